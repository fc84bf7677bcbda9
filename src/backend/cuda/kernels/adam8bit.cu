/* 8-bit AdamW with bitsandbytes semantics, backend.h's adam8bit_update (reference:
 * src/backend/cpu/adam8bit.c, which reproduces bnb's kOptimizerStatic8bit2StateBlockwise and
 * kOptimizer32bit2State).
 *
 * 8-bit path (n >= FL_ADAM8BIT_MIN_SIZE): one CUDA block of 256 threads per quantization block
 * of 256 elements (a block loops over several, grid-stride, so the two 256-entry code tables are
 * staged into shared memory once per CUDA block): each thread updates its element's m and v from
 * the dequantized codes, the block's new absmax values come from a max reduction (exact: max is
 * order-free, and a NaN is dropped as fmaxf does in the CPU's loop), then each thread updates its
 * parameter and re-quantizes with bnb's binary search over the code in shared memory. Every fp32
 * operation is the CPU's, in its order, with no contraction (fl_cu_mul_rn / fl_cu_add_rn), and the
 * host computes the step constants with the CPU's expressions: the same bits as the CPU backend.
 * One exception, after an overflow only: a NaN made by arithmetic (0 * an inf absmax) has its sign
 * bit set on x86 and clear on a GPU, and the sign fix-up of m's code reads that bit, so a block
 * whose state already holds inf can get other codes than on the CPU (both runs have diverged).
 * fp32 path (small tensors): elementwise, grid-stride, likewise. */
#include <float.h>
#include <math.h>
#include <string.h>

#define FL_CU_NEED_CODE_SIGNED 1
#define FL_CU_NEED_CODE_UNSIGNED 1
#include "backend/cuda/cu_compat.h"
#include "backend/cuda/cu_kernels_train.h"
#include "backend/cuda/cu_exact_dev.h"

typedef struct {
    float beta1, beta2, w1, w2, step_size, eps2, decay, grad_scale;
    int decay_on;
} fl_cu_a8_consts;

FL_CU_DEV float a8_load(const void *x, int t, size_t i) {
    return t == FL_F32    ? ((const float *)x)[i]
           : t == FL_BF16 ? fl_cu_bf16_to_f32(((const uint16_t *)x)[i])
                          : fl_cu_f16_to_f32(((const uint16_t *)x)[i]);
}
FL_CU_DEV float a8_round(float x, int t) {
    return t == FL_F32 ? x : t == FL_BF16 ? fl_cu_bf16_to_f32(fl_cu_f32_to_bf16(x)) : fl_cu_f16_to_f32(fl_cu_f32_to_f16(x));
}
FL_CU_DEV void a8_store(void *x, int t, size_t i, float v) {
    if (t == FL_F32) ((float *)x)[i] = v;
    else if (t == FL_BF16) ((uint16_t *)x)[i] = fl_cu_f32_to_bf16(v);
    else ((uint16_t *)x)[i] = fl_cu_f32_to_f16(v);
}

/* fl_adam8bit_quantize: bnb's quantize_2D search from pivot 127, then the midpoint test (the
 * same comparisons and selects; NaN ends at code 0). */
FL_CU_DEV int a8_quantize(const float *code, int is_signed, float x) {
    int pivot = 127, upper_pivot = 255, lower_pivot = 0;
    float lower = is_signed ? -1.0f : 0.0f, upper = 1.0f;
    float val = code[pivot];
    for (int i = 64; i > 0; i >>= 1) {
        int gt = x > val;
        lower_pivot = gt ? pivot : lower_pivot;
        lower = gt ? val : lower;
        upper_pivot = gt ? upper_pivot : pivot;
        upper = gt ? upper : val;
        pivot += gt ? i : -i;
        val = code[pivot];
    }
    int gt = x > val;
    float mid = fl_cu_mul_rn(fl_cu_add_rn(gt ? upper : lower, val), 0.5f);
    int up = x > mid, down = x < mid;
    return gt ? (up ? upper_pivot : pivot) : (down ? lower_pivot : pivot);
}

/* Max over a 256-thread block (every thread gets it); buf: 8 floats of shared memory, free again
 * on return. */
FL_CU_DEV float a8_block_max(float v, float *buf) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FL_CU_FULL_MASK, v, o));
    if ((threadIdx.x & 31) == 0) buf[threadIdx.x >> 5] = v;
    __syncthreads();
    float r = buf[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); w++) r = fmaxf(r, buf[w]);
    __syncthreads();
    return r;
}

/* floor_m / floor_v (device memory, may be NULL): FULL_SHARD's absmax floor per block (fitllm/adam8bit.h):
 * the block's new absmax is max(floor, the part's max); max is exact and order-free, so this is the
 * CPU's fmaxf chain started at the floor. */
__global__ static void fl_cu_adam8bit_k(void *p, int tp, const void *g, int tg, uint8_t *q_m, uint8_t *q_v,
                                        float *absmax_m, float *absmax_v, const float *floor_m, const float *floor_v,
                                        size_t n, size_t nb, fl_cu_a8_consts k, const fl_cu_a8_consts *kd,
                                        const double *ss) {
    __shared__ float cs[256], cu[256], red[16];
    const int tid = threadIdx.x;
    if (kd) k = *kd; /* a CUDA graph's per-step slot (adam8bit_consts' bytes) */
    if (ss) { /* the step scalars' gradient scale (NaN: the step's update is skipped, nothing changes) */
        const double s = ss[1];
        if (s != s) return;
        k.grad_scale = (float)s;
    }
    cs[tid] = fl_cu_code_signed[tid];
    cu[tid] = fl_cu_code_unsigned[tid];
    __syncthreads();
    for (size_t b = blockIdx.x; b < nb; b += gridDim.x) {
        size_t i = b * FL_ADAM8BIT_BLOCK + (size_t)tid;
        int in = i < n, ok = 0;
        float s1 = 0.0f, s2 = 0.0f;
        const float am = absmax_m[b], av = absmax_v[b];
        if (in) {
            float graw = a8_load(g, tg, i);
            ok = fl_cu_isfinite(graw);
            if (ok) {
                float gv = fl_cu_mul_rn(graw, k.grad_scale);
                float v2 = fl_cu_mul_rn(cu[q_v[i]], av);
                s2 = fl_cu_add_rn(fl_cu_mul_rn(v2, k.beta2), fl_cu_mul_rn(fl_cu_mul_rn(k.w2, gv), gv));
                float v1 = fl_cu_mul_rn(cs[q_m[i]], am);
                s1 = fl_cu_add_rn(fl_cu_mul_rn(v1, k.beta1), fl_cu_mul_rn(k.w1, gv));
            }
        }
        /* the CPU's nm = fmaxf(nm, |s|) from -FLT_MAX: a NaN |s| leaves it unchanged */
        float nm1 = a8_block_max(in ? fmaxf(-FLT_MAX, fabsf(s1)) : -FLT_MAX, red);
        float nm2 = a8_block_max(in ? fmaxf(-FLT_MAX, fabsf(s2)) : -FLT_MAX, red + 8);
        if (floor_m) nm1 = fmaxf(floor_m[b], nm1);
        if (floor_v) nm2 = fmaxf(floor_v[b], nm2);
        if (tid == 0) { /* every thread read am, av before the reductions' barriers */
            absmax_m[b] = nm1;
            absmax_v[b] = nm2;
        }
        if (!in) continue;
        if (ok) {
            float upd = fl_cu_mul_rn(k.step_size, s1 / fl_cu_add_rn(sqrtf(s2), k.eps2));
            float pi = a8_round(fl_cu_add_rn(a8_load(p, tp, i), upd), tp);
            if (k.decay_on) pi = fl_cu_mul_rn(pi, k.decay);
            a8_store(p, tp, i, pi);
        }
        int c1 = a8_quantize(cs, 1, s1 / nm1), c2 = a8_quantize(cu, 0, s2 / nm2);
        /* keep the sign of m (the kernel's fix-up; wraps like unsigned char) */
        if ((!fl_cu_signbit(cs[c1])) != (!fl_cu_signbit(s1))) c1 = s1 > 0.0f ? c1 + 1 : c1 - 1;
        q_m[i] = (uint8_t)c1;
        q_v[i] = (uint8_t)c2;
    }
}

__global__ static void fl_cu_adam32_k(void *p, int tp, const void *g, int tg, float *m, float *v, size_t n,
                                      fl_cu_a8_consts k, const fl_cu_a8_consts *kd, const double *ss) {
    if (kd) k = *kd;
    if (ss) {
        const double s = ss[1];
        if (s != s) return;
        k.grad_scale = (float)s;
    }
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float gi = a8_round(fl_cu_mul_rn(k.grad_scale, a8_load(g, tg, i)), tg);
        float s1 = fl_cu_add_rn(fl_cu_mul_rn(m[i], k.beta1), fl_cu_mul_rn(k.w1, gi));
        float s2 = fl_cu_add_rn(fl_cu_mul_rn(v[i], k.beta2), fl_cu_mul_rn(k.w2, fl_cu_mul_rn(gi, gi)));
        float upd = fl_cu_mul_rn(k.step_size, s1 / fl_cu_add_rn(sqrtf(s2), k.eps2));
        float pi = a8_round(fl_cu_add_rn(a8_load(p, tp, i), upd), tp);
        if (k.decay_on) pi = fl_cu_mul_rn(pi, k.decay);
        a8_store(p, tp, i, pi);
        m[i] = s1;
        v[i] = s2;
    }
}

__global__ static void fl_cu_a8_codes_k(float *out) {
    int t = threadIdx.x;
    out[t] = fl_cu_code_signed[t];
    out[256 + t] = fl_cu_code_unsigned[t];
}

/* One rounding per operation on the host too: a volatile result keeps the host compiler from
 * contracting the CPU backend's `1.0f - lr * weight_decay` (compiled without contraction) into
 * an FMA. */
static float host_mul(float a, float b) {
    volatile float r = a * b;
    return r;
}

/* the CPU backend's constants, the same expressions (powf, sqrtf of the host's libm) */
static fl_cu_a8_consts a8_consts(float lr, float beta1, float beta2, float eps, float weight_decay, int step,
                                 float grad_scale) {
    fl_cu_a8_consts k;
    memset(&k, 0, sizeof k); /* (its bytes go into a CUDA graph's slot) */
    const float correction1 = 1.0f - powf(beta1, (float)step);
    const float correction2 = sqrtf(1.0f - powf(beta2, (float)step));
    k.step_size = host_mul(-lr, correction2) / correction1;
    k.w1 = 1.0f - beta1;
    k.w2 = 1.0f - beta2;
    k.decay = 1.0f - host_mul(lr, weight_decay);
    k.eps2 = host_mul(correction2, eps);
    k.beta1 = beta1;
    k.beta2 = beta2;
    k.grad_scale = grad_scale;
    k.decay_on = weight_decay > 0.0f;
    return k;
}

/* ss (device, or NULL: k.grad_scale): the gradient scale read when the kernel runs (the step scalars' ss[1]);
 * kd (device, or NULL: k): the constants read when the kernel runs (a CUDA graph's per-step slot) */
static int a8_launch(void *p, fl_dtype tp, const void *g, fl_dtype tg, const fl_adam8bit_state *st,
                     const fl_cu_a8_consts *k, const fl_cu_a8_consts *kd, const double *ss, void *stream) {
    if (!fl_adam8bit_dtype_ok(tp) || !fl_adam8bit_dtype_ok(tg) || !st || !k) return -1;
    /* the constants by value: the emulator's launch captures its arguments' expressions, evaluated when the kernel runs
     * (a captured graph's replay, after the caller's k has gone out of scope: ASan's stack-use-after-scope) */
    const fl_cu_a8_consts kv = *k;
    const size_t n = st->n;
    if (n == 0) return 0;
    if (!p || !g) return -1;
    if (!st->q_m) { /* the fp32 path (FULL_SHARD's floor is for 8-bit blocks: none here), as the CPU's: a small tensor, or a piece of one (ZeRO's pieces of a large
                     * tensor can be shorter than the 8-bit threshold and stay 8-bit: the state says which) */
        if (!st->m || !st->v) return -1;
        size_t blocks = (n + 255) / 256;
        FL_CU_LAUNCH(fl_cu_adam32_k, dim3((unsigned)blocks), dim3(256), 0, (fl_cu_stream)stream, p, (int)tp, g,
                     (int)tg, st->m, st->v, n, kv, kd, ss);
        return fl_cu_launch_error();
    }
    if (!st->q_m || !st->q_v || !st->absmax_m || !st->absmax_v ||
        st->n_blocks != (n + FL_ADAM8BIT_BLOCK - 1) / FL_ADAM8BIT_BLOCK)
        return -1;
    /* up to 16 quantization blocks per CUDA block on large tensors (the tables' staging amortized),
     * at least ~2000 CUDA blocks in flight for 132 SMs */
    size_t grid = st->n_blocks < 2048 ? st->n_blocks : 2048;
    if (st->n_blocks / grid > 16) grid = (st->n_blocks + 15) / 16;
    FL_CU_LAUNCH(fl_cu_adam8bit_k, dim3((unsigned)grid), dim3(256), 0, (fl_cu_stream)stream, p, (int)tp, g, (int)tg,
                 st->q_m, st->q_v, st->absmax_m, st->absmax_v, st->floor_m, st->floor_v, n, st->n_blocks, kv, kd,
                 ss);
    return fl_cu_launch_error();
}

static int a8_update(void *p, fl_dtype tp, const void *g, fl_dtype tg, const fl_adam8bit_state *st, float lr,
                     float beta1, float beta2, float eps, float weight_decay, int step, float grad_scale,
                     const double *ss, void *stream) {
    if (step < 1) return -1;
    const fl_cu_a8_consts k = a8_consts(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
    return a8_launch(p, tp, g, tg, st, &k, NULL, ss, stream);
}

extern "C" int FL_CUK(adam8bit_update)(void *p, fl_dtype tp, const void *g, fl_dtype tg, const fl_adam8bit_state *st,
                                       float lr, float beta1, float beta2, float eps, float weight_decay, int step,
                                       float grad_scale, void *stream) {
    return a8_update(p, tp, g, tg, st, lr, beta1, beta2, eps, weight_decay, step, grad_scale, NULL, stream);
}
extern "C" int FL_CUK(adam8bit_update_ss)(void *p, fl_dtype tp, const void *g, fl_dtype tg,
                                          const fl_adam8bit_state *st, float lr, float beta1, float beta2, float eps,
                                          float weight_decay, int step, const double *ss, void *stream) {
    return ss ? a8_update(p, tp, g, tg, st, lr, beta1, beta2, eps, weight_decay, step, 1.0f, ss, stream) : -1;
}

extern "C" size_t FL_CUK(adam8bit_consts)(void *out, float lr, float beta1, float beta2, float eps,
                                          float weight_decay, int step) {
    const fl_cu_a8_consts k = a8_consts(lr, beta1, beta2, eps, weight_decay, step < 1 ? 1 : step, 1.0f);
    if (out) memcpy(out, &k, sizeof k);
    return sizeof k;
}
extern "C" int FL_CUK(adam8bit_update_dss)(void *p, fl_dtype tp, const void *g, fl_dtype tg,
                                           const fl_adam8bit_state *st, const void *consts, const double *ss,
                                           void *stream) {
    if (!consts || !ss) return -1;
    const fl_cu_a8_consts k = a8_consts(0.0f, 0.9f, 0.999f, 1e-8f, 0.0f, 1, 1.0f); /* (replaced by *consts) */
    return a8_launch(p, tp, g, tg, st, &k, (const fl_cu_a8_consts *)consts, ss, stream);
}

extern "C" int FL_CUK(adam8bit_codes)(float *out, void *stream) {
    FL_CU_LAUNCH(fl_cu_a8_codes_k, dim3(1), dim3(256), 0, (fl_cu_stream)stream, out);
    return fl_cu_launch_error();
}

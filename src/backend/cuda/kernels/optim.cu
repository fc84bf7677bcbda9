/* AdamW (fp32 and 16-bit storage) and dtype conversion, semantics of backend.h's adamw_update,
 * adamw_update_ex and convert: elementwise, grid-stride loops, the constants computed on the
 * host exactly as the CPU backend computes them (bias corrections in double), the same fp32
 * operation order per element. The GPU may contract a*b+c into an FMA (nvcc's default), so its
 * bits can differ from the CPU's by an ulp; the op tests compare against float64 references. */
#include <math.h>
#include <string.h>

#include "backend/cuda/cu_compat.h"
#include "backend/cuda/cu_kernels.h"

FL_CU_DEV float fl_cu_load(const void *p, int t, size_t i) {
    if (t == FL_F32) return ((const float *)p)[i];
    if (t == FL_BF16) return fl_cu_bf16_to_f32(((const uint16_t *)p)[i]);
    return fl_cu_f16_to_f32(((const uint16_t *)p)[i]);
}
FL_CU_DEV void fl_cu_store(void *p, int t, size_t i, float v) {
    if (t == FL_F32) ((float *)p)[i] = v;
    else if (t == FL_BF16) ((uint16_t *)p)[i] = fl_cu_f32_to_bf16(v);
    else ((uint16_t *)p)[i] = fl_cu_f32_to_f16(v);
}

typedef struct {
    float step_size, bc2_sqrt, decay, w1, w2, beta2, eps, grad_scale;
} fl_cu_adamw_k;

static fl_cu_adamw_k adamw_consts(float lr, float beta1, float beta2, float eps, float weight_decay, int step,
                                  float grad_scale) {
    double bc1 = 1.0 - pow((double)beta1, step), bc2 = 1.0 - pow((double)beta2, step);
    fl_cu_adamw_k k;
    k.step_size = (float)(lr / bc1);
    k.bc2_sqrt = (float)sqrt(bc2);
    k.decay = 1.0f - lr * weight_decay;
    k.w1 = 1.0f - beta1;
    k.w2 = 1.0f - beta2;
    k.beta2 = beta2;
    k.eps = eps;
    k.grad_scale = grad_scale;
    return k;
}

/* one element: p0, m0, v0 in, the new values out */
FL_CU_DEV void adamw_val(float g, float *p0, float *m0, float *v0, const fl_cu_adamw_k &k) {
    float gi = g * k.grad_scale;
    float pi = *p0 * k.decay;
    float mi = *m0 + k.w1 * (gi - *m0);
    float vi = k.beta2 * *v0 + k.w2 * gi * gi;
    float denom = sqrtf(vi) / k.bc2_sqrt + k.eps;
    *p0 = pi - k.step_size * (mi / denom);
    *m0 = mi;
    *v0 = vi;
}
FL_CU_DEV void adamw_one(void *p, int tp, void *m, void *v, int ts, size_t i, float g, float p0, float m0, float v0,
                         const fl_cu_adamw_k &k) {
    adamw_val(g, &p0, &m0, &v0, k);
    fl_cu_store(p, tp, i, p0);
    fl_cu_store(m, ts, i, m0);
    fl_cu_store(v, ts, i, v0);
}

/* Elementwise; a thread loads four elements (one grid stride apart) before computing any, so that
 * enough loads are in flight to stream at memory speed (one element per iteration left an H100's
 * bf16-true AdamW at a third of its bandwidth). The same operations per element either way.
 * vec (every pointer 16-byte aligned): 8 consecutive elements per thread with 128-bit accesses (one per 16-bit
 * array, two per fp32 one), then the tail (< 8) as below. */
FL_CU_DEV void adamw_body(void *p, int tp, const void *g, int tg, void *m, void *v, int ts, size_t n,
                          const fl_cu_adamw_k &k, int vec) {
    const size_t S = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec) {
        for (size_t q = i; q < n / 8; q += S) {
            float gv[8], pv[8], mv[8], vv[8];
            fl_cu_ld8t(g, tg, 8 * q, gv);
            fl_cu_ld8t(p, tp, 8 * q, pv);
            fl_cu_ld8t(m, ts, 8 * q, mv);
            fl_cu_ld8t(v, ts, 8 * q, vv);
            for (int u = 0; u < 8; u++) adamw_val(gv[u], &pv[u], &mv[u], &vv[u], k);
            fl_cu_st8t(p, tp, 8 * q, pv);
            fl_cu_st8t(m, ts, 8 * q, mv);
            fl_cu_st8t(v, ts, 8 * q, vv);
        }
        i += n / 8 * 8;
    }
    for (; i + 3 * S < n; i += 4 * S) {
        float gv[4], pv[4], mv[4], vv[4];
        for (int u = 0; u < 4; u++) {
            size_t j = i + (size_t)u * S;
            gv[u] = fl_cu_load(g, tg, j);
            pv[u] = fl_cu_load(p, tp, j);
            mv[u] = fl_cu_load(m, ts, j);
            vv[u] = fl_cu_load(v, ts, j);
        }
        for (int u = 0; u < 4; u++) adamw_one(p, tp, m, v, ts, i + (size_t)u * S, gv[u], pv[u], mv[u], vv[u], k);
    }
    for (; i < n; i += S)
        adamw_one(p, tp, m, v, ts, i, fl_cu_load(g, tg, i), fl_cu_load(p, tp, i), fl_cu_load(m, ts, i),
                  fl_cu_load(v, ts, i), k);
}
__global__ static void fl_cu_adamw_k_(void *p, int tp, const void *g, int tg, void *m, void *v, int ts, size_t n,
                               fl_cu_adamw_k k, int vec) {
    adamw_body(p, tp, g, tg, m, v, ts, n, k, vec);
}
/* the constants read from device memory (a CUDA graph's update: written there before each replay) */
__global__ static void fl_cu_adamw_kd_(void *p, int tp, const void *g, int tg, void *m, void *v, int ts, size_t n,
                                       const fl_cu_adamw_k *kd, int vec) {
    const fl_cu_adamw_k k = *kd;
    adamw_body(p, tp, g, tg, m, v, ts, n, k, vec);
}

/* vec: groups of 8 with 128-bit accesses (returns the first element of the tail: n rounded down to 8) */
FL_CU_DEV size_t convert8(void *dst, int dt, const void *src, int st, size_t n, size_t t0, size_t S) {
    for (size_t q = t0; q < n / 8; q += S) {
        float x[8];
        fl_cu_ld8t(src, st, 8 * q, x);
        fl_cu_st8t(dst, dt, 8 * q, x);
    }
    return n / 8 * 8;
}
/* four loads in flight per thread, as AdamW; vec (both pointers 16-byte aligned): convert8, then the tail */
__global__ static void fl_cu_convert_k(void *dst, int dt, const void *src, int st, size_t n, int vec) {
    const size_t S = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec) i += convert8(dst, dt, src, st, n, i, S);
    for (; i + 3 * S < n; i += 4 * S) {
        float x0 = fl_cu_load(src, st, i), x1 = fl_cu_load(src, st, i + S), x2 = fl_cu_load(src, st, i + 2 * S),
              x3 = fl_cu_load(src, st, i + 3 * S);
        fl_cu_store(dst, dt, i, x0);
        fl_cu_store(dst, dt, i + S, x1);
        fl_cu_store(dst, dt, i + 2 * S, x2);
        fl_cu_store(dst, dt, i + 3 * S, x3);
    }
    for (; i < n; i += S) fl_cu_store(dst, dt, i, fl_cu_load(src, st, i));
}

/* Grid for an elementwise op: 256 threads per block, at most 1024 blocks (grid-stride beyond). */
static unsigned ew_blocks(size_t n) {
    size_t b = (n + 255) / 256;
    return (unsigned)(b > 1024 ? 1024 : b);
}
static int float_type(fl_dtype t) { return t == FL_F32 || t == FL_BF16 || t == FL_F16; }

extern "C" int FL_CUK(adamw_update_ex)(void *p, fl_dtype tp, const void *g, fl_dtype tg, void *m, void *v, fl_dtype ts,
                                       size_t n, float lr, float beta1, float beta2, float eps, float weight_decay,
                                       int step, float grad_scale, void *stream) {
    if (!float_type(tp) || !float_type(tg) || (ts != FL_F32 && ts != FL_BF16) || step < 1) return -1;
    if (n == 0) return 0;
    fl_cu_adamw_k k = adamw_consts(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
    const int vec = fl_cu_aligned16(p, g, m, v, NULL);
    FL_CU_LAUNCH(fl_cu_adamw_k_, dim3(ew_blocks(vec ? (n + 7) / 8 : n)), dim3(256), 0, (fl_cu_stream)stream, p, (int)tp,
                 g, (int)tg, m, v, (int)ts, n, k, vec);
    return fl_cu_launch_error();
}

extern "C" size_t FL_CUK(adamw_consts)(void *out, float lr, float beta1, float beta2, float eps, float weight_decay,
                                       int step, float grad_scale) {
    fl_cu_adamw_k k = adamw_consts(lr, beta1, beta2, eps, weight_decay, step < 1 ? 1 : step, grad_scale);
    if (out) memcpy(out, &k, sizeof k);
    return sizeof k;
}

extern "C" int FL_CUK(adamw_update_dev)(void *p, fl_dtype tp, const void *g, fl_dtype tg, void *m, void *v,
                                        fl_dtype ts, size_t n, const void *consts, void *stream) {
    if (!float_type(tp) || !float_type(tg) || (ts != FL_F32 && ts != FL_BF16)) return -1;
    if (n == 0) return 0;
    const int vec = fl_cu_aligned16(p, g, m, v, NULL);
    FL_CU_LAUNCH(fl_cu_adamw_kd_, dim3(ew_blocks(vec ? (n + 7) / 8 : n)), dim3(256), 0, (fl_cu_stream)stream, p, (int)tp,
                 g, (int)tg, m, v, (int)ts, n, (const fl_cu_adamw_k *)consts, vec);
    return fl_cu_launch_error();
}

/* grad_scale from the step scalars (ss[1]) when it runs: NaN = the step's norm was not finite, nothing changes */
__global__ static void fl_cu_adamw_ks_(void *p, int tp, const void *g, int tg, void *m, void *v, int ts, size_t n,
                                       fl_cu_adamw_k k, const double *ss, int vec) {
    const double s = ss[1];
    if (s != s) return;
    k.grad_scale = (float)s;
    adamw_body(p, tp, g, tg, m, v, ts, n, k, vec);
}

/* both from device memory: the constants from a CUDA graph's slot, grad_scale from the step scalars */
__global__ static void fl_cu_adamw_kds_(void *p, int tp, const void *g, int tg, void *m, void *v, int ts, size_t n,
                                        const fl_cu_adamw_k *kd, const double *ss, int vec) {
    const double s = ss[1];
    if (s != s) return;
    fl_cu_adamw_k k = *kd;
    k.grad_scale = (float)s;
    adamw_body(p, tp, g, tg, m, v, ts, n, k, vec);
}

extern "C" int FL_CUK(adamw_update_dss)(void *p, fl_dtype tp, const void *g, fl_dtype tg, void *m, void *v,
                                        fl_dtype ts, size_t n, const void *consts, const double *ss, void *stream) {
    if (!float_type(tp) || !float_type(tg) || (ts != FL_F32 && ts != FL_BF16)) return -1;
    if (n == 0) return 0;
    const int vec = fl_cu_aligned16(p, g, m, v, NULL);
    FL_CU_LAUNCH(fl_cu_adamw_kds_, dim3(ew_blocks(vec ? (n + 7) / 8 : n)), dim3(256), 0, (fl_cu_stream)stream, p,
                 (int)tp, g, (int)tg, m, v, (int)ts, n, (const fl_cu_adamw_k *)consts, ss, vec);
    return fl_cu_launch_error();
}

extern "C" int FL_CUK(adamw_update_ss)(void *p, fl_dtype tp, const void *g, fl_dtype tg, void *m, void *v, fl_dtype ts,
                                       size_t n, float lr, float beta1, float beta2, float eps, float weight_decay,
                                       int step, const double *ss, void *stream) {
    if (!float_type(tp) || !float_type(tg) || (ts != FL_F32 && ts != FL_BF16) || step < 1) return -1;
    if (n == 0) return 0;
    fl_cu_adamw_k k = adamw_consts(lr, beta1, beta2, eps, weight_decay, step, 1.0f);
    const int vec = fl_cu_aligned16(p, g, m, v, NULL);
    FL_CU_LAUNCH(fl_cu_adamw_ks_, dim3(ew_blocks(vec ? (n + 7) / 8 : n)), dim3(256), 0, (fl_cu_stream)stream, p, (int)tp,
                 g, (int)tg, m, v, (int)ts, n, k, ss, vec);
    return fl_cu_launch_error();
}

extern "C" int FL_CUK(adamw_update)(float *p, const float *g, float *m, float *v, size_t n, float lr, float beta1,
                                    float beta2, float eps, float weight_decay, int step, float grad_scale,
                                    void *stream) {
    return FL_CUK(adamw_update_ex)(p, FL_F32, g, FL_F32, m, v, FL_F32, n, lr, beta1, beta2, eps, weight_decay, step,
                                   grad_scale, stream);
}

/* Store in 16 bits and keep the fp32 view equal: dst = round(x), x = widen(dst), in one pass (the
 * graph's narrow + widen pair of a stored slot: one read and two writes instead of two launches). */
__global__ static void fl_cu_round16_k(uint16_t *dst, int dt, float *x, size_t n, int vec) {
    const size_t S = (size_t)gridDim.x * blockDim.x;
    size_t i0 = 0;
    if (vec) { /* groups of 8, 128-bit accesses; the tail below */
        for (size_t q = (size_t)blockIdx.x * blockDim.x + threadIdx.x; q < n / 8; q += S) {
            float v[8];
            fl_cu_ld8t(x, FL_F32, 8 * q, v);
            fl_cu_st8t(dst, dt, 8 * q, v);
            fl_cu_ld8t(dst, dt, 8 * q, v);
            fl_cu_st8t(x, FL_F32, 8 * q, v);
        }
        i0 = n / 8 * 8;
    }
    for (size_t i = i0 + (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += S) {
        fl_cu_store(dst, dt, i, x[i]);
        x[i] = fl_cu_load(dst, dt, i);
    }
}

extern "C" int FL_CUK(round16)(void *dst, fl_dtype dt, float *x, size_t n, void *stream) {
    if (dt != FL_BF16 && dt != FL_F16) return -1;
    if (n == 0) return 0;
#if FL_CU_EMULATED
    fl_cu_emu_convert_launches++; /* a conversion kernel: counted with convert */
#endif
    const int vec = fl_cu_aligned16(dst, x, NULL, NULL, NULL);
    FL_CU_LAUNCH(fl_cu_round16_k, dim3(ew_blocks(vec ? (n + 7) / 8 : n)), dim3(256), 0, (fl_cu_stream)stream,
                 (uint16_t *)dst, (int)dt, x, n, vec);
    return fl_cu_launch_error();
}

/* convert_many: segment blockIdx.y of the list (passed by value: no device copy of the list), each element
 * as convert's (the same load and store: the same bits) */
typedef struct {
    void *dst[FL_CU_CONVERT_MANY_MAX];
    const void *src[FL_CU_CONVERT_MANY_MAX];
    size_t n[FL_CU_CONVERT_MANY_MAX];
} fl_cu_segs;
__global__ static void fl_cu_convert_many_k(fl_cu_segs s, int dt, int st) {
    const size_t S = (size_t)gridDim.x * blockDim.x, n = s.n[blockIdx.y];
    void *dst = s.dst[blockIdx.y];
    const void *src = s.src[blockIdx.y];
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if ((((uintptr_t)dst | (uintptr_t)src) & 15u) == 0) i += convert8(dst, dt, src, st, n, i, S); /* this segment */
    for (; i < n; i += S)
        fl_cu_store(dst, dt, i, fl_cu_load(src, st, i));
}

extern "C" int FL_CUK(convert_many)(int count, void *const *dst, fl_dtype dt, const void *const *src, fl_dtype st,
                                    const size_t *n, void *stream) {
    if (!float_type(dt) || !float_type(st) || count < 0 || count > FL_CU_CONVERT_MANY_MAX) return -1;
    fl_cu_segs s;
    memset(&s, 0, sizeof s);
    size_t most = 0;
    int vec = 1; /* every segment on the 8-element path: a thread takes 8 at a time, 1/8 of the blocks */
    for (int k = 0; k < count; k++) {
        s.dst[k] = dst[k], s.src[k] = src[k], s.n[k] = n[k];
        if (n[k] > most) most = n[k];
        vec &= fl_cu_aligned16(dst[k], src[k], NULL, NULL, NULL);
    }
    if (most == 0) return 0;
#if FL_CU_EMULATED
    fl_cu_emu_convert_launches++; /* one conversion kernel for the whole list */
#endif
    FL_CU_LAUNCH(fl_cu_convert_many_k, dim3(ew_blocks(vec ? (most + 7) / 8 : most), (unsigned)count), dim3(256), 0,
                 (fl_cu_stream)stream, s, (int)dt, (int)st);
    return fl_cu_launch_error();
}

extern "C" int FL_CUK(convert)(void *dst, fl_dtype dt, const void *src, fl_dtype st, size_t n, void *stream) {
    if (!float_type(dt) || !float_type(st)) return -1;
    if (n == 0) return 0;
#if FL_CU_EMULATED
    fl_cu_emu_convert_launches++;
#endif
    const int vec = fl_cu_aligned16(dst, src, NULL, NULL, NULL);
    FL_CU_LAUNCH(fl_cu_convert_k, dim3(ew_blocks(vec ? (n + 7) / 8 : n)), dim3(256), 0, (fl_cu_stream)stream, dst,
                 (int)dt, src, (int)st, n, vec);
    return fl_cu_launch_error();
}

/* 8-bit AdamW (bitsandbytes block-wise semantics) on the CPU: the vectorized quantizer and the
 * update (the state layout, the code tables and the scalar quantizer: core/adam8bit.c).
 *
 * Reproduces bitsandbytes' CUDA kernels for Adam/AdamW (bnb.optim.Adam8bit/AdamW8bit on a GPU):
 *   - n >= FL_ADAM8BIT_MIN_SIZE: kOptimizerStatic8bit2StateBlockwise<T, ADAM, 256, 1>
 *     (csrc/cuda/optimizers.cu; csrc/kernels.cu in older trees);
 *   - n <  FL_ADAM8BIT_MIN_SIZE: kOptimizer32bit2State<T, ADAM> (fp32 m, v).
 * Every operation is float32 in the kernel's order; this file is compiled with
 * -ffp-contract=off (CMakeLists.txt) so no multiply-add is fused, which is what the Python
 * reference (tests/ref/adam8bit_ref.py, numpy float32) computes. Differences from the GPU that
 * remain: the GPU's __powf/__fdividef/__fdividef approximations (we use powf and exact
 * division), which can move a value across a quantization midpoint (rare code ties).
 */
#include <math.h>
#include <omp.h>

#include "backend/cpu/cpu-impl.h"
#include "fitllm/cpu.h"


/* Vector quantizers: N lanes of fl_adam8bit_quantize at once, the same comparisons and
 * selects per lane (so the same codes; NaN compares false everywhere and ends at code 0 as in
 * the scalar code), with the search's dependent loads as gathers, which turns a latency-bound
 * chain per element into one per 8 or 16 elements. Chosen at run time (fl_cpu_level): the
 * AVX-512 variant on AVX-512 CPUs, AVX2 on AVX2 CPUs, the scalar loop otherwise. The only
 * arithmetic is mid = (a + b) * 0.5f, an add then a multiply as in the scalar code (this file is
 * compiled with -ffp-contract=off and the variants do not enable FMA). */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FL_Q8_X86 1

__attribute__((target("avx2"))) static void quantize8_avx2(const float *code, int is_signed, const float *x,
                                                             uint8_t *out) {
    __m256 vx = _mm256_loadu_ps(x);
    __m256i pivot = _mm256_set1_epi32(127), up_p = _mm256_set1_epi32(255), lo_p = _mm256_setzero_si256();
    __m256 lower = _mm256_set1_ps(is_signed ? -1.0f : 0.0f), upper = _mm256_set1_ps(1.0f);
    __m256 val = _mm256_i32gather_ps(code, pivot, 4);
    for (int i = 64; i > 0; i >>= 1) {
        __m256 gt = _mm256_cmp_ps(vx, val, _CMP_GT_OQ);
        __m256i gti = _mm256_castps_si256(gt);
        lo_p = _mm256_blendv_epi8(lo_p, pivot, gti);
        lower = _mm256_blendv_ps(lower, val, gt);
        up_p = _mm256_blendv_epi8(pivot, up_p, gti);
        upper = _mm256_blendv_ps(val, upper, gt);
        /* gt ? pivot + i : pivot - i  ==  pivot - i + (gt & 2i) */
        pivot = _mm256_add_epi32(_mm256_sub_epi32(pivot, _mm256_set1_epi32(i)),
                                 _mm256_and_si256(gti, _mm256_set1_epi32(2 * i)));
        val = _mm256_i32gather_ps(code, pivot, 4);
    }
    __m256 gt = _mm256_cmp_ps(vx, val, _CMP_GT_OQ);
    __m256i gti = _mm256_castps_si256(gt);
    __m256 mid = _mm256_mul_ps(_mm256_add_ps(_mm256_blendv_ps(lower, upper, gt), val), _mm256_set1_ps(0.5f));
    __m256i up = _mm256_castps_si256(_mm256_cmp_ps(vx, mid, _CMP_GT_OQ));
    __m256i down = _mm256_castps_si256(_mm256_cmp_ps(vx, mid, _CMP_LT_OQ));
    /* gt: up ? upper_pivot : pivot;  !gt: down ? lower_pivot : pivot */
    __m256i r = _mm256_blendv_epi8(pivot, up_p, _mm256_and_si256(gti, up));
    r = _mm256_blendv_epi8(r, lo_p, _mm256_andnot_si256(gti, down));
    /* the low byte of each 32-bit lane -> 8 bytes */
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1,
                                          -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i b = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(r, pick), _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    _mm_storel_epi64((__m128i *)out, _mm256_castsi256_si128(b));
}

__attribute__((target("avx512f"))) static void quantize16_avx512(const float *code, int is_signed, const float *x,
                                                                   uint8_t *out) {
    __m512 vx = _mm512_loadu_ps(x);
    __m512i pivot = _mm512_set1_epi32(127), up_p = _mm512_set1_epi32(255), lo_p = _mm512_setzero_si512();
    __m512 lower = _mm512_set1_ps(is_signed ? -1.0f : 0.0f), upper = _mm512_set1_ps(1.0f);
    __m512 val = _mm512_i32gather_ps(pivot, code, 4);
    for (int i = 64; i > 0; i >>= 1) {
        __mmask16 gt = _mm512_cmp_ps_mask(vx, val, _CMP_GT_OQ);
        lo_p = _mm512_mask_mov_epi32(lo_p, gt, pivot);
        lower = _mm512_mask_mov_ps(lower, gt, val);
        up_p = _mm512_mask_mov_epi32(pivot, gt, up_p);
        upper = _mm512_mask_mov_ps(val, gt, upper);
        __m512i step = _mm512_set1_epi32(i);
        pivot = _mm512_mask_add_epi32(_mm512_sub_epi32(pivot, step), gt, pivot, step);
        val = _mm512_i32gather_ps(pivot, code, 4);
    }
    __mmask16 gt = _mm512_cmp_ps_mask(vx, val, _CMP_GT_OQ);
    __m512 mid = _mm512_mul_ps(_mm512_add_ps(_mm512_mask_mov_ps(lower, gt, upper), val), _mm512_set1_ps(0.5f));
    __mmask16 up = _mm512_cmp_ps_mask(vx, mid, _CMP_GT_OQ), down = _mm512_cmp_ps_mask(vx, mid, _CMP_LT_OQ);
    /* gt: up ? upper_pivot : pivot;  !gt: down ? lower_pivot : pivot */
    __m512i r = _mm512_mask_mov_epi32(pivot, gt & up, up_p);
    r = _mm512_mask_mov_epi32(r, (__mmask16)(~gt) & down, lo_p);
    _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(r));
}
#endif

/* codes for x[0..n) */
void fl_adam8bit_quantize_n(const float *code, int is_signed, const float *x, int n, uint8_t *out) {
    int j = 0;
#if defined(FL_Q8_X86)
    fl_cpu_level_t l = fl_cpu_level();
    if (l >= FL_CPU_AVX512)
        for (; j + 16 <= n; j += 16) quantize16_avx512(code, is_signed, x + j, out + j);
    else if (l >= FL_CPU_AVX2)
        for (; j + 8 <= n; j += 8) quantize8_avx2(code, is_signed, x + j, out + j);
#endif
    for (; j < n; j++) out[j] = fl_adam8bit_quantize(code, is_signed, x[j]);
}

const char *fl_cpu_adam8bit_quantizer_path(void) {
#if defined(FL_Q8_X86)
    fl_cpu_level_t l = fl_cpu_level();
    if (l >= FL_CPU_AVX512) return "avx512-gather";
    if (l >= FL_CPU_AVX2) return "avx2-gather";
#endif
    return "scalar";
}

static inline float load_f(const void *x, fl_dtype t, size_t i) {
    return t == FL_F32    ? ((const float *)x)[i]
           : t == FL_BF16 ? fl_bf16_to_f32(((const uint16_t *)x)[i])
                          : fl_f16_to_f32(((const uint16_t *)x)[i]);
}
/* (T)(x): the kernel's store into the parameter type. */
static inline float round_to(float x, fl_dtype t) {
    return t == FL_F32 ? x : t == FL_BF16 ? fl_bf16_to_f32(fl_f32_to_bf16(x)) : fl_f16_to_f32(fl_f32_to_f16(x));
}
static inline void store_f(void *x, fl_dtype t, size_t i, float v) {
    if (t == FL_F32)
        ((float *)x)[i] = v;
    else if (t == FL_BF16)
        ((uint16_t *)x)[i] = fl_f32_to_bf16(v);
    else
        ((uint16_t *)x)[i] = fl_f32_to_f16(v);
}

fl_status fl_cpu_adam8bit_update(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg,
                                 const fl_adam8bit_state *st, float lr, float beta1, float beta2, float eps,
                                 float weight_decay, int step, float grad_scale) {
    if (!fl_adam8bit_dtype_ok(tp) || !fl_adam8bit_dtype_ok(tg))
        return fl_errorf(FL_ERR_UNSUPPORTED, "adam8bit_update: p=%s g=%s (F32, BF16 or F16 only)", fl_dtype_name(tp),
                         fl_dtype_name(tg));
    if (!st) return fl_errorf(FL_ERR_INVALID, "adam8bit_update: NULL state");
    size_t n = st->n;
    if (n == 0) return FL_OK;
    if (!p || !g || step < 1) return fl_errorf(FL_ERR_INVALID, "adam8bit_update: p=%p g=%p step=%d", p, (void *)g, step);
    int nt = be && be->n_threads > 0 ? be->n_threads : 1;
    const float correction1 = 1.0f - powf(beta1, (float)step);
    const float correction2 = sqrtf(1.0f - powf(beta2, (float)step));
    const float step_size = (-lr * correction2) / correction1;
    const float w1 = 1.0f - beta1, w2 = 1.0f - beta2, decay = 1.0f - lr * weight_decay;
    const float eps2 = correction2 * eps;

    if (!st->q_m) { /* the fp32 path: a small tensor (or a piece of one) */
        if (!st->m || !st->v) return fl_errorf(FL_ERR_INVALID, "adam8bit_update: fp32 path (n=%zu) without m/v", n);
        float *m = st->m, *v = st->v;
        /* kOptimizer32bit2State, ADAM: g_vals = (T)(gnorm_scale * g); no inf/NaN rule. */
#pragma omp parallel for num_threads(nt) schedule(static)
        for (size_t i = 0; i < n; i++) {
            float gi = round_to(grad_scale * load_f(g, tg, i), tg);
            float s1 = m[i] * beta1 + (w1 * gi);
            float s2 = v[i] * beta2 + (w2 * (gi * gi));
            float pi = round_to(load_f(p, tp, i) + (step_size * (s1 / (sqrtf(s2) + eps2))), tp);
            if (weight_decay > 0.0f) pi = pi * decay;
            store_f(p, tp, i, pi);
            m[i] = s1;
            v[i] = s2;
        }
        return FL_OK;
    }
    if (!st->q_m || !st->q_v || !st->absmax_m || !st->absmax_v || st->n_blocks != (n + 255) / 256)
        return fl_errorf(FL_ERR_INVALID, "adam8bit_update: 8-bit state (n=%zu) incomplete", n);
    const float *cs = fl_adam8bit_code_signed, *cu = fl_adam8bit_code_unsigned;
    long nb = (long)st->n_blocks;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (long b = 0; b < nb; b++) {
        size_t i0 = (size_t)b * FL_ADAM8BIT_BLOCK;
        int cnt = (int)(n - i0 < FL_ADAM8BIT_BLOCK ? n - i0 : FL_ADAM8BIT_BLOCK);
        float s1[FL_ADAM8BIT_BLOCK], s2[FL_ADAM8BIT_BLOCK];
        unsigned char ok[FL_ADAM8BIT_BLOCK];
        float am = st->absmax_m[b], av = st->absmax_v[b];
        /* from -FLT_MAX as the kernel; FULL_SHARD: from the whole block's max (fl_adam8bit_state) */
        float nm1 = st->floor_m ? st->floor_m[b] : -3.40282347e+38f, nm2 = st->floor_v ? st->floor_v[b] : -3.40282347e+38f;
        for (int j = 0; j < cnt; j++) {
            float graw = load_f(g, tg, i0 + j);
            ok[j] = isfinite(graw) ? 1 : 0;
            if (ok[j]) {
                float gv = graw * grad_scale;
                float v2 = cu[st->q_v[i0 + j]] * av;
                s2[j] = (v2 * beta2) + ((w2 * gv) * gv);
                float v1 = cs[st->q_m[i0 + j]] * am;
                s1[j] = (v1 * beta1) + (w1 * gv);
            } else {
                s1[j] = 0.0f;
                s2[j] = 0.0f;
            }
            nm1 = fmaxf(nm1, fabsf(s1[j]));
            nm2 = fmaxf(nm2, fabsf(s2[j]));
        }
        st->absmax_m[b] = nm1;
        st->absmax_v[b] = nm2;
        for (int j = 0; j < cnt; j++) {
            if (!ok[j]) continue;
            float pi = round_to(load_f(p, tp, i0 + j) + (step_size * (s1[j] / (sqrtf(s2[j]) + eps2))), tp);
            if (weight_decay > 0.0f) pi = pi * decay;
            store_f(p, tp, i0 + j, pi);
        }
        float x1[FL_ADAM8BIT_BLOCK], x2[FL_ADAM8BIT_BLOCK];
        uint8_t q1[FL_ADAM8BIT_BLOCK], q2[FL_ADAM8BIT_BLOCK];
        for (int j = 0; j < cnt; j++) {
            x1[j] = s1[j] / nm1;
            x2[j] = s2[j] / nm2;
        }
        fl_adam8bit_quantize_n(cs, 1, x1, cnt, q1);
        fl_adam8bit_quantize_n(cu, 0, x2, cnt, q2);
        for (int j = 0; j < cnt; j++) {
            uint8_t c1 = q1[j], c2 = q2[j];
            /* keep the sign of m (the kernel's fix-up; wraps like unsigned char) */
            if (!signbit(cs[c1]) != !signbit(s1[j])) c1 = (uint8_t)(s1[j] > 0.0f ? c1 + 1 : c1 - 1);
            st->q_m[i0 + j] = c1;
            st->q_v[i0 + j] = c2;
        }
    }
    return FL_OK;
}

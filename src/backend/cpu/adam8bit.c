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
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "backend/cpu/cpu-impl.h"
#include "fitllm/cpu.h"


/* The SIMD kernels below (the table quantizer, the update's first pass) are AVX2, chosen at run time (fl_cpu_level);
 * this file is compiled with -ffp-contract=off and they use no FMA, so their arithmetic is the scalar code's. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FL_Q8_X86 1
#endif

/* ---- the quantizer as a table (the same codes, no search) ----------------------------------------------------
 * fl_adam8bit_quantize is a non-decreasing step function of x over the non-NaN floats (NaN: code 0), so it is
 * the number of its 255 transitions at or below x. Over the floats' total order (key: the bits, the sign bit set for
 * x >= 0 and every bit flipped for x < 0, -0 just below +0), a transition is the least key whose code reaches the
 * next one, found once by bisection against fl_adam8bit_quantize itself (so the bnb search's ties and its midpoint
 * rounding are what it is). Buckets of 2^18 consecutive keys (sign, exponent, 5 mantissa bits: 16,384 of them) hold
 * the code at their start and their first transition; no bucket holds more than 3 transitions (built and checked
 * at start-up, else the search runs), so code = base + (key >= t[i]) + (key >= t[i + 1]) + (key >= t[i + 2]), the
 * list padded with keys no float has. Checked against the search over all 2^32 bit patterns for both code tables
 * (dispatch_adam8bit_table_exhaustive, FITLLM_TEST_EXHAUSTIVE=1: 0 differ) and, in the quick tier, at every code,
 * midpoint and neighbour, the specials and random bit patterns. Three compares and two dependent loads instead of
 * eight dependent comparisons and loads (the gather search this replaced). Another code table: the scalar search. */
#define Q8_SHIFT 18
#define Q8_BUCKETS (1u << (32 - Q8_SHIFT))
typedef struct {
    int ok;                 /* built, at most 3 transitions a bucket */
    int32_t lo, hi;         /* the keys of -inf and +inf (as int32: key ^ 2^31); outside: NaN, code 0 */
    int32_t t[255 + 3];     /* the transitions' keys (as int32), ascending, then INT32_MAX */
    uint32_t ent[Q8_BUCKETS]; /* base code | first transition << 8 */
} q8_table;
static q8_table q8_tab[2]; /* [is_signed] */
static pthread_once_t q8_once = PTHREAD_ONCE_INIT;

static inline uint32_t q8_key(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}
static inline float q8_float(uint32_t k) {
    const uint32_t u = k & 0x80000000u ? k & 0x7fffffffu : ~k;
    float x;
    memcpy(&x, &u, 4);
    return x;
}
static void q8_build(q8_table *T, const float *code, int is_signed) {
    const uint32_t lo = q8_key(-INFINITY), hi = q8_key(INFINITY);
    uint32_t t[255];
    int n = 0, base0 = fl_adam8bit_quantize(code, is_signed, -INFINITY), top = fl_adam8bit_quantize(code, is_signed, INFINITY);
    for (int k = base0 + 1; k <= top; k++) { /* the least key in [lo, hi] whose code is >= k */
        uint32_t a = lo, b = hi;            /* code(a) < k <= code(b) */
        while (b - a > 1) {
            const uint32_t m = a + (b - a) / 2;
            if (fl_adam8bit_quantize(code, is_signed, q8_float(m)) >= k) b = m;
            else a = m;
        }
        t[n++] = b;
    }
    T->lo = (int32_t)(lo ^ 0x80000000u), T->hi = (int32_t)(hi ^ 0x80000000u);
    for (int i = 0; i < 255 + 3; i++) T->t[i] = i < n ? (int32_t)(t[i] ^ 0x80000000u) : INT32_MAX;
    int st = 0;
    for (uint32_t b = 0; b < Q8_BUCKETS; b++) {
        const uint32_t k0 = b << Q8_SHIFT, k1 = k0 + ((1u << Q8_SHIFT) - 1);
        while (st < n && t[st] <= k0) st++; /* reached at the bucket's start: in its base */
        int cnt = 0;
        while (st + cnt < n && t[st + cnt] <= k1) cnt++;
        if (cnt > 3) return; /* not this layout: the search runs (ok stays 0) */
        T->ent[b] = (uint32_t)(base0 + st) | (uint32_t)st << 8;
    }
    /* monotone, as the layout assumes: the code just below and at each transition */
    for (int i = 0; i < n; i++)
        if (fl_adam8bit_quantize(code, is_signed, q8_float(t[i] - 1)) != base0 + i ||
            fl_adam8bit_quantize(code, is_signed, q8_float(t[i])) != base0 + i + 1)
            return;
    T->ok = 1;
}
static void q8_build_both(void) {
    q8_build(&q8_tab[0], fl_adam8bit_code_unsigned, 0);
    q8_build(&q8_tab[1], fl_adam8bit_code_signed, 1);
}
/* the table of one of the two code tables (NULL: another code, or not built) */
static const q8_table *q8_table_for(const float *code, int is_signed) {
    if (code != (is_signed ? fl_adam8bit_code_signed : fl_adam8bit_code_unsigned)) return NULL;
    pthread_once(&q8_once, q8_build_both);
    return q8_tab[is_signed != 0].ok ? &q8_tab[is_signed != 0] : NULL;
}
static inline uint8_t q8_lookup(const q8_table *T, float x) {
    const int32_t k = (int32_t)(q8_key(x) ^ 0x80000000u);
    if (k < T->lo || k > T->hi) return 0; /* NaN */
    const uint32_t e = T->ent[(uint32_t)(k ^ INT32_MIN) >> Q8_SHIFT];
    const int32_t *t = T->t + (e >> 8);
    return (uint8_t)((e & 0xff) + (k >= t[0]) + (k >= t[1]) + (k >= t[2]));
}
#if defined(FL_Q8_X86)
__attribute__((target("avx2"))) static void q8_table8_avx2(const q8_table *T, const float *x, uint8_t *out) {
    const __m256i u = _mm256_loadu_si256((const __m256i *)x), sb = _mm256_set1_epi32((int)0x80000000u);
    /* the key as int32: x >= 0: u (sign bit clear, key u | 2^31, ^ 2^31 = u); x < 0: ~u ^ 2^31 */
    const __m256i k = _mm256_xor_si256(u, _mm256_andnot_si256(sb, _mm256_srai_epi32(u, 31)));
    const __m256i bad = _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(T->lo), k),
                                        _mm256_cmpgt_epi32(k, _mm256_set1_epi32(T->hi)));
    const __m256i e = _mm256_i32gather_epi32((const int *)T->ent, _mm256_srli_epi32(_mm256_xor_si256(k, sb), Q8_SHIFT), 4);
    const __m256i i = _mm256_srli_epi32(e, 8);
    const __m256i t0 = _mm256_i32gather_epi32(T->t, i, 4), t1 = _mm256_i32gather_epi32(T->t + 1, i, 4),
                  t2 = _mm256_i32gather_epi32(T->t + 2, i, 4);
    /* base + 3 - (t0 > k) - (t1 > k) - (t2 > k): a compare is -1 where true */
    __m256i c = _mm256_add_epi32(_mm256_and_si256(e, _mm256_set1_epi32(0xff)), _mm256_set1_epi32(3));
    c = _mm256_add_epi32(c, _mm256_add_epi32(_mm256_cmpgt_epi32(t0, k), _mm256_cmpgt_epi32(t1, k)));
    c = _mm256_andnot_si256(bad, _mm256_add_epi32(c, _mm256_cmpgt_epi32(t2, k)));
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1,
                                          -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i b = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(c, pick), _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    _mm_storel_epi64((__m128i *)out, _mm256_castsi256_si128(b));
}
#endif

/* codes for x[0..n): the table for the two code tables, the search for another */
void fl_adam8bit_quantize_n(const float *code, int is_signed, const float *x, int n, uint8_t *out) {
    int j = 0;
    const q8_table *T = q8_table_for(code, is_signed);
    if (T) {
#if defined(FL_Q8_X86)
        /* (AVX-512 CPUs too: the table's loads are the gathers' cost either way; this kernel is the one checked
         * against the search over every float) */
        if (fl_cpu_level() >= FL_CPU_AVX2)
            for (; j + 8 <= n; j += 8) q8_table8_avx2(T, x + j, out + j);
#endif
        for (; j < n; j++) out[j] = q8_lookup(T, x[j]);
        return;
    }
    for (; j < n; j++) out[j] = fl_adam8bit_quantize(code, is_signed, x[j]);
}

const char *fl_cpu_adam8bit_quantizer_path(void) {
    if (!q8_table_for(fl_adam8bit_code_signed, 1) || !q8_table_for(fl_adam8bit_code_unsigned, 0)) return "scalar";
#if defined(FL_Q8_X86)
    if (fl_cpu_level() >= FL_CPU_AVX2) return "avx2-table";
#endif
    return "scalar-table";
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
/* x[i0 .. i0 + n) widened into out / out rounded into x[i0 ..): the type switch outside the loops */
static void load_block(const void *x, fl_dtype t, size_t i0, int n, float *out) {
    if (t == FL_F32) memcpy(out, (const float *)x + i0, (size_t)n * sizeof(float));
    else if (t == FL_BF16)
        for (int j = 0; j < n; j++) out[j] = fl_bf16_to_f32(((const uint16_t *)x)[i0 + j]);
    else
        for (int j = 0; j < n; j++) out[j] = fl_f16_to_f32(((const uint16_t *)x)[i0 + j]);
}
static void store_block(void *x, fl_dtype t, size_t i0, int n, const float *v) {
    if (t == FL_F32) memcpy((float *)x + i0, v, (size_t)n * sizeof(float));
    else if (t == FL_BF16)
        for (int j = 0; j < n; j++) ((uint16_t *)x)[i0 + j] = fl_f32_to_bf16(v[j]);
    else
        for (int j = 0; j < n; j++) ((uint16_t *)x)[i0 + j] = fl_f32_to_f16(v[j]);
}
static inline void store_f(void *x, fl_dtype t, size_t i, float v) {
    if (t == FL_F32)
        ((float *)x)[i] = v;
    else if (t == FL_BF16)
        ((uint16_t *)x)[i] = fl_f32_to_bf16(v);
    else
        ((uint16_t *)x)[i] = fl_f32_to_f16(v);
}

/* The 8-bit update's first pass over a block: the dequantized states' update (s1 = m, s2 = v; 0 where the gradient is
 * not finite, ok[j] 0 there) and their blocks' new absmax (nm1, nm2 in and out, a > b ? a : b as fmaxf gives here) */
typedef struct {
    float grad_scale, beta1, beta2, w1, w2, am, av;
} q8_consts;
#if defined(FL_Q8_X86)
/* 8 lanes of the scalar loop below, the same operations in the same order (mul, then add: no FMA); returns the
 * elements done (a multiple of 8) */
__attribute__((target("avx2"))) static int q8_state_avx2(const q8_consts *k, const float *gb, const uint8_t *qm,
                                                         const uint8_t *qv, int cnt, float *s1, float *s2, int32_t *ok,
                                                         float *nm1, float *nm2) {
    const __m256 gs = _mm256_set1_ps(k->grad_scale), b1 = _mm256_set1_ps(k->beta1), b2 = _mm256_set1_ps(k->beta2);
    const __m256 w1 = _mm256_set1_ps(k->w1), w2 = _mm256_set1_ps(k->w2), am = _mm256_set1_ps(k->am);
    const __m256 av = _mm256_set1_ps(k->av), absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i expm = _mm256_set1_epi32(0x7f800000);
    __m256 m1 = _mm256_set1_ps(*nm1), m2 = _mm256_set1_ps(*nm2);
    int j = 0;
    for (; j + 8 <= cnt; j += 8) {
        const __m256 graw = _mm256_loadu_ps(gb + j);
        /* finite: the exponent bits not all set */
        const __m256i okm = _mm256_xor_si256(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(graw), expm), expm),
                                             _mm256_set1_epi32(-1));
        const __m256 gv = _mm256_mul_ps(graw, gs);
        const __m256 v2 = _mm256_mul_ps(_mm256_i32gather_ps(fl_adam8bit_code_unsigned,
                                                            _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qv + j))), 4),
                                        av);
        const __m256 v1 = _mm256_mul_ps(_mm256_i32gather_ps(fl_adam8bit_code_signed,
                                                            _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qm + j))), 4),
                                        am);
        const __m256 a2 = _mm256_add_ps(_mm256_mul_ps(v2, b2), _mm256_mul_ps(_mm256_mul_ps(w2, gv), gv));
        const __m256 a1 = _mm256_add_ps(_mm256_mul_ps(v1, b1), _mm256_mul_ps(w1, gv));
        const __m256 z1 = _mm256_and_ps(a1, _mm256_castsi256_ps(okm)), z2 = _mm256_and_ps(a2, _mm256_castsi256_ps(okm));
        _mm256_storeu_si256((__m256i *)(ok + j), _mm256_srli_epi32(okm, 31));
        _mm256_storeu_ps(s1 + j, z1);
        _mm256_storeu_ps(s2 + j, z2);
        /* max_ps(x, m) = x > m ? x : m: a NaN x keeps m */
        m1 = _mm256_max_ps(_mm256_and_ps(z1, absm), m1);
        m2 = _mm256_max_ps(_mm256_and_ps(z2, absm), m2);
    }
    float l1[8], l2[8];
    _mm256_storeu_ps(l1, m1);
    _mm256_storeu_ps(l2, m2);
    for (int i = 0; i < 8; i++) { /* the lanes' maxima (none NaN) in any order */
        *nm1 = l1[i] > *nm1 ? l1[i] : *nm1;
        *nm2 = l2[i] > *nm2 ? l2[i] : *nm2;
    }
    return j;
}
#endif

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
    uint8_t *const q_m = st->q_m, *const q_v = st->q_v;
    float *const amax_m = st->absmax_m, *const amax_v = st->absmax_v;
    const float *const floor_m = st->floor_m, *const floor_v = st->floor_v;
    /* A block at a time in passes over 256-element arrays (g and p widened once, the type switch outside the loops;
     * the selects and the max as maxps takes them: a > b ? a : b), which the compiler vectorizes: each element's
     * arithmetic is the kernel's, in its order (-ffp-contract=off), so the same bits as element by element. */
#pragma omp parallel for num_threads(nt) schedule(static)
    for (long b = 0; b < nb; b++) {
        size_t i0 = (size_t)b * FL_ADAM8BIT_BLOCK;
        int cnt = (int)(n - i0 < FL_ADAM8BIT_BLOCK ? n - i0 : FL_ADAM8BIT_BLOCK);
        float gb[FL_ADAM8BIT_BLOCK], pb[FL_ADAM8BIT_BLOCK], s1[FL_ADAM8BIT_BLOCK], s2[FL_ADAM8BIT_BLOCK];
        int32_t ok[FL_ADAM8BIT_BLOCK];
        const float am = amax_m[b], av = amax_v[b];
        const uint8_t *qm = q_m + i0, *qv = q_v + i0;
        load_block(g, tg, i0, cnt, gb);
        /* from -FLT_MAX as the kernel; FULL_SHARD: from the whole block's max (fl_adam8bit_state) */
        float nm1 = floor_m ? floor_m[b] : -3.40282347e+38f, nm2 = floor_v ? floor_v[b] : -3.40282347e+38f;
        const q8_consts k = {grad_scale, beta1, beta2, w1, w2, am, av};
        int j = 0;
#if defined(FL_Q8_X86)
        if (fl_cpu_level() >= FL_CPU_AVX2) j = q8_state_avx2(&k, gb, qm, qv, cnt, s1, s2, ok, &nm1, &nm2);
#endif
        for (; j < cnt; j++) {
            const float graw = gb[j];
            const int okj = isfinite(graw) != 0;
            const float gv = graw * grad_scale;
            const float v2 = cu[qv[j]] * av, v1 = cs[qm[j]] * am;
            const float a2 = (v2 * beta2) + ((w2 * gv) * gv), a1 = (v1 * beta1) + (w1 * gv);
            ok[j] = okj;
            s1[j] = okj ? a1 : 0.0f;
            s2[j] = okj ? a2 : 0.0f;
            /* fmaxf's result: |s| is never NaN where it matters (an ok element's; nm never NaN) */
            const float x1 = fabsf(s1[j]), x2 = fabsf(s2[j]);
            nm1 = x1 > nm1 ? x1 : nm1;
            nm2 = x2 > nm2 ? x2 : nm2;
        }
        amax_m[b] = nm1;
        amax_v[b] = nm2;
        load_block(p, tp, i0, cnt, pb);
        for (int j = 0; j < cnt; j++) { /* (T)(p + step_size * m / (sqrt(v) + eps2)), then the decay; as it was else */
            float pi = round_to(pb[j] + (step_size * (s1[j] / (sqrtf(s2[j]) + eps2))), tp);
            if (weight_decay > 0.0f) pi = pi * decay;
            pb[j] = ok[j] ? pi : pb[j];
        }
        store_block(p, tp, i0, cnt, pb);
        float x1[FL_ADAM8BIT_BLOCK], x2[FL_ADAM8BIT_BLOCK];
        uint8_t c1[FL_ADAM8BIT_BLOCK], c2[FL_ADAM8BIT_BLOCK];
        for (int j = 0; j < cnt; j++) {
            x1[j] = s1[j] / nm1;
            x2[j] = s2[j] / nm2;
        }
        fl_adam8bit_quantize_n(cs, 1, x1, cnt, c1);
        fl_adam8bit_quantize_n(cu, 0, x2, cnt, c2);
        uint8_t *om = q_m + i0, *ov = q_v + i0;
        for (int j = 0; j < cnt; j++) {
            uint8_t c = c1[j];
            /* keep the sign of m (the kernel's fix-up; wraps like unsigned char) */
            if (!signbit(cs[c]) != !signbit(s1[j])) c = (uint8_t)(s1[j] > 0.0f ? c + 1 : c - 1);
            om[j] = c; /* (a non-finite gradient's element: the codes of s = 0, as the kernel) */
            ov[j] = c2[j];
        }
    }
    return FL_OK;
}

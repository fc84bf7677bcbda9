/* Bulk 16-bit <-> fp32 conversions: scalar, AVX2 (+F16C) and AVX-512 variants, chosen per call
 * from fl_cpu_level(). Semantics (bit-identical to dtype.h's scalar functions): core/cvt.h.
 *
 * bf16 is the top half of an fp32, so widening is a 16-bit shift and narrowing is the integer
 * RNE of fl_f32_to_bf16 (add 0x7fff + lsb, shift) with its NaN rule, done 8 or 16 lanes at a
 * time. fp16 uses the hardware conversions (vcvtph2ps / vcvtps2ph with round-to-nearest-even,
 * exact IEEE for every finite value, subnormals included) and patches NaN lanes, where the
 * hardware keeps the payload (and sets the quiet bit) while the scalar functions do not. All
 * integer work: no floating-point rounding happens outside the conversion instructions. */
#include "core/cvt.h"

#include "fitllm/cpu.h"
#include "fitllm/dtype.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FL_CVT_X86 1
#endif

/* ---- scalar ------------------------------------------------------------------------------ */

static void bf16_to_f32_scalar(float *d, const uint16_t *s, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] = fl_bf16_to_f32(s[i]);
}
static void f32_to_bf16_scalar(uint16_t *d, const float *s, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] = fl_f32_to_bf16(s[i]);
}
static void f16_to_f32_scalar(float *d, const uint16_t *s, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] = fl_f16_to_f32(s[i]);
}
static void f32_to_f16_scalar(uint16_t *d, const float *s, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] = fl_f32_to_f16(s[i]);
}
static void round_bf16_scalar(float *d, const float *s, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] = fl_bf16_to_f32(fl_f32_to_bf16(s[i]));
}

#if defined(FL_CVT_X86)
/* ---- AVX2 (+F16C) -------------------------------------------------------------------------- */
#define FL_T2 __attribute__((target("avx2,f16c")))

/* 8 fp32 bit patterns -> their bf16 (fl_f32_to_bf16) in the low 16 bits of each lane */
FL_T2 static inline __m256i bf16_bits8(__m256i u) {
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(r, q, nan);
}

FL_T2 static void bf16_to_f32_avx2(float *d, const uint16_t *s, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16);
        __m256i hi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16);
        _mm256_storeu_si256((__m256i *)(d + i), lo);
        _mm256_storeu_si256((__m256i *)(d + i + 8), hi);
    }
    bf16_to_f32_scalar(d + i, s + i, n - i);
}

FL_T2 static void f32_to_bf16_avx2(uint16_t *d, const float *s, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i a = bf16_bits8(_mm256_loadu_si256((const __m256i *)(s + i)));
        __m256i b = bf16_bits8(_mm256_loadu_si256((const __m256i *)(s + i + 8)));
        /* packus interleaves 128-bit lanes: a0-3 b0-3 | a4-7 b4-7 -> reorder the quadwords */
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
        _mm256_storeu_si256((__m256i *)(d + i), p);
    }
    f32_to_bf16_scalar(d + i, s + i, n - i);
}

FL_T2 static void round_bf16_avx2(float *d, const float *s, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i a = bf16_bits8(_mm256_loadu_si256((const __m256i *)(s + i)));
        _mm256_storeu_si256((__m256i *)(d + i), _mm256_slli_epi32(a, 16));
    }
    round_bf16_scalar(d + i, s + i, n - i);
}

/* fl_f16_to_f32 of NaN halves: sign | 0x7f800000 | (m << 13), no quiet bit added */
FL_T2 static inline __m256 f16_widen8(__m128i h) {
    __m256 f = _mm256_cvtph_ps(h);
    __m256i w = _mm256_cvtepu16_epi32(h);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x7fff)), _mm256_set1_epi32(0x7c00));
    __m256i q = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x8000)), 16),
                                _mm256_or_si256(_mm256_set1_epi32(0x7f800000),
                                                _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x3ff)), 13)));
    return _mm256_blendv_ps(f, _mm256_castsi256_ps(q), _mm256_castsi256_ps(nan));
}

/* fl_f32_to_f16 of NaN floats: sign | 0x7e00 */
FL_T2 static inline __m128i f16_narrow8(__m256 x) {
    __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i u = _mm256_castps_si256(x);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    __m256i q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000)),
                                _mm256_set1_epi32(0x7e00));
    __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan), _mm256_extracti128_si256(nan, 1));
    __m128i q16 = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    return _mm_blendv_epi8(h, q16, nan16);
}

FL_T2 static void f16_to_f32_avx2(float *d, const uint16_t *s, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, f16_widen8(_mm_loadu_si128((const __m128i *)(s + i))));
    f16_to_f32_scalar(d + i, s + i, n - i);
}

FL_T2 static void f32_to_f16_avx2(uint16_t *d, const float *s, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i *)(d + i), f16_narrow8(_mm256_loadu_ps(s + i)));
    f32_to_f16_scalar(d + i, s + i, n - i);
}

/* ---- AVX-512 (F/BW/VL) --------------------------------------------------------------------- */
#define FL_T5 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c")))

FL_T5 static inline __m512i bf16_bits16(__m512i u) {
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_mask_blend_epi32(nan, r, q);
}

FL_T5 static void bf16_to_f32_avx512(float *d, const uint16_t *s, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + i)));
        _mm512_storeu_si512((void *)(d + i), _mm512_slli_epi32(w, 16));
    }
    bf16_to_f32_scalar(d + i, s + i, n - i);
}

FL_T5 static void f32_to_bf16_avx512(uint16_t *d, const float *s, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i b = bf16_bits16(_mm512_loadu_si512((const void *)(s + i)));
        _mm256_storeu_si256((__m256i *)(d + i), _mm512_cvtepi32_epi16(b));
    }
    f32_to_bf16_scalar(d + i, s + i, n - i);
}

FL_T5 static void round_bf16_avx512(float *d, const float *s, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i b = bf16_bits16(_mm512_loadu_si512((const void *)(s + i)));
        _mm512_storeu_si512((void *)(d + i), _mm512_slli_epi32(b, 16));
    }
    round_bf16_scalar(d + i, s + i, n - i);
}

FL_T5 static void f16_to_f32_avx512(float *d, const uint16_t *s, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(s + i));
        __m512 f = _mm512_cvtph_ps(h);
        __m512i w = _mm512_cvtepu16_epi32(h);
        __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(w, _mm512_set1_epi32(0x7fff)), _mm512_set1_epi32(0x7c00));
        __m512i q = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x8000)), 16),
                                    _mm512_or_si512(_mm512_set1_epi32(0x7f800000),
                                                    _mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x3ff)), 13)));
        _mm512_storeu_ps(d + i, _mm512_mask_blend_ps(nan, f, _mm512_castsi512_ps(q)));
    }
    f16_to_f32_scalar(d + i, s + i, n - i);
}

FL_T5 static void f32_to_f16_avx512(uint16_t *d, const float *s, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(s + i);
        __m512i h = _mm512_cvtepu16_epi32(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m512i u = _mm512_castps_si512(x);
        __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
        __m512i q = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x8000)),
                                    _mm512_set1_epi32(0x7e00));
        _mm256_storeu_si256((__m256i *)(d + i), _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, h, q)));
    }
    f32_to_f16_scalar(d + i, s + i, n - i);
}
#endif /* FL_CVT_X86 */

/* ---- dispatch ------------------------------------------------------------------------------ */

#if defined(FL_CVT_X86)
#define DISPATCH(name, ...)                                                                                  \
    do {                                                                                                     \
        fl_cpu_level_t l_ = fl_cpu_level();                                                                  \
        if (l_ >= FL_CPU_AVX512) name##_avx512(__VA_ARGS__);                                                 \
        else if (l_ >= FL_CPU_AVX2) name##_avx2(__VA_ARGS__);                                                \
        else name##_scalar(__VA_ARGS__);                                                                     \
    } while (0)
#else
#define DISPATCH(name, ...) name##_scalar(__VA_ARGS__)
#endif

void fl_cvt_bf16_to_f32(float *dst, const uint16_t *src, size_t n) { DISPATCH(bf16_to_f32, dst, src, n); }
void fl_cvt_f32_to_bf16(uint16_t *dst, const float *src, size_t n) { DISPATCH(f32_to_bf16, dst, src, n); }
void fl_cvt_f16_to_f32(float *dst, const uint16_t *src, size_t n) { DISPATCH(f16_to_f32, dst, src, n); }
void fl_cvt_f32_to_f16(uint16_t *dst, const float *src, size_t n) { DISPATCH(f32_to_f16, dst, src, n); }
void fl_cvt_f32_round_bf16(float *dst, const float *src, size_t n) { DISPATCH(round_bf16, dst, src, n); }

const char *fl_cvt_path(void) {
#if defined(FL_CVT_X86)
    fl_cpu_level_t l = fl_cpu_level();
    if (l >= FL_CPU_AVX512) return "avx512";
    if (l >= FL_CPU_AVX2) return "avx2+f16c";
#endif
    return "scalar";
}

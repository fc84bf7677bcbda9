/* Element types and round-to-nearest-even conversions. */
#include "fitllm/dtype.h"

#include "core/cvt.h"

#include <string.h>

static const size_t k_size[FL_DTYPE_COUNT] = {4, 2, 2, 8, 4, 8, 1};
static const char *k_name[FL_DTYPE_COUNT] = {"F32", "BF16", "F16", "F64", "I32", "I64", "U8"};

size_t fl_dtype_size(fl_dtype t) { return (t >= 0 && t < FL_DTYPE_COUNT) ? k_size[t] : 0; }
const char *fl_dtype_name(fl_dtype t) { return (t >= 0 && t < FL_DTYPE_COUNT) ? k_name[t] : "?"; }

int fl_dtype_parse(const char *s, fl_dtype *out) {
    for (int i = 0; i < FL_DTYPE_COUNT; i++)
        if (strcmp(s, k_name[i]) == 0) { *out = (fl_dtype)i; return 0; }
    return -1;
}

uint16_t fl_f32_to_f16(float f) {
    union { float f; uint32_t u; } v = {f};
    uint32_t x = v.u;
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return sign | 0x7e00u;          /* NaN */
    if (ax >= 0x477ff000u) return sign | 0x7c00u;         /* overflow (incl. rounding up) -> inf */
    if (ax < 0x38800000u) {                               /* f16 subnormal or zero */
        if (ax < 0x33000000u) return sign;                /* < 2^-25: rounds to 0 */
        uint32_t e = ax >> 23;                            /* 102..112 */
        uint32_t m = (ax & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e;                        /* 14..24 */
        uint32_t r = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return sign | (uint16_t)r;
    }
    uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);         /* RNE on 13 dropped bits */
    r -= 0x38000000u;                                     /* rebias 127 -> 15 */
    return sign | (uint16_t)(r >> 13);
}

float fl_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (e == 0) {
        if (m == 0) { v.u = sign; return v.f; }
        /* subnormal: value = m * 2^-24 */
        float f = (float)m * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    if (e == 31) { v.u = sign | 0x7f800000u | (m << 13); return v.f; }
    v.u = sign | ((e + 112u) << 23) | (m << 13);
    return v.f;
}

static double load_elem(const void *src, fl_dtype st, size_t i) {
    switch (st) {
    case FL_F32: return ((const float *)src)[i];
    case FL_BF16: return fl_bf16_to_f32(((const uint16_t *)src)[i]);
    case FL_F16: return fl_f16_to_f32(((const uint16_t *)src)[i]);
    case FL_F64: return ((const double *)src)[i];
    default: return 0.0;
    }
}

int fl_convert(void *dst, fl_dtype dt, const void *src, fl_dtype st, size_t n) {
    int ok_s = st == FL_F32 || st == FL_BF16 || st == FL_F16 || st == FL_F64;
    int ok_d = dt == FL_F32 || dt == FL_BF16 || dt == FL_F16 || dt == FL_F64;
    if (!ok_s || !ok_d) return -1;
    if (st == dt) { memcpy(dst, src, n * fl_dtype_size(st)); return 0; }
    /* F32 <-> BF16/F16 and BF16 <-> F16: the SIMD row kernels of core/cvt.c (bit-identical to
     * the scalar functions); 16 -> 16 goes through fp32, which is exact. */
    if (dt == FL_F32 && st == FL_BF16) { fl_cvt_bf16_to_f32(dst, src, n); return 0; }
    if (dt == FL_F32 && st == FL_F16) { fl_cvt_f16_to_f32(dst, src, n); return 0; }
    if (dt == FL_BF16 && st == FL_F32) { fl_cvt_f32_to_bf16(dst, src, n); return 0; }
    if (dt == FL_F16 && st == FL_F32) { fl_cvt_f32_to_f16(dst, src, n); return 0; }
    if ((dt == FL_BF16 || dt == FL_F16) && (st == FL_BF16 || st == FL_F16)) {
        float tmp[1024];
        for (size_t off = 0; off < n; off += 1024) {
            size_t k = n - off < 1024 ? n - off : 1024;
            const uint16_t *s = (const uint16_t *)src + off;
            uint16_t *d = (uint16_t *)dst + off;
            if (st == FL_BF16) fl_cvt_bf16_to_f32(tmp, s, k); else fl_cvt_f16_to_f32(tmp, s, k);
            if (dt == FL_BF16) fl_cvt_f32_to_bf16(d, tmp, k); else fl_cvt_f32_to_f16(d, tmp, k);
        }
        return 0;
    }
    /* F64 in or out (test-only) */
    for (size_t i = 0; i < n; i++) {
        double x = load_elem(src, st, i);
        switch (dt) {
        case FL_F32: ((float *)dst)[i] = (float)x; break;
        /* double -> float -> half: rounds twice for F64 inputs (documented: F64 inputs are
         * test-only). */
        case FL_BF16: ((uint16_t *)dst)[i] = fl_f32_to_bf16((float)x); break;
        case FL_F16: ((uint16_t *)dst)[i] = fl_f32_to_f16((float)x); break;
        case FL_F64: ((double *)dst)[i] = x; break;
        default: return -1;
        }
    }
    return 0;
}

long long fl_dtype_first_nonfinite(const void *x, fl_dtype t, size_t n) {
    const unsigned char *b = x;
    /* by bits: an all-ones exponent is inf or NaN (memcpy: no alignment needed) */
    for (size_t i = 0; i < n; i++) {
        if (t == FL_F32) {
            uint32_t v;
            memcpy(&v, b + 4 * i, 4);
            if ((v & 0x7f800000u) == 0x7f800000u) return (long long)i;
        } else if (t == FL_F64) {
            uint64_t v;
            memcpy(&v, b + 8 * i, 8);
            if ((v & 0x7ff0000000000000ull) == 0x7ff0000000000000ull) return (long long)i;
        } else if (t == FL_BF16 || t == FL_F16) {
            uint16_t v;
            memcpy(&v, b + 2 * i, 2);
            uint16_t e = t == FL_BF16 ? 0x7f80u : 0x7c00u;
            if ((v & e) == e) return (long long)i;
        } else {
            return -1;
        }
    }
    return -1;
}

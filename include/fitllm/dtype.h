/* fitllm: element types and conversions.
 *
 * Storage dtypes of tensors. Conversions to bf16/f16 round to nearest even and
 * keep NaN a (quiet) NaN; f16 overflow gives +-inf, f16 underflow gives
 * subnormals / signed zero as IEEE 754 requires.
 */
#ifndef FITLLM_DTYPE_H
#define FITLLM_DTYPE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    FL_F32 = 0,
    FL_BF16,
    FL_F16,
    FL_F64,
    FL_I32,
    FL_I64,
    FL_U8,  /* raw bytes: 8-bit optimizer state, packed 4-bit codes */
    FL_DTYPE_COUNT
} fl_dtype;

/* Bytes per element (U8 counts bytes; packed 4-bit types are U8 storage). */
size_t fl_dtype_size(fl_dtype t);
/* "F32", "BF16", ... exactly as safetensors spells them. */
const char *fl_dtype_name(fl_dtype t);
/* Parse a safetensors dtype string; returns 0 on success, -1 if unknown. */
int fl_dtype_parse(const char *s, fl_dtype *out);

static inline uint16_t fl_f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* quiet NaN */
    uint32_t lsb = (v.u >> 16) & 1u;
    v.u += 0x7fffu + lsb;
    return (uint16_t)(v.u >> 16);
}

static inline float fl_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

uint16_t fl_f32_to_f16(float f);
float fl_f16_to_f32(uint16_t h);

/* Bulk conversions (n elements) from src of type st to dst of type dt.
 * Supported pairs: any of F32/BF16/F16/F64 to any of them. Returns 0 or -1. */
int fl_convert(void *dst, fl_dtype dt, const void *src, fl_dtype st, size_t n);

/* Index of the first inf/NaN among n floating-point values of dtype t (F32, F64,
 * BF16, F16; any alignment), or -1 when all are finite or t is not a float. */
long long fl_dtype_first_nonfinite(const void *x, fl_dtype t, size_t n);

#ifdef __cplusplus
}
#endif
#endif

/* Bulk 16-bit <-> fp32 conversions with run-time SIMD dispatch (src/core/cvt.c).
 *
 * Every variant is bit-identical to the scalar functions of include/fitllm/dtype.h for every
 * input, NaN payloads included (fl_f32_to_bf16: (x >> 16) | 0x40; fl_f32_to_f16: sign | 0x7e00;
 * fl_f16_to_f32 keeps an f16 NaN's payload without setting the quiet bit). The variant follows
 * fl_cpu_level() (include/fitllm/cpu.h) on every call. Internal to the library (backend and
 * core); fl_convert is the public bulk entry. */
#ifndef FITLLM_CORE_CVT_H
#define FITLLM_CORE_CVT_H

#include <stddef.h>
#include <stdint.h>

void fl_cvt_bf16_to_f32(float *dst, const uint16_t *src, size_t n);
void fl_cvt_f32_to_bf16(uint16_t *dst, const float *src, size_t n);
void fl_cvt_f16_to_f32(float *dst, const uint16_t *src, size_t n);
void fl_cvt_f32_to_f16(uint16_t *dst, const float *src, size_t n);
/* dst[i] = fl_bf16_to_f32(fl_f32_to_bf16(src[i])): fp32 rounded to bf16 (RNE), kept as fp32.
 * dst may equal src. */
void fl_cvt_f32_round_bf16(float *dst, const float *src, size_t n);
/* The variant the calls take now: "avx512", "avx2" (F16C for fp16) or "scalar". */
const char *fl_cvt_path(void);

#endif

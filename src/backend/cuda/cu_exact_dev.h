/* Device-side helpers shared by the kernels of cu_kernels_train.h (included by .cu files only,
 * after cu_compat.h): fp32 multiply / add with one rounding each and no contraction (nvcc would
 * otherwise fuse a*b+c into an FMA; the emulator is built with -ffp-contract=off), so kernels
 * that must reproduce the CPU backend's bits (8-bit AdamW, the double-quantized absmax) say so
 * explicitly; and bitsandbytes' dynamic code tables (copies of fl_adam8bit_code_signed /
 * _unsigned from src/core/adam8bit.c, checked equal bit for bit by tests/test_cuda_more.c
 * through fl_cuemu_adam8bit_codes and on the GPU by tests/cuda/check_more.c). */
#ifndef FL_CU_EXACT_DEV_H
#define FL_CU_EXACT_DEV_H

#include "backend/cuda/cu_compat.h"

#ifdef __CUDACC__
FL_CU_DEV float fl_cu_mul_rn(float a, float b) { return __fmul_rn(a, b); }
FL_CU_DEV float fl_cu_add_rn(float a, float b) { return __fadd_rn(a, b); }
#else
FL_CU_DEV float fl_cu_mul_rn(float a, float b) { return a * b; }
FL_CU_DEV float fl_cu_add_rn(float a, float b) { return a + b; }
#endif

FL_CU_DEV int fl_cu_isfinite(float x) { return (fl_cu_float_bits(x) & 0x7f800000u) != 0x7f800000u; }
FL_CU_DEV int fl_cu_signbit(float x) { return (int)(fl_cu_float_bits(x) >> 31); }

#include "core/adam8bit_codes.inc"

#ifdef FL_CU_NEED_CODE_SIGNED /* define before including: unused device arrays would be warnings */
/* create_dynamic_map(signed=True), ascending */
static __device__ const float fl_cu_code_signed[256] = {FL_ADAM8BIT_CODE_SIGNED_VALUES};
#endif
#ifdef FL_CU_NEED_CODE_UNSIGNED
/* create_dynamic_map(signed=False), ascending */
static __device__ const float fl_cu_code_unsigned[256] = {FL_ADAM8BIT_CODE_UNSIGNED_VALUES};
#endif
#endif

/* fitllm CUDA kernels the backend object itself needs (src/backend/cuda/cuda-backend-impl.h),
 * beside the op kernels of cu_kernels.h: same two-prefix pattern (fl_cuk_ on the GPU, fl_cuemu_
 * under the emulator), same return convention (0, or the launch's error). */
#ifndef FL_CU_KERNELS_BE_H
#define FL_CU_KERNELS_BE_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FL_CU_DECLARE_BE_KERNELS(P)                                                                          \
    /* dst (rows, cols; row stride ldd, type dt) = src (rows, cols; row stride lds, type st), F32/BF16/F16  \
     * any pair, RNE when narrowing (the panels of the backend's mixed-type GEMMs); -1 for other types */ \
    int P##convert2d(void *dst, fl_dtype dt, size_t ldd, const void *src, fl_dtype st, size_t lds, int rows,  \
                     int cols, void *stream);                                                              \
    /* rows of C (rows, cols; row stride ldc) *= beta (beta 0: set to 0, NaN-safe): a GEMM with K = 0 */    \
    int P##scale2d(float *c, size_t ldc, int rows, int cols, float beta, void *stream);

FL_CU_DECLARE_BE_KERNELS(fl_cuk_)
FL_CU_DECLARE_BE_KERNELS(fl_cuemu_)

#ifdef __cplusplus
}
#endif
#endif

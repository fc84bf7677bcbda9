/* The one kernel of the cuDNN attention path (cuda-cudnn-impl.h): cuDNN's SDPA backward writes
 * dQ, dK, dV as compact 16-bit tensors, while the backend's attention_backward ACCUMULATES into
 * fp32 gradients with row strides; this adds one into the other. */
#include "backend/cuda/cu_compat.h"
#include "backend/cuda/cu_kernels_attn.h"

/* grid (ceil(cols/256), min(rows, 65535)); each block row-strides over rows */
__global__ static void fl_cu_attn_acc2d_k(float *dst, size_t ldd, const uint16_t *src, int bf16, size_t lds, int rows,
                                          int cols) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        uint16_t h = src[(size_t)r * lds + c];
        dst[(size_t)r * ldd + c] += bf16 ? fl_cu_bf16_to_f32(h) : fl_cu_f16_to_f32(h);
    }
}

extern "C" int FL_CUK(attention_acc2d)(float *dst, size_t ldd, const uint16_t *src, fl_dtype st, size_t lds, int rows,
                                       int cols, void *stream) {
    if ((st != FL_BF16 && st != FL_F16) || rows < 0 || cols < 0 || ldd < (size_t)cols || lds < (size_t)cols)
        return FL_CU_ATTN_INVALID;
    if (!rows || !cols) return 0;
    if (!dst || !src) return FL_CU_ATTN_INVALID;
    dim3 grid((unsigned)((cols + 255) / 256), (unsigned)(rows < 65535 ? rows : 65535));
    FL_CU_LAUNCH(fl_cu_attn_acc2d_k, grid, dim3(256), 0, (fl_cu_stream)stream, dst, ldd, src, st == FL_BF16 ? 1 : 0,
                 lds, rows, cols);
    return fl_cu_launch_error();
}

/* Kernels of the backend object itself (cu_kernels_be.h): the strided 2-D conversion behind the
 * mixed-type GEMM panels, and the K = 0 GEMM's scaling of C. */
#include "backend/cuda/cu_compat.h"
#include "backend/cuda/cu_kernels_be.h"

FL_CU_DEV float be_load(const void *p, int t, size_t i) {
    if (t == FL_F32) return ((const float *)p)[i];
    if (t == FL_BF16) return fl_cu_bf16_to_f32(((const uint16_t *)p)[i]);
    return fl_cu_f16_to_f32(((const uint16_t *)p)[i]);
}
FL_CU_DEV void be_store(void *p, int t, size_t i, float v) {
    if (t == FL_F32) ((float *)p)[i] = v;
    else if (t == FL_BF16) ((uint16_t *)p)[i] = fl_cu_f32_to_bf16(v);
    else ((uint16_t *)p)[i] = fl_cu_f32_to_f16(v);
}

/* grid (ceil(cols/256), min(rows, 65535)); each block row-strides over rows */
__global__ static void fl_cu_convert2d_k(void *dst, int dt, size_t ldd, const void *src, int st, size_t lds, int rows,
                                         int cols) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    for (int r = blockIdx.y; r < rows; r += gridDim.y)
        be_store(dst, dt, (size_t)r * ldd + c, be_load(src, st, (size_t)r * lds + c));
}

__global__ static void fl_cu_scale2d_k(float *c, size_t ldc, int rows, int cols, float beta) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        float *p = c + (size_t)r * ldc + j;
        *p = beta == 0.0f ? 0.0f : *p * beta;
    }
}

static int ftype(fl_dtype t) { return t == FL_F32 || t == FL_BF16 || t == FL_F16; }

extern "C" int FL_CUK(convert2d)(void *dst, fl_dtype dt, size_t ldd, const void *src, fl_dtype st, size_t lds, int rows,
                                 int cols, void *stream) {
    if (!ftype(dt) || !ftype(st) || rows < 0 || cols < 0) return -1;
    if (!rows || !cols) return 0;
#if FL_CU_EMULATED
    fl_cu_emu_convert2d_launches++;
#endif
    dim3 grid((unsigned)((cols + 255) / 256), (unsigned)(rows < 65535 ? rows : 65535));
    FL_CU_LAUNCH(fl_cu_convert2d_k, grid, dim3(256), 0, (fl_cu_stream)stream, dst, (int)dt, ldd, src, (int)st, lds,
                 rows, cols);
    return fl_cu_launch_error();
}

extern "C" int FL_CUK(scale2d)(float *c, size_t ldc, int rows, int cols, float beta, void *stream) {
    if (rows < 0 || cols < 0) return -1;
    if (!rows || !cols) return 0;
    dim3 grid((unsigned)((cols + 255) / 256), (unsigned)(rows < 65535 ? rows : 65535));
    FL_CU_LAUNCH(fl_cu_scale2d_k, grid, dim3(256), 0, (fl_cu_stream)stream, c, ldc, rows, cols, beta);
    return fl_cu_launch_error();
}

/* The elementwise pieces of the LoRA ops (backend.h's lora_forward / lora_backward; the CUDA
 * backend composes them with GEMMs as src/backend/cpu/lora.c does): the inverted-dropout input
 * xd = x * mask / (1 - p) and the masked input-gradient update dx += t * mask / (1 - p). The mask
 * is fitllm/lora.h's fl_lora_dropout_keep(seed, i): splitmix64 of seed + (i + 1) * golden, whose
 * top 24 bits as a float in [0, 1) are compared with p. Integer arithmetic and exact float
 * conversions, so the same mask bit for bit as the CPU; the scale 1 / (1 - p) is computed on the
 * host with fl_lora_dropout_scale's expression. The dx update rounds the product and the sum
 * separately (no FMA: the GPU and the emulator agree bit for bit; the CPU build may fuse them,
 * a difference of at most one rounding). Grid-stride, coalesced. */
#include "backend/cuda/cu_compat.h"
#include "backend/cuda/cu_kernels_train.h"
#include "backend/cuda/cu_exact_dev.h"

FL_CU_DEV int lora_keep(uint64_t seed, size_t i, float p) {
    uint64_t z = seed + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f) >= p;
}

__global__ static void fl_cu_lora_dropout_k(float *xd, const float *x, size_t n, float p, float sc, uint64_t seed_arg,
                                            const uint64_t *seed_dev) {
    const uint64_t seed = seed_dev ? *seed_dev : seed_arg;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        xd[i] = lora_keep(seed, i, p) ? x[i] * sc : 0.0f;
}

__global__ static void fl_cu_lora_dropout_dx_k(float *dx, const float *t, size_t n, float p, float sc,
                                               uint64_t seed_arg, const uint64_t *seed_dev) {
    const uint64_t seed = seed_dev ? *seed_dev : seed_arg;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        if (lora_keep(seed, i, p)) dx[i] = fl_cu_add_rn(dx[i], fl_cu_mul_rn(t[i], sc));
}

static unsigned lora_grid(size_t n) {
    size_t b = (n + 255) / 256;
    return (unsigned)(b > 4096 ? 4096 : b);
}

extern "C" int FL_CUK(lora_dropout)(float *xd, const float *x, size_t n, float p, uint64_t seed,
                                    const uint64_t *seed_dev, void *stream) {
    if (!(p > 0.0f && p < 1.0f)) return -1;
    if (n == 0) return 0;
    const float sc = 1.0f / (1.0f - p);
    FL_CU_LAUNCH(fl_cu_lora_dropout_k, dim3(lora_grid(n)), dim3(256), 0, (fl_cu_stream)stream, xd, x, n, p, sc, seed,
                 seed_dev);
    return fl_cu_launch_error();
}

extern "C" int FL_CUK(lora_dropout_dx)(float *dx, const float *t, size_t n, float p, uint64_t seed,
                                       const uint64_t *seed_dev, void *stream) {
    if (!(p > 0.0f && p < 1.0f)) return -1;
    if (n == 0) return 0;
    const float sc = 1.0f / (1.0f - p);
    FL_CU_LAUNCH(fl_cu_lora_dropout_dx_k, dim3(lora_grid(n)), dim3(256), 0, (fl_cu_stream)stream, dx, t, n, p, sc,
                 seed, seed_dev);
    return fl_cu_launch_error();
}

/* The backward's masked input gradient with its product inside (the fused form of lora_dropout_dx after the t = scaling
 * g @ A GEMM): dx[n, c] += (scaling * sum_k g[n, k] A[k, c]) / (1 - p) where keep(n in + c), the sum in k order, every
 * product and sum rounded on its own (no FMA: the GPU and the emulator agree bit for bit). A thread a column, the block
 * rows strided over grid.y: A's column (r values) comes from L1 / L2, g's row is the same for the whole block, dx is
 * read and written once; the dropped elements compute nothing. No temporary: the N x in fp32 t the GEMM wrote and the
 * kernel read back (2 x 64 MiB a TinyLlama adapter and layer) is gone. */
__global__ static void fl_cu_lora_dx_k(float *dx, const float *g, const float *A, int N, int in, int r, float scaling,
                                       float p, float sc, uint64_t seed_arg, const uint64_t *seed_dev) {
    const uint64_t seed = seed_dev ? *seed_dev : seed_arg;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= in) return;
    for (int n = blockIdx.y; n < N; n += gridDim.y) {
        const size_t i = (size_t)n * in + c;
        if (!lora_keep(seed, i, p)) continue;
        const float *gr = g + (size_t)n * r;
        float t = 0.0f;
        for (int k = 0; k < r; k++) t = fl_cu_add_rn(t, fl_cu_mul_rn(gr[k], A[(size_t)k * in + c]));
        dx[i] = fl_cu_add_rn(dx[i], fl_cu_mul_rn(fl_cu_mul_rn(t, scaling), sc));
    }
}

extern "C" int FL_CUK(lora_dx_fused)(float *dx, const float *g, const float *A, int N, int in, int r, float scaling,
                                     float p, uint64_t seed, const uint64_t *seed_dev, void *stream) {
    if (!(p > 0.0f && p < 1.0f) || N < 0 || in < 0 || r < 1) return -1;
    if (N == 0 || in == 0) return 0;
    const float sc = 1.0f / (1.0f - p);
    const unsigned bx = (unsigned)((in + 255) / 256), by = (unsigned)(N < 512 ? N : 512);
    FL_CU_LAUNCH(fl_cu_lora_dx_k, dim3(bx, by), dim3(256), 0, (fl_cu_stream)stream, dx, g, A, N, in, r, scaling, p, sc,
                 seed, seed_dev);
    return fl_cu_launch_error();
}

/* backend.h dropout_rows: rows of w values whose mask indices are r stride + j (the same mask bits as one dropout call
 * per row at a shifted seed; accumulate: the lora_dropout_dx kernel's separate roundings) */
__global__ static void fl_cu_dropout_rows_k(float *y, const float *x, size_t n, size_t w, size_t stride, float p,
                                            float sc, uint64_t seed, int accumulate) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / w, at = r * stride + (i - r * w);
        const int keep = lora_keep(seed, at, p);
        if (accumulate) {
            if (keep) y[i] = fl_cu_add_rn(y[i], fl_cu_mul_rn(x[i], sc));
        } else {
            y[i] = keep ? x[i] * sc : 0.0f;
        }
    }
}

extern "C" int FL_CUK(dropout_rows)(float *y, const float *x, int rows, size_t w, size_t stride, float p, uint64_t seed,
                                    int accumulate, void *stream) {
    if (!(p >= 0.0f && p < 1.0f) || rows < 0 || stride < w) return -1;
    const size_t n = (size_t)rows * w;
    if (n == 0) return 0;
    const float sc = 1.0f / (1.0f - p);
    FL_CU_LAUNCH(fl_cu_dropout_rows_k, dim3(lora_grid(n)), dim3(256), 0, (fl_cu_stream)stream, y, x, n, w, stride, p, sc,
                 seed, accumulate);
    return fl_cu_launch_error();
}

/* RMSNorm forward and backward (LLaMA), semantics of backend.h's rmsnorm_forward/backward.
 *
 * Forward and the input gradient: one block per row, the row's sum of squares (resp. the dot
 * product of backward) by a block reduction (warp shuffles, then one value per warp through
 * shared memory). The weight gradient is a sum over rows: one thread per column walks the rows
 * in order (deterministic without atomics; reads are coalesced across the warp's columns). Sums
 * in float: a row of a few thousand values loses ~1e-6 relative, inside the op tests' 1e-5. */
#include "backend/cuda/cu_compat.h"
#include "backend/cuda/cu_kernels.h"

/* Threads per row block: a multiple of 32 covering C, at most 256. */
static unsigned row_threads(int C) {
    unsigned t = ((unsigned)C + 31u) & ~31u;
    return t > 256u ? 256u : (t ? t : 32u);
}

static __global__ void fl_cu_rmsnorm_fwd_k(float *out, float *rstd, const float *inp, const float *w, int C, float eps) {
    __shared__ float buf[32];
    size_t row = blockIdx.x;
    const float *x = inp + row * C;
    float *o = out + row * C;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) ss += x[c] * x[c];
    ss = fl_cu_block_sum(ss, buf);
    float r = 1.0f / sqrtf(ss / (float)C + eps); /* not rsqrtf: approximate on the GPU */
    for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = x[c] * r * w[c];
    if (threadIdx.x == 0 && rstd) rstd[row] = r;
}

/* dx += r * (dy*w - x*r * mean(dy*w * x*r)) */
static __global__ void fl_cu_rmsnorm_bwd_dx_k(float *dinp, const float *dout, const float *inp, const float *w,
                                       const float *rstd, int C) {
    __shared__ float buf[32];
    size_t row = blockIdx.x;
    const float *x = inp + row * C, *dy = dout + row * C;
    float *dx = dinp + row * C;
    float r = rstd[row], dot = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) dot += (dy[c] * w[c]) * (x[c] * r);
    float mdot = fl_cu_block_sum(dot, buf) / (float)C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) dx[c] += r * (dy[c] * w[c] - x[c] * r * mdot);
}

/* dw[c] += sum over rows n of dy[n,c] * x[n,c] * r[n] */
static __global__ void fl_cu_rmsnorm_bwd_dw_k(float *dw, const float *dout, const float *inp, const float *rstd, int N,
                                       int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float acc = 0.0f;
    for (int n = 0; n < N; n++) acc += dout[(size_t)n * C + c] * (inp[(size_t)n * C + c] * rstd[n]);
    dw[c] += acc;
}

extern "C" int FL_CUK(rmsnorm_forward)(float *out, float *rstd, const float *inp, const float *w, int N, int C,
                                       float eps, void *stream) {
    if (N <= 0 || C <= 0) return 0;
    FL_CU_LAUNCH(fl_cu_rmsnorm_fwd_k, dim3((unsigned)N), dim3(row_threads(C)), 0, (fl_cu_stream)stream, out, rstd,
                 inp, w, C, eps);
    return fl_cu_launch_error();
}

extern "C" int FL_CUK(rmsnorm_backward)(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                                        const float *rstd, int N, int C, void *stream) {
    if (N <= 0 || C <= 0) return 0;
    if (dinp)
        FL_CU_LAUNCH(fl_cu_rmsnorm_bwd_dx_k, dim3((unsigned)N), dim3(row_threads(C)), 0, (fl_cu_stream)stream, dinp,
                     dout, inp, w, rstd, C);
    if (dw)
        FL_CU_LAUNCH(fl_cu_rmsnorm_bwd_dw_k, dim3((unsigned)(C + 127) / 128), dim3(128), 0, (fl_cu_stream)stream, dw,
                     dout, inp, rstd, N, C);
    return fl_cu_launch_error();
}

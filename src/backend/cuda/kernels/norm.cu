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

__global__ static void fl_cu_rmsnorm_fwd_k(float *out, float *rstd, const float *inp, const float *w, int C, float eps) {
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
__global__ static void fl_cu_rmsnorm_bwd_dx_k(float *dinp, const float *dout, const float *inp, const float *w,
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
__global__ static void fl_cu_rmsnorm_bwd_dw_k(float *dw, const float *dout, const float *inp, const float *rstd, int N,
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

/* ---- LayerNorm (GPT-2): two block sums per row (mean, then the two-pass variance) ---------------- */

__global__ static void fl_cu_layernorm_fwd_k(float *out, float *mean, float *rstd, const float *inp, const float *w,
                                             const float *b, int C, float eps) {
    __shared__ float buf[32];
    size_t row = blockIdx.x;
    const float *x = inp + row * C;
    float *o = out + row * C;
    float s = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += x[c];
    float m = fl_cu_block_sum(s, buf) / (float)C;
    float v = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) v += (x[c] - m) * (x[c] - m);
    float r = 1.0f / sqrtf(fl_cu_block_sum(v, buf) / (float)C + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = (x[c] - m) * r * w[c] + (b ? b[c] : 0.0f);
    if (threadIdx.x == 0) {
        if (mean) mean[row] = m;
        if (rstd) rstd[row] = r;
    }
}

/* dx += r * (dy*w - mean(dy*w) - xhat * mean(dy*w * xhat)) */
__global__ static void fl_cu_layernorm_bwd_dx_k(float *dinp, const float *dout, const float *inp, const float *w,
                                                const float *mean, const float *rstd, int C) {
    __shared__ float buf[32];
    size_t row = blockIdx.x;
    const float *x = inp + row * C, *dy = dout + row * C;
    float *dx = dinp + row * C;
    float m = mean[row], r = rstd[row], s1 = 0.0f, s2 = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float g = dy[c] * w[c];
        s1 += g;
        s2 += g * ((x[c] - m) * r);
    }
    float m1 = fl_cu_block_sum(s1, buf) / (float)C;
    float m2 = fl_cu_block_sum(s2, buf) / (float)C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) dx[c] += r * (dy[c] * w[c] - m1 - (x[c] - m) * r * m2);
}

__global__ static void fl_cu_layernorm_bwd_dwdb_k(float *dw, float *db, const float *dout, const float *inp,
                                                  const float *mean, const float *rstd, int N, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float aw = 0.0f, ab = 0.0f;
    for (int n = 0; n < N; n++) {
        float d = dout[(size_t)n * C + c];
        aw += d * ((inp[(size_t)n * C + c] - mean[n]) * rstd[n]);
        ab += d;
    }
    if (dw) dw[c] += aw;
    if (db) db[c] += ab;
}

extern "C" int FL_CUK(layernorm_forward)(float *out, float *mean, float *rstd, const float *inp, const float *w,
                                         const float *b, int N, int C, float eps, void *stream) {
    if (N <= 0 || C <= 0) return 0;
    FL_CU_LAUNCH(fl_cu_layernorm_fwd_k, dim3((unsigned)N), dim3(row_threads(C)), 0, (fl_cu_stream)stream, out, mean,
                 rstd, inp, w, b, C, eps);
    return fl_cu_launch_error();
}

extern "C" int FL_CUK(layernorm_backward)(float *dinp, float *dw, float *db, const float *dout, const float *inp,
                                          const float *w, const float *mean, const float *rstd, int N, int C,
                                          void *stream) {
    if (N <= 0 || C <= 0) return 0;
    if (dinp)
        FL_CU_LAUNCH(fl_cu_layernorm_bwd_dx_k, dim3((unsigned)N), dim3(row_threads(C)), 0, (fl_cu_stream)stream, dinp,
                     dout, inp, w, mean, rstd, C);
    if (dw || db)
        FL_CU_LAUNCH(fl_cu_layernorm_bwd_dwdb_k, dim3((unsigned)(C + 127) / 128), dim3(128), 0, (fl_cu_stream)stream,
                     dw, db, dout, inp, mean, rstd, N, C);
    return fl_cu_launch_error();
}

/* The vocabulary-parallel cross-entropy's halves on the device (backend.h's vocab_stats / vocab_xent; issue 35,
 * src/model/tp_vocab.c): a rank's row statistics of its logits slice, then, after the group's all-gather of them
 * (NCCL on the device: nothing goes through the host), each row's loss and the slice's gradient.
 *
 * One block per row (a power of two of threads, <= 256). vocab_stats: each thread's max over its strided share, the
 * block's max by a tree in shared memory (a max is exact in any order); then each thread's sum of exp(l - max) in
 * double, summed by a tree of fixed shape (deterministic: the same bits every run; not the CPU's sequential order,
 * which is within double rounding of it). vocab_xent: every thread combines the P ranks' statistics of its row in rank
 * order (a few doubles) and writes its share of the gradient; the target's column is written by the one thread that
 * reads it (dlogits may alias logits), its grad_scale subtracted after the product is rounded (no FMA: the CPU's two
 * roundings). EXPERIMENTAL: emulator-verified (no GPU has run it). */
#include "backend/cuda/cu_compat.h"
#include "backend/cuda/cu_kernels_train.h"
#include "backend/cuda/cu_exact_dev.h"

#define FL_VX_THREADS 256

__global__ static void fl_cu_vocab_stats_k(double *stats, const float *logits, const int32_t *targets, int n, int lo) {
    __shared__ float sm[FL_VX_THREADS];
    __shared__ double ss[FL_VX_THREADS];
    const size_t row = blockIdx.x;
    const float *x = logits + row * (size_t)n;
    const int tid = threadIdx.x, bd = blockDim.x;
    float m = -INFINITY;
    for (int v = tid; v < n; v += bd) m = x[v] > m ? x[v] : m;
    sm[tid] = m;
    __syncthreads();
    for (int s = bd / 2; s > 0; s >>= 1) {
        if (tid < s) sm[tid] = sm[tid + s] > sm[tid] ? sm[tid + s] : sm[tid];
        __syncthreads();
    }
    const float mx = sm[0];
    double sum = 0;
    for (int v = tid; v < n; v += bd) sum += exp((double)x[v] - (double)mx);
    ss[tid] = sum;
    __syncthreads();
    for (int s = bd / 2; s > 0; s >>= 1) {
        if (tid < s) ss[tid] = ss[tid] + ss[tid + s];
        __syncthreads();
    }
    if (tid == 0) {
        const int t = targets[row] - lo;
        stats[3 * row] = mx, stats[3 * row + 1] = ss[0], stats[3 * row + 2] = t >= 0 && t < n ? x[t] : 0.0f;
    }
}

__global__ static void fl_cu_vocab_xent_k(float *loss, float *dlogits, const float *logits, const double *all,
                                          const int32_t *targets, int rows, int n, int lo, int P, int me, int V,
                                          float grad_scale, int ignore_index) {
    const size_t row = blockIdx.x;
    const int tid = threadIdx.x, bd = blockDim.x, tg = targets[row];
    float *dx = dlogits ? dlogits + row * (size_t)n : NULL;
    const float *x = logits + row * (size_t)n;
    if (tg == ignore_index) { /* the whole block takes this branch */
        if (tid == 0) loss[row] = 0.0f;
        for (int v = tid; dx && v < n; v += bd) dx[v] = 0.0f;
        return;
    }
    double M = -INFINITY, S = 0;
    for (int k = 0; k < P; k++) M = all[((size_t)k * rows + row) * 3] > M ? all[((size_t)k * rows + row) * 3] : M;
    for (int k = 0; k < P; k++)
        S += all[((size_t)k * rows + row) * 3 + 1] * exp(all[((size_t)k * rows + row) * 3] - M);
    int owner = -1;
    for (int k = 0; k < P; k++)
        if (tg >= (int)((long long)k * V / P) && tg < (int)((long long)(k + 1) * V / P)) owner = k;
    const float lse = (float)M + (float)log(S);
    const float xt = owner >= 0 ? (float)all[((size_t)owner * rows + row) * 3 + 2] : 0.0f;
    if (tid == 0) loss[row] = lse - xt;
    if (!dx) return;
    const int at = owner == me ? tg - lo : -1;
    for (int v = tid; v < n; v += bd) {
        float d = fl_cu_mul_rn(grad_scale, (float)exp((double)x[v] - (double)lse));
        if (v == at) d = fl_cu_add_rn(d, -grad_scale);
        dx[v] = d;
    }
}

static unsigned vx_threads(int n) {
    unsigned t = 32;
    while (t < FL_VX_THREADS && t < (unsigned)n) t <<= 1;
    return t;
}

extern "C" int FL_CUK(vocab_stats)(double *stats, const float *logits, const int32_t *targets, int rows, int n, int lo,
                                   void *stream) {
    if (rows < 0 || n <= 0) return -1;
    if (rows == 0) return 0;
    FL_CU_LAUNCH(fl_cu_vocab_stats_k, dim3((unsigned)rows), dim3(vx_threads(n)), 0, (fl_cu_stream)stream, stats, logits,
                 targets, n, lo);
    return fl_cu_launch_error();
}

extern "C" int FL_CUK(vocab_xent)(float *loss, float *dlogits, const float *logits, const double *all,
                                  const int32_t *targets, int rows, int n, int lo, int P, int me, int V,
                                  float grad_scale, int ignore_index, void *stream) {
    if (rows < 0 || n <= 0 || P <= 0 || me < 0 || me >= P || V < P) return -1;
    if (rows == 0) return 0;
    FL_CU_LAUNCH(fl_cu_vocab_xent_k, dim3((unsigned)rows), dim3(vx_threads(n)), 0, (fl_cu_stream)stream, loss, dlogits,
                 logits, all, targets, rows, n, lo, P, me, V, grad_scale, ignore_index);
    return fl_cu_launch_error();
}

/* Fused softmax cross-entropy over a vocabulary row, semantics of backend.h's cross_entropy.
 *
 * One block per row. Each thread keeps an online (max m, sum s = sum exp(x - m)) over its
 * strided share of the row, the pairs are merged across the warp by shuffles and across warps
 * through shared memory (every thread merges the per-warp pairs in warp order: the same lse in
 * all threads, deterministic). dlogits may alias logits: the target logit is read into shared
 * memory before the barrier that precedes every write. With dlogits16 (cross_entropy_dbf16) the gradient is
 * written as bf16 only (RNE of the same fp32 value): the LM head's bf16 GEMMs read it, and no fp32 (N, V) gradient
 * is written and read back by a convert (issue 30 item 4). */
#include "backend/cuda/cu_compat.h"
#include "backend/cuda/cu_kernels.h"

/* (m, s) <- merge of (m, s) and (m2, s2); an empty side has m = -inf and s = 0. */
FL_CU_DEV void fl_cu_lse_merge(float *m, float *s, float m2, float s2) {
    float M = fmaxf(*m, m2);
    if (M == -INFINITY) return; /* both empty */
    *s = *s * expf(*m - M) + s2 * expf(m2 - M);
    *m = M;
}

__global__ static void fl_cu_xent_k(float *loss, float *dlogits, uint16_t *dlogits16, const float *logits,
                                    const int32_t *targets, int V, float grad_scale_arg, const float *grad_scale_dev,
                                    int ignore_index) {
    __shared__ float wm[32], ws[32], xt;
    const float grad_scale = grad_scale_dev ? *grad_scale_dev : grad_scale_arg;
    size_t row = blockIdx.x;
    const float *x = logits + row * V;
    float *dx = dlogits ? dlogits + row * V : NULL;
    uint16_t *dx16 = dlogits16 ? dlogits16 + row * V : NULL;
    int tgt = targets[row];
    if (tgt == ignore_index) { /* the whole block takes this branch */
        if (threadIdx.x == 0) loss[row] = 0.0f;
        for (int v = threadIdx.x; (dx || dx16) && v < V; v += blockDim.x) {
            if (dx) dx[v] = 0.0f;
            else dx16[v] = 0; /* +0.0 */
        }
        return;
    }
    float m = -INFINITY, s = 0.0f;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        float xv = x[v];
        if (xv > m) {
            s = s * expf(m - xv) + 1.0f; /* m = -inf first: s is 0 */
            m = xv;
        } else {
            s += expf(xv - m);
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(FL_CU_FULL_MASK, m, o), s2 = __shfl_xor_sync(FL_CU_FULL_MASK, s, o);
        fl_cu_lse_merge(&m, &s, m2, s2);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarp = blockDim.x >> 5;
    if (lane == 0) {
        wm[warp] = m;
        ws[warp] = s;
    }
    if (threadIdx.x == 0) xt = x[tgt];
    __syncthreads(); /* the pairs are complete and x[tgt] is read before anyone writes dx (may alias x) */
    m = wm[0];
    s = ws[0];
    for (int i = 1; i < nwarp; i++) fl_cu_lse_merge(&m, &s, wm[i], ws[i]);
    float lse = m + logf(s);
    if (threadIdx.x == 0) loss[row] = lse - xt;
    if (dx || dx16)
        for (int v = threadIdx.x; v < V; v += blockDim.x) {
            float d = grad_scale * expf(x[v] - lse);
            if (v == tgt) d -= grad_scale;
            if (dx) dx[v] = d;
            else dx16[v] = fl_cu_f32_to_bf16(d);
        }
}

static int xent_launch(float *loss, float *dlogits, uint16_t *dlogits16, const float *logits, const int32_t *targets,
                       int N, int V, float grad_scale, const float *grad_scale_dev, int ignore_index, void *stream) {
    if (N <= 0 || V <= 0) return 0;
    unsigned t = ((unsigned)V + 31u) & ~31u;
    if (t > 256u) t = 256u;
    FL_CU_LAUNCH(fl_cu_xent_k, dim3((unsigned)N), dim3(t), 0, (fl_cu_stream)stream, loss, dlogits, dlogits16, logits,
                 targets, V, grad_scale, grad_scale_dev, ignore_index);
    return fl_cu_launch_error();
}

extern "C" int FL_CUK(cross_entropy)(float *loss, float *dlogits, const float *logits, const int32_t *targets, int N,
                                     int V, float grad_scale, int ignore_index, void *stream) {
    return xent_launch(loss, dlogits, NULL, logits, targets, N, V, grad_scale, NULL, ignore_index, stream);
}

extern "C" int FL_CUK(cross_entropy_dbf16)(float *loss, void *dlogits16, const float *logits, const int32_t *targets,
                                           int N, int V, float grad_scale, int ignore_index, void *stream) {
    return xent_launch(loss, NULL, (uint16_t *)dlogits16, logits, targets, N, V, grad_scale, NULL, ignore_index,
                       stream);
}

extern "C" int FL_CUK(cross_entropy_dev)(float *loss, float *dlogits, void *dlogits16, const float *logits,
                                         const int32_t *targets, int N, int V, const float *grad_scale,
                                         int ignore_index, void *stream) {
    return xent_launch(loss, dlogits, (uint16_t *)dlogits16, logits, targets, N, V, 0.0f, grad_scale, ignore_index,
                       stream);
}

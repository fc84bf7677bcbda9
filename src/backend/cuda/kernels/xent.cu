/* Fused softmax cross-entropy over a vocabulary row, semantics of backend.h's cross_entropy.
 *
 * Split over the row (the 2026-11-30 18:00 wave; one block per row with an online max / sum ran 262 blocks per
 * TinyLlama head chunk, 97 us for 33.5 MB of logits on an H200). A row of V is cut into S = ceil(V / (8 T)) chunks
 * of 8 T columns, T = min(256, V / 8 rounded up to a warp) threads per block; thread t holds the chunk's columns
 * 4 t .. 4 t + 3 and 4 T + 4 t .. 4 T + 4 t + 3 (two 128-bit loads where V % 4 == 0 and the rows are aligned, else
 * the same 8 columns one by one: the same values, the same sums). Two launches of grid (S, rows):
 *   1. fl_cu_xent_stats_k: the chunk's max M (exact in any order), then sum exp(x - M) over it (each thread its 8
 *      values in order, then fl_cu_block_sum's fixed order); (M, sum) into work, and the target logit (read here,
 *      before any gradient is written: dlogits may alias logits);
 *   2. fl_cu_xent_grad_k: every warp merges the row's S pairs the same way (lane l takes the chunks l, l + 32, ...
 *      in order, then a fixed xor tree): lse = M + log(sum); the chunk's gradient grad_scale * exp(x - lse), minus
 *      grad_scale at the target (each thread writes the elements it read). Chunk 0's thread 0 writes the loss.
 * Each element's exp is taken once per launch, no data-dependent branch; every order is a function of (V) alone.
 * The work holds (2 S + 1) floats per row; rows go in groups that fit FL_CU_NORM_WORK_BYTES (each row on its own:
 * the grouping changes no bits). With dlogits16 (cross_entropy_dbf16) the gradient is written as bf16 only (RNE of
 * the same fp32 value): the LM head's bf16 GEMMs read it, and no fp32 (N, V) gradient is written and read back by
 * a convert (issue 30 item 4). Rows may be padded (cross_entropy_dbf16 / _dev's ld > V: the LM head's logits rows of
 * a vocabulary such as GPT-2's 50,257 padded to a multiple of 8, so that its GEMMs' operands stay 16-byte aligned):
 * the kernels read and write columns 0 .. V-1 of each row only. */
#include "backend/cuda/cu_compat.h"
#include "backend/cuda/cu_kernels.h"

/* threads per chunk block for a row of V (a multiple of 32 in [32, 256]); a chunk is 8 of them wide */
static int xent_threads(int V) {
    int t = ((V + 7) / 8 + 31) & ~31;
    return t < 32 ? 32 : t > 256 ? 256 : t;
}
/* the thread's 8 columns of its chunk (their indices in ix; past the row: -inf). vec: 128-bit loads of runs of 4 that
 * lie wholly in the row (a row of V % 4 != 0 in padded rows, ld % 4 == 0, takes its last run one by one: no column
 * past V is read) */
FL_CU_DEV void xent_load(const float *x, int base, int V, int vec, float *v, int *ix) {
    const int T = (int)blockDim.x, t = (int)threadIdx.x;
    FL_CU_UNROLL
    for (int h = 0; h < 2; h++) {
        const int c = base + h * 4 * T + 4 * t;
        for (int k = 0; k < 4; k++) ix[4 * h + k] = c + k;
        if (vec && c + 3 < V) {
            fl_cu_ld4(x + c, v + 4 * h);
        } else {
            for (int k = 0; k < 4; k++) v[4 * h + k] = c + k < V ? x[c + k] : -INFINITY;
        }
    }
}
/* the block's max (every thread gets it; buf: 32 floats of shared memory, free again on return) */
FL_CU_DEV float xent_block_max(float v, float *buf) {
    const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5, nwarp = (int)blockDim.x >> 5;
    v = fl_cu_warp_max(v);
    if (lane == 0) buf[warp] = v;
    __syncthreads();
    v = fl_cu_warp_max(lane < nwarp ? buf[lane] : -INFINITY);
    __syncthreads();
    return v;
}

/* st: per row (2 S + 1) floats: (M, sum) of each chunk, then the target's logit */
__global__ static void fl_cu_xent_stats_k(float *st, const float *logits, const int32_t *targets, int V, int ld,
                                          int S, int ignore_index, int vec) {
    __shared__ float buf[32];
    const size_t row = blockIdx.y;
    const int tgt = targets[row], chunk = (int)blockIdx.x, base = chunk * 8 * (int)blockDim.x;
    if (tgt == ignore_index) return; /* the whole block takes this branch */
    const float *x = logits + row * ld;
    float v[8], m = -INFINITY, s = 0.0f;
    int ix[8];
    xent_load(x, base, V, vec, v, ix);
    FL_CU_UNROLL
    for (int k = 0; k < 8; k++) m = fmaxf(m, v[k]);
    m = xent_block_max(m, buf);
    FL_CU_UNROLL
    for (int k = 0; k < 8; k++) s += ix[k] < V ? expf(v[k] - m) : 0.0f;
    s = fl_cu_block_sum(s, buf);
    float *o = st + row * (size_t)(2 * S + 1);
    if (threadIdx.x == 0) {
        o[2 * chunk] = m;
        o[2 * chunk + 1] = s;
        if (tgt >= base && tgt < base + 8 * (int)blockDim.x) o[2 * S] = x[tgt];
    }
}

__global__ static void fl_cu_xent_grad_k(float *loss, float *dlogits, uint16_t *dlogits16, const float *st,
                                         const float *logits, const int32_t *targets, int V, int ld, int S,
                                         float grad_scale_arg, const float *grad_scale_dev, int ignore_index,
                                         int vec) {
    const size_t row = blockIdx.y;
    const int tgt = targets[row], chunk = (int)blockIdx.x, base = chunk * 8 * (int)blockDim.x;
    const int T = (int)blockDim.x, t = (int)threadIdx.x;
    float *dx = dlogits ? dlogits + row * ld : NULL;
    uint16_t *dx16 = dlogits16 ? dlogits16 + row * ld : NULL;
    float d[8];
    int ix[8];
    if (tgt == ignore_index) { /* the whole block takes this branch */
        if (chunk == 0 && t == 0) loss[row] = 0.0f;
        FL_CU_UNROLL
        for (int k = 0; k < 8; k++) d[k] = 0.0f; /* +0.0 */
    } else {
        const float grad_scale = grad_scale_dev ? *grad_scale_dev : grad_scale_arg;
        const float *o = st + row * (size_t)(2 * S + 1);
        const int lane = t & 31;
        float m = -INFINITY, s = 0.0f;
        for (int k = lane; k < S; k += 32) m = fmaxf(m, o[2 * k]);
        m = fl_cu_warp_max(m);
        for (int k = lane; k < S; k += 32) s += o[2 * k + 1] * expf(o[2 * k] - m);
        s = fl_cu_warp_sum(s);
        const float lse = m + logf(s);
        if (chunk == 0 && t == 0) loss[row] = lse - o[2 * S];
        if (!dx && !dx16) return;
        xent_load(logits + row * ld, base, V, vec, d, ix);
        FL_CU_UNROLL
        for (int k = 0; k < 8; k++) {
            d[k] = grad_scale * expf(d[k] - lse);
            if (ix[k] == tgt) d[k] -= grad_scale;
        }
    }
    FL_CU_UNROLL
    for (int h = 0; h < 2 && (dx || dx16); h++) {
        const int c = base + h * 4 * T + 4 * t;
        float *dh = d + 4 * h;
        if (vec && c + 3 < V) {
            if (dx) fl_cu_st4(dx + c, dh);
            else fl_cu_keep16x4(dx16, (size_t)c, dh);
        } else {
            for (int k = 0; k < 4 && c + k < V; k++) {
                if (dx) dx[c + k] = dh[k];
                else dx16[c + k] = fl_cu_f32_to_bf16(dh[k]);
            }
        }
    }
}

/* ld: the row stride of logits and of the gradient (>= V; the LM head's padded rows, fl_logits_ld): columns V .. ld-1
 * are neither read nor written */
static int xent_launch(float *loss, float *dlogits, uint16_t *dlogits16, const float *logits, const int32_t *targets,
                       int N, int V, int ld, float grad_scale, const float *grad_scale_dev, int ignore_index, void *work,
                       void *stream) {
    if (N <= 0 || V <= 0) return 0;
    if (ld < V) return -1;
    const int T = xent_threads(V), S = (V + 8 * T - 1) / (8 * T);
    const size_t row_bytes = (size_t)(2 * S + 1) * sizeof(float);
    if (!work || row_bytes > FL_CU_NORM_WORK_BYTES) return -1;
    const size_t g = FL_CU_NORM_WORK_BYTES / row_bytes;
    const int G = g > 65535 ? 65535 : (int)g; /* rows per group (a grid's y: at most 65535) */
    const int vec = ld % 4 == 0 && fl_cu_aligned16(logits, dlogits, NULL, NULL, NULL) &&
                    ((uintptr_t)dlogits16 & 7u) == 0;
    for (int r0 = 0; r0 < N; r0 += G) {
        const int rows = N - r0 < G ? N - r0 : G;
        const size_t off = (size_t)r0 * ld;
        FL_CU_LAUNCH(fl_cu_xent_stats_k, dim3((unsigned)S, (unsigned)rows), dim3((unsigned)T), 0, (fl_cu_stream)stream,
                     (float *)work, logits + off, targets + r0, V, ld, S, ignore_index, vec);
        FL_CU_LAUNCH(fl_cu_xent_grad_k, dim3((unsigned)S, (unsigned)rows), dim3((unsigned)T), 0, (fl_cu_stream)stream,
                     loss + r0, dlogits ? dlogits + off : NULL, dlogits16 ? dlogits16 + off : NULL,
                     (const float *)work, logits + off, targets + r0, V, ld, S, grad_scale, grad_scale_dev,
                     ignore_index, vec);
    }
    return fl_cu_launch_error();
}

extern "C" int FL_CUK(cross_entropy)(float *loss, float *dlogits, const float *logits, const int32_t *targets, int N,
                                     int V, float grad_scale, int ignore_index, void *work, void *stream) {
    return xent_launch(loss, dlogits, NULL, logits, targets, N, V, V, grad_scale, NULL, ignore_index, work, stream);
}

extern "C" int FL_CUK(cross_entropy_dbf16)(float *loss, void *dlogits16, const float *logits, const int32_t *targets,
                                           int N, int V, int ld, float grad_scale, int ignore_index, void *work,
                                           void *stream) {
    return xent_launch(loss, NULL, (uint16_t *)dlogits16, logits, targets, N, V, ld, grad_scale, NULL, ignore_index,
                       work, stream);
}

extern "C" int FL_CUK(cross_entropy_dev)(float *loss, float *dlogits, void *dlogits16, const float *logits,
                                         const int32_t *targets, int N, int V, int ld, const float *grad_scale,
                                         int ignore_index, void *work, void *stream) {
    return xent_launch(loss, dlogits, (uint16_t *)dlogits16, logits, targets, N, V, ld, 0.0f, grad_scale, ignore_index,
                       work, stream);
}

/* Token (+ position) embedding forward and backward, semantics of backend.h's embedding_forward /
 * embedding_backward (reference: src/backend/cpu/embedding.c).
 *
 * Forward: one block per token row, columns across the threads (coalesced copy-add).
 *
 * Backward into dwte: ids repeat, so a row-parallel scatter would race, and float atomics would
 * make the sums depend on timing. Instead, without atomics and without a sort:
 *   1. rank: for every token n, less(n) = #{j : ids[j] < ids[n]}, before(n) = #{j < n : ids[j] ==
 *      ids[n]} and count(n) = #{j : ids[j] == ids[n]} (integer counts: exact in any order). A block
 *      takes 32 tokens (one per lane) and its 8 warps scan 8 slices of ids, 32 at a time through a
 *      warp shuffle; the slices' counts are added in shared memory. O(N^2) compares, spread over
 *      N/32 blocks of 8 warps: ~2M warp steps at N = 8192 (tens of microseconds on an H100).
 *      Then perm[less + before] = n is the stable order of the tokens by id (a permutation, so
 *      the scatter is race-free), and each id's first token n (before == 0) owns its group:
 *      start(n) = less(n), count(n).
 *   2. sum: one block per (token, 256-column slice); blocks of tokens that do not own a group
 *      exit at once. The owner's threads walk the group in token order, dwte[v, c] += dout[m, c]
 *      for m = perm[start], perm[start+1], ...: exactly the CPU's fp32 additions in its order
 *      (dwte + g_first + g_second + ...), so the same bits. Four group members at a time are
 *      loaded before they are added (memory parallelism on long groups of frequent tokens).
 * Backward into dwpe: one thread per (t, c) adds the batch rows in order (the CPU's order). */
#include "backend/cuda/cu_compat.h"
#include "backend/cuda/cu_kernels_more.h"

__global__ static void fl_cu_emb_fwd_k(float *out, const int32_t *ids, const float *wte, const float *wpe, int T,
                                       int C) {
    size_t n = blockIdx.x;
    const float *e = wte + (size_t)ids[n] * C;
    float *o = out + n * C;
    if (wpe) {
        const float *p = wpe + (n % (size_t)T) * C;
        for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = e[c] + p[c];
    } else {
        for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = e[c];
    }
}

#define EMB_RANK_WARPS 8

/* work = perm[N] | start[N] | count[N] (count 0: not a group owner) */
__global__ static void fl_cu_emb_rank_k(int32_t *work, const int32_t *ids, int N) {
    __shared__ int sl[EMB_RANK_WARPS][32], sb[EMB_RANK_WARPS][32], sc[EMB_RANK_WARPS][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n = blockIdx.x * 32 + lane;
    const int me = n < N ? ids[n] : 0;
    /* this warp's slice of j: [j0, j1), whole tiles of 32 */
    const int tiles = (N + 31) / 32, per = (tiles + EMB_RANK_WARPS - 1) / EMB_RANK_WARPS;
    const int j0 = warp * per * 32, j1 = (warp + 1) * per * 32 < N ? (warp + 1) * per * 32 : N;
    int less = 0, before = 0, count = 0;
    for (int jt = j0; jt < j1; jt += 32) {
        const int mine = jt + lane < N ? ids[jt + lane] : 0;
        const int w = j1 - jt < 32 ? j1 - jt : 32; /* the same for every lane: the shuffles stay convergent */
        for (int s = 0; s < w; s++) {
            const int id = __shfl_sync(FL_CU_FULL_MASK, mine, s);
            less += id < me;
            const int eq = id == me;
            count += eq;
            before += eq & (jt + s < n);
        }
    }
    sl[warp][lane] = less;
    sb[warp][lane] = before;
    sc[warp][lane] = count;
    __syncthreads();
    if (warp == 0 && n < N) {
        for (int w = 1; w < EMB_RANK_WARPS; w++) {
            less += sl[w][lane];
            before += sb[w][lane];
            count += sc[w][lane];
        }
        work[less + before] = n;          /* perm */
        work[(size_t)N + n] = less;       /* start */
        work[2 * (size_t)N + n] = before == 0 ? count : 0;
    }
}

#define EMB_COLS 256 /* columns per sum block: 64 threads x 4 */

__global__ static void fl_cu_emb_bwd_wte_k(float *dwte, const float *dout, const int32_t *ids, const int32_t *work,
                                           int N, int C) {
    const int n = blockIdx.x;
    const int cnt = work[2 * (size_t)N + n];
    if (cnt == 0) return; /* the whole block: not the owner of its id's group */
    const int32_t *perm = work + work[(size_t)N + n];
    const int c0 = blockIdx.y * EMB_COLS + threadIdx.x;
    float *d = dwte + (size_t)ids[n] * C;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    const int ok0 = c0 < C, ok1 = c0 + 64 < C, ok2 = c0 + 128 < C, ok3 = c0 + 192 < C;
    if (ok0) a0 = d[c0];
    if (ok1) a1 = d[c0 + 64];
    if (ok2) a2 = d[c0 + 128];
    if (ok3) a3 = d[c0 + 192];
    int k = 0;
    for (; k + 4 <= cnt; k += 4) {
        const float *g[4];
        for (int u = 0; u < 4; u++) g[u] = dout + (size_t)perm[k + u] * C + c0;
        float x[4][4];
        for (int u = 0; u < 4; u++) {
            x[u][0] = ok0 ? g[u][0] : 0.0f;
            x[u][1] = ok1 ? g[u][64] : 0.0f;
            x[u][2] = ok2 ? g[u][128] : 0.0f;
            x[u][3] = ok3 ? g[u][192] : 0.0f;
        }
        for (int u = 0; u < 4; u++) { /* in token order */
            a0 += x[u][0];
            a1 += x[u][1];
            a2 += x[u][2];
            a3 += x[u][3];
        }
    }
    for (; k < cnt; k++) {
        const float *g = dout + (size_t)perm[k] * C + c0;
        if (ok0) a0 += g[0];
        if (ok1) a1 += g[64];
        if (ok2) a2 += g[128];
        if (ok3) a3 += g[192];
    }
    if (ok0) d[c0] = a0;
    if (ok1) d[c0 + 64] = a1;
    if (ok2) d[c0 + 128] = a2;
    if (ok3) d[c0 + 192] = a3;
}

__global__ static void fl_cu_emb_bwd_wpe_k(float *dwpe, const float *dout, int B, int T, int C) {
    const size_t TC = (size_t)T * C;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < TC; i += (size_t)gridDim.x * blockDim.x) {
        float s = dwpe[i];
        for (int b = 0; b < B; b++) s += dout[(size_t)b * TC + i];
        dwpe[i] = s;
    }
}

extern "C" int FL_CUK(embedding_forward)(float *out, const int32_t *ids, const float *wte, const float *wpe, int B,
                                         int T, int C, void *stream) {
    if (B <= 0 || T <= 0 || C <= 0) return 0;
    unsigned th = ((unsigned)C + 31u) & ~31u;
    FL_CU_LAUNCH(fl_cu_emb_fwd_k, dim3((unsigned)(B * T)), dim3(th > 256u ? 256u : th), 0, (fl_cu_stream)stream, out,
                 ids, wte, wpe, T, C);
    return fl_cu_launch_error();
}

extern "C" int FL_CUK(embedding_backward)(float *dwte, float *dwpe, const float *dout, const int32_t *ids, int B, int T,
                                          int C, int32_t *work, void *stream) {
    if (B <= 0 || T <= 0 || C <= 0) return 0;
    const int N = B * T;
    if (dwte) {
        if (!work || (C + EMB_COLS - 1) / EMB_COLS > 65535) return -1;
        FL_CU_LAUNCH(fl_cu_emb_rank_k, dim3((unsigned)(N + 31) / 32), dim3(32 * EMB_RANK_WARPS), 0,
                     (fl_cu_stream)stream, work, ids, N);
        FL_CU_LAUNCH(fl_cu_emb_bwd_wte_k, dim3((unsigned)N, (unsigned)(C + EMB_COLS - 1) / EMB_COLS), dim3(64), 0,
                     (fl_cu_stream)stream, dwte, dout, ids, work, N, C);
    }
    if (dwpe) {
        size_t blocks = ((size_t)T * C + 255) / 256;
        FL_CU_LAUNCH(fl_cu_emb_bwd_wpe_k, dim3((unsigned)(blocks > 4096 ? 4096 : blocks)), dim3(256), 0,
                     (fl_cu_stream)stream, dwpe, dout, B, T, C);
    }
    return fl_cu_launch_error();
}

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
 *      N/32 blocks of 8 warps: ~2M warp steps at N = 8192 (an estimated tens of microseconds on an H100;
 *      it grows as N^2).
 *      Then perm[less + before] = n is the stable order of the tokens by id (a permutation, so
 *      the scatter is race-free), and each id's first token n (before == 0) owns its group:
 *      start(n) = less(n), count(n).
 *   2. sum: one block per (4 tokens, 128-column slice) skips the tokens that do not own a
 *      group; for an owner its threads walk the group in token order, dwte[v, c] += dout[m, c]
 *      for m = perm[start], perm[start+1], ...: exactly the CPU's fp32 additions in its order
 *      (dwte + g_first + g_second + ...), so the same bits. Sixteen group members at a time are
 *      loaded before they are added (memory parallelism on the long groups of frequent tokens:
 *      a group is one block's sequential chain per column slice, the kernel's critical path).
 * Backward into dwpe: one thread per (t, c) adds the batch rows in order (the CPU's order). */
#include "backend/cuda/cu_compat.h"
#include "backend/cuda/cu_kernels_train.h"

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

/* The same over a 16-bit table (bf16 or fp16 storage): each element widened exactly, then the one
 * fp32 add of the position row: the bits of the caller's per-row convert + add, in one launch
 * instead of one or two per token. */
/* out16 (NULL or): the rows stored in bf16 too, out then their exact widening (round16's bits: the residual
 * stream's first row of a bf16 run without its round16 launch) */
/* vec (C % 8 == 0, every pointer 16-byte aligned): 8 columns per thread, 128-bit accesses, the same bits */
__global__ static void fl_cu_emb_fwd16_k(float *out, uint16_t *out16, const int32_t *ids, const uint16_t *wte,
                                         const uint16_t *wpe, int bf, int T, int C, int vec) {
    size_t n = blockIdx.x;
    const uint16_t *e = wte + (size_t)ids[n] * C;
    const uint16_t *p = wpe ? wpe + (n % (size_t)T) * C : NULL;
    float *o = out + n * C;
    uint16_t *o16 = out16 ? out16 + n * C : NULL;
    const int t = bf ? (int)FL_BF16 : (int)FL_F16;
    if (vec) {
        for (int c = 8 * (int)threadIdx.x; c < C; c += 8 * (int)blockDim.x) {
            float v[8], q[8];
            fl_cu_ld8t(e, t, (size_t)c, v);
            if (p) {
                fl_cu_ld8t(p, t, (size_t)c, q);
                for (int k = 0; k < 8; k++) v[k] = v[k] + q[k];
            }
            fl_cu_keep16x8(o16, (size_t)c, v);
            fl_cu_st8t(o, FL_F32, (size_t)c, v);
        }
        return;
    }
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float v = bf ? fl_cu_bf16_to_f32(e[c]) : fl_cu_f16_to_f32(e[c]);
        if (p) v = v + (bf ? fl_cu_bf16_to_f32(p[c]) : fl_cu_f16_to_f32(p[c]));
        o[c] = fl_cu_keep16(o16, (size_t)c, v);
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

#define EMB_COLS 128 /* columns per sum block: 64 threads x 2 */
#define EMB_TOKENS 4 /* tokens per sum block (most are not group owners: fewer empty blocks) */
#define EMB_UNROLL 16

__global__ static void fl_cu_emb_bwd_wte_k(float *dwte, const float *dout, const int32_t *ids, const int32_t *work,
                                           int N, int C) {
    const int c0 = blockIdx.y * EMB_COLS + threadIdx.x, c1 = c0 + 64;
    const int ok0 = c0 < C, ok1 = c1 < C;
    /* out-of-range columns read column 0 (valid) and are never stored: the loads stay
     * unconditional, so they can all be issued before the first add */
    const int r0 = ok0 ? c0 : 0, r1 = ok1 ? c1 : 0;
    for (int n = blockIdx.x * EMB_TOKENS; n < N && n < (int)(blockIdx.x + 1) * EMB_TOKENS; n++) {
        const int cnt = work[2 * (size_t)N + n];
        if (cnt == 0) continue; /* the whole block: n does not own its id's group */
        const int32_t *perm = work + work[(size_t)N + n];
        float *d = dwte + (size_t)ids[n] * C;
        float a0 = d[r0], a1 = d[r1];
        int k = 0;
        /* EMB_UNROLL group members loaded before they are added (in token order): 32 loads in
         * flight per thread on the long groups of frequent tokens */
        for (; k + EMB_UNROLL <= cnt; k += EMB_UNROLL) {
            float x0[EMB_UNROLL], x1[EMB_UNROLL];
            for (int u = 0; u < EMB_UNROLL; u++) {
                const float *g = dout + (size_t)perm[k + u] * C;
                x0[u] = g[r0];
                x1[u] = g[r1];
            }
            for (int u = 0; u < EMB_UNROLL; u++) {
                a0 += x0[u];
                a1 += x1[u];
            }
        }
        for (; k < cnt; k++) {
            const float *g = dout + (size_t)perm[k] * C;
            a0 += g[r0];
            a1 += g[r1];
        }
        if (ok0) d[c0] = a0;
        if (ok1) d[c1] = a1;
    }
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

extern "C" int FL_CUK(embedding_forward16)(float *out, void *out16, const int32_t *ids, const void *wte,
                                           const void *wpe, fl_dtype dt, int B, int T, int C, void *stream) {
    if (dt != FL_BF16 && dt != FL_F16) return -1;
    if (B <= 0 || T <= 0 || C <= 0) return 0;
    const int vec = C % 8 == 0 && fl_cu_aligned16(out, out16, wte, wpe, NULL);
    unsigned th = ((unsigned)(vec ? C / 8 : C) + 31u) & ~31u;
    FL_CU_LAUNCH(fl_cu_emb_fwd16_k, dim3((unsigned)(B * T)), dim3(th > 256u ? 256u : th), 0, (fl_cu_stream)stream,
                 out, (uint16_t *)out16, ids, (const uint16_t *)wte, (const uint16_t *)wpe, dt == FL_BF16 ? 1 : 0, T, C,
                 vec);
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
        FL_CU_LAUNCH(fl_cu_emb_bwd_wte_k, dim3((unsigned)(N + EMB_TOKENS - 1) / EMB_TOKENS,
                                               (unsigned)(C + EMB_COLS - 1) / EMB_COLS), dim3(64), 0,
                     (fl_cu_stream)stream, dwte, dout, ids, work, N, C);
    }
    if (dwpe) {
        size_t blocks = ((size_t)T * C + 255) / 256;
        FL_CU_LAUNCH(fl_cu_emb_bwd_wpe_k, dim3((unsigned)(blocks > 4096 ? 4096 : blocks)), dim3(256), 0,
                     (fl_cu_stream)stream, dwpe, dout, B, T, C);
    }
    return fl_cu_launch_error();
}

/* ---- T5's relative position bias (backend.h's relbias_forward / relbias_backward; the CPU's: cpu/embedding.c) -----
 * Query i and key j take bucket rb[j - i + Tq - 1], one per diagonal r = j - i.
 * Forward: one thread per element, a copy from the head's table row.
 * Backward, two launches and no atomics: (1) a block of 32 warps per (32 diagonals, head): lane l walks diagonal
 * k0 + l, warp w its rows i = w, w + 32, ... (row i's 32 elements on the block's diagonals are contiguous: each
 * load is one coalesced 128-byte row piece), so warp w's lane l holds the contract's partial P_w of diagonal k0 + l;
 * through shared memory warp w then takes diagonal k0 + w's 32 partials (lane s: P_s) and combines them by the xor
 * butterfly, whose lane 0 is the contract's tree (fp32 adds commute: v_s + v_(s^off) has the same bits on both
 * lanes); S(h, k) into the work area. (2) a block per head, thread b its bucket: the diagonals in increasing k,
 * staged through shared memory, acc += S where rb == b; dtab += acc. NH Tq Tk loads in all, against the per-head
 * embedding_backward's O((Tq Tk)^2) rank over the T^2 elements (~10 ms a head at T 512 on an H200, estimated). */
__global__ static void fl_cu_relbias_fwd_k(float *bias, const float *tab, const int32_t *rb, int NH, int Tq, int Tk,
                                           int nb) {
    const size_t n = (size_t)NH * Tq * Tk;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x) {
        const int j = (int)(e % (size_t)Tk);
        const size_t hi = e / (size_t)Tk;
        const int i = (int)(hi % (size_t)Tq), h = (int)(hi / (size_t)Tq);
        const int b = rb[j - i + Tq - 1];
        bias[e] = b >= 0 && b < nb ? tab[(size_t)h * nb + b] : 0.0f;
    }
}

__global__ static void FL_CU_BOUNDS(1024) fl_cu_relbias_diag_k(float *S, const float *dbias, int Tq, int Tk) {
    __shared__ float part[32][33];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, h = blockIdx.y, nd = Tq + Tk - 1;
    const int k0 = blockIdx.x * 32, r0 = k0 - (Tq - 1), j = r0 + lane; /* row i's element on diagonal k0 + lane: i + j */
    const float *d = dbias + (size_t)h * Tq * Tk;
    /* the rows where some lane's diagonal is inside: i + r0 + 31 >= 0 and i + r0 < Tk */
    int i = warp;
    const int first = -r0 - 31;
    if (i < first) i += (first - i + 31) / 32 * 32;
    const int iend = Tk - r0 < Tq ? Tk - r0 : Tq;
    float p = 0.0f;
    const int ok_k = k0 + lane < nd;
    for (; i + 96 < iend; i += 128) { /* four rows' loads in flight, then their adds in row order */
        float x[4];
        int ok[4];
        FL_CU_UNROLL
        for (int u = 0; u < 4; u++) {
            const int ii = i + 32 * u, jj = ii + j;
            ok[u] = ok_k && jj >= 0 && jj < Tk;
            x[u] = ok[u] ? d[(size_t)ii * Tk + jj] : 0.0f;
        }
        FL_CU_UNROLL
        for (int u = 0; u < 4; u++)
            if (ok[u]) p += x[u];
    }
    for (; i < iend; i += 32) {
        const int jj = i + j;
        if (ok_k && jj >= 0 && jj < Tk) p += d[(size_t)i * Tk + jj];
    }
    part[warp][lane] = p;
    __syncthreads();
    float v = part[lane][warp]; /* diagonal k0 + warp's P_lane */
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FL_CU_FULL_MASK, v, off);
    if (lane == 0 && k0 + warp < nd) S[(size_t)h * nd + k0 + warp] = v;
}

#define RB_CHUNK 1024

__global__ static void FL_CU_BOUNDS(1024) fl_cu_relbias_bucket_k(float *dtab, const float *S, const int32_t *rb, int nd, int nb) {
    __shared__ int sb[RB_CHUNK];
    __shared__ float ss[RB_CHUNK];
    const int h = blockIdx.x, b = threadIdx.x;
    const float *s = S + (size_t)h * nd;
    float acc = 0.0f;
    for (int c0 = 0; c0 < nd; c0 += RB_CHUNK) {
        const int n = nd - c0 < RB_CHUNK ? nd - c0 : RB_CHUNK;
        for (int k = threadIdx.x; k < n; k += blockDim.x) sb[k] = rb[c0 + k], ss[k] = s[c0 + k];
        __syncthreads();
        for (int k = 0; k < n; k++)
            if (sb[k] == b) acc += ss[k];
        __syncthreads();
    }
    if (b < nb) dtab[(size_t)h * nb + b] += acc;
}

extern "C" int FL_CUK(relbias_forward)(float *bias, const float *tab, const int32_t *rb, int NH, int Tq, int Tk, int nb,
                                       void *stream) {
    if (NH < 0 || Tq < 0 || Tk < 0 || nb <= 0) return -1;
    const size_t n = (size_t)NH * Tq * Tk;
    if (n == 0) return 0;
    const size_t blocks = (n + 255) / 256;
    FL_CU_LAUNCH(fl_cu_relbias_fwd_k, dim3((unsigned)(blocks > 8192 ? 8192 : blocks)), dim3(256), 0,
                 (fl_cu_stream)stream, bias, tab, rb, NH, Tq, Tk, nb);
    return fl_cu_launch_error();
}

extern "C" int FL_CUK(relbias_backward)(float *dtab, const float *dbias, const int32_t *rb, int NH, int Tq, int Tk,
                                        int nb, float *work, void *stream) {
    if (NH < 0 || Tq < 0 || Tk < 0 || nb <= 0 || nb > FL_CU_RELBIAS_MAX_BUCKETS || NH > 65535) return -1;
    if (NH == 0 || Tq == 0 || Tk == 0) return 0;
    if (!work) return -1;
    const int nd = Tq + Tk - 1;
    FL_CU_LAUNCH(fl_cu_relbias_diag_k, dim3((unsigned)(nd + 31) / 32, (unsigned)NH), dim3(1024), 0,
                 (fl_cu_stream)stream, work, dbias, Tq, Tk);
    FL_CU_LAUNCH(fl_cu_relbias_bucket_k, dim3((unsigned)NH), dim3((unsigned)(nb + 31) / 32 * 32), 0,
                 (fl_cu_stream)stream, dtab, work, rb, nd, nb);
    return fl_cu_launch_error();
}

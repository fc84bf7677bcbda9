/* Private to the tensor-core attention kernels (kernels/attention_tc.cu, kernels/attn_fa2.cu):
 * the fragment helpers over bf16 shared-memory tiles, ldmatrix and a float atomic add, in both
 * worlds of cu_compat.h (include after cu_mma.h). Fragment layouts: cu_mma.h. */
#ifndef FL_CU_ATTN_MMA_H
#define FL_CU_ATTN_MMA_H

#include "backend/cuda/cu_mma.h"

/* (FL_CU_UNROLL: cu_compat.h) */

#define FL_CU_TC_THREADS 128
#define FL_CU_LOG2E 1.4426950408889634f
#define FL_CU_LN2 0.6931471805599453f

#define FL_CU_TC_PAD 8

/* Two consecutive fp32 elements of row r (0 past n rows) packed as bf16. */
FL_CU_DEV uint32_t fl_cu_tc_ld2(fl_cu_fptr base, size_t ld, int r, int n, int c) {
    if (r >= n) return 0u;
    const fl_cu_fptr x = base + ((size_t)r * ld + c);
    return fl_cu_pack_bf16(x[0], x[1]);
}

/* dst (R rows, pitch P elements; NULL: none) <- bf16 of rows 0..n-1 of a (rows, D) fp32 view,
 * rows >= n zero; and, when dt is given, the transpose (D rows of pitch PT) likewise. Consecutive threads take
 * consecutive column pairs (coalesced reads). hd (even, at most D): the view's columns, those from hd on zero (a head
 * size the fa2 kernels pad to D). */
template <int D, int R, int NTH = FL_CU_TC_THREADS>
FL_CU_DEV void fl_cu_tc_load(uint16_t *dst, int P, uint16_t *dt, int PT, fl_cu_fptr src, size_t ld, int n, int hd = D) {
    for (int i = threadIdx.x; i < R * D / 2; i += NTH) {
        const int r = i / (D / 2), c = 2 * (i % (D / 2));
        const uint32_t w = c < hd ? fl_cu_tc_ld2(src, ld, r, n, c) : 0u;
        if (dst) *reinterpret_cast<uint32_t *>(dst + r * P + c) = w;
        if (dt) {
            dt[c * PT + r] = (uint16_t)(w & 0xffffu);
            dt[(c + 1) * PT + r] = (uint16_t)(w >> 16);
        }
    }
}

/* The A fragment of rows row0..row0+15, columns k0..k0+15 of a row-major bf16 tile (pitch P). */
FL_CU_DEV void fl_cu_tc_frag_a(uint32_t a[4], const uint16_t *s, int P, int row0, int k0) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const uint16_t *r0 = s + (row0 + g) * P + k0 + 2 * t, *r1 = r0 + 8 * P;
    a[0] = *reinterpret_cast<const uint32_t *>(r0);
    a[1] = *reinterpret_cast<const uint32_t *>(r1);
    a[2] = *reinterpret_cast<const uint32_t *>(r0 + 8);
    a[3] = *reinterpret_cast<const uint32_t *>(r1 + 8);
}
/* The B fragment (k = k0..k0+15, n = n0..n0+7) of B[k][n] = s[n][k], s row-major (pitch P). */
FL_CU_DEV void fl_cu_tc_frag_b(uint32_t b[2], const uint16_t *s, int P, int n0, int k0) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const uint16_t *r = s + (n0 + g) * P + k0 + 2 * t;
    b[0] = *reinterpret_cast<const uint32_t *>(r);
    b[1] = *reinterpret_cast<const uint32_t *>(r + 8);
}
/* The A fragment of k-step kk of an accumulator tile x[n-tile][4] (16 rows x 8 per n-tile):
 * n-tiles 2kk and 2kk+1 rounded to bf16 (the PTX C layout is the A layout, two n-tiles wide). */
FL_CU_DEV void fl_cu_tc_acc_to_a(uint32_t a[4], const float x0[4], const float x1[4]) {
    a[0] = fl_cu_pack_bf16(x0[0], x0[1]);
    a[1] = fl_cu_pack_bf16(x0[2], x0[3]);
    a[2] = fl_cu_pack_bf16(x1[0], x1[1]);
    a[3] = fl_cu_pack_bf16(x1[2], x1[3]);
}


/* ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane l gives the address of row l % 8 of
 * 8x8 matrix l / 8 (16 bytes, 16-byte aligned); register j of lane l receives matrix j's
 * elements (row l/4, columns 2(l%4), 2(l%4)+1), or with .trans (rows 2(l%4), 2(l%4)+1, column
 * l/4). So (g = lane/4, t = lane%4, r = lane%8, m = lane/8), for a bf16 tile of pitch P:
 *   A fragment, rows r0.., k-columns k0.. of a row-major (m, k) tile:  row r0 + r + 8(m&1),
 *     column k0 + 8(m>>1)                                                 (fl_cu_ldm_a)
 *   A fragment from a (k, m) row-major tile (A transposed), .trans:      row k0 + r + 8(m>>1),
 *     column m0 + 8(m&1)                                                  (fl_cu_ldm_at)
 *   B fragments of two n-tiles n0, n0+8 (registers 0,1 / 2,3) from a row-major (n, k) tile:
 *     row n0 + r + 8(m>>1), column k0 + 8(m&1)                            (fl_cu_ldm_b)
 *   the same from a row-major (k, n) tile, .trans: row k0 + r + 8(m&1), column n0 + 8(m>>1)
 *                                                                         (fl_cu_ldm_bt)
 * The emulator gathers the 32 addresses (one warp phase) and reads the elements as above. */
#ifdef __CUDACC__
FL_CU_DEV void fl_cu_ldm_x4(uint32_t r[4], const uint16_t *row, int trans) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(row);
    if (trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
}
/* dq accumulation across key blocks (FlashAttention-2's): the order of the adds varies per run */
FL_CU_DEV void fl_cu_atomic_add(float *p, float v) { atomicAdd(p, v); }
/* The deterministic dq (attn_fa2.cu): a block adds its dq contribution to a query tile only when the
 * tile's counter says every earlier key block has added its own (they run the tiles in the same
 * order, and a block is scheduled no later than any block after it: no cycle), then counts itself. */
FL_CU_DEV void fl_cu_dq_wait(int *lock, int want) {
    if (threadIdx.x == 0) {
        while (atomicAdd(lock, 0) < want) {
        }
        __threadfence();
    }
    __syncthreads();
}
FL_CU_DEV void fl_cu_dq_post(int *lock) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(lock, 1);
}
#else
FL_CU_DEV void fl_cu_ldm_x4(uint32_t r[4], const uint16_t *row, int trans) {
    fl_cu_check16(row);
    const unsigned char *v = fl_cu_emu_warp_gather_begin(&row, sizeof row); /* lane l's row pointer */
    const int lane = fl_cu_emu_lane(), g = lane >> 2, t = lane & 3;
    for (int j = 0; j < 4; j++) {
        const uint16_t *lo_row = NULL, *hi_row = NULL;
        if (v) {
            memcpy(&lo_row, v + (trans ? 8 * j + 2 * t : 8 * j + g) * FL_CU_EMU_GATHER_MAX, sizeof lo_row);
            memcpy(&hi_row, v + (trans ? 8 * j + 2 * t + 1 : 8 * j + g) * FL_CU_EMU_GATHER_MAX, sizeof hi_row);
        }
        const uint16_t lo = !v ? 0 : trans ? lo_row[g] : lo_row[2 * t];
        const uint16_t hi = !v ? 0 : trans ? hi_row[g] : hi_row[2 * t + 1];
        r[j] = (uint32_t)lo | ((uint32_t)hi << 16);
    }
    fl_cu_emu_warp_gather_end();
}
/* the blocks of a launch run one after another and fibers switch only at barriers: a plain add */
FL_CU_DEV void fl_cu_atomic_add(float *p, float v) { *p += v; }
/* blocks in launch order: the earlier key blocks are done when a block gets here (the tests check
 * each counter's final value: the number of key blocks that added to its tile) */
FL_CU_DEV void fl_cu_dq_wait(int *lock, int want) {
    (void)lock, (void)want;
    __syncthreads();
}
FL_CU_DEV void fl_cu_dq_post(int *lock) {
    __syncthreads();
    if (threadIdx.x == 0) *lock += 1;
}
#endif
/* Two n-tiles' products with one A fragment: c0 += a b[0..1], c1 += a b[2..3] (b from fl_cu_ldm_b / _bt) */
FL_CU_DEV void fl_cu_mma_pair(float c0[4], float c1[4], const uint32_t a[4], const uint32_t b[4]) {
    fl_cu_mma_bf16_16816(c0, a, b, c0);
    fl_cu_mma_bf16_16816(c1, a, b + 2, c1);
}
FL_CU_DEV void fl_cu_ldm_a(uint32_t a[4], const uint16_t *s, int P, int r0, int k0) {
    const int l = threadIdx.x & 31, m = l >> 3;
    fl_cu_ldm_x4(a, s + (r0 + (l & 7) + 8 * (m & 1)) * P + k0 + 8 * (m >> 1), 0);
}
FL_CU_DEV void fl_cu_ldm_at(uint32_t a[4], const uint16_t *s, int P, int m0, int k0) {
    const int l = threadIdx.x & 31, m = l >> 3;
    fl_cu_ldm_x4(a, s + (k0 + (l & 7) + 8 * (m >> 1)) * P + m0 + 8 * (m & 1), 1);
}
FL_CU_DEV void fl_cu_ldm_b(uint32_t b[4], const uint16_t *s, int P, int n0, int k0) {
    const int l = threadIdx.x & 31, m = l >> 3;
    fl_cu_ldm_x4(b, s + (n0 + (l & 7) + 8 * (m >> 1)) * P + k0 + 8 * (m & 1), 0);
}
FL_CU_DEV void fl_cu_ldm_bt(uint32_t b[4], const uint16_t *s, int P, int n0, int k0) {
    const int l = threadIdx.x & 31, m = l >> 3;
    fl_cu_ldm_x4(b, s + (k0 + (l & 7) + 8 * (m & 1)) * P + n0 + 8 * (m >> 1), 1);
}

/* ---- the tiles' 128-bit loads (attn_fa2.cu) ----------------------------------------------------
 * cp.async.cg (sm_80+): 16 bytes global -> shared without passing through registers, zero-filled when
 * !valid (src-size 0: nothing is read); a thread's copies complete at fl_cu_cp_wait<N> (all but its N newest
 * commit groups), the block sees them after the __syncthreads that follows. The emulator checks the alignment a
 * GPU needs and holds the copy as a GPU may (cu_emu.h fl_cu_emu_cp_async): the destination NaN bytes from the issue
 * (a buffer another warp still reads is spoilt at once) and the bytes landing only at the wait that completes the
 * group (a read before the wait and its barrier gets NaNs). */
#ifdef __CUDACC__
FL_CU_DEV void fl_cu_cp16(void *sdst, const void *gsrc, int valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned s = (unsigned)__cvta_generic_to_shared(sdst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gsrc), "r"(valid ? 16 : 0));
#else
    *reinterpret_cast<uint4 *>(sdst) = valid ? *reinterpret_cast<const uint4 *>(gsrc) : make_uint4(0u, 0u, 0u, 0u);
#endif
}
/* the same for 8 bytes (cp.async.ca: .cg copies 16 only), 8-byte aligned addresses */
FL_CU_DEV void fl_cu_cp8(void *sdst, const void *gsrc, int valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned s = (unsigned)__cvta_generic_to_shared(sdst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(s), "l"(gsrc), "r"(valid ? 8 : 0));
#else
    *reinterpret_cast<uint2 *>(sdst) = valid ? *reinterpret_cast<const uint2 *>(gsrc) : make_uint2(0u, 0u);
#endif
}
FL_CU_DEV void fl_cu_cp_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N> FL_CU_DEV void fl_cu_cp_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}
/* 8 bf16 (4 packed words) to a 16-byte aligned shared address: one 128-bit store */
FL_CU_DEV void fl_cu_st16w(uint16_t *p, const uint32_t w[4]) {
    *reinterpret_cast<uint4 *>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}
/* 4 bf16 (2 packed words) to an 8-byte aligned shared address: one 64-bit store */
FL_CU_DEV void fl_cu_st2w(uint16_t *p, uint32_t w0, uint32_t w1) { *reinterpret_cast<uint2 *>(p) = make_uint2(w0, w1); }
#else
FL_CU_DEV void fl_cu_cp16(void *sdst, const void *gsrc, int valid) {
    fl_cu_check16(sdst);
    fl_cu_check16(gsrc);
    fl_cu_emu_cp_async(sdst, gsrc, 16, valid);
}
/* an 8-byte access (counted with the 128-bit ones: fl_cu_emu_vec_accesses), aligned as a GPU needs */
FL_CU_DEV void fl_cu_check8(const void *p) {
    fl_cu_emu_vec_accesses++;
    if ((uintptr_t)p & 7u) {
        fprintf(stderr, "cuda emulator: 64-bit access at %p, not 8-byte aligned (a GPU faults)\n", p);
        abort();
    }
}
FL_CU_DEV void fl_cu_cp8(void *sdst, const void *gsrc, int valid) {
    fl_cu_check8(sdst);
    fl_cu_check8(gsrc);
    fl_cu_emu_cp_async(sdst, gsrc, 8, valid);
}
FL_CU_DEV void fl_cu_cp_commit() { fl_cu_emu_cp_commit(); }
template <int N> FL_CU_DEV void fl_cu_cp_wait() { fl_cu_emu_cp_wait(N); }
FL_CU_DEV void fl_cu_st16w(uint16_t *p, const uint32_t w[4]) {
    fl_cu_check16(p);
    memcpy(p, w, 16);
}
FL_CU_DEV void fl_cu_st2w(uint16_t *p, uint32_t w0, uint32_t w1) {
    const uint32_t w[2] = {w0, w1};
    fl_cu_check8(p);
    memcpy(p, w, 8);
}
#endif

/* dst (R rows, pitch P) <- rows 0..n-1 of a bf16 (rows, D) view, rows >= n zero, by cp.async: chunk i of 8
 * elements (row i / (D/8)) per thread and step, consecutive threads on consecutive chunks (coalesced). The
 * caller checked 16-byte alignment of src and of ld * 2 bytes. The same bits as fl_cu_tc_load (bf16 -> fp32 ->
 * bf16 is exact). */
template <int D, int R, int NTH = FL_CU_TC_THREADS>
FL_CU_DEV void fl_cu_tc_cp_tile(uint16_t *dst, int P, const uint16_t *src, size_t ld, int n) {
    enum { CPR = D / 8, IT = R * CPR / NTH };
    static_assert(R * CPR % NTH == 0, "whole steps of NTH chunks");
    FL_CU_UNROLL
    for (int it = 0; it < IT; it++) {
        const int i = it * NTH + (int)threadIdx.x, r = i / CPR, c = 8 * (i % CPR);
        fl_cu_cp16(dst + r * P + c, r < n ? src + (size_t)r * ld + c : src, r < n);
    }
}
/* The same from an fp32 view (16-byte aligned src, ld % 4 == 0), in two halves so that a tile's loads can be in
 * flight while the block computes (the backward's dO): steps g0..g0+G-1 of the tile's chunks (8 elements, two
 * float4) into registers x (rows >= n zero), then packed to bf16 and stored (rounded as fl_cu_tc_load). */
template <int D, int R, int G, int NTH = FL_CU_TC_THREADS>
FL_CU_DEV void fl_cu_tc_ld32_regs(float (*x)[8], int g0, const float *src, size_t ld, int n) {
    enum { CPR = D / 8 };
    FL_CU_UNROLL
    for (int j = 0; j < G; j++) {
        const int i = (g0 + j) * NTH + (int)threadIdx.x, r = i / CPR, c = 8 * (i % CPR);
        if (r < n) {
            fl_cu_ld4(src + (size_t)r * ld + c, x[j]);
            fl_cu_ld4(src + (size_t)r * ld + c + 4, x[j] + 4);
        } else {
            FL_CU_UNROLL
            for (int e = 0; e < 8; e++) x[j][e] = 0.0f;
        }
    }
}
template <int D, int R, int G, int NTH = FL_CU_TC_THREADS>
FL_CU_DEV void fl_cu_tc_st32_regs(uint16_t *dst, int P, float (*x)[8], int g0) {
    enum { CPR = D / 8 };
    FL_CU_UNROLL
    for (int j = 0; j < G; j++) {
        const int i = (g0 + j) * NTH + (int)threadIdx.x, r = i / CPR, c = 8 * (i % CPR);
        uint32_t w[4];
        FL_CU_UNROLL
        for (int e = 0; e < 4; e++) w[e] = fl_cu_pack_bf16(x[j][2 * e], x[j][2 * e + 1]);
        fl_cu_st16w(dst + r * P + c, w);
    }
}
/* The whole tile, each group of (at most) 4 steps' loads issued before its stores. */
template <int D, int R, int NTH = FL_CU_TC_THREADS>
FL_CU_DEV void fl_cu_tc_ld_tile32(uint16_t *dst, int P, const float *src, size_t ld, int n) {
    enum { IT = R * (D / 8) / NTH, G = IT < 4 ? IT : 4 };
    static_assert(R * (D / 8) % NTH == 0 && IT % G == 0, "whole steps of NTH chunks");
    FL_CU_UNROLL
    for (int g0 = 0; g0 < IT; g0 += G) {
        float x[G][8];
        fl_cu_tc_ld32_regs<D, R, G, NTH>(x, g0, src, ld, n);
        fl_cu_tc_st32_regs<D, R, G, NTH>(dst, P, x, g0);
    }
}
/* A head of hd < D columns (hd % 4 == 0; the fa2 kernels pad it to D, fl_cu_fa_tile): rows 0..n-1, columns 0..hd-1
 * into the tile, the rest zero, in chunks of 4 elements (row i / (D/4)). bf16: cp.async of 8 bytes (rows 8-byte
 * aligned: hd * 2 bytes need not be a 16-byte multiple, e.g. OpenLLaMA 3B's 100); fp32: 128-bit loads (rows 16-byte
 * aligned), a group of 4 in flight before their 64-bit packed stores. The same bits as fl_cu_tc_load. */
template <int D, int R, int NTH = FL_CU_TC_THREADS>
FL_CU_DEV void fl_cu_tc_cp8_tile(uint16_t *dst, int P, const uint16_t *src, size_t ld, int n, int hd) {
    enum { CPR = D / 4, IT = R * CPR / NTH };
    static_assert(R * CPR % NTH == 0, "whole steps of NTH chunks");
    FL_CU_UNROLL
    for (int it = 0; it < IT; it++) {
        const int i = it * NTH + (int)threadIdx.x, r = i / CPR, c = 4 * (i % CPR), ok = r < n && c < hd;
        fl_cu_cp8(dst + r * P + c, ok ? src + (size_t)r * ld + c : src, ok);
    }
}
template <int D, int R, int NTH = FL_CU_TC_THREADS>
FL_CU_DEV void fl_cu_tc_ld_tile32n(uint16_t *dst, int P, const float *src, size_t ld, int n, int hd) {
    enum { CPR = D / 4, IT = R * CPR / NTH, G = IT < 4 ? IT : 4 };
    static_assert(R * CPR % NTH == 0 && IT % G == 0, "whole steps of NTH chunks");
    FL_CU_NO_UNROLL
    for (int g0 = 0; g0 < IT; g0 += G) {
        float x[G][4];
        FL_CU_UNROLL
        for (int j = 0; j < G; j++) {
            const int i = (g0 + j) * NTH + (int)threadIdx.x, r = i / CPR, c = 4 * (i % CPR);
            if (r < n && c < hd) fl_cu_ld4(src + (size_t)r * ld + c, x[j]);
            else x[j][0] = x[j][1] = x[j][2] = x[j][3] = 0.0f;
        }
        FL_CU_UNROLL
        for (int j = 0; j < G; j++) {
            const int i = (g0 + j) * NTH + (int)threadIdx.x, r = i / CPR, c = 4 * (i % CPR);
            fl_cu_st2w(dst + r * P + c, fl_cu_pack_bf16(x[j][0], x[j][1]), fl_cu_pack_bf16(x[j][2], x[j][3]));
        }
    }
}
/* dq's two adjacent elements p[0], p[1] (the fa2 backward's dQ tile): one 64-bit atomic on sm_90 when pair (p
 * 8-byte aligned), else two (the emulator: plain adds, as fl_cu_atomic_add) */
FL_CU_DEV void fl_cu_atomic_add2(float *p, float a, float b, int pair) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (pair) {
        atomicAdd(reinterpret_cast<float2 *>(p), make_float2(a, b));
        return;
    }
#endif
    (void)pair;
    fl_cu_atomic_add(p, a);
    fl_cu_atomic_add(p + 1, b);
}
#endif

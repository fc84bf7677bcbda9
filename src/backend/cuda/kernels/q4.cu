/* 4-bit (bitsandbytes NF4/FP4) weights: the fused dequantize-matmuls of backend.h's
 * q4_matmul_forward / q4_matmul_backward, and a dequantize kernel (references:
 * src/backend/cpu/quant4.c, q4matmul.c; the format: fitllm/quant4.h).
 * Every kernel takes the plain layout (element (r, c) stored at r * cols + c) and a tensor-parallel
 * rank's part that cuts the blocks (fl_q4_weight.row_start, a device array: whole blocks of one
 * process's quantization, element (r, c) at row_start[r] + c), as fl_q4_dequantize_tile does.
 *
 * Dequantization is the CPU's fl_q4_dequantize_tile value for value: code[q] * absmax(block),
 * where a double-quantized absmax is code8[q_absmax] * scale + offset with two roundings (no FMA:
 * fl_cu_mul_rn / fl_cu_add_rn). The dequantize kernel therefore writes the CPU's bits (F32).
 *
 * The matmuls are one tiled SGEMM kernel (two variants) that dequantizes each 16 x 128 tile of W
 * into shared memory as it goes: no dequantized copy of W exists. Block tile 128 (rows of x / dy)
 * x 128 (output columns) x 16 (reduction), 256 threads, each accumulating an 8 x 8 register block
 * from 128-bit shared reads. fp32 accumulation with FMA along the reduction in a fixed order: the
 * result does not depend on the device or the launch, but it is not the CPU's bits (its GEMM
 * library sums in another order); tests compare against float64 within fp32 rounding.
 *   forward:  y (N, out)  = x (N, in) @ deq(W)^T: A = x, B[k][o] = W[o][k] (the W tile is read
 *             along k, its 64-element quantization blocks, and stored transposed);
 *   backward: dx (N, in) = dy (N, out) @ deq(W):  A = dy, B[o][k] = W[o][k] (read along k).
 * For a GEMM-library path instead (cuBLASLt at its fp32 / tf32 speed), q4_dequantize writes a
 * panel of rows of deq(W) (F32 or BF16) into a caller scratch, as the CPU backend's panels. */
#define FL_CU_NEED_CODE_SIGNED 1
#include "backend/cuda/cu_compat.h"
#include "backend/cuda/cu_kernels_train.h"
#include "backend/cuda/cu_exact_dev.h"
#include "backend/cuda/cu_mma.h"

static __device__ const float fl_cu_nf4_code[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f,
};
static __device__ const float fl_cu_fp4_code[16] = {
    0.0f, 0.005208333333f, 0.66666667f, 1.0f, 0.33333333f, 0.5f, 0.16666667f, 0.25f,
    -0.0f, -0.005208333333f, -0.66666667f, -1.0f, -0.33333333f, -0.5f, -0.16666667f, -0.25f,
};

/* The weight as the kernels see it (device pointers; offset read once per block). */
typedef struct {
    const uint8_t *packed;
    const float *absmax;       /* !dq */
    const uint8_t *q_absmax;   /* dq */
    const float *absmax_scale; /* dq */
    const float *offset;       /* dq */
    const uint32_t *row_start; /* a mapped part (fl_q4_weight.row_start): row r starts at element row_start[r] of the
                                * kept blocks; NULL: at r * cols */
    int rows, cols, type, dq;
} fl_cu_q4w;

FL_CU_DEV float q4_absmax(const fl_cu_q4w &w, float off, size_t b) {
    if (!w.dq) return w.absmax[b];
    return fl_cu_add_rn(fl_cu_mul_rn(fl_cu_code_signed[w.q_absmax[b]], w.absmax_scale[b / FL_Q4_DQ_BLOCK]), off);
}
/* the stored element index of (r, 0): the plain layout's r * cols, or a mapped part's row map */
FL_CU_DEV size_t q4_row(const fl_cu_q4w &w, int r) {
    return w.row_start ? (size_t)w.row_start[r] : (size_t)r * (size_t)w.cols;
}
/* stored element i (q4_row(r) + c for element (r, c)); lut: the 16 code values */
FL_CU_DEV float q4_value(const fl_cu_q4w &w, const float *lut, float off, size_t i) {
    const unsigned byte = w.packed[i >> 1];
    const unsigned q = (i & 1) ? (byte & 15u) : (byte >> 4);
    return lut[q] * q4_absmax(w, off, i / FL_Q4_BLOCK);
}
FL_CU_DEV void q4_load_lut(float *lut, int type) {
    if (threadIdx.x < 16) lut[threadIdx.x] = type == FL_Q4_NF4 ? fl_cu_nf4_code[threadIdx.x] : fl_cu_fp4_code[threadIdx.x];
}

#define Q4_BM 128
#define Q4_BN 128
#define Q4_BK 16
#define Q4_PAD 4 /* row padding of the shared tiles: rows stay 16-byte aligned for the 4-float reads */

/* 4 consecutive floats of shared memory, p 16-byte aligned: one 128-bit load on the GPU */
FL_CU_DEV void q4_ld4(const float *p, float *out) {
#ifdef __CUDACC__
    const float4 v = *reinterpret_cast<const float4 *>(p);
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
#else
    memcpy(out, p, 4 * sizeof(float));
#endif
}

/* C (M, Ncol; ldc) = A (M, K; lda) @ B + beta * C with B (K, Ncol) = deq(W)^T (BWD = 0: K = cols,
 * Ncol = rows) or deq(W) (BWD = 1: K = rows, Ncol = cols). Thread (ty, tx) owns rows ty*8 .. +7
 * and columns tx*8 .. +7 of the block tile: per reduction step two 128-bit shared reads of A (a
 * broadcast: a warp has two ty) and two of B (16 lanes x 32 consecutive bytes: conflict-free) feed
 * 64 FMAs. */
template <int BWD>
__global__ static void fl_cu_q4_gemm_k(float *Cm, int ldc, const float *A, int lda, fl_cu_q4w w, int M, float beta) {
    alignas(16) __shared__ float As[Q4_BK][Q4_BM + Q4_PAD];
    alignas(16) __shared__ float Bs[Q4_BK][Q4_BN + Q4_PAD];
    __shared__ float lut[16];
    const int K = BWD ? w.rows : w.cols, Ncol = BWD ? w.cols : w.rows;
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int m0 = blockIdx.y * Q4_BM, n0 = blockIdx.x * Q4_BN;
    const float off = w.dq ? *w.offset : 0.0f;
    q4_load_lut(lut, w.type);
    __syncthreads();
    float acc[8][8];
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 8; j++) acc[i][j] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += Q4_BK) {
        /* A tile, read along k (16 consecutive floats per row), stored transposed */
        for (int r = 0; r < 8; r++) {
            const int e = tid + 256 * r, m = e >> 4, kk = e & 15;
            const int gm = m0 + m, gk = k0 + kk;
            As[kk][m] = gm < M && gk < K ? A[(size_t)gm * lda + gk] : 0.0f;
        }
        /* W tile, dequantized, read along W's columns (consecutive nibbles) */
        for (int r = 0; r < 8; r++) {
            const int e = tid + 256 * r;
            if (!BWD) { /* Bs[kk][o] = W[n0 + o][k0 + kk] */
                const int o = e >> 4, kk = e & 15, go = n0 + o, gk = k0 + kk;
                Bs[kk][o] = go < Ncol && gk < K ? q4_value(w, lut, off, q4_row(w, go) + gk) : 0.0f;
            } else { /* Bs[kk][c] = W[k0 + kk][n0 + c] */
                const int c = e & 127, kk = e >> 7, gc = n0 + c, gk = k0 + kk;
                Bs[kk][c] = gc < Ncol && gk < K ? q4_value(w, lut, off, q4_row(w, gk) + gc) : 0.0f;
            }
        }
        __syncthreads();
        for (int kk = 0; kk < Q4_BK; kk++) {
            float a[8], b[8];
            q4_ld4(&As[kk][ty * 8], a);
            q4_ld4(&As[kk][ty * 8 + 4], a + 4);
            q4_ld4(&Bs[kk][tx * 8], b);
            q4_ld4(&Bs[kk][tx * 8 + 4], b + 4);
            for (int i = 0; i < 8; i++)
                for (int j = 0; j < 8; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
    for (int i = 0; i < 8; i++) {
        const int gm = m0 + ty * 8 + i;
        if (gm >= M) break;
        float *c = Cm + (size_t)gm * ldc;
        for (int j = 0; j < 8; j++) {
            const int gn = n0 + tx * 8 + j;
            if (gn < Ncol) c[gn] = beta != 0.0f ? c[gn] + acc[i][j] : acc[i][j];
        }
    }
}

/* ---- the same on bf16 tensor cores (issue 30 item 7: NF4 dequantization fused into the GEMM's B load) ----
 * Block tile 64 (rows of x / dy) x 64 (output columns) x 32 (reduction), 128 threads = 4 warps of 32 x 32, each
 * warp 2 x 4 mma m16n8k16 per 16 of the reduction. The load rounds A's fp32 and the dequantized W's fp32 values to
 * bf16 (RNE) into shared memory, both stored (row, k) so every fragment register is one 32-bit read (cu_mma.h's
 * table: A[g][2t, 2t+1], B[2t, 2t+1][g] = the (n, k) tile's row g). The backward's W tile is read along W's rows
 * (consecutive nibbles) and stored transposed. */
#define Q4T_BM 64
#define Q4T_BN 64
#define Q4T_BK 32
#define Q4T_LD (Q4T_BK + 8) /* bf16 per shared row: 80 bytes, so the 32-bit reads at even k stay aligned */

FL_CU_DEV uint32_t q4t_ld32(const uint16_t *p) {
#ifdef __CUDACC__
    return *reinterpret_cast<const uint32_t *>(p);
#else
    return (uint32_t)p[0] | ((uint32_t)p[1] << 16);
#endif
}

/* 8 bf16 (16 bytes) of global memory into shared memory: one 128-bit load and store on the GPU (both 16-byte aligned) */
FL_CU_DEV void q4t_cp16(uint16_t *dst, const uint16_t *src) {
#ifdef __CUDACC__
    *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(src);
#else
    memcpy(dst, src, 16);
#endif
}

/* A16: A is bf16 (q4_matmul_forward16 / _backward16: the stored copy, RNE of the fp32 value the A16 = 0 kernel rounds
 * as it loads), copied into the same tile 8 values (128 bits) at a time where a row's 8 are inside and vec (lda and
 * A's address multiples of 8 values) says they are aligned; else value by value. The tile, hence every bit, is the
 * A16 = 0 kernel's on widen(A). */
template <int MODE> /* BWD = MODE & 1, A16 = MODE >> 1 (one template argument: FL_CU_LAUNCH's macro) */
__global__ static void fl_cu_q4_gemm_tc_k(float *Cm, int ldc, const void *Av, int lda, fl_cu_q4w w, int M,
                                          float beta, int vec) {
    constexpr int BWD = MODE & 1, A16 = MODE >> 1;
    alignas(16) __shared__ uint16_t As[Q4T_BM][Q4T_LD]; /* (m, k) */
    alignas(16) __shared__ uint16_t Bs[Q4T_BN][Q4T_LD]; /* (n, k) */
    __shared__ float lut[16];
    const int K = BWD ? w.rows : w.cols, Ncol = BWD ? w.cols : w.rows;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
    const int m0 = blockIdx.y * Q4T_BM, n0 = blockIdx.x * Q4T_BN;
    const float off = w.dq ? *w.offset : 0.0f;
    q4_load_lut(lut, w.type);
    __syncthreads();
    float acc[2][4][4];
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++)
            for (int q = 0; q < 4; q++) acc[i][j][q] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += Q4T_BK) {
        if (A16) { /* A: 64 x 32 bf16, 4 runs of 8 a row, 2 a thread */
            const uint16_t *A = (const uint16_t *)Av;
            for (int r = 0; r < 2; r++) {
                const int e = tid + 128 * r, m = e >> 2, kk = (e & 3) * 8, gm = m0 + m, gk = k0 + kk;
                const uint16_t *src = A + (size_t)gm * lda + gk;
                if (vec && gm < M && gk + 8 <= K) q4t_cp16(&As[m][kk], src);
                else
                    for (int j = 0; j < 8; j++) As[m][kk + j] = gm < M && gk + j < K ? src[j] : (uint16_t)0;
            }
        } else {
            const float *A = (const float *)Av;
            for (int r = 0; r < 16; r++) { /* A: 64 x 32, read along k */
                const int e = tid + 128 * r, m = e >> 5, kk = e & 31, gm = m0 + m, gk = k0 + kk;
                As[m][kk] = fl_cu_f32_to_bf16(gm < M && gk < K ? A[(size_t)gm * lda + gk] : 0.0f);
            }
        }
        for (int r = 0; r < 16; r++) { /* W: 64 x 32 as (n, k), dequantized along W's rows */
            const int e = tid + 128 * r;
            float v;
            int n, kk;
            if (!BWD) { /* Bs[n][kk] = W[n0 + n][k0 + kk] */
                n = e >> 5, kk = e & 31;
                const int gn = n0 + n, gk = k0 + kk;
                v = gn < Ncol && gk < K ? q4_value(w, lut, off, q4_row(w, gn) + gk) : 0.0f;
            } else { /* Bs[n][kk] = W[k0 + kk][n0 + n] */
                n = e & 63, kk = e >> 6;
                const int gn = n0 + n, gk = k0 + kk;
                v = gn < Ncol && gk < K ? q4_value(w, lut, off, q4_row(w, gk) + gn) : 0.0f;
            }
            Bs[n][kk] = fl_cu_f32_to_bf16(v);
        }
        __syncthreads();
        for (int ks = 0; ks < Q4T_BK; ks += 16) {
            uint32_t a[2][4], b[4][2];
            for (int i = 0; i < 2; i++) {
                const int r = wm + 16 * i + g, c = ks + 2 * t;
                a[i][0] = q4t_ld32(&As[r][c]);
                a[i][1] = q4t_ld32(&As[r + 8][c]);
                a[i][2] = q4t_ld32(&As[r][c + 8]);
                a[i][3] = q4t_ld32(&As[r + 8][c + 8]);
            }
            for (int j = 0; j < 4; j++) {
                const int n = wn + 8 * j + g, c = ks + 2 * t;
                b[j][0] = q4t_ld32(&Bs[n][c]);
                b[j][1] = q4t_ld32(&Bs[n][c + 8]);
            }
            for (int i = 0; i < 2; i++)
                for (int j = 0; j < 4; j++) fl_cu_mma_bf16_16816(acc[i][j], a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++)
            for (int q = 0; q < 4; q++) {
                const int gm = m0 + wm + 16 * i + g + 8 * (q >> 1), gn = n0 + wn + 8 * j + 2 * t + (q & 1);
                if (gm >= M || gn >= Ncol) continue;
                float *c = Cm + (size_t)gm * ldc + gn;
                *c = beta != 0.0f ? *c + acc[i][j][q] : acc[i][j][q];
            }
}

/* deq(W)[r0 + r, c0 .. c0+7] for rows r = blockIdx.y, + gridDim.y, ...: a thread per run of 8 elements of a row (a
 * block: 2048 columns), so no division per element. A run whose first stored element is a multiple of 8 (all 8 in
 * one quantization block: one absmax) takes its 4 packed bytes in one load (pk4: the packed array 4-byte aligned)
 * and, with vec (dst 16-byte aligned, ldd whole 16-byte units), one 128-bit store (two for F32); other runs (a row's
 * tail, a row map starting mid-run) go element by element. Every value as q4_value: the same bits either way. */
__global__ static void fl_cu_q4_dequant_k(void *dst, int dt, int ldd, fl_cu_q4w w, int r0, int nr, int vec, int pk4) {
    __shared__ float lut[16];
    const float off = w.dq ? *w.offset : 0.0f;
    q4_load_lut(lut, w.type);
    __syncthreads();
    const int c0 = ((int)blockIdx.x * (int)blockDim.x + (int)threadIdx.x) * 8;
    if (c0 >= w.cols) return;
    for (int r = (int)blockIdx.y; r < nr; r += (int)gridDim.y) {
        const size_t i0 = q4_row(w, r0 + r) + (size_t)c0, o = (size_t)r * ldd + (size_t)c0;
        if (c0 + 8 > w.cols || (i0 & 7u)) {
            for (int j = 0; j < 8 && c0 + j < w.cols; j++) {
                const float v = q4_value(w, lut, off, i0 + (size_t)j);
                if (dt == FL_F32) ((float *)dst)[o + j] = v;
                else ((uint16_t *)dst)[o + j] = fl_cu_f32_to_bf16(v);
            }
            continue;
        }
        const uint8_t *pb = w.packed + (i0 >> 1);
        const uint32_t bytes = pk4 ? *reinterpret_cast<const uint32_t *>(pb)
                                   : (uint32_t)pb[0] | (uint32_t)pb[1] << 8 | (uint32_t)pb[2] << 16 | (uint32_t)pb[3] << 24;
        const float am = q4_absmax(w, off, i0 / FL_Q4_BLOCK);
        float v[8];
        FL_CU_UNROLL
        for (int j = 0; j < 8; j++) { /* element i0 + j: byte j / 2, its high nibble first */
            const unsigned byte = (bytes >> (8 * (j >> 1))) & 255u;
            v[j] = lut[(j & 1) ? (byte & 15u) : (byte >> 4)] * am;
        }
        if (dt == FL_F32) {
            float *d = (float *)dst + o;
            if (vec) fl_cu_st4(d, v), fl_cu_st4(d + 4, v + 4);
            else
                for (int j = 0; j < 8; j++) d[j] = v[j];
        } else {
            uint16_t h[8];
            FL_CU_UNROLL
            for (int j = 0; j < 8; j++) h[j] = fl_cu_f32_to_bf16(v[j]);
            uint16_t *d = (uint16_t *)dst + o;
            if (vec) fl_cu_st8h(d, h);
            else
                for (int j = 0; j < 8; j++) d[j] = h[j];
        }
    }
}

static int q4_view(const fl_q4_weight *w, fl_cu_q4w *v) {
    if (!w || !w->packed || w->rows <= 0 || w->cols <= 0 || (w->type != FL_Q4_NF4 && w->type != FL_Q4_FP4)) return -1;
    if (w->double_quant ? !w->q_absmax || !w->absmax_scale || !w->offset : !w->absmax) return -1;
    v->packed = w->packed;
    v->absmax = w->absmax;
    v->q_absmax = w->q_absmax;
    v->absmax_scale = w->absmax_scale;
    v->offset = w->offset;
    v->row_start = w->row_start;
    v->rows = w->rows;
    v->cols = w->cols;
    v->type = (int)w->type;
    v->dq = w->double_quant ? 1 : 0;
    return 0;
}

/* one launch of a 4-bit matmul: C (N, BWD ? cols : rows; ldc) from A (N, BWD ? rows : cols; lda), TC: 1 the bf16
 * tensor-core kernel, 2 the same over a bf16 A, 0 the fp32 kernel; ldy: the row stride of y / dy (>= rows) */
template <int BWD, int TC>
static int q4_launch(float *C, int ldc, const void *A, int lda, int ldy, const fl_q4_weight *w, int N, float beta,
                     void *stream) {
    fl_cu_q4w v;
    if (q4_view(w, &v) || (beta != 0.0f && beta != 1.0f) || ldy < w->rows || N < 0) return -1;
    if (N == 0) return 0;
    const int ncol = BWD ? w->cols : w->rows, bn = TC ? Q4T_BN : Q4_BN, bm = TC ? Q4T_BM : Q4_BM;
    dim3 grid((unsigned)(ncol + bn - 1) / bn, (unsigned)(N + bm - 1) / bm);
    if (TC == 2) { /* bf16 A: 128-bit runs where lda and A's address keep 8 values 16-byte aligned */
        const int vec = lda % 8 == 0 && ((uintptr_t)A & 15u) == 0;
        FL_CU_LAUNCH(fl_cu_q4_gemm_tc_k<BWD | 2>, grid, dim3(128), 0, (fl_cu_stream)stream, C, ldc, A, lda, v, N, beta,
                     vec);
    } else if (TC)
        FL_CU_LAUNCH(fl_cu_q4_gemm_tc_k<BWD>, grid, dim3(128), 0, (fl_cu_stream)stream, C, ldc, A, lda, v, N, beta,
                     0);
    else
        FL_CU_LAUNCH(fl_cu_q4_gemm_k<BWD>, grid, dim3(256), 0, (fl_cu_stream)stream, C, ldc, (const float *)A, lda, v, N,
                     beta);
    return fl_cu_launch_error();
}

extern "C" int FL_CUK(q4_matmul_forward)(float *y, int ldy, const float *x, const fl_q4_weight *w, int N, float beta,
                                         void *stream) {
    return w ? q4_launch<0, 0>(y, ldy, x, w->cols, ldy, w, N, beta, stream) : -1;
}
extern "C" int FL_CUK(q4_matmul_backward)(float *dx, const float *dy, int ldy, const fl_q4_weight *w, int N, float beta,
                                          void *stream) {
    return w ? q4_launch<1, 0>(dx, w->cols, dy, ldy, ldy, w, N, beta, stream) : -1;
}
extern "C" int FL_CUK(q4_matmul_forward_tc)(float *y, int ldy, const float *x, const fl_q4_weight *w, int N,
                                            float beta, void *stream) {
    return w ? q4_launch<0, 1>(y, ldy, x, w->cols, ldy, w, N, beta, stream) : -1;
}
extern "C" int FL_CUK(q4_matmul_backward_tc)(float *dx, const float *dy, int ldy, const fl_q4_weight *w, int N,
                                             float beta, void *stream) {
    return w ? q4_launch<1, 1>(dx, w->cols, dy, ldy, ldy, w, N, beta, stream) : -1;
}

extern "C" int FL_CUK(q4_matmul_forward16_tc)(float *y, int ldy, const void *x16, const fl_q4_weight *w, int N,
                                              float beta, void *stream) {
    return w ? q4_launch<0, 2>(y, ldy, x16, w->cols, ldy, w, N, beta, stream) : -1;
}
extern "C" int FL_CUK(q4_matmul_backward16_tc)(float *dx, const void *dy16, int ldy, const fl_q4_weight *w, int N,
                                               float beta, void *stream) {
    return w ? q4_launch<1, 2>(dx, w->cols, dy16, ldy, ldy, w, N, beta, stream) : -1;
}

extern "C" int FL_CUK(q4_dequantize)(void *dst, fl_dtype dt, int ldd, const fl_q4_weight *w, int r0, int nr,
                                     void *stream) {
    fl_cu_q4w v;
    if (q4_view(w, &v) || (dt != FL_F32 && dt != FL_BF16) || ldd < w->cols || r0 < 0 || nr < 0 || r0 + nr > w->rows)
        return -1;
    if (nr == 0) return 0;
    const int vec = ((uintptr_t)dst & 15u) == 0 && ldd % (dt == FL_F32 ? 4 : 8) == 0;
    const int pk4 = ((uintptr_t)w->packed & 3u) == 0;
    const dim3 grid((unsigned)((w->cols + 2047) / 2048), (unsigned)(nr < 65535 ? nr : 65535));
    FL_CU_LAUNCH(fl_cu_q4_dequant_k, grid, dim3(256), 0, (fl_cu_stream)stream, dst, (int)dt, ldd, v, r0, nr, vec, pk4);
    return fl_cu_launch_error();
}

/* Small dense products inside the attention kernels (attention.c): the five tile products
 * of flash attention (S = Q K^T, O += P V; backward dP = dO V^T, dV += P^T dO, dK += dS^T Q,
 * dQ = dS K) on one thread, inside the kernels' own parallel loops.
 *
 *   C(M,N) = [C +] A(M,K) B(K,N)
 *   A(i,k) = A[i*ai + k*ak]    (any strides: row-major A, or A^T of a row-major tile)
 *   B(k,n) = B[k*ldb + n]      (rows contiguous)
 *   C(i,n) = C[i*ldc + n]
 *
 * Each C element is one chain over k ascending, c = c + A(i,k) B(k,n) (fused multiply-add
 * where the variant has it), starting from C (acc) or 0. The chain does not depend on the
 * register tiling, so every caller that runs the same product gets the same bits, whatever
 * rows or columns it shares a tile with (attention.c's schedules rely on this).
 *
 * Variants, chosen per call from fl_cpu_level() (include/fitllm/cpu.h):
 *   avx512 (AVX-512F) when N % 16 == 0: register tiles of 6 rows x 32 columns (12 zmm
 *          accumulators, 2 B loads and 6 broadcasts per k), narrower at the edges;
 *   avx2   (AVX2 + FMA) when N % 8 == 0: the same tiles 16 columns wide;
 *   portable C otherwise (any N; what the compiler makes of it at the build's -march).
 * avx512 and avx2 give the same bits (one fused multiply-add per element and k, in order).
 * A tile of the callers (32 x 32 x HD) is 65K multiply-adds per call: the per-call cost
 * (a level read, a switch) is noise. */
#include "backend/cpu/cpu-impl.h"
#include "fitllm/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define AMM_X86 1
#endif

static void mm_portable(float *C, int ldc, const float *A, int ai, int ak, const float *B, int ldb, int M, int N,
                        int K, int acc) {
    for (int i = 0; i < M; i++) {
        float *c = C + (size_t)i * ldc; // (N) row i of C
        if (!acc)
            for (int n = 0; n < N; n++) c[n] = 0.0f;
        for (int k = 0; k < K; k++) {
            float a = A[(size_t)i * ai + (size_t)k * ak];
            const float *b = B + (size_t)k * ldb; // (N) row k of B
#pragma omp simd
            for (int n = 0; n < N; n++) c[n] += a * b[n];
        }
    }
}

#if defined(AMM_X86)
/* C over register tiles of up to 6 rows x 2 vectors of LANES columns (N % LANES == 0): each
 * edge tile gets its own compile-time shape, so its accumulators stay in registers. */
#define MM_DRIVER(NAME, ATTR, TILE_FN_, LANES)                                                                      \
    ATTR static void NAME(float *C, int ldc, const float *A, int ai, int ak, const float *B, int ldb, int M, int N, \
                          int K, int acc) {                                                                          \
        for (int n0 = 0; n0 < N; n0 += 2 * (LANES)) {                                                               \
            const int nv = N - n0 >= 2 * (LANES) ? 2 : 1;                                                           \
            const float *Bt = B + n0;                                                                                \
            for (int i0 = 0; i0 < M; i0 += 6) {                                                                      \
                const int mr = M - i0 < 6 ? M - i0 : 6;                                                              \
                float *Ct = C + (size_t)i0 * ldc + n0;                                                               \
                const float *At = A + (size_t)i0 * ai;                                                               \
                switch (mr * 2 + nv - 2) {                                                                           \
                case 12: TILE_FN_(Ct, ldc, At, ai, ak, Bt, ldb, K, acc, 6, 2); break;                               \
                case 11: TILE_FN_(Ct, ldc, At, ai, ak, Bt, ldb, K, acc, 6, 1); break;                               \
                case 10: TILE_FN_(Ct, ldc, At, ai, ak, Bt, ldb, K, acc, 5, 2); break;                               \
                case 9: TILE_FN_(Ct, ldc, At, ai, ak, Bt, ldb, K, acc, 5, 1); break;                                \
                case 8: TILE_FN_(Ct, ldc, At, ai, ak, Bt, ldb, K, acc, 4, 2); break;                                \
                case 7: TILE_FN_(Ct, ldc, At, ai, ak, Bt, ldb, K, acc, 4, 1); break;                                \
                case 6: TILE_FN_(Ct, ldc, At, ai, ak, Bt, ldb, K, acc, 3, 2); break;                                \
                case 5: TILE_FN_(Ct, ldc, At, ai, ak, Bt, ldb, K, acc, 3, 1); break;                                \
                case 4: TILE_FN_(Ct, ldc, At, ai, ak, Bt, ldb, K, acc, 2, 2); break;                                \
                case 3: TILE_FN_(Ct, ldc, At, ai, ak, Bt, ldb, K, acc, 2, 1); break;                                \
                case 2: TILE_FN_(Ct, ldc, At, ai, ak, Bt, ldb, K, acc, 1, 2); break;                                \
                default: TILE_FN_(Ct, ldc, At, ai, ak, Bt, ldb, K, acc, 1, 1); break;                               \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
    }
#define T2 __attribute__((target("avx2,fma")))

/* One MR x (8 NV) register tile of C over the whole K. MR and NV are constants at every call
 * site (the switch below), so the accumulators live in registers. */
T2 static inline __attribute__((always_inline)) void tile_avx2(float *C, int ldc, const float *A, int ai, int ak,
                                                                const float *B, int ldb, int K, int acc, const int MR,
                                                                const int NV) {
    __m256 c[6][2];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++)
            c[r][v] = acc ? _mm256_loadu_ps(C + (size_t)r * ldc + 8 * v) : _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        const float *b = B + (size_t)k * ldb, *a = A + (size_t)k * ak;
        __m256 b0 = _mm256_loadu_ps(b), b1 = NV > 1 ? _mm256_loadu_ps(b + 8) : b0;
        for (int r = 0; r < MR; r++) {
            __m256 ar = _mm256_broadcast_ss(a + (size_t)r * ai);
            c[r][0] = _mm256_fmadd_ps(ar, b0, c[r][0]);
            if (NV > 1) c[r][1] = _mm256_fmadd_ps(ar, b1, c[r][1]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++) _mm256_storeu_ps(C + (size_t)r * ldc + 8 * v, c[r][v]);
}

MM_DRIVER(mm_avx2, T2, tile_avx2, 8)

/* The same tiles 16 lanes wide (N % 16 == 0): the same fused multiply-add per element in the
 * same order, so the bits equal the AVX2 variant's. On Zen 4 a 512-bit FMA is two 256-bit
 * halves (the same peak), but a k step of the 6 x 32 tile issues 20 instructions for 24
 * 256-bit FMAs' worth of work instead of 20 for 12: the 256-bit kernel is bound by the
 * front end's issue width before the FMA units. */
#define T5 __attribute__((target("avx512f,avx2,fma")))
T5 static inline __attribute__((always_inline)) void tile_avx512(float *C, int ldc, const float *A, int ai, int ak,
                                                                  const float *B, int ldb, int K, int acc,
                                                                  const int MR, const int NV) {
    __m512 c[6][2];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++)
            c[r][v] = acc ? _mm512_loadu_ps(C + (size_t)r * ldc + 16 * v) : _mm512_setzero_ps();
    for (int k = 0; k < K; k++) {
        const float *b = B + (size_t)k * ldb, *a = A + (size_t)k * ak;
        __m512 b0 = _mm512_loadu_ps(b), b1 = NV > 1 ? _mm512_loadu_ps(b + 16) : b0;
        for (int r = 0; r < MR; r++) {
            __m512 ar = _mm512_set1_ps(a[(size_t)r * ai]);
            c[r][0] = _mm512_fmadd_ps(ar, b0, c[r][0]);
            if (NV > 1) c[r][1] = _mm512_fmadd_ps(ar, b1, c[r][1]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(C + (size_t)r * ldc + 16 * v, c[r][v]);
}

MM_DRIVER(mm_avx512, T5, tile_avx512, 16)
#endif

const char *fl_cpu_attn_mm_path(void) {
#if defined(AMM_X86)
    if (fl_cpu_level() >= FL_CPU_AVX512) return "avx512";
    if (fl_cpu_level() >= FL_CPU_AVX2) return "avx2-fma";
#endif
    return "portable";
}

void fl_cpu_attn_mm(float *C, int ldc, const float *A, int ai, int ak, const float *B, int ldb, int M, int N, int K,
                    int acc) {
    if (M <= 0 || N <= 0) return;
#if defined(AMM_X86)
    fl_cpu_level_t lv = fl_cpu_level();
    if (N % 16 == 0 && lv >= FL_CPU_AVX512) {
        mm_avx512(C, ldc, A, ai, ak, B, ldb, M, N, K, acc);
        return;
    }
    if (N % 8 == 0 && lv >= FL_CPU_AVX2) {
        mm_avx2(C, ldc, A, ai, ak, B, ldb, M, N, K, acc);
        return;
    }
#endif
    mm_portable(C, ldc, A, ai, ak, B, ldb, M, N, K, acc);
}

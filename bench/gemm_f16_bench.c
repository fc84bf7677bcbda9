/* gemm_f16_bench: fl_cpu_gemm with an F16 B (the fp16 policies) side by side with the F32 path.
 *
 * Shapes of one linear's forward y = x W^T (trans_b 1, W stored (N,K)) and backward dx = dy W
 * (trans_b 0, W stored (K,N)), M = 1024 rows. Columns: F32 = F32xF32->F32 (the library sgemm);
 * F32xF16 = f32 activations x f16 weights (16-mixed; B widened to fp32 inside the call, time
 * included); F16xF16 = both f16 (16-true); F32xBF16 for reference (A rounded to bf16, oneDNN
 * bf16 matmul where the CPU has avx512_bf16). Each number: the median of --reps timed calls
 * after two warm-ups, the four variants interleaved within each repetition.
 * Usage: gemm_f16_bench [--threads 2] [--reps 9]. Markdown on stdout. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cpu/cpu-impl.h"

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* n values in [-0.1, 0.1): fp32, f16 or bf16 (t). */
static void *rnd(size_t n, fl_dtype t, unsigned seed) {
    uint64_t s = seed * 0x9e3779b97f4a7c15ULL + 1;
    void *p = malloc(n * fl_dtype_size(t));
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        float v = (float)((s >> 40) * (1.0 / 16777216.0)) * 0.2f - 0.1f;
        if (t == FL_F32) ((float *)p)[i] = v;
        else if (t == FL_F16) ((uint16_t *)p)[i] = fl_f32_to_f16(v);
        else ((uint16_t *)p)[i] = fl_f32_to_bf16(v);
    }
    return p;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    int nt = 2, reps = 9;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) nt = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
    }
    if (reps < 1) reps = 1;
    fl_backend be;
    fl_cpu_backend_init(&be, nt);
    printf("library: %s, f16 path: %s, bf16 path: %s, threads: %d, median of %d\n\n", fl_cpu_gemm_library(),
           fl_cpu_gemm_f16_path(), fl_cpu_gemm_bf16_path(), nt, reps);
    printf("| M | N | K | trans_b | F32 ms | F32xF16 ms | F16xF16 ms | F32xBF16 ms | F32 GFLOP/s | F32xF16 / F32 | "
           "F16xF16 / F32 |\n");
    printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    static const int shapes[][3] = {{1024, 2048, 512}, {1024, 512, 2048}};
    static const fl_dtype tas[4] = {FL_F32, FL_F32, FL_F16, FL_F32}, tbs[4] = {FL_F32, FL_F16, FL_F16, FL_BF16};
    double *t = malloc(sizeof(double) * 4 * reps);
    for (int si = 0; si < 2; si++)
        for (int trb = 1; trb >= 0; trb--) {
            int M = shapes[si][0], N = shapes[si][1], K = shapes[si][2], ldb = trb ? K : N;
            void *A[4], *B[4];
            float *C = rnd((size_t)M * N, FL_F32, 3);
            for (int v = 0; v < 4; v++) A[v] = rnd((size_t)M * K, tas[v], 1), B[v] = rnd((size_t)K * N, tbs[v], 2);
            /* variants interleaved within each repetition: load from other processes hits all alike */
            for (int r = -2; r < reps; r++)
                for (int v = 0; v < 4; v++) {
                    double t0 = now_s();
                    fl_status s = fl_cpu_gemm(&be, 0, trb, M, N, K, 1.0f, A[v], tas[v], K, B[v], tbs[v], ldb, 0.0f,
                                              C, FL_F32, N);
                    double dt = now_s() - t0;
                    if (s != FL_OK) {
                        fprintf(stderr, "gemm failed: %s\n", fl_error_message());
                        return 1;
                    }
                    if (r >= 0) t[v * reps + r] = dt;
                }
            double med[4];
            for (int v = 0; v < 4; v++) {
                qsort(t + v * reps, reps, sizeof(double), cmp_d);
                med[v] = t[v * reps + reps / 2];
                free(A[v]), free(B[v]);
            }
            free(C);
            printf("| %d | %d | %d | %d | %.2f | %.2f | %.2f | %.2f | %.1f | %.2f | %.2f |\n", M, N, K, trb,
                   med[0] * 1e3, med[1] * 1e3, med[2] * 1e3, med[3] * 1e3, 2.0 * M * N * K / med[0] * 1e-9,
                   med[1] / med[0], med[2] / med[0]);
            fflush(stdout);
        }
    free(t);
    return 0;
}

/* The CPU's fused causal attention kernels (attention.c, which the attention slots run for the
 * decoder's fused-QKV shape) vs its general kernels (attention_general.c) on the same fused QKV
 * buffer, passed as q/k/v views: causal self-attention, no bias, no mask. Median of reps (and, as the g/f
 * ratio of the fastest runs, "min": on a shared machine the noise only ever adds time), ms.
 * Usage: attention_bench [threads=1] [reps=5] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cpu/cpu-impl.h"
#include "fitllm/backend.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
    qsort(v, n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char **argv) {
    fl_cpu_process_init(argv);
    int threads = argc > 1 ? atoi(argv[1]) : 1, reps = argc > 2 ? atoi(argv[2]) : 5;
    if (reps < 1 || reps > 100) reps = 5;
    fl_backend be;
    if (fl_cpu_backend_init(&be, threads) != FL_OK) return 1;
    struct { const char *name; int B, T, NH, NKV, HD; } sh[] = {
        {"stories15M B4 T256", 4, 256, 6, 6, 48},
        {"stories260K B8 T256", 8, 256, 8, 4, 8},
        {"1B-like GQA B1 T512", 1, 512, 32, 8, 64},
        {"small B4 T256", 4, 256, 12, 12, 64},
    };
    printf("threads %d, median of %d; ms per call (fused = the fused-QKV kernels, general = the general kernels)\n", threads,
           reps);
    printf("%-22s %9s %9s %9s %9s %8s %8s %8s %8s %8s %8s\n", "shape", "fwd fused", "fwd gen", "bwd fused", "bwd gen",
           "fwd g/f", "bwd g/f", "min fwd", "min bwd", "GF/s fwd", "GF/s bwd");
    for (size_t s = 0; s < sizeof sh / sizeof sh[0]; s++) {
        int B = sh[s].B, T = sh[s].T, NH = sh[s].NH, NKV = sh[s].NKV, HD = sh[s].HD;
        size_t W = (size_t)(NH + 2 * NKV) * HD, nq = (size_t)B * T * W, no = (size_t)B * T * NH * HD;
        float *qkv = malloc(nq * 4), *dqkv = calloc(nq, 4), *out = malloc(no * 4), *dout = malloc(no * 4);
        float *lse = malloc((size_t)B * NH * T * 4);
        for (size_t i = 0; i < nq; i++) qkv[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
        for (size_t i = 0; i < no; i++) dout[i] = (float)((i * 40503u) % 1000) / 1000.0f - 0.5f;
        fl_attn_desc a = {B, T, T, NH, NKV, HD, W, W, W, (size_t)NH * HD, 1.0f / sqrtf((float)HD), 1, 0, 0};
        double t[4][100];
        for (int r = 0; r < reps + 1; r++) { /* first round: warm-up, not counted */
            double t0 = now();
            fl_cpu_attn_qkv_forward(&be, out, lse, qkv, B, T, NH, NKV, HD);
            double t1 = now();
            fl_cpu_attn_qkv_backward_sched(&be, dqkv, dout, qkv, out, lse, B, T, NH, NKV, HD, -1);
            double t2 = now();
            if (fl_cpu_attn_general_forward(&be, &a, out, lse, qkv, qkv + (size_t)NH * HD,
                                            qkv + (size_t)(NH + NKV) * HD, NULL, NULL) != FL_OK)
                return 1;
            double t3 = now();
            if (fl_cpu_attn_general_backward_sched(&be, &a, dqkv, dqkv + (size_t)NH * HD, dqkv + (size_t)(NH + NKV) * HD,
                                                   NULL, dout, qkv, qkv + (size_t)NH * HD,
                                                   qkv + (size_t)(NH + NKV) * HD, NULL, NULL, out, lse, -1) != FL_OK)
                return 1;
            double t4 = now();
            if (r == 0) continue;
            t[0][r - 1] = t1 - t0, t[1][r - 1] = t3 - t2, t[2][r - 1] = t2 - t1, t[3][r - 1] = t4 - t3;
        }
        double m[4], mn[4];
        for (int k = 0; k < 4; k++) {
            m[k] = 1e3 * median(t[k], reps); /* sorts t[k] */
            mn[k] = t[k][0];
        }
        /* useful FLOPs of the fused op (the causal half of each T x T product): forward QK^T and PV,
         * backward S, dP, dV, dK, dQ; 2 FLOPs per multiply-add */
        double pairs = (double)B * NH * T * (T + 1) / 2.0 * HD;
        printf("%-22s %9.2f %9.2f %9.2f %9.2f %8.2f %8.2f %8.2f %8.2f %8.1f %8.1f\n", sh[s].name, m[0], m[1], m[2],
               m[3], m[1] / m[0], m[3] / m[2], mn[1] / mn[0], mn[3] / mn[2], 2 * 2 * pairs / (m[0] * 1e6),
               2 * 5 * pairs / (m[2] * 1e6));
        free(qkv); free(dqkv); free(out); free(dout); free(lse);
    }
    return 0;
}

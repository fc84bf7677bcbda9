/* NF4 (bitsandbytes nf4-dq) fused dequantize-matmul vs the f32 GEMM on the "small" LLaMA
 * shapes (C 768, F 2048): forward y = x W^T and input gradient dx = dy W, N = B*T rows.
 * Usage: quant4_bench [threads=2] [N=512] [reps=5]. Best of reps, milliseconds and GFLOP/s. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "fitllm/backend.h"
#include "fitllm/quant4.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2, N = argc > 2 ? atoi(argv[2]) : 512, reps = argc > 3 ? atoi(argv[3]) : 5;
    fl_backend be;
    if (fl_cpu_backend_init(&be, threads) != FL_OK) return 1;
    struct { const char *name; int out, in; } sh[] = {
        {"qkv 2304x768", 2304, 768}, {"o 768x768", 768, 768}, {"gate_up 4096x768", 4096, 768}, {"down 768x2048", 768, 2048}};
    printf("threads %d, N %d rows, gemm %s\n", threads, N, be.gemm_name);
    printf("%-18s %-4s %10s %10s %10s %10s %8s\n", "shape", "op", "f32 ms", "nf4 ms", "f32 GF/s", "nf4 GF/s", "nf4/f32");
    double tot_f = 0, tot_q = 0;
    for (int s = 0; s < 4; s++) {
        int O = sh[s].out, I = sh[s].in;
        size_t n = (size_t)O * I;
        float *w = malloc(n * 4), *x = malloc((size_t)N * I * 4), *y = malloc((size_t)N * O * 4);
        float *dy = malloc((size_t)N * O * 4), *dx = malloc((size_t)N * I * 4);
        unsigned long long st = 12345 + s;
        for (size_t i = 0; i < n; i++) { st = st * 6364136223846793005ULL + 1442695040888963407ULL; w[i] = ((st >> 40) / 16777216.0f - 0.5f) * 0.04f; }
        for (size_t i = 0; i < (size_t)N * I; i++) x[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
        for (size_t i = 0; i < (size_t)N * O; i++) dy[i] = (float)((i * 40503u) % 1000) / 1000.0f - 0.5f;
        void *mem = malloc(fl_q4_bytes(n, 1));
        fl_q4_weight q;
        fl_q4_bind(&q, O, I, FL_Q4_NF4, 1, mem);
        fl_q4_quantize(&q, w, threads);
        double fl = 2.0 * N * O * I;
        for (int op = 0; op < 2; op++) {
            double bf = 1e9, bq = 1e9;
            for (int r = 0; r < reps + 1; r++) {
                double t0 = now();
                if (op == 0) be.gemm(&be, 0, 1, N, O, I, 1.0f, x, FL_F32, I, w, FL_F32, I, 0.0f, y, FL_F32, O);
                else be.gemm(&be, 0, 0, N, I, O, 1.0f, dy, FL_F32, O, w, FL_F32, I, 0.0f, dx, FL_F32, I);
                double t1 = now();
                if (op == 0) be.q4_matmul_forward(&be, y, O, x, &q, N, 0.0f);
                else be.q4_matmul_backward(&be, dx, dy, O, &q, N, 0.0f);
                double t2 = now();
                if (r) { if (t1 - t0 < bf) bf = t1 - t0; if (t2 - t1 < bq) bq = t2 - t1; }
            }
            tot_f += bf;
            tot_q += bq;
            printf("%-18s %-4s %10.2f %10.2f %10.1f %10.1f %8.2f\n", sh[s].name, op ? "dx" : "fwd", bf * 1e3, bq * 1e3,
                   fl / bf * 1e-9, fl / bq * 1e-9, bq / bf);
        }
        printf("%-18s weight bytes: f32 %zu, nf4-dq %zu (%.3f bits/param)\n", "", n * 4, fl_q4_bytes(n, 1),
               8.0 * fl_q4_bytes(n, 1) / n);
        free(w); free(x); free(y); free(dy); free(dx); free(mem);
    }
    printf("total per layer (fwd + dx): f32 %.2f ms, nf4 %.2f ms (%.2fx)\n", tot_f * 1e3, tot_q * 1e3, tot_q / tot_f);
    return 0;
}

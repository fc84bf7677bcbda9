/* gemm_bf16_bench: fl_cpu_gemm with bf16 operands vs the F32 path, on the GEMMs of one
 * training step (N = 1024 rows; per linear W(out,in): fwd y = x W^T (NT), dx += dy W (NN,
 * beta 1), dW += dy^T x (TN, beta 1)).
 *
 * Columns: F32 = F32xF32->F32 (the library sgemm); BF16 = BF16xBF16->F32 on fl_cpu_gemm's bf16
 * path (printed in the header: oneDNN bf16 matmul on avx512_bf16 CPUs, else widen+sgemm; what
 * bf16-true uses with a bf16 activation copy); widen = the same through fl_cpu_gemm_bf16_widen
 * and tiled = through fl_cpu_gemm_bf16_tiled (the pre-widening fallback), whatever the CPU;
 * MIX = F32xBF16->F32 (f32 activations, bf16 weights: A is rounded to bf16 inside the call,
 * conversion time included; fwd/dX only); BF16out = BF16xBF16->BF16. widen/F32 = time ratio.
 * Each number: best of --reps timed calls after one warm-up (primitive creation excluded;
 * tiled: one timed call), the variants interleaved call by call.
 * Usage: gemm_bf16_bench [--threads 2] [--reps 3] [--model tiny|c512|small|all] [--no-lm-head]
 * [--no-tiled]. Markdown on stdout. */
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

static void *rnd(size_t n, int bf16, unsigned seed) {
    uint64_t s = seed * 0x9e3779b97f4a7c15ULL + 1;
    void *p = malloc(n * (bf16 ? 2 : 4));
    if (!p) { fprintf(stderr, "out of memory\n"); exit(1); }
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        float v = (float)((s >> 40) * (1.0 / 16777216.0)) * 0.2f - 0.1f;
        if (bf16) ((uint16_t *)p)[i] = fl_f32_to_bf16(v); else ((float *)p)[i] = v;
    }
    return p;
}

typedef struct { const char *name; int C, F, V; } model_t;
typedef fl_status (*gemm_fn)(const fl_backend *, int, int, int, int, int, float, const void *, fl_dtype, int,
                             const void *, fl_dtype, int, float, void *, fl_dtype, int);

int main(int argc, char **argv) {
    int nt = 2, reps = 3;
    const char *which = "all";
    int no_head = 0, no_tiled = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--no-lm-head")) no_head = 1;
        if (!strcmp(argv[i], "--no-tiled")) no_tiled = 1;
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) nt = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--model") && i + 1 < argc) which = argv[++i];
    }
    fl_backend be;
    fl_cpu_backend_init(&be, nt);
    const int ROWS = 1024;
    model_t models[3] = {{"tiny", 288, 768, 32000}, {"c512", 512, 1376, 32000}, {"small", 768, 2048, 32000}};
    fl_cpu_kernel_info ki;
    fl_cpu_kernels(&ki);
    printf("gemm: %s, bf16 path: %s, cpu level: %s (FITLLM_CPU caps it), avx512_bf16: %d, threads: %d, best of %d\n\n",
           ki.gemm_library, ki.bf16_gemm, ki.cpu_level, fl_cpu_has_avx512bf16(), nt, reps);
    printf("| model | linear | op | M | N | K | F32 GFLOP/s | BF16 GFLOP/s | widen GFLOP/s | tiled GFLOP/s | MIX GFLOP/s | BF16out GFLOP/s | widen/F32 time |\n");
    printf("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int mi = 0; mi < 3; mi++) {
        model_t *m = &models[mi];
        if (strcmp(which, "all") && strcmp(which, m->name)) continue;
        struct { const char *n; int out, in; } lin[5] = {
            {"qkv", 3 * m->C, m->C}, {"o", m->C, m->C}, {"gate+up", 2 * m->F, m->C}, {"down", m->C, m->F}, {"lm_head", m->V, m->C}};
        for (int l = 0; l < 5; l++) {
            if (l == 4 && no_head) continue;
            int out = lin[l].out, in = lin[l].in;
            size_t nx = (size_t)ROWS * in, nw = (size_t)out * in, ny = (size_t)ROWS * out;
            float *X = rnd(nx, 0, 1), *Wf = rnd(nw, 0, 2), *Y = rnd(ny, 0, 3), *dX = rnd(nx, 0, 4), *dW = rnd(nw, 0, 5);
            uint16_t *Xb = rnd(nx, 1, 1), *Wb = rnd(nw, 1, 2), *Yb = rnd(ny, 1, 3), *Ob = rnd((ny > nw ? ny : nw) > nx ? (ny > nw ? ny : nw) : nx, 1, 6);
            for (int var = 0; var < 3; var++) {
                int M, N, K;
                if (var == 0) M = ROWS, N = out, K = in;
                else if (var == 1) M = ROWS, N = in, K = out;
                else M = out, N = in, K = ROWS;
                double gf[6] = {0}, best[6] = {1e30, 1e30, 1e30, 1e30, 1e30, 1e30};
                /* repetitions outer, variants inner: on a shared machine a burst of load hits
                 * every column alike instead of one */
                for (int r = 0; r <= reps; r++)
                for (int ty = 0; ty < 6; ty++) {
                    if (ty == 2 && var == 2) continue;
                    if (ty == 5 && (no_tiled || r > 1)) continue; /* slow: one timed call */
                    gemm_fn fb = ty == 4 ? fl_cpu_gemm_bf16_widen : ty == 5 ? fl_cpu_gemm_bf16_tiled : fl_cpu_gemm;
                    {
                        double t0 = now_s();
                        fl_status s = FL_OK;
                        if (var == 0) { /* y = x W^T */
                            if (ty == 0) s = fl_cpu_gemm(&be, 0, 1, M, N, K, 1, X, FL_F32, in, Wf, FL_F32, in, 0, Y, FL_F32, out);
                            if (ty == 1 || ty >= 4) s = fb(&be, 0, 1, M, N, K, 1, Xb, FL_BF16, in, Wb, FL_BF16, in, 0, Y, FL_F32, out);
                            if (ty == 2) s = fl_cpu_gemm(&be, 0, 1, M, N, K, 1, X, FL_F32, in, Wb, FL_BF16, in, 0, Y, FL_F32, out);
                            if (ty == 3) s = fl_cpu_gemm(&be, 0, 1, M, N, K, 1, Xb, FL_BF16, in, Wb, FL_BF16, in, 0, Ob, FL_BF16, out);
                        } else if (var == 1) { /* dx += dy W */
                            if (ty == 0) s = fl_cpu_gemm(&be, 0, 0, M, N, K, 1, Y, FL_F32, out, Wf, FL_F32, in, 1, dX, FL_F32, in);
                            if (ty == 1 || ty >= 4) s = fb(&be, 0, 0, M, N, K, 1, Yb, FL_BF16, out, Wb, FL_BF16, in, 1, dX, FL_F32, in);
                            if (ty == 2) s = fl_cpu_gemm(&be, 0, 0, M, N, K, 1, Y, FL_F32, out, Wb, FL_BF16, in, 1, dX, FL_F32, in);
                            if (ty == 3) s = fl_cpu_gemm(&be, 0, 0, M, N, K, 1, Yb, FL_BF16, out, Wb, FL_BF16, in, 1, Ob, FL_BF16, in);
                        } else { /* dW += dy^T x */
                            if (ty == 0) s = fl_cpu_gemm(&be, 1, 0, M, N, K, 1, Y, FL_F32, out, X, FL_F32, in, 1, dW, FL_F32, in);
                            if (ty == 1 || ty >= 4) s = fb(&be, 1, 0, M, N, K, 1, Yb, FL_BF16, out, Xb, FL_BF16, in, 1, dW, FL_F32, in);
                            if (ty == 3) s = fl_cpu_gemm(&be, 1, 0, M, N, K, 1, Yb, FL_BF16, out, Xb, FL_BF16, in, 1, Ob, FL_BF16, in);
                        }
                        double dt = now_s() - t0;
                        if (s != FL_OK) { fprintf(stderr, "gemm failed: %s\n", fl_error_message()); return 1; }
                        if (r > 0 && dt < best[ty]) best[ty] = dt;
                    }
                }
                for (int ty = 0; ty < 6; ty++) gf[ty] = 2.0 * M * N * K / best[ty] * 1e-9;
                static const char *vn[3] = {"fwd NT", "dX NN", "dW TN"};
                char mix[32], tiled[32];
                if (var == 2) snprintf(mix, sizeof mix, "-"); else snprintf(mix, sizeof mix, "%.1f", gf[2]);
                if (no_tiled) snprintf(tiled, sizeof tiled, "-"); else snprintf(tiled, sizeof tiled, "%.1f", gf[5]);
                printf("| %s | %s | %s | %d | %d | %d | %.1f | %.1f | %.1f | %s | %s | %.1f | %.2f |\n", m->name, lin[l].n,
                       vn[var], M, N, K, gf[0], gf[1], gf[4], tiled, mix, gf[3], gf[0] / gf[4]);
                fflush(stdout);
            }
            free(X), free(Wf), free(Y), free(dX), free(dW), free(Xb), free(Wb), free(Yb), free(Ob);
        }
    }
    return 0;
}

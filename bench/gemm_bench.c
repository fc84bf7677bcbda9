/* gemm_bench: OpenBLAS cblas_sgemm vs oneDNN dnnl_sgemm on the GEMMs of one
 * training step of our benchmark models, with 1 and 2 threads.
 *
 * Per linear layer W (out, in) applied to N = B*T = 1024 rows:
 *   fwd  y  = x W^T        NT  M=N   N=out K=in   beta=0
 *   dX  dx += dy W         NN  M=N   N=in  K=out  beta=1 (backward accumulates)
 *   dW  dW += dy^T x       TN  M=out N=in  K=N    beta=1
 * Linears: qkv (3C,C), o (C,C), gate+up fused (2F,C), down (C,F), lm_head
 * (V,C), and the lm_head applied in chunks of 256 rows (each chunk is an M=256
 * NT/NN call and a K=256 TN call; the step does 1024/256 of them).
 *
 * Measurements are interleaved: every repetition walks all shapes, and for
 * each shape runs every (library, threads) config in a rotating order. One
 * measurement = mean of back-to-back calls over >= 40 ms (first call is the
 * warm-up), the reported number is the median over the repetitions.
 * OpenBLAS's pthread workers busy-wait after a call (OPENBLAS_THREAD_TIMEOUT)
 * and libgomp's after a parallel region, so when the config switches library
 * we sleep --settle-ms first, so one library's idle spinners do not slow the
 * other. A separate section (--interop) measures that interference.
 *
 * Usage: gemm_bench [--reps N] [--min-ms X] [--settle-ms X] [--model tiny|small]
 *                   [--no-interop] [--interop-only]
 * Output: markdown on stdout.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <omp.h>

#ifdef FL_BENCH_OPENBLAS
#include <cblas.h>
void openblas_set_num_threads(int num_threads);
char *openblas_get_config(void);
char *openblas_get_corename(void);
#endif
#ifdef FL_BENCH_ONEDNN
#include <dnnl.h>
#endif

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

enum { LIB_OPENBLAS, LIB_ONEDNN, LIB_COUNT };
static const char *lib_name[LIB_COUNT] = {"OpenBLAS", "oneDNN"};
static int lib_have[LIB_COUNT] = {
#ifdef FL_BENCH_OPENBLAS
    1,
#else
    0,
#endif
#ifdef FL_BENCH_ONEDNN
    1,
#else
    0,
#endif
};

static int g_blas_nt = -1;

static void sgemm(int lib, int nt, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                  const float *B, int ldb, float beta, float *C, int ldc) {
    if (lib == LIB_OPENBLAS) {
#ifdef FL_BENCH_OPENBLAS
        if (g_blas_nt != nt) openblas_set_num_threads(g_blas_nt = nt);
        cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, alpha,
                    A, lda, B, ldb, beta, C, ldc);
#endif
    } else {
#ifdef FL_BENCH_ONEDNN
        if (omp_get_max_threads() != nt) omp_set_num_threads(nt);
        if (dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc) != dnnl_success) {
            fprintf(stderr, "dnnl_sgemm failed\n");
            exit(1);
        }
#endif
    }
}

/* ---- shapes ------------------------------------------------------------------ */
#define ROWS 1024
#define CHUNK 256

typedef struct {
    const char *model;
    int layers;
    int C, F, V;
} model_t;

static const model_t g_models[] = {
    {"tiny", 6, 288, 768, 32000},   /* llama2.c stories15M: 6 layers, 6 heads */
    {"small", 12, 768, 2048, 32000} /* 12 layers, 12 heads */
};

typedef struct {
    const model_t *m;
    const char *lin;
    int out, in;
    int chunked; /* lm_head in chunks of CHUNK rows */
    int per_step; /* how many times the step applies this linear (layers, or 1) */
    float *X, *W, *Y, *dX, *dW;
} linear_t;

typedef struct {
    linear_t *l;
    int var; /* 0 fwd NT, 1 dX NN, 2 dW TN */
    int M, N, K;
    double calls_per_step; /* per_step * (chunks) */
    double med[LIB_COUNT][2]; /* median seconds per call, [lib][nt-1] */
    double *samples[LIB_COUNT][2];
} shape_t;

static const char *var_name[3] = {"fwd NT", "dX NN", "dW TN"};

static float *randbuf(size_t n, unsigned seed) {
    float *p = malloc(n * sizeof(float));
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    uint64_t s = seed * 0x9e3779b97f4a7c15ULL + 1;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        p[i] = (float)((s >> 40) * (1.0 / 16777216.0)) * 0.2f - 0.1f;
    }
    return p;
}

static void run_shape(const shape_t *s, int lib, int nt) {
    linear_t *l = s->l;
    int rows = l->chunked ? CHUNK : ROWS;
    switch (s->var) {
    case 0: /* y(rows,out) = x(rows,in) W(out,in)^T */
        sgemm(lib, nt, 0, 1, rows, l->out, l->in, 1.0f, l->X, l->in, l->W, l->in, 0.0f, l->Y, l->out);
        break;
    case 1: /* dx(rows,in) += dy(rows,out) W(out,in) */
        sgemm(lib, nt, 0, 0, rows, l->in, l->out, 1.0f, l->Y, l->out, l->W, l->in, 1.0f, l->dX, l->in);
        break;
    default: /* dW(out,in) += dy(rows,out)^T x(rows,in) */
        sgemm(lib, nt, 1, 0, l->out, l->in, rows, 1.0f, l->Y, l->out, l->X, l->in, 1.0f, l->dW, l->in);
        break;
    }
}

static double time_shape(const shape_t *s, int lib, int nt, double min_s) {
    double t0 = now_s();
    run_shape(s, lib, nt);
    double t1 = now_s();
    if (t1 - t0 >= min_s) return t1 - t0;
    int n = 0;
    t0 = now_s();
    do {
        run_shape(s, lib, nt);
        n++;
        t1 = now_s();
    } while (t1 - t0 < min_s);
    return (t1 - t0) / n;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static double median(double *v, int n) {
    double *t = malloc(n * sizeof(double));
    memcpy(t, v, n * sizeof(double));
    qsort(t, n, sizeof(double), cmp_d);
    double m = n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
    free(t);
    return m;
}

static void settle(double ms) {
    if (ms > 0) usleep((useconds_t)(ms * 1000));
}

/* ---- interop: OpenMP kernels alternating with GEMM ------------------------------ */
/* An rmsnorm-like OpenMP kernel over (ROWS, C): the kind of op that runs
 * between the GEMMs of a step. */
static void omp_kernel(float *out, const float *x, int rows, int C, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int i = 0; i < rows; i++) {
        const float *xi = x + (size_t)i * C;
        float ss = 0;
        for (int j = 0; j < C; j++) ss += xi[j] * xi[j];
        float r = 1.0f / sqrtf(ss / C + 1e-5f);
        for (int j = 0; j < C; j++) out[(size_t)i * C + j] = xi[j] * r;
    }
}

static void interop(int reps, double settle_ms) {
    const int C = 768, nt = 2, iters = 40, kper = 6;
    float *x = randbuf((size_t)ROWS * 3 * C, 1), *o = randbuf((size_t)ROWS * 3 * C, 2);
    float *w = randbuf((size_t)C * C, 3), *y = randbuf((size_t)ROWS * C, 4);
    printf("\n### Interference: 2-thread OpenMP kernels between 2-thread GEMMs\n\n");
    printf("Loop of %d x { sgemm NT 1024x768x768 ; %d x rmsnorm-like OpenMP kernel over 1024x2304 }, "
           "median of %d; 'alone' = same calls without the other kind in between.\n\n",
           iters, kper, reps);
    printf("| library | kernel alone (us) | kernel after GEMM (us) | GEMM alone (ms) | GEMM after kernels (ms) | "
           "loop total (ms) | sum of alone (ms) |\n|---|---:|---:|---:|---:|---:|---:|\n");
    for (int lib = 0; lib < LIB_COUNT; lib++) {
        if (!lib_have[lib]) continue;
        double *ka = malloc(reps * sizeof(double)), *kb = malloc(reps * sizeof(double));
        double *ga = malloc(reps * sizeof(double)), *gb = malloc(reps * sizeof(double));
        double *lt = malloc(reps * sizeof(double));
        for (int r = 0; r < reps; r++) {
            settle(settle_ms);
            /* kernels alone */
            for (int i = 0; i < 5; i++) omp_kernel(o, x, ROWS, 3 * C, nt);
            double t0 = now_s();
            for (int i = 0; i < iters * kper; i++) omp_kernel(o, x, ROWS, 3 * C, nt);
            ka[r] = (now_s() - t0) / (iters * kper);
            settle(settle_ms);
            /* gemm alone */
            sgemm(lib, nt, 0, 1, ROWS, C, C, 1, x, C, w, C, 0, y, C);
            t0 = now_s();
            for (int i = 0; i < iters; i++) sgemm(lib, nt, 0, 1, ROWS, C, C, 1, x, C, w, C, 0, y, C);
            ga[r] = (now_s() - t0) / iters;
            settle(settle_ms);
            /* alternating */
            double tk = 0, tg = 0, tl0 = now_s();
            for (int i = 0; i < iters; i++) {
                double a = now_s();
                sgemm(lib, nt, 0, 1, ROWS, C, C, 1, x, C, w, C, 0, y, C);
                double b = now_s();
                for (int k = 0; k < kper; k++) omp_kernel(o, x, ROWS, 3 * C, nt);
                double c = now_s();
                tg += b - a;
                tk += c - b;
            }
            lt[r] = now_s() - tl0;
            kb[r] = tk / (iters * kper);
            gb[r] = tg / iters;
        }
        double mka = median(ka, reps), mga = median(ga, reps);
        printf("| %s | %.0f | %.0f | %.2f | %.2f | %.1f | %.1f |\n", lib_name[lib], mka * 1e6, median(kb, reps) * 1e6,
               mga * 1e3, median(gb, reps) * 1e3, median(lt, reps) * 1e3, iters * (mga + kper * mka) * 1e3);
        fflush(stdout);
        free(ka), free(kb), free(ga), free(gb), free(lt);
    }
    free(x), free(o), free(w), free(y);
}

int main(int argc, char **argv) {
    int reps = 7, do_interop = 1, only_interop = 0;
    double min_ms = 40, settle_ms = 150;
    const char *only_model = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--min-ms") && i + 1 < argc) min_ms = atof(argv[++i]);
        else if (!strcmp(argv[i], "--settle-ms") && i + 1 < argc) settle_ms = atof(argv[++i]);
        else if (!strcmp(argv[i], "--model") && i + 1 < argc) only_model = argv[++i];
        else if (!strcmp(argv[i], "--no-interop")) do_interop = 0;
        else if (!strcmp(argv[i], "--interop-only")) only_interop = 1;
        else {
            fprintf(stderr, "usage: %s [--reps N] [--min-ms X] [--settle-ms X] [--model tiny|small] [--no-interop] "
                            "[--interop-only]\n", argv[0]);
            return 2;
        }
    }
    if (reps < 1) reps = 1;
    if (!lib_have[0] && !lib_have[1]) {
        fprintf(stderr, "gemm_bench: built without OpenBLAS and oneDNN\n");
        return 1;
    }
    printf("## gemm_bench\n\n");
#ifdef FL_BENCH_OPENBLAS
    printf("- OpenBLAS: %s (core %s)\n", openblas_get_config(), openblas_get_corename());
#endif
#ifdef FL_BENCH_ONEDNN
    {
        const dnnl_version_t *v = dnnl_version();
        printf("- oneDNN: %d.%d.%d (cpu runtime %s)\n", v->major, v->minor, v->patch,
               v->cpu_runtime == DNNL_RUNTIME_OMP ? "OpenMP" : "other");
    }
#endif
    printf("- rows N = B*T = %d, lm_head chunk = %d rows; %d reps interleaved, >= %.0f ms per measurement, "
           "median reported; settle %.0f ms on library switch\n\n",
           ROWS, CHUNK, reps, min_ms, settle_ms);
    fflush(stdout);
    if (only_interop) {
        interop(reps, settle_ms);
        return 0;
    }

    /* build the linears and shapes */
    linear_t lins[32];
    shape_t shapes[96];
    int nl = 0, ns = 0;
    for (size_t mi = 0; mi < sizeof g_models / sizeof g_models[0]; mi++) {
        const model_t *m = &g_models[mi];
        if (only_model && strcmp(only_model, m->model)) continue;
        struct { const char *n; int out, in, chunked; } defs[] = {
            {"qkv", 3 * m->C, m->C, 0}, {"o", m->C, m->C, 0},         {"gate+up", 2 * m->F, m->C, 0},
            {"down", m->C, m->F, 0},    {"lm_head", m->V, m->C, 0}, {"lm_head/256", m->V, m->C, 1}};
        float *lm_bufs[5] = {0};
        for (int d = 0; d < 6; d++) {
            linear_t *l = &lins[nl++];
            memset(l, 0, sizeof *l);
            l->m = m;
            l->lin = defs[d].n;
            l->out = defs[d].out;
            l->in = defs[d].in;
            l->chunked = defs[d].chunked;
            l->per_step = d < 4 ? m->layers : 1;
            if (l->chunked) { /* share the full lm_head's buffers */
                l->X = lm_bufs[0], l->W = lm_bufs[1], l->Y = lm_bufs[2], l->dX = lm_bufs[3], l->dW = lm_bufs[4];
            } else {
                l->X = randbuf((size_t)ROWS * l->in, 10 + nl);
                l->W = randbuf((size_t)l->out * l->in, 20 + nl);
                l->Y = randbuf((size_t)ROWS * l->out, 30 + nl);
                l->dX = randbuf((size_t)ROWS * l->in, 40 + nl);
                l->dW = randbuf((size_t)l->out * l->in, 50 + nl);
                if (d == 4) lm_bufs[0] = l->X, lm_bufs[1] = l->W, lm_bufs[2] = l->Y, lm_bufs[3] = l->dX,
                            lm_bufs[4] = l->dW;
            }
            int rows = l->chunked ? CHUNK : ROWS;
            for (int v = 0; v < 3; v++) {
                shape_t *s = &shapes[ns++];
                memset(s, 0, sizeof *s);
                s->l = l;
                s->var = v;
                s->M = v == 2 ? l->out : rows;
                s->N = v == 0 ? l->out : l->in;
                s->K = v == 0 ? l->in : v == 1 ? l->out : rows;
                s->calls_per_step = l->per_step * (l->chunked ? ROWS / CHUNK : 1);
                for (int lib = 0; lib < LIB_COUNT; lib++)
                    for (int t = 0; t < 2; t++) s->samples[lib][t] = calloc(reps, sizeof(double));
            }
        }
    }

    /* configs: (lib, nt) */
    int cfg[4][2], nc = 0;
    for (int lib = 0; lib < LIB_COUNT; lib++)
        if (lib_have[lib])
            for (int t = 1; t <= 2; t++) cfg[nc][0] = lib, cfg[nc][1] = t, nc++;

    double tstart = now_s();
    int last_lib = -1;
    for (int r = 0; r < reps; r++) {
        for (int si = 0; si < ns; si++) {
            shape_t *s = &shapes[si];
            for (int c = 0; c < nc; c++) {
                int k = (c + r + si) % nc; /* rotate the order */
                int lib = cfg[k][0], nt = cfg[k][1];
                if (lib != last_lib) settle(settle_ms);
                last_lib = lib;
                s->samples[lib][nt - 1][r] = time_shape(s, lib, nt, min_ms * 1e-3);
            }
        }
        fprintf(stderr, "rep %d/%d done (%.0f s)\n", r + 1, reps, now_s() - tstart);
    }
    for (int si = 0; si < ns; si++)
        for (int lib = 0; lib < LIB_COUNT; lib++)
            for (int t = 0; t < 2; t++)
                if (lib_have[lib]) shapes[si].med[lib][t] = median(shapes[si].samples[lib][t], reps);

    /* per-shape table */
    printf("### Median GFLOP/s per shape\n\n");
    printf("| model | linear | op | M | N | K | OpenBLAS 1T | oneDNN 1T | OpenBLAS 2T | oneDNN 2T |\n");
    printf("|---|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int si = 0; si < ns; si++) {
        shape_t *s = &shapes[si];
        double fl = 2.0 * s->M * s->N * s->K;
        printf("| %s | %s | %s | %d | %d | %d |", s->l->m->model, s->l->lin, var_name[s->var], s->M, s->N, s->K);
        for (int t = 0; t < 2; t++)
            for (int lib = 0; lib < LIB_COUNT; lib++) {
                if (!lib_have[lib]) {
                    printf(" - |");
                    continue;
                }
                double best = fmin(s->med[0][t], s->med[1][t]);
                int win = lib_have[0] && lib_have[1] && s->med[lib][t] == best;
                printf(win ? " **%.1f** |" : " %.1f |", fl / s->med[lib][t] * 1e-9);
            }
        printf("\n");
    }

    /* per-model step summary */
    printf("\n### One training step's GEMMs (time-weighted), ms\n\n");
    printf("Sum over the step of median time per call x calls per step (layers x 3 ops for qkv/o/gate+up/down, "
           "plus the lm_head applied either whole or as %d chunks of %d rows). Effective GFLOP/s in brackets.\n\n",
           ROWS / CHUNK, CHUNK);
    printf("| model | layers | lm_head | GFLOP | OpenBLAS 1T | oneDNN 1T | OpenBLAS 2T | oneDNN 2T | "
           "oneDNN/OpenBLAS 1T | oneDNN/OpenBLAS 2T |\n");
    printf("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for (size_t mi = 0; mi < sizeof g_models / sizeof g_models[0]; mi++) {
        const model_t *m = &g_models[mi];
        if (only_model && strcmp(only_model, m->model)) continue;
        for (int chunked = 0; chunked < 2; chunked++) {
            double tot[LIB_COUNT][2] = {{0}}, fl = 0;
            for (int si = 0; si < ns; si++) {
                shape_t *s = &shapes[si];
                if (s->l->m != m) continue;
                int is_lm = !strncmp(s->l->lin, "lm_head", 7);
                if (is_lm && s->l->chunked != chunked) continue;
                fl += 2.0 * s->M * s->N * s->K * s->calls_per_step;
                for (int lib = 0; lib < LIB_COUNT; lib++)
                    for (int t = 0; t < 2; t++) tot[lib][t] += s->med[lib][t] * s->calls_per_step;
            }
            printf("| %s | %d | %s | %.1f |", m->model, m->layers, chunked ? "4x256 rows" : "whole (1024 rows)",
                   fl * 1e-9);
            for (int t = 0; t < 2; t++)
                for (int lib = 0; lib < LIB_COUNT; lib++)
                    if (lib_have[lib]) printf(" %.1f (%.0f) |", tot[lib][t] * 1e3, fl / tot[lib][t] * 1e-9);
                    else printf(" - |");
            for (int t = 0; t < 2; t++)
                if (lib_have[0] && lib_have[1]) printf(" %.2f |", tot[1][t] / tot[0][t]);
                else printf(" - |");
            printf("\n");
        }
    }
    fflush(stdout);
    if (do_interop) interop(reps, settle_ms);
    return 0;
}

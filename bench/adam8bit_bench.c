/* 8-bit AdamW (bnb's block-wise AdamW8bit) on the CPU backend: one step over a flat fp32 tensor of n parameters,
 * the median of reps after one warm-up, milliseconds (its peer: bench/bench_adam8bit_torch.py, bitsandbytes'
 * AdamW8bit on the CPU; bench/run_adam8bit_bench.sh runs both in turn).
 * Usage: adam8bit_bench [threads=2] [n=26000000] [reps=5] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fitllm/adam8bit.h"
#include "fitllm/backend.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}
static int cmpd(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 2, reps = argc > 3 ? atoi(argv[3]) : 5;
    const size_t n = argc > 2 ? (size_t)atoll(argv[2]) : 26000000;
    if (threads < 1 || reps < 1 || reps > 100 || n < FL_ADAM8BIT_MIN_SIZE) {
        fprintf(stderr, "usage: adam8bit_bench [threads >= 1] [n >= %d] [reps 1..100]\n", FL_ADAM8BIT_MIN_SIZE);
        return 2;
    }
    fl_backend be;
    if (fl_cpu_backend_init(&be, threads) != FL_OK) return 1;
    float *p = malloc(n * 4), *g = malloc(n * 4);
    void *mem = calloc(1, fl_adam8bit_state_bytes(n));
    fl_adam8bit_state st;
    if (!p || !g || !mem || fl_adam8bit_state_bind(&st, n, mem) != FL_OK) return 1;
    unsigned long long s = 7;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        p[i] = ((float)(s >> 40) / 16777216.0f - 0.5f) * 0.04f;
        g[i] = ((float)((s >> 20) & 0xfffff) / 1048576.0f - 0.5f) * 2e-3f;
    }
    double t[101];
    for (int r = 0; r <= reps; r++) { /* r 0: the warm-up */
        const double t0 = now();
        if (be.adam8bit_update(&be, p, FL_F32, g, FL_F32, &st, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, r + 1, 1.0f) != FL_OK)
            return 1;
        t[r] = now() - t0;
    }
    qsort(t + 1, (size_t)reps, sizeof t[0], cmpd);
    printf("RESULT fitllm adam8bit_update n=%zu threads=%d median_ms=%.1f min_ms=%.1f max_ms=%.1f\n", n, threads,
           t[1 + reps / 2] * 1e3, t[1] * 1e3, t[reps] * 1e3);
    free(p), free(g), free(mem);
    fl_backend_free(&be);
    return 0;
}

/* Fused softmax cross-entropy over the vocabulary.
 *
 * One pass over each row in CHUNK-sized pieces keeps an online max m and sum
 * s = sum exp(x - m) (rescaled when m grows), so the (N,V) logits are read once
 * for the loss and once more for the gradient, never materializing a softmax.
 * Rows are independent: parallel over rows, deterministic. */
#include <math.h>
#include <omp.h>

#include "backend/cpu/cpu-impl.h"

#define CHUNK 512

void fl_cpu_cross_entropy(const fl_backend *be, float *loss /*(N)*/, float *dlogits /*(N,V) or NULL*/,
                          const float *logits /*(N,V)*/, const int32_t *targets /*(N)*/, int N, int V,
                          float grad_scale, int ignore_index) {
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)N * V >= FL_CPU_PAR_MIN)
    for (int n = 0; n < N; n++) {
        const float *x = logits + (size_t)n * V;
        float *dx = dlogits ? dlogits + (size_t)n * V : NULL;
        int tgt = targets[n];
        if (tgt == ignore_index) {
            loss[n] = 0.0f;
            if (dx) memset(dx, 0, (size_t)V * sizeof(float));
            continue;
        }
        float m = -INFINITY;
        double s = 0.0; /* across chunks in double: V up to ~256k */
        for (int v0 = 0; v0 < V; v0 += CHUNK) {
            int v1 = v0 + CHUNK < V ? v0 + CHUNK : V;
            float cm = -INFINITY;
            /* FL_VECTORIZE: xent_max */
#pragma omp simd reduction(max : cm)
            for (int v = v0; v < v1; v++) cm = x[v] > cm ? x[v] : cm;
            if (cm > m) {
                s *= (double)fl_cpu_expf(m - cm); /* m = -inf first: s is 0 anyway */
                m = cm;
            }
            float cs = 0.0f;
            /* FL_VECTORIZE: xent_exp_sum */
#pragma omp simd reduction(+ : cs)
            for (int v = v0; v < v1; v++) cs += fl_cpu_expf(x[v] - m);
            s += cs;
        }
        float lse = m + (float)log(s);
        float xt = x[tgt]; /* read before dlogits (which may alias) overwrites it */
        loss[n] = lse - xt;
        if (dx) {
            /* FL_VECTORIZE: xent_softmax_grad */
#pragma omp simd
            for (int v = 0; v < V; v++) dx[v] = grad_scale * fl_cpu_expf(x[v] - lse);
            dx[tgt] -= grad_scale;
        }
    }
}

/* ---- backend.h vocab_stats / vocab_xent: the vocabulary-parallel cross-entropy's halves (issue 35). The arithmetic
 * of src/model/tp_vocab.c's host loops before the op existed (the same bits): the max in float, the sums and the
 * exponentials in double, rows in parallel (each row's order fixed). */
fl_status fl_cpu_vocab_stats(const fl_backend *be, double *stats, const float *logits, const int32_t *targets, int rows,
                             int n, int lo) {
    if (rows < 0 || n <= 0 || (rows && (!stats || !logits || !targets)))
        return fl_errorf(FL_ERR_INVALID, "vocab_stats: %d rows of %d logits (or a NULL buffer)", rows, n);
#pragma omp parallel for num_threads(be->n_threads) schedule(static)
    for (int i = 0; i < rows; i++) {
        const float *x = logits + (size_t)i * n;
        float mx = -INFINITY;
        for (int v = 0; v < n; v++) mx = x[v] > mx ? x[v] : mx;
        double sum = 0;
        for (int v = 0; v < n; v++) sum += exp((double)x[v] - mx);
        const int t = targets[i] - lo;
        stats[3 * (size_t)i] = mx, stats[3 * (size_t)i + 1] = sum, stats[3 * (size_t)i + 2] = t >= 0 && t < n ? x[t] : 0;
    }
    return FL_OK;
}

fl_status fl_cpu_vocab_xent(const fl_backend *be, float *loss, float *dlogits, const float *logits, const double *all,
                            const int32_t *targets, int rows, int n, int lo, int P, int me, int V, float grad_scale,
                            int ignore_index) {
    if (rows < 0 || n <= 0 || P <= 0 || me < 0 || me >= P || V < P || (rows && (!loss || !logits || !all || !targets)))
        return fl_errorf(FL_ERR_INVALID, "vocab_xent: %d rows of %d logits, rank %d of %d, vocabulary %d (or a NULL "
                         "buffer)", rows, n, me, P, V);
#pragma omp parallel for num_threads(be->n_threads) schedule(static)
    for (int i = 0; i < rows; i++) {
        const int tg = targets[i];
        float *dx = dlogits ? dlogits + (size_t)i * n : NULL;
        if (tg == ignore_index) {
            loss[i] = 0;
            if (dx) memset(dx, 0, (size_t)n * sizeof *dx);
            continue;
        }
        double M = -INFINITY, S = 0;
        for (int k = 0; k < P; k++) M = all[((size_t)k * rows + i) * 3] > M ? all[((size_t)k * rows + i) * 3] : M;
        for (int k = 0; k < P; k++) S += all[((size_t)k * rows + i) * 3 + 1] * exp(all[((size_t)k * rows + i) * 3] - M);
        int owner = -1; /* out of range: the loss's sum names it */
        for (int k = 0; k < P; k++)
            if (tg >= (int)((long long)k * V / P) && tg < (int)((long long)(k + 1) * V / P)) owner = k;
        const float lse = (float)M + (float)log(S), xt = owner >= 0 ? (float)all[((size_t)owner * rows + i) * 3 + 2] : 0;
        loss[i] = lse - xt;
        if (!dx) continue;
        const float *x = logits + (size_t)i * n;
        for (int v = 0; v < n; v++) dx[v] = grad_scale * (float)exp((double)x[v] - lse);
        if (owner == me) dx[tg - lo] -= grad_scale;
    }
    return FL_OK;
}

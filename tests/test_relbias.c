/* The backend's relbias_forward / relbias_backward (T5's relative position bias; backend.h), on every backend:
 * the forward's copies bit for bit; the backward against float64 (each bucket's sum within the fp32 summation bound
 * of its terms: (n + 1) u sum |x|, any order) and bit for bit against the contract's order written here as plain
 * loops (per diagonal, 32 partials dealt by row, a warp's butterfly; the buckets' sums over their diagonals in
 * increasing r, added once), so the CPU and the GPU kernels (cuda-emu) hold the same bits; then the model-level
 * consequence: a T5 bias is Toeplitz, and the op over T5's buckets equals the per-element definition. Bad shapes get
 * FL_ERR_INVALID naming the op; cuda-emu's work area refuses a shape beyond it by name. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"
#include "test.h"

/* the contract's order, as loops */
static void relbias_spec(float *dtab, const float *dbias, const int32_t *rb, int NH, int Tq, int Tk, int nb) {
    const int nd = Tq + Tk - 1;
    for (int h = 0; h < NH; h++) {
        float acc[FL_RELBIAS_MAX_BUCKETS] = {0};
        for (int k = 0; k < nd; k++) {
            const int r = k - (Tq - 1);
            float P[32] = {0};
            for (int i = 0; i < Tq; i++)
                if (i + r >= 0 && i + r < Tk) P[i % 32] += dbias[((size_t)h * Tq + i) * Tk + i + r];
            for (int off = 16; off > 0; off >>= 1)
                for (int s = 0; s < off; s++) P[s] = P[s] + P[s + off];
            if (rb[k] >= 0 && rb[k] < nb) acc[rb[k]] += P[0];
        }
        for (int b = 0; b < nb; b++) dtab[h * nb + b] += acc[b];
    }
}

/* buckets shaped as T5's (seq2seq.c's function is T5's exact float32 arithmetic; any fixed map of the diagonals
 * serves here): bidirectional, the keys after the query in the upper half; causal, only keys before it; one bucket
 * per distance near the diagonal, then every third distance shares one, the far ones the last */
static int32_t t5ish_bucket(int rel, int bidir, int nb) {
    const int half = bidir ? nb / 2 : nb, base = bidir && rel > 0 ? half : 0;
    const int n = bidir ? abs(rel) : (rel < 0 ? -rel : 0), near = half / 2;
    const int v = n < near ? n : near + (n - near) / 3;
    return base + (v < half - 1 ? v : half - 1);
}

typedef struct {
    int NH, Tq, Tk, nb, kind; /* kind 0: T5 bidirectional buckets, 1: causal (the decoder; dbias 0 above the
                               * diagonal as its masked attention leaves it), 2: random buckets, some outside [0, nb) */
} rb_case;

static void relbias_on(fl_backend be) {
    static const rb_case cases[] = {
        {3, 37, 37, 32, 0},  {2, 130, 130, 32, 0}, {2, 130, 130, 32, 1}, {3, 5, 70, 40, 2},
        {2, 70, 3, 7, 2},    {4, 1, 9, 32, 1},     {1, 1, 1, 1, 2},      {2, 33, 95, 1024, 2},
    };
    const int n_cases = (int)(sizeof cases / sizeof cases[0]);
    fl_test_rng r = {17};
    for (int c = 0; c < n_cases; c++) {
        const rb_case *q = &cases[c];
        if (fl_test_backend_emulated(&be) && (size_t)q->NH * q->Tq * q->Tk > 40000) continue; /* slow there */
        const int nd = q->Tq + q->Tk - 1;
        const size_t nbias = (size_t)q->NH * q->Tq * q->Tk, ntab = (size_t)q->NH * q->nb;
        int32_t *rb = malloc((size_t)nd * sizeof *rb);
        for (int k = 0; k < nd; k++) {
            const int rel = k - (q->Tq - 1);
            rb[k] = q->kind < 2 ? t5ish_bucket(rel, q->kind == 0, q->nb)
                                : (int32_t)(fl_test_rng_u64(&r) % (uint64_t)(q->nb + 2)) - 1; /* -1 .. nb */
        }
        float *tab = fl_test_frand(&r, ntab, -2, 2), *bias = fl_test_frand(&r, nbias, -9, 9);
        be.relbias_forward(&be, bias, tab, rb, q->NH, q->Tq, q->Tk, q->nb);
        size_t bad = 0;
        for (int h = 0; h < q->NH; h++)
            for (int i = 0; i < q->Tq; i++)
                for (int j = 0; j < q->Tk; j++) {
                    const int b = rb[j - i + q->Tq - 1];
                    const float want = b >= 0 && b < q->nb ? tab[h * q->nb + b] : 0.0f;
                    const float got = bias[((size_t)h * q->Tq + i) * q->Tk + j];
                    bad += memcmp(&got, &want, sizeof got) != 0;
                }
        FL_CHECKF(bad == 0, "%s relbias_forward case %d (NH %d, Tq %d, Tk %d, nb %d): %zu elements not the table's", be.name,
                  c, q->NH, q->Tq, q->Tk, q->nb, bad);
        float *dbias = fl_test_frand(&r, nbias, -1, 1);
        if (q->kind == 1) /* causal: keys after the query carry no gradient */
            for (int h = 0; h < q->NH; h++)
                for (int i = 0; i < q->Tq; i++)
                    for (int j = i + 1; j < q->Tk; j++) dbias[((size_t)h * q->Tq + i) * q->Tk + j] = 0.0f;
        float *dtab = fl_test_frand(&r, ntab, -1, 1), *want = fl_test_fdup(dtab, ntab);
        double *ref = malloc(ntab * sizeof *ref), *mag = malloc(ntab * sizeof *mag), *cnt = malloc(ntab * sizeof *cnt);
        for (size_t e = 0; e < ntab; e++) ref[e] = dtab[e], mag[e] = fabs(dtab[e]), cnt[e] = 1;
        for (int h = 0; h < q->NH; h++)
            for (int i = 0; i < q->Tq; i++)
                for (int j = 0; j < q->Tk; j++) {
                    const int b = rb[j - i + q->Tq - 1];
                    if (b < 0 || b >= q->nb) continue;
                    const double x = dbias[((size_t)h * q->Tq + i) * q->Tk + j];
                    ref[h * q->nb + b] += x, mag[h * q->nb + b] += fabs(x), cnt[h * q->nb + b] += 1;
                }
        relbias_spec(want, dbias, rb, q->NH, q->Tq, q->Tk, q->nb);
        FL_REQUIRE_OP(&be, be.relbias_backward(&be, dtab, dbias, rb, q->NH, q->Tq, q->Tk, q->nb));
        size_t off_bits = 0, off_bound = 0;
        for (size_t e = 0; e < ntab; e++) {
            off_bits += memcmp(&dtab[e], &want[e], sizeof(float)) != 0;
            off_bound += fabs(dtab[e] - ref[e]) > (cnt[e] + 1) * ldexp(1.0, -24) * mag[e];
        }
        FL_CHECKF(off_bits == 0, "%s relbias_backward case %d (NH %d, Tq %d, Tk %d, nb %d): %zu of %zu sums not the "
                  "contract's order's bits", be.name, c, q->NH, q->Tq, q->Tk, q->nb, off_bits, ntab);
        FL_CHECKF(off_bound == 0, "%s relbias_backward case %d: %zu sums beyond the fp32 summation bound of float64",
                  be.name, c, off_bound);
        free(rb), free(tab), free(bias), free(dbias), free(dtab), free(want), free(ref), free(mag), free(cnt);
    }
    /* bad shapes: named, nothing written */
    float t = 1.5f, d = 2.0f;
    int32_t z = 0;
    FL_CHECK(be.relbias_backward(&be, &t, &d, &z, 1, 1, 1, 0) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "relbias_backward") && strstr(fl_error_message(), "0 buckets"));
    FL_CHECK(be.relbias_backward(&be, &t, &d, &z, 1, 1, 1, FL_RELBIAS_MAX_BUCKETS + 1) == FL_ERR_INVALID);
    FL_CHECK(be.relbias_backward(&be, &t, &d, &z, 1, -1, 1, 1) == FL_ERR_INVALID && strstr(fl_error_message(), "Tq -1"));
    FL_CHECK(be.relbias_backward(&be, &t, &d, &z, 0, 4, 4, 32) == FL_OK && t == 1.5f); /* no heads: nothing */
    if (fl_test_backend_emulated(&be)) { /* its work area holds NH (Tq + Tk - 1) diagonal sums: beyond it, refused */
        fl_status s = be.relbias_backward(&be, &t, &d, &z, 300, 512, 512, 32);
        FL_CHECKF(s != FL_OK && strstr(fl_error_message(), "relbias_backward") && strstr(fl_error_message(), "work"),
                  "cuda-emu relbias_backward past its work area: %s", fl_error_message());
    } /* (the sticky error stays with this backend object, freed next) */
}

FL_TEST(ops_relbias) {
    fl_backend be;
    int emu = 0;
    FL_FOR_EACH_BACKEND(be, 2) {
        emu += fl_test_backend_emulated(&be);
        relbias_on(be);
    }
#ifdef FL_HAVE_CUDA_EMU
    FL_CHECK(emu == 1);
#else
    (void)emu;
#endif
}

/* Pipeline parallelism's schedule and stage split (fitllm/pp.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/pp.h"

static const char *k_names[FL_PP_SCHEDULE_COUNT] = {"gpipe", "1f1b"};

const char *fl_pp_schedule_name(fl_pp_schedule k) { return k >= 0 && k < FL_PP_SCHEDULE_COUNT ? k_names[k] : "?"; }

fl_status fl_pp_schedule_parse(const char *name, fl_pp_schedule *out) {
    for (int k = 0; k < FL_PP_SCHEDULE_COUNT; k++)
        if (name && !strcmp(name, k_names[k])) {
            *out = (fl_pp_schedule)k;
            return FL_OK;
        }
    return fl_errorf(FL_ERR_INVALID, "pipeline_schedule '%s': expected gpipe or 1f1b", name ? name : "(null)");
}

fl_status fl_pp_schedule_ops(fl_pp_schedule k, int stages, int stage, int micro, fl_pp_op *ops) {
    if (stages < 1 || stage < 0 || stage >= stages || micro < 1)
        return fl_errorf(FL_ERR_INVALID, "pipeline schedule: stage %d of %d with %d micro-batches (need 0 <= stage < "
                         "stages and at least one micro-batch)", stage, stages, micro);
    if (k != FL_PP_GPIPE && k != FL_PP_1F1B) return fl_errorf(FL_ERR_INVALID, "pipeline schedule: unknown kind %d", (int)k);
    int n = 0, f = 0, b = 0;
    /* GPipe: every forward first. 1F1B: the warm-up forwards fill the stages after this one, so that the last
     * stage's first backward (which needs them all) can start; then one forward, one backward */
    const int warm = k == FL_PP_GPIPE ? micro : (stages - stage - 1 < micro ? stages - stage - 1 : micro);
    while (f < warm) ops[n++] = (fl_pp_op){FL_PP_FWD, f++};
    while (f < micro) {
        ops[n++] = (fl_pp_op){FL_PP_FWD, f++};
        ops[n++] = (fl_pp_op){FL_PP_BWD, b++};
    }
    while (b < micro) ops[n++] = (fl_pp_op){FL_PP_BWD, b++};
    return FL_OK;
}

int fl_pp_in_flight(const fl_pp_op *ops, int n) {
    int now = 0, most = 0;
    for (int i = 0; i < n; i++) {
        now += ops[i].kind == FL_PP_FWD ? 1 : -1;
        if (now > most) most = now;
    }
    return most;
}

/* Whether layers [0, n) split into at most `stages` contiguous parts of cost <= cap, greedily (each part as long
 * as it can be); first[] gets the boundaries when it fits, padded so that every stage keeps one layer. */
static int fits(int n, const double *cost, int stages, double cap, int *first) {
    /* cost is never NULL here (fl_pp_split passes its reversed copy) */
    int s = 0, i = 0;
    first[0] = 0;
    while (i < n) {
        if (s == stages) return 0;
        double acc = 0;
        /* leave at least one layer for each later stage */
        const int last = n - (stages - s - 1);
        int j = i;
        while (j < last && (j == i || acc + cost[j] <= cap)) {
            acc += cost[j];
            if (acc > cap) return 0;
            j++;
        }
        first[++s] = j;
        i = j;
    }
    return s == stages;
}

static int pp_cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

fl_status fl_pp_split(int n_layers, const double *cost, int stages, int *first) {
    if (stages < 1 || stages > n_layers)
        return fl_errorf(FL_ERR_INVALID, "--pipeline_parallel %d: the model has %d layers (each stage needs at least "
                         "one)", stages, n_layers);
    for (int i = 0; i < n_layers; i++) {
        const double c = cost ? cost[i] : 1;
        if (!(c >= 0) || !isfinite(c))
            return fl_errorf(FL_ERR_INVALID, "pipeline split: layer %d's cost %g is not a finite non-negative number",
                             i, c);
    }
    /* the smallest cap that fits lies among the sums of contiguous runs: bisect on them (sorted). The greedy fill
     * runs from the last layer back (rev = the costs reversed), so later stages take as many layers as they can:
     * stage 0 keeps the most micro-batches' activations under 1F1B */
    const size_t nr = (size_t)n_layers * (size_t)(n_layers + 1) / 2;
    double *runs = malloc((nr + (size_t)n_layers) * sizeof *runs), *rev = runs + nr;
    int *rf = malloc(((size_t)stages + 1) * sizeof *rf);
    if (!runs || !rf) {
        free(runs), free(rf);
        return fl_errorf(FL_ERR_OOM, "pipeline split: out of host memory");
    }
    size_t k = 0;
    for (int i = 0; i < n_layers; i++) rev[i] = cost ? cost[n_layers - 1 - i] : 1;
    for (int i = 0; i < n_layers; i++) { /* summed in the order fits() sums a stage: the same bits */
        double acc = 0;
        for (int j = i; j < n_layers; j++) runs[k++] = acc += rev[j];
    }
    qsort(runs, nr, sizeof *runs, pp_cmp_double);
    size_t lo = 0, hi = nr - 1; /* runs[hi] = the total: one stage holding everything fits */
    while (lo < hi) {
        const size_t mid = lo + (hi - lo) / 2;
        if (fits(n_layers, rev, stages, runs[mid], rf)) hi = mid;
        else lo = mid + 1;
    }
    const int ok = fits(n_layers, rev, stages, runs[lo], rf);
    for (int s = 0; ok && s <= stages; s++) first[s] = n_layers - rf[stages - s];
    free(runs);
    free(rf);
    return ok ? FL_OK : fl_errorf(FL_ERR_INVALID, "pipeline split: no split of %d layers into %d stages", n_layers, stages);
}

/* Pipeline parallelism's schedule and stage split (fitllm/pp.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/pp.h"

static const char *k_names[FL_PP_INTERLEAVED + 1] = {"gpipe", "1f1b", "interleaved"};

const char *fl_pp_schedule_name(fl_pp_schedule k) { return k >= 0 && k <= FL_PP_INTERLEAVED ? k_names[k] : "?"; }

fl_status fl_pp_schedule_parse(const char *name, fl_pp_schedule *out) {
    for (int k = 0; k < FL_PP_SCHEDULE_COUNT; k++) /* what the trainer runs (interleaved: the library's and the plan's) */
        if (name && !strcmp(name, k_names[k])) {
            *out = (fl_pp_schedule)k;
            return FL_OK;
        }
    return fl_errorf(FL_ERR_INVALID, "pipeline_schedule '%s': expected gpipe or 1f1b", name ? name : "(null)");
}

fl_status fl_pp_schedule_parse_all(const char *name, fl_pp_schedule *out) {
    if (name && !strcmp(name, k_names[FL_PP_INTERLEAVED])) {
        *out = FL_PP_INTERLEAVED;
        return FL_OK;
    }
    if (fl_pp_schedule_parse(name, out) == FL_OK) return FL_OK;
    return fl_errorf(FL_ERR_INVALID, "pipeline_schedule '%s': expected gpipe, 1f1b or interleaved", name ? name : "(null)");
}

/* Megatron-LM's interleaved order: forward i on micro-batch (i / (S V)) S + i % S of chunk (i / S) % V, backward i on
 * the same micro-batch of chunk V - 1 - (i / S) % V (the chunks run in reverse); the warm-up fills the virtual stages
 * after this rank's first chunk (2 (S - s - 1) + (V - 1) S forwards) */
static int interleaved_ops(int S, int V, int s, int M, fl_pp_op *ops) {
    const int n = M * V;
    int warm = 2 * (S - s - 1) + (V - 1) * S, k = 0, f = 0, b = 0;
    if (warm > n) warm = n;
#define PP_IOP(kind, i, c) (fl_pp_op){kind, ((i) / (S * V)) * S + (i) % S, c}
    while (f < warm) ops[k++] = PP_IOP(FL_PP_FWD, f, (f / S) % V), f++;
    while (f < n) {
        ops[k++] = PP_IOP(FL_PP_FWD, f, (f / S) % V), f++;
        ops[k++] = PP_IOP(FL_PP_BWD, b, V - 1 - (b / S) % V), b++;
    }
    while (b < n) ops[k++] = PP_IOP(FL_PP_BWD, b, V - 1 - (b / S) % V), b++;
#undef PP_IOP
    return k;
}

fl_status fl_pp_schedule_ops_v(fl_pp_schedule k, int stages, int chunks, int stage, int micro, fl_pp_op *ops) {
    if (stages < 1 || stage < 0 || stage >= stages || micro < 1 || chunks < 1)
        return fl_errorf(FL_ERR_INVALID, "pipeline schedule: stage %d of %d with %d micro-batches and %d chunks (need 0 "
                         "<= stage < stages, at least one micro-batch and one chunk)", stage, stages, micro, chunks);
    if (k < 0 || k > FL_PP_INTERLEAVED) return fl_errorf(FL_ERR_INVALID, "pipeline schedule: unknown kind %d", (int)k);
    if (k != FL_PP_INTERLEAVED && chunks != 1)
        return fl_errorf(FL_ERR_INVALID, "pipeline schedule %s: one chunk per rank (%d given; interleaved runs several)",
                         k_names[k], chunks);
    if (k == FL_PP_INTERLEAVED) {
        if (micro % stages)
            return fl_errorf(FL_ERR_INVALID, "pipeline schedule interleaved: %d micro-batches (gradient accumulation "
                             "steps) is not a multiple of the %d stages", micro, stages);
        interleaved_ops(stages, chunks, stage, micro, ops);
        return FL_OK;
    }
    int n = 0, f = 0, b = 0;
    /* GPipe: every forward first. 1F1B: the warm-up forwards fill the stages after this one, so that the last
     * stage's first backward (which needs them all) can start; then one forward, one backward */
    const int warm = k == FL_PP_GPIPE ? micro : (stages - stage - 1 < micro ? stages - stage - 1 : micro);
    while (f < warm) ops[n++] = (fl_pp_op){FL_PP_FWD, f++, 0};
    while (f < micro) {
        ops[n++] = (fl_pp_op){FL_PP_FWD, f++, 0};
        ops[n++] = (fl_pp_op){FL_PP_BWD, b++, 0};
    }
    while (b < micro) ops[n++] = (fl_pp_op){FL_PP_BWD, b++, 0};
    return FL_OK;
}

fl_status fl_pp_schedule_ops(fl_pp_schedule k, int stages, int stage, int micro, fl_pp_op *ops) {
    return fl_pp_schedule_ops_v(k, stages, 1, stage, micro, ops);
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

fl_status fl_pp_simulate_v(fl_pp_schedule k, int stages, int chunks, int micro, const double *fwd, const double *bwd,
                           double *makespan, double *bubble) {
    if (stages < 1 || micro < 1 || chunks < 1)
        return fl_errorf(FL_ERR_INVALID, "pipeline simulation: %d stages, %d micro-batches, %d chunks (at least one "
                         "each)", stages, micro, chunks);
    const int S = stages, NV = stages * chunks;
    for (int v = 0; v < NV; v++)
        if (!(fwd[v] >= 0) || !(bwd[v] >= 0))
            return fl_errorf(FL_ERR_INVALID, "pipeline simulation: stage %d's times %g, %g", v, fwd[v], bwd[v]);
    const size_t n2 = (size_t)2 * micro * chunks, d2 = (size_t)2 * micro; /* a rank's operations; a virtual stage's */
    fl_pp_op *ops = malloc((size_t)S * n2 * sizeof *ops);
    double *done = malloc((size_t)NV * d2 * sizeof *done), *clock = calloc((size_t)S, sizeof *clock);
    int *next = calloc((size_t)S, sizeof *next);
    fl_status st = ops && done && clock && next ? FL_OK : fl_errorf(FL_ERR_OOM, "pipeline simulation: out of memory");
    for (int s = 0; st == FL_OK && s < S; s++) st = fl_pp_schedule_ops_v(k, S, chunks, s, micro, ops + (size_t)s * n2);
    /* done[v][2 j + kind]: when virtual stage v finished micro-batch j's forward (kind 0) or backward (1); -1 not yet */
    for (size_t i = 0; done && i < (size_t)NV * d2; i++) done[i] = -1;
    int progress = 1;
    long left = (long)S * (long)n2;
    while (st == FL_OK && progress && left > 0) {
        progress = 0;
        for (int s = 0; s < S; s++)
            while (next[s] < (int)n2) {
                const fl_pp_op o = ops[(size_t)s * n2 + next[s]];
                const int v = o.chunk * S + s;
                /* forward j needs virtual stage v - 1's forward j; backward j v + 1's backward j (the last virtual
                 * stage: its own forward j, which its order already ran) */
                const int from = o.kind == FL_PP_FWD ? v - 1 : v + 1;
                double ready = 0;
                if (from >= 0 && from < NV) {
                    ready = done[(size_t)from * d2 + 2 * o.mb + o.kind];
                    if (ready < 0) break;
                }
                const double t0 = clock[s] > ready ? clock[s] : ready;
                clock[s] = t0 + (o.kind == FL_PP_FWD ? fwd[v] : bwd[v]);
                done[(size_t)v * d2 + 2 * o.mb + o.kind] = clock[s];
                next[s]++, left--, progress = 1;
            }
    }
    if (st == FL_OK && left > 0) st = fl_errorf(FL_ERR_INTERNAL, "pipeline simulation: the schedule deadlocks");
    double span = 0, busy = 0;
    for (int s = 0; st == FL_OK && s < S; s++)
        if (clock[s] > span) span = clock[s];
    for (int v = 0; st == FL_OK && v < NV; v++) busy += micro * (fwd[v] + bwd[v]);
    if (st == FL_OK) {
        *makespan = span;
        *bubble = span > 0 ? 1 - busy / (S * span) : 0;
    }
    free(ops), free(done), free(clock), free(next);
    return st;
}

fl_status fl_pp_simulate(fl_pp_schedule k, int stages, int micro, const double *fwd, const double *bwd,
                         double *makespan, double *bubble) {
    return fl_pp_simulate_v(k, stages, 1, micro, fwd, bwd, makespan, bubble);
}

fl_status fl_pp_split_model(const fl_model_config *c, int T, int stages, int *first) {
    const int L = fl_pp_model_blocks(c);
    double *cost = malloc(((size_t)(L > 0 ? L : 0) + 1) * sizeof *cost);
    if (!cost) return fl_errorf(FL_ERR_OOM, "pipeline split: out of host memory");
    fl_pp_block_costs(c, T > 0 ? T : 1, cost);
    fl_status s = fl_pp_split(L, cost, stages, first);
    free(cost);
    return s;
}

fl_status fl_pp_estimate_step_v(const fl_model_config *c, int T, int stages, int chunks, int micro, fl_pp_schedule k,
                                fl_pp_estimate *e) {
    memset(e, 0, sizeof *e);
    const int NV = stages * (chunks > 0 ? chunks : 1);
    if (NV > 64) return fl_errorf(FL_ERR_UNSUPPORTED, "--pipeline_parallel %d: at most 64 (virtual) stages", NV);
    const int L = fl_pp_model_blocks(c);
    if (chunks > 1 && NV > L)
        return fl_errorf(FL_ERR_INVALID, "--pipeline_parallel %d x --pipeline_chunks %d: %d virtual stages for a model of "
                         "%d blocks (each needs at least one)", stages, chunks, NV, L);
    FL_TRY(fl_pp_split_model(c, T, NV, e->first));
    double *cost = malloc((size_t)L * sizeof *cost + 1);
    if (!cost) return fl_errorf(FL_ERR_OOM, "pipeline estimate: out of host memory");
    fl_pp_block_costs(c, T > 0 ? T : 1, cost);
    const double unit = cost[0] > 0 ? cost[0] : 1; /* a block's (the first is never the head's) */
    double total = 0;
    for (int s = 0; s < NV; s++) {
        double a = 0;
        for (int i = e->first[s]; i < e->first[s + 1]; i++) a += cost[i] / unit;
        e->fwd[s] = a / 3, e->bwd[s] = 2 * a / 3;
        total += a;
    }
    free(cost);
    e->one = micro * total;
    return fl_pp_simulate_v(k, stages, chunks, micro, e->fwd, e->bwd, &e->step, &e->bubble);
}

fl_status fl_pp_estimate_step(const fl_model_config *c, int T, int stages, int micro, fl_pp_schedule k,
                              fl_pp_estimate *e) {
    return fl_pp_estimate_step_v(c, T, stages, 1, micro, k, e);
}

/* the plan's notes of a run under interleaved: the virtual stages' blocks, each rank's chunks' times, the step */
static fl_status interleaved_text(const fl_model_config *c, int T, int S, int V, int micro, double block_ms, char *buf,
                                  size_t n) {
    fl_pp_estimate e;
    FL_TRY(fl_pp_estimate_step_v(c, T, S, V, micro, FL_PP_INTERLEAVED, &e));
    const double u = block_ms > 0 ? block_ms : 1;
    const char *unit = block_ms > 0 ? " ms" : " block times";
    size_t at = (size_t)snprintf(buf, n, "pipeline step (EXPERIMENTAL): interleaved, %d stages x %d chunks (virtual "
                                 "stages v = chunk x %d + stage), %d micro-batches; blocks per virtual stage (balanced "
                                 "by training FLOPs at T = %d, lm_head's on the last):", S, V, S, micro, T);
    for (int v = 0; v < S * V && at < n; v++) at += (size_t)snprintf(buf + at, n - at, " [%d, %d)", e.first[v], e.first[v + 1]);
    if (at < n)
        at += (size_t)snprintf(buf + at, n - at, "\npipeline: a micro-batch's forward + backward per virtual stage (%s):",
                               unit + 1);
    for (int v = 0; v < S * V && at < n; v++) at += (size_t)snprintf(buf + at, n - at, " %.3g", u * (e.fwd[v] + e.bwd[v]));
    if (at < n)
        snprintf(buf + at, n - at, "\npipeline: expected step %.4g%s (the schedule on those times, sends free; one "
                 "process %.4g), bubble %.1f%% (equal virtual stages: (S-1)/(M V+S-1) = %.1f%%)%s", u * e.step, unit,
                 u * e.one, 100 * e.bubble, 100.0 * (S - 1) / (micro * V + S - 1),
                 block_ms > 0 ? " at --block-ms" : "; --block-ms MS: in ms");
    at = strlen(buf);
    if (at < n)
        snprintf(buf + at, n - at, "\ninterleaved: a rank holds %d stage models (each its parameters, gradients, optimizer "
                 "state and arena) and a stash per further chunk-micro-batch in flight (Megatron's warm-up: up to 2 "
                 "(stages - stage - 1) + (chunks - 1) stages + 1 of them)", V);
    return FL_OK;
}

fl_status fl_pp_estimate_text(const fl_model_config *c, int T, int stages, int micro, fl_pp_schedule k,
                              double block_ms, char *buf, size_t n) {
    return fl_pp_estimate_text_v(c, T, stages, 1, micro, k, block_ms, buf, n);
}

fl_status fl_pp_estimate_text_v(const fl_model_config *c, int T, int stages, int chunks, int micro, fl_pp_schedule k,
                                double block_ms, char *buf, size_t n) {
    if (k == FL_PP_INTERLEAVED) return interleaved_text(c, T, stages, chunks, micro, block_ms, buf, n);
    fl_pp_estimate e;
    FL_TRY(fl_pp_estimate_step(c, T, stages, micro, k, &e));
    const double u = block_ms > 0 ? block_ms : 1;
    const char *unit = block_ms > 0 ? " ms" : " block times";
    /* three lines (the plan's notes are short) */
    size_t at = (size_t)snprintf(buf, n, "pipeline step (EXPERIMENTAL): %s, %d stages, %d micro-batches; blocks "
                                 "per stage (balanced by training FLOPs at T = %d, lm_head's on the last):",
                                 fl_pp_schedule_name(k), stages, micro, T);
    for (int s = 0; s < stages && at < n; s++)
        at += (size_t)snprintf(buf + at, n - at, " [%d, %d)", e.first[s], e.first[s + 1]);
    if (at < n)
        at += (size_t)snprintf(buf + at, n - at, "\npipeline: a micro-batch's forward + backward per stage (%s):",
                               unit + 1);
    for (int s = 0; s < stages && at < n; s++)
        at += (size_t)snprintf(buf + at, n - at, " %.3g", u * (e.fwd[s] + e.bwd[s]));
    if (at < n)
        snprintf(buf + at, n - at, "\npipeline: expected step %.4g%s (the schedule on those times, sends free; one "
                 "process %.4g), bubble %.1f%% (equal stages: %.1f%%)%s", u * e.step, unit, u * e.one, 100 * e.bubble,
                 100.0 * (stages - 1) / (micro + stages - 1), block_ms > 0 ? " at --block-ms" : "; --block-ms MS: in ms");
    /* what the interleaved schedule would give (two chunks per rank: virtual stages of half the blocks), where it
     * applies: 1F1B, micro-batches a multiple of the stages, two blocks per rank at least */
    fl_pp_estimate v;
    at = strlen(buf);
    if (k == FL_PP_1F1B && stages > 1 && micro % stages == 0 && 2 * stages <= fl_pp_model_blocks(c) && at < n &&
        fl_pp_estimate_step_v(c, T, stages, 2, micro, FL_PP_INTERLEAVED, &v) == FL_OK)
        snprintf(buf + at, n - at, "\npipeline: interleaved 1F1B with 2 chunks per rank (virtual stages; "
                 "--pipeline_schedule interleaved) would take %.4g%s, bubble %.1f%% (equal stages: %.1f%%)", u * v.step, unit, 100 * v.bubble,
                 100.0 * (stages - 1) / (2 * micro + stages - 1));
    return FL_OK;
}

/* "Which grid?" (issue 35 item 4; plan.h fl_plan_suggest_grid, `fitllm plan --suggest`): every DP x TP x PP grid of
 * the run's ranks, each planned by fl_plan_run under the run's own options (precision, batch, T, optimizer, the
 * strategy on the data axis), and the one to run chosen among those whose every rank fits.
 *
 * A grid's ranks differ: a pipeline's stages hold different blocks and micro-batches in flight, a tensor-parallel
 * rank's vocabulary rows differ by one when N does not divide V, ZeRO's chunks by one element (the first ranks of the
 * axis the larger). So every rank is rehearsed without a budget (what it needs: one fl_plan_run, its rank_peaks) and
 * the grid's need is the largest rank's; the chosen grid's largest rank is then
 * planned again under the budget, so its verdict is the planner's own, not a comparison made here.
 *
 * The choice, most data parallelism first (Megatron-LM's and DeepSpeed's rule of thumb: DP scales with one gradient
 * reduction per step and no bubble, TP pays two all-reduces of the activations per block and micro-batch and wants
 * the fast links inside a node, PP pays the bubble and suits the links across nodes):
 *   1. the fewest model-parallel ranks (TP x PP) that fit;
 *   2. then no tensor-parallel group wider than a node (devices per node);
 *   3. then the smallest pipeline bubble, (PP - 1) / (M + PP - 1) for M micro-batches per step (gradient accumulation);
 *   4. then the smallest largest-rank peak.
 * A grid the trainer refuses (its heads or MLP width not divisible by TP, more stages than layers, a global batch the
 * data axis does not divide, a combination not built) is a row with the refusal, never chosen; an error of data
 * parallelism alone (the run as given: an unknown model, a bad option) ends the suggestion with it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/plan.h"
#include "plan-impl.h"

/* the grid's need: one rehearsal of every rank without a budget (fl_plan_opts.rank_peaks); the largest rank's peak */
static fl_status plan_ranks(const fl_run_config *c, const fl_plan_machine *mc, fl_plan *p, fl_plan_grid_row *r) {
    const int W = c->devices * c->num_nodes;
    size_t *pk = calloc((size_t)W * 2, sizeof *pk);
    if (!pk) return fl_errorf(FL_ERR_OOM, "grid suggestion: out of host memory");
    fl_plan_opts o;
    fl_plan_opts_default(&o);
    o.devices = 0; /* c->devices: the machine's */
    o.cuda = mc->cuda, o.seq_len = mc->seq_len, o.generation = mc->generation, o.no_suggestions = 1;
    o.rank_peaks = pk, o.rank_host_peaks = pk + W;
    fl_status s = fl_plan_run(c, &o, p);
    if (s == FL_OK && p->verdict == FL_PLAN_UNAVAILABLE) s = fl_errorf(FL_ERR_UNSUPPORTED, "%s", p->unavailable);
    if (s == FL_OK && W == 1) pk[0] = p->peak_total, pk[1] = p->host_peak_total; /* one process: its own */
    for (int k = 0; s == FL_OK && k < W; k++) {
        if (k == 0 || pk[k] > r->peak) r->peak = pk[k], r->peak_rank = k;
        if (pk[W + k] > r->host_peak) r->host_peak = pk[W + k];
    }
    r->micro_batches = p->accum;
    free(pk);
    FL_TRY(s);
    if (r->dp > 1) { /* the data axis's strategy as the trainer resolves it (auto beside TP / PP: by the plan, above) */
        fl_strategy_choice sc;
        FL_TRY(fl_cfg_resolve_strategy(c, mc->cuda, &sc));
        snprintf(r->strategy, sizeof r->strategy, "%s", sc.strategy);
    }
    return FL_OK;
}

/* each rank's budget and whether the grid's need fits it: a GPU's device memory (the host tier, if the machine's RAM
 * is given, shared by its ranks); CPU ranks share the RAM, the host tier included */
static size_t rank_budget(const fl_plan_machine *mc) {
    const size_t ranks = (size_t)(mc->devices > 1 ? mc->devices : 1);
    return mc->cuda || !mc->host_memory ? mc->device_memory : mc->host_memory / ranks;
}
static int grid_fits(const fl_plan_grid_row *r, const fl_plan_machine *mc) {
    const double ranks = mc->devices > 1 ? mc->devices : 1;
    const double need = (double)r->peak + (mc->cuda ? 0.0 : (double)r->host_peak);
    if (need > (double)rank_budget(mc)) return 0;
    return !mc->cuda || !mc->host_memory || ranks * (double)r->host_peak <= (double)mc->host_memory;
}

/* Which memory a grid that does not fit runs out of, in words: a CPU rank's is the host's RAM (its device and host
 * tiers together), a GPU's its device memory or, with --host-memory, the host tier its ranks share. "host" or
 * "device" in *tier. */
static void oom_why(const fl_plan_grid_row *r, const fl_plan_machine *mc, char *b, size_t n, const char **tier) {
    char x[32], y[32], z[32], w[32];
    const int ranks = mc->devices > 1 ? mc->devices : 1;
    if (!mc->cuda) {
        *tier = "host";
        snprintf(b, n, "out of host memory: %s%s%s%s per rank > %s (%s)", fl_fmt_bytes(r->peak, x, sizeof x),
                 r->host_peak ? " + host tier " : "", r->host_peak ? fl_fmt_bytes(r->host_peak, y, sizeof y) : "",
                 r->host_peak ? " (offload: the same RAM)" : "", fl_fmt_bytes(rank_budget(mc), z, sizeof z),
                 mc->host_memory ? "the host's RAM shared by the ranks" : "--device-memory: a CPU rank's RAM");
    } else if (r->peak > rank_budget(mc)) {
        *tier = "device";
        snprintf(b, n, "out of device memory: %s > %s per GPU", fl_fmt_bytes(r->peak, x, sizeof x),
                 fl_fmt_bytes(rank_budget(mc), z, sizeof z));
    } else {
        *tier = "host";
        snprintf(b, n, "out of host memory: host tier %s x %d ranks > --host-memory %s",
                 fl_fmt_bytes(r->host_peak, y, sizeof y), ranks, fl_fmt_bytes(mc->host_memory, w, sizeof w));
    }
}

/* 1 when a is the better grid (the order in the file's comment) */
static int better(const fl_plan_grid_row *a, const fl_plan_grid_row *b, int per_node) {
    if (a->tp * a->pp != b->tp * b->pp) return a->tp * a->pp < b->tp * b->pp;
    const int wa = a->tp > per_node, wb = b->tp > per_node;
    if (wa != wb) return wa < wb;
    if (a->bubble != b->bubble) return a->bubble < b->bubble;
    return a->peak < b->peak;
}

/* the trainer's own words: past the planner's "refused at set-up (...): " and a peer's "rank k aborted (code c): " */
static const char *refusal(const char *m) {
    const char *a = strstr(m, " aborted (code "), *b = strstr(m, "refused at set-up (");
    const char *from = a ? a : b;
    const char *c = from ? strstr(from, "): ") : NULL;
    return c ? c + 3 : m;
}

fl_status fl_plan_suggest_grid(const fl_run_config *base, const fl_plan_machine *mc, fl_plan_grid *out) {
    memset(out, 0, sizeof *out);
    out->best = -1;
    if (!rank_budget(mc))
        return fl_errorf(FL_ERR_INVALID, "grid suggestion: each rank's memory is needed (--device-memory SIZE, or a CPU "
                         "machine's --host-memory SIZE shared by its ranks)");
    fl_run_config *c = malloc(sizeof *c);
    fl_plan *p = malloc(sizeof *p);
    fl_status s = c && p ? FL_OK : fl_errorf(FL_ERR_OOM, "grid suggestion: out of host memory");
    const int W = (mc->devices > 1 ? mc->devices : 1) * (base->num_nodes > 1 ? base->num_nodes : 1);
    const int per_node = mc->devices > 1 ? mc->devices : 1;
    for (int tp = 1; s == FL_OK && tp <= W; tp++)
        for (int pp = 1; s == FL_OK && pp <= W / tp; pp++) {
            if (W % (tp * pp) || out->n == FL_PLAN_MAX_GRIDS) continue;
            fl_plan_grid_row *r = &out->rows[out->n++];
            r->dp = W / (tp * pp), r->tp = tp, r->pp = pp;
            *c = *base;
            c->devices = per_node;
            c->tensor_parallel = tp;
            c->pipeline_parallel = pp;
            /* --strategy auto on a model-parallel grid: its data axis's strategy by the per-rank plan (plan_auto.c) */
            char as[32], why[1024];
            fl_status e = fl_plan_auto_strategy(c, mc->cuda, rank_budget(mc), as, sizeof as, why, sizeof why);
            if (e == FL_OK && as[0]) snprintf(c->strategy, sizeof c->strategy, "%s", as);
            if (e == FL_OK) e = plan_ranks(c, mc, p, r);
            /* data parallelism alone (the first grid) is the run as given: its error is the answer's. A model-parallel
             * grid's is a refusal (a rank's refusal reaches the others as a failed collective, whatever its code) */
            if (e != FL_OK && (tp > 1 || pp > 1)) {
                r->fits = -1;
                snprintf(r->why, sizeof r->why, "%s", refusal(fl_error_message()));
                continue;
            }
            s = e;
            if (s != FL_OK) break;
            r->bubble = pp > 1 ? (double)(pp - 1) / (r->micro_batches + pp - 1) : 0.0;
            r->fits = grid_fits(r, mc);
            if (r->fits && (out->best < 0 || better(r, &out->rows[out->best], per_node))) out->best = out->n - 1;
        }
    if (s == FL_OK && out->best >= 0) { /* the chosen grid's largest rank under the budget: the planner's verdict */
        const fl_plan_grid_row *r = &out->rows[out->best];
        *c = *base;
        c->devices = per_node, c->tensor_parallel = r->tp, c->pipeline_parallel = r->pp;
        char as[32], why[1024]; /* auto's choice on a model-parallel grid, as above */
        s = fl_plan_auto_strategy(c, mc->cuda, rank_budget(mc), as, sizeof as, why, sizeof why);
        if (as[0]) snprintf(c->strategy, sizeof c->strategy, "%s", as);
        fl_plan_opts o;
        fl_plan_opts_default(&o);
        o.cuda = mc->cuda, o.seq_len = mc->seq_len, o.generation = mc->generation, o.no_suggestions = 1, o.rank = r->peak_rank;
        o.device_memory = rank_budget(mc) - (mc->cuda ? 0 : (r->host_peak < rank_budget(mc) ? r->host_peak : 0));
        if (s == FL_OK) s = fl_plan_run(c, &o, p);
        out->verdict = s == FL_OK ? p->verdict : FL_PLAN_UNAVAILABLE;
        if (s == FL_OK && p->verdict != FL_PLAN_FITS)
            s = fl_errorf(FL_ERR_INTERNAL, "grid suggestion: DP %d x TP %d x PP %d needs %zu bytes on rank %d, within "
                          "the budget, but its budgeted plan says %s", r->dp, r->tp, r->pp, r->peak, r->peak_rank,
                          fl_plan_verdict_name(p->verdict));
    }
    free(c);
    free(p);
    return fl_error_prefix(s, "grid suggestion");
}

void fl_plan_json_str(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') fprintf(f, "\\%c", ch);
        else if (ch == '\n') fputs("\\n", f);
        else if (ch < 0x20) fprintf(f, "\\u%04x", ch);
        else fputc(ch, f);
    }
    fputc('"', f);
}

/* the options that run a grid (devices x num_nodes is the run's) */
static void grid_options(const fl_plan_grid_row *r, char *buf, size_t cap) {
    int n = snprintf(buf, cap, "%s", "");
    if (r->tp > 1) n += snprintf(buf + n, cap - (size_t)n, "--tensor_parallel %d", r->tp);
    if (r->pp > 1) snprintf(buf + n, cap - (size_t)n, "%s--pipeline_parallel %d", n ? " " : "", r->pp);
    if (!buf[0]) snprintf(buf, cap, "(data parallel only)");
}

void fl_plan_grid_print(const fl_plan_grid *g, const fl_plan_machine *mc, FILE *out) {
    char a[32], b[32], opt[96];
    const int W = g->n ? g->rows[0].dp * g->rows[0].tp * g->rows[0].pp : 0;
    fprintf(out, "grids of %d rank(s), %s %s per rank%s:\n", W, mc->cuda ? "GPU memory" : "memory",
            fl_fmt_bytes(rank_budget(mc), a, sizeof a), mc->cuda || !mc->host_memory ? "" : " (the host's RAM shared)");
    fprintf(out, "  %4s %4s %4s  %-17s %12s %6s %7s  %s\n", "DP", "TP", "PP", "DP axis", "largest rank", "rank", "bubble",
            "verdict");
    for (int i = 0; i < g->n; i++) {
        const fl_plan_grid_row *r = &g->rows[i];
        if (r->fits < 0) {
            fprintf(out, "  %4d %4d %4d  %-17s %12s %6s %7s  not with this run: %s\n", r->dp, r->tp, r->pp, "-", "-", "-",
                    "-", r->why);
            continue;
        }
        snprintf(b, sizeof b, "%.1f%%", 100.0 * r->bubble);
        char why[200] = "fits", h[32];
        const char *tier;
        if (!r->fits) oom_why(r, mc, why, sizeof why, &tier);
        else if (!mc->cuda && r->host_peak) /* a CPU rank's host tier is the same RAM: its need is both */
            snprintf(why, sizeof why, "fits with its host tier %s (the same RAM)", fl_fmt_bytes(r->host_peak, h, sizeof h));
        fprintf(out, "  %4d %4d %4d  %-17s %12s %6d %7s  %s%s\n", r->dp, r->tp, r->pp, r->strategy[0] ? r->strategy : "-",
                fl_fmt_bytes(r->peak, a, sizeof a), r->peak_rank, r->pp > 1 ? b : "-", why,
                i == g->best ? "  <- suggested" : "");
    }
    if (g->best < 0) {
        fprintf(out, "suggested grid: none fits (each rank's memory is too small for every grid this run allows)\n");
        return;
    }
    const fl_plan_grid_row *r = &g->rows[g->best];
    grid_options(r, opt, sizeof opt);
    fprintf(out, "suggested grid: DP %d x TP %d x PP %d: %s (largest rank %d needs %s%s%s)\n", r->dp, r->tp, r->pp, opt,
            r->peak_rank, fl_fmt_bytes(r->peak, a, sizeof a), !mc->cuda && r->host_peak ? " + its host tier " : "",
            !mc->cuda && r->host_peak ? fl_fmt_bytes(r->host_peak, b, sizeof b) : "");
}

/* `plan --suggest --json`: the machine, every grid's row and the suggestion (schema: docs/ARCHITECTURE.md "Which grid") */
void fl_plan_grid_write_json(const fl_plan_grid *g, const fl_plan_machine *mc, FILE *out) {
    fprintf(out, "{\n  \"version\": %d,\n  \"kind\": \"grid_suggestion\",\n  \"rank_budget\": %zu,\n  \"cuda\": %s,\n"
            "  \"grids\": [", FL_PLAN_JSON_VERSION, rank_budget(mc), mc->cuda ? "true" : "false");
    for (int i = 0; i < g->n; i++) {
        const fl_plan_grid_row *r = &g->rows[i];
        fprintf(out, "%s\n    {\"dp\": %d, \"tp\": %d, \"pp\": %d, \"verdict\": \"%s\"", i ? "," : "", r->dp, r->tp,
                r->pp, r->fits < 0 ? "refused" : r->fits ? "fits" : "oom");
        if (r->fits < 0) {
            fputs(", \"why\": ", out);
            fl_plan_json_str(out, r->why);
        } else {
            fprintf(out, ", \"peak\": %zu, \"peak_rank\": %d, \"host_peak\": %zu, \"micro_batches\": %d, "
                    "\"bubble\": %.6f, \"strategy\": ", r->peak, r->peak_rank, r->host_peak, r->micro_batches, r->bubble);
            fl_plan_json_str(out, r->strategy);
            if (!r->fits) { /* the memory that runs out: "host" (a CPU rank's RAM, a GPU's host tier) or "device" */
                char why[200];
                const char *tier;
                oom_why(r, mc, why, sizeof why, &tier);
                fprintf(out, ", \"oom_tier\": \"%s\"", tier);
            }
        }
        fputc('}', out);
    }
    fprintf(out, "\n  ],\n  \"suggested\": ");
    if (g->best < 0) fputs("null", out);
    else fprintf(out, "{\"dp\": %d, \"tp\": %d, \"pp\": %d}", g->rows[g->best].dp, g->rows[g->best].tp,
                 g->rows[g->best].pp);
    fputs("\n}\n", out);
}

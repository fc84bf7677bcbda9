/* --strategy auto on a model-parallel grid (plan.h fl_plan_auto_strategy): the data axis's strategy by the per-rank
 * plan. LitGPT's auto (FULL_SHARD) is a data-parallel rule; beside TP / PP the cheapest layout that fits is wanted:
 * DDP (one all-reduce, nothing gathered), then ZeRO-1 (the optimizer state sharded), ZeRO-2 (the gradients too),
 * FULL_SHARD (the parameters too: all-gathers every step), then the CPU offloads (host traffic every step). Each
 * candidate's every rank is rehearsed without a budget (fl_plan_run's rank_peaks, as the grid suggestion does), so
 * the choice is the plan's exact numbers; a candidate the trainer refuses on the grid is skipped. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/plan.h"

static const char *const k_cand[] = {"ddp", "deepspeed_stage_1", "deepspeed_stage_2", "fsdp",
                                     "deepspeed_stage_2_offload", "deepspeed_stage_3_offload"};
enum { N_CAND = sizeof k_cand / sizeof k_cand[0] };

/* candidate k's largest rank: its peak (CPU ranks: with its host tier) and rank; FL_ERR_* when the rehearsal refuses it (its message set) */
static fl_status cand_peak(const fl_run_config *c, int k, int cuda, fl_plan *p, size_t *pk, size_t *peak, int *at) {
    const int W = c->devices * c->num_nodes;
    fl_run_config *x = malloc(sizeof *x);
    if (!x) return fl_errorf(FL_ERR_OOM, "--strategy auto: out of host memory");
    *x = *c;
    snprintf(x->strategy, sizeof x->strategy, "%s", k_cand[k]);
    if (strcmp(k_cand[k], "fsdp")) x->sharding_strategy[0] = 0;
    fl_plan_opts o;
    fl_plan_opts_default(&o);
    o.cuda = cuda, o.generation = -1, o.no_suggestions = 1; /* the evaluation's sample as the CLI run makes it */
    o.rank_peaks = pk, o.rank_host_peaks = pk + W;
    fl_status s = fl_plan_run(x, &o, p);
    free(x);
    if (s == FL_OK && p->verdict == FL_PLAN_UNAVAILABLE) s = fl_errorf(FL_ERR_UNSUPPORTED, "%s", p->unavailable);
    for (int r = 0; s == FL_OK && r < W; r++) { /* CPU ranks: the host tier is the same RAM (an offload frees none) */
        const size_t need = pk[r] + (cuda ? 0 : pk[W + r]);
        if (r == 0 || need > *peak) *peak = need, *at = r;
    }
    return s;
}

fl_status fl_plan_auto_strategy(const fl_run_config *c, int cuda, size_t device_memory, char *strategy, size_t n,
                                char *why, size_t why_n) {
    strategy[0] = why[0] = 0;
    const int dp = fl_cfg_dp_ranks(c), W = c->devices * c->num_nodes;
    if ((c->strategy[0] && strcmp(c->strategy, "auto")) || dp < 2 || (c->tensor_parallel <= 1 && c->pipeline_parallel <= 1) ||
        c->command == FL_CMD_FINETUNE_LORA)
        return FL_OK;
    char grid[64];
    snprintf(grid, sizeof grid, "DP %d x TP %d x PP %d", dp, c->tensor_parallel > 1 ? c->tensor_parallel : 1,
             c->pipeline_parallel > 1 ? c->pipeline_parallel : 1);
    const size_t budget = device_memory ? device_memory : c->max_memory;
    if (!budget) {
        snprintf(strategy, n, "ddp");
        snprintf(why, why_n, "auto: DDP on the data axis of %s (no memory budget given: with --max_memory, the first of "
                 "DDP, ZeRO-1, ZeRO-2, FULL_SHARD and the offloads whose every rank fits)", grid);
        return FL_OK;
    }
    size_t *pk = calloc((size_t)W * 2, sizeof *pk);
    fl_plan *p = malloc(sizeof *p);
    fl_status s = pk && p ? FL_OK : fl_errorf(FL_ERR_OOM, "--strategy auto: out of host memory");
    char bb[32], pb[32], said[768] = "";
    size_t best_peak = 0, used = 0;
    int best = -1, chosen = -1;
    for (int k = 0; s == FL_OK && k < N_CAND && chosen < 0; k++) {
        size_t peak = 0;
        int at = 0;
        fl_status e = cand_peak(c, k, cuda, p, pk, &peak, &at);
        if (e == FL_ERR_OOM) s = e;
        if (e != FL_OK) { /* refused on this grid: the next */
            used += (size_t)snprintf(said + used, used < sizeof said ? sizeof said - used : 0, "%s refused here; ",
                                     k_cand[k]);
            continue;
        }
        if (peak <= budget) chosen = k;
        if (best < 0 || peak < best_peak) best = k, best_peak = peak;
        if (chosen < 0)
            used += (size_t)snprintf(said + used, used < sizeof said ? sizeof said - used : 0, "%s needs %s on rank %d; ",
                                     k_cand[k], fl_fmt_bytes(peak, pb, sizeof pb), at);
        else
            snprintf(pb, sizeof pb, "%s", fl_fmt_bytes(peak, bb, sizeof bb));
    }
    free(pk);
    free(p);
    FL_TRY(fl_error_prefix(s, "--strategy auto"));
    fl_fmt_bytes(budget, bb, sizeof bb);
    if (used >= sizeof said) used = sizeof said - 1;
    if (used >= 2) said[used - 2] = 0; /* the last "; " */
    if (chosen >= 0) {
        snprintf(strategy, n, "%s", k_cand[chosen]);
        snprintf(why, why_n, "auto: %s on the data axis of %s: every rank's plan fits the budget %s (the largest %s)%s%s",
                 k_cand[chosen], grid, bb, pb, said[0] ? "; before it: " : "", said);
    } else if (best >= 0) {
        snprintf(strategy, n, "%s", k_cand[best]);
        snprintf(why, why_n, "auto: %s on the data axis of %s: no strategy fits the budget %s, %s needs the least; the candidates: %s",
                 k_cand[best], grid, bb, k_cand[best], said);
    } else {
        snprintf(strategy, n, "ddp");
        snprintf(why, why_n, "auto: DDP on the data axis of %s: every candidate was refused; the candidates: %s", grid, said);
    }
    return FL_OK;
}

fl_status fl_plan_auto_resolve(const fl_run_config **c, fl_run_config *cd, int cuda, size_t device_memory, char *head,
                               size_t head_n, char *rest, size_t rest_n) {
    char s[32], why[1024];
    head[0] = rest[0] = 0;
    FL_TRY(fl_plan_auto_strategy(*c, cuda, device_memory, s, sizeof s, why, sizeof why));
    if (!s[0]) return FL_OK;
    if (*c != cd) *cd = **c;
    snprintf(cd->strategy, sizeof cd->strategy, "%s", s);
    *c = cd;
    const char *more = strstr(why, "; ");
    snprintf(head, head_n, "%.*s", more ? (int)(more - why) : (int)strlen(why), why);
    if (more) snprintf(rest, rest_n, "%s", more + 2);
    return FL_OK;
}

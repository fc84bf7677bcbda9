/* The grid suggestion (fl_plan_suggest_grid, `fitllm plan --suggest`) against the planner's own per-rank plans:
 * each grid's need is the largest of its ranks' planned peaks (every rank planned on its own with --rank), whether a
 * grid fits is the budgeted plan's verdict of that rank (to the byte: a budget of exactly the peak fits, one byte less
 * does not), the suggestion follows the documented order, and refused grids carry the trainer's refusal.
 * (The per-rank plans themselves equal the measured runs: pp_train_threads_plan_equals_measured, the tp tests.) */
#include <string.h>

#include "fitllm/plan.h"
#include "test.h"

/* micro (LLaMA: 5 layers, 8 query and 4 key/value heads, MLP 172) on 8 CPU ranks, DDP on the data axis, 16 sequences of
 * 32 tokens per step one at a time: TP 8 (4 key/value heads) and PP 8 (5 layers) are refused */
static void grid_cfg(fl_run_config *c) {
    fl_cfg_defaults(c, FL_CMD_FINETUNE_FULL);
    snprintf(c->checkpoint_dir, sizeof c->checkpoint_dir, "micro");
    snprintf(c->strategy, sizeof c->strategy, "ddp");
    c->data.kind = FL_DATA_SYNTHETIC;
    c->devices = 8;
    c->train.global_batch_size = 16;
    c->train.micro_batch_size = 1;
    c->train.max_seq_length = 33;
    c->eval.max_new_tokens = 0;
}

static const fl_plan_grid_row *find(const fl_plan_grid *g, int tp, int pp) {
    for (int i = 0; i < g->n; i++)
        if (g->rows[i].tp == tp && g->rows[i].pp == pp) return &g->rows[i];
    return NULL;
}

/* rank k of the grid planned on its own, under `budget` (0: none) */
static fl_status plan_rank(const fl_run_config *base, int tp, int pp, int k, size_t budget, fl_plan *p) {
    fl_run_config c = *base;
    c.tensor_parallel = tp, c.pipeline_parallel = pp;
    fl_plan_opts o;
    fl_plan_opts_default(&o);
    o.rank = k, o.generation = 0, o.no_suggestions = 1, o.device_memory = budget;
    return fl_plan_run(&c, &o, p);
}

FL_TEST(plan_grid_suggestion_equals_per_rank_plans) {
    if (!fl_test_asan_budget()) return; /* make test time (quick tier); the grid planner under ASan: plan_grid_*, plan_auto_strategy_* */
    fl_run_config c;
    grid_cfg(&c);
    fl_plan_machine mc = {(size_t)1 << 40, 0, 0, 8, 0, 0};
    fl_plan_grid *g = malloc(sizeof *g);
    fl_plan *p = malloc(sizeof *p);
    FL_REQUIRE(g && p);
    FL_REQUIRE_OK(fl_plan_suggest_grid(&c, &mc, g));
    FL_CHECKF(g->n == 10, "%d grids of 8 ranks (the (tp, pp) pairs whose product divides 8: 10)", g->n);
    int planned = 0;
    for (int i = 0; i < g->n; i++) {
        const fl_plan_grid_row *r = &g->rows[i];
        FL_CHECK(r->dp * r->tp * r->pp == 8);
        if (r->fits < 0) continue;
        size_t want = 0;
        int at = -1;
        for (int k = 0; k < 8; k++) { /* every rank's own plan: the row's need is the largest */
            FL_REQUIRE_OK(plan_rank(&c, r->tp, r->pp, k, 0, p));
            if (at < 0 || p->peak_total > want) want = p->peak_total, at = k;
        }
        FL_CHECKF(r->peak == want && r->peak_rank == at, "DP %d x TP %d x PP %d: need %zu on rank %d, the per-rank plans "
                  "%zu on rank %d", r->dp, r->tp, r->pp, r->peak, r->peak_rank, want, at);
        /* the budget to the byte: exactly the need fits, one byte less is out of memory (the planner's verdicts) */
        FL_REQUIRE_OK(plan_rank(&c, r->tp, r->pp, r->peak_rank, r->peak, p));
        FL_CHECKF(p->verdict == FL_PLAN_FITS, "TP %d x PP %d at its own peak: %s", r->tp, r->pp, fl_plan_verdict_name(p->verdict));
        FL_REQUIRE_OK(plan_rank(&c, r->tp, r->pp, r->peak_rank, r->peak - 1, p));
        FL_CHECKF(p->verdict == FL_PLAN_OOM, "TP %d x PP %d one byte short: %s", r->tp, r->pp, fl_plan_verdict_name(p->verdict));
        /* PP's bubble: M = 16 / DP / 1 micro-batches */
        const int M = 16 / r->dp;
        FL_CHECKF(fabs(r->bubble - (r->pp > 1 ? (double)(r->pp - 1) / (M + r->pp - 1) : 0.0)) < 1e-15, "bubble %g", r->bubble);
        FL_CHECK(r->micro_batches == M);
        planned++;
    }
    FL_CHECKF(planned == 8, "%d grids planned (DP 8, PP 2, PP 4, TP 2, TP 4, TP 2 x PP 2, TP 2 x PP 4, TP 4 x PP 2)",
              planned);
    /* the refusals, in the trainer's words */
    const fl_plan_grid_row *t8 = find(g, 8, 1), *p8 = find(g, 1, 8), *tp2 = find(g, 2, 2), *t4p2 = find(g, 4, 2);
    FL_REQUIRE(t8 && p8 && tp2 && t4p2);
    FL_CHECKF(t8->fits < 0 && strstr(t8->why, "num_key_value_heads"), "TP 8: %s", t8->why);
    FL_CHECKF(p8->fits < 0 && strstr(p8->why, "5 layers"), "PP 8: %s", p8->why);
    size_t least = (size_t)-1; /* the smallest need of any grid */
    for (int i = 0; i < g->n; i++)
        if (g->rows[i].fits >= 0 && g->rows[i].peak < least) least = g->rows[i].peak;
    /* no limit that matters: data parallelism alone */
    FL_CHECK(g->best >= 0 && g->rows[g->best].tp == 1 && g->rows[g->best].pp == 1 && g->verdict == FL_PLAN_FITS);
    const fl_plan_grid_row *dp = find(g, 1, 1), *t2 = find(g, 2, 1), *t4 = find(g, 4, 1), *pp2 = find(g, 1, 2);
    FL_REQUIRE(dp && t2 && t4 && pp2 && t2->peak < pp2->peak && pp2->peak < dp->peak && t4->peak < t2->peak);
    /* the 3D grids: TP 2 x PP 2 below TP 2 alone, TP 4 x PP 2 the least of all (below TP 4) */
    FL_CHECKF(tp2->fits >= 0 && tp2->peak < t2->peak && t4p2->peak < t4->peak && t4p2->peak == least,
              "TP 2 x PP 2 %zu (TP 2 %zu), TP 4 x PP 2 %zu (TP 4 %zu), the least %zu", tp2->peak, t2->peak, t4p2->peak,
              t4->peak, least);
    FL_CHECK(!strcmp(dp->strategy, "ddp"));
    /* budgets between the needs: the fewest model-parallel ranks that fit, TP before PP at the same count */
    const size_t needs[4] = {dp->peak, pp2->peak, t2->peak, t4->peak};
    free(g), free(p);
    const int want_tp[4] = {1, 2, 2, 4}, want_pp[4] = {1, 1, 1, 1};
    fl_plan_grid *h = malloc(sizeof *h);
    FL_REQUIRE(h);
    for (int b = 0; b < 4; b++) {
        mc.device_memory = needs[b];
        FL_REQUIRE_OK(fl_plan_suggest_grid(&c, &mc, h));
        FL_CHECKF(h->best >= 0 && h->rows[h->best].tp == want_tp[b] && h->rows[h->best].pp == want_pp[b],
                  "budget %zu: suggested TP %d x PP %d, want TP %d", needs[b], h->best >= 0 ? h->rows[h->best].tp : -1,
                  h->best >= 0 ? h->rows[h->best].pp : -1, want_tp[b]);
    }
    mc.device_memory = needs[3] - 1; /* below every grid of 4 model-parallel ranks: the 8 of TP 4 x PP 2 */
    FL_REQUIRE_OK(fl_plan_suggest_grid(&c, &mc, h));
    FL_CHECKF(h->best >= 0 && h->rows[h->best].tp == 4 && h->rows[h->best].pp == 2, "below TP 4's need: suggested TP %d "
              "x PP %d", h->best >= 0 ? h->rows[h->best].tp : -1, h->best >= 0 ? h->rows[h->best].pp : -1);
    mc.device_memory = least - 1; /* below every grid's need */
    FL_REQUIRE_OK(fl_plan_suggest_grid(&c, &mc, h));
    FL_CHECK(h->best == -1);
    /* 8 nodes of one rank: a TP group would cross nodes, so at 2 model-parallel ranks PP 2 comes first where it fits,
     * and TP 2 where only it does */
    c.num_nodes = 8, c.devices = 1, mc.devices = 1;
    mc.device_memory = needs[1];
    FL_REQUIRE_OK(fl_plan_suggest_grid(&c, &mc, h));
    FL_CHECKF(h->best >= 0 && h->rows[h->best].tp == 1 && h->rows[h->best].pp == 2, "1 rank per node, PP 2's need: "
              "suggested TP %d x PP %d", h->best >= 0 ? h->rows[h->best].tp : -1, h->best >= 0 ? h->rows[h->best].pp : -1);
    mc.device_memory = needs[1] - 1;
    FL_REQUIRE_OK(fl_plan_suggest_grid(&c, &mc, h));
    FL_CHECK(h->best >= 0 && h->rows[h->best].tp == 2 && h->rows[h->best].pp == 1);
    free(h);
}

FL_TEST(plan_grid_suggestion_errors) {
    fl_run_config c;
    grid_cfg(&c);
    fl_plan_machine mc = {0, 0, 0, 8, 0, 0};
    fl_plan_grid *g = malloc(sizeof *g);
    FL_REQUIRE(g);
    FL_CHECK(fl_plan_suggest_grid(&c, &mc, g) == FL_ERR_INVALID); /* no memory given */
    FL_CHECK(strstr(fl_error_message(), "--device-memory"));
    mc.device_memory = (size_t)1 << 30;
    snprintf(c.checkpoint_dir, sizeof c.checkpoint_dir, "no-such-preset-xyz");
    FL_CHECK(fl_plan_suggest_grid(&c, &mc, g) != FL_OK); /* the run as given fails: no rows of refusals */
    FL_CHECK(strstr(fl_error_message(), "no-such-preset-xyz"));
    free(g);
}

/* The grids are planned with the run's evaluation sample (its generation phase, mc.generation -1: as the CLI run makes
 * it): a grid whose rank peaks while generating is not suggested on the training phases alone (review round 6:
 * `plan gpt2 --devices 4 --suggest` chose TP 4 at 759.81 MiB where the plain plan of that grid needs 768.49 MiB in
 * eval_generate). Each fitting row's need equals its ranks' own plans with the generation, and the chosen grid's
 * largest rank fits under the budget by the planner's own verdict. */
FL_TEST(plan_grid_suggestion_plans_the_generation) {
    fl_run_config c;
    grid_cfg(&c);
    c.devices = 4;
    c.eval.max_new_tokens = 64; /* the sample: T + 64 positions of KV cache */
    fl_plan_machine mc = {(size_t)1 << 40, 0, 0, 4, 0, 0, -1};
    fl_plan_grid *g = malloc(sizeof *g);
    fl_plan *p = malloc(sizeof *p);
    FL_REQUIRE(g && p);
    FL_REQUIRE_OK(fl_plan_suggest_grid(&c, &mc, g));
    int gen_peaks = 0, rows = 0;
    for (int i = 0; i < g->n; i++) {
        const fl_plan_grid_row *r = &g->rows[i];
        if (r->fits < 0) continue;
        size_t want = 0, train = 0;
        for (int k = 0; k < 4; k++) {
            fl_run_config rc = c;
            rc.tensor_parallel = r->tp, rc.pipeline_parallel = r->pp;
            fl_plan_opts o;
            fl_plan_opts_default(&o);
            o.rank = k, o.generation = -1, o.no_suggestions = 1;
            FL_REQUIRE_OK(fl_plan_run(&rc, &o, p));
            if (p->peak_total > want) want = p->peak_total;
            o.generation = 0;
            FL_REQUIRE_OK(fl_plan_run(&rc, &o, p));
            if (p->peak_total > train) train = p->peak_total;
        }
        FL_CHECKF(r->peak == want, "DP %d x TP %d x PP %d: need %zu, its ranks' plans with the sample %zu (without %zu)",
                  r->dp, r->tp, r->pp, r->peak, want, train);
        gen_peaks += want > train, rows++;
    }
    /* the check can tell: some grid's rank peaks while generating (else the test would pass without the sample) */
    FL_CHECKF(gen_peaks > 0, "no grid of %d peaks in its generation phase", rows);
    free(g);
    free(p);
}

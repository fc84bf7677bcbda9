/* Pipeline parallelism of a real model (fitllm/pp.h: the stages of src/model/stage.c, the step of
 * src/train/pp_step.c) as threads: 2..L stages of the micro LLaMA (5 layers), GPipe and 1F1B, against one
 * process running fl_step_run on the same micro-batches. Untied and unclipped, every block and the head run the
 * single process's code on the same inputs and each stage accumulates its micro-batches in the same order: the
 * losses of every step and the weights after the run are the same bits. Tied (micro's lm_head is its token table),
 * the two halves of that gradient are summed across stages (not micro-batch by micro-batch) and clipping's norm
 * is summed per stage: the losses then agree within fp32 reduction noise, bounded by ddp_ref.h's bar. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/comm.h"
#include "fitllm/model.h"
#include "fitllm/pp.h"
#include "fitllm/precision.h"
#include "fitllm/train.h"
#include "test.h"

enum { PB = 2, PT = 16, PM = 4, PSTEPS = 3 };

typedef struct {
    fl_model_config cfg;
    float max_norm;
    fl_pp_schedule kind;
    int prec, act_ckpt;      /* precision (fl_precision_kind; 0: 32-true), activation checkpointing */
    int empty_first;         /* a step whose every target is masked first (skip_empty: no forward, no update) */
    int32_t ids[PM][PB * PT], tg[PM][PB * PT];
    double loss[8][PSTEPS];  /* per stage */
    int peak[8], want_peak[8], slots[8];
    float *params[8];        /* per stage: its fp32 parameters after the run (malloc'd) */
    size_t numel[8];
    int first[9];
} pp_case;

static void case_data(pp_case *c) {
    for (int k = 0; k < PM; k++)
        for (int i = 0; i < PB * PT; i++) {
            c->ids[k][i] = (i * 37 + k * 101 + 5) % c->cfg.vocab_size;
            c->tg[k][i] = (i * 11 + k * 13 + 3) % c->cfg.vocab_size;
        }
    c->tg[1][7] = FL_IGNORE_INDEX; /* a masked target: step_valid counts it out */
}

static long case_valid(const pp_case *c) {
    long v = 0;
    for (int k = 0; k < PM; k++)
        for (int i = 0; i < PB * PT; i++) v += c->tg[k][i] != FL_IGNORE_INDEX;
    return v;
}

static fl_status run_steps(fl_model *m, fl_optimizer *o, fl_pp *p, pp_case *c, double *loss) {
    fl_micro_batch mbs[PM];
    for (int k = 0; k < PM; k++) mbs[k] = (fl_micro_batch){.ids = c->ids[k], .targets = c->tg[k], .B = PB, .T = PT};
    if (c->empty_first) {
        fl_step_ctx e = {.mbs = mbs, .n_micro = PM, .step_valid = 0, .skip_empty = 1, .lr = 3e-3f};
        fl_step_result r;
        FL_TRY(p ? fl_pp_step_run(p, o, &e, &r) : fl_step_run(m, o, &e, &r));
        if (!isnan(r.loss)) return fl_errorf(FL_ERR_INTERNAL, "an empty step's loss %g, not NaN", r.loss);
    }
    for (int st = 0; st < PSTEPS; st++) {
        fl_step_ctx sc = {.mbs = mbs, .n_micro = PM, .step_valid = case_valid(c), .lr = 3e-3f, .max_norm = c->max_norm};
        fl_step_result r;
        FL_TRY(p ? fl_pp_step_run(p, o, &sc, &r) : fl_step_run(m, o, &sc, &r));
        loss[st] = r.loss;
    }
    return FL_OK;
}

/* a model of cfg with c's precision's storage; then, with its weights in place, the policy and checkpointing */
static fl_status make_model(const pp_case *c, const fl_model_config *cfg, const fl_backend *be, fl_mem_pool *pool,
                            fl_model *m) {
    fl_model_storage st;
    fl_model_storage_for(fl_precision_get((fl_precision_kind)c->prec), &st);
    return fl_model_init_ex(m, cfg, be, pool, &st);
}

static fl_status policy(const pp_case *c, fl_model *m) {
    FL_TRY(fl_model_set_precision(m, fl_precision_get((fl_precision_kind)c->prec)));
    m->act_ckpt = c->act_ckpt;
    return FL_OK;
}

/* one process */
static void single(pp_case *c, double *loss, float **params) {
    fl_backend be;
    fl_mem_pool pool, hpool;
    fl_model m;
    fl_optimizer o;
    FL_REQUIRE_OK(fl_test_backend(&be, 1));
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &hpool, be.name, 0));
    FL_REQUIRE_OK(make_model(c, &c->cfg, &be, &pool, &m));
    fl_model_init_random(&m, 7);
    FL_REQUIRE_OK(policy(c, &m));
    FL_REQUIRE_OK(fl_model_alloc_grads(&m));
    FL_REQUIRE_OK(fl_model_alloc_acts(&m, PB, PT));
    fl_optim_config oc;
    fl_optim_config_default(&oc, FL_OPT_ADAMW);
    FL_REQUIRE_OK(fl_optim_init(&o, &m, &oc));
    FL_REQUIRE_OK(run_steps(&m, &o, NULL, c, loss));
    *params = malloc(m.layout.numel * sizeof(float));
    FL_REQUIRE(*params);
    for (int i = 0; i < m.layout.n; i++) fl_model_read_param(&m, i, *params + m.layout.params[i].offset);
    fl_optim_free(&o);
    fl_model_free(&m);
    fl_backend_pools_free(&pool, &hpool);
    fl_backend_free(&be);
}

/* stage s: the whole model made with the single process's seed, the stage's part taken, the steps */
static fl_status stage_rank(fl_comm *comm, int s, void *ud) {
    pp_case *c = ud;
    const int S = fl_comm_size(comm);
    fl_backend be;
    fl_mem_pool pool, hpool;
    fl_model whole, m;
    fl_optimizer o;
    fl_pp p;
    fl_model_config sc;
    FL_TRY(fl_test_backend(&be, 1));
    FL_TRY(fl_backend_pools_init(&be, &pool, &hpool, be.name, 0));
    FL_TRY(make_model(c, &c->cfg, &be, &pool, &whole));
    fl_model_init_random(&whole, 7);
    FL_TRY(fl_pp_stage_config(&c->cfg, c->first[s], c->first[s + 1], &sc));
    FL_TRY(make_model(c, &sc, &be, &pool, &m));
    FL_TRY(fl_pp_stage_take(&whole, &m, c->first[s]));
    FL_TRY(policy(c, &m));
    FL_TRY(fl_model_alloc_grads(&m));
    FL_TRY(fl_model_alloc_acts(&m, PB, PT));
    fl_optim_config oc;
    fl_optim_config_default(&oc, FL_OPT_ADAMW);
    FL_TRY(fl_optim_init(&o, &m, &oc));
    FL_TRY(fl_pp_init(&p, &m, comm, c->kind));
    FL_TRY(fl_pp_optim_attach(&p, &o));
    FL_TRY(run_steps(&m, &o, &p, c, c->loss[s]));
    c->peak[s] = p.peak_in_flight;
    c->slots[s] = p.n_stash;
    fl_pp_op ops[2 * PM];
    FL_TRY(fl_pp_schedule_ops(c->kind, S, s, PM, ops));
    c->want_peak[s] = fl_pp_in_flight(ops, 2 * PM);
    /* the whole model's parameters this stage trains, at their whole-layout offsets */
    float *w = calloc(whole.layout.numel, sizeof *w);
    if (!w) return fl_errorf(FL_ERR_OOM, "test");
    for (int i = 0; i < m.layout.n; i++)
        if (fl_pp_stage_owns(&m, i)) {
            const int j = fl_pp_stage_entry(&whole.layout, &m.layout, c->first[s], i);
            fl_model_read_param(&m, i, w + whole.layout.params[j].offset);
        }
    c->params[s] = w;
    c->numel[s] = whole.layout.numel;
    fl_pp_free(&p);
    fl_optim_free(&o);
    fl_model_free(&m);
    fl_model_free(&whole);
    fl_backend_pools_free(&pool, &hpool);
    fl_backend_free(&be);
    return FL_OK;
}

/* S stages of c under kind: every stage's losses against one process's (exact: bit for bit; else within
 * 1e-6 relative), the stages' trained weights against one process's (exact only) */
static void check_pipeline(pp_case *c, int S, int exact, const double *want, const float *wparams) {
    FL_REQUIRE_OK(fl_pp_split(c->cfg.n_layers, NULL, S, c->first));
    for (int s = 0; s < 8; s++) c->params[s] = NULL;
    FL_REQUIRE_OK(fl_comm_threads_run(S, stage_rank, c));
    double worst = 0;
    for (int s = 0; s < S; s++)
        for (int st = 0; st < PSTEPS; st++) {
            const double d = fabs(c->loss[s][st] - want[st]) / fabs(want[st]);
            if (d > worst) worst = d;
            if (exact || st == 0) /* the first step's loss precedes any update: the same bits in every case */
                FL_CHECKF(c->loss[s][st] == want[st], "%s S %d (%s%s) stage %d step %d: loss %.9g, one process %.9g",
                          fl_pp_schedule_name(c->kind), S, fl_precision_get((fl_precision_kind)c->prec)->name,
                          c->act_ckpt ? ", checkpointing" : "", s, st, c->loss[s][st], want[st]);
        }
    FL_CHECKF(worst <= 1e-6, "%s S %d: losses %.3g relative from one process's", fl_pp_schedule_name(c->kind), S, worst);
    for (int s = 0; s < S; s++)
        FL_CHECKF(c->peak[s] == c->want_peak[s] && c->slots[s] == c->want_peak[s] - 1, "%s S %d stage %d: %d "
                  "micro-batches in flight in the arena and %d stash slots, pp.h says %d in flight",
                  fl_pp_schedule_name(c->kind), S, s, c->peak[s], c->slots[s], c->want_peak[s]);
    size_t diff = 0;
    for (size_t k = 0; exact && k < c->numel[0]; k++) {
        float v = 0;
        for (int s = 0; s < S; s++) v += c->params[s][k]; /* each element trained by one stage, zeros elsewhere */
        diff += memcmp(&v, &wparams[k], sizeof v) != 0;
    }
    FL_CHECKF(diff == 0, "%s S %d: %zu weights differ from one process's", fl_pp_schedule_name(c->kind), S, diff);
    for (int s = 0; s < S; s++) free(c->params[s]);
}

FL_TEST(pp_model_untied_equals_single_process) {
    static pp_case c;
    memset(&c, 0, sizeof c);
    FL_REQUIRE_OK(fl_preset_find("micro", &c.cfg));
    c.cfg.tie_embeddings = 0; /* a head of its own: every gradient accumulates as in one process */
    c.empty_first = 1;        /* and an empty step first changes nothing */
    case_data(&c);
    double want[PSTEPS];
    float *wp = NULL;
    single(&c, want, &wp);
    for (int k = 0; k < FL_PP_SCHEDULE_COUNT; k++)
        for (int S = 2; S <= c.cfg.n_layers; S++) {
            c.kind = (fl_pp_schedule)k;
            check_pipeline(&c, S, 1, want, wp);
        }
    free(wp);
}

/* activation checkpointing (the block recomputed from the stashed input; the last block's kept activations stashed
 * with the rest) and the 16-bit policies (bf16-mixed's compute copy, bf16-true's bf16 storage and saved activations):
 * the same bits as one process under each */
FL_TEST(pp_model_ckpt_and_precisions_equal_single_process) {
    static pp_case c;
    const int precs[3] = {FL_PREC_32_TRUE, FL_PREC_BF16_MIXED, FL_PREC_BF16_TRUE};
    for (int v = 0; v < 6; v++) { /* each precision under both schedules, checkpointing in half of them */
        memset(&c, 0, sizeof c);
        FL_REQUIRE_OK(fl_preset_find("micro", &c.cfg));
        c.cfg.tie_embeddings = 0;
        c.prec = precs[v / 2];
        c.act_ckpt = (v / 2 + v % 2) % 2;
        case_data(&c);
        double want[PSTEPS];
        float *wp = NULL;
        single(&c, want, &wp);
        c.kind = v % 2 ? FL_PP_GPIPE : FL_PP_1F1B;
        check_pipeline(&c, 3, 1, want, wp);
        free(wp);
    }
}

FL_TEST(pp_model_tied_and_clipped_within_noise) {
    static pp_case c;
    memset(&c, 0, sizeof c);
    FL_REQUIRE_OK(fl_preset_find("micro", &c.cfg)); /* lm_head tied to the token table */
    FL_REQUIRE(c.cfg.tie_embeddings);
    case_data(&c);
    double want[PSTEPS];
    float *wp = NULL;
    single(&c, want, &wp);
    for (int k = 0; k < FL_PP_SCHEDULE_COUNT; k++) {
        c.kind = (fl_pp_schedule)k;
        check_pipeline(&c, 3, 0, want, wp);
    }
    /* clipping: the norm summed over the stages */
    free(wp);
    c.max_norm = 0.05f;
    single(&c, want, &wp);
    c.kind = FL_PP_1F1B;
    check_pipeline(&c, 2, 0, want, wp);
    free(wp);
}

/* GPT-2 (learned positions, LayerNorm with biases, GELU) and OPT (learned positions at an offset of 2, ReLU, its
 * final LayerNorm) split into stages as LLaMA is: with a head of their own, the same bits as one process under
 * both schedules at 2 and 3 stages of 4 blocks (their embeddings group holds the position table too, run on the first stage) */
FL_TEST(pp_model_gpt2_and_opt_equal_single_process) {
    static pp_case c;
    const char *presets[2] = {"gpt2-micro", "opt-micro"};
    for (int m = 0; m < 2; m++) {
        memset(&c, 0, sizeof c);
        FL_REQUIRE_OK(fl_preset_find(presets[m], &c.cfg));
        c.cfg.tie_embeddings = 0;
        c.cfg.n_layers = 4; /* the presets' 2 blocks allow one split only */
        case_data(&c);
        double want[PSTEPS];
        float *wp = NULL;
        single(&c, want, &wp);
        for (int k = 0; k < FL_PP_SCHEDULE_COUNT; k++)
            for (int S = 2; S <= 3 && S <= c.cfg.n_layers; S++) {
                c.kind = (fl_pp_schedule)k;
                check_pipeline(&c, S, 1, want, wp);
            }
        free(wp);
    }
}

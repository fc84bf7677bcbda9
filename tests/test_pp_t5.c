/* Pipeline parallelism of T5 (fitllm/pp.h; issue 35 item 2): the stages split [encoder blocks; decoder blocks]
 * (src/model/stage.c, the streams of src/model/seq2seq_stage.c) and run as threads through fl_pp_step_run, against
 * one process running fl_step_run on the same micro-batches (sources of two lengths with padding, ignored labels).
 *
 * What differs from one process: the shared embedding's gradient (the encoder's embedding on stage 0, the decoder's on
 * the stage holding decoder block 0, the tied head on the last) and each stack's relative bias table's (a copy on every
 * stage holding blocks of the stack, each folding its blocks' d(bias)) are summed over the pipeline once per step, not
 * micro-batch by micro-batch and block by block: a reassociation. Everything else (every block on the same inputs,
 * d(encoder output) summed over the decoder blocks in the one process's order across the stages) is the same code.
 * Checked: the first step's loss (before any update) bit for bit; the later losses within ddp_ref.h's 1e-6 relative
 * (fp32 reassociation noise; a missing term is far outside: without the pipeline's sum the shared embedding's and the
 * tables' step-0 gradients are 0.2 to 1 of their scale off, checked by hand); the step-0 gradients re-assembled from the stages (each entry from the
 * stage that owns it, fl_pp_stage_owns) tensor by tensor within 1e-5 of each tensor's largest value (fp32 sums of at
 * most a few dozen terms reassociated: ~1e-7); the micro-batches in flight = pp.h's count at every stage. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend_op.h"
#include "fitllm/comm.h"
#include "fitllm/lora.h"
#include "fitllm/model.h"
#include "fitllm/pp.h"
#include "fitllm/precision.h"
#include "fitllm/train.h"
#include "test.h"

enum { TB = 2, TS = 7, TT = 5, TM = 3, TSTEPS = 3 };

typedef struct {
    fl_model_config cfg;
    fl_pp_schedule kind;
    int prec, act_ckpt, dropout;
    float max_norm;
    int32_t src[TM][TB * TS], dec[TM][TB * TT], tg[TM][TB * TT];
    uint8_t mask[TM][TB * TS];
    int Ts[TM];
    double loss[8][TSTEPS];
    int peak[8], want_peak[8];
    float *grads[8]; /* per stage: the step-0 gradients of the entries it owns at the whole layout's offsets */
    size_t numel;
    int first[9];
    int lora;          /* LoRA on q, v, o, wo (dropout 0.1) over the frozen base */
} t5_case;

static void case_data(t5_case *c) {
    const int V = c->cfg.vocab_size;
    for (int k = 0; k < TM; k++) {
        c->Ts[k] = k == 1 ? TS - 2 : TS; /* micro-batch 1 has shorter sources (the arena's smaller pass) */
        for (int i = 0; i < TB * c->Ts[k]; i++) {
            c->src[k][i] = 2 + (i * 37 + k * 101 + 5) % (V - 2);
            c->mask[k][i] = !(i / c->Ts[k] == 1 && i % c->Ts[k] >= c->Ts[k] - 2); /* row 1's last two padded */
        }
        for (int i = 0; i < TB * TT; i++) {
            c->tg[k][i] = 2 + (i * 11 + k * 13 + 3) % (V - 2);
            c->dec[k][i] = i % TT ? c->tg[k][i - 1] : c->cfg.dec_start_id;
        }
    }
    c->tg[2][TT + 3] = FL_IGNORE_INDEX;
}

static long case_valid(const t5_case *c) {
    long v = 0;
    for (int k = 0; k < TM; k++)
        for (int i = 0; i < TB * TT; i++) v += c->tg[k][i] != FL_IGNORE_INDEX;
    return v;
}

/* the owned entries' gradients of m (o's buffer) at the whole layout's offsets in g (whole NULL: m is the whole) */
static void read_grads(const fl_model *m, const fl_optimizer *o, const fl_model *whole, int first, float *g) {
    for (int i = 0; i < m->layout.n; i++) {
        const fl_param_info *e = &m->layout.params[i];
        if (whole && !fl_pp_stage_owns(m, i)) continue;
        const int j = whole ? fl_pp_stage_entry(&whole->layout, &m->layout, first, i) : i;
        FL_REQUIRE(j >= 0);
        const size_t at = whole ? whole->layout.params[j].offset : e->offset;
        FL_REQUIRE_OK(FL_RUN(m->be, to_host, g + at, (const float *)o->w.g + e->offset, e->numel * sizeof(float)));
    }
}

static fl_status run_steps(fl_model *m, fl_optimizer *o, fl_pp *p, t5_case *c, double *loss, float *g0,
                           const fl_model *whole, int first) {
    fl_micro_batch mbs[TM];
    for (int k = 0; k < TM; k++)
        mbs[k] = (fl_micro_batch){.ids = c->dec[k], .targets = c->tg[k], .B = TB, .T = TT, .src = c->src[k],
                                  .src_mask = c->mask[k], .Ts = c->Ts[k]};
    for (int st = 0; st < TSTEPS; st++) {
        fl_step_ctx sc = {.mbs = mbs, .n_micro = TM, .step_valid = case_valid(c), .lr = 3e-3f, .max_norm = c->max_norm,
                          .seeded = c->dropout, .seed = 1234, .iter0 = (long)st * TM};
        fl_step_result r;
        FL_TRY(p ? fl_pp_step_run(p, o, &sc, &r) : fl_step_run(m, o, &sc, &r));
        loss[st] = r.loss;
        if (st == 0 && g0) read_grads(m, o, whole, first, g0);
    }
    return FL_OK;
}

static fl_status make_model(const t5_case *c, const fl_model_config *cfg, const fl_backend *be, fl_mem_pool *pool,
                            fl_model *m, int seed) {
    fl_model_storage st;
    fl_model_storage_for(fl_precision_get((fl_precision_kind)c->prec), &st);
    FL_TRY(fl_model_init_ex(m, cfg, be, pool, &st));
    if (seed) fl_model_init_random(m, 7);
    return FL_OK;
}

/* LoRA: the adapters of a model whose first block is block `first` of the whole (whole: its config) at the whole's
 * module index of its first module (encoder blocks' modules first, 4 per block here: q, v, o, wo; then the decoder's,
 * 7 per block: its cross-attention's q, v, o too), so each starts and drops out as one process's */
static fl_status lora_at(const t5_case *c, fl_model *m, int first) {
    fl_lora_config lc;
    FL_TRY(fl_lora_config_init(&lc, &m->cfg, 4, 8.0f, 0.1f, 0, "q,v,o,wo"));
    const int Le = c->cfg.n_layers;
    return fl_model_lora_init_at(m, &lc, 11, first < Le ? first * 4 : Le * 4 + (first - Le) * 7);
}

/* the precision, checkpointing, dropout, gradients, the arena (the longest source and target) and AdamW */
static fl_status train_setup(const t5_case *c, fl_model *m, fl_optimizer *o) {
    FL_TRY(fl_model_set_precision(m, fl_precision_get((fl_precision_kind)c->prec)));
    m->act_ckpt = c->act_ckpt;
    if (c->dropout) FL_TRY(fl_model_set_dropout(m, 1));
    if (!c->lora) FL_TRY(fl_model_alloc_grads(m));
    FL_TRY(fl_model_alloc_acts_s2s(m, TB, TS, TT));
    fl_optim_config oc;
    fl_optim_config_default(&oc, FL_OPT_ADAMW);
    return fl_optim_init(o, m, &oc);
}

static void single(t5_case *c, double *loss, float **g0) {
    fl_backend be;
    fl_mem_pool pool, hpool;
    fl_model m;
    fl_optimizer o;
    FL_REQUIRE_OK(fl_test_backend(&be, 1));
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &hpool, be.name, 0));
    FL_REQUIRE_OK(make_model(c, &c->cfg, &be, &pool, &m, 1));
    if (c->lora) FL_REQUIRE_OK(lora_at(c, &m, 0));
    FL_REQUIRE_OK(train_setup(c, &m, &o));
    *g0 = calloc(m.layout.numel, sizeof **g0);
    FL_REQUIRE(*g0);
    c->numel = m.layout.numel;
    FL_REQUIRE_OK(run_steps(&m, &o, NULL, c, loss, c->lora ? NULL : *g0, NULL, 0));
    fl_optim_free(&o);
    fl_model_free(&m);
    fl_backend_pools_free(&pool, &hpool);
    fl_backend_free(&be);
}

static fl_status stage_rank(fl_comm *comm, int s, void *ud) {
    t5_case *c = ud;
    const int S = fl_comm_size(comm);
    fl_backend be;
    fl_mem_pool pool, hpool;
    fl_model whole, m;
    fl_optimizer o;
    fl_pp p;
    fl_model_config sc;
    FL_TRY(fl_test_backend(&be, 1));
    FL_TRY(fl_backend_pools_init(&be, &pool, &hpool, be.name, 0));
    FL_TRY(make_model(c, &c->cfg, &be, &pool, &whole, 1));
    FL_TRY(fl_pp_stage_config(&c->cfg, c->first[s], c->first[s + 1], &sc));
    FL_TRY(make_model(c, &sc, &be, &pool, &m, 0));
    FL_TRY(fl_pp_stage_take(&whole, &m, c->first[s]));
    if (c->lora) FL_TRY(lora_at(c, &m, c->first[s]));
    FL_TRY(train_setup(c, &m, &o));
    FL_TRY(fl_pp_init(&p, &m, comm, c->kind));
    FL_TRY(fl_pp_optim_attach(&p, &o));
    c->grads[s] = calloc(whole.layout.numel, sizeof(float));
    if (!c->grads[s]) return fl_errorf(FL_ERR_OOM, "test");
    FL_TRY(run_steps(&m, &o, &p, c, c->loss[s], c->lora ? NULL : c->grads[s], &whole, c->first[s]));
    c->peak[s] = p.peak_in_flight;
    fl_pp_op ops[2 * TM];
    FL_TRY(fl_pp_schedule_ops(c->kind, S, s, TM, ops));
    c->want_peak[s] = fl_pp_in_flight(ops, 2 * TM);
    fl_pp_free(&p);
    fl_optim_free(&o);
    fl_model_free(&m);
    fl_model_free(&whole);
    fl_backend_pools_free(&pool, &hpool);
    fl_backend_free(&be);
    return FL_OK;
}

/* the pipeline of split first[0..S] against one process's losses and step-0 gradients; the worst gradient distance
 * (relative to each tensor's largest value) in *gworst */
static void check_pipeline(t5_case *c, int S, const int *first, const double *want, const float *wg, double *gworst) {
    memcpy(c->first, first, (size_t)(S + 1) * sizeof *first);
    for (int s = 0; s < 8; s++) c->grads[s] = NULL;
    FL_REQUIRE_OK(fl_comm_threads_run(S, stage_rank, c));
    double worst = 0;
    for (int s = 0; s < S; s++)
        for (int st = 0; st < TSTEPS; st++) {
            const double d = fabs(c->loss[s][st] - want[st]) / fabs(want[st]);
            if (d > worst) worst = d;
            if (st == 0 || c->lora) /* LoRA: a frozen base, no summed gradient: every step one process's bits */
                FL_CHECKF(c->loss[s][st] == want[st], "%s split %d..%d stage %d: first loss %.9g, one process %.9g",
                          fl_pp_schedule_name(c->kind), first[1], first[S - 1], s, c->loss[s][st], want[st]);
        }
    FL_CHECKF(worst <= 1e-6, "%s S %d (split at %d): losses %.3g relative from one process's", fl_pp_schedule_name(c->kind),
              S, first[1], worst);
    for (int s = 0; s < S; s++)
        FL_CHECKF(c->peak[s] == c->want_peak[s], "%s S %d stage %d: %d micro-batches in flight, pp.h says %d",
                  fl_pp_schedule_name(c->kind), S, s, c->peak[s], c->want_peak[s]);
    *gworst = 0;
    if (c->lora) {
        for (int s = 0; s < S; s++) free(c->grads[s]);
        return;
    }
    /* the gradients re-assembled: each element from the one stage that owns its entry (zeros elsewhere) */
    fl_model_config wc = c->cfg;
    fl_param_layout lay;
    FL_REQUIRE_OK(fl_layout_build(&lay, &wc));
    *gworst = 0;
    for (int i = 0; i < lay.n; i++) {
        const fl_param_info *e = &lay.params[i];
        double mx = 0, d = 0;
        for (size_t k = 0; k < e->numel; k++) {
            float v = 0;
            for (int s = 0; s < S; s++) v += c->grads[s][e->offset + k];
            const double w = wg[e->offset + k];
            if (fabs(w) > mx) mx = fabs(w);
            if (fabs(v - w) > d) d = fabs(v - w);
        }
        const double r = mx > 0 ? d / mx : d;
        if (r > *gworst) *gworst = r;
        FL_CHECKF(r <= 1e-5, "%s S %d: the step-0 gradient of %s is %.3g of its scale from one process's",
                  fl_pp_schedule_name(c->kind), S, e->name, r);
    }
    fl_layout_free(&lay);
    for (int s = 0; s < S; s++) free(c->grads[s]);
}

static void t5_config(t5_case *c, int v10) {
    memset(c, 0, sizeof *c);
    FL_REQUIRE_OK(fl_preset_find("t5-micro", &c->cfg)); /* v1.1's shape: gated-GELU, lm_head of its own */
    c->cfg.vocab_size = 97, c->cfg.n_layers = 3, c->cfg.n_dec_layers = 3, c->cfg.rel_buckets = 8, c->cfg.rel_max_dist = 20;
    if (v10) c->cfg.ffn_gated = 0, c->cfg.tie_embeddings = 1, c->cfg.head_scale = 1; /* v1.0: ReLU, the tied scaled head */
    case_data(c);
}

/* splits of 3 + 3 blocks: at the stacks' boundary, inside the encoder (a stage with the encoder's end and the
 * decoder's start), inside the decoder (a stage of decoder blocks only, after the decoder's first), and four stages */
static const int splits[4][6] = {{2, 0, 3, 6}, {2, 0, 2, 6}, {2, 0, 4, 6}, {4, 0, 1, 3, 5, 6}};

FL_TEST(pp_t5_stages_equal_one_process) {
    static t5_case c;
    double gw = 0, worst = 0;
    const int light = fl_test_asan_light(); /* ASan: v1.1 only (every split and both schedules) */
    for (int v10 = 0; v10 < 2 - light; v10++) {
        t5_config(&c, v10);
        double want[TSTEPS];
        float *wg = NULL;
        single(&c, want, &wg);
        for (int k = 0; k < 4; k++) {
            if (v10 && (k == 1 || k == 2)) continue; /* v1.0: the stacks' boundary and 4 stages (the unit test's time) */
            c.kind = k % 2 ? FL_PP_GPIPE : FL_PP_1F1B;
            check_pipeline(&c, splits[k][0], &splits[k][1], want, wg, &gw);
            if (gw > worst) worst = gw;
        }
        free(wg);
    }
    printf("  [pp_t5] worst step-0 gradient distance %.3g of a tensor's scale\n", worst);
}

/* activation checkpointing, bf16-mixed (its 16-bit saved activations stashed) and dropout (each block's sites by its
 * index in the whole model), clipping (the norm over the stages) */
FL_TEST(pp_t5_ckpt_bf16_dropout_clip) {
    static t5_case c;
    double gw = 0;
    for (int v = 0; v < 3; v++) {
        t5_config(&c, v == 1);
        c.act_ckpt = v == 0;
        c.prec = v == 1 ? FL_PREC_BF16_MIXED : FL_PREC_32_TRUE;
        c.dropout = v == 2;
        c.max_norm = v == 2 ? 0.5f : 0;
        double want[TSTEPS];
        float *wg = NULL;
        single(&c, want, &wg);
        c.kind = v == 1 ? FL_PP_GPIPE : FL_PP_1F1B;
        check_pipeline(&c, 3, (const int[]){0, 2, 4, 6}, want, wg, &gw);
        free(wg);
    }
}

/* LoRA (q, v, o, wo with dropout 0.1; the encoder's and the decoder's self-attention, the cross-attention's q, v, o):
 * each stage's adapters keyed by the whole model's module index, the base frozen (no summed gradient): every step's
 * loss is one process's bits, under 1F1B and GPipe at 2 and 4 stages */
FL_TEST(pp_t5_lora_equals_one_process) {
    static t5_case c;
    double gw = 0;
    t5_config(&c, 0);
    c.lora = 1;
    c.dropout = 1; /* T5's own dropout too (the base's sites by the whole's block index) */
    double want[TSTEPS];
    float *wg = NULL;
    single(&c, want, &wg);
    for (int k = 0; k < 2; k++) {
        c.kind = k ? FL_PP_GPIPE : FL_PP_1F1B;
        check_pipeline(&c, splits[2 + k][0], &splits[2 + k][1], want, wg, &gw);
    }
    free(wg);
}

/* `fitllm lab --suite blip2` (issue 32 item 5): the course's BLIP-2 image-caption sequence, row by row, with its
 * verdicts: baseline 64 images at 32-true out of memory, micro batch 8 and accumulation fit, 16-bit
 * precisions, the larger language models (the Flan-T5-XXL variant out of memory with AdamW, fitting with SGD),
 * activation checkpointing, CPU offload (the optimizer state on the host), LoRA / QLoRA on the language model, DDP and
 * FSDP over 4 ranks.
 *
 * Every row is one BLIP-2 fine-tuning through the library's entry (fl_blip2_train, fitllm/blip2_train.h): planned as
 * its rehearsal on the null backend (the run's own allocations, nothing computed: plan = measured), then, unless
 * --plan-only or the plan is out of memory, trained for a few steps on synthetic images and captions (random pixels
 * and ids, random weights; no download). At lab scale each real model is shrunk as the language lab's lab-* presets
 * are: every width / 16 (hidden sizes, MLP sizes, heads x head dim; the vocabulary to 2000), every depth kept; the
 * image grid 16x16 -> 4x4 patches, the queries 32 -> 2 and the captions 50 -> 4 tokens (every sequence / 16, so
 * one sample's activations per parameter stay about the real ones), the budget 80 GB x params(lab) / params(real) of
 * blip2-opt-2.7b. --scale real runs (or with --plan-only plans) the real shapes on an 80 GB device (the plan stands
 * in for a GPU: the null backend planning "cuda"). What BLIP-2 fine-tuning refuses in this build (a precision, a
 * strategy, QLoRA, ...) makes its row n/a with the refusal as the note. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fitllm/backend.h"
#include "fitllm/blip2_train.h"
#include "fitllm/comm.h"
#include "lab-impl.h"

#define B2_REF "blip2-opt-2.7b"   /* the model the budget is scaled by */
#define B2_DEVICE ((size_t)80000000000ULL)
#define B2_CAPTION 50             /* the lab's captions: at most 50 tokens */
#define B2_SHRINK 16              /* widths and sequences at lab scale */

/* The course's BLIP-2 sequence (BRIEF section 5 with the BLIP-2 version's batch sizes: 64, then 8 (16 and 32 fit
 * too at the real scale, the frozen vision tower saving nothing: 8 leaves the lab scale the same verdicts with
 * margin)). The language model trains with the Q-Former (the vision tower frozen: BLIP-2 fine-tuning's default,
 * --blip2.train qformer,lm). */
static const lab_exp k_b2[] = {
    {"baseline", "full fine-tune, fp32, batch 64", "OOM", B2_REF, "", 64, 64, 1, "32-true", FL_OPT_ADAMW, 0, "",
     FL_LAB_OOM, 0},
    {"reduced-batch", "micro batch 8", "fits, slower per sample", B2_REF, "", 8, 8, 1, "32-true", FL_OPT_ADAMW, 0,
     "", FL_LAB_FITS, 0},
    {"grad-accum", "global 64 = micro 8 x accumulate 8", "about the memory of micro batch 8", B2_REF, "", 8, 64, 1,
     "32-true", FL_OPT_ADAMW, 0, "", FL_LAB_FITS, 0},
    {"bf16-true", "precision bf16-true", "much less memory, faster", B2_REF, "", 8, 64, 1, "bf16-true", FL_OPT_ADAMW,
     0, "", FL_LAB_FITS, 0},
    {"bf16-mixed", "precision bf16-mixed", "between bf16-true and fp32", B2_REF, "", 8, 64, 1, "bf16-mixed",
     FL_OPT_ADAMW, 0, "", FL_LAB_FITS, 0},
    {"larger-model", "BLIP-2 OPT-6.7B in bf16-true", "memory grows with size", "blip2-opt-6.7b", "", 8, 64, 1,
     "bf16-true", FL_OPT_ADAMW, 0, "", FL_LAB_FITS, 0},
    {"even-larger", "BLIP-2 Flan-T5-XXL, bf16-true, batch 1", "OOM even at batch 1", "blip2-flan-t5-xxl", "", 1, 1, 1,
     "bf16-true", FL_OPT_ADAMW, 0, "", FL_LAB_OOM, 0},
    {"sgd", "Flan-T5-XXL, batch 1, SGD (stateless)", "fits: Adam's states cost 2x the weights", "blip2-flan-t5-xxl", "",
     1, 1, 10, "bf16-true", FL_OPT_SGD, 0, "", FL_LAB_FITS, 0},
    {"act-ckpt", "activation checkpointing, batch 64", "activations shrink, slower", B2_REF, "", 64, 64, 1, "32-true",
     FL_OPT_ADAMW, 1, "activation_checkpointing", FL_LAB_FITS, 0},
    {"cpu-offload", "ZeRO-2 offload, CPU Adam, micro 8", "device optimizer memory ~0, slow", B2_REF, "", 8, 64, 1,
     "32-true", FL_OPT_ADAMW, 0, "cpu_offload", FL_LAB_FITS, 0},
    {"lora", "Flan-T5-XXL, LoRA r16 alpha32 on q, v", "small grads/optim state, fits easily", "blip2-flan-t5-xxl", "",
     4, 4, 1, "32-true", FL_OPT_ADAMW, 0, "lora", FL_LAB_FITS, 0},
    {"qlora", "Flan-T5-XXL, QLoRA (NF4 base, r16)", "smaller still, slower than LoRA", "blip2-flan-t5-xxl", "", 4, 4,
     1, "bf16-true", FL_OPT_ADAMW, 0, "qlora", FL_LAB_FITS, 0},
    {"ddp", "4x DDP, micro batch 8", "same memory per device, faster", B2_REF, "", 8, 64, 1, "32-true", FL_OPT_ADAMW,
     0, "ddp", FL_LAB_FITS, 0},
    {"fsdp", "4x FSDP, Flan-T5-XXL", "memory per device about halves", "blip2-flan-t5-xxl", "", 1, 4, 1, "32-true",
     FL_OPT_ADAMW, 0, "fsdp", FL_LAB_FITS, 0},
};
#define N_B2 (int)(sizeof k_b2 / sizeof k_b2[0])

const char *const *fl_lab_blip2_names(void) {
    static const char *names[N_B2 + 1];
    for (int i = 0; i < N_B2; i++) names[i] = k_b2[i].name;
    names[N_B2] = NULL;
    return names;
}

static int b2_ranks(const lab_exp *e) { return !strcmp(e->technique, "ddp") || !strcmp(e->technique, "fsdp") ? 4 : 1; }

/* ---- scaling ----------------------------------------------------------------------------------------------- */

static void shrink_part(fl_model_config *m, int heads) {
    m->dim /= B2_SHRINK;
    m->ffn_dim /= B2_SHRINK;
    if (m->head_dim) m->head_dim = m->dim / heads; /* heads x head dim = the width, as the real parts have it */
    m->n_heads = m->n_kv_heads = heads;
    if (!m->n_kv_heads) m->n_kv_heads = heads;
}

/* The shape a row runs: the real preset, or (lab scale) its lab version (the file's header). */
fl_status fl_lab_blip2_shape(const char *real, int lab, fl_blip2_config *c) {
    FL_TRY(fl_blip2_preset(real, c));
    if (!lab) return FL_OK;
    fl_model_config *v = &c->vision, *q = &c->qformer, *t = &c->text;
    shrink_part(v, 4); /* 1408 / 16 = 88: 4 heads of 22 */
    shrink_part(q, 4); /* 768 / 16 = 48: 4 heads of 12 */
    const int t5 = fl_model_is_s2s(t);
    shrink_part(t, t5 ? 8 : t->dim / (16 * B2_SHRINK)); /* OPT: heads of 16; T5 XXL: 8 heads of 32 (inner 256) */
    if (t5) t->head_dim = t->dim / t->n_heads;
    t->vocab_size = 2000;
    v->image_size /= 4; /* a 16x16 grid of patches -> 4x4 */
    v->max_seq = (v->image_size / v->patch_size) * (v->image_size / v->patch_size) + 1;
    c->n_queries /= B2_SHRINK;
    q->n_queries = q->max_seq = c->n_queries;
    q->xattn_dim = v->dim;
    q->proj_dim = t->dim;
    c->image_token = t->vocab_size - 1;
    snprintf(t->name, sizeof t->name, "lab-%s", real);
    FL_TRY(fl_error_prefix(fl_config_validate(v), "lab-%s: vision", real));
    FL_TRY(fl_error_prefix(fl_config_validate(q), "lab-%s: Q-Former", real));
    return fl_error_prefix(fl_config_validate(t), "lab-%s: language model", real);
}

/* The suite's scale: budget and caption length (rep->T), the parameter ratio of blip2-opt-2.7b. */
static fl_status b2_scale(int real, fl_lab_report *rep) {
    fl_blip2_config r, l;
    FL_TRY(fl_lab_blip2_shape(B2_REF, 0, &r));
    FL_TRY(fl_lab_blip2_shape(B2_REF, 1, &l));
    rep->ref_device = B2_DEVICE;
    rep->ref_T = B2_CAPTION;
    rep->param_ratio = real ? 1.0 : (double)fl_blip2_param_count(&l) / (double)fl_blip2_param_count(&r);
    rep->budget = real ? B2_DEVICE : (size_t)llround((double)B2_DEVICE * rep->param_ratio);
    rep->T = real ? B2_CAPTION : (B2_CAPTION + B2_SHRINK / 2) / B2_SHRINK + 1; /* 50 -> 4 (BOS and 3) */
    rep->blip2 = 1;
    return FL_OK;
}

/* ---- one row ----------------------------------------------------------------------------------------------- */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

/* The row's fine-tuning config: one rank's share under DDP / FSDP (global / ranks per rank). */
static void b2_config(fl_run_config *c, const lab_exp *e, int T, long steps, size_t budget, int threads, int per_rank) {
    const int lora = !strcmp(e->technique, "lora") || !strcmp(e->technique, "qlora"), ranks = b2_ranks(e);
    fl_cfg_defaults(c, lora ? FL_CMD_FINETUNE_LORA : FL_CMD_FINETUNE_FULL);
    snprintf(c->checkpoint_dir, sizeof c->checkpoint_dir, "%s", e->ref_model);
    snprintf(c->precision, sizeof c->precision, "%s", e->precision);
    c->train.micro_batch_size = e->B;
    c->train.global_batch_size = per_rank && ranks > 1 ? e->global / ranks : e->global;
    c->train.max_steps = (int)steps;
    c->train.max_seq_length = T;
    c->train.lr_warmup_steps = 0;
    c->train.save_interval = 0;
    c->train.activation_checkpointing = e->act_ckpt;
    c->eval.interval = 1 << 30;
    c->eval.max_new_tokens = 0;
    c->eval.final_validation = c->eval.initial_validation = 0;
    fl_optim_config_default(&c->optimizer, e->optim);
    c->optimizer.lr = 1e-4f * e->lr_mult;
    c->max_memory = budget;
    c->threads = threads;
    c->seed = 1337;
    if (ranks > 1 && !per_rank) {
        c->devices = ranks;
        snprintf(c->strategy, sizeof c->strategy, "%s", e->technique);
    } else if (ranks > 1 && !strcmp(e->technique, "fsdp")) {
        c->devices = ranks; /* FSDP's plan is one rank's shard: the strategy says so */
        snprintf(c->strategy, sizeof c->strategy, "fsdp");
    }
    if (!strcmp(e->technique, "cpu_offload")) snprintf(c->strategy, sizeof c->strategy, "deepspeed_stage_2_offload");
    if (lora) { /* the lab's LoRA: r 16, alpha 32, dropout 0.05 on query and value (T5's q, v) */
        c->lora.r = 16;
        c->lora.alpha = 32;
        c->lora.dropout = 0.05f;
        c->lora.query = c->lora.value = 1;
        if (!strcmp(e->technique, "qlora")) snprintf(c->lora.quantize, sizeof c->lora.quantize, "bnb.nf4");
    }
}

/* A rehearsal of one step on the null backend (cuda: standing in for a GPU) with the budget (0: none): FL_OK fits,
 * FL_ERR_OOM with res->oom, or the refusal. */
static fl_status b2_plan(const fl_run_config *c, const fl_blip2_config *shape, int cuda, size_t budget, int L,
                         fl_blip2_train_result *res) {
    fl_backend be;
    FL_TRY(fl_null_backend_init_for(&be, cuda ? "cuda" : "cpu"));
    fl_run_config one = *c;
    one.max_memory = budget;
    fl_blip2_train_opts o = {.shape = shape, .be = &be, .budget = budget, .synth_len = L, .rehearse_steps = 1};
    memset(res, 0, sizeof *res);
    fl_status s = fl_blip2_train(&one, &o, res);
    fl_null_backend_free(&be);
    return s;
}

typedef struct {
    const fl_run_config *cfg;
    const fl_blip2_config *shape;
    size_t budget;
    int L;
    long steps;
    double ms[4][64], loss[4][64];
    fl_blip2_train_result res[4];
    fl_status st[4];
    const fl_lab_opts *lab; /* its stop callback */
} b2_ranks_run;

static fl_status b2_rank(fl_comm *comm, int rank, void *ud) {
    b2_ranks_run *x = ud;
    long n = x->steps < 64 ? x->steps : 64;
    fl_blip2_train_opts o = {.shape = x->shape, .budget = x->budget, .synth_len = x->L, .rehearse_steps = x->steps,
                             .comm = comm, .step_ms = x->ms[rank], .step_loss = x->loss[rank], .n_step_out = n,
                             .stop = x->lab->stop, .stop_ud = x->lab->stop_ud};
    x->st[rank] = fl_blip2_train(x->cfg, &o, &x->res[rank]);
    return x->st[rank];
}

/* Train the row (one process, or its ranks as threads): rank 0's result, or the failing rank's. */
static fl_status b2_train(b2_ranks_run *x, int ranks, fl_lab_row *r) {
    fl_status s;
    int pick = 0;
    if (ranks <= 1) s = b2_rank(NULL, 0, x);
    else {
        s = fl_comm_threads_run(ranks, b2_rank, x);
        for (int k = 0; k < ranks && s != FL_OK; k++)
            if (x->st[k] == FL_ERR_OOM) { s = FL_ERR_OOM; break; }
        for (int k = 0; k < ranks && s != FL_OK; k++)
            if (x->st[k] == s) { pick = k; break; }
    }
    for (int k = 0; k < (ranks > 1 ? ranks : 1); k++) {
        size_t pk = x->res[k].peak_total;
        if (!k || pk < r->peak_min) r->peak_min = pk;
        if (!k || pk > r->peak_max) r->peak_max = pk;
    }
    if (pick) x->res[0] = x->res[pick];
    return s;
}

static void copy_phases(fl_lab_row *r, const fl_blip2_train_result *res, int planned) {
    r->n_phases = res->n_phases < FL_PLAN_MAX_PHASES ? res->n_phases : FL_PLAN_MAX_PHASES;
    memcpy(r->phases, res->phases, (size_t)r->n_phases * sizeof r->phases[0]);
    r->phases_planned = planned;
}

/* CPU offload: what the host tier took instead of the device (the row's note) */
static void offload_note(const fl_blip2_train_result *res, fl_lab_row *r) {
    char a[32], b[32], d[32];
    if (res->offload)
        snprintf(r->note, sizeof r->note, "device OPTIM %s; host tier (outside the device budget): OPTIM %s, total %s",
                 fl_fmt_bytes(res->peak[FL_TAG_OPTIM], d, sizeof d), fl_fmt_bytes(res->host_peak[FL_TAG_OPTIM], a, sizeof a),
                 fl_fmt_bytes(res->host_peak_total, b, sizeof b));
}

/* Real scale: where the row's plan (res: the whole run's) and PyTorch's modelled peak (--peer pytorch's model,
 * src/lab/lab_peer.c) reach different verdicts on the 80 GB device, the plan's is not the course's, or the two
 * figures differ by more than 25%, why in numbers: the phase of PyTorch's peak and what it holds there (the start of
 * the backward holds no gradient: zero_grad(set_to_none=True) frees them every step; the optimizer step no saved
 * tensor), against fitllm's tags, which it reserves for the whole step. */
static void b2_why(const lab_exp *e, const fl_blip2_train_result *res, int fits, fl_lab_row *r) {
    fl_blip2_config real;
    fl_lab_peer q;
    if (fl_lab_blip2_shape(e->ref_model, 0, &real) != FL_OK || !fl_lab_b2_peer_of(e, r->ranks, &real, B2_CAPTION, &q))
        return;
    const int pt_fits = q.peak <= B2_DEVICE, course_fits = e->expected == FL_LAB_FITS;
    const double G = 1e9, ratio = (double)res->peak_total / (double)q.peak;
    if (fits == pt_fits && fits == course_fits && ratio <= 1.25 && ratio >= 0.8) return;
    const size_t dev_optim = q.host ? 0 : q.optim, base = q.params + q.quant + dev_optim + q.comm;
    char pt[256], opt[32] = "", comm[48] = "";
    if (dev_optim) snprintf(opt, sizeof opt, " + optimizer %.2f", dev_optim / G);
    if (q.comm) snprintf(comm, sizeof comm, " + DDP's gradient buckets %.2f", q.comm / G);
    if (q.peak == base + q.saved + q.logits + q.transient)
        snprintf(pt, sizeof pt, "PyTorch peaks as the backward starts: params %.2f%s%s + saved %.2f + logits %.2f GB, no "
                 "gradient yet (zero_grad(set_to_none=True))%s", (q.params + q.quant) / G, opt, comm, q.saved / G,
                 (q.logits + q.transient) / G, q.host ? ", the state on the host (ZeRO-2 offload)" : "");
    else if (!q.host && q.peak == base + q.grads + q.step_temp)
        snprintf(pt, sizeof pt, "PyTorch peaks in the optimizer step: params %.2f%s%s + grads %.2f + AdamW's foreach "
                 "temporary %.2f GB", (q.params + q.quant) / G, opt, comm, q.grads / G, q.step_temp / G);
    else
        snprintf(pt, sizeof pt, "PyTorch: params %.2f, grads %.2f, optimizer %.2f, saved %.2f, logits %.2f GB, its peak "
                 "the largest of its phases", (q.params + q.quant) / G, q.grads / G, q.optim / G, q.saved / G,
                 (q.logits + q.transient) / G);
    const size_t *t = res->peak;
    snprintf(r->course_why, sizeof r->course_why, "fitllm plans %.2f GB (%s on 80 GB; the course: %s), PyTorch's model "
             "%.2f GB (%s). %s; fitllm reserves all for the whole step: PARAMS %.2f + GRADS %.2f + OPTIM %.2f + ACTS "
             "%.2f (vision %.2f: frozen, saves nothing; Q-Former %.2f; language model %.2f; %+.2f on PyTorch's saved) + "
             "WORKSPACE %.2f GB", res->peak_total / G, fits ? "fits" : "OOM", fl_lab_verdict_name(e->expected),
             q.peak / G, pt_fits ? "fits" : "OOM", pt, t[FL_TAG_PARAMS] / G, t[FL_TAG_GRADS] / G, t[FL_TAG_OPTIM] / G,
             t[FL_TAG_ACTS] / G, res->part_acts[FL_BLIP2_VISION] / G, res->part_acts[FL_BLIP2_QFORMER] / G,
             res->part_acts[FL_BLIP2_TEXT] / G, (double)t[FL_TAG_ACTS] / G - q.saved / G, t[FL_TAG_WORKSPACE] / G);
}

/* The row's plan at its scale (and, at lab scale, at the real one): its verdict, peaks and phases; 0 when the fine-
 * tuning refuses the row (n/a, the note says why). */
static int b2_plan_row(const lab_exp *e, const fl_lab_report *rep, const fl_blip2_config *shape, int cuda,
                       fl_run_config *c, fl_lab_row *r) {
    fl_blip2_train_result *res = malloc(sizeof *res);
    if (!res) {
        r->verdict = FL_LAB_ERROR;
        snprintf(r->note, sizeof r->note, "out of host memory");
        return 0;
    }
    int ok = 1;
    fl_status s = b2_plan(c, shape, cuda, rep->budget, r->T, res);
    if (s == FL_OK || (s == FL_ERR_OOM && res->oom.valid)) {
        r->planned = s == FL_OK ? FL_PLAN_FITS : FL_PLAN_OOM;
        if (s == FL_OK) {
            r->planned_peak = res->peak_total;
            memcpy(r->planned_tag, res->peak, sizeof r->planned_tag);
            memcpy(r->peak, res->peak, sizeof r->peak);
            r->peak_total = r->peak_min = r->peak_max = res->peak_total;
            copy_phases(r, res, 1);
            offload_note(res, r);
        } else {
            memcpy(r->peak, res->oom.cur, sizeof r->peak);
            r->peak_total = r->peak_min = r->peak_max = res->oom.in_use;
            r->oom = res->oom;
            if (b2_plan(c, shape, cuda, 0, r->T, res) == FL_OK) { /* what it needs, no budget */
                r->planned_peak = res->peak_total;
                memcpy(r->planned_tag, res->peak, sizeof r->planned_tag);
                copy_phases(r, res, 1);
                if (rep->real_scale) b2_why(e, res, 0, r);
            }
        }
        if (s == FL_OK && rep->real_scale) b2_why(e, res, 1, r);
    } else {
        r->planned = FL_PLAN_UNAVAILABLE;
        r->verdict = s == FL_ERR_UNSUPPORTED ? FL_LAB_NA : FL_LAB_ERROR;
        snprintf(r->note, sizeof r->note, "%s%s", s == FL_ERR_UNSUPPORTED ? "not available for BLIP-2 in this build: " : "",
                 fl_error_message());
        ok = 0;
    }
    if (ok && !rep->real_scale) { /* the real model on the 80 GB device */
        fl_blip2_config real;
        fl_run_config rc = *c;
        rc.max_memory = B2_DEVICE;
        if (fl_lab_blip2_shape(e->ref_model, 0, &real) == FL_OK) {
            s = b2_plan(&rc, &real, 1, B2_DEVICE, B2_CAPTION, res);
            r->ref_planned = s == FL_OK ? FL_PLAN_FITS : s == FL_ERR_OOM ? FL_PLAN_OOM : FL_PLAN_UNAVAILABLE;
            r->ref_peak = s == FL_OK ? res->peak_total : 0;
            if (s == FL_ERR_OOM && b2_plan(&rc, &real, 1, 0, B2_CAPTION, res) == FL_OK) /* what it needs, no budget */
                s = FL_OK;
            if (s == FL_OK) r->ref_peak = res->peak_total, memcpy(r->ref_tag, res->peak, sizeof r->ref_tag);
        }
    } else {
        r->ref_planned = r->planned;
        r->ref_peak = r->planned_peak;
        memcpy(r->ref_tag, r->planned_tag, sizeof r->ref_tag);
    }
    free(res);
    return ok;
}

/* A row that trained: its step time, tokens (the language model's rows: queries + caption) and phases. */
static void b2_measured(const lab_exp *e, const fl_blip2_config *shape, const b2_ranks_run *x, fl_lab_row *r) {
    const fl_blip2_train_result *res = &x->res[0];
    r->verdict = FL_LAB_FITS;
    copy_phases(r, res, 0);
    memcpy(r->peak, res->peak, sizeof r->peak);
    r->peak_total = res->peak_total;
    r->steps = res->session_steps;
    r->final_loss = res->last_loss;
    r->step_ms = res->step_ms_mean;
    const double rows = fl_model_is_s2s(&shape->text) ? r->T : shape->n_queries + r->T;
    r->tok_s = r->step_ms > 0 ? (double)e->global * rows / (r->step_ms / 1e3) : 0;
    offload_note(res, r);
}

/* Returns o->stop's value when it ended the row's training (its figures partial), else 0 */
static int b2_row(const lab_exp *e, const fl_lab_report *rep, const fl_lab_opts *o, long steps, fl_lab_row *r) {
    int stopped = 0;
    memset(r, 0, sizeof *r);
    double t0 = now_s();
    snprintf(r->name, sizeof r->name, "%s", e->name);
    snprintf(r->lab_step, sizeof r->lab_step, "%s", e->lab_step);
    snprintf(r->expect, sizeof r->expect, "%s", e->expect);
    snprintf(r->model, sizeof r->model, "%s%s", rep->real_scale ? "" : "lab-", e->ref_model);
    snprintf(r->ref_model, sizeof r->ref_model, "%s", e->ref_model);
    snprintf(r->precision, sizeof r->precision, "%s", e->precision);
    snprintf(r->optimizer, sizeof r->optimizer, "%s", fl_optim_name(e->optim));
    snprintf(r->technique, sizeof r->technique, "%s", e->technique);
    r->ranks = b2_ranks(e);
    r->B = e->B;
    r->accum = e->global / (e->B * r->ranks);
    r->T = rep->T;
    r->act_ckpt = e->act_ckpt;
    r->expected = e->expected;
    r->final_loss = NAN;
    fl_blip2_config shape;
    fl_run_config *c = malloc(sizeof *c);
    b2_ranks_run *x = calloc(1, sizeof *x);
    fl_status s = !c || !x ? fl_errorf(FL_ERR_OOM, "out of host memory") : fl_lab_blip2_shape(e->ref_model, !rep->real_scale, &shape);
    if (s != FL_OK) {
        r->verdict = FL_LAB_ERROR;
        snprintf(r->note, sizeof r->note, "%s", fl_error_message());
        goto done;
    }
    fl_blip2_config real; /* --peer pytorch: what PyTorch would need for the real model (even where fitllm refuses) */
    if (rep->peer_pytorch && fl_lab_blip2_shape(e->ref_model, 0, &real) == FL_OK)
        fl_lab_b2_row_peer(e, r->ranks, &real, B2_CAPTION, r);
    /* the plan stands in for the device the rows run on (the real scale's: an 80 GB GPU) */
    fl_backend_facts f;
    const int cuda = rep->real_scale || (fl_backend_facts_of(fl_backend_default_name(), &f) == FL_OK &&
                                         (f.caps & FL_CAP_DEVICE_MEMORY));
    b2_config(c, e, r->T, steps, rep->budget, o->threads, 1);
    if (!b2_plan_row(e, rep, &shape, cuda, c, r)) goto done;
    if (r->planned == FL_PLAN_OOM && !o->run_oom) { /* the plan's verdict: no model memory touched */
        fl_lab_set_oom(r, &r->oom, " (planned; not run)");
        goto done;
    }
    if (o->plan_only) {
        r->verdict = FL_LAB_FITS;
        goto done;
    }
    if (rep->real_scale && (r->ranks > 1 || rep->capacity < rep->budget)) { /* refuse, not crash */
        char a[32], b[32];
        r->verdict = FL_LAB_NA;
        fl_fmt_bytes(rep->budget, a, sizeof a);
        fl_fmt_bytes(rep->capacity, b, sizeof b);
        if (r->ranks > 1)
            snprintf(r->note, sizeof r->note, "at real scale the %d ranks need %d devices of %s (mpirun); the lab's "
                     "thread ranks would share this one", r->ranks, r->ranks, a);
        else
            snprintf(r->note, sizeof r->note, "at real scale this row needs the %s device: the %s backend has %s (run it "
                     "on an 80 GB GPU, --accelerator cuda)", a, fl_backend_default_name(), b);
        goto done;
    }
    b2_config(c, e, r->T, steps, rep->budget, o->threads, 0);
    if (r->ranks > 1) c->threads = o->threads > r->ranks ? o->threads / r->ranks : 1; /* the ranks share the cores */
    x->cfg = c, x->shape = &shape, x->budget = rep->budget, x->L = r->T, x->steps = steps, x->lab = o;
    r->ran = 1;
    s = b2_train(x, r->ranks, r);
    stopped = s == FL_OK ? x->res[0].stopped : 0;
    if (s == FL_OK) b2_measured(e, &shape, x, r);
    else if (s == FL_ERR_OOM && x->res[0].oom.valid) {
        memcpy(r->peak, x->res[0].oom.cur, sizeof r->peak);
        r->peak_total = x->res[0].oom.in_use;
        fl_lab_set_oom(r, &x->res[0].oom, "");
    } else {
        r->verdict = s == FL_ERR_UNSUPPORTED ? FL_LAB_NA : FL_LAB_ERROR;
        snprintf(r->note, sizeof r->note, "%s: %s", fl_status_name(s), fl_error_message());
    }
done:
    free(c);
    free(x);
    r->wall_s = now_s() - t0;
    return stopped;
}

void fl_lab_blip2_short(char *model) {
    static const char *const drop[] = {"blip2-", "flan-"};
    for (int k = 0; k < 2; k++) {
        char *p = strstr(model, drop[k]);
        if (p) memmove(p, p + strlen(drop[k]), strlen(p + strlen(drop[k])) + 1);
    }
}

/* ---- the suite ----------------------------------------------------------------------------------------------- */

fl_status fl_lab_blip2_run(const fl_lab_opts *o, FILE *out, fl_lab_report *rep) {
    if (o->peer && strcmp(o->peer, "pytorch"))
        return fl_errorf(FL_ERR_INVALID, "--peer: '%s' is not pytorch (the one peer modelled)", o->peer);
    rep->peer_pytorch = o->peer != NULL; /* each row at the real shapes (fl_lab_peer_pytorch_blip2) */
    if ((o->data && *o->data) || (o->tokenizer && *o->tokenizer) || (o->lengths && *o->lengths))
        return fl_errorf(FL_ERR_INVALID, "lab --data / --tokenizer / --lengths: the blip2 suite trains on synthetic "
                         "images and captions of the lab's 50 tokens");
    if (o->only && *o->only) { /* every name must exist */
        char buf[1024];
        snprintf(buf, sizeof buf, "%s", o->only);
        for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
            int known = 0;
            for (int i = 0; i < N_B2; i++) known |= !strcmp(k_b2[i].name, tok);
            if (!known) return fl_errorf(FL_ERR_INVALID, "--only: unknown experiment '%s' in suite blip2 (known: baseline, "
                                         "reduced-batch, grad-accum, bf16-true, bf16-mixed, larger-model, even-larger, "
                                         "sgd, act-ckpt, cpu-offload, lora, qlora, ddp, fsdp)", tok);
        }
    }
    FL_TRY(b2_scale(o->real_scale, rep));
    if (o->real_scale) rep->capacity = fl_backend_memory_capacity(fl_backend_default_name());
    if (o->budget) rep->budget = o->budget;
    const long steps = o->steps > 0 ? o->steps : 3;
    rep->rows = calloc(N_B2, sizeof *rep->rows);
    if (!rep->rows) return fl_errorf(FL_ERR_OOM, "out of host memory");
    char a[32];
    if (out) {
        char line[700];
        if (rep->real_scale)
            snprintf(line, sizeof line, "suite blip2 (the model column: BLIP-2 by its language model), real scale: blip2-opt-2.7b, blip2-opt-6.7b and blip2-flan-t5-xxl, "
                     "224x224 images, 32 queries, captions of %d tokens, budget %s per device (80 GB), %s", rep->T,
                     fl_fmt_bytes(rep->budget, a, sizeof a), o->plan_only ? "planned (--plan-only)" : "synthetic images");
        else
            snprintf(line, sizeof line, "suite blip2 (the model column: BLIP-2 by its language model): budget %s (80 GB x params(lab-%s)/params(%s) = 80 GB x %.5f), "
                     "every width and sequence / 16 (56x56 images: 16 patches, 2 queries, captions of %d tokens), "
                     "%ld steps per run on synthetic images and captions", fl_fmt_bytes(rep->budget, a, sizeof a),
                     B2_REF, B2_REF, rep->param_ratio, rep->T, steps);
        fl_lab_wrap(out, "fitllm lab, ", line, 120, 4);
        fflush(out);
    }
    const double t0 = now_s();
    for (int i = 0; i < N_B2; i++) {
        if (o->only && *o->only && !fl_lab_in_list(o->only, k_b2[i].name)) continue;
        if (fl_lab_stop_polled(o, rep)) break;
        fl_lab_row *r = &rep->rows[rep->n++];
        if ((rep->stopped = b2_row(&k_b2[i], rep, o, steps, r)) != 0) { /* in its training: its figures partial */
            rep->n--;
            break;
        }
        if (r->verdict == FL_LAB_ERROR) rep->n_errors++;
        if (out) FL_TRY(fl_lab_print_row(out, r, rep));
    }
    rep->wall_s = now_s() - t0;
    return FL_OK;
}

void fl_lab_blip2_md_scaling(FILE *f, const fl_lab_report *rep) {
    char a[32];
    if (rep->real_scale) {
        fprintf(f, "## Scale: real (`--scale real`, suite blip2)\n\n"
                   "Every row is the real BLIP-2 (blip2-opt-2.7b, blip2-opt-6.7b, blip2-flan-t5-xxl; random init): "
                   "224x224 images (256 patches), 32 queries, captions of %d tokens (the lab's cut), a budget of %s "
                   "per device (the lab's 80 GB GPU). %s The data-parallel rows need 4 devices (`mpirun -np 4`).\n\n",
                rep->T, fl_fmt_bytes(rep->budget, a, sizeof a), rep->plan_only
                ? "`--plan-only`: every verdict and figure is the row's plan (its fine-tuning's own set-up and step on "
                  "the null backend standing in for a GPU: plan = measured per tag)."
                : "Rows that fit trained on synthetic images and captions; the others are their plan's verdict.");
        return;
    }
    fprintf(f, "## How the BLIP-2 lab is scaled to this machine\n\n"
               "The course fine-tunes BLIP-2 (OPT-2.7B, OPT-6.7B, Flan-T5-XXL) on image captions on one 80 GB GPU. "
               "Here every model is its lab version: each part (vision tower, Q-Former, language model) with every "
               "width divided by 16 (hidden and MLP sizes, heads x head dim; the vocabulary 2000) and every depth "
               "kept, and every sequence divided by 16: 56x56 images (a 4x4 grid of 14-pixel patches instead of "
               "16x16), 2 queries instead of 32, captions of %d tokens instead of 50, so one sample's activations "
               "per parameter stay about the real ones.\n\n"
               "- **Budget** = 80 GB x params(lab-blip2-opt-2.7b) / params(blip2-opt-2.7b) = 80 GB x %.6f = **%s**.\n"
               "- Micro batches, accumulation, precisions, optimizers and the order of the experiments are the "
               "lab's; the vision tower is frozen (BLIP-2 fine-tuning's default: the Q-Former and the language model "
               "train).\n"
               "- Every row is planned first (its fine-tuning's own set-up and step on the null backend: plan = "
               "measured); a row the plan says is out of memory is not run. The others train on synthetic images "
               "and captions through `fl_blip2_train` with the budget as the device pool.\n"
               "- **Real-scale plan**: each row is also planned for the real model on an 80 GB GPU "
               "(`fitllm lab --suite blip2 --scale real --plan-only`, or `fitllm plan blip2-opt-2.7b ...`).\n\n",
            rep->T, rep->param_ratio, fl_fmt_bytes(rep->budget, a, sizeof a));
}

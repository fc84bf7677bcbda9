/* The memory lab: see include/fitllm/lab.h. This file holds the experiments,
 * the scaling and the runs; lab_report.c writes the table and the files. */
#define _XOPEN_SOURCE 700
#include <errno.h>
#include <ftw.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/fs.h"
#include "fitllm/backend.h"
#include "fitllm/comm.h"
#include "fitllm/cuda.h"
#include "fitllm/lab.h"
#include "fitllm/trainer.h"
#include "lab-impl.h"

/* ---- the experiments ------------------------------------------------------------
 * The lab's sequence (BRIEF section 5). The 3B-like model runs in bf16-true as
 * in the lab; the CPU computes in fp32 under every policy (bf16 in the matmuls'
 * weights, and in the storage of the activations saved for backward), and the
 * rest of the size ladder stays in 32-true: the 7B-like
 * model takes the role of the lab's 11-13B (out of memory even at batch 1 with
 * AdamW) and fits with SGD. Rows that need a technique this
 * build lacks are planned and shown as "not available". When a technique
 * lands: flip its entry in k_tech (src/plan/plan.c) and, for techniques with
 * no config key yet (LoRA, QLoRA, 8-bit Adam, offload, DDP, FSDP), set its key
 * in apply_row() below. */

#define SUITE_QUICK 1
#define SUITE_FULL 2
#define SUITE_CI 4
#define SUITE_FSDP 8 /* the batch-size sweep: its rows are generated (sweep_exp), not in k_exps */

static const lab_exp k_exps[] = {
    {"baseline", "full fine-tune, fp32, batch 32", "OOM", "tinyllama-1.1b", "lab-1b", 32, 32, 1, "32-true",
     FL_OPT_ADAMW, 0, "", FL_LAB_OOM, SUITE_QUICK | SUITE_FULL | SUITE_CI},
    {"reduced-batch", "micro batch 8", "fits, slower per sample", "tinyllama-1.1b", "lab-1b", 8, 8, 1, "32-true",
     FL_OPT_ADAMW, 0, "", FL_LAB_FITS, SUITE_QUICK | SUITE_FULL | SUITE_CI},
    {"grad-accum", "global 32 = micro 8 x accumulate 4", "about the memory of micro batch 8", "tinyllama-1.1b",
     "lab-1b", 8, 32, 1, "32-true", FL_OPT_ADAMW, 0, "", FL_LAB_FITS, SUITE_QUICK | SUITE_FULL | SUITE_CI},
    {"grad-accum-lr", "accumulate 4, LR x4 (effective batch)", "same memory; LR follows the batch", "tinyllama-1.1b",
     "lab-1b", 8, 32, 4, "32-true", FL_OPT_ADAMW, 0, "", FL_LAB_FITS, SUITE_QUICK | SUITE_FULL},
    {"bf16-true", "precision bf16-true", "much less memory, faster", "tinyllama-1.1b", "lab-1b", 8, 32, 1, "bf16-true",
     FL_OPT_ADAMW, 0, "bf16-true", FL_LAB_FITS, SUITE_QUICK | SUITE_FULL},
    {"bf16-mixed", "precision bf16-mixed", "between bf16-true and fp32", "tinyllama-1.1b", "lab-1b", 8, 32, 1,
     "bf16-mixed", FL_OPT_ADAMW, 0, "bf16-mixed", FL_LAB_FITS, SUITE_QUICK | SUITE_FULL},
    {"larger-model", "3B model in bf16-true", "memory grows with size", "open-llama-3b", "lab-3b", 2, 2, 1,
     "bf16-true", FL_OPT_ADAMW, 0, "bf16-true", FL_LAB_FITS, SUITE_QUICK | SUITE_FULL},
    {"even-larger", "7B model, micro batch 8 (lab: 11-13B)", "OOM", "open-llama-7b", "lab-7b", 8, 8, 1, "32-true",
     FL_OPT_ADAMW, 0, "", FL_LAB_OOM, SUITE_QUICK | SUITE_FULL},
    {"even-larger-b1", "7B model, batch 1", "OOM even at batch 1", "open-llama-7b", "lab-7b", 1, 1, 1, "32-true",
     FL_OPT_ADAMW, 0, "", FL_LAB_OOM, SUITE_QUICK | SUITE_FULL | SUITE_CI},
    {"sgd", "7B, batch 1, SGD (stateless)", "fits: Adam's states cost 2x the weights", "open-llama-7b", "lab-7b", 1, 1,
     10, "32-true", FL_OPT_SGD, 0, "", FL_LAB_FITS, SUITE_QUICK | SUITE_FULL | SUITE_CI},
    {"adam8bit", "7B, batch 1, 8-bit AdamW", "fits with a small batch", "open-llama-7b", "lab-7b", 1, 1, 1, "32-true",
     FL_OPT_ADAMW8BIT, 0, "adam8bit", FL_LAB_FITS, SUITE_QUICK | SUITE_FULL},
    {"act-ckpt", "activation checkpointing, batch 32", "activations shrink, slower", "tinyllama-1.1b", "lab-1b", 32, 32,
     1, "32-true", FL_OPT_ADAMW, 1, "activation_checkpointing", FL_LAB_FITS, SUITE_QUICK | SUITE_FULL},
    {"cpu-offload", "7B, ZeRO-2 offload, CPU Adam", "device optimizer memory ~0, slow", "open-llama-7b", "lab-7b", 1,
     1, 1, "32-true", FL_OPT_ADAMW, 0, "cpu_offload", FL_LAB_FITS, SUITE_QUICK | SUITE_FULL},
    {"lora", "7B, LoRA r16 alpha32 dropout0.05", "small grads/optim state, fits easily", "open-llama-7b", "lab-7b", 1,
     1, 1, "32-true", FL_OPT_ADAMW, 0, "lora", FL_LAB_FITS, SUITE_QUICK | SUITE_FULL},
    {"qlora", "7B, QLoRA (NF4 base, r16)", "smaller still, slower than LoRA", "open-llama-7b", "lab-7b", 1, 1, 1, "32-true",
     FL_OPT_ADAMW, 0, "qlora", FL_LAB_FITS, SUITE_QUICK | SUITE_FULL},
    {"ddp", "4x DDP", "same memory per device, faster", "tinyllama-1.1b", "lab-1b", 8, 32, 1, "32-true", FL_OPT_ADAMW,
     0, "ddp", FL_LAB_FITS, SUITE_QUICK | SUITE_FULL | SUITE_CI},
    {"fsdp", "4x FSDP", "memory per device about halves", "open-llama-7b", "lab-7b", 1, 4, 1, "32-true", FL_OPT_ADAMW,
     0, "fsdp", FL_LAB_FITS, SUITE_QUICK | SUITE_FULL | SUITE_CI},
    /* micro batch 0: the largest power of two the planner fits per rank (pick_batch) */
    {"fsdp-larger-batch", "4x FSDP, larger micro batch", "fits: the shards leave room for activations",
     "open-llama-7b", "lab-7b", 0, 0, 1, "32-true", FL_OPT_ADAMW, 0, "fsdp", FL_LAB_FITS, SUITE_QUICK | SUITE_FULL},
    /* issue 35: what each split of the 7B model that does not fit one device buys, per rank (4 sequences a step). In no
     * suite (run by name: --only tp-2,tp-4,pp-2,pp-4,dp2-tp2,tp2-pp2,tp2-sp): the suites are the course's rows, which has no such */
    {"tp-2", "7B, 2x tensor parallel", "fits: each rank holds half of every block", "open-llama-7b", "lab-7b", 1, 4, 1,
     "32-true", FL_OPT_ADAMW, 0, "tensor_parallel", FL_LAB_FITS, 0},
    {"tp-4", "7B, 4x tensor parallel", "a quarter of every block per rank", "open-llama-7b", "lab-7b", 1, 4, 1,
     "32-true", FL_OPT_ADAMW, 0, "tensor_parallel", FL_LAB_FITS, 0},
    {"pp-2", "7B, 2 pipeline stages (1F1B)", "fits: each rank holds half the blocks", "open-llama-7b", "lab-7b", 1, 4,
     1, "32-true", FL_OPT_ADAMW, 0, "pipeline_parallel", FL_LAB_FITS, 0},
    {"pp-4", "7B, 4 pipeline stages (1F1B)", "a quarter of the blocks per rank", "open-llama-7b", "lab-7b", 1, 4, 1,
     "32-true", FL_OPT_ADAMW, 0, "pipeline_parallel", FL_LAB_FITS, 0},
    {"dp2-tp2", "7B, 2x DDP of 2x tensor parallel", "TP 2's memory per rank, twice the samples", "open-llama-7b",
     "lab-7b", 1, 4, 1, "32-true", FL_OPT_ADAMW, 0, "tensor_parallel", FL_LAB_FITS, 0},
    {"tp2-pp2", "7B, 2x tensor parallel x 2 pipeline stages", "fits: half of every block of half the blocks per rank",
     "open-llama-7b", "lab-7b", 1, 4, 1, "32-true", FL_OPT_ADAMW, 0, "tensor_parallel", FL_LAB_FITS, 0},
    {"tp2-sp", "7B, 2x tensor parallel + sequence parallel", "fits: TP 2 less half its saved stream and statistics",
     "open-llama-7b", "lab-7b", 1, 4, 1, "32-true", FL_OPT_ADAMW, 0, "tensor_parallel", FL_LAB_FITS, 0},
};
#define N_EXPS (int)(sizeof k_exps / sizeof k_exps[0])

static const lab_exp *find_exp(const char *name) {
    for (int i = 0; i < N_EXPS; i++)
        if (!strcmp(k_exps[i].name, name)) return &k_exps[i];
    return NULL;
}

static int suite_bit(const char *s) {
    if (!s || !strcmp(s, "quick")) return SUITE_QUICK;
    if (!strcmp(s, "full")) return SUITE_FULL;
    if (!strcmp(s, "ci")) return SUITE_CI;
    if (!strcmp(s, "fsdp")) return SUITE_FSDP;
    return 0;
}

/* ---- the fsdp suite: the course's FSDP benchmark at its own settings -------------------------
 * 4 ranks FULL_SHARD on gpt2-xl (or the course's ~3 B gpt2-xxl), T 128 (scaled at lab scale), the
 * precisions 32-true and 16-mixed (the course's AMP), the course's micro batches 1 2 4 7 8 9 without
 * activation checkpointing and with it (then also 16 32 64, the course's checkpointed list), and on
 * by doubling (fitllm's activations are leaner than PyTorch's: the course's list alone would end
 * before fitllm's limit); each (precision, checkpointing) setting stops at the first batch the
 * planner says OOM (that row is a result). Names: b<B>, b<B>-ckpt (32-true), amp-b<B>,
 * amp-b<B>-ckpt (16-mixed). */
static const int k_sweep_b[] = {1, 2, 4, 7, 8, 9, 16, 32, 64, 128, 256, 512};
#define SWEEP_B_PLAIN 10 /* without checkpointing: up to 128 */
#define SWEEP_B_CKPT 12
#define SWEEP_N (2 * (SWEEP_B_PLAIN + SWEEP_B_CKPT)) /* both precisions */
#define REF_SWEEP_T 128
#define REF_SWEEP_DEVICE ((size_t)16 << 30) /* the course's V100 16 GB */

static const char *const k_sweep_prec[2] = {"32-true", "16-mixed"};

/* candidate i: its precision (0/1), checkpointing and micro batch, in run order */
static void sweep_cand(int i, int *prec, int *ck, int *B) {
    const int per = SWEEP_B_PLAIN + SWEEP_B_CKPT;
    *prec = i / per;
    int j = i % per;
    *ck = j >= SWEEP_B_PLAIN;
    *B = k_sweep_b[*ck ? j - SWEEP_B_PLAIN : j];
}

static const char *sweep_name(int i) {
    static char names[SWEEP_N][24];
    int prec, ck, B;
    sweep_cand(i, &prec, &ck, &B);
    snprintf(names[i], sizeof names[i], "%sb%d%s", prec ? "amp-" : "", B, ck ? "-ckpt" : "");
    return names[i];
}

static lab_exp sweep_exp(int i, const char *model, const char *lab_model) {
    int prec, ck, B;
    sweep_cand(i, &prec, &ck, &B);
    lab_exp e = {sweep_name(i), "4x FSDP FULL_SHARD", "the plan's verdict", model, lab_model, B, 4 * B, 1,
                 k_sweep_prec[prec], FL_OPT_ADAMW, ck, "fsdp", FL_LAB_FITS, SUITE_FSDP};
    return e;
}

const char *const *fl_lab_experiments(const char *suite) {
    static const char *names[3][N_EXPS + 1];
    static const char *sweep[SWEEP_N + 1];
    if (suite && !strcmp(suite, "blip2")) return fl_lab_blip2_names();
    int bit = suite_bit(suite), idx = bit == SUITE_QUICK ? 0 : bit == SUITE_FULL ? 1 : 2;
    if (!bit) return NULL;
    if (bit == SUITE_FSDP) {
        for (int i = 0; i < SWEEP_N; i++) sweep[i] = sweep_name(i);
        sweep[SWEEP_N] = NULL;
        return sweep;
    }
    int n = 0;
    for (int i = 0; i < N_EXPS; i++)
        if (k_exps[i].suites & bit) names[idx][n++] = k_exps[i].name;
    names[idx][n] = NULL;
    return names[idx];
}

const char *fl_lab_verdict_name(fl_lab_verdict v) {
    static const char *n[FL_LAB_VERDICT_COUNT] = {"fits", "OOM", "n/a", "error"};
    return (v >= 0 && v < FL_LAB_VERDICT_COUNT) ? n[v] : "?";
}

void fl_lab_opts_default(fl_lab_opts *o) {
    memset(o, 0, sizeof *o);
    o->suite = "quick";
}

/* ---- scaling ------------------------------------------------------------------------ */

#define REF_MODEL "tinyllama-1.1b"
/* LAB_MODEL, COURSE_MAX_SEQ_LENGTH: lab-impl.h */
#define REF_DEVICE ((size_t)80000000000ULL) /* 80 GB */
#define REF_T 1024

static double act_per_param(const fl_model_config *c, int T) {
    fl_act_sizes a;
    fl_sizing_acts(c, 1, T, &a);
    return (double)(a.acts_bytes + a.workspace_bytes) / (double)fl_sizing_param_count(c);
}

/* budget and T of lab_model as device and ref_T relate to ref_model (see fl_lab_scale) */
static fl_status scale_to(const char *ref_model, const char *lab_model, size_t device, int ref_T, fl_lab_report *rep) {
    fl_model_config ref, lab;
    FL_TRY(fl_preset_find(ref_model, &ref));
    FL_TRY(fl_preset_find(lab_model, &lab));
    rep->ref_device = device;
    rep->ref_T = ref_T;
    rep->param_ratio = (double)fl_sizing_param_count(&lab) / (double)fl_sizing_param_count(&ref);
    rep->budget = (size_t)llround((double)device * rep->param_ratio);
    rep->act_ratio_ref = act_per_param(&ref, ref_T);
    int best = 1;
    double bd = INFINITY;
    for (int T = 1; T <= ref_T; T++) {
        double d = fabs(act_per_param(&lab, T) - rep->act_ratio_ref);
        if (d < bd) { bd = d; best = T; }
    }
    rep->T = best;
    rep->act_ratio_lab = act_per_param(&lab, best);
    return FL_OK;
}

fl_status fl_lab_scale(fl_lab_report *rep) { return scale_to(REF_MODEL, LAB_MODEL, REF_DEVICE, REF_T, rep); }

fl_status fl_lab_scale_fsdp(const char *model, fl_lab_report *rep) {
    if (!model) model = "gpt2-xl";
    if (strcmp(model, "gpt2-xl") && strcmp(model, "gpt2-xxl"))
        return fl_errorf(FL_ERR_INVALID, "the fsdp suite's model '%s' is not gpt2-xl or gpt2-xxl", model);
    char lab[40];
    snprintf(lab, sizeof lab, "lab-%s", model);
    snprintf(rep->sweep_model, sizeof rep->sweep_model, "%s", model);
    return scale_to(model, lab, REF_SWEEP_DEVICE, REF_SWEEP_T, rep);
}

/* ---- one experiment ------------------------------------------------------------------- */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

typedef struct {
    long steps, want;
    double t[256];
    double last_loss;
    const fl_lab_opts *o; /* its stop callback */
    int stopped;          /* its value when it ended the row's training */
} step_log;

static int on_step(void *ud, long step, double loss, const void *p, size_t n) {
    (void)p; (void)n;
    step_log *l = ud;
    if (step - 1 < 256) l->t[step - 1] = now_s();
    l->steps = step;
    l->last_loss = loss;
    /* stop after the last step: no final checkpoint to write; or at the user's stop (the row dropped) */
    if (step >= l->want) return 1;
    if (l->o && l->o->stop && !l->stopped) l->stopped = l->o->stop(l->o->stop_ud);
    return l->stopped != 0;
}

/* The grid rows (techniques tensor_parallel, pipeline_parallel): their DP x TP x PP sizes */
static const struct { const char *name; int dp, tp, pp; } k_grid[] = {
    {"tp-2", 1, 2, 1}, {"tp-4", 1, 4, 1}, {"pp-2", 1, 1, 2}, {"pp-4", 1, 1, 4}, {"dp2-tp2", 2, 2, 1},
    {"tp2-pp2", 1, 2, 2}, {"tp2-sp", 1, 2, 1},
};
static const int *exp_grid(const lab_exp *e) { /* {dp, tp, pp}, NULL for another row */
    for (size_t i = 0; i < sizeof k_grid / sizeof k_grid[0]; i++)
        if (!strcmp(k_grid[i].name, e->name)) return &k_grid[i].dp;
    return NULL;
}
/* A row's data-parallel ranks ("4x DDP", "4x FSDP", a grid's DP) and all its ranks (DP x TP x PP) */
static int exp_data_ranks(const lab_exp *e) {
    const int *g = exp_grid(e);
    return g ? g[0] : !strcmp(e->technique, "ddp") || !strcmp(e->technique, "fsdp") ? 4 : 1;
}
static int exp_ranks(const lab_exp *e) {
    const int *g = exp_grid(e);
    return g ? g[0] * g[1] * g[2] : exp_data_ranks(e);
}

/* The model a row runs: its lab-* preset, or (--scale real) the real one. */
static const char *row_model(const lab_exp *e, const fl_lab_report *rep) {
    return rep->real_scale ? e->ref_model : e->lab_model;
}

/* The peak TFLOP/s for a row's MFU: 16-bit tensor cores for the 16-bit precisions, else fp32. */
static double row_peak(const fl_lab_report *rep, const char *precision) {
    return rep->peak_tflops[strcmp(precision, "32-true") != 0];
}

/* The config of a row: at lab scale (model, T) or at the real one. */
static void apply_row(fl_run_config *c, const lab_exp *e, const char *model, int T, long steps, size_t budget,
                      const char *out_dir, int threads, const fl_lab_report *rep) {
    const char *text_dir = rep->text_dir;
    const int no_prefetch = rep->no_prefetch;
    fl_cfg_defaults(c, FL_CMD_FINETUNE_FULL);
    snprintf(c->checkpoint_dir, sizeof c->checkpoint_dir, "%s", model);
    snprintf(c->out_dir, sizeof c->out_dir, "%s", out_dir);
    snprintf(c->precision, sizeof c->precision, "%s", e->precision);
    c->data.kind = FL_DATA_SYNTHETIC;
    if (text_dir && *text_dir) { /* samples of exactly T + 1 tokens of random letters (write_text_dir) */
        c->data.kind = FL_DATA_TEXTFILES;
        snprintf(c->data.train_data_path, sizeof c->data.train_data_path, "%s", text_dir);
    }
    c->data.synthetic_train = (int)(e->global * steps + 8);
    if (rep->lengths[0]) { /* one sample set for the whole comparison (the most any row reads): every row's longest
                            * draw, so its T, is the comparison's, not its own (grad-accum planned more than
                            * reduced-batch at the same micro batch: it drew 4x the samples) */
        int g = 0;
        for (int i = 0; i < N_EXPS; i++) g = k_exps[i].global > g ? k_exps[i].global : g;
        if ((long)g * steps + 8 > c->data.synthetic_train) c->data.synthetic_train = (int)((long)g * steps + 8);
    }
    c->data.synthetic_val = 2;
    c->train.global_batch_size = e->global;
    c->train.micro_batch_size = e->B;
    c->train.max_steps = (int)steps;
    /* the trainer's T is exactly T: TextFiles blocks of max_seq_length + 1 tokens (T inputs and the last one's target);
     * Synthetic records (below) are longer than T + 1 tokens and cut to it */
    c->train.max_seq_length = c->data.kind == FL_DATA_TEXTFILES ? T : T + 1;
    if (rep->lengths[0]) { /* real scale at the course's settings: Alpaca's lengths, cut to its max_seq_length */
        c->data.kind = FL_DATA_SYNTHETIC;
        snprintf(c->data.lengths, sizeof c->data.lengths, "%s", rep->lengths);
        c->train.max_seq_length = rep->max_seq_length;
    }
    if (rep->data[0]) { /* the course's own data (Alpaca2k's records, the recipe's split), cut as the recipe cuts */
        fl_data_config_default(&c->data, FL_DATA_ALPACA);
        snprintf(c->data.json_path, sizeof c->data.json_path, "%s", rep->data);
        c->data.val_split_fraction = 0.03847f;
        snprintf(c->tokenizer_dir, sizeof c->tokenizer_dir, "%s", rep->tokenizer);
        c->train.max_seq_length = strcmp(model, e->ref_model) ? T + 1 : COURSE_MAX_SEQ_LENGTH;
        c->train.epochs = -1; /* max_steps decides: small files are gone over again */
    }
    c->train.lr_warmup_steps = 0;
    c->train.save_interval = 0;
    c->train.activation_checkpointing = e->act_ckpt;
    c->eval.interval = 1 << 30;
    c->eval.max_new_tokens = 0;
    c->eval.final_validation = 0;
    c->eval.initial_validation = 0;
    fl_optim_config_default(&c->optimizer, e->optim);
    c->optimizer.lr = 1e-3f * e->lr_mult;
    c->max_memory = budget; /* per rank: each rank's pool is one device */
    c->threads = threads;
    int ranks = exp_ranks(e);
    if (ranks > 1) { /* data parallel: the global batch is micro batch x accumulation x ranks */
        c->devices = ranks;
        const int *g = exp_grid(e);
        if (g) c->tensor_parallel = g[1], c->pipeline_parallel = g[2];
        if (g) c->sequence_parallel = !strcmp(e->name, "tp2-sp"); /* Megatron's sequence parallelism over the group */
        else snprintf(c->strategy, sizeof c->strategy, "%s", e->technique); /* a grid's data axis: auto (DDP) */
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        int all = threads > 0 ? threads : (int)(cores > 0 ? cores : 1);
        c->threads = all / ranks > 0 ? all / ranks : 1; /* the ranks share the cores */
    }
    if (no_prefetch) snprintf(c->backward_prefetch, sizeof c->backward_prefetch, "off");
    c->overwrite = 1;
    c->seed = 1337;
    /* the lab's DeepSpeed ZeRO stage 2 offload: the optimizer state and its update on the host (one device) */
    if (!strcmp(e->technique, "cpu_offload")) snprintf(c->strategy, sizeof c->strategy, "deepspeed_stage_2_offload");
    if (!strcmp(e->technique, "lora") || !strcmp(e->technique, "qlora")) {
        /* the lab's LoRA: r 16, alpha 32, dropout 0.05 on query and value; QLoRA: the same on an NF4 base */
        c->command = FL_CMD_FINETUNE_LORA;
        c->lora.r = 16;
        c->lora.alpha = 32;
        c->lora.dropout = 0.05f;
        c->lora.query = c->lora.value = 1;
        if (!strcmp(e->technique, "qlora")) snprintf(c->lora.quantize, sizeof c->lora.quantize, "bnb.nf4");
    }
}

/* A capability of the backend the rows run on (the default one), from the registry's facts. */
static int backend_has(unsigned cap) {
    fl_backend_facts f;
    return fl_backend_facts_of(fl_backend_default_name(), &f) == FL_OK && (f.caps & cap) != 0;
}

static void plan_row(const fl_run_config *c, fl_plan *p, fl_plan_verdict *verdict, size_t *peak) {
    fl_plan_opts o;
    fl_plan_opts_default(&o);
    o.generation = 0;
    o.no_suggestions = 1;
    /* the rows run on the default backend: plan for the same one (its op scratch differs) */
    o.cuda = backend_has(FL_CAP_DEVICE_MEMORY);
    o.comm_threads = 1; /* several ranks run as threads (train_row) */
    if (fl_plan_run(c, &o, p) != FL_OK) { *verdict = FL_PLAN_VERDICT_COUNT; *peak = 0; return; }
    *verdict = p->verdict;
    *peak = p->peak_total;
}

/* Why a row's step costs more per sample than plain fp32 AdamW at a large micro batch:
 * the extra work its technique does on this CPU (the step-time chart compares ms per sample). */
static void time_note(const lab_exp *e, const fl_lab_report *rep, char *buf, size_t n) {
    const char *t = e->technique, *why = "";
    char small[48] = "";
    if (e->act_ckpt) why = "recomputes every block's forward but the last in backward";
    else if (!strcmp(t, "qlora")) why = "dequantizes 4-bit weights at every matmul";
    else if (!strcmp(t, "lora")) why = "adapter matmuls on top of the frozen base";
    else if (!strcmp(t, "adam8bit")) why = "(de)quantizes the 8-bit optimizer state block by block";
    else if (!strcmp(e->precision, "bf16-true") || !strcmp(e->precision, "bf16-mixed"))
        why = backend_has(FL_CAP_COMPUTE_BF16) ? "bf16 <-> fp32 conversions of the fp32 activations"
                                               : "bf16 <-> fp32 conversions (the CPU computes in fp32)";
    if (exp_ranks(e) > 1) why = "its ranks share this machine's cores";
    if (e->B < 8) snprintf(small, sizeof small, "micro batch %d (small matmuls)", e->B);
    const char *model = row_model(e, rep);
    int big = strcmp(model, rep->real_scale ? REF_MODEL : LAB_MODEL) != 0;
    snprintf(buf, n, "%s%s%s%s%s%s%s", big ? "larger model (" : "", big ? model : "", big ? ")" : "",
             big && (why[0] || small[0]) ? "; " : "", why, why[0] && small[0] ? "; " : "", small);
}

/* A data-parallel row's ranks, as threads of this process over the threads communicator (the
 * trainer is the one mpirun runs; each rank has its own pool with the row's budget). */
typedef struct {
    const fl_run_config *cfg;
    step_log log[4];
    fl_trainer_result res[4];
    fl_status st[4];
} ranks_run;

static fl_status rank_main(fl_comm *comm, int rank, void *ud) {
    ranks_run *x = ud;
    x->st[rank] = fl_trainer_run_comm(x->cfg, comm, NULL, 0, on_step, &x->log[rank], &x->res[rank]);
    return x->st[rank];
}

/* Train the row (one process, or its ranks as threads): rank 0's log and result, or those of the
 * rank whose own error ended the run (an OOM names that rank's allocation). */
static fl_status train_row(const fl_run_config *c, int ranks, step_log *log, fl_trainer_result *res, size_t *pmin,
                           size_t *pmax) {
    if (ranks <= 1) {
        fl_status s = fl_trainer_run(c, NULL, 0, on_step, log, res);
        *pmin = *pmax = res->peak_total;
        return s;
    }
    ranks_run *x = calloc(1, sizeof *x);
    if (!x) return fl_errorf(FL_ERR_OOM, "out of host memory");
    x->cfg = c;
    for (int r = 0; r < ranks; r++) x->log[r] = *log;
    fl_status s = fl_comm_threads_run(ranks, rank_main, x);
    int pick = 0;
    /* a rank out of memory makes its peers fail in their next collective (an IO error naming it):
     * the row's verdict is the OOM */
    for (int r = 0; r < ranks && s != FL_OK; r++)
        if (x->st[r] == FL_ERR_OOM) { s = FL_ERR_OOM; break; }
    for (int r = 0; r < ranks && s != FL_OK; r++)
        if (x->st[r] == s) { pick = r; break; }
    *log = x->log[pick];
    for (int r = 0; r < ranks; r++) /* the ranks stop together when any one's poll said so */
        if (x->log[r].stopped) log->stopped = x->log[r].stopped;
    *res = x->res[pick];
    for (int r = 0; r < ranks; r++) { /* the peak's range over the ranks */
        size_t pk = x->res[r].peak_total;
        if (!r || pk < *pmin) *pmin = pk;
        if (!r || pk > *pmax) *pmax = pk;
    }
    free(x);
    return s;
}

/* "FSDP with larger batch": the largest power-of-two micro batch (<= 64) the planner fits per rank
 * at lab scale, with the per-device budget (1 if none: the row then shows the OOM). */
static int pick_batch(const lab_exp *e, const fl_lab_report *rep, long steps, const char *out, int threads,
                      fl_run_config *c, fl_plan *p) {
    int best = 1;
    for (int B = 1; B <= 64; B *= 2) {
        lab_exp x = *e;
        x.B = B;
        x.global = B * exp_ranks(e);
        apply_row(c, &x, row_model(&x, rep), rep->T, steps, rep->budget, out, threads, rep);
        fl_plan_verdict v;
        size_t peak;
        plan_row(c, p, &v, &peak);
        if (v != FL_PLAN_FITS) break;
        best = B;
    }
    return best;
}

/* An OOM verdict, the run's or (suffix " (planned; not run)") its plan's: the allocation that failed. */
void fl_lab_set_oom(fl_lab_row *r, const fl_mem_oom *oom, const char *suffix) {
    char a[32], b[32];
    r->verdict = FL_LAB_OOM;
    r->oom = *oom;
    snprintf(r->note, sizeof r->note, "OOM during %s: %s %s requested, %s available%s", oom->phase,
             fl_mem_tag_name(oom->tag), fl_fmt_bytes(oom->requested, a, sizeof a),
             fl_fmt_bytes(oom->budget > oom->in_use ? oom->budget - oom->in_use : 0, b, sizeof b), suffix);
}

/* Drawn lengths: the mean input length (sample - 1) of the row's training samples, cut as the trainer cuts them. */
static double mean_input(const fl_lab_report *rep, const fl_run_config *c) {
    double sum = 0;
    int n = c->data.synthetic_train;
    for (int i = 0; i < n; i++) {
        int l = fl_lengths_draw(&rep->table, c->data.seed, 0, (uint64_t)i);
        sum += (c->train.max_seq_length > 0 && l > c->train.max_seq_length ? c->train.max_seq_length : l) - 1;
    }
    return n > 0 ? sum / n : 0;
}

/* At the real scale a row this machine cannot hold says so (1; the note says what it needs) instead of running. */
static int real_scale_refused(const lab_exp *e, const fl_lab_report *rep, fl_lab_row *r) {
    if (rep->real_scale && r->ranks > 1 && rep->sweep && rep->capacity < (size_t)r->ranks * rep->budget) {
        char a[32], b[32];
        r->verdict = FL_LAB_NA;
        snprintf(r->note, sizeof r->note, "at real scale the %d ranks of %s each need one device; the %s backend has %s "
                 "(%d ranks share a GPU of at least %d x the budget through the staged communicator; or mpirun -np %d)",
                 r->ranks, fl_fmt_bytes(rep->budget, a, sizeof a), fl_backend_default_name(),
                 fl_fmt_bytes(rep->capacity, b, sizeof b), r->ranks, r->ranks, r->ranks);
        return 1;
    }
    if (rep->real_scale && r->ranks > 1 && !rep->sweep) { /* one process cannot stand in for 4 devices of 80 GB */
        r->verdict = FL_LAB_NA;
        snprintf(r->note, sizeof r->note, "at real scale the %d ranks need %d devices (mpirun -np %d fitllm "
                 "finetune_full %s --devices %d ...); the lab's thread ranks would share this one", r->ranks, r->ranks,
                 r->ranks, e->ref_model, r->ranks);
        return 1;
    }
    if (rep->real_scale && !rep->sweep && rep->capacity < rep->budget) { /* the pool would grow past the machine: refuse, not crash */
        char a[32], b[32];
        r->verdict = FL_LAB_NA;
        snprintf(r->note, sizeof r->note, "at real scale this row needs the %s device: the %s backend has %s (%s); run "
                 "it on an 80 GB GPU (--accelerator cuda)", fl_fmt_bytes(rep->budget, a, sizeof a),
                 fl_backend_default_name(), fl_fmt_bytes(rep->capacity, b, sizeof b),
                 backend_has(FL_CAP_DEVICE_MEMORY) ? "GPU memory" : "the machine's RAM");
        return 1;
    }
    return 0;
}

/* A row that trained: its phases, step time, tokens/s, TFLOP/s and MFU from the log and the trainer's result. */
static void row_measured(const lab_exp *e, const fl_lab_report *rep, const char *model, const fl_run_config *c,
                         const step_log *log, const fl_trainer_result *res, fl_lab_row *r) {
    r->verdict = FL_LAB_FITS;
    r->n_phases = res->n_phases < FL_PLAN_MAX_PHASES ? res->n_phases : FL_PLAN_MAX_PHASES;
    memcpy(r->phases, res->phases, (size_t)r->n_phases * sizeof r->phases[0]);
    r->phases_planned = 0;
    r->steps = log->steps;
    r->final_loss = log->last_loss;
    if (log->steps >= 2) r->step_ms = 1e3 * (log->t[log->steps - 1] - log->t[0]) / (double)(log->steps - 1);
    else r->step_ms = 1e3 * res->train_seconds;
    /* several ranks: the global batch; drawn lengths: the samples' own tokens, no padding (their mean) */
    double Tm = rep->lengths[0] ? mean_input(rep, c) : rep->T;
    double tokens_per_step = (double)e->global * Tm;
    if (rep->data[0] && log->steps > 0) { /* the course's data: its samples' own tokens (every rank's) */
        tokens_per_step = (double)res->tokens_real / (double)log->steps;
        Tm = tokens_per_step / e->global;
    }
    r->tok_s = r->step_ms > 0 ? tokens_per_step / (r->step_ms / 1e3) : 0;
    fl_model_config mc; /* model FLOPs of the global batch (the MFU convention: no recompute) */
    if (r->step_ms > 0 && fl_preset_find(model, &mc) == FL_OK)
        r->tflops = fl_model_train_flops(&mc, e->B, (int)(Tm + 0.5)) * (double)e->global / e->B / (r->step_ms / 1e3) / 1e12;
    if (row_peak(rep, e->precision) > 0) r->mfu = r->tflops / row_peak(rep, e->precision);
    if (res->offload) { /* CPU offload: what the host tier took instead of the device */
        char a[32], b[32];
        snprintf(r->note, sizeof r->note, "host tier (outside the device budget): OPTIM %s, total %s",
                 fl_fmt_bytes(res->host_peak[FL_TAG_OPTIM], a, sizeof a), fl_fmt_bytes(res->host_peak_total, b, sizeof b));
    }
}

/* Returns o->stop's value when it ended the row's training (its figures partial), else 0 */
static int run_row(const lab_exp *e0, const fl_lab_report *rep, long steps, const char *run_dir,
                   const fl_lab_opts *o, fl_lab_row *r) {
    const int threads = o->threads, run_oom = o->run_oom;
    int stopped = 0;
    memset(r, 0, sizeof *r);
    lab_exp ex = *e0;
    const lab_exp *e = &ex;
    snprintf(r->name, sizeof r->name, "%s", e->name);
    snprintf(r->lab_step, sizeof r->lab_step, "%s", e->lab_step);
    snprintf(r->expect, sizeof r->expect, "%s", e->expect);
    const char *model = row_model(e, rep);
    snprintf(r->model, sizeof r->model, "%s", model);
    snprintf(r->ref_model, sizeof r->ref_model, "%s", e->ref_model);
    snprintf(r->precision, sizeof r->precision, "%s", e->precision);
    snprintf(r->optimizer, sizeof r->optimizer, "%s", fl_optim_name(e->optim));
    snprintf(r->technique, sizeof r->technique, "%s", e->technique);
    r->ranks = exp_ranks(e);
    r->T = rep->T;
    r->act_ckpt = e->act_ckpt;
    r->expected = e->expected;
    r->final_loss = NAN;
    double t0 = now_s();
    char out[FL_CFG_PATH];
    snprintf(out, sizeof out, "%s/%s", run_dir, e->name);
    fl_run_config *c = malloc(sizeof *c);
    fl_plan *p = malloc(sizeof *p);
    if (!c || !p) {
        r->verdict = FL_LAB_ERROR;
        snprintf(r->note, sizeof r->note, "out of host memory");
        goto done;
    }
    if (ex.B == 0) { /* the planner picks the micro batch */
        ex.B = pick_batch(e, rep, steps, out, threads, c, p);
        ex.global = ex.B * r->ranks;
        snprintf(r->lab_step, sizeof r->lab_step, "4x FSDP, micro batch %d (the largest the plan fits)", ex.B);
    }
    r->B = e->B;
    r->accum = e->global / (e->B * exp_data_ranks(e));
    if (!rep->sweep) time_note(e, rep, r->time_note, sizeof r->time_note); /* the sweep's rows compare by batch */
    /* the real scale: the real model, T 1024, an 80 GB device (--scale real: the run's own plan, below) */
    if (!rep->real_scale) {
        apply_row(c, e, e->ref_model, rep->ref_T, steps, rep->ref_device, out, threads, rep);
        plan_row(c, p, &r->ref_planned, &r->ref_peak);
        if (r->ref_planned == FL_PLAN_FITS || r->ref_planned == FL_PLAN_OOM) memcpy(r->ref_tag, p->peak, sizeof r->ref_tag);
        if (rep->peer_pytorch && r->ref_planned != FL_PLAN_VERDICT_COUNT) fl_lab_row_peer(e, r->ranks, p, r);
    }
    /* the scale the row runs at */
    apply_row(c, e, model, rep->T, steps, rep->budget, out, threads, rep);
    plan_row(c, p, &r->planned, &r->planned_peak);
    if (rep->lengths[0] && (r->planned == FL_PLAN_OOM || r->planned == FL_PLAN_FITS))
        r->T = p->T; /* drawn lengths: the trainer's T is the longest draw - 1, as the plan says */
    if (rep->real_scale) {
        r->ref_planned = r->planned;
        r->ref_peak = r->planned_peak;
        if (r->planned == FL_PLAN_FITS || r->planned == FL_PLAN_OOM) memcpy(r->ref_tag, p->peak, sizeof r->ref_tag);
        if (rep->peer_pytorch && r->planned != FL_PLAN_VERDICT_COUNT) fl_lab_row_peer(e, r->ranks, p, r);
        if (!rep->sweep && r->planned != FL_PLAN_VERDICT_COUNT) fl_lab_row_course_diff(e, p, r);
    }
    if (r->planned == FL_PLAN_OOM || r->planned == FL_PLAN_FITS) {
        memcpy(r->planned_tag, p->peak, sizeof r->planned_tag);
        r->n_phases = p->n_phases; /* replaced by the measured ones when the run fits */
        memcpy(r->phases, p->phases, sizeof r->phases);
        r->phases_planned = 1;
    }
    r->prefetch = !rep->no_prefetch;
    if (rep->plan_only && (r->planned == FL_PLAN_FITS || r->planned == FL_PLAN_OOM) &&
        (!e->technique[0] || fl_plan_technique_available(e->technique) == 1)) { /* --plan-only: the plan's verdict */
        if (r->planned == FL_PLAN_OOM) {
            memcpy(r->peak, p->oom.cur, sizeof r->peak);
            r->peak_total = r->peak_min = r->peak_max = p->oom.in_use;
            fl_lab_set_oom(r, &p->oom, " (planned; not run)");
        } else {
            r->verdict = FL_LAB_FITS;
            memcpy(r->peak, p->peak, sizeof r->peak);
            r->peak_total = r->peak_min = r->peak_max = r->planned_peak; /* the legend says planned */
        }
        goto done;
    }
    int avail = e->technique[0] ? fl_plan_technique_available(e->technique) : 1;
    if (avail != 1 || r->planned == FL_PLAN_UNAVAILABLE) {
        r->verdict = FL_LAB_NA;
        r->planned = r->ref_planned = FL_PLAN_UNAVAILABLE; /* the plan without the technique would mislead */
        r->planned_peak = r->ref_peak = 0;
        const fl_plan_technique *ts;
        int n;
        ts = fl_plan_techniques(&n);
        for (int i = 0; i < n; i++)
            if (!strcmp(ts[i].name, e->technique))
                snprintf(r->note, sizeof r->note, "%s not available in this build: %s", e->technique, ts[i].note);
        goto done;
    }
    if (r->planned == FL_PLAN_OOM && !run_oom) { /* the plan's verdict: no model memory touched, < 1 s (at the real
                                                  * scale too, whatever this machine holds: the budget decides it) */
        memcpy(r->peak, p->oom.cur, sizeof r->peak);
        r->peak_total = r->peak_min = r->peak_max = p->oom.in_use;
        fl_lab_set_oom(r, &p->oom, " (planned; not run)");
        goto done;
    }
    if (real_scale_refused(e, rep, r)) goto done;
    r->ran = 1;
    step_log log;
    memset(&log, 0, sizeof log);
    log.want = steps;
    log.o = o;
    fl_trainer_result res;
    memset(&res, 0, sizeof res);
    char why[200];
    fl_gpu_monitor *gpu = !strncmp(rep->gpu_note, "NVML,", 5) ? fl_gpu_monitor_start(100, why, sizeof why) : NULL;
    fl_status s = train_row(c, r->ranks, &log, &res, &r->peak_min, &r->peak_max);
    stopped = s == FL_OK ? log.stopped : 0;
    fl_lab_gpu_stop(gpu, r);
    memcpy(r->peak, res.peak, sizeof r->peak);
    r->peak_total = res.peak_total;
    if (s == FL_OK) {
        row_measured(e, rep, model, c, &log, &res, r);
    } else if (s == FL_ERR_OOM) {
        fl_lab_set_oom(r, &res.oom, "");
    } else if (s == FL_ERR_UNSUPPORTED) {
        r->verdict = FL_LAB_NA;
        snprintf(r->note, sizeof r->note, "%s", fl_error_message());
    } else {
        r->verdict = FL_LAB_ERROR;
        snprintf(r->note, sizeof r->note, "%s: %s", fl_status_name(s), fl_error_message());
    }
done:
    free(c);
    free(p);
    r->wall_s = now_s() - t0;
    return stopped;
}

/* ---- the suite ------------------------------------------------------------------------ */

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st; (void)flag; (void)ftw;
    return remove(path);
}

int fl_lab_in_list(const char *list, const char *name) {
    size_t n = strlen(name);
    for (const char *p = list; *p;) {
        const char *q = strchr(p, ',');
        size_t len = q ? (size_t)(q - p) : strlen(p);
        if (len == n && !strncmp(p, name, n)) return 1;
        if (!q) break;
        p = q + 1;
    }
    return 0;
}

/* The device's peak TFLOP/s for MFU: --peak-tflops, else a known GPU's by its name (dense, SXM: 16-bit tensor
 * cores for 16-bit rows, the fp32 units for 32-true), else none (a CPU). */
static void device_peak(const fl_lab_opts *o, fl_lab_report *rep) {
    static const struct { const char *name; double t16, t32; } k_gpus[] = {
        {"H200", 989.4, 66.9}, {"H100", 989.4, 66.9}, {"A100", 312.0, 19.5}, {"V100", 125.0, 15.7}};
    if (o->peak_tflops > 0) {
        rep->peak_tflops[0] = rep->peak_tflops[1] = o->peak_tflops;
        snprintf(rep->peak_source, sizeof rep->peak_source, "--peak-tflops %g", o->peak_tflops);
        return;
    }
    fl_backend_facts f;
    char d[256] = "";
    if (fl_backend_facts_of(fl_backend_default_name(), &f) != FL_OK || !f.describe) return;
    f.describe(d, sizeof d);
    for (size_t i = 0; i < sizeof k_gpus / sizeof k_gpus[0]; i++)
        if (strstr(d, k_gpus[i].name)) {
            rep->peak_tflops[0] = k_gpus[i].t32, rep->peak_tflops[1] = k_gpus[i].t16;
            snprintf(rep->peak_source, sizeof rep->peak_source, "%s: %g (16-bit) / %g (fp32) TFLOP/s", k_gpus[i].name,
                     k_gpus[i].t16, k_gpus[i].t32);
            return;
        }
}

/* The fsdp suite's settings: model, precisions (bits of k_sweep_prec), scale. */
static fl_status sweep_setup(const fl_lab_opts *o, fl_lab_report *rep, int *precs) {
    FL_TRY(fl_lab_scale_fsdp(o->model, rep));
    *precs = 0;
    char buf[128];
    snprintf(buf, sizeof buf, "%s", o->precisions && *o->precisions ? o->precisions : "32-true,16-mixed");
    for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
        int k = !strcmp(t, k_sweep_prec[0]) ? 0 : !strcmp(t, k_sweep_prec[1]) ? 1 : -1;
        if (k < 0) return fl_errorf(FL_ERR_INVALID, "the fsdp suite's precision '%s' is not 32-true or 16-mixed", t);
        *precs |= 1 << k;
    }
    if (o->seq_len > 0) rep->T = o->seq_len;
    if (o->real_scale) { /* the course's device and T: 4 ranks of 16 GiB, here on one device or under mpirun */
        rep->T = rep->ref_T;
        rep->budget = rep->ref_device;
        rep->param_ratio = 1.0;
        rep->act_ratio_lab = rep->act_ratio_ref;
    }
    return FL_OK;
}

/* The suite's banner, wrapped at 120 columns: its scale, data and budget. */
static void banner(const fl_lab_opts *o, const fl_lab_report *rep, long steps, FILE *out) {
    char a[32];
    char line[900];
    if (rep->sweep)
        snprintf(line, sizeof line, "suite fsdp: %s%s, 4 ranks FULL_SHARD, T = %d, budget %s per rank (%s), "
                 "backward prefetch %s, %ld steps per run", rep->real_scale ? "" : "lab-", rep->sweep_model, rep->T,
                 fl_fmt_bytes(rep->budget, a, sizeof a), rep->real_scale ? "the course's 16 GB V100"
                 : "16 GiB scaled as the lab's model to the real one", rep->no_prefetch ? "off" : "on", steps);
    else if (rep->data[0])
        snprintf(line, sizeof line, "suite %s, %s scale: the rows fine-tune on %.300s (tokenizer: %.300s), each sample cut "
                 "to max_seq_length %d, no packing, each micro batch padded to its longest sample; budget %s per "
                 "device, %ld steps per run", rep->suite, rep->real_scale ? "real" : "lab", rep->data,
                 rep->tokenizer[0] ? rep->tokenizer : "the built-in bytes",
                 rep->real_scale ? COURSE_MAX_SEQ_LENGTH : rep->T + 1, fl_fmt_bytes(rep->budget, a, sizeof a), steps);
    else if (rep->real_scale && rep->lengths[0])
        snprintf(line, sizeof line, "suite %s, real scale: %s, open-llama-3b and open-llama-7b; sample lengths "
                 "drawn from %s (median %d, p95 %d, max %d tokens), cut to max_seq_length %d, no packing, each "
                 "micro batch padded to its longest (T = the longest sample - 1, one sample set for every row, so one T); budget %s per device (80 "
                 "GB), %ld steps per run", rep->suite, REF_MODEL, rep->lengths, fl_lengths_at(&rep->table, 0.5),
                 fl_lengths_at(&rep->table, 0.95), rep->table.len[rep->table.n - 1], rep->max_seq_length,
                 fl_fmt_bytes(rep->budget, a, sizeof a), steps);
    else if (rep->real_scale)
        snprintf(line, sizeof line, "suite %s, real scale: %s, open-llama-3b and open-llama-7b at T = %d (every "
                 "sample %d tokens: %s), budget %s per device (80 GB), %ld steps per run", rep->suite, REF_MODEL,
                 rep->T, rep->T + 1, o->lengths && !strcmp(o->lengths, "fixed") ? "--lengths fixed"
                 : "recipes/data/alpaca-lengths.tsv not found; give --lengths", fl_fmt_bytes(rep->budget, a, sizeof a), steps);
    else
        snprintf(line, sizeof line, "suite %s: budget %s (80 GB x params(%s)/params(%s) = 80 GB x %.5f), T = %d "
                 "(activations per parameter of one sample as %s at T = %d), samples of T + 1 random letters (--data: "
                 "the course's), %ld steps per run", rep->suite,
                 fl_fmt_bytes(rep->budget, a, sizeof a), LAB_MODEL, REF_MODEL, rep->param_ratio, rep->T, REF_MODEL,
                 REF_T, steps);
    fl_lab_wrap(out, "fitllm lab, ", line, 120, 4);
    fflush(out);
}

/* fl_lab_run's data, rows and plans, its runs' out_dirs under run_dir */
static fl_status lab_rows(const fl_lab_opts *o, FILE *out, fl_lab_report *rep, int bit, int precs, long steps,
                          const char *run_dir) {
    if (!rep->sweep) FL_TRY(fl_lab_course_data(o, rep));
    else if ((o->data && *o->data) || (o->tokenizer && *o->tokenizer))
        return fl_errorf(FL_ERR_INVALID, "lab --data / --tokenizer: the quick and full suites' rows fine-tune on the "
                         "course's data; the fsdp suite's benchmark runs fixed lengths");
    if (rep->real_scale && !rep->sweep && !rep->data[0]) FL_TRY(fl_lab_real_lengths(o, rep));
    /* no course data and no drawn lengths: blocks of T + 1 tokens of random letters (TextFiles), every token a target
     * and every sample its own; Synthetic's instruction records cut to T + 1 tokens kept only their Alpaca template
     * at the lab scale's T (62): every row trained on one text, the loss column and DDP = accumulation meant nothing */
    if (!rep->lengths[0] && !rep->data[0]) {
        int max_global = 1;
        for (int i = 0; i < N_EXPS; i++) max_global = k_exps[i].global > max_global ? k_exps[i].global : max_global;
        if (rep->sweep) max_global = 4 * k_sweep_b[SWEEP_B_CKPT - 1];
        snprintf(rep->text_dir, sizeof rep->text_dir, "%s/real-scale-text", run_dir);
        FL_TRY(fl_error_prefix(fl_lab_write_text_dir(rep->text_dir, rep->T, steps, max_global), "lab: its data"));
    }
    rep->rows = calloc(N_EXPS > SWEEP_N ? N_EXPS : SWEEP_N, sizeof *rep->rows);
    if (!rep->rows) return fl_errorf(FL_ERR_OOM, "out of host memory");
    if (out) banner(o, rep, steps, out);
    double t0 = now_s();
    int n_cand = bit == SUITE_FSDP ? SWEEP_N : N_EXPS, stopped = 0, group = -1;
    char lab_model[40];
    snprintf(lab_model, sizeof lab_model, "lab-%s", rep->sweep_model);
    for (int i = 0; i < n_cand; i++) {
        lab_exp sx;
        const lab_exp *e = &k_exps[i < N_EXPS ? i : 0];
        if (bit == SUITE_FSDP) {
            int prec, ck, B;
            sweep_cand(i, &prec, &ck, &B);
            if (!(precs & (1 << prec))) continue;
            if (group != 2 * prec + ck) stopped = 0, group = 2 * prec + ck; /* each setting starts at batch 1 */
            sx = sweep_exp(i, rep->sweep_model, lab_model);
            e = &sx;
            if (o->only && *o->only ? !fl_lab_in_list(o->only, e->name) : stopped) continue;
        } else if (o->only && *o->only ? !fl_lab_in_list(o->only, e->name) : !(e->suites & bit)) continue;
        if (fl_lab_stop_polled(o, rep)) break;
        fl_lab_row *r = &rep->rows[rep->n++];
        if ((rep->stopped = run_row(e, rep, steps, run_dir, o, r)) != 0) { /* in its training: its figures partial */
            rep->n--;
            break;
        }
        if (bit == SUITE_FSDP) { /* "as in the lab": the course's verdict where its table has the row */
            fl_lab_sweep_course_verdict(rep, r);
            snprintf(r->lab_step, sizeof r->lab_step, "%s 4x FSDP, %s, micro batch %d, act ckpt %s",
                     rep->sweep_model, r->precision, r->B, r->act_ckpt ? "on" : "off");
            if (r->planned != FL_PLAN_FITS) stopped = 1;
        }
        if (r->verdict == FL_LAB_ERROR) rep->n_errors++;
        if (out) FL_TRY(fl_lab_print_row(out, r, rep));
    }
    if (rep->stopped) return FL_OK;
    /* the largest micro batch that fits, per precision and checkpointing setting */
    for (int g = 0; g < 4; g++) {
        int best = -1;
        for (int i = 0; i < rep->n; i++) {
            const fl_lab_row *r = &rep->rows[i];
            if (rep->sweep && r->act_ckpt == (g & 1) && !strcmp(r->precision, k_sweep_prec[g >> 1]) &&
                r->verdict == FL_LAB_FITS && (best < 0 || r->B > rep->rows[best].B))
                best = i;
        }
        if (best >= 0) rep->rows[best].largest = 1;
    }
    if (!rep->sweep) fl_lab_time_notes_settle(rep);
    if (bit == SUITE_QUICK || bit == SUITE_FULL) FL_TRY(fl_lab_course_plans(rep)); /* plans only: < 2 s */
    rep->wall_s = now_s() - t0;
    return FL_OK;
}

fl_status fl_lab_run(const fl_lab_opts *o, FILE *out, fl_lab_report *rep) {
    memset(rep, 0, sizeof *rep);
    int bit = suite_bit(o->suite);
    if (o->suite && !strcmp(o->suite, "blip2")) { /* lab_blip2.c */
        snprintf(rep->suite, sizeof rep->suite, "blip2");
        rep->plan_only = o->plan_only;
        rep->real_scale = o->real_scale;
        snprintf(rep->gpu_note, sizeof rep->gpu_note, "not sampled in the blip2 suite");
        return fl_lab_blip2_run(o, out, rep);
    }
    if (!bit) return fl_errorf(FL_ERR_INVALID, "unknown suite '%s' (quick, full, ci, fsdp, blip2)", o->suite);
    if (o->only && *o->only) { /* every name must exist */
        char buf[1024];
        snprintf(buf, sizeof buf, "%s", o->only);
        const char *const *sw = fl_lab_experiments("fsdp");
        for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
            int known = 0;
            if (bit == SUITE_FSDP) {
                for (int i = 0; sw[i]; i++) known |= !strcmp(sw[i], tok);
            } else known = find_exp(tok) != NULL;
            if (!known) {
                char names[1024];
                size_t off = 0;
                for (int i = 0; bit == SUITE_FSDP ? sw[i] != NULL : i < N_EXPS; i++)
                    if (off < sizeof names)
                        off += (size_t)snprintf(names + off, sizeof names - off, "%s%s", i ? ", " : "",
                                                bit == SUITE_FSDP ? sw[i] : k_exps[i].name);
                return fl_errorf(FL_ERR_INVALID, "--only: unknown experiment '%s' in suite %s (known: %s)", tok,
                                 o->suite, names);
            }
        }
    }
    if (o->peer && strcmp(o->peer, "pytorch"))
        return fl_errorf(FL_ERR_INVALID, "--peer: '%s' is not pytorch (the one peer modelled)", o->peer);
    snprintf(rep->suite, sizeof rep->suite, "%s", o->suite ? o->suite : "quick");
    rep->peer_pytorch = o->peer != NULL; /* the rows' and the course's runs carry PyTorch's allocation */
    rep->plan_only = o->plan_only;
    int precs = 0;
    rep->no_prefetch = bit == SUITE_FSDP && o->no_backward_prefetch;
    if (bit == SUITE_FSDP) FL_TRY(sweep_setup(o, rep, &precs));
    else FL_TRY(fl_lab_scale(rep));
    device_peak(o, rep);
    if (backend_has(FL_CAP_DEVICE_MEMORY)) { /* GPU utilization: NVML when the driver's library is there */
        char why[160];
        if (fl_gpu_monitor_probe(why, sizeof why))
            snprintf(rep->gpu_note, sizeof rep->gpu_note, "NVML, device 0, every 100 ms while each row trains");
        else snprintf(rep->gpu_note, sizeof rep->gpu_note, "not sampled: %s", why);
    } else
        snprintf(rep->gpu_note, sizeof rep->gpu_note, "not sampled: the %s backend runs on the CPU (no GPU)",
                 fl_backend_default_name());
    if (o->real_scale) {
        rep->real_scale = 1;
        rep->capacity = fl_backend_memory_capacity(fl_backend_default_name());
    }
    if (o->real_scale && bit != SUITE_FSDP) {
        rep->T = rep->ref_T;
        rep->budget = rep->ref_device;
        rep->param_ratio = 1.0;
        rep->act_ratio_lab = rep->act_ratio_ref;
    }
    if (o->budget) rep->budget = o->budget;
    long steps = o->steps > 0 ? o->steps : bit == SUITE_FULL ? 20 : bit == SUITE_CI ? 2 : bit == SUITE_FSDP ? 2 : 4;
    rep->sweep = bit == SUITE_FSDP;
    rep->threads = o->threads;
    char tmp[FL_CFG_PATH];
    const char *run_dir = o->run_dir;
    if (!run_dir) {
        snprintf(tmp, sizeof tmp, "%s/fitllm-lab-XXXXXX", fl_fs_tmpdir());
        if (!mkdtemp(tmp))
            return fl_errorf(FL_ERR_IO, "cannot create a temporary folder for the runs under %s (TMPDIR): %s",
                             fl_fs_tmpdir(), strerror(errno));
        run_dir = tmp;
    }
    const fl_status st = lab_rows(o, out, rep, bit, precs, steps, run_dir);
    if (!o->run_dir) nftw(tmp, rm_entry, 16, FTW_DEPTH | FTW_PHYS); /* on an error too (the real scale's text) */
    return st;
}

void fl_lab_report_free(fl_lab_report *rep) {
    free(rep->rows);
    rep->rows = NULL;
    rep->n = 0;
}

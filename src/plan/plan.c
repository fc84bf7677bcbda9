/* The memory planner: see include/fitllm/plan.h.
 *
 * One process (devices x num_nodes = 1): the plan RUNS the trainer's own set-up and first
 * step (fl_trainer_rehearse: model load, gradients or adapters, optimizer state, activations,
 * step buffers, forward, backward, update, the evaluation sample) on the null backend, whose
 * ops do nothing and whose pool hands out fake addresses: the phases, peaks, per-tag bytes and
 * the first failing allocation under a budget are the runtime's by construction. A technique
 * that lands in the runtime is planned with no change here but its row in k_tech.
 *
 * Several ranks (DDP, ZeRO-1/2, FSDP FULL_SHARD, HYBRID_SHARD) are planned the same way: every
 * rank's set-up and first step run as threads over the threads communicator
 * (fl_trainer_rehearse_comm), each on its own null backend, whose device communicator moves no
 * bytes and takes the planned run's collective scratch (MPI's receive buffers for CPU ranks over
 * mpirun; none for thread ranks or NCCL). The rank planned alone has the budget, so a verdict is its
 * own. There is no hand-kept replay left: tests/test_zero.c, tests/test_fsdp.c and the MPI tests
 * compare these plans with the runs' measured pools. */
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/fs.h"
#include "fitllm/comm.h"
#include "fitllm/data.h"
#include "fitllm/generate.h"
#include "fitllm/io.h"
#include "fitllm/plan.h"
#include "plan-impl.h"
#include "fitllm/pp.h"
#include "fitllm/lengths.h"
#include "backend/cuda/cuda-impl.h"
#include "fitllm/trainer.h"
#include "fitllm/lora.h"
#include "fitllm/tokenizer.h"
#include "fitllm/train.h"

/* ---- techniques ------------------------------------------------------------------ */

static const fl_plan_technique k_tech[] = {
    {"micro_batch", 1, "--train.micro_batch_size B (accumulation = global_batch_size / B)", ""},
    {"max_seq_length", 1, "--train.max_seq_length T (longer samples are truncated)", ""},
    {"sgd", 1, "--optimizer SGD (no state without momentum; one buffer with)", ""},
    {"bf16-true", 1, "--precision bf16-true", "bf16 parameters, gradients and AdamW state (2+2+4 bytes per parameter)"},
    {"bf16-mixed", 1, "--precision bf16-mixed", "fp32 master weights + a bf16 copy the matmuls read"},
    {"16-mixed", 1, "--precision 16-mixed", "fp32 master weights + an fp16 copy the matmuls read, dynamic loss scaling"},
    {"activation_checkpointing", 1, "--train.activation_checkpointing true", "keep block inputs, recompute blocks in backward"},
    {"adam8bit", 1, "--optimizer bnb.optim.AdamW8bit", "bitsandbytes' block-wise 8-bit AdamW state"},
    {"lora", 1, "fitllm finetune_lora", "adapters only: the base needs no gradients or optimizer state"},
    {"qlora", 1, "fitllm finetune_lora --quantize bnb.nf4-dq", "LoRA on bitsandbytes NF4/FP4 4-bit base weights"},
    {"cpu_offload", 1, "--strategy deepspeed_stage_2_offload", "ZeRO-Offload: the optimizer state in host memory, the update on the host's cores"},
    {"nvme_offload", 1, "--strategy deepspeed_stage_2_offload --offload_optimizer_device nvme --nvme_path DIR",
     "ZeRO-Infinity's: the optimizer state in files on a disk (a CPU run's offload: its host tier is its device's RAM)"},
    {"param_offload", 1, "--strategy deepspeed_stage_3_offload --offload_param_device cpu",
     "ZeRO-3 with the parameters' and gradients' shards in host memory (or NVMe files), each unit fetched ahead of its use"},
    {"ddp", 1, "mpirun -np N fitllm ... --devices N (--strategy ddp)", "each rank holds everything; the lab runs its ranks as threads of one process"},
    {"fsdp", 1, "mpirun -np N fitllm ... --devices N --strategy fsdp", "FULL_SHARD / ZeRO-3: parameters, gradients and optimizer state divided by the ranks, units gathered block by block"},
    {"tensor_parallel", 1, "mpirun -np N fitllm ... --devices N --tensor_parallel N", "Megatron-style: heads, MLP columns and the vocabulary split over the group; the lab runs its ranks as threads"},
    {"pipeline_parallel", 1, "mpirun -np N fitllm ... --devices N --pipeline_parallel N", "contiguous block ranges per stage, micro-batches through the stages (GPipe / 1F1B)"},
};
#define N_TECH (int)(sizeof k_tech / sizeof k_tech[0])

const fl_plan_technique *fl_plan_techniques(int *n) {
    *n = N_TECH;
    return k_tech;
}

static const fl_plan_technique *tech(const char *name) {
    for (int i = 0; i < N_TECH; i++)
        if (!strcmp(k_tech[i].name, name)) return &k_tech[i];
    return NULL;
}

int fl_plan_technique_available(const char *name) {
    const fl_plan_technique *t = tech(name);
    return t ? t->available : -1;
}

const char *fl_plan_verdict_name(fl_plan_verdict v) {
    static const char *n[FL_PLAN_VERDICT_COUNT] = {"fits", "oom", "not_available"};
    return (v >= 0 && v < FL_PLAN_VERDICT_COUNT) ? n[v] : "?";
}

void fl_plan_opts_default(fl_plan_opts *o) {
    memset(o, 0, sizeof *o);
    o->devices = 1;
    o->generation = -1;
    o->rank = 0;
}

/* What the config asks for that this build lacks ("" if nothing). */
static int config_unavailable(const fl_run_config *c, char *msg, size_t n) {
    const char *need = NULL;
    fl_precision pr;
    if (fl_precision_find(c->precision, &pr) == FL_OK && !pr.available) need = c->precision;
    if (!need) return 0;
    const fl_plan_technique *t = tech(need);
    if (t && t->available) return 0;
    snprintf(msg, n, "%s is not available in this build%s%s", need, t ? ": " : "", t ? t->note : "");
    return 1;
}

/* ---- resolving the model and the run's shapes --------------------------------------- */

/* The model the trainer would build (load_model_and_tokenizer), without weights. */
static fl_status resolve_model(const fl_run_config *c, fl_model_config *mc, char *src, size_t n) {
    const char *ck = c->checkpoint_dir;
    int have = 0;
    if (c->command == FL_CMD_PRETRAIN) FL_TRY(fl_cfg_model_config(c, mc, &have));
    if (have) {
        snprintf(src, n, "%s", c->n_model_fields ? "model_config" : c->model_config[0] ? "config.json" : "preset");
    } else if (!ck[0]) {
        return fl_errorf(FL_ERR_INVALID, "no model: give checkpoint_dir (a model folder or a preset name)");
    } else if (!fl_fs_is_dir(ck) && !fl_fs_is_file(ck)) {
        if (fl_fs_is_path_form(ck)) return fl_errorf(FL_ERR_NOT_FOUND, "checkpoint_dir '%s': no such file or folder", ck);
        fl_status s = fl_preset_find(ck, mc);
        if (s != FL_OK) {
            char why[1024]; /* fl_errorf must not read the message it is writing */
            snprintf(why, sizeof why, "%s", fl_error_message());
            return fl_errorf(FL_ERR_NOT_FOUND, "checkpoint_dir '%s' is neither a model folder nor a preset (%s)", ck,
                             why);
        }
        snprintf(src, n, "preset");
    } else {
        char path[FL_CFG_PATH + 16];
        size_t len = strlen(ck);
        if (fl_fs_is_dir(ck)) snprintf(path, sizeof path, "%s/config.json", ck);
        else if (len > 5 && !strcmp(ck + len - 5, ".json")) snprintf(path, sizeof path, "%s", ck);
        else
            return fl_errorf(FL_ERR_UNSUPPORTED,
                             "plan: '%s': give a Hugging Face model folder, its config.json or a preset name "
                             "(llama2.c .bin files are not planned)", ck);
        FL_TRY(fl_hf_load_config(path, mc));
        snprintf(src, n, "config.json");
    }
    return fl_config_validate(mc);
}

/* Must match generate_example() in src/train/trainer.c (a test compares the
 * planned and measured peaks with generation on, so drift shows). */
static const char *k_gen_instruction =
    "Recommend a movie for me to watch during the weekend and explain the reason.";

static fl_status gen_prompt_tokens(const fl_run_config *c, int *n_out) {
    if (c->command == FL_CMD_PRETRAIN) { /* a validation text's prefix: at most this many (the plan reads no data) */
        *n_out = FL_PRETRAIN_PROMPT_TOKENS;
        return FL_OK;
    }
    const char *td = c->tokenizer_dir[0] ? c->tokenizer_dir : NULL;
    if (!td && c->checkpoint_dir[0] && fl_fs_is_dir(c->checkpoint_dir)) td = c->checkpoint_dir;
    fl_tokenizer *tok = NULL;
    char *prompt = NULL;
    int32_t *ids = NULL;
    size_t n = 0;
    fl_status s = td ? fl_tok_load(&tok, td) : fl_tok_builtin_bytes(&tok);
    if (s == FL_OK)
        s = fl_data_format_prompt(c->data.prompt_style[0] ? c->data.prompt_style : "alpaca", k_gen_instruction, "",
                                  &prompt);
    if (s == FL_OK) s = fl_tok_encode(tok, prompt, strlen(prompt), -1, 0, &ids, &n);
    *n_out = (int)n;
    free(ids);
    free(prompt);
    fl_tok_free(tok);
    return s;
}

static int has_val_split(const fl_run_config *c) {
    switch (c->data.kind) {
    case FL_DATA_SYNTHETIC: return c->data.synthetic_val > 0;
    case FL_DATA_TEXTFILES: return 1; /* the first train file becomes val when no val folder is given */
    default: return c->data.val_split_fraction > 0 || fl_fs_is_dir(c->data.json_path);
    }
}

typedef struct {
    fl_model_config mc;
    fl_status *err;      /* where a run that failed for another reason than memory says so (may be NULL) */
    int T;
    int Ts;              /* an encoder-decoder: source rows (T: the target's); 0 otherwise */
    int gen;             /* sample generation at evaluation */
    int n_prompt, cap;   /* its prompt tokens and KV capacity */
    int rank;            /* the rank planned (ZeRO: ranks differ by their chunk) */
    int cuda;            /* plan for the CUDA backend's scratch and widening */
    int comm_threads;    /* the ranks are threads (fl_plan_opts.comm_threads): no reduction scratch */
    size_t *rank_peaks, *rank_host_peaks; /* fl_plan_opts': every rank's peaks of the run without a budget */
} plan_ctx;

/* The snapshot an allocation that fails before snapshot i precedes (one process; several ranks
 * snapshot after_reduce between after_bwd and after_opt_step) */
static const char *k_steps[] = {"after_load", "before_fwd", "after_fwd", "after_bwd", "after_opt_step",
                                "eval_generate"};
static const char *k_steps_dp[] = {"after_load", "before_fwd", "after_fwd", "after_bwd", "after_reduce",
                                   "after_opt_step", "eval_generate"};

/* The plan's verdict from a rehearsal's status s and record r (s's message is this thread's). */
static int rehearsal_result(const plan_ctx *x, fl_status s, const fl_trainer_result *r, int ranks, size_t budget,
                            fl_plan *out, size_t *peak_total) {
    if (s == FL_ERR_UNSUPPORTED) /* the trainer refuses it, or the stand-in asked the planned backend's supports_op */
        s = fl_error_prefix(s, "refused at set-up (on the plan's null backend standing in for the %s backend)",
                            x->cuda ? "cuda" : "cpu");
    const int oom = s == FL_ERR_OOM && r->oom.valid;
    if (s != FL_OK && !oom && x->err && *x->err == FL_OK) *x->err = s; /* not a memory verdict: an error */
    if (peak_total) *peak_total = r->peak_total;
    if (out) {
        if (!budget) {
            out->n_phases = r->n_phases < FL_PLAN_MAX_PHASES ? r->n_phases : FL_PLAN_MAX_PHASES;
            memcpy(out->phases, r->phases, (size_t)out->n_phases * sizeof *out->phases);
            memcpy(out->peak, r->peak, sizeof out->peak);
            out->peak_total = r->peak_total;
            out->offload = r->offload;
            memcpy(out->host_peak, r->host_peak, sizeof out->host_peak);
            out->host_peak_total = r->host_peak_total;
            out->nvme = r->nvme;
            memcpy(out->nvme_peak, r->nvme_peak, sizeof out->nvme_peak);
            out->nvme_peak_total = r->nvme_peak_total;
        } else if (oom) {
            fl_plan_set_oom(out, &r->oom, r->n_phases, ranks);
        }
    }
    return s == FL_OK;
}

/* The trainer's real set-up and first step (of one rank of comm's, or of the one process) on its own
 * null backend standing in for the CPU or (plan --accelerator cuda) the GPU; r gets its record. */
static fl_status rehearse_on_null(const plan_ctx *x, const fl_run_config *v, fl_comm *comm, size_t budget, int B,
                                  int accum, fl_trainer_result *r) {
    memset(r, 0, sizeof *r);
    fl_backend be;
    FL_TRY(fl_null_backend_init_for(&be, x->cuda ? "cuda" : "cpu"));
    fl_null_backend_set_mpi_scratch(&be, !x->comm_threads && !x->cuda); /* several CPU ranks over mpirun */
    fl_run_config vs; /* an encoder-decoder: the rehearsal's sources are data.max_source_length tokens long */
    if (x->Ts) vs = *v, vs.data.max_source_length = x->Ts, v = &vs;
    fl_status s = fl_trainer_rehearse_comm(v, &x->mc, &be, comm, budget, B, x->T, accum, x->gen ? x->n_prompt : 0, r);
    fl_null_backend_free(&be);
    return s;
}

/* One process; same contract as simulate(). */
static int rehearse(const plan_ctx *x, const fl_run_config *c, const fl_optim_config *oc, int B, int accum,
                    size_t budget, fl_plan *out, size_t *peak_total) {
    fl_run_config v = *c;
    v.optimizer = *oc;
    fl_trainer_result r;
    fl_status s = rehearse_on_null(x, &v, NULL, budget, B, accum, &r);
    return rehearsal_result(x, s, &r, 1, budget, out, peak_total);
}

/* Several ranks: every rank's real set-up and first step, as threads over the threads communicator,
 * each on its own null backend (whose device communicator moves nothing and takes the planned
 * run's scratch: MPI's receive scratch for CPU ranks over mpirun, none for thread ranks or NCCL).
 * Only the planned rank has the budget, so a verdict is its own; its failure breaks the group
 * (fl_trainer_rehearse_comm), so the others return. */
#define FL_PLAN_MAX_RANKS 4096 /* the threads communicator's largest group (about 9 s and 1.4 GB at 4096) */

typedef struct {
    const plan_ctx *x;
    const fl_run_config *v;
    int B, accum;
    size_t budget;
    fl_status s;             /* the planned rank's (another rank's failure reaches it with its message) */
    fl_trainer_result r;
    char msg[2048];          /* its message */
} ranks_ctx;

static fl_status rehearse_rank(fl_comm *comm, int rank, void *ud) {
    ranks_ctx *k = ud;
    const int me = rank == k->x->rank;
    fl_trainer_result r;
    fl_status s = rehearse_on_null(k->x, k->v, comm, me ? k->budget : 0, k->B, k->accum, &r);
    if (!k->budget && s == FL_OK && k->x->rank_peaks) /* every rank's own need (fl_plan_opts.rank_peaks) */
        k->x->rank_peaks[rank] = r.peak_total, k->x->rank_host_peaks[rank] = r.host_peak_total;
    if (me) {
        k->s = s;
        k->r = r;
        snprintf(k->msg, sizeof k->msg, "%s", s == FL_OK ? "" : fl_error_message());
    }
    return FL_OK; /* the planned rank's status is read from k */
}

static int rehearse_ranks(const plan_ctx *x, const fl_run_config *c, const fl_optim_config *oc, int B, int accum,
                          size_t budget, fl_plan *out, size_t *peak_total) {
    fl_run_config v = *c;
    v.optimizer = *oc;
    const int world = c->devices * c->num_nodes;
    ranks_ctx *k = calloc(1, sizeof *k);
    if (!k) {
        fl_status s = fl_errorf(FL_ERR_OOM, "plan: out of host memory");
        if (x->err && *x->err == FL_OK) *x->err = s;
        return 0;
    }
    *k = (ranks_ctx){.x = x, .v = &v, .B = B, .accum = accum, .budget = budget, .s = FL_ERR_INTERNAL};
    fl_status s = world > FL_PLAN_MAX_RANKS
                      ? fl_errorf(FL_ERR_INVALID, "plan: %d ranks (devices %d x num_nodes %d): a plan rehearses every "
                                  "rank as a thread of this process, at most %d", world, c->devices, c->num_nodes,
                                  FL_PLAN_MAX_RANKS)
                      : fl_comm_threads_run(world, rehearse_rank, k);
    if (s == FL_OK && (s = k->s) != FL_OK) fl_errorf(s, "%s", k->msg);
    int fits = rehearsal_result(x, s, &k->r, world, budget, out, peak_total);
    free(k);
    return fits;
}

/* Plan one run; returns 1 if it fits. out (may be NULL) gets the phases, peaks and the OOM
 * record. */
static int simulate(const plan_ctx *x, const fl_run_config *c, const fl_optim_config *oc, int B, int accum,
                    size_t budget, fl_plan *out, size_t *peak_total) {
    if (c->devices * c->num_nodes == 1) return rehearse(x, c, oc, B, accum, budget, out, peak_total);
    return rehearse_ranks(x, c, oc, B, accum, budget, out, peak_total);
}

/* ---- the plan -------------------------------------------------------------------------- */

void fl_plan_note(fl_plan *p, const char *fmt, ...) {
    if (p->n_notes >= FL_PLAN_MAX_NOTES) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->notes[p->n_notes++], sizeof p->notes[0], fmt, ap);
    va_end(ap);
}
#define note(...) fl_plan_note(__VA_ARGS__) /* this file's short name for it */

void fl_plan_set_oom(fl_plan *p, const fl_mem_oom *oom, int n_phases, int ranks) {
    /* what failed, as the allocation site says it (this thread's message): up to the pool's own words */
    const char *m = fl_error_message(), *e = strstr(m, "out of memory on ");
    size_t n = e ? (size_t)(e - m) : strlen(m);
    while (n && (m[n - 1] == ' ' || m[n - 1] == ':')) n--;
    if (n) snprintf(p->oom_what, sizeof p->oom_what, "%.*s", (int)n, m);
    else snprintf(p->oom_what, sizeof p->oom_what, "%s buffer", fl_mem_tag_name(oom->tag));
    p->oom = *oom;
    const char *const *steps = ranks > 1 ? k_steps_dp : k_steps;
    const int ns = ranks > 1 ? (int)(sizeof k_steps_dp / sizeof *k_steps_dp) : (int)(sizeof k_steps / sizeof *k_steps);
    snprintf(p->oom_step, sizeof p->oom_step, "%s", steps[n_phases < ns ? n_phases : ns - 1]);
}

static fl_plan_suggestion *sugg(fl_plan *p, const char *technique) {
    if (p->n_sugg >= FL_PLAN_MAX_SUGG) return NULL;
    fl_plan_suggestion *s = &p->sugg[p->n_sugg++];
    memset(s, 0, sizeof *s);
    snprintf(s->technique, sizeof s->technique, "%s", technique);
    const fl_plan_technique *t = tech(technique);
    s->available = t ? t->available : 0;
    s->fits = -1;
    if (t && !t->available) snprintf(s->note, sizeof s->note, "not available in this build: %s", t->note);
    return s;
}

/* Largest divisor of `global` that fits (0: none). */
static int max_micro_batch(const plan_ctx *x, const fl_run_config *c, const fl_optim_config *oc, int global,
                           size_t budget) {
    for (int b = global; b >= 1; b--)
        if (global % b == 0 && simulate(x, c, oc, b, global / b, budget, NULL, NULL)) return b;
    return 0;
}

/* Whether the planned backend's 8-bit AdamW takes the run's trainable parameters (LoRA: the fp32 adapters;
 * else the precision's storage): its supports_op, asked through the null backend standing in for it. */
static int adam8bit_takes(const plan_ctx *x, const fl_run_config *c, char *why, size_t n) {
    fl_precision pr;
    fl_model_storage st;
    if (fl_precision_find(c->precision, &pr) != FL_OK || fl_trainer_storage(c, &pr, &st) != FL_OK) return 1;
    const fl_dtype dt = c->command == FL_CMD_FINETUNE_LORA ? FL_F32 : st.param_dtype;
    fl_backend nb;
    if (fl_null_backend_init_for(&nb, x->cuda ? "cuda" : "cpu") != FL_OK) return 1;
    const int ok = nb.supports_op(&nb, FL_OP_ADAM8BIT, dt, dt, FL_F32);
    fl_null_backend_free(&nb);
    if (!ok)
        snprintf(why, n, "the %s backend's 8-bit AdamW does not take %s parameters (--precision %s)",
                 x->cuda ? "cuda" : "cpu", fl_dtype_name(dt), c->precision);
    return ok;
}

/* A suggestion that runs the plan with v / oc: whether it fits the budget, its peak, what to type
 * and why. */
static void sugg_variant(fl_plan *p, const plan_ctx *x, fl_plan_suggestion *s, const fl_run_config *v,
                         const fl_optim_config *oc, const char *change, const char *note) {
    size_t peak = 0;
    fl_status err = FL_OK;
    plan_ctx y = *x;
    y.err = &err; /* a variant the run refuses (not for memory): said so, with the refusal */
    s->fits = simulate(&y, v, oc, p->B, p->accum, p->budget, NULL, NULL);
    snprintf(s->change, sizeof s->change, "%s", change);
    if (err != FL_OK) {
        s->fits = -1;
        snprintf(s->note, sizeof s->note, "%s", fl_error_message());
        return;
    }
    simulate(x, v, oc, p->B, p->accum, 0, NULL, &peak);
    s->peak = peak;
    snprintf(s->note, sizeof s->note, "%s", note);
}

/* Suggestions 1-3: a smaller micro batch, shorter sequences, SGD without state. */
static void suggest_shape(fl_plan *p, const plan_ctx *x, const fl_run_config *c) {
    const fl_optim_config *oc = &c->optimizer;
    size_t budget = p->budget, peak = 0;
    fl_plan_suggestion *s;
    /* 1. a smaller micro batch with accumulation (same global batch) */
    if ((s = sugg(p, "micro_batch"))) {
        int mb = p->max_micro_batch_size;
        if (mb > 0) {
            simulate(x, c, oc, mb, p->global_batch / mb, 0, NULL, &peak);
            s->fits = 1;
            s->peak = peak;
            snprintf(s->change, sizeof s->change, "--train.micro_batch_size %d", mb);
            snprintf(s->note, sizeof s->note, "accumulation %d keeps the global batch of %d", p->global_batch / mb,
                     p->global_batch * (p->dp_ranks > 1 ? p->dp_ranks : 1));
        } else {
            s->fits = 0;
            snprintf(s->note, sizeof s->note, "even micro_batch_size 1 does not fit");
        }
    }
    /* 2. shorter sequences at this micro batch */
    if ((s = sugg(p, "max_seq_length"))) {
        plan_ctx y = *x;
        int *len = x->Ts ? &y.Ts : &y.T; /* an encoder-decoder: shorter sources */
        int lo = 0, hi = *len - 1; /* largest T' < T that fits */
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            *len = mid;
            if (simulate(&y, c, oc, p->B, p->accum, budget, NULL, NULL)) lo = mid;
            else hi = mid - 1;
        }
        if (lo >= 1) {
            *len = lo;
            simulate(&y, c, oc, p->B, p->accum, 0, NULL, &peak);
            s->fits = 1;
            s->peak = peak;
            /* the trainer's T is max_seq_length - 1 (inputs are a sample minus its last token); a source is cut to
             * max_source_length tokens */
            if (x->Ts) snprintf(s->change, sizeof s->change, "--data.max_source_length %d", lo);
            else snprintf(s->change, sizeof s->change, "--train.max_seq_length %d", lo + 1);
            snprintf(s->note, sizeof s->note, "%s longer than %d tokens are truncated", x->Ts ? "sources" : "samples",
                     x->Ts ? lo : lo + 1);
        } else {
            s->fits = 0;
            snprintf(s->note, sizeof s->note, "no sequence length fits at micro_batch_size %d", p->B);
        }
    }
    /* 3. SGD without momentum: no optimizer state */
    if ((oc->kind != FL_OPT_SGD || oc->momentum != 0.0f) && (s = sugg(p, "sgd"))) {
        fl_optim_config sgd;
        fl_optim_config_default(&sgd, FL_OPT_SGD);
        sgd.lr = oc->lr;
        if (simulate(x, c, &sgd, p->B, p->accum, budget, NULL, NULL)) {
            simulate(x, c, &sgd, p->B, p->accum, 0, NULL, &peak);
            s->fits = 1;
            s->peak = peak;
            snprintf(s->change, sizeof s->change, "--optimizer SGD");
            snprintf(s->note, sizeof s->note, "no optimizer state (AdamW keeps two fp32 states per parameter)");
        } else {
            int mb = max_micro_batch(x, c, &sgd, p->global_batch, budget);
            s->fits = mb > 0;
            if (mb > 0) {
                simulate(x, c, &sgd, mb, p->global_batch / mb, 0, NULL, &peak);
                s->peak = peak;
                snprintf(s->change, sizeof s->change, "--optimizer SGD --train.micro_batch_size %d", mb);
            }
            snprintf(s->note, sizeof s->note, "%s", mb > 0 ? "no optimizer state, with a smaller micro batch"
                                                           : "still out of memory without optimizer state");
        }
    }
}

/* What to change when the run does not fit, each planned like the run itself. */
static void suggest(fl_plan *p, const plan_ctx *x, const fl_run_config *c) {
    const fl_optim_config *oc = &c->optimizer;
    fl_plan_suggestion *s;
    suggest_shape(p, x, c);
    /* 3b. bf16-true: half the bytes of parameters, gradients, AdamW state and saved activations */
    if (!strcmp(c->precision, "32-true") && (s = sugg(p, "bf16-true"))) {
        fl_run_config v = *c;
        snprintf(v.precision, sizeof v.precision, "bf16-true");
        sugg_variant(p, x, s, &v, oc, "--precision bf16-true",
                     "bf16 parameters, gradients, optimizer state and saved activations");
    }
    /* 4. activation checkpointing and 8-bit AdamW, planned like the rest */
    if (!p->act_ckpt && (s = sugg(p, "activation_checkpointing"))) {
        fl_run_config v = *c;
        v.train.activation_checkpointing = 1;
        sugg_variant(p, x, s, &v, oc, "--train.activation_checkpointing true",
                     "keeps each block's input only; one block is recomputed in backward");
    }
    if (oc->kind == FL_OPT_ADAMW && (s = sugg(p, "adam8bit")) && !adam8bit_takes(x, c, s->note, sizeof s->note)) {
        s->fits = -1; /* not with this precision: unknown, said in the note */
        snprintf(s->change, sizeof s->change, "--optimizer bnb.optim.AdamW8bit");
    } else if (oc->kind == FL_OPT_ADAMW && s) {
        fl_optim_config a8;
        fl_optim_config_default(&a8, FL_OPT_ADAMW8BIT);
        a8.lr = oc->lr;
        sugg_variant(p, x, s, c, &a8, "--optimizer bnb.optim.AdamW8bit", "about 2 bytes of state per parameter instead of 8");
    }
    /* 4b. CPU offload (ZeRO-Offload): the optimizer state off the device; AdamW and SGD with momentum; under ZeRO-3 /
     * FULL_SHARD deepspeed_stage_3_offload (the parameters' shards stay on the devices; not for HYBRID_SHARD) */
    const int z3 = p->zero_stage == 3;
    if (!fl_cfg_offload(c->strategy) && !fl_cfg_hybrid_shard(c->strategy, c->sharding_strategy) &&
        (oc->kind == FL_OPT_ADAMW || (oc->kind == FL_OPT_SGD && oc->momentum != 0.0f)) && (s = sugg(p, "cpu_offload"))) {
        fl_run_config v = *c;
        const char *st = z3 ? "deepspeed_stage_3_offload" : "deepspeed_stage_2_offload";
        snprintf(v.strategy, sizeof v.strategy, "%s", st);
        v.sharding_strategy[0] = '\0';
        char change[160], a[32], note[256];
        snprintf(change, sizeof change, "--strategy %s", st);
        if (x->cuda) sugg_variant(p, x, s, &v, oc, change, "the optimizer state in host memory and the update on the "
                                  "host's cores (slower: gradients down and parameters up every step)");
        else { /* a CPU run's host tier is the same RAM as its "device": offloading to it frees nothing */
            snprintf(s->change, sizeof s->change, "%s", change);
            snprintf(s->note, sizeof s->note, "on a CPU the device is the host's RAM, where ZeRO-Offload would put the "
                     "optimizer state: it frees nothing (nvme_offload moves it to a disk)");
            snprintf(v.offload_device, sizeof v.offload_device, "nvme");
            snprintf(change + strlen(change), sizeof change - strlen(change), " --offload_optimizer_device nvme --nvme_path DIR");
            snprintf(note, sizeof note, "the optimizer state (OPTIM %s) in files on a disk, out of the RAM that is this "
                     "CPU run's device memory, paged through a few pieces of it (slower: read and written every step)",
                     fl_fmt_bytes(p->peak[FL_TAG_OPTIM], a, sizeof a));
            if ((s = sugg(p, "nvme_offload"))) sugg_variant(p, x, s, &v, oc, change, note);
        }
    }
    /* 4c. parameter offload: where even ZeRO-3's shards (or one process's whole model) do not fit the device, the
     * shards of the parameters and gradients go to the host (a CPU run: to files, its host being its "device") with
     * the optimizer; full-model training only (LoRA's frozen base stays whole) */
    if (c->command != FL_CMD_FINETUNE_LORA && !fl_cfg_param_offload(c) &&
        !fl_cfg_hybrid_shard(c->strategy, c->sharding_strategy) && (p->devices == 1 || z3) &&
        oc->kind != FL_OPT_ADAMW8BIT && (s = sugg(p, "param_offload"))) {
        fl_run_config v = *c;
        snprintf(v.strategy, sizeof v.strategy, "deepspeed_stage_3_offload");
        v.sharding_strategy[0] = '\0';
        snprintf(v.offload_param_device, sizeof v.offload_param_device, "%s", x->cuda ? "cpu" : "nvme");
        if (!x->cuda) snprintf(v.offload_device, sizeof v.offload_device, "nvme");
        sugg_variant(p, x, s, &v, oc,
                     x->cuda ? "--strategy deepspeed_stage_3_offload --offload_param_device cpu"
                             : "--strategy deepspeed_stage_3_offload --offload_param_device nvme --offload_optimizer_device "
                               "nvme --nvme_path DIR",
                     x->cuda ? "the parameters' and gradients' shards and the optimizer in host memory, each unit copied "
                               "to the device ahead of its use (slower: every unit crosses PCIe twice per step)"
                             : "the parameters, gradients and optimizer state in files on a disk, each unit read ahead "
                               "of its use (slower: the disk is read and written every step)");
    }
    if (c->command != FL_CMD_FINETUNE_LORA && (s = sugg(p, "lora"))) {
        fl_run_config v = *c;
        fl_run_config d;
        fl_cfg_defaults(&d, FL_CMD_FINETUNE_LORA);
        v.command = FL_CMD_FINETUNE_LORA;
        v.lora = d.lora;
        char change[64];
        snprintf(change, sizeof change, "fitllm finetune_lora (r %d, query+value)", v.lora.r);
        sugg_variant(p, x, s, &v, oc, change, "gradients and optimizer state for the adapters only");
    }
    if (!c->lora.quantize[0] && (s = sugg(p, "qlora"))) { /* QLoRA: LoRA on a 4-bit NF4 base */
        fl_run_config v = *c;
        if (c->command != FL_CMD_FINETUNE_LORA) {
            fl_run_config d;
            fl_cfg_defaults(&d, FL_CMD_FINETUNE_LORA);
            v.command = FL_CMD_FINETUNE_LORA;
            v.lora = d.lora;
        }
        snprintf(v.lora.quantize, sizeof v.lora.quantize, "bnb.nf4-dq");
        if (strstr(v.precision, "mixed")) snprintf(v.precision, sizeof v.precision, "bf16-true");
        sugg_variant(p, x, s, &v, oc, strcmp(v.precision, c->precision)
                     ? "fitllm finetune_lora --quantize bnb.nf4-dq --precision bf16-true"
                     : "fitllm finetune_lora --quantize bnb.nf4-dq", "LoRA on a 4-bit base (4.127 bits per linear weight)");
    }
    /* 5. what this build does not have yet */
    static const char *later[] = {"bf16-true", "bf16-mixed", "activation_checkpointing", "adam8bit", "lora", "qlora",
                                  "cpu_offload"};
    for (size_t i = 0; i < sizeof later / sizeof later[0]; i++) {
        const fl_plan_technique *t = tech(later[i]);
        if (t && !t->available && (s = sugg(p, later[i]))) snprintf(s->change, sizeof s->change, "%s", t->how);
    }
}

/* An encoder-decoder's two lengths: the source's (--seq-len, else data.max_source_length capped by
 * train.max_seq_length) and the target's
 * (--target-len, else data.max_target_length); the trainer sizes for the longest pair cut to those limits. */
static fl_status s2s_lengths(const fl_run_config *c, const fl_plan_opts *o, plan_ctx *x, fl_plan *p) {
    const int lim = fl_s2s_source_limit(c->data.max_source_length, c->train.max_seq_length); /* the trainer's */
    x->Ts = o->seq_len > 0 ? o->seq_len : lim;
    x->T = o->target_len > 0 ? o->target_len : c->data.max_target_length;
    if (x->Ts <= 0 || x->T <= 0)
        return fl_errorf(FL_ERR_INVALID, "plan: an encoder-decoder (%s) needs a %s length: give %s (data.%s is no "
                         "limit)", x->mc.name, x->Ts <= 0 ? "source" : "target",
                         x->Ts <= 0 ? "--seq-len or --data.max_source_length" : "--target-len or --data.max_target_length",
                         x->Ts <= 0 ? "max_source_length" : "max_target_length");
    note(p, "source %d tokens (%s), target %d (%s): the trainer sizes activations for the longest source and target, "
            "cut to data.max_source_length / max_target_length, so shorter pairs need less", x->Ts,
         o->seq_len > 0 ? "--seq-len" : lim != c->data.max_source_length ? "train.max_seq_length" : "data.max_source_length", x->T,
         o->target_len > 0 ? "--target-len" : "data.max_target_length");
    return FL_OK;
}

/* data.lengths: the Synthetic samples' lengths are drawn from a table by (seed, split, index); draw the same
 * ones and size T for the longest, as the trainer does (exact: no assumption about the data left). */
static fl_status drawn_lengths(const fl_run_config *c, int ctx, plan_ctx *x, fl_plan *p) {
    fl_lengths t;
    FL_TRY(fl_error_prefix(fl_lengths_load(c->data.lengths, &t), "data.lengths"));
    int longest = fl_lengths_longest(&t, c->data.seed, (size_t)c->data.synthetic_train, (size_t)c->data.synthetic_val,
                                     c->train.max_seq_length);
    x->T = longest - 1 < ctx ? longest - 1 : ctx;
    if (x->T < 1) x->T = 1;
    note(p, "T = %d: the longest of the %d + %d samples whose lengths are drawn from %s (seed %llu; median %d, max "
            "%d tokens%s), minus its last token%s", x->T, c->data.synthetic_train, c->data.synthetic_val,
         c->data.lengths, (unsigned long long)c->data.seed, fl_lengths_at(&t, 0.5), t.len[t.n - 1],
         c->train.max_seq_length > 0 ? ", cut to train.max_seq_length" : "", longest - 1 > ctx ? ", capped by the model context" : "");
    return FL_OK;
}

/* The notes that say how the run's strategy divides the memory (tensor parallel, DDP, FSDP, ZeRO), how the gradients
 * reduce (buckets) and which tiers hold what (parameter, CPU and NVMe offload), in that order. */
static void strategy_notes(fl_plan *p, const fl_run_config *c, const fl_strategy_choice *scp, const fl_plan_opts *o,
                           int fsdp) {
    const fl_strategy_choice sc = *scp;
    const fl_plan_opts opts = *o;
    if (c->pipeline_parallel > 1) /* (interleaved: its chunks' models and stashes, the schedule's notes say) */
        note(p, "pipeline parallel %d (EXPERIMENTAL, schedule %s)%s: rank %d is stage %d: %s "
                "blocks (balanced by their training FLOPs, lm_head's on the last stage), a copy of the embeddings and head (run and trained on the first / last stage "
                "only), their gradients and optimizer state, and the activations of the micro-batches it keeps in flight "
                "(the arena's one and a stash per further one: 1F1B at most min(stages - stage, micro-batches), GPipe all); "
                "the whole model the run loads, and the checkpoints' gathered copy, are outside the pool; no sample "
                "generation", c->pipeline_parallel, c->pipeline_schedule, fl_cfg_dp_ranks(c) > 1 ? (fsdp ? " x FSDP" : p->zero_stage == 1 ? " x ZeRO-1" : p->zero_stage == 2 ? " x ZeRO-2" : " x DDP") : "", p->rank,
             (p->rank / (c->tensor_parallel > 1 ? c->tensor_parallel : 1)) % c->pipeline_parallel, strcmp(c->pipeline_schedule, "interleaved") ? "its contiguous range of the" : "its chunks' (non-contiguous)"); /* (stage: tpp_begin's) */
    else if (c->tensor_parallel > 1)
        note(p, "tensor parallel %d%s: rank %d's memory: its slice of the model (1/%d of the attention heads, key/value "
                "heads and MLP columns; norms, embeddings and the head whole), its gradients and optimizer state, its "
                "heads' activations; the whole model the run loads and slices, and the checkpoints' gathered copy, "
                "are outside the pool (host staging)%s", c->tensor_parallel, fl_cfg_dp_ranks(c) > 1 ? (p->zero_stage == 1 ? " x ZeRO-1"
                : p->zero_stage == 2 ? " x ZeRO-2" : " x DDP") : "",
             p->rank, c->tensor_parallel, c->sequence_parallel ? "; sequence parallel: the saved residual stream, mid residuals "
             "and norm statistics are the rank's 1/N of the rows (ACTS), the norms' outputs gathered whole for the linears" : "");
    else if (p->devices > 1 && !p->zero_stage)
        note(p, "data parallel (DDP) over %d ranks: the memory of ONE rank (every rank holds the whole model, its "
                "gradients and optimizer state)%s", p->devices,
             opts.comm_threads ? "; the ranks are threads of one process: no all-reduce scratch"
                               : ", with the gradient all-reduce's scratch in WORKSPACE");
    else if (fsdp && c->num_nodes > 1 && fl_cfg_hybrid_shard(sc.strategy, sc.sharding))
        note(p, "FSDP HYBRID_SHARD over %d nodes of %d ranks: rank %d's memory: FULL_SHARD within its node (PARAMS, "
                "GRADS and OPTIM its shard of every unit, split over the node's %d ranks; GATHER the units gathered "
                "in the node at a time), the same shards replicated on every node (gradients reduce-scattered in "
                "the node, then all-reduced across the nodes)", c->num_nodes, c->devices, p->rank, c->devices);
    else if (fsdp)
        note(p, "FSDP FULL_SHARD (ZeRO-3) over %d ranks: rank %d's memory: PARAMS, GRADS and OPTIM its shard of "
                "every unit (each unit split by fl_comm's chunk layout); GATHER the units gathered at a time (at most "
                "2 blocks, the head group and, tied, the embeddings) and their unreduced gradients; the model is "
                "created sharded (the load reads, or the random init generates, only the rank's pieces: it never "
                "holds the whole model)", p->devices, p->rank);
    else if (p->devices > 1)
        note(p, "ZeRO-%d over %d ranks: rank %d's memory: OPTIM for its chunk of the parameters; %s; parameters "
                "whole", p->zero_stage, p->devices, p->rank,
             p->zero_stage == 2 ? "GRADS reserved in full (backward fills the flat buffer), live after the "
                                  "reduce-scatter: the chunk" : "gradients whole (all-reduced)");
    if (p->devices > 1) {
        char bb[32];
        if (c->bucket_size)
            note(p, "gradient reductions in buckets of %s (--bucket_size): their WORKSPACE stays under twice it, "
                    "whatever the model; the same bits", fl_fmt_bytes(c->bucket_size, bb, sizeof bb));
        else
            note(p, "gradient reductions unbucketed (--bucket_size null): their scratch grows with the model");
    }
    if (sc.param_offload)
        note(p, "parameter offload (offload_param_device %s): PARAMS and GRADS are this rank's shards in the %s tier "
                "(outside the device budget); GATHER holds the units fetched to the device at a time%s",
             sc.param_offload == 2 ? "nvme" : "cpu", sc.param_offload == 2 ? "nvme" : "host",
             opts.cuda ? " and each unit's piece staged before its all-gather" : "");
    if (sc.offload && fl_cfg_offload_nvme(c))
        note(p, "NVMe offload: OPTIM is in the nvme tier (its row: files under nvme_path, paged through a few "
                "pieces of host memory), outside the device budget%s", opts.cuda ? "; the host tier: one piece staged"
                                                                                 : "");
    else if (sc.offload)
        note(p, "CPU offload (ZeRO-Offload, %s): OPTIM is the host tier's, outside the device budget (the \"host "
                "(offload)\" row: the optimizer state%s); every step moves the gradients to the host and the updated "
                "parameters back", c->strategy, opts.cuda ? " and the update's staging of one piece" : "");
}

fl_status fl_plan_run(const fl_run_config *c, const fl_plan_opts *opts_in, fl_plan *p) {
    fl_plan_opts opts;
    if (opts_in) opts = *opts_in;
    else fl_plan_opts_default(&opts);
    memset(p, 0, sizeof *p);
    fl_run_config cd;
    if (opts.devices > 1) { /* plan --devices N: the run's devices */
        cd = *c;
        cd.devices = opts.devices;
        c = &cd;
    }
    FL_TRY(fl_cfg_validate(c));
    p->devices = c->devices * c->num_nodes;
    char auto_head[256], auto_rest[1024]; /* --strategy auto on a TP / PP grid: the data axis's by the per-rank plan */
    FL_TRY(fl_plan_auto_resolve(&c, &cd, opts.cuda, opts.device_memory, auto_head, sizeof auto_head, auto_rest, sizeof auto_rest));
    fl_strategy_choice sc; /* --strategy auto: the trainer's choice (fl_cfg_resolve_strategy) */
    FL_TRY(fl_cfg_resolve_strategy(c, opts.cuda, &sc));
    const int stage = sc.stage;
    if (opts.rank < 0 || opts.rank >= p->devices) /* one device too: rank 5 of 1 was planned as rank 0, unsaid */
        return fl_errorf(FL_ERR_INVALID, p->devices > 1 ? "plan --rank %d: the run has ranks 0..%d" : "plan --rank %d: "
                         "the run has one rank (0); --devices N plans N ranks", opts.rank, p->devices - 1);
    p->rank = p->devices > 1 ? opts.rank : 0;
    p->zero_stage = p->devices > 1 ? stage : 0;
    if (p->zero_stage == 3 && c->command == FL_CMD_FINETUNE_LORA) p->zero_stage = 2; /* adapters: ZeRO-2 */
    const int fsdp = p->zero_stage == 3;
    if (p->devices > 1) note(p, "strategy %s", auto_head[0] ? auto_head : sc.desc);
    if (p->devices > 1 && auto_rest[0]) note(p, "strategy auto, %s", auto_rest); /* what came before the choice */
    if (fsdp) {
        fl_precision fp;
        const char *why = fl_fsdp_refusal(c, fl_precision_find(c->precision, &fp) == FL_OK ? &fp : NULL);
        if (why) return fl_errorf(FL_ERR_UNSUPPORTED, "%s", why);
    }
    p->bucket_size = c->bucket_size;
    strategy_notes(p, c, &sc, &opts, fsdp);
    plan_ctx x;
    memset(&x, 0, sizeof x);
    fl_status err = FL_OK;
    x.err = &err;
    x.rank = p->rank;
    x.cuda = opts.cuda;
    x.comm_threads = opts.comm_threads;
    x.rank_peaks = opts.rank_peaks, x.rank_host_peaks = opts.rank_host_peaks;
    if (!x.rank_peaks != !x.rank_host_peaks)
        return fl_errorf(FL_ERR_INVALID, "plan: rank_peaks and rank_host_peaks go together");
    FL_TRY(resolve_model(c, &x.mc, p->model_source, sizeof p->model_source));
    p->model = x.mc;
    p->n_params = fl_sizing_param_count(&x.mc);
    const int ctx = x.mc.max_seq;
    /* T: the trainer's min(longest sample - 1, max_seq_length, context) without the data */
    if (fl_model_is_s2s(&x.mc)) {
        FL_TRY(s2s_lengths(c, &opts, &x, p));
    } else if (opts.seq_len > 0) {
        x.T = opts.seq_len < ctx ? opts.seq_len : ctx;
        note(p, "T = %d from --seq-len%s", x.T, opts.seq_len > ctx ? " (capped by the model context)" : "");
    } else if (c->data.kind == FL_DATA_SYNTHETIC && c->data.lengths[0]) {
        FL_TRY(drawn_lengths(c, ctx, &x, p));
    } else if (c->train.max_seq_length > 0 && c->data.kind == FL_DATA_TEXTFILES) { /* blocks of max_seq_length + 1 */
        x.T = c->train.max_seq_length < ctx ? c->train.max_seq_length : ctx;
        note(p, "T = %d = train.max_seq_length%s: TextFiles cuts the text into blocks of max_seq_length + 1 tokens "
                "(max_seq_length inputs and the last one's target)", x.T, x.T < c->train.max_seq_length ? ", capped by the model context" : "");
    } else if (c->train.max_seq_length > 0) {
        /* samples are cut to max_seq_length tokens; inputs are a sample minus its last token */
        int msl = c->train.max_seq_length > 1 ? c->train.max_seq_length - 1 : 1;
        x.T = msl < ctx ? msl : ctx;
        note(p, "T = %d = train.max_seq_length - 1%s: the trainer sizes activations for the longest sample (cut to "
                "max_seq_length tokens; inputs are a sample minus its last token), so a dataset of shorter samples "
                "needs less", x.T, msl > ctx ? ", capped by the model context" : "");
    } else {
        x.T = ctx;
        note(p, "T = %d = the model context: train.max_seq_length is null, so the longest sample decides at run "
                "time; this is the upper bound (set --train.max_seq_length to plan for less)", x.T);
    }
    p->T = x.T;
    p->Ts = x.Ts;
    p->B = c->train.micro_batch_size;
    p->dp_ranks = fl_cfg_dp_ranks(c);
    p->global_batch = c->train.global_batch_size / p->dp_ranks; /* per data-parallel rank */
    p->accum = p->global_batch / p->B;
    if (c->pipeline_parallel > 1) { /* the bubble and the expected step (fitllm/pp.h) */
        char pp[1200];
        fl_pp_schedule k;
        FL_TRY(fl_pp_schedule_parse_all(c->pipeline_schedule, &k));
        FL_TRY(fl_pp_estimate_text_v(&x.mc, c->train.max_seq_length > 0 ? c->train.max_seq_length : ctx,
                                     c->pipeline_parallel, k == FL_PP_INTERLEAVED ? c->pipeline_chunks : 1, p->accum, k,
                                     opts.block_ms, pp, sizeof pp));
        for (char *line = strtok(pp, "\n"); line; line = strtok(NULL, "\n")) note(p, "%s", line);
    }
    snprintf(p->precision, sizeof p->precision, "%s", c->precision);
    snprintf(p->optimizer, sizeof p->optimizer, "%s%s", fl_optim_name(c->optimizer.kind),
             c->optimizer.kind == FL_OPT_SGD && c->optimizer.momentum != 0.0f ? "+momentum" : "");
    p->act_ckpt = sc.act_ckpt;
    p->budget = opts.device_memory ? opts.device_memory : c->max_memory;
    /* sample generation at evaluation, as the CLI run does it */
    int gen = opts.generation;
    if (gen < 0)
        gen = c->eval.max_new_tokens > 0 && has_val_split(c) &&
              (c->train.max_steps < 0 || c->train.max_steps >= c->eval.interval);
    if (gen && x.Ts) {
        note(p, "no evaluation: an encoder-decoder run has no validation split or sample generation yet");
        gen = 0;
    }
    if (gen && c->eval.max_new_tokens > 0) {
        FL_TRY(gen_prompt_tokens(c, &x.n_prompt));
        x.cap = x.n_prompt + c->eval.max_new_tokens;
        if (x.cap > ctx) {
            note(p, "no eval sample generation: prompt (%d tokens) + eval.max_new_tokens exceeds the context", x.n_prompt);
            gen = 0;
        } else {
            note(p, "eval_generate: the sample generated at each evaluation (prompt %d tokens + %d new, KV cache of "
                    "%d positions); only when the run prints (the CLI), library callers with out=NULL skip it",
                 x.n_prompt, c->eval.max_new_tokens, x.cap);
        }
    } else {
        gen = 0;
    }
    x.gen = gen;
    p->generation = gen;
    p->gen_prompt_tokens = x.n_prompt;
    p->gen_capacity = gen ? x.cap : 0;

    if (config_unavailable(c, p->unavailable, sizeof p->unavailable)) {
        p->verdict = FL_PLAN_UNAVAILABLE;
        p->max_micro_batch_size = -1;
        return FL_OK;
    }
    simulate(&x, c, &c->optimizer, p->B, p->accum, 0, p, NULL); /* what the run needs */
    if (err != FL_OK) return err; /* the run itself fails (not for memory): the same error */
    x.err = NULL;                 /* the variants below: a failing one just does not fit */
    if (!p->budget) {
        p->verdict = FL_PLAN_FITS;
        p->max_micro_batch_size = -1;
        /* the library keeps FL_PLAN_FITS (nothing failed); the printed verdict says no budget was given */
        note(p, "no budget given (--device-memory or --max-memory): the plan cannot say whether it fits");
        return FL_OK;
    }
    int fits = simulate(&x, c, &c->optimizer, p->B, p->accum, p->budget, p, NULL);
    p->verdict = fits ? FL_PLAN_FITS : FL_PLAN_OOM;
    p->max_micro_batch_size = max_micro_batch(&x, c, &c->optimizer, p->global_batch, p->budget);
    if (!fits && !opts.no_suggestions) suggest(p, &x, c);
    return FL_OK;
}

/* ---- output ------------------------------------------------------------------------------ */

static void row(FILE *f, const char *name, const char *kind, const size_t *b, size_t total, size_t peak, int with_peak) {
    char s[32];
    fprintf(f, "%-16s %-8s", name, kind);
    for (int t = 0; t < FL_TAG_COUNT; t++) fprintf(f, " %11s", fl_fmt_bytes(b[t], s, sizeof s));
    fprintf(f, " %11s", fl_fmt_bytes(total, s, sizeof s));
    if (with_peak) fprintf(f, " %11s", fl_fmt_bytes(peak, s, sizeof s));
    fprintf(f, "\n");
}

void fl_plan_print(const fl_plan *p, FILE *f) {
    char a[32], b[32], d[32], lay[32];
    if (p->model.n_dec_layers) snprintf(lay, sizeof lay, "L=%d+%d", p->model.n_layers, p->model.n_dec_layers);
    else snprintf(lay, sizeof lay, "L=%d", p->model.n_layers);
    fprintf(f, "model: %s (%s), %zu parameters; %s, %s C=%d F=%d heads %d/%d, vocab %d, context %d\n",
            p->model.name[0] ? p->model.name : "?", p->model_source, p->n_params,
            fl_arch_get(p->model.arch)->display, lay, p->model.dim, p->model.ffn_dim,
            p->model.n_heads, p->model.n_kv_heads, p->model.vocab_size, p->model.max_seq);
    char len[64], ranks[48] = ""; /* ranks: as the run's header says it */
    if (p->Ts) snprintf(len, sizeof len, "source %d, target %d", p->Ts, p->T);
    else snprintf(len, sizeof len, "T=%d", p->T);
    if (p->dp_ranks > 1) snprintf(ranks, sizeof ranks, " x %d ranks", p->dp_ranks);
    fprintf(f, "run: micro_batch %d x accumulation %d%s = global batch %d, %s, precision %s, %s, activation "
               "checkpointing %s, eval sample generation %s\n",
            p->B, p->accum, ranks, p->global_batch * (p->dp_ranks > 1 ? p->dp_ranks : 1), len, p->precision,
            p->optimizer, p->act_ckpt ? "on" : "off", p->generation ? "on" : "off");
    for (int i = 0; i < p->n_notes; i++) fprintf(f, "note: %s\n", p->notes[i]);
    if (p->verdict == FL_PLAN_UNAVAILABLE) {
        fprintf(f, "\nverdict: NOT AVAILABLE: %s\n", p->unavailable);
        return;
    }
    fprintf(f, "\nplanned memory at each phase of a step, as the runtime's memory report: reserved = allocated, "
               "live = holding data a later phase still reads\n");
    fprintf(f, "%-16s %-8s", "phase", "");
    for (int t = 0; t < FL_TAG_COUNT; t++) fprintf(f, " %11s", fl_mem_tag_name((fl_mem_tag)t));
    fprintf(f, " %11s %11s\n", "total", "phase peak");
    for (int i = 0; i < p->n_phases; i++) {
        row(f, p->phases[i].name, "reserved", p->phases[i].cur, p->phases[i].cur_total, p->phases[i].peak_total, 1);
        row(f, "", "live", p->phases[i].live, p->phases[i].live_total, 0, 0);
    }
    row(f, "peak", "reserved", p->peak, p->peak_total, 0, 0);
    if (p->offload) /* the host tier: outside the device's budget */
        row(f, "host (offload)", "reserved", p->host_peak, p->host_peak_total, 0, 0);
    if (p->nvme) /* the state's files */
        row(f, "nvme (offload)", "reserved", p->nvme_peak, p->nvme_peak_total, 0, 0);
    if (p->budget)
        fprintf(f, "budget %s (%zu bytes); planned peak %s = %.1f%% of it\n", fl_fmt_bytes(p->budget, a, sizeof a),
                p->budget, fl_fmt_bytes(p->peak_total, b, sizeof b), 100.0 * (double)p->peak_total / (double)p->budget);
    fprintf(f, "\n");
    /* more than any single machine has: a config to fix (batch, sequence, model), not a device to buy */
    if (p->peak_total > ((size_t)64 << 40))
        fprintf(f, "note: the planned peak of %s is more than any single machine has: check train.micro_batch_size, "
                   "train.max_seq_length (or --seq-len) and the model\n", fl_fmt_bytes(p->peak_total, a, sizeof a));
    if (p->verdict == FL_PLAN_FITS && !p->budget) {
        fprintf(f, "verdict: UNKNOWN: no --device-memory / --max-memory given, cannot say whether a peak of %s fits "
                   "(give the device's memory, e.g. --device-memory 80GB)\n", fl_fmt_bytes(p->peak_total, a, sizeof a));
    } else if (p->verdict == FL_PLAN_FITS) {
        fprintf(f, "verdict: FITS\n");
    } else {
        const fl_mem_oom *o = &p->oom;
        size_t avail = o->budget > o->in_use ? o->budget - o->in_use : 0;
        fprintf(f, "verdict: OUT OF MEMORY during %s (%s): %s for %s needs %s, %s available (budget %s, in use %s)\n",
                o->phase, p->oom_step, fl_mem_tag_name(o->tag), p->oom_what, fl_fmt_bytes(o->requested, a, sizeof a),
                fl_fmt_bytes(avail, b, sizeof b), fl_fmt_bytes(o->budget, d, sizeof d),
                fl_fmt_bytes(o->in_use, (char[32]){0}, 32));
        fprintf(f, "  in use at that moment:");
        for (int t = 0; t < FL_TAG_COUNT; t++)
            fprintf(f, " %s %s%s", fl_mem_tag_name((fl_mem_tag)t), fl_fmt_bytes(o->cur[t], a, sizeof a),
                    t + 1 < FL_TAG_COUNT ? "," : "\n");
    }
    char cap[96] = ""; /* the search starts at the rank's share of the global batch: said where that stops it */
    if (p->max_micro_batch_size > 0) {
        if (p->max_micro_batch_size == p->global_batch) snprintf(cap, sizeof cap, "; capped at the global batch %d%s",
                     p->global_batch * (p->dp_ranks > 1 ? p->dp_ranks : 1), p->dp_ranks > 1 ? " / its ranks" : "");
        fprintf(f, "largest micro_batch_size that fits: %d (accumulation %d%s for global batch %d%s)\n",
                p->max_micro_batch_size, p->global_batch / p->max_micro_batch_size, ranks,
                p->global_batch * (p->dp_ranks > 1 ? p->dp_ranks : 1), cap);
    }
    else if (p->max_micro_batch_size == 0)
        fprintf(f, "largest micro_batch_size that fits: none (even 1 is out of memory)\n");
    if (p->n_sugg) {
        fprintf(f, "\nwhat to try:\n");
        for (int i = 0; i < p->n_sugg; i++) {
            const fl_plan_suggestion *s = &p->sugg[i];
            if (!s->available) fprintf(f, "  - %-26s not available in this build (%s)\n", s->technique, s->change);
            else if (s->fits == 1)
                fprintf(f, "  - %-26s fits: %s (planned peak %s; %s)\n", s->technique, s->change,
                        fl_fmt_bytes(s->peak, a, sizeof a), s->note);
            else if (s->fits < 0) fprintf(f, "  - %-26s not with this run: %s\n", s->technique, s->note);
            else fprintf(f, "  - %-26s does not fit: %s\n", s->technique, s->note);
        }
    }
}

static void jtags(FILE *f, const size_t *b, size_t total) {
    fputc('{', f);
    for (int t = 0; t < FL_TAG_COUNT; t++) fprintf(f, "\"%s\": %zu, ", fl_mem_tag_name((fl_mem_tag)t), b[t]);
    fprintf(f, "\"total\": %zu}", total);
}

void fl_plan_write_json(const fl_plan *p, FILE *f) {
    fprintf(f, "{\n  \"version\": %d,\n  \"model\": {\"name\": ", FL_PLAN_JSON_VERSION);
    fl_plan_json_str(f, p->model.name);
    fprintf(f, ", \"source\": ");
    fl_plan_json_str(f, p->model_source);
    fprintf(f, ", \"arch\": \"%s\", \"params\": %zu, \"vocab_size\": %d, \"dim\": %d, \"n_layers\": %d, "
               "\"n_heads\": %d, \"n_kv_heads\": %d, \"ffn_dim\": %d, \"context\": %d},\n",
            fl_arch_get(p->model.arch)->name, p->n_params, p->model.vocab_size, p->model.dim,
            p->model.n_layers, p->model.n_heads, p->model.n_kv_heads, p->model.ffn_dim, p->model.max_seq);
    fprintf(f, "  \"config\": {\"micro_batch_size\": %d, \"accumulation\": %d, \"data_parallel_ranks\": %d, "
               "\"global_batch_size\": %d, \"seq_len\": %d, ",
            p->B, p->accum, p->dp_ranks > 1 ? p->dp_ranks : 1, p->global_batch * (p->dp_ranks > 1 ? p->dp_ranks : 1), p->T);
    if (p->Ts) fprintf(f, "\"source_len\": %d, \"precision\": ", p->Ts); /* an encoder-decoder: seq_len is the target's */
    else fprintf(f, "\"source_len\": null, \"precision\": ");
    fl_plan_json_str(f, p->precision);
    fprintf(f, ", \"optimizer\": ");
    fl_plan_json_str(f, p->optimizer);
    fprintf(f, ", \"activation_checkpointing\": %s, \"eval_generation\": %s, \"devices\": %d, \"rank\": %d, "
               "\"zero_stage\": %d, \"bucket_size\": %zu},\n",
            p->act_ckpt ? "true" : "false", p->generation ? "true" : "false", p->devices > 0 ? p->devices : 1, p->rank,
            p->zero_stage, p->bucket_size);
    if (p->budget) fprintf(f, "  \"budget\": %zu,\n", p->budget);
    else fprintf(f, "  \"budget\": null,\n");
    fprintf(f, "  \"tags\": [");
    for (int t = 0; t < FL_TAG_COUNT; t++) fprintf(f, "%s\"%s\"", t ? ", " : "", fl_mem_tag_name((fl_mem_tag)t));
    fprintf(f, "],\n  \"phases\": [");
    for (int i = 0; i < p->n_phases; i++) {
        fprintf(f, "%s\n    {\"name\": ", i ? "," : "");
        fl_plan_json_str(f, p->phases[i].name);
        fprintf(f, ", \"bytes\": ");
        jtags(f, p->phases[i].cur, p->phases[i].cur_total);
        fprintf(f, ", \"live\": ");
        jtags(f, p->phases[i].live, p->phases[i].live_total);
        fprintf(f, ", \"phase_peak\": %zu}", p->phases[i].peak_total);
    }
    fprintf(f, "%s],\n  \"peak\": ", p->n_phases ? "\n  " : "");
    jtags(f, p->peak, p->peak_total);
    fprintf(f, ",\n  \"host_tier\": "); /* CPU offload: the host memory the run takes beside the device's */
    if (p->offload) jtags(f, p->host_peak, p->host_peak_total);
    else fprintf(f, "null");
    fprintf(f, ",\n  \"nvme_tier\": "); /* NVMe offload: the optimizer state's files */
    if (p->nvme) jtags(f, p->nvme_peak, p->nvme_peak_total);
    else fprintf(f, "null");
    fprintf(f, ",\n  \"verdict\": \"%s\",\n",
            p->verdict == FL_PLAN_FITS && !p->budget ? "unknown" : fl_plan_verdict_name(p->verdict));
    if (p->verdict == FL_PLAN_OOM) {
        const fl_mem_oom *o = &p->oom;
        fprintf(f, "  \"oom\": {\"phase\": ");
        fl_plan_json_str(f, o->phase);
        fprintf(f, ", \"step\": ");
        fl_plan_json_str(f, p->oom_step);
        fprintf(f, ", \"tag\": \"%s\", \"what\": ", fl_mem_tag_name(o->tag));
        fl_plan_json_str(f, p->oom_what);
        fprintf(f, ", \"requested\": %zu, \"available\": %zu, \"in_use\": %zu, \"budget\": %zu},\n", o->requested,
                o->budget > o->in_use ? o->budget - o->in_use : 0, o->in_use, o->budget);
    } else {
        fprintf(f, "  \"oom\": null,\n");
    }
    fprintf(f, "  \"unavailable\": ");
    if (p->verdict == FL_PLAN_UNAVAILABLE) fl_plan_json_str(f, p->unavailable);
    else fprintf(f, "null");
    if (p->max_micro_batch_size >= 0)
        fprintf(f, ",\n  \"max_micro_batch_size\": %d,\n  \"max_micro_batch_size_capped\": %s", p->max_micro_batch_size,
                p->max_micro_batch_size > 0 && p->max_micro_batch_size == p->global_batch ? "true" : "false");
    else fprintf(f, ",\n  \"max_micro_batch_size\": null");
    fprintf(f, ",\n  \"suggestions\": [");
    for (int i = 0; i < p->n_sugg; i++) {
        const fl_plan_suggestion *s = &p->sugg[i];
        fprintf(f, "%s\n    {\"technique\": ", i ? "," : "");
        fl_plan_json_str(f, s->technique);
        fprintf(f, ", \"available\": %s, \"fits\": %s, \"peak\": ", s->available ? "true" : "false",
                s->fits < 0 ? "null" : s->fits ? "true" : "false");
        if (s->fits == 1) fprintf(f, "%zu", s->peak);
        else fprintf(f, "null");
        fprintf(f, ", \"change\": ");
        fl_plan_json_str(f, s->change);
        fprintf(f, ", \"note\": ");
        fl_plan_json_str(f, s->note);
        fputc('}', f);
    }
    fprintf(f, "%s],\n  \"notes\": [", p->n_sugg ? "\n  " : "");
    for (int i = 0; i < p->n_notes; i++) {
        fprintf(f, "%s\n    ", i ? "," : "");
        fl_plan_json_str(f, p->notes[i]);
    }
    fprintf(f, "%s]\n}\n", p->n_notes ? "\n  " : "");
}

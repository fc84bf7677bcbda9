/* fitllm: the training loop behind `fitllm finetune_full` and `fitllm pretrain`
 * (LitGPT's fit()): data, accumulation, LR schedule, clipping, evaluation,
 * logs, checkpoints, resume, and the final report.
 *
 * Progress goes to `out` (NULL = silent); errors come back as fl_status with a
 * message, as everywhere in the library.
 */
#ifndef FITLLM_TRAINER_H
#define FITLLM_TRAINER_H

#include <stdio.h>

#include "fitllm/comm.h"
#include "fitllm/config.h"
#include "fitllm/lora.h"
#include "fitllm/mem.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FL_TRAINER_MAX_PHASES 8
/* pretrain's evaluation sample: the model continues the first this-many tokens of the first
 * validation text (fewer when it is shorter); finetuning uses the instruction prompt */
#define FL_PRETRAIN_PROMPT_TOKENS 16

typedef struct {
    long steps;               /* optimizer steps done in total (incl. before a resume) */
    long iters;
    double last_loss;         /* train loss (running mean) at the end */
    double val_loss;          /* final validation loss (NaN if none) */
    double train_seconds;
    long long tokens_real, tokens_prompt, tokens_padded;
    size_t peak[8];           /* peak bytes per tag (FL_TAG_COUNT) */
    size_t peak_total;
    char final_dir[FL_CFG_PATH + 16];
    fl_mem_oom oom;           /* on FL_ERR_OOM: the failed allocation and the breakdown (oom.valid) */
    /* the memory snapshots (after_load, then before_fwd, after_fwd, after_bwd, after_opt_step of
     * the last step): reserved and live bytes per tag, as the memory report prints them */
    fl_mem_phase phases[FL_TRAINER_MAX_PHASES];
    int n_phases;
    /* data parallel: on failure, 1 when every rank returned this same error (configuration checks
     * and set-up, agreed between the ranks: let rank 0 report it), 0 when it is this rank's own
     * (the others may be waiting in a collective: the CLI aborts the job) */
    int error_all_ranks;
    /* data parallel: the bytes this rank sent in the last step (fl_comm_traffic: gradient reduction,
     * parameter gathers, the step's loss statistics); 0 in one process */
    unsigned long long comm_sent_last_step;
    /* fp16 loss scaling (16-true): the scale at the end and the updates skipped for an inf/NaN in
     * the (reduced) gradients this session; 0 and 0 without loss scaling */
    float loss_scale;
    long skipped_steps;
    /* CPU offload (fl_cfg_offload): 1, and the host tier's peaks (the optimizer state and the update's
     * staging; outside peak[] and the device budget); 0 otherwise */
    int offload;
    size_t host_peak[8];
    size_t host_peak_total;
    /* NVMe offload (offload_optimizer_device nvme): 1, and the disk tier's peaks (the optimizer state's files) */
    int nvme;
    size_t nvme_peak[8];
    size_t nvme_peak_total;
} fl_trainer_result;

/* res (may be NULL) is filled on success and on failure: peak and peak_total
 * are the pool's all-time peaks so far, and an out-of-memory failure copies
 * the pool's OOM record into res->oom (the pool itself is gone on return).
 * Set-up (model, gradients, optimizer state, activations, step buffers) is
 * allocated before out_dir is created, so an OOM there leaves no files. */

/* Whether a data-parallel run reduces its gradients in buckets, block by block as the last
 * micro-batch's backward ends each (DDP and ZeRO-1 of the full model; not ZeRO-2, LoRA or one
 * process). */
int fl_trainer_dp_bucketed(int world, int zero_stage, int lora);
/* FSDP FULL_SHARD / ZeRO-3 (src/train/fsdp.c): the elements of rank `rank`'s shard among `world`
 * (every layout group split by fl_comm's chunk layout on its own: sum over groups of the rank's
 * chunk), what each rank holds of the parameters, gradients and optimizer state. */
size_t fl_fsdp_shard_numel(const fl_param_layout *lay, int world, int rank);
/* Why FULL_SHARD cannot run this configuration, or NULL (every optimizer and precision runs, on host
 * and on device memory; kept as the one place a future refusal goes). p may be NULL. */
const char *fl_fsdp_refusal(const fl_run_config *cfg, const fl_precision *p);

/* Hook for tests: called after every optimizer step (after that step's
 * evaluation and checkpoint) with the step's loss (mean over its valid
 * targets) and the raw bytes of the trained parameters (all of them in their storage dtype,
 * or the LoRA adapters; under FULL_SHARD this rank's shard unless cfg->hook_whole_params). Returning 1 stops training there, with
 * no final checkpoint, as a crash right after the step would; 2 stops there after committing this step's step-*
 * checkpoint (unless train.save_interval just wrote it, or the loss is above the divergence limit): the CLI's
 * answer to a signal under train.save_on_signal. Any rank's request counts for all. */
typedef int (*fl_step_hook)(void *ud, long step, double loss, const void *params, size_t bytes);

/* The LoRA configuration of a finetune_lora run (LitGPT's lora_* switches or a
 * PEFT target list), shared with the planner. */
fl_status fl_trainer_lora_config(const fl_run_config *c, const fl_model_config *mc, fl_lora_config *lc);
/* The parameter storage of a run (shared with the planner): the precision policy's dtype,
 * plus the 4-bit base of QLoRA (finetune_lora with quantize set). */
fl_status fl_trainer_storage(const fl_run_config *c, const fl_precision *p, fl_model_storage *st);

/* The progress bar's ETA in seconds: mean step time of this session (session_seconds /
 * session_steps) x steps_left, capped by max_time - train_seconds when max_time > 0;
 * -1 when nothing was measured yet. */
double fl_trainer_eta(double session_seconds, long session_steps, long steps_left, double max_time,
                      double train_seconds);

fl_status fl_trainer_run(const fl_run_config *cfg, FILE *out, int progress_bar, fl_step_hook hook, void *hook_ud,
                         fl_trainer_result *res);

/* The planner's run (src/plan/plan.c): the trainer's own set-up and first optimizer step, with
 * its own functions (model load, set-up, the step), on backend `be` (the null backend) with a
 * pool of `budget` bytes (0: none). The model is *mc created and randomly initialized (no
 * weights read); the step is `accum` micro-batches of (B, T) tokens (no data read); with
 * gen_prompt > 0 the evaluation follows (a forward without gradients, then the sample of
 * eval.max_new_tokens after a prompt of gen_prompt tokens), snapshotted as "eval_generate" at
 * its first sampled token. Single process (devices x num_nodes ranks are the caller's
 * business). res gets the peaks, the snapshots and, on FL_ERR_OOM, the failed allocation; the
 * error message names the allocation site. */
fl_status fl_trainer_rehearse(const fl_run_config *cfg, const fl_model_config *mc, const fl_backend *be,
                              size_t budget, int B, int T, int accum, int gen_prompt, fl_trainer_result *res);
/* The same for one rank of comm's (several ranks: every rank of comm calls it, each with its own
 * backend, whose comm_create makes the device communicator: the null backend's moves no bytes). The
 * set-up follows fl_trainer_run_comm's (its agreements aside); a rank that fails breaks comm's group
 * (fl_comm_abort's semantics) so the others return instead of waiting. Each rank's res is its own. */
fl_status fl_trainer_rehearse_comm(const fl_run_config *cfg, const fl_model_config *mc, const fl_backend *be,
                                   fl_comm *comm, size_t budget, int B, int T, int accum, int gen_prompt,
                                   fl_trainer_result *res);

/* Data-parallel training (DDP / NO_SHARD) over comm: every rank of comm calls this with the same
 * configuration, whose devices x num_nodes must equal the communicator's size. Each rank trains
 * its share of every step's global batch (global micro-batch j of a step is rank j % size's) and
 * the gradients are summed over the ranks once per step; rank 0 alone prints to `out` (others
 * are silent), writes the metrics and the checkpoints (the single-process format: a single
 * process can resume them). The hook runs on every rank; stopping is decided together. comm NULL
 * (or of size 1) is fl_trainer_run. See docs/ARCHITECTURE.md "Data-parallel training". */
fl_status fl_trainer_run_comm(const fl_run_config *cfg, fl_comm *comm, FILE *out, int progress_bar, fl_step_hook hook,
                              void *hook_ud, fl_trainer_result *res);


/* ---- finite divergence (src/train/divergence.c) ----------------------------------------------
 * A loss that stays above a uniform guess's, ln(vocab_size), by FL_DIVERGE_MARGIN nats after the
 * learning-rate warm-up: the model predicts worse than knowing nothing, and no later step brings
 * it back in practice (lr 50 on micro: 331.8 against ln 512 = 6.2). The run stops as on a NaN.
 * - the training loss of each optimizer step (mean over its valid targets, the same on every
 *   rank) is smoothed by an EMA with weight FL_DIVERGE_ALPHA (a one-step spike moves it by a
 *   tenth), and must stay above the limit for FL_DIVERGE_WINDOW consecutive steps;
 * - a validation loss (already a mean over eval.max_iters batches of the current weights) above
 *   the limit counts at once: the final validation of a run too short to fill the window stops it.
 * Steps before the warm-up's end (step < warmup) do not count: a fresh model starts near ln(V).
 * The margin, 2 nats: the model gives the right token e^-2 = 1/7.4 of a uniform guess's
 * probability on average; a random init starts within a few tenths of ln(V), a healthy run far
 * below it. The window, 20 steps: a few bad batches in a row cannot trip it. */
#define FL_DIVERGE_MARGIN 2.0
#define FL_DIVERGE_WINDOW 20
#define FL_DIVERGE_ALPHA 0.1
/* losses above this many nats print their perplexity as inf: e^20 = 4.9e8 is beyond any vocabulary's
 * uniform guess (the perplexity of a diverged run is otherwise a 143-digit number) */
#define FL_PPL_MAX_LOSS 20.0

typedef struct {
    double limit;       /* ln(vocab_size) + FL_DIVERGE_MARGIN, nats */
    double ln_v;        /* ln(vocab_size) */
    long warmup;        /* steps before this do not count */
    double ema;         /* smoothed training loss; NaN before the first step */
    int above;          /* consecutive counted steps with ema > limit */
    long last_good;     /* the newest step whose weights gave a loss within the limit: a validation after
                         * it, or the next step's training loss (computed before that step's update) and
                         * its EMA; -1 = none yet */
    double value;       /* what tripped it (the EMA or the validation loss) */
    int by_val;         /* 1: a validation loss tripped it */
    long since;         /* first step of the window that tripped it */
} fl_trainer_diverge;

/* vocab_size: the model's; warmup: the LR schedule's warm-up steps. */
void fl_trainer_diverge_init(fl_trainer_diverge *d, int vocab_size, long warmup);
/* The step's training loss (NaN: a fully masked step, ignored). Returns 1 when diverged. */
int fl_trainer_diverge_train(fl_trainer_diverge *d, long step, double loss);
/* A validation loss after `step` optimizer steps (NaN: none). Returns 1 when diverged. */
int fl_trainer_diverge_val(fl_trainer_diverge *d, long step, double val_loss);
/* 1 while the smoothed loss is above the limit (checkpoints should not rotate older ones away). */
int fl_trainer_diverge_suspect(const fl_trainer_diverge *d);
/* The run's error after a trip: FL_ERR_NONFINITE (exit 1), "training diverged at step S (iter I): the
 * ... loss X stayed above ...; stopped without saving final/ (the last good checkpoint, '...', is kept)"
 * with the newest committed step-* of out_dir at or before d->last_good, and the hint. */
fl_status fl_trainer_diverge_error(const fl_trainer_diverge *d, const char *out_dir, double lr, long step, long iter);
/* The newest committed step-* checkpoint of out_dir whose step is <= max_step, into path; 0 if none. */
int fl_trainer_ckpt_at_or_before(const char *out_dir, long max_step, char *path, size_t n);
/* exp(loss), or INFINITY beyond FL_PPL_MAX_LOSS (and for inf/NaN losses: NaN stays NaN). */
double fl_trainer_perplexity(double loss);

#ifdef __cplusplus
}
#endif
#endif

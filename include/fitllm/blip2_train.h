/* fitllm: BLIP-2 image-caption fine-tuning as one library call (src/train/blip2_train.c, blip2_ckpt.c): the loop behind
 * `fitllm finetune_full` / `finetune_lora` on a BLIP-2 folder, BLIP-2's `plan` and `bench-step`, and the lab's BLIP-2
 * rows (`fitllm lab --suite blip2`).
 *
 * A run (rehearse_steps 0): cfg->checkpoint_dir's folder (fitllm/blip2.h), the captions of --data JSON
 * --data.json_path (fitllm/image.h's layouts: JSON/JSONL records, an image folder with a captions file) tokenized with
 * the folder's tokenizer (or read as token ids when it has none; OPT: BOS first, T5: EOS last, cut to
 * train.max_seq_length, default 50, the lab's), each micro-batch's images through the folder's preprocessor_config.json;
 * cfg->blip2_train names the parts that train (default qformer,lm; finetune_lora: LoRA on the language model). AdamW or
 * SGD per part, one clipping norm over all, the LR schedule, gradient accumulation, a validation split, step
 * checkpoints (out_dir/step-NNNNNN: an HF BLIP-2 folder + training_state.safetensors) and bit-exact --resume, the final
 * folder out_dir/final (the trained weights, LoRA merged; adapter/: PEFT). One process, or DDP / ZeRO-1/2 / FSDP
 * FULL_SHARD (cfg->strategy) over comm's ranks (micro-batch a of a step is rank a % world's; gradients and losses
 * summed; under FULL_SHARD every part sharded unit by unit, the checkpoints gathered into the one-process form). What
 * is not built is refused by name.
 *
 * A rehearsal (rehearse_steps > 0): the same set-up and rehearse_steps steps at the configured LR on synthetic data
 * (every caption synth_len random ids, every image random pixels: no data read), no checkpoint, no validation, no
 * files; with shape set no folder is read either (random weights, or zeros on a borrowed backend that computes nothing:
 * the plan's null backend). plan, bench-step and the lab's BLIP-2 rows are rehearsals.
 *
 * Progress goes to `out` (rank 0; NULL: silent). Errors come back as fl_status with a message naming the file, key or
 * rank. */
#ifndef FITLLM_BLIP2_TRAIN_H
#define FITLLM_BLIP2_TRAIN_H

#include <stdio.h>

#include "fitllm/backend.h"
#include "fitllm/blip2.h"
#include "fitllm/comm.h"
#include "fitllm/config.h"
#include "fitllm/mem.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FL_BLIP2_TRAIN_MAX_PHASES 8

typedef struct {
    const fl_blip2_config *shape; /* NULL: cfg->checkpoint_dir's folder and its weights; else this shape, no weights read
                                   * (random from cfg->seed, or zeros on a borrowed backend: see be) */
    const fl_backend *be;         /* NULL: the default backend (fl_backend_default_name) with cfg->threads, created and
                                   * freed by the call; else this one, borrowed (shape set: its weights stay zeros) */
    size_t budget;                /* the device pool's bytes; 0: cfg->max_memory */
    int synth_len;                /* a rehearsal's caption length (>= 2 tokens); 0 in a run */
    long rehearse_steps;          /* > 0: a rehearsal of this many steps (above); 0: the run */
    int plan_world;               /* a rehearsal without comm standing for rank 0 of this many data-parallel ranks
                                   * (plan --devices N): under ZeRO its chunk of the optimizer state; 0, 1: none */
    fl_comm *comm;                /* DDP over comm's ranks (every rank calls with the same cfg); NULL: one process */
    FILE *out;                    /* progress lines (rank 0); NULL: silent */
    FILE *report;                 /* the memory report at the end (per part, per tag, the snapshots); NULL: none */
    /* polled on every rank after each step but the last: non-zero (a signal number) stops the run there (the MAX over
     * the ranks), with a step checkpoint when train.save_on_signal (unless train.save_interval just wrote one); no
     * final evaluation or folder (a rehearsal: it ends there). NULL: never */
    int (*stop)(void *ud);
    void *stop_ud;
    double *step_ms, *step_loss;  /* NULL, or n_step_out entries: each step of this session's wall time and loss */
    long n_step_out;
    int plan_rank;                /* a FULL_SHARD plan (plan_world ranks, or cfg->devices, rehearsed as threads on the
                                   * borrowed null backend): whose memory the result is, 0 .. ranks - 1 */
    /* called on every rank of a run after each step but the last, its checkpoint (if due) committed, before stop is
     * polled: step the steps done (a resumed run's count from its checkpoint's); stop_ud is its ud. NULL: never (the
     * CLI: the training commands' fault hooks, FITLLM_FAULT_DISK_FULL_AFTER_STEP) */
    void (*after_step)(void *ud, long step);
} fl_blip2_train_opts;

typedef struct {
    long steps;                   /* optimizer steps done in all (those before a --resume included) */
    long session_steps;           /* steps run by this call */
    double last_loss;             /* the last step's mean loss over its valid targets */
    double val_loss;              /* the final validation loss (NaN when none ran) */
    double train_seconds;         /* this session's wall time in the step loop */
    double step_ms_mean;          /* mean step time of this session's steps after the first (the first's alone when
                                   * only one ran) */
    size_t trained;               /* trained parameters (the LoRA adapters under LoRA) */
    size_t part_params[FL_BLIP2_PARTS], part_grads[FL_BLIP2_PARTS]; /* bytes per part */
    size_t part_optim[FL_BLIP2_PARTS]; /* this rank's optimizer state per part (ZeRO: its chunk; offload: on the host) */
    size_t part_acts[FL_BLIP2_PARTS], lora_acts; /* the first step's arena per part; the LoRA adapters' ACTS */
    /* the pool: its snapshots (after_load, before_fwd, after_fwd, after_bwd, after_opt_step of the first step, end),
     * peaks per tag and in all; an out-of-memory failure's record (oom.valid) */
    fl_mem_phase phases[FL_BLIP2_TRAIN_MAX_PHASES];
    int n_phases;
    size_t peak[FL_TAG_COUNT], peak_total;
    fl_mem_oom oom;
    /* CPU offload (--strategy deepspeed_stage_{1,2}_offload): 1, and the host tier's peaks (the optimizer state,
     * outside the device pool and its budget); 0 otherwise */
    int offload;
    size_t host_peak[FL_TAG_COUNT], host_peak_total;
    /* NVMe offload (deepspeed_stage_3_offload_nvme, --offload_*_device nvme): 1, and the disk tier's peaks */
    int nvme;
    size_t nvme_peak[FL_TAG_COUNT], nvme_peak_total;
    int stopped;                  /* the stop callback's value that ended the run (0: it ran to the end) */
    int set_up;                   /* 1 when set-up succeeded (on every rank under DDP): a failure after it is the run's */
    int quiet;                    /* DDP: 1 when another rank reports this failure (it failed there first) */
    char final_dir[FL_CFG_PATH + 16]; /* out_dir/final, written by rank 0 ("" for a rehearsal or a stopped run) */
} fl_blip2_train_result;

/* Fine-tune (or rehearse) BLIP-2 as described above. o may be NULL (a run on the folder, one process, silent); res may
 * be NULL, else it is filled on success and on failure (the peaks so far, the OOM record). */
fl_status fl_blip2_train(const fl_run_config *cfg, const fl_blip2_train_opts *o, fl_blip2_train_result *res);

#ifdef __cplusplus
}
#endif

#endif

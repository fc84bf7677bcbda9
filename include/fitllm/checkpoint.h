/* fitllm: training checkpoints.
 *
 * out_dir/step-000100/ (and out_dir/final/) is a Hugging Face folder that
 * transformers loads unchanged (config.json, model.safetensors, tokenizer
 * files, hyperparameters.yaml) plus training_state.safetensors (optimizer
 * state tensors; step, iteration, data position and counters as metadata),
 * which transformers ignores. A LoRA run's step checkpoints are PEFT adapter folders like
 * PEFT's checkpoint-N/ (adapter_config.json + adapter_model.safetensors, tokenizer files,
 * hyperparameters.yaml, the training state with the adapters; no config.json, so
 * transformers loads the base the adapter names): no copy of the frozen base, which stays
 * where it was loaded from and which adapter_config.json names by its absolute path. A LoRA run's final/ is the merged model with the PEFT adapter in final/adapter.
 * A checkpoint is built in a temporary folder,
 * fsynced, renamed into place, and only then marked committed by the file
 * COMMITTED (written atomically). Only committed checkpoints are resumed, so a
 * crash or kill -9 during a save never leaves a checkpoint --resume would pick
 * but could not load.
 */
#ifndef FITLLM_CHECKPOINT_H
#define FITLLM_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/config.h"
#include "fitllm/data.h"
#include "fitllm/model.h"
#include "fitllm/train.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Everything besides parameters and optimizer tensors a bit-exact resume needs (zero-initialize it). */
typedef struct {
    long step;               /* optimizer steps done */
    long iter;               /* micro-batch iterations done */
    fl_loader_state loader;  /* data position */
    long long tokens_real, tokens_prompt, tokens_padded; /* counters of the final report */
    double train_seconds;    /* wall time spent training so far */
    double flops;            /* model FLOPs done so far */
    /* The running loss the log lines show (LitGPT's RunningMean over the G = accumulation x ranks iterations of a
     * step): a ring of loss_window_size losses, the n-th loss pushed (from 0) at n % loss_window_size, loss_window_n
     * pushed so far. The buffer is the caller's (the trainer's; NULL: none, nothing saved). Saved as the metadata
     * loss_window (the last min(n, size) losses, oldest first) and loss_window_n; a load fills the buffer the caller
     * set (keeping it and its size), the same ring when the size is the saved one, else the last losses that fit; a
     * checkpoint without them (older ones) leaves it empty (n = 0). */
    double *loss_window;
    int loss_window_size;
    long loss_window_n;
    /* The divergence detector's running state (fl_trainer_diverge, fitllm/trainer.h: the smoothed loss, the counted
     * steps above the limit, since when, the last good step), set by the trainer as it goes (dv_set 1), so that a
     * resumed run's detector goes on where the checkpoint's stopped. Saved as the metadata diverge_ema,
     * diverge_above, diverge_since, diverge_last_good when dv_set; a checkpoint without them (older ones) loads with
     * dv_set 0 (the detector starts afresh). */
    int dv_set;
    double dv_ema;
    int dv_above;
    long dv_since, dv_last_good;
} fl_train_state;

/* Save to out_dir/<name>. o and st may be NULL (weights-only, e.g. an export).
 * tokenizer_src: the run's tokenizer, a folder whose tokenizer files are copied or one tokenizer
 * file; NULL = the built-in byte tokenizer, written as tokenizer.json (fl_io_write_tokenizer), so
 * that every checkpoint (step-N/, final/, a LoRA step's adapter folder, final/adapter) carries it. */
fl_status fl_ckpt_save(const char *out_dir, const char *name, const fl_model *m, const fl_optimizer *o,
                       const fl_train_state *st, const fl_run_config *cfg, const char *tokenizer_src);
/* fl_ckpt_save with tensors produced while they are written (fl_st_write_tensor's fill_range):
 * model: m->layout.n tensors in layout order (fl_hf_save_tensors' contract), or NULL: m's own
 * weights (not with LoRA, whose base is not saved); state: the optimizer's tensors of the training
 * state (the names, dtypes and lengths fl_ckpt_save gives a whole optimizer; LoRA's lora.params is
 * added from m), n_state of them, NULL: o's own. Metadata from m, o and st as fl_ckpt_save's. Used
 * where the bytes live on several ranks (FSDP, ZeRO), so that no rank holds a whole copy. */
struct fl_st_write_tensor_s; /* fitllm/io.h */
fl_status fl_ckpt_save_streamed(const char *out_dir, const char *name, const fl_model *m, const fl_optimizer *o,
                                const fl_train_state *st, const fl_run_config *cfg, const char *tokenizer_src,
                                const struct fl_st_write_tensor_s *model, const struct fl_st_write_tensor_s *state,
                                int n_state);
/* Write the PEFT adapter of a LoRA model (m->lora) to dir (adapter_config.json +
 * adapter_model.safetensors). base_model is stored as base_model_name_or_path: an existing
 * path as its absolute path (found from any working directory), anything else (a preset
 * name) as given; NULL or "" = null. */
fl_status fl_ckpt_save_adapter(const fl_model *m, const char *dir, const char *base_model);
/* A LoRA run whose base weights were not read from files (--init random, a preset, pretrain's shape) keeps them once
 * in out_dir/base (FL_CKPT_BASE: config.json, model.safetensors, the tokenizer; committed as a checkpoint): its
 * adapters' base_model_name_or_path names it, so that merge_lora, generate and PEFT find the weights they were trained
 * on. fl_ckpt_save_base writes m's weights as they are (a LoRA model's base before any merge, 4-bit ones dequantized)
 * there, replacing an older one. fl_ckpt_adapter_base: what the adapters saved into out_dir name (buf, n: room for
 * the path): out_dir/base when it is committed, else cfg's checkpoint_dir. */
#define FL_CKPT_BASE "base"
fl_status fl_ckpt_save_base(const char *out_dir, const fl_model *m, const char *tokenizer_src);
const char *fl_ckpt_adapter_base(const char *out_dir, const fl_run_config *cfg, char *buf, size_t n);
/* 1 if dir holds a committed checkpoint. */
int fl_ckpt_is_committed(const char *dir);
/* Newest committed step-* checkpoint in out_dir (by step number) into path.
 * FL_ERR_NOT_FOUND if there is none. */
fl_status fl_ckpt_find_latest(const char *out_dir, char *path, size_t n);
/* Load parameters, optimizer state and train state from a committed
 * checkpoint into an initialized model/optimizer of the same shape. */
fl_status fl_ckpt_load(const char *dir, fl_model *m, fl_optimizer *o, fl_train_state *st);
/* Whether the checkpoint dir is the run cfg's to resume, from the checkpoint's hyperparameters.yaml (written by every
 * checkpoint with a configuration; none: nothing is checked), before anything is loaded. mc: the run's model (the
 * whole model's config, not a tensor- or pipeline-parallel slice's). The model is compared by name (a fine-tune's
 * checkpoint_dir, pretrain's model_name / model_config), then where the names differ by config.json's architecture
 * (the checkpoint's, or its model's: a LoRA step has none); the settings the saved state depends on (the optimizer and
 * its state dtype, the adapters' rank, targets and scale: lora_alpha, use_rslora; the data set, data.seed, its split,
 * its size) must be the checkpoint's. Each of those differences is FL_ERR_INVALID naming the key, the checkpoint's
 * value, this run's and the way on (the checkpoint's values, or a new run); another model name of the same
 * architecture (a copy in another folder) and settings that only change the steps to come (lora_dropout, seed, the
 * learning rate and its schedule, the batch, the precision, ...) are "note: --resume: ..." lines in notes (cut at
 * n). src/train/resume_check.c holds the table. */
fl_status fl_ckpt_check_resume(const char *dir, const fl_run_config *cfg, const fl_model_config *mc, char *notes,
                               size_t n);
/* 1 if dir is a sharded checkpoint (--fsdp.state_dict_type sharded: shard-RRRRR-of-NNNNN.safetensors
 * per rank + sharded_state.safetensors); committed or not. */
int fl_ckpt_is_sharded(const char *dir);
/* The consolidated Hugging Face folder of a committed sharded checkpoint (config.json +
 * model.safetensors, sharded above 5 GB as fl_hf_save_model; the tokenizer files copied): `fitllm
 * merge_shards`. Offline (no communicator), streamed: it holds one output tensor at a time (as
 * fp32) besides the shard files' read-only mappings. *n_tok (may be NULL): tokenizer files copied.
 * A missing shard file, a range no file covers or another layout is an error naming the file
 * and the range, and nothing is written. */
fl_status fl_ckpt_merge_shards(const char *ckpt_dir, const char *out_dir, int *n_tok);
/* Delete all but the newest `keep` committed step-* checkpoints (keep > 0). */
void fl_ckpt_rotate(const char *out_dir, int keep);
/* Remove leftover temporary folders of interrupted saves in out_dir. */
void fl_ckpt_clean_tmp(const char *out_dir);
/* --overwrite: a previous run's checkpoints in out_dir (its step-* folders, final/ and base/) removed, so that the new run's
 * --resume auto or a reader of the folder cannot take the old run's for the new one's; their names into said
 * (comma-separated, cut at n). Returns how many were removed. Other files are left. */
int fl_ckpt_remove_run(const char *out_dir, char *said, size_t n);

#ifdef __cplusplus
}
#endif
#endif

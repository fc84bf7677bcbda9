/* Private to src/train: the trainer's state and its phases, one file each (include/fitllm/trainer.h):
 * set-up and tear-down (trainer_setup.c), evaluation and the sample (trainer_eval.c), what the run
 * prints (trainer_out.c), checkpoints and divergence (trainer_ckpt.c), the step loop (trainer.c). */
#ifndef FL_TRAINER_IMPL_H
#define FL_TRAINER_IMPL_H

#include <stdio.h>
#include <time.h>

#include "fitllm/fault.h"
#include "fitllm/generate.h"
#include "fitllm/lora.h"
#include "fitllm/pp.h"
#include "fitllm/tp.h"
#include "fitllm/trainer.h"
#include "dp.h"
#include "metrics.h"

/* The run's backend and memory tiers. */
typedef struct {
    fl_backend be;
    int be_ok;
    fl_mem_pool pool;
    fl_mem_pool hpool;          /* host staging when the backend's memory is not host memory (pool.host) */
    int pool_ok;
    /* CPU offload (fl_cfg_offload): the host tier (the backend's host_pool_init, outside the device budget)
     * and the backend the optimizer's update runs on (hbe: a CPU backend when the device's memory is not
     * host memory; else the run's own) */
    fl_mem_pool opool;
    int opool_ok;
    fl_mem_pool dpool;          /* NVMe offload (offload_optimizer_device nvme): the state's disk tier */
    int dpool_ok;
    fl_backend hbe;
    int hbe_ok;
    fl_optim_offload off;
} trainer_hw;

/* What the run reads: the tokenizer, the dataset and its loaders. */
typedef struct {
    fl_tokenizer *tok;
    char tok_dir[FL_CFG_PATH];  /* where tokenizer files come from ("" = built-in) */
    int32_t stop_ids[FL_MODEL_MAX_EOS]; /* the ids that end the evaluation sample (fl_hf_stop_ids: the model folder's */
    int n_stop;                 /* generation_config.json / config.json eos_token_id and the tokenizer's) */
    int weights_loaded;         /* the model's weights were read from files (fl_tr_load_model): their vocabulary is
                                 * not the built-in bytes', so a tokenizer must come with them */
    int base_kept;              /* LoRA on random weights: out_dir/base holds them (fl_tr_save_base) */
    int base_said;              /* LoRA on random weights, resumed: their reading from base/ said */
    fl_dataset *data;
    size_t n_cut;               /* samples (both splits) not used whole: cut to cut_to tokens (count_cuts) */
    int cut_to, cut_by_ctx;     /* ... by train.max_seq_length, or (cut_by_ctx) by the model's context */
    fl_loader *train, *val;
    /* an encoder-decoder (fl_model_is_s2s): the source/target pairs and their loader instead */
    fl_s2s_data *s2s, *s2s_vdata; /* the training pairs; the validation pairs (data.val_split_fraction), or NULL */
    fl_s2s_loader *s2s_train, *s2s_val;
} trainer_input;

/* The step's buffers. G = accum x world: micro-batches of one optimizer step, all ranks. */
typedef struct {
    int32_t *ids, *tgt;         /* (accum, B, T_max) step buffers of this rank, OTHER */
    int32_t *src;               /* encoder-decoder: (accum, B, Ts) sources and their masks, OTHER */
    uint8_t *src_mask;
    fl_micro_batch *mbs;        /* (accum) this rank's micro-batches of the step */
    long *mb_epoch;             /* (G) epoch each global micro-batch of the step was drawn from */
    long long *mb_tokens;       /* (G) padded tokens of each global micro-batch */
    double *mb_stats;           /* (3 G) rank-major, FL_TR_MB_SLOTS x accum a rank: its micro-batches' (loss sum, valid
                                 * targets) pairs, then their wall ms; gathered after each step (the metrics' iter_time) */
} trainer_bufs;
#define FL_TR_MB_SLOTS 3 /* doubles a micro-batch in trainer_bufs.mb_stats */

/* The shape of a step and the schedule. */
typedef struct {
    int accum, G, B, T;         /* G = accum x world; encoder-decoder: T the longest target */
    int Ts;                     /* encoder-decoder: the longest source (0: a decoder-only run) */
    long max_steps, warmup, steps_per_epoch;
} trainer_sched;

/* Tensor parallelism (--tensor_parallel N > 1, trainer_tp.c): the grid of devices x num_nodes ranks is
 * (ranks / N) data-parallel groups of N consecutive ranks; each rank trains its slice of the model
 * (fl_tp_config) with its group, and the run's fl_dp is the data-parallel axis (the ranks of one tensor-
 * parallel rank across the groups). */
typedef struct {
    int size, rank;             /* the group's size (1: no tensor parallelism) and this rank's place in it */
    fl_comm *world;             /* the whole grid (borrowed): set-up agreements, the lead */
    fl_comm *grp, *dgrp;        /* the tensor-parallel group (owned): on host memory; the backend's device
                                 * communicator over it (NULL: grp reads the backend's memory) */
    fl_comm *dpc;               /* the data-parallel axis (owned; t->dp's communicator) */
    fl_model_config whole;      /* the whole model's config (checkpoints) */
    size_t whole_numel;         /* and its parameters */
    fl_tp_dist dist;            /* the optimizer's hooks over the group */
    fl_tp_dist xdist[FL_PP_MAX_CHUNKS]; /* TP x PP interleaved: chunk c's optimizer's (c >= 1) */
} trainer_tp;

/* Pipeline parallelism (--pipeline_parallel S > 1, trainer_pp.c): world rank w is stage w % S of pipeline w / S;
 * the run's fl_dp is the data-parallel axis (the ranks of one stage across the pipelines). */
typedef struct {
    int size, stage;            /* stages per pipeline (1: none) and this rank's */
    int first, last;            /* this stage's blocks [first, last) of the whole model (interleaved: chunk 0's) */
    int split[65];              /* every (virtual) stage's first block, split[size x chunks] = the blocks */
    int chunks;                 /* model chunks per rank: --pipeline_chunks under interleaved, else 1 */
    fl_model xm[FL_PP_MAX_CHUNKS];     /* interleaved: chunks 1 .. chunks - 1 (virtual stage c size + stage) */
    fl_optimizer xo[FL_PP_MAX_CHUNKS]; /* and their optimizers */
    int xm_ok, xo_ok;           /* how many of xm[1 ..], xo[1 ..] exist */
    fl_dp xdp[FL_PP_MAX_CHUNKS]; /* FULL_SHARD on the data axis: chunk c's units' bookkeeping (xdp[c].fsdp), a copy of
                                  * the axis' fl_dp sharing its communicators (only fl_fsdp_free'd) */
    fl_comm *grp, *dpc;         /* the pipeline and the data-parallel axis (owned) */
    fl_model_config whole;      /* the whole model's config (checkpoints) */
    size_t whole_numel;
    fl_pp rt;                   /* the pipelined step (fitllm/pp.h) */
    int rt_ok;
} trainer_pp;

typedef struct {
    const fl_run_config *cfg;
    fl_run_config *saved_cfg;   /* what checkpoints record (hyperparameters.yaml): cfg with `init` what the model's
                                 * load did (random: no weights read), set by fl_tr_load_model; fl_tr_saved_cfg */
    FILE *out;
    int bar;
    char notes[1024];           /* user settings the run could not take as given, one "note: ..." line each */
    trainer_hw hw;
    fl_model model;
    fl_model_storage stg;       /* parameter storage of the precision policy */
    int model_ok;
    fl_optimizer opt;
    trainer_input in;
    fl_metrics metrics;
    trainer_bufs buf;
    fl_dp dp;                   /* data parallel: rank, world, communicator (see dp.h) */
    trainer_tp tp;              /* tensor parallel (size 1: none) */
    trainer_pp pp;              /* pipeline parallel (size 1: none) */
    trainer_sched sch;
    fl_train_state st;
    fl_fault_fn (*fault_at)(int rank, long step); /* fitllm/fault.h's query when a test armed a fault, else NULL */
} trainer;

/* The configuration a checkpoint's hyperparameters.yaml records (trainer.saved_cfg, else cfg). */
static inline const fl_run_config *fl_tr_saved_cfg(const trainer *t) { return t->saved_cfg ? t->saved_cfg : t->cfg; }

static inline double fl_tr_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* ---- set-up and tear-down (trainer_setup.c) ---- */
/* out_dir holds checkpoints or logs of a run */
int fl_tr_dir_has_run(const char *dir);
/* Tokenizer: the model folder's, an explicit tokenizer_dir, or the built-in bytes. */
fl_status fl_tr_load_tokenizer(trainer *t);
/* The dataset, the loaders, and (B, T): T the longest sample's inputs within max_seq_length. */
fl_status fl_tr_load_data(trainer *t);
/* Data-parallel runs: every rank's training and validation sets (counts, tokens, fl_data_fingerprint) must be rank
 * 0's, else FL_ERR_INVALID on every rank naming the lowest rank that differs and its data files (fl_dp_check_data;
 * collective, agreed). One rank: nothing. */
fl_status fl_tr_check_data(trainer *t);
/* An encoder-decoder's run: what it does not support yet refused, naming the option. */
fl_status fl_tr_check_s2s(const trainer *t, const fl_precision *prec, const fl_strategy_choice *sc);
/* The training loader's micro-batches per epoch and its state (either loader). */
size_t fl_tr_batches_per_epoch(const trainer *t);
void fl_tr_loader_get_state(const trainer *t, fl_loader_state *s);
fl_status fl_tr_loader_set_state(trainer *t, const fl_loader_state *s);
/* accum, G, steps per epoch, max_steps, the warm-up. */
void fl_tr_schedule(trainer *t);
fl_status fl_tr_setup_model(trainer *t, const fl_precision *prec, const fl_model_config *given);
fl_status fl_tr_setup_offload(trainer *t, const fl_strategy_choice *sc);
fl_status fl_tr_setup_training(trainer *t, const fl_run_config *rcfg, const fl_strategy_choice *sc);
void fl_tr_cleanup(trainer *t);
void fl_tr_cleanup_keep_error(trainer *t, fl_status s);

/* ---- evaluation (trainer_eval.c) ---- */
fl_status fl_tr_validate(trainer *t, int max_iters, double *loss);
/* The run has a validation split (the decoder-only loader's, or an encoder-decoder's pairs); its batches. */
int fl_tr_has_val(const trainer *t);
long fl_tr_val_batches(const trainer *t);
fl_status fl_tr_sample_tokens(trainer *t, const int32_t *ids, int n, const int32_t *eos, int n_eos, int32_t *gen,
                              int *n_out, fl_gen_callback cb, void *ud);
fl_status fl_tr_generate_example(trainer *t);
fl_status fl_tr_generate_example_s2s(trainer *t); /* an encoder-decoder's, in the training arena */

/* ---- output (trainer_out.c) ---- */
void fl_tr_bar_clear(trainer *t);
void fl_tr_bar_draw(trainer *t, long step, double eta);
void fl_tr_print_box(trainer *t, const fl_trainer_result *r);
void fl_tr_mem_values(const fl_mem_pool *p, fl_metrics_values *v);
void fl_tr_print_header(trainer *t, fl_comm *comm, const fl_precision *prec, const fl_strategy_choice *sc);
void fl_tr_print_memory(trainer *t);
void fl_tr_val_row(trainer *t, double val_loss);

/* ---- tensor parallelism (trainer_tp.c) ---- */
/* Split world into the grid's axes (collective; tensor_parallel 1: *dp_comm = world, nothing split), after the
 * refusals every rank makes alike (fl_tr_tp_check's; given: the planner's model shape, its split). */
fl_status fl_tr_tp_begin(trainer *t, fl_comm *world, const fl_model_config *given, fl_comm **dp_comm);
/* Whether this rank leads the run (prints, logs, writes checkpoints): the grid's rank 0. */
int fl_tr_tp_lead(const trainer *t);
/* What tensor parallelism does not combine with yet (refused naming the option), before the model loads. */
fl_status fl_tr_tp_check(const trainer *t, const fl_strategy_choice *sc);
/* The model: the whole one loaded into a pool of its own (outside the budget), this rank's slice made in the
 * run's pool and filled, the whole one freed; the group attached (fl_model_set_tp). */
fl_status fl_tr_tp_load(trainer *t, const fl_model_config *given);
/* After the optimizer: its hooks over the group (fl_tp_optim_attach). */
fl_status fl_tr_tp_attach(trainer *t);
/* Consolidated checkpoints: the whole model and optimizer state gathered on the lead (host staging outside
 * the pool), written as one process writes them (collective over the first data-parallel group's tensor-
 * parallel group); the load reads the whole checkpoint (any tensor-parallel size wrote it) and takes the
 * slice. o NULL: the weights alone. */
fl_status fl_tr_tp_save(trainer *t, int lead, const char *name, const fl_optimizer *o, const fl_train_state *st);
fl_status fl_tr_tp_ckpt_load(trainer *t, const char *path);
void fl_tr_tp_end(trainer *t);
/* v[0..n) summed over every rank of the grid (fl_dp_sum over the whole grid; without tensor parallelism the
 * data-parallel ranks): the run's stop decisions, which every rank must take alike. */
fl_status fl_tr_sum_all(trainer *t, double *v, int n);
/* The run header's line (the lead). */
void fl_tr_tp_print(const trainer *t, fl_comm *world);
/* A whole model (and optimizer, o given) of cfg in pools of its own, outside the run's budget: checkpoint staging. */
typedef struct {
    fl_mem_pool pool, hpool;
    int pool_ok;
    fl_model m;
    int m_ok;
    fl_optimizer o;
    int o_ok;
} tp_whole;
fl_status fl_tr_whole_make(trainer *t, tp_whole *w, const fl_model_config *cfg, const fl_optimizer *o);
void fl_tr_whole_free(tp_whole *w);

/* ---- pipeline parallelism (trainer_pp.c; EXPERIMENTAL) ---- */
/* fl_tr_tp_begin's counterpart (it calls this under --pipeline_parallel): refusals, the pipeline and the
 * data-parallel axis split from world. */
fl_status fl_tr_pp_begin(trainer *t, fl_comm *world, const fl_model_config *given, fl_comm **dp_comm);
fl_status fl_tr_pp_check(const trainer *t, const fl_strategy_choice *sc);
/* This stage's blocks [first, last) and every stage's (t->pp.split) of the whole model's config. */
fl_status fl_tr_pp_stage_range(trainer *t, const fl_model_config *whole);
/* The whole model loaded outside the pool, this stage's blocks taken into the run's pool. */
fl_status fl_tr_pp_load(trainer *t, const fl_model_config *given);
/* After the optimizer: the pipelined step (fl_pp_init) and its hooks. */
fl_status fl_tr_pp_attach(trainer *t);
/* LoRA on a stage: the whole model's index of the stage's first module (the modules of the blocks before it). */
fl_status fl_tr_pp_lora_base(const trainer *t, const fl_lora_config *lc, int *base);
/* Consolidated checkpoints (the first pipeline gathers on its stage 0, which writes as one process does); the
 * load reads the whole checkpoint and takes the stage. */
fl_status fl_tr_pp_save(trainer *t, int lead, const char *name, const fl_optimizer *o, const fl_train_state *st);
/* Its gather and write without the grid's agreement, from the stage's model m and its optimizer o (TP x PP: the
 * stage assembled from its tensor-parallel slices on their rank 0, whose first pipeline runs it). */
fl_status fl_tr_pp_save_stage(trainer *t, int lead, const char *name, const fl_model *m, const fl_optimizer *o,
                              const fl_train_state *st);
/* The same with the interleaved schedule's later chunks given (xm[c], xo[c] for c >= 1: TP x PP, each chunk assembled
 * from its slices; NULL: the run's t->pp.xm, t->pp.xo). */
fl_status fl_tr_pp_save_stage_v(trainer *t, int lead, const char *name, const fl_model *m, const fl_optimizer *o,
                                const fl_model *const *xm, const fl_optimizer *const *xo, const fl_train_state *st);
fl_status fl_tr_pp_ckpt_load(trainer *t, const char *path);
/* TP x PP with LoRA: the stage's modules of a whole checkpoint's adapters and state (w) into sw (trainer_tp.c's resume). */
fl_status fl_tr_pp_lora_stage_state(trainer *t, tp_whole *w, tp_whole *sw, int v);
/* LoRA on a pipeline stage: the run's seed shifted to the stage's first module (fl_tp_lora_init's draws as
 * fl_model_lora_init_at's: module j + base of the whole model). */
uint64_t fl_tr_pp_lora_seed(const trainer *t);
/* The pipelined step and the interleaved schedule's later chunks (models, optimizers) freed, before the pool. */
void fl_tr_pp_free_chunks(trainer *t);
void fl_tr_pp_end(trainer *t);
void fl_tr_pp_print(const trainer *t);
/* The stage's or slice's whole state array arr of o into host memory *full (malloc'd): ZeRO's chunks all-gathered
 * over the data axis (a collective of it), else a copy. */
fl_status fl_tr_state_whole(const fl_optimizer *o, fl_comm *axis, const void *arr, fl_dtype dt, void **full);
/* At the end of a run (every rank of the grid): the measured stage times and the schedule on them (the lead prints). */
fl_status fl_tr_pp_report(trainer *t);
/* The model of load_model (trainer_setup.c) into m from pool (*ok: m is to be freed). */
fl_status fl_tr_load_model(trainer *t, const fl_model_config *given, fl_model *m, fl_mem_pool *pool, int *ok);

/* ---- checkpoints and divergence (trainer_ckpt.c) ---- */
fl_status fl_tr_diverged(const trainer *t, fl_status s, long step, long iter);
fl_status fl_tr_check_weights(trainer *t);
fl_status fl_tr_save_step(trainer *t, int lead, int rotate);
fl_status fl_tr_resume(trainer *t, int *resumed);
/* The lead: a LoRA run whose base weights were not read from files (--init random, a preset) saves them once to
 * out_dir/base (fl_ckpt_save_base), which its adapters then name. Called at set-up (setup 1: a resumed run keeps the
 * committed one; tensor / pipeline parallel save there, making the whole model again as the load did, while the
 * memory is free) and before each adapter is saved (a step checkpoint, final/ before the merge: a whole model saves
 * its own base then, so that a run that saves no adapter, the lab's rows, writes none). Said on t->out. */
fl_status fl_tr_save_base(trainer *t, int setup, int resumed);

#endif

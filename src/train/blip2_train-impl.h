/* BLIP-2 image-caption fine-tuning (fitllm/blip2_train.h): the run's state shared by the loop (blip2_train.c) and its
 * checkpoints (blip2_ckpt.c). Private to src/train. */
#ifndef FL_BLIP2_TRAIN_IMPL_H
#define FL_BLIP2_TRAIN_IMPL_H

#include <stdint.h>

#include "fitllm/blip2.h"
#include "fitllm/blip2_train.h"
#include "fitllm/image.h"
#include "fitllm/train.h"
#include "dp.h"
#include "metrics.h"

typedef struct {
    const fl_run_config *cfg;
    const fl_blip2_train_opts *o; /* the caller's options (never NULL here: defaults filled in) */
    fl_blip2_train_result *res;   /* what the call reports (never NULL here) */
    int lora;                /* finetune_lora: adapters on the language model */
    int parts;               /* 1 << FL_BLIP2_* of the parts that train */
    fl_backend be;
    fl_mem_pool pool, hpool;
    fl_blip2 *b;
    fl_model_storage stg[FL_BLIP2_PARTS]; /* each part's storage (bf16-true; QLoRA's 4-bit block linears) */
    fl_img_proc proc;
    fl_img_captions caps;
    int32_t **ids;           /* per record: the caption's ids (BOS first when the language model has one) */
    int *n_ids;
    size_t n_rec;            /* training records (the captions', or the synthetic ones) */
    size_t n_val;            /* validation records: ids[n_rec, n_rec + n_val) (data.val_split_fraction) */
    fl_optimizer opt[FL_BLIP2_PARTS];
    int has_opt[FL_BLIP2_PARTS];
    /* plan / bench-step / the lab: no data read */
    const fl_blip2_config *given; /* a preset's (or config.json's) shape instead of the folder's weights */
    const fl_backend *borrowed;   /* the backend to run on (plan: the null backend), else the run's own */
    int synth;                    /* > 0: every caption this many tokens, random ids and pixels (no data read) */
    size_t budget;                /* the pool's (plan --device-memory); 0: the run's max_memory */
    uint64_t rng;
    int pools_ok;
    fl_comm *comm;                /* DDP over several ranks (NULL: one process) */
    size_t acts_part[FL_BLIP2_PARTS], acts_total; /* ACTS by part and in all at the first step's after_fwd */
    int snapline;                 /* this step prints the per-phase lines (train.memory_snapshot_interval) */
    int stopped;                  /* the stop callback's value that stopped the run after a step */
    long steps_done;
    int rank, world;
    /* strategies (blip2_dist.c): the data-parallel context, the configuration fl_dp_optim_init reads, CPU offload's
     * host tier and the backend its update runs on */
    fl_dp dp;
    fl_dp pdp[FL_BLIP2_PARTS];    /* FSDP FULL_SHARD / ZeRO-3: each part's sharding (pdp[k].fsdp), else zeros */
    fl_comm *fdev;                /* their device communicator: a plan's null one (owned), else NULL */
    fl_run_config dcfg;
    fl_mem_pool opool;
    fl_mem_pool dpool;            /* NVMe offload: the disk tier (the state's and / or the parameters' shards) */
    fl_backend hbe;
    fl_optim_offload off;
    int opool_ok, hbe_ok, dpool_ok;
    fl_metrics metrics;           /* out_dir/logs/metrics.csv (rank 0 of a run) */
} b2run;

typedef struct {
    size_t *order, pos;
    long epoch;
    double epoch_sum;
    long epoch_n;
    long step; /* optimizer steps done */
    long long tokens; /* the valid caption targets of every step so far (metrics.csv's total_tokens) */
} b2pos;

/* What the run prints: rank 0's lines only (DDP), to the options' out (NULL: nothing). */
void fl_b2t_say(const b2run *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- strategies (blip2_dist.c) ---- */
/* What --strategy (and its offload options) this run supports; the rest refused by name. */
fl_status fl_b2t_check_strategy(const fl_run_config *c);
/* The data-parallel context and CPU offload's host tier (after the backend and pools, before the optimizers). */
fl_status fl_b2t_dist_setup(b2run *r);
/* Part k's optimizer under the run's strategy (ZeRO: this rank's chunk; offload: the host tier). */
fl_status fl_b2t_optim_init(b2run *r, int k);
/* The step's gradient reductions (every trained part) and the micro-batches' losses summed over the ranks. */
fl_status fl_b2t_reduce(b2run *r, float *ml, int accum);
/* Clipping by the norm over every trained part's gradients. */
fl_status fl_b2t_clip(b2run *r, float max_norm);
/* 1 when the optimizer state is divided over the ranks (ZeRO-1/2 at several ranks). */
int fl_b2t_sharded(const b2run *r);
/* FSDP FULL_SHARD / ZeRO-3 of full fine-tuning at several ranks: each part created sharded (before the load, with the
 * parts' storage r->stg), the gathered units' compute copy (after the precision), given back (before the parts are
 * freed). No-ops otherwise. fl_b2t_fsdp: some part is sharded. */
fl_status fl_b2t_fsdp_prepare(b2run *r, const fl_precision *prec);
fl_status fl_b2t_fsdp_init(b2run *r);
void fl_b2t_fsdp_free(b2run *r);
/* A plan (the null backend, no communicator) of FULL_SHARD over N ranks: N (plan_world, else devices), else 0; the
 * ranks then rehearse as threads (fl_b2t_plan_fsdp: rank 0's result into res). */
int fl_b2t_plan_ranks(const fl_run_config *c, const fl_blip2_train_opts *o);
fl_status fl_b2t_plan_fsdp(const fl_run_config *c, const fl_blip2_train_opts *o, int n, fl_blip2_train_result *res);
int fl_b2t_fsdp(const b2run *r);
void fl_b2t_dist_free(b2run *r);
/* Several ranks (not a rehearsal): every rank's configuration and data must be rank 0's, as the trainer's
 * (fl_dp_check_config, then fl_dp_check_data over each split's records: the captions' ids, the images' file names and
 * sizes). Collective and agreed: every rank returns the lowest differing rank's FL_ERR_INVALID. */
fl_status fl_b2t_check_data(b2run *r);

/* ---- checkpoints (blip2_ckpt.c) ---- */
/* out_dir/step-NNNNNN (an HF BLIP-2 folder, or the PEFT adapter under LoRA, + training_state.safetensors and
 * hyperparameters.yaml), built in a temporary folder, renamed into place, then committed (nothing left on a failure). */
fl_status fl_b2t_save_step(b2run *r, const b2pos *p);
/* --resume: the trained parts' parameters and optimizer state, the data position (*resumed 1 when one was read). */
fl_status fl_b2t_resume(b2run *r, b2pos *p, int *resumed);
/* out_dir/final, committed as a step checkpoint is (hyperparameters.yaml, COMMITTED; nothing left on a failure): the
 * weights (LoRA merged), adapter/ (PEFT) under LoRA; full fine-tuning's with the training state at position p (as the
 * trainer's final/: --resume final/ goes on). Every rank calls it; rank 0 writes (FSDP, ZeRO: gathered first). */
fl_status fl_b2t_save_final(b2run *r, const b2pos *p);

#endif

/* fitllm: the memory planner behind `fitllm plan` (and the lab's "planned" column).
 *
 * Given a run configuration and a device memory size, the planner predicts the
 * bytes per tag (PARAMS, GRADS, OPTIM, ACTS, WORKSPACE, OTHER), reserved and
 * live (fitllm/mem.h), at each phase (after_load, then a training step's
 * before_fwd, after_fwd, after_bwd, after_opt_step, and eval_generate when the
 * run generates a sample at evaluation), the peak, and
 * the verdict: fits, or out of memory at which phase, tag and allocation.
 *
 * One source of truth: the planner does not have a formula of its own. For one
 * process it runs the trainer's own set-up and first step (fl_trainer_rehearse:
 * model load, gradients or adapters, optimizer state, activations, step buffers,
 * forward, backward, update, the evaluation sample) on the null backend, whose
 * ops do nothing and whose pool hands out addresses that are never touched: the
 * allocations, the budget check, the per-tag counters, the phase snapshots and
 * the OOM record are the runtime's own. One rank of a multi-rank run (DDP, ZeRO,
 * FSDP) is planned by running every rank's set-up and first step as threads, each
 * on its own null backend whose communicator moves nothing but takes the planned
 * run's collective scratch (fl_trainer_rehearse_comm, fl_comm_null_create).
 *
 * Data dependence: the trainer sizes activations for T = the longest sample,
 * capped by train.max_seq_length and the model context. The planner does not
 * read the data; it takes T = train.max_seq_length (or the model context when
 * that is null), an upper bound, unless opts.seq_len says otherwise, and says
 * so in the notes. An encoder-decoder (T5) has two lengths: the source (opts.seq_len, else
 * data.max_source_length) and the target (opts.target_len, else data.max_target_length), both the
 * trainer's upper bounds (it sizes for the longest source and target, cut to those limits).
 *
 * Nothing here prints except fl_plan_print / fl_plan_write_json, which write
 * to the FILE* they are given.
 */
#ifndef FITLLM_PLAN_H
#define FITLLM_PLAN_H

#include <stdio.h>

#include "fitllm/config.h"
#include "fitllm/mem.h"
#include "fitllm/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Version of the `fitllm plan --json` schema (docs/ARCHITECTURE.md "Planner and lab"). */
#define FL_PLAN_JSON_VERSION 2 /* 2: phases start with after_load; each has "live" beside "bytes" */

typedef enum {
    FL_PLAN_FITS = 0,        /* every allocation of the run fits the budget (or there is no budget) */
    FL_PLAN_OOM,             /* an allocation fails: see fl_plan.oom / oom_what / oom_step */
    FL_PLAN_UNAVAILABLE,     /* the config asks for a technique this build does not have */
    FL_PLAN_VERDICT_COUNT
} fl_plan_verdict;

const char *fl_plan_verdict_name(fl_plan_verdict v); /* "fits", "oom", "not_available" */

/* Memory-saving techniques the planner knows, and whether this build has them.
 * The one table to update when a technique lands (src/plan/plan.c k_tech). */
typedef struct {
    const char *name;      /* "micro_batch", "sgd", "bf16-true", "lora", ... */
    int available;         /* 1: the trainer implements it */
    const char *how;       /* how a run asks for it */
    const char *note;      /* why not (when unavailable) */
} fl_plan_technique;

const fl_plan_technique *fl_plan_techniques(int *n);
/* 1 available, 0 not in this build, -1 unknown name. */
int fl_plan_technique_available(const char *name);

typedef struct {
    size_t device_memory;  /* budget in bytes; 0: the config's max_memory; both 0: no budget */
    int devices;           /* > 1: plan one rank of a DDP run over this many ranks (0, 1: the config's) */
    int seq_len;           /* > 0: plan for this T instead of max_seq_length / the context (an encoder-decoder: the
                            * source length instead of data.max_source_length) */
    int target_len;        /* an encoder-decoder: > 0 plan for this target length instead of data.max_target_length */
    int generation;        /* -1 auto (as the CLI run would), 0 off, 1 on */
    int no_suggestions;    /* skip the suggestion search (used by the search itself) */
    int rank;              /* ZeRO / FSDP: plan this rank (ZeRO's chunks differ by one element at most, FULL_SHARD's
                            * shards by one per unit); default 0 */
    int cuda;              /* 1: plan a run on the CUDA backend (its op scratch and GEMM widening; the device
                            * pool only: host staging is not device memory); 0: the CPU backend */
    int comm_threads;      /* several ranks: 1 = they run as threads of one process (the threads communicator
                            * reads its peers' buffers, so reductions take no receive scratch; the lab's ddp and
                            * fsdp rows); 0 = processes under MPI (the default) */
    double block_ms;       /* --pipeline_parallel: > 0, one block's measured forward + backward of a micro-batch (ms;
                            * a pipelined run's "pipeline timing" line prints it): the expected step time in ms; 0:
                            * in units of that time */
    size_t *rank_peaks;    /* several ranks: NULL, or devices x num_nodes entries that get every rank's planned peak
                            * of the run without a budget (device bytes; the grid suggestion's largest rank) */
    size_t *rank_host_peaks; /* with rank_peaks: every rank's host tier peak */
} fl_plan_opts;

void fl_plan_opts_default(fl_plan_opts *o);

#define FL_PLAN_MAX_PHASES 8
#define FL_PLAN_MAX_SUGG 16
#define FL_PLAN_MAX_NOTES 12

typedef struct {
    char technique[32];    /* a name from fl_plan_techniques() */
    int available;         /* this build has it */
    int fits;              /* 1 fits, 0 still OOM, -1 unknown (not available) */
    size_t peak;           /* planned peak with the change (0 when unknown) */
    char change[160];      /* command-line options that make the change */
    char note[200];
} fl_plan_suggestion;

typedef struct {
    /* what was planned */
    fl_model_config model;
    char model_source[64];     /* "preset", "config.json" */
    size_t n_params;
    int B, accum, global_batch, T; /* per rank: global_batch = the run's / devices; T (an encoder-decoder: the target's) */
    int dp_ranks;                  /* the data-parallel ranks the run's global batch is split over (1: none) */
    int Ts;                    /* an encoder-decoder: the source length planned; 0 otherwise */
    int devices;               /* ranks (DDP: the plan is one rank's memory) */
    int rank, zero_stage;      /* the rank planned; ZeRO stage of the strategy (0: DDP or one process, 3: FSDP
                                * FULL_SHARD; LoRA under FULL_SHARD: 2) */
    size_t bucket_size;        /* --bucket_size: the gradient reductions' bucket bytes (0: one collective each) */
    char precision[16];
    char optimizer[24];        /* "AdamW", "SGD", "SGD+momentum" */
    int act_ckpt;
    int generation;            /* eval sample generation planned */
    int gen_prompt_tokens, gen_capacity;
    size_t budget;             /* 0 = none */
    /* bytes: the whole run without a budget (what it needs) */
    fl_mem_phase phases[FL_PLAN_MAX_PHASES];
    int n_phases;
    size_t peak[FL_TAG_COUNT];
    size_t peak_total;
    /* CPU offload (--strategy deepspeed_stage_{1,2}_offload): 1, and the host tier's peak per tag (the
     * optimizer state and the update's staging), outside peak[] and the budget; 0 otherwise */
    int offload;
    size_t host_peak[FL_TAG_COUNT];
    size_t host_peak_total;
    /* NVMe offload: 1, and the disk tier's peak (the optimizer state's files) */
    int nvme;
    size_t nvme_peak[FL_TAG_COUNT];
    size_t nvme_peak_total;
    /* the verdict under the budget */
    fl_plan_verdict verdict;
    fl_mem_oom oom;            /* FL_PLAN_OOM: the first allocation that fails (the allocator's record) */
    char oom_what[96];         /* which buffer, as the failing allocation site says, e.g. "allocating AdamW state" */
    char oom_step[32];         /* the planned phase it belongs to, e.g. "before_fwd" (set-up) or "eval_generate" */
    char unavailable[256];     /* FL_PLAN_UNAVAILABLE: what is missing */
    int max_micro_batch_size;  /* largest divisor of the global batch that fits; 0 none; -1 no budget */
    fl_plan_suggestion sugg[FL_PLAN_MAX_SUGG];
    int n_sugg;
    char notes[FL_PLAN_MAX_NOTES][240];
    int n_notes;
} fl_plan;

/* Plan the run `cfg` describes (the same config finetune_full / pretrain take).
 * Returns FL_OK with a verdict (fits / OOM / not available are all results);
 * an error only when the config is invalid or the model cannot be resolved
 * (preset name, HF folder with config.json, or a config.json file). */
fl_status fl_plan_run(const fl_run_config *cfg, const fl_plan_opts *opts, fl_plan *out);
/* For planners of their own (the BLIP-2 fine-tuning's, src/cli/cmd_blip2_plan.c): a note (up to FL_PLAN_MAX_NOTES),
 * and the verdict's record of a rehearsal that ran out of memory (the pool's oom, the snapshots it took before, its
 * ranks: the phase it failed in; oom_what from this thread's error message). */
void fl_plan_note(fl_plan *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void fl_plan_set_oom(fl_plan *p, const fl_mem_oom *oom, int n_phases, int ranks);

/* "The largest model that fits" a machine (src/plan/plan_fit.c; `fitllm plan --largest`): the LLaMA presets from
 * 1.1 B to 13 B, each planned with the run's options (precision, batch, T, optimizer), as given, then with ZeRO-3
 * and the optimizer in host memory, then the parameters too, then both on NVMe; the first that fits is its row. A
 * variant fits when the device's plan does and the machine's host RAM and disk hold devices x the rank's host and
 * NVMe tiers (a CPU: the device is the RAM, the budget RAM / devices, and the host tier is the same RAM). */
typedef struct {
    size_t device_memory;  /* each device's memory (cuda); ignored on a CPU */
    size_t host_memory;    /* the host's RAM (required on a CPU; 0 on a GPU machine: not limited) */
    size_t disk;           /* the NVMe folder's free bytes (0: not limited) */
    int devices;           /* ranks on the machine (0, 1: one) */
    int cuda;              /* 1: GPUs (the device pool is theirs), 0: CPU ranks */
    int seq_len;           /* > 0: T to plan for (else the run's) */
    int generation;        /* --suggest: the evaluation sample's generation as fl_plan_opts.generation (-1 as the
                            * CLI run makes it, 1 on); 0 off (--largest plans without it) */
} fl_plan_machine;
typedef struct {
    char model[32];
    size_t n_params;
    int fits;
    char how[160];         /* "as given" or the options of the first variant that fits */
    size_t device_peak, host_peak, nvme_peak; /* that variant's, per rank (none fits: the last tried) */
    int device_fits;       /* the last variant planned fits the device (none fits: then a tier is the limit) */
} fl_plan_fit_row;
typedef struct {
    fl_plan_fit_row rows[8];
    int n;
    int best;              /* index of the largest that fits; -1 none */
} fl_plan_fit;
fl_status fl_plan_largest(const fl_run_config *cfg, const fl_plan_machine *mc, fl_plan_fit *out);
void fl_plan_fit_print(const fl_plan_fit *f, const fl_plan_machine *mc, FILE *out);

/* "Which grid?" (src/plan/plan_grid.c; `fitllm plan --suggest`): every DP x TP x PP grid of the run's devices x
 * num_nodes ranks (mc->devices per node), each rank of its first model replica planned by fl_plan_run with the run's
 * options; a grid fits when its largest rank does (mc->device_memory per rank; CPU ranks without it: host_memory /
 * devices, the host tier counted in it). The suggestion: the fewest model-parallel ranks (TP x PP), then no TP group
 * wider than a node, then the smallest pipeline bubble (PP - 1) / (M + PP - 1), then the smallest peak; the chosen
 * grid's largest rank is planned again under the budget (verdict). A grid the trainer refuses is a row (fits -1). */
#define FL_PLAN_MAX_GRIDS 48
typedef struct {
    int dp, tp, pp;
    int fits;              /* 1 every rank fits, 0 one does not, -1 the trainer refuses this grid (why) */
    size_t peak;           /* the largest rank's planned peak (device bytes), and which world rank that is */
    int peak_rank;
    size_t host_peak;      /* the largest host tier of its ranks (offload) */
    int micro_batches;     /* per step and data-parallel rank (gradient accumulation): PP's micro-batches */
    double bubble;         /* PP's idle fraction (PP - 1) / (M + PP - 1); 0 without PP */
    char strategy[32];     /* the data axis's strategy as resolved ("" when DP is 1) */
    char why[256];
} fl_plan_grid_row;
typedef struct {
    fl_plan_grid_row rows[FL_PLAN_MAX_GRIDS];
    int n;
    int best;              /* the suggested row; -1 none fits */
    fl_plan_verdict verdict; /* the suggested grid's largest rank planned under the budget (FL_PLAN_FITS) */
} fl_plan_grid;
fl_status fl_plan_suggest_grid(const fl_run_config *cfg, const fl_plan_machine *mc, fl_plan_grid *out);
void fl_plan_grid_print(const fl_plan_grid *g, const fl_plan_machine *mc, FILE *out);
/* The same as JSON (plan --suggest --json; "version" FL_PLAN_JSON_VERSION, "kind" "grid_suggestion") */
void fl_plan_grid_write_json(const fl_plan_grid *g, const fl_plan_machine *mc, FILE *out);

/* --strategy auto on a tensor- or pipeline-parallel grid with a data axis (src/plan/plan_auto.c): the data axis's
 * strategy chosen by the per-rank plan, the first of ddp, deepspeed_stage_1, deepspeed_stage_2, fsdp (FULL_SHARD),
 * deepspeed_stage_2_offload, deepspeed_stage_3_offload whose every rank's planned peak fits the budget
 * (device_memory, else the config's max_memory); a candidate the trainer refuses on this grid is skipped, saying why;
 * none fitting: the one with the smallest largest rank. No budget: ddp. *strategy "" when the rule does not apply (a
 * strategy given, one data-parallel rank, no TP / PP, finetune_lora: fl_cfg_resolve_strategy's choice stands). why:
 * the reason, one line. The planner (fl_plan_run) and the CLI's training commands call it; the library's trainer
 * takes the strategy it is given. */
fl_status fl_plan_auto_strategy(const fl_run_config *cfg, int cuda, size_t device_memory, char *strategy, size_t n,
                                char *why, size_t why_n);
/* fl_plan_run's use of it: where auto chooses, *c becomes cd (a copy of *c, or cd itself already) with the choice;
 * head gets the choice's reason up to its first "; ", rest what came before it (both "" when auto does not choose:
 * a note holds 240 characters) */
fl_status fl_plan_auto_resolve(const fl_run_config **c, fl_run_config *cd, int cuda, size_t device_memory, char *head,
                               size_t head_n, char *rest, size_t rest_n);

/* Human report: summary, the phase table (as the runtime's memory report),
 * the verdict, the largest micro batch, suggestions. */
void fl_plan_print(const fl_plan *p, FILE *f);
/* The --json document (schema version FL_PLAN_JSON_VERSION). */
void fl_plan_write_json(const fl_plan *p, FILE *f);

#ifdef __cplusplus
}
#endif
#endif

/* fitllm: run configuration with LitGPT's names and defaults.
 *
 * Precedence: built-in defaults < --config YAML < dotted command-line
 * overrides (--train.micro_batch_size 8). YAML is parsed with libyaml; LitGPT's
 * config_hub files load unchanged (class_path: litgpt.data.Alpaca2k,
 * torch.optim.AdamW, init_args, model_config: {...}, devices: auto). An unknown
 * key is an error that suggests the nearest valid key.
 *
 * The recipe and the command line are MERGED before any value is checked (as
 * jsonargparse does): `--data TextFiles` replaces a recipe's `data: TinyStories`
 * (and the recipe's data.* fields, which belonged to the class it replaces), so
 * a value fitllm does not support can be overridden instead of failing first.
 */
#ifndef FITLLM_CONFIG_H
#define FITLLM_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "fitllm/data.h"
#include "fitllm/model.h"
#include "fitllm/status.h"
#include "fitllm/optim_config.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FL_CFG_PATH 4096
#define FL_CFG_MODEL_FIELDS 48

typedef enum { FL_CMD_FINETUNE_FULL = 0, FL_CMD_PRETRAIN, FL_CMD_FINETUNE_LORA, FL_CMD_COUNT } fl_cmd_kind;

typedef struct {
    int save_interval;        /* optimizer steps between checkpoints; 0 = never (null) */
    int log_interval;         /* iterations between log lines */
    int global_batch_size;
    int micro_batch_size;
    int lr_warmup_steps;      /* -1 = null */
    float lr_warmup_fraction; /* < 0 = null */
    int epochs;               /* -1 = null */
    long long max_tokens;     /* -1 = null */
    int max_steps;            /* -1 = null */
    int max_seq_length;       /* -1 = null */
    int tie_embeddings;       /* -1 = null (keep the checkpoint's) */
    float max_norm;           /* <= 0 = null (no clipping) */
    float min_lr;
    int activation_checkpointing; /* fitllm extension (lab's act_ckpt); -1 = null: as LitGPT, on where --strategy
                                   * auto runs finetune_full as FSDP (fl_strategy_choice.act_ckpt) */
    int keep_checkpoints;     /* fitllm: keep only the newest N step-* checkpoints (0 = all) */
    float max_time;           /* seconds of training (evaluation excluded) after which the run ends as
                                 at max_steps: final validation and final/; < 0 = null */
    int save_on_signal;       /* fitllm: a stop by SIGINT/SIGTERM/SIGUSR1 commits a checkpoint of the step (default 1) */
    int divergence_check;     /* fitllm: stop a run whose loss stays above ln(vocab) + margin (default 1;
                               * fl_diverge in src/train/divergence.h) */
    int memory_snapshot_interval; /* fitllm, BLIP-2 fine-tuning: the memory at the four phases of steps 1, 2 and every
                                   * N-th step printed as the course does (0 = off) */
} fl_train_args;

typedef struct {
    int interval;             /* optimizer steps between evaluations */
    int max_new_tokens;       /* sample generation length (0 = none) */
    int max_iters;            /* validation batches */
    int initial_validation;
    int final_validation;
} fl_eval_args;

/* LitGPT finetune/lora.py options. */
typedef struct {
    int r;
    float alpha, dropout;
    int query, key, value, projection, mlp, head;
    char target_modules[256]; /* PEFT-style list (overrides the booleans), e.g. "q_proj,v_proj" or "all-linear" */
    int use_rslora;
    char quantize[32];        /* "" or bnb.nf4 / bnb.nf4-dq / bnb.fp4 / bnb.fp4-dq (QLoRA) */
} fl_lora_args;

typedef struct {
    fl_cmd_kind command;
    char checkpoint_dir[FL_CFG_PATH]; /* finetune: required; pretrain: optional initial weights */
    char out_dir[FL_CFG_PATH];
    char precision[16];               /* "32-true", "bf16-true", "bf16-mixed", "16-mixed", ... */
    int devices, num_nodes;           /* ranks = devices x num_nodes (data parallel over MPI) */
    int devices_auto;                 /* devices was given as auto (or -1): 1 here, one CPU device (for messages) */
    int tensor_parallel;              /* tensor_parallel: ranks per tensor-parallel group (1: none); the ranks are
                                       * (devices x num_nodes / tensor_parallel) data-parallel groups of it */
    int pipeline_parallel;            /* pipeline_parallel: stages per pipeline (1: none; EXPERIMENTAL), each a
                                       * contiguous block range; (devices x num_nodes / pipeline_parallel) pipelines */
    char pipeline_schedule[32];       /* gpipe | 1f1b (default) | interleaved */
    int pipeline_chunks;              /* interleaved: model chunks (virtual stages) per rank (default 2) */
    int sequence_parallel;            /* sequence_parallel (with tensor_parallel > 1): Megatron-LM's sequence
                                       * parallelism, the stream between the linears split over the group's ranks */
    char strategy[32];                /* auto, ddp, deepspeed_stage_1, _2, _3, their _offload, fsdp (Lightning's names) */
    char sharding_strategy[32];       /* fsdp.sharding_strategy: "" (FULL_SHARD), FULL_SHARD, NO_SHARD, SHARD_GRAD_OP,
                                       * HYBRID_SHARD */
    char backward_prefetch[32];       /* fsdp.backward_prefetch: "" / BACKWARD_PRE / true (default: in backward, the
                                       * next unit's gather is posted while this one computes) or off / false
                                       * (PyTorch's None: each unit gathered when its backward starts) */
    char offload_device[32];          /* offload_optimizer_device (Lightning's DeepSpeedStrategy argument): "" (not
                                       * given: cpu under an *_offload strategy), "cpu" (the offloaded state in host
                                       * memory) or "nvme" (in files under nvme_path, paged through host memory);
                                       * refused with a strategy that does not offload */
    char nvme_path[FL_CFG_PATH];      /* nvme_path: the folder of the nvme state files ("": out_dir) */
    char offload_param_device[32];    /* offload_param_device: "" (the strategy's: cpu for fsdp_cpu_offload, nvme for
                                       * deepspeed_stage_3_offload_nvme, else none) / "none" (the parameters stay on the
                                       * device) / cpu / nvme (parameter offload: each rank's parameter and gradient
                                       * shards in the host tier or in files under nvme_path; ZeRO-3 with the optimizer
                                       * offloaded only, fl_cfg_param_offload) */
    int offload_prefetch;             /* offload_prefetch: parameter offload's fetch depth (units ahead; default 1, 0:
                                       * each unit when needed) */
    int offload_overlap;              /* offload_overlap: parameter offload's fetches ahead copied out of the tier by a
                                       * worker thread while the unit before computes (default 1; 0: by the model's
                                       * thread when posted). Same bits either way */
    int offload_update_overlap;       /* offload_update_overlap: ZeRO-3 / FULL_SHARD with the optimizer offloaded, no
                                       * clipping, no loss scaling: each unit's host update queued on the fetch worker
                                       * as its gradient is final, beside the rest of the backward (default 1; 0: the
                                       * update after the backward). Same bits either way */
    size_t bucket_size;               /* bucket_size: bytes of one bucket of the data-parallel gradient reductions
                                       * (src/train/dp_bucket.c; default 256 MiB; 0 / null: one collective each) */
    char state_dict_type[32];         /* fsdp.state_dict_type: "full" (one consolidated checkpoint, the default) or
                                         "sharded" (each rank writes its element ranges; any strategy) */
    char resume[FL_CFG_PATH];         /* "false", "true", "auto" or a checkpoint folder */
    uint64_t seed;
    char logger_name[16];             /* "csv" or "jsonl"; LitGPT's tensorboard / wandb / mlflow / litlogger
                                         are accepted and write CSV (the trainer says so) */
    char model_name[64];              /* pretrain: preset name or a LitGPT / HF name of one */
    char model_config[FL_CFG_PATH];   /* pretrain: config.json path (fitllm) */
    /* pretrain: LitGPT's `model_config:` mapping (litgpt.Config fields, e.g. n_layer: 6),
     * kept as given; fl_cfg_model_config turns it into a model shape */
    struct { char key[32]; char value[64]; } model_fields[FL_CFG_MODEL_FIELDS];
    int n_model_fields;
    char tokenizer_dir[FL_CFG_PATH];  /* pretrain: tokenizer folder ("" = built-in bytes) */
    fl_data_config data;
    fl_train_args train;
    fl_eval_args eval;
    fl_optim_config optimizer;
    fl_lora_args lora;                /* finetune_lora */
    /* fitllm extensions */
    int init_random;                  /* --init random: ignore stored weights (shape only) */
    size_t max_memory;                /* allocator budget in bytes, 0 = unlimited */
    int threads;                      /* 0 = all cores */
    int quiet;
    int overwrite;
    char blip2_train[32];             /* blip2.train: a BLIP-2 checkpoint's parts that train ("" = the command's default) */
    /* library callers (no option): the step hook's parameters under FSDP FULL_SHARD: 0 this rank's
     * shard (fl_step_hook), 1 the whole parameters, gathered unit by unit for it (a collective and a
     * whole host copy on every rank each step: tests) */
    int hook_whole_params;
    /* library callers (no option): fp16 loss scaling's initial scale (0: 65536, GradScaler's default;
     * a resumed run takes its checkpoint's); tests force an overflow with a huge one */
    float loss_scale_init;
    /* train.lr_warmup_steps was given (fl_cfg_set): a train.lr_warmup_fraction given alone replaces
     * the command's default warm-up steps instead of conflicting with them */
    int lr_warmup_steps_given;
} fl_run_config;

/* Defaults of the command (LitGPT's setup() defaults). */
void fl_cfg_defaults(fl_run_config *c, fl_cmd_kind cmd);

/* Apply a YAML file. Errors name the file, line and key. */
fl_status fl_cfg_apply_yaml_file(fl_run_config *c, const char *path);
/* Apply YAML text (source names it in errors). */
fl_status fl_cfg_apply_yaml(fl_run_config *c, const char *text, size_t n, const char *source);
/* Apply one dotted override, e.g. ("train.micro_batch_size", "8"). */
fl_status fl_cfg_set(fl_run_config *c, const char *key, const char *value);
/* ---- merging a recipe with the command line ------------------------------
 * Options are collected first (later ones replace earlier ones with the same key,
 * aliases included: model = checkpoint_dir, data.class_path = data, X.init_args.Y
 * = X.Y), then applied, then validated. */
typedef struct {
    char *key;    /* canonical dotted key */
    char *name;   /* as written (for messages) */
    char *value;
    char *source; /* "recipe.yaml:12" or "command line" */
    int from_cli;
} fl_cfg_entry;

typedef struct {
    fl_cfg_entry *e;
    int n, cap;
} fl_cfg_entries;

void fl_cfg_entries_init(fl_cfg_entries *l);
void fl_cfg_entries_free(fl_cfg_entries *l);
/* Add (or replace) one option. A command-line value for a whole group (data with
 * another class, model_config) drops the recipe's fields of that group. */
fl_status fl_cfg_entries_add(fl_cfg_entries *l, const char *key, const char *value, const char *source, int from_cli);
/* Collect the leaves of a YAML recipe (errors name the file and line). */
fl_status fl_cfg_entries_load_yaml(fl_cfg_entries *l, const char *text, size_t n, const char *source);
fl_status fl_cfg_entries_load_yaml_file(fl_cfg_entries *l, const char *path);
/* Apply the merged options (class keys first). On error *failed (may be NULL) is the
 * entry's index; the message is prefixed with its source when that is a file. */
fl_status fl_cfg_apply_entries(fl_run_config *c, const fl_cfg_entries *l, int *failed);
/* The value of the option `name` (any spelling: aliases, X.init_args.Y) in l, as written; NULL when absent. */
const char *fl_cfg_entries_value(const fl_cfg_entries *l, const char *name);

/* The model a pretrain run creates: model_config fields (LitGPT Config semantics:
 * unset fields take litgpt.Config's defaults), else a model_config config.json, else
 * model_name (a preset or a LitGPT / HF name of one). *have = 0 when none is set.
 * Shapes fitllm cannot build (GPT-NeoX parallel residual, partial rotary, ...) are
 * FL_ERR_UNSUPPORTED naming the field. */
fl_status fl_cfg_model_config(const fl_run_config *c, fl_model_config *mc, int *have);

/* The command's name as typed ("pretrain", "finetune_full", "finetune_lora"). */
const char *fl_cfg_command_name(fl_cmd_kind cmd);

/* Check cross-field constraints (sizes positive, warmup exclusivity, ...). */
fl_status fl_cfg_validate(const fl_run_config *c);
/* The ZeRO stage of a strategy name (Lightning's names): auto (as a name; the run's choice is
 * fl_cfg_resolve_strategy), ddp and fsdp + NO_SHARD -> 0 (DDP),
 * deepspeed_stage_1 -> 1 (optimizer state sharded), deepspeed_stage_2 and fsdp + SHARD_GRAD_OP -> 2
 * (also the reduced gradients), deepspeed_stage_3 and fsdp + FULL_SHARD (fsdp's default) -> 3 (also the
 * parameters: src/train/fsdp.c), fsdp + HYBRID_SHARD -> 3 (FULL_SHARD within each node, replicated
 * across nodes: fl_cfg_hybrid_shard); deepspeed_stage_1_offload -> 1, deepspeed_stage_2_offload -> 2 and
 * deepspeed_stage_3_offload -> 3 with the optimizer offloaded (fl_cfg_offload; stage 3: the parameters' shards
 * stay on the devices), fsdp_cpu_offload and deepspeed_stage_3_offload_nvme -> 3 with the optimizer and the
 * parameters offloaded (fl_cfg_param_offload). What is not built yet (_HYBRID_SHARD_ZERO2, a DeepSpeed JSON
 * `deepspeed`) is FL_ERR_UNSUPPORTED, never mapped onto something else; unknown names FL_ERR_INVALID.
 * sharding may be NULL. */
fl_status fl_cfg_zero_stage(const char *strategy, const char *sharding, int *stage);
/* The data-parallel ranks of the run: devices x num_nodes / tensor_parallel (the grid's other axis). */
int fl_cfg_dp_ranks(const fl_run_config *c);
/* Whether the strategy offloads the optimizer (ZeRO-Offload: deepspeed_stage_1_offload,
 * deepspeed_stage_2_offload, deepspeed_stage_3_offload): its state lives in the backend's host tier (host_pool_init), outside
 * the device budget, and the update runs there on the host's cores (src/train/optim.c). */
int fl_cfg_offload(const char *strategy);
/* Parameter offload (ZeRO-3 only): 0 none, 1 the parameters' (and gradients') shards in the host tier, 2 in NVMe
 * files. offload_param_device when given, else the strategy's (fsdp_cpu_offload: 1,
 * deepspeed_stage_3_offload_nvme: 2). */
int fl_cfg_param_offload(const fl_run_config *c);
/* Whether the offloaded optimizer state goes to NVMe files: offload_optimizer_device nvme, or not given under
 * deepspeed_stage_3_offload_nvme. */
int fl_cfg_offload_nvme(const fl_run_config *c);
/* Whether strategy + sharding is HYBRID_SHARD: FULL_SHARD over the --devices ranks of each node
 * (ranks node*devices .. node*devices + devices-1), replicated across the --num_nodes nodes. */
int fl_cfg_hybrid_shard(const char *strategy, const char *sharding);
/* fsdp.backward_prefetch: 1 BACKWARD_PRE (the default, ""), 0 off, -1 not a known value. */
int fl_cfg_backward_prefetch(const fl_run_config *c);
/* fl_cfg_zero_stage with fsdp read as SHARD_GRAD_OP: whether the name is one fitllm runs. */
fl_status fl_cfg_check_strategy(const char *strategy);

/* What --strategy runs as (fl_cfg_resolve_strategy). */
typedef struct {
    int stage;         /* ZeRO stage of the strategy run: 0 DDP (and auto in one process), 1, 2, 3 FULL_SHARD
                        * (LoRA: see dp.h); one process runs unsharded whatever it is */
    char strategy[32]; /* the strategy run: the one given, or auto's choice ("ddp" or "fsdp") */
    char sharding[32]; /* its fsdp.sharding_strategy ("FULL_SHARD" or "HYBRID_SHARD" for auto's fsdp, else the one
                        * given) */
    char desc[256];    /* for the run's description: "fsdp", "auto: fsdp FULL_SHARD (...)", "auto: DDP, since ..." */
    int act_ckpt;      /* activation checkpointing per block: train.activation_checkpointing when given; null:
                        * on where auto picks FSDP for finetune_full (LitGPT's finetune/full.py wraps each Block
                        * with activation_checkpointing_policy={Block} when it shards), else off */
    int offload;       /* the optimizer offloaded to the host (fl_cfg_offload) */
    int param_offload; /* the parameters' shards offloaded: 0 no, 1 host tier, 2 NVMe (fl_cfg_param_offload) */
} fl_strategy_choice;
/* --strategy auto (the default) per command as LitGPT does, for devices x num_nodes ranks:
 * finetune_full -> FSDP FULL_SHARD; pretrain -> LitGPT's HYBRID_SHARD (num_nodes > 1; on one node
 * it is FULL_SHARD, which auto names);
 * finetune_lora -> DDP over the adapters. Where FULL_SHARD refuses the configuration (device_comm:
 * a device-memory communicator) auto is DDP and desc says why. An explicit strategy is never changed; auto with one rank stays auto (stage 0). The
 * trainer (with its communicator) and the planner (--cuda) both resolve here. Errors as
 * fl_cfg_zero_stage. */
fl_status fl_cfg_resolve_strategy(const fl_run_config *c, int device_comm, fl_strategy_choice *out);

/* Write the effective configuration as YAML (hyperparameters.yaml). */
void fl_cfg_write_yaml(const fl_run_config *c, FILE *f);
/* One option's value as fl_cfg_write_yaml writes it ("0.0001", "true", "null", "[0.9, 0.95]"; aliases and
 * data.init_args.X spellings accepted) into buf; an unknown key is FL_ERR_INVALID. */
fl_status fl_cfg_value_text(const fl_run_config *c, const char *key, char *buf, size_t n);
/* Print every option with its default (for --help). */
void fl_cfg_print_help(fl_cmd_kind cmd, FILE *f);

/* The LR at optimizer step `step` (0-based; the LR used for that step):
 * linear warmup from 0 over `warmup` steps, then cosine decay from lr to min_lr
 * at max_steps. */
double fl_lr_schedule(double lr, double min_lr, long step, long warmup, long max_steps);

#ifdef __cplusplus
}
#endif
#endif

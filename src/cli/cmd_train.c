/* fitllm finetune_full / pretrain: LitGPT-compatible command lines and YAML
 * recipes driving the trainer. finetune_lora / finetune are reserved. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "fitllm/backend.h"
#include "fitllm/blip2.h"
#include "fitllm/gpu_monitor.h"
#include "fitllm/plan.h"
#include "fitllm/checkpoint.h"
#include "fitllm/comm.h"
#include "fitllm/config.h"
#include "fitllm/fault.h"
#include "fitllm/trainer.h"

static void help(const char *cmd, fl_cmd_kind kind) {
    printf("usage: fitllm %s %s[--config recipe.yaml] [--<option> VALUE ...]\n\n", cmd,
           kind == FL_CMD_PRETRAIN ? "[<initial_checkpoint_dir>] " : "<checkpoint_dir> ");
    printf("Options use LitGPT's names; precedence: defaults < --config YAML < command line, merged before\n"
           "values are checked (--data TextFiles replaces a recipe's data: and its init_args). Values may also be\n"
           "written --option=VALUE; integers may group digits (10_000). data.init_args.X and optimizer.init_args.X\n"
           "are accepted for data.X and optimizer.X.%s\n"
           "Each checkpoint folder holds hyperparameters.yaml: --config it to run the same configuration again.\n"
           "Defaults:\n\n",
           kind == FL_CMD_PRETRAIN ? "\nThe model: model_config (a config.json, or LitGPT's mapping of litgpt.Config "
                                     "fields: model_config.n_layer ...),\nelse model_name (a preset, or its LitGPT / "
                                     "Hugging Face name)." : "");
    fl_cfg_print_help(kind, stdout);
    printf("\n  --accelerator auto|cpu|cuda   (default auto: the GPU when this build has CUDA and one is visible,\n"
           "                                else the CPU) cuda is EXPERIMENTAL: passed `fitllm selftest` and trained\n"
           "                                on an H100. Several GPUs (DDP, ZeRO-1/2, FSDP): mpirun -np N ... --devices N,\n"
           "                                one process per GPU, through NCCL (builds with NCCL; verified on its\n"
           "                                CPU stand-in only)\n");
    printf("\n  Data parallel (--devices N, --num_nodes M, --strategy): started without a launcher on one machine,\n"
           "  fitllm runs itself as N ranks through Open MPI's mpirun (printed first; FITLLM_MPIRUN=PATH picks the\n"
           "  mpirun; FITLLM_MPIRUN=none starts nothing: it prints the command and exits 2); under mpirun or srun\n"
           "  --mpi=pmix, devices x num_nodes must equal the rank count. Several machines: mpirun -np N*M --hostfile\n"
           "  HOSTS (the error without a launcher prints the whole command). Needs a build with MPI (fitllm\n"
           "  --version). A rank that waits FITLLM_COMM_TIMEOUT seconds (default 600; 0: never) for the others in one\n"
           "  collective (a rank stopped or hung) names the wait, the step and the last committed checkpoint and\n"
           "  ends the job (exit 1).\n"
           "  --strategy auto (the default) is LitGPT's: finetune_full FSDP FULL_SHARD, pretrain HYBRID_SHARD\n"
           "  (FULL_SHARD within each node of --devices ranks, replicated across the --num_nodes nodes; on one node\n"
           "  FULL_SHARD), adapter fine-tuning DDP over the adapters, on CPUs and GPUs (NCCL); a BLIP-2 folder\n"
           "  DDP (below);\n"
           "  the run's \"data parallel (...)\" line names what auto chose and why.\n");
    printf("\n  Stopping: SIGINT (Ctrl-C), SIGTERM and SIGUSR1 (Slurm's --signal=USR1@SECONDS pre-emption notice) finish\n"
           "  the current step, commit its checkpoint (--train.save_on_signal, default true), name it, and exit\n"
           "  128 + the signal: 130, 143, 138; a second signal stops at once. Several ranks: signal the fitllm\n"
           "  that started them (it forwards the stop), or send SIGUSR1 to every rank or to your own mpirun (kill\n"
           "  -USR1 <its pid>: it forwards it); SIGTERM to the ranks ends them at once (it is how mpirun and srun end\n"
           "  a job whose rank failed), and so does Ctrl-C or SIGTERM to your own mpirun (exit 1, the step lost).\n");
    printf("\n  Divergence (--train.divergence_check, default true): after the warm-up, a validation loss, or a\n"
           "  training loss smoothed by an EMA (weight %.1f) for %d steps in a row, above ln(vocab_size) + %.0f\n"
           "  (a uniform guess's loss + %.0f nats: the model predicts far worse than knowing nothing) stops\n"
           "  the run as a NaN does: exit 1, no final/, the last good checkpoint named. Perplexities above\n"
           "  e^%.0f print as inf.\n", FL_DIVERGE_ALPHA, FL_DIVERGE_WINDOW, FL_DIVERGE_MARGIN, FL_DIVERGE_MARGIN,
           FL_PPL_MAX_LOSS);
    if (kind != FL_CMD_PRETRAIN)
        printf("\n  BLIP-2 folders (model_type blip-2, OPT or Flan-T5): image-caption fine-tuning with --data JSON\n"
               "  --data.json_path CAPTIONS (.json/.jsonl {\"image\", \"text\"} records, or an image folder with\n"
               "  captions.jsonl, captions.tsv or NAME.txt beside each image; token ids when the folder has no tokenizer);\n"
               "  --blip2.train vision,qformer,lm picks the parts that train (vision frozen by default%s).\n"
               "  Captions cut to train.max_seq_length tokens (default 50). 32-true, bf16-true or bf16-mixed\n"
               "  (16-true, 16-mixed refused), activation checkpointing, AdamW / SGD / AdamW8bit%s;\n"
               "  one process or --devices N [--num_nodes M]: DDP, ZeRO-1/2 (deepspeed_stage_1|2), FSDP FULL_SHARD /\n"
               "  ZeRO-3 (fsdp, deepspeed_stage_3; finetune_lora: the adapters as ZeRO-2), HYBRID_SHARD\n"
               "  (--fsdp.sharding_strategy HYBRID_SHARD), CPU optimizer offload (deepspeed_stage_{1,2,3}_offload;\n"
               "  NVMe: --offload_optimizer_device nvme), parameter offload (fsdp_cpu_offload, --offload_param_device\n"
               "  cpu|nvme, deepspeed_stage_3_offload_nvme; finetune_full). --strategy auto is DDP here, in `plan` as\n"
               "  in the run (Lightning's Trainer default, what the course's BLIP-2 script runs; FSDP: --strategy\n"
               "  fsdp), so train.activation_checkpointing null is off. logs/metrics.csv.\n"
               "  final/ is an HF BLIP-2 folder%s; step-N/ (train.save_interval) one too (the language model's\n"
               "  adapter under LoRA) with the training state, which --resume continues from bit-exactly (full\n"
               "  fine-tuning's final/ too); --resume is checked as the trainer's (another model, optimizer,\n"
               "  blip2.train, seed, data split or LoRA setting refused, exit 2); ranks that read other captions\n"
               "  or images refused at start-up; each folder is committed as the trainer's (hyperparameters.yaml,\n"
               "  COMMITTED; a failed save leaves nothing).%s data.val_split_fraction holds out validation\n"
               "  captions. `fitllm plan` and\n"
               "  `bench-step` take BLIP-2 folders and presets too.\n",
               kind == FL_CMD_FINETUNE_LORA ? "; default lm: LoRA on the language model" : "",
               kind == FL_CMD_FINETUNE_LORA ? ", QLoRA (--quantize)" : "",
               kind == FL_CMD_FINETUNE_LORA ? " (LoRA merged) + adapter/ (PEFT)" : "",
               kind == FL_CMD_FINETUNE_LORA ? "\n  A step-N/ or final/adapter works with merge_lora and generate --image (the adapter\n"
                                              "  merged into the BLIP-2 base)." : "");
    printf("\nexit codes: 0 ok, 1 runtime error, 2 usage or config error, 3 out of memory, 130 SIGINT, 143 SIGTERM,\n"
           "138 SIGUSR1\n");
}

/* An unknown option the key table has nothing near to: perhaps a mistyped flag of the command line
 * itself (--acelerator, plan's --device-memroy), which the table does not hold. Prints the usage
 * error with the suggestion and returns its exit code, or 0 when there is nothing to suggest. */
static int unknown_flag(const char *cmd, const char *key) {
    static const char *const run_flags[] = {"accelerator", "config", "max-memory", "help", NULL};
    static const char *const plan_flags[] = {"accelerator", "config", "max-memory", "help", "device-memory", "seq-len",
                                             "generation", "json", "lora", "rank", "block-ms", NULL};
    const char *m = fl_error_message();
    if (strncmp(m, "unknown option", 14) || strstr(m, "did you mean")) return 0;
    const char *near = fl_cli_nearest(key, strcmp(cmd, "plan") ? run_flags : plan_flags);
    return near ? fl_cli_usage(cmd, "unknown option '%s' (did you mean '--%s'?)", key, near) : 0;
}

/* A value every rank of a launcher's job refuses alike (the same command line): rank 0 says it, once for the job (it
 * was printed once per rank). Another rank first waits a moment, in which the launcher ends it when rank 0 has exited
 * with the error; one still running then says its own (a rank whose files differ). */
/* --devices x --num_nodes against a launcher's rank count: the message once (rank 0), 1 when they differ. */
static int launcher_mismatch(const char *cmd, const fl_run_config *cfg, const fl_launch_info *li) {
    const int want = cfg->devices * cfg->num_nodes, have = li->kind == FL_LAUNCH_NONE ? 1 : li->size;
    if (li->kind == FL_LAUNCH_NONE || want == have) return 0;
    if (li->rank == 0) /* every rank sees the same mismatch: one message */
        fprintf(stderr, "fitllm %s: error: --devices %d%s x --num_nodes %d = %d rank%s, but %s started %d: give "
                "--devices %d (ranks per node x nodes = the launcher's rank count) or start %d rank%s\n", cmd,
                cfg->devices, cfg->devices_auto ? " (auto: this process's one CPU device)" : "", cfg->num_nodes, want,
                want == 1 ? "" : "s", fl_launch_kind_name(li->kind), have,
                have / cfg->num_nodes > 0 ? have / cfg->num_nodes : have, want, want == 1 ? "" : "s");
    else
        fl_cli_after_rank0(); /* rank 0 says it */
    return 1;
}

static void config_error(const char *cmd) {
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", fl_error_message());
    fl_cli_after_rank0();
    fprintf(stderr, "fitllm %s: error: %s\n", cmd, msg);
}

/* defaults < every --config (in order) < the command line, merged BEFORE any value
 * is checked: a recipe's unsupported value (data: TinyStories) can be overridden. */
int fl_cli_parse_run(const char *cmd, fl_cmd_kind kind, int argc, char **argv, fl_run_config *cfg,
                     fl_cli_extra_fn extra, void *ud, void (*help_fn)(const char *, fl_cmd_kind)) {
    fl_cfg_defaults(cfg, kind);
    fl_cfg_entries opts;
    fl_cfg_entries_init(&opts);
    int rc = 0;
#define USAGE(...) do { rc = fl_cli_usage(cmd, __VA_ARGS__); goto done; } while (0)
    /* first pass: --help and the recipes */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { /* once under a launcher (rank 0) */
            if (fl_cli_launched_rank() == 0) help_fn(cmd, kind);
            rc = -1;
            goto done;
        }
        if (!strcmp(argv[i], "--config") || !strncmp(argv[i], "--config=", 9)) {
            const char *path = argv[i][8] == '=' ? argv[i] + 9 : (i + 1 < argc ? argv[++i] : NULL);
            if (!path) USAGE("--config needs a file");
            if (fl_cfg_entries_load_yaml_file(&opts, path) != FL_OK) {
                fprintf(stderr, "fitllm %s: error: %s\n", cmd, fl_error_message());
                rc = FL_EXIT_USAGE;
                goto done;
            }
        }
    }
    int positional = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--config")) { i++; continue; }
        if (!strncmp(a, "--config=", 9)) continue;
        if (extra) { /* first: a command may take --accelerator itself (plan: for a device not here) */
            int r = extra(ud, argc, argv, &i);
            if (r < 0) { rc = FL_EXIT_USAGE; goto done; }
            if (r > 0) continue;
        }
        if (!strcmp(a, "--accelerator") || !strncmp(a, "--accelerator=", 14)) {
            const char *v = a[13] == '=' ? a + 14 : (i + 1 < argc ? argv[++i] : NULL);
            int r = fl_cli_accelerator(cmd, v);
            if (r) { rc = r; goto done; }
            continue;
        }
        const char *key_s = NULL, *val = NULL;
        char key[256];
        if (!strncmp(a, "--", 2)) {
            const char *eq = strchr(a, '=');
            if (eq) {
                snprintf(key, sizeof key, "%.*s", (int)(eq - a - 2), a + 2);
                val = eq + 1;
            } else {
                snprintf(key, sizeof key, "%s", a + 2);
                /* flags that are booleans may stand alone: --quiet, --overwrite */
                if ((!strcmp(key, "quiet") || !strcmp(key, "overwrite")) && (i + 1 >= argc || !strncmp(argv[i + 1], "--", 2)))
                    val = "true";
                else if (i + 1 < argc) val = argv[++i];
                else {
                    /* an unknown (or another command's) option is that, not a missing value */
                    fl_run_config probe = *cfg;
                    if (fl_cfg_set(&probe, key, "null") == FL_ERR_INVALID &&
                        (!strncmp(fl_error_message(), "unknown option", 14) || strstr(fl_error_message(), "applies to"))) {
                        if ((rc = unknown_flag(cmd, key)) != 0) goto done;
                        USAGE("%s", fl_error_message());
                    }
                    USAGE("option --%s needs a value", key);
                }
            }
            /* fitllm spellings of a few options */
            if (!strcmp(key, "max-memory")) snprintf(key, sizeof key, "max_memory");
            key_s = key;
        } else if (positional++ == 0) {
            key_s = "checkpoint_dir", val = a;
        } else {
            USAGE("unexpected argument '%s'", a);
        }
        if (fl_cfg_entries_add(&opts, key_s, val, "command line", 1) != FL_OK) USAGE("%s", fl_error_message());
    }
    int failed;
    if (fl_cfg_apply_entries(cfg, &opts, &failed) != FL_OK) {
        if (failed >= 0 && opts.e[failed].from_cli) {
            if ((rc = unknown_flag(cmd, opts.e[failed].name)) != 0) goto done;
            USAGE("%s", fl_error_message());
        }
        config_error(cmd);
        rc = FL_EXIT_USAGE;
        goto done;
    }
    if (fl_cfg_validate(cfg) != FL_OK) {
        /* a launcher that started another number of ranks than --devices says: that first (a batch that "is not
         * divisible by 3 x 1" under `mpirun -np 2 ... --devices 3` would send the user to the wrong option) */
        fl_launch_info lm;
        if (!(fl_launch_detect(&lm) == FL_OK && fl_launch_check(&lm) == FL_OK && launcher_mismatch(cmd, cfg, &lm)))
            config_error(cmd);
        rc = FL_EXIT_USAGE;
    }
    /* models by name: a Hugging Face repo id -> the folder it was downloaded to (src/cli/model_name.c);
     * said once per job (rank 0 of a launcher's ranks) */
    const char *say = fl_cli_launched_rank() != 0 ? NULL : cmd;
    char *paths[2] = {cfg->checkpoint_dir, cfg->tokenizer_dir};
    for (int k = 0; k < 2 && !rc; k++) {
        char buf[FL_CFG_PATH];
        if (fl_cli_resolve_model(say, paths[k], buf, sizeof buf, k == 0 && !strcmp(cmd, "plan")) != FL_OK) {
            fprintf(stderr, "fitllm %s: error: %s%s\n", cmd, k ? "tokenizer_dir: " : "", fl_error_message());
            rc = FL_EXIT_USAGE;
        } else {
            snprintf(paths[k], FL_CFG_PATH, "%s", buf);
        }
    }
#undef USAGE
done:
    fl_cfg_entries_free(&opts);
    return rc;
}

/* 0 = go on; 1 = stop; 2 = stop after committing this step's checkpoint (train.save_on_signal) */
static int stop_if_interrupted(void *ud, long step, double loss, const void *params, size_t bytes) {
    const fl_run_config *cfg = ud;
    (void)loss, (void)params, (void)bytes;
    fl_cli_faults_step(cfg, step);
    return fl_cli_interrupted() ? (cfg->train.save_on_signal ? 2 : 1) : 0;
}

/* --devices / --num_nodes against the launcher; the communicator for more than one rank.
 * Returns 0 (comm set, NULL for one process) or an exit code (the error printed). */
static int join_ranks(const char *cmd, const fl_run_config *cfg, int argc, char **argv, fl_comm **comm) {
    *comm = NULL;
    fl_launch_info li;
    if (fl_launch_detect(&li) != FL_OK) {
        fprintf(stderr, "fitllm %s: error: %s\n", cmd, fl_error_message());
        return FL_EXIT_USAGE;
    }
    if (fl_launch_check(&li) != FL_OK) { /* torchrun's ranks: mpirun is the answer, whatever --devices says */
        if (li.rank == 0) fprintf(stderr, "fitllm %s: error: %s\n", cmd, fl_error_message());
        return FL_EXIT_USAGE;
    }
    int want = cfg->devices * cfg->num_nodes, have = li.kind == FL_LAUNCH_NONE ? 1 : li.size;
    /* no launcher: start the ranks through mpirun (their status once they end), or say what to run */
    if (want > 1 && li.kind == FL_LAUNCH_NONE) { /* the run's status, or -1 for 0: nothing left to do here */
        int rc = fl_cli_start_ranks(cmd, cfg, argc, argv);
        return rc ? rc : -1;
    }
    if (want != have) {
        launcher_mismatch(cmd, cfg, &li);
        return FL_EXIT_USAGE;
    }
    if (want == 1) return 0;
    if (fl_comm_init(comm, NULL, NULL) != FL_OK) {
        if (li.rank == 0) fprintf(stderr, "fitllm %s: error: %s\n", cmd, fl_error_message());
        return FL_EXIT_USAGE;
    }
    return 0;
}

static int train(const char *cmd, fl_cmd_kind kind, fl_run_config *cfg_in, fl_comm *comm);
static int blip2_run(const char *cmd, const fl_run_config *cfg, fl_comm *comm);

static int run(const char *cmd, fl_cmd_kind kind, int argc, char **argv) {
    /* the log a line at a time also into a file or a pipe (mpirun's): a process killed at any moment
     * (SIGKILL, the launcher ending a rank) leaves whole lines; a line per iteration costs nothing */
    setvbuf(stdout, NULL, _IOLBF, 0);
    fl_run_config cfg;
    int rc = fl_cli_parse_run(cmd, kind, argc, argv, &cfg, NULL, NULL, help);
    if (rc) return rc < 0 ? 0 : rc;
    /* a rank of fitllm's launcher: its stop request may come while MPI starts; kept for the first step */
    if (getenv("FITLLM_LAUNCHED")) fl_cli_signals_early(SIGUSR2);
    /* a BLIP-2 folder: image-caption fine-tuning, its own loop (fl_blip2_train, through cmd_blip2_train.c) */
    const int blip2 = kind != FL_CMD_PRETRAIN && fl_blip2_is_folder(cfg.checkpoint_dir);
    fl_comm *comm = NULL;
    if ((rc = join_ranks(cmd, &cfg, argc, argv, &comm)) != 0) return rc < 0 ? 0 : rc;
    const int rank0 = !comm || fl_comm_rank(comm) == 0;
    if (!blip2 && rank0) fl_cli_note_run_weights(cmd, &cfg); /* the first line */
    if (rank0) fl_cli_warn_threads(cmd, cfg.threads);
    if (comm && (rc = fl_cli_check_ranks(cmd, &cfg, comm)) != 0) {
        fl_comm_destroy(comm);
        return rc;
    }
    rc = blip2 ? blip2_run(cmd, &cfg, comm) : train(cmd, kind, &cfg, comm);
    fl_comm_destroy(comm);
    return rc;
}

static int train(const char *cmd, fl_cmd_kind kind, fl_run_config *cfg_in, fl_comm *comm) {
    (void)kind;
    fl_run_config cfg = *cfg_in;
    const int rank = comm ? fl_comm_rank(comm) : 0, world = comm ? fl_comm_size(comm) : 1;
    const int launched = getenv("FITLLM_LAUNCHED") != NULL && world > 1; /* by fitllm's own mpirun */
    int bar = !cfg.quiet && rank == 0 && fl_cli_stdout_is_terminal(world);
    fl_trainer_result res;
    char resume_msg[FL_CFG_PATH + 256];
    snprintf(resume_msg, sizeof resume_msg,
             "fitllm %s: stopped at once; to continue from the last step-* checkpoint in '%s', run the same command "
             "with --resume auto\n", cmd, cfg.out_dir);
    const fl_cli_signals sigs = {.cmd = cmd, .out_dir = cfg_in->out_dir, .world = world, .rank = rank,
                                 .threads = cfg.threads > 0 ? cfg.threads : fl_cpu_default_threads(),
                                 .launched = launched, .at_once_msg = resume_msg};
    /* --strategy auto on a TP / PP grid: the data axis's strategy by the per-rank plan (fitllm/plan.h); every rank
     * plans alike (the plan is deterministic), rank 0 says why */
    fl_backend_facts af;
    const int dev = fl_backend_facts_of(fl_backend_default_name(), &af) == FL_OK && (af.caps & FL_CAP_DEVICE_MEMORY);
    char auto_s[32], auto_why[1024];
    if (fl_plan_auto_strategy(&cfg, dev, 0, auto_s, sizeof auto_s, auto_why, sizeof auto_why) != FL_OK)
        return fl_cli_fail(cmd, FL_ERR_INVALID, NULL);
    if (auto_s[0]) {
        snprintf(cfg.strategy, sizeof cfg.strategy, "%s", auto_s);
        if (rank == 0 && !cfg.quiet) printf("note: strategy %s\n", auto_why);
    }
    /* testing fp16's overflow path: FITLLM_FAULT_GRAD_OVERFLOW=STEP[:RANK] (fitllm/fault.h, README) */
    fl_fault_clear();
    if (fl_fault_from_env() != FL_OK) {
        fl_cli_fail(cmd, FL_ERR_INVALID, NULL);
        return FL_EXIT_USAGE;
    }
    fl_cli_signals_begin(&sigs);
    fl_cli_faults_begin(cmd, &cfg, rank, world);
    /* on a GPU, rank 0 samples its utilization and memory through NVML for the summary (the course's nvtop);
     * FITLLM_GPU_MONITOR=off never, on always (the tests: an NVML stand-in beside a CPU run) */
    char gpu_why[200] = "";
    fl_backend_facts bf;
    const char *gm = getenv("FITLLM_GPU_MONITOR");
    const int on_gpu = rank == 0 && (gm && !strcmp(gm, "on") ? 1 : gm && !strcmp(gm, "off") ? 0
                                     : fl_backend_facts_of(fl_backend_default_name(), &bf) == FL_OK &&
                                           (bf.caps & FL_CAP_DEVICE_MEMORY));
    fl_gpu_monitor *gpu = on_gpu ? fl_gpu_monitor_start(100, gpu_why, sizeof gpu_why) : NULL;
    fl_status s = fl_trainer_run_comm(&cfg, comm, stdout, bar, stop_if_interrupted, &cfg, &res);
    fl_gpu_usage gu;
    fl_gpu_monitor_stop(gpu, &gu);
    if (on_gpu && s == FL_OK && !cfg.quiet) {
        if (gu.samples > 0)
            printf("GPU utilization (NVML, device 0, %ld samples): %.1f +- %.1f %%, device memory used %.2f +- %.2f GiB\n",
                   gu.samples, gu.util_mean, gu.util_std, gu.mem_mean / 1073741824.0, gu.mem_std / 1073741824.0);
        else printf("GPU utilization: not sampled (%s)\n", gpu_why[0] ? gpu_why : "no sample");
    }
    fl_cli_faults_end();
    fl_cli_signals_end();
    fflush(stdout); /* the log ends with its last whole line before any message */
    /* configuration problems found while setting up (bad values, a checkpoint_dir or data file
     * that does not exist, a technique this build lacks) are usage errors */
    int code = s == FL_ERR_OOM ? FL_EXIT_OOM
               : (s == FL_ERR_INVALID || s == FL_ERR_NOT_FOUND || s == FL_ERR_UNSUPPORTED) ? FL_EXIT_USAGE : FL_EXIT_RUNTIME;
    if (s != FL_OK && world > 1) {
        /* an error every rank returned (set-up, agreed): rank 0 says it; one rank's own error:
         * it ends the job, naming the rank (the others may be waiting for it in a collective) */
        if (res.error_all_ranks && rank != 0) return code;
        if (!res.error_all_ranks) {
            char msg[1200 + FL_CFG_PATH * 3], where[FL_CFG_PATH * 2], err[1024];
            snprintf(err, sizeof err, "%s", fl_error_message()); /* before the checkpoint scan sets another */
            fl_cli_last_checkpoint(cfg.out_dir, where, sizeof where);
            snprintf(msg, sizeof msg, "fitllm %s: error: %s; %s", cmd, err, where);
            fl_comm_abort(comm, code, msg); /* MPI: does not return */
        }
    }
    const int sig = fl_cli_interrupted();
    if (s == FL_OK && sig && res.final_dir[0]) { /* it came after the last step: the run is complete */
        if (rank == 0)
            fprintf(stderr, "fitllm %s: %s came after the last step; the run finished and saved '%s'\n", cmd,
                    fl_cli_signal_name(sig), res.final_dir);
        return 0;
    }
    /* the launcher's request: it names the signal and the checkpoint, and exits with the code */
    if (s == FL_OK && sig == SIGUSR2) return 0;
    if (s == FL_OK && sig && rank != 0) return 128 + sig;
    if (s == FL_OK && sig) {
        char last[FL_CFG_PATH + 300];
        if (fl_ckpt_find_latest(cfg.out_dir, last, sizeof last) == FL_OK)
            fprintf(stderr, "fitllm %s: stopped by %s after step %ld; the last checkpoint is '%s': to continue, run the "
                            "same command with --resume auto (out_dir '%s')\n", cmd, fl_cli_signal_name(sig), res.steps,
                    last, cfg.out_dir);
        else
            fprintf(stderr, "fitllm %s: stopped by %s after step %ld, before any checkpoint was committed "
                            "(train.save_interval %d, train.save_on_signal %s): nothing to resume from, a new run starts "
                            "over (--overwrite)\n", cmd, fl_cli_signal_name(sig), res.steps, cfg.train.save_interval,
                    cfg.train.save_on_signal ? "true" : "false");
        return 128 + sig; /* as the shell reports a process killed by it: 130 SIGINT, 143 SIGTERM, 138 SIGUSR1 */
    }
    if (s != FL_OK) {
        if (s == FL_ERR_OOM) {
            /* the breakdown and what to try, from the planner (same sizing as the runtime) */
            fprintf(stderr, "fitllm %s: error: %s\n", cmd, fl_error_message());
            fl_cli_oom_advice(&cfg, &res.oom, stderr);
            return FL_EXIT_OOM;
        }
        /* a failure after training started (a full disk, a file that cannot be written) names the
         * checkpoint to continue from; a diverged run's message names the last good one itself */
        if (!res.error_all_ranks && s != FL_ERR_NONFINITE) {
            char where[FL_CFG_PATH * 2];
            fl_cli_last_checkpoint(cfg.out_dir, where, sizeof where);
            fprintf(stderr, "fitllm %s: error: %s; %s\n", cmd, fl_error_message(), where);
            return code;
        }
        fl_cli_fail(cmd, s, NULL);
        return code;
    }
    return 0;
}

/* BLIP-2's loop (fl_blip2_train through cmd_blip2_train.c) under the same signal handling: it polls fl_cli_interrupted after each step. */
static int blip2_run(const char *cmd, const fl_run_config *cfg, fl_comm *comm) {
    const int rank = comm ? fl_comm_rank(comm) : 0, world = comm ? fl_comm_size(comm) : 1;
    const int launched = getenv("FITLLM_LAUNCHED") != NULL && world > 1;
    char resume_msg[FL_CFG_PATH + 256];
    snprintf(resume_msg, sizeof resume_msg,
             "fitllm %s: stopped at once; to continue from the last step-* checkpoint in '%s', run the same command "
             "with --resume auto\n", cmd, cfg->out_dir);
    const fl_cli_signals sigs = {.cmd = cmd, .out_dir = cfg->out_dir, .world = world, .rank = rank,
                                 .threads = cfg->threads > 0 ? cfg->threads : fl_cpu_default_threads(),
                                 .launched = launched, .at_once_msg = resume_msg};
    fl_cli_signals_begin(&sigs);
    const int rc = fl_cli_blip2_train(cmd, cfg, comm);
    fl_cli_signals_end();
    return rc;
}

int fl_cmd_finetune_full(int argc, char **argv) { return run("finetune_full", FL_CMD_FINETUNE_FULL, argc, argv); }
int fl_cmd_pretrain(int argc, char **argv) { return run("pretrain", FL_CMD_PRETRAIN, argc, argv); }

int fl_cmd_finetune_lora(int argc, char **argv) { return run(argv[0], FL_CMD_FINETUNE_LORA, argc, argv); }

/* CLI internals: shared helpers for the subcommands. Only the CLI prints and
 * chooses exit codes: 0 ok, 1 runtime error, 2 usage error, 3 out of memory. */
#ifndef FL_CLI_H
#define FL_CLI_H

#include <stdio.h>

#include "fitllm/backend.h"
#include "fitllm/blip2.h"
#include "fitllm/comm.h"
#include "fitllm/config.h"
#include "fitllm/io.h"
#include "fitllm/mem.h"
#include "fitllm/model.h"
#include "fitllm/status.h"
#include "fitllm/train.h"

enum { FL_EXIT_OK = 0, FL_EXIT_RUNTIME = 1, FL_EXIT_USAGE = 2, FL_EXIT_OOM = 3 };

/* Print "fitllm <cmd>: error: <message>" (+ a hint for OOM) and return the exit code for s. */
int fl_cli_fail(const char *cmd, fl_status s, const fl_mem_pool *pool);
/* 1 when a and b name the same existing folder (whatever the spelling: the inode) */
int fl_cli_same_dir(const char *a, const char *b);
/* Usage error: prints the message and "see fitllm <cmd> --help"; returns 2. */
int fl_cli_usage(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The candidate nearest to word by edit distance (case-insensitive), or NULL when none is near
 * enough to be what was meant (the rule of the option keys: distance <= 2 + len/4). known: NULL-ended. */
const char *fl_cli_nearest(const char *word, const char *const *known);
/* "unknown option '--micro-bach' (did you mean '--micro-batch'?)" as a usage error; known: the
 * command's options, NULL-ended. Returns FL_EXIT_USAGE. */
/* this process's rank under a launcher (mpirun, srun ...; 0 without one) */
int fl_cli_launched_rank(void);
/* an error every rank meets, about to be printed: ranks other than 0 first give rank 0 3 s to say it and exit (the
 * launcher then ends them), so a job prints it once */
void fl_cli_after_rank0(void);
int fl_cli_unknown_option(const char *cmd, const char *arg, const char *const *known);

/* Parse helpers: return 0 on success, -1 with a usage message printed. */
int fl_cli_int(const char *cmd, const char *opt, const char *val, long lo, long hi, int *out);
int fl_cli_float(const char *cmd, const char *opt, const char *val, float *out);
/* fl_cli_float that must be > 0 and finite (a learning rate) */
int fl_cli_pos_float(const char *cmd, const char *opt, const char *val, float *out);
/* --threads N: fl_cli_int in [0, hi], then fl_cli_warn_threads. */
int fl_cli_threads(const char *cmd, const char *val, long hi, int *out);
/* threads (--threads / the `threads` key; 0 = the default, all cores) above the CPUs this process may run on: a
 * warning on stderr, once a process, naming both (the threads take turns on the cores). */
void fl_cli_warn_threads(const char *cmd, int threads);
/* The CPUs this process may run on (its affinity mask); *physical: their cores (hardware threads of one core
 * counted once, as Open MPI counts slots). src/cli/launch.c. */
int fl_cli_usable_cpus(int *physical);
/* --accelerator VALUE (auto|cpu|cuda, fitllm/cuda.h): 0 when the command runs on the CPU (auto,
 * cpu); else prints why not (bad value: usage error 2; cuda without a CUDA build, a visible device
 * or a complete CUDA backend: runtime error 1) and returns the exit code. */
int fl_cli_accelerator(const char *cmd, const char *val);

/* Load a model from a preset name, HF folder, llama2.c .bin or config.json.
 * random_init: ignore weights and initialize randomly with seed. */
fl_status fl_cli_load_model(fl_model *m, const char *path, int random_init, uint64_t seed, const fl_backend *be,
                            fl_mem_pool *pool, int *weights_loaded);
/* The same with a parameter storage (NULL = fp32; see fl_model_storage_for). */
fl_status fl_cli_load_model_ex(fl_model *m, const char *path, int random_init, uint64_t seed, const fl_backend *be,
                               fl_mem_pool *pool, const fl_model_storage *st, int *weights_loaded);

/* A training run folder given as a model (a folder with no config.json, adapter_config.json or model_config.yaml):
 * its final/ (committed), else its newest committed step-N/, into path (n bytes), and how it was resolved into note
 * (nn bytes, "" when arg is not a run folder: path = arg). A run folder without a committed checkpoint yet, or a
 * folder that is none of these: FL_ERR_NOT_FOUND saying which. */
fl_status fl_cli_run_folder(const char *arg, char *path, size_t n, char *note, size_t nn);

double fl_cli_now_ms(void);
/* Peak resident set size of this process in MiB. */
double fl_cli_peak_rss_mb(void);
/* Whether stdout is a terminal a person watches (progress bars and escapes only then): for a rank
 * that fitllm's launcher started, what the launcher's stdout was (FITLLM_STDOUT_TTY); for a rank of
 * another launcher, no (its stdout is the launcher's pseudo-terminal whatever the user's is). */
int fl_cli_stdout_is_terminal(int world);

/* Parse a training command line ([checkpoint_dir] --config Y --dotted.key V ...) into cfg
 * (defaults < YAML < command line) and validate it. `extra` (may be NULL) sees each
 * argument first: it returns 1 when it consumed argv[*i] (advancing *i past any value),
 * 0 when not its own, -1 after printing a usage error. Returns 0 ok, -1 after --help
 * (exit 0), or an exit code. */
typedef int (*fl_cli_extra_fn)(void *ud, int argc, char **argv, int *i);
int fl_cli_parse_run(const char *cmd, fl_cmd_kind kind, int argc, char **argv, fl_run_config *cfg,
                     fl_cli_extra_fn extra, void *ud, void (*help_fn)(const char *, fl_cmd_kind));
/* --devices N (x --num_nodes) > 1 and no launcher (src/cli/launch.c): on one node, re-execute this
 * command line (argv[0] = the subcommand) as N ranks through Open MPI's mpirun, printing
 * "fitllm: starting N ranks: mpirun ..."; this process stays to forward a stop signal to the ranks
 * and returns the run's exit status (mpirun's, or 128 + the signal that stopped it);
 * otherwise (several nodes, a build without MPI, no mpirun, FITLLM_MPIRUN=none) print the exact
 * command to run and return the exit code. */
int fl_cli_start_ranks(const char *cmd, const fl_run_config *cfg, int argc, char **argv);
/* "0.9.0-dev <git describe>": what ranks must agree on (src/cli/main.c). */
const char *fl_cli_version(void);
/* Multi-rank runs (src/cli/ranks.c). Start-up: every rank runs the same fitllm version and reads the
 * same model files (checkpoint_dir, a --resume folder: each file's size and fingerprint) as rank 0;
 * the lowest rank that differs prints the first difference. Collective; 0 or the exit code (2). */
int fl_cli_check_ranks(const char *cmd, const fl_run_config *cfg, fl_comm *comm);
/* "the last committed checkpoint is '...' (to continue ...)" or "no checkpoint was committed ..."
 * in out_dir (the newest committed step-*, what --resume auto continues from). */
void fl_cli_last_checkpoint(const char *out_dir, char *buf, size_t n);
/* Around a run: rank 0 of several answers the launcher's SIGTERM (another rank died) with the last
 * committed checkpoint; _step (from the step hook) refreshes it after a due checkpoint. */
void fl_cli_faults_begin(const char *cmd, const fl_run_config *cfg, int rank, int size);
void fl_cli_faults_step(const fl_run_config *cfg, long step);
void fl_cli_faults_end(void);
/* A rank of several ended by the launcher's SIGTERM (from the thread that took it): rank 0 names the
 * last committed checkpoint; the process dies of sig. Does not return. */
void fl_cli_faults_term(int sig);
/* "SIGINT (Ctrl-C)", "SIGTERM", "SIGUSR1", ... (signals.c) */
const char *fl_cli_signal_name(int sig);
/* After a training run failed with FL_ERR_OOM: the breakdown at the failure and
 * what to try, planned for the same config and budget (src/cli/cmd_plan.c). */
void fl_cli_oom_advice(const fl_run_config *cfg, const fl_mem_oom *oom, FILE *f);

int fl_cmd_plan(int argc, char **argv);
int fl_cmd_lab(int argc, char **argv);
int fl_cmd_loss(int argc, char **argv);
int fl_cmd_bench_step(int argc, char **argv);
int fl_cmd_selftest(int argc, char **argv);
int fl_cmd_demo(int argc, char **argv);
int fl_cmd_tokenize(int argc, char **argv);
int fl_cmd_generate(int argc, char **argv);
int fl_cmd_finetune_full(int argc, char **argv);
int fl_cmd_pretrain(int argc, char **argv);
int fl_cmd_finetune_lora(int argc, char **argv);
int fl_cmd_merge_lora(int argc, char **argv);
int fl_cmd_merge_shards(int argc, char **argv);
#define FL_CLI_PATH 4096
/* What fl_cli_load_with_adapter used. */
typedef struct {
    char adapter[FL_CLI_PATH]; /* the PEFT adapter folder */
    char base[FL_CLI_PATH];    /* the base model */
    const char *how;           /* how the adapter was found from the path given ("": it is that folder) */
    int blip2;                 /* its modules are a BLIP-2 model's (language_model.<module>) */
} fl_cli_adapter_info;
/* The PEFT adapter folder a path means: the folder itself (adapter_config.json), a LoRA
 * checkpoint's adapter/ (final/ -> final/adapter), or a finetune_lora run folder (final/adapter,
 * else the newest committed step-* holding an adapter). FL_ERR_NOT_FOUND with what the folder is. */
fl_status fl_cli_find_adapter(const char *path, fl_cli_adapter_info *info);
/* Base model with a PEFT LoRA adapter merged in memory (adapter_path NULL: base only; else
 * resolved by fl_cli_find_adapter; base NULL: the adapter's base_model_name_or_path, and when
 * that is not found the error names it and says `hint`, how to give the base). */
fl_status fl_cli_load_with_adapter(fl_model *m, const char *base, const char *adapter_path, const char *hint,
                                   const fl_backend *be, fl_mem_pool *pool, int *loaded, fl_cli_adapter_info *info);
/* The adapter (as fl_cli_load_with_adapter finds it) and its base into info, nothing loaded: what the base is decides
 * how to load it (a BLIP-2 folder: fl_cli_blip2_with_adapter). */
fl_status fl_cli_resolve_adapter(const char *base, const char *adapter_path, const char *hint,
                                 fl_cli_adapter_info *info);
/* A BLIP-2 base (base, else the adapter's base_model_name_or_path: a BLIP-2 folder) with the PEFT adapter at
 * adapter_path (fl_cli_find_adapter) merged in memory (fl_blip2_merge_peft); *b NULL on failure. */
fl_status fl_cli_blip2_with_adapter(fl_blip2 **b, const char *base, const char *adapter_path, const char *hint,
                                    const fl_backend *be, fl_mem_pool *pool, fl_cli_adapter_info *info);
/* The folder whose tokenizer goes with the adapter: the base's (with its config.json's special
 * ids), else the adapter folder's (fitllm's step checkpoints carry a copy of the run's), else the
 * checkpoint holding an adapter/ (final/); NULL if none has one. own_first: the checkpoint's (the
 * adapter folder's, then final/'s: the tokenizer the run trained with, --tokenizer_dir's too) before
 * the base's (merge_lora's output carries the run's tokenizer). */
const char *fl_cli_adapter_tokenizer(const fl_cli_adapter_info *info, int own_first, char *buf, size_t n);

/* Models by name (src/cli/model_name.c). A model argument that is not a file or folder here and
 * names a Hugging Face repo (ORG/NAME, checkpoints/ORG/NAME) -> the folder fitllm's download
 * folder or the HF cache holds (cmd non-NULL: "fitllm <cmd>: NAME is PATH (where)" on stderr);
 * not there: FL_ERR_NOT_FOUND saying to run `fitllm download` (shape_ok, plan: a repo id of a
 * preset stays the name, its shape). Any other name is copied unchanged (a preset). */
fl_status fl_cli_resolve_model(const char *cmd, const char *name, char *out, size_t n, int shape_ok);
/* The same for a command's model argument: *path = buf on success; else prints the error, returns 1. */
int fl_cli_model_arg(const char *cmd, const char **path, char *buf, size_t n);
/* "fitllm <cmd>: random initialization (no weights were loaded): <why>" on stderr (stdout flushed). */
void fl_cli_note_random(const char *cmd, const char *why);
/* That note for a preset name, with the `fitllm download` of its weights (nothing if no preset). */
void fl_cli_note_preset(const char *cmd, const char *name);
/* That note when a training run's configuration means random weights (a preset, --init random,
 * a config.json, pretraining from model_name / model_config). */
void fl_cli_note_run_weights(const char *cmd, const fl_run_config *cfg);
/* The subcommand running (main.c), named by notes printed with cmd NULL. */
void fl_cli_set_command(const char *cmd);
/* 1 once the random-init note was printed (it is printed at most once per process). */
int fl_cli_said_random(void);
/* The command prints the random-init note itself: the model loaders' (cmd NULL) stay quiet. */
void fl_cli_own_random_note(void);
/* "; for its weights run `fitllm download ORG/NAME` ..." for a preset with a repo id, else "". */
void fl_cli_preset_weights_hint(const char *name, char *buf, size_t n);
int fl_cmd_download(int argc, char **argv);

/* BLIP-2 with --image (cmd_blip2.c): `fitllm loss` of a caption's ids (the mean cross-entropy of caption[1:] after
 * the query tokens; the Flan-T5 variant: of tgt given the source) and greedy captioning (prompt text with the folder's tokenizer, or ids); exit codes as the
 * commands'. */
/* finetune_full / finetune_lora on a BLIP-2 folder (cmd_blip2_train.c over the library's fl_blip2_train):
 * image-caption fine-tuning, in one process (comm NULL) or DDP over comm's ranks; the exit code. */
int fl_cli_blip2_train(const char *cmd, const fl_run_config *cfg, fl_comm *comm);
/* Stop signals of a long command (signals.c): SIGINT (Ctrl-C), SIGTERM (Slurm's scancel and time limit, Kubernetes,
 * systemd), SIGUSR1 (Slurm's pre-emption notice) and, launched, SIGUSR2 (fitllm's launcher's stop request) are blocked
 * in this thread and the OpenMP pool (started here: `threads`) and taken by a thread of their own. The first sets
 * fl_cli_interrupted and prints "fitllm: SIGINT (Ctrl-C): <stop_what> ..." on rank 0; the command stops after its
 * step. The second stops at once: the temporary files of a write under way are removed (a checkpoint's folder:
 * fl_fs_tmp_track), at_once(sig) says what was left (NULL: the last checkpoint in out_dir, the training commands'),
 * then the process dies of the signal (the shell's 128 + number). */
typedef struct {
    const char *cmd;
    const char *out_dir;       /* with at_once NULL: where the last step-* checkpoint is looked for */
    int world, rank, threads, launched;
    const char *at_once_msg;   /* the second signal taken by a thread that does not block it (MPI's): written as is */
    const char *stop_what;     /* NULL: "stopping after this step" */
    void (*at_once)(int sig);  /* NULL: the training commands' message */
    int first_stops;           /* 1: the first signal stops at once (a command without steps: convert, merge_lora) */
    const char *left;          /* first_stops, at_once NULL: what is left, said after the signal (NULL: "nothing was
                                * written") */
} fl_cli_signals;
void fl_cli_signals_begin(const fl_cli_signals *s);
void fl_cli_signals_end(void);
/* sig taken as a first stop signal before fl_cli_signals_begin (a rank of fitllm's launcher: its SIGUSR2 while MPI
 * starts) */
void fl_cli_signals_early(int sig);
/* The process dies of sig now: the temporary files a write had under way removed (fl_fs_tmp_track), then its
 * default action, unblocked in this thread only (signals.c) */
void fl_cli_die_of(int sig);
/* The first stop signal's number (SIGINT, SIGTERM, SIGUSR1; SIGUSR2: fitllm's launcher), 0 = none. */
int fl_cli_interrupted(void);
/* `fitllm plan` of BLIP-2 fine-tuning (a folder or a preset, fl_cli_is_blip2): the exit code. */
int fl_cli_is_blip2(const char *name);
int fl_cli_blip2_plan(const fl_run_config *cfg, size_t device_memory, int seq_len, int json, int cuda, int rank);
/* `fitllm bench-step` of BLIP-2 fine-tuning: the exit code. */
typedef struct {
    const char *model;
    int B, L, steps, warmup, threads, seed, lora_r, sgd, random_init, act_ckpt;
    float lr;
    size_t budget;
    const char *precision; /* 32-true or bf16-mixed */
} fl_cli_b2_bench;
int fl_cli_blip2_bench(const fl_cli_b2_bench *o);
int fl_cli_blip2_loss(const char *cmd, const char *dir, const char *image, const int32_t *caption, int n,
                      const int32_t *tgt, int nt, const fl_backend *be, fl_mem_pool *pool);
/* Greedy captioning of image by the BLIP-2 model b (the caller's, an adapter merged: freed here), else loaded from
 * dir; dir's preprocessor_config.json and tokenizer (a BLIP-2 folder: b's base). */
int fl_cli_blip2_generate(const char *cmd, const char *dir, fl_blip2 *b, const char *image, const char *prompt,
                          const int32_t *prompt_ids, int n_prompt_ids, int max_new, float temperature,
                          const fl_backend *be, fl_mem_pool *pool);

#endif

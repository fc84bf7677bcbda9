/* fitllm plan: predict the memory of a training run before running it.
 * Same arguments as finetune_full (positional checkpoint_dir or preset name,
 * --config YAML, dotted overrides) plus --device-memory, --devices, --seq-len
 * and --json. Exit codes: 0 fits, 3 out of memory, 2 usage / config / a
 * technique this build does not have, 1 runtime error (e.g. unreadable model). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "fitllm/plan.h"

typedef struct {
    size_t device_memory;
    int devices, seq_len, json, generation;
    int target_len;
    int lora;
    int rank;
    int cuda;
    int largest;               /* --largest: the largest preset that fits the machine (fl_plan_largest) */
    int suggest;               /* --suggest: the DP x TP x PP grid to run (fl_plan_suggest_grid) */
    size_t host_memory, disk;  /* --host-memory, --disk: the machine's (--largest) */
    float block_ms;            /* --block-ms: a pipeline block's measured time */
} plan_args;

static void help(const char *cmd, fl_cmd_kind kind) {
    (void)kind;
    printf("usage: fitllm %s <checkpoint_dir | ORG/NAME | preset> [--config recipe.yaml] [--<option> VALUE ...]\n"
           "          [--device-memory SIZE] [--devices 1] [--rank 0] [--seq-len T] [--target-len T] [--generation auto|on|off]\n"
           "          [--block-ms MS] [--json]\n\n",
           cmd);
    printf("Predicts the bytes per tag (PARAMS, GRADS, OPTIM, ACTS, WORKSPACE, OTHER) at each phase of a\n"
           "training step of `fitllm finetune_full` with the same arguments, reserved (allocated) and live\n"
           "(holding data a later phase still reads), the peak, whether it fits the\n"
           "device, the largest micro_batch_size that fits, and what to try when it does not. No memory is\n"
           "touched and nothing computes: the trainer's own set-up and step run on a null backend whose ops\n"
           "do nothing (several ranks: every rank's set-up and step run as threads, their collectives moving nothing).\n"
           "A BLIP-2 folder or preset (blip2-opt-2.7b, blip2-flan-t5-xxl, Salesforce/...): its image-caption\n"
           "fine-tuning's set-up and step on captions of --seq-len tokens (else train.max_seq_length, else 50).\n\n"
           "plan options:\n"
           "  --device-memory SIZE           (default: --max_memory, else none)  device memory, e.g. 80GB, 24GiB\n"
           "  --devices N|auto               (default 1)  ranks of a data-parallel run: plans one rank's memory\n"
           "                                 (--strategy auto, the default, as the trainer: fsdp FULL_SHARD, --lora\n"
           "                                 ddp, on CPUs and GPUs;\n"
           "                                 --strategy ddp: every rank the same; deepspeed_stage_1 / _2 and fsdp\n"
           "                                 with --fsdp.sharding_strategy SHARD_GRAD_OP: the rank's chunk of the\n"
           "                                 optimizer state; deepspeed_stage_1_offload / _2_offload / _3_offload: the\n"
           "                                 rank's state in the host tier (or nvme),\n"
           "                                 its own row, outside the budget); auto: 1 (one CPU device);\n"
           "                                 overrides a recipe's devices:\n"
           "  --accelerator cpu|cuda         (default cpu)  the backend planned: cuda uses the CUDA backend's op\n"
           "                                 scratch (80 MiB: cuBLASLt workspace, GEMM panels, kernel work) and\n"
           "                                 plans its device pool (no GPU needed to plan; EXPERIMENTAL)\n"
           "  --rank R                       (default 0)  which rank to plan (ZeRO: the first n %% N ranks hold one\n"
           "                                 element more)\n"
           "  --seq-len T                    (default: train.max_seq_length - 1, else the model context)  T to plan\n"
           "                                 for (the trainer uses the longest sample - 1, samples cut to\n"
           "                                 max_seq_length); an encoder-decoder (T5): the source length (default\n"
           "                                 data.max_source_length, capped by train.max_seq_length); with\n"
           "                                 --data.lengths TABLE (Synthetic data,\n"
           "                                 e.g. recipes/data/alpaca-lengths.tsv): the longest drawn sample - 1\n"
           "  --block-ms MS                  (--pipeline_parallel; default none)  one block's forward + backward of a\n"
           "                                 micro-batch, measured (a pipelined run's \"pipeline timing\" line): the\n"
           "                                 expected step time in ms (without it: in units of that time)\n"
           "  --target-len T                 (default data.max_target_length)  an encoder-decoder's target length\n"
           "  --generation auto|on|off       (default auto)  include the sample generated at each evaluation\n"
           "                                 (auto: eval.max_new_tokens > 0, a validation split, and\n"
           "                                 train.max_steps unset or >= eval.interval)\n"
           "  --lora                         (default off)  plan `fitllm finetune_lora` (lora_* options apply)\n"
           "  --largest                      (default off)  the largest model that fits this machine instead of\n"
           "                                 the table: the LLaMA presets 1.1B to 13B with the run's options, each\n"
           "                                 as given, then ZeRO-3 with the optimizer, then also the parameters, in\n"
           "                                 host memory, then both on NVMe (the first that fits is named); with\n"
           "                                 --devices, --device-memory (GPUs, --accelerator cuda), --host-memory,\n"
           "                                 --disk; exit 0 when one fits, 3 when none does\n"
           "  --suggest                      (default off)  the DP x TP x PP grid to run instead of the table: every\n"
           "                                 grid of --devices x --num_nodes ranks (--tensor_parallel x\n"
           "                                 --pipeline_parallel dividing them), each rank of a model replica planned\n"
           "                                 with the run's options; the suggestion is the grid with the fewest\n"
           "                                 model-parallel ranks whose largest rank fits --device-memory (CPU ranks:\n"
           "                                 or --host-memory shared by them), then TP within a node, then the\n"
           "                                 smallest pipeline bubble, then the smallest peak; grids the trainer\n"
           "                                 refuses are listed with the reason; exit 0 when one fits, 3 when none\n"
           "  --host-memory SIZE             (--largest, --suggest)  the host's RAM (a CPU machine: its \"device\"; required there;\n"
           "                                 on CPU ranks it replaces --device-memory, a note says so; a grid that does\n"
           "                                 not fit names the memory it runs out of, host or device)\n"
           "  --disk SIZE                    (--largest, default not limited)  the NVMe folder's free space\n"
           "  --json                         (default off)  machine-readable output (schema version %d,\n"
           "                                 docs/ARCHITECTURE.md \"Planner and lab\")\n\n"
           "training options (as finetune_full, or finetune_lora with --lora: lora_*, use_rslora and quantize\n"
           "need --lora; --model NAME is checkpoint_dir):\n\n",
           FL_PLAN_JSON_VERSION);
    fl_cfg_print_help(FL_CMD_FINETUNE_LORA, stdout);
    printf("\nexit codes: 0 fits, 3 out of memory (the plan says OOM), 2 usage or config error or a technique\n"
           "this build does not have, 1 runtime error\n");
}

static int extra(void *ud, int argc, char **argv, int *i) {
    plan_args *a = ud;
    const char *arg = argv[*i];
    const char *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    if (!strcmp(arg, "--json")) { a->json = 1; return 1; }
    if (!strcmp(arg, "--lora")) { a->lora = 1; return 1; }
    if (!strcmp(arg, "--largest")) { a->largest = 1; return 1; }
    if (!strcmp(arg, "--suggest")) { a->suggest = 1; return 1; }
    if (!strcmp(arg, "--host-memory") || !strcmp(arg, "--disk")) {
        size_t *dst = arg[2] == 'h' ? &a->host_memory : &a->disk;
        if (!v || fl_parse_bytes(v, dst) || *dst == 0) {
            char why[300];
            if (v && fl_parse_bytes(v, dst) == 0) snprintf(why, sizeof why, "'%s' is no memory at all", v);
            else fl_bytes_refusal(v, why, sizeof why);
            fl_cli_usage("plan", "%s: %s", arg, why);
            return -1;
        }
        (*i)++;
        return 1;
    }
    if (!strcmp(arg, "--device-memory") || !strcmp(arg, "--device_memory")) {
        if (!v || fl_parse_bytes(v, &a->device_memory) || a->device_memory == 0) {
            char why[300];
            if (v && fl_parse_bytes(v, &a->device_memory) == 0) snprintf(why, sizeof why, "'%s' is no memory at all", v);
            else fl_bytes_refusal(v, why, sizeof why);
            fl_cli_usage("plan", "--device-memory: %s", why);
            return -1;
        }
        (*i)++;
        return 1;
    }
    if (!strcmp(arg, "--accelerator")) { /* plan for a device, present here or not */
        fl_accel want;
        if (fl_accel_parse(v, &want)) {
            fl_cli_usage("plan", "--accelerator must be auto, cpu or cuda (got '%s')", v ? v : "");
            return -1;
        }
        a->cuda = want == FL_ACCEL_CUDA; /* auto plans for the CPU: the plan needs no device */
        (*i)++;
        return 1;
    }
    if (!strcmp(arg, "--rank")) {
        if (fl_cli_int("plan", arg, v, 0, 1 << 20, &a->rank)) return -1;
        (*i)++;
        return 1;
    }
    if (!strcmp(arg, "--block-ms")) {
        if (fl_cli_float("plan", arg, v, &a->block_ms)) return -1;
        if (!(a->block_ms > 0) || !isfinite(a->block_ms)) {
            fl_cli_usage("plan", "--block-ms: '%s' is not a positive time in milliseconds", v);
            return -1;
        }
        (*i)++;
        return 1;
    }
    if (!strcmp(arg, "--seq-len")) {
        if (fl_cli_int("plan", arg, v, 1, 1 << 24, &a->seq_len)) return -1;
        (*i)++;
        return 1;
    }
    if (!strcmp(arg, "--target-len")) {
        if (fl_cli_int("plan", arg, v, 1, 1 << 24, &a->target_len)) return -1;
        (*i)++;
        return 1;
    }
    if (!strcmp(arg, "--generation")) {
        if (v && !strcmp(v, "auto")) a->generation = -1;
        else if (v && !strcmp(v, "on")) a->generation = 1;
        else if (v && !strcmp(v, "off")) a->generation = 0;
        else { fl_cli_usage("plan", "--generation: '%s' is not auto, on or off", v ? v : ""); return -1; }
        (*i)++;
        return 1;
    }
    return 0;
}

/* --largest's and --suggest's failure: the message, and the exit code of a usage error or a runtime one */
static int machine_failed(fl_status s, void *buf) {
    free(buf);
    fprintf(stderr, "fitllm plan: error: %s\n", fl_error_message());
    return s == FL_ERR_INVALID || s == FL_ERR_UNSUPPORTED || s == FL_ERR_NOT_FOUND ? FL_EXIT_USAGE : FL_EXIT_RUNTIME;
}

/* --suggest / --largest on CPU ranks: their memory is the host's RAM, so --host-memory is the budget and a
 * --device-memory beside it is not used: said, not silently dropped */
static void host_replaces_device(const plan_args *a, int ranks) {
    if (a->cuda || !a->host_memory || !a->device_memory) return;
    char h[32], d[32], e[32];
    fprintf(stderr, "note: --host-memory %s replaces --device-memory %s: a CPU rank's memory is the host's RAM (%s for "
            "each of %d rank(s)); --device-memory is a GPU's (--accelerator cuda)\n",
            fl_fmt_bytes(a->host_memory, h, sizeof h), fl_fmt_bytes(a->device_memory, d, sizeof d),
            fl_fmt_bytes(a->host_memory / (size_t)(ranks > 1 ? ranks : 1), e, sizeof e), ranks > 1 ? ranks : 1);
}

static int suggest_grid(const fl_run_config *cfg, const plan_args *a) {
    host_replaces_device(a, cfg->devices);
    fl_plan_machine mc = {a->device_memory, a->host_memory, a->disk, cfg->devices, a->cuda, a->seq_len,
                          a->generation}; /* the evaluation's sample as the run (or --generation) makes it */
    fl_plan_grid *g = malloc(sizeof *g);
    fl_status s = g ? fl_plan_suggest_grid(cfg, &mc, g) : fl_errorf(FL_ERR_OOM, "out of host memory");
    if (s != FL_OK) return machine_failed(s, g);
    if (a->json) fl_plan_grid_write_json(g, &mc, stdout);
    else fl_plan_grid_print(g, &mc, stdout);
    int rc = g->best >= 0 ? FL_EXIT_OK : FL_EXIT_OOM;
    free(g);
    return rc;
}

static int largest(const fl_run_config *cfg, const plan_args *a) {
    host_replaces_device(a, cfg->devices);
    fl_plan_machine mc = {a->device_memory, a->host_memory, a->disk, cfg->devices, a->cuda, a->seq_len};
    fl_plan_fit *f = malloc(sizeof *f);
    fl_status s = f ? fl_plan_largest(cfg, &mc, f) : fl_errorf(FL_ERR_OOM, "out of host memory");
    if (s != FL_OK) return machine_failed(s, f);
    fl_plan_fit_print(f, &mc, stdout);
    int rc = f->best >= 0 ? FL_EXIT_OK : FL_EXIT_OOM;
    free(f);
    return rc;
}

int fl_cmd_plan(int argc, char **argv) {
    const char *cmd = "plan";
    plan_args a = {.devices = 1, .generation = -1};
    fl_run_config cfg;
    /* --lora first: the LoRA options (and a YAML recipe's) are only accepted for a finetune_lora plan */
    fl_cmd_kind kind = FL_CMD_FINETUNE_FULL;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--lora")) kind = FL_CMD_FINETUNE_LORA;
    int rc = fl_cli_parse_run(cmd, kind, argc, argv, &cfg, extra, &a, help);
    if (rc) return rc < 0 ? 0 : rc;
    fl_plan_opts o;
    fl_plan_opts_default(&o);
    o.device_memory = a.device_memory;
    o.devices = cfg.devices; /* --devices is the training option (merged with a recipe's devices:) */
    o.seq_len = a.seq_len;
    o.block_ms = a.block_ms;
    o.target_len = a.target_len;
    o.rank = a.rank;
    o.cuda = a.cuda;
    o.generation = a.generation;
    if (a.largest && a.suggest) {
        fl_cli_usage("plan", "--largest and --suggest are two questions: ask one at a time");
        return FL_EXIT_USAGE;
    }
    if (a.largest && a.json) { /* it printed its table and exited 0: a JSON reader got text */
        fl_cli_usage("plan", "--largest prints a table only (no JSON form yet): drop --json, or ask a plain plan "
                     "(with the micro batch and length it finds) for JSON");
        return FL_EXIT_USAGE;
    }
    if (a.largest) return largest(&cfg, &a);
    if (a.suggest) return suggest_grid(&cfg, &a);
    if (fl_cli_is_blip2(cfg.checkpoint_dir)) { /* image-caption fine-tuning: its own loop (cmd_blip2_plan.c) */
        if (a.target_len || a.generation >= 0) {
            fprintf(stderr, "fitllm plan: error: %s: a BLIP-2 plan sizes the caption with --seq-len (no --target-len "
                    "or --generation)\n", a.target_len ? "--target-len" : "--generation");
            return FL_EXIT_USAGE;
        }
        return fl_cli_blip2_plan(&cfg, a.device_memory, a.seq_len, a.json, a.cuda, a.rank);
    }
    fl_plan *p = malloc(sizeof *p);
    if (!p) return fl_cli_fail(cmd, fl_errorf(FL_ERR_OOM, "out of host memory"), NULL);
    fl_status s = fl_plan_run(&cfg, &o, p);
    if (s != FL_OK) {
        free(p);
        fprintf(stderr, "fitllm %s: error: %s\n", cmd, fl_error_message());
        return s == FL_ERR_INVALID || s == FL_ERR_UNSUPPORTED || s == FL_ERR_NOT_FOUND ? FL_EXIT_USAGE : FL_EXIT_RUNTIME;
    }
    if (a.json) fl_plan_write_json(p, stdout);
    else fl_plan_print(p, stdout);
    rc = p->verdict == FL_PLAN_FITS ? FL_EXIT_OK : p->verdict == FL_PLAN_OOM ? FL_EXIT_OOM : FL_EXIT_USAGE;
    free(p);
    return rc;
}

/* ---- advice after a real out-of-memory failure ------------------------------------ */

void fl_cli_oom_advice(const fl_run_config *cfg, const fl_mem_oom *oom, FILE *f) {
    char a[32], b[32];
    if (oom && oom->valid) {
        size_t avail = oom->budget > oom->in_use ? oom->budget - oom->in_use : 0;
        fprintf(f, "out of memory during %s: %s requested %s, %s available", oom->phase, fl_mem_tag_name(oom->tag),
                fl_fmt_bytes(oom->requested, a, sizeof a), fl_fmt_bytes(avail, b, sizeof b));
        if (oom->budget) fprintf(f, " (budget %s)", fl_fmt_bytes(oom->budget, a, sizeof a));
        fprintf(f, "\nin use at that moment:\n");
        for (int t = 0; t < FL_TAG_COUNT; t++)
            fprintf(f, "  %-10s %s\n", fl_mem_tag_name((fl_mem_tag)t), fl_fmt_bytes(oom->cur[t], a, sizeof a));
        fprintf(f, "  %-10s %s\n", "total", fl_fmt_bytes(oom->in_use, a, sizeof a));
        if (!strcmp(oom->phase, "model load") || !strcmp(oom->phase, "setup"))
            fprintf(f, "nothing was written: the run failed before creating '%s'\n", cfg->out_dir);
        else
            fprintf(f, "no final checkpoint was written; '%s' keeps its logs and any step checkpoint committed "
                       "before the failure\n", cfg->out_dir);
    }
    fl_plan_opts o;
    fl_plan_opts_default(&o);
    fl_plan *p = malloc(sizeof *p);
    if (!p || fl_plan_run(cfg, &o, p) != FL_OK || p->verdict != FL_PLAN_OOM) {
        fprintf(f, "what to try: a smaller train.micro_batch_size (with accumulation), a shorter "
                   "train.max_seq_length, SGD, or a larger --max-memory\n");
        free(p);
        return;
    }
    fprintf(f, "planned peak of this run: %s (fitllm plan with the same arguments shows the table)\n",
            fl_fmt_bytes(p->peak_total, a, sizeof a));
    if (p->max_micro_batch_size > 0)
        fprintf(f, "largest micro_batch_size that fits: %d%s\n", p->max_micro_batch_size,
                p->max_micro_batch_size == p->global_batch ? " (capped at the global batch: its share per rank)" : "");
    fprintf(f, "what to try:\n");
    for (int i = 0; i < p->n_sugg; i++) {
        const fl_plan_suggestion *s = &p->sugg[i];
        if (!s->available) fprintf(f, "  - %-26s not available in this build\n", s->technique);
        else if (s->fits == 1)
            fprintf(f, "  - %-26s %s (planned peak %s; %s)\n", s->technique, s->change,
                    fl_fmt_bytes(s->peak, a, sizeof a), s->note);
        else if (s->fits < 0) fprintf(f, "  - %-26s not with this run: %s\n", s->technique, s->note);
        else fprintf(f, "  - %-26s does not fit: %s\n", s->technique, s->note);
    }
    free(p);
}

/* fitllm lab: the course lab's experiments on scaled models, as one command
 * (also `make demo`). Exit codes: 0 when every experiment ran (OOM and "not
 * available" are results), 1 when one failed or the files could not be
 * written, 2 usage error. */
#define _XOPEN_SOURCE 700
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "core/fs.h"
#include "fitllm/cpu.h"
#include "fitllm/lab.h"

static void help(void) {
    printf("usage: fitllm lab [--suite quick|full|ci|fsdp|blip2] [--only name,name] [--out_dir DIR] [--threads N] [--steps N]\n"
           "                  [--keep-runs] [--run-oom] [--plan-only] [--scale lab|real] [--lengths TABLE|fixed]\n"
           "                  [--peer pytorch] [--peak-tflops X]\n"
           "                  fsdp suite: [--model gpt2-xl|gpt2-xxl] [--precision LIST] [--fsdp.backward_prefetch on|off]\n\n"
           "Runs the memory lab's sequence of experiments (baseline, reduced batch, gradient accumulation, LR\n"
           "scaling, bf16-true, bf16-mixed, larger models, SGD, 8-bit Adam, activation checkpointing, CPU offload,\n"
           "LoRA, QLoRA, DDP, FSDP, FSDP with a larger batch) on the lab's models scaled to this machine (lab-* presets) with a memory budget\n"
           "scaled as an 80 GB GPU relates to TinyLlama-1.1B; prints a table and writes report.md, results.csv,\n"
           "results.json and PNG charts (gnuplot, optional). Rows for techniques this build lacks say n/a.\n\n"
           "  --suite NAME      (default quick)  quick: every experiment, 4 steps each (under a minute on 2 idle cores);\n"
           "                    full: 20 steps each; ci: the rows the unit tests assert, 2 steps;\n"
           "                    fsdp: the course's GPT-2-XL FSDP benchmark at its settings (4 ranks FULL_SHARD,\n"
           "                    T 128 and 16 GiB per rank, both scaled at lab scale; 32-true and 16-mixed): micro\n"
           "                    batch 1 2 4 7 8 9 without and with activation checkpointing (then 16 32 64, then\n"
           "                    doubling), each setting up to the first the plan says OOM; per-rank memory as the\n"
           "                    min-max over the ranks, iteration time, tok/s, TFLOP/s, MFU, the largest batch that\n"
           "                    fits marked, the real-scale plan and the course's figures beside; 2 steps each;\n"
           "                    blip2: the course's BLIP-2 image-caption sequence (blip2-opt-2.7b batch 64 32-true\n"
           "                    OOM, micro 8, accumulation, bf16, OPT-6.7B, Flan-T5-XXL AdamW OOM / SGD fits,\n"
           "                    checkpointing, CPU offload, LoRA, QLoRA, DDP, FSDP) on synthetic images and captions,\n"
           "                    every width and sequence / 16 at lab scale (--scale real: the real shapes, 80 GB);\n"
           "                    what BLIP-2 fine-tuning refuses in this build is n/a; 3 steps each\n"
           "  --only LIST       (default: the whole suite)  comma-separated experiment names:\n                   ");
    const char *const *n = fl_lab_experiments("quick");
    for (int i = 0; n[i]; i++) printf(" %s", n[i]);
    n = fl_lab_experiments("blip2");
    printf("\n                    blip2 suite:");
    for (int i = 0; n[i]; i++) printf(" %s", n[i]);
    printf("\n                    by name only (issue 35, each rank's memory and step time of a split of lab-7b):\n"
           "                    tp-2 tp-4 pp-2 pp-4 dp2-tp2 tp2-pp2 tp2-sp");
    printf("\n                    fsdp suite: b1 b2 b4 b7 b8 b9 b16 .. b128, b1-ckpt .. b512-ckpt (32-true),\n"
           "                    amp-b1 .. amp-b512-ckpt (16-mixed)\n"
           "  --out_dir DIR     (default lab)  where the report, CSV, JSON and charts go\n"
           "  --threads N       (default 0 = all cores)  CPU threads\n"
           "  --accelerator A   (default auto)  auto|cpu|cuda; auto: the GPU when this build has CUDA and one\n"
           "                    is visible, else the CPU; cuda is EXPERIMENTAL (single GPU; README)\n"
           "  --steps N         (default: the suite's)  optimizer steps per runnable experiment\n"
           "  --keep-runs       (default off)  keep each run's out_dir (logs/metrics.csv) under DIR/runs\n"
           "                    (default: a temporary folder under $TMPDIR or /tmp, removed at the end)\n"
           "  --run-oom         (default off)  also train the rows the plan says OOM, to see the allocator refuse\n"
           "                    them; off: such a row is decided by its plan before any model memory is touched\n"
           "                    (under a second; its note says \"planned; not run\")\n"
           "  --plan-only       (default off)  train no row: every verdict and peak is the row's plan (seconds for\n"
           "                    the whole suite, at either scale; e.g. --scale real on a machine without 80 GB)\n"
           "  --scale S         (default lab)  lab: the scaled models and budget above; real: the lab's real models\n"
           "                    (tinyllama-1.1b, open-llama-3b, open-llama-7b) at the course's settings (sample lengths\n"
           "                    drawn from --lengths, cut to max_seq_length 512) with an 80 GB budget, for\n"
           "                    an 80 GB GPU (--accelerator cuda; ~100 GB of host memory on the CPU); the 4-rank rows\n"
           "                    are n/a (they need 4 devices: mpirun); --suite fsdp: gpt2-xl at T 128, 16 GiB per\n"
           "                    rank, its 4 ranks sharing one device of at least 64 GiB (else n/a)\n"
           "  --lengths TABLE   (default recipes/data/alpaca-lengths.tsv, from the working directory or beside the\n"
           "                    build folder)  --scale real, quick/full: the sample-length quantile table the rows\n"
           "                    draw from (Alpaca's measured lengths: median 118, p95 320, max 406 tokens); each\n"
           "                    micro batch is padded to its longest sample, no packing; fixed: every sample 1025\n"
           "                    tokens (T = 1024)\n"
           "  --data FILE       (default: at --scale real, data/alpaca2k/alpaca2k.json when the working directory\n"
           "                    has it, else synthetic)  quick/full: the rows fine-tune on this Alpaca-style JSON /\n"
           "                    JSONL file (the course's Alpaca2k), each sample cut to max_seq_length (real scale:\n"
           "                    512; lab scale: T + 1), padded to the micro batch's longest\n"
           "  --tokenizer DIR   (default: the built-in bytes)  with --data: the tokenizer folder (the real model's)\n"
           "  --peer pytorch    (default off)  quick/full/fsdp/blip2: beside each lab row (at the real scale) and each\n"
           "                    of the course's runs, what PyTorch (HF Llama, GPT-2, OPT, Flan-T5 or BLIP-2 with its\n"
           "                    vision tower frozen, sdpa; the row's optimizer, autocast, HF checkpointing, PEFT LoRA,\n"
           "                    bitsandbytes NF4 and 8-bit AdamW) would need: parameters, gradients, optimizer\n"
           "                    state, saved tensors and logits as measured with torch (tests/ref/pytorch_alloc.py),\n"
           "                    the peak and DeepSpeed / DDP / FSDP modelled (each row says which); fitllm / PyTorch\n"
           "                    and PyTorch / the course's reading as ratios, and why fitllm differs, in GB by\n"
           "                    category (weights, gradients, optimizer state, activations, the rest)\n"
           "  --peak-tflops X   (default: H100/H200/A100/V100 by name, none on a CPU)  the device's peak for MFU\n"
           "  --model M         (default gpt2-xl)  fsdp suite: gpt2-xl or gpt2-xxl (the course's ~3 B GPT;\n"
           "                    GPT-3 2.7B's shape, 2.65 B parameters)\n"
           "  --precision LIST  (default 32-true,16-mixed)  fsdp suite: the precisions swept (16-mixed: the course's AMP)\n"
           "  --fsdp.backward_prefetch on|off  (default on)  fsdp suite: the backward's next all-gather posted ahead\n\n"
           "Stopping: Ctrl-C (SIGINT) or SIGTERM stops after the step in progress, writes no report and removes the\n"
           "runs' temporary folder; the same signal again stops at once (the folder removed too). A reader that goes\n"
           "away (| head) ends the lab at the next row it prints, its folder removed, killed by SIGPIPE as a filter is.\n\n"
           "exit codes: 0 every experiment ran (OOM and n/a are results), 1 an experiment failed or the files\n"
           "could not be written, 2 usage error, 130 SIGINT, 143 SIGTERM\n");
}

/* The runs' folder: fl_cmd_lab's, removed by stop_at_once when it is temporary (g_runs_temp) */
static char g_runs[4200];
static int g_runs_temp;

static int poll_stop(void *ud) {
    (void)ud;
    return fl_cli_interrupted();
}

/* The second stop signal (from the signals' thread; the rows' threads still run, and the process dies after this):
 * the temporary folder removed, best effort (a file a row creates meanwhile may keep it), and said. */
static void stop_at_once(int sig) {
    if (g_runs_temp) fl_fs_remove_dir(g_runs);
    struct stat st;
    const int left = g_runs_temp && stat(g_runs, &st) == 0;
    fprintf(stderr, "fitllm lab: stopped at once by %s; no report written%s%s%s\n", fl_cli_signal_name(sig),
            g_runs_temp ? (left ? "; its temporary folder is left: remove '" : "; its temporary folder removed")
                        : "; the runs so far are in '",
            g_runs_temp && !left ? "" : g_runs, g_runs_temp && !left ? "" : "'");
}

/* An --out_dir that cannot hold the report (a file, or under one): said before the rows run (they ran for minutes,
 * then the writing failed). 1 when refused (printed). */
static int out_dir_refused(const char *cmd, const char *out_dir) {
    char probe[4200];
    snprintf(probe, sizeof probe, "%s", out_dir);
    struct stat st;
    if (stat(out_dir, &st) == 0 && !S_ISDIR(st.st_mode))
        return fl_cli_usage(cmd, "--out_dir '%s' is a file, not a folder", out_dir) != 0;
    char *sl = strrchr(probe, '/');
    if (!sl || stat(out_dir, &st) == 0) return 0;
    *sl = 0; /* a folder still to make: its parent must not be a file */
    if (*probe && stat(probe, &st) == 0 && !S_ISDIR(st.st_mode))
        return fl_cli_usage(cmd, "--out_dir '%s': '%s' is a file, not a folder", out_dir, probe) != 0;
    return 0;
}

int fl_cmd_lab(int argc, char **argv) {
    const char *cmd = "lab", *out_dir = "lab";
    fl_lab_opts o;
    fl_lab_opts_default(&o);
    int keep = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { help(); return 0; }
        else if (!strcmp(a, "--suite")) {
            if (!v || !fl_lab_experiments(v)) return fl_cli_usage(cmd, "--suite: '%s' is not quick, full, ci or fsdp, or blip2", v ? v : "");
            o.suite = v;
            i++;
        } else if (!strcmp(a, "--only")) {
            if (!v || !*v) return fl_cli_usage(cmd, "--only needs a list of experiment names (an empty one ran the "
                                               "whole suite)");
            o.only = v;
            i++;
        } else if (!strcmp(a, "--out_dir") || !strcmp(a, "--out-dir")) {
            if (!v) return fl_cli_usage(cmd, "--out_dir needs a folder");
            out_dir = v;
            i++;
        } else if (!strcmp(a, "--threads")) { if (fl_cli_threads(cmd, v, 1024, &o.threads)) return FL_EXIT_USAGE; i++; }
        else if (!strcmp(a, "--accelerator")) { int rc = fl_cli_accelerator(cmd, v); if (rc) return rc; i++; }
        else if (!strcmp(a, "--steps")) { if (fl_cli_int(cmd, a, v, 1, 256, &o.steps)) return FL_EXIT_USAGE; i++; }
        else if (!strcmp(a, "--keep-runs")) keep = 1;
        else if (!strcmp(a, "--peer")) {
            if (!v || strcmp(v, "pytorch")) return fl_cli_usage(cmd, "--peer: '%s' is not pytorch", v ? v : "");
            o.peer = v;
            i++;
        } else if (!strcmp(a, "--data") || !strcmp(a, "--tokenizer")) {
            if (!v || !*v) return fl_cli_usage(cmd, "%s needs a %s", a, a[2] == 'd' ? "JSON file" : "folder");
            if (a[2] == 'd') o.data = v;
            else o.tokenizer = v;
            i++;
        } else if (!strcmp(a, "--lengths")) {
            if (!v || !*v) return fl_cli_usage(cmd, "--lengths needs a length table (quantile<TAB>length lines) or fixed");
            o.lengths = v;
            i++;
        }
        else if (!strcmp(a, "--run-oom")) o.run_oom = 1;
        else if (!strcmp(a, "--plan-only")) o.plan_only = 1;
        else if (!strcmp(a, "--model")) {
            if (!v || (strcmp(v, "gpt2-xl") && strcmp(v, "gpt2-xxl")))
                return fl_cli_usage(cmd, "--model: '%s' is not gpt2-xl or gpt2-xxl (the fsdp suite's models)", v ? v : "");
            o.model = v;
            i++;
        } else if (!strcmp(a, "--precision")) {
            if (!v) return fl_cli_usage(cmd, "--precision needs 32-true, 16-mixed or both (comma-separated)");
            o.precisions = v;
            i++;
        } else if (!strcmp(a, "--fsdp.backward_prefetch") || !strcmp(a, "--fsdp.backward-prefetch")) {
            if (!v || (strcmp(v, "on") && strcmp(v, "off") && strcmp(v, "true") && strcmp(v, "false") &&
                       strcmp(v, "BACKWARD_PRE")))
                return fl_cli_usage(cmd, "--fsdp.backward_prefetch: '%s' is not on (BACKWARD_PRE, true) or off (false)",
                                    v ? v : "");
            o.no_backward_prefetch = !strcmp(v, "off") || !strcmp(v, "false");
            i++;
        } else if (!strcmp(a, "--peak-tflops")) {
            char *end = NULL;
            o.peak_tflops = v ? strtod(v, &end) : 0;
            if (!v || !end || *end || !(o.peak_tflops > 0))
                return fl_cli_usage(cmd, "--peak-tflops: '%s' is not a positive number", v ? v : "");
            i++;
        }
        else if (!strcmp(a, "--scale")) {
            if (!v || (strcmp(v, "lab") && strcmp(v, "real"))) return fl_cli_usage(cmd, "--scale: '%s' is not lab or real", v ? v : "");
            o.real_scale = !strcmp(v, "real");
            i++;
        }
        else return fl_cli_unknown_option(cmd, a, (const char *const[]){"--accelerator", "--data", "--help", "--fsdp.backward_prefetch", "--keep-runs", "--lengths", "--model", "--peer", "--only", "--plan-only", "--out_dir", "--peak-tflops", "--precision", "--run-oom", "--scale", "--steps", "--suite", "--threads", "--tokenizer", NULL});
    }
    if (out_dir_refused(cmd, out_dir)) return FL_EXIT_USAGE;
    /* the runs' out_dirs: DIR/runs (--keep-runs) or a temporary folder of this command's (the library would make
     * one, but a stop at once must know it to remove it) */
    if (keep) snprintf(g_runs, sizeof g_runs, "%s/runs", out_dir);
    else {
        snprintf(g_runs, sizeof g_runs, "%s/fitllm-lab-XXXXXX", fl_fs_tmpdir());
        if (!mkdtemp(g_runs)) {
            fprintf(stderr, "fitllm %s: error: cannot create a temporary folder for the runs under %s (TMPDIR): %s\n",
                    cmd, fl_fs_tmpdir(), strerror(errno));
            return FL_EXIT_RUNTIME;
        }
    }
    g_runs_temp = !keep;
    o.run_dir = g_runs;
    o.stop = poll_stop;
    fl_lab_report rep;
    /* a reader that goes away (`fitllm lab | head`): the write fails (EPIPE) instead of killing the process, the lab
     * ends at the row and removes its folder, then the process ends as a filter does (SIGPIPE) */
    signal(SIGPIPE, SIG_IGN);
    const fl_cli_signals sigs = {.cmd = cmd, .threads = o.threads > 0 ? o.threads : fl_cpu_default_threads(),
                                 .at_once_msg = "fitllm lab: stopped at once\n",
                                 .stop_what = "stopping the lab after this step, no report written",
                                 .at_once = stop_at_once};
    fl_cli_signals_begin(&sigs);
    fl_status s = fl_lab_run(&o, stdout, &rep);
    fl_cli_signals_end();
    if (g_runs_temp) fl_fs_remove_dir(g_runs);
    if (s != FL_OK && rep.out_errno == EPIPE) {
        fl_lab_report_free(&rep);
        fl_cli_die_of(SIGPIPE);
        return FL_EXIT_RUNTIME;
    }
    if (s != FL_OK) {
        fl_lab_report_free(&rep);
        fprintf(stderr, "fitllm %s: error: %s\n", cmd, fl_error_message());
        return s == FL_ERR_INVALID ? FL_EXIT_USAGE : FL_EXIT_RUNTIME;
    }
    if (rep.stopped) {
        const int n = rep.n;
        fl_lab_report_free(&rep);
        fflush(stdout);
        fprintf(stderr, "fitllm %s: stopped by %s after %d row%s; no report written%s%s%s\n", cmd,
                fl_cli_signal_name(rep.stopped), n, n == 1 ? "" : "s", keep ? " (the runs so far are in '" : "",
                keep ? g_runs : "", keep ? "')" : "");
        return 128 + rep.stopped;
    }
    fl_lab_print_table(&rep, stdout);
    int charts = 0;
    s = fl_lab_write(&rep, out_dir, &charts);
    if (s != FL_OK) {
        fl_lab_report_free(&rep);
        fprintf(stderr, "fitllm %s: error: %s\n", cmd, fl_error_message());
        return FL_EXIT_RUNTIME;
    }
    char pngs[128] = ""; /* the charts gnuplot drew (step_time.png needs a row that trained; sweep.png the fsdp suite) */
    static const char *const k_png[] = {"memory.png", "phases.png", "step_time.png", "sweep.png"};
    for (size_t i = 0; charts && i < sizeof k_png / sizeof k_png[0]; i++) {
        char path[FL_CFG_PATH + 32];
        snprintf(path, sizeof path, "%s/%s", out_dir, k_png[i]);
        if (access(path, R_OK) == 0)
            snprintf(pngs + strlen(pngs), sizeof pngs - strlen(pngs), ", %s", k_png[i]);
    }
    printf("\nwrote %s/report.md, results.csv, results.json%s (%.1f s)\n", out_dir,
           charts ? pngs : " (no charts: see report.md)", rep.wall_s);
    int errors = rep.n_errors;
    fl_lab_report_free(&rep);
    errno = 0;
    /* the reader left during the table: as a filter ends */
    if ((fflush(stdout) != 0 || ferror(stdout)) && errno == EPIPE) fl_cli_die_of(SIGPIPE);
    if (errors) {
        fprintf(stderr, "fitllm %s: %d experiment(s) failed (see the table)\n", cmd, errors);
        return FL_EXIT_RUNTIME;
    }
    return 0;
}

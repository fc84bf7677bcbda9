/* Shared CLI helpers: error reporting, option parsing, model loading. */
#include <errno.h>
#include <math.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "core/fs.h"
#include "fitllm/checkpoint.h"
#include "fitllm/cuda.h"

int fl_cli_fail(const char *cmd, fl_status s, const fl_mem_pool *pool) {
    fflush(stdout); /* what was printed before the failure comes first, also when both go to one file */
    fprintf(stderr, "fitllm %s: error: %s\n", cmd, fl_error_message());
    if (s == FL_ERR_OOM) {
        if (pool && pool->oom.valid) fl_mem_print_oom(pool, stderr);
        /* only options the failing command has */
        if (!strcmp(cmd, "bench-step") || !strcmp(cmd, "demo"))
            fprintf(stderr,
                    "hint: try a smaller --micro-batch or --seq, a larger --max-memory, or (when available) bf16, "
                    "activation checkpointing, SGD / 8-bit Adam, LoRA or QLoRA\n");
        else if (!strcmp(cmd, "generate"))
            fprintf(stderr, "hint: the weights and the KV cache (prompt + --max_new_tokens tokens) must fit in "
                            "memory: try a smaller --max_new_tokens or prompt, or a smaller model\n");
        else
            fprintf(stderr, "hint: the model does not fit in the memory available: free memory or use a smaller "
                            "model\n");
        return FL_EXIT_OOM;
    }
    /* the documented codes: a bad value, a file or name that is not there, a request this build cannot do (2), as the
     * training commands map them; anything else that failed while running (1) */
    return s == FL_ERR_INVALID || s == FL_ERR_NOT_FOUND || s == FL_ERR_UNSUPPORTED ? FL_EXIT_USAGE : FL_EXIT_RUNTIME;
}

int fl_cli_accelerator(const char *cmd, const char *val) {
    fl_accel want, use;
    if (fl_accel_parse(val, &want)) return fl_cli_usage(cmd, "--accelerator must be auto, cpu or cuda (got '%s')", val ? val : "");
    const fl_status s = fl_accel_resolve(want, &use);
    if (s != FL_OK) { /* this build without CUDA: 2, as another request it cannot do; no GPU visible: 1 */
        fprintf(stderr, "fitllm %s: error: %s\n", cmd, fl_error_message());
        return s == FL_ERR_UNSUPPORTED || s == FL_ERR_INVALID ? FL_EXIT_USAGE : FL_EXIT_RUNTIME;
    }
    fl_backend_set_default_name(fl_accel_backend(use));
    return 0;
}

int fl_cli_launched_rank(void) {
    fl_launch_info li;
    return fl_launch_detect(&li) == FL_OK && li.kind != FL_LAUNCH_NONE ? li.rank : 0;
}

/* Under a launcher every rank parses the same command line: an error every rank meets is said by rank 0; the others
 * wait for the launcher to end them once rank 0 has exited (an error of their own still shows after 3 s). */
void fl_cli_after_rank0(void) {
    if (fl_cli_launched_rank() != 0) sleep(3);
}

int fl_cli_usage(const char *cmd, const char *fmt, ...) {
    va_list ap;
    fl_cli_after_rank0();
    fflush(stdout);
    fprintf(stderr, "fitllm %s: ", cmd);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\nsee 'fitllm %s --help'\n", cmd);
    return FL_EXIT_USAGE;
}

int fl_cli_int(const char *cmd, const char *opt, const char *val, long lo, long hi, int *out) {
    if (!val) { fl_cli_usage(cmd, "option %s needs a value", opt); return -1; }
    char *end;
    errno = 0;
    long v = strtol(val, &end, 10);
    if (errno || end == val || *end || v < lo || v > hi) {
        fl_cli_usage(cmd, "option %s: '%s' is not an integer in [%ld, %ld]", opt, val, lo, hi);
        return -1;
    }
    *out = (int)v;
    return 0;
}

void fl_cli_warn_threads(const char *cmd, int threads) {
    static int warned;
    int phys, cpus = fl_cli_usable_cpus(&phys);
    if (threads <= cpus || warned) return;
    warned = 1;
    fflush(stdout);
    fprintf(stderr, "fitllm %s: warning: --threads %d is more than the %d CPU cores this process can run on: the "
            "threads take turns on them, which slows the run down (more so on a shared machine); give --threads %d "
            "or fewer (0 or none: all cores)\n", cmd, threads, cpus, cpus);
}

int fl_cli_threads(const char *cmd, const char *val, long hi, int *out) {
    if (fl_cli_int(cmd, "--threads", val, 0, hi, out)) return -1;
    fl_cli_warn_threads(cmd, *out);
    return 0;
}

int fl_cli_float(const char *cmd, const char *opt, const char *val, float *out) {
    if (!val) { fl_cli_usage(cmd, "option %s needs a value", opt); return -1; }
    char *end;
    float v = strtof(val, &end);
    if (end == val || *end) { fl_cli_usage(cmd, "option %s: '%s' is not a number", opt, val); return -1; }
    *out = v;
    return 0;
}

int fl_cli_pos_float(const char *cmd, const char *opt, const char *val, float *out) {
    float v;
    if (fl_cli_float(cmd, opt, val, &v)) return -1;
    if (!(v > 0) || !isfinite(v)) {
        fl_cli_usage(cmd, "option %s: '%s' must be a positive finite number", opt, val);
        return -1;
    }
    *out = v;
    return 0;
}

static int is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

static int exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0;
}

fl_status fl_cli_load_model(fl_model *m, const char *path, int random_init, uint64_t seed, const fl_backend *be,
                            fl_mem_pool *pool, int *weights_loaded) {
    return fl_cli_load_model_ex(m, path, random_init, seed, be, pool, NULL, weights_loaded);
}

fl_status fl_cli_load_model_ex(fl_model *m, const char *path, int random_init, uint64_t seed, const fl_backend *be,
                               fl_mem_pool *pool, const fl_model_storage *stg, int *weights_loaded) {
    fl_model_config cfg;
    char named[FL_CLI_PATH];
    *weights_loaded = 0;
    FL_TRY(fl_cli_resolve_model(NULL, path, named, sizeof named, 0)); /* a Hugging Face repo id: its folder */
    path = named;
    if (!exists(path)) {
        if (fl_fs_is_path_form(path)) return fl_errorf(FL_ERR_NOT_FOUND, "'%s': no such file or folder", path);
        fl_status s = fl_preset_find(path, &cfg);
        if (s != FL_OK) {
            char why[1024]; /* copy first: fl_errorf rewrites the message buffer it would read */
            snprintf(why, sizeof why, "%s", fl_error_message());
            return fl_errorf(FL_ERR_NOT_FOUND, "'%s' is neither a file, a folder nor a model preset (%s)", path, why);
        }
        fl_cli_note_preset(NULL, path);
        FL_TRY(fl_model_init_ex(m, &cfg, be, pool, stg));
        FL_TRY(fl_model_init_random_ex(m, seed));
        return FL_OK;
    }
    if (random_init) {
        char cp[FL_CLI_PATH + 16];
        if (is_dir(path)) snprintf(cp, sizeof cp, "%s/config.json", path);
        else snprintf(cp, sizeof cp, "%s", path);
        size_t n = strlen(cp);
        if (n > 4 && strcmp(cp + n - 4, ".bin") == 0) {
            /* llama2.c checkpoint: take its shape, then re-initialize. */
            FL_TRY(fl_llama2c_load_model_ex(m, path, be, pool, stg));
        } else {
            FL_TRY(fl_hf_load_config(cp, &cfg));
            FL_TRY(fl_model_init_ex(m, &cfg, be, pool, stg));
        }
        FL_TRY(fl_model_init_random_ex(m, seed));
        return FL_OK;
    }
    return fl_model_load_auto_ex(m, path, be, pool, stg, weights_loaded);
}

static int cli_has(const char *dir, const char *name) {
    char q[4096];
    struct stat st;
    return fl_fs_join(q, sizeof q, dir, name) == FL_OK && stat(q, &st) == 0;
}

fl_status fl_cli_run_folder(const char *arg, char *path, size_t n, char *note, size_t nn) {
    struct stat st;
    snprintf(path, n, "%s", arg);
    if (nn) note[0] = 0;
    if (stat(arg, &st) != 0 || !S_ISDIR(st.st_mode) || cli_has(arg, "config.json") ||
        cli_has(arg, "adapter_config.json") || cli_has(arg, "model_config.yaml"))
        return FL_OK;
    /* a run folder: final/, else the newest committed step */
    char p[4096];
    snprintf(p, sizeof p, "%s/final", arg);
    if (fl_fs_is_dir(p) && fl_ckpt_is_committed(p)) {
        snprintf(path, n, "%s", p);
        snprintf(note, nn, "%s is a run folder: its final checkpoint %s", arg, p);
        return FL_OK;
    }
    if (fl_ckpt_find_latest(arg, p, sizeof p) == FL_OK) {
        snprintf(path, n, "%s", p);
        snprintf(note, nn, "%s is a run folder: its newest checkpoint %s (no final/ yet)", arg, p);
        return FL_OK;
    }
    fl_error_clear();
    snprintf(p, sizeof p, "%s/final", arg);
    if (fl_fs_is_dir(p) || cli_has(arg, "logs") || cli_has(arg, "hyperparameters.yaml"))
        return fl_errorf(FL_ERR_NOT_FOUND, "%s: a run folder without a committed checkpoint yet (no final/, no "
                         "step-*/ with its COMMITTED marker): wait for the first save (train.save_interval)", arg);
    return fl_errorf(FL_ERR_NOT_FOUND, "%s: not a model folder (no config.json), a PEFT adapter folder (no "
                     "adapter_config.json) nor a training run folder (no final/ or step-*/)", arg);
}

double fl_cli_now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

double fl_cli_peak_rss_mb(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss / 1024.0;
}

int fl_cli_stdout_is_terminal(int world) {
    const char *e = getenv("FITLLM_STDOUT_TTY");
    if (e && *e) return !strcmp(e, "1");
    return world <= 1 && isatty(STDOUT_FILENO);
}

const char *fl_cli_nearest(const char *word, const char *const *known) {
    const char *best = NULL;
    size_t bd = (size_t)-1;
    for (size_t i = 0; known && known[i]; i++) {
        size_t d = fl_edit_distance(word, known[i]);
        if (d < bd) bd = d, best = known[i];
    }
    return best && bd <= 2 + strlen(word) / 4 ? best : NULL;
}

int fl_cli_unknown_option(const char *cmd, const char *arg, const char *const *known) {
    char key[128];
    snprintf(key, sizeof key, "%.*s", (int)strcspn(arg, "="), arg); /* --opt=value: the option's name */
    for (size_t i = 0; known && known[i]; i++) /* a known option at the end of the line, its value missing */
        if (!strcmp(key, known[i])) return fl_cli_usage(cmd, "option '%s' needs a value", key);
    const char *near = fl_cli_nearest(key, known);
    if (near) return fl_cli_usage(cmd, "unknown option '%s' (did you mean '%s'?)", key, near);
    return fl_cli_usage(cmd, "unknown option '%s'", key);
}

int fl_cli_same_dir(const char *a, const char *b) {
    struct stat sa, sb;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && S_ISDIR(sa.st_mode) && sa.st_dev == sb.st_dev &&
           sa.st_ino == sb.st_ino;
}

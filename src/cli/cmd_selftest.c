/* fitllm selftest: a backend's ops against the CPU backend on the same inputs (fitllm/selftest.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "core/fs.h"
#include "fitllm/cuda.h"
#include "fitllm/selftest.h"
#include "fitllm/trainer.h"

/* ---- one training run of the micro preset on each backend ------------------------------------
 * The ops above are checked one by one; this runs them together as the trainer does (forward,
 * backward, AdamW with clipping, a checkpoint), 4 steps of Synthetic data, on the tested backend and
 * on the reference, and compares every step's loss. Bound: 1e-5 relative, fp32's two evaluations of
 * the same sums (tests/cuda/gpu_check_all.sh); the opaque backend gives the CPU's bits. The offload
 * variant runs the tested backend with --strategy deepspeed_stage_2_offload (the host tier: pinned
 * memory on a GPU, the update staged through it) against the reference without. */
#define ST_STEPS 4

typedef struct {
    double loss[ST_STEPS];
    long steps;
} st_losses;

static int st_hook(void *ud, long step, double loss, const void *params, size_t bytes) {
    (void)params, (void)bytes;
    st_losses *l = ud;
    if (step >= 1 && step <= ST_STEPS) l->loss[step - 1] = loss;
    l->steps = step;
    return 0;
}

static fl_status st_train(const char *backend, const char *dir, const char *tag, int offload, int threads,
                          st_losses *out, double *secs) {
    fl_run_config c;
    fl_cfg_defaults(&c, FL_CMD_FINETUNE_FULL);
    snprintf(c.checkpoint_dir, sizeof c.checkpoint_dir, "micro");
    snprintf(c.out_dir, sizeof c.out_dir, "%s/%s", dir, tag);
    c.data.kind = FL_DATA_SYNTHETIC;
    c.data.synthetic_train = 64;
    c.data.synthetic_val = 4;
    c.train.micro_batch_size = 4;
    c.train.global_batch_size = 8;
    c.train.max_steps = ST_STEPS;
    c.train.max_seq_length = 64;
    c.train.max_norm = 1.0f;
    c.train.lr_warmup_steps = 0;
    c.train.save_interval = 2;
    c.eval.interval = 1 << 30;
    c.eval.max_new_tokens = 0;
    c.eval.final_validation = 0;
    c.threads = threads;
    c.overwrite = 1;
    if (offload) snprintf(c.strategy, sizeof c.strategy, "deepspeed_stage_2_offload");
    memset(out, 0, sizeof *out);
    const char *prev = getenv("FITLLM_BACKEND");
    char keep[64] = "";
    if (prev) snprintf(keep, sizeof keep, "%s", prev);
    setenv("FITLLM_BACKEND", backend, 1);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    fl_status s = fl_trainer_run(&c, NULL, 0, st_hook, out, NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (prev) setenv("FITLLM_BACKEND", keep, 1);
    else unsetenv("FITLLM_BACKEND");
    *secs = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    if (s == FL_OK && out->steps != ST_STEPS)
        s = fl_errorf(FL_ERR_INTERNAL, "selftest training on %s: %ld steps, expected %d", backend, out->steps, ST_STEPS);
    return s;
}

/* 0 pass, 1 mismatch or failure; prints one line per case like the op cases */
static int st_train_cases(const char *name, const char *ref_name, const char *only, int threads, FILE *f, int *n_cases) {
    char dir[256];
    snprintf(dir, sizeof dir, "%s/fitllm-selftest-XXXXXX", fl_fs_tmpdir());
    if (!mkdtemp(dir)) {
        fprintf(f, "FAIL train_step: cannot make a folder under %s (TMPDIR)\n", fl_fs_tmpdir());
        ++*n_cases;
        return 1;
    }
    int bad = 0;
    static const char *names[2] = {"train_step micro fp32 AdamW (4 steps, checkpoint)", "train_step offload (deepspeed_stage_2_offload)"};
    for (int k = 0; k < 2; k++) {
        if (only && !strstr(names[k], only)) continue;
        ++*n_cases;
        st_losses a, b;
        double ta = 0, tb = 0;
        fl_status s = st_train(ref_name, dir, k ? "ref-offload" : "ref", 0, threads, &b, &tb);
        if (s == FL_OK) s = st_train(name, dir, k ? "dev-offload" : "dev", k, threads, &a, &ta);
        if (s != FL_OK) {
            fprintf(f, "FAIL %-48s %s\n", names[k], fl_error_message());
            bad = 1;
            continue;
        }
        double worst = 0;
        for (int i = 0; i < ST_STEPS; i++) {
            double r = fabs(a.loss[i] - b.loss[i]) / fabs(b.loss[i]);
            if (!(r <= worst)) worst = r; /* NaN sticks */
        }
        const double bound = 1e-5;
        int ok = worst <= bound;
        fprintf(f, "%s %-48s max relative loss difference %.2e (bound %.0e), %.2f s\n", ok ? "ok  " : "FAIL", names[k],
                worst, bound, ta);
        bad |= !ok;
    }
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(f, "note: could not remove %s\n", dir);
    return bad;
}

static void help(void) {
    printf("usage: fitllm selftest [--accelerator cuda|cpu] [--backend NAME] [--only SUBSTRING] [--threads N]\n\n"
           "Runs every op of a backend (GEMMs in every type combination, norms, RoPE, attention forward and\n"
           "backward, SwiGLU/GELU/ReLU, cross-entropy, optimizers incl. 8-bit AdamW, 16-bit conversions, NF4\n"
           "matmuls, LoRA) on random inputs, and the same op on the CPU backend, and compares every output\n"
           "element against a floating-point error bound of the computation. Prints one line per case (worst\n"
           "error as a fraction of its bound; median time of 5 runs on the tested backend). Then trains the\n"
           "micro preset 4 steps (AdamW, clipping, a checkpoint) on both backends, and once more with CPU\n"
           "offload (deepspeed_stage_2_offload) on the tested one, comparing every step's loss within 1e-5\n"
           "(relative). On a GPU backend, the attention kernels a bf16 run may get side by side against float64,\n"
           "with their time and TFLOP/s: FITLLM_CUDA_ATTN=cudnn (NVIDIA cuDNN's fused attention, opened at run\n"
           "time; EXPERIMENTAL), own and legacy (--only attention_choices runs just these). Exits 1 on any\n"
           "mismatch.\n\n"
           "  --accelerator A   cuda (default when this build has CUDA and a GPU is visible; EXPERIMENTAL) or\n"
           "                    cpu (the CPU backend against the portable reference backend)\n"
           "  --backend NAME    any backend of this build by name (fitllm --version lists them)\n"
           "  --only S          only the cases whose name contains S (e.g. gemm, attention)\n"
           "  --small           small shapes (what the test suite runs; seconds on a CPU)\n"
           "  --threads N       CPU threads of the CPU backends (default: all cores)\n");
}

int fl_cmd_selftest(int argc, char **argv) {
    const char *cmd = "selftest", *name = NULL, *only = NULL, *accel = NULL;
    int threads = 0, small = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { help(); return 0; }
        else if (!strcmp(a, "--accelerator") && i + 1 < argc) accel = argv[++i];
        else if (!strcmp(a, "--backend") && i + 1 < argc) name = argv[++i];
        else if (!strcmp(a, "--only") && i + 1 < argc) only = argv[++i];
        else if (!strcmp(a, "--small")) small = 1;
        else if (!strcmp(a, "--threads")) {
            if (fl_cli_threads(cmd, i + 1 < argc ? argv[++i] : NULL, 4096, &threads)) return FL_EXIT_USAGE;
        } else return fl_cli_unknown_option(cmd, a, (const char *const[]){"--accelerator", "--backend", "--help", "--only", "--small", "--threads", NULL});
    }
    if (!name) {
        fl_accel want = FL_ACCEL_AUTO, use;
        if (accel && fl_accel_parse(accel, &want))
            return fl_cli_usage(cmd, "--accelerator must be auto, cpu or cuda (got '%s')", accel);
        if (fl_accel_resolve(want, &use) != FL_OK) {
            fprintf(stderr, "fitllm %s: error: %s\n", cmd, fl_error_message());
            return FL_EXIT_USAGE; /* as --accelerator's refusal everywhere (fl_cli_accelerator) */
        }
        name = fl_accel_backend(use);
    }
    if (!strcmp(name, "null")) /* every case would fail: there is nothing to compare */
        return fl_cli_usage(cmd, "--backend null: the null backend computes nothing (the planner's stand-in for a "
                            "device's memory): there is nothing to check");
    fl_backend_facts facts; /* the reference it is compared against; a line on its device */
    fl_status s = fl_backend_facts_of(name, &facts);
    if (s != FL_OK) return fl_cli_fail(cmd, s, NULL);
    const char *ref_name = facts.reference;
    fl_backend dev, ref;
    s = fl_backend_init_by_name(name, &dev, threads);
    if (s != FL_OK) return fl_cli_fail(cmd, s, NULL);
    if ((s = fl_backend_init_by_name(ref_name, &ref, threads)) != FL_OK) {
        fl_backend_free(&dev);
        return fl_cli_fail(cmd, s, NULL);
    }
    if (facts.describe) {
        char desc[512];
        facts.describe(desc, sizeof desc);
        printf("%s: %s\n", name, desc);
    }
    fl_selftest_result res;
    s = fl_backend_selftest(&dev, &ref, only, small, stdout, &res);
    const int bf16_attn = (dev.caps & FL_CAP_COMPUTE_BF16) != 0;
    fl_backend_free(&dev);
    fl_backend_free(&ref);
    if (s != FL_OK) return fl_cli_fail(cmd, s, NULL);
    /* the attention kernels a bf16 run may get (cuDNN, own, legacy) side by side against float64 */
    if (s == FL_OK && bf16_attn && (!only || strstr("attention_choices", only))) {
        fl_selftest_result ra;
        if (fl_selftest_attention_choices(name, small, stdout, &ra) == FL_OK) {
            res.n_cases += ra.n_cases;
            res.n_fail += ra.n_fail;
        }
    }
    /* the ops together: training runs on both backends */
    int n_train = 0, train_bad = st_train_cases(name, ref_name, only, threads, stdout, &n_train);
    if (n_train) printf("selftest: training runs %s\n", train_bad ? "FAILED" : "ok");
    res.n_fail += train_bad;
    res.n_cases += n_train;
    if (res.n_cases == 0) {
        fprintf(stderr, "fitllm %s: error: no case matches --only '%s'\n", cmd, only ? only : "");
        return FL_EXIT_USAGE;
    }
    return res.n_fail ? FL_EXIT_RUNTIME : 0;
}

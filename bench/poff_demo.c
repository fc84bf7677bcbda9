/* The parameter-offload demonstration (issue 34: ZeRO-Infinity on a CPU): pretrain a model whose parameters and
 * AdamW state together exceed this machine's RAM, with the parameters, gradients and optimizer state in files
 * (--strategy deepspeed_stage_3_offload_nvme), for a few steps; per step the wall time and the disk traffic the
 * process caused (/proc/self/io read_bytes / write_bytes), then the peak RSS (getrusage) and the tiers' bytes.
 * The step hook stops the run after the last step, so no checkpoint is written (as the lab does).
 * Usage: poff_demo CONFIG_JSON NVME_DIR [STEPS=2] [T=16] [OUT_DIR=/tmp/poff-demo-out] [OVERLAP=true]
 *                  [UPDATE_OVERLAP=true] [MAX_NORM=1.0] [TIER=nvme]
 * (OVERLAP: --offload_overlap, the fetch worker thread; false: the copies on the model's thread. UPDATE_OVERLAP:
 * --offload_update_overlap, each unit's update on that worker beside the backward, which needs MAX_NORM 0 (no
 * clipping; pretrain's default clips at 1.0). TIER nvme: everything in files under NVME_DIR
 * (deepspeed_stage_3_offload_nvme); cpu: the parameters and the state in host memory (fsdp_cpu_offload).) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "fitllm/config.h"
#include "fitllm/trainer.h"

typedef struct {
    long steps;
    double t0, last;
    unsigned long long r0, w0;
} demo;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void io_bytes(unsigned long long *r, unsigned long long *w) {
    FILE *f = fopen("/proc/self/io", "r");
    char key[64];
    unsigned long long v;
    *r = *w = 0;
    while (f && fscanf(f, "%63s %llu", key, &v) == 2) {
        if (!strcmp(key, "read_bytes:")) *r = v;
        if (!strcmp(key, "write_bytes:")) *w = v;
    }
    if (f) fclose(f);
}

static long peak_rss_mb(void) {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return u.ru_maxrss / 1024;
}

static int hook(void *ud, long step, double loss, const void *params, size_t bytes) {
    (void)params, (void)bytes;
    demo *d = ud;
    unsigned long long r, w;
    io_bytes(&r, &w);
    double t = now();
    printf("step %ld: loss %.4f, %.1f s, disk read %.2f GB, written %.2f GB (%.2f GB/s), peak RSS so far %ld MB\n", step,
           loss, t - d->last, (r - d->r0) / 1e9, (w - d->w0) / 1e9, ((r - d->r0) + (w - d->w0)) / 1e9 / (t - d->last),
           peak_rss_mb());
    fflush(stdout);
    d->last = t;
    d->r0 = r, d->w0 = w;
    return step >= d->steps;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s CONFIG_JSON NVME_DIR [STEPS] [T] [OUT_DIR] [OVERLAP true|false] [UPDATE_OVERLAP "
                "true|false] [MAX_NORM] [TIER nvme|cpu]\n", argv[0]);
        return 2;
    }
    demo d = {.steps = argc > 3 ? atol(argv[3]) : 2};
    const char *T = argc > 4 ? argv[4] : "16";
    char out[4200], seq[32];
    snprintf(out, sizeof out, "%s", argc > 5 ? argv[5] : "/tmp/poff-demo-out");
    snprintf(seq, sizeof seq, "%d", atoi(T) + 1);
    fl_run_config c;
    fl_cfg_defaults(&c, FL_CMD_PRETRAIN);
    const char *kv[][2] = {{"model_config", argv[1]}, {"data", "Synthetic"}, {"train.micro_batch_size", "1"},
                           {"train.global_batch_size", "1"}, {"train.max_seq_length", seq}, {"train.max_steps", "1000"},
                           {"eval.interval", "100000"}, {"eval.initial_validation", "false"},
                           {"eval.final_validation", "false"}, {"eval.max_new_tokens", "0"},
                           {"out_dir", out}, {"overwrite", "true"}, {"offload_overlap", argc > 6 ? argv[6] : "true"},
                           {"offload_update_overlap", argc > 7 ? argv[7] : "true"},
                           {"train.max_norm", argc > 8 ? argv[8] : "1.0"}};
    const int nvme = argc <= 9 || strcmp(argv[9], "cpu") != 0;
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        if (fl_cfg_set(&c, kv[i][0], kv[i][1]) != FL_OK) {
            fprintf(stderr, "%s: %s\n", kv[i][0], fl_error_message());
            return 2;
        }
    if (fl_cfg_set(&c, "strategy", nvme ? "deepspeed_stage_3_offload_nvme" : "fsdp_cpu_offload") != FL_OK ||
        (nvme && fl_cfg_set(&c, "nvme_path", argv[2]) != FL_OK)) {
        fprintf(stderr, "strategy: %s\n", fl_error_message());
        return 2;
    }
    d.t0 = d.last = now();
    io_bytes(&d.r0, &d.w0);
    fl_trainer_result res;
    memset(&res, 0, sizeof res);
    fl_status s = fl_trainer_run(&c, stdout, 0, hook, &d, &res);
    printf("status %s%s%s\n", fl_status_name(s), s ? ": " : "", s ? fl_error_message() : "");
    printf("peak RSS %ld MB; device pool peak %.2f GiB; host tier %.2f GiB; nvme tier %.2f GiB (PARAMS %.2f, GRADS %.2f, "
           "OPTIM %.2f); wall %.1f s\n", peak_rss_mb(), res.peak_total / 1073741824.0, res.host_peak_total / 1073741824.0,
           res.nvme_peak_total / 1073741824.0, res.nvme_peak[FL_TAG_PARAMS] / 1073741824.0,
           res.nvme_peak[FL_TAG_GRADS] / 1073741824.0, res.nvme_peak[FL_TAG_OPTIM] / 1073741824.0, now() - d.t0);
    return s == FL_OK ? 0 : 1;
}

/* CPU offload (ZeRO-Offload: --strategy deepspeed_stage_1_offload / deepspeed_stage_2_offload): the
 * optimizer state in the backend's host tier and the update on the host's kernels.
 *
 * Anchor: the same run with the optimizer on the device. The update is elementwise and the host
 * kernels are the device's own on cpu and opaque, so offload must give the SAME BITS (parameters and
 * every step loss), one process and ZeRO-1/2 at 2 and 3 thread ranks, and on the opaque backend (whose
 * memory the host cannot read: the gradients and parameters really travel to the host tier and back,
 * here in pieces of 9973 elements so every update spans many pieces, the last one short). Memory: the
 * device pool's OPTIM is 0 and its peak drops by exactly the state's bytes; the host tier holds the
 * state (and, staged, one piece of parameters and gradients); the plan predicts both pools to the byte.
 * Checkpoints: the offloaded state is saved and resumed through the host backend (opaque: stop after
 * step 2, resume, end on the uninterrupted run's bits). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train/dp.h"
#include "test.h"
#include "zero_ref.h"

#define OT_MAX_RANKS 3

typedef struct {
    fl_run_config cfg;
    zr_rec rec[OT_MAX_RANKS];
    fl_trainer_result res[OT_MAX_RANKS];
    fl_status st[OT_MAX_RANKS];
} ojob;

static fl_status orank(fl_comm *c, int rank, void *ud) {
    ojob *j = ud;
    j->st[rank] = fl_trainer_run_comm(&j->cfg, c, NULL, 0, zr_record, &j->rec[rank], &j->res[rank]);
    return j->st[rank];
}

/* Scenario sc on `world` ranks (1: one process, no communicator) with the strategy, on `backend`. */
static ojob *run(int sc, int world, const char *strategy, const char *backend, const char *tag) {
    ojob *j = calloc(1, sizeof *j);
    if (!j) abort();
    char out[700];
    snprintf(out, sizeof out, "%s/offload-%s-%s-%s-%d", fl_test_tmpdir(), zr_names[sc], tag, backend, world);
    zr_config(&j->cfg, sc, world, world, 1, strategy, NULL, out);
    setenv("FITLLM_BACKEND", backend, 1);
    fl_status s = world > 1 ? fl_comm_threads_run(world, orank, j) : orank(NULL, 0, j);
    unsetenv("FITLLM_BACKEND");
    FL_CHECKF(s == FL_OK, "%s %s at %d ranks on %s: %s", zr_names[sc], strategy, world, backend, fl_error_message());
    return j;
}

static void free_job(ojob *j) {
    for (int r = 0; j && r < OT_MAX_RANKS; r++) zr_free(&j->rec[r]);
    free(j);
}

/* off against base (the same run, optimizer on the device), rank by rank: the bits; the device's OPTIM
 * 0 and its peak exactly base's minus the state; the host tier's OPTIM base's, its WORKSPACE `staging`
 * bytes (one piece of parameters and gradients, or none) */
static void compare(const ojob *off, const ojob *base, int world, size_t staging, const char *what) {
    for (int r = 0; r < world; r++) {
        const fl_trainer_result *a = &off->res[r], *b = &base->res[r];
        if (off->st[r] != FL_OK || base->st[r] != FL_OK) return;
        FL_CHECKF(zr_same(&off->rec[r], &base->rec[r]), "%s rank %d: offloaded parameters or losses differ from the "
                  "device optimizer's bits", what, r);
        FL_CHECKF(b->peak[FL_TAG_OPTIM] > 0 && a->peak[FL_TAG_OPTIM] == 0 && b->offload == 0 && a->offload == 1,
                  "%s rank %d: device OPTIM %zu with offload, %zu without", what, r, a->peak[FL_TAG_OPTIM],
                  b->peak[FL_TAG_OPTIM]);
        FL_CHECKF(a->peak_total == b->peak_total - b->peak[FL_TAG_OPTIM], "%s rank %d: device peak %zu, expected %zu "
                  "- %zu", what, r, a->peak_total, b->peak_total, b->peak[FL_TAG_OPTIM]);
        FL_CHECKF(a->host_peak[FL_TAG_OPTIM] == b->peak[FL_TAG_OPTIM] && a->host_peak[FL_TAG_WORKSPACE] == staging &&
                  a->host_peak_total == b->peak[FL_TAG_OPTIM] + staging,
                  "%s rank %d: host tier OPTIM %zu (device run's %zu), WORKSPACE %zu (expected %zu), total %zu", what,
                  r, a->host_peak[FL_TAG_OPTIM], b->peak[FL_TAG_OPTIM], a->host_peak[FL_TAG_WORKSPACE], staging,
                  a->host_peak_total);
    }
}

/* one piece of parameters and gradients of the storage dtype: what a staged update holds */
static size_t staging_bytes(const fl_run_config *c, size_t piece) { return 2 * piece * fl_dtype_size(zr_store_dtype(c)); }

FL_TEST(offload_one_process_equals_the_device_optimizer) {
    const int scs[3] = {ZR_ADAMW, ZR_SGDM, ZR_BF16};
    for (int i = 0; i < 3; i++) {
        ojob *base = run(scs[i], 1, "deepspeed_stage_2", "cpu", "dev");
        ojob *off = run(scs[i], 1, "deepspeed_stage_2_offload", "cpu", "off");
        compare(off, base, 1, 0, zr_names[scs[i]]); /* host memory: updated in place, nothing staged */
        char why[2048] = "";
        int bad = zr_check_plan(&off->cfg, 0, &off->res[0], 1, why, sizeof why, 0);
        FL_CHECKF(bad == 0, "%s offload: %s", zr_names[scs[i]], why);
        free_job(base);
        free_job(off);
    }
}

/* LoRA with dropout: the trainable parameters are the adapters (fp32 under every policy), staged on opaque */
FL_TEST(offload_lora_adapters_equal_the_device_optimizer) {
    fl_optim_set_offload_piece(997); /* micro's q,v adapters: a few thousand elements, several pieces */
    ojob *j[2] = {calloc(1, sizeof(ojob)), calloc(1, sizeof(ojob))};
    FL_REQUIRE(j[0] && j[1]);
    for (int k = 0; k < 2; k++) {
        char out[700];
        snprintf(out, sizeof out, "%s/offload-lora-%d", fl_test_tmpdir(), k);
        dr_config(&j[k]->cfg, DR_LORA, 1, 1, 1, 1, out);
        snprintf(j[k]->cfg.strategy, sizeof j[k]->cfg.strategy, "%s", k ? "deepspeed_stage_2_offload" : "deepspeed_stage_2");
        setenv("FITLLM_BACKEND", "opaque", 1);
        j[k]->st[0] = fl_trainer_run(&j[k]->cfg, NULL, 0, zr_record, &j[k]->rec[0], &j[k]->res[0]);
        unsetenv("FITLLM_BACKEND");
        FL_CHECKF(j[k]->st[0] == FL_OK, "LoRA %s: %s", j[k]->cfg.strategy, fl_error_message());
    }
    size_t n = j[0]->rec[0].nbytes / sizeof(float), piece = n < 997 ? n : 997;
    compare(j[1], j[0], 1, 2 * piece * sizeof(float), "LoRA (dropout)");
    free_job(j[0]);
    free_job(j[1]);
    fl_optim_set_offload_piece(0);
}

FL_TEST(offload_zero_threads_equal_zero_bits) {
    /* ASan, quick tier: both stages at 3 ranks (an uneven split), the release pass at 2 as well */
    for (int world = fl_test_asan_light() ? 3 : 2; world <= 3; world++)
        for (int stage = 1; stage <= 2; stage++) {
            char dev[32], off[48], what[64];
            snprintf(dev, sizeof dev, "deepspeed_stage_%d", stage);
            snprintf(off, sizeof off, "deepspeed_stage_%d_offload", stage);
            snprintf(what, sizeof what, "ZeRO-%d at %d ranks", stage, world);
            ojob *b = run(ZR_ADAMW, world, dev, "cpu", "dev");
            ojob *o = run(ZR_ADAMW, world, off, "cpu", "off");
            compare(o, b, world, 0, what);
            for (int r = 0; r < world; r++) { /* each rank's device and host tier as planned for it */
                char why[2048] = "";
                int bad = zr_check_plan(&o->cfg, r, &o->res[r], 0, why, sizeof why, 0);
                FL_CHECKF(bad == 0, "%s offload: %s", what, why);
            }
            free_job(b);
            free_job(o);
        }
}

static long g_stop_at;
static int stop_hook(void *ud, long step, double loss, const void *params, size_t bytes) {
    zr_record(ud, step, loss, params, bytes);
    return g_stop_at && step >= g_stop_at;
}

FL_TEST(offload_opaque_stages_pieces_and_resumes_with_the_same_bits) {
    if (!fl_test_asan_budget()) return; /* make test time (quick tier); the staged update under ASan: offload_zero_threads_equal_zero_bits (cpu) */
    const size_t piece = 9973; /* an odd size: micro's 260032 elements span 27 pieces, the last short */
    fl_optim_set_offload_piece(piece);
    const int scs[2] = {ZR_ADAMW, ZR_BF16};
    for (int i = 0; i < 2; i++) {
        /* the device run on opaque too: its device pool differs from the cpu's by the host buffers (the cpu
         * run's bits are opaque's, tests/test_opaque.c) */
        ojob *base = run(scs[i], 1, "deepspeed_stage_2", "opaque", "dev");
        ojob *off = run(scs[i], 1, "deepspeed_stage_2_offload", "opaque", "off");
        compare(off, base, 1, staging_bytes(&off->cfg, piece), zr_names[scs[i]]);
        /* a checkpoint at step 2 (the offloaded state saved through the host backend), stopped there, then
         * resumed (the state read back into the host tier): the uninterrupted run's bits */
        fl_run_config c = off->cfg;
        snprintf(c.out_dir, sizeof c.out_dir, "%s/offload-resume-%s", fl_test_tmpdir(), zr_names[scs[i]]);
        c.train.save_interval = 2;
        zr_rec part = {0}, rest = {0};
        setenv("FITLLM_BACKEND", "opaque", 1);
        g_stop_at = 2;
        fl_status s = fl_trainer_run(&c, NULL, 0, stop_hook, &part, NULL);
        g_stop_at = 0;
        FL_CHECKF(s == FL_OK && part.steps == 2, "%s: the run stopped after step 2: %s", zr_names[scs[i]],
                  fl_error_message());
        snprintf(c.resume, sizeof c.resume, "auto");
        if (s == FL_OK) s = fl_trainer_run(&c, NULL, 0, zr_record, &rest, NULL);
        unsetenv("FITLLM_BACKEND");
        FL_CHECKF(s == FL_OK, "%s: resume: %s", zr_names[scs[i]], fl_error_message());
        if (s == FL_OK && off->st[0] == FL_OK)
            FL_CHECKF(rest.steps == off->rec[0].steps && rest.nbytes == off->rec[0].nbytes &&
                      !memcmp(rest.bytes, off->rec[0].bytes, rest.nbytes),
                      "%s: the resumed offloaded run ends on other parameters than the uninterrupted one",
                      zr_names[scs[i]]);
        zr_free(&part);
        zr_free(&rest);
        free_job(base);
        free_job(off);
    }
    fl_optim_set_offload_piece(0);
}

/* Several opaque ranks: the reduce-scatter and the all-gather on the device communicator (the NCCL
 * stand-in), the chunk's update staged on the host between them. */
FL_TEST(offload_opaque_zero2_two_ranks_same_bits) {
    const size_t piece = 9973;
    fl_optim_set_offload_piece(piece);
    ojob *base = run(ZR_ADAMW, 2, "deepspeed_stage_2", "opaque", "dev");
    ojob *off = run(ZR_ADAMW, 2, "deepspeed_stage_2_offload", "opaque", "off");
    compare(off, base, 2, staging_bytes(&off->cfg, piece), "opaque ZeRO-2 at 2 ranks");
    free_job(base);
    free_job(off);
    fl_optim_set_offload_piece(0);
}

/* NVMe offload (offload_optimizer_device nvme): the state in unlinked files under nvme_path, walked piece
 * by piece (9973 elements: 27 pieces, each prefetched, written back and dropped); the same bits, the state's
 * bytes in the nvme tier instead of the host's, as planned; no file left in the folder; a checkpoint at step 2
 * streamed from the files and resumed into them ends on the uninterrupted run's bits. On cpu (in place) and on
 * opaque (staged through the host tier, and the state on disk). */
static void nvme_cfg(fl_run_config *c, const char *dir) {
    snprintf(c->offload_device, sizeof c->offload_device, "nvme");
    snprintf(c->nvme_path, sizeof c->nvme_path, "%s", dir);
}

static int dir_is_empty(const char *dir) {
    char cmd[800];
    snprintf(cmd, sizeof cmd, "test -z \"$(ls -A '%s' 2>/dev/null)\"", dir);
    return system(cmd) == 0;
}

FL_TEST(offload_nvme_pages_the_state_through_files_with_the_same_bits) {
    const size_t piece = 9973;
    fl_optim_set_offload_piece(piece);
    char dir[700];
    snprintf(dir, sizeof dir, "%s/nvme", fl_test_tmpdir());
    char mk[760];
    snprintf(mk, sizeof mk, "mkdir -p '%s'", dir);
    FL_REQUIRE(system(mk) == 0);
    const char *bes[2] = {"cpu", "opaque"};
    const int scs[2] = {ZR_ADAMW, ZR_SGDM};
    for (int b = 0; b < 2; b++)
        for (int i = 0; i < 2; i++) {
            ojob *base = run(scs[i], 1, "deepspeed_stage_2", bes[b], "dev");
            ojob *off = calloc(1, sizeof *off);
            FL_REQUIRE(off != NULL);
            char out[700];
            snprintf(out, sizeof out, "%s/offload-nvme-%s-%s", fl_test_tmpdir(), zr_names[scs[i]], bes[b]);
            zr_config(&off->cfg, scs[i], 1, 1, 1, "deepspeed_stage_2_offload", NULL, out);
            nvme_cfg(&off->cfg, dir);
            setenv("FITLLM_BACKEND", bes[b], 1);
            off->st[0] = fl_trainer_run(&off->cfg, NULL, 0, zr_record, &off->rec[0], &off->res[0]);
            unsetenv("FITLLM_BACKEND");
            FL_CHECKF(off->st[0] == FL_OK, "nvme %s on %s: %s", zr_names[scs[i]], bes[b], fl_error_message());
            const fl_trainer_result *a = &off->res[0], *d = &base->res[0];
            if (off->st[0] == FL_OK && base->st[0] == FL_OK) {
                FL_CHECKF(zr_same(&off->rec[0], &base->rec[0]), "nvme %s on %s: parameters or losses differ from the "
                          "device optimizer's bits", zr_names[scs[i]], bes[b]);
                size_t staging = b ? staging_bytes(&off->cfg, piece) : 0;
                FL_CHECKF(a->nvme && a->nvme_peak[FL_TAG_OPTIM] == d->peak[FL_TAG_OPTIM] &&
                          a->nvme_peak_total == d->peak[FL_TAG_OPTIM] && a->peak[FL_TAG_OPTIM] == 0 &&
                          a->peak_total == d->peak_total - d->peak[FL_TAG_OPTIM] && a->host_peak[FL_TAG_OPTIM] == 0 &&
                          a->host_peak_total == staging,
                          "nvme %s on %s: nvme OPTIM %zu (device run's %zu), host tier %zu (staging %zu), device %zu",
                          zr_names[scs[i]], bes[b], a->nvme_peak[FL_TAG_OPTIM], d->peak[FL_TAG_OPTIM],
                          a->host_peak_total, staging, a->peak_total);
                if (!b) { /* the plan (host memory: one device pool as planned) of every tier */
                    char why[2048] = "";
                    int bad = zr_check_plan(&off->cfg, 0, a, 1, why, sizeof why, 0);
                    FL_CHECKF(bad == 0, "nvme %s: %s", zr_names[scs[i]], why);
                }
            }
            FL_CHECKF(dir_is_empty(dir), "nvme %s on %s: files left in %s", zr_names[scs[i]], bes[b], dir);
            if (b == 1 && i == 0 && off->st[0] == FL_OK) { /* checkpoint at step 2 from the files, resumed into them */
                fl_run_config c = off->cfg;
                snprintf(c.out_dir, sizeof c.out_dir, "%s/offload-nvme-resume", fl_test_tmpdir());
                c.train.save_interval = 2;
                zr_rec part = {0}, rest = {0};
                setenv("FITLLM_BACKEND", bes[b], 1);
                g_stop_at = 2;
                fl_status s = fl_trainer_run(&c, NULL, 0, stop_hook, &part, NULL);
                g_stop_at = 0;
                snprintf(c.resume, sizeof c.resume, "auto");
                if (s == FL_OK) s = fl_trainer_run(&c, NULL, 0, zr_record, &rest, NULL);
                unsetenv("FITLLM_BACKEND");
                FL_CHECKF(s == FL_OK && rest.steps == off->rec[0].steps && rest.nbytes == off->rec[0].nbytes &&
                          !memcmp(rest.bytes, off->rec[0].bytes, rest.nbytes),
                          "nvme: the resumed run ends on other parameters than the uninterrupted one (%s)",
                          s == FL_OK ? "" : fl_error_message());
                zr_free(&part);
                zr_free(&rest);
            }
            free_job(base);
            free_job(off);
        }
    /* a folder that cannot take the files: refused at set-up, naming it */
    ojob *bad = calloc(1, sizeof *bad);
    FL_REQUIRE(bad != NULL);
    char out[700];
    snprintf(out, sizeof out, "%s/offload-nvme-bad", fl_test_tmpdir());
    zr_config(&bad->cfg, ZR_ADAMW, 1, 1, 1, "deepspeed_stage_2_offload", NULL, out);
    nvme_cfg(&bad->cfg, "/nonexistent-fitllm-nvme");
    fl_status s = fl_trainer_run(&bad->cfg, NULL, 0, NULL, NULL, NULL);
    FL_CHECKF(s != FL_OK && strstr(fl_error_message(), "/nonexistent-fitllm-nvme") &&
              strstr(fl_error_message(), "nvme_path"), "bad nvme_path: %s (%s)", fl_status_name(s), fl_error_message());
    free(bad);
    fl_optim_set_offload_piece(0);
}

FL_TEST(offload_refuses_what_it_does_not_offload) {
    fl_run_config c;
    char out[700];
    snprintf(out, sizeof out, "%s/offload-8bit", fl_test_tmpdir());
    zr_config(&c, ZR_ADAMW8, 1, 1, 1, "deepspeed_stage_2_offload", NULL, out);
    fl_status s = fl_trainer_run(&c, NULL, 0, NULL, NULL, NULL);
    FL_CHECKF(s == FL_ERR_UNSUPPORTED && strstr(fl_error_message(), "CPU offload of AdamW8bit"), "8-bit AdamW with "
              "offload: %s (%s)", fl_status_name(s), fl_error_message());
    /* parameter offload (stage 3, issue 34) is accepted by Lightning's names (tests/test_poff.c trains it) */
    FL_CHECK(fl_cfg_set(&c, "strategy", "deepspeed_stage_3_offload_nvme") == FL_OK && fl_cfg_validate(&c) == FL_OK &&
             fl_cfg_param_offload(&c) == 2);
    FL_CHECK(fl_cfg_set(&c, "strategy", "fsdp_cpu_offload") == FL_OK && fl_cfg_validate(&c) == FL_OK &&
             fl_cfg_param_offload(&c) == 1);
    /* an offload option the strategy would not use is refused, never ignored (deepspeed_stage_3 with
     * offload_optimizer_device cpu ran plain ZeRO-3 before) */
    FL_CHECK(fl_cfg_set(&c, "strategy", "deepspeed_stage_3") == FL_OK &&
             fl_cfg_set(&c, "offload_optimizer_device", "cpu") == FL_OK && fl_cfg_validate(&c) == FL_ERR_INVALID);
    FL_CHECKF(strstr(fl_error_message(), "'deepspeed_stage_3'") && strstr(fl_error_message(), "add _offload"), "%s",
              fl_error_message());
    FL_CHECK(fl_cfg_set(&c, "strategy", "deepspeed_stage_3_offload") == FL_OK && fl_cfg_validate(&c) == FL_OK);
    FL_CHECK(fl_cfg_set(&c, "strategy", "fsdp") == FL_OK && fl_cfg_validate(&c) == FL_ERR_INVALID);
    FL_CHECK(fl_cfg_set(&c, "offload_optimizer_device", "") == FL_OK && fl_cfg_validate(&c) == FL_OK);
    FL_CHECK(fl_cfg_set(&c, "nvme_path", "/tmp") == FL_OK && fl_cfg_validate(&c) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "nvme_path '/tmp'"));
    FL_CHECK(fl_cfg_set(&c, "strategy", "deepspeed_stage_3_offload") == FL_OK &&
             fl_cfg_set(&c, "offload_optimizer_device", "nvme") == FL_OK && fl_cfg_validate(&c) == FL_OK);
    FL_CHECK(fl_cfg_set(&c, "nvme_path", "") == FL_OK && fl_cfg_set(&c, "offload_optimizer_device", "") == FL_OK);
    /* fsdp.sharding_strategy with a strategy that is not fsdp: refused */
    FL_CHECK(fl_cfg_set(&c, "strategy", "deepspeed_stage_2") == FL_OK &&
             fl_cfg_set(&c, "fsdp.sharding_strategy", "FULL_SHARD") == FL_OK && fl_cfg_validate(&c) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "applies to --strategy fsdp"));
    FL_CHECK(fl_cfg_set(&c, "fsdp.sharding_strategy", "") == FL_OK && fl_cfg_validate(&c) == FL_OK);
    /* nvme needs an offload strategy; an unknown device is named */
    zr_config(&c, ZR_ADAMW, 1, 1, 1, "deepspeed_stage_2", NULL, out);
    FL_CHECK(fl_cfg_set(&c, "offload_optimizer_device", "nvme") == FL_OK && fl_cfg_validate(&c) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "deepspeed_stage_2_offload"));
    FL_CHECK(fl_cfg_set(&c, "offload_optimizer_device", "tape") == FL_OK && fl_cfg_validate(&c) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "'tape'"));
}

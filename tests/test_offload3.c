/* ZeRO-3 / FULL_SHARD with the optimizer offloaded (--strategy deepspeed_stage_3_offload,
 * --offload_optimizer_device cpu | nvme): each rank's shard of the optimizer state in the host tier (or
 * in NVMe files) and its update on the host's kernels; the parameters' and gradients' shards stay on the
 * device.
 *
 * Anchor: the same run with the optimizer on the device (deepspeed_stage_3). The update is elementwise
 * over the shard and the host kernels are the device's own on cpu, opaque and cuda-emu, so the offloaded
 * run must give the SAME BITS (every step's loss and the whole parameters gathered after each step) at
 * 1, 2 and 3 thread ranks, on the opaque backend (its memory is not the host's: each piece of the shard
 * really travels to the host tier and back, here in pieces of 9973 elements) and on the CUDA emulator.
 * Memory per rank: the device's OPTIM 0 and its peak the device run's minus the state; the host (or
 * nvme) tier the device run's OPTIM; the plan of every tier equal to the measured. Checkpoints: saved
 * with offload and resumed with or without it, and the reverse, consolidated and sharded, at the same
 * and another world size: the bits of the same checkpoint resumed by the device-resident run (and, at
 * the same size, of the uninterrupted run). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "train/dp.h"
#include "test.h"
#include "zero_ref.h"

#define O3_MAX_RANKS 3

typedef struct {
    fl_run_config cfg;
    zr_rec rec[O3_MAX_RANKS];
    fl_trainer_result res[O3_MAX_RANKS];
    fl_status st[O3_MAX_RANKS];
    long stop_at; /* > 0: the hook stops the run after this step */
} o3job;

static int o3_hook(void *ud, long step, double loss, const void *params, size_t bytes) {
    zr_rec *r = ud;
    zr_record(r, step, loss, params, bytes);
    return 0;
}

typedef struct {
    o3job *j;
    int rank;
} o3arg;

static int o3_stop_hook(void *ud, long step, double loss, const void *params, size_t bytes) {
    o3arg *a = ud;
    zr_record(&a->j->rec[a->rank], step, loss, params, bytes);
    return a->j->stop_at && step >= a->j->stop_at;
}

static fl_status o3rank(fl_comm *c, int rank, void *ud) {
    o3job *j = ud;
    o3arg a = {j, rank};
    j->st[rank] = j->stop_at ? fl_trainer_run_comm(&j->cfg, c, NULL, 0, o3_stop_hook, &a, &j->res[rank])
                             : fl_trainer_run_comm(&j->cfg, c, NULL, 0, o3_hook, &j->rec[rank], &j->res[rank]);
    return j->st[rank];
}

static o3job *o3_new(int sc, int world, const char *strategy, const char *tag) {
    o3job *j = calloc(1, sizeof *j);
    if (!j) abort();
    char out[700];
    snprintf(out, sizeof out, "%s/offload3-%s-%s-%d", fl_test_tmpdir(), zr_names[sc], tag, world);
    zr_config(&j->cfg, sc, world, world, 1, strategy, NULL, out);
    return j;
}

static fl_status o3_run(o3job *j, int world, const char *backend) {
    setenv("FITLLM_BACKEND", backend, 1);
    fl_status s = world > 1 ? fl_comm_threads_run(world, o3rank, j) : o3rank(NULL, 0, j);
    unsetenv("FITLLM_BACKEND");
    FL_CHECKF(s == FL_OK, "%s at %d ranks on %s: %s", j->cfg.strategy, world, backend, fl_error_message());
    return s;
}

static void o3_free(o3job *j) {
    for (int r = 0; j && r < O3_MAX_RANKS; r++) zr_free(&j->rec[r]);
    free(j);
}

/* off against base rank by rank: the bits; the device's OPTIM 0 and its peak exactly base's minus the
 * state; the host tier's OPTIM base's (nvme: the nvme tier's) and WORKSPACE `staging` bytes */
static void o3_compare(const o3job *off, const o3job *base, int world, size_t staging, int nvme, const char *what) {
    for (int r = 0; r < world; r++) {
        const fl_trainer_result *a = &off->res[r], *b = &base->res[r];
        if (off->st[r] != FL_OK || base->st[r] != FL_OK) return;
        FL_CHECKF(zr_same(&off->rec[r], &base->rec[r]), "%s rank %d: offloaded parameters or losses differ from the "
                  "device optimizer's bits", what, r);
        FL_CHECKF(b->peak[FL_TAG_OPTIM] > 0 && a->peak[FL_TAG_OPTIM] == 0 && a->offload == 1,
                  "%s rank %d: device OPTIM %zu with offload, %zu without", what, r, a->peak[FL_TAG_OPTIM],
                  b->peak[FL_TAG_OPTIM]);
        FL_CHECKF(a->peak_total == b->peak_total - b->peak[FL_TAG_OPTIM], "%s rank %d: device peak %zu, expected %zu "
                  "- %zu", what, r, a->peak_total, b->peak_total, b->peak[FL_TAG_OPTIM]);
        size_t host_optim = nvme ? 0 : b->peak[FL_TAG_OPTIM];
        FL_CHECKF(a->host_peak[FL_TAG_OPTIM] == host_optim && a->host_peak[FL_TAG_WORKSPACE] == staging &&
                  a->host_peak_total == host_optim + staging,
                  "%s rank %d: host tier OPTIM %zu (expected %zu), WORKSPACE %zu (expected %zu), total %zu", what, r,
                  a->host_peak[FL_TAG_OPTIM], host_optim, a->host_peak[FL_TAG_WORKSPACE], staging, a->host_peak_total);
        if (nvme)
            FL_CHECKF(a->nvme && a->nvme_peak[FL_TAG_OPTIM] == b->peak[FL_TAG_OPTIM] &&
                      a->nvme_peak_total == b->peak[FL_TAG_OPTIM],
                      "%s rank %d: nvme tier OPTIM %zu, the device run's %zu", what, r, a->nvme_peak[FL_TAG_OPTIM],
                      b->peak[FL_TAG_OPTIM]);
    }
}

static void o3_check_plan(const o3job *j, int world, const char *what) {
    for (int r = 0; r < world; r++) { /* each rank's device, host and nvme tiers as planned for it */
        char why[2048] = "";
        int bad = zr_check_plan(&j->cfg, r, &j->res[r], 0, why, sizeof why, 0);
        FL_CHECKF(bad == 0, "%s: %s", what, why);
    }
}

static size_t o3_staging(const fl_run_config *c, size_t piece) { return 2 * piece * fl_dtype_size(zr_store_dtype(c)); }

FL_TEST(offload3_threads_equal_zero3_bits_at_1_2_3_ranks) {
    const int scs[2] = {ZR_ADAMW, ZR_SGDM};
    for (int world = 1; world <= 3; world++)
        for (int i = 0; i < 2; i++) {
            if (i == 1 && world != 2) continue; /* SGD with momentum at 2 ranks */
            if (i == 0 && world == 2 && fl_test_asan_light()) continue; /* ASan, quick tier: AdamW at 1 and 3 ranks */
            char what[96];
            snprintf(what, sizeof what, "ZeRO-3 offload %s at %d ranks", zr_names[scs[i]], world);
            o3job *b = o3_new(scs[i], world, "deepspeed_stage_3", "dev");
            o3job *o = o3_new(scs[i], world, "deepspeed_stage_3_offload", "off");
            if (o3_run(b, world, "cpu") == FL_OK && o3_run(o, world, "cpu") == FL_OK) {
                o3_compare(o, b, world, 0, 0, what); /* host memory: in place, nothing staged */
                o3_check_plan(o, world, what);
            }
            o3_free(b);
            o3_free(o);
        }
}

static int dir_empty(const char *dir) {
    char cmd[800];
    snprintf(cmd, sizeof cmd, "test -z \"$(ls -A '%s' 2>/dev/null)\"", dir);
    return system(cmd) == 0;
}

/* NVMe: each rank's state shard in unlinked files, walked piece by piece */
FL_TEST(offload3_nvme_two_ranks_equal_zero3_bits) {
    const size_t piece = 9973;
    fl_optim_set_offload_piece(piece);
    char dir[700], mk[760];
    snprintf(dir, sizeof dir, "%s/nvme3", fl_test_tmpdir());
    snprintf(mk, sizeof mk, "mkdir -p '%s'", dir);
    FL_REQUIRE(system(mk) == 0);
    o3job *b = o3_new(ZR_ADAMW, 2, "deepspeed_stage_3", "dev");
    o3job *o = o3_new(ZR_ADAMW, 2, "deepspeed_stage_3_offload", "nvme");
    snprintf(o->cfg.offload_device, sizeof o->cfg.offload_device, "nvme");
    snprintf(o->cfg.nvme_path, sizeof o->cfg.nvme_path, "%s", dir);
    if (o3_run(b, 2, "cpu") == FL_OK && o3_run(o, 2, "cpu") == FL_OK) {
        o3_compare(o, b, 2, 0, 1, "ZeRO-3 nvme offload at 2 ranks");
        o3_check_plan(o, 2, "ZeRO-3 nvme offload at 2 ranks");
    }
    FL_CHECKF(dir_empty(dir), "ZeRO-3 nvme offload: files left in %s", dir);
    o3_free(b);
    o3_free(o);
    fl_optim_set_offload_piece(0);
}

/* opaque (and the CUDA emulator): the shard's gradients and parameters go to the host tier and back
 * piece by piece; the gathers and reduce-scatters through the device communicator (the NCCL stand-in) */
static void o3_device(const char *backend, int staged, int sc, int world, long steps) {
    const size_t piece = 9973;
    fl_optim_set_offload_piece(piece);
    char what[96];
    snprintf(what, sizeof what, "%s ZeRO-3 offload %s at %d ranks", backend, zr_names[sc], world);
    o3job *b = o3_new(sc, world, "deepspeed_stage_3", backend);
    o3job *o = o3_new(sc, world, "deepspeed_stage_3_offload", backend);
    if (steps) b->cfg.train.max_steps = o->cfg.train.max_steps = steps;
    if (o3_run(b, world, backend) == FL_OK && o3_run(o, world, backend) == FL_OK) {
        /* every rank's shard spans several pieces: one piece of parameters and gradients staged (opaque; the
         * emulator's memory is the host's: updated in place) */
        o3_compare(o, b, world, staged ? o3_staging(&o->cfg, piece) : 0, 0, what);
    }
    o3_free(b);
    o3_free(o);
    fl_optim_set_offload_piece(0);
}

FL_TEST(offload3_opaque_stages_the_shard_with_the_same_bits) {
    if (!fl_test_asan_budget()) return; /* make test time (quick tier); under ASan: offload3_threads_equal_zero3_bits_at_1_2_3_ranks (cpu) */
    o3_device("opaque", 1, ZR_ADAMW, 2, 4);
    o3_device("opaque", 1, ZR_BF16, 3, 4);
}

FL_TEST(offload3_cuda_emu_two_ranks_same_bits) {
    if (fl_test_asan_budget()) o3_device("cuda-emu", 0, ZR_ADAMW, 2, 2);
}

/* A checkpoint at step 2 of a run with global batch 12 (micro 2): saved by `save` (strategy, ranks,
 * state_dict_type), then resumed by each of `resume` at its ranks; every resumed run must end on the
 * bits of the same checkpoint resumed by the first of them (the anchor), and, resumed at the saving
 * world size, on the uninterrupted run's bits. */
typedef struct {
    const char *strategy;
    int world;
} o3side;

static void o3_resume_case(int sc, o3side save, const char *sdt, const o3side *resume, int n_resume, const char *backend) {
    const size_t piece = 9973;
    fl_optim_set_offload_piece(piece);
    char what[160];
    snprintf(what, sizeof what, "%s %s saved by %s at %d (%s)", backend, zr_names[sc], save.strategy, save.world, sdt);
    o3job *full = o3_new(sc, save.world, save.strategy, "ck-full");
    full->cfg.train.global_batch_size = 12;
    full->cfg.train.max_steps = 4;
    o3job *part = calloc(1, sizeof *part);
    FL_REQUIRE(part != NULL);
    part->cfg = full->cfg;
    snprintf(part->cfg.out_dir, sizeof part->cfg.out_dir, "%s/offload3-ck-%s-%s-%d-%s-%s", fl_test_tmpdir(),
             zr_names[sc], save.strategy, save.world, sdt, backend);
    snprintf(part->cfg.state_dict_type, sizeof part->cfg.state_dict_type, "%s", sdt);
    part->cfg.train.save_interval = 2;
    part->stop_at = 2;
    if (o3_run(full, save.world, backend) != FL_OK || o3_run(part, save.world, backend) != FL_OK) goto out;
    FL_CHECKF(part->rec[0].steps == 2, "%s: stopped at step %ld", what, part->rec[0].steps);
    zr_rec anchor = {0};
    for (int k = 0; k < n_resume; k++) {
        o3job *r = o3_new(sc, resume[k].world, resume[k].strategy, "ck-resumed");
        r->cfg.train.global_batch_size = 12;
        r->cfg.train.max_steps = 4;
        snprintf(r->cfg.resume, sizeof r->cfg.resume, "%.4000s/step-000002", part->cfg.out_dir);
        snprintf(r->cfg.out_dir, sizeof r->cfg.out_dir, "%s/offload3-ck-resumed-%d", fl_test_tmpdir(), k);
        if (o3_run(r, resume[k].world, backend) == FL_OK) {
            const zr_rec *x = &r->rec[0];
            FL_CHECKF(x->steps == 4 && x->bytes, "%s, resumed by %s at %d: steps %ld", what, resume[k].strategy,
                      resume[k].world, x->steps);
            if (k == 0) {
                anchor = *x;
                anchor.bytes = malloc(x->nbytes + 4);
                if (anchor.bytes) memcpy(anchor.bytes, x->bytes, x->nbytes);
            } else {
                FL_CHECKF(anchor.bytes && x->nbytes == anchor.nbytes && !memcmp(x->bytes, anchor.bytes, x->nbytes) &&
                              !memcmp(x->loss + 2, anchor.loss + 2, 2 * sizeof(double)),
                          "%s, resumed by %s at %d: other bits than by %s at %d", what, resume[k].strategy,
                          resume[k].world, resume[0].strategy, resume[0].world);
            }
            if (resume[k].world == save.world)
                FL_CHECKF(x->nbytes == full->rec[0].nbytes && !memcmp(x->bytes, full->rec[0].bytes, x->nbytes) &&
                              !memcmp(x->loss + 2, full->rec[0].loss + 2, 2 * sizeof(double)),
                          "%s, resumed by %s at %d: other bits than the uninterrupted run", what, resume[k].strategy,
                          resume[k].world);
        }
        o3_free(r);
    }
    zr_free(&anchor);
out:
    o3_free(full);
    o3_free(part);
    fl_optim_set_offload_piece(0);
}

FL_TEST(offload3_checkpoints_resume_with_and_without_offload) {
    const char *D = "deepspeed_stage_3", *O = "deepspeed_stage_3_offload";
    /* saved with offload (opaque: staged), resumed with and without it, at 2 ranks */
    const o3side r2[2] = {{D, 2}, {O, 2}};
    o3_resume_case(ZR_ADAMW, (o3side){O, 2}, "full", r2, 2, "opaque");
    /* the reverse: saved on the device, resumed offloaded (make test time: not under ASan in the quick tier, where
     * the case above resumes offloaded and fsdp_threads_checkpoint_resumes_at_another_world_size saves and resumes
     * FULL_SHARD's device checkpoints) */
    const int al = fl_test_asan_light();
    if (!al) o3_resume_case(ZR_SGDM, (o3side){D, 2}, "full", r2, 2, "opaque");
    /* sharded at 3 ranks with offload, resumed at 2 and 3 with and without it */
    const o3side r3[4] = {{D, 2}, {O, 2}, {D, 3}, {O, 3}};
    o3_resume_case(ZR_ADAMW, (o3side){O, 3}, "sharded", r3, 2, "cpu");
    if (!al) o3_resume_case(ZR_ADAMW, (o3side){O, 3}, "sharded", r3 + 2, 2, "cpu"); /* ASan quick: the 2-rank resume */
    /* consolidated at 3 ranks with offload (the single-process format), resumed in one process with and
     * without offload */
    const o3side r1[2] = {{D, 1}, {O, 1}};
    o3_resume_case(ZR_SGDM, (o3side){O, 3}, "full", r1, 2, "cpu");
}

/* The planner: device, host and nvme bytes of every rank, for every offload combination built
 * (deepspeed_stage_{1,2,3}_offload x offload_optimizer_device cpu | nvme x 1, 2, 3 ranks; AdamW with
 * clipping), equal to the measured: every tag's peak of each tier (the device's WORKSPACE aside: thread
 * ranks take no MPI scratch, which the plan counts), every phase's reserved bytes. */
FL_TEST(offload3_plan_equals_measured_for_every_tier_and_rank) {
    char dir[700], mk[760];
    snprintf(dir, sizeof dir, "%s/nvme-plan", fl_test_tmpdir());
    snprintf(mk, sizeof mk, "mkdir -p '%s'", dir);
    FL_REQUIRE(system(mk) == 0);
    for (int stage = 1; stage <= 3; stage++)
        for (int nvme = 0; nvme < 2; nvme++)
            for (int world = 1; world <= 3; world++) {
                char st[48], what[96];
                snprintf(st, sizeof st, "deepspeed_stage_%d_offload", stage);
                snprintf(what, sizeof what, "%s %s at %d ranks", st, nvme ? "nvme" : "cpu", world);
                o3job *j = o3_new(ZR_ADAMW, world, st, nvme ? "plan-nvme" : "plan-cpu");
                j->cfg.train.max_steps = 2;
                if (nvme) {
                    snprintf(j->cfg.offload_device, sizeof j->cfg.offload_device, "nvme");
                    snprintf(j->cfg.nvme_path, sizeof j->cfg.nvme_path, "%s", dir);
                }
                if (o3_run(j, world, "cpu") == FL_OK) {
                    for (int r = 0; r < world; r++)
                        FL_CHECKF(j->res[r].offload && (nvme ? j->res[r].nvme_peak[FL_TAG_OPTIM] > 0
                                                              : j->res[r].host_peak[FL_TAG_OPTIM] > 0),
                                  "%s rank %d: no state in the %s tier", what, r, nvme ? "nvme" : "host");
                    o3_check_plan(j, world, what);
                }
                o3_free(j);
            }
    FL_CHECKF(dir_empty(dir), "offload plans: files left in %s", dir);
}

/* Parameter offload (built: tests/test_poff.c) takes none, cpu and nvme with ZeRO-3 offload; other values refused */
FL_TEST(offload3_param_offload_values) {
    fl_run_config c;
    char out[700];
    snprintf(out, sizeof out, "%s/offload3-param", fl_test_tmpdir());
    zr_config(&c, ZR_ADAMW, 2, 2, 1, "deepspeed_stage_3_offload", NULL, out);
    FL_CHECK(fl_cfg_validate(&c) == FL_OK);
    FL_CHECK(fl_cfg_set(&c, "offload_param_device", "none") == FL_OK && fl_cfg_validate(&c) == FL_OK);
    FL_CHECK(fl_cfg_set(&c, "offload_param_device", "cpu") == FL_OK && fl_cfg_validate(&c) == FL_OK);
    FL_CHECK(fl_cfg_set(&c, "offload_param_device", "nvme") == FL_OK && fl_cfg_validate(&c) == FL_OK);
    FL_CHECK(fl_cfg_set(&c, "offload_param_device", "gpu") == FL_OK && fl_cfg_validate(&c) == FL_ERR_INVALID);
}

/* Faults at set-up under ZeRO-3 nvme offload at 2 ranks: a folder that does not exist, and a disk that
 * cannot take the state (here a file-size limit below the state's bytes: posix_fallocate fails as on a
 * full disk). Every rank fails at set-up, before a step, with the folder named; no file is left. */
FL_TEST(offload3_nvme_faults_at_setup_name_the_folder) {
    o3job *j = o3_new(ZR_ADAMW, 2, "deepspeed_stage_3_offload", "nvme-missing");
    snprintf(j->cfg.offload_device, sizeof j->cfg.offload_device, "nvme");
    snprintf(j->cfg.nvme_path, sizeof j->cfg.nvme_path, "/nonexistent-fitllm-nvme3");
    setenv("FITLLM_BACKEND", "cpu", 1);
    fl_status s = fl_comm_threads_run(2, o3rank, j);
    FL_CHECKF(s != FL_OK && strstr(fl_error_message(), "/nonexistent-fitllm-nvme3") &&
              strstr(fl_error_message(), "nvme_path") && !j->rec[0].steps && !j->rec[1].steps,
              "missing nvme folder: %s (%s), steps %ld", fl_status_name(s), fl_error_message(), j->rec[0].steps);
    o3_free(j);
    /* "full": files may not grow past 64 KiB (micro's AdamW state shard is ~500 KiB a rank) */
    char dir[700], mk[760];
    snprintf(dir, sizeof dir, "%s/nvme-full", fl_test_tmpdir());
    snprintf(mk, sizeof mk, "mkdir -p '%s'", dir);
    FL_REQUIRE(system(mk) == 0);
    j = o3_new(ZR_ADAMW, 2, "deepspeed_stage_3_offload", "nvme-full");
    snprintf(j->cfg.offload_device, sizeof j->cfg.offload_device, "nvme");
    snprintf(j->cfg.nvme_path, sizeof j->cfg.nvme_path, "%s", dir);
    struct rlimit old, lim;
    FL_REQUIRE(getrlimit(RLIMIT_FSIZE, &old) == 0);
    lim = old;
    lim.rlim_cur = 64 << 10;
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN); /* the call fails with EFBIG instead of a signal */
    FL_REQUIRE(setrlimit(RLIMIT_FSIZE, &lim) == 0);
    s = fl_comm_threads_run(2, o3rank, j);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, prev);
    unsetenv("FITLLM_BACKEND");
    FL_CHECKF(s != FL_OK && strstr(fl_error_message(), dir) && strstr(fl_error_message(), "cannot reserve") &&
              !j->rec[0].steps && !j->rec[1].steps,
              "full nvme folder: %s (%s), steps %ld", fl_status_name(s), fl_error_message(), j->rec[0].steps);
    FL_CHECKF(dir_empty(dir), "full nvme folder: files left in %s", dir);
    o3_free(j);
}

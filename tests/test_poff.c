/* Parameter offload (--offload_param_device cpu | nvme; --strategy fsdp_cpu_offload,
 * deepspeed_stage_3_offload_nvme): each rank's shard of the parameters and gradients lives in the host
 * tier or in NVMe files (the offloaded parameter store, src/model/store_offload.c); each unit is copied up
 * ahead of its use and dropped after, its gradient reduced and sent down; the optimizer updates the host
 * shard in place.
 *
 * Anchor: the device-resident run (deepspeed_stage_3: its shards on the device, the optimizer too; at one
 * rank the unsharded one-process run). Offload moves bytes and the host kernels are the device's own on
 * cpu, opaque and cuda-emu, so the offloaded run must give the SAME BITS: every step's loss and the whole
 * parameters gathered after each step, at 1, 2 and 3 ranks, on cpu, opaque (its memory is not the host's:
 * every unit's piece really travels) and the CUDA emulator, at every prefetch depth. Memory: the device
 * holds no PARAMS, GRADS or OPTIM; the tier holds the device run's PARAMS and GRADS (the shard's); the plan
 * of every tier equals the measured. Checkpoints: saved with parameter offload and resumed without it and
 * the reverse, consolidated and sharded; a stop and resume ends on the uninterrupted run's bits. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "train/dp.h"
#include "test.h"
#include "zero_ref.h"

#define PO_MAX_RANKS 3

typedef struct {
    fl_run_config cfg;
    zr_rec rec[PO_MAX_RANKS];
    fl_trainer_result res[PO_MAX_RANKS];
    fl_status st[PO_MAX_RANKS];
    long stop_at; /* > 0: the hook stops the run after this step */
} pojob;

typedef struct {
    pojob *j;
    int rank;
} poarg;

static int po_hook(void *ud, long step, double loss, const void *params, size_t bytes) {
    poarg *a = ud;
    zr_record(&a->j->rec[a->rank], step, loss, params, bytes);
    return a->j->stop_at && step >= a->j->stop_at;
}

static fl_status porank(fl_comm *c, int rank, void *ud) {
    pojob *j = ud;
    poarg a = {j, rank};
    j->st[rank] = fl_trainer_run_comm(&j->cfg, c, NULL, 0, po_hook, &a, &j->res[rank]);
    return j->st[rank];
}

/* param: "" (device-resident), "cpu" or "nvme" (the folder under the test's tmp, made here) */
static pojob *po_new(int sc, int world, const char *strategy, const char *param, const char *tag) {
    pojob *j = calloc(1, sizeof *j);
    if (!j) abort();
    char out[700];
    snprintf(out, sizeof out, "%s/poff-%s-%s-%d", fl_test_tmpdir(), zr_names[sc], tag, world);
    zr_config(&j->cfg, sc, world, world, 1, strategy, NULL, out);
    if (param[0]) snprintf(j->cfg.offload_param_device, sizeof j->cfg.offload_param_device, "%s", param);
    if (!strcmp(param, "nvme")) {
        char mk[800];
        snprintf(j->cfg.nvme_path, sizeof j->cfg.nvme_path, "%s/poff-nvme", fl_test_tmpdir());
        snprintf(mk, sizeof mk, "mkdir -p '%s'", j->cfg.nvme_path);
        if (system(mk) != 0) abort();
    }
    return j;
}

static fl_status po_run(pojob *j, int world, const char *backend) {
    setenv("FITLLM_BACKEND", backend, 1);
    fl_status s = world > 1 ? fl_comm_threads_run(world, porank, j) : porank(NULL, 0, j);
    unsetenv("FITLLM_BACKEND");
    FL_CHECKF(s == FL_OK, "%s (offload_param_device %s) at %d ranks on %s: %s", j->cfg.strategy,
              j->cfg.offload_param_device, world, backend, fl_error_message());
    return s;
}

static void po_free(pojob *j) {
    for (int r = 0; j && r < PO_MAX_RANKS; r++) zr_free(&j->rec[r]);
    free(j);
}

/* off against the device-resident base, rank by rank: the bits; the device holds no PARAMS, GRADS or OPTIM;
 * the tier (host or nvme) holds base's PARAMS and GRADS, and the optimizer's state where it was offloaded */
static void po_compare(const pojob *off, const pojob *base, int world, const char *what) {
    const int nvme = !strcmp(off->cfg.offload_param_device, "nvme") ||
                     !strcmp(off->cfg.strategy, "deepspeed_stage_3_offload_nvme");
    for (int r = 0; r < world; r++) {
        const fl_trainer_result *a = &off->res[r], *b = &base->res[r];
        if (off->st[r] != FL_OK || base->st[r] != FL_OK) return;
        FL_CHECKF(zr_same(&off->rec[r], &base->rec[r]), "%s rank %d: the parameters or losses differ from the "
                  "device-resident run's bits", what, r);
        FL_CHECKF(a->peak[FL_TAG_PARAMS] == 0 && a->peak[FL_TAG_GRADS] == 0 && a->peak[FL_TAG_OPTIM] == 0,
                  "%s rank %d: device PARAMS %zu GRADS %zu OPTIM %zu with parameter offload", what, r,
                  a->peak[FL_TAG_PARAMS], a->peak[FL_TAG_GRADS], a->peak[FL_TAG_OPTIM]);
        const size_t *tier = nvme ? a->nvme_peak : a->host_peak;
        FL_CHECKF(a->offload && (!nvme || a->nvme) && tier[FL_TAG_PARAMS] == b->peak[FL_TAG_PARAMS] &&
                      tier[FL_TAG_GRADS] == b->peak[FL_TAG_GRADS],
                  "%s rank %d: %s tier PARAMS %zu GRADS %zu, the device run's %zu %zu", what, r, nvme ? "nvme" : "host",
                  tier[FL_TAG_PARAMS], tier[FL_TAG_GRADS], b->peak[FL_TAG_PARAMS], b->peak[FL_TAG_GRADS]);
        FL_CHECKF(a->host_peak[FL_TAG_OPTIM] + a->nvme_peak[FL_TAG_OPTIM] == b->peak[FL_TAG_OPTIM],
                  "%s rank %d: offloaded OPTIM %zu + %zu, the device run's %zu", what, r, a->host_peak[FL_TAG_OPTIM],
                  a->nvme_peak[FL_TAG_OPTIM], b->peak[FL_TAG_OPTIM]);
    }
}

static void po_check_plan(const pojob *j, int world, const char *what) {
    for (int r = 0; r < world; r++) { /* each rank's device, host and nvme tiers as planned for it */
        char why[2048] = "";
        int bad = zr_check_plan(&j->cfg, r, &j->res[r], 0, why, sizeof why, 0);
        FL_CHECKF(bad == 0, "%s: %s", what, why);
    }
}

static int po_dir_empty(const char *dir) {
    char cmd[800];
    snprintf(cmd, sizeof cmd, "test -z \"$(ls -A '%s' 2>/dev/null)\"", dir);
    return system(cmd) == 0;
}

/* one comparison: base (deepspeed_stage_3) against `strategy` + `param` on backend, with the plan (cpu) */
/* > 0: po_case's runs cut their samples at that many tokens instead of dr_config's 20 (the CUDA emulator's cases:
 * the gathers, reductions and the tier's traffic are per unit and step, not per token) */
static int g_po_seq;

static void po_case(const char *backend, int sc, int world, const char *strategy, const char *param, long steps,
                    int plan) {
    char what[160];
    snprintf(what, sizeof what, "%s %s at %d ranks, %s param %s", backend, zr_names[sc], world, strategy,
             param[0] ? param : "(strategy's)");
    pojob *b = po_new(sc, world, "deepspeed_stage_3", "", "dev");
    pojob *o = po_new(sc, world, strategy, param, "off");
    if (steps) b->cfg.train.max_steps = o->cfg.train.max_steps = steps;
    if (g_po_seq) b->cfg.train.max_seq_length = o->cfg.train.max_seq_length = g_po_seq;
    if (po_run(b, world, backend) == FL_OK && po_run(o, world, backend) == FL_OK) {
        po_compare(o, b, world, what);
        if (plan) po_check_plan(o, world, what);
    }
    if (o->cfg.nvme_path[0]) FL_CHECKF(po_dir_empty(o->cfg.nvme_path), "%s: files left in %s", what, o->cfg.nvme_path);
    po_free(b);
    po_free(o);
}

FL_TEST(poff_threads_equal_device_bits_at_1_2_3_ranks) {
    /* quick tier (both passes): 3 ranks; under ASan not even those (make test time: both tiers run there at 3 ranks in
     * poff_overlap_keeps_the_bits (nvme) and at 2 in poff_update_overlap_keeps_the_bits, poff_stop_resume_*) */
    for (int world = fl_test_quick() ? 3 : 1; world <= 3 && !fl_test_asan_light(); world++) {
        po_case("cpu", ZR_ADAMW, world, "deepspeed_stage_3_offload", "cpu", 0, 1);
        po_case("cpu", ZR_ADAMW, world, "deepspeed_stage_3_offload_nvme", "", 0, 1);
    }
    po_case("cpu", ZR_SGDM, 2, "fsdp_cpu_offload", "", 0, 1);
    po_case("cpu", ZR_BF16, 3, "fsdp_cpu_offload", "", 0, 1);
    po_case("cpu", ZR_BF16, 1, "deepspeed_stage_3_offload", "nvme", 0, 1);
}

/* the prefetch depth moves when bytes travel, never what they are */
FL_TEST(poff_prefetch_depth_keeps_the_bits) {
    /* one ZeRO-3 run without offload (the same for both depths), each depth against it */
    pojob *b = po_new(ZR_ADAMW, 2, "deepspeed_stage_3", "", "pf-dev");
    const fl_status sb = po_run(b, 2, "cpu");
    for (int depth = 0; sb == FL_OK && depth <= 3; depth += 3) {
        pojob *o = po_new(ZR_ADAMW, 2, "deepspeed_stage_3_offload_nvme", "", "pf-off");
        o->cfg.offload_prefetch = depth;
        char what[64];
        snprintf(what, sizeof what, "nvme offload_prefetch %d", depth);
        if (po_run(o, 2, "cpu") == FL_OK) {
            po_compare(o, b, 2, what);
            po_check_plan(o, 2, what);
        }
        po_free(o);
    }
    po_free(b);
}

/* --offload_overlap: the worker thread copies each unit fetched ahead out of the tier while the unit before it
 * computes; the copy-on-post run (overlap off) is the anchor: the same bits at 1, 2 and 3 ranks, on cpu (host
 * tier and NVMe, with the plan of every tier = measured), opaque (the worker fills host staging, copied up at
 * arrival) and the CUDA emulator; and the worker did the copies (its job count grows by at least a unit per
 * step and rank). */
static void po_overlap(const char *backend, int sc, int world, const char *strategy, long steps, int plan) {
    char what[160];
    snprintf(what, sizeof what, "%s %s at %d ranks, %s: offload_overlap on against off", backend, zr_names[sc], world,
             strategy);
    pojob *a = po_new(sc, world, strategy, "", "ov-on"), *b = po_new(sc, world, strategy, "", "ov-off");
    b->cfg.offload_overlap = 0;
    if (steps) a->cfg.train.max_steps = b->cfg.train.max_steps = steps;
    const unsigned long n0 = fl_fetch_count();
    if (po_run(a, world, backend) == FL_OK) {
        const unsigned long n1 = fl_fetch_count();
        FL_CHECKF(n1 - n0 >= (unsigned long)(world * a->rec[0].steps), "%s: the worker copied %lu units", what, n1 - n0);
        if (po_run(b, world, backend) == FL_OK) {
            FL_CHECKF(fl_fetch_count() == n1, "%s: the worker ran with offload_overlap false", what);
            for (int r = 0; r < world; r++)
                FL_CHECKF(zr_same(&a->rec[r], &b->rec[r]), "%s rank %d: the parameters or losses differ", what, r);
            if (plan) po_check_plan(a, world, what);
        }
    }
    if (a->cfg.nvme_path[0]) FL_CHECKF(po_dir_empty(a->cfg.nvme_path), "%s: files left in %s", what, a->cfg.nvme_path);
    po_free(a);
    po_free(b);
}

FL_TEST(poff_overlap_keeps_the_bits) {
    const int light = fl_test_quick(); /* the quick tier (both passes): each tier on cpu and opaque once */
    for (int world = light ? 3 : 1; world <= 3; world++)
        po_overlap("cpu", ZR_ADAMW, world, "deepspeed_stage_3_offload_nvme", 0, 1);
    po_overlap("cpu", ZR_SGDM, 2, "fsdp_cpu_offload", 0, 1);
    if (!light) po_overlap("cpu", ZR_BF16, 3, "fsdp_cpu_offload", 0, 1);
    for (int world = light ? 2 : 1; world <= (light ? 2 : 3); world++)
        po_overlap("opaque", ZR_ADAMW, world, "fsdp_cpu_offload", 3, 0);
    if (!light) po_overlap("opaque", ZR_BF16, 2, "deepspeed_stage_3_offload_nvme", 3, 0);
    if (fl_test_asan_light()) return; /* emulated kernels under ASan are slow (fl_test_asan_budget) */
    po_overlap("cuda-emu", ZR_ADAMW, 1, "fsdp_cpu_offload", 2, 0);
    if (!light) po_overlap("cuda-emu", ZR_ADAMW, 2, "deepspeed_stage_3_offload_nvme", 2, 0);
}

/* --offload_update_overlap: without clipping and loss scaling each unit's host update is queued on the fetch
 * worker as its gradient becomes final (the last micro-batch's reduction; these runs accumulate 2), beside the
 * rest of the backward. Anchors: the same run with the switch off and the device-resident deepspeed_stage_3 run
 * (at one rank the plain run): every step's loss and the whole parameters bit for bit; the worker ran at least one
 * update per unit, step and rank (its count of function jobs); the plan of every tier = measured (cpu). With
 * clipping on (ZR_ADAMW's max_norm) nothing is queued. */
static void po_upd(const char *backend, int sc, int world, const char *strategy, const char *param, long steps,
                   int plan) {
    char what[200];
    snprintf(what, sizeof what, "%s %s (max_norm 0) at %d ranks, %s param %s: offload_update_overlap on against off "
             "and the device run", backend, zr_names[sc], world, strategy, param[0] ? param : "(strategy's)");
    pojob *a = po_new(sc, world, strategy, param, "uo-on"), *b = po_new(sc, world, strategy, param, "uo-off");
    pojob *d = po_new(sc, world, "deepspeed_stage_3", "", "uo-dev");
    a->cfg.train.max_norm = b->cfg.train.max_norm = d->cfg.train.max_norm = 0.0f; /* no clipping */
    b->cfg.offload_update_overlap = 0;
    if (steps) a->cfg.train.max_steps = b->cfg.train.max_steps = d->cfg.train.max_steps = steps;
    const unsigned long n0 = fl_fetch_run_count();
    if (po_run(a, world, backend) == FL_OK) {
        const unsigned long n1 = fl_fetch_run_count();
        const long units = 2 + 2; /* micro: 2 blocks, the embeddings and the head group */
        FL_CHECKF(n1 - n0 >= (unsigned long)(world * units * a->rec[0].steps), "%s: the worker ran %lu updates in %ld "
                  "steps", what, n1 - n0, a->rec[0].steps);
        if (po_run(b, world, backend) == FL_OK && po_run(d, world, backend) == FL_OK) {
            FL_CHECKF(fl_fetch_run_count() == n1, "%s: updates queued with offload_update_overlap false", what);
            for (int r = 0; r < world; r++) {
                FL_CHECKF(zr_same(&a->rec[r], &b->rec[r]), "%s rank %d: the parameters or losses differ from the "
                          "switch-off run's", what, r);
                FL_CHECKF(zr_same(&a->rec[r], &d->rec[r]), "%s rank %d: the parameters or losses differ from the "
                          "device-resident run's", what, r);
            }
            if (plan) po_check_plan(a, world, what);
        }
    }
    if (a->cfg.nvme_path[0]) FL_CHECKF(po_dir_empty(a->cfg.nvme_path), "%s: files left in %s", what, a->cfg.nvme_path);
    po_free(a);
    po_free(b);
    po_free(d);
}

FL_TEST(poff_update_overlap_keeps_the_bits) {
    const int light = fl_test_quick(); /* the quick tier (both passes): each tier and backend once */
    for (int world = light ? 2 : 1; world <= (light ? 2 : 3); world++)
        po_upd("cpu", ZR_ADAMW, world, "deepspeed_stage_3_offload", "cpu", 0, 1);
    /* make test time: not under ASan in the quick tier, where poff_update_overlap_disk_fails_mid_run updates nvme units
     * on the worker for its first steps */
    if (!fl_test_asan_light()) po_upd("cpu", ZR_ADAMW, 2, "deepspeed_stage_3_offload_nvme", "", 0, 1);
    if (!light) po_upd("cpu", ZR_SGDM, 3, "fsdp_cpu_offload", "", 0, 1);
    if (!light) po_upd("cpu", ZR_BF16, 2, "deepspeed_stage_3_offload_nvme", "", 0, 1);
    po_upd("cpu", ZR_ADAMW, 2, "deepspeed_stage_3_offload", "", 0, 1); /* the optimizer alone offloaded */
    po_upd("opaque", ZR_ADAMW, 2, "fsdp_cpu_offload", "", 3, 0);
    if (!light) po_upd("opaque", ZR_BF16, 1, "deepspeed_stage_3_offload_nvme", "", 3, 0);
    /* clipping on: the update needs every shard's gradient first; nothing is queued */
    pojob *c = po_new(ZR_ADAMW, 2, "fsdp_cpu_offload", "", "uo-clip");
    c->cfg.train.max_steps = 2;
    const unsigned long n0 = fl_fetch_run_count();
    if (po_run(c, 2, "cpu") == FL_OK)
        FL_CHECKF(fl_fetch_run_count() == n0, "clipping on: %lu updates queued", fl_fetch_run_count() - n0);
    po_free(c);
}

/* A function job on the fetch worker (fl_fetch_post_run) runs in post order with the copies, and its failure
 * comes back with its message (the worker's thread-local message would otherwise be lost) */
static fl_status po_job_fails(void *ud) {
    return fl_errorf(FL_ERR_IO, "unit %d: the disk is full", *(int *)ud);
}
static fl_status po_job_copies(void *ud) {
    int *v = ud;
    v[1] = v[0] + 1; /* after the copy posted before it */
    return FL_OK;
}

FL_TEST(poff_fetch_worker_runs_functions_in_order) {
    fl_fetch *w = NULL;
    FL_REQUIRE_OK(fl_fetch_start(&w));
    fl_fetch_job j[3];
    memset(j, 0, sizeof j);
    int src = 41, v[2] = {0, 0}, unit = 7;
    fl_fetch_post(w, &j[0], &v[0], &src, sizeof src);
    fl_fetch_post_run(w, &j[1], po_job_copies, v);
    fl_fetch_post_run(w, &j[2], po_job_fails, &unit);
    for (int k = 0; k < 3; k++) fl_fetch_wait(w, &j[k]);
    FL_CHECKF(v[0] == 41 && v[1] == 42 && j[1].st == FL_OK, "the function ran out of order: %d %d", v[0], v[1]);
    FL_CHECKF(j[2].st == FL_ERR_IO && !strcmp(j[2].msg, "unit 7: the disk is full"), "the failure came back as %s '%s'",
              fl_status_name(j[2].st), j[2].msg);
    fl_fetch_stop(w);
}

/* Sharded generation: the evaluation sample under parameter offload at 2 thread ranks decodes in step (each token
 * gathers the units from both ranks); the ranks' picks are compared after each token. Agreeing ranks run through;
 * a rank whose sampler went apart (FITLLM_TEST_SAMPLE_SEED_SKEW=1: rank 1 samples with seed + 1) ends the run on
 * every rank with an error naming that rank and the step, not a hang in mismatched collectives. */
static FILE *g_po_out; /* rank 0's output (the sample is decoded where a rank prints) */

static fl_status porank_out(fl_comm *c, int rank, void *ud) {
    pojob *j = ud;
    poarg a = {j, rank};
    j->st[rank] = fl_trainer_run_comm(&j->cfg, c, rank == 0 ? g_po_out : NULL, 0, po_hook, &a, &j->res[rank]);
    return j->st[rank];
}

FL_TEST(poff_sharded_sample_ranks_must_agree) {
    for (int skew = 0; skew <= 1; skew++) {
        g_po_out = tmpfile();
        FL_REQUIRE(g_po_out);
        pojob *j = po_new(ZR_SGDM, 2, "fsdp_cpu_offload", "", skew ? "agree-skew" : "agree");
        j->cfg.train.max_steps = 2;
        j->cfg.eval.interval = 2;
        j->cfg.eval.max_new_tokens = 8;
        j->cfg.eval.final_validation = 0;
        if (skew) setenv("FITLLM_TEST_SAMPLE_SEED_SKEW", "1", 1);
        setenv("FITLLM_BACKEND", "cpu", 1);
        fl_status s = fl_comm_threads_run(2, porank_out, j);
        unsetenv("FITLLM_BACKEND");
        unsetenv("FITLLM_TEST_SAMPLE_SEED_SKEW");
        char text[65536];
        rewind(g_po_out);
        const size_t got = fread(text, 1, sizeof text - 1, g_po_out);
        text[got] = 0;
        fclose(g_po_out);
        if (!skew) {
            FL_CHECKF(s == FL_OK && j->rec[0].steps == 2 && strstr(text, "Recommend a movie"),
                      "agreeing ranks: %s (%s), sample printed %d", fl_status_name(s), fl_error_message(),
                      strstr(text, "Recommend a movie") != NULL);
        } else {
            /* (a rank still inside the last gather when the other ends sees the broken group instead: the run's
             * status is then the comm's IO error, whose message carries the aborting rank's reason) */
            FL_CHECKF((s == FL_ERR_INTERNAL || s == FL_ERR_IO) && j->st[0] != FL_OK && j->st[1] != FL_OK &&
                          strstr(fl_error_message(), "sharded generation (the evaluation sample after step 2): rank 1 picked"),
                      "ranks sampling apart: %s / %s (%s)", fl_status_name(j->st[0]), fl_status_name(j->st[1]),
                      fl_error_message());
        }
        po_free(j);
    }
}

/* opaque: every unit's piece goes up through the backend's copies and the gathers and reductions through
 * the device communicator (the NCCL stand-in at 2 and 3 ranks); the CUDA emulator likewise (slow: small) */
FL_TEST(poff_opaque_same_bits) {
    if (!fl_test_asan_budget()) return; /* make test time (quick tier); parameter offload under ASan: poff_threads_*, poff_overlap_* (cpu, light) */
    po_case("opaque", ZR_ADAMW, 1, "fsdp_cpu_offload", "", 3, 0);
    po_case("opaque", ZR_ADAMW, 2, "fsdp_cpu_offload", "", 3, 0);
    po_case("opaque", ZR_BF16, 3, "deepspeed_stage_3_offload_nvme", "", 3, 0);
}

FL_TEST(poff_cuda_emu_same_bits) {
    if (!fl_test_asan_budget()) return;
    /* the quick tier: 2 ranks (make test time; one rank's device path runs in poff_opaque_same_bits) */
    g_po_seq = 8;
    if (!fl_test_quick()) po_case("cuda-emu", ZR_ADAMW, 1, "fsdp_cpu_offload", "", 2, 0);
    po_case("cuda-emu", ZR_ADAMW, 2, "fsdp_cpu_offload", "", 2, 0);
    g_po_seq = 0;
}

/* issue 34's Verify: the CUDA emulator at 3 ranks too (the NCCL stand-in carries the gathers of device buffers;
 * the NVMe tier) */
FL_TEST(poff_cuda_emu_three_ranks_same_bits) {
    if (!fl_test_asan_budget()) return;
    g_po_seq = 8;
    po_case("cuda-emu", ZR_SGDM, 3, "deepspeed_stage_3_offload_nvme", "", 2, 0);
    g_po_seq = 0;
}

/* A checkpoint at step 2 (global batch 12, 4 steps), saved by `save_strategy` + `save_param`, resumed by
 * `res_strategy` + `res_param` at the same world size: the uninterrupted run's bits. */
static void po_resume(const char *backend, int sc, int world, const char *save_strategy, const char *save_param,
                      const char *res_strategy, const char *res_param, const char *sdt) {
    char what[200];
    snprintf(what, sizeof what, "%s %s at %d: saved by %s/%s (%s), resumed by %s/%s", backend, zr_names[sc], world,
             save_strategy, save_param, sdt, res_strategy, res_param);
    pojob *full = po_new(sc, world, "deepspeed_stage_3", "", "ck-full");
    pojob *part = po_new(sc, world, save_strategy, save_param, "ck-part");
    pojob *r = po_new(sc, world, res_strategy, res_param, "ck-res");
    full->cfg.train.global_batch_size = part->cfg.train.global_batch_size = r->cfg.train.global_batch_size = 12;
    full->cfg.train.max_steps = part->cfg.train.max_steps = r->cfg.train.max_steps = 4;
    snprintf(part->cfg.state_dict_type, sizeof part->cfg.state_dict_type, "%s", sdt);
    part->cfg.train.save_interval = 2;
    part->stop_at = 2;
    snprintf(r->cfg.resume, sizeof r->cfg.resume, "%.4000s/step-000002", part->cfg.out_dir);
    if (po_run(full, world, backend) == FL_OK && po_run(part, world, backend) == FL_OK &&
        po_run(r, world, backend) == FL_OK) {
        FL_CHECKF(part->rec[0].steps == 2, "%s: stopped at step %ld", what, part->rec[0].steps);
        for (int k = 0; k < world; k++)
            FL_CHECKF(r->rec[k].steps == 4 &&
                          r->rec[k].nbytes == full->rec[k].nbytes &&
                          !memcmp(r->rec[k].bytes, full->rec[k].bytes, r->rec[k].nbytes) &&
                          !memcmp(r->rec[k].loss + 2, full->rec[k].loss + 2, 2 * sizeof(double)),
                      "%s rank %d: the resumed run's steps 3-4 are not the uninterrupted run's bits", what, k);
    }
    po_free(full);
    po_free(part);
    po_free(r);
}

FL_TEST(poff_stop_resume_and_reshard_across_offload_settings) {
    const char *D = "deepspeed_stage_3", *O = "deepspeed_stage_3_offload";
    /* stop and resume with parameter offload: the uninterrupted run's bits */
    po_resume("cpu", ZR_ADAMW, 2, O, "cpu", O, "cpu", "full");
    po_resume("cpu", ZR_ADAMW, 1, O, "nvme", O, "nvme", "full");
    /* saved with offload, resumed without it, and the reverse (consolidated and sharded) */
    if (!fl_test_asan_light()) { /* under ASan the cases above and below cover these paths */
        po_resume("cpu", ZR_SGDM, 2, O, "cpu", D, "", "full");
        po_resume("cpu", ZR_SGDM, 2, D, "", O, "nvme", "full");
    }
    po_resume("cpu", ZR_ADAMW, 3, O, "nvme", D, "", "sharded");
    po_resume("opaque", ZR_ADAMW, 2, D, "", "fsdp_cpu_offload", "", "full");
}

/* The configuration: what parameter offload runs with, and what it refuses by name */
FL_TEST(poff_config_accepts_and_refuses) {
    fl_run_config c;
    char out[700];
    snprintf(out, sizeof out, "%s/poff-cfg", fl_test_tmpdir());
    zr_config(&c, ZR_ADAMW, 2, 2, 1, "deepspeed_stage_3_offload", NULL, out);
    int st = 0;
    FL_CHECK(fl_cfg_zero_stage("fsdp_cpu_offload", NULL, &st) == FL_OK && st == 3);
    FL_CHECK(fl_cfg_zero_stage("deepspeed_stage_3_offload_nvme", NULL, &st) == FL_OK && st == 3);
    FL_CHECK(fl_cfg_offload("fsdp_cpu_offload") && fl_cfg_offload("deepspeed_stage_3_offload_nvme"));
    FL_CHECK(fl_cfg_param_offload(&c) == 0);
    FL_CHECK(fl_cfg_set(&c, "offload_param_device", "cpu") == FL_OK && fl_cfg_validate(&c) == FL_OK &&
             fl_cfg_param_offload(&c) == 1);
    FL_CHECK(fl_cfg_set(&c, "offload_param_device", "nvme") == FL_OK && fl_cfg_validate(&c) == FL_OK &&
             fl_cfg_param_offload(&c) == 2 && !fl_cfg_offload_nvme(&c));
    FL_CHECK(fl_cfg_set(&c, "nvme_path", "/tmp") == FL_OK && fl_cfg_validate(&c) == FL_OK); /* the parameters' files */
    FL_CHECK(fl_cfg_set(&c, "offload_param_device", "gpu") == FL_OK && fl_cfg_validate(&c) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "offload_param_device 'gpu'"));
    FL_CHECK(fl_cfg_set(&c, "offload_param_device", "none") == FL_OK && fl_cfg_validate(&c) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "nvme_path")); /* nothing goes to nvme now */
    FL_CHECK(fl_cfg_set(&c, "nvme_path", "") == FL_OK && fl_cfg_validate(&c) == FL_OK);
    /* the strategies' own devices */
    FL_CHECK(fl_cfg_set(&c, "offload_param_device", "") == FL_OK && fl_cfg_set(&c, "strategy", "fsdp_cpu_offload") == FL_OK &&
             fl_cfg_validate(&c) == FL_OK && fl_cfg_param_offload(&c) == 1 && !fl_cfg_offload_nvme(&c));
    FL_CHECK(fl_cfg_set(&c, "strategy", "deepspeed_stage_3_offload_nvme") == FL_OK && fl_cfg_validate(&c) == FL_OK &&
             fl_cfg_param_offload(&c) == 2 && fl_cfg_offload_nvme(&c));
    /* refused: a strategy that does not offload stage 3's optimizer, LoRA, a negative depth */
    FL_CHECK(fl_cfg_set(&c, "offload_param_device", "cpu") == FL_OK && fl_cfg_set(&c, "strategy", "deepspeed_stage_3") == FL_OK &&
             fl_cfg_validate(&c) == FL_ERR_INVALID && strstr(fl_error_message(), "offload_param_device cpu") &&
             strstr(fl_error_message(), "deepspeed_stage_3'"));
    FL_CHECK(fl_cfg_set(&c, "strategy", "deepspeed_stage_2_offload") == FL_OK && fl_cfg_validate(&c) == FL_ERR_INVALID);
    FL_CHECK(fl_cfg_set(&c, "strategy", "fsdp") == FL_OK && fl_cfg_validate(&c) == FL_ERR_INVALID);
    FL_CHECK(fl_cfg_set(&c, "strategy", "deepspeed_stage_3_offload") == FL_OK &&
             fl_cfg_set(&c, "offload_prefetch", "-1") == FL_ERR_INVALID && strstr(fl_error_message(), "offload_prefetch"));
    c.offload_prefetch = -1; /* a library caller's */
    FL_CHECK(fl_cfg_validate(&c) == FL_ERR_INVALID && strstr(fl_error_message(), "offload_prefetch"));
    FL_CHECK(fl_cfg_set(&c, "offload_prefetch", "2") == FL_OK && fl_cfg_validate(&c) == FL_OK);
    fl_run_config l;
    fl_cfg_defaults(&l, FL_CMD_FINETUNE_LORA);
    FL_CHECK(fl_cfg_set(&l, "strategy", "fsdp_cpu_offload") == FL_OK && fl_cfg_validate(&l) == FL_ERR_UNSUPPORTED &&
             strstr(fl_error_message(), "finetune_lora"));
}

/* The planner: where ZeRO-3's shards do not fit the device, parameter offload is suggested with its planned
 * peak, which is the parameter-offloaded run's own plan (GPU: host tier; CPU: NVMe files, its host being its
 * "device"); one process likewise */
FL_TEST(poff_plan_suggests_parameter_offload) {
    for (int cuda = 0; cuda <= 1; cuda++)
        for (int world = 1; world <= 2; world++) {
            fl_run_config c;
            char out[700], what[96];
            snprintf(out, sizeof out, "%s/poff-plan", fl_test_tmpdir());
            snprintf(what, sizeof what, "%s plan at %d ranks", cuda ? "cuda" : "cpu", world);
            zr_config(&c, ZR_ADAMW, world, world, 1, "deepspeed_stage_3", NULL, out);
            fl_run_config v = c; /* the suggested run */
            snprintf(v.strategy, sizeof v.strategy, "deepspeed_stage_3_offload");
            snprintf(v.offload_param_device, sizeof v.offload_param_device, "%s", cuda ? "cpu" : "nvme");
            if (!cuda) snprintf(v.offload_device, sizeof v.offload_device, "nvme");
            fl_plan *a = calloc(1, sizeof *a), *b = calloc(1, sizeof *b);
            FL_REQUIRE(a && b);
            fl_plan_opts po;
            fl_plan_opts_default(&po);
            po.no_suggestions = 1;
            po.generation = 0;
            po.cuda = cuda;
            if (fl_plan_run(&c, &po, a) == FL_OK && fl_plan_run(&v, &po, b) == FL_OK) {
                FL_CHECKF(b->peak_total < a->peak_total && b->peak[FL_TAG_PARAMS] == 0 &&
                              (cuda ? b->host_peak : b->nvme_peak)[FL_TAG_PARAMS] == a->peak[FL_TAG_PARAMS],
                          "%s: parameter offload's peak %zu (PARAMS %zu), ZeRO-3's %zu", what, b->peak_total,
                          b->peak[FL_TAG_PARAMS], a->peak_total);
                po.no_suggestions = 0;
                po.device_memory = (a->peak_total + b->peak_total) / 2; /* ZeRO-3's shards do not fit */
                fl_plan *s = calloc(1, sizeof *s);
                FL_REQUIRE(s);
                FL_CHECKF(fl_plan_run(&c, &po, s) == FL_OK && s->verdict == FL_PLAN_OOM, "%s: %s", what, fl_error_message());
                int found = 0;
                for (int i = 0; i < s->n_sugg; i++)
                    if (!strcmp(s->sugg[i].technique, "param_offload")) {
                        found = 1;
                        FL_CHECKF(s->sugg[i].fits == 1 && s->sugg[i].peak == b->peak_total &&
                                      strstr(s->sugg[i].change, cuda ? "--offload_param_device cpu" : "--offload_param_device nvme"),
                                  "%s: param_offload suggestion fits %d peak %zu (its plan %zu) '%s'", what,
                                  s->sugg[i].fits, s->sugg[i].peak, b->peak_total, s->sugg[i].change);
                    }
                FL_CHECKF(found, "%s: no param_offload suggestion", what);
                free(s);
            } else {
                FL_CHECKF(0, "%s: %s", what, fl_error_message());
            }
            free(a);
            free(b);
        }
}

/* Faults with the parameters on NVMe: a folder that does not exist or cannot take the shards at set-up (a
 * file-size limit stands in for a full disk), and the disk failing a write-back in the middle of the run (an
 * injected ENOSPC): each ends with its error naming the folder, no file left; the mid-run failure after a
 * committed checkpoint, which resumes to the uninterrupted run's bits. */
FL_TEST(poff_nvme_faults_end_cleanly) {
    /* the folder does not exist */
    pojob *j = po_new(ZR_ADAMW, 2, "deepspeed_stage_3_offload", "nvme", "fault-missing");
    snprintf(j->cfg.nvme_path, sizeof j->cfg.nvme_path, "%s/poff-no-such-folder", fl_test_tmpdir());
    setenv("FITLLM_BACKEND", "cpu", 1);
    fl_status s = fl_comm_threads_run(2, porank, j);
    /* (the status: the folder's refusal, or under load the other rank's broken collective; the message names it) */
    FL_CHECKF(s != FL_OK && strstr(fl_error_message(), "poff-no-such-folder") && strstr(fl_error_message(), "nvme_path") &&
                  !j->rec[0].steps && !j->rec[1].steps,
              "missing nvme folder: %s (%s)", fl_status_name(s), fl_error_message());
    po_free(j);
    /* the disk cannot take the parameter shards (64 KiB file-size limit; the shard is ~500 KiB) */
    j = po_new(ZR_ADAMW, 2, "deepspeed_stage_3_offload", "nvme", "fault-full");
    struct rlimit old, lim;
    FL_REQUIRE(getrlimit(RLIMIT_FSIZE, &old) == 0);
    lim = old;
    lim.rlim_cur = 64 << 10;
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN); /* the call fails with EFBIG instead of a signal */
    FL_REQUIRE(setrlimit(RLIMIT_FSIZE, &lim) == 0);
    s = fl_comm_threads_run(2, porank, j);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, prev);
    FL_CHECKF(s == FL_ERR_IO && strstr(fl_error_message(), "parameter offload (NVMe)") &&
                  strstr(fl_error_message(), "parameter shard") && strstr(fl_error_message(), j->cfg.nvme_path) &&
                  !j->rec[0].steps,
              "full nvme folder: %s (%s)", fl_status_name(s), fl_error_message());
    FL_CHECKF(po_dir_empty(j->cfg.nvme_path), "full nvme folder: files left in %s", j->cfg.nvme_path);
    po_free(j);
    /* a write-back fails in the middle of the run, after step 2's checkpoint */
    j = po_new(ZR_ADAMW, 2, "deepspeed_stage_3_offload_nvme", "nvme", "fault-mid");
    j->cfg.train.save_interval = 2;
    j->cfg.train.max_steps = 12;
    setenv("FITLLM_TEST_NVME_FAIL_AFTER", "400", 1); /* each rank's 401st write-back fails (step 7 or so) */
    s = fl_comm_threads_run(2, porank, j);
    unsetenv("FITLLM_TEST_NVME_FAIL_AFTER");
    char last[800];
    snprintf(last, sizeof last, "%s/step-000002/COMMITTED", j->cfg.out_dir);
    FILE *f = fopen(last, "r");
    FL_CHECKF(s == FL_ERR_IO && strstr(fl_error_message(), "injected") && strstr(fl_error_message(), j->cfg.nvme_path) &&
                  f != NULL && j->rec[0].steps >= 2 && j->rec[0].steps < 12,
              "nvme write failure mid-run: %s (%s), steps %ld, step 2 committed %d", fl_status_name(s),
              fl_error_message(), j->rec[0].steps, f != NULL);
    if (f) fclose(f);
    FL_CHECKF(po_dir_empty(j->cfg.nvme_path), "nvme write failure: files left in %s", j->cfg.nvme_path);
    unsetenv("FITLLM_BACKEND");
    po_free(j);
}

/* The disk failing a write-back in the middle of a run whose updates run unit by unit on the fetch worker
 * (--offload_update_overlap; SGD with momentum, no clipping): the 376th release of each rank's disk pool is one of
 * unit 0's update's (the last unit: every release of the model's thread in that step came before it was queued, so
 * the count is the same every run): the worker's error comes back through the step, and the run ends with the
 * disk's error naming the folder and the unit, after step 2's committed checkpoint, no file left */
FL_TEST(poff_update_overlap_disk_fails_mid_run) {
    pojob *j = po_new(ZR_SGDM, 2, "deepspeed_stage_3_offload_nvme", "", "fault-upd");
    j->cfg.train.save_interval = 2;
    j->cfg.train.max_steps = 12;
    const unsigned long n0 = fl_fetch_run_count();
    setenv("FITLLM_TEST_NVME_FAIL_AFTER", "375", 1);
    setenv("FITLLM_BACKEND", "cpu", 1);
    fl_status s = fl_comm_threads_run(2, porank, j);
    unsetenv("FITLLM_BACKEND");
    unsetenv("FITLLM_TEST_NVME_FAIL_AFTER");
    char last[800];
    snprintf(last, sizeof last, "%s/step-000002/COMMITTED", j->cfg.out_dir);
    FILE *f = fopen(last, "r");
    FL_CHECKF(s == FL_ERR_IO && strstr(fl_error_message(), "injected") && strstr(fl_error_message(), j->cfg.nvme_path) &&
                  strstr(fl_error_message(), "the optimizer's update of unit 0 (on the fetch worker)") && f != NULL &&
                  j->rec[0].steps >= 2 && j->rec[0].steps < 12 && fl_fetch_run_count() > n0,
              "nvme write failure with the update on the worker: %s (%s), steps %ld, step 2 committed %d, updates %lu",
              fl_status_name(s), fl_error_message(), j->rec[0].steps, f != NULL, fl_fetch_run_count() - n0);
    if (f) fclose(f);
    FL_CHECKF(po_dir_empty(j->cfg.nvme_path), "nvme write failure (update on the worker): files left in %s",
              j->cfg.nvme_path);
    po_free(j);
}

/* `fitllm plan --largest` (fl_plan_largest): this machine (one CPU, 23 GiB of RAM, 60 GB of disk) trains
 * OpenLLaMA-3B fp32 AdamW only with everything on NVMe (its 16 bytes per parameter: 4 parameters + 4 gradients + 8
 * state, the files' bytes, checked against the model's count), not 7B (more than the disk); one 24 GB GPU with
 * 128 GB of host RAM trains 13B in bf16-true with the parameters offloaded to the host, which a 24 GB host cannot
 * hold (it then needs NVMe); a CPU machine without its RAM given is refused by name. */
FL_TEST(poff_plan_largest_model_that_fits) {
    fl_run_config c;
    fl_cfg_defaults(&c, FL_CMD_FINETUNE_FULL);
    c.data.kind = FL_DATA_SYNTHETIC;
    c.train.micro_batch_size = 1;
    c.train.global_batch_size = 1;
    c.train.max_seq_length = 17;
    fl_plan_fit *f = calloc(1, sizeof *f);
    FL_REQUIRE(f);
    fl_plan_machine cpu = {0, (size_t)23 << 30, 60000000000ULL, 1, 0, 0};
    FL_REQUIRE_OK(fl_plan_largest(&c, &cpu, f));
    FL_REQUIRE(f->n == 4 && f->best == 1);
    const fl_plan_fit_row *r = &f->rows[1];
    FL_CHECKF(!strcmp(r->model, "open-llama-3b") && strstr(r->how, "deepspeed_stage_3_offload_nvme") &&
                  r->nvme_peak == 16 * r->n_params && r->device_peak < ((size_t)2 << 30),
              "%s: %s, nvme %zu for %zu parameters, device %zu", r->model, r->how, r->nvme_peak, r->n_params,
              r->device_peak);
    FL_CHECK(f->rows[0].fits && !strcmp(f->rows[0].how, "as given") && !f->rows[2].fits &&
             f->rows[2].nvme_peak == 16 * f->rows[2].n_params && f->rows[2].nvme_peak > cpu.disk);
    snprintf(c.precision, sizeof c.precision, "bf16-true");
    c.train.max_seq_length = 512;
    fl_plan_machine gpu = {24000000000ULL, (size_t)128 << 30, 0, 1, 1, 0};
    FL_REQUIRE_OK(fl_plan_largest(&c, &gpu, f));
    FL_CHECKF(f->best == 3 && strstr(f->rows[3].how, "--offload_param_device cpu") &&
                  f->rows[3].host_peak <= gpu.host_memory && f->rows[3].device_peak <= gpu.device_memory,
              "13B on a 24 GB GPU: %s", f->rows[3].how);
    gpu.host_memory = (size_t)24 << 30;
    FL_REQUIRE_OK(fl_plan_largest(&c, &gpu, f));
    FL_CHECKF(f->best == 3 && strstr(f->rows[3].how, "nvme"), "13B with 24 GiB of host RAM: %s", f->rows[3].how);
    fl_plan_machine bad = {0, 0, 0, 1, 0, 0};
    FL_CHECK(fl_plan_largest(&c, &bad, f) == FL_ERR_INVALID && strstr(fl_error_message(), "--host-memory"));
    free(f);
}

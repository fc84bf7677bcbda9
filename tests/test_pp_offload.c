/* Offload on pipeline-parallel grids (issue 35: --strategy deepspeed_stage_1/2/3_offload, fsdp_cpu_offload,
 * deepspeed_stage_3_offload_nvme with --pipeline_parallel N, GPipe, 1F1B and the interleaved schedule; with
 * --tensor_parallel too: the 3D grid). A stage's (a chunk's) optimizer, and under parameter offload its pieces of the
 * stage's units, are that stage's: the offload relocates them to the host tier (or NVMe files) and runs the
 * elementwise update there with the device's own kernels (cpu, opaque), so the anchor is the same grid without
 * offload: the SAME BITS, every rank's step losses and trained parameters (tests/test_pp_train.c has that grid against
 * one process). Memory per rank: the device's OPTIM 0 (parameter offload: PARAMS and GRADS 0 too), the tier holding
 * what the device run held there; the plan = the measured peaks per rank, device and tiers. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/fs.h"
#include "ddp_ref.h"
#include "fitllm/comm.h"
#include "fitllm/plan.h"
#include "fitllm/train.h"
#include "offload_ref.h"
#include "plan_ref.h"
#include "train/dp.h"
#include "test.h"

typedef struct {
    int dp, tp, pp, chunks; /* the grid; chunks > 1: the interleaved schedule */
    const char *sched, *base, *off;
    int params, nvme; /* parameter offload; in NVMe files */
    int lora;         /* finetune_lora (the adapters' optimizer; dropout 0.1) */
} po_case;

static const char *g_po_backend = "cpu";
/* pp_offload_update_overlap_keeps_the_bits: no clipping (max_norm 0), --offload_update_overlap as given (-1: default) */
static int g_po_noclip, g_po_upd = -1;

static void po_config(fl_run_config *c, const po_case *k, const char *strategy, const char *out, long steps) {
    const int W = k->dp * k->tp * k->pp;
    dr_config(c, k->lora ? DR_LORA : DR_ADAMW, k->dp, W, 1, k->lora, out); /* AdamW with clipping: the norm over the
                                                                           * offloaded pieces */
    c->pipeline_parallel = k->pp;
    c->tensor_parallel = k->tp;
    snprintf(c->pipeline_schedule, sizeof c->pipeline_schedule, "%s", k->sched);
    if (k->chunks > 1) c->pipeline_chunks = k->chunks;
    snprintf(c->strategy, sizeof c->strategy, "%s", strategy);
    c->train.max_steps = steps;
    c->eval.interval = 100;
    if (g_po_noclip) c->train.max_norm = 0;
    if (g_po_upd >= 0) c->offload_update_overlap = g_po_upd;
}

/* the grid of case k under strategy, as threads (resume: a checkpoint folder, "" to save at step 2) */
static dr_job *po_run(const po_case *k, const char *strategy, const char *tag, long steps, const char *resume) {
    dr_job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    char out[760], nv[800];
    snprintf(out, sizeof out, "%s/pp-off-%s-%d-%d-%d-%d-%s-%s", fl_test_tmpdir(), tag, k->dp, k->tp, k->pp, k->chunks,
             k->sched, g_po_backend);
    snprintf(nv, sizeof nv, "%s-nvme", out);
    const int W = k->dp * k->tp * k->pp, nvme = strstr(strategy, "nvme") != NULL;
    if (nvme) {
        char mk[900];
        snprintf(mk, sizeof mk, "mkdir -p '%s'", nv);
        FL_CHECK(system(mk) == 0);
    }
    for (int r = 0; r < W; r++) {
        po_config(&j->cfg[r], k, strategy, out, steps);
        j->cfg[r].train.save_interval = resume ? 2 : 0;
        if (nvme) snprintf(j->cfg[r].nvme_path, sizeof j->cfg[r].nvme_path, "%s", nv);
        if (resume && resume[0]) snprintf(j->cfg[r].resume, sizeof j->cfg[r].resume, "%s", resume);
    }
    /* (the suite's backend, FITLLM_TEST_BACKEND: cpu, ref, cuda-emu; the opaque case sets its own) */
    setenv("FITLLM_BACKEND", strcmp(g_po_backend, "cpu") ? g_po_backend : fl_test_backend_name(), 1);
    const fl_status s = fl_comm_threads_run(W, dr_job_rank, j);
    unsetenv("FITLLM_BACKEND");
    FL_CHECKF(s == FL_OK, "DP %d x TP %d x PP %d %s %s%s: %s", k->dp, k->tp, k->pp, k->sched, strategy,
              resume && resume[0] ? " resumed" : "", j->msg[0]);
    if (nvme) {
        char cmd[900];
        snprintf(cmd, sizeof cmd, "test -z \"$(ls -A '%s')\"", nv);
        FL_CHECKF(system(cmd) == 0, "DP %d x PP %d %s: files left in the NVMe folder", k->dp, k->pp, strategy);
    }
    return s == FL_OK ? j : (free(j), NULL);
}

static void po_what(const po_case *k, char *what, size_t n) {
    snprintf(what, n, "%sDP %d x TP %d x PP %d %s%s%s %s vs %s on %s", k->lora ? "LoRA " : "", k->dp, k->tp, k->pp,
             k->sched,
             k->chunks > 1 ? " x " : "", k->chunks > 1 ? (k->chunks == 2 ? "2 chunks" : "chunks") : "", k->off, k->base,
             strcmp(g_po_backend, "cpu") ? g_po_backend : fl_test_backend_name());
}

/* case k with and without offload: the same bits, the memory moved */
static void po_case_run(const po_case *k, long steps) {
    char what[200];
    po_what(k, what, sizeof what);
    const int W = k->dp * k->tp * k->pp;
    dr_job *b = po_run(k, k->base, "base", steps, NULL), *o = po_run(k, k->off, "off", steps, NULL);
    off_same_bits(o, b, W, what);
    off_memory(o, b, W, k->params, k->nvme, what);
    if (getenv("FL_TEST_VERBOSE") && o && b)
        printf("    %s: the same bits; rank 0's tier OPTIM %zu PARAMS %zu bytes, device peak %zu (without %zu)\n", what,
               (k->nvme ? o->res[0].nvme_peak : o->res[0].host_peak)[FL_TAG_OPTIM],
               (k->nvme ? o->res[0].nvme_peak : o->res[0].host_peak)[FL_TAG_PARAMS], o->res[0].peak_total,
               b->res[0].peak_total);
    off_free(b), off_free(o);
}

static const po_case k_opt[] = {
    {2, 1, 2, 1, "1f1b", "deepspeed_stage_2", "deepspeed_stage_2_offload", 0, 0, 0},
    {2, 1, 2, 1, "gpipe", "deepspeed_stage_1", "deepspeed_stage_1_offload", 0, 0, 0},
    {1, 1, 2, 1, "1f1b", "deepspeed_stage_2", "deepspeed_stage_2_offload", 0, 0, 0}, /* one pipeline: the whole stage */
    {2, 1, 2, 2, "interleaved", "deepspeed_stage_2", "deepspeed_stage_2_offload", 0, 0, 0}, /* each chunk's optimizer */
    {2, 1, 2, 1, "1f1b", "deepspeed_stage_2", "deepspeed_stage_2_offload", 0, 0, 1}, /* LoRA: the adapters' state */
};

/* 2 steps each: the clipped update twice (its norm over the offloaded pieces, summed over the stages) */
FL_TEST(pp_offload_optimizer_keeps_the_bits) {
    for (int i = 0; i < (int)(sizeof k_opt / sizeof k_opt[0]); i++)
        if ((!fl_test_quick() || i == 0 || i == 3 || i == 4) && (!fl_test_asan_light() || i == 0))
            po_case_run(&k_opt[i], 2);
}

/* Parameter offload where FULL_SHARD runs on the stages (the data axis' pieces of each stage's units, the interleaved
 * schedule's each chunk sharded by its own bookkeeping): the pieces of the parameters and gradients in the tier (or
 * NVMe files: none left afterwards), gathered up unit by unit */
static const po_case k_par[] = {
    {2, 1, 2, 1, "1f1b", "deepspeed_stage_3", "deepspeed_stage_3_offload", 0, 0, 0}, /* the optimizer of the pieces */
    {2, 1, 2, 1, "1f1b", "deepspeed_stage_3", "fsdp_cpu_offload", 1, 0, 0},          /* the pieces too */
    {2, 1, 2, 1, "gpipe", "deepspeed_stage_3", "deepspeed_stage_3_offload_nvme", 1, 1, 0},
    {2, 1, 2, 2, "interleaved", "deepspeed_stage_3", "fsdp_cpu_offload", 1, 0, 0},
    {2, 1, 2, 2, "interleaved", "deepspeed_stage_3", "deepspeed_stage_3_offload", 0, 0, 0},
    {2, 1, 2, 2, "interleaved", "deepspeed_stage_3", "deepspeed_stage_3_offload_nvme", 1, 1, 0}, /* each chunk's files */
};

FL_TEST(pp_offload_params_keep_the_bits) {
    for (int i = 0; i < (int)(sizeof k_par / sizeof k_par[0]); i++) /* quick tier: the parameter offloads */
        if ((!fl_test_quick() || i == 1 || i == 2) && (!fl_test_asan_light() || i == 1)) po_case_run(&k_par[i], 2);
}

/* The 3D grid (DP 2 x TP 2 x PP 2, eight thread ranks): each rank's part of its slice of its stage in the tier */
static const po_case k_3d[] = {
    {2, 2, 2, 1, "1f1b", "deepspeed_stage_2", "deepspeed_stage_2_offload", 0, 0, 0},
    {2, 2, 2, 1, "1f1b", "deepspeed_stage_3", "fsdp_cpu_offload", 1, 0, 0},
    {2, 2, 2, 1, "gpipe", "deepspeed_stage_3", "deepspeed_stage_3_offload_nvme", 1, 1, 0}, /* (the full tier) */
    {2, 2, 2, 1, "1f1b", "deepspeed_stage_3", "deepspeed_stage_3_offload", 0, 0, 0}, /* the optimizer of the pieces */
};

FL_TEST(pp_offload_3d_grid_keeps_the_bits) {
    if (!fl_test_asan_budget()) return; /* ASan: the DP x PP cases above, tp_train_threads_offload_* */
    for (int i = 0; i < (fl_test_quick() ? 2 : (int)(sizeof k_3d / sizeof k_3d[0])); i++) po_case_run(&k_3d[i], 2);
}

/* --offload_update_overlap on the stages (no clipping, which it needs): FULL_SHARD's host update of each unit of a
 * stage (of each chunk) queued on the fetch worker as the unit's gradient is final in the last backward, beside the
 * rest of the schedule; the tied table's unit 0 on the end stages after their sum. Elementwise: on = off = the device
 * grid (deepspeed_stage_3), every rank's losses and weights bit for bit. The fsdp counters prove the units were queued
 * (on: every rank's units each step; off: none) */
static const po_case k_upd[] = {
    {2, 1, 2, 1, "1f1b", "deepspeed_stage_3", "fsdp_cpu_offload", 1, 0, 0},           /* tied ends: unit 0 held */
    {2, 1, 2, 2, "interleaved", "deepspeed_stage_3", "deepspeed_stage_3_offload", 0, 0, 0}, /* each chunk's units */
    {1, 1, 2, 1, "gpipe", "deepspeed_stage_3", "deepspeed_stage_3_offload_nvme", 1, 1, 0}, /* one pipeline, NVMe */
    {2, 2, 2, 1, "1f1b", "deepspeed_stage_3", "fsdp_cpu_offload", 1, 0, 0},           /* the 3D grid */
};

FL_TEST(pp_offload_update_overlap_keeps_the_bits) {
    g_po_noclip = 1;
    const int n = fl_test_asan_light() ? 1 : fl_test_quick() ? 2 : (int)(sizeof k_upd / sizeof k_upd[0]);
    for (int i = 0; i < n; i++) {
        const po_case *k = &k_upd[i];
        const int W = k->dp * k->tp * k->pp;
        char what[240];
        po_what(k, what, sizeof what);
        snprintf(what + strlen(what), sizeof what - strlen(what), " (max_norm 0), offload_update_overlap");
        unsigned long q0, q1, q2, e1, e2;
        fl_fsdp_update_counts(NULL, NULL, &q0, NULL);
        g_po_upd = 0; /* (the quick tier: on against the device grid alone) */
        dr_job *off = fl_test_quick() ? NULL : po_run(k, k->off, "upd-off", 2, NULL);
        fl_fsdp_update_counts(NULL, &e1, &q1, NULL);
        g_po_upd = 1;
        dr_job *on = po_run(k, k->off, "upd-on", 2, NULL);
        fl_fsdp_update_counts(NULL, &e2, &q2, NULL);
        dr_job *b = po_run(k, k->base, "upd-base", 2, NULL);
        g_po_upd = -1;
        if (off) off_same_bits(on, off, W, what);
        off_same_bits(on, b, W, what);
        /* every rank's units (each chunk's; a held unit 0 not queued), 2 steps */
        /* (armed on the CPU backend's kernels only: FITLLM_TEST_BACKEND=ref / cuda-emu run the update after the schedule) */
        const int armed = !strcmp(fl_test_backend_name(), "cpu");
        FL_CHECKF(q1 == q0 && (q2 > q1) == armed, "%s: %lu units' updates queued with it false, %lu with it true", what,
                  q1 - q0, q2 - q1);
        for (int r = 0; i == 0 && !fl_test_quick() && on && r < W; r++) /* the plan (its rehearsal arms it too) */
            plan_rank_equals_measured(&on->cfg[r], r, &on->res[r], what);
        if (getenv("FL_TEST_VERBOSE"))
            printf("    %s on = off = %s: the same bits; %lu units' updates queued on the workers, %lu of them done "
                   "before their step's wait\n", what, k->base, q2 - q1, e2 - e1);
        off_free(off), off_free(on), off_free(b);
    }
    g_po_noclip = 0;
}

/* The opaque backend (its memory the host cannot read): the optimizer's update staged through the host tier in
 * pieces of 9973 elements, parameter offload's pieces fetched up from the tier and its gradients sent down; the
 * pipeline's tied sum and clipping norm read the tier's gradients through the host backend */
FL_TEST(pp_offload_opaque) {
    if (!fl_test_asan_budget()) return; /* the opaque backend's copies; ASan: the cpu cases above */
    g_po_backend = "opaque";
    fl_optim_set_offload_piece(9973);
    if (!fl_test_quick()) po_case_run(&k_opt[0], 2); /* (the staged update: tp_train_offload_nccl_standin_opaque) */
    po_case_run(&k_par[1], fl_test_quick() ? 1 : 2);
    fl_optim_set_offload_piece(0);
    g_po_backend = "cpu";
}

/* plan per rank = measured with offload on the stages: every rank's device tags and total, and its host tier's (the
 * optimizer state, the staging, parameter offload's pieces) or NVMe files': DP 2 x PP 2 under each offload, the
 * interleaved schedule's chunks, the 3D grid */
FL_TEST(pp_offload_plan_equals_measured) {
    const po_case *k[] = {&k_opt[0], &k_par[1], &k_par[2], &k_opt[3], &k_par[3], &k_3d[1], &k_par[5], &k_3d[3]};
    const int n = fl_test_asan_light() ? 2 : fl_test_quick() ? 4 : (int)(sizeof k / sizeof k[0]);
    for (int i = 0; i < n; i++) {
        const int W = k[i]->dp * k[i]->tp * k[i]->pp;
        dr_job *j = po_run(k[i], k[i]->off, "plan", 1, NULL);
        char grid[200];
        po_what(k[i], grid, sizeof grid);
        for (int r = 0; j && r < W; r++) {
            const size_t total = plan_rank_equals_measured(&j->cfg[r], r, &j->res[r], grid);
            if (getenv("FL_TEST_VERBOSE") && r == 0)
                printf("    %s rank 0: planned = measured: device %zu, host tier %zu, NVMe %zu bytes\n", grid, total,
                       j->res[r].host_peak_total, j->res[r].nvme_peak_total);
        }
        off_free(j);
    }
}

/* Checkpoints across offload settings (consolidated: one process's files whatever the tiers). A DP 2 x PP 2 run under
 * k->off stopped at step 2 (its state gathered from the tier) and resumed under k->base on the same grid ends on the
 * uninterrupted run's bits (the later step losses and the parameters, every rank: the same arithmetic); resumed in one
 * process (the same global batch in micro-batches of 4: ddp_ref.h's equivalence) its later losses are the
 * uninterrupted run's within ddp_ref.h's 1e-6 relative (the pipeline's tied sum and clipping norm differ from one
 * process's by rounding: tests/test_pp_train.c). */
static int same_bytes(const char *dir_a, const char *dir_b, const char *name) {
    char pa[4400], pb[4400];
    snprintf(pa, sizeof pa, "%s/%s", dir_a, name);
    snprintf(pb, sizeof pb, "%s/%s", dir_b, name);
    size_t na = 0, nb = 0;
    char *x = NULL, *y = NULL;
    const int same = fl_fs_read_file(pa, (size_t)1 << 30, &x, &na) == FL_OK &&
                     fl_fs_read_file(pb, (size_t)1 << 30, &y, &nb) == FL_OK && na == nb && na > 0 && !memcmp(x, y, na);
    free(x), free(y);
    return same;
}

static void po_resume(const po_case *k) {
    char tag[64], from[4096], what[200];
    po_what(k, what, sizeof what);
    snprintf(tag, sizeof tag, "full-%s", k->off);
    dr_job *a = po_run(k, k->off, tag, 4, "");
    if (!a) return;
    snprintf(from, sizeof from, "%.4000s/step-000002", a->cfg[0].out_dir);
    snprintf(tag, sizeof tag, "resumed-%s", k->off);
    dr_job *b = po_run(k, k->base, tag, 4, from);
    const int W = k->dp * k->tp * k->pp;
    for (int r = 0; b && r < W; r++) {
        const dr_rec *x = &a->rec[r], *y = &b->rec[r];
        FL_CHECKF(y->steps == 4 && !memcmp(&x->loss[2], &y->loss[2], 2 * sizeof x->loss[0]), "%s: step 2 resumed under "
                  "%s, rank %d: steps %ld, the later losses (%.9g vs %.9g) differ from the uninterrupted run's", what,
                  k->base, r, y->steps, y->loss[3], x->loss[3]);
    }
    /* the trained model: final/ (consolidated from the stages' owned entries; a stage's unused copies of the entries
     * another stage trains are the checkpoint's after a resume, the initial ones without) */
    FL_CHECKF(b && same_bytes(a->cfg[0].out_dir, b->cfg[0].out_dir, "final/model.safetensors"), "%s: step 2 resumed "
              "under %s: final/model.safetensors differs from the uninterrupted run's", what, k->base);
    /* one process, no offload */
    fl_run_config c;
    char out[760];
    snprintf(out, sizeof out, "%s/pp-off-one-%s", fl_test_tmpdir(), k->off);
    dr_config(&c, DR_ADAMW, k->dp, 1, k->dp, 0, out);
    c.train.max_steps = 4;
    c.eval.interval = 100;
    snprintf(c.resume, sizeof c.resume, "%s", from);
    dr_rec one;
    memset(&one, 0, sizeof one);
    fl_trainer_result res;
    setenv("FITLLM_BACKEND", strcmp(g_po_backend, "cpu") ? g_po_backend : fl_test_backend_name(), 1);
    FL_REQUIRE_OK(fl_trainer_run_comm(&c, NULL, NULL, 0, dr_record, &one, &res));
    unsetenv("FITLLM_BACKEND");
    for (int s = 2; s < 4; s++) {
        const double w = fabs(one.loss[s] - a->rec[0].loss[s]) / fabs(a->rec[0].loss[s]);
        FL_CHECKF(one.steps == 4 && w <= 1e-6, "%s: step 2 resumed in one process, step %d: loss %.9g, uninterrupted "
                  "%.9g (%.3g relative)", what, s + 1, one.loss[s], a->rec[0].loss[s], w);
        if (getenv("FL_TEST_VERBOSE"))
            printf("    %s: step %d resumed in one process %.3g relative\n", what, s + 1, w);
    }
    dr_free(&one);
    off_free(a), off_free(b);
}

FL_TEST(pp_offload_checkpoints_resume_without_offload) {
    po_resume(&k_opt[0]); /* ZeRO-2 offload: the state gathered from the host tier over the axis, then the stages */
    if (!fl_test_asan_light()) po_resume(&k_par[1]); /* fsdp_cpu_offload: the pieces' parameters, state from the tier */
    if (!fl_test_quick()) po_resume(&k_par[3]);      /* the interleaved chunks' pieces, each chunk's bookkeeping */
}

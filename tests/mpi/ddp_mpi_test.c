/* Data-parallel training (DDP, ZeRO-1, ZeRO-2; FULL_SHARD at 2 ranks, HYBRID_SHARD at 4) with the ranks as MPI processes (run by
 * tests/mpi_test.sh under mpirun -np 2, 3 and 4):
 *   fitllm_ddp_mpi_test TMPDIR
 * every scenario of tests/ddp_ref.h trains over MPI; rank 0 then trains the single-process
 * reference and control runs and checks the step losses and parameters (ddp_ref.h explains the
 * bounds), and trains the same DDP run with the ranks as threads in its own process: the MPI run
 * must give the same bits (the threads implementation of fl_comm is MPI's bit-exact twin, and the
 * trainer is deterministic). Every rank must end with the same parameters.
 * Prints "ddp mpi test: N ranks, C checks, F failures" on rank 0; exit status 1 on failure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../zero_ref.h"
#include "fitllm/comm.h"
#include "fitllm/plan.h"

static int g_rank, g_checks, g_fails;

#define CHECK(cond, ...)                                                           \
    do {                                                                           \
        g_checks++;                                                                \
        if (!(cond)) {                                                             \
            g_fails++;                                                             \
            fprintf(stderr, "rank %d: FAIL %s:%d: ", g_rank, __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                                          \
            fputc('\n', stderr);                                                   \
        }                                                                          \
    } while (0)

typedef struct {
    fl_run_config cfg;
    dr_rec rec[8];
} tjob;

static fl_status trank(fl_comm *c, int rank, void *ud) {
    tjob *j = ud;
    return fl_trainer_run_comm(&j->cfg, c, NULL, 0, dr_record, &j->rec[rank], NULL);
}

static void scenario(fl_comm *c, const char *tmp, int sc) {
    int n = fl_comm_size(c);
    char out[600];
    fl_run_config cfg;
    snprintf(out, sizeof out, "%s/%s-mpi", tmp, dr_names[sc]);
    dr_config(&cfg, sc, n, n, 1, 1, out);
    dr_rec mpi = {0};
    fl_trainer_result res;
    fl_status s = fl_trainer_run_comm(&cfg, c, NULL, 0, dr_record, &mpi, &res);
    CHECK(s == FL_OK, "%s: DDP over MPI: %s", dr_names[sc], fl_error_message());
    if (s != FL_OK) return;
    /* every rank ends with rank 0's parameters: compare a checksum of the bits */
    double h[2] = {0, 0};
    for (size_t i = 0; i < mpi.numel; i++) {
        uint32_t b;
        memcpy(&b, &mpi.params[i], 4);
        h[0] += (double)(b % 65521) * (double)(i % 7919 + 1);
        h[1] += mpi.params[i];
    }
    float mine[4] = {(float)h[0], (float)(h[0] - (float)h[0]), (float)h[1], (float)(h[1] - (float)h[1])};
    float *all = calloc((size_t)n * 4, sizeof *all);
    CHECK(all && fl_comm_all_gather(c, mine, all, (size_t)n * 4, FL_F32) == FL_OK, "gathering checksums");
    for (int r = 1; all && r < n; r++)
        CHECK(!memcmp(all, all + 4 * r, 4 * sizeof *all), "%s: rank %d's parameters differ from rank 0's", dr_names[sc], r);
    free(all);
    if (g_rank == 0) {
        fl_run_config rc;
        dr_rec ref = {0}, ref0 = {0}, ctl = {0};
        snprintf(out, sizeof out, "%s/%s-ref", tmp, dr_names[sc]);
        dr_config(&rc, sc, n, 1, 1, 1, out);
        CHECK(fl_trainer_run(&rc, NULL, 0, dr_record, &ref, NULL) == FL_OK, "ref: %s", fl_error_message());
        snprintf(out, sizeof out, "%s/%s-ctl", tmp, dr_names[sc]);
        dr_config(&rc, sc, n, 1, n, 0, out);
        CHECK(fl_trainer_run(&rc, NULL, 0, dr_record, &ctl, NULL) == FL_OK, "control: %s", fl_error_message());
        const dr_rec *pair = &ref;
        if (sc == DR_LORA) {
            snprintf(out, sizeof out, "%s/%s-ref0", tmp, dr_names[sc]);
            dr_config(&rc, sc, n, 1, 1, 0, out);
            CHECK(fl_trainer_run(&rc, NULL, 0, dr_record, &ref0, NULL) == FL_OK, "ref0: %s", fl_error_message());
            pair = &ref0;
        }
        /* rank 0's memory (with the MPI all-reduce's scratch from the pool) is what the planner
         * says for one rank of this run, byte for byte, at every phase */
        fl_plan *pl = calloc(1, sizeof *pl);
        fl_plan_opts po;
        fl_plan_opts_default(&po);
        po.no_suggestions = 1;
        CHECK(pl && fl_plan_run(&cfg, &po, pl) == FL_OK, "plan: %s", fl_error_message());
        if (pl) {
            CHECK(pl->devices == n && pl->peak_total == res.peak_total, "%s: planned peak %zu, rank 0 measured %zu",
                  dr_names[sc], pl->peak_total, res.peak_total);
            for (int k = 0; k < FL_TAG_COUNT; k++)
                CHECK(pl->peak[k] == res.peak[k], "%s: tag %d planned peak %zu, measured %zu", dr_names[sc], k,
                      pl->peak[k], res.peak[k]);
            CHECK(pl->n_phases == res.n_phases, "%s: %d planned phases, %d measured", dr_names[sc], pl->n_phases,
                  res.n_phases);
            for (int i = 0; i < pl->n_phases && i < res.n_phases; i++)
                CHECK(!memcmp(pl->phases[i].cur, res.phases[i].cur, sizeof pl->phases[i].cur) &&
                          pl->phases[i].peak_total == res.phases[i].peak_total,
                      "%s: phase %s differs from the plan", dr_names[sc], res.phases[i].name);
        }
        free(pl);
        if (sc != DR_LORA) { /* N ranks x micro b = one process x micro N*b (the control) */
            double lr = dr_loss_rel(&mpi, &ctl, cfg.train.max_steps);
            CHECK(lr <= 1e-6, "%s at %d ranks vs one process with micro %d: step losses differ by %.3g relative", dr_names[sc], n, 2 * n, lr);
        }
        char why[1024];
        int bad = dr_compare(&mpi, &ref, dr_max_diff(pair, &ctl), dr_floor(&cfg), cfg.train.max_steps, why, sizeof why);
        CHECK(bad == 0, "%s at %d ranks vs one process: %s", dr_names[sc], n, why);
        if (!bad) printf("  %s at %d ranks vs one process: %s\n", dr_names[sc], n, why);
        /* the same run with the ranks as threads: the same bits */
        tjob *j = calloc(1, sizeof *j);
        if (j && n <= 8) {
            snprintf(out, sizeof out, "%s/%s-threads", tmp, dr_names[sc]);
            dr_config(&j->cfg, sc, n, n, 1, 1, out);
            fl_status ts = fl_comm_threads_run(n, trank, j);
            CHECK(ts == FL_OK, "threads: %s", fl_error_message());
            if (ts == FL_OK)
                CHECK(j->rec[0].numel == mpi.numel && !memcmp(j->rec[0].params, mpi.params, mpi.numel * 4) &&
                          !memcmp(j->rec[0].loss, mpi.loss, sizeof mpi.loss),
                      "%s: DDP over MPI and over threads differ in bits", dr_names[sc]);
            for (int r = 0; r < n; r++) dr_free(&j->rec[r]);
        }
        free(j);
        dr_free(&ref);
        dr_free(&ref0);
        dr_free(&ctl);
    }
    dr_free(&mpi);
    CHECK(fl_comm_barrier(c) == FL_OK, "barrier");
}

/* ZeRO (tests/zero_ref.h) over MPI: DDP's bits at this world size, the threads twin's bits, one
 * process within the derived bounds, and each rank's memory equal to the plan for that rank with
 * every peak (the MPI reduction's scratch included). */
typedef struct {
    fl_run_config cfg;
    zr_rec rec[8];
} ztjob;

static fl_status ztrank(fl_comm *c, int rank, void *ud) {
    ztjob *j = ud;
    return fl_trainer_run_comm(&j->cfg, c, NULL, 0, zr_record, &j->rec[rank], NULL);
}

static void zero_scenario(fl_comm *c, const char *tmp, int sc) {
    int n = fl_comm_size(c);
    char out[600];
    static const char *strat[3] = {"ddp", "deepspeed_stage_1", "deepspeed_stage_2"};
    zr_rec rec[3];
    memset(rec, 0, sizeof rec);
    fl_trainer_result res[3];
    fl_run_config cfg[3];
    for (int k = 0; k < 3; k++) {
        snprintf(out, sizeof out, "%s/z-%s-%s", tmp, zr_names[sc], strat[k]);
        zr_config(&cfg[k], sc, n, n, 1, strat[k], NULL, out);
        fl_status s = fl_trainer_run_comm(&cfg[k], c, NULL, 0, zr_record, &rec[k], &res[k]);
        CHECK(s == FL_OK, "%s %s over MPI: %s", zr_names[sc], strat[k], fl_error_message());
        if (s != FL_OK) goto out;
    }
    for (int k = 1; k < 3; k++) {
        CHECK(zr_same(&rec[k], &rec[0]), "%s: ZeRO-%d over MPI differs in bits from DDP over MPI", zr_names[sc], k);
        char why[2048];
        size_t nel = rec[0].nbytes / fl_dtype_size(zr_store_dtype(&cfg[0]));
        int bad = zr_check_memory(&cfg[k], g_rank, n, &res[k], res[0].peak[FL_TAG_OPTIM], nel, 1, why, sizeof why);
        CHECK(bad == 0, "%s ZeRO-%d: %s", zr_names[sc], k, why);
    }
    /* every rank ends with the same bits: a checksum of rank 0's against each rank's */
    {
        double h = 0;
        for (size_t i = 0; i < rec[2].nbytes; i++) h += (double)rec[2].bytes[i] * (double)(i % 7919 + 1);
        float mine[2] = {(float)h, (float)(h - (float)h)}, *all = calloc((size_t)n * 2, sizeof *all);
        CHECK(all && fl_comm_all_gather(c, mine, all, (size_t)n * 2, FL_F32) == FL_OK, "gathering checksums");
        for (int r = 1; all && r < n; r++)
            CHECK(!memcmp(all, all + 2 * r, 2 * sizeof *all), "%s ZeRO-2: rank %d's parameters differ from rank 0's",
                  zr_names[sc], r);
        free(all);
    }
    if (g_rank == 0) {
        fl_run_config rc;
        zr_rec ref = {0}, ctl = {0};
        snprintf(out, sizeof out, "%s/z-%s-ref", tmp, zr_names[sc]);
        zr_config(&rc, sc, n, 1, 1, "auto", NULL, out);
        CHECK(fl_trainer_run(&rc, NULL, 0, zr_record, &ref, NULL) == FL_OK, "ref: %s", fl_error_message());
        snprintf(out, sizeof out, "%s/z-%s-ctl", tmp, zr_names[sc]);
        zr_config(&rc, sc, n, 1, n, "auto", NULL, out);
        CHECK(fl_trainer_run(&rc, NULL, 0, zr_record, &ctl, NULL) == FL_OK, "control: %s", fl_error_message());
        for (int k = 1; k < 3; k++) {
            char why[1024];
            int bad = zr_compare_one_process(&rec[k], &ref, &ctl, &cfg[k], why, sizeof why);
            CHECK(bad == 0, "%s ZeRO-%d at %d ranks vs one process: %s", zr_names[sc], k, n, why);
            if (!bad) printf("  %s ZeRO-%d at %d ranks vs one process: %s\n", zr_names[sc], k, n, why);
        }
        /* the same ZeRO-2 run with the ranks as threads: the same bits */
        ztjob *j = calloc(1, sizeof *j);
        if (j && n <= 8) {
            snprintf(out, sizeof out, "%s/z-%s-threads", tmp, zr_names[sc]);
            zr_config(&j->cfg, sc, n, n, 1, "deepspeed_stage_2", NULL, out);
            fl_status ts = fl_comm_threads_run(n, ztrank, j);
            CHECK(ts == FL_OK, "threads: %s", fl_error_message());
            if (ts == FL_OK) CHECK(zr_same(&j->rec[0], &rec[2]), "%s: ZeRO-2 over MPI and over threads differ in bits",
                                   zr_names[sc]);
            for (int r = 0; r < n; r++) zr_free(&j->rec[r]);
        }
        free(j);
        zr_free(&ref);
        zr_free(&ctl);
    }
out:
    for (int k = 0; k < 3; k++) zr_free(&rec[k]);
    CHECK(fl_comm_barrier(c) == FL_OK, "barrier");
}

/* Accumulation 1: the last micro-batch is the first, so the bucketed reduction's scratch (the
 * embeddings' bucket still in flight) is inside the after_bwd snapshot; every rank's memory must
 * still be the plan's for that rank, byte for byte at every phase (DDP and ZeRO-1 bucketed,
 * ZeRO-2 not). */
static void accum1_memory(fl_comm *c, const char *tmp) {
    int n = fl_comm_size(c);
    static const char *strat[3] = {"ddp", "deepspeed_stage_1", "deepspeed_stage_2"};
    for (int k = 0; k < 3; k++) {
        char out[600];
        fl_run_config cfg;
        snprintf(out, sizeof out, "%s/a1-%s", tmp, strat[k]);
        zr_config(&cfg, ZR_ADAMW, n, n, 1, strat[k], NULL, out);
        cfg.train.global_batch_size = 2 * n; /* micro 2 x accumulation 1 per rank */
        cfg.train.max_steps = 2;
        fl_trainer_result res;
        fl_status s = fl_trainer_run_comm(&cfg, c, NULL, 0, NULL, NULL, &res);
        CHECK(s == FL_OK, "accumulation 1, %s: %s", strat[k], fl_error_message());
        if (s != FL_OK) continue;
        fl_plan *pl = calloc(1, sizeof *pl);
        fl_plan_opts po;
        fl_plan_opts_default(&po);
        po.no_suggestions = 1;
        po.generation = 0;
        po.rank = g_rank;
        CHECK(pl && fl_plan_run(&cfg, &po, pl) == FL_OK, "plan: %s", fl_error_message());
        if (pl) {
            CHECK(pl->peak_total == res.peak_total && !memcmp(pl->peak, res.peak, sizeof pl->peak),
                  "accumulation 1, %s: rank %d planned peak %zu, measured %zu", strat[k], g_rank, pl->peak_total,
                  res.peak_total);
            CHECK(pl->n_phases == res.n_phases, "accumulation 1, %s: phases %d vs %d", strat[k], pl->n_phases,
                  res.n_phases);
            for (int i = 0; i < pl->n_phases && i < res.n_phases; i++)
                CHECK(!memcmp(pl->phases[i].cur, res.phases[i].cur, sizeof pl->phases[i].cur) &&
                          pl->phases[i].peak_total == res.phases[i].peak_total,
                      "accumulation 1, %s: rank %d phase %s differs from the plan", strat[k], g_rank,
                      res.phases[i].name);
        }
        free(pl);
    }
    CHECK(fl_comm_barrier(c) == FL_OK, "barrier");
}

/* --bucket_size over MPI (src/train/dp_bucket.c): DDP's all-reduce slices, ZeRO-2's strided reduce-scatter
 * and FULL_SHARD's per unit in buckets of 4000 bytes end on the unbucketed run's bits, and every rank's
 * memory is the plan for it with buckets at every phase and every peak (the packing and MPI's scratch of
 * one bucket at a time). */
static void bucket_scenario(fl_comm *c, const char *tmp) {
    int n = fl_comm_size(c);
    static const char *strat[3] = {"ddp", "deepspeed_stage_2", "fsdp"};
    for (int k = 0; k < 3; k++) {
        zr_rec rec[2];
        memset(rec, 0, sizeof rec);
        fl_run_config cfg[2];
        fl_trainer_result res[2];
        fl_status s = FL_OK;
        for (int b = 0; b < 2 && s == FL_OK; b++) {
            char out[600];
            snprintf(out, sizeof out, "%s/bk-%s-%d", tmp, strat[k], b);
            zr_config(&cfg[b], ZR_SGDM, n, n, 1, strat[k], NULL, out);
            cfg[b].train.max_steps = 3;
            cfg[b].bucket_size = b ? 4000 : 0;
            s = fl_trainer_run_comm(&cfg[b], c, NULL, 0, zr_record, &rec[b], &res[b]);
            CHECK(s == FL_OK, "buckets, %s: %s", strat[k], fl_error_message());
        }
        if (s == FL_OK) {
            CHECK(zr_same(&rec[1], &rec[0]), "%s over MPI in buckets of 4000 bytes: other bits than unbucketed", strat[k]);
            char why[2048] = "";
            int bad = zr_check_plan(&cfg[1], g_rank, &res[1], 1, why, sizeof why, 0);
            CHECK(bad == 0, "%s in buckets: %s", strat[k], why);
        }
        zr_free(&rec[0]);
        zr_free(&rec[1]);
    }
    CHECK(fl_comm_barrier(c) == FL_OK, "barrier");
}

/* FULL_SHARD over MPI (2 ranks: tests/mpi_test.sh): AdamW with clipping (and 8-bit AdamW with
 * clipping: its cut blocks' scales exchanged over MPI) against one process (the derived bounds), the
 * threads twin's bits, every rank ending with the same parameters, and each rank's memory equal to
 * the plan for it with every peak (the reduce-scatters' MPI scratch included). */
static void fsdp_scenario(fl_comm *c, const char *tmp, int sc) {
    int n = fl_comm_size(c);
    char out[600];
    fl_run_config cfg;
    snprintf(out, sizeof out, "%s/fsdp-mpi%d", tmp, sc);
    zr_config(&cfg, sc, n, n, 1, "fsdp", NULL, out);
    zr_rec rec = {0};
    fl_trainer_result res;
    fl_status s = fl_trainer_run_comm(&cfg, c, NULL, 0, zr_record, &rec, &res);
    CHECK(s == FL_OK, "FULL_SHARD over MPI: %s", fl_error_message());
    if (s == FL_OK) {
        char why[2048];
        int bad = zr_check_fsdp_memory(&cfg, g_rank, n, &res, 1, why, sizeof why);
        CHECK(bad == 0, "FULL_SHARD: %s", why);
        double h = 0;
        for (size_t i = 0; i < rec.nbytes; i++) h += (double)rec.bytes[i] * (double)(i % 7919 + 1);
        float mine[2] = {(float)h, (float)(h - (float)h)}, *all = calloc((size_t)n * 2, sizeof *all);
        CHECK(all && fl_comm_all_gather(c, mine, all, (size_t)n * 2, FL_F32) == FL_OK, "gathering checksums");
        for (int r = 1; all && r < n; r++)
            CHECK(!memcmp(all, all + 2 * r, 2 * sizeof *all), "FULL_SHARD: rank %d's parameters differ from rank 0's", r);
        free(all);
    }
    if (s == FL_OK && g_rank == 0) {
        fl_run_config rc;
        zr_rec ref = {0}, ctl = {0};
        snprintf(out, sizeof out, "%s/fsdp-ref%d", tmp, sc);
        zr_config(&rc, sc, n, 1, 1, "auto", NULL, out);
        CHECK(fl_trainer_run(&rc, NULL, 0, zr_record, &ref, NULL) == FL_OK, "ref: %s", fl_error_message());
        snprintf(out, sizeof out, "%s/fsdp-ctl%d", tmp, sc);
        zr_config(&rc, sc, n, 1, n, "auto", NULL, out);
        CHECK(fl_trainer_run(&rc, NULL, 0, zr_record, &ctl, NULL) == FL_OK, "control: %s", fl_error_message());
        char why[1024];
        int bad = zr_compare_one_process(&rec, &ref, &ctl, &cfg, why, sizeof why);
        CHECK(bad == 0, "FULL_SHARD at %d ranks vs one process: %s", n, why);
        if (!bad) printf("  %s FULL_SHARD at %d ranks vs one process: %s\n", zr_names[sc], n, why);
        ztjob *j = calloc(1, sizeof *j);
        if (j && n <= 8) {
            snprintf(out, sizeof out, "%s/fsdp-threads%d", tmp, sc);
            zr_config(&j->cfg, sc, n, n, 1, "fsdp", NULL, out);
            fl_status ts = fl_comm_threads_run(n, ztrank, j);
            CHECK(ts == FL_OK, "threads: %s", fl_error_message());
            if (ts == FL_OK) CHECK(zr_same(&j->rec[0], &rec), "FULL_SHARD over MPI and over threads differ in bits");
            for (int r = 0; r < n; r++) zr_free(&j->rec[r]);
        }
        free(j);
        zr_free(&ref);
        zr_free(&ctl);
    }
    zr_free(&rec);
    CHECK(fl_comm_barrier(c) == FL_OK, "barrier");
}

/* HYBRID_SHARD over MPI (4 ranks as 2 nodes x 2, and as 4 nodes x 1: --devices per --num_nodes n / per): each rank's
 * memory equal to the plan for it with every peak (the node's reduce-scatter scratch, then the piece's all-reduce
 * scratch across the nodes: at 4 x 1 that one is (4-1)/4 of the unit and decides WORKSPACE's peak), every rank ending
 * with the same parameters, and the threads twin's bits. The bare-instruction prompt (20 tokens) makes the
 * micro-batches differ (tests/test_fsdp.c's hy_data). */
static void hybrid_scenario(fl_comm *c, const char *tmp, int per) {
    int n = fl_comm_size(c);
    char out[600];
    fl_run_config cfg;
    snprintf(out, sizeof out, "%s/hybrid-mpi-%d", tmp, per);
    zr_config(&cfg, ZR_SGDM, n, n, 1, "fsdp", "HYBRID_SHARD", out);
    snprintf(cfg.data.prompt_style, sizeof cfg.data.prompt_style, "default");
    cfg.train.max_seq_length = 20;
    cfg.train.max_steps = 3;
    cfg.train.max_norm = 0.05f;
    cfg.devices = per;
    cfg.num_nodes = n / per;
    zr_rec rec = {0};
    fl_trainer_result res;
    fl_status s = fl_trainer_run_comm(&cfg, c, NULL, 0, zr_record, &rec, &res);
    CHECK(s == FL_OK, "HYBRID_SHARD over MPI: %s", fl_error_message());
    if (s == FL_OK) {
        char why[2048];
        int bad = zr_check_fsdp_memory(&cfg, g_rank, n, &res, 1, why, sizeof why);
        CHECK(bad == 0, "HYBRID_SHARD: %s", why);
        double h = 0;
        for (size_t i = 0; i < rec.nbytes; i++) h += (double)rec.bytes[i] * (double)(i % 7919 + 1);
        float mine[2] = {(float)h, (float)(h - (float)h)}, *all = calloc((size_t)n * 2, sizeof *all);
        CHECK(all && fl_comm_all_gather(c, mine, all, (size_t)n * 2, FL_F32) == FL_OK, "gathering checksums");
        for (int r = 1; all && r < n; r++)
            CHECK(!memcmp(all, all + 2 * r, 2 * sizeof *all), "HYBRID_SHARD: rank %d's parameters differ from rank 0's", r);
        free(all);
    }
    if (s == FL_OK && g_rank == 0) {
        ztjob *j = calloc(1, sizeof *j);
        if (j && n <= 8) {
            j->cfg = cfg;
            snprintf(j->cfg.out_dir, sizeof j->cfg.out_dir, "%s/hybrid-threads-%d", tmp, per);
            fl_status ts = fl_comm_threads_run(n, ztrank, j);
            CHECK(ts == FL_OK, "threads: %s", fl_error_message());
            if (ts == FL_OK) CHECK(zr_same(&j->rec[0], &rec), "HYBRID_SHARD over MPI and over threads differ in bits");
            if (ts == FL_OK) printf("  HYBRID_SHARD at %d nodes x %d ranks: MPI = threads, bit for bit\n", n / per, per);
            for (int r = 0; r < n; r++) zr_free(&j->rec[r]);
        }
        free(j);
    }
    zr_free(&rec);
    CHECK(fl_comm_barrier(c) == FL_OK, "barrier");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: fitllm_ddp_mpi_test TMPDIR (under mpirun)\n");
        return 2;
    }
    const char *tmp = argv[1];
    fl_comm *c;
    if (fl_comm_init(&c, &argc, &argv) != FL_OK) {
        fprintf(stderr, "ddp_mpi_test: %s\n", fl_error_message());
        return 1;
    }
    g_rank = fl_comm_rank(c);
    int n = fl_comm_size(c);
    /* DDP's scenarios at 2 and 4 ranks; ZeRO's at every size (tests/mpi_test.sh: 2, 3 and 4), 16-true's
     * (DDP, ZeRO-1, ZeRO-2: fp16 gradients over MPI, the plan's WORKSPACE with their scratch) at 2 */
    if (n != 3)
        for (int sc = 0; sc < DR_COUNT; sc++) scenario(c, tmp, sc);
    for (int sc = 0; sc < ZR_COUNT; sc++)
        if (sc != ZR_F16 || n == 2) zero_scenario(c, tmp, sc); /* 16-true: one case (make test time) */
    accum1_memory(c, tmp);
    bucket_scenario(c, tmp);
    if (n == 2) fsdp_scenario(c, tmp, ZR_ADAMW);
    if (n == 2) fsdp_scenario(c, tmp, ZR_ADAMW8);
    if (n == 4) hybrid_scenario(c, tmp, 2), hybrid_scenario(c, tmp, 1);
    float f = (float)g_fails, fmax = 0, chk = (float)g_checks, csum = 0;
    if (fl_comm_all_reduce(c, &f, &fmax, 1, FL_F32, FL_COMM_MAX) != FL_OK ||
        fl_comm_all_reduce(c, &chk, &csum, 1, FL_F32, FL_COMM_SUM) != FL_OK) {
        fprintf(stderr, "rank %d: final reduction: %s\n", g_rank, fl_error_message());
        return 1;
    }
    if (g_rank == 0) printf("ddp mpi test: %d ranks, %.0f checks, %.0f failures (most on one rank)\n", n, csum, fmax);
    fl_comm_destroy(c);
    return fmax > 0;
}

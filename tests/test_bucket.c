/* Bounded communication scratch (--bucket_size, src/train/dp_bucket.c): the data-parallel gradient
 * reductions in buckets.
 *
 * Anchor: the same run unbucketed (--bucket_size null, one collective per reduction). Every fl_comm
 * implementation sums element i in rank order whatever the message, so a bucketed run must end on the
 * SAME BITS (every step's loss, the whole parameters) at every bucket size: ZeRO-2's strided
 * reduce-scatter, FULL_SHARD's per unit, DDP's and ZeRO-1's all-reduce slices, at 2 and 3 thread ranks,
 * with buckets of odd sizes (a bucket's pieces cut across tensors, the last bucket's pieces shorter
 * and padded); on the opaque backend the packing moves device memory through the backend's copies and
 * the reductions run on the NCCL stand-in. Memory: the plan of every rank equals the measured with
 * buckets, and the reduction's WORKSPACE (the planned MPI scratch and the packing) falls from growing
 * with the model to under twice the bucket. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/plan.h"
#include "train/dp.h"
#include "test.h"
#include "zero_ref.h"

#define BK_MAX_RANKS 3

typedef struct {
    fl_run_config cfg;
    zr_rec rec[BK_MAX_RANKS];
    fl_trainer_result res[BK_MAX_RANKS];
} bkjob;

static fl_status bkrank(fl_comm *c, int rank, void *ud) {
    bkjob *j = ud;
    return fl_trainer_run_comm(&j->cfg, c, NULL, 0, zr_record, &j->rec[rank], &j->res[rank]);
}

static bkjob *bk_run(int sc, int world, const char *strategy, size_t bucket, const char *backend) {
    bkjob *j = calloc(1, sizeof *j);
    if (!j) abort();
    char out[700];
    snprintf(out, sizeof out, "%s/bucket-%s-%s-%d-%zu-%s", fl_test_tmpdir(), zr_names[sc], strategy, world, bucket,
             backend);
    zr_config(&j->cfg, sc, world, world, 1, strategy, NULL, out);
    j->cfg.bucket_size = bucket;
    /* under ASan in the quick tier 3 steps instead of 8 (AdamW) / 5: every step reduces through the buckets, and the
     * third still runs the validation after it (the release pass runs them all; make test's time) */
    if (fl_test_asan_light()) j->cfg.train.max_steps = 3;
    setenv("FITLLM_BACKEND", backend, 1);
    fl_status s = fl_comm_threads_run(world, bkrank, j);
    unsetenv("FITLLM_BACKEND");
    FL_CHECKF(s == FL_OK, "%s at %d ranks, bucket %zu, %s: %s", strategy, world, bucket, backend, fl_error_message());
    if (s != FL_OK) {
        for (int r = 0; r < BK_MAX_RANKS; r++) zr_free(&j->rec[r]);
        free(j);
        return NULL;
    }
    return j;
}

static void bk_free(bkjob *j) {
    for (int r = 0; j && r < BK_MAX_RANKS; r++) zr_free(&j->rec[r]);
    free(j);
}

/* the strategy at `world` ranks with each bucket size against the unbucketed run: the bits on every rank,
 * and (cpu) every rank's plan = measured */
static void bk_case(int sc, int world, const char *strategy, const char *backend, const size_t *buckets, int nb) {
    bkjob *base = bk_run(sc, world, strategy, 0, backend);
    for (int b = 0; base && b < nb; b++) {
        bkjob *j = bk_run(sc, world, strategy, buckets[b], backend);
        for (int r = 0; j && r < world; r++) {
            FL_CHECKF(zr_same(&j->rec[r], &base->rec[r]), "%s %s at %d ranks on %s, bucket %zu bytes, rank %d: other "
                      "bits than unbucketed", zr_names[sc], strategy, world, backend, buckets[b], r);
            if (strcmp(backend, "cpu")) continue;
            char why[2048] = "";
            int bad = zr_check_plan(&j->cfg, r, &j->res[r], 0, why, sizeof why, 0);
            FL_CHECKF(bad == 0, "%s %s at %d ranks, bucket %zu: %s", zr_names[sc], strategy, world, buckets[b], why);
        }
        bk_free(j);
    }
    bk_free(base);
}

FL_TEST(bucket_zero2_and_full_shard_keep_the_bits) {
    /* micro: 260032 elements (1 MiB fp32); 4000 bytes: pieces of 333 (2 ranks) / 250 (3) elements, hundreds
     * of buckets; 999 bytes: pieces of 83 / 62, not a divisor of anything; 64 KiB: a few buckets */
    const size_t bk[3] = {4000, 999, 64 << 10};
    /* under ASan in the quick tier the 999-byte buckets alone where the release pass runs several sizes: the same
     * packing code, its odd piece sizes the ones that end off any boundary (make test's time) */
    const int asan1 = fl_test_asan_light();
    bk_case(ZR_ADAMW, 2, "deepspeed_stage_2", "cpu", asan1 ? bk + 1 : bk, asan1 ? 1 : 3);
    const int light = fl_test_quick(); /* the quick tier (both passes): each strategy and gradient width once */
    if (!light) bk_case(ZR_SGDM, 3, "deepspeed_stage_2", "cpu", bk, 2);
    bk_case(ZR_BF16, 3, "deepspeed_stage_2", "cpu", bk + 1, 1); /* BF16 gradients: 2-byte elements */
    bk_case(ZR_ADAMW8, 2, "deepspeed_stage_2", "cpu", bk, 1);    /* + the 8-bit halo after the buckets */
    /* per unit (accumulation 2: the add path) */
    bk_case(ZR_ADAMW, 3, "fsdp", "cpu", asan1 ? bk + 1 : bk, asan1 ? 1 : 2);
    if (!light) bk_case(ZR_BF16, 2, "fsdp", "cpu", bk + 1, 1);
    bk_case(ZR_SGDM, 3, "deepspeed_stage_3_offload", "cpu", bk, 1);
}

FL_TEST(bucket_ddp_and_zero1_slices_keep_the_bits) {
    const size_t bk[2] = {4000, 999};
    bk_case(ZR_ADAMW, 2, "ddp", "cpu", bk, 2);
    bk_case(ZR_SGDM, 3, "deepspeed_stage_1", "cpu", bk, 1);
}

/* device memory: the packing through the backend's copies, the reductions on the NCCL stand-in */
FL_TEST(bucket_opaque_two_ranks_keep_the_bits) {
    const size_t bk[1] = {64 << 10};
    bk_case(ZR_ADAMW, 2, "deepspeed_stage_2", "opaque", bk, 1);
    /* make test time: under ASan in the quick tier ZeRO-2 alone (FULL_SHARD over the stand-in on opaque runs under
     * ASan in shard_nccl_opaque_t5_fsdp_zero2_equal_cpu_bits, FULL_SHARD's buckets on cpu in the test above) */
    if (!fl_test_asan_light()) bk_case(ZR_ADAMW, 2, "fsdp", "opaque", bk, 1);
}

/* The plan of a ZeRO-2 rank over MPI: the reduce-scatter's WORKSPACE is (N-1)/N of the gradients
 * unbucketed, and under twice the bucket bucketed (the packing (N+1) P and MPI's (N-1) P scratch). */
FL_TEST(bucket_plan_bounds_the_reduction_workspace) {
    const size_t n = 260032, es = 4, B = 16 << 10;
    for (int world = 2; world <= 4; world += 2) {
        size_t ws[2];
        for (int k = 0; k < 2; k++) {
            fl_run_config c;
            char out[700];
            snprintf(out, sizeof out, "%s/bucket-plan", fl_test_tmpdir());
            zr_config(&c, ZR_ADAMW, world, world, 1, "deepspeed_stage_2", NULL, out);
            c.bucket_size = k ? B : 0;
            fl_plan_opts po;
            fl_plan_opts_default(&po);
            po.no_suggestions = 1;
            po.generation = 0;
            fl_plan *pl = calloc(1, sizeof *pl);
            FL_REQUIRE(pl != NULL);
            FL_REQUIRE_OK(fl_plan_run(&c, &po, pl));
            ws[k] = 0;
            for (int i = 0; i < pl->n_phases; i++)
                if (!strcmp(pl->phases[i].name, "after_reduce")) {
                    size_t cur = 0;
                    for (int t = 0; t < FL_TAG_COUNT; t++) cur += pl->phases[i].cur[t];
                    ws[k] = pl->phases[i].peak_total - cur; /* what the reduction held above the phase's end */
                }
            free(pl);
        }
        size_t off, len;
        fl_comm_chunk(n, world, 0, &off, &len);
        FL_CHECKF(ws[0] == (size_t)(world - 1) * len * es, "%d ranks unbucketed: the reduction held %zu bytes, MPI's "
                  "scratch is %zu", world, ws[0], (size_t)(world - 1) * len * es);
        FL_CHECKF(ws[1] > 0 && ws[1] < 2 * B && ws[1] == fl_dp_rs_workspace(n, world, FL_F32, B) +
                  (size_t)(world - 1) * (B / ((size_t)(world + 1) * es)) * es,
                  "%d ranks, bucket %zu: the reduction held %zu bytes (packing %zu + MPI scratch)", world, B, ws[1],
                  fl_dp_rs_workspace(n, world, FL_F32, B));
    }
}

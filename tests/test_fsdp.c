/* FSDP FULL_SHARD / ZeRO-3 (--strategy fsdp, deepspeed_stage_3) with the ranks as threads of this
 * process: against one process training the same global batch, against ZeRO-2 bit for bit where
 * the reduction order allows (accumulation 1), memory per rank (exact, and as planned), the
 * consolidated checkpoints, and what is refused. tests/zero_ref.h explains the scenarios and the
 * bounds; tests/mpi/ddp_mpi_test.c runs one case under mpirun. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/checkpoint.h"
#include "test.h"
#include "zero_ref.h"

#define FT_MAX_RANKS 4

typedef struct {
    fl_run_config cfg;
    zr_rec rec[FT_MAX_RANKS];
    fl_trainer_result res[FT_MAX_RANKS];
    fl_status st[FT_MAX_RANKS];
    char msg[FT_MAX_RANKS][600];
} fjob;

static fl_status frank(fl_comm *c, int rank, void *ud) {
    fjob *j = ud;
    fl_status s = fl_trainer_run_comm(&j->cfg, c, NULL, 0, zr_record, &j->rec[rank], &j->res[rank]);
    j->st[rank] = s;
    if (s != FL_OK) snprintf(j->msg[rank], sizeof j->msg[rank], "%s", fl_error_message());
    return s;
}

static void free_fjob(fjob *j) {
    if (!j) return;
    for (int r = 0; r < FT_MAX_RANKS; r++) zr_free(&j->rec[r]);
    free(j);
}

/* Scenario sc at `world` ranks under `strategy`; accum1: micro 2 x accumulation 1 per rank (else
 * zero_ref.h's accumulation 2). Every rank must end with the same bits. */
static fjob *frun(int sc, int world, const char *strategy, const char *sharding, int accum1, const char *tag) {
    fjob *j = calloc(1, sizeof *j);
    if (!j) abort();
    char out[700];
    snprintf(out, sizeof out, "%s/f-%s-%s%d", fl_test_tmpdir(), zr_names[sc], tag, world);
    zr_config(&j->cfg, sc, world, world, 1, strategy, sharding, out);
    if (accum1) j->cfg.train.global_batch_size = 2 * world;
    fl_status s = fl_comm_threads_run(world, frank, j);
    FL_CHECKF(s == FL_OK, "%s %s at %d ranks: %s", zr_names[sc], tag, world, fl_error_message());
    if (s != FL_OK) return j;
    for (int r = 1; r < world; r++)
        FL_CHECKF(zr_same(&j->rec[r], &j->rec[0]), "%s %s: rank %d's parameters or losses differ from rank 0's",
                  zr_names[sc], tag, r);
    return j;
}

/* FULL_SHARD against one process with the same global batch (zero_ref.h's derived bounds) and its
 * memory per rank: PARAMS, GRADS and OPTIM the rank's shard of DDP's, the plan to the byte. */
static void scenario(int sc, int world) {
    fjob *f = frun(sc, world, "fsdp", NULL, 0, "fsdp");
    fjob *ddp = frun(sc, world, "ddp", NULL, 0, "ddp");
    if (f->st[0] != FL_OK || ddp->st[0] != FL_OK) goto out;
    fl_run_config c;
    char out[700];
    zr_rec ref = {0}, ctl = {0};
    snprintf(out, sizeof out, "%s/f-%s-ref%d", fl_test_tmpdir(), zr_names[sc], world);
    zr_config(&c, sc, world, 1, 1, "auto", NULL, out);
    FL_REQUIRE_OK(fl_trainer_run(&c, NULL, 0, zr_record, &ref, NULL));
    snprintf(out, sizeof out, "%s/f-%s-ctl%d", fl_test_tmpdir(), zr_names[sc], world);
    zr_config(&c, sc, world, 1, world, "auto", NULL, out);
    FL_REQUIRE_OK(fl_trainer_run(&c, NULL, 0, zr_record, &ctl, NULL));
    char why[2048];
    int bad = zr_compare_one_process(&f->rec[0], &ref, &ctl, &f->cfg, why, sizeof why);
    FL_CHECKF(bad == 0, "%s FULL_SHARD at %d ranks vs one process: %s", zr_names[sc], world, why);
    if (getenv("FL_TEST_VERBOSE")) printf("    %s FULL_SHARD at %d ranks: %s\n", zr_names[sc], world, why);
    size_t es = sc == ZR_BF16 ? 2 : 4, n = ddp->rec[0].nbytes / es;
    for (int r = 0; r < world; r++) {
        bad = zr_check_fsdp_memory(&f->cfg, r, world, &f->res[r], &ddp->res[0], n, 0, why, sizeof why);
        FL_CHECKF(bad == 0, "%s FULL_SHARD at %d ranks: %s", zr_names[sc], world, why);
    }
    zr_free(&ref);
    zr_free(&ctl);
out:
    free_fjob(f);
    free_fjob(ddp);
}

FL_TEST(fsdp_threads_sgd_momentum_2_and_3_ranks) {
    scenario(ZR_SGDM, 2);
    scenario(ZR_SGDM, 3);
}

FL_TEST(fsdp_threads_adamw_clip_2_and_3_ranks) {
    scenario(ZR_ADAMW, 2);
    scenario(ZR_ADAMW, 3);
}

FL_TEST(fsdp_threads_bf16_true_2_and_3_ranks) {
    scenario(ZR_BF16, 2);
    scenario(ZR_BF16, 3);
}

/* With accumulation 1 each element's reduced gradient is the same rank-order sum under FULL_SHARD
 * and ZeRO-2, and the update is elementwise on the same bits: the same parameters and losses bit
 * for bit, in every precision, when no clipping norm (summed over a different partition of the
 * elements) enters. bf16-mixed too: the gathered unit's bf16 copy is the RNE of the same fp32 bits. */
FL_TEST(fsdp_threads_accum1_equals_zero2_bits) {
    static const struct { int sc; const char *prec; int world; } k[] = {
        {ZR_SGDM, "32-true", 2}, {ZR_SGDM, "32-true", 3}, {ZR_SGDM, "bf16-mixed", 3}, {ZR_BF16, "bf16-true", 2}};
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        fjob *j[2];
        for (int z = 0; z < 2; z++) {
            j[z] = calloc(1, sizeof *j[z]);
            FL_REQUIRE(j[z] != NULL);
            char out[700];
            snprintf(out, sizeof out, "%s/f-a1-%zu-%d", fl_test_tmpdir(), i, z);
            zr_config(&j[z]->cfg, k[i].sc, k[i].world, k[i].world, 1, z ? "deepspeed_stage_3" : "deepspeed_stage_2",
                      NULL, out);
            j[z]->cfg.train.global_batch_size = 2 * k[i].world;
            j[z]->cfg.train.max_steps = 4;
            if (k[i].sc == ZR_BF16) j[z]->cfg.optimizer.weight_decay = 0.0f;
            snprintf(j[z]->cfg.precision, sizeof j[z]->cfg.precision, "%s", k[i].prec);
            FL_CHECKF(fl_comm_threads_run(k[i].world, frank, j[z]) == FL_OK, "%s %s: %s", k[i].prec,
                      z ? "ZeRO-3" : "ZeRO-2", fl_error_message());
        }
        FL_CHECKF(zr_same(&j[0]->rec[0], &j[1]->rec[0]), "%s %s at %d ranks, accumulation 1: FULL_SHARD differs from "
                  "ZeRO-2 in bits", zr_names[k[i].sc], k[i].prec, k[i].world);
        free_fjob(j[0]);
        free_fjob(j[1]);
    }
}

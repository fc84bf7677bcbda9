/* fp16's overflow path under every layout, through the test-only fault hook (fitllm/fault.h): an overflow injected
 * into ONE rank's gradients at step 2 of a 16-mixed run (+inf in its first gradient element before the backward,
 * as if its backward had overflowed) must be found by the layout's check (DDP: the reduction carries it; TP: the
 * group's shared verdict; PP / interleaved: the stages'; 3D: all of them) and skip that step on EVERY rank: the
 * scale backs off alike (65536 -> 32768, torch's backoff 0.5), each rank reports one skipped step, and the losses of
 * every step equal one process's with the same injection within ddp_ref.h's 1e-6 relative bar (fp32
 * reassociation; a rank that updated while another skipped moves its weights by a whole AdamW step, ~lr = 3e-3 per
 * element, and its group's losses by far more than the bar from step 3 on). The anchor: one process without the
 * fault skips nothing (micro's fp16 gradients stay finite at the default scale), so the skip is the hook's. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ddp_ref.h"
#include "fitllm/comm.h"
#include "fitllm/fault.h"
#include "test.h"

enum { FF_STEPS = 4, FF_AT = 2 };

typedef struct { int dp, tp, pp, chunks; const char *sched; int rank, one; } ff_grid; /* one: one process */

static void ff_config(fl_run_config *c, const ff_grid *g, int W, const char *out) {
    dr_config(c, DR_ADAMW, g->dp, W, 1, 0, out);
    snprintf(c->precision, sizeof c->precision, "16-mixed");
    c->train.max_steps = FF_STEPS;
    c->eval.interval = 100;
    c->eval.final_validation = 0;
    c->tensor_parallel = g->tp;
    c->pipeline_parallel = g->pp;
    if (g->pp > 1) snprintf(c->pipeline_schedule, sizeof c->pipeline_schedule, "%s", g->sched);
    if (g->chunks > 1) c->pipeline_chunks = g->chunks;
}

/* the grid g (dp x tp x pp ranks as threads; g->one: one process of dp ranks' global batch), the fault armed at
 * (g->rank, FF_AT) (rank -2: none) */
static dr_job *ff_run(const ff_grid *g) {
    dr_job *j = calloc(1, sizeof *j);
    FL_REQUIRE_R(j != NULL, NULL);
    const int W = g->one ? 1 : g->dp * g->tp * g->pp;
    char out[700];
    snprintf(out, sizeof out, "%s/ff-dp%d-tp%d-pp%d-v%d-w%d-r%d", fl_test_tmpdir(), g->dp, g->tp, g->pp, g->chunks, W, g->rank);
    for (int r = 0; r < W; r++) ff_config(&j->cfg[r], g, W, out);
    fl_fault_clear();
    if (g->rank >= -1) FL_REQUIRE_R(fl_fault_set(FL_FAULT_GRAD_OVERFLOW, g->rank, FF_AT) == FL_OK, NULL);
    setenv("FITLLM_BACKEND", fl_test_backend_name(), 1);
    fl_status s = W > 1 ? fl_comm_threads_run(W, dr_job_rank, j) : dr_job_rank(NULL, 0, j);
    unsetenv("FITLLM_BACKEND");
    fl_fault_clear();
    FL_CHECKF(s == FL_OK, "16-mixed DP %d x TP %d x PP %d (%s x %d) with an overflow at rank %d: %s", g->dp, g->tp, g->pp,
              g->sched ? g->sched : "-", g->chunks, g->rank, j->msg[0]);
    return j;
}

static void ff_free(dr_job *j) {
    for (int r = 0; j && r < DR_JOB_RANKS; r++) dr_free(&j->rec[r]);
    free(j);
}

FL_TEST(fp16_fault_overflow_skips_on_every_rank) {
    /* the grids; rank: the one injected (not the loss's stage under PP: the verdict must travel) */
    const ff_grid g[] = {{2, 1, 1, 1, NULL, 1, 0},       {1, 2, 1, 1, NULL, 1, 0},       {1, 1, 2, 1, "1f1b", 0, 0},
                         {1, 1, 2, 2, "interleaved", 1, 0}, {2, 2, 2, 1, "1f1b", 5, 0},
                         {1, 2, 2, 2, "interleaved", 3, 0}}; /* TP inside interleaved: the chunks', group's, stages' */
    /* one process (the global batch of DP 1 and DP 2): without the fault, and with it (rank 0 is the process) */
    dr_job *clean = ff_run(&(ff_grid){1, 1, 1, 1, NULL, -2, 1});
    dr_job *one[3] = {NULL, ff_run(&(ff_grid){1, 1, 1, 1, NULL, 0, 1}), ff_run(&(ff_grid){2, 1, 1, 1, NULL, 0, 1})};
    FL_REQUIRE(clean && one[1] && one[2]);
    FL_CHECKF(clean->res[0].skipped_steps == 0 && clean->res[0].loss_scale == 65536.0f,
              "one process without the fault: %ld skipped steps, scale %g (the anchor: none, 65536)",
              clean->res[0].skipped_steps, clean->res[0].loss_scale);
    for (int d = 1; d <= 2; d++) {
        const fl_trainer_result *r = &one[d]->res[0];
        FL_CHECKF(r->skipped_steps == 1 && r->loss_scale == 32768.0f, "one process (DP %d's batch) with the fault: %ld "
                  "skipped steps, scale %g (want 1, 32768)", d, r->skipped_steps, r->loss_scale);
    }
    /* before the fault the same bits; after it the skipped update shows */
    FL_CHECK(one[1]->rec[0].loss[0] == clean->rec[0].loss[0] && one[1]->rec[0].loss[FF_AT - 1] == clean->rec[0].loss[FF_AT - 1]);
    FL_CHECK(one[1]->rec[0].loss[FF_AT] != clean->rec[0].loss[FF_AT]);
    for (size_t k = 0; k < sizeof g / sizeof g[0]; k++) {
        if (fl_test_asan_light() && k != 3 && k != 4) continue; /* ASan: interleaved and the 3D grid (every verdict; TP
                                                                  * inside interleaved: the release pass) */
        dr_job *j = ff_run(&g[k]);
        FL_REQUIRE(j != NULL);
        const int W = g[k].dp * g[k].tp * g[k].pp;
        const dr_rec *ref = &one[g[k].dp]->rec[0];
        double worst = 0;
        for (int r = 0; r < W; r++) {
            const double w = dr_loss_rel(&j->rec[r], ref, FF_STEPS);
            if (w > worst) worst = w;
            FL_CHECKF(j->res[r].skipped_steps == 1 && j->res[r].loss_scale == 32768.0f && w <= 1e-6,
                      "DP %d x TP %d x PP %d (%s x %d), overflow at rank %d step %d: rank %d skipped %ld steps, scale %g "
                      "(one process: 1, 32768), losses %.3g relative from one process's", g[k].dp, g[k].tp, g[k].pp,
                      g[k].sched ? g[k].sched : "-", g[k].chunks, g[k].rank, FF_AT, r, j->res[r].skipped_steps,
                      j->res[r].loss_scale, w);
        }
        if (getenv("FL_TEST_VERBOSE"))
            printf("    16-mixed DP %d x TP %d x PP %d (%s x %d), overflow at rank %d: 1 skip on all %d ranks, losses "
                   "within %.3g of one process\n", g[k].dp, g[k].tp, g[k].pp, g[k].sched ? g[k].sched : "-",
                   g[k].chunks, g[k].rank, W, worst);
        ff_free(j);
    }
    ff_free(clean), ff_free(one[1]), ff_free(one[2]);
}

/* FITLLM_FAULT_GRAD_OVERFLOW (the CLI's one way in): STEP[:RANK], comma-separated; anything else refused naming it */
FL_TEST(fp16_fault_env_and_table) {
    fl_fault_clear();
    setenv("FITLLM_FAULT_GRAD_OVERFLOW", "2:1,5", 1);
    FL_REQUIRE_OK(fl_fault_from_env());
    FL_CHECK(fl_fault_due(FL_FAULT_GRAD_OVERFLOW, 1, 2) && !fl_fault_due(FL_FAULT_GRAD_OVERFLOW, 0, 2));
    FL_CHECK(fl_fault_due(FL_FAULT_GRAD_OVERFLOW, 0, 5) && fl_fault_due(FL_FAULT_GRAD_OVERFLOW, 7, 5));
    FL_CHECK(!fl_fault_due(FL_FAULT_GRAD_OVERFLOW, 1, 3));
    const char *bad[] = {"x", "2:", "0", "2,", ",2", "2:-1", "2:1:3", "-3", "99999999999999999999"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fl_fault_clear();
        setenv("FITLLM_FAULT_GRAD_OVERFLOW", bad[i], 1);
        const fl_status s = fl_fault_from_env();
        FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "FITLLM_FAULT_GRAD_OVERFLOW"),
                  "'%s' accepted (or the message does not name the variable: %s)", bad[i], fl_error_message());
    }
    unsetenv("FITLLM_FAULT_GRAD_OVERFLOW");
    fl_fault_clear();
    FL_CHECK(fl_fault_from_env() == FL_OK && !fl_fault_due(FL_FAULT_GRAD_OVERFLOW, 0, 1));
    for (int i = 0; i < FL_FAULT_MAX; i++) FL_REQUIRE_OK(fl_fault_set(FL_FAULT_GRAD_OVERFLOW, -1, i + 1));
    FL_CHECK(fl_fault_set(FL_FAULT_GRAD_OVERFLOW, -1, 9) == FL_ERR_INVALID);
    FL_CHECK(fl_fault_set(FL_FAULT_GRAD_OVERFLOW, -2, 1) == FL_ERR_INVALID);
    fl_fault_clear();
}

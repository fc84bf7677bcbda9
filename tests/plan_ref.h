/* The planner against a measured multi-rank run, shared by the grid tests (tests/test_tp_train.c: DP x TP,
 * tests/test_pp_train.c: DP x PP): rank `rank`'s plan of cfg (thread ranks, no suggestions, no generation)
 * must equal that rank's measured peaks, tag by tag and in total (the device, and the offload's host tier and NVMe
 * files). `grid` names the run in the messages. */
#ifndef FITLLM_TESTS_PLAN_REF_H
#define FITLLM_TESTS_PLAN_REF_H

#include <stdlib.h>

#include "fitllm/plan.h"
#include "test.h"

/* Returns the plan's peak total (0 when planning failed: the failure is recorded). */
static size_t plan_rank_equals_measured(const fl_run_config *cfg, int rank, const fl_trainer_result *res,
                                        const char *grid) {
    fl_plan_opts po;
    fl_plan_opts_default(&po);
    po.no_suggestions = 1;
    po.generation = 0;
    po.comm_threads = 1;
    po.rank = rank;
    fl_plan *pl = calloc(1, sizeof *pl);
    FL_REQUIRE_R(pl != NULL, 0);
    fl_status s = fl_plan_run(cfg, &po, pl);
    FL_CHECKF(s == FL_OK, "%s rank %d: plan -> %s: %s", grid, rank, fl_status_name(s), fl_error_message());
    size_t total = 0;
    if (s == FL_OK) {
        for (int k = 0; k < FL_TAG_COUNT; k++)
            FL_CHECKF(pl->peak[k] == res->peak[k], "%s rank %d: tag %s planned %zu, measured %zu", grid, rank,
                      fl_mem_tag_name((fl_mem_tag)k), pl->peak[k], res->peak[k]);
        FL_CHECKF(pl->peak_total == res->peak_total, "%s rank %d: peak planned %zu, measured %zu", grid, rank,
                  pl->peak_total, res->peak_total);
        /* offload: the host tier and the NVMe files too (0 = 0 without) */
        for (int k = 0; k < FL_TAG_COUNT; k++)
            FL_CHECKF(pl->host_peak[k] == res->host_peak[k] && pl->nvme_peak[k] == res->nvme_peak[k], "%s rank %d: tag "
                      "%s host tier planned %zu, measured %zu; NVMe planned %zu, measured %zu", grid, rank,
                      fl_mem_tag_name((fl_mem_tag)k), pl->host_peak[k], res->host_peak[k], pl->nvme_peak[k],
                      res->nvme_peak[k]);
        FL_CHECKF(pl->host_peak_total == res->host_peak_total && pl->nvme_peak_total == res->nvme_peak_total, "%s rank "
                  "%d: host tier peak planned %zu, measured %zu; NVMe %zu, %zu", grid, rank, pl->host_peak_total,
                  res->host_peak_total, pl->nvme_peak_total, res->nvme_peak_total);
        total = pl->peak_total;
    }
    free(pl);
    return total;
}

#endif

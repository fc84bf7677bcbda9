/* Offload against the same grid without it, shared by the grid tests (tests/test_tp_train.c: DP x TP,
 * tests/test_pp_offload.c: DP x PP and DP x TP x PP): the runs' every rank logs the same step losses and ends on the
 * same trained parameters (the same bits), and what moved off the device is in the tier (the host's or the NVMe
 * files'): the device's OPTIM 0 and the tier's the device run's, under parameter offload PARAMS and GRADS too. */
#ifndef FITLLM_TESTS_OFFLOAD_REF_H
#define FITLLM_TESTS_OFFLOAD_REF_H

#include <stdlib.h>
#include <string.h>

#include "ddp_ref.h"
#include "test.h"

static void off_free(dr_job *j) {
    for (int r = 0; j && r < DR_JOB_RANKS; r++) dr_free(&j->rec[r]);
    free(j);
}

/* every rank's losses and trained parameters: the same bits */
static void off_same_bits(const dr_job *a, const dr_job *b, int W, const char *what) {
    for (int r = 0; a && b && r < W; r++) {
        const dr_rec *x = &a->rec[r], *y = &b->rec[r];
        FL_CHECKF(x->steps == y->steps && x->steps > 0 && !memcmp(x->loss, y->loss, sizeof x->loss), "%s rank %d: the "
                  "step losses differ (step 1: %.9g vs %.9g)", what, r, x->loss[0], y->loss[0]);
        FL_CHECKF(x->numel == y->numel && x->params && y->params && !memcmp(x->params, y->params, x->numel * 4),
                  "%s rank %d: the trained parameters differ from the run without offload (%zu vs %zu elements)", what,
                  r, x->numel, y->numel);
    }
}

/* what moved off the device (off) against the device run (base), rank by rank */
static void off_memory(const dr_job *off, const dr_job *base, int W, int params, int nvme, const char *what) {
    for (int r = 0; off && base && r < W; r++) {
        const fl_trainer_result *a = &off->res[r], *b = &base->res[r];
        const size_t *tier = nvme ? a->nvme_peak : a->host_peak;
        FL_CHECKF(b->peak[FL_TAG_OPTIM] > 0 && a->peak[FL_TAG_OPTIM] == 0 &&
                      tier[FL_TAG_OPTIM] == b->peak[FL_TAG_OPTIM],
                  "%s rank %d: device OPTIM %zu (without offload %zu), the tier's %zu", what, r, a->peak[FL_TAG_OPTIM],
                  b->peak[FL_TAG_OPTIM], tier[FL_TAG_OPTIM]);
        if (params)
            FL_CHECKF(a->peak[FL_TAG_PARAMS] == 0 && a->peak[FL_TAG_GRADS] == 0 &&
                      tier[FL_TAG_PARAMS] == b->peak[FL_TAG_PARAMS] && tier[FL_TAG_GRADS] == b->peak[FL_TAG_GRADS],
                      "%s rank %d: device PARAMS %zu GRADS %zu, the tier's %zu %zu (without offload: %zu %zu)", what, r,
                      a->peak[FL_TAG_PARAMS], a->peak[FL_TAG_GRADS], tier[FL_TAG_PARAMS], tier[FL_TAG_GRADS],
                      b->peak[FL_TAG_PARAMS], b->peak[FL_TAG_GRADS]);
    }
}

#endif

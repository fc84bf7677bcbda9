/* --fsdp.backward_prefetch (the course's FSDP benchmark toggles it): BACKWARD_PRE (the default) posts the next
 * unit's all-gather in backward while the current one computes; off (PyTorch's None) gathers each unit when its
 * backward starts. The switch moves no bit (the same losses and parameters: the gathers copy bits either way) and
 * takes one block's gathered parameters off the GATHER peak (the backward's prefetched block), which the plan
 * predicts (it runs the same code). The ranks are threads of this process, as in tests/test_fsdp.c. */
#include <string.h>

#include "fitllm/plan.h"
#include "test.h"
#include "zero_ref.h"

typedef struct {
    fl_run_config cfg;
    zr_rec rec[2];
    fl_trainer_result res[2];
} pf_job;

static fl_status pf_rank(fl_comm *c, int rank, void *ud) {
    pf_job *j = ud;
    return fl_trainer_run_comm(&j->cfg, c, NULL, 0, zr_record, &j->rec[rank], &j->res[rank]);
}

FL_TEST(fsdp_backward_prefetch_switch) {
    static pf_job job[2];
    fl_plan *plan = calloc(1, sizeof *plan);
    FL_REQUIRE(plan != NULL);
    size_t gather_planned[2];
    for (int off = 0; off < 2; off++) {
        pf_job *j = &job[off];
        memset(j, 0, sizeof *j);
        char out[700];
        snprintf(out, sizeof out, "%s/pf%d", fl_test_tmpdir(), off);
        zr_config(&j->cfg, ZR_ADAMW, 2, 2, 1, "fsdp", NULL, out);
        j->cfg.train.max_steps = 2;
        if (off) FL_REQUIRE_OK(fl_cfg_set(&j->cfg, "fsdp.backward_prefetch", "off"));
        FL_REQUIRE_OK(fl_comm_threads_run(2, pf_rank, j));
        fl_plan_opts po;
        fl_plan_opts_default(&po);
        po.comm_threads = 1;
        po.no_suggestions = 1;
        po.generation = 0;
        FL_REQUIRE_OK(fl_plan_run(&j->cfg, &po, plan));
        gather_planned[off] = plan->peak[FL_TAG_GATHER];
        FL_CHECKF(plan->peak[FL_TAG_GATHER] == j->res[0].peak[FL_TAG_GATHER], "prefetch %s: GATHER planned %zu, "
                  "measured %zu", off ? "off" : "on", plan->peak[FL_TAG_GATHER], j->res[0].peak[FL_TAG_GATHER]);
    }
    FL_CHECK(zr_same(&job[0].rec[0], &job[1].rec[0]));
    fl_model_config mc;
    FL_REQUIRE_OK(fl_preset_find("micro", &mc));
    fl_param_layout lay;
    FL_REQUIRE_OK(fl_layout_build(&lay, &mc));
    const size_t block = (lay.group_offset[2] - lay.group_offset[1]) * sizeof(float);
    fl_layout_free(&lay);
    FL_CHECKF(job[0].res[0].peak[FL_TAG_GATHER] == job[1].res[0].peak[FL_TAG_GATHER] + block,
              "GATHER with prefetch %zu, without %zu, a block %zu", job[0].res[0].peak[FL_TAG_GATHER],
              job[1].res[0].peak[FL_TAG_GATHER], block);
    FL_CHECK(gather_planned[0] == gather_planned[1] + block);
    /* a value it does not know is refused, naming the key */
    fl_run_config c;
    fl_cfg_defaults(&c, FL_CMD_FINETUNE_FULL);
    FL_REQUIRE_OK(fl_cfg_set(&c, "fsdp.backward_prefetch", "BACKWARD_POST"));
    FL_CHECK(fl_cfg_validate(&c) == FL_ERR_INVALID && strstr(fl_error_message(), "fsdp.backward_prefetch"));
    for (int i = 0; i < 2; i++)
        for (int r = 0; r < 2; r++) zr_free(&job[i].rec[r]);
    free(plan);
}

/* The one training step (fl_step_run): what its context gives back per micro-batch, where a
 * failure happened, an empty step, and the live bytes it records at the phase boundaries. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/model.h"
#include "fitllm/train.h"
#include "test.h"

typedef struct {
    fl_backend be;
    fl_mem_pool pool, hpool; /* the backend's memory; host staging when that is not host memory */
    fl_model m;
    fl_optimizer o;
} step_rig;

static void rig_init(step_rig *r) {
    fl_model_config c;
    FL_REQUIRE_OK(fl_preset_find("micro", &c));
    FL_REQUIRE_OK(fl_test_backend(&r->be, 2));
    FL_REQUIRE_OK(fl_backend_pools_init(&r->be, &r->pool, &r->hpool, r->be.name, 0));
    FL_REQUIRE_OK(fl_model_init(&r->m, &c, &r->be, &r->pool));
    fl_model_init_random(&r->m, 7);
    FL_REQUIRE_OK(fl_model_alloc_grads(&r->m));
    FL_REQUIRE_OK(fl_model_alloc_acts(&r->m, 2, 16));
    fl_optim_config oc;
    fl_optim_config_default(&oc, FL_OPT_ADAMW);
    FL_REQUIRE_OK(fl_optim_init(&r->o, &r->m, &oc));
}

static void rig_free(step_rig *r) {
    fl_optim_free(&r->o);
    fl_model_free(&r->m);
    fl_backend_pools_free(&r->pool, &r->hpool);
    fl_backend_free(&r->be);
}

FL_TEST(step_run_context_outputs_and_failures) {
    step_rig a, b;
    rig_init(&a);
    rig_init(&b);
    int32_t ids[64], tg[64];
    for (int i = 0; i < 64; i++) { ids[i] = (i * 37 + 5) % a.m.cfg.vocab_size; tg[i] = (i * 11 + 3) % a.m.cfg.vocab_size; }
    for (int i = 40; i < 48; i++) tg[i] = FL_IGNORE_INDEX;
    /* the context's per-micro-batch loss sums and counts add up to the step's; the same bits as fl_train_step */
    fl_micro_batch mbs[2] = {{.ids = ids, .targets = tg, .B = 2, .T = 16}, {.ids = ids + 32, .targets = tg + 32, .B = 2, .T = 16}};
    double stats[4], ms[2];
    fl_step_ctx c = {.mbs = mbs, .n_micro = 2, .step_valid = 56, .lr = 1e-3f, .max_norm = 1.0f, .mb_stats = stats,
                     .mb_ms = ms};
    fl_step_result ra, rb;
    FL_REQUIRE_OK(fl_step_run(&a.m, &a.o, &c, &ra));
    FL_REQUIRE_OK(fl_train_step(&b.m, &b.o, ids, tg, 2, 2, 16, 1e-3f, 1.0f, &rb));
    FL_CHECK(c.failed_k == -1 && stats[1] == 32 && stats[3] == 24 && ms[0] >= 0 && ms[1] >= ra.ms_opt * 0.5);
    FL_CHECKF(ra.loss == (stats[0] + stats[2]) / 56 && ra.loss == rb.loss && ra.grad_norm == rb.grad_norm,
              "loss %.9g vs %.9g", ra.loss, rb.loss);
    size_t pb = a.m.layout.numel * sizeof(float);
    float *pa = malloc(pb), *pbb = malloc(pb);
    FL_REQUIRE(pa && pbb);
    FL_REQUIRE_OK(a.be.to_host(&a.be, pa, fl_model_params_f32(&a.m), pb));
    FL_REQUIRE_OK(b.be.to_host(&b.be, pbb, fl_model_params_f32(&b.m), pb));
    FL_CHECK(memcmp(pa, pbb, pb) == 0);
    free(pa);
    free(pbb);
    /* live bytes, recorded by the step at its phase boundaries (fl_model_live) */
    const fl_mem_phase *f = fl_mem_find_phase(&a.pool, "after_fwd"), *k = fl_mem_find_phase(&a.pool, "after_bwd"),
                       *u = fl_mem_find_phase(&a.pool, "after_opt_step"), *z = fl_mem_find_phase(&a.pool, "before_fwd");
    FL_REQUIRE(f && k && u && z);
    FL_CHECK(z->live[FL_TAG_ACTS] == 0 && z->live[FL_TAG_GRADS] == 0);
    FL_CHECK(f->live[FL_TAG_ACTS] > 0 && f->live[FL_TAG_GRADS] > 0 && f->live[FL_TAG_GRADS] < f->cur[FL_TAG_GRADS]);
    FL_CHECK(k->live[FL_TAG_ACTS] == 0 && k->live[FL_TAG_GRADS] == k->cur[FL_TAG_GRADS]);
    FL_CHECK(u->live[FL_TAG_GRADS] == 0);
    fl_live_region reg[FL_MODEL_LIVE_MAX];
    int n = fl_model_live(&a.m, FL_LIVE_ZEROED, reg);
    FL_CHECK(n == 1 && reg[0].bytes == 0 && !reg[0].at_least);
    /* a failure names its micro-batch: a target outside the vocabulary in the second */
    tg[33] = a.m.cfg.vocab_size;
    FL_CHECK(fl_step_run(&a.m, &a.o, &c, &ra) == FL_ERR_INVALID && c.failed_k == 1);
    /* every target masked: an error, or with skip_empty no forward and no update */
    for (int i = 0; i < 64; i++) tg[i] = FL_IGNORE_INDEX;
    c.step_valid = 0;
    const int steps = a.o.step;
    FL_CHECK(fl_step_run(&a.m, &a.o, &c, &ra) == FL_ERR_INVALID && c.failed_k == 0);
    c.skip_empty = 1;
    FL_REQUIRE_OK(fl_step_run(&a.m, &a.o, &c, &ra));
    FL_CHECK(a.o.step == steps && stats[0] == 0 && stats[1] == 0 && stats[3] == 0 && isnan(ra.loss));
    rig_free(&a);
    rig_free(&b);
}

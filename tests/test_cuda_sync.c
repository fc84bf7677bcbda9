/* Issue 30 item 5: the host round trips of a training step on the CUDA backend, counted by the backend's
 * own code on the emulator (fl_cuemu_backend_counters): synchronizations and copies to the host per step. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/model.h"
#include "fitllm/train.h"
#include "test.h"

#ifdef FL_HAVE_CUDA_EMU
#include "backend/cuda/cuda-impl.h"

typedef struct {
    fl_backend be;
    fl_mem_pool pool, hpool;
    fl_model m;
    fl_optimizer o;
} sync_rig;

static void rig_init(sync_rig *r, const char *prec, int B, int T) {
    fl_model_config c;
    FL_REQUIRE_OK(fl_preset_find("micro", &c));
    fl_cuemu_set_host_memory(0); /* the GPU's paths: host staging, ids copied, what waits for the device */
    fl_status s = fl_backend_init_by_name("cuda-emu", &r->be, 1);
    fl_cuemu_set_host_memory(1);
    FL_REQUIRE_OK(s);
    FL_REQUIRE(!fl_backend_host_memory(&r->be));
    FL_REQUIRE_OK(fl_backend_pools_init(&r->be, &r->pool, &r->hpool, r->be.name, 0));
    fl_precision p;
    FL_REQUIRE_OK(fl_precision_find(prec, &p));
    fl_model_storage stg;
    fl_model_storage_for(&p, &stg);
    FL_REQUIRE_OK(fl_model_init_ex(&r->m, &c, &r->be, &r->pool, &stg));
    fl_model_init_random(&r->m, 7);
    FL_REQUIRE_OK(fl_model_set_precision(&r->m, &p));
    FL_REQUIRE_OK(fl_model_alloc_grads(&r->m));
    FL_REQUIRE_OK(fl_model_alloc_acts(&r->m, B, T));
    fl_optim_config oc;
    fl_optim_config_default(&oc, FL_OPT_ADAMW);
    FL_REQUIRE_OK(fl_optim_init(&r->o, &r->m, &oc));
}
static void rig_free(sync_rig *r) {
    fl_optim_free(&r->o);
    fl_model_free(&r->m);
    fl_backend_pools_free(&r->pool, &r->hpool);
    fl_backend_free(&r->be);
}

/* The round trips of one step (the second: the first makes first-use buffers), n_micro micro-batches. */
static fl_cu_counters step_counts(const char *prec, int n_micro, float max_norm, int phase_times, double *loss) {
    const int B = 2, T = 16;
    sync_rig r;
    rig_init(&r, prec, B, T);
    int32_t ids[4 * 32], tg[4 * 32];
    for (int i = 0; i < 4 * 32; i++) {
        ids[i] = (i * 37 + 5) % r.m.cfg.vocab_size;
        tg[i] = (i * 11 + 3) % r.m.cfg.vocab_size;
    }
    fl_micro_batch mbs[4];
    for (int k = 0; k < 4; k++) mbs[k] = (fl_micro_batch){.ids = ids + 32 * k, .targets = tg + 32 * k, .B = B, .T = T};
    fl_step_ctx sc = {.mbs = mbs, .n_micro = n_micro, .step_valid = (long)n_micro * B * T, .lr = 1e-3f,
                      .max_norm = max_norm, .phase_times = phase_times};
    fl_step_result res = {0};
    fl_cu_counters a = {0}, b = {0};
    fl_status s = fl_step_run(&r.m, &r.o, &sc, &res);
    fl_cuemu_backend_counters(&r.be, &a);
    if (s == FL_OK) s = fl_step_run(&r.m, &r.o, &sc, &res);
    fl_cuemu_backend_counters(&r.be, &b);
    FL_CHECKF(s == FL_OK, "%s: %s", prec, fl_error_message());
    *loss = res.loss;
    rig_free(&r);
    return (fl_cu_counters){b.sync - a.sync, b.d2h - a.d2h, b.h2d - a.h2d};
}

/* What a step on a GPU makes the host wait for: no synchronization, one copy to the host per micro-batch
 * (its per-token losses: the loss is logged, and a NaN stops the run before the update) and one for the
 * gradient norm (clipping is decided on the host); with fp16 loss scaling the overflow flag (its reset
 * goes up, the flag comes back). Copies up: each micro-batch's ids and targets. bench-step's phase times
 * (phase_times) add the syncs at the phase edges: 3 per micro-batch and 1 after the update. */
FL_TEST(cuda_sync_round_trips_per_step) {
    static const struct {
        const char *prec;
        int n_micro;
        float max_norm;
        int amp;
    } cases[] = {{"32-true", 1, 1.0f, 0}, {"32-true", 3, 1.0f, 0}, {"32-true", 1, 0.0f, 0}, {"bf16-true", 1, 1.0f, 0},
                 {"bf16-mixed", 2, 1.0f, 0}, {"16-mixed", 1, 1.0f, 1}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        double loss, loss_timed;
        const int nm = cases[i].n_micro, amp = cases[i].amp;
        fl_cu_counters c = step_counts(cases[i].prec, nm, cases[i].max_norm, 0, &loss);
        printf("      %-10s x%d clip %.0f: %ld syncs, %ld copies to the host, %ld from it (loss %.5f)\n", cases[i].prec,
               nm, (double)cases[i].max_norm, c.sync, c.d2h, c.h2d, loss);
        FL_CHECKF(c.sync == 0 && c.d2h == nm + 1 + amp && c.h2d == 2 * nm + amp,
                  "%s x%d: %ld syncs, %ld copies to the host, %ld from it", cases[i].prec, nm, c.sync, c.d2h, c.h2d);
        if (nm != 3) continue; /* the timed variant once (the emulator is slow) */
        fl_cu_counters t = step_counts(cases[i].prec, nm, cases[i].max_norm, 1, &loss_timed);
        FL_CHECKF(t.sync == 3 * nm + 1 && t.d2h == c.d2h && t.h2d == c.h2d, "%s x%d timed: %ld syncs", cases[i].prec, nm,
                  t.sync);
        FL_CHECK(loss_timed == loss); /* the syncs change no result */
    }
}
#endif

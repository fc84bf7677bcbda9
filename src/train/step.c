/* One training step: accumulation over micro-batches, backward, update, with
 * phase memory snapshots and phase timings. */
#include <time.h>

#include "fitllm/train.h"

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

fl_status fl_train_step(fl_model *m, fl_optimizer *o, const int32_t *ids, const int32_t *targets, int n_micro, int B,
                        int T, float lr, float max_norm, fl_step_result *res) {
    fl_mem_pool *pool = m->pool;
    const size_t mb = (size_t)B * T;
    long total = 0;
    for (size_t i = 0; i < (size_t)n_micro * mb; i++) total += targets[i] != FL_IGNORE_INDEX;
    if (total == 0) return fl_errorf(FL_ERR_INVALID, "training step has no target tokens (all are ignore_index)");
    float grad_scale = (float)(1.0 / (double)total);
    double t0 = now_ms(), tf = 0, tb = 0, loss_sum = 0;
    fl_model_zero_grads(m);
    for (int k = 0; k < n_micro; k++) {
        double a = now_ms();
        if (k == 0) fl_mem_snapshot(pool, "before_fwd");
        fl_mem_set_phase(pool, "forward");
        FL_TRY(fl_model_forward(m, ids + k * mb, targets + k * mb, B, T, grad_scale, NULL));
        loss_sum += m->loss_sum;
        if (k == 0) fl_mem_snapshot(pool, "after_fwd");
        double b = now_ms();
        fl_mem_set_phase(pool, "backward");
        FL_TRY(fl_model_backward(m));
        if (k == 0) fl_mem_snapshot(pool, "after_bwd");
        tf += b - a;
        tb += now_ms() - b;
    }
    double c = now_ms();
    fl_mem_set_phase(pool, "optimizer step");
    double norm = 0;
    FL_TRY(fl_optim_step(o, lr, max_norm, &norm));
    fl_mem_snapshot(pool, "after_opt_step");
    double d = now_ms();
    if (res) {
        res->loss = loss_sum / (double)total;
        res->n_valid = total;
        res->grad_norm = norm;
        res->ms_fwd = tf;
        res->ms_bwd = tb;
        res->ms_opt = d - c;
        res->ms_total = d - t0;
    }
    return FL_OK;
}

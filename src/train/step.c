/* One training step: accumulation over micro-batches, backward, update, with
 * phase memory snapshots and phase timings. */
#include <math.h>
#include <time.h>

#include "fitllm/train.h"

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

fl_status fl_train_micro(fl_model *m, fl_optimizer *o, const fl_micro_batch *mb, int k, int last, long step_valid,
                         float lr, float max_norm, double *loss_sum, long *n_valid, fl_step_result *res) {
    fl_mem_pool *pool = m->pool;
    if (step_valid <= 0) return fl_errorf(FL_ERR_INVALID, "training step has no target tokens (all are ignore_index)");
    float grad_scale = (float)(1.0 / (double)step_valid);
    if (o && o->use_loss_scale) grad_scale *= fl_loss_scale_value(&o->ls); /* fp16: scaled loss */
    double a = now_ms();
    if (k == 0) fl_mem_snapshot(pool, "before_fwd");
    fl_mem_set_phase(pool, "forward");
    FL_TRY(fl_model_forward(m, mb->ids, mb->targets, mb->B, mb->T, grad_scale, NULL));
    *loss_sum = m->loss_sum;
    *n_valid = m->n_valid;
    /* a diverged run: stop before its NaN reaches the weights. Under fp16 loss
     * scaling an overflow is expected now and then: the optimizer skips that update. */
    if (!isfinite(m->loss_sum) && !(o && o->use_loss_scale))
        return fl_errorf(FL_ERR_NONFINITE, "the loss is %s", isnan(m->loss_sum) ? "NaN" : m->loss_sum > 0 ? "+inf" : "-inf");
    if (k == 0) fl_mem_snapshot(pool, "after_fwd");
    double b = now_ms();
    fl_mem_set_phase(pool, "backward");
    FL_TRY(fl_model_backward(m));
    if (k == 0) fl_mem_snapshot(pool, "after_bwd");
    if (res && !m->be->host_memory) FL_TRY(m->be->sync(m->be)); /* an asynchronous device: its own time */
    double c = now_ms();
    if (res) {
        res->ms_fwd += b - a - m->ms_head;
        res->ms_head += m->ms_head;
        res->ms_bwd += c - b;
    }
    if (last) FL_TRY(fl_train_update(m, o, lr, max_norm, res));
    return FL_OK;
}

fl_status fl_train_update(fl_model *m, fl_optimizer *o, float lr, float max_norm, fl_step_result *res) {
    fl_mem_pool *pool = m->pool;
    double c = now_ms();
    fl_mem_set_phase(pool, "optimizer step");
    double norm = 0;
    FL_TRY(fl_optim_step(o, lr, max_norm, &norm));
    if (res && !m->be->host_memory) FL_TRY(m->be->sync(m->be));
    fl_mem_snapshot(pool, "after_opt_step");
    if (res) {
        res->grad_norm = norm;
        res->skipped = o->last_skipped;
        res->loss_scale = o->use_loss_scale ? fl_loss_scale_value(&o->ls) : 0.0f;
        res->ms_opt += now_ms() - c;
    }
    return FL_OK;
}

fl_status fl_train_step(fl_model *m, fl_optimizer *o, const int32_t *ids, const int32_t *targets, int n_micro, int B,
                        int T, float lr, float max_norm, fl_step_result *res) {
    const size_t mb = (size_t)B * T;
    long total = 0;
    for (size_t i = 0; i < (size_t)n_micro * mb; i++) total += targets[i] != FL_IGNORE_INDEX;
    fl_step_result r = {0};
    double t0 = now_ms(), loss_sum = 0;
    fl_model_zero_grads(m);
    for (int k = 0; k < n_micro; k++) {
        fl_micro_batch b = {ids + k * mb, targets + k * mb, B, T};
        double ls = 0;
        long nv;
        FL_TRY(fl_train_micro(m, o, &b, k, k == n_micro - 1, total, lr, max_norm, &ls, &nv, &r));
        loss_sum += ls;
    }
    r.loss = loss_sum / (double)total;
    r.n_valid = total;
    r.ms_total = now_ms() - t0;
    if (res) *res = r;
    return FL_OK;
}

/* The training step, the one every caller runs (the trainer, bench-step, the demo, tests):
 * accumulation over micro-batches, backward, the data-parallel reduction, the update, with the
 * phase memory snapshots, the live bytes each phase leaves (fl_model_live) and phase timings. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fitllm/train.h"

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* A phase boundary, one call into the pool (fl_mem_phase_edge). Live bytes are a fact of the step's phases: the
 * model says which of its regions still hold data a later phase reads after phase ph (fl_model_live; ph < 0:
 * nothing to record), the pool records them, takes the snapshot `tag` (NULL: none) and labels the next phase
 * (NULL: kept). */
static void edge(fl_model *m, int ph, const char *tag, const char *next) {
    fl_live_region r[FL_MODEL_LIVE_MAX];
    fl_mem_phase_edge(m->pool, r, ph < 0 ? 0 : fl_model_live(m, (fl_live_phase)ph, r), tag, next);
}

/* An asynchronous device (not host memory) runs behind the host: when the phase times are asked for
 * (fl_step_ctx.phase_times -> m->phase_sync), wait at the phase edges so they are the device's; otherwise no
 * synchronization inside a step (issue 30 item 5). */
static fl_status sync_device(const fl_model *m) {
    return !m->phase_sync || m->host_memory ? FL_OK : FL_RUN(m->be, sync);
}

/* Forward + backward of micro-batch k (grad scale 1/step_valid); gradients accumulate. */
static fl_status micro(fl_model *m, fl_optimizer *o, const fl_micro_batch *mb, const uint64_t *seed, int k,
                       long step_valid, double *ss, double *loss_sum, long *n_valid, fl_step_result *res) {
    if (step_valid <= 0) return fl_errorf(FL_ERR_INVALID, "training step has no target tokens (all are ignore_index)");
    float grad_scale = (float)(1.0 / (double)step_valid);
    if (o && o->amp.scaler) grad_scale *= o->amp.scaler->value(o); /* fp16: scaled loss (fl_loss_scaler) */
    double a = now_ms();
    edge(m, -1, k == 0 ? "before_fwd" : NULL, "forward");
    FL_TRY(fl_model_forward_micro(m, mb, grad_scale, seed)); /* either kind, up to the head's input */
    /* the head (lm_head + cross-entropy + its backward, chunk by chunk) timed as its own phase */
    FL_TRY(sync_device(m));
    const double h = now_ms();
    m->loss_dev = ss ? ss + FL_SS_LOSS + k : NULL; /* the losses summed on the device (step scalars) */
    m->loss_on_dev = 0;
    fl_status hs = fl_model_forward_head(m, NULL);
    m->loss_dev = NULL;
    FL_TRY(hs);
    FL_TRY(sync_device(m));
    const double hb = now_ms();
    *loss_sum = m->loss_on_dev ? NAN : m->loss_sum; /* on the device: read at the step's end (fl_step_run) */
    *n_valid = m->n_valid;
    /* a diverged run: stop before its NaN reaches the weights (losses on the device: the update is skipped there and
     * the step fails at its end, the weights as they were). Under fp16 loss scaling an overflow is expected now and
     * then: the optimizer skips that update. */
    const int diverged = !m->loss_on_dev && !isfinite(m->loss_sum) && !(o && o->amp.scaler);
    edge(m, FL_LIVE_FORWARD, k == 0 && !diverged ? "after_fwd" : NULL, diverged ? NULL : "backward");
    if (diverged)
        return fl_errorf(FL_ERR_NONFINITE, "the loss is %s", isnan(m->loss_sum) ? "NaN" : m->loss_sum > 0 ? "+inf" : "-inf");
    double b = now_ms();
    FL_TRY(fl_model_backward(m)); /* either kind: an encoder-decoder's runs its stacks backward */
    edge(m, FL_LIVE_BACKWARD, k == 0 ? "after_bwd" : NULL, NULL);
    FL_TRY(sync_device(m));
    double c = now_ms();
    res->ms_fwd += b - a - (hb - h);
    res->ms_head += hb - h;
    res->ms_bwd += c - b;
    return FL_OK;
}

/* The optimizer update that ends a step: phase "optimizer step", fl_optim_step, the after_opt_step
 * snapshot, res's grad_norm / skipped / loss_scale / ms_opt. */
static fl_status update(fl_model *m, fl_optimizer *o, float lr, float max_norm, double *ss, int n_loss,
                        fl_step_result *res) {
    double c = now_ms();
    edge(m, -1, NULL, "optimizer step");
    double norm = 0;
    o->ss = ss; /* the norm and clip scale may stay on the device: read at the step's end */
    o->ss_nloss = o->amp.scaler ? 0 : n_loss; /* a non-finite loss refuses the update (loss scaling: its overflow check) */
    fl_status s = fl_optim_step(o, lr, max_norm, &norm);
    o->ss = NULL;
    FL_TRY(s);
    edge(m, FL_LIVE_UPDATED, NULL, NULL); /* the gradients are consumed (or, skipped, discarded) */
    FL_TRY(sync_device(m));
    edge(m, -1, "after_opt_step", NULL);
    res->grad_norm = norm;
    res->skipped = o->amp.skipped;
    res->loss_scale = o->amp.scaler ? o->amp.scaler->value(o) : 0.0f;
    res->ms_opt += now_ms() - c;
    return FL_OK;
}

/* The sum of the gradients over the ranks (no synchronisation: nothing), then what is live of
 * them (ZeRO-2: this rank's chunk) and, with several ranks, the after_reduce snapshot. */
static fl_status reduce(fl_model *m, fl_optimizer *o, const fl_grad_sync *gs) {
    if (!gs) return FL_OK;
    size_t live = SIZE_MAX;
    int snap = 0;
    FL_TRY(gs->reduce(gs->self, o, &live, &snap));
    if (!snap) return FL_OK;
    const fl_live_region r = {o->w.g, live, 0}; /* SIZE_MAX: nothing to say */
    fl_mem_phase_edge(m->pool, &r, r.bytes != SIZE_MAX, "after_reduce", NULL);
    return FL_OK;
}

/* Issue 30 item 5: the step scalars (fl_backend.step_scalars): on a backend that has them, for n_micro + 2 <= FL_SS_MAX,
 * the micro-batches' loss sums and the update's norm and clip scale stay in device memory, zeroed at the step's
 * start; NULL: the host path (each micro-batch's losses read after its head, the norm read by the update). */
static double *step_scalars(fl_model *m, const fl_optimizer *o, const fl_step_ctx *c) {
    const fl_backend *be = m->be;
    /* only with the update on the device too: it skips itself on a non-finite loss, as the host path stops. The
     * memory is the backend's, asked for at the optimizer's set-up (o->ss_home) */
    if (!o || !o->ss_home || !be->loss_sum_dev || c->n_micro + FL_SS_LOSS > FL_SS_MAX || !fl_optim_device_step(o))
        return NULL;
    FL_RUN(be, zero, o->ss_home, (size_t)(c->n_micro + FL_SS_LOSS) * sizeof *o->ss_home);
    return o->ss_home;
}

/* The step's one read of its scalars (when anything was left on the device): each micro-batch's loss sum into
 * ls[k] (a non-finite one, without loss scaling, fails the step at micro-batch k, as the host path does before its
 * backward: here the device skipped the update), then the norm (fl_optim_step_finish). */
static fl_status read_scalars(fl_model *m, fl_optimizer *o, fl_step_ctx *c, const double *ss, double *ls,
                              const unsigned char *on_dev, int n, fl_step_result *r) {
    double h[FL_SS_MAX];
    FL_TRY(FL_RUN(m->be, to_host, h, ss, (size_t)(n + FL_SS_LOSS) * sizeof *h));
    for (int k = 0; k < n; k++)
        if (on_dev[k]) ls[k] = h[FL_SS_LOSS + k];
    fl_status s = fl_optim_step_finish(o, h, &r->grad_norm); /* the count, the norm */
    if (s != FL_OK) c->failed_k = n;
    for (int k = 0; k < n; k++) /* a loss first, as the host path fails before the update */
        if (!isfinite(ls[k]) && !o->amp.scaler) {
            c->failed_k = k;
            return fl_errorf(FL_ERR_NONFINITE, "the loss is %s", isnan(ls[k]) ? "NaN" : ls[k] > 0 ? "+inf" : "-inf");
        }
    return s;
}

/* Issue 30 item 5: micro-batch k's inputs uploaded ahead into input slot k % FL_INPUT_SLOTS (fl_model_prefetch: the
 * backend's second stream), so micro-batch k + 1's copy runs while micro-batch k computes; a no-op where the backend
 * has no input slots. */
static fl_status prefetch(fl_model *m, const fl_step_ctx *c, int k) {
    return k < c->n_micro ? fl_model_prefetch(m, &c->mbs[k], k % FL_INPUT_SLOTS, NULL) : FL_OK;
}

static fl_status step_run(fl_model *m, fl_optimizer *o, fl_step_ctx *c, fl_step_result *res) {
    fl_step_result r = {0};
    const fl_grad_sync *gs = c->sync;
    const int world = gs ? gs->world : 1, rank = gs ? gs->rank : 0;
    double t0 = now_ms(), loss_sum = 0;
    c->failed_k = -1;
    m->phase_sync = c->phase_times;
    fl_model_zero_grads(m);
    if (c->fault) FL_TRY(c->fault(m)); /* test-only (fitllm/fault.h) */
    edge(m, FL_LIVE_ZEROED, NULL, NULL);
    /* every target of the step masked: nothing to learn, no forward and no update (c->skip_empty) */
    const int learn = c->step_valid > 0 || !c->skip_empty;
    double *ss = learn ? step_scalars(m, o, c) : NULL, ls[FL_SS_MAX];
    unsigned char on_dev[FL_SS_MAX] = {0}; /* micro-batch k's loss sum left on the device */
    int pending = 0;                       /* a loss or the norm left on the device */
    for (int k = 0; k < c->n_micro; k++) {
        double it0 = now_ms(), ls_k = 0;
        long nv_k = 0;
        if (learn) {
            /* LoRA dropout masks depend on (seed, global micro-batch) only: a resumed run, and any world size,
             * draws the same (the forward seeds the adapters before it runs) */
            const uint64_t seed = c->seed + (uint64_t)(c->iter0 + (long)k * world + rank);
            fl_status s = k == 0 ? prefetch(m, c, 0) : FL_OK;
            if (s == FL_OK) s = prefetch(m, c, k + 1); /* the next one's copy while this one computes */
            if (s == FL_OK && gs) s = gs->arm(gs->self, o, k == c->n_micro - 1, c->lr, c->max_norm);
            if (s == FL_OK)
                s = micro(m, o, &c->mbs[k], c->seeded ? &seed : NULL, k, c->step_valid, ss, &ls_k, &nv_k, &r);
            if (s != FL_OK) {
                c->failed_k = k;
                return s;
            }
            if (ss) on_dev[k] = (unsigned char)m->loss_on_dev;
            pending |= m->loss_on_dev;
        }
        if (ss) ls[k] = ls_k;
        if (c->mb_stats) c->mb_stats[2 * k + 1] = (double)nv_k;
        if (!ss) {
            loss_sum += ls_k;
            if (c->mb_stats) c->mb_stats[2 * k] = ls_k;
        }
        if (c->mb_ms) c->mb_ms[k] = now_ms() - it0;
    }
    if (learn) {
        double u0 = now_ms();
        /* the sum over ranks, then one update: clipping and fp16 overflow skips see the same
         * reduced gradients on every rank, so they decide alike */
        fl_status s = reduce(m, o, gs);
        if (s == FL_OK) s = update(m, o, c->lr, c->max_norm, ss, c->n_micro, &r);
        if (s != FL_OK) {
            c->failed_k = c->n_micro;
            return s;
        }
        pending |= o->ss_pending;
        if (pending) FL_TRY(read_scalars(m, o, c, ss, ls, on_dev, c->n_micro, &r));
        if (pending && o->amp.scaler) { /* fp16's overflow verdict came with the scalars */
            r.skipped = o->amp.skipped;
            r.loss_scale = o->amp.scaler->value(o);
        }
        if (c->mb_ms && c->n_micro > 0) c->mb_ms[c->n_micro - 1] += now_ms() - u0; /* the last iteration carries it */
    }
    for (int k = 0; ss && k < c->n_micro; k++) { /* the host path's sum, in its order */
        loss_sum += ls[k];
        if (c->mb_stats) c->mb_stats[2 * k] = ls[k];
    }
    r.loss = c->step_valid > 0 ? loss_sum / (double)c->step_valid : NAN;
    r.n_valid = c->step_valid;
    r.ms_total = now_ms() - t0;
    if (res) *res = r;
    return FL_OK;
}

fl_status fl_step_run(fl_model *m, fl_optimizer *o, fl_step_ctx *c, fl_step_result *res) {
    fl_status s = step_run(m, o, c, res);
    (void)fl_model_prefetch(m, NULL, 0, NULL); /* what the input slots hold was this step's */
    return s;
}

fl_status fl_train_step(fl_model *m, fl_optimizer *o, const int32_t *ids, const int32_t *targets, int n_micro, int B,
                        int T, float lr, float max_norm, fl_step_result *res) {
    enum { ON_STACK = 16 };
    const size_t mb = (size_t)B * T;
    long total = 0;
    for (size_t i = 0; i < (size_t)n_micro * mb; i++) total += targets[i] != FL_IGNORE_INDEX;
    fl_micro_batch stack[ON_STACK], *mbs = n_micro <= ON_STACK ? stack : malloc((size_t)n_micro * sizeof *mbs);
    if (!mbs) return fl_errorf(FL_ERR_OOM, "out of host memory");
    for (int k = 0; k < n_micro; k++) mbs[k] = (fl_micro_batch){.ids = ids + k * mb, .targets = targets + k * mb, .B = B, .T = T};
    fl_step_ctx c = {.mbs = mbs, .n_micro = n_micro, .step_valid = total, .lr = lr, .max_norm = max_norm};
    fl_status s = fl_step_run(m, o, &c, res);
    if (mbs != stack) free(mbs);
    return s;
}

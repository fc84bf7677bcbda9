/* Optimizer state and updates over the flat parameter buffer. */
#include <math.h>
#include <string.h>

#include "fitllm/train.h"

void fl_optim_config_default(fl_optim_config *c, fl_optim_kind kind) {
    memset(c, 0, sizeof *c);
    c->kind = kind;
    c->lr = 1e-3f;
    if (kind == FL_OPT_ADAMW) {
        c->beta1 = 0.9f;
        c->beta2 = 0.999f;
        c->eps = 1e-8f;
        c->weight_decay = 0.01f;
    }
}

const char *fl_optim_name(fl_optim_kind kind) {
    static const char *n[FL_OPT_COUNT] = {"AdamW", "SGD"};
    return (kind >= 0 && kind < FL_OPT_COUNT) ? n[kind] : "?";
}

size_t fl_optim_state_bytes(const fl_optim_config *c, size_t n) {
    switch (c->kind) {
    case FL_OPT_ADAMW: return 2 * n * sizeof(float);
    case FL_OPT_SGD: return c->momentum != 0.0f ? n * sizeof(float) : 0;
    default: return 0;
    }
}

fl_status fl_optim_init(fl_optimizer *o, fl_model *model, const fl_optim_config *cfg) {
    memset(o, 0, sizeof *o);
    if (cfg->kind < 0 || cfg->kind >= FL_OPT_COUNT) return fl_errorf(FL_ERR_INVALID, "unknown optimizer %d", (int)cfg->kind);
    o->cfg = *cfg;
    o->model = model;
    size_t bytes = model->layout.numel * sizeof(float);
    fl_status s = FL_OK;
    if (cfg->kind == FL_OPT_ADAMW) {
        s = fl_mem_calloc(model->pool, FL_TAG_OPTIM, bytes, (void **)&o->m);
        if (s == FL_OK) s = fl_mem_calloc(model->pool, FL_TAG_OPTIM, bytes, (void **)&o->v);
    } else if (cfg->momentum != 0.0f) {
        s = fl_mem_calloc(model->pool, FL_TAG_OPTIM, bytes, (void **)&o->buf);
    }
    if (s != FL_OK) {
        fl_optim_free(o);
        return fl_error_prefix(s, "allocating %s state", fl_optim_name(cfg->kind));
    }
    return FL_OK;
}

void fl_optim_free(fl_optimizer *o) {
    if (!o->model) return;
    fl_mem_free(o->model->pool, o->m);
    fl_mem_free(o->model->pool, o->v);
    fl_mem_free(o->model->pool, o->buf);
    memset(o, 0, sizeof *o);
}

double fl_grad_norm(const fl_model *m) {
    return sqrt(m->be->sumsq(m->be, m->grads, m->layout.numel));
}

fl_status fl_optim_step(fl_optimizer *o, float lr, float max_norm, double *norm_out) {
    fl_model *m = o->model;
    const fl_backend *be = m->be;
    if (!m->grads) return fl_errorf(FL_ERR_INVALID, "optimizer step without gradient buffers");
    double norm = -1.0;
    float scale = 1.0f;
    if (max_norm > 0 || norm_out) norm = fl_grad_norm(m);
    if (max_norm > 0) {
        double coef = max_norm / (norm + 1e-6);
        if (coef < 1.0) scale = (float)coef;
    }
    if (norm_out) *norm_out = norm;
    o->step++;
    const fl_optim_config *c = &o->cfg;
    size_t n = m->layout.numel;
    if (c->kind == FL_OPT_ADAMW)
        be->adamw_update(be, m->params, m->grads, o->m, o->v, n, lr, c->beta1, c->beta2, c->eps, c->weight_decay,
                         o->step, scale);
    else
        be->sgd_update(be, m->params, m->grads, o->buf, n, lr, c->momentum, c->dampening, c->weight_decay,
                       c->nesterov, o->step == 1, scale);
    return FL_OK;
}

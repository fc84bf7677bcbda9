/* Optimizer state and updates over the flat parameter buffer. AdamW and SGD
 * run over the whole buffer in one call (fp32 or bf16 state); 8-bit AdamW
 * keeps block-wise state per parameter tensor, as bitsandbytes does. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../model/model-impl.h"
#include "fitllm/comm.h"
#include "fitllm/train.h"

void fl_optim_config_default(fl_optim_config *c, fl_optim_kind kind) {
    memset(c, 0, sizeof *c);
    c->kind = kind;
    c->lr = 1e-3f;
    c->state_dtype = FL_F32;
    if (kind == FL_OPT_ADAMW || kind == FL_OPT_ADAMW8BIT) {
        c->beta1 = 0.9f;
        c->beta2 = 0.999f;
        c->eps = 1e-8f;
        c->weight_decay = 0.01f;
    }
}

const char *fl_optim_name(fl_optim_kind kind) {
    static const char *n[FL_OPT_COUNT] = {"AdamW", "SGD", "AdamW8bit"};
    return (kind >= 0 && kind < FL_OPT_COUNT) ? n[kind] : "?";
}

size_t fl_optim_state_bytes(const fl_optim_config *c, size_t n) {
    size_t es = c->state_dtype == FL_BF16 ? 2 : 4;
    switch (c->kind) {
    case FL_OPT_ADAMW: return 2 * n * es;
    case FL_OPT_SGD: return c->momentum != 0.0f ? n * es : 0;
    case FL_OPT_ADAMW8BIT: return fl_adam8bit_state_bytes(n);
    default: return 0;
    }
}

size_t fl_optim_state_bytes_layout(const fl_optim_config *c, const fl_param_layout *lay) {
    if (c->kind != FL_OPT_ADAMW8BIT) return fl_optim_state_bytes(c, lay->numel);
    size_t total = 0;
    for (int i = 0; i < lay->n; i++) total += fl_adam8bit_state_bytes(lay->params[i].numel);
    return total;
}

/* The trainable tensors: the layout's, or each LoRA adapter's A and B. */
static fl_status trainable(fl_optimizer *o, fl_model *model) {
    const struct fl_lora_state *st = model->lora;
    int n = st ? 2 * st->n_mods : model->layout.n;
    o->t_off = calloc((size_t)n + 1, sizeof *o->t_off);
    o->t_n = calloc((size_t)n + 1, sizeof *o->t_n);
    if (!o->t_off || !o->t_n) return fl_errorf(FL_ERR_OOM, "optimizer bookkeeping: out of host memory");
    o->n_tensors = n;
    o->pt = o->gt = FL_F32;
    if (st) {
        o->p = st->params;
        o->g = st->grads;
        o->n = st->numel;
        for (int j = 0; j < st->n_mods; j++) {
            o->t_off[2 * j] = st->off[2 * j];
            o->t_n[2 * j] = (size_t)st->cfg.r * st->mods[j].in;
            o->t_off[2 * j + 1] = st->off[2 * j + 1];
            o->t_n[2 * j + 1] = (size_t)st->mods[j].out * st->cfg.r;
        }
    } else {
        o->p = model->params ? (void *)model->params : (void *)model->p16;
        o->g = model->grads ? (void *)model->grads : (void *)model->g16;
        o->pt = o->gt = model->store_dtype;
        o->n = model->layout.numel;
        for (int i = 0; i < n; i++) {
            o->t_off[i] = model->layout.params[i].offset;
            o->t_n[i] = model->layout.params[i].numel;
        }
        if (model->pp) { /* sharded (FSDP): this rank's shard, one elementwise range (8-bit AdamW is refused) */
            o->n = model->pp->numel;
            o->n_tensors = 1;
            o->t_off[0] = 0;
            o->t_n[0] = o->n;
        }
    }
    return FL_OK;
}

fl_status fl_optim_init(fl_optimizer *o, fl_model *model, const fl_optim_config *cfg) {
    return fl_optim_init_shard(o, model, cfg, 1, 0);
}

void fl_optim_8bit_piece(size_t n, size_t t_off, size_t t_n, int world, int rank, size_t *a, size_t *len) {
    size_t off, cl;
    fl_comm_chunk(n, world, rank, &off, &cl);
    size_t lo = off > t_off ? off : t_off, hi = off + cl < t_off + t_n ? off + cl : t_off + t_n;
    *a = 0;
    *len = 0;
    if (lo >= hi) return;
    size_t x = lo - t_off, y = hi - t_off; /* tensor-relative */
    if (fl_adam8bit_is_8bit(t_n)) {
        const size_t B = FL_ADAM8BIT_BLOCK;
        x = x / B * B;
        y = (y + B - 1) / B * B;
        if (y > t_n) y = t_n;
    }
    *a = x;
    *len = y - x;
}

fl_status fl_optim_init_shard(fl_optimizer *o, fl_model *model, const fl_optim_config *cfg, int world, int rank) {
    memset(o, 0, sizeof *o);
    if (world < 1 || rank < 0 || rank >= world)
        return fl_errorf(FL_ERR_INVALID, "optimizer set-up: rank %d of %d", rank, world);

    if (cfg->kind < 0 || cfg->kind >= FL_OPT_COUNT) return fl_errorf(FL_ERR_INVALID, "unknown optimizer %d", (int)cfg->kind);
    if (cfg->state_dtype != FL_F32 && cfg->state_dtype != FL_BF16)
        return fl_errorf(FL_ERR_INVALID, "optimizer state dtype must be F32 or BF16");
    o->cfg = *cfg;
    o->model = model;
    /* the precision policy fixes the state dtype of the full parameters (bf16-true: bf16);
     * LoRA adapters are fp32 under every policy */
    if (!model->lora && model->prec.optim_dtype == FL_BF16) o->cfg.state_dtype = FL_BF16;
    o->use_loss_scale = model->prec.loss_scaling;
    fl_loss_scale_init(&o->ls);
    fl_status s = trainable(o, model);
    if (s == FL_OK) fl_comm_chunk(o->n, world, rank, &o->s_off, &o->s_len);
    /* the backend must implement the update for these dtypes: found here, not at the first step */
    if (s == FL_OK) {
        const fl_backend *be = model->be;
        fl_op op = cfg->kind == FL_OPT_ADAMW ? FL_OP_ADAMW_EX : cfg->kind == FL_OPT_SGD ? FL_OP_SGD_EX : FL_OP_ADAM8BIT;
        if (!be->supports_op(be, op, o->pt, o->gt, o->cfg.state_dtype))
            s = fl_errorf(FL_ERR_UNSUPPORTED, "backend '%s' does not implement %s for parameters %s, gradients %s, state "
                          "%s (optimizer set-up)", be->name, fl_op_name(op), fl_dtype_name(o->pt), fl_dtype_name(o->gt),
                          fl_dtype_name(o->cfg.state_dtype));
    }
    size_t bytes = o->s_len * (o->cfg.state_dtype == FL_BF16 ? 2 : 4); /* this rank's range */
    if (s != FL_OK) {
    } else if (cfg->kind == FL_OPT_ADAMW) {
        s = fl_backend_calloc(model->be, model->pool, FL_TAG_OPTIM, bytes, (void **)&o->m);
        if (s == FL_OK) s = fl_backend_calloc(model->be, model->pool, FL_TAG_OPTIM, bytes, (void **)&o->v);
    } else if (cfg->kind == FL_OPT_SGD) {
        if (cfg->momentum != 0.0f) s = fl_backend_calloc(model->be, model->pool, FL_TAG_OPTIM, bytes, (void **)&o->buf);
    } else {
        /* 8-bit: one OPTIM allocation, bound tensor by tensor (zeroed = fresh state); under ZeRO
         * each tensor's piece (whole blocks) that meets this rank's chunk */
        o->st8 = calloc((size_t)o->n_tensors + 1, sizeof *o->st8);
        o->p8_a = calloc((size_t)o->n_tensors + 1, sizeof *o->p8_a);
        o->p8_n = calloc((size_t)o->n_tensors + 1, sizeof *o->p8_n);
        if (!o->st8 || !o->p8_a || !o->p8_n) s = fl_errorf(FL_ERR_OOM, "8-bit optimizer bookkeeping: out of host memory");
        for (int i = 0; s == FL_OK && i < o->n_tensors; i++) {
            fl_optim_8bit_piece(o->n, o->t_off[i], o->t_n[i], world, rank, &o->p8_a[i], &o->p8_n[i]);
            o->state8_bytes += fl_adam8bit_state_bytes_ex(o->p8_n[i], fl_adam8bit_is_8bit(o->t_n[i]));
        }
        if (s == FL_OK) s = fl_backend_calloc(model->be, model->pool, FL_TAG_OPTIM, o->state8_bytes, &o->state8);
        size_t off = 0;
        for (int i = 0; s == FL_OK && i < o->n_tensors; i++) {
            int e8 = fl_adam8bit_is_8bit(o->t_n[i]);
            s = fl_adam8bit_state_bind_ex(&o->st8[i], o->p8_n[i], e8, (char *)o->state8 + off);
            off += fl_adam8bit_state_bytes_ex(o->p8_n[i], e8);
        }
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
    fl_mem_free(o->model->pool, o->state8);
    free(o->st8);
    free(o->p8_a);
    free(o->p8_n);
    free(o->t_off);
    free(o->t_n);
    memset(o, 0, sizeof *o);
}

/* Whether this rank holds only its range of the reduced gradients (ZeRO-2, and ZeRO-3 / FSDP whose
 * optimizer sees only the rank's shard: [s_off, s_off + s_len) is the whole of it). */
static int grads_sharded(const fl_optimizer *o) { return o->dist && o->dist->stage >= 2; }

static const void *g_at(const fl_optimizer *o, size_t off) { return (const char *)o->g + off * fl_dtype_size(o->gt); }

/* Loss scaling: any inf/NaN among the scaled gradients (times inv_scale); under ZeRO-2 each rank
 * checks its range and the verdicts are summed, so every rank decides alike. */
static fl_status found_inf(const fl_optimizer *o, float inv_scale, int *found) {
    *found = 0;
    const fl_backend *be = o->model->be;
    if (!grads_sharded(o)) return be->check_finite(be, o->g, o->gt, o->n, inv_scale, found);
    FL_TRY(be->check_finite(be, g_at(o, o->s_off), o->gt, o->s_len, inv_scale, found));
    double v = *found != 0;
    FL_TRY(o->dist->sum(o->dist->ud, &v, 1));
    *found = v > 0;
    return FL_OK;
}

static double chunk_sumsq(const fl_optimizer *o, size_t off, size_t len) {
    const fl_backend *be = o->model->be;
    if (!len) return 0.0;
    if (o->gt == FL_F32) return be->sumsq(be, (const float *)g_at(o, off), len);
    return be->sumsq_ex(be, g_at(o, off), o->gt, len);
}

/* The squared global gradient norm: the squared norms of the world's chunks summed in rank order
 * in double. DDP and ZeRO-1 hold every chunk and add them here; ZeRO-2 ranks hold one each and add
 * them with dist->sum (the same order): all three clip with the same bits. */
static fl_status grad_sumsq(const fl_optimizer *o, double *out) {
    if (grads_sharded(o)) {
        double v = chunk_sumsq(o, o->s_off, o->s_len);
        FL_TRY(o->dist->sum(o->dist->ud, &v, 1));
        *out = v;
        return FL_OK;
    }
    int world = o->dist ? o->dist->world : 1;
    double acc = 0;
    for (int r = 0; r < world; r++) {
        size_t off, len;
        fl_comm_chunk(o->n, world, r, &off, &len);
        acc += chunk_sumsq(o, off, len);
    }
    *out = acc;
    return FL_OK;
}

double fl_grad_norm(const fl_model *m) {
    size_t n = m->pp ? m->pp->numel : m->layout.numel; /* sharded: this rank's shard only */
    if (m->lora) return sqrt(m->be->sumsq(m->be, m->lora->grads, m->lora->numel));
    if (m->g16) return sqrt(m->be->sumsq_ex(m->be, m->g16, m->store_dtype, n));
    return sqrt(m->be->sumsq(m->be, m->grads, n));
}

fl_status fl_optim_step(fl_optimizer *o, float lr, float max_norm, double *norm_out) {
    fl_model *m = o->model;
    const fl_backend *be = m->be;
    if (!o->g) return fl_errorf(FL_ERR_INVALID, "optimizer step without gradient buffers");
    double norm = -1.0;
    float scale = 1.0f;
    o->last_skipped = 0;
    if (o->use_loss_scale) {
        float inv = fl_loss_scale_inv(&o->ls);
        int found;
        FL_TRY(found_inf(o, inv, &found));
        if (fl_loss_scale_update(&o->ls, found)) { /* overflow: no update, scale backed off */
            o->last_skipped = 1;
            fl_model_grads_live(m, 0); /* discarded */
            if (norm_out) *norm_out = NAN;
            return FL_OK;
        }
        scale = inv; /* unscale inside the update */
    }
    if (max_norm > 0 || norm_out) {
        double sq;
        FL_TRY(grad_sumsq(o, &sq));
        norm = sqrt(sq) * scale;
    }
    /* inf/NaN gradients (no loss scaling to absorb them): refuse the update, the weights stay as they were */
    if ((max_norm > 0 || norm_out) && !isfinite(norm)) return fl_errorf(FL_ERR_NONFINITE, "the gradient norm is %s", isnan(norm) ? "NaN" : "inf");
    if (max_norm > 0) {
        double coef = max_norm / (norm + 1e-6);
        if (coef < 1.0) scale = (float)(coef * scale);
    }
    if (norm_out) *norm_out = norm;
    o->step++;
    const fl_optim_config *c = &o->cfg;
    /* this rank's range (everything but under ZeRO): elementwise updates, so a range updates
     * with the same arithmetic as the whole buffer does */
    size_t n = o->s_len;
    void *p = (char *)o->p + o->s_off * fl_dtype_size(o->pt), *g = (void *)g_at(o, o->s_off);
    const int f32 = o->pt == FL_F32 && o->gt == FL_F32;
    if (c->kind == FL_OPT_ADAMW && c->state_dtype == FL_F32 && f32) {
        be->adamw_update(be, p, g, o->m, o->v, n, lr, c->beta1, c->beta2, c->eps, c->weight_decay,
                         o->step, scale);
    } else if (c->kind == FL_OPT_ADAMW) {
        FL_TRY(be->adamw_update_ex(be, p, o->pt, g, o->gt, o->m, o->v, c->state_dtype, n, lr,
                                   c->beta1, c->beta2, c->eps, c->weight_decay, o->step, scale));
    } else if (c->kind == FL_OPT_SGD && c->state_dtype == FL_F32 && f32) {
        be->sgd_update(be, p, g, o->buf, n, lr, c->momentum, c->dampening, c->weight_decay,
                       c->nesterov, o->step == 1, scale);
    } else if (c->kind == FL_OPT_SGD) {
        FL_TRY(be->sgd_update_ex(be, p, o->pt, g, o->gt, o->buf, c->state_dtype, n, lr, c->momentum,
                                 c->dampening, c->weight_decay, c->nesterov, o->step == 1, scale));
    } else {
        /* block-wise state is per tensor, as bitsandbytes keeps it per parameter */
        for (int i = 0; i < o->n_tensors; i++) {
            if (!o->p8_n[i]) continue; /* ZeRO: not in this rank's chunk */
            size_t off = o->t_off[i] + o->p8_a[i];
            FL_TRY(be->adam8bit_update(be, (char *)o->p + off * fl_dtype_size(o->pt), o->pt,
                                       (const char *)o->g + off * fl_dtype_size(o->gt), o->gt, &o->st8[i], lr, c->beta1,
                                       c->beta2, c->eps, c->weight_decay, o->step, scale));
        }
    }
    /* ZeRO: every rank's updated range to every rank before anything reads the weights */
    if (o->dist && o->dist->stage > 0 && o->dist->gather) FL_TRY(o->dist->gather(o->dist->ud, o));
    if (!m->lora) fl_model_sync_compute_copy(m); /* mixed precision: matmuls read the refreshed copy */
    fl_model_grads_live(m, 0); /* consumed: the next step starts from zero */
    return FL_OK;
}

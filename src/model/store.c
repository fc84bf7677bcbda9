/* The parameter store's binding (store.h): the weight, 1-D parameter and gradient views the ops
 * read, whichever implementation holds them. Moved out of blocks.c (paddr, P1, G,
 * fl_linear_set_weight, the gradient staging): the same pointers, the same conversions. */
#include "store.h"

int fl_store_is_q4(const fl_param_store *s, int i) { return s->q4 && s->q4[i].packed != NULL; }
size_t fl_store_off(const fl_param_store *s, int i) { return s->soff ? s->soff[i] : s->lay->params[i].offset; }
int fl_store_sharded(const fl_param_store *s) { return !s->ops->whole; }
void *fl_store_param_at(const fl_param_store *s, size_t so) { return s->ops->param_at(s, so); }
fl_status fl_store_gather(fl_param_store *s, int g, int next) { return s->ops->gather(s, g, next); }
void fl_store_release(fl_param_store *s, int g) { s->ops->release(s, g); }
fl_status fl_store_grads_begin(fl_param_store *s, int g) { return s->ops->grads_begin(s, g); }

int fl_store_group_of(const fl_param_store *s, size_t off) {
    const size_t *go = s->lay->group_offset;
    int g = 0;
    while (g + 1 < s->lay->n_groups && off >= go[g + 1]) g++;
    return g;
}

void fl_store_bind_weight(const fl_param_store *s, int wi, int out, fl_weight_view *v) {
    v->w = NULL;
    v->wc = NULL;
    v->wct = s->compute_dtype;
    v->n_q4 = 0;
    if (wi < 0) return;
    if (fl_store_is_q4(s, wi)) {
        /* 4-bit base: a fused output (q|k|v, gate|up) is consecutive 4-bit entries, in row order */
        for (int r = 0, i = wi; r < out && i < s->lay->n && v->n_q4 < 3 && fl_store_is_q4(s, i); i++) {
            v->q4[v->n_q4++] = &s->q4[i];
            r += (int)s->lay->params[i].shape[0];
        }
        return;
    }
    size_t so = fl_store_off(s, wi);
    if (s->dtype != FL_F32) { /* 16-bit storage: the matmul reads the stored weights */
        v->wc = s->ops->param_at(s, so);
        v->wct = s->dtype;
        return;
    }
    v->w = s->ops->param_at(s, so);
    v->wc = s->ops->compute_at(s, so);
}

const float *fl_store_bind_1d(const fl_param_store *s, int i, float **cur) { return fl_store_bind_1d_w(s, i, cur, NULL); }

void fl_store_widen_flush(const fl_param_store *s, fl_store_widen *w) {
    const fl_backend *be = s->be;
    if (w->n > 1 && be->convert_many)
        (void)FL_RUN(be, convert_many, w->n, w->dst, FL_F32, (const void *const *)w->src, s->dtype, w->len);
    else
        for (int k = 0; k < w->n; k++) (void)FL_RUN(be, convert, w->dst[k], FL_F32, w->src[k], s->dtype, w->len[k]);
    w->n = 0;
}

const float *fl_store_bind_1d_w(const fl_param_store *s, int i, float **cur, fl_store_widen *w) {
    return i < 0 ? NULL : fl_store_bind_span_w(s, i, s->lay->params[i].numel, cur, w);
}

const float *fl_store_bind_span_w(const fl_param_store *s, int i, size_t n, float **cur, fl_store_widen *w) {
    if (i < 0) return NULL;
    const void *src = s->ops->param_at(s, fl_store_off(s, i));
    if (s->dtype == FL_F32) return src;
    float *v = *cur;
    *cur += n;
    if (!src) return NULL; /* sharded: its group is not gathered */
    if (!w) {
        FL_RUN(s->be, convert, v, FL_F32, src, s->dtype, n);
        return v;
    }
    if (w->n == FL_CONVERT_MANY_MAX) fl_store_widen_flush(s, w);
    w->dst[w->n] = v, w->src[w->n] = src, w->len[w->n++] = n;
    return v;
}

float *fl_store_grad(const fl_param_store *s, size_t off) {
    if (off == (size_t)-1) return NULL;
    if (s->dtype == FL_F32) return s->ops->grad_at(s, off);
    if (!s->g16) return NULL;
    return s->gstage + (off - s->lay->group_offset[fl_store_group_of(s, off)]);
}

void fl_store_stage_begin(fl_param_store *s, size_t n) {
    if (s->g16) FL_RUN(s->be, zero, s->gstage, n * sizeof(float));
}

fl_status fl_store_stage_flush(fl_param_store *s, size_t off, size_t n) {
    if (!s->g16) return FL_OK;
    /* g16[off : off+n] += gstage[0 : n], widened to fp32, rounded once (sharded: into the
     * gradient view of off's group) */
    void *dst = s->ops->grad_at(s, off);
    if (!dst)
        return fl_errorf(FL_ERR_INTERNAL, "sharded gradients: group %d has no gradient buffer", fl_store_group_of(s, off));
    return FL_RUN(s->be, accumulate16, dst, s->dtype, s->gstage, n);
}

fl_status fl_store_grads_ready(fl_param_store *s, int g) {
    FL_TRY(s->ops->grads_ready(s, g));
    if (s->grad_ready) {
        const size_t *go = s->lay->group_offset;
        FL_TRY(s->grad_ready(s->grad_ready_ud, go[g], go[g + 1] - go[g]));
    }
    return FL_OK;
}

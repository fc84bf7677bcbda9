/* Tensor parallelism's part of the training step (fitllm/tp.h): the optimizer of a rank's slice decides on
 * the whole model's gradient. The slice's own parts are src/model/tp.c and graph_tp.c. */
#include <stdlib.h>
#include <string.h>

#include "fitllm/pp.h"
#include "fitllm/tp.h"

/* v (one double per rank, as pairs of F32 words: the all-gather copies bits) summed in rank order */
static fl_status sum_ranks(fl_comm *c, double v, double *out) {
    const int n = fl_comm_size(c);
    double stack[16], *all = n <= 16 ? stack : malloc((size_t)n * sizeof *all);
    if (!all) return fl_errorf(FL_ERR_OOM, "tensor parallel: out of host memory");
    fl_status s = fl_comm_all_gather(c, &v, all, (size_t)n * 2, FL_F32);
    double acc = 0;
    for (int r = 0; s == FL_OK && r < n; r++) acc += all[r];
    *out = acc;
    if (all != stack) free(all);
    return s;
}

/* v summed over the group in rank order, then (TP x PP) over the pipeline's stages in stage order: every rank of the
 * model-parallel ranks gets the same bits */
static fl_status sum_group(const fl_tp_dist *d, double v, double *out) {
    FL_TRY(sum_ranks(d->comm, v, out));
    return d->pipe ? sum_ranks(d->pipe, *out, out) : FL_OK;
}

/* the squared norm of the whole model's gradient: each rank's split entries, and rank 0's replicated ones (the
 * same bits on every rank; a row-parallel bias trains on rank 0 alone). Under DDP on the data-parallel axis
 * every rank of it holds the same reduced gradient: the tensor-parallel group's sum is the whole norm. Under
 * ZeRO-1/2 there a rank adds the part of each entry in its chunk [off, off + len) of the slice's buffer (ZeRO-2
 * holds no other reduced gradient), the axis sums the chunks in rank order, then the group. */
static fl_status tp_grad_sumsq(void *ud, const fl_optimizer *o, double *out) {
    const fl_tp_dist *d = ud;
    const fl_model *m = d->m;
    const fl_backend *be = m->be;
    const int rank = fl_comm_rank(d->comm), zero = d->inner && d->inner->stage > 0;
    const size_t c0 = zero ? o->shard.off : 0, c1 = zero ? o->shard.off + o->shard.len : o->w.n;
    const size_t es = fl_dtype_size(o->w.gt);
    double v = 0;
    for (int i = 0; i < m->layout.n; i++) {
        const fl_param_info *p = &m->layout.params[i];
        if (rank != 0 && fl_tp_entry_split(&m->layout, i) == FL_TP_REPLICATED) continue;
        if (!fl_pp_stage_owns(m, i)) continue; /* TP x PP: an end this stage does not run (always owned without PP) */
        const size_t a = p->offset > c0 ? p->offset : c0, b = p->offset + p->numel < c1 ? p->offset + p->numel : c1;
        if (a < b) v += be->sumsq(be, (const char *)o->w.g + a * es, o->w.gt, b - a);
    }
    if (zero) FL_TRY(d->inner->sum(d->inner->ud, &v, 1));
    return fl_error_prefix(sum_group(d, v, out), "tensor parallel: the gradient norm");
}

static fl_status tp_any(void *ud, int *flag) {
    const fl_tp_dist *d = ud;
    double v = *flag != 0;
    FL_TRY(fl_error_prefix(sum_group(d, v, &v), "tensor parallel: the overflow check"));
    *flag = v > 0;
    return FL_OK;
}

/* the data-parallel hooks (DDP, ZeRO-1/2 on the other axis of the grid) under tensor parallelism's. A sum is the
 * whole grid's (the axis, then the group): its users decide for every rank (ZeRO-2's overflow verdict). */
static fl_status inner_sum(void *ud, double *v, int n) {
    const fl_tp_dist *d = ud;
    FL_TRY(d->inner->sum(d->inner->ud, v, n));
    for (int k = 0; k < n; k++) FL_TRY(sum_group(d, v[k], &v[k]));
    return FL_OK;
}
static fl_status inner_gather(void *ud, fl_optimizer *o) {
    const fl_optim_dist *in = ((fl_tp_dist *)ud)->inner;
    return in->gather ? in->gather(in->ud, o) : FL_OK;
}
static fl_status inner_max(void *ud, float *v, size_t n) {
    const fl_optim_dist *in = ((fl_tp_dist *)ud)->inner;
    return in->max(in->ud, v, n);
}

fl_status fl_tp_optim_attach(fl_optimizer *o, fl_comm *host_comm, fl_tp_dist *d) {
    const fl_optim_dist *in = o->shard.dist;
    if (in && (in->stage > 2 || in->grad_sumsq))
        return fl_errorf(FL_ERR_UNSUPPORTED, "tensor parallel: the data-parallel axis runs DDP, ZeRO-1 or ZeRO-2 (its "
                         "optimizer is at stage %d)", in->stage);
    if (o->w.n != o->model->layout.numel || o->w.p != fl_model_params_data(o->model))
        return fl_errorf(FL_ERR_UNSUPPORTED, "tensor parallel: the optimizer must train the slice's parameters (not "
                         "LoRA adapters)");
    memset(d, 0, sizeof *d);
    d->comm = host_comm;
    d->m = o->model;
    d->dist.world = 1; /* the data is not split: every rank of the group trains the same batch */
    d->dist.ud = d;
    if (in) { /* DDP over the data-parallel axis: its ranks and sums, the norm and verdicts over the group */
        d->inner = in;
        d->dist.world = in->world, d->dist.rank = in->rank, d->dist.stage = in->stage;
        d->dist.sum = inner_sum, d->dist.gather = inner_gather, d->dist.max = inner_max;
    }
    d->dist.grad_sumsq = tp_grad_sumsq;
    d->dist.any = tp_any;
    o->shard.dist = &d->dist;
    return FL_OK;
}

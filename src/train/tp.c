/* Tensor parallelism's part of the training step (fitllm/tp.h): the optimizer of a rank's slice decides on
 * the whole model's gradient. The slice's own parts are src/model/tp.c and graph_tp.c. */
#include <stdlib.h>
#include <string.h>

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

/* the squared norm of the whole model's gradient: each rank's split entries, and rank 0's replicated ones (the
 * same bits on every rank; a row-parallel bias trains on rank 0 alone). Under DDP on the data-parallel axis
 * every rank of it holds the same reduced gradient: the tensor-parallel group's sum is the whole norm. */
static fl_status tp_grad_sumsq(void *ud, const fl_optimizer *o, double *out) {
    const fl_tp_dist *d = ud;
    const fl_model *m = d->m;
    const fl_backend *be = m->be;
    const int rank = fl_comm_rank(d->comm);
    double v = 0;
    for (int i = 0; i < m->layout.n; i++) {
        const fl_param_info *p = &m->layout.params[i];
        if (rank != 0 && fl_tp_entry_split(&m->layout, i) == FL_TP_REPLICATED) continue;
        v += be->sumsq(be, (const char *)o->w.g + p->offset * fl_dtype_size(o->w.gt), o->w.gt, p->numel);
    }
    return fl_error_prefix(sum_ranks(d->comm, v, out), "tensor parallel: the gradient norm");
}

static fl_status tp_any(void *ud, int *flag) {
    const fl_tp_dist *d = ud;
    double v = *flag != 0;
    FL_TRY(fl_error_prefix(sum_ranks(d->comm, v, &v), "tensor parallel: the overflow check"));
    *flag = v > 0;
    return FL_OK;
}

/* the data-parallel hooks (DDP on the other axis of the grid) under tensor parallelism's */
static fl_status inner_sum(void *ud, double *v, int n) {
    const fl_optim_dist *in = ((fl_tp_dist *)ud)->inner;
    return in->sum(in->ud, v, n);
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
    if (in && (in->stage != 0 || in->grad_sumsq))
        return fl_errorf(FL_ERR_UNSUPPORTED, "tensor parallel: the data-parallel axis runs DDP only so far (its "
                         "optimizer is sharded: stage %d)", in->stage);
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
        d->dist.world = in->world, d->dist.rank = in->rank, d->dist.stage = 0;
        d->dist.sum = inner_sum, d->dist.gather = inner_gather, d->dist.max = inner_max;
    }
    d->dist.grad_sumsq = tp_grad_sumsq;
    d->dist.any = tp_any;
    o->shard.dist = &d->dist;
    return FL_OK;
}

/* The FSDP parameter store (store.h; ZeRO-3 / FULL_SHARD): the dense buffers hold this rank's
 * shard of every layout group, and a group's whole parameters, compute copy and gradient buffer are
 * the views of the fl_param_provider that src/train/fsdp.c implements, present between gather and
 * release (gradients: grads_begin and grads_ready). The model never talks to other ranks. A sharded
 * model has no 4-bit entries: store offsets are layout offsets. */
#include "store.h"

/* element `off` of group g's view buffer v (element size es), NULL while the group is not gathered */
static void *view_at(const fl_param_store *s, void *v, size_t off, size_t es) {
    return v ? (char *)v + (off - s->lay->group_offset[fl_store_group_of(s, off)]) * es : NULL;
}

void *fl_store_pp_param_at(const fl_param_store *s, size_t so) {
    return view_at(s, s->pp->views[fl_store_group_of(s, so)].p, so, fl_dtype_size(s->dtype));
}

const void *fl_store_pp_compute_at(const fl_param_store *s, size_t so) {
    return view_at(s, s->pp->views[fl_store_group_of(s, so)].wc, so, fl_dtype_size(s->compute_dtype));
}

void *fl_store_pp_grad_at(const fl_param_store *s, size_t off) {
    return view_at(s, s->pp->views[fl_store_group_of(s, off)].g, off, fl_dtype_size(s->dtype));
}

fl_status fl_store_pp_gather(fl_param_store *s, int g, int next) { return s->pp->gather(s->pp->ud, g, next); }
void fl_store_pp_release(fl_param_store *s, int g) { s->pp->release(s->pp->ud, g); }
fl_status fl_store_pp_grads_begin(fl_param_store *s, int g) { return s->pp->grads_begin(s->pp->ud, g); }
fl_status fl_store_pp_grads_ready(fl_param_store *s, int g) { return s->pp->grads_ready(s->pp->ud, g); }
void fl_store_pp_zero_grads(fl_param_store *s) {
    if (s->pp->zero_grads) s->pp->zero_grads(s->pp->ud);
}

const fl_param_store_ops fl_store_fsdp_ops = {
    "fsdp", 0, fl_store_pp_param_at, fl_store_pp_compute_at, fl_store_pp_grad_at, fl_store_pp_gather,
    fl_store_pp_release, fl_store_pp_grads_begin, fl_store_pp_grads_ready, fl_store_pp_zero_grads,
};

void fl_store_make_shard(fl_param_store *s, void *shard, fl_param_provider *pp) {
    if (s->dtype == FL_F32) s->params = shard;
    else s->p16 = shard;
    s->pp = pp;
    s->numel = pp->numel;
    s->ops = &fl_store_fsdp_ops;
}

void fl_store_make_whole(fl_param_store *s) {
    s->pp = NULL; /* an offloaded store keeps tpool: its buffers go back there */
    s->numel = s->lay->numel;
    s->ops = &fl_store_dense_ops;
}

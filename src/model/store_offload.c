/* The offloaded parameter store (store.h; parameter offload, --offload_param_device cpu | nvme, Lightning's
 * fsdp_cpu_offload, ZeRO-Infinity's offload_param): ZeRO-3's store whose dense buffers (this rank's shard of
 * the parameters and of the gradients; at one rank the whole model) live in a host tier, the host's pool
 * beside the device (`tpool`: page-locked memory on a GPU, ordinary memory elsewhere, or files under
 * nvme_path), never in the device pool. A group's parameters exist on the device only between gather and
 * release, in the views of the provider src/train/fsdp.c implements: gather copies this rank's piece up (ahead
 * of its use: the next unit is posted while this one computes) and all-gathers it; grads_ready reduces the
 * group's gradient and sends the rank's piece down into the host shard. The optimizer updates the host shard
 * in place on the host's kernels (src/train/optim.c, fl_optim_home.params_host). The binding (param_at,
 * compute_at, grad_at) is the FSDP store's: the device views of the gathered group. */
#include "store.h"

const fl_param_store_ops fl_store_offload_ops = {
    "offload", 0, fl_store_pp_param_at, fl_store_pp_compute_at, fl_store_pp_grad_at, fl_store_pp_gather,
    fl_store_pp_release, fl_store_pp_grads_begin, fl_store_pp_grads_ready, fl_store_pp_zero_grads,
};

void fl_store_make_offloaded(fl_param_store *s, void *shard, fl_param_provider *pp, const fl_backend *tier_be,
                             fl_mem_pool *tier_pool) {
    fl_store_make_shard(s, shard, pp);
    s->tpool = tier_pool;
    s->tbe = tier_be;
    s->ops = &fl_store_offload_ops;
}

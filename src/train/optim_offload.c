/* The offloaded optimizer update (ZeRO-Offload; fitllm/train.h fl_optim_update_ops): fl_optim_init_offload installs
 * it where the update is staged through the host tier or the state (or the parameters) live on NVMe; fl_optim_step
 * and fl_optim_update_part call it for this rank's range or a part of it. */
#include "fitllm/train.h"
#include "dp.h"

static const void *g_at(const fl_optimizer *o, size_t off) { return (const char *)o->w.g + off * o->w.ges; }

/* The state of elements [a, a + len) of the rank's range, one call per state array (NVMe offload's
 * residency hints) */
static fl_status state_range(const fl_optimizer *o, size_t a, size_t len, fl_disk_advice what) {
    const size_t ses = o->cfg.state_dtype == FL_BF16 ? 2 : 4;
    const size_t at = o->shard.off + a, pes = o->w.pes, ges = o->w.ges;
    /* the state's arrays in its pool; parameter offload on NVMe: the parameters and gradients in theirs */
    const void *arr[5] = {o->st.m, o->st.v, o->st.buf, o->home.ppool ? (const char *)o->w.p + at * pes : NULL,
                          o->home.ppool ? g_at(o, at) : NULL};
    for (int i = 0; i < 5; i++) {
        if (!arr[i] || !len) continue;
        fl_mem_pool *pool = i < 3 ? o->home.pool : o->home.ppool;
        const size_t es = i < 3 ? ses : i == 3 ? pes : ges, off = i < 3 ? a * ses : 0;
        const char *x = (const char *)arr[i] + off;
        FL_TRY(fl_mem_disk_advise(pool, x, len * es, what));
    }
    return FL_OK;
}

/* CPU offload (ZeRO-Offload), piece by piece over this rank's range:
 *   staged (a device the host cannot read): the (reduced) gradients and the parameters down to the host
 *   tier, the update there with the host backend's kernels and the state, the parameters back up. The
 *   device's stream orders piece k's upload before piece k + 1's download (to_host waits), so one staging
 *   piece serves every piece; the last upload is waited for before the step returns;
 *   NVMe (the state in a disk pool): before piece k, the read-ahead of piece k + 1's state starts; after
 *   it, piece k's write-back starts and piece k - 1's is waited for and its pages dropped, so the process
 *   holds about three pieces of the state while the disk reads and writes beside the update. */
static fl_status offload_update(const fl_optimizer *o, size_t a0, size_t n, float lr, float scale, int step) {
    const fl_backend *be = o->model->be;
    const size_t pes = o->w.pes, ges = o->w.ges, P = o->home.piece ? o->home.piece : n;
    const size_t end = a0 + n;
    size_t prev = 0, prev_len = 0;
    for (size_t a = a0; a < end; a += P) {
        const size_t len = end - a < P ? end - a : P, at = o->shard.off + a;
        char *p = (char *)o->w.p + at * pes;
        if (o->home.disk || o->home.ppool) {
            if (a == a0) FL_TRY(state_range(o, a, len, FL_DISK_PREFETCH));
            FL_TRY(state_range(o, a + len, end - a - len < P ? end - a - len : P, FL_DISK_PREFETCH));
        }
        if (o->home.hp) {
            FL_TRY(fl_error_prefix(FL_RUN(be, to_host, o->home.hg, g_at(o, at), len * ges),
                                   "CPU offload: gradients to the host"));
            FL_TRY(
                fl_error_prefix(FL_RUN(be, to_host, o->home.hp, p, len * pes), "CPU offload: parameters to the host"));
            FL_TRY(fl_optim_update_range(o, o->home.be, o->home.hp, o->home.hg, a, len, lr, scale, step));
            FL_TRY(fl_error_prefix(FL_RUN(be, to_device, p, o->home.hp, len * pes),
                                   "CPU offload: parameters to the device"));
        } else { /* host memory: in place */
            FL_TRY(fl_optim_update_range(o, o->home.be, p, g_at(o, at), a, len, lr, scale, step));
        }
        if (o->home.disk || o->home.ppool) {
            FL_TRY(state_range(o, a, len, FL_DISK_WRITEBACK));
            if (prev_len) FL_TRY(state_range(o, prev, prev_len, FL_DISK_RELEASE));
            prev = a, prev_len = len;
        }
    }
    if ((o->home.disk || o->home.ppool) && prev_len) FL_TRY(state_range(o, prev, prev_len, FL_DISK_RELEASE));
    return o->home.hp ? fl_error_prefix(FL_RUN(be, sync), "CPU offload: the updated parameters") : FL_OK;
}

const fl_optim_update_ops fl_optim_offload_update = {.name = "offload", .range = offload_update};

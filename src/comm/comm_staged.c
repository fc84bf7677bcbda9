/* The staged device communicator (fl_comm_staged_create, include/fitllm/comm.h): collectives on a
 * backend's device memory moved through host buffers and run by a host communicator.
 *
 * Each collective, on every rank, in the same order:
 *   1. the rank's part of the device buffer comes to a host buffer (st->to_host: after the ops the
 *      backend has queued; the CUDA backend's copy synchronizes its stream),
 *   2. the host communicator runs the same collective in place on the host buffer (so results are
 *      the host implementation's bits: the threads implementation's sums in rank order),
 *   3. the result goes back to the device (st->to_device).
 * Everything completes before the call returns (the requests are done when posted).
 *
 * Host buffers: one per collective, as large as the collective's buffer (count elements; a
 * broadcast's or all-reduce's whole buffer), malloc'd for the call and freed after it. They are
 * host memory, outside the device's accounting pool, like NCCL's own buffers.
 *
 * Used where NCCL cannot be: ranks that are threads of one process sharing one GPU (the lab's
 * in-process DDP and FSDP rows; NCCL refuses two ranks on one device). A rank whose copy fails
 * aborts the host communicator, so the other ranks' collectives fail instead of waiting. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm-impl.h"

typedef struct {
    fl_comm *host;
    fl_comm_staging st;
    int owns_host; /* a split's host communicator is its own */
} scomm;

static unsigned long g_calls; /* collectives staged in this process (tests: a run went this way) */
unsigned long fl_comm_staged_calls(void) { return __atomic_load_n(&g_calls, __ATOMIC_RELAXED); }

static fl_status done_req(fl_comm *c, fl_coll_kind kind, size_t count, fl_dtype dt, fl_comm_op op, fl_comm_req **req) {
    __atomic_fetch_add(&g_calls, 1, __ATOMIC_RELAXED);
    return fl_comm_done_req(c, kind, count, dt, op, req);
}

/* A failed copy: the other ranks must not wait for this one in the host collective. */
static fl_status copy_failed(fl_comm *c, fl_status s, const char *what, const char *dir) {
    scomm *m = c->impl;
    char why[512], msg[256];
    snprintf(why, sizeof why, "%s", fl_error_message()); /* fl_comm_fail rewrites the message */
    snprintf(msg, sizeof msg, "%s: the copy %s failed", what, dir);
    m->host->vt->abort(m->host, 1, msg);
    return fl_comm_fail(c, s, what, "the copy %s failed: %s", dir, why);
}

static fl_status host_buf(fl_comm *c, size_t bytes, const char *what, char **out) {
    *out = malloc(bytes ? bytes : 1);
    if (!*out) {
        scomm *m = c->impl;
        m->host->vt->abort(m->host, 1, "out of host memory for a staged collective");
        return fl_comm_fail(c, FL_ERR_OOM, what, "no host memory for a %zu-byte staging buffer", bytes);
    }
    return FL_OK;
}

static fl_status s_all_reduce(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt, fl_comm_op op,
                              fl_comm_req **req) {
    scomm *m = c->impl;
    char what[128], *h;
    fl_comm_what(what, sizeof what, FL_COLL_ALL_REDUCE, count, dt, op, 0);
    size_t bytes = count * fl_dtype_size(dt);
    FL_TRY(host_buf(c, bytes, what, &h));
    fl_status s = m->st.to_host(m->st.ctx, h, send, bytes);
    if (s != FL_OK) s = copy_failed(c, s, what, "to the host");
    if (s == FL_OK) s = fl_comm_all_reduce(m->host, h, h, count, dt, op);
    if (s == FL_OK && (s = m->st.to_device(m->st.ctx, recv, h, bytes)) != FL_OK) s = copy_failed(c, s, what, "to the device");
    free(h);
    return s == FL_OK ? done_req(c, FL_COLL_ALL_REDUCE, count, dt, op, req) : s;
}

static fl_status s_reduce_scatter(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt, fl_comm_op op,
                                  fl_comm_req **req) {
    scomm *m = c->impl;
    char what[128], *h;
    fl_comm_what(what, sizeof what, FL_COLL_REDUCE_SCATTER, count, dt, op, 0);
    size_t es = fl_dtype_size(dt), off, len;
    fl_comm_chunk(count, c->size, c->rank, &off, &len);
    FL_TRY(host_buf(c, count * es, what, &h));
    fl_status s = m->st.to_host(m->st.ctx, h, send, count * es);
    if (s != FL_OK) s = copy_failed(c, s, what, "to the host");
    if (s == FL_OK) s = fl_comm_reduce_scatter(m->host, h, h + off * es, count, dt, op); /* in place: our chunk */
    if (s == FL_OK && len && (s = m->st.to_device(m->st.ctx, recv, h + off * es, len * es)) != FL_OK)
        s = copy_failed(c, s, what, "to the device");
    free(h);
    return s == FL_OK ? done_req(c, FL_COLL_REDUCE_SCATTER, count, dt, op, req) : s;
}

static fl_status s_all_gather(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt, fl_comm_req **req) {
    scomm *m = c->impl;
    char what[128], *h;
    fl_comm_what(what, sizeof what, FL_COLL_ALL_GATHER, count, dt, FL_COMM_SUM, 0);
    size_t es = fl_dtype_size(dt), off, len;
    fl_comm_chunk(count, c->size, c->rank, &off, &len);
    FL_TRY(host_buf(c, count * es, what, &h));
    fl_status s = len ? m->st.to_host(m->st.ctx, h + off * es, send, len * es) : FL_OK;
    if (s != FL_OK) s = copy_failed(c, s, what, "to the host");
    if (s == FL_OK) s = fl_comm_all_gather(m->host, h + off * es, h, count, dt); /* in place: our chunk */
    if (s == FL_OK && (s = m->st.to_device(m->st.ctx, recv, h, count * es)) != FL_OK)
        s = copy_failed(c, s, what, "to the device");
    free(h);
    return s == FL_OK ? done_req(c, FL_COLL_ALL_GATHER, count, dt, FL_COMM_SUM, req) : s;
}

static fl_status s_broadcast(fl_comm *c, void *buf, size_t count, fl_dtype dt, int root, fl_comm_req **req) {
    scomm *m = c->impl;
    char what[128], *h;
    fl_comm_what(what, sizeof what, FL_COLL_BROADCAST, count, dt, FL_COMM_SUM, root);
    size_t bytes = count * fl_dtype_size(dt);
    FL_TRY(host_buf(c, bytes, what, &h));
    fl_status s = FL_OK;
    if (c->rank == root && (s = m->st.to_host(m->st.ctx, h, buf, bytes)) != FL_OK)
        s = copy_failed(c, s, what, "to the host");
    if (s == FL_OK) s = fl_comm_broadcast(m->host, h, count, dt, root);
    if (s == FL_OK && c->rank != root && (s = m->st.to_device(m->st.ctx, buf, h, bytes)) != FL_OK)
        s = copy_failed(c, s, what, "to the device");
    free(h);
    return s == FL_OK ? done_req(c, FL_COLL_BROADCAST, count, dt, FL_COMM_SUM, req) : s;
}

static fl_status s_barrier(fl_comm *c) { return fl_comm_barrier(((scomm *)c->impl)->host); }

static void s_abort(fl_comm *c, int code, const char *msg) {
    scomm *m = c->impl;
    m->host->vt->abort(m->host, code, msg);
}

static int s_release(fl_comm *c, const char *msg) { return fl_comm_release_peers(((scomm *)c->impl)->host, msg); }

static void s_destroy(fl_comm *c) {
    scomm *m = c->impl;
    if (m && m->owns_host) fl_comm_destroy(m->host);
    free(m);
    free(c);
}

static fl_status staged_over(fl_comm *part, void *ud, fl_comm **out) {
    return fl_comm_staged_create(part, &((scomm *)ud)->st, out);
}

static fl_status s_split(fl_comm *c, int color, int key, fl_comm **out) {
    FL_TRY(fl_comm_split_over(((scomm *)c->impl)->host, color, key, staged_over, c->impl, out));
    ((scomm *)(*out)->impl)->owns_host = 1;
    return FL_OK;
}

static const fl_comm_vtable k_staged = {
    .name = "staged",
    .iall_reduce = s_all_reduce,
    .ireduce_scatter = s_reduce_scatter,
    .iall_gather = s_all_gather,
    .ibroadcast = s_broadcast,
    .barrier = s_barrier,
    .test = fl_comm_done_test,
    .wait = fl_comm_done_wait,
    .abort = s_abort,
    .release_peers = s_release,
    .destroy = s_destroy,
    .split = s_split,
};

fl_status fl_comm_staged_create(fl_comm *host, const fl_comm_staging *st, fl_comm **out) {
    *out = NULL;
    if (!host || !st || !st->to_host || !st->to_device)
        return fl_errorf(FL_ERR_INVALID, "comm staged: a host communicator and both copies are needed");
    scomm *m = calloc(1, sizeof *m);
    if (!m) return fl_errorf(FL_ERR_OOM, "comm staged: cannot allocate a handle");
    m->host = host;
    m->st = *st;
    fl_status s = fl_comm_alloc_handle_over(&k_staged, host, m, out);
    if (s != FL_OK) free(m);
    return s;
}

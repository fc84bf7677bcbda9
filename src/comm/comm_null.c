/* The null device communicator (fl_comm_null_create, include/fitllm/comm.h): the planner's stand-in
 * for the communicator of a data-parallel run's tensor buffers, as the null backend stands in for
 * the device (src/backend/null/). `fitllm plan --devices N` runs N ranks of the trainer's real
 * set-up and first step as threads (fl_trainer_rehearse_comm), each on its own null backend whose
 * buffers are fake addresses: the collectives on those buffers must move nothing, while the
 * host-level ones (the set-up's agreements, the configuration check, the norms' sums, the splits'
 * membership) steer the run and go to the real host communicator this one wraps.
 *
 * What it does take is the planned communicator's memory: with `mpi_scratch` set, a reduction
 * (all-reduce or reduce-scatter) takes the MPI implementation's receive scratch, (N-1) x this
 * rank's chunk (fl_comm_scratch_bytes), from the pool the host communicator had when this one was
 * made (the trainer's), at its post, and gives it back at its wait, as src/comm/comm_mpi.c does
 * (which may free it a little sooner, at the reduction, when a request is tested: the plan keeps the
 * wait, an upper bound). Without it (threads ranks, NCCL, whose buffers are its own) nothing.
 * Gathers and broadcasts take no scratch in any implementation. Requests complete at once (nothing
 * to wait for); a split splits the host communicator (collective over it) and keeps the rule and
 * the pool. */
#include <stdlib.h>
#include <string.h>

#include "comm/comm-impl.h"

typedef struct nreq {
    fl_comm_req base;
    void *scratch;
    struct nreq *prev, *next; /* outstanding: a failed step leaves some, released by destroy */
} nreq;

typedef struct {
    fl_comm *host;
    int mpi_scratch;
    fl_mem_pool *pool; /* where the MPI scratch is taken (NULL: not taken) */
    int owns_host;     /* a split's host communicator is its own */
    nreq *out;         /* outstanding requests */
} ncomm;

static fl_status post(fl_comm *c, fl_coll_kind kind, size_t count, fl_dtype dt, fl_comm_op op, fl_comm_req **req) {
    ncomm *m = c->impl;
    nreq *r = calloc(1, sizeof *r);
    if (!r) return fl_comm_fail(c, FL_ERR_OOM, "request", "cannot allocate a request");
    r->base.comm = c;
    r->base.kind = kind;
    r->base.count = count;
    r->base.dtype = dt;
    r->base.op = op;
    size_t bytes = 0;
    if (m->mpi_scratch && m->pool && c->size > 1 && (kind == FL_COLL_ALL_REDUCE || kind == FL_COLL_REDUCE_SCATTER)) {
        size_t off, len;
        fl_comm_chunk(count, c->size, c->rank, &off, &len);
        bytes = (size_t)(c->size - 1) * len * fl_dtype_size(dt);
    }
    if (bytes) {
        fl_status s = fl_mem_alloc(m->pool, FL_TAG_WORKSPACE, bytes, &r->scratch);
        if (s != FL_OK) {
            free(r);
            char what[128];
            fl_comm_what(what, sizeof what, kind, count, dt, op, 0);
            return fl_error_prefix(s, "comm %s: rank %d of %d: %s: the MPI receive scratch ((N-1) x chunk)",
                                   c->vt->name, c->rank, c->size, what);
        }
    }
    r->next = m->out;
    if (m->out) m->out->prev = r;
    m->out = r;
    *req = &r->base;
    return FL_OK;
}

static void release(fl_comm *c, fl_comm_req *q) {
    ncomm *m = c->impl;
    nreq *r = (nreq *)q;
    if (r->prev) r->prev->next = r->next;
    else m->out = r->next;
    if (r->next) r->next->prev = r->prev;
    if (r->scratch) fl_mem_free(m->pool, r->scratch);
    free(r);
}

static fl_status n_all_reduce(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt, fl_comm_op op,
                              fl_comm_req **req) {
    (void)send, (void)recv;
    return post(c, FL_COLL_ALL_REDUCE, count, dt, op, req);
}

static fl_status n_reduce_scatter(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt, fl_comm_op op,
                                  fl_comm_req **req) {
    (void)send, (void)recv;
    return post(c, FL_COLL_REDUCE_SCATTER, count, dt, op, req);
}

static fl_status n_all_gather(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt, fl_comm_req **req) {
    (void)send, (void)recv;
    return post(c, FL_COLL_ALL_GATHER, count, dt, FL_COMM_SUM, req);
}

static fl_status n_broadcast(fl_comm *c, void *buf, size_t count, fl_dtype dt, int root, fl_comm_req **req) {
    (void)buf, (void)root;
    return post(c, FL_COLL_BROADCAST, count, dt, FL_COMM_SUM, req);
}

static fl_status n_barrier(fl_comm *c) { (void)c; return FL_OK; }

static fl_status n_test(fl_comm *c, fl_comm_req *r, int *done) {
    release(c, r);
    *done = 1;
    return FL_OK;
}

static fl_status n_wait(fl_comm *c, fl_comm_req *r) {
    release(c, r);
    return FL_OK;
}

static void n_abort(fl_comm *c, int code, const char *msg) {
    ncomm *m = c->impl;
    m->host->vt->abort(m->host, code, msg);
}

static int n_release(fl_comm *c, const char *msg) { return fl_comm_release_peers(((ncomm *)c->impl)->host, msg); }

static void n_destroy(fl_comm *c) {
    ncomm *m = c->impl;
    while (m && m->out) release(c, &m->out->base);
    if (m && m->owns_host) fl_comm_destroy(m->host);
    free(m);
    free(c);
}

static fl_status make(fl_comm *host, int mpi_scratch, fl_mem_pool *pool, fl_comm **out);

static fl_status make_over(fl_comm *part, void *ud, fl_comm **out) {
    const ncomm *m = ud;
    return make(part, m->mpi_scratch, m->pool, out);
}

static fl_status n_split(fl_comm *c, int color, int key, fl_comm **out) {
    FL_TRY(fl_comm_split_over(((ncomm *)c->impl)->host, color, key, make_over, c->impl, out));
    ((ncomm *)(*out)->impl)->owns_host = 1;
    return FL_OK;
}

static const fl_comm_vtable k_null = {
    .name = "null",
    .iall_reduce = n_all_reduce,
    .ireduce_scatter = n_reduce_scatter,
    .iall_gather = n_all_gather,
    .ibroadcast = n_broadcast,
    .barrier = n_barrier,
    .test = n_test,
    .wait = n_wait,
    .abort = n_abort,
    .release_peers = n_release,
    .destroy = n_destroy,
    .split = n_split,
};

static fl_status make(fl_comm *host, int mpi_scratch, fl_mem_pool *pool, fl_comm **out) {
    ncomm *m = calloc(1, sizeof *m);
    if (!m) return fl_errorf(FL_ERR_OOM, "comm null: cannot allocate a handle");
    m->host = host;
    m->mpi_scratch = mpi_scratch;
    m->pool = pool;
    fl_status s = fl_comm_alloc_handle_over(&k_null, host, m, out);
    if (s != FL_OK) free(m);
    return s;
}

fl_status fl_comm_null_create(fl_comm *host, int mpi_scratch, fl_comm **out) {
    if (out) *out = NULL;
    if (!host || !out) return fl_errorf(FL_ERR_INVALID, "comm null: a host communicator is needed");
    return make(host, mpi_scratch, host->pool, out);
}

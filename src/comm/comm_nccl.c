/* The NCCL implementation of fl_comm (include/fitllm/comm_nccl.h): device-memory collectives
 * through an fl_nccl_api table, so the same code runs over libnccl on GPUs and over the CPU
 * stand-in (src/comm/nccl_standin.c) in the tests.
 *
 * A request: an event of the backend's stream, which the communicator's own stream waits for
 * (the collective sees every op queued before it), the NCCL call(s) on the communicator's
 * stream, and a completion event recorded after them. wait synchronizes with that event while
 * polling ncclCommGetAsyncError (a peer that died must not leave this rank blocked forever);
 * test queries it. Requests complete in stream order, so any completion order is fine. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cuda/cu_plugin.h"
#include "comm/comm-impl.h"
#include "fitllm/comm_nccl.h"

typedef struct nreq {
    fl_comm_req base;
    void *done; /* completion event on the comm stream */
    struct nreq *next;
} nreq;

typedef struct {
    const fl_nccl_api *api;
    void *nc;          /* ncclComm_t; NULL after abort */
    fl_comm *host;     /* bootstrap, barrier, abort */
    void *compute;     /* the backend's stream */
    void *stream;      /* this communicator's stream */
    void *ready;       /* event on the compute stream, re-recorded per collective */
    nreq *head;        /* outstanding requests */
    int owns_host;     /* a split's: its host communicator (a split of the parent's host) is its own */
    double timeout_s;  /* a wait that sees no completion for this long aborts (fl_comm_nccl_timeout) */
} ncomm;

/* FITLLM_NCCL_TIMEOUT seconds where set, else FITLLM_COMM_TIMEOUT's (default 600, PyTorch's NCCL watchdog default; 0
 * or less: never). */
double fl_comm_nccl_timeout(void) {
    const char *e = getenv("FITLLM_NCCL_TIMEOUT");
    if (!e || !*e) return fl_comm_timeout();
    char *end;
    double v = strtod(e, &end);
    return end != e ? v : fl_comm_timeout();
}

static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int nccl_dtype(fl_dtype dt) {
    return dt == FL_BF16 ? FL_NCCL_BFLOAT16 : dt == FL_F16 ? FL_NCCL_FLOAT16 : FL_NCCL_FLOAT32;
}
static int nccl_op(fl_comm_op op) { return op == FL_COMM_MAX ? FL_NCCL_MAX : op == FL_COMM_AVG ? FL_NCCL_AVG : FL_NCCL_SUM; }

static fl_status nccl_err(fl_comm *c, const char *what, const char *call, int rc) {
    ncomm *m = c->impl;
    const char *last = m->nc && m->api->get_last_error ? m->api->get_last_error(m->nc) : "";
    return fl_comm_fail(c, FL_ERR_IO, what, "%s failed: %s%s%s", call, m->api->get_error_string(rc),
                        last && *last ? ": " : "", last ? last : "");
}

static fl_status cuda_err(fl_comm *c, const char *what, const char *call, int rc) {
    ncomm *m = c->impl;
    return fl_comm_fail(c, FL_ERR_IO, what, "%s failed: %s", call, m->api->cuda_error_string(rc));
}

#define NCALL(c, what, name, call)                                                                                   \
    do {                                                                                                             \
        int rc_ = (call);                                                                                            \
        if (rc_ != FL_NCCL_SUCCESS) return nccl_err((c), (what), (name), rc_);                                       \
    } while (0)
#define CCALL(c, what, name, call)                                                                                   \
    do {                                                                                                             \
        int rc_ = (call);                                                                                            \
        if (rc_ != 0) return cuda_err((c), (what), (name), rc_);                                                     \
    } while (0)

/* Order the comm stream after everything queued so far on the compute stream. */
static fl_status begin(fl_comm *c, const char *what) {
    ncomm *m = c->impl;
    if (!m->nc) return fl_comm_fail(c, FL_ERR_IO, what, "the communicator was aborted");
    CCALL(c, what, "cudaEventRecord", m->api->event_record(m->ready, m->compute));
    CCALL(c, what, "cudaStreamWaitEvent", m->api->stream_wait_event(m->stream, m->ready));
    return FL_OK;
}

/* The request of the calls just queued: a completion event after them. */
static fl_status finish(fl_comm *c, fl_coll_kind kind, size_t count, fl_dtype dt, fl_comm_op op, const char *what,
                        fl_comm_req **out) {
    ncomm *m = c->impl;
    nreq *r = calloc(1, sizeof *r);
    if (!r) return fl_comm_fail(c, FL_ERR_OOM, what, "cannot allocate a request");
    r->base = (fl_comm_req){c, kind, count, dt, op};
    int rc = m->api->event_create(&r->done);
    if (rc == 0) {
        rc = m->api->event_record(r->done, m->stream);
        if (rc != 0) m->api->event_destroy(r->done);
    }
    if (rc != 0) {
        free(r);
        return cuda_err(c, what, "cudaEventCreate/Record", rc);
    }
    r->next = m->head;
    m->head = r;
    *out = &r->base;
    return FL_OK;
}

static void unlink_free(fl_comm *c, nreq *r) {
    ncomm *m = c->impl;
    for (nreq **p = &m->head; *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            break;
        }
    m->api->event_destroy(r->done);
    free(r);
}

static fl_status n_all_reduce(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt, fl_comm_op op,
                              fl_comm_req **req) {
    ncomm *m = c->impl;
    char what[128];
    fl_comm_what(what, sizeof what, FL_COLL_ALL_REDUCE, count, dt, op, 0);
    FL_TRY(begin(c, what));
    if (count)
        NCALL(c, what, "ncclAllReduce", m->api->all_reduce(send, recv, count, nccl_dtype(dt), nccl_op(op), m->nc, m->stream));
    return finish(c, FL_COLL_ALL_REDUCE, count, dt, op, what, req);
}

/* Divisible counts: NCCL's equal blocks are fl_comm's chunks. Otherwise one ncclReduce per rank's
 * chunk (root = its owner), grouped so NCCL launches them together. */
static fl_status n_reduce_scatter(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt,
                                  fl_comm_op op, fl_comm_req **req) {
    ncomm *m = c->impl;
    char what[128];
    fl_comm_what(what, sizeof what, FL_COLL_REDUCE_SCATTER, count, dt, op, 0);
    FL_TRY(begin(c, what));
    size_t es = fl_dtype_size(dt), n = (size_t)c->size;
    if (count % n == 0) {
        if (count)
            NCALL(c, what, "ncclReduceScatter",
                  m->api->reduce_scatter(send, recv, count / n, nccl_dtype(dt), nccl_op(op), m->nc, m->stream));
    } else {
        NCALL(c, what, "ncclGroupStart", m->api->group_start());
        int rc = FL_NCCL_SUCCESS;
        for (int r = 0; r < c->size && rc == FL_NCCL_SUCCESS; r++) {
            size_t off, len;
            fl_comm_chunk(count, c->size, r, &off, &len);
            if (len)
                rc = m->api->reduce((const char *)send + off * es, r == c->rank ? recv : NULL, len, nccl_dtype(dt),
                                    nccl_op(op), r, m->nc, m->stream);
        }
        int rc2 = m->api->group_end();
        if (rc != FL_NCCL_SUCCESS) return nccl_err(c, what, "ncclReduce", rc);
        if (rc2 != FL_NCCL_SUCCESS) return nccl_err(c, what, "ncclGroupEnd", rc2);
    }
    return finish(c, FL_COLL_REDUCE_SCATTER, count, dt, op, what, req);
}

/* Divisible counts: ncclAllGather; otherwise one ncclBroadcast per rank's chunk, grouped. */
static fl_status n_all_gather(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt,
                              fl_comm_req **req) {
    ncomm *m = c->impl;
    char what[128];
    fl_comm_what(what, sizeof what, FL_COLL_ALL_GATHER, count, dt, FL_COMM_SUM, 0);
    FL_TRY(begin(c, what));
    size_t es = fl_dtype_size(dt), n = (size_t)c->size;
    if (count % n == 0) {
        if (count)
            NCALL(c, what, "ncclAllGather", m->api->all_gather(send, recv, count / n, nccl_dtype(dt), m->nc, m->stream));
    } else {
        NCALL(c, what, "ncclGroupStart", m->api->group_start());
        int rc = FL_NCCL_SUCCESS;
        for (int r = 0; r < c->size && rc == FL_NCCL_SUCCESS; r++) {
            size_t off, len;
            fl_comm_chunk(count, c->size, r, &off, &len);
            char *dst = (char *)recv + off * es;
            if (len)
                rc = m->api->broadcast(r == c->rank ? send : dst, dst, len, nccl_dtype(dt), r, m->nc, m->stream);
        }
        int rc2 = m->api->group_end();
        if (rc != FL_NCCL_SUCCESS) return nccl_err(c, what, "ncclBroadcast", rc);
        if (rc2 != FL_NCCL_SUCCESS) return nccl_err(c, what, "ncclGroupEnd", rc2);
    }
    return finish(c, FL_COLL_ALL_GATHER, count, dt, FL_COMM_SUM, what, req);
}

static fl_status n_broadcast(fl_comm *c, void *buf, size_t count, fl_dtype dt, int root, fl_comm_req **req) {
    ncomm *m = c->impl;
    char what[128];
    fl_comm_what(what, sizeof what, FL_COLL_BROADCAST, count, dt, FL_COMM_SUM, root);
    FL_TRY(begin(c, what));
    if (count)
        NCALL(c, what, "ncclBroadcast", m->api->broadcast(buf, buf, count, nccl_dtype(dt), root, m->nc, m->stream));
    return finish(c, FL_COLL_BROADCAST, count, dt, FL_COMM_SUM, what, req);
}

static fl_status n_barrier(fl_comm *c) {
    ncomm *m = c->impl;
    return fl_comm_barrier(m->host);
}

/* 1 when complete, 0 pending; errors (the event's, or NCCL's asynchronous one) returned. */
static fl_status poll_req(fl_comm *c, nreq *r, const char *what, int *done) {
    ncomm *m = c->impl;
    int q = m->api->event_query(r->done);
    *done = q == 0;
    if (q != 0 && q != FL_NCCL_EVENT_PENDING) return cuda_err(c, what, "cudaEventQuery", q);
    if (!m->nc) return fl_comm_fail(c, FL_ERR_IO, what, "the communicator was aborted");
    int ae = FL_NCCL_SUCCESS;
    int rc = m->api->comm_get_async_error(m->nc, &ae);
    if (rc != FL_NCCL_SUCCESS) return nccl_err(c, what, "ncclCommGetAsyncError", rc);
    if (ae != FL_NCCL_SUCCESS && ae != FL_NCCL_IN_PROGRESS) return nccl_err(c, what, "an NCCL collective", ae);
    return FL_OK;
}

static fl_status n_test(fl_comm *c, fl_comm_req *base, int *done) {
    nreq *r = (nreq *)base;
    char what[128];
    fl_comm_what(what, sizeof what, base->kind, base->count, base->dtype, base->op, 0);
    fl_status s = poll_req(c, r, what, done);
    if (s != FL_OK) *done = 1;
    if (*done) unlink_free(c, r);
    return s;
}

static fl_status n_wait(fl_comm *c, fl_comm_req *base) {
    nreq *r = (nreq *)base;
    char what[128];
    fl_comm_what(what, sizeof what, base->kind, base->count, base->dtype, base->op, 0);
    fl_status s;
    int done = 0, spins = 0;
    ncomm *m = c->impl;
    const double t0 = mono_s();
    /* poll rather than cudaEventSynchronize: a peer's failure shows as NCCL's asynchronous error
     * while our event never completes. A peer that stopped without failing (it left the training
     * loop, it is stuck, or the ranks' collectives differ) shows as nothing at all: NCCL waits
     * forever, so after timeout_s this rank aborts the communicator and says so (PyTorch's watchdog) */
    while ((s = poll_req(c, r, what, &done)) == FL_OK && !done) {
        if (m->api->event_wait) { /* the stand-in: sleep until the peers move (slices: the watchdog below) */
            m->api->event_wait(r->done, 0.05);
        } else if (++spins < 64) {
            sched_yield();
            continue;
        } else {
            struct timespec ts = {0, 20000}; /* 20 us */
            nanosleep(&ts, NULL);
            if ((spins & 1023) != 0) continue;
        }
        if (m->timeout_s > 0 && mono_s() - t0 > m->timeout_s) {
            if (m->nc) m->api->comm_abort(m->nc); /* NCCL's communicator freed; later calls fail */
            m->nc = NULL;
            s = fl_comm_fail(c, FL_ERR_IO, what,
                             "no completion after %.4g s: a peer stopped or the ranks' collectives differ; the "
                             "communicator was aborted (FITLLM_COMM_TIMEOUT or FITLLM_NCCL_TIMEOUT sets the limit)", m->timeout_s);
            break;
        }
    }
    unlink_free(c, r);
    return s;
}

static void n_abort(fl_comm *c, int code, const char *msg) {
    ncomm *m = c->impl;
    if (m->nc) m->api->comm_abort(m->nc); /* frees NCCL's communicator; later calls fail */
    m->nc = NULL;
    fl_comm_abort(m->host, code, msg);
}

/* Ranks that are threads (the host's are): NCCL's communicator aborted too, so a peer waiting in an
 * NCCL call (the stand-in's group) is released as well; over MPI nothing (the process exits). */
static int n_release(fl_comm *c, const char *msg) {
    ncomm *m = c->impl;
    if (!fl_comm_release_peers(m->host, msg)) return 0;
    if (m->nc) m->api->comm_abort(m->nc);
    m->nc = NULL;
    return 1;
}

static void n_destroy(fl_comm *c) {
    ncomm *m = c->impl;
    while (m->head) unlink_free(c, m->head); /* never waited for: released */
    if (m->nc) {
        m->api->event_synchronize(m->ready);
        m->api->comm_destroy(m->nc);
    }
    if (m->ready) m->api->event_destroy(m->ready);
    if (m->stream) m->api->stream_destroy(m->stream);
    if (m->owns_host) fl_comm_destroy(m->host);
    free(m);
    free(c);
}

/* The host communicator is split (fl_comm_split: its implementation's), then a new NCCL communicator
 * is bootstrapped over the part (a unique id from its rank 0, ncclCommInitRank): what ncclCommSplit
 * does, through the calls the api table already has, so the stand-in and libnccl run the same path. */
static fl_status nccl_over(fl_comm *part, void *ud, fl_comm **out) {
    const ncomm *m = ud;
    return fl_comm_nccl_create(part, m->api, m->compute, out);
}

static fl_status n_split(fl_comm *c, int color, int key, fl_comm **out) {
    FL_TRY(fl_comm_split_over(((ncomm *)c->impl)->host, color, key, nccl_over, c->impl, out));
    ((ncomm *)(*out)->impl)->owns_host = 1;
    return FL_OK;
}

static const fl_comm_vtable k_nccl = {
    .name = "nccl",
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

#define ID_WORDS (1 + FL_NCCL_ID_BYTES / 4) /* rank 0's status, then the id */

fl_status fl_comm_nccl_create(fl_comm *host, const fl_nccl_api *api, void *stream, fl_comm **out) {
    *out = NULL;
    if (!host || !api)
        return fl_errorf(FL_ERR_INVALID, "comm nccl: %s", host ? "no NCCL in this build" : "no host communicator");
    char what[64] = "set-up";
    /* rank 0's unique id (or its failure) to every rank, as bits over the host communicator */
    uint32_t words[ID_WORDS];
    memset(words, 0, sizeof words);
    if (host->rank == 0) {
        fl_nccl_id id;
        memset(&id, 0, sizeof id);
        int rc = api->get_unique_id(&id);
        words[0] = (uint32_t)rc;
        memcpy(words + 1, &id, sizeof id);
    }
    FL_TRY(fl_error_prefix(fl_comm_broadcast(host, words, ID_WORDS, FL_F32, 0), "comm nccl: sending the unique id"));
    if (words[0] != FL_NCCL_SUCCESS)
        return fl_errorf(FL_ERR_IO, "comm nccl: rank %d of %d: ncclGetUniqueId failed on rank 0: %s", host->rank,
                         host->size, api->get_error_string((int)words[0]));
    fl_nccl_id id;
    memcpy(&id, words + 1, sizeof id);

    fl_comm *c;
    ncomm *m = calloc(1, sizeof *m);
    if (!m) return fl_errorf(FL_ERR_OOM, "comm nccl: cannot allocate a handle");
    if (fl_comm_alloc_handle_over(&k_nccl, host, m, &c) != FL_OK) {
        free(m);
        return fl_errorf(FL_ERR_OOM, "comm nccl: cannot allocate a handle");
    }
    m->timeout_s = fl_comm_nccl_timeout();
    m->api = api;
    m->host = host;
    m->compute = stream;
    fl_status s = FL_OK;
    int rc = api->stream_create(&m->stream);
    if (rc != 0) m->stream = NULL, s = cuda_err(c, what, "cudaStreamCreate", rc);
    if (s == FL_OK && (rc = api->event_create(&m->ready)) != 0) m->ready = NULL, s = cuda_err(c, what, "cudaEventCreate", rc);
    if (s == FL_OK && (rc = api->comm_init_rank(&m->nc, host->size, id, host->rank)) != FL_NCCL_SUCCESS) {
        m->nc = NULL;
        s = nccl_err(c, what, "ncclCommInitRank", rc);
        if (rc == FL_NCCL_INVALID_USAGE) {
            char msg[1536];
            snprintf(msg, sizeof msg, "%s", fl_error_message());
            s = fl_errorf(s, "%s (NCCL refuses two ranks on one GPU: run one process per GPU, with the launcher's local "
                          "rank choosing the device, or give each rank its own CUDA_VISIBLE_DEVICES)", msg);
        }
    }
    if (s != FL_OK) {
        n_destroy(c);
        return s;
    }
    *out = c;
    return FL_OK;
}

/* The real table lives in the CUDA plugin (src/comm/nccl_cuda.c), opened on first use. */
const fl_nccl_api *fl_nccl_cuda_api(void) {
    const fl_cuda_plugin *p = fl_cuda_plugin_try(NULL, 0);
    return p ? p->nccl : NULL;
}
int fl_comm_nccl_built(void) {
#ifdef FL_HAVE_NCCL
    return 1;
#else
    return 0;
#endif
}
const char *fl_comm_nccl_library(void) {
    if (!fl_comm_nccl_built()) return "none";
    const fl_cuda_plugin *p = fl_cuda_plugin_try(NULL, 0);
    return p && p->nccl ? p->nccl_library() : "NCCL (in the CUDA plugin; not loaded: no GPU in use)";
}

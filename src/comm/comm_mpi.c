/* The MPI implementation of fl_comm (built when CMake finds MPI: FL_HAVE_MPI).
 *
 * Deterministic by construction, whatever algorithms the MPI library would pick for its own
 * reductions (they depend on message sizes, rank counts and tuning files): we never call
 * MPI_Allreduce on data. A reduce-scatter is point-to-point: rank j receives every other rank's
 * copy of its chunk (fl_comm_chunk layout) into scratch and reduces them in rank order 0..N-1
 * with fl_comm_reduce_kernel, the function the threads implementation runs; an all-gather sends
 * each rank's chunk to every other rank; an all-reduce is the two in turn. Every rank sends and
 * receives (N-1)/N of the buffer per half, the volume of a ring; messages are split into pieces
 * of at most 1 GiB so counts fit MPI's int.
 *
 * Requests progress in fl_comm_test/wait (an all-reduce's reduction and its all-gather are
 * started there when its first half has arrived). A blocking wait polls every outstanding
 * request rather than blocking in MPI, since another rank may be waiting for one of ours to
 * reach its second half; a single outstanding request is polled too (with the back-off, not spinning in MPI: a small
 * one, and a barrier, wait for a peer rather than for a transfer; a large one's back-off stops at 20 us sleeps).
 *
 * Errors: the duplicated communicator uses MPI_ERRORS_RETURN, so a failed call becomes an
 * fl_status naming rank and operation. A rank that dies makes the launcher (mpirun, srun) end
 * the others. A rank that stops without dying (kill -STOP, a hung file system) shows as nothing at all: every wait
 * (m_wait, m_barrier, m_recv) polls, so it watches its own clock, and one that has not completed after
 * FITLLM_COMM_TIMEOUT seconds (default 600) says which wait and the CLI's note (the step, the last committed
 * checkpoint) and ends the job with MPI_Abort (exit 1). */
#define _GNU_SOURCE
#include <mpi.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/comm-impl.h"

#define PIECE ((size_t)1 << 30) /* bytes per message: fits an int count of MPI_BYTE */

typedef struct mreq {
    fl_comm_req base;
    struct mreq *next;
    int stage; /* 1: first half in flight; 2: all-gather half in flight (all_reduce); 3: complete */
    int tag;
    MPI_Request *reqs;
    int nreq, capreq;
    void *scratch; /* (N-1) x len(me) elements: the other ranks' copies of this rank's chunk */
    const void *send;
    void *recv;
    fl_status err;
    char errmsg[512]; /* err's message, kept: other requests may overwrite the thread's */
} mreq;

/* A buffered point-to-point send: our copy of the data until MPI has sent it. */
typedef struct msend {
    struct msend *next;
    int nreq;
    MPI_Request reqs[];
} msend;

typedef struct {
    msend *sends; /* buffered sends in flight (their data follows reqs) */
    MPI_Comm comm;
    int owns_init; /* fl_comm_init called MPI_Init: fl_comm_destroy finalizes */
    unsigned long long seq;
    mreq *head;
    int nout;
    double timeout_s; /* FITLLM_COMM_TIMEOUT (fl_comm_timeout): a longer wait ends the job; <= 0: never */
} mcomm;

static char g_lib[128];

const char *fl_comm_mpi_library(void) {
    if (!g_lib[0]) {
        char v[MPI_MAX_LIBRARY_VERSION_STRING];
        int n = 0;
        /* one of the few MPI calls allowed before MPI_Init */
        if (MPI_Get_library_version(v, &n) != MPI_SUCCESS) snprintf(v, sizeof v, "unknown MPI");
        v[strcspn(v, ",\n")] = 0;
        snprintf(g_lib, sizeof g_lib, "%.120s", v);
    }
    return g_lib;
}

static fl_status mpi_fail(fl_comm *c, const char *what, const char *call, int rc) {
    char s[MPI_MAX_ERROR_STRING];
    int n = 0;
    if (MPI_Error_string(rc, s, &n) != MPI_SUCCESS) snprintf(s, sizeof s, "MPI error %d", rc);
    return fl_comm_fail(c, FL_ERR_IO, what, "%s failed: %s", call, s);
}

static const char *req_what(const mreq *r, char *buf, size_t n) {
    return fl_comm_what(buf, n, r->base.kind, r->base.count, r->base.dtype, r->base.op, 0);
}

static fl_status grow(fl_comm *c, mreq *r, int more) {
    if (r->nreq + more <= r->capreq) return FL_OK;
    int cap = r->capreq ? r->capreq : 8;
    while (cap < r->nreq + more) cap *= 2;
    MPI_Request *q = realloc(r->reqs, (size_t)cap * sizeof *q);
    if (!q) {
        char what[128];
        return fl_comm_fail(c, FL_ERR_OOM, req_what(r, what, sizeof what), "cannot allocate MPI requests");
    }
    r->reqs = q;
    r->capreq = cap;
    return FL_OK;
}

/* Post the receive (recv=1) or send of bytes at buf from/to peer, split into pieces. */
static fl_status p2p(fl_comm *c, mreq *r, int recv, void *buf, size_t bytes, int peer) {
    mcomm *m = c->impl;
    char what[128];
    for (size_t o = 0; o < bytes; o += PIECE) {
        int b = (int)(bytes - o < PIECE ? bytes - o : PIECE);
        FL_TRY(grow(c, r, 1));
        int rc = recv ? MPI_Irecv((char *)buf + o, b, MPI_BYTE, peer, r->tag, m->comm, &r->reqs[r->nreq])
                      : MPI_Isend((char *)buf + o, b, MPI_BYTE, peer, r->tag, m->comm, &r->reqs[r->nreq]);
        if (rc != MPI_SUCCESS) return mpi_fail(c, req_what(r, what, sizeof what), recv ? "MPI_Irecv" : "MPI_Isend", rc);
        r->nreq++;
    }
    return FL_OK;
}

/* Peers in the order me+1, me+2, ... so that not every rank talks to rank 0 first. */
static int peer_at(const fl_comm *c, int i) { return (c->rank + i) % c->size; }

/* First half of a reduction: receive the other ranks' copies of my chunk, send them theirs. */
static fl_status post_scatter(fl_comm *c, mreq *r) {
    size_t es = fl_dtype_size(r->base.dtype), off, len;
    fl_comm_chunk(r->base.count, c->size, c->rank, &off, &len);
    FL_TRY(fl_comm_scratch_alloc(c, (size_t)(c->size - 1) * len * es, &r->scratch));
    for (int i = 1; i < c->size; i++) {
        int k = peer_at(c, i);
        int slot = k < c->rank ? k : k - 1;
        if (len) FL_TRY(p2p(c, r, 1, (char *)r->scratch + (size_t)slot * len * es, len * es, k));
    }
    for (int i = 1; i < c->size; i++) {
        int k = peer_at(c, c->size - i); /* send to me-1, me-2, ...: the ranks that receive first from me */
        size_t ko, kl;
        fl_comm_chunk(r->base.count, c->size, k, &ko, &kl);
        if (kl) FL_TRY(p2p(c, r, 0, (char *)r->send + ko * es, kl * es, k));
    }
    return FL_OK;
}

/* All-gather: my chunk (at mine) to everyone, everyone's chunk into recv at their offsets. */
static fl_status post_gather(fl_comm *c, mreq *r, const void *mine) {
    size_t es = fl_dtype_size(r->base.dtype), off, len;
    fl_comm_chunk(r->base.count, c->size, c->rank, &off, &len);
    for (int i = 1; i < c->size; i++) {
        int k = peer_at(c, i);
        size_t ko, kl;
        fl_comm_chunk(r->base.count, c->size, k, &ko, &kl);
        if (kl) FL_TRY(p2p(c, r, 1, (char *)r->recv + ko * es, kl * es, k));
    }
    for (int i = 1; i < c->size; i++) {
        int k = peer_at(c, c->size - i);
        if (len) FL_TRY(p2p(c, r, 0, (void *)mine, len * es, k));
    }
    return FL_OK;
}

/* The reduction of my chunk, in rank order, once the first half has arrived. */
static void reduce_mine(fl_comm *c, mreq *r, void *dst) {
    size_t es = fl_dtype_size(r->base.dtype), off, len;
    fl_comm_chunk(r->base.count, c->size, c->rank, &off, &len);
    const void *src[256];
    const void **sp = c->size <= 256 ? src : malloc((size_t)c->size * sizeof *sp);
    for (int k = 0; k < c->size; k++)
        sp[k] = k == c->rank ? (const char *)r->send + off * es
                             : (const char *)r->scratch + (size_t)(k < c->rank ? k : k - 1) * len * es;
    fl_comm_reduce_kernel(dst, sp, c->size, len, r->base.dtype, r->base.op);
    if (sp != src) free((void *)sp);
}

/* The current stage's messages are done: move on. */
static fl_status advance(fl_comm *c, mreq *r) {
    r->nreq = 0;
    size_t es = fl_dtype_size(r->base.dtype), off, len;
    fl_comm_chunk(r->base.count, c->size, c->rank, &off, &len);
    if (r->stage == 1 && r->base.kind == FL_COLL_ALL_REDUCE) {
        char *mine = (char *)r->recv + off * es;
        reduce_mine(c, r, mine);
        fl_comm_scratch_free(c, r->scratch);
        r->scratch = NULL;
        r->stage = 2;
        return post_gather(c, r, mine);
    }
    if (r->stage == 1 && r->base.kind == FL_COLL_REDUCE_SCATTER) {
        reduce_mine(c, r, r->recv);
        fl_comm_scratch_free(c, r->scratch);
        r->scratch = NULL;
    }
    r->stage = 3;
    return FL_OK;
}

/* Test r's messages; advance through the stages that are done. */
static fl_status progress_one(fl_comm *c, mreq *r) {
    while (r->stage < 3 && r->err == FL_OK) {
        int flag = 1, rc;
        if (r->nreq) {
            rc = MPI_Testall(r->nreq, r->reqs, &flag, MPI_STATUSES_IGNORE);
            if (rc != MPI_SUCCESS) {
                char what[128];
                r->err = mpi_fail(c, req_what(r, what, sizeof what), "MPI_Testall", rc);
                snprintf(r->errmsg, sizeof r->errmsg, "%s", fl_error_message());
                break;
            }
        }
        if (!flag) break;
        fl_status s = advance(c, r);
        if (s != FL_OK) {
            r->err = s;
            snprintf(r->errmsg, sizeof r->errmsg, "%s", fl_error_message());
        }
    }
    return r->err;
}

static void progress_all(fl_comm *c) {
    mcomm *m = c->impl;
    for (mreq *r = m->head; r; r = r->next) progress_one(c, r);
}

static void release(fl_comm *c, mreq *r) {
    mcomm *m = c->impl;
    for (mreq **p = &m->head; *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            m->nout--;
            break;
        }
    fl_comm_scratch_free(c, r->scratch);
    free(r->reqs);
    free(r);
}

static fl_status new_req(fl_comm *c, fl_coll_kind kind, const void *send, void *recv, size_t count, fl_dtype dt,
                         fl_comm_op op, mreq **out) {
    mcomm *m = c->impl;
    char what[128];
    mreq *r = calloc(1, sizeof *r);
    if (!r) return fl_comm_fail(c, FL_ERR_OOM, fl_comm_what(what, sizeof what, kind, count, dt, op, 0), "cannot allocate a request");
    r->base = (fl_comm_req){c, kind, count, dt, op};
    r->send = send;
    r->recv = recv;
    r->stage = 1;
    /* tags keep concurrent collectives apart (MPI also matches same-tag messages in posting order) */
    r->tag = (int)(m->seq++ % 32000);
    mreq **p = &m->head;
    while (*p) p = &(*p)->next;
    *p = r;
    m->nout++;
    *out = r;
    return FL_OK;
}

static fl_status finish_post(fl_comm *c, mreq *r, fl_status s, fl_comm_req **req) {
    if (s != FL_OK) {
        /* messages already posted cannot be withdrawn cleanly; the job is broken anyway */
        release(c, r);
        return s;
    }
    if (r->nreq == 0 && r->stage < 3) advance(c, r); /* nothing to exchange (count 0 / size 1) */
    *req = &r->base;
    return FL_OK;
}

static fl_status m_all_reduce(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt, fl_comm_op op,
                              fl_comm_req **req) {
    mreq *r = NULL;
    FL_TRY(new_req(c, FL_COLL_ALL_REDUCE, send, recv, count, dt, op, &r));
    return finish_post(c, r, post_scatter(c, r), req);
}

static fl_status m_reduce_scatter(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt,
                                  fl_comm_op op, fl_comm_req **req) {
    mreq *r = NULL;
    FL_TRY(new_req(c, FL_COLL_REDUCE_SCATTER, send, recv, count, dt, op, &r));
    return finish_post(c, r, post_scatter(c, r), req);
}

static fl_status m_all_gather(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt,
                              fl_comm_req **req) {
    mreq *r = NULL;
    FL_TRY(new_req(c, FL_COLL_ALL_GATHER, send, recv, count, dt, FL_COMM_SUM, &r));
    size_t es = fl_dtype_size(dt), off, len;
    fl_comm_chunk(count, c->size, c->rank, &off, &len);
    if (len && send != (const char *)recv + off * es) memcpy((char *)recv + off * es, send, len * es);
    return finish_post(c, r, post_gather(c, r, send), req);
}

static fl_status m_broadcast(fl_comm *c, void *buf, size_t count, fl_dtype dt, int root, fl_comm_req **req) {
    mcomm *m = c->impl;
    mreq *r = NULL;
    char what[128];
    FL_TRY(new_req(c, FL_COLL_BROADCAST, NULL, buf, count, dt, FL_COMM_SUM, &r));
    fl_status s = FL_OK;
    size_t bytes = count * fl_dtype_size(dt);
    for (size_t o = 0; o < bytes && s == FL_OK; o += PIECE) {
        int b = (int)(bytes - o < PIECE ? bytes - o : PIECE);
        s = grow(c, r, 1);
        if (s != FL_OK) break;
        int rc = MPI_Ibcast((char *)buf + o, b, MPI_BYTE, root, m->comm, &r->reqs[r->nreq]);
        if (rc != MPI_SUCCESS)
            s = mpi_fail(c, fl_comm_what(what, sizeof what, FL_COLL_BROADCAST, count, dt, FL_COMM_SUM, root),
                         "MPI_Ibcast", rc);
        else r->nreq++;
    }
    return finish_post(c, r, s, req);
}

/* The watchdog: whether a wait that began at t0 has passed the limit; timed_out then ends the job. */
static int expired(const fl_comm *c, double t0) {
    const mcomm *m = c->impl;
    return m->timeout_s > 0 && fl_comm_now_s() - t0 > m->timeout_s;
}

static void timed_out(fl_comm *c, const char *what) {
    const mcomm *m = c->impl;
    char msg[2048];
    fl_comm_timeout_text(c, what, m->timeout_s, msg, sizeof msg);
    fflush(stdout); /* the log's lines whole before the message */
    fprintf(stderr, "fitllm: %s; ending the job\n", msg);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1); /* the whole job, whichever group waited */
}

/* A collective of at most this many bytes moves in a few protocol steps (Open MPI's eager sizes: 4 KiB shared memory,
 * 64 KiB TCP): a long wait for it is a wait for a peer that has not sent yet (rank 0 writing a checkpoint or running
 * alone, a slower or descheduled rank), not for a transfer that needs MPI called to move. A larger one may (pipelined
 * fragments when no single-copy mechanism is available), so its back-off stops at the short sleep. */
#define SMALL_WAIT ((size_t)64 << 10)

/* Poll until r completes, progressing everything; back off to short sleeps when nothing moves (ranks are often
 * oversubscribed on the cores: spinning would starve the rank we wait for). Never blocks in MPI: Open MPI's wait spins
 * at full speed (sched_yield in a loop when oversubscribed), a core taken from the peer it waits for. */
static fl_status m_wait(fl_comm *c, fl_comm_req *base) {
    mcomm *m = c->impl;
    mreq *r = (mreq *)base;
    long idle = 0;
    const double t0 = fl_comm_now_s();
    while (r->stage < 3 && r->err == FL_OK) {
        int large = m->nout == 1 && r->base.count * fl_dtype_size(r->base.dtype) > SMALL_WAIT;
        int before = r->stage;
        progress_all(c);
        if (r->stage != before) idle = 0;
        else if (++idle > 200) {
            struct timespec ts = {0, idle > 2000 && !large ? 200000 : 20000};
            nanosleep(&ts, NULL);
            if (expired(c, t0)) {
                char what[128];
                timed_out(c, req_what(r, what, sizeof what));
            }
        } else {
            sched_yield();
        }
    }
    fl_status s = r->err;
    if (s != FL_OK) fl_errorf(s, "%s", r->errmsg);
    release(c, r);
    return s;
}

static fl_status m_test(fl_comm *c, fl_comm_req *base, int *done) {
    mreq *r = (mreq *)base;
    progress_all(c);
    *done = r->stage == 3 || r->err != FL_OK;
    fl_status s = r->err;
    if (*done) {
        if (s != FL_OK) fl_errorf(s, "%s", r->errmsg);
        release(c, r);
    }
    return s;
}

/* A barrier must keep outstanding requests moving (a peer may be waiting for our second half). */
static fl_status m_barrier(fl_comm *c) {
    mcomm *m = c->impl;
    MPI_Request q;
    int rc = MPI_Ibarrier(m->comm, &q);
    if (rc != MPI_SUCCESS) return mpi_fail(c, "barrier", "MPI_Ibarrier", rc);
    long idle = 0; /* polled with the same back-off as m_wait even when nothing else is outstanding: MPI_Wait
                    * spins at full speed while e.g. rank 0 writes a checkpoint */
    const double t0 = fl_comm_now_s();
    for (;;) {
        int flag = 0;
        rc = MPI_Test(&q, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) return mpi_fail(c, "barrier", "MPI_Test", rc);
        if (flag) return FL_OK;
        progress_all(c);
        if (++idle > 200) {
            struct timespec ts = {0, 100000};
            nanosleep(&ts, NULL);
            if (expired(c, t0)) timed_out(c, "barrier");
        } else {
            sched_yield();
        }
    }
}

static void m_abort(fl_comm *c, int code, const char *msg) {
    mcomm *m = c->impl;
    fprintf(stderr, "fitllm: rank %d of %d aborting: %s\n", c->rank, c->size, msg);
    fflush(stderr);
    (void)m; /* the whole job, whichever group (a split's) the failure was seen in */
    MPI_Abort(MPI_COMM_WORLD, code ? code : 1);
}

static void m_destroy(fl_comm *c) {
    mcomm *m = c->impl;
    while (m->head) release(c, m->head);
    while (m->sends) { /* sent, maybe never received (a failed job): MPI completes or drops them */
        msend *x = m->sends;
        m->sends = x->next;
        for (int i = 0; i < x->nreq; i++)
            if (x->reqs[i] != MPI_REQUEST_NULL) MPI_Request_free(&x->reqs[i]);
        free(x);
    }
    MPI_Comm_free(&m->comm);
    if (m->owns_init) {
        int fin = 0;
        MPI_Finalized(&fin);
        if (!fin) MPI_Finalize();
    }
    free(m);
    free(c);
}

static fl_status m_split(fl_comm *c, int color, int key, fl_comm **out);

/* ---- point to point: tags P2P_TAG + tag (the collectives' are below 32000); messages of more than PIECE bytes go
 * as pieces of one tag, which MPI keeps in order; an empty message is one message of 0 bytes ------------------- */

#define P2P_TAG 32000

static int pieces(size_t bytes) { return bytes ? (int)((bytes + PIECE - 1) / PIECE) : 1; }

/* Free the buffered sends MPI has finished with. */
static fl_status reap_sends(fl_comm *c) {
    mcomm *m = c->impl;
    for (msend **p = &m->sends; *p;) {
        int flag = 0, rc = MPI_Testall((*p)->nreq, (*p)->reqs, &flag, MPI_STATUSES_IGNORE);
        if (rc != MPI_SUCCESS) return mpi_fail(c, "send", "MPI_Testall", rc);
        if (!flag) {
            p = &(*p)->next;
            continue;
        }
        msend *x = *p;
        *p = x->next;
        free(x);
    }
    return FL_OK;
}

static fl_status m_send(fl_comm *c, const void *buf, size_t bytes, int peer, int tag) {
    mcomm *m = c->impl;
    char what[128];
    snprintf(what, sizeof what, "send(%zu bytes to rank %d, tag %d)", bytes, peer, tag);
    FL_TRY(reap_sends(c));
    const int np = pieces(bytes);
    const size_t head = sizeof(msend) + (size_t)np * sizeof(MPI_Request);
    msend *x = malloc(head + bytes);
    if (!x) return fl_comm_fail(c, FL_ERR_OOM, what, "out of host memory for the message's copy");
    unsigned char *data = (unsigned char *)x + head;
    if (bytes) memcpy(data, buf, bytes);
    x->nreq = 0;
    for (int i = 0; i < np; i++) {
        size_t o = (size_t)i * PIECE, b = bytes - o < PIECE ? bytes - o : PIECE;
        int rc = MPI_Isend(data + o, (int)b, MPI_BYTE, peer, P2P_TAG + tag, m->comm, &x->reqs[i]);
        if (rc != MPI_SUCCESS) {
            x->next = m->sends; /* the pieces already posted still read the copy */
            m->sends = x;
            return mpi_fail(c, what, "MPI_Isend", rc);
        }
        x->nreq++;
    }
    x->next = m->sends;
    m->sends = x;
    return FL_OK;
}

static fl_status m_recv(fl_comm *c, void *buf, size_t bytes, int peer, int tag) {
    mcomm *m = c->impl;
    char what[128];
    snprintf(what, sizeof what, "recv(%zu bytes from rank %d, tag %d)", bytes, peer, tag);
    const int np = pieces(bytes);
    MPI_Request one[4], *q = np <= 4 ? one : malloc((size_t)np * sizeof *q);
    MPI_Status sst[4], *st = np <= 4 ? sst : malloc((size_t)np * sizeof *st);
    fl_status s = q && st ? FL_OK : fl_comm_fail(c, FL_ERR_OOM, what, "out of host memory");
    int posted = 0, rc = MPI_SUCCESS;
    for (; s == FL_OK && posted < np; posted++) {
        size_t o = (size_t)posted * PIECE, b = bytes - o < PIECE ? bytes - o : PIECE;
        rc = MPI_Irecv((char *)buf + o, (int)b, MPI_BYTE, peer, P2P_TAG + tag, m->comm, &q[posted]);
        if (rc != MPI_SUCCESS) s = mpi_fail(c, what, "MPI_Irecv", rc);
    }
    /* poll: our outstanding collectives and buffered sends must move while we wait (a peer may wait on them) */
    long idle = 0;
    const double t0 = fl_comm_now_s();
    for (int flag = 0; s == FL_OK && !flag;) {
        rc = MPI_Testall(np, q, &flag, st);
        if (rc != MPI_SUCCESS) s = mpi_fail(c, what, "MPI_Testall", rc); /* a longer message: MPI_ERR_TRUNCATE */
        if (s != FL_OK || flag) break;
        progress_all(c);
        s = reap_sends(c);
        if (++idle > 200) {
            struct timespec ts = {0, idle > 2000 ? 200000 : 20000};
            nanosleep(&ts, NULL);
            if (expired(c, t0)) timed_out(c, what);
        }
    }
    for (int i = 0; s == FL_OK && i < np; i++) {
        int got = 0;
        size_t b = bytes - (size_t)i * PIECE < PIECE ? bytes - (size_t)i * PIECE : PIECE;
        MPI_Get_count(&st[i], MPI_BYTE, &got);
        if ((size_t)got != b)
            s = fl_comm_fail(c, FL_ERR_INVALID, what, "rank %d sent a message of another size (piece %d: %d bytes, "
                             "expected %zu)", peer, i, got, b);
    }
    if (q != one) free(q);
    if (st != sst) free(st);
    return s;
}

static const fl_comm_vtable k_mpi = {
    .name = "mpi",
    .iall_reduce = m_all_reduce,
    .ireduce_scatter = m_reduce_scatter,
    .iall_gather = m_all_gather,
    .ibroadcast = m_broadcast,
    .barrier = m_barrier,
    .test = m_test,
    .wait = m_wait,
    .abort = m_abort,
    .destroy = m_destroy,
    .split = m_split,
    .send = m_send,
    .recv = m_recv,
};

/* local_rank / local_size of c: its ranks on this node (MPI's shared-memory split). */
static int ask_local(fl_comm *c, MPI_Comm comm) {
    MPI_Comm node = MPI_COMM_NULL;
    int rc = MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &node);
    if (rc == MPI_SUCCESS) {
        MPI_Comm_rank(node, &c->local_rank);
        MPI_Comm_size(node, &c->local_size);
        MPI_Comm_free(&node);
    }
    return rc;
}

static fl_status m_split(fl_comm *c, int color, int key, fl_comm **out) {
    mcomm *m = c->impl;
    /* no request may be outstanding on c across a blocking split: fl_comm's users split at set-up */
    MPI_Comm nc = MPI_COMM_NULL;
    int rc = MPI_Comm_split(m->comm, color, key, &nc);
    if (rc != MPI_SUCCESS) return mpi_fail(c, "split", "MPI_Comm_split", rc);
    MPI_Comm_set_errhandler(nc, MPI_ERRORS_RETURN);
    int rank = 0, size = 1;
    MPI_Comm_rank(nc, &rank);
    MPI_Comm_size(nc, &size);
    mcomm *sm = calloc(1, sizeof *sm);
    fl_comm *sc = NULL;
    if (!sm || fl_comm_alloc_handle(&k_mpi, rank, size, &sc) != FL_OK) {
        free(sm);
        MPI_Comm_free(&nc);
        return fl_comm_fail(c, FL_ERR_OOM, "split", "cannot allocate a handle");
    }
    sc->impl = sm;
    sc->launch = c->launch;
    sm->comm = nc; /* owns_init 0: only the first communicator finalizes MPI */
    sm->timeout_s = m->timeout_s;
    rc = ask_local(sc, nc);
    if (rc != MPI_SUCCESS) {
        fl_status s = mpi_fail(c, "split", "MPI_Comm_split_type", rc);
        m_destroy(sc);
        return s;
    }
    *out = sc;
    return FL_OK;
}

/* What to tell a user whose launcher started `want` processes that MPI sees as `got`. */
static const char *launch_hint(const fl_launch_info *li) {
    switch (li->kind) {
    case FL_LAUNCH_SLURM: return "srun needs an MPI plugin matching this build: srun --mpi=pmix (or --mpi=pmi2)";
    case FL_LAUNCH_PMI:
        return "the processes were started by another MPI's launcher (MPICH/Intel mpiexec); use the mpirun of the MPI "
               "fitllm was built with";
    default: return "start all ranks with one mpirun of the MPI fitllm was built with";
    }
}

fl_status fl_comm_mpi_init(fl_comm **out, const fl_launch_info *li, int *argc, char ***argv) {
    *out = NULL;
    int inited = 0, owns = 0, rc;
    MPI_Initialized(&inited);
    if (!inited) {
        int provided = 0;
        /* FUNNELED: only the thread that drives training calls MPI (OpenMP kernels never do) */
        rc = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
        if (rc != MPI_SUCCESS)
            return fl_errorf(FL_ERR_IO, "comm mpi: MPI_Init failed (launched as rank %d of %d by %s)", li->rank,
                             li->size, fl_launch_kind_name(li->kind));
        owns = 1;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    int rank = 0, size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size != li->size || rank != li->rank) {
        fl_status s = fl_errorf(FL_ERR_UNSUPPORTED,
                                "comm mpi: %s says rank %d of %d but MPI (%s) sees rank %d of %d: %s", 
                                fl_launch_kind_name(li->kind), li->rank, li->size, fl_comm_mpi_library(), rank, size,
                                launch_hint(li));
        if (owns) MPI_Finalize();
        return s;
    }
    mcomm *m = calloc(1, sizeof *m);
    fl_comm *c = NULL;
    if (!m || fl_comm_alloc_handle(&k_mpi, rank, size, &c) != FL_OK) {
        free(m);
        if (owns) MPI_Finalize();
        return fl_errorf(FL_ERR_OOM, "comm mpi: cannot allocate a handle");
    }
    c->impl = m;
    m->owns_init = owns;
    m->timeout_s = fl_comm_timeout();
    c->launch = *li;
    /* our own communicator: our tags never meet anyone else's messages */
    rc = MPI_Comm_dup(MPI_COMM_WORLD, &m->comm);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
    if (rc == MPI_SUCCESS) rc = ask_local(c, MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) {
        fl_status s = mpi_fail(c, "init", "MPI_Comm_dup/MPI_Comm_split_type", rc);
        free(m);
        free(c);
        if (owns) MPI_Finalize();
        return s;
    }
    *out = c;
    return FL_OK;
}

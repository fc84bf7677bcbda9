/* A CPU stand-in for the NCCL and CUDA-runtime calls of fl_nccl_api (include/fitllm/comm_nccl.h),
 * for the "cuda-emu" backend and the tests: NCCL's documented semantics over the threads
 * implementation of fl_comm, with host memory, ranks as threads of one process.
 *
 * What it implements, as nccl.h documents it:
 *  - ncclGetUniqueId / ncclCommInitRank: the id names a group (a process-wide registry); the
 *    first rank to join creates a threads communicator of nranks, the others take their handle;
 *    a rank joining twice is ncclInvalidUsage (NCCL: "Duplicate GPU detected");
 *  - ncclAllReduce (in place when send == recv); ncclReduceScatter with recvcount = the PER-RANK
 *    count, send = nranks blocks rank-major, in place when recv == send + rank * recvcount;
 *    ncclAllGather with sendcount per rank, in place when send == recv + rank * sendcount;
 *    ncclBroadcast (send significant on root only, in place when equal); ncclReduce (recv may be
 *    NULL except on root); any other overlap of send and recv is ncclInvalidArgument;
 *  - types ncclFloat32 / ncclBfloat16, ops ncclSum / ncclMax / ncclAvg (others:
 *    ncclInvalidArgument); sums in rank order by fl_comm's kernel (NCCL's order differs: see
 *    comm_nccl.h), so results equal the threads implementation's bit for bit;
 *  - ncclGroupStart/End nest per thread; an unmatched End is ncclInvalidUsage. Grouped calls are
 *    posted at once (a threads post never blocks on the other ranks, and every rank issues them
 *    in the same order, which is all NCCL's grouping needs here);
 *  - ncclCommAbort breaks the group: the other ranks' pending and later operations fail, seen as
 *    ncclCommGetAsyncError = ncclRemoteError; ncclGetLastError says why.
 * Streams and events: a stream is a FIFO of posted collectives; an event recorded on it
 * completes when every collective posted before the record has (cudaEventQuery progresses
 * them; cudaEventSynchronize waits; the optional event_wait sleeps until they can move on). A NULL stream (the emulated backend's: its kernels run
 * synchronously) has nothing pending; a collective on it completes before the call returns. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm/comm-impl.h"
#include "fitllm/comm_nccl.h"

#define MAGIC "fitllm-nccl-standin"

typedef struct sworld {
    unsigned long long serial;
    int n, joined;
    int *taken;
    fl_comm **comms;
    struct sworld *next;
} sworld;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static sworld *g_worlds;
static unsigned long long g_serial;
static _Thread_local int g_group_depth;

typedef struct sent sent;
typedef struct {
    fl_comm *tc;
    int rank, n;
    int async_err;
    char last[768];
    sent *live; /* this communicator's pending collectives (next_c) */
} scomm;

struct sent {
    fl_comm_req *r; /* NULL once complete or detached */
    void *scratch;
    scomm *sc;
    unsigned long long seq;
    sent *next_s, *next_c;
};

typedef struct {
    sent *head;
    unsigned long long posted;
} sstream;

typedef struct {
    sstream *s;
    unsigned long long upto;
} sevent;

/* ---- entries --------------------------------------------------------------------------------- */

static void comm_unlink(scomm *sc, sent *e) {
    for (sent **p = &sc->live; *p; p = &(*p)->next_c)
        if (*p == e) {
            *p = e->next_c;
            return;
        }
}

/* The entry's collective is over (done or failed): release its scratch and detach it. */
static void entry_close(sent *e, fl_status s) {
    if (e->sc) {
        if (s != FL_OK && e->sc->async_err == FL_NCCL_SUCCESS) {
            e->sc->async_err = FL_NCCL_REMOTE_ERROR;
            snprintf(e->sc->last, sizeof e->sc->last, "%s", fl_error_message());
        }
        comm_unlink(e->sc, e);
    }
    free(e->scratch);
    e->scratch = NULL;
    e->r = NULL;
    e->sc = NULL;
}

/* Remove closed entries from the stream. */
static void stream_sweep(sstream *st) {
    for (sent **p = &st->head; *p;) {
        sent *e = *p;
        if (!e->r) {
            *p = e->next_s;
            free(e);
        } else {
            p = &e->next_s;
        }
    }
}

static int map_status(fl_status s) {
    return s == FL_OK ? FL_NCCL_SUCCESS
                      : (s == FL_ERR_INVALID || s == FL_ERR_UNSUPPORTED) ? FL_NCCL_INVALID_ARGUMENT
                      : s == FL_ERR_OOM ? FL_NCCL_SYSTEM_ERROR : FL_NCCL_REMOTE_ERROR;
}

static unsigned long g_calls; /* collectives accepted (tests: a run went through the stand-in) */
unsigned long fl_nccl_standin_calls(void) { return __atomic_load_n(&g_calls, __ATOMIC_RELAXED); }

/* Queue r (posted with status ps) on stream; on a NULL stream wait for it here. */
static int enqueue(scomm *sc, void *stream, fl_status ps, fl_comm_req *r, void *scratch) {
    if (ps == FL_OK) __atomic_fetch_add(&g_calls, 1, __ATOMIC_RELAXED);
    if (ps != FL_OK) {
        free(scratch);
        snprintf(sc->last, sizeof sc->last, "%s", fl_error_message());
        return map_status(ps);
    }
    if (!stream) {
        fl_status s = fl_comm_wait(&r);
        free(scratch);
        if (s != FL_OK) {
            snprintf(sc->last, sizeof sc->last, "%s", fl_error_message());
            if (sc->async_err == FL_NCCL_SUCCESS) sc->async_err = FL_NCCL_REMOTE_ERROR;
        }
        return map_status(s);
    }
    sstream *st = stream;
    sent *e = calloc(1, sizeof *e);
    if (!e) {
        fl_comm_wait(&r);
        free(scratch);
        return FL_NCCL_SYSTEM_ERROR;
    }
    e->r = r;
    e->scratch = scratch;
    e->sc = sc;
    e->seq = ++st->posted;
    sent **p = &st->head;
    while (*p) p = &(*p)->next_s;
    *p = e;
    e->next_c = sc->live;
    sc->live = e;
    return FL_NCCL_SUCCESS;
}

/* ---- NCCL ------------------------------------------------------------------------------------ */

static int s_get_version(int *v) {
    *v = 22800; /* the NCCL 2.28 API it follows */
    return FL_NCCL_SUCCESS;
}

static int s_get_unique_id(fl_nccl_id *id) {
    if (!id) return FL_NCCL_INVALID_ARGUMENT;
    memset(id, 0, sizeof *id);
    pthread_mutex_lock(&g_mu);
    unsigned long long serial = ++g_serial;
    pthread_mutex_unlock(&g_mu);
    snprintf(id->internal, sizeof id->internal, "%s %d %llu", MAGIC, (int)getpid(), serial);
    return FL_NCCL_SUCCESS;
}

static int s_comm_init_rank(void **out, int nranks, fl_nccl_id id, int rank) {
    if (!out) return FL_NCCL_INVALID_ARGUMENT;
    *out = NULL;
    int pid;
    unsigned long long serial;
    id.internal[FL_NCCL_ID_BYTES - 1] = 0;
    if (sscanf(id.internal, MAGIC " %d %llu", &pid, &serial) != 2 || pid != (int)getpid()) return FL_NCCL_INVALID_ARGUMENT;
    if (nranks < 1 || rank < 0 || rank >= nranks) return FL_NCCL_INVALID_ARGUMENT;
    scomm *sc = calloc(1, sizeof *sc);
    if (!sc) return FL_NCCL_SYSTEM_ERROR;
    int rc = FL_NCCL_SUCCESS;
    pthread_mutex_lock(&g_mu);
    sworld *w = g_worlds;
    while (w && w->serial != serial) w = w->next;
    if (!w) {
        w = calloc(1, sizeof *w);
        fl_comm **comms = calloc((size_t)nranks, sizeof *comms);
        int *taken = calloc((size_t)nranks, sizeof *taken);
        if (!w || !comms || !taken || fl_comm_threads_create(nranks, 0, comms) != FL_OK) {
            free(w);
            free(comms);
            free(taken);
            rc = FL_NCCL_SYSTEM_ERROR;
        } else {
            w->serial = serial;
            w->n = nranks;
            w->comms = comms;
            w->taken = taken;
            w->next = g_worlds;
            g_worlds = w;
        }
    }
    if (rc == FL_NCCL_SUCCESS && w->n != nranks) rc = FL_NCCL_INVALID_ARGUMENT;
    if (rc == FL_NCCL_SUCCESS && w->taken[rank]) rc = FL_NCCL_INVALID_USAGE; /* NCCL: duplicate GPU */
    if (rc == FL_NCCL_SUCCESS) {
        w->taken[rank] = 1;
        sc->tc = w->comms[rank];
        sc->rank = rank;
        sc->n = nranks;
        if (++w->joined == w->n) { /* everyone has its handle: the id is spent */
            for (sworld **p = &g_worlds; *p; p = &(*p)->next)
                if (*p == w) {
                    *p = w->next;
                    break;
                }
            free(w->comms);
            free(w->taken);
            free(w);
        }
    }
    pthread_mutex_unlock(&g_mu);
    if (rc != FL_NCCL_SUCCESS) {
        free(sc);
        return rc;
    }
    *out = sc;
    return FL_NCCL_SUCCESS;
}

/* Detach every pending collective of sc (their threads requests go with the communicator). */
static void comm_release(scomm *sc) {
    while (sc->live) {
        sent *e = sc->live;
        sc->live = e->next_c;
        e->sc = NULL;
        free(e->scratch);
        e->scratch = NULL;
        e->r = NULL;
    }
    fl_comm_destroy(sc->tc);
    free(sc);
}

static int s_comm_destroy(void *comm) {
    if (!comm) return FL_NCCL_INVALID_ARGUMENT;
    comm_release(comm);
    return FL_NCCL_SUCCESS;
}

static int s_comm_abort(void *comm) {
    scomm *sc = comm;
    if (!sc) return FL_NCCL_INVALID_ARGUMENT;
    fl_comm_abort(sc->tc, 1, "ncclCommAbort");
    comm_release(sc);
    return FL_NCCL_SUCCESS;
}

static int s_comm_get_async_error(void *comm, int *err) {
    scomm *sc = comm;
    if (!sc || !err) return FL_NCCL_INVALID_ARGUMENT;
    *err = sc->async_err;
    return FL_NCCL_SUCCESS;
}

static const char *s_get_error_string(int rc) {
    switch (rc) {
    case FL_NCCL_SUCCESS: return "no error";
    case 1: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case FL_NCCL_SYSTEM_ERROR: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case FL_NCCL_INTERNAL_ERROR: return "internal error - please report this issue to the NCCL developers";
    case FL_NCCL_INVALID_ARGUMENT: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case FL_NCCL_INVALID_USAGE: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case FL_NCCL_REMOTE_ERROR: return "remote process exited or there was a network error";
    case FL_NCCL_IN_PROGRESS: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

static const char *s_get_last_error(void *comm) { return comm ? ((scomm *)comm)->last : ""; }

static int s_check(scomm *sc, int dtype, int op, int need_op) {
    if (!sc) return FL_NCCL_INVALID_ARGUMENT;
    if (dtype != FL_NCCL_FLOAT32 && dtype != FL_NCCL_BFLOAT16 && dtype != FL_NCCL_FLOAT16) {
        snprintf(sc->last, sizeof sc->last, "stand-in: datatype %d (ncclFloat32, ncclBfloat16 and ncclFloat16 only)",
                 dtype);
        return FL_NCCL_INVALID_ARGUMENT;
    }
    if (need_op && op != FL_NCCL_SUM && op != FL_NCCL_MAX && op != FL_NCCL_AVG) {
        snprintf(sc->last, sizeof sc->last, "stand-in: reduction op %d (ncclSum, ncclMax and ncclAvg only)", op);
        return FL_NCCL_INVALID_ARGUMENT;
    }
    return FL_NCCL_SUCCESS;
}

static fl_dtype s_dt(int dtype) {
    return dtype == FL_NCCL_BFLOAT16 ? FL_BF16 : dtype == FL_NCCL_FLOAT16 ? FL_F16 : FL_F32;
}
static fl_comm_op s_op(int op) { return op == FL_NCCL_MAX ? FL_COMM_MAX : op == FL_NCCL_AVG ? FL_COMM_AVG : FL_COMM_SUM; }

static int s_all_reduce(const void *send, void *recv, size_t count, int dtype, int op, void *comm, void *stream) {
    scomm *sc = comm;
    int rc = s_check(sc, dtype, op, 1);
    if (rc) return rc;
    fl_comm_req *r;
    fl_status s = fl_comm_iall_reduce(sc->tc, send, recv, count, s_dt(dtype), s_op(op), &r);
    return enqueue(sc, stream, s, r, NULL);
}

static int s_reduce_scatter(const void *send, void *recv, size_t recvcount, int dtype, int op, void *comm,
                            void *stream) {
    scomm *sc = comm;
    int rc = s_check(sc, dtype, op, 1);
    if (rc) return rc;
    fl_comm_req *r;
    /* nranks equal blocks: fl_comm's chunks of recvcount x nranks elements, rank r's at r x recvcount */
    fl_status s = fl_comm_ireduce_scatter(sc->tc, send, recv, recvcount * (size_t)sc->n, s_dt(dtype), s_op(op), &r);
    return enqueue(sc, stream, s, r, NULL);
}

static int s_all_gather(const void *send, void *recv, size_t sendcount, int dtype, void *comm, void *stream) {
    scomm *sc = comm;
    int rc = s_check(sc, dtype, 0, 0);
    if (rc) return rc;
    fl_comm_req *r;
    fl_status s = fl_comm_iall_gather(sc->tc, send, recv, sendcount * (size_t)sc->n, s_dt(dtype), &r);
    return enqueue(sc, stream, s, r, NULL);
}

static int overlap(const void *a, const void *b, size_t bytes) {
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return bytes && x < y + bytes && y < x + bytes;
}

static int s_broadcast(const void *send, void *recv, size_t count, int dtype, int root, void *comm, void *stream) {
    scomm *sc = comm;
    int rc = s_check(sc, dtype, 0, 0);
    if (rc) return rc;
    size_t bytes = count * fl_dtype_size(s_dt(dtype));
    if (root < 0 || root >= sc->n || (count && !recv) || (count && sc->rank == root && !send)) {
        snprintf(sc->last, sizeof sc->last, "stand-in: ncclBroadcast: root %d of %d, a NULL buffer", root, sc->n);
        return FL_NCCL_INVALID_ARGUMENT;
    }
    if (sc->rank == root && send != recv) {
        if (overlap(send, recv, bytes)) {
            snprintf(sc->last, sizeof sc->last, "stand-in: ncclBroadcast: send and recv overlap without being equal");
            return FL_NCCL_INVALID_ARGUMENT;
        }
        if (bytes) memcpy(recv, send, bytes);
    }
    fl_comm_req *r;
    fl_status s = fl_comm_ibroadcast(sc->tc, recv, count, s_dt(dtype), root, &r);
    return enqueue(sc, stream, s, r, NULL);
}

/* fl_comm has no reduce-to-root: an all-reduce whose non-root ranks write scratch. */
static int s_reduce(const void *send, void *recv, size_t count, int dtype, int op, int root, void *comm,
                    void *stream) {
    scomm *sc = comm;
    int rc = s_check(sc, dtype, op, 1);
    if (rc) return rc;
    size_t bytes = count * fl_dtype_size(s_dt(dtype));
    if (root < 0 || root >= sc->n || (count && sc->rank == root && !recv)) {
        snprintf(sc->last, sizeof sc->last, "stand-in: ncclReduce: root %d of %d, NULL recv on the root", root, sc->n);
        return FL_NCCL_INVALID_ARGUMENT;
    }
    void *scratch = NULL, *dst = recv;
    if (sc->rank != root) {
        scratch = malloc(bytes ? bytes : 1);
        if (!scratch) return FL_NCCL_SYSTEM_ERROR;
        dst = scratch;
    }
    fl_comm_req *r;
    fl_status s = fl_comm_iall_reduce(sc->tc, send, dst, count, s_dt(dtype), s_op(op), &r);
    return enqueue(sc, stream, s, r, scratch);
}

static int s_group_start(void) {
    g_group_depth++;
    return FL_NCCL_SUCCESS;
}

static int s_group_end(void) {
    if (g_group_depth == 0) return FL_NCCL_INVALID_USAGE;
    g_group_depth--;
    return FL_NCCL_SUCCESS;
}

/* ---- streams and events ---------------------------------------------------------------------- */

static int s_stream_create(void **out) {
    *out = calloc(1, sizeof(sstream));
    return *out ? 0 : 2; /* cudaErrorMemoryAllocation */
}

static int s_stream_destroy(void *stream) {
    sstream *st = stream;
    if (!st) return 0;
    for (sent *e = st->head; e; e = e->next_s)
        if (e->r) entry_close(e, fl_comm_wait(&e->r));
    stream_sweep(st);
    free(st);
    return 0;
}

static int s_event_create(void **out) {
    *out = calloc(1, sizeof(sevent));
    return *out ? 0 : 2;
}

static int s_event_destroy(void *ev) {
    free(ev);
    return 0;
}

static int s_event_record(void *ev, void *stream) {
    sevent *e = ev;
    e->s = stream;
    e->upto = stream ? ((sstream *)stream)->posted : 0;
    return 0;
}

/* Progress the collectives before the event (blocking: wait for each). */
static int s_event_progress(void *ev, int block) {
    sevent *e = ev;
    if (!e->s) return 0;
    int pending = 0;
    for (sent *x = e->s->head; x; x = x->next_s) {
        if (!x->r || x->seq > e->upto) continue;
        if (block) {
            entry_close(x, fl_comm_wait(&x->r));
        } else {
            int done = 0;
            fl_status s = fl_comm_test(&x->r, &done);
            if (done || s != FL_OK) entry_close(x, s);
            else pending = 1;
        }
    }
    stream_sweep(e->s);
    return pending ? FL_NCCL_EVENT_PENDING : 0;
}

static int s_event_query(void *ev) { return s_event_progress(ev, 0); }
/* Sleep until the first pending collective before the event can move on (its threads group's
 * condition variable: a peer posted or finished a phase, or the group broke) or max_s passes. */
static int s_event_wait(void *ev, double max_s) {
    sevent *e = ev;
    if (!e->s) return 0;
    for (sent *x = e->s->head; x; x = x->next_s)
        if (x->r && x->seq <= e->upto) {
            fl_comm_threads_idle_wait(x->r, max_s);
            break;
        }
    return 0;
}
static int s_event_synchronize(void *ev) { return s_event_progress(ev, 1); }

static int s_stream_wait_event(void *stream, void *ev) {
    (void)stream; (void)ev; /* a stand-in stream posts in order; the emulated backend's work is already done */
    return 0;
}

static const char *s_cuda_error_string(int err) { return err == 0 ? "no error" : err == 2 ? "out of memory" : "stand-in error"; }

static const fl_nccl_api k_standin = {
    .name = "nccl-standin",
    .get_version = s_get_version,
    .get_unique_id = s_get_unique_id,
    .comm_init_rank = s_comm_init_rank,
    .comm_destroy = s_comm_destroy,
    .comm_abort = s_comm_abort,
    .comm_get_async_error = s_comm_get_async_error,
    .get_error_string = s_get_error_string,
    .get_last_error = s_get_last_error,
    .all_reduce = s_all_reduce,
    .reduce_scatter = s_reduce_scatter,
    .all_gather = s_all_gather,
    .broadcast = s_broadcast,
    .reduce = s_reduce,
    .group_start = s_group_start,
    .group_end = s_group_end,
    .stream_create = s_stream_create,
    .stream_destroy = s_stream_destroy,
    .event_create = s_event_create,
    .event_destroy = s_event_destroy,
    .event_record = s_event_record,
    .event_query = s_event_query,
    .event_synchronize = s_event_synchronize,
    .stream_wait_event = s_stream_wait_event,
    .cuda_error_string = s_cuda_error_string,
    .event_wait = s_event_wait,
};

const fl_nccl_api *fl_nccl_standin_api(void) { return &k_standin; }

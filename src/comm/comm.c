/* The communication layer's common part (include/fitllm/comm.h): argument checks and dispatch,
 * the chunk layout, the one reduction kernel, launcher detection, fl_comm_init, and the
 * single-process implementation. Threads: comm_threads.c; MPI: comm_mpi.c. */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/comm-impl.h"
#include "core/cvt.h"

/* ---- names and messages -------------------------------------------------------------------- */

const char *fl_comm_op_name(fl_comm_op op) {
    static const char *k[FL_COMM_OP_COUNT] = {"sum", "avg", "max"};
    return (op >= 0 && op < FL_COMM_OP_COUNT) ? k[op] : "?";
}

const char *fl_coll_kind_name(fl_coll_kind kd) {
    static const char *k[FL_COLL_COUNT] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier"};
    return (kd >= 0 && kd < FL_COLL_COUNT) ? k[kd] : "?";
}

const char *fl_comm_what(char *buf, size_t n, fl_coll_kind kind, size_t count, fl_dtype dt, fl_comm_op op, int root) {
    const char *dn = (dt == FL_F32 || dt == FL_BF16 || dt == FL_F16) ? fl_dtype_name(dt) : "?";
    switch (kind) {
    case FL_COLL_ALL_REDUCE:
    case FL_COLL_REDUCE_SCATTER:
        snprintf(buf, n, "%s(count %zu, %s, %s)", fl_coll_kind_name(kind), count, dn, fl_comm_op_name(op));
        break;
    case FL_COLL_ALL_GATHER: snprintf(buf, n, "all_gather(count %zu, %s)", count, dn); break;
    case FL_COLL_BROADCAST: snprintf(buf, n, "broadcast(count %zu, %s, root %d)", count, dn, root); break;
    default: snprintf(buf, n, "%s", fl_coll_kind_name(kind)); break;
    }
    return buf;
}

fl_status fl_comm_fail(const fl_comm *c, fl_status s, const char *what, const char *fmt, ...) {
    char msg[1536];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (!c) return fl_errorf(s, "comm: %s: %s", what, msg);
    return fl_errorf(s, "comm %s: rank %d of %d: %s: %s", c->vt->name, c->rank, c->size, what, msg);
}

/* ---- a wait that never ends (comm.h) -------------------------------------------------------- */

static fl_comm_note_fn g_note;

void fl_comm_set_timeout_note(fl_comm_note_fn fn) { g_note = fn; }

static int parse_timeout(double *out) {
    const char *e = getenv("FITLLM_COMM_TIMEOUT");
    *out = 600.0;
    if (!e || !*e) return 1;
    char *end;
    double v = strtod(e, &end);
    while (*end == ' ') end++;
    if (end == e || *end || v != v) return 0;
    *out = v;
    return 1;
}

double fl_comm_timeout(void) {
    double v;
    parse_timeout(&v);
    return v;
}

fl_status fl_comm_timeout_check(void) {
    double v;
    if (parse_timeout(&v)) return FL_OK;
    return fl_errorf(FL_ERR_INVALID, "FITLLM_COMM_TIMEOUT='%s' is not a number of seconds (the longest wait for the "
                     "other ranks in one collective; default 600, 0: never)", getenv("FITLLM_COMM_TIMEOUT"));
}

double fl_comm_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

const char *fl_comm_timeout_text(const fl_comm *c, const char *what, double limit_s, char *buf, size_t n) {
    char note[1024] = "";
    if (g_note) g_note(note, sizeof note);
    snprintf(buf, n, "comm %s: rank %d of %d: %s did not complete in %.4g s: another rank stopped or hangs, or the "
             "ranks' collectives differ (FITLLM_COMM_TIMEOUT sets the limit, default 600 s)%s%s", c->vt->name, c->rank,
             c->size, what, limit_s, note[0] ? "; " : "", note);
    return buf;
}

/* ---- chunk layout -------------------------------------------------------------------------- */

void fl_comm_chunk(size_t count, int size, int rank, size_t *off, size_t *len) {
    size_t n = size > 0 ? (size_t)size : 1, r = rank > 0 ? (size_t)rank : 0;
    size_t base = count / n, rem = count % n;
    *len = base + (r < rem ? 1 : 0);
    *off = r * base + (r < rem ? r : rem);
}

/* ---- the reduction kernel ------------------------------------------------------------------ */

#define RBLOCK 512

/* acc = x (first rank) / acc (+) x (later ranks), elementwise. MAX: a NaN in either wins, so an
 * overflow anywhere is seen (fmaxf would drop it). */
static inline void acc_first(float *acc, const float *x, size_t m) { memcpy(acc, x, m * sizeof(float)); }
static inline void acc_add(float *acc, const float *x, size_t m) {
    for (size_t i = 0; i < m; i++) acc[i] += x[i];
}
static inline void acc_max(float *acc, const float *x, size_t m) {
    for (size_t i = 0; i < m; i++) acc[i] = (x[i] > acc[i] || x[i] != x[i]) ? x[i] : acc[i];
}
/* 16-bit to fp32 (exact for BF16 and F16) and back (RNE; F16 overflow gives +-inf): the SIMD row
 * kernels of core/cvt.c, bit-identical to the scalar conversions of fitllm/dtype.h for every input,
 * so every implementation and every CPU computes the same bits. */
static void widen(float *dst, const uint16_t *src, size_t m, fl_dtype dt) {
    if (dt == FL_BF16) fl_cvt_bf16_to_f32(dst, src, m);
    else fl_cvt_f16_to_f32(dst, src, m);
}
static void narrow(uint16_t *dst, const float *src, size_t m, fl_dtype dt) {
    if (dt == FL_BF16) fl_cvt_f32_to_bf16(dst, src, m);
    else fl_cvt_f32_to_f16(dst, src, m);
}

void fl_comm_reduce_kernel(void *dst, const void *const *src, int n, size_t len, fl_dtype dt, fl_comm_op op) {
    float acc[RBLOCK], tmp[RBLOCK];
    const float inv_n = (float)n; /* AVG divides (correctly rounded), never multiplies by 1/n */
    for (size_t b = 0; b < len; b += RBLOCK) {
        size_t m = len - b < RBLOCK ? len - b : RBLOCK;
        for (int r = 0; r < n; r++) {
            const float *x;
            if (dt == FL_F32) {
                x = (const float *)src[r] + b;
            } else {
                widen(tmp, (const uint16_t *)src[r] + b, m, dt);
                x = tmp;
            }
            if (r == 0) acc_first(acc, x, m);
            else if (op == FL_COMM_MAX) acc_max(acc, x, m);
            else acc_add(acc, x, m);
        }
        if (op == FL_COMM_AVG)
            for (size_t i = 0; i < m; i++) acc[i] = acc[i] / inv_n;
        if (dt == FL_F32) {
            memcpy((float *)dst + b, acc, m * sizeof(float));
        } else {
            narrow((uint16_t *)dst + b, acc, m, dt);
        }
    }
}

/* ---- scratch and handles ------------------------------------------------------------------- */

fl_status fl_comm_scratch_alloc(fl_comm *c, size_t bytes, void **out) {
    *out = NULL;
    if (bytes == 0) return FL_OK;
    if (c->pool) return fl_mem_alloc(c->pool, FL_TAG_WORKSPACE, bytes, out);
    *out = malloc(bytes);
    if (!*out) return fl_errorf(FL_ERR_OOM, "comm: cannot allocate %zu bytes of scratch", bytes);
    return FL_OK;
}

void fl_comm_scratch_free(fl_comm *c, void *p) {
    if (!p) return;
    if (c->pool) fl_mem_free(c->pool, p);
    else free(p);
}

void fl_comm_set_pool(fl_comm *c, fl_mem_pool *pool) { c->pool = pool; }

size_t fl_comm_scratch_bytes(const fl_comm *c, fl_coll_kind kind, size_t count, fl_dtype dt) {
    if (strcmp(c->vt->name, "mpi") != 0 || c->size < 2) return 0;
    if (kind != FL_COLL_ALL_REDUCE && kind != FL_COLL_REDUCE_SCATTER) return 0;
    size_t off, len;
    fl_comm_chunk(count, c->size, c->rank, &off, &len);
    return (size_t)(c->size - 1) * len * fl_dtype_size(dt);
}

fl_status fl_comm_alloc_handle_over(const fl_comm_vtable *vt, const fl_comm *host, void *impl, fl_comm **out) {
    FL_TRY(fl_comm_alloc_handle(vt, host->rank, host->size, out));
    (*out)->impl = impl;
    (*out)->local_rank = host->local_rank;
    (*out)->local_size = host->local_size;
    (*out)->launch = host->launch;
    return FL_OK;
}

fl_status fl_comm_split_over(fl_comm *host, int color, int key, fl_comm_over_fn make, void *ud, fl_comm **out) {
    fl_comm *part = NULL;
    FL_TRY(fl_comm_split(host, color, key, &part));
    fl_status s = make(part, ud, out);
    if (s != FL_OK) fl_comm_destroy(part);
    return s;
}

fl_status fl_comm_alloc_handle(const fl_comm_vtable *vt, int rank, int size, fl_comm **out) {
    fl_comm *c = calloc(1, sizeof *c);
    if (!c) return fl_errorf(FL_ERR_OOM, "comm: cannot allocate a handle");
    c->vt = vt;
    c->rank = rank;
    c->size = size;
    c->local_rank = rank;
    c->local_size = size;
    c->launch.kind = FL_LAUNCH_NONE;
    c->launch.rank = 0;
    c->launch.size = 1;
    c->launch.local_rank = c->launch.local_size = -1;
    *out = c;
    return FL_OK;
}

/* ---- argument checks and dispatch ---------------------------------------------------------- */

static int ranges_overlap(const void *a, size_t an, const void *b, size_t bn) {
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return an && bn && x < y + bn && y < x + an;
}

static fl_status check_common(fl_comm *c, fl_coll_kind kind, size_t count, fl_dtype dt, fl_comm_op op, int root,
                              fl_comm_req **req, char *what, size_t wn) {
    if (req) *req = NULL;
    if (!c) return fl_errorf(FL_ERR_INVALID, "comm: %s on a NULL communicator", fl_coll_kind_name(kind));
    fl_comm_what(what, wn, kind, count, dt, op, root);
    if (!req) return fl_comm_fail(c, FL_ERR_INVALID, what, "no request pointer");
    if (dt != FL_F32 && dt != FL_BF16 && dt != FL_F16)
        return fl_comm_fail(c, FL_ERR_UNSUPPORTED, what, "dtype %s (F32, BF16 and F16 are supported)",
                            dt >= 0 && dt < FL_DTYPE_COUNT ? fl_dtype_name(dt) : "?");
    if ((kind == FL_COLL_ALL_REDUCE || kind == FL_COLL_REDUCE_SCATTER) && (op < 0 || op >= FL_COMM_OP_COUNT))
        return fl_comm_fail(c, FL_ERR_INVALID, what, "unknown op %d", (int)op);
    if (kind == FL_COLL_BROADCAST && (root < 0 || root >= c->size))
        return fl_comm_fail(c, FL_ERR_INVALID, what, "root %d outside [0, %d)", root, c->size);
    if (count > (size_t)PTRDIFF_MAX / 4) return fl_comm_fail(c, FL_ERR_INVALID, what, "count too large");
    return FL_OK;
}

/* Count a posted collective (after its checks passed): see fl_comm_traffic. */
static void account(fl_comm *c, fl_coll_kind kind, size_t count, fl_dtype dt, int root) {
    const unsigned long long es = fl_dtype_size(dt);
    size_t off, len;
    fl_comm_chunk(count, c->size, c->rank, &off, &len);
    unsigned long long out = 0, in = 0;
    const unsigned long long others = (unsigned long long)(count - len), gathered = (unsigned long long)(c->size - 1) * len;
    if (c->size > 1) switch (kind) {
        case FL_COLL_REDUCE_SCATTER: out = others; in = gathered; break;
        case FL_COLL_ALL_GATHER: out = gathered; in = others; break;
        case FL_COLL_ALL_REDUCE: out = in = others + gathered; break;
        case FL_COLL_BROADCAST: if (c->rank == root) out = (unsigned long long)(c->size - 1) * count; else in = count; break;
        default: break;
        }
    c->traffic.sent += out * es;
    c->traffic.received += in * es;
    c->traffic.calls[kind]++;
    c->traffic.buffer_bytes[kind] += (unsigned long long)count * es;
}

void fl_comm_get_traffic(const fl_comm *c, fl_comm_traffic *t) {
    if (c) *t = c->traffic;
    else memset(t, 0, sizeof *t);
}

fl_status fl_comm_iall_reduce(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt, fl_comm_op op,
                              fl_comm_req **req) {
    char what[128];
    FL_TRY(check_common(c, FL_COLL_ALL_REDUCE, count, dt, op, 0, req, what, sizeof what));
    if (count && (!send || !recv)) return fl_comm_fail(c, FL_ERR_INVALID, what, "NULL buffer");
    size_t es = fl_dtype_size(dt);
    if (send != recv && ranges_overlap(send, count * es, recv, count * es))
        return fl_comm_fail(c, FL_ERR_INVALID, what, "send and recv overlap without being equal");
    account(c, FL_COLL_ALL_REDUCE, count, dt, 0);
    return c->vt->iall_reduce(c, send, recv, count, dt, op, req);
}

fl_status fl_comm_ireduce_scatter(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt,
                                  fl_comm_op op, fl_comm_req **req) {
    char what[128];
    FL_TRY(check_common(c, FL_COLL_REDUCE_SCATTER, count, dt, op, 0, req, what, sizeof what));
    size_t es = fl_dtype_size(dt), off, len;
    fl_comm_chunk(count, c->size, c->rank, &off, &len);
    if ((count && !send) || (len && !recv)) return fl_comm_fail(c, FL_ERR_INVALID, what, "NULL buffer");
    if (len && recv != (const char *)send + off * es && ranges_overlap(send, count * es, recv, len * es))
        return fl_comm_fail(c, FL_ERR_INVALID, what,
                            "recv overlaps send without being this rank's chunk (send + %zu elements)", off);
    account(c, FL_COLL_REDUCE_SCATTER, count, dt, 0);
    return c->vt->ireduce_scatter(c, send, recv, count, dt, op, req);
}

fl_status fl_comm_iall_gather(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt,
                              fl_comm_req **req) {
    char what[128];
    FL_TRY(check_common(c, FL_COLL_ALL_GATHER, count, dt, FL_COMM_SUM, 0, req, what, sizeof what));
    size_t es = fl_dtype_size(dt), off, len;
    fl_comm_chunk(count, c->size, c->rank, &off, &len);
    if ((len && !send) || (count && !recv)) return fl_comm_fail(c, FL_ERR_INVALID, what, "NULL buffer");
    if (len && send != (const char *)recv + off * es && ranges_overlap(send, len * es, recv, count * es))
        return fl_comm_fail(c, FL_ERR_INVALID, what,
                            "send overlaps recv without being this rank's chunk (recv + %zu elements)", off);
    account(c, FL_COLL_ALL_GATHER, count, dt, 0);
    return c->vt->iall_gather(c, send, recv, count, dt, req);
}

fl_status fl_comm_ibroadcast(fl_comm *c, void *buf, size_t count, fl_dtype dt, int root, fl_comm_req **req) {
    char what[128];
    FL_TRY(check_common(c, FL_COLL_BROADCAST, count, dt, FL_COMM_SUM, root, req, what, sizeof what));
    if (count && !buf) return fl_comm_fail(c, FL_ERR_INVALID, what, "NULL buffer");
    account(c, FL_COLL_BROADCAST, count, dt, root);
    return c->vt->ibroadcast(c, buf, count, dt, root, req);
}

fl_status fl_comm_wait(fl_comm_req **req) {
    if (!req || !*req) return FL_OK;
    fl_comm_req *r = *req;
    *req = NULL;
    return r->comm->vt->wait(r->comm, r);
}

fl_status fl_comm_test(fl_comm_req **req, int *done) {
    *done = 1;
    if (!req || !*req) return FL_OK;
    fl_comm_req *r = *req;
    *done = 0;
    fl_status s = r->comm->vt->test(r->comm, r, done);
    if (s != FL_OK || *done) {
        *req = NULL;
        *done = 1;
    }
    return s;
}

fl_status fl_comm_wait_all(fl_comm_req **reqs, int n) {
    fl_status first = FL_OK;
    char msg[2048] = "";
    for (int i = 0; i < n; i++) {
        fl_status s = fl_comm_wait(&reqs[i]);
        if (s != FL_OK && first == FL_OK) {
            first = s;
            snprintf(msg, sizeof msg, "%s", fl_error_message());
        }
    }
    if (first != FL_OK) fl_errorf(first, "%s", msg);
    return first;
}

fl_status fl_comm_all_reduce(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt, fl_comm_op op) {
    fl_comm_req *r;
    FL_TRY(fl_comm_iall_reduce(c, send, recv, count, dt, op, &r));
    return fl_comm_wait(&r);
}

fl_status fl_comm_reduce_scatter(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt,
                                 fl_comm_op op) {
    fl_comm_req *r;
    FL_TRY(fl_comm_ireduce_scatter(c, send, recv, count, dt, op, &r));
    return fl_comm_wait(&r);
}

fl_status fl_comm_all_gather(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt) {
    fl_comm_req *r;
    FL_TRY(fl_comm_iall_gather(c, send, recv, count, dt, &r));
    return fl_comm_wait(&r);
}

fl_status fl_comm_broadcast(fl_comm *c, void *buf, size_t count, fl_dtype dt, int root) {
    fl_comm_req *r;
    FL_TRY(fl_comm_ibroadcast(c, buf, count, dt, root, &r));
    return fl_comm_wait(&r);
}

fl_status fl_comm_barrier(fl_comm *c) {
    if (!c) return fl_errorf(FL_ERR_INVALID, "comm: barrier on a NULL communicator");
    c->traffic.calls[FL_COLL_BARRIER]++;
    return c->vt->barrier(c);
}

/* ---- point to point ------------------------------------------------------------------------ */

static fl_status check_p2p(fl_comm *c, const char *op, const void *buf, size_t count, fl_dtype dt, int peer, int tag,
                           char *what, size_t wn) {
    if (!c) return fl_errorf(FL_ERR_INVALID, "comm: %s on a NULL communicator", op);
    const int dt_ok = dt >= 0 && dt < FL_DTYPE_COUNT && fl_dtype_size(dt) > 0;
    snprintf(what, wn, "%s(count %zu, %s, %s rank %d, tag %d)", op, count, dt_ok ? fl_dtype_name(dt) : "?",
             op[0] == 's' ? "to" : "from", peer, tag);
    if (!dt_ok) return fl_comm_fail(c, FL_ERR_UNSUPPORTED, what, "dtype %d has no element size", (int)dt);
    if (peer < 0 || peer >= c->size || peer == c->rank)
        return fl_comm_fail(c, FL_ERR_INVALID, what, "peer %d is not another rank of the %d", peer, c->size);
    if (tag < 0 || tag >= FL_COMM_TAG_LIMIT)
        return fl_comm_fail(c, FL_ERR_INVALID, what, "tag %d outside [0, %d)", tag, FL_COMM_TAG_LIMIT);
    if (count > (size_t)PTRDIFF_MAX / 8) return fl_comm_fail(c, FL_ERR_INVALID, what, "count too large");
    if (count && !buf) return fl_comm_fail(c, FL_ERR_INVALID, what, "NULL buffer");
    if (!(op[0] == 's' ? (void *)c->vt->send : (void *)c->vt->recv))
        return fl_comm_fail(c, FL_ERR_UNSUPPORTED, what, "the %s implementation has no point-to-point messages",
                            c->vt->name);
    return FL_OK;
}

fl_status fl_comm_send(fl_comm *c, const void *buf, size_t count, fl_dtype dt, int peer, int tag) {
    char what[160];
    FL_TRY(check_p2p(c, "send", buf, count, dt, peer, tag, what, sizeof what));
    const size_t bytes = count * fl_dtype_size(dt);
    FL_TRY(c->vt->send(c, buf, bytes, peer, tag));
    c->traffic.sent += bytes;
    c->traffic.p2p_sends++;
    return FL_OK;
}

fl_status fl_comm_recv(fl_comm *c, void *buf, size_t count, fl_dtype dt, int peer, int tag) {
    char what[160];
    FL_TRY(check_p2p(c, "recv", buf, count, dt, peer, tag, what, sizeof what));
    const size_t bytes = count * fl_dtype_size(dt);
    FL_TRY(c->vt->recv(c, buf, bytes, peer, tag));
    c->traffic.received += bytes;
    c->traffic.p2p_recvs++;
    return FL_OK;
}

fl_status fl_comm_split_members(fl_comm *c, int color, int key, int *new_rank, int *new_size, int **members) {
    *members = NULL;
    int32_t *all = malloc(((size_t)c->size * 2 + 2) * sizeof *all);
    if (!all) return fl_comm_fail(c, FL_ERR_OOM, "split", "out of host memory");
    int32_t *mine = all + (size_t)c->size * 2;
    mine[0] = color, mine[1] = key;
    /* int32 bits in F32 words: an all-gather copies, it never adds */
    fl_status s = fl_comm_all_gather(c, mine, all, (size_t)c->size * 2, FL_F32);
    int n = 0, *mem = s == FL_OK ? malloc((size_t)c->size * sizeof *mem) : NULL;
    if (s == FL_OK && !mem) s = fl_comm_fail(c, FL_ERR_OOM, "split", "out of host memory");
    if (s == FL_OK) {
        for (int r = 0; r < c->size; r++) /* insertion by (key, rank): rank order is the tie-break */
            if (all[2 * r] == color) {
                int i = n++;
                while (i > 0 && all[2 * mem[i - 1] + 1] > all[2 * r + 1]) mem[i] = mem[i - 1], i--;
                mem[i] = r;
            }
        for (int i = 0; i < n; i++)
            if (mem[i] == c->rank) *new_rank = i;
        *new_size = n;
        *members = mem;
    }
    free(all);
    return s;
}

fl_status fl_comm_split(fl_comm *c, int color, int key, fl_comm **out) {
    *out = NULL;
    if (!c) return fl_errorf(FL_ERR_INVALID, "comm: split of a NULL communicator");
    if (color < 0) return fl_comm_fail(c, FL_ERR_INVALID, "split", "color %d (must be >= 0)", color);
    if (!c->vt->split) return fl_comm_fail(c, FL_ERR_UNSUPPORTED, "split", "this implementation cannot split");
    fl_comm_traffic keep = c->traffic; /* set-up, not training traffic */
    fl_status s = c->vt->split(c, color, key, out);
    c->traffic = keep;
    return s;
}

void fl_comm_abort(fl_comm *c, int code, const char *msg) {
    if (c) c->vt->abort(c, code, msg ? msg : "");
}

int fl_comm_release_peers(fl_comm *c, const char *msg) {
    if (!c || !c->vt->release_peers) return 0;
    /* msg is usually this thread's error message, which the implementation's calls may rewrite */
    char keep[2048];
    snprintf(keep, sizeof keep, "%s", msg ? msg : "");
    int r = c->vt->release_peers(c, keep);
    fl_errorf(FL_OK, "%s", keep);
    return r;
}

void fl_comm_destroy(fl_comm *c) {
    if (c) c->vt->destroy(c);
}

/* ---- the single-process implementation ----------------------------------------------------- */
/* Size 1: a reduction is the kernel over one source (so BF16 NaN payloads come out exactly as the
 * threads implementation's at size 1), gathers are copies; everything completes when posted. */

fl_status fl_comm_done_req(fl_comm *c, fl_coll_kind kind, size_t count, fl_dtype dt, fl_comm_op op,
                           fl_comm_req **req) {
    fl_comm_req *r = malloc(sizeof *r);
    if (!r) return fl_comm_fail(c, FL_ERR_OOM, "request", "cannot allocate a request");
    r->comm = c;
    r->kind = kind;
    r->count = count;
    r->dtype = dt;
    r->op = op;
    *req = r;
    return FL_OK;
}

static fl_status single_reduce(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt, fl_comm_op op,
                               fl_comm_req **req) {
    const void *src[1] = {send};
    fl_comm_reduce_kernel(recv, src, 1, count, dt, op);
    return fl_comm_done_req(c, FL_COLL_ALL_REDUCE, count, dt, op, req);
}

static fl_status single_rs(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt, fl_comm_op op,
                           fl_comm_req **req) {
    const void *src[1] = {send};
    fl_comm_reduce_kernel(recv, src, 1, count, dt, op);
    return fl_comm_done_req(c, FL_COLL_REDUCE_SCATTER, count, dt, op, req);
}

static fl_status single_ag(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt, fl_comm_req **req) {
    if (count && send != recv) memcpy(recv, send, count * fl_dtype_size(dt));
    return fl_comm_done_req(c, FL_COLL_ALL_GATHER, count, dt, FL_COMM_SUM, req);
}

static fl_status single_bcast(fl_comm *c, void *buf, size_t count, fl_dtype dt, int root, fl_comm_req **req) {
    (void)buf; (void)root;
    return fl_comm_done_req(c, FL_COLL_BROADCAST, count, dt, FL_COMM_SUM, req);
}

static fl_status single_barrier(fl_comm *c) { (void)c; return FL_OK; }

fl_status fl_comm_done_test(fl_comm *c, fl_comm_req *r, int *done) {
    (void)c;
    free(r);
    *done = 1;
    return FL_OK;
}

fl_status fl_comm_done_wait(fl_comm *c, fl_comm_req *r) {
    (void)c;
    free(r);
    return FL_OK;
}

static void single_abort(fl_comm *c, int code, const char *msg) { (void)c; (void)code; (void)msg; }
static void single_destroy(fl_comm *c) { free(c); }

static fl_status single_split(fl_comm *c, int color, int key, fl_comm **out) {
    (void)color, (void)key;
    FL_TRY(fl_comm_init_single(out));
    (*out)->launch = c->launch;
    return FL_OK;
}

static const fl_comm_vtable k_single = {
    .name = "single",
    .iall_reduce = single_reduce,
    .ireduce_scatter = single_rs,
    .iall_gather = single_ag,
    .ibroadcast = single_bcast,
    .barrier = single_barrier,
    .test = fl_comm_done_test,
    .wait = fl_comm_done_wait,
    .abort = single_abort,
    .destroy = single_destroy,
    .split = single_split,
};

fl_status fl_comm_init_single(fl_comm **out) { return fl_comm_alloc_handle(&k_single, 0, 1, out); }

/* ---- launcher detection -------------------------------------------------------------------- */

const char *fl_launch_kind_name(fl_launch_kind k) {
    static const char *n[FL_LAUNCH_COUNT] = {"none", "Open MPI (mpirun)", "PMI (MPICH/Intel MPI mpiexec)",
                                             "Slurm (srun)", "torchrun-style variables"};
    return (k >= 0 && k < FL_LAUNCH_COUNT) ? n[k] : "?";
}

/* *out = the integer in variable `name`; 0 if unset, 1 if set, error if malformed. */
static fl_status env_int(const char *name, int *out, int *set) {
    const char *v = getenv(name);
    *set = 0;
    if (!v || !*v) return FL_OK;
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    while (*end == ' ') end++;
    if (errno || *end || x < 0 || x > INT_MAX)
        return fl_errorf(FL_ERR_INVALID, "launcher variable %s='%s' is not a non-negative integer", name, v);
    *out = (int)x;
    *set = 1;
    return FL_OK;
}

fl_status fl_launch_detect(fl_launch_info *li) {
    memset(li, 0, sizeof *li);
    li->kind = FL_LAUNCH_NONE;
    li->rank = 0;
    li->size = 1;
    li->local_rank = li->local_size = -1;
    static const struct {
        fl_launch_kind kind;
        const char *rank, *size, *size_alt, *local_rank, *local_size;
    } k[] = {
        {FL_LAUNCH_OPENMPI, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", NULL, "OMPI_COMM_WORLD_LOCAL_RANK",
         "OMPI_COMM_WORLD_LOCAL_SIZE"},
        {FL_LAUNCH_PMI, "PMI_RANK", "PMI_SIZE", NULL, "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
        /* SLURM_STEP_NUM_TASKS is the srun step's; SLURM_NTASKS alone is also set in a batch script
         * that runs fitllm once, without srun */
        {FL_LAUNCH_SLURM, "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_LOCALID", NULL},
        {FL_LAUNCH_TORCHRUN, "RANK", "WORLD_SIZE", NULL, "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    };
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        int rank = 0, size = 0, rs, ss;
        FL_TRY(env_int(k[i].rank, &rank, &rs));
        FL_TRY(env_int(k[i].size, &size, &ss));
        const char *size_name = k[i].size;
        if (!ss && k[i].size_alt) {
            FL_TRY(env_int(k[i].size_alt, &size, &ss));
            size_name = k[i].size_alt;
        }
        if (!rs || !ss) continue;
        if (size < 1 || rank >= size)
            return fl_errorf(FL_ERR_INVALID, "launcher variables %s=%d and %s=%d: the rank must be in [0, size)",
                             k[i].rank, rank, size_name, size);
        li->kind = k[i].kind;
        li->rank = rank;
        li->size = size;
        int v, set;
        if (k[i].local_rank) {
            FL_TRY(env_int(k[i].local_rank, &v, &set));
            if (set) li->local_rank = v;
        }
        if (k[i].local_size) {
            FL_TRY(env_int(k[i].local_size, &v, &set));
            if (set) li->local_size = v;
        }
        if (k[i].kind == FL_LAUNCH_TORCHRUN) {
            const char *a = getenv("MASTER_ADDR");
            snprintf(li->master_addr, sizeof li->master_addr, "%s", a ? a : "");
            FL_TRY(env_int("MASTER_PORT", &v, &set));
            if (set) li->master_port = v;
        }
        return FL_OK;
    }
    return FL_OK;
}

const char *fl_launch_describe(const fl_launch_info *li, char *buf, size_t n) {
    if (li->kind == FL_LAUNCH_NONE) {
        snprintf(buf, n, "none: single process");
        return buf;
    }
    int w = snprintf(buf, n, "%s: rank %d of %d", fl_launch_kind_name(li->kind), li->rank, li->size);
    if (w < 0 || (size_t)w >= n) return buf;
    if (li->local_rank >= 0 && li->local_size > 0)
        w += snprintf(buf + w, n - w, ", local rank %d of %d", li->local_rank, li->local_size);
    else if (li->local_rank >= 0)
        w += snprintf(buf + w, n - w, ", local rank %d", li->local_rank);
    if (w >= 0 && (size_t)w < n && li->master_addr[0])
        snprintf(buf + w, n - w, ", master %s:%d", li->master_addr, li->master_port);
    return buf;
}

/* ---- fl_comm_init -------------------------------------------------------------------------- */

int fl_comm_mpi_built(void) {
#ifdef FL_HAVE_MPI
    return 1;
#else
    return 0;
#endif
}

#ifndef FL_HAVE_MPI
const char *fl_comm_mpi_library(void) { return "none"; }
#endif

fl_status fl_launch_check(const fl_launch_info *li) {
    if (li->kind != FL_LAUNCH_TORCHRUN || li->size <= 1) return FL_OK;
    return fl_errorf(FL_ERR_UNSUPPORTED,
                     "comm: launched with torchrun-style variables (RANK=%d, WORLD_SIZE=%d%s%s) but without an MPI "
                     "launcher; fitllm's ranks talk through MPI, so start them with mpirun instead: "
                     "`mpirun -np %d fitllm ...` on one machine, `mpirun -np %d --hostfile HOSTS fitllm ...` or "
                     "`srun --mpi=pmix -n %d fitllm ...` across nodes",
                     li->rank, li->size, li->master_addr[0] ? ", MASTER_ADDR=" : "", li->master_addr, li->size,
                     li->size, li->size);
}

fl_status fl_comm_init(fl_comm **out, int *argc, char ***argv) {
    *out = NULL;
    fl_launch_info li;
    FL_TRY(fl_launch_detect(&li));
    FL_TRY(fl_comm_timeout_check());
    if (li.size <= 1) {
        FL_TRY(fl_comm_init_single(out));
        (*out)->launch = li;
        return FL_OK;
    }
    FL_TRY(fl_launch_check(&li));
#ifdef FL_HAVE_MPI
    return fl_comm_mpi_init(out, &li, argc, argv);
#else
    (void)argc; (void)argv;
    return fl_errorf(FL_ERR_UNSUPPORTED,
                     "comm: launched as rank %d of %d by %s, but this fitllm was built without MPI: multi-process "
                     "training needs a build with MPI (apt-get install openmpi-bin libopenmpi-dev, then configure and "
                     "build again: cmake -S . -B build && cmake --build build)",
                     li.rank, li.size, fl_launch_kind_name(li.kind));
#endif
}

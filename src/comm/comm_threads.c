/* The threads implementation of fl_comm: N ranks as N threads of one process sharing memory.
 *
 * For tests: collective semantics in the normal suite where MPI is absent, and the bit-exact
 * twin of the MPI implementation (the same chunk layout, rank order and reduction kernel).
 *
 * Each collective a rank posts takes the next sequence number; the group keeps a ring of SLOTS
 * shared op records indexed by it. A rank posts its buffer pointers into the record, then its
 * request goes through two phases, each followed by a rendezvous of all ranks:
 *   phase A  all_reduce / reduce_scatter: reduce this rank's chunk from every rank's send buffer;
 *            all_gather: copy every rank's chunk in; broadcast: copy the root's buffer;
 *   phase B  all_reduce: copy the other ranks' reduced chunks in (from their recv buffers);
 * and is complete when every rank has finished phase B (nobody reads its buffers any more). Work
 * runs outside the lock; the counters under it. Waiting progresses all of the rank's outstanding
 * requests, so requests may be completed in any order without deadlock. A failure (a rank's
 * abort, mismatched calls, a timeout) breaks the whole group: every rank's pending and later
 * calls fail naming the cause.
 *
 * Splits (fl_comm_split): the new group's rank 0 allocates it and its address travels to the
 * members over the parent (an all-gather of the pointer's bits). Every group split from one
 * fl_comm_threads_create shares a `family`: a group that breaks records its cause there too, and
 * a rank waiting in any group of the family sees it within FAMILY_POLL_MS (its waits wake up that
 * often while the family has more than one group), so one rank's failure ends every rank's calls
 * as MPI_Abort ends every process. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/comm-impl.h"

#define SLOTS 64
#define FAMILY_POLL_MS 20

struct group;
typedef struct {
    pthread_mutex_t mu; /* a leaf lock: taken with a group's lock held, never the other way */
    int broken, groups;
    int handles;        /* the family's live handles (attach .. t_destroy) */
    struct group *all;  /* every group of the family, linked by fam_next */
    char why[1024];
} family;

typedef struct {
    int busy;
    uint64_t seq;
    int posted, doneA, doneB, released;
    fl_coll_kind kind;
    size_t count;
    fl_dtype dt;
    fl_comm_op op;
    int root, first_rank;
    const void **send; /* [n] */
    void **recv;       /* [n] */
} slot;

/* A point-to-point message in flight: the sender's copy, until the receiver takes it. */
typedef struct msg {
    int src, dst, tag;
    size_t bytes;
    struct msg *next;
    unsigned char data[];
} msg;

typedef struct group {
    int n;
    double timeout_s;
    msg *mail; /* every rank's messages in flight, oldest first */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    slot slots[SLOTS];
    int broken;
    char why[1024]; /* the cause, reported by every rank */
    int refs;
    family *fam;
    struct group *fam_next;
} group;

typedef struct treq {
    fl_comm_req base;
    uint64_t seq;
    int stage; /* 0 posted, 1 phase A done, 2 phase B done, 3 complete */
    struct treq *next;
} treq;

typedef struct {
    group *g;
    uint64_t next_seq;
    treq *head; /* outstanding, in posting order */
} tcomm;

static void break_group(group *g, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void break_group(group *g, const char *fmt, ...) {
    if (g->broken) return; /* the first cause is the one reported */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g->why, sizeof g->why, fmt, ap);
    va_end(ap);
    g->broken = 1;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_lock(&g->fam->mu);
    if (!g->fam->broken) {
        g->fam->broken = 1;
        memcpy(g->fam->why, g->why, sizeof g->why);
    }
    pthread_mutex_unlock(&g->fam->mu);
}

/* Another group of the family broke: this one breaks with its cause. Lock of g held. Returns
 * whether the family has other groups (then waits poll). */
static int family_sync(group *g) {
    pthread_mutex_lock(&g->fam->mu);
    int many = g->fam->groups > 1;
    if (g->fam->broken && !g->broken) {
        memcpy(g->why, g->fam->why, sizeof g->why);
        g->broken = 1;
        pthread_cond_broadcast(&g->cv);
    }
    pthread_mutex_unlock(&g->fam->mu);
    return many;
}

static struct timespec deadline_after(double s) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    long long ns = t.tv_nsec + (long long)((s - (long long)s) * 1e9);
    t.tv_sec += (time_t)s + ns / 1000000000LL;
    t.tv_nsec = ns % 1000000000LL;
    return t;
}

static const char *req_what(const treq *r, char *buf, size_t n) {
    return fl_comm_what(buf, n, r->base.kind, r->base.count, r->base.dtype, r->base.op, 0);
}

/* The work of phase A (ph 0) or B (ph 1) for rank me. Runs without the lock; the slot cannot be
 * reused before every rank has released it. */
static void do_phase(slot *s, int n, int me, int ph) {
    size_t es = fl_dtype_size(s->dt), off, len;
    fl_comm_chunk(s->count, n, me, &off, &len);
    const void *src[256];
    const void **srcp = n <= 256 ? src : malloc((size_t)n * sizeof *srcp);
    switch (s->kind) {
    case FL_COLL_ALL_REDUCE:
        if (ph == 0) {
            for (int k = 0; k < n; k++) srcp[k] = (const char *)s->send[k] + off * es;
            fl_comm_reduce_kernel((char *)s->recv[me] + off * es, srcp, n, len, s->dt, s->op);
        } else {
            for (int k = 0; k < n; k++) {
                if (k == me) continue;
                size_t ko, kl;
                fl_comm_chunk(s->count, n, k, &ko, &kl);
                if (kl) memcpy((char *)s->recv[me] + ko * es, (const char *)s->recv[k] + ko * es, kl * es);
            }
        }
        break;
    case FL_COLL_REDUCE_SCATTER:
        if (ph == 0) {
            for (int k = 0; k < n; k++) srcp[k] = (const char *)s->send[k] + off * es;
            fl_comm_reduce_kernel(s->recv[me], srcp, n, len, s->dt, s->op);
        }
        break;
    case FL_COLL_ALL_GATHER:
        if (ph == 0)
            for (int k = 0; k < n; k++) {
                size_t ko, kl;
                fl_comm_chunk(s->count, n, k, &ko, &kl);
                char *dst = (char *)s->recv[me] + ko * es;
                if (kl && dst != (const char *)s->send[k]) memcpy(dst, s->send[k], kl * es);
            }
        break;
    case FL_COLL_BROADCAST:
        if (ph == 0 && me != s->root && s->count) memcpy(s->recv[me], s->send[s->root], s->count * es);
        break;
    default: break;
    }
    if (srcp != src) free((void *)srcp);
}

/* Advance r as far as it goes without waiting. Called and returns with the lock held. */
static void progress_one(fl_comm *c, treq *r) {
    tcomm *t = c->impl;
    group *g = t->g;
    slot *s = &g->slots[r->seq % SLOTS];
    for (;;) {
        if (g->broken) return;
        if (r->stage == 0 && s->posted == g->n) {
            pthread_mutex_unlock(&g->mu);
            do_phase(s, g->n, c->rank, 0);
            pthread_mutex_lock(&g->mu);
            s->doneA++;
            r->stage = 1;
            pthread_cond_broadcast(&g->cv);
        } else if (r->stage == 1 && s->doneA == g->n) {
            pthread_mutex_unlock(&g->mu);
            do_phase(s, g->n, c->rank, 1);
            pthread_mutex_lock(&g->mu);
            s->doneB++;
            r->stage = 2;
            pthread_cond_broadcast(&g->cv);
        } else if (r->stage == 2 && s->doneB == g->n) {
            if (++s->released == g->n) s->busy = 0;
            r->stage = 3;
            pthread_cond_broadcast(&g->cv);
            return;
        } else {
            return;
        }
    }
}

static void progress_all(fl_comm *c) {
    tcomm *t = c->impl;
    for (treq *r = t->head; r; r = r->next)
        if (r->stage < 3) progress_one(c, r);
}

static void unlink_req(tcomm *t, treq *r) {
    for (treq **p = &t->head; *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            return;
        }
}

/* The ranks that have not reached what r waits for (for the timeout message). */
static void missing_ranks(group *g, const treq *r, char *buf, size_t n) {
    const slot *s = &g->slots[r->seq % SLOTS];
    int have = r->stage == 0 ? s->posted : r->stage == 1 ? s->doneA : s->doneB;
    snprintf(buf, n, "%d of %d ranks %s", g->n - have, g->n,
             r->stage == 0 ? "did not call it" : "did not finish their part");
}

/* Block (progressing everything) until cond(c) holds. Lock held. Breaks the group on timeout. */
static fl_status wait_until(fl_comm *c, int (*cond)(fl_comm *, void *), void *arg, const char *what, treq *r) {
    tcomm *t = c->impl;
    group *g = t->g;
    struct timespec dl = deadline_after(g->timeout_s);
    for (;;) {
        int many = family_sync(g);
        progress_all(c);
        if (g->broken) return fl_comm_fail(c, FL_ERR_IO, what, "%s", g->why);
        if (cond(c, arg)) return FL_OK;
        if (many) { /* wake up every FAMILY_POLL_MS to look at the other groups */
            struct timespec now, poll = deadline_after(FAMILY_POLL_MS / 1000.0);
            clock_gettime(CLOCK_MONOTONIC, &now);
            int before_dl = poll.tv_sec < dl.tv_sec || (poll.tv_sec == dl.tv_sec && poll.tv_nsec < dl.tv_nsec);
            if (before_dl) {
                pthread_cond_timedwait(&g->cv, &g->mu, &poll);
                continue;
            }
        }
        if (pthread_cond_timedwait(&g->cv, &g->mu, &dl) != 0) {
            progress_all(c);
            if (cond(c, arg)) return FL_OK;
            char miss[128] = "the other ranks did not join";
            if (r) missing_ranks(g, r, miss, sizeof miss);
            break_group(g, "rank %d gave up on %s (collective #%llu) after %.4g s: %s", c->rank, what,
                        (unsigned long long)(r ? r->seq : t->next_seq), g->timeout_s, miss);
            return fl_comm_fail(c, FL_ERR_IO, what, "%s", g->why);
        }
    }
}

static int cond_req_done(fl_comm *c, void *arg) { (void)c; return ((treq *)arg)->stage == 3; }
static int cond_slot_free(fl_comm *c, void *arg) {
    tcomm *t = c->impl;
    const slot *s = &t->g->slots[*(uint64_t *)arg % SLOTS];
    return !s->busy || s->seq == *(uint64_t *)arg;
}

static fl_status post(fl_comm *c, fl_coll_kind kind, const void *send, void *recv, size_t count, fl_dtype dt,
                      fl_comm_op op, int root, fl_comm_req **out) {
    tcomm *t = c->impl;
    group *g = t->g;
    char what[128];
    fl_comm_what(what, sizeof what, kind, count, dt, op, root);
    treq *r = calloc(1, sizeof *r);
    if (!r) return fl_comm_fail(c, FL_ERR_OOM, what, "cannot allocate a request");
    r->base = (fl_comm_req){c, kind, count, dt, op};
    pthread_mutex_lock(&g->mu);
    r->seq = t->next_seq++;
    /* the slot's previous occupant (SLOTS collectives earlier) must be released by every rank */
    fl_status st = wait_until(c, cond_slot_free, &r->seq, what, NULL);
    if (st != FL_OK) goto fail;
    slot *s = &g->slots[r->seq % SLOTS];
    if (!s->busy) {
        s->busy = 1;
        s->seq = r->seq;
        s->posted = s->doneA = s->doneB = s->released = 0;
        s->kind = kind;
        s->count = count;
        s->dt = dt;
        s->op = op;
        s->root = root;
        s->first_rank = c->rank;
    } else if (s->kind != kind || s->count != count || s->dt != dt ||
               ((kind == FL_COLL_ALL_REDUCE || kind == FL_COLL_REDUCE_SCATTER) && s->op != op) ||
               (kind == FL_COLL_BROADCAST && s->root != root)) {
        char theirs[128];
        fl_comm_what(theirs, sizeof theirs, s->kind, s->count, s->dt, s->op, s->root);
        break_group(g, "mismatched collective #%llu: rank %d called %s where rank %d called %s",
                    (unsigned long long)r->seq, c->rank, what, s->first_rank, theirs);
        st = fl_comm_fail(c, FL_ERR_INVALID, what, "%s", g->why);
        goto fail;
    }
    s->send[c->rank] = kind == FL_COLL_BROADCAST ? recv : send;
    s->recv[c->rank] = recv;
    s->posted++;
    r->next = NULL;
    treq **p = &t->head;
    while (*p) p = &(*p)->next;
    *p = r;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    *out = &r->base;
    return FL_OK;
fail:
    pthread_mutex_unlock(&g->mu);
    free(r);
    return st;
}

static fl_status t_all_reduce(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt, fl_comm_op op,
                              fl_comm_req **req) {
    return post(c, FL_COLL_ALL_REDUCE, send, recv, count, dt, op, 0, req);
}
static fl_status t_reduce_scatter(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt,
                                  fl_comm_op op, fl_comm_req **req) {
    return post(c, FL_COLL_REDUCE_SCATTER, send, recv, count, dt, op, 0, req);
}
static fl_status t_all_gather(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt,
                              fl_comm_req **req) {
    return post(c, FL_COLL_ALL_GATHER, send, recv, count, dt, FL_COMM_SUM, 0, req);
}
static fl_status t_broadcast(fl_comm *c, void *buf, size_t count, fl_dtype dt, int root, fl_comm_req **req) {
    return post(c, FL_COLL_BROADCAST, NULL, buf, count, dt, FL_COMM_SUM, root, req);
}

static fl_status t_wait(fl_comm *c, fl_comm_req *base) {
    tcomm *t = c->impl;
    treq *r = (treq *)base;
    char what[128];
    req_what(r, what, sizeof what);
    pthread_mutex_lock(&t->g->mu);
    fl_status st = wait_until(c, cond_req_done, r, what, r);
    unlink_req(t, r);
    pthread_mutex_unlock(&t->g->mu);
    free(r);
    return st;
}

static fl_status t_test(fl_comm *c, fl_comm_req *base, int *done) {
    tcomm *t = c->impl;
    treq *r = (treq *)base;
    fl_status st = FL_OK;
    pthread_mutex_lock(&t->g->mu);
    family_sync(t->g);
    progress_all(c);
    *done = r->stage == 3;
    if (t->g->broken) {
        char what[128];
        st = fl_comm_fail(c, FL_ERR_IO, req_what(r, what, sizeof what), "%s", t->g->why);
        *done = 1;
    }
    if (*done) unlink_req(t, r);
    pthread_mutex_unlock(&t->g->mu);
    if (*done) free(r);
    return st;
}

static fl_status t_barrier(fl_comm *c) {
    fl_comm_req *r;
    FL_TRY(post(c, FL_COLL_BARRIER, NULL, NULL, 0, FL_F32, FL_COMM_SUM, 0, &r));
    return t_wait(c, r);
}

static void t_abort(fl_comm *c, int code, const char *msg) {
    tcomm *t = c->impl;
    pthread_mutex_lock(&t->g->mu);
    break_group(t->g, "rank %d aborted (code %d): %s", c->rank, code, msg);
    pthread_mutex_unlock(&t->g->mu);
}

static int t_release(fl_comm *c, const char *msg) {
    t_abort(c, 1, msg);
    return 1;
}

/* A group's memory (unlinked from its family already). */
static void group_release(group *g) {
    while (g->mail) { /* sent, never received (a rank failed) */
        msg *x = g->mail;
        g->mail = x->next;
        free(x);
    }
    for (int i = 0; i < SLOTS; i++) {
        free(g->slots[i].send);
        free(g->slots[i].recv);
    }
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    free(g);
}

/* Takes g out of its family's list. Lock of the family held. */
static void family_unlink(family *f, group *g) {
    for (group **p = &f->all; *p; p = &(*p)->fam_next)
        if (*p == g) {
            *p = g->fam_next;
            f->groups--;
            return;
        }
}

/* The family's end, once no handle is left: the groups still listed are orphans (a split whose
 * all-gather failed on some ranks and not on others: the ranks that never learnt the group's
 * address cannot give back their references), freed with it. */
static void family_free(family *f) {
    while (f->all) {
        group *g = f->all;
        f->all = g->fam_next;
        group_release(g);
    }
    pthread_mutex_destroy(&f->mu);
    free(f);
}

/* Frees g, which no handle holds. */
static void group_free(group *g) {
    family *f = g->fam;
    pthread_mutex_lock(&f->mu);
    family_unlink(f, g);
    int done = f->groups == 0 && f->handles == 0;
    pthread_mutex_unlock(&f->mu);
    group_release(g);
    if (done) family_free(f);
}

/* A group of n with no handles yet (refs = n: each member's handle holds one), in family fam
 * (NULL: a new family). */
static group *group_new(int n, double timeout_s, family *fam) {
    group *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    if (!fam) {
        fam = calloc(1, sizeof *fam);
        if (!fam) {
            free(g);
            return NULL;
        }
        pthread_mutex_init(&fam->mu, NULL);
    }
    g->fam = fam;
    pthread_mutex_lock(&fam->mu);
    fam->groups++;
    g->fam_next = fam->all;
    fam->all = g;
    pthread_mutex_unlock(&fam->mu);
    g->n = n;
    g->refs = n;
    /* 0: FITLLM_COMM_TIMEOUT's (default 600 s; "never": a deadline no run reaches) */
    const double env_s = fl_comm_timeout();
    g->timeout_s = timeout_s > 0 ? timeout_s : env_s > 0 ? env_s : 1e9;
    pthread_mutex_init(&g->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&g->cv, &ca);
    pthread_condattr_destroy(&ca);
    int ok = 1;
    for (int i = 0; i < SLOTS; i++) {
        g->slots[i].send = calloc((size_t)n, sizeof(void *));
        g->slots[i].recv = calloc((size_t)n, sizeof(void *));
        ok = ok && g->slots[i].send && g->slots[i].recv;
    }
    if (!ok) {
        group_free(g);
        return NULL;
    }
    return g;
}

static void t_destroy(fl_comm *c);
static fl_status t_split(fl_comm *c, int color, int key, fl_comm **out);

static void t_destroy(fl_comm *c) {
    tcomm *t = c->impl;
    group *g = t->g;
    pthread_mutex_lock(&g->mu);
    /* requests never waited for are released here (their collectives may be incomplete) */
    while (t->head) {
        treq *r = t->head;
        t->head = r->next;
        free(r);
    }
    family *f = g->fam; /* read before the reference goes: another rank's t_destroy may free g then */
    int last = --g->refs == 0;
    pthread_mutex_unlock(&g->mu);
    pthread_mutex_lock(&f->mu);
    if (last) family_unlink(f, g);
    int done = --f->handles == 0; /* nobody can attach to or give back a group of the family any more */
    pthread_mutex_unlock(&f->mu);
    if (last) group_release(g);
    if (done) family_free(f);
    free(t);
    free(c);
}

/* ---- point to point: a mailbox per group (the sender's copy waits there for its receiver) ---- */

static fl_status t_send(fl_comm *c, const void *buf, size_t bytes, int peer, int tag) {
    group *g = ((tcomm *)c->impl)->g;
    msg *x = malloc(sizeof *x + bytes);
    if (!x) return fl_errorf(FL_ERR_OOM, "comm threads: rank %d of %d: send(%zu bytes to rank %d, tag %d): out of host "
                             "memory", c->rank, c->size, bytes, peer, tag);
    *x = (msg){c->rank, peer, tag, bytes, NULL};
    if (bytes) memcpy(x->data, buf, bytes);
    pthread_mutex_lock(&g->mu);
    family_sync(g);
    if (g->broken) {
        pthread_mutex_unlock(&g->mu);
        free(x);
        return fl_errorf(FL_ERR_IO, "comm threads: rank %d of %d: send(%zu bytes to rank %d, tag %d): %s", c->rank,
                         c->size, bytes, peer, tag, g->why);
    }
    msg **p = &g->mail;
    while (*p) p = &(*p)->next;
    *p = x;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    return FL_OK;
}

typedef struct {
    int src, tag;
    msg **at; /* set by cond_mail: the link to the oldest match */
} mail_key;

static int cond_mail(fl_comm *c, void *arg) {
    mail_key *k = arg;
    for (msg **p = &((tcomm *)c->impl)->g->mail; *p; p = &(*p)->next)
        if ((*p)->dst == c->rank && (*p)->src == k->src && (*p)->tag == k->tag) {
            k->at = p;
            return 1;
        }
    return 0;
}

static fl_status t_recv(fl_comm *c, void *buf, size_t bytes, int peer, int tag) {
    group *g = ((tcomm *)c->impl)->g;
    char what[128];
    snprintf(what, sizeof what, "recv(%zu bytes from rank %d, tag %d)", bytes, peer, tag);
    mail_key k = {peer, tag, NULL};
    pthread_mutex_lock(&g->mu);
    fl_status st = wait_until(c, cond_mail, &k, what, NULL);
    msg *x = NULL;
    if (st == FL_OK) {
        x = *k.at;
        *k.at = x->next;
        if (x->bytes != bytes) {
            break_group(g, "rank %d sent %zu bytes (tag %d) where rank %d receives %zu", peer, x->bytes, tag, c->rank,
                        bytes);
            st = fl_comm_fail(c, FL_ERR_INVALID, what, "%s", g->why);
        }
    }
    pthread_mutex_unlock(&g->mu);
    if (st == FL_OK && bytes) memcpy(buf, x->data, bytes);
    free(x);
    return st;
}

static const fl_comm_vtable k_threads = {
    .name = "threads",
    .iall_reduce = t_all_reduce,
    .ireduce_scatter = t_reduce_scatter,
    .iall_gather = t_all_gather,
    .ibroadcast = t_broadcast,
    .barrier = t_barrier,
    .test = t_test,
    .wait = t_wait,
    .abort = t_abort,
    .release_peers = t_release,
    .destroy = t_destroy,
    .split = t_split,
    .send = t_send,
    .recv = t_recv,
};

/* Whether the rank can move one of its requests on now (the other ranks have reached its stage). Lock held. */
static int can_progress(fl_comm *c) {
    tcomm *t = c->impl;
    group *g = t->g;
    for (const treq *r = t->head; r; r = r->next) {
        const slot *s = &g->slots[r->seq % SLOTS];
        if ((r->stage == 0 && s->posted == g->n) || (r->stage == 1 && s->doneA == g->n) ||
            (r->stage == 2 && s->doneB == g->n))
            return 1;
    }
    return 0;
}

fl_status fl_comm_threads_idle_wait(fl_comm_req *req, double max_s) {
    if (!req || req->comm->vt != &k_threads) return FL_OK;
    fl_comm *c = req->comm;
    const treq *r = (const treq *)req;
    group *g = ((tcomm *)c->impl)->g;
    struct timespec dl = deadline_after(max_s > 0 ? max_s : 0);
    pthread_mutex_lock(&g->mu);
    for (;;) {
        int many = family_sync(g);
        if (g->broken || r->stage == 3 || can_progress(c)) break;
        struct timespec until = dl;
        int last = 1;
        if (many) { /* another group of the family may break: look every FAMILY_POLL_MS */
            struct timespec poll = deadline_after(FAMILY_POLL_MS / 1000.0);
            if (poll.tv_sec < dl.tv_sec || (poll.tv_sec == dl.tv_sec && poll.tv_nsec < dl.tv_nsec)) {
                until = poll;
                last = 0;
            }
        }
        if (pthread_cond_timedwait(&g->cv, &g->mu, &until) != 0 && last) break;
    }
    pthread_mutex_unlock(&g->mu);
    return FL_OK;
}

/* One rank's handle on g as rank r (its reference was counted in group_new). */
static fl_status attach(group *g, int r, fl_comm **out) {
    tcomm *t = calloc(1, sizeof *t);
    if (!t || fl_comm_alloc_handle(&k_threads, r, g->n, out) != FL_OK) {
        free(t);
        *out = NULL;
        return fl_errorf(FL_ERR_OOM, "comm threads: cannot allocate a handle");
    }
    t->g = g;
    (*out)->impl = t;
    pthread_mutex_lock(&g->fam->mu);
    g->fam->handles++;
    pthread_mutex_unlock(&g->fam->mu);
    return FL_OK;
}

/* Give back a reference of g without a handle (a member that could not attach). */
static void drop_ref(group *g) {
    pthread_mutex_lock(&g->mu);
    int last = --g->refs == 0;
    pthread_mutex_unlock(&g->mu);
    if (last) group_free(g);
}

static fl_status t_split(fl_comm *c, int color, int key, fl_comm **out) {
    tcomm *t = c->impl;
    int nr = 0, nn = 0, *mem = NULL;
    FL_TRY(fl_comm_split_members(c, color, key, &nr, &nn, &mem));
    int leader = mem[0];
    free(mem);
    group *mine = nr == 0 ? group_new(nn, t->g->timeout_s, t->g->fam) : NULL;
    /* the leaders' group addresses to every rank, as bits (uint64 in two F32 words) */
    uint64_t *all = malloc(((size_t)c->size + 1) * sizeof *all);
    if (!all) {
        if (mine) group_free(mine);
        return fl_comm_fail(c, FL_ERR_OOM, "split", "out of host memory");
    }
    all[c->size] = (uint64_t)(uintptr_t)mine;
    fl_status s = fl_comm_all_gather(c, &all[c->size], all, (size_t)c->size * 2, FL_F32);
    group *g = s == FL_OK ? (group *)(uintptr_t)all[leader] : NULL;
    free(all);
    if (s != FL_OK) {
        /* Some ranks may have completed the all-gather before the failure and attached to the leader's
         * group: it is broken (their calls fail at once) and only the leader's reference is given back;
         * the references of ranks that never learnt its address go with the family (family_free). */
        if (mine) {
            pthread_mutex_lock(&mine->mu);
            break_group(mine, "rank %d: the split of color %d failed", c->rank, color);
            pthread_mutex_unlock(&mine->mu);
            drop_ref(mine);
        }
        return s;
    }
    if (!g) return fl_comm_fail(c, FL_ERR_OOM, "split", "rank %d could not allocate the group of color %d", leader, color);
    s = attach(g, nr, out);
    if (s != FL_OK) {
        drop_ref(g); /* the others' calls in the new group then time out: the group is short of a rank */
        return s;
    }
    return FL_OK;
}

fl_status fl_comm_threads_create(int n, double timeout_s, fl_comm **comms) {
    if (n < 1 || n > 4096) return fl_errorf(FL_ERR_INVALID, "comm threads: group size %d outside [1, 4096]", n);
    group *g = group_new(n, timeout_s, NULL);
    if (!g) return fl_errorf(FL_ERR_OOM, "comm threads: cannot allocate a group of %d", n);
    int ok = 1;
    for (int r = 0; r < n; r++) comms[r] = NULL;
    for (int r = 0; ok && r < n; r++) ok = attach(g, r, &comms[r]) == FL_OK;
    if (!ok) {
        /* the references without a handle first: the last handle's t_destroy ends the family */
        for (int r = 0; r < n; r++)
            if (!comms[r]) drop_ref(g); /* the last one frees the group when nothing attached */
        for (int r = 0; r < n; r++) {
            if (comms[r]) t_destroy(comms[r]); /* gives back its reference */
            comms[r] = NULL;
        }
        return fl_errorf(FL_ERR_OOM, "comm threads: cannot allocate a group of %d", n);
    }
    return FL_OK;
}

/* ---- fl_comm_threads_run ------------------------------------------------------------------- */

typedef struct {
    fl_comm *c;
    int rank;
    fl_comm_rank_fn fn;
    void *ctx;
    fl_status st;
    char msg[2048];
} run_arg;

static void *run_thread(void *p) {
    run_arg *a = p;
    fl_error_clear();
    a->st = a->fn(a->c, a->rank, a->ctx);
    if (a->st != FL_OK) {
        snprintf(a->msg, sizeof a->msg, "%s", fl_error_message());
        /* the others are told at once instead of waiting for the timeout */
        tcomm *t = a->c->impl;
        pthread_mutex_lock(&t->g->mu);
        break_group(t->g, "rank %d failed: %s", a->rank, a->msg);
        pthread_mutex_unlock(&t->g->mu);
    }
    return NULL;
}

fl_status fl_comm_threads_run(int n, fl_comm_rank_fn fn, void *ctx) {
    fl_comm **comms = calloc((size_t)(n > 0 ? n : 1), sizeof *comms);
    run_arg *args = calloc((size_t)(n > 0 ? n : 1), sizeof *args);
    pthread_t *th = calloc((size_t)(n > 0 ? n : 1), sizeof *th);
    fl_status st = (!comms || !args || !th) ? fl_errorf(FL_ERR_OOM, "comm threads: out of memory") : FL_OK;
    if (st == FL_OK) st = fl_comm_threads_create(n, 0, comms);
    if (st == FL_OK) {
        int started = 0;
        for (int r = 0; r < n; r++) {
            args[r] = (run_arg){.c = comms[r], .rank = r, .fn = fn, .ctx = ctx, .st = FL_OK};
            if (pthread_create(&th[r], NULL, run_thread, &args[r]) != 0) {
                args[r].st = fl_errorf(FL_ERR_INTERNAL, "comm threads: cannot start thread %d", r);
                snprintf(args[r].msg, sizeof args[r].msg, "%s", fl_error_message());
                t_abort(comms[r], 1, "its thread could not be started");
                break;
            }
            started++;
        }
        for (int r = 0; r < started; r++) pthread_join(th[r], NULL);
        for (int r = 0; r < n; r++) fl_comm_destroy(comms[r]);
        for (int r = 0; r < n && st == FL_OK; r++)
            if (args[r].st != FL_OK) st = fl_errorf(args[r].st, "%s", args[r].msg);
    }
    free(comms);
    free(args);
    free(th);
    return st;
}

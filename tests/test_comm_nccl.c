/* The NCCL implementation of fl_comm (src/comm/comm_nccl.c) over the CPU stand-in of the NCCL
 * calls (src/comm/nccl_standin.c), ranks as threads:
 *   - every fl_comm case of tests/comm_ref.h (each kind, dtype, op; in place; counts 0, below
 *     the rank count, not divisible by it: the grouped ncclReduce / ncclBroadcast path, and
 *     divisible: ncclReduceScatter / ncclAllGather) against the written-out specification, bit
 *     for bit, and against the threads implementation run on the same inputs;
 *   - the stand-in itself against nccl.h's documented semantics (per-rank counts, rank-major
 *     blocks, the in-place rules, ncclAvg, ncclReduce's NULL recv off the root, groups,
 *     streams and events, refused types, ops and overlaps, a rank joining twice);
 *   - asynchronous requests completed in any order; abort; the bootstrap's failures.
 * The real table (fl_nccl_cuda_api) is the same code over libnccl: tests/cuda/nccl_check.sh. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm_ref.h"
#include "fitllm/comm.h"
#include "fitllm/comm_nccl.h"
#include "fitllm/cuda.h"
#include "test.h"

/* ---- every fl_comm case through the NCCL communicator ----------------------------------------- */

typedef struct {
    int ncases;
    const cr_case *cases;
    void ***in, ***out; /* [case][rank] */
    int use_nccl;       /* 0: the threads communicator itself (the twin) */
} all_ctx;

static fl_status all_rank(fl_comm *host, int rank, void *p) {
    all_ctx *x = p;
    fl_comm *c = host;
    if (x->use_nccl) FL_TRY(fl_comm_nccl_create(host, fl_nccl_standin_api(), NULL, &c));
    fl_status s = FL_OK;
    for (int k = 0; k < x->ncases && s == FL_OK; k++) s = cr_run(c, &x->cases[k], x->in[k][rank], x->out[k][rank]);
    if (c != host) fl_comm_destroy(c);
    return s;
}

/* Returns the number of wrong results; *twin_diff counts outputs that differ from the threads
 * implementation's. */
static int run_cases_nccl(int n, int *ncases, int *twin_diff) {
    int m = cr_cases(n, NULL), fails = 0;
    cr_case *cases = malloc((size_t)m * sizeof *cases);
    cr_cases(n, cases);
    all_ctx x = {m, cases, calloc((size_t)m, sizeof(void **)), calloc((size_t)m, sizeof(void **)), 1};
    void ***twin = calloc((size_t)m, sizeof(void **));
    for (int k = 0; k < m; k++) {
        size_t es = fl_dtype_size(cases[k].dt);
        x.in[k] = calloc((size_t)n, sizeof(void *));
        x.out[k] = calloc((size_t)n, sizeof(void *));
        twin[k] = calloc((size_t)n, sizeof(void *));
        for (int r = 0; r < n; r++) {
            x.in[k][r] = malloc(cases[k].count * es + 1);
            x.out[k][r] = malloc(cases[k].count * es + 1);
            twin[k][r] = malloc(cases[k].count * es + 1);
            cr_input(&cases[k], r, x.in[k][r]);
        }
    }
    fl_status s = fl_comm_threads_run(n, all_rank, &x);
    if (s != FL_OK) {
        fprintf(stderr, "  %d ranks: %s\n", n, fl_error_message());
        fails++;
    }
    all_ctx y = x;
    y.out = twin;
    y.use_nccl = 0;
    if (s == FL_OK && fl_comm_threads_run(n, all_rank, &y) != FL_OK) fails++;
    *twin_diff = 0;
    for (int k = 0; k < m && s == FL_OK; k++) {
        char label[256];
        cr_label(&cases[k], n, label, sizeof label);
        for (int r = 0; r < n; r++) {
            fails += cr_check(label, &cases[k], n, r, (const void *const *)x.in[k], x.out[k][r], NULL) != 0;
            size_t bytes = cr_out_count(&cases[k], n, r) * fl_dtype_size(cases[k].dt);
            *twin_diff += bytes && memcmp(x.out[k][r], twin[k][r], bytes) != 0;
        }
    }
    for (int k = 0; k < m; k++) {
        for (int r = 0; r < n; r++) {
            free(x.in[k][r]);
            free(x.out[k][r]);
            free(twin[k][r]);
        }
        free(x.in[k]);
        free(x.out[k]);
        free(twin[k]);
    }
    free(x.in);
    free(x.out);
    free(twin);
    free(cases);
    *ncases = m;
    return fails;
}

FL_TEST(comm_nccl_standin_collectives) {
    int sizes[] = {1, 2, 3, 4, 7}, total = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        int m, twin, f = run_cases_nccl(sizes[i], &m, &twin);
        total += m;
        FL_CHECKF(f == 0, "%d wrong rank results in %d cases at %d ranks", f, m, sizes[i]);
        FL_CHECKF(twin == 0, "%d results differ from the threads implementation's at %d ranks", twin, sizes[i]);
    }
    FL_CHECK(total > 400);
}

/* ---- the stand-in against nccl.h ------------------------------------------------------------ */

#define SN 3

typedef struct {
    fl_nccl_id id;
    int bad[SN];
    char why[SN][256];
} api_ctx;

#define EXPECT(rank, cond, ...)                                                                                      \
    do {                                                                                                             \
        if (!(cond) && !x->bad[rank]) {                                                                              \
            x->bad[rank] = __LINE__;                                                                                 \
            snprintf(x->why[rank], sizeof x->why[rank], __VA_ARGS__);                                                \
        }                                                                                                            \
    } while (0)

static float val(int rank, int i) { return (float)(rank + 1) * 0.5f + (float)i * 0.25f; } /* exact sums */

static fl_status api_rank(fl_comm *host, int rank, void *p) {
    api_ctx *x = p;
    const fl_nccl_api *a = fl_nccl_standin_api();
    (void)host;
    void *nc = NULL;
    int rc = a->comm_init_rank(&nc, SN, x->id, rank);
    EXPECT(rank, rc == FL_NCCL_SUCCESS && nc, "ncclCommInitRank: %d", rc);
    if (!nc) return FL_OK;
    /* reduce-scatter: recvcount is per rank, send holds SN blocks rank-major */
    float send[SN * 4], recv[4];
    for (int i = 0; i < SN * 4; i++) send[i] = val(rank, i);
    rc = a->reduce_scatter(send, recv, 4, FL_NCCL_FLOAT32, FL_NCCL_SUM, nc, NULL);
    for (int j = 0; j < 4; j++) {
        float want = 0;
        for (int r = 0; r < SN; r++) want += val(r, rank * 4 + j);
        EXPECT(rank, rc == 0 && recv[j] == want, "reduce_scatter[%d] = %g, want %g (rc %d)", j, recv[j], want, rc);
    }
    /* in place: recv = send + rank * recvcount */
    for (int i = 0; i < SN * 4; i++) send[i] = val(rank, i);
    rc = a->reduce_scatter(send, send + rank * 4, 4, FL_NCCL_FLOAT32, FL_NCCL_MAX, nc, NULL);
    for (int j = 0; j < 4; j++)
        EXPECT(rank, rc == 0 && send[rank * 4 + j] == val(SN - 1, rank * 4 + j), "in-place reduce_scatter max");
    /* another overlap is not in place: refused */
    rc = a->reduce_scatter(send, send + 1, 4, FL_NCCL_FLOAT32, FL_NCCL_SUM, nc, NULL);
    EXPECT(rank, rc == FL_NCCL_INVALID_ARGUMENT, "overlapping reduce_scatter: rc %d", rc);
    /* all-gather: sendcount per rank, rank r's block at r * sendcount; in place */
    float g[SN * 5], mine[5];
    for (int j = 0; j < 5; j++) mine[j] = val(rank, 100 + j);
    rc = a->all_gather(mine, g, 5, FL_NCCL_FLOAT32, nc, NULL);
    for (int r = 0; r < SN; r++)
        for (int j = 0; j < 5; j++) EXPECT(rank, rc == 0 && g[r * 5 + j] == val(r, 100 + j), "all_gather [%d][%d]", r, j);
    memset(g, 0, sizeof g);
    memcpy(g + rank * 5, mine, sizeof mine);
    rc = a->all_gather(g + rank * 5, g, 5, FL_NCCL_FLOAT32, nc, NULL);
    for (int r = 0; r < SN; r++) EXPECT(rank, rc == 0 && g[r * 5 + 4] == val(r, 104), "in-place all_gather");
    /* ncclAvg: the mean (here exact: sums of quarters divided by 3 round the same either way) */
    float v[2] = {val(rank, 0), 3.0f * (float)rank}, av[2];
    rc = a->all_reduce(v, av, 2, FL_NCCL_FLOAT32, FL_NCCL_AVG, nc, NULL);
    EXPECT(rank, rc == 0 && av[1] == 3.0f && av[0] == (val(0, 0) + val(1, 0) + val(2, 0)) / 3.0f, "avg %g %g", av[0], av[1]);
    /* BF16 all-reduce in place */
    uint16_t hb[2] = {fl_f32_to_bf16(1.0f), fl_f32_to_bf16((float)rank)};
    rc = a->all_reduce(hb, hb, 2, FL_NCCL_BFLOAT16, FL_NCCL_SUM, nc, NULL);
    EXPECT(rank, rc == 0 && fl_bf16_to_f32(hb[0]) == 3.0f && fl_bf16_to_f32(hb[1]) == 3.0f, "bf16 sum");
    /* F16 (ncclFloat16) likewise */
    uint16_t hh[2] = {fl_f32_to_f16(1.0f), fl_f32_to_f16((float)rank)};
    rc = a->all_reduce(hh, hh, 2, FL_NCCL_FLOAT16, FL_NCCL_SUM, nc, NULL);
    EXPECT(rank, rc == 0 && fl_f16_to_f32(hh[0]) == 3.0f && fl_f16_to_f32(hh[1]) == 3.0f, "f16 sum");
    /* broadcast: send significant on the root only, recv filled everywhere */
    float src[3] = {7, 8, 9}, dst[3] = {0, 0, 0};
    rc = a->broadcast(rank == 1 ? src : NULL, dst, 3, FL_NCCL_FLOAT32, 1, nc, NULL);
    EXPECT(rank, rc == 0 && dst[0] == 7 && dst[2] == 9, "broadcast from root 1");
    /* reduce: recv NULL except on the root */
    float rv[2] = {-1, -1}, rs[2] = {1, (float)rank};
    rc = a->reduce(rs, rank == 2 ? rv : NULL, 2, FL_NCCL_FLOAT32, FL_NCCL_SUM, 2, nc, NULL);
    EXPECT(rank, rc == 0 && (rank != 2 || (rv[0] == 3 && rv[1] == 3)), "reduce to root 2: %g %g", rv[0], rv[1]);
    /* a group of reduces to each root, as comm_nccl.c does for uneven chunks */
    float gs[SN], gr = -1;
    for (int r = 0; r < SN; r++) gs[r] = (float)(r * 10 + rank);
    EXPECT(rank, a->group_start() == 0, "group_start");
    for (int r = 0; r < SN; r++) a->reduce(gs + r, r == rank ? &gr : NULL, 1, FL_NCCL_FLOAT32, FL_NCCL_SUM, r, nc, NULL);
    EXPECT(rank, a->group_end() == 0, "group_end");
    EXPECT(rank, gr == (float)(SN * rank * 10 + 0 + 1 + 2), "grouped reduce: %g", gr);
    EXPECT(rank, a->group_end() == FL_NCCL_INVALID_USAGE, "unmatched group_end");
    /* refused types and ops */
    EXPECT(rank, a->all_reduce(v, av, 2, 8 /* ncclFloat64 */, FL_NCCL_SUM, nc, NULL) == FL_NCCL_INVALID_ARGUMENT, "f64");
    EXPECT(rank, a->all_reduce(v, av, 2, FL_NCCL_FLOAT32, 1 /* ncclProd */, nc, NULL) == FL_NCCL_INVALID_ARGUMENT, "prod");
    EXPECT(rank, strstr(a->get_last_error(nc), "op 1") != NULL, "last error '%s'", a->get_last_error(nc));
    /* streams: collectives complete when an event recorded after them does */
    void *st = NULL, *ev = NULL;
    EXPECT(rank, a->stream_create(&st) == 0 && a->event_create(&ev) == 0, "stream/event");
    float q1[4] = {1, 1, 1, 1}, q2[4] = {2, 2, 2, 2};
    rc = a->all_reduce(q1, q1, 4, FL_NCCL_FLOAT32, FL_NCCL_SUM, nc, st);
    rc |= a->all_reduce(q2, q2, 4, FL_NCCL_FLOAT32, FL_NCCL_SUM, nc, st);
    EXPECT(rank, rc == 0 && a->event_record(ev, st) == 0, "enqueue");
    int q;
    while ((q = a->event_query(ev)) == FL_NCCL_EVENT_PENDING) sched_yield();
    EXPECT(rank, q == 0 && q1[3] == 3 && q2[0] == 6 && a->event_synchronize(ev) == 0, "event: %d, %g %g", q, q1[3], q2[0]);
    int ae = -1;
    EXPECT(rank, a->comm_get_async_error(nc, &ae) == 0 && ae == 0, "async error %d", ae);
    a->event_destroy(ev);
    a->stream_destroy(st);
    EXPECT(rank, a->comm_destroy(nc) == 0, "destroy");
    return FL_OK;
}

FL_TEST(comm_nccl_standin_semantics) {
    api_ctx *x = calloc(1, sizeof *x);
    const fl_nccl_api *a = fl_nccl_standin_api();
    FL_REQUIRE(a->get_unique_id(&x->id) == FL_NCCL_SUCCESS);
    FL_REQUIRE_OK(fl_comm_threads_run(SN, api_rank, x));
    for (int r = 0; r < SN; r++) FL_CHECKF(!x->bad[r], "rank %d, line %d: %s", r, x->bad[r], x->why[r]);
    /* a rank joining twice (NCCL: two ranks on one GPU) */
    fl_nccl_id id;
    void *c0 = NULL, *c1 = NULL, *c2 = NULL;
    FL_REQUIRE(a->get_unique_id(&id) == 0);
    FL_CHECK(a->comm_init_rank(&c0, 2, id, 0) == 0 && c0);
    FL_CHECK(a->comm_init_rank(&c1, 2, id, 0) == FL_NCCL_INVALID_USAGE && !c1);
    FL_CHECK(a->comm_init_rank(&c2, 3, id, 1) == FL_NCCL_INVALID_ARGUMENT && !c2); /* another size */
    FL_CHECK(a->comm_init_rank(&c2, 2, id, 1) == 0 && c2);
    a->comm_destroy(c0);
    a->comm_destroy(c2);
    memset(&id, 0, sizeof id);
    FL_CHECK(a->comm_init_rank(&c0, 2, id, 0) == FL_NCCL_INVALID_ARGUMENT); /* not an id */
    free(x);
}

/* ---- asynchronous requests ------------------------------------------------------------------ */

#define AN 3
#define AK 70 /* more than the threads ring's 64 slots */
#define ALEN 37

typedef struct {
    float in[AN][AK][ALEN], out[AN][AK][ALEN];
} as_ctx;

static fl_status as_rank(fl_comm *host, int rank, void *p) {
    as_ctx *x = p;
    fl_comm *c;
    FL_TRY(fl_comm_nccl_create(host, fl_nccl_standin_api(), NULL, &c));
    fl_comm_req *req[AK];
    size_t off, len;
    fl_comm_chunk(ALEN, AN, rank, &off, &len);
    fl_status s = FL_OK;
    for (int k = 0; k < AK && s == FL_OK; k++) {
        switch (k % 4) {
        case 0: s = fl_comm_iall_reduce(c, x->in[rank][k], x->out[rank][k], ALEN, FL_F32, FL_COMM_SUM, &req[k]); break;
        case 1: s = fl_comm_ireduce_scatter(c, x->in[rank][k], x->out[rank][k], ALEN, FL_F32, FL_COMM_SUM, &req[k]); break;
        case 2: s = fl_comm_iall_gather(c, x->in[rank][k] + off, x->out[rank][k], ALEN, FL_F32, &req[k]); break;
        default:
            memcpy(x->out[rank][k], x->in[rank][k], sizeof x->out[rank][k]);
            s = fl_comm_ibroadcast(c, x->out[rank][k], ALEN, FL_F32, k % AN, &req[k]);
        }
    }
    if (s == FL_OK) {
        if (rank == 0) {
            for (int k = AK - 1; k >= 0 && s == FL_OK; k--) s = fl_comm_wait(&req[k]);
        } else if (rank == 1) {
            for (int left = AK; left && s == FL_OK;)
                for (int k = 0; k < AK && s == FL_OK; k++) {
                    if (!req[k]) continue;
                    int done;
                    s = fl_comm_test(&req[k], &done);
                    left -= done;
                }
        } else {
            s = fl_comm_wait_all(req, AK);
        }
    }
    fl_comm_destroy(c);
    return s;
}

FL_TEST(comm_nccl_standin_async) {
    as_ctx *x = calloc(1, sizeof *x);
    fl_test_rng g = {78};
    fl_test_fill(&g, &x->in[0][0][0], (size_t)AN * AK * ALEN, -1, 1);
    FL_REQUIRE_OK(fl_comm_threads_run(AN, as_rank, x));
    int bad = 0;
    for (int k = 0; k < AK; k++) {
        cr_case cs = {(fl_coll_kind)(k % 4), ALEN, FL_F32, FL_COMM_SUM, k % AN, 0};
        const void *in[AN];
        for (int r = 0; r < AN; r++) in[r] = x->in[r][k];
        for (int r = 0; r < AN; r++) {
            char label[64];
            snprintf(label, sizeof label, "request %d rank %d", k, r);
            bad += cr_check(label, &cs, AN, r, in, x->out[r][k], NULL) != 0;
        }
    }
    FL_CHECKF(bad == 0, "%d of %d results wrong", bad, AK * AN);
    free(x);
}

/* ---- failures ------------------------------------------------------------------------------- */

typedef struct {
    fl_status st[3];
    char msg[3][1024];
    int later_refused;
} ab_ctx;

static fl_status ab_rank(fl_comm *host, int rank, void *p) {
    ab_ctx *x = p;
    fl_comm *c;
    FL_TRY(fl_comm_nccl_create(host, fl_nccl_standin_api(), NULL, &c));
    float v[8] = {0};
    fl_status s = FL_OK;
    if (rank == 2) {
        usleep(50000); /* the others are waiting in the all-reduce */
        fl_comm_abort(c, 3, "test failure on this rank");
        s = fl_comm_all_reduce(c, v, v, 8, FL_F32, FL_COMM_SUM);
        x->later_refused = s != FL_OK && strstr(fl_error_message(), "aborted") != NULL;
        s = FL_OK;
    } else {
        s = fl_comm_all_reduce(c, v, v, 8, FL_F32, FL_COMM_SUM);
    }
    x->st[rank] = s;
    snprintf(x->msg[rank], sizeof x->msg[rank], "%s", s != FL_OK ? fl_error_message() : "");
    fl_comm_destroy(c);
    return FL_OK;
}

FL_TEST(comm_nccl_standin_abort) {
    ab_ctx x;
    memset(&x, 0, sizeof x);
    FL_REQUIRE_OK(fl_comm_threads_run(3, ab_rank, &x));
    for (int r = 0; r < 2; r++) {
        char want[80];
        snprintf(want, sizeof want, "comm nccl: rank %d of 3: all_reduce(count 8, F32, sum)", r);
        FL_CHECKF(x.st[r] == FL_ERR_IO && strstr(x.msg[r], want) && strstr(x.msg[r], "rank 2 aborted"),
                  "rank %d: '%s'", r, x.msg[r]);
    }
    FL_CHECK(x.later_refused);
}

/* The bootstrap: rank 0's failure to make the id reaches every rank; NCCL's refusal of two ranks
 * on one GPU is explained. */
static int fail_unique_id(fl_nccl_id *id) {
    (void)id;
    return FL_NCCL_SYSTEM_ERROR;
}
static int fail_init(void **comm, int n, fl_nccl_id id, int rank) {
    (void)n; (void)id; (void)rank;
    *comm = NULL;
    return FL_NCCL_INVALID_USAGE;
}
typedef struct {
    fl_nccl_api api;
    char msg[2][1024];
} bs_ctx;
static fl_status bs_rank(fl_comm *host, int rank, void *p) {
    bs_ctx *x = p;
    fl_comm *c = NULL;
    fl_status s = fl_comm_nccl_create(host, &x->api, NULL, &c);
    snprintf(x->msg[rank], sizeof x->msg[rank], "%s", s != FL_OK ? fl_error_message() : "created");
    fl_comm_destroy(c);
    return FL_OK;
}

FL_TEST(comm_nccl_bootstrap_failures) {
    bs_ctx x;
    x.api = *fl_nccl_standin_api();
    x.api.get_unique_id = fail_unique_id;
    FL_REQUIRE_OK(fl_comm_threads_run(2, bs_rank, &x));
    for (int r = 0; r < 2; r++)
        FL_CHECKF(strstr(x.msg[r], "ncclGetUniqueId failed on rank 0") && strstr(x.msg[r], "system error"),
                  "rank %d: '%s'", r, x.msg[r]);
    x.api = *fl_nccl_standin_api();
    x.api.comm_init_rank = fail_init;
    FL_REQUIRE_OK(fl_comm_threads_run(2, bs_rank, &x));
    for (int r = 0; r < 2; r++)
        FL_CHECKF(strstr(x.msg[r], "ncclCommInitRank failed: invalid usage") && strstr(x.msg[r], "two ranks on one GPU"),
                  "rank %d: '%s'", r, x.msg[r]);
    fl_comm *c = NULL;
    FL_CHECK(fl_comm_nccl_create(NULL, fl_nccl_standin_api(), NULL, &c) == FL_ERR_INVALID && !c);
    /* which NCCL this build has (none without FL_NCCL): the real table comes from the CUDA plugin,
     * loaded only where a GPU is usable */
    FL_CHECK(fl_comm_nccl_built() || fl_nccl_cuda_api() == NULL);
    FL_CHECK(!fl_nccl_cuda_api() || fl_cuda_device_count(NULL, 0) > 0);
    FL_CHECK(fl_comm_nccl_built() ? !strncmp(fl_comm_nccl_library(), "NCCL", 4) : !strcmp(fl_comm_nccl_library(), "none"));
}

/* fl_comm_split of an NCCL communicator (the stand-in): 4 ranks as 2 nodes x 2; the node group
 * sums over its two ranks (exact values), a new host split underneath, destroyed with it. */
typedef struct { int bad[4]; char msg[4][256]; } sp_ctx;
static fl_status sp_rank(fl_comm *host, int rank, void *p) {
    sp_ctx *x = p;
    fl_comm *c = NULL, *node = NULL;
    FL_TRY(fl_comm_nccl_create(host, fl_nccl_standin_api(), NULL, &c));
    fl_status s = fl_comm_split(c, rank / 2, rank, &node);
    float v[5];
    for (int i = 0; i < 5; i++) v[i] = val(rank, i);
    if (s == FL_OK) s = fl_comm_all_reduce(node, v, v, 5, FL_F32, FL_COMM_SUM);
    if (s == FL_OK) {
        x->bad[rank] = fl_comm_size(node) != 2 || fl_comm_rank(node) != rank % 2 || strcmp(fl_comm_impl_name(node), "nccl");
        int n0 = rank / 2 * 2;
        for (int i = 0; i < 5; i++)
            if (v[i] != val(n0, i) + val(n0 + 1, i)) x->bad[rank] = 1;
    }
    snprintf(x->msg[rank], sizeof x->msg[rank], "%s", s == FL_OK ? "" : fl_error_message());
    fl_comm_destroy(node);
    fl_comm_destroy(c);
    return s;
}

FL_TEST(comm_nccl_standin_split) {
    sp_ctx x;
    memset(&x, 0, sizeof x);
    FL_REQUIRE_OK(fl_comm_threads_run(4, sp_rank, &x));
    for (int r = 0; r < 4; r++) FL_CHECKF(!x.bad[r], "rank %d: wrong split or sum %s", r, x.msg[r]);
}

/* The watchdog: rank 1 never posts the all-reduce rank 0 waits in (a peer that stopped without
 * failing: NCCL would wait forever). With FITLLM_NCCL_TIMEOUT=0.3 rank 0's wait fails after about
 * that long, naming the collective and the limit, and its communicator refuses later calls. */
typedef struct {
    fl_status st;
    char msg[1024];
    double waited_s;
    int later_refused;
} wd_ctx;

static fl_status wd_rank(fl_comm *host, int rank, void *p) {
    wd_ctx *x = p;
    fl_comm *c;
    FL_TRY(fl_comm_nccl_create(host, fl_nccl_standin_api(), NULL, &c));
    if (rank == 0) {
        float v[8] = {0};
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        x->st = fl_comm_all_reduce(c, v, v, 8, FL_F32, FL_COMM_SUM);
        clock_gettime(CLOCK_MONOTONIC, &b);
        x->waited_s = (double)(b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) * 1e-9;
        snprintf(x->msg, sizeof x->msg, "%s", x->st != FL_OK ? fl_error_message() : "");
        x->later_refused = fl_comm_all_reduce(c, v, v, 8, FL_F32, FL_COMM_SUM) != FL_OK;
    }
    fl_comm_barrier(host); /* rank 1 waits here, on the host, until rank 0 gave up */
    fl_comm_destroy(c);
    return FL_OK;
}

FL_TEST(comm_nccl_watchdog_ends_a_wait_for_a_silent_peer) {
    wd_ctx x;
    memset(&x, 0, sizeof x);
    setenv("FITLLM_NCCL_TIMEOUT", "0.3", 1);
    FL_CHECK(fl_comm_nccl_timeout() == 0.3);
    fl_status s = fl_comm_threads_run(2, wd_rank, &x);
    unsetenv("FITLLM_NCCL_TIMEOUT");
    FL_CHECK(fl_comm_nccl_timeout() == 600.0);
    FL_REQUIRE_OK(s);
    FL_CHECKF(x.st == FL_ERR_IO && strstr(x.msg, "comm nccl: rank 0 of 2: all_reduce(count 8, F32, sum)") &&
                  strstr(x.msg, "no completion after 0.3 s") && strstr(x.msg, "FITLLM_NCCL_TIMEOUT"),
              "rank 0: %s '%s'", fl_status_name(x.st), x.msg);
    FL_CHECKF(x.waited_s >= 0.3, "rank 0 gave up after %.3f s, before the limit", x.waited_s);
    FL_CHECK(x.later_refused);
}

/* The null device communicator (src/comm/comm_null.c), the planner's for the null backend's ranks,
 * over the threads implementation at 3 ranks:
 *   - it moves nothing: every collective leaves its (real, here) buffers as they were;
 *   - with the MPI rule a reduction holds (N-1) x this rank's chunk in the pool's WORKSPACE from
 *     its post to its wait (the chunk sizes written out from the layout's definition, comm.h), a
 *     gather or broadcast nothing; without the rule nothing at all;
 *   - a split keeps the rule and the pool, with the split group's sizes;
 *   - a request outstanding when the handle is destroyed gives its scratch back;
 *   - a budget too small for the scratch fails the post with FL_ERR_OOM naming it;
 *   - abort breaks the host group: a peer's next host collective fails instead of waiting. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/comm.h"
#include "test.h"

#define NR 3

/* the chunk of rank r among n for count elements, from the definition in comm.h */
static size_t chunk_len(size_t count, int n, int r) { return count / (size_t)n + ((size_t)r < count % (size_t)n ? 1 : 0); }

typedef struct {
    int fails[NR];
    char msg[NR][256];
} nc_ctx;

#define NC_CHECK(rank, cond, ...)                                                                   \
    do {                                                                                            \
        if (!(cond) && !x->fails[rank]) {                                                           \
            x->fails[rank] = __LINE__;                                                              \
            snprintf(x->msg[rank], sizeof x->msg[rank], __VA_ARGS__);                               \
        }                                                                                           \
    } while (0)

static int unchanged(const unsigned char *b, size_t n, unsigned char v) {
    for (size_t i = 0; i < n; i++)
        if (b[i] != v) return 0;
    return 1;
}

static fl_status nc_rank(fl_comm *host, int rank, void *ud) {
    nc_ctx *x = ud;
    fl_mem_pool pool;
    FL_TRY(fl_mem_pool_init(&pool, "cpu", 0));
    fl_comm_set_pool(host, &pool);
    fl_comm *c = NULL, *q = NULL;
    fl_status s = fl_comm_null_create(host, 1, &c);
    fl_comm_set_pool(host, NULL); /* the null communicator keeps the pool it was made with */
    NC_CHECK(rank, s == FL_OK, "create: %s", fl_error_message());
    if (s != FL_OK) goto out;
    NC_CHECK(rank, fl_comm_rank(c) == rank && fl_comm_size(c) == NR && !strcmp(fl_comm_impl_name(c), "null"),
             "rank %d size %d", fl_comm_rank(c), fl_comm_size(c));
    unsigned char a[64], b[64];
    memset(a, 0x11, sizeof a);
    memset(b, 0x22, sizeof b);
    /* all-reduce of 10 F32: (N-1) x len(rank) x 4 bytes held between post and wait */
    fl_comm_req *r = NULL;
    s = fl_comm_iall_reduce(c, a, b, 10, FL_F32, FL_COMM_SUM, &r);
    size_t want = (NR - 1) * chunk_len(10, NR, rank) * 4;
    NC_CHECK(rank, s == FL_OK && pool.cur[FL_TAG_WORKSPACE] == want, "all_reduce posted: WORKSPACE %zu, want %zu",
             pool.cur[FL_TAG_WORKSPACE], want);
    if (s == FL_OK) s = fl_comm_wait(&r);
    NC_CHECK(rank, s == FL_OK && pool.cur[FL_TAG_WORKSPACE] == 0, "all_reduce waited: WORKSPACE %zu",
             pool.cur[FL_TAG_WORKSPACE]);
    NC_CHECK(rank, pool.peak[FL_TAG_WORKSPACE] == want, "all_reduce: peak %zu, want %zu", pool.peak[FL_TAG_WORKSPACE], want);
    /* reduce-scatter of 7 BF16 (blocking: taken and given back) */
    s = fl_comm_reduce_scatter(c, a, b + 32, 7, FL_BF16, FL_COMM_SUM);
    size_t want2 = (NR - 1) * chunk_len(7, NR, rank) * 2;
    NC_CHECK(rank, s == FL_OK && pool.cur[FL_TAG_WORKSPACE] == 0, "reduce_scatter: %s", fl_error_message());
    NC_CHECK(rank, pool.peak[FL_TAG_WORKSPACE] == (want > want2 ? want : want2), "reduce_scatter peak %zu",
             pool.peak[FL_TAG_WORKSPACE]);
    /* gathers and broadcasts take nothing */
    size_t before = pool.peak_total;
    s = fl_comm_all_gather(c, a, b, 9, FL_F32);
    if (s == FL_OK) s = fl_comm_broadcast(c, a, 16, FL_F32, 1);
    NC_CHECK(rank, s == FL_OK && pool.peak_total == before && pool.cur_total == 0, "gather/broadcast took memory");
    NC_CHECK(rank, unchanged(a, sizeof a, 0x11) && unchanged(b, sizeof b, 0x22), "a collective wrote a buffer");
    /* outstanding at destroy: the scratch goes back */
    s = fl_comm_iall_reduce(c, a, a, 12, FL_F32, FL_COMM_SUM, &r);
    NC_CHECK(rank, s == FL_OK && pool.cur[FL_TAG_WORKSPACE] == (NR - 1) * chunk_len(12, NR, rank) * 4,
             "second all_reduce posted");
    /* a split (ranks 0, 2 | 1): the same rule and pool, the group's own sizes */
    s = fl_comm_split(c, rank % 2, rank, &q);
    const int qn = rank % 2 ? 1 : 2, qr = rank / 2;
    NC_CHECK(rank, s == FL_OK && q && fl_comm_size(q) == qn && fl_comm_rank(q) == qr, "split: %s", fl_error_message());
    if (s == FL_OK) {
        size_t held = pool.cur[FL_TAG_WORKSPACE];
        fl_comm_req *r2 = NULL;
        s = fl_comm_iall_reduce(q, a, a, 5, FL_F32, FL_COMM_SUM, &r2);
        size_t w = qn > 1 ? (size_t)(qn - 1) * chunk_len(5, qn, qr) * 4 : 0;
        NC_CHECK(rank, s == FL_OK && pool.cur[FL_TAG_WORKSPACE] == held + w, "split all_reduce: %zu, want %zu",
                 pool.cur[FL_TAG_WORKSPACE] - held, w);
        if (s == FL_OK) fl_comm_wait(&r2);
    }
    fl_comm_destroy(q);
    q = NULL;
    fl_comm_destroy(c); /* r is still outstanding */
    c = NULL;
    NC_CHECK(rank, pool.cur_total == 0, "destroy left %zu bytes in the pool", pool.cur_total);
    /* without the rule: nothing */
    fl_comm_set_pool(host, &pool);
    s = fl_comm_null_create(host, 0, &c);
    fl_comm_set_pool(host, NULL);
    if (s == FL_OK) {
        before = pool.peak_total;
        /* large counts: addresses that are never dereferenced (nothing moves), disjoint ranges */
        void *fa = (void *)(uintptr_t)0x10000, *fb = (void *)(uintptr_t)0x100000;
        s = fl_comm_all_reduce(c, fa, fa, 1000, FL_F32, FL_COMM_SUM);
        if (s == FL_OK) s = fl_comm_reduce_scatter(c, fa, fb, 1000, FL_F32, FL_COMM_SUM);
        NC_CHECK(rank, s == FL_OK && pool.peak_total == before, "no rule: %s, peak %zu -> %zu", fl_status_name(s),
                 before, pool.peak_total);
        fl_comm_destroy(c);
        c = NULL;
    }
    /* a budget below the scratch: the post fails, naming it */
    fl_mem_pool small;
    if (fl_mem_pool_init(&small, "cpu", 16) == FL_OK) {
        fl_comm_set_pool(host, &small);
        s = fl_comm_null_create(host, 1, &c);
        fl_comm_set_pool(host, NULL);
        if (s == FL_OK) {
            s = fl_comm_all_reduce(c, (void *)(uintptr_t)0x10000, (void *)(uintptr_t)0x10000, 1000, FL_F32,
                                   FL_COMM_SUM);
            NC_CHECK(rank, s == FL_ERR_OOM && strstr(fl_error_message(), "MPI receive scratch"),
                     "budget 16: %s (%s)", fl_status_name(s), fl_error_message());
            fl_comm_destroy(c);
            c = NULL;
        }
        fl_mem_pool_free(&small);
    }
    /* abort breaks the host group */
    fl_comm_barrier(host);
    s = fl_comm_null_create(host, 0, &c);
    if (s == FL_OK) {
        if (rank == 1) fl_comm_abort(c, 1, "test");
        else NC_CHECK(rank, fl_comm_barrier(host) != FL_OK, "rank %d: the host barrier passed after an abort", rank);
        fl_comm_destroy(c);
    }
out:
    fl_mem_pool_free(&pool);
    return FL_OK;
}

FL_TEST(comm_null_moves_nothing_and_holds_the_mpi_scratch) {
    nc_ctx x;
    memset(&x, 0, sizeof x);
    fl_status s = fl_comm_threads_run(NR, nc_rank, &x);
    FL_CHECKF(s == FL_OK, "%s", fl_error_message());
    for (int r = 0; r < NR; r++) FL_CHECKF(!x.fails[r], "rank %d (line %d): %s", r, x.fails[r], x.msg[r]);
}

FL_TEST(comm_null_refuses_without_a_host) {
    fl_comm *c = (fl_comm *)1;
    FL_CHECK(fl_comm_null_create(NULL, 1, &c) == FL_ERR_INVALID && c == NULL);
}

/* The staged device communicator (src/comm/comm_staged.c), ranks as threads over the threads
 * implementation:
 *   - every fl_comm case of tests/comm_ref.h (each kind, dtype, op; in place; counts 0, below the
 *     rank count, not divisible by it) at 1, 2, 3, 4 and 7 ranks against the written-out
 *     specification bit for bit, on "device memory" the communicator may reach only through its
 *     copies: the device bytes are the host bytes XOR 0x5A, which only the test's to_host / to_device
 *     undo, so a collective that read or wrote a device buffer directly gives wrong results;
 *   - a split (2 groups of 2) through the same copies;
 *   - a rank whose copy fails: its call fails naming the copy, the other ranks' fail (the host
 *     group is aborted) instead of waiting for it.
 * The trainer-level runs (ZeRO, FSDP, HYBRID and DDP on the opaque backend in its staged mode = the
 * cpu backend's bits) are in tests/test_shard_nccl.c. */
#include <stdlib.h>
#include <string.h>

#include "comm_ref.h"
#include "fitllm/comm.h"
#include "test.h"

#define XK 0x5A

static void xor_bytes(void *dst, const void *src, size_t bytes) {
    unsigned char *d = dst;
    const unsigned char *s = src;
    for (size_t i = 0; i < bytes; i++) d[i] = (unsigned char)(s[i] ^ XK);
}

typedef struct {
    int fail_rank;              /* this rank's to_host fails (-1: none) */
    unsigned long copies[8];    /* per rank */
} st_ctx;

typedef struct {
    st_ctx *x;
    int rank;
} st_rank_ctx;

static fl_status x_to_host(void *ctx, void *dst, const void *src, size_t bytes) {
    st_rank_ctx *rc = ctx;
    rc->x->copies[rc->rank]++;
    if (rc->rank == rc->x->fail_rank) return fl_errorf(FL_ERR_IO, "test device: to_host of %zu bytes failed", bytes);
    xor_bytes(dst, src, bytes);
    return FL_OK;
}
static fl_status x_to_device(void *ctx, void *dst, const void *src, size_t bytes) {
    st_rank_ctx *rc = ctx;
    rc->x->copies[rc->rank]++;
    xor_bytes(dst, src, bytes);
    return FL_OK;
}

typedef struct {
    st_ctx st;
    int ncases;
    const cr_case *cases;
    void ***in, ***out; /* [case][rank], encoded ("device") bytes */
} all_ctx;

static fl_status all_rank(fl_comm *host, int rank, void *p) {
    all_ctx *x = p;
    st_rank_ctx rc = {&x->st, rank};
    fl_comm_staging sg = {&rc, x_to_host, x_to_device};
    fl_comm *c = NULL;
    FL_TRY(fl_comm_staged_create(host, &sg, &c));
    fl_status s = FL_OK;
    for (int k = 0; k < x->ncases && s == FL_OK; k++) s = cr_run(c, &x->cases[k], x->in[k][rank], x->out[k][rank]);
    fl_comm_destroy(c);
    return s;
}

static int run_cases(int n, int *ncases) {
    int m = cr_cases(n, NULL), fails = 0;
    cr_case *cases = malloc((size_t)m * sizeof *cases);
    cr_cases(n, cases);
    all_ctx x;
    memset(&x, 0, sizeof x);
    x.st.fail_rank = -1;
    x.ncases = m;
    x.cases = cases;
    x.in = calloc((size_t)m, sizeof(void **));
    x.out = calloc((size_t)m, sizeof(void **));
    void ***plain = calloc((size_t)m, sizeof(void **));
    for (int k = 0; k < m; k++) {
        size_t bytes = cases[k].count * fl_dtype_size(cases[k].dt) + 1;
        x.in[k] = calloc((size_t)n, sizeof(void *));
        x.out[k] = calloc((size_t)n, sizeof(void *));
        plain[k] = calloc((size_t)n, sizeof(void *));
        for (int r = 0; r < n; r++) {
            plain[k][r] = malloc(bytes);
            x.in[k][r] = malloc(bytes);
            x.out[k][r] = malloc(bytes);
            cr_input(&cases[k], r, plain[k][r]);
            xor_bytes(x.in[k][r], plain[k][r], bytes);
        }
    }
    fl_status s = fl_comm_threads_run(n, all_rank, &x);
    if (s != FL_OK) {
        fprintf(stderr, "  %d ranks: %s\n", n, fl_error_message());
        fails++;
    }
    for (int k = 0; k < m && s == FL_OK; k++) {
        char label[256];
        cr_label(&cases[k], n, label, sizeof label);
        for (int r = 0; r < n; r++) {
            size_t bytes = cases[k].count * fl_dtype_size(cases[k].dt);
            void *dec = malloc(bytes + 1);
            xor_bytes(dec, x.out[k][r], bytes);
            fails += cr_check(label, &cases[k], n, r, (const void *const *)plain[k], dec, NULL) != 0;
            free(dec);
        }
    }
    for (int r = 0; r < n && s == FL_OK; r++) fails += x.st.copies[r] == 0; /* the data went through the copies */
    for (int k = 0; k < m; k++) {
        for (int r = 0; r < n; r++) {
            free(x.in[k][r]);
            free(x.out[k][r]);
            free(plain[k][r]);
        }
        free(x.in[k]);
        free(x.out[k]);
        free(plain[k]);
    }
    free(x.in);
    free(x.out);
    free(plain);
    free(cases);
    *ncases = m;
    return fails;
}

FL_TEST(comm_staged_collectives) {
    int sizes[] = {1, 2, 3, 4, 7}, total = 0;
    unsigned long c0 = fl_comm_staged_calls();
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        int m, f = run_cases(sizes[i], &m);
        total += m;
        FL_CHECKF(f == 0, "%d wrong rank results in %d cases at %d ranks", f, m, sizes[i]);
    }
    FL_CHECK(total > 400);
    FL_CHECK(fl_comm_staged_calls() - c0 >= (unsigned long)total);
}

/* ---- a split: ranks {0, 2} and {1, 3}, each group's sum through the staged copies ------------ */
typedef struct {
    st_ctx st;
    int bad[4];
} sp_ctx;

static fl_status sp_rank(fl_comm *host, int rank, void *p) {
    sp_ctx *x = p;
    st_rank_ctx rc = {&x->st, rank};
    fl_comm_staging sg = {&rc, x_to_host, x_to_device};
    fl_comm *c = NULL, *g = NULL;
    FL_TRY(fl_comm_staged_create(host, &sg, &c));
    fl_status s = fl_comm_split(c, rank % 2, rank, &g);
    float v[5], d[5];
    for (int i = 0; i < 5; i++) v[i] = (float)(rank + 1) + 0.25f * (float)i;
    xor_bytes(d, v, sizeof d);
    if (s == FL_OK) s = fl_comm_all_reduce(g, d, d, 5, FL_F32, FL_COMM_SUM);
    xor_bytes(v, d, sizeof d);
    /* group {0, 2}: (1 + 3) + 0.5 i; group {1, 3}: (2 + 4) + 0.5 i (exact in fp32) */
    for (int i = 0; s == FL_OK && i < 5; i++)
        if (v[i] != (rank % 2 ? 6.0f : 4.0f) + 0.5f * (float)i) x->bad[rank] = 1;
    if (s == FL_OK && (fl_comm_size(g) != 2 || fl_comm_rank(g) != rank / 2)) x->bad[rank] = 1;
    if (s != FL_OK) x->bad[rank] = 1;
    fl_comm_destroy(g);
    fl_comm_destroy(c);
    return s;
}

FL_TEST(comm_staged_split) {
    sp_ctx x;
    memset(&x, 0, sizeof x);
    x.st.fail_rank = -1;
    FL_REQUIRE_OK(fl_comm_threads_run(4, sp_rank, &x));
    for (int r = 0; r < 4; r++) FL_CHECKF(!x.bad[r], "rank %d: wrong split or sum", r);
}

/* ---- a failing copy: no rank is left waiting -------------------------------------------------- */
typedef struct {
    st_ctx st;
    fl_status s[3];
    char msg[3][700];
} fl_ctx;

static fl_status fail_rank_fn(fl_comm *host, int rank, void *p) {
    fl_ctx *x = p;
    st_rank_ctx rc = {&x->st, rank};
    fl_comm_staging sg = {&rc, x_to_host, x_to_device};
    fl_comm *c = NULL;
    FL_TRY(fl_comm_staged_create(host, &sg, &c));
    float v[8] = {0};
    x->s[rank] = fl_comm_all_reduce(c, v, v, 8, FL_F32, FL_COMM_SUM);
    snprintf(x->msg[rank], sizeof x->msg[rank], "%s", x->s[rank] != FL_OK ? fl_error_message() : "");
    fl_comm_destroy(c);
    return x->s[rank];
}

FL_TEST(comm_staged_copy_failure) {
    fl_ctx x;
    memset(&x, 0, sizeof x);
    x.st.fail_rank = 1;
    FL_CHECK(fl_comm_threads_run(3, fail_rank_fn, &x) != FL_OK);
    FL_CHECKF(x.s[1] == FL_ERR_IO && strstr(x.msg[1], "comm staged: rank 1 of 3: all_reduce(count 8, F32, sum)") &&
                  strstr(x.msg[1], "the copy to the host failed") && strstr(x.msg[1], "test device: to_host"),
              "rank 1: '%s'", x.msg[1]);
    for (int r = 0; r < 3; r += 2)
        FL_CHECKF(x.s[r] != FL_OK && strstr(x.msg[r], "aborted"), "rank %d: '%s'", r, x.msg[r]);
}

FL_TEST(comm_staged_refuses_missing_copies) {
    fl_comm *c = (fl_comm *)1;
    fl_comm_staging sg = {NULL, x_to_host, NULL};
    fl_comm *host = NULL;
    FL_REQUIRE_OK(fl_comm_init_single(&host));
    FL_CHECK(fl_comm_staged_create(host, &sg, &c) == FL_ERR_INVALID && c == NULL);
    FL_CHECK(strstr(fl_error_message(), "both copies") != NULL);
    fl_comm_destroy(host);
}

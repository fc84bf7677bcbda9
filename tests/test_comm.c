/* fl_comm tests: the chunk layout, the single-process and threads implementations (every
 * collective, dtype and op; counts 0, below the rank count and odd; in place; asynchronous
 * requests completed in any order and past the slot ring; abort, mismatched calls, timeouts),
 * launcher detection and fl_comm_init's messages. References (tests/comm_ref.h): the written-out
 * specification of the deterministic reduction (bit-equal) and float64 with a derived bound.
 * The MPI implementation runs the same cases under mpirun in tests/mpi_test.sh. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm_ref.h"
#include "fitllm/comm.h"
#include "test.h"

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

FL_TEST(comm_chunk_layout) {
    for (int n = 1; n <= 9; n++)
        for (size_t count = 0; count <= 40; count++) {
            size_t next = 0, minl = (size_t)-1, maxl = 0;
            for (int r = 0; r < n; r++) {
                size_t off, len;
                fl_comm_chunk(count, n, r, &off, &len);
                FL_CHECKF(off == next, "count %zu n %d rank %d: off %zu, want %zu (contiguous)", count, n, r, off, next);
                /* the first count % n ranks hold the extra element */
                FL_CHECKF(len == count / n + ((size_t)r < count % n), "count %zu n %d rank %d: len %zu", count, n, r, len);
                next = off + len;
                if (len < minl) minl = len;
                if (len > maxl) maxl = len;
            }
            FL_CHECKF(next == count, "count %zu n %d: chunks cover %zu", count, n, next);
            FL_CHECK(maxl - minl <= 1);
        }
    /* a large count: no overflow in the offsets */
    size_t off, len, big = (size_t)1 << 40;
    fl_comm_chunk(big + 3, 4, 3, &off, &len);
    FL_CHECK(off == 3 * (big / 4) + 3 && len == big / 4);
}

/* ---- running every case on N threads ------------------------------------------------------- */

typedef struct {
    const cr_case *cs;
    void **in;  /* [n] inputs */
    void **out; /* [n] outputs */
} case_ctx;

static fl_status run_case_rank(fl_comm *c, int rank, void *p) {
    case_ctx *x = p;
    return cr_run(c, x->cs, x->in[rank], x->out[rank]);
}

/* Run all cases at n ranks; returns failures. With n == 1 and single != 0 on the single-process
 * implementation instead. */
static int run_all_cases(int n, int single, int *ncases) {
    int m = cr_cases(n, NULL), fails = 0;
    cr_case *cases = malloc((size_t)m * sizeof *cases);
    cr_cases(n, cases);
    double worst = 0;
    for (int k = 0; k < m; k++) {
        const cr_case *cs = &cases[k];
        size_t es = fl_dtype_size(cs->dt);
        void *in[16], *out[16];
        for (int r = 0; r < n; r++) {
            in[r] = malloc(cs->count * es + 1);
            out[r] = malloc(cs->count * es + 1);
            cr_input(cs, r, in[r]);
        }
        case_ctx x = {cs, in, out};
        fl_status s;
        if (single) {
            fl_comm *c;
            s = fl_comm_init_single(&c);
            if (s == FL_OK) s = run_case_rank(c, 0, &x);
            fl_comm_destroy(c);
        } else {
            s = fl_comm_threads_run(n, run_case_rank, &x);
        }
        char label[256];
        cr_label(cs, n, label, sizeof label);
        if (s != FL_OK) {
            fprintf(stderr, "  %s: %s\n", label, fl_error_message());
            fails++;
        } else {
            for (int r = 0; r < n; r++) fails += cr_check(label, cs, n, r, (const void *const *)in, out[r], &worst) != 0;
        }
        for (int r = 0; r < n; r++) {
            free(in[r]);
            free(out[r]);
        }
    }
    free(cases);
    *ncases = m;
    return fails;
}

FL_TEST(comm_single_collectives) {
    int m, f = run_all_cases(1, 1, &m);
    FL_CHECKF(f == 0, "%d of %d cases failed on the single-process implementation", f, m);
    fl_comm *c;
    FL_REQUIRE_OK(fl_comm_init_single(&c));
    FL_CHECK(fl_comm_rank(c) == 0 && fl_comm_size(c) == 1 && !strcmp(fl_comm_impl_name(c), "single"));
    FL_CHECK(fl_comm_barrier(c) == FL_OK);
    float x[3] = {1, 2, 3};
    fl_comm_req *r;
    FL_REQUIRE_OK(fl_comm_iall_reduce(c, x, x, 3, FL_F32, FL_COMM_AVG, &r));
    int done = 0;
    FL_CHECK(fl_comm_test(&r, &done) == FL_OK && done && r == NULL);
    FL_CHECK(x[0] == 1 && x[1] == 2 && x[2] == 3);
    fl_comm_abort(c, 1, "nothing to do at size 1"); /* returns */
    fl_comm_destroy(c);
}

FL_TEST(comm_threads_collectives) {
    int total = 0;
    for (int n = 1; n <= 5; n++) {
        int m, f = run_all_cases(n, 0, &m);
        total += m;
        FL_CHECKF(f == 0, "%d wrong rank results in %d cases at %d ranks", f, m, n);
    }
    /* 7 ranks: a count of 3 leaves four ranks with empty chunks */
    int m, f = run_all_cases(7, 0, &m);
    FL_CHECKF(f == 0, "%d wrong rank results in %d cases at 7 ranks", f, m);
    FL_CHECK(total > 500);
}

/* BF16 is reduced in fp32 and rounded once: 1 + 3 x 2^-9 rounds to 1 + 2^-7 (3 x 2^-9 is more
 * than half of bf16's ulp at 1); rounding after every addition would keep 1 (each 2^-9 is a
 * quarter ulp). */
typedef struct { uint16_t out[4][1]; } once_ctx;
static fl_status once_rank(fl_comm *c, int rank, void *p) {
    once_ctx *x = p;
    uint16_t v = fl_f32_to_bf16(rank == 0 ? 1.0f : ldexpf(1.0f, -9));
    return fl_comm_all_reduce(c, &v, x->out[rank], 1, FL_BF16, FL_COMM_SUM);
}
FL_TEST(comm_bf16_rounded_once) {
    once_ctx x;
    FL_REQUIRE_OK(fl_comm_threads_run(4, once_rank, &x));
    for (int r = 0; r < 4; r++)
        FL_CHECKF(fl_bf16_to_f32(x.out[r][0]) == 1.0f + ldexpf(1.0f, -7), "rank %d: %.9g", r, fl_bf16_to_f32(x.out[r][0]));
}

/* F16 likewise: 1 + 3 x 2^-12 rounds to 1 + 2^-10 (fp16's ulp at 1 is 2^-10; 3 x 2^-12 is more than
 * half of it, each 2^-12 a quarter). And a sum of finite fp16 values beyond fp16's range is +-inf
 * after the one rounding (the loss scaler's overflow check on the reduced gradients must see it):
 * 40000 + 40000; 65504 + 16 = 65520, the tie between 65504 (odd significand) and 2^16, rounds to
 * even, i.e. overflows; 65504 + 15 rounds back to 65504; -40000 x 2 is -inf. MAX keeps an fp16 NaN. */
typedef struct { uint16_t out[4][6]; } f16_ctx;
static fl_status f16_rank(fl_comm *c, int rank, void *p) {
    f16_ctx *x = p;
    float v[6] = {rank == 0 ? 1.0f : ldexpf(1.0f, -12), rank < 2 ? 40000.0f : 0.0f, rank == 0 ? 65504.0f : rank == 1 ? 16.0f : 0.0f,
                  rank == 0 ? 65504.0f : rank == 1 ? 15.0f : 0.0f, rank < 2 ? -40000.0f : 0.0f, rank == 3 ? NAN : (float)rank};
    uint16_t h[6];
    for (int i = 0; i < 6; i++) h[i] = fl_f32_to_f16(v[i]);
    FL_TRY(fl_comm_all_reduce(c, h, x->out[rank], 5, FL_F16, FL_COMM_SUM));
    return fl_comm_all_reduce(c, h + 5, x->out[rank] + 5, 1, FL_F16, FL_COMM_MAX);
}
FL_TEST(comm_f16_rounded_once_and_overflows) {
    f16_ctx x;
    FL_REQUIRE_OK(fl_comm_threads_run(4, f16_rank, &x));
    for (int r = 0; r < 4; r++) {
        const uint16_t *o = x.out[r];
        FL_CHECKF(fl_f16_to_f32(o[0]) == 1.0f + ldexpf(1.0f, -10), "rank %d: %.9g", r, fl_f16_to_f32(o[0]));
        FL_CHECKF(o[1] == 0x7c00 && o[2] == 0x7c00 && o[4] == 0xfc00, "rank %d: %04x %04x %04x (want +inf +inf -inf)", r,
                  o[1], o[2], o[4]);
        FL_CHECKF(fl_f16_to_f32(o[3]) == 65504.0f, "rank %d: %.9g", r, fl_f16_to_f32(o[3]));
        FL_CHECKF(isnan(fl_f16_to_f32(o[5])), "rank %d: MAX %04x", r, o[5]);
    }
}

/* MAX keeps a NaN (an overflow check must see it) and +-inf. */
typedef struct { float out[3][4]; } nan_ctx;
static fl_status nan_rank(fl_comm *c, int rank, void *p) {
    nan_ctx *x = p;
    float v[4] = {(float)rank, rank == 1 ? NAN : 0.f, rank == 2 ? INFINITY : -1.f, rank == 0 ? -INFINITY : -2.f};
    return fl_comm_all_reduce(c, v, x->out[rank], 4, FL_F32, FL_COMM_MAX);
}
FL_TEST(comm_max_nan_inf) {
    nan_ctx x;
    FL_REQUIRE_OK(fl_comm_threads_run(3, nan_rank, &x));
    for (int r = 0; r < 3; r++) {
        FL_CHECK(x.out[r][0] == 2.f);
        FL_CHECK(isnan(x.out[r][1]));
        FL_CHECK(isinf(x.out[r][2]) && x.out[r][2] > 0);
        FL_CHECK(x.out[r][3] == -2.f);
    }
}

/* ---- asynchronous requests ----------------------------------------------------------------- */

#define ASYNC_N 3
#define ASYNC_K 100 /* more outstanding than the threads implementation's ring of 64 slots */
#define ASYNC_LEN 37

typedef struct {
    float in[ASYNC_N][ASYNC_K][ASYNC_LEN];
    float out[ASYNC_N][ASYNC_K][ASYNC_LEN];
    int polled[ASYNC_N];
} async_ctx;

static fl_status async_rank(fl_comm *c, int rank, void *p) {
    async_ctx *x = p;
    fl_comm_req *req[ASYNC_K];
    size_t off, len;
    fl_comm_chunk(ASYNC_LEN, ASYNC_N, rank, &off, &len);
    for (int k = 0; k < ASYNC_K; k++) {
        fl_status s;
        switch (k % 4) {
        case 0: s = fl_comm_iall_reduce(c, x->in[rank][k], x->out[rank][k], ASYNC_LEN, FL_F32, FL_COMM_SUM, &req[k]); break;
        case 1: s = fl_comm_ireduce_scatter(c, x->in[rank][k], x->out[rank][k], ASYNC_LEN, FL_F32, FL_COMM_SUM, &req[k]); break;
        case 2: s = fl_comm_iall_gather(c, x->in[rank][k] + off, x->out[rank][k], ASYNC_LEN, FL_F32, &req[k]); break;
        default:
            memcpy(x->out[rank][k], x->in[rank][k], sizeof x->out[rank][k]);
            s = fl_comm_ibroadcast(c, x->out[rank][k], ASYNC_LEN, FL_F32, k % ASYNC_N, &req[k]);
        }
        if (s != FL_OK) return s;
    }
    /* complete in a rank-dependent order: reverse, by polling, or forward */
    if (rank == 0) {
        for (int k = ASYNC_K - 1; k >= 0; k--) FL_TRY(fl_comm_wait(&req[k]));
    } else if (rank == 1) {
        int left = ASYNC_K;
        while (left) {
            for (int k = 0; k < ASYNC_K; k++) {
                if (!req[k]) continue;
                int done;
                FL_TRY(fl_comm_test(&req[k], &done));
                if (done) left--;
                x->polled[rank]++;
            }
        }
    } else {
        FL_TRY(fl_comm_wait_all(req, ASYNC_K));
    }
    for (int k = 0; k < ASYNC_K; k++)
        if (req[k]) return fl_errorf(FL_ERR_INTERNAL, "request %d not cleared", k);
    return FL_OK;
}

FL_TEST(comm_threads_async) {
    async_ctx *x = calloc(1, sizeof *x);
    fl_test_rng g = {77};
    fl_test_fill(&g, &x->in[0][0][0], (size_t)ASYNC_N * ASYNC_K * ASYNC_LEN, -1, 1);
    FL_REQUIRE_OK(fl_comm_threads_run(ASYNC_N, async_rank, x));
    int bad = 0;
    for (int k = 0; k < ASYNC_K; k++) {
        cr_case cs = {(fl_coll_kind)(k % 4), ASYNC_LEN, FL_F32, FL_COMM_SUM, k % ASYNC_N, 0};
        const void *in[ASYNC_N];
        for (int r = 0; r < ASYNC_N; r++) in[r] = x->in[r][k];
        for (int r = 0; r < ASYNC_N; r++) {
            char label[64];
            snprintf(label, sizeof label, "request %d rank %d", k, r);
            bad += cr_check(label, &cs, ASYNC_N, r, in, x->out[r][k], NULL) != 0;
        }
    }
    FL_CHECKF(bad == 0, "%d of %d async results wrong", bad, ASYNC_K * ASYNC_N);
    FL_CHECK(x->polled[1] >= ASYNC_K);
    free(x);
}

/* ---- failures ------------------------------------------------------------------------------ */

typedef struct {
    fl_comm *c[4];
    fl_status st[4];
    char msg[4][1024];
    double t[4];
    int abort_rank; /* -1: none */
    int mismatch;   /* rank 1 calls with another count */
    int absent;     /* this rank never calls (timeout) */
} fail_ctx;

typedef struct { fail_ctx *x; int rank; } fail_arg;

static void *fail_thread(void *p) {
    fail_arg *a = p;
    fail_ctx *x = a->x;
    int r = a->rank;
    double t0 = now_s();
    float v[8] = {0};
    fl_status s = FL_OK;
    if (r == x->absent) return NULL;
    if (r == x->abort_rank) {
        usleep(50000); /* the others are already blocked in the all-reduce */
        fl_comm_abort(x->c[r], 3, "test failure on this rank");
    } else {
        s = fl_comm_all_reduce(x->c[r], v, v, r == 1 && x->mismatch ? 7 : 8, FL_F32, FL_COMM_SUM);
        if (s == FL_OK) s = fl_comm_barrier(x->c[r]); /* later calls fail too */
    }
    x->st[r] = s;
    snprintf(x->msg[r], sizeof x->msg[r], "%s", fl_error_message());
    x->t[r] = now_s() - t0;
    return NULL;
}

static void run_fail(fail_ctx *x, int n, double timeout) {
    pthread_t th[4];
    fail_arg a[4];
    FL_REQUIRE_OK(fl_comm_threads_create(n, timeout, x->c));
    for (int r = 0; r < n; r++) {
        a[r] = (fail_arg){x, r};
        pthread_create(&th[r], NULL, fail_thread, &a[r]);
    }
    for (int r = 0; r < n; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < n; r++) fl_comm_destroy(x->c[r]);
}

FL_TEST(comm_threads_abort) {
    fail_ctx x = {.abort_rank = 2, .absent = -1};
    run_fail(&x, 4, 30);
    for (int r = 0; r < 4; r++) {
        if (r == 2) continue;
        FL_CHECKF(x.st[r] != FL_OK, "rank %d did not fail", r);
        FL_CHECKF(strstr(x.msg[r], "rank 2 aborted") && strstr(x.msg[r], "test failure on this rank"),
                  "rank %d: '%s'", r, x.msg[r]);
        char want[64];
        snprintf(want, sizeof want, "comm threads: rank %d of 4: all_reduce(count 8, F32, sum)", r);
        FL_CHECKF(strstr(x.msg[r], want), "rank %d's message does not name it and the operation: '%s'", r, x.msg[r]);
        FL_CHECKF(x.t[r] < 5, "rank %d took %.1f s to notice the abort", r, x.t[r]);
    }
}

FL_TEST(comm_threads_mismatch) {
    fail_ctx x = {.abort_rank = -1, .absent = -1, .mismatch = 1};
    run_fail(&x, 2, 30);
    for (int r = 0; r < 2; r++) {
        FL_CHECKF(x.st[r] == FL_ERR_INVALID || x.st[r] == FL_ERR_IO, "rank %d: status %d", r, x.st[r]);
        FL_CHECKF(strstr(x.msg[r], "mismatched collective #0") && strstr(x.msg[r], "count 7") &&
                      strstr(x.msg[r], "count 8"),
                  "rank %d: '%s'", r, x.msg[r]);
    }
}

FL_TEST(comm_threads_timeout) {
    fail_ctx x = {.abort_rank = -1, .absent = 1};
    run_fail(&x, 2, 0.3);
    FL_CHECK(x.st[0] == FL_ERR_IO);
    FL_CHECKF(strstr(x.msg[0], "gave up") && strstr(x.msg[0], "1 of 2 ranks did not call it"), "'%s'", x.msg[0]);
    FL_CHECKF(x.t[0] < 5, "%.1f s", x.t[0]);
}

/* FITLLM_COMM_TIMEOUT (comm.h: one limit for every implementation) is the threads group's when its creator gives none
 * (0): a rank waiting for an absent one gives up after it (before: a fixed 120 s, the variable ignored); a value that
 * is not a number is refused by fl_comm_init, naming the variable (the getter keeps the default) */
FL_TEST(comm_threads_timeout_from_env) {
    const char *had = getenv("FITLLM_COMM_TIMEOUT");
    char keep[64];
    snprintf(keep, sizeof keep, "%s", had ? had : "");
    setenv("FITLLM_COMM_TIMEOUT", "0.05", 1);
    fail_ctx x = {.abort_rank = -1, .absent = 1};
    run_fail(&x, 2, 0);
    FL_CHECK(x.st[0] == FL_ERR_IO);
    FL_CHECKF(strstr(x.msg[0], "gave up") && strstr(x.msg[0], "after 0.05 s"), "'%s'", x.msg[0]);
    FL_CHECKF(x.t[0] < 5, "%.1f s", x.t[0]);
    setenv("FITLLM_COMM_TIMEOUT", "ten", 1);
    FL_CHECK(fl_comm_timeout() == 600.0);
    fl_comm *c = NULL;
    FL_CHECK(fl_comm_init(&c, NULL, NULL) == FL_ERR_INVALID && c == NULL);
    FL_CHECKF(strstr(fl_error_message(), "FITLLM_COMM_TIMEOUT='ten' is not a number of seconds"), "'%s'",
              fl_error_message());
    if (keep[0]) setenv("FITLLM_COMM_TIMEOUT", keep, 1);
    else unsetenv("FITLLM_COMM_TIMEOUT");
    FL_CHECK(keep[0] || fl_comm_timeout() == 600.0);
}

/* ---- argument checks ----------------------------------------------------------------------- */

FL_TEST(comm_bad_arguments) {
    fl_comm *c[2];
    FL_REQUIRE_OK(fl_comm_threads_create(2, 5, c));
    float a[8] = {0}, b[8];
    fl_comm_req *r = (fl_comm_req *)1;
    FL_CHECK(fl_comm_iall_reduce(c[1], a, b, 2, FL_F64, FL_COMM_SUM, &r) == FL_ERR_UNSUPPORTED);
    FL_CHECKF(strstr(fl_error_message(), "rank 1 of 2: all_reduce(count 2, ?, sum): dtype F64"), "'%s'", fl_error_message());
    FL_CHECK(r == NULL);
    FL_CHECK(fl_comm_all_reduce(c[0], a, a + 1, 4, FL_F32, FL_COMM_SUM) == FL_ERR_INVALID);
    FL_CHECKF(strstr(fl_error_message(), "overlap"), "'%s'", fl_error_message());
    FL_CHECK(fl_comm_all_reduce(c[0], NULL, b, 4, FL_F32, FL_COMM_SUM) == FL_ERR_INVALID);
    FL_CHECK(fl_comm_all_reduce(c[0], a, b, 4, FL_F32, (fl_comm_op)9) == FL_ERR_INVALID);
    FL_CHECK(fl_comm_broadcast(c[0], a, 4, FL_F32, 2) == FL_ERR_INVALID);
    FL_CHECKF(strstr(fl_error_message(), "root 2 outside [0, 2)"), "'%s'", fl_error_message());
    /* reduce-scatter into this rank's own chunk of send is fine, elsewhere inside send is not */
    FL_CHECK(fl_comm_reduce_scatter(c[1], a, a + 1, 8, FL_F32, FL_COMM_SUM) == FL_ERR_INVALID);
    FL_CHECK(fl_comm_all_gather(c[1], b + 1, b, 8, FL_F32) == FL_ERR_INVALID);
    FL_CHECK(fl_comm_all_reduce(NULL, a, b, 4, FL_F32, FL_COMM_SUM) == FL_ERR_INVALID);
    FL_CHECK(fl_comm_wait(NULL) == FL_OK);
    fl_comm_destroy(c[0]);
    fl_comm_destroy(c[1]);
}

/* ---- launcher detection and fl_comm_init --------------------------------------------------- */

static const char *k_launch_vars[] = {
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS",
    "SLURM_NTASKS", "SLURM_LOCALID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
    "MASTER_PORT"};
#define NLV (sizeof k_launch_vars / sizeof k_launch_vars[0])

static void save_env(char **saved) {
    for (size_t i = 0; i < NLV; i++) {
        const char *v = getenv(k_launch_vars[i]);
        saved[i] = v ? strdup(v) : NULL;
        unsetenv(k_launch_vars[i]);
    }
}
static void clear_env(void) {
    for (size_t i = 0; i < NLV; i++) unsetenv(k_launch_vars[i]);
}
static void restore_env(char **saved) {
    for (size_t i = 0; i < NLV; i++) {
        if (saved[i]) setenv(k_launch_vars[i], saved[i], 1);
        else unsetenv(k_launch_vars[i]);
        free(saved[i]);
    }
}

FL_TEST(comm_launch_detect) {
    char *saved[NLV];
    save_env(saved);
    fl_launch_info li;
    char buf[512];
    FL_CHECK(fl_launch_detect(&li) == FL_OK && li.kind == FL_LAUNCH_NONE && li.rank == 0 && li.size == 1);
    FL_CHECK(strstr(fl_launch_describe(&li, buf, sizeof buf), "single process"));

    setenv("OMPI_COMM_WORLD_RANK", "3", 1);
    setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
    setenv("SLURM_PROCID", "0", 1); /* mpirun inside an allocation: Open MPI's are this process's */
    setenv("SLURM_NTASKS", "4", 1);
    FL_CHECK(fl_launch_detect(&li) == FL_OK && li.kind == FL_LAUNCH_OPENMPI && li.rank == 3 && li.size == 4 &&
             li.local_rank == 1 && li.local_size == 2);
    FL_CHECKF(!strcmp(fl_launch_describe(&li, buf, sizeof buf), "Open MPI (mpirun): rank 3 of 4, local rank 1 of 2"),
              "'%s'", buf);

    clear_env();
    setenv("SLURM_PROCID", "5", 1);
    setenv("SLURM_NTASKS", "16", 1);
    setenv("SLURM_STEP_NUM_TASKS", "8", 1); /* the step's count wins over the allocation's */
    setenv("SLURM_LOCALID", "1", 1);
    FL_CHECK(fl_launch_detect(&li) == FL_OK && li.kind == FL_LAUNCH_SLURM && li.rank == 5 && li.size == 8 &&
             li.local_rank == 1 && li.local_size == -1);

    clear_env();
    setenv("PMI_RANK", "1", 1);
    setenv("PMI_SIZE", "2", 1);
    FL_CHECK(fl_launch_detect(&li) == FL_OK && li.kind == FL_LAUNCH_PMI && li.rank == 1 && li.size == 2);

    clear_env();
    setenv("RANK", "2", 1);
    setenv("WORLD_SIZE", "4", 1);
    setenv("LOCAL_RANK", "0", 1);
    setenv("LOCAL_WORLD_SIZE", "2", 1);
    setenv("MASTER_ADDR", "node7", 1);
    setenv("MASTER_PORT", "29500", 1);
    FL_CHECK(fl_launch_detect(&li) == FL_OK && li.kind == FL_LAUNCH_TORCHRUN && li.rank == 2 && li.size == 4 &&
             li.local_size == 2 && !strcmp(li.master_addr, "node7") && li.master_port == 29500);
    FL_CHECKF(strstr(fl_launch_describe(&li, buf, sizeof buf), "master node7:29500"), "'%s'", buf);
    /* torchrun without mpirun: refused with the command to run instead (MPI build or not) */
    fl_comm *c = NULL;
    FL_CHECK(fl_comm_init(&c, NULL, NULL) == FL_ERR_UNSUPPORTED && c == NULL);
    FL_CHECKF(strstr(fl_error_message(), "WORLD_SIZE=4") && strstr(fl_error_message(), "mpirun -np 4 fitllm"), "'%s'",
              fl_error_message());
    FL_CHECK(fl_launch_check(&li) == FL_ERR_UNSUPPORTED && strstr(fl_error_message(), "mpirun -np 4 fitllm"));

    clear_env();
    setenv("WORLD_SIZE", "1", 1);
    setenv("RANK", "0", 1);
    FL_CHECK(fl_comm_init(&c, NULL, NULL) == FL_OK && c && !strcmp(fl_comm_impl_name(c), "single") &&
             c->launch.kind == FL_LAUNCH_TORCHRUN);
    fl_comm_destroy(c);

    clear_env();
    setenv("RANK", "4", 1);
    setenv("WORLD_SIZE", "4", 1);
    FL_CHECK(fl_launch_detect(&li) == FL_ERR_INVALID);
    FL_CHECKF(strstr(fl_error_message(), "RANK=4") && strstr(fl_error_message(), "WORLD_SIZE=4"), "'%s'", fl_error_message());
    setenv("RANK", "x1", 1);
    FL_CHECK(fl_launch_detect(&li) == FL_ERR_INVALID);
    FL_CHECKF(strstr(fl_error_message(), "RANK='x1'"), "'%s'", fl_error_message());

    /* no launcher: the single-process implementation, MPI not initialized */
    clear_env();
    FL_CHECK(fl_comm_init(&c, NULL, NULL) == FL_OK && c && fl_comm_size(c) == 1 && !strcmp(fl_comm_impl_name(c), "single"));
    fl_comm_destroy(c);

    if (!fl_comm_mpi_built()) {
        setenv("OMPI_COMM_WORLD_RANK", "0", 1);
        setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
        FL_CHECK(fl_comm_init(&c, NULL, NULL) == FL_ERR_UNSUPPORTED);
        FL_CHECKF(strstr(fl_error_message(), "multi-process training needs a build with MPI"), "'%s'", fl_error_message());
        FL_CHECK(!strcmp(fl_comm_mpi_library(), "none"));
    }
    restore_env(saved);
}

/* Traffic counters (fl_comm_traffic): summed over the ranks, what is sent is what is received, and
 * the totals are the ring algorithms' textbook volumes for N ranks and `count` elements: an
 * all-reduce moves 2 (N-1) count elements (reduce-scatter (N-1) count, all-gather (N-1) count), a
 * broadcast (N-1) count. Odd count (does not divide by 3). */
typedef struct { fl_comm_traffic t[3]; } traffic_ctx;
static fl_status traffic_rank(fl_comm *c, int rank, void *ud) {
    traffic_ctx *x = ud;
    float a[101] = {0}, b[101];
    uint16_t h[101] = {0};
    size_t off, len;
    fl_comm_chunk(101, c->size, rank, &off, &len);
    FL_TRY(fl_comm_all_reduce(c, a, b, 101, FL_F32, FL_COMM_SUM));
    FL_TRY(fl_comm_reduce_scatter(c, a, b + off, 101, FL_F32, FL_COMM_SUM));
    FL_TRY(fl_comm_all_gather(c, h + off, h, 101, FL_BF16));
    FL_TRY(fl_comm_broadcast(c, a, 101, FL_F32, 2));
    FL_TRY(fl_comm_barrier(c));
    fl_comm_get_traffic(c, &x->t[rank]);
    return FL_OK;
}

FL_TEST(comm_traffic_counts) {
    traffic_ctx x;
    memset(&x, 0, sizeof x);
    FL_REQUIRE_OK(fl_comm_threads_run(3, traffic_rank, &x));
    unsigned long long sent = 0, recv = 0;
    for (int r = 0; r < 3; r++) {
        sent += x.t[r].sent;
        recv += x.t[r].received;
        FL_CHECK(x.t[r].calls[FL_COLL_ALL_REDUCE] == 1 && x.t[r].calls[FL_COLL_BARRIER] == 1);
        FL_CHECK(x.t[r].buffer_bytes[FL_COLL_ALL_GATHER] == 101 * 2);
    }
    const unsigned long long N = 3, n = 101;
    /* all-reduce 2(N-1)n fp32 + reduce-scatter (N-1)n fp32 + all-gather (N-1)n bf16 + broadcast (N-1)n fp32 */
    FL_CHECKF(sent == recv, "sent %llu, received %llu over the ranks", sent, recv);
    FL_CHECKF(sent == 4 * 2 * (N - 1) * n + 4 * (N - 1) * n + 2 * (N - 1) * n + 4 * (N - 1) * n, "sent %llu", sent);
    /* one process moves nothing */
    fl_comm *s1;
    FL_REQUIRE_OK(fl_comm_init_single(&s1));
    float v[5] = {0};
    FL_REQUIRE_OK(fl_comm_all_reduce(s1, v, v, 5, FL_F32, FL_COMM_SUM));
    fl_comm_traffic t1;
    fl_comm_get_traffic(s1, &t1);
    FL_CHECK(t1.sent == 0 && t1.received == 0 && t1.calls[FL_COLL_ALL_REDUCE] == 1);
    fl_comm_destroy(s1);
}

/* ---- sub-communicators (fl_comm_split) --------------------------------------------------------- */

/* 6 ranks as 2 "nodes" of 3 (color rank / 3) and 3 replica groups (color rank % 3, key -rank: the
 * reversed order), then a split of a split. Integer-valued data: every sum is exact, so the
 * expected values are written out. */
typedef struct {
    int bad[6];
    char msg[6][256];
    fl_comm_traffic parent_before[6], parent_after[6], node_t[6];
} split_ctx;

static fl_status split_rank(fl_comm *c, int rank, void *ud) {
    split_ctx *x = ud;
    float v[7];
    for (int i = 0; i < 7; i++) v[i] = (float)(rank * 10 + i);
    FL_TRY(fl_comm_all_reduce(c, v, v, 7, FL_F32, FL_COMM_SUM)); /* some parent traffic first */
    fl_comm_get_traffic(c, &x->parent_before[rank]);
    fl_comm *node = NULL, *rep = NULL, *half = NULL;
    FL_TRY(fl_comm_split(c, rank / 3, rank, &node));
    fl_status s = fl_comm_split(c, rank % 3, -rank, &rep);
    fl_comm_get_traffic(c, &x->parent_after[rank]);
    int n0 = rank / 3 * 3, bad = 0;
#define SPLIT_BAD(cond, ...) do { if (!bad && (cond)) { bad = 1; snprintf(x->msg[rank], sizeof x->msg[rank], __VA_ARGS__); } } while (0)
    if (s == FL_OK) {
        SPLIT_BAD(fl_comm_size(node) != 3 || fl_comm_rank(node) != rank - n0, "node: rank %d of %d", fl_comm_rank(node),
                  fl_comm_size(node));
        /* key -rank: rank 3+j is replica rank 0, rank j rank 1 */
        SPLIT_BAD(fl_comm_size(rep) != 2 || fl_comm_rank(rep) != (rank < 3), "replica: rank %d of %d", fl_comm_rank(rep),
                  fl_comm_size(rep));
        SPLIT_BAD(strcmp(fl_comm_impl_name(node), "threads"), "implementation %s", fl_comm_impl_name(node));
        /* node all-reduce: sum over the node's 3 ranks; replica reduce-scatter: over the two nodes */
        for (int i = 0; i < 7; i++) v[i] = (float)(rank * 10 + i);
        s = fl_comm_all_reduce(node, v, v, 7, FL_F32, FL_COMM_SUM);
        for (int i = 0; s == FL_OK && i < 7; i++)
            SPLIT_BAD(v[i] != (float)(10 * (3 * n0 + 3) + 3 * i), "node sum [%d] = %g", i, v[i]);
        float w[5], mine[3];
        for (int i = 0; i < 5; i++) w[i] = (float)(rank + 100 * i);
        size_t off, len;
        fl_comm_chunk(5, 2, fl_comm_rank(rep), &off, &len);
        if (s == FL_OK) s = fl_comm_reduce_scatter(rep, w, mine, 5, FL_F32, FL_COMM_SUM);
        for (size_t i = 0; s == FL_OK && i < len; i++)
            SPLIT_BAD(mine[i] != (float)(2 * (rank % 3) + 3 + 200 * (off + i)), "replica sum [%zu] = %g", off + i, mine[i]);
        /* broadcast from the node's rank 1; a nested split of the node into {0} and {1, 2} */
        float b = (float)rank;
        if (s == FL_OK) s = fl_comm_broadcast(node, &b, 1, FL_F32, 1);
        SPLIT_BAD(s == FL_OK && b != (float)(n0 + 1), "broadcast gave %g", b);
        if (s == FL_OK) s = fl_comm_split(node, fl_comm_rank(node) > 0, 0, &half);
        if (s == FL_OK) {
            SPLIT_BAD(fl_comm_size(half) != (rank == n0 ? 1 : 2), "nested: size %d", fl_comm_size(half));
            float h = 1;
            s = fl_comm_all_reduce(half, &h, &h, 1, FL_F32, FL_COMM_SUM);
            SPLIT_BAD(s == FL_OK && h != (float)fl_comm_size(half), "nested sum %g", h);
        }
        fl_comm_get_traffic(node, &x->node_t[rank]);
    }
#undef SPLIT_BAD
    x->bad[rank] = bad;
    fl_comm_destroy(half);
    fl_comm_destroy(rep);
    fl_comm_destroy(node);
    return s;
}

FL_TEST(comm_threads_split) {
    split_ctx x;
    memset(&x, 0, sizeof x);
    FL_REQUIRE_OK(fl_comm_threads_run(6, split_rank, &x));
    for (int r = 0; r < 6; r++) {
        FL_CHECKF(!x.bad[r], "rank %d: %s", r, x.msg[r]);
        /* the split's own exchange is not training traffic; the node counts its own collectives */
        FL_CHECK(!memcmp(&x.parent_before[r], &x.parent_after[r], sizeof x.parent_after[r]));
        FL_CHECK(x.node_t[r].calls[FL_COLL_ALL_REDUCE] == 1 && x.node_t[r].calls[FL_COLL_BROADCAST] == 1);
        size_t off, len;
        fl_comm_chunk(7, 3, r % 3, &off, &len);
        /* node all-reduce of 7 fp32 (2 x (7 - len + 2 len)) + broadcast of 1 from rank 1 (2 out, or 1 in) */
        unsigned long long want = 4ull * ((7 - len) + 2 * len) + (r % 3 == 1 ? 4ull * 2 : 0);
        FL_CHECKF(x.node_t[r].sent == want, "rank %d: node sent %llu, want %llu", r, x.node_t[r].sent, want);
    }
    /* size 1 splits into size 1 */
    fl_comm *s1, *sub;
    FL_REQUIRE_OK(fl_comm_init_single(&s1));
    FL_REQUIRE_OK(fl_comm_split(s1, 7, 0, &sub));
    FL_CHECK(fl_comm_size(sub) == 1 && fl_comm_rank(sub) == 0);
    fl_comm *bad = NULL;
    FL_CHECK(fl_comm_split(s1, -1, 0, &bad) == FL_ERR_INVALID && bad == NULL);
    fl_comm_destroy(sub);
    fl_comm_destroy(s1);
}

/* A rank that aborts on its node's group ends the calls of every rank, whichever group they wait in:
 * 4 ranks as 2 nodes x 2; rank 0 aborts its node group; rank 1 waits there, rank 2 in the replica
 * group {0, 2}, rank 3 in {1, 3} (for rank 1) and the parent would not help any of them. */
typedef struct {
    fl_status st[4];
    char msg[4][1024];
    double t[4];
} split_abort_ctx;

static fl_status split_abort_rank(fl_comm *c, int rank, void *ud) {
    split_abort_ctx *x = ud;
    fl_comm *node = NULL, *rep = NULL;
    FL_TRY(fl_comm_split(c, rank / 2, rank, &node));
    fl_status s = fl_comm_split(c, rank % 2, rank, &rep);
    double t0 = now_s();
    float v[4] = {0};
    if (s == FL_OK) {
        if (rank == 0) {
            usleep(50000);
            fl_comm_abort(node, 3, "test failure on the node group");
        } else if (rank == 1) {
            s = fl_comm_all_reduce(node, v, v, 4, FL_F32, FL_COMM_SUM);
        } else {
            s = fl_comm_all_reduce(rep, v, v, 4, FL_F32, FL_COMM_SUM);
        }
    }
    x->st[rank] = s;
    snprintf(x->msg[rank], sizeof x->msg[rank], "%s", s == FL_OK ? "" : fl_error_message());
    x->t[rank] = now_s() - t0;
    fl_comm_destroy(rep);
    fl_comm_destroy(node);
    return FL_OK;
}

FL_TEST(comm_threads_split_abort) {
    split_abort_ctx x;
    memset(&x, 0, sizeof x);
    FL_REQUIRE_OK(fl_comm_threads_run(4, split_abort_rank, &x));
    for (int r = 1; r < 4; r++) {
        FL_CHECKF(x.st[r] == FL_ERR_IO, "rank %d: status %d", r, x.st[r]);
        FL_CHECKF(strstr(x.msg[r], "rank 0 aborted") && strstr(x.msg[r], "test failure on the node group"), "rank %d: '%s'",
                  r, x.msg[r]);
        FL_CHECKF(x.t[r] < 5, "rank %d took %.1f s to notice", r, x.t[r]);
    }
}

/* The MPI implementation of fl_comm under a real launcher (run by tests/mpi_test.sh):
 *   fitllm_comm_mpi_test [check]  every case of tests/comm_ref.h at this world size, each checked
 *                                  against the specification (bits) and float64 (derived bound),
 *                                  against the threads implementation run in this process on the
 *                                  same inputs (bits), and against a second run (bits); async
 *                                  requests in any order; a 12 MB all-reduce; scratch in a pool.
 *   fitllm_comm_mpi_test abort    the last rank calls fl_comm_abort while the others wait in a
 *                                  barrier: the launcher must end every rank, non-zero.
 *   fitllm_comm_mpi_test die      the last rank exits(7) without a word while the others wait.
 * Prints "comm mpi test: N ranks, C checks, F failures" on rank 0; exit status 1 on failure. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm_p2p_ref.h"
#include "comm_ref.h"
#include "pp_toy_ref.h"
#include "fitllm/comm.h"
#include "fitllm/mem.h"

static int g_checks, g_fails;

#define CHECK(cond, ...)                                                                   \
    do {                                                                                   \
        g_checks++;                                                                        \
        if (!(cond)) {                                                                     \
            g_fails++;                                                                     \
            fprintf(stderr, "rank %d: FAIL %s:%d: ", g_rank, __FILE__, __LINE__);         \
            fprintf(stderr, __VA_ARGS__);                                                  \
            fputc('\n', stderr);                                                           \
        }                                                                                  \
    } while (0)

static int g_rank;

typedef struct {
    const cr_case *cs;
    void **in, **out;
} case_ctx;

static fl_status run_case_rank(fl_comm *c, int rank, void *p) {
    case_ctx *x = p;
    return cr_run(c, x->cs, x->in[rank], x->out[rank]);
}

static void check_cases(fl_comm *c) {
    int n = fl_comm_size(c), r = fl_comm_rank(c);
    int m = cr_cases(n, NULL);
    cr_case *cases = malloc((size_t)m * sizeof *cases);
    cr_cases(n, cases);
    double worst = 0;
    for (int k = 0; k < m; k++) {
        const cr_case *cs = &cases[k];
        size_t es = fl_dtype_size(cs->dt);
        char label[256];
        cr_label(cs, n, label, sizeof label);
        void **in = calloc((size_t)n, sizeof *in), **tout = calloc((size_t)n, sizeof *tout);
        for (int q = 0; q < n; q++) {
            in[q] = malloc(cs->count * es + 1);
            tout[q] = malloc(cs->count * es + 1);
            cr_input(cs, q, in[q]);
        }
        size_t on = cr_out_count(cs, n, r);
        void *out = malloc(cs->count * es + 1), *out2 = malloc(cs->count * es + 1);
        fl_status s = cr_run(c, cs, in[r], out);
        CHECK(s == FL_OK, "%s: %s", label, fl_error_message());
        if (s == FL_OK) {
            CHECK(cr_check(label, cs, n, r, (const void *const *)in, out, &worst) == 0, "%s: wrong result", label);
            s = cr_run(c, cs, in[r], out2);
            CHECK(s == FL_OK && !memcmp(out, out2, on * es), "%s: a second run gave other bits", label);
            case_ctx x = {cs, in, tout};
            s = fl_comm_threads_run(n, run_case_rank, &x);
            CHECK(s == FL_OK, "%s (threads): %s", label, fl_error_message());
            CHECK(s != FL_OK || !memcmp(out, tout[r], on * es), "%s: MPI and threads bits differ", label);
        }
        for (int q = 0; q < n; q++) {
            free(in[q]);
            free(tout[q]);
        }
        free(in);
        free(tout);
        free(out);
        free(out2);
    }
    if (r == 0) printf("comm mpi test: %d cases at %d ranks, worst error / bound %.3f\n", m, n, worst);
    free(cases);
}

/* Several requests in flight, completed in reverse order (rank 0), by polling (rank 1) or in
 * order; the results must equal the blocking calls' bits. */
static void check_async(fl_comm *c) {
    int n = fl_comm_size(c), r = fl_comm_rank(c);
    enum { K = 12, LEN = 3001 };
    cr_case cs[K];
    void *in[K], *out[K], *ref[K];
    fl_comm_req *req[K];
    for (int k = 0; k < K; k++) {
        fl_dtype dt = (k / 4) % 3 == 0 ? FL_BF16 : (k / 4) % 3 == 1 ? FL_F16 : FL_F32; /* every kind in each */
        cs[k] = (cr_case){(fl_coll_kind)(k % 4), LEN + k, dt, (fl_comm_op)(k % 3), k % n, 0};
        size_t es = fl_dtype_size(cs[k].dt);
        in[k] = malloc(cs[k].count * es);
        out[k] = malloc(cs[k].count * es);
        ref[k] = malloc(cs[k].count * es);
        cr_input(&cs[k], r, in[k]);
        CHECK(cr_run(c, &cs[k], in[k], ref[k]) == FL_OK, "async reference %d: %s", k, fl_error_message());
    }
    for (int k = 0; k < K; k++) {
        size_t off, len, es = fl_dtype_size(cs[k].dt);
        fl_comm_chunk(cs[k].count, n, r, &off, &len);
        fl_status s;
        switch (cs[k].kind) {
        case FL_COLL_ALL_REDUCE: s = fl_comm_iall_reduce(c, in[k], out[k], cs[k].count, cs[k].dt, cs[k].op, &req[k]); break;
        case FL_COLL_REDUCE_SCATTER:
            s = fl_comm_ireduce_scatter(c, in[k], out[k], cs[k].count, cs[k].dt, cs[k].op, &req[k]);
            break;
        case FL_COLL_ALL_GATHER:
            s = fl_comm_iall_gather(c, (char *)in[k] + off * es, out[k], cs[k].count, cs[k].dt, &req[k]);
            break;
        default:
            memcpy(out[k], in[k], cs[k].count * es);
            s = fl_comm_ibroadcast(c, out[k], cs[k].count, cs[k].dt, cs[k].root, &req[k]);
        }
        CHECK(s == FL_OK, "async post %d: %s", k, fl_error_message());
    }
    if (r == 0) {
        for (int k = K - 1; k >= 0; k--) CHECK(fl_comm_wait(&req[k]) == FL_OK, "wait %d: %s", k, fl_error_message());
    } else if (r == 1) {
        int left = K;
        while (left)
            for (int k = 0; k < K; k++) {
                if (!req[k]) continue;
                int done = 0;
                fl_status s = fl_comm_test(&req[k], &done);
                CHECK(s == FL_OK, "test %d: %s", k, fl_error_message());
                if (done) left--;
            }
    } else {
        CHECK(fl_comm_wait_all(req, K) == FL_OK, "wait_all: %s", fl_error_message());
    }
    /* a barrier with nothing outstanding, then one while a request is pending */
    CHECK(fl_comm_barrier(c) == FL_OK, "barrier: %s", fl_error_message());
    {
        float v[5] = {1, 2, 3, 4, (float)r}, w[5];
        fl_comm_req *q, *q2;
        CHECK(fl_comm_iall_reduce(c, v, w, 5, FL_F32, FL_COMM_SUM, &q) == FL_OK, "post: %s", fl_error_message());
        CHECK(fl_comm_iall_reduce(c, v, v, 5, FL_F32, FL_COMM_MAX, &q2) == FL_OK, "post: %s", fl_error_message());
        CHECK(fl_comm_barrier(c) == FL_OK, "barrier with requests pending: %s", fl_error_message());
        CHECK(fl_comm_wait(&q2) == FL_OK && fl_comm_wait(&q) == FL_OK, "wait: %s", fl_error_message());
        CHECK(w[0] == n && w[3] == 4 * n && w[4] == n * (n - 1) / 2 && v[4] == n - 1, "pending all_reduce results");
    }
    for (int k = 0; k < K; k++) {
        size_t es = fl_dtype_size(cs[k].dt);
        CHECK(!memcmp(out[k], ref[k], cr_out_count(&cs[k], n, r) * es), "async request %d: bits differ from blocking", k);
        free(in[k]);
        free(out[k]);
        free(ref[k]);
    }
}

/* A 12 MB all-reduce (several reduction blocks per chunk, messages of MBs) against threads. */
static void check_large(fl_comm *c) {
    int n = fl_comm_size(c), r = fl_comm_rank(c);
    cr_case cs = {FL_COLL_ALL_REDUCE, 3000001, FL_F32, FL_COMM_SUM, 0, 1};
    void **in = calloc((size_t)n, sizeof *in), **tout = calloc((size_t)n, sizeof *tout);
    for (int q = 0; q < n; q++) {
        in[q] = malloc(cs.count * 4);
        tout[q] = malloc(cs.count * 4);
        cr_input(&cs, q, in[q]);
    }
    float *out = malloc(cs.count * 4);
    CHECK(cr_run(c, &cs, in[r], out) == FL_OK, "large: %s", fl_error_message());
    case_ctx x = {&cs, in, tout};
    CHECK(fl_comm_threads_run(n, run_case_rank, &x) == FL_OK, "large (threads): %s", fl_error_message());
    CHECK(!memcmp(out, tout[r], cs.count * 4), "large all_reduce: MPI and threads bits differ");
    CHECK(cr_check("large", &cs, n, r, (const void *const *)in, out, NULL) == 0, "large all_reduce: wrong result");
    for (int q = 0; q < n; q++) {
        free(in[q]);
        free(tout[q]);
    }
    free(in);
    free(tout);
    free(out);
}

/* Scratch comes from the pool while a reduction is pending, as fl_comm_scratch_bytes says. */
static void check_pool(fl_comm *c) {
    fl_mem_pool pool;
    CHECK(fl_mem_pool_init(&pool, "comm", 0) == FL_OK, "pool init");
    fl_comm_set_pool(c, &pool);
    size_t count = 1001;
    uint16_t *a = calloc(count, 2);
    for (int k = 0; k < 2; k++) { /* BF16 and F16 (16-true's gradients): 2 bytes an element */
        fl_dtype dt = k ? FL_F16 : FL_BF16;
        fl_comm_req *q;
        CHECK(fl_comm_iall_reduce(c, a, a, count, dt, FL_COMM_SUM, &q) == FL_OK, "pool: %s", fl_error_message());
        size_t want = fl_comm_scratch_bytes(c, FL_COLL_ALL_REDUCE, count, dt), off, len;
        fl_comm_chunk(count, fl_comm_size(c), fl_comm_rank(c), &off, &len);
        CHECK(want == (size_t)(fl_comm_size(c) - 1) * len * 2, "scratch formula %zu", want);
        CHECK(pool.cur[FL_TAG_WORKSPACE] == want, "pool WORKSPACE %zu while pending, want %zu", pool.cur[FL_TAG_WORKSPACE],
              want);
        CHECK(fl_comm_wait(&q) == FL_OK, "pool wait: %s", fl_error_message());
        CHECK(pool.cur[FL_TAG_WORKSPACE] == 0, "pool WORKSPACE %zu after wait", pool.cur[FL_TAG_WORKSPACE]);
    }
    fl_comm_set_pool(c, NULL);
    fl_mem_pool_free(&pool);
    free(a);
}

/* fl_comm_split: colors rank % 2 with key -rank (the reversed order), sums inside each part (exact
 * integers), the parent's traffic untouched by the split, a broadcast from the part's rank 0. */
static void check_split(fl_comm *c) {
    int n = fl_comm_size(c), me = fl_comm_rank(c);
    fl_comm_traffic before, after;
    fl_comm_get_traffic(c, &before);
    fl_comm *p = NULL;
    fl_status s = fl_comm_split(c, me % 2, -me, &p);
    fl_comm_get_traffic(c, &after);
    CHECK(s == FL_OK, "split: %s", fl_error_message());
    if (s != FL_OK) return;
    CHECK(!memcmp(&before, &after, sizeof after), "the split counted as traffic");
    int size = (n - me % 2 + 1) / 2, want_rank = (n - 1 - me) / 2; /* ranks of my parity, highest first */
    CHECK(fl_comm_size(p) == size && fl_comm_rank(p) == want_rank && !strcmp(fl_comm_impl_name(p), "mpi"),
          "split: rank %d of %d (%s), want %d of %d", fl_comm_rank(p), fl_comm_size(p), fl_comm_impl_name(p), want_rank, size);
    CHECK(fl_comm_local_size(p) >= 1 && fl_comm_local_rank(p) < fl_comm_local_size(p), "split: local %d of %d",
          fl_comm_local_rank(p), fl_comm_local_size(p));
    float v[3] = {(float)me, 1, (float)(me * me)}, want[3] = {0, 0, 0};
    for (int r = me % 2; r < n; r += 2) want[0] += (float)r, want[1] += 1, want[2] += (float)(r * r);
    s = fl_comm_all_reduce(p, v, v, 3, FL_F32, FL_COMM_SUM);
    CHECK(s == FL_OK && v[0] == want[0] && v[1] == want[1] && v[2] == want[2], "split sum %g %g %g", v[0], v[1], v[2]);
    float b = (float)me;
    s = fl_comm_broadcast(p, &b, 1, FL_F32, 0);
    int top = n - 1 - ((n - 1 - me) % 2); /* the highest rank of my parity: the part's rank 0 */
    CHECK(s == FL_OK && b == (float)top, "split broadcast %g, want %d", b, top);
    fl_comm_traffic t;
    fl_comm_get_traffic(p, &t);
    CHECK(t.calls[FL_COLL_ALL_REDUCE] == 1 && t.calls[FL_COLL_BROADCAST] == 1, "split traffic calls");
    fl_comm_destroy(p);
}

/* the toy pipeline of tests/pp_toy_ref.h with one stage per process: this stage's gradient rows and (last stage)
 * the losses equal the single process's bit for bit, under both schedules */
static void check_pipeline(fl_comm *c) {
    static toy T;
    float ref_grad[TL][TD], ref_loss[TM];
    const int n = fl_comm_size(c), r = fl_comm_rank(c);
    int first[TL + 1];
    if (n > TL || fl_pp_split(TL, NULL, n, first) != FL_OK) return;
    for (int k = 0; k < FL_PP_SCHEDULE_COUNT; k++) {
        toy_init(&T);
        toy_single(&T, ref_grad, ref_loss);
        T.kind = (fl_pp_schedule)k;
        T.S = n;
        fl_status s = toy_rank(c, r, &T);
        CHECK(s == FL_OK, "pipeline %s: %s", fl_pp_schedule_name(k), fl_error_message());
        const size_t rows = (size_t)(first[r + 1] - first[r]) * sizeof T.grad[0];
        CHECK(!memcmp(T.grad[first[r]], ref_grad[first[r]], rows), "pipeline %s: stage %d's gradients differ",
              fl_pp_schedule_name(k), r);
        if (r == n - 1) CHECK(!memcmp(T.loss, ref_loss, sizeof ref_loss), "pipeline %s: losses differ", fl_pp_schedule_name(k));
    }
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "check";
    fl_comm *c;
    if (fl_comm_init(&c, &argc, &argv) != FL_OK) {
        fprintf(stderr, "comm_mpi_test: %s\n", fl_error_message());
        return 1;
    }
    g_rank = fl_comm_rank(c);
    int n = fl_comm_size(c);
    if (!strcmp(mode, "abort") || !strcmp(mode, "die") || !strcmp(mode, "abort_split")) {
        float v = 1;
        if (fl_comm_all_reduce(c, &v, &v, 1, FL_F32, FL_COMM_SUM) != FL_OK) return 1;
        /* abort_split: the last rank aborts on a sub-communicator (ranks of its parity); the whole job ends */
        fl_comm *part = NULL;
        if (!strcmp(mode, "abort_split") && fl_comm_split(c, g_rank % 2, g_rank, &part) != FL_OK) return 1;
        if (g_rank == n - 1) {
            usleep(200000); /* the others are in the barrier by now */
            if (!strcmp(mode, "die")) _exit(7);
            fl_comm_abort(part ? part : c, 3, "abort test: the last rank gives up");
            fprintf(stderr, "rank %d: fl_comm_abort returned\n", g_rank);
            return 0;
        }
        if (part) (void)fl_comm_barrier(part); /* the last rank's part waits for it; the other part goes on */
        fl_status s = fl_comm_barrier(c);
        fprintf(stderr, "rank %d: barrier returned %d after the last rank left (%s)\n", g_rank, (int)s, fl_error_message());
        fl_comm_destroy(c);
        return 0;
    }
    CHECK(!strcmp(fl_comm_impl_name(c), n > 1 ? "mpi" : "single"), "implementation %s at %d ranks", fl_comm_impl_name(c), n);
    CHECK(fl_comm_local_size(c) >= 1 && fl_comm_local_rank(c) >= 0 && fl_comm_local_rank(c) < fl_comm_local_size(c),
          "local rank %d of %d", fl_comm_local_rank(c), fl_comm_local_size(c));
    CHECK(c->launch.kind == FL_LAUNCH_OPENMPI || n == 1, "launcher %s", fl_launch_kind_name(c->launch.kind));
    check_cases(c);
    check_async(c);
    check_large(c);
    check_pool(c);
    check_split(c);
    if (n > 1) { /* point to point: the cases the threads implementation passes (tests/comm_p2p_ref.h) */
        char err[512] = "";
        int pf = cp_exercise(c, err, sizeof err);
        CHECK(pf == 0, "point to point: %d failures: %s", pf, err);
        check_pipeline(c);
    }
    /* everyone's verdict: the maximum of the failure counts */
    float f = (float)g_fails, fmax = 0, chk = (float)g_checks, csum = 0;
    if (fl_comm_all_reduce(c, &f, &fmax, 1, FL_F32, FL_COMM_MAX) != FL_OK ||
        fl_comm_all_reduce(c, &chk, &csum, 1, FL_F32, FL_COMM_SUM) != FL_OK) {
        fprintf(stderr, "rank %d: final reduction: %s\n", g_rank, fl_error_message());
        return 1;
    }
    if (g_rank == 0)
        printf("comm mpi test: %d ranks (%s), %.0f checks, %.0f failures (most on one rank)\n", n, fl_comm_mpi_library(), csum,
               fmax);
    fl_comm_destroy(c);
    return fmax > 0 ? 1 : 0;
}

/* Tensor parallelism with the ranks as MPI processes (run by tests/mpi_test.sh under mpirun -np 2 and 4):
 *   fitllm_tp_mpi_test
 * tests/tp_ref.h's scenarios (the golden LLaMA with GQA at 2 ranks, GPT-2 and OPT at 2 and 4; their 257 tokens as
 * uneven vocabulary slices): every rank runs
 * its slice over MPI; rank 0 then runs the single process and the same group as threads in its own process,
 * checks tp_ref.h's bounds and that MPI gave the threads' bits (losses of every rank, the re-assembled
 * gradient and parameters: fl_comm's MPI and threads implementations are bit-exact twins).
 * Prints "tp mpi test: N ranks, C checks, F failures" on rank 0; exit status 1 on failure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../tp_ref.h"
#include "fitllm/comm.h"

static int g_rank, g_checks, g_fails;

static void check_cb(int ok, const char *msg) {
    g_checks++;
    if (!ok) {
        g_fails++;
        fprintf(stderr, "rank %d: FAIL %s\n", g_rank, msg);
    }
}
#define CHECK(cond, ...)                                      \
    do {                                                      \
        char m_[700];                                         \
        snprintf(m_, sizeof m_, __VA_ARGS__);                 \
        check_cb(!!(cond), m_);                               \
    } while (0)

static int alloc_job(tp_job *j, const char *dir, size_t n) {
    memset(j, 0, sizeof *j);
    j->dir = dir;
    j->backend = getenv("FITLLM_TEST_BACKEND") ? getenv("FITLLM_TEST_BACKEND") : "cpu";
    j->grad = malloc(n * sizeof(float));
    j->params = malloc(n * sizeof(float));
    return j->grad && j->params;
}

static void scenario(fl_comm *c, const char *dir) {
    const int N = fl_comm_size(c);
    char cfgp[600];
    snprintf(cfgp, sizeof cfgp, "%s/config.json", dir);
    fl_model_config cfg;
    CHECK(fl_hf_load_config(cfgp, &cfg) == FL_OK && fl_config_validate(&cfg) == FL_OK, "%s: %s", cfgp, fl_error_message());
    const size_t n = fl_sizing_param_count(&cfg);
    tp_job *mpi = malloc(sizeof *mpi);
    CHECK(mpi && alloc_job(mpi, dir, n), "out of memory");
    fl_status s = tp_rank_run(c, g_rank, mpi);
    CHECK(s == FL_OK, "%s TP %d over MPI, rank %d: %s", dir, N, g_rank, mpi->msg[g_rank]);
    /* a rank that failed ends the job (the CLI's pattern: MPI_Abort; its peers may wait in a collective) */
    if (s != FL_OK) fl_comm_abort(c, 1, mpi->msg[g_rank]);
    /* every rank's losses to rank 0, as bits (an all-gather moves bits) */
    double all[TP_MAX_RANKS][TP_STEPS];
    CHECK(fl_comm_all_gather(c, mpi->loss[g_rank], all, (size_t)N * TP_STEPS * 2, FL_F32) == FL_OK, "gathering losses");
    if (g_rank == 0 && s == FL_OK) {
        memcpy(mpi->loss, all, sizeof(double) * TP_STEPS * (size_t)N);
        tp_job *one = malloc(sizeof *one), *thr = malloc(sizeof *thr);
        CHECK(one && thr && alloc_job(one, dir, n) && alloc_job(thr, dir, n), "out of memory");
        fl_comm *single;
        CHECK(fl_comm_init_single(&single) == FL_OK, "single: %s", fl_error_message());
        CHECK(tp_rank_run(single, 0, one) == FL_OK, "%s one process: %s", dir, one->msg[0]);
        fl_comm_destroy(single);
        CHECK(fl_comm_threads_run(N, tp_rank_run, thr) == FL_OK, "%s TP %d as threads: %s", dir, N, fl_error_message());
        g_fails += tp_check(one, mpi, N, check_cb);
        g_checks++;
        CHECK(!memcmp(mpi->loss, thr->loss, sizeof(double) * TP_STEPS * (size_t)N), "%s TP %d: MPI's losses differ from the "
              "threads'", dir, N);
        CHECK(!memcmp(mpi->grad, thr->grad, n * sizeof(float)) && !memcmp(mpi->params, thr->params, n * sizeof(float)),
              "%s TP %d: MPI's gradient or parameters differ from the threads' bits", dir, N);
        free(one->grad), free(one->params), free(thr->grad), free(thr->params), free(one), free(thr);
    }
    if (mpi) free(mpi->grad), free(mpi->params), free(mpi);
}

int main(int argc, char **argv) {
    fl_comm *c;
    if (fl_comm_init(&c, &argc, &argv) != FL_OK) {
        fprintf(stderr, "tp_mpi_test: %s\n", fl_error_message());
        return 1;
    }
    g_rank = fl_comm_rank(c);
    const int n = fl_comm_size(c);
    if (n == 2) scenario(c, "tests/fixtures/golden-llama"); /* 6 heads, 2 key/value heads */
    scenario(c, "tests/fixtures/golden-gpt2");
    scenario(c, "tests/fixtures/golden-opt");
    float f = (float)g_fails, fmax = 0, chk = (float)g_checks, csum = 0;
    if (fl_comm_all_reduce(c, &f, &fmax, 1, FL_F32, FL_COMM_MAX) != FL_OK ||
        fl_comm_all_reduce(c, &chk, &csum, 1, FL_F32, FL_COMM_SUM) != FL_OK) {
        fprintf(stderr, "rank %d: final reduction: %s\n", g_rank, fl_error_message());
        return 1;
    }
    if (g_rank == 0) printf("tp mpi test: %d ranks, %.0f checks, %.0f failures (most on one rank)\n", n, csum, fmax);
    fl_comm_destroy(c);
    return fmax > 0;
}

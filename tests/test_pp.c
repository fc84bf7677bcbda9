/* Pipeline parallelism's building blocks (fitllm/pp.h): the schedules' invariants against their definitions, the
 * stage split against a brute-force search, and the toy pipeline of tests/pp_toy_ref.h over the threads communicator (activations and
 * gradients by fl_comm_send / fl_comm_recv) whose losses and gradients equal the single process's bit for bit. */
#include <math.h>
#include <string.h>

#include "fitllm/comm.h"
#include "fitllm/pp.h"
#include "pp_toy_ref.h"
#include "test.h"

FL_TEST(pp_schedule_invariants) {
    fl_pp_op ops[64];
    for (int k = 0; k < FL_PP_SCHEDULE_COUNT; k++)
        for (int S = 1; S <= 5; S++)
            for (int M = 1; M <= 8; M++)
                for (int s = 0; s < S; s++) {
                    FL_REQUIRE_OK(fl_pp_schedule_ops((fl_pp_schedule)k, S, s, M, ops));
                    int fseen = 0, bseen = 0, bad = 0;
                    for (int i = 0; i < 2 * M; i++) {
                        if (ops[i].kind == FL_PP_FWD) bad |= ops[i].mb != fseen++;      /* forwards in order */
                        else bad |= ops[i].mb != bseen++ || ops[i].mb >= fseen;        /* backwards in order, after their forward */
                    }
                    FL_CHECKF(!bad && fseen == M && bseen == M, "%s S %d s %d M %d: order", fl_pp_schedule_name(k), S, s, M);
                    const int want = k == FL_PP_GPIPE ? M : (S - s < M ? S - s : M);
                    FL_CHECKF(fl_pp_in_flight(ops, 2 * M) == want, "%s S %d s %d M %d: %d in flight, want %d",
                              fl_pp_schedule_name(k), S, s, M, fl_pp_in_flight(ops, 2 * M), want);
                }
    FL_CHECK(fl_pp_schedule_ops(FL_PP_1F1B, 2, 2, 4, ops) == FL_ERR_INVALID);
    FL_CHECK(fl_pp_schedule_ops(FL_PP_1F1B, 2, 0, 0, ops) == FL_ERR_INVALID);
    fl_pp_schedule k;
    FL_CHECK(fl_pp_schedule_parse("1f1b", &k) == FL_OK && k == FL_PP_1F1B);
    FL_CHECK(fl_pp_schedule_parse("interleaved", &k) == FL_ERR_INVALID && strstr(fl_error_message(), "gpipe or 1f1b"));
}

/* the smallest largest-stage cost over every contiguous split (brute force over the boundaries) */
static double brute(int n, const double *cost, int S, int from, int s) {
    if (s == S - 1) {
        double a = 0;
        for (int i = from; i < n; i++) a += cost[i];
        return a;
    }
    double best = INFINITY, a = 0;
    for (int j = from; j < n - (S - s - 1); j++) {
        a += cost[j];
        double rest = brute(n, cost, S, j + 1, s + 1), m = a > rest ? a : rest;
        if (m < best) best = m;
    }
    return best;
}

FL_TEST(pp_split_balanced) {
    int first[11]; /* stages + 1 entries, stages up to 10 below */
    FL_REQUIRE_OK(fl_pp_split(7, NULL, 3, first));
    FL_CHECKF(first[0] == 0 && first[1] == 1 && first[2] == 4 && first[3] == 7, "%d %d %d %d", first[0], first[1],
              first[2], first[3]);
    unsigned z = 12345;
    for (int trial = 0; trial < 200; trial++) {
        double cost[10];
        const int n = 1 + trial % 10, S = 1 + (trial / 10) % n;
        for (int i = 0; i < n; i++) cost[i] = (z = z * 1103515245u + 12345u) >> 28;
        FL_REQUIRE_OK(fl_pp_split(n, cost, S, first));
        double worst = 0;
        int ok = first[0] == 0 && first[S] == n;
        for (int s = 0; s < S; s++) {
            double a = 0;
            ok &= first[s + 1] > first[s];
            for (int i = first[s]; i < first[s + 1]; i++) a += cost[i];
            if (a > worst) worst = a;
        }
        FL_CHECKF(ok && worst == brute(n, cost, S, 0, 0), "trial %d: n %d S %d: worst %g, optimum %g", trial, n, S, worst,
                  brute(n, cost, S, 0, 0));
    }
    FL_CHECK(fl_pp_split(4, NULL, 5, first) == FL_ERR_INVALID);
    FL_CHECKF(strstr(fl_error_message(), "--pipeline_parallel 5: the model has 4 layers"), "'%s'", fl_error_message());
    double badc[2] = {1, NAN};
    FL_CHECK(fl_pp_split(2, badc, 1, first) == FL_ERR_INVALID && strstr(fl_error_message(), "layer 1's cost"));
}

FL_TEST(pp_toy_pipeline_equals_single_process) {
    static toy T;
    float ref_grad[TL][TD], ref_loss[TM];
    toy_init(&T);
    toy_single(&T, ref_grad, ref_loss);
    for (int k = 0; k < FL_PP_SCHEDULE_COUNT; k++)
        for (int S = 2; S <= 4; S++) {
            memset(T.grad, 0, sizeof T.grad);
            memset(T.loss, 0, sizeof T.loss);
            T.kind = (fl_pp_schedule)k;
            T.S = S;
            FL_REQUIRE_OK(fl_comm_threads_run(S, toy_rank, &T));
            FL_CHECKF(!memcmp(T.grad, ref_grad, sizeof ref_grad), "%s, %d stages: gradients differ",
                      fl_pp_schedule_name(k), S);
            FL_CHECKF(!memcmp(T.loss, ref_loss, sizeof ref_loss), "%s, %d stages: losses differ", fl_pp_schedule_name(k), S);
        }
}

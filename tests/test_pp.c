/* Pipeline parallelism's building blocks (fitllm/pp.h): the schedules' invariants against their definitions, the
 * stage split against a brute-force search, and the toy pipeline of tests/pp_toy_ref.h over the threads communicator (activations and
 * gradients by fl_comm_send / fl_comm_recv) whose losses and gradients equal the single process's bit for bit. */
#include <math.h>
#include <string.h>

#include "fitllm/comm.h"
#include "fitllm/model.h"
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
        }    /* the interleaved schedule over virtual stages: 2 stages of 2 and 3 chunks, 3 stages of 2 chunks (7 layers in 4
     * or 6 virtual stages; 6 micro-batches): the same bits, each chunk accumulating in micro-batch order */
    const int sv[3][2] = {{2, 2}, {2, 3}, {3, 2}};
    for (int i = 0; i < 3; i++) {
        memset(T.grad, 0, sizeof T.grad);
        memset(T.loss, 0, sizeof T.loss);
        T.kind = FL_PP_INTERLEAVED;
        T.S = sv[i][0], T.V = sv[i][1];
        FL_REQUIRE_OK(fl_comm_threads_run(T.S, toy_rank, &T));
        FL_CHECKF(!memcmp(T.grad, ref_grad, sizeof ref_grad) && !memcmp(T.loss, ref_loss, sizeof ref_loss),
                  "interleaved, %d stages of %d chunks: gradients or losses differ", T.S, T.V);
    }
}

/* the schedule simulated on per-stage times: equal stages take (M + S - 1)(f + b) with a bubble of (S - 1) /
 * (M + S - 1) under both schedules (the textbook figures), and an unequal pair's GPipe step worked by hand */
FL_TEST(pp_simulate_bubble) {
    double f[5] = {1, 1, 1, 1, 1}, b[5] = {2, 2, 2, 2, 2}, span, bub;
    for (int k = 0; k < FL_PP_SCHEDULE_COUNT; k++)
        for (int S = 1; S <= 5; S++)
            for (int M = 1; M <= 8; M++) {
                FL_REQUIRE_OK(fl_pp_simulate((fl_pp_schedule)k, S, M, f, b, &span, &bub));
                const double want = (M + S - 1) * 3.0, wb = (S - 1) / (double)(M + S - 1);
                FL_CHECKF(span == want && fabs(bub - wb) < 1e-12, "%s S %d M %d: step %g (want %g), bubble %g (want %g)",
                          fl_pp_schedule_name(k), S, M, span, want, bub, wb);
            }
    /* stage 0 forward 1, backward 2; stage 1 twice as slow; 4 micro-batches, GPipe: stage 1's forwards end at 3, 5,
     * 7, 9, its backwards at 13, 17, 21, 25, stage 0's backwards at 15, 19, 23, 27; busy 4 x (3 + 6) of 2 x 27 */
    double f2[2] = {1, 2}, b2[2] = {2, 4};
    FL_REQUIRE_OK(fl_pp_simulate(FL_PP_GPIPE, 2, 4, f2, b2, &span, &bub));
    FL_CHECKF(span == 27 && fabs(bub - 1.0 / 3) < 1e-12, "unequal GPipe: step %g (want 27), bubble %g (want 1/3)", span, bub);
    FL_REQUIRE_OK(fl_pp_simulate(FL_PP_1F1B, 2, 4, f2, b2, &span, &bub));
    FL_CHECKF(span == 27, "unequal 1F1B: step %g (want 27: stage 1 is busy from 1 to 25 either way)", span);
    b2[1] = -1;
    FL_CHECK(fl_pp_simulate(FL_PP_GPIPE, 2, 4, f2, b2, &span, &bub) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "stage 1's times"));
    FL_CHECK(fl_pp_simulate(FL_PP_GPIPE, 0, 4, f2, b2, &span, &bub) == FL_ERR_INVALID);
}

/* the planner's per-block costs: they add up to the model's training FLOPs (fl_model_train_flops of one sequence),
 * every block alike but the last, which carries lm_head's (the count of no blocks); a head as heavy as three blocks
 * leaves the last stage one block where a split by count gives it two; the estimate's stage times are the split's
 * costs in block units (a third forward) and its step is the schedule simulated on them */
FL_TEST(pp_split_by_block_cost) {
    fl_model_config c;
    FL_REQUIRE_OK(fl_preset_find("micro", &c));
    const int T = 48;
    double cost[64], sum = 0;
    fl_pp_block_costs(&c, T, cost);
    for (int i = 0; i < c.n_layers; i++) sum += cost[i];
    fl_model_config none = c;
    none.n_layers = 0;
    const double head = fl_model_train_flops(&none, 1, T), whole = fl_model_train_flops(&c, 1, T);
    FL_CHECKF(fabs(sum - whole) <= 1e-12 * whole, "costs sum %.17g, the model's FLOPs %.17g", sum, whole);
    for (int i = 1; i + 1 < c.n_layers; i++) FL_CHECK(cost[i] == cost[0]);
    FL_CHECKF(fabs(cost[c.n_layers - 1] - cost[0] - head) <= 1e-9 * head, "last block %g, a block %g, head %g",
              cost[c.n_layers - 1], cost[0], head);
    /* a vocabulary making the head about three blocks: 5 blocks in 3 stages by count [0,1) [1,3) [3,5), by cost the
     * last stage holds block 4 alone */
    fl_model_config big = c;
    big.vocab_size = (int)(3 * cost[0] / (6.0 * T * c.dim));
    int first[5], byc[5];
    FL_REQUIRE_OK(fl_pp_split_model(&big, T, 3, first));
    FL_REQUIRE_OK(fl_pp_split(big.n_layers, NULL, 3, byc));
    FL_CHECKF(byc[2] == 3 && first[2] == 4 && first[3] == 5, "split by count [.., %d, ..), by cost [%d, %d) [%d, %d)",
              byc[2], first[1], first[2], first[2], first[3]);
    fl_pp_estimate e;
    FL_REQUIRE_OK(fl_pp_estimate_step(&big, T, 3, 4, FL_PP_1F1B, &e));
    fl_pp_block_costs(&big, T, cost);
    double tot = 0, f[3], b[3], span, bub;
    for (int s = 0; s < 3; s++) {
        double a = 0;
        for (int i = e.first[s]; i < e.first[s + 1]; i++) a += cost[i] / cost[0];
        FL_CHECKF(fabs(e.fwd[s] + e.bwd[s] - a) <= 1e-12 * a && fabs(e.bwd[s] - 2 * e.fwd[s]) <= 1e-12 * a,
                  "stage %d: %g + %g, cost %g blocks", s, e.fwd[s], e.bwd[s], a);
        f[s] = a / 3, b[s] = 2 * a / 3, tot += a;
    }
    FL_REQUIRE_OK(fl_pp_simulate(FL_PP_1F1B, 3, 4, f, b, &span, &bub));
    FL_CHECKF(fabs(e.one - 4 * tot) <= 1e-9 * tot && fabs(e.step - span) <= 1e-9 * span && e.bubble == bub,
              "one process %g (want %g), step %g (want %g)", e.one, 4 * tot, e.step, span);
    char text[1200];
    FL_REQUIRE_OK(fl_pp_estimate_text(&big, T, 3, 4, FL_PP_1F1B, 2.0, text, sizeof text));
    FL_CHECKF(strstr(text, "[0, 2) [2, 4) [4, 5)") || strstr(text, "[0, 1) [1, 4) [4, 5)"), "'%s'", text);
    FL_CHECKF(strstr(text, " ms") && strchr(text, '\n'), "'%s'", text);
}

/* the interleaved schedule (Megatron-LM's order over virtual stages): each chunk runs every micro-batch's forward
 * and backward once, its forwards and its backwards in micro-batch order (one process's accumulation order), a
 * backward after its forward; a rank keeps min(2 (S - s - 1) + (V - 1) S + 1, M V) chunk-micro-batches in flight;
 * the schedule never deadlocks, and on equal virtual stages (forward 1, backward 2 each) it takes (M V + S - 1) x 3,
 * the bubble (S - 1) / (M V + S - 1): 1/V of 1F1B's idle time (Narayanan et al. 2021) */
FL_TEST(pp_interleaved_schedule) {
    fl_pp_op ops[2 * 12 * 3];
    double f[12], b[12], span, bub;
    for (int i = 0; i < 12; i++) f[i] = 1, b[i] = 2;
    for (int S = 1; S <= 4; S++)
        for (int V = 1; V <= 3; V++)
            for (int M = S; M <= 12; M += S) {
                for (int s = 0; s < S; s++) {
                    FL_REQUIRE_OK(fl_pp_schedule_ops_v(FL_PP_INTERLEAVED, S, V, s, M, ops));
                    int fseen[3] = {0, 0, 0}, bseen[3] = {0, 0, 0}, bad = 0;
                    for (int i = 0; i < 2 * M * V; i++) {
                        const int c = ops[i].chunk;
                        if (c < 0 || c >= V) {
                            bad = 1;
                            break;
                        }
                        if (ops[i].kind == FL_PP_FWD) bad |= ops[i].mb != fseen[c]++;
                        else bad |= ops[i].mb != bseen[c]++ || ops[i].mb >= fseen[c];
                    }
                    for (int c = 0; c < V; c++) bad |= fseen[c] != M || bseen[c] != M;
                    FL_CHECKF(!bad, "interleaved S %d V %d s %d M %d: order", S, V, s, M);
                    int want = 2 * (S - s - 1) + (V - 1) * S + 1;
                    if (want > M * V) want = M * V;
                    FL_CHECKF(fl_pp_in_flight(ops, 2 * M * V) == want, "interleaved S %d V %d s %d M %d: %d in flight, "
                              "want %d", S, V, s, M, fl_pp_in_flight(ops, 2 * M * V), want);
                }
                FL_REQUIRE_OK(fl_pp_simulate_v(FL_PP_INTERLEAVED, S, V, M, f, b, &span, &bub));
                const double want = (M * V + S - 1) * 3.0, wb = (S - 1) / (double)(M * V + S - 1);
                FL_CHECKF(span == want && fabs(bub - wb) < 1e-12, "interleaved S %d V %d M %d: step %g (want %g), "
                          "bubble %g (want %g)", S, V, M, span, want, bub, wb);
            }
    FL_CHECK(fl_pp_schedule_ops_v(FL_PP_INTERLEAVED, 2, 2, 0, 3, ops) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "3 micro-batches (gradient accumulation steps) is not a multiple of the 2 stages"));
    FL_CHECK(fl_pp_schedule_ops_v(FL_PP_1F1B, 2, 2, 0, 4, ops) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "one chunk per rank"));
    FL_CHECK(fl_pp_schedule_ops_v(FL_PP_INTERLEAVED, 2, 0, 0, 4, ops) == FL_ERR_INVALID);
    FL_CHECK(!strcmp(fl_pp_schedule_name(FL_PP_INTERLEAVED), "interleaved"));
}

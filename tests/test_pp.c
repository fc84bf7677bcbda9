/* Pipeline parallelism's building blocks (fitllm/pp.h): the schedules' invariants against their definitions, the
 * stage split against a brute-force search, and a toy pipeline over the threads communicator (activations and
 * gradients by fl_comm_send / fl_comm_recv) whose losses and gradients equal the single process's bit for bit. */
#include <math.h>
#include <string.h>

#include "fitllm/comm.h"
#include "fitllm/pp.h"
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
    int first[9];
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

/* ---- the toy pipeline: L layers y = tanh(w_l * x) elementwise on D floats, loss 0.5 |y - t|^2 / M per
 * micro-batch; gradients of w accumulate over the micro-batches ---------------------------------------------- */
#define TD 16
#define TL 7
#define TM 5

typedef struct {
    float w[TL][TD], x[TM][TD], t[TM][TD];
    float grad[TL][TD], loss[TM]; /* the pipeline's (each stage writes its own layers' rows; the last the losses) */
    fl_pp_schedule kind;
    int S;
} toy;

static void toy_layer_fwd(const float *w, const float *x, float *y) {
    for (int i = 0; i < TD; i++) y[i] = tanhf(w[i] * x[i]);
}
/* dy in, dx out; g += dw */
static void toy_layer_bwd(const float *w, const float *x, const float *y, const float *dy, float *dx, float *g) {
    for (int i = 0; i < TD; i++) {
        const float d = dy[i] * (1.0f - y[i] * y[i]);
        g[i] += d * x[i];
        dx[i] = d * w[i];
    }
}
static float toy_loss(const float *y, const float *t, float *dy) {
    float l = 0;
    for (int i = 0; i < TD; i++) {
        const float e = y[i] - t[i];
        l += 0.5f * e * e;
        dy[i] = e / TM;
    }
    return l / TM;
}

static fl_status toy_rank(fl_comm *c, int s, void *ud) {
    toy *T = ud;
    int first[TL + 1];
    fl_pp_op ops[2 * TM];
    FL_TRY(fl_pp_split(TL, NULL, T->S, first));
    FL_TRY(fl_pp_schedule_ops(T->kind, T->S, s, TM, ops));
    const int l0 = first[s], nl = first[s + 1] - first[s];
    static _Thread_local float acts[TM][TL + 1][TD]; /* per micro-batch: this stage's input and each layer's output */
    float dy[TD], dx[TD];
    for (int k = 0; k < 2 * TM; k++) {
        const int mb = ops[k].mb;
        if (ops[k].kind == FL_PP_FWD) {
            if (s == 0) memcpy(acts[mb][0], T->x[mb], sizeof acts[mb][0]);
            else FL_TRY(fl_comm_recv(c, acts[mb][0], TD, FL_F32, s - 1, 0));
            for (int l = 0; l < nl; l++) toy_layer_fwd(T->w[l0 + l], acts[mb][l], acts[mb][l + 1]);
            if (s < T->S - 1) FL_TRY(fl_comm_send(c, acts[mb][nl], TD, FL_F32, s + 1, 0));
        } else {
            if (s == T->S - 1) T->loss[mb] = toy_loss(acts[mb][nl], T->t[mb], dy);
            else FL_TRY(fl_comm_recv(c, dy, TD, FL_F32, s + 1, 1));
            for (int l = nl - 1; l >= 0; l--) {
                toy_layer_bwd(T->w[l0 + l], acts[mb][l], acts[mb][l + 1], dy, dx, T->grad[l0 + l]);
                memcpy(dy, dx, sizeof dy);
            }
            if (s > 0) FL_TRY(fl_comm_send(c, dy, TD, FL_F32, s - 1, 1));
        }
    }
    return FL_OK;
}

FL_TEST(pp_toy_pipeline_equals_single_process) {
    static toy T;
    float ref_grad[TL][TD] = {{0}}, ref_loss[TM];
    unsigned z = 99;
    memset(&T, 0, sizeof T);
    for (int l = 0; l < TL; l++)
        for (int i = 0; i < TD; i++) T.w[l][i] = 0.5f + (float)((z = z * 1103515245u + 12345u) >> 16) / 65536.0f;
    for (int m = 0; m < TM; m++)
        for (int i = 0; i < TD; i++) {
            T.x[m][i] = (float)((z = z * 1103515245u + 12345u) >> 16) / 32768.0f - 1.0f;
            T.t[m][i] = (float)((z = z * 1103515245u + 12345u) >> 16) / 32768.0f - 1.0f;
        }
    /* the single process: micro-batch after micro-batch, forward then backward */
    for (int m = 0; m < TM; m++) {
        float a[TL + 1][TD], dy[TD], dx[TD];
        memcpy(a[0], T.x[m], sizeof a[0]);
        for (int l = 0; l < TL; l++) toy_layer_fwd(T.w[l], a[l], a[l + 1]);
        ref_loss[m] = toy_loss(a[TL], T.t[m], dy);
        for (int l = TL - 1; l >= 0; l--) {
            toy_layer_bwd(T.w[l], a[l], a[l + 1], dy, dx, ref_grad[l]);
            memcpy(dy, dx, sizeof dy);
        }
    }
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

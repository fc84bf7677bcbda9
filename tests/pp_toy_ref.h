/* A toy pipeline for the pipeline-parallel tests, shared by tests/test_pp.c (threads) and tests/mpi/comm_mpi_test.c
 * (MPI processes): L layers y = tanh(w_l * x) elementwise on D floats, loss 0.5 |y - t|^2 / M per micro-batch,
 * gradients of w accumulated over the micro-batches. toy_single runs the single process (micro-batch after
 * micro-batch); toy_rank runs stage s of a pipeline over c (fitllm/pp.h's split and schedule, activations and their
 * gradients by fl_comm_send / fl_comm_recv). Header-only: include it in one translation unit per program. */
#ifndef FL_TEST_PP_TOY_H
#define FL_TEST_PP_TOY_H

#include <math.h>
#include <string.h>

#include "fitllm/comm.h"
#include "fitllm/pp.h"

#define TD 16
#define TL 7
#define TM 6 /* a multiple of 2 and 3 stages: the interleaved schedule's condition */

typedef struct {
    float w[TL][TD], x[TM][TD], t[TM][TD];
    float grad[TL][TD], loss[TM]; /* the pipeline's (each stage writes its own layers' rows; the last the losses) */
    fl_pp_schedule kind;
    int S, V; /* stages; chunks per stage (interleaved: virtual stage c S + s; 0 means 1) */
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
    const int V = T->V > 0 ? T->V : 1, S = T->S, NV = S * V;
    int first[TL + 1];
    fl_pp_op ops[2 * TM * TL];
    FL_TRY(fl_pp_split(TL, NULL, NV, first));
    FL_TRY(fl_pp_schedule_ops_v(T->kind, S, V, s, TM, ops));
    /* per chunk and micro-batch: the virtual stage's input and each layer's output */
    static _Thread_local float acts[TL][TM][TL + 1][TD];
    float dy[TD], dx[TD];
    for (int k = 0; k < 2 * TM * V; k++) {
        const int mb = ops[k].mb, ch = ops[k].chunk, v = ch * S + s;
        const int l0 = first[v], nl = first[v + 1] - first[v];
        /* a message between virtual stages v and v + 1 travels on tag 2 v' + kind (v' the receiving chunk): each
         * tag's messages arrive in order, and each chunk runs its forwards, and its backwards, in micro-batch order */
        if (ops[k].kind == FL_PP_FWD) {
            if (v == 0) memcpy(acts[ch][mb][0], T->x[mb], sizeof acts[ch][mb][0]);
            else FL_TRY(fl_comm_recv(c, acts[ch][mb][0], TD, FL_F32, (v - 1) % S, 2 * ch));
            for (int l = 0; l < nl; l++) toy_layer_fwd(T->w[l0 + l], acts[ch][mb][l], acts[ch][mb][l + 1]);
            if (v < NV - 1) FL_TRY(fl_comm_send(c, acts[ch][mb][nl], TD, FL_F32, (v + 1) % S, 2 * ((v + 1) / S)));
        } else {
            if (v == NV - 1) T->loss[mb] = toy_loss(acts[ch][mb][nl], T->t[mb], dy);
            else FL_TRY(fl_comm_recv(c, dy, TD, FL_F32, (v + 1) % S, 2 * ch + 1));
            for (int l = nl - 1; l >= 0; l--) {
                toy_layer_bwd(T->w[l0 + l], acts[ch][mb][l], acts[ch][mb][l + 1], dy, dx, T->grad[l0 + l]);
                memcpy(dy, dx, sizeof dy);
            }
            if (v > 0) FL_TRY(fl_comm_send(c, dy, TD, FL_F32, (v - 1) % S, 2 * ((v - 1) / S) + 1));
        }
    }
    return FL_OK;
}

/* deterministic weights, inputs and targets */
static void toy_init(toy *T) {
    unsigned z = 99;
    memset(T, 0, sizeof *T);
    for (int l = 0; l < TL; l++)
        for (int i = 0; i < TD; i++) T->w[l][i] = 0.5f + (float)((z = z * 1103515245u + 12345u) >> 16) / 65536.0f;
    for (int m = 0; m < TM; m++)
        for (int i = 0; i < TD; i++) {
            T->x[m][i] = (float)((z = z * 1103515245u + 12345u) >> 16) / 32768.0f - 1.0f;
            T->t[m][i] = (float)((z = z * 1103515245u + 12345u) >> 16) / 32768.0f - 1.0f;
        }
}

/* the single process: micro-batch after micro-batch, forward then backward */
static void toy_single(const toy *T, float grad[TL][TD], float loss[TM]) {
    memset(grad, 0, sizeof(float) * TL * TD);
    for (int m = 0; m < TM; m++) {
        float a[TL + 1][TD], dy[TD], dx[TD];
        memcpy(a[0], T->x[m], sizeof a[0]);
        for (int l = 0; l < TL; l++) toy_layer_fwd(T->w[l], a[l], a[l + 1]);
        loss[m] = toy_loss(a[TL], T->t[m], dy);
        for (int l = TL - 1; l >= 0; l--) {
            toy_layer_bwd(T->w[l], a[l], a[l + 1], dy, dx, grad[l]);
            memcpy(dy, dx, sizeof dy);
        }
    }
}

#endif

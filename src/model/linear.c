/* The linear layer (the executor's LINEAR op, and the head's and the other passes' projections): forward with a
 * bias, an epilogue, adapters or 4-bit parts; backward with the bf16 dy / dW scratch (issue 30 item 1). Split from
 * exec.c (its size). */
#include <stdlib.h>
#include <string.h>

#include "exec-impl.h"
#include "model-impl.h"
#include "store.h"

/* ---- the linear layer: y = x W^T, dx = dy W, dW += dy^T x ---------------------------------------- */

fl_status fl_linear_forward(const fl_backend *be, float *y, const float *x, const fl_linear *lin, int N) {
    return fl_linear_forward_ex(be, y, x, NULL, lin, N);
}

fl_status fl_linear_forward_ex(const fl_backend *be, float *y, const float *x, const void *x16, const fl_linear *lin,
                               int N) {
    /* y (N,out) = x (N,in) @ W^T (in,out) */
    int biased = 0;
    if (lin->n_q4 && lin->q416 && x16) { /* 4-bit base from x's bf16 copy, the operand the bf16 path rounds x to: the
                                          * parts stacked in one op (q4_matmul_forward16) */
        FL_TRY(FL_RUN(be, q4_matmul_forward16, y, lin->out, x16, lin->q4[0], lin->n_q4, N, 0.0f));
    } else if (lin->n_q4) { /* 4-bit base: each part fills its rows of the (fused) output, dequantized tile by tile */
        for (int k = 0, r0 = 0; k < lin->n_q4; r0 += lin->q4[k]->rows, k++)
            FL_TRY(FL_RUN(be, q4_matmul_forward, y + r0, lin->out, x, lin->q4[k], N, 0.0f));
    } else {
        /* mixed precision: the weight's compute copy (bf16), fp32 accumulation */
        const void *w = lin->wc ? lin->wc : (const void *)lin->w;
        fl_dtype wt = lin->wc ? lin->wct : FL_F32;
        /* a BF16 weight's GEMM rounds an F32 x to bf16: x16 is that operand already */
        const int a16 = x16 && wt == FL_BF16;
        if (lin_biased(lin) && be->gemm_epilogue) { /* the bias in the GEMM's epilogue (issue 30 item 3) */
            int epi = FL_GEMM_EPI_BIAS;
            const void *b = epi_bias(lin, &epi);
            FL_TRY(FL_RUN(be, gemm_epilogue, epi, b, NULL, 0, 0, 1, N, lin->out, lin->in, 1.0f,
                          a16 ? x16 : (const void *)x, a16 ? FL_BF16 : FL_F32, lin->in, w, wt, lin->in, 0.0f, y,
                          lin->out));
            biased = 1;
        } else
            FL_TRY(FL_RUN(be, gemm, 0, 1, N, lin->out, lin->in, 1.0f, a16 ? x16 : (const void *)x, a16 ? FL_BF16 : FL_F32,
                      lin->in, w, wt, lin->in, 0.0f, y, FL_F32, lin->out));
    }
    if (lin->b && !biased) FL_RUN(be, bias_forward, y, lin->b, N, lin->out);
    for (int k = 0; k < lin->n_adapters; k++) { /* the adapters' branches (LoRA: y[:, rows] += scaling drop(x) A^T B^T) */
        const fl_linear_adapter *a = lin->adapters[k];
        FL_TRY(a->ops->forward(a, be, y, lin->out, x, N, lin->row_base));
    }
    return FL_OK;
}

fl_status fl_linear_backward(const fl_backend *be, float *dx, int dx_accumulate, const float *dy, const float *x,
                             const fl_linear *lin, int N) {
    return fl_linear_backward_ex(be, dx, dx_accumulate, dy, x, NULL, lin, N);
}

int fl_linear_plain16(const fl_linear *lin) {
    return lin->n_q4 == 0 && lin->wc && lin->wct == FL_BF16 && !lin_biased(lin) && lin->n_adapters == 0;
}

fl_status fl_linear_forward16(const fl_backend *be, void *y16, const void *x16, const fl_linear *lin, int N) {
    if (!fl_linear_plain16(lin) || !x16)
        return fl_errorf(FL_ERR_UNSUPPORTED, "a bf16-output linear takes a bf16 input and weight, no bias or adapter");
    return FL_RUN(be, gemm, 0, 1, N, lin->out, lin->in, 1.0f, x16, FL_BF16, lin->in, lin->wc, FL_BF16, lin->in, 0.0f,
                  y16, FL_BF16, lin->out);
}

fl_status fl_linear_backward_ex(const fl_backend *be, float *dx, int dx_accumulate, const float *dy, const float *x,
                                const void *x16, const fl_linear *lin, int N) {
    return fl_linear_backward_dy16(be, dx, dx_accumulate, dy, 0, x, x16, lin, N);
}

int fl_linear_wants_dy16(const fl_linear *lin) { return lin->dw && lin->xb16; }
int fl_linear_adapters_x16(const fl_backend *be, const fl_linear *lin) {
    for (int k = 0; k < lin->n_adapters; k++) {
        const fl_linear_adapter *a = lin->adapters[k];
        if (!a->ops->x16_only || !a->ops->x16_only(a, be)) return 0;
    }
    return lin->n_adapters > 0;
}
int fl_linear_dx16(const fl_linear *lin) {
    return fl_linear_wants_dy16(lin) || (!lin->dw && !lin->xb16 && lin->dyb16 && (lin->n_q4 == 0 || lin->q416));
}
int fl_linear_reads_dy32(const fl_linear *lin) {
    return lin->db || lin->n_adapters > 0 || (lin->n_q4 > 0 && !lin->q416) || !fl_linear_dx16(lin);
}
int fl_q416_test_unbind;
int fl_model_q4x16(const fl_model *m) {
    return (m->be->caps & FL_CAP_Q4X16) && m->prec.name && m->prec.compute_dtype == FL_BF16 && fl_model_quant4(m);
}

static fl_status linear_backward(const fl_backend *be, void *dx, fl_dtype dxt, int dx_accumulate, const float *dy,
                                 int dy16_ready, const float *x, const void *x16, const fl_linear *lin, int N);
fl_status fl_linear_backward_dy16(const fl_backend *be, float *dx, int dx_accumulate, const float *dy, int dy16_ready,
                                  const float *x, const void *x16, const fl_linear *lin, int N) {
    return linear_backward(be, dx, FL_F32, dx_accumulate, dy, dy16_ready, x, x16, lin, N);
}
int fl_linear_dx_b16(const fl_linear *lin) {
    return lin->n_adapters == 0 && lin->n_q4 == 0 && lin->wc && lin->wct == FL_BF16 && fl_linear_dx16(lin);
}
fl_status fl_linear_backward_b16(const fl_backend *be, void *dx16, const float *dy, int dy16_ready, const float *x,
                                 const void *x16, const fl_linear *lin, int N) {
    if (!dx16 || !fl_linear_dx_b16(lin))
        return fl_errorf(FL_ERR_INVALID, "linear backward: a bf16 dx takes a bf16 weight, its dy in bf16 and no adapter "
                         "or 4-bit part");
    return linear_backward(be, dx16, FL_BF16, 0, dy, dy16_ready, x, x16, lin, N);
}
/* dx of type dxt: F32, or BF16 (fl_linear_backward_b16: the plain bf16 GEMM's output rounded, not accumulated) */
static fl_status linear_backward(const fl_backend *be, void *dx, fl_dtype dxt, int dx_accumulate, const float *dy,
                                 int dy16_ready, const float *x, const void *x16, const fl_linear *lin, int N) {
    const void *w = lin->wc ? lin->wc : (const void *)lin->w;
    fl_dtype wt = lin->wc ? lin->wct : FL_F32;
    /* bf16 compute with a trainable weight (lin->xb16 set only with a BF16 weight): dy rounded to bf16
     * once, here (or by the op that made dy: dy16_ready); the dx GEMM reads that copy, the same operand its own
     * rounding of an F32 dy gives */
    const int dy16 = fl_linear_wants_dy16(lin);
    /* dx16: the dx GEMM reads that copy; a frozen bf16 base's too (dyb16 alone: fl_act_opts.dy_bf16), where the op
     * that made dy wrote it (dy16_ready) or here (the same RNE the GEMM's rounding of an F32 dy does) */
    const int dx16 = fl_linear_dx16(lin);
    if (!dy && (!dy16_ready || fl_linear_reads_dy32(lin)))
        return fl_errorf(FL_ERR_INVALID, "linear backward: no fp32 dy, which this linear reads");
    int db_done = 0; /* a biased linear's bias gradient writes that copy as it reads dy (bias_backward16) */
    if (dy16 && !dy16_ready && lin->db && be->bias_backward16) {
        FL_TRY(FL_RUN(be, bias_backward16, lin->db, lin->dyb16, dy, N, lin->out));
        db_done = 1;
    } else if (dx16 && !dy16_ready && (dy16 || dx))
        FL_TRY(FL_RUN(be, convert, lin->dyb16, FL_BF16, dy, FL_F32, (size_t)N * lin->out));
    if (dx && lin->n_q4 && dx16) /* dx (N,in) = dy's bf16 copy (N,out) @ deq([W_0; W_1; ...]) (out,in), one op (q416) */
        FL_TRY(FL_RUN(be, q4_matmul_backward16, (float *)dx, lin->dyb16, lin->out, lin->q4[0], lin->n_q4, N,
                      dx_accumulate ? 1.0f : 0.0f));
    else if (dx && lin->n_q4) { /* dx (N,in) = sum over parts of dy[:, rows] @ deq(W_part) */
        for (int k = 0, r0 = 0; k < lin->n_q4; r0 += lin->q4[k]->rows, k++)
            FL_TRY(FL_RUN(be, q4_matmul_backward, (float *)dx, dy + r0, lin->out, lin->q4[k], N,
                          (k > 0 || dx_accumulate) ? 1.0f : 0.0f));
    } else if (dx) /* dx (N,in) = dy (N,out) @ W (out,in) */
        FL_TRY(FL_RUN(be, gemm, 0, 0, N, lin->in, lin->out, 1.0f, dx16 ? (const void *)lin->dyb16 : (const void *)dy,
                      dx16 ? FL_BF16 : FL_F32, lin->out, w, wt, lin->in, dx_accumulate ? 1.0f : 0.0f, dx, dxt,
                      lin->in));
    if (dy16) { /* dW += bf16(dy)^T @ bf16(x), fp32 accumulation; bf16(x): the saved copy when there is one */
        if (!x16) FL_TRY(FL_RUN(be, convert, lin->xb16, FL_BF16, x, FL_F32, (size_t)N * lin->in));
        /* dw16: into the bf16 gradient in place, rounded once (fl_store_direct16); else the fp32 stage */
        FL_TRY(FL_RUN(be, gemm, 1, 0, lin->out, lin->in, N, 1.0f, lin->dyb16, FL_BF16, lin->out, x16 ? x16 : lin->xb16,
                      FL_BF16, lin->in, 1.0f, lin->dw16 ? lin->dw16 : (void *)lin->dw, lin->dw16 ? FL_BF16 : FL_F32,
                      lin->in));
    } else if (lin->dw) /* dW (out,in) += dy^T (out,N) @ x (N,in) */
        FL_TRY(FL_RUN(be, gemm, 1, 0, lin->out, lin->in, N, 1.0f, dy, FL_F32, lin->out, x, FL_F32, lin->in, 1.0f,
                      lin->dw, FL_F32, lin->in));
    if (lin->db && !db_done) FL_RUN(be, bias_backward, lin->db, dy, N, lin->out);
    for (int k = 0; k < lin->n_adapters; k++) { /* after the base dx: each adapter's branch adds to it */
        const fl_linear_adapter *a = lin->adapters[k];
        if (!x && x16 && a->ops->x16_only && a->ops->x16_only(a, be)) /* x's view not widened: its stored copy */
            FL_TRY(a->ops->backward16(a, be, (float *)dx, dy, lin->out, x16, N, lin->row_base));
        else
            FL_TRY(a->ops->backward(a, be, (float *)dx, dy, lin->out, x, N, lin->row_base));
    }
    return FL_OK;
}

/* Linear layers on top of the backend's GEMM: the three products a training
 * step needs (y = x W^T, dx = dy W, dW += dy^T x). */
#include "model-impl.h"

fl_status fl_linear_forward(const fl_backend *be, float *y, const float *x, const fl_linear *lin, int N) {
    return fl_linear_forward_ex(be, y, x, NULL, lin, N);
}

fl_status fl_linear_forward_ex(const fl_backend *be, float *y, const float *x, const void *x16, const fl_linear *lin,
                               int N) {
    /* y (N,out) = x (N,in) @ W^T (in,out) */
    if (lin->n_q4) { /* 4-bit base: each part fills its rows of the (fused) output, dequantized tile by tile */
        for (int k = 0, r0 = 0; k < lin->n_q4; r0 += lin->q4[k]->rows, k++)
            FL_TRY(be->q4_matmul_forward(be, y + r0, lin->out, x, lin->q4[k], N, 0.0f));
    } else {
        /* mixed precision: the weight's compute copy (bf16), fp32 accumulation */
        const void *w = lin->wc ? lin->wc : (const void *)lin->w;
        fl_dtype wt = lin->wc ? lin->wct : FL_F32;
        /* a BF16 weight's GEMM rounds an F32 x to bf16: x16 is that operand already */
        const int a16 = x16 && wt == FL_BF16;
        FL_TRY(be->gemm(be, 0, 1, N, lin->out, lin->in, 1.0f, a16 ? x16 : (const void *)x, a16 ? FL_BF16 : FL_F32,
                        lin->in, w, wt, lin->in, 0.0f, y, FL_F32, lin->out));
    }
    if (lin->b) be->bias_forward(be, y, lin->b, N, lin->out);
    for (int k = 0; k < lin->n_adapters; k++) { /* the adapters' branches (LoRA: y[:, rows] += scaling drop(x) A^T B^T) */
        const fl_linear_adapter *a = lin->adapters[k];
        FL_TRY(a->ops->forward(a, be, y, lin->out, x, N, lin->row_base));
    }
    return FL_OK;
}

int fl_linear_plain16(const fl_linear *lin) {
    return lin->n_q4 == 0 && lin->wc && lin->wct == FL_BF16 && !lin->b && lin->n_adapters == 0;
}

fl_status fl_linear_forward16(const fl_backend *be, void *y16, const void *x16, const fl_linear *lin, int N) {
    if (!fl_linear_plain16(lin) || !x16)
        return fl_errorf(FL_ERR_UNSUPPORTED, "a bf16-output linear takes a bf16 input and weight, no bias or adapter");
    return be->gemm(be, 0, 1, N, lin->out, lin->in, 1.0f, x16, FL_BF16, lin->in, lin->wc, FL_BF16, lin->in, 0.0f, y16,
                    FL_BF16, lin->out);
}

fl_status fl_linear_backward(const fl_backend *be, float *dx, int dx_accumulate, const float *dy, const float *x,
                             const fl_linear *lin, int N) {
    return fl_linear_backward_ex(be, dx, dx_accumulate, dy, x, NULL, lin, N);
}

fl_status fl_linear_backward_ex(const fl_backend *be, float *dx, int dx_accumulate, const float *dy, const float *x,
                                const void *x16, const fl_linear *lin, int N) {
    return fl_linear_backward_dy16(be, dx, dx_accumulate, dy, 0, x, x16, lin, N);
}

int fl_linear_wants_dy16(const fl_linear *lin) { return lin->dw && lin->xb16; }

fl_status fl_linear_backward_dy16(const fl_backend *be, float *dx, int dx_accumulate, const float *dy, int dy16_ready,
                                  const float *x, const void *x16, const fl_linear *lin, int N) {
    const void *w = lin->wc ? lin->wc : (const void *)lin->w;
    fl_dtype wt = lin->wc ? lin->wct : FL_F32;
    /* bf16 compute with a trainable weight (lin->xb16 set only with a BF16 weight): dy rounded to bf16
     * once, here (or by the op that made dy: dy16_ready); the dx GEMM reads that copy, the same operand its own
     * rounding of an F32 dy gives */
    const int dy16 = fl_linear_wants_dy16(lin);
    if (dy16 && !dy16_ready) FL_TRY(be->convert(be, lin->dyb16, FL_BF16, dy, FL_F32, (size_t)N * lin->out));
    if (dx && lin->n_q4) { /* dx (N,in) = sum over parts of dy[:, rows] @ deq(W_part) */
        for (int k = 0, r0 = 0; k < lin->n_q4; r0 += lin->q4[k]->rows, k++)
            FL_TRY(be->q4_matmul_backward(be, dx, dy + r0, lin->out, lin->q4[k], N,
                                          (k > 0 || dx_accumulate) ? 1.0f : 0.0f));
    } else if (dx) /* dx (N,in) = dy (N,out) @ W (out,in) */
        FL_TRY(be->gemm(be, 0, 0, N, lin->in, lin->out, 1.0f, dy16 ? (const void *)lin->dyb16 : (const void *)dy,
                        dy16 ? FL_BF16 : FL_F32, lin->out, w, wt, lin->in, dx_accumulate ? 1.0f : 0.0f, dx, FL_F32,
                        lin->in));
    if (dy16) { /* dW += bf16(dy)^T @ bf16(x), fp32 accumulation; bf16(x): the saved copy when there is one */
        if (!x16) FL_TRY(be->convert(be, lin->xb16, FL_BF16, x, FL_F32, (size_t)N * lin->in));
        FL_TRY(be->gemm(be, 1, 0, lin->out, lin->in, N, 1.0f, lin->dyb16, FL_BF16, lin->out, x16 ? x16 : lin->xb16,
                        FL_BF16, lin->in, 1.0f, lin->dw, FL_F32, lin->in));
    } else if (lin->dw) /* dW (out,in) += dy^T (out,N) @ x (N,in) */
        FL_TRY(be->gemm(be, 1, 0, lin->out, lin->in, N, 1.0f, dy, FL_F32, lin->out, x, FL_F32, lin->in, 1.0f,
                        lin->dw, FL_F32, lin->in));
    if (lin->db) be->bias_backward(be, lin->db, dy, N, lin->out);
    for (int k = 0; k < lin->n_adapters; k++) { /* after the base dx: each adapter's branch adds to it */
        const fl_linear_adapter *a = lin->adapters[k];
        FL_TRY(a->ops->backward(a, be, dx, dy, lin->out, x, N, lin->row_base));
    }
    return FL_OK;
}

/* The chunked LM head and cross-entropy over a stack's final norm output, shared by the interpreters of several
 * stacks (seq2seq.c, blip2_pass.c): at most `chunk` rows of (rows, V) logits exist at once; in training the head's
 * backward runs chunk by chunk too (the logits' gradient overwrites them), leaving d(the head's input) in dx. */
#include <stdlib.h>

#include "model-impl.h"

fl_status fl_head_loss(fl_model *m, const fl_head_bufs *h, const int32_t *targets, int N, float grad_scale,
                       float *logits_out, double *loss_sum, long *n_valid) {
    const fl_backend *be = m->be;
    const int C = m->cfg.dim, V = m->cfg.vocab_size, train = grad_scale > 0 && targets;
    fl_outer_params op;
    fl_get_outer(m, &op);
    fl_linear head = {.in = C, .out = V, .w = op.head, .dw = op.dhead};
    fl_linear_set_weight(m, &head, op.head_idx);
    const int32_t *tg = targets;
    if (targets && h->dtargets) {
        FL_TRY(be->to_device(be, h->dtargets, targets, (size_t)N * sizeof *targets));
        tg = h->dtargets;
    }
    for (int r0 = 0; r0 < N; r0 += h->chunk) {
        const int rows = N - r0 < h->chunk ? N - r0 : h->chunk;
        const float *xr = h->x + (size_t)r0 * C;
        fl_model_bind_adapters(m, -1, 0, &head, r0); /* head adapters: this chunk */
        FL_TRY(fl_linear_forward(be, h->logits, xr, &head, rows)); // (rows, V)
        if (logits_out) FL_TRY(be->to_host(be, logits_out + (size_t)r0 * V, h->logits, (size_t)rows * V * sizeof(float)));
        if (!targets) continue;
        be->cross_entropy(be, h->losses + r0, train ? h->logits : NULL, h->logits, tg + r0, rows, V, grad_scale,
                          FL_IGNORE_INDEX);
        if (train) FL_TRY(fl_linear_backward(be, h->dx + (size_t)r0 * C, 0, h->logits, xr, &head, rows));
    }
    if (!targets) return FL_OK;
    float *l = malloc((size_t)N * sizeof *l);
    if (!l) return fl_errorf(FL_ERR_OOM, "losses: out of host memory");
    fl_status s = be->to_host(be, l, h->losses, (size_t)N * sizeof *l);
    for (int i = 0; s == FL_OK && i < N; i++)
        if (targets[i] != FL_IGNORE_INDEX) {
            *loss_sum += l[i];
            (*n_valid)++;
        }
    free(l);
    return s;
}

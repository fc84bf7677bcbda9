/* `fitllm lab --peer pytorch` (issue 33): what PyTorch would allocate for a LLaMA full fine-tune step, beside
 * fitllm's plan. MEASURED (tests/ref/pytorch_alloc.py, HF LlamaForCausalLM with sdpa, torch.optim.AdamW; fixture
 * tests/fixtures/pytorch-alloc.json, reproduced byte for byte by fl_lab_peer_pytorch in tests/test_lab.c): the
 * parameters, gradients and AdamW state, the storages autograd saves in the forward, and the returned logits.
 * MODELLED (no GPU here): which of them are live at once (the peak), the backward's transient logits
 * gradients and the optimizer step's parameter-sized temporary; the CUDA caching allocator's rounding (512-byte blocks, segments) and fragmentation are not counted. */
#include <string.h>

#include "lab-impl.h"

/* Saved for backward, per token (B x T of them), as measured: per layer, RMSNorm x 2 (its fp32 upcast input and
 * fp32 rsqrt), the q/k/v/o projections' and the MLP's inputs in the model dtype (e), sdpa's q, k, v, out (k and v
 * with the KV heads) and its fp32 logsumexp per head, SwiGLU's gate, up and product; once: the final norm, the
 * head's input, the rotary cos/sin (T x head_dim each), the ids and shifted labels (int64: HF pads the labels
 * by one and shifts them, a view of the T + 1 padded ones at B 1, a copy of B x T otherwise), the loss's fp32
 * log-softmax (B x T x V). */
static size_t saved_bytes(const fl_model_config *mc, size_t B, size_t T, size_t e) {
    const size_t BT = B * T, d = (size_t)mc->dim, ff = (size_t)mc->ffn_dim, H = (size_t)mc->n_heads,
                 KV = (size_t)mc->n_kv_heads, hd = (size_t)mc->head_dim, V = (size_t)mc->vocab_size;
    size_t layer = BT * d * (2 * 4 + 4 * e) + BT * ff * 4 * e + BT * hd * (2 * H + 2 * KV) * e + B * H * T * 4 + 2 * BT * 4;
    size_t labels = (B == 1 ? T + 1 : BT) * 8;
    size_t once = BT * d * (4 + 2 * e) + BT * 4 + 2 * T * hd * e + BT * 8 + labels + 4 + BT * V * 4;
    return (size_t)mc->n_layers * layer + once;
}

fl_status fl_lab_peer_pytorch(const fl_model_config *mc, size_t n_params, int B, int T, const char *precision,
                              fl_lab_peer *out) {
    memset(out, 0, sizeof *out);
    size_t e = !strcmp(precision, "32-true") ? 4 : !strcmp(precision, "bf16-true") ? 2 : 0;
    if (!e)
        return fl_errorf(FL_ERR_UNSUPPORTED, "--peer pytorch: precision %s is not modelled (32-true and bf16-true are: "
                         "autocast's copies were not measured)", precision);
    if (mc->arch != FL_ARCH_LLAMA)
        return fl_errorf(FL_ERR_UNSUPPORTED, "--peer pytorch: %s is not modelled (LLaMA's shape is)", mc->name);
    const size_t tensors = 9 * (size_t)mc->n_layers + (mc->tie_embeddings ? 2 : 3);
    out->params = out->grads = n_params * e;
    out->optim = 2 * n_params * e + 4 * tensors; /* exp_avg, exp_avg_sq and a fp32 step count per tensor */
    out->saved = saved_bytes(mc, (size_t)B, (size_t)T, e);
    const size_t BTV = (size_t)B * T * mc->vocab_size;
    out->logits = BTV * e;
    out->transient = BTV * 4 + BTV * e; /* modelled: the fp32 log-softmax input's gradient, then the logits' */
    /* modelled peak (zero_grad(set_to_none=True): no gradient is live when backward starts; the state is, from the
     * second step on): start of backward (everything saved, the logits and their gradients) or its end (the
     * gradients, the saved tensors freed) */
    size_t start = out->params + out->optim + out->saved + out->logits + out->transient;
    size_t end = out->params + out->optim + out->grads + out->logits;
    /* modelled: AdamW's step (foreach, the default on a GPU) takes sqrt(exp_avg_sq) of every tensor at once, one
     * parameter-sized temporary beside the gradients and the state */
    out->step_temp = n_params * e;
    size_t step = out->params + out->optim + out->grads + out->step_temp;
    out->peak = start > end ? start : end;
    if (step > out->peak) out->peak = step;
    return FL_OK;
}

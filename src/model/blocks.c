/* Parameter lookup shared by the training forward/backward (transformer.c)
 * and generation (generate.c): pointers of one block's parameters and
 * gradients, of the embeddings/final norm/head, and the norm dispatch.
 * Moved verbatim out of transformer.c. */
#include <stdio.h>
#include <string.h>

#include "model-impl.h"

static size_t off_of(const fl_model *m, const char *name) {
    int i = fl_layout_find(&m->layout, name);
    return i < 0 ? (size_t)-1 : m->layout.params[i].offset;
}

static const float *P(const fl_model *m, size_t off) { return off == (size_t)-1 ? NULL : m->params + off; }
static float *G(const fl_model *m, size_t off) {
    return (off == (size_t)-1 || !m->grads) ? NULL : m->grads + off;
}

void fl_linear_set_compute(const fl_model *m, fl_linear *lin, size_t w_off) {
    lin->wc = (m->wcompute && w_off != (size_t)-1) ? (const void *)(m->wcompute + w_off) : NULL;
    lin->wct = m->prec.compute_dtype;
}

static void set_linear(const fl_model *m, fl_linear *lin, int in, int out, const char *w, const char *b) {
    size_t ow = off_of(m, w), ob = b ? off_of(m, b) : (size_t)-1;
    lin->in = in;
    lin->out = out;
    lin->w = P(m, ow);
    fl_linear_set_compute(m, lin, ow);
    lin->b = P(m, ob);
    lin->dw = G(m, ow);
    lin->db = G(m, ob);
}

void fl_get_block(const fl_model *m, int l, fl_block_params *bp) {
    fl_dims d = fl_model_dims(&m->cfg);
    char a[FL_PARAM_NAME_MAX], b[FL_PARAM_NAME_MAX], c[FL_PARAM_NAME_MAX], e[FL_PARAM_NAME_MAX];
    memset(bp, 0, sizeof *bp);
    if (m->cfg.arch == FL_ARCH_LLAMA) {
        int ab = m->cfg.attention_bias, mb = m->cfg.mlp_bias;
        snprintf(a, sizeof a, "model.layers.%d.input_layernorm.weight", l);
        snprintf(b, sizeof b, "model.layers.%d.post_attention_layernorm.weight", l);
        bp->ln1_w = P(m, off_of(m, a)); bp->d_ln1_w = G(m, off_of(m, a));
        bp->ln2_w = P(m, off_of(m, b)); bp->d_ln2_w = G(m, off_of(m, b));
        /* q_proj starts the fused (QKV, C) matrix; q_proj.bias the fused bias. */
        snprintf(a, sizeof a, "model.layers.%d.self_attn.q_proj.weight", l);
        snprintf(b, sizeof b, "model.layers.%d.self_attn.q_proj.bias", l);
        set_linear(m, &bp->qkv, d.C, d.QKV, a, ab ? b : NULL);
        snprintf(a, sizeof a, "model.layers.%d.self_attn.o_proj.weight", l);
        snprintf(b, sizeof b, "model.layers.%d.self_attn.o_proj.bias", l);
        set_linear(m, &bp->o, d.QD, d.C, a, ab ? b : NULL);
        /* gate_proj starts the fused (2F, C) [gate | up] matrix. */
        snprintf(c, sizeof c, "model.layers.%d.mlp.gate_proj.weight", l);
        snprintf(e, sizeof e, "model.layers.%d.mlp.gate_proj.bias", l);
        set_linear(m, &bp->fc, d.C, d.FCW, c, mb ? e : NULL);
        snprintf(c, sizeof c, "model.layers.%d.mlp.down_proj.weight", l);
        snprintf(e, sizeof e, "model.layers.%d.mlp.down_proj.bias", l);
        set_linear(m, &bp->proj, d.F, d.C, c, mb ? e : NULL);
    } else {
#define GP(field, dfield, fmt) \
    snprintf(a, sizeof a, fmt, l); bp->field = P(m, off_of(m, a)); bp->dfield = G(m, off_of(m, a))
        GP(ln1_w, d_ln1_w, "transformer.h.%d.ln_1.weight");
        GP(ln1_b, d_ln1_b, "transformer.h.%d.ln_1.bias");
        GP(ln2_w, d_ln2_w, "transformer.h.%d.ln_2.weight");
        GP(ln2_b, d_ln2_b, "transformer.h.%d.ln_2.bias");
#undef GP
#define GL(lin, in, out, name)                                              \
    snprintf(a, sizeof a, "transformer.h.%d." name ".weight", l);            \
    snprintf(b, sizeof b, "transformer.h.%d." name ".bias", l);              \
    set_linear(m, &bp->lin, in, out, a, b)
        GL(qkv, d.C, d.QKV, "attn.c_attn");
        GL(o, d.QD, d.C, "attn.c_proj");
        GL(fc, d.C, d.FCW, "mlp.c_fc");
        GL(proj, d.F, d.C, "mlp.c_proj");
#undef GL
    }
    fl_lora_attach(m, l, 0, &bp->qkv);
    fl_lora_attach(m, l, 1, &bp->o);
    fl_lora_attach(m, l, 2, &bp->fc);
    fl_lora_attach(m, l, 3, &bp->proj);
}

void fl_norm_forward(const fl_model *m, float *out, float *mean, float *rstd, const float *x, const float *w,
                     const float *b, int N) {
    const fl_backend *be = m->be;
    if (m->cfg.arch == FL_ARCH_GPT2) be->layernorm_forward(be, out, mean, rstd, x, w, b, N, m->cfg.dim, m->cfg.norm_eps);
    else be->rmsnorm_forward(be, out, rstd, x, w, N, m->cfg.dim, m->cfg.norm_eps);
}

void fl_get_outer(const fl_model *m, fl_outer_params *o) {
    int gpt2 = m->cfg.arch == FL_ARCH_GPT2;
    size_t wte = off_of(m, gpt2 ? "transformer.wte.weight" : "model.embed_tokens.weight");
    size_t wpe = gpt2 ? off_of(m, "transformer.wpe.weight") : (size_t)-1;
    size_t lw = off_of(m, gpt2 ? "transformer.ln_f.weight" : "model.norm.weight");
    size_t lb = gpt2 ? off_of(m, "transformer.ln_f.bias") : (size_t)-1;
    size_t hd = m->cfg.tie_embeddings ? wte : off_of(m, "lm_head.weight");
    o->wte = P(m, wte); o->dwte = G(m, wte);
    o->wpe = P(m, wpe); o->dwpe = G(m, wpe);
    o->lnf_w = P(m, lw); o->dlnf_w = G(m, lw);
    o->lnf_b = P(m, lb); o->dlnf_b = G(m, lb);
    o->head = P(m, hd); o->dhead = G(m, hd);
    o->head_off = hd;
}


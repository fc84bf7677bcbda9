/* `fitllm lab --peer pytorch` (issue 33): what PyTorch would allocate for a LLaMA, GPT-2, OPT, Flan-T5 or BLIP-2
 * fine-tune step, beside fitllm's plan (GPT-2: HF GPT2LMHeadModel, full fine-tunes and PEFT LoRA; OPT: HF
 * OPTForCausalLM, Flan-T5: T5ForConditionalGeneration, BLIP-2: Blip2ForConditionalGeneration, full fine-tunes and PEFT
 * LoRA / bitsandbytes QLoRA; fixtures tests/fixtures/pytorch-alloc-{gpt2,opt,t5,blip2,peft,8bit,extra}.json). MEASURED (tests/ref/pytorch_alloc.py on the CPU: HF LlamaForCausalLM with sdpa, torch.optim.AdamW / SGD,
 * bitsandbytes' AdamW8bit, autocast for bf16-mixed and 16-mixed, HF gradient checkpointing, PEFT LoRA on query and
 * value, bitsandbytes NF4 for QLoRA; fixture tests/fixtures/pytorch-alloc.json, reproduced byte for byte by
 * fl_lab_peer_pytorch_setup in tests/test_lab.c): the parameters (and QLoRA's quantization state), gradients and
 * optimizer state, the storages autograd saves in the forward, and the returned logits.
 * MODELLED (no GPU here): which of them are live at once (the peak), the backward's transient logits gradients,
 * the optimizer step's temporary, the recomputation of one layer under checkpointing, QLoRA's dequantized weight,
 * CUDA's dropout mask (a bool per element, where the CPU keeps an fp32 noise tensor), and the strategies DeepSpeed
 * and torch.distributed add (ZeRO-2 offload, DDP's gradient buckets, FSDP's shards and gathered units). The CUDA
 * caching allocator's rounding (512-byte blocks, segments) and fragmentation are not counted. */
#include <string.h>

#include "lab-impl.h"

typedef struct {
    size_t B, T, BT, d, ff, H, KV, hd, V, L;
    size_t e;     /* the parameters' dtype: 4 (32-true, the mixed precisions, QLoRA's unquantized ones) or 2 */
    size_t a;     /* the linears' outputs: e, or 2 under autocast */
    int mixed, ckpt, lora_r, cpu_dropout, lora_proj;
    size_t Tt, Ld; /* Flan-T5: the decoder's length and blocks (T, L: the encoder's) */
} shape;

static size_t labels_bytes(const shape *s) { /* HF pads the labels by one and shifts them: a view of the T + 1
                                              * padded ones at B 1, a copy of B x T otherwise (int64) */
    return (s->B == 1 ? s->T + 1 : s->BT) * 8;
}

/* Per layer, full fine-tune: RMSNorm x 2 (its fp32 upcast input, fp32 rsqrt, and its output: under autocast the
 * fp32 normed input alone, as the 16-bit casts of the linears' input are what they save: q, k and v each cast it,
 * gate and up each too), sdpa's q, k, v, out (k and v with the KV heads) and its fp32 logsumexp per head, SwiGLU's
 * gate, up and product and down's input; under autocast the 16-bit copy of every linear weight (its cache). */
static size_t layer_full(const shape *s) {
    size_t norms = s->mixed ? s->BT * s->d * (2 * 4 + 2 * 4 + 5 * 2) : s->BT * s->d * (2 * 4 + 4 * s->e);
    size_t w = s->mixed ? (s->d * s->hd * (2 * s->H + 2 * s->KV) + 3 * s->d * s->ff) * 2 : 0;
    return norms + s->BT * s->ff * 4 * s->a + s->BT * s->hd * (2 * s->H + 2 * s->KV) * s->a + s->B * s->H * s->T * 4 +
           2 * s->BT * 4 + w;
}

/* One PEFT adapter (rank r) on `rows` rows of width w_in, w_out wide, its input needing a gradient or not (g). PEFT
 * casts the input to the adapters' fp32. Without autocast A saves the dropped input and B A's output (fp32); under
 * autocast A its input's 16-bit cast, B A's (16-bit) output and the 16-bit copy of its weight, A the copy of its own
 * only where its input needs a gradient; dropout saves its noise (CPU: fp32) or mask (CUDA: bool) where its input
 * needs a gradient. */
static size_t lora_adapter(const shape *s, size_t rows, size_t w_in, size_t w_out, int g) {
    const size_t r = (size_t)s->lora_r, drop = g ? rows * w_in * (s->cpu_dropout ? 4 : 1) : 0;
    if (!s->mixed) return rows * w_in * 4 + rows * r * 4 + drop;
    return rows * w_in * 2 + rows * r * 2 + w_out * r * 2 + (g ? drop + r * w_in * 2 : 0);
}

/* Per layer l, LoRA (PEFT) on a frozen base: a norm saves its fp32 input and rsqrt only where its input needs a
 * gradient (not layer 0's first: the embeddings are frozen); q's and v's adapters; sdpa as above; SwiGLU's three
 * (down's input not: its weight is frozen); under autocast the 16-bit copy of each frozen linear's weight whose input
 * needs a gradient (q, k and v not in layer 0; o, gate, up and down in every layer). */
static size_t layer_lora(const shape *s, size_t l) {
    const size_t HD = s->H * s->hd, KVD = s->KV * s->hd, norm = s->BT * s->d * 4 + s->BT * 4;
    const size_t w = s->mixed ? ((l ? s->d * (HD + 2 * KVD) : 0) + HD * s->d + 3 * s->d * s->ff) * 2 : 0;
    return (l ? 2 : 1) * norm + lora_adapter(s, s->BT, s->d, HD, l > 0) + lora_adapter(s, s->BT, s->d, KVD, l > 0) +
           s->BT * s->hd * (2 * s->H + 2 * s->KV) * s->a + s->B * s->H * s->T * 4 + 3 * s->BT * s->ff * s->a + w;
}

/* Saved for backward over the step. Once: the final norm (as a layer's), the head's input, the rotary cos/sin
 * (T x head_dim each, in the hidden states' dtype), the ids (not with frozen embeddings), the shifted labels, the
 * loss's fp32 log-softmax (B x T x V) and a fp32 scalar; under autocast the head weight's 16-bit copy. With
 * checkpointing (HF's reentrant; under LoRA PEFT makes the embeddings' output need a gradient): each layer's input
 * instead of its tensors, and no cos/sin. */
static size_t saved_bytes(const shape *s) {
    const size_t h = s->mixed ? 4 : s->e; /* the hidden states' dtype */
    size_t once = s->BT * 4 + labels_bytes(s) + 4 + s->BT * s->V * 4 + (s->ckpt ? 0 : 2 * s->T * s->hd * h);
    if (s->lora_r) {
        size_t layers = s->ckpt ? s->L * s->BT * s->d * h : 0;
        for (size_t l = 0; l < s->L && !s->ckpt; l++) layers += layer_lora(s, l);
        return layers + once + s->BT * s->d * 4 + (s->mixed ? s->d * s->V * 2 : 0);
    }
    once += s->BT * 8 + (s->mixed ? s->BT * s->d * (4 + 4 + 2) + s->d * s->V * 2 : s->BT * s->d * (4 + 2 * s->e));
    return once + s->L * (s->ckpt ? s->BT * s->d * h : layer_full(s));
}

/* GPT-2 (HF GPT2LMHeadModel, sdpa, dropout off) and OPT (HF OPTForCausalLM, pre-norm, dropout off), per layer: each
 * LayerNorm's input and its mean and rstd (the hidden states' dtype: fp32 under autocast), the attention's and the
 * MLP's input (the LayerNorm's output, under autocast its 16-bit cast: OPT's q, k and v cast it each), sdpa's q, k, v (GPT-2: one storage, c_attn's
 * output; OPT: three) and its output (the out projection's input, a view) and fp32 logsumexp per head, the MLP's
 * activation: GPT-2's tanh GELU its four elementwise intermediates and its output, OPT's ReLU its output (the second
 * linear's input); under autocast the 16-bit copy of each linear's weight. */
static size_t layer_gpt2(const shape *s, int opt) {
    const size_t h = s->mixed ? 4 : s->e, HD = s->H * s->hd;
    size_t ln = s->BT * s->d * h + 2 * s->BT * h;
    size_t w = s->mixed ? (s->d * 3 * HD + HD * s->d + 2 * s->d * s->ff) * 2 : 0;
    return 2 * ln + (opt && s->mixed ? 4 : 2) * s->BT * s->d * s->a + 4 * s->BT * HD * s->a + s->B * s->H * s->T * 4 +
           (opt ? 1 : 5) * s->BT * s->ff * s->a + w;
}

/* GPT-2 and OPT over the step. Once: the ids and position ids (int64, the two embeddings' backward: GPT-2's positions
 * one row of T, OPT's from the attention mask's cumulative sum B x T), the final LayerNorm (as a layer's), the head's
 * input, under autocast the head weight's 16-bit copy, the loss's fp32 log-softmax, the shifted labels and a scalar.
 * Checkpointing (HF's): each block's input instead of its tensors. */
static size_t saved_gpt2(const shape *s, int opt) {
    const size_t h = s->mixed ? 4 : s->e;
    size_t once = s->BT * 8 + (opt ? s->BT : s->T) * 8 + s->BT * s->d * h + 2 * s->BT * h + s->BT * s->d * s->a +
                  (s->mixed ? s->d * s->V * 2 : 0) + s->BT * s->V * 4 + labels_bytes(s) + 4;
    return once + s->L * (s->ckpt ? s->BT * s->d * h : layer_gpt2(s, opt));
}

/* Flan-T5 (HF T5ForConditionalGeneration, gated GELU, its own head, dropout off), measured on the CPU, where its
 * self-attention (a position bias that needs a gradient) takes sdpa's math path: fp32 q, k^T, v and probabilities
 * whatever the precision; the cross-attention (a bias without one) the flash kernel (q, k, v, out, fp32 logsumexp).
 * One RMSNorm over B x t: its fp32 input (a copy unless fp32), fp32 rsqrt, the normalized input and its output in
 * the parameter dtype; under autocast the fp32 input and normalized input only (the linears save their casts). */
static size_t t5_norm(const shape *s, size_t t) {
    const size_t n = s->B * t * s->d;
    return (s->mixed ? 2 * n * 4 : (s->e == 4 ? 0 : n * 4) + 3 * n * s->e) + s->B * t * 4;
}

/* Self-attention and the FFN over B x t: the math path's four, the out projection's input; the gated GELU's seven
 * (wi_0's output, tanh GELU's intermediates and output, wi_1's output, their product); under autocast each linear's
 * input cast and weight copy. */
static size_t t5_self_ffn(const shape *s, size_t t) {
    const size_t HD = s->H * s->hd, Bt = s->B * t;
    size_t b = (3 * Bt * HD + s->B * s->H * t * t) * 4 + Bt * HD * s->a + 7 * Bt * s->ff * s->a;
    if (s->mixed) b += (3 + 2) * Bt * s->d * 2 + (4 * s->d * HD + 3 * s->d * s->ff) * 2;
    return b;
}

/* Saved over the step. Encoder blocks: two norms, self-attention, FFN; decoder blocks three norms, the same and the
 * cross-attention (sdpa's q, k, v, out and logsumexp; under autocast q's cast, k's and v's casts of the encoder's
 * output in every block, the weights) and the causal mask (bool, each block its own). Once: the ids and
 * relative-position buckets (int64) of each stack, the cross-attention's bias (zeros), both final norms, the head (under autocast its
 * weight copy and input cast), the log-softmax (fp32 under autocast, else the parameter dtype: T5's loss does not
 * upcast), the labels and a scalar. Checkpointing (HF's): each block's input, from the second block the position
 * biases it is handed, the encoder's output (the decoder's input) under autocast, no buckets or mask. */
static size_t saved_t5(const shape *s) {
    const size_t h = s->mixed ? 4 : s->e, HD = s->H * s->hd, Ts = s->T, Tt = s->Tt, B = s->B;
    size_t b = B * Ts * 8 + B * Tt * 8 + t5_norm(s, Ts) + t5_norm(s, Tt) + B * Tt * s->V * (s->mixed ? 4 : s->e) +
               B * Tt * 8 + (s->mixed ? 4 : s->e) + (s->mixed ? s->d * s->V * 2 + B * Tt * s->d * 2 : 0);
    if (s->ckpt)
        return b + s->L * B * Ts * s->d * h + (s->L > 1 ? s->H * Ts * Ts * h : 0) + s->Ld * B * Tt * s->d * h +
               (s->Ld > 1 ? s->H * Tt * Tt * h + s->H * Tt * Ts * s->a : 0) + (s->mixed ? B * Ts * s->d * 4 : 0);
    b += Ts * Ts * 8 + Tt * Tt * 8 + s->H * Tt * Ts * s->a;
    size_t cross = 2 * B * (Tt + Ts) * HD * s->a + B * s->H * Tt * 4 + Tt * Tt; /* + the causal mask, per block */
    if (s->mixed) cross += (B * Tt + 2 * B * Ts) * s->d * 2 + 4 * s->d * HD * 2;
    return b + s->L * (2 * t5_norm(s, Ts) + t5_self_ffn(s, Ts)) + s->Ld * (3 * t5_norm(s, Tt) + t5_self_ffn(s, Tt) + cross);
}

/* ---- LoRA (PEFT) on a frozen base, GPT-2, OPT and Flan-T5 (tests/ref/pytorch_alloc.py peft, extra) --------------
 * The base's linears save nothing without autocast (their weights need no gradient, their inputs are needed for
 * none; under autocast the 16-bit copy of the weight where the input needs a gradient); what needs a gradient starts
 * at the first adapter: until then (the embeddings, the first block's first norm) nothing is saved. Adapters: above.
 *
 * GPT-2 and OPT per layer l: the attention's LayerNorm (input, mean, rstd in the hidden states' dtype) where its input
 * needs a gradient (not layer 0's), the adapters (OPT: q_proj's and v_proj's; GPT-2: c_attn's, and with PEFT's c_proj
 * target attn.c_proj's on sdpa's output and mlp.c_proj's on the GELU's output), sdpa's q, k, v (GPT-2: c_attn's one
 * output), out and fp32 logsumexp, the FFN's LayerNorm, the activation (OPT: the ReLU's output, kept by its backward;
 * GPT-2: the tanh GELU's four intermediates, its output not: mlp.c_proj's weight is frozen), under autocast the
 * weight copies (q, k, v / c_attn from layer 1 on; the out projection and the FFN's two in every layer). */
static size_t layer_gpt2_lora(const shape *s, int opt, size_t l) {
    const size_t h = s->mixed ? 4 : s->e, HD = s->H * s->hd, BT = s->BT, d = s->d, ff = s->ff;
    const size_t ln = BT * d * h + 2 * BT * h;
    size_t b = (l ? ln : 0) + 4 * BT * HD * s->a + s->B * s->H * s->T * 4 + ln;
    if (opt) b += 2 * lora_adapter(s, BT, d, HD, l > 0) + BT * ff * s->a;
    else b += lora_adapter(s, BT, d, 3 * HD, l > 0) + 4 * BT * ff * s->a +
              (s->lora_proj ? lora_adapter(s, BT, HD, d, 1) + lora_adapter(s, BT, ff, d, 1) : 0);
    return b + (s->mixed ? ((l ? d * 3 * HD : 0) + HD * d + 2 * d * ff) * 2 : 0);
}

/* GPT-2 and OPT under LoRA over the step. Once: the final LayerNorm, under autocast the head weight's 16-bit copy, the
 * fp32 log-softmax, the labels and a scalar. Checkpointing (HF's): each block's input instead of its tensors. */
static size_t saved_gpt2_lora(const shape *s, int opt) {
    const size_t h = s->mixed ? 4 : s->e;
    size_t b = s->BT * s->d * h + 2 * s->BT * h + (s->mixed ? s->d * s->V * 2 : 0) + s->BT * s->V * 4 +
               labels_bytes(s) + 4;
    if (s->ckpt) return b + s->L * s->BT * s->d * h;
    for (size_t l = 0; l < s->L; l++) b += layer_gpt2_lora(s, opt, l);
    return b;
}

/* Flan-T5 under LoRA: its RMSNorm saves the fp32 input and rsqrt, and under bf16 the bf16 input its product takes. */
static size_t t5_lora_norm(const shape *s, size_t t) {
    const size_t n = s->B * t * s->d;
    return n * 4 + s->B * t * 4 + (s->e == 4 ? 0 : n * s->e);
}

/* sdpa's flash kernel over tq x tk: q, k, v, out (16-bit under autocast) and the fp32 logsumexp. */
static size_t t5_lora_attn(const shape *s, size_t tq, size_t tk) {
    return 2 * s->B * (tq + tk) * s->H * s->hd * s->a + s->B * s->H * tq * 4;
}

/* Block l of the encoder or the decoder: the self-attention's norm where its input needs a gradient (not block 0's),
 * q's and v's adapters, flash, the FFN's norm and the gated GELU's six (wo's input not); a decoder block adds the
 * cross-attention: its norm, q's adapter on the decoder's rows, v's on the encoder's output (which needs a gradient:
 * dropout saves its noise in every block) and flash over T_dec x T. Under autocast the 16-bit copy of each frozen
 * weight whose input needs a gradient: q, k, v from block 1 on, o, wi_0, wi_1, wo, and every cross-attention weight
 * (its k and v take the encoder's output). */
static size_t t5_lora_block(const shape *s, int dec, size_t l) {
    const size_t B = s->B, Ts = s->T, Tt = s->Tt, HD = s->H * s->hd, t = dec ? Tt : Ts;
    size_t b = (l ? t5_lora_norm(s, t) : 0) + 2 * lora_adapter(s, B * t, s->d, HD, l > 0) + t5_lora_attn(s, t, t) +
               t5_lora_norm(s, t) + 6 * B * t * s->ff * s->a;
    size_t w = ((l ? 3 : 0) + 1) * s->d * HD + 3 * s->d * s->ff;
    if (dec) {
        b += t5_lora_norm(s, Tt) + lora_adapter(s, B * Tt, s->d, HD, 1) + lora_adapter(s, B * Ts, s->d, HD, 1) +
             t5_lora_attn(s, Tt, Ts);
        w += 4 * s->d * HD;
    }
    return b + (s->mixed ? w * 2 : 0);
}

/* Flan-T5 under LoRA over the step. Once: both final norms, the log-softmax (T5's loss does not upcast: the
 * parameters' dtype, fp32 under autocast), the labels, a scalar; under autocast the head weight's 16-bit copy. The
 * self-attention's position bias needs no gradient now, so sdpa's flash kernel takes it as a mask (each block saves
 * its own, in the compute dtype), and the cross-attention's zero bias once (the blocks share it). Checkpointing
 * (HF's): each block's input, from the second block the biases it is handed, and the encoder's output (every
 * decoder block's input: its norm saves no output under LoRA). */
static size_t saved_t5_lora(const shape *s) {
    const size_t B = s->B, Ts = s->T, Tt = s->Tt, h = s->mixed ? 4 : s->e;
    size_t b = t5_lora_norm(s, Ts) + t5_lora_norm(s, Tt) + B * Tt * s->V * s->e + B * Tt * 8 + s->e +
               (s->mixed ? s->d * s->V * 2 : 0);
    if (s->ckpt)
        return b + s->L * B * Ts * s->d * h + (s->L > 1 ? s->H * Ts * Ts * h : 0) + s->Ld * B * Tt * s->d * h +
               (s->Ld > 1 ? s->H * Tt * Tt * h + s->H * Tt * Ts * s->a : 0) + B * Ts * s->d * h;
    b += (s->L * Ts * Ts + s->Ld * Tt * Tt + Tt * Ts) * s->H * s->a;
    for (size_t l = 0; l < s->L; l++) b += t5_lora_block(s, 0, l);
    for (size_t l = 0; l < s->Ld; l++) b += t5_lora_block(s, 1, l);
    return b;
}

/* One block's saved tensors (checkpointing's recompute): the larger of an encoder's and a decoder's. */
static size_t t5_block(const shape *s) {
    shape f = *s;
    f.ckpt = 0;
    const size_t HD = s->H * s->hd, enc = 2 * t5_norm(&f, s->T) + t5_self_ffn(&f, s->T);
    size_t dec = 3 * t5_norm(&f, s->Tt) + t5_self_ffn(&f, s->Tt) + 2 * s->B * (s->Tt + s->T) * HD * s->a +
                 s->B * s->H * s->Tt * 4;
    return enc > dec ? enc : dec;
}

/* bitsandbytes' AdamW8bit state of one tensor of n elements: from 4096 elements two uint8 states and fp32 absmax
 * per 256-block (the two 256-entry fp32 maps are shared by every tensor: counted once by the caller); below, two
 * fp32 states. */
static size_t adam8bit_tensor(size_t n) {
    return n >= 4096 ? 2 * n + 2 * ((n + 255) / 256) * 4 : 8 * n;
}

/* bitsandbytes' AdamW8bit state of a full fine-tune, tensor by tensor (the two 256-entry fp32 maps once). The tables
 * whose size the config does not give (GPT-2's and OPT's position tables, Flan-T5's two relative-position tables) are
 * what n_params leaves. */
static size_t adam8bit_state(const fl_model_config *mc, const shape *s, size_t n_params) {
    const size_t d = s->d, ff = s->ff, HD = s->H * s->hd, KVD = s->KV * s->hd, L = s->L, Ld = s->Ld, V = s->V;
    size_t total = 2048, known = 0;
#define TENSORS(n, c) (total += (c) * adam8bit_tensor(n), known += (c) * (n))
    if (mc->arch == FL_ARCH_GPT2) { /* per layer two LayerNorms (w, b), c_attn, attn c_proj, c_fc, mlp c_proj (w, b) */
        TENSORS(d, 4 * L), TENSORS(d * 3 * HD, L), TENSORS(3 * HD, L), TENSORS(HD * d, L), TENSORS(d, L);
        TENSORS(d * ff, L), TENSORS(ff, L), TENSORS(ff * d, L), TENSORS(d, L), TENSORS(d, 2), TENSORS(V * d, 1);
    } else if (mc->arch == FL_ARCH_OPT) { /* per layer q, k, v, out (w, b), two LayerNorms, fc1, fc2 (w, b) */
        TENSORS(d * HD, 4 * L), TENSORS(HD, 3 * L), TENSORS(d, L), TENSORS(d, 4 * L), TENSORS(d * ff, 2 * L);
        TENSORS(ff, L), TENSORS(d, L), TENSORS(d, 2), TENSORS(V * d, 1);
    } else if (mc->arch == FL_ARCH_T5) { /* q, k, v, o, the norms, wi_0, wi_1, wo; the decoder's cross-attention */
        TENSORS(d * HD, 4 * L + 8 * Ld), TENSORS(d, 2 * L + 3 * Ld + 2), TENSORS(d * ff, 3 * (L + Ld)), TENSORS(V * d, 2);
        const size_t rel = (n_params - known) / 2;
        TENSORS(rel, 2);
        return total;
    } else { /* LLaMA: two norms, q, k, v, o, gate, up, down per layer; the final norm, the table (+ the head) */
        TENSORS(d, 2 * L + 1), TENSORS(d * HD, 2 * L), TENSORS(d * KVD, 2 * L), TENSORS(d * ff, 3 * L);
        TENSORS(V * d, mc->tie_embeddings ? 1 : 2);
        return total;
    }
    TENSORS(n_params - known, 1); /* GPT-2's and OPT's position table */
#undef TENSORS
    return total;
}

/* A kind of linear: its weight's elements and how many the model has. */
typedef struct {
    size_t n, count;
} lin_kind;

/* The block linears bitsandbytes quantizes (every nn.Linear but the head): LLaMA's 7 and OPT's 6 per layer, Flan-T5's
 * 6 per encoder block and 10 per decoder block (its cross-attention's four; not wo). */
static int block_linears(const fl_model_config *mc, const shape *s, lin_kind *k) {
    const size_t HD = s->H * s->hd, KVD = s->KV * s->hd;
    if (mc->arch == FL_ARCH_T5) { /* wo is not: T5's _keep_in_fp32_modules keeps it from bitsandbytes (in the
                                   * parameters' dtype: measured) */
        k[0] = (lin_kind){s->d * HD, 4 * s->L + 8 * s->Ld};
        k[1] = (lin_kind){s->d * s->ff, 2 * (s->L + s->Ld)};
        return 2;
    }
    if (mc->arch == FL_ARCH_OPT) {
        k[0] = (lin_kind){s->d * HD, 4 * s->L};
        k[1] = (lin_kind){s->d * s->ff, 2 * s->L};
        return 2;
    }
    k[0] = (lin_kind){s->d * HD, 2 * s->L};
    k[1] = (lin_kind){s->d * KVD, 2 * s->L};
    k[2] = (lin_kind){s->d * s->ff, 3 * s->L};
    return 3;
}

/* One NF4 weight of n elements: its state (bitsandbytes' absmax per 64-block, fp32, and the 16-entry fp32 code; with
 * double quantization the absmax in uint8 with its own fp32 absmax per 256 of them, a 256-entry fp32 code and a fp32
 * offset). The packed weight itself is n / 2 bytes. */
static size_t nf4_state(size_t n, int dq) {
    const size_t blocks = (n + 63) / 64;
    return dq ? blocks + (blocks + 255) / 256 * 4 + 256 * 4 + 4 + 16 * 4 : blocks * 4 + 16 * 4;
}

/* QLoRA: the block linears in NF4 (packed, with their state); the rest (embeddings, head, norms, biases) stays in the
 * parameters' dtype e. */
static void nf4_bytes(const fl_model_config *mc, const shape *s, size_t n_params, int dq, size_t *params,
                      size_t *quant) {
    lin_kind k[3];
    const int nk = block_linears(mc, s, k);
    size_t n_lin = 0, packed = 0, q = 0;
    for (int i = 0; i < nk; i++)
        n_lin += k[i].n * k[i].count, packed += (k[i].n + 1) / 2 * k[i].count, q += nf4_state(k[i].n, dq) * k[i].count;
    *params = (n_params - n_lin) * s->e + packed;
    *quant = q;
}

/* PEFT LoRA on query and value: the adapted linears (LLaMA, OPT: q_proj and v_proj per layer; Flan-T5: q and v of
 * each self-attention and of the decoder's cross-attention; GPT-2: c_attn, with lora_proj also both c_proj) and their
 * adapters' elements (A: r x in, B: out x r). */
static size_t lora_params(const fl_model_config *mc, const shape *s, size_t *modules) {
    const size_t r = (size_t)s->lora_r, HD = s->H * s->hd, KVD = s->KV * s->hd;
    if (mc->arch == FL_ARCH_T5) {
        *modules = 2 * (s->L + 2 * s->Ld);
        return *modules * r * (s->d + HD);
    }
    if (mc->arch == FL_ARCH_GPT2) { /* c_attn (d -> 3 HD); c_proj: attn's (HD -> d) and mlp's (ff -> d) */
        *modules = (s->lora_proj ? 3 : 1) * s->L;
        return s->L * r * (s->d + 3 * HD + (s->lora_proj ? HD + s->ff + 2 * s->d : 0));
    }
    *modules = 2 * s->L;
    return s->L * r * (2 * s->d + HD + KVD);
}

static fl_status check_setup(const fl_model_config *mc, const fl_lab_peer_setup *u, const char **optim) {
    const char *p = u->precision ? u->precision : "";
    *optim = u->optim ? u->optim : "adamw";
    if (mc->arch != FL_ARCH_LLAMA && mc->arch != FL_ARCH_GPT2 && mc->arch != FL_ARCH_OPT && mc->arch != FL_ARCH_T5)
        return fl_errorf(FL_ERR_UNSUPPORTED, "--peer pytorch: %s is not modelled (LLaMA's, GPT-2's, OPT's and Flan-T5's "
                         "shapes are)", mc->name);
    if (mc->arch == FL_ARCH_T5 && (!mc->ffn_gated || mc->tie_embeddings))
        return fl_errorf(FL_ERR_UNSUPPORTED, "--peer pytorch: %s: T5 v1.0 (ReLU, tied head) is not modelled "
                         "(Flan-T5's shapes are)", mc->name);
    if (mc->arch == FL_ARCH_T5 && u->T_dec <= 0)
        return fl_errorf(FL_ERR_INVALID, "--peer pytorch: %s: the decoder's length T_dec is %d", mc->name,
                         u->T_dec);
    if (mc->arch == FL_ARCH_GPT2 && u->nf4)
        return fl_errorf(FL_ERR_UNSUPPORTED, "--peer pytorch: %s under QLoRA is not modelled (bitsandbytes quantizes "
                         "nn.Linear, not GPT-2's Conv1D)", fl_arch_get(mc->arch)->display);
    if (u->lora_proj && (mc->arch != FL_ARCH_GPT2 || !u->lora_r))
        return fl_errorf(FL_ERR_INVALID, "--peer pytorch: the c_proj LoRA target is GPT-2's, with lora_r");
    if (strcmp(p, "32-true") && strcmp(p, "bf16-true") && strcmp(p, "bf16-mixed") && strcmp(p, "16-mixed"))
        return fl_errorf(FL_ERR_UNSUPPORTED, "--peer pytorch: precision %s is not modelled (32-true, bf16-true, "
                         "bf16-mixed and 16-mixed are)", p);
    if (strcmp(*optim, "adamw") && strcmp(*optim, "sgd") && strcmp(*optim, "adamw8bit"))
        return fl_errorf(FL_ERR_UNSUPPORTED, "--peer pytorch: optimizer %s is not modelled (adamw, sgd, adamw8bit are)",
                         *optim);
    if (u->lora_r && (strcmp(*optim, "adamw") || u->ranks > 1))
        return fl_errorf(FL_ERR_UNSUPPORTED, "--peer pytorch: LoRA with %s is not modelled (measured: LoRA and QLoRA "
                         "with AdamW on one device)", u->ranks > 1 ? "several ranks" : *optim);
    if (u->nf4 && u->act_ckpt && mc->arch != FL_ARCH_LLAMA)
        return fl_errorf(FL_ERR_UNSUPPORTED, "--peer pytorch: QLoRA with activation checkpointing is modelled for "
                         "LLaMA (measured), not %s", fl_arch_get(mc->arch)->display);
    if (u->nf4 && (!u->lora_r || (strcmp(p, "32-true") && strcmp(p, "bf16-true"))))
        return fl_errorf(FL_ERR_UNSUPPORTED, "--peer pytorch: NF4 is modelled as QLoRA computing in fp32 (32-true) or "
                         "bf16 (bf16-true)");
    /* checkpointing changes the saved tensors only: it composes with the strategies' modelled state (the fsdp suite's
     * checkpointed rows); LoRA and the other optimizers were measured on one device */
    if ((u->lora_r || strcmp(*optim, "adamw")) && (u->offload || u->ranks > 1))
        return fl_errorf(FL_ERR_UNSUPPORTED, "--peer pytorch: a strategy with this setup is not modelled");
    if (u->ranks > 1 && (!u->strategy || (strcmp(u->strategy, "ddp") && strcmp(u->strategy, "fsdp"))))
        return fl_errorf(FL_ERR_UNSUPPORTED, "--peer pytorch: %d ranks under %s are not modelled (ddp and fsdp are)",
                         u->ranks, u->strategy ? u->strategy : "(none)");
    return FL_OK;
}

/* The categories the fixture measures. */
static void categories(const fl_model_config *mc, size_t n_params, const fl_lab_peer_setup *u, const shape *s,
                       const char *optim, fl_lab_peer *out) {
    /* tensors: GPT-2 12 a layer, OPT 16 (q, k, v apart), and the token and position tables and the final norm's two
     * (+ an untied head); LLaMA 9 a layer, the table and the final norm (+ the head); Flan-T5 9 an encoder block, 14
     * a decoder block, the table, the head, each stack's final norm and relative-position table */
    const int gpt2 = mc->arch == FL_ARCH_GPT2, opt = mc->arch == FL_ARCH_OPT, t5 = mc->arch == FL_ARCH_T5;
    const size_t tensors = t5 ? 9 * s->L + 14 * s->Ld + 6 :
                           gpt2 || opt ? (opt ? 16 : 12) * s->L + (mc->tie_embeddings ? 4 : 5) :
                                         9 * s->L + (mc->tie_embeddings ? 2 : 3);
    size_t trainable = n_params, state_e = s->e;
    out->params = n_params * s->e;
    size_t modules = 0;
    if (u->lora_r) {
        trainable = lora_params(mc, s, &modules);
        state_e = 4; /* PEFT keeps the adapters in fp32 on a 16-bit base */
        if (u->nf4) nf4_bytes(mc, s, n_params, u->dq, &out->params, &out->quant);
        out->params += trainable * 4;
    }
    out->trainable = trainable;
    out->grads = trainable * state_e;
    if (!strcmp(optim, "sgd")) out->optim = 0; /* no momentum: stateless */
    else if (!strcmp(optim, "adamw8bit")) out->optim = adam8bit_state(mc, s, n_params);
    else out->optim = 2 * trainable * state_e + 4 * (u->lora_r ? 2 * modules : tensors); /* + a fp32 step per tensor */
    out->saved = u->lora_r && t5 ? saved_t5_lora(s) : u->lora_r && (opt || gpt2) ? saved_gpt2_lora(s, opt) :
                 t5 ? saved_t5(s) : gpt2 || opt ? saved_gpt2(s, opt) : saved_bytes(s);
    out->logits = s->B * (t5 ? s->Tt : s->T) * s->V * s->a;
}

/* The step's shape for a language model's setup. */
static shape make_shape(const fl_model_config *mc, const fl_lab_peer_setup *u) {
    const char *p = u->precision;
    shape s = {(size_t)u->B, (size_t)u->T, (size_t)u->B * u->T, (size_t)mc->dim, (size_t)mc->ffn_dim,
               (size_t)mc->n_heads, (size_t)mc->n_kv_heads, (size_t)mc->head_dim, (size_t)mc->vocab_size,
               (size_t)mc->n_layers, !strcmp(p, "bf16-true") ? 2 : 4, 0, strstr(p, "mixed") != NULL, u->act_ckpt,
               u->lora_r, u->cpu_dropout, u->lora_proj, 0, 0};
    s.a = s.mixed ? 2 : s.e;
    if (mc->arch == FL_ARCH_T5) s.Tt = (size_t)u->T_dec, s.Ld = (size_t)mc->n_dec_layers;
    return s;
}

/* The modelled part (the measured categories are in *out): the transients, the strategy's state and the peak. */
static void model_peak(const fl_model_config *mc, size_t n_params, const fl_lab_peer_setup *u, const shape *sp,
                       const char *optim, fl_lab_peer *out) {
    const shape s = *sp;
    const size_t BTV = s.B * (mc->arch == FL_ARCH_T5 ? s.Tt : s.T) * s.V;
    /* modelled: the fp32 log-softmax input's gradient, then the logits' (in their dtype); QLoRA dequantizes one
     * linear at a time, in the compute dtype (bitsandbytes' MatMul4Bit: forward and backward each dequantize the
     * weight, use it and drop it) */
    out->transient = BTV * 4 + BTV * s.a + (u->nf4 ? s.d * s.ff * s.a : 0);
    /* modelled: checkpointing recomputes one layer's forward in backward, its saved tensors live beside the rest */
    if (u->act_ckpt) {
        shape f = s;
        f.ckpt = 0;
        const int opt = mc->arch == FL_ARCH_OPT; /* under LoRA: a later layer's (its input needs a gradient) */
        out->recompute = mc->arch == FL_ARCH_LLAMA ? (s.lora_r ? layer_lora(&f, 1) : layer_full(&f)) :
                         mc->arch == FL_ARCH_T5 && s.lora_r ? (t5_lora_block(&f, 0, 1) > t5_lora_block(&f, 1, 1) ?
                                                                t5_lora_block(&f, 0, 1) : t5_lora_block(&f, 1, 1)) :
                         mc->arch == FL_ARCH_T5 ? t5_block(&f) :
                         s.lora_r ? layer_gpt2_lora(&f, opt, 1) : layer_gpt2(&f, opt);
    }
    /* modelled: AdamW's step (foreach, the default on a GPU) takes sqrt(exp_avg_sq) of every tensor at once, one
     * trainable-sized temporary; SGD and bitsandbytes' 8-bit kernel update in place */
    out->step_temp = strcmp(optim, "adamw") ? 0 : out->grads;
    size_t dev_optim = out->optim, dev_grads = out->grads, comm = 0;
    if (u->offload) { /* modelled: DeepSpeed ZeRO-2 offload (one device): the state, fp32 gradients and update on the
                       * host, the gradients leave the device through its reduce bucket (Lightning's 2e8 elements) */
        out->host = out->optim + out->grads + n_params * 4 * (s.e == 2);
        dev_optim = 0;
        dev_grads = n_params < 200000000 ? out->grads : (size_t)200000000 * s.e;
        out->step_temp = 0;
    } else if (u->ranks > 1 && !strcmp(u->strategy, "ddp")) {
        comm = out->grads; /* modelled: DDP's gradient buckets, a gradient-sized copy (not bucket views) */
    } else if (u->ranks > 1) { /* modelled: FSDP FULL_SHARD per block: parameters, gradients and state sharded, two
                                * blocks gathered (the current and the prefetched one) and one block's full
                                * gradients before their reduce-scatter */
        const size_t R = (size_t)u->ranks, nb = s.L + s.Ld ? s.L + s.Ld : 1; /* blocks (Flan-T5: both stacks') */
        const size_t unit = n_params / nb > s.V * s.d ? n_params / nb : s.V * s.d;
        out->params /= R, dev_grads = out->grads / R, dev_optim = out->optim / R, out->step_temp /= R;
        comm = 3 * unit * s.e;
    }
    out->comm = comm;
    out->dev_grads = dev_grads, out->dev_optim = dev_optim;
    size_t base = out->params + out->quant + dev_optim + comm;
    size_t start = base + out->saved + out->logits + out->transient;
    size_t recompute = base + out->saved + out->recompute + (s.V * s.d + s.d) * s.e; /* with the head's gradients */
    size_t end = base + dev_grads + out->logits;
    size_t step = base + dev_grads + out->step_temp;
    out->peak = start, out->peak_at = FL_PEER_AT_BWD_START;
    if (end > out->peak) out->peak = end, out->peak_at = FL_PEER_AT_BWD_END;
    if (step > out->peak) out->peak = step, out->peak_at = FL_PEER_AT_STEP;
    if (u->act_ckpt && recompute > out->peak) out->peak = recompute, out->peak_at = FL_PEER_AT_RECOMPUTE;
}

fl_status fl_lab_peer_pytorch_setup(const fl_model_config *mc, size_t n_params, const fl_lab_peer_setup *u,
                                    fl_lab_peer *out) {
    memset(out, 0, sizeof *out);
    const char *optim;
    FL_TRY(check_setup(mc, u, &optim));
    const shape s = make_shape(mc, u);
    categories(mc, n_params, u, &s, optim, out);
    model_peak(mc, n_params, u, &s, optim, out);
    return FL_OK;
}

/* ---- BLIP-2 (HF Blip2ForConditionalGeneration, transformers 5) ---------------------------------------------------
 * As fitllm's BLIP-2 fine-tuning runs it: the vision tower frozen (no gradient reaches it, so autograd saves nothing
 * there), the Q-Former with the query tokens and the language projection, and the language model trained. OPT reads
 * the n_queries image-token placeholders then the caption (T = n_queries + caption); Flan-T5's encoder the
 * placeholders, its decoder the caption. bf16-true keeps the Q-Former and the query tokens in fp32, as
 * from_pretrained(dtype=bfloat16) does (_keep_in_fp32_modules). Measured: tests/ref/pytorch_alloc.py blip2. */

/* The vision tower's parameters (HF Blip2VisionModel: the patch conv with its bias, the class token, the position
 * table, per block two LayerNorms, qkv with its bias (transformers 5 stores k's zeros too), the projection, fc1 and
 * fc2 with biases; post_layernorm). */
static size_t b2_vision_params(const fl_model_config *v) {
    const size_t d = (size_t)v->dim, f = (size_t)v->ffn_dim, P = (size_t)v->patch_size, g = (size_t)v->image_size / P;
    const size_t block = 4 * d + 3 * d * d + 3 * d + d * d + d + 2 * d * f + f + d;
    return 3 * P * P * d + d + d + (g * g + 1) * d + (size_t)v->n_layers * block + 2 * d;
}

/* The Q-Former's cross-attention blocks (every xattn_every, from block 0). */
static size_t b2_cross_blocks(const fl_model_config *q) {
    const int every = q->xattn_every > 0 ? q->xattn_every : 1;
    return (size_t)((q->n_layers + every - 1) / every);
}

/* The Q-Former's parameters and tensors (its LayerNorm; per block self-attention q, k, v and dense with biases and a
 * LayerNorm, the query FFN's two linears and a LayerNorm; per cross block k and v from the image width) with the
 * query tokens and the language projection. */
static size_t b2_qformer_params(const fl_model_config *q, const fl_model_config *t, size_t *tensors) {
    const size_t d = (size_t)q->dim, f = (size_t)q->ffn_dim, x = (size_t)q->xattn_dim, L = (size_t)q->n_layers;
    const size_t C = b2_cross_blocks(q);
    *tensors = 2 + 16 * L + 10 * C + 1 + 2;
    return 2 * d + L * (4 * d * d + 4 * d + 2 * d + 2 * d * f + f + d + 2 * d) +
           C * (2 * d * d + 2 * x * d + 4 * d + 2 * d) + (size_t)q->n_queries * d + d * (size_t)t->dim + (size_t)t->dim;
}

/* bitsandbytes' AdamW8bit state of the Q-Former's tensors (as b2_qformer_params lists them; the two maps are the
 * language model's, counted once there). */
static size_t b2_qformer_adam8bit(const fl_model_config *q, const fl_model_config *t) {
    const size_t d = (size_t)q->dim, f = (size_t)q->ffn_dim, x = (size_t)q->xattn_dim, L = (size_t)q->n_layers;
    const size_t C = b2_cross_blocks(q), td = (size_t)t->dim;
    return 2 * adam8bit_tensor(d) +
           L * (4 * adam8bit_tensor(d * d) + 9 * adam8bit_tensor(d) + adam8bit_tensor(f) + 2 * adam8bit_tensor(d * f)) +
           C * (2 * adam8bit_tensor(d * d) + 2 * adam8bit_tensor(x * d) + 6 * adam8bit_tensor(d)) +
           adam8bit_tensor((size_t)q->n_queries * d) + adam8bit_tensor(d * td) + adam8bit_tensor(td);
}

/* What the Q-Former saves: per LayerNorm its input (not the first's: the query tokens) and fp32 mean and rstd, and
 * its output where the next linears take it as is (not under autocast: they save their casts and weight copies,
 * but for the cross-attention's k and v: their input needs no gradient, so their weights are not saved);
 * per block sdpa's q, k, v, out and fp32 logsumexp for the self-attention and, in a cross block, over the image
 * features (k, v: n_image rows); the FFN's first output (the exact GELU's input) and the GELU's output; the image
 * features once (fp32: the Q-Former's dtype; under autocast each cross block's k and v casts); the projection's input
 * (the last LayerNorm's output, in the language model's dtype). Checkpointing: each block's input, the image
 * features, the projection's input (a frozen vision block's checkpointed input is freed at once: nothing needs it). */
static size_t b2_qformer_saved(const fl_blip2_config *c, const shape *s) {
    const fl_model_config *q = &c->qformer, *v = &c->vision;
    const size_t B = s->B, NQ = (size_t)c->n_queries, d = (size_t)q->dim, f = (size_t)q->ffn_dim,
                 H = (size_t)q->n_heads, x = (size_t)q->xattn_dim, L = (size_t)q->n_layers, C = b2_cross_blocks(q),
                 g = (size_t)v->image_size / (size_t)v->patch_size, NV = g * g + 1, qa = s->mixed ? 2 : 4;
    const size_t rows = B * NQ * d, stats = 2 * B * NQ * 4, proj_in = rows * (s->mixed ? 2 : s->e);
    if (s->ckpt)
        return stats + L * rows * 4 + B * NV * x * 4 + proj_in;
    const size_t ln = rows * 4 + stats + (s->mixed ? 0 : rows * 4); /* input, stats, output */
    size_t self = 4 * rows * qa + B * H * NQ * 4, cross = 2 * B * NV * d * qa + 2 * rows * qa + B * H * NQ * 4,
           ffn = 2 * B * NQ * f * qa;
    if (s->mixed) { /* the casts of each linear's input and the weights' 16-bit copies */
        self += 3 * rows * 2 + 4 * d * d * 2;
        cross += rows * 2 + 2 * B * NV * x * 2 + 2 * d * d * 2; /* k, v: no copy (the image needs no gradient) */
        ffn += rows * 2 + 2 * d * f * 2;
    }
    size_t b = stats + (s->mixed ? 0 : rows * 4) + L * (self + ffn + 2 * ln) + C * (cross + ln) +
               (s->mixed ? (size_t)q->proj_dim * d * 2 : B * NV * x * 4);
    return b - (s->mixed ? 0 : rows * 4) + proj_in; /* the last output: the projection's input in its dtype */
}

fl_status fl_lab_peer_pytorch_blip2(const fl_blip2_config *c, const fl_lab_peer_setup *u, fl_lab_peer *out) {
    memset(out, 0, sizeof *out);
    const fl_model_config *t = &c->text;
    const int t5 = t->arch == FL_ARCH_T5;
    if (u->lora_r && u->act_ckpt && (!u->precision || strcmp(u->precision, "32-true")))
        return fl_errorf(FL_ERR_UNSUPPORTED, "--peer pytorch: BLIP-2's LoRA with activation checkpointing is modelled "
                         "at 32-true (measured), not %s", u->precision ? u->precision : "(none)");
    fl_lab_peer_setup lu = *u; /* the language model's step: its input rows and, for Flan-T5, the decoder's */
    lu.T = t5 ? c->n_queries : c->n_queries + u->T;
    lu.T_dec = t5 ? u->T : 0;
    const char *optim;
    FL_TRY(check_setup(t, &lu, &optim));
    const shape s = make_shape(t, &lu);
    const size_t n_text = fl_sizing_param_count(t), n_vision = b2_vision_params(&c->vision);
    size_t q_tensors, n_q = b2_qformer_params(&c->qformer, t, &q_tensors);
    const size_t n_proj = (size_t)c->qformer.dim * (size_t)t->dim + (size_t)t->dim, n_qf = n_q - n_proj;
    categories(t, n_text, &lu, &s, optim, out);
    /* the Q-Former's dtype: fp32 whatever the precision (bf16-true keeps it), but loaded through bitsandbytes its
     * _keep_in_fp32_modules only keep it out of the quantization: the parameters' dtype (measured) */
    const size_t qe = u->nf4 ? s.e : 4;
    out->params += n_vision * s.e + n_qf * qe + n_proj * s.e;
    if (u->nf4) { /* QLoRA: the vision blocks' linears (qkv, projection, fc1, fc2) and the language projection in NF4 */
        const fl_model_config *v = &c->vision;
        const size_t vd = (size_t)v->dim, vf = (size_t)v->ffn_dim, pr = (size_t)c->qformer.dim * (size_t)t->dim;
        const size_t lin[4] = {3 * vd * vd, vd * vd, vd * vf, vf * vd};
        for (int i = 0; i < 4; i++) {
            const size_t n = lin[i] * (size_t)v->n_layers;
            out->params -= n * s.e - (lin[i] + 1) / 2 * (size_t)v->n_layers;
            out->quant += nf4_state(lin[i], u->dq) * (size_t)v->n_layers;
        }
        out->params -= pr * s.e - (pr + 1) / 2;
        out->quant += nf4_state(pr, u->dq);
    }
    if (!u->lora_r) {
        out->trainable += n_q;
        const size_t qgrads = n_qf * qe + n_proj * s.e;
        out->grads += qgrads;
        if (!strcmp(optim, "adamw")) out->optim += 2 * qgrads + 4 * q_tensors;
        else if (!strcmp(optim, "adamw8bit")) out->optim += b2_qformer_adam8bit(&c->qformer, t);
        out->saved += b2_qformer_saved(c, &s) + (size_t)u->B * lu.T; /* + the placeholders' mask (bool) */
    } else if (u->act_ckpt) { /* LoRA, checkpointed: PEFT makes every input embedding's output need a gradient (the
                               * vision tower's too), so each checkpointed block of the frozen tower and Q-Former
                               * keeps its input, the tower's post_layernorm its input and statistics, the pooled
                               * output's LayerNorm the tower's output (a view) and its statistics; and the
                               * placeholders' mask (bool) */
        const fl_model_config *v = &c->vision, *q = &c->qformer;
        const size_t B = (size_t)u->B, g = (size_t)v->image_size / (size_t)v->patch_size, NV = g * g + 1;
        const size_t X = B * NV * (size_t)v->dim * 4;
        out->saved += ((size_t)v->n_layers + 2) * X + 2 * B * NV * 4 + 2 * B * 4 +
                      (size_t)q->n_layers * B * (size_t)c->n_queries * (size_t)q->dim * 4 + B * (size_t)lu.T;
    } /* LoRA: PEFT freezes all but the language model's adapters: the Q-Former saves nothing, no gradient reaches it */
    model_peak(t, n_text + n_vision + n_q, &lu, &s, optim, out);
    return FL_OK;
}

/* The full fine-tune with AdamW at one precision, CUDA's dropout (none in a full fine-tune). */
fl_status fl_lab_peer_pytorch(const fl_model_config *mc, size_t n_params, int B, int T, const char *precision,
                              fl_lab_peer *out) {
    fl_lab_peer_setup u = {0};
    u.precision = precision, u.B = B, u.T = T;
    return fl_lab_peer_pytorch_setup(mc, n_params, &u, out);
}

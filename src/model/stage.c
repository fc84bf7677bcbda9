/* A pipeline stage of a decoder-only model (fitllm/pp.h; issue 35 item 2, EXPERIMENTAL).
 *
 * A stage is an ordinary model whose config has the stage's block count (fl_pp_stage_config): its layout is
 * the whole model's embeddings, blocks [first, last) renumbered 0.., the final norm and the head, so every
 * block runs the unchanged code of transformer.c / graph.c on the same weights, which is what makes a
 * pipeline's losses the single process's. m->stage says which ends it runs: a later stage takes its blocks'
 * input from the previous stage instead of the embeddings, an earlier one hands its blocks' output to the
 * next instead of running the final norm, head and loss. The embeddings and head a stage does not run are
 * allocated but never read or trained (their gradients stay 0): a layout of the stage's own entries only is
 * not built yet.
 *
 * In-flight micro-batches: the arena holds one micro-batch's saved activations; a schedule that runs
 * another micro-batch's forward before this one's backward parks them in a stash (the ACTS arena, the token
 * ids the embedding backward reads, the head's d(lnf)), one per micro-batch in flight beyond the first. */
#include <stdlib.h>
#include <string.h>

#include "fitllm/pp.h"
#include "seq2seq-impl.h"
#include "store.h"

/* An encoder-decoder (T5) splits the sequence [encoder blocks; decoder blocks]: a stage holds a contiguous run of it,
 * as a T5 config of its encoder and decoder block counts (either may be 0) that remembers where it sits (pp_enc,
 * pp_first). Its layout is T5's: the shared embedding, its blocks, both final norms and the head, and a relative bias
 * table in its first block of each stack it holds blocks of: a copy of the whole's where that block is not the
 * stack's first, from which the stage computes the bias its blocks add (the copies' gradients are summed over the
 * pipeline after the schedule, as the shared embedding's: fl_pp_step_run). */
static fl_status stage_config_s2s(const fl_model_config *whole, int first, int last, fl_model_config *out) {
    const int Le = whole->n_layers, L = Le + whole->n_dec_layers;
    if (whole->pp_enc > 0)
        return fl_errorf(FL_ERR_INVALID, "pipeline stage: the config is already a stage's");
    if (first < 0 || last <= first || last > L)
        return fl_errorf(FL_ERR_INVALID, "pipeline stage: blocks [%d, %d) of an encoder-decoder with %d (%d + %d)", first,
                         last, L, Le, whole->n_dec_layers);
    *out = *whole;
    out->n_layers = (last < Le ? last : Le) - (first < Le ? first : Le);
    out->n_dec_layers = (last > Le ? last : Le) - (first > Le ? first : Le);
    out->pp_enc = Le;
    out->pp_first = first;
    return FL_OK;
}

int fl_pp_model_blocks(const fl_model_config *c) { return c->n_layers + (fl_model_is_s2s(c) ? c->n_dec_layers : 0); }

fl_status fl_pp_stage_config(const fl_model_config *whole, int first, int last, fl_model_config *out) {
    if (whole->arch == FL_ARCH_T5) return stage_config_s2s(whole, first, last, out);
    if (first < 0 || last <= first || last > whole->n_layers)
        return fl_errorf(FL_ERR_INVALID, "pipeline stage: layers [%d, %d) of a model with %d", first, last,
                         whole->n_layers);
    if (whole->arch != FL_ARCH_LLAMA && whole->arch != FL_ARCH_GPT2 && whole->arch != FL_ARCH_OPT)
        return fl_errorf(FL_ERR_UNSUPPORTED, "--pipeline_parallel: %s is not split into stages (decoder-only models "
                         "are: LLaMA, GPT-2, OPT; and T5)", fl_arch_get(whole->arch)->display);
    *out = *whole;
    out->n_layers = last - first;
    return FL_OK;
}

void fl_pp_block_costs(const fl_model_config *c, int T, double *cost) {
    if (fl_model_is_s2s(c)) { /* T5: an encoder block's and a decoder block's FLOPs at source = target = T, the head's
                               * (no blocks) on the last block */
        fl_model_config e = *c, d = *c, none = *c;
        e.n_layers = 1, e.n_dec_layers = 0, d.n_layers = 0, d.n_dec_layers = 1, none.n_layers = none.n_dec_layers = 0;
        const double head = fl_model_train_flops_s2s(&none, 1, T, T);
        const double eb = fl_model_train_flops_s2s(&e, 1, T, T) - head, db = fl_model_train_flops_s2s(&d, 1, T, T) - head;
        const int L = fl_pp_model_blocks(c);
        for (int i = 0; i < L; i++) cost[i] = i < c->n_layers ? eb : db;
        if (L > 0) cost[L - 1] += head;
        return;
    }
    /* one block's FLOPs: the whole count's change with one more block (its matmuls and attention); the head's: the
     * count of no blocks (lm_head's GEMMs; the embeddings are a lookup) */
    fl_model_config one = *c, none = *c;
    one.n_layers = 1, none.n_layers = 0;
    const double head = fl_model_train_flops(&none, 1, T), block = fl_model_train_flops(&one, 1, T) - head;
    for (int i = 0; i < c->n_layers; i++) cost[i] = block;
    if (c->n_layers > 0) cost[c->n_layers - 1] += head;
}

/* the layout group of entry i (0 embeddings, 1..L blocks, L+1 head) and its place among the group's entries */
static int entry_group(const fl_param_layout *lay, int i, int *within) {
    int g = 0;
    while (g + 1 < lay->n_groups && lay->params[i].offset >= lay->group_offset[g + 1]) g++;
    int k = 0;
    for (int j = i - 1; j >= 0 && lay->params[j].offset >= lay->group_offset[g]; j--) k++;
    *within = k;
    return g;
}

/* T5: the group of a layout's relative bias table of the stack named by prefix ("encoder." / "decoder."), -1 */
static int table_group(const fl_param_layout *lay, const char *prefix) {
    for (int i = 0; i < lay->n; i++)
        if (lay->params[i].role == FL_ROLE_REL_BIAS && !strncmp(lay->params[i].name, prefix, strlen(prefix))) {
            int k;
            return entry_group(lay, i, &k);
        }
    return -1;
}

/* T5: a block entry of the stage's group g (stack by its name), k-th of the group, in the whole layout: the block
 * first (among the stack's) + g - the stage's first group of the stack; a relative bias table maps to the whole's
 * (a copy where the stage's first block is not the stack's), the other entries skip the tables either side holds */
static int stage_entry_s2s(const fl_param_layout *whole, const fl_param_layout *stage, int first, int i) {
    int k;
    const int g = entry_group(stage, i, &k), Gs = stage->n_groups - 1, Gw = whole->n_groups - 1;
    const fl_param_info *e = &stage->params[i];
    int wg = g == 0 ? 0 : g == Gs ? Gw : -1, wk = k;
    if (wg < 0) {
        const int dec = !strncmp(e->name, "decoder.", 8), Le = table_group(whole, "decoder.") - 1;
        const int sg0 = table_group(stage, dec ? "decoder." : "encoder."), wg0 = dec ? 1 + Le : 1;
        if (sg0 < 0 || Le < 0) return -1;
        const int b0 = dec ? (first > Le ? first - Le : 0) : first; /* the stage's first block of the stack */
        if (e->role == FL_ROLE_REL_BIAS) wg = wg0, wk = 0;
        else wg = wg0 + b0 + (g - sg0), wk = k - (g == sg0) + (wg == wg0);
    }
    int j = 0;
    while (j < whole->n && whole->params[j].offset < whole->group_offset[wg]) j++;
    j += wk;
    return j < whole->n && whole->params[j].numel == e->numel && whole->params[j].role == e->role ? j : -1;
}

static int layout_is_s2s(const fl_param_layout *lay) { return table_group(lay, "decoder.") >= 0 || table_group(lay, "encoder.") >= 0; }

int fl_pp_stage_entry(const fl_param_layout *whole, const fl_param_layout *stage, int first, int i) {
    if (layout_is_s2s(whole)) return stage_entry_s2s(whole, stage, first, i);
    int k;
    const int g = entry_group(stage, i, &k), Ls = stage->n_groups - 2, L = whole->n_groups - 2;
    const int wg = g == 0 ? 0 : g <= Ls ? first + g : L + 1;
    int j = 0;
    while (j < whole->n && whole->params[j].offset < whole->group_offset[wg]) j++;
    j += k;
    return j < whole->n && whole->params[j].numel == stage->params[i].numel ? j : -1;
}

int fl_pp_layout_owns(const fl_param_layout *lay, int in, int out, int i) {
    int k;
    const int g = entry_group(lay, i, &k);
    if (g == 0) return !in;
    if (g == lay->n_groups - 1) return !out;
    return 1;
}

/* T5: the entries the stage is the one to train (its gradient is the model's; copies elsewhere get the same sum):
 * the shared embedding on the first stage, a stack's relative bias table where the stage holds the stack's first
 * block, the encoder's final norm where it holds the encoder's last, the decoder's and the head on the last stage */
int fl_pp_config_owns(const fl_model_config *c, const fl_param_layout *lay, int in, int out, int i) {
    if (c->pp_enc <= 0) return fl_pp_layout_owns(lay, in, out, i);
    int k;
    const int g = entry_group(lay, i, &k), Le = c->pp_enc, f = c->pp_first;
    const fl_param_role r = lay->params[i].role;
    if (g == 0) return !in;
    if (r == FL_ROLE_REL_BIAS) return !strncmp(lay->params[i].name, "decoder.", 8) ? f <= Le : f == 0;
    if (r == FL_ROLE_NORM_E_W) return c->n_layers > 0 && f + c->n_layers == Le;
    if (g == lay->n_groups - 1) return !out;
    return 1;
}

int fl_pp_stage_owns(const fl_model *m, int i) {
    return fl_pp_config_owns(&m->cfg, &m->layout, m->stage.in, m->stage.out, i);
}

/* QLoRA: a 4-bit entry's buffer copied as it is (the stage holds the whole model's codes and absmax, not a
 * re-quantization of their dequantized values: double quantization's mean would move) */
static fl_status take_q4(const fl_model *whole, int j, fl_model *stage, int i) {
    const fl_q4_weight *a = &whole->store->q4[j], *b = &stage->store->q4[i];
    const size_t bytes = fl_q4_bytes(a->n, a->double_quant);
    if (a->n != b->n || a->double_quant != b->double_quant || a->type != b->type)
        return fl_errorf(FL_ERR_INVALID, "pipeline stage: the 4-bit entry %s differs from the whole model's",
                         stage->layout.params[i].name);
    void *tmp = malloc(bytes + 4);
    if (!tmp) return fl_errorf(FL_ERR_OOM, "pipeline stage: out of host memory staging %s", stage->layout.params[i].name);
    fl_status s = whole->be ? FL_RUN(whole->be, to_host, tmp, a->packed, bytes) : (memcpy(tmp, a->packed, bytes), FL_OK);
    if (s == FL_OK) s = stage->be ? FL_RUN(stage->be, to_device, b->packed, tmp, bytes) : (memcpy(b->packed, tmp, bytes), FL_OK);
    free(tmp);
    return s;
}

fl_status fl_pp_stage_take(const fl_model *whole, fl_model *stage, int first) {
    size_t most = 0;
    for (int i = 0; i < whole->layout.n; i++)
        if (whole->layout.params[i].numel > most) most = whole->layout.params[i].numel;
    float *w = malloc((most ? most : 1) * sizeof *w);
    if (!w) return fl_errorf(FL_ERR_OOM, "pipeline stage: out of host memory staging one entry");
    for (int i = 0; i < stage->layout.n; i++) {
        const int j = fl_pp_stage_entry(&whole->layout, &stage->layout, first, i);
        if (j < 0) {
            free(w);
            return fl_errorf(FL_ERR_INVALID, "pipeline stage: entry %s has no counterpart in the whole model",
                             stage->layout.params[i].name);
        }
        if (fl_model_param_is_q4(stage, i) && fl_model_param_is_q4(whole, j)) {
            fl_status s = take_q4(whole, j, stage, i);
            if (s != FL_OK) {
                free(w);
                return s;
            }
            continue;
        }
        fl_model_read_param(whole, j, w);
        fl_status s = fl_model_write_param_any(stage, i, w); /* sharded: its piece */
        if (s != FL_OK) {
            free(w);
            return fl_error_prefix(s, "pipeline stage");
        }
    }
    free(w);
    fl_model_sync_compute_copy(stage); /* bf16-mixed: the copy the matmuls read */
    return FL_OK;
}

fl_status fl_model_set_stage(fl_model *m, int in, int out) {
    m->stage.in = in != 0;
    m->stage.out = out != 0;
    /* a later stage's d(input) goes to the previous stage: under adapters (a frozen base) block 0 still runs the ops
     * whose gradient flows only to its input, which one process skips at the embeddings */
    if (m->stage.in) m->keep_block0_din = 1;
    return FL_OK;
}

fl_status fl_model_stage_open_grads(fl_model *m) {
    if (!fl_store_sharded(m->store) || !m->fwd_train) return FL_OK;
    if (m->acts && m->acts->s2s) { /* an encoder-decoder's roots: the shared embedding (0) and the final norms and head
                                    * (G - 1), which a backward releases and hands on from any stage (seq2seq.c):
                                    * gathered again (the norms' backward reads them) and their gradients reopened */
        const int G = m->layout.n_groups - 1;
        FL_TRY(fl_store_gather(m->store, 0, -1));
        FL_TRY(fl_store_gather(m->store, G, -1));
        FL_TRY(fl_store_grads_begin(m->store, G));
        return fl_store_grads_begin(m->store, 0);
    }
    FL_TRY(fl_store_grads_begin(m->store, m->cfg.n_layers + 1));
    return m->stage.in ? fl_store_grads_begin(m->store, 0) : FL_OK;
}

/* sequence parallel: the rank's rows of the pass (B, T) runs at (padded as fl_model_forward pads it) */
size_t fl_model_stage_elems(const fl_model *m, int B, int T) {
    const int Tp = fl_sp_pass_T(m, B, T);
    size_t r0;
    return (size_t)fl_sp_part(m, B * Tp, &r0) * m->cfg.dim;
}

static size_t stream_bytes(const fl_model *m, int B, int T) { return fl_model_stage_elems(m, B, T) * sizeof(float); }

fl_status fl_model_stage_input(fl_model *m, const float *x, int B, int T) {
    if (!m->acts || !m->stage.in || B * T > m->B * m->T)
        return fl_errorf(FL_ERR_INVALID, "fl_model_stage_input: a later stage with an arena of at least (%d, %d) rows", B, T);
    return FL_RUN(m->be, to_device, m->acts->res[0], x, stream_bytes(m, B, T));
}

fl_status fl_model_stage_output(const fl_model *m, float *y) {
    if (m->acts && m->acts->s2s) return fl_s2s_stage_output(m, y);
    if (!m->acts || !m->stage.out) return fl_errorf(FL_ERR_INVALID, "fl_model_stage_output: not an earlier stage");
    return FL_RUN(m->be, to_host, y, m->acts->res[m->cfg.n_layers], stream_bytes(m, m->fwd_B, m->fwd_T));
}

fl_status fl_model_stage_dout(fl_model *m, const float *dy) {
    if (m->acts && m->acts->s2s) return fl_s2s_stage_dout(m, dy);
    if (!m->acts || !m->stage.out || !m->fwd_train)
        return fl_errorf(FL_ERR_INVALID, "fl_model_stage_dout: an earlier stage after a training forward");
    return FL_RUN(m->be, to_device, m->acts->dres, dy, stream_bytes(m, m->fwd_B, m->fwd_T));
}

fl_status fl_model_stage_dinput(const fl_model *m, float *dx, int B, int T) {
    if (m->acts && m->acts->s2s) return fl_s2s_stage_dinput(m, dx);
    if (!m->acts || !m->stage.in) return fl_errorf(FL_ERR_INVALID, "fl_model_stage_dinput: not a later stage");
    return FL_RUN(m->be, to_host, dx, m->acts->dres, stream_bytes(m, B, T));
}

/* ---- the stash of a micro-batch in flight ---- */

struct fl_stage_stash {
    void *acts, *ids, *dlnf;  /* the model's memory: the ACTS arena, the token ids, d(lnf) (the last stage) */
    void *ad;                 /* the adapters' activations (LoRA: each module's h and dropped input) */
    size_t ad_bytes;
    int fwd_B, fwd_T, fwd_train;
    fl_s2s_stash *x;          /* an encoder-decoder's (seq2seq_stage.c), instead of the above */
};

/* the adapters' activation buffer (outside the ACTS arena) and its bytes; 0 without adapters */
static size_t adapter_region(const fl_model *m, void **buf) {
    *buf = NULL;
    return m->adapt && m->adapt->h.acts_region ? m->adapt->h.acts_region(m, buf) : 0;
}

size_t fl_model_stage_stash_bytes(const fl_model *m) {
    if (m->acts && m->acts->s2s) return fl_s2s_stash_bytes(m);
    const size_t N = (size_t)m->B * m->T;
    void *ad;
    return m->sizes.acts_bytes + N * sizeof(int32_t) + (m->stage.out ? 0 : N * m->cfg.dim * sizeof(float)) +
           adapter_region(m, &ad);
}

void fl_model_stage_stash_free(fl_model *m, fl_stage_stash *s) {
    if (!s) return;
    fl_s2s_stash_free(m, s->x);
    fl_mem_free(m->pool, s->acts);
    fl_mem_free(m->pool, s->ids);
    fl_mem_free(m->pool, s->dlnf);
    fl_mem_free(m->pool, s->ad);
    free(s);
}

fl_status fl_model_stage_stash_new(fl_model *m, fl_stage_stash **out) {
    *out = NULL;
    if (!m->acts) return fl_errorf(FL_ERR_INVALID, "pipeline stash: the model has no arena");
    fl_stage_stash *s = calloc(1, sizeof *s);
    if (!s) return fl_errorf(FL_ERR_OOM, "pipeline stash: out of host memory");
    if (m->acts->s2s) {
        fl_status st = fl_s2s_stash_new(m, &s->x);
        if (st != FL_OK) free(s);
        else *out = s;
        return st;
    }
    const size_t N = (size_t)m->B * m->T;
    fl_status st = fl_mem_alloc(m->pool, FL_TAG_ACTS, m->sizes.acts_bytes, &s->acts);
    if (st == FL_OK) st = fl_mem_alloc(m->pool, FL_TAG_ACTS, N * sizeof(int32_t), &s->ids);
    if (st == FL_OK && !m->stage.out) st = fl_mem_alloc(m->pool, FL_TAG_ACTS, N * m->cfg.dim * sizeof(float), &s->dlnf);
    void *ad;
    s->ad_bytes = adapter_region(m, &ad);
    if (st == FL_OK && s->ad_bytes) st = fl_mem_alloc(m->pool, FL_TAG_ACTS, s->ad_bytes, &s->ad);
    if (st != FL_OK) {
        fl_model_stage_stash_free(m, s);
        return fl_error_prefix(st, "pipeline stash (a micro-batch in flight)");
    }
    *out = s;
    return FL_OK;
}

fl_status fl_model_stage_stash_save(fl_model *m, fl_stage_stash *s) {
    if (s->x) return fl_s2s_stash_save(m, s->x);
    const fl_backend *be = m->be;
    const size_t N = (size_t)m->fwd_B * m->fwd_T;
    FL_TRY(FL_RUN(be, copy, s->acts, m->acts_arena, m->sizes.acts_bytes));
    FL_TRY(FL_RUN(be, copy, s->ids, m->acts->ids, N * sizeof(int32_t)));
    if (s->dlnf) FL_TRY(FL_RUN(be, copy, s->dlnf, m->acts->buf1, N * m->cfg.dim * sizeof(float)));
    void *ad;
    if (s->ad) {
        if (adapter_region(m, &ad) != s->ad_bytes) return fl_errorf(FL_ERR_INTERNAL, "pipeline stash: the adapters' arena changed");
        FL_TRY(FL_RUN(be, copy, s->ad, ad, s->ad_bytes));
    }
    s->fwd_B = m->fwd_B, s->fwd_T = m->fwd_T, s->fwd_train = m->fwd_train;
    return FL_OK;
}

/* after a restore or swap: what the backward reads outside the stash. Checkpointing: the last block's kept
 * activations may live outside the arena (16-bit saved activations: the shared fp32 buffer, which later forwards
 * overwrote): it is recomputed from its saved input instead, the same ops in the same order (the same bits). bf16
 * stored residuals: the final norm's backward reads res[L]'s fp32 view (WORKSPACE, also overwritten), which held
 * res16[L]'s values exactly (fl_acts_store_stream rounds the view too). */
static fl_status after_restore(fl_model *m) {
    const int L = m->cfg.n_layers;
    m->ckpt_last_live = 0;
    if (m->acts->res16 && !m->stage.out)
        FL_TRY(FL_RUN(m->be, convert, m->acts->res[L], FL_F32, m->acts->res16[L], FL_BF16,
                              (size_t)m->fwd_B * m->fwd_T * m->cfg.dim));
    return FL_OK;
}

fl_status fl_model_stage_stash_restore(fl_model *m, const fl_stage_stash *s) {
    if (s->x) return fl_s2s_stash_restore(m, s->x);
    const fl_backend *be = m->be;
    const size_t N = (size_t)s->fwd_B * s->fwd_T;
    FL_TRY(FL_RUN(be, copy, m->acts_arena, s->acts, m->sizes.acts_bytes));
    FL_TRY(FL_RUN(be, copy, m->acts->ids, s->ids, N * sizeof(int32_t)));
    if (s->dlnf) FL_TRY(FL_RUN(be, copy, m->acts->buf1, s->dlnf, N * m->cfg.dim * sizeof(float)));
    void *ad;
    if (s->ad && adapter_region(m, &ad) != s->ad_bytes) return fl_errorf(FL_ERR_INTERNAL, "pipeline stash: the adapters' arena changed");
    if (s->ad) FL_TRY(FL_RUN(be, copy, ad, s->ad, s->ad_bytes));
    m->fwd_B = s->fwd_B, m->fwd_T = s->fwd_T, m->fwd_train = s->fwd_train;
    return after_restore(m);
}

/* a[0..n) <-> b[0..n) through scratch (the backend's memory) of sb bytes */
static fl_status swap_bytes(const fl_backend *be, void *a, void *b, size_t n, void *scratch, size_t sb) {
    for (size_t o = 0; o < n; o += sb) {
        const size_t k = n - o < sb ? n - o : sb;
        FL_TRY(FL_RUN(be, copy, scratch, (char *)a + o, k));
        FL_TRY(FL_RUN(be, copy, (char *)a + o, (char *)b + o, k));
        FL_TRY(FL_RUN(be, copy, (char *)b + o, scratch, k));
    }
    return FL_OK;
}

fl_status fl_model_stage_stash_swap(fl_model *m, fl_stage_stash *s, void *scratch, size_t scratch_bytes) {
    if (s->x) return fl_s2s_stash_swap(m, s->x, scratch, scratch_bytes);
    const fl_backend *be = m->be;
    const size_t N = (size_t)m->B * m->T; /* the arena's rows: both shapes fit */
    FL_TRY(swap_bytes(be, m->acts_arena, s->acts, m->sizes.acts_bytes, scratch, scratch_bytes));
    FL_TRY(swap_bytes(be, m->acts->ids, s->ids, N * sizeof(int32_t), scratch, scratch_bytes));
    if (s->dlnf) FL_TRY(swap_bytes(be, m->acts->buf1, s->dlnf, N * m->cfg.dim * sizeof(float), scratch, scratch_bytes));
    void *ad;
    if (s->ad && adapter_region(m, &ad) != s->ad_bytes) return fl_errorf(FL_ERR_INTERNAL, "pipeline stash: the adapters' arena changed");
    if (s->ad) FL_TRY(swap_bytes(be, ad, s->ad, s->ad_bytes, scratch, scratch_bytes));
    const int B = m->fwd_B, T = m->fwd_T, tr = m->fwd_train;
    m->fwd_B = s->fwd_B, m->fwd_T = s->fwd_T, m->fwd_train = s->fwd_train;
    s->fwd_B = B, s->fwd_T = T, s->fwd_train = tr;
    return after_restore(m);
}

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
#include "model-impl.h"
#include "store.h"

fl_status fl_pp_stage_config(const fl_model_config *whole, int first, int last, fl_model_config *out) {
    if (first < 0 || last <= first || last > whole->n_layers)
        return fl_errorf(FL_ERR_INVALID, "pipeline stage: layers [%d, %d) of a model with %d", first, last,
                         whole->n_layers);
    if (whole->arch != FL_ARCH_LLAMA && whole->arch != FL_ARCH_GPT2 && whole->arch != FL_ARCH_OPT)
        return fl_errorf(FL_ERR_UNSUPPORTED, "--pipeline_parallel: %s is not split into stages (decoder-only models "
                         "are: LLaMA, GPT-2, OPT)", fl_arch_get(whole->arch)->display);
    *out = *whole;
    out->n_layers = last - first;
    return FL_OK;
}

void fl_pp_block_costs(const fl_model_config *c, int T, double *cost) {
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

int fl_pp_stage_entry(const fl_param_layout *whole, const fl_param_layout *stage, int first, int i) {
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

int fl_pp_stage_owns(const fl_model *m, int i) { return fl_pp_layout_owns(&m->layout, m->stage.in, m->stage.out, i); }

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
    if (!m->acts || !m->stage.out) return fl_errorf(FL_ERR_INVALID, "fl_model_stage_output: not an earlier stage");
    return FL_RUN(m->be, to_host, y, m->acts->res[m->cfg.n_layers], stream_bytes(m, m->fwd_B, m->fwd_T));
}

fl_status fl_model_stage_dout(fl_model *m, const float *dy) {
    if (!m->acts || !m->stage.out || !m->fwd_train)
        return fl_errorf(FL_ERR_INVALID, "fl_model_stage_dout: an earlier stage after a training forward");
    return FL_RUN(m->be, to_device, m->acts->dres, dy, stream_bytes(m, m->fwd_B, m->fwd_T));
}

fl_status fl_model_stage_dinput(const fl_model *m, float *dx, int B, int T) {
    if (!m->acts || !m->stage.in) return fl_errorf(FL_ERR_INVALID, "fl_model_stage_dinput: not a later stage");
    return FL_RUN(m->be, to_host, dx, m->acts->dres, stream_bytes(m, B, T));
}

/* ---- the stash of a micro-batch in flight ---- */

struct fl_stage_stash {
    void *acts, *ids, *dlnf;  /* the model's memory: the ACTS arena, the token ids, d(lnf) (the last stage) */
    void *ad;                 /* the adapters' activations (LoRA: each module's h and dropped input) */
    size_t ad_bytes;
    int fwd_B, fwd_T, fwd_train;
};

/* the adapters' activation buffer (outside the ACTS arena) and its bytes; 0 without adapters */
static size_t adapter_region(const fl_model *m, void **buf) {
    *buf = NULL;
    return m->adapt && m->adapt->h.acts_region ? m->adapt->h.acts_region(m, buf) : 0;
}

size_t fl_model_stage_stash_bytes(const fl_model *m) {
    const size_t N = (size_t)m->B * m->T;
    void *ad;
    return m->sizes.acts_bytes + N * sizeof(int32_t) + (m->stage.out ? 0 : N * m->cfg.dim * sizeof(float)) +
           adapter_region(m, &ad);
}

void fl_model_stage_stash_free(fl_model *m, fl_stage_stash *s) {
    if (!s) return;
    fl_mem_free(m->pool, s->acts);
    fl_mem_free(m->pool, s->ids);
    fl_mem_free(m->pool, s->dlnf);
    fl_mem_free(m->pool, s->ad);
    free(s);
}

fl_status fl_model_stage_stash_new(fl_model *m, fl_stage_stash **out) {
    *out = NULL;
    if (!m->acts || m->acts->s2s) return fl_errorf(FL_ERR_UNSUPPORTED, "pipeline stash: a decoder-only model's arena");
    fl_stage_stash *s = calloc(1, sizeof *s);
    if (!s) return fl_errorf(FL_ERR_OOM, "pipeline stash: out of host memory");
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

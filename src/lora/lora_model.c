/* LoRA adapters on a model: storage, the rewrite that attaches them to the model's LINEAR ops (as
 * fl_linear_adapters: model.h), activations, merge. The math is the backend's lora_forward /
 * lora_backward ops. Only the model's public header is used. */
#include <stdlib.h>
#include <string.h>

#include "lora-impl.h"
#include "fitllm/tp.h"
#include "model/model-impl.h"
#include "model/graph.h" /* fl_lora16_on */

/* Which fl_linear of a block a module belongs to (0 qkv, 1 o, 2 fc, 3 proj: the block graph's linear
 * index), from the role of its weight's fused run (k, v, up carry no role: their run starts earlier). */
static int linear_kind(const fl_param_layout *lay, int param_index) {
    int i = param_index;
    while (i > 0 && lay->params[i].role == FL_ROLE_NONE) i--;
    switch (lay->params[i].role) {
    case FL_ROLE_QKV_W: return 0;
    case FL_ROLE_O_W: return 1;
    case FL_ROLE_FC_W: return 2;
    case FL_ROLE_PROJ_W: return 3;
    case FL_ROLE_XQ_W: return 4; /* an encoder-decoder's cross-attention (T5's decoder block) */
    case FL_ROLE_XKV_W: return 5;
    case FL_ROLE_XO_W: return 6;
    default: return -1;
    }
}

static void free_state(struct fl_lora_state *st, fl_mem_pool *pool) {
    if (!st) return;
    fl_mem_free(pool, st->params);
    fl_mem_free(pool, st->grads);
    fl_mem_free(pool, st->acts);
    fl_mem_free(pool, st->work);
    free(st->mods);
    free(st->off);
    free(st->slots);
    free(st->first);
    free(st->count);
    free(st);
}

/* ---- the adapter (model.h's fl_linear_adapter) --------------------------------------------- */

/* fl_lora_dropout_keep(seed, i): z = seed + (i + 1) * G, so a seed advanced by row_base * in * G gives
 * a head chunk the mask of rows row_base.. of the whole batch (independent of the chunking); each module's
 * stream is offset by its index */
static uint64_t slot_seed(const fl_lora_slot *a, int row_base) {
    uint64_t s = a->st->seed + (uint64_t)row_base * (uint64_t)a->in * 0x9E3779B97F4A7C15ULL;
    return s + (uint64_t)a->stream * 0x100000001b3ULL;
}

/* A row-parallel slice's dropout (tp_n > 0): its input rows are the rank's columns of the whole's rows, so each row
 * draws one process's mask at the whole's index (row_base + i) in_whole + c0 (keep(seed, i0 + j) = keep(seed + i0 G,
 * j)): the dropped input (xd) made by the backend's dropout_rows op (one call, row i's mask at i in_whole past row 0's),
 * the branch run on it undropped; the backward's d(x) part masked the same way from the branch's undropped d(x) (the
 * work buffer's second region, as the kernel's) */
static uint64_t cols_seed(const fl_lora_slot *a, int row_base) { /* row 0's: dropout_rows steps to the others */
    const size_t at = (size_t)row_base * (size_t)a->tp_n + (size_t)a->tp_c0;
    return a->st->seed + (uint64_t)at * 0x9E3779B97F4A7C15ULL + (uint64_t)a->stream * 0x100000001b3ULL;
}

static fl_status cols_forward(const fl_lora_slot *a, const fl_backend *be, float *y, int ldy, const float *x, int N,
                              int row_base) {
    FL_TRY(FL_RUN(be, dropout_rows, a->xd, x, N, (size_t)a->in, (size_t)a->tp_n, a->dropout, cols_seed(a, row_base),
                  0));
    return FL_RUN(be, lora_forward, y + a->row0, ldy, a->h, NULL, a->xd, a->A, a->B, N, a->in, a->out, a->r, a->scaling,
                  0.0f, 0);
}

/* The frozen parts' rows of dB back to 0 after a backward: B's rows there stay 0 whatever the optimizer (no
 * gradient, no moments, no decay of a 0), so the fused module's adapter is LitGPT's of its enabled parts */
static fl_status zero_frozen(const fl_lora_slot *a, const fl_backend *be) {
    const int rows = a->parts ? a->out / a->parts : 0;
    for (int p = 0; p < a->parts; p++)
        if (a->frozen >> p & 1u)
            FL_TRY(FL_RUN(be, zero, a->dB + (size_t)p * rows * a->r, (size_t)rows * a->r * sizeof(float)));
    return FL_OK;
}

static fl_status cols_backward(const fl_lora_slot *a, const fl_backend *be, float *dx, const float *dy, int ldy, int N,
                               int row_base) {
    float *t = a->st->work + (size_t)N * a->r; /* the branch's d(x) before the mask (the kernel's g before it) */
    if (dx) FL_RUN(be, zero, t, (size_t)N * a->in * sizeof(float));
    FL_TRY(FL_RUN(be, lora_backward, dx ? t : NULL, a->dA, a->dB, dy + a->row0, ldy, a->xd, a->h, a->A, a->B, N, a->in,
                  a->out, a->r, a->scaling, 0.0f, 0, a->st->work));
    FL_TRY(zero_frozen(a, be));
    if (!dx) return FL_OK;
    return FL_RUN(be, dropout_rows, dx, t, N, (size_t)a->in, (size_t)a->tp_n, a->dropout, cols_seed(a, row_base), 1);
}

/* y[:, row0:row0+out] += scaling * drop(x) A^T B^T */
static fl_status slot_forward(const fl_linear_adapter *ad, const fl_backend *be, float *y, int ldy, const float *x,
                              int N, int row_base) {
    const fl_lora_slot *a = (const fl_lora_slot *)ad;
    if (a->tp_n && a->dropout > 0) return cols_forward(a, be, y, ldy, x, N, row_base);
    return FL_RUN(be, lora_forward, y + a->row0, ldy, a->h, a->xd, x, a->A, a->B, N, a->in, a->out, a->r, a->scaling,
                            a->dropout, slot_seed(a, row_base));
}

/* after the base dx: the branch's dx is added, dA and dB accumulate */
static fl_status slot_backward(const fl_linear_adapter *ad, const fl_backend *be, float *dx, const float *dy, int ldy,
                               const float *x, int N, int row_base) {
    const fl_lora_slot *a = (const fl_lora_slot *)ad;
    if (a->tp_n && a->dropout > 0) return cols_backward(a, be, dx, dy, ldy, N, row_base);
    FL_TRY(FL_RUN(be, lora_backward, dx, a->dA, a->dB, dy + a->row0, ldy, a->xd ? a->xd : x, a->h, a->A, a->B, N, a->in,
                  a->out, a->r, a->scaling, a->dropout, slot_seed(a, row_base), a->st->work));
    return zero_frozen(a, be);
}

/* backward16 (issue 30 items 1 and 7): with dropout the branch's backward reads its own dropped copy (xd, made in the
 * forward), never x, so on a bf16-compute backend (FL_CAP_COMPUTE_BF16; FITLLM_CUDA_LORA16=0: off) the input's fp32
 * view need not be widened for it. Without dropout it reads x: the executor widens the input once for every adapter
 * on it (an op reading the stored bf16 copy instead was tried: each adapter then widened its own tiles for its fp32
 * dA GEMM, more launches and bytes than the one shared widening; removed). */
static int slot_x16_only(const fl_linear_adapter *ad, const fl_backend *be) {
    const fl_lora_slot *a = (const fl_lora_slot *)ad;
    int on = 1;
    return (be->caps & FL_CAP_COMPUTE_BF16) && a->dropout > 0 && a->xd != NULL && fl_lora16_on(&on) == FL_OK && on;
}
static fl_status slot_backward16(const fl_linear_adapter *ad, const fl_backend *be, float *dx, const float *dy, int ldy,
                                 const void *x16, int N, int row_base) {
    (void)x16;
    return slot_backward(ad, be, dx, dy, ldy, NULL, N, row_base); /* reads a->xd (slot_x16_only) */
}

static const fl_linear_adapter_ops slot_ops = {slot_forward, slot_backward, slot_x16_only, slot_backward16};

/* the model's hooks (fl_adapter_hooks) */
static void lora_release(fl_model *m) {
    free_state(m->lora, m->pool);
    m->lora = NULL;
}
static fl_status lora_alloc_acts(fl_model *m, int B, int T);
static void lora_free_acts(fl_model *m);
static size_t lora_live_acts(const fl_model *m, int train, const void **buf);
static void lora_seed(fl_model *m, uint64_t seed);
static void lora_add_merged(const fl_model *m, int i, float *dst);
static size_t lora_acts_region(const fl_model *m, void **buf);

fl_status fl_model_lora_init(fl_model *m, const fl_lora_config *cfg, uint64_t seed) {
    return fl_model_lora_init_at(m, cfg, seed, 0);
}

fl_status fl_model_lora_init_at(fl_model *m, const fl_lora_config *cfg, uint64_t seed, int base) {
    struct fl_lora_state *st = calloc(1, sizeof *st);
    if (!st) return fl_errorf(FL_ERR_OOM, "LoRA: out of host memory");
    st->cfg = *cfg;
    st->scaling = fl_lora_scaling(cfg);
    fl_status s = fl_lora_modules(cfg, &m->layout, &m->cfg, &st->mods, &st->n_mods);
    for (int j = 0; s == FL_OK && j < st->n_mods; j++)
        if (st->mods[j].layer >= 0 && linear_kind(&m->layout, st->mods[j].param_index) < 0)
            s = fl_errorf(FL_ERR_INTERNAL, "LoRA: module %s belongs to no linear of its block", st->mods[j].name);
    const int L = m->cfg.n_layers + m->cfg.n_dec_layers, K = FL_MODEL_BLOCK_LINEARS; /* blocks of every stack */
    if (s == FL_OK) {
        st->off = calloc((size_t)2 * st->n_mods + 1, sizeof *st->off);
        st->slots = calloc((size_t)st->n_mods + 1, sizeof *st->slots);
        st->first = calloc((size_t)L * K + 1, sizeof *st->first);
        st->count = calloc((size_t)L * K + 1, sizeof *st->count);
        if (!st->off || !st->slots || !st->first || !st->count) s = fl_errorf(FL_ERR_OOM, "LoRA: out of host memory");
    }
    if (s == FL_OK) {
        fl_lora_adapter_offsets(st->mods, st->n_mods, cfg->r, st->off, &st->numel);
        s = fl_mem_alloc(m->pool, FL_TAG_PARAMS, st->numel * sizeof(float), (void **)&st->params);
        if (s == FL_OK) s = fl_backend_calloc(m->be, m->pool, FL_TAG_GRADS, st->numel * sizeof(float), (void **)&st->grads);
        if (s != FL_OK) fl_error_prefix(s, "allocating LoRA adapters");
    }
    if (s != FL_OK) {
        free_state(st, m->pool);
        return s;
    }
    /* the adapters' initial values are made on the host and copied into the (device) buffer once:
     * r x (in + out) floats per module, small */
    float *host = malloc(st->numel * sizeof(float) + 1);
    if (!host) {
        free_state(st, m->pool);
        return fl_errorf(FL_ERR_OOM, "LoRA: out of host memory");
    }
    /* slots grouped by (layer, kind), in module order inside a group; group L * K is lm_head (layer -1) */
    int n = 0;
    for (int l = 0; l <= L; l++)
        for (int k = 0; k < (l < L ? K : 1); k++) {
            st->first[l * K + k] = n;
            for (int j = 0; j < st->n_mods; j++) {
                const fl_lora_module *md = &st->mods[j];
                if (l < L ? (md->layer != l || linear_kind(&m->layout, md->param_index) != k) : md->layer >= 0) continue;
                fl_lora_slot *sl = &st->slots[n++];
                float *A = st->params + st->off[2 * j], *Bm = st->params + st->off[2 * j + 1];
                if (!fl_backend_discards(m->be)) /* the planner's null backend keeps no values */
                    fl_lora_init_adapter(host + st->off[2 * j], host + st->off[2 * j + 1], cfg->r, md->in, md->out,
                                         seed + (uint64_t)(j + base) * 0x9e3779b97f4a7c15ULL);
                sl->A = A;
                sl->B = Bm;
                sl->dA = st->grads + st->off[2 * j];
                sl->dB = st->grads + st->off[2 * j + 1];
                sl->row0 = md->fused_row0;
                sl->out = md->out;
                sl->in = md->in;
                sl->parts = md->parts;
                sl->frozen = md->frozen;
                sl->r = cfg->r;
                sl->scaling = st->scaling;
                sl->dropout = cfg->dropout;
                sl->index = j;
                sl->stream = j + base;
                if (m->cfg.tp_size > 1 && fl_tp_entry_split(&m->layout, md->param_index) == FL_TP_ROW)
                    sl->tp_n = md->in * m->cfg.tp_size, sl->tp_c0 = md->in * m->cfg.tp_rank;
                sl->base.ops = &slot_ops;
                sl->st = st;
            }
            st->count[l * K + k] = n - st->first[l * K + k];
        }
    s = FL_RUN(m->be, to_device, st->params, host, st->numel * sizeof(float));
    free(host);
    /* the rewrite: each slot attached to its LINEAR (block l's linear k; the lm_head: block -1), in slot order */
    fl_adapter_hooks h = {st->grads, st->numel, fl_lora_sizing_head_grads(&st->cfg, st->mods, st->n_mods),
                          lora_alloc_acts, lora_free_acts, lora_live_acts, lora_seed, lora_add_merged, lora_release,
                          lora_acts_region};
    if (s == FL_OK) s = fl_model_adapters_begin(m, &h);
    if (s != FL_OK) {
        free_state(st, m->pool);
        return s;
    }
    m->lora = st; /* released by the model (lora_release) from here on */
    for (int l = 0; l <= L && s == FL_OK; l++)
        for (int k = 0; k < (l < L ? K : 1) && s == FL_OK; k++)
            for (int i = st->first[l * K + k]; i < st->first[l * K + k] + st->count[l * K + k] && s == FL_OK; i++)
                s = fl_model_attach_adapter(m, l < L ? l : -1, k, &st->slots[i].base);
    if (s != FL_OK) fl_model_detach_adapters(m);
    return s;
}

int fl_model_lora_adapters(const fl_model *m, fl_lora_adapters *v) {
    const struct fl_lora_state *st = m->lora;
    memset(v, 0, sizeof *v);
    if (!st) return 0;
    *v = (fl_lora_adapters){&st->cfg, st->mods, st->n_mods, st->off, st->numel, st->params, st->grads};
    return 1;
}

void fl_model_lora_set_seed(fl_model *m, uint64_t seed) {
    if (m->lora) m->lora->seed = seed;
}

void fl_model_lora_set_train(fl_model *m, int train) {
    struct fl_lora_state *st = m->lora;
    if (!st) return;
    for (int i = 0; i < st->n_mods; i++) st->slots[i].dropout = train ? st->cfg.dropout : 0.0f;
}

/* Rows of a module's h / xd for an arena of N rows: N for block linears, one logits chunk for
 * lm_head (it runs forward and backward chunk by chunk inside fl_model_forward). */
static size_t lora_rows(const fl_lora_module *md, size_t N) {
    return md->layer < 0 ? (size_t)fl_logits_chunk_rows(md->out, (int)N) : N;
}

void fl_lora_sizing_acts(const fl_lora_config *cfg, const fl_lora_module *mods, int n_mods, int B, int T,
                         size_t *acts_bytes, size_t *work_bytes) {
    size_t N = (size_t)B * T, a = 0, in_max = 0;
    for (int j = 0; j < n_mods; j++) {
        size_t rows = lora_rows(&mods[j], N);
        a += rows * cfg->r;                               /* h */
        if (cfg->dropout > 0) a += rows * mods[j].in;     /* dropped input */
        if ((size_t)mods[j].in > in_max) in_max = mods[j].in;
    }
    *acts_bytes = a * sizeof(float);
    *work_bytes = N * (cfg->r + (cfg->dropout > 0 ? in_max : 0)) * sizeof(float);
}

size_t fl_lora_sizing_live_acts(const fl_lora_config *cfg, const fl_lora_module *mods, int n_mods, int B, int T) {
    size_t N = (size_t)B * T, a = 0;
    for (int j = 0; j < n_mods; j++)
        if (mods[j].layer >= 0) a += N * (cfg->r + (cfg->dropout > 0 ? (size_t)mods[j].in : 0));
    return a * sizeof(float);
}

size_t fl_lora_sizing_head_grads(const fl_lora_config *cfg, const fl_lora_module *mods, int n_mods) {
    size_t g = 0;
    for (int j = 0; j < n_mods; j++)
        if (mods[j].layer < 0) g += (size_t)cfg->r * mods[j].in + (size_t)mods[j].out * cfg->r;
    return g * sizeof(float);
}

/* Each block module's h (and, with dropout, its dropped input) at the rows the model says it saved. */
static size_t lora_live_acts(const fl_model *m, int train, const void **buf) {
    const struct fl_lora_state *st = m->lora;
    *buf = st ? st->acts : NULL;
    if (!st || !st->acts) return 0;
    size_t n = 0;
    for (int j = 0; j < st->n_mods; j++) {
        const fl_lora_module *md = &st->mods[j];
        n += fl_model_adapter_live_rows(m, md->layer, md->param_index, train) *
             ((size_t)st->cfg.r + (st->cfg.dropout > 0 ? (size_t)md->in : 0));
    }
    return n * sizeof(float);
}

static void lora_seed(fl_model *m, uint64_t seed) { fl_model_lora_set_seed(m, seed); }

static size_t lora_acts_region(const fl_model *m, void **buf) {
    const struct fl_lora_state *st = m->lora;
    *buf = st ? st->acts : NULL;
    return st && st->acts ? st->acts_bytes : 0;
}

static fl_status lora_alloc_acts(fl_model *m, int B, int T) {
    struct fl_lora_state *st = m->lora;
    if (!st) return FL_OK;
    lora_free_acts(m);
    size_t ab, wb;
    fl_lora_sizing_acts(&st->cfg, st->mods, st->n_mods, B, T, &ab, &wb);
    FL_TRY(fl_mem_alloc(m->pool, FL_TAG_ACTS, ab, (void **)&st->acts));
    st->acts_bytes = ab;
    fl_status s = fl_mem_alloc(m->pool, FL_TAG_WORKSPACE, wb, (void **)&st->work);
    if (s != FL_OK) { lora_free_acts(m); return s; }
    size_t N = (size_t)B * T, o = 0;
    for (int i = 0; i < st->n_mods; i++) {
        fl_lora_slot *sl = &st->slots[i];
        size_t rows = lora_rows(&st->mods[sl->index], N);
        sl->h = st->acts + o;
        o += rows * sl->r;
        sl->xd = NULL;
        if (st->cfg.dropout > 0) { sl->xd = st->acts + o; o += rows * sl->in; }
    }
    return FL_OK;
}

static void lora_free_acts(fl_model *m) {
    if (!m->lora) return;
    fl_mem_free(m->pool, m->lora->acts);
    fl_mem_free(m->pool, m->lora->work);
    m->lora->acts = m->lora->work = NULL;
    m->lora->acts_bytes = 0;
}

fl_status fl_model_lora_merge(fl_model *m) {
    struct fl_lora_state *st = m->lora;
    if (!st) return FL_OK;
    /* device memory (the backend's is not host memory): the adapters come to the host once and each
     * weight is merged in a host copy (fl_model_read_param / write_param); host memory: in place */
    const int dev = m->be && !fl_backend_host_memory(m->be);
    float *ad = dev ? malloc(st->numel * sizeof(float) + 1) : st->params;
    if (!ad) return fl_errorf(FL_ERR_OOM, "merging LoRA: out of host memory");
    fl_status s = dev ? FL_RUN(m->be, to_host, ad, st->params, st->numel * sizeof(float)) : FL_OK;
    for (int j = 0; j < st->n_mods && s == FL_OK; j++) {
        const fl_lora_module *md = &st->mods[j];
        const fl_param_info *p = &m->layout.params[md->param_index];
        if (fl_model_param_is_q4(m, md->param_index)) continue; /* merged when read (fl_lora_add_merged) */
        /* 16-bit storage: merge in fp32, round once */
        float *tmp = fl_model_params_f32(m) && !dev ? NULL : malloc(p->numel * sizeof(float));
        if (!tmp && (dev || !fl_model_params_f32(m))) {
            s = fl_errorf(FL_ERR_OOM, "merging LoRA into %s: out of host memory", p->name);
            break;
        }
        float *w = tmp ? tmp : fl_model_params_f32(m) + fl_model_store_off(m, md->param_index);
        if (tmp) fl_model_read_param(m, md->param_index, tmp);
        fl_lora_merge(w, md->in, ad + st->off[2 * j], ad + st->off[2 * j + 1], st->cfg.r, md->in, md->out,
                      st->scaling);
        if (tmp) fl_model_write_param(m, md->param_index, tmp);
        free(tmp);
    }
    if (dev) free(ad);
    if (s == FL_OK) {
        st->merged = 1;
        fl_model_adapters_merged(m);
    }
    return s;
}

static void lora_add_merged(const fl_model *m, int i, float *dst) {
    const struct fl_lora_state *st = m->lora;
    if (!st || !st->merged) return;
    for (int j = 0; j < st->n_mods; j++) {
        const fl_lora_module *md = &st->mods[j];
        if (md->param_index != i) continue;
        const float *A = st->params + st->off[2 * j], *B = st->params + st->off[2 * j + 1];
        float *ab = NULL;
        if (m->be && !fl_backend_host_memory(m->be)) { /* device memory: this module's A and B to the host */
            size_t na = (size_t)st->cfg.r * md->in, nb = (size_t)md->out * st->cfg.r;
            ab = malloc((na + nb) * sizeof(float));
            if (!ab || FL_RUN(m->be, to_host, ab, A, na * sizeof(float)) != FL_OK ||
                FL_RUN(m->be, to_host, ab + na, B, nb * sizeof(float)) != FL_OK) {
                free(ab);
                continue; /* out of host memory: the weight reads back unmerged */
            }
            A = ab;
            B = ab + na;
        }
        fl_lora_merge(dst, md->in, A, B, st->cfg.r, md->in, md->out, st->scaling);
        free(ab);
    }
}

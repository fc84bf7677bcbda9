/* Tensor parallelism: a rank's slice of the config, of each layout entry, and the copies between the
 * whole model and the slices (fitllm/tp.h; the graph's part is graph_tp.c). */
#include <stdlib.h>
#include <string.h>

#include "fitllm/tp.h"
#include "model-impl.h"

fl_status fl_tp_config(const fl_model_config *whole, int size, int rank, fl_model_config *out) {
    *out = *whole;
    if (size < 1 || rank < 0 || rank >= size)
        return fl_errorf(FL_ERR_INVALID, "--tensor_parallel %d: rank %d is outside the group", size, rank);
    if (whole->tp_size > 1) return fl_errorf(FL_ERR_INVALID, "--tensor_parallel: the config is a slice already");
    out->tp_size = out->tp_rank = 0;
    if (size == 1) return FL_OK;
    const fl_arch_info *ai = fl_arch_get(whole->arch);
    if (!ai || ((ai->block_graph || ai->model_graph) && !ai->tp_split))
        return fl_errorf(FL_ERR_UNSUPPORTED, "--tensor_parallel %d: %s is not split yet (LLaMA, GPT-2, OPT and T5 are)",
                         size, ai ? ai->display : "this architecture");
    const int s2s = whole->n_dec_layers > 0; /* T5's config.json keys */
    struct { int v; const char *what; } need[] = {
        {whole->n_heads, s2s ? "attention heads (num_heads)" : "attention heads (num_attention_heads)"},
        {whole->n_kv_heads, "key/value heads (num_key_value_heads)"},
        {whole->ffn_dim, s2s ? "feed-forward width (d_ff)" : "MLP width (intermediate_size)"}};
    if (whole->vocab_size < size)
        return fl_errorf(FL_ERR_UNSUPPORTED, "--tensor_parallel %d: the model's %d-token vocabulary (vocab_size) has "
                         "fewer rows than ranks to split it over", size, whole->vocab_size);
    for (size_t k = 0; k < sizeof need / sizeof need[0]; k++)
        if (need[k].v % size)
            return fl_errorf(FL_ERR_UNSUPPORTED, "--tensor_parallel %d: the model's %d %s do not split evenly over %d "
                             "ranks (use a tensor-parallel size that divides it)", size, need[k].v, need[k].what, size);
    out->n_heads = whole->n_heads / size;
    out->n_kv_heads = whole->n_kv_heads / size;
    out->ffn_dim = whole->ffn_dim / size;
    out->tp_size = size;
    out->tp_rank = rank;
    return fl_config_validate(out);
}

fl_status fl_model_set_tp(fl_model *m, fl_comm *comm) {
    const int n = m->cfg.tp_size > 1 ? m->cfg.tp_size : 1;
    if (comm && (fl_comm_size(comm) != n || (n > 1 && fl_comm_rank(comm) != m->cfg.tp_rank)))
        return fl_errorf(FL_ERR_INVALID, "tensor parallel: a group of %d (rank %d) for a model sliced for %d (rank %d)",
                         fl_comm_size(comm), fl_comm_rank(comm), n, m->cfg.tp_rank);
    m->tp_comm = comm;
    m->tp_host = fl_backend_host_memory(m->be) ? comm : m->tp_host;
    if (!comm) m->tp_host = NULL;
    return FL_OK;
}

fl_status fl_model_set_sp(fl_model *m, int on) {
    if (on && m->cfg.tp_size <= 1)
        return fl_errorf(FL_ERR_INVALID, "--sequence_parallel needs --tensor_parallel N > 1 (it splits the tensor-parallel "
                         "group's replicated rows)");
    if (m->acts) return fl_errorf(FL_ERR_INVALID, "fl_model_set_sp: before fl_model_alloc_acts");
    m->sp = on != 0;
    return FL_OK;
}

fl_tp_split fl_tp_entry_split(const fl_param_layout *lay, int i) {
    int j = i; /* the entry that opens a fused run (k, v, up follow their role's entry with no role) */
    while (j > 0 && lay->params[j].role == FL_ROLE_NONE && lay->params[j - 1].group == lay->params[i].group) j--;
    switch (lay->params[j].role) {
    case FL_ROLE_QKV_W: case FL_ROLE_QKV_B: case FL_ROLE_FC_W: case FL_ROLE_FC_B: return FL_TP_COLUMN;
    /* T5: the cross-attention's q and k|v column-parallel, its o row-parallel; the relative position bias table
     * (NH, buckets) by rows = heads: each rank its heads' biases */
    case FL_ROLE_XQ_W: case FL_ROLE_XKV_W: case FL_ROLE_REL_BIAS: return FL_TP_COLUMN;
    case FL_ROLE_O_W: case FL_ROLE_PROJ_W: case FL_ROLE_XO_W: return FL_TP_ROW;
    case FL_ROLE_EMBED: case FL_ROLE_HEAD: return FL_TP_VOCAB;
    default: return FL_TP_REPLICATED;
    }
}

/* rank r's first row and row count of a vocabulary entry of V rows split over size ranks (fl_config_vocab_rows) */
static size_t vocab_part(size_t V, int size, int r, size_t *n) {
    const size_t a = (size_t)r * V / (size_t)size, b = (size_t)(r + 1) * V / (size_t)size;
    *n = b - a;
    return a;
}

/* The parts of a column-parallel entry that split separately (rows each): a fused q|k|v entry (GPT-2's
 * c_attn) is q, k and v; a fused gate|up entry gate and up; else the entry is one part. */
static int col_parts(const fl_model_config *c, const fl_param_info *p, int64_t parts[3]) {
    fl_dims d = fl_model_dims(c);
    const int64_t R = p->shape[0];
    if ((p->role == FL_ROLE_QKV_W || p->role == FL_ROLE_QKV_B) && R == d.QKV && R != d.QD) {
        parts[0] = d.QD, parts[1] = parts[2] = d.KVD;
        return 3;
    }
    if ((p->role == FL_ROLE_FC_W || p->role == FL_ROLE_FC_B) && R == 2 * (int64_t)d.F) {
        parts[0] = parts[1] = d.F;
        return 2;
    }
    parts[0] = R;
    return 1;
}

size_t fl_tp_q4_cut(const fl_model_config *whole, const fl_param_layout *lay, int size, int i) {
    const fl_param_info *p = &lay->params[i];
    if (size <= 1 || p->ndim != 2) return 0;
    const size_t K = (size_t)p->shape[1];
    const fl_tp_split sp = fl_tp_entry_split(lay, i);
    if (sp == FL_TP_ROW) return (K / (size_t)size) % FL_Q4_BLOCK ? K / (size_t)size : 0; /* a row's columns */
    if (sp != FL_TP_COLUMN) return 0;
    int64_t parts[3];
    const int np = col_parts(whole, p, parts);
    for (int k = 0; k < np; k++) /* each part's rows of the rank: whole rows of K elements */
        if ((size_t)parts[k] / (size_t)size * K % FL_Q4_BLOCK) return (size_t)parts[k] / (size_t)size * K;
    return 0;
}

/* The whole entry's flat start of each row of slice entry p (rank r of size; K columns in the slice): its whole
 * width, or 0 when the entry is neither column- nor row-parallel */
static size_t slice_row_starts(const fl_model_config *slice, const fl_param_info *p, fl_tp_split sp, size_t *starts) {
    const int size = slice->tp_size, r = slice->tp_rank;
    const size_t K = (size_t)p->shape[1];
    if (sp == FL_TP_ROW) {
        const size_t Kw = K * (size_t)size;
        for (int64_t row = 0; row < p->shape[0]; row++) starts[row] = (size_t)row * Kw + (size_t)r * K;
        return Kw;
    }
    if (sp != FL_TP_COLUMN) return 0;
    int64_t parts[3];
    const int np = col_parts(slice, p, parts);
    size_t wbase = 0, out = 0;
    for (int k = 0; k < np; k++) { /* the slice's part k: rows [r n, (r + 1) n) of the whole's part of N n rows */
        for (int64_t j = 0; j < parts[k]; j++) starts[out++] = (wbase + (size_t)r * (size_t)parts[k] + (size_t)j) * K;
        wbase += (size_t)parts[k] * (size_t)size;
    }
    return K;
}

size_t fl_tp_q4_map(const fl_model_config *slice, const fl_param_layout *lay, int i, size_t *src_block,
                    uint32_t *row_start) {
    const fl_param_info *p = &lay->params[i];
    if (slice->tp_size <= 1 || !fl_layout_entry_quantizable(lay, i)) return 0;
    const fl_tp_split sp = fl_tp_entry_split(lay, i);
    const size_t K = (size_t)p->shape[1], R = (size_t)p->shape[0];
    size_t *st = malloc(R * sizeof *st);
    if (!st || !slice_row_starts(slice, p, sp, st)) {
        free(st);
        return 0;
    }
    const size_t nb = fl_q4_map_rows(st, R, K, src_block, row_start);
    free(st);
    return nb;
}

/* take (dir 0: whole -> slice) or place (dir 1: slice -> whole) rank r's elements of a tensor p split as sp */
static void tp_map_info(const fl_model_config *c, const fl_param_info *p, fl_tp_split sp, int size, int r, float *whole,
                        float *slice, int dir) {
    const size_t K = p->ndim == 2 ? (size_t)p->shape[1] : 1;
#define MOVE(w, s, n) (dir ? memcpy((w), (s), (n) * sizeof(float)) : memcpy((s), (w), (n) * sizeof(float)))
    if (sp == FL_TP_REPLICATED) {
        MOVE(whole, slice, p->numel);
    } else if (sp == FL_TP_VOCAB) { /* r's rows [r V / size, (r + 1) V / size) */
        size_t rows;
        const size_t r0 = vocab_part((size_t)p->shape[0], size, r, &rows);
        MOVE(whole + r0 * K, slice, rows * K);
    } else if (sp == FL_TP_COLUMN) {
        int64_t parts[3];
        const int np = col_parts(c, p, parts);
        size_t base = 0, out = 0;
        for (int k = 0; k < np; k++) {
            const size_t rows = (size_t)parts[k] / (size_t)size;
            MOVE(whole + (base + (size_t)r * rows) * K, slice + out * K, rows * K);
            base += (size_t)parts[k];
            out += rows;
        }
    } else { /* row-parallel: r's columns of every row */
        const size_t R = (size_t)p->shape[0], kl = K / (size_t)size;
        for (size_t row = 0; row < R; row++) MOVE(whole + row * K + (size_t)r * kl, slice + row * kl, kl);
    }
#undef MOVE
}

/* the same of layout entry i */
static void tp_map(const fl_model_config *c, const fl_param_layout *lay, int i, int size, int r, float *whole,
                   float *slice, int dir) {
    tp_map_info(c, &lay->params[i], size > 1 ? fl_tp_entry_split(lay, i) : FL_TP_REPLICATED, size, r, whole, slice, dir);
}

/* LoRA on entry i's linear (rank lr adapters): on a column-parallel or vocabulary linear B (out, lr) takes the
 * rank's rows as the weight does (its parts, its vocabulary rows) and A is whole; on a row-parallel one A (lr, in)
 * takes the rank's columns and B is whole */
static void lora_map(const fl_model_config *c, const fl_param_layout *lay, int i, int size, int r, int lr, int is_b,
                     float *whole, float *slice, int dir) {
    const fl_tp_split sp = size > 1 ? fl_tp_entry_split(lay, i) : FL_TP_REPLICATED;
    fl_param_info p = lay->params[i];
    const int row = sp == FL_TP_ROW, split = sp != FL_TP_REPLICATED && (row ? !is_b : is_b);
    p.ndim = 2;
    if (is_b) p.shape[1] = lr; /* (out, lr): the weight's rows */
    else p.shape[0] = lr;      /* (lr, in): the weight's columns */
    p.numel = (size_t)p.shape[0] * (size_t)p.shape[1];
    tp_map_info(c, &p, split ? sp : FL_TP_REPLICATED, size, r, whole, slice, dir);
}

void fl_tp_lora_take(const fl_model_config *c, const fl_param_layout *lay, int i, int size, int r, int lr, int is_b,
                     const float *whole, float *slice) {
    lora_map(c, lay, i, size, r, lr, is_b, (float *)whole, slice, 0);
}

void fl_tp_lora_place(const fl_model_config *c, const fl_param_layout *lay, int i, int size, int r, int lr, int is_b,
                      const float *slice, float *whole) {
    lora_map(c, lay, i, size, r, lr, is_b, whole, (float *)slice, 1);
}

int fl_tp_lora_split(const fl_param_layout *lay, int i, int is_b) {
    const fl_tp_split sp = fl_tp_entry_split(lay, i);
    return sp != FL_TP_REPLICATED && (sp == FL_TP_ROW ? !is_b : is_b);
}

void fl_tp_take(const fl_model_config *c, const fl_param_layout *lay, int i, int size, int r, const float *whole,
                float *slice) {
    tp_map(c, lay, i, size, r, (float *)whole, slice, 0);
}

void fl_tp_place(const fl_model_config *c, const fl_param_layout *lay, int i, int size, int r, const float *slice,
                 float *whole) {
    tp_map(c, lay, i, size, r, whole, (float *)slice, 1);
}

static fl_status same_layout(const fl_model *whole, const fl_model *part) {
    fl_model_config c;
    FL_TRY(fl_tp_config(&whole->cfg, part->cfg.tp_size > 1 ? part->cfg.tp_size : 1, part->cfg.tp_rank, &c));
    if (whole->layout.n != part->layout.n || c.n_heads != part->cfg.n_heads || c.ffn_dim != part->cfg.ffn_dim ||
        c.dim != part->cfg.dim || c.n_layers != part->cfg.n_layers || c.vocab_size != part->cfg.vocab_size)
        return fl_errorf(FL_ERR_INVALID, "tensor parallel: the slice's config is not rank %d's slice of the model",
                         part->cfg.tp_rank);
    return FL_OK;
}

/* the largest entry's elements */
static size_t max_entry(const fl_param_layout *lay) {
    size_t mx = 0;
    for (int i = 0; i < lay->n; i++) mx = lay->params[i].numel > mx ? lay->params[i].numel : mx;
    return mx;
}

fl_status fl_tp_scatter(const fl_model *whole, fl_model *part) {
    FL_TRY(same_layout(whole, part));
    const int size = part->cfg.tp_size > 1 ? part->cfg.tp_size : 1, r = part->cfg.tp_rank;
    float *w = malloc(max_entry(&whole->layout) * sizeof(float)), *s = malloc(max_entry(&part->layout) * sizeof(float));
    if (!w || !s) {
        free(w), free(s);
        return fl_errorf(FL_ERR_OOM, "tensor parallel: out of host memory staging one entry");
    }
    fl_status st = FL_OK;
    for (int i = 0; i < whole->layout.n && st == FL_OK; i++) {
        if (fl_model_q4_mapped(part, i)) { /* a part that cuts the 4-bit blocks */
            st = fl_model_param_is_q4(whole, i) ? fl_model_q4_take_blocks(whole, i, part, i)
                                                : fl_errorf(FL_ERR_UNSUPPORTED, "%s: a part that cuts the 4-bit "
                                                            "blocks takes them from a 4-bit whole model",
                                                            part->layout.params[i].name);
            continue;
        }
        fl_model_read_param(whole, i, w);
        fl_tp_take(&whole->cfg, &whole->layout, i, size, r, w, s);
        st = fl_model_write_param_any(part, i, s); /* FSDP on the data axis: the rank's piece of its slice */
    }
    free(w), free(s);
    return fl_error_prefix(st, "tensor parallel");
}

/* One entry's elements as fp32 in host memory, read from or written to a model's parameters, gradients
 * or a flat array of the layout's offsets (optimizer state: F32 or BF16 in a backend's memory). */
typedef struct {
    fl_model *m;
    int kind;            /* 0 parameters, 1 gradients (fp32), 2 the array, 3 (read only) the parameters in host memory */
    const fl_backend *be;
    void *arr;
    fl_dtype dt;
} tp_io;

static fl_status io_read(const tp_io *x, int i, float *out) {
    const fl_param_info *p = &x->m->layout.params[i];
    if (x->kind == 0) {
        fl_model_read_param(x->m, i, out);
        return FL_OK;
    }
    if (x->kind == 1) return FL_RUN(x->m->be, to_host, out, fl_model_grads_f32(x->m) + p->offset, p->numel * sizeof(float));
    const size_t es = fl_dtype_size(x->dt);
    if (x->kind == 3) { /* host memory of any dtype (the parameters gathered from FSDP's pieces) */
        fl_convert(out, FL_F32, (const char *)x->arr + p->offset * es, x->dt, p->numel);
        return FL_OK;
    }
    if (x->be) FL_TRY(FL_RUN(x->be, to_host, out, (const char *)x->arr + p->offset * es, p->numel * es));
    else memcpy(out, (const char *)x->arr + p->offset * es, p->numel * es); /* host memory */
    if (x->dt == FL_BF16) /* widened in place, from the end */
        for (size_t k = p->numel; k-- > 0;) out[k] = fl_bf16_to_f32(((const uint16_t *)out)[k]);
    return FL_OK;
}

static fl_status io_write(const tp_io *x, int i, float *in) {
    const fl_param_info *p = &x->m->layout.params[i];
    if (x->kind == 0) {
        fl_model_write_param(x->m, i, in);
        return FL_OK;
    }
    if (x->kind == 1) return FL_RUN(x->m->be, to_device, fl_model_grads_f32(x->m) + p->offset, in, p->numel * sizeof(float));
    const size_t es = fl_dtype_size(x->dt);
    if (x->dt == FL_BF16) /* narrowed in place (exact: the values came from BF16) */
        for (size_t k = 0; k < p->numel; k++) ((uint16_t *)in)[k] = fl_f32_to_bf16(in[k]);
    if (!x->be) {
        memcpy((char *)x->arr + p->offset * es, in, p->numel * es);
        return FL_OK;
    }
    return FL_RUN(x->be, to_device, (char *)x->arr + p->offset * es, in, p->numel * es);
}

/* rank 0's whole (wr) receives every entry of the ranks' parts (rd), split entries assembled */
static fl_status gather_entries(fl_model *part, fl_comm *host_comm, fl_model *whole, const tp_io *rd, const tp_io *wr) {
    const int size = part->cfg.tp_size > 1 ? part->cfg.tp_size : 1, r = part->cfg.tp_rank;
    if (fl_comm_size(host_comm) != size || fl_comm_rank(host_comm) != r)
        return fl_errorf(FL_ERR_INVALID, "tensor parallel: gather over a group of %d (rank %d), the model is rank %d of %d",
                         fl_comm_size(host_comm), fl_comm_rank(host_comm), r, size);
    if (r == 0 && !whole) return fl_errorf(FL_ERR_INVALID, "tensor parallel: rank 0 gathers into a whole model");
    if (whole) FL_TRY(same_layout(whole, part));
    /* an entry's per-rank count in the all-gather: its numel; a vocabulary entry's the largest rank's (padded) */
    const size_t vpad = ((size_t)part->cfg.vocab_size + (size_t)size - 1) / (size_t)size * (size_t)part->cfg.dim;
    const size_t ns = max_entry(&part->layout) > vpad ? max_entry(&part->layout) : vpad;
    float *s = malloc(ns * sizeof(float)), *all = malloc(ns * (size_t)size * sizeof(float));
    float *w = whole ? malloc(max_entry(&whole->layout) * sizeof(float)) : NULL;
    fl_status st = (!s || !all || (whole && !w)) ? fl_errorf(FL_ERR_OOM, "tensor parallel: out of host memory") : FL_OK;
    for (int i = 0; st == FL_OK && i < part->layout.n; i++) {
        const fl_param_info *p = &part->layout.params[i];
        st = io_read(rd, i, s);
        const fl_tp_split sp = size > 1 ? fl_tp_entry_split(&part->layout, i) : FL_TP_REPLICATED;
        const int split = sp != FL_TP_REPLICATED;
        const size_t cnt = sp == FL_TP_VOCAB ? vpad : p->numel;
        if (st == FL_OK && cnt > p->numel) memset(s + p->numel, 0, (cnt - p->numel) * sizeof(float)); /* padding */
        if (st == FL_OK && split) st = fl_comm_all_gather(host_comm, s, all, cnt * (size_t)size, FL_F32);
        if (st != FL_OK || !whole) continue;
        if (split)
            for (int k = 0; k < size; k++) fl_tp_place(&whole->cfg, &whole->layout, i, size, k, all + (size_t)k * cnt, w);
        else
            memcpy(w, s, p->numel * sizeof(float)); /* replicated: rank 0's (a row-parallel bias: only rank 0 adds it) */
        st = io_write(wr, i, w);
    }
    free(s), free(all), free(w);
    return st;
}

fl_status fl_tp_gather(fl_model *part, fl_comm *host_comm, fl_model *whole, int grads) {
    if (grads && (fl_model_store_dtype(part) != FL_F32 || !fl_model_grads_f32(part) ||
                  (whole && !fl_model_grads_f32(whole))))
        return fl_errorf(FL_ERR_UNSUPPORTED, "tensor parallel: gathering gradients needs fp32 gradient buffers");
    const tp_io rd = {part, grads ? 1 : 0, NULL, NULL, FL_F32}, wr = {whole, grads ? 1 : 0, NULL, NULL, FL_F32};
    return gather_entries(part, host_comm, whole, &rd, &wr);
}

fl_status fl_tp_gather_params_host(fl_model *part, fl_comm *host_comm, const void *src, fl_dtype dt, fl_model *whole) {
    const tp_io rd = {part, 3, NULL, (void *)src, dt}, wr = {whole, 0, NULL, NULL, FL_F32};
    return gather_entries(part, host_comm, whole, &rd, &wr);
}

static fl_status state_dtype(fl_dtype dt) {
    return dt == FL_F32 || dt == FL_BF16 ? FL_OK : fl_errorf(FL_ERR_UNSUPPORTED, "tensor parallel: optimizer state "
                                                                 "of %s (F32 or BF16 only)", fl_dtype_name(dt));
}

fl_status fl_tp_gather_array(fl_model *part, fl_comm *host_comm, const fl_backend *src_be, const void *src,
                             fl_model *whole, const fl_backend *dst_be, void *dst, fl_dtype dt) {
    FL_TRY(state_dtype(dt));
    const tp_io rd = {part, 2, src_be, (void *)src, dt}, wr = {whole, 2, dst_be, dst, dt};
    return gather_entries(part, host_comm, whole, &rd, &wr);
}

fl_status fl_tp_scatter_array(fl_model *whole, const fl_backend *src_be, const void *src, fl_model *part,
                              const fl_backend *dst_be, void *dst, fl_dtype dt) {
    FL_TRY(state_dtype(dt));
    FL_TRY(same_layout(whole, part));
    const int size = part->cfg.tp_size > 1 ? part->cfg.tp_size : 1, r = part->cfg.tp_rank;
    const tp_io rd = {whole, 2, src_be, (void *)src, dt}, wr = {part, 2, dst_be, dst, dt};
    float *w = malloc(max_entry(&whole->layout) * sizeof(float)), *s = malloc(max_entry(&part->layout) * sizeof(float));
    fl_status st = w && s ? FL_OK : fl_errorf(FL_ERR_OOM, "tensor parallel: out of host memory staging one entry");
    for (int i = 0; st == FL_OK && i < whole->layout.n; i++) {
        st = io_read(&rd, i, w);
        if (st != FL_OK) break;
        fl_tp_take(&whole->cfg, &whole->layout, i, size, r, w, s);
        st = io_write(&wr, i, s);
    }
    free(w), free(s);
    return st;
}

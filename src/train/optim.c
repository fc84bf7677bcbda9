/* Optimizer state and updates over the flat parameter buffer. AdamW and SGD
 * run over the whole buffer in one call (fp32 or bf16 state); 8-bit AdamW
 * keeps block-wise state per parameter tensor, as bitsandbytes does. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/comm.h"
#include "fitllm/train.h"
#include "dp.h"

size_t fl_optim_state_bytes(const fl_optim_config *c, size_t n) {
    size_t es = c->state_dtype == FL_BF16 ? 2 : 4;
    switch (c->kind) {
    case FL_OPT_ADAMW: return 2 * n * es;
    case FL_OPT_SGD: return c->momentum != 0.0f ? n * es : 0;
    case FL_OPT_ADAMW8BIT: return fl_adam8bit_state_bytes(n);
    default: return 0;
    }
}

size_t fl_optim_state_bytes_layout(const fl_optim_config *c, const fl_param_layout *lay) {
    if (c->kind != FL_OPT_ADAMW8BIT) return fl_optim_state_bytes(c, lay->numel);
    size_t total = 0;
    for (int i = 0; i < lay->n; i++) total += fl_adam8bit_state_bytes(lay->params[i].numel);
    return total;
}

/* The trainable tensors: the layout's, or each LoRA adapter's A and B. */
static fl_status trainable(fl_optimizer *o, fl_model *model) {
    fl_lora_adapters ad;
    const fl_lora_adapters *st = fl_model_lora_adapters(model, &ad) ? &ad : NULL;
    int n = st ? 2 * st->n_mods : model->layout.n;
    o->w.t_off = calloc((size_t)n + 1, sizeof *o->w.t_off);
    o->w.t_n = calloc((size_t)n + 1, sizeof *o->w.t_n);
    if (!o->w.t_off || !o->w.t_n) return fl_errorf(FL_ERR_OOM, "optimizer bookkeeping: out of host memory");
    o->w.n_tensors = n;
    o->w.pt = o->w.gt = FL_F32;
    o->w.pes = o->w.ges = sizeof(float);
    if (st) {
        o->w.p = st->params;
        o->w.g = st->grads;
        o->w.n = st->numel;
        for (int j = 0; j < st->n_mods; j++) {
            o->w.t_off[2 * j] = st->off[2 * j];
            o->w.t_n[2 * j] = (size_t)st->cfg->r * st->mods[j].in;
            o->w.t_off[2 * j + 1] = st->off[2 * j + 1];
            o->w.t_n[2 * j + 1] = (size_t)st->mods[j].out * st->cfg->r;
        }
    } else {
        o->w.p = fl_model_params_data(model);
        o->w.g = fl_model_grads_data(model);
        o->w.pt = o->w.gt = fl_model_store_dtype(model);
        o->w.pes = o->w.ges = fl_dtype_size(o->w.pt);
        o->w.n = model->layout.numel;
        for (int i = 0; i < n; i++) {
            o->w.t_off[i] = model->layout.params[i].offset;
            o->w.t_n[i] = model->layout.params[i].numel;
        }
        if (fl_model_provider(model)) o->w.n = fl_model_store_numel(model); /* sharded (FSDP): the optimizer runs on this rank's shard */
        if (fl_model_provider(model) && o->cfg.kind != FL_OPT_ADAMW8BIT) { /* one elementwise range (8-bit: per tensor, below) */
            o->w.n_tensors = 1;
            o->w.t_off[0] = 0;
            o->w.t_n[0] = o->w.n;
        }
    }
    return FL_OK;
}

fl_status fl_optim_init(fl_optimizer *o, fl_model *model, const fl_optim_config *cfg) {
    return fl_optim_init_shard(o, model, cfg, 1, 0);
}

void fl_optim_8bit_piece(size_t n, size_t t_off, size_t t_n, int world, int rank, size_t *a, size_t *len) {
    size_t off, cl;
    fl_comm_chunk(n, world, rank, &off, &cl);
    size_t lo = off > t_off ? off : t_off, hi = off + cl < t_off + t_n ? off + cl : t_off + t_n;
    *a = 0;
    *len = 0;
    if (lo >= hi) return;
    size_t x = lo - t_off, y = hi - t_off; /* tensor-relative */
    if (fl_adam8bit_is_8bit(t_n)) {
        const size_t B = FL_ADAM8BIT_BLOCK;
        x = x / B * B;
        y = (y + B - 1) / B * B;
        if (y > t_n) y = t_n;
    }
    *a = x;
    *len = y - x;
}

/* ---- 8-bit AdamW under FULL_SHARD ------------------------------------------------------------
 *
 * Each unit is split among the ranks by fl_comm_chunk on its own (src/train/fsdp.c), so a rank edge
 * may cut a quantization block (256 elements from its tensor's start). The update of an element is
 * local; only the block's new absmax, which scales the requantized m and v of all its elements,
 * needs the block's other elements. So each rank keeps the codes of its part of such a block and
 * both absmax (the same bits on every rank that holds a part), and a step runs in two passes:
 *   1. for each part of a cut block: the update on a scratch copy of the part (its parameters,
 *      codes and scales), which yields the part's max |m| and max v (the kernel's absmax of the
 *      part alone); every cut block of the model has a slot, -FLT_MAX where a rank has no part;
 *   2. the max of the slots over the ranks (dist->max: exact, order-free), then the real update of
 *      every piece: whole blocks as in one process, each part of a cut block with the block's max as
 *      its absmax floor (fl_adam8bit_state.floor_m / floor_v), which the kernel's max over the part
 *      leaves as it is. Every element then gets one-process arithmetic: the same m, v, parameter
 *      and codes, and the block the same absmax, bit for bit.
 * A piece's state is one span: q_m[len], q_v[len] (padded to 4), absmax_m[nb], absmax_v[nb] over
 * the nb blocks the piece meets; the update binds views of it: the cut first block, the whole
 * blocks, the cut last block. */

/* group g's rank-r chunk, in flat (layout) elements, and its offset in rank r's shard */
static void fsdp_unit_piece(const fl_param_layout *lay, int g, int world, int rank, size_t *flat, size_t *len,
                            size_t *loc) {
    size_t at = 0, off, cl;
    for (int h = 0; h < g; h++) {
        fl_comm_chunk(lay->group_offset[h + 1] - lay->group_offset[h], world, rank, &off, &cl);
        at += cl;
    }
    fl_comm_chunk(lay->group_offset[g + 1] - lay->group_offset[g], world, rank, &off, &cl);
    *flat = lay->group_offset[g] + off;
    *len = cl;
    if (loc) *loc = at;
}

void fl_optim_8bit_fsdp_piece(const fl_param_layout *lay, int i, int world, int rank, size_t *a, size_t *len,
                              size_t *shard_off) {
    const fl_param_info *t = &lay->params[i];
    size_t f, cl, loc;
    fsdp_unit_piece(lay, t->group, world, rank, &f, &cl, &loc);
    size_t lo = f > t->offset ? f : t->offset, hi = f + cl < t->offset + t->numel ? f + cl : t->offset + t->numel;
    *a = *len = 0;
    *shard_off = loc;
    if (lo >= hi) return;
    *a = lo - t->offset;
    *len = hi - lo;
    *shard_off = loc + (lo - f);
}

int fl_optim_8bit_fsdp_slots(const fl_param_layout *lay, int world, int *edge_slot) {
    const size_t B = FL_ADAM8BIT_BLOCK;
    int n = 0;
    for (int g = 0; g < lay->n_groups; g++) {
        int last_i = -1;
        size_t last_b = 0;
        for (int e = 0; e <= world; e++) {
            int slot = -1;
            size_t f = lay->group_offset[g + 1], cl;
            if (e > 0 && e < world) fsdp_unit_piece(lay, g, world, e, &f, &cl, NULL); /* where rank e's piece starts */
            for (int i = 0; slot < 0 && e > 0 && e < world && i < lay->n; i++) {
                const fl_param_info *t = &lay->params[i];
                if (t->group != g || f <= t->offset || f >= t->offset + t->numel || !fl_adam8bit_is_8bit(t->numel) ||
                    (f - t->offset) % B == 0)
                    continue;
                size_t b = (f - t->offset) / B; /* strictly inside block b of tensor i */
                if (i != last_i || b != last_b) n++; /* several edges in one block (pieces < 256): one slot */
                last_i = i, last_b = b;
                slot = n - 1;
            }
            if (edge_slot) edge_slot[g * (world + 1) + e] = slot;
        }
    }
    return n;
}

size_t fl_adam8bit_piece_bytes(size_t t_n, size_t a, size_t len) {
    if (!len) return 0;
    if (!fl_adam8bit_is_8bit(t_n)) return 8 * len;
    const size_t B = FL_ADAM8BIT_BLOCK, nb = (a + len + B - 1) / B - a / B;
    return ((2 * len + 3) & ~(size_t)3) + 8 * nb;
}

/* The exchange scratch: the slots' partial absmax (m then v), then pass 1's copy of one part (its
 * parameters in fp32 width, codes, scales). */
static size_t x8_bytes(int n_slots) {
    return n_slots ? 2 * (size_t)n_slots * sizeof(float) + FL_ADAM8BIT_BLOCK * (4 + 2) + 2 * sizeof(float) : 0;
}

size_t fl_optim_8bit_fsdp_bytes(const fl_param_layout *lay, int world, int rank, size_t *scratch) {
    size_t total = 0;
    for (int i = 0; i < lay->n; i++) {
        size_t a, len, so;
        fl_optim_8bit_fsdp_piece(lay, i, world, rank, &a, &len, &so);
        total += fl_adam8bit_piece_bytes(lay->params[i].numel, a, len);
    }
    size_t x = x8_bytes(world > 1 ? fl_optim_8bit_fsdp_slots(lay, world, NULL) : 0);
    if (scratch) *scratch = x;
    return total + x;
}

/* A piece's state span: q_m, q_v, then the absmax of the nb blocks it meets (st->n_blocks = nb,
 * which the kernel never sees whole unless the piece is block-aligned). */
static void bind_piece(fl_adam8bit_state *st, size_t t_n, size_t a, size_t len, void *mem) {
    memset(st, 0, sizeof *st);
    st->n = len;
    if (!len) return;
    uint8_t *b = mem;
    if (!fl_adam8bit_is_8bit(t_n)) {
        st->m = (float *)b;
        st->v = (float *)(b + 4 * len);
        return;
    }
    const size_t B = FL_ADAM8BIT_BLOCK;
    st->n_blocks = (a + len + B - 1) / B - a / B;
    st->q_m = b;
    st->q_v = b + len;
    st->absmax_m = (float *)(b + ((2 * len + 3) & ~(size_t)3));
    st->absmax_v = st->absmax_m + st->n_blocks;
}

fl_status fl_optim_8bit_fsdp_copy(const fl_param_layout *lay, const size_t *a, const size_t *len, void *packed,
                                  void *full, int to_full) {
    size_t po = 0, fo = 0;
    for (int i = 0; i < lay->n; i++) {
        const size_t tn = lay->params[i].numel;
        fl_adam8bit_state ps, fs;
        bind_piece(&ps, tn, a[i], len[i], (char *)packed + po);
        FL_TRY(fl_adam8bit_state_bind(&fs, tn, (char *)full + fo));
        po += fl_adam8bit_piece_bytes(tn, a[i], len[i]);
        fo += fl_adam8bit_state_bytes(tn);
        if (!len[i]) continue;
        if (a[i] + len[i] > tn)
            return fl_errorf(FL_ERR_INTERNAL, "8-bit AdamW state: piece [%zu, +%zu) of tensor %s (%zu elements)", a[i],
                             len[i], lay->params[i].name, tn);
#define CP(dst, src, bytes) memcpy(to_full ? (void *)(dst) : (void *)(src), to_full ? (const void *)(src) : (const void *)(dst), bytes)
        if (ps.q_m) {
            const size_t b0 = a[i] / FL_ADAM8BIT_BLOCK;
            CP(fs.q_m + a[i], ps.q_m, len[i]);
            CP(fs.q_v + a[i], ps.q_v, len[i]);
            CP(fs.absmax_m + b0, ps.absmax_m, ps.n_blocks * sizeof(float));
            CP(fs.absmax_v + b0, ps.absmax_v, ps.n_blocks * sizeof(float));
        } else {
            CP(fs.m + a[i], ps.m, len[i] * sizeof(float));
            CP(fs.v + a[i], ps.v, len[i] * sizeof(float));
        }
#undef CP
    }
    return FL_OK;
}

fl_status fl_optim_8bit_piece_to_full(size_t tn, size_t a, size_t len, const void *packed, void *full) {
    if (!len) return FL_OK;
    if (a + len > tn) return fl_errorf(FL_ERR_INTERNAL, "8-bit AdamW state: piece [%zu, +%zu) of %zu", a, len, tn);
    fl_adam8bit_state ps, fs;
    bind_piece(&ps, tn, a, len, (void *)packed);
    FL_TRY(fl_adam8bit_state_bind(&fs, tn, full));
    if (ps.q_m) {
        const size_t b0 = a / FL_ADAM8BIT_BLOCK;
        memcpy(fs.q_m + a, ps.q_m, len);
        memcpy(fs.q_v + a, ps.q_v, len);
        memcpy(fs.absmax_m + b0, ps.absmax_m, ps.n_blocks * sizeof(float));
        memcpy(fs.absmax_v + b0, ps.absmax_v, ps.n_blocks * sizeof(float));
    } else {
        memcpy(fs.m + a, ps.m, len * sizeof(float));
        memcpy(fs.v + a, ps.v, len * sizeof(float));
    }
    return FL_OK;
}

/* The views of piece i for the update: k 0 its cut first block, 1 its whole blocks, 2 its cut last
 * block; *off the view's first element in the piece; 0 when the view is empty. *slot: the exchange
 * slot (cut views). */
static int piece_view(const fl_optimizer *o, int i, int k, fl_adam8bit_state *v, size_t *off, int *slot) {
    const fl_adam8bit_state *w = &o->q8.st[i];
    const size_t B = FL_ADAM8BIT_BLOCK, a = o->q8.p_a[i], len = o->q8.p_n[i], tn = o->w.t_n[i], e = a + len;
    memset(v, 0, sizeof *v);
    *off = 0;
    *slot = -1;
    if (!len) return 0;
    if (!w->q_m) { /* fp32 path: elementwise, one view */
        if (k != 1) return 0;
        *v = *w;
        return 1;
    }
    const size_t b0 = a / B, b1 = (e + B - 1) / B;
    /* the first block's part [a, h) and the block's own end */
    size_t h = (b0 + 1) * B < e ? (b0 + 1) * B : e, end0 = (b0 + 1) * B < tn ? (b0 + 1) * B : tn;
    int cut0 = a % B != 0 || h < end0;
    int cut1 = b1 - 1 > b0 && e % B != 0 && e < tn;
    size_t t0 = cut1 ? (b1 - 1) * B : e; /* where the cut last block's part starts */
    size_t x, y, bi;
    if (k == 0) {
        if (!cut0) return 0;
        x = a, y = h, bi = 0;
        *slot = o->q8.slot[2 * i];
    } else if (k == 2) {
        if (!cut1) return 0;
        x = t0, y = e, bi = b1 - 1 - b0;
        *slot = o->q8.slot[2 * i + 1];
    } else {
        x = cut0 ? h : a, y = t0, bi = cut0;
        if (y <= x) return 0;
    }
    v->n = y - x;
    v->n_blocks = (v->n + B - 1) / B;
    v->q_m = w->q_m + (x - a);
    v->q_v = w->q_v + (x - a);
    v->absmax_m = w->absmax_m + bi;
    v->absmax_v = w->absmax_v + bi;
    *off = x - a;
    return 1;
}

/* The state, the parameters, the gradients and the exchange scratch o->q8.x are the backend's memory
 * (device memory on a GPU): moved with its copies; the slots' maxima travel through a host array
 * (the exchange is a host-side all-gather) and back into x8, where the kernels read them as floors. */
static fl_status fsdp8_step(fl_optimizer *o, float lr, float scale) {
    const fl_backend *be = o->model->be;
    const fl_optim_config *c = &o->cfg;
    const size_t pes = o->w.pes, ges = o->w.ges, S = (size_t)o->q8.n_slots;
    float *part = o->q8.x; /* (2 S): max |m| then max v of each cut block (the floors pass 2 reads) */
    char *sp = (char *)o->q8.x + 2 * S * sizeof(float);
    uint8_t *sq = (uint8_t *)(sp + FL_ADAM8BIT_BLOCK * 4);
    float *sa = (float *)(sq + 2 * FL_ADAM8BIT_BLOCK);
    float *hpart = S ? malloc(2 * S * sizeof *hpart) : NULL; /* the slots in host memory */
    if (S && !hpart) return fl_errorf(FL_ERR_OOM, "8-bit AdamW (FULL_SHARD): out of host memory");
    fl_status s = FL_OK;
#define UPDATE(pp, gg, st)                                                                                             \
    FL_RUN(be, adam8bit_update, pp, o->w.pt, gg, o->w.gt, st, lr, c->beta1, c->beta2, c->eps, c->weight_decay,         \
           o->step, scale)
#define TRY8(x) do { if ((s = (x)) != FL_OK) goto done; } while (0)
    for (size_t k = 0; k < 2 * S; k++) hpart[k] = -3.40282347e+38f; /* no part here: the max's identity */
    /* pass 1: each cut part updated on a copy, for its absmax */
    for (int i = 0; i < o->w.n_tensors; i++)
        for (int k = 0; k < 3; k += 2) {
            fl_adam8bit_state v, w;
            size_t off;
            int slot;
            if (!piece_view(o, i, k, &v, &off, &slot)) continue;
            if (slot < 0 || slot >= o->q8.n_slots || v.n >= FL_ADAM8BIT_BLOCK)
                TRY8(fl_errorf(FL_ERR_INTERNAL, "8-bit AdamW (FULL_SHARD): tensor %d's cut block has no slot", i));
            size_t at = o->q8.p_s[i] + off;
            TRY8(FL_RUN(be, copy, sp, (const char *)o->w.p + at * pes, v.n * pes));
            TRY8(FL_RUN(be, copy, sq, v.q_m, v.n));
            TRY8(FL_RUN(be, copy, sq + FL_ADAM8BIT_BLOCK, v.q_v, v.n));
            TRY8(FL_RUN(be, copy, sa, v.absmax_m, sizeof(float)));
            TRY8(FL_RUN(be, copy, sa + 1, v.absmax_v, sizeof(float)));
            w = v;
            w.q_m = sq, w.q_v = sq + FL_ADAM8BIT_BLOCK, w.absmax_m = sa, w.absmax_v = sa + 1;
            TRY8(UPDATE(sp, (const char *)o->w.g + at * ges, &w));
            TRY8(FL_RUN(be, to_host, &hpart[slot], sa, sizeof(float)));
            TRY8(FL_RUN(be, to_host, &hpart[S + (size_t)slot], sa + 1, sizeof(float)));
        }
    /* the blocks' max over the ranks, then into x8 for the kernels */
    if (S) {
        if (!o->shard.dist || !o->shard.dist->max)
            TRY8(fl_errorf(FL_ERR_INTERNAL, "8-bit AdamW (FULL_SHARD): %zu cut blocks but no exchange", S));
        TRY8(fl_error_prefix(o->shard.dist->max(o->shard.dist->ud, hpart, 2 * S), "8-bit AdamW (FULL_SHARD): the scales of the "
                             "blocks cut by a rank edge"));
        TRY8(FL_RUN(be, to_device, part, hpart, 2 * S * sizeof(float)));
    }
    /* pass 2: the update, cut parts floored at their block's max */
    for (int i = 0; i < o->w.n_tensors; i++)
        for (int k = 0; k < 3; k++) {
            fl_adam8bit_state v;
            size_t off;
            int slot;
            if (!piece_view(o, i, k, &v, &off, &slot)) continue;
            if (k != 1) v.floor_m = &part[slot], v.floor_v = &part[S + (size_t)slot];
            size_t at = o->q8.p_s[i] + off;
            TRY8(UPDATE((char *)o->w.p + at * pes, (const char *)o->w.g + at * ges, &v));
        }
#undef UPDATE
#undef TRY8
done:
    free(hpart);
    return s;
}

/* 8-bit AdamW on a sharded model: the pieces (fl_optim_8bit_fsdp_piece), their slots, one OPTIM
 * span for the state and one for the exchange. */
static fl_status fsdp8_init(fl_optimizer *o, fl_model *model, int world, int rank) {
    const fl_param_layout *lay = &model->layout;
    const fl_param_provider *pp = fl_model_provider(model);
    for (int g = 0; g < lay->n_groups; g++) { /* the model's shard is this world's and rank's */
        size_t f, cl, loc;
        fsdp_unit_piece(lay, g, world, rank, &f, &cl, &loc);
        if (pp->flat_off[g] != f || pp->len[g] != cl || pp->shard_off[g] != loc)
            return fl_errorf(FL_ERR_INTERNAL, "8-bit AdamW (FULL_SHARD): unit %d of the model's shard is not rank %d of "
                             "%d's piece", g, rank, world);
    }
    int n = o->w.n_tensors;
    int *edge = calloc((size_t)lay->n_groups * ((size_t)world + 1) + 1, sizeof *edge);
    o->q8.p_s = calloc((size_t)n + 1, sizeof *o->q8.p_s);
    o->q8.slot = calloc(2 * (size_t)n + 1, sizeof *o->q8.slot);
    fl_status s = edge && o->q8.p_s && o->q8.slot ? FL_OK : fl_errorf(FL_ERR_OOM, "8-bit optimizer bookkeeping: out of "
                                                                    "host memory");
    if (s == FL_OK) o->q8.n_slots = world > 1 ? fl_optim_8bit_fsdp_slots(lay, world, edge) : 0;
    for (int i = 0; s == FL_OK && i < n; i++) {
        fl_optim_8bit_fsdp_piece(lay, i, world, rank, &o->q8.p_a[i], &o->q8.p_n[i], &o->q8.p_s[i]);
        o->q8.state_bytes += fl_adam8bit_piece_bytes(o->w.t_n[i], o->q8.p_a[i], o->q8.p_n[i]);
        /* a cut first block's part starts inside it (rank's edge) or ends inside it (the next rank's) */
        const size_t B = FL_ADAM8BIT_BLOCK, a = o->q8.p_a[i], e = a + o->q8.p_n[i];
        const int *es = edge ? edge + (size_t)lay->params[i].group * ((size_t)world + 1) : NULL;
        o->q8.slot[2 * i] = a % B ? es[rank] : es[rank + 1];
        o->q8.slot[2 * i + 1] = e % B ? es[rank + 1] : -1;
    }
    free(edge);
    if (s == FL_OK) s = fl_backend_calloc(model->be, model->pool, FL_TAG_OPTIM, o->q8.state_bytes, &o->q8.state);
    size_t off = 0;
    for (int i = 0; s == FL_OK && i < n; i++) {
        bind_piece(&o->q8.st[i], o->w.t_n[i], o->q8.p_a[i], o->q8.p_n[i], (char *)o->q8.state + off);
        off += fl_adam8bit_piece_bytes(o->w.t_n[i], o->q8.p_a[i], o->q8.p_n[i]);
    }
    o->q8.x_bytes = x8_bytes(o->q8.n_slots);
    if (s == FL_OK && o->q8.x_bytes) s = fl_backend_calloc(model->be, model->pool, FL_TAG_OPTIM, o->q8.x_bytes, &o->q8.x);
    return s;
}

#define STATE_SLICE ((size_t)16 << 20) /* bytes per slice of a state copy */

fl_status fl_optim_state_read(const fl_optimizer *o, void *host, const void *state, size_t bytes) {
    const fl_backend *be = o->home.be;
    for (size_t a = 0; a < bytes; a += STATE_SLICE) {
        const size_t n = bytes - a < STATE_SLICE ? bytes - a : STATE_SLICE;
        FL_TRY(FL_RUN(be, to_host, (char *)host + a, (const char *)state + a, n));
        if (o->home.disk) FL_TRY(fl_mem_disk_advise(o->home.pool, (const char *)state + a, n, FL_DISK_RELEASE));
    }
    return FL_OK;
}

fl_status fl_optim_state_write(const fl_optimizer *o, void *state, const void *host, size_t bytes) {
    const fl_backend *be = o->home.be;
    for (size_t a = 0; a < bytes; a += STATE_SLICE) {
        const size_t n = bytes - a < STATE_SLICE ? bytes - a : STATE_SLICE;
        FL_TRY(FL_RUN(be, to_device, (char *)state + a, (const char *)host + a, n));
        if (o->home.disk) FL_TRY(fl_mem_disk_advise(o->home.pool, (char *)state + a, n, FL_DISK_RELEASE));
    }
    return FL_OK;
}

static fl_status state_fill(void *ud, void *dst, size_t off, size_t n) {
    const fl_optim_state_src *x = ud;
    return fl_optim_state_read(x->o, dst, (const char *)x->arr + off * x->es, n * x->es);
}

void fl_optim_state_source(const fl_optimizer *o, fl_st_write_tensor *t, const void *arr, size_t es,
                           fl_optim_state_src *src) {
    *src = (fl_optim_state_src){o, arr, es};
    t->data = o->home.disk ? NULL : arr;
    t->be = o->home.disk ? NULL : o->home.be;
    t->fill_range = o->home.disk ? state_fill : NULL;
    t->fill_ud = o->home.disk ? src : NULL;
}

static size_t g_offload_piece = (size_t)4 << 20;
void fl_optim_set_offload_piece(size_t elements) { g_offload_piece = elements ? elements : (size_t)4 << 20; }

fl_status fl_optim_init_shard(fl_optimizer *o, fl_model *model, const fl_optim_config *cfg, int world, int rank) {
    return fl_optim_init_offload(o, model, cfg, world, rank, NULL);
}

fl_status fl_optim_init_offload(fl_optimizer *o, fl_model *model, const fl_optim_config *cfg, int world, int rank,
                                const fl_optim_offload *off) {
    memset(o, 0, sizeof *o);
    if (world < 1 || rank < 0 || rank >= world)
        return fl_errorf(FL_ERR_INVALID, "optimizer set-up: rank %d of %d", rank, world);

    if (cfg->kind < 0 || cfg->kind >= FL_OPT_COUNT) return fl_errorf(FL_ERR_INVALID, "unknown optimizer %d", (int)cfg->kind);
    if (cfg->state_dtype != FL_F32 && cfg->state_dtype != FL_BF16)
        return fl_errorf(FL_ERR_INVALID, "optimizer state dtype must be F32 or BF16");
    if (off && cfg->kind == FL_OPT_ADAMW8BIT)
        return fl_errorf(FL_ERR_UNSUPPORTED, "CPU offload of AdamW8bit is not supported (its block-wise state is "
                         "already a quarter of AdamW's): use --optimizer AdamW or SGD with the offload, or AdamW8bit "
                         "with a strategy without offload");
    if (off && (!off->be || !off->pool)) return fl_errorf(FL_ERR_INVALID, "CPU offload: no host backend or host pool");
    o->cfg = *cfg;
    o->name = fl_optim_name(cfg->kind);
    o->model = model;
    o->home.be = off ? off->be : model->be;
    o->home.pool = off ? (off->state_pool ? off->state_pool : off->pool) : model->pool;
    o->home.hpool = off ? off->pool : NULL;
    o->home.disk = off && off->state_pool;
    o->home.params_host = off && off->params_host;
    o->home.ppool = off && off->params_host ? off->param_pool : NULL;
    /* the precision policy fixes the state dtype of the full parameters (bf16-true: bf16);
     * LoRA adapters are fp32 under every policy */
    if (!model->lora && model->prec.optim_dtype == FL_BF16) o->cfg.state_dtype = FL_BF16;
    o->amp.on = model->prec.loss_scaling; /* the precision policy's loss scaling: its interface, GradScaler's state */
    o->amp.scaler = o->amp.on ? &fl_loss_scaler_dynamic : NULL;
    fl_loss_scale_init(&o->amp.ls);
    fl_status s = trainable(o, model);
    const int sharded = fl_model_provider(model) && !model->lora; /* FULL_SHARD: the whole shard is this rank's */
    if (s == FL_OK) fl_comm_chunk(o->w.n, sharded ? 1 : world, sharded ? 0 : rank, &o->shard.off, &o->shard.len);
    /* the backend must implement the update for these dtypes: found here, not at the first step */
    if (s == FL_OK) {
        const fl_backend *be = o->home.be; /* offload: the host's kernels run it */
        fl_op op = cfg->kind == FL_OPT_ADAMW ? FL_OP_ADAMW : cfg->kind == FL_OPT_SGD ? FL_OP_SGD : FL_OP_ADAM8BIT;
        if (!be->supports_op(be, op, o->w.pt, o->w.gt, o->cfg.state_dtype))
            s = fl_errorf(FL_ERR_UNSUPPORTED, "backend '%s' does not implement %s for parameters %s, gradients %s, state "
                          "%s (optimizer set-up)", be->name, fl_op_name(op), fl_dtype_name(o->w.pt), fl_dtype_name(o->w.gt),
                          fl_dtype_name(o->cfg.state_dtype));
    }
    size_t bytes = o->shard.len * (o->cfg.state_dtype == FL_BF16 ? 2 : 4); /* this rank's range */
    if (s != FL_OK) {
    } else if (cfg->kind == FL_OPT_ADAMW) {
        s = fl_backend_calloc(o->home.be, o->home.pool, FL_TAG_OPTIM, bytes, (void **)&o->st.m);
        if (s == FL_OK) s = fl_backend_calloc(o->home.be, o->home.pool, FL_TAG_OPTIM, bytes, (void **)&o->st.v);
    } else if (cfg->kind == FL_OPT_SGD) {
        if (cfg->momentum != 0.0f) s = fl_backend_calloc(o->home.be, o->home.pool, FL_TAG_OPTIM, bytes, (void **)&o->st.buf);
    } else {
        /* 8-bit: one OPTIM allocation, bound tensor by tensor (zeroed = fresh state); under ZeRO
         * each tensor's piece (whole blocks) that meets this rank's chunk */
        o->q8.st = calloc((size_t)o->w.n_tensors + 1, sizeof *o->q8.st);
        o->q8.p_a = calloc((size_t)o->w.n_tensors + 1, sizeof *o->q8.p_a);
        o->q8.p_n = calloc((size_t)o->w.n_tensors + 1, sizeof *o->q8.p_n);
        if (!o->q8.st || !o->q8.p_a || !o->q8.p_n) s = fl_errorf(FL_ERR_OOM, "8-bit optimizer bookkeeping: out of host memory");
        if (s == FL_OK && sharded) s = fsdp8_init(o, model, world, rank);
        for (int i = 0; s == FL_OK && !sharded && i < o->w.n_tensors; i++) {
            fl_optim_8bit_piece(o->w.n, o->w.t_off[i], o->w.t_n[i], world, rank, &o->q8.p_a[i], &o->q8.p_n[i]);
            o->q8.state_bytes += fl_adam8bit_state_bytes_ex(o->q8.p_n[i], fl_adam8bit_is_8bit(o->w.t_n[i]));
        }
        if (s == FL_OK && !sharded)
            s = fl_backend_calloc(model->be, model->pool, FL_TAG_OPTIM, o->q8.state_bytes, &o->q8.state);
        size_t off = 0;
        for (int i = 0; s == FL_OK && !sharded && i < o->w.n_tensors; i++) {
            int e8 = fl_adam8bit_is_8bit(o->w.t_n[i]);
            s = fl_adam8bit_state_bind_ex(&o->q8.st[i], o->q8.p_n[i], e8, (char *)o->q8.state + off);
            off += fl_adam8bit_state_bytes_ex(o->q8.p_n[i], e8);
        }
    }
    /* offload to a device the host cannot read: the staging of one piece of the parameters and gradients
     * (host tier, held for the run as DeepSpeed's pinned buffers) */
    if (s == FL_OK && off) o->home.piece = o->shard.len < g_offload_piece ? o->shard.len : g_offload_piece;
    if (s == FL_OK && off && !off->params_host && !fl_backend_host_memory(model->be)) {
        s = fl_mem_alloc(o->home.hpool, FL_TAG_WORKSPACE, o->home.piece * o->w.pes, &o->home.hp);
        if (s == FL_OK) s = fl_mem_alloc(o->home.hpool, FL_TAG_WORKSPACE, o->home.piece * o->w.ges, &o->home.hg);
    }
    if (s == FL_OK && (o->home.hp || o->home.disk || o->home.ppool)) o->home.update = &fl_optim_offload_update;
    if (s == FL_OK && model->be->step_scalars) o->ss_home = model->be->step_scalars(model->be, FL_SS_MAX);
    if (s != FL_OK && o->home.disk && o->home.pool->raw_why && o->home.pool->raw_why(o->home.pool->raw_ud)[0]) {
        /* the disk refused the state's files (missing space, a file-size limit): a disk fault, not a memory
         * budget (no smaller micro batch helps) */
        char why[512];
        snprintf(why, sizeof why, "%s", o->home.pool->raw_why(o->home.pool->raw_ud));
        fl_optim_free(o);
        return fl_errorf(FL_ERR_IO, "allocating %s state (NVMe offload: %zu bytes of this rank's state in files under "
                         "nvme_path): %s; free space there or give another --nvme_path", fl_optim_name(cfg->kind),
                         bytes * (cfg->kind == FL_OPT_ADAMW ? 2 : 1), why);
    }
    if (s != FL_OK) {
        fl_optim_free(o);
        return fl_error_prefix(s, "allocating %s state%s", fl_optim_name(cfg->kind), off ? " (CPU offload: host tier)" : "");
    }
    return FL_OK;
}

void fl_optim_free(fl_optimizer *o) {
    if (!o->model) return;
    fl_mem_pool *sp = o->home.pool; /* the model's pool, or the offload tier's */
    fl_mem_free(sp, o->st.m);
    fl_mem_free(sp, o->st.v);
    fl_mem_free(sp, o->st.buf);
    fl_mem_free(o->home.hpool, o->home.hp);
    fl_mem_free(o->home.hpool, o->home.hg);
    fl_mem_free(o->model->pool, o->q8.state);
    fl_mem_free(o->model->pool, o->q8.x);
    free(o->q8.p_s);
    free(o->q8.slot);
    free(o->q8.st);
    free(o->q8.p_a);
    free(o->q8.p_n);
    free(o->w.t_off);
    free(o->w.t_n);
    memset(o, 0, sizeof *o);
}

/* Whether this rank holds only its range of the reduced gradients (ZeRO-2, and ZeRO-3 / FSDP whose
 * optimizer sees only the rank's shard: [s_off, s_off + s_len) is the whole of it). */
static int grads_sharded(const fl_optimizer *o) { return o->shard.dist && o->shard.dist->stage >= 2; }

static const void *g_at(const fl_optimizer *o, size_t off) { return (const char *)o->w.g + off * o->w.ges; }

/* the backend whose memory holds the gradients: the model's, or under parameter offload the host's */
static const fl_backend *grads_be(const fl_optimizer *o) { return o->home.params_host ? o->home.be : o->model->be; }

/* Loss scaling's overflow check (fitllm/train.h): under ZeRO-2 each rank checks its range and the verdicts are
 * summed, so every rank decides alike. */
fl_status fl_optim_found_inf(const fl_optimizer *o, float inv_scale, int *found) {
    *found = 0;
    const fl_backend *be = grads_be(o);
    if (!grads_sharded(o)) {
        FL_TRY(FL_RUN(be, check_finite, o->w.g, o->w.gt, o->w.n, inv_scale, found));
        return o->shard.dist && o->shard.dist->any ? o->shard.dist->any(o->shard.dist->ud, found) : FL_OK; /* tensor parallel */
    }
    FL_TRY(FL_RUN(be, check_finite, g_at(o, o->shard.off), o->w.gt, o->shard.len, inv_scale, found));
    double v = *found != 0;
    FL_TRY(o->shard.dist->sum(o->shard.dist->ud, &v, 1));
    *found = v > 0;
    return FL_OK;
}

fl_status fl_optim_grad_sumsq(const fl_optimizer *o, size_t off, size_t len, double *v) {
    const fl_backend *be = grads_be(o);
    *v = 0.0;
    if (!len) return FL_OK;
    return FL_RUN(be, sumsq, g_at(o, off), o->w.gt, len, v);
}

/* The squared global gradient norm: over several ranks the hooks' (data parallel: the ranks' chunks in rank order,
 * src/train/zero.c; tensor / pipeline parallel: the whole model's), else the one range's in double (the bits of
 * the one chunk a single rank's order has). */
static fl_status grad_sumsq(const fl_optimizer *o, double *out) {
    if (o->shard.dist && o->shard.dist->grad_sumsq) return o->shard.dist->grad_sumsq(o->shard.dist->ud, o, out);
    return fl_optim_grad_sumsq(o, 0, o->w.n, out);
}

double fl_grad_norm(const fl_model *m) {
    size_t n = fl_model_store_numel(m); /* sharded: this rank's shard only */
    fl_lora_adapters ad;
    double v = 0.0;
    if (fl_model_lora_adapters(m, &ad))
        (void)FL_RUN(m->be, sumsq, ad.grads, FL_F32, ad.numel, &v);
    else
        (void)FL_RUN(m->be, sumsq, fl_model_grads_data(m), fl_model_store_dtype(m), n, &v);
    return sqrt(v);
}

fl_status fl_optim_update_range(const fl_optimizer *o, const fl_backend *be, void *p, const void *g, size_t st, size_t n,
                                float lr, float scale, int step) {
    const fl_optim_config *c = &o->cfg;
    const size_t ses = c->state_dtype == FL_BF16 ? 2 : 4;
    void *m = o->st.m ? (char *)o->st.m + st * ses : NULL, *v = o->st.v ? (char *)o->st.v + st * ses : NULL;
    void *buf = o->st.buf ? (char *)o->st.buf + st * ses : NULL;
    if (c->kind == FL_OPT_ADAMW)
        return FL_RUN(be, adamw_update, p, o->w.pt, g, o->w.gt, m, v, c->state_dtype, n, lr, c->beta1, c->beta2, c->eps,
                      c->weight_decay, step, scale);
    if (c->kind == FL_OPT_SGD)
        return FL_RUN(be, sgd_update, p, o->w.pt, g, o->w.gt, buf, c->state_dtype, n, lr, c->momentum, c->dampening,
                      c->weight_decay, c->nesterov, step == 1, scale);
    return fl_errorf(FL_ERR_INTERNAL, "optimizer update: %s is not elementwise", o->name);
}

/* The update of elements [a, a + n) of the rank's range as update `step`, unscaled, where the update runs on host
 * memory in place (fsdp.c's unit-by-unit update on the fetch worker; not staged). Elementwise, so the units' calls
 * together give the bits of the whole range's (the offload's pieces already rely on it). */
fl_status fl_optim_update_part(const fl_optimizer *o, size_t a, size_t n, float lr, int step) {
    if (o->home.hp || o->cfg.kind == FL_OPT_ADAMW8BIT || a + n > o->shard.len)
        return fl_errorf(FL_ERR_INTERNAL, "optimizer: a part of the update [%zu, %zu) cannot run on its own", a, a + n);
    if (!n) return FL_OK;
    if (o->home.update) return o->home.update->range(o, a, n, lr, 1.0f, step); /* NVMe: its residency hints */
    const size_t at = o->shard.off + a;
    return fl_optim_update_range(o, o->home.be, (char *)o->w.p + at * o->w.pes, g_at(o, at), a, n, lr, 1.0f, step);
}

/* The step whose update already ran part by part (o->home.updated): the norm it reports, the count. The gradients
 * are what they were (an update writes the parameters and the state only), so the norm is the one the whole
 * update would have reported; a non-finite one still ends the run (the weights moved already: the run stops
 * without saving them, as a refused update does). */
static fl_status step_updated(fl_optimizer *o, float max_norm, double *norm_out) {
    o->home.updated = 0;
    if (o->amp.on || max_norm > 0)
        return fl_errorf(FL_ERR_INTERNAL, "optimizer: an update run ahead with loss scaling or clipping on");
    if (norm_out) {
        double sq;
        FL_TRY(grad_sumsq(o, &sq));
        *norm_out = sqrt(sq);
        if (!isfinite(*norm_out)) return fl_errorf(FL_ERR_NONFINITE, "the gradient norm is %s", isnan(*norm_out) ? "NaN" : "inf");
    }
    o->step++;
    return FL_OK;
}

/* Issue 30 item 5: whether this update keeps its norm and clip scale on the device (o->ss lent by the step): one
 * process (no data-parallel or tensor-parallel hooks), the update on the model's backend in place (no offload), AdamW
 * or SGD with the backend's _ss slot, a norm asked for. */
int fl_optim_device_step(const fl_optimizer *o) {
    const fl_backend *be = o->model->be;
    const fl_optim_kind k = o->cfg.kind;
    if (!be->grad_norm_dev || o->home.updated) return 0;
    if (o->shard.dist || o->home.be != be || o->home.hp || o->home.disk || o->home.ppool || o->home.params_host)
        return 0;
    return (k == FL_OPT_ADAMW && be->adamw_update_ss) || (k == FL_OPT_SGD && be->sgd_update_ss) ||
           (k == FL_OPT_ADAMW8BIT && be->adam8bit_update_ss && !o->q8.p_s); /* (not FULL_SHARD's pieces) */
}
static int norm_on_device(const fl_optimizer *o, float max_norm, const double *norm_out) {
    return o->ss && (norm_out || max_norm > 0) && fl_optim_device_step(o);
}

/* The norm, the clip scale and the update on the device: ss[FL_SS_SCALE] is the scale (NaN: the update skipped) */
static fl_status step_on_device(fl_optimizer *o, float lr, float max_norm, float scale) {
    const fl_backend *be = o->model->be;
    const fl_optim_config *c = &o->cfg;
    FL_TRY(FL_RUN(be, grad_norm_dev, o->w.g, o->w.gt, o->w.n, max_norm, scale, o->ss_nloss, o->ss));
    o->ss_pending = 1;
    o->step++;
    const size_t n = o->shard.len;
    void *p = (char *)o->w.p + o->shard.off * o->w.pes, *g = (void *)g_at(o, o->shard.off);
    if (c->kind == FL_OPT_ADAMW)
        return FL_RUN(be, adamw_update_ss, p, o->w.pt, g, o->w.gt, o->st.m, o->st.v, c->state_dtype, n, lr, c->beta1,
                      c->beta2, c->eps, c->weight_decay, o->step, o->ss);
    if (c->kind == FL_OPT_ADAMW8BIT) { /* per tensor, as the host path (its block-wise state is per tensor) */
        for (int i = 0; i < o->w.n_tensors; i++) {
            if (!o->q8.p_n[i]) continue;
            const size_t off = o->w.t_off[i] + o->q8.p_a[i];
            FL_TRY(FL_RUN(be, adam8bit_update_ss, (char *)o->w.p + off * o->w.pes, o->w.pt,
                          (const char *)o->w.g + off * o->w.ges, o->w.gt, &o->q8.st[i], lr, c->beta1,
                          c->beta2, c->eps, c->weight_decay, o->step, o->ss));
        }
        return FL_OK;
    }
    return FL_RUN(be, sgd_update_ss, p, o->w.pt, g, o->w.gt, o->st.buf, c->state_dtype, n, lr, c->momentum,
                  c->dampening, c->weight_decay, c->nesterov, o->step == 1, o->ss);
}

fl_status fl_optim_step_finish(fl_optimizer *o, const double *ss, double *norm_out) {
    if (!o->ss_pending) return FL_OK;
    o->ss_pending = 0;
    const double norm = ss[FL_SS_NORM];
    if (norm_out) *norm_out = norm;
    if (isnan(ss[FL_SS_SCALE])) o->step--; /* refused on the device: the weights stay as they were */
    if (o->amp.scaler) { /* fp16: the device's overflow verdict, the scale's update as the host path makes it */
        o->amp.skipped = o->amp.scaler->update(o, ss[FL_SS_FOUND] != 0.0);
        if (o->amp.skipped) {
            if (norm_out) *norm_out = NAN;
            return FL_OK;
        }
    }
    if (isfinite(norm)) return FL_OK;
    return fl_errorf(FL_ERR_NONFINITE, "the gradient norm is %s", isnan(norm) ? "NaN" : "inf");
}

fl_status fl_optim_step(fl_optimizer *o, float lr, float max_norm, double *norm_out) {
    fl_model *m = o->model;
    const fl_backend *be = m->be;
    if (!o->w.g) return fl_errorf(FL_ERR_INVALID, "optimizer step without gradient buffers");
    if (o->shard.dist && o->shard.dist->reduce) FL_TRY(o->shard.dist->reduce(o->shard.dist->ud, o)); /* TP LoRA */
    double norm = -1.0;
    float scale = 1.0f;
    o->amp.skipped = 0;
    o->ss_pending = 0;
    if (o->home.updated) return step_updated(o, max_norm, norm_out); /* FULL_SHARD offload, unit by unit (fsdp.c) */
    if (o->amp.scaler && be->check_finite_dev && norm_on_device(o, max_norm, norm_out)) {
        /* fp16 on the device: the overflow flag beside the norm (the update skips itself on it), read with them at
         * the step's end, where fl_optim_step_finish hands it to the scaler; no wait inside the step */
        const float inv = o->amp.scaler->inv(o);
        FL_TRY(FL_RUN(be, check_finite_dev, o->w.g, o->w.gt, o->w.n, inv, o->ss));
        if (norm_out) *norm_out = NAN;
        FL_TRY(step_on_device(o, lr, max_norm, inv));
        if (!m->lora) fl_model_sync_compute_copy(m);
        return FL_OK;
    }
    if (o->amp.scaler) { /* fp16 loss scaling (fl_loss_scaler): the overflow check, the scale's update */
        int skip;
        FL_TRY(o->amp.scaler->unscale(o, &scale, &skip)); /* unscale inside the update */
        if (skip) { /* overflow: no update, scale backed off */
            o->amp.skipped = 1;
            if (norm_out) *norm_out = NAN;
            return FL_OK;
        }
    }
    if (norm_on_device(o, max_norm, norm_out)) { /* read by the caller at the step's end: fl_optim_step_finish */
        if (norm_out) *norm_out = NAN;
        FL_TRY(step_on_device(o, lr, max_norm, scale));
        if (!m->lora) fl_model_sync_compute_copy(m); /* mixed precision: matmuls read the refreshed copy */
        return FL_OK;
    }
    if (max_norm > 0 || norm_out) {
        double sq;
        FL_TRY(grad_sumsq(o, &sq));
        norm = sqrt(sq) * scale;
    }
    /* inf/NaN gradients (no loss scaling to absorb them): refuse the update, the weights stay as they were */
    if ((max_norm > 0 || norm_out) && !isfinite(norm)) return fl_errorf(FL_ERR_NONFINITE, "the gradient norm is %s", isnan(norm) ? "NaN" : "inf");
    if (max_norm > 0) {
        double coef = max_norm / (norm + 1e-6);
        if (coef < 1.0) scale = (float)(coef * scale);
    }
    if (norm_out) *norm_out = norm;
    o->step++;
    const fl_optim_config *c = &o->cfg;
    /* this rank's range (everything but under ZeRO): elementwise updates, so a range updates
     * with the same arithmetic as the whole buffer does */
    size_t n = o->shard.len;
    void *p = (char *)o->w.p + o->shard.off * o->w.pes, *g = (void *)g_at(o, o->shard.off);
    if (c->kind != FL_OPT_ADAMW8BIT && o->home.update) { /* offloaded: staged, or on NVMe */
        FL_TRY(o->home.update->range(o, 0, n, lr, scale, o->step));
    } else if (c->kind != FL_OPT_ADAMW8BIT) {
        FL_TRY(fl_optim_update_range(o, o->home.be, p, g, 0, n, lr, scale, o->step)); /* offload on host memory: in place, host state */
    } else if (o->q8.p_s) { /* FULL_SHARD: pieces of units, blocks cut by rank edges (above) */
        FL_TRY(fsdp8_step(o, lr, scale));
    } else {
        /* block-wise state is per tensor, as bitsandbytes keeps it per parameter */
        for (int i = 0; i < o->w.n_tensors; i++) {
            if (!o->q8.p_n[i]) continue; /* ZeRO: not in this rank's chunk */
            size_t off = o->w.t_off[i] + o->q8.p_a[i];
            FL_TRY(FL_RUN(be, adam8bit_update, (char *)o->w.p + off * o->w.pes, o->w.pt,
                          (const char *)o->w.g + off * o->w.ges, o->w.gt, &o->q8.st[i], lr, c->beta1,
                          c->beta2, c->eps, c->weight_decay, o->step, scale));
        }
    }
    /* ZeRO: every rank's updated range to every rank before anything reads the weights */
    if (o->shard.dist && o->shard.dist->stage > 0 && o->shard.dist->gather) FL_TRY(o->shard.dist->gather(o->shard.dist->ud, o));
    if (!m->lora) fl_model_sync_compute_copy(m); /* mixed precision: matmuls read the refreshed copy */
    return FL_OK;
}

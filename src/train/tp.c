/* Tensor parallelism's part of the training step (fitllm/tp.h): the optimizer of a rank's slice decides on
 * the whole model's gradient. The slice's own parts are src/model/tp.c and graph_tp.c. */
#include <stdlib.h>
#include <string.h>

#include "fitllm/lora.h"
#include "fitllm/pp.h"
#include "fitllm/tp.h"
#include "dp.h"

/* v (one double per rank, as pairs of F32 words: the all-gather copies bits) summed in rank order */
static fl_status sum_ranks(fl_comm *c, double v, double *out) {
    const int n = fl_comm_size(c);
    double stack[16], *all = n <= 16 ? stack : malloc((size_t)n * sizeof *all);
    if (!all) return fl_errorf(FL_ERR_OOM, "tensor parallel: out of host memory");
    fl_status s = fl_comm_all_gather(c, &v, all, (size_t)n * 2, FL_F32);
    double acc = 0;
    for (int r = 0; s == FL_OK && r < n; r++) acc += all[r];
    *out = acc;
    if (all != stack) free(all);
    return s;
}

/* v summed over the group in rank order, then (TP x PP) over the pipeline's stages in stage order: every rank of the
 * model-parallel ranks gets the same bits */
static fl_status sum_group(const fl_tp_dist *d, double v, double *out) {
    FL_TRY(sum_ranks(d->comm, v, out));
    return d->pipe ? sum_ranks(d->pipe, *out, out) : FL_OK;
}

/* the squared norm of the whole model's gradient: each rank's split entries, and rank 0's replicated ones (the
 * same bits on every rank; a row-parallel bias trains on rank 0 alone). Under DDP on the data-parallel axis
 * every rank of it holds the same reduced gradient: the tensor-parallel group's sum is the whole norm. Under
 * ZeRO-1/2 there a rank adds the part of each entry in its chunk [off, off + len) of the slice's buffer (ZeRO-2
 * holds no other reduced gradient), the axis sums the chunks in rank order, then the group. */
/* FULL_SHARD / ZeRO-3 on the data axis: the rank's pieces of the slice's units (fl_fsdp_ranges: unit g's elements
 * [fo, fo + ln) of the slice's flat layout at shard offset so), else 0 */
static int fsdp_pieces(const fl_tp_dist *d, size_t **fo, size_t **so, size_t **ln) {
    if (!d->inner || d->inner->stage != 3 || !((const fl_dp *)d->inner->ud)->fsdp) return 0;
    const fl_dp *dp = d->inner->ud;
    const int G = fl_fsdp_ranges(dp, NULL, NULL, NULL);
    *fo = malloc(3 * (size_t)(G + 1) * sizeof **fo);
    if (!*fo) return -1;
    *so = *fo + G + 1, *ln = *so + G + 1;
    return fl_fsdp_ranges(dp, *fo, *so, *ln);
}

/* the rank's part of one chunk's squared norm (d: its hooks, o: its optimizer), before any sum over ranks; < 0: out
 * of host memory */
static double grad_sumsq_local(const fl_tp_dist *d, const fl_optimizer *o) {
    const fl_model *m = d->m;
    /* parameter offload: the gradients are the host tier's */
    const fl_backend *be = o->home.params_host ? o->home.be : m->be;
    const int rank = fl_comm_rank(d->comm), zero = d->inner && d->inner->stage > 0;
    const size_t c0 = zero ? o->shard.off : 0, c1 = zero ? o->shard.off + o->shard.len : o->w.n;
    const size_t es = fl_dtype_size(o->w.gt);
    size_t *fo = NULL, *so = NULL, *ln = NULL;
    const int G = fsdp_pieces(d, &fo, &so, &ln); /* FULL_SHARD: each entry's part in the rank's piece of its unit */
    if (G < 0) return -1;
    double v = 0;
    for (int i = 0; i < m->layout.n; i++) {
        const fl_param_info *p = &m->layout.params[i];
        if (rank != 0 && fl_tp_entry_split(&m->layout, i) == FL_TP_REPLICATED) continue;
        if (!fl_pp_stage_owns(m, i)) continue; /* TP x PP: an end this stage does not run (always owned without PP) */
        for (int g = 0; g < (G ? G : 1); g++) {
            const size_t r0 = G ? fo[g] : c0, r1 = G ? fo[g] + ln[g] : c1; /* the held range, flat coordinates */
            const size_t a = p->offset > r0 ? p->offset : r0, b = p->offset + p->numel < r1 ? p->offset + p->numel : r1;
            if (a >= b) continue;
            const size_t at = G ? so[g] + (a - fo[g]) : a; /* where it sits in the gradient buffer */
            double w = 0; /* through the door; sumsq's status ignored, as the slot has none */
            (void)FL_RUN(be, sumsq, (const char *)o->w.g + at * es, o->w.gt, b - a, &w);
            v += w;
        }
    }
    free(fo);
    return v;
}

/* the interleaved schedule's chunks (d->pp): chunk c's hooks, their optimizer */
static const fl_tp_dist *chunk_dist(const fl_tp_dist *d, int c) { return d->pp->ch[c].o->shard.dist->ud; }

/* the rank's part of the squared norm: its one slice's, or (interleaved) every chunk's; < 0: out of host memory */
static double rank_sumsq(const fl_tp_dist *d, const fl_optimizer *o, double (*one)(const fl_tp_dist *, const fl_optimizer *)) {
    if (!d->pp || d->pp->chunks <= 1) return one(d, o);
    double v = 0;
    for (int c = 0; c < d->pp->chunks; c++) {
        const double x = one(chunk_dist(d, c), d->pp->ch[c].o);
        if (x < 0) return x;
        v += x;
    }
    return v;
}

/* interleaved: the step's norm once (every chunk's optimizer asks; the first call computes it) */
static int norm_kept(const fl_tp_dist *d, double *out) {
    if (!d->pp || d->pp->chunks <= 1 || !d->pp->norm_ok) return 0;
    *out = d->pp->norm_sq;
    return 1;
}
static void norm_keep(const fl_tp_dist *d, double v) {
    if (!d->pp || d->pp->chunks <= 1) return;
    d->pp->norm_sq = v;
    d->pp->norm_ok = 1;
}

static fl_status tp_grad_sumsq(void *ud, const fl_optimizer *o, double *out) {
    const fl_tp_dist *d = ud;
    if (norm_kept(d, out)) return FL_OK;
    double v = rank_sumsq(d, o, grad_sumsq_local);
    if (v < 0) return fl_errorf(FL_ERR_OOM, "tensor parallel: out of host memory");
    if (d->inner && d->inner->stage > 0) FL_TRY(d->inner->sum(d->inner->ud, &v, 1));
    FL_TRY(fl_error_prefix(sum_group(d, v, out), "tensor parallel: the gradient norm"));
    norm_keep(d, *out);
    return FL_OK;
}

/* LoRA (the optimizer trains the adapters): the norm of every rank's split matrices (B of a column-parallel
 * linear's adapter, A of a row-parallel one's) and rank 0's whole ones (summed over the group by tp_reduce first) */
static double lora_sumsq_local(const fl_tp_dist *d, const fl_optimizer *o) {
    const fl_model *m = d->m;
    fl_lora_adapters ad;
    fl_model_lora_adapters(m, &ad);
    const int rank = fl_comm_rank(d->comm);
    double v = 0;
    for (int j = 0; j < ad.n_mods; j++) {
        const fl_lora_module *md = &ad.mods[j];
        for (int b = 0; b < 2; b++) {
            if (rank != 0 && !fl_tp_lora_split(&m->layout, md->param_index, b)) continue;
            const size_t n = b ? (size_t)md->out * ad.cfg->r : (size_t)ad.cfg->r * md->in;
            double x = 0; /* through the door; sumsq's status ignored, as the slot has none */
            (void)FL_RUN(m->be, sumsq, (const float *)o->w.g + ad.off[2 * j + b], FL_F32, n, &x);
            v += x;
        }
    }
    return v;
}

static fl_status tp_lora_sumsq(void *ud, const fl_optimizer *o, double *out) {
    const fl_tp_dist *d = ud;
    if (norm_kept(d, out)) return FL_OK;
    FL_TRY(fl_error_prefix(sum_group(d, rank_sumsq(d, o, lora_sumsq_local), out), "tensor parallel: the adapters' "
                           "gradient norm"));
    norm_keep(d, *out);
    return FL_OK;
}

/* LoRA: the whole matrices' gradients are partial sums of the ranks' (dA = B_r^T dy_r x^T on a column-parallel
 * linear, dB = dy (A_r x_r)^T on a row-parallel one): summed over the group on the backend's memory before the
 * optimizer reads them (every rank then holds the same bits) */
static fl_status reduce_one(const fl_tp_dist *d, fl_optimizer *o) {
    const fl_model *m = d->m;
    fl_lora_adapters ad;
    if (!fl_model_lora_adapters(m, &ad) || !m->tp_comm) return FL_OK;
    for (int j = 0; j < ad.n_mods; j++) {
        const fl_lora_module *md = &ad.mods[j];
        for (int b = 0; b < 2; b++) {
            if (fl_tp_lora_split(&m->layout, md->param_index, b)) continue;
            const size_t n = b ? (size_t)md->out * ad.cfg->r : (size_t)ad.cfg->r * md->in;
            float *g = (float *)o->w.g + ad.off[2 * j + b];
            FL_TRY(fl_error_prefix(fl_comm_all_reduce(m->tp_comm, g, g, n, FL_F32, FL_COMM_SUM), "tensor parallel: the "
                                   "adapter gradient of %s", md->name));
        }
    }
    return FL_OK;
}

/* interleaved: the first chunk's update sums every chunk's before its clipping norm reads them all (rank_sumsq: rank 0
 * adds each chunk's whole matrices; summing a later chunk's in its own update came after the norm: the rank's partial
 * counted), the later chunks' updates find them summed */
static fl_status tp_reduce(void *ud, fl_optimizer *o) {
    const fl_tp_dist *d = ud;
    if (!d->pp || d->pp->chunks <= 1) return reduce_one(d, o);
    if (d->pp->lora_reduced) return FL_OK;
    for (int c = 0; c < d->pp->chunks; c++) FL_TRY(reduce_one(chunk_dist(d, c), d->pp->ch[c].o));
    d->pp->lora_reduced = 1;
    return FL_OK;
}

static fl_status tp_any(void *ud, int *flag) {
    const fl_tp_dist *d = ud;
    if (d->pp && d->pp->amp_ok) { /* interleaved: the verdict over every chunk (pp_step.c amp_verdict) */
        *flag = d->pp->amp_found;
        return FL_OK;
    }
    double v = *flag != 0;
    FL_TRY(fl_error_prefix(sum_group(d, v, &v), "tensor parallel: the overflow check"));
    *flag = v > 0;
    return FL_OK;
}

/* the data-parallel hooks (DDP, ZeRO-1/2 on the other axis of the grid) under tensor parallelism's. A sum is the
 * whole grid's (the axis, then the group): its users decide for every rank (ZeRO-2's overflow verdict). */
static fl_status inner_sum(void *ud, double *v, int n) {
    const fl_tp_dist *d = ud;
    if (d->pp && d->pp->amp_ok && n == 1) { /* ZeRO-2's overflow check under interleaved: the step's one verdict */
        v[0] = d->pp->amp_found;
        return FL_OK;
    }
    FL_TRY(d->inner->sum(d->inner->ud, v, n));
    for (int k = 0; k < n; k++) FL_TRY(sum_group(d, v[k], &v[k]));
    return FL_OK;
}
static fl_status inner_gather(void *ud, fl_optimizer *o) {
    const fl_optim_dist *in = ((fl_tp_dist *)ud)->inner;
    return in->gather ? in->gather(in->ud, o) : FL_OK;
}
static fl_status inner_max(void *ud, float *v, size_t n) {
    const fl_optim_dist *in = ((fl_tp_dist *)ud)->inner;
    return in->max(in->ud, v, n);
}

fl_status fl_tp_optim_attach(fl_optimizer *o, fl_comm *host_comm, fl_tp_dist *d) {
    const fl_optim_dist *in = o->shard.dist;
    const int fsdp = in && in->stage == 3 && ((const fl_dp *)in->ud)->fsdp; /* (HYBRID_SHARD: the node's pieces) */
    if (in && ((in->stage > 2 && !fsdp) || in->any)) /* any: the hooks of another tensor / pipeline split */
        return fl_errorf(FL_ERR_UNSUPPORTED, "tensor parallel: the data-parallel axis runs DDP, ZeRO-1, ZeRO-2 or "
                         "FULL_SHARD (its optimizer is at stage %d)", in->stage);
    fl_lora_adapters ad;
    const int lora = fl_model_lora_adapters(o->model, &ad);
    if (lora ? o->w.n != ad.numel || o->w.p != ad.params
             : o->w.n != fl_model_store_numel(o->model) || o->w.p != fl_model_params_data(o->model))
        return fl_errorf(FL_ERR_UNSUPPORTED, "tensor parallel: the optimizer must train the slice's parameters or its "
                         "LoRA adapters");
    if (lora && ((in && in->stage > 0) || o->w.gt != FL_F32))
        return fl_errorf(FL_ERR_UNSUPPORTED, "tensor parallel: LoRA's adapters train with fp32 gradients and DDP on the "
                         "data-parallel axis so far");
    memset(d, 0, sizeof *d);
    d->comm = host_comm;
    d->m = o->model;
    d->dist.world = 1; /* the data is not split: every rank of the group trains the same batch */
    d->dist.ud = d;
    if (in) { /* DDP over the data-parallel axis: its ranks and sums, the norm and verdicts over the group */
        d->inner = in;
        d->dist.world = in->world, d->dist.rank = in->rank, d->dist.stage = in->stage;
        d->dist.sum = inner_sum, d->dist.gather = inner_gather, d->dist.max = inner_max;
    }
    d->dist.grad_sumsq = lora ? tp_lora_sumsq : tp_grad_sumsq;
    d->dist.reduce = lora ? tp_reduce : NULL;
    d->dist.any = tp_any;
    o->shard.dist = &d->dist;
    return FL_OK;
}

fl_status fl_tp_lora_init(fl_model *m, uint64_t seed) {
    fl_lora_adapters ad;
    const int size = m->cfg.tp_size, r = m->cfg.tp_rank;
    if (size <= 1 || !fl_model_lora_adapters(m, &ad) || fl_backend_discards(m->be)) return FL_OK;
    for (int j = 0; j < ad.n_mods; j++) {
        const fl_lora_module *md = &ad.mods[j];
        if (!fl_tp_lora_split(&m->layout, md->param_index, 0)) continue; /* A whole: the slice drew the whole's */
        const int R = ad.cfg->r, in = md->in * size; /* the whole linear's input width */
        float *whole = malloc((size_t)R * in * sizeof *whole), *part = malloc((size_t)R * md->in * sizeof *part);
        fl_status s = whole && part ? FL_OK : fl_errorf(FL_ERR_OOM, "tensor parallel LoRA: out of host memory");
        if (s == FL_OK) { /* the whole A of module j (fl_model_lora_init's seed for it), the rank's columns */
            fl_lora_init_adapter(whole, NULL, R, in, md->out, seed + (uint64_t)j * 0x9e3779b97f4a7c15ULL);
            for (int k = 0; k < R; k++) memcpy(part + (size_t)k * md->in, whole + (size_t)k * in + (size_t)r * md->in,
                                               (size_t)md->in * sizeof *part);
            s = FL_RUN(m->be, to_device, ad.params + ad.off[2 * j], part, (size_t)R * md->in * sizeof *part);
        }
        free(whole), free(part);
        FL_TRY(s);
    }
    return FL_OK;
}

/* the largest A or B of the adapters v (its elements) */
static size_t lora_most(const fl_lora_adapters *v) {
    size_t most = 1;
    for (int j = 0; j < v->n_mods; j++) {
        const size_t a = (size_t)v->cfg->r * v->mods[j].in, b = (size_t)v->mods[j].out * v->cfg->r;
        most = a > most ? a : most;
        most = b > most ? b : most;
    }
    return most;
}

static size_t lora_count(const fl_lora_adapters *v, int j, int b) {
    return b ? (size_t)v->mods[j].out * v->cfg->r : (size_t)v->cfg->r * v->mods[j].in;
}

/* the elements every rank gives to the all-gather of module j's A (b 0) or B (b 1): its own, but B of a vocabulary
 * slice (lm_head: V / n rows rounded down or up) padded to the largest rank's, so the ranks' counts agree */
static size_t gather_count(const fl_model *part, const fl_lora_adapters *v, int j, int b, int n) {
    const int i = v->mods[j].param_index;
    if (!b || fl_tp_entry_split(&part->layout, i) != FL_TP_VOCAB) return lora_count(v, j, b);
    const size_t V = (size_t)part->cfg.vocab_size;
    return (V + (size_t)n - 1) / (size_t)n * (size_t)v->cfg->r;
}

fl_status fl_tp_lora_gather(const fl_model *part, fl_comm *host_comm, const fl_backend *src_be, const float *src,
                            const fl_model *whole, const fl_backend *dst_be, float *dst) {
    fl_lora_adapters pa, wa;
    if (!fl_model_lora_adapters(part, &pa) || (whole && !fl_model_lora_adapters(whole, &wa)))
        return fl_errorf(FL_ERR_INVALID, "tensor parallel LoRA: a model without adapters");
    const int n = fl_comm_size(host_comm), R = pa.cfg->r;
    size_t most = lora_most(&pa);
    const size_t wmost = whole ? lora_most(&wa) : 1;
    for (int j = 0; j < pa.n_mods; j++) {
        const size_t c = gather_count(part, &pa, j, 1, n);
        most = c > most ? c : most;
    }
    float *mine = malloc(most * sizeof *mine), *all = malloc((size_t)n * most * sizeof *all),
          *w = malloc(wmost * sizeof *w);
    fl_status s = mine && all && w ? FL_OK : fl_errorf(FL_ERR_OOM, "tensor parallel LoRA: out of host memory");
    for (int j = 0; j < pa.n_mods && s == FL_OK; j++)
        for (int b = 0; b < 2 && s == FL_OK; b++) { /* A, then B of module j, the same order on every rank */
            const size_t c = gather_count(part, &pa, j, b, n), own = lora_count(&pa, j, b);
            memset(mine + own, 0, (c - own) * sizeof *mine);
            s = FL_RUN(src_be, to_host, mine, src + pa.off[2 * j + b], own * sizeof *mine);
            if (s == FL_OK) s = fl_comm_all_gather(host_comm, mine, all, (size_t)n * c, FL_F32);
            if (s != FL_OK || !whole) continue;
            for (int k = 0; k < n; k++)
                fl_tp_lora_place(&whole->cfg, &whole->layout, pa.mods[j].param_index, n, k, R, b, all + (size_t)k * c, w);
            s = FL_RUN(dst_be, to_device, dst + wa.off[2 * j + b], w, lora_count(&wa, j, b) * sizeof *w);
        }
    free(mine), free(all), free(w);
    return fl_error_prefix(s, "tensor parallel: gathering the LoRA adapters");
}

fl_status fl_tp_lora_scatter(const fl_model *whole, const fl_backend *src_be, const float *src, const fl_model *part,
                             const fl_backend *dst_be, float *dst) {
    fl_lora_adapters pa, wa;
    if (!fl_model_lora_adapters(part, &pa) || !fl_model_lora_adapters(whole, &wa))
        return fl_errorf(FL_ERR_INVALID, "tensor parallel LoRA: a model without adapters");
    const int n = part->cfg.tp_size > 1 ? part->cfg.tp_size : 1, r = part->cfg.tp_rank;
    float *w = malloc(lora_most(&wa) * sizeof *w), *mine = malloc(lora_most(&pa) * sizeof *mine);
    fl_status s = w && mine ? FL_OK : fl_errorf(FL_ERR_OOM, "tensor parallel LoRA: out of host memory");
    for (int j = 0; j < pa.n_mods && s == FL_OK; j++)
        for (int b = 0; b < 2 && s == FL_OK; b++) {
            s = FL_RUN(src_be, to_host, w, src + wa.off[2 * j + b], lora_count(&wa, j, b) * sizeof *w);
            fl_tp_lora_take(&whole->cfg, &whole->layout, pa.mods[j].param_index, n, r, pa.cfg->r, b, w, mine);
            if (s == FL_OK) s = FL_RUN(dst_be, to_device, dst + pa.off[2 * j + b], mine, lora_count(&pa, j, b) * sizeof *mine);
        }
    free(w), free(mine);
    return fl_error_prefix(s, "tensor parallel: the LoRA adapters' slices");
}

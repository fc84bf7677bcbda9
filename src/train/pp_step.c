/* The pipelined training step (fitllm/pp.h; issue 35 item 2, EXPERIMENTAL): stage p->stage runs its schedule's
 * forwards and backwards of the step's micro-batches (fl_pp_schedule_ops), the stream between stages and its
 * gradient travelling by fl_comm_send / fl_comm_recv (tag 0 forward, 1 backward: one tag's messages between two
 * ranks arrive in order, and each stage runs its forwards, and its backwards, in micro-batch order). Each
 * stage's backwards run in micro-batch order 0..M-1, the order one process accumulates them in, and every block
 * runs the single process's code on the same inputs: a pipeline's losses and gradients are one process's bits;
 * only the clipping norm, a sum over the stages' squared norms in stage order, differs by rounding. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fitllm/lora.h"
#include "fitllm/pp.h"
#include "dp.h"

enum { TAG_ACT = 0, TAG_GRAD = 1, TAG_TIED = 2, TAG_CHUNK0 = 8 }; /* 3: the trainer's checkpoints */
#define FL_PP_MAX_UNITS 1024 /* layout groups of a stage under FULL_SHARD (its blocks + 2) */

void fl_pp_free(fl_pp *p) {
    for (int c = 0; c < p->chunks; c++) {
        fl_pp_chunk *h = &p->ch[c];
        for (int i = 0; i < h->n_stash; i++) fl_model_stage_stash_free(h->m, h->stash[i]);
        free(h->stash);
        if (h->swap) fl_mem_free(h->m->pool, h->swap);
    }
    free(p->hx);
    memset(p, 0, sizeof *p);
}

fl_status fl_pp_init_v(fl_pp *p, fl_model *const *ms, int chunks, fl_comm *comm, fl_pp_schedule kind) {
    memset(p, 0, sizeof *p);
    if (chunks < 1 || chunks > FL_PP_MAX_CHUNKS || (chunks > 1 && kind != FL_PP_INTERLEAVED))
        return fl_errorf(FL_ERR_INVALID, "pipeline: %d model chunks per rank under %s (1 to %d, more than 1 under "
                         "interleaved only)", chunks, fl_pp_schedule_name(kind), FL_PP_MAX_CHUNKS);
    p->comm = comm;
    p->stages = fl_comm_size(comm);
    p->stage = fl_comm_rank(comm);
    p->kind = kind;
    p->m = ms[0];
    p->chunks = chunks;
    const int S = p->stages, NV = S * chunks;
    size_t most = 0;
    for (int c = 0; c < chunks; c++) {
        const int v = c * S + p->stage; /* virtual stage */
        p->ch[c].m = ms[c];
        FL_TRY(fl_model_set_stage(ms[c], v > 0, v < NV - 1));
        const size_t n = fl_model_stage_max_elems(ms[c]); /* an encoder-decoder's: both stacks' streams */
        if (n > most) most = n;
    }
    p->hx_n = most;
    p->discard = fl_backend_discards(ms[0]->be);
    p->hx = malloc((p->discard ? 0 : p->hx_n) * sizeof *p->hx + 1); /* a plan's stream travels empty (stream_send) */
    if (!p->hx) return fl_errorf(FL_ERR_OOM, "pipeline stage %d: out of host memory for the stream's staging", p->stage);
    const size_t chunk = (size_t)1 << 20;
    fl_status s = FL_OK;
    for (int c = 0; c < chunks && s == FL_OK; c++) {
        fl_pp_chunk *h = &p->ch[c];
        h->swap_bytes = h->m->sizes.acts_bytes < chunk ? h->m->sizes.acts_bytes : chunk;
        if (NV > 1) s = fl_mem_alloc(h->m->pool, FL_TAG_WORKSPACE, h->swap_bytes, &h->swap);
    }
    if (s != FL_OK) fl_pp_free(p); /* the caller frees only a stage that started (a plan's OOM ends here) */
    return s;
}

fl_status fl_pp_init(fl_pp *p, fl_model *m, fl_comm *comm, fl_pp_schedule kind) { return fl_pp_init_v(p, &m, 1, comm, kind); }

/* v summed over the stages in stage order (one double per stage, all-gathered as bits) */
static fl_status sum_stages(fl_comm *c, double v, double *out) {
    const int n = fl_comm_size(c);
    double stack[16], *all = n <= 16 ? stack : malloc((size_t)n * sizeof *all);
    if (!all) return fl_errorf(FL_ERR_OOM, "pipeline: out of host memory");
    fl_status s = fl_comm_all_gather(c, &v, all, (size_t)n * 2, FL_F32);
    double acc = 0;
    for (int r = 0; s == FL_OK && r < n; r++) acc += all[r];
    *out = acc;
    if (all != stack) free(all);
    return s;
}

/* chunk c's data-parallel hooks: chunk 0's are the stage's; a later chunk's its own (FULL_SHARD: its units) */
static const fl_optim_dist *chunk_inner(const fl_pp *p, int c) { return c > 0 && p->ch[c].inner ? p->ch[c].inner : p->inner; }

/* FULL_SHARD on the data axis (stage 3 of a full model): chunk c's units' ranges (fl_fsdp_ranges), else 0 */
static int fsdp_units(const fl_pp *p, int c, size_t *fo, size_t *so, size_t *ln) {
    const fl_optim_dist *in = chunk_inner(p, c);
    if (!in || in->stage != 3 || p->adapters) return 0;
    const fl_dp *dp = in->ud;
    if (!dp->fsdp || p->ch[c].m->layout.n_groups > FL_PP_MAX_UNITS) return 0;
    return fl_fsdp_ranges(dp, fo, so, ln);
}
/* unit g (a layout group: 0 the embeddings, G - 1 the final norm and head) is trained by the stage */
static int unit_owned(const fl_model *m, int g, int G) { return g == 0 ? !m->stage.in : g == G - 1 ? !m->stage.out : 1; }

/* the backend that reads optimizer o's gradients: parameter offload's are the host tier's (its host backend), else the
 * chunk model's device memory */
static const fl_backend *grad_be(const fl_optimizer *o) { return o->home.params_host ? o->home.be : o->model->be; }

/* n entries' squared norm through the door (sumsq's status ignored, as the slot has none) */
static double door_sumsq(const fl_backend *be, const void *x, fl_dtype t, size_t n) {
    double v = 0;
    (void)FL_RUN(be, sumsq, x, t, n, &v);
    return v;
}

/* one chunk's squared gradient norm (its model m, its optimizer o): each entry it trains. Under DDP every
 * data-parallel rank holds the same reduced gradient; under ZeRO-1/2 a rank adds the part of each entry in its chunk
 * [off, off + len) of the stage's buffer (ZeRO-2 holds no other reduced gradient) */
static double chunk_sumsq(const fl_pp *p, int c, const fl_model *m, const fl_optimizer *o) {
    const size_t es = fl_dtype_size(o->w.gt);
    const int zero = p->inner && p->inner->stage > 0;
    const size_t c0 = zero ? o->shard.off : 0, c1 = zero ? o->shard.off + o->shard.len : o->w.n;
    double v = 0;
    /* LoRA: every adapter of the stage (a head adapter that only the last stage runs has a zero gradient elsewhere) */
    if (p->adapters && c0 < c1) v = door_sumsq(grad_be(o), (const char *)o->w.g + c0 * es, o->w.gt, c1 - c0);
    /* FULL_SHARD: the rank's piece of each unit (a layout group) the stage trains, in the shard at shard_off[g] */
    size_t fo[FL_PP_MAX_UNITS], so[FL_PP_MAX_UNITS], ln[FL_PP_MAX_UNITS];
    const int G = fsdp_units(p, c, fo, so, ln), s2s = m->cfg.pp_enc > 0;
    for (int g = 0; !s2s && g < G; g++)
        if (unit_owned(m, g, G) && ln[g]) v += door_sumsq(grad_be(o), (const char *)o->w.g + so[g] * es, o->w.gt, ln[g]);
    /* an encoder-decoder's units mix owned and copied entries (a block's unit holds a relative bias table's copy, the
     * last unit the encoder's final norm): each entry the stage owns, its parts in the rank's pieces */
    for (int i = 0; s2s && i < m->layout.n; i++)
        for (int g = 0; fl_pp_stage_owns(m, i) && g < G; g++) {
            const fl_param_info *e = &m->layout.params[i];
            const size_t a = e->offset > fo[g] ? e->offset : fo[g];
            const size_t b = e->offset + e->numel < fo[g] + ln[g] ? e->offset + e->numel : fo[g] + ln[g];
            if (a < b) v += door_sumsq(grad_be(o), (const char *)o->w.g + (so[g] + a - fo[g]) * es, o->w.gt, b - a);
        }
    for (int i = 0; !p->adapters && !G && i < m->layout.n; i++) {
        const fl_param_info *e = &m->layout.params[i];
        const size_t a = e->offset > c0 ? e->offset : c0, b = e->offset + e->numel < c1 ? e->offset + e->numel : c1;
        if (fl_pp_stage_owns(m, i) && a < b) v += door_sumsq(grad_be(o), (const char *)o->w.g + a * es, o->w.gt, b - a);
    }
    return v;
}

/* the whole model's squared gradient norm: each stage's chunks' trained entries, summed over the axis' chunks in
 * rank order (ZeRO), then over the stages. Interleaved: the first chunk optimizer's call sums every chunk of the
 * rank, the later ones (the same step) reuse it */
static fl_status pp_grad_sumsq(void *ud, const fl_optimizer *o, double *out) {
    fl_pp *p = ud;
    if (p->chunks > 1 && p->norm_ok) {
        *out = p->norm_sq;
        return FL_OK;
    }
    double v = 0;
    if (p->chunks > 1)
        for (int c = 0; c < p->chunks; c++) v += chunk_sumsq(p, c, p->ch[c].m, p->ch[c].o);
    else
        v = chunk_sumsq(p, 0, p->m, o);
    if (p->inner && p->inner->stage > 0) FL_TRY(p->inner->sum(p->inner->ud, &v, 1));
    FL_TRY(fl_error_prefix(sum_stages(p->comm, v, out), "pipeline: the gradient norm"));
    p->norm_sq = *out;
    p->norm_ok = p->chunks > 1;
    return FL_OK;
}

static fl_status pp_any(void *ud, int *flag) {
    const fl_pp *p = ud;
    if (p->amp_ok) { /* interleaved: the verdict over every chunk (amp_verdict) */
        *flag = p->amp_found;
        return FL_OK;
    }
    double v = *flag != 0;
    FL_TRY(fl_error_prefix(sum_stages(p->comm, v, &v), "pipeline: the overflow check"));
    *flag = v > 0;
    return FL_OK;
}

/* the data-parallel hooks (DDP, ZeRO-1/2) under the pipeline's: a sum is the whole grid's (the axis, then the
 * stages): its users decide for every rank (ZeRO-2's overflow verdict) */
static fl_status inner_sum(void *ud, double *v, int n) {
    const fl_pp *p = ud;
    if (p->amp_ok && n == 1) { /* ZeRO-2's overflow check (the norm has its own hook): interleaved's one verdict */
        v[0] = p->amp_found;
        return FL_OK;
    }
    FL_TRY(p->inner->sum(p->inner->ud, v, n));
    for (int k = 0; k < n; k++) FL_TRY(fl_error_prefix(sum_stages(p->comm, v[k], &v[k]), "pipeline: a sum"));
    return FL_OK;
}
static fl_status inner_gather(void *ud, fl_optimizer *o) {
    const fl_optim_dist *in = ((const fl_pp *)ud)->inner;
    return in->gather ? in->gather(in->ud, o) : FL_OK;
}
static fl_status inner_max(void *ud, float *v, size_t n) {
    const fl_optim_dist *in = ((const fl_pp *)ud)->inner;
    return in->max(in->ud, v, n);
}

fl_status fl_pp_optim_attach(fl_pp *p, fl_optimizer *o) {
    const fl_optim_dist *in = o->shard.dist;
    if (in && (in->stage > 3 || in->any)) /* any: the hooks of another tensor / pipeline split */
        return fl_errorf(FL_ERR_UNSUPPORTED, "--pipeline_parallel %d: the data-parallel axis runs DDP, ZeRO-1, ZeRO-2 or "
                         "FULL_SHARD (its optimizer is at stage %d)", p->stages, in->stage);
    fl_lora_adapters ad;
    p->adapters = fl_model_lora_adapters(p->m, &ad);
    if (p->adapters ? o->w.n != ad.numel || o->w.p != ad.params
                    : o->w.n != fl_model_store_numel(p->m) || o->w.p != fl_model_params_data(p->m)) /* FULL_SHARD: the shard's */
        return fl_errorf(FL_ERR_UNSUPPORTED, "--pipeline_parallel %d: the optimizer must train the stage's parameters "
                         "or its LoRA adapters", p->stages);
    p->ch[0].o = o;
    p->ch[0].inner = in;
    p->inner = in;
    memset(&p->dist, 0, sizeof p->dist);
    p->dist.world = in ? in->world : 1;
    p->dist.rank = in ? in->rank : 0;
    p->dist.stage = in ? in->stage : 0;
    p->dist.ud = p;
    if (in) p->dist.sum = inner_sum, p->dist.gather = inner_gather, p->dist.max = inner_max;
    p->dist.grad_sumsq = pp_grad_sumsq;
    p->dist.any = pp_any;
    o->shard.dist = &p->dist;
    return FL_OK;
}

fl_status fl_pp_chunk_optim(fl_pp *p, int c, fl_optimizer *o) {
    if (c < 1 || c >= p->chunks || !p->ch[0].o)
        return fl_errorf(FL_ERR_INVALID, "pipeline: chunk %d's optimizer (chunks 1 .. %d, after fl_pp_optim_attach)", c,
                         p->chunks - 1);
    const fl_optim_dist *in = o->shard.dist; /* FULL_SHARD: the chunk's own bookkeeping's, of the same axis */
    if (in && in != p->inner && (!p->inner || in->stage != 3 || p->inner->stage != 3 || in->world != p->inner->world))
        return fl_errorf(FL_ERR_UNSUPPORTED, "pipeline: chunk %d's optimizer has other hooks than chunk 0's", c);
    fl_lora_adapters ad; /* LoRA: every chunk trains its adapters (chunk 0 does: p->adapters) */
    const int lora = fl_model_lora_adapters(p->ch[c].m, &ad);
    if (lora != p->adapters ||
        (lora ? o->w.n != ad.numel || o->w.p != ad.params
              : o->w.n != fl_model_store_numel(p->ch[c].m) || o->w.p != fl_model_params_data(p->ch[c].m)) ||
        o->amp.on != p->ch[0].o->amp.on)
        return fl_errorf(FL_ERR_UNSUPPORTED, "pipeline: chunk %d's optimizer must train its model's parameters or LoRA "
                         "adapters, as chunk 0's does (loss scaling as chunk 0's)", c);
    p->ch[c].o = o;
    p->ch[c].inner = in;
    o->shard.dist = &p->dist;
    return FL_OK;
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* chunk h's arena's micro-batch parked in a free stash slot of h (one more slot when all are taken) */
static fl_status park(fl_pp *p, fl_pp_chunk *h, int mb, int *slot_of) {
    int free_slot = -1;
    for (int i = 0; i < h->n_stash && free_slot < 0; i++) {
        int used = 0;
        for (int k = 0; slot_of && k < 64 && !used; k++) used = slot_of[k] == i;
        if (!used) free_slot = i;
    }
    if (free_slot < 0) {
        fl_stage_stash **ns = realloc(h->stash, (size_t)(h->n_stash + 1) * sizeof *ns);
        if (!ns) return fl_errorf(FL_ERR_OOM, "pipeline: out of host memory");
        h->stash = ns;
        FL_TRY(fl_model_stage_stash_new(h->m, &h->stash[h->n_stash]));
        free_slot = h->n_stash++;
        p->n_stash++;
    }
    FL_TRY(fl_model_stage_stash_save(h->m, h->stash[free_slot]));
    slot_of[mb] = free_slot;
    return FL_OK;
}

typedef struct {
    fl_pp *p;
    fl_optimizer *o;
    fl_step_ctx *c;
    float grad_scale;
    int live[FL_PP_MAX_CHUNKS];        /* the micro-batch whose activations each chunk's arena holds (-1: none) */
    int slot_of[FL_PP_MAX_CHUNKS][64]; /* each chunk's micro-batches' stash slots (-1: none) */
    double *stats;                     /* (2 M) loss sum and valid targets (the last virtual stage's) */
} run;

/* the stream's tags: one process of chunk per rank keeps 0 (activations) and 1 (their gradients); interleaved gives
 * each receiving chunk its own pair (each tag's messages between two ranks arrive in order, and each chunk runs its
 * forwards, and its backwards, in micro-batch order) */
static int tag_act(const fl_pp *p, int c) { return p->chunks > 1 ? TAG_CHUNK0 + 2 * c : TAG_ACT; }
static int tag_grad(const fl_pp *p, int c) { return p->chunks > 1 ? TAG_CHUNK0 + 2 * c + 1 : TAG_GRAD; }

/* LoRA's dropout masks of micro-batch k: fl_step_run's seed (run seed, global micro-batch), set before its forward and
 * again before its backward (which draws the same masks again), as other micro-batches ran in between */
static void seed_micro(run *r, fl_model *m, int k) {
    const fl_step_ctx *c = r->c;
    const int world = c->dp ? c->dp->world : 1, rank = c->dp ? c->dp->rank : 0;
    if (c->seeded) fl_model_adapters_seed(m, c->seed + (uint64_t)(c->iter0 + (long)k * world + rank));
}

/* chunk ch's forward of micro-batch k: virtual stage v = ch S + stage, its input from v - 1 (the previous rank, or
 * the last rank's previous chunk), its output to v + 1 */
/* the stream's elements of micro-batch mb at the chunk's input side (out 0) or output side (out 1) */
static size_t stream_elems(const fl_model *m, const fl_micro_batch *mb, int out) {
    if (fl_model_is_s2s(&m->cfg)) return fl_model_stage_elems_s2s(m, mb->B, mb->Ts, mb->T, out);
    return fl_model_stage_elems(m, mb->B, mb->T); /* SP: the rank's rows */
}

static fl_status stage_input(fl_model *m, const float *x, const fl_micro_batch *mb) {
    if (fl_model_is_s2s(&m->cfg)) return fl_model_stage_input_s2s(m, x, mb->B, mb->Ts, mb->T);
    return fl_model_stage_input(m, x, mb->B, mb->T);
}

/* The stream's messages (n elements of p->hx to / from rank peer). On the planner's null backend (p->discard) they
 * carry no elements and the copies between the stage's arena and p->hx are skipped (the callers' !p->discard): the
 * values are the null backend's zeros that nobody reads, the stage's memory is its pool's either way, and the order
 * of the messages, which the ranks wait on, is kept. Copied, a 7B stage's (T, C) fp32 stream (32 MiB at T 2048) went
 * through the threads communicator's mailbox (malloc, memcpy, memcpy, free) at every forward and backward of every
 * micro-batch: nearly all of a pipelined plan's time and host memory (docs/BENCHMARKS.md, 2026-12-02). */
static fl_status stream_send(fl_pp *p, size_t n, int peer, int tag) {
    return fl_comm_send(p->comm, p->hx, p->discard ? 0 : n, FL_F32, peer, tag);
}
static fl_status stream_recv(fl_pp *p, size_t n, int peer, int tag) {
    return fl_comm_recv(p->comm, p->hx, p->discard ? 0 : n, FL_F32, peer, tag);
}

static fl_status fwd(run *r, int ch, int k) {
    fl_pp *p = r->p;
    fl_pp_chunk *h = &p->ch[ch];
    fl_model *m = h->m;
    const int S = p->stages, v = ch * S + p->stage, NV = S * p->chunks;
    const fl_micro_batch *mb = &r->c->mbs[k];
    seed_micro(r, m, k);
    if (r->live[ch] >= 0) FL_TRY(park(p, h, r->live[ch], r->slot_of[ch])); /* its backward comes later */
    r->live[ch] = -1;
    if (v > 0) {
        FL_TRY(stream_recv(p, stream_elems(m, mb, 0), (v - 1) % S, tag_act(p, ch)));
        if (!p->discard) FL_TRY(stage_input(m, p->hx, mb));
    }
    const double t0 = now_ms();
    FL_TRY(fl_model_forward_micro(m, mb, r->grad_scale, NULL)); /* either kind, up to the head's input */
    FL_TRY(fl_model_forward_head(m, NULL));
    const double dt = now_ms() - t0;
    p->fwd_ms += dt, h->fwd_ms += dt;
    p->n_fwd++, h->n_fwd++;
    r->live[ch] = k;
    if (v < NV - 1) {
        if (!p->discard) FL_TRY(fl_model_stage_output(m, p->hx));
        FL_TRY(stream_send(p, stream_elems(m, mb, 1), (v + 1) % S, tag_act(p, (v + 1) / S)));
    } else {
        r->stats[2 * k] = m->loss_sum;
        r->stats[2 * k + 1] = (double)m->n_valid;
    }
    return FL_OK;
}

/* chunk ch's data-parallel context where FULL_SHARD shards it (chunk 0: the stage's; a later chunk: its own
 * bookkeeping's, the hooks' ud), else NULL */
static fl_dp *chunk_fsdp(const fl_pp *p, const fl_step_ctx *c, int ch) {
    if (!c->dp) return NULL;
    if (ch == 0) return c->dp->fsdp ? c->dp : NULL;
    const fl_optim_dist *in = p->ch[ch].inner;
    fl_dp *dp = in && in->stage == 3 ? in->ud : NULL;
    return dp && dp->fsdp ? dp : NULL;
}

/* chunk ch holds an end of a tied table (tied_sum adds the other end's gradient to its unit 0 after the schedule) */
static int tied_end(const fl_pp *p, int ch) {
    const int S = p->stages;
    return p->ch[ch].m->cfg.tie_embeddings && S >= 2 && !p->adapters &&
           ((p->stage == 0 && ch == 0) || (p->stage == S - 1 && ch == p->chunks - 1));
}

/* --offload_update_overlap on a stage: before chunk ch's last backward, FULL_SHARD's unit-by-unit update armed on the
 * chunk's bookkeeping (fl_fsdp_update_arm decides: offloaded, no clipping, no loss scaling, ...), so each unit's host
 * update runs on the fetch worker as its gradient is final, beside the rest of the schedule (the chunk's lower units,
 * the other chunks' backwards, the wait for the other stages). A tied table's unit 0 waits for the end stages' sum
 * (fl_fsdp_update_hold); an encoder-decoder's shared sums touch every unit: not armed there. */
static fl_status arm_update(run *r, int ch) {
    fl_pp *p = r->p;
    fl_dp *dp = chunk_fsdp(p, r->c, ch);
    fl_optimizer *o = ch == 0 ? r->o : p->ch[ch].o;
    if (!dp || !o || p->m->cfg.pp_enc > 0) return FL_OK;
    FL_TRY(fl_fsdp_update_arm(dp, o, r->c->lr, r->c->max_norm));
    return tied_end(p, ch) ? fl_fsdp_update_hold(dp, 0) : FL_OK;
}

static fl_status bwd(run *r, int ch, int k) {
    fl_pp *p = r->p;
    fl_pp_chunk *h = &p->ch[ch];
    fl_model *m = h->m;
    const int S = p->stages, v = ch * S + p->stage, NV = S * p->chunks;
    const fl_micro_batch *mb = &r->c->mbs[k];
    if (r->live[ch] != k) { /* k back from its slot; the arena's micro-batch (if any) into that slot */
        const int slot = r->slot_of[ch][k];
        if (r->live[ch] >= 0) FL_TRY(fl_model_stage_stash_swap(m, h->stash[slot], h->swap, h->swap_bytes));
        else FL_TRY(fl_model_stage_stash_restore(m, h->stash[slot]));
        if (r->live[ch] >= 0) r->slot_of[ch][r->live[ch]] = slot;
        r->slot_of[ch][k] = -1;
        r->live[ch] = k;
    }
    if (v < NV - 1) {
        FL_TRY(stream_recv(p, stream_elems(m, mb, 1), (v + 1) % S, tag_grad(p, ch)));
        if (!p->discard) FL_TRY(fl_model_stage_dout(m, p->hx));
    }
    seed_micro(r, m, k);
    /* DDP's buckets hang on chunk 0's model: its last backward (the rank's last operation) reduces them; the later
     * chunks' gradients are reduced after the schedule */
    if (r->c->dp && ch == 0) fl_dp_buckets_arm(r->c->dp, r->o, k == r->c->n_micro - 1);
    if (k == r->c->n_micro - 1) FL_TRY(arm_update(r, ch));
    FL_TRY(fl_model_stage_open_grads(m));
    const double t0 = now_ms();
    FL_TRY(fl_model_backward(m));
    const double dt = now_ms() - t0;
    p->bwd_ms += dt, h->bwd_ms += dt;
    p->n_bwd++, h->n_bwd++;
    r->live[ch] = -1;
    if (v > 0) {
        if (!p->discard) FL_TRY(fl_model_stage_dinput(m, p->hx, mb->B, mb->T));
        FL_TRY(stream_send(p, stream_elems(m, mb, 0), (v - 1) % S, tag_grad(p, (v - 1) / S)));
    }
    return FL_OK;
}

/* ZeRO-2: a rank holds the reduced gradient of its chunk [off, off + len) of the stage's buffer alone, and the first
 * and last stage's chunks cut the table at different places (their layouts differ): the table's reduced gradient
 * a[0 .. n) (at element off0 of the buffer) made whole on every rank of the axis, each rank's part kept, the rest
 * zeroed and the axis summed (x + 0 == x: the same bits as the all-reduce DDP runs) */
static fl_status whole_reduced(fl_pp *p, const fl_optimizer *o, float *a, size_t off0, size_t n) {
    const fl_dp *dp = p->inner->ud;
    const size_t c0 = o->shard.off, c1 = o->shard.off + o->shard.len;
    for (size_t k = 0; k < n; k++)
        if (off0 + k < c0 || off0 + k >= c1) a[k] = 0;
    return dp->comm ? fl_comm_all_reduce(dp->comm, a, a, n, FL_F32, FL_COMM_SUM) : FL_OK;
}

/* Tied embeddings: the first stage's gradient of the token table (its embeddings') and the last stage's (its
 * head's) swapped and added (a + b == b + a in IEEE arithmetic: both get the same bits), so both copies update
 * alike. One process adds the two micro-batch by micro-batch, so this sum differs from it by rounding. */
static fl_status tied_sum(fl_pp *p, fl_optimizer *o0) {
    const int S = p->stages, peer = p->stage == 0 ? S - 1 : 0;
    /* the ends: virtual stage 0 (chunk 0 of stage 0) and the last (chunk chunks - 1 of stage S - 1) */
    const int ch = p->stage == 0 ? 0 : p->chunks - 1;
    fl_model *m = p->ch[ch].m;
    fl_optimizer *o = ch == 0 ? o0 : p->ch[ch].o;
    if (!m->cfg.tie_embeddings || S < 2 || (p->stage != 0 && p->stage != S - 1) || p->adapters) return FL_OK;
    const int i = fl_layout_role(&m->layout, 0, FL_ROLE_EMBED);
    if (i < 0) return FL_OK;
    size_t n = m->layout.params[i].numel, es = fl_dtype_size(o->w.gt);
    char *g = (char *)o->w.g + m->layout.params[i].offset * es;
    /* FULL_SHARD: the rank's piece of unit 0 (the embeddings' group, the same size on both end stages, so the same
     * piece of it on the same rank of the axis); the other entries of the group (GPT-2's positions) add 0 */
    size_t fo[FL_PP_MAX_UNITS], so[FL_PP_MAX_UNITS], ln[FL_PP_MAX_UNITS];
    const int fsdp = fsdp_units(p, ch, fo, so, ln) > 0;
    if (fsdp) n = ln[0], g = (char *)o->w.g + so[0] * es;
    if (p->discard) n = 0; /* a plan's: the same messages and reduction, empty (stream_send; a V x C table's 3 host
                            * copies otherwise, 1.5 GiB each for Llama-3.2-3B) */
    float *a = malloc(n * sizeof *a + 1), *b = malloc(n * sizeof *b + 1);
    void *raw = malloc(n * es + 1);
    fl_status s = a && b && raw ? FL_OK : fl_errorf(FL_ERR_OOM, "pipeline: out of host memory (tied embeddings)");
    if (s == FL_OK) s = FL_RUN(grad_be(o), to_host, raw, g, n * es);
    if (s == FL_OK) fl_convert(a, FL_F32, raw, o->w.gt, n);
    if (s == FL_OK && !fsdp && p->inner && p->inner->stage == 2) s = whole_reduced(p, o, a, m->layout.params[i].offset, n);
    if (s == FL_OK) s = fl_comm_send(p->comm, a, n, FL_F32, peer, TAG_TIED);
    if (s == FL_OK) s = fl_comm_recv(p->comm, b, n, FL_F32, peer, TAG_TIED);
    for (size_t k = 0; s == FL_OK && k < n; k++) a[k] += b[k];
    if (s == FL_OK) fl_convert(raw, o->w.gt, a, FL_F32, n);
    if (s == FL_OK) s = FL_RUN(grad_be(o), to_device, g, raw, n * es);
    free(a), free(b), free(raw);
    return fl_error_prefix(s, "pipeline: the tied embeddings' gradient");
}

/* An encoder-decoder's stages: the shared embedding (each stage that runs an embedding, and the tied head, adds its
 * part) and each stack's relative bias table (a copy on every stage holding blocks of the stack, each folding its
 * blocks' d(bias)) summed over the pipeline in one all-reduce, so every copy gets the whole gradient and updates alike
 * (the one process sums them micro-batch by micro-batch and block by block: this differs by rounding). ZeRO-2: each
 * entry's reduced gradient made whole on the axis first (whole_reduced). A stage without a table adds zeros. */
/* chunk model m's shared embedding (e 0) and encoder / decoder relative bias table (e 1, 2): its entry, -1 if none */
static int shared_entry(const fl_model *m, int e) {
    if (e == 0) return fl_layout_role(&m->layout, 0, FL_ROLE_EMBED);
    for (int i = 0; i < m->layout.n; i++)
        if (m->layout.params[i].role == FL_ROLE_REL_BIAS && !strncmp(m->layout.params[i].name, "decoder.", 8) == (e == 2))
            return i;
    return -1;
}

/* FULL_SHARD: entry pi of chunk c sits in the rank's piece of its unit (unit g's whole elements [fo, fo + ln) at shard
 * offset so): add 1 adds the rank's part of the entry's reduced gradient into a (zeros elsewhere), else writes the
 * rank's part from a. The units holding a shared entry have the same size and layout on every stage and chunk (unit 0:
 * the shared embedding alone; a stack's first block's unit: a block with the table's copy), so a rank of the axis holds
 * the same elements of the entry on every stage, and the pipeline's sum of the parts is the sum of the entry there */
static fl_status shared_pieces(fl_pp *p, int c, const fl_optimizer *o, const fl_param_info *pi, int G, const size_t *fo,
                               const size_t *so, const size_t *ln, float *a, void *raw, float *tmp, int add) {
    const fl_backend *be = p->ch[c].m->be;
    const size_t es = fl_dtype_size(o->w.gt), n = pi->numel;
    if (add) memset(tmp, 0, n * sizeof *tmp);
    for (int g = 0; g < G; g++) {
        const size_t k0 = pi->offset > fo[g] ? pi->offset : fo[g];
        const size_t k1 = pi->offset + n < fo[g] + ln[g] ? pi->offset + n : fo[g] + ln[g];
        if (k0 >= k1) continue;
        char *at = (char *)o->w.g + (so[g] + k0 - fo[g]) * es;
        const size_t e0 = k0 - pi->offset, len = k1 - k0;
        if (add) {
            FL_TRY(FL_RUN(be, to_host, raw, at, len * es));
            fl_convert(tmp + e0, FL_F32, raw, o->w.gt, len);
        } else {
            fl_convert(raw, o->w.gt, a + e0, FL_F32, len);
            FL_TRY(FL_RUN(be, to_device, at, raw, len * es));
        }
    }
    for (size_t k = 0; add && k < n; k++) a[k] += tmp[k];
    return FL_OK;
}

/* move entry e's gradient of chunk c between its optimizer's buffer and a (fp32, n): add 1 adds it into a (ZeRO-2:
 * made whole on the axis first; FULL_SHARD: shared_pieces), else writes a into it */
static fl_status shared_move(fl_pp *p, int c, fl_optimizer *o0, int e, float *a, size_t n, void *raw, float *tmp, int add) {
    const fl_model *m = p->ch[c].m;
    const fl_optimizer *o = c == 0 ? o0 : p->ch[c].o;
    const int i = shared_entry(m, e);
    if (i < 0) return FL_OK;
    const fl_param_info *pi = &m->layout.params[i];
    const size_t es = fl_dtype_size(o->w.gt);
    if (pi->numel != n) return fl_errorf(FL_ERR_INTERNAL, "pipeline: %s has %zu elements, not %zu", pi->name, pi->numel, n);
    size_t fo[FL_PP_MAX_UNITS], so[FL_PP_MAX_UNITS], ln[FL_PP_MAX_UNITS];
    const int G = fsdp_units(p, c, fo, so, ln);
    if (G) return shared_pieces(p, c, o, pi, G, fo, so, ln, a, raw, tmp, add);
    char *g = (char *)o->w.g + pi->offset * es;
    if (!add) {
        fl_convert(raw, o->w.gt, a, FL_F32, n);
        return FL_RUN(grad_be(o), to_device, g, raw, n * es);
    }
    FL_TRY(FL_RUN(grad_be(o), to_host, raw, g, n * es));
    fl_convert(tmp, FL_F32, raw, o->w.gt, n);
    if (p->inner && p->inner->stage == 2) FL_TRY(whole_reduced(p, o, tmp, pi->offset, n));
    for (size_t k = 0; k < n; k++) a[k] += tmp[k];
    return FL_OK;
}

/* An encoder-decoder's stages: the shared embedding (each stage that runs an embedding, and the tied head, adds its
 * part) and each stack's relative bias table (a copy on every stage holding blocks of the stack, each folding its
 * blocks' d(bias)) summed over the rank's chunks and then the pipeline in one all-reduce, so every copy gets the whole
 * gradient and updates alike (the one process sums them micro-batch by micro-batch and block by block: this differs
 * by rounding). ZeRO-2: each entry's reduced gradient made whole on the axis first (whole_reduced). A stage without a
 * table adds zeros. LoRA: the base is frozen, nothing to sum. */
static fl_status s2s_shared_sum(fl_pp *p, fl_optimizer *o) {
    fl_model *m = p->m;
    if (p->stages < 2 || p->adapters) return FL_OK;
    const size_t nt = (size_t)m->cfg.n_heads * m->cfg.rel_buckets;
    const size_t len[3] = {(size_t)fl_config_vocab_rows(&m->cfg, NULL) * m->cfg.dim, nt, nt}, tot = len[0] + 2 * nt;
    if (p->discard) /* a plan's: the same all-reduce, empty (stream_send; the tables' host copies otherwise) */
        return fl_error_prefix(fl_comm_all_reduce(p->comm, NULL, NULL, 0, FL_F32, FL_COMM_SUM),
                               "pipeline: the shared embedding's and relative bias tables' gradients");
    float *a = calloc(tot + len[0] + 1, sizeof *a), *tmp = a ? a + tot : NULL;
    void *raw = malloc(len[0] * sizeof(double) + 1); /* the widest gradient dtype's bytes */
    fl_status s = a && raw ? FL_OK : fl_errorf(FL_ERR_OOM, "pipeline: out of host memory (the shared gradients)");
    for (int c = 0; s == FL_OK && c < p->chunks; c++)
        for (size_t e = 0, at = 0; s == FL_OK && e < 3; at += len[e], e++)
            s = shared_move(p, c, o, (int)e, a + at, len[e], raw, tmp, 1);
    if (s == FL_OK) s = fl_comm_all_reduce(p->comm, a, a, tot, FL_F32, FL_COMM_SUM);
    for (int c = 0; s == FL_OK && c < p->chunks; c++)
        for (size_t e = 0, at = 0; s == FL_OK && e < 3; at += len[e], e++)
            s = shared_move(p, c, o, (int)e, a + at, len[e], raw, tmp, 0);
    free(a), free(raw);
    return fl_error_prefix(s, "pipeline: the shared embedding's and relative bias tables' gradients");
}

/* the schedule's operations; the number of chunk-micro-batches in flight measured as they run */
static fl_status schedule(run *r, const fl_pp_op *ops, int n_ops) {
    int in_flight = 0;
    for (int i = 0; i < n_ops; i++) {
        const int k = ops[i].mb, ch = ops[i].chunk;
        fl_status s = ops[i].kind == FL_PP_FWD ? fwd(r, ch, k) : bwd(r, ch, k);
        if (s != FL_OK) {
            r->c->failed_k = k;
            if (r->p->chunks > 1)
                return fl_error_prefix(s, "pipeline stage %d chunk %d (virtual stage %d), micro-batch %d %s", r->p->stage,
                                       ch, ch * r->p->stages + r->p->stage, k, ops[i].kind == FL_PP_FWD ? "forward" : "backward");
            return fl_error_prefix(s, "pipeline stage %d, micro-batch %d %s", r->p->stage, k,
                                   ops[i].kind == FL_PP_FWD ? "forward" : "backward");
        }
        in_flight += ops[i].kind == FL_PP_FWD ? 1 : -1;
        if (in_flight > r->p->peak_in_flight) r->p->peak_in_flight = in_flight;
    }
    return FL_OK;
}

/* after the schedule: DDP's reduction (chunk 0's buckets; a later chunk's whole buffer), the tied table's sum, and
 * each chunk's update (the clipping norm over every chunk of every stage: pp_grad_sumsq) */
/* interleaved under loss scaling: one overflow verdict for the step, any inf/NaN among every chunk's reduced gradients
 * (ZeRO-2: each rank's piece, summed over the axis) of every stage; each chunk optimizer's check then returns it
 * (pp_any, inner_sum), so every chunk skips or updates alike and their scales (copies of one) stay equal */
static fl_status amp_verdict(fl_pp *p, fl_optimizer *o0) {
    const int zero2 = p->inner && p->inner->stage >= 2;
    int any = 0;
    for (int ch = 0; ch < p->chunks; ch++) {
        const fl_optimizer *o = ch == 0 ? o0 : p->ch[ch].o;
        const size_t off = zero2 ? o->shard.off : 0, n = zero2 ? o->shard.len : o->w.n;
        int f = 0;
        if (n) FL_TRY(FL_RUN(grad_be(o), check_finite, (const char *)o->w.g + off * fl_dtype_size(o->w.gt), o->w.gt, n,
                             fl_loss_scale_inv(&o->amp.ls), &f));
        any |= f != 0;
    }
    double v = any;
    if (zero2) FL_TRY(p->inner->sum(p->inner->ud, &v, 1));
    FL_TRY(fl_error_prefix(sum_stages(p->comm, v, &v), "pipeline: the overflow check"));
    if (p->tp_comm) FL_TRY(fl_error_prefix(sum_stages(p->tp_comm, v, &v), "pipeline: the overflow check (the group)"));
    p->amp_found = v > 0;
    p->amp_ok = 1;
    return FL_OK;
}

static fl_status reduce_and_update(fl_pp *p, fl_optimizer *o, fl_step_ctx *c, double *norm) {
    /* FULL_SHARD reduced each unit in the backward: the sums over the stages first, then the wait for the units'
     * updates (fl_dp_reduce_grads; a held unit 0 updates there, after the tied sum). Otherwise the reduction first. */
    const int fsdp = c->dp && c->dp->fsdp;
    if (fsdp) FL_TRY(p->m->cfg.pp_enc > 0 ? s2s_shared_sum(p, o) : tied_sum(p, o));
    if (c->dp) FL_TRY(fl_dp_reduce_grads(c->dp, o));
    for (int ch = 1; c->dp && ch < p->chunks; ch++) {
        fl_dp *xd = chunk_fsdp(p, c, ch);
        if (xd && xd != c->dp) FL_TRY(fl_fsdp_update_wait(xd, p->ch[ch].o)); /* the chunk's own units' updates */
        FL_TRY(fl_dp_reduce_grads(c->dp, p->ch[ch].o));
    }
    if (!fsdp) FL_TRY(p->m->cfg.pp_enc > 0 ? s2s_shared_sum(p, o) : tied_sum(p, o));
    fl_mem_set_phase(p->m->pool, "optimizer step");
    p->norm_ok = 0;
    p->amp_ok = 0;
    p->lora_reduced = 0;
    if (p->chunks > 1 && o->amp.on) FL_TRY(amp_verdict(p, o));
    fl_status s = fl_optim_step(o, c->lr, c->max_norm, norm);
    for (int ch = 1; s == FL_OK && ch < p->chunks; ch++) {
        double nc = 0;
        s = fl_optim_step(p->ch[ch].o, c->lr, c->max_norm, &nc);
    }
    p->amp_ok = 0;
    return s;
}

fl_status fl_pp_step_run(fl_pp *p, fl_optimizer *o, fl_step_ctx *c, fl_step_result *res) {
    fl_step_result rs = {0};
    const int M = c->n_micro, V = p->chunks;
    const double t0 = now_ms();
    c->failed_k = -1;
    if (c->step_valid <= 0 && c->skip_empty) { /* every target masked (the count is the step's over every rank): no
                                                * forward and no update on any stage, as fl_step_run */
        for (int k = 0; k < M; k++) {
            if (c->mb_stats) c->mb_stats[2 * k] = c->mb_stats[2 * k + 1] = 0;
            if (c->mb_ms) c->mb_ms[k] = 0;
        }
        rs.loss = NAN;
        if (res) *res = rs;
        return FL_OK;
    }
    if (M < 1 || M > 64)
        return fl_errorf(FL_ERR_UNSUPPORTED, "--pipeline_parallel: %d micro-batches per step (gradient accumulation "
                         "steps): 1 to 64", M);
    if (c->step_valid <= 0) return fl_errorf(FL_ERR_INVALID, "training step has no target tokens (all are ignore_index)");
    for (int ch = 1; ch < V; ch++)
        if (!p->ch[ch].o) return fl_errorf(FL_ERR_INVALID, "pipeline: chunk %d has no optimizer (fl_pp_chunk_optim)", ch);
    const int s2s = fl_model_is_s2s(&p->m->cfg);
    for (int k = 0; k < M; k++)
        if (stream_elems(p->m, &c->mbs[k], 0) > p->hx_n || stream_elems(p->m, &c->mbs[k], 1) > p->hx_n ||
            !c->mbs[k].src != !s2s)
            return fl_errorf(FL_ERR_INVALID, "pipeline: micro-batch %d (%d, %d) exceeds the stage's arena", k,
                             c->mbs[k].B, c->mbs[k].T);
    fl_pp_op *ops = malloc((size_t)2 * M * V * sizeof *ops);
    double *stats = calloc((size_t)2 * M, sizeof *stats);
    run r = {.p = p, .o = o, .c = c, .stats = stats};
    for (int ch = 0; ch < FL_PP_MAX_CHUNKS; ch++) {
        r.live[ch] = -1;
        for (int k = 0; k < 64; k++) r.slot_of[ch][k] = -1;
    }
    r.grad_scale = (float)(1.0 / (double)c->step_valid);
    if (o && o->amp.on) r.grad_scale *= fl_loss_scale_value(&o->amp.ls);
    fl_status s = ops && stats ? FL_OK : fl_errorf(FL_ERR_OOM, "pipeline: out of host memory");
    if (s == FL_OK) s = fl_pp_schedule_ops_v(p->kind, p->stages, V, p->stage, M, ops);
    if (s == FL_OK) {
        for (int ch = 0; ch < V; ch++) fl_model_zero_grads(p->ch[ch].m);
        if (c->fault) s = c->fault(p->ch[0].m); /* test-only (fitllm/fault.h) */
        /* the phases of a pipelined step: its schedule (forwards and backwards interleaved), the update; snapshots
         * before, after the schedule (the micro-batches in flight at its peak) and after the update */
        fl_mem_snapshot(p->m->pool, "before_fwd");
        fl_mem_set_phase(p->m->pool, "pipeline schedule");
        if (s == FL_OK) s = schedule(&r, ops, 2 * M * V);
        for (int ch = 0; s == FL_OK && ch < V; ch++) /* the units' updates done beside the schedule (counted) */
            if (chunk_fsdp(p, c, ch)) fl_fsdp_update_mark(chunk_fsdp(p, c, ch));
        if (s == FL_OK) fl_mem_snapshot(p->m->pool, "after_bwd");
    }
    /* the losses to every stage (doubles as pairs of F32 words: the bits travel) */
    if (s == FL_OK) s = fl_comm_broadcast(p->comm, stats, (size_t)4 * M, FL_F32, p->stages - 1);
    double loss_sum = 0;
    for (int k = 0; s == FL_OK && k < M; k++) {
        loss_sum += stats[2 * k];
        if (c->mb_stats) c->mb_stats[2 * k] = stats[2 * k], c->mb_stats[2 * k + 1] = stats[2 * k + 1];
        if (!isfinite(stats[2 * k]) && !(o && o->amp.on)) {
            c->failed_k = k;
            s = fl_errorf(FL_ERR_NONFINITE, "the loss is %s", isnan(stats[2 * k]) ? "NaN" : stats[2 * k] > 0 ? "+inf" : "-inf");
        }
    }
    double norm = 0;
    if (s == FL_OK) s = reduce_and_update(p, o, c, &norm);
    if (s == FL_OK) fl_mem_snapshot(p->m->pool, "after_opt_step");
    if (s != FL_OK && c->failed_k < 0) c->failed_k = M;
    free(ops);
    free(stats);
    if (s != FL_OK) return s;
    /* the stages interleave the micro-batches: each is given an equal share of the step's time */
    rs.ms_total = now_ms() - t0;
    p->step_ms += rs.ms_total;
    p->n_steps++;
    for (int k = 0; c->mb_ms && k < M; k++) c->mb_ms[k] = rs.ms_total / M;
    rs.loss = loss_sum / (double)c->step_valid;
    rs.n_valid = c->step_valid;
    rs.grad_norm = norm;
    rs.skipped = o->amp.skipped;
    rs.loss_scale = o->amp.on ? fl_loss_scale_value(&o->amp.ls) : 0.0f;
    if (res) *res = rs;
    return FL_OK;
}

fl_status fl_pp_timing(fl_pp *p, double *fwd, double *bwd, double *step_ms) {
    const int S = p->stages, V = p->chunks, w = 2 * V + 1;
    /* per stage: each chunk's means (forward, backward), the step's, all-gathered as the bits of doubles */
    double mine[2 * FL_PP_MAX_CHUNKS + 1];
    for (int c = 0; c < V; c++) {
        const fl_pp_chunk *h = &p->ch[c];
        mine[2 * c] = h->n_fwd ? h->fwd_ms / h->n_fwd : 0;
        mine[2 * c + 1] = h->n_bwd ? h->bwd_ms / h->n_bwd : 0;
    }
    mine[2 * V] = p->n_steps ? p->step_ms / p->n_steps : 0;
    double *all = malloc((size_t)w * S * sizeof *all);
    if (!all) return fl_errorf(FL_ERR_OOM, "pipeline timing: out of host memory");
    fl_status s = fl_comm_all_gather(p->comm, mine, all, (size_t)2 * w * S, FL_F32);
    *step_ms = 0;
    for (int k = 0; s == FL_OK && k < S; k++) {
        for (int c = 0; c < V; c++) fwd[c * S + k] = all[w * k + 2 * c], bwd[c * S + k] = all[w * k + 2 * c + 1];
        if (all[w * k + 2 * V] > *step_ms) *step_ms = all[w * k + 2 * V]; /* the slowest stage's view of the step */
    }
    free(all);
    return fl_error_prefix(s, "pipeline timing");
}

/* validation: the virtual stages in order (each rank its chunks in turn), the losses from the last */
fl_status fl_pp_eval(fl_pp *p, const int32_t *ids, const int32_t *targets, int B, int T) {
    const int S = p->stages, NV = S * p->chunks;
    if (p->m->cfg.pp_enc > 0)
        return fl_errorf(FL_ERR_INVALID, "pipeline: an encoder-decoder's stages validate with fl_pp_eval_s2s");
    const size_t n = fl_model_stage_elems(p->m, B, T);
    if (n > p->hx_n) return fl_errorf(FL_ERR_INVALID, "pipeline: batch (%d, %d) exceeds the stage's arena", B, T);
    fl_model *m = p->m;
    for (int c = 0; c < p->chunks; c++) {
        const int v = c * S + p->stage;
        m = p->ch[c].m;
        if (v > 0) {
            FL_TRY(stream_recv(p, n, (v - 1) % S, tag_act(p, c)));
            if (!p->discard) FL_TRY(fl_model_stage_input(m, p->hx, B, T));
        }
        if (c > 0) fl_model_lora_set_train(m, 0); /* LoRA: no dropout (the caller turns chunk 0's off) */
        fl_status s = fl_model_forward(m, ids, targets, B, T, 0.0f, NULL);
        if (c > 0) fl_model_lora_set_train(m, 1);
        FL_TRY(s);
        if (v < NV - 1) {
            if (!p->discard) FL_TRY(fl_model_stage_output(m, p->hx));
            FL_TRY(stream_send(p, n, (v + 1) % S, tag_act(p, (v + 1) / S)));
        }
    }
    double v[2] = {m->loss_sum, (double)m->n_valid};
    FL_TRY(fl_comm_broadcast(p->comm, v, 4, FL_F32, S - 1));
    p->m->loss_sum = v[0];
    p->m->n_valid = (long)v[1];
    return FL_OK;
}

/* an encoder-decoder's validation forward through the stages (one chunk per rank): the stream as in a training
 * forward, without gradients; the losses from the last stage */
fl_status fl_pp_eval_s2s(fl_pp *p, const fl_micro_batch *mb) {
    fl_model *m = p->m;
    const int S = p->stages, s = p->stage;
    if (!fl_model_is_s2s(&m->cfg) || !mb->src || p->chunks > 1)
        return fl_errorf(FL_ERR_INVALID, "fl_pp_eval_s2s: an encoder-decoder's micro-batch on one chunk per rank");
    if (stream_elems(m, mb, 0) > p->hx_n || stream_elems(m, mb, 1) > p->hx_n)
        return fl_errorf(FL_ERR_INVALID, "pipeline: batch (%d, %d, %d) exceeds the stage's arena", mb->B, mb->Ts, mb->T);
    if (s > 0) {
        FL_TRY(stream_recv(p, stream_elems(m, mb, 0), s - 1, TAG_ACT));
        if (!p->discard) FL_TRY(stage_input(m, p->hx, mb));
    }
    FL_TRY(fl_model_forward_micro(m, mb, 0.0f, NULL));
    FL_TRY(fl_model_forward_head(m, NULL));
    if (s < S - 1) {
        if (!p->discard) FL_TRY(fl_model_stage_output(m, p->hx));
        FL_TRY(stream_send(p, stream_elems(m, mb, 1), s + 1, TAG_ACT));
    }
    double v[2] = {m->loss_sum, (double)m->n_valid};
    FL_TRY(fl_comm_broadcast(p->comm, v, 4, FL_F32, S - 1));
    m->loss_sum = v[0];
    m->n_valid = (long)v[1];
    return FL_OK;
}

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

enum { TAG_ACT = 0, TAG_GRAD = 1, TAG_TIED = 2 };
#define FL_PP_MAX_UNITS 1024 /* layout groups of a stage under FULL_SHARD (its blocks + 2) */

void fl_pp_free(fl_pp *p) {
    for (int i = 0; i < p->n_stash; i++) fl_model_stage_stash_free(p->m, p->stash[i]);
    free(p->stash);
    free(p->hx);
    if (p->swap) fl_mem_free(p->m->pool, p->swap);
    memset(p, 0, sizeof *p);
}

fl_status fl_pp_init(fl_pp *p, fl_model *m, fl_comm *comm, fl_pp_schedule kind) {
    memset(p, 0, sizeof *p);
    p->comm = comm;
    p->stages = fl_comm_size(comm);
    p->stage = fl_comm_rank(comm);
    p->kind = kind;
    p->m = m;
    FL_TRY(fl_model_set_stage(m, p->stage > 0, p->stage < p->stages - 1));
    p->hx_n = (size_t)m->B * m->T * m->cfg.dim;
    p->hx = malloc(p->hx_n * sizeof *p->hx + 1);
    if (!p->hx) return fl_errorf(FL_ERR_OOM, "pipeline stage %d: out of host memory for the stream's staging", p->stage);
    const size_t chunk = (size_t)1 << 20;
    p->swap_bytes = m->sizes.acts_bytes < chunk ? m->sizes.acts_bytes : chunk;
    fl_status s = p->stages > 1 ? fl_mem_alloc(m->pool, FL_TAG_WORKSPACE, p->swap_bytes, &p->swap) : FL_OK;
    if (s != FL_OK) fl_pp_free(p); /* the caller frees only a stage that started (a plan's OOM ends here) */
    return s;
}

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

/* FULL_SHARD on the data axis (stage 3 of a full model): its units' ranges (fl_fsdp_ranges), else 0 */
static int fsdp_units(const fl_pp *p, size_t *fo, size_t *so, size_t *ln) {
    if (!p->inner || p->inner->stage != 3 || p->adapters) return 0;
    const fl_dp *dp = p->inner->ud;
    if (!dp->fsdp || p->m->layout.n_groups > FL_PP_MAX_UNITS) return 0;
    return fl_fsdp_ranges(dp, fo, so, ln);
}
/* unit g (a layout group: 0 the embeddings, G - 1 the final norm and head) is trained by the stage */
static int unit_owned(const fl_model *m, int g, int G) { return g == 0 ? !m->stage.in : g == G - 1 ? !m->stage.out : 1; }

/* the whole model's squared gradient norm: each stage's trained entries, summed over the stages. Under DDP every
 * data-parallel rank holds the same reduced gradient; under ZeRO-1/2 a rank adds the part of each entry in its chunk
 * [off, off + len) of the stage's buffer (ZeRO-2 holds no other reduced gradient) and the axis sums the chunks in
 * rank order first */
static fl_status pp_grad_sumsq(void *ud, const fl_optimizer *o, double *out) {
    const fl_pp *p = ud;
    const fl_model *m = p->m;
    const size_t es = fl_dtype_size(o->w.gt);
    const int zero = p->inner && p->inner->stage > 0;
    const size_t c0 = zero ? o->shard.off : 0, c1 = zero ? o->shard.off + o->shard.len : o->w.n;
    double v = 0;
    /* LoRA: every adapter of the stage (a head adapter that only the last stage runs has a zero gradient elsewhere) */
    if (p->adapters && c0 < c1) v = m->be->sumsq(m->be, (const char *)o->w.g + c0 * es, o->w.gt, c1 - c0);
    /* FULL_SHARD: the rank's piece of each unit (a layout group) the stage trains, in the shard at shard_off[g] */
    size_t fo[FL_PP_MAX_UNITS], so[FL_PP_MAX_UNITS], ln[FL_PP_MAX_UNITS];
    const int G = fsdp_units(p, fo, so, ln);
    for (int g = 0; g < G; g++)
        if (unit_owned(m, g, G) && ln[g]) v += m->be->sumsq(m->be, (const char *)o->w.g + so[g] * es, o->w.gt, ln[g]);
    for (int i = 0; !p->adapters && !G && i < m->layout.n; i++) {
        const fl_param_info *e = &m->layout.params[i];
        const size_t a = e->offset > c0 ? e->offset : c0, b = e->offset + e->numel < c1 ? e->offset + e->numel : c1;
        if (fl_pp_stage_owns(m, i) && a < b) v += m->be->sumsq(m->be, (const char *)o->w.g + a * es, o->w.gt, b - a);
    }
    if (zero) FL_TRY(p->inner->sum(p->inner->ud, &v, 1));
    return fl_error_prefix(sum_stages(p->comm, v, out), "pipeline: the gradient norm");
}

static fl_status pp_any(void *ud, int *flag) {
    const fl_pp *p = ud;
    double v = *flag != 0;
    FL_TRY(fl_error_prefix(sum_stages(p->comm, v, &v), "pipeline: the overflow check"));
    *flag = v > 0;
    return FL_OK;
}

/* the data-parallel hooks (DDP, ZeRO-1/2) under the pipeline's: a sum is the whole grid's (the axis, then the
 * stages): its users decide for every rank (ZeRO-2's overflow verdict) */
static fl_status inner_sum(void *ud, double *v, int n) {
    const fl_pp *p = ud;
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
    if (in && (in->stage > 3 || in->grad_sumsq))
        return fl_errorf(FL_ERR_UNSUPPORTED, "--pipeline_parallel %d: the data-parallel axis runs DDP, ZeRO-1, ZeRO-2 or "
                         "FULL_SHARD (its optimizer is at stage %d)", p->stages, in->stage);
    fl_lora_adapters ad;
    p->adapters = fl_model_lora_adapters(p->m, &ad);
    if (p->adapters ? o->w.n != ad.numel || o->w.p != ad.params
                    : o->w.n != fl_model_store_numel(p->m) || o->w.p != fl_model_params_data(p->m)) /* FULL_SHARD: the shard's */
        return fl_errorf(FL_ERR_UNSUPPORTED, "--pipeline_parallel %d: the optimizer must train the stage's parameters "
                         "or its LoRA adapters", p->stages);
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

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* the arena's micro-batch parked in a free stash slot (one more slot when all are taken) */
static fl_status park(fl_pp *p, int mb, int *slot_of) {
    int free_slot = -1;
    for (int i = 0; i < p->n_stash && free_slot < 0; i++) {
        int used = 0;
        for (int k = 0; slot_of && k < 64 && !used; k++) used = slot_of[k] == i;
        if (!used) free_slot = i;
    }
    if (free_slot < 0) {
        fl_stage_stash **ns = realloc(p->stash, (size_t)(p->n_stash + 1) * sizeof *ns);
        if (!ns) return fl_errorf(FL_ERR_OOM, "pipeline: out of host memory");
        p->stash = ns;
        FL_TRY(fl_model_stage_stash_new(p->m, &p->stash[p->n_stash]));
        free_slot = p->n_stash++;
    }
    FL_TRY(fl_model_stage_stash_save(p->m, p->stash[free_slot]));
    slot_of[mb] = free_slot;
    return FL_OK;
}

typedef struct {
    fl_pp *p;
    fl_optimizer *o;
    fl_step_ctx *c;
    float grad_scale;
    int live;        /* the micro-batch whose activations the arena holds (-1: none) */
    int slot_of[64]; /* each micro-batch's stash slot (-1: none) */
    double *stats;   /* (2 M) loss sum and valid targets (the last stage's) */
} run;

/* LoRA's dropout masks of micro-batch k: fl_step_run's seed (run seed, global micro-batch), set before its forward and
 * again before its backward (which draws the same masks again), as other micro-batches ran in between */
static void seed_micro(run *r, int k) {
    const fl_step_ctx *c = r->c;
    const int world = c->dp ? c->dp->world : 1, rank = c->dp ? c->dp->rank : 0;
    if (c->seeded) fl_model_adapters_seed(r->p->m, c->seed + (uint64_t)(c->iter0 + (long)k * world + rank));
}

static fl_status fwd(run *r, int k) {
    fl_pp *p = r->p;
    fl_model *m = p->m;
    const fl_micro_batch *mb = &r->c->mbs[k];
    seed_micro(r, k);
    const size_t n = (size_t)mb->B * mb->T * m->cfg.dim;
    if (r->live >= 0) FL_TRY(park(p, r->live, r->slot_of)); /* its backward comes later */
    r->live = -1;
    if (p->stage > 0) {
        FL_TRY(fl_comm_recv(p->comm, p->hx, n, FL_F32, p->stage - 1, TAG_ACT));
        FL_TRY(fl_model_stage_input(m, p->hx, mb->B, mb->T));
    }
    const double t0 = now_ms();
    FL_TRY(fl_model_forward_body(m, mb->ids, mb->targets, mb->B, mb->T, r->grad_scale));
    FL_TRY(fl_model_forward_head(m, NULL));
    p->fwd_ms += now_ms() - t0;
    p->n_fwd++;
    r->live = k;
    if (p->stage < p->stages - 1) {
        FL_TRY(fl_model_stage_output(m, p->hx));
        FL_TRY(fl_comm_send(p->comm, p->hx, n, FL_F32, p->stage + 1, TAG_ACT));
    } else {
        r->stats[2 * k] = m->loss_sum;
        r->stats[2 * k + 1] = (double)m->n_valid;
    }
    return FL_OK;
}

static fl_status bwd(run *r, int k) {
    fl_pp *p = r->p;
    fl_model *m = p->m;
    const fl_micro_batch *mb = &r->c->mbs[k];
    const size_t n = (size_t)mb->B * mb->T * m->cfg.dim;
    if (r->live != k) { /* k back from its slot; the arena's micro-batch (if any) into that slot */
        const int slot = r->slot_of[k];
        if (r->live >= 0) FL_TRY(fl_model_stage_stash_swap(m, p->stash[slot], p->swap, p->swap_bytes));
        else FL_TRY(fl_model_stage_stash_restore(m, p->stash[slot]));
        if (r->live >= 0) r->slot_of[r->live] = slot;
        r->slot_of[k] = -1;
        r->live = k;
    }
    if (p->stage < p->stages - 1) {
        FL_TRY(fl_comm_recv(p->comm, p->hx, n, FL_F32, p->stage + 1, TAG_GRAD));
        FL_TRY(fl_model_stage_dout(m, p->hx));
    }
    seed_micro(r, k);
    if (r->c->dp) fl_dp_buckets_arm(r->c->dp, r->o, k == r->c->n_micro - 1); /* the last backward reduces */
    FL_TRY(fl_model_stage_open_grads(m));
    const double t0 = now_ms();
    FL_TRY(fl_model_backward(m));
    p->bwd_ms += now_ms() - t0;
    p->n_bwd++;
    r->live = -1;
    if (p->stage > 0) {
        FL_TRY(fl_model_stage_dinput(m, p->hx, mb->B, mb->T));
        FL_TRY(fl_comm_send(p->comm, p->hx, n, FL_F32, p->stage - 1, TAG_GRAD));
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
static fl_status tied_sum(fl_pp *p, fl_optimizer *o) {
    fl_model *m = p->m;
    const int S = p->stages, peer = p->stage == 0 ? S - 1 : 0;
    if (!m->cfg.tie_embeddings || S < 2 || (p->stage != 0 && p->stage != S - 1) || p->adapters) return FL_OK;
    const int i = fl_layout_role(&m->layout, 0, FL_ROLE_EMBED);
    if (i < 0) return FL_OK;
    size_t n = m->layout.params[i].numel, es = fl_dtype_size(o->w.gt);
    char *g = (char *)o->w.g + m->layout.params[i].offset * es;
    /* FULL_SHARD: the rank's piece of unit 0 (the embeddings' group, the same size on both end stages, so the same
     * piece of it on the same rank of the axis); the other entries of the group (GPT-2's positions) add 0 */
    size_t fo[FL_PP_MAX_UNITS], so[FL_PP_MAX_UNITS], ln[FL_PP_MAX_UNITS];
    const int fsdp = fsdp_units(p, fo, so, ln) > 0;
    if (fsdp) n = ln[0], g = (char *)o->w.g + so[0] * es;
    float *a = malloc(n * sizeof *a + 1), *b = malloc(n * sizeof *b + 1);
    void *raw = malloc(n * es + 1);
    fl_status s = a && b && raw ? FL_OK : fl_errorf(FL_ERR_OOM, "pipeline: out of host memory (tied embeddings)");
    if (s == FL_OK) s = m->be->to_host(m->be, raw, g, n * es);
    if (s == FL_OK) fl_convert(a, FL_F32, raw, o->w.gt, n);
    if (s == FL_OK && !fsdp && p->inner && p->inner->stage == 2) s = whole_reduced(p, o, a, m->layout.params[i].offset, n);
    if (s == FL_OK) s = fl_comm_send(p->comm, a, n, FL_F32, peer, TAG_TIED);
    if (s == FL_OK) s = fl_comm_recv(p->comm, b, n, FL_F32, peer, TAG_TIED);
    for (size_t k = 0; s == FL_OK && k < n; k++) a[k] += b[k];
    if (s == FL_OK) fl_convert(raw, o->w.gt, a, FL_F32, n);
    if (s == FL_OK) s = m->be->to_device(m->be, g, raw, n * es);
    free(a), free(b), free(raw);
    return fl_error_prefix(s, "pipeline: the tied embeddings' gradient");
}

/* the schedule's operations; the number of micro-batches in flight measured as they run */
static fl_status schedule(run *r, const fl_pp_op *ops, int n_ops) {
    int in_flight = 0;
    for (int i = 0; i < n_ops; i++) {
        const int k = ops[i].mb;
        fl_status s = ops[i].kind == FL_PP_FWD ? fwd(r, k) : bwd(r, k);
        if (s != FL_OK) {
            r->c->failed_k = k;
            return fl_error_prefix(s, "pipeline stage %d, micro-batch %d %s", r->p->stage, k,
                                   ops[i].kind == FL_PP_FWD ? "forward" : "backward");
        }
        in_flight += ops[i].kind == FL_PP_FWD ? 1 : -1;
        if (in_flight > r->p->peak_in_flight) r->p->peak_in_flight = in_flight;
    }
    return FL_OK;
}

fl_status fl_pp_step_run(fl_pp *p, fl_optimizer *o, fl_step_ctx *c, fl_step_result *res) {
    fl_step_result rs = {0};
    const int M = c->n_micro;
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
    for (int k = 0; k < M; k++)
        if ((size_t)c->mbs[k].B * c->mbs[k].T * p->m->cfg.dim > p->hx_n || c->mbs[k].src)
            return fl_errorf(FL_ERR_INVALID, "pipeline: micro-batch %d (%d, %d) exceeds the stage's arena", k,
                             c->mbs[k].B, c->mbs[k].T);
    fl_pp_op *ops = malloc((size_t)2 * M * sizeof *ops);
    double *stats = calloc((size_t)2 * M, sizeof *stats);
    run r = {.p = p, .o = o, .c = c, .live = -1, .stats = stats};
    for (int k = 0; k < 64; k++) r.slot_of[k] = -1;
    r.grad_scale = (float)(1.0 / (double)c->step_valid);
    if (o && o->amp.on) r.grad_scale *= fl_loss_scale_value(&o->amp.ls);
    fl_status s = ops && stats ? FL_OK : fl_errorf(FL_ERR_OOM, "pipeline: out of host memory");
    if (s == FL_OK) s = fl_pp_schedule_ops(p->kind, p->stages, p->stage, M, ops);
    if (s == FL_OK) {
        fl_model_zero_grads(p->m);
        /* the phases of a pipelined step: its schedule (forwards and backwards interleaved), the update; snapshots
         * before, after the schedule (the micro-batches in flight at its peak) and after the update */
        fl_mem_snapshot(p->m->pool, "before_fwd");
        fl_mem_set_phase(p->m->pool, "pipeline schedule");
        s = schedule(&r, ops, 2 * M);
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
    if (s == FL_OK && c->dp) s = fl_dp_reduce_grads(c->dp, o);
    if (s == FL_OK) s = tied_sum(p, o);
    double norm = 0;
    if (s == FL_OK) fl_mem_set_phase(p->m->pool, "optimizer step");
    if (s == FL_OK) s = fl_optim_step(o, c->lr, c->max_norm, &norm);
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
    const int S = p->stages;
    /* per stage: its means (forward, backward, step), all-gathered as the bits of doubles */
    double mine[3] = {p->n_fwd ? p->fwd_ms / p->n_fwd : 0, p->n_bwd ? p->bwd_ms / p->n_bwd : 0,
                      p->n_steps ? p->step_ms / p->n_steps : 0};
    double *all = malloc((size_t)3 * S * sizeof *all);
    if (!all) return fl_errorf(FL_ERR_OOM, "pipeline timing: out of host memory");
    fl_status s = fl_comm_all_gather(p->comm, mine, all, (size_t)6 * S, FL_F32);
    *step_ms = 0;
    for (int k = 0; s == FL_OK && k < S; k++) {
        fwd[k] = all[3 * k], bwd[k] = all[3 * k + 1];
        if (all[3 * k + 2] > *step_ms) *step_ms = all[3 * k + 2]; /* the slowest stage's view of the step */
    }
    free(all);
    return fl_error_prefix(s, "pipeline timing");
}

fl_status fl_pp_eval(fl_pp *p, const int32_t *ids, const int32_t *targets, int B, int T) {
    fl_model *m = p->m;
    const size_t n = (size_t)B * T * m->cfg.dim;
    if (n > p->hx_n) return fl_errorf(FL_ERR_INVALID, "pipeline: batch (%d, %d) exceeds the stage's arena", B, T);
    if (p->stage > 0) {
        FL_TRY(fl_comm_recv(p->comm, p->hx, n, FL_F32, p->stage - 1, TAG_ACT));
        FL_TRY(fl_model_stage_input(m, p->hx, B, T));
    }
    FL_TRY(fl_model_forward(m, ids, targets, B, T, 0.0f, NULL));
    if (p->stage < p->stages - 1) {
        FL_TRY(fl_model_stage_output(m, p->hx));
        FL_TRY(fl_comm_send(p->comm, p->hx, n, FL_F32, p->stage + 1, TAG_ACT));
    }
    double v[2] = {m->loss_sum, (double)m->n_valid};
    FL_TRY(fl_comm_broadcast(p->comm, v, 4, FL_F32, p->stages - 1));
    m->loss_sum = v[0];
    m->n_valid = (long)v[1];
    return FL_OK;
}

/* The trainer's pipeline parallelism (--pipeline_parallel S, --pipeline_schedule gpipe|1f1b; EXPERIMENTAL;
 * src/train/trainer-impl.h, docs/ARCHITECTURE.md "Pipeline parallelism").
 *
 * The grid. World rank w is stage w % S of pipeline w / S, and rank w / S of the data-parallel axis (the ranks
 * of stage w % S across the pipelines): the S stages of a pipeline train the same micro-batches (the data is
 * split over the pipelines as DDP splits it over ranks), so the trainer's data-parallel context (t->dp) is the
 * axis and the loop, the loss statistics and DDP's reduction run over it unchanged. Every stage gets every
 * micro-batch's losses from the last stage (fl_pp_step_run), so every rank logs and decides alike; the lead is
 * world rank 0 (stage 0 of pipeline 0). Set-up agreements and stop decisions run over the whole grid
 * (t->tp.world is the grid here too). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer-impl.h"
#include "fitllm/checkpoint.h"
#include "fitllm/lora.h"

enum { TAG_CKPT = 3 };

fl_status fl_tr_pp_check(const trainer *t, const fl_strategy_choice *sc) {
    const fl_run_config *c = t->cfg;
    const int n = c->pipeline_parallel;
    if (n <= 1) return FL_OK;
    if (c->optimizer.kind == FL_OPT_ADAMW8BIT)
        return fl_errorf(FL_ERR_UNSUPPORTED, "--pipeline_parallel %d: AdamW8bit's block-wise state is not gathered into "
                         "checkpoints yet (AdamW and SGD are)", n);
    if (!strcmp(c->state_dict_type, "sharded"))
        return fl_errorf(FL_ERR_UNSUPPORTED, "--pipeline_parallel %d: fsdp.state_dict_type sharded is not written yet "
                         "(full: consolidated)", n);
    /* V stage models per rank: every strategy of the data axis runs (FULL_SHARD / HYBRID_SHARD: each chunk sharded on
     * its own), TP / SP too (each chunk a slice of its virtual stage) */
    (void)sc;
    return FL_OK;
}

fl_status fl_tr_pp_begin(trainer *t, fl_comm *world, const fl_model_config *given, fl_comm **dp_comm) {
    const int n = t->cfg->pipeline_parallel;
    const int W = world ? fl_comm_size(world) : 1, w = world ? fl_comm_rank(world) : 0;
    if (W % n)
        return fl_errorf(FL_ERR_INVALID, "--pipeline_parallel %d: this run has %d rank%s, not a multiple of it (launch "
                         "pipelines x %d ranks: --devices %d, %d, ...)", n, W, W == 1 ? "" : "s", n, n, 2 * n);
    fl_pp_schedule k;
    FL_TRY(fl_error_prefix(fl_pp_schedule_parse_all(t->cfg->pipeline_schedule, &k), "--pipeline_schedule"));
    t->pp.chunks = k == FL_PP_INTERLEAVED ? t->cfg->pipeline_chunks : 1;
    fl_strategy_choice sc;
    FL_TRY(fl_cfg_resolve_strategy(t->cfg, 0, &sc));
    FL_TRY(fl_tr_pp_check(t, &sc));
    FL_TRY(fl_error_prefix(fl_comm_split(world, w / n, w, &t->pp.grp), "--pipeline_parallel %d: the pipeline", n));
    FL_TRY(fl_error_prefix(fl_comm_split(world, w % n, w, &t->pp.dpc), "--pipeline_parallel %d: the data-parallel axis", n));
    t->pp.size = n;
    t->pp.stage = w % n;
    t->tp.world = world; /* the grid: agreements, stop decisions, the lead */
    fl_dp_init(&t->dp, t->pp.dpc, NULL);
    t->dp.grid = world;
    *dp_comm = t->pp.dpc;
    return FL_OK;
}

void fl_tr_pp_end(trainer *t) {
    if (t->pp.rt_ok) fl_pp_free(&t->pp.rt);
    t->pp.rt_ok = 0;
    fl_comm_destroy(t->pp.grp);
    fl_comm_destroy(t->pp.dpc);
    t->pp.grp = t->pp.dpc = NULL;
}

/* the stages' blocks, balanced by the planner's per-block cost (fl_pp_block_costs: the head's FLOPs on the last
 * block) at the run's sequence length (train.max_seq_length, else the model's context): every rank computes the same
 * split from the same config, and the checkpoints gather by it */
fl_status fl_tr_pp_stage_range(trainer *t, const fl_model_config *whole) {
    const int V = t->pp.chunks > 1 ? t->pp.chunks : 1, NV = t->pp.size * V;
    if (NV > 64) return fl_errorf(FL_ERR_UNSUPPORTED, "--pipeline_parallel %d: at most 64 (virtual) stages (%d x %d "
                                  "chunks)", t->pp.size, t->pp.size, V);
    const int T = t->cfg->train.max_seq_length > 0 ? t->cfg->train.max_seq_length : whole->max_seq;
    /* interleaved: S V virtual stages split by cost, chunk c of this stage being virtual stage c S + stage */
    fl_status s = fl_pp_split_model(whole, T, NV, t->pp.split);
    if (s != FL_OK && V > 1)
        return fl_errorf(FL_ERR_INVALID, "--pipeline_parallel %d x --pipeline_chunks %d: %d virtual stages for a model of "
                         "%d blocks (each needs at least one)", t->pp.size, V, NV, fl_pp_model_blocks(whole));
    FL_TRY(s);
    t->pp.first = t->pp.split[t->pp.stage];
    t->pp.last = t->pp.split[t->pp.stage + 1];
    return FL_OK;
}

/* interleaved: chunks 1 .. V - 1 of this stage (virtual stages c S + stage) made in the run's pool, their parameters
 * taken from the whole model (NULL: the planner's, random) */
static fl_status chunk_models(trainer *t, const fl_model_config *whole, const fl_model *w) {
    const int S = t->pp.size;
    for (int c = 1; c < t->pp.chunks; c++) {
        const int v = c * S + t->pp.stage;
        fl_model_config sc;
        FL_TRY(fl_pp_stage_config(whole, t->pp.split[v], t->pp.split[v + 1], &sc));
        fl_model_storage stg = t->stg; /* FULL_SHARD on the data axis: the chunk's units sharded by a bookkeeping of
                                        * its own (a copy of the axis' fl_dp, its communicators shared) */
        if (stg.shard) {
            t->pp.xdp[c] = t->dp;
            t->pp.xdp[c].fsdp = NULL;
            stg.shard_ud = &t->pp.xdp[c];
        }
        FL_TRY(fl_model_init_ex(&t->pp.xm[c], &sc, &t->hw.be, &t->hw.pool, &stg));
        t->pp.xm_ok = c;
        if (w) FL_TRY(fl_pp_stage_take(w, &t->pp.xm[c], t->pp.split[v]));
        else fl_model_init_random_ex(&t->pp.xm[c], t->cfg->seed);
    }
    return FL_OK;
}


void fl_tr_pp_free_chunks(trainer *t) {
    if (t->pp.rt_ok) fl_pp_free(&t->pp.rt);
    t->pp.rt_ok = 0;
    for (int c = 1; c <= t->pp.xo_ok; c++) fl_optim_free(&t->pp.xo[c]);
    for (int c = 1; c <= t->pp.xm_ok; c++) {
        fl_fsdp_free(&t->pp.xdp[c]); /* (its bookkeeping alone: the communicators are the axis') */
        fl_model_free(&t->pp.xm[c]);
    }
    t->pp.xo_ok = t->pp.xm_ok = 0;
}

/* the planner's rehearsal: the stage of the given shape made directly (no whole copy: it is outside the pool) */
static fl_status plan_stage(trainer *t, const fl_model_config *given) {
    fl_model_config sc;
    FL_TRY(fl_tr_pp_stage_range(t, given));
    FL_TRY(fl_pp_stage_config(given, t->pp.first, t->pp.last, &sc));
    t->pp.whole = *given;
    FL_TRY(fl_model_init_ex(&t->model, &sc, &t->hw.be, &t->hw.pool, &t->stg));
    t->model_ok = 1;
    fl_model_init_random_ex(&t->model, t->cfg->seed);
    return chunk_models(t, given, NULL);
}

/* whole models are never sharded: FULL_SHARD on the data axis (fl_fsdp_prepare's storage hook in t->stg) shards the
 * stage alone; nor quantized (the load's whole is: its 4-bit stores are copied into the stages as they are) */
static fl_status whole_unsharded(trainer *t, tp_whole *w, const fl_optimizer *o) {
    const fl_model_storage keep = t->stg;
    t->stg.shard = NULL;
    t->stg.quant4 = 0; /* QLoRA: the checkpoints' whole holds the dequantized base (fp32 reads of the 4-bit stores) */
    fl_status s = fl_tr_whole_make(t, w, &t->pp.whole, o);
    t->stg = keep;
    return s;
}

fl_status fl_tr_pp_load(trainer *t, const fl_model_config *given) {
    if (fl_backend_discards(&t->hw.be)) return plan_stage(t, given);
    tp_whole w;
    memset(&w, 0, sizeof w);
    fl_status s = fl_backend_pools_init(&t->hw.be, &w.pool, &w.hpool, "pipeline parallel (whole model)", 0);
    w.pool_ok = s == FL_OK;
    const fl_model_storage keep = t->stg; /* the whole model unsharded (whole_unsharded) */
    t->stg.shard = NULL;
    if (s == FL_OK) s = fl_tr_load_model(t, given, &w.m, &w.pool, &w.m_ok);
    t->stg = keep;
    if (s == FL_OK) s = fl_tr_pp_stage_range(t, &w.m.cfg);
    fl_model_config sc;
    if (s == FL_OK) s = fl_pp_stage_config(&w.m.cfg, t->pp.first, t->pp.last, &sc);
    if (s == FL_OK) {
        t->pp.whole = w.m.cfg;
        t->pp.whole_numel = w.m.layout.numel;
        s = fl_model_init_ex(&t->model, &sc, &t->hw.be, &t->hw.pool, &t->stg);
    }
    if (s == FL_OK) {
        t->model_ok = 1;
        s = fl_pp_stage_take(&w.m, &t->model, t->pp.first);
    }
    if (s == FL_OK) s = chunk_models(t, &w.m.cfg, &w.m);
    fl_tr_whole_free(&w);
    return s;
}

/* the whole model's index of the first adapter module of the stage starting at block `first`: decoder-only, first x
 * the modules of a block; an encoder-decoder's encoder and decoder blocks adapt different modules (the cross-attention),
 * numbered encoder blocks first, so first x an encoder block's before the decoder, then Le x it + the decoder blocks'
 * before (a stage's modules stay contiguous: one holding both stacks holds the encoder's end and the decoder's start) */
static fl_status lora_base(const fl_model_config *whole, const fl_lora_config *lc, int first, int *base) {
    fl_param_layout lay;
    FL_TRY(fl_layout_build(&lay, whole));
    fl_lora_module *mods = NULL;
    int n = 0, ne = 0, nd = 0;
    const int Le = whole->n_layers, s2s = fl_model_is_s2s(whole);
    fl_status s = fl_lora_modules(lc, &lay, whole, &mods, &n);
    for (int j = 0; s == FL_OK && j < n; j++) ne += mods[j].layer == 0, nd += s2s && mods[j].layer == Le;
    free(mods);
    fl_layout_free(&lay);
    *base = !s2s || first < Le ? first * ne : Le * ne + (first - Le) * nd;
    return s;
}

fl_status fl_tr_pp_lora_base(const trainer *t, const fl_lora_config *lc, int *base) {
    return lora_base(&t->pp.whole, lc, t->pp.first, base);
}

/* interleaved: chunk c's precision, gradients, arena and optimizer, as fl_tr_setup_model / _training make chunk 0's */
static fl_status chunk_setup(trainer *t, int c) {
    fl_model *m = &t->pp.xm[c];
    const int fsdp = t->pp.xdp[c].fsdp != NULL;
    FL_TRY(fl_model_set_precision(m, &t->model.prec));
    if (t->model.lora) { /* LoRA: the chunk's adapters, keyed (initial values, dropout streams) by the whole model's
                          * module index of its first block, as one process's */
        fl_lora_config lc;
        int base = 0;
        FL_TRY(fl_trainer_lora_config(t->cfg, &m->cfg, &lc));
        FL_TRY(lora_base(&t->pp.whole, &lc, t->pp.split[c * t->pp.size + t->pp.stage], &base));
        FL_TRY(fl_model_lora_init_at(m, &lc, t->cfg->seed, base));
        /* TP x PP: the row-parallel A the rank's columns of the whole's (module base + j's draws; no-op on a whole) */
        FL_TRY(fl_tp_lora_init(m, t->cfg->seed + (uint64_t)base * 0x9e3779b97f4a7c15ULL));
    } else {
        if (fsdp) FL_TRY(fl_fsdp_init(&t->pp.xdp[c], t->cfg, m)); /* FULL_SHARD: the gathered units' compute copy */
        FL_TRY(fl_model_alloc_grads(m));
    }
    m->act_ckpt = t->model.act_ckpt;
    if (t->sch.Ts) { /* an encoder-decoder's chunk: its dropout and arena as chunk 0's */
        FL_TRY(fl_model_set_dropout(m, 1));
        FL_TRY(fl_model_alloc_acts_s2s(m, t->sch.B, t->sch.Ts, t->sch.T));
    } else {
        if (t->model.cfg.dropout_on) FL_TRY(fl_model_set_dropout(m, 1)); /* OPT's dropout, as chunk 0's */
        FL_TRY(fl_model_alloc_acts(m, t->sch.B, t->sch.T));
    }
    /* ZeRO-1/2 on the data axis: the chunk's state for this rank's piece of its elements, as chunk 0's; FULL_SHARD:
     * of its shard (its own bookkeeping's hooks) */
    FL_TRY(fl_dp_optim_init(fsdp ? &t->pp.xdp[c] : &t->dp, t->cfg, &t->pp.xo[c], m));
    t->pp.xo_ok = c;
    t->pp.xo[c].amp.ls = t->opt.amp.ls; /* 16-mixed: one scale for every chunk (one verdict per step: pp_step.c) */
    return FL_OK;
}

fl_status fl_tr_pp_attach(trainer *t) {
    fl_pp_schedule k;
    FL_TRY(fl_pp_schedule_parse_all(t->cfg->pipeline_schedule, &k));
    if (k == FL_PP_INTERLEAVED && t->sch.accum % t->pp.size)
        return fl_errorf(FL_ERR_INVALID, "--pipeline_schedule interleaved: %d micro-batches per step (gradient "
                         "accumulation: global_batch_size / (data-parallel ranks x micro_batch_size)) is not a multiple of "
                         "the %d stages", t->sch.accum, t->pp.size);
    fl_model *ms[FL_PP_MAX_CHUNKS];
    ms[0] = &t->model;
    for (int c = 1; c < t->pp.chunks; c++) {
        FL_TRY(fl_error_prefix(chunk_setup(t, c), "--pipeline_schedule interleaved: chunk %d (virtual stage %d)", c,
                               c * t->pp.size + t->pp.stage));
        ms[c] = &t->pp.xm[c];
        ms[c]->stage.first = t->pp.split[c * t->pp.size + t->pp.stage]; /* OPT's dropout: the whole's block seeds */
    }
    FL_TRY(fl_pp_init_v(&t->pp.rt, ms, t->pp.chunks > 1 ? t->pp.chunks : 1, t->pp.grp, k));
    t->pp.rt_ok = 1;
    if (t->tp.size > 1) return FL_OK; /* TP x PP: the optimizers' hooks are the group's (fl_tr_tp_attach) */
    FL_TRY(fl_pp_optim_attach(&t->pp.rt, &t->opt));
    for (int c = 1; c < t->pp.chunks; c++) FL_TRY(fl_pp_chunk_optim(&t->pp.rt, c, &t->pp.xo[c]));
    return FL_OK;
}

/* ---- consolidated checkpoints ---- */

/* the optimizer's state arrays (AdamW's m, v; SGD's momentum) */
static void arrays(const fl_optimizer *o, void *arr[3]) { arr[0] = o->st.m, arr[1] = o->st.v, arr[2] = o->st.buf; }

/* ZeRO-1/2 on the data axis: a rank holds state for its chunk [off, off + len) of the stage's elements alone */
static int state_chunked(const fl_optimizer *o) { return o->shard.off != 0 || o->shard.len != o->w.n; }

fl_status fl_tr_state_whole(const fl_optimizer *o, fl_comm *axis, const void *arr, fl_dtype dt, void **full) {
    const size_t es = fl_dtype_size(dt), n = o->w.n, len = o->shard.len;
    char *h = malloc(n * es + 4), *c = state_chunked(o) ? malloc(len * es + 4) : NULL;
    fl_status s = h && (c || !state_chunked(o)) ? FL_OK : fl_errorf(FL_ERR_OOM, "checkpoint: out of host memory "
                                                                          "staging the optimizer state");
    if (s == FL_OK) s = fl_optim_state_read(o, c ? c : h, arr, (c ? len : n) * es);
    if (s == FL_OK && c) /* a copy of bits: BF16 travels as BF16 words */
        s = fl_comm_all_gather(axis, c, h, n, dt == FL_F32 ? FL_F32 : FL_BF16);
    free(c);
    if (s != FL_OK) free(h), h = NULL;
    *full = h;
    return s;
}

/* entry p of a state array (dt: the optimizer's memory arr, or the whole array staged in host memory) <-> fp32 host */
static fl_status arr_read(const fl_optimizer *o, const void *arr, const char *host, fl_dtype dt, const fl_param_info *p,
                          float *out) {
    const size_t es = fl_dtype_size(dt);
    if (host) memcpy(out, host + p->offset * es, p->numel * es);
    else FL_TRY(fl_optim_state_read(o, out, (const char *)arr + p->offset * es, p->numel * es));
    if (dt == FL_BF16) /* widened in place, from the end */
        for (size_t k = p->numel; k-- > 0;) out[k] = fl_bf16_to_f32(((const uint16_t *)out)[k]);
    return FL_OK;
}

static fl_status arr_write(const fl_optimizer *o, void *arr, char *host, fl_dtype dt, const fl_param_info *p, float *in) {
    const size_t es = fl_dtype_size(dt);
    if (dt == FL_BF16) fl_convert(in, FL_BF16, in, FL_F32, p->numel); /* narrowed in place, from the start */
    if (host) memcpy(host + p->offset * es, in, p->numel * es);
    return host ? FL_OK : fl_optim_state_write(o, (char *)arr + p->offset * es, in, p->numel * es);
}

/* one stage's entries (parameters, then each state array) into the whole model, in the order every stage sends them:
 * stage 0's own from its model (src), a later stage's received (src NULL) */
/* entry i of m as fp32: from pw (FULL_SHARD: the stage's parameters gathered over the data axis, the store's dtype)
 * or the model */
static void read_entry(const fl_model *m, const char *pw, int i, float *buf) {
    const fl_param_info *p = &m->layout.params[i];
    const fl_dtype pt = fl_model_store_dtype(m);
    if (pw) fl_convert(buf, FL_F32, pw + p->offset * fl_dtype_size(pt), pt, p->numel);
    else fl_model_read_param(m, i, buf);
}

/* s: the (virtual) stage, held by pipeline rank s % size (interleaved: its chunk s / size) */
static fl_status take_stage(trainer *t, tp_whole *w, int s, const int *first, const fl_model *src,
                            const fl_optimizer *so, char *const *full, float *buf, fl_dtype dt, const char *pw) {
    fl_model_config sc;
    fl_param_layout lay;
    FL_TRY(fl_pp_stage_config(&t->pp.whole, first[s], first[s + 1], &sc));
    FL_TRY(fl_layout_build(&lay, &sc));
    const int S = t->pp.size * (t->pp.chunks > 1 ? t->pp.chunks : 1);
    void *dst[3] = {NULL, NULL, NULL}, *sarr[3] = {NULL, NULL, NULL};
    if (w->o_ok) arrays(&w->o, dst);
    if (so) arrays(so, sarr);
    fl_status st = FL_OK;
    for (int a = -1; a < 3 && st == FL_OK; a++) {
        if (a >= 0 && !dst[a]) continue;
        for (int i = 0; i < lay.n && st == FL_OK; i++) {
            if (!fl_pp_config_owns(&sc, &lay, s > 0, s < S - 1, i)) continue;
            const int j = fl_pp_stage_entry(&w->m.layout, &lay, first[s], i);
            const fl_param_info *p = &w->m.layout.params[j];
            if (!src) st = fl_comm_recv(t->pp.grp, buf, p->numel, FL_F32, s % t->pp.size, TAG_CKPT);
            else if (a < 0) read_entry(src, pw, i, buf);
            else st = arr_read(so, sarr[a], full[a], dt, &src->layout.params[i], buf);
            if (st != FL_OK) break;
            if (a < 0) fl_model_write_param(&w->m, j, buf);
            else st = arr_write(&w->o, dst[a], NULL, dt, p, buf);
        }
    }
    fl_layout_free(&lay);
    return st;
}

/* a later stage (its model m): its entries to stage 0, in take_stage's order */
static fl_status give_stage(trainer *t, const fl_model *m, const fl_optimizer *o, char *const *full, float *buf,
                            fl_dtype dt, const char *pw) {
    void *arr[3] = {NULL, NULL, NULL};
    if (o) arrays(o, arr);
    for (int a = -1; a < 3; a++) {
        if (a >= 0 && !arr[a]) continue;
        for (int i = 0; i < m->layout.n; i++) {
            if (!fl_pp_stage_owns(m, i)) continue;
            const fl_param_info *p = &m->layout.params[i];
            if (a < 0) read_entry(m, pw, i, buf);
            else FL_TRY(arr_read(o, arr[a], full[a], dt, p, buf));
            FL_TRY(fl_comm_send(t->pp.grp, buf, p->numel, FL_F32, 0, TAG_CKPT));
        }
    }
    return FL_OK;
}

/* ---- LoRA on the stages: the adapters gathered into (and taken from) a LoRA-attached whole model ---- */

/* the whole model (the run's precision) with the run's adapters attached, and an optimizer over them when o */
static fl_status lora_whole(trainer *t, tp_whole *w, const fl_optimizer *o) {
    FL_TRY(whole_unsharded(t, w, NULL));
    FL_TRY(fl_model_set_precision(&w->m, &t->model.prec));
    fl_lora_config lc;
    FL_TRY(fl_trainer_lora_config(t->cfg, &w->m.cfg, &lc));
    if (!w->m.lora) FL_TRY(fl_model_lora_init(&w->m, &lc, t->cfg->seed)); /* TP x PP: fl_tr_whole_make attached them */
    if (!o) return FL_OK;
    FL_TRY(fl_optim_init(&w->o, &w->m, &o->cfg));
    w->o_ok = 1;
    return FL_OK;
}

/* module j's A and B: r (in + out) elements from off[2 j] of the adapters' buffers (and their state arrays) */
static fl_param_info mod_span(const fl_lora_adapters *ad, int j) {
    fl_param_info p;
    memset(&p, 0, sizeof p);
    p.offset = ad->off[2 * j];
    p.numel = (size_t)ad->cfg->r * (size_t)(ad->mods[j].in + ad->mods[j].out);
    return p;
}

/* stage s's modules (its blocks', the head's) and the whole model's index of its first; a module the stage trains:
 * its blocks' always, the head's on the last stage */
static fl_status stage_mods(const trainer *t, int s, const fl_lora_config *lc, fl_lora_module **mods, int *n, int *base) {
    fl_model_config sc;
    fl_param_layout lay;
    FL_TRY(fl_pp_stage_config(&t->pp.whole, t->pp.split[s], t->pp.split[s + 1], &sc));
    FL_TRY(fl_layout_build(&lay, &sc));
    fl_status st = fl_lora_modules(lc, &lay, &sc, mods, n);
    fl_layout_free(&lay);
    if (st == FL_OK) st = lora_base(&t->pp.whole, lc, t->pp.split[s], base);
    return st;
}
static int mod_whole(const fl_lora_module *md, int j, int base, int n_whole) { return md->layer >= 0 ? base + j : n_whole - 1; }
static int mod_trained(const fl_lora_module *md, int s, int S) { return md->layer >= 0 || s == S - 1; }

/* one array's elements of a module: a < 0 the adapters (the backend's memory), else state array a */
static fl_status mod_read(const fl_model *m, const fl_optimizer *o, const fl_lora_adapters *ad, int a, void *const *arr,
                          char *const *full, fl_dtype dt, int j, float *buf) {
    const fl_param_info p = mod_span(ad, j);
    if (a < 0) return FL_RUN(m->be, to_host, buf, ad->params + p.offset, p.numel * sizeof(float));
    return arr_read(o, arr[a], full ? full[a] : NULL, dt, &p, buf);
}
static fl_status mod_write(fl_model *m, fl_optimizer *o, const fl_lora_adapters *ad, int a, void *const *arr, char *host,
                           fl_dtype dt, int j, float *buf) {
    const fl_param_info p = mod_span(ad, j);
    if (a < 0) return FL_RUN(m->be, to_device, ad->params + p.offset, buf, p.numel * sizeof(float));
    return arr_write(o, arr[a], host, dt, &p, buf);
}

/* the LoRA gather: every later stage of the first pipeline sends each module it trains (the adapters, then each state
 * array), stage 0 puts them (and its own) at their whole-model modules (w NULL: a sender). Interleaved: the virtual
 * stages in order, rank v % S giving its chunk v / S (fullc[c]: chunk c's staged state; chunk 0's is full) */
/* (src: the stage's model whose adapters travel: the run's, or under TP x PP its group's assembled stage; xm, xo: the
 * later chunks', likewise) */
static fl_status lora_gather(trainer *t, const fl_model *src, const fl_model *const *xm, const fl_optimizer *const *xo,
                             tp_whole *w, const fl_optimizer *o, char *const *full, char *(*fullc)[3], float *buf,
                             fl_dtype dt) {
    const int S = t->pp.size, me = t->pp.stage, V = t->pp.chunks > 1 ? t->pp.chunks : 1, NV = S * V;
    fl_lora_adapters whole;
    void *dst[3] = {NULL, NULL, NULL}, *arr0[3] = {NULL, NULL, NULL};
    if (w && w->o_ok) arrays(&w->o, dst);
    if (o) arrays(o, arr0); /* every chunk's optimizer holds the same arrays */
    if (w) fl_model_lora_adapters(&w->m, &whole);
    fl_status st = FL_OK;
    for (int v = 0; v < NV && st == FL_OK; v++) {
        const int owner = v % S, c = v / S;
        if (me > 0 && owner != me) continue;
        /* the chunk's model, optimizer and staged state (its own, or the owner's shape for the sizes) */
        const fl_model *cm = c == 0 ? src : xm[c];
        const fl_optimizer *co = !o ? NULL : c == 0 ? o : xo[c];
        char *const *cf = c == 0 ? full : fullc[c];
        fl_lora_adapters mine;
        fl_model_lora_adapters(cm, &mine);
        void *arr[3] = {NULL, NULL, NULL};
        if (co) arrays(co, arr);
        fl_lora_module *mods = NULL;
        int n = 0, base = 0;
        st = stage_mods(t, v, mine.cfg, &mods, &n, &base);
        for (int a = -1; a < 3 && st == FL_OK; a++) {
            if (a >= 0 && !arr0[a]) continue;
            for (int j = 0; j < n && st == FL_OK; j++) {
                if (!mod_trained(&mods[j], v, NV)) continue;
                const size_t k = (size_t)mine.cfg->r * (size_t)(mods[j].in + mods[j].out);
                if (owner == me) st = mod_read(cm, co, &mine, a, arr, cf, dt, j, buf);
                else st = fl_comm_recv(t->pp.grp, buf, k, FL_F32, owner, TAG_CKPT);
                if (st == FL_OK && me > 0) st = fl_comm_send(t->pp.grp, buf, k, FL_F32, 0, TAG_CKPT);
                else if (st == FL_OK && (a < 0 || dst[a]))
                    st = mod_write(&w->m, &w->o, &whole, a, dst, NULL, dt, mod_whole(&mods[j], j, base, whole.n_mods), buf);
            }
        }
        free(mods);
    }
    return st;
}

/* ZeRO on the data axis: an optimizer's state arrays whole in host memory (every rank of the axis gives its chunk: the
 * same arrays in the same order on every rank); nothing (NULLs) when the state is whole already */
static fl_status chunk_state_whole(trainer *t, const fl_optimizer *o, fl_dtype dt, char *full[3]) {
    void *arr[3];
    arrays(o, arr);
    for (int a = 0; a < 3 && state_chunked(o); a++)
        if (arr[a]) FL_TRY(fl_tr_state_whole(o, t->pp.dpc, arr[a], dt, (void **)&full[a]));
    return FL_OK;
}
static void free_chunk_state(char *fullc[FL_PP_MAX_CHUNKS][3]) {
    for (int c = 0; c < FL_PP_MAX_CHUNKS; c++)
        for (int a = 0; a < 3; a++) free(fullc[c][a]);
}

/* FULL_SHARD on the data axis: a stage model's (a chunk's) parameters (*pw) and its optimizer's state arrays (full[a])
 * whole in host memory, gathered unit by unit over the axis (dp: the model's bookkeeping; collective on the axis) */
static fl_status fsdp_whole(fl_dp *dp, const fl_model *m, const fl_optimizer *o, fl_dtype dt, char **pw, char *full[3]) {
    size_t pb = 0;
    void *arr[3] = {NULL, NULL, NULL};
    if (o) arrays(o, arr);
    fl_status s = fl_fsdp_whole_params(dp, (void **)pw, &pb);
    for (int a = 0; a < 3 && o && s == FL_OK; a++) {
        if (!arr[a]) continue;
        full[a] = malloc(m->layout.numel * fl_dtype_size(dt) + 4);
        /* a failed allocation still takes part in the gathers (collective) */
        const fl_status g = fl_fsdp_whole_array(dp, arr[a], fl_dtype_size(dt), full[a]);
        s = !full[a] ? fl_errorf(FL_ERR_OOM, "pipeline checkpoint: out of host memory") : g;
    }
    return s;
}

fl_status fl_tr_pp_save_stage(trainer *t, int lead, const char *name, const fl_model *m, const fl_optimizer *o,
                              const fl_train_state *st) {
    return fl_tr_pp_save_stage_v(t, lead, name, m, o, NULL, NULL, st);
}

fl_status fl_tr_pp_save_stage_v(trainer *t, int lead, const char *name, const fl_model *m, const fl_optimizer *o,
                                const fl_model *const *xm, const fl_optimizer *const *xo, const fl_train_state *st) {
    const fl_model *cm[FL_PP_MAX_CHUNKS];      /* the later chunks' models and optimizers */
    const fl_optimizer *co[FL_PP_MAX_CHUNKS];
    for (int c = 1; c < t->pp.chunks; c++) cm[c] = xm ? xm[c] : &t->pp.xm[c], co[c] = xo ? xo[c] : &t->pp.xo[c];
    const fl_dtype dt = o && o->cfg.state_dtype == FL_BF16 ? FL_BF16 : FL_F32;
    char *full[3] = {NULL, NULL, NULL};
    void *arr[3] = {NULL, NULL, NULL};
    fl_status s = FL_OK;
    if (o) arrays(o, arr);
    /* ZeRO: every rank of the axis gives its chunks first (the same arrays in the same order on every rank) */
    if (o) s = chunk_state_whole(t, o, dt, full);
    /* interleaved under ZeRO: the later chunks' arrays too (fullc[c]: chunk c's) */
    char *fullc[FL_PP_MAX_CHUNKS][3];
    memset(fullc, 0, sizeof fullc);
    for (int c = 1; o && c < t->pp.chunks && s == FL_OK; c++)
        s = chunk_state_whole(t, co[c], dt, fullc[c]);
    /* FULL_SHARD on the data axis: the stage's parameters and state gathered unit by unit over the axis first */
    const int fsdp = t->dp.fsdp && m == &t->model;
    char *pw = NULL, *pwc[FL_PP_MAX_CHUNKS] = {NULL};
    if (fsdp && s == FL_OK) s = fsdp_whole(&t->dp, m, o, dt, &pw, full);
    /* interleaved: each later chunk's too (its own bookkeeping) */
    for (int c = 1; fsdp && c < t->pp.chunks && s == FL_OK; c++)
        s = fsdp_whole(&t->pp.xdp[c], cm[c], o ? co[c] : NULL, dt, &pwc[c], fullc[c]);
    /* LoRA: the adapters (and their state) of every stage; the final save (no optimizer) also the frozen base, which
     * stage 0 merges them into as one process does */
    fl_lora_adapters ad;
    const int lora = fl_model_lora_adapters(m, &ad);
    size_t most = lora ? ad.numel + 1 : 1;
    for (int c = 1; lora && c < t->pp.chunks; c++) { /* interleaved: the largest chunk's adapters */
        fl_lora_adapters ac;
        if (fl_model_lora_adapters(cm[c], &ac) && ac.numel + 1 > most) most = ac.numel + 1;
    }
    for (int i = 0; i < m->layout.n; i++)
        if (m->layout.params[i].numel > most) most = m->layout.params[i].numel;
    float *buf = t->dp.rank == 0 && s == FL_OK ? malloc(most * sizeof *buf) : NULL;
    if (t->dp.rank == 0 && s == FL_OK && !buf) s = fl_errorf(FL_ERR_OOM, "pipeline checkpoint: out of host memory");
    if (t->dp.rank == 0 && s == FL_OK && t->pp.stage > 0 && (!lora || !o)) s = give_stage(t, m, lora ? NULL : o, full, buf, dt, pw);
    /* interleaved: the later chunks' in virtual-stage order (LoRA: their frozen base, final/ only) */
    for (int c = 1; t->dp.rank == 0 && s == FL_OK && t->pp.stage > 0 && c < t->pp.chunks && (!lora || !o); c++)
        s = give_stage(t, cm[c], o && !lora ? co[c] : NULL, fullc[c], buf, dt, pwc[c]);
    if (t->dp.rank == 0 && s == FL_OK && t->pp.stage > 0 && lora) s = lora_gather(t, m, cm, co, NULL, o, full, fullc, buf, dt);
    if (t->dp.rank != 0 || s != FL_OK || t->pp.stage > 0) { /* the first pipeline gathers, its stage 0 writes */
        for (int a = 0; a < 3; a++) free(full[a]);
        free_chunk_state(fullc);
        free(buf);
        free(pw);
        for (int c = 0; c < FL_PP_MAX_CHUNKS; c++) free(pwc[c]);
        return s;
    }
    tp_whole w;
    memset(&w, 0, sizeof w);
    s = lora ? lora_whole(t, &w, o) : whole_unsharded(t, &w, o);
    const int V = t->pp.chunks > 1 ? t->pp.chunks : 1;
    for (int k = 0; s == FL_OK && k < t->pp.size * V && (!lora || !o); k++) {
        const int own = k % t->pp.size == 0, c = k / t->pp.size; /* stage 0's chunk c, or a later stage's */
        const fl_model *src = !own ? NULL : c == 0 ? m : cm[c];
        const fl_optimizer *so = !own || lora ? NULL : c == 0 ? o : o ? co[c] : NULL;
        s = take_stage(t, &w, k, t->pp.split, src, so, c == 0 ? full : fullc[c], buf, dt, c == 0 ? pw : pwc[c]);
    }
    if (s == FL_OK && lora) s = lora_gather(t, m, cm, co, &w, o, full, fullc, buf, dt);
    if (s == FL_OK && lora && !o) s = fl_model_lora_merge(&w.m); /* final/: the merged model and the adapter */
    free(buf);
    free(pw);
    for (int c = 0; c < FL_PP_MAX_CHUNKS; c++) free(pwc[c]);
    for (int a = 0; a < 3; a++) free(full[a]);
    free_chunk_state(fullc);
    if (s == FL_OK && o) {
        w.o.step = o->step;
        w.o.amp = o->amp;
    }
    if (s == FL_OK && lead)
        s = fl_ckpt_save(t->cfg->out_dir, name, &w.m, o ? &w.o : NULL, st, fl_tr_saved_cfg(t),
                         t->in.tok_dir[0] ? t->in.tok_dir : NULL);
    fl_tr_whole_free(&w);
    return s;
}

fl_status fl_tr_pp_save(trainer *t, int lead, const char *name, const fl_optimizer *o, const fl_train_state *st) {
    fl_status s = fl_tr_pp_save_stage(t, lead, name, &t->model, o, st);
    /* a failed gather or write fails every rank of the grid at once */
    fl_dp g;
    memset(&g, 0, sizeof g);
    fl_dp_init(&g, t->tp.world, NULL);
    return fl_dp_agree(&g, s);
}

/* LoRA: chunk c's modules (virtual stage c S + stage) and their state from the whole checkpoint's (w: a LoRA-attached
 * whole model and optimizer that read it) */
static fl_status lora_resume_chunk(trainer *t, tp_whole *w, int c) {
    fl_model *m = c == 0 ? &t->model : &t->pp.xm[c];
    fl_optimizer *o = c == 0 ? &t->opt : &t->pp.xo[c];
    fl_lora_adapters mine, whole;
    fl_model_lora_adapters(m, &mine);
    fl_lora_module *mods = NULL;
    int n = 0, base = 0;
    fl_status s = FL_OK;
    if (fl_model_lora_adapters(&w->m, &whole)) s = stage_mods(t, c * t->pp.size + t->pp.stage, mine.cfg, &mods, &n, &base);
    const fl_dtype dt = o->cfg.state_dtype == FL_BF16 ? FL_BF16 : FL_F32;
    const size_t es = fl_dtype_size(dt);
    char *h = state_chunked(o) ? malloc(o->w.n * es + 4) : NULL;
    float *buf = malloc((mine.numel + 1) * sizeof *buf);
    if (s == FL_OK && (!buf || (state_chunked(o) && !h))) s = fl_errorf(FL_ERR_OOM, "pipeline resume: out of host memory");
    void *src[3] = {NULL, NULL, NULL}, *dst[3];
    if (w->o_ok) arrays(&w->o, src);
    arrays(o, dst);
    for (int a = -1; a < 3 && s == FL_OK; a++) {
        if (a >= 0 && (!src[a] || !dst[a])) continue;
        for (int j = 0; j < n && s == FL_OK; j++) {
            s = mod_read(&w->m, &w->o, &whole, a, src, NULL, dt, mod_whole(&mods[j], j, base, whole.n_mods), buf);
            if (s == FL_OK) s = mod_write(m, o, &mine, a, dst, h, dt, j, buf);
        }
        if (s == FL_OK && a >= 0 && h) s = FL_RUN(o->home.be, to_device, dst[a], h + o->shard.off * es, o->shard.len * es);
    }
    free(mods), free(h), free(buf);
    if (s == FL_OK) {
        o->step = w->o.step;
        o->amp.ls = w->o.amp.ls;
    }
    return s;
}

/* LoRA: the whole checkpoint's adapters and their state (a LoRA-attached whole model reads it as one process does),
 * then this stage's modules, every chunk's under interleaved (the base is the run's checkpoint_dir, loaded already) */
static fl_status lora_resume(trainer *t, const char *path) {
    tp_whole w;
    memset(&w, 0, sizeof w);
    fl_status s = lora_whole(t, &w, &t->opt);
    if (s == FL_OK) s = fl_ckpt_load(path, &w.m, &w.o, &t->st);
    for (int c = 0; c < (t->pp.chunks > 1 ? t->pp.chunks : 1) && s == FL_OK; c++) s = lora_resume_chunk(t, &w, c);
    fl_tr_whole_free(&w);
    return s;
}

/* a stage model's (a chunk's) optimizer state from the whole checkpoint's (w), its entries from block `first` on:
 * ZeRO on the data axis: the stage's whole array in host memory, then this rank's chunk; FULL_SHARD (dp->fsdp, the
 * model's bookkeeping): the rank's piece of each unit */
static fl_status state_resume(const fl_dp *dp, tp_whole *w, const fl_model *m, fl_optimizer *o, int first, float *buf) {
    const fl_dtype dt = o->cfg.state_dtype == FL_BF16 ? FL_BF16 : FL_F32;
    const size_t es = fl_dtype_size(dt);
    void *src[3], *dst[3];
    arrays(&w->o, src);
    arrays(o, dst);
    size_t fo[1024], so[1024], ln[1024];
    const int G = dp->fsdp && m->layout.n_groups <= 1024 ? fl_fsdp_ranges(dp, fo, so, ln) : 0;
    const int staged = state_chunked(o) || G > 0;
    char *h = staged ? malloc((G ? m->layout.numel : o->w.n) * es + 4) : NULL;
    fl_status s = staged && !h ? fl_errorf(FL_ERR_OOM, "pipeline resume: out of host memory") : FL_OK;
    for (int a = 0; a < 3 && s == FL_OK; a++) {
        if (!src[a] || !dst[a]) continue;
        for (int i = 0; i < m->layout.n && s == FL_OK; i++) {
            const int j = fl_pp_stage_entry(&w->m.layout, &m->layout, first, i);
            s = arr_read(&w->o, src[a], NULL, dt, &w->m.layout.params[j], buf);
            if (s == FL_OK) s = arr_write(o, dst[a], h, dt, &m->layout.params[i], buf);
        }
        for (int g = 0; g < G && s == FL_OK; g++)
            s = FL_RUN(o->home.be, to_device, (char *)dst[a] + so[g] * es, h + fo[g] * es, ln[g] * es);
        if (s == FL_OK && h && !G) s = FL_RUN(o->home.be, to_device, dst[a], h + o->shard.off * es, o->shard.len * es);
    }
    free(h);
    return s;
}

/* interleaved: chunk c's parameters and optimizer state from the whole checkpoint */
static fl_status chunk_resume(trainer *t, tp_whole *w, int c, float *buf) {
    fl_model *m = &t->pp.xm[c];
    fl_optimizer *o = &t->pp.xo[c];
    const int first = t->pp.split[c * t->pp.size + t->pp.stage];
    FL_TRY(fl_pp_stage_take(&w->m, m, first)); /* FULL_SHARD: the rank's pieces */
    FL_TRY(state_resume(t->pp.xdp[c].fsdp ? &t->pp.xdp[c] : &t->dp, w, m, o, first, buf));
    o->step = w->o.step;
    o->amp.ls = w->o.amp.ls;
    fl_model_sync_compute_copy(m); /* mixed precision: the resumed master weights' copy */
    return FL_OK;
}

/* TP x PP with LoRA: this stage's modules of the whole checkpoint's adapters and their state (w, a LoRA-attached whole
 * model and optimizer) into sw (the stage's LoRA-attached model and optimizer, whole across the group) */
fl_status fl_tr_pp_lora_stage_state(trainer *t, tp_whole *w, tp_whole *sw, int v) {
    fl_lora_adapters mine, whole;
    if (!fl_model_lora_adapters(&sw->m, &mine) || !fl_model_lora_adapters(&w->m, &whole))
        return fl_errorf(FL_ERR_INTERNAL, "pipeline resume: the stage's or the checkpoint's adapters are missing");
    fl_lora_module *mods = NULL;
    int n = 0, base = 0;
    fl_status s = stage_mods(t, v, mine.cfg, &mods, &n, &base);
    const fl_dtype dt = sw->o.cfg.state_dtype == FL_BF16 ? FL_BF16 : FL_F32;
    float *buf = malloc((mine.numel + 1) * sizeof *buf);
    if (s == FL_OK && !buf) s = fl_errorf(FL_ERR_OOM, "pipeline resume: out of host memory");
    void *src[3] = {NULL, NULL, NULL}, *dst[3] = {NULL, NULL, NULL};
    if (w->o_ok) arrays(&w->o, src);
    if (sw->o_ok) arrays(&sw->o, dst);
    for (int a = -1; a < 3 && s == FL_OK; a++) {
        if (a >= 0 && (!src[a] || !dst[a])) continue;
        for (int j = 0; j < n && s == FL_OK; j++) {
            s = mod_read(&w->m, &w->o, &whole, a, src, NULL, dt, mod_whole(&mods[j], j, base, whole.n_mods), buf);
            if (s == FL_OK) s = mod_write(&sw->m, &sw->o, &mine, a, dst, NULL, dt, j, buf);
        }
    }
    free(mods), free(buf);
    sw->o.step = w->o.step;
    sw->o.amp.ls = w->o.amp.ls;
    return s;
}

uint64_t fl_tr_pp_lora_seed(const trainer *t) {
    fl_lora_config lc;
    int base = 0;
    if (t->pp.size > 1 && t->model.lora && fl_trainer_lora_config(t->cfg, &t->model.cfg, &lc) == FL_OK &&
        fl_tr_pp_lora_base(t, &lc, &base) == FL_OK)
        return t->cfg->seed + (uint64_t)base * 0x9e3779b97f4a7c15ULL; /* fl_model_lora_init_at's seed of module base */
    return t->cfg->seed;
}

fl_status fl_tr_pp_ckpt_load(trainer *t, const char *path) {
    if (t->model.lora) return lora_resume(t, path);
    tp_whole w;
    memset(&w, 0, sizeof w);
    fl_status s = whole_unsharded(t, &w, &t->opt);
    if (s == FL_OK) s = fl_ckpt_load(path, &w.m, &w.o, &t->st);
    if (s == FL_OK) s = fl_pp_stage_take(&w.m, &t->model, t->pp.first); /* FULL_SHARD: the rank's pieces */
    size_t most = 1;
    for (int i = 0; i < w.m.layout.n; i++)
        if (w.m.layout.params[i].numel > most) most = w.m.layout.params[i].numel;
    float *buf = malloc(most * sizeof *buf);
    if (s == FL_OK && !buf) s = fl_errorf(FL_ERR_OOM, "pipeline resume: out of host memory");
    if (s == FL_OK) s = state_resume(&t->dp, &w, &t->model, &t->opt, t->pp.first, buf);
    for (int c = 1; c < t->pp.chunks && s == FL_OK; c++) s = chunk_resume(t, &w, c, buf);
    free(buf);
    if (s == FL_OK) {
        t->opt.step = w.o.step;
        t->opt.amp.ls = w.o.amp.ls;
    }
    fl_tr_whole_free(&w);
    return s;
}

void fl_tr_pp_print(const trainer *t) {
    if (t->pp.size <= 1 || !t->out) return;
    fprintf(t->out, "pipeline parallel (EXPERIMENTAL): %d stages x %d pipeline%s, schedule %s, %d micro-batches per "
            "step; stage 0 holds blocks [%d, %d) of %d and the embeddings, the last stage the final norm, lm_head and "
            "loss; activations and their gradients between neighbouring stages; stage 0 writes consolidated "
            "checkpoints; no sample generation\n",
            t->pp.size, t->dp.world, t->dp.world == 1 ? "" : "s", t->cfg->pipeline_schedule, t->sch.accum, t->pp.first,
            t->pp.last, fl_pp_model_blocks(&t->pp.whole));
    if (t->pp.chunks <= 1) return;
    fprintf(t->out, "interleaved (EXPERIMENTAL): %d model chunks per rank, chunk c of stage s is virtual stage c x %d + "
            "s; virtual stages' blocks:", t->pp.chunks, t->pp.size);
    for (int v = 0; v < t->pp.size * t->pp.chunks; v++) fprintf(t->out, " [%d, %d)", t->pp.split[v], t->pp.split[v + 1]);
    fprintf(t->out, "\n");
}

/* --offload_update_overlap on the stages: per stage, its units' updates (every chunk's) queued on the fetch worker
 * and those already done when the step's wait began (they ran beside the rest of the schedule), gathered over the
 * pipeline (collective); printed where any ran */
static fl_status update_overlap_report(trainer *t) {
    const int S = t->pp.size;
    unsigned long e = 0, q = 0, d = 0;
    fl_fsdp_update_counts(&t->dp, &e, &q, &d);
    for (int c = 1; c < t->pp.chunks; c++) fl_fsdp_update_counts(&t->pp.xdp[c], &e, &q, &d);
    float mine[3] = {(float)d, (float)e, (float)q}, all[3 * 64];
    if (S > 64) return FL_OK;
    FL_TRY(fl_error_prefix(fl_comm_all_gather(t->pp.rt.comm, mine, all, (size_t)3 * S, FL_F32), "pipeline: the update "
                           "overlap's counts"));
    double any = 0;
    for (int k = 0; k < S; k++) any += all[3 * k + 2];
    if (!t->out || any == 0) return FL_OK;
    fprintf(t->out, "update overlap: units' updates on the fetch worker (--offload_update_overlap), done when the "
            "stage's schedule ended / done when the step's wait began / queued, per stage:");
    for (int k = 0; k < S; k++) fprintf(t->out, " %.0f / %.0f / %.0f", all[3 * k], all[3 * k + 1], all[3 * k + 2]);
    fprintf(t->out, "\n");
    return FL_OK;
}

/* The end of a run: the stages' measured compute per micro-batch, the schedule simulated on those times (the step
 * the pipeline could take with free sends, and its bubble) beside the measured step, and a block's time (a stage's
 * compute over its cost in blocks, the slowest stage's) that `plan --block-ms` turns into an expected step time.
 * The measured bubble: 1 - M sum_v (f_v + b_v) / (S x the measured step), the fraction of the ranks' step time not
 * spent computing (the sends, waits, broadcast and update included), beside the simulator's on the measured times
 * and the equal-stage figure (S - 1) / (M V + S - 1). Interleaved: per virtual stage. */
fl_status fl_tr_pp_report(trainer *t) {
    if (t->pp.size <= 1 || !t->pp.rt_ok) return FL_OK;
    const int S = t->pp.size, V = t->pp.rt.chunks, NV = S * V, M = t->sch.accum;
    double fwd[64], bwd[64], step = 0, span = 0, bubble = 0;
    FL_TRY(fl_pp_timing(&t->pp.rt, fwd, bwd, &step));
    FL_TRY(update_overlap_report(t));
    if (!t->out || t->pp.rt.n_steps == 0) return FL_OK;
    FL_TRY(fl_pp_simulate_v(t->pp.rt.kind, S, V, M, fwd, bwd, &span, &bubble));
    fl_pp_estimate e;
    const int T = t->cfg->train.max_seq_length > 0 ? t->cfg->train.max_seq_length : t->pp.whole.max_seq;
    FL_TRY(fl_pp_estimate_step_v(&t->pp.whole, T, S, V, M, t->pp.rt.kind, &e));
    double block = 0, busy = 0;
    for (int v = 0; v < NV; v++) {
        const double b = (fwd[v] + bwd[v]) / (e.fwd[v] + e.bwd[v]);
        if (b > block) block = b;
        busy += M * (fwd[v] + bwd[v]);
    }
    fprintf(t->out, "pipeline timing (EXPERIMENTAL): forward + backward of a micro-batch per %sstage (ms):",
            V > 1 ? "virtual " : "");
    for (int v = 0; v < NV; v++) fprintf(t->out, " %.3f + %.3f", fwd[v], bwd[v]);
    fprintf(t->out, "; the %s schedule on these times: %.3f ms per step, bubble %.1f%%; measured %.3f ms per step "
            "(with the sends, waits, the losses' broadcast and the update); a block's forward + backward %.3f ms "
            "(plan --block-ms)\n", t->cfg->pipeline_schedule, span, 100 * bubble, step, block);
    fprintf(t->out, "pipeline bubble (EXPERIMENTAL): measured %.1f%% (1 - the ranks' compute over %d x the measured "
            "step), simulated on the measured times %.1f%%, equal stages (S-1)/(M V+S-1) = %.1f%% (S %d, M %d, V %d)\n",
            step > 0 ? 100 * (1 - busy / (S * step)) : 0.0, S, 100 * bubble, 100.0 * (S - 1) / (M * V + S - 1), S, M, V);
    return FL_OK;
}

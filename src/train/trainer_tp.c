/* The trainer's tensor parallelism (--tensor_parallel N; src/train/trainer-impl.h, docs/ARCHITECTURE.md
 * "Tensor parallelism"): the grid, the slice of the model, the optimizer's hooks, consolidated checkpoints.
 *
 * The grid. World rank w is rank w % N of tensor-parallel group w / N, and rank w / N of data-parallel
 * axis w % N: the N ranks of a group train the same micro-batches (the data is split over the groups,
 * as DDP splits it over ranks), so the trainer's data-parallel context (t->dp) is the axis and every
 * loop, loss and log works unchanged over it. Set-up agreements run over the whole grid (fl_dp.grid), so a
 * rank that fails anywhere stops every rank. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer-impl.h"
#include "fitllm/checkpoint.h"
#include "fitllm/lora.h"

static fl_status tp_check(const fl_run_config *c, int n, int dp_world, const fl_strategy_choice *sc);
static fl_status lora_check(const trainer *t, int n_tp, const fl_model_config *whole);

/* The 3D grid DP x TP x PP (--tensor_parallel N with --pipeline_parallel S): world rank w is rank w % N of the
 * tensor-parallel group of stage (w / N) % S of pipeline w / (N S), its tensor-parallel rank's pipeline being the
 * ranks of that rank across the stages, and rank w / (N S) of the data-parallel axis (the ranks of one stage and
 * tensor-parallel rank across the pipelines). A tensor-parallel group is N consecutive ranks (Megatron's order:
 * the busiest collectives within a node). Every rank holds its slice (fl_tp_config) of its stage's blocks
 * (fl_pp_stage_config); the stream between stages travels from each tensor-parallel rank to the same rank of the
 * next stage (the stream is replicated over a group). The data-parallel axis is t->tp.dpc here (t->pp.dpc NULL). */
static fl_status tpp_begin(trainer *t, fl_comm *world, const fl_model_config *given, fl_comm **dp_comm) {
    const int n = t->cfg->tensor_parallel, S = t->cfg->pipeline_parallel;
    const int W = world ? fl_comm_size(world) : 1, w = world ? fl_comm_rank(world) : 0;
    if (W % (n * S))
        return fl_errorf(FL_ERR_INVALID, "--tensor_parallel %d with --pipeline_parallel %d: this run has %d rank%s, not "
                         "a multiple of %d (launch data-parallel groups x %d ranks: --devices %d, %d, ...)", n, S, W,
                         W == 1 ? "" : "s", n * S, n * S, n * S, 2 * n * S);
    fl_pp_schedule k;
    FL_TRY(fl_error_prefix(fl_pp_schedule_parse_all(t->cfg->pipeline_schedule, &k), "--pipeline_schedule"));
    t->pp.chunks = k == FL_PP_INTERLEAVED ? t->cfg->pipeline_chunks : 1; /* interleaved: each chunk a slice */
    fl_strategy_choice sc;
    FL_TRY(fl_cfg_resolve_strategy(t->cfg, 0, &sc));
    FL_TRY(fl_tr_pp_check(t, &sc)); /* (what interleaved does not run with TP refused there) */
    FL_TRY(tp_check(t->cfg, n, W / (n * S), &sc));
    fl_model_config pc;
    if (given) FL_TRY(fl_tp_config(given, n, 0, &pc)); /* the planner's shape */
    const int r = w % n, st = (w / n) % S, d = w / (n * S);
    FL_TRY(fl_error_prefix(fl_comm_split(world, w / n, w, &t->tp.grp), "--tensor_parallel %d: the group", n));
    FL_TRY(fl_error_prefix(fl_comm_split(world, d * n + r, w, &t->pp.grp), "--pipeline_parallel %d: the pipeline", S));
    FL_TRY(fl_error_prefix(fl_comm_split(world, w % (n * S), w, &t->tp.dpc), "--tensor_parallel %d with "
                           "--pipeline_parallel %d: the data-parallel axis", n, S));
    t->tp.size = n, t->tp.rank = r;
    t->pp.size = S, t->pp.stage = st;
    t->tp.world = world;
    fl_dp_init(&t->dp, t->tp.dpc, NULL);
    t->dp.grid = world;
    *dp_comm = t->tp.dpc;
    return FL_OK;
}

fl_status fl_tr_tp_begin(trainer *t, fl_comm *world, const fl_model_config *given, fl_comm **dp_comm) {
    const int n = t->cfg->tensor_parallel > 1 ? t->cfg->tensor_parallel : 1;
    *dp_comm = world;
    t->tp.size = 1;
    t->pp.size = 1;
    if (t->cfg->sequence_parallel && n <= 1) /* every rank alike, before any collective */
        return fl_errorf(FL_ERR_INVALID, "--sequence_parallel splits the rows of a tensor-parallel group: give "
                         "--tensor_parallel N (N > 1) with it");
    if (t->cfg->pipeline_parallel > 1 && n > 1) return tpp_begin(t, world, given, dp_comm); /* the 3D grid */
    if (t->cfg->pipeline_parallel > 1) return fl_tr_pp_begin(t, world, given, dp_comm); /* trainer_pp.c */
    if (n == 1) return FL_OK;
    const int W = world ? fl_comm_size(world) : 1, w = world ? fl_comm_rank(world) : 0;
    if (W % n)
        return fl_errorf(FL_ERR_INVALID, "--tensor_parallel %d: this run has %d rank%s, not a multiple of it (launch "
                         "data-parallel groups x %d ranks: --devices %d, %d, ...)", n, W, W == 1 ? "" : "s", n, n, 2 * n);
    /* what every rank refuses alike, before any collective: each returns its own error (with threads, one
     * that failed later would otherwise see a peer's release) */
    fl_strategy_choice sc;
    FL_TRY(fl_cfg_resolve_strategy(t->cfg, 0, &sc));
    FL_TRY(tp_check(t->cfg, n, W / n, &sc));
    fl_model_config pc;
    if (given) FL_TRY(fl_tp_config(given, n, 0, &pc)); /* the planner's shape */
    if (given) FL_TRY(lora_check(t, n, given));        /* (a run checks at its load) */
    FL_TRY(fl_error_prefix(fl_comm_split(world, w / n, w, &t->tp.grp), "--tensor_parallel %d: the group", n));
    FL_TRY(fl_error_prefix(fl_comm_split(world, w % n, w, &t->tp.dpc), "--tensor_parallel %d: the data-parallel axis", n));
    t->tp.size = n;
    t->tp.rank = w % n;
    t->tp.world = world;
    fl_dp_init(&t->dp, t->tp.dpc, NULL);
    t->dp.grid = world;
    *dp_comm = t->tp.dpc;
    return FL_OK;
}

int fl_tr_tp_lead(const trainer *t) {
    return t->tp.world ? fl_comm_rank(t->tp.world) == 0 : t->dp.rank == 0;
}

void fl_tr_tp_end(trainer *t) {
    fl_tr_pp_end(t);
    fl_comm_destroy(t->tp.dgrp); /* split over grp: first */
    fl_comm_destroy(t->tp.grp);
    fl_comm_destroy(t->tp.dpc);
    t->tp.dgrp = t->tp.grp = t->tp.dpc = NULL;
}

fl_status fl_tr_tp_check(const trainer *t, const fl_strategy_choice *sc) {
    if (t->pp.size > 1) FL_TRY(fl_tr_pp_check(t, sc));
    if (t->pp.size > 1 && t->tp.size <= 1) return FL_OK;
    return t->tp.size <= 1 ? FL_OK : tp_check(t->cfg, t->tp.size, t->dp.world, sc);
}

static fl_status tp_check(const fl_run_config *c, int n, int dp_world, const fl_strategy_choice *sc) {
    if (c->command == FL_CMD_FINETUNE_LORA && dp_world > 1 && sc->stage > 0)
        return fl_errorf(FL_ERR_UNSUPPORTED, "--tensor_parallel %d with finetune_lora and --strategy %s: the adapters' "
                         "data-parallel axis runs DDP so far (give --strategy ddp)", n, c->strategy);
    if (c->optimizer.kind == FL_OPT_ADAMW8BIT)
        return fl_errorf(FL_ERR_UNSUPPORTED, "--tensor_parallel %d: AdamW8bit's block-wise state is not split yet "
                         "(AdamW and SGD are)", n);
    if (!strcmp(c->state_dict_type, "sharded"))
        return fl_errorf(FL_ERR_UNSUPPORTED, "--tensor_parallel %d: fsdp.state_dict_type sharded is not written yet "
                         "(full: consolidated, resumable at any tensor-parallel size)", n);
    return FL_OK;
}

void fl_tr_whole_free(tp_whole *w) {
    if (w->o_ok) fl_optim_free(&w->o);
    if (w->m_ok) fl_model_free(&w->m);
    if (w->pool_ok) fl_backend_pools_free(&w->pool, &w->hpool);
    memset(w, 0, sizeof *w);
}

static fl_status whole_pools(trainer *t, tp_whole *w) {
    memset(w, 0, sizeof *w);
    FL_TRY(fl_backend_pools_init(&t->hw.be, &w->pool, &w->hpool, "tensor parallel (whole model)", 0));
    w->pool_ok = 1;
    return FL_OK;
}

/* q4: keep the run's 4-bit storage (TP x PP's stage of the loaded whole: slices that cut a block take its blocks) */
static fl_status whole_make(trainer *t, tp_whole *w, const fl_model_config *cfg, const fl_optimizer *o, int q4) {
    FL_TRY(whole_pools(t, w));
    const fl_model_storage keep = t->stg;
    t->stg.shard = NULL; /* whole models are never sharded (FULL_SHARD on the data axis shards the slice alone) */
    if (!q4) t->stg.quant4 = 0; /* nor quantized (QLoRA: the staging holds the dequantized base; the load's is 4-bit) */
    const fl_status s = fl_model_init_ex(&w->m, cfg, &t->hw.be, &w->pool, &t->stg);
    t->stg = keep;
    FL_TRY(s);
    w->m_ok = 1;
    if (t->model.lora && t->tp.size > 1) { /* tensor parallel LoRA: the whole model carries the same adapters (their
                                            * values: gathered or loaded; the pipeline's lora_whole attaches its own) */
        fl_lora_config lc;
        FL_TRY(fl_trainer_lora_config(t->cfg, cfg, &lc));
        FL_TRY(fl_model_lora_init(&w->m, &lc, t->cfg->seed));
    }
    if (!o) return FL_OK;
    FL_TRY(fl_model_set_precision(&w->m, &t->model.prec)); /* the state's dtype and loss scaling follow it */
    FL_TRY(fl_optim_init(&w->o, &w->m, &o->cfg));
    w->o_ok = 1;
    return FL_OK;
}

fl_status fl_tr_whole_make(trainer *t, tp_whole *w, const fl_model_config *cfg, const fl_optimizer *o) {
    return whole_make(t, w, cfg, o, 0);
}

static void whole_free(tp_whole *w) { fl_tr_whole_free(w); }

static fl_status attach_group(trainer *t);

/* TP x PP: the stage's blocks of the whole config (t->pp's range and whole; *out: what the group slices) */
static fl_status tpp_stage_config(trainer *t, const fl_model_config *whole, fl_model_config *out) {
    FL_TRY(fl_tr_pp_stage_range(t, whole));
    t->pp.whole = *whole;
    return fl_pp_stage_config(whole, t->pp.first, t->pp.last, out);
}

/* TP x PP: the stage's blocks of the whole model w taken into a model of their own (sw, outside the pool) */
static fl_status tpp_stage_model(trainer *t, const tp_whole *w, tp_whole *sw) {
    fl_model_config sc;
    FL_TRY(tpp_stage_config(t, &w->m.cfg, &sc));
    t->pp.whole_numel = w->m.layout.numel;
    FL_TRY(whole_make(t, sw, &sc, NULL, 1)); /* (QLoRA: the loaded 4-bit blocks, taken as they are) */
    return fl_pp_stage_take(&w->m, &sw->m, t->pp.first);
}

/* LoRA on the slices: what is not split yet, refused on every rank alike from the whole config (the same modules on
 * every rank), before the group's first collective (the device communicator: attach_group) */
static fl_status lora_check(const trainer *t, int n_tp, const fl_model_config *whole) {
    (void)n_tp; /* (every part runs: lm_head's, and QLoRA's parts that cut a 4-bit block keep the whole blocks) */
    if (t->cfg->command != FL_CMD_FINETUNE_LORA) return FL_OK;
    fl_lora_config lc;
    fl_param_layout lay;
    fl_lora_module *mods = NULL;
    int n = 0;
    FL_TRY(fl_trainer_lora_config(t->cfg, whole, &lc));
    FL_TRY(fl_layout_build(&lay, whole));
    fl_status s = fl_lora_modules(&lc, &lay, whole, &mods, &n);
    free(mods);
    fl_layout_free(&lay);
    return s;
}

/* The slice's storage: the run's, but a 4-bit weight's absmax kept as fp32 (QLoRA): the slice holds whole blocks of one
 * process's quantization (lora_check), re-quantized from their dequantized values, which gives the same codes and, as
 * absmax, the whole's dequantized one; double quantization's 8-bit absmax would be re-quantized over another set of
 * blocks (its mean and 256-groups are the whole tensor's) and move. So the slice's 4-bit weights cost 4.5 bits per
 * parameter instead of nf4-dq's 4.127 (the plan's figure is this layout's). */
static fl_model_storage slice_storage(const trainer *t) {
    fl_model_storage ss = t->stg;
    ss.q4_double_quant = 0;
    return ss;
}

/* TP x PP interleaved: virtual stage v's blocks of the whole config (what the group slices into chunk v / S) */
static fl_status chunk_config(const trainer *t, const fl_model_config *whole, int v, fl_model_config *out) {
    return fl_pp_stage_config(whole, t->pp.split[v], t->pp.split[v + 1], out);
}

/* TP x PP interleaved: chunk c (virtual stage c S + stage) made in the run's pool as this rank's slice of its blocks,
 * taken from the whole model w (NULL: the planner's, random) */
static fl_status chunk_slice(trainer *t, const fl_model_config *whole, const tp_whole *w, int c) {
    const int v = c * t->pp.size + t->pp.stage;
    fl_model_config vc, pc;
    tp_whole sw;
    memset(&sw, 0, sizeof sw);
    FL_TRY(chunk_config(t, whole, v, &vc));
    FL_TRY(fl_tp_config(&vc, t->tp.size, t->tp.rank, &pc));
    fl_status s = FL_OK;
    if (w) { /* the virtual stage's blocks of the whole model (QLoRA: its 4-bit blocks as they are), then the slice */
        s = whole_make(t, &sw, &vc, NULL, 1);
        if (s == FL_OK) s = fl_pp_stage_take(&w->m, &sw.m, t->pp.split[v]);
    }
    fl_model_storage ss = slice_storage(t);
    if (ss.shard) { /* FULL_SHARD on the data axis: the chunk's units sharded by a bookkeeping of its own (a copy of the
                     * axis' fl_dp, its communicators shared), as trainer_pp.c's chunks */
        t->pp.xdp[c] = t->dp;
        t->pp.xdp[c].fsdp = NULL;
        ss.shard_ud = &t->pp.xdp[c];
    }
    if (s == FL_OK) s = fl_model_init_ex(&t->pp.xm[c], &pc, &t->hw.be, &t->hw.pool, &ss);
    if (s == FL_OK) t->pp.xm_ok = c;
    if (s == FL_OK) s = w ? fl_tp_scatter(&sw.m, &t->pp.xm[c]) : fl_model_init_random_ex(&t->pp.xm[c], t->cfg->seed);
    whole_free(&sw);
    return fl_error_prefix(s, "--pipeline_schedule interleaved: chunk %d (virtual stage %d)", c, v);
}

fl_status fl_tr_tp_load(trainer *t, const fl_model_config *given) {
    tp_whole w, sw;
    fl_status s;
    if (fl_backend_discards(&t->hw.be)) { /* the planner's rehearsal: the slice of the given shape, no whole copy */
        fl_model_config pc, sc = *given;
        FL_TRY(lora_check(t, t->tp.size, given));
        if (t->pp.size > 1) FL_TRY(tpp_stage_config(t, given, &sc)); /* TP x PP: the slice of its stage */
        FL_TRY(fl_tp_config(&sc, t->tp.size, t->tp.rank, &pc));
        t->tp.whole = sc;
        const fl_model_storage ss = slice_storage(t);
        FL_TRY(fl_model_init_ex(&t->model, &pc, &t->hw.be, &t->hw.pool, &ss));
        t->model_ok = 1;
        FL_TRY(fl_model_init_random_ex(&t->model, t->cfg->seed));
        for (int c = 1; c < t->pp.chunks; c++) FL_TRY(chunk_slice(t, given, NULL, c)); /* interleaved: the slices */
        return attach_group(t);
    }
    memset(&sw, 0, sizeof sw);
    s = whole_pools(t, &w);
    const fl_model_storage keep = t->stg; /* the whole model unsharded (FULL_SHARD on the data axis: the slice is) */
    t->stg.shard = NULL;
    if (s == FL_OK) s = fl_tr_load_model(t, given, &w.m, &w.pool, &w.m_ok);
    t->stg = keep;
    if (s == FL_OK) t->tp.whole_numel = w.m.layout.numel;
    if (s == FL_OK) s = lora_check(t, t->tp.size, &w.m.cfg);
    if (s == FL_OK && t->pp.size > 1) s = tpp_stage_model(t, &w, &sw); /* TP x PP: the group slices its stage */
    const tp_whole *src = t->pp.size > 1 ? &sw : &w;
    fl_model_config pc;
    if (s == FL_OK) s = fl_tp_config(&src->m.cfg, t->tp.size, t->tp.rank, &pc);
    if (s == FL_OK) {
        t->tp.whole = src->m.cfg;
        const fl_model_storage ss = slice_storage(t);
        s = fl_model_init_ex(&t->model, &pc, &t->hw.be, &t->hw.pool, &ss);
    }
    if (s == FL_OK) {
        t->model_ok = 1;
        s = fl_tp_scatter(&src->m, &t->model);
    }
    whole_free(&sw);
    for (int c = 1; c < t->pp.chunks && s == FL_OK; c++) s = chunk_slice(t, &w.m.cfg, &w, c); /* interleaved */
    whole_free(&w);
    if (s != FL_OK) return s;
    return attach_group(t);
}

static fl_status attach_group(trainer *t) {
    /* the blocks' sums run on the backend's memory: its device communicator over the group where it has one */
    if (t->hw.be.comm_create)
        FL_TRY(fl_error_prefix(t->hw.be.comm_create(&t->hw.be, t->tp.grp, &t->tp.dgrp), "--tensor_parallel %d: the %s "
                               "backend's communicator", t->tp.size, t->hw.be.name));
    else if (!fl_backend_host_memory(&t->hw.be))
        return fl_errorf(FL_ERR_UNSUPPORTED, "--tensor_parallel %d on backend '%s' (whose memory the host cannot read) "
                         "needs a device-memory communicator, which it does not have", t->tp.size, t->hw.be.name);
    for (int c = 0; c < (t->pp.chunks > 1 ? t->pp.chunks : 1); c++) { /* interleaved: every chunk's slice */
        fl_model *m = c == 0 ? &t->model : &t->pp.xm[c];
        FL_TRY(fl_model_set_tp(m, t->tp.dgrp ? t->tp.dgrp : t->tp.grp));
        if (t->cfg->sequence_parallel) FL_TRY(fl_model_set_sp(m, 1)); /* before the arena: its rows are 1/N */
        FL_TRY(fl_model_set_tp_host(m, t->tp.grp)); /* the vocabulary slices' cross-entropy statistics */
    }
    return FL_OK;
}

fl_status fl_tr_tp_attach(trainer *t) {
    t->model.stage.first = t->pp.size > 1 ? t->pp.first : 0; /* OPT's dropout: a stage seeds the whole's blocks */
    if (t->pp.size > 1 && t->tp.size <= 1) return fl_tr_pp_attach(t);
    if (t->tp.size <= 1) return FL_OK;
    if (t->pp.size > 1) { /* TP x PP: the pipelined step over the stages of this tensor-parallel rank */
        fl_pp_schedule k;
        const fl_optim_dist *axis = t->opt.shard.dist;
        FL_TRY(fl_pp_schedule_parse_all(t->cfg->pipeline_schedule, &k));
        if (k == FL_PP_INTERLEAVED) FL_TRY(fl_tr_pp_attach(t)); /* each chunk's set-up, the step over every chunk */
        else FL_TRY(fl_pp_init(&t->pp.rt, &t->model, t->pp.grp, k));
        t->pp.rt_ok = 1;
        t->pp.rt.inner = axis; /* ZeRO-2's tied table is made whole over the axis (pp_step.c) */
        t->pp.rt.adapters = t->model.lora != NULL; /* LoRA: the optimizer trains the adapters (no tied table's sum) */
        t->pp.rt.tp_comm = t->tp.grp;              /* interleaved's fp16 verdict over the group too */
    }
    FL_TRY(fl_tp_optim_attach(&t->opt, t->tp.grp, &t->tp.dist));
    /* TP x PP: the norm counts the entries the stage trains; the sums and verdicts run over the stages too */
    t->tp.dist.pipe = t->pp.size > 1 ? t->pp.grp : NULL;
    if (t->pp.chunks > 1) { /* interleaved: every chunk's optimizer over the group, one norm and verdict for them all */
        t->pp.rt.ch[0].o = &t->opt;
        t->tp.dist.pp = &t->pp.rt;
        for (int c = 1; c < t->pp.chunks; c++) {
            fl_tp_dist *d = &t->tp.xdist[c];
            t->pp.rt.ch[c].inner = t->pp.xo[c].shard.dist;
            FL_TRY(fl_error_prefix(fl_tp_optim_attach(&t->pp.xo[c], t->tp.grp, d), "chunk %d", c));
            d->pipe = t->pp.grp;
            d->pp = &t->pp.rt;
            t->pp.rt.ch[c].o = &t->pp.xo[c];
        }
    }
    return fl_tp_lora_init(&t->model, fl_tr_pp_lora_seed(t)); /* LoRA: the slices of the whole's initial adapters
                                                                * (TP x PP: numbered from the stage's first module;
                                                                * the later chunks': chunk_setup) */
}

/* the optimizer's state arrays (AdamW's m, v; SGD's momentum) */
static int state_arrays(const fl_optimizer *o, void *arr[3]) {
    arr[0] = o->st.m, arr[1] = o->st.v, arr[2] = o->st.buf;
    return 3;
}

/* ZeRO-1/2 on the data axis: a rank holds state for its chunk [off, off + len) of the slice's elements alone */
static int state_chunked(const fl_optimizer *o) { return o->shard.off != 0 || o->shard.len != o->w.n; }

/* The slice's whole state array arr of o into host memory *full (fl_tr_state_whole over the data axis) */
static fl_status state_whole(trainer *t, const fl_optimizer *o, const void *arr, fl_dtype dt, void **full) {
    return fl_error_prefix(fl_tr_state_whole(o, t->tp.dpc, arr, dt, full), "tensor parallel");
}

/* tp_assemble's LoRA part (s: rank 0's staging, g: the base's gather): the adapters, then each state array (F32 at
 * the adapters' offsets) gathered into the whole model's (its LoRA) and optimizer */
static fl_status tp_assemble_lora(trainer *t, fl_model *m, const fl_optimizer *o, tp_whole *w, fl_status s,
                                  fl_status g) {
    fl_lora_adapters pa, wa;
    fl_model_lora_adapters(m, &pa);
    const fl_model *wm = s == FL_OK && t->tp.rank == 0 ? &w->m : NULL;
    if (wm) fl_model_lora_adapters(wm, &wa);
    if (g == FL_OK)
        g = fl_tp_lora_gather(m, t->tp.grp, m->be, pa.params, wm, wm ? wm->be : NULL, wm ? wa.params : NULL);
    void *src[3] = {NULL, NULL, NULL}, *dst[3] = {NULL, NULL, NULL};
    if (o) state_arrays(o, src);
    if (o && wm) state_arrays(&w->o, dst);
    for (int a = 0; a < 3 && g == FL_OK; a++)
        if (src[a])
            g = fl_tp_lora_gather(m, t->tp.grp, o->home.be, src[a], wm, wm ? w->o.home.be : NULL, dst[a]);
    if (s == FL_OK) s = g;
    if (s == FL_OK && wm && o) {
        w->o.step = o->step;
        w->o.amp = o->amp;
    }
    return s;
}

/* The slices' parameters and state arrays (full[a]: the slice's whole array a in host memory under ZeRO, else NULL)
 * assembled into a model and optimizer of cfg on the group's rank 0 (w; collective over the group): the whole model,
 * or (TP x PP) the stage's. A failed staging on rank 0 still runs the group's gathers (their sums are dropped). */
/* pw: FULL_SHARD on the data axis, the slice's parameters gathered from the axis' pieces (host memory, the store's
 * dtype), else NULL (read from the model) */
/* (m: the slice, t->model; TP x PP interleaved: a later chunk's, cfg its virtual stage's) */
static fl_status tp_assemble(trainer *t, fl_model *m, const fl_model_config *cfg, const fl_optimizer *o,
                             void *const *full, const void *pw, tp_whole *w) {
    const fl_dtype dt = o && o->cfg.state_dtype == FL_BF16 ? FL_BF16 : FL_F32;
    void *src[3] = {NULL, NULL, NULL}, *dst[3] = {NULL, NULL, NULL};
    memset(w, 0, sizeof *w);
    fl_status s = t->tp.rank == 0 ? fl_tr_whole_make(t, w, cfg, o) : FL_OK;
    fl_model *wm = s == FL_OK && t->tp.rank == 0 ? &w->m : NULL;
    fl_status g = pw ? fl_tp_gather_params_host(m, t->tp.grp, pw, fl_model_store_dtype(m), wm)
                     : fl_tp_gather(m, t->tp.grp, wm, 0);
    if (m->lora) return tp_assemble_lora(t, m, o, w, s, g); /* the adapters and their optimizer state */
    if (o) {
        state_arrays(o, src);
        if (wm) state_arrays(&w->o, dst);
        for (int a = 0; a < 3 && g == FL_OK; a++)
            if (src[a])
                g = fl_tp_gather_array(m, t->tp.grp, full[a] ? NULL : o->home.be, full[a] ? full[a] : src[a], wm,
                                       wm ? w->o.home.be : NULL, dst[a], dt);
    }
    if (s == FL_OK) s = g;
    if (s == FL_OK && wm && o) {
        w->o.step = o->step;
        w->o.amp = o->amp; /* the loss scale */
    }
    return s;
}

static fl_status tp_save(trainer *t, int lead, const char *name, const fl_optimizer *o, const fl_train_state *st) {
    const fl_run_config *c = t->cfg;
    const fl_dtype dt = o && o->cfg.state_dtype == FL_BF16 ? FL_BF16 : FL_F32;
    void *full[3] = {NULL, NULL, NULL}, *src[3] = {NULL, NULL, NULL};
    fl_status s = FL_OK;
    if (o) state_arrays(o, src);
    /* FULL_SHARD: every rank of the axis gives its pieces of the slice's parameters and state, unit by unit */
    const int fsdp = t->dp.fsdp != NULL;
    void *pw = NULL;
    size_t pb = 0;
    if (fsdp) s = fl_fsdp_whole_params(&t->dp, &pw, &pb);
    for (int a = 0; a < 3 && o && fsdp; a++) {
        if (!src[a]) continue;
        full[a] = malloc(t->model.layout.numel * fl_dtype_size(dt) + 4);
        const fl_status g = fl_fsdp_whole_array(&t->dp, src[a], fl_dtype_size(dt), full[a]); /* collective: always */
        if (s == FL_OK) s = !full[a] ? fl_errorf(FL_ERR_OOM, "tensor parallel checkpoint: out of host memory") : g;
    }
    /* ZeRO: every rank of the axis gives its chunks first (the same arrays in the same order on every rank);
     * interleaved: every model chunk's in turn (fullc[c]: chunk c's) */
    const int V = t->pp.chunks > 1 ? t->pp.chunks : 1;
    void *fullc[FL_PP_MAX_CHUNKS][3];
    memset(fullc, 0, sizeof fullc);
    for (int a = 0; a < 3 && o && !fsdp && state_chunked(o); a++)
        if (src[a] && s == FL_OK) s = state_whole(t, o, src[a], dt, &full[a]);
    void *pwc[FL_PP_MAX_CHUNKS] = {NULL};
    for (int ch = 1; ch < V && fsdp; ch++) { /* FULL_SHARD: each chunk's pieces by its own bookkeeping */
        fl_dp *xd = &t->pp.xdp[ch];
        const fl_status g = fl_fsdp_whole_params(xd, &pwc[ch], &pb); /* collective: always */
        if (s == FL_OK) s = g;
        void *cs[3] = {NULL, NULL, NULL};
        if (o) state_arrays(&t->pp.xo[ch], cs);
        for (int a = 0; a < 3; a++) {
            if (!cs[a]) continue;
            fullc[ch][a] = malloc(t->pp.xm[ch].layout.numel * fl_dtype_size(dt) + 4);
            const fl_status ga = fl_fsdp_whole_array(xd, cs[a], fl_dtype_size(dt), fullc[ch][a]);
            if (s == FL_OK) s = !fullc[ch][a] ? fl_errorf(FL_ERR_OOM, "tensor parallel checkpoint: out of host memory") : ga;
        }
    }
    for (int ch = 1; ch < V && o && !fsdp && state_chunked(&t->pp.xo[ch]); ch++) {
        void *cs[3];
        state_arrays(&t->pp.xo[ch], cs);
        for (int a = 0; a < 3; a++)
            if (cs[a] && s == FL_OK) s = state_whole(t, &t->pp.xo[ch], cs[a], dt, &fullc[ch][a]);
    }
    tp_whole w, wc[FL_PP_MAX_CHUNKS];
    memset(&w, 0, sizeof w), memset(wc, 0, sizeof wc);
    /* DDP / ZeRO: the first data-parallel group gathers and writes */
    if (t->dp.rank == 0 && s == FL_OK) s = tp_assemble(t, &t->model, &t->tp.whole, o, full, pw, &w);
    for (int ch = 1; ch < V && t->dp.rank == 0 && s == FL_OK; ch++) { /* interleaved: each chunk's virtual stage */
        const int v = ch * t->pp.size + t->pp.stage;
        fl_model_config vc;
        s = chunk_config(t, &t->pp.whole, v, &vc);
        if (s == FL_OK) s = tp_assemble(t, &t->pp.xm[ch], &vc, o ? &t->pp.xo[ch] : NULL, fullc[ch], pwc[ch], &wc[ch]);
        if (s == FL_OK && t->tp.rank == 0) fl_model_set_stage(&wc[ch].m, 1, v < t->pp.size * V - 1);
    }
    for (int a = 0; a < 3; a++) {
        free(full[a]);
        for (int ch = 0; ch < FL_PP_MAX_CHUNKS; ch++) free(fullc[ch][a]);
    }
    for (int ch = 0; ch < FL_PP_MAX_CHUNKS; ch++) free(pwc[ch]);
    free(pw);
    if (t->dp.rank == 0 && s == FL_OK && t->pp.size > 1 && t->tp.rank == 0) {
        /* TP x PP: each stage (interleaved: each chunk) assembled on its group's rank 0; their pipeline gathers it on
         * stage 0, which writes */
        const fl_model *xm[FL_PP_MAX_CHUNKS];
        const fl_optimizer *xo[FL_PP_MAX_CHUNKS];
        for (int ch = 1; ch < V; ch++) xm[ch] = &wc[ch].m, xo[ch] = o ? &wc[ch].o : NULL;
        fl_model_set_stage(&w.m, t->pp.stage > 0, t->pp.stage < t->pp.size * V - 1);
        s = fl_tr_pp_save_stage_v(t, lead, name, &w.m, o ? &w.o : NULL, xm, xo, st);
    } else if (t->dp.rank == 0 && s == FL_OK && lead)
        s = fl_ckpt_save(c->out_dir, name, &w.m, o ? &w.o : NULL, st, fl_tr_saved_cfg(t),
                         t->in.tok_dir[0] ? t->in.tok_dir : NULL);
    for (int ch = 1; ch < V; ch++) whole_free(&wc[ch]);
    whole_free(&w);
    return s;
}

fl_status fl_tr_tp_save(trainer *t, int lead, const char *name, const fl_optimizer *o, const fl_train_state *st) {
    /* a failed gather or write fails every rank of the grid at once (as ZeRO's streamed saves do) */
    return fl_dp_agree(&t->dp, tp_save(t, lead, name, o, st));
}

fl_status fl_tr_sum_all(trainer *t, double *v, int n) {
    if (!t->tp.world) return fl_dp_sum(&t->dp, v, n);
    fl_dp g;
    memset(&g, 0, sizeof g);
    fl_dp_init(&g, t->tp.world, NULL);
    return fl_dp_sum(&g, v, n);
}

/* The slice of w's model and optimizer state (a whole model of t->tp.whole's config) into this rank's (under ZeRO
 * on the data axis: its chunk of the slice's arrays), the step and loss scale with them (m, o: the run's model and
 * optimizer, or under interleaved a later chunk's, w of its virtual stage's config) */
/* the data axis' bookkeeping of model m: the run's, or (FULL_SHARD under interleaved) a later chunk's own */
static const fl_dp *dp_of(const trainer *t, const fl_model *m) {
    for (int c = 1; c < t->pp.chunks; c++)
        if (m == &t->pp.xm[c] && t->pp.xdp[c].fsdp) return &t->pp.xdp[c];
    return &t->dp;
}

static fl_status tp_take_state(trainer *t, fl_model *m, fl_optimizer *o, tp_whole *w) {
    if (m->lora) { /* the frozen base is the run's (loaded from checkpoint_dir): the adapters and their state */
        fl_lora_adapters pa, wa;
        fl_model_lora_adapters(m, &pa);
        fl_model_lora_adapters(&w->m, &wa);
        fl_status s = fl_tp_lora_scatter(&w->m, w->m.be, wa.params, m, m->be, pa.params);
        void *src[3], *dst[3];
        state_arrays(&w->o, src);
        state_arrays(o, dst);
        for (int a = 0; a < 3 && s == FL_OK; a++)
            if (src[a] && dst[a]) s = fl_tp_lora_scatter(&w->m, w->o.home.be, src[a], m, o->home.be, dst[a]);
        if (s == FL_OK) o->step = w->o.step, o->amp.ls = w->o.amp.ls;
        return s;
    }
    fl_status s = fl_tp_scatter(&w->m, m);
    void *src[3], *dst[3];
    state_arrays(&w->o, src);
    state_arrays(o, dst);
    const fl_dtype dt = o->cfg.state_dtype == FL_BF16 ? FL_BF16 : FL_F32;
    const size_t es = fl_dtype_size(dt);
    /* FULL_SHARD on the data axis: the slice's whole array in host memory, then the rank's piece of each unit */
    size_t *fo = NULL, *so = NULL, *ln = NULL;
    const fl_dp *dp = dp_of(t, m); /* (interleaved: a later chunk's own bookkeeping) */
    const int G = dp->fsdp ? fl_fsdp_ranges(dp, NULL, NULL, NULL) : 0;
    if (G) fo = malloc(3 * (size_t)G * sizeof *fo), so = fo ? fo + G : NULL, ln = fo ? fo + 2 * G : NULL;
    if (fo) fl_fsdp_ranges(dp, fo, so, ln);
    /* ZeRO on the data axis: the slice's whole array in host memory, then this rank's chunk */
    const int staged = state_chunked(o) || G > 0;
    char *h = staged ? malloc((G ? m->layout.numel : o->w.n) * es + 4) : NULL;
    if (s == FL_OK && ((staged && !h) || (G && !fo))) s = fl_errorf(FL_ERR_OOM, "tensor parallel resume: out of host memory");
    for (int a = 0; a < 3 && s == FL_OK; a++) {
        if (!src[a] || !dst[a]) continue;
        s = fl_tp_scatter_array(&w->m, w->o.home.be, src[a], m, h ? NULL : o->home.be, h ? h : dst[a], dt);
        for (int g = 0; g < G && s == FL_OK; g++)
            s = FL_RUN(o->home.be, to_device, (char *)dst[a] + so[g] * es, h + fo[g] * es, ln[g] * es);
        if (s == FL_OK && h && !G) s = FL_RUN(o->home.be, to_device, dst[a], h + o->shard.off * es, o->shard.len * es);
    }
    free(h);
    free(fo);
    if (s == FL_OK) {
        o->step = w->o.step;
        o->amp.ls = w->o.amp.ls;
    }
    return s;
}

/* TP x PP: the stage's blocks of the whole checkpoint w (model and optimizer state) into sw, a model and optimizer of
 * the stage's config (t->tp.whole), entry by entry (the state arrays' bytes: both are whole, of one dtype) */
/* (interleaved: virtual stage v's, of config vc) */
static fl_status tpp_stage_state(trainer *t, tp_whole *w, tp_whole *sw, int v, const fl_model_config *vc) {
    const int first = t->pp.split[v];
    FL_TRY(fl_tr_whole_make(t, sw, vc, &t->opt));
    if (t->model.lora) return fl_tr_pp_lora_stage_state(t, w, sw, v); /* LoRA: the stage's adapters and their state */
    FL_TRY(fl_pp_stage_take(&w->m, &sw->m, first));
    const size_t es = fl_dtype_size(t->opt.cfg.state_dtype == FL_BF16 ? FL_BF16 : FL_F32);
    void *src[3], *dst[3];
    state_arrays(&w->o, src);
    state_arrays(&sw->o, dst);
    size_t most = 1;
    for (int i = 0; i < sw->m.layout.n; i++)
        if (sw->m.layout.params[i].numel > most) most = sw->m.layout.params[i].numel;
    char *buf = malloc(most * es);
    fl_status s = buf ? FL_OK : fl_errorf(FL_ERR_OOM, "tensor x pipeline parallel resume: out of host memory");
    for (int a = 0; a < 3 && s == FL_OK; a++) {
        if (!src[a] || !dst[a]) continue;
        for (int i = 0; i < sw->m.layout.n && s == FL_OK; i++) {
            const fl_param_info *p = &sw->m.layout.params[i];
            const int j = fl_pp_stage_entry(&w->m.layout, &sw->m.layout, first, i);
            s = fl_optim_state_read(&w->o, buf, (const char *)src[a] + w->m.layout.params[j].offset * es, p->numel * es);
            if (s == FL_OK) s = fl_optim_state_write(&sw->o, (char *)dst[a] + p->offset * es, buf, p->numel * es);
        }
    }
    free(buf);
    sw->o.step = w->o.step;
    sw->o.amp.ls = w->o.amp.ls;
    return s;
}

fl_status fl_tr_tp_ckpt_load(trainer *t, const char *path) {
    tp_whole w, sw;
    memset(&sw, 0, sizeof sw);
    const fl_model_config *cfg = t->pp.size > 1 ? &t->pp.whole : &t->tp.whole;
    fl_status s = fl_tr_whole_make(t, &w, cfg, &t->opt);
    if (s == FL_OK) s = fl_ckpt_load(path, &w.m, &w.o, &t->st);
    if (s == FL_OK && t->pp.size > 1) s = tpp_stage_state(t, &w, &sw, t->pp.stage, &t->tp.whole); /* TP x PP: the stage first */
    if (s == FL_OK) s = tp_take_state(t, &t->model, &t->opt, t->pp.size > 1 ? &sw : &w);
    whole_free(&sw);
    for (int c = 1; c < t->pp.chunks && s == FL_OK; c++) { /* interleaved: each later chunk's virtual stage, sliced */
        const int v = c * t->pp.size + t->pp.stage;
        fl_model_config vc;
        s = chunk_config(t, &t->pp.whole, v, &vc);
        if (s == FL_OK) s = tpp_stage_state(t, &w, &sw, v, &vc);
        if (s == FL_OK) s = tp_take_state(t, &t->pp.xm[c], &t->pp.xo[c], &sw);
        if (s == FL_OK) fl_model_sync_compute_copy(&t->pp.xm[c]); /* mixed precision: the resumed weights' copy */
        whole_free(&sw);
    }
    whole_free(&w);
    return s;
}

void fl_tr_tp_print(const trainer *t, fl_comm *world) {
    fl_tr_pp_print(t);
    if (t->tp.size <= 1 || !t->out) return;
    const fl_model_config *w = &t->tp.whole, *p = &t->model.cfg;
    const int vr = fl_config_vocab_rows(p, NULL); /* rank 0's: V / N rounded down */
    fprintf(t->out, "tensor parallel: %d ranks per group x %d data-parallel group%s over %s; each rank holds %d of the "
            "%d attention heads, %d of the %d key/value heads and %d of the %d MLP columns (QKV and gate/up "
            "column-parallel, O and down row-parallel; the token embeddings and lm_head vocabulary-parallel (%d of the %d "
            "rows; the cross-entropy combines the ranks' row statistics): %zu of the %zu parameters); norms replicated; "
            "2 all-reduces of (B T, C) per block forward and 2 backward%s; the group of rank 0 reports and writes "
            "consolidated checkpoints\n",
            t->tp.size, t->dp.world, t->dp.world == 1 ? "" : "s", fl_comm_impl_name(world), p->n_heads, w->n_heads,
            p->n_kv_heads, w->n_kv_heads, p->ffn_dim, w->ffn_dim, vr, w->vocab_size, t->model.layout.numel,
            t->tp.whole_numel,
            p->n_dec_layers > 0 ? " (T5's decoder block 3 and 3: its cross-attention's q and k|v column-parallel, o "
                                  "row-parallel; each stack's relative position bias split by heads; d(encoder output) "
                                  "summed once per backward)" : "");
    if (t->model.sp)
        fprintf(t->out, "sequence parallel: between the linears each rank holds %d of every pass's %d x %d rows%s (the "
                "residual stream, the norms, the residual adds; the saved stream and statistics 1/%d); a reduce-scatter "
                "after each row-parallel linear and an all-gather before each column-parallel one in place of the "
                "all-reduces; the norms' weight gradients summed over the group%s\n",
                /* the arena's T is rounded up to a multiple of N (fl_model_alloc_acts): a rank holds B x T_N / N rows */
                t->sch.B * ((t->sch.T + t->tp.size - 1) / t->tp.size), t->sch.B,
                (t->sch.T + t->tp.size - 1) / t->tp.size * t->tp.size,
                t->sch.T % t->tp.size ? " (each sequence padded at its end to a multiple of the group)" : "", t->tp.size, t->sch.Ts ? " (T5: both stacks, the target's rows shown; the encoder "
                "output gathered once per pass for the cross-attention)" : "");
}

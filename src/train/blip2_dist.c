/* BLIP-2 fine-tuning's strategies (fitllm/blip2_train.h): DDP, ZeRO-1 and ZeRO-2 over the ranks and CPU optimizer
 * offload, through the trainer's data-parallel pieces (dp.h, zero.c) applied to each trained part's optimizer.
 *
 * One fl_dp for the run (its optimizer hooks shared by the parts' optimizers: they act on the optimizer they are
 * given). Per part, fl_dp_optim_init: under ZeRO each rank keeps the optimizer state of its chunk of the part's
 * trainable elements (fl_comm_chunk) and updates those, then one all-gather gives every rank the part's updated
 * parameters; with offload the state lives in the host tier ("host (offload)", outside the device pool and its
 * budget) and the update runs on the host's kernels. The gradients: DDP and ZeRO-1 all-reduce each part's (the bits of
 * DDP: ZeRO-1 = DDP bit for bit), ZeRO-2 reduce-scatters them (each rank the sum of its chunk, the same rank-order sum
 * per element). Clipping's norm: DDP and ZeRO-1 every trained part's whole gradient, ZeRO-2 the squared norms of the
 * chunks summed over the ranks in rank order (fl_dp_sum): equal to DDP's within the rounding of the sum's order.
 * Step checkpoints under ZeRO gather each part's state to every rank (blip2_ckpt.c) and rank 0 writes the one-process
 * form; a resume takes each rank's chunk of it, so they resume at any world size.
 *
 * FSDP FULL_SHARD / ZeRO-3 (--strategy fsdp, deepspeed_stage_3; full fine-tuning at several ranks): one fl_dp per
 * part (pdp[k], sharing the run's communicator), each with fsdp.c's sharding of its part: the units are the part's
 * layout groups (group 0: patch embedding / query tokens + embedding norm / the language model's embeddings; each
 * block; the last: the vision tower's post-LayerNorm / the language projection / the final norm with the head), every
 * part sharded, the frozen ones too (no gradient, no optimizer); the passes (blip2_pass.c) gather and release each
 * unit around its use and reduce-scatter its gradient when its backward ends. Each part's optimizer runs on its
 * shard. LoRA under FULL_SHARD: the base stays whole on every rank and the adapters (and a part trained whole) train
 * as ZeRO-2, as the trainer's LoRA does. HYBRID_SHARD, 8-bit AdamW on the shards and parameter offload (host or
 * NVMe) under FULL_SHARD: docs/ARCHITECTURE.md "BLIP-2". --strategy auto is DDP (Lightning's Trainer default, the
 * course's BLIP-2 script), in the plan as in the run. */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "blip2_train-impl.h"
#include "core/fs.h"
#include "fitllm/backend_op.h"

fl_status fl_b2t_check_strategy(const fl_run_config *c) {
    int stage = 0;
    FL_TRY(fl_error_prefix(fl_cfg_zero_stage(c->strategy, c->sharding_strategy, &stage), "--strategy"));
    /* parameter offload shards the parts over the ranks (one rank: the whole part is its shard, in the tier): full
     * fine-tuning only, as the trainer's FULL_SHARD (LoRA keeps the base whole on every rank) */
    if (fl_cfg_param_offload(c) && c->command == FL_CMD_FINETUNE_LORA)
        return fl_errorf(FL_ERR_UNSUPPORTED, "--strategy %s under finetune_lora: BLIP-2's parameter offload shards the "
                         "parts (finetune_full); LoRA keeps the base whole on every rank: use deepspeed_stage_3_offload "
                         "or deepspeed_stage_2_offload (the adapters' optimizer on the host)", c->strategy);
    return FL_OK;
}

/* 1 when the run's state is divided over several ranks (ZeRO-1/2 at world > 1) */
int fl_b2t_sharded(const b2run *r) { return r->dp.comm && r->dp.stage >= 1; }

int fl_b2t_fsdp(const b2run *r) {
    for (int k = 0; k < FL_BLIP2_PARTS; k++)
        if (r->pdp[k].fsdp) return 1;
    return 0;
}

/* part k's data-parallel context: its FSDP one when the part is sharded, else the run's */
static fl_dp *part_dp(b2run *r, int k) { return r->pdp[k].fsdp ? &r->pdp[k] : &r->dp; }

/* CPU offload's host tier ("host (offload)", outside the device pool and its budget) and the backend the update runs
 * on: the run's own on host memory (or where nothing is computed: the plan), else a CPU backend. Once: parameter
 * offload makes it before the parts are created. */
static fl_status offload_tier(b2run *r) {
    if (r->opool_ok) return FL_OK;
    const fl_backend *be = &r->be;
    FL_TRY(be->host_pool_init ? be->host_pool_init(be, &r->opool, "host (offload)", 0)
                              : fl_mem_pool_init(&r->opool, "host (offload)", 0));
    r->opool_ok = 1;
    if (fl_backend_host_memory(be) || fl_backend_discards(be)) {
        r->off.be = be; /* the update in place on host memory (or nothing computed: the plan) */
    } else {
        FL_TRY(fl_error_prefix(fl_cpu_backend_init(&r->hbe, r->cfg->threads), "CPU offload: the host's optimizer"));
        r->hbe_ok = 1;
        r->off.be = &r->hbe;
    }
    r->off.pool = &r->opool;
    const fl_run_config *c = r->cfg;
    if (fl_cfg_offload_nvme(c) || fl_cfg_param_offload(c) == 2) {
        /* NVMe (ZeRO-Infinity): files under nvme_path (out_dir by default; unlinked at creation), as the trainer's; the
         * plan's null backend stands it in with its counted fake addresses */
        if (fl_backend_discards(be)) {
            FL_TRY(be->host_pool_init(be, &r->dpool, "nvme (offload)", 0));
        } else {
            const char *dir = c->nvme_path[0] ? c->nvme_path : c->out_dir;
            if (!c->nvme_path[0]) FL_TRY(fl_fs_mkdir_p(dir));
            FL_TRY(fl_mem_disk_pool_init(&r->dpool, "nvme (offload)", dir));
        }
        r->dpool_ok = 1;
        if (fl_cfg_offload_nvme(c)) r->off.state_pool = &r->dpool;
    }
    return FL_OK;
}

fl_status fl_b2t_fsdp_prepare(b2run *r, const fl_precision *prec) {
    int stage = 0;
    FL_TRY(fl_cfg_zero_stage(r->cfg->strategy, r->cfg->sharding_strategy, &stage));
    /* parameter offload (fsdp_cpu_offload) shards at one rank too: the whole part is the rank's shard, in the tier */
    const int poff = fl_cfg_param_offload(r->cfg); /* 1 the host tier, 2 NVMe files */
    if ((r->world < 2 && !poff) || stage != 3 || r->lora) return FL_OK;
    static const char *const what[FL_BLIP2_PARTS] = {"vision tower", "Q-Former", "language model"};
    /* the units' gathers and reductions on the backend's buffers: a device backend's communicator (NCCL; its CPU
     * stand-in on cuda-emu and opaque), a plan's null one (the null backend's fake addresses: it moves nothing); a
     * host-memory backend's buffers go through the run's communicator */
    fl_status cs = FL_OK;
    if (r->world > 1 && (fl_backend_discards(&r->be) || !fl_backend_host_memory(&r->be)) && r->be.comm_create && !r->fdev)
        cs = fl_error_prefix(r->be.comm_create(&r->be, r->comm, &r->fdev), "FSDP: the %s backend's communicator",
                             r->be.name);
    if (r->world > 1 && fl_cfg_hybrid_shard(r->cfg->strategy, r->cfg->sharding_strategy) && r->cfg->num_nodes > 1) {
        /* HYBRID_SHARD's splits are collectives: a rank whose communicator failed must not leave the others there */
        fl_dp all = {.comm = r->comm, .rank = r->rank, .world = r->world};
        cs = fl_dp_agree(&all, cs);
    }
    FL_TRY(cs);
    const int disk = poff == 2 && !fl_backend_discards(&r->be);
    if (poff) { /* the parameters' and gradients' shards in the host tier, the optimizer updating them there */
        FL_TRY(offload_tier(r));
        r->off.params_host = 1;
        if (disk) r->off.param_pool = &r->dpool; /* the update drops their pieces behind it */
    }
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        fl_dp *d = &r->pdp[k];
        memset(d, 0, sizeof *d);
        d->comm = r->world > 1 ? r->comm : NULL; /* the reductions' MPI scratch outside the pool, as the run's fl_dp */
        d->dev = r->fdev;
        d->be = &r->be; /* the checkpoints' gathers read the shards through its to_host */
        d->rank = r->rank, d->world = r->world;
        if (poff) {
            d->ptier.be = r->off.be;
            d->ptier.pool = poff == 2 ? &r->dpool : &r->opool;
            d->ptier.host = &r->opool;
            d->ptier.disk = disk;
            d->ptier.prefetch = r->cfg->offload_prefetch;
            d->ptier.overlap = r->cfg->offload_overlap;
        }
        /* the part is created sharded: the loader (or the random init) fills this rank's pieces only; HYBRID_SHARD:
         * each part's fl_dp splits the ranks into its nodes and replica groups (every rank in the same order) */
        FL_TRY(fl_error_prefix(fl_fsdp_prepare(d, r->cfg, prec, &r->stg[k]), "FSDP of the BLIP-2 %s", what[k]));
    }
    return FL_OK;
}

fl_status fl_b2t_fsdp_init(b2run *r) {
    for (int k = 0; k < FL_BLIP2_PARTS; k++)
        if (r->pdp[k].fsdp) FL_TRY(fl_fsdp_init(&r->pdp[k], r->cfg, fl_blip2_part(r->b, k)));
    return FL_OK;
}

void fl_b2t_fsdp_free(b2run *r) {
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        fl_dp *d = &r->pdp[k];
        fl_fsdp_free(d); /* its gathers in flight use the node's communicators */
        fl_comm_destroy(d->drep), fl_comm_destroy(d->dnode); /* HYBRID_SHARD's groups (split from dev: first) */
        fl_comm_destroy(d->rep), fl_comm_destroy(d->node);
        d->drep = d->dnode = d->rep = d->node = NULL;
    }
    fl_comm_destroy(r->fdev);
    r->fdev = NULL;
}

/* plan --devices N / the lab's fsdp row under FULL_SHARD: rank 0's memory is its shard's, which only running the ranks
 * gives (each unit's gather and reduce-scatter take GATHER as the run does): the N ranks' set-up and steps as threads
 * on the null backend (fl_blip2_train per rank with the threads communicator), rank 0's result. */
typedef struct {
    const fl_run_config *cfg;
    const fl_blip2_train_opts *o;
    fl_blip2_train_result *res; /* (N) */
    fl_status *st;              /* (N) each rank's status */
    char (*msg)[512];           /* (N) and its message */
} plan_ranks;

static fl_status plan_rank(fl_comm *comm, int rank, void *ud) {
    plan_ranks *x = ud;
    fl_blip2_train_opts o = *x->o;
    o.comm = comm, o.plan_world = 0;
    o.plan_rank = 0;
    if (rank != x->o->plan_rank) o.report = o.out = NULL, o.step_ms = o.step_loss = NULL, o.n_step_out = 0, o.stop = NULL;
    x->st[rank] = fl_blip2_train(x->cfg, &o, &x->res[rank]);
    if (x->st[rank] != FL_OK) snprintf(x->msg[rank], sizeof x->msg[rank], "%s", fl_error_message());
    return x->st[rank];
}

int fl_b2t_plan_ranks(const fl_run_config *c, const fl_blip2_train_opts *o) {
    int stage = 0;
    if (o->comm || !o->be || !fl_backend_discards(o->be) || o->rehearse_steps <= 0 || c->command == FL_CMD_FINETUNE_LORA ||
        fl_cfg_zero_stage(c->strategy, c->sharding_strategy, &stage) != FL_OK || stage != 3)
        return 0;
    const int n = o->plan_world > 1 ? o->plan_world : c->devices * (c->num_nodes > 1 ? c->num_nodes : 1);
    return n > 1 ? n : 0;
}

fl_status fl_b2t_plan_fsdp(const fl_run_config *c, const fl_blip2_train_opts *o, int n, fl_blip2_train_result *res) {
    fl_run_config all = *c; /* c is one rank's share of the step (global batch / N): the ranks' run has all of it */
    const int B = c->train.micro_batch_size > 0 ? c->train.micro_batch_size : 1;
    all.train.global_batch_size = (c->train.global_batch_size > 0 ? c->train.global_batch_size : B) * n;
    /* HYBRID_SHARD keeps its nodes (the shards within each node's --devices ranks); else one node of N */
    if (!fl_cfg_hybrid_shard(c->strategy, c->sharding_strategy) || c->num_nodes <= 1 || c->devices * c->num_nodes != n)
        all.devices = n, all.num_nodes = 1;
    if (o->plan_rank < 0 || o->plan_rank >= n)
        return fl_errorf(FL_ERR_INVALID, "--rank %d: the run has %d ranks (0 .. %d)", o->plan_rank, n, n - 1);
    plan_ranks x = {&all, o, calloc((size_t)n, sizeof *res), calloc((size_t)n, sizeof(fl_status)),
                    calloc((size_t)n, sizeof *x.msg)};
    if (!x.res || !x.st || !x.msg) {
        free(x.res), free(x.st), free(x.msg);
        return fl_errorf(FL_ERR_OOM, "out of host memory");
    }
    fl_status s = fl_comm_threads_run(n, plan_rank, &x);
    int pick = o->plan_rank;
    /* a rank out of memory ends the run (the others then fail in the broken group): that rank's record and message */
    for (int k = 0; s != FL_OK && k < n; k++)
        if (x.st[k] == FL_ERR_OOM && x.res[k].oom.valid) {
            pick = k;
            s = fl_errorf(FL_ERR_OOM, "rank %d of %d: %s", k, n, x.msg[k]);
            break;
        }
    *res = x.res[pick];
    free(x.res), free(x.st), free(x.msg);
    return s;
}

fl_status fl_b2t_dist_setup(b2run *r) {
    const fl_run_config *c = r->cfg;
    memset(&r->dp, 0, sizeof r->dp);
    /* not fl_dp_init: the reductions' MPI scratch stays outside the pool, as the DDP runs' before (and the plan's) */
    r->dp.comm = r->world > 1 ? r->comm : NULL;
    r->dp.rank = r->rank, r->dp.world = r->world;
    r->dcfg = *c; /* fl_dp_optim_init's view: auto is DDP here (not the trainer's FSDP for finetune_full) */
    if (!strcmp(r->dcfg.strategy, "auto")) snprintf(r->dcfg.strategy, sizeof r->dcfg.strategy, "ddp");
    if (fl_cfg_offload(c->strategy) || r->off.params_host) { /* the optimizer with the parameters (fsdp_cpu_offload) */
        FL_TRY(offload_tier(r));
        r->dp.offload = &r->off;
    }
    if (r->world > 1) {
        int stage = 0;
        FL_TRY(fl_cfg_zero_stage(r->dcfg.strategy, r->dcfg.sharding_strategy, &stage));
        const int ckpt = c->train.save_interval > 0 || c->train.save_on_signal || (c->resume[0] && strcmp(c->resume, "false"));
        /* FULL_SHARD's 8-bit state is gathered into the one-process layout (blip2_ckpt.c); ZeRO-1/2's (and LoRA's
         * adapters under FULL_SHARD, which train as ZeRO-2) is not */
        if (stage >= 1 && c->optimizer.kind == FL_OPT_ADAMW8BIT && ckpt && !fl_b2t_fsdp(r))
            return fl_errorf(FL_ERR_UNSUPPORTED, "--strategy %s over %d ranks with --optimizer AdamW8bit: BLIP-2 step "
                             "checkpoints and --resume of the 8-bit state divided over the ranks are not built yet "
                             "under ZeRO-1/2 (FULL_SHARD of finetune_full gathers it): use --train.save_interval 0 "
                             "--train.save_on_signal false without --resume, --strategy ddp, or AdamW", c->strategy,
                             r->world);
    }
    return FL_OK;
}

fl_status fl_b2t_optim_init(b2run *r, int k) {
    fl_model *m = fl_blip2_part(r->b, k);
    int stage = 0;
    FL_TRY(fl_cfg_zero_stage(r->dcfg.strategy, r->dcfg.sharding_strategy, &stage));
    /* plan --devices N under ZeRO: rank 0's chunk of the state, no communicator (the plan's rank moves nothing) */
    if (!r->dp.comm && r->o->plan_world > 1 && stage >= 1)
        return fl_optim_init_offload(&r->opt[k], m, &r->dcfg.optimizer, r->o->plan_world, 0, r->dp.offload);
    if (r->pdp[k].fsdp) r->pdp[k].offload = r->dp.offload; /* deepspeed_stage_3_offload: the shard's state on the host */
    return fl_dp_optim_init(part_dp(r, k), &r->dcfg, &r->opt[k], m);
}

/* DDP / ZeRO: every trained part's gradients (the adapters' under LoRA) reduced as the stage does, and the
 * micro-batches' losses (each known to one rank, 0 on the others: their sum is exact) summed over the ranks. */
fl_status fl_b2t_reduce(b2run *r, float *ml, int accum) {
    for (int k = 0; k < FL_BLIP2_PARTS; k++)
        if (r->has_opt[k]) FL_TRY(fl_dp_reduce_grads(part_dp(r, k), &r->opt[k]));
    return fl_comm_all_reduce(r->comm, ml, ml, (size_t)accum, FL_F32, FL_COMM_SUM);
}

/* bf16-true: the 16-bit gradients times coef, each rounded once (PyTorch's clip_grad_norm_ multiplies the bf16
 * gradients in place), in slices through the store's fp32 gradient staging (free between backwards) */
static fl_status scale16(const fl_backend *be, fl_model *m, float coef, fl_mem_pool *hp) {
    const fl_dtype dt = fl_model_store_dtype(m);
    uint16_t *g = fl_model_grads_16(m);
    float *st = fl_model_grad_stage(m);
    const size_t n = fl_model_store_numel(m), S = fl_sizing_gstage_elems(&m->cfg);
    void *own = NULL; /* parameter offload on a device backend: the host's gradients staged in the host tier */
    if (hp && S) FL_TRY(fl_mem_alloc(hp, FL_TAG_WORKSPACE, S * sizeof(float), &own));
    if (own) st = own;
    fl_status s = g && st && S ? FL_OK : fl_errorf(FL_ERR_INTERNAL, "clipping 16-bit gradients: no fp32 staging");
    for (size_t a = 0; s == FL_OK && a < n; a += S) {
        const size_t k = n - a < S ? n - a : S;
        s = FL_RUN(be, convert, st, FL_F32, g + a, dt, k);
        if (s == FL_OK) FL_RUN(be, scale, st, k, coef);
        if (s == FL_OK) s = FL_RUN(be, convert, g + a, dt, st, FL_F32, k);
    }
    if (own) fl_mem_free(hp, own);
    return s;
}

/* the backend whose memory holds o's gradients: the host tier's under parameter offload, else the run's */
static const fl_backend *grads_be(const b2run *r, const fl_optimizer *o) {
    return o->home.params_host ? o->home.be : &r->be;
}

/* clip_grad_norm_ over every trained part's gradients at once (the norm over all of them, in double; coef =
 * max_norm / (norm + 1e-6) when below 1), before the parts' updates. */
fl_status fl_b2t_clip(b2run *r, float max_norm) {
    double ss = 0;
    /* ZeRO-2: each rank holds its chunk of the sums; FULL_SHARD: its shard of each part (o->shard: all of it) */
    const int chunks = (r->dp.comm && r->dp.stage == 2) || fl_b2t_fsdp(r);
    fl_dp *sum = &r->dp; /* FULL_SHARD: over the shard group (HYBRID_SHARD: the node; its replicas hold the same) */
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        if (!r->has_opt[k]) continue;
        const fl_optimizer *o = &r->opt[k];
        if (r->pdp[k].fsdp) sum = &r->pdp[k];
        if (chunks) {
            const size_t es = fl_dtype_size(o->w.gt);
            if (o->shard.len) {
                double v = 0; /* sumsq's status ignored, as the slot has none; parameter offload: the host's shard */
                (void)FL_RUN(grads_be(r, o), sumsq, (const char *)o->w.g + o->shard.off * es, o->w.gt, o->shard.len, &v);
                ss += v;
            }
        } else {
            const double n = fl_grad_norm(fl_blip2_part(r->b, k));
            ss += n * n;
        }
    }
    if (chunks && sum->comm) FL_TRY(sum->fsdp ? fl_fsdp_sum(sum, &ss, 1) : fl_dp_sum(sum, &ss, 1));
    const float coef = max_norm / (float)(sqrt(ss) + 1e-6);
    if (!(coef < 1.0f)) return FL_OK;
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        if (!r->has_opt[k]) continue;
        fl_model *m = fl_blip2_part(r->b, k);
        fl_lora_adapters ad;
        if (fl_model_lora_adapters(m, &ad)) (void)FL_RUN(&r->be, scale, ad.grads, ad.numel, coef);
        else if (fl_model_grads_f32(m))
            (void)FL_RUN(grads_be(r, &r->opt[k]), scale, fl_model_grads_f32(m), fl_model_store_numel(m), coef);
        else /* parameter offload with its own host backend: the device's staging is not the host's */
            FL_TRY(scale16(grads_be(r, &r->opt[k]), m, coef, grads_be(r, &r->opt[k]) != &r->be ? &r->opool : NULL));
    }
    return FL_OK;
}

void fl_b2t_dist_free(b2run *r) {
    if (r->dpool_ok) fl_mem_pool_free(&r->dpool);
    if (r->opool_ok) fl_mem_pool_free(&r->opool);
    if (r->hbe_ok) fl_backend_free(&r->hbe);
    r->opool_ok = r->hbe_ok = r->dpool_ok = 0;
}

/* One line per split: "NAME: N records, T caption tokens, fingerprint HEX": the captions' ids (as tokenized and cut)
 * and each image's file name and size, in record order (the images are not read here: a pass over every image at
 * set-up would cost a pass over the data set). */
static void describe_records(const b2run *r, FILE *f, const char *name, size_t i0, size_t n) {
    uint64_t h = FL_DATA_FP_BASIS;
    size_t tok = 0;
    for (size_t i = i0; i < i0 + n; i++) {
        const char *img = r->caps.image[i], *base = strrchr(img, '/') ? strrchr(img, '/') + 1 : img;
        struct stat st;
        const long long size = stat(img, &st) == 0 ? (long long)st.st_size : -1;
        const int32_t w[3] = {r->n_ids[i], (int32_t)(uint32_t)size, (int32_t)(uint32_t)((unsigned long long)size >> 32)};
        h = fl_data_fp_extend(h, w, 3);
        h = fl_data_fp_extend(h, r->ids[i], (size_t)r->n_ids[i]);
        for (const char *c = base; *c; c++) {
            const int32_t ch = (unsigned char)*c;
            h = fl_data_fp_extend(h, &ch, 1);
        }
        tok += (size_t)r->n_ids[i];
    }
    fprintf(f, "%s: %zu records, %zu caption tokens, fingerprint %016llx\n", name, n, tok, (unsigned long long)h);
}

fl_status fl_b2t_check_data(b2run *r) {
    if (r->world <= 1 || r->synth || !r->dp.comm) return FL_OK;
    char *mine = NULL, files[3 * FL_CFG_PATH + 64], abs[PATH_MAX];
    size_t len = 0;
    FILE *f = open_memstream(&mine, &len);
    if (!f) return fl_errorf(FL_ERR_OOM, "out of host memory");
    describe_records(r, f, "training set", 0, r->n_rec);
    describe_records(r, f, "validation set", r->n_rec, r->n_val);
    fclose(f);
    const char *jp = r->cfg->data.json_path, *rp = realpath(jp, abs);
    snprintf(files, sizeof files, "data.json_path '%s'%s%s%s", jp, rp && strcmp(rp, jp) ? " (" : "",
             rp && strcmp(rp, jp) ? rp : "", rp && strcmp(rp, jp) ? ")" : rp ? "" : " (missing here)");
    /* the same command line and recipe, as the trainer's (agreed: the data check that follows is collective) */
    fl_status s = fl_dp_agree(&r->dp, fl_dp_check_config(&r->dp, r->cfg));
    if (s == FL_OK) s = fl_dp_check_data(&r->dp, mine, files);
    free(mine);
    return s;
}

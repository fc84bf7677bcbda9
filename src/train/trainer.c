/* The training loop (LitGPT's fit()): see include/fitllm/trainer.h.
 *
 * One iteration = one micro-batch forward+backward; every `accum` iterations
 * the optimizer steps (fl_step_run). The micro-batches of a step are fetched first so the
 * loss can be normalized by the number of valid targets of the whole step
 * (accumulation == one large batch). The phases live in their own files (trainer-impl.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer-impl.h"
#include "core/fs.h"
#include "fitllm/checkpoint.h"
#include "fitllm/fault.h"
#include "fitllm/generate.h"
#include "fitllm/lora.h"
#include "fitllm/tokenizer.h"

/* One optimizer step over this rank's fetched micro-batches t->buf.mbs (fl_step_run, the step
 * bench-step times): iter0: global micro-batches before this step; step_valid: the valid targets
 * of the whole step (0: nothing to learn, no update). (loss sum, valid) per micro-batch go to this
 * rank's slots of t->buf.mb_stats, their wall ms after them. A diverged micro-batch or update is said with its step
 * and iteration. */
static fl_step_ctx step_ctx(trainer *t, long iter0, long step_valid, float lr) {
    const fl_run_config *cfg = t->cfg;
    const int grid_rank = t->tp.world ? fl_comm_rank(t->tp.world) : t->dp.rank; /* a test's fault (fitllm/fault.h) */
    double *mine = t->buf.mb_stats + (size_t)t->dp.rank * FL_TR_MB_SLOTS * t->sch.accum;
    return (fl_step_ctx){.fault = t->fault_at ? t->fault_at(grid_rank, t->st.step + 1) : NULL,
                         .mbs = t->buf.mbs, .n_micro = t->sch.accum, .step_valid = step_valid, .skip_empty = 1, .lr = lr,
                         .max_norm = cfg->train.max_norm, .dp = &t->dp, .sync = &t->dp.sync, .seeded = 1,
                         .seed = cfg->seed * 0x9e3779b97f4a7c15ULL, .iter0 = iter0,
                         .mb_stats = mine, .mb_ms = mine + 2 * t->sch.accum};
}

/* The global iteration (1-based) a failed step failed at, so the caller (the loop, the rehearsal) can report a
 * divergence where it acts on it (fl_tr_diverged). */
static long failed_iter(const trainer *t, const fl_step_ctx *c, long iter0) {
    return c->failed_k < t->sch.accum ? iter0 + (long)c->failed_k * t->dp.world + t->dp.rank + 1 : iter0 + t->sch.G;
}

/* One optimizer step through fl_step_run; on failure *fail_iter says where. */
static fl_status train_step(trainer *t, long iter0, long step_valid, float lr, fl_step_result *sr, long *fail_iter) {
    fl_step_ctx c = step_ctx(t, iter0, step_valid, lr);
    fl_status s = fl_step_run(&t->model, &t->opt, &c, sr);
    *fail_iter = failed_iter(t, &c, iter0);
    return s;
}

/* The same step as this rank's stage of a pipeline (--pipeline_parallel; fl_pp_step_run, src/train/pp_step.c): its
 * own path (tools/callpath.py --func train_step_pp), so train_step's count stays the one-stack step's. */
static fl_status train_step_pp(trainer *t, long iter0, long step_valid, float lr, fl_step_result *sr, long *fail_iter) {
    fl_step_ctx c = step_ctx(t, iter0, step_valid, lr);
    fl_status s = fl_pp_step_run(&t->pp.rt, &t->opt, &c, sr);
    *fail_iter = failed_iter(t, &c, iter0);
    return s;
}

/* The pool's memory record into r: the all-time peaks, the snapshots, and on FL_ERR_OOM the
 * failed allocation (also on failure: what was reached). */
static void result_memory(const trainer *t, fl_status s, fl_trainer_result *r) {
    for (int k = 0; k < FL_TAG_COUNT; k++) r->peak[k] = t->hw.pool.peak[k];
    r->peak_total = t->hw.pool.peak_total;
    r->offload = t->hw.opool_ok;
    for (int k = 0; t->hw.opool_ok && k < FL_TAG_COUNT; k++) r->host_peak[k] = t->hw.opool.peak[k];
    r->host_peak_total = t->hw.opool_ok ? t->hw.opool.peak_total : 0;
    r->nvme = t->hw.dpool_ok;
    for (int k = 0; t->hw.dpool_ok && k < FL_TAG_COUNT; k++) r->nvme_peak[k] = t->hw.dpool.peak[k];
    r->nvme_peak_total = t->hw.dpool_ok ? t->hw.dpool.peak_total : 0;
    r->n_phases = t->hw.pool.n_phases < FL_TRAINER_MAX_PHASES ? t->hw.pool.n_phases : FL_TRAINER_MAX_PHASES;
    memcpy(r->phases, t->hw.pool.phases, (size_t)r->n_phases * sizeof r->phases[0]);
    if (s == FL_ERR_OOM) r->oom = t->hw.pool.oom;
}

/* The rehearsal's sample: the "eval_generate" snapshot at the first sampled token (the cache,
 * the decode scratch, the sampler and its logits held; the prefill's scratch, gone by then, is
 * in the phase peak), then stop after the first decode step: every later step repeats it
 * (fl_model_decode allocates nothing) and sampling over the vocabulary on the host would cost
 * the plan more than everything else (3/4 of a Llama-3-8B plan's time). */
static int snapshot_eval_generate(void *ud, int32_t id) {
    (void)id;
    fl_mem_pool *p = ud;
    if (fl_mem_find_phase(p, "eval_generate")) return 1;
    fl_mem_snapshot(p, "eval_generate");
    return 0;
}

/* A trainer with nothing set up yet: its configuration and one process's (or comm's) ranks. */
static void trainer_begin(trainer *t, const fl_run_config *cfg, fl_comm *comm) {
    memset(t, 0, sizeof *t);
    t->cfg = cfg;
    t->fault_at = fl_fault_armed() ? fl_fault_at : NULL; /* a test's fault (fitllm/fault.h): a plug-in when armed */
    fl_dp_init(&t->dp, comm, NULL);
}

fl_status fl_trainer_rehearse(const fl_run_config *cfg, const fl_model_config *mc, const fl_backend *be,
                              size_t budget, int B, int T, int accum, int gen_prompt, fl_trainer_result *res) {
    return fl_trainer_rehearse_comm(cfg, mc, be, NULL, budget, B, T, accum, gen_prompt, res);
}

fl_status fl_trainer_rehearse_comm(const fl_run_config *cfg, const fl_model_config *mc, const fl_backend *be,
                                   fl_comm *comm, size_t budget, int B, int T, int accum, int gen_prompt,
                                   fl_trainer_result *res) {
    trainer t;
    trainer_begin(&t, cfg, comm);
    fl_trainer_result r;
    memset(&r, 0, sizeof r);
    r.val_loss = NAN;
    fl_status s0 = fl_tr_tp_begin(&t, comm, mc, &comm); /* tensor parallel: comm := the data-parallel axis */
    if (s0 != FL_OK) {
        fl_tr_tp_end(&t);
        return s0;
    }
    int32_t *prompt = NULL, *gen = NULL;
    fl_precision prec;
    fl_status s = fl_precision_find(cfg->precision, &prec);
    if (s == FL_OK && !prec.available)
        s = fl_errorf(FL_ERR_UNSUPPORTED, "precision '%s' is not available yet in this build", cfg->precision);
    if (s == FL_OK) s = fl_trainer_storage(cfg, &prec, &t.stg);
    if (s != FL_OK) goto done;
    t.hw.be = *be; /* borrowed (be_ok stays 0: the caller frees it) */
    s = fl_backend_pools_init(&t.hw.be, &t.hw.pool, &t.hw.hpool, fl_backend_host_memory(be) ? "cpu" : "cuda", budget);
    if (s != FL_OK) goto done;
    t.hw.pool_ok = 1;
    /* fl_trainer_run_comm's set-up sequence; its agreements are left out (they allocate nothing, and a
     * rank that fails here breaks the group: see done) */
    fl_dp_init(&t.dp, comm, &t.hw.pool);
    t.dp.be = &t.hw.be;
    if (t.dp.world > 1 && !be->comm_create)
        s = fl_errorf(FL_ERR_UNSUPPORTED, "rehearsing %d ranks needs a backend with a device communicator (the null "
                      "backend's)", t.dp.world);
    if (s == FL_OK) s = fl_dp_device_comm(&t.dp, &t.hw.be);
    fl_strategy_choice sc;
    /* the planned backend's choice: a GPU's under --accelerator cuda (the null communicator is a
     * device one on either) */
    if (s == FL_OK) s = fl_cfg_resolve_strategy(cfg, !fl_backend_host_memory(be), &sc);
    fl_run_config rcfg = *cfg;
    if (s == FL_OK) {
        snprintf(rcfg.strategy, sizeof rcfg.strategy, "%s", sc.strategy);
        snprintf(rcfg.sharding_strategy, sizeof rcfg.sharding_strategy, "%s", sc.sharding);
        s = fl_tr_setup_offload(&t, &sc); /* parameter offload: the tiers exist before the model */
        if (s == FL_OK) s = fl_fsdp_prepare(&t.dp, &rcfg, &prec, &t.stg);
    }
    if (s == FL_OK) s = fl_tr_tp_check(&t, &sc);
    if (s == FL_OK) s = fl_tr_setup_model(&t, &prec, mc);
    if (s == FL_OK) s = fl_tr_check_s2s(&t, &prec, &sc);
    /* an encoder-decoder: sources of data.max_source_length tokens (the planner's source length), targets of T */
    const int s2s = s == FL_OK && fl_model_is_s2s(&t.model.cfg), Ts = s2s ? cfg->data.max_source_length : 0;
    if (s2s && Ts <= 0)
        s = fl_errorf(FL_ERR_INVALID, "rehearsing an encoder-decoder needs a source length (data.max_source_length)");
    t.sch.B = B;
    t.sch.T = T;
    t.sch.Ts = Ts;
    t.sch.accum = accum;
    t.sch.G = accum * t.dp.world;
    if (s == FL_OK) s = fl_tr_setup_training(&t, &rcfg, &sc);
    if (s == FL_OK) s = fl_tr_tp_attach(&t);
    if (s == FL_OK) s = fl_dp_broadcast_params(&t.dp, &t.opt); /* rank 0's weights everywhere, as DDP starts */
    if (s != FL_OK) goto done;
    /* a step of token 0 everywhere, every target valid (the values do not matter: nothing computes) */
    const size_t per = (size_t)B * T;
    memset(t.buf.ids, 0, (size_t)accum * per * sizeof *t.buf.ids);
    memset(t.buf.tgt, 0, (size_t)accum * per * sizeof *t.buf.tgt);
    for (int k = 0; k < accum; k++) t.buf.mbs[k] = (fl_micro_batch){.ids = t.buf.ids + k * per, .targets = t.buf.tgt + k * per, .B = B, .T = T};
    const size_t pers = (size_t)B * Ts; /* an encoder-decoder's sources: token 0, no padding */
    if (s2s) memset(t.buf.src, 0, (size_t)accum * pers * sizeof *t.buf.src), memset(t.buf.src_mask, 1, (size_t)accum * pers);
    for (int k = 0; s2s && k < accum; k++)
        t.buf.mbs[k].src = t.buf.src + k * pers, t.buf.mbs[k].src_mask = t.buf.src_mask + k * pers, t.buf.mbs[k].Ts = Ts;
    fl_step_result sr;
    long fail_iter;
    s = (t.pp.size > 1 ? train_step_pp : train_step)(&t, 0, (long)(accum * per), cfg->optimizer.lr, &sr, &fail_iter);
    if (s != FL_OK) s = fl_tr_diverged(&t, s, t.st.step + 1, fail_iter);
    if (s != FL_OK || gen_prompt <= 0 || s2s) goto done; /* an encoder-decoder run has no evaluation yet */
    /* the evaluation (validate, then generate_example): one forward without gradients, then the
     * sample, snapshotted at its first token ("eval_generate": the KV cache, the decode scratch,
     * the sampler and its logits held) */
    fl_mem_set_phase(&t.hw.pool, "validation");
    fl_model_lora_set_train(&t.model, 0);
    s = t.pp.size > 1 ? fl_pp_eval(&t.pp.rt, t.buf.ids, t.buf.tgt, B, T) /* the stages in turn; no sample */
                      : fl_model_forward(&t.model, t.buf.ids, t.buf.tgt, B, T, 0.0f, NULL);
    fl_model_lora_set_train(&t.model, 1);
    if (t.pp.size > 1) goto done;
    prompt = calloc((size_t)gen_prompt, sizeof *prompt);
    gen = malloc(((size_t)cfg->eval.max_new_tokens + 1) * sizeof *gen);
    if (s == FL_OK && (!prompt || !gen)) s = fl_errorf(FL_ERR_OOM, "out of host memory");
    int n_out = 0;
    if (s == FL_OK) s = fl_tr_sample_tokens(&t, prompt, gen_prompt, NULL, 0, gen, &n_out, snapshot_eval_generate, &t.hw.pool);
done:
    /* several ranks: a failure anywhere (this rank's OOM under its budget) breaks the group, so the
     * others' next collective fails at once instead of waiting for this rank */
    if (s != FL_OK && t.dp.comm) fl_comm_release_peers(fl_dp_dcomm(&t.dp), fl_error_message());
    if (s != FL_OK && t.tp.world) fl_comm_release_peers(t.tp.world, fl_error_message());
    if (t.hw.pool_ok) result_memory(&t, s, &r);
    if (res) *res = r;
    free(prompt);
    free(gen);
    fl_tr_cleanup_keep_error(&t, s);
    return s;
}

fl_status fl_trainer_run(const fl_run_config *cfg, FILE *out, int progress_bar, fl_step_hook hook, void *hook_ud,
                         fl_trainer_result *res) {
    return fl_trainer_run_comm(cfg, NULL, out, progress_bar, hook, hook_ud, res);
}

/* ---- the run, phase by phase ----------------------------------------------------------------- */

/* What the step loop carries from step to step. */
typedef struct {
    fl_trainer_result r;
    int lead;                 /* rank 0: prints, logs and writes checkpoints */
    int resumed, stopped;
    double val_loss;
    long val_step;            /* the step of the last evaluation in the loop */
    fl_trainer_diverge dv;    /* finite divergence: the loss stays above a uniform guess's */
    double t_start;           /* training time's origin (evaluation time is taken out of it) */
    double train0;            /* a resumed run measures its own steps for the ETA */
    long step0;
    fl_step_hook hook;
    void *hook_ud;
} run_loop;

/* The checks before set-up: they fail alike on every rank. */
static fl_status run_checks(trainer *t, fl_comm *comm, fl_precision *prec) {
    const fl_run_config *cfg = t->cfg;
    FL_TRY(fl_cfg_validate(cfg));
    const int ranks = t->dp.world * (t->tp.size > 1 ? t->tp.size : 1) * (t->pp.size > 1 ? t->pp.size : 1); /* the grid */
    if (cfg->devices * cfg->num_nodes != ranks)
        return fl_errorf(FL_ERR_INVALID, "devices x num_nodes = %d x %d = %d ranks, but this run has %d (%s): give "
                         "--devices %d, or launch %d ranks (mpirun -np %d)", cfg->devices, cfg->num_nodes,
                         cfg->devices * cfg->num_nodes, ranks, comm ? fl_comm_impl_name(comm) : "no communicator",
                         ranks, cfg->devices * cfg->num_nodes, cfg->devices * cfg->num_nodes);
    FL_TRY(fl_precision_find(cfg->precision, prec));
    if (!prec->available)
        return fl_errorf(FL_ERR_UNSUPPORTED, "precision '%s' is not available yet in this build", cfg->precision);
    FL_TRY(fl_trainer_storage(cfg, prec, &t->stg));
    if (!strcmp(cfg->resume, "false") && !cfg->overwrite && fl_tr_dir_has_run(cfg->out_dir))
        return fl_errorf(FL_ERR_INVALID,
                         "out_dir '%s' holds another run (checkpoints or logs); use --resume auto to continue it "
                         "or --overwrite to start over",
                         cfg->out_dir);
    return FL_OK;
}

/* Set-up runs on every rank; its failures are agreed on (fl_dp_agree) at fixed points, so a rank
 * that fails does not leave the others waiting in a collective: every rank returns the lowest failing
 * rank's error. A failure returns with *agreed 0 (the caller agrees for it) unless it came from an
 * agreement. sc, rcfg: the resolved strategy and the configuration with its names (the caller's: the
 * sharding keeps pointing at rcfg). */
static fl_status run_setup(trainer *t, fl_comm *comm, const fl_precision *prec, fl_strategy_choice *sc,
                           fl_run_config *rcfg, int lead, int *resumed, int *agreed) {
    const fl_run_config *cfg = t->cfg;
    fl_status s = FL_OK;
#define AGREE() do { *agreed = 1; FL_TRY(fl_dp_agree(&t->dp, s)); *agreed = 0; } while (0)
    FL_TRY(fl_dp_check_config(&t->dp, cfg)); /* the same command line and recipe on every rank */
    FL_TRY(fl_backend_init_by_name(fl_backend_default_name(), &t->hw.be, cfg->threads));
    t->hw.be_ok = 1;
    FL_TRY(fl_backend_pools_init(&t->hw.be, &t->hw.pool, &t->hw.hpool, t->hw.be.name, cfg->max_memory));
    t->hw.pool_ok = 1;
    fl_dp_init(&t->dp, comm, &t->hw.pool);
    t->dp.be = &t->hw.be; /* the checkpoint streams read and write the backend's memory through it */
    if (t->dp.world > 1 && t->hw.be.comm_create) { /* the device communicator (NCCL): collective set-up */
        AGREE();
        FL_TRY(fl_dp_device_comm(&t->dp, &t->hw.be));
    }
    if (t->dp.world > 1 && !fl_backend_host_memory(&t->hw.be) && !t->dp.dev) /* the host communicator cannot read its memory */
        return fl_errorf(FL_ERR_UNSUPPORTED, "data-parallel training on backend '%s' (whose memory the host cannot "
                         "read) needs a device-memory communicator, which this backend does not have; run one rank, or "
                         "--accelerator cpu", t->hw.be.name);
    /* --strategy auto: the strategy this run uses (fl_cfg_resolve_strategy, as the planner); the
     * sharding code reads it from rcfg, a copy of cfg with the resolved names (cfg, written to
     * hyperparameters.yaml and compared across ranks, keeps what was given) */
    FL_TRY(fl_cfg_resolve_strategy(cfg, t->dp.dev != NULL, sc));
    *rcfg = *cfg;
    snprintf(rcfg->strategy, sizeof rcfg->strategy, "%s", sc->strategy);
    snprintf(rcfg->sharding_strategy, sizeof rcfg->sharding_strategy, "%s", sc->sharding);
    FL_TRY(fl_tr_tp_check(t, sc));
    FL_TRY(fl_tr_setup_offload(t, sc)); /* the host / NVMe tiers, before the model (parameter offload's shards) */
    FL_TRY(fl_fsdp_prepare(&t->dp, rcfg, prec, &t->stg)); /* FULL_SHARD: the model is created sharded */
    FL_TRY(fl_tr_setup_model(t, prec, NULL));
    FL_TRY(fl_tr_check_s2s(t, prec, sc));
    FL_TRY(fl_tr_load_tokenizer(t));
    FL_TRY(fl_tr_load_data(t));
    fl_tr_schedule(t);
    fl_mem_set_phase(&t->hw.pool, "setup");
    if (cfg->command != FL_CMD_FINETUNE_LORA) AGREE(); /* every rank has its model (FULL_SHARD: its shard) before the gradients */
    FL_TRY(fl_tr_setup_training(t, rcfg, sc));
    FL_TRY(fl_tr_tp_attach(t)); /* tensor parallel: the clipping norm and overflow verdicts over the group */
    AGREE(); /* every rank holds its model, data and buffers; nothing was written yet */
    *agreed = 1; /* every rank read rank 0's data (an agreed error names the lowest rank that did not) */
    FL_TRY(fl_tr_check_data(t));
    *agreed = 0;
    if (lead) {
        FL_TRY(fl_fs_mkdir_p(cfg->out_dir));
        fl_ckpt_clean_tmp(cfg->out_dir);
        char gone[512];
        /* start over: the old run's checkpoints went on beside the new one's, and --resume auto took them */
        if (cfg->overwrite && !strcmp(cfg->resume, "false") && fl_ckpt_remove_run(cfg->out_dir, gone, sizeof gone) &&
            t->out)
            fprintf(t->out, "note: --overwrite: the previous run's checkpoints in '%s' removed (%s)\n", cfg->out_dir, gone);
    }
    AGREE(); /* out_dir is ready before any rank looks for checkpoints in it */
    /* the running loss's window: training state, restored by a resume */
    t->st.loss_window = calloc((size_t)t->sch.G, sizeof *t->st.loss_window);
    if (!t->st.loss_window) return fl_errorf(FL_ERR_OOM, "out of host memory");
    t->st.loss_window_size = t->sch.G;
    FL_TRY(fl_tr_resume(t, resumed)); /* every rank reads the same checkpoint (a shared file system) */
    fl_model_sync_compute_copy(&t->model); /* resumed master weights -> compute copy */
    AGREE();
    FL_TRY(fl_dp_broadcast_params(&t->dp, &t->opt)); /* rank 0's weights everywhere, as DDP starts */
    if (lead) FL_TRY(fl_tr_save_base(t, 1, *resumed)); /* LoRA on random weights: the base its adapters name */
    if (lead) FL_TRY(fl_metrics_open(&t->metrics, cfg->out_dir, cfg->logger_name, *resumed, *resumed ? t->st.iter : -1));
    t->metrics.ranks = t->dp.world; /* tokens = total_tokens / the data-parallel ranks */
    AGREE();
#undef AGREE
    return FL_OK;
}

/* Fetch the step's G global micro-batches: every rank walks the whole stream (so the loader
 * position, token counters and the valid-target count are global everywhere) and keeps
 * j % world == rank in its slot j / world. *step_valid: the step's valid targets. */
/* fetch_step for an encoder-decoder: the pairs' batches, global micro-batch j kept by rank j % world in its slot
 * j / world (as fetch_step). */
static fl_status fetch_step_s2s(trainer *t, long *step_valid) {
    const size_t per = (size_t)t->sch.B * t->sch.T, pers = (size_t)t->sch.B * t->sch.Ts;
    *step_valid = 0;
    for (int j = 0; j < t->sch.G; j++) {
        fl_s2s_batch b;
        int ne;
        FL_TRY(fl_s2s_loader_next(t->in.s2s_train, &b, &ne));
        fl_loader_state lk;
        fl_s2s_loader_get_state(t->in.s2s_train, &lk);
        t->buf.mb_epoch[j] = (long)lk.epoch;
        long real = 0, valid = 0;
        for (size_t i = 0; i < (size_t)b.B * b.Ts; i++) real += b.src_mask[i] != 0;
        for (size_t i = 0; i < (size_t)b.B * b.Tt; i++) valid += b.labels[i] != FL_IGNORE_INDEX;
        t->buf.mb_tokens[j] = (long long)b.B * (b.Ts + b.Tt);
        *step_valid += valid;
        t->st.tokens_real += real + valid;
        t->st.tokens_prompt += real;
        t->st.tokens_padded += t->buf.mb_tokens[j];
        t->st.flops += fl_model_train_flops_s2s(&t->model.cfg, b.B, b.Ts, b.Tt);
        if (!fl_dp_mine(&t->dp, j)) continue;
        const int k = j / t->dp.world;
        int32_t *di = t->buf.ids + (size_t)k * per, *dt = t->buf.tgt + (size_t)k * per, *ds = t->buf.src + (size_t)k * pers;
        uint8_t *dm = t->buf.src_mask + (size_t)k * pers;
        memcpy(di, b.dec_in, (size_t)b.B * b.Tt * sizeof *di);
        memcpy(dt, b.labels, (size_t)b.B * b.Tt * sizeof *dt);
        memcpy(ds, b.src, (size_t)b.B * b.Ts * sizeof *ds);
        memcpy(dm, b.src_mask, (size_t)b.B * b.Ts);
        t->buf.mbs[k] = (fl_micro_batch){.ids = di, .targets = dt, .B = b.B, .T = b.Tt, .src = ds, .src_mask = dm, .Ts = b.Ts};
    }
    return FL_OK;
}

static fl_status fetch_step(trainer *t, long *step_valid) {
    if (t->in.s2s_train) return fetch_step_s2s(t, step_valid);
    const size_t per = (size_t)t->sch.B * t->sch.T;
    *step_valid = 0;
    for (int j = 0; j < t->sch.G; j++) {
        fl_batch b;
        int ne;
        FL_TRY(fl_loader_next(t->in.train, &b, &ne));
        fl_loader_state lk;
        fl_loader_get_state(t->in.train, &lk);
        t->buf.mb_epoch[j] = (long)lk.epoch; /* the loader moves to the next epoch when it wraps */
        t->buf.mb_tokens[j] = b.padded_tokens;
        *step_valid += b.target_tokens;
        t->st.tokens_real += b.real_tokens;
        t->st.tokens_prompt += b.prompt_tokens;
        t->st.tokens_padded += b.padded_tokens;
        t->st.flops += fl_model_train_flops(&t->model.cfg, b.B, b.T);
        if (!fl_dp_mine(&t->dp, j)) continue;
        int k = j / t->dp.world;
        int32_t *di = t->buf.ids + (size_t)k * per, *dt = t->buf.tgt + (size_t)k * per;
        memcpy(di, b.ids, (size_t)b.B * b.T * sizeof *di);
        memcpy(dt, b.targets, (size_t)b.B * b.T * sizeof *dt);
        t->buf.mbs[k] = (fl_micro_batch){.ids = di, .targets = dt, .B = b.B, .T = b.T};
    }
    return FL_OK;
}

/* The step's G iterations into the log, each rank's (loss sum, valid) per micro-batch gathered first:
 * the running loss, the printed line every train.log_interval iterations, the metrics row.
 * tokens0: padded tokens before the step; *step_loss: the step's summed loss. */
static fl_status log_iterations(trainer *t, run_loop *L, float lr, long long tokens0, unsigned long long sent0,
                                double *step_loss) {
    const fl_run_config *cfg = t->cfg;
    const int slots = FL_TR_MB_SLOTS * t->sch.accum; /* a rank's (loss sum, valid) per k, then its ms per k */
    /* every rank's (loss sum, valid) and wall ms per micro-batch, for the log, the step loss and each row's iter_time */
    FL_TRY(fl_dp_gather(&t->dp, t->buf.mb_stats + (size_t)t->dp.rank * slots, slots, t->buf.mb_stats));
    const double step_sent = (double)(fl_dp_sent(&t->dp) - sent0);
    if (t->dp.world > 1) L->r.comm_sent_last_step = (unsigned long long)step_sent;
    int timed_k = -1; /* the round whose time a printed line has shown */
    *step_loss = 0;
    for (int j = 0; j < t->sch.G; j++) {
        int k = j / t->dp.world;
        const double *rk = t->buf.mb_stats + (size_t)(j % t->dp.world) * slots, *st = rk + 2 * k;
        double ls_k = st[0];
        long nv_k = (long)st[1];
        int last = j == t->sch.G - 1;
        t->st.iter++;
        tokens0 += t->buf.mb_tokens[j]; /* tokens through this iteration */
        *step_loss += ls_k;
        double it_loss = nv_k > 0 ? ls_k / nv_k : NAN;
        /* the running mean over the last G iterations (LitGPT's RunningMean; part of the training state, so that a
         * resumed run logs what the uninterrupted one does); a fully masked micro-batch has no loss */
        double *win = t->st.loss_window;
        if (nv_k > 0) win[t->st.loss_window_n++ % t->st.loss_window_size] = it_loss;
        double run = 0;
        long cnt = t->st.loss_window_n < t->st.loss_window_size ? t->st.loss_window_n : t->st.loss_window_size;
        for (long q = 0; q < cnt; q++) run += win[q];
        run = cnt ? run / cnt : NAN;
        L->r.last_loss = run;
        double it_time = rk[2 * t->sch.accum + k] / 1e3; /* the micro-batch on the rank that ran it */
        if (t->st.iter % cfg->train.log_interval) continue;
        long step_now = t->st.step + (last ? 1 : 0);
        char vbuf[32];
        if (isnan(L->val_loss)) snprintf(vbuf, sizeof vbuf, "n/a");
        else snprintf(vbuf, sizeof vbuf, "%.3f", L->val_loss);
        fl_tr_bar_clear(t);
        /* several ranks: the iterations of one round ran at once, one per rank: the time printed once, on the round's
         * first printed line (that rank's; each iteration's row in metrics.csv holds its own rank's) */
        char tbuf[64];
        if (timed_k != k) snprintf(tbuf, sizeof tbuf, "iter time: %.2f ms", it_time * 1e3);
        else snprintf(tbuf, sizeof tbuf, "rank %d's micro-batch, in parallel with iter %ld", j % t->dp.world,
                      t->st.iter - j % t->dp.world);
        timed_k = k;
        char lbuf[40]; /* no loss yet: every micro-batch so far was fully masked (metrics.csv leaves the cell empty) */
        if (isnan(run)) snprintf(lbuf, sizeof lbuf, "n/a (no target tokens)");
        else snprintf(lbuf, sizeof lbuf, "%.3f", run);
        if (t->out)
            fprintf(t->out, "Epoch %lld | iter %ld step %ld | loss train: %s, val: %s | %s%s\n",
                    (long long)t->buf.mb_epoch[j] + 1, t->st.iter, step_now, lbuf, vbuf, tbuf, last ? " (step)" : "");
        /* total_tokens: every rank's padded tokens through this iteration (LitGPT's iter_num x micro batch x T x world
         * size; metrics.c writes tokens, this rank's share); tok_s: this micro-batch's on its rank */
        fl_metrics_values mv = {.iter = t->st.iter, .step = step_now, .epoch = t->buf.mb_epoch[j], .loss = run,
                                .iter_time = it_time, .learning_rate = lr, .val_loss = NAN,
                                .tok_s = t->buf.mb_tokens[j] / (it_time > 0 ? it_time : 1e-9), .total_tokens = tokens0};
        fl_tr_mem_values(&t->hw.pool, &mv);
        if (last && t->dp.world > 1) mv.comm_sent = step_sent;
        fl_metrics_row(&t->metrics, &mv);
    }
    return FL_OK;
}

/* The divergence detector's running state kept in the training state (saved with every checkpoint), and taken back
 * from a resumed one (an older checkpoint's has none: the detector starts afresh). */
static void dv_keep(trainer *t, const fl_trainer_diverge *d) {
    t->st.dv_set = 1;
    t->st.dv_ema = d->ema, t->st.dv_above = d->above, t->st.dv_since = d->since, t->st.dv_last_good = d->last_good;
}

static void dv_restore(fl_trainer_diverge *d, const fl_train_state *st) {
    if (!st->dv_set) return;
    d->ema = st->dv_ema, d->above = st->dv_above, d->since = st->dv_since, d->last_good = st->dv_last_good;
}

/* The step's loss judged: a non-finite one that fp16 loss scaling let through, finite divergence,
 * an update the loss scale skipped (said). */
static fl_status check_step(trainer *t, run_loop *L, const fl_step_result *sr, double step_loss, long step_valid) {
    const fl_run_config *cfg = t->cfg;
    if (!isfinite(step_loss) && !sr->skipped) { /* fp16 loss scaling let a non-finite loss through */
        fl_status s = fl_errorf(FL_ERR_NONFINITE, "the loss is %s", isnan(step_loss) ? "NaN" : "inf");
        FL_TRY(fl_tr_diverged(t, s, t->st.step + 1, t->st.iter));
    }
    if (cfg->train.divergence_check && step_valid > 0 && !sr->skipped &&
        fl_trainer_diverge_train(&L->dv, t->st.step + 1, step_loss / (double)step_valid))
        FL_TRY(fl_trainer_diverge_error(&L->dv, cfg->out_dir, cfg->optimizer.lr, t->st.step + 1, t->st.iter));
    dv_keep(t, &L->dv);
    if (sr->skipped && t->out) { /* loss scaling: overflow, the update was skipped and the scale halved */
        fl_tr_bar_clear(t);
        fprintf(t->out, "step %ld: inf/NaN in the fp16 gradients: update skipped, loss scale -> %g\n", t->st.step + 1,
                (double)sr->loss_scale);
    }
    return FL_OK;
}

/* Every eval.interval steps: the validation loss, the sample, the metrics row; its time is not
 * training time. */
static fl_status evaluate(trainer *t, run_loop *L) {
    const fl_run_config *cfg = t->cfg;
    double e0 = fl_tr_now_s();
    FL_TRY(fl_tr_diverged(t, fl_tr_validate(t, cfg->eval.max_iters, &L->val_loss), t->st.step, t->st.iter));
    fl_tr_bar_clear(t);
    FL_TRY(t->in.s2s ? fl_tr_generate_example_s2s(t) : fl_tr_generate_example(t));
    if (t->out)
        fprintf(t->out, "iter %ld: val loss %.4f, val time: %.2f ms\n", t->st.iter, L->val_loss, (fl_tr_now_s() - e0) * 1e3);
    if (cfg->train.divergence_check && fl_trainer_diverge_val(&L->dv, t->st.step, L->val_loss))
        FL_TRY(fl_trainer_diverge_error(&L->dv, cfg->out_dir, cfg->optimizer.lr, t->st.step, t->st.iter));
    dv_keep(t, &L->dv);
    fl_tr_val_row(t, L->val_loss);
    L->val_step = t->st.step;
    L->t_start += fl_tr_now_s() - e0; /* evaluation time is not training time */
    return FL_OK;
}

/* The step hook: it reads the trained parameters on the host (a copy when they are device memory;
 * FULL_SHARD with hook_whole_params: the whole parameters gathered, collectively: every rank has a hook,
 * else the shard). stop[0] := it asks to stop, stop[2] := for this step's checkpoint too. */
static fl_status call_hook(trainer *t, run_loop *L, double step_loss, long step_valid, double *stop) {
    const fl_run_config *cfg = t->cfg;
    size_t pb = t->opt.w.n * fl_dtype_size(t->opt.w.pt);
    void *hp = NULL;
    const int whole = t->dp.fsdp && cfg->hook_whole_params;
    if (whole) {
        FL_TRY(fl_fsdp_whole_params(&t->dp, &hp, &pb));
    } else if (!t->opt.home.params_host) { /* (parameter offload: the shard is host memory already) */
        hp = fl_backend_host_memory(&t->hw.be) ? NULL : malloc(pb + 1);
        if (!fl_backend_host_memory(&t->hw.be) && !hp) return fl_errorf(FL_ERR_OOM, "out of host memory");
    }
    fl_status s = hp && !whole ? FL_RUN(&t->hw.be, to_host, hp, t->opt.w.p, pb) : FL_OK;
    if (s == FL_OK) {
        int h = L->hook(L->hook_ud, t->st.step, step_valid ? step_loss / step_valid : NAN, hp ? hp : t->opt.w.p, pb);
        stop[0] = h > 0;
        stop[2] = h > 1;
    }
    free(hp);
    return s;
}

/* After evaluation and checkpointing (so a hook that stops the run acts like a crash right after this
 * step's checkpoint), stopping is decided together: a hook (Ctrl-C) or the time budget on any rank stops
 * all; a hook that returns 2 (a signal under train.save_on_signal) asks for this step's checkpoint.
 * *brk: leave the loop (L->stopped: without the final evaluation and final/). */
static fl_status decide_stop(trainer *t, run_loop *L, double step_loss, long step_valid, int saved, int *brk) {
    const fl_run_config *cfg = t->cfg;
    double stop[3] = {0, cfg->train.max_time > 0 && t->st.train_seconds >= cfg->train.max_time, 0};
    if (L->hook) FL_TRY(call_hook(t, L, step_loss, step_valid, stop));
    FL_TRY(fl_tr_sum_all(t, stop, 3)); /* tensor parallel: a group's ranks time their steps apart */
    if (stop[0] > 0) {
        /* not while the loss is above the divergence limit: that checkpoint would be a bad one */
        if (stop[2] > 0 && !saved && !fl_trainer_diverge_suspect(&L->dv)) FL_TRY(fl_tr_save_step(t, L->lead, 1));
        L->stopped = 1;
        *brk = 1;
    } else if (stop[1] > 0) {
        /* the time budget ends the run like max_steps would: final validation and final/ */
        fl_tr_bar_clear(t);
        if (t->out)
            fprintf(t->out, "train.max_time (%g s) reached after step %ld of %ld (%.1f s of training): finishing\n",
                    (double)cfg->train.max_time, t->st.step, t->sch.max_steps, t->st.train_seconds);
        *brk = 1;
    }
    return FL_OK;
}

/* One iteration of the loop: fetch, step, log, judge, the first step's memory report, evaluation,
 * checkpoint, the stop decision. *brk: the loop ends here. */
static fl_status loop_step(trainer *t, run_loop *L, int *brk) {
    const fl_run_config *cfg = t->cfg;
    fl_loader_state ls;
    fl_tr_loader_get_state(t, &ls);
    if ((cfg->train.epochs > 0 && ls.epoch >= cfg->train.epochs) ||
        (cfg->train.max_tokens > 0 && t->st.tokens_real >= cfg->train.max_tokens)) {
        *brk = 1;
        return FL_OK;
    }
    long step_valid;
    const long long tokens0 = t->st.tokens_padded; /* before this step: the log counts iteration by iteration */
    const long iter0 = t->st.iter;                  /* global micro-batches before this step */
    FL_TRY(fetch_step(t, &step_valid));
    float lr = (float)fl_lr_schedule(cfg->optimizer.lr, cfg->train.min_lr, t->st.step, t->sch.warmup, t->sch.max_steps);
    const unsigned long long sent0 = fl_dp_sent(&t->dp); /* this rank's traffic before the step: the step's bytes go to the log */
    double step_loss;
    fl_step_result sr;
    long fail_iter;
    fl_status s = (t->pp.size > 1 ? train_step_pp : train_step)(t, iter0, step_valid, lr, &sr, &fail_iter);
    if (s != FL_OK) return fl_tr_diverged(t, s, t->st.step + 1, fail_iter); /* a divergence says where and what to try */
    FL_TRY(log_iterations(t, L, lr, tokens0, sent0, &step_loss));
    FL_TRY(check_step(t, L, &sr, step_loss, step_valid));
    t->st.step++;
    fl_tr_loader_get_state(t, &t->st.loader);
    t->st.train_seconds = fl_tr_now_s() - L->t_start;
    if (t->st.step == 1 && t->out && !L->resumed) fl_tr_print_memory(t);
    if (t->st.step % cfg->eval.interval == 0 && fl_tr_has_val(t)) FL_TRY(evaluate(t, L));
    const int saved = cfg->train.save_interval > 0 && t->st.step % cfg->train.save_interval == 0;
    if (saved) FL_TRY(fl_tr_save_step(t, L->lead, !fl_trainer_diverge_suspect(&L->dv)));
    FL_TRY(decide_stop(t, L, step_loss, step_valid, saved, brk));
    if (!*brk)
        fl_tr_bar_draw(t, t->st.step,
                       fl_trainer_eta(t->st.train_seconds - L->train0, t->st.step - L->step0, t->sch.max_steps - t->st.step,
                                      cfg->train.max_time, t->st.train_seconds));
    return FL_OK;
}

/* The end of a run that was not stopped: the final evaluation (unless the last step's covered every
 * validation batch with these weights: no second, identical row in the log), the weights checked,
 * final/ (LoRA: the merged model, final/adapter the PEFT adapter). */
static fl_status finish(trainer *t, run_loop *L) {
    const fl_run_config *cfg = t->cfg;
    fl_trainer_result *r = &L->r;
    long n_val = fl_tr_val_batches(t);
    int have_final = L->val_step == t->st.step && cfg->eval.max_iters >= n_val;
    if (cfg->eval.final_validation && fl_tr_has_val(t)) {
        if (!have_final) FL_TRY(fl_tr_diverged(t, fl_tr_validate(t, (int)n_val, &L->val_loss), t->st.step, t->st.iter));
        r->val_loss = L->val_loss;
        if (t->out) fprintf(t->out, "Final evaluation | val loss: %.3f | val ppl: %.3f\n", L->val_loss,
                            fl_trainer_perplexity(L->val_loss));
        if (cfg->train.divergence_check && fl_trainer_diverge_val(&L->dv, t->st.step, L->val_loss))
            FL_TRY(fl_trainer_diverge_error(&L->dv, cfg->out_dir, cfg->optimizer.lr, t->st.step, t->st.iter));
        dv_keep(t, &L->dv);
        if (!have_final) fl_tr_val_row(t, L->val_loss);
    }
    FL_TRY(fl_tr_pp_report(t)); /* pipeline parallel: the stages' times and the schedule on them */
    fl_mem_set_phase(&t->hw.pool, "checkpoint");
    FL_TRY(fl_tr_diverged(t, fl_tr_check_weights(t), t->st.step, t->st.iter));
    /* LoRA: the lead merges (tensor parallel: every rank its slice, gathered merged; pipeline stages: stage 0 merges
     * the gathered adapters into the gathered base, fl_tr_pp_save) */
    if (L->lead) FL_TRY(fl_tr_save_base(t, 0, 0)); /* LoRA on random weights: the base final/adapter names, unmerged */
    if (t->model.lora && t->pp.size <= 1 && (L->lead || t->tp.size > 1)) FL_TRY(fl_model_lora_merge(&t->model));
    if (t->tp.size > 1) FL_TRY(fl_tr_tp_save(t, L->lead, "final", t->model.lora ? NULL : &t->opt,
                                             t->model.lora ? NULL : &t->st));
    else if (t->pp.size > 1) FL_TRY(fl_tr_pp_save(t, L->lead, "final", t->model.lora ? NULL : &t->opt,
                                                  t->model.lora ? NULL : &t->st));
    else FL_TRY(fl_dp_ckpt_save(&t->dp, L->lead, cfg->out_dir, "final", &t->model, t->model.lora ? NULL : &t->opt,
                                t->model.lora ? NULL : &t->st, fl_tr_saved_cfg(t), t->in.tok_dir[0] ? t->in.tok_dir : NULL));
    snprintf(r->final_dir, sizeof r->final_dir, "%s/final", cfg->out_dir);
    /* fl_ckpt_save wrote final/adapter (the PEFT adapter) with final/ */
    if (t->model.lora && L->lead && t->out) fprintf(t->out, "Saved the PEFT adapter to '%s/adapter'\n", r->final_dir);
    if (t->out) fprintf(t->out, "Saved the final model to '%s'\n", r->final_dir);
    return FL_OK;
}

/* The loop from the initial validation to the result box. */
static fl_status run_loop_all(trainer *t, run_loop *L) {
    const fl_run_config *cfg = t->cfg;
    if (cfg->eval.initial_validation) {
        FL_TRY(fl_tr_validate(t, cfg->eval.max_iters, &L->val_loss));
        if (t->out) fprintf(t->out, "initial validation | val loss: %.3f | val ppl: %.3f\n", L->val_loss,
                            fl_trainer_perplexity(L->val_loss));
    }
    fl_trainer_diverge_init(&L->dv, t->model.cfg.vocab_size, t->sch.warmup);
    dv_restore(&L->dv, &t->st); /* resumed: where the checkpoint's run had it */
    L->t_start = fl_tr_now_s() - t->st.train_seconds;
    L->train0 = t->st.train_seconds;
    L->step0 = t->st.step;
    int brk = 0;
    while (t->st.step < t->sch.max_steps && !brk) FL_TRY(loop_step(t, L, &brk));
    fl_tr_bar_clear(t);
    L->r.steps = t->st.step;
    L->r.iters = t->st.iter;
    L->r.train_seconds = t->st.train_seconds;
    L->r.tokens_real = t->st.tokens_real;
    L->r.tokens_prompt = t->st.tokens_prompt;
    L->r.tokens_padded = t->st.tokens_padded;
    if (!L->stopped) FL_TRY(finish(t, L));
    result_memory(t, FL_OK, &L->r);
    fl_tr_print_box(t, &L->r);
    return FL_OK;
}

fl_status fl_trainer_run_comm(const fl_run_config *cfg, fl_comm *comm, FILE *out, int progress_bar, fl_step_hook hook,
                              void *hook_ud, fl_trainer_result *res) {
    trainer t;
    trainer_begin(&t, cfg, comm);
    fl_comm *world = comm;
    fl_status s = fl_tr_tp_begin(&t, world, NULL, &comm); /* tensor parallel: comm := the data-parallel axis */
    if (s != FL_OK) {
        fl_tr_tp_end(&t);
        if (res) { /* the grid's checks (sizes, shapes, options) fail alike on every rank before any collective: rank 0
                    * reports them; a split's failure (I/O, memory) is this rank's own */
            memset(res, 0, sizeof *res);
            res->val_loss = NAN;
            res->error_all_ranks = s == FL_ERR_INVALID || s == FL_ERR_UNSUPPORTED || s == FL_ERR_NOT_FOUND;
        }
        return s;
    }
    run_loop L;
    memset(&L, 0, sizeof L);
    L.lead = fl_tr_tp_lead(&t); /* only rank 0 prints, logs and writes checkpoints */
    L.val_loss = NAN;
    L.val_step = -1;
    L.hook = hook;
    L.hook_ud = hook_ud;
    if (!L.lead) out = NULL;
    t.out = out;
    t.bar = progress_bar && out;
    L.r.val_loss = NAN;
    L.r.error_all_ranks = 1; /* the checks before set-up fail alike on every rank */
    if (res) *res = L.r;
    fl_precision prec;
    s = run_checks(&t, world, &prec);
    if (s != FL_OK) {
        fl_tr_tp_end(&t);
        return s;
    }
    fl_strategy_choice sc;
    fl_run_config rcfg;
    int agreed = 0, in_setup = 1;
    s = run_setup(&t, comm, &prec, &sc, &rcfg, L.lead, &L.resumed, &agreed);
    if (s == FL_OK) {
        in_setup = 0;
        fl_tr_print_header(&t, world, &prec, &sc);
        s = run_loop_all(&t, &L);
    }
    if (s != FL_OK && in_setup && !agreed) s = fl_dp_agree(&t.dp, s); /* meet the others' next agreement */
    /* no agreement follows: peers that are threads would wait in their next collective */
    if (s != FL_OK && !in_setup && t.dp.comm) fl_comm_release_peers(fl_dp_dcomm(&t.dp), fl_error_message());
    if (s != FL_OK && !in_setup && t.tp.world) fl_comm_release_peers(t.tp.world, fl_error_message());
    L.r.error_all_ranks = in_setup;
    if (t.hw.pool_ok) result_memory(&t, s, &L.r); /* also on failure: what was reached, and the OOM record */
    if (t.opt.model && t.opt.amp.on) {
        L.r.loss_scale = t.opt.amp.ls.scale;
        L.r.skipped_steps = (long)t.opt.amp.ls.n_skipped;
    }
    if (res) *res = L.r;
    fl_tr_cleanup_keep_error(&t, s);
    return s;
}

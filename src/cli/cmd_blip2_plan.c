/* `fitllm plan` and `fitllm bench-step` on BLIP-2 (a folder or a preset: blip2-opt-2.7b, ...): image-caption
 * fine-tuning's memory and speed. Both run the fine-tuning's own set-up and steps (the library's fl_blip2_train, a
 * rehearsal: fitllm/blip2_train.h) on synthetic captions of L tokens: plan on the null backend (no memory touched, nothing
 * computed: the pool's allocations, budget check, snapshots and OOM record are the run's own, so planned = measured
 * per tag when the captions are L tokens long), bench-step on the real backend with random pixels and ids. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "core/fs.h"
#include "fitllm/blip2.h"
#include "fitllm/blip2_train.h"
#include "fitllm/plan.h"

/* A BLIP-2 folder (config.json, model_type blip-2) or a BLIP-2 preset name. */
int fl_cli_is_blip2(const char *name) {
    fl_blip2_config c;
    if (!name || !name[0]) return 0;
    if (fl_blip2_is_folder(name)) return 1;
    return !fl_fs_is_dir(name) && !fl_fs_is_file(name) && fl_blip2_preset(name, &c) == FL_OK;
}

static fl_status resolve(const char *name, fl_blip2_config *c, const char **src) {
    if (fl_blip2_is_folder(name)) {
        char path[4096];
        FL_TRY(fl_fs_join(path, sizeof path, name, "config.json"));
        *src = "BLIP-2 config.json";
        return fl_blip2_config_load(path, c);
    }
    *src = "BLIP-2 preset";
    return fl_blip2_preset(name, c);
}

/* The caption length planned: --seq-len, else train.max_seq_length (default 50, the lab's), capped as the trainer caps
 * it (OPT: the context less the query rows). */
static int caption_len(const fl_run_config *c, const fl_blip2_config *bc, int seq_len) {
    int L = seq_len > 0 ? seq_len : c->train.max_seq_length > 0 ? c->train.max_seq_length : 50;
    if (!fl_model_is_s2s(&bc->text) && L > bc->text.max_seq - bc->n_queries) L = bc->text.max_seq - bc->n_queries;
    return L;
}

/* One rehearsal on the null backend standing in for the CPU or a GPU; 1 fits, 0 out of memory, -1 another error. */
static int rehearse(const fl_run_config *c, const fl_blip2_config *bc, int cuda, size_t budget, int L, int world,
                    int rank, fl_blip2_train_result *rec, fl_status *err) {
    memset(rec, 0, sizeof *rec);
    fl_backend be;
    fl_status s = fl_null_backend_init_for(&be, cuda ? "cuda" : "cpu");
    if (s == FL_OK) {
        const fl_blip2_train_opts o = {.shape = bc, .be = &be, .budget = budget, .synth_len = L, .rehearse_steps = 1,
                                       .plan_world = world, .plan_rank = rank};
        s = fl_blip2_train(c, &o, rec);
        fl_null_backend_free(&be);
    }
    if (err) *err = s;
    return s == FL_OK ? 1 : s == FL_ERR_OOM && rec->oom.valid ? 0 : -1;
}

#define note(...) fl_plan_note(__VA_ARGS__)

/* The plan's header: the shape, the run, the parts. */
static void describe(fl_plan *p, const fl_run_config *c, const fl_blip2_config *bc, const char *src, int L, int B,
                     int accum) {
    p->model = bc->text;
    snprintf(p->model.name, sizeof p->model.name, "%.63s", c->checkpoint_dir);
    snprintf(p->model_source, sizeof p->model_source, "%s", src);
    p->n_params = fl_blip2_param_count(bc);
    const int s2s = fl_model_is_s2s(&bc->text), NQ = bc->n_queries;
    p->B = B, p->accum = accum, p->global_batch = B * accum, p->devices = 1;
    p->T = s2s ? L : NQ + L;
    p->Ts = s2s ? NQ : 0;
    snprintf(p->precision, sizeof p->precision, "%s", c->precision);
    snprintf(p->optimizer, sizeof p->optimizer, "%s%s", fl_optim_name(c->optimizer.kind),
             c->optimizer.kind == FL_OPT_SGD && c->optimizer.momentum != 0.0f ? "+momentum" : "");
    note(p, "BLIP-2: vision tower %zu parameters (%dx%d images, %d patches), Q-Former %zu (%d queries), language model "
            "%zu (%s)", fl_sizing_param_count(&bc->vision), bc->vision.image_size, bc->vision.image_size,
         bc->vision.max_seq - 1, fl_sizing_param_count(&bc->qformer), NQ, fl_sizing_param_count(&bc->text),
         fl_arch_get(bc->text.arch)->display);
    note(p, "captions of %d tokens (%s%s): the trainer sizes each micro-batch for its longest caption, cut to "
            "train.max_seq_length, so shorter captions need less; %s", L, s2s ? "with EOS, " : "with BOS, ",
         c->train.max_seq_length > 0 ? "train.max_seq_length" : "the lab's 50",
         s2s ? "the source is the query placeholders" : "the language model reads the queries' rows and the caption");
}

static void copy_rec(fl_plan *p, const fl_blip2_train_result *r) {
    p->n_phases = r->n_phases < FL_PLAN_MAX_PHASES ? r->n_phases : FL_PLAN_MAX_PHASES;
    memcpy(p->phases, r->phases, (size_t)p->n_phases * sizeof *p->phases);
    memcpy(p->peak, r->peak, sizeof p->peak);
    p->peak_total = r->peak_total;
    p->offload = r->offload; /* CPU offload: the optimizer state in the host tier, outside the budget */
    memcpy(p->host_peak, r->host_peak, sizeof p->host_peak);
    p->host_peak_total = r->host_peak_total;
    p->nvme = r->nvme; /* NVMe offload: the disk tier */
    memcpy(p->nvme_peak, r->nvme_peak, sizeof p->nvme_peak);
    p->nvme_peak_total = r->nvme_peak_total;
}

int fl_cli_blip2_plan(const fl_run_config *cfg, size_t device_memory, int seq_len, int json, int cuda, int rank) {
    const char *cmd = "plan";
    fl_blip2_config bc;
    const char *src = "";
    fl_status s = resolve(cfg->checkpoint_dir, &bc, &src);
    int B = 1, accum = 1;
    const int world = cfg->devices * cfg->num_nodes;
    fl_run_config one = *cfg; /* DDP: one rank's run is one process with its share of the step's micro-batches */
    if (s == FL_OK) {
        B = cfg->train.micro_batch_size > 0 ? cfg->train.micro_batch_size : 1;
        const int gb = cfg->train.global_batch_size > 0 ? cfg->train.global_batch_size : B;
        if (gb % (B * world))
            s = fl_errorf(FL_ERR_INVALID, "train.global_batch_size %d is not divisible by devices x micro_batch_size = "
                          "%d x %d", gb, world, B);
        accum = gb / (B * world);
        /* HYBRID_SHARD: the ranks rehearsed keep their nodes (the shards within a node's --devices ranks) */
        if (!fl_cfg_hybrid_shard(cfg->strategy, cfg->sharding_strategy)) one.devices = one.num_nodes = 1;
        one.train.global_batch_size = B * accum;
    }
    int stage = 0;
    const int fsdp = world > 1 && fl_cfg_zero_stage(cfg->strategy, cfg->sharding_strategy, &stage) == FL_OK &&
                     stage == 3 && cfg->command != FL_CMD_FINETUNE_LORA;
    if (s == FL_OK && rank && !fsdp)
        s = fl_errorf(FL_ERR_UNSUPPORTED, "--rank %d: a BLIP-2 plan is rank 0's, except under FULL_SHARD (--strategy fsdp "
                      "or deepspeed_stage_3 with --devices N: the ranks' shards differ)", rank);
    if (s == FL_OK && cfg->tensor_parallel > 1)
        s = fl_errorf(FL_ERR_UNSUPPORTED, "--tensor_parallel %d: BLIP-2 fine-tuning runs data-parallel (DDP) only so far",
                      cfg->tensor_parallel);
    cfg = &one;
    fl_plan *p = s == FL_OK ? calloc(1, sizeof *p) : NULL;
    if (s == FL_OK && !p) s = fl_errorf(FL_ERR_OOM, "out of host memory");
    if (s != FL_OK) {
        fprintf(stderr, "fitllm %s: error: %s\n", cmd, fl_error_message());
        return s == FL_ERR_INVALID || s == FL_ERR_UNSUPPORTED || s == FL_ERR_NOT_FOUND ? FL_EXIT_USAGE : FL_EXIT_RUNTIME;
    }
    const int L = caption_len(cfg, &bc, seq_len);
    describe(p, cfg, &bc, src, L, B, accum);
    if (world > 1 && fl_cfg_zero_stage(cfg->strategy, cfg->sharding_strategy, &stage) == FL_OK && (stage == 1 || stage == 2)) {
        p->devices = world;
        note(p, "ZeRO-%d over %d ranks: each rank holds the whole model and its gradients, the optimizer state of its "
                "chunk of each trained part (this plan is rank 0's) and runs %d of the step's %d micro-batches (the "
                "reductions' MPI scratch is outside the pool)", stage, world, accum, accum * world);
    } else if (world > 1 && stage == 3 && cfg->command != FL_CMD_FINETUNE_LORA) {
        p->devices = world;
        const int hy = fl_cfg_hybrid_shard(cfg->strategy, cfg->sharding_strategy) && cfg->num_nodes > 1;
        note(p, "%s over %d ranks%s: each rank holds its shard of every part's parameters, gradients and optimizer "
                "state (the units: each part's embeddings / queries / patch embedding, each block, its last group), "
                "gathers a unit around its use (GATHER) and runs %d of the step's %d micro-batches; this plan is rank "
                "%d's (--rank), the ranks rehearsed as threads (the reductions' MPI scratch is outside the pool)",
             hy ? "HYBRID_SHARD" : "FULL_SHARD", world, hy ? " (sharded within each node's --devices ranks, "
             "replicated across the nodes)" : "", accum, accum * world, rank);
    } else if (world > 1) {
        p->devices = world;
        note(p, "DDP over %d ranks: each rank holds the whole model, its gradients and optimizer state and runs %d of "
                "the step's %d micro-batches (this plan is one rank's; the reductions' MPI scratch is outside the pool)",
             world, accum, accum * world);
    }
    p->budget = device_memory ? device_memory : cfg->max_memory;
    fl_blip2_train_result rec;
    int fits = rehearse(cfg, &bc, cuda, 0, L, world, rank, &rec, &s); /* what the run needs */
    if (fits < 0) {
        fprintf(stderr, "fitllm %s: error: %s\n", cmd, fl_error_message());
        free(p);
        return s == FL_ERR_INVALID || s == FL_ERR_UNSUPPORTED || s == FL_ERR_NOT_FOUND ? FL_EXIT_USAGE : FL_EXIT_RUNTIME;
    }
    copy_rec(p, &rec);
    note(p, "trains %s%s (--blip2.train), %zu parameters",
             cfg->blip2_train[0] ? cfg->blip2_train : cfg->command == FL_CMD_FINETUNE_LORA ? "lm" : "qformer,lm",
             cfg->command == FL_CMD_FINETUNE_LORA ? " (LoRA adapters)" : "", rec.trained);
    p->verdict = FL_PLAN_FITS;
    p->max_micro_batch_size = -1;
    if (!p->budget) {
        note(p, "no budget given (--device-memory or --max-memory): the plan cannot say whether it fits");
    } else {
        fits = rehearse(cfg, &bc, cuda, p->budget, L, world, rank, &rec, NULL);
        if (!fits) fl_plan_set_oom(p, &rec.oom, rec.n_phases, 1);
        p->verdict = fits == 1 ? FL_PLAN_FITS : FL_PLAN_OOM;
        /* the largest micro-batch dividing the global batch that fits */
        p->max_micro_batch_size = 0;
        for (int b = p->global_batch; b >= 1 && !p->max_micro_batch_size; b--) {
            if (p->global_batch % b) continue;
            fl_run_config v = *cfg;
            v.train.micro_batch_size = b;
            v.train.global_batch_size = p->global_batch;
            if (rehearse(&v, &bc, cuda, p->budget, L, world, rank, &rec, NULL) == 1) p->max_micro_batch_size = b;
        }
    }
    if (json) fl_plan_write_json(p, stdout);
    else fl_plan_print(p, stdout);
    const int rc = p->verdict == FL_PLAN_FITS ? FL_EXIT_OK : FL_EXIT_OOM;
    free(p);
    return rc;
}

/* ---- bench-step ------------------------------------------------------------------------------ */

static int cmp_ms(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int fl_cli_blip2_bench(const fl_cli_b2_bench *o) {
    const char *cmd = "bench-step";
    fl_run_config c;
    fl_cfg_defaults(&c, o->lora_r ? FL_CMD_FINETUNE_LORA : FL_CMD_FINETUNE_FULL);
    snprintf(c.checkpoint_dir, sizeof c.checkpoint_dir, "%s", o->model);
    c.train.micro_batch_size = c.train.global_batch_size = o->B;
    c.threads = o->threads;
    c.seed = (uint64_t)o->seed;
    fl_optim_config_default(&c.optimizer, o->sgd ? FL_OPT_SGD : FL_OPT_ADAMW);
    c.optimizer.lr = o->lr;
    if (!o->sgd) c.optimizer.weight_decay = 0.1f;
    if (o->lora_r) c.lora.r = o->lora_r, c.lora.alpha = 2.0f * (float)o->lora_r;
    snprintf(c.precision, sizeof c.precision, "%s", o->precision ? o->precision : "32-true");
    c.train.activation_checkpointing = o->act_ckpt ? 1 : 0;
    fl_blip2_config bc;
    const char *src = "";
    fl_status s = resolve(o->model, &bc, &src);
    const int folder = fl_blip2_is_folder(o->model), n = o->warmup + o->steps;
    const int L = caption_len(&c, &bc, o->L);
    double *ms = calloc((size_t)n, sizeof *ms), *loss = calloc((size_t)n, sizeof *loss);
    if (s == FL_OK && (!ms || !loss)) s = fl_errorf(FL_ERR_OOM, "out of host memory");
    const int s2s = fl_model_is_s2s(&bc.text), rows = bc.n_queries + L;
    if (s == FL_OK)
        printf("bench-step: %s (BLIP-2 with %s, %zu params), B=%d, captions of %d tokens (%d language-model rows%s), "
               "%s, %s, trains %s%s, %s weights%s\n", o->model, fl_arch_get(bc.text.arch)->display,
               fl_blip2_param_count(&bc), o->B, L, s2s ? L : rows, s2s ? " + the source's query placeholders" : "",
               c.precision, fl_optim_name(c.optimizer.kind), o->lora_r ? "lm (LoRA)" : "qformer,lm", "",
               folder && !o->random_init ? "the folder's" : "random", o->act_ckpt ? ", activation checkpointing" : "");
    const fl_blip2_train_opts to = {.shape = folder && !o->random_init ? NULL : &bc, .budget = o->budget,
                                    .synth_len = L, .rehearse_steps = n, .report = stdout, .step_ms = ms,
                                    .step_loss = loss, .n_step_out = n};
    if (s == FL_OK) s = fl_blip2_train(&c, &to, NULL);
    if (s != FL_OK) {
        free(ms), free(loss);
        return fl_cli_fail(cmd, s, NULL);
    }
    for (int k = 0; k < n; k++)
        printf("  step %3d  loss %.4f  %8.1f ms%s\n", k + 1, loss[k], ms[k], k < o->warmup ? "  [warmup]" : "");
    qsort(ms + o->warmup, (size_t)o->steps, sizeof *ms, cmp_ms);
    const double *t = ms + o->warmup;
    const double med = o->steps % 2 ? t[o->steps / 2] : 0.5 * (t[o->steps / 2 - 1] + t[o->steps / 2]);
    /* tokens: the language model's rows (the caption and the queries' rows; the T5 variant's source and target) */
    const double toks = (double)o->B * (double)rows / (med / 1e3), imgs = (double)o->B / (med / 1e3);
    printf("\nmedian %.1f ms/step over %d steps, %.0f tok/s, %.1f images/s\n", med, o->steps, toks, imgs);
    printf("\nRESULT impl=fitllm shape=%s median_ms=%.2f tok_s=%.1f images_s=%.2f peak_rss_mb=%.1f\n", o->model, med,
           toks, imgs, fl_cli_peak_rss_mb());
    free(ms), free(loss);
    return 0;
}

/* What the trainer prints: the progress bar, the result box, the metrics' memory columns
 * (src/train/trainer-impl.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/perf.h"
#include "trainer-impl.h"

void fl_tr_bar_clear(trainer *t) {
    if (t->bar && t->out) fputs("\r\033[K", t->out);
}

/* "1h02m", "3m05s", "42s" */
static void fmt_duration(double s, char *buf, size_t n) {
    long v = s > 0 ? (long)(s + 0.5) : 0;
    if (v >= 3600) snprintf(buf, n, "%ldh%02ldm", v / 3600, v / 60 % 60);
    else if (v >= 60) snprintf(buf, n, "%ldm%02lds", v / 60, v % 60);
    else snprintf(buf, n, "%lds", v);
}

/* Remaining training time: the mean step time measured in this session times the steps
 * left, capped by what train.max_time leaves. Evaluation and checkpoint time are not in
 * it (they are not training time either). Returns -1 before anything was measured. */
double fl_trainer_eta(double session_seconds, long session_steps, long steps_left, double max_time,
                      double train_seconds) {
    if (session_steps <= 0 || session_seconds <= 0) return -1;
    double eta = session_seconds / (double)session_steps * (double)(steps_left > 0 ? steps_left : 0);
    if (max_time > 0) {
        double left = max_time - train_seconds;
        if (left < eta) eta = left > 0 ? left : 0;
    }
    return eta;
}

void fl_tr_bar_draw(trainer *t, long step, double eta) {
    if (!t->bar || !t->out) return;
    int w = 30, fill = (int)(w * (double)step / (double)(t->sch.max_steps > 0 ? t->sch.max_steps : 1));
    if (fill > w) fill = w;
    char e[32] = "--";
    if (eta >= 0) fmt_duration(eta, e, sizeof e);
    fprintf(t->out, "\r[%.*s%*s] step %ld/%ld, ETA %s", fill, "##############################", w - fill, "", step,
            t->sch.max_steps, e);
    fflush(t->out);
}

/* Several ranks: the least and the most peak total over them (every rank calls this: a host collective). */
static int peak_range(trainer *t, const fl_trainer_result *r, double *lo, double *hi) {
    /* tensor parallel: over the whole grid */
    const int W = t->tp.world ? fl_comm_size(t->tp.world) : t->dp.world;
    if (W < 2 || (!t->dp.comm && !t->tp.world)) return 0;
    double *v = calloc((size_t)W, sizeof *v);
    if (!v) return 0;
    v[t->tp.world ? fl_comm_rank(t->tp.world) : t->dp.rank] = (double)r->peak_total;
    int ok = fl_tr_sum_all(t, v, W) == FL_OK;
    *lo = *hi = v[0];
    for (int k = 1; k < W; k++) {
        if (v[k] < *lo) *lo = v[k];
        if (v[k] > *hi) *hi = v[k];
    }
    free(v);
    return ok;
}

void fl_tr_print_box(trainer *t, const fl_trainer_result *r) {
    double lo = 0, hi = 0;
    const int ranged = peak_range(t, r, &lo, &hi); /* before the non-leads return: collective */
    if (!t->out) return;
    char b[32];
    double secs = r->train_seconds > 0 ? r->train_seconds : 1e-9;
    fprintf(t->out, "\n+-------------------------------------------------------------+\n");
    fprintf(t->out, "| %-28s %30lld |\n", "input tokens (non-prompt)", r->tokens_real - r->tokens_prompt);
    fprintf(t->out, "| %-28s %30lld |\n", "tokens with prompt", r->tokens_real);
    fprintf(t->out, "| %-28s %30lld |\n", "total tokens with padding", r->tokens_padded);
    fprintf(t->out, "| %-28s %28.2f s |\n", "training time", r->train_seconds);
    if (t->opt.model && t->opt.amp.on) { /* fp16 loss scaling: the steps an overflow skipped (every rank alike) */
        char ls[64];
        snprintf(ls, sizeof ls, "%lld skipped, scale %g", (long long)t->opt.amp.ls.n_skipped, (double)t->opt.amp.ls.scale);
        fprintf(t->out, "| %-28s %30s |\n", "fp16 steps (loss scaling)", ls);
    }
    /* the job's throughput (every rank's tokens and FLOPs; metrics.csv's tok_s is one rank's): said so at N ranks */
    const int W = t->tp.world ? fl_comm_size(t->tp.world) : t->dp.world;
    char all[32] = "", v[64];
    if (W > 1) snprintf(all, sizeof all, " (all %d ranks)", W);
    snprintf(v, sizeof v, "%.1f%s", r->tokens_real / secs, all);
    fprintf(t->out, "| %-28s %30s |\n", "tokens/s (with prompt)", v);
    snprintf(v, sizeof v, "%.4f%s", t->st.flops / secs / 1e12, all);
    fprintf(t->out, "| %-28s %30s |\n", "TFLOP/s (model FLOPs)", v);
    fl_gpu_peak pk;
    if (t->hw.be_ok && fl_backend_peak(&t->hw.be, &pk)) {
        /* a GPU run: MFU against the device's dense 16-bit peak (fitllm/perf.h), or why there is none */
        if (pk.tflops > 0)
            snprintf(v, sizeof v, "%.1f%% of %.0f (%.28s)", 100.0 * t->st.flops / secs / 1e12 / pk.tflops, pk.tflops,
                     pk.model);
        else
            snprintf(v, sizeof v, "unknown GPU (FITLLM_PEAK_TFLOPS)");
        fprintf(t->out, "| %-28s %30s |\n", "MFU (dense 16-bit peak)", v);
    }
    for (int k = 0; k < FL_TAG_COUNT; k++) {
        char lbl[40];
        snprintf(lbl, sizeof lbl, "peak %s", fl_mem_tag_name((fl_mem_tag)k));
        fprintf(t->out, "| %-28s %30s |\n", lbl, fl_fmt_bytes(r->peak[k], b, sizeof b));
    }
    fprintf(t->out, "| %-28s %30s |\n", "peak total", fl_fmt_bytes(r->peak_total, b, sizeof b));
    if (ranged) { /* the course reports every multi-GPU figure as the range over the GPUs */
        char c[32], line[80];
        snprintf(line, sizeof line, "%s - %s", fl_fmt_bytes((size_t)lo, b, sizeof b), fl_fmt_bytes((size_t)hi, c, sizeof c));
        fprintf(t->out, "| %-28s %30s |\n", "peak total, ranks min - max", line);
    }
    if (r->offload && t->dp.ptier.pool && !t->dp.ptier.disk) { /* parameter offload: the shards in the host tier */
        fprintf(t->out, "| %-28s %30s |\n", "host tier (offload) PARAMS", fl_fmt_bytes(r->host_peak[FL_TAG_PARAMS], b, sizeof b));
        fprintf(t->out, "| %-28s %30s |\n", "host tier (offload) GRADS", fl_fmt_bytes(r->host_peak[FL_TAG_GRADS], b, sizeof b));
    }
    if (r->offload) { /* CPU offload: the host tier beside the device */
        fprintf(t->out, "| %-28s %30s |\n", "host tier (offload) OPTIM", fl_fmt_bytes(r->host_peak[FL_TAG_OPTIM], b, sizeof b));
        fprintf(t->out, "| %-28s %30s |\n", "host tier (offload) total", fl_fmt_bytes(r->host_peak_total, b, sizeof b));
    }
    if (r->nvme && t->dp.ptier.disk) { /* parameter offload on nvme */
        fprintf(t->out, "| %-28s %30s |\n", "nvme tier (offload) PARAMS", fl_fmt_bytes(r->nvme_peak[FL_TAG_PARAMS], b, sizeof b));
        fprintf(t->out, "| %-28s %30s |\n", "nvme tier (offload) GRADS", fl_fmt_bytes(r->nvme_peak[FL_TAG_GRADS], b, sizeof b));
    }
    if (r->nvme)
        fprintf(t->out, "| %-28s %30s |\n", "nvme tier (offload) OPTIM", fl_fmt_bytes(r->nvme_peak[FL_TAG_OPTIM], b, sizeof b));
    if (t->dp.world > 1) {
        /* in units of the whole model's trainable gradients (ZeRO's psi; under FULL_SHARD opt.w.n is
         * this rank's shard), said in words: DDP's all-reduce sends 2 (N-1)/N of it */
        size_t n_grad = t->dp.fsdp ? t->model.layout.numel : t->opt.w.n;
        double psi = (double)n_grad * fl_dtype_size(t->opt.w.gt);
        char g[32], line[96];
        fprintf(t->out, "| %-28s %30s |\n", "sent per step (this rank)",
                fl_fmt_bytes((size_t)r->comm_sent_last_step, b, sizeof b));
        snprintf(line, sizeof line, "= %.2f x the model's gradients (%s)",
                 psi > 0 ? (double)r->comm_sent_last_step / psi : 0.0, fl_fmt_bytes((size_t)psi, g, sizeof g));
        fprintf(t->out, "| %59s |\n", line);
    }
    fprintf(t->out, "+-------------------------------------------------------------+\n");
}

void fl_tr_mem_values(const fl_mem_pool *p, fl_metrics_values *v) {
    for (int k = 0; k < 6; k++) v->mem[k] = (double)p->cur[k];
    v->mem_peak = (double)p->peak_total;
    v->comm_sent = NAN;
}

/* Where the header's model came from, in words ("" when nothing names it): a fine-tuning run's checkpoint_dir; a
 * pretrain run's shape (fl_cfg_model_config's order: model_config fields, a config.json, model_name) and the
 * initial_checkpoint_dir its weights start from. */
static void model_source(const fl_run_config *cfg, char *buf, size_t n) {
    const char *ck = cfg->checkpoint_dir;
    if (cfg->command != FL_CMD_PRETRAIN || (!cfg->n_model_fields && !cfg->model_config[0] && !cfg->model_name[0])) {
        snprintf(buf, n, "%s", ck);
        return;
    }
    size_t o = 0;
    if (cfg->n_model_fields)
        o = (size_t)snprintf(buf, n, "model_config: %d field%s set, the rest litgpt.Config's defaults",
                             cfg->n_model_fields, cfg->n_model_fields == 1 ? "" : "s");
    else o = (size_t)snprintf(buf, n, "%s", cfg->model_config[0] ? cfg->model_config : cfg->model_name);
    if (ck[0] && o < n) snprintf(buf + o, n - o, "; weights from %s", ck);
}

/* A LoRA run's adapters: what they are on and what trains (a fused q|k|v's frozen parts count for nothing), and how a
 * fused module with frozen parts is saved. */
static void print_lora(const trainer *t) {
    fl_lora_adapters ad;
    if (!fl_model_lora_adapters(&t->model, &ad)) return;
    char d[1024], alpha[32];
    if (fl_lora_describe(ad.cfg, &t->model.cfg, d, sizeof d) != FL_OK) fl_error_clear();
    snprintf(alpha, sizeof alpha, "%g", (double)ad.cfg->alpha);
    fprintf(t->out, "LoRA r %d, alpha %s on %s: %zu trainable parameters%s\n", ad.cfg->r, alpha, d,
            fl_lora_trainable(ad.mods, ad.n_mods, ad.cfg->r), t->tp.size > 1 || t->pp.size > 1 ? " (this rank's)" : "");
    static const char *const part_names[3] = {"q", "k", "v"};
    for (int j = 0; j < ad.n_mods; j++) {
        if (!ad.mods[j].frozen) continue;
        char on[16] = "", off[16] = "";
        for (int p = 0; p < ad.mods[j].parts && p < 3; p++) {
            char *w = ad.mods[j].frozen >> p & 1u ? off : on;
            snprintf(w + strlen(w), 16 - strlen(w), "%s%s", w[0] ? "," : "", part_names[p]);
        }
        const char *dot = strrchr(ad.mods[j].name, '.');
        fprintf(t->out, "note: %s's q, k and v are one module (%s): LoRA trains its %s rows only (lora_query, lora_key, "
                "lora_value, as LitGPT); the PEFT adapter is saved on the whole %s (PEFT cannot adapt a part of a "
                "module) with lora_B's %s rows zero and one A for the trained parts\n", fl_arch_get(t->model.cfg.arch)->display,
                dot ? dot + 1 : ad.mods[j].name, on, dot ? dot + 1 : ad.mods[j].name, off);
        break;
    }
}

/* The run's header: model, data, precision, batch and schedule, the notes, data parallelism. */
void fl_tr_print_header(trainer *t, fl_comm *comm, const fl_precision *prec, const fl_strategy_choice *sc) {
    const fl_run_config *cfg = t->cfg;
    if (!t->out) return;
    char src[2 * FL_CFG_PATH + 96];
    model_source(cfg, src, sizeof src);
    fprintf(t->out, "model: %s, %zu parameters%s%s%s; tokenizer: %s%s%s%s\n", t->model.cfg.name[0] ? t->model.cfg.name : "?",
            t->tp.size > 1 ? t->tp.whole_numel : t->pp.size > 1 ? t->pp.whole_numel : t->model.layout.numel,
            src[0] ? " (" : "", src, src[0] ? ")" : "", fl_tok_kind(t->in.tok), t->in.tok_dir[0] ? " from '" : " (built in: no tokenizer files with the model; "
            "--tokenizer_dir gives one", t->in.tok_dir[0] ? t->in.tok_dir : "", t->in.tok_dir[0] ? "'" : ")");
    if (t->in.s2s) {
        const fl_s2s_stats *ss = fl_s2s_get_stats(t->in.s2s);
        const size_t nv = fl_s2s_count(t->in.s2s_vdata);
        fprintf(t->out, "data: %zu source/target pairs from '%s' (%zu sources, %zu targets truncated); longest source "
                "%d, target %d tokens; ", ss->n_records + nv, cfg->data.json_path, ss->n_truncated_source,
                ss->n_truncated_target, t->sch.Ts, t->sch.T);
        if (nv) fprintf(t->out, "%zu train / %zu val pairs (data.val_split_fraction %g)\n", ss->n_records, nv,
                        (double)cfg->data.val_split_fraction);
        else fprintf(t->out, "no validation split (data.val_split_fraction %g of %zu pairs is none)\n",
                     (double)cfg->data.val_split_fraction, ss->n_records);
    } else {
        const fl_data_stats *ds = fl_data_get_stats(t->in.data);
        char cut[96] = "";
        if (t->in.n_cut && t->in.cut_by_ctx)
            snprintf(cut, sizeof cut, " to %d tokens (the model's context: %d inputs)", t->in.cut_to, t->in.cut_to - 1);
        else if (t->in.n_cut)
            snprintf(cut, sizeof cut, " to %d tokens (train.max_seq_length)", t->in.cut_to);
        fprintf(t->out, "data: %s, %zu train / %zu val samples, %zu truncated%s; longest input %d\n",
                fl_data_kind_name(cfg->data.kind), ds->n_samples[FL_SPLIT_TRAIN], ds->n_samples[FL_SPLIT_VAL],
                t->in.n_cut, cut, t->sch.T);
        if (ds->val_source[0]) fprintf(t->out, "validation: %s\n", ds->val_source);
    }
    if (strcmp(cfg->logger_name, "csv") && strcmp(cfg->logger_name, "jsonl"))
        fprintf(t->out, "logger_name %s: fitllm writes CSV metrics (%s/logs/metrics.csv); the %s logger is not "
                "available in this build\n", cfg->logger_name, cfg->out_dir, cfg->logger_name);
    fprintf(t->out, "precision %s%s\n", prec->name, t->model.act_ckpt ? ", activation checkpointing" : "");
    print_lora(t);
    char ranks[48] = "";
    if (t->dp.world > 1) snprintf(ranks, sizeof ranks, " x %d ranks", t->dp.world);
    fprintf(t->out, "micro_batch %d x accumulation %d%s = global batch %d; %ld steps/epoch, %ld steps, warmup %ld; "
            "%s lr %g, min_lr %g%s\n",
            t->sch.B, t->sch.accum, ranks, cfg->train.global_batch_size, t->sch.steps_per_epoch, t->sch.max_steps, t->sch.warmup,
            fl_optim_name(cfg->optimizer.kind), cfg->optimizer.lr, cfg->train.min_lr,
            cfg->train.min_lr > cfg->optimizer.lr ? " (above lr: the rate stays at lr after the warm-up, no decay; give "
                                                    "--train.min_lr below it to decay)" : "");
    fputs(t->notes, t->out);
    if (t->dp.world > 1) {
        char lb[300];
        fprintf(t->out, "data parallel (%s, strategy %s): %d ranks over %s (%s); rank 0 reports; gradients summed "
                "over the ranks %s (%s, deterministic rank order)%s\n",
                fl_dp_stage_name(&t->dp), sc->desc, t->dp.world,
                fl_comm_impl_name(comm), fl_launch_describe(&comm->launch, lb, sizeof lb),
                t->dp.fsdp ? "unit by unit in every micro-batch" : "once per step",
                t->dp.fsdp && t->dp.node ? "one reduce-scatter per unit within the node as its backward ends, then "
                "an all-reduce of the piece across the nodes: each rank keeps its node's shard"
                : t->dp.fsdp ? "one reduce-scatter per unit as its backward ends: each rank keeps its shard"
                : t->dp.stage == 2 ? "one reduce-scatter: each rank keeps its chunk"
                : t->model.lora ? "one all-reduce of the adapters"
                               : "all-reduced block by block as the last micro-batch's backward ends each",
                t->dp.fsdp ? "; each rank holds its shard of every unit's parameters, gradients and optimizer "
                "state; a unit's parameters are all-gathered right before its forward and its backward (the next "
                "unit's gather posted ahead, at most 2 blocks at once)"
                : t->dp.stage ? "; each rank holds the optimizer state of its chunk of the parameters, updates it, "
                "and the updated parameters are all-gathered" : "");
    }
    fl_tr_tp_print(t, comm);
    long bpe = (long)fl_tr_batches_per_epoch(t);
    if (bpe < t->sch.G) /* the epoch counter then moves every few iterations, inside one step */
        fprintf(t->out, "note: the training split is %ld micro-batch%s of %d, fewer than the %d of one optimizer "
                "step: every step goes over it %.3g times (the log's epoch counter moves with each pass; train.epochs and "
                "the warm-up fraction count one step per epoch)\n",
                bpe, bpe == 1 ? "" : "es", t->sch.B, t->sch.G, (double)t->sch.G / (double)bpe);
}

/* After the first step (not resumed): the memory report of the device pool, and of the host and nvme
 * tiers under offload. */
void fl_tr_print_memory(trainer *t) {
    const fl_run_config *cfg = t->cfg;
    fl_tr_bar_clear(t);
    fprintf(t->out, "\n");
    char stage[96] = ""; /* TP x PP: the slice is of pipeline stage 0's blocks */
    if (t->tp.size > 1 && t->pp.size > 1)
        snprintf(stage, sizeof stage, " of pipeline stage 0 of %d (blocks [%d, %d))", t->pp.size, t->pp.first, t->pp.last);
    if (t->tp.size > 1)
        fprintf(t->out, "memory of rank 0 (tensor parallel %d%s%s: PARAMS, GRADS and OPTIM hold its slice%s, %zu of %zu "
                "parameters%s; ACTS its heads' and MLP columns' activations; the whole model was loaded outside the "
                "pool and freed)\n", t->tp.size, t->dp.world > 1 ? " x " : "", t->dp.world > 1 ? fl_dp_stage_name(&t->dp) : "",
                stage, t->model.layout.numel, t->tp.whole_numel,
                t->dp.fsdp ? " (PARAMS, GRADS and OPTIM: the rank's pieces of the slice's units; GATHER the gathered units)"
                : t->dp.stage ? " (OPTIM: its chunk's state)" : "");
    else if (t->pp.size > 1)
        fprintf(t->out, "memory of rank 0 (pipeline stage 0 of %d%s%s: PARAMS, GRADS and OPTIM hold blocks [%d, %d) and "
                "copies of the embeddings and head, %zu of %zu parameters%s%s; ACTS its arena and a stash per further "
                "micro-batch in flight; the whole model was loaded outside the pool and freed)\n", t->pp.size,
                t->dp.world > 1 ? " x " : "", t->dp.world > 1 ? fl_dp_stage_name(&t->dp) : "", t->pp.first, t->pp.last,
                t->model.layout.numel, t->pp.whole_numel,
                t->dp.fsdp ? " (PARAMS, GRADS and OPTIM: the rank's pieces of the stage's units)"
                : t->dp.stage ? " (OPTIM: its chunk's state)" : "",
                t->pp.chunks > 1 ? ": chunk 0's; interleaved, its later chunks are stage models of their own in the same "
                                   "pool, each with its arena and stashes" : "");
    else if (t->dp.world > 1 && !t->dp.stage)
        fprintf(t->out, "memory of rank 0 (DDP: every rank holds the same; WORKSPACE includes the all-reduce's "
                "scratch)\n");
    else if (t->dp.fsdp && t->dp.ptier.pool)
        fprintf(t->out, "memory of rank 0 (ZeRO-3 with parameter offload: its shard, %zu of %zu elements, of PARAMS "
                "and GRADS in the %s tier below, of OPTIM in the %s tier below; GATHER the units fetched and gathered at "
                "a time and their unreduced gradients)\n", t->opt.w.n, t->model.layout.numel, t->dp.ptier.disk ? "nvme" : "host",
                t->hw.off.state_pool ? "nvme" : "host");
    else if (t->dp.fsdp)
        fprintf(t->out, "memory of rank 0 (%s: PARAMS, GRADS and OPTIM hold its shard, %zu of %zu elements; "
                "GATHER the units gathered at a time and their unreduced gradients; WORKSPACE includes the "
                "reduction's scratch)\n", fl_dp_stage_name(&t->dp), t->opt.w.n, t->model.layout.numel);
    else if (t->dp.world > 1)
        fprintf(t->out, "memory of rank 0 (%s: OPTIM holds its chunk's state, %zu of %zu elements%s; WORKSPACE "
                "includes the reduction's scratch)\n", fl_dp_stage_name(&t->dp), t->opt.shard.len, t->opt.w.n,
                t->dp.stage == 2 ? "; GRADS live after the reduction: its chunk" : "");
    fl_mem_print_report(&t->hw.pool, t->out);
    if (t->hw.opool_ok) {
        fprintf(t->out, "\nhost tier (CPU offload: %s%s%s, outside the device's budget)\n",
                t->hw.off.state_pool ? "the optimizer state is in the nvme tier below" : "the optimizer state",
                t->opt.home.hp ? "; the update's staging of one piece" : "",
                !t->dp.ptier.pool ? "" : t->dp.ptier.disk ? "; the gradients' staging on their way down, when they "
                "accumulate or a device stages them (none: 0 B)" : "; the parameters' and gradients' shards");
        fl_mem_print_report(&t->hw.opool, t->out);
    }
    if (t->hw.dpool_ok) {
        fprintf(t->out, "\nnvme tier (%s in files under '%s', mapped: the kernel pages in the pieces being read or "
                "updated through its page cache, host memory that is not the host tier's)\n",
                !t->dp.ptier.disk ? "the optimizer state" : t->hw.off.state_pool ? "the parameters' and gradients' shards and the optimizer state"
                : "the parameters' and gradients' shards", cfg->nvme_path[0] ? cfg->nvme_path : cfg->out_dir);
        fl_mem_print_report(&t->hw.dpool, t->out);
    }
    fprintf(t->out, "\n");
}

/* A metrics row of a validation loss. */
void fl_tr_val_row(trainer *t, double val_loss) {
    fl_metrics_values mv = {.iter = t->st.iter, .step = t->st.step, .epoch = (long)t->st.loader.epoch, .loss = NAN,
                            .iter_time = NAN, .learning_rate = NAN, .val_loss = val_loss, .tok_s = NAN,
                            .total_tokens = t->st.tokens_padded}; /* every rank's, as the training rows' */
    fl_tr_mem_values(&t->hw.pool, &mv);
    fl_metrics_row(&t->metrics, &mv);
}

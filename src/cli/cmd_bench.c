/* fitllm bench-step: times full training steps (forward + backward + AdamW)
 * on random tokens and prints median ms/step, tok/s, GFLOP/s, the median time
 * of each phase (forward, head+loss, backward, optimizer) and the memory phase
 * report. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "cli.h"
#include "fitllm/lora.h"
#include "fitllm/perf.h"

static void help(void) {
    printf("usage: fitllm bench-step <model> [options]\n\n"
           "  <model>               preset name (tiny, small, tinyllama-1.1b, blip2-opt-2.7b, ...), HF folder, a downloaded Hugging\n"
           "                        Face repo id ORG/NAME (`fitllm download --help`), config.json or\n"
           "                        llama2.c .bin (--preset NAME is the same as a preset positional)\n"
           "  --init random         ignore stored weights, initialize randomly (presets always are)\n"
           "  --micro-batch B       sequences per step (default 4)\n"
           "  --seq T               tokens per sequence (default 256; an encoder-decoder: the target's; BLIP-2: the\n"
           "                        caption's tokens, after the image's query rows)\n"
           "  --source-seq T        an encoder-decoder (T5): source tokens per sequence (default: --seq)\n"
           "  --steps N             timed steps (default 10)\n"
           "  --warmup N            untimed steps first (default 2)\n"
           "  --optimizer NAME      AdamW (default) or SGD\n"
           "  --lr X                learning rate (default 1e-4)\n"
           "  --threads N           CPU threads (default: all cores)\n"
           "  --accelerator A       auto|cpu|cuda (default auto: the GPU when this build has CUDA and one is\n"
           "                        visible, else the CPU). cuda is EXPERIMENTAL (passed selftest and trained on\n"
           "                        an H100; single GPU; README)\n"
           "  --max-memory SIZE     allocator budget, e.g. 2GB, 512MiB (default: unlimited)\n"
           "  --act-ckpt            activation checkpointing (recompute blocks in backward)\n"
           "  --dropout             config.json's dropout in the step, as fine-tuning applies it (T5 / Flan-T5,\n"
           "                        OPT; default: none, as the peer benchmarks run); a model without dropout of\n"
           "                        its own is refused\n"
           "  --precision NAME      32-true (default), bf16-true, bf16-mixed, 16-true, 16-mixed\n"
           "  --lora R              LoRA fine-tuning: rank R, alpha 2R, on q_proj,v_proj (base frozen)\n"
           "  --quantize MODE       with --lora: QLoRA, block linears in 4 bits (bnb.nf4, bnb.nf4-dq, bnb.fp4,\n"
           "                        bnb.fp4-dq)\n"
           "  --seed N              init/data seed (default 1337)\n"
           "  --profile             time every backend op of the timed steps (CUDA events on a GPU, the host clock\n"
           "                        with a sync around each op elsewhere) and print them grouped as GEMM /\n"
           "                        attention / norm / elementwise / embedding+loss / optimizer / copies, with the\n"
           "                        GEMMs' and attention's TFLOP/s, then each GEMM shape's rate beside the\n"
           "                        library's own for the shape alone (cuBLASLt's fastest candidate: %% best);\n"
           "                        ends with a PROFILE line\n\n"
           "Phases per step: fwd = embedding + blocks + final norm; head = lm_head + cross-entropy + the\n"
           "head's backward (computed chunk by chunk inside the forward); bwd = backward of the blocks and\n"
           "embedding; opt = gradient norm + optimizer update. On a GPU, MFU = model FLOPs per step / step time /\n"
           "the GPU's dense bf16 peak (fp16 on V100/T4) from a table by the device's name; FITLLM_PEAK_TFLOPS=X\n"
           "gives the peak of a GPU the table lacks. Output ends with a machine-readable line (phase fields:\n"
           "medians over the timed steps; mfu: a fraction, -1 when unknown, absent on the CPU):\n"
           "RESULT impl=fitllm shape=<model> median_ms=.. tok_s=.. gflops=.. peak_rss_mb=.. fwd_ms=.. head_ms=..\n"
           "       bwd_ms=.. opt_ms=.. [mfu=..]\n");
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of x[0..n-1] (sorts x). */
static double median(double *x, int n) {
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

enum { PH_TOTAL, PH_FWD, PH_HEAD, PH_BWD, PH_OPT, PH_COUNT };

/* bench-step's options. */
typedef struct {
    const char *model_path;
    int B, T, Ts, steps, warmup, threads, seed, random_init, act_ckpt, lora_r, dropout;
    float lr;
    size_t budget;
    fl_optim_kind okind;
    fl_precision prec;
    fl_q4_type q4t;
    int q4dq, quant, profile;
} bench_opts;

/* The command line into o: -1 to run, else the exit code (help, a usage error). */
static int parse_opts(int argc, char **argv, const char *cmd, bench_opts *o) {
    *o = (bench_opts){.B = 4, .T = 256, .steps = 10, .warmup = 2, .seed = 1337, .lr = 1e-4f, .okind = FL_OPT_ADAMW,
                      .prec = *fl_precision_get(FL_PREC_32_TRUE), .q4t = FL_Q4_NF4};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { help(); return 0; }
        else if (!strcmp(a, "--init")) {
            if (!v || strcmp(v, "random")) return fl_cli_usage(cmd, "--init accepts only 'random'");
            o->random_init = 1; i++;
        } else if (!strcmp(a, "--precision")) {
            if (!v || fl_precision_find(v, &o->prec) != FL_OK) return fl_cli_usage(cmd, "%s", fl_error_message());
            i++;
        } else if (!strcmp(a, "--quantize")) {
            if (!v || fl_q4_parse_mode(v, &o->q4t, &o->q4dq) != FL_OK)
                return fl_cli_usage(cmd, "%s", v ? fl_error_message() : "--quantize needs a mode");
            o->quant = 1;
            i++;
        } else if (!strcmp(a, "--lora")) {
            if (fl_cli_int(cmd, a, v, 1, 4096, &o->lora_r)) return 2;
            i++;
        } else if (!strcmp(a, "--act-ckpt")) {
            o->act_ckpt = 1;
        } else if (!strcmp(a, "--dropout")) {
            o->dropout = 1;
        } else if (!strcmp(a, "--profile")) {
            o->profile = 1;
        } else if (!strcmp(a, "--preset")) {
            if (!v) return fl_cli_usage(cmd, "--preset needs a name");
            o->model_path = v; i++;
        } else if (!strcmp(a, "--micro-batch")) { if (fl_cli_int(cmd, a, v, 1, 1 << 20, &o->B)) return 2; i++; }
        else if (!strcmp(a, "--seq")) { if (fl_cli_int(cmd, a, v, 1, 1 << 24, &o->T)) return 2; i++; }
        else if (!strcmp(a, "--source-seq")) { if (fl_cli_int(cmd, a, v, 1, 1 << 24, &o->Ts)) return 2; i++; }
        else if (!strcmp(a, "--steps")) { if (fl_cli_int(cmd, a, v, 1, 1 << 20, &o->steps)) return 2; i++; }
        else if (!strcmp(a, "--warmup")) { if (fl_cli_int(cmd, a, v, 0, 1 << 20, &o->warmup)) return 2; i++; }
        else if (!strcmp(a, "--threads")) { if (fl_cli_threads(cmd, v, 1024, &o->threads)) return 2; i++; }
        else if (!strcmp(a, "--accelerator")) { int rc = fl_cli_accelerator(cmd, v); if (rc) return rc; i++; }
        else if (!strcmp(a, "--seed")) { if (fl_cli_int(cmd, a, v, 0, 1 << 30, &o->seed)) return 2; i++; }
        else if (!strcmp(a, "--lr")) { if (fl_cli_pos_float(cmd, a, v, &o->lr)) return 2; i++; }
        else if (!strcmp(a, "--optimizer")) {
            if (!v) return fl_cli_usage(cmd, "--optimizer needs a name");
            if (!strcasecmp(v, "adamw")) o->okind = FL_OPT_ADAMW;
            else if (!strcasecmp(v, "sgd")) o->okind = FL_OPT_SGD;
            else return fl_cli_usage(cmd, "unknown optimizer '%s' (AdamW, SGD)", v);
            i++;
        } else if (!strcmp(a, "--max-memory")) {
            if (!v || fl_parse_bytes(v, &o->budget)) {
                char why[300];
                return fl_cli_usage(cmd, "--max-memory: %s", fl_bytes_refusal(v, why, sizeof why));
            }
            i++;
        } else if (a[0] == '-') return fl_cli_unknown_option(cmd, a, (const char *const[]){"--accelerator", "--act-ckpt", "--dropout", "--help", "--init", "--lora", "--lr", "--max-memory", "--micro-batch", "--optimizer", "--precision", "--preset", "--profile", "--quantize", "--seed", "--seq", "--source-seq", "--steps", "--threads", "--warmup", NULL});
        else if (!o->model_path) o->model_path = a;
        else return fl_cli_usage(cmd, "unexpected argument '%s'", a);
    }
    if (!o->model_path) return fl_cli_usage(cmd, "missing <model>");
    if (o->quant && !o->lora_r) return fl_cli_usage(cmd, "--quantize needs --lora R (the 4-bit base is frozen)");
    if (o->quant && o->prec.compute_copy)
        return fl_cli_usage(cmd, "--quantize with --precision %s: quantization and mixed precision are not supported together",
                            o->prec.name);
    return -1;
}

/* A BLIP-2 folder or preset: image-caption fine-tuning's steps (cmd_blip2_plan.c); --seq is the caption's tokens. */
static int blip2(const bench_opts *o, const char *cmd) {
    const char *no = o->quant ? "--quantize" : o->Ts ? "--source-seq" : o->profile ? "--profile" : o->dropout ? "--dropout"
                     : strcmp(o->prec.name, "32-true") && strcmp(o->prec.name, "bf16-mixed") &&
                       strcmp(o->prec.name, "bf16-true") ? "--precision" : NULL;
    if (no) return fl_cli_usage(cmd, "%s: BLIP-2 steps run 32-true, bf16-true or bf16-mixed without quantization, "
                                "the op profile or dropout so far", no);
    fl_cli_b2_bench b = {.model = o->model_path, .B = o->B, .L = o->T, .steps = o->steps, .warmup = o->warmup,
                         .threads = o->threads, .seed = o->seed, .lora_r = o->lora_r, .sgd = o->okind == FL_OPT_SGD,
                         .random_init = o->random_init, .lr = o->lr, .budget = o->budget, .precision = o->prec.name,
                         .act_ckpt = o->act_ckpt};
    return fl_cli_blip2_bench(&b);
}

int fl_cmd_bench_step(int argc, char **argv) {
    const char *cmd = "bench-step";
    bench_opts o;
    int prc = parse_opts(argc, argv, cmd, &o);
    if (prc >= 0) return prc;
    if (fl_cli_is_blip2(o.model_path)) return blip2(&o, cmd);
    fl_backend be;
    fl_mem_pool pool, hpool; /* tensors; host staging when the backend's memory is not host memory */
    fl_model m = {0};
    fl_optimizer opt = {0};
    int32_t *ids = NULL, *tg = NULL, *src = NULL;
    uint8_t *smask = NULL;
    double *times = NULL;
    fl_profiler *prof = NULL; /* --profile: attached for the timed steps */
    int loaded = 0, rc = 0;
    fl_status s = fl_backend_init_by_name(fl_backend_default_name(), &be, o.threads);
    if (s != FL_OK) return fl_cli_fail(cmd, s, NULL);
    if ((s = fl_backend_pools_init(&be, &pool, &hpool, be.name, o.budget)) != FL_OK) return fl_cli_fail(cmd, s, NULL);
    fl_mem_set_phase(&pool, "model load");
    fl_model_storage stg;
    fl_model_storage_for(&o.prec, &stg);
    stg.quant4 = o.quant;
    stg.q4_type = o.q4t;
    stg.q4_double_quant = o.q4dq;
    if ((s = fl_cli_load_model_ex(&m, o.model_path, o.random_init, (uint64_t)o.seed, &be, &pool, &stg, &loaded)) != FL_OK)
        goto fail;
    fl_mem_set_phase(&pool, "setup");
    if ((s = fl_model_set_precision(&m, &o.prec)) != FL_OK) goto fail;
    if (o.lora_r) {
        fl_lora_config lc;
        if ((s = fl_lora_config_init(&lc, &m.cfg, o.lora_r, 2.0f * o.lora_r, 0.0f, 0,
                                     fl_arch_get(m.cfg.arch)->lora_default)) != FL_OK)
            goto fail;
        if ((s = fl_model_lora_init(&m, &lc, (uint64_t)o.seed)) != FL_OK) goto fail;
    } else if ((s = fl_model_alloc_grads(&m)) != FL_OK) {
        goto fail;
    }
    fl_optim_config oc;
    fl_optim_config_default(&oc, o.okind);
    oc.lr = o.lr;
    if (o.okind == FL_OPT_ADAMW) oc.weight_decay = 0.1f;
    if ((s = fl_optim_init(&opt, &m, &oc)) != FL_OK) goto fail;
    m.act_ckpt = o.act_ckpt;
    /* --dropout: config.json's rates in the training passes (before the arena: the blocks' graphs change) */
    if (o.dropout && (s = fl_model_set_dropout(&m, 1)) != FL_OK) goto fail;
    const int s2s = fl_model_is_s2s(&m.cfg), Ts = s2s ? (o.Ts ? o.Ts : o.T) : 0; /* an encoder-decoder's source */
    if (!s2s && o.Ts) {
        s = fl_errorf(FL_ERR_INVALID, "--source-seq: %s is not an encoder-decoder (it has no source)", o.model_path);
        goto fail;
    }
    if ((s = s2s ? fl_model_alloc_acts_s2s(&m, o.B, Ts, o.T) : fl_model_alloc_acts(&m, o.B, o.T)) != FL_OK) goto fail;
    size_t N = (size_t)o.B * o.T, Ns = (size_t)o.B * Ts;
    if ((s = fl_mem_alloc(fl_mem_host_pool(&pool), FL_TAG_OTHER, N * sizeof *ids, (void **)&ids)) != FL_OK) goto fail;
    if ((s = fl_mem_alloc(fl_mem_host_pool(&pool), FL_TAG_OTHER, N * sizeof *tg, (void **)&tg)) != FL_OK) goto fail;
    if (s2s && (s = fl_mem_alloc(fl_mem_host_pool(&pool), FL_TAG_OTHER, Ns * (sizeof *src + 1), (void **)&src)) != FL_OK)
        goto fail;
    times = calloc((size_t)o.steps * PH_COUNT, sizeof *times); /* (PH_COUNT, o.steps) */
    if (!times) {
        s = fl_errorf(FL_ERR_OOM, "bench-step: no memory for %d step timings", o.steps);
        goto fail;
    }
    uint64_t r = (uint64_t)o.seed * 0x9e3779b97f4a7c15ULL + 1;
    for (size_t i = 0; i < N; i++) {
        r ^= r << 13; r ^= r >> 7; r ^= r << 17;
        ids[i] = (int32_t)(r % (uint64_t)m.cfg.vocab_size);
    }
    for (size_t i = 0; i < N; i++) tg[i] = (i + 1) % o.T ? ids[i + 1] : ids[i - o.T + 1];
    if (s2s) { /* random sources, unpadded; the decoder reads the start token, then the targets but their last */
        smask = (uint8_t *)(src + Ns);
        for (size_t i = 0; i < Ns; i++) {
            r ^= r << 13; r ^= r >> 7; r ^= r << 17;
            src[i] = (int32_t)(r % (uint64_t)m.cfg.vocab_size);
            smask[i] = 1;
        }
        for (size_t i = N; i-- > 0;) ids[i] = i % o.T ? tg[i - 1] : m.cfg.dec_start_id;
    }

    const fl_model_config *c = &m.cfg;
    char shape[64], lay[32];
    if (s2s) snprintf(shape, sizeof shape, "B=%d source %d target %d", o.B, Ts, o.T);
    else snprintf(shape, sizeof shape, "B=%d T=%d", o.B, o.T);
    if (s2s) snprintf(lay, sizeof lay, "L=%d+%d", c->n_layers, c->n_dec_layers);
    else snprintf(lay, sizeof lay, "L=%d", c->n_layers);
    char drop[64] = "";
    if (o.dropout) snprintf(drop, sizeof drop, ", dropout %g / attention %g", (double)c->dropout_rate,
                            (double)(fl_model_is_s2s(c) ? c->dropout_rate : c->attn_dropout_rate));
    printf("bench-step: %s (%s, %zu params, %s C=%d NH=%d NKV=%d F=%d V=%d), %s, %s, %s%s%s%s, %d threads, gemm=%s\n",
           o.model_path, fl_arch_get(c->arch)->name, m.layout.numel, lay, c->dim, c->n_heads,
           c->n_kv_heads, c->ffn_dim, c->vocab_size, shape, o.prec.name, fl_optim_name(o.okind), o.act_ckpt ? ", act-ckpt" : "", o.lora_r ? ", LoRA q,v" : "",
           drop, be.n_threads, be.gemm_name);
    /* the step training runs (fl_step_run), in one process: one micro-batch, every target valid */
    fl_micro_batch mb = {.ids = ids, .targets = tg, .B = o.B, .T = o.T, .src = src, .src_mask = smask, .Ts = Ts};
    fl_step_result res;
    for (int k = 0; k < o.warmup + o.steps; k++) {
        if (o.profile && k == o.warmup && (s = fl_profiler_attach(&be, &prof)) != FL_OK) goto fail;
        /* seeded: each step's dropout masks differ, as training's micro-batches' (--dropout) */
        fl_step_ctx sc = {.mbs = &mb, .n_micro = 1, .step_valid = (long)N, .lr = o.lr, .max_norm = 1.0f,
                          .phase_times = 1, .seeded = o.dropout, .seed = (uint64_t)o.seed, .iter0 = k};
        if ((s = fl_step_run(&m, &opt, &sc, &res)) != FL_OK) goto fail;
        if (prof && (s = fl_profiler_collect(prof)) != FL_OK) goto fail;
        if (k >= o.warmup) {
            const double ph[PH_COUNT] = {res.ms_total, res.ms_fwd, res.ms_head, res.ms_bwd, res.ms_opt};
            for (int p = 0; p < PH_COUNT; p++) times[(size_t)p * o.steps + (k - o.warmup)] = ph[p];
        }
        printf("  step %3d  loss %.4f  %8.1f ms (fwd %.1f, head+loss %.1f, bwd %.1f, opt %.1f)%s\n", k + 1, res.loss,
               res.ms_total, res.ms_fwd, res.ms_head, res.ms_bwd, res.ms_opt, k < o.warmup ? "  [warmup]" : "");
    }
    double mph[PH_COUNT];
    for (int p = 0; p < PH_COUNT; p++) mph[p] = median(times + (size_t)p * o.steps, o.steps);
    double med = mph[PH_TOTAL];
    double flops = s2s ? fl_model_train_flops_s2s(c, o.B, Ts, o.T) : fl_model_train_flops(c, o.B, o.T);
    double toks = (double)(N + Ns) / (med / 1e3), gflops = flops / (med / 1e3) / 1e9; /* source tokens too */
    printf("\nmedian %.1f ms/step over %d steps, %.0f tok/s, %.1f GFLOP/s (%.2f GFLOP/step)\n", med, o.steps, toks,
           gflops, flops / 1e9);
    printf("median per phase: forward %.1f ms, head+loss %.1f ms, backward %.1f ms, optimizer %.1f ms\n",
           mph[PH_FWD], mph[PH_HEAD], mph[PH_BWD], mph[PH_OPT]);
    char mline[320], mfield[48] = "";
    double mfu = -1;
    if (fl_mfu_line(&be, gflops / 1e3, mline, sizeof mline, &mfu)) {
        printf("%s\n", mline);
        snprintf(mfield, sizeof mfield, " mfu=%.4f", mfu);
    }
    printf("\n");
    if (prof) {
        if (fl_profiler_gemm_refs(prof, 10) != FL_OK) /* each GEMM shape alone, by the library: a report, not fatal */
            fprintf(stderr, "bench-step: some GEMM shapes were not timed alone: %s\n", fl_error_message());
        fl_profiler_print(prof, o.steps, med, stdout);
        printf("\n");
    }
    fl_mem_print_report(&pool, stdout);
    printf("\nRESULT impl=fitllm shape=%s median_ms=%.2f tok_s=%.1f gflops=%.2f peak_rss_mb=%.1f fwd_ms=%.2f head_ms=%.2f "
           "bwd_ms=%.2f opt_ms=%.2f%s\n",
           o.model_path, med, toks, gflops, fl_cli_peak_rss_mb(), mph[PH_FWD], mph[PH_HEAD], mph[PH_BWD], mph[PH_OPT],
           mfield);
    goto done;
fail:
    rc = fl_cli_fail(cmd, s, &pool);
done:
    fl_profiler_detach(prof);
    free(times);
    fl_mem_free(fl_mem_host_pool(&pool), ids);
    fl_mem_free(fl_mem_host_pool(&pool), tg);
    fl_mem_free(fl_mem_host_pool(&pool), src);
    fl_optim_free(&opt);
    fl_model_free(&m);
    fl_backend_pools_free(&pool, &hpool);
    fl_backend_free(&be);
    return rc;
}

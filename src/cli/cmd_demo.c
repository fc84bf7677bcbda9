/* fitllm demo: a short real training run on a built-in model shape with random
 * init and a synthetic, learnable task (arithmetic progressions modulo the
 * vocabulary: token t+1 = token t + d, d in 1..4, so the model must look at the
 * previous two tokens). Prints the loss curve and the memory phase report. */
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#include "cli.h"

static void help(void) {
    printf("usage: fitllm demo [options]\n\n"
           "  --model NAME        model preset (default micro: dim 64, 5 layers, GQA 8/4 heads, vocab 512)\n"
           "  --steps N           optimizer steps (default 150)\n"
           "  --micro-batch B     sequences per micro-batch (default 16)\n"
           "  --accum K           micro-batches per step (gradient accumulation, default 1)\n"
           "  --seq T             tokens per sequence (default 64)\n"
           "  --lr X              AdamW learning rate (default 3e-3)\n"
           "  --threads N         CPU threads (default: all cores)\n"
           "  --accelerator A     auto|cpu|cuda (default auto: the GPU when this build has CUDA and one is\n"
           "                      visible, else the CPU). cuda is EXPERIMENTAL (single GPU; README)\n"
           "  --max-memory SIZE   allocator budget (default: unlimited)\n");
}

static uint64_t xs(uint64_t *r) {
    *r ^= *r << 13; *r ^= *r >> 7; *r ^= *r << 17;
    return *r;
}

/* (n, T) sequences: s, s+d, s+2d, ... mod V. */
static void make_batch(int32_t *ids, int32_t *tg, int n, int T, int V, uint64_t *r) {
    for (int b = 0; b < n; b++) {
        int s = (int)(xs(r) % (uint64_t)V), d = 1 + (int)(xs(r) % 4);
        for (int t = 0; t < T; t++) {
            ids[b * T + t] = (s + t * d) % V;
            tg[b * T + t] = (s + (t + 1) * d) % V;
        }
    }
}

int fl_cmd_demo(int argc, char **argv) {
    const char *cmd = "demo", *preset = "micro";
    int steps = 150, B = 16, T = 64, accum = 1, threads = 0;
    float lr = 3e-3f;
    size_t budget = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { help(); return 0; }
        else if (!strcmp(a, "--model")) { if (!v) return fl_cli_usage(cmd, "--model needs a name"); preset = v; i++; }
        else if (!strcmp(a, "--steps")) { if (fl_cli_int(cmd, a, v, 1, 1 << 24, &steps)) return 2; i++; }
        else if (!strcmp(a, "--micro-batch")) { if (fl_cli_int(cmd, a, v, 1, 1 << 20, &B)) return 2; i++; }
        else if (!strcmp(a, "--accum")) { if (fl_cli_int(cmd, a, v, 1, 1 << 20, &accum)) return 2; i++; }
        else if (!strcmp(a, "--seq")) { if (fl_cli_int(cmd, a, v, 2, 1 << 24, &T)) return 2; i++; }
        else if (!strcmp(a, "--threads")) { if (fl_cli_threads(cmd, v, 1024, &threads)) return 2; i++; }
        else if (!strcmp(a, "--accelerator")) { int rc = fl_cli_accelerator(cmd, v); if (rc) return rc; i++; }
        else if (!strcmp(a, "--lr")) { if (fl_cli_pos_float(cmd, a, v, &lr)) return 2; i++; }
        else if (!strcmp(a, "--max-memory")) {
            if (!v || fl_parse_bytes(v, &budget)) {
                char why[300];
                return fl_cli_usage(cmd, "--max-memory: %s", fl_bytes_refusal(v, why, sizeof why));
            }
            i++;
        } else return fl_cli_unknown_option(cmd, a, (const char *const[]){"--accelerator", "--accum", "--help", "--lr", "--max-memory", "--micro-batch", "--model", "--seq", "--steps", "--threads", NULL});
    }
    fl_backend be;
    fl_mem_pool pool, hpool; /* tensors; host staging when the backend's memory is not host memory */
    fl_model m = {0};
    fl_optimizer opt = {0};
    fl_model_config cfg;
    int32_t *ids = NULL, *tg = NULL;
    int rc = 0;
    fl_status s = fl_backend_init_by_name(fl_backend_default_name(), &be, threads);
    if (s != FL_OK) return fl_cli_fail(cmd, s, NULL);
    if ((s = fl_backend_pools_init(&be, &pool, &hpool, be.name, budget)) != FL_OK) return fl_cli_fail(cmd, s, NULL);
    if ((s = fl_preset_find(preset, &cfg)) != FL_OK) goto fail;
    fl_mem_set_phase(&pool, "setup");
    if ((s = fl_model_init(&m, &cfg, &be, &pool)) != FL_OK) goto fail;
    fl_model_init_random(&m, 1337);
    if ((s = fl_model_alloc_grads(&m)) != FL_OK) goto fail;
    fl_optim_config oc;
    fl_optim_config_default(&oc, FL_OPT_ADAMW);
    oc.lr = lr;
    oc.beta2 = 0.95f;
    oc.weight_decay = 0.0f;
    if ((s = fl_optim_init(&opt, &m, &oc)) != FL_OK) goto fail;
    if ((s = fl_model_alloc_acts(&m, B, T)) != FL_OK) goto fail;
    size_t n = (size_t)accum * B * T;
    if ((s = fl_mem_alloc(fl_mem_host_pool(&pool), FL_TAG_OTHER, n * sizeof *ids, (void **)&ids)) != FL_OK) goto fail;
    if ((s = fl_mem_alloc(fl_mem_host_pool(&pool), FL_TAG_OTHER, n * sizeof *tg, (void **)&tg)) != FL_OK) goto fail;

    printf("fitllm demo: training preset '%s' (%zu params) from random init on synthetic arithmetic sequences\n",
           preset, m.layout.numel);
    printf("micro-batch %d x %d tokens, accumulation %d, AdamW lr %g, %d threads, gemm %s\n\n", B, T, accum, lr,
           be.n_threads, be.gemm_name);
    uint64_t r = 0x1234567ULL;
    double t0 = fl_cli_now_ms(), first = 0, last = 0;
    for (int step = 1; step <= steps; step++) {
        make_batch(ids, tg, accum * B, T, cfg.vocab_size, &r);
        /* cosine decay to 10% after a short warmup */
        float w = step < 10 ? step / 10.0f : 1.0f;
        float frac = (float)(step - 1) / (float)(steps > 1 ? steps - 1 : 1);
        float cur = lr * w * (0.1f + 0.9f * 0.5f * (1.0f + cosf(3.14159265f * frac)));
        fl_step_result res;
        if ((s = fl_train_step(&m, &opt, ids, tg, accum, B, T, cur, 1.0f, &res)) != FL_OK) goto fail;
        if (step == 1) first = res.loss;
        last = res.loss;
        if (step == 1 || step % 10 == 0 || step == steps)
            printf("step %4d  loss %.4f  grad norm %.3f  lr %.2e  %.1f ms\n", step, res.loss, res.grad_norm, cur,
                   res.ms_total);
        if (step == 1) { printf("\n"); fl_mem_print_report(&pool, stdout); printf("\n"); }
    }
    double secs = (fl_cli_now_ms() - t0) / 1e3;
    printf("\nloss %.4f -> %.4f in %d steps, %.1f s, %.0f tok/s\n", first, last, steps, secs,
           (double)n * steps / secs);
    printf("\n");
    fl_mem_print_report(&pool, stdout);
    goto done;
fail:
    rc = fl_cli_fail(cmd, s, &pool);
done:
    fl_mem_free(fl_mem_host_pool(&pool), ids);
    fl_mem_free(fl_mem_host_pool(&pool), tg);
    fl_optim_free(&opt);
    fl_model_free(&m);
    fl_backend_pools_free(&pool, &hpool);
    fl_backend_free(&be);
    return rc;
}

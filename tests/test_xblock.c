/* The cross-block residual add + norm (issue 30 item 4; exec_fuse.c, transformer.c blocks_forward): under a bf16
 * store a block's last add (res[l+1] = res_mid + the MLP's output) is left pending and done by the next block's
 * first op fused with its ln_1 (add_norm_forward16), or by the final norm. Checked on cuda-emu: every loss and every
 * parameter of a step (2 micro-batches) equal in bits with the fusion switched off (FITLLM_CUDA_XBLOCK_NORM=0: the
 * block's own add),
 * and fewer add / norm launches with it on, for LLaMA bf16-true (with and without activation checkpointing, whose
 * recompute starts from the stored row), bf16-mixed, LoRA on q, v, GPT-2 and OPT (LayerNorm), FULL_SHARD at 2 thread
 * ranks (each block's parameters gathered with its own group, the norm weight the fused op reads among them) and a
 * pipeline of 2 stages (the first stage's last block sends its row: not deferred). A bad FITLLM_CUDA_XBLOCK_NORM value
 * fails the run naming it. Tensor parallel at 2 keeps every add (ln_1's output is stored after the backward's
 * ALLREDUCE op on it: neither norm fuses, as before): the same bits and launches. */
#include <stdlib.h>
#include <string.h>

#include "fitllm/comm.h"
#include "fitllm/config.h"
#include "fitllm/trainer.h"
#include "test.h"
#ifdef FL_HAVE_CUDA_EMU
#include "backend/cuda/emu/cu_emu.h"
#endif

#ifdef FL_HAVE_CUDA_EMU
enum { XB_RANKS = 2 };

typedef fl_test_step_rec xb_rec; /* (tests/main.c: fl_test_record_step) */

typedef struct {
    fl_run_config cfg;
    xb_rec rec[XB_RANKS];
    fl_status st[XB_RANKS];
} xb_job;

static fl_status xb_rank(fl_comm *c, int rank, void *ud) {
    xb_job *j = ud;
    j->st[rank] = fl_trainer_run_comm(&j->cfg, c, NULL, 0, fl_test_record_step, &j->rec[rank], NULL);
    return j->st[rank];
}

/* 1 step of 2 micro-batches of 1 x 8 tokens from a random init of `preset` (the LoRA case fine-tunes it with
 * adapters on q, v), no validation. ranks 2: strategy or pipeline_parallel 2 over thread ranks. */
static fl_status xb_run(xb_job *j, const char *preset, const char *prec, int ckpt, int lora, int ranks, int pp,
                        const char *tag) { /* pp: 2 = pipeline_parallel 2, -2 = tensor_parallel 2 */
    fl_run_config *c = &j->cfg;
    char out[160];
    snprintf(out, sizeof out, "xblock-%s-%s-%s", preset, prec, tag);
    fl_test_tiny_run_config(c, lora ? FL_CMD_FINETUNE_LORA : FL_CMD_FINETUNE_FULL, preset, out, 8);
    c->train.global_batch_size = 2 * (ranks > 1 && !pp ? ranks : 1); /* FULL_SHARD: data-parallel ranks */
    c->train.max_norm = 1.0f;
    c->devices = ranks;
    if (ranks > 1) snprintf(c->strategy, sizeof c->strategy, "%s", pp ? "ddp" : "fsdp");
    if (pp > 0) c->pipeline_parallel = pp;
    if (pp < 0) c->tensor_parallel = -pp;
    if (lora) c->lora.query = c->lora.value = 1, c->lora.mlp = 0;
    FL_TRY(fl_cfg_set(c, "precision", prec));
    if (ckpt) FL_TRY(fl_cfg_set(c, "train.activation_checkpointing", "true"));
    setenv("FITLLM_BACKEND", "cuda-emu", 1);
    fl_status s = ranks > 1 ? fl_comm_threads_run(ranks, xb_rank, j)
                            : fl_trainer_run(c, NULL, 0, fl_test_record_step, &j->rec[0], NULL);
    unsetenv("FITLLM_BACKEND");
    return s;
}

static void xb_free(xb_job *j) {
    for (int r = 0; r < XB_RANKS; r++) free(j->rec[r].params);
    free(j);
}

/* The same run with the fusion off and on: the same bits on every rank (the last stage's losses: rank 1 of a
 * pipeline), and fewer add / norm launches with it. */
static const char *xb_par(int pp) { return pp > 0 ? " pipeline" : pp < 0 ? " tensor parallel" : ""; }
static void xb_case(const char *preset, const char *prec, int ckpt, int lora, int ranks, int pp) {
    xb_job *off = calloc(1, sizeof *off), *on = calloc(1, sizeof *on);
    FL_REQUIRE(off && on);
    /* the pending add as an add (FITLLM_CUDA_RESGEMM=0): with the sum in the down projection's GEMM there is none */
    setenv("FITLLM_CUDA_RESGEMM", "0", 1);
    setenv("FITLLM_CUDA_XBLOCK_NORM", "0", 1);
    unsigned long n0 = fl_cu_emu_norm_add_launches;
    fl_status s = xb_run(off, preset, prec, ckpt, lora, ranks, pp, "off");
    const unsigned long n_off = fl_cu_emu_norm_add_launches - n0;
    unsetenv("FITLLM_CUDA_XBLOCK_NORM");
    FL_CHECKF(s == FL_OK, "%s %s unfused: %s", preset, prec, fl_error_message());
    n0 = fl_cu_emu_norm_add_launches;
    s = xb_run(on, preset, prec, ckpt, lora, ranks, pp, "on");
    const unsigned long n_on = fl_cu_emu_norm_add_launches - n0;
    unsetenv("FITLLM_CUDA_RESGEMM");
    FL_CHECKF(s == FL_OK, "%s %s fused: %s", preset, prec, fl_error_message());
    for (int r = 0; s == FL_OK && r < ranks; r++) {
        const xb_rec *a = &off->rec[r], *b = &on->rec[r];
        FL_CHECKF(a->steps == 1 && b->steps == 1 && a->n && a->n == b->n && !memcmp(a->params, b->params, a->n),
                  "%s %s%s%s ranks %d%s: rank %d's parameters differ in bits with the cross-block fusion", preset,
                  prec, ckpt ? " ckpt" : "", lora ? " lora" : "", ranks, xb_par(pp), r);
        FL_CHECKF(a->loss == b->loss, "%s %s: rank %d's loss %.9g fused, %.9g unfused", preset, prec, r,
                  b->loss, a->loss);
    }
    printf("      %s %s%s%s ranks %d%s: %lu add / norm launches unfused, %lu fused\n", preset, prec, ckpt ? " ckpt" : "",
           lora ? " lora" : "", ranks, xb_par(pp), n_off, n_on);
    /* tensor parallel: ln_1's output is stored after the ALLREDUCE op on it: no norm fused, in the block or across */
    FL_CHECKF(pp < 0 ? n_on == n_off : n_on < n_off, "%s %s: %lu add / norm launches with the cross-block fusion, %lu "
              "without", preset, prec, n_on, n_off);
    xb_free(off);
    xb_free(on);
}
#endif

/* One case a test (each < 1.5 s in the release build). full: the full tier only, `covered` naming the quick-tier
 * cases that take its paths (the same fused op and fallbacks) */
#if defined(FL_HAVE_CUDA_EMU) && !defined(__SANITIZE_ADDRESS__)
#define XB_TEST(name, full, preset, prec, ckpt, lora, ranks, pp)                                                      \
    FL_TEST(name) {                                                                                                    \
        if (full && !fl_test_full_only("xblock_fuse_llama_ckpt, xblock_fuse_gpt2, xblock_fuse_fsdp, xblock_fuse_pipeline")) return;        \
        xb_case(preset, prec, ckpt, lora, ranks, pp);                                                                  \
    }
#elif defined(FL_HAVE_CUDA_EMU)
#define XB_TEST(name, full, preset, prec, ckpt, lora, ranks, pp)                                                      \
    FL_TEST(name) { fl_test_skip("the release pass runs it (emulated kernels under ASan)"); }
#else
#define XB_TEST(name, full, preset, prec, ckpt, lora, ranks, pp)                                                      \
    FL_TEST(name) { fl_test_skip("no CUDA emulator in this build"); }
#endif
/* checkpointing: the forward fuses, the recompute does the norm alone from the stored row */
XB_TEST(xblock_fuse_llama_ckpt, 0, "micro", "bf16-true", 1, 0, 1, 0)
XB_TEST(xblock_fuse_gpt2, 0, "gpt2-micro", "bf16-true", 0, 0, 1, 0)               /* LayerNorm with a bias */
XB_TEST(xblock_fuse_fsdp, 0, "micro", "bf16-true", 0, 0, 2, 0)                   /* FULL_SHARD: gathered per block */
XB_TEST(xblock_fuse_llama, 1, "micro", "bf16-true", 0, 0, 1, 0)
XB_TEST(xblock_fuse_llama_mixed, 1, "micro", "bf16-mixed", 0, 0, 1, 0)           /* the final norm: fp32 weight */
XB_TEST(xblock_fuse_lora, 1, "micro", "bf16-true", 0, 1, 1, 0)                   /* adapters on q, v */
XB_TEST(xblock_fuse_opt, 1, "opt-micro", "bf16-true", 0, 0, 1, 0)
XB_TEST(xblock_fuse_tensor_parallel, 1, "micro", "bf16-true", 0, 0, 2, -2) /* not fused: the same bits, launches */
XB_TEST(xblock_fuse_pipeline, 0, "micro", "bf16-true", 0, 0, 2, 2) /* the first stage's last block sends its row */

/* A value other than 0 / 1: the run fails naming the variable, before any step. */
FL_TEST(xblock_fuse_bad_env) {
#ifdef FL_HAVE_CUDA_EMU
    xb_job *j = calloc(1, sizeof *j);
    FL_REQUIRE(j != NULL);
    setenv("FITLLM_CUDA_XBLOCK_NORM", "yes", 1);
    fl_status s = xb_run(j, "micro", "bf16-true", 0, 0, 1, 0, "bad");
    unsetenv("FITLLM_CUDA_XBLOCK_NORM");
    FL_CHECK(s != FL_OK);
    FL_CHECKF(strstr(fl_error_message(), "FITLLM_CUDA_XBLOCK_NORM=yes") != NULL, "error: %s", fl_error_message());
    FL_CHECK(j->rec[0].steps == 0);
    xb_free(j);
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

/* LoRA / QLoRA under bf16 compute without conversions (issue 30 items 1 and 7; fl_act_opts.dy_bf16, exec.c
 * fl_linear_dx16): a frozen bf16 base linear's dx GEMM reads a bf16 dy that the op making dy writes beside it
 * (act_backward16, rope_backward16, the w16 norms) instead of the CUDA backend rounding the fp32 dy into a panel inside
 * the GEMM (convert2d); the adapters keep reading the fp32 dy. Checked on cuda-emu: every loss and every trained bit
 * of a step equal to the knob-off run (FITLLM_CUDA_LORA16=0), for LoRA on q, v and on every linear, and QLoRA (4-bit
 * bases: unchanged); the conversion launches per step as a ratchet; the WORKSPACE the dy scratch takes, planned =
 * measured; a bad knob value named. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"
#include "fitllm/config.h"
#include "fitllm/dtype.h"
#include "fitllm/trainer.h"
#include "test.h"
#ifdef FL_HAVE_CUDA_EMU
#include "backend/cuda/emu/cu_emu.h"
#endif

#ifdef FL_HAVE_CUDA_EMU
typedef fl_test_step_rec l16_rec;

/* L16_QLORA: QLoRA with FITLLM_CUDA_Q4=fp32; L16_Q4TC, L16_Q4SCRATCH: with FITLLM_CUDA_Q4=tc / scratch, the knob FITLLM_CUDA_Q4X16 (the 4-bit bases over
 * the stored bf16 x and the bf16 dy: q4_matmul_forward16 / _backward16) */
enum { L16_QV = 1, L16_ALL = 2, L16_QLORA = 3, L16_CKPT = 4, L16_Q4TC = 5, L16_Q4SCRATCH = 6, L16_Q4ALL = 7 };
static const char *l16_name(int kind) {
    return kind == L16_QV ? "LoRA q,v" : kind == L16_ALL ? "LoRA all" : kind == L16_CKPT ? "LoRA q,v ckpt"
           : kind == L16_Q4TC ? "QLoRA tc" : kind == L16_Q4SCRATCH ? "QLoRA scratch"
           : kind == L16_Q4ALL ? "QLoRA tc all" : "QLoRA fp32";
}
static const char *l16_knob(int kind) { return kind >= L16_Q4TC ? "FITLLM_CUDA_Q4X16" : "FITLLM_CUDA_LORA16"; }

/* 1 step of 2 micro-batches of 1 x 16 tokens, finetune_lora of a random-init micro (5 blocks), bf16-true;
 * *conv: the conversion launches it made (convert, convert_many, convert2d: the GEMMs' panels) */
static fl_status l16_run(l16_rec *r, int kind, const char *knob, unsigned long *conv) {
    fl_run_config c;
    char out[64];
    snprintf(out, sizeof out, "lora16-%d-%s", kind, knob ? knob : "on");
    fl_test_tiny_run_config(&c, FL_CMD_FINETUNE_LORA, "micro", out, 16);
    c.lora.query = c.lora.value = 1;
    if (kind == L16_ALL || kind == L16_Q4ALL) c.lora.key = c.lora.projection = c.lora.mlp = 1, c.lora.dropout = 0.0f; /* x widened */
    FL_TRY(fl_cfg_set(&c, "precision", "bf16-true"));
    if (kind == L16_QLORA || kind >= L16_Q4TC) FL_TRY(fl_cfg_set(&c, "quantize", "bnb.nf4"));
    if (kind >= L16_Q4TC) setenv("FITLLM_CUDA_Q4", kind == L16_Q4SCRATCH ? "scratch" : "tc", 1);
    if (kind == L16_QLORA) setenv("FITLLM_CUDA_Q4", "fp32", 1); /* the fp32 4-bit kernels (a bf16 run's default: scratch) */
    if (kind == L16_CKPT) { /* the recompute's views, the adapters reading the stored copies */
        c.lora.dropout = 0.0f;
        FL_TRY(fl_cfg_set(&c, "train.activation_checkpointing", "true"));
    }
    setenv("FITLLM_BACKEND", "cuda-emu", 1);
    if (knob) setenv(l16_knob(kind), knob, 1);
    const unsigned long c0 = fl_cu_emu_convert_launches + fl_cu_emu_convert2d_launches;
    fl_status s = fl_trainer_run(&c, NULL, 0, fl_test_record_step, r, NULL);
    *conv = fl_cu_emu_convert_launches + fl_cu_emu_convert2d_launches - c0;
    unsetenv(l16_knob(kind));
    unsetenv("FITLLM_CUDA_Q4");
    unsetenv("FITLLM_BACKEND");
    return s;
}

/* knob off, then on: the same bits; the conversion launches of each (want_off, want_on: the ratchet) */
static void l16_case(int kind, unsigned long want_off, unsigned long want_on) {
    l16_rec off = {0}, on = {0};
    unsigned long n_off = 0, n_on = 0;
    fl_status s = l16_run(&off, kind, "0", &n_off);
    FL_CHECKF(s == FL_OK, "%s, %s=0: %s", l16_name(kind), l16_knob(kind), fl_error_message());
    if (s == FL_OK) s = l16_run(&on, kind, NULL, &n_on);
    FL_CHECKF(s == FL_OK, "%s: %s", l16_name(kind), fl_error_message());
    if (s == FL_OK) {
        FL_CHECKF(off.steps == 1 && on.steps == 1 && off.n && off.n == on.n && !memcmp(off.params, on.params, off.n),
                  "%s bf16-true: the trained parameters differ in bits with %s on and off", l16_name(kind),
                  l16_knob(kind));
        FL_CHECKF(off.loss == on.loss, "%s: loss %.9g on, %.9g off", l16_name(kind), on.loss, off.loss);
        FL_CHECKF(n_off == want_off && n_on == want_on,
                  "%s: %lu conversion launches with the knob off, %lu on; expected %lu -> %lu", l16_name(kind), n_off,
                  n_on, want_off, want_on);
        printf("      %-9s bf16-true loss %.6f (equal bits); conversion launches per step %lu -> %lu\n", l16_name(kind),
               on.loss, n_off, n_on);
    }
    free(off.params);
    free(on.params);
}
#endif

FL_TEST(cuda_emu_lora16_bits) {
#ifdef FL_HAVE_CUDA_EMU
    if (!fl_test_asan_budget()) return; /* emulated training runs (~1 s): the release pass */
    /* per step (2 micro-batches): the frozen bases' dx GEMMs' dy panels (19 a micro-batch: 4 linears in each of 5
     * blocks, block 0's q|k|v dx skipped, and the frozen head's: cross_entropy_dbf16 writes its bf16 dlogits) and
     * the adapted inputs' widening before each block's backward (5 a micro-batch) go; left: the head forward's x
     * panel (1 a micro-batch). LoRA q,v with dropout 0.05: the adapters read their dropped copy, so the input is not
     * widened; on every linear without dropout the adapters read x, widened once per block (one convert_many) */
    l16_case(L16_QV, 52, 2);
    if (!fl_test_quick()) { /* the full tier (a second each) */
        l16_case(L16_ALL, 52, 12);
        l16_case(L16_QLORA, 14, 2); /* 4-bit bases: q4_matmul_backward reads the fp32 dy (no panel); the widening goes */
        l16_case(L16_CKPT, 52, 12); /* checkpointed: each block's input widened for its recompute (5 a micro-batch) */
    }
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

/* QLoRA's 4-bit bases over the stored bf16 input and the bf16 dy (FL_CAP_Q4X16: FITLLM_CUDA_Q4=tc | scratch): the
 * same loss and trained bits as FITLLM_CUDA_Q4X16=0, for both paths; conversion launches per step as a ratchet */
FL_TEST(cuda_emu_q416_bits) {
#ifdef FL_HAVE_CUDA_EMU
    if (!fl_test_asan_budget()) return; /* emulated training runs: the release pass */
    /* conversions per step: tc 2 -> 2 (the head forward's x panel, 1 a micro-batch, either way: the tc kernels round
     * x / dy as they load them; the bytes saved: cuda_emu_q416_workspace); scratch 136 -> 2 (each 4-bit matmul's
     * F32 x bf16 GEMM rounded its fp32 x / dy into a panel, convert2d, 67 a micro-batch) */
    l16_case(L16_Q4TC, 2, 2);
    if (!fl_test_quick()) { /* the full tier */
        l16_case(L16_Q4SCRATCH, 136, 2);
        l16_case(L16_Q4ALL, 12, 12); /* adapters on every linear without dropout: they read x (widened once a block) and
                                       * the fp32 dy; the bases the bf16 copies */
    }
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

FL_TEST(cuda_emu_lora16_bad_knob) {
#ifdef FL_HAVE_CUDA_EMU
    l16_rec r = {0};
    unsigned long n = 0;
    fl_status s = l16_run(&r, L16_QV, "yes", &n);
    FL_CHECKF(s != FL_OK && strstr(fl_error_message(), "FITLLM_CUDA_LORA16=yes"), "status %d: %s", (int)s,
              s == FL_OK ? "ok" : fl_error_message());
    free(r.params);
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}


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
typedef struct {
    double loss;
    unsigned char *params;
    size_t n;
    long steps;
} l16_rec;

static int l16_record(void *ud, long step, double loss, const void *params, size_t bytes) {
    l16_rec *r = ud;
    if (step == 1) r->loss = loss;
    r->steps = step;
    free(r->params);
    r->params = malloc(bytes + 1);
    if (!r->params) return 1;
    memcpy(r->params, params, bytes);
    r->n = bytes;
    return 0;
}

enum { L16_QV = 1, L16_ALL = 2, L16_QLORA = 3, L16_CKPT = 4 };
static const char *l16_name(int kind) {
    return kind == L16_QV ? "LoRA q,v" : kind == L16_ALL ? "LoRA all" : kind == L16_CKPT ? "LoRA q,v ckpt" : "QLoRA";
}

/* 1 step of 2 micro-batches of 1 x 16 tokens, finetune_lora of a random-init micro (5 blocks), bf16-true;
 * *conv: the conversion launches it made (convert, convert_many, convert2d: the GEMMs' panels) */
static fl_status l16_run(l16_rec *r, int kind, const char *knob, unsigned long *conv) {
    fl_run_config c;
    char out[64];
    snprintf(out, sizeof out, "lora16-%d-%s", kind, knob ? knob : "on");
    fl_test_tiny_run_config(&c, FL_CMD_FINETUNE_LORA, "micro", out, 16);
    c.lora.query = c.lora.value = 1;
    if (kind == L16_ALL) c.lora.key = c.lora.projection = c.lora.mlp = 1, c.lora.dropout = 0.0f; /* lora_backward_x16 */
    FL_TRY(fl_cfg_set(&c, "precision", "bf16-true"));
    if (kind == L16_QLORA) FL_TRY(fl_cfg_set(&c, "quantize", "bnb.nf4"));
    if (kind == L16_CKPT) { /* the recompute's views, the adapters reading the stored copies */
        c.lora.dropout = 0.0f;
        FL_TRY(fl_cfg_set(&c, "train.activation_checkpointing", "true"));
    }
    setenv("FITLLM_BACKEND", "cuda-emu", 1);
    if (knob) setenv("FITLLM_CUDA_LORA16", knob, 1);
    const unsigned long c0 = fl_cu_emu_convert_launches + fl_cu_emu_convert2d_launches;
    fl_status s = fl_trainer_run(&c, NULL, 0, l16_record, r, NULL);
    *conv = fl_cu_emu_convert_launches + fl_cu_emu_convert2d_launches - c0;
    unsetenv("FITLLM_CUDA_LORA16");
    unsetenv("FITLLM_BACKEND");
    return s;
}

/* knob off, then on: the same bits; the conversion launches of each (want_off, want_on: the ratchet) */
static void l16_case(int kind, unsigned long want_off, unsigned long want_on) {
    l16_rec off = {0}, on = {0};
    unsigned long n_off = 0, n_on = 0;
    fl_status s = l16_run(&off, kind, "0", &n_off);
    FL_CHECKF(s == FL_OK, "%s, FITLLM_CUDA_LORA16=0: %s", l16_name(kind), fl_error_message());
    if (s == FL_OK) s = l16_run(&on, kind, NULL, &n_on);
    FL_CHECKF(s == FL_OK, "%s: %s", l16_name(kind), fl_error_message());
    if (s == FL_OK) {
        FL_CHECKF(off.steps == 1 && on.steps == 1 && off.n && off.n == on.n && !memcmp(off.params, on.params, off.n),
                  "%s bf16-true: the trained parameters differ in bits with FITLLM_CUDA_LORA16 on and off", l16_name(kind));
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
     * panel (1 a micro-batch). LoRA q,v with dropout 0.05 (the adapters read their dropped copy), on every linear
     * without dropout (lora_backward_x16 over the stored bf16 inputs) */
    l16_case(L16_QV, 52, 2);
    if (!fl_test_quick()) { /* the full tier (a second each) */
        l16_case(L16_ALL, 52, 2);
        l16_case(L16_QLORA, 14, 2); /* 4-bit bases: q4_matmul_backward reads the fp32 dy (no panel); the widening goes */
        l16_case(L16_CKPT, 52, 12); /* checkpointed: each block's input widened for its recompute (5 a micro-batch) */
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

/* The backend op lora_backward_x16 (cuda, cuda-emu; cuda only: cpu / ref / opaque compute in fp32 and keep x's view):
 * dx, dA, dB the bits of lora_backward on the widened input (dropout 0) at odd shapes (a partial 64-column block, a
 * fused output's row stride ldy > out, r 1, one row, N past one block's rows), two shuffle seeds; dA within
 * 2^-23 of float64's sum of magnitudes (g = dy B is rounded to fp32 once, the sum and the update once more); bad
 * arguments refused by name. */
#ifdef FL_HAVE_CUDA_EMU
static void x16_case(const fl_backend *be, int N, int in, int out, int r, int ldy) {
    fl_test_rng rg = {(uint64_t)(N * 131 + in * 7 + out * 3 + r)};
    const float sc = 0.625f;
    float *dy = fl_test_frand(&rg, (size_t)N * ldy, -1, 1), *h = fl_test_frand(&rg, (size_t)N * r, -1, 1);
    float *A = fl_test_frand(&rg, (size_t)r * in, -1, 1), *Bm = fl_test_frand(&rg, (size_t)out * r, -1, 1);
    float *xf = fl_test_frand(&rg, (size_t)N * in, -3, 3);
    float *dA0 = fl_test_frand(&rg, (size_t)r * in, -1, 1), *dB0 = fl_test_frand(&rg, (size_t)out * r, -1, 1);
    float *dx0 = fl_test_frand(&rg, (size_t)N * in, -1, 1);
    uint16_t *x16 = malloc((size_t)N * in * 2);
    FL_REQUIRE_OK(fl_convert(x16, FL_BF16, xf, FL_F32, (size_t)N * in));
    FL_REQUIRE_OK(fl_convert(xf, FL_F32, x16, FL_BF16, (size_t)N * in)); /* x = widen(x16) exactly */
    const size_t na = (size_t)r * in, nb = (size_t)out * r, nx = (size_t)N * in;
    float *w = malloc((size_t)N * (r + in) * 4), *o[2][3];
    for (int v = 0; v < 2; v++) {
        o[v][0] = malloc(nx * 4), o[v][1] = malloc(na * 4), o[v][2] = malloc(nb * 4);
        memcpy(o[v][0], dx0, nx * 4), memcpy(o[v][1], dA0, na * 4), memcpy(o[v][2], dB0, nb * 4);
    }
    FL_REQUIRE_OK(be->lora_backward(be, o[0][0], o[0][1], o[0][2], dy, ldy, xf, h, A, Bm, N, in, out, r, sc, 0.0f, 0, w));
    for (int s = 0; s < 2; s++) {
        fl_cu_emu_set_seed(s ? 0x5eed : 0);
        memcpy(o[1][0], dx0, nx * 4), memcpy(o[1][1], dA0, na * 4), memcpy(o[1][2], dB0, nb * 4);
        FL_REQUIRE_OK(be->lora_backward_x16(be, o[1][0], o[1][1], o[1][2], dy, ldy, x16, h, A, Bm, N, in, out, r, sc, w));
        FL_CHECKF(!memcmp(o[0][0], o[1][0], nx * 4) && !memcmp(o[0][1], o[1][1], na * 4) &&
                      !memcmp(o[0][2], o[1][2], nb * 4),
                  "lora_backward_x16 N %d in %d out %d r %d ldy %d: dx, dA or dB not lora_backward's bits on widen(x16)",
                  N, in, out, r, ldy);
    }
    int ok = 1;
    for (int i = 0; i < r; i++) /* float64: dA0 + sc sum_p (dy B)[p, i] x[p, j] */
        for (int j = 0; j < in; j++) {
            double want = dA0[(size_t)i * in + j], mag = fabs(want);
            for (int p = 0; p < N; p++) {
                double g = 0;
                for (int c = 0; c < out; c++) g += (double)dy[(size_t)p * ldy + c] * Bm[(size_t)c * r + i];
                want += sc * g * xf[(size_t)p * in + j], mag += fabs(sc * g * xf[(size_t)p * in + j]);
            }
            ok &= fabs(o[1][1][(size_t)i * in + j] - want) <= 0x1p-23 * mag + 1e-30;
        }
    FL_CHECKF(ok, "lora_backward_x16 N %d in %d out %d r %d: dA beyond 2^-23 of float64", N, in, out, r);
    for (int v = 0; v < 2; v++) free(o[v][0]), free(o[v][1]), free(o[v][2]);
    free(dy), free(h), free(A), free(Bm), free(xf), free(dA0), free(dB0), free(dx0), free(x16), free(w);
}
#endif

FL_TEST(cuda_emu_lora_backward_x16) {
#ifdef FL_HAVE_CUDA_EMU
    static const char *const others[] = {"cpu", "ref", "opaque"};
    for (int k = 0; k < 3; k++) {
        fl_backend o;
        FL_REQUIRE_OK(fl_backend_init_by_name(others[k], &o, 1));
        FL_CHECKF(o.lora_backward_x16 == NULL, "%s has lora_backward_x16 (this test checks only cuda-emu's)", others[k]);
        fl_backend_free(&o);
    }
    fl_backend be;
    FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
    FL_REQUIRE(be.lora_backward_x16 != NULL);
    x16_case(&be, 37, 70, 33, 5, 40);
    x16_case(&be, 1, 1, 1, 1, 1);
    x16_case(&be, 130, 129, 9, 3, 9);
    /* x16 widened a column tile at a time into the panel (the emulated backend's: 64 KiB), each tile an fp32 GEMM over
     * all N rows: 130 x 129 above takes 126 + 3 columns, 300 x 200 takes 54 + 54 + 54 + 38; still lora_backward's bits */
    x16_case(&be, 300, 200, 7, 4, 7);
    float f[4] = {0};
    FL_CHECK(be.lora_backward_x16(&be, f, f, f, f, 1, NULL, f, f, f, 1, 1, 1, 1, 1.0f, f) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "x16"));
    FL_CHECK(be.lora_backward_x16(&be, f, f, f, f, 1, f, f, f, f, 1, 1, 2, 1, 1.0f, f) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "ldy=1"));
    fl_backend_free(&be);
    setenv("FITLLM_CUDA_LORA16", "0", 1); /* the A/B knob leaves the slot out */
    FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
    unsetenv("FITLLM_CUDA_LORA16");
    FL_CHECK(be.lora_backward_x16 == NULL);
    fl_backend_free(&be);
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

/* The residual stream held in bf16 (issue 30 item 1, FL_CAP_STREAM16: cuda, cuda-emu; FITLLM_CUDA_STREAM16=0 off).
 * Under a bf16 store the residual rows' fp32 views hold the exact widening of the stored bf16 rows, so the residual
 * adds read their residual operand from the bf16 copy (add_norm_forward16_b16) and the stream's fp32 rows buffers and
 * the mid residual's view share ONE WORKSPACE buffer (fl_block_stream16, acts.c carve_work16). Checked here:
 *   - the op: add_norm_forward16_b16 is the bits of add_norm_forward16 (norm) / add16 (alone) over the widened b16,
 *     every output, at odd shapes (C not a multiple of 4 or 8, one row, a row longer than one thread stride), the
 *     pointers aligned or one element off (the element paths), res aliasing a (as the model calls it) and res NULL;
 *   - the model: bf16-true training steps on cuda-emu with the knob off and on give the same loss and parameter bits
 *     for LLaMA (with and without checkpointing, LoRA on q, v; bf16-mixed in the full tier), GPT-2 and OPT;
 *   - the bytes: WORKSPACE's peak is smaller by exactly two (N, C) fp32 buffers (the second rows buffer and the mid
 *     residual's view), planned (the null backend standing in for cuda-emu) = measured, both settings;
 *   - a bad knob value is refused at set-up, by name; a binding changed after set-up so that a pass would read a
 *     shared view (the w16 RMSNorm backward taken away: ln_1's backward would read the input's fp32 rows) fails the
 *     pass naming the slot, before any op. */
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda-impl.h"
#include "fitllm/config.h"
#include "fitllm/dtype.h"
#include "fitllm/trainer.h"
#include "model/model-impl.h"
#include "test.h"

#ifdef FL_HAVE_CUDA_EMU
static uint32_t s16_rng = 12345u;
static float s16_rand(void) {
    s16_rng = s16_rng * 1664525u + 1013904223u;
    return (float)((s16_rng >> 8) & 0xffff) / 65536.0f * 4.0f - 2.0f;
}

/* one shape: the _b16 op against the fp32-operand op over the widened copy, every output's bits */
static void op_case(const fl_backend *be, int ln, int N, int C, fl_dtype wt, int mis, int alias, int no_res, int norm) {
    const size_t n = (size_t)N * C, pad = n + 8;
    float *a = calloc(pad, 4), *a2 = calloc(pad, 4), *bw = calloc(pad, 4), *res = calloc(pad, 4), *res2 = calloc(pad, 4);
    float *out = calloc(pad, 4), *out2 = calloc(pad, 4), *st = calloc(4 * (size_t)N + 8, 4);
    uint16_t *b16 = calloc(pad, 2), *r16 = calloc(pad, 2), *r16b = calloc(pad, 2), *o16 = calloc(pad, 2),
             *o16b = calloc(pad, 2), *w16 = calloc((size_t)C + 8, 2), *bias16 = calloc((size_t)C + 8, 2);
    float *w = calloc((size_t)C + 8, 4), *bias = calloc((size_t)C + 8, 4);
    FL_REQUIRE(a && a2 && bw && res && res2 && out && out2 && st && b16 && r16 && r16b && o16 && o16b && w16 && bias16 &&
               w && bias);
    const int m = mis ? 1 : 0; /* a and b16 one element off: the element paths */
    for (size_t i = 0; i < n; i++) {
        a[m + i] = a2[m + i] = s16_rand();
        b16[m + i] = fl_f32_to_bf16(s16_rand());
        bw[i] = fl_bf16_to_f32(b16[m + i]);
    }
    for (int c = 0; c < C; c++) {
        w[c] = 1.0f + 0.25f * s16_rand(), bias[c] = 0.1f * s16_rand();
        w16[c] = fl_f32_to_bf16(w[c]), bias16[c] = fl_f32_to_bf16(bias[c]);
        if (wt == FL_BF16) w[c] = fl_bf16_to_f32(w16[c]), bias[c] = fl_bf16_to_f32(bias16[c]);
    }
    const void *wv = wt == FL_BF16 ? (const void *)w16 : (const void *)w, *bv = wt == FL_BF16 ? (const void *)bias16
                                                                                               : (const void *)bias;
    float *ra = alias ? a + m : res, *rb = alias ? a2 + m : res2; /* the model: res == a (the projection's output) */
    if (no_res) ra = rb = NULL;
    float *mean = st, *rstd = st + N, *mean2 = st + 2 * N, *rstd2 = st + 3 * N;
    fl_status s1, s2;
    if (norm) {
        s1 = be->add_norm_forward16(be, ln, rb ? rb : res2, r16, out, o16, ln ? mean : NULL, rstd, a2 + m, bw, wv,
                                    ln ? bv : NULL, wt, N, C, 1e-5f);
        s2 = be->add_norm_forward16_b16(be, ln, ra, r16b, out2, o16b, ln ? mean2 : NULL, rstd2, a + m, b16 + m, wv,
                                        ln ? bv : NULL, wt, N, C, 1e-5f);
    } else {
        s1 = be->add16(be, rb ? rb : res2, r16, a2 + m, bw, n);
        s2 = be->add_norm_forward16_b16(be, 0, ra, r16b, NULL, NULL, NULL, NULL, a + m, b16 + m, NULL, NULL, FL_F32, N, C,
                                        0.0f);
    }
    FL_CHECKF(s1 == FL_OK && s2 == FL_OK, "ln %d %dx%d: status %d / %d: %s", ln, N, C, (int)s1, (int)s2,
              fl_error_message());
    const char *what = NULL;
    if (memcmp(r16, r16b, n * 2)) what = "res16";
    else if (ra && memcmp(rb, ra, n * 4)) what = "res";
    else if (norm && memcmp(o16, o16b, n * 2)) what = "out16";
    else if (norm && memcmp(out, out2, n * 4)) what = "out";
    else if (norm && memcmp(rstd, rstd2, (size_t)N * 4)) what = "rstd";
    else if (norm && ln && memcmp(mean, mean2, (size_t)N * 4)) what = "mean";
    FL_CHECKF(!what, "%s ln %d N %d C %d wt %s mis %d alias %d no_res %d: %s differs from the fp32-operand op", norm ?
              "add + norm" : "add", ln, N, C, fl_dtype_name(wt), mis, alias, no_res, what);
    void *all[] = {a, a2, bw, res, res2, out, out2, st, b16, r16, r16b, o16, o16b, w16, bias16, w, bias};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}
#endif

FL_TEST(cuda_emu_stream16_op) {
#ifdef FL_HAVE_CUDA_EMU
    fl_backend be;
    FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
    FL_REQUIRE(be.add_norm_forward16_b16 != NULL && (be.caps & FL_CAP_STREAM16));
    /* one element; C odd; C % 8 == 0; C % 4 == 0 only; C / 4 > 256 (two strides); many rows of an odd C */
    static const int shapes[][2] = {{1, 1}, {3, 37}, {5, 64}, {4, 100}, {2, 1032}, {9, 13}};
    int cases = 0;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        for (int v = 0; v < 8; v++) { /* mis, alias, no_res */
            const int mis = v & 1, alias = v >> 1 & 1, no_res = v >> 2 & 1;
            if (alias && no_res) continue;
            op_case(&be, 0, shapes[i][0], shapes[i][1], FL_F32, mis, alias, no_res, 0), cases++;
            for (int ln = 0; ln < 2; ln++)
                for (int t = 0; t < 2; t++)
                    op_case(&be, ln, shapes[i][0], shapes[i][1], t ? FL_BF16 : FL_F32, mis, alias, no_res, 1), cases++;
        }
    printf("      %d shapes x layouts: add_norm_forward16_b16 = the fp32-operand ops in bits\n", cases);
    /* refused by name: no b16; a norm without its weight */
    float f = 0;
    uint16_t h = 0;
    FL_CHECK(be.add_norm_forward16_b16(&be, 0, &f, &h, NULL, NULL, NULL, NULL, &f, NULL, NULL, NULL, FL_F32, 1, 1, 0) ==
                 FL_ERR_INVALID && strstr(fl_error_message(), "add_norm_forward16_b16"));
    FL_CHECK(be.add_norm_forward16_b16(&be, 0, &f, &h, &f, &h, NULL, &f, &f, &h, NULL, NULL, FL_F32, 1, 1, 0) ==
                 FL_ERR_INVALID && strstr(fl_error_message(), "add_norm_forward16_b16"));
    fl_backend_free(&be);
    /* the CPU backends lack it (NULL: the fp32 rows kept) */
    fl_backend cpu;
    FL_REQUIRE_OK(fl_backend_init_by_name("cpu", &cpu, 1));
    FL_CHECK(cpu.add_norm_forward16_b16 == NULL && !(cpu.caps & FL_CAP_STREAM16));
    fl_backend_free(&cpu);
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

#ifdef FL_HAVE_CUDA_EMU
enum { WB = 2, WT = 24 };
/* WORKSPACE's peak of one rehearsed step (null: planned on the stand-in, else measured on cuda-emu) */
static size_t ws_peak(int null, const char *knob, const char *preset, const char *prec, int ckpt, int lora) {
    setenv("FITLLM_CUDA_STREAM16", knob, 1);
    fl_cuemu_set_host_memory(0); /* the GPU's paths: a device pool beside the host one */
    fl_backend be;
    fl_status s = null ? fl_null_backend_init_for(&be, "cuda-emu") : fl_backend_init_by_name("cuda-emu", &be, 1);
    fl_cuemu_set_host_memory(1);
    unsetenv("FITLLM_CUDA_STREAM16");
    FL_CHECKF(s == FL_OK, "backend: %s", fl_error_message());
    if (s != FL_OK) return 0;
    fl_run_config c;
    fl_cfg_defaults(&c, lora ? FL_CMD_FINETUNE_LORA : FL_CMD_FINETUNE_FULL);
    snprintf(c.checkpoint_dir, sizeof c.checkpoint_dir, "%s", preset);
    c.train.max_seq_length = WT;
    fl_trainer_result r;
    memset(&r, 0, sizeof r);
    fl_model_config mc;
    s = fl_cfg_set(&c, "precision", prec);
    if (s == FL_OK && ckpt) s = fl_cfg_set(&c, "train.activation_checkpointing", "true");
    if (s == FL_OK) s = fl_preset_find(preset, &mc);
    if (s == FL_OK) s = fl_trainer_rehearse(&c, &mc, &be, 0, WB, WT, 1, 0, &r);
    if (null) fl_null_backend_free(&be);
    else fl_backend_free(&be);
    FL_CHECKF(s == FL_OK, "%s %s rehearsal: %s", preset, prec, fl_error_message());
    return r.peak[FL_TAG_WORKSPACE];
}

/* off - on = the two (N, C) fp32 buffers no longer carved; planned = measured both ways */
static void ws_case(const char *preset, const char *prec, int ckpt, int lora, int measure) {
    fl_model_config mc;
    FL_REQUIRE_OK(fl_preset_find(preset, &mc));
    const size_t buf = ((size_t)WB * WT * mc.dim * sizeof(float) + 63) / 64 * 64;
    const size_t off = ws_peak(1, "0", preset, prec, ckpt, lora), on = ws_peak(1, "1", preset, prec, ckpt, lora);
    FL_CHECKF(off == on + 2 * buf, "%s %s%s%s: WORKSPACE %zu with the fp32 rows, %zu without: expected %zu fewer",
              preset, prec, ckpt ? " ckpt" : "", lora ? " lora" : "", off, on, 2 * buf);
    printf("      %-10s %-10s%s%s WORKSPACE %zu -> %zu bytes (2 x %zu)\n", preset, prec, ckpt ? " ckpt" : "",
           lora ? " lora" : "", off, on, buf);
    if (!measure) return;
    const size_t moff = ws_peak(0, "0", preset, prec, ckpt, lora), mon = ws_peak(0, "1", preset, prec, ckpt, lora);
    FL_CHECKF(moff == off && mon == on, "%s %s: planned %zu / %zu, measured %zu / %zu (off / on)", preset, prec, off,
              on, moff, mon);
}
#endif

#if defined(FL_HAVE_CUDA_EMU) && !defined(__SANITIZE_ADDRESS__)
#define S16_TEST(name, full, preset, prec, ckpt, lora)                                                                \
    FL_TEST(name) {                                                                                                    \
        if (full && !fl_test_full_only("cuda_emu_stream16_llama_ckpt, cuda_emu_stream16_gpt2")) return;               \
        fl_test_emu_knob_ab("FITLLM_CUDA_STREAM16", "stream16", preset, prec, ckpt, lora);                            \
    }
#elif defined(FL_HAVE_CUDA_EMU)
#define S16_TEST(name, full, preset, prec, ckpt, lora)                                                                \
    FL_TEST(name) { fl_test_skip("the release pass runs it (emulated kernels under ASan)"); }
#else
#define S16_TEST(name, full, preset, prec, ckpt, lora)                                                                \
    FL_TEST(name) { fl_test_skip("no CUDA emulator in this build"); }
#endif
S16_TEST(cuda_emu_stream16_llama_ckpt, 0, "micro", "bf16-true", 1, 0) /* the recompute from the widened input row */
S16_TEST(cuda_emu_stream16_gpt2, 0, "gpt2-micro", "bf16-true", 0, 0)   /* LayerNorm with a bias */
S16_TEST(cuda_emu_stream16_llama, 1, "micro", "bf16-true", 0, 0)
S16_TEST(cuda_emu_stream16_lora, 1, "micro", "bf16-true", 0, 1) /* adapters on q, v */
S16_TEST(cuda_emu_stream16_mixed, 1, "micro", "bf16-mixed", 0, 0)
S16_TEST(cuda_emu_stream16_opt, 1, "opt-micro", "bf16-true", 0, 0)

FL_TEST(cuda_emu_stream16_workspace) {
#ifdef FL_HAVE_CUDA_EMU
    ws_case("micro", "bf16-true", 0, 0, !fl_test_asan_light());
    ws_case("micro", "bf16-true", 1, 0, 0);
    ws_case("micro", "bf16-true", 0, 1, 0);
    ws_case("gpt2-micro", "bf16-true", 0, 0, 0);
    ws_case("opt-micro", "bf16-true", 0, 0, 0);
    fl_test_emu_knob_refused("FITLLM_CUDA_STREAM16");
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

FL_TEST(cuda_emu_stream16_wrong_decision_fails) {
#ifdef FL_HAVE_CUDA_EMU
    fl_backend be;
    fl_mem_pool pool, host;
    fl_model m;
    enum { B = 2, T = 8 };
    FL_REQUIRE_OK(fl_test_emu_micro(&be, &pool, &host, &m, "stream16", B, T));
    const int V = m.cfg.vocab_size;
    FL_REQUIRE(m.acts->stream16 & 1u); /* the premise: the input rows' view shared */
    int32_t ids[B * T];
    for (int i = 0; i < B * T; i++) ids[i] = i % V;
    FL_REQUIRE_OK(fl_model_forward(&m, ids, NULL, B, T, 0.0f, NULL)); /* as decided: fine */
    be.rmsnorm_backward_w16 = NULL; /* now ln_1's backward would read the input's fp32 view */
    fl_status s = fl_model_forward(&m, ids, NULL, B, T, 0.0f, NULL);
    FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "fp32 view of 'x'") &&
                  strstr(fl_error_message(), "residual stream"),
              "status %d: %s", (int)s, s == FL_OK ? "ok" : fl_error_message());
    fl_test_emu_micro_free(&be, &pool, &host, &m);
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

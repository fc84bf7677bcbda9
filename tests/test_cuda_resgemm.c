/* The residual add inside its projection's GEMM (issue 30 items 1 and 3; cuda, cuda-emu; FITLLM_CUDA_RESGEMM=0 off).
 * Under a bf16 store with the residual stream in bf16 (FL_CAP_STREAM16), LLaMA's o and down projections write the
 * residual sum's bf16 rows themselves: gemm_res16, cuBLASLt's C the stored residual (beta 1) and its D the sum's rows,
 * D = RNE(fp32(x W^T) + widen(C)), which is add16's RNE(y + widen(res16)) of the fp32 GEMM output y, bit for bit; the
 * add then adds nothing, its norm reads the stored sum (add_norm_forward16_b16 with a NULL). Checked here:
 *   - the op: gemm_res16 against the in-place ACC16 gemm on a copy of C, and (alpha 1) against gemm F32 + add16, in
 *     bits, at odd shapes (M, N, K not multiples of the stand-in's tiles, ldc > N: the padding untouched, C unchanged),
 *     both transpositions; overlapping C / D, K = 0 and a bad knob refused by name; FITLLM_CUDA_RESGEMM=0 and the CPU
 *     backends: no slot;
 *   - the norm of a stored sum: add_norm_forward16_b16 with a NULL = rmsnorm_forward_w16 over its widening, every
 *     output, RMSNorm only;
 *   - the model: bf16-true training steps on cuda-emu with the knob off and on give the same loss and parameter bits
 *     (LLaMA plain and checkpointed; LoRA q, v, bf16-mixed and GPT-2 (biased: not taken) in the full tier), and the
 *     on run's projections write 2 sums per block and forward pass, N x C x 4 fp32 bytes each not written. */
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda-impl.h"
#include "fitllm/config.h"
#include "fitllm/dtype.h"
#include "fitllm/trainer.h"
#include "model/model-impl.h"
#include "test.h"

#ifdef FL_HAVE_CUDA_EMU
static uint32_t rg_rng = 777u;
static float rg_rand(void) {
    rg_rng = rg_rng * 1664525u + 1013904223u;
    return (float)((rg_rng >> 8) & 0xffff) / 65536.0f * 4.0f - 2.0f;
}
static uint16_t *rg_bf16(size_t n) {
    uint16_t *p = malloc(n * 2 + 16);
    for (size_t i = 0; p && i < n; i++) p[i] = fl_f32_to_bf16(rg_rand());
    return p;
}

/* one shape: D from gemm_res16 against the in-place ACC16 gemm on a copy of C and (alpha 1) the fp32 GEMM + add16 */
static void op_case(const fl_backend *be, int ta, int tb, int M, int N, int K, int ldc, float alpha) {
    const int lda = (ta ? M : K) + 1, ldb = (tb ? K : N) + 2; /* strided operands too */
    const size_t na = (size_t)(ta ? K : M) * lda, nb = (size_t)(tb ? N : K) * ldb, nc = (size_t)M * ldc;
    uint16_t *A = rg_bf16(na), *B = rg_bf16(nb), *C = rg_bf16(nc), *C0 = malloc(nc * 2), *D = rg_bf16(nc),
             *D0 = malloc(nc * 2), *E = malloc(nc * 2), *r16 = malloc((size_t)M * N * 2);
    float *y = malloc((size_t)M * N * 4), *cw = malloc((size_t)M * N * 4);
    FL_REQUIRE(A && B && C && C0 && D && D0 && E && r16 && y && cw);
    memcpy(C0, C, nc * 2), memcpy(D0, D, nc * 2), memcpy(E, C, nc * 2);
    fl_status s1 = be->gemm_res16(be, ta, tb, M, N, K, alpha, A, lda, B, ldb, C, D, ldc);
    fl_status s2 = be->gemm(be, ta, tb, M, N, K, alpha, A, FL_BF16, lda, B, FL_BF16, ldb, 1.0f, E, FL_BF16, ldc);
    FL_CHECKF(s1 == FL_OK && s2 == FL_OK, "%dx%dx%d: status %d / %d: %s", M, N, K, (int)s1, (int)s2,
              fl_error_message());
    int bad_d = 0, bad_pad = 0, bad_add = 0;
    for (int i = 0; i < M; i++)
        for (int j = 0; j < ldc; j++) {
            const size_t k = (size_t)i * ldc + j;
            if (j < N) bad_d += D[k] != E[k];
            else bad_pad += D[k] != D0[k]; /* the padding columns: not written */
        }
    if (alpha == 1.0f) { /* the unfused path: the fp32 output y, then add16 with the widened residual */
        FL_CHECK(be->gemm(be, ta, tb, M, N, K, 1.0f, A, FL_BF16, lda, B, FL_BF16, ldb, 0.0f, y, FL_F32, N) == FL_OK);
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) cw[(size_t)i * N + j] = fl_bf16_to_f32(C[(size_t)i * ldc + j]);
        FL_CHECK(be->add16(be, y, r16, y, cw, (size_t)M * N) == FL_OK);
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) bad_add += r16[(size_t)i * N + j] != D[(size_t)i * ldc + j];
    }
    FL_CHECKF(!bad_d && !bad_pad && !bad_add && !memcmp(C, C0, nc * 2),
              "ta %d tb %d %dx%dx%d ldc %d alpha %g: %d elements differ from the in-place gemm, %d from gemm + add16, "
              "%d padding elements written, C %s", ta, tb, M, N, K, ldc, (double)alpha, bad_d, bad_add, bad_pad,
              memcmp(C, C0, nc * 2) ? "changed" : "kept");
    void *all[] = {A, B, C, C0, D, D0, E, r16, y, cw};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

/* the norm of a stored sum (a NULL) against rmsnorm_forward_w16 over its widening: every output */
static void norm_case(const fl_backend *be, int N, int C, fl_dtype wt, int no_res) {
    const size_t n = (size_t)N * C;
    uint16_t *s16 = rg_bf16(n), *s0 = malloc(n * 2), *o16 = malloc(n * 2), *o16b = malloc(n * 2), *w16 = rg_bf16(C);
    float *sw = malloc(n * 4), *res = malloc(n * 4), *out = malloc(n * 4), *out2 = malloc(n * 4),
          *rs = malloc((size_t)N * 8), *w = malloc((size_t)C * 4);
    FL_REQUIRE(s16 && s0 && o16 && o16b && w16 && sw && res && out && out2 && rs && w);
    memcpy(s0, s16, n * 2);
    for (size_t i = 0; i < n; i++) sw[i] = fl_bf16_to_f32(s16[i]);
    for (int c = 0; c < C; c++) w[c] = fl_bf16_to_f32(w16[c]);
    const void *wv = wt == FL_BF16 ? (const void *)w16 : (const void *)w;
    be->rmsnorm_forward_w16(be, out, o16, rs, sw, wv, wt, N, C, 1e-5f);
    fl_status s = be->add_norm_forward16_b16(be, 0, no_res ? NULL : res, s16, out2, o16b, NULL, rs + N, NULL, s16, wv,
                                             NULL, wt, N, C, 1e-5f);
    FL_CHECKF(s == FL_OK, "%dx%d: %s", N, C, fl_error_message());
    const char *what = memcmp(o16, o16b, n * 2)                    ? "out16"
                       : memcmp(out, out2, n * 4)                  ? "out"
                       : memcmp(rs, rs + N, (size_t)N * 4)         ? "rstd"
                       : !no_res && memcmp(res, sw, n * 4)         ? "res"
                       : memcmp(s16, s0, n * 2)                    ? "the stored sum (changed)"
                                                                   : NULL;
    FL_CHECKF(!what, "N %d C %d wt %s no_res %d: %s differs from the w16 norm of the stored sum", N, C,
              fl_dtype_name(wt), no_res, what);
    /* no norm (the add alone: nothing to add): res the stored sum's widening, the sum not written */
    memset(res, 0xff, n * 4);
    s = be->add_norm_forward16_b16(be, 0, res, s16, NULL, NULL, NULL, NULL, NULL, s16, NULL, NULL, FL_F32, N, C, 0.0f);
    FL_CHECKF(s == FL_OK && !memcmp(res, sw, n * 4) && !memcmp(s16, s0, n * 2), "N %d C %d: the widening alone: %s",
              N, C, s == FL_OK ? "differs" : fl_error_message());
    void *all[] = {s16, s0, o16, o16b, w16, sw, res, out, out2, rs, w};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}
#endif

FL_TEST(cuda_emu_resgemm_op) {
#ifdef FL_HAVE_CUDA_EMU
    fl_backend be;
    FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
    FL_REQUIRE(be.gemm_res16 != NULL);
    /* one element; odd M, N, K (the stand-in's 4 x 4 tiles cut); a row longer than a tile; K longer than N */
    static const int shapes[][3] = {{1, 1, 1}, {5, 7, 3}, {13, 37, 19}, {6, 66, 70}, {3, 9, 130}};
    int cases = 0;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        for (int v = 0; v < 4; v++) {
            const int M = shapes[i][0], N = shapes[i][1], K = shapes[i][2];
            op_case(&be, v & 1, v >> 1 & 1, M, N, K, N + 3, 1.0f), cases++;
            if (v == 2) op_case(&be, 0, 1, M, N, K, N, 0.5f), cases++; /* compact rows, alpha applied first */
        }
    printf("      %d shapes x layouts: gemm_res16 = the in-place gemm on a copy of C (and gemm + add16) in bits\n",
           cases);
    static const int nshapes[][2] = {{1, 1}, {3, 37}, {5, 64}, {2, 1032}};
    for (size_t i = 0; i < sizeof nshapes / sizeof nshapes[0]; i++)
        for (int v = 0; v < 4; v++) norm_case(&be, nshapes[i][0], nshapes[i][1], v & 1 ? FL_BF16 : FL_F32, v >> 1);
    /* refused by name: C and D overlapping; K = 0; a NULL a with LayerNorm or res16 != b16 */
    uint16_t h[64] = {0};
    float f[8] = {0};
    fl_status s;
    FL_CHECK(be.gemm_res16(&be, 0, 1, 2, 4, 2, 1.0f, h, 2, h, 2, h + 8, h + 10, 4) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "overlaps"));
    FL_CHECK(be.gemm_res16(&be, 0, 1, 2, 4, 0, 1.0f, h, 2, h, 2, h + 8, h + 32, 4) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "gemm_res16"));
    s = be.add_norm_forward16_b16(&be, 1, NULL, h, f, h + 8, f, f, NULL, h, f, f, FL_F32, 1, 4, 0);
    FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "a NULL"), "LayerNorm: status %d: %s", (int)s,
              fl_error_message());
    s = be.add_norm_forward16_b16(&be, 0, NULL, h + 4, f, h + 8, NULL, f, NULL, h, f, NULL, FL_F32, 1, 4, 0);
    FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "a NULL"), "res16 != b16: status %d: %s", (int)s,
              fl_error_message());
    fl_backend_free(&be);
    /* the knob: 0 no slot; another value refused at set-up, by name */
    setenv("FITLLM_CUDA_RESGEMM", "0", 1);
    FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
    FL_CHECK(be.gemm_res16 == NULL);
    fl_backend_free(&be);
    fl_test_emu_knob_refused("FITLLM_CUDA_RESGEMM");
    fl_backend cpu;
    FL_REQUIRE_OK(fl_backend_init_by_name("cpu", &cpu, 1));
    FL_CHECK(cpu.gemm_res16 == NULL);
    fl_backend_free(&cpu);
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

#ifdef FL_HAVE_CUDA_EMU
/* one rehearsed step of B x T on cuda-emu with FITLLM_CUDA_RESGEMM = knob: the change of its counters */
static fl_status counted(const char *knob, const char *preset, int ckpt, int B, int T, fl_cu_counters *d) {
    setenv("FITLLM_CUDA_RESGEMM", knob, 1);
    fl_backend be;
    fl_status s = fl_backend_init_by_name("cuda-emu", &be, 1);
    unsetenv("FITLLM_CUDA_RESGEMM");
    if (s != FL_OK) return s;
    fl_run_config c;
    fl_cfg_defaults(&c, FL_CMD_FINETUNE_FULL);
    snprintf(c.checkpoint_dir, sizeof c.checkpoint_dir, "%s", preset);
    c.train.max_seq_length = T;
    fl_model_config mc;
    fl_trainer_result r;
    memset(&r, 0, sizeof r);
    s = fl_cfg_set(&c, "precision", "bf16-true");
    if (s == FL_OK && ckpt) s = fl_cfg_set(&c, "train.activation_checkpointing", "true");
    if (s == FL_OK) s = fl_preset_find(preset, &mc);
    fl_cu_counters c0, c1;
    fl_cuemu_backend_counters(&be, &c0);
    if (s == FL_OK) s = fl_trainer_rehearse(&c, &mc, &be, 0, B, T, 1, 0, &r);
    fl_cuemu_backend_counters(&be, &c1);
    d->gemm_res16 = c1.gemm_res16 - c0.gemm_res16;
    d->res16_bytes = c1.res16_bytes - c0.res16_bytes;
    fl_backend_free(&be);
    return s;
}

static void ab_case(const char *preset, const char *prec, int ckpt, int lora) {
    fl_test_emu_knob_ab("FITLLM_CUDA_RESGEMM", "resgemm", preset, prec, ckpt, lora);
    if (lora || strcmp(prec, "bf16-true")) return;
    /* the sums the projections wrote: LLaMA 2 per block and forward pass (a checkpointed step: the recompute's too,
     * of every block but the last, whose activations the backward starts on: transformer.c), N x C x 4 fp32 bytes
     * each not written; GPT-2 (biased projections) none; off none */
    enum { B = 2, T = 16 };
    fl_model_config mc;
    FL_REQUIRE_OK(fl_preset_find(preset, &mc));
    fl_cu_counters a = {0}, b = {0};
    fl_status s = counted("0", preset, ckpt, B, T, &a);
    if (s == FL_OK) s = counted("1", preset, ckpt, B, T, &b);
    FL_CHECKF(s == FL_OK, "%s counted: %s", preset, fl_error_message());
    const int llama = !fl_arch_get(mc.arch)->layernorm;
    const long want = llama ? 2L * (mc.n_layers + (ckpt ? mc.n_layers - 1 : 0)) : 0;
    FL_CHECKF(a.gemm_res16 == 0 && b.gemm_res16 == want && b.res16_bytes == want * B * T * mc.dim * 4,
              "%s%s: %ld / %ld projections wrote their sums (want 0 / %ld), %ld fp32 bytes not written", preset,
              ckpt ? " ckpt" : "", a.gemm_res16, b.gemm_res16, want, b.res16_bytes);
    printf("      %s%s: %ld GEMMs wrote their residual sums, %ld fp32 bytes not written (B %d T %d)\n", preset,
           ckpt ? " ckpt" : "", b.gemm_res16, b.res16_bytes, B, T);
}
#endif

#if defined(FL_HAVE_CUDA_EMU) && !defined(__SANITIZE_ADDRESS__)
#define RG_TEST(name, full, preset, prec, ckpt, lora)                                                                 \
    FL_TEST(name) {                                                                                                    \
        if (full && !fl_test_full_only("cuda_emu_resgemm_llama, cuda_emu_resgemm_llama_ckpt")) return;                \
        ab_case(preset, prec, ckpt, lora);                                                                             \
    }
#elif defined(FL_HAVE_CUDA_EMU)
#define RG_TEST(name, full, preset, prec, ckpt, lora)                                                                 \
    FL_TEST(name) { fl_test_skip("the release pass runs it (emulated kernels under ASan)"); }
#else
#define RG_TEST(name, full, preset, prec, ckpt, lora)                                                                 \
    FL_TEST(name) { fl_test_skip("no CUDA emulator in this build"); }
#endif
RG_TEST(cuda_emu_resgemm_llama, 0, "micro", "bf16-true", 0, 0)
RG_TEST(cuda_emu_resgemm_llama_ckpt, 0, "micro", "bf16-true", 1, 0) /* the recompute takes it too */
RG_TEST(cuda_emu_resgemm_lora, 1, "micro", "bf16-true", 0, 1)       /* adapters on q, v: o and down plain */
RG_TEST(cuda_emu_resgemm_mixed, 1, "micro", "bf16-mixed", 0, 0)
RG_TEST(cuda_emu_resgemm_gpt2, 1, "gpt2-micro", "bf16-true", 0, 0) /* biased projections: today's path */

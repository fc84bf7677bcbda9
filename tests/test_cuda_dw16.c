/* A bf16-true step's weight gradients written by their GEMMs straight into the bf16 gradient (issue 30 item 1:
 * FL_OP_GEMM_ACC16, src/model/store.c fl_store_direct16) instead of an fp32 stage zeroed, accumulated into and added
 * back by accumulate16. Checked here:
 *   - the op on cuda-emu (the cuBLASLt stand-in): D = C = bf16(fp32 sum + C) at odd shapes, a padded C and alpha != 1,
 *     against float64 (one bf16 rounding of the exact value plus the fp32 sum's own error: a derived bound) and bit
 *     for bit against the staged path it replaces (gemm into a zeroed fp32 buffer, then accumulate16); padding
 *     untouched; supports_op says yes on cuda / cuda-emu (BF16 only) and no on cpu, ref, opaque;
 *   - the decision: a weight two dW GEMMs of one pass would write (overlapping ranges) stays staged, biased and
 *     adapter linears stay staged, and the staged ranges are the group's complement of the direct weights;
 *   - a ratchet on the emulator's counters per step of micro cut to 2 LLaMA blocks (bf16-true): the fp32 bytes
 *     zeroed and added back fall by the linears' weights (4 bytes each, per block), 4 dW GEMMs per block write bf16
 *     in place; FITLLM_CUDA_DW16=0 stages everything as before (A/B); the same loss and gradient-norm bits either way,
 *     with activation checkpointing too; LoRA (no base dW): nothing direct; a bad knob value named.
 * The training bits against the build before: tests/bitident (cuda-emu cases). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"
#include "fitllm/config.h"
#include "fitllm/dtype.h"
#include "fitllm/trainer.h"
#include "model/model-impl.h"
#include "model/store.h"
#include "test.h"

#ifdef FL_HAVE_CUDA_EMU
#include "backend/cuda/cuda-impl.h"

/* one call at (M, N, K) row-major, C (M, ldc) bf16 with ldc >= N (the padding must stay), dW's orientation
 * (trans_a 1: A stored (K, M)) */
static void acc16_case(fl_backend *be, int M, int N, int K, int ldc, float alpha, unsigned long long seed) {
    fl_test_rng r = {seed};
    float *Af = fl_test_frand(&r, (size_t)K * M, -2, 2), *Bf = fl_test_frand(&r, (size_t)K * N, -2, 2);
    float *Cf = fl_test_frand(&r, (size_t)M * ldc, -4, 4);
    uint16_t *A = malloc((size_t)K * M * 2), *B = malloc((size_t)K * N * 2), *C = malloc((size_t)M * ldc * 2);
    uint16_t *C2 = malloc((size_t)M * ldc * 2), *C0 = malloc((size_t)M * ldc * 2);
    float *st = calloc((size_t)M * ldc, 4), *a = malloc((size_t)K * M * 4), *b = malloc((size_t)K * N * 4);
    FL_REQUIRE_OK(fl_convert(A, FL_BF16, Af, FL_F32, (size_t)K * M));
    FL_REQUIRE_OK(fl_convert(B, FL_BF16, Bf, FL_F32, (size_t)K * N));
    FL_REQUIRE_OK(fl_convert(C, FL_BF16, Cf, FL_F32, (size_t)M * ldc));
    FL_REQUIRE_OK(fl_convert(a, FL_F32, A, FL_BF16, (size_t)K * M));
    FL_REQUIRE_OK(fl_convert(b, FL_F32, B, FL_BF16, (size_t)K * N));
    memcpy(C0, C, (size_t)M * ldc * 2);
    memcpy(C2, C, (size_t)M * ldc * 2);
    FL_REQUIRE_OK(be->gemm(be, 1, 0, M, N, K, alpha, A, FL_BF16, M, B, FL_BF16, N, 1.0f, C, FL_BF16, ldc));
    /* the staged path: the fp32 sum into a zeroed buffer, then accumulate16 */
    FL_REQUIRE_OK(be->gemm(be, 1, 0, M, N, K, alpha, A, FL_BF16, M, B, FL_BF16, N, 1.0f, st, FL_F32, ldc));
    FL_REQUIRE_OK(be->accumulate16(be, C2, FL_BF16, st, (size_t)M * ldc));
    FL_REQUIRE_OK(be->sync(be));
    long bad64 = 0, badbits = 0, badpad = 0;
    for (int i = 0; i < M; i++)
        for (int j = 0; j < ldc; j++) {
            const size_t ci = (size_t)i * ldc + j;
            if (j >= N) {
                badpad += C[ci] != C0[ci];
                continue;
            }
            badbits += C[ci] != C2[ci];
            double s = 0, sa = 0;
            for (int p = 0; p < K; p++) {
                s += (double)a[(size_t)p * M + i] * b[(size_t)p * N + j];
                sa += fabs((double)a[(size_t)p * M + i] * b[(size_t)p * N + j]);
            }
            const double c = fl_bf16_to_f32(C0[ci]), v = alpha * s + c;
            /* one bf16 rounding (2^-8 relative, RNE's half ulp taken whole) of the fp32 value, which is within
             * (K + 2) fp32 roundings (2^-24) of the terms' magnitudes of v */
            const double tol = ldexp(fabs(v), -8) + (K + 2) * ldexp(fabs(alpha) * sa + fabs(c), -24);
            bad64 += !(fabs((double)fl_bf16_to_f32(C[ci]) - v) <= tol);
        }
    FL_CHECKF(bad64 == 0 && badbits == 0 && badpad == 0,
              "gemm acc16 M %d N %d K %d ldc %d alpha %g: %ld off float64, %ld differ from gemm + accumulate16, %ld "
              "padding touched",
              M, N, K, ldc, (double)alpha, bad64, badbits, badpad);
    free(Af), free(Bf), free(Cf), free(A), free(B), free(C), free(C2), free(C0), free(st), free(a), free(b);
}
#endif

FL_TEST(cuda_gemm_acc16_vs_float64) {
#ifdef FL_HAVE_CUDA_EMU
    fl_backend be;
    FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
    FL_CHECK(be.supports_op(&be, FL_OP_GEMM_ACC16, FL_BF16, FL_BF16, FL_BF16));
    acc16_case(&be, 37, 29, 53, 29, 1.0f, 1);
    acc16_case(&be, 5, 131, 7, 133, 1.0f, 2);  /* a padded C: its 2 extra columns untouched */
    acc16_case(&be, 33, 17, 300, 17, 0.5f, 3); /* alpha != 1, a longer sum */
    acc16_case(&be, 1, 1, 1, 1, 1.0f, 4);
    /* not a 16-bit C, or not bf16: not this op */
    FL_CHECK(!be.supports_op(&be, FL_OP_GEMM_ACC16, FL_BF16, FL_BF16, FL_F32));
    FL_CHECK(!be.supports_op(&be, FL_OP_GEMM_ACC16, FL_F16, FL_F16, FL_F16));
    FL_CHECK(!be.supports_op(&be, FL_OP_GEMM_ACC16, FL_F32, FL_F32, FL_F32));
    fl_backend_free(&be);
    FL_CHECK(fl_cuda_supports_op(FL_OP_GEMM_ACC16, FL_BF16, FL_BF16, FL_BF16)); /* the planner's answer for cuda */
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
    /* the CPU backends keep the stage (their GEMMs widen to fp32 anyway) */
    static const char *const cpu[] = {"cpu", "ref", "opaque"};
    for (int k = 0; k < 3; k++) {
        fl_backend b;
        FL_REQUIRE_OK(fl_backend_init_by_name(cpu[k], &b, 1));
        FL_CHECKF(!b.supports_op(&b, FL_OP_GEMM_ACC16, FL_BF16, FL_BF16, FL_BF16), "%s claims gemm_acc16", cpu[k]);
        fl_backend_free(&b);
    }
    FL_CHECK(!strcmp(fl_op_name(FL_OP_GEMM_ACC16), "gemm_acc16"));
}

/* fl_store_direct16 on a hand-made block: a 1-group layout [n0 | W0 | W1 | n1 | W2 | W3] of a dense bf16 store */
FL_TEST(store_direct16_ranges) {
    enum { O = 4, I = 3, WN = O * I, NN = 5 };
    static const size_t at[6] = {0, NN, NN + WN, NN + 2 * WN, 2 * NN + 2 * WN, 2 * NN + 3 * WN}; /* entry starts */
    const size_t gn = 2 * NN + 4 * WN;
    float *gstage = calloc(gn, 4);
    uint16_t *g16 = calloc(gn, 2);
    size_t go[3] = {0, 0, gn}; /* group 0 empty, group 1 the block */
    fl_param_store s = {.ops = &fl_store_dense_ops, .dtype = FL_BF16, .g16 = g16, .gstage = gstage};
    fl_model m;
    memset(&m, 0, sizeof m);
    m.store = &s;
    m.layout.group_offset = go;
    m.layout.n_groups = 2;
    fl_block_graph g;
    memset(&g, 0, sizeof g);
    fl_block_params bp;
    static char any;
    for (int t = 0; t < 4; t++) {
        memset(&bp, 0, sizeof bp);
        g.n_ops = 4;
        for (int i = 0; i < 4; i++) {
            g.op[i].kind = FL_GOP_LINEAR, g.op[i].p = (int8_t)i;
            fl_linear *l = &bp.lin[i];
            l->in = I, l->out = O;
            l->dw = gstage + at[i < 2 ? 1 + i : 2 + i];
            l->xb16 = &any;
        }
        if (t == 1) bp.lin[1].dw = bp.lin[0].dw + 1; /* W1's GEMM overlaps W0's: both hit twice, both staged */
        if (t == 2) bp.lin[2].db = gstage, bp.lin[3].n_adapters = 1; /* a bias gradient, an adapter: staged */
        if (t == 3) g.op[3].p = 0, g.n_ops = 4; /* op 3 is lin 0 again (its weight written twice): staged */
        size_t rng[FL_STAGE_RANGES_MAX][2];
        const int nr = fl_store_direct16(&m, &g, &bp, 1, rng);
        int direct[4];
        for (int i = 0; i < 4; i++) direct[i] = bp.lin[i].dw16 != NULL;
        size_t staged = 0;
        for (int k = 0; k < nr; k++) staged += rng[k][1] - rng[k][0];
        switch (t) {
        case 0: /* [n0] [n1]: the norms alone */
            FL_CHECKF(nr == 2 && rng[0][0] == 0 && rng[0][1] == NN && rng[1][0] == at[3] && rng[1][1] == at[4] &&
                          direct[0] && direct[1] && direct[2] && direct[3] && bp.lin[2].dw16 == g16 + at[4],
                      "plain: %d ranges", nr);
            break;
        case 1:
            FL_CHECKF(!direct[0] && !direct[1] && direct[2] && direct[3] && nr == 1 && staged == at[4],
                      "overlap: direct %d %d, %d ranges, %zu staged", direct[0], direct[1], nr, staged);
            break;
        case 2:
            FL_CHECKF(direct[0] && direct[1] && !direct[2] && !direct[3] && nr == 2 && staged == 2 * NN + 2 * WN,
                      "bias/adapter: direct %d %d, %d ranges, %zu staged", direct[2], direct[3], nr, staged);
            break;
        case 3:
            FL_CHECKF(!direct[0] && direct[1] && direct[2] && !direct[3], "op twice: direct %d %d %d %d", direct[0],
                      direct[1], direct[2], direct[3]);
            break;
        }
        /* the ranges are in order, disjoint, and with the direct weights cover the group once */
        size_t cover = staged;
        for (int i = 0; i < 4; i++)
            if (bp.lin[i].dw16) cover += WN;
        for (int k = 1; k < nr; k++) FL_CHECK(rng[k][0] >= rng[k - 1][1]);
        FL_CHECKF(cover == gn || t == 3, "case %d: %zu of %zu covered", t, cover, gn);
    }
    free(gstage);
    free(g16);
}

#ifdef FL_HAVE_CUDA_EMU
enum { B = 2, T = 24 };

static fl_status step(const fl_backend *be, const char *prec, int ckpt, int lora, fl_trainer_result *r) {
    fl_run_config c;
    fl_cfg_defaults(&c, lora ? FL_CMD_FINETUNE_LORA : FL_CMD_FINETUNE_FULL);
    snprintf(c.checkpoint_dir, sizeof c.checkpoint_dir, "micro");
    c.train.max_seq_length = T;
    FL_TRY(fl_cfg_set(&c, "precision", prec));
    if (ckpt) FL_TRY(fl_cfg_set(&c, "train.activation_checkpointing", "true"));
    fl_model_config mc;
    FL_TRY(fl_preset_find("micro", &mc));
    mc.n_layers = 2;
    return fl_trainer_rehearse(&c, &mc, be, 0, B, T, 1, 0, r);
}

/* one step on cuda-emu with FITLLM_CUDA_DW16=knob (NULL: unset): its counters' change */
static fl_status counted(const char *knob, int ckpt, int lora, fl_cu_counters *d, fl_trainer_result *r) {
    if (knob) setenv("FITLLM_CUDA_DW16", knob, 1);
    fl_backend be;
    fl_status s = fl_backend_init_by_name("cuda-emu", &be, 1);
    if (s == FL_OK) {
        fl_cu_counters c0, c1;
        fl_cuemu_backend_counters(&be, &c0);
        s = step(&be, "bf16-true", ckpt, lora, r);
        fl_cuemu_backend_counters(&be, &c1);
        d->zero_bytes = c1.zero_bytes - c0.zero_bytes;
        d->acc16_bytes = c1.acc16_bytes - c0.acc16_bytes;
        d->gemm_acc16 = c1.gemm_acc16 - c0.gemm_acc16;
        fl_backend_free(&be);
    }
    unsetenv("FITLLM_CUDA_DW16");
    return s;
}

/* the bits: 1 step of 2 micro-batches (accumulated into the bf16 gradient) of 1 x 8 tokens of micro, trained from
 * a random init with FITLLM_CUDA_DW16=knob; the step's loss and the trained parameters' bytes */
typedef fl_test_step_rec dw_rec;

static fl_status dw_run(const char *knob, int ckpt, dw_rec *r) {
    fl_run_config c;
    char out[64];
    snprintf(out, sizeof out, "dw16-%s-%d", knob ? knob : "on", ckpt);
    fl_test_tiny_run_config(&c, FL_CMD_FINETUNE_FULL, "micro", out, 8);
    FL_TRY(fl_cfg_set(&c, "precision", "bf16-true"));
    if (ckpt) FL_TRY(fl_cfg_set(&c, "train.activation_checkpointing", "true"));
    setenv("FITLLM_BACKEND", "cuda-emu", 1);
    if (knob) setenv("FITLLM_CUDA_DW16", knob, 1);
    fl_status s = fl_trainer_run(&c, NULL, 0, fl_test_record_step, r, NULL);
    unsetenv("FITLLM_BACKEND");
    unsetenv("FITLLM_CUDA_DW16");
    return s;
}
#endif

FL_TEST(cuda_emu_dw16_ratchet) {
#ifdef FL_HAVE_CUDA_EMU
    fl_model_config mc;
    FL_REQUIRE_OK(fl_preset_find("micro", &mc));
    const long L = 2, C = mc.dim, F = mc.ffn_dim, HD = mc.dim / mc.n_heads;
    const long QD = mc.n_heads * HD, QKV = (mc.n_heads + 2L * mc.n_kv_heads) * HD;
    const long W = QKV * C + C * QD + 2 * F * C + C * F; /* a block's linears' weights */
    for (int ckpt = 0; ckpt < 1 + !fl_test_quick(); ckpt++) { /* checkpointing's count: the full tier */
        fl_cu_counters on, off;
        fl_trainer_result ron, roff;
        FL_REQUIRE_OK(counted(NULL, ckpt, 0, &on, &ron));
        FL_REQUIRE_OK(counted("0", ckpt, 0, &off, &roff));
        FL_CHECKF(off.zero_bytes - on.zero_bytes == L * W * 4 && off.acc16_bytes - on.acc16_bytes == L * W * 4,
                  "ckpt %d: fp32 stage bytes zeroed %ld -> %ld, added back %ld -> %ld; expected %ld fewer each", ckpt,
                  off.zero_bytes, on.zero_bytes, off.acc16_bytes, on.acc16_bytes, L * W * 4);
        FL_CHECKF(on.gemm_acc16 == 4 * L && off.gemm_acc16 == 0, "ckpt %d: %ld / %ld dW GEMMs in place (want %ld / 0)",
                  ckpt, on.gemm_acc16, off.gemm_acc16, 4 * L);
        printf("      micro (2 blocks) bf16-true%s: fp32 stage bytes zeroed %ld -> %ld, added back %ld -> %ld, %ld dW "
               "GEMMs in place\n",
               ckpt ? " ckpt" : "", off.zero_bytes, on.zero_bytes, off.acc16_bytes, on.acc16_bytes, on.gemm_acc16);
    }
    /* the same loss and trained parameters, bit for bit (the quick tier: checkpointed, the recompute between) */
    for (int ckpt = fl_test_asan_light() ? 2 : fl_test_quick(); ckpt < 2; ckpt++) { /* ASan quick: none */
        dw_rec on = {0}, off = {0};
        FL_REQUIRE_OK(dw_run(NULL, ckpt, &on));
        FL_REQUIRE_OK(dw_run("0", ckpt, &off));
        FL_CHECKF(on.n && on.n == off.n && !memcmp(on.params, off.params, on.n) && !memcmp(&on.loss, &off.loss, 8),
                  "ckpt %d: loss %.17g / %.17g, parameters (%zu / %zu bytes) %s", ckpt, on.loss, off.loss, on.n, off.n,
                  on.n == off.n && !memcmp(on.params, off.params, on.n) ? "equal" : "differ");
        free(on.params);
        free(off.params);
    }
    if (!fl_test_quick()) { /* LoRA (the full tier): the frozen base has no dW */
        fl_cu_counters lo;
        fl_trainer_result r;
        FL_REQUIRE_OK(counted(NULL, 0, 1, &lo, &r));
        FL_CHECKF(lo.gemm_acc16 == 0, "LoRA: %ld dW GEMMs in place", lo.gemm_acc16);
    }
    fl_cu_counters d;
    fl_trainer_result r;
    fl_status s = counted("yes", 0, 0, &d, &r);
    FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "FITLLM_CUDA_DW16=yes"), "a bad knob: %d (%s)", (int)s,
              s == FL_OK ? "ok" : fl_error_message());
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

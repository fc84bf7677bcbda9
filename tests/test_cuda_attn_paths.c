/* The FlashAttention-2-structured kernels' load paths (kernels/attn_fa2.cu): a tile comes in by cp.async from a bf16
 * run's stored q|k|v, by 128-bit loads from fp32 views (every view 16-byte aligned with whole 16-byte row strides:
 * fl_cu_fa_vec), or by the element-pair loads otherwise; the backward's dO by 128-bit loads (held in registers across
 * the previous tile's products at HD 64) or element pairs. Anchor: bits. The same logical inputs laid out three ways
 * (unpadded rows: the 128-bit paths; rows padded by 2 elements: the element pairs; q|k|v unpadded with a padded out /
 * dO: the mixed case) give the same out, lse, dq, dk, dv bit for bit, and leave the row padding alone. The values
 * themselves are checked against float64 in test_cuda_attn.c (cuda_attn_fa2) and test_cuda_bf16_bwd.c. Several
 * key tiles and (head, query tile) pairs per block run through both buffers of the double-buffered loops; the
 * emulator's 128-bit access count (the ldmatrix rows, the same in every layout, plus the loads) says which ran.
 * The 128-key backward blocks (FL_CU_FA2_BK128) likewise, and against the 64-key blocks: the same out, dK, dV bits
 * (a key's warp walks the same pairs), dq's partial sums grouped otherwise; the backend's FITLLM_CUDA_FA2_BK. A
 * head size padded to the 128 tiles (HD 100) by chunks of 4 elements (8-byte cp.async, 128-bit fp32 loads) likewise. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"
#include "fitllm/dtype.h"
#include "test.h"

#ifdef FL_HAVE_CUDA_EMU
#include "backend/cuda/cu_kernels_attn.h"
#include "backend/cuda/emu/cu_emu.h"

typedef struct {
    int B, Tq, Tk, NH, NKV, HD, causal, mask, in16, flags; /* flags: FL_CU_FA2_DET, FL_CU_FA2_BK128 */
} path_case;

static void prand(float *x, size_t n, uint64_t *s) {
    for (size_t i = 0; i < n; i++) {
        *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
        x[i] = (float)((*s >> 40) & 0xffff) / 32768.0f - 1.0f;
    }
}

/* rows x w logical values into rows of stride ld (the padding: a fixed pattern), fp32 or bf16 */
static void *lay(const float *x, size_t rows, size_t w, size_t ld, int b16) {
    const size_t es = b16 ? 2 : 4;
    unsigned char *y = malloc(rows * ld * es + 16);
    memset(y, 0x5a, rows * ld * es);
    for (size_t r = 0; r < rows; r++)
        if (b16) FL_CHECK(fl_convert((uint16_t *)y + r * ld, FL_BF16, x + r * w, FL_F32, w) == FL_OK);
        else memcpy((float *)y + r * ld, x + r * w, w * 4);
    return y;
}
/* the logical rows back out of a strided fp32 buffer; the padding must still be the pattern */
static float *unlay(const float *y, size_t rows, size_t w, size_t ld, int *pad_ok) {
    float *x = malloc(rows * w * 4);
    for (size_t r = 0; r < rows; r++) {
        memcpy(x + r * w, y + r * ld, w * 4);
        for (size_t c = w; c < ld; c++) {
            uint32_t u;
            memcpy(&u, y + r * ld + c, 4);
            *pad_ok &= u == 0x5a5a5a5au;
        }
    }
    return x;
}

typedef struct {
    float *out, *lse, *dq, *dk, *dv;
    unsigned long vec;     /* 128-bit accesses of the two launches */
    unsigned long refused; /* shared memory opt-ins refused (an emulated device too small for the 128-key blocks) */
} path_out;

/* One layout: q, k, v (and dq, dk, dv) rows padded by pqkv elements, out / dO rows by po */
static path_out path_run(const path_case *c, const float *q, const float *k, const float *v, const float *dout,
                         const float *g0[3], const uint8_t *kmask, int pqkv, int po, int flags) {
    const size_t wq = (size_t)c->NH * c->HD, wk = (size_t)c->NKV * c->HD, rq = (size_t)c->B * c->Tq,
                 rk = (size_t)c->B * c->Tk, nl = (size_t)c->B * c->NH * c->Tq;
    fl_attn_desc a = {c->B, c->Tq, c->Tk, c->NH, c->NKV, c->HD, wq + pqkv, wk + pqkv, wk + pqkv, wq + po,
                      (float)(1.0 / sqrt((double)c->HD)), c->causal, 0, 0};
    void *ql = lay(q, rq, wq, a.ldq, c->in16), *kl = lay(k, rk, wk, a.ldk, c->in16), *vl = lay(v, rk, wk, a.ldv, c->in16);
    float *dol = lay(dout, rq, wq, a.ldo, 0), *ol = lay(dout, rq, wq, a.ldo, 0); /* out: the pattern overwritten */
    /* the gradients share their input's stride (fl_attn_desc) */
    float *dql = lay(g0[0], rq, wq, a.ldq, 0), *dkl = lay(g0[1], rk, wk, a.ldk, 0), *dvl = lay(g0[2], rk, wk, a.ldv, 0);
    uint16_t *o16 = c->in16 ? malloc(rq * a.ldo * 2 + 16) : NULL;
    float *lse = malloc(nl * 4);
    void *work = malloc(fl_cu_attention_work_bytes_det(c->B, c->NH, c->Tq));
    const unsigned long v0 = fl_cu_emu_vec_accesses, r0 = fl_cu_emu_smem_refusals;
    int rc;
    if (c->in16) {
        rc = fl_cuemu_attention_forward_fa2_16(&a, ol, o16, lse, ql, kl, vl, kmask, NULL);
        rc |= fl_cuemu_attention_backward_fa2_16(&a, dql, dkl, dvl, dol, ql, kl, vl, kmask, o16, lse, work, flags, NULL);
    } else {
        rc = fl_cuemu_attention_forward_fa2(&a, ol, NULL, lse, ql, kl, vl, kmask, NULL);
        rc |= fl_cuemu_attention_backward_fa2_ex(&a, dql, dkl, dvl, dol, ql, kl, vl, kmask, ol, lse, work, flags, NULL);
    }
    FL_CHECKF(rc == 0, "fa2 paths: a launcher failed (%d)", rc);
    path_out r;
    r.vec = fl_cu_emu_vec_accesses - v0;
    r.refused = fl_cu_emu_smem_refusals - r0;
    int pad_ok = 1;
    r.out = unlay(ol, rq, wq, a.ldo, &pad_ok), r.lse = lse;
    r.dq = unlay(dql, rq, wq, a.ldq, &pad_ok), r.dk = unlay(dkl, rk, wk, a.ldk, &pad_ok);
    r.dv = unlay(dvl, rk, wk, a.ldv, &pad_ok);
    FL_CHECKF(pad_ok, "fa2 paths (pad %d / %d): a kernel wrote into the row padding", pqkv, po);
    free(ql), free(kl), free(vl), free(dol), free(ol), free(dql), free(dkl), free(dvl), free(o16), free(work);
    return r;
}

static int same_bits(const float *x, const float *y, size_t n) { return !memcmp(x, y, n * 4); }

static void path_case_run(const path_case *c) {
    const size_t wq = (size_t)c->NH * c->HD, wk = (size_t)c->NKV * c->HD, nq = (size_t)c->B * c->Tq * wq,
                 nk = (size_t)c->B * c->Tk * wk, nl = (size_t)c->B * c->NH * c->Tq;
    uint64_t s = 0xfa2ull + (uint64_t)c->Tq * 131 + (uint64_t)c->Tk * 7 + (uint64_t)c->HD + (uint64_t)c->in16;
    float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4), *dout = malloc(nq * 4);
    float *g[3] = {malloc(nq * 4), malloc(nk * 4), malloc(nk * 4)};
    prand(q, nq, &s), prand(k, nk, &s), prand(v, nk, &s), prand(dout, nq, &s);
    for (int i = 0; i < 3; i++) prand(g[i], i ? nk : nq, &s);
    uint8_t *kmask = NULL;
    if (c->mask) {
        kmask = malloc((size_t)c->B * c->Tk);
        for (size_t i = 0; i < (size_t)c->B * c->Tk; i++) kmask[i] = (uint8_t)(i % 7 != 2);
    }
    const float *g0[3] = {g[0], g[1], g[2]};
    char name[128];
    snprintf(name, sizeof name, "fa2 %s B%d Tq%d Tk%d NH%d/%d HD%d%s%s%s%s", c->in16 ? "bf16 q|k|v" : "fp32", c->B,
             c->Tq, c->Tk, c->NH, c->NKV, c->HD, c->causal ? " causal" : "", c->mask ? " kmask" : "",
             c->flags & FL_CU_FA2_DET ? " det" : "",
             c->flags & FL_CU_FA2_BK128 ? " bk128" : c->flags & FL_CU_FA2_BK64 ? " bk64" : "");
    /* layouts: 128-bit everywhere; element pairs everywhere (rows + 2); q|k|v 128-bit with dO / out by pairs */
    const int pads[3][2] = {{0, 0}, {2, 2}, {0, 2}};
    path_out r[3];
    for (int l = 0; l < 3; l++) r[l] = path_run(c, q, k, v, dout, g0, kmask, pads[l][0], pads[l][1], c->flags);
    /* the emulator counts ldmatrix's row addresses too (the same in every layout): the loads make the difference; a
     * padded head's 64-key backward blocks (FL_CU_FA2_BK64; 128 are its default) read dO by element pairs in every
     * layout (attn_fa2.cu: registers) */
    /* (the 64-key blocks also where an emulated device refused the 128-key ones' shared memory: FITLLM_EMU_SMEM_MAX) */
    const int bk128 = !(c->flags & FL_CU_FA2_BK64) && !r[0].refused;
    const int dov = c->HD == 64 || c->HD == 128 || bk128;
    FL_CHECKF(r[0].vec >= r[2].vec && (r[0].vec > r[2].vec) == dov && r[2].vec > r[1].vec,
              "%s: 128-bit accesses unpadded %lu, mixed %lu, padded %lu", name, r[0].vec, r[2].vec, r[1].vec);
    for (int l = 1; l < 3; l++) {
        FL_CHECKF(same_bits(r[0].out, r[l].out, nq) && same_bits(r[0].lse, r[l].lse, nl), "%s: forward bits, layout %d",
                  name, l);
        FL_CHECKF(same_bits(r[0].dq, r[l].dq, nq) && same_bits(r[0].dk, r[l].dk, nk) && same_bits(r[0].dv, r[l].dv, nk),
                  "%s: backward bits, layout %d", name, l);
    }
    /* against the 64-key blocks: a key's warp walks the same (head, tile) pairs, so dK, dV are the same bits; dq's
     * per-block partial sums are grouped otherwise (not where the 128-key blocks were refused: they are the 64-key) */
    if ((c->flags & FL_CU_FA2_BK128) && !r[0].refused) {
        path_out r64 = path_run(c, q, k, v, dout, g0, kmask, 0, 0, (c->flags & ~FL_CU_FA2_BK128) | FL_CU_FA2_BK64);
        size_t dq_differ = 0;
        for (size_t i = 0; i < nq; i++) dq_differ += r64.dq[i] != r[0].dq[i];
        FL_CHECKF(same_bits(r64.out, r[0].out, nq) && same_bits(r64.dk, r[0].dk, nk) && same_bits(r64.dv, r[0].dv, nk),
                  "%s: out / dk / dv not the 64-key blocks' bits", name);
        FL_CHECKF(dq_differ > 0, "%s: dq the 64-key blocks' bits everywhere (did the 128-key kernel run?)", name);
        free(r64.out), free(r64.lse), free(r64.dq), free(r64.dk), free(r64.dv);
    }
    /* not vacuous: the backward added something everywhere a row sees a key */
    size_t moved = 0;
    for (size_t i = 0; i < nk; i++) moved += r[0].dk[i] != g[1][i];
    FL_CHECKF(moved > nk / 2, "%s: dk changed in only %zu of %zu elements", name, moved, nk);
    for (int l = 0; l < 3; l++) free(r[l].out), free(r[l].lse), free(r[l].dq), free(r[l].dk), free(r[l].dv);
    free(q), free(k), free(v), free(dout), free(kmask);
    for (int i = 0; i < 3; i++) free(g[i]);
}

FL_TEST(cuda_attn_fa2_paths) {
    const path_case cases[] = {
        /* 3 key tiles per forward block (both buffers, twice), 2 heads x 4 query tiles per backward block */
        {2, 200, 200, 4, 2, 64, 1, 0, 1, 0},
        {1, 200, 200, 4, 2, 64, 1, 0, 0, 0},
        /* HD 128: 32-row backward tiles, dO by 128-bit loads without the register prefetch; kmask; Tq < Tk */
        {1, 77, 150, 2, 1, 128, 1, 1, 1, 0},
        /* non-causal, odd lengths, kmask, the deterministic dq's counters between the double-buffered pairs */
        {1, 130, 67, 2, 2, 64, 0, 1, 0, FL_CU_FA2_DET},
        /* 128-key blocks of 8 warps (256 threads: the loaders' steps, the dQ tile's warp split): 2 blocks */
        {1, 200, 200, 4, 2, 64, 1, 0, 1, FL_CU_FA2_BK128},
        {1, 77, 150, 2, 1, 128, 1, 1, 0, FL_CU_FA2_BK128 | FL_CU_FA2_DET},
        /* a head padded to the 128 tiles (OpenLLaMA 3B's 100): chunks of 4 (cp.async of 8 bytes from bf16, 128-bit
         * loads from fp32) against element pairs; the 128-key blocks */
        {1, 150, 150, 4, 2, 100, 1, 0, 1, 0},              /* the default: 128-key blocks */
        {1, 77, 150, 2, 1, 100, 1, 1, 0, FL_CU_FA2_BK64},  /* 64-key blocks (FITLLM_CUDA_FA2_BK=64) */
        {1, 150, 150, 2, 1, 100, 1, 0, 1, FL_CU_FA2_BK128},
    };
    /* the quick tier's release pass leaves out the fp32 twin of the first case (fp32 views at HD 64: the non-causal
     * case) and the padded head's explicit 128-key blocks (its default's, case 6; the 64-key comparison: case 5);
     * under ASan case 5 (HD 128 with a key mask, 128-key blocks and the deterministic dq) and the padded default */
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (fl_test_asan_light() ? i == 5 || i == 6 : !fl_test_quick() || (i != 1 && i != 8))
            path_case_run(&cases[i]);
}

/* The backend's knob FITLLM_CUDA_FA2_BK (read at set-up): 128 runs the 128-key blocks, 64 or unset the 64-key ones
 * (the bits of the direct launches; at T 150 dq tells them apart), any other value is refused by name. */
static void bk_knob_case(const char *env, int flags) {
    if (env) setenv("FITLLM_CUDA_FA2_BK", env, 1);
    else unsetenv("FITLLM_CUDA_FA2_BK");
    fl_backend be;
    fl_status st = fl_backend_init_by_name("cuda-emu", &be, 1);
    unsetenv("FITLLM_CUDA_FA2_BK");
    FL_CHECKF(st == FL_OK, "cuda-emu with FITLLM_CUDA_FA2_BK=%s: %s", env ? env : "(unset)", fl_error_message());
    if (st != FL_OK) return;
    be.set_compute_dtype(&be, FL_BF16); /* the tensor-core kernels: fa2 by default */
    const int B = 1, T = 150, NH = 2, NKV = 1, HD = 64, OW = NH * HD;
    const size_t nx = (size_t)B * T * (NH + 2 * NKV) * HD, no = (size_t)B * T * OW, nl = (size_t)B * NH * T;
    uint64_t s = 0xb128;
    float *qkv = malloc(nx * 4), *dout = malloc(no * 4), *o[2], *l[2], *g[3];
    prand(qkv, nx, &s), prand(dout, no, &s);
    for (int i = 0; i < 2; i++) o[i] = malloc(no * 4), l[i] = malloc(nl * 4);
    for (int i = 0; i < 3; i++) g[i] = calloc(nx, 4);
    void *work = malloc(fl_cu_attention_work_bytes(B, NH, T));
    const fl_attn_desc a = fl_attn_desc_qkv(B, T, NH, NKV, HD);
    const float *q = qkv, *k = qkv + OW, *v = qkv + OW + NKV * HD;
    FL_CHECK(fl_attention_qkv_forward(&be, o[0], l[0], qkv, B, T, NH, NKV, HD) == FL_OK);
    FL_CHECK(fl_attention_qkv_backward(&be, g[0], dout, qkv, o[0], l[0], B, T, NH, NKV, HD) == FL_OK);
    FL_CHECK(be.sync(&be) == FL_OK);
    FL_CHECK(fl_cuemu_attention_forward_fa2(&a, o[1], NULL, l[1], q, k, v, NULL, NULL) == 0);
    for (int i = 1; i < 3; i++) {
        const int f = i == 1 ? flags : flags ^ FL_CU_FA2_BK128; /* the chosen blocks, then the others */
        FL_CHECK(fl_cuemu_attention_backward_fa2_ex(&a, g[i], g[i] + OW, g[i] + OW + NKV * HD, dout, q, k, v, NULL, o[1],
                                                    l[1], work, f, NULL) == 0);
    }
    FL_CHECKF(same_bits(o[0], o[1], no) && same_bits(l[0], l[1], nl) && same_bits(g[0], g[1], nx),
              "FITLLM_CUDA_FA2_BK=%s: not the bits of the %d-key blocks", env ? env : "(unset)",
              flags ? 128 : 64);
    FL_CHECKF(!same_bits(g[0], g[2], nx), "FITLLM_CUDA_FA2_BK=%s: the other blocks' bits too (dq should differ)",
              env ? env : "(unset)");
    fl_backend_free(&be);
    free(qkv), free(dout), free(work);
    for (int i = 0; i < 2; i++) free(o[i]), free(l[i]);
    for (int i = 0; i < 3; i++) free(g[i]);
}

FL_TEST(cuda_attn_fa2_bk_knob) {
    /* under ASan (quick tier) the non-default value alone: the knob read, the other blocks' kernel run */
    if (!fl_test_asan_light()) bk_knob_case(NULL, 0);
    if (!fl_test_asan_light()) bk_knob_case("64", 0);
    bk_knob_case("128", FL_CU_FA2_BK128);
    fl_test_emu_knob_refused("FITLLM_CUDA_FA2_BK");
}
/* A device with 99 KiB of shared memory a block (sm_86 / 89: RTX 30xx / 40xx, L40S; the emulator's FL_CU_SMEM_OPTIN
 * refuses above it): the 128-key backward blocks at HD 128 and the padded HD 100 (112 KiB) are refused and the 64-key
 * blocks run (their bits exactly), one refusal a call; at HD 64 (90 KiB) the 128-key blocks still run (dq's bits
 * differ from the 64-key blocks'). */
static void small_smem_case(int HD, int want_fallback) {
    const int B = 1, T = 96, NH = 2, NKV = 1, OW = NH * HD;
    const size_t nx = (size_t)B * T * (NH + 2 * NKV) * HD, no = (size_t)B * T * OW, nl = (size_t)B * NH * T;
    uint64_t s = 0x5e0 + (uint64_t)HD;
    float *qkv = malloc(nx * 4), *dout = malloc(no * 4), *o = malloc(no * 4), *l = malloc(nl * 4), *g[2];
    prand(qkv, nx, &s), prand(dout, no, &s);
    for (int i = 0; i < 2; i++) g[i] = calloc(nx, 4);
    void *work = malloc(fl_cu_attention_work_bytes(B, NH, T));
    const fl_attn_desc a = fl_attn_desc_qkv(B, T, NH, NKV, HD);
    const float *q = qkv, *k = qkv + OW, *v = qkv + OW + NKV * HD;
    FL_CHECK(fl_cuemu_attention_forward_fa2(&a, o, NULL, l, q, k, v, NULL, NULL) == 0);
    FL_CHECK(fl_cuemu_attention_backward_fa2_ex(&a, g[0], g[0] + OW, g[0] + OW + NKV * HD, dout, q, k, v, NULL, o, l,
                                                work, FL_CU_FA2_BK64, NULL) == 0);
    fl_cu_emu_set_smem_max(101376);
    const unsigned long refused = fl_cu_emu_smem_refusals;
    const int rc = fl_cuemu_attention_backward_fa2_ex(&a, g[1], g[1] + OW, g[1] + OW + NKV * HD, dout, q, k, v, NULL,
                                                      o, l, work, FL_CU_FA2_BK128, NULL);
    const unsigned long nref = fl_cu_emu_smem_refusals - refused;
    fl_cu_emu_set_smem_max(0);
    FL_CHECKF(rc == 0 && fl_cu_emu_error() == NULL, "HD %d on a 99 KiB device: rc %d, %s", HD, rc,
              fl_cu_emu_error() ? fl_cu_emu_error() : "no emulator error");
    FL_CHECKF(nref == (unsigned long)want_fallback, "HD %d: %lu opt-ins refused, want %d", HD, nref, want_fallback);
    FL_CHECKF(same_bits(g[0], g[1], nx) == want_fallback, "HD %d: %s", HD,
              want_fallback ? "not the 64-key blocks' bits after the refusal" : "the 64-key blocks' bits (the 128-key "
                                                                                "blocks should have run)");
    free(qkv), free(dout), free(o), free(l), free(work), free(g[0]), free(g[1]);
}

FL_TEST(cuda_attn_fa2_small_smem_device) {
    small_smem_case(128, 1);
    small_smem_case(100, 1);
    if (!fl_test_asan_light()) small_smem_case(64, 0);
}
#else
FL_TEST(cuda_attn_fa2_small_smem_device) { fl_test_skip("no CUDA emulator in this build"); }
FL_TEST(cuda_attn_fa2_paths) { fl_test_skip("no CUDA emulator in this build"); }
FL_TEST(cuda_attn_fa2_bk_knob) { fl_test_skip("no CUDA emulator in this build"); }
#endif

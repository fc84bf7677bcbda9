/* The FlashAttention-2-structured kernels' load paths (kernels/attn_fa2.cu): a tile comes in by cp.async from a bf16
 * run's stored q|k|v, by 128-bit loads from fp32 views (every view 16-byte aligned with whole 16-byte row strides:
 * fl_cu_fa_vec), or by the element-pair loads otherwise; the backward's dO by 128-bit loads (held in registers across
 * the previous tile's products at HD 64) or element pairs. Anchor: bits. The same logical inputs laid out three ways
 * (unpadded rows: the 128-bit paths; rows padded by 2 elements: the element pairs; q|k|v unpadded with a padded out /
 * dO: the mixed case) give the same out, lse, dq, dk, dv bit for bit, and leave the row padding alone. The values
 * themselves are checked against float64 in test_cuda_attn.c (cuda_attn_fa2) and test_cuda_bf16_bwd.c. Several
 * key tiles and (head, query tile) pairs per block run through both buffers of the double-buffered loops; the
 * emulator's 128-bit access count (the ldmatrix rows, the same in every layout, plus the loads) says which ran. */
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
    int B, Tq, Tk, NH, NKV, HD, causal, mask, in16, det;
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
    unsigned long vec; /* 128-bit accesses of the two launches */
} path_out;

/* One layout: q, k, v (and dq, dk, dv) rows padded by pqkv elements, out / dO rows by po */
static path_out path_run(const path_case *c, const float *q, const float *k, const float *v, const float *dout,
                         const float *g0[3], const uint8_t *kmask, int pqkv, int po) {
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
    const unsigned long v0 = fl_cu_emu_vec_accesses;
    int rc;
    if (c->in16) {
        rc = fl_cuemu_attention_forward_fa2_16(&a, ol, o16, lse, ql, kl, vl, kmask, NULL);
        rc |= fl_cuemu_attention_backward_fa2_16(&a, dql, dkl, dvl, dol, ql, kl, vl, kmask, o16, lse, work, c->det, NULL);
    } else {
        rc = fl_cuemu_attention_forward_fa2(&a, ol, NULL, lse, ql, kl, vl, kmask, NULL);
        rc |= fl_cuemu_attention_backward_fa2_ex(&a, dql, dkl, dvl, dol, ql, kl, vl, kmask, ol, lse, work, c->det, NULL);
    }
    FL_CHECKF(rc == 0, "fa2 paths: a launcher failed (%d)", rc);
    path_out r;
    r.vec = fl_cu_emu_vec_accesses - v0;
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
    snprintf(name, sizeof name, "fa2 %s B%d Tq%d Tk%d NH%d/%d HD%d%s%s%s", c->in16 ? "bf16 q|k|v" : "fp32", c->B, c->Tq,
             c->Tk, c->NH, c->NKV, c->HD, c->causal ? " causal" : "", c->mask ? " kmask" : "", c->det ? " det" : "");
    /* layouts: 128-bit everywhere; element pairs everywhere (rows + 2); q|k|v 128-bit with dO / out by pairs */
    const int pads[3][2] = {{0, 0}, {2, 2}, {0, 2}};
    path_out r[3];
    for (int l = 0; l < 3; l++) r[l] = path_run(c, q, k, v, dout, g0, kmask, pads[l][0], pads[l][1]);
    /* the emulator counts ldmatrix's row addresses too (the same in every layout): the loads make the difference */
    FL_CHECKF(r[0].vec > r[2].vec && r[2].vec > r[1].vec, "%s: 128-bit accesses unpadded %lu, mixed %lu, padded %lu",
              name, r[0].vec, r[2].vec, r[1].vec);
    for (int l = 1; l < 3; l++) {
        FL_CHECKF(same_bits(r[0].out, r[l].out, nq) && same_bits(r[0].lse, r[l].lse, nl), "%s: forward bits, layout %d",
                  name, l);
        FL_CHECKF(same_bits(r[0].dq, r[l].dq, nq) && same_bits(r[0].dk, r[l].dk, nk) && same_bits(r[0].dv, r[l].dv, nk),
                  "%s: backward bits, layout %d", name, l);
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
        {1, 130, 67, 2, 2, 64, 0, 1, 0, 1},
    };
    const size_t n = fl_test_asan_light() ? 2 : sizeof cases / sizeof cases[0];
    for (size_t i = 0; i < n; i++) path_case_run(&cases[i]);
}
#else
FL_TEST(cuda_attn_fa2_paths) { fl_test_skip("no CUDA emulator in this build"); }
#endif

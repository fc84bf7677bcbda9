/* The deterministic dq of the FlashAttention-2-structured backward (kernels/attn_fa2.cu,
 * FITLLM_CUDA_DETERMINISTIC=1): each key block adds its dq contribution to a query tile in key-block
 * order, waiting on a counter per (b, h, query tile) in the work area. On a GPU that fixes the order
 * of the fp32 adds (the same bits every run); the emulator runs the blocks in order anyway, so here:
 *  - the values equal the atomic path's exactly (the tiles realigned to multiples of the tile height,
 *    rows before a block's first visible row add zeros),
 *  - every counter ends at the number of key blocks that visited its tile, computed here from the
 *    causal limits (a block that skipped its turn, or posted twice, would hang or corrupt the GPU run).
 * The EX kernels (a bias with its gradient, dropout: T5's attention) the same, dbias too: by atomics from a block per
 * batch element, deterministic by one block walking the batch (one owner per element; the counters see each batch
 * element's visits in turn); the emulator runs the blocks in batch order, so the two give the same bits here.
 * Not checked here: the order itself on a GPU (tests/cuda/check_attn.c's dq-bits comparison on a GPU). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"
#include "test.h"

#ifdef FL_HAVE_CUDA_EMU
#include "backend/cuda/cu_kernels_attn.h"
#include "backend/cuda/emu/cu_emu.h"

static float *det_rand(size_t n, uint64_t *s) {
    float *x = malloc(n * sizeof(float) + 4);
    for (size_t i = 0; i < n; i++) {
        *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
        x[i] = (float)((*s >> 40) & 0xffff) / 32768.0f - 1.0f;
    }
    return x;
}

/* B, Tq, Tk, NH, NKV, HD, causal; bk: the backward's key blocks (64, or 128: FL_CU_FA2_BK128); ex: the EX kernels
 * (attention_*_fa2_b: a bias with its gradient, dropout 0.1; HD 64 here, whose blocks walk the batch: the counters'
 * order per batch element) */
static void det_case(const int c[7], int bk, int ex) {
    const int bkf = bk == 128 ? FL_CU_FA2_BK128 : 0;
    const int B = c[0], Tq = c[1], Tk = c[2], NH = c[3], NKV = c[4], HD = c[5];
    fl_attn_desc a = {B, Tq, Tk, NH, NKV, HD, (size_t)NH * HD, (size_t)NKV * HD, (size_t)NKV * HD, (size_t)NH * HD,
                      (float)(1.0 / sqrt((double)HD)), c[6], ex ? 0.1f : 0.0f, 0xd209u};
    const size_t nq = (size_t)B * Tq * NH * HD, nk = (size_t)B * Tk * NKV * HD, nl = (size_t)B * NH * Tq;
    const size_t nb = ex ? (size_t)NH * Tq * Tk : 0;
    uint64_t s = 0x1234 + (uint64_t)Tq * 7 + Tk;
    float *q = det_rand(nq, &s), *k = det_rand(nk, &s), *v = det_rand(nk, &s), *dout = det_rand(nq, &s);
    float *bias = ex ? det_rand(nb, &s) : NULL;
    float *out = calloc(nq, 4), *lse = calloc(nl, 4);
    float *g[2][4];
    for (int r = 0; r < 2; r++)
        g[r][0] = det_rand(nq, &s), g[r][1] = det_rand(nk, &s), g[r][2] = det_rand(nk, &s), g[r][3] = det_rand(nb, &s);
    for (int i = 0; i < 4; i++) memcpy(g[1][i], g[0][i], (i == 0 ? nq : i < 3 ? nk : nb) * 4); /* the same pre-fills */
    const size_t wb = fl_cu_attention_work_bytes_det(B, NH, Tq);
    float *work = malloc(wb);
    FL_REQUIRE(fl_cuemu_attention_forward_fa2_b(&a, out, NULL, lse, q, k, v, bias, NULL, NULL) == 0);
    FL_REQUIRE(fl_cuemu_attention_backward_fa2_b(&a, g[0][0], g[0][1], g[0][2], ex ? g[0][3] : NULL, dout, q, k, v, bias,
                                                 NULL, out, lse, work, bkf, NULL) == 0);
    memset(work, 0x7f, wb); /* the launch zeroes its counters itself */
    const unsigned long refused = fl_cu_emu_smem_refusals;
    FL_REQUIRE(fl_cuemu_attention_backward_fa2_b(&a, g[1][0], g[1][1], g[1][2], ex ? g[1][3] : NULL, dout, q, k, v, bias,
                                                 NULL, out, lse, work, FL_CU_FA2_DET | bkf, NULL) == 0);
    /* an emulated device too small for the 128-key blocks (FITLLM_EMU_SMEM_MAX) ran the 64-key ones: their counts */
    if (fl_cu_emu_smem_refusals != refused) bk = 64;
    for (int i = 0; i < 4; i++) {
        size_t n = i == 0 ? nq : i < 3 ? nk : nb, bad = 0;
        for (size_t e = 0; e < n; e++) bad += !(g[0][i][e] == g[1][i][e]);
        FL_CHECKF(bad == 0, "B%d Tq%d Tk%d %d/%d HD%d bk %d%s: %zu of %zu %s values differ", B, Tq, Tk, NH, NKV, HD, bk,
                  ex ? " ex" : "", bad, n, i == 0 ? "dq" : i == 1 ? "dk" : i == 2 ? "dv" : "dbias");
    }
    /* the counters: BQ = 64 rows (HD 64) or 32 (HD 128); key block kb visits tiles from its first visible
     * row rounded down to a tile */
    const int BQ = HD == 64 ? 64 : 32, nt = (Tq + BQ - 1) / BQ, nkb = (Tk + bk - 1) / bk;
    const int *cnt = (const int *)(work + nl);
    int bad = 0;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < nt; t++) {
                int want = 0;
                for (int kb = 0; kb < nkb; kb++) {
                    long fr = c[6] ? (long)kb * bk - (Tk - Tq) : 0;
                    fr = fr < 0 ? 0 : fr > Tq ? Tq : fr;
                    want += t * BQ >= fr - fr % BQ;
                }
                bad += cnt[((size_t)b * NH + h) * nt + t] != want;
            }
    FL_CHECKF(bad == 0, "B%d Tq%d Tk%d bk %d: %d tile counters off", B, Tq, Tk, bk, bad);
    free(q), free(k), free(v), free(dout), free(bias), free(out), free(lse), free(work);
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < 4; i++) free(g[r][i]);
}

FL_TEST(cuda_attn_fa2_deterministic) {
    if (!fl_test_asan_budget()) return; /* make test time (quick tier); the FA2 emulated kernels under ASan: cuda_attn_fa2 */
    const int cases[][7] = {
        {1, 131, 131, 4, 1, 64, 1},  /* 3 key blocks, GQA 4:1, tiles starting mid-way realigned */
        {2, 77, 200, 2, 1, 128, 1},  /* causal Tq < Tk: blocks no row sees, 32-row tiles */
        {1, 200, 70, 2, 2, 64, 1},   /* causal Tq > Tk */
        {1, 67, 131, 2, 2, 64, 0},   /* non-causal: every block visits every tile */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) det_case(cases[i], 64, 0);
    /* 128-key blocks (FITLLM_CUDA_FA2_BK=128): 2 blocks of 131 / 200 keys, 1 of 70 / 67 (the quick tier: the first
     * two, a tile realigned mid-way and blocks no row sees) */
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (!fl_test_quick() || i < 2) det_case(cases[i], 128, 0);
    /* the EX kernels (T5's bias and dropout) over a batch of 2: causal GQA 2:1, and non-causal, 64- and 128-key (the
     * quick tier: the 128-key blocks on the causal case) */
    const int ex_cases[][7] = {{2, 131, 131, 2, 1, 64, 1}, {2, 70, 131, 2, 2, 64, 0}};
    for (int bk = 64; bk <= 128; bk += 64)
        for (size_t i = 0; i < sizeof ex_cases / sizeof ex_cases[0]; i++)
            if (!fl_test_quick() || bk == 64 || i == 0) det_case(ex_cases[i], bk, 1);
}
#endif

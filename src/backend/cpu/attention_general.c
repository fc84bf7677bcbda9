/* General attention on the CPU: causal or bidirectional, self or cross (Tq != Tk),
 * grouped-query heads, an optional additive bias (NH, Tq, Tk) broadcast over the
 * batch (T5's relative positions) and an optional key padding mask (B, Tk).
 * Semantics and layout: include/fitllm/backend.h (fl_attn_desc, attention_forward). This file
 * holds the backend's attention slots: the fused-QKV causal shape (fl_attn_is_qkv) goes to
 * attention.c's kernels, every other to the general kernels here.
 *
 * Same flash-attention-2 scheme as attention.c (the fused-QKV causal op the decoder
 * uses), generalized:
 *  - forward: work item = (b, h, tile of BQ query rows); key tiles of BK are
 *    transposed into Kt (HD, BK) so a score row is HD broadcast-FMAs over a BK-wide
 *    vector; online softmax (running max m, sum l, rescaled accumulator O); lse =
 *    m + log(l) saved per (b, h, t). Visibility (mask, causal limit, tile end) is
 *    one keep flag per (row, key): the max skips hidden keys, their probability is
 *    forced to +0 with fl_cpu_keepf (a bit mask, so the loop vectorizes).
 *  - backward: P = exp(S - lse) and dS = P o (dP - D), D = dO.O, recomputed per
 *    (row block, key tile) by ONE function (rows_probs) for both kinds of item:
 *      kv items (b, kv head g, key tile) own dK/dV of that tile: every head of g's
 *        group, every query row that can see the tile, rows ascending;
 *      q items own dQ (and dbias) of a tile of BQ query rows of head h, key tiles
 *        ascending; with dbias, an item is (h, query tile) and walks b ascending, so
 *        dbias[h, t, j] (a sum over the batch) has one owner too; without, (b, h,
 *        query tile).
 *    This is attention.c's "split" schedule (P and dS computed twice: 7 HD-long FMA
 *    rows per visible (query, key) pair instead of 5), whose items stay numerous
 *    whatever B and NKV are. The "fused" schedule does least work: item (b, g), or (g)
 *    walking b ascending when dbias is wanted, runs the kv items of g with the dQ /
 *    dbias contributions of each tile added on the spot. As in attention.c, the split
 *    is taken only when the fused items would leave threads idle (fl_cpu_attn_use_split).
 *    Both give the same bits: P and dS of a (row, key) come from the same code, and
 *    every output element has one owner that adds its parts in the same order (dK/dV:
 *    heads, then rows ascending into a zeroed tile; dQ: key tiles ascending; dbias:
 *    batch ascending), so the bits depend neither on the schedule nor on the thread
 *    count. dbias needs no batch-sized scratch (ops never allocate).
 *
 * Stack tiles only, sized for HD <= FL_CPU_ATTN_MAX_HD (larger: FL_ERR_UNSUPPORTED). */
#include <math.h>
#include <omp.h>

#include "backend/cpu/cpu-impl.h"
#include "fitllm/lora.h"

#define BQ 32 /* query rows per work item */
#define BK FL_CPU_ATTN_BK /* keys per tile */
#define RB 4 /* query rows summed together into dK / dV (rows_dkdv's expression is unrolled for 4) */
#define RR 32 /* query rows per backward call (a multiple of RB) */
#define NG (RR / RB)
#define MAXHD FL_CPU_ATTN_MAX_HD

/* One past the last key row t may see (causal: t + Tk - Tq, bottom-right aligned),
 * clamped to [0, Tk]. */
static inline int key_limit(const fl_attn_desc *a, int t) {
    if (!a->causal) return a->Tk;
    long lim = (long)t + a->Tk - a->Tq + 1;
    return lim < 0 ? 0 : lim > a->Tk ? a->Tk : (int)lim;
}

/* First query row that sees key k0 (causal), clamped to [0, Tq]. */
static inline int first_row(const fl_attn_desc *a, int k0) {
    if (!a->causal) return 0;
    long t = (long)k0 - (a->Tk - a->Tq);
    return t < 0 ? 0 : t > a->Tq ? a->Tq : (int)t;
}

/* Rows k0..k0+kn-1 (row stride ld) transposed into Kt (HD, BK); columns kn..BK-1 zero. */
static inline void load_transposed(float *restrict Kt /*(HD,BK)*/, const float *src, size_t ld, int kn, int HD) {
    for (int d = 0; d < HD; d++)
        for (int j = kn; j < BK; j++) Kt[d * BK + j] = 0.0f;
    for (int j = 0; j < kn; j++) {
        const float *r = src + (size_t)j * ld; // (HD) row of key j
        for (int d = 0; d < HD; d++) Kt[d * BK + j] = r[d];
    }
}

/* km[j] = 1 if key k0+j exists (j < kn) and is not padding. */
static inline void load_key_mask(int *km /*(BK)*/, const uint8_t *kmask /*(Tk) of this b, or NULL*/, int k0, int kn) {
    for (int j = 0; j < BK; j++) km[j] = j < kn && (!kmask || kmask[k0 + j]);
}

/* Dropout on the attention weights (fl_attn_desc.drop_p > 0): the factor of key k0 + j of query row t of head h,
 * batch b: the mask of (drop_seed, ((b NH + h) Tq + t) Tk + k0 + j) times 1 / (1 - p), or 0 */
static inline float drop_factor(const fl_attn_desc *a, int b, int h, int t, int k0, int j) {
    const size_t i = (((size_t)b * a->NH + h) * a->Tq + t) * a->Tk + k0 + j;
    return fl_lora_dropout_keep(a->drop_seed, i, a->drop_p) ? fl_lora_dropout_scale(a->drop_p) : 0.0f;
}

/* the argument checks every backend applies (src/backend/attn_args.c), with this backend's tiles */
static fl_status check_args(const char *op, const fl_attn_desc *a, const void *out, const void *lse, const float *q,
                            const float *k, const float *v, const float *bias, const float *dbias) {
    return fl_attn_check_args(op, a, MAXHD, "the CPU backend's tile size", out, lse, q, k, v, bias, dbias);
}

/* work ~ multiply-adds of the forward; below FL_CPU_ATTN_PAR_MIN: one thread */
static int n_threads_for(const fl_backend *be, const fl_attn_desc *a) {
    int64_t work = (int64_t)a->B * a->NH * a->Tq * a->Tk * a->HD;
    return be->n_threads > 1 && work >= FL_CPU_ATTN_PAR_MIN ? be->n_threads : 1;
}

/* ---- forward ----------------------------------------------------------------------- */

static void fwd_item(const fl_attn_desc *a, float *out, float *lse, const float *q, const float *k, const float *v,
                     const float *bias, const uint8_t *kmask, int b, int h, int q0) {
    const int HD = a->HD, Tq = a->Tq, Tk = a->Tk, g = h / (a->NH / a->NKV);
    const int qn = Tq - q0 < BQ ? Tq - q0 : BQ;
    const float *Q = q + (size_t)b * Tq * a->ldq + (size_t)h * HD; // (Tq,HD) stride ldq
    const float *K = k + (size_t)b * Tk * a->ldk + (size_t)g * HD; // (Tk,HD) stride ldk
    const float *V = v + (size_t)b * Tk * a->ldv + (size_t)g * HD; // (Tk,HD) stride ldv
    const uint8_t *M = kmask ? kmask + (size_t)b * Tk : NULL;     // (Tk) or NULL
    float Kt[MAXHD * BK]; // (HD,BK) transposed key tile
    float Qs[BQ * MAXHD]; // (qn,HD) query tile times scale
    float O[BQ * MAXHD];  // (qn,HD) unnormalized output accumulator
    float S[BQ * BK];     // (qn,BK) scores, then probabilities
    float m[BQ], l[BQ];   // (BQ) running max / running sum
    int lim[BQ];          // (BQ) one past each row's last causally visible key
    int km[BK];           // (BK) key exists and is not padding
    for (int r = 0; r < qn; r++) {
        const float *qr = Q + (size_t)(q0 + r) * a->ldq;
        for (int d = 0; d < HD; d++) {
            Qs[r * HD + d] = qr[d] * a->scale;
            O[r * HD + d] = 0.0f;
        }
        m[r] = -INFINITY;
        l[r] = 0.0f;
        lim[r] = key_limit(a, q0 + r);
    }
    const int kend = qn > 0 ? key_limit(a, q0 + qn - 1) : 0; /* no row of the tile sees keys >= kend */
    for (int k0 = 0; k0 < kend; k0 += BK) {
        const int kn = kend - k0 < BK ? kend - k0 : BK;
        load_transposed(Kt, K + (size_t)k0 * a->ldk, a->ldk, kn, HD);
        load_key_mask(km, M, k0, kn);
        /* S = (scale Q) K^T for the whole tile: one tile product (attn_mm.c) */
        fl_cpu_attn_mm(S, BK, Qs, HD, 1, Kt, BK, qn, BK, HD, 0);
        int jmx = 0; /* keys some row of the tile sees */
        for (int r = 0; r < qn; r++) {
            float *s = S + r * BK;
            int j = lim[r] - k0, jmax = j < 0 ? 0 : j < kn ? j : kn;
            if (bias && jmax > 0) {
                const float *br = bias + ((size_t)h * Tq + q0 + r) * Tk + k0; // (kn) of row q0+r
                for (int j2 = 0; j2 < jmax; j2++) s[j2] += br[j2];
            }
            float smax = -INFINITY;
            for (int j2 = 0; j2 < jmax; j2++)
                if (km[j2] && s[j2] > smax) smax = s[j2];
            if (smax == -INFINITY) { /* no visible key in this tile: the row's state is unchanged */
                for (int j2 = 0; j2 < BK; j2++) s[j2] = 0.0f;
                continue;
            }
            jmx = jmax > jmx ? jmax : jmx;
            float mnew = smax > m[r] ? smax : m[r];
            float corr = fl_cpu_expf(m[r] - mnew); /* m = -inf (nothing seen yet): ~0, and O, l are 0 */
            float ps = 0.0f;
            /* FL_VECTORIZE: attn_ex_fwd_exp */
#pragma omp simd reduction(+ : ps)
            for (int j2 = 0; j2 < BK; j2++) {
                float p = fl_cpu_keepf(fl_cpu_expf(s[j2] - mnew), km[j2] & (j2 < jmax));
                s[j2] = p;
                ps += p;
            }
            if (a->drop_p > 0) /* V sees the dropped weights; l keeps the softmax's own sum */
                for (int j2 = 0; j2 < jmax; j2++) s[j2] *= drop_factor(a, b, h, q0 + r, k0, j2);
            l[r] = l[r] * corr + ps;
            m[r] = mnew;
            float *o = O + r * HD;
#pragma omp simd
            for (int d = 0; d < HD; d++) o[d] *= corr;
        }
        /* O += P V over the keys some row sees; hidden entries of P are exactly 0 */
        if (jmx > 0) fl_cpu_attn_mm(O, HD, S, BK, 1, V + (size_t)k0 * a->ldv, (int)a->ldv, qn, HD, jmx, 1);
    }
    for (int r = 0; r < qn; r++) {
        const int t = q0 + r;
        float *dst = out + ((size_t)b * Tq + t) * a->ldo + (size_t)h * HD;
        if (l[r] > 0.0f) {
            float inv = 1.0f / l[r];
#pragma omp simd
            for (int d = 0; d < HD; d++) dst[d] = O[r * HD + d] * inv;
            lse[((size_t)b * a->NH + h) * Tq + t] = m[r] + logf(l[r]);
        } else { /* no visible key: documented as out 0, lse -inf */
            for (int d = 0; d < HD; d++) dst[d] = 0.0f;
            lse[((size_t)b * a->NH + h) * Tq + t] = -INFINITY;
        }
    }
}

static void fill_nan(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = NAN;
}

fl_status fl_cpu_attention_forward(const fl_backend *be, const fl_attn_desc *a, float *out /*(B,Tq,NH,HD) ldo*/,
                                   float *lse /*(B,NH,Tq)*/, const float *q /*(B,Tq,NH,HD) ldq*/,
                                   const float *k /*(B,Tk,NKV,HD) ldk*/, const float *v /*(B,Tk,NKV,HD) ldv*/,
                                   const float *bias /*(NH,Tq,Tk) or NULL*/, const uint8_t *kmask /*(B,Tk) or NULL*/) {
    fl_status st = check_args("attention_forward", a, out, lse, q, k, v, bias, NULL);
    const int qkv = fl_attn_is_qkv(a, q, k, v, bias, kmask, NULL, NULL, NULL, NULL);
    if (st != FL_OK) {
        /* the fused shape's outputs become NaN on a refused head size (the fused op's contract
         * before the slots merged): a caller that drops the status still cannot read garbage */
        if (qkv && st == FL_ERR_UNSUPPORTED && out && lse) {
            fill_nan(out, (size_t)a->B * a->Tq * a->ldo);
            fill_nan(lse, (size_t)a->B * a->NH * a->Tq);
        }
        return st;
    }
    if (qkv) { /* the decoder's fused QKV: its own kernel (attention.c), the bits it always gave */
        fl_cpu_attn_qkv_forward(be, out, lse, q, a->B, a->Tq, a->NH, a->NKV, a->HD);
        return FL_OK;
    }
    return fl_cpu_attn_general_forward(be, a, out, lse, q, k, v, bias, kmask);
}

fl_status fl_cpu_attn_general_forward(const fl_backend *be, const fl_attn_desc *a, float *out, float *lse,
                                      const float *q, const float *k, const float *v, const float *bias,
                                      const uint8_t *kmask) {
    fl_status st = check_args("attention_forward", a, out, lse, q, k, v, bias, NULL);
    if (st != FL_OK) return st;
    const int nqt = (a->Tq + BQ - 1) / BQ, nitems = a->B * a->NH * nqt, nt = n_threads_for(be, a);
    /* dynamic: causal late query tiles do more work; an item's result does not depend on
     * the thread that runs it */
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
    for (int it = 0; it < nitems; it++) {
        int qt = nqt - 1 - it % nqt; /* heaviest (causal) first */
        int h = (it / nqt) % a->NH, b = it / (nqt * a->NH);
        fwd_item(a, out, lse, q, k, v, bias, kmask, b, h, qt * BQ);
    }
    return FL_OK;
}

/* ---- backward ---------------------------------------------------------------------- */

typedef struct {
    const fl_attn_desc *a;
    const float *q, *k, *v, *bias, *dout, *out, *lse;
    const uint8_t *kmask;
    float *dq, *dk, *dv, *dbias;
    int rep; /* NH / NKV */
} bw_ctx;

/* Per-thread state of RR query rows (NG groups of RB) against one key tile. */
typedef struct {
    /* (RR,HD) scale*q, dO, dQ of the rows, row stride ld = HD rounded up to 8 (not MAXHD: 32 rows 1 KiB
     * apart would share a few L1 sets), columns HD..ld-1 of qs and go zero */
    float qs[RR * MAXHD], go[RR * MAXHD], dq[RR * MAXHD];
    int ld;
    float s[RR][BK], dp[RR][BK];                       // (RR,BK) scores -> P, dP -> dS
    float D[RR], lt[RR];                               // (RR) dO.O and lse per row
    int jm[RR];                                        // (RR) visible keys per row
    int gj[NG];                                        // (NG) visible keys of each group of RB rows (their max)
} bw_rows;

/* 8 floats as one value (GCC vector extension: a ymm register with AVX, two xmm without) */
typedef float v8f __attribute__((vector_size(32)));
static inline v8f v8_load(const float *p) {
    v8f v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

/* dV_j += P^T dO and dK_j += dS^T (scale q) for the keys each group of RB rows sees, groups
 * ascending, each group's RB rows first summed in one expression (p0 g0 + p1 g1 + p2 g2 + p3 g3,
 * as the one-group kernel before it), then added to the accumulator: the accumulator stays in a
 * register across the groups (8 columns of d at a time), instead of a load and store per group.
 * noinline: every schedule runs this very code. */
__attribute__((noinline)) static void rows_dkdv(const bw_rows *r, float *dK /*(BK,HD)*/, float *dV /*(BK,HD)*/,
                                                int jmx, int HD) {
    const int ld = r->ld;
    for (int j = 0; j < jmx; j++) {
        float *dv = dV + j * HD, *dk = dK + j * HD;
        for (int d0 = 0; d0 < HD; d0 += 8) {
            const int w = HD - d0 < 8 ? HD - d0 : 8; /* columns d0.. of this chunk (reads past HD stay in the rows) */
            v8f av = {0}, ak = {0};
            if (w == 8) av = v8_load(dv + d0), ak = v8_load(dk + d0);
            else
                for (int x = 0; x < w; x++) av[x] = dv[d0 + x], ak[x] = dk[d0 + x];
            for (int q = 0; q < NG; q++) {
                if (j >= r->gj[q]) continue;
                const int i = q * RB;
                const float p0 = r->s[i][j], p1 = r->s[i + 1][j], p2 = r->s[i + 2][j], p3 = r->s[i + 3][j];
                const float e0 = r->dp[i][j], e1 = r->dp[i + 1][j], e2 = r->dp[i + 2][j], e3 = r->dp[i + 3][j];
                av = av + (p0 * v8_load(r->go + i * ld + d0) + p1 * v8_load(r->go + (i + 1) * ld + d0) +
                           p2 * v8_load(r->go + (i + 2) * ld + d0) + p3 * v8_load(r->go + (i + 3) * ld + d0));
                /* scale folded into qs */
                ak = ak + (e0 * v8_load(r->qs + i * ld + d0) + e1 * v8_load(r->qs + (i + 1) * ld + d0) +
                           e2 * v8_load(r->qs + (i + 2) * ld + d0) + e3 * v8_load(r->qs + (i + 3) * ld + d0));
            }
            if (w == 8) __builtin_memcpy(dv + d0, &av, sizeof av), __builtin_memcpy(dk + d0, &ak, sizeof ak);
            else
                for (int x = 0; x < w; x++) dv[d0 + x] = av[x], dk[d0 + x] = ak[x];
        }
    }
}

/* Rows t0..t0+RR-1 of head h, batch b against the key tile at k0 (kn keys, transposed
 * in Kt/Vt, key mask km): P = exp(S - lse) into r->s, dS = P o (dP - D) into r->dp,
 * both exactly 0 for hidden keys and for padding rows (t >= Tq); r->gj: each group's largest
 * jm. Returns the largest jm of all. noinline: kv items and q items must run the very same
 * code, so that P and dS have the same bits in both. */
__attribute__((noinline)) static int rows_probs(const bw_ctx *c, bw_rows *r, const float *Kt /*(HD,BK)*/,
                                                const float *Vt /*(HD,BK)*/, const int *km /*(BK)*/, int b, int h,
                                                int k0, int kn, int t0) {
    const fl_attn_desc *a = c->a;
    const int Tq = a->Tq, HD = a->HD;
    const int nr = Tq - t0 < RR ? (Tq - t0 + RB - 1) / RB * RB : RR; /* whole groups up to the last real row */
    const int ld = r->ld = (HD + 7) & ~7;
    for (int i = 0; i < nr; i++) {
        const int t = t0 + i;
        if (t < Tq) {
            const float *qr = c->q + ((size_t)b * Tq + t) * a->ldq + (size_t)h * HD;
            const float *dO = c->dout + ((size_t)b * Tq + t) * a->ldo + (size_t)h * HD;
            const float *o = c->out + ((size_t)b * Tq + t) * a->ldo + (size_t)h * HD;
            float Dr = 0.0f;
#pragma omp simd reduction(+ : Dr)
            for (int d = 0; d < HD; d++) Dr += dO[d] * o[d];
            float *qs = r->qs + i * ld, *go = r->go + i * ld;
            for (int d = 0; d < HD; d++) {
                qs[d] = qr[d] * a->scale;
                go[d] = dO[d];
            }
            for (int d = HD; d < ld; d++) qs[d] = go[d] = 0.0f;
            r->D[i] = Dr;
            r->lt[i] = c->lse[((size_t)b * a->NH + h) * Tq + t];
            int j = key_limit(a, t) - k0;
            r->jm[i] = j < 0 ? 0 : j < kn ? j : kn;
        } else {
            for (int d = 0; d < ld; d++) r->qs[i * ld + d] = r->go[i * ld + d] = 0.0f;
            r->D[i] = r->lt[i] = 0.0f;
            r->jm[i] = 0;
        }
    }
    /* S = (scale q) Kt and dP = dO Vt over all BK columns: register-tiled products (attn_mm.c),
     * each element one multiply-add chain over d ascending from 0, as the forward's S */
    fl_cpu_attn_mm(&r->s[0][0], BK, r->qs, ld, 1, Kt, BK, nr, BK, HD, 0);
    fl_cpu_attn_mm(&r->dp[0][0], BK, r->go, ld, 1, Vt, BK, nr, BK, HD, 0);
    int jmx = 0;
    for (int q = 0; q < NG; q++) r->gj[q] = 0;
    for (int i = 0; i < nr; i++) {
        const int jmax = r->jm[i];
        if (jmax <= 0) { /* nothing visible (or padding row): P = dS = 0 already */
            continue;
        }
        jmx = jmax > jmx ? jmax : jmx;
        if (jmax > r->gj[i / RB]) r->gj[i / RB] = jmax;
        if (c->bias) {
            const float *br = c->bias + ((size_t)h * Tq + t0 + i) * a->Tk + k0; // (kn) of row t0+i
            for (int j = 0; j < jmax; j++) r->s[i][j] += br[j];
        }
        /* a row with no visible key at all has lse -inf: s - lse is +inf, expf clamps it,
         * and keep (0 for every key of such a row) clears it bitwise: no NaN */
        const float Lr = r->lt[i], Dr = r->D[i];
        if (a->drop_p > 0) { /* dropped weights: dV reads f P, dS = P o (f dP - D) with the forward's factors f */
            for (int j = 0; j < BK; j++) {
                const float p = fl_cpu_keepf(fl_cpu_expf(r->s[i][j] - Lr), km[j] & (j < jmax));
                const float f = j < jmax ? drop_factor(a, b, h, t0 + i, k0, j) : 0.0f;
                r->s[i][j] = p * f;
                r->dp[i][j] = p * (f * r->dp[i][j] - Dr);
            }
            continue;
        }
        /* FL_VECTORIZE: attn_ex_bwd_exp */
#pragma omp simd
        for (int j = 0; j < BK; j++) {
            float p = fl_cpu_keepf(fl_cpu_expf(r->s[i][j] - Lr), km[j] & (j < jmax));
            r->s[i][j] = p;
            r->dp[i][j] = p * (r->dp[i][j] - Dr);
        }
    }
    return jmx;
}

/* dQ_t += scale * sum_j dS_tj K_j over the first jmx keys of the tile at k0; dbias of the
 * block's rows += dS (when wanted). */
__attribute__((noinline)) static void rows_dq(const bw_ctx *c, bw_rows *r, int b, int h, int k0, int kn, int jmx,
                                              int t0) {
    const fl_attn_desc *a = c->a;
    const int Tq = a->Tq, HD = a->HD, g = h / c->rep;
    const float *K = c->k + (size_t)b * a->Tk * a->ldk + (size_t)g * HD; // (Tk,HD) stride ldk
    /* dq = dS K over the first jmx keys: one multiply-add chain per element, keys ascending from 0 */
    const int nr = Tq - t0 < RR ? Tq - t0 : RR;
    fl_cpu_attn_mm(r->dq, r->ld, &r->dp[0][0], BK, 1, K + (size_t)k0 * a->ldk, (int)a->ldk, nr, HD, jmx, 0);
    for (int i = 0; i < nr; i++) {
        if (r->jm[i] <= 0) continue; /* nothing visible in this tile: no contribution */
        float *dqr = c->dq + ((size_t)b * Tq + t0 + i) * a->ldq + (size_t)h * HD;
#pragma omp simd
        for (int d = 0; d < HD; d++) dqr[d] += a->scale * r->dq[i * r->ld + d];
        if (c->dbias) {
            float *dbr = c->dbias + ((size_t)h * Tq + t0 + i) * a->Tk + k0; // (kn) of row t0+i
            for (int j = 0; j < kn; j++) dbr[j] += r->dp[i][j];
        }
    }
}

/* Key tile k0 of kv head g of batch b: dK/dV over every head of g's group and every row
 * that can see the tile (rows ascending, RR at a time), added once into dk/dv; with_dq: also
 * the tile's dQ (and dbias) contributions to those rows (the fused schedule, whose item owns
 * all of them). */
static void kv_item(const bw_ctx *c, int b, int g, int k0, int with_dq) {
    const fl_attn_desc *a = c->a;
    const int Tk = a->Tk, HD = a->HD;
    const float *K = c->k + (size_t)b * Tk * a->ldk + (size_t)g * HD; // (Tk,HD) stride ldk
    const float *V = c->v + (size_t)b * Tk * a->ldv + (size_t)g * HD; // (Tk,HD) stride ldv
    bw_rows r;
    float Kt[MAXHD * BK], Vt[MAXHD * BK]; // (HD,BK) transposed key / value tiles
    float dK[BK * MAXHD], dV[BK * MAXHD]; // (BK,HD) tile gradient accumulators
    int km[BK];
    const int kn = Tk - k0 < BK ? Tk - k0 : BK;
    load_transposed(Kt, K + (size_t)k0 * a->ldk, a->ldk, kn, HD);
    load_transposed(Vt, V + (size_t)k0 * a->ldv, a->ldv, kn, HD);
    load_key_mask(km, c->kmask ? c->kmask + (size_t)b * Tk : NULL, k0, kn);
    memset(dK, 0, sizeof(float) * (size_t)kn * HD);
    memset(dV, 0, sizeof(float) * (size_t)kn * HD);
    const int tstart = first_row(a, k0);
    for (int h = g * c->rep; h < (g + 1) * c->rep; h++)
        for (int t0 = tstart; t0 < a->Tq; t0 += RR) {
            int jmx = rows_probs(c, &r, Kt, Vt, km, b, h, k0, kn, t0);
            rows_dkdv(&r, dK, dV, jmx, HD);
            if (with_dq) rows_dq(c, &r, b, h, k0, kn, jmx, t0);
        }
    for (int j = 0; j < kn; j++) {
        float *dkr = c->dk + ((size_t)b * Tk + k0 + j) * a->ldk + (size_t)g * HD;
        float *dvr = c->dv + ((size_t)b * Tk + k0 + j) * a->ldv + (size_t)g * HD;
#pragma omp simd
        for (int d = 0; d < HD; d++) {
            dkr[d] += dK[j * HD + d];
            dvr[d] += dV[j * HD + d];
        }
    }
}

/* q item: dQ (and dbias) of query rows q0..q0+BQ-1 of head h for batch elements b0..b1-1
 * (ascending), key tiles ascending up to the tile's causal limit. */
static void q_item(const bw_ctx *c, int b0, int b1, int h, int q0) {
    const fl_attn_desc *a = c->a;
    const int Tq = a->Tq, Tk = a->Tk, HD = a->HD, g = h / c->rep;
    bw_rows r;
    float Kt[MAXHD * BK], Vt[MAXHD * BK]; // (HD,BK) transposed key / value tiles
    int km[BK];
    const int qend = q0 + BQ < Tq ? q0 + BQ : Tq, kend = key_limit(a, qend - 1);
    for (int b = b0; b < b1; b++) {
        const float *K = c->k + (size_t)b * Tk * a->ldk + (size_t)g * HD; // (Tk,HD) stride ldk
        const float *V = c->v + (size_t)b * Tk * a->ldv + (size_t)g * HD; // (Tk,HD) stride ldv
        for (int k0 = 0; k0 < kend; k0 += BK) {
            /* the tile as kv items see it (kn up to Tk, not kend): identical inputs to rows_probs */
            const int kn = Tk - k0 < BK ? Tk - k0 : BK;
            load_transposed(Kt, K + (size_t)k0 * a->ldk, a->ldk, kn, HD);
            load_transposed(Vt, V + (size_t)k0 * a->ldv, a->ldv, kn, HD);
            load_key_mask(km, c->kmask ? c->kmask + (size_t)b * Tk : NULL, k0, kn);
            for (int t0 = q0; t0 < qend; t0 += RR) {
                int jmx = rows_probs(c, &r, Kt, Vt, km, b, h, k0, kn, t0);
                rows_dq(c, &r, b, h, k0, kn, jmx, t0);
            }
        }
    }
}

fl_status fl_cpu_attention_backward(const fl_backend *be, const fl_attn_desc *a, float *dq, float *dk, float *dv,
                                    float *dbias /*(NH,Tq,Tk) or NULL*/, const float *dout, const float *q,
                                    const float *k, const float *v, const float *bias, const uint8_t *kmask,
                                    const float *out, const float *lse /*(B,NH,Tq)*/) {
    const int qkv = fl_attn_is_qkv(a, q, k, v, bias, kmask, dq, dk, dv, dbias);
    if (qkv && dout) {
        fl_status st = check_args("attention_backward", a, out, lse, q, k, v, bias, dbias);
        if (st == FL_ERR_UNSUPPORTED && dq) /* NaN, as forward */
            fill_nan(dq, (size_t)a->B * a->Tq * a->ldq);
        if (st != FL_OK || !dq) return st != FL_OK ? st : fl_errorf(FL_ERR_INVALID, "attention_backward: NULL dq");
        fl_cpu_attn_qkv_backward_sched(be, dq, dout, q, out, lse, a->B, a->Tq, a->NH, a->NKV, a->HD, -1);
        return FL_OK;
    }
    return fl_cpu_attn_general_backward_sched(be, a, dq, dk, dv, dbias, dout, q, k, v, bias, kmask, out, lse, -1);
}

fl_status fl_cpu_attn_general_backward_sched(const fl_backend *be, const fl_attn_desc *a, float *dq, float *dk,
                                             float *dv, float *dbias, const float *dout, const float *q,
                                             const float *k, const float *v, const float *bias,
                                             const uint8_t *kmask, const float *out, const float *lse, int split) {
    fl_status st = check_args("attention_backward", a, out, lse, q, k, v, bias, dbias);
    if (st != FL_OK) return st;
    if (!dq || !dk || !dv || !dout) return fl_errorf(FL_ERR_INVALID, "attention_backward: NULL gradient tensor");
    const bw_ctx c = {a, q, k, v, bias, dout, out, lse, kmask, dq, dk, dv, dbias, a->NH / a->NKV};
    const int B = a->B, NH = a->NH, NKV = a->NKV, nt = n_threads_for(be, a);
    const int nkt = (a->Tk + BK - 1) / BK, nqt = (a->Tq + BQ - 1) / BQ;
    /* with dbias an item that owns dQ covers the whole batch (one owner per dbias element) */
    const int qb = dbias ? 1 : B;
    if (split < 0) split = fl_cpu_attn_use_split(qb * NKV, nt);
    if (!split) {
        /* fused: item (b, g), or (g) over b ascending with dbias: dK/dV of g and dQ (dbias) of
         * g's query heads, key tiles ascending: per element the order of the split schedule */
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
        for (int it = 0; it < qb * NKV; it++) {
            int g = it % NKV, b0 = dbias ? 0 : it / NKV, b1 = dbias ? B : b0 + 1;
            for (int b = b0; b < b1; b++)
                for (int kt = 0; kt < nkt; kt++) kv_item(&c, b, g, kt * BK, 1);
        }
        return FL_OK;
    }
    const int n_kv = B * NKV * nkt, n_q = qb * NH * nqt;
    /* kv items first, key tiles ascending (causal: the first see the most rows), then q
     * items, query tiles descending (the last see the most keys): heaviest first */
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
    for (int it = 0; it < n_kv + n_q; it++) {
        if (it < n_kv) {
            int kt = it / (B * NKV), bg = it % (B * NKV);
            kv_item(&c, bg / NKV, bg % NKV, kt * BK, 0);
        } else {
            int i = it - n_kv, qt = nqt - 1 - i / (qb * NH), bh = i % (qb * NH);
            int h = bh % NH, b = bh / NH;
            if (dbias) q_item(&c, 0, B, h, qt * BQ);
            else q_item(&c, b, b + 1, h, qt * BQ);
        }
    }
    return FL_OK;
}

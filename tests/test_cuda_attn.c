/* CUDA attention kernels (src/backend/cuda/kernels/attention*.cu) under the CPU emulator.
 *
 * Anchors, independent of the kernels' code:
 *  - a float64 reference written here, straight from backend.h's contract (naive softmax over
 *    the visible keys of one query row at a time, no tiling, D = sum_j p_j dP_j);
 *  - the CPU backend's ops on the same inputs (themselves checked against finite differences
 *    in tests/test_attention.c and tests/test_ops.c);
 *  - an error bound from fp32 rounding, per element, computed from the data (below), never
 *    from the kernels' output. Both the kernel and the CPU op must be within it of the float64
 *    value, so the two must agree within twice it.
 * And bits: every launch runs twice under two fiber-order seeds (the emulator permutes the
 * fibers between barrier phases, so a missing __syncthreads shows) and must give the same bits.
 *
 * The bound. u = 2^-24. A dot product or sum of n fp32 terms errs by at most about n u times
 * the sum of |terms| (the worst-case linear bound of recursive summation, no random-walk
 * discount), and an error e in a score changes its probability by the factor exp(e); with
 * sabs = scale * sum_d |q_d k_d| + |bias| the largest magnitude behind a visible score, every
 * probability's relative error is within rho = u (HD + Tk + 8)(1 + sabs). Per element, with
 * the sums of |terms| of the float64 reference (P1 = sum_d |dO_d v_jd|, P2 = sum_d |dO_d o_d|):
 *   out:   M = sum_j p_j |v_jd|                     lse: 1 + |lse|
 *   dq:    M = scale sum_j p_tj (P1 + P2) |k_jd|     dk: M = scale sum_t p_tj (P1 + P2) |q_td|
 *   dv:    M = sum_t p_tj |dO_td|                    dbias: M = sum_b p (P1 + P2)
 * and |err| <= 4 u (HD + Tq*NH/NKV + Tk + B + 16)(1 + sabs) M + 4 u |x| (the += into a
 * pre-filled gradient and the last rounding), 4 for the stages chained (score, exp, sum,
 * division / D, dS, the gradient sum). A row with no visible key has M = 0: its out and its
 * gradients must be exact. At these shapes the bound is ~1e-5 relative: a hidden key let in, a
 * lost tile or a wrong scale is off by 1e-2 or more. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"
#include "fitllm/lora.h"
#include "fitllm/model.h"
#include "fitllm/precision.h"
#include "test.h"

#ifdef FL_HAVE_CUDA_EMU
#include "backend/cuda/cu_kernels_attn.h"
#include "backend/cuda/emu/cu_emu.h"

#define U32 (1.0 / 16777216.0)

static const uint64_t k_seed_a = 0x51ed2701ull, k_seed_b = 0xa77e4711ull;

static double *dzeros(size_t n) { return calloc(n ? n : 1, sizeof(double)); }

/* emulated launch: returns the launcher's code, a recorded emulator error fails the test */
static int emu_call(int rc, const char *what) {
    const char *e = fl_cu_emu_error();
    FL_CHECKF(!e, "%s: emulator error: %s", what, e ? e : "");
    fl_cu_emu_clear_error();
    return rc;
}

/* ---- float64 reference -------------------------------------------------------------------- */

typedef struct {
    fl_attn_desc a;
    const float *q, *k, *v, *bias, *dout; /* op layouts (dout like out: ldo) */
    const uint8_t *kmask;
    /* contiguous outputs: out (B,Tq,NH,HD), lse (B,NH,Tq), dq (B,Tq,NH,HD), dk/dv (B,Tk,NKV,HD),
     * dbias (NH,Tq,Tk); M* the |term| sums of the bound; sabs the largest score magnitude */
    double *out, *lse, *dq, *dk, *dv, *dbias, *Mo, *Mq, *Mk, *Mv, *Mb;
    double sabs;
    /* optional (NULL: not computed), for the bf16 bound: as Mq / Mk (Mb2: Mb) with P1 + P2 replaced by
     * Qt = sum_j p_tj P1_tj (how far an error of out, hence of D, reaches dS) */
    double *Mq2, *Mk2, *Mb2;
} ref_t;

/* dropout's factor of key j of query row t, head h, batch b (a->drop_p > 0): backend.h's contract, the mask of
 * fitllm/lora.h at ((b NH + h) Tq + t) Tk + j times 1 / (1 - p) (the fp32 value the ops use), else 1 */
static double drop_f(const fl_attn_desc *a, int b, int h, int t, int j) {
    if (!(a->drop_p > 0)) return 1.0;
    const size_t i = (((size_t)b * a->NH + h) * a->Tq + t) * a->Tk + j;
    return fl_lora_dropout_keep(a->drop_seed, i, a->drop_p) ? (double)fl_lora_dropout_scale(a->drop_p) : 0.0;
}

static int visible(const fl_attn_desc *a, const uint8_t *kmask, int b, int t, int j) {
    if (kmask && !kmask[(size_t)b * a->Tk + j]) return 0;
    return !a->causal || (long)j <= (long)t + a->Tk - a->Tq;
}

static void ref_run(ref_t *R) {
    const fl_attn_desc *a = &R->a;
    const int HD = a->HD, rep = a->NH / a->NKV, Tk = a->Tk, Tq = a->Tq;
    double *s = malloc(sizeof(double) * (Tk ? Tk : 1)), *p = malloc(sizeof(double) * (Tk ? Tk : 1));
    double *dp = malloc(sizeof(double) * (Tk ? Tk : 1)), *P1 = malloc(sizeof(double) * (Tk ? Tk : 1));
    R->sabs = 0;
    for (int b = 0; b < a->B; b++)
        for (int h = 0; h < a->NH; h++)
            for (int t = 0; t < Tq; t++) {
                const int g = h / rep;
                const float *q = R->q + ((size_t)b * Tq + t) * a->ldq + (size_t)h * HD;
                double m = -INFINITY;
                for (int j = 0; j < Tk; j++) {
                    if (!visible(a, R->kmask, b, t, j)) continue;
                    const float *k = R->k + ((size_t)b * Tk + j) * a->ldk + (size_t)g * HD;
                    double dot = 0, mag = 0;
                    for (int d = 0; d < HD; d++) {
                        dot += (double)q[d] * k[d];
                        mag += fabs((double)q[d] * k[d]);
                    }
                    double bj = R->bias ? R->bias[((size_t)h * Tq + t) * Tk + j] : 0.0;
                    s[j] = a->scale * dot + bj;
                    mag = a->scale * mag + fabs(bj);
                    if (mag > R->sabs) R->sabs = mag;
                    if (s[j] > m) m = s[j];
                }
                double l = 0;
                for (int j = 0; j < Tk; j++) {
                    p[j] = visible(a, R->kmask, b, t, j) ? exp(s[j] - m) : 0.0;
                    l += p[j];
                }
                const size_t orow = (((size_t)b * Tq + t) * a->NH + h) * HD, lrow = ((size_t)b * a->NH + h) * Tq + t;
                double *o = R->out + orow;
                if (l == 0) { /* no visible key */
                    R->lse[lrow] = -INFINITY;
                    continue; /* out, gradients, M stay 0 */
                }
                for (int j = 0; j < Tk; j++) p[j] /= l;
                R->lse[lrow] = m + log(l);
                double *f = s; /* the scores are done with: dropout's factors (1 without) */
                for (int j = 0; j < Tk; j++) f[j] = drop_f(a, b, h, t, j);
                for (int j = 0; j < Tk; j++) {
                    if (p[j] == 0) continue;
                    const float *v = R->v + ((size_t)b * Tk + j) * a->ldv + (size_t)g * HD;
                    for (int d = 0; d < HD; d++) {
                        o[d] += p[j] * f[j] * v[d];
                        R->Mo[orow + d] += p[j] * f[j] * fabs((double)v[d]);
                    }
                }
                if (!R->dout) continue;
                const float *dO = R->dout + ((size_t)b * Tq + t) * a->ldo + (size_t)h * HD;
                double D = 0, P2 = 0;
                for (int d = 0; d < HD; d++) P2 += fabs(dO[d] * o[d]);
                for (int j = 0; j < Tk; j++) {
                    dp[j] = P1[j] = 0;
                    if (p[j] == 0) continue;
                    const float *v = R->v + ((size_t)b * Tk + j) * a->ldv + (size_t)g * HD;
                    for (int d = 0; d < HD; d++) {
                        dp[j] += (double)dO[d] * v[d];
                        P1[j] += fabs((double)dO[d] * v[d]);
                    }
                    D += p[j] * f[j] * dp[j];
                }
                double Qt = 0;
                for (int j = 0; j < Tk; j++) Qt += p[j] * f[j] * P1[j];
                for (int j = 0; j < Tk; j++) {
                    if (p[j] == 0) continue;
                    const double ds = p[j] * (f[j] * dp[j] - D), w = p[j] * (f[j] * P1[j] + P2);
                    const float *k = R->k + ((size_t)b * Tk + j) * a->ldk + (size_t)g * HD;
                    const size_t krow = (((size_t)b * Tk + j) * a->NKV + g) * HD;
                    for (int d = 0; d < HD; d++) {
                        R->dq[orow + d] += a->scale * ds * k[d];
                        R->Mq[orow + d] += a->scale * w * fabs((double)k[d]);
                        R->dk[krow + d] += a->scale * ds * q[d];
                        R->Mk[krow + d] += a->scale * w * fabs((double)q[d]);
                        R->dv[krow + d] += p[j] * f[j] * dO[d];
                        R->Mv[krow + d] += p[j] * f[j] * fabs((double)dO[d]);
                        if (R->Mq2) R->Mq2[orow + d] += a->scale * p[j] * Qt * fabs((double)k[d]);
                        if (R->Mk2) R->Mk2[krow + d] += a->scale * p[j] * Qt * fabs((double)q[d]);
                    }
                    if (R->dbias) {
                        R->dbias[((size_t)h * Tq + t) * Tk + j] += ds;
                        R->Mb[((size_t)h * Tq + t) * Tk + j] += w;
                        if (R->Mb2) R->Mb2[((size_t)h * Tq + t) * Tk + j] += p[j] * Qt;
                    }
                }
            }
    free(s);
    free(p);
    free(dp);
    free(P1);
}

/* got (a strided view: rows of `row` floats at stride ld, minus pre when given) against the
 * contiguous reference; 0 if any element is outside its bound (the first is printed). */
static int check_bound(const char *what, const float *got, const float *pre, size_t rows, size_t row, size_t ld,
                       const double *want, const double *M, double nfac, double sabs) {
    double worst = 0;
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < row; c++) {
            size_t gi = r * ld + c, wi = r * row + c;
            double x = got[gi], p0 = pre ? pre[gi] : 0.0;
            double err = fabs(x - p0 - want[wi]);
            double tol = 4 * U32 * nfac * (1 + sabs) * M[wi] + 4 * U32 * (fabs(x) + fabs(p0));
            if (!(err <= tol)) {
                fprintf(stderr, "  %s: [%zu,%zu] got %.9g want %.9g (err %.3g > bound %.3g)\n", what, r, c, x - p0,
                        want[wi], err, tol);
                return 0;
            }
            if (tol > 0 && err / tol > worst) worst = err / tol;
        }
    return 1;
}
static int check_lse(const char *what, const float *got, const double *want, size_t n, double rho) {
    for (size_t i = 0; i < n; i++) {
        if (isinf(want[i])) {
            if (!(isinf(got[i]) && got[i] < 0)) {
                fprintf(stderr, "  %s: [%zu] got %g want -inf\n", what, i, got[i]);
                return 0;
            }
            continue;
        }
        double tol = rho * (1 + fabs(want[i])) * 4;
        if (!(fabs(got[i] - want[i]) <= tol)) {
            fprintf(stderr, "  %s: [%zu] got %.9g want %.9g (bound %.3g)\n", what, i, got[i], want[i], tol);
            return 0;
        }
    }
    return 1;
}
/* |a - b| within twice the bound (both are within it of the float64 value) */
static int check_pair(const char *what, const float *x, const float *y, size_t rows, size_t row, size_t ld,
                      const double *M, double nfac, double sabs) {
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < row; c++) {
            size_t i = r * ld + c;
            double tol = 8 * U32 * nfac * (1 + sabs) * M[r * row + c] + 8 * U32 * (fabs(x[i]) + fabs(y[i]));
            if (!(fabs((double)x[i] - y[i]) <= tol)) {
                fprintf(stderr, "  %s: [%zu,%zu] %.9g vs %.9g (bound %.3g)\n", what, r, c, x[i], y[i], tol);
                return 0;
            }
        }
    return 1;
}

/* ---- one general case ---------------------------------------------------------------------- */

typedef struct {
    int B, Tq, Tk, NH, NKV, HD, causal, bias, mask, dbias, strided;
    int mask_all_b1; /* batch element 1: every key padding (all its rows see nothing) */
} attn_case;

static void run_case(const attn_case *cs) {
    char name[160];
    snprintf(name, sizeof name, "B%d Tq%d Tk%d NH%d/%d HD%d%s%s%s%s%s", cs->B, cs->Tq, cs->Tk, cs->NH, cs->NKV, cs->HD,
             cs->causal ? " causal" : "", cs->bias ? " bias" : "", cs->mask ? " kmask" : "",
             cs->dbias ? " dbias" : "", cs->strided ? " strided" : "");
    fl_test_rng rng = {(unsigned long long)(cs->Tq * 131 + cs->Tk * 7 + cs->HD + cs->NKV * 1000 + cs->bias * 3)};
    fl_attn_desc a = {0};
    a.B = cs->B, a.Tq = cs->Tq, a.Tk = cs->Tk, a.NH = cs->NH, a.NKV = cs->NKV, a.HD = cs->HD;
    a.scale = 1.0f / sqrtf((float)cs->HD);
    a.causal = cs->causal;
    const size_t wq = (size_t)a.NH * a.HD, wk = (size_t)a.NKV * a.HD;
    a.ldq = wq + (cs->strided ? 3 : 0);
    a.ldk = wk + (cs->strided ? 5 : 0);
    a.ldv = wk + (cs->strided ? 1 : 0);
    a.ldo = wq + (cs->strided ? 2 : 0);
    const size_t nq = (size_t)a.B * a.Tq * a.ldq, nk = (size_t)a.B * a.Tk * a.ldk, nv = (size_t)a.B * a.Tk * a.ldv;
    const size_t no = (size_t)a.B * a.Tq * a.ldo, nl = (size_t)a.B * a.NH * a.Tq, nb = (size_t)a.NH * a.Tq * a.Tk;
    float *q = fl_test_frand(&rng, nq, -1.5f, 1.5f), *k = fl_test_frand(&rng, nk, -1.5f, 1.5f), *v = fl_test_frand(&rng, nv, -1, 1);
    float *bias = cs->bias ? fl_test_frand(&rng, nb, -1, 1) : NULL, *dout = fl_test_frand(&rng, no, -1, 1);
    uint8_t *kmask = NULL;
    if (cs->mask) {
        kmask = malloc((size_t)a.B * a.Tk);
        for (size_t i = 0; i < (size_t)a.B * a.Tk; i++) kmask[i] = (fl_test_rng_u64(&rng) % 5) != 0;
        if (a.B > 1) {
            kmask[(size_t)a.Tk] = 0; /* causal self-attention: row 0 of b=1 sees nothing */
            if (cs->mask_all_b1) memset(kmask + a.Tk, 0, a.Tk);
        }
    }
    /* reference */
    ref_t R = {a, q, k, v, bias, dout, kmask, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, NULL, NULL,
               NULL};
    const size_t cq = (size_t)a.B * a.Tq * wq, ck = (size_t)a.B * a.Tk * wk;
    R.out = dzeros(cq), R.lse = dzeros(nl), R.dq = dzeros(cq), R.dk = dzeros(ck), R.dv = dzeros(ck);
    R.Mo = dzeros(cq), R.Mq = dzeros(cq), R.Mk = dzeros(ck), R.Mv = dzeros(ck);
    R.dbias = cs->dbias ? dzeros(nb) : NULL, R.Mb = cs->dbias ? dzeros(nb) : NULL;
    ref_run(&R);
    const double nfac = a.HD + (double)a.Tq * (a.NH / a.NKV) + a.Tk + a.B + 16;
    const double rho = U32 * (a.HD + a.Tk + 8) * (1 + R.sabs);

    /* forward: emulated twice (two fiber orders), CPU backend once; sentinels in the stride padding */
    float *out1 = fl_test_frand(&rng, no, 7, 8), *out2 = fl_test_fdup(out1, no), *outc = fl_test_fdup(out1, no), *out0 = fl_test_fdup(out1, no);
    float *lse1 = malloc(nl * 4), *lse2 = malloc(nl * 4), *lsec = malloc(nl * 4);
    fl_cu_emu_set_seed(k_seed_a);
    int rc = emu_call(fl_cuemu_attention_forward_ex(&a, out1, NULL, lse1, q, k, v, bias, kmask, NULL), name);
    fl_cu_emu_set_seed(k_seed_b);
    rc |= emu_call(fl_cuemu_attention_forward_ex(&a, out2, NULL, lse2, q, k, v, bias, kmask, NULL), name);
    FL_CHECKF(rc == 0, "%s: forward launcher -> %d", name, rc);
    FL_CHECKF(!memcmp(out1, out2, no * 4) && !memcmp(lse1, lse2, nl * 4), "%s: forward bits differ between runs", name);
    fl_backend be;
    fl_cpu_backend_init(&be, 2);
    FL_CHECK(be.attention_forward(&be, &a, outc, lsec, q, k, v, bias, kmask) == FL_OK);
    const size_t rows = (size_t)a.B * a.Tq;
    FL_CHECKF(check_bound("out vs float64", out1, NULL, rows, wq, a.ldo, R.out, R.Mo, nfac, R.sabs), "%s: out", name);
    FL_CHECKF(check_lse("lse vs float64", lse1, R.lse, nl, rho), "%s: lse", name);
    FL_CHECKF(check_pair("out vs cpu", out1, outc, rows, wq, a.ldo, R.Mo, nfac, R.sabs), "%s: out vs cpu", name);
    int pad_ok = 1;
    for (size_t r = 0; r < rows; r++)
        for (size_t c = wq; c < a.ldo; c++) pad_ok &= out1[r * a.ldo + c] == out0[r * a.ldo + c];
    FL_CHECKF(pad_ok, "%s: forward wrote into the stride padding", name);

    /* backward: gradients pre-filled (the op accumulates), out/lse from the emulated forward */
    float *dq0 = fl_test_frand(&rng, nq, -0.5f, 0.5f), *dk0 = fl_test_frand(&rng, nk, -0.5f, 0.5f), *dv0 = fl_test_frand(&rng, nv, -0.5f, 0.5f);
    float *db0 = cs->dbias ? fl_test_frand(&rng, nb, -0.5f, 0.5f) : NULL;
    float *dq1 = fl_test_fdup(dq0, nq), *dk1 = fl_test_fdup(dk0, nk), *dv1 = fl_test_fdup(dv0, nv), *db1 = db0 ? fl_test_fdup(db0, nb) : NULL;
    float *dq2 = fl_test_fdup(dq0, nq), *dk2 = fl_test_fdup(dk0, nk), *dv2 = fl_test_fdup(dv0, nv), *db2 = db0 ? fl_test_fdup(db0, nb) : NULL;
    float *dqc = fl_test_fdup(dq0, nq), *dkc = fl_test_fdup(dk0, nk), *dvc = fl_test_fdup(dv0, nv), *dbc = db0 ? fl_test_fdup(db0, nb) : NULL;
    size_t wb = fl_cu_attention_work_bytes(a.B, a.NH, a.Tq);
    FL_CHECK(wb == nl * sizeof(float));
    float *work = malloc(wb ? wb : 1);
    fl_cu_emu_set_seed(k_seed_a);
    rc = emu_call(fl_cuemu_attention_backward_ex(&a, dq1, dk1, dv1, db1, dout, q, k, v, bias, kmask, out1, lse1, work,
                                                 NULL), name);
    fl_cu_emu_set_seed(k_seed_b);
    rc |= emu_call(fl_cuemu_attention_backward_ex(&a, dq2, dk2, dv2, db2, dout, q, k, v, bias, kmask, out1, lse1, work,
                                                  NULL), name);
    FL_CHECKF(rc == 0, "%s: backward launcher -> %d", name, rc);
    FL_CHECKF(!memcmp(dq1, dq2, nq * 4) && !memcmp(dk1, dk2, nk * 4) && !memcmp(dv1, dv2, nv * 4) &&
                  (!db1 || !memcmp(db1, db2, nb * 4)),
              "%s: backward bits differ between runs", name);
    FL_CHECK(be.attention_backward(&be, &a, dqc, dkc, dvc, dbc, dout, q, k, v, bias, kmask, outc, lsec) == FL_OK);
    const size_t krows = (size_t)a.B * a.Tk;
    FL_CHECKF(check_bound("dq vs float64", dq1, dq0, rows, wq, a.ldq, R.dq, R.Mq, nfac, R.sabs), "%s: dq", name);
    FL_CHECKF(check_bound("dk vs float64", dk1, dk0, krows, wk, a.ldk, R.dk, R.Mk, nfac, R.sabs), "%s: dk", name);
    FL_CHECKF(check_bound("dv vs float64", dv1, dv0, krows, wk, a.ldv, R.dv, R.Mv, nfac, R.sabs), "%s: dv", name);
    if (db1)
        FL_CHECKF(check_bound("dbias vs float64", db1, db0, (size_t)a.NH * a.Tq, a.Tk, a.Tk, R.dbias, R.Mb, nfac,
                              R.sabs),
                  "%s: dbias", name);
    FL_CHECKF(check_pair("dq vs cpu", dq1, dqc, rows, wq, a.ldq, R.Mq, nfac, R.sabs), "%s: dq vs cpu", name);
    FL_CHECKF(check_pair("dk vs cpu", dk1, dkc, krows, wk, a.ldk, R.Mk, nfac, R.sabs), "%s: dk vs cpu", name);
    FL_CHECKF(check_pair("dv vs cpu", dv1, dvc, krows, wk, a.ldv, R.Mv, nfac, R.sabs), "%s: dv vs cpu", name);
    if (db1)
        FL_CHECKF(check_pair("dbias vs cpu", db1, dbc, (size_t)a.NH * a.Tq, a.Tk, a.Tk, R.Mb, nfac, R.sabs),
                  "%s: dbias vs cpu", name);
    /* the stride padding of the gradients is not touched */
    pad_ok = 1;
    for (size_t r = 0; r < rows; r++)
        for (size_t c = wq; c < a.ldq; c++) pad_ok &= dq1[r * a.ldq + c] == dq0[r * a.ldq + c];
    for (size_t r = 0; r < krows; r++) {
        for (size_t c = wk; c < a.ldk; c++) pad_ok &= dk1[r * a.ldk + c] == dk0[r * a.ldk + c];
        for (size_t c = wk; c < a.ldv; c++) pad_ok &= dv1[r * a.ldv + c] == dv0[r * a.ldv + c];
    }
    FL_CHECKF(pad_ok, "%s: backward wrote into the stride padding", name);
    fl_backend_free(&be);

    free(q), free(k), free(v), free(bias), free(dout), free(kmask);
    free(R.out), free(R.lse), free(R.dq), free(R.dk), free(R.dv), free(R.Mo), free(R.Mq), free(R.Mk), free(R.Mv);
    free(R.dbias), free(R.Mb);
    free(out1), free(out2), free(outc), free(out0), free(lse1), free(lse2), free(lsec);
    free(dq0), free(dk0), free(dv0), free(db0), free(dq1), free(dk1), free(dv1), free(db1);
    free(dq2), free(dk2), free(dv2), free(db2), free(dqc), free(dkc), free(dvc), free(dbc), free(work);
}

FL_TEST(cuda_attn_ex_self) {
    /* T = 1, 7, 33 (crosses the 32-key and 16-key tiles), HD 8 / 24 (bucket 32) and 64 */
    const attn_case cases[] = {
        {2, 1, 1, 6, 2, 24, 1, 0, 0, 0, 0, 0},
        {2, 7, 7, 4, 4, 8, 1, 0, 0, 0, 1, 0},
        {2, 33, 33, 6, 2, 24, 1, 1, 1, 1, 1, 0}, /* row 0 of b=1 sees no key */
        {2, 33, 33, 4, 4, 64, 0, 0, 1, 0, 0, 1}, /* b=1 fully padded */
        {2, 33, 33, 6, 2, 64, 1, 0, 0, 0, 1, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i]);
}

FL_TEST(cuda_attn_ex_cross) {
    const attn_case cases[] = {
        {2, 33, 7, 4, 4, 64, 1, 0, 0, 0, 0, 0},  /* causal, Tq > Tk: rows t < 26 see nothing */
        {2, 7, 33, 6, 2, 64, 0, 1, 1, 1, 1, 0},  /* bidirectional cross with bias, mask, dbias */
        {2, 7, 33, 6, 2, 24, 1, 1, 0, 1, 0, 0},  /* causal, Tq < Tk (bottom-right) */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i]);
}

FL_TEST(cuda_attn_ex_wide_heads) {
    /* the 128 and 256 buckets (their own tile shapes); HD 80 and 200 leave zero dimensions */
    const attn_case cases[] = {
        {2, 7, 7, 4, 4, 128, 1, 0, 1, 0, 1, 0},
        {2, 7, 19, 4, 2, 80, 0, 1, 0, 1, 0, 0},
        {2, 7, 7, 2, 2, 256, 1, 0, 0, 0, 0, 0},
        {2, 7, 19, 2, 1, 200, 1, 1, 1, 1, 1, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i]);
}

FL_TEST(cuda_attn_errors) {
    float x[64] = {0}, work[16];
    fl_attn_desc a = {2, 3, 3, 4, 4, 300, 1200, 1200, 1200, 1200, 0.1f, 1, 0, 0};
    FL_CHECK(fl_cuemu_attention_forward_ex(&a, x, NULL, x, x, x, x, NULL, NULL, NULL) == FL_CU_ATTN_UNSUPPORTED);
    FL_CHECK(fl_cuemu_attention_forward(x, x, x, 1, 2, 2, 2, 300, NULL) == FL_CU_ATTN_UNSUPPORTED);
    FL_CHECK(fl_cuemu_attention_decode(x, x, x, x, 2, 2, 2, 300, 600, NULL) == FL_CU_ATTN_UNSUPPORTED);
    a.HD = 8, a.NKV = 3; /* NH % NKV */
    FL_CHECK(fl_cuemu_attention_forward_ex(&a, x, NULL, x, x, x, x, NULL, NULL, NULL) == FL_CU_ATTN_INVALID);
    a.NKV = 4, a.ldk = 8; /* stride < NKV*HD */
    FL_CHECK(fl_cuemu_attention_forward_ex(&a, x, NULL, x, x, x, x, NULL, NULL, NULL) == FL_CU_ATTN_INVALID);
    a.ldk = 32;
    FL_CHECK(fl_cuemu_attention_backward_ex(&a, x, x, x, x /*dbias without bias*/, x, x, x, x, NULL, NULL, x, x, work,
                                            NULL) == FL_CU_ATTN_INVALID);
    FL_CHECK(fl_cuemu_attention_decode(x, x, x, x, 0, 2, 2, 8, 16, NULL) == FL_CU_ATTN_INVALID);
    for (int i = 0; i < 64; i++) FL_CHECKF(x[i] == 0.0f, "an error path wrote x[%d]", i);
}

/* ---- the fused causal op on qkv rows ----------------------------------------------------------- */

FL_TEST(cuda_attn_fused) {
    const int B = 2, T = 33, NH = 6, NKV = 2, HD = 24, W = (NH + 2 * NKV) * HD, OW = NH * HD;
    fl_test_rng rng = {77};
    const size_t nx = (size_t)B * T * W, no = (size_t)B * T * OW, nl = (size_t)B * NH * T;
    float *qkv = fl_test_frand(&rng, nx, -1.5f, 1.5f), *dout = fl_test_frand(&rng, no, -1, 1);
    fl_attn_desc a = {B, T, T, NH, NKV, HD, W, W, W, OW, 1.0f / sqrtf((float)HD), 1, 0, 0};
    ref_t R = {a, qkv, qkv + NH * HD, qkv + (NH + NKV) * HD, NULL, dout, NULL, NULL, NULL, NULL, NULL, NULL,
               NULL, NULL, NULL, NULL, NULL, NULL, 0, NULL, NULL, NULL};
    R.out = dzeros(no), R.lse = dzeros(nl), R.dq = dzeros(no), R.Mo = dzeros(no), R.Mq = dzeros(no);
    const size_t ck = (size_t)B * T * NKV * HD;
    R.dk = dzeros(ck), R.dv = dzeros(ck), R.Mk = dzeros(ck), R.Mv = dzeros(ck);
    ref_run(&R);
    const double nfac = HD + (double)T * (NH / NKV) + T + B + 16;
    float *out1 = malloc(no * 4), *out2 = malloc(no * 4), *outc = malloc(no * 4);
    float *lse1 = malloc(nl * 4), *lse2 = malloc(nl * 4), *lsec = malloc(nl * 4);
    fl_cu_emu_set_seed(k_seed_a);
    int rc = emu_call(fl_cuemu_attention_forward(out1, lse1, qkv, B, T, NH, NKV, HD, NULL), "fused fwd");
    fl_cu_emu_set_seed(k_seed_b);
    rc |= emu_call(fl_cuemu_attention_forward(out2, lse2, qkv, B, T, NH, NKV, HD, NULL), "fused fwd");
    FL_CHECK(rc == 0);
    FL_CHECK(!memcmp(out1, out2, no * 4) && !memcmp(lse1, lse2, nl * 4));
    fl_backend be;
    fl_cpu_backend_init(&be, 2);
    fl_attention_qkv_forward(&be, outc, lsec, qkv, B, T, NH, NKV, HD);
    FL_CHECK(check_bound("fused out vs float64", out1, NULL, (size_t)B * T, OW, OW, R.out, R.Mo, nfac, R.sabs));
    FL_CHECK(check_lse("fused lse vs float64", lse1, R.lse, nl, U32 * (HD + T + 8) * (1 + R.sabs)));
    FL_CHECK(check_pair("fused out vs cpu", out1, outc, (size_t)B * T, OW, OW, R.Mo, nfac, R.sabs));
    float *g0 = fl_test_frand(&rng, nx, -0.5f, 0.5f), *g1 = fl_test_fdup(g0, nx), *g2 = fl_test_fdup(g0, nx), *gc = fl_test_fdup(g0, nx);
    float *work = malloc(fl_cu_attention_work_bytes(B, NH, T));
    fl_cu_emu_set_seed(k_seed_a);
    rc = emu_call(fl_cuemu_attention_backward(g1, dout, qkv, out1, lse1, B, T, NH, NKV, HD, work, NULL), "fused bwd");
    fl_cu_emu_set_seed(k_seed_b);
    rc |= emu_call(fl_cuemu_attention_backward(g2, dout, qkv, out1, lse1, B, T, NH, NKV, HD, work, NULL), "fused bwd");
    FL_CHECK(rc == 0);
    FL_CHECKF(!memcmp(g1, g2, nx * 4), "fused backward bits differ between runs");
    fl_attention_qkv_backward(&be, gc, dout, qkv, outc, lsec, B, T, NH, NKV, HD);
    const size_t rows = (size_t)B * T, wk = (size_t)NKV * HD;
    FL_CHECK(check_bound("fused dq", g1, g0, rows, OW, W, R.dq, R.Mq, nfac, R.sabs));
    FL_CHECK(check_bound("fused dk", g1 + OW, g0 + OW, rows, wk, W, R.dk, R.Mk, nfac, R.sabs));
    FL_CHECK(check_bound("fused dv", g1 + OW + wk, g0 + OW + wk, rows, wk, W, R.dv, R.Mv, nfac, R.sabs));
    FL_CHECK(check_pair("fused dq vs cpu", g1, gc, rows, OW, W, R.Mq, nfac, R.sabs));
    FL_CHECK(check_pair("fused dk vs cpu", g1 + OW, gc + OW, rows, wk, W, R.Mk, nfac, R.sabs));
    FL_CHECK(check_pair("fused dv vs cpu", g1 + OW + wk, gc + OW + wk, rows, wk, W, R.Mv, nfac, R.sabs));
    fl_backend_free(&be);
    free(qkv), free(dout), free(out1), free(out2), free(outc), free(lse1), free(lse2), free(lsec);
    free(g0), free(g1), free(g2), free(gc), free(work);
    free(R.out), free(R.lse), free(R.dq), free(R.dk), free(R.dv), free(R.Mo), free(R.Mq), free(R.Mk), free(R.Mv);
}

/* ---- decode: one query against the (NKV, Tmax, HD) cache ----------------------------------------- */

static void decode_case(int T, int NH, int NKV, int HD) {
    const int Tmax = 40;
    fl_test_rng rng = {(unsigned long long)(T * 17 + HD)};
    const size_t nc = (size_t)NKV * Tmax * HD, hs = (size_t)Tmax * HD;
    float *q = fl_test_frand(&rng, (size_t)NH * HD, -1.5f, 1.5f), *kc = fl_test_frand(&rng, nc, -1.5f, 1.5f), *vc = fl_test_frand(&rng, nc, -1, 1);
    float *o1 = malloc((size_t)NH * HD * 4), *o2 = malloc((size_t)NH * HD * 4), *oc = malloc((size_t)NH * HD * 4);
    fl_cu_emu_set_seed(k_seed_a);
    int rc = emu_call(fl_cuemu_attention_decode(o1, q, kc, vc, T, NH, NKV, HD, hs, NULL), "decode");
    fl_cu_emu_set_seed(k_seed_b);
    rc |= emu_call(fl_cuemu_attention_decode(o2, q, kc, vc, T, NH, NKV, HD, hs, NULL), "decode");
    FL_CHECKF(rc == 0, "decode T%d HD%d -> %d", T, HD, rc);
    FL_CHECKF(!memcmp(o1, o2, (size_t)NH * HD * 4), "decode T%d HD%d: bits differ between runs", T, HD);
    fl_backend be;
    fl_cpu_backend_init(&be, 2);
    be.attention_decode(&be, oc, q, kc, vc, T, NH, NKV, HD, hs);
    fl_backend_free(&be);
    /* float64 reference and the bound of the forward (Tq = 1, no mask) */
    const double scale = 1.0 / sqrt((double)HD);
    double *ref = dzeros((size_t)NH * HD), *M = dzeros((size_t)NH * HD), *s = dzeros(T), sabs = 0;
    for (int h = 0; h < NH; h++) {
        const int g = h / (NH / NKV);
        double m = -INFINITY, l = 0;
        for (int t = 0; t < T; t++) {
            double dot = 0, mag = 0;
            for (int d = 0; d < HD; d++) {
                dot += (double)q[h * HD + d] * kc[g * hs + (size_t)t * HD + d];
                mag += fabs((double)q[h * HD + d] * kc[g * hs + (size_t)t * HD + d]);
            }
            s[t] = dot * scale;
            sabs = fmax(sabs, mag * scale);
            m = fmax(m, s[t]);
        }
        for (int t = 0; t < T; t++) l += exp(s[t] - m);
        for (int t = 0; t < T; t++)
            for (int d = 0; d < HD; d++) {
                double p = exp(s[t] - m) / l;
                ref[h * HD + d] += p * vc[g * hs + (size_t)t * HD + d];
                M[h * HD + d] += p * fabs((double)vc[g * hs + (size_t)t * HD + d]);
            }
    }
    const double nfac = HD + 1.0 + T + 1 + 16;
    FL_CHECKF(check_bound("decode vs float64", o1, NULL, NH, HD, HD, ref, M, nfac, sabs), "decode T%d HD%d", T, HD);
    FL_CHECKF(check_pair("decode vs cpu", o1, oc, NH, HD, HD, M, nfac, sabs), "decode T%d HD%d vs cpu", T, HD);
    free(q), free(kc), free(vc), free(o1), free(o2), free(oc), free(ref), free(M), free(s);
}

FL_TEST(cuda_attn_decode) {
    decode_case(1, 6, 2, 24);
    decode_case(7, 4, 4, 8);
    decode_case(33, 6, 2, 64);
    decode_case(33, 4, 1, 200);
}

/* ---- the tensor-core (bf16) kernels: kernels/attention_tc.cu --------------------------------------
 *
 * The mma primitive first: small integers make every product and partial sum exact in fp32, so
 * the result is the integer matmul's whatever the summation order (the emulator's or a GPU's),
 * and a fragment taken transposed or from the wrong lane gives other numbers (the test checks
 * that A^T B differs from A B, so a transposed A cannot pass). Random bf16 values: within the
 * fp32 accumulation bound of 17 terms, doubled (tensor cores truncate; the emulator rounds).
 *
 * The attention kernels: Q, K, V, dO and the products' P and dS rounded to bf16 (u = 2^-8), fp32
 * elsewhere. Inputs either bf16 values already (ui = 0: only P / dS rounding and fp32 remain, a
 * bound of ~0.4% of the |term| sums) or any fp32 (ui = 2^-8). Derived (first order terms kept
 * exactly, products of the factors for the higher orders; u32 = 2^-24, sabs the largest
 * scale * sum|q k|, Ls = 1 + sabs + log(Tk + 1) bounds |lse| and the scores):
 *   scores:  ES = (2 ui + ui^2) sabs + 2 u32 (HD + 8)(1 + sabs)       (operands, fp32 dot)
 *   lse:     EL = ES + 4 u32 (Tk + 8) Ls                               (max moves by ES, l's sum)
 *   out:     wP = e^(2 ES)(1 + u)(1 + ui) - 1 relative per weight p_j v_j (normalized p moves by
 *            e^(+-2 ES), P and V rounded), eo = wP + 2 u32 (Tk + HD + 16)(1 + wP); |err| <= eo Mo
 *   backward: recomputed p = exp(s - lse) relative rp = e^(ES + EL + 2 u32 Ls) - 1;
 *            c = (1 + u)(1 + ui)(1 + rp);
 *            dS = p (dP - D): dP's operands and fp32 sum (2 ui + ui^2 + 2 u32 HD)(P1 + P2), D from
 *            the kernel's out: sum_d |dO_d| eo Mo_d = eo Qt (Mq2 / Mk2 carry Qt);
 *   dq, dk:  |err| <= [(rp + 2 ui + ui^2 + 2 u32 HD) c + (1 + u)(1 + ui) - 1 + 4 u32 (Tk + Tq rep + 16) c] M
 *            + (eo + 2 u32 HD) c M2
 *   dv:      |err| <= [c - 1 + 4 u32 (Tq rep + 16) c] Mv
 * plus 4 u32 (|x| + |x0|) for the += into pre-filled gradients. A row that sees no key: exact. */
#define U16 (1.0 / 256.0)

static float bfround(float x) { return fl_bf16_to_f32(fl_f32_to_bf16(x)); }

FL_TEST(cuda_attn_mma) {
    fl_test_rng rng = {4242};
    uint16_t A[256], B[128];
    float Af[256], Bf[128], C[128], D1[128], D2[128];
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < 256; i++) {
            Af[i] = pass == 0 ? (float)((int)(fl_test_rng_u64(&rng) % 17) - 8) : bfround(fl_test_rng_uniform(&rng, -2, 2));
            A[i] = fl_f32_to_bf16(Af[i]);
        }
        for (int i = 0; i < 128; i++) {
            Bf[i] = pass == 0 ? (float)((int)(fl_test_rng_u64(&rng) % 17) - 8) : bfround(fl_test_rng_uniform(&rng, -2, 2));
            B[i] = fl_f32_to_bf16(Bf[i]);
            C[i] = pass == 0 ? (float)((int)(fl_test_rng_u64(&rng) % 101) - 50) : fl_test_rng_uniform(&rng, -4, 4);
        }
        fl_cu_emu_set_seed(k_seed_a);
        int rc = emu_call(fl_cuemu_mma_bf16_check(D1, A, B, C, NULL), "mma");
        fl_cu_emu_set_seed(k_seed_b);
        rc |= emu_call(fl_cuemu_mma_bf16_check(D2, A, B, C, NULL), "mma");
        FL_CHECK(rc == 0);
        FL_CHECK(!memcmp(D1, D2, sizeof D1));
        int bad = 0, transposed_differs = 0;
        for (int r = 0; r < 16; r++)
            for (int n = 0; n < 8; n++) {
                double want = C[r * 8 + n], wantT = want, mag = fabs(want);
                for (int kk = 0; kk < 16; kk++) {
                    want += (double)Af[r * 16 + kk] * Bf[kk * 8 + n];
                    wantT += (double)Af[kk * 16 + r] * Bf[kk * 8 + n];
                    mag += fabs((double)Af[r * 16 + kk] * Bf[kk * 8 + n]);
                }
                const double tol = pass == 0 ? 0.0 : 2 * 17 * U32 * mag;
                transposed_differs += wantT != want;
                if (!(fabs(D1[r * 8 + n] - want) <= tol)) {
                    if (!bad++)
                        fprintf(stderr, "  mma pass %d: D[%d][%d] = %.9g want %.9g (bound %.3g)\n", pass, r, n,
                                D1[r * 8 + n], want, tol);
                }
            }
        FL_CHECKF(bad == 0, "mma pass %d: %d of 128 outputs wrong", pass, bad);
        FL_CHECK(transposed_differs > 64);
    }
}

typedef struct {
    int B, Tq, Tk, NH, NKV, HD, causal, mask, strided, exact_in;
    /* the fa2 kernels' EX cases (attention_*_fa2_b): a bias (NH, Tq, Tk), its gradient, dropout p = 0.2, T5's scale 1 */
    int bias, dbias, drop, t5;
} tc_case;

/* The kernels under test: the tensor-core (_tc, "legacy") or the FlashAttention-2-structured
 * (_fa2, "own") launchers; the same semantics, roundings and bound, except that _fa2 adds dq's
 * contribution of each 64-key block into dq separately: one more fp32 rounding of the running
 * sum per key block, within nkb u (|dq0| + M) (the partial sums never exceed |dq0| + M). */
typedef int (*tc_fwd_fn)(const fl_attn_desc *, float *, void *, float *, const float *, const float *,
                         const float *, const uint8_t *, void *);
typedef int (*tc_bwd_fn)(const fl_attn_desc *, float *, float *, float *, const float *, const float *,
                         const float *, const float *, const uint8_t *, const float *, const float *, void *, void *);
static tc_fwd_fn g_tc_fwd = fl_cuemu_attention_forward_tc;
static tc_bwd_fn g_tc_bwd = fl_cuemu_attention_backward_tc;
static double g_dq_adds; /* key blocks adding into dq separately (0: one add) */
/* the _fa2 backward in 128-key blocks of 8 warps (FITLLM_CUDA_FA2_BK=128) */
static int fa2_bwd_bk128(const fl_attn_desc *a, float *dq, float *dk, float *dv, const float *dout, const float *q,
                         const float *k, const float *v, const uint8_t *m, const float *o, const float *l, void *w,
                         void *st) {
    return fl_cuemu_attention_backward_fa2_ex(a, dq, dk, dv, dout, q, k, v, m, o, l, w, FL_CU_FA2_BK128, st);
}
/* 64-key blocks whatever the head size (a padded head's default is 128: FITLLM_CUDA_FA2_BK=64) */
static int fa2_bwd_bk64(const fl_attn_desc *a, float *dq, float *dk, float *dv, const float *dout, const float *q,
                        const float *k, const float *v, const uint8_t *m, const float *o, const float *l, void *w,
                        void *st) {
    return fl_cuemu_attention_backward_fa2_ex(a, dq, dk, dv, dout, q, k, v, m, o, l, w, FL_CU_FA2_BK64, st);
}
/* key blocks of the backward under test adding into dq separately (the plain _fa2 launcher: at most as many) */
static double dq_adds(const fl_attn_desc *a) {
    return g_tc_bwd == fl_cuemu_attention_backward_tc ? 0.0
           : g_tc_bwd == fa2_bwd_bk128                ? (a->Tk + 127) / 128
                                                      : (a->Tk + 63) / 64;
}

static int check_b16(const char *what, const float *got, const float *pre, size_t rows, size_t row, size_t ld,
                     const double *want, const double *M, double fM, const double *M2, double fM2, double *worst) {
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < row; c++) {
            const size_t gi = r * ld + c, wi = r * row + c;
            const double x = got[gi], p0 = pre ? pre[gi] : 0.0, err = fabs(x - p0 - want[wi]);
            const double tol = fM * M[wi] + (M2 ? fM2 * M2[wi] : 0.0) + 4 * U32 * (fabs(x) + fabs(p0)) +
                               g_dq_adds * U32 * (fabs(p0) + M[wi]);
            if (!(err <= tol)) {
                fprintf(stderr, "  %s: [%zu,%zu] got %.9g want %.9g (err %.3g > bound %.3g)\n", what, r, c, x - p0,
                        want[wi], err, tol);
                return 0;
            }
            if (tol > 0 && err / tol > *worst) *worst = err / tol;
        }
    return 1;
}

/* the _fa2 backward's flags of the launcher under test (the EX cases call attention_backward_fa2_b) */
static int fa2_flags(void) { return g_tc_bwd == fa2_bwd_bk128 ? FL_CU_FA2_BK128 : g_tc_bwd == fa2_bwd_bk64 ? FL_CU_FA2_BK64 : 0; }

static void tc_run(const tc_case *cs) {
    char name[200];
    const int ex = cs->bias || cs->drop; /* the EX kernels (attention_*_fa2_b) */
    snprintf(name, sizeof name, "%s B%d Tq%d Tk%d NH%d/%d HD%d%s%s%s%s%s%s%s%s",
             g_tc_fwd == fl_cuemu_attention_forward_tc ? "tc"
             : g_tc_bwd == fa2_bwd_bk128              ? "fa2-bk128"
                                                      : "fa2",
             cs->B, cs->Tq, cs->Tk, cs->NH, cs->NKV, cs->HD,
             cs->causal ? " causal" : "", cs->mask ? " kmask" : "", cs->strided ? " strided" : "",
             cs->exact_in ? " bf16-inputs" : " fp32-inputs", cs->bias ? " bias" : "", cs->dbias ? " dbias" : "",
             cs->drop ? " dropout" : "", cs->t5 ? " scale-1" : "");
    fl_test_rng rng = {(unsigned long long)(cs->Tq * 131 + cs->Tk * 7 + cs->HD + cs->NKV * 1000 + cs->exact_in +
                                            cs->bias * 17 + cs->drop * 29)};
    fl_attn_desc a = {0};
    a.B = cs->B, a.Tq = cs->Tq, a.Tk = cs->Tk, a.NH = cs->NH, a.NKV = cs->NKV, a.HD = cs->HD;
    a.scale = cs->t5 ? 1.0f : 1.0f / sqrtf((float)cs->HD);
    a.causal = cs->causal;
    a.drop_p = cs->drop ? 0.2f : 0.0f, a.drop_seed = 0x7e57d209ull + (uint64_t)cs->Tq;
    const size_t wq = (size_t)a.NH * a.HD, wk = (size_t)a.NKV * a.HD;
    a.ldq = wq + (cs->strided ? 2 : 0);
    a.ldk = wk + (cs->strided ? 4 : 0);
    a.ldv = wk + (cs->strided ? 6 : 0);
    a.ldo = wq + (cs->strided ? 2 : 0);
    const size_t nq = (size_t)a.B * a.Tq * a.ldq, nk = (size_t)a.B * a.Tk * a.ldk, nv = (size_t)a.B * a.Tk * a.ldv;
    const size_t no = (size_t)a.B * a.Tq * a.ldo, nl = (size_t)a.B * a.NH * a.Tq;
    const float qk = cs->t5 ? 0.4f : 1.5f; /* scale 1: smaller q, k (T5's scores are of a few units) */
    float *q = fl_test_frand(&rng, nq, -qk, qk), *k = fl_test_frand(&rng, nk, -qk, qk);
    float *v = fl_test_frand(&rng, nv, -1, 1), *dout = fl_test_frand(&rng, no, -1, 1);
    const size_t nb = (size_t)a.NH * a.Tq * a.Tk;
    float *bias = cs->bias ? fl_test_frand(&rng, nb, -2, 2) : NULL;
    if (cs->exact_in) {
        for (size_t i = 0; i < nq; i++) q[i] = bfround(q[i]);
        for (size_t i = 0; i < nk; i++) k[i] = bfround(k[i]);
        for (size_t i = 0; i < nv; i++) v[i] = bfround(v[i]);
        for (size_t i = 0; i < no; i++) dout[i] = bfround(dout[i]);
    }
    uint8_t *kmask = NULL;
    if (cs->mask) {
        kmask = malloc((size_t)a.B * a.Tk);
        for (size_t i = 0; i < (size_t)a.B * a.Tk; i++) kmask[i] = (fl_test_rng_u64(&rng) % 5) != 0;
        if (a.B > 1) memset(kmask + a.Tk, 0, a.Tk); /* b = 1: every key padding, no row sees anything */
    }
    ref_t R = {a, q, k, v, bias, dout, kmask, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0,
               NULL, NULL, NULL};
    const size_t cq = (size_t)a.B * a.Tq * wq, ck = (size_t)a.B * a.Tk * wk;
    R.out = dzeros(cq), R.lse = dzeros(nl), R.dq = dzeros(cq), R.dk = dzeros(ck), R.dv = dzeros(ck);
    R.Mo = dzeros(cq), R.Mq = dzeros(cq), R.Mk = dzeros(ck), R.Mv = dzeros(ck), R.Mq2 = dzeros(cq), R.Mk2 = dzeros(ck);
    if (cs->dbias) R.dbias = dzeros(nb), R.Mb = dzeros(nb), R.Mb2 = dzeros(nb);
    ref_run(&R);
    /* the bound (see above) */
    const double ui = cs->exact_in ? 0.0 : U16, u = U16, rep = a.NH / a.NKV, sab = R.sabs;
    const double Ls = 1 + sab + log(a.Tk + 1.0);
    const double ES = (2 * ui + ui * ui) * sab + 2 * U32 * (a.HD + 8) * (1 + sab);
    const double EL = ES + 4 * U32 * (a.Tk + 8) * Ls;
    /* dropout: P f and dP f take one more fp32 rounding each (the factor f is the ops' fp32 value, exact) */
    const double ud = cs->drop ? U32 : 0.0;
    const double wP = exp(2 * ES) * (1 + u) * (1 + ui) * (1 + ud) - 1, eo = wP + 2 * U32 * (a.Tk + a.HD + 16) * (1 + wP);
    const double rp = exp(ES + EL + 2 * U32 * Ls) - 1, c = (1 + u) * (1 + ui) * (1 + rp) * (1 + ud);
    const double fqk = (rp + 2 * ui + ui * ui + 2 * U32 * a.HD) * c + ((1 + u) * (1 + ui) - 1) +
                       4 * U32 * (a.Tk + a.Tq * rep + 16) * c;
    const double fqk2 = (eo + 2 * U32 * a.HD) * c, fv = c - 1 + 4 * U32 * (a.Tq * rep + 16) * c;

    float *out1 = fl_test_frand(&rng, no, 7, 8), *out2 = fl_test_fdup(out1, no), *out0 = fl_test_fdup(out1, no);
    float *lse1 = malloc(nl * 4), *lse2 = malloc(nl * 4);
    fl_cu_emu_set_seed(k_seed_a);
    int rc = emu_call(ex ? fl_cuemu_attention_forward_fa2_b(&a, out1, NULL, lse1, q, k, v, bias, kmask, NULL)
                         : g_tc_fwd(&a, out1, NULL, lse1, q, k, v, kmask, NULL), name);
    fl_cu_emu_set_seed(k_seed_b);
    rc |= emu_call(ex ? fl_cuemu_attention_forward_fa2_b(&a, out2, NULL, lse2, q, k, v, bias, kmask, NULL)
                      : g_tc_fwd(&a, out2, NULL, lse2, q, k, v, kmask, NULL), name);
    FL_CHECKF(rc == 0, "%s: forward launcher -> %d", name, rc);
    FL_CHECKF(!memcmp(out1, out2, no * 4) && !memcmp(lse1, lse2, nl * 4), "%s: forward bits differ between runs", name);
    const size_t rows = (size_t)a.B * a.Tq, krows = (size_t)a.B * a.Tk;
    double wo = 0, wl = 0, wdq = 0, wdk = 0, wdv = 0;
    FL_CHECKF(check_b16("tc out vs float64", out1, NULL, rows, wq, a.ldo, R.out, R.Mo, eo, NULL, 0, &wo), "%s: out",
              name);
    int lse_ok = 1;
    for (size_t i = 0; i < nl && lse_ok; i++) {
        if (isinf(R.lse[i])) lse_ok = isinf(lse1[i]) && lse1[i] < 0;
        else {
            const double e = fabs(lse1[i] - R.lse[i]);
            lse_ok = e <= EL;
            if (e / EL > wl) wl = e / EL;
        }
        if (!lse_ok) fprintf(stderr, "  tc lse: [%zu] got %.9g want %.9g (bound %.3g)\n", i, lse1[i], R.lse[i], EL);
    }
    FL_CHECKF(lse_ok, "%s: lse", name);
    int pad_ok = 1;
    for (size_t r = 0; r < rows; r++)
        for (size_t cc = wq; cc < a.ldo; cc++) pad_ok &= out1[r * a.ldo + cc] == out0[r * a.ldo + cc];
    FL_CHECKF(pad_ok, "%s: forward wrote into the stride padding", name);

    /* backward, pre-filled gradients, twice (bits); then from the fp32 forward's out / lse (mixing) */
    float *dq0 = fl_test_frand(&rng, nq, -0.5f, 0.5f), *dk0 = fl_test_frand(&rng, nk, -0.5f, 0.5f), *dv0 = fl_test_frand(&rng, nv, -0.5f, 0.5f);
    float *dq1 = fl_test_fdup(dq0, nq), *dk1 = fl_test_fdup(dk0, nk), *dv1 = fl_test_fdup(dv0, nv);
    float *dq2 = fl_test_fdup(dq0, nq), *dk2 = fl_test_fdup(dk0, nk), *dv2 = fl_test_fdup(dv0, nv);
    float *db0 = cs->dbias ? fl_test_frand(&rng, nb, -0.5f, 0.5f) : NULL;
    float *db1 = db0 ? fl_test_fdup(db0, nb) : NULL, *db2 = db0 ? fl_test_fdup(db0, nb) : NULL;
    float *work = malloc(nl * 4 + 4);
    fl_cu_emu_set_seed(k_seed_a);
    rc = emu_call(ex ? fl_cuemu_attention_backward_fa2_b(&a, dq1, dk1, dv1, db1, dout, q, k, v, bias, kmask, out1, lse1,
                                                         work, fa2_flags(), NULL)
                     : g_tc_bwd(&a, dq1, dk1, dv1, dout, q, k, v, kmask, out1, lse1, work, NULL), name);
    fl_cu_emu_set_seed(k_seed_b);
    rc |= emu_call(ex ? fl_cuemu_attention_backward_fa2_b(&a, dq2, dk2, dv2, db2, dout, q, k, v, bias, kmask, out1, lse1,
                                                          work, fa2_flags(), NULL)
                      : g_tc_bwd(&a, dq2, dk2, dv2, dout, q, k, v, kmask, out1, lse1, work, NULL), name);
    FL_CHECKF(rc == 0, "%s: backward launcher -> %d", name, rc);
    FL_CHECKF(!memcmp(dq1, dq2, nq * 4) && !memcmp(dk1, dk2, nk * 4) && !memcmp(dv1, dv2, nv * 4) &&
                  (!db1 || !memcmp(db1, db2, nb * 4)),
              "%s: backward bits differ between runs", name);
    g_dq_adds = dq_adds(&a);
    FL_CHECKF(check_b16("tc dq vs float64", dq1, dq0, rows, wq, a.ldq, R.dq, R.Mq, fqk, R.Mq2, fqk2, &wdq), "%s: dq", name);
    g_dq_adds = 0;
    FL_CHECKF(check_b16("tc dk vs float64", dk1, dk0, krows, wk, a.ldk, R.dk, R.Mk, fqk, R.Mk2, fqk2, &wdk), "%s: dk", name);
    FL_CHECKF(check_b16("tc dv vs float64", dv1, dv0, krows, wk, a.ldv, R.dv, R.Mv, fv, NULL, 0, &wdv), "%s: dv", name);
    double wdb = 0;
    if (db1) { /* dS itself (dq's factors, which hold dS K's too) summed over the batch: B adds in fp32 */
        g_dq_adds = a.B;
        FL_CHECKF(check_b16("fa2 dbias vs float64", db1, db0, nb / a.Tk, a.Tk, a.Tk, R.dbias, R.Mb, fqk, R.Mb2, fqk2,
                            &wdb),
                  "%s: dbias", name);
        g_dq_adds = 0;
    }
    pad_ok = 1;
    for (size_t r = 0; r < rows; r++)
        for (size_t cc = wq; cc < a.ldq; cc++) pad_ok &= dq1[r * a.ldq + cc] == dq0[r * a.ldq + cc];
    for (size_t r = 0; r < krows; r++) {
        for (size_t cc = wk; cc < a.ldk; cc++) pad_ok &= dk1[r * a.ldk + cc] == dk0[r * a.ldk + cc];
        for (size_t cc = wk; cc < a.ldv; cc++) pad_ok &= dv1[r * a.ldv + cc] == dv0[r * a.ldv + cc];
    }
    FL_CHECKF(pad_ok, "%s: backward wrote into the stride padding", name);
    printf("      %s: worst err/bound out %.3f lse %.3f dq %.3f dk %.3f dv %.3f dbias %.3f (bounds: out %.2g, dq/dk %.2g + "
           "%.2g, dv %.2g relative)\n", name, wo, wl, wdq, wdk, wdv, wdb, eo, fqk, fqk2, fv);
    if (cs->exact_in && cs->strided) { /* the tc backward after the fp32 forward (its bias, dropout): the same bound */
        float *o3 = fl_test_fdup(out0, no), *l3 = malloc(nl * 4);
        float *dq3 = fl_test_fdup(dq0, nq), *dk3 = fl_test_fdup(dk0, nk), *dv3 = fl_test_fdup(dv0, nv);
        rc = emu_call(fl_cuemu_attention_forward_ex(&a, o3, NULL, l3, q, k, v, bias, kmask, NULL), name);
        rc |= emu_call(ex ? fl_cuemu_attention_backward_fa2_b(&a, dq3, dk3, dv3, NULL, dout, q, k, v, bias, kmask, o3, l3,
                                                              work, fa2_flags(), NULL)
                          : g_tc_bwd(&a, dq3, dk3, dv3, dout, q, k, v, kmask, o3, l3, work, NULL), name);
        FL_CHECK(rc == 0);
        double w3 = 0;
        g_dq_adds = dq_adds(&a);
        FL_CHECKF(check_b16("tc dq after fp32 fwd", dq3, dq0, rows, wq, a.ldq, R.dq, R.Mq, fqk, R.Mq2, fqk2, &w3) &&
                      check_b16("tc dk after fp32 fwd", dk3, dk0, krows, wk, a.ldk, R.dk, R.Mk, fqk, R.Mk2, fqk2, &w3) &&
                      check_b16("tc dv after fp32 fwd", dv3, dv0, krows, wk, a.ldv, R.dv, R.Mv, fv, NULL, 0, &w3),
                  "%s: backward after the fp32 forward", name);
        g_dq_adds = 0;
        free(o3), free(l3), free(dq3), free(dk3), free(dv3);
    }
    free(q), free(k), free(v), free(dout), free(kmask), free(bias);
    free(R.out), free(R.lse), free(R.dq), free(R.dk), free(R.dv), free(R.Mo), free(R.Mq), free(R.Mk), free(R.Mv);
    free(R.Mq2), free(R.Mk2), free(R.dbias), free(R.Mb), free(R.Mb2), free(db0), free(db1), free(db2);
    free(out1), free(out2), free(out0), free(lse1), free(lse2);
    free(dq0), free(dk0), free(dv0), free(dq1), free(dk1), free(dv1), free(dq2), free(dk2), free(dv2), free(work);
}

FL_TEST(cuda_attn_tc) {
    const tc_case cases[] = {
        {2, 33, 33, 4, 2, 64, 1, 0, 1, 1, 0, 0, 0, 0},  /* causal self, GQA, strided views */
        {1, 70, 7, 2, 2, 64, 1, 0, 0, 1, 0, 0, 0, 0},   /* causal Tq > Tk: rows t < 63 see nothing; 2 query tiles */
        {2, 7, 70, 2, 1, 64, 0, 1, 1, 1, 0, 0, 0, 0},   /* cross, kmask (b = 1 all padding), 2 key tiles */
        {1, 40, 40, 2, 1, 128, 1, 1, 0, 1, 0, 0, 0, 0}, /* HD 128: 32-row / 32-key backward tiles */
        {1, 33, 33, 2, 2, 64, 1, 0, 0, 0, 0, 0, 0, 0},  /* fp32 inputs: their rounding inside the bound */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) tc_run(&cases[i]);
}

/* The FlashAttention-2-structured kernels: the cases above, and 2 query tiles of the HD-64 forward
 * (128 rows), several 64-key blocks adding into dq, odd lengths, Tq != Tk, GQA 4:1. */
FL_TEST(cuda_attn_fa2) {
    const tc_case cases[] = {
        {2, 33, 33, 4, 2, 64, 1, 0, 1, 1, 0, 0, 0, 0},   /* causal self, GQA, strided views */
        {1, 70, 7, 2, 2, 64, 1, 0, 0, 1, 0, 0, 0, 0},    /* causal Tq > Tk: rows t < 63 see nothing */
        {2, 7, 70, 2, 1, 64, 0, 1, 1, 1, 0, 0, 0, 0},    /* cross, kmask (b = 1 all padding), 2 key blocks */
        {1, 40, 40, 2, 1, 128, 1, 1, 0, 1, 0, 0, 0, 0},  /* HD 128: 32-row backward tiles, warps split dQ's dims */
        {1, 33, 33, 2, 2, 64, 1, 0, 0, 0, 0, 0, 0, 0},   /* fp32 inputs: their rounding inside the bound */
        {1, 131, 131, 4, 1, 64, 1, 0, 0, 1, 0, 0, 0, 0}, /* 2 forward tiles of 128, 3 key blocks, GQA 4:1 */
        {1, 77, 131, 2, 1, 128, 1, 0, 1, 1, 0, 0, 0, 0}, /* HD 128 causal Tq < Tk, odd lengths, 3 key blocks */
        {1, 131, 67, 2, 2, 64, 0, 0, 0, 1, 0, 0, 0, 0},  /* non-causal, odd lengths */
        /* head sizes padded to the 128 tiles (fl_cu_attention_fa2_supported): OpenLLaMA 3B's 100 (chunks of 4),
         * OPT-2.7b's 80 with a key mask over 2 key blocks, 66 (HD % 4 = 2: element pairs), 100 from fp32 inputs */
        {1, 70, 70, 4, 2, 100, 1, 0, 0, 1, 0, 0, 0, 0},
        {2, 40, 75, 2, 1, 80, 0, 1, 1, 1, 0, 0, 0, 0},
        {1, 33, 33, 2, 2, 66, 1, 0, 0, 1, 0, 0, 0, 0},
        {1, 33, 45, 2, 1, 100, 1, 0, 0, 0, 0, 0, 0, 0},
        /* the EX kernels (attention_*_fa2_b): T5's encoder (scale 1, a key mask, bias and its gradient over a batch of
         * 2, dropout) over 2 key blocks; its decoder's causal self-attention; the Q-Former's cross-attention (dropout
         * alone); HD 128 with GQA 2:1; a bias from fp32 inputs; a bias and dbias without dropout over 3 query tiles */
        {2, 70, 70, 2, 2, 64, 0, 1, 1, 1, 1, 1, 1, 1},
        {2, 45, 45, 2, 2, 64, 1, 0, 0, 1, 1, 1, 1, 1},
        {2, 40, 75, 2, 2, 64, 0, 1, 0, 1, 0, 0, 1, 0},
        {1, 40, 70, 2, 1, 128, 1, 0, 1, 1, 1, 1, 1, 0},
        {1, 33, 33, 2, 2, 64, 1, 0, 0, 0, 1, 0, 0, 0},
        {1, 131, 67, 2, 2, 64, 0, 0, 0, 1, 1, 1, 0, 0},
    };
    g_tc_fwd = fl_cuemu_attention_forward_fa2;
    g_tc_bwd = fa2_bwd_bk64; /* the padded heads' 64-key blocks too (their default: 128) */
    /* under ASan (quick tier) the cases with partial tiles and blocks at their edges: GQA 2:1 strided, cross with a key
     * mask over 2 key blocks, HD 128's 32-row tiles, HD 128 Tq < Tk over 3 key blocks, non-causal 131 x 67 (2 forward
     * tiles), one padded head, one EX (the 131 x 131 GQA 4:1 case was half the pass's time here; Tq > Tk and the fp32
     * inputs run in the release pass) */
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (!fl_test_asan_light() || i == 0 || i == 2 || i == 3 || i == 6 || i == 7 || i == 9 || i == 12)
            tc_run(&cases[i]);
    /* the backward in 128-key blocks, 8 warps (dQ's tile split over m-tiles and dims by 2 / 4 warps): every case in
     * the full tier; the quick tier's release pass GQA 2:1 strided, HD 128 (32-row tiles; odd lengths over 2 blocks,
     * the second partial), GQA 4:1 over 131 keys, the padded 100, two EX ones (T5's encoder, HD 128); under ASan the
     * HD-128 77 x 131 one */
    g_tc_bwd = fa2_bwd_bk128;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (fl_test_asan_light() ? i == 6
                                 : !fl_test_quick() || i == 0 || i == 3 || i == 5 || i == 6 || i == 8 || i == 12 ||
                                       i == 15)
            tc_run(&cases[i]);
    g_tc_fwd = fl_cuemu_attention_forward_tc;
    g_tc_bwd = fl_cuemu_attention_backward_tc;
}

FL_TEST(cuda_attn_tc_unsupported) {
    float x[64] = {0}, work[16];
    fl_attn_desc a = {1, 3, 3, 2, 2, 80, 160, 160, 160, 160, 0.1f, 1, 0, 0};
    FL_CHECK(!fl_cu_attention_tc_supported(&a, NULL));
    FL_CHECK(fl_cuemu_attention_forward_tc(&a, x, NULL, x, x, x, x, NULL, NULL) == FL_CU_ATTN_UNSUPPORTED);
    FL_CHECK(fl_cuemu_attention_backward_tc(&a, x, x, x, x, x, x, x, NULL, x, x, work, NULL) == FL_CU_ATTN_UNSUPPORTED);
    a.HD = 64, a.ldq = a.ldk = a.ldv = a.ldo = 128;
    FL_CHECK(fl_cu_attention_tc_supported(&a, NULL) && !fl_cu_attention_tc_supported(&a, x));
    /* the fa2 kernels: 64 and the even sizes in (64, 128] (padded to 128); not odd, smaller or larger ones */
    const int fa2_ok[] = {64, 66, 80, 88, 100, 128}, fa2_no[] = {32, 48, 62, 81, 130, 256};
    for (int i = 0; i < 6; i++) {
        a.HD = fa2_ok[i];
        /* a bias or dropout: the EX kernels, at HD 64 and 128 only */
        const int ex = a.HD == 64 || a.HD == 128;
        FL_CHECKF(fl_cu_attention_fa2_supported(&a, NULL) && fl_cu_attention_fa2_supported(&a, x) == ex, "fa2 HD %d",
                  a.HD);
        a.drop_p = 0.1f;
        FL_CHECKF(fl_cu_attention_fa2_supported(&a, NULL) == ex, "fa2 HD %d with dropout", a.HD);
        a.drop_p = 0.0f;
        a.HD = fa2_no[i];
        FL_CHECKF(!fl_cu_attention_fa2_supported(&a, NULL), "fa2 takes HD %d", a.HD);
    }
    a.HD = 130, a.ldq = a.ldk = a.ldv = a.ldo = 260;
    FL_CHECK(fl_cuemu_attention_forward_fa2(&a, x, NULL, x, x, x, x, NULL, NULL) == FL_CU_ATTN_UNSUPPORTED);
    FL_CHECK(fl_cuemu_attention_backward_fa2(&a, x, x, x, x, x, x, x, NULL, x, x, work, NULL) == FL_CU_ATTN_UNSUPPORTED);
    a.HD = 64, a.ldq = a.ldk = a.ldv = a.ldo = 128;
    a.NKV = 3; /* NH % NKV: invalid before unsupported */
    FL_CHECK(fl_cuemu_attention_forward_tc(&a, x, NULL, x, x, x, x, NULL, NULL) == FL_CU_ATTN_INVALID);
    for (int i = 0; i < 64; i++) FL_CHECKF(x[i] == 0.0f, "an error path wrote x[%d]", i);
}

/* The backend's dispatch: "cuda-emu" runs the tensor-core kernels for a bf16 compute dtype and a
 * shape they take (the FlashAttention-2-structured _fa2 ones by default and with
 * FITLLM_CUDA_ATTN=own, the _tc ones with =legacy), the fp32 kernels otherwise (F32, a bias,
 * HD 24) and whenever FITLLM_CUDA_ATTN=fp32; bits equal to the direct launches say which ran. */
static int same(const float *x, const float *y, size_t n) { return !memcmp(x, y, n * sizeof(float)); }

static void dispatch_case(const char *env, int HD, int use_bias) {
    if (env) setenv("FITLLM_CUDA_ATTN", env, 1);
    else unsetenv("FITLLM_CUDA_ATTN");
    fl_backend be;
    fl_status st = fl_backend_init_by_name("cuda-emu", &be, 1);
    FL_CHECKF(st == FL_OK, "cuda-emu init with FITLLM_CUDA_ATTN=%s", env ? env : "(unset)");
    if (st != FL_OK) return;
    FL_CHECK(be.set_compute_dtype != NULL);
    be.set_compute_dtype(&be, FL_BF16);
    const int legacy = env && !strcmp(env, "legacy");
    /* legacy: HD 64 / 128 without a bias; own / auto: the fa2 kernels' sizes (64, even (64, 128]; a bias at 64 / 128) */
    const int expect_tc = !(env && !strcmp(env, "fp32")) &&
                          (legacy ? !use_bias && (HD == 64 || HD == 128)
                                  : HD == 64 || HD == 128 || (!use_bias && HD > 64 && HD <= 128 && HD % 2 == 0));
    tc_fwd_fn fwd = legacy ? fl_cuemu_attention_forward_tc : fl_cuemu_attention_forward_fa2;
    tc_bwd_fn bwd = legacy ? fl_cuemu_attention_backward_tc : fl_cuemu_attention_backward_fa2;
    const int B = 1, T = 9, NH = 2, NKV = 1, W = (NH + 2 * NKV) * HD, OW = NH * HD;
    const size_t nx = (size_t)B * T * W, no = (size_t)B * T * OW, nl = (size_t)B * NH * T;
    fl_test_rng rng = {(unsigned long long)(HD + use_bias)};
    float *qkv = fl_test_frand(&rng, nx, -1, 1), *dout = fl_test_frand(&rng, no, -1, 1);
    float *bias = fl_test_frand(&rng, (size_t)NH * T * T, -1, 1);
    float *o1 = malloc(no * 4), *o2 = malloc(no * 4), *l1 = malloc(nl * 4), *l2 = malloc(nl * 4);
    float *g1 = calloc(nx, 4), *g2 = calloc(nx, 4), *work = malloc(nl * 4);
    const fl_attn_desc a = fl_attn_desc_qkv(B, T, NH, NKV, HD);
    const float *q = qkv, *k = qkv + NH * HD, *v = qkv + (NH + NKV) * HD;
    if (!use_bias) { /* the fused ops */
        fl_attention_qkv_forward(&be, o1, l1, qkv, B, T, NH, NKV, HD);
        fl_attention_qkv_backward(&be, g1, dout, qkv, o1, l1, B, T, NH, NKV, HD);
        FL_CHECK(be.sync(&be) == FL_OK);
        if (expect_tc) {
            FL_CHECK(fwd(&a, o2, NULL, l2, q, k, v, NULL, NULL) == 0);
            FL_CHECK(bwd(&a, g2, g2 + OW, g2 + OW + NKV * HD, dout, q, k, v, NULL, o2, l2, work, NULL) == 0);
        } else {
            FL_CHECK(fl_cuemu_attention_forward(o2, l2, qkv, B, T, NH, NKV, HD, NULL) == 0);
            FL_CHECK(fl_cuemu_attention_backward(g2, dout, qkv, o2, l2, B, T, NH, NKV, HD, work, NULL) == 0);
        }
    } else { /* the general ops with a bias (and its gradient): the fa2 EX kernels at HD 64 / 128, else fp32 */
        float *db1 = calloc((size_t)NH * T * T, 4), *db2 = calloc((size_t)NH * T * T, 4);
        FL_CHECK(be.attention_forward(&be, &a, o1, l1, q, k, v, bias, NULL) == FL_OK);
        FL_CHECK(be.attention_backward(&be, &a, g1, g1 + OW, g1 + OW + NKV * HD, db1, dout, q, k, v, bias, NULL,
                                          o1, l1) == FL_OK);
        FL_CHECK(be.sync(&be) == FL_OK);
        if (expect_tc) {
            FL_CHECK(fl_cuemu_attention_forward_fa2_b(&a, o2, NULL, l2, q, k, v, bias, NULL, NULL) == 0);
            FL_CHECK(fl_cuemu_attention_backward_fa2_b(&a, g2, g2 + OW, g2 + OW + NKV * HD, db2, dout, q, k, v, bias,
                                                       NULL, o2, l2, work, 0, NULL) == 0);
        } else {
            FL_CHECK(fl_cuemu_attention_forward_ex(&a, o2, NULL, l2, q, k, v, bias, NULL, NULL) == 0);
            FL_CHECK(fl_cuemu_attention_backward_ex(&a, g2, g2 + OW, g2 + OW + NKV * HD, db2, dout, q, k, v, bias,
                                                    NULL, o2, l2, work, NULL) == 0);
        }
        FL_CHECKF(same(db1, db2, (size_t)NH * T * T), "dispatch env %s HD %d: dbias", env ? env : "(unset)", HD);
        free(db1), free(db2);
    }
    FL_CHECKF(same(o1, o2, no) && same(l1, l2, nl) && same(g1, g2, nx), "dispatch env %s HD %d bias %d: expected the %s "
              "kernels", env ? env : "(unset)", HD, use_bias, expect_tc ? (legacy ? "legacy tensor-core" : "fa2") : "fp32");
    if (expect_tc) { /* and back to F32: the fp32 kernels */
        be.set_compute_dtype(&be, FL_F32);
        fl_attention_qkv_forward(&be, o1, l1, qkv, B, T, NH, NKV, HD);
        FL_CHECK(be.sync(&be) == FL_OK);
        FL_CHECK(fl_cuemu_attention_forward(o2, l2, qkv, B, T, NH, NKV, HD, NULL) == 0);
        FL_CHECK(same(o1, o2, no) && same(l1, l2, nl));
    }
    fl_backend_free(&be);
    free(qkv), free(dout), free(bias), free(o1), free(o2), free(l1), free(l2), free(g1), free(g2), free(work);
    unsetenv("FITLLM_CUDA_ATTN");
}

FL_TEST(cuda_attn_tc_dispatch) {
    dispatch_case(NULL, 64, 0);
    dispatch_case("auto", 128, 0);
    dispatch_case("own", 64, 0);
    dispatch_case("legacy", 64, 0);
    dispatch_case("legacy", 128, 0);
    dispatch_case("legacy", 64, 1);
    dispatch_case(NULL, 24, 0);
    dispatch_case(NULL, 64, 1);  /* a bias: the fa2 EX kernels */
    dispatch_case("own", 128, 1);
    dispatch_case("fp32", 64, 1); /* which fp32 keeps on the fp32 kernels */
    dispatch_case(NULL, 100, 1);  /* and a padded head with a bias: the fp32 kernels */
    dispatch_case("fp32", 64, 0);
    dispatch_case(NULL, 100, 0);     /* a padded head: the fa2 kernels */
    dispatch_case("legacy", 100, 0); /* which the legacy ones do not take: fp32 */
    dispatch_case("fp32", 100, 0);
    setenv("FITLLM_CUDA_ATTN", "tensor", 1);
    fl_backend be;
    FL_CHECK(fl_backend_init_by_name("cuda-emu", &be, 1) == FL_ERR_INVALID);
    FL_CHECK(strstr(fl_error_message(), "FITLLM_CUDA_ATTN=tensor") != NULL);
    unsetenv("FITLLM_CUDA_ATTN");
    fl_backend cpu;
    FL_REQUIRE_OK(fl_cpu_backend_init(&cpu, 1));
    FL_CHECK(cpu.set_compute_dtype == NULL); /* fp32 attention always */
    fl_backend_free(&cpu);
}

/* The model tells the backend its compute dtype around each call (fl_model_tell_compute_dtype):
 * a recorder in the slot sees BF16 then F32 around a bf16-mixed forward and backward, F32 for
 * 32-true; on "cuda-emu" with HD 64 the bf16 loss then comes from the tensor-core kernels (it
 * differs from the FITLLM_CUDA_ATTN=fp32 run's, which are the fp32 kernels). */
static void (*g_real_set)(const fl_backend *, fl_dtype);
static fl_dtype g_seen[16];
static int g_nseen;
static void record_dtype(const fl_backend *be, fl_dtype t) {
    if (g_nseen < 16) g_seen[g_nseen++] = t;
    g_real_set(be, t);
}

static void model_loss(const char *env, int record, double *loss) {
    if (env) setenv("FITLLM_CUDA_ATTN", env, 1);
    fl_backend be;
    FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
    unsetenv("FITLLM_CUDA_ATTN");
    if (record) {
        g_real_set = be.set_compute_dtype;
        be.set_compute_dtype = record_dtype;
        g_nseen = 0;
    }
    fl_model_config c;
    FL_REQUIRE_OK(fl_preset_find("micro", &c));
    c.dim = 128, c.n_heads = 2, c.n_kv_heads = 1, c.head_dim = 64, c.n_layers = 1; /* HD 64: the tc kernels */
    fl_mem_pool pool, host;
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &host, "tc", 0));
    fl_model m;
    FL_REQUIRE_OK(fl_model_init(&m, &c, &be, &pool));
    fl_model_init_random(&m, 5);
    const int B = 1, T = 20;
    int32_t ids[20], tg[20];
    for (int i = 0; i < T; i++) ids[i] = (i * 37 + 11) % c.vocab_size, tg[i] = (i * 53 + 7) % c.vocab_size;
    FL_REQUIRE_OK(fl_model_set_precision(&m, fl_precision_get(FL_PREC_BF16_MIXED)));
    FL_REQUIRE_OK(fl_model_alloc_grads(&m));
    FL_REQUIRE_OK(fl_model_alloc_acts(&m, B, T));
    FL_REQUIRE_OK(fl_model_forward(&m, ids, tg, B, T, 1.0f / T, NULL));
    *loss = m.loss_sum;
    FL_REQUIRE_OK(fl_model_backward(&m));
    if (record) {
        FL_CHECKF(g_nseen == 4 && g_seen[0] == FL_BF16 && g_seen[1] == FL_F32 && g_seen[2] == FL_BF16 &&
                      g_seen[3] == FL_F32,
                  "bf16-mixed: %d set_compute_dtype calls (want BF16, F32 around forward and backward)", g_nseen);
        FL_REQUIRE_OK(fl_model_set_precision(&m, fl_precision_get(FL_PREC_32_TRUE)));
        g_nseen = 0;
        FL_REQUIRE_OK(fl_model_forward(&m, ids, tg, B, T, 0.0f, NULL));
        FL_CHECKF(g_nseen == 2 && g_seen[0] == FL_F32 && g_seen[1] == FL_F32, "32-true: calls %d", g_nseen);
    }
    fl_model_free(&m);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}

FL_TEST(cuda_attn_tc_model) {
    double tc = NAN, fp = NAN, lg = NAN;
    model_loss(NULL, 1, &tc);
    model_loss("fp32", 0, &fp);
    model_loss("legacy", 0, &lg);
    printf("      bf16-mixed loss sum: %.9g (fa2 tensor cores), %.9g (legacy tensor cores) vs %.9g (fp32 attention)\n",
           tc, lg, fp);
    FL_CHECK(isfinite(tc) && isfinite(fp) && isfinite(lg));
    FL_CHECK(tc != fp);
    FL_CHECK(lg != fp);
}

#else
FL_TEST(cuda_attn_skipped) { fl_test_skip("built without the CUDA emulator (no C++ compiler)"); }
#endif

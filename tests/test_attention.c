/* The general attention op (backend.h attention_forward_ex / attention_backward_ex).
 *
 * Anchors, all independent of the op's code:
 *  - a float64 reference written here: naive softmax attention, one query row at a
 *    time, every visible key, no tiling; its analytic backward is itself checked
 *    against central finite differences in double (tiny cases);
 *  - the op's fp32 results are compared with it under an error bound derived from
 *    fp32 rounding (see "The error bound" below), computed from the data, not tuned;
 *  - finite differences of the double forward checked directly against the op's
 *    gradients (tiny cases, every combination);
 *  - the existing fused causal op (attention_forward/backward) on causal
 *    self-attention: the two must agree within the sum of their bounds;
 *  - bits: the same results at 1, 2 and 3 threads (the reference backend is 1).
 * Every case runs on every registered backend (FL_FOR_EACH_BACKEND: cpu at 2 threads, ref,
 * later others); the bit-identity checks are of the CPU kernels (cpu and ref). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cpu/cpu-impl.h"
#include "fitllm/backend.h"
#include "test.h"

/* ---- The error bound ---------------------------------------------------------------
 * u = 2^-24 (fp32 unit roundoff). A sum of n fp32 terms is modelled as a random walk of
 * rounding errors: |error| <= C * u * sqrt(n) * (sum of |terms|), C = 4 (four standard
 * deviations). For one query row, with sigma_j = scale * sum_d |q_d k_jd| + |bias_j| the
 * magnitude behind score j and smax its largest value over the row's visible keys, the
 * relative error of a computed probability p_j is at most
 *   rho = u * (sqrt(HD+1) * smax    score: HD products plus the bias
 *              + sqrt(Tk)           the running sum l
 *              + |lse| + 4)         rounding of lse / the max, expf (2 ulp), the division
 * and then, per element (sums over visible keys j; A_x = sum of |terms| of x):
 *   out_d:    C * (rho + u sqrt(Tk)) * sum_j p_j |v_jd|,          lse: C * rho
 *   dS_tj = p (dP - D): e_tj = p * ((rho + u sqrt(HD)) * (P1 + P2) + dD), P1 = sum|dO||v_j|,
 *             P2 = sum|dO||o|, dD = sum_d |dO_d| * (out_d's bound / C) (the op reads its own out)
 *   dq_td:    C * scale * (sum_j e_tj |k_jd| + u sqrt(Tk) * sum_j |dS_tj k_jd|)
 *   dk_jd:    C * scale * (sum_t e_tj |q_td| + u sqrt(n) * sum_t |dS_tj q_td|),  n = (NH/NKV)*Tq
 *   dv_jd:    C * (sum_t p_tj rho_t |dO_td| + u sqrt(n) * sum_t p_tj |dO_td|)
 *   dbias:    C * (sum_b e + u sqrt(B) * sum_b |dS|)
 * plus 2u(|pre| + |x|) for the final rounding and the += into a pre-filled gradient. Fully
 * masked rows have bound 0: their outputs must be exact zeros. */
#define U32 (1.0 / 16777216.0)
#define CSIG 4.0

typedef struct {
    fl_attn_desc a;
    /* inputs (double), in the op's layout: q, k, v point into these buffers */
    const double *q, *k, *v, *bias; /* bias (NH,Tq,Tk) or NULL */
    const uint8_t *mask;            /* (B,Tk) or NULL */
    const float *dout;              /* (B,Tq,NH*HD) contiguous, NULL: forward only */
    /* outputs, contiguous: out (B,Tq,NH,HD), lse (B,NH,Tq); grads dq (B,Tq,NH,HD),
     * dk, dv (B,Tk,NKV,HD), dbias (NH,Tq,Tk), zeroed by the caller */
    double *out, *lse, *dq, *dk, *dv, *dbias;
    /* bounds (same shapes; NULL: not computed): tout, tlse final; E*, S* the error and
     * |term| sums of the gradients (see above), combined by grad_bound() */
    double *tout, *tlse, *Eq, *Sq, *Ek, *Sk, *Ev, *Sv, *Eb, *Sb;
} ref_t;

static void ref_run(const ref_t *R) {
    const fl_attn_desc *a = &R->a;
    const int B = a->B, Tq = a->Tq, Tk = a->Tk, NH = a->NH, NKV = a->NKV, HD = a->HD, rep = NH / NKV;
    const double sc = a->scale;
    double *s = malloc(sizeof(double) * (Tk + 1)), *p = malloc(sizeof(double) * (Tk + 1));
    double *sig = malloc(sizeof(double) * (Tk + 1));
    int *vis = malloc(sizeof(int) * (Tk + 1));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < Tq; t++) {
                const int g = h / rep;
                const double *qr = R->q + ((size_t)b * Tq + t) * a->ldq + (size_t)h * HD;
                int lim = a->causal ? t + Tk - Tq + 1 : Tk, any = 0;
                double mx = -INFINITY, smax = 0;
                for (int j = 0; j < Tk; j++) {
                    vis[j] = j < lim && (!R->mask || R->mask[(size_t)b * Tk + j]);
                    if (!vis[j]) continue;
                    any = 1;
                    const double *kr = R->k + ((size_t)b * Tk + j) * a->ldk + (size_t)g * HD;
                    double dot = 0, mag = 0;
                    for (int d = 0; d < HD; d++) dot += qr[d] * kr[d], mag += fabs(qr[d] * kr[d]);
                    double bj = R->bias ? R->bias[((size_t)h * Tq + t) * Tk + j] : 0.0;
                    s[j] = sc * dot + bj;
                    sig[j] = fabs(sc) * mag + fabs(bj);
                    if (s[j] > mx) mx = s[j];
                    if (sig[j] > smax) smax = sig[j];
                }
                const size_t orow = (((size_t)b * Tq + t) * NH + h) * HD; /* (B,Tq,NH,HD) */
                const size_t li = ((size_t)b * NH + h) * Tq + t;
                if (!any) { /* documented: out 0, lse -inf, no gradient */
                    for (int d = 0; d < HD; d++) {
                        R->out[orow + d] = 0;
                        if (R->tout) R->tout[orow + d] = 0;
                    }
                    R->lse[li] = -INFINITY;
                    if (R->tlse) R->tlse[li] = 0;
                    continue;
                }
                double sum = 0;
                for (int j = 0; j < Tk; j++) sum += vis[j] ? exp(s[j] - mx) : 0.0;
                for (int j = 0; j < Tk; j++) p[j] = vis[j] ? exp(s[j] - mx) / sum : 0.0;
                const double lse = mx + log(sum);
                const double rho = U32 * (sqrt(HD + 1.0) * smax + sqrt((double)Tk) + fabs(lse) + 4);
                R->lse[li] = lse;
                if (R->tlse) R->tlse[li] = CSIG * rho;
                double *o = R->out + orow;
                double to[FL_CPU_ATTN_MAX_HD]; /* out's bound without C: dD below */
                for (int d = 0; d < HD; d++) {
                    double acc = 0, A = 0;
                    for (int j = 0; j < Tk; j++) {
                        if (!vis[j]) continue;
                        double vd = R->v[((size_t)b * Tk + j) * a->ldv + (size_t)g * HD + d];
                        acc += p[j] * vd;
                        A += p[j] * fabs(vd);
                    }
                    o[d] = acc;
                    to[d] = (rho + U32 * sqrt((double)Tk)) * A + U32 * fabs(acc);
                    if (R->tout) R->tout[orow + d] = CSIG * to[d];
                }
                if (!R->dout) continue;
                const float *dO = R->dout + orow;
                double D = 0, P2 = 0, dD = 0;
                for (int d = 0; d < HD; d++) D += dO[d] * o[d], P2 += fabs(dO[d] * o[d]), dD += fabs(dO[d]) * to[d];
                for (int j = 0; j < Tk; j++) {
                    if (!vis[j]) continue;
                    const double *kr = R->k + ((size_t)b * Tk + j) * a->ldk + (size_t)g * HD;
                    const double *vr = R->v + ((size_t)b * Tk + j) * a->ldv + (size_t)g * HD;
                    double dP = 0, P1 = 0;
                    for (int d = 0; d < HD; d++) dP += dO[d] * vr[d], P1 += fabs(dO[d] * vr[d]);
                    const double dS = p[j] * (dP - D);
                    const double e = p[j] * ((rho + U32 * sqrt((double)HD)) * (P1 + P2) + dD);
                    const size_t krow = (((size_t)b * Tk + j) * NKV + g) * HD; /* (B,Tk,NKV,HD) */
                    for (int d = 0; d < HD; d++) {
                        R->dq[orow + d] += sc * dS * kr[d];
                        R->dk[krow + d] += sc * dS * qr[d];
                        R->dv[krow + d] += p[j] * dO[d];
                        if (R->Eq) {
                            R->Eq[orow + d] += fabs(sc) * e * fabs(kr[d]);
                            R->Sq[orow + d] += fabs(sc * dS * kr[d]);
                            R->Ek[krow + d] += fabs(sc) * e * fabs(qr[d]);
                            R->Sk[krow + d] += fabs(sc * dS * qr[d]);
                            R->Ev[krow + d] += p[j] * rho * fabs(dO[d]);
                            R->Sv[krow + d] += p[j] * fabs(dO[d]);
                        }
                    }
                    if (R->dbias) {
                        size_t bi = ((size_t)h * Tq + t) * Tk + j;
                        R->dbias[bi] += dS;
                        if (R->Eb) R->Eb[bi] += e, R->Sb[bi] += fabs(dS);
                    }
                }
            }
    free(s); free(p); free(sig); free(vis);
}

/* ---- one test case: buffers in the op's layout ----------------------------------------- */

typedef struct {
    fl_attn_desc a;
    int cross, has_bias, has_mask;
    size_t nqb, nkb; /* floats in the q buffer (self: the fused qkv) and the k/v buffer (cross) */
    size_t qoff, koff, voff; /* offsets of the q, k, v views in their buffers */
    float *qb, *kb, *bias, *dout /*(B,Tq,NH*HD)*/;
    uint8_t *mask;
    size_t ldo_pad; /* ldo = NH*HD + ldo_pad: the op must not touch the gap */
} acase;

static float *frand_n(fl_test_rng *r, size_t n, float lo, float hi) {
    float *x = malloc((n ? n : 1) * sizeof(float));
    fl_test_fill(r, x, n, lo, hi);
    return x;
}
static double *dup_d(const float *x, size_t n) {
    double *y = malloc((n ? n : 1) * sizeof(double));
    for (size_t i = 0; i < n; i++) y[i] = x ? x[i] : 0;
    return y;
}
static const float *kbuf_of(const acase *c, const float *qb, const float *kb) { return c->cross ? kb : qb; }

/* Self: one fused (B, T, (NH+2*NKV)*HD) buffer with q, k, v as views (the decoder's layout).
 * Cross: q (B, Tq, NH*HD + 3) and a fused kv projection (B, Tk, 2*NKV*HD + 1): odd strides. */
static void acase_init(acase *c, int B, int Tq, int Tk, int NH, int NKV, int HD, int causal, int bias, int mask,
                       int cross, float scale, unsigned long long seed) {
    memset(c, 0, sizeof *c);
    fl_test_rng r = {seed};
    c->cross = cross, c->has_bias = bias, c->has_mask = mask;
    if (!cross) Tk = Tq;
    fl_attn_desc a = {B, Tq, Tk, NH, NKV, HD, 0, 0, 0, 0, scale, causal, 0, 0};
    if (cross) {
        a.ldq = (size_t)NH * HD + 3;
        a.ldk = a.ldv = (size_t)2 * NKV * HD + 1;
        c->nqb = (size_t)B * Tq * a.ldq, c->nkb = (size_t)B * Tk * a.ldk;
        c->qoff = 0, c->koff = 0, c->voff = (size_t)NKV * HD;
    } else {
        a.ldq = a.ldk = a.ldv = (size_t)(NH + 2 * NKV) * HD;
        c->nqb = (size_t)B * Tq * a.ldq, c->nkb = 0;
        c->qoff = 0, c->koff = (size_t)NH * HD, c->voff = (size_t)(NH + NKV) * HD;
    }
    c->ldo_pad = 2;
    a.ldo = (size_t)NH * HD + c->ldo_pad;
    c->a = a;
    c->qb = frand_n(&r, c->nqb, -1.5f, 1.5f);
    c->kb = cross ? frand_n(&r, c->nkb, -1.5f, 1.5f) : NULL;
    c->bias = bias ? frand_n(&r, (size_t)NH * Tq * Tk, -2.0f, 2.0f) : NULL;
    c->dout = frand_n(&r, (size_t)B * Tq * NH * HD, -1.0f, 1.0f);
    if (mask) {
        /* b % 3 == 0: random holes; 1: the first 3 and the last 5 keys are padding (with
         * causal self-attention the first rows then see nothing); 2: every key padding */
        c->mask = malloc((size_t)B * Tk);
        for (int b = 0; b < B; b++)
            for (int j = 0; j < Tk; j++) {
                uint8_t m = 1;
                if (b % 3 == 0) m = fl_test_rng_u64(&r) % 5 != 0;
                if (b % 3 == 1) m = j >= 3 && j < Tk - 5;
                if (b % 3 == 2) m = 0;
                c->mask[(size_t)b * Tk + j] = m;
            }
    }
}

static void acase_free(acase *c) {
    free(c->qb); free(c->kb); free(c->bias); free(c->dout); free(c->mask);
}

/* The op's results. */
typedef struct {
    float *out, *lse, *dqb, *dkb, *dbias; /* dqb/dkb: gradient buffers shaped like qb/kb */
} ares;

static void ares_free(ares *r) {
    free(r->out); free(r->lse); free(r->dqb); free(r->dkb); free(r->dbias);
}

/* Runs forward and backward of be's op on c. Gradients are pre-filled with pre_* (copied)
 * so the += contract is exercised; out's row gaps are filled with a sentinel. */
static fl_status run_op_sched(const fl_backend *be, const acase *c, ares *res, const float *pre_q,
                              const float *pre_k, const float *pre_b, int split);
static fl_status run_op(const fl_backend *be, const acase *c, ares *res, const float *pre_q, const float *pre_k,
                        const float *pre_b) {
    return run_op_sched(be, c, res, pre_q, pre_k, pre_b, -1);
}

/* split -1: the backend's own backward; 0 / 1: the CPU backward with the fused / split schedule */
static fl_status run_op_sched(const fl_backend *be, const acase *c, ares *res, const float *pre_q,
                              const float *pre_k, const float *pre_b, int split) {
    const fl_attn_desc *a = &c->a;
    size_t no = (size_t)a->B * a->Tq * a->ldo, nl = (size_t)a->B * a->NH * a->Tq, nb = (size_t)a->NH * a->Tq * a->Tk;
    memset(res, 0, sizeof *res);
    res->out = malloc((no ? no : 1) * 4), res->lse = malloc((nl ? nl : 1) * 4);
    for (size_t i = 0; i < no; i++) res->out[i] = 12345.0f;
    res->dqb = malloc((c->nqb ? c->nqb : 1) * 4);
    memcpy(res->dqb, pre_q, c->nqb * 4);
    if (c->cross) {
        res->dkb = malloc((c->nkb ? c->nkb : 1) * 4);
        memcpy(res->dkb, pre_k, c->nkb * 4);
    }
    if (c->has_bias) {
        res->dbias = malloc((nb ? nb : 1) * 4);
        memcpy(res->dbias, pre_b, nb * 4);
    }
    const float *kb = kbuf_of(c, c->qb, c->kb);
    float *dkb = c->cross ? res->dkb : res->dqb;
    fl_status st = be->attention_forward(be, a, res->out, res->lse, c->qb + c->qoff, kb + c->koff, kb + c->voff,
                                            c->bias, c->mask);
    if (st != FL_OK) return st;
    /* dout in the out layout (stride ldo) */
    float *dO = malloc((no ? no : 1) * 4);
    for (size_t row = 0; row < (size_t)a->B * a->Tq; row++)
        for (size_t i = 0; i < a->ldo; i++)
            dO[row * a->ldo + i] = i < (size_t)a->NH * a->HD ? c->dout[row * a->NH * a->HD + i] : NAN;
    if (split < 0)
        st = be->attention_backward(be, a, res->dqb + c->qoff, dkb + c->koff, dkb + c->voff, res->dbias, dO,
                                       c->qb + c->qoff, kb + c->koff, kb + c->voff, c->bias, c->mask, res->out,
                                       res->lse);
    else
        st = fl_cpu_attn_general_backward_sched(be, a, res->dqb + c->qoff, dkb + c->koff, dkb + c->voff, res->dbias,
                                                dO, c->qb + c->qoff, kb + c->koff, kb + c->voff, c->bias, c->mask,
                                                res->out, res->lse, split);
    free(dO);
    return st;
}

/* The reference on c (double), with bounds. */
typedef struct {
    double *out, *lse, *dq, *dk, *dv, *dbias;
    double *tout, *tlse, *Eq, *Sq, *Ek, *Sk, *Ev, *Sv, *Eb, *Sb;
} aref;

static void aref_run(const acase *c, aref *R) {
    const fl_attn_desc *a = &c->a;
    size_t no = (size_t)a->B * a->Tq * a->NH * a->HD, nk = (size_t)a->B * a->Tk * a->NKV * a->HD;
    size_t nl = (size_t)a->B * a->NH * a->Tq, nb = (size_t)a->NH * a->Tq * a->Tk;
#define Z(n) calloc((n) ? (n) : 1, sizeof(double))
    *R = (aref){Z(no), Z(nl), Z(no), Z(nk), Z(nk), Z(nb), Z(no), Z(nl), Z(no), Z(no), Z(nk), Z(nk), Z(nk), Z(nk),
                Z(nb), Z(nb)};
#undef Z
    double *qd = dup_d(c->qb, c->nqb), *kd = c->cross ? dup_d(c->kb, c->nkb) : qd;
    double *bd = c->bias ? dup_d(c->bias, nb) : NULL;
    ref_t rt = {*a, qd + c->qoff, kd + c->koff, kd + c->voff, bd, c->mask, c->dout, R->out, R->lse, R->dq, R->dk,
                R->dv, c->has_bias ? R->dbias : NULL, R->tout, R->tlse, R->Eq, R->Sq, R->Ek, R->Sk, R->Ev, R->Sv,
                R->Eb, R->Sb};
    ref_run(&rt);
    free(qd);
    if (c->cross) free(kd);
    free(bd);
}

static void aref_free(aref *R) {
    double **p = &R->out;
    for (int i = 0; i < 16; i++) free(p[i]);
}

static double grad_bound(double E, double S, double n, double pre, double x) {
    return CSIG * (E + U32 * sqrt(n) * S) + 2 * U32 * (fabs(pre) + fabs(x));
}

/* Compares the op's results with the reference under the bound (times `slack`: 1 for one
 * op against the truth, 2 for two ops against each other). Returns the number of
 * violations; *worst gets max |err| / bound over everything checked. */
typedef struct {
    const char *what;
    double worst;
    int bad;
    int quiet; /* 1: no report (a mismatch is the expected outcome) */
} cmp_t;

static void cmp_one(cmp_t *m, const char *name, size_t i, double got, double want, double bound) {
    double err = fabs(got - want);
    if (isinf(want) && got == want) err = 0; /* lse -inf of a fully masked row */
    double ratio = bound > 0 ? err / bound : (err > 0 ? INFINITY : 0);
    if (!(ratio <= 1.0)) {
        if (!m->bad && !m->quiet)
            fprintf(stderr, "  %s: %s[%zu] got %.9g want %.9g |err| %.3g > bound %.3g\n", m->what, name, i, got, want,
                    err, bound);
        m->bad++;
    }
    if (!(ratio <= m->worst)) m->worst = ratio;
}

/* out/lse, and the gradients (when res->dqb) against pre + reference. */
static void compare(cmp_t *m, const acase *c, const ares *res, const aref *R, const float *pre_q, const float *pre_k,
                    const float *pre_b, double slack, int fwd_only) {
    const fl_attn_desc *a = &c->a;
    const int B = a->B, Tq = a->Tq, Tk = a->Tk, NH = a->NH, NKV = a->NKV, HD = a->HD, rep = NH / NKV;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < Tq; t++) {
            const float *orow = res->out + ((size_t)b * Tq + t) * a->ldo;
            for (int i = 0; i < NH * HD; i++) {
                size_t ri = ((size_t)b * Tq + t) * NH * HD + i;
                cmp_one(m, "out", ri, orow[i], R->out[ri], slack * R->tout[ri]);
            }
            for (size_t i = (size_t)NH * HD; i < a->ldo; i++)
                if (orow[i] != 12345.0f && !m->bad++) fprintf(stderr, "  %s: out row gap written\n", m->what);
        }
    for (size_t i = 0; i < (size_t)B * NH * Tq; i++) cmp_one(m, "lse", i, res->lse[i], R->lse[i], slack * R->tlse[i]);
    if (fwd_only) return;
    const float *dkb = c->cross ? res->dkb : res->dqb, *pk = c->cross ? pre_k : pre_q;
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < Tq; t++)
            for (int i = 0; i < NH * HD; i++) {
                size_t bi = ((size_t)b * Tq + t) * a->ldq + c->qoff + i, ri = ((size_t)b * Tq + t) * NH * HD + i;
                double want = pre_q[bi] + R->dq[ri];
                cmp_one(m, "dq", ri, res->dqb[bi], want, slack * grad_bound(R->Eq[ri], R->Sq[ri], Tk, pre_q[bi], want));
            }
        for (int j = 0; j < Tk; j++)
            for (int i = 0; i < NKV * HD; i++) {
                size_t ri = ((size_t)b * Tk + j) * NKV * HD + i;
                size_t bk = ((size_t)b * Tk + j) * a->ldk + c->koff + i, bv = ((size_t)b * Tk + j) * a->ldv + c->voff + i;
                double wk = pk[bk] + R->dk[ri], wv = pk[bv] + R->dv[ri];
                cmp_one(m, "dk", ri, dkb[bk], wk, slack * grad_bound(R->Ek[ri], R->Sk[ri], (double)rep * Tq, pk[bk], wk));
                cmp_one(m, "dv", ri, dkb[bv], wv, slack * grad_bound(R->Ev[ri], R->Sv[ri], (double)rep * Tq, pk[bv], wv));
            }
    }
    /* columns outside the views (cross: q's stride gap, kv's last column) stay as pre-filled */
    if (c->cross) {
        for (size_t row = 0; row < (size_t)B * Tq; row++)
            for (size_t i = (size_t)NH * HD; i < a->ldq; i++)
                if (res->dqb[row * a->ldq + i] != pre_q[row * a->ldq + i] && !m->bad++)
                    fprintf(stderr, "  %s: dq row gap written\n", m->what);
        for (size_t row = 0; row < (size_t)B * Tk; row++)
            if (res->dkb[row * a->ldk + a->ldk - 1] != pre_k[row * a->ldk + a->ldk - 1] && !m->bad++)
                fprintf(stderr, "  %s: dkv row gap written\n", m->what);
    }
    if (c->has_bias)
        for (size_t i = 0; i < (size_t)NH * Tq * Tk; i++) {
            double want = pre_b[i] + R->dbias[i];
            cmp_one(m, "dbias", i, res->dbias[i], want, slack * grad_bound(R->Eb[i], R->Sb[i], B, pre_b[i], want));
        }
}

/* pre-fill values for the gradients */
typedef struct {
    float *q, *k, *b;
} apre;
static void apre_init(apre *p, const acase *c, unsigned long long seed) {
    fl_test_rng r = {seed};
    p->q = frand_n(&r, c->nqb, -1, 1);
    p->k = c->cross ? frand_n(&r, c->nkb, -1, 1) : NULL;
    p->b = c->has_bias ? frand_n(&r, (size_t)c->a.NH * c->a.Tq * c->a.Tk, -1, 1) : NULL;
}
static void apre_free(apre *p) { free(p->q); free(p->k); free(p->b); }

static void describe(char *buf, size_t n, const acase *c) {
    snprintf(buf, n, "B%d Tq%d Tk%d NH%d NKV%d HD%d %s %s%s%s", c->a.B, c->a.Tq, c->a.Tk, c->a.NH, c->a.NKV, c->a.HD,
             c->a.causal ? "causal" : "bidir", c->cross ? "cross" : "self", c->has_bias ? " bias" : "",
             c->has_mask ? " mask" : "");
}

/* ---- against the float64 reference: every combination ------------------------------------ */

static double g_worst_ratio; /* largest err/bound seen, printed by the combos test */

static void check_case(const acase *c, unsigned long long seed) {
    char what[160];
    describe(what, sizeof what, c);
    aref R;
    aref_run(c, &R);
    apre pre;
    apre_init(&pre, c, seed);
    /* every registered backend against the float64 reference; the results of cpu (2 threads)
     * and ref (1 thread) are kept for the bit-identity checks of the CPU kernels below */
    fl_backend be2, ref, bk;
    fl_cpu_backend_init(&be2, 2);
    fl_ref_backend_init(&ref);
    const fl_backend *bes[2] = {&be2, &ref};
    ares res[2];
    int have[2] = {0, 0};
    FL_FOR_EACH_BACKEND(bk, 2) {
        ares rk;
        fl_status st = run_op(&bk, c, &rk, pre.q, pre.k, pre.b);
        if (fl_test_unsupported(&bk, st, what)) { ares_free(&rk); continue; }
        FL_CHECKF(st == FL_OK, "%s (%s): %s", what, bk.name, fl_error_message());
        if (st != FL_OK) { ares_free(&rk); continue; }
        cmp_t m = {what, 0, 0, 0};
        compare(&m, c, &rk, &R, pre.q, pre.k, pre.b, 1.0, 0);
        FL_CHECKF(m.bad == 0, "%s (%s): %d values outside the fp32 bound (worst err/bound %.3g)", what, bk.name,
                  m.bad, m.worst);
        if (m.worst > g_worst_ratio) g_worst_ratio = m.worst;
        int k = !strcmp(bk.name, "cpu") ? 0 : !strcmp(bk.name, "ref") ? 1 : -1;
        if (k >= 0) res[k] = rk, have[k] = 1;
        else ares_free(&rk);
    }
    FL_REQUIRE(have[0] && have[1]);
    /* the 1-thread reference backend and 2 threads: the same bits */
    const fl_attn_desc *a = &c->a;
    size_t no = (size_t)a->B * a->Tq * a->ldo, nl = (size_t)a->B * a->NH * a->Tq;
    FL_CHECKF(!memcmp(res[0].out, res[1].out, no * 4) && !memcmp(res[0].lse, res[1].lse, nl * 4) &&
                  !memcmp(res[0].dqb, res[1].dqb, c->nqb * 4) &&
                  (!c->cross || !memcmp(res[0].dkb, res[1].dkb, c->nkb * 4)) &&
                  (!c->has_bias || !memcmp(res[0].dbias, res[1].dbias, (size_t)a->NH * a->Tq * a->Tk * 4)),
              "%s: 1 and 2 threads give different bits", what);
    /* both backward schedules, at 1 and 2 threads: the same bits */
    for (int k = 0; k < 2; k++)
        for (int split = 0; split < 2; split++) {
            ares rs;
            FL_REQUIRE_OK(run_op_sched(bes[k], c, &rs, pre.q, pre.k, pre.b, split));
            FL_CHECKF(!memcmp(res[0].dqb, rs.dqb, c->nqb * 4) && (!c->cross || !memcmp(res[0].dkb, rs.dkb, c->nkb * 4)) &&
                          (!c->has_bias || !memcmp(res[0].dbias, rs.dbias, (size_t)a->NH * a->Tq * a->Tk * 4)),
                      "%s: the %s schedule at %d threads gives different bits", what, split ? "split" : "fused",
                      bes[k]->n_threads);
            ares_free(&rs);
        }
    ares_free(&res[0]);
    ares_free(&res[1]);
    apre_free(&pre);
    aref_free(&R);
}

/* causal x bias x mask x self/cross, NKV cycling 2, 3, 1 under NH 6, B 2 or 3, tiles (32)
 * not dividing Tq or Tk, odd HD; cross cases have Tk > Tq and Tk < Tq (causal bottom-right:
 * the first Tq - Tk rows see nothing). */
FL_TEST(attn_ex_all_combinations_vs_float64) {
    static const int nkvs[3] = {2, 3, 1};
    g_worst_ratio = 0;
    for (int combo = 0; combo < 16; combo++) {
        int causal = combo & 1, bias = combo >> 1 & 1, mask = combo >> 2 & 1, cross = combo >> 3 & 1;
        int B = 2 + combo % 2, NKV = nkvs[combo % 3], HD = combo % 4 == 3 ? 33 : 13;
        int Tq = 37, Tk = cross ? (combo % 3 == 0 ? 29 : 70) : 37;
        float scale = combo % 3 == 1 ? 1.0f : 1.0f / sqrtf((float)HD); /* T5 uses 1 */
        acase c;
        acase_init(&c, B, Tq, Tk, 6, NKV, HD, causal, bias, mask, cross, scale, 1000 + combo);
        check_case(&c, 77 + combo);
        acase_free(&c);
    }
    printf("      largest err / fp32 bound over all cases: %.3g\n", g_worst_ratio);
}

/* One query row and one key; Tq 1 against many keys (a decode-like shape); an empty batch. */
FL_TEST(attn_ex_edge_shapes) {
    acase c;
    acase_init(&c, 1, 1, 1, 2, 1, 5, 1, 1, 0, 0, 0.7f, 5);
    check_case(&c, 6);
    acase_free(&c);
    acase_init(&c, 2, 1, 100, 4, 2, 7, 1, 1, 1, 1, 0.3f, 7);
    check_case(&c, 8);
    acase_free(&c);
    acase_init(&c, 3, 65, 64, 3, 3, 16, 0, 0, 1, 1, 0.25f, 9); /* multiple tiles both ways, B 3 mask pattern 2 */
    check_case(&c, 10);
    acase_free(&c);
}

/* ---- the bound is tight enough to catch small errors ------------------------------------- */

FL_TEST(attn_ex_bound_detects_errors) {
    acase c;
    acase_init(&c, 2, 37, 45, 6, 2, 13, 1, 1, 1, 1, 0.3f, 11);
    aref R;
    aref_run(&c, &R);
    apre pre;
    apre_init(&pre, &c, 12);
    fl_backend be = {0};
    FL_REQUIRE_OK(fl_test_backend(&be, 1));
    ares res;
    /* a scale 1e-4 off: forward outside the bound */
    c.a.scale *= 1.0001f;
    FL_REQUIRE_OK(run_op(&be, &c, &res, pre.q, pre.k, pre.b));
    cmp_t m = {"scale+1e-4", 0, 0, 1};
    compare(&m, &c, &res, &R, pre.q, pre.k, pre.b, 1.0, 1);
    FL_CHECKF(m.bad > 0, "a 1e-4 relative error in the scale went unnoticed (worst err/bound %.3g)", m.worst);
    ares_free(&res);
    c.a.scale /= 1.0001f;
    /* lse 1e-4 off in the backward only: gradients outside the bound */
    FL_REQUIRE_OK(run_op(&be, &c, &res, pre.q, pre.k, pre.b));
    {
        const fl_attn_desc *a = &c.a;
        size_t nl = (size_t)a->B * a->NH * a->Tq;
        memcpy(res.dqb, pre.q, c.nqb * 4);
        memcpy(res.dkb, pre.k, c.nkb * 4);
        memcpy(res.dbias, pre.b, (size_t)a->NH * a->Tq * a->Tk * 4);
        float *lse2 = malloc(nl * 4);
        for (size_t i = 0; i < nl; i++) lse2[i] = res.lse[i] + 1e-4f;
        size_t no = (size_t)a->B * a->Tq * a->ldo;
        float *dO = calloc(no, 4);
        for (size_t row = 0; row < (size_t)a->B * a->Tq; row++)
            memcpy(dO + row * a->ldo, c.dout + row * a->NH * a->HD, (size_t)a->NH * a->HD * 4);
        FL_REQUIRE_OK(be.attention_backward(&be, a, res.dqb, res.dkb + c.koff, res.dkb + c.voff, res.dbias, dO,
                                               c.qb, c.kb + c.koff, c.kb + c.voff, c.bias, c.mask, res.out, lse2));
        cmp_t m2 = {"lse+1e-4", 0, 0, 1};
        compare(&m2, &c, &res, &R, pre.q, pre.k, pre.b, 1.0, 0);
        FL_CHECKF(m2.bad > 0, "a 1e-4 error in lse went unnoticed by the gradient bound (worst %.3g)", m2.worst);
        free(lse2);
        free(dO);
    }
    ares_free(&res);
    apre_free(&pre);
    aref_free(&R);
    acase_free(&c);
}

/* ---- finite differences -------------------------------------------------------------------- */

/* L = sum(out * dout) on the double reference, as a function of the double inputs. */
typedef struct {
    const acase *c;
    double *qd, *kd, *bd; /* kd == qd for self */
    double *out, *lse, *dq, *dk, *dv, *dbias;
} fd_t;

static double fd_loss(fd_t *f) {
    const acase *c = f->c;
    const fl_attn_desc *a = &c->a;
    ref_t rt = {*a, f->qd + c->qoff, f->kd + c->koff, f->kd + c->voff, f->bd, c->mask, NULL, f->out, f->lse, f->dq,
                f->dk, f->dv, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    ref_run(&rt);
    double L = 0;
    for (size_t i = 0; i < (size_t)a->B * a->Tq * a->NH * a->HD; i++) L += f->out[i] * c->dout[i];
    return L;
}

/* FD step h = 1e-5 in double: truncation h^2/6 |L'''| ~ 2e-11 and cancellation
 * 2 * 1e-16 * |L| / h ~ 1e-10 for these O(1)-sized tiny cases; so the reference's analytic
 * gradient must match to 1e-7 * (1 + max|g|), and the op's to its fp32 bound plus that. */
static void fd_case_on(fl_backend be, int causal, int bias, int mask, int cross, unsigned long long seed) {
    acase c;
    /* B 3 so every mask pattern occurs; Tq 3 vs Tk 5 (cross) */
    acase_init(&c, 3, cross ? 3 : 4, 5, 2, 1, 3, causal, bias, mask, cross, 0.8f, seed);
    char what[160];
    describe(what, sizeof what, &c);
    const fl_attn_desc *a = &c.a;
    aref R;
    aref_run(&c, &R);
    apre pre;
    apre_init(&pre, &c, seed + 1);
    ares res;
    FL_REQUIRE_OP(&be, run_op(&be, &c, &res, pre.q, pre.k, pre.b));
    size_t nb = (size_t)a->NH * a->Tq * a->Tk, no = (size_t)a->B * a->Tq * a->NH * a->HD;
    size_t nk = (size_t)a->B * a->Tk * a->NKV * a->HD;
    fd_t f = {&c, dup_d(c.qb, c.nqb), NULL, bias ? dup_d(c.bias, nb) : NULL, calloc(no, 8),
              calloc((size_t)a->B * a->NH * a->Tq, 8), calloc(no, 8), calloc(nk, 8), calloc(nk, 8), NULL};
    f.kd = cross ? dup_d(c.kb, c.nkb) : f.qd;
    const double hstep = 1e-5;
    /* each perturbed variable: (buffer, index, analytic reference gradient, op's value, op bound) */
    int bad_ref = 0, bad_op = 0;
    double maxg = 0;
    for (int pass = 0; pass < 2; pass++) /* pass 0: max |g|; pass 1: compare */
        for (int which = 0; which < 4; which++) {
            /* 0: q, 1: k, 2: v, 3: bias */
            if (which == 3 && !bias) continue;
            int rows = which == 0 ? a->Tq : a->Tk, width = which == 0 ? a->NH * a->HD : a->NKV * a->HD;
            size_t n = which == 3 ? nb : (size_t)a->B * rows * width;
            for (size_t e = 0; e < n; e++) {
                double *x;
                const float *opv, *prev;
                double gref, bound;
                if (which == 3) {
                    x = f.bd + e, opv = res.dbias + e, prev = pre.b + e;
                    gref = R.dbias[e];
                    bound = grad_bound(R.Eb[e], R.Sb[e], a->B, *prev, *prev + gref);
                } else {
                    size_t row = e / width, col = e % width;
                    size_t ld = which == 0 ? a->ldq : which == 1 ? a->ldk : a->ldv;
                    size_t off = which == 0 ? c.qoff : which == 1 ? c.koff : c.voff;
                    size_t bi = row * ld + off + col;
                    double *buf = which == 0 ? f.qd : f.kd;
                    const float *ob = which == 0 || !cross ? res.dqb : res.dkb;
                    const float *pb = which == 0 || !cross ? pre.q : pre.k;
                    x = buf + bi, opv = ob + bi, prev = pb + bi;
                    const double *G = which == 0 ? R.dq : which == 1 ? R.dk : R.dv;
                    const double *E = which == 0 ? R.Eq : which == 1 ? R.Ek : R.Ev;
                    const double *S = which == 0 ? R.Sq : which == 1 ? R.Sk : R.Sv;
                    gref = G[e];
                    double nt = which == 0 ? a->Tk : (double)(a->NH / a->NKV) * a->Tq;
                    bound = grad_bound(E[e], S[e], nt, *prev, *prev + gref);
                }
                if (pass == 0) {
                    if (fabs(gref) > maxg) maxg = fabs(gref);
                    continue;
                }
                double x0 = *x;
                *x = x0 + hstep;
                double lp = fd_loss(&f);
                *x = x0 - hstep;
                double lm = fd_loss(&f);
                *x = x0;
                double fd = (lp - lm) / (2 * hstep), tol = 1e-7 * (1 + maxg);
                if (!(fabs(gref - fd) <= tol)) {
                    if (!bad_ref)
                        fprintf(stderr, "  %s: reference grad %d[%zu] %.12g vs fd %.12g\n", what, which, e, gref, fd);
                    bad_ref++;
                }
                double got = (double)*opv - *prev;
                if (!(fabs((double)*opv - (*prev + fd)) <= bound + tol)) {
                    if (!bad_op)
                        fprintf(stderr, "  %s: op grad %d[%zu] %.9g vs fd %.9g (bound %.3g)\n", what, which, e, got,
                                fd, bound + tol);
                    bad_op++;
                }
            }
        }
    FL_CHECKF(bad_ref == 0, "%s: the float64 reference backward differs from finite differences (%d)", what, bad_ref);
    FL_CHECKF(bad_op == 0, "%s: the op's gradient differs from finite differences (%d)", what, bad_op);
    free(f.qd);
    if (cross) free(f.kd);
    free(f.bd); free(f.out); free(f.lse); free(f.dq); free(f.dk); free(f.dv);
    ares_free(&res);
    apre_free(&pre);
    aref_free(&R);
    acase_free(&c);
}
static void fd_case(int causal, int bias, int mask, int cross, unsigned long long seed) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) fd_case_on(be, causal, bias, mask, cross, seed);
}

FL_TEST(attn_ex_finite_differences) {
    for (int combo = 0; combo < 16; combo++) fd_case(combo & 1, combo >> 1 & 1, combo >> 2 & 1, combo >> 3 & 1, 300 + combo);
}

/* ---- thread count: the same bits at 1, 2, 3 threads, above the parallel threshold ------------ */

FL_TEST(attn_ex_bits_independent_of_threads) {
    for (int with_bias = 0; with_bias < 2; with_bias++) {
        acase c;
        /* B*NH*Tq*Tk*HD = 2*6*70*83*33 = 2.3M >= FL_CPU_ATTN_PAR_MIN: really threaded */
        acase_init(&c, 2, 70, 83, 6, 2, 33, 1, with_bias, 1, 1, 0.2f, 21 + with_bias);
        FL_CHECK((int64_t)2 * 6 * 70 * 83 * 33 >= FL_CPU_ATTN_PAR_MIN);
        apre pre;
        apre_init(&pre, &c, 23);
        ares res[3];
        for (int k = 0; k < 3; k++) {
            fl_backend be;
            fl_cpu_backend_init(&be, k + 1);
            FL_REQUIRE_OK(run_op(&be, &c, &res[k], pre.q, pre.k, pre.b));
        }
        const fl_attn_desc *a = &c.a;
        size_t no = (size_t)a->B * a->Tq * a->ldo, nl = (size_t)a->B * a->NH * a->Tq, nb = (size_t)a->NH * a->Tq * a->Tk;
        for (int k = 1; k < 3; k++)
            FL_CHECKF(!memcmp(res[0].out, res[k].out, no * 4) && !memcmp(res[0].lse, res[k].lse, nl * 4) &&
                          !memcmp(res[0].dqb, res[k].dqb, c.nqb * 4) && !memcmp(res[0].dkb, res[k].dkb, c.nkb * 4) &&
                          (!with_bias || !memcmp(res[0].dbias, res[k].dbias, nb * 4)),
                      "bias %d: 1 and %d threads give different bits", with_bias, k + 1);
        for (int k = 0; k < 3; k++) ares_free(&res[k]);
        for (int nt = 1; nt <= 3; nt++)
            for (int split = 0; split < 2; split++) {
                fl_backend be;
                fl_cpu_backend_init(&be, nt);
                FL_REQUIRE_OK(run_op_sched(&be, &c, &res[1], pre.q, pre.k, pre.b, split));
                if (nt == 1 && split == 0) {
                    res[0] = res[1];
                    continue;
                }
                FL_CHECKF(!memcmp(res[0].dqb, res[1].dqb, c.nqb * 4) && !memcmp(res[0].dkb, res[1].dkb, c.nkb * 4) &&
                              (!with_bias || !memcmp(res[0].dbias, res[1].dbias, nb * 4)),
                          "bias %d: %s schedule at %d threads differs from fused at 1", with_bias,
                          split ? "split" : "fused", nt);
                ares_free(&res[1]);
            }
        ares_free(&res[0]);
        apre_free(&pre);
        acase_free(&c);
    }
}

/* ---- agreement with the fused causal op on causal self-attention ------------------------------ */

static void attn_ex_matches_fused_causal_op_on(fl_backend be) {
    const int B = 2, T = 45, NH = 6, NKV = 2, HD = 16;
    acase c;
    acase_init(&c, B, T, T, NH, NKV, HD, 1, 0, 0, 0, 1.0f / sqrtf((float)HD), 31);
    c.ldo_pad = 0;
    c.a.ldo = (size_t)NH * HD; /* the fused op's out is contiguous */
    aref R;
    aref_run(&c, &R);
    apre pre;
    apre_init(&pre, &c, 32);
    ares gen;
    FL_REQUIRE_OP(&be, run_op(&be, &c, &gen, pre.q, pre.k, pre.b));
    /* the fused op on the same qkv buffer */
    size_t no = (size_t)B * T * NH * HD, nl = (size_t)B * NH * T;
    ares fused = {malloc(no * 4), malloc(nl * 4), malloc(c.nqb * 4), NULL, NULL};
    memcpy(fused.dqb, pre.q, c.nqb * 4);
    fl_attention_qkv_forward(&be, fused.out, fused.lse, c.qb, B, T, NH, NKV, HD);
    fl_attention_qkv_backward(&be, fused.dqb, c.dout, c.qb, fused.out, fused.lse, B, T, NH, NKV, HD);
    /* each op is within its bound of the float64 truth, so they differ by at most twice it:
     * compare the general op with the fused one taken as "want" */
    cmp_t m = {"general vs fused", 0, 0, 0};
    aref F = R;
    double *fo = dup_d(fused.out, no), *fl = dup_d(fused.lse, nl);
    double *fdq = calloc(no, 8), *fdk = calloc((size_t)B * T * NKV * HD, 8), *fdv = calloc((size_t)B * T * NKV * HD, 8);
    size_t W = (size_t)(NH + 2 * NKV) * HD;
    for (size_t row = 0; row < (size_t)B * T; row++) {
        for (int i = 0; i < NH * HD; i++) fdq[row * NH * HD + i] = (double)fused.dqb[row * W + i] - pre.q[row * W + i];
        for (int i = 0; i < NKV * HD; i++) {
            size_t ik = row * W + (size_t)NH * HD + i, iv = row * W + (size_t)(NH + NKV) * HD + i;
            fdk[row * NKV * HD + i] = (double)fused.dqb[ik] - pre.q[ik];
            fdv[row * NKV * HD + i] = (double)fused.dqb[iv] - pre.q[iv];
        }
    }
    F.out = fo, F.lse = fl, F.dq = fdq, F.dk = fdk, F.dv = fdv;
    compare(&m, &c, &gen, &F, pre.q, pre.k, pre.b, 2.0, 0);
    FL_CHECKF(m.bad == 0, "general op and fused op differ beyond twice the fp32 bound (%d values, worst %.3g)", m.bad,
              m.worst);
    /* and the fused op itself against the truth under the same bound */
    cmp_t m2 = {"fused vs float64", 0, 0, 0};
    compare(&m2, &c, &fused, &R, pre.q, pre.k, pre.b, 1.0, 0);
    FL_CHECKF(m2.bad == 0, "fused op outside the fp32 bound (%d values, worst %.3g)", m2.bad, m2.worst);
    free(fo); free(fl); free(fdq); free(fdk); free(fdv);
    ares_free(&gen);
    ares_free(&fused);
    apre_free(&pre);
    aref_free(&R);
    acase_free(&c);
}
FL_TEST(attn_ex_matches_fused_causal_op) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) attn_ex_matches_fused_causal_op_on(be);
}

/* ---- errors and the vtable --------------------------------------------------------------- */

static void attn_ex_bad_arguments_on(fl_backend be) {
    float x[64] = {0}, out[64], lse[8];
    for (int i = 0; i < 64; i++) out[i] = 7.0f;
    fl_attn_desc a = {1, 2, 2, 2, 1, 4, 16, 16, 16, 8, 0.5f, 0, 0, 0};
    FL_CHECK(be.attention_forward(&be, &a, out, lse, x, x, x, NULL, NULL) == FL_OK);
    fl_attn_desc bad = a;
    bad.NKV = 3; /* NH % NKV */
    FL_CHECK(be.attention_forward(&be, &bad, out, lse, x, x, x, NULL, NULL) == FL_ERR_INVALID);
    bad = a;
    bad.ldk = 3; /* < NKV*HD */
    FL_CHECK(be.attention_forward(&be, &bad, out, lse, x, x, x, NULL, NULL) == FL_ERR_INVALID);
    FL_CHECK(strstr(fl_error_message(), "ldk") != NULL);
    bad = a;
    bad.HD = FL_CPU_ATTN_MAX_HD + 1, bad.ldq = bad.ldk = bad.ldv = bad.ldo = 1000;
    for (int i = 0; i < 64; i++) out[i] = 7.0f;
    FL_CHECK(be.attention_forward(&be, &bad, out, lse, x, x, x, NULL, NULL) == FL_ERR_UNSUPPORTED);
    FL_CHECK(out[0] == 7.0f); /* nothing written on error */
    FL_CHECK(be.attention_backward(&be, &a, x, x, x, x /*dbias*/, x, x, x, x, NULL /*bias*/, NULL, out, lse) ==
             FL_ERR_INVALID);
    FL_CHECK(be.attention_backward(&be, &a, NULL, x, x, NULL, x, x, x, x, NULL, NULL, out, lse) == FL_ERR_INVALID);
}
FL_TEST(attn_ex_bad_arguments) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 1) attn_ex_bad_arguments_on(be);
}

/* No keys at all (Tk 0): every row is fully masked: out 0, lse -inf, gradients untouched. */
static void attn_ex_no_keys_on(fl_backend be) {
    fl_attn_desc a = {2, 3, 0, 2, 1, 4, 8, 4, 4, 8, 0.5f, 0, 0, 0};
    float q[48], out[48], lse[12], dq[48], d0[4] = {0}, dO[48];
    for (int i = 0; i < 48; i++) q[i] = 0.1f * i, out[i] = 7.0f, dq[i] = 3.0f, dO[i] = 1.0f;
    FL_REQUIRE_OP(&be, be.attention_forward(&be, &a, out, lse, q, d0, d0, NULL, NULL));
    int ok = 1;
    for (int i = 0; i < 48; i++) ok &= out[i] == 0.0f && dq[i] == 3.0f;
    for (int i = 0; i < 12; i++) ok &= isinf(lse[i]) && lse[i] < 0;
    FL_REQUIRE_OP(&be, be.attention_backward(&be, &a, dq, d0, d0, NULL, dO, q, d0, d0, NULL, NULL, out, lse));
    for (int i = 0; i < 48; i++) ok &= dq[i] == 3.0f;
    FL_CHECKF(ok, "Tk 0: out must be 0, lse -inf, dq unchanged");
}
FL_TEST(attn_ex_no_keys) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) attn_ex_no_keys_on(be);
}

FL_TEST(attn_ex_in_every_backend_vtable) {
    fl_backend be, ref;
    FL_REQUIRE_OK(fl_cpu_backend_init(&be, 0));
    FL_REQUIRE_OK(fl_ref_backend_init(&ref));
    FL_CHECK(be.attention_forward && be.attention_backward);
    FL_CHECK(ref.attention_forward && ref.attention_backward);
    fl_backend bk;
    FL_FOR_EACH_BACKEND(bk, 0) FL_CHECK(bk.attention_forward && bk.attention_backward);
}

/* References for the fl_comm tests, shared by tests/test_comm.c (single and threads, in the
 * normal suite) and tests/mpi/comm_mpi_test.c (MPI under mpirun), so both check the same cases
 * against the same anchors:
 *   - the specification of the deterministic reduction, written out here independently of
 *     src/comm: element i = x_0[i] (+) x_1[i] (+) ... in rank order in fp32 (AVG: / N in fp32),
 *     rounded once to the dtype; results must equal it bit for bit;
 *   - float64 with a derived bound: a sequential fp32 sum of N terms is within
 *     gamma_{N-1} * sum|x| of the exact sum (gamma_k = k u / (1 - k u), u = 2^-24; Higham 4.2),
 *     one more operation for AVG's division (gamma_N * sum|x| / N), and BF16's final rounding
 *     adds at most 2^-8 of the magnitude (8-bit significand, round to nearest), F16's at most
 *     2^-11 of it (11-bit significand) or 2^-25 absolute (half of fp16's subnormal spacing 2^-24,
 *     for results below 2^-14); MAX is exact.
 * Header-only (static functions): include it in one translation unit per program. */
#ifndef FL_TEST_COMM_REF_H
#define FL_TEST_COMM_REF_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/comm.h"
#include "fitllm/dtype.h"

typedef struct {
    fl_coll_kind kind;
    size_t count;
    fl_dtype dt;
    fl_comm_op op;
    int root;
    int inplace;
} cr_case;

static inline unsigned long long cr_mix(unsigned long long z) {
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Rank r's input for case cs: count elements of cs->dt, uniform in [-1, 1) (BF16, F16: rounded),
 * with a spread of magnitudes (some elements scaled by 2^-10 .. 2^10) so sums round non-trivially
 * (F16: some land in fp16's subnormal range below 2^-14). */
static inline void cr_input(const cr_case *cs, int r, void *out) {
    unsigned long long s = cr_mix(((unsigned long long)cs->kind << 56) ^ ((unsigned long long)cs->dt << 48) ^
                                  ((unsigned long long)cs->op << 40) ^ ((unsigned long long)r << 32) ^ cs->count);
    for (size_t i = 0; i < cs->count; i++) {
        s = cr_mix(s);
        float v = (float)((double)(s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
        int e = (int)((s >> 3) % 21) - 10;
        if ((s & 7) == 0) v = ldexpf(v, e);
        if (cs->dt == FL_F32) ((float *)out)[i] = v;
        else if (cs->dt == FL_F16) ((uint16_t *)out)[i] = fl_f32_to_f16(v);
        else ((uint16_t *)out)[i] = fl_f32_to_bf16(v);
    }
}

static inline double cr_get(fl_dtype dt, const void *p, size_t i) {
    if (dt == FL_F32) return (double)((const float *)p)[i];
    if (dt == FL_F16) return (double)fl_f16_to_f32(((const uint16_t *)p)[i]);
    return (double)fl_bf16_to_f32(((const uint16_t *)p)[i]);
}

/* The specification of reduced element i over n ranks, as the dtype's bits (in a uint32). */
static inline uint32_t cr_spec_elem(fl_dtype dt, fl_comm_op op, int n, const void *const *in, size_t i) {
    float a = 0;
    for (int r = 0; r < n; r++) {
        float x = (float)cr_get(dt, in[r], i);
        if (r == 0) a = x;
        else if (op == FL_COMM_MAX) { if (isnan(x) || x > a) a = x; }
        else a = a + x;
    }
    if (op == FL_COMM_AVG) a = a / (float)n;
    if (dt == FL_BF16) return fl_f32_to_bf16(a);
    if (dt == FL_F16) return fl_f32_to_f16(a);
    uint32_t u;
    memcpy(&u, &a, 4);
    return u;
}

static inline uint32_t cr_bits(fl_dtype dt, const void *p, size_t i) {
    if (dt == FL_BF16 || dt == FL_F16) return ((const uint16_t *)p)[i];
    uint32_t u;
    memcpy(&u, (const float *)p + i, 4);
    return u;
}

/* Check got[0..len) = the reduction of elements [off, off+len) over in[0..n): bit-equal to the
 * specification and within the float64 bound. Returns the number of failures (prints the first
 * with `label`). *worst gets the largest |err| / bound seen (0 when all exact). */
static inline int cr_check_reduce(const char *label, fl_dtype dt, fl_comm_op op, int n, const void *const *in, size_t off,
                           size_t len, const void *got, double *worst) {
    const double u = ldexp(1.0, -24), ub = ldexp(1.0, -8), uh = ldexp(1.0, -11), uh_sub = ldexp(1.0, -25);
    int fails = 0;
    for (size_t j = 0; j < len; j++) {
        size_t i = off + j;
        double ref, mx = -INFINITY, sum = 0, asum = 0;
        for (int r = 0; r < n; r++) {
            double x = cr_get(dt, in[r], i);
            sum += x;
            asum += fabs(x);
            if (x > mx) mx = x;
        }
        double g = cr_get(dt, got, j), bound;
        if (op == FL_COMM_MAX) {
            ref = mx;
            bound = 0;
        } else {
            int k = op == FL_COMM_AVG ? n : n - 1;
            double gamma = k * u / (1 - k * u);
            ref = op == FL_COMM_AVG ? sum / n : sum;
            bound = gamma * asum / (op == FL_COMM_AVG ? n : 1);
            if (dt == FL_BF16) bound += ub * (fabs(ref) + bound);
            if (dt == FL_F16) bound += uh * (fabs(ref) + bound) + uh_sub;
        }
        double err = fabs(g - ref);
        if (worst && bound > 0 && err / bound > *worst) *worst = err / bound;
        uint32_t want = cr_spec_elem(dt, op, n, in, i), have = cr_bits(dt, got, j);
        if (!(err <= bound) || want != have) {
            if (!fails)
                fprintf(stderr, "  %s: element %zu: got %.9g (bits %08x), spec bits %08x, float64 %.12g, bound %.3g\n",
                        label, i, g, have, want, ref, bound);
            fails++;
        }
    }
    return fails;
}

/* Bytes of rank r's output for case cs among n ranks (reduce_scatter: its chunk). */
static inline size_t cr_out_count(const cr_case *cs, int n, int r) {
    if (cs->kind != FL_COLL_REDUCE_SCATTER) return cs->count;
    size_t off, len;
    fl_comm_chunk(cs->count, n, r, &off, &len);
    return len;
}

/* Run case cs on rank c->rank with that rank's input `in` (count elements); the result goes to
 * out (cr_out_count elements), through an in-place buffer when cs->inplace. */
static inline fl_status cr_run(fl_comm *c, const cr_case *cs, const void *in, void *out) {
    int n = fl_comm_size(c), r = fl_comm_rank(c);
    size_t es = fl_dtype_size(cs->dt), off, len;
    fl_comm_chunk(cs->count, n, r, &off, &len);
    void *buf = malloc(cs->count * es + 16);
    if (!buf) return fl_errorf(FL_ERR_OOM, "test: out of memory");
    fl_status s = FL_OK;
    switch (cs->kind) {
    case FL_COLL_ALL_REDUCE:
        if (cs->inplace) {
            memcpy(buf, in, cs->count * es);
            s = fl_comm_all_reduce(c, buf, buf, cs->count, cs->dt, cs->op);
            memcpy(out, buf, cs->count * es);
        } else {
            s = fl_comm_all_reduce(c, in, out, cs->count, cs->dt, cs->op);
        }
        break;
    case FL_COLL_REDUCE_SCATTER:
        if (cs->inplace) {
            memcpy(buf, in, cs->count * es);
            s = fl_comm_reduce_scatter(c, buf, (char *)buf + off * es, cs->count, cs->dt, cs->op);
            memcpy(out, (char *)buf + off * es, len * es);
        } else {
            s = fl_comm_reduce_scatter(c, in, out, cs->count, cs->dt, cs->op);
        }
        break;
    case FL_COLL_ALL_GATHER: /* rank r contributes its input's own chunk */
        if (cs->inplace) {
            memset(buf, 0xA5, cs->count * es);
            memcpy((char *)buf + off * es, (const char *)in + off * es, len * es);
            s = fl_comm_all_gather(c, (char *)buf + off * es, buf, cs->count, cs->dt);
            memcpy(out, buf, cs->count * es);
        } else {
            memset(out, 0xA5, cs->count * es);
            s = fl_comm_all_gather(c, (const char *)in + off * es, out, cs->count, cs->dt);
        }
        break;
    case FL_COLL_BROADCAST:
        memcpy(out, in, cs->count * es);
        s = fl_comm_broadcast(c, out, cs->count, cs->dt, cs->root);
        break;
    default: s = fl_errorf(FL_ERR_INVALID, "test: bad case"); break;
    }
    free(buf);
    return s;
}

/* Check rank r's output of case cs against the inputs of all n ranks. Returns failures. */
static inline int cr_check(const char *label, const cr_case *cs, int n, int r, const void *const *in, const void *out,
                    double *worst) {
    size_t es = fl_dtype_size(cs->dt), off, len;
    fl_comm_chunk(cs->count, n, r, &off, &len);
    switch (cs->kind) {
    case FL_COLL_ALL_REDUCE: return cr_check_reduce(label, cs->dt, cs->op, n, in, 0, cs->count, out, worst);
    case FL_COLL_REDUCE_SCATTER: return cr_check_reduce(label, cs->dt, cs->op, n, in, off, len, out, worst);
    case FL_COLL_ALL_GATHER:
        for (int k = 0; k < n; k++) {
            size_t ko, kl;
            fl_comm_chunk(cs->count, n, k, &ko, &kl);
            if (kl && memcmp((const char *)out + ko * es, (const char *)in[k] + ko * es, kl * es)) {
                fprintf(stderr, "  %s: rank %d's chunk [%zu, %zu) differs\n", label, k, ko, ko + kl);
                return 1;
            }
        }
        return 0;
    case FL_COLL_BROADCAST:
        if (cs->count && memcmp(out, in[cs->root], cs->count * es)) {
            fprintf(stderr, "  %s: differs from root %d's buffer\n", label, cs->root);
            return 1;
        }
        return 0;
    default: return 1;
    }
}

static inline const char *cr_label(const cr_case *cs, int n, char *buf, size_t bn) {
    char w[128];
    switch (cs->kind) {
    case FL_COLL_ALL_REDUCE:
    case FL_COLL_REDUCE_SCATTER:
        snprintf(w, sizeof w, "%s(count %zu, %s, %s)", fl_coll_kind_name(cs->kind), cs->count, fl_dtype_name(cs->dt),
                 fl_comm_op_name(cs->op));
        break;
    case FL_COLL_BROADCAST:
        snprintf(w, sizeof w, "broadcast(count %zu, %s, root %d)", cs->count, fl_dtype_name(cs->dt), cs->root);
        break;
    default: snprintf(w, sizeof w, "%s(count %zu, %s)", fl_coll_kind_name(cs->kind), cs->count, fl_dtype_name(cs->dt));
    }
    snprintf(buf, bn, "%s%s at %d ranks", w, cs->inplace ? " in place" : "", n);
    return buf;
}

/* Every case for n ranks: each kind, dtype, op, in and out of place, counts around n (0, 1,
 * below n, n-1, n, n+1), odd sizes and one spanning several reduction blocks. Returns how many
 * were written to cases (cases may be NULL to count). */
static inline int cr_cases(int n, cr_case *cases) {
    size_t counts[] = {0, 1, 2, 3, (size_t)(n > 1 ? n - 1 : 1), (size_t)n, (size_t)n + 1, 7, 1000, 4099};
    int k = 0;
    for (size_t ci = 0; ci < sizeof counts / sizeof counts[0]; ci++)
        for (int dt = 0; dt < 3; dt++)
            for (int kind = 0; kind < FL_COLL_BARRIER; kind++)
                for (int ip = 0; ip < 2; ip++) {
                    int nops = kind <= FL_COLL_REDUCE_SCATTER ? FL_COMM_OP_COUNT : 1;
                    int nroots = kind == FL_COLL_BROADCAST ? (n < 3 ? n : 3) : 1;
                    if (kind == FL_COLL_BROADCAST && ip) continue;
                    for (int op = 0; op < nops; op++)
                        for (int root = 0; root < nroots; root++) {
                            if (cases)
                                cases[k] = (cr_case){(fl_coll_kind)kind, counts[ci],
                                                     dt == 2 ? FL_F16 : dt ? FL_BF16 : FL_F32,
                                                     (fl_comm_op)op, kind == FL_COLL_BROADCAST ? (n - 1 - root) : 0, ip};
                            k++;
                        }
                }
    return k;
}

#endif

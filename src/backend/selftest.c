/* fitllm selftest: every op of a backend against a reference backend, on the same inputs
 * (include/fitllm/selftest.h).
 *
 * Each case makes its inputs on the host (a fixed-seed generator), runs the op on the reference
 * backend (host buffers) and on the backend under test (its own pool's buffers, reached only
 * through to_device / to_host: a GPU's memory), and compares every output element against a
 * bound that does not come from either result:
 *     |dev - ref| <= tol * (L + 2) * u * mag + atol
 * where u is the unit roundoff of the output's storage (2^-24 fp32, 2^-8 bf16), L the length of
 * the longest reduction behind one output element (the dot products of a GEMM, the row of a
 * norm, the keys of an attention row), mag a magnitude of the terms summed (the case computes it:
 * sum |a||b| for a GEMM, max |ref| of the output otherwise) and tol a per-case constant: 2 for
 * two independent fp32 evaluations of the same sum (each within (L-1)u of exact), more where a
 * transcendental function (exp, tanh: a few ulp on a GPU) enters. 8-bit optimizer states are
 * compared by their dequantized values. Timings: median of 5 runs of the backend under test,
 * synchronized. */
#include "fitllm/selftest.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fitllm/adam8bit.h"
#include "fitllm/lora.h"
#include "fitllm/quant4.h"

#include "backend/selftest-impl.h"


/* ---- host helpers ----------------------------------------------------------------------------- */
float fl_st_rand(st_ctx *c, float lo, float hi) {
    c->rng = c->rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return lo + (hi - lo) * (float)((c->rng >> 40) & 0xffffff) / 16777216.0f;
}
float *fl_st_frand(st_ctx *c, size_t n, float lo, float hi) {
    float *x = malloc(n * sizeof(float) + 1);
    for (size_t i = 0; i < n && x; i++) x[i] = fl_st_rand(c, lo, hi);
    return x;
}
float *fl_st_dup(const float *x, size_t n) {
    float *y = malloc(n * sizeof(float) + 1);
    if (y) memcpy(y, x, n * sizeof(float));
    return y;
}
double fl_st_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* ---- device buffers: the backend's own pool, filled and read through its copies -------------- */
void *fl_st_up(st_ctx *c, st_bufs *b, const void *host, size_t bytes) {
    void *d = NULL;
    if (b->n == ST_MAX_BUFS || fl_mem_alloc(&c->pool, FL_TAG_OTHER, bytes ? bytes : 1, &d) != FL_OK) {
        b->failed = 1;
        return NULL;
    }
    b->p[b->n++] = d;
    if (host && bytes && c->dev->to_device(c->dev, d, host, bytes) != FL_OK) b->failed = 1;
    if (!host && bytes) c->dev->zero(c->dev, d, bytes);
    return d;
}
void fl_st_down(st_ctx *c, st_bufs *b, void *host, const void *dev, size_t bytes) {
    if (!dev || c->dev->to_host(c->dev, host, dev, bytes) != FL_OK) b->failed = 1;
}
void fl_st_free(st_ctx *c, st_bufs *b) {
    for (int i = 0; i < b->n; i++) fl_mem_free(&c->pool, b->p[i]);
    b->n = 0;
}

/* ---- comparison ---------------------------------------------------------------------------------- */
void fl_st_compare(st_cmp *r, const float *dev, const float *ref, const double *mag, double magc, size_t n,
                       double tol, int L, double u, double atol) {
    double mx = magc; /* magc < 0: each element's own |ref| */
    if (!mag && mx == 0)
        for (size_t i = 0; i < n; i++) mx = fmax(mx, fabs(ref[i]));
    for (size_t i = 0; i < n; i++) {
        double bound = tol * (L + 2) * u * (mag ? mag[i] : mx < 0 ? fabs(ref[i]) : mx) + atol;
        double d = fabs((double)dev[i] - ref[i]);
        if (!(d <= bound)) r->ok = 0; /* NaN fails */
        if (bound > 0 && d / bound > r->worst) r->worst = d / bound;
        if (d != d) r->worst = INFINITY;
    }
}

/* one result line; time_s < 0: not timed */
void fl_st_report(st_ctx *c, const char *name, const st_cmp *r, int launch_failed, double time_s) {
    c->n_cases++;
    int ok = r->ok && !launch_failed;
    if (!ok) c->n_fail++;
    char t[32] = "";
    if (time_s >= 0) snprintf(t, sizeof t, "%10.1f us", time_s * 1e6);
    fprintf(c->out, "  %-40s %s  worst %.2e of bound  %s%s%s%s\n", name, ok ? "ok  " : "FAIL", r->worst, t,
            launch_failed ? "  (" : "", launch_failed ? fl_error_message() : "", launch_failed ? ")" : "");
    fflush(c->out);
}

/* median of 5 synchronized runs of fn after a warm one; on the CUDA emulator (a CPU stand-in whose time says
 * nothing of a GPU's) one run: the path runs, the checked run before it already compared it (most of `make test`'s
 * selftest time was these repeats: 7 runs a case where 2 do) */
double fl_st_time(st_ctx *c, st_run_fn fn, void *arg) {
    if (c->dev->device_name && !strcmp(c->dev->device_name, "CUDA emulator")) {
        const double t0 = fl_st_now();
        fn(c, arg);
        c->dev->sync(c->dev);
        return fl_st_now() - t0;
    }
    double t[5];
    fn(c, arg); /* warm */
    c->dev->sync(c->dev);
    for (int k = 0; k < 5; k++) {
        double t0 = fl_st_now();
        fn(c, arg);
        c->dev->sync(c->dev);
        t[k] = fl_st_now() - t0;
    }
    for (int i = 1; i < 5; i++)
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            double x = t[j]; t[j] = t[j - 1]; t[j - 1] = x;
        }
    return t[2];
}

int fl_st_want(st_ctx *c, const char *name) { return !c->only || strstr(name, c->only); }


fl_status fl_backend_selftest(const fl_backend *dev, const fl_backend *ref, const char *only, int small, FILE *out,
                              fl_selftest_result *res) {
    if (!dev || !ref || !out || !res) return fl_errorf(FL_ERR_INVALID, "fl_backend_selftest: NULL argument");
    memset(res, 0, sizeof *res);
    st_ctx c;
    memset(&c, 0, sizeof c);
    c.dev = dev;
    c.ref = ref;
    c.out = out;
    c.rng = 0x5eed;
    c.only = only && *only ? only : NULL;
    c.small = small;
    FL_TRY(dev->pool_init(dev, &c.pool, "selftest", 0));
    fprintf(out, "selftest: backend %s against %s (bound: tol * (L + 2) * u * magnitude; time: median of 5)\n",
            dev->name, ref->name);
    fl_st_run_all(&c);
    fl_status s = dev->sync(dev);
    fl_mem_pool_free(&c.pool);
    res->n_cases = c.n_cases;
    res->n_fail = c.n_fail;
    fprintf(out, "selftest: %d of %d cases ok%s\n", c.n_cases - c.n_fail, c.n_cases,
            c.n_fail ? "  (MISMATCH: see FAIL lines)" : "");
    if (s != FL_OK && c.n_fail == 0) return s;
    return FL_OK;
}

/* fitllm selftest internals: the context and host helpers of selftest.c that the cases
 * (selftest_cases.c) use. */
#ifndef FL_SELFTEST_IMPL_H
#define FL_SELFTEST_IMPL_H

#include <stdint.h>
#include <stdio.h>

#include "fitllm/backend.h"
#include "fitllm/mem.h"

typedef struct {
    const fl_backend *dev, *ref;
    fl_mem_pool pool;
    FILE *out;
    int n_cases, n_fail;
    uint64_t rng;
    const char *only;
    int small;
} st_ctx;

/* host inputs from the context's fixed-seed generator */
float fl_st_rand(st_ctx *c, float lo, float hi);
float *fl_st_frand(st_ctx *c, size_t n, float lo, float hi);
float *fl_st_dup(const float *x, size_t n);
double fl_st_now(void); /* seconds, monotonic */

/* device buffers: the backend's own pool, filled and read through its copies; a failure sets
 * b->failed (the case reports it) */
#define ST_MAX_BUFS 24
typedef struct {
    void *p[ST_MAX_BUFS];
    int n;
    int failed;
} st_bufs;
void *fl_st_up(st_ctx *c, st_bufs *b, const void *host, size_t bytes); /* host NULL: zeroed */
void fl_st_down(st_ctx *c, st_bufs *b, void *host, const void *dev, size_t bytes);
void fl_st_free(st_ctx *c, st_bufs *b);

/* comparison against the bound tol * (L + 2) * u * mag + atol (selftest.c's header) */
typedef struct {
    double worst; /* max |d - r| / bound */
    int ok;
} st_cmp;
void fl_st_compare(st_cmp *r, const float *dev, const float *ref, const double *mag, double magc, size_t n, double tol,
                   int L, double u, double atol);
/* one result line; time_s < 0: not timed */
void fl_st_report(st_ctx *c, const char *name, const st_cmp *r, int launch_failed, double time_s);
/* median of 5 synchronized runs of fn (the CUDA emulator: one run) */
typedef void (*st_run_fn)(st_ctx *c, void *arg);
double fl_st_time(st_ctx *c, st_run_fn fn, void *arg);
/* whether --only selects the case */
int fl_st_want(st_ctx *c, const char *name);

/* every case (selftest_cases.c) */
void fl_st_run_all(st_ctx *c);

#endif

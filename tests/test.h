/* fitllm test harness: tests self-register with FL_TEST(name) from any file in
 * tests/; the runner (tests/main.c) runs all or those matching argv filters
 * and prints "N passed, N failed, N skipped". A check failure marks the test
 * failed and continues; FL_REQUIRE stops the test. */
#ifndef FL_TEST_H
#define FL_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"
#include "fitllm/config.h"
#include "fitllm/model.h"

typedef void (*fl_test_fn)(void);
void fl_test_register(const char *name, const char *file, fl_test_fn fn);
void fl_test_fail(const char *file, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void fl_test_skip(const char *why);
/* ---- tiers: keeping `make test` under its budget (README "Two tiers") ------------------------
 * FITLLM_TEST_TIER=full (`make test-full`) runs every case of every test in both passes; unset or "quick" (`make
 * test`, and a plain ./build/fitllm_tests) is the quick tier: every path once, sweeps thinned, slow repeats of
 * release-pass code left out of the ASan pass. Where a new test goes (a unit test: < 1.5 s in the release pass):
 *   - many cases of one path (a sweep over sizes, dtypes, ranks):  `n = fl_test_quick() ? 1 : N;` (keep one case
 *     of each path in the quick tier);
 *   - release-pass code re-run at bigger shapes / more steps (bit-identity sweeps, emulated-GPU runs), > ~1 s:
 *     `if (!fl_test_asan_budget()) return;` (skipped under ASan in the quick tier), or a subset under ASan with
 *     `fl_test_asan_light()`. Fault-injection, bad-input, resume and checkpoint-failure tests run under ASan
 *     (fewer cases is fine, each path once);
 *   - a whole test whose paths quick-tier tests already cover: `if (!fl_test_full_only("test_a, test_b")) return;`
 *     naming them (skipped, saying so, in the quick tier).
 * The same in tests/cli_test.sh and tests/mpi_test.sh (tests/suite_lib.sh): a long case (> ~5 s) whose paths other
 * cases cover goes in `if full_tier; then ...; else tier_skip NAME "the covering cases"; fi`. */
/* 1 in the quick tier (FITLLM_TEST_TIER unset or not "full") */
int fl_test_quick(void);
/* 1 to run a test that only the full tier runs; 0 (skipped, naming covered_by: the quick-tier tests that run its
 * paths) in the quick tier */
int fl_test_full_only(const char *covered_by);
/* 1 to run a slow test; 0 (skipped, saying so) in the ASan build in the quick tier (FITLLM_TEST_TIER=full or
 * FITLLM_TEST_ASAN_ALL=1 run it): the slowest emulated-kernel tests and bit-identity sweeps keep to the release
 * pass, which runs them all. */
int fl_test_asan_budget(void);
/* 1 under ASan in the quick tier (not with FITLLM_TEST_TIER=full or FITLLM_TEST_ASAN_ALL=1): run a representative
 * subset of a test's cases (every path once) */
int fl_test_asan_light(void);
int fl_test_failed(void);
/* Path to the shared data folder: $FITLLM_DATA or ../shared/data. Returns NULL
 * (and the test should skip with a clear message) if it does not exist. */
const char *fl_test_data_dir(void);
/* Join data dir and a relative path into a static buffer (NULL if no data dir). */
const char *fl_test_data_path(const char *rel);
/* Tensor-scale relative error max|a - ref| / max|ref| (a NaN difference counts as infinite;
 * the entry-wise relative error is meaningless for entries that are ~0 by cancellation).
 * *worst (may be NULL) gets the index of the largest difference. */
double fl_test_scaled_err(const float *a, const float *ref, size_t n, size_t *worst);
/* A fresh temporary directory for this test (created). */
const char *fl_test_tmpdir(void);
/* A short synthetic run for A/B tests of one switch (tests/test_xblock.c, test_cuda_dw16.c, test_cuda_lora16.c):
 * `cmd` of the model `preset` (random init for a preset), 16 training and 2 validation samples, micro-batch 1 of a
 * global batch of 2, no warm-up, 1 step, no saving, no validation, T tokens, lr 3e-3, 1 thread, seed 7, out_dir
 * `out` under this test's temporary directory. The caller sets the rest. */
void fl_test_tiny_run_config(fl_run_config *c, fl_cmd_kind cmd, const char *preset, const char *out, int T);
/* A bf16-mixed `micro` model on cuda-emu (random init, seed 5) with its activations for B x T: *be, the pools and *m
 * set up (the caller's storage; fl_test_emu_micro_free); FL_OK or the first failure. */
fl_status fl_test_emu_micro(fl_backend *be, fl_mem_pool *pool, fl_mem_pool *host, fl_model *m, const char *tag, int B,
                            int T);
void fl_test_emu_micro_free(fl_backend *be, fl_mem_pool *pool, fl_mem_pool *host, fl_model *m);
/* A run's last step as fl_trainer_run's step callback sees it (fl_test_record_step, ud = the record): step 1's loss,
 * the number of steps, the trained parameters' bytes (malloc'd: free(params)) */
typedef struct {
    double loss;
    unsigned char *params;
    size_t n;
    long steps;
} fl_test_step_rec;
int fl_test_record_step(void *ud, long step, double loss, const void *params, size_t bytes);
/* One step of `preset` (T 8, global batch 2, clipping at 1) on cuda-emu with the environment knob set to v, recorded
 * into rec (fl_test_emu_knob_ab's run; tag names the out folder) */
fl_status fl_test_emu_knob_run(fl_test_step_rec *rec, const char *knob, const char *v, const char *tag,
                               const char *preset, const char *prec, int ckpt, int lora);
fl_status fl_test_emu_knob_run_t(fl_test_step_rec *rec, const char *knob, const char *v, const char *tag,
                                 const char *preset, const char *prec, int ckpt, int lora, int T); /* T tokens */
/* An A/B knob's bits (FITLLM_CUDA_<NAME>=0 against 1): 1 step of 2 micro-batches of 1 x 8 tokens of `preset` (LoRA:
 * on q, v) trained on cuda-emu with the environment's `knob` 0, then 1; checks the same loss and parameter bits and
 * prints them (`tag`: the runs' folder names, what the messages call the setting) */
/* cuda-emu refuses the knob set to "yes" (neither 0 nor 1) at set-up, naming it */
void fl_test_emu_knob_refused(const char *knob);
void fl_test_emu_knob_ab(const char *knob, const char *tag, const char *preset, const char *prec, int ckpt, int lora);
/* The tensor data of a safetensors file (after the 8-byte length and the JSON header), malloc'd; NULL if the
 * file cannot be read. Checkpoints of two runs compare on it (their headers differ: wall times). */
unsigned char *fl_test_st_data(const char *path, size_t *len);
/* A whole file, malloc'd with a terminating NUL after its *len bytes; NULL (and *len untouched) if it
 * cannot be read. */
char *fl_test_slurp(const char *path, size_t *len);
/* A T5 model folder at dir for the trainer: tests/fixtures/<fixture>'s config.json (t5-tiny-relu / t5-tiny-gated) at
 * vocab 500 with the t5-tok Unigram tokenizer (tests/fixtures/t5-pairs' pairs tokenize within it); 0, or -1 when a
 * file cannot be read or written. */
int fl_test_t5_folder(const char *dir, const char *fixture);

/* ---- backends ---------------------------------------------------------------------------
 * "The test backend" of tests that are not about one backend's ops (models, trainer, LoRA,
 * generation): the registered backend named by the environment variable FITLLM_TEST_BACKEND
 * (default "cpu"; the runner refuses an unknown name before running anything), made with
 * n_threads, so the whole suite can run against another backend. */
fl_status fl_test_backend(fl_backend *be, int n_threads);
const char *fl_test_backend_name(void);
/* Op tests run against EVERY registered backend (ggml's test-backend-ops):
 *     fl_backend be;
 *     FL_FOR_EACH_BACKEND(be, 2) some_case(&be);
 * runs the statement once per backend with `be` made by fl_backend_init_by_name(name, &be, 2);
 * failures inside name the backend, and the runner's summary counts the tests each one ran. */
int fl_test_backend_next(int *i, fl_backend *be, int n_threads);
#define FL_FOR_EACH_BACKEND(be, n_threads) \
    for (int be##_i_ = 0; fl_test_backend_next(&be##_i_, &(be), (n_threads)); be##_i_++)
/* An op returned st. FL_ERR_UNSUPPORTED from a backend that does not implement an op or dtype
 * combination: the case is skipped with a message naming backend and case (returns 1: skip it).
 * The reference backends "cpu" and "ref" implement the whole contract of backend.h, so from
 * them it is a failure (returns 1 too). Any other status: returns 0 (the caller checks it). */
int fl_test_unsupported(const fl_backend *be, fl_status st, const char *what);
/* 1 for a backend whose kernels run under the CUDA emulator ("cuda-emu": a fiber per GPU thread,
 * ~1000x slower than the CPU ops), where a case may use smaller shapes for its repetitions */
int fl_test_backend_emulated(const fl_backend *be);

/* In a per-backend case function: run a backend op; UNSUPPORTED goes to fl_test_unsupported
 * (skip with a message, or a failure on cpu/ref) and ends the case, another error fails it. */
#define FL_REQUIRE_OP(be, expr)                                                      \
    do {                                                                             \
        fl_status s_ = (expr);                                                       \
        if (fl_test_unsupported((be), s_, #expr)) return;                            \
        if (s_ != FL_OK) {                                                           \
            fl_test_fail(__FILE__, __LINE__, "%s -> %s: %s", #expr, fl_status_name(s_), \
                         fl_error_message());                                        \
            return;                                                                  \
        }                                                                            \
    } while (0)

#define FL_TEST(name)                                                                \
    static void fl_test_##name(void);                                                \
    __attribute__((constructor)) static void fl_test_reg_##name(void) {              \
        fl_test_register(#name, __FILE__, fl_test_##name);                           \
    }                                                                                \
    static void fl_test_##name(void)

#define FL_CHECK(cond)                                                               \
    do {                                                                             \
        if (!(cond)) fl_test_fail(__FILE__, __LINE__, "check failed: %s", #cond);    \
    } while (0)
#define FL_CHECKF(cond, ...)                                                         \
    do {                                                                             \
        if (!(cond)) fl_test_fail(__FILE__, __LINE__, __VA_ARGS__);                  \
    } while (0)
#define FL_REQUIRE(cond)                                                             \
    do {                                                                             \
        if (!(cond)) { fl_test_fail(__FILE__, __LINE__, "required: %s", #cond); return; } \
    } while (0)
/* The same in a helper that returns a value: `ret` on failure (a bare return there is an error, -Werror=return-type) */
#define FL_REQUIRE_R(cond, ret)                                                      \
    do {                                                                             \
        if (!(cond)) { fl_test_fail(__FILE__, __LINE__, "required: %s", #cond); return ret; } \
    } while (0)
#define FL_REQUIRE_OK_R(expr, ret)                                                   \
    do {                                                                             \
        fl_status s_ = (expr);                                                       \
        if (s_ != FL_OK) {                                                           \
            fl_test_fail(__FILE__, __LINE__, "%s -> %s: %s", #expr, fl_status_name(s_), \
                         fl_error_message());                                        \
            return ret;                                                              \
        }                                                                            \
    } while (0)
#define FL_REQUIRE_OK(expr)                                                          \
    do {                                                                             \
        fl_status s_ = (expr);                                                       \
        if (s_ != FL_OK) {                                                           \
            fl_test_fail(__FILE__, __LINE__, "%s -> %s: %s", #expr, fl_status_name(s_), \
                         fl_error_message());                                        \
            return;                                                                  \
        }                                                                            \
    } while (0)
#define FL_SKIP_IF_NO_DATA()                                                         \
    do {                                                                             \
        if (!fl_test_data_dir()) {                                                   \
            fl_test_skip("shared data folder not found (set FITLLM_DATA or provide ../shared/data)"); \
            return;                                                                  \
        }                                                                            \
    } while (0)

/* max |a-b| / max(|b|, floor) over n elements; reports the worst index. */
double fl_test_max_rel_err(const float *a, const float *b, size_t n, double floor, size_t *worst);
/* Check arrays close: |a-b| <= atol + rtol*|b| elementwise; prints first bad. */
int fl_test_allclose(const char *what, const float *a, const float *b, size_t n, double rtol, double atol);

/* Deterministic RNG for tests. */
typedef struct { unsigned long long s; } fl_test_rng;
static inline unsigned long long fl_test_rng_u64(fl_test_rng *r) {
    unsigned long long z = (r->s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
/* uniform in [lo, hi) */
static inline float fl_test_rng_uniform(fl_test_rng *r, float lo, float hi) {
    return lo + (hi - lo) * (float)((fl_test_rng_u64(r) >> 40) * (1.0 / 16777216.0));
}
static inline void fl_test_fill(fl_test_rng *r, float *x, size_t n, float lo, float hi);
/* n floats uniform in [lo, hi) (malloc'd, at least one element), and a malloc'd copy of x */
static inline float *fl_test_frand(fl_test_rng *r, size_t n, float lo, float hi) {
    float *x = (float *)malloc((n ? n : 1) * sizeof(float));
    if (x) fl_test_fill(r, x, n, lo, hi);
    return x;
}
static inline float *fl_test_fdup(const float *x, size_t n) {
    float *y = (float *)malloc((n ? n : 1) * sizeof(float));
    if (y) memcpy(y, x, n * sizeof(float));
    return y;
}
static inline void fl_test_fill(fl_test_rng *r, float *x, size_t n, float lo, float hi) {
    for (size_t i = 0; i < n; i++) x[i] = fl_test_rng_uniform(r, lo, hi);
}

#endif

/* fitllm: a backend's self-test against a reference backend (`fitllm selftest`).
 *
 * Every op of the table, on the same inputs, on the backend under test (its own pool's memory,
 * reached only through to_device / to_host) and on the reference (host memory), each output
 * element compared against a bound from the floating-point error of the computation (not from
 * either result): see src/backend/selftest.c. One line per case with its worst error as a
 * fraction of its bound and, where timed, the median of 5 runs on the backend under test. */
#ifndef FITLLM_SELFTEST_H
#define FITLLM_SELFTEST_H

#include <stdio.h>

#include "fitllm/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int n_cases, n_fail;
} fl_selftest_result;

/* Run the cases whose name contains `only` (NULL or "": all), print to out. small: the small
 * shapes (the test suite's, fast under the CUDA emulator) instead of the realistic ones. Returns
 * FL_OK when it ran (mismatches are counted in res->n_fail), an error when it could not run. */
fl_status fl_backend_selftest(const fl_backend *dev, const fl_backend *ref, const char *only, int small, FILE *out,
                              fl_selftest_result *res);

/* The attention kernels a bf16 run may get on a backend with FL_CAP_COMPUTE_BF16 (cuda, cuda-emu), one
 * after the other: FITLLM_CUDA_ATTN=cudnn (cuDNN's fused SDPA, EXPERIMENTAL; "not available" and no
 * failure where it does not load), own and legacy, each a fresh backend `name`, forward + backward
 * at causal grouped-head shapes (HD 64 and 128), every output against a float64 reference of the same
 * bf16-rounded inputs within a bf16 bound, with the median time and TFLOP/s. The environment's
 * FITLLM_CUDA_ATTN is put back after. FL_OK when it ran (mismatches in res->n_fail). */
fl_status fl_selftest_attention_choices(const char *name, int small, FILE *out, fl_selftest_result *res);

#ifdef __cplusplus
}
#endif
#endif

/* fitllm: CPU features and run-time kernel dispatch.
 *
 * Kernels with SIMD variants (16-bit conversions, the bf16/fp16 GEMM widening, the 8-bit
 * optimizer's quantizer) pick one at run time from fl_cpu_level(), never from the compiler's
 * -march: a binary built on one x86-64 CPU runs correctly on another, and every variant the
 * CPU has can be tested against the scalar code in one binary.
 *
 * Levels (each includes the previous):
 *   FL_CPU_GENERIC  scalar C only (what the compiler makes of it);
 *   FL_CPU_AVX2     AVX2 + FMA + F16C (Haswell, Zen 1 and later);
 *   FL_CPU_AVX512   + AVX-512 F/BW/VL (Skylake-X, Zen 4 and later).
 * AVX512_BF16 (vdpbf16ps) is a separate feature bit, usable only at FL_CPU_AVX512.
 *
 * The environment variable FITLLM_CPU=generic|avx2|avx512 caps the level (read once; it can
 * lower it, never raise it above what the CPU has), to compare variants or work around a
 * suspect one. Detection runs once, thread-safely (pthread_once). */
#ifndef FITLLM_CPU_H
#define FITLLM_CPU_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
    FL_CPU_F_AVX2 = 1 << 0,
    FL_CPU_F_FMA = 1 << 1,
    FL_CPU_F_F16C = 1 << 2,
    FL_CPU_F_AVX512F = 1 << 3,
    FL_CPU_F_AVX512BW = 1 << 4,
    FL_CPU_F_AVX512VL = 1 << 5,
    FL_CPU_F_AVX512BF16 = 1 << 6,
};

typedef enum { FL_CPU_GENERIC = 0, FL_CPU_AVX2 = 1, FL_CPU_AVX512 = 2 } fl_cpu_level_t;

/* Feature bits the CPU has (FL_CPU_F_*), ignoring FITLLM_CPU. */
unsigned fl_cpu_features_detected(void);
/* Highest level the CPU supports, ignoring FITLLM_CPU. */
fl_cpu_level_t fl_cpu_level_detected(void);
/* The level kernels use: detected, capped by FITLLM_CPU and by fl_cpu_set_level. */
fl_cpu_level_t fl_cpu_level(void);
/* Feature bits usable at fl_cpu_level() (bits above the level cleared). */
unsigned fl_cpu_features(void);
/* "generic", "avx2", "avx512". */
const char *fl_cpu_level_name(fl_cpu_level_t level);
/* Space-separated names of the detected features ("avx2 fma f16c"; "" if none). */
const char *fl_cpu_features_string(void);
/* FITLLM_CPU as given ("" if unset) and whether it was understood. */
const char *fl_cpu_env(int *valid);
/* Tests and benchmarks: cap the level process-wide (clamped to the detected level); -1 goes
 * back to the FITLLM_CPU / detected level. Returns the level now in effect. Not for use while
 * kernels run on other threads (they may see either level, each call consistent). */
fl_cpu_level_t fl_cpu_set_level(int level);

/* The CPU backend's n_threads <= 0 (and the 4-bit quantizer's): the OpenMP default as the process
 * started (read once; later omp_set_num_threads calls, the GEMM's among them, do not change it). */
int fl_cpu_default_threads(void);

#ifdef __cplusplus
}
#endif
#endif

/* fitllm: performance accounting on accelerators (issue 30, item 6): the GPU peak table behind MFU, and
 * the per-op profiler of `bench-step --profile`.
 *
 * MFU = model FLOPs per step (fl_model_train_flops) / step time / the device's DENSE 16-bit tensor peak
 * (bf16 where the GPU has it, fp16 on V100 / T4; never the 2:4-sparsity figure NVIDIA's datasheets
 * print first). The peak is looked up by the name the driver reports (fl_backend.device_name).
 *
 * The profiler wraps a backend's op slots in place: each op (the outermost one, when an op calls
 * another slot) is bracketed by two markers (fl_backend.mark: CUDA events on the backend's stream, so
 * the step is not synchronized per op; without the slot, a sync and the host clock), and its time is
 * added to its op and its group. It also counts the model FLOPs the ops were asked for (GEMMs 2 M N K,
 * attention from its descriptor), which is how the tests check fl_model_train_flops independently. */
#ifndef FITLLM_PERF_H
#define FITLLM_PERF_H

#include <stddef.h>
#include <stdio.h>

#include "fitllm/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A GPU's dense 16-bit tensor-core peak, from its name. */
typedef struct {
    double tflops;     /* dense peak in TFLOP/s; 0 = unknown GPU */
    const char *dtype; /* "bf16" or "fp16" (GPUs without bf16 tensor cores) */
    const char *model; /* the table's row ("H100 SXM"), NULL when unknown */
} fl_gpu_peak;
/* Looks `name` up (tokens of the name, case-insensitive: "NVIDIA H100 PCIe" -> H100 PCIe, 756 TFLOP/s);
 * unknown or NULL: tflops 0. */
fl_gpu_peak fl_gpu_peak_lookup(const char *name);
/* The peak MFU is computed against for a backend: $FITLLM_PEAK_TFLOPS when set (a GPU the table lacks),
 * else the table's row of be->device_name. Returns 0 when the backend has no device name (CPU). */
int fl_backend_peak(const fl_backend *be, fl_gpu_peak *out);
/* One line "MFU 18.5% (183.0 of NVIDIA H200's 989.5 dense bf16 TFLOP/s)" or "MFU: unknown GPU 'X' ...",
 * for model_tflops = model TFLOP/s achieved; returns 0 (and writes "") for a backend without a device
 * name. *mfu (may be NULL) gets the fraction, or -1 when unknown. */
int fl_mfu_line(const fl_backend *be, double model_tflops, char *buf, size_t n, double *mfu);

/* ---- the profiler ------------------------------------------------------------------------------------ */

#define FL_PROF_MAX_MARKS 16384 /* markers a backend's mark slot must take (pairs pending before a collect) */

typedef enum {
    FL_PROF_GEMM = 0, /* gemm, LoRA, 4-bit matmuls */
    FL_PROF_ATTN,     /* attention forward / backward / decode, RoPE */
    FL_PROF_NORM,     /* RMSNorm, LayerNorm */
    FL_PROF_ELEM,     /* activations, add, bias, scale, convert, accumulate16 */
    FL_PROF_LOSS,     /* embedding, cross-entropy */
    FL_PROF_OPTIM,    /* optimizer updates, gradient norm (sumsq), check_finite */
    FL_PROF_COPY,     /* host <-> device and device copies, zeroing */
    FL_PROF_GROUPS
} fl_prof_group;
const char *fl_prof_group_name(fl_prof_group g);

typedef struct fl_profiler fl_profiler;
/* Wraps be's op slots (be must outlive the profiler and stay at its address; one profiler per backend;
 * one thread). */
fl_status fl_profiler_attach(fl_backend *be, fl_profiler **out);
/* Restores the backend's slots and frees the profiler. */
void fl_profiler_detach(fl_profiler *p);
/* Waits for the pending markers and adds their times (call after a step; the totals are cumulative). */
fl_status fl_profiler_collect(fl_profiler *p);
/* Zeroes the totals. */
void fl_profiler_reset(fl_profiler *p);
/* Totals since the last reset (after collect): ms and calls of a group, its model FLOPs. */
double fl_profiler_group_ms(const fl_profiler *p, fl_prof_group g);
long fl_profiler_group_calls(const fl_profiler *p, fl_prof_group g);
double fl_profiler_flops(const fl_profiler *p, fl_prof_group g);
/* Sum of the group times. */
double fl_profiler_total_ms(const fl_profiler *p);
/* The library's own rate for each GEMM shape profiled so far (the backend's gemm_bench: each shape alone, its
 * fastest candidate algorithm and the one our gemm runs, reps calls each), shown by print beside the step's rate.
 * A backend without gemm_bench: nothing. Runs GEMMs on the device: call it after the profiled steps. A shape the
 * library could not time keeps no rate (the first such failure is returned, the other shapes are timed). */
fl_status fl_profiler_gemm_refs(fl_profiler *p, int reps);
/* The table: per group, then its ops, as ms per step over `steps` steps and the share of `step_ms` (the
 * step's measured median); then a machine-readable line "PROFILE gemm_ms=.. attn_ms=.. ...". */
void fl_profiler_print(const fl_profiler *p, int steps, double step_ms, FILE *f);

#ifdef __cplusplus
}
#endif
#endif

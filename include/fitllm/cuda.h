/* fitllm: CUDA build and device queries (EXPERIMENTAL).
 *
 * The CUDA backend (docs/ARCHITECTURE.md "CUDA backend") is experimental: its ops pass
 * `fitllm selftest --accelerator cuda` on an H100; see README for what has run on a GPU. */
#ifndef FITLLM_CUDA_H
#define FITLLM_CUDA_H

#include <stddef.h>

#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when this build has the CUDA backend (CMake FL_CUDA): built as the plugin libfitllm_cuda.so,
 * which sits beside the fitllm binary and is opened only when a GPU is asked for or probed
 * (docs/ARCHITECTURE.md "CUDA plugin"). */
int fl_cuda_built(void);
/* Devices visible to the CUDA runtime (0 without a CUDA build, without the plugin, without a
 * driver, with a driver too old or without a GPU; never fails). why (may be NULL) gets the reason
 * when 0, e.g. "no NVIDIA driver (libcuda.so.1 not found)"; 768 bytes hold any. */
int fl_cuda_device_count(char *why, size_t n);
/* One line for --version: "not compiled in" (and what the driver here says), or the plugin's
 * version, architectures and path, then the devices visible or why none. */
void fl_cuda_describe(char *buf, size_t n);
/* Total memory of CUDA device `device` in bytes (0 without a CUDA build, a driver or that device). */
size_t fl_cuda_device_memory(int device);

/* --accelerator auto|cpu|cuda: fl_accel_parse / fl_accel_resolve in fitllm/backend.h (the registry's). */

#ifdef __cplusplus
}
#endif
#endif

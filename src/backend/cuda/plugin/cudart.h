/* fitllm CUDA plugin internals (src/backend/cuda/plugin/, built into libfitllm_cuda.so only): the
 * CUDA runtime's device queries and the backend and NCCL table the plugin's entry hands to
 * libfitllm (cu_plugin.h). Prefix fl_cudart_: these names never clash with libfitllm's fl_cuda_
 * functions when the GPU check programs link both. */
#ifndef FL_CUDART_H
#define FL_CUDART_H

#include <stddef.h>

#include "fitllm/backend.h"
#include "fitllm/comm_nccl.h"

#ifdef __cplusplus
extern "C" {
#endif

/* cudaGetDeviceCount (0 and the runtime's reason in why when it fails or finds none) */
int fl_cudart_device_count(char *why, size_t n);
void fl_cudart_describe_devices(char *buf, size_t n);
size_t fl_cudart_device_memory(int device);

fl_status fl_cudart_backend_init(fl_backend *be, int n_threads);
void fl_cudart_backend_free(fl_backend *be);
fl_status fl_cudart_backend_error(const fl_backend *be);

/* libnccl + cudart (src/comm/nccl_cuda.c; FL_NCCL builds) */
const fl_nccl_api *fl_cudart_nccl_api(void);
const char *fl_cudart_nccl_library(void);

#ifdef __cplusplus
}
#endif
#endif

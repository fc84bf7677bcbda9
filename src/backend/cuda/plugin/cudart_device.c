/* The CUDA plugin's entry (cu_plugin.h) and the CUDA runtime's device queries behind it. */
#include <stdio.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "backend/cuda/cu_plugin.h"
#include "backend/cuda/plugin/cudart.h"

int fl_cudart_device_count(char *why, size_t n) {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        if (why) snprintf(why, n, "no CUDA device visible to the CUDA runtime (cudaGetDeviceCount: %s)",
                          cudaGetErrorString(e));
        (void)cudaGetLastError(); /* clear the sticky-less error state */
        return 0;
    }
    if (count == 0 && why) snprintf(why, n, "no CUDA device visible (the CUDA runtime reports 0 devices)");
    return count;
}

void fl_cudart_describe_devices(char *buf, size_t n) {
    char why[256];
    int count = fl_cudart_device_count(why, sizeof why);
    if (count == 0) {
        snprintf(buf, n, "%s", why);
        return;
    }
    size_t o = (size_t)snprintf(buf, n, "%d device%s:", count, count == 1 ? "" : "s");
    for (int d = 0; d < count; d++) {
        struct cudaDeviceProp p;
        if (cudaGetDeviceProperties(&p, d) != cudaSuccess) continue;
        o += (size_t)snprintf(buf + (o < n ? o : n), o < n ? n - o : 0, "%s %d %s (sm_%d%d, %.1f GiB)",
                              d ? ";" : "", d, p.name, p.major, p.minor, (double)p.totalGlobalMem / (1 << 30));
    }
}

size_t fl_cudart_device_memory(int device) {
    char why[256];
    if (device < 0 || device >= fl_cudart_device_count(why, sizeof why)) return 0;
    struct cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, device) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return p.totalGlobalMem;
}

#ifndef FL_HAVE_NCCL
const fl_nccl_api *fl_cudart_nccl_api(void) { return NULL; }
const char *fl_cudart_nccl_library(void) { return "none"; }
#endif

/* The one exported symbol (plugin.map). */
__attribute__((visibility("default"))) const fl_cuda_plugin *fl_cuda_plugin_entry(void) {
    static fl_cuda_plugin p;
    if (!p.abi) { /* constant contents: a second caller writes the same values */
        p.backend_size = sizeof(fl_backend);
        p.pool_size = sizeof(fl_mem_pool);
        p.nccl_api_size = sizeof(fl_nccl_api);
        p.runtime_version = CUDART_VERSION;
        p.archs = FL_CUDA_ARCHS;
        p.device_count = fl_cudart_device_count;
        p.describe_devices = fl_cudart_describe_devices;
        p.device_memory = fl_cudart_device_memory;
        p.backend_init = fl_cudart_backend_init;
        p.backend_free = fl_cudart_backend_free;
        p.backend_error = fl_cudart_backend_error;
        p.nccl = fl_cudart_nccl_api();
        p.nccl_library = fl_cudart_nccl_library;
        p.abi = FL_CUDA_PLUGIN_ABI;
    }
    return &p;
}

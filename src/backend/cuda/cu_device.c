/* CUDA build and device queries, and the --accelerator choice (include/fitllm/cuda.h).
 *
 * Only the CUDA runtime's device queries are used here; a machine without a driver or a GPU
 * answers them with an error code, which becomes "no CUDA device visible" (never a failure:
 * --version and accelerator auto must work everywhere). */
#include <stdio.h>
#include <string.h>

#include "fitllm/cuda.h"

#ifdef FL_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

int fl_cuda_built(void) {
#ifdef FL_HAVE_CUDA
    return 1;
#else
    return 0;
#endif
}

int fl_cuda_device_count(char *why, size_t n) {
#ifdef FL_HAVE_CUDA
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        if (why) snprintf(why, n, "cudaGetDeviceCount: %s", cudaGetErrorString(e));
        (void)cudaGetLastError(); /* clear the sticky-less error state */
        return 0;
    }
    if (count == 0 && why) snprintf(why, n, "the CUDA runtime reports 0 devices");
    return count;
#else
    if (why) snprintf(why, n, "this build has no CUDA (configure with -DFL_CUDA=ON on a machine with the CUDA toolkit)");
    return 0;
#endif
}

void fl_cuda_describe(char *buf, size_t n) {
#ifdef FL_HAVE_CUDA
    char why[256];
    int rt = 0;
    cudaRuntimeGetVersion(&rt);
    int count = fl_cuda_device_count(why, sizeof why);
    size_t o = (size_t)snprintf(buf, n, "compiled in (experimental; runtime %d.%d, sm %s); ", rt / 1000,
                                rt % 1000 / 10, FL_CUDA_ARCHS);
    if (count == 0) {
        snprintf(buf + (o < n ? o : n), o < n ? n - o : 0, "no CUDA device visible (%s)", why);
        return;
    }
    o += (size_t)snprintf(buf + (o < n ? o : n), o < n ? n - o : 0, "%d device%s:", count, count == 1 ? "" : "s");
    for (int d = 0; d < count; d++) {
        struct cudaDeviceProp p;
        if (cudaGetDeviceProperties(&p, d) != cudaSuccess) continue;
        o += (size_t)snprintf(buf + (o < n ? o : n), o < n ? n - o : 0, "%s %d %s (sm_%d%d, %.1f GiB)",
                              d ? ";" : "", d, p.name, p.major, p.minor, (double)p.totalGlobalMem / (1 << 30));
    }
#else
    snprintf(buf, n, "not compiled in");
#endif
}

size_t fl_cuda_device_memory(int device) {
#ifdef FL_HAVE_CUDA
    char why[256];
    if (device < 0 || device >= fl_cuda_device_count(why, sizeof why)) return 0;
    struct cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, device) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return p.totalGlobalMem;
#else
    (void)device;
    return 0;
#endif
}

int fl_accel_parse(const char *s, fl_accel *out) {
    if (!s) return -1;
    if (!strcmp(s, "auto")) *out = FL_ACCEL_AUTO;
    else if (!strcmp(s, "cpu")) *out = FL_ACCEL_CPU;
    else if (!strcmp(s, "cuda")) *out = FL_ACCEL_CUDA;
    else return -1;
    return 0;
}

fl_status fl_accel_resolve(fl_accel want, fl_accel *use) {
    *use = FL_ACCEL_CPU;
    if (want == FL_ACCEL_CPU) return FL_OK;
    char why[256];
    int have = fl_cuda_built() && fl_cuda_device_count(why, sizeof why) > 0;
    if (want == FL_ACCEL_AUTO) { /* the GPU when this build has CUDA and one is visible */
        if (have) *use = FL_ACCEL_CUDA;
        return FL_OK;
    }
    if (!fl_cuda_built())
        return fl_errorf(FL_ERR_UNSUPPORTED, "--accelerator cuda: this fitllm was built without CUDA "
                                             "(rebuild with the CUDA toolkit installed, or use --accelerator cpu)");
    if (!have) return fl_errorf(FL_ERR_UNSUPPORTED, "--accelerator cuda: no CUDA device visible (%s)", why);
    *use = FL_ACCEL_CUDA;
    return FL_OK;
}

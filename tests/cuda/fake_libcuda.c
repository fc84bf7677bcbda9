/* A stand-in for the NVIDIA driver's libcuda.so.1 (built as build/fake-driver/libcuda.so.1 in every
 * build; never installed): tests/cli_test.sh puts it first on LD_LIBRARY_PATH to check what fitllm
 * says about a driver too old or a driver without a GPU, on machines without either. Only the four
 * calls fitllm's driver probe makes (src/backend/cuda/cu_loader.c), with the driver API's values:
 *   FITLLM_FAKE_CUDA_VERSION  what cuDriverGetVersion reports (default 11000: CUDA 11.0)
 *   FITLLM_FAKE_CUDA_DEVICES  0 (default): cuInit fails with CUDA_ERROR_NO_DEVICE (100); N > 0:
 *                             cuInit succeeds and cuDeviceGetCount reports N. */
#include <stdlib.h>

static int env_int(const char *name, int dflt) {
    const char *e = getenv(name);
    return e && *e ? atoi(e) : dflt;
}

int cuDriverGetVersion(int *v) {
    if (!v) return 1; /* CUDA_ERROR_INVALID_VALUE */
    *v = env_int("FITLLM_FAKE_CUDA_VERSION", 11000);
    return 0;
}

int cuInit(unsigned flags) {
    (void)flags;
    return env_int("FITLLM_FAKE_CUDA_DEVICES", 0) > 0 ? 0 : 100;
}

int cuDeviceGetCount(int *n) {
    if (!n) return 1;
    *n = env_int("FITLLM_FAKE_CUDA_DEVICES", 0);
    return 0;
}

int cuGetErrorName(int err, const char **s) {
    if (!s) return 1;
    *s = err == 100 ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_UNKNOWN";
    return 0;
}

/* The "cuda" backend (EXPERIMENTAL): backend_cuda_impl.h over the real CUDA runtime, the nvcc
 * kernels (fl_cuk_*) and cuBLASLt, on one stream per backend. Builds without CUDA keep only
 * fl_cuda_backend_init, which says why there is no CUDA backend. */
#include "backend/cuda/backend_cuda.h"

#include <stdio.h>

#ifdef FL_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "backend/cuda/cu_gemm.h"
#include "fitllm/cuda.h"

#define FLB_NAME "cuda"
#define FLB_GEMM_NAME "cublaslt"
#define FLB_HOST_MEMORY 0
#define FLB_K(name) fl_cuk_##name
#define FLB_PREFIX(name) fl_cuda_##name
#define FLB_LT_WS_BYTES FL_CUDA_LT_WS_BYTES /* cuBLASLt workspace: lets the heuristics pick split-K on H100 */
#define FLB_PANEL_BYTES FL_CUDA_PANEL_BYTES /* mixed-type GEMM panels */
#define FLB_WORK_BYTES FL_CUDA_WORK_BYTES /* kernel work: attention D (B*NH*T floats), embedding ranks */
#define flb_gemm_fn fl_cu_gemm_cublaslt

static void *flb_dev_alloc(size_t bytes) {
    void *p = NULL;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}
static void flb_dev_free(void *p) { cudaFree(p); }
static int flb_h2d(void *d, const void *h, size_t n, void *s) {
    return (int)cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, (cudaStream_t)s);
}
static int flb_d2h(void *h, const void *d, size_t n, void *s) {
    cudaError_t e = cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, (cudaStream_t)s);
    if (e == cudaSuccess) e = cudaStreamSynchronize((cudaStream_t)s);
    return (int)e;
}
static int flb_d2d(void *d, const void *src, size_t n, void *s) {
    return (int)cudaMemcpyAsync(d, src, n, cudaMemcpyDeviceToDevice, (cudaStream_t)s);
}
static int flb_memset(void *d, int v, size_t n, void *s) { return (int)cudaMemsetAsync(d, v, n, (cudaStream_t)s); }
static int flb_stream_sync(void *s) {
    cudaError_t e = cudaStreamSynchronize((cudaStream_t)s);
    if (e == cudaSuccess) e = cudaGetLastError();
    return (int)e;
}
static const char *flb_last_error(int rc) { return cudaGetErrorString((cudaError_t)rc); }

static fl_status flb_device_init(void **stream, fl_cu_blas *blas) {
    char why[256];
    if (fl_cuda_device_count(why, sizeof why) == 0)
        return fl_errorf(FL_ERR_UNSUPPORTED, "cuda backend: no CUDA device visible (%s)", why);
    cudaStream_t s;
    cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (e != cudaSuccess) return fl_errorf(FL_ERR_UNSUPPORTED, "cuda backend: cudaStreamCreate: %s", cudaGetErrorString(e));
    fl_status st = fl_cu_blas_init(blas, NULL, 0, s);
    if (st != FL_OK) {
        cudaStreamDestroy(s);
        return st;
    }
    *stream = s;
    return FL_OK;
}
static void flb_device_free(void *stream, fl_cu_blas *blas) {
    fl_cu_blas_free(blas);
    if (stream) cudaStreamDestroy((cudaStream_t)stream);
}

#include "backend/cuda/backend_cuda_impl.h"

#else /* no CUDA in this build */

fl_status fl_cuda_backend_init(fl_backend *be, int n_threads) {
    (void)be; (void)n_threads;
    return fl_errorf(FL_ERR_UNSUPPORTED, "the cuda backend: this fitllm was built without CUDA (configure on a machine "
                                         "with the CUDA toolkit, -DFL_CUDA=ON)");
}
void fl_cuda_backend_free(fl_backend *be) { (void)be; }
fl_status fl_cuda_backend_error(const fl_backend *be) {
    (void)be;
    return FL_OK;
}
#endif

/* sizes of the real backend, for the planner (any build: a GPU run is planned anywhere) */
size_t fl_cuda_scratch_bytes(void) {
    return (size_t)FL_CUDA_LT_WS_BYTES + (size_t)FL_CUDA_PANEL_BYTES + (size_t)FL_CUDA_WORK_BYTES + 256;
}
unsigned fl_cuda_gemm_widens16(void) { return 1u << FL_F16; }

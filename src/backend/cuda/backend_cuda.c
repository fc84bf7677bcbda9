/* The "cuda" backend (EXPERIMENTAL): backend_cuda_impl.h over the real CUDA runtime, the nvcc
 * kernels (fl_cuk_*) and cuBLASLt, on one stream per backend. Builds without CUDA keep only
 * fl_cuda_backend_init, which says why there is no CUDA backend. */
#include "backend/cuda/backend_cuda.h"

#include <stdio.h>
#include <string.h>

#ifdef FL_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "backend/cuda/cu_gemm.h"
#include "fitllm/comm.h"
#include "fitllm/comm_nccl.h"
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
static void *flb_host_alloc(size_t bytes) {
    void *p = NULL;
    if (cudaMallocHost(&p, bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}
static void flb_host_free(void *p) { cudaFreeHost(p); }
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

/* One process per GPU: a rank started by a launcher with several ranks on this node uses device
 * = its local rank; with one visible device per rank (srun --gpus-per-task=1, a per-rank
 * CUDA_VISIBLE_DEVICES) that device. More local ranks than devices: refused here, since NCCL
 * refuses two ranks on one GPU. */
static fl_status flb_pick_device(int count) {
    fl_launch_info li;
    if (fl_launch_detect(&li) != FL_OK || li.size <= 1 || li.local_rank < 0) return FL_OK; /* device 0 (or the current one) */
    int dev = li.local_rank;
    if (dev >= count) {
        if (count != 1)
            return fl_errorf(FL_ERR_UNSUPPORTED, "cuda backend: local rank %d on this node, but only %d CUDA devices are "
                             "visible: run one process per GPU, at most %d ranks per node (NCCL refuses two ranks on one "
                             "GPU)", li.local_rank, count, count);
        dev = 0; /* one visible device per rank */
    }
    cudaError_t e = cudaSetDevice(dev);
    if (e != cudaSuccess)
        return fl_errorf(FL_ERR_UNSUPPORTED, "cuda backend: cudaSetDevice(%d) for local rank %d: %s", dev, li.local_rank,
                         cudaGetErrorString(e));
    return FL_OK;
}

static fl_status flb_device_init(void **stream, fl_cu_blas *blas) {
    char why[256];
    int count = fl_cuda_device_count(why, sizeof why);
    if (count == 0)
        return fl_errorf(FL_ERR_UNSUPPORTED, "cuda backend: no CUDA device visible (%s)", why);
    FL_TRY(flb_pick_device(count));
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

/* Several ranks: NCCL on device memory (a build without it refuses, naming the fix). Ranks that are
 * threads of this process (the lab's in-process DDP and FSDP rows) share its one GPU, which NCCL
 * refuses ("Duplicate GPU detected"): their collectives are staged through host buffers over the
 * threads communicator (src/comm/comm_staged.c; the threads implementation's bits). */
static fl_status flb_comm_create(const fl_backend *be, void *stream, struct fl_comm *host, struct fl_comm **out) {
    *out = NULL;
    if (host && host->vt && !strcmp(host->vt->name, "threads")) return fl_backend_comm_staged(be, host, out);
#ifdef FL_HAVE_NCCL
    return fl_comm_nccl_create(host, fl_nccl_cuda_api(), stream, out);
#else
    (void)stream;
    return fl_errorf(FL_ERR_UNSUPPORTED, "cuda backend: several ranks on GPUs need NCCL, and this fitllm was built "
                     "without it (install NCCL, e.g. the libnccl-dev package, and configure again with -DFL_NCCL=ON); "
                     "run one rank, or --accelerator cpu");
#endif
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

static int fl_float_dt(fl_dtype t) { return t == FL_F32 || t == FL_BF16 || t == FL_F16; }

int fl_cuda_supports_op(fl_op op, fl_dtype a, fl_dtype b, fl_dtype c) {
    switch (op) {
    case FL_OP_GEMM: /* cuBLASLt's bf16/fp16 tensor cores with fp32 accumulation, fp32, and the widened mixes */
        return (a == FL_F32 && b == FL_F32 && c == FL_F32) || (a == FL_BF16 && b == FL_BF16 && c == FL_F32) ||
               (a == FL_F32 && b == FL_BF16 && c == FL_F32) || (a == FL_BF16 && b == FL_BF16 && c == FL_BF16) ||
               (a == FL_F32 && b == FL_F16 && c == FL_F32) || (a == FL_F16 && b == FL_F16 && c == FL_F32);
    case FL_OP_CONVERT: return fl_float_dt(a) && fl_float_dt(b);
    case FL_OP_ADAMW_EX:
    case FL_OP_SGD_EX: return fl_float_dt(a) && fl_float_dt(b) && (c == FL_F32 || c == FL_BF16);
    case FL_OP_ADAM8BIT: return fl_adam8bit_dtype_ok(a) && fl_adam8bit_dtype_ok(b);
    case FL_OP_ACCUMULATE16: return a == FL_BF16 || a == FL_F16;
    case FL_OP_SUMSQ: return fl_float_dt(a);
    case FL_OP_Q4_MATMUL: return 1;
    default: return 0;
    }
}

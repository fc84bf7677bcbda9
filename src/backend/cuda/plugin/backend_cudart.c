/* The "cuda" backend (EXPERIMENTAL), in the CUDA plugin: cuda-backend-impl.h over the real CUDA
 * runtime, the nvcc kernels (fl_cuk_*) and cuBLASLt, on one stream per backend. libfitllm reaches
 * it through the plugin's table (cu_plugin.h: fl_cudart_backend_init & co.). */
#include <stdio.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "backend/cuda/cuda-impl.h"
#include "backend/cuda/plugin/cudart.h"

#include "backend/cuda/cu_gemm.h"
#include "fitllm/comm.h"
#include "fitllm/comm_nccl.h"
#include "fitllm/cuda.h"

#define FLB_NAME "cuda"
#define FLB_GEMM_NAME "cublaslt"
#define FLB_HOST_MEMORY 0
#define FLB_K(name) fl_cuk_##name
#define FLB_PREFIX(name) fl_cudart_##name
#define FLB_LT_WS_BYTES FL_CUDA_LT_WS_BYTES /* cuBLASLt workspace: lets the heuristics pick split-K on H100 */
#define FLB_PANEL_BYTES FL_CUDA_PANEL_BYTES /* mixed-type GEMM panels */
#define FLB_WORK_BYTES FL_CUDA_WORK_BYTES /* kernel work: attention D (B*NH*T floats), embedding ranks */
#define flb_gemm_fn fl_cu_gemm_cublaslt
#define flb_gemm_bench_fn fl_cu_gemm_cublaslt_bench
#define FLB_HAVE_CUDNN 1 /* cuDNN's fused attention, opened at run time (cuda-cudnn-impl.h) */

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
/* CUDA Graphs (cuda-graph-impl.h; EXPERIMENTAL: compiled, not yet run on a GPU). Relaxed mode: the first use of a
 * shape inside a capture may still allocate (cudaMalloc is refused in the global mode). */
static int flb_capture_begin(void *s) { return (int)cudaStreamBeginCapture((cudaStream_t)s, cudaStreamCaptureModeRelaxed); }
/* End the capture; old (the segment's previous executable graph, when it is captured again because a pointer or
 * an argument changed) is updated in place with cudaGraphExecUpdate where the topology allows, else replaced. */
static int flb_capture_end(void *s, void **exec, void *old, const char **why) {
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture((cudaStream_t)s, &g);
    *exec = NULL;
    if (e != cudaSuccess || !g) {
        *why = cudaGetErrorString(e != cudaSuccess ? e : cudaErrorStreamCaptureInvalidated);
        (void)cudaGetLastError();
        if (g) cudaGraphDestroy(g);
        if (old) cudaGraphExecDestroy((cudaGraphExec_t)old);
        return 1;
    }
    if (old) {
        cudaGraphExecUpdateResultInfo info;
        if (cudaGraphExecUpdate((cudaGraphExec_t)old, g, &info) == cudaSuccess) {
            cudaGraphDestroy(g);
            *exec = old;
            return 0;
        }
        (void)cudaGetLastError();
        cudaGraphExecDestroy((cudaGraphExec_t)old);
    }
    cudaGraphExec_t x = NULL;
    e = cudaGraphInstantiate(&x, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess) {
        *why = cudaGetErrorString(e);
        (void)cudaGetLastError();
        return 1;
    }
    *exec = (void *)x;
    return 0;
}
static int flb_graph_launch(void *exec, void *s) { return (int)cudaGraphLaunch((cudaGraphExec_t)exec, (cudaStream_t)s); }
static void flb_graph_free(void *exec) { cudaGraphExecDestroy((cudaGraphExec_t)exec); }
static size_t flb_graph_nodes(void *exec) {
    (void)exec;
    return 0; /* not asked of the runtime (the door counts the ops it captured) */
}
static void flb_capture_clear(void) { (void)cudaGetLastError(); }

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

static void flb_device_name(char *buf, size_t n) {
    int d = 0;
    struct cudaDeviceProp p;
    if (cudaGetDevice(&d) != cudaSuccess || cudaGetDeviceProperties(&p, d) != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(buf, n, "unknown CUDA device");
        return;
    }
    snprintf(buf, n, "%s", p.name);
}
/* profiling markers: CUDA events (timing enabled) on the backend's stream */
static int flb_mark_new(void **ev) {
    cudaEvent_t e;
    if (cudaEventCreate(&e) != cudaSuccess) {
        (void)cudaGetLastError();
        return 1;
    }
    *ev = (void *)e;
    return 0;
}
static int flb_mark_record(void *ev, void *s) { return (int)cudaEventRecord((cudaEvent_t)ev, (cudaStream_t)s); }
static int flb_mark_elapsed(void *a, void *b, float *ms) {
    cudaError_t e = cudaEventSynchronize((cudaEvent_t)b);
    if (e == cudaSuccess) e = cudaEventElapsedTime(ms, (cudaEvent_t)a, (cudaEvent_t)b);
    return (int)e;
}
static void flb_mark_free(void *ev) { cudaEventDestroy((cudaEvent_t)ev); }
static int flb_mark_wait(void *ev) { return (int)cudaEventSynchronize((cudaEvent_t)ev); }
/* The second stream of the inputs' uploads (cuda-input-impl.h; EXPERIMENTAL: compiled, not yet run on a GPU) */
static int flb_s2_new(void **s2) {
    cudaStream_t s;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
        (void)cudaGetLastError();
        return 1;
    }
    *s2 = (void *)s;
    return 0;
}
static void flb_s2_free(void *s2) {
    if (!s2) return;
    cudaStreamSynchronize((cudaStream_t)s2);
    cudaStreamDestroy((cudaStream_t)s2);
}
static int flb_s2_h2d(void *d, const void *h, size_t n, void *s2) { return flb_h2d(d, h, n, s2); }
static int flb_s2_ev_new(void **ev, void *s2) {
    (void)s2;
    cudaEvent_t e;
    if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
        (void)cudaGetLastError();
        return 1;
    }
    *ev = (void *)e;
    return 0;
}
static void flb_s2_ev_free(void *ev) { cudaEventDestroy((cudaEvent_t)ev); }
static int flb_s2_record(void *ev, void *s2) { return (int)cudaEventRecord((cudaEvent_t)ev, (cudaStream_t)s2); }
static int flb_s2_after_main(void *s2, void *stream, void *ev) {
    cudaError_t e = cudaEventRecord((cudaEvent_t)ev, (cudaStream_t)stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent((cudaStream_t)s2, (cudaEvent_t)ev, 0);
    return (int)e;
}
static int flb_main_after_s2(void *stream, void *ev) {
    return (int)cudaStreamWaitEvent((cudaStream_t)stream, (cudaEvent_t)ev, 0);
}
static int flb_host_after_s2(void *ev) { return (int)cudaEventSynchronize((cudaEvent_t)ev); }
static int flb_s2_pending(void *s2, const void *p) { /* the emulator's check; the GPU does not know */
    (void)s2, (void)p;
    return 0;
}
static fl_status flb_device_init(void **stream, fl_cu_blas *blas) {
    char why[256];
    int count = fl_cudart_device_count(why, sizeof why);
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
    return fl_comm_nccl_create(host, fl_cudart_nccl_api(), stream, out);
#else
    (void)stream;
    return fl_errorf(FL_ERR_UNSUPPORTED, "cuda backend: several ranks on GPUs need NCCL, and this fitllm was built "
                     "without it (install NCCL, e.g. the libnccl-dev package, and configure again with -DFL_NCCL=ON); "
                     "run one rank, or --accelerator cpu");
#endif
}

#include "backend/cuda/cuda-backend-impl.h"


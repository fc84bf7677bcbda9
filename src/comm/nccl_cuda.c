/* The real fl_nccl_api table: libnccl and the CUDA runtime, in the CUDA plugin (built with FL_NCCL,
 * which needs FL_CUDA; never in libfitllm, which reaches it through the plugin's table). Thin wrappers only: every decision is in
 * comm_nccl.c, which `make test` runs over the CPU stand-in (nccl_standin.c). */
#include <assert.h>
#include <stdio.h>
#include <string.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "backend/cuda/plugin/cudart.h"
#include "fitllm/comm_nccl.h"

/* fl_nccl_api passes NCCL's values through unchanged */
static_assert(sizeof(ncclUniqueId) == sizeof(fl_nccl_id), "ncclUniqueId size");
#define SAME(a, b) ((int)(a) == (int)(b))
static_assert(SAME(ncclSuccess, FL_NCCL_SUCCESS) && SAME(ncclSystemError, FL_NCCL_SYSTEM_ERROR) &&
                  SAME(ncclInternalError, FL_NCCL_INTERNAL_ERROR) && SAME(ncclInvalidArgument, FL_NCCL_INVALID_ARGUMENT) &&
                  SAME(ncclInvalidUsage, FL_NCCL_INVALID_USAGE) && SAME(ncclRemoteError, FL_NCCL_REMOTE_ERROR) &&
                  SAME(ncclInProgress, FL_NCCL_IN_PROGRESS),
              "ncclResult_t values");
static_assert(SAME(ncclSum, FL_NCCL_SUM) && SAME(ncclMax, FL_NCCL_MAX) && SAME(ncclAvg, FL_NCCL_AVG), "ncclRedOp_t values");
static_assert(SAME(ncclFloat32, FL_NCCL_FLOAT32) && SAME(ncclBfloat16, FL_NCCL_BFLOAT16) &&
                  SAME(ncclFloat16, FL_NCCL_FLOAT16),
              "ncclDataType_t values");

static int r_get_version(int *v) { return (int)ncclGetVersion(v); }
static int r_get_unique_id(fl_nccl_id *id) { return (int)ncclGetUniqueId((ncclUniqueId *)id); }
static int r_comm_init_rank(void **comm, int nranks, fl_nccl_id id, int rank) {
    ncclUniqueId u;
    memcpy(&u, &id, sizeof u);
    ncclComm_t c = NULL;
    ncclResult_t rc = ncclCommInitRank(&c, nranks, u, rank);
    *comm = c;
    return (int)rc;
}
static int r_comm_destroy(void *comm) { return (int)ncclCommDestroy((ncclComm_t)comm); }
static int r_comm_abort(void *comm) { return (int)ncclCommAbort((ncclComm_t)comm); }
static int r_comm_get_async_error(void *comm, int *e) {
    ncclResult_t a = ncclSuccess;
    ncclResult_t rc = ncclCommGetAsyncError((ncclComm_t)comm, &a);
    *e = (int)a;
    return (int)rc;
}
static const char *r_get_error_string(int rc) { return ncclGetErrorString((ncclResult_t)rc); }
static const char *r_get_last_error(void *comm) { return ncclGetLastError((ncclComm_t)comm); }
static int r_all_reduce(const void *send, void *recv, size_t count, int dt, int op, void *comm, void *stream) {
    return (int)ncclAllReduce(send, recv, count, (ncclDataType_t)dt, (ncclRedOp_t)op, (ncclComm_t)comm,
                              (cudaStream_t)stream);
}
static int r_reduce_scatter(const void *send, void *recv, size_t recvcount, int dt, int op, void *comm, void *stream) {
    return (int)ncclReduceScatter(send, recv, recvcount, (ncclDataType_t)dt, (ncclRedOp_t)op, (ncclComm_t)comm,
                                  (cudaStream_t)stream);
}
static int r_all_gather(const void *send, void *recv, size_t sendcount, int dt, void *comm, void *stream) {
    return (int)ncclAllGather(send, recv, sendcount, (ncclDataType_t)dt, (ncclComm_t)comm, (cudaStream_t)stream);
}
static int r_broadcast(const void *send, void *recv, size_t count, int dt, int root, void *comm, void *stream) {
    return (int)ncclBroadcast(send, recv, count, (ncclDataType_t)dt, root, (ncclComm_t)comm, (cudaStream_t)stream);
}
static int r_reduce(const void *send, void *recv, size_t count, int dt, int op, int root, void *comm, void *stream) {
    return (int)ncclReduce(send, recv, count, (ncclDataType_t)dt, (ncclRedOp_t)op, root, (ncclComm_t)comm,
                           (cudaStream_t)stream);
}
static int r_group_start(void) { return (int)ncclGroupStart(); }
static int r_group_end(void) { return (int)ncclGroupEnd(); }

static int r_stream_create(void **s) {
    cudaStream_t st = NULL;
    cudaError_t e = cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    *s = st;
    return (int)e;
}
static int r_stream_destroy(void *s) { return (int)cudaStreamDestroy((cudaStream_t)s); }
static int r_event_create(void **ev) {
    cudaEvent_t e = NULL;
    cudaError_t rc = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    *ev = e;
    return (int)rc;
}
static int r_event_destroy(void *ev) { return (int)cudaEventDestroy((cudaEvent_t)ev); }
static int r_event_record(void *ev, void *s) { return (int)cudaEventRecord((cudaEvent_t)ev, (cudaStream_t)s); }
static int r_event_query(void *ev) {
    cudaError_t e = cudaEventQuery((cudaEvent_t)ev);
    if (e == cudaErrorNotReady) {
        (void)cudaGetLastError(); /* not an error: keep the runtime's last-error state clean */
        return FL_NCCL_EVENT_PENDING;
    }
    return (int)e;
}
static int r_event_synchronize(void *ev) { return (int)cudaEventSynchronize((cudaEvent_t)ev); }
static int r_stream_wait_event(void *s, void *ev) {
    return (int)cudaStreamWaitEvent((cudaStream_t)s, (cudaEvent_t)ev, 0);
}
static const char *r_cuda_error_string(int e) { return cudaGetErrorString((cudaError_t)e); }

static const fl_nccl_api k_real = {
    .name = "nccl",
    .get_version = r_get_version,
    .get_unique_id = r_get_unique_id,
    .comm_init_rank = r_comm_init_rank,
    .comm_destroy = r_comm_destroy,
    .comm_abort = r_comm_abort,
    .comm_get_async_error = r_comm_get_async_error,
    .get_error_string = r_get_error_string,
    .get_last_error = r_get_last_error,
    .all_reduce = r_all_reduce,
    .reduce_scatter = r_reduce_scatter,
    .all_gather = r_all_gather,
    .broadcast = r_broadcast,
    .reduce = r_reduce,
    .group_start = r_group_start,
    .group_end = r_group_end,
    .stream_create = r_stream_create,
    .stream_destroy = r_stream_destroy,
    .event_create = r_event_create,
    .event_destroy = r_event_destroy,
    .event_record = r_event_record,
    .event_query = r_event_query,
    .event_synchronize = r_event_synchronize,
    .stream_wait_event = r_stream_wait_event,
    .cuda_error_string = r_cuda_error_string,
};

const fl_nccl_api *fl_cudart_nccl_api(void) { return &k_real; }

const char *fl_cudart_nccl_library(void) {
    static char buf[64];
    int v = 0;
    if (ncclGetVersion(&v) != ncclSuccess) return "NCCL (version unknown)";
    /* NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z since 2.9 */
    snprintf(buf, sizeof buf, "NCCL %d.%d.%d", v / 10000, v / 100 % 100, v % 100);
    return buf;
}

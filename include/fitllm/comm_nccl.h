/* fitllm: fl_comm over NCCL (EXPERIMENTAL): collectives on DEVICE memory, one process per GPU.
 *
 * The "nccl" implementation of fl_comm (src/comm/comm_nccl.c) runs every collective through a
 * small table of function pointers, fl_nccl_api, that mirrors the NCCL and CUDA-runtime calls it
 * needs. Two tables exist:
 *   fl_nccl_cuda_api()     the real libnccl + cudart (src/comm/nccl_cuda.c, FL_NCCL builds);
 *   fl_nccl_standin_api()  a CPU stand-in that implements NCCL's documented semantics over the
 *                          threads implementation of fl_comm with host memory (src/comm/
 *                          nccl_standin.c), for the "cuda-emu" backend and the tests.
 * so the code above the table (bootstrap, layouts, requests, errors) runs in `make test`.
 *
 * Bootstrap: rank 0 of the host communicator (MPI, or threads in the tests) creates the
 * ncclUniqueId and broadcasts it over that communicator; every rank then calls ncclCommInitRank
 * with its host rank. The host communicator keeps carrying host-memory collectives (losses,
 * counts, configuration checks) and must outlive the NCCL one.
 *
 * Semantics = fl_comm's (include/fitllm/comm.h) with these differences:
 *  - every buffer is device memory of the backend the communicator was made for;
 *  - DETERMINISM: NCCL's reductions are not fl_comm's rank-order sum. A ring or tree all-reduce
 *    adds the ranks' values in an order that depends on the element's position, the channel,
 *    the algorithm and the rank count, and BF16 / F16 partial sums are rounded to 16 bits at every
 *    hop (up to N-1 roundings instead of one; an F16 partial sum beyond 65504 is inf there even
 *    when the whole sum would not be); AVG premultiplies by 1/N. Results are the same on
 *    every rank (each element is reduced once and then copied) and run to run for a fixed
 *    configuration, but differ in the last bits from fl_comm's at 3 ranks and more. At 2 ranks
 *    a SUM is one addition x_0 + x_1 = x_1 + x_0 rounded once (fp32, or bf16 / f16 widened, added
 *    in fp32 and rounded once): the same bits as fl_comm's. MAX follows NCCL (NaN propagation is
 *    not guaranteed). The stand-in reduces in rank order (it calls the threads implementation),
 *    so under it the results equal fl_comm's bit for bit at every world size;
 *  - fl_comm's uneven chunk layout (count not divisible by N) is done with grouped ncclReduce /
 *    ncclBroadcast calls, one per rank's chunk; divisible counts use ncclReduceScatter /
 *    ncclAllGather directly (NCCL's equal per-rank blocks are then fl_comm's chunks);
 *  - asynchronous: a collective is queued on the communicator's own stream after an event of the
 *    backend's stream (so it sees every op queued before it) and returns at once; fl_comm_wait
 *    synchronizes with its completion event (the host blocks; NCCL's asynchronous errors are
 *    polled while it waits). fl_comm_test queries the event. The bucketed gradient reduction
 *    therefore overlaps the next block's backward on the GPU;
 *  - no scratch in fitllm's pools (NCCL keeps its own buffers, outside the memory report);
 *  - barrier = the host communicator's barrier; abort = ncclCommAbort, then the host's abort;
 *  - a watchdog: a wait that sees no completion for FITLLM_NCCL_TIMEOUT seconds (default 600, as
 *    PyTorch's; 0: none) aborts the communicator and fails naming the collective (NCCL itself waits
 *    forever for a peer that stopped without failing, or whose collectives differ).
 *
 * Devices: one process per GPU. The cuda backend picks device = the launcher's local rank (one
 * visible device per rank, e.g. srun --gpus-per-task=1: that device). NCCL refuses two ranks on
 * one GPU ("Duplicate GPU detected"): the message says so. */
#ifndef FITLLM_COMM_NCCL_H
#define FITLLM_COMM_NCCL_H

#include <stddef.h>

#include "fitllm/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FL_NCCL_ID_BYTES 128 /* NCCL_UNIQUE_ID_BYTES */
typedef struct {
    char internal[FL_NCCL_ID_BYTES];
} fl_nccl_id;

/* NCCL's own values (nccl.h 2.x; src/comm/nccl_cuda.c checks them against the header). */
enum {
    FL_NCCL_SUCCESS = 0,
    FL_NCCL_SYSTEM_ERROR = 2,
    FL_NCCL_INTERNAL_ERROR = 3,
    FL_NCCL_INVALID_ARGUMENT = 4,
    FL_NCCL_INVALID_USAGE = 5,
    FL_NCCL_REMOTE_ERROR = 6,
    FL_NCCL_IN_PROGRESS = 7
};
enum { FL_NCCL_SUM = 0, FL_NCCL_MAX = 2, FL_NCCL_AVG = 4 };       /* ncclRedOp_t */
enum { FL_NCCL_FLOAT16 = 6, FL_NCCL_FLOAT32 = 7, FL_NCCL_BFLOAT16 = 9 }; /* ncclDataType_t */
#define FL_NCCL_EVENT_PENDING (-1) /* event_query: not complete yet (cudaErrorNotReady) */

/* The calls the NCCL communicator makes. NCCL entries return an ncclResult_t value; the stream /
 * event entries return 0 or a CUDA error code (event_query: FL_NCCL_EVENT_PENDING while the
 * event's work is pending). Opaque handles: comm = ncclComm_t, stream = cudaStream_t,
 * event = cudaEvent_t. */
typedef struct fl_nccl_api {
    const char *name; /* "nccl" / "nccl-standin" */
    int (*get_version)(int *version); /* NCCL_VERSION_CODE of the library */
    int (*get_unique_id)(fl_nccl_id *id);
    int (*comm_init_rank)(void **comm, int nranks, fl_nccl_id id, int rank);
    int (*comm_destroy)(void *comm);
    int (*comm_abort)(void *comm);
    int (*comm_get_async_error)(void *comm, int *async_error);
    const char *(*get_error_string)(int result);
    const char *(*get_last_error)(void *comm); /* details of the last failure (may be "") */
    int (*all_reduce)(const void *send, void *recv, size_t count, int dtype, int op, void *comm, void *stream);
    /* send holds nranks x recvcount elements; rank r receives block r; in place when
     * recv == send + rank * recvcount */
    int (*reduce_scatter)(const void *send, void *recv, size_t recvcount, int dtype, int op, void *comm,
                          void *stream);
    /* recv holds nranks x sendcount elements, rank r's at r * sendcount; in place when
     * send == recv + rank * sendcount */
    int (*all_gather)(const void *send, void *recv, size_t sendcount, int dtype, void *comm, void *stream);
    /* send significant on root only; in place when send == recv */
    int (*broadcast)(const void *send, void *recv, size_t count, int dtype, int root, void *comm, void *stream);
    /* recv significant (non-NULL) on root only; in place when send == recv */
    int (*reduce)(const void *send, void *recv, size_t count, int dtype, int op, int root, void *comm, void *stream);
    int (*group_start)(void);
    int (*group_end)(void);
    /* CUDA runtime */
    int (*stream_create)(void **stream); /* non-blocking */
    int (*stream_destroy)(void *stream);
    int (*event_create)(void **event);   /* timing disabled */
    int (*event_destroy)(void *event);
    int (*event_record)(void *event, void *stream);
    int (*event_query)(void *event);
    int (*event_synchronize)(void *event);
    int (*stream_wait_event)(void *stream, void *event);
    const char *(*cuda_error_string)(int err);
    /* optional (NULL: the communicator's wait polls event_query, as it must over CUDA events): block up to
     * max_s seconds until event_query may find the event's work moved on; moves no data itself. The
     * stand-in's ranks sleep here (a condition variable) instead of polling. Returns 0. */
    int (*event_wait)(void *event, double max_s);
} fl_nccl_api;

/* A communicator over `api` for the ranks of `host` (same rank and size), whose collectives run
 * after the work queued so far on `stream` (the backend's stream; NULL = the default stream).
 * Collective over host: rank 0 creates the unique id and broadcasts it (its failure reaches every
 * rank). host must outlive the result; fl_comm_destroy(*out) does not destroy host. */
fl_status fl_comm_nccl_create(fl_comm *host, const fl_nccl_api *api, void *stream, fl_comm **out);
/* The watchdog's limit new communicators take: FITLLM_NCCL_TIMEOUT (seconds) where set, else FITLLM_COMM_TIMEOUT's
 * (fl_comm_timeout: default 600). */
double fl_comm_nccl_timeout(void);

/* The real NCCL table (NULL in a build without NCCL) and the CPU stand-in (always built). */
const fl_nccl_api *fl_nccl_cuda_api(void);
const fl_nccl_api *fl_nccl_standin_api(void);
/* How many collective calls the stand-in has accepted in this process (tests: a run used it). */
unsigned long fl_nccl_standin_calls(void);
/* Whether this build links NCCL, and "NCCL 2.28.9" (the library's version) or "none". */
int fl_comm_nccl_built(void);
const char *fl_comm_nccl_library(void);

#ifdef __cplusplus
}
#endif
#endif

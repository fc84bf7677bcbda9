/* fitllm: the communication layer (collectives between ranks).
 *
 * fl_comm is one rank's handle on a group of `size` ranks. Data-parallel and sharded training
 * (DDP, ZeRO, FSDP) talk to the other ranks only through it; the implementations plug in through
 * a vtable like the backends do:
 *   "single"   size 1: every collective is a copy or a no-op (always built);
 *   "threads"  N ranks as N threads of one process sharing memory (tests: collective semantics
 *              in the normal suite, and a bit-exact twin of the MPI implementation);
 *   "mpi"      processes started by mpirun / srun (Open MPI), built when CMake finds MPI;
 *   "nccl"     device memory of a GPU backend, over a host communicator (fitllm/comm_nccl.h).
 *
 * Conventions for every collective:
 *  - every rank of the group calls the same collectives in the same order with the same count,
 *    dtype, op and root (the threads implementation checks this and names the ranks that differ;
 *    MPI cannot check it cheaply);
 *  - dtypes FL_F32, FL_BF16 and FL_F16. The 16-bit ones are widened to fp32 (exactly), reduced in
 *    fp32 and rounded (RNE) once; an F16 result beyond fp16's range (|x| >= 65520 after the sum)
 *    becomes +-inf, so a sum of finite fp16 gradients that overflows is seen as an overflow by a
 *    loss scaler checking the reduced gradients;
 *  - ops SUM, AVG (the sum divided by size in fp32, then rounded once), MAX (a NaN anywhere
 *    gives NaN, so an overflow check sees it);
 *  - DETERMINISTIC: the result bits depend only on the inputs and the world size, never on
 *    timing, the MPI library's algorithm choice or the implementation (threads == mpi, bit for
 *    bit). Element i of a reduction is x_0[i] (+) x_1[i] (+) ... (+) x_{N-1}[i] in rank order,
 *    computed by the rank that owns i's chunk (see "Chunk layout"). The "nccl" implementation is
 *    the exception: NCCL's own order (fitllm/comm_nccl.h says what differs);
 *  - all-reduce = reduce-scatter + all-gather over that layout, so every rank sends and receives
 *    (N-1)/N of the buffer per half, like a ring;
 *  - count 0 is valid (nothing moves, the call still matches across ranks); counts need not be
 *    divisible by the rank count;
 *  - asynchronous: every collective but barrier has an fl_comm_i* form that returns a request.
 *    The buffers belong to the collective until fl_comm_wait (or fl_comm_test reporting done)
 *    returns. Requests may complete in any order; fl_comm_wait/test progress all of this rank's
 *    outstanding requests (the reduction of a reduce-scatter and the all-gather half of an
 *    all-reduce run there, so call fl_comm_test between pieces of compute to overlap);
 *  - errors return an fl_status whose message names the implementation, the rank and the
 *    operation ("comm mpi: rank 2 of 4: all_reduce(count 1000, BF16, sum): ..."); nothing exits,
 *    except fl_comm_abort under MPI, whose job it is.
 *
 * Chunk layout (reduce-scatter output, all-gather input, checkpoint shards): `count` elements are
 * split into `size` contiguous ranges in rank order; rank r owns
 *   len(r) = count / size + (r < count % size ? 1 : 0)
 *   off(r) = r * (count / size) + min(r, count % size)
 * i.e. the first count % size ranks own one element more. Ranges are global element offsets,
 * so a sharded checkpoint's pieces can be reassembled at any other world size. fl_comm_chunk
 * computes it.
 *
 * Threading: one fl_comm is driven by one thread (the training loop's); OpenMP kernels never call
 * it. Not thread-safe per handle.
 */
#ifndef FITLLM_COMM_H
#define FITLLM_COMM_H

#include <stddef.h>

#include "fitllm/dtype.h"
#include "fitllm/mem.h"
#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { FL_COMM_SUM = 0, FL_COMM_AVG, FL_COMM_MAX, FL_COMM_OP_COUNT } fl_comm_op;

/* Collective kinds (for messages, the threads implementation's checks and scratch sizing). */
typedef enum {
    FL_COLL_ALL_REDUCE = 0,
    FL_COLL_REDUCE_SCATTER,
    FL_COLL_ALL_GATHER,
    FL_COLL_BROADCAST,
    FL_COLL_BARRIER,
    FL_COLL_COUNT
} fl_coll_kind;

const char *fl_comm_op_name(fl_comm_op op);     /* "sum", "avg", "max" */
const char *fl_coll_kind_name(fl_coll_kind k);  /* "all_reduce", ... */

/* ---- how the process was launched ---------------------------------------------------------- */

typedef enum {
    FL_LAUNCH_NONE = 0,  /* plain process: rank 0 of 1 */
    FL_LAUNCH_OPENMPI,   /* mpirun/mpiexec of Open MPI: OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE */
    FL_LAUNCH_PMI,       /* MPICH / Intel MPI Hydra (or another PMI launcher): PMI_RANK, PMI_SIZE */
    FL_LAUNCH_SLURM,     /* srun: SLURM_PROCID, SLURM_STEP_NUM_TASKS (or SLURM_NTASKS), SLURM_LOCALID */
    FL_LAUNCH_TORCHRUN,  /* torchrun-style: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT */
    FL_LAUNCH_COUNT
} fl_launch_kind;

typedef struct {
    fl_launch_kind kind;
    int rank, size;             /* from the launcher's variables */
    int local_rank, local_size; /* -1 where the launcher does not say */
    char master_addr[256];      /* torchrun-style only ("" otherwise) */
    int master_port;            /* torchrun-style only (0 otherwise) */
} fl_launch_info;

/* Read the launcher's environment variables (no MPI call). Precedence: Open MPI, PMI, Slurm,
 * torchrun (mpirun inside a Slurm allocation sets both; Open MPI's are the ones of this process).
 * FL_ERR_INVALID, naming the variable, when a variable is present but not a valid number or
 * the rank is outside [0, size). */
fl_status fl_launch_detect(fl_launch_info *out);
/* Whether fitllm's ranks can join under this launcher: torchrun-style variables of more than one rank without an
 * MPI launcher cannot (FL_ERR_UNSUPPORTED, naming the mpirun / srun command to run instead); else FL_OK. */
fl_status fl_launch_check(const fl_launch_info *li);
/* "Open MPI (mpirun)", "Slurm (srun)", ..., "none". */
const char *fl_launch_kind_name(fl_launch_kind k);
/* One line for the CLI: "Open MPI (mpirun): rank 1 of 4, local rank 1 of 4" or "none: single
 * process". Returns buf. */
const char *fl_launch_describe(const fl_launch_info *li, char *buf, size_t n);

/* ---- the interface ------------------------------------------------------------------------- */

typedef struct fl_comm fl_comm;
/* A pending collective. Each implementation allocates a larger struct that begins with this. */
typedef struct fl_comm_req {
    fl_comm *comm;
    fl_coll_kind kind;
    size_t count;
    fl_dtype dtype;
    fl_comm_op op;
} fl_comm_req;

typedef struct fl_comm_vtable {
    const char *name; /* "single", "threads", "mpi" */
    /* Post a collective (arguments already validated by the fl_comm_i* wrappers). *req is set. */
    fl_status (*iall_reduce)(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt, fl_comm_op op,
                             fl_comm_req **req);
    fl_status (*ireduce_scatter)(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt,
                                 fl_comm_op op, fl_comm_req **req);
    fl_status (*iall_gather)(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt,
                             fl_comm_req **req);
    fl_status (*ibroadcast)(fl_comm *c, void *buf, size_t count, fl_dtype dt, int root, fl_comm_req **req);
    fl_status (*barrier)(fl_comm *c);
    /* Progress all outstanding requests of c; *done = whether r completed. On completion or
     * error the implementation releases r. */
    fl_status (*test)(fl_comm *c, fl_comm_req *r, int *done);
    fl_status (*wait)(fl_comm *c, fl_comm_req *r);
    /* Tell every rank to stop: see fl_comm_abort. */
    void (*abort)(fl_comm *c, int code, const char *msg);
    void (*destroy)(fl_comm *c);
    /* The group of c's ranks with this rank's color: see fl_comm_split. Collective over c. NULL:
     * the implementation cannot split. */
    fl_status (*split)(fl_comm *c, int color, int key, fl_comm **out);
    /* See fl_comm_release_peers; NULL: the implementation's ranks are processes, whose exit ends the
     * job through the launcher (mpi), or there are no peers (single). */
    int (*release_peers)(fl_comm *c, const char *msg);
    /* Point to point (see fl_comm_send / fl_comm_recv; arguments validated; bytes may be 0). NULL: the
     * implementation has none (single: no peer; staged, null, nccl: not yet). */
    fl_status (*send)(fl_comm *c, const void *buf, size_t bytes, int peer, int tag);
    fl_status (*recv)(fl_comm *c, void *buf, size_t bytes, int peer, int tag);
} fl_comm_vtable;

/* Traffic of one rank since its communicator was created, counted by the dispatch layer on every
 * collective posted (whatever the implementation): payload bytes this rank sends and receives under
 * fl_comm's algorithms (reduce-scatter: count - len(r) elements out, (N-1) len(r) in; all-gather: the
 * reverse; all-reduce: both halves; broadcast: count in on every non-root rank, (N-1) count out from
 * the root as if it sent to each: a tree or a ring moves the same total), plus the calls and buffer
 * bytes (count x dtype size) per kind. Size 1 moves nothing. ZeRO's "2 psi" of DDP is the
 * all-reduce's bytes sent per rank: 2 (N-1)/N psi. */
typedef struct {
    unsigned long long sent, received;
    unsigned long long calls[FL_COLL_COUNT];
    unsigned long long buffer_bytes[FL_COLL_COUNT];
    unsigned long long p2p_sends, p2p_recvs; /* fl_comm_send / fl_comm_recv calls (their bytes are in sent / received) */
} fl_comm_traffic;

struct fl_comm {
    const fl_comm_vtable *vt;
    int rank, size;
    int local_rank, local_size; /* ranks on this node (the MPI implementation asks MPI) */
    fl_launch_info launch;      /* how this process was started (FL_LAUNCH_NONE for threads) */
    fl_mem_pool *pool;          /* scratch pool (NULL = malloc), see fl_comm_set_pool */
    void *impl;
    fl_comm_traffic traffic;    /* see fl_comm_traffic (the dispatch layer counts) */
};

/* Join the ranks this process was launched with: the single-process implementation when the
 * launcher says size 1 (or there is none; MPI is then not initialized at all), MPI otherwise.
 * argc/argv may be NULL. Errors (FL_ERR_UNSUPPORTED) say what to do: a build without MPI
 * launched with size > 1 ("multi-process training needs a build with MPI"), torchrun-style
 * variables without an MPI launcher (run mpirun/srun instead), a launcher whose rank count MPI
 * does not see (srun without --mpi=pmix, MPICH's mpiexec with an Open MPI build). */
fl_status fl_comm_init(fl_comm **out, int *argc, char ***argv);
/* This rank's traffic so far (zeros for NULL). */
void fl_comm_get_traffic(const fl_comm *c, fl_comm_traffic *t);
/* The single-process implementation (rank 0 of 1). */
fl_status fl_comm_init_single(fl_comm **out);
/* Leave the group (MPI: MPI_Finalize when fl_comm_init initialized MPI) and free c. Outstanding
 * requests must have been waited for. NULL is a no-op. */
void fl_comm_destroy(fl_comm *c);

/* Whether this build has the MPI implementation, and the MPI library's one-line version
 * ("Open MPI v4.1.4"; "none" without MPI). */
int fl_comm_mpi_built(void);
const char *fl_comm_mpi_library(void);

/* The threads implementation: n handles of one group, comms[r] for rank r, each to be driven by
 * its own thread. Destroy each with fl_comm_destroy (the group goes with the last). A rank that
 * waits longer than timeout_s (0 = fl_comm_timeout(): FITLLM_COMM_TIMEOUT, default 600 s) for the others fails
 * with an error naming the ranks that did not join (a test bug or a stuck rank, not a hang). */
fl_status fl_comm_threads_create(int n, double timeout_s, fl_comm **comms);
/* Convenience for tests: create a group of n, run fn(comm, rank, ctx) on n threads, join,
 * destroy. Returns the first non-OK status of a rank (its message on this thread). */
typedef fl_status (*fl_comm_rank_fn)(fl_comm *c, int rank, void *ctx);
fl_status fl_comm_threads_run(int n, fl_comm_rank_fn fn, void *ctx);

/* Scratch (receive buffers of the MPI reduce-scatter: (N-1) x chunk elements per outstanding
 * reduction) from pool under FL_TAG_WORKSPACE instead of malloc, so the memory report counts it.
 * The pool is not thread-safe: it must be the one the driving thread allocates from. NULL: malloc. */
void fl_comm_set_pool(fl_comm *c, fl_mem_pool *pool);
/* Bytes of scratch the collective takes on this rank while it is pending (what the planner
 * adds): MPI reductions (N-1) x len(rank) elements, otherwise 0. */
size_t fl_comm_scratch_bytes(const fl_comm *c, fl_coll_kind kind, size_t count, fl_dtype dt);

/* Sub-communicators (MPI_Comm_split's semantics): the ranks of c that pass the same color form one
 * new group, ranked by (key, rank in c). Collective over c (every rank calls it at the same point;
 * color >= 0). *out is a communicator of c's implementation (threads: a group of the same threads;
 * mpi: MPI_Comm_split; nccl: a new NCCL communicator bootstrapped over the split host communicator;
 * single: size 1) with the same collectives, conventions and bits at its size, its own traffic
 * counters (from zero; the split's own exchange is not counted on c) and no scratch pool (set one
 * with fl_comm_set_pool). local_rank / local_size: mpi asks MPI again (the ranks of the new group on
 * this node), elsewhere the new rank and size. A failure or fl_comm_abort in any group of a job
 * reaches every group of it (threads: the groups split from one fl_comm_threads_create share the
 * failure; mpi: MPI_Abort of the whole job). Destroy *out with fl_comm_destroy before c.
 * HYBRID_SHARD (src/train/fsdp.c) splits the world into its nodes and its replica groups. */
fl_status fl_comm_split(fl_comm *c, int color, int key, fl_comm **out);

/* A device communicator staged through host memory: every collective copies the device buffer's
 * part to a host buffer (to_host), runs the same collective on `host` in place there, and copies the
 * result back (to_device); everything completes when posted, and the results are host's bits (the
 * threads implementation's sums in rank order). For ranks NCCL cannot serve: threads of one process
 * sharing one GPU (the lab's in-process DDP/FSDP rows on the CUDA backend). `host` must outlive the
 * communicator (a split's own host communicator is destroyed with it). src/comm/comm_staged.c. */
typedef struct {
    void *ctx;
    fl_status (*to_host)(void *ctx, void *dst /*host*/, const void *src /*device*/, size_t bytes);
    fl_status (*to_device)(void *ctx, void *dst /*device*/, const void *src /*host*/, size_t bytes);
} fl_comm_staging;
fl_status fl_comm_staged_create(fl_comm *host, const fl_comm_staging *st, fl_comm **out);
/* How many collectives staged communicators have completed in this process (tests). */
unsigned long fl_comm_staged_calls(void);

/* The null device communicator (src/comm/comm_null.c): the planner's, for the null backend's
 * ranks (fitllm plan --devices N runs the ranks' real set-up and first step as threads). Its
 * collectives move no bytes (the buffers are fake addresses) and complete at once; with
 * mpi_scratch, each reduction takes the MPI implementation's receive scratch ((N-1) x this rank's
 * chunk, fl_comm_scratch_bytes) from host's pool (as it is now) between its post and its wait, as a
 * CPU run over MPI does; without, nothing (threads ranks; NCCL keeps its buffers outside the pool).
 * Splits split host (collective over it). host must outlive the handle. */
fl_status fl_comm_null_create(fl_comm *host, int mpi_scratch, fl_comm **out);

/* The chunk of `rank` among `size` ranks for `count` elements (layout above). */
void fl_comm_chunk(size_t count, int size, int rank, size_t *off, size_t *len);

static inline int fl_comm_rank(const fl_comm *c) { return c->rank; }
static inline int fl_comm_size(const fl_comm *c) { return c->size; }
static inline int fl_comm_local_rank(const fl_comm *c) { return c->local_rank; }
static inline int fl_comm_local_size(const fl_comm *c) { return c->local_size; }
static inline const char *fl_comm_impl_name(const fl_comm *c) { return c->vt->name; }

/* ---- collectives (blocking: post + wait) --------------------------------------------------- */

/* recv[0..count) = op over ranks of send[0..count). send == recv (in place) is allowed. */
fl_status fl_comm_all_reduce(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt, fl_comm_op op);
/* recv[0..len(rank)) = op over ranks of send[off(rank) .. off(rank)+len(rank)): send holds count
 * elements, recv this rank's chunk. recv may be send + off(rank) (in place), else no overlap. */
fl_status fl_comm_reduce_scatter(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt,
                                 fl_comm_op op);
/* recv[off(r) .. off(r)+len(r)) = rank r's send[0..len(r)) for every r: recv holds count
 * elements. send may be recv + off(rank) (in place), else no overlap. */
fl_status fl_comm_all_gather(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt);
/* buf[0..count) = root's buf on every rank. */
fl_status fl_comm_broadcast(fl_comm *c, void *buf, size_t count, fl_dtype dt, int root);
fl_status fl_comm_barrier(fl_comm *c);

/* ---- point to point (pipeline parallelism's activations and gradients) ------------------------ */

/* Tags: 0 <= tag < FL_COMM_TAG_LIMIT. Messages from one rank to another with one tag arrive in the order sent. */
#define FL_COMM_TAG_LIMIT 256
/* Send count elements of dt (any dtype: the bits travel unchanged) to rank peer (!= this rank). Buffered: returns as
 * soon as buf may be reused, never waiting for the receiver to call fl_comm_recv (the implementation keeps a copy
 * until it is received), so a schedule whose every receive has its send issued before it or by a rank that does
 * not wait on this one cannot deadlock. count 0 sends an empty message (it still has to be received). */
fl_status fl_comm_send(fl_comm *c, const void *buf, size_t count, fl_dtype dt, int peer, int tag);
/* Receive the oldest message from peer with tag into buf (count elements of dt). Blocks until it arrives,
 * progressing this rank's outstanding collectives meanwhile. A message of another size is an error naming both
 * sizes (threads: the group breaks, as for mismatched collectives). */
fl_status fl_comm_recv(fl_comm *c, void *buf, size_t count, fl_dtype dt, int peer, int tag);

/* ---- asynchronous forms -------------------------------------------------------------------- */

fl_status fl_comm_iall_reduce(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt, fl_comm_op op,
                              fl_comm_req **req);
fl_status fl_comm_ireduce_scatter(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt,
                                  fl_comm_op op, fl_comm_req **req);
fl_status fl_comm_iall_gather(fl_comm *c, const void *send, void *recv, size_t count, fl_dtype dt,
                              fl_comm_req **req);
fl_status fl_comm_ibroadcast(fl_comm *c, void *buf, size_t count, fl_dtype dt, int root, fl_comm_req **req);
/* Complete *req and set it to NULL (NULL or *req == NULL: FL_OK at once). An error completes
 * and releases the request too. */
fl_status fl_comm_wait(fl_comm_req **req);
/* *done = 1 (and *req = NULL) when complete; 0 while pending. Never blocks on other ranks. */
fl_status fl_comm_test(fl_comm_req **req, int *done);
/* Wait for n requests (NULL entries skipped); returns the first error, having completed all. */
fl_status fl_comm_wait_all(fl_comm_req **reqs, int n);

/* Abort the whole job: every rank exits non-zero promptly, the message names this rank.
 *   mpi:     prints "fitllm: rank R of N aborting: <msg>" to stderr and calls MPI_Abort
 *            (never returns; the launcher kills every rank);
 *   threads: marks the group aborted; the other ranks' pending and later calls fail with
 *            "rank R aborted: <msg>" (so they exit through their error paths); returns;
 *   single:  returns (the caller exits as it would anyway).
 * For the CLI's fatal-error path only: library code returns errors instead. */
void fl_comm_abort(fl_comm *c, int code, const char *msg);

/* For library code whose rank failed where no agreement follows (an OOM inside a training step):
 * peers that are threads of this process would otherwise wait in their next collective until the
 * group's timeout. Where they are (threads, and the staged, nccl and null communicators over
 * threads: the NCCL stand-in's own group too), the group breaks as fl_comm_abort breaks it and
 * this returns 1; their calls then fail with "rank R aborted (code 1): msg". Processes (mpi) and a
 * single rank: nothing (0); the failing process's exit ends an MPI job. Never exits. msg may be
 * fl_error_message(): this thread's message is msg afterwards. */
int fl_comm_release_peers(fl_comm *c, const char *msg);

/* ---- a wait that never ends ----------------------------------------------------------------- */

/* FITLLM_COMM_TIMEOUT: the seconds one rank waits for one collective, barrier or receive before it gives up on the
 * others (a rank stopped without dying - kill -STOP, a hung file system -, or the ranks' collectives differ);
 * default 600 (PyTorch's NCCL watchdog's), 0 or less: never. mpi: the rank prints which wait, what it waited for
 * and fl_comm_set_timeout_note's words, and ends the job (MPI_Abort, exit 1); threads: the group breaks (every
 * rank's call fails naming the ranks that did not arrive; fl_comm_threads_create's explicit timeout wins); nccl:
 * the communicator is aborted and the wait fails (FITLLM_NCCL_TIMEOUT, where set, wins for it). A value that is not
 * a number: fl_comm_timeout_check's error (fl_comm_init returns it); the getter then says 600. */
double fl_comm_timeout(void);
fl_status fl_comm_timeout_check(void);
/* What a timeout's message adds after the wait (the CLI: the step the rank was in and the last committed
 * checkpoint): fn writes a phrase into buf (n bytes). Process-wide; NULL: nothing. Called on the waiting thread. */
typedef void (*fl_comm_note_fn)(char *buf, size_t n);
void fl_comm_set_timeout_note(fl_comm_note_fn fn);

#ifdef __cplusplus
}
#endif
#endif

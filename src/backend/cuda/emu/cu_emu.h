/* fitllm CUDA emulator: runs CUDA kernels written against cu_compat.h on the CPU.
 *
 * One fiber (ucontext) per CUDA thread; the blocks of a grid run one after another on the
 * calling OS thread. A fiber runs without interruption until it reaches a barrier
 * (__syncthreads: the block; a warp shuffle or __syncwarp: its warp) or returns. When every
 * live fiber of the block (of the warp) has arrived, they are released and run again, in an
 * order shuffled by a seeded generator: code that relies on an order CUDA does not promise
 * (a missing __syncthreads) then reads stale or NaN-filled data and fails its test.
 * Semantics and limits: docs/ARCHITECTURE.md "CUDA backend". C API: the C++ side of
 * cu_compat.h calls it; tests call the seed / error functions. */
#ifndef FL_CU_EMU_H
#define FL_CU_EMU_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct { unsigned x, y, z; } fl_cu_emu_dim;

/* Run fn(ctx) once per CUDA thread of grid x block, with dyn_smem bytes of dynamic shared
 * memory per block (filled with 0xff bytes, a float NaN, at each block's start). Blocks run in
 * turn; a launch is synchronous. Errors (too many threads, a barrier not reached by all live
 * threads of its block or warp) are recorded for fl_cu_emu_error() and end the launch. */
void fl_cu_emu_launch(fl_cu_emu_dim grid, fl_cu_emu_dim block, size_t dyn_smem, void (*fn)(void *), void *ctx);

/* What a GPU refuses at launch and the emulator otherwise would not (tests/test_cuda_emu.c cuda_emu_launch_limits):
 * fl_cu_emu_launch_ok is called by every FL_CU_LAUNCH (run or captured) with the kernel's address as its key. A grid
 * of more than 2^31 - 1 blocks in x or 65,535 in y or z, a block over 1,024 threads or 1,024 / 1,024 / 64 in x / y /
 * z, or dynamic shared memory over 48 KiB without the kernel's opt-in of at least that much
 * (cudaFuncSetAttribute(MaxDynamicSharedMemorySize): FL_CU_SMEM_OPTIN, fl_cu_emu_smem_optin) records an error
 * naming it and returns 0 (nothing runs, as cudaErrorInvalidConfiguration / InvalidValue). */
int fl_cu_emu_launch_ok(uintptr_t kernel, fl_cu_emu_dim grid, fl_cu_emu_dim block, size_t dyn_smem);
/* The opt-in: 0, or -1 when bytes exceeds the emulated device's per-block maximum (cudaFuncSetAttribute's refusal:
 * then fl_cu_emu_take_pending returns 1 once, as cudaGetLastError returns and clears the refusal, and the kernel's
 * previous opt-in stays). The maximum is process-wide: 232,448 bytes (sm_90's 227 KiB) unless set
 * (fl_cu_emu_set_smem_max: sm_80's 166,912, sm_86 / 89's 101,376; 0 restores the default) or given by
 * FITLLM_EMU_SMEM_MAX=BYTES (read at the first opt-in; values under 49,152 ignored). */
int fl_cu_emu_smem_optin(uintptr_t kernel, size_t bytes);
void fl_cu_emu_set_smem_max(size_t bytes);
size_t fl_cu_emu_smem_max(void);
int fl_cu_emu_take_pending(void);
/* dynamic shared memory opt-ins refused so far (a test reads it to see that a fall-back was taken) */
extern unsigned long fl_cu_emu_smem_refusals;

/* The running CUDA thread's coordinates (valid inside a launch). */
const fl_cu_emu_dim *fl_cu_emu_thread_idx(void);
const fl_cu_emu_dim *fl_cu_emu_block_idx(void);
const fl_cu_emu_dim *fl_cu_emu_block_dim(void);
const fl_cu_emu_dim *fl_cu_emu_grid_dim(void);
void *fl_cu_emu_dyn_smem(void);

/* __syncthreads(): wait for every live thread of the block. */
void fl_cu_emu_syncthreads(void);
/* __syncwarp(): wait for every live lane of the calling thread's warp (32 consecutive linear ids). */
void fl_cu_emu_syncwarp(void);
/* The warp exchange under every shuffle: publishes `mine`, waits for the warp, returns the value
 * lane src_lane published (src_lane < 0, outside the block or an exited lane: `mine`), then waits
 * again so no lane overwrites its slot before all have read. */
uint64_t fl_cu_emu_exchange(uint64_t mine, int src_lane);
/* The warp's all-gather under the emulated tensor-core mma (cu_mma.h): every lane publishes
 * `bytes` (<= FL_CU_EMU_GATHER_MAX) from `mine` and receives the 32 lanes' in lane order into
 * `all` (32 * bytes), one warp barrier phase. Every lane of a full warp must be live and call it
 * (as mma.sync needs): otherwise the launch records an error and `all` is zeros. */
#define FL_CU_EMU_GATHER_MAX 64
void fl_cu_emu_warp_gather(const void *mine, size_t bytes, void *all);
/* The same gather read in place (the emulated mma's, without 32 copies a lane): returns the warp's slots, lane l's
 * bytes at l * FL_CU_EMU_GATHER_MAX, readable until fl_cu_emu_warp_gather_end (the warp barrier after which a lane
 * may publish again), which every lane must call; NULL (the error recorded) where the gather above gives zeros. */
const unsigned char *fl_cu_emu_warp_gather_begin(const void *mine, size_t bytes);
void fl_cu_emu_warp_gather_end(void);
/* cp.async (attn_mma.h's fl_cu_cp16 / fl_cu_cp8 under the emulator): the destination holds 0xff bytes from the issue
 * until the calling thread's cp.async.wait_group (fl_cu_emu_cp_wait: every committed group but the newest n) lands the
 * bytes read at the issue; fl_cu_emu_cp_commit closes a group (PTX's commit_group). A thread that returns with copies in
 * flight is an error. docs/ARCHITECTURE.md "The tiles' loads". */
void fl_cu_emu_cp_async(void *dst, const void *src, int bytes, int valid);
void fl_cu_emu_cp_commit(void);
void fl_cu_emu_cp_wait(int n);
/* Lane of the calling thread (0..31). */
int fl_cu_emu_lane(void);

/* Fiber order between barrier phases: seed 0 runs the fibers in thread order every phase (what
 * a naive emulator does: hides missing barriers); any other seed shuffles them (the default). */
void fl_cu_emu_set_seed(uint64_t seed);
uint64_t fl_cu_emu_get_seed(void);
/* The first error recorded on this OS thread since the last fl_cu_emu_clear_error (NULL: none). */
const char *fl_cu_emu_error(void);
void fl_cu_emu_clear_error(void);
/* Fiber context switches on this OS thread so far (a test asserts a barrier switches). */
uint64_t fl_cu_emu_switches(void);

/* Stream capture (CUDA Graphs, issue 30 item 5), per OS thread. Between capture_begin and capture_end, launches
 * (FL_CU_LAUNCH: capture_kernel, the closure with its arguments by value, owned by the graph and freed with del)
 * and stream copies (capture_call: fn with a copy of `bytes` of args) are recorded as nodes, not run; a host
 * read-back or stream synchronization calls capture_invalidate (the GPU refuses them inside a capture too), and
 * capture_end then returns NULL with the reason. graph_launch runs the nodes in their order, with the captured
 * arguments (the replay of a cudaGraphLaunch). */
typedef struct fl_cu_emu_graph fl_cu_emu_graph;
int fl_cu_emu_capture_begin(void); /* 0, or -1 when this thread already captures */
int fl_cu_emu_capturing(void);
void fl_cu_emu_capture_kernel(fl_cu_emu_dim grid, fl_cu_emu_dim block, size_t dyn_smem, void (*fn)(void *), void *ctx,
                              void (*del)(void *));
void fl_cu_emu_capture_call(void (*fn)(void *), const void *args, size_t bytes);
void fl_cu_emu_capture_invalidate(const char *why);
fl_cu_emu_graph *fl_cu_emu_capture_end(const char **why);
void fl_cu_emu_graph_launch(const fl_cu_emu_graph *g);
size_t fl_cu_emu_graph_nodes(const fl_cu_emu_graph *g);
void fl_cu_emu_graph_free(fl_cu_emu_graph *g);
/* graph launches since the process started (tests: that a run replayed) */
extern unsigned long fl_cu_emu_graph_launches;

/* Convert-kernel launches since the process started (convert: 1-D, convert2d: the GEMM's
 * widen/narrow panels), counted by the kernels' host entry points under the emulator only: the
 * bf16-step test (tests/test_cuda_model.c) measures how many a bf16 training step still pays. */
extern unsigned long fl_cu_emu_convert_launches, fl_cu_emu_convert2d_launches;
/* cuDNN's attention path (the stand-in tests/cuda/sim_cudnn.c): buffers of the backend's own it grew because the
 * model lent too small a region (cuda-cudnn-impl.h's flb_dnn_buf; a test wants 0: the plan holds the workspace) */
extern unsigned long fl_cu_emu_dnn_own_buffers;
/* attention_backward_b16 calls cuDNN ran (fl_cu_emu_dnn_b16), those with the gradients written in place by its graph
 * (_b16_grads: the q|k|v linear's bf16 dy rows) and with dO read in place (_b16_dout) */
extern unsigned long fl_cu_emu_dnn_b16, fl_cu_emu_dnn_b16_grads, fl_cu_emu_dnn_b16_dout;
/* 128-bit accesses (fl_cu_ld4 / st4 / ld8h / st8h) made so far (not atomic: a test reads it around its own single-
 * threaded launches to see that a vector path ran) */
extern unsigned long fl_cu_emu_vec_accesses;
/* Launches of the residual add (add / add16), the norms' forward kernels (RMSNorm, LayerNorm, either weight type) and
 * the fused add + norm kernels (add_rmsnorm_forward, add_norm_forward16), counted by their host entry points under
 * the emulator only: the launch-count ratchets of issue 30 item 4 (tests/test_cuda_model.c) */
extern unsigned long fl_cu_emu_norm_add_launches;
/* GEMMs through the cuBLASLt stand-in since the process started, and those cuBLASLt could not give its fast kernels: an
 * operand (A, B, C, D, the bias, GELU's aux) not 16-byte aligned or a leading dimension not a multiple of 16 bytes (Hopper's TMA
 * kernels and the 128-bit loads of the others need both; cuBLASLt then falls back to kernels of a smaller alignment,
 * several times slower). The last such call is described in fl_cu_emu_gemm_misaligned_what; with
 * FITLLM_EMU_GEMM_AUDIT=1 each one is printed to stderr (the audit of a whole step's GEMMs, issue 30 item 3). */
extern unsigned long fl_cu_emu_gemm_calls, fl_cu_emu_gemm_misaligned;
extern char fl_cu_emu_gemm_misaligned_what[192];

#ifdef __cplusplus
}
#endif
#endif

/* fitllm CUDA backend objects (EXPERIMENTAL): "cuda" (the GPU; FL_CUDA builds) and "cuda-emu"
 * (the same backend code over the CPU emulator and the cuBLASLt stand-in, host memory; linked
 * into the test programs only, registered with fl_backend_register). See cuda-backend-impl.h. */
#ifndef FL_BACKEND_CUDA_H
#define FL_BACKEND_CUDA_H

#include "fitllm/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The real backend's op scratch (cuda-backend-impl.h): cuBLASLt workspace, mixed-type GEMM panels,
 * kernel work, + 256 bytes of re-alignment. The planner uses these sizes for a GPU plan. */
#define FL_CUDA_LT_WS_BYTES (32u << 20)
#define FL_CUDA_PANEL_BYTES (32u << 20)
#define FL_CUDA_WORK_BYTES (16u << 20)
size_t fl_cuda_scratch_bytes(void);
/* gemm_widens16 of the real backend: an F16 B is widened per call (bf16 is native) */
unsigned fl_cuda_gemm_widens16(void);
/* attn_scratch_bytes of the real backend as a plan here sees it: fl_cudnn_sdpa_scratch_bytes when FITLLM_CUDA_ATTN
 * takes cuDNN (auto, cudnn) and a cuDNN library loads on this machine (probed once), else NULL */
size_t (*fl_cuda_planned_attn_scratch(void))(int B, int T, int NH, int NKV, int HD);
/* supports_op of the real backend (and its emulated twin), in any build: the planner's null backend asks
 * it when it stands in for a GPU */
int fl_cuda_supports_op(fl_op op, fl_dtype a, fl_dtype b, fl_dtype c);

fl_status fl_cuda_backend_init(fl_backend *be, int n_threads);
void fl_cuda_backend_free(fl_backend *be);
/* FL_OK, or the backend's sticky error (the first failed op) */
fl_status fl_cuda_backend_error(const fl_backend *be);

fl_status fl_cuemu_backend_init(fl_backend *be, int n_threads);
void fl_cuemu_backend_free(fl_backend *be);
fl_status fl_cuemu_backend_error(const fl_backend *be);
/* cuda-emu with several ranks: 1 (default) = the NCCL communicator over its CPU stand-in; 0 = the
 * host communicator used directly (tests compare the two). Not thread-safe: set before the ranks start. */
void fl_cuemu_use_nccl(int on);

/* What the backend made the host wait for, since it was made: sync calls, copies to the host (each waits
 * for the stream: sumsq's and check_finite's results, to_host), copies from the host (to_device,
 * check_finite's flag); of the latter, h2d_pinned went through the page-locked ring (cuda-stage-impl.h: no
 * wait), and stage_waits counts the times a ring slot was still queued (the host waited for the GPU). */
typedef struct {
    long sync, d2h, h2d, h2d_pinned, stage_waits;
    long h2d_s2; /* of the copies from the host, those on the second stream (the next micro-batch's inputs) */
    /* rope_forward16 / rope_backward16 / act_backward16 issued with a NULL fp32 output (the bf16 copy alone, issue 30
     * item 1), and the fp32 bytes those ops did not write */
    long only16, only16_bytes;
    /* the fp32 gradient staging's traffic (issue 30 item 1): bytes `zero` filled, fp32 bytes accumulate16 read, and
     * the GEMMs that added into a 16-bit C in place (beta != 0: a weight gradient written straight into g16) */
    long zero_bytes, acc16_bytes, gemm_acc16;
    /* gemm_res16's calls (issue 30 items 1 and 3: a residual add inside its projection's GEMM) and the fp32 bytes of
     * their products not written (the fp32 output the separate add would have read) */
    long gemm_res16, res16_bytes;
} fl_cu_counters;
void fl_cuemu_backend_counters(const fl_backend *be, fl_cu_counters *out);
/* cuda-emu made after fl_cuemu_set_host_memory(0) states the real GPU's capabilities (FL_CAP_DEVICE_MEMORY, not
 * FL_CAP_HOST_MEMORY), so the model and trainer take the GPU's paths (host staging pool, ids copied, the phase
 * syncs) over the emulator's host memory; 1 (default) = host memory. Set before fl_backend_init_by_name. */
void fl_cuemu_set_host_memory(int on);
void fl_cudart_backend_counters(const fl_backend *be, fl_cu_counters *out);
/* FITLLM_CUDA_GRAPHS=1 (cuda-graph-impl.h): what the door does with the step ("replaying the step as N CUDA graphs
 * ...", or "op by op: " and why), once two steps ran; "" otherwise. */
const char *fl_cuemu_backend_graph_verdict(const fl_backend *be);
const char *fl_cudart_backend_graph_verdict(const fl_backend *be);
/* Its counts: steps captured / replayed whole / that fell back op by op part way, recaptures, graphs made, their
 * nodes (the emulator's), graph launches, ops captured, ops run outside the graphs during the captures, AdamW
 * updates run inside a graph (their per-step constants from the device slot). */
typedef struct {
    long captured_steps, replayed_steps, missed_steps, recaptures, graphs, nodes, launches, captured_ops, outside_ops;
    long graph_updates;
} fl_cu_graph_stats;
void fl_cuemu_backend_graph_stats(const fl_backend *be, fl_cu_graph_stats *out);
void fl_cudart_backend_graph_stats(const fl_backend *be, fl_cu_graph_stats *out);

#ifdef __cplusplus
}
#endif
#endif

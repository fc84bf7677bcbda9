/* fitllm: NVIDIA cuDNN's fused scaled-dot-product attention, opened at run time (EXPERIMENTAL: built
 * and checked without a GPU; `fitllm selftest --accelerator cuda` compares it on the user's GPU).
 *
 * Why dlopen: cuDNN is large (about 1 GB with its engines) and optional. It ships with the CUDA
 * toolkit and inside PyTorch's wheels; fitllm links nothing of it, so a machine without it runs the
 * own attention kernels (kernels/attn_fa2.cu) and says once why. Only the C backend API is used
 * (cudnnBackend* descriptors; no C++ frontend): the SDPA forward and backward are built as operation
 * graphs of matmul / pointwise / reduction / reshape nodes, which cuDNN's fused-attention engines
 * recognize (cudnn_sdpa.c).
 *
 * Three layers, each testable here:
 *   cudnn_load.c  the library and its symbols (fl_cudnn_api: plain function pointers, so a test can
 *                 inject fakes), its version, and the reason when any is missing;
 *   cudnn_sdpa.c  pure mapping of an attention call (fl_attn_desc) to the graph's tensors (dims,
 *                 strides, unique ids; fl_cudnn_sdpa_layout), the shape check (fl_cudnn_sdpa_refuse),
 *                 and the graph building / plan cache / execution through fl_cudnn_api;
 *   the backend   (cuda-work-ops-impl.h, the plugin only): FITLLM_CUDA_ATTN's choice, the bf16 copies
 *                 of the fp32 operands, and the fall-back to the own kernels. */
#ifndef FL_CUDNN_IMPL_H
#define FL_CUDNN_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* the oldest cuDNN taken: 9.0 (the fused flash-attention graphs with grouped K/V heads, backward
 * included) */
#define FL_CUDNN_MIN_VERSION 90000

/* The subset of cuDNN's C API fitllm calls, as plain C types (cudnnStatus_t and the enums are ints;
 * handles and descriptors pointers): filled by fl_cudnn_load, or by a test. Every call returns a
 * cudnnStatus_t (0 = CUDNN_STATUS_SUCCESS). */
typedef struct fl_cudnn_api {
    void *lib; /* dlopen handle (NULL: injected) */
    size_t version; /* cudnnGetVersion(): 91900 for 9.19.0 */
    size_t (*get_version)(void);
    const char *(*error_string)(int status);
    int (*create)(void **handle);
    int (*destroy)(void *handle);
    int (*set_stream)(void *handle, void *stream);
    int (*be_create)(int type, void **desc);
    int (*be_destroy)(void *desc);
    int (*be_set)(void *desc, int name, int type, int64_t count, const void *values);
    int (*be_get)(void *desc, int name, int type, int64_t requested, int64_t *count, void *values);
    int (*be_finalize)(void *desc);
    int (*be_execute)(void *handle, void *plan, void *variant_pack);
} fl_cudnn_api;

/* The library: `path` (NULL: $FITLLM_CUDNN_LIB, else libcudnn.so.9 then libcudnn.so on the loader's
 * search path, else the first of fl_cudnn_search's places) opened and every symbol above resolved, and its
 * version checked. 0, or -1 with the reason in why (the file not found, a missing symbol, a version below
 * FL_CUDNN_MIN_VERSION); nothing stays mapped on failure. */
int fl_cudnn_load(fl_cudnn_api *api, const char *path, char *why, size_t n);
/* Where cuDNN 9 usually is when it is not on the loader's path, first found written to out: PyTorch's
 * nvidia-cudnn wheel (nvidia/cudnn/lib/libcudnn.so.9 under $VIRTUAL_ENV, $CONDA_PREFIX, ~/.local and the
 * system's python3* site- / dist-packages), conda's $CONDA_PREFIX/lib, and the CUDA toolkit's
 * /usr/local/cuda/lib64 and lib. 1 found, 0 not. */
int fl_cudnn_search(char *out, size_t n);
/* One line for `fitllm --version`: "9.19.0 (/path/libcudnn.so.9)" of the library fl_cudnn_load(NULL) opens, or why
 * none opens. */
void fl_cudnn_describe(char *out, size_t n);
void fl_cudnn_unload(fl_cudnn_api *api);
/* "CUDNN_STATUS_NOT_SUPPORTED" (the library's own name when loaded), else "cudnn status N" */
const char *fl_cudnn_status_name(const fl_cudnn_api *api, int status, char *buf, size_t n);

/* FITLLM_CUDA_ATTN: which attention kernels a bf16 run gets for the shapes they take. */
typedef enum {
    FL_CUDNN_ATTN_AUTO = 0, /* cuDNN when it loads and accepts the shape, else OWN (said once) */
    FL_CUDNN_ATTN_CUDNN,    /* cuDNN: the backend fails to start without it; a refused shape: OWN, said once */
    FL_CUDNN_ATTN_OWN,      /* kernels/attn_fa2.cu */
    FL_CUDNN_ATTN_LEGACY,   /* kernels/attention_tc.cu */
    FL_CUDNN_ATTN_FP32      /* the fp32 kernels whatever the dtype */
} fl_cudnn_attn_choice;
/* NULL / "" / "auto" -> AUTO, ...; -1 for anything else */
int fl_cudnn_attn_parse(const char *env);
/* whether a choice tries cuDNN at all */
static inline int fl_cudnn_attn_wants(int choice) {
    return choice == FL_CUDNN_ATTN_AUTO || choice == FL_CUDNN_ATTN_CUDNN;
}

/* ---- the SDPA graphs (cudnn_sdpa.c) ---------------------------------------------------------- */

/* unique ids of the graph's non-virtual tensors (the variant pack's keys) */
enum {
    FL_CUDNN_UID_Q = 1, FL_CUDNN_UID_K, FL_CUDNN_UID_V, FL_CUDNN_UID_O, FL_CUDNN_UID_STATS, FL_CUDNN_UID_SCALE,
    FL_CUDNN_UID_NEG, FL_CUDNN_UID_DO, FL_CUDNN_UID_DQ, FL_CUDNN_UID_DK, FL_CUDNN_UID_DV, FL_CUDNN_UID_DSUM,
    FL_CUDNN_UID_DQACC, /* backward: dQ accumulated in fp32, (B, NH, Tq, HD) packed: fl_cudnn_sdpa_dqacc_bytes */
    FL_CUDNN_UID_ONE,   /* backward: a by-value 1 (the softmax-sum's dropout scale, as cuDNN's pattern has it) */
    FL_CUDNN_UID_COUNT
};

/* One 4-d tensor of the graph: dims (b, h, s, d) and strides in elements. */
typedef struct {
    int64_t dim[4], stride[4];
} fl_cudnn_t4;

/* What the graphs see of one attention call. q, k, v, o (and their gradients) are the bf16 (or
 * fp16) copies the backend makes: compact rows, (B, T, heads, HD), so (b, h, s, d) strides are
 * (T*H*HD, HD, H*HD, 1); stats is the fp32 (B, NH, Tq) log-sum-exp of the fl_attn_desc contract
 * (natural log of the scaled scores' row sum), viewed (B, NH, Tq, 1). */
typedef struct {
    fl_cudnn_t4 q, k, v, o, stats;
    fl_cudnn_t4 dq, dk, dv; /* the backward's outputs: compact (B, T, heads, HD) rows, or q, k, v's (grad_rows) */
    int io_dtype; /* cudnnDataType_t of q, k, v, o: CUDNN_DATA_BFLOAT16 or CUDNN_DATA_HALF */
    int causal;
    float scale;
} fl_cudnn_sdpa_layout;

/* The layout of a call with 16-bit copies of type `dt` (FL_BF16 / FL_F16). Pure. */
void fl_cudnn_sdpa_layout_of(const fl_attn_desc *a, fl_dtype dt, fl_cudnn_sdpa_layout *L);
/* As fl_cudnn_sdpa_layout_of, but q, k, v at the call's own row strides (a->ldq, ldk, ldv): cuDNN reads a bf16 run's
 * stored 16-bit rows in place, no compact copy (FITLLM_CUDA_CUDNN_DIRECT, the default); o, dO and the gradients stay
 * compact. Usable when fl_cudnn_sdpa_direct_ok. Pure. */
void fl_cudnn_sdpa_layout_rows(const fl_attn_desc *a, fl_dtype dt, fl_cudnn_sdpa_layout *L);
/* As fl_cudnn_sdpa_layout_rows, and the backward's dQ, dK, dV written at the same row strides as q, k, v
 * (attention_backward_b16: into the q|k|v linear's bf16 dy rows, no compact copies brought back). Pure. */
void fl_cudnn_sdpa_layout_grad_rows(const fl_attn_desc *a, fl_dtype dt, fl_cudnn_sdpa_layout *L);
/* whether q, k, v can be read in place: a head size of whole 16-byte units, each 16-byte aligned with a row stride
 * of whole 16-byte units (cuDNN's tensors are declared 16-byte aligned). Pure. */
int fl_cudnn_sdpa_direct_ok(const fl_attn_desc *a, const void *q, const void *k, const void *v);
/* The call cuDNN runs for a: its head size HD rounded up to a multiple of 8 (the fused engines' sizes: OpenLLaMA
 * 3B's 100 runs at 104), compact rows at that size (ldq = ldo = NH HD', ldk = ldv = NKV HD'); the operands' copies
 * are zero-padded per head (so the scores, and with V's zero columns the outputs' first HD columns, are the call's;
 * the scale stays a's) and the results' padding dropped (attention_heads2d). 1 when HD' != HD. Pure. */
int fl_cudnn_sdpa_pad(const fl_attn_desc *a, fl_attn_desc *p);
/* NULL when cuDNN's graphs take the call, else why not (a phrase): the head size (up to 128), a bias,
 * a key mask, causal with Tq != Tk (the graphs' mask is top-left aligned), NH % NKV, an empty shape,
 * a non-compact output row (ldo != NH*HD). Pure. */
const char *fl_cudnn_sdpa_refuse(const fl_attn_desc *a, const float *bias, const uint8_t *kmask);
/* The backend's cuDNN buffer for one call (cuda-cudnn-impl.h): the bf16 copies, each 256-aligned (forward q k v o;
 * backward q o dO dQ k v dK dV), before cuDNN's workspace. */
size_t fl_cudnn_sdpa_copy_bytes(const fl_attn_desc *a, int backward);
/* The backward graph's fp32 dQ accumulator (FL_CUDNN_UID_DQACC): B * NH * Tq * HD floats, 256-aligned; cuDNN
 * before 9.6.0 needs it zeroed before each run (fl_cudnn_dqacc_needs_zero), later versions initialize it. */
size_t fl_cudnn_sdpa_dqacc_bytes(const fl_attn_desc *a);
static inline int fl_cudnn_dqacc_needs_zero(size_t version) { return version < 90600; }
/* The allowance for cuDNN's own workspace in a call's backward (its forward asks less: 0 or 256 bytes), from
 * the figures cuDNN 9.19 states for the engines it ranks first (CUDNN_ATTR_ENGINECFG_WORKSPACE_SIZE, planned
 * without a GPU by tests/test_cudnn.c's cudnn_plan_without_a_device, which checks this bound): on sm_80 (A100,
 * engine 7) an fp32 dQ accumulator of its own, B NH Tq' HD floats (rows rounded up to 8: Tq' <= Tq rounded up to
 * 64 here), plus with grouped K / V heads full-head 16-bit dK and dV (2 x B NH Tk' HD x 2 bytes) before their
 * reduction; on sm_90 (H200, engine 6) the full-head dK / dV only; each + 128 or 256 bytes. The larger, + 1 KiB:
 * TinyLlama-1.1B's B 4, T 2048, 32 / 4 heads, HD 64: 128 MiB + 1 KiB (the A100's 128 MiB + 128). Pure. */
size_t fl_cudnn_sdpa_workspace_allowance(const fl_attn_desc *a);
/* fl_backend.attn_scratch_bytes of the cuda backend with cuDNN: a model's causal self-attention (B, T, NH, NKV,
 * HD) lends the backward's copies (the larger), the graph's fp32 dQ accumulator and the workspace allowance
 * above. A plan asking more (another GPU or cuDNN) makes the backend grow a buffer of its own, outside the
 * pools, said once. 0: a refused shape. */
size_t fl_cudnn_sdpa_scratch_bytes(int B, int T, int NH, int NKV, int HD);

/* A built plan (forward or backward) and the workspace bytes it needs. */
typedef struct fl_cudnn_plan fl_cudnn_plan;
/* The SDPA graphs through `api` on `handle` (NULL: the descriptors are built and finalized up to the
 * operation graph, which needs a handle: what the tests do with the real library and no GPU).
 * 0 and *out (NULL when handle is NULL), or -1 and why (the descriptor or node that failed and
 * cuDNN's status: a shape no engine takes ends here). */
int fl_cudnn_sdpa_build(const fl_cudnn_api *api, void *handle, const fl_cudnn_sdpa_layout *L, int backward,
                        fl_cudnn_plan **out, char *why, size_t n);
/* Without a GPU (cuDNN >= 9.8's ahead-of-time path): the graphs, the engine heuristics and the plan of the
 * heuristics' first configuration for the device `devprop` describes (fl_cudnn_devprop_json) instead of a handle's. cuDNN's fused attention engines compile their
 * kernels through NVRTC when the plan is finalized, then load them through the driver: on a machine without one,
 * heuristics rank nothing (every configuration fails cuDNN's support check with
 * CUDNN_STATUS_NOT_SUPPORTED_RUNTIME_PREREQUISITE_MISSING, before any graph check); with the CUDA toolkit's stub
 * libcuda.so.1 loaded, the graph and shape checks run, the kernel compiles and only loading it fails
 * (CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER). So, with the stub: a graph cuDNN refuses on a GPU (the first graphs
 * of 2026-11-30, "no engine for the graph" on an H200) is refused here alike, and one it takes compiles.
 * 0: the plan finalized (a GPU was there), 1 it compiled and only its loading
 * failed (why says so), -1 refused (why: the step and cuDNN's status); *engine: its engine's global index,
 * *workspace: the bytes the configuration says it needs (CUDNN_ATTR_ENGINECFG_WORKSPACE_SIZE; the plan's when it
 * finalized). */
int fl_cudnn_sdpa_probe(const fl_cudnn_api *api, void *devprop, const fl_cudnn_sdpa_layout *L, int backward,
                        int64_t *engine, size_t *workspace, char *why, size_t n);
/* A device property descriptor from cuDNN's JSON (the keys of cudnnDeviceProp: deviceVer 900 for sm_90,
 * multiProcessorCount, the shared memory and register limits, ...), finalized; free with api->be_destroy.
 * 0, or -1 and why (cuDNN before 9.8, a JSON cuDNN refuses). */
int fl_cudnn_devprop_json(const fl_cudnn_api *api, const char *json, void **out, char *why, size_t n);
size_t fl_cudnn_plan_workspace(const fl_cudnn_plan *p);
/* the engine a plan runs (cuDNN's global index, -1 when not told) and *rank, its place in the heuristics' list */
int64_t fl_cudnn_plan_engine(const fl_cudnn_plan *p, int *rank);
void fl_cudnn_plan_free(const fl_cudnn_api *api, fl_cudnn_plan *p);
/* Runs a plan. ptr[uid] for each FL_CUDNN_UID_* the graph reads or writes (device pointers; SCALE
 * and NEG are taken from the plan itself), workspace of fl_cudnn_plan_workspace bytes. 0 or the
 * cuDNN status. */
int fl_cudnn_plan_run(const fl_cudnn_api *api, void *handle, fl_cudnn_plan *p, void *const ptr[FL_CUDNN_UID_COUNT],
                      void *workspace);

#ifdef __cplusplus
}
#endif
#endif

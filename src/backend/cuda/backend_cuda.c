/* The "cuda" backend (EXPERIMENTAL) on the libfitllm side: the calls go to the CUDA plugin
 * (src/backend/cuda/plugin/backend_cudart.c, opened by cu_loader.c), which says why when there is
 * no GPU to run on; and the real backend's sizes and op support, which the planner uses in any
 * build (a GPU run is planned anywhere). */
#include "backend/cuda/cuda-impl.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cu_plugin.h"
#include "backend/cuda/cudnn-impl.h"

fl_status fl_cuda_backend_init(fl_backend *be, int n_threads) {
    const fl_cuda_plugin *p;
    FL_TRY(fl_cuda_plugin_get(&p));
    return p->backend_init(be, n_threads);
}
void fl_cuda_backend_free(fl_backend *be) {
    const fl_cuda_plugin *p = fl_cuda_plugin_try(NULL, 0);
    if (p && be && be->impl) p->backend_free(be); /* a backend exists only where the plugin was loaded */
}
fl_status fl_cuda_backend_error(const fl_backend *be) {
    const fl_cuda_plugin *p = fl_cuda_plugin_try(NULL, 0);
    return p && be && be->impl ? p->backend_error(be) : FL_OK;
}

/* sizes of the real backend, for the planner (any build: a GPU run is planned anywhere) */
size_t fl_cuda_scratch_bytes(void) {
    return (size_t)FL_CUDA_LT_WS_BYTES + (size_t)FL_CUDA_PANEL_BYTES + (size_t)FL_CUDA_WORK_BYTES + 256;
}
unsigned fl_cuda_gemm_widens16(void) { return 1u << FL_F16; }

static int g_cudnn_here = -1; /* whether a cuDNN library loads on this machine: -1 not yet probed */
static void probe_cudnn(void) {
    fl_cudnn_api api;
    char why[256];
    g_cudnn_here = fl_cudnn_load(&api, NULL, why, sizeof why) == 0;
    if (g_cudnn_here) fl_cudnn_unload(&api);
}
size_t (*fl_cuda_planned_attn_scratch(void))(int B, int T, int NH, int NKV, int HD) {
    if (!fl_cudnn_attn_wants(fl_cudnn_attn_parse(getenv("FITLLM_CUDA_ATTN")))) return NULL;
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, probe_cudnn);
    return g_cudnn_here ? fl_cudnn_sdpa_scratch_bytes : NULL;
}

static int fl_float_dt(fl_dtype t) { return t == FL_F32 || t == FL_BF16 || t == FL_F16; }

int fl_cuda_supports_op(fl_op op, fl_dtype a, fl_dtype b, fl_dtype c) {
    switch (op) {
    case FL_OP_GEMM: /* cuBLASLt's bf16/fp16 tensor cores with fp32 accumulation, fp32, and the widened mixes */
        return (a == FL_F32 && b == FL_F32 && c == FL_F32) || (a == FL_BF16 && b == FL_BF16 && c == FL_F32) ||
               (a == FL_F32 && b == FL_BF16 && c == FL_F32) || (a == FL_BF16 && b == FL_BF16 && c == FL_BF16) ||
               (a == FL_F32 && b == FL_F16 && c == FL_F32) || (a == FL_F16 && b == FL_F16 && c == FL_F32);
    case FL_OP_CONVERT: return fl_float_dt(a) && fl_float_dt(b);
    case FL_OP_ADAMW:
    case FL_OP_SGD: return fl_float_dt(a) && fl_float_dt(b) && (c == FL_F32 || c == FL_BF16);
    case FL_OP_ADAM8BIT: return fl_adam8bit_dtype_ok(a) && fl_adam8bit_dtype_ok(b);
    case FL_OP_ACCUMULATE16: return a == FL_BF16 || a == FL_F16;
    case FL_OP_SUMSQ: return fl_float_dt(a);
    case FL_OP_Q4_MATMUL: return 1;
    case FL_OP_VOCAB_XENT: return a == FL_F32;
    /* cuBLASLt: C = D bf16, read with beta, compute and scale type fp32: D = bf16(alpha acc + beta C), rounded once */
    case FL_OP_GEMM_ACC16: return a == FL_BF16 && b == FL_BF16 && c == FL_BF16;
    default: return 0;
    }
}

/* The null backend ("null"): the planner's stand-in for a device (include/fitllm/backend.h).
 *
 * `fitllm plan` runs the trainer's real set-up and one real training step on it
 * (fl_trainer_rehearse, src/train/trainer.c) instead of replaying the allocations by hand:
 * every op and copy here returns at once without touching memory, and the pool hands out
 * fake addresses (never dereferenced, nothing reserved), so the real code's allocations reach
 * the accounting pool exactly as on the backend planned while a 70B plan costs no memory and
 * a few milliseconds. The facts that change what the model allocates are the planned
 * backend's: scratch_bytes (its op scratch), gemm_widens16 (the widened lm_head) and
 * host memory (FL_CAP_HOST_MEMORY: one pool for tensors and host staging, or a device pool beside a host one).
 *
 * What the host reads back is well defined: to_host writes zeros (losses of 0, a finite norm),
 * sumsq returns 0 and check_finite finds nothing, so the trainer's host logic (the loss, the
 * clipping, the loss scaler, the sampler) runs its ordinary path. supports_op is the planned
 * backend's (a plan refuses what that run would refuse at set-up, with the same message); the
 * registry's "null", standing in for nothing, says yes to everything. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"
#include "fitllm/comm.h"

typedef struct {
    uintptr_t next; /* the next fake address (one counter for every pool of this backend) */
    /* the supports_op of the backend it stands in for (fl_backend_facts); NULL: every op (the
     * registry's null, or a backend whose facts do not say) */
    int (*supports)(fl_op op, fl_dtype a, fl_dtype b, fl_dtype c);
    int mpi_scratch; /* its ranks' reductions take the MPI scratch (fl_null_backend_set_mpi_scratch) */
} nul;

/* 64-byte aligned, never dereferenced, in the upper half of the 64-bit space (NUL_BASE and up: no
 * x86-64 or AArch64 process maps an address there, a dereference faults, and no real host pointer
 * is ever mistaken for one, however much a plan allocates); allocations are disjoint ranges (the
 * communicator's argument checks compare a collective's send and receive ranges, as on any device) */
#define NUL_BASE ((uintptr_t)1 << 63)
static void *nul_alloc(size_t bytes, void *ud) {
    nul *n = ud;
    /* at least 64 apart: distinct even at 0 bytes; atomic: a plan's ranks are threads that may share this backend
     * (a plain += let two of them take overlapping ranges now and then: the communicator's overlap check failed) */
    return (void *)__atomic_fetch_add(&n->next, (bytes + 127) & ~(uintptr_t)63, __ATOMIC_RELAXED);
}

static void nul_free(void *p, size_t bytes, void *ud) { (void)p; (void)bytes; (void)ud; }

static fl_status nul_pool_init(const fl_backend *be, fl_mem_pool *p, const char *name, size_t budget) {
    /* FL_DEV_CUDA: fl_mem_calloc never memsets it (the bytes do not exist) */
    return fl_mem_pool_init_raw(p, name, FL_DEV_CUDA, budget, nul_alloc, nul_free, be->impl);
}

static fl_status n_gemm(const fl_backend *be, int ta, int tb, int M, int N, int K, float alpha, const void *A,
                        fl_dtype tA, int lda, const void *B, fl_dtype tB, int ldb, float beta, void *C, fl_dtype tC,
                        int ldc) {
    (void)be; (void)ta; (void)tb; (void)M; (void)N; (void)K; (void)alpha; (void)A; (void)tA; (void)lda; (void)B;
    (void)tB; (void)ldb; (void)beta; (void)C; (void)tC; (void)ldc;
    return FL_OK;
}
static void n_embedding_forward(const fl_backend *be, float *out, const int32_t *ids, const float *wte,
                                const float *wpe, int B, int T, int C) {
    (void)be; (void)out; (void)ids; (void)wte; (void)wpe; (void)B; (void)T; (void)C;
}
static void n_embedding_backward(const fl_backend *be, float *dwte, float *dwpe, const float *dout,
                                 const int32_t *ids, int B, int T, int C) {
    (void)be; (void)dwte; (void)dwpe; (void)dout; (void)ids; (void)B; (void)T; (void)C;
}
static void n_relbias_forward(const fl_backend *be, float *bias, const float *tab, const int32_t *rb, int NH, int Tq,
                              int Tk, int nb) {
    (void)be; (void)bias; (void)tab; (void)rb; (void)NH; (void)Tq; (void)Tk; (void)nb;
}
static fl_status n_relbias_backward(const fl_backend *be, float *dtab, const float *dbias, const int32_t *rb, int NH,
                                    int Tq, int Tk, int nb) {
    (void)be; (void)dtab; (void)dbias; (void)rb; (void)NH; (void)Tq; (void)Tk; (void)nb;
    return FL_OK;
}
static void n_rmsnorm_forward(const fl_backend *be, float *out, float *rstd, const float *inp, const float *w, int N,
                              int C, float eps) {
    (void)be; (void)out; (void)rstd; (void)inp; (void)w; (void)N; (void)C; (void)eps;
}
static void n_rmsnorm_backward(const fl_backend *be, float *dinp, float *dw, const float *dout, const float *inp,
                               const float *w, const float *rstd, int N, int C) {
    (void)be; (void)dinp; (void)dw; (void)dout; (void)inp; (void)w; (void)rstd; (void)N; (void)C;
}
static fl_status n_add_rmsnorm_forward(const fl_backend *be, void *res, void *out, float *rstd, const void *a,
                                       const void *b, const float *w, fl_dtype t, int N, int C, float eps) {
    (void)be; (void)res; (void)out; (void)rstd; (void)a; (void)b; (void)w; (void)t; (void)N; (void)C; (void)eps;
    return FL_OK;
}
static void n_layernorm_forward(const fl_backend *be, float *out, float *mean, float *rstd, const float *inp,
                                const float *w, const float *b, int N, int C, float eps) {
    (void)be; (void)out; (void)mean; (void)rstd; (void)inp; (void)w; (void)b; (void)N; (void)C; (void)eps;
}
static void n_layernorm_backward(const fl_backend *be, float *dinp, float *dw, float *db, const float *dout,
                                 const float *inp, const float *w, const float *mean, const float *rstd, int N,
                                 int C) {
    (void)be; (void)dinp; (void)dw; (void)db; (void)dout; (void)inp; (void)w; (void)mean; (void)rstd; (void)N;
    (void)C;
}
static void n_rope(const fl_backend *be, float *x, int B, int T, int nh, int HD, size_t row_stride,
                   const float *cos_t, const float *sin_t, int pos0) {
    (void)be; (void)x; (void)B; (void)T; (void)nh; (void)HD; (void)row_stride; (void)cos_t; (void)sin_t; (void)pos0;
}
static void n_swiglu_forward(const fl_backend *be, float *out, const float *gu, int N, int F) {
    (void)be; (void)out; (void)gu; (void)N; (void)F;
}
static void n_swiglu_backward(const fl_backend *be, float *dgu, const float *dout, const float *gu, int N, int F) {
    (void)be; (void)dgu; (void)dout; (void)gu; (void)N; (void)F;
}
static void n_gelu_forward(const fl_backend *be, float *out, const float *inp, size_t n) {
    (void)be; (void)out; (void)inp; (void)n;
}
static void n_gelu_backward(const fl_backend *be, float *dinp, const float *dout, const float *inp, size_t n) {
    (void)be; (void)dinp; (void)dout; (void)inp; (void)n;
}
static void n_add(const fl_backend *be, float *out, const float *a, const float *b, size_t n) {
    (void)be; (void)out; (void)a; (void)b; (void)n;
}
static void n_bias_forward(const fl_backend *be, float *y, const float *b, int N, int OC) {
    (void)be; (void)y; (void)b; (void)N; (void)OC;
}
static void n_bias_backward(const fl_backend *be, float *db, const float *dy, int N, int OC) {
    (void)be; (void)db; (void)dy; (void)N; (void)OC;
}
static void n_cross_entropy(const fl_backend *be, float *loss, float *dlogits, const float *logits,
                            const int32_t *targets, int N, int V, float grad_scale, int ignore_index) {
    (void)be; (void)loss; (void)dlogits; (void)logits; (void)targets; (void)N; (void)V; (void)grad_scale;
    (void)ignore_index;
}
static void n_scale(const fl_backend *be, float *x, size_t n, float s) { (void)be; (void)x; (void)n; (void)s; }
static void n_zero(const fl_backend *be, void *x, size_t bytes) { (void)be; (void)x; (void)bytes; }
static void n_attention_decode(const fl_backend *be, float *out, const float *q, const float *kcache,
                               const float *vcache, int T, int NH, int NKV, int HD, size_t head_stride) {
    (void)be; (void)out; (void)q; (void)kcache; (void)vcache; (void)T; (void)NH; (void)NKV; (void)HD;
    (void)head_stride;
}
static fl_status n_convert(const fl_backend *be, void *dst, fl_dtype dt, const void *src, fl_dtype st, size_t n) {
    (void)be; (void)dst; (void)dt; (void)src; (void)st; (void)n;
    return FL_OK;
}
static fl_status n_adamw_update(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg, void *m,
                                   void *v, fl_dtype ts, size_t n, float lr, float beta1, float beta2, float eps,
                                   float wd, int step, float grad_scale) {
    (void)be; (void)p; (void)tp; (void)g; (void)tg; (void)m; (void)v; (void)ts; (void)n; (void)lr; (void)beta1;
    (void)beta2; (void)eps; (void)wd; (void)step; (void)grad_scale;
    return FL_OK;
}
static fl_status n_sgd_update(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg, void *buf,
                                 fl_dtype ts, size_t n, float lr, float momentum, float dampening, float wd,
                                 int nesterov, int first_step, float grad_scale) {
    (void)be; (void)p; (void)tp; (void)g; (void)tg; (void)buf; (void)ts; (void)n; (void)lr; (void)momentum;
    (void)dampening; (void)wd; (void)nesterov; (void)first_step; (void)grad_scale;
    return FL_OK;
}
static fl_status n_check_finite(const fl_backend *be, const void *x, fl_dtype t, size_t n, float inv_scale,
                                int *found_inf) {
    (void)be; (void)x; (void)t; (void)n; (void)inv_scale; (void)found_inf; /* nothing found: left unchanged */
    return FL_OK;
}
static fl_status n_adam8bit_update(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg,
                                   const fl_adam8bit_state *st, float lr, float beta1, float beta2, float eps,
                                   float wd, int step, float grad_scale) {
    (void)be; (void)p; (void)tp; (void)g; (void)tg; (void)st; (void)lr; (void)beta1; (void)beta2; (void)eps;
    (void)wd; (void)step; (void)grad_scale;
    return FL_OK;
}
static fl_status n_q4_matmul_forward(const fl_backend *be, float *y, int ldy, const float *x, const fl_q4_weight *w,
                                     int N, float beta) {
    (void)be; (void)y; (void)ldy; (void)x; (void)w; (void)N; (void)beta;
    return FL_OK;
}
static fl_status n_q4_matmul_backward(const fl_backend *be, float *dx, const float *dy, int ldy,
                                      const fl_q4_weight *w, int N, float beta) {
    (void)be; (void)dx; (void)dy; (void)ldy; (void)w; (void)N; (void)beta;
    return FL_OK;
}
/* FL_CAP_Q4X16's 4-bit matmuls over bf16 inputs, where the planned backend has them */
static fl_status n_q4_matmul_forward16(const fl_backend *be, float *y, int ldy, const void *x16, const fl_q4_weight *w,
                                       int nw, int N, float beta) {
    (void)be; (void)y; (void)ldy; (void)x16; (void)w; (void)nw; (void)N; (void)beta;
    return FL_OK;
}
static fl_status n_q4_matmul_backward16(const fl_backend *be, float *dx, const void *dy16, int ldy,
                                        const fl_q4_weight *w, int nw, int N, float beta) {
    (void)be; (void)dx; (void)dy16; (void)ldy; (void)w; (void)nw; (void)N; (void)beta;
    return FL_OK;
}
static fl_status n_lora_forward(const fl_backend *be, float *y, int ldy, float *h, float *xd, const float *x,
                                const float *A, const float *B, int N, int in, int out, int r, float scaling,
                                float dropout, uint64_t seed) {
    (void)be; (void)y; (void)ldy; (void)h; (void)xd; (void)x; (void)A; (void)B; (void)N; (void)in; (void)out;
    (void)r; (void)scaling; (void)dropout; (void)seed;
    return FL_OK;
}
static fl_status n_lora_backward(const fl_backend *be, float *dx, float *dA, float *dB, const float *dy, int ldy,
                                 const float *xb, const float *h, const float *A, const float *B, int N, int in,
                                 int out, int r, float scaling, float dropout, uint64_t seed, float *work) {
    (void)be; (void)dx; (void)dA; (void)dB; (void)dy; (void)ldy; (void)xb; (void)h; (void)A; (void)B; (void)N;
    (void)in; (void)out; (void)r; (void)scaling; (void)dropout; (void)seed; (void)work;
    return FL_OK;
}
static fl_status n_dropout(const fl_backend *be, float *y, const float *x, size_t n, float p, uint64_t seed,
                          int accumulate) {
    (void)be; (void)y; (void)x; (void)n; (void)p; (void)seed; (void)accumulate;
    return FL_OK;
}
static fl_status n_dropout_rows(const fl_backend *be, float *y, const float *x, int rows, size_t w, size_t stride,
                               float p, uint64_t seed, int accumulate) {
    (void)be; (void)y; (void)x; (void)rows; (void)w; (void)stride; (void)p; (void)seed; (void)accumulate;
    return FL_OK;
}
static fl_status n_vocab_stats(const fl_backend *be, double *stats, const float *logits, const int32_t *targets,
                               int rows, int n, int lo) {
    (void)be; (void)stats; (void)logits; (void)targets; (void)rows; (void)n; (void)lo;
    return FL_OK;
}
static fl_status n_vocab_xent(const fl_backend *be, float *loss, float *dlogits, const float *logits, const double *all,
                              const int32_t *targets, int rows, int n, int lo, int P, int me, int V, float grad_scale,
                              int ignore_index) {
    (void)be; (void)loss; (void)dlogits; (void)logits; (void)all; (void)targets; (void)rows; (void)n; (void)lo;
    (void)P; (void)me; (void)V; (void)grad_scale; (void)ignore_index;
    return FL_OK;
}
static fl_status n_accumulate16(const fl_backend *be, uint16_t *dst, fl_dtype t, const float *src, size_t n) {
    (void)be; (void)dst; (void)t; (void)src; (void)n;
    return FL_OK;
}
static double n_sumsq(const fl_backend *be, const void *x, fl_dtype t, size_t n) {
    (void)be; (void)x; (void)t; (void)n;
    return 0.0;
}
static fl_status n_attention_forward(const fl_backend *be, const fl_attn_desc *a, float *out, float *lse,
                                        const float *q, const float *k, const float *v, const float *bias,
                                        const uint8_t *kmask) {
    (void)be; (void)a; (void)out; (void)lse; (void)q; (void)k; (void)v; (void)bias; (void)kmask;
    return FL_OK;
}
static fl_status n_attention_backward(const fl_backend *be, const fl_attn_desc *a, float *dq, float *dk, float *dv,
                                         float *dbias, const float *dout, const float *q, const float *k,
                                         const float *v, const float *bias, const uint8_t *kmask, const float *out,
                                         const float *lse) {
    (void)be; (void)a; (void)dq; (void)dk; (void)dv; (void)dbias; (void)dout; (void)q; (void)k; (void)v; (void)bias;
    (void)kmask; (void)out; (void)lse;
    return FL_OK;
}
static void n_set_scratch(const fl_backend *be, void *p, size_t bytes) { (void)be; (void)p; (void)bytes; }
static fl_status n_to_device(const fl_backend *be, void *dst, const void *src, size_t bytes) {
    (void)be; (void)dst; (void)src; (void)bytes;
    return FL_OK;
}
/* the host side is real memory: what the host reads back is zeros; except into this backend's own
 * fake addresses (a planned offload's host tier, host_pool_init), which nobody may touch */
static fl_status n_to_host(const fl_backend *be, void *dst, const void *src, size_t bytes) {
    (void)src;
    (void)be;
    if ((uintptr_t)dst >= NUL_BASE) return FL_OK;
    if (bytes) memset(dst, 0, bytes);
    return FL_OK;
}
static fl_status n_copy(const fl_backend *be, void *dst, const void *src, size_t bytes) {
    (void)be; (void)dst; (void)src; (void)bytes;
    return FL_OK;
}
static fl_status n_sync(const fl_backend *be) {
    (void)be;
    return FL_OK;
}
/* standing in for a backend: its supports_op (a plan refuses what the run would refuse at set-up); the
 * registry's null (planned NULL) supports everything */
static int n_supports_op(const fl_backend *be, fl_op op, fl_dtype a, fl_dtype b, fl_dtype c) {
    const nul *n = be->impl;
    return n->supports ? n->supports(op, a, b, c) : 1;
}
static fl_status n_rope_tables(const fl_backend *be, float *cos_t, float *sin_t, int maxT, int HD, float theta,
                               const fl_rope_scaling *scaling) {
    (void)be; (void)cos_t; (void)sin_t; (void)maxT; (void)HD; (void)theta; (void)scaling;
    return FL_OK;
}

/* several ranks: the null communicator over the host one (its collectives move nothing; the planned
 * MPI run's scratch when asked) */
static fl_status n_comm_create(const fl_backend *be, struct fl_comm *host, struct fl_comm **out) {
    const nul *n = be->impl;
    return fl_comm_null_create(host, n->mpi_scratch, out);
}

void fl_null_backend_set_mpi_scratch(fl_backend *be, int on) {
    if (be && be->impl && be->comm_create == n_comm_create) ((nul *)be->impl)->mpi_scratch = on;
}

fl_status fl_null_backend_init_for(fl_backend *be, const char *planned) {
    if (!be) return fl_errorf(FL_ERR_INVALID, "fl_null_backend_init: NULL backend");
    memset(be, 0, sizeof *be);
    /* the planned backend's facts (plan --accelerator cuda: the GPU's, without a GPU); none: the
     * registry's null's. Standing in for host memory (the CPU): one pool (only fl_trainer_rehearse
     * runs on this: code paths that write tensors through host pointers, a LoRA merge, a loader,
     * would fault) */
    fl_backend_facts f;
    FL_TRY(fl_backend_facts_of(planned ? planned : "null", &f));
    if (planned && (f.caps & FL_CAP_DISCARDS))
        return fl_errorf(FL_ERR_INVALID, "null backend: cannot stand in for '%s' (itself)", planned);
    nul *n = calloc(1, sizeof *n);
    if (!n) return fl_errorf(FL_ERR_OOM, "null backend: out of host memory");
    n->next = NUL_BASE;
    n->supports = f.supports_op;
    be->name = "null"; /* the registry finds its free function by name (fl_backend_free) */
    be->device = f.device;
    be->n_threads = 1;
    be->gemm_name = "none";
    be->gemm_widens16 = f.gemm_widens16;
    be->scratch_bytes = f.scratch_bytes;
    be->attn_scratch_bytes = f.attn_scratch_bytes; /* the planned GPU's cuDNN attention copies */
    /* FL_CAP_VIEWS16: the fp32 views the planned backend does not carve; FL_CAP_COMPUTE_BF16: a frozen base's bf16 dy
     * scratch it carves (acts.c) */
    be->caps = (f.caps & (FL_CAP_HOST_MEMORY | FL_CAP_VIEWS16 | FL_CAP_STREAM16 | FL_CAP_COMPUTE_BF16 | FL_CAP_Q4X16)) |
               FL_CAP_DISCARDS;
    be->impl = n;
    be->gemm = n_gemm;
    be->embedding_forward = n_embedding_forward;
    be->embedding_backward = n_embedding_backward;
    be->relbias_forward = n_relbias_forward;
    be->relbias_backward = n_relbias_backward;
    be->rmsnorm_forward = n_rmsnorm_forward;
    be->rmsnorm_backward = n_rmsnorm_backward;
    be->add_rmsnorm_forward = n_add_rmsnorm_forward;
    be->layernorm_forward = n_layernorm_forward;
    be->layernorm_backward = n_layernorm_backward;
    be->rope_forward = n_rope;
    be->rope_backward = n_rope;
    be->attention_forward = n_attention_forward;
    be->attention_backward = n_attention_backward;
    be->swiglu_forward = n_swiglu_forward;
    be->swiglu_backward = n_swiglu_backward;
    be->gelu_forward = n_gelu_forward;
    be->gelu_backward = n_gelu_backward;
    be->relu_forward = n_gelu_forward; /* the same signature, the same nothing */
    be->relu_backward = n_gelu_backward;
    be->gelu_erf_forward = n_gelu_forward;
    be->gelu_erf_backward = n_gelu_backward;
    be->geglu_forward = n_swiglu_forward; /* the same signature, the same nothing */
    be->geglu_backward = n_swiglu_backward;
    be->add = n_add;
    be->bias_forward = n_bias_forward;
    be->bias_backward = n_bias_backward;
    be->cross_entropy = n_cross_entropy;
    be->adamw_update = n_adamw_update;
    be->sgd_update = n_sgd_update;
    be->sumsq = n_sumsq;
    be->scale = n_scale;
    be->zero = n_zero;
    be->attention_decode = n_attention_decode;
    be->convert = n_convert;
    be->check_finite = n_check_finite;
    be->adam8bit_update = n_adam8bit_update;
    be->q4_matmul_forward = n_q4_matmul_forward;
    be->q4_matmul_backward = n_q4_matmul_backward;
    be->q4_matmul_forward16 = be->caps & FL_CAP_Q4X16 ? n_q4_matmul_forward16 : NULL;
    be->q4_matmul_backward16 = be->caps & FL_CAP_Q4X16 ? n_q4_matmul_backward16 : NULL;
    be->lora_forward = n_lora_forward;
    be->lora_backward = n_lora_backward;
    be->dropout = n_dropout;
    be->dropout_rows = n_dropout_rows;
    be->vocab_stats = n_vocab_stats;
    be->vocab_xent = n_vocab_xent;
    be->accumulate16 = n_accumulate16;
    be->set_scratch = n_set_scratch;
    be->to_device = n_to_device;
    be->to_host = n_to_host;
    be->copy = n_copy;
    be->sync = n_sync;
    be->supports_op = n_supports_op;
    be->run = fl_backend_run_slots;
    be->rope_tables = n_rope_tables;
    be->pool_init = nul_pool_init;
    be->host_pool_init = nul_pool_init; /* the host tier of a planned offload: counted, never touched */
    be->comm_create = n_comm_create;
    return FL_OK;
}

fl_status fl_null_backend_init(fl_backend *be, int n_threads) {
    (void)n_threads;
    return fl_null_backend_init_for(be, NULL);
}

void fl_null_backend_free(fl_backend *be) {
    if (!be || !be->impl) return;
    free(be->impl);
    memset(be, 0, sizeof *be);
}

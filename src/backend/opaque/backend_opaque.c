/* The opaque test backend ("opaque"): the CPU kernels over memory the host cannot read.
 *
 * Its pool (pool_init) hands out addresses in ONE reserved range of the address space, the
 * handles (mmap PROT_NONE, MAP_NORESERVE), that is never made readable: the bytes live in a
 * second reservation of the same size, the storage, at the same offset. Each op translates its
 * pointer arguments that lie in the handle range (and those inside fl_q4_weight and
 * fl_adam8bit_state) to the storage and calls the CPU op there. So any host dereference of tensor
 * memory outside the backend (model/, train/, io/, generation, lab) faults at the line that did it,
 * as a device pointer would on a GPU, on any thread at any time (also while another thread's op
 * runs), with no system call per op; and the results are bit-identical to "cpu" (the same kernels
 * with the same thread count). docs/ARCHITECTURE.md "The opaque test backend" has the design and
 * what it does not catch.
 *
 * Allocation is page-granular first fit over the range; the storage is made read-write as the
 * range grows (one mprotect per growth, never per op); a freed block's storage pages go back to
 * the system (MADV_DONTNEED: they read as zeros when reused). Pointers outside the range (host
 * buffers of the op tests, the host-pointer arguments of the contract: check_finite's flag)
 * pass through unchanged. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fitllm/adam8bit.h"
#include "fitllm/backend.h"
#include "fitllm/comm_nccl.h"
#include "fitllm/quant4.h"

#define OPQ_RESERVE ((size_t)1 << 38) /* 256 GiB of address space each for handles and storage (no memory until used) */

typedef struct {
    size_t off, size; /* bytes from base, page multiples */
    int used;
} opq_block;

typedef struct {
    fl_backend cpu;         /* the CPU backend whose kernels run */
    pthread_mutex_t mu;
    char *base;             /* the handles: the reserved range the pool hands out, PROT_NONE for ever */
    char *mem;              /* the storage: handle base + off is mem + off; [mem, mem + top) read-write */
    size_t top;             /* [base, base + top) is the part blocks have ever covered */
    opq_block *blk;         /* sorted by off, covering [0, top) */
    int nblk, capblk;
    int n_used;             /* live blocks */
    int dead;               /* the backend was freed: release the range with the last block */
} opq;

static size_t page_size(void) {
    static size_t ps;
    if (!ps) ps = (size_t)sysconf(_SC_PAGESIZE);
    return ps;
}

/* The storage address of p: a handle of this instance maps to its storage, anything else (host
 * memory, NULL) is returned as it is. */
static void *opq_at(const opq *o, const void *p) {
    const uintptr_t c = (uintptr_t)p, b = (uintptr_t)o->base;
    return c >= b && c - b < OPQ_RESERVE ? o->mem + (c - b) : (void *)c;
}

static void opq_unregister(opq *o);

static void opq_release(opq *o) {
    opq_unregister(o);
    munmap(o->base, OPQ_RESERVE);
    munmap(o->mem, OPQ_RESERVE);
    free(o->blk);
    pthread_mutex_destroy(&o->mu);
    fl_cpu_backend_free(&o->cpu);
    free(o);
}

/* ---- the device communicator: the NCCL stand-in over the ranks' storage ----
 *
 * Several ranks (threads, each with its own opaque backend and range) run data-parallel training
 * through the NCCL communicator (src/comm/comm_nccl.c) over the CPU stand-in, as "cuda-emu" does.
 * A collective copies between the ranks' ranges on whichever thread progresses it, so each
 * collective's buffers are translated to the storage of the instance that owns them when it is
 * posted (a registry of the live instances); the stand-in then moves bytes between storages only.
 * Host code still faults on any rank's handles at any time, and a collective handed a host buffer
 * is refused (ncclInvalidArgument), as a GPU's NCCL would fail. */
static pthread_mutex_t g_reg_mu = PTHREAD_MUTEX_INITIALIZER;
static opq **g_reg;
static int g_nreg, g_capreg;

static void opq_register(opq *o) {
    pthread_mutex_lock(&g_reg_mu);
    if (g_nreg == g_capreg) {
        int cap = g_capreg ? 2 * g_capreg : 8;
        opq **n = realloc(g_reg, (size_t)cap * sizeof *n);
        if (n) g_reg = n, g_capreg = cap;
    }
    if (g_nreg < g_capreg) g_reg[g_nreg++] = o;
    pthread_mutex_unlock(&g_reg_mu);
}

static void opq_unregister(opq *o) {
    pthread_mutex_lock(&g_reg_mu);
    for (int i = 0; i < g_nreg; i++)
        if (g_reg[i] == o) {
            g_reg[i] = g_reg[--g_nreg];
            break;
        }
    pthread_mutex_unlock(&g_reg_mu);
}

/* Whether p is device memory of some live instance (a GPU's NCCL takes device buffers only: a host
 * buffer handed to the device communicator is a bug the stand-in alone would not see); if so, *at
 * is its storage address. */
static int in_some_range(const void *p, void **at) {
    const char *c = p;
    int in = 0;
    pthread_mutex_lock(&g_reg_mu);
    for (int i = 0; i < g_nreg && !in; i++) {
        opq *o = g_reg[i];
        pthread_mutex_lock(&o->mu);
        in = c >= o->base && c < o->base + o->top;
        pthread_mutex_unlock(&o->mu);
        if (in) *at = opq_at(o, p);
    }
    pthread_mutex_unlock(&g_reg_mu);
    return in;
}
/* the buffers of a collective of `count` elements: device memory (NULL: a non-root's absent recv),
 * translated to their storage in place */
#define DEV_ARGS(send, recv, count)                                                                   \
    do {                                                                                              \
        void *s_ = (void *)(send), *r_ = (recv);                                                      \
        if ((count) && ((s_ && !in_some_range(s_, &s_)) || (r_ && !in_some_range(r_, &r_))))          \
            return FL_NCCL_INVALID_ARGUMENT;                                                          \
        send = s_;                                                                                    \
        recv = r_;                                                                                    \
    } while (0)

#define SI fl_nccl_standin_api()
static int x_all_reduce(const void *send, void *recv, size_t count, int dtype, int op, void *comm, void *stream) {
    DEV_ARGS(send, recv, count);
    return SI->all_reduce(send, recv, count, dtype, op, comm, stream);
}
static int x_reduce_scatter(const void *send, void *recv, size_t n, int dtype, int op, void *comm, void *stream) {
    DEV_ARGS(send, recv, n);
    return SI->reduce_scatter(send, recv, n, dtype, op, comm, stream);
}
static int x_all_gather(const void *send, void *recv, size_t n, int dtype, void *comm, void *stream) {
    DEV_ARGS(send, recv, n);
    return SI->all_gather(send, recv, n, dtype, comm, stream);
}
static int x_broadcast(const void *send, void *recv, size_t count, int dtype, int root, void *comm, void *stream) {
    DEV_ARGS(send, recv, count);
    return SI->broadcast(send, recv, count, dtype, root, comm, stream);
}
static int x_reduce(const void *send, void *recv, size_t count, int dtype, int op, int root, void *comm, void *stream) {
    DEV_ARGS(send, recv, count);
    return SI->reduce(send, recv, count, dtype, op, root, comm, stream);
}

static fl_nccl_api g_api;
static void init_api(void) {
    g_api = *SI; /* the stand-in's ids, streams and events; the collectives' buffers translated */
    g_api.name = "nccl-standin (opaque)";
    g_api.all_reduce = x_all_reduce;
    g_api.reduce_scatter = x_reduce_scatter;
    g_api.all_gather = x_all_gather;
    g_api.broadcast = x_broadcast;
    g_api.reduce = x_reduce;
}

static int g_use_comm = 1;
void fl_opaque_use_comm(int on) { g_use_comm = on; }

static fl_status opq_comm_create(const fl_backend *be, struct fl_comm *host, struct fl_comm **out) {
    if (g_use_comm == 2) return fl_backend_comm_staged(be, host, out); /* through host buffers, by its copies */
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, init_api);
    return fl_comm_nccl_create(host, &g_api, NULL, out);
}

static int blk_insert(opq *o, int at, opq_block b) {
    if (o->nblk == o->capblk) {
        int cap = o->capblk ? 2 * o->capblk : 64;
        opq_block *n = realloc(o->blk, (size_t)cap * sizeof *n);
        if (!n) return -1;
        o->blk = n;
        o->capblk = cap;
    }
    memmove(o->blk + at + 1, o->blk + at, (size_t)(o->nblk - at) * sizeof *o->blk);
    o->blk[at] = b;
    o->nblk++;
    return 0;
}

static void blk_remove(opq *o, int at) {
    memmove(o->blk + at, o->blk + at + 1, (size_t)(o->nblk - at - 1) * sizeof *o->blk);
    o->nblk--;
}

static void *opq_alloc(size_t bytes, void *ud) {
    opq *o = ud;
    const size_t ps = page_size();
    size_t n = bytes ? (bytes + ps - 1) / ps * ps : ps;
    void *r = NULL;
    pthread_mutex_lock(&o->mu);
    for (int i = 0; i < o->nblk && !r; i++) { /* first fit among freed blocks */
        opq_block *b = &o->blk[i];
        if (b->used || b->size < n) continue;
        if (b->size > n && blk_insert(o, i + 1, (opq_block){b->off + n, o->blk[i].size - n, 0}) != 0) break;
        b = &o->blk[i];
        b->size = n;
        b->used = 1;
        r = o->base + b->off;
    }
    /* the range grows: its storage becomes read-write (the handles never do) */
    if (!r && o->top + n <= OPQ_RESERVE && mprotect(o->mem + o->top, n, PROT_READ | PROT_WRITE) == 0 &&
        blk_insert(o, o->nblk, (opq_block){o->top, n, 1}) == 0) {
        r = o->base + o->top;
        o->top += n;
    }
    if (r) o->n_used++;
    pthread_mutex_unlock(&o->mu);
    return r;
}

static void opq_free(void *ptr, size_t bytes, void *ud) {
    (void)bytes;
    opq *o = ud;
    int release = 0;
    pthread_mutex_lock(&o->mu);
    size_t off = (size_t)((char *)ptr - o->base);
    for (int i = 0; i < o->nblk; i++) {
        if (o->blk[i].off != off || !o->blk[i].used) continue;
        madvise(o->mem + off, o->blk[i].size, MADV_DONTNEED); /* the pages go back; reused ones read as 0 */
        o->blk[i].used = 0;
        if (i + 1 < o->nblk && !o->blk[i + 1].used) {
            o->blk[i].size += o->blk[i + 1].size;
            blk_remove(o, i + 1);
        }
        if (i > 0 && !o->blk[i - 1].used) {
            o->blk[i - 1].size += o->blk[i].size;
            blk_remove(o, i);
        }
        o->n_used--;
        break;
    }
    release = o->dead && o->n_used == 0;
    pthread_mutex_unlock(&o->mu);
    if (release) opq_release(o);
}

static fl_status opq_pool_init(const fl_backend *be, fl_mem_pool *p, const char *name, size_t budget) {
    return fl_mem_pool_init_raw(p, name, FL_DEV_CPU, budget, opq_alloc, opq_free, be->impl);
}

/* the host tier (CPU offload): ordinary host memory, which its copies read and write as any host buffer */
static fl_status opq_host_pool_init(const fl_backend *be, fl_mem_pool *p, const char *name, size_t budget) {
    (void)be;
    return fl_mem_pool_init(p, name, budget);
}

/* ---- the ops: the CPU op on the storage of its pointer arguments --------------------------- */

#define IN (&((opq *)be->impl)->cpu)
#define D(p) opq_at((const opq *)be->impl, (p))

/* the pointers inside the 4-bit weight and the 8-bit optimizer state, to their storage */
static const fl_q4_weight *q4_at(const fl_backend *be, const fl_q4_weight *w, fl_q4_weight *tmp) {
    if (!w) return NULL;
    *tmp = *w;
    tmp->packed = D(w->packed);
    tmp->absmax = D(w->absmax);
    tmp->q_absmax = D(w->q_absmax);
    tmp->absmax_scale = D(w->absmax_scale);
    tmp->offset = D(w->offset);
    tmp->row_start = D(w->row_start);
    return tmp;
}
static const fl_adam8bit_state *a8_at(const fl_backend *be, const fl_adam8bit_state *st, fl_adam8bit_state *tmp) {
    if (!st) return NULL;
    *tmp = *st;
    tmp->q_m = D(st->q_m);
    tmp->q_v = D(st->q_v);
    tmp->absmax_m = D(st->absmax_m);
    tmp->absmax_v = D(st->absmax_v);
    tmp->m = D(st->m);
    tmp->v = D(st->v);
    tmp->floor_m = D(st->floor_m);
    tmp->floor_v = D(st->floor_v);
    return tmp;
}

static fl_status op_gemm(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                         const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta,
                         void *C, fl_dtype tc, int ldc) {
    return IN->gemm(IN, trans_a, trans_b, M, N, K, alpha, D(A), ta, lda, D(B), tb, ldb, beta, D(C), tc, ldc);
}
static void op_embedding_forward(const fl_backend *be, float *out, const int32_t *ids, const float *wte,
                                 const float *wpe, int B, int T, int C) {
    IN->embedding_forward(IN, D(out), D(ids), D(wte), D(wpe), B, T, C);
}
static void op_embedding_backward(const fl_backend *be, float *dwte, float *dwpe, const float *dout,
                                  const int32_t *ids, int B, int T, int C) {
    IN->embedding_backward(IN, D(dwte), D(dwpe), D(dout), D(ids), B, T, C);
}
static void op_relbias_forward(const fl_backend *be, float *bias, const float *tab, const int32_t *rb, int NH, int Tq,
                               int Tk, int nb) {
    IN->relbias_forward(IN, D(bias), D(tab), D(rb), NH, Tq, Tk, nb);
}
static fl_status op_relbias_backward(const fl_backend *be, float *dtab, const float *dbias, const int32_t *rb, int NH,
                                     int Tq, int Tk, int nb) {
    return IN->relbias_backward(IN, D(dtab), D(dbias), D(rb), NH, Tq, Tk, nb);
}
static void op_rmsnorm_forward(const fl_backend *be, float *out, float *rstd, const float *inp, const float *w, int N,
                               int C, float eps) {
    IN->rmsnorm_forward(IN, D(out), D(rstd), D(inp), D(w), N, C, eps);
}
static fl_status op_add_rmsnorm_forward(const fl_backend *be, void *res, void *out, float *rstd, const void *a,
                                        const void *b, const float *w, fl_dtype t, int N, int C, float eps) {
    return IN->add_rmsnorm_forward(IN, D(res), D(out), D(rstd), D(a), D(b), D(w), t, N, C, eps);
}
static fl_status op_add_norm_forward16(const fl_backend *be, int ln, float *res, void *res16, float *out, void *out16,
                                       float *mean, float *rstd, const float *a, const float *b, const void *w,
                                       const void *bias, fl_dtype wt, int N, int C, float eps) {
    return IN->add_norm_forward16(IN, ln, D(res), D(res16), D(out), D(out16), D(mean), D(rstd), D(a), D(b), D(w),
                                  D(bias), wt, N, C, eps);
}
static void op_rmsnorm_backward(const fl_backend *be, float *dinp, float *dw, const float *dout, const float *inp,
                                const float *w, const float *rstd, int N, int C) {
    IN->rmsnorm_backward(IN, D(dinp), D(dw), D(dout), D(inp), D(w), D(rstd), N, C);
}
static void op_layernorm_forward(const fl_backend *be, float *out, float *mean, float *rstd, const float *inp,
                                 const float *w, const float *b, int N, int C, float eps) {
    IN->layernorm_forward(IN, D(out), D(mean), D(rstd), D(inp), D(w), D(b), N, C, eps);
}
static void op_layernorm_backward(const fl_backend *be, float *dinp, float *dw, float *db, const float *dout,
                                  const float *inp, const float *w, const float *mean, const float *rstd, int N,
                                  int C) {
    IN->layernorm_backward(IN, D(dinp), D(dw), D(db), D(dout), D(inp), D(w), D(mean), D(rstd), N, C);
}
static void op_rope_forward(const fl_backend *be, float *x, int B, int T, int nh, int HD, size_t row_stride,
                            const float *cos_t, const float *sin_t, int pos0) {
    IN->rope_forward(IN, D(x), B, T, nh, HD, row_stride, D(cos_t), D(sin_t), pos0);
}
static void op_rope_backward(const fl_backend *be, float *dx, int B, int T, int nh, int HD, size_t row_stride,
                             const float *cos_t, const float *sin_t, int pos0) {
    IN->rope_backward(IN, D(dx), B, T, nh, HD, row_stride, D(cos_t), D(sin_t), pos0);
}
static void op_swiglu_forward(const fl_backend *be, float *out, const float *gu, int N, int F) {
    IN->swiglu_forward(IN, D(out), D(gu), N, F);
}
static void op_swiglu_backward(const fl_backend *be, float *dgu, const float *dout, const float *gu, int N, int F) {
    IN->swiglu_backward(IN, D(dgu), D(dout), D(gu), N, F);
}
static void op_gelu_forward(const fl_backend *be, float *out, const float *inp, size_t n) {
    IN->gelu_forward(IN, D(out), D(inp), n);
}
static void op_gelu_backward(const fl_backend *be, float *dinp, const float *dout, const float *inp, size_t n) {
    IN->gelu_backward(IN, D(dinp), D(dout), D(inp), n);
}
static void op_geglu_forward(const fl_backend *be, float *out, const float *gu, int N, int F) {
    IN->geglu_forward(IN, D(out), D(gu), N, F);
}
static void op_geglu_backward(const fl_backend *be, float *dgu, const float *dout, const float *gu, int N, int F) {
    IN->geglu_backward(IN, D(dgu), D(dout), D(gu), N, F);
}
static void op_relu_forward(const fl_backend *be, float *out, const float *inp, size_t n) {
    IN->relu_forward(IN, D(out), D(inp), n);
}
static void op_relu_backward(const fl_backend *be, float *dinp, const float *dout, const float *inp, size_t n) {
    IN->relu_backward(IN, D(dinp), D(dout), D(inp), n);
}
static void op_gelu_erf_forward(const fl_backend *be, float *out, const float *inp, size_t n) {
    IN->gelu_erf_forward(IN, D(out), D(inp), n);
}
static void op_gelu_erf_backward(const fl_backend *be, float *dinp, const float *dout, const float *inp, size_t n) {
    IN->gelu_erf_backward(IN, D(dinp), D(dout), D(inp), n);
}
static void op_add(const fl_backend *be, float *out, const float *a, const float *b, size_t n) {
    IN->add(IN, D(out), D(a), D(b), n);
}
static void op_bias_forward(const fl_backend *be, float *y, const float *b, int N, int OC) {
    IN->bias_forward(IN, D(y), D(b), N, OC);
}
static void op_bias_backward(const fl_backend *be, float *db, const float *dy, int N, int OC) {
    IN->bias_backward(IN, D(db), D(dy), N, OC);
}
static void op_cross_entropy(const fl_backend *be, float *loss, float *dlogits, const float *logits,
                             const int32_t *targets, int N, int V, float grad_scale, int ignore_index) {
    IN->cross_entropy(IN, D(loss), D(dlogits), D(logits), D(targets), N, V, grad_scale, ignore_index);
}
static void op_scale(const fl_backend *be, float *x, size_t n, float s) { IN->scale(IN, D(x), n, s); }
static void op_zero(const fl_backend *be, void *x, size_t bytes) { IN->zero(IN, D(x), bytes); }
static void op_attention_decode(const fl_backend *be, float *out, const float *q, const float *kcache,
                                const float *vcache, int T, int NH, int NKV, int HD, size_t head_stride) {
    IN->attention_decode(IN, D(out), D(q), D(kcache), D(vcache), T, NH, NKV, HD, head_stride);
}
static fl_status op_convert(const fl_backend *be, void *dst, fl_dtype dt, const void *src, fl_dtype st, size_t n) {
    return IN->convert(IN, D(dst), dt, D(src), st, n);
}
static fl_status op_adamw_update(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg, void *m,
                                    void *v, fl_dtype ts, size_t n, float lr, float beta1, float beta2, float eps,
                                    float weight_decay, int step, float grad_scale) {
    return IN->adamw_update(IN, D(p), tp, D(g), tg, D(m), D(v), ts, n, lr, beta1, beta2, eps, weight_decay, step,
                            grad_scale);
}
static fl_status op_sgd_update(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg, void *buf,
                                  fl_dtype ts, size_t n, float lr, float momentum, float dampening,
                                  float weight_decay, int nesterov, int first_step, float grad_scale) {
    return IN->sgd_update(IN, D(p), tp, D(g), tg, D(buf), ts, n, lr, momentum, dampening, weight_decay, nesterov,
                          first_step, grad_scale);
}
static fl_status op_check_finite(const fl_backend *be, const void *x, fl_dtype t, size_t n, float inv_scale,
                                 int *found_inf) {
    return IN->check_finite(IN, D(x), t, n, inv_scale, D(found_inf));
}
static fl_status op_adam8bit_update(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg,
                                    const fl_adam8bit_state *st, float lr, float beta1, float beta2, float eps,
                                    float weight_decay, int step, float grad_scale) {
    fl_adam8bit_state s;
    return IN->adam8bit_update(IN, D(p), tp, D(g), tg, a8_at(be, st, &s), lr, beta1, beta2, eps, weight_decay, step,
                               grad_scale);
}
static fl_status op_q4_matmul_forward(const fl_backend *be, float *y, int ldy, const float *x, const fl_q4_weight *w,
                                      int N, float beta) {
    fl_q4_weight q;
    return IN->q4_matmul_forward(IN, D(y), ldy, D(x), q4_at(be, w, &q), N, beta);
}
static fl_status op_q4_matmul_backward(const fl_backend *be, float *dx, const float *dy, int ldy,
                                       const fl_q4_weight *w, int N, float beta) {
    fl_q4_weight q;
    return IN->q4_matmul_backward(IN, D(dx), D(dy), ldy, q4_at(be, w, &q), N, beta);
}
static fl_status op_lora_forward(const fl_backend *be, float *y, int ldy, float *h, float *xd, const float *x,
                                 const float *A, const float *B, int N, int in, int out, int r, float scaling,
                                 float dropout, uint64_t seed) {
    return IN->lora_forward(IN, D(y), ldy, D(h), D(xd), D(x), D(A), D(B), N, in, out, r, scaling, dropout, seed);
}
static fl_status op_lora_backward(const fl_backend *be, float *dx, float *dA, float *dB, const float *dy, int ldy,
                                  const float *xb, const float *h, const float *A, const float *B, int N, int in,
                                  int out, int r, float scaling, float dropout, uint64_t seed, float *work) {
    return IN->lora_backward(IN, D(dx), D(dA), D(dB), D(dy), ldy, D(xb), D(h), D(A), D(B), N, in, out, r, scaling,
                             dropout, seed, D(work));
}
static fl_status op_dropout(const fl_backend *be, float *y, const float *x, size_t n, float p, uint64_t seed,
                           int accumulate) {
    return IN->dropout(IN, D(y), D(x), n, p, seed, accumulate);
}
static fl_status op_dropout_rows(const fl_backend *be, float *y, const float *x, int rows, size_t w, size_t stride,
                                float p, uint64_t seed, int accumulate) {
    return IN->dropout_rows(IN, D(y), D(x), rows, w, stride, p, seed, accumulate);
}
static fl_status op_vocab_stats(const fl_backend *be, double *stats, const float *logits, const int32_t *targets,
                                int rows, int n, int lo) {
    return IN->vocab_stats(IN, D(stats), D(logits), D(targets), rows, n, lo);
}
static fl_status op_vocab_xent(const fl_backend *be, float *loss, float *dlogits, const float *logits,
                               const double *all, const int32_t *targets, int rows, int n, int lo, int P, int me,
                               int V, float grad_scale, int ignore_index) {
    return IN->vocab_xent(IN, D(loss), D(dlogits), D(logits), D(all), D(targets), rows, n, lo, P, me, V,
                          grad_scale, ignore_index);
}
static fl_status op_accumulate16(const fl_backend *be, uint16_t *dst, fl_dtype t, const float *src, size_t n) {
    return IN->accumulate16(IN, D(dst), t, D(src), n);
}
static double op_sumsq(const fl_backend *be, const void *x, fl_dtype t, size_t n) { return IN->sumsq(IN, D(x), t, n); }
static fl_status op_attention_forward(const fl_backend *be, const fl_attn_desc *a, float *out, float *lse,
                                         const float *q, const float *k, const float *v, const float *bias,
                                         const uint8_t *kmask) {
    return IN->attention_forward(IN, a, D(out), D(lse), D(q), D(k), D(v), D(bias), D(kmask));
}
static fl_status op_attention_backward(const fl_backend *be, const fl_attn_desc *a, float *dq, float *dk, float *dv,
                                          float *dbias, const float *dout, const float *q, const float *k,
                                          const float *v, const float *bias, const uint8_t *kmask, const float *out,
                                          const float *lse) {
    return IN->attention_backward(IN, a, D(dq), D(dk), D(dv), D(dbias), D(dout), D(q), D(k), D(v), D(bias), D(kmask),
                                  D(out), D(lse));
}
/* the scratch (the model's WORKSPACE, from this pool) is lent to the CPU ops at its storage */
static void op_set_scratch(const fl_backend *be, void *p, size_t bytes) { IN->set_scratch(IN, D(p), bytes); }
/* The copies check which side is device memory, as a GPU's would fail (cudaMemcpy of a host
 * pointer named as device memory is an error there, a plain memcpy here): so a host buffer
 * passed where the contract wants a device one is caught on the CPU too. */
static int opq_is_dev(const fl_backend *be, const void *p, size_t bytes) {
    const opq *o = be->impl;
    const char *c = p;
    return c >= o->base && c + bytes <= o->base + o->top;
}
static fl_status opq_copy_check(const fl_backend *be, const char *op, const void *dst, int dst_dev, const void *src,
                                int src_dev, size_t bytes) {
    if (!bytes) return FL_OK;
    if (opq_is_dev(be, dst, bytes) != dst_dev)
        return fl_errorf(FL_ERR_INVALID, "opaque backend: %s: destination %p (%zu bytes) is %s memory, the contract "
                         "wants %s memory", op, dst, bytes, dst_dev ? "host" : "device", dst_dev ? "device" : "host");
    if (opq_is_dev(be, src, bytes) != src_dev)
        return fl_errorf(FL_ERR_INVALID, "opaque backend: %s: source %p (%zu bytes) is %s memory, the contract "
                         "wants %s memory", op, src, bytes, src_dev ? "host" : "device", src_dev ? "device" : "host");
    return FL_OK;
}
static fl_status op_to_device(const fl_backend *be, void *dst, const void *src, size_t bytes) {
    FL_TRY(opq_copy_check(be, "to_device", dst, 1, src, 0, bytes));
    return IN->to_device(IN, D(dst), src, bytes);
}
static fl_status op_to_host(const fl_backend *be, void *dst, const void *src, size_t bytes) {
    FL_TRY(opq_copy_check(be, "to_host", dst, 0, src, 1, bytes));
    return IN->to_host(IN, dst, D(src), bytes);
}
static fl_status op_copy(const fl_backend *be, void *dst, const void *src, size_t bytes) {
    FL_TRY(opq_copy_check(be, "copy", dst, 1, src, 1, bytes));
    return IN->copy(IN, D(dst), D(src), bytes);
}
static fl_status op_sync(const fl_backend *be) { return IN->sync(IN); }
static int op_supports_op(const fl_backend *be, fl_op op, fl_dtype a, fl_dtype b, fl_dtype c) {
    return IN->supports_op(IN, op, a, b, c);
}
static fl_status op_rope_tables(const fl_backend *be, float *cos_t, float *sin_t, int maxT, int HD, float theta,
                                const fl_rope_scaling *scaling) {
    return IN->rope_tables(IN, D(cos_t), D(sin_t), maxT, HD, theta, scaling);
}

fl_status fl_opaque_backend_init(fl_backend *be, int n_threads) {
    if (!be) return fl_errorf(FL_ERR_INVALID, "fl_opaque_backend_init: NULL backend");
    memset(be, 0, sizeof *be);
    opq *o = calloc(1, sizeof *o);
    if (!o) return fl_errorf(FL_ERR_OOM, "opaque backend: out of host memory");
    fl_status s = fl_cpu_backend_init(&o->cpu, n_threads);
    if (s != FL_OK) {
        free(o);
        return s;
    }
    o->base = mmap(NULL, OPQ_RESERVE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    o->mem = mmap(NULL, OPQ_RESERVE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (o->base == MAP_FAILED || o->mem == MAP_FAILED) {
        if (o->base != MAP_FAILED) munmap(o->base, OPQ_RESERVE);
        if (o->mem != MAP_FAILED) munmap(o->mem, OPQ_RESERVE);
        fl_cpu_backend_free(&o->cpu);
        free(o);
        return fl_errorf(FL_ERR_OOM, "opaque backend: cannot reserve %zu GiB of address space", OPQ_RESERVE >> 30);
    }
    pthread_mutex_init(&o->mu, NULL);
    opq_register(o);
    *be = o->cpu; /* names, thread count, GEMM facts: the CPU's */
    be->name = "opaque";
    be->caps = 0; /* host memory the host cannot read: not FL_CAP_HOST_MEMORY */
    be->impl = o;
    be->gemm = op_gemm;
    be->embedding_forward = op_embedding_forward;
    be->embedding_backward = op_embedding_backward;
    be->relbias_forward = op_relbias_forward;
    be->relbias_backward = op_relbias_backward;
    be->rmsnorm_forward = op_rmsnorm_forward;
    be->rmsnorm_backward = op_rmsnorm_backward;
    be->add_rmsnorm_forward = op_add_rmsnorm_forward;
    be->add_norm_forward16 = op_add_norm_forward16;
    be->layernorm_forward = op_layernorm_forward;
    be->layernorm_backward = op_layernorm_backward;
    be->rope_forward = op_rope_forward;
    be->rope_backward = op_rope_backward;
    be->attention_forward = op_attention_forward;
    be->attention_backward = op_attention_backward;
    be->swiglu_forward = op_swiglu_forward;
    be->swiglu_backward = op_swiglu_backward;
    be->gelu_forward = op_gelu_forward;
    be->gelu_backward = op_gelu_backward;
    be->relu_forward = op_relu_forward;
    be->relu_backward = op_relu_backward;
    be->gelu_erf_forward = op_gelu_erf_forward;
    be->gelu_erf_backward = op_gelu_erf_backward;
    be->geglu_forward = op_geglu_forward;
    be->geglu_backward = op_geglu_backward;
    be->add = op_add;
    be->bias_forward = op_bias_forward;
    be->bias_backward = op_bias_backward;
    be->cross_entropy = op_cross_entropy;
    be->adamw_update = op_adamw_update;
    be->sgd_update = op_sgd_update;
    be->sumsq = op_sumsq;
    be->scale = op_scale;
    be->zero = op_zero;
    be->attention_decode = op_attention_decode;
    be->convert = op_convert;
    be->check_finite = op_check_finite;
    be->adam8bit_update = op_adam8bit_update;
    be->q4_matmul_forward = op_q4_matmul_forward;
    be->q4_matmul_backward = op_q4_matmul_backward;
    be->lora_forward = op_lora_forward;
    be->lora_backward = op_lora_backward;
    be->dropout = op_dropout;
    be->dropout_rows = op_dropout_rows;
    be->vocab_stats = op_vocab_stats;
    be->vocab_xent = op_vocab_xent;
    be->accumulate16 = op_accumulate16;
    be->set_scratch = op_set_scratch;
    be->to_device = op_to_device;
    be->to_host = op_to_host;
    be->copy = op_copy;
    be->sync = op_sync;
    be->supports_op = op_supports_op;
    be->run = fl_backend_run_slots;
    be->rope_tables = op_rope_tables;
    be->pool_init = opq_pool_init;
    be->host_pool_init = opq_host_pool_init;
    be->comm_create = g_use_comm ? opq_comm_create : NULL; /* several ranks: the NCCL stand-in over the ranges */
    return FL_OK;
}

void fl_opaque_backend_free(fl_backend *be) {
    if (!be || !be->impl) return;
    opq *o = be->impl;
    pthread_mutex_lock(&o->mu);
    int release = o->n_used == 0;
    o->dead = 1; /* pools still holding blocks release the range with their last free */
    pthread_mutex_unlock(&o->mu);
    if (release) opq_release(o);
    memset(be, 0, sizeof *be);
}

/* The "cuda-emu" backend: cuda-backend-impl.h over the CPU emulator's kernels (fl_cuemu_*), the
 * cuBLASLt stand-in and host memory. Linked into the test programs only (fitllm_cuemu), where
 * tests/main.c registers it, so the op suite runs the CUDA backend's own code on any machine.
 * The scratch panels are small on purpose (64 KiB): the test shapes then cross panel edges. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cuda/cuda-impl.h"
#include "backend/cuda/cu_gemm.h"
#include "backend/cuda/emu/cu_emu.h"
#include "fitllm/comm_nccl.h"

#define FLB_NAME "cuda-emu"
#define FLB_GEMM_NAME "cublaslt-standin"
/* host memory unless a test asked for the GPU's split (fl_cuemu_set_host_memory(0)) */
static int g_host_memory = 1;
void fl_cuemu_set_host_memory(int on) { g_host_memory = on; }
#define FLB_HOST_MEMORY g_host_memory
#define FLB_K(name) fl_cuemu_##name
#define FLB_PREFIX(name) fl_cuemu_##name
#define FLB_LT_WS_BYTES 0u
#define FLB_PANEL_BYTES (64u << 10)
#define FLB_WORK_BYTES (1u << 20)
#define flb_gemm_fn flb_emu_gemm
#define flb_gemm_bench_fn fl_cu_gemm_standin_bench
/* cuDNN's attention path (cuda-cudnn-impl.h) only with a library $FITLLM_CUDNN_LIB names: tests/cuda/sim_cudnn.c */
#define FLB_HAVE_CUDNN 1
#define FLB_CUDNN_NAMED_ONLY 1

/* Stream work under a capture (cu_emu.h) becomes a graph node: a copy or fill, a stand-in GEMM. */
typedef struct {
    void *d;
    const void *s;
    size_t n;
    int fill, v;
} flb_emu_copy;
static void flb_emu_copy_run(void *a) {
    const flb_emu_copy *c = (const flb_emu_copy *)a;
    if (c->fill) memset(c->d, c->v, c->n);
    else memmove(c->d, c->s, c->n);
}
static void flb_emu_gemm_run(void *a) {
    if (fl_cu_gemm_standin(NULL, (const fl_cu_gemm_desc *)a) != FL_OK) fl_cu_emu_capture_invalidate("gemm");
}
/* the alignment audit (cu_emu.h): what cuBLASLt's fast kernels need of every operand */
static void flb_emu_gemm_audit(const fl_cu_gemm_desc *d) {
    fl_cu_emu_gemm_calls++;
    const size_t ea = fl_dtype_size(d->ta), eb = fl_dtype_size(d->tb), ec = fl_dtype_size(d->tc);
    const void *D = d->D ? d->D : d->C;
    const int bad = fl_cu_gemm_align_of(d->A) < 16 || fl_cu_gemm_align_of(d->B) < 16 ||
                    fl_cu_gemm_align_of(d->C) < 16 || fl_cu_gemm_align_of(D) < 16 ||
                    (d->epilogue && fl_cu_gemm_align_of(d->bias) < 16) ||
                    (d->epilogue == FL_CU_EPI_GELU_AUX_BIAS && (fl_cu_gemm_align_of(d->aux) < 16 || d->ldaux * 4 % 16)) ||
                    (size_t)d->lda * ea % 16 ||
                    (size_t)d->ldb * eb % 16 || (size_t)d->ldc * ec % 16;
    if (!bad) return;
    fl_cu_emu_gemm_misaligned++;
    snprintf(fl_cu_emu_gemm_misaligned_what, sizeof fl_cu_emu_gemm_misaligned_what,
             "m %d n %d k %d %s%s%s, alignment A %u B %u C %u D %u, ld %lld %lld %lld", d->m, d->n, d->k,
             fl_dtype_name(d->ta), fl_dtype_name(d->tb), fl_dtype_name(d->tc), (unsigned)fl_cu_gemm_align_of(d->A),
             (unsigned)fl_cu_gemm_align_of(d->B), (unsigned)fl_cu_gemm_align_of(d->C),
             (unsigned)fl_cu_gemm_align_of(D), (long long)d->lda, (long long)d->ldb, (long long)d->ldc);
    const char *e = getenv("FITLLM_EMU_GEMM_AUDIT");
    if (e && *e == '1') fprintf(stderr, "cuda-emu: misaligned GEMM: %s\n", fl_cu_emu_gemm_misaligned_what);
}
static fl_status flb_emu_gemm(void *ctx, const fl_cu_gemm_desc *d) {
    flb_emu_gemm_audit(d);
    if (!fl_cu_emu_capturing()) return fl_cu_gemm_standin(ctx, d);
    FL_TRY(fl_cu_gemm_check(d)); /* what cuBLASLt refuses at the call, refused at the capture */
    FL_TRY(fl_cu_gemm_lt_bias_ok(d));
    fl_cu_emu_capture_call(flb_emu_gemm_run, d, sizeof *d);
    return FL_OK;
}

static void *flb_dev_alloc(size_t bytes) { return aligned_alloc(256, (bytes + 255) / 256 * 256); }
static void flb_dev_free(void *p) { free(p); }
static void *flb_host_alloc(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }
static void flb_host_free(void *p) { free(p); }
static int flb_h2d(void *d, const void *h, size_t n, void *s) {
    (void)s;
    if (fl_cu_emu_capturing()) {
        const flb_emu_copy c = {d, h, n, 0, 0};
        fl_cu_emu_capture_call(flb_emu_copy_run, &c, sizeof c);
        return 0;
    }
    memmove(d, h, n);
    return 0;
}
static int flb_d2h(void *h, const void *d, size_t n, void *s) {
    if (fl_cu_emu_capturing()) fl_cu_emu_capture_invalidate("a copy to the host inside the capture");
    return flb_h2d(h, d, n, s);
}
static int flb_d2d(void *d, const void *src, size_t n, void *s) { return flb_h2d(d, src, n, s); }
static int flb_memset(void *d, int v, size_t n, void *s) {
    (void)s;
    if (fl_cu_emu_capturing()) {
        const flb_emu_copy c = {d, NULL, n, 1, v};
        fl_cu_emu_capture_call(flb_emu_copy_run, &c, sizeof c);
        return 0;
    }
    memset(d, v, n);
    return 0;
}
static int flb_stream_sync(void *s) {
    (void)s;
    if (fl_cu_emu_capturing()) fl_cu_emu_capture_invalidate("a stream synchronization inside the capture");
    return 0;
}
/* CUDA Graphs (cuda-graph-impl.h): the emulator's capture of this OS thread */
static int flb_capture_begin(void *s) {
    (void)s;
    return fl_cu_emu_capture_begin();
}
/* end the capture and make its executable graph (old: the segment's previous one, replaced) */
static int flb_capture_end(void *s, void **exec, void *old, const char **why) {
    (void)s;
    fl_cu_emu_graph *g = fl_cu_emu_capture_end(why);
    if (old) fl_cu_emu_graph_free((fl_cu_emu_graph *)old);
    *exec = g;
    return g ? 0 : 1;
}
static int flb_graph_launch(void *exec, void *s) {
    (void)s;
    fl_cu_emu_graph_launch((const fl_cu_emu_graph *)exec);
    return fl_cu_emu_error() ? 1 : 0;
}
static void flb_graph_free(void *exec) { fl_cu_emu_graph_free((fl_cu_emu_graph *)exec); }
static size_t flb_graph_nodes(void *exec) { return fl_cu_emu_graph_nodes((const fl_cu_emu_graph *)exec); }
static void flb_capture_clear(void) {}
static const char *flb_last_error(int rc) {
    (void)rc;
    const char *e = fl_cu_emu_error();
    return e ? e : "emulator error";
}
static void flb_device_name(char *buf, size_t n) { snprintf(buf, n, "CUDA emulator"); }
/* markers: the launches are synchronous, so the host clock at the record is the queue's time */
static int flb_mark_new(void **ev) {
    *ev = malloc(sizeof(double));
    return *ev ? 0 : 1;
}
static int flb_mark_record(void *ev, void *s) {
    (void)s;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    *(double *)ev = (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
    return 0;
}
static int flb_mark_elapsed(void *a, void *b, float *ms) {
    *ms = (float)(*(double *)b - *(double *)a);
    return 0;
}
static void flb_mark_free(void *ev) { free(ev); }
static int flb_mark_wait(void *ev) { /* the launches and copies are synchronous: done */
    (void)ev;
    return 0;
}
/* The second stream (cuda-input-impl.h: the next micro-batch's inputs), modelled: its copies are queued and run
 * only when something waits for them (the backend's stream waiting for an event recorded after them, or the host
 * waiting for one), never by themselves, so a read of a slot before its wait sees the old bytes; and while a copy
 * is queued its destination is "pending" (flb_s2_pending), which the ops that read the input slots refuse by name.
 * The backend's stream runs its work at once (launches are synchronous), so a wait of the second stream for it is
 * already satisfied. */
enum { FLB_S2_QUEUE = 16 };
typedef struct {
    struct { void *d; const void *h; size_t n; long seq; } q[FLB_S2_QUEUE];
    int n;
    long seq; /* copies queued so far */
} flb_s2q;
typedef struct {
    flb_s2q *q;
    long seq; /* the copies before the record */
} flb_s2ev;
static void flb_s2_run(flb_s2q *q, long upto) {
    int k = 0;
    for (int i = 0; i < q->n; i++) {
        if (q->q[i].seq <= upto) memmove(q->q[i].d, q->q[i].h, q->q[i].n);
        else q->q[k++] = q->q[i];
    }
    q->n = k;
}
static int flb_s2_new(void **s2) {
    *s2 = calloc(1, sizeof(flb_s2q));
    return *s2 ? 0 : 1;
}
static void flb_s2_free(void *s2) {
    if (!s2) return;
    flb_s2_run((flb_s2q *)s2, ((flb_s2q *)s2)->seq);
    free(s2);
}
static int flb_s2_h2d(void *d, const void *h, size_t n, void *s2) {
    flb_s2q *q = (flb_s2q *)s2;
    if (q->n == FLB_S2_QUEUE) flb_s2_run(q, q->q[0].seq); /* (not reached: at most 2 copies per slot queued) */
    q->q[q->n].d = d, q->q[q->n].h = h, q->q[q->n].n = n, q->q[q->n].seq = ++q->seq;
    q->n++;
    return 0;
}
static int flb_s2_ev_new(void **ev, void *s2) {
    flb_s2ev *e = (flb_s2ev *)calloc(1, sizeof *e);
    if (e) e->q = (flb_s2q *)s2;
    *ev = e;
    return e ? 0 : 1;
}
static void flb_s2_ev_free(void *ev) { free(ev); }
static int flb_s2_record(void *ev, void *s2) {
    ((flb_s2ev *)ev)->seq = ((flb_s2q *)s2)->seq;
    return 0;
}
/* the second stream waits for the work queued on the backend's stream so far (ev: an event to record there) */
static int flb_s2_after_main(void *s2, void *stream, void *ev) {
    (void)s2, (void)stream, (void)ev;
    return 0;
}
/* the backend's stream (or the host) waits for the second stream's event */
static int flb_main_after_s2(void *stream, void *ev) {
    (void)stream;
    const flb_s2ev *e = (const flb_s2ev *)ev;
    flb_s2_run(e->q, e->seq);
    return 0;
}
static int flb_host_after_s2(void *ev) { return flb_main_after_s2(NULL, ev); }
/* whether p lies in the destination of a queued copy */
static int flb_s2_pending(void *s2, const void *p) {
    const flb_s2q *q = (const flb_s2q *)s2;
    for (int i = 0; q && i < q->n; i++)
        if ((const char *)p >= (const char *)q->q[i].d && (const char *)p < (const char *)q->q[i].d + q->q[i].n) return 1;
    return 0;
}
static fl_status flb_device_init(void **stream, fl_cu_blas *blas) {
    *stream = NULL;
    memset(blas, 0, sizeof *blas);
    return FL_OK;
}
static void flb_device_free(void *stream, fl_cu_blas *blas) {
    (void)stream; (void)blas;
}

/* Several ranks: the NCCL communicator's own code over the CPU stand-in (host memory, the
 * threads implementation of fl_comm underneath), unless a test turned it off to compare with
 * the host communicator used directly (fl_cuemu_use_nccl). */
static int g_use_nccl = 1;
void fl_cuemu_use_nccl(int on) { g_use_nccl = on; }
static fl_status flb_comm_create(const fl_backend *be, void *stream, struct fl_comm *host, struct fl_comm **out) {
    (void)be; (void)stream;
    *out = NULL;
    if (!g_use_nccl) return FL_OK;
    return fl_comm_nccl_create(host, fl_nccl_standin_api(), NULL, out);
}

#include "backend/cuda/cuda-backend-impl.h"

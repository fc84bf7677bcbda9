/* fitllm CUDA backend object: cuDNN's fused attention (EXPERIMENTAL; included by
 * cuda-work-ops-impl.h). The plugin (backend_cudart.c) and the emulator (backend_cuemu.c) define
 * FLB_HAVE_CUDNN. The emulator opens only a library $FITLLM_CUDNN_LIB names (FLB_CUDNN_NAMED_ONLY): the
 * stand-in tests/cuda/sim_cudnn.c, which runs the graphs on the host, so this path runs in make test;
 * without it there "auto" is "own" and "cudnn" refuses to start.
 *
 * The attention ops take fp32 operands with row strides (fl_attn_desc); cuDNN's graphs take 16-bit
 * ones. So a call copies Q, K, V (and O, dO backward) into compact bf16 buffers (convert2d), runs the
 * plan (cached per shape), and brings the result back: O to fp32 with ldo, dQ/dK/dV added into the
 * fp32 gradients (attention_heads2d: the op accumulates); the log-sum-exp is written by cuDNN in place
 * (fp32 (B, NH, Tq), the contract's layout). The bf16 copies and cuDNN's workspace live in the region of
 * the op scratch beyond FLB_SCRATCH_BYTES, which a model lends for its attention shape
 * (fl_backend.attn_scratch_bytes: in its WORKSPACE, so the planner counts it), else (a call outside a model,
 * a larger workspace than the allowance) in a device buffer of the backend's own, grown on demand, outside
 * the pools (said once when a model lent a region too small). A shape cuDNN refuses (cudnn-impl.h's fl_cudnn_sdpa_refuse, or no engine for the graph)
 * runs the own kernels, said once on stderr. */

#ifdef FLB_HAVE_CUDNN
#include "backend/cuda/cudnn-impl.h"

#define FLB_DNN_PLANS 16
typedef struct flb_cudnn {
    fl_cudnn_api api;
    void *handle;
    struct {
        fl_cudnn_sdpa_layout L;
        int backward;
        fl_cudnn_plan *plan; /* NULL: this layout was refused (remembered: no rebuild per call) */
    } plans[FLB_DNN_PLANS];
    int nplans;
    void *buf; /* device: the 16-bit copies, then cuDNN's workspace (when the lent scratch is too small) */
    size_t buf_bytes;
    int direct;   /* FITLLM_CUDA_CUDNN_DIRECT (default 1): a bf16 run's stored q, k, v (and o) read in place */
    int b16;      /* FITLLM_CUDA_CUDNN_B16 (default 1): attention_backward_b16 offered (attention_b16_ok) */
    int said;     /* a refusal said once */
    int said_buf; /* a lent region too small, said once */
    int said_direct; /* an in-place layout refused, said once */
    int said_grads;  /* the gradients' in-place layout refused, said once */
    int said_plan[2]; /* FITLLM_CUDA_ATTN=cudnn: the first forward / backward plan's engine, said once */
} flb_cudnn;

static void flb_dnn_say(flb_impl *im, const char *what, const char *why) {
    if (im->dnn->said) return;
    im->dnn->said = 1;
    fprintf(stderr, "fitllm: %s backend: cuDNN attention %s (%s): the own FlashAttention-2-structured kernels run it "
            "(FITLLM_CUDA_ATTN=own silences this)\n", FLB_NAME, what, why);
}

static fl_status flb_attn_init(flb_impl *im) {
    if (!fl_cudnn_attn_wants(im->attn)) return FL_OK;
#ifdef FLB_CUDNN_NAMED_ONLY
    const char *named = getenv("FITLLM_CUDNN_LIB");
    if (!named || !*named) {
        if (im->attn == FL_CUDNN_ATTN_CUDNN)
            return fl_errorf(FL_ERR_UNSUPPORTED, "%s backend: FITLLM_CUDA_ATTN=cudnn: cuDNN's attention runs in the "
                             "CUDA plugin on a GPU only (use auto or own here)", FLB_NAME);
        im->attn = FL_CUDNN_ATTN_OWN; /* nothing to say: no cuDNN is expected */
        return FL_OK;
    }
#endif
    /* FITLLM_CUDA_CUDNN_DIRECT (unset, empty or 1: on; 0: off, an A/B): a bf16 run's stored q, k, v read in place */
    const char *ed = getenv("FITLLM_CUDA_CUDNN_DIRECT");
    if (ed && *ed && strcmp(ed, "1") && strcmp(ed, "0"))
        return fl_errorf(FL_ERR_INVALID, "%s backend: FITLLM_CUDA_CUDNN_DIRECT=%s: expected 1 (cuDNN reads a bf16 "
                         "run's stored q, k, v in place, the default) or 0 (compact copies first)", FLB_NAME, ed);
    /* FITLLM_CUDA_CUDNN_B16 (unset, empty or 1: on; 0: off, an A/B): the backward in bf16 around cuDNN's graphs */
    const char *eb = getenv("FITLLM_CUDA_CUDNN_B16");
    if (eb && *eb && strcmp(eb, "1") && strcmp(eb, "0"))
        return fl_errorf(FL_ERR_INVALID, "%s backend: FITLLM_CUDA_CUDNN_B16=%s: expected 1 (a bf16 run's attention "
                         "backward takes a bf16 dO and writes bf16 gradients around cuDNN's graphs, the default) or 0 "
                         "(fp32 dO and gradients, converted)", FLB_NAME, eb);
    char why[400];
    flb_cudnn *d = (flb_cudnn *)calloc(1, sizeof *d);
    if (!d) return fl_errorf(FL_ERR_OOM, "%s backend: out of host memory", FLB_NAME);
    int rc = fl_cudnn_load(&d->api, NULL, why, sizeof why);
    if (rc == 0 && (rc = d->api.create(&d->handle)) != 0) {
        char b[48];
        snprintf(why, sizeof why, "cudnnCreate: %s", fl_cudnn_status_name(&d->api, rc, b, sizeof b));
    } else if (rc == 0 && (rc = d->api.set_stream(d->handle, im->stream)) != 0) {
        char b[48];
        snprintf(why, sizeof why, "cudnnSetStream: %s", fl_cudnn_status_name(&d->api, rc, b, sizeof b));
    }
    if (rc != 0) {
        if (d->handle) d->api.destroy(d->handle);
        fl_cudnn_unload(&d->api);
        free(d);
        if (im->attn == FL_CUDNN_ATTN_CUDNN)
            return fl_errorf(FL_ERR_UNSUPPORTED, "%s backend: FITLLM_CUDA_ATTN=cudnn: %s", FLB_NAME, why);
        fprintf(stderr, "fitllm: %s backend: cuDNN attention not used (%s): the own FlashAttention-2-structured "
                "kernels run (FITLLM_CUDA_ATTN=own silences this)\n", FLB_NAME, why);
        im->attn = FL_CUDNN_ATTN_OWN;
        return FL_OK;
    }
    d->direct = !ed || !*ed || !strcmp(ed, "1");
    d->b16 = !eb || !*eb || !strcmp(eb, "1");
    im->dnn = d;
    return FL_OK;
}
static void flb_attn_free(flb_impl *im) {
    flb_cudnn *d = im->dnn;
    if (!d) return;
    for (int i = 0; i < d->nplans; i++) fl_cudnn_plan_free(&d->api, d->plans[i].plan);
    if (d->buf) flb_dev_free(d->buf);
    d->api.destroy(d->handle);
    fl_cudnn_unload(&d->api);
    free(d);
    im->dnn = NULL;
}

/* the cached plan of a layout (built on first use), or NULL when cuDNN refuses it (said once; direct 1: an in-place
 * layout, whose refusal sends the call to the compact copies, flb_dnn_plan_of; 2: its gradients in place too, whose
 * refusal sends them to compact buffers) */
static fl_cudnn_plan *flb_dnn_plan(flb_impl *im, const fl_cudnn_sdpa_layout *L, int backward, int direct) {
    flb_cudnn *d = im->dnn;
    for (int i = 0; i < d->nplans; i++)
        if (d->plans[i].backward == backward && !memcmp(&d->plans[i].L, L, sizeof *L)) return d->plans[i].plan;
    char why[400];
    fl_cudnn_plan *p = NULL;
    if (fl_cudnn_sdpa_build(&d->api, d->handle, L, backward, &p, why, sizeof why) != 0) {
        if (!direct) flb_dnn_say(im, backward ? "backward graph refused" : "forward graph refused", why);
        else if (direct == 2 && !d->said_grads) {
            d->said_grads = 1;
            fprintf(stderr, "fitllm: %s backend: cuDNN attention backward graph refused its bf16 gradients written in "
                    "place (%s): compact ones are copied out\n", FLB_NAME, why);
        } else if (direct == 1 && !d->said_direct) {
            d->said_direct = 1;
            fprintf(stderr, "fitllm: %s backend: cuDNN attention %s graph refused the stored bf16 q, k, v in place (%s): "
                    "compact copies are tried (FITLLM_CUDA_CUDNN_DIRECT=0 goes there at once)\n", FLB_NAME,
                    backward ? "backward" : "forward", why);
        }
        p = NULL;
    } else if (im->attn == FL_CUDNN_ATTN_CUDNN && !d->said_plan[backward]) { /* asked for by name: which engine */
        int rank = 0;
        const long long eng = (long long)fl_cudnn_plan_engine(p, &rank);
        d->said_plan[backward] = 1;
        fprintf(stderr, "fitllm: %s backend: cuDNN attention %s plan: engine %lld (heuristics' choice %d), workspace %zu "
                "bytes, %s q, k, v\n", FLB_NAME, backward ? "backward" : "forward", eng, rank + 1,
                fl_cudnn_plan_workspace(p), direct ? "in place" : "compact copies of");
    }
    int slot = d->nplans < FLB_DNN_PLANS ? d->nplans++ : FLB_DNN_PLANS - 1; /* full: the last slot is reused */
    if (slot == FLB_DNN_PLANS - 1 && d->plans[slot].plan) fl_cudnn_plan_free(&d->api, d->plans[slot].plan);
    d->plans[slot].L = *L;
    d->plans[slot].backward = backward;
    d->plans[slot].plan = p;
    return p;
}
/* a cuDNN buffer of at least `bytes`: the lent scratch's region beyond FLB_SCRATCH_BYTES (flb_scratch's start is
 * at most 255 bytes into the lent block, FLB_SCRATCH_BYTES - 256 its own part), else the backend's own (grown: the
 * stream waits for the old one's users) */
static char *flb_dnn_buf(const fl_backend *be, size_t bytes) {
    flb_impl *im = FLB_IMPL(be);
    flb_cudnn *d = im->dnn;
    if (im->scratch && im->scratch_lent >= FLB_SCRATCH_BYTES + bytes) {
        char *s = (char *)flb_scratch(be);
        return s ? s + FLB_SCRATCH_BYTES - 256 : NULL;
    }
    if (im->scratch_lent > FLB_SCRATCH_BYTES && !d->said_buf) {
        d->said_buf = 1;
        fprintf(stderr, "fitllm: %s backend: cuDNN's attention needs %zu bytes, the model lent %zu: a buffer outside "
                "the memory plan holds them\n", FLB_NAME, bytes, im->scratch_lent - FLB_SCRATCH_BYTES);
    }
    if (d->buf_bytes >= bytes) return (char *)d->buf;
#ifdef FLB_CUDNN_NAMED_ONLY
    if (im->scratch_lent > FLB_SCRATCH_BYTES) fl_cu_emu_dnn_own_buffers++; /* the emulator's count (cu_emu.h) */
#endif
    flb_stream_sync(im->stream);
    if (d->buf) flb_dev_free(d->buf);
    d->buf = flb_dev_alloc(bytes);
    d->buf_bytes = d->buf ? bytes : 0;
    if (!d->buf) {
        char why[128];
        snprintf(why, sizeof why, "cannot allocate %zu bytes of device memory for cuDNN's attention", bytes);
        flb_set_error(be, FL_ERR_OOM, "attention", why);
    }
    return (char *)d->buf;
}
static size_t flb_al256(size_t b) { return (b + 255) & ~(size_t)255; }
/* an operand (rows, heads x hd at row stride ld, type t) into cuDNN's compact bf16 copy (rows, heads x hp; hp > hd:
 * each head zero-padded) */
static int flb_dnn_in(const fl_backend *be, void *dst, int hp, const void *src, fl_dtype t, size_t ld, int rows,
                      int heads, int hd) {
    if (hp == hd) return FLB_K(convert2d)(dst, FL_BF16, (size_t)heads * hd, src, t, ld, rows, heads * hd, STREAM);
    return FLB_K(attention_heads2d)(dst, FL_BF16, (size_t)heads * hp, hp, src, t, ld, hd, rows, heads, hd, hp, 0,
                                    STREAM);
}
/* cuDNN's compact bf16 result (rows, heads x hp) into the call's (rows, heads x hd at row stride ld, type t; acc: added
 * to an fp32 one), each head's padding dropped */
static int flb_dnn_out(const fl_backend *be, void *dst, fl_dtype t, size_t ld, const void *src, int hp, int rows,
                       int heads, int hd, int acc) {
    const size_t ls = (size_t)heads * hp;
    if (hp == hd && !acc) return FLB_K(convert2d)(dst, t, ld, src, FL_BF16, ls, rows, heads * hd, STREAM);
    if (hp == hd) heads = 1, hd = hp = (int)ls; /* one "head" of the whole row */
    return FLB_K(attention_heads2d)(dst, t, ld, hd, src, FL_BF16, ls, hp, rows, heads, hd, hd, acc, STREAM);
}
/* A call's layout: a bf16 run's stored q, k, v (and the backward's o: NULL forward, compact rows per
 * fl_cudnn_sdpa_refuse) read in place at their own row strides where FITLLM_CUDA_CUDNN_DIRECT and the alignment allow
 * (returns 1), else the compact copies' (0) */
static int flb_dnn_layout(const flb_impl *im, const fl_attn_desc *a, fl_dtype it, const void *q, const void *k,
                          const void *v, const void *o, fl_cudnn_sdpa_layout *L) {
    const int direct = im->dnn->direct && it == FL_BF16 && fl_cudnn_sdpa_direct_ok(a, q, k, v) && (uintptr_t)o % 16 == 0;
    fl_attn_desc p;
    fl_cudnn_sdpa_pad(a, &p); /* the copies' layout: cuDNN's head size */
    if (direct) fl_cudnn_sdpa_layout_rows(a, FL_BF16, L);
    else fl_cudnn_sdpa_layout_of(&p, FL_BF16, L);
    return direct;
}
/* A call's layout and its plan: an in-place layout cuDNN refuses (its strides) falls back to the compact copies'
 * (*direct cleared, the refusal cached like any other). grads (the backward with bf16 gradients at q, k, v's
 * strides, attention_backward_b16): in place, the gradients' in-place layout first (*direct 2). NULL: the own
 * kernels run the call. */
static fl_cudnn_plan *flb_dnn_plan_of(flb_impl *im, const fl_attn_desc *a, fl_dtype it, const void *q, const void *k,
                                      const void *v, const void *o, int backward, int grads, fl_cudnn_sdpa_layout *L,
                                      int *direct) {
    *direct = flb_dnn_layout(im, a, it, q, k, v, o, L);
    if (*direct && grads) {
        fl_cudnn_sdpa_layout G;
        fl_cudnn_sdpa_layout_grad_rows(a, FL_BF16, &G);
        fl_cudnn_plan *p = flb_dnn_plan(im, &G, 1, 2);
        if (p) return *L = G, *direct = 2, p;
    }
    fl_cudnn_plan *p = flb_dnn_plan(im, L, backward, *direct);
    if (p || !*direct) return p;
    *direct = 0; /* (in place implies a head size of a multiple of 8: the compact copies are a's) */
    fl_cudnn_sdpa_layout_of(a, FL_BF16, L);
    return flb_dnn_plan(im, L, backward, 0);
}

/* 1: cuDNN ran it (or failed: *st says); 0: run the own kernels */
/* q, k, v of type it: F32, or BF16 (attention_forward_in16: a bf16 run's stored q|k|v, copied compact) */
static int flb_cudnn_forward(const fl_backend *be, const fl_attn_desc *a, float *out, void *out16, float *lse,
                             const void *q, const void *k, const void *v, fl_dtype it, const float *bias,
                             const uint8_t *kmask, fl_status *st) {
    flb_impl *im = FLB_IMPL(be);
    if (!im->dnn || im->compute != FL_BF16) return 0;
    const char *no = fl_cudnn_sdpa_refuse(a, bias, kmask);
    if (no) {
        flb_dnn_say(im, "refused a shape", no);
        return 0;
    }
    fl_cudnn_sdpa_layout L;
    int direct;
    fl_cudnn_plan *p = flb_dnn_plan_of(im, a, it, q, k, v, NULL, 0, 0, &L, &direct);
    if (!p) return 0;
    fl_attn_desc pa; /* cuDNN's call: the head size padded to a multiple of 8 (hp), compact rows */
    const int padded = fl_cudnn_sdpa_pad(a, &pa), hp = pa.HD;
    const int rq = a->B * a->Tq, rk = a->B * a->Tk, cq = a->NH * hp, ck = a->NKV * hp;
    const size_t bq = flb_al256((size_t)rq * cq * 2), bk = flb_al256((size_t)rk * ck * 2);
    char *buf = flb_dnn_buf(be, fl_cudnn_sdpa_copy_bytes(&pa, 0) + fl_cudnn_plan_workspace(p)); /* 2 bq + 2 bk + ws */
    if (!buf) return (*st = flb_sticky(be)), 1;
    void *ptr[FL_CUDNN_UID_COUNT] = {0};
    ptr[FL_CUDNN_UID_Q] = buf;
    ptr[FL_CUDNN_UID_K] = buf + bq;
    ptr[FL_CUDNN_UID_V] = buf + bq + bk;
    /* out16 (bf16 stored): cuDNN's bf16 O goes there directly (the refused shapes leave compact rows, ldo = cq) */
    ptr[FL_CUDNN_UID_O] = out16 && !padded && a->ldo == (size_t)cq ? out16 : (void *)(buf + bq + 2 * bk);
    ptr[FL_CUDNN_UID_STATS] = lse;
    int rc = 0;
    if (direct) {
        ptr[FL_CUDNN_UID_Q] = (void *)q, ptr[FL_CUDNN_UID_K] = (void *)k, ptr[FL_CUDNN_UID_V] = (void *)v;
    } else {
        rc = flb_dnn_in(be, ptr[FL_CUDNN_UID_Q], hp, q, it, a->ldq, rq, a->NH, a->HD);
        if (!rc) rc = flb_dnn_in(be, ptr[FL_CUDNN_UID_K], hp, k, it, a->ldk, rk, a->NKV, a->HD);
        if (!rc) rc = flb_dnn_in(be, ptr[FL_CUDNN_UID_V], hp, v, it, a->ldv, rk, a->NKV, a->HD);
    }
    if (rc) return (*st = flb_attn_status(be, rc, "attention_forward (cuDNN)")), 1;
    int s = fl_cudnn_plan_run(&im->dnn->api, im->dnn->handle, p, ptr, buf + 2 * bq + 2 * bk);
    if (s) {
        char b[48], why[96];
        snprintf(why, sizeof why, "cudnnBackendExecute: %s", fl_cudnn_status_name(&im->dnn->api, s, b, sizeof b));
        flb_set_error(be, FL_ERR_UNSUPPORTED, "attention_forward (cuDNN)", why);
        return (*st = flb_sticky(be)), 1;
    }
    if (out) /* NULL: the bf16 copy only */
        rc = flb_dnn_out(be, out, FL_F32, a->ldo, ptr[FL_CUDNN_UID_O], hp, rq, a->NH, a->HD, 0);
    if (!rc && out16 && ptr[FL_CUDNN_UID_O] != out16) /* a padded head size (or rows not compact): the copy */
        rc = flb_dnn_out(be, out16, FL_BF16, a->ldo, ptr[FL_CUDNN_UID_O], hp, rq, a->NH, a->HD, 0);
    *st = flb_attn_status(be, rc, "attention_forward (cuDNN)");
    return 1;
}

/* The backward through cuDNN. q, k, v, out of type it: F32, or BF16 (a bf16 run's stored activations: read in place
 * where they can be, else copied compact); dout of type dt: F32 (converted) or BF16 (attention_backward_b16: read in
 * place where it can be). d16 NULL: the gradients added into the fp32 dq, dk, dv; else (attention_backward_b16) the
 * bf16 gradients written to d16[0..2] at q, k, v's strides, by cuDNN itself where its graph takes them there. */
static int flb_cudnn_bwd(const fl_backend *be, const fl_attn_desc *a, float *dq, float *dk, float *dv, void *const *d16,
                         const void *dout, fl_dtype dt, const void *q, const void *k, const void *v, fl_dtype it,
                         const void *out, const float *lse, void *work, fl_status *st) {
    flb_impl *im = FLB_IMPL(be);
    /* d16 in place: at q, k, v's strides, each 16-byte aligned (as the in-place q, k, v) */
    const int grads = d16 && fl_cudnn_sdpa_direct_ok(a, d16[0], d16[1], d16[2]);
    fl_cudnn_sdpa_layout L;
    int direct;
    fl_cudnn_plan *p = flb_dnn_plan_of(im, a, it, q, k, v, out, 1, grads, &L, &direct);
    if (!p) return 0;
    fl_attn_desc pa; /* cuDNN's call: the head size padded to a multiple of 8 (hp), compact rows */
    fl_cudnn_sdpa_pad(a, &pa);
    const int hp = pa.HD, rq = a->B * a->Tq, rk = a->B * a->Tk, cq = a->NH * hp, ck = a->NKV * hp;
    const size_t bq = flb_al256((size_t)rq * cq * 2), bk = flb_al256((size_t)rk * ck * 2);
    /* 4 bq + 4 bk: q o do dq | k v dk dv, then the fp32 dQ accumulator */
    const size_t copies = fl_cudnn_sdpa_copy_bytes(&pa, 1), used = copies + fl_cudnn_sdpa_dqacc_bytes(&pa);
    char *buf = flb_dnn_buf(be, used + fl_cudnn_plan_workspace(p));
    if (!buf) return (*st = flb_sticky(be)), 1;
    void *ptr[FL_CUDNN_UID_COUNT] = {0};
    ptr[FL_CUDNN_UID_Q] = buf;
    ptr[FL_CUDNN_UID_O] = buf + bq;
    ptr[FL_CUDNN_UID_DO] = buf + 2 * bq;
    ptr[FL_CUDNN_UID_DQ] = buf + 3 * bq;
    ptr[FL_CUDNN_UID_K] = buf + 4 * bq;
    ptr[FL_CUDNN_UID_V] = buf + 4 * bq + bk;
    ptr[FL_CUDNN_UID_DK] = buf + 4 * bq + 2 * bk;
    ptr[FL_CUDNN_UID_DV] = buf + 4 * bq + 3 * bk;
    ptr[FL_CUDNN_UID_STATS] = (void *)lse;
    ptr[FL_CUDNN_UID_DSUM] = work; /* rowsum(dO * O), B*NH*Tq floats: the op's work area */
    ptr[FL_CUDNN_UID_DQACC] = buf + copies;
    int rc = 0;
    if (direct) {
        ptr[FL_CUDNN_UID_Q] = (void *)q, ptr[FL_CUDNN_UID_K] = (void *)k, ptr[FL_CUDNN_UID_V] = (void *)v;
        ptr[FL_CUDNN_UID_O] = (void *)out;
    } else {
        rc = flb_dnn_in(be, ptr[FL_CUDNN_UID_Q], hp, q, it, a->ldq, rq, a->NH, a->HD);
        if (!rc) rc = flb_dnn_in(be, ptr[FL_CUDNN_UID_O], hp, out, it, a->ldo, rq, a->NH, a->HD);
        if (!rc) rc = flb_dnn_in(be, ptr[FL_CUDNN_UID_K], hp, k, it, a->ldk, rk, a->NKV, a->HD);
        if (!rc) rc = flb_dnn_in(be, ptr[FL_CUDNN_UID_V], hp, v, it, a->ldv, rk, a->NKV, a->HD);
    }
    if (direct == 2)
        ptr[FL_CUDNN_UID_DQ] = d16[0], ptr[FL_CUDNN_UID_DK] = d16[1], ptr[FL_CUDNN_UID_DV] = d16[2];
    /* dO in O's layout: a bf16 one in place when the layout is O's own (compact rows, in place) and it is aligned */
    if (direct && dt == FL_BF16 && (uintptr_t)dout % 16 == 0) ptr[FL_CUDNN_UID_DO] = (void *)dout;
    else if (!rc) rc = flb_dnn_in(be, ptr[FL_CUDNN_UID_DO], hp, dout, dt, a->ldo, rq, a->NH, a->HD);
    if (!rc && fl_cudnn_dqacc_needs_zero(im->dnn->api.version)) /* cuDNN < 9.6: the accumulator starts at 0 */
        rc = flb_memset(ptr[FL_CUDNN_UID_DQACC], 0, fl_cudnn_sdpa_dqacc_bytes(&pa), STREAM);
    const char *what = dt == FL_BF16 ? "attention_backward_b16 (cuDNN)" : "attention_backward (cuDNN)";
    if (rc) return (*st = flb_attn_status(be, rc, what)), 1;
    int s = fl_cudnn_plan_run(&im->dnn->api, im->dnn->handle, p, ptr, buf + used);
    if (s) {
        char b[48], why[96];
        snprintf(why, sizeof why, "cudnnBackendExecute: %s", fl_cudnn_status_name(&im->dnn->api, s, b, sizeof b));
        flb_set_error(be, FL_ERR_UNSUPPORTED, what, why);
        return (*st = flb_sticky(be)), 1;
    }
    if (direct != 2) { /* the compact results: added into fp32 ones, or copied into the bf16 ones */
        void *dst[3] = {dq, dk, dv};
        const fl_dtype t = d16 ? FL_BF16 : FL_F32;
        if (d16) dst[0] = d16[0], dst[1] = d16[1], dst[2] = d16[2];
        rc = flb_dnn_out(be, dst[0], t, a->ldq, ptr[FL_CUDNN_UID_DQ], hp, rq, a->NH, a->HD, !d16);
        if (!rc) rc = flb_dnn_out(be, dst[1], t, a->ldk, ptr[FL_CUDNN_UID_DK], hp, rk, a->NKV, a->HD, !d16);
        if (!rc) rc = flb_dnn_out(be, dst[2], t, a->ldv, ptr[FL_CUDNN_UID_DV], hp, rk, a->NKV, a->HD, !d16);
    }
#ifdef FLB_CUDNN_NAMED_ONLY
    if (dt == FL_BF16) /* attention_backward_b16: the emulator's counts (cu_emu.h) */
        fl_cu_emu_dnn_b16++, fl_cu_emu_dnn_b16_grads += direct == 2,
            fl_cu_emu_dnn_b16_dout += ptr[FL_CUDNN_UID_DO] == dout;
#endif
    *st = flb_attn_status(be, rc, what);
    return 1;
}

/* whether cuDNN's backward may take the call: loaded, bf16 compute, a shape its graphs take, and not
 * FITLLM_CUDA_DETERMINISTIC (the own backward, whose dq adds run in a fixed order) */
static int flb_dnn_bwd_takes(const flb_impl *im, const fl_attn_desc *a, const float *bias, const uint8_t *kmask) {
    return im->dnn && !im->det && im->compute == FL_BF16 && !fl_cudnn_sdpa_refuse(a, bias, kmask);
}
/* 1: cuDNN ran it (or failed: *st says); 0: run the own kernels */
static int flb_cudnn_backward(const fl_backend *be, const fl_attn_desc *a, float *dq, float *dk, float *dv,
                              const float *dout, const void *q, const void *k, const void *v, fl_dtype it,
                              const float *bias, const uint8_t *kmask, const void *out, const float *lse, void *work,
                              fl_status *st) {
    if (!flb_dnn_bwd_takes(FLB_IMPL(be), a, bias, kmask)) return 0;
    return flb_cudnn_bwd(be, a, dq, dk, dv, NULL, dout, FL_F32, q, k, v, it, out, lse, work, st);
}

/* attention_b16_ok: cuDNN present and offered (FITLLM_CUDA_CUDNN_B16), bf16 compute, not deterministic, the shape
 * taken and a backward plan for the operands' layout */
static int flb_attention_b16_ok(const fl_backend *be, const fl_attn_desc *a, const void *q16, const void *k16,
                                const void *v16, const void *out16) {
    flb_impl *im = FLB_IMPL(be);
    if (!a || !flb_dnn_bwd_takes(im, a, NULL, NULL) || !im->dnn->b16 || !q16 || !k16 || !v16 || !out16 ||
        flb_sticky(be) != FL_OK)
        return 0;
    fl_cudnn_sdpa_layout L;
    int direct;
    return flb_dnn_plan_of(im, a, FL_BF16, q16, k16, v16, out16, 1, 0, &L, &direct) != NULL;
}
static fl_status flb_attention_backward_b16(const fl_backend *be, const fl_attn_desc *a, float *dq, float *dk,
                                            float *dv, void *dq16, void *dk16, void *dv16, const void *dout16,
                                            const void *q16, const void *k16, const void *v16, const void *out16,
                                            const float *lse) {
    FL_TRY(flb_sticky(be));
    FL_TRY(fl_attn_check_args("attention_backward_b16", a, FL_CU_ATTN_MAX_HD, "the CUDA kernels' tiles",
                              (const float *)out16, lse, (const float *)q16, (const float *)k16, (const float *)v16,
                              NULL, NULL));
    if (!dout16 || (dq16 ? !dk16 || !dv16 : !dq || !dk || !dv))
        return fl_errorf(FL_ERR_INVALID, "%s attention_backward_b16: NULL %s", FLB_NAME,
                         !dout16 ? "dout16" : dq16 ? "dk16 / dv16" : "gradient tensor");
    if (!flb_attention_b16_ok(be, a, q16, k16, v16, out16))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s attention_backward_b16: cuDNN's bf16 backward does not take this call "
                         "(attention_b16_ok)", FLB_NAME);
    void *work = flb_work(be, fl_cu_attention_work_bytes(a->B, a->NH, a->Tq), "attention_backward_b16");
    if (!work) return flb_sticky(be);
    void *d16[3] = {dq16, dk16, dv16};
    fl_status st = FL_OK;
    if (!flb_cudnn_bwd(be, a, dq, dk, dv, dq16 ? d16 : NULL, dout16, FL_BF16, q16, k16, v16, FL_BF16, out16, lse, work,
                       &st))
        return fl_errorf(FL_ERR_INTERNAL, "%s attention_backward_b16: cuDNN's plan went away", FLB_NAME);
    return st;
}
#endif

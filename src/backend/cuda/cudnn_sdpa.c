/* cuDNN's fused scaled-dot-product attention as backend-API operation graphs (contract: cudnn-impl.h;
 * EXPERIMENTAL: the descriptors are finalized against the real library in the tests, which needs no
 * GPU; the graphs, engines and numbers are checked on a GPU by `fitllm selftest --accelerator cuda`).
 *
 * cuDNN's fused flash engines recognize their graphs by pattern, node for node: an equivalent graph
 * written differently gets "no engine for the graph" (CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN, "Not
 * supported node in flash fprop"), as ours did on an H200 with cuDNN 9.19 until 2026-11-30. The graphs
 * below are therefore the ones cuDNN's own frontend emits (cudnn-frontend's SDPA nodes; checked against the
 * backend graph PyTorch 2.11's sdpa built on that machine, dumped with CUDNN_LOGLEVEL_DBG=3): K^T and V^T
 * are the non-virtual K and V tensors declared with their last two dims and strides swapped (not a
 * reshape of K), the causal compare has a boolean math precision, and the backward accumulates dQ in a
 * non-virtual fp32 tensor copied out by an identity.
 *
 * Forward (tensors (b, h, s, d); S and P virtual):
 *   S = Q . K^T;  S = S * scale
 *   causal: S = (row >= col) ? S : lowest     GEN_INDEX (axis 3, then 2), CMP_GE, BINARY_SELECT
 *   M = max_row S; E = exp(S - M); Z = sum_row E;  stats = M + log Z  (written out, fp32)
 *   P = E / Z (16-bit);  O = P . V
 * Backward (stats, O, dO in; dQ, dK, dV out):
 *   dP = dO . V^T;  S = Q . K^T;  dO*O;  K = reshape(K^T) (for dQ)
 *   S = S * scale - stats;  causal mask;  P = exp(S)
 *   dV = reshape(P)^T . dO          (grouped heads: a full-head dV summed over the group by a reduction)
 *   Dsum = rowsum(dO * O) * 1        (non-virtual fp32, the op's work area)
 *   dS = (dP - Dsum) * P * scale
 *   dQacc = dS . K (fp32, non-virtual);  dQ = identity(dQacc)
 *   dK = reshape(dS)^T . Q           (grouped heads: summed as dV)
 * The engines that fuse these are found by cuDNN's heuristics (mode A); the first configuration that
 * finalizes into an execution plan is kept. */
#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cudnn-impl.h"

/* ---- pure: the layout and the shape check (every build) ------------------------------------------ */

static void t4(fl_cudnn_t4 *t, int64_t b, int64_t h, int64_t s, int64_t d, int64_t sb, int64_t sh, int64_t ss,
               int64_t sd) {
    t->dim[0] = b, t->dim[1] = h, t->dim[2] = s, t->dim[3] = d;
    t->stride[0] = sb, t->stride[1] = sh, t->stride[2] = ss, t->stride[3] = sd;
}

void fl_cudnn_sdpa_layout_of(const fl_attn_desc *a, fl_dtype dt, fl_cudnn_sdpa_layout *L) {
    memset(L, 0, sizeof *L); /* the plan cache compares layouts bytewise */
    const int64_t B = a->B, Tq = a->Tq, Tk = a->Tk, NH = a->NH, NKV = a->NKV, HD = a->HD;
    /* compact rows (B, T, heads, HD) viewed (b, h, s, d) */
    t4(&L->q, B, NH, Tq, HD, Tq * NH * HD, HD, NH * HD, 1);
    t4(&L->o, B, NH, Tq, HD, Tq * NH * HD, HD, NH * HD, 1);
    t4(&L->k, B, NKV, Tk, HD, Tk * NKV * HD, HD, NKV * HD, 1);
    t4(&L->v, B, NKV, Tk, HD, Tk * NKV * HD, HD, NKV * HD, 1);
    t4(&L->stats, B, NH, Tq, 1, NH * Tq, Tq, 1, 1); /* the contract's lse (B, NH, Tq) */
    L->dq = L->q, L->dk = L->k, L->dv = L->v;
    L->io_dtype = dt == FL_F16 ? 2 /* CUDNN_DATA_HALF */ : 9 /* CUDNN_DATA_BFLOAT16 */;
    L->causal = a->causal ? 1 : 0;
    L->scale = a->scale;
}

void fl_cudnn_sdpa_layout_rows(const fl_attn_desc *a, fl_dtype dt, fl_cudnn_sdpa_layout *L) {
    fl_cudnn_sdpa_layout_of(a, dt, L);
    const int64_t Tq = a->Tq, Tk = a->Tk, HD = a->HD, lq = (int64_t)a->ldq, lk = (int64_t)a->ldk, lv = (int64_t)a->ldv;
    t4(&L->q, a->B, a->NH, Tq, HD, Tq * lq, HD, lq, 1);
    t4(&L->k, a->B, a->NKV, Tk, HD, Tk * lk, HD, lk, 1);
    t4(&L->v, a->B, a->NKV, Tk, HD, Tk * lv, HD, lv, 1);
}

void fl_cudnn_sdpa_layout_grad_rows(const fl_attn_desc *a, fl_dtype dt, fl_cudnn_sdpa_layout *L) {
    fl_cudnn_sdpa_layout_rows(a, dt, L);
    L->dq = L->q, L->dk = L->k, L->dv = L->v;
}

int fl_cudnn_sdpa_direct_ok(const fl_attn_desc *a, const void *q, const void *k, const void *v) {
    const uintptr_t m = (uintptr_t)q | (uintptr_t)k | (uintptr_t)v;
    return q && k && v && m % 16 == 0 && a->HD % 8 == 0 && a->ldq % 8 == 0 && a->ldk % 8 == 0 &&
           a->ldv % 8 == 0; /* 8 bf16 = 16 bytes; a padded head size has only copies */
}

int fl_cudnn_sdpa_pad(const fl_attn_desc *a, fl_attn_desc *p) {
    *p = *a;
    const int hp = (a->HD + 7) / 8 * 8;
    p->HD = hp;
    p->ldq = p->ldo = (size_t)a->NH * hp, p->ldk = p->ldv = (size_t)a->NKV * hp;
    return hp != a->HD;
}

const char *fl_cudnn_sdpa_refuse(const fl_attn_desc *a, const float *bias, const uint8_t *kmask) {
    if (!a || a->B <= 0 || a->Tq <= 0 || a->Tk <= 0 || a->NH <= 0 || a->NKV <= 0) return "an empty shape";
    /* the fused flash engines' head sizes: multiples of 8 up to 128 on every GPU generation cuDNN 9 runs them (others
     * run zero-padded to the next multiple of 8: fl_cudnn_sdpa_pad; a size its heuristics still refuse falls back to
     * the own kernels at run time, said once) */
    if (a->HD < 1 || a->HD > 128) return "head size above 128";
    if (a->NH % a->NKV) return "query heads not a multiple of key/value heads";
    if (bias) return "an attention bias";
    if (a->drop_p > 0) return "dropout on the attention weights";
    if (kmask) return "a key padding mask";
    if (a->causal && a->Tq != a->Tk) return "causal with Tq != Tk (bottom-right alignment)";
    if (a->ldo != (size_t)a->NH * a->HD) return "output rows with a stride";
    return NULL;
}

static size_t al256(size_t b) { return (b + 255) & ~(size_t)255; }

size_t fl_cudnn_sdpa_copy_bytes(const fl_attn_desc *a, int backward) {
    const size_t bq = al256((size_t)a->B * a->Tq * a->NH * a->HD * 2), bk = al256((size_t)a->B * a->Tk * a->NKV * a->HD * 2);
    return backward ? 4 * bq + 4 * bk : 2 * bq + 2 * bk;
}

size_t fl_cudnn_sdpa_dqacc_bytes(const fl_attn_desc *a) {
    return al256((size_t)a->B * a->Tq * a->NH * a->HD * sizeof(float));
}

size_t fl_cudnn_sdpa_workspace_allowance(const fl_attn_desc *a) {
    const size_t rq = ((size_t)a->Tq + 63) / 64 * 64, rk = ((size_t)a->Tk + 63) / 64 * 64; /* rows as tiled */
    const size_t dq = al256((size_t)a->B * a->NH * rq * a->HD * sizeof(float));             /* sm_80's own dQ */
    const size_t full = a->NKV < a->NH ? 2 * al256((size_t)a->B * a->NH * rk * a->HD * 2) : 0; /* dK, dV per head */
    return dq + full + 1024;
}

size_t fl_cudnn_sdpa_scratch_bytes(int B, int T, int NH, int NKV, int HD) {
    fl_attn_desc a = {0}, p;
    a.B = B, a.Tq = a.Tk = T, a.NH = NH, a.NKV = NKV, a.HD = HD, a.causal = 1, a.ldo = (size_t)NH * HD;
    if (fl_cudnn_sdpa_refuse(&a, NULL, NULL)) return 0;
    fl_cudnn_sdpa_pad(&a, &p); /* cuDNN's head size */
    /* the backward's copies, its fp32 dQ accumulator, and the allowance for the plan's own workspace */
    return fl_cudnn_sdpa_copy_bytes(&p, 1) + fl_cudnn_sdpa_dqacc_bytes(&p) + fl_cudnn_sdpa_workspace_allowance(&p);
}

/* cuDNN's SDPA operation graphs through the backend API (contract: cudnn-impl.h; the node list is in
 * cudnn_sdpa.c's header comment). Compiled with cuDNN's headers where CMake found them
 * (FL_HAVE_CUDNN_H: the enum values come from cudnn_backend.h, nothing is linked); without them,
 * stubs that say so. EXPERIMENTAL: tests/test_cudnn.c finalizes every descriptor here against the
 * real library on a machine without a GPU, and plans both graphs for an H200 and an A100 described
 * by cuDNN's device-properties JSON (fl_cudnn_sdpa_probe: with the toolkit's stub libcuda, cuDNN's
 * checks run and its chosen kernel compiles; only loading it needs the GPU); the execution needs
 * one (`fitllm selftest --accelerator cuda`). */
#include <float.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cudnn-impl.h"

#ifdef FL_HAVE_CUDNN_H
#include <cudnn_backend.h>

#define GB_MAX 96 /* descriptors of one graph: tensors, nodes and their parameter descriptors */

struct fl_cudnn_plan {
    void *plan;       /* CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR */
    size_t workspace; /* bytes */
    int64_t engine;   /* the engine's global index (-1: not told), and its configuration's place in the */
    int rank;         /* heuristics' list (0 = their first choice) */
    int backward, causal;
    float scale, lowest, one; /* the by-value scalars' host values */
};

/* one graph being built: every descriptor made (freed at the end), the operation nodes in order, and
 * the first failure */
typedef struct {
    const fl_cudnn_api *api;
    void *d[GB_MAX];
    int nd;
    void *ops[GB_MAX];
    int nops;
    int64_t next_uid; /* virtual tensors' ids */
    int bad;
    char *why;
    size_t n;
} gb;

static void gb_fail(gb *g, const char *what, int status) {
    if (g->bad) return;
    g->bad = 1;
    char b[48];
    snprintf(g->why, g->n, "%s: %s", what, fl_cudnn_status_name(g->api, status, b, sizeof b));
}
static void *gb_new(gb *g, cudnnBackendDescriptorType_t type, const char *what) {
    if (g->bad) return NULL;
    if (g->nd == GB_MAX) {
        gb_fail(g, what, CUDNN_STATUS_NOT_SUPPORTED);
        return NULL;
    }
    void *d = NULL;
    int s = g->api->be_create((int)type, &d);
    if (s) {
        gb_fail(g, what, s);
        return NULL;
    }
    return g->d[g->nd++] = d;
}
static void gb_set(gb *g, void *d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
                   const void *v, const char *what) {
    if (g->bad) return;
    int s = g->api->be_set(d, (int)name, (int)type, count, v);
    if (s) gb_fail(g, what, s);
}
static void gb_fin(gb *g, void *d, const char *what) {
    if (g->bad) return;
    int s = g->api->be_finalize(d);
    if (s) gb_fail(g, what, s);
}
static void gb_free(gb *g) {
    for (int i = g->nd - 1; i >= 0; i--) g->api->be_destroy(g->d[i]);
    g->nd = 0;
}

/* a tensor: uid 0 = virtual (an id of its own); by_value: a host scalar */
static void *gb_tensor(gb *g, int64_t uid, cudnnDataType_t dt, const int64_t dim[4], const int64_t stride[4],
                       int by_value, const char *what) {
    void *t = gb_new(g, CUDNN_BACKEND_TENSOR_DESCRIPTOR, what);
    bool virt = uid == 0, byv = by_value != 0;
    if (virt) uid = g->next_uid++;
    int64_t align = 16;
    gb_set(g, t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt, what);
    gb_set(g, t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dim, what);
    gb_set(g, t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, stride, what);
    gb_set(g, t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, what);
    gb_set(g, t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, what);
    if (virt) gb_set(g, t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt, what);
    if (byv) gb_set(g, t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &byv, what);
    gb_fin(g, t, what);
    return t;
}
/* a virtual (b, h, r, c) tensor, packed row-major */
static void *gb_virt(gb *g, cudnnDataType_t dt, int64_t b, int64_t h, int64_t r, int64_t c, const char *what) {
    const int64_t dim[4] = {b, h, r, c}, stride[4] = {h * r * c, r * c, c, 1};
    return gb_tensor(g, 0, dt, dim, stride, 0, what);
}
static void *gb_t4(gb *g, int64_t uid, cudnnDataType_t dt, const fl_cudnn_t4 *t, const char *what) {
    return gb_tensor(g, uid, dt, t->dim, t->stride, 0, what);
}
static void gb_op(gb *g, void *op, const char *what) {
    gb_fin(g, op, what);
    if (!g->bad) g->ops[g->nops++] = op;
}

static void gb_matmul(gb *g, void *a, void *b, void *c, const char *what) {
    cudnnDataType_t f = CUDNN_DATA_FLOAT;
    void *m = gb_new(g, CUDNN_BACKEND_MATMUL_DESCRIPTOR, what);
    gb_set(g, m, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f, what);
    gb_fin(g, m, what);
    void *op = gb_new(g, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, what);
    gb_set(g, op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a, what);
    gb_set(g, op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b, what);
    gb_set(g, op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c, what);
    gb_set(g, op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &m, what);
    gb_op(g, op, what);
}
/* y = mode(x[, b[, t]]); axis >= 0: GEN_INDEX's axis */
static void gb_pw(gb *g, cudnnPointwiseMode_t mode, void *x, void *b, void *t, void *y, int64_t axis, const char *what) {
    /* the compare's math precision is boolean, everything else fp32: what cuDNN's pattern matcher expects */
    cudnnDataType_t f = mode == CUDNN_POINTWISE_CMP_GE ? CUDNN_DATA_BOOLEAN : CUDNN_DATA_FLOAT;
    void *p = gb_new(g, CUDNN_BACKEND_POINTWISE_DESCRIPTOR, what);
    gb_set(g, p, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, what);
    gb_set(g, p, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &f, what);
    if (axis >= 0) gb_set(g, p, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, what);
    gb_fin(g, p, what);
    void *op = gb_new(g, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, what);
    gb_set(g, op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &p, what);
    gb_set(g, op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, what);
    if (b) gb_set(g, op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b, what);
    if (t) gb_set(g, op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t, what);
    gb_set(g, op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, what);
    gb_op(g, op, what);
}
static void gb_reduce(gb *g, cudnnReduceTensorOp_t how, void *x, void *y, const char *what) {
    cudnnDataType_t f = CUDNN_DATA_FLOAT;
    void *r = gb_new(g, CUDNN_BACKEND_REDUCTION_DESCRIPTOR, what);
    gb_set(g, r, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f, what);
    gb_set(g, r, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &how, what);
    gb_fin(g, r, what);
    void *op = gb_new(g, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, what);
    gb_set(g, op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, what);
    gb_set(g, op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, what);
    gb_set(g, op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &r, what);
    gb_op(g, op, what);
}
/* t with its last two dims and strides swapped */
static fl_cudnn_t4 t4_swap(const fl_cudnn_t4 *t) {
    fl_cudnn_t4 r = {{t->dim[0], t->dim[1], t->dim[3], t->dim[2]}, {t->stride[0], t->stride[1], t->stride[3], t->stride[2]}};
    return r;
}
/* y (virtual, of type dt): x's last two dims swapped by a reshape node (xt: x's dims and strides) */
static void *gb_transpose(gb *g, void *x, cudnnDataType_t dt, const fl_cudnn_t4 *xt, const char *what) {
    const fl_cudnn_t4 yt = t4_swap(xt);
    void *y = gb_tensor(g, 0, dt, yt.dim, yt.stride, 0, what);
    void *op = gb_new(g, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, what);
    gb_set(g, op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, what);
    gb_set(g, op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, what);
    gb_op(g, op, what);
    return y;
}
static fl_cudnn_t4 packed(int64_t b, int64_t h, int64_t r, int64_t c) {
    fl_cudnn_t4 t = {{b, h, r, c}, {h * r * c, r * c, c, 1}};
    return t;
}

/* the causal mask on x (b, h, sq, skv) fp32: (row >= col) ? x : lowest */
static void *gb_causal(gb *g, void *x, int64_t B, int64_t H, int64_t SQ, int64_t SK, void *lowest) {
    void *col = gb_virt(g, CUDNN_DATA_INT32, B, H, SQ, SK, "tensor column index");
    void *row = gb_virt(g, CUDNN_DATA_INT32, B, H, SQ, SK, "tensor row index");
    void *keep = gb_virt(g, CUDNN_DATA_BOOLEAN, B, H, SQ, SK, "tensor causal mask");
    void *y = gb_virt(g, CUDNN_DATA_FLOAT, B, H, SQ, SK, "tensor masked S");
    gb_pw(g, CUDNN_POINTWISE_GEN_INDEX, x, NULL, NULL, col, 3, "pointwise column index");
    gb_pw(g, CUDNN_POINTWISE_GEN_INDEX, x, NULL, NULL, row, 2, "pointwise row index");
    gb_pw(g, CUDNN_POINTWISE_CMP_GE, row, col, NULL, keep, -1, "pointwise row >= column");
    gb_pw(g, CUDNN_POINTWISE_BINARY_SELECT, x, lowest, keep, y, -1, "pointwise causal select");
    return y;
}

/* kt, vt: the non-virtual K^T / V^T views; s_*: what both graphs name alike */
static void gb_forward(gb *g, const fl_cudnn_sdpa_layout *L, void *q, void *kt, void *v, void *scale, void *lowest) {
    const cudnnDataType_t io = (cudnnDataType_t)L->io_dtype, f = CUDNN_DATA_FLOAT;
    const int64_t B = L->q.dim[0], H = L->q.dim[1], SQ = L->q.dim[2], SK = L->k.dim[2];
    void *s0 = gb_virt(g, f, B, H, SQ, SK, "tensor S");
    gb_matmul(g, q, kt, s0, "matmul S = Q.K^T");
    void *s = gb_virt(g, f, B, H, SQ, SK, "tensor S*scale");
    gb_pw(g, CUDNN_POINTWISE_MUL, s0, scale, NULL, s, -1, "pointwise S*scale");
    if (L->causal) s = gb_causal(g, s, B, H, SQ, SK, lowest);
    void *m = gb_virt(g, f, B, H, SQ, 1, "tensor row max");
    gb_reduce(g, CUDNN_REDUCE_TENSOR_MAX, s, m, "reduction row max");
    void *d = gb_virt(g, f, B, H, SQ, SK, "tensor S - max");
    gb_pw(g, CUDNN_POINTWISE_SUB, s, m, NULL, d, -1, "pointwise S - max");
    void *e = gb_virt(g, f, B, H, SQ, SK, "tensor exp");
    gb_pw(g, CUDNN_POINTWISE_EXP, d, NULL, NULL, e, -1, "pointwise exp");
    void *z = gb_virt(g, f, B, H, SQ, 1, "tensor row sum");
    gb_reduce(g, CUDNN_REDUCE_TENSOR_ADD, e, z, "reduction row sum");
    void *lz = gb_virt(g, f, B, H, SQ, 1, "tensor log sum");
    gb_pw(g, CUDNN_POINTWISE_LOG, z, NULL, NULL, lz, -1, "pointwise log");
    void *stats = gb_t4(g, FL_CUDNN_UID_STATS, f, &L->stats, "tensor stats");
    gb_pw(g, CUDNN_POINTWISE_ADD, m, lz, NULL, stats, -1, "pointwise stats = max + log sum");
    void *p = gb_virt(g, io, B, H, SQ, SK, "tensor P");
    gb_pw(g, CUDNN_POINTWISE_DIV, e, z, NULL, p, -1, "pointwise P = exp / sum");
    void *o = gb_t4(g, FL_CUDNN_UID_O, io, &L->o, "tensor O");
    gb_matmul(g, p, v, o, "matmul O = P.V");
}

/* out (b, hk, s, d) = at . b: directly when the heads are not grouped, else through a full-head 16-bit tensor
 * summed over each group of NH/NKV heads by a reduction (the frontend's dK / dV "fullhead") */
static void gb_matmul_grouped(gb *g, const fl_cudnn_sdpa_layout *L, void *at, void *b, int64_t uid,
                              const fl_cudnn_t4 *t, const char *what) {
    const cudnnDataType_t io = (cudnnDataType_t)L->io_dtype;
    if (L->q.dim[1] == t->dim[1]) {
        gb_matmul(g, at, b, gb_t4(g, uid, io, t, what), what);
        return;
    }
    void *full = gb_virt(g, io, t->dim[0], L->q.dim[1], t->dim[2], t->dim[3], what);
    gb_matmul(g, at, b, full, what);
    gb_reduce(g, CUDNN_REDUCE_TENSOR_ADD, full, gb_t4(g, uid, io, t, what), what);
}

static void gb_backward(gb *g, const fl_cudnn_sdpa_layout *L, void *q, void *kt, void *vt, void *scale, void *lowest,
                        void *one) {
    const cudnnDataType_t io = (cudnnDataType_t)L->io_dtype, f = CUDNN_DATA_FLOAT;
    const int64_t B = L->q.dim[0], H = L->q.dim[1], SQ = L->q.dim[2], SK = L->k.dim[2], D = L->q.dim[3];
    void *o = gb_t4(g, FL_CUDNN_UID_O, io, &L->o, "tensor O");
    void *dout = gb_t4(g, FL_CUDNN_UID_DO, io, &L->o, "tensor dO");
    void *stats = gb_t4(g, FL_CUDNN_UID_STATS, f, &L->stats, "tensor stats");
    void *dp = gb_virt(g, f, B, H, SQ, SK, "tensor dP");
    gb_matmul(g, dout, vt, dp, "matmul dP = dO.V^T");
    void *s0 = gb_virt(g, f, B, H, SQ, SK, "tensor S");
    gb_matmul(g, q, kt, s0, "matmul S = Q.K^T");
    const int64_t dd[4] = {B, H, SQ, D}, ds[4] = {H * SQ * D, SQ * D, H * D, 1}; /* the frontend's strides */
    void *doo = gb_tensor(g, 0, f, dd, ds, 0, "tensor dO*O");
    gb_pw(g, CUDNN_POINTWISE_MUL, dout, o, NULL, doo, -1, "pointwise dO*O");
    const fl_cudnn_t4 ktt = t4_swap(&L->k); /* K^T's dims and strides, whose swap is K's */
    void *k = gb_transpose(g, kt, f, &ktt, "reshape K");
    void *s1 = gb_virt(g, f, B, H, SQ, SK, "tensor S*scale");
    gb_pw(g, CUDNN_POINTWISE_MUL, s0, scale, NULL, s1, -1, "pointwise S*scale");
    void *s = gb_virt(g, f, B, H, SQ, SK, "tensor S - stats");
    gb_pw(g, CUDNN_POINTWISE_SUB, s1, stats, NULL, s, -1, "pointwise S - stats");
    if (L->causal) s = gb_causal(g, s, B, H, SQ, SK, lowest);
    void *p = gb_virt(g, f, B, H, SQ, SK, "tensor P");
    gb_pw(g, CUDNN_POINTWISE_EXP, s, NULL, NULL, p, -1, "pointwise P = exp");
    const fl_cudnn_t4 ps = packed(B, H, SQ, SK);
    void *pt = gb_transpose(g, p, io, &ps, "reshape P^T");
    gb_matmul_grouped(g, L, pt, dout, FL_CUDNN_UID_DV, &L->dv, "matmul dV = P^T.dO");
    void *rs = gb_virt(g, f, B, H, SQ, 1, "tensor rowsum(dO*O)");
    gb_reduce(g, CUDNN_REDUCE_TENSOR_ADD, doo, rs, "reduction rowsum(dO*O)");
    void *dsum = gb_t4(g, FL_CUDNN_UID_DSUM, f, &L->stats, "tensor Dsum");
    gb_pw(g, CUDNN_POINTWISE_MUL, rs, one, NULL, dsum, -1, "pointwise Dsum = rowsum * 1");
    void *t1 = gb_virt(g, f, B, H, SQ, SK, "tensor dP - Dsum");
    gb_pw(g, CUDNN_POINTWISE_SUB, dp, dsum, NULL, t1, -1, "pointwise dP - Dsum");
    void *t2 = gb_virt(g, f, B, H, SQ, SK, "tensor (dP - Dsum)*P");
    gb_pw(g, CUDNN_POINTWISE_MUL, t1, p, NULL, t2, -1, "pointwise (dP - Dsum)*P");
    void *dsf = gb_virt(g, f, B, H, SQ, SK, "tensor dS");
    gb_pw(g, CUDNN_POINTWISE_MUL, t2, scale, NULL, dsf, -1, "pointwise dS*scale");
    const fl_cudnn_t4 qa = packed(B, H, SQ, D);
    void *dqacc = gb_t4(g, FL_CUDNN_UID_DQACC, f, &qa, "tensor dQ accumulator");
    gb_matmul(g, dsf, k, dqacc, "matmul dQ = dS.K");
    void *dq = gb_t4(g, FL_CUDNN_UID_DQ, io, &L->dq, "tensor dQ");
    gb_pw(g, CUDNN_POINTWISE_IDENTITY, dqacc, NULL, NULL, dq, -1, "pointwise dQ = identity(dQ accumulator)");
    const fl_cudnn_t4 dss = packed(B, H, SQ, SK);
    void *dst = gb_transpose(g, dsf, io, &dss, "reshape dS^T");
    gb_matmul_grouped(g, L, dst, q, FL_CUDNN_UID_DK, &L->dk, "matmul dK = dS^T.Q");
}

/* the engine (global index) behind an engine configuration; -1 when cuDNN does not say */
static int64_t cfg_engine(const fl_cudnn_api *api, void *cfg) {
    void *eng = NULL;
    int64_t ne = 0, idx = -1;
    if (api->be_create(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &eng)) return -1;
    if (api->be_get(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &ne, &eng) ||
        api->be_get(eng, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &ne, &idx))
        idx = -1;
    api->be_destroy(eng);
    return idx;
}

typedef struct {
    size_t ws;
    int64_t engine;
    int rank, status; /* status: the last plan's finalize (the first's when first_only) */
} gb_result;

/* the execution plan of the finalized operation graph: heuristics (mode A), the first configuration that
 * finalizes (first_only: the first configuration only, its status in r whatever it is). devprop (not NULL):
 * the heuristics and the plan for the device it describes, no handle (cuDNN >= 9.8) */
static void *gb_plan(gb *g, void *handle, void *devprop, void *graph, int first_only, gb_result *r) {
    cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    void *h = gb_new(g, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "engine heuristics");
    gb_set(g, h, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph, "engine heuristics");
    gb_set(g, h, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "engine heuristics");
#if CUDNN_MAJOR > 9 || (CUDNN_MAJOR == 9 && CUDNN_MINOR >= 8)
    if (devprop)
        gb_set(g, h, CUDNN_ATTR_ENGINEHEUR_DEVICEPROP, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &devprop, "engine heuristics");
#endif
    gb_fin(g, h, "engine heuristics");
    enum { NCFG = 8 };
    void *cfg[NCFG];
    for (int i = 0; i < NCFG; i++) cfg[i] = gb_new(g, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine configuration");
    if (g->bad) return NULL;
    int64_t got = 0;
    int s = g->api->be_get(h, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, NCFG, &got, cfg);
    if (s) {
        gb_fail(g, "engine heuristics' results", s);
        return NULL;
    }
    int last = CUDNN_STATUS_NOT_SUPPORTED;
    for (int64_t i = 0; i < got && i < NCFG; i++) {
        void *plan = NULL;
        if ((last = g->api->be_create(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan)) != 0) break;
#if CUDNN_MAJOR > 9 || (CUDNN_MAJOR == 9 && CUDNN_MINOR >= 8)
        if (devprop)
            last = g->api->be_set(plan, CUDNN_ATTR_EXECUTION_PLAN_DEVICEPROP, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &devprop);
        else
#endif
            last = g->api->be_set(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
        if (!last) last = g->api->be_set(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                         &cfg[i]);
        if (!last) last = g->api->be_finalize(plan);
        int64_t w = 0, nw = 0;
        if (!last) last = g->api->be_get(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &nw, &w);
        r->status = last, r->rank = (int)i;
        if (!last || first_only) r->engine = cfg_engine(g->api, cfg[i]);
        if (first_only) { /* the configuration's own workspace figure (the plan's, when it finalizes) */
            int64_t cw = 0, nc = 0;
            if (!g->api->be_get(cfg[i], CUDNN_ATTR_ENGINECFG_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &nc, &cw) && nc == 1)
                r->ws = (size_t)(cw > 0 ? cw : 0);
        }
        if (!last) {
            r->ws = (size_t)(w > 0 ? w : 0);
            return plan; /* the caller owns it */
        }
        g->api->be_destroy(plan);
        if (first_only) break;
    }
    gb_fail(g, got ? "execution plan (no engine configuration finalized)" : "engine heuristics (no engine for the graph)",
            last);
    return NULL;
}

/* the graphs, and their plan when handle or devprop is given (probe: the first configuration only, r->status) */
static int sdpa_build(const fl_cudnn_api *api, void *handle, void *devprop, const fl_cudnn_sdpa_layout *L, int backward,
                      int probe, fl_cudnn_plan **out, gb_result *r, char *why, size_t n) {
    *out = NULL;
    gb g;
    memset(&g, 0, sizeof g);
    g.api = api, g.why = why, g.n = n, g.next_uid = 1000;
    if (why && n) why[0] = '\0';
    const cudnnDataType_t io = (cudnnDataType_t)L->io_dtype;
    static const int64_t one[4] = {1, 1, 1, 1};
    /* K enters every graph as K^T (its own memory, dims and strides swapped); V as V^T in the backward */
    const fl_cudnn_t4 kt = t4_swap(&L->k), vt = t4_swap(&L->v);
    void *q = gb_t4(&g, FL_CUDNN_UID_Q, io, &L->q, "tensor Q");
    void *k = gb_t4(&g, FL_CUDNN_UID_K, io, &kt, "tensor K^T");
    void *v = gb_t4(&g, FL_CUDNN_UID_V, io, backward ? &vt : &L->v, backward ? "tensor V^T" : "tensor V");
    void *scale = gb_tensor(&g, FL_CUDNN_UID_SCALE, CUDNN_DATA_FLOAT, one, one, 1, "tensor scale");
    void *lowest = L->causal ? gb_tensor(&g, FL_CUDNN_UID_NEG, CUDNN_DATA_FLOAT, one, one, 1, "tensor lowest") : NULL;
    if (backward) {
        void *unit = gb_tensor(&g, FL_CUDNN_UID_ONE, CUDNN_DATA_FLOAT, one, one, 1, "tensor one");
        gb_backward(&g, L, q, k, v, scale, lowest, unit);
    } else {
        gb_forward(&g, L, q, k, v, scale, lowest);
    }
    void *graph = gb_new(&g, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
    gb_set(&g, graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, g.nops, g.ops, "operation graph");
    if ((!handle && !devprop) || g.bad) { /* neither: everything up to the graph checked (the tests) */
        gb_free(&g);
        return g.bad ? -1 : 0;
    }
    if (!devprop) gb_set(&g, graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "operation graph");
    gb_fin(&g, graph, "operation graph");
    void *plan = g.bad ? NULL : gb_plan(&g, handle, devprop, graph, probe, r);
    gb_free(&g);
    if (!plan) return -1;
    if (probe) {
        api->be_destroy(plan);
        return 0;
    }
    fl_cudnn_plan *p = (fl_cudnn_plan *)calloc(1, sizeof *p);
    if (!p) {
        api->be_destroy(plan);
        snprintf(why, n, "out of host memory");
        return -1;
    }
    p->plan = plan, p->workspace = r->ws, p->engine = r->engine, p->rank = r->rank, p->backward = backward, p->causal = L->causal, p->scale = L->scale, p->lowest = -FLT_MAX, p->one = 1.0f;
    *out = p;
    return 0;
}

int fl_cudnn_sdpa_build(const fl_cudnn_api *api, void *handle, const fl_cudnn_sdpa_layout *L, int backward,
                        fl_cudnn_plan **out, char *why, size_t n) {
    gb_result r = {0, -1, 0, 0};
    return sdpa_build(api, handle, NULL, L, backward, 0, out, &r, why, n);
}

int fl_cudnn_sdpa_probe(const fl_cudnn_api *api, void *devprop, const fl_cudnn_sdpa_layout *L, int backward,
                        int64_t *engine, size_t *workspace, char *why, size_t n) {
    gb_result r = {0, -1, 0, CUDNN_STATUS_NOT_SUPPORTED};
    fl_cudnn_plan *p = NULL;
    *engine = -1, *workspace = 0;
    if (sdpa_build(api, NULL, devprop, L, backward, 1, &p, &r, why, n) == 0)
        return *engine = r.engine, *workspace = r.ws, 0;
    if (r.status != CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER) return -1; /* why: the failing step */
    *engine = r.engine, *workspace = r.ws;
    char b[48];
    snprintf(why, n, "engine %lld compiled, not loaded: %s", (long long)r.engine,
             fl_cudnn_status_name(api, r.status, b, sizeof b));
    return 1;
}

size_t fl_cudnn_plan_workspace(const fl_cudnn_plan *p) { return p ? p->workspace : 0; }
int64_t fl_cudnn_plan_engine(const fl_cudnn_plan *p, int *rank) {
    if (rank) *rank = p ? p->rank : 0;
    return p ? p->engine : -1;
}

int fl_cudnn_devprop_json(const fl_cudnn_api *api, const char *json, void **out, char *why, size_t n) {
    *out = NULL;
#if CUDNN_MAJOR > 9 || (CUDNN_MAJOR == 9 && CUDNN_MINOR >= 8)
    if (api->version < 90800) {
        snprintf(why, n, "cuDNN %zu: device properties without a device need 9.8 or newer", api->version);
        return -1;
    }
    void *d = NULL;
    char b[48];
    int s = api->be_create(CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR, &d);
    if (!s) s = api->be_set(d, CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION, CUDNN_TYPE_CHAR, (int64_t)strlen(json), json);
    if (!s) s = api->be_finalize(d);
    if (s) {
        snprintf(why, n, "device properties from JSON: %s", fl_cudnn_status_name(api, s, b, sizeof b));
        if (d) api->be_destroy(d);
        return -1;
    }
    *out = d;
    return 0;
#else
    (void)api, (void)json;
    snprintf(why, n, "built with cuDNN %d.%d's headers: device properties without a device need 9.8 or newer",
             CUDNN_MAJOR, CUDNN_MINOR);
    return -1;
#endif
}
void fl_cudnn_plan_free(const fl_cudnn_api *api, fl_cudnn_plan *p) {
    if (!p) return;
    api->be_destroy(p->plan);
    free(p);
}

int fl_cudnn_plan_run(const fl_cudnn_api *api, void *handle, fl_cudnn_plan *p, void *const ptr[FL_CUDNN_UID_COUNT],
                      void *workspace) {
    static const int fwd[] = {FL_CUDNN_UID_Q, FL_CUDNN_UID_K, FL_CUDNN_UID_V, FL_CUDNN_UID_O, FL_CUDNN_UID_STATS};
    static const int bwd[] = {FL_CUDNN_UID_Q,  FL_CUDNN_UID_K,  FL_CUDNN_UID_V,  FL_CUDNN_UID_O, FL_CUDNN_UID_STATS,
                              FL_CUDNN_UID_DO, FL_CUDNN_UID_DQ, FL_CUDNN_UID_DK, FL_CUDNN_UID_DV, FL_CUDNN_UID_DSUM,
                              FL_CUDNN_UID_DQACC};
    const int *ids = p->backward ? bwd : fwd;
    const int n = p->backward ? (int)(sizeof bwd / sizeof bwd[0]) : (int)(sizeof fwd / sizeof fwd[0]);
    int64_t uid[16];
    void *dp[16];
    int m = 0;
    for (int i = 0; i < n; i++) uid[m] = ids[i], dp[m++] = ptr[ids[i]];
    uid[m] = FL_CUDNN_UID_SCALE, dp[m++] = &p->scale; /* by value: host pointers */
    if (p->causal) uid[m] = FL_CUDNN_UID_NEG, dp[m++] = &p->lowest;
    if (p->backward) uid[m] = FL_CUDNN_UID_ONE, dp[m++] = &p->one;
    void *vp = NULL;
    int s = api->be_create(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp);
    if (s) return s;
    s = api->be_set(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, m, uid);
    if (!s) s = api->be_set(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, m, dp);
    if (!s) s = api->be_set(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
    if (!s) s = api->be_finalize(vp);
    if (!s) s = api->be_execute(handle, p->plan, vp);
    api->be_destroy(vp);
    return s;
}

#else
/* built without cuDNN's headers: the graphs cannot be described, so cuDNN is never used */
int fl_cudnn_sdpa_build(const fl_cudnn_api *api, void *handle, const fl_cudnn_sdpa_layout *L, int backward,
                        fl_cudnn_plan **out, char *why, size_t n) {
    (void)api, (void)handle, (void)L, (void)backward;
    *out = NULL;
    snprintf(why, n, "this fitllm was built without cuDNN's headers (cudnn_backend.h)");
    return -1;
}
int fl_cudnn_sdpa_probe(const fl_cudnn_api *api, void *devprop, const fl_cudnn_sdpa_layout *L, int backward,
                        int64_t *engine, size_t *workspace, char *why, size_t n) {
    (void)api, (void)devprop, (void)L, (void)backward;
    *engine = -1, *workspace = 0;
    snprintf(why, n, "this fitllm was built without cuDNN's headers (cudnn_backend.h)");
    return -1;
}
size_t fl_cudnn_plan_workspace(const fl_cudnn_plan *p) { (void)p; return 0; }
int64_t fl_cudnn_plan_engine(const fl_cudnn_plan *p, int *rank) {
    (void)p;
    if (rank) *rank = 0;
    return -1;
}
int fl_cudnn_devprop_json(const fl_cudnn_api *api, const char *json, void **out, char *why, size_t n) {
    (void)api, (void)json;
    *out = NULL;
    snprintf(why, n, "this fitllm was built without cuDNN's headers (cudnn_backend.h)");
    return -1;
}
void fl_cudnn_plan_free(const fl_cudnn_api *api, fl_cudnn_plan *p) { (void)api, (void)p; }
int fl_cudnn_plan_run(const fl_cudnn_api *api, void *handle, fl_cudnn_plan *p, void *const ptr[FL_CUDNN_UID_COUNT],
                      void *workspace) {
    (void)api, (void)handle, (void)p, (void)ptr, (void)workspace;
    return 3000; /* CUDNN_STATUS_NOT_SUPPORTED */
}
#endif

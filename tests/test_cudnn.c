/* cuDNN's fused attention (src/backend/cuda/cudnn_*.c, cuda-cudnn-impl.h): what can be checked without
 * a GPU. The loader's failures (no library, a library without cuDNN's symbols, one too old, a handle
 * refused) with a stand-in library (tests/cuda/fake_cudnn.c) and a file that is not cuDNN; the
 * FITLLM_CUDA_ATTN choice; the shape check and the layout (pure functions, against values written
 * here from the fl_attn_desc contract); the graphs' descriptors through injected functions that
 * record them (every tensor's dims and strides, the variant pack's ids and pointers); and, where the
 * real libcudnn.so.9 is installed, every tensor and operation descriptor of both graphs finalized by
 * cuDNN itself, and both graphs planned for an H200, an A100 and an RTX 4090 without any (cuDNN >= 9.8's device
 * properties, the toolkit's stub libcuda: cuDNN ranks, checks and compiles; the engine it ranks first
 * must be the one it gives its own frontend's graphs, tests/fixtures/cudnn-engines.txt). The run needs a
 * GPU: `fitllm selftest --accelerator cuda`. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/cuda/cudnn-impl.h"
#include "fitllm/backend.h"
#include "test.h"

FL_TEST(cudnn_attn_choice) {
    FL_CHECK(fl_cudnn_attn_parse(NULL) == FL_CUDNN_ATTN_AUTO);
    FL_CHECK(fl_cudnn_attn_parse("") == FL_CUDNN_ATTN_AUTO);
    FL_CHECK(fl_cudnn_attn_parse("auto") == FL_CUDNN_ATTN_AUTO);
    FL_CHECK(fl_cudnn_attn_parse("cudnn") == FL_CUDNN_ATTN_CUDNN);
    FL_CHECK(fl_cudnn_attn_parse("own") == FL_CUDNN_ATTN_OWN);
    FL_CHECK(fl_cudnn_attn_parse("legacy") == FL_CUDNN_ATTN_LEGACY);
    FL_CHECK(fl_cudnn_attn_parse("fp32") == FL_CUDNN_ATTN_FP32);
    FL_CHECK(fl_cudnn_attn_parse("CUDNN") == -1);
    FL_CHECK(fl_cudnn_attn_wants(FL_CUDNN_ATTN_AUTO) && fl_cudnn_attn_wants(FL_CUDNN_ATTN_CUDNN));
    FL_CHECK(!fl_cudnn_attn_wants(FL_CUDNN_ATTN_OWN) && !fl_cudnn_attn_wants(FL_CUDNN_ATTN_FP32));
}

FL_TEST(cudnn_load_failures) {
    fl_cudnn_api api;
    char why[512];
    FL_CHECK(fl_cudnn_load(&api, "/nonexistent/libcudnn.so.9", why, sizeof why) == -1);
    FL_CHECKF(strstr(why, "cuDNN not found") && strstr(why, "/nonexistent/libcudnn.so.9"), "%s", why);
    FL_CHECK(api.lib == NULL && api.be_execute == NULL);
    setenv("FITLLM_CUDNN_LIB", "/nonexistent/x.so", 1); /* the variable names the file */
    FL_CHECK(fl_cudnn_load(&api, NULL, why, sizeof why) == -1 && strstr(why, "/nonexistent/x.so"));
    unsetenv("FITLLM_CUDNN_LIB");
#ifdef FL_FAKE_NVML
    FL_CHECK(fl_cudnn_load(&api, FL_FAKE_NVML, why, sizeof why) == -1); /* a library, not cuDNN */
    FL_CHECKF(strstr(why, "has no cudnnGetVersion"), "%s", why);
#endif
#ifdef FL_FAKE_CUDNN
    setenv("FITLLM_FAKE_CUDNN_VERSION", "8907", 1);
    FL_CHECK(fl_cudnn_load(&api, FL_FAKE_CUDNN, why, sizeof why) == -1);
    FL_CHECKF(strstr(why, "cuDNN 0.89.7 is too old") || strstr(why, "too old"), "%s", why);
    unsetenv("FITLLM_FAKE_CUDNN_VERSION");
    FL_REQUIRE(fl_cudnn_load(&api, FL_FAKE_CUDNN, why, sizeof why) == 0);
    FL_CHECK(api.version == 91900 && api.lib);
    void *h = (void *)1;
    int s = api.create(&h);
    char b[48];
    FL_CHECK(s == 1001 && !strcmp(fl_cudnn_status_name(&api, s, b, sizeof b), "CUDNN_STATUS_NOT_INITIALIZED"));
    fl_cudnn_unload(&api);
    FL_CHECK(api.lib == NULL);
#endif
}

static fl_attn_desc desc(int B, int Tq, int Tk, int NH, int NKV, int HD, int causal) {
    fl_attn_desc a = {B, Tq, Tk, NH, NKV, HD, (size_t)NH * HD, (size_t)NKV * HD, (size_t)NKV * HD, (size_t)NH * HD,
                      0.125f, causal, 0, 0};
    return a;
}

/* Where cuDNN is looked for off the loader's path: PyTorch's nvidia-cudnn wheel in a virtualenv first */
FL_TEST(cudnn_search_places) {
    char dir[] = "/tmp/fitllm-cudnn-XXXXXX", lib[200], got[600], cmd[700];
    FL_REQUIRE(mkdtemp(dir));
    snprintf(lib, sizeof lib, "%s/lib/python3.11/site-packages/nvidia/cudnn/lib", dir);
    snprintf(cmd, sizeof cmd, "mkdir -p %s && touch %s/libcudnn.so.9", lib, lib);
    FL_REQUIRE(system(cmd) == 0);
    const char *old = getenv("VIRTUAL_ENV");
    char *keep = old ? strdup(old) : NULL;
    setenv("VIRTUAL_ENV", dir, 1);
    FL_CHECK(fl_cudnn_search(got, sizeof got) == 1);
    snprintf(cmd, sizeof cmd, "%s/libcudnn.so.9", lib);
    FL_CHECKF(!strcmp(got, cmd), "found %s", got);
    /* without it: the next places (a system's wheel or toolkit may exist: then not the virtualenv's) */
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    FL_REQUIRE(system(cmd) == 0);
    got[0] = '\0';
    fl_cudnn_search(got, sizeof got);
    FL_CHECK(!strstr(got, dir));
    if (keep) setenv("VIRTUAL_ENV", keep, 1);
    else unsetenv("VIRTUAL_ENV");
    free(keep);
}

FL_TEST(cudnn_refuse_and_layout) {
    fl_attn_desc a = desc(2, 16, 16, 8, 2, 64, 1);
    FL_CHECK(fl_cudnn_sdpa_refuse(&a, NULL, NULL) == NULL);
    a.HD = 128, a.ldq = a.ldo = 8 * 128, a.ldk = a.ldv = 2 * 128;
    FL_CHECK(fl_cudnn_sdpa_refuse(&a, NULL, NULL) == NULL);
    a.HD = 80, a.ldq = a.ldo = 8 * 80, a.ldk = a.ldv = 2 * 80; /* BLIP-2 OPT-2.7b's: a multiple of 8 */
    FL_CHECK(fl_cudnn_sdpa_refuse(&a, NULL, NULL) == NULL);
    const int no_hd[] = {136, 0};
    for (int i = 0; i < 2; i++) {
        a.HD = no_hd[i], a.ldq = a.ldo = 8 * 136, a.ldk = a.ldv = 2 * 136;
        FL_CHECKF(strstr(fl_cudnn_sdpa_refuse(&a, NULL, NULL), "head size"), "HD %d", a.HD);
    }
    /* other sizes up to 128 run zero-padded to the next multiple of 8 (OpenLLaMA 3B's 100 at 104), through copies */
    const int pad_hd[][2] = {{100, 104}, {4, 8}, {66, 72}, {20, 24}, {64, 64}};
    for (int i = 0; i < 5; i++) {
        a.HD = pad_hd[i][0], a.ldq = a.ldo = (size_t)8 * a.HD, a.ldk = a.ldv = (size_t)2 * a.HD;
        FL_CHECKF(fl_cudnn_sdpa_refuse(&a, NULL, NULL) == NULL, "HD %d", a.HD);
        fl_attn_desc p;
        const int padded = fl_cudnn_sdpa_pad(&a, &p);
        FL_CHECKF(padded == (pad_hd[i][1] != pad_hd[i][0]) && p.HD == pad_hd[i][1] && p.ldq == (size_t)8 * p.HD &&
                      p.ldo == p.ldq && p.ldk == (size_t)2 * p.HD && p.ldv == p.ldk && p.B == a.B && p.Tq == a.Tq &&
                      p.Tk == a.Tk && p.NH == a.NH && p.NKV == a.NKV && p.scale == a.scale && p.causal == a.causal,
                  "HD %d: padded to %d", a.HD, p.HD);
    }
    _Alignas(16) uint16_t al[8];
    a.HD = 100, a.ldq = a.ldk = a.ldv = 1200; /* 16-byte units, but a head of 100: no reading in place */
    FL_CHECK(!fl_cudnn_sdpa_direct_ok(&a, al, al, al));
    a = desc(2, 16, 16, 8, 3, 64, 1);
    FL_CHECK(strstr(fl_cudnn_sdpa_refuse(&a, NULL, NULL), "multiple"));
    a = desc(2, 16, 16, 8, 2, 64, 1);
    float bias = 0;
    uint8_t mask = 1;
    FL_CHECK(strstr(fl_cudnn_sdpa_refuse(&a, &bias, NULL), "bias"));
    FL_CHECK(strstr(fl_cudnn_sdpa_refuse(&a, NULL, &mask), "mask"));
    a.Tq = 8;
    FL_CHECK(strstr(fl_cudnn_sdpa_refuse(&a, NULL, NULL), "Tq != Tk"));
    a.causal = 0; /* cross-attention shapes are fine without the mask */
    FL_CHECK(fl_cudnn_sdpa_refuse(&a, NULL, NULL) == NULL);
    a.ldo += 64;
    FL_CHECK(strstr(fl_cudnn_sdpa_refuse(&a, NULL, NULL), "stride"));
    a = desc(0, 16, 16, 8, 2, 64, 1);
    FL_CHECK(strstr(fl_cudnn_sdpa_refuse(&a, NULL, NULL), "empty"));
    /* the layout: element (b, h, t, d) of the compact (B, T, heads, HD) copy at b*T*H*HD + t*H*HD + h*HD + d */
    a = desc(3, 5, 7, 4, 2, 64, 0);
    fl_cudnn_sdpa_layout L;
    fl_cudnn_sdpa_layout_of(&a, FL_BF16, &L);
    const int64_t q[8] = {3, 4, 5, 64, 5 * 4 * 64, 64, 4 * 64, 1}, k[8] = {3, 2, 7, 64, 7 * 2 * 64, 64, 2 * 64, 1};
    const int64_t st[8] = {3, 4, 5, 1, 4 * 5, 5, 1, 1}; /* lse (B, NH, Tq) */
    FL_CHECK(!memcmp(L.q.dim, q, 32) && !memcmp(L.q.stride, q + 4, 32));
    FL_CHECK(!memcmp(L.o.dim, q, 32) && !memcmp(L.o.stride, q + 4, 32));
    FL_CHECK(!memcmp(L.k.dim, k, 32) && !memcmp(L.k.stride, k + 4, 32));
    FL_CHECK(!memcmp(L.v.dim, k, 32) && !memcmp(L.v.stride, k + 4, 32));
    FL_CHECK(!memcmp(L.stats.dim, st, 32) && !memcmp(L.stats.stride, st + 4, 32));
    FL_CHECK(L.io_dtype == 9 && L.causal == 0 && L.scale == 0.125f); /* CUDNN_DATA_BFLOAT16 */
    fl_cudnn_sdpa_layout_of(&a, FL_F16, &L);
    FL_CHECK(L.io_dtype == 2); /* CUDNN_DATA_HALF */
    FL_CHECK(!memcmp(&L.dq, &L.q, sizeof L.q) && !memcmp(&L.dk, &L.k, sizeof L.k) && !memcmp(&L.dv, &L.v, sizeof L.v));
    /* read in place: a bf16 run's q|k|v rows, (B, T, NH + 2 NKV, HD) interleaved: element (b, h, t, d) of q at
     * b*T*ld + t*ld + h*HD + d with ld = (4 + 2*2)*64; the gradients stay compact */
    a.ldq = a.ldk = a.ldv = (4 + 2 * 2) * 64;
    fl_cudnn_sdpa_layout_rows(&a, FL_BF16, &L);
    const int64_t ld = (4 + 2 * 2) * 64, qr[8] = {3, 4, 5, 64, 5 * ld, 64, ld, 1}, kr[8] = {3, 2, 7, 64, 7 * ld, 64, ld, 1};
    FL_CHECK(!memcmp(L.q.dim, qr, 32) && !memcmp(L.q.stride, qr + 4, 32));
    FL_CHECK(!memcmp(L.k.dim, kr, 32) && !memcmp(L.k.stride, kr + 4, 32) && !memcmp(L.v.stride, kr + 4, 32));
    FL_CHECK(!memcmp(L.dq.stride, q + 4, 32) && !memcmp(L.dk.stride, k + 4, 32) && !memcmp(L.dv.stride, k + 4, 32));
    FL_CHECK(!memcmp(L.o.stride, q + 4, 32) && L.io_dtype == 9);
    /* in place only at 16-byte aligned pointers and row strides of whole 16-byte units */
    _Alignas(16) uint16_t rows[64];
    FL_CHECK(fl_cudnn_sdpa_direct_ok(&a, rows, rows + 8, rows + 16));
    FL_CHECK(!fl_cudnn_sdpa_direct_ok(&a, rows, rows + 4, rows + 16));
    FL_CHECK(!fl_cudnn_sdpa_direct_ok(&a, rows, rows + 8, NULL));
    a.ldk = 8 * 64 + 4;
    FL_CHECK(!fl_cudnn_sdpa_direct_ok(&a, rows, rows + 8, rows + 16));
}

#ifdef FL_HAVE_CUDNN_H
#include <stdbool.h>
#include <cudnn_backend.h>

/* ---- injected functions: descriptors that record what is set on them -------------------------- */
typedef struct {
    int type, dt, virt, byval, fin, mode, prec, redop;
    int64_t uid, dim[4], stride[4], nuid;
    int64_t uids[16];
    void *ptrs[16];
    void *ws;
} fk_desc;
static int fk_ndesc, fk_live, fk_cfgs;
static fk_desc *fk_all[512];
static int fk_create(int type, void **d) {
    fk_desc *x = calloc(1, sizeof *x);
    x->type = type;
    if (fk_ndesc < 512) fk_all[fk_ndesc++] = x;
    fk_live++;
    *d = x;
    return 0;
}
static int fk_destroy(void *d) {
    fk_live--;
    for (int i = 0; i < fk_ndesc; i++)
        if (fk_all[i] == d) fk_all[i] = fk_all[--fk_ndesc];
    free(d);
    return 0;
}
static int fk_set(void *d, int name, int type, int64_t n, const void *v) {
    fk_desc *x = d;
    (void)type;
    if (name == CUDNN_ATTR_TENSOR_DATA_TYPE) x->dt = *(const int *)v;
    if (name == CUDNN_ATTR_POINTWISE_MODE) x->mode = *(const int *)v;
    if (name == CUDNN_ATTR_POINTWISE_MATH_PREC) x->prec = *(const int *)v;
    if (name == CUDNN_ATTR_REDUCTION_OPERATOR) x->redop = *(const int *)v;
    if (name == CUDNN_ATTR_TENSOR_DIMENSIONS && n == 4) memcpy(x->dim, v, 32);
    if (name == CUDNN_ATTR_TENSOR_STRIDES && n == 4) memcpy(x->stride, v, 32);
    if (name == CUDNN_ATTR_TENSOR_UNIQUE_ID) x->uid = *(const int64_t *)v;
    if (name == CUDNN_ATTR_TENSOR_IS_VIRTUAL) x->virt = *(const bool *)v;
    if (name == CUDNN_ATTR_TENSOR_IS_BY_VALUE) x->byval = *(const bool *)v;
    if (name == CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS && n <= 16) memcpy(x->uids, v, (size_t)n * 8), x->nuid = n;
    if (name == CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS && n <= 16) memcpy(x->ptrs, v, (size_t)n * sizeof(void *));
    if (name == CUDNN_ATTR_VARIANT_PACK_WORKSPACE) x->ws = *(void *const *)v;
    return 0;
}
static int fk_get(void *d, int name, int type, int64_t req, int64_t *n, void *v) {
    (void)d, (void)type, (void)req;
    if (name == CUDNN_ATTR_ENGINEHEUR_RESULTS) *n = fk_cfgs;
    if (name == CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE) *(int64_t *)v = 4096, *n = 1;
    return 0;
}
static int fk_fin(void *d) { ((fk_desc *)d)->fin = 1; return 0; }
static fk_desc fk_last_pack;
static int fk_exec(void *h, void *p, void *vp) { (void)h, (void)p; fk_last_pack = *(fk_desc *)vp; return 0; }
static const char *fk_err(int s) { return s == 3000 ? "CUDNN_STATUS_NOT_SUPPORTED" : "fake"; }

static const fk_desc *fk_tensor(int64_t uid) {
    for (int i = 0; i < fk_ndesc; i++)
        if (fk_all[i]->type == CUDNN_BACKEND_TENSOR_DESCRIPTOR && fk_all[i]->uid == uid) return fk_all[i];
    return NULL;
}

FL_TEST(cudnn_graph_injected) {
    fl_cudnn_api api = {0};
    api.error_string = fk_err, api.be_create = fk_create, api.be_destroy = fk_destroy, api.be_set = fk_set;
    api.be_get = fk_get, api.be_finalize = fk_fin, api.be_execute = fk_exec;
    fl_attn_desc a = desc(2, 33, 33, 8, 2, 64, 1);
    fl_cudnn_sdpa_layout L;
    fl_cudnn_sdpa_layout_of(&a, FL_BF16, &L);
    char why[256];
    fl_cudnn_plan *p = NULL;
    /* no engine for the graph: refused with the reason; every descriptor destroyed */
    fk_cfgs = 0;
    FL_CHECK(fl_cudnn_sdpa_build(&api, (void *)0x1, &L, 0, &p, why, sizeof why) == -1 && !p);
    FL_CHECKF(strstr(why, "no engine"), "%s", why);
    FL_CHECK(fk_live == 0);
    for (int bwd = 0; bwd < 2; bwd++) {
        fk_cfgs = 1;
        FL_REQUIRE(fl_cudnn_sdpa_build(&api, (void *)0x1, &L, bwd, &p, why, sizeof why) == 0 && p);
        FL_CHECK(fk_live == 1 && fl_cudnn_plan_workspace(p) == 4096); /* the plan only */
        /* the tensors as the graph saw them: rebuild without a handle and look before they are freed */
        fl_cudnn_plan_free(&api, p);
        FL_CHECK(fk_live == 0);
    }
    /* the variant pack: each uid with its pointer, the scalars by value (host) */
    fk_cfgs = 1;
    FL_REQUIRE(fl_cudnn_sdpa_build(&api, (void *)0x1, &L, 1, &p, why, sizeof why) == 0);
    void *ptr[FL_CUDNN_UID_COUNT] = {0};
    for (int u = 1; u < FL_CUDNN_UID_COUNT; u++) ptr[u] = (void *)(uintptr_t)(0x1000 * u);
    FL_CHECK(fl_cudnn_plan_run(&api, (void *)0x1, p, ptr, (void *)0x99) == 0);
    FL_CHECK(fk_last_pack.nuid == 14 && fk_last_pack.ws == (void *)0x99);
    int seen = 0;
    for (int i = 0; i < fk_last_pack.nuid; i++) {
        int64_t u = fk_last_pack.uids[i];
        seen |= 1 << u;
        if (u == FL_CUDNN_UID_SCALE) FL_CHECK(*(const float *)fk_last_pack.ptrs[i] == 0.125f);
        else if (u == FL_CUDNN_UID_NEG) FL_CHECK(*(const float *)fk_last_pack.ptrs[i] < -1e38f);
        else if (u == FL_CUDNN_UID_ONE) FL_CHECK(*(const float *)fk_last_pack.ptrs[i] == 1.0f);
        else FL_CHECK(fk_last_pack.ptrs[i] == ptr[u]);
    }
    FL_CHECK(seen == ((1 << FL_CUDNN_UID_COUNT) - 2)); /* every uid 1..COUNT-1 once */
    fl_cudnn_plan_free(&api, p);
}

/* the non-virtual tensors of a graph built without a handle, caught before the builder frees them */
static int fk_keep;
static int fk_destroy_keep(void *d) {
    if (fk_keep) return 0;
    return fk_destroy(d);
}
FL_TEST(cudnn_graph_tensors) {
    fl_cudnn_api api = {0};
    api.error_string = fk_err, api.be_create = fk_create, api.be_destroy = fk_destroy_keep, api.be_set = fk_set;
    api.be_get = fk_get, api.be_finalize = fk_fin, api.be_execute = fk_exec;
    fl_attn_desc a = desc(2, 40, 40, 6, 3, 128, 1);
    fl_cudnn_sdpa_layout L;
    fl_cudnn_sdpa_layout_of(&a, FL_BF16, &L);
    char why[256];
    fl_cudnn_plan *p = NULL;
    fk_keep = 1;
    FL_REQUIRE(fl_cudnn_sdpa_build(&api, NULL, &L, 1, &p, why, sizeof why) == 0 && !p);
    /* K and V enter the backward as K^T and V^T: their own memory with the last two dims and strides swapped (what
     * cuDNN's pattern takes, not a reshape); the fp32 dQ accumulator packed (b, h, s, d) */
    fl_cudnn_t4 kt = L.k, vt = L.v, acc = {{2, 6, 40, 128}, {6 * 40 * 128, 40 * 128, 128, 1}};
    kt.dim[2] = L.k.dim[3], kt.dim[3] = L.k.dim[2], kt.stride[2] = L.k.stride[3], kt.stride[3] = L.k.stride[2];
    vt.dim[2] = L.v.dim[3], vt.dim[3] = L.v.dim[2], vt.stride[2] = L.v.stride[3], vt.stride[3] = L.v.stride[2];
    const struct { int64_t uid; const fl_cudnn_t4 *t; int dt; } want[] = {
        {FL_CUDNN_UID_Q, &L.q, 9}, {FL_CUDNN_UID_K, &kt, 9}, {FL_CUDNN_UID_V, &vt, 9}, {FL_CUDNN_UID_O, &L.o, 9},
        {FL_CUDNN_UID_DO, &L.o, 9}, {FL_CUDNN_UID_DQ, &L.q, 9}, {FL_CUDNN_UID_DK, &L.k, 9},
        {FL_CUDNN_UID_DV, &L.v, 9}, {FL_CUDNN_UID_STATS, &L.stats, 0}, {FL_CUDNN_UID_DSUM, &L.stats, 0},
        {FL_CUDNN_UID_DQACC, &acc, 0}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const fk_desc *t = fk_tensor(want[i].uid);
        FL_CHECKF(t && !t->virt && t->fin && t->dt == want[i].dt && !memcmp(t->dim, want[i].t->dim, 32) &&
                      !memcmp(t->stride, want[i].t->stride, 32),
                  "tensor uid %lld", (long long)want[i].uid);
    }
    const fk_desc *sc = fk_tensor(FL_CUDNN_UID_SCALE), *ng = fk_tensor(FL_CUDNN_UID_NEG), *on = fk_tensor(FL_CUDNN_UID_ONE);
    FL_CHECK(sc && sc->byval && ng && ng->byval && sc->dt == 0 && on && on->byval && on->dt == 0);
    /* grouped heads (6 / 3): dK, dV summed from full-head virtual tensors by a reduction each */
    int red = 0;
    for (int i = 0; i < fk_ndesc; i++) red += fk_all[i]->type == CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR;
    FL_CHECK(red == 3); /* Dsum, dV, dK */
    fk_keep = 0;
    while (fk_ndesc) fk_destroy(fk_all[fk_ndesc - 1]);
    fk_live = 0;
}

/* The node sequence against cuDNN's own frontend: cuDNN's fused flash engines match their graph node for node
 * (ours, equivalent but written differently, got "no engine for the graph" on an H200 with cuDNN 9.19). The
 * expected sequences are the backend graphs cudnn-frontend built for PyTorch 2.11's sdpa (cuDNN backend, causal,
 * bf16, heads not grouped) on that machine, dumped with CUDNN_LOGLEVEL_DBG=3: each operation in order, pointwise
 * ops by mode ("cmp_ge" with a boolean math precision, every other pointwise op fp32). */
static void fk_sequence(char *out, size_t n) {
    size_t k = 0;
    out[0] = '\0';
    for (int i = 0; i < fk_ndesc && k < n; i++) {
        const fk_desc *d = fk_all[i];
        const char *t = NULL;
        char b[32], c[48];
        if (d->type == CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR) t = "matmul";
        else if (d->type == CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR) t = "reshape";
        else if (d->type == CUDNN_BACKEND_REDUCTION_DESCRIPTOR) t = d->redop == CUDNN_REDUCE_TENSOR_MAX ? "max" : "sum";
        else if (d->type == CUDNN_BACKEND_POINTWISE_DESCRIPTOR) {
            static const struct { int mode; const char *name; } m[] = {
                {CUDNN_POINTWISE_ADD, "add"}, {CUDNN_POINTWISE_MUL, "mul"}, {CUDNN_POINTWISE_SUB, "sub"},
                {CUDNN_POINTWISE_DIV, "div"}, {CUDNN_POINTWISE_EXP, "exp"}, {CUDNN_POINTWISE_LOG, "log"},
                {CUDNN_POINTWISE_IDENTITY, "identity"}, {CUDNN_POINTWISE_GEN_INDEX, "index"},
                {CUDNN_POINTWISE_CMP_GE, "cmp_ge"}, {CUDNN_POINTWISE_BINARY_SELECT, "select"}};
            snprintf(b, sizeof b, "mode%d", d->mode);
            t = b;
            for (size_t j = 0; j < sizeof m / sizeof m[0]; j++)
                if (m[j].mode == d->mode) t = m[j].name;
            const int want = d->mode == CUDNN_POINTWISE_CMP_GE ? CUDNN_DATA_BOOLEAN : CUDNN_DATA_FLOAT;
            if (d->prec != want) snprintf(c, sizeof c, "%s(prec %d)", t, d->prec), t = c;
        }
        if (t) k += (size_t)snprintf(out + k, n - k, "%s%s", k ? " " : "", t);
    }
}
FL_TEST(cudnn_graph_follows_frontend) {
    fl_cudnn_api api = {0};
    api.error_string = fk_err, api.be_create = fk_create, api.be_destroy = fk_destroy_keep, api.be_set = fk_set;
    api.be_get = fk_get, api.be_finalize = fk_fin, api.be_execute = fk_exec;
    static const char *const want[2] = {
        "matmul mul index index cmp_ge select max sub exp sum log add div matmul",
        "matmul matmul mul reshape mul sub index index cmp_ge select exp reshape matmul sum mul sub mul mul matmul "
        "identity reshape matmul"};
    for (int bwd = 0; bwd < 2; bwd++) {
        fl_attn_desc a = desc(4, 64, 64, 8, 8, 64, 1);
        fl_cudnn_sdpa_layout L;
        fl_cudnn_sdpa_layout_of(&a, FL_BF16, &L);
        char why[256], seq[512];
        fl_cudnn_plan *p = NULL;
        fk_keep = 1;
        FL_REQUIRE(fl_cudnn_sdpa_build(&api, NULL, &L, bwd, &p, why, sizeof why) == 0 && !p);
        fk_sequence(seq, sizeof seq);
        FL_CHECKF(!strcmp(seq, want[bwd]), "%s graph:\n  got  %s\n  want %s", bwd ? "backward" : "forward", seq,
                  want[bwd]);
        /* the matmuls' K^T (forward and backward) and V^T (backward) are the non-virtual K and V, never a reshape */
        int reshaped_kv = 0;
        for (int i = 0; i < fk_ndesc; i++)
            if (fk_all[i]->type == CUDNN_BACKEND_TENSOR_DESCRIPTOR && fk_all[i]->virt && fk_all[i]->dim[2] == 64 &&
                fk_all[i]->dim[3] == 64 && fk_all[i]->stride[2] == 1 && fk_all[i]->stride[3] == 8 * 64)
                reshaped_kv++; /* a virtual (b, h, d, s) view with K's row stride: a reshaped K^T */
        FL_CHECK(reshaped_kv == 0);
        fk_keep = 0;
        while (fk_ndesc) fk_destroy(fk_all[fk_ndesc - 1]);
        fk_live = 0;
    }
}

/* the real library, where installed: every descriptor short of the operation graph finalized by cuDNN */
FL_TEST(cudnn_graph_real_library) {
    fl_cudnn_api api;
    char why[512];
    if (fl_cudnn_load(&api, NULL, why, sizeof why) != 0 &&
        fl_cudnn_load(&api, "/usr/local/cuda/lib/libcudnn.so.9", why, sizeof why) != 0) {
        printf("      skipped: %s\n", why);
        return;
    }
    printf("      cuDNN %zu\n", api.version);
    const int shapes[][7] = {{2, 64, 64, 8, 2, 64, 1}, {1, 128, 128, 4, 4, 128, 1}, {2, 17, 40, 8, 1, 64, 0},
                             {1, 40, 40, 4, 2, 80, 1}};
    for (int i = 0; i < 4; i++)
        for (int bwd = 0; bwd < 2; bwd++) {
            const int *s = shapes[i];
            fl_attn_desc a = desc(s[0], s[1], s[2], s[3], s[4], s[5], s[6]);
            fl_cudnn_sdpa_layout L;
            fl_cudnn_sdpa_layout_of(&a, i == 2 ? FL_F16 : FL_BF16, &L);
            fl_cudnn_plan *p = NULL;
            FL_CHECKF(fl_cudnn_sdpa_build(&api, NULL, &L, bwd, &p, why, sizeof why) == 0, "shape %d %s: %s", i,
                      bwd ? "backward" : "forward", why);
        }
    /* no GPU here: the handle is refused, and says so by name */
    void *h = NULL;
    int st = api.create(&h);
    if (st) {
        char b[64];
        printf("      cudnnCreate without a GPU: %s\n", fl_cudnn_status_name(&api, st, b, sizeof b));
    } else api.destroy(h);
    fl_cudnn_unload(&api);
}

/* tests/fixtures/cudnn-engines.txt (tests/ref/cudnn_engines.py): devices as cuDNN's JSON, shapes, and the engine
 * cuDNN ranks first for its own frontend's SDPA graphs of each (cuDNN and frontend versions on its first line) */
enum { REF_DEV = 4, REF_SHAPES = 12 };
typedef struct {
    size_t cudnn;
    int ndev, nshape;
    char dev[REF_DEV][16];
    char json[REF_DEV][1024];
    int shape[REF_SHAPES][8];          /* B, Tq, Tk, NH, NKV, HD, causal, interleaved q|k|v rows */
    long long engine[REF_DEV][REF_SHAPES][2];
} engines_ref;

static int read_engines_ref(engines_ref *r, char *why, size_t n) {
    memset(r, 0, sizeof *r);
    const char *path = "tests/fixtures/cudnn-engines.txt";
    FILE *f = fopen(path, "r");
    if (!f) return snprintf(why, n, "%s: cannot open", path), -1;
    char line[2048];
    int bad = 0;
    while (!bad && fgets(line, sizeof line, f)) {
        char a[16], b[16];
        int i, k[8];
        long long e;
        if (sscanf(line, "cudnn %zu", &r->cudnn) == 1) continue;
        if (sscanf(line, "device %15s %1023[^\n]", a, r->json[r->ndev < REF_DEV ? r->ndev : 0]) == 2 && r->ndev < REF_DEV)
            memcpy(r->dev[r->ndev++], a, sizeof a);
        else if (sscanf(line, "shape %d %d %d %d %d %d %d %d %d", &i, &k[0], &k[1], &k[2], &k[3], &k[4], &k[5], &k[6],
                        &k[7]) == 9 && i == r->nshape && i < REF_SHAPES)
            memcpy(r->shape[r->nshape++], k, sizeof k);
        else if (sscanf(line, "engine %15s %d %15s %lld", a, &i, b, &e) == 4 && i >= 0 && i < r->nshape) {
            int d = 0;
            while (d < r->ndev && strcmp(r->dev[d], a)) d++;
            if (d == r->ndev) bad = 1;
            else r->engine[d][i][!strcmp(b, "bwd")] = e;
        } else bad = 1;
    }
    fclose(f);
    if (bad || !r->cudnn || !r->ndev || !r->nshape)
        return snprintf(why, n, "%s: not as tests/ref/cudnn_engines.py writes it: %.200s", path, line), -1;
    return 0;
}

/* Which of the fixture's shapes (i == nshape: the control) device d probes: every one in the full tier; in the quick
 * tier the first device (the H200) the first and last shapes and the control, the second (the A100) the first shape
 * alone (TinyLlama's layer in place: NVRTC compiles ~1 s a probe), the others (the RTX 4090's sm_89) none */
static int probed(int quick, int d, int i, int nshape) {
    if (!quick) return 1;
    return d == 0 ? i == 0 || i >= nshape - 1 : d == 1 && i == 0;
}

/* The graphs on the fixture's devices (an H200, an A100) without either (fl_cudnn_sdpa_probe, cuDNN >= 9.8), in a
 * child process with the CUDA toolkit's stub libcuda.so.1 loaded (so cuDNN's checks run; only loading the compiled
 * kernel fails), and a control cuDNN must refuse or send elsewhere (fp32 operands: its fused engines are 16-bit).
 * One line a probe: "device shape bwd rc engine why" (shape -1: the control). */
static int probe_child(const engines_ref *r, const char *stub, int wfd, int quick) {
    if (!dlopen(stub, RTLD_NOW | RTLD_GLOBAL)) return 2;
    fl_cudnn_api api;
    char why[512], line[768];
    if (fl_cudnn_load(&api, NULL, why, sizeof why) != 0) return 3;
    for (int d = 0; d < r->ndev; d++) {
        void *dp = NULL;
        if (fl_cudnn_devprop_json(&api, r->json[d], &dp, why, sizeof why) != 0) {
            snprintf(line, sizeof line, "%s 0 0 -2 -1 %s\n", r->dev[d], why);
            if (write(wfd, line, strlen(line)) < 0) return 4;
            continue;
        }
        for (int i = 0; i <= r->nshape; i++)
            for (int bwd = 0; bwd < 3; bwd++) { /* 2: the backward with its gradients at q|k|v's rows too */
                if (!probed(quick, d, i, r->nshape)) continue;
                const int *sh = r->shape[i < r->nshape ? i : 0];
                if (bwd == 2 && (!sh[7] || i == r->nshape)) continue;
                fl_attn_desc a = desc(sh[0], sh[1], sh[2], sh[3], sh[4], sh[5], sh[6]);
                a.scale = 1.0f / sqrtf((float)sh[5]);
                fl_cudnn_sdpa_layout L;
                if (sh[7]) { /* a bf16 run's q|k|v rows, read in place (and written: attention_backward_b16) */
                    a.ldq = a.ldk = a.ldv = (size_t)(sh[3] + 2 * sh[4]) * sh[5];
                    if (bwd == 2) fl_cudnn_sdpa_layout_grad_rows(&a, FL_BF16, &L);
                    else fl_cudnn_sdpa_layout_rows(&a, FL_BF16, &L);
                } else {
                    fl_cudnn_sdpa_layout_of(&a, FL_BF16, &L);
                }
                if (i == r->nshape) L.io_dtype = CUDNN_DATA_FLOAT; /* the control */
                int64_t eng = -1;
                size_t ws = 0;
                int rc = fl_cudnn_sdpa_probe(&api, dp, &L, bwd > 0, &eng, &ws, why, sizeof why);
                snprintf(line, sizeof line, "%s %d %d %d %lld %zu %s\n", r->dev[d], i == r->nshape ? -1 : i, bwd, rc,
                         (long long)eng, ws, why);
                if (write(wfd, line, strlen(line)) < 0) return 4;
            }
        api.be_destroy(dp);
    }
    fl_cudnn_unload(&api);
    return 0;
}

/* Does cuDNN take fitllm's SDPA graphs on an H200 / A100 / RTX 4090 (sm_89), and on the engine it gives its own
 * frontend's? Every shape of the fixture (TinyLlama's GQA at a bf16 run's in-place q|k|v rows and through the compact copies, HD 128,
 * 80, 88, bidirectional, Tq != Tk), forward and backward, must compile on cuDNN's first-ranked engine, and with the
 * fixture's cuDNN version that engine must be the one cuDNN ranks first for the frontend's graph of the same call
 * (for a bidirectional forward, the frontend of 1.32 writes cuDNN's unified SDPA node, another engine: there, the
 * engine of the fixture's causal forward, the composite graph's). A control, fp32 operands, must be refused or sent
 * elsewhere. The first graphs (K^T as a reshape node of K: "no engine for the graph" on an H200 on 2026-11-30) get
 * the same refusal here. A shape with interleaved q|k|v rows is probed a third time: the backward writing dQ, dK, dV
 * at those rows' strides (attention_backward_b16's graph, fl_cudnn_sdpa_layout_grad_rows), which must compile on the
 * same engine. */
FL_TEST(cudnn_plan_without_a_device) {
    if (!fl_test_asan_budget()) return; /* NVRTC compiles: ~8 s in the quick tier, ~25 s in the full one */
    fl_cudnn_api api;
    char why[512];
    if (fl_cudnn_load(&api, NULL, why, sizeof why) != 0) {
        printf("      skipped: %s\n", why);
        return;
    }
    const size_t version = api.version;
    fl_cudnn_unload(&api);
    const char *stub = "/usr/local/cuda/lib64/stubs/libcuda.so";
    if (version < 90800 || access(stub, R_OK) != 0) {
        printf("      skipped: %s\n", version < 90800 ? "cuDNN before 9.8 plans only on a device"
                                                    : "no CUDA toolkit stub (/usr/local/cuda/lib64/stubs/libcuda.so)");
        return;
    }
    static engines_ref ref;
    if (read_engines_ref(&ref, why, sizeof why) != 0) {
        FL_CHECKF(0, "%s", why);
        return;
    }
    const int same = ref.cudnn == version;
    printf("      cuDNN %zu, the fixture's %zu: %s\n", version, ref.cudnn,
           same ? "engines compared" : "engines not compared (another cuDNN ranks its own)");
    /* the quick tier: the H200's first shape (TinyLlama's layer in place), last (a padded head size) and the control,
     * the A100's first shape (probed()), ~9 s of compiles; the full tier every shape of both */
    const int quick = fl_test_quick();
    int fd[2];
    FL_REQUIRE(pipe(fd) == 0);
    fflush(stdout);
    pid_t pid = fork();
    FL_REQUIRE(pid >= 0);
    if (pid == 0) {
        close(fd[0]);
        alarm(300); /* <= ~25 s of compiles here: a child that hangs dies by SIGALRM, and the check below says so */
        _exit(probe_child(&ref, stub, fd[1], quick));
    }
    close(fd[1]);
    static char out[32768];
    size_t got = 0;
    ssize_t rd;
    while (got + 1 < sizeof out && (rd = read(fd[0], out + got, sizeof out - 1 - got)) > 0) got += (size_t)rd;
    out[got] = '\0';
    close(fd[0]);
    int st = 0;
    FL_REQUIRE(waitpid(pid, &st, 0) == pid);
    FL_CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the probe's child: %s %d", WIFSIGNALED(st) ? "killed by signal" : "exit",
              WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
    int compiled = 0, controls = 0, lines = 0, fwd_told = 0, nrows = 0;
    int want_rows = 0, want_shapes = 0, want_controls = 0; /* over the devices: the probes probed() asks */
    for (int d = 0; d < ref.ndev; d++) {
        for (int i = 0; i < ref.nshape; i++)
            if (probed(quick, d, i, ref.nshape)) /* forward and backward; interleaved q|k|v rows: a third probe */
                want_shapes += 2, want_rows += ref.shape[i][7] != 0;
        want_controls += probed(quick, d, ref.nshape, ref.nshape) ? 2 : 0;
    }
    char *save = NULL;
    for (char *l = strtok_r(out, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        char dev[16], rest[600] = "";
        int shape = 0, bwd = 0, rc = 0, d = 0;
        long long eng = -1;
        size_t ws = 0;
        lines++;
        if (sscanf(l, "%15s %d %d %d %lld %zu %599[^\n]", dev, &shape, &bwd, &rc, &eng, &ws, rest) < 6) {
            FL_CHECKF(0, "probe: %s", l);
            continue;
        }
        while (d < ref.ndev && strcmp(ref.dev[d], dev)) d++;
        FL_REQUIRE(d < ref.ndev);
        FL_CHECKF(rc != -2, "%s: %s", dev, rest);
        const int s = shape < 0 ? 0 : shape, grads = bwd == 2; /* grads: dQ, dK, dV at q|k|v's rows */
        bwd = bwd > 0;
        const long long want = ref.shape[s][6] || bwd ? ref.engine[d][s][bwd] : ref.engine[d][0][0];
        char tag[16];
        snprintf(tag, sizeof tag, shape < 0 ? "fp32" : "shape %d", shape);
        printf("      %s %-8s %s: %s, workspace %zu B (frontend's: engine %lld)\n", dev, tag,
               grads ? "bwd, gradients in the rows" : bwd ? "bwd" : "fwd", rc == 0 ? "plan finalized" : rest, ws,
               ref.engine[d][s][bwd]);
        nrows += grads;
        if (shape < 0) {
            /* no SDPA backward engine takes fp32 operands; forward, cuDNN's generic runtime-fusion engine may compile
             * them, and on sm_80 it is also the one cuDNN ranks first for the frontend's bf16 graph (A100: engine 1),
             * so there the forward control cannot tell: it must then be the H200's that does */
            if (bwd) FL_CHECKF(rc == -1, "%s backward: fp32 operands not refused (engine %lld)", dev, eng);
            else if (rc >= 0 && eng == want) printf("      (%s's engine %lld compiles fp32 graphs too)\n", dev, eng);
            else fwd_told++;
            controls++;
        } else {
            FL_CHECKF(rc >= 0, "%s shape %d %s: %s", dev, shape, bwd ? "backward" : "forward", rest);
            FL_CHECKF(!same || rc < 0 || eng == want, "%s shape %d %s: engine %lld, cuDNN's frontend gets %lld", dev,
                      shape, bwd ? "backward" : "forward", eng, want);
            /* what the plan lends for cuDNN's workspace covers what the configuration asks */
            const int *sh = ref.shape[shape];
            fl_attn_desc a = desc(sh[0], sh[1], sh[2], sh[3], sh[4], sh[5], sh[6]);
            FL_CHECKF(ws <= fl_cudnn_sdpa_workspace_allowance(&a), "%s shape %d %s: workspace %zu > the allowance %zu",
                      dev, shape, bwd ? "backward" : "forward", ws, fl_cudnn_sdpa_workspace_allowance(&a));
            compiled += rc >= 0;
        }
    }
    FL_CHECKF(lines == want_shapes + want_rows + want_controls && compiled == want_shapes + want_rows &&
                  controls == want_controls && nrows == want_rows,
              "%d lines, %d compiled, %d controls, %d with the gradients in the rows", lines, compiled, controls, nrows);
    FL_CHECKF(!same || fwd_told > 0, "no device's forward told the fp32 control from the bf16 graphs");
}
#endif

#ifdef FL_HAVE_CUDA_EMU
#include "backend/cuda/cu_kernels_attn.h"
#include "fitllm/dtype.h"

#ifdef FL_SIM_CUDNN
/* The emulated backend's cuDNN path end to end (cuda-cudnn-impl.h, which otherwise runs only on a GPU) with
 * tests/cuda/sim_cudnn.c standing in for libcudnn: it runs the graphs the backend builds on the host in double
 * precision through their own tensors' dims and strides, so the layouts (a bf16 run's q|k|v rows read in place, the
 * compact copies of fp32 operands), the variant pack's pointers, the workspace in the backend's buffer, the fp32 dQ
 * accumulator, the bf16 outputs' return and the gradients' accumulation are checked against the CPU backend's
 * attention of the same (bf16-representable) inputs: outputs and gradients within 8 u max|ref| (u = 2^-8, bf16; the
 * bound `fitllm selftest` puts on cuDNN against float64), every call counted by the stand-in (no silent fall-back). */
static double maxabs(const float *x, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs((double)x[i]));
    return m;
}
static double maxdiff(const float *x, const float *y, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs((double)x[i] - (double)y[i]));
    return m;
}

/* 256-aligned (C11's aligned_alloc: the size a multiple of the alignment) */
static void *sim_alloc(size_t bytes) { return aligned_alloc(256, (bytes + 255) / 256 * 256); }

static void sim_case(int B, int T, int NH, int NKV, int HD, int causal, int in16) {
    setenv("FITLLM_CUDNN_LIB", FL_SIM_CUDNN, 1);
    setenv("FITLLM_CUDA_ATTN", "cudnn", 1);
    setenv("FITLLM_SIM_CUDNN_WS", "4096", 1);
    fl_backend be, cpu;
    fl_status st = fl_backend_init_by_name("cuda-emu", &be, 1);
    unsetenv("FITLLM_CUDA_ATTN"), unsetenv("FITLLM_CUDNN_LIB"); /* read at the backend's start */
    if (st != FL_OK) {
        FL_CHECKF(0, "cuda-emu with the stand-in cuDNN: %s", fl_error_message());
        return;
    }
    FL_REQUIRE_OK(fl_cpu_backend_init(&cpu, 1));
    be.set_compute_dtype(&be, FL_BF16);
    void *lib = dlopen(FL_SIM_CUDNN, RTLD_NOW | RTLD_NOLOAD);
    long (*runs)(void) = lib ? (long (*)(void))dlsym(lib, "sim_cudnn_runs") : NULL;
    FL_REQUIRE(runs != NULL);
    const long r0 = runs();
    /* q|k|v interleaved rows (a model's fused projection), fp32 values on bf16's grid */
    const size_t row = (size_t)(NH + 2 * NKV) * HD, N = (size_t)B * T, nq = N * NH * HD;
    float *qkv = (float *)sim_alloc(N * row * 4), *dqkv_e = (float *)sim_alloc(N * row * 4);
    float *dqkv_c = (float *)sim_alloc(N * row * 4), *out_e = (float *)sim_alloc(nq * 4);
    float *out_c = (float *)sim_alloc(nq * 4), *dout = (float *)sim_alloc(nq * 4);
    float *lse_e = (float *)sim_alloc((size_t)B * NH * T * 4 + 256);
    float *lse_c = (float *)sim_alloc((size_t)B * NH * T * 4 + 256);
    uint16_t *qkv16 = (uint16_t *)sim_alloc(N * row * 2), *out16 = (uint16_t *)sim_alloc(nq * 2);
    FL_REQUIRE(qkv && dqkv_e && dqkv_c && out_e && out_c && dout && lse_e && lse_c && qkv16 && out16);
    uint64_t r = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < N * row; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        qkv16[i] = fl_f32_to_bf16((float)((double)(r >> 11) / 9007199254740992.0 * 2 - 1));
        qkv[i] = fl_bf16_to_f32(qkv16[i]);
        dqkv_e[i] = dqkv_c[i] = 0.25f * (float)((i % 7) - 3); /* the op accumulates into what is there */
    }
    for (size_t i = 0; i < nq; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        dout[i] = fl_bf16_to_f32(fl_f32_to_bf16((float)((double)(r >> 11) / 9007199254740992.0 - 0.5)));
    }
    fl_attn_desc a = {B, T, T, NH, NKV, HD, row, row, row, (size_t)NH * HD, 1.0f / sqrtf((float)HD), causal, 0, 0};
    const float *q = qkv, *k = qkv + NH * HD, *v = qkv + (NH + NKV) * HD;
    FL_REQUIRE_OK(cpu.attention_forward(&cpu, &a, out_c, lse_c, q, k, v, NULL, NULL));
    if (in16) FL_REQUIRE_OK(be.attention_forward_in16(&be, &a, out_e, out16, lse_e, qkv16, qkv16 + NH * HD,
                                                      qkv16 + (NH + NKV) * HD, NULL));
    else FL_REQUIRE_OK(be.attention_forward(&be, &a, out_e, lse_e, q, k, v, NULL, NULL));
    FL_CHECKF(runs() == r0 + 1, "HD %d: the forward ran %ld plans through the stand-in cuDNN (want 1)", HD, runs() - r0);
    const double u = 1.0 / 256, mo = maxabs(out_c, nq);
    FL_CHECKF(maxdiff(out_e, out_c, nq) <= 8 * u * mo, "out: %g off the CPU's (bound %g)", maxdiff(out_e, out_c, nq),
              8 * u * mo);
    FL_CHECKF(maxdiff(lse_e, lse_c, (size_t)B * NH * T) <= 1e-4 * (1 + maxabs(lse_c, (size_t)B * NH * T)),
              "lse: %g off the CPU's", maxdiff(lse_e, lse_c, (size_t)B * NH * T));
    /* the backward reads what the forward saved: the CPU its fp32 output, cuDNN its bf16 output */
    for (size_t i = 0; i < nq; i++) out_c[i] = fl_bf16_to_f32(fl_f32_to_bf16(out_c[i]));
    FL_REQUIRE_OK(cpu.attention_backward(&cpu, &a, dqkv_c, dqkv_c + NH * HD, dqkv_c + (NH + NKV) * HD, NULL, dout, q,
                                         k, v, NULL, NULL, out_c, lse_c));
    if (in16) {
        for (size_t i = 0; i < nq; i++) out16[i] = fl_f32_to_bf16(out_c[i]);
        FL_REQUIRE_OK(be.attention_backward16(&be, &a, dqkv_e, dqkv_e + NH * HD, dqkv_e + (NH + NKV) * HD, dout, qkv16,
                                              qkv16 + NH * HD, qkv16 + (NH + NKV) * HD, NULL, out16, lse_e));
    } else {
        FL_REQUIRE_OK(be.attention_backward(&be, &a, dqkv_e, dqkv_e + NH * HD, dqkv_e + (NH + NKV) * HD, NULL, dout, q,
                                            k, v, NULL, NULL, out_c, lse_e));
    }
    FL_CHECKF(runs() == r0 + 2, "the backward ran %ld plans through the stand-in cuDNN (want 1)", runs() - r0 - 1);
    const char *name[3] = {"dq", "dk", "dv"};
    const int off[3] = {0, NH * HD, (NH + NKV) * HD}, w[3] = {NH * HD, NKV * HD, NKV * HD};
    for (int t = 0; t < 3; t++) {
        double m = 0, d = 0;
        for (size_t i = 0; i < N; i++)
            for (int c = 0; c < w[t]; c++) {
                const size_t j = i * row + off[t] + c;
                const double base = 0.25 * (double)((j % 7) - 3);
                m = fmax(m, fabs(dqkv_c[j] - base));
                d = fmax(d, fabs((double)dqkv_e[j] - dqkv_c[j]));
            }
        FL_CHECKF(m > 0 && d <= 8 * u * m, "%s: %g off the CPU's (bound %g, %s, B %d T %d heads %d/%d HD %d)", name[t], d,
                  8 * u * m, in16 ? "bf16 in place" : "fp32 copies", B, T, NH, NKV, HD);
    }
    if (in16) { /* attention_backward_b16 (a bf16 dO): its fp32 gradients the bits of attention_backward16's, its
                 * bf16 ones (written at q|k|v's strides, the columns between untouched) those values rounded */
        FL_REQUIRE(be.attention_backward_b16 && be.attention_b16_ok);
        const uint16_t *k16 = qkv16 + NH * HD, *v16 = qkv16 + (NH + NKV) * HD;
        FL_CHECK(be.attention_b16_ok(&be, &a, qkv16, k16, v16, out16));
        uint16_t *dout16 = (uint16_t *)sim_alloc(nq * 2), *d16 = (uint16_t *)sim_alloc(N * row * 2);
        float *dz = (float *)sim_alloc(N * row * 4), *db = (float *)sim_alloc(N * row * 4);
        FL_REQUIRE(dout16 && d16 && dz && db);
        for (size_t i = 0; i < nq; i++) dout16[i] = fl_f32_to_bf16(dout[i]); /* dout is on bf16's grid */
        for (size_t i = 0; i < N * row; i++) db[i] = 0.25f * (float)((i % 7) - 3), dz[i] = 0, d16[i] = 0x7fc1;
        const long r1 = runs();
        FL_REQUIRE_OK(be.attention_backward_b16(&be, &a, db, db + NH * HD, db + (NH + NKV) * HD, NULL, NULL, NULL,
                                                dout16, qkv16, k16, v16, out16, lse_e));
        FL_CHECKF(!memcmp(db, dqkv_e, N * row * 4), "attention_backward_b16 (fp32 gradients): not attention_backward16's "
                  "bits (B %d T %d heads %d/%d HD %d)", B, T, NH, NKV, HD);
        FL_REQUIRE_OK(be.attention_backward16(&be, &a, dz, dz + NH * HD, dz + (NH + NKV) * HD, dout, qkv16, k16, v16,
                                              NULL, out16, lse_e));
        FL_REQUIRE_OK(be.attention_backward_b16(&be, &a, NULL, NULL, NULL, d16, d16 + NH * HD, d16 + (NH + NKV) * HD,
                                                dout16, qkv16, k16, v16, out16, lse_e));
        size_t bad = 0;
        for (size_t i = 0; i < N * row; i++) bad += !(fl_bf16_to_f32(d16[i]) == dz[i]); /* (+0 == -0: 0 + -0 is +0) */
        FL_CHECKF(bad == 0, "attention_backward_b16 (bf16 gradients): %zu of %zu elements not the fp32 path's values "
                  "(B %d T %d heads %d/%d HD %d)", bad, N * row, B, T, NH, NKV, HD);
        FL_CHECKF(runs() == r1 + 3, "the bf16 backwards ran %ld plans through the stand-in (want 3)", runs() - r1);
        /* refused: no dO; a shape cuDNN does not take (attention_b16_ok says no; the op names it) */
        FL_CHECK(be.attention_backward_b16(&be, &a, db, db, db, NULL, NULL, NULL, NULL, qkv16, k16, v16, out16,
                                           lse_e) == FL_ERR_INVALID);
        fl_attn_desc nc = a;
        nc.drop_p = 0.1f;
        FL_CHECK(!be.attention_b16_ok(&be, &nc, qkv16, k16, v16, out16));
        FL_CHECK(be.attention_backward_b16(&be, &nc, db, db, db, NULL, NULL, NULL, dout16, qkv16, k16, v16, out16,
                                           lse_e) == FL_ERR_UNSUPPORTED);
        FL_CHECKF(strstr(fl_error_message(), "attention_b16_ok"), "%s", fl_error_message());
        free(dout16), free(d16), free(dz), free(db);
    }
    printf("      B %d T %d heads %d/%d HD %d %s %s: through the stand-in cuDNN, within 8 u of the CPU's\n", B, T, NH,
           NKV, HD, causal ? "causal" : "bidirectional", in16 ? "bf16 q|k|v (in place where it can)" : "fp32 q|k|v copied");
    free(qkv), free(dqkv_e), free(dqkv_c), free(out_e), free(out_c), free(dout), free(lse_e), free(lse_c), free(qkv16);
    free(out16);
    fl_backend_free(&be);
    fl_backend_free(&cpu);
    unsetenv("FITLLM_SIM_CUDNN_WS");
}

FL_TEST(cudnn_emu_sim_ops) {
    sim_case(2, 33, 4, 2, 64, 1, 1);  /* GQA, causal, a bf16 run's q|k|v read in place */
    sim_case(2, 33, 4, 2, 64, 1, 0);  /* the same from fp32 operands: compact bf16 copies */
    sim_case(1, 40, 2, 2, 128, 0, 1); /* HD 128, bidirectional */
    sim_case(2, 37, 4, 2, 100, 1, 1); /* OpenLLaMA 3B's 100: at 104, the copies zero-padded per head */
    sim_case(1, 29, 2, 2, 100, 0, 0);
    sim_case(2, 21, 6, 3, 20, 1, 1); /* lab-3b's 20: at 24 */
    /* cuDNN refusing the in-place strides: the backend builds the graphs again over its compact copies (said once) */
    setenv("FITLLM_SIM_CUDNN_COMPACT_ONLY", "1", 1);
    sim_case(2, 33, 4, 2, 64, 1, 1);
    unsetenv("FITLLM_SIM_CUDNN_COMPACT_ONLY");
}

/* attention_heads2d against the contract written as loops: per head, the first w columns moved (widened, rounded to
 * bf16, or added), the rest up to wdst zeros; odd sizes, strides wider than the rows, every type pair */
FL_TEST(cudnn_emu_heads2d) {
    const int rows = 5, heads = 3;
    const struct { int w, shs, wdst, dhs; } g[] = {{5, 7, 8, 8}, {8, 8, 5, 5}, {4, 4, 4, 6}};
    const fl_dtype sts[3] = {FL_F32, FL_BF16, FL_F16};
    for (int gi = 0; gi < 3; gi++)
        for (int si = 0; si < 3; si++)
            for (int mode = 0; mode < 3; mode++) { /* 0: into bf16, 1: into fp32, 2: added to fp32 */
                const int w = g[gi].w < g[gi].wdst ? g[gi].w : g[gi].wdst, shs = g[gi].shs, wdst = g[gi].wdst;
                const int dhs = g[gi].dhs;
                const size_t lds = (size_t)heads * shs + 3, ldd = (size_t)heads * dhs + 2;
                float srcf[256], dstf[256], want[256];
                uint16_t src16[256], dst16[256], want16[256];
                for (int i = 0; i < 256; i++) {
                    srcf[i] = (float)((i * 37) % 23 - 11) / 8.0f + (float)i / 1024.0f;
                    src16[i] = sts[si] == FL_BF16 ? fl_f32_to_bf16(srcf[i]) : fl_f32_to_f16(srcf[i]);
                    dstf[i] = want[i] = (float)(i % 5) - 2.0f;
                    dst16[i] = want16[i] = 0x7fc1; /* untouched outside the heads' columns */
                }
                for (int r = 0; r < rows; r++)
                    for (int h = 0; h < heads; h++)
                        for (int c = 0; c < wdst; c++) {
                            const size_t so = (size_t)r * lds + (size_t)h * shs + c, o = (size_t)r * ldd + (size_t)h * dhs + c;
                            const float v = c >= w ? 0.0f
                                            : sts[si] == FL_F32 ? srcf[so]
                                            : sts[si] == FL_BF16 ? fl_bf16_to_f32(src16[so]) : fl_f16_to_f32(src16[so]);
                            if (mode == 0) want16[o] = fl_f32_to_bf16(v);
                            else want[o] = mode == 2 ? want[o] + v : v;
                        }
                const void *src = sts[si] == FL_F32 ? (const void *)srcf : (const void *)src16;
                void *dst = mode == 0 ? (void *)dst16 : (void *)dstf;
                FL_CHECK(fl_cuemu_attention_heads2d(dst, mode == 0 ? FL_BF16 : FL_F32, ldd, dhs, src, sts[si], lds, shs,
                                                    rows, heads, w, wdst, mode == 2, NULL) == 0);
                FL_CHECKF(mode == 0 ? !memcmp(dst16, want16, sizeof want16) : !memcmp(dstf, want, sizeof want),
                          "heads2d: w %d wdst %d src %s mode %d", w, wdst, fl_dtype_name(sts[si]), mode);
            }
    /* what it refuses: acc into bf16, w > wdst, a destination row too short */
    float d[64];
    FL_CHECK(fl_cuemu_attention_heads2d(d, FL_BF16, 16, 8, d, FL_F32, 16, 8, 1, 2, 8, 8, 1, NULL) != 0);
    FL_CHECK(fl_cuemu_attention_heads2d(d, FL_F32, 16, 8, d, FL_F32, 16, 8, 1, 2, 8, 4, 0, NULL) != 0);
    FL_CHECK(fl_cuemu_attention_heads2d(d, FL_F32, 12, 8, d, FL_F32, 16, 8, 1, 2, 8, 8, 0, NULL) != 0);
}
#endif

/* the emulator has no cuDNN: "cudnn" refuses to start, naming why; "auto" runs the own kernels
 * (tests/test_cuda_attn.c's dispatch test checks their bits) */
FL_TEST(cudnn_emu_choice) {
    fl_backend be;
    setenv("FITLLM_CUDA_ATTN", "cudnn", 1);
    FL_CHECK(fl_backend_init_by_name("cuda-emu", &be, 1) == FL_ERR_UNSUPPORTED);
    FL_CHECKF(strstr(fl_error_message(), "FITLLM_CUDA_ATTN=cudnn") && strstr(fl_error_message(), "GPU"), "%s",
              fl_error_message());
    setenv("FITLLM_CUDA_ATTN", "auto", 1);
    FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
    fl_backend_free(&be);
    unsetenv("FITLLM_CUDA_ATTN");
}

/* attention_heads2d adding cuDNN's 16-bit gradients into the fp32 ones as the backend calls it where the head sizes
 * agree (one "head" of the whole row): strided rows, both 16-bit types, partial blocks; exact (a 16-bit value widens
 * exactly, one fp32 add) */
FL_TEST(cudnn_acc2d_kernel) {
    const int rows = 5, cols = 300, ldd = 333, lds = 301;
    float *dst = malloc(sizeof(float) * rows * ldd), *want = malloc(sizeof(float) * rows * ldd);
    uint16_t *src = malloc(2 * (size_t)rows * lds);
    for (int t = 0; t < 2; t++) {
        fl_dtype st = t ? FL_F16 : FL_BF16;
        for (int i = 0; i < rows * ldd; i++) dst[i] = want[i] = 0.01f * (float)(i % 97) - 0.3f;
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < lds; c++) {
                float x = 0.5f * (float)((r * 31 + c * 7) % 19) - 4.0f;
                src[r * lds + c] = t ? fl_f32_to_f16(x) : fl_f32_to_bf16(x);
                if (c < cols) want[r * ldd + c] += t ? fl_f16_to_f32(src[r * lds + c]) : fl_bf16_to_f32(src[r * lds + c]);
            }
        FL_CHECK(fl_cuemu_attention_heads2d(dst, FL_F32, ldd, cols, src, st, lds, cols, rows, 1, cols, cols, 1, NULL) == 0);
        FL_CHECK(!memcmp(dst, want, sizeof(float) * rows * ldd)); /* the gaps between rows untouched */
    }
    FL_CHECK(fl_cuemu_attention_heads2d(dst, FL_F32, ldd, cols, src, FL_U8, lds, cols, rows, 1, cols, cols, 1, NULL) ==
             FL_CU_ATTN_INVALID); /* a source type it does not read */
    FL_CHECK(fl_cuemu_attention_heads2d(dst, FL_F32, 10, cols, src, FL_BF16, lds, cols, rows, 1, cols, cols, 1, NULL) ==
             FL_CU_ATTN_INVALID);
    free(dst), free(want), free(src);
}
#endif

#ifdef FL_HAVE_CUDA_EMU
#include "fitllm/selftest.h"
/* `selftest`'s attention section on the emulator: cuDNN not available (said, not a failure), the own
 * and legacy kernels within the bf16 bound of float64, through the fp32 calls and the bf16-stored ones */
FL_TEST(cudnn_selftest_choices_emu) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    fl_selftest_result r;
    setenv("FITLLM_CUDA_ATTN", "fp32", 1); /* put back after */
    FL_REQUIRE_OK(fl_selftest_attention_choices("cuda-emu", 1, f, &r));
    fclose(f);
    FL_CHECK(!strcmp(getenv("FITLLM_CUDA_ATTN"), "fp32"));
    unsetenv("FITLLM_CUDA_ATTN");
    /* 4 shapes (HD 64, 128, 100, 80) x own, legacy x the fp32 calls and a bf16 run's stored-operand calls (in16), and
     * T5's (bias, dbias, dropout: the own kernels' EX path, legacy's fp32 kernels) through the fp32 calls */
    FL_CHECKF(r.n_cases == 18 && r.n_fail == 0, "%d cases, %d failed:\n%s", r.n_cases, r.n_fail, buf);
    FL_CHECKF(strstr(buf, "cudnn  not available") && strstr(buf, "attention own    B1 T40") &&
                  strstr(buf, "attention legacy B1 T33") && strstr(buf, "HD128 causal in16   ok") &&
                  strstr(buf, "attention own    B1 T37 NH4 NKV2 HD100 causal in16   ok") &&
                  strstr(buf, "attention own    B2 T35 NH2 NKV2 HD64 t5 bias dropout ok"), "%s", buf);
    free(buf);
}

#ifdef FL_SIM_CUDNN
/* `fitllm selftest`'s cudnn rows, as a GPU would run them, through the stand-in: every shape (HD 64, 128, 100 padded
 * to 104, 80) against float64 within 8 u, the fp32 calls, the stored-operand ones and the backward in bf16
 * (attention_backward_b16); T5's bias falls back to own */
FL_TEST(cudnn_selftest_choices_sim) {
    if (!fl_test_full_only("cudnn_emu_sim_ops (the cuDNN path at these sizes), cudnn_selftest_choices_emu")) return;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    fl_selftest_result r;
    setenv("FITLLM_CUDNN_LIB", FL_SIM_CUDNN, 1);
    fl_status st = fl_selftest_attention_choices("cuda-emu", 1, f, &r);
    unsetenv("FITLLM_CUDNN_LIB");
    fclose(f);
    FL_REQUIRE_OK(st);
    FL_CHECKF(r.n_cases == 31 && r.n_fail == 0, "%d cases, %d failed:\n%s", r.n_cases, r.n_fail, buf);
    FL_CHECKF(!strstr(buf, "cudnn  not available") && strstr(buf, "attention cudnn  B1 T37 NH4 NKV2 HD100 causal in16   ok") &&
                  strstr(buf, "attention cudnn  B1 T33 NH2 NKV1 HD128 causal in16   ok") &&
                  strstr(buf, "attention cudnn  B1 T29 NH2 NKV2 HD80 causal in16    ok") &&
                  strstr(buf, "attention cudnn  B1 T40 NH4 NKV2 HD64 causal b16     ok") &&
                  strstr(buf, "attention cudnn  B1 T37 NH4 NKV2 HD100 causal b16    ok"), "%s", buf);
    free(buf);
}
#endif
#endif

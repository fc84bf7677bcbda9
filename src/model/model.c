/* Model lifetime: parameters, gradients, activation arena (and its sizing,
 * shared with the planner), random init, FLOP count. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model-impl.h"

/* ---- activation arena carving --------------------------------------------
 * One function walks the arena layout: with base == NULL it only counts
 * bytes (the planner and fl_sizing_acts), with a base it also sets the views.
 * So the size the planner predicts is by construction the size we allocate. */

typedef struct {
    char *base;
    size_t off;
} carver;

static float *carve(carver *cv, size_t nfloats) {
    size_t bytes = (nfloats * sizeof(float) + 63) / 64 * 64; /* keep every view 64-byte aligned */
    float *p = cv->base ? (float *)(cv->base + cv->off) : NULL;
    cv->off += bytes;
    return p;
}

static int logits_chunk_rows(const fl_model_config *c, int N) {
    /* About 32 MiB of logits per chunk: large enough for an efficient lm_head
     * GEMM, small enough that (N, V) never exists at once. */
    long rows = (32L << 20) / ((long)c->vocab_size * 4);
    if (rows < 32) rows = 32;
    if (rows > N) rows = N;
    return (int)rows;
}

static size_t carve_acts(const fl_model_config *c, int B, int T, char *base, fl_acts *a) {
    fl_dims d = fl_model_dims(c);
    size_t N = (size_t)B * T;
    int ln = c->arch == FL_ARCH_GPT2; /* LayerNorm keeps the mean too */
    carver cv = {base, 0};
    for (int l = 0; l <= d.L; l++) {
        float *r = carve(&cv, N * d.C);
        if (a) a->res[l] = r;
    }
    for (int l = 0; l < d.L; l++) {
        fl_layer_acts la;
        la.ln1 = carve(&cv, N * d.C);
        la.ln1_mean = ln ? carve(&cv, N) : NULL;
        la.ln1_rstd = carve(&cv, N);
        la.qkv = carve(&cv, N * d.QKV);
        la.att = carve(&cv, N * d.QD);
        la.lse = carve(&cv, N * d.NH);
        la.res_mid = carve(&cv, N * d.C);
        la.ln2 = carve(&cv, N * d.C);
        la.ln2_mean = ln ? carve(&cv, N) : NULL;
        la.ln2_rstd = carve(&cv, N);
        la.fc = carve(&cv, N * d.FCW);
        la.act = carve(&cv, N * d.F);
        if (a) a->layer[l] = la;
    }
    float *lnf = carve(&cv, N * d.C);
    float *lnf_mean = ln ? carve(&cv, N) : NULL;
    float *lnf_rstd = carve(&cv, N);
    if (a) { a->lnf = lnf; a->lnf_mean = lnf_mean; a->lnf_rstd = lnf_rstd; }
    return cv.off;
}

static size_t imax(size_t a, size_t b) { return a > b ? a : b; }

static size_t carve_work(const fl_model_config *c, int B, int T, char *base, fl_acts *a) {
    fl_dims d = fl_model_dims(c);
    size_t N = (size_t)B * T;
    carver cv = {base, 0};
    float *dres = carve(&cv, N * d.C);
    float *buf1 = carve(&cv, N * imax(imax(d.C, d.QD), d.F));
    float *buf2 = carve(&cv, N * imax(d.QKV, d.FCW));
    float *logits = carve(&cv, (size_t)logits_chunk_rows(c, (int)N) * d.V);
    float *losses = carve(&cv, N);
    size_t half = c->arch == FL_ARCH_LLAMA ? (size_t)T * (d.HD / 2) : 0;
    float *rc = carve(&cv, half), *rs = carve(&cv, half);
    if (a) {
        a->dres = dres; a->buf1 = buf1; a->buf2 = buf2; a->logits = logits; a->losses = losses;
        a->rope_cos = rc; a->rope_sin = rs; a->rope_T = T;
    }
    return cv.off;
}

void fl_sizing_acts(const fl_model_config *cfg, int B, int T, fl_act_sizes *out) {
    out->acts_bytes = carve_acts(cfg, B, T, NULL, NULL);
    out->workspace_bytes = carve_work(cfg, B, T, NULL, NULL);
    /* per layer: the difference between L and L-1 layers */
    fl_model_config c1 = *cfg;
    c1.n_layers = cfg->n_layers > 0 ? cfg->n_layers - 1 : 0;
    out->per_layer_acts_bytes = out->acts_bytes - carve_acts(&c1, B, T, NULL, NULL);
    out->logits_chunk_rows = logits_chunk_rows(cfg, B * T);
}

/* ---- lifetime ------------------------------------------------------------ */

fl_status fl_model_init(fl_model *m, const fl_model_config *cfg, const fl_backend *be, fl_mem_pool *pool) {
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    FL_TRY(fl_config_validate(&m->cfg));
    m->be = be;
    m->pool = pool;
    FL_TRY(fl_layout_build(&m->layout, &m->cfg));
    if (m->layout.numel != fl_sizing_param_count(&m->cfg)) {
        fl_layout_free(&m->layout);
        return fl_errorf(FL_ERR_INTERNAL, "layout has %zu elements but sizing counts %zu", m->layout.numel,
                         fl_sizing_param_count(&m->cfg));
    }
    fl_status s = fl_mem_alloc(pool, FL_TAG_PARAMS, m->layout.numel * sizeof(float), (void **)&m->params);
    if (s != FL_OK) {
        fl_layout_free(&m->layout);
        return fl_error_prefix(s, "allocating parameters");
    }
    return FL_OK;
}

static void free_acts(fl_model *m) {
    fl_mem_free(m->pool, m->acts_arena);
    fl_mem_free(m->pool, m->work_arena);
    m->acts_arena = m->work_arena = NULL;
    if (m->acts) {
        free(m->acts->res);
        free(m->acts->layer);
        free(m->acts);
        m->acts = NULL;
    }
    m->B = m->T = 0;
}

void fl_model_free(fl_model *m) {
    if (!m->pool) return;
    free_acts(m);
    fl_mem_free(m->pool, m->grads);
    fl_mem_free(m->pool, m->params);
    fl_layout_free(&m->layout);
    memset(m, 0, sizeof *m);
}

fl_status fl_model_alloc_grads(fl_model *m) {
    if (m->grads) return FL_OK;
    fl_status s = fl_mem_calloc(m->pool, FL_TAG_GRADS, m->layout.numel * sizeof(float), (void **)&m->grads);
    return s == FL_OK ? s : fl_error_prefix(s, "allocating gradients");
}

void fl_model_zero_grads(fl_model *m) {
    if (m->grads) m->be->zero(m->be, m->grads, m->layout.numel * sizeof(float));
}

fl_status fl_model_alloc_acts(fl_model *m, int B, int T) {
    if (B <= 0 || T <= 0) return fl_errorf(FL_ERR_INVALID, "micro-batch must be positive (B=%d, T=%d)", B, T);
    if (T > m->cfg.max_seq)
        return fl_errorf(FL_ERR_INVALID, "sequence length %d exceeds the model's max_position_embeddings %d", T,
                         m->cfg.max_seq);
    free_acts(m);
    fl_sizing_acts(&m->cfg, B, T, &m->sizes);
    fl_acts *a = calloc(1, sizeof *a);
    if (!a) return fl_errorf(FL_ERR_OOM, "activation views: out of host memory");
    a->L = m->cfg.n_layers;
    a->res = calloc((size_t)a->L + 1, sizeof *a->res);
    a->layer = calloc((size_t)a->L, sizeof *a->layer);
    m->acts = a;
    if (!a->res || !a->layer) { free_acts(m); return fl_errorf(FL_ERR_OOM, "activation views: out of host memory"); }
    fl_status s = fl_mem_alloc(m->pool, FL_TAG_ACTS, m->sizes.acts_bytes, (void **)&m->acts_arena);
    if (s == FL_OK) s = fl_mem_alloc(m->pool, FL_TAG_WORKSPACE, m->sizes.workspace_bytes, (void **)&m->work_arena);
    if (s != FL_OK) { free_acts(m); return fl_error_prefix(s, "allocating activations for B=%d T=%d", B, T); }
    carve_acts(&m->cfg, B, T, (char *)m->acts_arena, a);
    carve_work(&m->cfg, B, T, (char *)m->work_arena, a);
    if (m->cfg.arch == FL_ARCH_LLAMA)
        fl_rope_table_init(a->rope_cos, a->rope_sin, T, m->cfg.head_dim, m->cfg.rope_theta, &m->cfg.rope_scaling);
    m->B = B;
    m->T = T;
    return FL_OK;
}

float *fl_model_param(fl_model *m, const char *name) {
    int i = fl_layout_find(&m->layout, name);
    return i < 0 ? NULL : m->params + m->layout.params[i].offset;
}

float *fl_model_grad(fl_model *m, const char *name) {
    int i = fl_layout_find(&m->layout, name);
    return (i < 0 || !m->grads) ? NULL : m->grads + m->layout.params[i].offset;
}

/* ---- random init ---------------------------------------------------------- */

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static double uniform01(uint64_t *s) { return ((splitmix(s) >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

static int ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

void fl_model_init_random(fl_model *m, uint64_t seed) {
    const double std = 0.02;
    /* GPT-2 scales residual projections by 1/sqrt(2L) (HF GPT2PreTrainedModel). */
    const double proj_std = std / sqrt(2.0 * m->cfg.n_layers);
    for (int i = 0; i < m->layout.n; i++) {
        const fl_param_info *p = &m->layout.params[i];
        float *w = m->params + p->offset;
        int is_norm = strstr(p->name, "norm") || strstr(p->name, "ln_");
        if (ends_with(p->name, ".bias")) {
            memset(w, 0, p->numel * sizeof(float));
        } else if (is_norm) {
            for (size_t k = 0; k < p->numel; k++) w[k] = 1.0f;
        } else {
            double sd = (m->cfg.arch == FL_ARCH_GPT2 && ends_with(p->name, "c_proj.weight")) ? proj_std : std;
            /* per-tensor stream so the init does not depend on layout order */
            uint64_t s = seed * 0x100000001b3ULL + (uint64_t)i * 0x9e3779b97f4a7c15ULL;
            for (size_t k = 0; k < p->numel; k += 2) {
                double u1 = uniform01(&s), u2 = uniform01(&s);
                double r = sqrt(-2.0 * log(u1)), th = 6.283185307179586 * u2;
                w[k] = (float)(sd * r * cos(th));
                if (k + 1 < p->numel) w[k + 1] = (float)(sd * r * sin(th));
            }
        }
    }
}

double fl_model_train_flops(const fl_model_config *c, int B, int T) {
    fl_dims d = fl_model_dims(c);
    double tokens = (double)B * T;
    /* matmul weights per token: every linear including the head (embeddings are lookups) */
    double per_layer = (double)d.QKV * d.C + (double)d.C * d.QD + (double)d.FCW * d.C + (double)d.C * d.F;
    double nmat = d.L * per_layer + (double)d.V * d.C;
    /* attention: QK^T and PV, 2*2*T*T*QD per sequence per layer forward, halved by the
     * causal mask; x3 for forward+backward. */
    double attn = 3.0 * 2.0 * 2.0 * (double)B * T * T * d.QD * d.L / 2.0;
    return 6.0 * nmat * tokens + attn;
}

/* Model lifetime: parameters, gradients, activation arena (and its sizing,
 * shared with the planner), random init, FLOP count. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model-impl.h"

/* ---- lifetime ------------------------------------------------------------ */

fl_status fl_model_init(fl_model *m, const fl_model_config *cfg, const fl_backend *be, fl_mem_pool *pool) {
    return fl_model_init_ex(m, cfg, be, pool, NULL);
}

void fl_model_storage_for(const fl_precision *p, fl_model_storage *st) {
    memset(st, 0, sizeof *st);
    st->param_dtype = p && !p->compute_copy ? p->param_dtype : FL_F32;
}

fl_status fl_model_init_ex(fl_model *m, const fl_model_config *cfg, const fl_backend *be, fl_mem_pool *pool,
                           const fl_model_storage *st) {
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    FL_TRY(fl_config_validate(&m->cfg));
    m->be = be;
    m->pool = pool;
    m->store_dtype = st ? st->param_dtype : FL_F32;
    if (m->store_dtype != FL_F32 && m->store_dtype != FL_BF16 && m->store_dtype != FL_F16)
        return fl_errorf(FL_ERR_INVALID, "parameter storage must be F32, BF16 or F16 (got %s)",
                         fl_dtype_name(m->store_dtype));
    FL_TRY(fl_layout_build(&m->layout, &m->cfg));
    if (m->layout.numel != fl_sizing_param_count(&m->cfg)) {
        fl_layout_free(&m->layout);
        return fl_errorf(FL_ERR_INTERNAL, "layout has %zu elements but sizing counts %zu", m->layout.numel,
                         fl_sizing_param_count(&m->cfg));
    }
    fl_status s;
    if (m->store_dtype == FL_F32) {
        s = fl_mem_alloc(pool, FL_TAG_PARAMS, m->layout.numel * sizeof(float), (void **)&m->params);
    } else {
        m->pstage_n = fl_sizing_pstage_elems(&m->cfg);
        s = fl_mem_alloc(pool, FL_TAG_PARAMS, m->layout.numel * sizeof(uint16_t), (void **)&m->p16);
        if (s == FL_OK) s = fl_mem_alloc(pool, FL_TAG_WORKSPACE, m->pstage_n * sizeof(float), (void **)&m->pstage);
    }
    if (s != FL_OK) {
        fl_mem_free(pool, m->p16);
        fl_layout_free(&m->layout);
        m->p16 = NULL;
        return fl_error_prefix(s, "allocating parameters");
    }
    m->prec = *fl_precision_get(m->store_dtype == FL_BF16 ? FL_PREC_BF16_TRUE
                                : m->store_dtype == FL_F16 ? FL_PREC_16_TRUE
                                                           : FL_PREC_32_TRUE);
    return FL_OK;
}

void *fl_model_param_data(const fl_model *m, int i, fl_dtype *dt) {
    size_t off = m->layout.params[i].offset;
    if (dt) *dt = m->store_dtype;
    return m->params ? (void *)(m->params + off) : (void *)(m->p16 + off);
}

void fl_model_read_param(const fl_model *m, int i, float *dst) {
    fl_dtype dt;
    const void *src = fl_model_param_data(m, i, &dt);
    fl_convert(dst, FL_F32, src, dt, m->layout.params[i].numel);
}

void fl_model_write_param(fl_model *m, int i, const float *src) {
    fl_dtype dt;
    void *dst = fl_model_param_data(m, i, &dt);
    fl_convert(dst, dt, src, FL_F32, m->layout.params[i].numel);
}

void fl_model_free_acts(fl_model *m) {
    fl_lora_free_acts(m);
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

fl_status fl_model_set_precision(fl_model *m, const fl_precision *p) {
    if (!p->available)
        return fl_errorf(FL_ERR_UNSUPPORTED, "precision '%s' is not available yet in this build", p->name);
    fl_model_storage want;
    fl_model_storage_for(p, &want);
    if (want.param_dtype != m->store_dtype)
        return fl_errorf(FL_ERR_INVALID, "precision '%s' stores parameters in %s but this model was created with %s "
                         "storage (create it with fl_model_init_ex and fl_model_storage_for)",
                         p->name, fl_dtype_name(want.param_dtype), fl_dtype_name(m->store_dtype));
    fl_mem_free(m->pool, m->wcompute);
    m->wcompute = NULL;
    m->prec = *p;
    if (p->compute_copy) {
        fl_status s = fl_mem_alloc(m->pool, FL_TAG_PARAMS, fl_precision_copy_bytes(p, m->layout.numel),
                                   (void **)&m->wcompute);
        if (s != FL_OK) return fl_error_prefix(s, "allocating the %s weight copy", p->name);
        fl_model_sync_compute_copy(m);
    }
    return FL_OK;
}

void fl_model_sync_compute_copy(fl_model *m) {
    if (m->wcompute && m->params)
        m->be->convert(m->be, m->wcompute, m->prec.compute_dtype, m->params, FL_F32, m->layout.numel);
}

void fl_model_free(fl_model *m) {
    if (!m->pool) return;
    fl_mem_free(m->pool, m->wcompute);
    fl_model_free_acts(m);
    fl_model_lora_free(m);
    fl_mem_free(m->pool, m->grads);
    fl_mem_free(m->pool, m->params);
    fl_mem_free(m->pool, m->g16);
    fl_mem_free(m->pool, m->gstage);
    fl_mem_free(m->pool, m->pstage);
    fl_mem_free(m->pool, m->p16);
    fl_layout_free(&m->layout);
    memset(m, 0, sizeof *m);
}

fl_status fl_model_alloc_grads(fl_model *m) {
    if (m->grads || m->g16) return FL_OK;
    fl_status s;
    if (m->store_dtype == FL_F32) {
        s = fl_mem_calloc(m->pool, FL_TAG_GRADS, m->layout.numel * sizeof(float), (void **)&m->grads);
    } else {
        m->gstage_n = fl_sizing_gstage_elems(&m->cfg);
        s = fl_mem_calloc(m->pool, FL_TAG_GRADS, m->layout.numel * sizeof(uint16_t), (void **)&m->g16);
        if (s == FL_OK) s = fl_mem_alloc(m->pool, FL_TAG_WORKSPACE, m->gstage_n * sizeof(float), (void **)&m->gstage);
        if (s != FL_OK) {
            fl_mem_free(m->pool, m->g16);
            m->g16 = NULL;
        }
    }
    return s == FL_OK ? s : fl_error_prefix(s, "allocating gradients");
}

void fl_model_zero_grads(fl_model *m) {
    if (m->grads) m->be->zero(m->be, m->grads, m->layout.numel * sizeof(float));
    if (m->g16) m->be->zero(m->be, m->g16, m->layout.numel * sizeof(uint16_t));
    if (m->lora) m->be->zero(m->be, m->lora->grads, m->lora->numel * sizeof(float));
}

float *fl_model_param(fl_model *m, const char *name) {
    int i = fl_layout_find(&m->layout, name);
    return (i < 0 || !m->params) ? NULL : m->params + m->layout.params[i].offset;
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
    size_t maxn = 0;
    for (int i = 0; i < m->layout.n; i++)
        if (m->layout.params[i].numel > maxn) maxn = m->layout.params[i].numel;
    float *tmp = m->params ? NULL : malloc(maxn * sizeof(float)); /* 16-bit storage: one tensor at a time */
    if (!m->params && !tmp) {
        fl_errorf(FL_ERR_OOM, "random init: out of host memory");
        return;
    }
    for (int i = 0; i < m->layout.n; i++) {
        const fl_param_info *p = &m->layout.params[i];
        float *w = m->params ? m->params + p->offset : tmp;
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
        if (tmp) fl_model_write_param(m, i, tmp);
    }
    free(tmp);
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

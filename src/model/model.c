/* Model lifetime: parameters, gradients, activation arena (and its sizing,
 * shared with the planner), random init, FLOP count. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model-impl.h"

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
        return fl_errorf(FL_ERR_UNSUPPORTED, "precision '%s' is not available yet in this build (32-true, bf16-mixed)",
                         p->name);
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
    if (m->wcompute) m->be->convert(m->be, m->wcompute, m->prec.compute_dtype, m->params, FL_F32, m->layout.numel);
}

void fl_model_free(fl_model *m) {
    if (!m->pool) return;
    fl_mem_free(m->pool, m->wcompute);
    fl_model_free_acts(m);
    fl_model_lora_free(m);
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
    if (m->lora) m->be->zero(m->be, m->lora->grads, m->lora->numel * sizeof(float));
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

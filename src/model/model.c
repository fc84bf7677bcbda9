/* Model lifetime: the model made (its layout and store), its precision set, its activation arena freed, random
 * init, FLOP count. Reading, writing and binding its parameters and gradients is the store's (store.c). */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/tp.h"
#include "model-impl.h"
#include "store.h"

/* ---- lifetime ------------------------------------------------------------ */

fl_status fl_model_init(fl_model *m, const fl_model_config *cfg, const fl_backend *be, fl_mem_pool *pool) {
    return fl_model_init_ex(m, cfg, be, pool, NULL);
}

void fl_sizing_param_split(const fl_model_config *cfg, const fl_model_storage *st, size_t *dense_numel,
                           size_t *q4_bytes) {
    *dense_numel = fl_sizing_param_count(cfg);
    *q4_bytes = 0;
    if (!st || !st->quant4) return;
    fl_param_layout lay;
    if (fl_layout_build(&lay, cfg) != FL_OK) return;
    *dense_numel = fl_store_q4_plan(&lay, cfg, st, NULL, q4_bytes);
    fl_layout_free(&lay);
}

size_t fl_sizing_q4_staging_elems(const fl_model_config *cfg, const fl_model_storage *st) {
    if (!st || !st->quant4) return 0;
    fl_param_layout lay;
    if (fl_layout_build(&lay, cfg) != FL_OK) return 0;
    size_t mx = 0;
    for (int i = 0; i < lay.n; i++)
        if (fl_layout_entry_quantizable(&lay, i) && lay.params[i].numel > mx) mx = lay.params[i].numel;
    fl_layout_free(&lay);
    return mx;
}

fl_status fl_model_q4_staging(fl_model *m, float **out) {
    *out = NULL;
    size_t mx = 0;
    for (int i = 0; m->store->q4 && i < m->layout.n; i++)
        if (fl_model_param_is_q4(m, i) && m->layout.params[i].numel > mx) mx = m->layout.params[i].numel;
    if (!mx) return FL_OK;
    fl_status s = fl_mem_alloc(fl_mem_host_pool(m->pool), FL_TAG_WORKSPACE, mx * sizeof(float), (void **)out);
    return s == FL_OK ? FL_OK : fl_error_prefix(s, "the fp32 staging of a 4-bit weight (%zu elements)", mx);
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
    m->host_memory = be && fl_backend_host_memory(be);
    m->pool = pool;
    m->tp_ops = m->cfg.tp_size > 1 ? &fl_tp_model_ops : NULL; /* a rank's slice: tensor parallelism's passes */
    const fl_dtype dt = st ? st->param_dtype : FL_F32;
    if (dt != FL_F32 && dt != FL_BF16 && dt != FL_F16)
        return fl_errorf(FL_ERR_INVALID, "parameter storage must be F32, BF16 or F16 (got %s)", fl_dtype_name(dt));
    FL_TRY(fl_layout_build(&m->layout, &m->cfg)); /* fl_sizing_param_count measures this same layout */
    /* the store (its storage callback may make it a shard: fl_model_store_shard reads m->store) */
    fl_status s = fl_store_create(&m->layout, &m->cfg, be, pool, st, m, &m->store);
    if (s != FL_OK) {
        const int q4 = st && st->quant4;
        fl_layout_free(&m->layout);
        memset(m, 0, sizeof *m);
        return fl_error_prefix(s, "allocating parameters (%s%s)", fl_dtype_name(dt), q4 ? ", 4-bit linears" : "");
    }
    m->prec = *fl_precision_get(dt == FL_BF16 ? FL_PREC_BF16_TRUE : dt == FL_F16 ? FL_PREC_16_TRUE : FL_PREC_32_TRUE);
    m->store->compute_dtype = m->prec.compute_dtype;
    return FL_OK;
}

void fl_model_free_acts(fl_model *m) {
    if (m->adapt && m->adapt->h.free_acts) m->adapt->h.free_acts(m);
    fl_mem_free(m->pool, m->acts_arena);
    fl_mem_free(m->pool, m->work_arena);
    m->acts_arena = m->work_arena = NULL;
    if (m->acts) {
        fl_mem_free(m->pool, m->acts->targets_home ? m->acts->targets_home : m->acts->targets);
        fl_s2s_acts_free(m->acts->s2s);
        free(m->acts->sp_pad);
        free(m->acts->res);
        free(m->acts->res16);
        free(m->acts->layer);
        free((void *)m->acts->graph);
        free(m->acts);
        m->acts = NULL;
    }
    m->B = m->T = 0;
}

/* The ops a precision policy's steps run with its dtypes, checked against the backend when the
 * policy is set (fl_backend.supports_op), so a missing kernel is an error naming it now, not
 * FL_ERR_UNSUPPORTED in the middle of the first step. */
static fl_status check_backend_ops(const fl_model *m, const fl_precision *p) {
    const fl_backend *be = m->be;
    if (!be) return FL_OK; /* a model without a backend (the I/O tools) runs no op */
    const fl_dtype cd = p->compute_dtype, sd = m->store->dtype;
    struct {
        fl_op op;
        fl_dtype a, b, c;
        int needed;
    } need[] = {
        {FL_OP_GEMM, FL_F32, cd, FL_F32, 1},                      /* y = x W^T, dx = dy W */
        {FL_OP_GEMM, FL_BF16, FL_BF16, FL_F32, cd == FL_BF16},    /* bf16 dW = dy^T x */
        {FL_OP_CONVERT, cd, FL_F32, FL_F32, p->compute_copy},     /* the compute copy */
        {FL_OP_CONVERT, sd, FL_F32, FL_F32, sd != FL_F32},        /* 16-bit storage in and out */
        {FL_OP_CONVERT, FL_F32, sd, FL_F32, sd != FL_F32},
        {FL_OP_ACCUMULATE16, sd, FL_F32, FL_F32, sd != FL_F32},   /* gradients added into 16-bit */
        {FL_OP_SUMSQ, sd, FL_F32, FL_F32, 1},                     /* the gradient norm */
        {FL_OP_Q4_MATMUL, FL_F32, FL_F32, FL_F32, m->store->q4 != NULL}, /* QLoRA's 4-bit linears */
    };
    for (size_t k = 0; k < sizeof need / sizeof need[0]; k++)
        if (need[k].needed && !be->supports_op(be, need[k].op, need[k].a, need[k].b, need[k].c))
            return fl_errorf(FL_ERR_UNSUPPORTED, "backend '%s' does not implement %s(%s, %s, %s), which precision '%s' "
                             "needs", be->name, fl_op_name(need[k].op), fl_dtype_name(need[k].a),
                             fl_dtype_name(need[k].b), fl_dtype_name(need[k].c), p->name);
    return FL_OK;
}

fl_status fl_model_set_precision(fl_model *m, const fl_precision *p) {
    if (!p->available)
        return fl_errorf(FL_ERR_UNSUPPORTED, "precision '%s' is not available yet in this build", p->name);
    fl_model_storage want;
    fl_model_storage_for(p, &want);
    if (want.param_dtype != m->store->dtype)
        return fl_errorf(FL_ERR_INVALID, "precision '%s' stores parameters in %s but this model was created with %s "
                         "storage (create it with fl_model_init_ex and fl_model_storage_for)",
                         p->name, fl_dtype_name(want.param_dtype), fl_dtype_name(m->store->dtype));
    FL_TRY(check_backend_ops(m, p));
    const fl_dtype old_compute = m->prec.name ? m->prec.compute_dtype : FL_F32;
    m->prec = *p;
    FL_TRY(fl_store_set_compute(m->store, p));
    /* the saved activations' storage follows the policy: re-size an arena already allocated */
    /* ... and the workspace's compute-dtype parts (the widened head, the backend's scratch) */
    if (m->acts && (m->act_dtype != p->act_dtype || old_compute != p->compute_dtype)) {
        fl_status s = fl_model_alloc_acts(m, m->B, m->T);
        if (s != FL_OK) return fl_error_prefix(s, "re-sizing the activations for %s", p->name);
    }
    return FL_OK;
}

void fl_model_free(fl_model *m) {
    if (!m->pool) return;
    fl_model_free_acts(m);
    fl_model_detach_adapters(m);
    fl_store_destroy(m->store);
    fl_layout_free(&m->layout);
    memset(m, 0, sizeof *m);
}

void fl_model_set_eos_ids(fl_model *m, const int32_t *ids, int n) {
    m->eos.n = 0;
    for (int i = 0; i < n && m->eos.n < FL_MODEL_MAX_EOS; i++) m->eos.ids[m->eos.n++] = ids[i];
}

int fl_model_is_eos(const fl_model *m, int32_t id) {
    if (!m->eos.n) return id == m->cfg.eos_id;
    for (int i = 0; i < m->eos.n; i++)
        if (m->eos.ids[i] == id) return 1;
    return 0;
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

/* Fills elements [k0, k1) of a tensor's init stream into w[0 .. k1-k0) (k0 even). The stream
 * is one Box-Muller pair per two elements, so any even split gives the same values. */
static void init_fill(float *w, size_t k0, size_t k1, size_t numel, int kind, double sd, uint64_t *s) {
    for (size_t k = k0; k < k1; k += 2) {
        float *o = w + (k - k0);
        if (kind == 0) { o[0] = 0.0f; if (k + 1 < k1) o[1] = 0.0f; continue; }
        if (kind == 1) { o[0] = 1.0f; if (k + 1 < k1) o[1] = 1.0f; continue; }
        double u1 = uniform01(s), u2 = uniform01(s);
        double r = sqrt(-2.0 * log(u1)), th = 6.283185307179586 * u2;
        o[0] = (float)(sd * r * cos(th));
        if (k + 1 < numel && k + 1 < k1) o[1] = (float)(sd * r * sin(th));
    }
}

fl_status fl_model_init_random_ex(fl_model *m, uint64_t seed) {
    const double std = 0.02;
    /* GPT-2 scales residual projections by 1/sqrt(2L) (HF GPT2PreTrainedModel). */
    const double proj_std = std / sqrt(2.0 * m->cfg.n_layers);
    /* 16-bit storage: written in fixed slices through a small buffer (no whole-tensor fp32
     * temporary: up to V x C floats); a 4-bit entry is quantized whole, from the pool's
     * staging (WORKSPACE, freed at the end; the planner counts it in "model load") */
    float *q4tmp = NULL;
    FL_TRY(fl_model_q4_staging(m, &q4tmp));
    if (m->be && fl_backend_discards(m->be)) { /* the planner's null backend: the same allocations, no values */
        fl_mem_free(fl_mem_host_pool(m->pool), q4tmp);
        return FL_OK;
    }
    /* a block of NS slices per copy, the slices generated in parallel (each slice's stream state is
     * computed from its first element, so the values do not depend on the split); 768 KiB of host
     * buffer (under the 1 MiB the allocation check allows outside the pool) */
    enum { SLICE = 16384, NS = 8, BLOCK = SLICE * NS };
    /* the backend's threads on the CPU; a device backend's count is its own (CUDA: 1): the host's cores then */
    const int nt = m->be && fl_backend_host_memory(m->be) && m->be->n_threads > 0 ? m->be->n_threads : fl_cpu_default_threads();
    float *slice = malloc(BLOCK * sizeof(float) + BLOCK * sizeof(uint16_t));
    if (!slice) {
        fl_mem_free(fl_mem_host_pool(m->pool), q4tmp);
        return fl_errorf(FL_ERR_OOM, "random init: out of host memory");
    }
    for (int i = 0; i < m->layout.n; i++) {
        const fl_param_info *p = &m->layout.params[i];
        int is_norm = p->role == FL_ROLE_LN1_W || p->role == FL_ROLE_LN2_W || p->role == FL_ROLE_NORM_F_W ||
                      p->role == FL_ROLE_EMB_NORM_W;
        int kind = ends_with(p->name, ".bias") ? 0 : is_norm ? 1 : 2;
        const int residual_proj = p->role == FL_ROLE_O_W || p->role == FL_ROLE_PROJ_W;
        double sd = fl_arch_get(m->cfg.arch)->scaled_proj_init && residual_proj ? proj_std : std;
        /* per-tensor stream so the init does not depend on layout order */
        uint64_t s = seed * 0x100000001b3ULL + (uint64_t)i * 0x9e3779b97f4a7c15ULL;
        if (fl_model_param_is_q4(m, i)) { /* the whole tensor, its slices in parallel (as below) */
            const long nsl = (long)((p->numel + SLICE - 1) / SLICE);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && nsl > 1)
            for (long q = 0; q < nsl; q++) {
                const size_t k0 = (size_t)q * SLICE, k1 = p->numel - k0 < SLICE ? p->numel : k0 + SLICE;
                uint64_t sq = kind == 2 ? s + (uint64_t)k0 * 0x9e3779b97f4a7c15ULL : s;
                init_fill(q4tmp + k0, k0, k1, p->numel, kind, sd, &sq);
            }
            fl_model_write_param(m, i, q4tmp);
        } else { /* generated on the host in slices, copied into the (device) storage */
            /* only the part this model holds (sharded: this rank's piece [a, b) of the entry). The
             * stream is splitmix64, a counter (draw j reads the state s + (j+1) x gamma), and each
             * pair of elements takes two draws: starting at the pair of element a is starting the
             * state at s + a0 x gamma (a0 = a rounded down to even), the whole stream's values */
            fl_dtype dt;
            size_t a, b;
            char *dst = fl_model_param_piece(m, i, &a, &b, &dt);
            const size_t a0 = a & ~(size_t)1, es = fl_dtype_size(dt);
            const fl_backend *dbe = fl_model_params_be(m);
            if (dbe && dbe->init_random && !m->store->tpool) { /* on the device: no host stream, no copy */
                fl_status st = dbe->init_random(dbe, dst, dt, a, b, p->numel, kind, sd, s);
                if (st != FL_OK) {
                    free(slice);
                    fl_mem_free(fl_mem_host_pool(m->pool), q4tmp);
                    return st;
                }
                continue;
            }
            uint16_t *s16 = (uint16_t *)(slice + BLOCK);
            /* a block in at least nt slices (more than NS threads, e.g. a GPU machine's host cores, all work);
             * even lengths keep every slice's start on a pair of the stream */
            const size_t sl = nt > NS ? ((size_t)BLOCK / (size_t)nt) & ~(size_t)1 : SLICE;
            for (size_t B0 = a0; B0 < b; B0 += BLOCK) { /* block [B0, B1): slices of sl, element lo.. kept */
                const size_t B1 = b - B0 < BLOCK ? b : B0 + BLOCK, lo = B0 > a ? B0 : a;
                const long nsl = (long)((B1 - B0 + sl - 1) / sl);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && nsl > 1)
                for (long q = 0; q < nsl; q++) {
                    const size_t k0 = B0 + (size_t)q * sl, k1 = B1 - k0 < sl ? B1 : k0 + sl;
                    uint64_t sq = kind == 2 ? s + (uint64_t)k0 * 0x9e3779b97f4a7c15ULL : s; /* pair k0/2's state */
                    init_fill(slice + (k0 - B0), k0, k1, p->numel, kind, sd, &sq);
                    if (dt != FL_F32) { /* [max(k0, lo), k1) into s16 at the same offset from lo */
                        const size_t c0 = k0 > lo ? k0 : lo;
                        if (k1 > c0) fl_convert(s16 + (c0 - lo), dt, slice + (c0 - B0), FL_F32, k1 - c0);
                    }
                }
                const void *h = dt != FL_F32 ? (const void *)s16 : (const void *)(slice + (lo - B0));
                size_t nb = (B1 - lo) * es;
                fl_status st = FL_OK;
                const fl_backend *pbe = fl_model_params_be(m); /* parameter offload: the host tier's */
                if (pbe) st = FL_RUN(pbe, to_device, dst + (lo - a) * es, h, nb);
                else memcpy(dst + (lo - a) * es, h, nb); /* no backend: host memory */
                /* parameter offload on NVMe: each tensor's pages leave the process once written (no-op elsewhere) */
                if (st == FL_OK && B1 >= b && m->store->tpool)
                    st = fl_mem_disk_advise(m->store->tpool, dst, (b - a) * es, FL_DISK_FLUSH);
                if (st != FL_OK) {
                    free(slice);
                    fl_mem_free(fl_mem_host_pool(m->pool), q4tmp);
                    return st;
                }
            }
        }
    }
    free(slice);
    fl_mem_free(fl_mem_host_pool(m->pool), q4tmp);
    return FL_OK;
}

void fl_model_init_random(fl_model *m, uint64_t seed) { (void)fl_model_init_random_ex(m, seed); }

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

double fl_model_train_flops_s2s(const fl_model_config *c, int B, int Ts, int Tt) {
    const double C = c->dim, QD = (double)c->n_heads * c->head_dim, F = c->ffn_dim, FCW = c->ffn_gated ? 2 * F : F;
    const double Le = c->n_layers, Ld = c->n_dec_layers, ns = (double)B * Ts, nt = (double)B * Tt;
    const double self = 3 * QD * C + C * QD, ffn = FCW * C + C * F, xq_o = 2 * QD * C, xkv = 2 * QD * C;
    const double mat = Le * (self + ffn) * ns + (Ld * (self + xq_o + ffn) + (double)c->vocab_size * C) * nt + Ld * xkv * ns;
    /* QK^T and PV: 2 x 2 x rows x keys x QD per layer forward, x3 for forward + backward */
    const double attn = 12.0 * QD * (Le * ns * Ts + Ld * nt * Tt / 2.0 + Ld * nt * Ts);
    return 6.0 * mat + attn;
}

/* Generation: KV cache, prefill / decode forward, sampling, the token loop.
 * The blocks run the training forward's block graph (graph.c) with the cache in
 * the context: the prompt uses the causal attention op on itself, a decode step
 * attends one query to the cached keys (attention_decode). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/generate.h"
#include "model-impl.h"
#include "store.h"

/* ---- scratch for a forward over n rows ------------------------------------
 * The block graph's slots, sharing buffers by liveness (fl_block_rows_scratch: the blocks run in place,
 * input and output in one buffer), then the final norm of the last row. */

typedef struct {
    fl_block_graph g;
    float *s[FL_GRAPH_MAX_SLOTS]; /* (n, width) views of the block's slots */
    float *ln, *mean, *rstd;      /* (1, C), (1), (1): the final norm of the last row */
} rows_scratch;

static size_t al16(size_t n) { return (n + 15) / 16 * 16; } /* 64-byte aligned views */

static size_t scratch_floats(const fl_block_graph *g, int C, int n, rows_scratch *w, float *base) {
    size_t off = fl_block_rows_scratch(g, n, base, w ? w->s : NULL);
    if (w) w->ln = base + off;
    off += al16((size_t)C);
    if (w) w->mean = base + off;
    off += al16(1);
    if (w) w->rstd = base + off;
    off += al16(1);
    return off;
}

/* ---- the cache ---------------------------------------------------------------- */

size_t fl_kv_cache_bytes(const fl_model_config *cfg, int max_T) {
    return 2 * (size_t)cfg->n_layers * cfg->n_kv_heads * (size_t)max_T * cfg->head_dim * sizeof(float);
}

fl_status fl_kv_cache_init(fl_kv_cache *kv, const fl_model *m, int max_T) {
    memset(kv, 0, sizeof *kv);
    const fl_model_config *c = &m->cfg;
    if (max_T <= 0) max_T = c->max_seq;
    if (max_T > c->max_seq)
        return fl_errorf(FL_ERR_INVALID, "KV cache of %d positions exceeds the model's context of %d", max_T,
                         c->max_seq);
    fl_dims d = fl_model_dims(c);
    kv->n_layers = d.L;
    kv->n_kv_heads = d.NKV;
    kv->head_dim = d.HD;
    kv->max_T = max_T;
    kv->pool = m->pool;
    size_t half = fl_kv_cache_bytes(c, max_T) / 2;
    fl_status s = fl_mem_alloc(m->pool, FL_TAG_ACTS, half, (void **)&kv->k);
    if (s == FL_OK) s = fl_mem_alloc(m->pool, FL_TAG_ACTS, half, (void **)&kv->v);
    fl_gen_sizes gs;
    fl_sizing_generate(c, 1, max_T, &gs);
    if (s == FL_OK && fl_arch_get(c->arch)->rope) {
        size_t tb = gs.rope_bytes / 2;
        s = fl_mem_alloc(m->pool, FL_TAG_WORKSPACE, tb, (void **)&kv->rope_cos);
        if (s == FL_OK) s = fl_mem_alloc(m->pool, FL_TAG_WORKSPACE, tb, (void **)&kv->rope_sin);
        if (s == FL_OK)
            s = m->be->rope_tables(m->be, kv->rope_cos, kv->rope_sin, max_T, d.HD, c->rope_theta, &c->rope_scaling);
    }
    if (s == FL_OK)
        s = fl_mem_alloc(m->pool, FL_TAG_WORKSPACE, gs.step_bytes, (void **)&kv->step);
    size_t bes = fl_model_backend_scratch(m->prec.name ? m->prec.compute_dtype : FL_F32, fl_model_quant4(m),
                                          m->be->scratch_bytes);
    if (s == FL_OK && bes && !(m->acts && m->acts->be_scratch))
        s = fl_mem_alloc(m->pool, FL_TAG_WORKSPACE, bes, &kv->be_scratch);
    if (s == FL_OK && !fl_backend_host_memory(m->be)) {
        s = fl_mem_alloc(m->pool, FL_TAG_OTHER, (size_t)max_T * sizeof(int32_t), (void **)&kv->dids);
        if (s == FL_OK) s = fl_mem_alloc(m->pool, FL_TAG_WORKSPACE, (size_t)d.V * sizeof(float), (void **)&kv->dlogits);
    }
    if (s != FL_OK) {
        fl_kv_cache_free(kv);
        return fl_error_prefix(s, "allocating the KV cache (%d positions)", max_T);
    }
    /* live: what every later decode step reads (the cache's positions as they fill, the RoPE tables) */
    fl_mem_set_live(m->pool, kv->k, SIZE_MAX);
    fl_mem_set_live(m->pool, kv->v, SIZE_MAX);
    fl_mem_set_live(m->pool, kv->rope_cos, SIZE_MAX);
    fl_mem_set_live(m->pool, kv->rope_sin, SIZE_MAX);
    return FL_OK;
}

void fl_kv_cache_free(fl_kv_cache *kv) {
    if (!kv || !kv->pool) return;
    fl_mem_free(kv->pool, kv->k);
    fl_mem_free(kv->pool, kv->v);
    fl_mem_free(kv->pool, kv->rope_cos);
    fl_mem_free(kv->pool, kv->rope_sin);
    fl_mem_free(kv->pool, kv->step);
    fl_mem_free(kv->pool, kv->be_scratch);
    fl_mem_free(kv->pool, kv->dids);
    fl_mem_free(kv->pool, kv->dlogits);
    memset(kv, 0, sizeof *kv);
}

void fl_kv_cache_reset(fl_kv_cache *kv) { kv->pos = 0; }

/* ---- the forward ------------------------------------------------------------------
 * n rows at positions pos0 .. pos0+n-1, where either n == 1 (decode: attend
 * to cached keys 0..pos0) or pos0 == 0 (prefill: causal attention within the
 * n rows, which are then the whole context). */
static fl_status forward_rows_impl(fl_model *m, fl_kv_cache *kv, const rows_scratch *w, const int32_t *ids, int n,
                                   int pos0, float *logits);

/* The backend's scratch lent for the call (see transformer.c's lend_scratch): the activation
 * arena's when the model has one (a training run's evaluation sample), else the cache's. */
static fl_status forward_rows(fl_model *m, fl_kv_cache *kv, const rows_scratch *w, const int32_t *ids, int n,
                              int pos0, float *logits) {
    void *sc = m->acts && m->acts->be_scratch ? m->acts->be_scratch : kv->be_scratch;
    if (sc) FL_RUN(m->be, set_scratch, sc, m->be->scratch_bytes);
    fl_model_tell_compute_dtype(m, 1);
    fl_status s = forward_rows_impl(m, kv, w, ids, n, pos0, logits);
    fl_model_tell_compute_dtype(m, 0);
    if (sc) FL_RUN(m->be, set_scratch, NULL, 0);
    return s;
}

/* the final norm and the head on the last row only: logits (V) into the caller's host buffer */
static fl_status head_logits(fl_model *m, fl_kv_cache *kv, const rows_scratch *w, const fl_outer_params *op,
                             const float *last, float *logits) {
    const fl_backend *be = m->be;
    fl_dims d = fl_model_dims(&m->cfg);
    (void)fl_norm_forward_t(m, w->ln, NULL, w->mean, w->rstd, last, op->lnf_w, op->lnf_wt, op->lnf_b, 1);
    fl_linear head = {.in = d.C, .out = d.V, .w = op->head};
    fl_linear_set_weight(m, &head, op->head_idx);
    if (m->adapt) m->adapt->bind(m->adapt, -1, 0, &head, 0); /* an lm_head adapter (one row; dropout is off outside training) */
    if (!kv->dlogits && !fl_tp_vocab_split(m)) return fl_linear_forward(be, logits, w->ln, &head, 1); // (V)
    float *dl = kv->dlogits ? kv->dlogits : logits; /* tensor parallel on host memory: the slice, then gathered */
    FL_TRY(fl_linear_forward(be, dl, w->ln, &head, 1)); /* device logits, to the caller's host buffer */
    return fl_head_logits_out(m, logits, dl, 1);
}

static fl_status forward_rows_impl(fl_model *m, fl_kv_cache *kv, const rows_scratch *w, const int32_t *ids, int n,
                                   int pos0, float *logits) {
    const fl_backend *be = m->be;
    fl_dims d = fl_model_dims(&m->cfg);
    fl_outer_params op;
    const int32_t *dids = ids; /* host memory: the op reads the caller's ids */
    if (kv->dids) {
        FL_TRY(FL_RUN(be, to_device, kv->dids, ids, (size_t)n * sizeof *ids));
        dids = kv->dids;
    }
    float *x = w->s[FL_GSLOT_IN]; // (n, C): every block's input and output (fl_block_rows_scratch)
    /* sharded parameters (FSDP / ZeRO-3, parameter offload): each unit fetched right before use, the next one's
     * fetch posted ahead, released after, in the training forward's order (transformer.c): the embeddings (kept
     * for the head when tied), the blocks, the head group; only with logits wanted is the head fetched at all.
     * Every rank of the shard group runs this in step (the gathers are collectives). A whole store: no-ops. */
    const int L = d.L, HG = L + 1, head = logits != NULL, tied = m->cfg.tie_embeddings;
    FL_TRY(fl_store_gather(m->store, 0, L > 0 ? 1 : head ? HG : -1));
    fl_get_outer(m, &op);
    FL_TRY(fl_embed_forward(m, &op, x, dids, ids, 1, n, pos0));
    /* rows the caller supplies (fl_model.emb_inject: BLIP-2's projected queries) in a prefill: the row + its
     * position, as the training forward's embedding (blip2_pass.c) */
    for (int i = 0; pos0 == 0 && i < m->emb_inject.n; i++) {
        const int t = m->emb_inject.rows[i];
        if (t < 0 || t >= n) return fl_errorf(FL_ERR_INVALID, "injected row %d outside the prefill's %d rows", t, n);
        float *r = x + (size_t)t * d.C;
        FL_TRY(FL_RUN(be, copy, r, m->emb_inject.src + (size_t)i * d.C, (size_t)d.C * sizeof(float)));
        if (op.wpe) FL_RUN(be, add, r, r, op.wpe + (size_t)t * d.C, (size_t)d.C);
    }
    if (!(tied && head)) fl_store_release(m->store, 0);
    /* the block graph with the cache: attention appends K/V rows (after RoPE), then attends causally
     * within the n rows (prefill, pos0 == 0) or, for one row, to the cached positions 0..pos0 (decode) */
    fl_block_ctx c = {.B = 1, .T = n, .pos0 = pos0, .rope_cos = kv->rope_cos, .rope_sin = kv->rope_sin, .kv = kv,
                      .comm = m->tp_comm};
    for (int l = 0; l < L; l++) {
        FL_TRY(fl_store_gather(m->store, l + 1, l + 2 <= L ? l + 2 : head ? HG : -1));
        fl_block_params bp;
        fl_get_block(m, &w->g, l, &bp);
        c.layer = l;
        FL_TRY(fl_block_forward(m, &w->g, &bp, w->s, &c));
        fl_store_release(m->store, l + 1);
    }
    kv->pos = pos0 + n;
    if (!head) return FL_OK;
    FL_TRY(fl_store_gather(m->store, HG, -1));
    fl_get_outer(m, &op); /* sharded: the head group's views exist from here */
    fl_status s = head_logits(m, kv, w, &op, x + (size_t)(n - 1) * d.C, logits);
    fl_store_release(m->store, HG);
    if (tied) fl_store_release(m->store, 0);
    return s;
}

static fl_status check_ids(const fl_model *m, const fl_kv_cache *kv, const int32_t *ids, int n) {
    if (!kv->k) return fl_errorf(FL_ERR_INVALID, "KV cache not initialized");
    if (kv->n_layers != m->cfg.n_layers || kv->n_kv_heads != m->cfg.n_kv_heads || kv->head_dim != m->cfg.head_dim)
        return fl_errorf(FL_ERR_INVALID, "KV cache was made for another model shape");
    if (n <= 0) return fl_errorf(FL_ERR_INVALID, "nothing to run: %d tokens", n);
    if (kv->pos + n > kv->max_T)
        return fl_errorf(FL_ERR_INVALID, "%d positions exceed the KV cache's (context) capacity of %d",
                         kv->pos + n, kv->max_T);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= m->cfg.vocab_size)
            return fl_errorf(FL_ERR_INVALID, "token id %d at position %d is outside the vocabulary [0, %d)", ids[i],
                             kv->pos + i, m->cfg.vocab_size);
    return FL_OK;
}

fl_status fl_model_decode(fl_model *m, fl_kv_cache *kv, int32_t id, float *logits) {
    FL_TRY(check_ids(m, kv, &id, 1));
    rows_scratch w;
    FL_TRY(fl_block_graph_build(&m->cfg, &w.g));
    scratch_floats(&w.g, m->cfg.dim, 1, &w, kv->step);
    return forward_rows(m, kv, &w, &id, 1, kv->pos, logits);
}

fl_status fl_model_prefill(fl_model *m, fl_kv_cache *kv, const int32_t *ids, int n, float *logits) {
    FL_TRY(check_ids(m, kv, ids, n));
    if (kv->pos > 0 || n == 1) {
        for (int i = 0; i < n; i++) FL_TRY(fl_model_decode(m, kv, ids[i], i == n - 1 ? logits : NULL));
        return FL_OK;
    }
    rows_scratch w;
    FL_TRY(fl_block_graph_build(&m->cfg, &w.g));
    float *base = NULL;
    FL_TRY(fl_mem_alloc(m->pool, FL_TAG_WORKSPACE, scratch_floats(&w.g, m->cfg.dim, n, NULL, NULL) * sizeof(float),
                        (void **)&base));
    scratch_floats(&w.g, m->cfg.dim, n, &w, base);
    fl_status s = forward_rows(m, kv, &w, ids, n, 0, logits);
    fl_mem_free(m->pool, base);
    return s;
}

/* ---- sampling ------------------------------------------------------------------------ */

void fl_gen_params_default(fl_gen_params *p) {
    p->max_new_tokens = 50;
    p->temperature = 0.8f;
    p->top_k = 50;
    p->top_p = 1.0f;
    p->seed = 1337;
}

fl_status fl_gen_params_validate(const fl_gen_params *p) {
    if (p->max_new_tokens < 0) return fl_errorf(FL_ERR_INVALID, "max_new_tokens must be >= 0 (got %d)", p->max_new_tokens);
    if (!(p->temperature >= 0) || isinf(p->temperature))
        return fl_errorf(FL_ERR_INVALID, "temperature must be a finite number >= 0 (got %g)", p->temperature);
    if (!(p->top_p > 0 && p->top_p <= 1)) return fl_errorf(FL_ERR_INVALID, "top_p must be in (0, 1] (got %g)", p->top_p);
    return FL_OK;
}

fl_status fl_sampler_init(fl_sampler *s, fl_mem_pool *pool, int V, const fl_gen_params *p) {
    memset(s, 0, sizeof *s);
    FL_TRY(fl_gen_params_validate(p));
    s->p = *p;
    s->V = V;
    s->rng = p->seed;
    s->pool = pool;
    fl_status st = fl_mem_alloc(pool, FL_TAG_WORKSPACE, (size_t)V * sizeof(float), (void **)&s->probs);
    if (st == FL_OK) st = fl_mem_alloc(pool, FL_TAG_WORKSPACE, (size_t)V * sizeof(int32_t), (void **)&s->idx);
    if (st != FL_OK) { fl_sampler_free(s); return fl_error_prefix(st, "allocating the sampler"); }
    return FL_OK;
}

void fl_sampler_free(fl_sampler *s) {
    if (!s || !s->pool) return;
    fl_mem_free(s->pool, s->probs);
    fl_mem_free(s->pool, s->idx);
    memset(s, 0, sizeof *s);
}

/* splitmix64 -> uniform double in [0, 1) with 53 bits */
static double rng_uniform(uint64_t *st) {
    uint64_t z = (*st += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

static int32_t argmax(const float *x, int V) {
    int32_t best = 0;
    for (int i = 1; i < V; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* k-th largest (1-based) of a[0..n-1] (a is reordered): quickselect, middle pivot. */
static float kth_largest(float *a, int n, int k) {
    int lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        float piv = a[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (a[i] > piv) i++;
            while (a[j] < piv) j--;
            if (i <= j) { float t = a[i]; a[i] = a[j]; a[j] = t; i++; j--; }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return a[want];
    }
    return a[want];
}

static const float *g_sort_probs; /* qsort has no context argument; sampling runs on one thread */
static int cmp_prob_asc(const void *a, const void *b) {
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    float pi = g_sort_probs[i], pj = g_sort_probs[j];
    if (pi != pj) return pi < pj ? -1 : 1;
    return i > j ? -1 : i < j; /* ties: higher index first, so the lower index ranks as more likely */
}

int32_t fl_sampler_sample(fl_sampler *s, float *logits) {
    const int V = s->V;
    const fl_gen_params *p = &s->p;
    if (p->temperature == 0) return argmax(logits, V);
    /* 1. top-k: drop logits below the k-th largest (ties at the threshold kept, as torch.where(l < v[-1])) */
    if (p->top_k > 0 && p->top_k < V) {
        memcpy(s->probs, logits, (size_t)V * sizeof(float));
        float th = kth_largest(s->probs, V, p->top_k);
        for (int i = 0; i < V; i++)
            if (logits[i] < th) logits[i] = -INFINITY;
    }
    /* 2. temperature and softmax (sum in double) */
    float mx = -INFINITY;
    for (int i = 0; i < V; i++) mx = logits[i] > mx ? logits[i] : mx;
    const float inv_t = 1.0f / p->temperature;
    double sum = 0;
    for (int i = 0; i < V; i++) {
        float e = logits[i] == -INFINITY ? 0.0f : expf((logits[i] - mx) * inv_t);
        s->probs[i] = e;
        sum += e;
    }
    for (int i = 0; i < V; i++) s->probs[i] = (float)(s->probs[i] / sum);
    /* 3. top-p (LitGPT's sample_top_p): ascending order, drop tokens whose cumulative
     * probability is <= 1 - top_p, always keep the most likely one; renormalize. */
    if (p->top_p < 1.0f) {
        int n = 0;
        for (int i = 0; i < V; i++)
            if (s->probs[i] > 0) s->idx[n++] = i;
        g_sort_probs = s->probs;
        qsort(s->idx, (size_t)n, sizeof *s->idx, cmp_prob_asc);
        double cum = 0, kept = 0;
        for (int r = 0; r < n; r++) {
            int32_t i = s->idx[r];
            cum += s->probs[i];
            if (cum <= 1.0 - p->top_p && r < n - 1) s->probs[i] = 0.0f;
            else kept += s->probs[i];
        }
        for (int r = 0; r < n; r++) s->probs[s->idx[r]] = (float)(s->probs[s->idx[r]] / kept);
    }
    /* 4. inverse-CDF draw */
    double u = rng_uniform(&s->rng), c = 0;
    int32_t last = -1;
    for (int i = 0; i < V; i++) {
        if (s->probs[i] <= 0) continue;
        c += s->probs[i];
        last = i;
        if (u < c) return i;
    }
    return last >= 0 ? last : argmax(logits, V);
}

/* ---- the loop --------------------------------------------------------------------------- */

fl_status fl_generate(fl_model *m, fl_kv_cache *kv, const int32_t *prompt, int n_prompt, const fl_gen_params *p,
                      const int32_t *eos_ids, int n_eos, int32_t *out, int *n_out, fl_gen_stop *why,
                      fl_gen_callback cb, void *ud) {
    *n_out = 0;
    if (why) *why = FL_GEN_STOP_MAX_TOKENS;
    FL_TRY(fl_gen_params_validate(p));
    if (n_prompt < 1) return fl_errorf(FL_ERR_INVALID, "generation needs a prompt of at least one token (e.g. BOS)");
    if (n_prompt > kv->max_T)
        return fl_errorf(FL_ERR_INVALID, "prompt of %d tokens exceeds the context of %d", n_prompt, kv->max_T);
    fl_sampler smp;
    float *logits = NULL;
    /* the sampler and the logits it reads are host memory */
    FL_TRY(fl_sampler_init(&smp, fl_mem_host_pool(m->pool), m->cfg.vocab_size, p));
    fl_status s = fl_mem_alloc(fl_mem_host_pool(m->pool), FL_TAG_WORKSPACE, (size_t)m->cfg.vocab_size * sizeof(float),
                               (void **)&logits);
    if (s == FL_OK) {
        fl_kv_cache_reset(kv);
        s = fl_model_prefill(m, kv, prompt, n_prompt, logits);
    }
    int n = 0;
    while (s == FL_OK && n < p->max_new_tokens) {
        if (kv->pos >= kv->max_T) { if (why) *why = FL_GEN_STOP_CONTEXT; break; }
        int32_t tok = fl_sampler_sample(&smp, logits);
        out[n++] = tok;
        int is_eos = 0;
        for (int i = 0; i < n_eos; i++) is_eos |= tok == eos_ids[i];
        if (cb && cb(ud, tok)) { if (why) *why = FL_GEN_STOP_CALLBACK; break; }
        if (is_eos) { if (why) *why = FL_GEN_STOP_EOS; break; }
        if (n == p->max_new_tokens) break;
        /* the sequence is now kv->pos + 1 long: at the context, stop without a wasted decode */
        if (kv->pos + 1 >= kv->max_T) { if (why) *why = FL_GEN_STOP_CONTEXT; break; }
        s = fl_model_decode(m, kv, tok, logits);
    }
    *n_out = n;
    fl_mem_free(fl_mem_host_pool(m->pool), logits);
    fl_sampler_free(&smp);
    return s;
}

/* ---- sizing (shared with the planner) ------------------------------------------------ */

void fl_sizing_generate(const fl_model_config *cfg_in, int n_prompt, int max_T, fl_gen_sizes *out) {
    fl_model_config c = *cfg_in;
    memset(out, 0, sizeof *out);
    if (fl_config_validate(&c) != FL_OK || max_T <= 0) return;
    fl_dims d = fl_model_dims(&c);
    fl_block_graph g;
    if (fl_block_graph_build(&c, &g) != FL_OK) return;
    out->kv_bytes = fl_kv_cache_bytes(&c, max_T);
    if (fl_arch_get(c.arch)->rope) out->rope_bytes = 2 * (size_t)max_T * (d.HD / 2) * sizeof(float);
    out->step_bytes = scratch_floats(&g, d.C, 1, NULL, NULL) * sizeof(float);
    out->sampler_bytes = (size_t)c.vocab_size * (sizeof(float) + sizeof(int32_t));
    out->logits_bytes = (size_t)c.vocab_size * sizeof(float);
    if (n_prompt > 1) out->prefill_bytes = scratch_floats(&g, d.C, n_prompt, NULL, NULL) * sizeof(float);
}

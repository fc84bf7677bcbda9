/* Model-level tests: golden comparisons against PyTorch/transformers dumps
 * (tests/ref/make_golden.py), gradient accumulation, and real checkpoints. */
#include <math.h>
#include <stdlib.h>

#include "fitllm/backend.h"
#include "fitllm/io.h"
#include "fitllm/json.h"
#include "fitllm/model.h"
#include "fitllm/train.h"
#include "golden_ref.h"
#include "model/model-impl.h"
#include "model/graph.h"
#include "test.h"

/* Tensor-scale relative error: max|a-b| / max|ref|. Element-wise relative error
 * is meaningless for entries that are ~0 by cancellation; the scale of the
 * tensor is the meaningful denominator. */
#define scaled_err fl_test_scaled_err

/* Copy a reference tensor into our orientation (transposing GPT-2 Conv1D). */
static void to_ours(float *dst, const fl_st_tensor *t, const fl_param_info *p) {
    const float *src = t->data;
    if (p->transposed_on_disk) {
        int64_t R = p->shape[0], Cc = p->shape[1]; /* ours (R, Cc); file (Cc, R) */
        for (int64_t i = 0; i < R; i++)
            for (int64_t j = 0; j < Cc; j++) dst[i * Cc + j] = src[j * R + i];
    } else {
        memcpy(dst, src, p->numel * sizeof(float));
    }
}

/* The same for a float64 reference tensor. */
static void to_ours64(double *dst, const fl_st_tensor *t, const fl_param_info *p) {
    const char *src = t->data; /* 8-byte alignment not guaranteed in the file: copy bytes */
    if (p->transposed_on_disk) {
        int64_t R = p->shape[0], Cc = p->shape[1];
        for (int64_t i = 0; i < R; i++)
            for (int64_t j = 0; j < Cc; j++) memcpy(&dst[i * Cc + j], src + (size_t)(j * R + i) * 8, 8);
    } else {
        memcpy(dst, src, p->numel * sizeof(double));
    }
}

#define find_ref fl_golden_find

/* The fused q|k|v bias run of layout entry p's group: [*lo, *hi) in flat offsets (empty without biases). The
 * key bias's exact gradient is 0 (softmax is invariant to a constant added to every score of a row): its
 * elements are rounding noise, on the scale of the whole fused bias's gradient. GPT-2 stores the run as one
 * tensor (c_attn.bias), OPT as three. */
static void qkv_bias_run(const fl_model *m, const fl_param_info *p, size_t *lo, size_t *hi) {
    int i = fl_layout_role(&m->layout, p->group, FL_ROLE_QKV_B);
    const size_t QKV = (size_t)(m->cfg.n_heads + 2 * m->cfg.n_kv_heads) * m->cfg.head_dim;
    *lo = i >= 0 ? m->layout.params[i].offset : 0;
    *hi = i >= 0 ? *lo + QKV : 0;
}

/* max |reference gradient| over the fused bias run [lo, hi), the entries' own error scale */
static double run_grad_max(const fl_model *m, const fl_st_file *g, size_t lo, size_t hi, float *tmp) {
    double mx = 0;
    for (int i = 0; i < m->layout.n; i++) {
        const fl_param_info *q = &m->layout.params[i];
        if (q->offset < lo || q->offset >= hi) continue;
        const fl_st_tensor *t = find_ref(g, "grad.", q->name);
        if (!t) continue;
        to_ours(tmp, t, q);
        for (size_t k = 0; k < q->numel; k++) mx = fabs(tmp[k]) > mx ? fabs(tmp[k]) : mx;
    }
    return mx;
}

static void golden(const char *dir) {
    char path[512];
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "cpu", 0));
    fl_model m;
    FL_REQUIRE_OK(fl_hf_load_model(&m, dir, &be, &pool));
    fl_st_file g;
    snprintf(path, sizeof path, "%s/golden.safetensors", dir);
    FL_REQUIRE_OK(fl_st_open(&g, path));
    const fl_st_tensor *ids = fl_st_find(&g, "input_ids"), *tg = fl_st_find(&g, "targets");
    const fl_st_tensor *lg = fl_st_find(&g, "logits"), *loss = fl_st_find(&g, "loss");
    const fl_st_tensor *l5 = fl_st_find(&g, "losses5");
    FL_REQUIRE(ids && tg && lg && loss && l5 && ids->dtype == FL_I32 && ids->ndim == 2);
    int B = (int)ids->shape[0], T = (int)ids->shape[1], V = m.cfg.vocab_size;
    FL_REQUIRE_OK(fl_model_alloc_grads(&m));
    FL_REQUIRE_OK(fl_model_alloc_acts(&m, B, T));
    float *logits = malloc((size_t)B * T * V * sizeof(float));
    FL_REQUIRE(logits);

    /* 1. logits and loss of the forward */
    long nvalid = 0;
    for (int i = 0; i < B * T; i++) nvalid += ((const int32_t *)tg->data)[i] != FL_IGNORE_INDEX;
    fl_model_zero_grads(&m);
    FL_REQUIRE_OK(fl_model_forward(&m, ids->data, tg->data, B, T, 1.0f / (float)nvalid, logits));
    size_t w;
    double e = scaled_err(logits, lg->data, (size_t)B * T * V, &w);
    FL_CHECKF(e <= 1e-5, "%s: logits error %.3g at %zu", dir, e, w);
    double our_loss = m.loss_sum / (double)m.n_valid, ref_loss = ((const float *)loss->data)[0];
    FL_CHECKF(m.n_valid == nvalid && fabs(our_loss - ref_loss) <= 1e-5 * fabs(ref_loss),
              "%s: loss %.8f vs reference %.8f", dir, our_loss, ref_loss);

    /* 2. every parameter gradient */
    FL_REQUIRE_OK(fl_model_backward(&m));
    float *tmp = malloc(m.layout.numel * sizeof(float));
    int checked = 0;
    double worst_grad = 0;
    for (int i = 0; i < m.layout.n; i++) {
        const fl_param_info *p = &m.layout.params[i];
        const fl_st_tensor *t = find_ref(&g, "grad.", p->name);
        FL_CHECKF(t != NULL, "%s: reference has no gradient for %s", dir, p->name);
        if (!t) continue;
        FL_REQUIRE((size_t)(t->end - t->begin) == p->numel * 4);
        size_t lo, hi;
        qkv_bias_run(&m, p, &lo, &hi);
        double run_max = p->offset >= lo && p->offset < hi ? run_grad_max(&m, &g, lo, hi, tmp) : 0;
        to_ours(tmp, t, p);
        double ge = scaled_err(fl_model_grads_f32(&m) + p->offset, tmp, p->numel, &w);
        if (run_max > 0) { /* a part of the fused q|k|v bias (OPT's separate k_proj.bias): the run's scale */
            double d = 0;
            for (size_t k = 0; k < p->numel; k++) d = fmax(d, fabs((double)fl_model_grads_f32(&m)[p->offset + k] - tmp[k]));
            ge = d / run_max;
        }
        if (ge > worst_grad) worst_grad = ge;
        FL_CHECKF(ge <= 1e-5, "%s: gradient of %s: error %.3g at %zu (ours %.9g, ref %.9g)", dir, p->name, ge, w,
                  fl_model_grads_f32(&m)[p->offset + w], tmp[w]);
        checked++;
    }
    FL_CHECK(checked == m.layout.n);
    printf("      %s: logits err %.2g, loss %.7f (ref %.7f), worst grad err %.2g over %d tensors\n", dir, e, our_loss,
           ref_loss, worst_grad, checked);

    /* 3. five AdamW steps (lr 1e-3, betas (0.9, 0.95), eps 1e-8, wd 0.1) on the same batch */
    fl_optimizer o;
    fl_optim_config oc;
    fl_optim_config_default(&oc, FL_OPT_ADAMW);
    oc.lr = 1e-3f;
    oc.beta1 = 0.9f;
    oc.beta2 = 0.95f;
    oc.eps = 1e-8f;
    oc.weight_decay = 0.1f;
    FL_REQUIRE_OK(fl_optim_init(&o, &m, &oc));
    for (int k = 0; k < 5; k++) {
        fl_step_result r;
        FL_REQUIRE_OK(fl_train_step(&m, &o, ids->data, tg->data, 1, B, T, oc.lr, 0.0f, &r));
        double rl = ((const float *)l5->data)[k];
        FL_CHECKF(fabs(r.loss - rl) <= 1e-5 * fabs(rl), "%s: step %d loss %.8f vs %.8f", dir, k + 1, r.loss, rl);
    }
    /* Anchor: the same 5 steps run in float64 by the fixture script (after5_f64.*). Two
     * float32 implementations round differently; which one lands nearer the exact result is
     * chance, so neither is the truth: each is measured against float64. The distance is the
     * worst element of the worst tensor, scaled by the tensor's max|p_f64|: an extreme value
     * over ~1e5 elements whose Adam update amplifies gradient rounding by lr/|g|, so it moves
     * by integer factors between equally good fp32 runs (three PyTorch runs: 1.3x; fitllm's
     * own with and without FMA contraction in AdamW: 1.35x; tests/ref/README.md). Ours must
     * stay within 4x PyTorch fp32's own distance (E_torch). That bar still separates real
     * optimizer errors by orders of magnitude: the same 5 steps with the learning rate off
     * by 1% (a wrong bias correction or schedule does at least that) must land over 10x the
     * bar, checked below, so the check can fail.
     * Adam divides each element's update by its own gradient scale, so an element whose
     * gradient is at float-noise level (e.g. GPT-2's k bias, whose exact gradient is 0) moves
     * by +-lr on noise in every precision, float64 included. Elements with
     * 0 < |grad| < 1e-4 x the tensor's max are excluded from the bound (counted, must be
     * under 2%) and only held to Adam's bound |delta| <= steps * lr; exact zeros (unused
     * embedding rows) are checked like the rest. */
    fl_model mm; /* the mutant: same steps, lr x 1.01 */
    FL_REQUIRE_OK(fl_hf_load_model(&mm, dir, &be, &pool));
    FL_REQUIRE_OK(fl_model_alloc_grads(&mm));
    FL_REQUIRE_OK(fl_model_alloc_acts(&mm, B, T));
    fl_optimizer om;
    fl_optim_config ocm = oc;
    ocm.lr = oc.lr * 1.01f;
    FL_REQUIRE_OK(fl_optim_init(&om, &mm, &ocm));
    for (int k = 0; k < 5; k++) {
        fl_step_result r;
        FL_REQUIRE_OK(fl_train_step(&mm, &om, ids->data, tg->data, 1, B, T, ocm.lr, 0.0f, &r));
    }
    double tau = 1e-4, e_torch = 0, worst_p = 0, worst_mut = 0;
    size_t excluded = 0, total = 0;
    double *pe_ours = calloc((size_t)m.layout.n, sizeof(double));
    double *ref64 = malloc(m.layout.numel * sizeof(double));
    FL_REQUIRE(pe_ours && ref64);
    size_t *wk_at = calloc((size_t)m.layout.n, sizeof(size_t));
    FL_REQUIRE(wk_at);
    for (int i = 0; i < m.layout.n; i++) {
        const fl_param_info *p = &m.layout.params[i];
        const fl_st_tensor *t = find_ref(&g, "after5.", p->name), *tg1 = find_ref(&g, "grad.", p->name);
        const fl_st_tensor *t64 = find_ref(&g, "after5_f64.", p->name);
        FL_CHECKF(t && tg1 && t64 && t64->dtype == FL_F64 && (size_t)(t64->end - t64->begin) == p->numel * 8,
                  "%s: reference has no after5/after5_f64 (F64)/grad for %s (rerun tests/ref/make_golden.py)", dir,
                  p->name);
        if (!t || !tg1 || !t64 || t64->dtype != FL_F64) continue;
        float *g1 = malloc(p->numel * sizeof(float));
        float *p32 = malloc(p->numel * sizeof(float));
        FL_REQUIRE(g1 && p32);
        to_ours(g1, tg1, p);
        to_ours(p32, t, p);
        to_ours64(ref64, t64, p);
        double gmax = 0, pmax = 0, d_ours = 0, d_torch = 0, d_mut = 0;
        for (size_t k = 0; k < p->numel; k++) {
            if (fabs(g1[k]) > gmax) gmax = fabs(g1[k]);
            if (fabs(ref64[k]) > pmax) pmax = fabs(ref64[k]);
        }
        /* the key bias (the k part of the fused q|k|v bias: GPT-2's c_attn.bias[C:2C], OPT's k_proj.bias) has an
         * exact gradient of 0: pure noise */
        size_t lo, hi;
        qkv_bias_run(&m, p, &lo, &hi);
        const size_t QD = (size_t)m.cfg.n_heads * m.cfg.head_dim, KVD = (size_t)m.cfg.n_kv_heads * m.cfg.head_dim;
        for (size_t k = 0; k < p->numel; k++) {
            double d = fabs((double)fl_model_params_f32(&m)[p->offset + k] - ref64[k]);
            total++;
            const size_t flat = p->offset + k;
            int noise = hi > lo && flat >= lo + QD && flat < lo + QD + KVD;
            if (noise || (g1[k] != 0.0f && fabs(g1[k]) < tau * gmax)) {
                excluded++;
                FL_CHECKF(d <= 5 * oc.lr * 1.01, "%s: %s[%zu] moved beyond Adam's bound", dir, p->name, k);
                continue;
            }
            if (d > d_ours) { d_ours = d; wk_at[i] = k; }
            double dt = fabs((double)p32[k] - ref64[k]);
            if (dt > d_torch) d_torch = dt;
            double dm = fabs((double)fl_model_params_f32(&mm)[p->offset + k] - ref64[k]);
            if (dm > d_mut) d_mut = dm;
        }
        double sc = pmax > 0 ? pmax : 1;
        pe_ours[i] = d_ours / sc;
        if (d_torch / sc > e_torch) e_torch = d_torch / sc;
        if (pe_ours[i] > worst_p) worst_p = pe_ours[i];
        if (d_mut / sc > worst_mut) worst_mut = d_mut / sc;
        free(g1);
        free(p32);
    }
    FL_CHECKF(e_torch > 0, "%s: PyTorch fp32 is bit-identical to float64 after 5 steps (fixture broken?)", dir);
    for (int i = 0; i < m.layout.n; i++) {
        const fl_param_info *p = &m.layout.params[i];
        FL_CHECKF(pe_ours[i] <= 4 * e_torch,
                  "%s: %s after 5 AdamW steps: distance to float64 %.3g at %zu, over 4x PyTorch fp32's own %.3g", dir,
                  p->name, pe_ours[i], wk_at[i], e_torch);
    }
    FL_CHECKF(excluded * 50 <= total, "%s: %zu of %zu elements have near-zero gradients (over 2%%)", dir, excluded, total);
    printf("      %s: %zu of %zu elements (%.2f%%) with |grad| < %.0e x tensor max held to Adam's bound only\n", dir,
           excluded, total, 100.0 * excluded / total, tau);
    FL_CHECKF(worst_mut > 10 * 4 * e_torch, "%s: lr off by 1%% lands at %.3g from float64, within 10x the bar %.3g", dir,
              worst_mut, 4 * e_torch);
    printf("      %s: after 5 AdamW steps, distance to float64: ours %.3g, PyTorch fp32 %.3g (bar 4x = %.3g); "
           "lr off by 1%%: %.3g\n", dir, worst_p, e_torch, 4 * e_torch, worst_mut);
    fl_optim_free(&om);
    fl_model_free(&mm);
    free(pe_ours);
    free(wk_at);
    free(ref64);
    fl_optim_free(&o);
    free(tmp);
    free(logits);
    fl_st_close(&g);
    fl_model_free(&m);
    FL_CHECK(pool.cur_total == 0);
    fl_mem_pool_free(&pool);
    fl_cpu_backend_free(&be);
}

FL_TEST(golden_llama_gqa_vs_pytorch) { golden("tests/fixtures/golden-llama"); }
FL_TEST(golden_gpt2_vs_pytorch) { golden("tests/fixtures/golden-gpt2"); }
FL_TEST(golden_opt_vs_pytorch) { golden("tests/fixtures/golden-opt"); }

/* Two micro-batches of 1 accumulate to exactly the gradient of one batch of 2
 * (the step normalizes by the total count of valid targets). */
FL_TEST(model_grad_accumulation_equals_large_batch) {
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "cpu", 0));
    fl_model_config c;
    FL_REQUIRE_OK(fl_preset_find("micro", &c));
    fl_model m;
    FL_REQUIRE_OK(fl_model_init(&m, &c, &be, &pool));
    fl_model_init_random(&m, 7);
    FL_REQUIRE_OK(fl_model_alloc_grads(&m));
    FL_REQUIRE_OK(fl_model_alloc_acts(&m, 2, 23));
    int32_t ids[46], tg[46];
    fl_test_rng r = {42};
    for (int i = 0; i < 46; i++) {
        ids[i] = (int32_t)(fl_test_rng_u64(&r) % 512);
        tg[i] = (i % 5 == 0) ? FL_IGNORE_INDEX : (int32_t)(fl_test_rng_u64(&r) % 512);
    }
    long nv = 0;
    for (int i = 0; i < 46; i++) nv += tg[i] != FL_IGNORE_INDEX;
    fl_model_zero_grads(&m);
    FL_REQUIRE_OK(fl_model_forward(&m, ids, tg, 2, 23, 1.0f / nv, NULL));
    double big_loss = m.loss_sum / nv;
    FL_REQUIRE_OK(fl_model_backward(&m));
    float *g1 = malloc(m.layout.numel * sizeof(float));
    memcpy(g1, fl_model_grads_f32(&m), m.layout.numel * sizeof(float));
    fl_model_zero_grads(&m);
    double ls = 0;
    for (int k = 0; k < 2; k++) {
        FL_REQUIRE_OK(fl_model_forward(&m, ids + 23 * k, tg + 23 * k, 1, 23, 1.0f / nv, NULL));
        ls += m.loss_sum;
        FL_REQUIRE_OK(fl_model_backward(&m));
    }
    FL_CHECK(fabs(ls / nv - big_loss) <= 1e-6 * big_loss);
    size_t w;
    double e = scaled_err(fl_model_grads_f32(&m), g1, m.layout.numel, &w);
    FL_CHECKF(e <= 1e-6, "accumulated gradient differs: %.3g at %zu", e, w);
    free(g1);
    fl_model_free(&m);
    fl_mem_pool_free(&pool);
    fl_cpu_backend_free(&be);
}

/* stories260K as llama2.c .bin and as HF safetensors give the same logits. */
FL_TEST(real_stories260k_bin_and_hf_same_logits) {
    FL_SKIP_IF_NO_DATA();
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "cpu", 0));
    fl_model a, b;
    FL_REQUIRE_OK(fl_llama2c_load_model(&a, fl_test_data_path("stories260K/stories260K.bin"), &be, &pool));
    FL_REQUIRE_OK(fl_hf_load_model(&b, fl_test_data_path("stories260K-hf"), &be, &pool));
    int T = 33, V = a.cfg.vocab_size;
    int32_t ids[33];
    fl_test_rng r = {3};
    ids[0] = 1;
    for (int i = 1; i < T; i++) ids[i] = (int32_t)(fl_test_rng_u64(&r) % (uint64_t)V);
    FL_REQUIRE_OK(fl_model_alloc_acts(&a, 1, T));
    FL_REQUIRE_OK(fl_model_alloc_acts(&b, 1, T));
    float *la = malloc((size_t)T * V * 4), *lb = malloc((size_t)T * V * 4);
    FL_REQUIRE_OK(fl_model_forward(&a, ids, NULL, 1, T, 0, la));
    FL_REQUIRE_OK(fl_model_forward(&b, ids, NULL, 1, T, 0, lb));
    size_t w;
    double e = scaled_err(la, lb, (size_t)T * V, &w);
    FL_CHECKF(e <= 1e-5, "stories260K .bin vs HF logits differ: %.3g at %zu", e, w);
    free(la);
    free(lb);
    fl_model_free(&a);
    fl_model_free(&b);
    fl_mem_pool_free(&pool);
    fl_cpu_backend_free(&be);
}

/* Loss and logits of real checkpoints against transformers (fixtures written
 * by tests/ref/tiny_gpt2_ref.py and tests/ref/stories_ref.py). */
static void real_vs_torch(const char *model_rel, const char *fixture) {
    FL_SKIP_IF_NO_DATA();
    fl_json *j;
    FL_REQUIRE_OK(fl_json_parse_file(fixture, &j));
    const fl_json *toks = fl_json_get(j, "tokens"), *loss = fl_json_get(j, "loss");
    const fl_json *first = fl_json_get(j, "logits_first_row"), *lastr = fl_json_get(j, "logits_last_row");
    FL_REQUIRE(toks && loss && first && lastr && toks->type == FL_JSON_ARRAY);
    int n = (int)toks->len;
    int32_t ids[256];
    FL_REQUIRE(n >= 2 && n <= 256);
    for (int i = 0; i < n; i++) ids[i] = (int32_t)fl_json_at(toks, (size_t)i)->num;
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "cpu", 0));
    fl_model m;
    FL_REQUIRE_OK(fl_hf_load_model(&m, fl_test_data_path(model_rel), &be, &pool));
    int T = n - 1, V = m.cfg.vocab_size;
    FL_REQUIRE_OK(fl_model_alloc_acts(&m, 1, T));
    float *lg = malloc((size_t)T * V * 4);
    FL_REQUIRE_OK(fl_model_forward(&m, ids, ids + 1, 1, T, 0, lg));
    double our = m.loss_sum / m.n_valid;
    FL_CHECKF(fabs(our - loss->num) <= 1e-5 * fabs(loss->num), "%s: loss %.8f vs torch %.8f", model_rel, our, loss->num);
    for (size_t k = 0; k < first->len; k++) {
        double a = lg[k], b = fl_json_at(first, k)->num;
        FL_CHECKF(fabs(a - b) <= 1e-4 * (fabs(b) + 1), "%s: logit[0][%zu] %.7f vs %.7f", model_rel, k, a, b);
    }
    /* The reference's last row is position n-1 (all n tokens); ours covers 0..n-2,
     * so compare the first row only plus the loss, unless the fixture says otherwise. */
    free(lg);
    fl_model_free(&m);
    fl_mem_pool_free(&pool);
    fl_cpu_backend_free(&be);
    fl_json_free(j);
}

FL_TEST(real_tiny_gpt2_loss_vs_torch) { real_vs_torch("tiny-gpt2-hf", "tests/fixtures/tiny-gpt2-ref.json"); }
FL_TEST(real_stories260k_loss_vs_torch) { real_vs_torch("stories260K-hf", "tests/fixtures/stories260K-ref.json"); }

/* Activation checkpointing: bit-identical gradients (fp32) and an arena of
 * (L+1) residuals plus one block instead of L blocks; the backward recomputes L-1 blocks (the
 * last one's activations survive the head). */
static void ckpt_case(const char *preset, int n_layers) {
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "cpu", 0));
    fl_model_config c;
    FL_REQUIRE_OK(fl_preset_find(preset, &c));
    c.vocab_size = 300;
    c.max_seq = 64;
    if (n_layers) c.n_layers = n_layers;
    fl_model m;
    FL_REQUIRE_OK(fl_model_init(&m, &c, &be, &pool));
    fl_model_init_random(&m, 11);
    FL_REQUIRE_OK(fl_model_alloc_grads(&m));
    int B = 2, T = 37, N = B * T;
    int32_t ids[74], tg[74];
    fl_test_rng r = {5};
    for (int i = 0; i < N; i++) {
        ids[i] = (int32_t)(fl_test_rng_u64(&r) % 300);
        tg[i] = i % 7 == 3 ? FL_IGNORE_INDEX : (int32_t)(fl_test_rng_u64(&r) % 300);
    }
    float *g[2];
    double loss[2];
    size_t acts[2];
    for (int k = 0; k < 2; k++) {
        m.act_ckpt = k;
        FL_REQUIRE_OK(fl_model_alloc_acts(&m, B, T));
        acts[k] = pool.cur[FL_TAG_ACTS];
        fl_model_zero_grads(&m);
        FL_REQUIRE_OK(fl_model_forward(&m, ids, tg, B, T, 0.01f, NULL));
        loss[k] = m.loss_sum;
        FL_REQUIRE_OK(fl_model_backward(&m));
        /* the last block's activations are still in the shared buffer after the forward */
        FL_CHECKF(m.ckpt_recomputed == (k ? c.n_layers - 1 : 0), "%s: %d blocks recomputed", preset,
                  m.ckpt_recomputed);
        g[k] = malloc(m.layout.numel * sizeof(float));
        memcpy(g[k], fl_model_grads_f32(&m), m.layout.numel * sizeof(float));
    }
    FL_CHECK(loss[0] == loss[1]);
    FL_CHECKF(memcmp(g[0], g[1], m.layout.numel * sizeof(float)) == 0, "%s: checkpointed gradients differ", preset);
    fl_act_sizes full, ck;
    fl_act_opts on = {1, FL_F32, 0, FL_F32, 0, 0, 0, 0, 0, 0};
    fl_sizing_acts(&c, B, T, &full);
    fl_sizing_acts_ex(&c, B, T, &on, &ck);
    FL_CHECK(acts[0] == full.acts_bytes && acts[1] == ck.acts_bytes);
    /* the saved state is the residual stream of every block plus one block's activations */
    size_t res = ((size_t)N * c.dim * 4 + 63) / 64 * 64;
    size_t one_block = full.per_layer_acts_bytes - res;
    FL_CHECKF(ck.acts_bytes == full.acts_bytes - (size_t)(c.n_layers - 1) * one_block,
              "%s: ckpt ACTS %zu, full %zu, per block %zu", preset, ck.acts_bytes, full.acts_bytes, one_block);
    printf("      %s: ACTS %zu -> %zu bytes with checkpointing\n", preset, full.acts_bytes, ck.acts_bytes);
    free(g[0]);
    free(g[1]);
    fl_model_free(&m);
    fl_mem_pool_free(&pool);
    fl_cpu_backend_free(&be);
}

FL_TEST(model_act_ckpt_exact_llama) { ckpt_case("micro", 0); }
/* GPT-2 small's widths with 3 of its 12 blocks (make test's time: 5.3 -> 1.3 CPU s, FITLLM_THREADS=1): a first,
 * a middle and the last block, the first two recomputed; the checks are per block or formulas in n_layers */
FL_TEST(model_act_ckpt_exact_gpt2) { ckpt_case("gpt2", 3); }

/* bf16-mixed: fp32 master weights plus a bf16 copy that the matmuls read.
 * PARAMS = 4 + 2 bytes per parameter exactly; gradients agree with 32-true to
 * bf16 accuracy (tensor-scaled error < 2e-2; bf16 has 8 mantissa bits). */
FL_TEST(model_bf16_mixed_memory_and_accuracy) {
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "cpu", 0));
    fl_model m;
    FL_REQUIRE_OK(fl_hf_load_model(&m, "tests/fixtures/golden-llama", &be, &pool));
    size_t n = m.layout.numel;
    FL_REQUIRE_OK(fl_model_alloc_grads(&m));
    FL_REQUIRE_OK(fl_model_alloc_acts(&m, 2, 40));
    fl_st_file g;
    FL_REQUIRE_OK(fl_st_open(&g, "tests/fixtures/golden-llama/golden.safetensors"));
    const fl_st_tensor *ids = fl_st_find(&g, "input_ids"), *tg = fl_st_find(&g, "targets");
    float *g32 = malloc(n * sizeof(float));
    double loss[2];
    for (int k = 0; k < 2; k++) {
        fl_precision p = *fl_precision_get(k ? FL_PREC_BF16_MIXED : FL_PREC_32_TRUE);
        FL_REQUIRE_OK(fl_model_set_precision(&m, &p));
        FL_CHECK(pool.cur[FL_TAG_PARAMS] == n * (k ? 6 : 4));
        fl_model_zero_grads(&m);
        FL_REQUIRE_OK(fl_model_forward(&m, ids->data, tg->data, 2, 40, 1.0f / 72, NULL));
        loss[k] = m.loss_sum / m.n_valid;
        FL_REQUIRE_OK(fl_model_backward(&m));
        if (!k) memcpy(g32, fl_model_grads_f32(&m), n * sizeof(float));
    }
    FL_CHECKF(fabs(loss[1] - loss[0]) < 1e-2 * loss[0], "bf16-mixed loss %.6f vs fp32 %.6f", loss[1], loss[0]);
    /* against PyTorch's bf16-mixed (torch.autocast(cpu, bfloat16), tests/ref/make_golden_bf16.py):
     * both round matmul operands to bf16 with fp32 accumulation; autocast also rounds the dW
     * products' operands (we keep dW in fp32), so the documented tolerance is 3e-2 of each
     * tensor's scale for gradients, 1e-2 for logits and 1e-3 relative for the loss. */
    fl_st_file gb;
    FL_REQUIRE_OK(fl_st_open(&gb, "tests/fixtures/golden-llama/golden-bf16-mixed.safetensors"));
    const fl_st_tensor *tl = fl_st_find(&gb, "loss"), *tlg = fl_st_find(&gb, "logits");
    FL_REQUIRE(tl && tlg);
    double tref = ((const float *)tl->data)[0];
    FL_CHECKF(fabs(loss[1] - tref) <= 1e-3 * tref, "bf16-mixed loss %.6f vs torch autocast %.6f", loss[1], tref);
    float *lg = malloc((size_t)2 * 40 * m.cfg.vocab_size * sizeof(float));
    FL_REQUIRE_OK(fl_model_forward(&m, ids->data, NULL, 2, 40, 0.0f, lg));
    double le = scaled_err(lg, tlg->data, (size_t)2 * 40 * m.cfg.vocab_size, NULL);
    FL_CHECKF(le <= 1e-2, "bf16-mixed logits vs torch autocast: %.3g", le);
    free(lg);
    double worst_t = 0;
    for (int i = 0; i < m.layout.n; i++) {
        const fl_param_info *p = &m.layout.params[i];
        const fl_st_tensor *t = find_ref(&gb, "grad.", p->name);
        FL_REQUIRE(t != NULL);
        double e = scaled_err(fl_model_grads_f32(&m) + p->offset, t->data, p->numel, NULL);
        if (e > worst_t) worst_t = e;
    }
    FL_CHECKF(worst_t <= 3e-2, "bf16-mixed gradients vs torch autocast: %.3g", worst_t);
    printf("      bf16-mixed vs torch autocast: loss %.6f vs %.6f, logits err %.2g, worst gradient err %.2g\n",
           loss[1], tref, le, worst_t);
    fl_st_close(&gb);
    double worst = 0;
    for (int i = 0; i < m.layout.n; i++) {
        const fl_param_info *p = &m.layout.params[i];
        double e = scaled_err(fl_model_grads_f32(&m) + p->offset, g32 + p->offset, p->numel, NULL);
        if (e > worst) worst = e;
    }
    FL_CHECKF(worst < 2e-2, "bf16-mixed gradients differ from fp32 by %.3g (tensor-scaled)", worst);
    FL_CHECKF(worst > 0, "bf16-mixed gradients are identical to fp32: the bf16 copy is not used");
    printf("      bf16-mixed vs fp32: loss %.6f vs %.6f, worst gradient error %.2g\n", loss[1], loss[0], worst);
    /* a 16-bit storage policy needs a model created with that storage: refused clearly */
    FL_CHECK(fl_model_set_precision(&m, fl_precision_get(FL_PREC_16_TRUE)) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "fl_model_init_ex"));
    free(g32);
    fl_st_close(&g);
    fl_model_free(&m);
    FL_CHECK(pool.cur_total == 0);
    fl_mem_pool_free(&pool);
    fl_cpu_backend_free(&be);
}

/* ---- 16-bit saved activations (fl_act_opts.act_dtype) ---------------------------------- */

static size_t al64(size_t b) { return (b + 63) / 64 * 64; }

/* The fp16 policies save the (N, width) activations of every block in 16 bits: ACTS =
 * the fp32 arena minus L-1 fp32 copies of them (one shared fp32 layer buffer stays) plus
 * L 16-bit copies, exactly. The bf16 policies store everything in bf16 (the residual rows
 * too, also with checkpointing), the fp32 compute views in WORKSPACE. The runtime allocates
 * what the sizing says. */
static void acts16_sizing_case(const char *preset) {
    fl_model_config c;
    FL_REQUIRE_OK(fl_preset_find(preset, &c));
    c.vocab_size = 300;
    c.max_seq = 64;
    const int B = 2, T = 37;
    const size_t N = (size_t)B * T;
    const int L = c.n_layers;
    const size_t C = c.dim, hd = c.head_dim ? c.head_dim : c.dim / c.n_heads;
    const size_t nkv = c.n_kv_heads ? c.n_kv_heads : c.n_heads;
    const size_t QD = c.n_heads * hd, QKV = QD + 2 * nkv * hd, F = c.ffn_dim;
    const size_t FCW = c.arch == FL_ARCH_LLAMA ? 2 * F : F;
    const size_t w[7] = {C, QKV, QD, C, C, FCW, F}; /* ln1 qkv att res_mid ln2 fc act */
    fl_act_sizes s32, s16, h16, ck32, ck16;
    fl_act_opts o16 = {0, FL_BF16, 0, FL_F32, 0, 0, 0, 0, 0, 0}, oh = {0, FL_F16, 0, FL_F32, 0, 0, 0, 0, 0, 0}, c32 = {1, FL_F32, 0, FL_F32, 0, 0, 0, 0, 0, 0}, c16 = {1, FL_BF16, 0, FL_F32, 0, 0, 0, 0, 0, 0};
    fl_sizing_acts(&c, B, T, &s32);
    fl_sizing_acts_ex(&c, B, T, &o16, &s16);
    fl_sizing_acts_ex(&c, B, T, &oh, &h16);
    fl_sizing_acts_ex(&c, B, T, &c32, &ck32);
    fl_sizing_acts_ex(&c, B, T, &c16, &ck16);
    size_t wide32 = 0, wide16 = 0;
    for (int k = 0; k < 7; k++) {
        wide32 += al64(N * w[k] * 4);
        wide16 += al64(N * w[k] * 2);
    }
    size_t want = s32.acts_bytes - (size_t)(L - 1) * wide32 + (size_t)L * wide16;
    FL_CHECKF(h16.acts_bytes == want, "%s: fp16 ACTS %zu, formula %zu", preset, h16.acts_bytes, want);
    FL_CHECK(h16.per_layer_acts_bytes == s32.per_layer_acts_bytes - wide32 + wide16);
    FL_CHECK(h16.workspace_bytes == s32.workspace_bytes && h16.logits_chunk_rows == s32.logits_chunk_rows);
    /* bf16 stored end to end: the residual rows in bf16 too; ACTS keeps only bf16 rows and fp32 statistics,
     * the fp32 views the ops compute in (two residual buffers, one block's WIDE slots, the final norm's
     * output; checkpointing: the recomputed block's statistics and bf16 copies too) are WORKSPACE */
    const size_t r32 = al64(N * C * 4), r16 = al64(N * C * 2);
    const size_t stat = s32.per_layer_acts_bytes - r32 - wide32; /* one block's fp32 statistics */
    want = s32.acts_bytes - (size_t)(L + 1) * (r32 - r16) - (size_t)L * (wide32 - wide16) - r32;
    FL_CHECKF(s16.acts_bytes == want, "%s: bf16 ACTS %zu, formula %zu", preset, s16.acts_bytes, want);
    FL_CHECK(s16.per_layer_acts_bytes == r16 + stat + wide16);
    FL_CHECKF(s16.workspace_bytes == s32.workspace_bytes + 3 * r32 + wide32 && s16.logits_chunk_rows == s32.logits_chunk_rows,
              "%s: bf16 WORKSPACE %zu, formula %zu", preset, s16.workspace_bytes, s32.workspace_bytes + 3 * r32 + wide32);
    const size_t want_ck = ck32.acts_bytes - (size_t)(L + 1) * (r32 - r16) - (stat + wide32) - r32;
    FL_CHECKF(ck16.acts_bytes == want_ck, "%s: bf16 checkpointed ACTS %zu, formula %zu", preset, ck16.acts_bytes, want_ck);
    FL_CHECK(ck16.workspace_bytes == ck32.workspace_bytes + 3 * r32 + wide32 + stat + wide16);
    FL_CHECK(ck16.per_layer_acts_bytes == r16);
    /* the runtime: bf16-true storage allocates exactly the 16-bit arena; switching the policy of an
     * fp32 model re-sizes an arena already allocated */
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "cpu", 0));
    fl_model m;
    fl_model_storage st;
    fl_model_storage_for(fl_precision_get(FL_PREC_BF16_TRUE), &st);
    FL_REQUIRE_OK(fl_model_init_ex(&m, &c, &be, &pool, &st));
    FL_REQUIRE_OK(fl_model_set_precision(&m, fl_precision_get(FL_PREC_BF16_TRUE)));
    FL_REQUIRE_OK(fl_model_alloc_acts(&m, B, T));
    FL_CHECK(pool.cur[FL_TAG_ACTS] == s16.acts_bytes);
    m.act_ckpt = 1;
    FL_REQUIRE_OK(fl_model_alloc_acts(&m, B, T));
    FL_CHECK(pool.cur[FL_TAG_ACTS] == ck16.acts_bytes);
    fl_model_free(&m);
    FL_REQUIRE_OK(fl_model_init(&m, &c, &be, &pool));
    FL_REQUIRE_OK(fl_model_alloc_acts(&m, B, T));
    FL_CHECK(pool.cur[FL_TAG_ACTS] == s32.acts_bytes);
    FL_REQUIRE_OK(fl_model_set_precision(&m, fl_precision_get(FL_PREC_16_MIXED)));
    FL_CHECK(pool.cur[FL_TAG_ACTS] == h16.acts_bytes && m.B == B && m.T == T);
    FL_REQUIRE_OK(fl_model_set_precision(&m, fl_precision_get(FL_PREC_32_TRUE)));
    FL_CHECK(pool.cur[FL_TAG_ACTS] == s32.acts_bytes);
    fl_model_free(&m);
    FL_CHECK(pool.cur_total == 0);
    fl_mem_pool_free(&pool);
    fl_cpu_backend_free(&be);
    printf("      %s: ACTS %zu -> %zu bytes with 16-bit saved activations (%.2fx; checkpointed %zu)\n", preset,
           s32.acts_bytes, s16.acts_bytes, (double)s16.acts_bytes / s32.acts_bytes, ck16.acts_bytes);
}

FL_TEST(model_acts16_sizing_exact) {
    acts16_sizing_case("micro");
    acts16_sizing_case("gpt2-micro");
    acts16_sizing_case("tiny");
}

/* Same weights (the policy's 16-bit compute copy), fp32 vs 16-bit activations.
 * fp16 (saved only): the forward computes in fp32 either way (identical loss), the backward reads the
 * rounded activations. Measured worst tensor-scaled gradient differences (2 threads, x86-64): golden-llama
 * fp16 0.00069, gpt2-micro 0.00025; bar 2e-3 (11-bit mantissa), ~3x the worst measurement.
 * bf16 (stored end to end, by design since issue 30: every op's output rounded as it is stored, so the
 * forward changes too): the mean loss within the first-order bound of R roundings of relative size
 * u = 2^-9 on the way from the ids to the logits (the embedding, then every stored slot a block writes:
 * R = 1 + L x the block's ops), each at most a relative R u change of the logits, which moves a token's
 * cross-entropy (lse(z) - z_t) by at most 2 R u max|z|. Gradients within twice PyTorch bf16-true's own
 * distance to fp32 on golden-llama (1.9e-2 worst tensor, tests/ref/README.md): the precision's noise.
 * Measured: mean loss 2.2e-5 apart (bound 9.6e-2) and worst gradient 0.011 on golden-llama, 2.1e-4
 * (8.7e-2) and 0.0078 on gpt2-micro. */
static void acts16_grad_case(fl_model *m, const int32_t *ids, const int32_t *tg, int B, int T, const char *what) {
    const size_t n = m->layout.numel;
    float *g32 = malloc(n * sizeof(float));
    static const fl_precision_kind pols[2] = {FL_PREC_BF16_MIXED, FL_PREC_16_MIXED};
    for (int pi = 0; pi < 2; pi++) {
        fl_precision p = *fl_precision_get(pols[pi]), p32 = p;
        p32.act_dtype = FL_F32;
        double loss[2], zmax = 0;
        float *lg = malloc((size_t)B * T * m->cfg.vocab_size * sizeof(float));
        FL_REQUIRE(lg != NULL);
        for (int k = 0; k < 2; k++) {
            FL_REQUIRE_OK(fl_model_set_precision(m, k ? &p : &p32));
            fl_act_sizes sz;
            fl_act_opts ao = {0, k ? p.act_dtype : FL_F32, 0, FL_F32, 0, 0, 0, 0, 0, 0};
            fl_sizing_acts_ex(&m->cfg, B, T, &ao, &sz);
            FL_CHECK(m->pool->cur[FL_TAG_ACTS] == sz.acts_bytes);
            fl_model_zero_grads(m);
            FL_REQUIRE_OK(fl_model_forward(m, ids, tg, B, T, 1.0f / (B * T), k ? NULL : lg));
            loss[k] = m->loss_sum;
            for (size_t i = 0; !k && i < (size_t)B * T * m->cfg.vocab_size; i++) zmax = fmax(zmax, fabs(lg[i]));
            FL_REQUIRE_OK(fl_model_backward(m));
            if (!k) memcpy(g32, fl_model_grads_f32(m), n * sizeof(float));
        }
        free(lg);
        if (p.act_dtype == FL_BF16) {
            fl_block_graph bg;
            FL_REQUIRE_OK(fl_block_graph_build(&m->cfg, &bg));
            const double R = 1 + (double)m->cfg.n_layers * bg.n_ops, u = ldexp(1.0, -9);
            const double dl = fabs(loss[0] - loss[1]) / m->n_valid, bound = 2 * R * u * zmax;
            FL_CHECKF(dl <= bound && dl > 0, "%s %s: bf16 stored activations moved the mean loss by %.3g (bound %.3g)",
                      what, p.name, dl, bound);
            printf("      %s %s: bf16 stored vs fp32 activations, mean loss %.3g apart (bound %.3g)\n", what, p.name, dl,
                   bound);
        } else {
            FL_CHECKF(loss[0] == loss[1], "%s %s: 16-bit saved activations changed the forward", what, p.name);
        }
        double worst = 0;
        const char *wn = "";
        for (int i = 0; i < m->layout.n; i++) {
            const fl_param_info *pi2 = &m->layout.params[i];
            double e = scaled_err(fl_model_grads_f32(m) + pi2->offset, g32 + pi2->offset, pi2->numel, NULL);
            if (e > worst) { worst = e; wn = pi2->name; }
        }
        double bar = p.act_dtype == FL_BF16 ? 2 * 1.9e-2 : 2e-3;
        FL_CHECKF(worst <= bar && worst > 0, "%s %s: gradients with %s activations vs fp32 activations: %.3g (%s)",
                  what, p.name, fl_dtype_name(p.act_dtype), worst, wn);
        printf("      %s %s: %s saved activations vs fp32, worst gradient err %.2g (%s)\n", what, p.name,
               fl_dtype_name(p.act_dtype), worst, wn);
    }
    free(g32);
}

FL_TEST(model_acts16_gradients_vs_fp32_acts) {
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "cpu", 0));
    fl_model m;
    FL_REQUIRE_OK(fl_hf_load_model(&m, "tests/fixtures/golden-llama", &be, &pool));
    FL_REQUIRE_OK(fl_model_alloc_grads(&m));
    FL_REQUIRE_OK(fl_model_alloc_acts(&m, 2, 40));
    fl_st_file g;
    FL_REQUIRE_OK(fl_st_open(&g, "tests/fixtures/golden-llama/golden.safetensors"));
    const fl_st_tensor *ids = fl_st_find(&g, "input_ids"), *tg = fl_st_find(&g, "targets");
    FL_REQUIRE(ids && tg);
    acts16_grad_case(&m, ids->data, tg->data, 2, 40, "golden-llama");
    fl_st_close(&g);
    fl_model_free(&m);
    /* GPT-2 (LayerNorm mean, GELU, biases), random init */
    fl_model_config c;
    FL_REQUIRE_OK(fl_preset_find("gpt2-micro", &c));
    c.vocab_size = 300;
    c.max_seq = 64;
    FL_REQUIRE_OK(fl_model_init(&m, &c, &be, &pool));
    fl_model_init_random(&m, 7);
    FL_REQUIRE_OK(fl_model_alloc_grads(&m));
    FL_REQUIRE_OK(fl_model_alloc_acts(&m, 2, 37));
    int32_t rid[74], rtg[74];
    fl_test_rng r = {3};
    for (int i = 0; i < 74; i++) {
        rid[i] = (int32_t)(fl_test_rng_u64(&r) % 300);
        rtg[i] = (int32_t)(fl_test_rng_u64(&r) % 300);
    }
    acts16_grad_case(&m, rid, rtg, 2, 37, "gpt2-micro");
    fl_model_free(&m);
    FL_CHECK(pool.cur_total == 0);
    fl_mem_pool_free(&pool);
    fl_cpu_backend_free(&be);
}

/* Parameter roles (model.h): resolved once by the layout, each one the HF entry it stands for, in
 * the group it belongs to, for LLaMA with and without biases, tied and untied, and GPT-2. */
FL_TEST(model_layout_roles_resolve_to_their_entries) {
    static const char *llama[FL_ROLE_COUNT] = {
        "model.embed_tokens.weight", NULL, "model.norm.weight", NULL, "lm_head.weight",
        "model.layers.%d.input_layernorm.weight", NULL, "model.layers.%d.post_attention_layernorm.weight", NULL,
        "model.layers.%d.self_attn.q_proj.weight", "model.layers.%d.self_attn.q_proj.bias",
        "model.layers.%d.self_attn.o_proj.weight", "model.layers.%d.self_attn.o_proj.bias",
        "model.layers.%d.mlp.gate_proj.weight", "model.layers.%d.mlp.gate_proj.bias",
        "model.layers.%d.mlp.down_proj.weight", "model.layers.%d.mlp.down_proj.bias"};
    static const char *gpt2[FL_ROLE_COUNT] = {
        "transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias",
        "lm_head.weight", "transformer.h.%d.ln_1.weight", "transformer.h.%d.ln_1.bias", "transformer.h.%d.ln_2.weight",
        "transformer.h.%d.ln_2.bias", "transformer.h.%d.attn.c_attn.weight", "transformer.h.%d.attn.c_attn.bias",
        "transformer.h.%d.attn.c_proj.weight", "transformer.h.%d.attn.c_proj.bias", "transformer.h.%d.mlp.c_fc.weight",
        "transformer.h.%d.mlp.c_fc.bias", "transformer.h.%d.mlp.c_proj.weight", "transformer.h.%d.mlp.c_proj.bias"};
    for (int v = 0; v < 4; v++) {
        fl_model_config c;
        FL_REQUIRE_OK(fl_preset_find(v == 3 ? "gpt2-micro" : "micro", &c));
        if (v == 1) c.attention_bias = c.mlp_bias = 1;
        if (v < 3) c.tie_embeddings = v != 2;
        FL_REQUIRE_OK(fl_config_validate(&c));
        fl_param_layout lay;
        FL_REQUIRE_OK(fl_layout_build(&lay, &c));
        const char **names = v == 3 ? gpt2 : llama;
        int found = 0;
        for (int g = 0; g < lay.n_groups; g++)
            for (int r = 0; r < FL_ROLE_COUNT; r++) {
                const int outer = r <= FL_ROLE_HEAD, want_group = outer ? (r == FL_ROLE_EMBED || r == FL_ROLE_POS_EMBED
                                                                            ? 0 : lay.n_groups - 1) : g;
                int present = names[r] && (outer ? g == want_group : g >= 1 && g <= c.n_layers);
                if (present && v != 3) { /* LLaMA's optional entries */
                    if ((r == FL_ROLE_QKV_B || r == FL_ROLE_O_B) && !c.attention_bias) present = 0;
                    if ((r == FL_ROLE_FC_B || r == FL_ROLE_PROJ_B) && !c.mlp_bias) present = 0;
                }
                if (r == FL_ROLE_HEAD && c.tie_embeddings) present = 0;
                int i = fl_layout_role(&lay, g, (fl_param_role)r);
                FL_CHECKF(present == (i >= 0), "variant %d group %d role %d: index %d", v, g, r, i);
                if (i < 0 || !present) continue;
                char want[FL_PARAM_NAME_MAX];
                snprintf(want, sizeof want, names[r], g - 1);
                FL_CHECKF(!strcmp(lay.params[i].name, want) && lay.params[i].group == g && lay.params[i].role == r,
                          "variant %d group %d role %d: %s, want %s", v, g, r, lay.params[i].name, want);
                found++;
            }
        FL_CHECK(found > 6 * c.n_layers);
        FL_CHECK(fl_layout_role(&lay, -1, FL_ROLE_EMBED) == -1 && fl_layout_role(&lay, lay.n_groups, FL_ROLE_EMBED) == -1);
        fl_layout_free(&lay);
    }
}

/* T5 (tests/fixtures/t5-tiny-relu, t5-tiny-gated: tests/ref/make_t5_fixture.py) under the precisions and storage an
 * encoder-decoder trains with besides fp32 (issue 31 item 2):
 *  - bf16-mixed against transformers under PyTorch's CPU autocast to bfloat16 (tests/ref/make_t5_bf16_fixture.py):
 *    both read bf16 operands in their matmuls, so their distance to the float64 run is of the order of bf16's unit
 *    roundoff (2^-8) times the scale, landing differently (autocast also rounds every matmul's output to bf16 where
 *    fitllm keeps fp32; measured: fitllm's logits 0.047 / 0.108 from float64, PyTorch's 0.098 / 0.111). fitllm's
 *    distance must be within 2 x PyTorch's (logits, loss, the gradients' L2 error; a wrong op moves the logits by
 *    1 to 20: tests/test_t5.c t5_variants_are_distinct) and beyond fp32's (30 x PyTorch fp32's noise: the bf16
 *    copy is really what the matmuls read).
 *  - QLoRA (NF4 block linears + fp32 LoRA with PEFT's A, B): the same logits and adapter gradients as the fp32 model
 *    whose block linears hold the dequantized NF4 values, within fp32 noise (8 x PyTorch fp32's + 16 roundings of
 *    the scale, as tests/test_t5.c): the 4-bit path changes the weights, not the passes. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/io.h"
#include "fitllm/lora.h"
#include "fitllm/model.h"
#include "fitllm/train.h"
#include "model/seq2seq-impl.h"
#include "test.h"

typedef struct {
    fl_st_file x;
    const fl_st_tensor *src, *mask, *dec, *labels;
    int B, Ts, Tt, n_valid;
} t5_batch;

static void open_batch(t5_batch *b, const char *dir) {
    char p[256];
    snprintf(p, sizeof p, "%s/expected.safetensors", dir);
    FL_REQUIRE_OK(fl_st_open(&b->x, p));
    b->src = fl_st_find(&b->x, "src"), b->mask = fl_st_find(&b->x, "src_mask");
    b->dec = fl_st_find(&b->x, "dec"), b->labels = fl_st_find(&b->x, "labels");
    FL_REQUIRE(b->src && b->mask && b->dec && b->labels);
    b->B = (int)b->src->shape[0], b->Ts = (int)b->src->shape[1], b->Tt = (int)b->dec->shape[1];
    b->n_valid = 0;
    for (int i = 0; i < b->B * b->Tt; i++) b->n_valid += ((const int32_t *)b->labels->data)[i] != FL_IGNORE_INDEX;
}

static float f32_of(const fl_st_file *f, const char *name) {
    const fl_st_tensor *t = fl_st_find(f, name);
    FL_CHECKF(t != NULL, "fixture tensor %s", name);
    return t ? ((const float *)t->data)[0] : NAN;
}

/* a training forward (logits into lg) and the backward; the mean loss into *loss */
static void train_pass(fl_model *m, const t5_batch *b, float *lg, double *loss) {
    fl_model_zero_grads(m);
    FL_REQUIRE_OK(fl_model_forward_s2s(m, b->src->data, b->mask->data, b->dec->data, b->labels->data, b->B, b->Ts, b->Tt,
                                       1.0f / (float)b->n_valid, lg));
    FL_REQUIRE_OK(fl_model_backward_s2s(m));
    *loss = m->loss_sum / (double)m->n_valid;
}

/* bf16-mixed (tag "bf16") or 16-mixed ("fp16": the same check against autocast to float16, whose unit roundoff is
 * 2^-11: the fp16 copy the matmuls read puts fitllm's distance 8x below bf16-mixed's, still beyond fp32's) */
/* the suite's backend and pools, the fixture's model under policy kind (bf16-true: bf16 storage) with its gradients,
 * and the batch's arena */
/* on the backend named bename (NULL: the suite's); *opened 1 once all is set up (0: this build lacks the backend, the
 * emulator, or a set-up step failed the test) */
static void open_model_on(const char *bename, const char *dir, fl_precision_kind kind, fl_backend *be,
                          fl_mem_pool *pool, fl_mem_pool *host, fl_model *m, t5_batch *b, int *opened) {
    *opened = 0;
    const fl_status st = bename ? fl_backend_init_by_name(bename, be, 2) : fl_test_backend(be, 2);
    if (bename && (st == FL_ERR_UNSUPPORTED || st == FL_ERR_NOT_FOUND)) return;
    FL_REQUIRE_OK(st);
    FL_REQUIRE_OK(fl_backend_pools_init(be, pool, host, be->name, 0));
    const fl_model_storage bf16 = {.param_dtype = FL_BF16};
    FL_REQUIRE_OK(fl_hf_load_model_ex(m, dir, be, pool, kind == FL_PREC_BF16_TRUE ? &bf16 : NULL));
    FL_REQUIRE_OK(fl_model_set_precision(m, fl_precision_get(kind)));
    FL_REQUIRE_OK(fl_model_alloc_grads(m));
    open_batch(b, dir);
    FL_REQUIRE_OK(fl_model_alloc_acts_s2s(m, b->B, b->Ts, b->Tt));
    *opened = 1;
}
static void open_model(const char *dir, fl_precision_kind kind, fl_backend *be, fl_mem_pool *pool, fl_mem_pool *host,
                       fl_model *m, t5_batch *b) {
    int opened;
    open_model_on(NULL, dir, kind, be, pool, host, m, b, &opened);
}

static void check_mixed(const char *dir, fl_precision_kind kind, const char *tag) {
    fl_backend be;
    fl_mem_pool pool, host;
    fl_model m;
    t5_batch b;
    open_model(dir, kind, &be, &pool, &host, &m, &b);
    char p[256];
    snprintf(p, sizeof p, "%s/expected-%s.safetensors", dir, tag);
    fl_st_file y;
    FL_REQUIRE_OK(fl_st_open(&y, p));
    const size_t nl = (size_t)b.B * b.Tt * m.cfg.vocab_size;
    float *lg = malloc(nl * sizeof(float)), *g = malloc(m.layout.numel * sizeof(float));
    FL_REQUIRE(lg && g);
    double loss = 0;
    train_pass(&m, &b, lg, &loss);
    const fl_st_tensor *rl = fl_st_find(&b.x, "logits"), *rloss = fl_st_find(&b.x, "loss");
    FL_REQUIRE(rl && rloss && (size_t)(rl->end - rl->begin) == nl * 4);
    double el = 0;
    for (size_t i = 0; i < nl; i++) el = fmax(el, fabs((double)lg[i] - ((const float *)rl->data)[i]));
    const double es = fabs(loss - ((const double *)rloss->data)[0]);
    /* the gradients' L2 distance to the float64 run's (the fixture's grad.*, in HF orientation: the relative bias
     * tables are stored transposed here, which a sum of squares over the whole tensor does not see) */
    FL_REQUIRE_OK(be.to_host(&be, g, fl_model_grads_f32(&m), m.layout.numel * sizeof(float)));
    double eg = 0, gn = 0;
    for (int i = 0; i < m.layout.n; i++) {
        const fl_param_info *pi = &m.layout.params[i];
        char key[300];
        snprintf(key, sizeof key, "grad.%s", pi->name);
        const fl_st_tensor *t = fl_st_find(&b.x, key);
        FL_REQUIRE(t && (size_t)(t->end - t->begin) == pi->numel * 4);
        const float *r = t->data, *o = g + pi->offset;
        const int tr = pi->ndim == 2 && pi->transposed_on_disk;
        for (size_t k = 0; k < pi->numel; k++) {
            const size_t kr = tr ? (k % pi->shape[1]) * pi->shape[0] + k / pi->shape[1] : k;
            eg += ((double)o[k] - r[kr]) * ((double)o[k] - r[kr]);
            gn += (double)r[kr] * r[kr];
        }
    }
    eg = sqrt(eg), gn = sqrt(gn);
    char k1[64], k2[64], k3[64];
    snprintf(k1, sizeof k1, "noise_%s.logits", tag), snprintf(k2, sizeof k2, "noise_%s.loss", tag);
    snprintf(k3, sizeof k3, "noise_%s.grad_l2", tag);
    const char *pn = fl_precision_get(kind)->name;
    const double pl = f32_of(&y, k1), ps = f32_of(&y, k2), pg = f32_of(&y, k3), f32l = f32_of(&b.x, "noise.logits");
    printf("      %s %s: logits error %.3g (autocast %.3g, fp32 %.2g), loss error %.3g (autocast %.3g), "
           "gradients' L2 error %.3g (autocast %.3g, ||g|| %.3g)\n", dir, pn, el, pl, f32l, es, ps, eg, pg, gn);
    FL_CHECKF(el <= 2 * pl, "%s: %s logits error %.3g > 2 x PyTorch autocast's %.3g", dir, pn, el, pl);
    FL_CHECKF(el >= 30.0 * f32l, "%s: %s logits error %.3g is fp32's (%.3g): no 16-bit matmuls?", dir, pn, el, f32l);
    FL_CHECKF(es <= 2 * ps, "%s: %s loss error %.3g > 2 x PyTorch autocast's %.3g", dir, pn, es, ps);
    FL_CHECKF(eg <= 2 * pg, "%s: %s gradients' L2 error %.3g > 2 x PyTorch autocast's %.3g", dir, pn, eg, pg);
    free(lg), free(g);
    fl_st_close(&y);
    fl_st_close(&b.x);
    fl_model_free(&m);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}

FL_TEST(t5_relu_bf16_mixed_vs_autocast) { check_mixed("tests/fixtures/t5-tiny-relu", FL_PREC_BF16_MIXED, "bf16"); }
FL_TEST(t5_gated_bf16_mixed_vs_autocast) { check_mixed("tests/fixtures/t5-tiny-gated", FL_PREC_BF16_MIXED, "bf16"); }
/* The weight-gradient GEMMs of a bf16 run read bf16 operands, dW += bf16(dy)^T bf16(x) (the decoder-only passes'
 * policy, PyTorch autocast's and bf16-true's operands; issue 30 item 1: on a GPU an fp32 x fp32 GEMM runs on the CUDA
 * cores, ~15x the tensor cores' time): a training pass of the gated fixture in bf16-mixed and bf16-true issues no
 * fp32 x fp32 GEMM (the head's included) and one GEMM with bf16 A and B transposed A (dW) per trained linear and pass;
 * 32-true issues only fp32 ones (the recorder sees the GEMMs). The values: check_mixed's autocast bound above. */
static fl_status (*g_gemm_real)(const fl_backend *, int, int, int, int, int, float, const void *, fl_dtype, int,
                                const void *, fl_dtype, int, float, void *, fl_dtype, int);
static int g_f32f32, g_dw16, g_all;
static fl_status gemm_rec(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                          const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta, void *C,
                          fl_dtype tc, int ldc) {
    g_all++;
    g_f32f32 += ta == FL_F32 && tb == FL_F32;
    g_dw16 += trans_a && !trans_b && ta == FL_BF16 && tb == FL_BF16;
    return g_gemm_real(be, trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, tb, ldb, beta, C, tc, ldc);
}
static void dw_operands(fl_precision_kind kind) {
    fl_backend be;
    fl_mem_pool pool, host;
    fl_model m;
    t5_batch b;
    open_model("tests/fixtures/t5-tiny-gated", kind, &be, &pool, &host, &m, &b);
    int linears = 0; /* the trained 2-D weights: one dW GEMM each per pass (fused q|k|v, k|v: one run, one GEMM) */
    for (int i = 0; i < m.layout.n; i++) {
        const fl_param_info *pi = &m.layout.params[i];
        linears += pi->ndim == 2 && pi->role != FL_ROLE_NONE && strstr(pi->name, "embed") == NULL &&
                   strstr(pi->name, "shared") == NULL && strstr(pi->name, "relative_attention_bias") == NULL;
    }
    g_gemm_real = be.gemm;
    be.gemm = gemm_rec;
    g_f32f32 = g_dw16 = g_all = 0;
    double loss = 0;
    train_pass(&m, &b, NULL, &loss);
    be.gemm = g_gemm_real;
    const char *pn = fl_precision_get(kind)->name;
    printf("      %s: %d GEMMs, %d fp32 x fp32, %d bf16 dW (%d trained linear weights), loss %.6f\n", pn, g_all,
           g_f32f32, g_dw16, linears, loss);
    FL_CHECK(isfinite(loss) && g_all > 0 && linears > 0);
    if (kind == FL_PREC_32_TRUE) {
        FL_CHECKF(g_f32f32 == g_all && g_dw16 == 0, "%s: %d of %d GEMMs fp32 x fp32", pn, g_f32f32, g_all);
    } else {
        FL_CHECKF(g_f32f32 == 0, "%s: %d fp32 x fp32 GEMMs", pn, g_f32f32);
        FL_CHECKF(g_dw16 >= linears, "%s: %d bf16 dW GEMMs for %d trained linear weights", pn, g_dw16, linears);
    }
    fl_st_close(&b.x);
    fl_model_free(&m);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}
FL_TEST(t5_bf16_weight_gradients_read_bf16) {
    dw_operands(FL_PREC_32_TRUE);
    dw_operands(FL_PREC_BF16_MIXED);
    dw_operands(FL_PREC_BF16_TRUE);
}

/* The bf16 saved slots in the passes (issue 30 item 1; seq2seq.c's ctx16): the slots only bf16-weight GEMMs read
 * (each norm's output, the attention outputs, the FFN's activation) stored in bf16 by the op that writes them, which
 * those GEMMs then read instead of rounding their fp32 input themselves, and the backward reading the saved copies
 * where its ops take bf16 (the weight gradients' x, the norms' inputs, ReLU's / GEGLU's on cuda-emu) instead of
 * widening them first. Both fixtures, bf16-mixed and bf16-true, on the CPU backend and cuda-emu: the logits, loss
 * and every gradient bit for bit those of the passes without them (fl_s2s_test_no16), and, on the CPU (the GEMM
 * recorder), the GEMMs with an fp32 A and a bf16 weight that are not the backward's dW fewer by exactly the
 * stored slots' readers: per encoder block 4 (q|k|v, o, wi, wo), per decoder block 6 (+ the cross-attention's q, o);
 * what is left reads the encoder's output (the cross k|v) or the final norm's (the head). */
static int g_f32a;
static fl_status gemm_rec_a(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                            const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta, void *C,
                            fl_dtype tc, int ldc) {
    g_f32a += !trans_a && ta == FL_F32 && tb == FL_BF16;
    return g_gemm_real(be, trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, tb, ldb, beta, C, tc, ldc);
}
static void stored16_bits(const char *dir, fl_precision_kind kind, const char *bename) {
    fl_backend be;
    fl_mem_pool pool, host;
    fl_model m;
    t5_batch b;
    int opened;
    open_model_on(bename, dir, kind, &be, &pool, &host, &m, &b, &opened);
    if (!opened) return; /* no emulator in this build */
    const size_t nl = (size_t)b.B * b.Tt * m.cfg.vocab_size;
    const size_t gbytes = m.layout.numel * (fl_model_grads_f32(&m) ? 4 : 2);
    float *lg[2] = {malloc(nl * 4), malloc(nl * 4)};
    char *g[2] = {malloc(gbytes), malloc(gbytes)};
    double loss[2] = {0, 0};
    int f32a[2] = {0, 0};
    const int rec = !strcmp(bename, "cpu");
    unsigned char *poison = malloc(m.sizes.acts_bytes);
    FL_REQUIRE(poison != NULL);
    memset(poison, 0xff, m.sizes.acts_bytes); /* NaN in every fp32 and bf16 slot: a copy read before it is written shows */
    for (int on = 1; on >= 0; on--) {
        FL_REQUIRE_OK(be.to_device(&be, m.acts_arena, poison, m.sizes.acts_bytes));
        fl_s2s_test_no16 = !on;
        g_gemm_real = be.gemm;
        if (rec) be.gemm = gemm_rec_a;
        g_f32a = 0;
        train_pass(&m, &b, lg[on], &loss[on]);
        be.gemm = g_gemm_real;
        f32a[on] = g_f32a;
        FL_REQUIRE_OK(be.to_host(&be, g[on], fl_model_grads_data(&m), gbytes));
    }
    fl_s2s_test_no16 = 0;
    const char *pn = fl_precision_get(kind)->name;
    FL_CHECKF(memcmp(lg[0], lg[1], nl * 4) == 0 && loss[0] == loss[1], "%s %s %s: the logits or loss differ with the "
              "bf16 saved slots in the passes (%.9g vs %.9g)", dir, pn, bename, loss[1], loss[0]);
    FL_CHECKF(memcmp(g[0], g[1], gbytes) == 0, "%s %s %s: the gradients differ with the bf16 saved slots in the "
              "passes", dir, pn, bename);
    if (rec) {
        const int want = 4 * m.cfg.n_layers + 6 * m.cfg.n_dec_layers;
        printf("      %s %s: fp32-A GEMMs on bf16 weights %d -> %d (the stored slots' readers: %d)\n", dir, pn, f32a[0],
               f32a[1], want);
        FL_CHECKF(f32a[0] - f32a[1] == want, "%s %s: %d -> %d fp32-A GEMMs, %d fewer expected", dir, pn, f32a[0],
                  f32a[1], want);
    }
    free(lg[0]), free(lg[1]), free(g[0]), free(g[1]), free(poison);
    fl_st_close(&b.x);
    fl_model_free(&m);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}
FL_TEST(t5_bf16_saved_slots_in_the_passes_keep_the_bits) {
    static const char *const dirs[] = {"tests/fixtures/t5-tiny-relu", "tests/fixtures/t5-tiny-gated"};
    /* under ASan (quick tier) half the combinations, each fixture, precision and backend once: the relu fixture in
     * bf16-mixed, the gated one in bf16-true, each on both backends */
    for (int d = 0; d < 2; d++)
        for (int k = 0; k < 2; k++)
            for (int e = 0; e < 2; e++)
                if (!fl_test_asan_light() || k == d)
                    stored16_bits(dirs[d], k ? FL_PREC_BF16_TRUE : FL_PREC_BF16_MIXED, e ? "cuda-emu" : "cpu");
}

/* bf16-true's block weight gradients written into the bf16 gradient by their dW GEMMs (FL_OP_GEMM_ACC16: bf16(fp32
 * sum + g), rounded once; FITLLM_CUDA_DW16, the decoder-only passes' way) instead of an fp32 stage added in after
 * (accumulate16: the same sum, the same rounding): on cuda-emu (the CPU backend has no ACC16 GEMM) both fixtures'
 * logits, loss and bf16 gradients bit for bit those of the staged pass, and the elements accumulate16 adds fewer by
 * exactly the blocks' linear weights (what stays staged: the norms' weights, the relative bias tables, the head and
 * the embedding). */
static fl_status (*g_acc_real)(const fl_backend *, uint16_t *, fl_dtype, const float *, size_t);
static size_t g_acc_n;
static fl_status acc_rec(const fl_backend *be, uint16_t *dst, fl_dtype t, const float *src, size_t n) {
    g_acc_n += n;
    return g_acc_real(be, dst, t, src, n);
}
static void dw16_bits(const char *dir) {
    fl_backend be;
    fl_mem_pool pool, host;
    fl_model m;
    t5_batch b;
    int opened;
    open_model_on("cuda-emu", dir, FL_PREC_BF16_TRUE, &be, &pool, &host, &m, &b, &opened);
    if (!opened) return; /* no emulator in this build */
    const size_t nl = (size_t)b.B * b.Tt * m.cfg.vocab_size, gbytes = m.layout.numel * 2;
    float *lg[2] = {malloc(nl * 4), malloc(nl * 4)};
    char *g[2] = {malloc(gbytes), malloc(gbytes)};
    double loss[2] = {0, 0};
    size_t acc[2] = {0, 0}, lin = 0;
    for (int i = 0; i < m.layout.n; i++) { /* the blocks' linear weights: 2-D, not the embedding, head or tables */
        const fl_param_info *pi = &m.layout.params[i];
        if (pi->ndim == 2 && strstr(pi->name, "block.") && !strstr(pi->name, "relative_attention_bias")) lin += pi->numel;
    }
    for (int on = 0; on < 2; on++) {
        FL_REQUIRE(setenv("FITLLM_CUDA_DW16", on ? "1" : "0", 1) == 0);
        g_acc_real = be.accumulate16;
        be.accumulate16 = acc_rec;
        g_acc_n = 0;
        train_pass(&m, &b, lg[on], &loss[on]);
        be.accumulate16 = g_acc_real;
        acc[on] = g_acc_n;
        FL_REQUIRE_OK(be.to_host(&be, g[on], fl_model_grads_data(&m), gbytes));
    }
    unsetenv("FITLLM_CUDA_DW16");
    printf("      %s bf16-true cuda-emu: accumulate16 over %zu -> %zu elements (the blocks' linear weights: %zu)\n", dir,
           acc[0], acc[1], lin);
    FL_CHECKF(memcmp(lg[0], lg[1], nl * 4) == 0 && loss[0] == loss[1] && memcmp(g[0], g[1], gbytes) == 0,
              "%s: the dW GEMMs into the bf16 gradient change the logits, loss or gradients", dir);
    FL_CHECKF(lin > 0 && acc[0] - acc[1] == lin, "%s: accumulate16 %zu -> %zu elements, %zu fewer expected", dir, acc[0],
              acc[1], lin);
    free(lg[0]), free(lg[1]), free(g[0]), free(g[1]);
    fl_st_close(&b.x);
    fl_model_free(&m);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}
FL_TEST(t5_bf16_true_dw_gemms_into_the_bf16_gradient) {
    dw16_bits("tests/fixtures/t5-tiny-relu");
    dw16_bits("tests/fixtures/t5-tiny-gated");
}

FL_TEST(t5_relu_fp16_mixed_vs_autocast) { check_mixed("tests/fixtures/t5-tiny-relu", FL_PREC_16_MIXED, "fp16"); }
FL_TEST(t5_gated_fp16_mixed_vs_autocast) { check_mixed("tests/fixtures/t5-tiny-gated", FL_PREC_16_MIXED, "fp16"); }

/* LoRA on m with PEFT's A and B of the gated fixture (expected-lora.safetensors) */
static void lora_peft(fl_model *m, const fl_st_file *y) {
    fl_lora_config lc;
    FL_REQUIRE_OK(fl_lora_config_init(&lc, &m->cfg, 4, 8.0f, 0.0f, 0, "q,k,v,o,wi_0,wi_1,wo"));
    FL_REQUIRE_OK(fl_model_lora_init(m, &lc, 1));
    fl_lora_adapters v;
    FL_REQUIRE(fl_model_lora_adapters(m, &v));
    for (int j = 0; j < v.n_mods; j++) {
        char ka[300], kb[300];
        snprintf(ka, sizeof ka, "A.%s", v.mods[j].name);
        snprintf(kb, sizeof kb, "B.%s", v.mods[j].name);
        const fl_st_tensor *A = fl_st_find(y, ka), *Bt = fl_st_find(y, kb);
        FL_REQUIRE(A && Bt);
        const size_t na = (size_t)v.cfg->r * v.mods[j].in, nb = (size_t)v.mods[j].out * v.cfg->r;
        FL_REQUIRE((size_t)(A->end - A->begin) == na * 4 && (size_t)(Bt->end - Bt->begin) == nb * 4);
        FL_REQUIRE_OK(m->be->to_device(m->be, v.params + v.off[2 * j], A->data, na * 4));
        FL_REQUIRE_OK(m->be->to_device(m->be, v.params + v.off[2 * j + 1], Bt->data, nb * 4));
    }
}

FL_TEST(t5_qlora_equals_dequantized) {
    const char *dir = "tests/fixtures/t5-tiny-gated";
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    fl_mem_pool pool, host;
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &host, be.name, 0));
    static const int types[2] = {FL_Q4_NF4, FL_Q4_FP4};
    for (int q = 0; q < 2; q++) {
        fl_model_storage st;
        fl_model_storage_for(fl_precision_get(FL_PREC_32_TRUE), &st);
        st.quant4 = 1, st.q4_type = types[q], st.q4_double_quant = q == 0;
        fl_model mq, md;
        FL_REQUIRE_OK(fl_hf_load_model_ex(&mq, dir, &be, &pool, &st));
        FL_REQUIRE_OK(fl_hf_load_model(&md, dir, &be, &pool));
        FL_REQUIRE(fl_model_quant4(&mq) && !fl_model_quant4(&md));
        /* md's block linears: mq's 4-bit weights dequantized */
        int nq = 0;
        for (int i = 0; i < mq.layout.n; i++) {
            if (!fl_model_param_is_q4(&mq, i)) continue;
            const fl_param_info *p = &mq.layout.params[i];
            float *w = malloc(p->numel * sizeof(float));
            FL_REQUIRE(w != NULL);
            fl_model_read_param(&mq, i, w);
            FL_REQUIRE_OK(be.to_device(&be, fl_model_params_f32(&md) + fl_model_store_off(&md, i), w,
                                       p->numel * sizeof(float)));
            free(w);
            nq++;
        }
        FL_CHECKF(nq == 2 * 7 + 3 * 11, "%d quantized entries", nq); /* q, k, v, o, wi_0, wi_1, wo (+ the cross q, k, v, o) */
        fl_st_file y;
        FL_REQUIRE_OK(fl_st_open(&y, "tests/fixtures/t5-tiny-gated/expected-lora.safetensors"));
        t5_batch b;
        open_batch(&b, dir);
        fl_model *ms[2] = {&mq, &md};
        const size_t nl = (size_t)b.B * b.Tt * mq.cfg.vocab_size;
        float *lg[2], *g[2];
        size_t ng = 0;
        double loss[2];
        for (int k = 0; k < 2; k++) {
            lora_peft(ms[k], &y);
            FL_REQUIRE_OK(fl_model_alloc_acts_s2s(ms[k], b.B, b.Ts, b.Tt));
            fl_lora_adapters v;
            FL_REQUIRE(fl_model_lora_adapters(ms[k], &v));
            ng = v.numel;
            lg[k] = malloc(nl * sizeof(float)), g[k] = malloc(ng * sizeof(float));
            FL_REQUIRE(lg[k] && g[k]);
            train_pass(ms[k], &b, lg[k], &loss[k]);
            FL_REQUIRE_OK(be.to_host(&be, g[k], v.grads, ng * sizeof(float)));
        }
        double el = 0, sl = 0, worst = 0;
        for (size_t i = 0; i < nl; i++) el = fmax(el, fabs((double)lg[0][i] - lg[1][i])), sl = fmax(sl, fabs(lg[1][i]));
        /* fp32 noise: 8 x PyTorch fp32's on the LoRA fixture (per tensor) + 16 roundings of the scale (tests/test_t5.c) */
        const double bl = 8.0 * f32_of(&y, "noise.logits") + 16.0 * FLT_EPSILON * sl;
        FL_CHECKF(el <= bl, "QLoRA %d: logits differ from the dequantized model's by %.3g (bound %.3g)", q, el, bl);
        fl_lora_adapters v;
        FL_REQUIRE(fl_model_lora_adapters(&mq, &v));
        for (int j = 0; j < v.n_mods; j++)
            for (int ab = 0; ab < 2; ab++) {
                char key[300];
                snprintf(key, sizeof key, "noise.%s%s", ab ? "gB." : "gA.", v.mods[j].name);
                const size_t n = ab ? (size_t)v.mods[j].out * v.cfg->r : (size_t)v.cfg->r * v.mods[j].in;
                const float *a = g[0] + v.off[2 * j + ab], *r = g[1] + v.off[2 * j + ab];
                double e = 0, sc = 0;
                for (size_t k = 0; k < n; k++) e = fmax(e, fabs((double)a[k] - r[k])), sc = fmax(sc, fabs(r[k]));
                const double bd = 8.0 * f32_of(&y, key) + 16.0 * FLT_EPSILON * sc;
                FL_CHECKF(e <= bd, "QLoRA %d: d%s of %s differs by %.3g (bound %.3g)", q, ab ? "B" : "A", v.mods[j].name,
                          e, bd);
                worst = fmax(worst, e / bd);
            }
        printf("      QLoRA %s: logits %.3g (bound %.3g), %d adapter gradients at worst %.2f of their bounds, loss %.8f "
               "vs %.8f\n", fl_q4_mode_name(types[q], q == 0), el, bl, 2 * v.n_mods, worst, loss[0], loss[1]);
        FL_CHECK(fabs(loss[0] - loss[1]) <= 16.0 * FLT_EPSILON * loss[1]);
        /* and the 4-bit weights do move the function: the fp32 model's loss (PEFT's, same adapters) is elsewhere */
        const double lf = ((const double *)fl_st_find(&y, "loss")->data)[0];
        FL_CHECKF(fabs(loss[0] - lf) > 1e-3, "QLoRA %d: loss %.8f is the fp32 model's %.8f", q, loss[0], lf);
        for (int k = 0; k < 2; k++) free(lg[k]), free(g[k]);
        fl_st_close(&y);
        fl_st_close(&b.x);
        fl_model_free(&mq);
        fl_model_free(&md);
    }
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}

/* fp16 loss scaling on an encoder-decoder (16-mixed: fp32 gradients; 16-true: fp16 gradients, which overflow past
 * 65504): a step whose scaled gradients overflow is skipped, leaving every weight's bits, and the scale backed off by
 * half (torch.amp.GradScaler); the next step at a scale that fits updates the weights. The scale that overflows is
 * the format's: 16-true's gradients (~1 / (valid targets) on the tiny model) pass fp16's 65504 at 2^20; 16-mixed's
 * are fp32 (its activation gradients too): 2^127 overflows them once the step's token count (the grad scale's
 * 1 / step_valid) is given as 1, which sums the tokens' gradients unnormalized. */
static void fp16_overflow_skipped(fl_precision_kind kind, float big, int valid1) {
    const char *dir = "tests/fixtures/t5-tiny-gated";
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    fl_mem_pool pool, host;
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &host, be.name, 0));
    const fl_precision *pr = fl_precision_get(kind);
    fl_model_storage st;
    fl_model_storage_for(pr, &st);
    fl_model m;
    FL_REQUIRE_OK(fl_hf_load_model_ex(&m, dir, &be, &pool, &st));
    FL_REQUIRE_OK(fl_model_set_precision(&m, pr));
    FL_REQUIRE_OK(fl_model_alloc_grads(&m));
    t5_batch b;
    open_batch(&b, dir);
    FL_REQUIRE_OK(fl_model_alloc_acts_s2s(&m, b.B, b.Ts, b.Tt));
    fl_optim_config oc;
    fl_optim_config_default(&oc, FL_OPT_ADAMW);
    fl_optimizer o;
    FL_REQUIRE_OK(fl_optim_init(&o, &m, &oc));
    FL_CHECKF(o.amp.on, "%s: no loss scaling", pr->name);
    const fl_micro_batch mb = {.ids = b.dec->data, .targets = b.labels->data, .B = b.B, .T = b.Tt,
                               .src = b.src->data, .src_mask = b.mask->data, .Ts = b.Ts};
    fl_step_ctx c = {.mbs = &mb, .n_micro = 1, .step_valid = b.n_valid, .lr = 1e-3f};
    const int p16 = fl_model_params_f32(&m) == NULL;
    const size_t nb = m.layout.numel * (p16 ? 2 : 4);
    const void *dev = p16 ? (const void *)fl_model_params_16(&m) : fl_model_params_f32(&m);
    char *w0 = malloc(nb), *w1 = malloc(nb);
    FL_REQUIRE(w0 && w1);
    FL_REQUIRE_OK(be.to_host(&be, w0, dev, nb));
    fl_step_result r;
    o.amp.ls.scale = big;
    if (valid1) c.step_valid = 1;
    FL_REQUIRE_OK(fl_step_run(&m, &o, &c, &r));
    c.step_valid = b.n_valid;
    FL_REQUIRE_OK(be.to_host(&be, w1, dev, nb));
    FL_CHECKF(r.skipped == 1, "%s at scale %g: the overflowing step was not skipped", pr->name, (double)big);
    FL_CHECKF(r.loss_scale == big / 2, "%s: loss scale %g after the skipped step (want %g)", pr->name,
              (double)r.loss_scale, (double)big / 2);
    FL_CHECKF(memcmp(w0, w1, nb) == 0, "%s: a skipped step changed the weights", pr->name);
    FL_CHECKF(isfinite(r.loss) && r.loss > 1, "%s: loss %g", pr->name, r.loss);
    const double l0 = valid1 ? r.loss / b.n_valid : r.loss;
    o.amp.ls.scale = 1024.0f;
    FL_REQUIRE_OK(fl_step_run(&m, &o, &c, &r));
    FL_REQUIRE_OK(be.to_host(&be, w1, dev, nb));
    FL_CHECKF(r.skipped == 0 && isfinite(r.grad_norm), "%s at scale 1024: skipped %d, norm %g", pr->name, r.skipped,
              r.grad_norm);
    FL_CHECKF(memcmp(w0, w1, nb) != 0, "%s: the step at scale 1024 left the weights", pr->name);
    FL_CHECKF(fabs(r.loss - l0) <= 4 * DBL_EPSILON * l0, "%s: the second step's loss %.9g is not the first's %.9g (same "
              "weights)", pr->name, r.loss, l0);
    printf("      %s: scale %g overflowed (skipped, scale -> %g), scale 1024 updated (loss %.6f, norm %.4g)\n", pr->name,
           (double)big, (double)big / 2, r.loss, r.grad_norm);
    free(w0), free(w1);
    fl_optim_free(&o);
    fl_st_close(&b.x);
    fl_model_free(&m);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}

FL_TEST(t5_fp16_mixed_overflow_skipped) { fp16_overflow_skipped(FL_PREC_16_MIXED, 0x1p127f, 1); }
FL_TEST(t5_fp16_true_overflow_skipped) { fp16_overflow_skipped(FL_PREC_16_TRUE, 0x1p20f, 0); }

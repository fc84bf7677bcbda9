/* Batched decoding of an encoder-decoder (fl_model_generate_s2s_batch / fl_generate_s2s_batch; issue 31's leftover)
 * against transformers' generate(do_sample=False) on a right-padded batch of 4 sources of 5 to 11 tokens in one call
 * (tests/ref/make_t5_batch_gen_fixture.py, both tiny T5s): the same (B, L) ids, the start token, each row's greedy
 * ids, the pad id after a row's stop id, L = 1 + the steps until every row has stopped. The random tiny models
 * rarely emit their eos, so the fixture stops on a token some rows produce and others do not (generate's
 * eos_token_id; here the model's eos id set to it): a row ending early, rows running to max_new and the padding after
 * the end are all compared. With the cache (each sequence in its own rows of the arena) and without (the batch's
 * prefix rerun) alike; each row also equals that source decoded alone (B 1, no padding), so a sequence's region,
 * mask or cross k|v read at another's offset shows; sampled decoding of the batch is seeded (the same ids twice) and
 * a mask row of zeros is refused naming the row. */
#include <stdlib.h>
#include <string.h>

#include "fitllm/generate.h"
#include "fitllm/io.h"
#include "fitllm/model.h"
#include "test.h"

/* The test backend (2 threads), its pools and the fixture folder's model; t5_close frees them */
static fl_status t5_open(const char *dir, fl_backend *be, fl_mem_pool *pool, fl_mem_pool *host, fl_model *m) {
    FL_TRY(fl_test_backend(be, 2));
    FL_TRY(fl_backend_pools_init(be, pool, host, be->name, 0));
    return fl_hf_load_model(m, dir, be, pool);
}
static void t5_close(fl_backend *be, fl_mem_pool *pool, fl_mem_pool *host, fl_model *m) {
    fl_model_free(m);
    fl_backend_pools_free(pool, host);
    fl_backend_free(be);
}

static void check_batch(const char *dir) {
    fl_backend be;
    fl_mem_pool pool, host;
    fl_model m;
    FL_REQUIRE_OK(t5_open(dir, &be, &pool, &host, &m));
    char p[256];
    snprintf(p, sizeof p, "%s/expected-gen-batch.safetensors", dir);
    fl_st_file x;
    FL_REQUIRE_OK(fl_st_open(&x, p));
    const fl_st_tensor *src = fl_st_find(&x, "src"), *mask = fl_st_find(&x, "src_mask"), *gen = fl_st_find(&x, "gen"),
                       *eos = fl_st_find(&x, "eos");
    FL_REQUIRE(src && mask && gen && eos && gen->ndim == 2);
    const int B = (int)src->shape[0], Ts = (int)src->shape[1], L = (int)gen->shape[1], N = 12, W = N + 1;
    const int32_t *want = gen->data;
    const uint8_t *mk = mask->data;
    m.cfg.eos_id = ((const int32_t *)eos->data)[0];
    FL_REQUIRE_OK(fl_model_alloc_acts_s2s(&m, B, Ts, N));
    int32_t *out = malloc((size_t)B * W * sizeof *out), *one = malloc((size_t)W * sizeof *one);
    FL_REQUIRE(out && one);
    int ended = 0;
    for (int cache = 0; cache < 2; cache++) {
        int n = 0;
        FL_REQUIRE_OK(fl_model_generate_s2s_batch(&m, src->data, mk, B, Ts, N, cache, out, &n));
        FL_CHECKF(n == L, "%s (cache %d): %d ids per row, transformers %d", dir, cache, n, L);
        for (int b = 0; b < B; b++)
            for (int i = 0; i < n && i < L; i++)
                FL_CHECKF(out[(size_t)b * W + i] == want[(size_t)b * L + i], "%s (cache %d) row %d token %d: %d, want %d",
                          dir, cache, b, i, out[(size_t)b * W + i], want[(size_t)b * L + i]);
        /* each row = its source alone (its own length, no mask) */
        for (int b = 0; b < B; b++) {
            int len = 0, n1 = 0;
            while (len < Ts && mk[(size_t)b * Ts + len]) len++;
            FL_REQUIRE_OK(fl_model_generate_s2s(&m, (const int32_t *)src->data + (size_t)b * Ts, NULL, len, N, cache, one,
                                                &n1));
            for (int i = 0; i < n1; i++)
                FL_CHECKF(one[i] == out[(size_t)b * W + i], "%s (cache %d) row %d token %d: alone %d, in the batch %d", dir,
                          cache, b, i, one[i], out[(size_t)b * W + i]);
            for (int i = n1; i < n; i++) FL_CHECK(out[(size_t)b * W + i] == m.cfg.pad_id);
            ended += cache && n1 < n;
        }
    }
    FL_CHECKF(ended > 0 && ended < B, "%s: %d of %d rows end before the others (the fixture has both kinds)", dir, ended, B);
    /* generation's arena (fl_model_alloc_gen_s2s: the decoder's K/V cache and cross k|v, one row of the rest per
     * sequence): the same ids as transformers' batch and each source alone; the training passes and the prefix rerun
     * (no cache) refuse it */
    int32_t *sampled = malloc((size_t)B * W * sizeof *sampled);
    FL_REQUIRE(sampled != NULL);
    fl_gen_params gs;
    fl_gen_params_default(&gs);
    gs.max_new_tokens = N, gs.temperature = 1.0f, gs.seed = 11;
    int ns = 0, ng = 0;
    FL_REQUIRE_OK(fl_generate_s2s_batch(&m, src->data, mk, B, Ts, &gs, sampled, &ns)); /* the training arena's */
    FL_REQUIRE_OK(fl_model_alloc_gen_s2s(&m, B, Ts, N));
    FL_REQUIRE_OK(fl_model_generate_s2s_batch(&m, src->data, mk, B, Ts, N, 1, out, &ng));
    FL_CHECKF(ng == L, "%s (generation's arena): %d ids per row, transformers %d", dir, ng, L);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < ng && i < L; i++)
            FL_CHECKF(out[(size_t)b * W + i] == want[(size_t)b * L + i], "%s (generation's arena) row %d token %d: %d, "
                      "want %d", dir, b, i, out[(size_t)b * W + i], want[(size_t)b * L + i]);
    for (int b = 0; b < B; b++) {
        int len = 0, n1 = 0;
        while (len < Ts && mk[(size_t)b * Ts + len]) len++;
        FL_REQUIRE_OK(fl_model_generate_s2s(&m, (const int32_t *)src->data + (size_t)b * Ts, NULL, len, N, 1, one, &n1));
        for (int i = 0; i < n1; i++) FL_CHECK(one[i] == out[(size_t)b * W + i]);
    }
    int n3 = 0; /* sampled: the training arena's draws (the same logits) */
    FL_REQUIRE_OK(fl_generate_s2s_batch(&m, src->data, mk, B, Ts, &gs, out, &n3));
    FL_CHECKF(n3 == ns && !memcmp(out, sampled, (size_t)B * W * sizeof *out), "%s: sampled ids differ from the "
              "training arena's", dir);
    fl_status sg = fl_model_generate_s2s_batch(&m, src->data, mk, B, Ts, N, 0, out, &n3);
    FL_CHECKF(sg == FL_ERR_INVALID && strstr(fl_error_message(), "KV cache only"), "'%s'", fl_error_message());
    sg = fl_model_forward_s2s(&m, src->data, mk, src->data, NULL, 1, 2, 2, 0.0f, NULL);
    FL_CHECKF(sg == FL_ERR_INVALID && strstr(fl_error_message(), "generation's"), "'%s'", fl_error_message());
    free(sampled);
    FL_REQUIRE_OK(fl_model_alloc_acts_s2s(&m, B, Ts, N)); /* the checks below in the training arena */
    printf("      %s: %d sources, %d ids per row = transformers' padded generate, %d row(s) ending early; each row = "
           "its source alone\n", dir, B, L, ended);
    /* sampled: seeded, the same ids again */
    fl_gen_params gp;
    fl_gen_params_default(&gp);
    gp.max_new_tokens = N, gp.temperature = 1.0f, gp.seed = 11;
    int32_t *out2 = malloc((size_t)B * W * sizeof *out2);
    FL_REQUIRE(out2 != NULL);
    int n1 = 0, n2 = 0;
    FL_REQUIRE_OK(fl_generate_s2s_batch(&m, src->data, mk, B, Ts, &gp, out, &n1));
    FL_REQUIRE_OK(fl_generate_s2s_batch(&m, src->data, mk, B, Ts, &gp, out2, &n2));
    FL_CHECK(n1 == n2 && !memcmp(out, out2, (size_t)B * W * sizeof *out));
    /* a row whose mask hides every token; more sources than the arena holds */
    uint8_t *bad = malloc((size_t)B * Ts);
    FL_REQUIRE(bad != NULL);
    memcpy(bad, mk, (size_t)B * Ts);
    memset(bad + 2 * Ts, 0, (size_t)Ts);
    fl_status s = fl_model_generate_s2s_batch(&m, src->data, bad, B, Ts, N, 1, out, &n1);
    FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "source 2: its mask hides every token"), "'%s'",
              fl_error_message());
    s = fl_model_generate_s2s_batch(&m, src->data, mk, B + 1, Ts, N, 1, out, &n1);
    FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "need an arena of batch >= 5"), "'%s'",
              fl_error_message());
    free(bad), free(out), free(out2), free(one);
    fl_st_close(&x);
    t5_close(&be, &pool, &host, &m);
}

FL_TEST(t5_relu_batch_generate) { check_batch("tests/fixtures/t5-tiny-relu"); }
FL_TEST(t5_gated_batch_generate) { check_batch("tests/fixtures/t5-tiny-gated"); }

/* Generation's arena grows linearly with max_new (the training arena, which `fitllm generate` used, holds the
 * decoder's relative bias and its gradient, NH x max_new x max_new each: 74.6 GiB of WORKSPACE at 50,000 new tokens for
 * a 932 KiB t5-micro): its planned bytes (m->sizes) at max_new 256, 512, 1024 have equal steps, the WORKSPACE the
 * pool measured while decoding that many tokens is the planned bytes plus the same constant (the sampler), and 50,000
 * tokens plan under 64 MiB of WORKSPACE and 8 KiB of ACTS per token (the K/V cache). */
static void gen_bytes(const char *dir, int max_new, int run, size_t *acts, size_t *work, size_t *measured) {
    fl_backend be;
    fl_mem_pool pool, host;
    fl_model m;
    FL_REQUIRE_OK(t5_open(dir, &be, &pool, &host, &m));
    m.cfg.eos_id = -1; /* decode every one of max_new tokens */
    static const int32_t src[] = {51, 17, 68, 69, 57, 71, 45, 10, 4, 92, 4, 91, 89};
    const int Ts = (int)(sizeof src / sizeof src[0]);
    const size_t before = pool.peak[FL_TAG_WORKSPACE];
    FL_REQUIRE_OK(fl_model_alloc_gen_s2s(&m, 1, Ts, max_new));
    *acts = m.sizes.acts_bytes, *work = m.sizes.workspace_bytes, *measured = 0;
    if (run) {
        fl_gen_params gp;
        fl_gen_params_default(&gp);
        gp.max_new_tokens = max_new, gp.temperature = 0.0f;
        int32_t *out = malloc(((size_t)max_new + 1) * sizeof *out);
        int n = 0;
        FL_REQUIRE(out != NULL);
        FL_REQUIRE_OK(fl_generate_s2s(&m, src, NULL, Ts, &gp, out, &n));
        FL_CHECK(n == max_new + 1);
        *measured = pool.peak[FL_TAG_WORKSPACE] - before;
        free(out);
    }
    t5_close(&be, &pool, &host, &m);
}

FL_TEST(t5_generation_arena_linear) {
    const char *dir = "tests/fixtures/t5-tiny-gated";
    size_t a[3] = {0}, w[3] = {0}, mw[3] = {0};
    const int n[3] = {256, 512, 1024};
    for (int i = 0; i < 3; i++) gen_bytes(dir, n[i], i < 2, &a[i], &w[i], &mw[i]);
    FL_CHECKF(w[2] - w[1] == 2 * (w[1] - w[0]) && a[2] - a[1] == 2 * (a[1] - a[0]),
              "planned bytes not linear in max_new: WORKSPACE %zu, %zu, %zu; ACTS %zu, %zu, %zu", w[0], w[1], w[2], a[0],
              a[1], a[2]);
    FL_CHECKF(mw[0] - w[0] == mw[1] - w[1] && mw[0] > w[0], "measured WORKSPACE %zu, %zu = planned %zu, %zu + the "
              "same constant", mw[0], mw[1], w[0], w[1]);
    size_t a5 = 0, w5 = 0, m5 = 0;
    gen_bytes(dir, 50000, 0, &a5, &w5, &m5);
    FL_CHECKF(w5 < ((size_t)64 << 20) && a5 / 50000 < 8192, "50,000 new tokens plan %zu B WORKSPACE, %zu B ACTS", w5, a5);
    printf("      %s: generation's arena at max_new 256 / 512 / 1024 / 50,000: WORKSPACE %zu / %zu / %zu / %zu B, "
           "ACTS %zu / %zu / %zu / %zu B (linear); measured WORKSPACE = planned + %zu B\n", dir, w[0], w[1], w[2], w5,
           a[0], a[1], a[2], a5, mw[0] - w[0]);
}

/* max_new 0 (`fitllm generate --max_new_tokens 0`, which a decoder-only model takes: the prompt printed, no token):
 * the start token alone, nothing run, in either arena; it was refused ("must be positive") for an encoder-decoder */
FL_TEST(t5_generate_zero_new_tokens) {
    fl_backend be;
    fl_mem_pool pool, host;
    fl_model m;
    FL_REQUIRE_OK(t5_open("tests/fixtures/t5-tiny-gated", &be, &pool, &host, &m));
    static const int32_t src[] = {51, 17, 68, 69, 57, 71, 45, 10, 4, 92, 4, 91, 89, 5, 6, 7};
    fl_gen_params gp;
    fl_gen_params_default(&gp);
    gp.max_new_tokens = 0, gp.temperature = 0.0f;
    for (int gen = 0; gen < 2; gen++) {
        FL_REQUIRE_OK(gen ? fl_model_alloc_gen_s2s(&m, 2, 8, 0) : fl_model_alloc_acts_s2s(&m, 2, 8, 4));
        int32_t out[2] = {-1, -1};
        int n = -1;
        FL_REQUIRE_OK(fl_generate_s2s(&m, src, NULL, 8, &gp, out, &n));
        FL_CHECKF(n == 1 && out[0] == m.cfg.dec_start_id, "arena %d: %d ids, first %d", gen, n, out[0]);
        n = -1, out[0] = out[1] = -1;
        FL_REQUIRE_OK(fl_generate_s2s_batch(&m, src, NULL, 2, 8, &gp, out, &n));
        FL_CHECK(n == 1 && out[0] == m.cfg.dec_start_id && out[1] == m.cfg.dec_start_id);
        FL_REQUIRE_OK(fl_model_generate_s2s(&m, src, NULL, 8, 0, 1, out, &n));
        FL_CHECK(n == 1 && out[0] == m.cfg.dec_start_id);
        FL_CHECK(fl_model_generate_s2s(&m, src, NULL, 8, -1, 1, out, &n) == FL_ERR_INVALID);
    }
    t5_close(&be, &pool, &host, &m);
}

/* Sampled decoding of an encoder-decoder (fl_generate_s2s, `fitllm generate` on T5; issue 31 item 4) on the tiny gated
 * T5 of tests/ref/make_t5_fixture.py: temperature 0 and top-k 1 give transformers' greedy ids (the fixture's gen0);
 * a seed gives the same ids again and another seed others; and the first sampled token follows the softmax of the
 * model's own first-row logits (from the training forward, fl_model_forward_s2s): over 1000 seeds each of the three
 * likeliest tokens' frequency within 4.5 binomial standard deviations of its probability (a sampler that ignored the
 * temperature or took the argmax lands tens of deviations away). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/generate.h"
#include "fitllm/io.h"
#include "fitllm/model.h"
#include "test.h"

FL_TEST(t5_sampling_seeded) {
    const char *dir = "tests/fixtures/t5-tiny-gated";
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    fl_mem_pool pool, host;
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &host, be.name, 0));
    fl_model m;
    FL_REQUIRE_OK(fl_hf_load_model(&m, dir, &be, &pool));
    fl_st_file x;
    FL_REQUIRE_OK(fl_st_open(&x, "tests/fixtures/t5-tiny-gated/expected.safetensors"));
    const fl_st_tensor *src = fl_st_find(&x, "src"), *g0 = fl_st_find(&x, "gen0");
    FL_REQUIRE(src && g0);
    const int Ts = (int)src->shape[1], ng = (int)g0->shape[0], V = m.cfg.vocab_size, N = 12;
    const int32_t *s0 = src->data;
    FL_REQUIRE_OK(fl_model_alloc_acts_s2s(&m, 1, Ts, N));
    int32_t out[3][13];
    int n[3];
    fl_gen_params gp;
    fl_gen_params_default(&gp);
    gp.max_new_tokens = N;
    /* greedy two ways: temperature 0, and top-k 1 at a high temperature */
    gp.temperature = 0.0f;
    FL_REQUIRE_OK(fl_generate_s2s(&m, s0, NULL, Ts, &gp, out[0], &n[0]));
    gp.temperature = 1.5f, gp.top_k = 1;
    FL_REQUIRE_OK(fl_generate_s2s(&m, s0, NULL, Ts, &gp, out[1], &n[1]));
    for (int k = 0; k < 2; k++) {
        FL_CHECKF(n[k] == ng, "greedy %d: %d ids, transformers %d", k, n[k], ng);
        for (int i = 0; i < n[k] && i < ng; i++) FL_CHECK(out[k][i] == ((const int32_t *)g0->data)[i]);
    }
    /* seeded: the same seed again gives the same ids, another seed others */
    gp.temperature = 1.0f, gp.top_k = 50, gp.seed = 7;
    FL_REQUIRE_OK(fl_generate_s2s(&m, s0, NULL, Ts, &gp, out[0], &n[0]));
    FL_REQUIRE_OK(fl_generate_s2s(&m, s0, NULL, Ts, &gp, out[1], &n[1]));
    gp.seed = 8;
    FL_REQUIRE_OK(fl_generate_s2s(&m, s0, NULL, Ts, &gp, out[2], &n[2]));
    FL_CHECK(n[0] == n[1] && !memcmp(out[0], out[1], (size_t)n[0] * sizeof out[0][0]));
    FL_CHECK(n[0] != n[2] || memcmp(out[0], out[2], (size_t)n[0] * sizeof out[0][0]));
    /* the first token's distribution: softmax of the first decoder row's logits (start token in, temperature 1) */
    float *lg = malloc((size_t)V * sizeof *lg);
    FL_REQUIRE(lg != NULL);
    const int32_t start = m.cfg.dec_start_id;
    FL_REQUIRE_OK(fl_model_forward_s2s(&m, s0, NULL, &start, NULL, 1, Ts, 1, 0.0f, lg));
    double mx = lg[0], z = 0;
    for (int v = 1; v < V; v++) mx = fmax(mx, lg[v]);
    for (int v = 0; v < V; v++) z += exp(lg[v] - mx);
    int top[3] = {-1, -1, -1};
    for (int k = 0; k < 3; k++)
        for (int v = 0; v < V; v++)
            if ((k < 1 || v != top[0]) && (k < 2 || v != top[1]) && (top[k] < 0 || lg[v] > lg[top[k]])) top[k] = v;
    const int S = 1000;
    int cnt[3] = {0, 0, 0};
    gp.max_new_tokens = 1, gp.top_k = 0, gp.top_p = 1.0f, gp.temperature = 1.0f;
    for (int r = 0; r < S; r++) {
        gp.seed = 1000 + (uint64_t)r;
        FL_REQUIRE_OK(fl_generate_s2s(&m, s0, NULL, Ts, &gp, out[0], &n[0]));
        FL_REQUIRE(n[0] == 2);
        for (int k = 0; k < 3; k++) cnt[k] += out[0][1] == top[k];
    }
    for (int k = 0; k < 3; k++) {
        const double p = exp(lg[top[k]] - mx) / z, sd = sqrt(S * p * (1 - p));
        printf("      token %d: p %.4f, sampled %d of %d (expected %.1f +- %.1f)\n", top[k], p, cnt[k], S, S * p, sd);
        FL_CHECKF(fabs(cnt[k] - S * p) <= 4.5 * sd, "token %d: %d of %d samples, softmax expects %.1f +- %.1f", top[k],
                  cnt[k], S, S * p, sd);
    }
    free(lg);
    fl_st_close(&x);
    fl_model_free(&m);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}

/* The backend's one door (issue 29, fitllm/backend_op.h): every backend installs run, every kind
 * has its slot's name, an op issued as a record has the bits of the slot called directly (the same
 * kernel with the same arguments), a missing optional slot and an unknown kind are errors that
 * name them. */
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend_op.h"
#include "test.h"

FL_TEST(backend_door_every_backend_has_run) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 1) FL_CHECKF(be.run == fl_backend_run_slots, "%s: run", be.name);
}

FL_TEST(backend_door_kind_names) {
    static const char *const want[] = {"gemm", "embedding_forward", "rmsnorm_forward", "attention_backward",
                                       "sumsq", "set_compute_dtype", "attention_qkv_backward"};
    static const fl_opk kind[] = {FL_OPK_gemm, FL_OPK_embedding_forward, FL_OPK_rmsnorm_forward,
                                  FL_OPK_attention_backward, FL_OPK_sumsq, FL_OPK_set_compute_dtype,
                                  FL_OPK_attention_qkv_backward};
    for (size_t i = 0; i < sizeof want / sizeof *want; i++) FL_CHECK(!strcmp(fl_opk_name(kind[i]), want[i]));
    for (int k = 0; k < FL_OPK_COUNT; k++) { /* every kind named, no name twice */
        FL_CHECKF(strcmp(fl_opk_name((fl_opk)k), "?") != 0, "kind %d", k);
        for (int j = 0; j < k; j++) FL_CHECK(strcmp(fl_opk_name((fl_opk)k), fl_opk_name((fl_opk)j)) != 0);
    }
    FL_CHECK(!strcmp(fl_opk_name(FL_OPK_COUNT), "?") && !strcmp(fl_opk_name((fl_opk)-1), "?"));
}

FL_TEST(backend_door_refuses_by_name) {
    fl_backend be;
    FL_REQUIRE_OK(fl_backend_init_by_name("cpu", &be, 1));
    float x[4] = {1, 2, 3, 4}, y[4];
    /* the CPU backend has no act_forward16 (an optional slot): UNSUPPORTED naming the op and the backend */
    FL_REQUIRE(be.act_forward16 == NULL);
    FL_CHECK(FL_RUN(&be, act_forward16, FL_ACT16_RELU, y, NULL, x, NULL, 1, 4) == FL_ERR_UNSUPPORTED);
    FL_CHECK(strstr(fl_error_message(), "act_forward16") && strstr(fl_error_message(), "cpu"));
    fl_oprec bad = {.kind = FL_OPK_COUNT};
    FL_CHECK(be.run(&be, &bad) == FL_ERR_INVALID);
    FL_CHECK(strstr(fl_error_message(), "unknown kind") != NULL);
    fl_backend_free(&be);
}

/* ops through the door and by their slots on the same inputs: the same bytes */
static void door_same_bits(const fl_backend *be) {
    enum { M = 7, N = 9, K = 13, C = 16, R = 5 };
    fl_test_rng rng = {0x5eed};
    float *a = fl_test_frand(&rng, M * K, -1, 1), *b = fl_test_frand(&rng, K * N, -1, 1);
    float *c1 = calloc(M * N, sizeof(float)), *c2 = calloc(M * N, sizeof(float));
    float *x = fl_test_frand(&rng, R * C, -2, 2), *w = fl_test_frand(&rng, C, 0.5f, 1.5f);
    float *o1 = calloc(R * C, sizeof(float)), *o2 = calloc(R * C, sizeof(float));
    float rs1[R], rs2[R];
    uint16_t h1[R * C], h2[R * C];
    FL_REQUIRE(a && b && c1 && c2 && x && w && o1 && o2);
    FL_CHECK(be->gemm(be, 0, 0, M, N, K, 1.0f, a, FL_F32, K, b, FL_F32, N, 0.0f, c1, FL_F32, N) == FL_OK);
    FL_CHECK(FL_RUN(be, gemm, 0, 0, M, N, K, 1.0f, a, FL_F32, K, b, FL_F32, N, 0.0f, c2, FL_F32, N) == FL_OK);
    FL_CHECKF(!memcmp(c1, c2, sizeof(float) * M * N), "%s: gemm", be->name);
    be->rmsnorm_forward(be, o1, rs1, x, w, R, C, 1e-5f);
    FL_CHECK(FL_RUN(be, rmsnorm_forward, o2, rs2, x, w, R, C, 1e-5f) == FL_OK);
    FL_CHECKF(!memcmp(o1, o2, sizeof(float) * R * C) && !memcmp(rs1, rs2, sizeof rs1), "%s: rmsnorm", be->name);
    FL_CHECK(be->convert(be, h1, FL_BF16, x, FL_F32, R * C) == FL_OK);
    FL_CHECK(FL_RUN(be, convert, h2, FL_BF16, x, FL_F32, R * C) == FL_OK);
    FL_CHECKF(!memcmp(h1, h2, sizeof h1), "%s: convert", be->name);
    double s1 = be->sumsq(be, x, FL_F32, R * C), s2 = -1;
    FL_CHECK(FL_RUN(be, sumsq, x, FL_F32, R * C, &s2) == FL_OK);
    FL_CHECKF(s1 == s2 && s1 > 0, "%s: sumsq %.17g vs %.17g", be->name, s1, s2);
    /* the fused-QKV attention kind runs fl_attention_qkv_forward */
    enum { B = 1, T = 3, NH = 2, NKV = 1, HD = 4, W = (NH + 2 * NKV) * HD };
    float *qkv = fl_test_frand(&rng, B * T * W, -1, 1), att1[B * T * NH * HD], att2[B * T * NH * HD];
    float l1[B * NH * T], l2[B * NH * T];
    FL_REQUIRE(qkv);
    FL_CHECK(fl_attention_qkv_forward(be, att1, l1, qkv, B, T, NH, NKV, HD) == FL_OK);
    FL_CHECK(FL_RUN(be, attention_qkv_forward, att2, l2, qkv, B, T, NH, NKV, HD) == FL_OK);
    FL_CHECKF(!memcmp(att1, att2, sizeof att1) && !memcmp(l1, l2, sizeof l1), "%s: attention_qkv", be->name);
    free(qkv);
    free(a), free(b), free(c1), free(c2), free(x), free(w), free(o1), free(o2);
}

FL_TEST(backend_door_same_bits_as_the_slots) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) {
        if (fl_backend_host_memory(&be)) door_same_bits(&be); /* host buffers: the backends whose memory is ours */
    }
}

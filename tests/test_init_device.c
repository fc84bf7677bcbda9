/* Random initialization on the device (issue 33: backend.h init_random; the CUDA kernel kernels/init.cu, run here by
 * the emulator): the parameters' bytes equal the host stream's (the CPU backend has no slot: the host path) in fp32,
 * bf16 and fp16 storage, over a vocabulary of an odd element count; a tensor piece starting at an odd element (an
 * FSDP shard's start) equals the same elements of the whole tensor. */
#include "fitllm/backend.h"
#include "fitllm/model.h"
#include <math.h>

#include "test.h"

static void *init_bytes(const char *backend, fl_dtype dt, size_t *bytes) {
    fl_model_config c;
    FL_REQUIRE_R(fl_preset_find("micro", &c) == FL_OK, NULL);
    c.vocab_size = 8191; /* an odd element count: the last pair has one element */
    fl_backend be;
    fl_mem_pool pool, host;
    if (fl_backend_init_by_name(backend, &be, 2) != FL_OK) return NULL;
    FL_REQUIRE_R(fl_backend_pools_init(&be, &pool, &host, "init", 0) == FL_OK, NULL);
    fl_model_storage st;
    memset(&st, 0, sizeof st);
    st.param_dtype = dt;
    fl_model m;
    FL_REQUIRE_R(fl_model_init_ex(&m, &c, &be, &pool, &st) == FL_OK, NULL);
    FL_REQUIRE_R(fl_model_init_random_ex(&m, 1337) == FL_OK, NULL);
    *bytes = m.layout.numel * fl_dtype_size(dt);
    void *h = malloc(*bytes);
    FL_REQUIRE_R(h && be.to_host(&be, h, fl_model_params_data(&m), *bytes) == FL_OK, NULL);
    fl_model_free(&m);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
    return h;
}

FL_TEST(init_random_on_device_same_bits) {
    fl_backend probe;
    if (fl_backend_init_by_name("cuda-emu", &probe, 1) != FL_OK) {
        fl_test_skip("no cuda-emu backend in this build");
        return;
    }
    FL_CHECK(probe.init_random != NULL);
    fl_backend cpu;
    FL_REQUIRE_OK(fl_backend_init_by_name("cpu", &cpu, 1));
    FL_CHECK(cpu.init_random == NULL); /* host memory: generated in place */
    fl_backend_free(&cpu);
    static const fl_dtype dts[3] = {FL_F32, FL_BF16, FL_F16};
    for (int k = 0; k < 3; k++) {
        size_t nh = 0, nd = 0;
        void *h = init_bytes("cpu", dts[k], &nh), *d = init_bytes("cuda-emu", dts[k], &nd);
        FL_REQUIRE(h && d);
        FL_CHECKF(nh == nd && !memcmp(h, d, nh), "%s: the device's init differs from the host's", fl_dtype_name(dts[k]));
        free(h), free(d);
    }
    /* a piece [a, b) of tensor 0 (a odd: a shard's start) equals those elements of the whole tensor; the stream
     * state is the model's per-tensor one (src/model/model.c: seed x 0x100000001b3 + index x gamma) */
    const size_t numel = 1001, a = 3, b = 777;
    const uint64_t s = 1337ULL * 0x100000001b3ULL;
    fl_mem_pool pool, host;
    FL_REQUIRE_OK(fl_backend_pools_init(&probe, &pool, &host, "init", 0));
    void *whole = NULL, *piece = NULL;
    FL_REQUIRE_OK(fl_mem_alloc(&pool, FL_TAG_OTHER, numel * sizeof(float), &whole));
    FL_REQUIRE_OK(fl_mem_alloc(&pool, FL_TAG_OTHER, numel * sizeof(float), &piece));
    FL_REQUIRE_OK(probe.init_random(&probe, whole, FL_F32, 0, numel, numel, 2, 0.02, s));
    FL_REQUIRE_OK(probe.init_random(&probe, piece, FL_F32, a, b, numel, 2, 0.02, s));
    float hw[1001], hp[1001];
    FL_REQUIRE_OK(probe.to_host(&probe, hw, whole, sizeof hw));
    FL_REQUIRE_OK(probe.to_host(&probe, hp, piece, (b - a) * sizeof(float)));
    FL_CHECK(!memcmp(hw + a, hp, (b - a) * sizeof(float)));
    double sum = 0, sq = 0; /* normal(0, 0.02): a sanity check that it is the stream, not zeros */
    for (size_t i = 0; i < numel; i++) sum += hw[i], sq += (double)hw[i] * hw[i];
    FL_CHECKF(fabs(sum / numel) < 0.003 && fabs(sqrt(sq / numel) - 0.02) < 0.003, "mean %g sd %g", sum / numel,
              sqrt(sq / numel));
    FL_REQUIRE_OK(probe.init_random(&probe, piece, FL_F32, 0, 5, 5, 1, 0.0, s)); /* ones */
    FL_REQUIRE_OK(probe.to_host(&probe, hp, piece, 5 * sizeof(float)));
    FL_CHECK(hp[0] == 1.0f && hp[4] == 1.0f);
    fl_mem_free(&pool, whole);
    fl_mem_free(&pool, piece);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&probe);
}

/* The backend contract's queries (issue 29, item 5): capability flags and the registry's facts
 * agree with the backends they describe, the accelerator choice maps to a registered backend, and
 * the fused-QKV attention shape is recognized exactly (a near miss runs the general kernels). */
#include <math.h>
#include <string.h>

#include "fitllm/backend.h"
#include "test.h"

FL_TEST(backend_caps_match_the_facts) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 1) {
        fl_backend_facts f;
        FL_REQUIRE_OK(fl_backend_facts_of(be.name, &f));
        FL_CHECKF(f.caps == be.caps, "%s: facts caps %#x, backend %#x", be.name, f.caps, be.caps);
        FL_CHECKF(f.device == be.device, "%s: device", be.name);
        FL_CHECKF(f.scratch_bytes == be.scratch_bytes && f.gemm_widens16 == be.gemm_widens16, "%s: scratch/widen",
                  be.name);
        /* a backend-free supports_op, where the facts have one, answers as the backend's */
        static const fl_dtype dt[3] = {FL_F32, FL_BF16, FL_F16};
        for (int op = 0; f.supports_op && op < FL_OP_COUNT; op++)
            for (int a = 0; a < 3; a++)
                for (int b = 0; b < 3; b++)
                    for (int c = 0; c < 3; c++)
                        FL_CHECKF(f.supports_op((fl_op)op, dt[a], dt[b], dt[c]) ==
                                      be.supports_op(&be, (fl_op)op, dt[a], dt[b], dt[c]),
                                  "%s: supports_op %s(%s, %s, %s)", be.name, fl_op_name((fl_op)op),
                                  fl_dtype_name(dt[a]), fl_dtype_name(dt[b]), fl_dtype_name(dt[c]));
        fl_backend ref;
        FL_CHECKF(f.reference && fl_backend_init_by_name(f.reference, &ref, 1) == FL_OK, "%s: reference %s", be.name,
                  f.reference ? f.reference : "(none)");
        if (f.reference) fl_backend_free(&ref);
    }
    fl_backend_facts f;
    /* the GPU's facts in any build: a plan for it needs no GPU */
    FL_REQUIRE_OK(fl_backend_facts_of("cuda", &f));
    FL_CHECK((f.caps & FL_CAP_DEVICE_MEMORY) && !(f.caps & FL_CAP_HOST_MEMORY) && f.device == FL_DEV_CUDA);
    FL_CHECK(f.supports_op && f.memory_capacity && f.describe);
    FL_CHECK(fl_backend_facts_of("no-such-backend", &f) == FL_ERR_INVALID);
    FL_CHECK(strstr(fl_error_message(), "cpu, ref") != NULL);
    FL_CHECK(fl_backend_memory_capacity("cpu") > 0);
}

FL_TEST(backend_accelerator_names_a_backend) {
    fl_accel a;
    FL_CHECK(fl_accel_parse("auto", &a) == 0 && a == FL_ACCEL_AUTO);
    FL_CHECK(fl_accel_parse("cpu", &a) == 0 && a == FL_ACCEL_CPU);
    FL_CHECK(fl_accel_parse("cuda", &a) == 0 && a == FL_ACCEL_CUDA);
    FL_CHECK(fl_accel_parse("gpu", &a) == -1 && fl_accel_parse(NULL, &a) == -1);
    FL_CHECK(!strcmp(fl_accel_backend(FL_ACCEL_CPU), "cpu") && !strcmp(fl_accel_backend(FL_ACCEL_CUDA), "cuda"));
    fl_accel use;
    FL_REQUIRE_OK(fl_accel_resolve(FL_ACCEL_CPU, &use));
    FL_CHECK(use == FL_ACCEL_CPU);
    fl_backend_facts f; /* every accelerator's backend has facts, built or not */
    FL_CHECK(fl_backend_facts_of(fl_accel_backend(FL_ACCEL_CPU), &f) == FL_OK);
    FL_CHECK(fl_backend_facts_of(fl_accel_backend(FL_ACCEL_CUDA), &f) == FL_OK);
}

FL_TEST(backend_attn_qkv_shape_is_exact) {
    const int B = 2, T = 5, NH = 4, NKV = 2, HD = 8;
    static float qkv[2 * 5 * (4 + 2 * 2) * 8], dqkv[2 * 5 * (4 + 2 * 2) * 8];
    const size_t ko = (size_t)NH * HD, vo = (size_t)(NH + NKV) * HD;
    fl_attn_desc a = fl_attn_desc_qkv(B, T, NH, NKV, HD);
    FL_CHECK(a.causal && a.Tq == T && a.Tk == T && a.ldq == (size_t)(NH + 2 * NKV) * HD && a.ldo == ko);
    FL_CHECK(a.scale == 1.0f / sqrtf((float)HD));
    FL_CHECK(fl_attn_is_qkv(&a, qkv, qkv + ko, qkv + vo, NULL, NULL, NULL, NULL, NULL, NULL));
    FL_CHECK(fl_attn_is_qkv(&a, qkv, qkv + ko, qkv + vo, NULL, NULL, dqkv, dqkv + ko, dqkv + vo, NULL));
    /* near misses: the general kernels */
    FL_CHECK(!fl_attn_is_qkv(&a, qkv, qkv + ko + 1, qkv + vo, NULL, NULL, NULL, NULL, NULL, NULL));
    FL_CHECK(!fl_attn_is_qkv(&a, qkv, qkv + ko, qkv + vo, qkv, NULL, NULL, NULL, NULL, NULL)); /* a bias */
    FL_CHECK(!fl_attn_is_qkv(&a, qkv, qkv + ko, qkv + vo, NULL, (const uint8_t *)qkv, NULL, NULL, NULL, NULL));
    FL_CHECK(!fl_attn_is_qkv(&a, qkv, qkv + ko, qkv + vo, NULL, NULL, dqkv, dqkv + vo, dqkv + vo, NULL));
    fl_attn_desc b = a;
    b.causal = 0;
    FL_CHECK(!fl_attn_is_qkv(&b, qkv, qkv + ko, qkv + vo, NULL, NULL, NULL, NULL, NULL, NULL));
    b = a;
    b.scale = 0.5f;
    FL_CHECK(!fl_attn_is_qkv(&b, qkv, qkv + ko, qkv + vo, NULL, NULL, NULL, NULL, NULL, NULL));
    b = a;
    b.Tk = T - 1;
    FL_CHECK(!fl_attn_is_qkv(&b, qkv, qkv + ko, qkv + vo, NULL, NULL, NULL, NULL, NULL, NULL));
}

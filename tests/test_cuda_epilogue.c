/* cuBLASLt epilogues (issue 30 item 3): a linear's bias, and GPT-2's bias + tanh GELU, fused into the GEMM.
 *
 * The stand-in (cu_gemm.c, what the emulator runs) against its contract: the epilogue adds the bias to the
 * fp32-rounded sum (the bits of the plain stand-in then one fp32 add) and the GELU is within a few fp32
 * roundings of a float64 evaluation of the tanh GELU (an independent anchor: tanh, not the kernels' sigmoid
 * form); its refusals; and that the plan cache keeps epilogues apart. The backend's gemm_epilogue on cuda-emu
 * against gemm + bias_forward (+ gelu_forward) on the same backend, bit for bit, for every type combination of
 * the gemm slot (fused where cuBLASLt takes the types, composed otherwise), with FITLLM_CUDA_EPILOGUE=0 the same
 * bits without the fused path, and the bad arguments by name. The training run's bits: test_cuda_model.c. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cu_gemm.h"
#include "fitllm/backend.h"
#include "fitllm/dtype.h"
#include "test.h"

/* float64 tanh GELU (transformers' gelu_new) */
static double gelu64(double x) { return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }

FL_TEST(cuda_gemm_epilogue_standin) {
    enum { m = 13, n = 7, k = 19, ldc = 16, ldaux = 15 };
    fl_test_rng rng = {0xe1b0};
    float *A = fl_test_frand(&rng, m * k, -1, 1), *B = fl_test_frand(&rng, k * n, -1, 1);
    float *bias = fl_test_frand(&rng, m, -2, 2), *C0 = fl_test_frand(&rng, ldc * n, -1, 1);
    float *C = malloc(sizeof(float) * ldc * n), *P = malloc(sizeof(float) * ldc * n);
    float *aux = malloc(sizeof(float) * ldaux * n);
    FL_REQUIRE(A && B && bias && C0 && C && P && aux);
    for (int beta_case = 0; beta_case < 2; beta_case++) {
        const float beta = beta_case ? -0.4f : 0.0f;
        fl_cu_gemm_desc d = {.m = m, .n = n, .k = k, .alpha = 0.7f, .beta = beta, .A = A, .ta = FL_F32, .lda = m,
                             .B = B, .tb = FL_F32, .ldb = k, .C = P, .tc = FL_F32, .ldc = ldc, .batch = 1};
        memcpy(P, C0, sizeof(float) * ldc * n);
        FL_REQUIRE_OK(fl_cu_gemm_standin(NULL, &d)); /* the plain sum */
        memcpy(C, C0, sizeof(float) * ldc * n);
        d.C = C;
        d.epilogue = FL_CU_EPI_BIAS;
        d.bias = bias;
        unsigned long e0 = fl_cu_gemm_standin_epilogues;
        FL_REQUIRE_OK(fl_cu_gemm_standin(NULL, &d));
        FL_CHECK(fl_cu_gemm_standin_epilogues == e0 + 1);
        int same = 1;
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++) {
                float want = P[i + j * ldc] + bias[i];
                same &= !memcmp(&want, &C[i + j * ldc], sizeof want);
            }
        FL_CHECKF(same, "bias epilogue (beta %g): not the plain sum + one fp32 add", (double)beta);
        for (int i = m; i < ldc; i++) FL_CHECK(C[i] == C0[i]); /* padding rows untouched */
        /* a BF16 bias with an F32 D: refused as cuBLASLt refuses it (a bias of D's type only), C untouched */
        uint16_t b16[m];
        for (int i = 0; i < m; i++) b16[i] = fl_f32_to_bf16(bias[i]);
        memcpy(C, C0, sizeof(float) * ldc * n);
        d.bias = b16, d.bias_t = FL_BF16;
        e0 = fl_cu_gemm_standin_epilogues;
        FL_CHECK(fl_cu_gemm_standin(NULL, &d) == FL_ERR_UNSUPPORTED && strstr(fl_error_message(), "bias of D's type") &&
                 strstr(fl_error_message(), "BF16 bias with a F32 D"));
        FL_CHECK(fl_cu_gemm_standin_epilogues == e0 && !memcmp(C, C0, sizeof(float) * ldc * n));
        d.bias_t = FL_F16;
        FL_CHECK(fl_cu_gemm_standin(NULL, &d) == FL_ERR_UNSUPPORTED && strstr(fl_error_message(), "F16 bias"));
    }
    /* bias + GELU (beta 0): aux the biased sum, C its GELU within 8 fp32 roundings of float64 */
    fl_cu_gemm_desc d = {.m = m, .n = n, .k = k, .alpha = 1.0f, .beta = 0.0f, .A = A, .ta = FL_F32, .lda = m,
                         .B = B, .tb = FL_F32, .ldb = k, .C = P, .tc = FL_F32, .ldc = ldc, .batch = 1};
    FL_REQUIRE_OK(fl_cu_gemm_standin(NULL, &d));
    d.C = C;
    d.epilogue = FL_CU_EPI_GELU_AUX_BIAS;
    d.bias = bias;
    d.aux = aux;
    d.ldaux = ldaux;
    FL_REQUIRE_OK(fl_cu_gemm_standin(NULL, &d));
    int aux_ok = 1, gelu_ok = 1;
    double worst = 0;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            float pre = P[i + j * ldc] + bias[i];
            aux_ok &= !memcmp(&pre, &aux[i + j * ldaux], sizeof pre);
            double g = gelu64(pre), err = fabs(C[i + j * ldc] - g), tol = 8 * 0x1p-24 * (fabs(g) + fabs(pre));
            gelu_ok &= err <= tol;
            if (err / tol > worst) worst = err / tol;
        }
    FL_CHECK(aux_ok);
    FL_CHECKF(gelu_ok, "GELU epilogue: worst error %.3g of the bound", worst);
    {
        fl_cu_gemm_desc g = d; /* a BF16 bias with the F32 D: refused */
        uint16_t g16[m];
        for (int i = 0; i < m; i++) g16[i] = fl_f32_to_bf16(bias[i]);
        g.bias = g16, g.bias_t = FL_BF16;
        FL_CHECK(fl_cu_gemm_standin(NULL, &g) == FL_ERR_UNSUPPORTED && strstr(fl_error_message(), "bias+GELU"));
    }
    /* a BF16 D with the bias epilogue (beta 0) and a BF16 bias: RNE of the plain sum + the bias's exact widening, one
     * fp32 add, one rounding; an F32 bias with the BF16 D refused (a bias of D's type only) */
    {
        uint16_t D16[ldc * n], A16[m * k], B16[k * n], b16[m];
        for (int i = 0; i < m; i++) b16[i] = fl_f32_to_bf16(bias[i]);
        for (int i = 0; i < m * k; i++) A16[i] = fl_f32_to_bf16(A[i]);
        for (int i = 0; i < k * n; i++) B16[i] = fl_f32_to_bf16(B[i]);
        fl_cu_gemm_desc b = d; /* bf16 operands: the plain sum into P, then the epilogue into D16 */
        b.A = A16, b.ta = FL_BF16, b.B = B16, b.tb = FL_BF16, b.C = P, b.epilogue = FL_CU_EPI_NONE;
        FL_REQUIRE_OK(fl_cu_gemm_standin(NULL, &b));
        b.epilogue = FL_CU_EPI_BIAS, b.aux = NULL, b.C = D16, b.tc = FL_BF16;
        FL_CHECK(fl_cu_gemm_standin(NULL, &b) == FL_ERR_UNSUPPORTED && strstr(fl_error_message(), "F32 bias with a BF16 D"));
        b.bias = b16, b.bias_t = FL_BF16;
        FL_REQUIRE_OK(fl_cu_gemm_standin(NULL, &b));
        int same16 = 1;
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++)
                same16 &= D16[i + j * ldc] == fl_f32_to_bf16(P[i + j * ldc] + fl_bf16_to_f32(b16[i]));
        FL_CHECKF(same16, "bias epilogue with a BF16 D: not RNE(the sum + the widened bf16 bias)");
        b.epilogue = FL_CU_EPI_GELU_AUX_BIAS, b.aux = aux; /* not built for a BF16 D */
        FL_CHECK(fl_cu_gemm_standin(NULL, &b) == FL_ERR_UNSUPPORTED && strstr(fl_error_message(), "BF16"));
        b.epilogue = FL_CU_EPI_BIAS, b.beta = 1.0f;
        FL_CHECK(fl_cu_gemm_standin(NULL, &b) == FL_ERR_UNSUPPORTED);
    }
    /* refusals */
    fl_cu_gemm_desc e = d;
    e.ldaux = m - 1;
    FL_CHECK(fl_cu_gemm_standin(NULL, &e) == FL_ERR_INVALID && strstr(fl_error_message(), "ldaux"));
    e = d, e.beta = 1.0f;
    FL_CHECK(fl_cu_gemm_standin(NULL, &e) == FL_ERR_INVALID && strstr(fl_error_message(), "beta"));
    e = d, e.aux = NULL;
    FL_CHECK(fl_cu_gemm_standin(NULL, &e) == FL_ERR_INVALID);
    e = d, e.bias = NULL;
    FL_CHECK(fl_cu_gemm_standin(NULL, &e) == FL_ERR_INVALID && strstr(fl_error_message(), "bias"));
    e = d, e.epilogue = 7;
    FL_CHECK(fl_cu_gemm_standin(NULL, &e) == FL_ERR_INVALID && strstr(fl_error_message(), "epilogue 7"));
    e = d, e.batch = 2;
    FL_CHECK(fl_cu_gemm_standin(NULL, &e) == FL_ERR_UNSUPPORTED && strstr(fl_error_message(), "one matrix"));
    free(A), free(B), free(bias), free(C0), free(C), free(P), free(aux);
}

/* the plan cache: an epilogue's kind, aux's leading dimension and the bias / aux alignments make other plans;
 * the pointers of equal alignment do not */
FL_TEST(cuda_gemm_epilogue_plan_key) {
    _Alignas(256) static float buf[2048];
    fl_cu_gemm_desc d = {.m = 5, .n = 7, .k = 3, .alpha = 1, .A = buf, .ta = FL_F32, .lda = 5, .B = buf + 64,
                         .tb = FL_F32, .ldb = 3, .C = buf + 128, .tc = FL_F32, .ldc = 5, .batch = 1,
                         .epilogue = FL_CU_EPI_GELU_AUX_BIAS, .bias = buf + 256, .aux = buf + 512, .ldaux = 8};
    fl_cu_gemm_key k0, k;
    fl_cu_gemm_key_of(&d, 64, &k0);
    fl_cu_gemm_desc e = d;
    e.bias = buf + 768, e.aux = buf + 1024;
    fl_cu_gemm_key_of(&e, 64, &k);
    FL_CHECK(fl_cu_gemm_key_eq(&k0, &k));
    for (int f = 0; f < 6; f++) {
        e = d;
        switch (f) {
        case 5: e.bias_t = FL_BF16; break;
        case 0: e.epilogue = FL_CU_EPI_BIAS; break;
        case 1: e.epilogue = FL_CU_EPI_NONE; break;
        case 2: e.ldaux = 16; break;
        case 3: e.bias = buf + 257; break;
        case 4: e.aux = buf + 513; break;
        }
        fl_cu_gemm_key_of(&e, 64, &k);
        FL_CHECKF(!fl_cu_gemm_key_eq(&k0, &k), "epilogue field %d ignored by the key", f);
    }
    /* without an epilogue its fields are not read */
    d.epilogue = FL_CU_EPI_NONE;
    fl_cu_gemm_key_of(&d, 64, &k0);
    e = d, e.bias = buf + 3, e.aux = buf + 5, e.ldaux = 99;
    fl_cu_gemm_key_of(&e, 64, &k);
    FL_CHECK(fl_cu_gemm_key_eq(&k0, &k));
}

#ifdef FL_HAVE_CUDA_EMU
/* operand of type t from floats (bf16 / f16: rounded) */
static void *typed(const float *x, size_t n, fl_dtype t) {
    if (t == FL_F32) {
        float *y = malloc(n * sizeof *y);
        memcpy(y, x, n * sizeof *y);
        return y;
    }
    uint16_t *y = malloc(n * sizeof *y);
    for (size_t i = 0; i < n; i++) y[i] = t == FL_BF16 ? fl_f32_to_bf16(x[i]) : fl_f32_to_f16(x[i]);
    return y;
}

/* gemm_epilogue = gemm, bias_forward (+ gelu_forward) on one backend; *fused: the stand-in's epilogue ran */
/* (epi | FL_GEMM_EPI_BIAS_BF16: the bias given in bf16, the separate ops' bias its widening) */
static void epi_case(const fl_backend *be, int epi, int trans_a, fl_dtype ta, fl_dtype tb, int K, float beta,
                     int *fused) {
    enum { M = 11, N = 9 };
    fl_test_rng rng = {0x5eed + (uint64_t)K * 7 + (uint64_t)ta * 3 + (uint64_t)tb};
    float *a = fl_test_frand(&rng, (size_t)M * (K ? K : 1), -1, 1), *b = fl_test_frand(&rng, (size_t)N * (K ? K : 1), -1, 1);
    float *bias = fl_test_frand(&rng, N, -1, 1), *c0 = fl_test_frand(&rng, M * N, -1, 1);
    void *A = typed(a, (size_t)M * (K ? K : 1), ta), *B = typed(b, (size_t)N * (K ? K : 1), tb);
    float c1[M * N], c2[M * N], x1[M * N], x2[M * N];
    memcpy(c1, c0, sizeof c1), memcpy(c2, c0, sizeof c2);
    uint16_t b16[N];
    const int bf = (epi & FL_GEMM_EPI_BIAS_BF16) != 0;
    for (int j = 0; j < N && bf; j++) b16[j] = fl_f32_to_bf16(bias[j]), bias[j] = fl_bf16_to_f32(b16[j]);
    const int lda = trans_a ? M : K, gelu = (epi & ~FL_GEMM_EPI_BIAS_BF16) == FL_GEMM_EPI_BIAS_GELU;
    unsigned long e0 = fl_cu_gemm_standin_epilogues;
    FL_CHECK(be->gemm_epilogue(be, epi, bf ? (const void *)b16 : bias, gelu ? x1 : NULL, N, trans_a, 1, M, N, K, 0.5f,
                               A, ta, lda, B, tb, K, beta, c1, N) == FL_OK);
    *fused = fl_cu_gemm_standin_epilogues > e0;
    float *y = gelu ? x2 : c2;
    FL_CHECK(be->gemm(be, trans_a, 1, M, N, K, 0.5f, A, ta, lda, B, tb, K, beta, y, FL_F32, N) == FL_OK);
    be->bias_forward(be, y, bias, M, N);
    if (gelu) be->gelu_forward(be, c2, x2, (size_t)M * N);
    FL_CHECKF(!memcmp(c1, c2, sizeof c1) && (!gelu || !memcmp(x1, x2, sizeof x1)),
              "%s epilogue %d trans_a %d %s x %s K %d beta %g: not the separate ops' bits", be->name, epi, trans_a,
              fl_dtype_name(ta), fl_dtype_name(tb), K, (double)beta);
    free(a), free(b), free(bias), free(c0), free(A), free(B);
}

static void epi_cases(const fl_backend *be, int want_fused) {
    static const struct { int trans_a; fl_dtype ta, tb; int fusable; } ty[] = {
        {0, FL_F32, FL_F32, 1}, {1, FL_F32, FL_F32, 1}, {0, FL_BF16, FL_BF16, 1}, {0, FL_F32, FL_BF16, 1},
        {1, FL_F32, FL_BF16, 0}, {0, FL_F32, FL_F16, 0}, {0, FL_F16, FL_F16, 1}};
    for (size_t t = 0; t < sizeof ty / sizeof ty[0]; t++)
        for (int c = 0; c < 5; c++) { /* 3, 4: a bf16 bias */
            const int epi = (c % 3 == 2 ? FL_GEMM_EPI_BIAS_GELU : FL_GEMM_EPI_BIAS) | (c > 2 ? FL_GEMM_EPI_BIAS_BF16 : 0);
            int fused = -1;
            epi_case(be, epi, ty[t].trans_a, ty[t].ta, ty[t].tb, 21, c == 1 || c == 3 ? 0.25f : 0.0f, &fused);
            FL_CHECKF(fused == (want_fused && ty[t].fusable), "%s %s x %s trans_a %d: fused %d", be->name,
                      fl_dtype_name(ty[t].ta), fl_dtype_name(ty[t].tb), ty[t].trans_a, fused);
        }
    int fused;
    epi_case(be, FL_GEMM_EPI_BIAS, 0, FL_F32, FL_F32, 0, 0.5f, &fused); /* K = 0: beta C + bias */
    epi_case(be, FL_GEMM_EPI_BIAS | FL_GEMM_EPI_BIAS_BF16, 0, FL_F32, FL_F32, 0, 0.5f, &fused);
}

/* FL_GEMM_EPI_OUT_BF16 (a bf16 run's stored biased linear output, issue 30 item 1): C16 = RNE(gemm + bias_forward's
 * fp32 result) bit for bit, fused (the stand-in's bf16 D) and composed (FITLLM_CUDA_EPILOGUE=0: through aux), an fp32
 * or bf16 bias, odd shapes; within one bf16 rounding plus the fp32 sum's bound of float64; its refusals by name */
static void out16_case(const fl_backend *be, int M, int N, int K, int b16, int want_fused) {
    fl_test_rng rng = {(uint64_t)(M * 131 + N * 7 + K + b16)};
    float *a = fl_test_frand(&rng, (size_t)M * K, -1, 1), *b = fl_test_frand(&rng, (size_t)N * K, -1, 1);
    float *bias = fl_test_frand(&rng, N, -1, 1), *y = malloc((size_t)M * N * 4), *aux = malloc((size_t)M * N * 4);
    uint16_t *A = typed(a, (size_t)M * K, FL_BF16), *B = typed(b, (size_t)N * K, FL_BF16), *bb = typed(bias, N, FL_BF16);
    uint16_t *c16 = malloc((size_t)M * N * 2);
    for (int j = 0; j < N && b16; j++) bias[j] = fl_bf16_to_f32(bb[j]);
    FL_CHECK(be->gemm(be, 0, 1, M, N, K, 1.0f, A, FL_BF16, K, B, FL_BF16, K, 0.0f, y, FL_F32, N) == FL_OK);
    be->bias_forward(be, y, bias, M, N);
    unsigned long e0 = fl_cu_gemm_standin_epilogues;
    const int epi = FL_GEMM_EPI_BIAS | FL_GEMM_EPI_OUT_BF16 | (b16 ? FL_GEMM_EPI_BIAS_BF16 : 0);
    FL_CHECK(be->gemm_epilogue(be, epi, b16 ? (const void *)bb : bias, aux, N, 0, 1, M, N, K, 1.0f, A, FL_BF16, K, B,
                               FL_BF16, K, 0.0f, (float *)c16, N) == FL_OK);
    FL_CHECKF((fl_cu_gemm_standin_epilogues > e0) == want_fused, "out16 %dx%dx%d: fused %d", M, N, K, !want_fused);
    int same = 1, near = 1;
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            const size_t k = (size_t)i * N + j;
            same &= c16[k] == fl_f32_to_bf16(y[k]);
            double want = bias[j], mag = fabs(bias[j]);
            for (int p = 0; p < K; p++) {
                const double t = (double)fl_bf16_to_f32(A[(size_t)i * K + p]) * fl_bf16_to_f32(B[(size_t)j * K + p]);
                want += t, mag += fabs(t);
            }
            near &= fabs(fl_bf16_to_f32(c16[k]) - want) <= 0x1p-8 * fabs(want) + (K + 2) * 0x1p-24 * mag;
        }
    FL_CHECKF(same, "out16 %dx%dx%d bias %s: not RNE(gemm + bias_forward)", M, N, K, b16 ? "bf16" : "fp32");
    FL_CHECKF(near, "out16 %dx%dx%d: beyond one bf16 rounding of float64", M, N, K);
    free(a), free(b), free(bias), free(y), free(aux), free(A), free(B), free(bb), free(c16);
}
static void out16_cases(const fl_backend *be, int want_fused) {
    out16_case(be, 11, 9, 21, 0, want_fused);
    out16_case(be, 37, 45, 67, 1, want_fused);
    out16_case(be, 1, 3, 1, 1, want_fused);
}

FL_TEST(cuda_emu_gemm_epilogue_same_bits) {
    fl_backend be;
    FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
    FL_REQUIRE(be.gemm_epilogue != NULL);
    float x[64] = {0};
    epi_cases(&be, 1);
    out16_cases(&be, 1);
    {
        const int o16 = FL_GEMM_EPI_BIAS | FL_GEMM_EPI_OUT_BF16;
        uint16_t h[64] = {0};
        FL_CHECK(be.gemm_epilogue(&be, o16, x, NULL, 0, 0, 1, 2, 2, 2, 1, h, FL_BF16, 2, h, FL_BF16, 2, 0.5f, x, 2) ==
                     FL_ERR_UNSUPPORTED && strstr(fl_error_message(), "bf16 output"));
        FL_CHECK(be.gemm_epilogue(&be, o16, x, NULL, 0, 0, 1, 2, 2, 2, 1, x, FL_F32, 2, x, FL_F32, 2, 0, x, 2) ==
                     FL_ERR_UNSUPPORTED && strstr(fl_error_message(), "bf16 output"));
        FL_CHECK(be.gemm_epilogue(&be, FL_GEMM_EPI_BIAS_GELU | FL_GEMM_EPI_OUT_BF16, x, x + 16, 2, 0, 1, 2, 2, 2, 1, h,
                                  FL_BF16, 2, h, FL_BF16, 2, 0, x + 32, 2) == FL_ERR_UNSUPPORTED);
    }
    /* bad arguments, by name */
    FL_CHECK(be.gemm_epilogue(&be, 9, x, NULL, 0, 0, 1, 2, 2, 2, 1, x, FL_F32, 2, x, FL_F32, 2, 0, x, 2) ==
                 FL_ERR_INVALID && strstr(fl_error_message(), "epilogue 9"));
    FL_CHECK(be.gemm_epilogue(&be, FL_GEMM_EPI_BIAS, NULL, NULL, 0, 0, 1, 2, 2, 2, 1, x, FL_F32, 2, x, FL_F32, 2, 0,
                              x, 2) == FL_ERR_INVALID && strstr(fl_error_message(), "bias NULL"));
    FL_CHECK(be.gemm_epilogue(&be, FL_GEMM_EPI_BIAS, x, NULL, 0, 0, 1, 2, 2, 2, 1, x, FL_F32, 2, x, FL_F32, 2, 0, x,
                              3) == FL_ERR_INVALID && strstr(fl_error_message(), "ldc 3"));
    FL_CHECK(be.gemm_epilogue(&be, FL_GEMM_EPI_BIAS_GELU, x, x + 16, 2, 0, 1, 2, 2, 2, 1, x, FL_F32, 2, x, FL_F32, 2,
                              1.0f, x + 32, 2) == FL_ERR_INVALID && strstr(fl_error_message(), "beta"));
    FL_CHECK(be.gemm_epilogue(&be, FL_GEMM_EPI_BIAS, x, NULL, 0, 0, 1, 2, 2, 2, 1, x, FL_BF16, 2, x, FL_F32, 2, 0, x,
                              2) == FL_ERR_UNSUPPORTED);
    fl_backend_free(&be);
    /* FITLLM_CUDA_EPILOGUE=0: the same bits, never the fused path; another value is refused by name */
    setenv("FITLLM_CUDA_EPILOGUE", "0", 1);
    fl_status s = fl_backend_init_by_name("cuda-emu", &be, 1);
    unsetenv("FITLLM_CUDA_EPILOGUE");
    FL_REQUIRE_OK(s);
    epi_cases(&be, 0);
    out16_cases(&be, 0); /* composed: the fp32 result in aux, then rounded */
    {
        uint16_t h[64] = {0};
        FL_CHECK(be.gemm_epilogue(&be, FL_GEMM_EPI_BIAS | FL_GEMM_EPI_OUT_BF16, x, NULL, 0, 0, 1, 2, 2, 2, 1, h,
                                  FL_BF16, 2, h, FL_BF16, 2, 0, (float *)h + 8, 2) == FL_ERR_UNSUPPORTED &&
                 strstr(fl_error_message(), "aux"));
    }
    fl_backend_free(&be);
    setenv("FITLLM_CUDA_EPILOGUE", "on", 1);
    s = fl_backend_init_by_name("cuda-emu", &be, 1);
    unsetenv("FITLLM_CUDA_EPILOGUE");
    FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "FITLLM_CUDA_EPILOGUE=on"), "status %d: %s", (int)s,
              fl_error_message());
    if (s == FL_OK) fl_backend_free(&be);
}

/* The bias type (the 2026-11-30 H200 check): cuBLASLt takes an epilogue's bias of D's type only, and the stand-in
 * refuses the others as it does (fl_cu_gemm_lt_bias_ok, FL_ERR_UNSUPPORTED). The backend never asks for one: a bf16
 * store's bias with an fp32 output (bias, bias + GELU) and an fp32 bias with a bf16 output run fused all the same (the
 * bias widened first / the fp32 result in aux, then rounded), with the separate ops' bits, and the backend's
 * epilogues stay on after them (a refusal would have turned them off: the next fp32 case fused). */
FL_TEST(cuda_emu_gemm_epilogue_bias_type) {
    float a[6] = {1, 2, 3, 4, 5, 6}, c[4] = {0};
    uint16_t a16[6], b16[2] = {0x3f80, 0xbf00}, c16[4] = {0}; /* bf16 1, -0.5 */
    for (int i = 0; i < 6; i++) a16[i] = fl_f32_to_bf16(a[i]);
    FL_CHECK(fl_cu_gemm_rowmajor_epi(fl_cu_gemm_standin, NULL, FL_CU_EPI_BIAS, b16, FL_BF16, NULL, 2, 0, 1, 2, 2, 3,
                                     1.0f, a16, FL_BF16, 3, a16, FL_BF16, 3, 0.0f, c, FL_F32, 2) == FL_ERR_UNSUPPORTED &&
             strstr(fl_error_message(), "BF16 bias with a F32 D"));
    FL_CHECK(fl_cu_gemm_rowmajor_epi(fl_cu_gemm_standin, NULL, FL_CU_EPI_BIAS, a, FL_F32, NULL, 2, 0, 1, 2, 2, 3, 1.0f,
                                     a16, FL_BF16, 3, a16, FL_BF16, 3, 0.0f, c16, FL_BF16, 2) == FL_ERR_UNSUPPORTED &&
             strstr(fl_error_message(), "F32 bias with a BF16 D"));
    FL_CHECK(c[0] == 0 && c16[0] == 0); /* nothing written */
    FL_REQUIRE_OK(fl_cu_gemm_rowmajor_epi(fl_cu_gemm_standin, NULL, FL_CU_EPI_BIAS, b16, FL_BF16, NULL, 2, 0, 1, 2, 2, 3,
                                          1.0f, a16, FL_BF16, 3, a16, FL_BF16, 3, 0.0f, c16, FL_BF16, 2));
    FL_CHECK(c16[0] == fl_f32_to_bf16(1 + 4 + 9 + 1.0f) && c16[1] == fl_f32_to_bf16(4 + 10 + 18 - 0.5f));
    fl_backend be;
    FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
    int fused = -1;
    epi_case(&be, FL_GEMM_EPI_BIAS | FL_GEMM_EPI_BIAS_BF16, 0, FL_BF16, FL_BF16, 21, 0.0f, &fused);
    FL_CHECKF(fused == 1, "bf16 bias, fp32 output: fused %d", fused);
    epi_case(&be, FL_GEMM_EPI_BIAS_GELU | FL_GEMM_EPI_BIAS_BF16, 0, FL_BF16, FL_BF16, 21, 0.0f, &fused);
    FL_CHECKF(fused == 1, "bf16 bias + GELU, fp32 output: fused %d", fused);
    out16_case(&be, 11, 9, 21, 0, 1); /* an fp32 bias, a bf16 output */
    epi_case(&be, FL_GEMM_EPI_BIAS, 0, FL_F32, FL_F32, 21, 0.0f, &fused);
    FL_CHECKF(fused == 1, "the epilogues turned off after the mixed bias types (fused %d)", fused);
    fl_backend_free(&be);
}

/* Issue 30 item 3: bf16 activations' bias + GELU (fl_backend.gelu16_epilogue, FITLLM_CUDA_GELU16). The model stores
 * a biased linear's pre-activation and its GELU in bf16; the fused path (gemm_epilogue's bias + GELU, then round16
 * of both) takes the GELU of the fp32 pre-activation, the unfused one (gemm_epilogue's bias, then act_forward16 with
 * FL_ACT16_ROUND_IN) the GELU of the bf16-rounded one. Against a float64 evaluation of gelu(x W^T + b) over the same
 * bf16 operands, odd shapes: the fused output within one bf16 rounding (half an ulp, 2^-8 relative) plus the fp32
 * sum's bound (gamma_K of sum |x w|, GELU's slope <= 1.13) and 8 fp32 roundings of the GELU; its mean error at most
 * the unfused one's (the evidence for the default, printed with both maxima). The stored pre-activation (what the
 * backward's GELU gradient reads) is the unfused path's bit for bit, and act_backward16 over it is the float64
 * derivative at that stored value within 16 fp32 roundings. The switch: default 0, 1 on, another value refused. */
static double dgelu64(double x) {
    const double c = 0.7978845608028654, t = tanh(c * (x + 0.044715 * x * x * x));
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x);
}
static void round_pair(const fl_backend *be, uint16_t *d16, float *x, size_t n) {
    if (be->round16) {
        FL_CHECK(be->round16(be, d16, FL_BF16, x, n) == FL_OK);
        return;
    }
    for (size_t i = 0; i < n; i++) x[i] = fl_bf16_to_f32(d16[i] = fl_f32_to_bf16(x[i]));
}
static void gelu16_case(const fl_backend *be, int M, int N, int K, double *err_f, double *err_u, double *worst) {
    fl_test_rng rng = {0x9e1 + (uint64_t)M * 131 + (uint64_t)K};
    const float ws = 2.0f / sqrtf((float)K);
    float *x = fl_test_frand(&rng, (size_t)M * K, -1, 1), *w = fl_test_frand(&rng, (size_t)N * K, -ws, ws);
    float *bias = fl_test_frand(&rng, N, -1, 1), *dout = fl_test_frand(&rng, (size_t)M * N, -1, 1);
    uint16_t *X = typed(x, (size_t)M * K, FL_BF16), *W = typed(w, (size_t)N * K, FL_BF16);
    const size_t n = (size_t)M * N;
    float *pre = malloc(n * 4), *out = malloc(n * 4), *pre_u = malloc(n * 4), *out_u = malloc(n * 4), *din = calloc(n, 4);
    uint16_t *pre16 = malloc(n * 2), *out16 = malloc(n * 2), *pre16_u = malloc(n * 2), *out16_u = malloc(n * 2);
    FL_REQUIRE(x && w && bias && dout && X && W && pre && out && pre_u && out_u && din && pre16 && out16 && pre16_u &&
               out16_u);
    /* fused: gemm_epilogue's bias + GELU, both then stored (exec.c) */
    FL_CHECK(be->gemm_epilogue(be, FL_GEMM_EPI_BIAS_GELU, bias, pre, N, 0, 1, M, N, K, 1.0f, X, FL_BF16, K, W, FL_BF16,
                               K, 0.0f, out, N) == FL_OK);
    round_pair(be, out16, out, n);
    round_pair(be, pre16, pre, n);
    /* unfused: the bias in the GEMM, the pre-activation rounded by the GELU that reads it */
    FL_CHECK(be->gemm_epilogue(be, FL_GEMM_EPI_BIAS, bias, NULL, 0, 0, 1, M, N, K, 1.0f, X, FL_BF16, K, W, FL_BF16, K,
                               0.0f, pre_u, N) == FL_OK);
    FL_CHECK(be->act_forward16(be, FL_ACT16_GELU | FL_ACT16_ROUND_IN, out_u, out16_u, pre_u, pre16_u, M, N) == FL_OK);
    FL_CHECKF(!memcmp(pre16, pre16_u, n * 2) && !memcmp(pre, pre_u, n * 4),
              "%d x %d x %d: the stored pre-activation differs from the unfused path's", M, N, K);
    int ok = 1, bwd_ok = 1;
    double sf = 0, su = 0;
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double p = bias[j], a = fabs(bias[j]);
            for (int k = 0; k < K; k++) {
                const double t = (double)fl_bf16_to_f32(X[(size_t)i * K + k]) * fl_bf16_to_f32(W[(size_t)j * K + k]);
                p += t, a += fabs(t);
            }
            const size_t e = (size_t)i * N + j;
            const double ref = gelu64(p), ef = fabs(out[e] - ref), eu = fabs(out_u[e] - ref);
            const double bound = 0x1p-8 * fabs(ref) + 1.13 * (K + 1) * 0x1p-24 * a + 8 * 0x1p-24 * (fabs(ref) + fabs(p));
            ok &= ef <= bound && out[e] == fl_bf16_to_f32(out16[e]);
            if (ef / bound > *worst) *worst = ef / bound;
            sf += ef, su += eu;
            if (ef > err_f[1]) err_f[1] = ef;
            if (eu > err_u[1]) err_u[1] = eu;
        }
    err_f[0] += sf, err_u[0] += su, err_f[2] += (double)n;
    FL_CHECKF(ok, "%d x %d x %d: the fused bf16 GELU beyond its bound (worst %.3g of it)", M, N, K, *worst);
    /* the backward's GELU gradient from the stored pre-activation */
    FL_CHECK(be->act_backward16(be, FL_ACT16_GELU, din, NULL, dout, pre, pre16, M, N) == FL_OK);
    for (size_t e = 0; e < n; e++) {
        const double xp = fl_bf16_to_f32(pre16[e]), ref = dgelu64(xp) * dout[e];
        bwd_ok &= fabs(din[e] - ref) <= 16 * 0x1p-24 * fabs(dout[e]) * (1.0 + fabs(xp));
    }
    FL_CHECKF(bwd_ok, "%d x %d x %d: the GELU gradient is not the derivative at the stored pre-activation", M, N, K);
    free(x), free(w), free(bias), free(dout), free(X), free(W), free(pre), free(out), free(pre_u), free(out_u);
    free(din), free(pre16), free(out16), free(pre16_u), free(out16_u);
}

FL_TEST(cuda_emu_gemm_epilogue_gelu16) {
    fl_backend be;
    FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
    FL_REQUIRE(be.gemm_epilogue && be.act_forward16 && be.act_backward16);
    static const int sh[][3] = {{37, 45, 67}, {3, 129, 17}, {65, 33, 255}, {1, 7, 1}};
    double ef[3] = {0}, eu[3] = {0}, worst = 0;
    for (size_t c = 0; c < sizeof sh / sizeof sh[0]; c++) gelu16_case(&be, sh[c][0], sh[c][1], sh[c][2], ef, eu, &worst);
    printf("      bf16 GELU vs float64 over %.0f outputs: from the fp32 pre-activation mean %.3g max %.3g (worst %.2f of "
           "its bound), from the bf16-rounded one mean %.3g max %.3g\n", ef[2], ef[0] / ef[2], ef[1], worst,
           eu[0] / ef[2], eu[1]);
    FL_CHECKF(ef[0] <= eu[0], "the fused GELU is further from float64 (mean %.3g) than the unfused (%.3g)",
              ef[0] / ef[2], eu[0] / ef[2]);
    FL_CHECK(be.gelu16_epilogue == 0); /* the default */
    fl_backend_free(&be);
    /* the switch: 1 on, another value refused by name; the CPU backends never take it */
    setenv("FITLLM_CUDA_GELU16", "1", 1);
    fl_status s = fl_backend_init_by_name("cuda-emu", &be, 1);
    FL_REQUIRE_OK(s);
    FL_CHECK(be.gelu16_epilogue == 1);
    fl_backend_free(&be);
    setenv("FITLLM_CUDA_GELU16", "yes", 1);
    s = fl_backend_init_by_name("cuda-emu", &be, 1);
    unsetenv("FITLLM_CUDA_GELU16");
    FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "FITLLM_CUDA_GELU16=yes"), "status %d: %s", (int)s,
              fl_error_message());
    if (s == FL_OK) fl_backend_free(&be);
    FL_REQUIRE_OK(fl_backend_init_by_name("cpu", &be, 1));
    FL_CHECK(be.gelu16_epilogue == 0);
    fl_backend_free(&be);
}
#endif

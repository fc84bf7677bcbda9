/* fitllm_cuda_check, issue 30 item 3: cuBLASLt's epilogues (bias; bias + GELU with the pre-activation in aux)
 * against the stand-in's (the emulator's bits: tests/test_cuda_epilogue.c), fp32 and bf16 operands; and the
 * per-shape bench of bench-step --profile (fl_cu_gemm_cublaslt_bench) at a TinyLlama MLP shape, printed with its
 * TFLOP/s. Tolerances: the GEMM's sums in another order (relative 1e-5 of the largest value, as cuda_check.c's
 * gemm), and cuBLASLt's GELU is its own fp32 evaluation of the tanh form (2e-5 of the largest value). */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cu_gemm.h"
#include "fitllm/dtype.h"

static int epi_fail;

static float *rnd(unsigned *s, size_t n) {
    float *x = malloc(n * sizeof *x);
    for (size_t i = 0; i < n; i++) {
        *s = *s * 1664525u + 1013904223u;
        x[i] = -1.0f + 2.0f * (float)(*s >> 8) / 16777216.0f;
    }
    return x;
}
static void *dev(const void *h, size_t bytes) {
    void *d = NULL;
    if (cudaMalloc(&d, bytes ? bytes : 1) != cudaSuccess) return NULL;
    if (h) cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
    return d;
}
static void cmp(const char *what, const float *gpu, const float *ref, size_t n, double rel) {
    double mx = 0, worst = 0;
    for (size_t i = 0; i < n; i++) mx = fmax(mx, fabs(ref[i]));
    for (size_t i = 0; i < n; i++) worst = fmax(worst, fabs((double)gpu[i] - ref[i]) / (mx > 0 ? mx : 1));
    const int ok = worst <= rel;
    printf("%-44s %s  (max |diff| / max|ref| = %.2e)\n", what, ok ? "ok  " : "FAIL", worst);
    if (!ok) epi_fail++;
}

/* row-major C (M, N) = A (M, K) B^T (B stored N x K) + bias [-> GELU], through cuBLASLt and the stand-in; bt the
 * bias's type (BF16: BIAS_DATA_TYPE), tc C's (BF16: a bf16 D with the bias epilogue; issue 30 item 1). A bias of
 * another type than D's: both must refuse it (fl_cu_gemm_lt_bias_ok), then the backend's way is compared (prod):
 * a BF16 bias widened to fp32 (exact: the convert kernel's bits), fused with an F32 D; an F32 bias fused with the F32
 * D aux, then rounded to bf16 (RNE: the convert kernel's bits) */
static void epi_case_t(fl_cu_blas *b, int epi, fl_dtype t, float beta, fl_dtype bt, fl_dtype tc);
static void epi_case_refused(fl_cu_blas *b, int epi, fl_dtype t, float beta, fl_dtype bt, fl_dtype tc, fl_status hs,
                             fl_status ds, const char *what) {
    const int refused = hs == FL_ERR_UNSUPPORTED && ds == FL_ERR_UNSUPPORTED;
    if (refused) printf("%-44s ok    (refused as cuBLASLt does)\n", what);
    else {
        printf("%-44s FAIL  (the stand-in %s, cuBLASLt %s: fl_cu_gemm_lt_bias_ok no longer models cuBLASLt)\n", what,
               hs == FL_OK ? "ran it" : "refused it", ds == FL_OK ? "ran it" : "refused it");
        epi_fail++;
    }
    epi_case_t(b, epi | 0x100, t, beta, bt, tc); /* the backend's way (0x100: prod) */
}
static void epi_case_t(fl_cu_blas *b, int epi, fl_dtype t, float beta, fl_dtype bt, fl_dtype tc) {
    const int prod = epi & 0x100; /* a refused combination's production path: a bias or D of the other's type */
    epi &= 0xff;
    enum { M = 67, N = 96, K = 80 };
    unsigned s = 11u + (unsigned)epi * 7u + (unsigned)t;
    float *A = rnd(&s, (size_t)M * K), *B = rnd(&s, (size_t)N * K), *bias = rnd(&s, N), *C0 = rnd(&s, (size_t)M * N);
    uint16_t *bias16 = malloc((size_t)N * 2), *C16 = malloc((size_t)M * N * 2);
    for (int j = 0; j < N; j++) bias16[j] = fl_f32_to_bf16(bias[j]);
    if (prod && bt == FL_BF16) /* the widened bf16 bias */
        for (int j = 0; j < N; j++) bias[j] = fl_bf16_to_f32(bias16[j]);
    const int round_d = prod && tc == FL_BF16; /* F32 D, then rounded to bf16 */
    if (prod) bt = FL_F32, tc = FL_F32;
    const void *hb = bt == FL_BF16 ? (const void *)bias16 : bias;
    const size_t bbytes = (size_t)N * fl_dtype_size(bt);
    const size_t es = fl_dtype_size(t);
    void *Ah = malloc((size_t)M * K * es), *Bh = malloc((size_t)N * K * es);
    for (size_t i = 0; i < (size_t)M * K; i++) {
        if (t == FL_BF16) ((uint16_t *)Ah)[i] = fl_f32_to_bf16(A[i]);
        else ((float *)Ah)[i] = A[i];
    }
    for (size_t i = 0; i < (size_t)N * K; i++) {
        if (t == FL_BF16) ((uint16_t *)Bh)[i] = fl_f32_to_bf16(B[i]);
        else ((float *)Bh)[i] = B[i];
    }
    float *C = malloc((size_t)M * N * 4), *X = malloc((size_t)M * N * 4), *G = malloc((size_t)M * N * 4);
    float *GX = malloc((size_t)M * N * 4);
    memcpy(C, C0, (size_t)M * N * 4);
    const int cu = epi == 2 ? FL_CU_EPI_GELU_AUX_BIAS : FL_CU_EPI_BIAS;
    const int d16 = tc == FL_BF16;
    fl_status hs = fl_cu_gemm_rowmajor_epi(fl_cu_gemm_standin, NULL, cu, hb, bt, X, N, 0, 1, M, N, K, 1.0f, Ah, t, K,
                                           Bh, t, K, beta, d16 ? (void *)C16 : C, tc, N);
    void *dA = dev(Ah, (size_t)M * K * es), *dB = dev(Bh, (size_t)N * K * es), *dC = dev(C0, (size_t)M * N * 4);
    void *dbias = dev(hb, bbytes), *dX = dev(NULL, (size_t)M * N * 4);
    fl_status ds = fl_cu_gemm_rowmajor_epi(fl_cu_gemm_cublaslt, b, cu, dbias, bt, dX, N, 0, 1, M, N, K, 1.0f, dA, t, K,
                                           dB, t, K, beta, dC, tc, N);
    char what[96];
    if (prod)
        snprintf(what, sizeof what, "  its backend path (%s)", round_d ? "fp32 D, rounded" : "bias widened");
    else
        snprintf(what, sizeof what, "gemm epilogue %s %s%s%s beta %g (cuBLASLt)", epi == 2 ? "bias+gelu" : "bias",
                 fl_dtype_name(t), bt == FL_BF16 ? " bf16-bias" : "", d16 ? " bf16-D" : "", (double)beta);
    if (!prod && bt != tc) {
        (void)cudaDeviceSynchronize();
        epi_case_refused(b, epi, t, beta, bt, tc, hs, ds, what);
    } else if (hs != FL_OK || ds != FL_OK || cudaDeviceSynchronize() != cudaSuccess) {
        printf("%-44s FAIL  (%s)\n", what, fl_error_message());
        epi_fail++;
    } else {
        if (d16) { /* both rounded to bf16: sums a few fp32 ulps apart may round to neighbouring bf16 values: one bf16 ulp
                    * (2^-7 relative to the largest) */
            uint16_t *G16 = malloc((size_t)M * N * 2);
            cudaMemcpy(G16, dC, (size_t)M * N * 2, cudaMemcpyDeviceToHost);
            for (size_t i = 0; i < (size_t)M * N; i++) G[i] = fl_bf16_to_f32(G16[i]), C[i] = fl_bf16_to_f32(C16[i]);
            free(G16);
        } else
            cudaMemcpy(G, dC, (size_t)M * N * 4, cudaMemcpyDeviceToHost);
        if (round_d) /* the convert kernel's RNE of both fp32 results */
            for (size_t i = 0; i < (size_t)M * N; i++)
                G[i] = fl_bf16_to_f32(fl_f32_to_bf16(G[i])), C[i] = fl_bf16_to_f32(fl_f32_to_bf16(C[i]));
        cmp(what, G, C, (size_t)M * N, d16 || round_d ? 0x1p-7 : epi == 2 ? 2e-5 : 1e-5);
        if (epi == 2) {
            cudaMemcpy(GX, dX, (size_t)M * N * 4, cudaMemcpyDeviceToHost);
            cmp("  its aux (the pre-activation)", GX, X, (size_t)M * N, 1e-5);
        }
    }
    cudaFree(dA), cudaFree(dB), cudaFree(dC), cudaFree(dbias), cudaFree(dX);
    free(A), free(B), free(bias), free(C0), free(Ah), free(Bh), free(C), free(X), free(G), free(GX);
    free(bias16), free(C16);
}
static void epi_case(fl_cu_blas *b, int epi, fl_dtype t, float beta) { epi_case_t(b, epi, t, beta, FL_F32, FL_F32); }

int fl_cuda_check_gemm_epi(void) {
    epi_fail = 0;
    const size_t ws_bytes = 32u << 20;
    void *ws = dev(NULL, ws_bytes);
    fl_cu_blas b;
    if (!ws || fl_cu_blas_init(&b, ws, ws_bytes, NULL) != FL_OK) {
        printf("gemm epilogues: cuBLASLt did not start: FAIL\n");
        return 1;
    }
    epi_case(&b, 1, FL_F32, 0.0f);
    epi_case(&b, 1, FL_F32, 0.5f);
    epi_case(&b, 1, FL_BF16, 0.0f);
    epi_case(&b, 2, FL_F32, 0.0f);
    epi_case(&b, 2, FL_BF16, 0.0f);
    epi_case_t(&b, 1, FL_BF16, 0.0f, FL_BF16, FL_F32);  /* a bf16 model's stored bias */
    epi_case_t(&b, 2, FL_BF16, 0.0f, FL_BF16, FL_F32);
    epi_case_t(&b, 1, FL_BF16, 0.0f, FL_BF16, FL_BF16); /* c_attn: its output in bf16 only */
    epi_case_t(&b, 1, FL_BF16, 0.0f, FL_F32, FL_BF16);  /* bf16-mixed: an fp32 bias, a bf16 D */
    /* the per-shape bench: TinyLlama's gate|up GEMM of a B 4 T 2048 step, bf16 -> fp32 (row-major 8192 x 11264 x 2048) */
    const int M = 8192, N = 11264, K = 2048;
    void *dA = dev(NULL, (size_t)M * K * 2), *dB = dev(NULL, (size_t)N * K * 2), *dC = dev(NULL, (size_t)M * N * 4);
    if (dA && dB && dC) {
        cudaMemset(dA, 0x3c, (size_t)M * K * 2); /* bf16 0x3c3c ~ 0.0115: nonzero operands */
        cudaMemset(dB, 0x3c, (size_t)N * K * 2);
        fl_cu_gemm_desc d;
        fl_cu_gemm_desc_rowmajor(&d, 0, 1, M, N, K, 1.0f, dA, FL_BF16, K, dB, FL_BF16, K, 0.0f, dC, FL_F32, N);
        double best = -1, first = -1;
        int n = 0;
        fl_status s = fl_cu_gemm_cublaslt_bench(&b, &d, 10, &best, &first, &n);
        const double fl = 2.0 * M * N * (double)K;
        const int ok = s == FL_OK && n >= 1 && best > 0 && best <= first;
        printf("%-44s %s  (%d algorithms: best %.1f TFLOP/s, the heuristic's first %.1f)\n",
               "gemm bench 8192x11264x2048 bf16 (cuBLASLt)", ok ? "ok  " : "FAIL", n, ok ? fl / best / 1e9 : 0.0,
               ok ? fl / first / 1e9 : 0.0);
        if (!ok) epi_fail++;
    }
    cudaFree(dA), cudaFree(dB), cudaFree(dC);
    fl_cu_blas_free(&b);
    cudaFree(ws);
    return epi_fail;
}

/* fitllm selftest (src/backend/selftest.c): the CPU backend against the reference, the CUDA
 * backend's own code under the emulator against the CPU backend, and proof that the bounds are
 * not vacuous (a backend with one op perturbed by a small relative error fails). */
#include <stdio.h>
#include <string.h>

#include "fitllm/selftest.h"
#include "test.h"

static void run_pair(const char *dev_name, const char *ref_name) {
    fl_backend dev, ref;
    FL_REQUIRE_OK(fl_backend_init_by_name(dev_name, &dev, 2));
    FL_REQUIRE_OK(fl_backend_init_by_name(ref_name, &ref, 2));
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    fl_selftest_result r;
    fl_status s = fl_backend_selftest(&dev, &ref, NULL, 1, f, &r);
    fclose(f);
    FL_CHECK(s == FL_OK);
    FL_CHECKF(r.n_cases >= 40, "%s: only %d cases ran", dev_name, r.n_cases);
    FL_CHECKF(r.n_fail == 0, "%s vs %s: %d of %d cases failed:\n%s", dev_name, ref_name, r.n_fail, r.n_cases, buf);
    /* the optional bf16-gradient cross-entropy is checked where the backend has it */
    FL_CHECKF(!dev.cross_entropy_dbf16 || (buf && strstr(buf, "cross_entropy_dbf16 5x1001")), "%s: no cross_entropy_dbf16 "
              "case:\n%s", dev_name, buf);
    /* tensor parallelism's ops (issue 35), on every backend that has them */
    FL_CHECKF(!dev.vocab_xent || (buf && strstr(buf, "vocab_xent 5x1001 over 3 slices") &&
                                  strstr(buf, "dropout_rows 13x37 stride 111")),
              "%s: no vocab_xent / dropout_rows case:\n%s", dev_name, buf);
    free(buf);
    fl_backend_free(&dev);
    fl_backend_free(&ref);
}

FL_TEST(selftest_cpu_vs_ref) { run_pair("cpu", "ref"); }

FL_TEST(selftest_cuda_emu_vs_cpu) {
#ifdef FL_HAVE_CUDA_EMU
    run_pair("cuda-emu", "cpu");
#else
    fl_test_skip("no C++ compiler for the CUDA emulator in this build");
#endif
}

/* rmsnorm_forward off by a relative 1e-4 (about 1700 fp32 ulps: inside the 1e-3 a tolerance
 * picked by eye would allow, 10x outside the error bound of a 40-term norm) */
static void (*g_rms)(const fl_backend *, float *, float *, const float *, const float *, int, int, float);
static void rms_perturbed(const fl_backend *be, float *out, float *rstd, const float *inp, const float *w, int N, int C,
                          float eps) {
    g_rms(be, out, rstd, inp, w, N, C, eps);
    for (int i = 0; i < N * C; i++) out[i] *= 1.0f + 1e-4f;
}
/* gemm: one element of C off by 1e-4 relative */
static fl_status (*g_gemm)(const fl_backend *, int, int, int, int, int, float, const void *, fl_dtype, int, const void *,
                           fl_dtype, int, float, void *, fl_dtype, int);
static fl_status gemm_perturbed(const fl_backend *be, int ta, int tb, int M, int N, int K, float alpha, const void *A,
                                fl_dtype tA, int lda, const void *B, fl_dtype tB, int ldb, float beta, void *C, fl_dtype tC,
                                int ldc) {
    fl_status s = g_gemm(be, ta, tb, M, N, K, alpha, A, tA, lda, B, tB, ldb, beta, C, tC, ldc);
    if (tC == FL_F32 && M > 3 && N > 3) ((float *)C)[3 * ldc + 2] *= 1.0f + 1e-4f;
    return s;
}

FL_TEST(selftest_detects_small_errors) {
    fl_backend dev, ref;
    FL_REQUIRE_OK(fl_backend_init_by_name("cpu", &dev, 2));
    FL_REQUIRE_OK(fl_backend_init_by_name("ref", &ref, 1));
    g_rms = dev.rmsnorm_forward;
    dev.rmsnorm_forward = rms_perturbed;
    g_gemm = dev.gemm;
    dev.gemm = gemm_perturbed;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    fl_selftest_result r;
    FL_CHECK(fl_backend_selftest(&dev, &ref, NULL, 1, f, &r) == FL_OK);
    fclose(f);
    /* every F32-output GEMM case (7) and the two norm cases that use rmsnorm_forward fail */
    const char *line = strstr(buf, "rmsnorm_forward 19x40");
    const char *eol = line ? strchr(line, '\n') : NULL;
    const char *fail = line ? strstr(line, "FAIL") : NULL;
    FL_CHECKF(line && eol && fail && fail < eol, "the perturbed rmsnorm_forward was not caught:\n%s", buf);
    FL_CHECKF(r.n_fail >= 9, "only %d cases failed with two perturbed ops:\n%s", r.n_fail, buf);
    free(buf);
    fl_backend_free(&dev);
    fl_backend_free(&ref);
}

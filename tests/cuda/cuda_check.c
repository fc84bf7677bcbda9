/* fitllm_cuda_check: the real CUDA kernels (nvcc objects, fl_cuk_*) against the same sources
 * under the CPU emulator (fl_cuemu_*, which tests/test_cuda_emu.c checks against the CPU backend
 * and float64 references), on the first visible GPU. Built only with FL_CUDA; run by `make test`.
 * Without a visible device it says so and exits 0 (nothing to check). Tolerances: the GPU may
 * contract multiply-adds into FMAs and sums in another order (block size is the same, but expf
 * and division are not the host's bits), so results are compared with relative 1e-5 (values) and
 * the finite-difference tolerance of test_ops.c (gradients); conversions must be bit-identical.
 * This is the seed of `fitllm selftest --accelerator cuda` (issue 15). */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cu_gemm.h"
#include "backend/cuda/cu_kernels.h"
#include "backend/cuda/emu/cu_emu.h"
#include "fitllm/cuda.h"

int fl_cuda_check_attn(void); /* check_attn.c: the attention kernels */

static int g_fail;
/* the norm backwards' / cross-entropy's work (FL_CU_NORM_WORK_BYTES): the device's, the emulator's (host memory);
 * check_vec16.c and check_normce.c use them too */
void *g_dev_work, *g_emu_work;

int fl_cuda_check_more(void); /* tests/cuda/check_more.c: the cu_kernels_train.h kernels */
int fl_cuda_check_fused(void); /* tests/cuda/check_fused.c: issue 30 item 4's fused and 128-bit kernels */
int fl_cuda_check_gemm_epi(void); /* tests/cuda/check_gemm_epi.c: issue 30 item 3's epilogues and GEMM bench */
int fl_cuda_check_vec16(void); /* tests/cuda/check_vec16.c: LayerNorm w16, the 128-bit elementwise paths */
int fl_cuda_check_ss(void);    /* tests/cuda/check_ss.c: the step scalars (norm, clip scale, loss sums) */
int fl_cuda_check_normce(void); /* tests/cuda/check_normce.c: the split column sums and cross-entropy */

static void *dev_copy(const void *h, size_t bytes) {
    void *d = NULL;
    if (cudaMalloc(&d, bytes ? bytes : 1) != cudaSuccess) { fprintf(stderr, "cudaMalloc failed\n"); exit(1); }
    if (h) cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
    return d;
}
static void to_host(void *h, const void *d, size_t bytes) {
    if (cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) { fprintf(stderr, "cudaMemcpy failed\n"); exit(1); }
}
static float *frand(unsigned *s, size_t n, float lo, float hi) {
    float *x = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        *s = *s * 1664525u + 1013904223u;
        x[i] = lo + (hi - lo) * (float)(*s >> 8) / 16777216.0f;
    }
    return x;
}
static void report(const char *op, const float *gpu, const float *emu, size_t n, double rtol, double atol_rel_max) {
    double mx = 0, worst = 0;
    for (size_t i = 0; i < n; i++) mx = fmax(mx, fabs(emu[i]));
    int ok = 1;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)gpu[i] - emu[i]);
        worst = fmax(worst, d / (mx > 0 ? mx : 1));
        if (!(d <= rtol * fabs(emu[i]) + atol_rel_max * (1 + mx))) ok = 0;
    }
    printf("%-28s %s  (max |diff| / max|ref| = %.2e)\n", op, ok ? "ok  " : "FAIL", worst);
    if (!ok) g_fail++;
}

static void check_rmsnorm(int N, int C) {
    unsigned s = 1;
    float *x = frand(&s, (size_t)N * C, -2, 2), *w = frand(&s, C, 0.5f, 1.5f), *dy = frand(&s, (size_t)N * C, -1, 1);
    size_t nc = (size_t)N * C;
    float *out = malloc(nc * 4), *rstd = malloc(N * 4), *dx = calloc(nc, 4), *dw = calloc(C, 4);
    fl_cuemu_rmsnorm_forward(out, rstd, x, w, N, C, 1e-5f, NULL);
    fl_cuemu_rmsnorm_backward(dx, dw, dy, x, w, rstd, N, C, g_emu_work, NULL);
    float *dX = dev_copy(x, nc * 4), *dW = dev_copy(w, C * 4), *dDY = dev_copy(dy, nc * 4), *dO = dev_copy(NULL, nc * 4);
    float *dR = dev_copy(NULL, N * 4), *dDX = dev_copy(NULL, nc * 4), *dDW = dev_copy(NULL, C * 4);
    cudaMemset(dDX, 0, nc * 4);
    cudaMemset(dDW, 0, C * 4);
    int rc = fl_cuk_rmsnorm_forward(dO, dR, dX, dW, N, C, 1e-5f, NULL);
    rc |= fl_cuk_rmsnorm_backward(dDX, dDW, dDY, dX, dW, dR, N, C, g_dev_work, NULL);
    if (rc || cudaDeviceSynchronize() != cudaSuccess) { printf("rmsnorm: launch failed\n"); g_fail++; return; }
    float *g = malloc(nc * 4);
    to_host(g, dO, nc * 4); report("rmsnorm_forward out", g, out, nc, 1e-5, 1e-6);
    to_host(g, dDX, nc * 4); report("rmsnorm_backward dinp", g, dx, nc, 2e-4, 2e-5);
    to_host(g, dDW, C * 4); report("rmsnorm_backward dw", g, dw, C, 2e-4, 2e-5);
    cudaFree(dX); cudaFree(dW); cudaFree(dDY); cudaFree(dO); cudaFree(dR); cudaFree(dDX); cudaFree(dDW);
    free(x); free(w); free(dy); free(out); free(rstd); free(dx); free(dw); free(g);
}

static void check_xent(int N, int V) {
    unsigned s = 2;
    size_t nv = (size_t)N * V;
    float *x = frand(&s, nv, -3, 3), *loss = malloc(N * 4), *dl = malloc(nv * 4);
    int32_t *tg = malloc(N * 4);
    for (int n = 0; n < N; n++) tg[n] = n == 1 ? -100 : (int32_t)((n * 7919) % V);
    fl_cuemu_cross_entropy(loss, dl, x, tg, N, V, 0.37f, -100, g_emu_work, NULL);
    float *dX = dev_copy(x, nv * 4), *dL = dev_copy(NULL, N * 4), *dDL = dev_copy(NULL, nv * 4);
    int32_t *dT = dev_copy(tg, N * 4);
    if (fl_cuk_cross_entropy(dL, dDL, dX, dT, N, V, 0.37f, -100, g_dev_work, NULL) || cudaDeviceSynchronize() != cudaSuccess) {
        printf("cross_entropy: launch failed\n"); g_fail++; return;
    }
    float *g = malloc(nv * 4);
    to_host(g, dL, N * 4); report("cross_entropy loss", g, loss, N, 1e-5, 1e-6);
    to_host(g, dDL, nv * 4); report("cross_entropy dlogits", g, dl, nv, 2e-4, 2e-5);
    cudaFree(dX); cudaFree(dL); cudaFree(dDL); cudaFree(dT);
    free(x); free(loss); free(dl); free(tg); free(g);
}

static void check_adamw(size_t n) {
    unsigned s = 3;
    float *p = frand(&s, n, -1, 1), *g = frand(&s, n, -2, 2), *m = calloc(n, 4), *v = calloc(n, 4);
    float *dP = dev_copy(p, n * 4), *dG = dev_copy(g, n * 4), *dM = dev_copy(m, n * 4), *dV = dev_copy(v, n * 4);
    for (int step = 1; step <= 3; step++) {
        fl_cuemu_adamw_update(p, g, m, v, n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 0.5f, NULL);
        if (fl_cuk_adamw_update(dP, dG, dM, dV, n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 0.5f, NULL)) g_fail++;
    }
    cudaDeviceSynchronize();
    float *h = malloc(n * 4);
    to_host(h, dP, n * 4); report("adamw_update p", h, p, n, 1e-5, 1e-7);
    to_host(h, dM, n * 4); report("adamw_update m", h, m, n, 1e-5, 1e-7);
    cudaFree(dP); cudaFree(dG); cudaFree(dM); cudaFree(dV);
    free(p); free(g); free(m); free(v); free(h);
}

static void check_convert(size_t n) {
    unsigned s = 4;
    float *x = frand(&s, n, -70000, 70000);
    uint16_t *hb = malloc(n * 2), *gb = malloc(n * 2);
    float *dX = dev_copy(x, n * 4);
    uint16_t *dB = dev_copy(NULL, n * 2);
    int bad = 0;
    const fl_dtype t16[2] = {FL_BF16, FL_F16};
    for (int k = 0; k < 2; k++) {
        fl_cuemu_convert(hb, t16[k], x, FL_F32, n, NULL);
        if (fl_cuk_convert(dB, t16[k], dX, FL_F32, n, NULL) || cudaDeviceSynchronize() != cudaSuccess) bad = 1;
        to_host(gb, dB, n * 2);
        bad |= memcmp(gb, hb, n * 2) != 0;
    }
    printf("%-28s %s\n", "convert f32->bf16/f16 bits", bad ? "FAIL" : "ok");
    g_fail += bad;
    cudaFree(dX); cudaFree(dB);
    free(x); free(hb); free(gb);
}

static void check_gemm(void) {
    /* row-major C(7,13) = A(7,11) @ B^T (B stored 13 x 11), through cuBLASLt and the stand-in */
    const int M = 7, N = 13, K = 11;
    unsigned s = 5;
    float *A = frand(&s, (size_t)M * K, -1, 1), *B = frand(&s, (size_t)N * K, -1, 1), *C = calloc((size_t)M * N, 4);
    float *G = malloc((size_t)M * N * 4);
    fl_cu_gemm_rowmajor(fl_cu_gemm_standin, NULL, 0, 1, M, N, K, 1.0f, A, FL_F32, K, B, FL_F32, K, 0.0f, C, FL_F32, N,
                        1, 0, 0, 0);
    float *dA = dev_copy(A, (size_t)M * K * 4), *dB = dev_copy(B, (size_t)N * K * 4), *dC = dev_copy(NULL, (size_t)M * N * 4);
    void *ws = dev_copy(NULL, 32u << 20);
    fl_cu_blas b;
    if (fl_cu_blas_init(&b, ws, 32u << 20, NULL) != FL_OK ||
        fl_cu_gemm_rowmajor(fl_cu_gemm_cublaslt, &b, 0, 1, M, N, K, 1.0f, dA, FL_F32, K, dB, FL_F32, K, 0.0f, dC,
                            FL_F32, N, 1, 0, 0, 0) != FL_OK ||
        cudaDeviceSynchronize() != cudaSuccess) {
        printf("gemm (cuBLASLt): failed\n");
        g_fail++;
    } else {
        to_host(G, dC, (size_t)M * N * 4);
        report("gemm fp32 (cuBLASLt, A B^T)", G, C, (size_t)M * N, 1e-5, 1e-6);
    }
    fl_cu_blas_free(&b);
    cudaFree(dA); cudaFree(dB); cudaFree(dC); cudaFree(ws);
    free(A); free(B); free(C); free(G);
}

static void check_layernorm(int N, int C) {
    unsigned s = 6;
    size_t nc = (size_t)N * C;
    float *x = frand(&s, nc, -2, 2), *w = frand(&s, C, 0.5f, 1.5f), *b = frand(&s, C, -1, 1), *dy = frand(&s, nc, -1, 1);
    float *out = malloc(nc * 4), *mean = malloc(N * 4), *rstd = malloc(N * 4), *dx = calloc(nc, 4), *dw = calloc(C, 4);
    float *db = calloc(C, 4);
    fl_cuemu_layernorm_forward(out, mean, rstd, x, w, b, N, C, 1e-5f, NULL);
    fl_cuemu_layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, N, C, g_emu_work, NULL);
    float *dX = dev_copy(x, nc * 4), *dW = dev_copy(w, C * 4), *dB = dev_copy(b, C * 4), *dDY = dev_copy(dy, nc * 4);
    float *dO = dev_copy(NULL, nc * 4), *dM = dev_copy(NULL, N * 4), *dR = dev_copy(NULL, N * 4);
    float *dDX = dev_copy(NULL, nc * 4), *dDW = dev_copy(NULL, C * 4), *dDB = dev_copy(NULL, C * 4);
    cudaMemset(dDX, 0, nc * 4);
    cudaMemset(dDW, 0, C * 4);
    cudaMemset(dDB, 0, C * 4);
    int rc = fl_cuk_layernorm_forward(dO, dM, dR, dX, dW, dB, N, C, 1e-5f, NULL);
    rc |= fl_cuk_layernorm_backward(dDX, dDW, dDB, dDY, dX, dW, dM, dR, N, C, g_dev_work, NULL);
    if (rc || cudaDeviceSynchronize() != cudaSuccess) { printf("layernorm: launch failed\n"); g_fail++; return; }
    float *g = malloc(nc * 4);
    to_host(g, dO, nc * 4); report("layernorm_forward out", g, out, nc, 1e-5, 1e-6);
    to_host(g, dDX, nc * 4); report("layernorm_backward dinp", g, dx, nc, 2e-4, 2e-5);
    to_host(g, dDW, C * 4); report("layernorm_backward dw", g, dw, C, 2e-4, 2e-5);
    to_host(g, dDB, C * 4); report("layernorm_backward db", g, db, C, 2e-4, 2e-5);
    cudaFree(dX); cudaFree(dW); cudaFree(dB); cudaFree(dDY); cudaFree(dO); cudaFree(dM); cudaFree(dR);
    cudaFree(dDX); cudaFree(dDW); cudaFree(dDB);
    free(x); free(w); free(b); free(dy); free(out); free(mean); free(rstd); free(dx); free(dw); free(db); free(g);
}

static void check_sumsq(size_t n) {
    unsigned s = 7;
    float *x = frand(&s, n, -3, 3);
    double want = 0, work[FL_CU_SUMSQ_PARTS], emu = 0, got = 0;
    for (size_t i = 0; i < n; i++) want += (double)x[i] * x[i];
    fl_cuemu_sumsq_ex(&emu, work, x, FL_F32, n, NULL);
    float *dX = dev_copy(x, n * 4);
    double *dOut = dev_copy(NULL, sizeof(double)), *dWork = dev_copy(NULL, FL_CU_SUMSQ_PARTS * sizeof(double));
    if (fl_cuk_sumsq_ex(dOut, dWork, dX, FL_F32, n, NULL) || cudaDeviceSynchronize() != cudaSuccess) {
        printf("sumsq_ex: launch failed\n"); g_fail++; return;
    }
    to_host(&got, dOut, sizeof got);
    /* the same partition and order as the emulator, but nvcc may fuse s += v*v into an FMA: close, not
     * necessarily the same bits (printed). Any order of summing n non-negative doubles is within
     * (n - 1) * 2^-53 * sum of the exact sum (each of the GPU's and the host's sums): the bound. */
    int ok = fabs(got - want) <= 2.0 * (double)n * 0x1p-53 * want;
    printf("%-28s %s  (gpu %.17g, emulated %.17g%s)\n", "sumsq_ex f32", ok ? "ok  " : "FAIL", got, emu,
           got == emu ? ", identical" : "");
    g_fail += !ok;
    cudaFree(dX); cudaFree(dOut); cudaFree(dWork);
    free(x);
}

/* The emulator's launch model (cu_emu.h fl_cu_emu_launch_ok, fl_cu_emu_smem_optin, fl_cu_emu_cp_async) against the
 * GPU's: each case refused or run on both alike, the shift's result where it runs; the device's opt-in maximum beside
 * the emulator's sm_90 default. cp.async: the waited-for mode only (the others read unlanded copies on purpose). */
static void check_launch_model(void) {
    enum { N = 64 };
    float in[N], o[N], oe[N];
    for (int i = 0; i < N; i++) in[i] = (float)(i + 1);
    float *din = dev_copy(in, sizeof in), *dout = dev_copy(NULL, sizeof o);
    int dev = 0, optmax = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&optmax, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    fl_cu_emu_set_smem_max((size_t)optmax);
    const struct { const char *what; size_t smem; int optin, n; unsigned gy; } cs[] = {
        {"48 KiB, no opt-in", 48 << 10, 0, N, 1},          {"64 KiB, no opt-in", 64 << 10, 0, N, 1},
        {"64 KiB, opt-in", 64 << 10, 1, N, 1},             {"the device's maximum, opt-in", (size_t)optmax, 1, N, 1},
        {"1 KiB over it, opt-in", (size_t)optmax + 1024, 1, N, 1}, {"grid y 65535", 4096, 0, 1, 65535},
        {"grid y 65536", 4096, 0, 1, 65536},
    };
    int ok = 1;
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        cudaMemset(dout, 0, sizeof o);
        const int rg = fl_cuk_selftest_smem(dout, din, cs[i].n, cs[i].smem, cs[i].optin, cs[i].gy, NULL);
        cudaDeviceSynchronize();
        cudaGetLastError();
        fl_cu_emu_clear_error();
        const int re = fl_cuemu_selftest_smem(oe, in, cs[i].n, cs[i].smem, cs[i].optin, cs[i].gy, NULL);
        fl_cu_emu_clear_error();
        to_host(o, dout, sizeof o);
        int same = (rg != 0) == (re != 0);
        for (int k = 0; same && rg == 0 && k < cs[i].n; k++) same = o[k] == in[(k + cs[i].n - 1) % cs[i].n];
        printf("launch model: %-32s GPU %s, emulator %s %s\n", cs[i].what, rg ? "refused" : "ran", re ? "refused" : "ran",
               same ? "ok" : "FAIL");
        ok &= same;
    }
    fl_cu_emu_set_smem_max(0);
    printf("launch model: the device's opt-in maximum %d bytes (the emulator's default: sm_90's %zu)\n", optmax,
           fl_cu_emu_smem_max());
    float cin[128], co[128];
    for (int i = 0; i < 128; i++) cin[i] = (float)i;
    float *dcin = dev_copy(cin, sizeof cin), *dco = dev_copy(NULL, sizeof co);
    int rc = fl_cuk_selftest_cp(dco, dcin, 0, NULL);
    cudaDeviceSynchronize();
    to_host(co, dco, sizeof co);
    int cp_ok = rc == 0;
    for (int i = 0; cp_ok && i < 128; i++) cp_ok = co[i] == cin[(i + 4) % 128];
    printf("launch model: cp.async waited for              %s\n", cp_ok ? "ok" : "FAIL");
    if (!ok || !cp_ok) g_fail++;
    cudaFree(din), cudaFree(dout), cudaFree(dcin), cudaFree(dco);
}

int main(void) {
    char why[256], desc[1024];
    fl_cuda_describe(desc, sizeof desc);
    if (fl_cuda_device_count(why, sizeof why) == 0) {
        printf("fitllm_cuda_check: %s: nothing checked\n", why);
        return 0;
    }
    printf("fitllm_cuda_check: %s\n", desc);
    g_dev_work = dev_copy(NULL, FL_CU_NORM_WORK_BYTES);
    g_emu_work = malloc(FL_CU_NORM_WORK_BYTES);
    check_rmsnorm(7, 13);
    check_rmsnorm(64, 4096);
    check_xent(9, 101);
    check_xent(8, 32000);
    check_adamw(1 << 20);
    check_convert(100003);
    check_layernorm(33, 769);
    check_sumsq(3000017);
    check_gemm();
    check_launch_model();
    g_fail += fl_cuda_check_attn();
    g_fail += fl_cuda_check_more();
    g_fail += fl_cuda_check_fused();
    g_fail += fl_cuda_check_gemm_epi();
    g_fail += fl_cuda_check_vec16();
    g_fail += fl_cuda_check_ss();
    g_fail += fl_cuda_check_normce();
    printf("%s\n", g_fail ? "FAILED" : "all ok");
    return g_fail ? 1 : 0;
}

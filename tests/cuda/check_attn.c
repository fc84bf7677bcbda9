/* fitllm_cuda_check, attention part: the real attention kernels (fl_cuk_*, kernels/attention*.cu)
 * on the GPU against
 *  - the same sources under the CPU emulator (fl_cuemu_*, which tests/test_cuda_attn.c checks
 *    against float64 and the CPU backend) at small odd shapes, every head-dimension bucket,
 *    bias / mask / dbias / cross-attention / decode;
 *  - a float64 reference of one (batch, kv head group) slice at the large shapes (B 2, T 1024,
 *    NH 16, NKV 4 and 16, HD 64 and 128): the emulator would take minutes there;
 * plus the bits of two GPU runs of each backward (deterministic: no atomics), and the kernel
 * times (cudaEvent) of forward and backward at T 1024 / 2048, HD 64, NH 32.
 * The tensor-core (bf16) kernels of attention_tc.cu likewise: the mma's fragment layouts on the
 * hardware (exact integer products), GPU vs emulator at small shapes, the float64 slice with
 * bf16-rounded inputs (tolerance 1e-2: P and dS rounded to bf16), and their times next to the
 * fp32 kernels' (the speed-up of a bf16 run's attention).
 * Tolerances: GPU vs emulator as cuda_check.c's report() (nvcc contracts to FMAs, the device
 * expf is not glibc's): relative 1e-4 plus 1e-5 (values) / 2e-5 (gradients) of the largest
 * reference magnitude; the float64 slice: 1e-4 of the largest magnitude of each tensor (fp32
 * over 1024-key sums: ~1e-6 expected, a masking or scale error is 1e-2 or more).
 * int fl_cuda_check_attn(void): the number of failures; one line per op. Built with
 * -DFL_CHECK_ATTN_MAIN it is a program of its own (tests/cuda/check_attn.sh: no libfitllm). */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cu_kernels_attn.h"
#include "fitllm/dtype.h"

int fl_cuda_check_attn(void);

static int a_fail;

static void *a_dev(const void *h, size_t bytes) {
    void *d = NULL;
    if (cudaMalloc(&d, bytes ? bytes : 1) != cudaSuccess) {
        fprintf(stderr, "cudaMalloc(%zu) failed\n", bytes);
        exit(1);
    }
    if (h) cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
    return d;
}
static void a_host(void *h, const void *d, size_t bytes) {
    if (cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
        fprintf(stderr, "cudaMemcpy failed\n");
        exit(1);
    }
}
static float *a_rand(unsigned *s, size_t n, float lo, float hi) {
    float *x = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        *s = *s * 1664525u + 1013904223u;
        x[i] = lo + (hi - lo) * (float)(*s >> 8) / 16777216.0f;
    }
    return x;
}
/* cuda_check.c's report(): |gpu - emu| <= rtol |emu| + atol (1 + max|emu|); -inf == -inf */
static void a_report(const char *op, const float *gpu, const float *emu, size_t n, double rtol, double atol) {
    double mx = 0, worst = 0;
    for (size_t i = 0; i < n; i++)
        if (isfinite(emu[i])) mx = fmax(mx, fabs(emu[i]));
    int ok = 1;
    for (size_t i = 0; i < n; i++) {
        if (isinf(emu[i]) || isinf(gpu[i])) {
            ok &= gpu[i] == emu[i];
            continue;
        }
        double d = fabs((double)gpu[i] - emu[i]);
        worst = fmax(worst, d / (mx > 0 ? mx : 1));
        if (!(d <= rtol * fabs(emu[i]) + atol * (1 + mx))) ok = 0;
    }
    printf("%-40s %s  (max |diff| / max|ref| = %.2e)\n", op, ok ? "ok  " : "FAIL", worst);
    if (!ok) a_fail++;
}
static void a_bits(const char *op, const void *x, const void *y, size_t bytes) {
    int ok = !memcmp(x, y, bytes);
    printf("%-40s %s\n", op, ok ? "ok  " : "FAIL");
    if (!ok) a_fail++;
}

/* ---- small shapes: GPU against the emulator -------------------------------------------------- */

static void check_ex(int B, int Tq, int Tk, int NH, int NKV, int HD, int causal, int use_bias, int use_mask) {
    char nm[96], op[128];
    snprintf(nm, sizeof nm, "attn_ex B%d Tq%d Tk%d %d/%d HD%d%s%s%s", B, Tq, Tk, NH, NKV, HD, causal ? " c" : "",
             use_bias ? " b" : "", use_mask ? " m" : "");
    unsigned s = (unsigned)(Tq * 31 + Tk + HD);
    fl_attn_desc a = {B, Tq, Tk, NH, NKV, HD, (size_t)NH * HD + 1, (size_t)NKV * HD + 3, (size_t)NKV * HD,
                      (size_t)NH * HD, 1.0f / sqrtf((float)HD), causal, 0.0f, 0};
    size_t nq = (size_t)B * Tq * a.ldq, nk = (size_t)B * Tk * a.ldk, nv = (size_t)B * Tk * a.ldv;
    size_t no = (size_t)B * Tq * a.ldo, nl = (size_t)B * NH * Tq, nb = (size_t)NH * Tq * Tk;
    float *q = a_rand(&s, nq, -1.5f, 1.5f), *k = a_rand(&s, nk, -1.5f, 1.5f), *v = a_rand(&s, nv, -1, 1);
    float *dout = a_rand(&s, no, -1, 1), *bias = use_bias ? a_rand(&s, nb, -1, 1) : NULL;
    uint8_t *mask = NULL;
    if (use_mask) {
        mask = malloc((size_t)B * Tk);
        for (size_t i = 0; i < (size_t)B * Tk; i++) mask[i] = (i * 7 + 3) % 5 != 0;
        mask[Tk] = 0;
    }
    float *out = malloc(no * 4), *lse = malloc(nl * 4), *work = malloc(fl_cu_attention_work_bytes(B, NH, Tq));
    float *dq = calloc(nq, 4), *dk = calloc(nk, 4), *dv = calloc(nv, 4), *db = use_bias ? calloc(nb, 4) : NULL;
    int rc = fl_cuemu_attention_forward_ex(&a, out, NULL, lse, q, k, v, bias, mask, NULL);
    rc |= fl_cuemu_attention_backward_ex(&a, dq, dk, dv, db, dout, q, k, v, bias, mask, out, lse, work, NULL);
    float *gq = a_dev(q, nq * 4), *gk = a_dev(k, nk * 4), *gv = a_dev(v, nv * 4), *gdo = a_dev(dout, no * 4);
    float *gb = bias ? a_dev(bias, nb * 4) : NULL, *go = a_dev(NULL, no * 4), *gl = a_dev(NULL, nl * 4);
    uint8_t *gm = mask ? a_dev(mask, (size_t)B * Tk) : NULL;
    float *gw = a_dev(NULL, fl_cu_attention_work_bytes(B, NH, Tq));
    float *gdq = a_dev(NULL, nq * 4), *gdk = a_dev(NULL, nk * 4), *gdv = a_dev(NULL, nv * 4);
    float *gdb = bias ? a_dev(NULL, nb * 4) : NULL;
    cudaMemset(go, 0, no * 4);
    cudaMemset(gdq, 0, nq * 4);
    cudaMemset(gdk, 0, nk * 4);
    cudaMemset(gdv, 0, nv * 4);
    if (gdb) cudaMemset(gdb, 0, nb * 4);
    rc |= fl_cuk_attention_forward_ex(&a, go, NULL, gl, gq, gk, gv, gb, gm, NULL);
    rc |= fl_cuk_attention_backward_ex(&a, gdq, gdk, gdv, gdb, gdo, gq, gk, gv, gb, gm, go, gl, gw, NULL);
    if (rc || cudaDeviceSynchronize() != cudaSuccess) {
        printf("%-40s FAIL (launch: %d, %s)\n", nm, rc, cudaGetErrorString(cudaGetLastError()));
        a_fail++;
    } else {
        float *h = malloc((nq > nb ? (nq > nk ? nq : nk) : (nb > nk ? nb : nk)) * 4 + no * 4 + nl * 4);
        /* out's padding of ldo: none here (ldo = NH*HD) */
        a_host(h, go, no * 4), snprintf(op, sizeof op, "%s out", nm), a_report(op, h, out, no, 1e-4, 1e-5);
        a_host(h, gl, nl * 4), snprintf(op, sizeof op, "%s lse", nm), a_report(op, h, lse, nl, 1e-4, 1e-5);
        a_host(h, gdq, nq * 4), snprintf(op, sizeof op, "%s dq", nm), a_report(op, h, dq, nq, 2e-4, 2e-5);
        a_host(h, gdk, nk * 4), snprintf(op, sizeof op, "%s dk", nm), a_report(op, h, dk, nk, 2e-4, 2e-5);
        a_host(h, gdv, nv * 4), snprintf(op, sizeof op, "%s dv", nm), a_report(op, h, dv, nv, 2e-4, 2e-5);
        if (gdb) a_host(h, gdb, nb * 4), snprintf(op, sizeof op, "%s dbias", nm), a_report(op, h, db, nb, 2e-4, 2e-5);
        free(h);
    }
    cudaFree(gq), cudaFree(gk), cudaFree(gv), cudaFree(gdo), cudaFree(gb), cudaFree(go), cudaFree(gl), cudaFree(gm);
    cudaFree(gw), cudaFree(gdq), cudaFree(gdk), cudaFree(gdv), cudaFree(gdb);
    free(q), free(k), free(v), free(dout), free(bias), free(mask), free(out), free(lse), free(work);
    free(dq), free(dk), free(dv), free(db);
}

static void check_decode(int T, int NH, int NKV, int HD) {
    char op[96];
    unsigned s = (unsigned)(T + HD * 3);
    const int Tmax = T + 5;
    size_t nc = (size_t)NKV * Tmax * HD, hs = (size_t)Tmax * HD, n = (size_t)NH * HD;
    float *q = a_rand(&s, n, -1.5f, 1.5f), *kc = a_rand(&s, nc, -1.5f, 1.5f), *vc = a_rand(&s, nc, -1, 1);
    float *o = malloc(n * 4), *h = malloc(n * 4);
    int rc = fl_cuemu_attention_decode(o, q, kc, vc, T, NH, NKV, HD, hs, NULL);
    float *gq = a_dev(q, n * 4), *gk = a_dev(kc, nc * 4), *gv = a_dev(vc, nc * 4), *go = a_dev(NULL, n * 4);
    rc |= fl_cuk_attention_decode(go, gq, gk, gv, T, NH, NKV, HD, hs, NULL);
    snprintf(op, sizeof op, "attn_decode T%d %d/%d HD%d", T, NH, NKV, HD);
    if (rc || cudaDeviceSynchronize() != cudaSuccess) {
        printf("%-40s FAIL (launch)\n", op);
        a_fail++;
    } else {
        a_host(h, go, n * 4);
        a_report(op, h, o, n, 1e-4, 1e-5);
    }
    cudaFree(gq), cudaFree(gk), cudaFree(gv), cudaFree(go);
    free(q), free(kc), free(vc), free(o), free(h);
}

/* ---- tensor cores: the mma fragment layouts, then the kernels against the emulator ------------------ */

/* Small integers: exact on any hardware in any summation order, so the GPU's D must equal the
 * integer matmul bit for bit (a fragment layout of cu_mma.h that does not match the hardware's
 * fails here even if the emulator agrees with itself); random bf16 values: within the fp32
 * accumulation bound of 17 terms (doubled: tensor cores truncate) of float64. */
static void check_mma(void) {
    unsigned s = 77;
    uint16_t A[256], B[128];
    float Af[256], Bf[128], C[128], D[128];
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < 256; i++) {
            s = s * 1664525u + 1013904223u;
            Af[i] = pass == 0 ? (float)((int)(s >> 20) % 17 - 8) : fl_bf16_to_f32(fl_f32_to_bf16(-2.0f + 4.0f * (float)(s >> 8) / 16777216.0f));
            A[i] = fl_f32_to_bf16(Af[i]);
        }
        for (int i = 0; i < 128; i++) {
            s = s * 1664525u + 1013904223u;
            Bf[i] = pass == 0 ? (float)((int)(s >> 20) % 17 - 8) : fl_bf16_to_f32(fl_f32_to_bf16(-2.0f + 4.0f * (float)(s >> 8) / 16777216.0f));
            B[i] = fl_f32_to_bf16(Bf[i]);
            C[i] = pass == 0 ? (float)((int)(s >> 12) % 101 - 50) : -4.0f + 8.0f * (float)(s >> 8) / 16777216.0f;
        }
        float *gd = a_dev(NULL, sizeof D), *gc = a_dev(C, sizeof C);
        uint16_t *ga = a_dev(A, sizeof A), *gb = a_dev(B, sizeof B);
        int rc = fl_cuk_mma_bf16_check(gd, ga, gb, gc, NULL);
        const char *op = pass == 0 ? "mma bf16 m16n8k16 (integers: exact)" : "mma bf16 m16n8k16 (random, fp32 bound)";
        if (rc || cudaDeviceSynchronize() != cudaSuccess) {
            printf("%-40s FAIL (launch: %d)\n", op, rc);
            a_fail++;
        } else {
            a_host(D, gd, sizeof D);
            int ok = 1;
            double worst = 0;
            for (int r = 0; r < 16; r++)
                for (int n = 0; n < 8; n++) {
                    double want = C[r * 8 + n], mag = fabs(want);
                    for (int k = 0; k < 16; k++) {
                        want += (double)Af[r * 16 + k] * Bf[k * 8 + n];
                        mag += fabs((double)Af[r * 16 + k] * Bf[k * 8 + n]);
                    }
                    const double err = fabs(D[r * 8 + n] - want), tol = pass == 0 ? 0 : 2 * 17 * mag / 16777216.0;
                    ok &= err <= tol;
                    if (tol > 0) worst = fmax(worst, err / tol);
                }
            printf("%-40s %s  (worst err / bound %.2f)\n", op, ok ? "ok  " : "FAIL", worst);
            if (!ok) a_fail++;
        }
        cudaFree(gd), cudaFree(gc), cudaFree(ga), cudaFree(gb);
    }
}

/* The tensor-core kernels on the GPU against the same source emulated (at 100+ rows the emulated
 * run takes seconds). Both round the same bf16 operands, but a P or dS whose fp32 value differs
 * by an ulp (the mma's order, the device exp2f) can round to the neighbouring bf16: differences
 * of up to 2^-8 of a term, so 1e-2 relative plus 2e-3 of the largest value (a layout or masking
 * error is 1e-1 or more). kmask with b = 1's key 0 hidden. fa2: 0 the legacy kernels, 1 fa2, 2 fa2's EX kernels
 * (attention_*_fa2_b: T5's scale 1, a bias (NH, Tq, Tk) with its gradient, dropout 0.1 on the weights). */
static void check_tc_ex(int fa2, int B, int Tq, int Tk, int NH, int NKV, int HD, int causal, int use_mask) {
    char nm[96], op[128];
    snprintf(nm, sizeof nm, "attn_%s B%d Tq%d Tk%d %d/%d HD%d%s%s", fa2 == 2 ? "fa2ex" : fa2 ? "fa2" : "tc", B, Tq, Tk,
             NH, NKV, HD, causal ? " c" : "", use_mask ? " m" : "");
    unsigned s = (unsigned)(Tq * 37 + Tk + HD);
    fl_attn_desc a = {B, Tq, Tk, NH, NKV, HD, (size_t)NH * HD + 2, (size_t)NKV * HD + 4, (size_t)NKV * HD,
                      (size_t)NH * HD, fa2 == 2 ? 1.0f : 1.0f / sqrtf((float)HD), causal, fa2 == 2 ? 0.1f : 0.0f,
                      0x5eedull + (uint64_t)Tq};
    size_t nq = (size_t)B * Tq * a.ldq, nk = (size_t)B * Tk * a.ldk, nv = (size_t)B * Tk * a.ldv;
    size_t no = (size_t)B * Tq * a.ldo, nl = (size_t)B * NH * Tq, nb = (size_t)NH * Tq * Tk;
    const float qk = fa2 == 2 ? 0.4f : 1.5f; /* scale 1: T5's scores of a few units */
    float *q = a_rand(&s, nq, -qk, qk), *k = a_rand(&s, nk, -qk, qk), *v = a_rand(&s, nv, -1, 1);
    float *dout = a_rand(&s, no, -1, 1);
    float *bias = fa2 == 2 ? a_rand(&s, nb, -2, 2) : NULL, *db = fa2 == 2 ? calloc(nb, 4) : NULL;
    uint8_t *mask = NULL;
    if (use_mask) {
        mask = malloc((size_t)B * Tk);
        for (size_t i = 0; i < (size_t)B * Tk; i++) mask[i] = (i * 7 + 3) % 5 != 0;
        if (B > 1) mask[Tk] = 0;
    }
    float *out = malloc(no * 4), *lse = malloc(nl * 4), *work = malloc(fl_cu_attention_work_bytes(B, NH, Tq));
    float *dq = calloc(nq, 4), *dk = calloc(nk, 4), *dv = calloc(nv, 4);
    int rc;
    if (fa2 == 2) {
        rc = fl_cuemu_attention_forward_fa2_b(&a, out, NULL, lse, q, k, v, bias, mask, NULL);
        rc |= fl_cuemu_attention_backward_fa2_b(&a, dq, dk, dv, db, dout, q, k, v, bias, mask, out, lse, work, 0, NULL);
    } else {
        rc = (fa2 ? fl_cuemu_attention_forward_fa2 : fl_cuemu_attention_forward_tc)(&a, out, NULL, lse, q, k, v, mask, NULL);
        rc |= (fa2 ? fl_cuemu_attention_backward_fa2 : fl_cuemu_attention_backward_tc)(&a, dq, dk, dv, dout, q, k, v, mask,
                                                                                     out, lse, work, NULL);
    }
    float *gq = a_dev(q, nq * 4), *gk = a_dev(k, nk * 4), *gv = a_dev(v, nv * 4), *gdo = a_dev(dout, no * 4);
    float *go = a_dev(NULL, no * 4), *gl = a_dev(NULL, nl * 4), *gw = a_dev(NULL, fl_cu_attention_work_bytes(B, NH, Tq));
    uint8_t *gm = mask ? a_dev(mask, (size_t)B * Tk) : NULL;
    float *gdq = a_dev(NULL, nq * 4), *gdk = a_dev(NULL, nk * 4), *gdv = a_dev(NULL, nv * 4);
    cudaMemset(gdq, 0, nq * 4), cudaMemset(gdk, 0, nk * 4), cudaMemset(gdv, 0, nv * 4);
    float *gb = bias ? a_dev(bias, nb * 4) : NULL, *gdb = db ? a_dev(NULL, nb * 4) : NULL;
    if (gdb) cudaMemset(gdb, 0, nb * 4);
    if (fa2 == 2) {
        rc |= fl_cuk_attention_forward_fa2_b(&a, go, NULL, gl, gq, gk, gv, gb, gm, NULL);
        rc |= fl_cuk_attention_backward_fa2_b(&a, gdq, gdk, gdv, gdb, gdo, gq, gk, gv, gb, gm, go, gl, gw, 0, NULL);
    } else {
        rc |= (fa2 ? fl_cuk_attention_forward_fa2 : fl_cuk_attention_forward_tc)(&a, go, NULL, gl, gq, gk, gv, gm, NULL);
        rc |= (fa2 ? fl_cuk_attention_backward_fa2 : fl_cuk_attention_backward_tc)(&a, gdq, gdk, gdv, gdo, gq, gk, gv, gm,
                                                                                 go, gl, gw, NULL);
    }
    if (rc || cudaDeviceSynchronize() != cudaSuccess) {
        printf("%-40s FAIL (launch: %d, %s)\n", nm, rc, cudaGetErrorString(cudaGetLastError()));
        a_fail++;
    } else {
        float *h = malloc((nq > nk ? (nq > nv ? nq : nv) : (nk > nv ? nk : nv)) * 4 + no * 4 + nl * 4 + nb * 4);
        a_host(h, go, no * 4), snprintf(op, sizeof op, "%s out", nm), a_report(op, h, out, no, 1e-2, 2e-3);
        a_host(h, gl, nl * 4), snprintf(op, sizeof op, "%s lse", nm), a_report(op, h, lse, nl, 1e-4, 1e-5);
        a_host(h, gdq, nq * 4), snprintf(op, sizeof op, "%s dq", nm), a_report(op, h, dq, nq, 1e-2, 2e-3);
        a_host(h, gdk, nk * 4), snprintf(op, sizeof op, "%s dk", nm), a_report(op, h, dk, nk, 1e-2, 2e-3);
        a_host(h, gdv, nv * 4), snprintf(op, sizeof op, "%s dv", nm), a_report(op, h, dv, nv, 1e-2, 2e-3);
        if (gdb) a_host(h, gdb, nb * 4), snprintf(op, sizeof op, "%s dbias", nm), a_report(op, h, db, nb, 1e-2, 2e-3);
        free(h);
    }
    cudaFree(gq), cudaFree(gk), cudaFree(gv), cudaFree(gdo), cudaFree(go), cudaFree(gl), cudaFree(gw), cudaFree(gm);
    cudaFree(gdq), cudaFree(gdk), cudaFree(gdv), cudaFree(gb), cudaFree(gdb);
    free(q), free(k), free(v), free(dout), free(mask), free(out), free(lse), free(work), free(dq), free(dk), free(dv);
    free(bias), free(db);
}

/* ---- large shapes: GPU against a float64 slice ------------------------------------------------ */

/* max |x - ref| / max |ref| over a slice */
typedef struct { double diff, ref; } a_err;
static void a_acc(a_err *e, double x, double ref) {
    e->diff = fmax(e->diff, fabs(x - ref));
    e->ref = fmax(e->ref, fabs(ref));
}
static void a_err_report(const char *op, a_err e, double tol) {
    double r = e.diff / (e.ref > 0 ? e.ref : 1);
    int ok = r <= tol;
    printf("%-40s %s  (max |diff| / max|ref| = %.2e, float64 slice)\n", op, ok ? "ok  " : "FAIL", r);
    if (!ok) a_fail++;
}

/* the fused ops, fp32 (tc 0) or tensor-core kernels (tc 1: attention_tc.cu, 2: attn_fa2.cu, 3: attn_fa2.cu with
 * the deterministic dq of FITLLM_CUDA_DETERMINISTIC, 4: attn_fa2.cu's 128-key backward blocks of FITLLM_CUDA_FA2_BK=128,
 * 5: both; inputs
 * rounded to bf16 first, so that the bf16 error left is P's and dS's rounding, <= 2^-8 of the
 * |term| sums per element) */
static int a_fwd(int tc, float *o, float *l, const float *x, int B, int T, int NH, int NKV, int HD) {
    if (!tc) return fl_cuk_attention_forward(o, l, x, B, T, NH, NKV, HD, NULL);
    const fl_attn_desc a = fl_attn_desc_qkv(B, T, NH, NKV, HD);
    return (tc >= 2 ? fl_cuk_attention_forward_fa2 : fl_cuk_attention_forward_tc)(&a, o, NULL, l, x, x + (size_t)NH * HD, x + (size_t)(NH + NKV) * HD, NULL, NULL);
}
static int a_bwd(int tc, float *dx, const float *dout, const float *x, const float *o, const float *l, int B, int T,
                 int NH, int NKV, int HD, void *w) {
    if (!tc) return fl_cuk_attention_backward(dx, dout, x, o, l, B, T, NH, NKV, HD, w, NULL);
    const fl_attn_desc a = fl_attn_desc_qkv(B, T, NH, NKV, HD);
    const size_t ko = (size_t)NH * HD, vo = (size_t)(NH + NKV) * HD;
    if (tc >= 3) {
        const int flags = (tc == 3 || tc == 5 ? FL_CU_FA2_DET : 0) | (tc >= 4 ? FL_CU_FA2_BK128 : 0);
        return fl_cuk_attention_backward_fa2_ex(&a, dx, dx + ko, dx + vo, dout, x, x + ko, x + vo, NULL, o, l, w, flags,
                                                NULL);
    }
    return (tc == 2 ? fl_cuk_attention_backward_fa2 : fl_cuk_attention_backward_tc)(&a, dx, dx + ko, dx + vo, dout, x, x + ko, x + vo, NULL, o, l, w, NULL);
}
static void a_round_bf16(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = fl_bf16_to_f32(fl_f32_to_bf16(x[i]));
}

static void check_large(int B, int T, int NH, int NKV, int HD, int tc) {
    char nm[96], op[160];
    static const char *const tags[] = {"", "_tc", "_fa2", "_fa2det", "_fa2bk128", "_fa2det128"};
    snprintf(nm, sizeof nm, "attn%s B%d T%d %d/%d HD%d", tags[tc], B, T, NH, NKV, HD);
    const int atomic_dq = tc == 2 || tc == 4; /* the fa2 backward's dq: atomic adds in a varying order */
    unsigned s = (unsigned)(T + NKV * 7 + HD);
    const size_t W = (size_t)(NH + 2 * NKV) * HD, OW = (size_t)NH * HD;
    const size_t nx = (size_t)B * T * W, no = (size_t)B * T * OW, nl = (size_t)B * NH * T;
    float *qkv = a_rand(&s, nx, -1.5f, 1.5f), *dout = a_rand(&s, no, -1, 1);
    if (tc) a_round_bf16(qkv, nx), a_round_bf16(dout, no);
    /* bf16 P / dS: ~1e-3 of the largest value expected (2^-8 per term, not aligned), a lost tile,
     * a masking or a fragment-layout error is 1e-1 or more */
    const double tol = tc ? 1e-2 : 1e-4, tol_lse = tc ? 1e-4 : 1e-5;
    float *gx = a_dev(qkv, nx * 4), *gdo = a_dev(dout, no * 4), *go = a_dev(NULL, no * 4), *gl = a_dev(NULL, nl * 4);
    float *gdx = a_dev(NULL, nx * 4), *gdx2 = a_dev(NULL, nx * 4), *gw = a_dev(NULL, fl_cu_attention_work_bytes_det(B, NH, T));
    cudaMemset(gdx, 0, nx * 4);
    cudaMemset(gdx2, 0, nx * 4);
    int rc = a_fwd(tc, go, gl, gx, B, T, NH, NKV, HD);
    rc |= a_bwd(tc, gdx, gdo, gx, go, gl, B, T, NH, NKV, HD, gw);
    rc |= a_bwd(tc, gdx2, gdo, gx, go, gl, B, T, NH, NKV, HD, gw);
    if (rc || cudaDeviceSynchronize() != cudaSuccess) {
        printf("%-40s FAIL (launch: %d)\n", nm, rc);
        a_fail++;
        goto done;
    }
    {
        float *out = malloc(no * 4), *lse = malloc(nl * 4), *dx = malloc(nx * 4), *dx2 = malloc(nx * 4);
        a_host(out, go, no * 4), a_host(lse, gl, nl * 4), a_host(dx, gdx, nx * 4), a_host(dx2, gdx2, nx * 4);
        snprintf(op, sizeof op, "%s backward bits%s", nm, atomic_dq ? " (dk, dv; dq adds atomically)" : "");
        if (atomic_dq)
            for (size_t r = 0; r < (size_t)B * T; r++) {
                memset(dx + r * W, 0, OW * 4);
                memset(dx2 + r * W, 0, OW * 4);
            }
        a_bits(op, dx, dx2, nx * 4);
        if (atomic_dq) a_host(dx, gdx, nx * 4);
        /* float64 slice: batch b = B-1, kv head g = NKV-1 and its query heads */
        const int b = B - 1, g = NKV - 1, rep = NH / NKV;
        const double scale = 1.0 / sqrt((double)HD);
        double *p = malloc(sizeof(double) * T), *dp = malloc(sizeof(double) * T);
        double *dk = calloc((size_t)T * HD, sizeof(double)), *dv = calloc((size_t)T * HD, sizeof(double));
        double *o = malloc(sizeof(double) * HD), *dq = malloc(sizeof(double) * HD);
        a_err eo = {0, 0}, el = {0, 0}, eq = {0, 0}, ek = {0, 0}, ev = {0, 0};
        const float *X = qkv + (size_t)b * T * W, *G = dout + (size_t)b * T * OW;
        for (int h = g * rep; h < (g + 1) * rep; h++)
            for (int t = 0; t < T; t++) {
                const float *qr = X + (size_t)t * W + (size_t)h * HD, *gr = G + (size_t)t * OW + (size_t)h * HD;
                double m = -INFINITY, l = 0, D = 0;
                for (int j = 0; j <= t; j++) {
                    const float *kr = X + (size_t)j * W + (size_t)(NH + g) * HD;
                    double dot = 0;
                    for (int d = 0; d < HD; d++) dot += (double)qr[d] * kr[d];
                    p[j] = dot * scale;
                    m = fmax(m, p[j]);
                }
                for (int j = 0; j <= t; j++) l += (p[j] = exp(p[j] - m));
                for (int d = 0; d < HD; d++) o[d] = dq[d] = 0;
                for (int j = 0; j <= t; j++) {
                    const float *vr = X + (size_t)j * W + (size_t)(NH + NKV + g) * HD;
                    p[j] /= l;
                    dp[j] = 0;
                    for (int d = 0; d < HD; d++) {
                        o[d] += p[j] * vr[d];
                        dp[j] += (double)gr[d] * vr[d];
                    }
                    D += p[j] * dp[j];
                }
                const size_t orow = ((size_t)b * T + t) * OW + (size_t)h * HD;
                for (int d = 0; d < HD; d++) a_acc(&eo, out[orow + d], o[d]);
                a_acc(&el, lse[((size_t)b * NH + h) * T + t], m + log(l));
                for (int j = 0; j <= t; j++) {
                    const float *kr = X + (size_t)j * W + (size_t)(NH + g) * HD;
                    const double ds = p[j] * (dp[j] - D);
                    for (int d = 0; d < HD; d++) {
                        dq[d] += scale * ds * kr[d];
                        dk[(size_t)j * HD + d] += scale * ds * qr[d];
                        dv[(size_t)j * HD + d] += p[j] * gr[d];
                    }
                }
                const float *dqr = dx + ((size_t)b * T + t) * W + (size_t)h * HD;
                for (int d = 0; d < HD; d++) a_acc(&eq, dqr[d], dq[d]);
            }
        for (int j = 0; j < T; j++) {
            const float *dkr = dx + ((size_t)b * T + j) * W + (size_t)(NH + g) * HD;
            const float *dvr = dx + ((size_t)b * T + j) * W + (size_t)(NH + NKV + g) * HD;
            for (int d = 0; d < HD; d++) {
                a_acc(&ek, dkr[d], dk[(size_t)j * HD + d]);
                a_acc(&ev, dvr[d], dv[(size_t)j * HD + d]);
            }
        }
        snprintf(op, sizeof op, "%s out", nm), a_err_report(op, eo, tol);
        snprintf(op, sizeof op, "%s lse", nm), a_err_report(op, el, tol_lse);
        snprintf(op, sizeof op, "%s dq", nm), a_err_report(op, eq, tol);
        snprintf(op, sizeof op, "%s dk", nm), a_err_report(op, ek, tol);
        snprintf(op, sizeof op, "%s dv", nm), a_err_report(op, ev, tol);
        free(out), free(lse), free(dx), free(dx2), free(p), free(dp), free(dk), free(dv), free(o), free(dq);
    }
done:
    cudaFree(gx), cudaFree(gdo), cudaFree(go), cudaFree(gl), cudaFree(gdx), cudaFree(gdx2), cudaFree(gw);
    free(qkv), free(dout);
}

/* ---- kernel times --------------------------------------------------------------------------- */

static void time_attn(int B, int T, int NH, int NKV, int HD, int tc) {
    unsigned s = 9;
    const size_t W = (size_t)(NH + 2 * NKV) * HD, nx = (size_t)B * T * W, no = (size_t)B * T * NH * HD;
    float *x = a_rand(&s, nx, -1.5f, 1.5f);
    float *gx = a_dev(x, nx * 4), *gdo = a_dev(x, no * 4), *go = a_dev(NULL, no * 4);
    float *gl = a_dev(NULL, (size_t)B * NH * T * 4), *gdx = a_dev(NULL, nx * 4);
    float *gw = a_dev(NULL, fl_cu_attention_work_bytes(B, NH, T));
    cudaMemset(gdx, 0, nx * 4);
    cudaEvent_t e0, e1, e2;
    cudaEventCreate(&e0), cudaEventCreate(&e1), cudaEventCreate(&e2);
    const int reps = 5;
    int rc = a_fwd(tc, go, gl, gx, B, T, NH, NKV, HD); /* warm-up */
    rc |= a_bwd(tc, gdx, gdo, gx, go, gl, B, T, NH, NKV, HD, gw);
    cudaEventRecord(e0, NULL);
    for (int i = 0; i < reps; i++) rc |= a_fwd(tc, go, gl, gx, B, T, NH, NKV, HD);
    cudaEventRecord(e1, NULL);
    for (int i = 0; i < reps; i++) rc |= a_bwd(tc, gdx, gdo, gx, go, gl, B, T, NH, NKV, HD, gw);
    cudaEventRecord(e2, NULL);
    cudaEventSynchronize(e2);
    float f = 0, bw = 0;
    cudaEventElapsedTime(&f, e0, e1);
    cudaEventElapsedTime(&bw, e1, e2);
    f /= reps, bw /= reps;
    /* causal: half of the 4*B*NH*T*T*HD multiply-adds of the forward (QK^T, PV); backward 2.5x */
    double fl = 2.0 * B * NH * (double)T * T * HD;
    printf("%-40s fwd %8.3f ms (%5.1f TFLOP/s)  bwd %8.3f ms (%5.1f TFLOP/s)%s\n", "", f, fl / f * 1e-9, bw,
           2.5 * fl / bw * 1e-9, rc ? "  LAUNCH FAILED" : "");
    if (rc) a_fail++;
    cudaEventDestroy(e0), cudaEventDestroy(e1), cudaEventDestroy(e2);
    cudaFree(gx), cudaFree(gdo), cudaFree(go), cudaFree(gl), cudaFree(gdx), cudaFree(gw);
    free(x);
}

int fl_cuda_check_attn(void) {
    a_fail = 0;
    check_ex(2, 33, 33, 6, 2, 24, 1, 1, 1);
    check_ex(2, 70, 70, 4, 4, 64, 1, 0, 0);
    check_ex(2, 37, 70, 6, 2, 64, 0, 1, 1);
    check_ex(2, 70, 29, 4, 2, 128, 1, 0, 1);
    check_ex(2, 33, 45, 4, 4, 200, 1, 1, 0);
    check_decode(1, 6, 2, 64);
    check_decode(77, 8, 2, 128);
    check_decode(300, 4, 4, 256);
    for (int tc = 0; tc < 6; tc++) { /* 3, 5: the deterministic dq, whose bits must repeat too */
        check_large(2, 1024, 16, 4, 64, tc);
        check_large(2, 1024, 16, 16, 64, tc);
        check_large(2, 1024, 16, 4, 128, tc);
        check_large(2, 1024, 16, 16, 128, tc);
    }
    check_mma();
    for (int fa2 = 0; fa2 < 2; fa2++) {
        check_tc_ex(fa2, 2, 33, 33, 6, 2, 64, 1, 1);
        check_tc_ex(fa2, 2, 70, 70, 4, 4, 64, 1, 0);
        check_tc_ex(fa2, 2, 37, 150, 6, 2, 64, 0, 1);
        check_tc_ex(fa2, 2, 150, 29, 4, 2, 128, 1, 1);
        check_tc_ex(fa2, 1, 100, 100, 2, 1, 128, 0, 0);
        check_tc_ex(fa2, 1, 200, 200, 4, 1, 64, 1, 0);
    }
    /* fa2's EX kernels: T5's encoder (key mask, bias, dbias over a batch of 2, dropout), its causal decoder, HD 128 */
    check_tc_ex(2, 2, 70, 70, 4, 4, 64, 0, 1);
    check_tc_ex(2, 2, 45, 45, 4, 4, 64, 1, 0);
    check_tc_ex(2, 2, 40, 90, 2, 2, 128, 0, 1);
    const int Ts[2] = {1024, 2048}, kv[2] = {32, 8};
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++)
            for (int tc = 0; tc < 5; tc++) {
                if (tc == 3) continue;
                printf("attention time B 2 T %d NH 32 NKV %d HD 64 (causal, %s):\n", Ts[i], kv[j],
                       tc == 4   ? "bf16 tensor cores, fa2 (own), 128-key backward blocks"
                       : tc == 2 ? "bf16 tensor cores, fa2 (own)"
                       : tc      ? "bf16 tensor cores, tc (legacy)"
                                 : "fp32");
                time_attn(2, Ts[i], 32, kv[j], 64, tc);
            }
    for (int tc = 1; tc < 3; tc++) {
        printf("attention time B 2 T 2048 NH 16 NKV 16 HD 128 (causal, bf16 tensor cores, %s):\n",
               tc == 2 ? "fa2 (own)" : "tc (legacy)");
        time_attn(2, 2048, 16, 16, 128, tc);
    }
    return a_fail;
}

#ifdef FL_CHECK_ATTN_MAIN
int main(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("check_attn: no CUDA device visible: nothing checked\n");
        return 0;
    }
    int f = fl_cuda_check_attn();
    printf("%s\n", f ? "FAILED" : "all ok");
    return f ? 1 : 0;
}
#endif

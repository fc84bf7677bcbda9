/* CUDA kernels under the CPU emulator (src/backend/cuda/emu/, docs/ARCHITECTURE.md "CUDA backend").
 *
 * First the emulator itself: a kernel that forgets a __syncthreads passes when the fibers run in
 * thread order and fails once the order between barrier phases is shuffled, and passes shuffled
 * with the barrier; warp shuffles against their CUDA definitions. Then each kernel, compiled from
 * the same .cu source nvcc builds, op by op at small odd shapes (partial warps, several warps,
 * strided rows): forwards against the float64 references of tests/test_ops.c with its tolerances,
 * backwards against the CPU backend's op (itself checked against finite differences there) with
 * test_ops.c's finite-difference tolerance, AdamW against the float64 torch formula and, since
 * both evaluate the same fp32 operation sequence without contraction (fitllm_cuemu is built with
 * -ffp-contract=off like optim.c and precision.c), bit for bit against the CPU backend, and the
 * 16-bit conversions bit for bit. Every op runs under two shuffle seeds. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fitllm/backend.h"
#include "test.h"

#ifdef FL_HAVE_CUDA_EMU
#include "backend/cuda/cu_kernels.h"
#include "backend/cuda/emu/cu_emu.h"
#include "cuda_emu_test.h"

static const uint64_t k_seeds[] = {0x1234567ull, 0xfeedbeefull};

static fl_backend cpu2(void) {
    fl_backend be;
    fl_cpu_backend_init(&be, 2);
    return be;
}
/* test_ops.c's gradient tolerance: |got - want| <= rtol*|want| + atol*(1 + max|want|). */
static int grad_close(const char *what, const float *got, const float *want, size_t n) {
    const double rtol = 2e-4, atol = 2e-5;
    double mx = 0;
    for (size_t i = 0; i < n; i++) mx = fmax(mx, fabs((double)want[i]));
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - want[i]);
        if (!(d <= rtol * fabs((double)want[i]) + atol * (1 + mx))) {
            fprintf(stderr, "  %s: mismatch at %zu: got %.9g want %.9g\n", what, i, got[i], want[i]);
            return 0;
        }
    }
    return 1;
}

/* ---- the emulator ------------------------------------------------------------------------- */

FL_TEST(cuda_emu_missing_barrier_fails_when_permuted) {
    const int n = 97; /* three full warps and a partial one */
    fl_test_rng r = {5};
    float *in = fl_test_frand(&r, n, 1, 2), *out = malloc(n * sizeof(float));
    uint64_t saved = fl_cu_emu_get_seed();
    /* in thread order, without the barrier: thread i-1 always wrote before thread i reads, so
     * every element but the first (whose neighbour n-1 runs last: it reads the NaN fill) is right */
    fl_cu_emu_set_seed(0);
    EMU_OK(fl_cuemu_selftest_shift(out, in, n, 0, NULL));
    int wrong = 0;
    for (int i = 1; i < n; i++) wrong += out[i] != in[i - 1];
    FL_CHECKF(wrong == 0 && isnan(out[0]), "in-order run: %d wrong, out[0] = %g", wrong, out[0]);
    for (int s = 0; s < 4; s++) {
        fl_cu_emu_set_seed(100 + s);
        EMU_OK(fl_cuemu_selftest_shift(out, in, n, 0, NULL)); /* no barrier: must be wrong somewhere */
        wrong = 0;
        for (int i = 0; i < n; i++) wrong += out[i] != in[(i + n - 1) % n];
        FL_CHECKF(wrong > 0, "seed %d: the missing barrier went unnoticed", 100 + s);
        EMU_OK(fl_cuemu_selftest_shift(out, in, n, 1, NULL)); /* with it: right */
        wrong = 0;
        for (int i = 0; i < n; i++) wrong += out[i] != in[(i + n - 1) % n];
        FL_CHECKF(wrong == 0, "seed %d: %d wrong with the barrier", 100 + s, wrong);
    }
    fl_cu_emu_set_seed(saved);
    free(in); free(out);
}

FL_TEST(cuda_emu_shuffles) {
    const int block = 48; /* a full warp and a half one */
    int *out = malloc((size_t)block * 4 * sizeof(int));
    for (size_t k = 0; k < sizeof k_seeds / sizeof k_seeds[0]; k++) {
        fl_cu_emu_set_seed(k_seeds[k]);
        uint64_t sw0 = fl_cu_emu_switches();
        EMU_OK(fl_cuemu_selftest_shuffles(out, block, NULL));
        FL_CHECK(fl_cu_emu_switches() > sw0 + (uint64_t)block); /* the shuffles did switch fibers */
        int ok = 1;
        for (int t = 0; t < block; t++) {
            int l = t & 31, nl = t < 32 ? 32 : block - 32; /* lanes in this warp */
            ok &= out[t * 4 + 0] == (l ^ 5);
            /* __shfl_down_sync: a source lane past the warp's end gives the caller's own value (CUDA);
             * past the end of a partial warp the emulator does the same (the GPU: undefined) */
            ok &= out[t * 4 + 1] == (l + 3 < nl ? l + 3 : l);
            ok &= out[t * 4 + 2] == 7;
            if (t < 32) ok &= out[t * 4 + 3] == 31 * 32 / 2;
            if (!ok) {
                fprintf(stderr, "  thread %d: %d %d %d %d\n", t, out[t * 4], out[t * 4 + 1], out[t * 4 + 2], out[t * 4 + 3]);
                break;
            }
        }
        FL_CHECK(ok);
    }
    free(out);
}

FL_TEST(cuda_emu_errors_are_reported) {
    int out[32] = {0};
    fl_cu_emu_clear_error();
    FL_CHECK(fl_cuemu_selftest_divergent(out, NULL) != 0);
    FL_CHECKF(fl_cu_emu_error() && strstr(fl_cu_emu_error(), "deadlock"), "got: %s",
              fl_cu_emu_error() ? fl_cu_emu_error() : "no error");
    fl_cu_emu_clear_error();
    FL_CHECK(fl_cu_emu_error() == NULL);
    float in[2000] = {0}, o[2000];
    FL_CHECK(fl_cuemu_selftest_shift(o, in, 2000, 1, NULL) != 0); /* 2000 threads per block: over 1024 */
    FL_CHECKF(fl_cu_emu_error() && strstr(fl_cu_emu_error(), "threads per block"), "got: %s",
              fl_cu_emu_error() ? fl_cu_emu_error() : "no error");
    fl_cu_emu_clear_error();
}

/* What a GPU refuses at launch (cu_emu.h fl_cu_emu_launch_ok): dynamic shared memory over 48 KiB without the kernel's
 * opt-in, an opt-in over the device's maximum (sm_86 / 89's 99 KiB: refused once, not sticky, nothing launched), a
 * grid's y over 65,535; each named in the error. Within the limits the kernel runs and shifts its input. */
static int smem_shift_ok(const float *o, const float *in, int n) {
    for (int i = 0; i < n; i++)
        if (o[i] != in[(i + n - 1) % n]) return 0;
    return 1;
}
FL_TEST(cuda_emu_launch_limits) {
    enum { N = 64 };
    float in[N], o[N];
    for (int i = 0; i < N; i++) in[i] = (float)(i + 1);
    fl_cu_emu_clear_error();
    memset(o, 0, sizeof o);
    FL_CHECK(fl_cuemu_selftest_smem(o, in, N, 48 << 10, 0, 1, NULL) == 0 && smem_shift_ok(o, in, N));
    FL_CHECK(fl_cuemu_selftest_smem(o, in, N, 64 << 10, 0, 1, NULL) != 0); /* no opt-in */
    FL_CHECKF(fl_cu_emu_error() && strstr(fl_cu_emu_error(), "dynamic shared memory"), "got: %s",
              fl_cu_emu_error() ? fl_cu_emu_error() : "no error");
    fl_cu_emu_clear_error();
    memset(o, 0, sizeof o);
    FL_CHECK(fl_cuemu_selftest_smem(o, in, N, 64 << 10, 1, 1, NULL) == 0 && smem_shift_ok(o, in, N));
    FL_CHECK(fl_cuemu_selftest_smem(o, in, N, 200 << 10, 1, 1, NULL) == 0); /* under sm_90's 227 KiB */
    FL_CHECK(fl_cu_emu_error() == NULL);
    /* a device of 99 KiB a block: the opt-in refused, returned once, nothing launched, nothing sticky */
    fl_cu_emu_set_smem_max(101376);
    const unsigned long refused = fl_cu_emu_smem_refusals;
    memset(o, 0, sizeof o);
    FL_CHECK(fl_cuemu_selftest_smem(o, in, N, 128 << 10, 1, 1, NULL) != 0);
    FL_CHECK(fl_cu_emu_smem_refusals == refused + 1 && fl_cu_emu_error() == NULL && o[0] == 0.0f);
    FL_CHECK(fl_cuemu_selftest_smem(o, in, N, 96 << 10, 1, 1, NULL) == 0 && smem_shift_ok(o, in, N));
    fl_cu_emu_set_smem_max(0);
    FL_CHECK(fl_cu_emu_smem_max() == 232448);
    FL_CHECK(fl_cuemu_selftest_smem(o, in, 1, 4096, 0, 65535, NULL) == 0 && fl_cu_emu_error() == NULL);
    FL_CHECK(fl_cuemu_selftest_smem(o, in, 1, 4096, 0, 65536, NULL) != 0);
    FL_CHECKF(fl_cu_emu_error() && strstr(fl_cu_emu_error(), "grid (1, 65536, 1)"), "got: %s",
              fl_cu_emu_error() ? fl_cu_emu_error() : "no error");
    fl_cu_emu_clear_error();
}

/* Under ASan, shared memory past what the launch asked is out of bounds, although the emulator's buffer (kept from a
 * launch of more) is larger: a kernel writing 64 floats into 128 bytes is an ASan error (in a child process). */
FL_TEST(cuda_emu_smem_bounds_asan) {
#if defined(__SANITIZE_ADDRESS__)
    float in[64] = {0}, o[64];
    FL_REQUIRE(fl_cuemu_selftest_smem(o, in, 64, 32 << 10, 0, 1, NULL) == 0); /* the cached buffer: 32 KiB */
    fflush(stdout);
    const pid_t pid = fork();
    FL_REQUIRE(pid >= 0);
    if (pid == 0) {
        FILE *quiet = freopen("/dev/null", "w", stderr); /* the report: its exit status is what is checked */
        (void)quiet;
        fl_cuemu_selftest_smem(o, in, 64, 128, -1, 1, NULL);
        _exit(0);
    }
    int st = 0;
    FL_REQUIRE(waitpid(pid, &st, 0) == pid);
    FL_CHECKF(!(WIFEXITED(st) && WEXITSTATUS(st) == 0), "a kernel wrote past its dynamic shared memory unnoticed");
    FL_CHECK(fl_cuemu_selftest_smem(o, in, 64, 256, 0, 1, NULL) == 0); /* within its size: fine */
#else
    fl_test_skip("ASan builds only (make asan)");
#endif
}

/* cp.async (cu_emu.h fl_cu_emu_cp_async): the bytes land at the wait that completes their group, the destination holds
 * NaN bytes until then, and a thread that returns with copies in flight is an error */
FL_TEST(cuda_emu_cp_async) {
    float in[128], o[128];
    const uint64_t seed0 = fl_cu_emu_get_seed();
    for (int i = 0; i < 128; i++) in[i] = (float)i;
    for (size_t k = 0; k < sizeof k_seeds / sizeof k_seeds[0]; k++) {
        fl_cu_emu_set_seed(k_seeds[k]);
        fl_cu_emu_clear_error();
        int ok[3] = {1, 1, 1};
        FL_CHECK(fl_cuemu_selftest_cp(o, in, 0, NULL) == 0);
        for (int i = 0; i < 128; i++) ok[0] &= o[i] == in[(i + 4) % 128];
        FL_CHECK(fl_cuemu_selftest_cp(o, in, 1, NULL) == 0);
        for (int i = 0; i < 128; i++) ok[1] &= isnan(o[i]);
        FL_CHECK(fl_cuemu_selftest_cp(o, in, 2, NULL) == 0); /* group 1 (chunks 0-15) landed, group 2 not */
        for (int i = 0; i < 128; i++) ok[2] &= ((i + 4) % 128 < 64) ? o[i] == in[(i + 4) % 128] : isnan(o[i]);
        FL_CHECKF(ok[0] && ok[1] && ok[2] && !fl_cu_emu_error(), "seed %zu: waited %d, none %d, all but the newest %d%s%s",
                  k, ok[0], ok[1], ok[2], fl_cu_emu_error() ? ": " : "", fl_cu_emu_error() ? fl_cu_emu_error() : "");
        FL_CHECK(fl_cuemu_selftest_cp(o, in, 3, NULL) != 0);
        FL_CHECKF(fl_cu_emu_error() && strstr(fl_cu_emu_error(), "cp.async copies not waited for"), "got: %s",
                  fl_cu_emu_error() ? fl_cu_emu_error() : "no error");
        fl_cu_emu_clear_error();
    }
    fl_cu_emu_set_seed(seed0);
}

/* ---- RMSNorm -------------------------------------------------------------------------------- */

static void rmsnorm_case(int N, int C) {
    fl_backend be = cpu2();
    fl_test_rng r = {(unsigned long long)(N * 1000 + C)};
    const float eps = 1e-5f;
    float *x = fl_test_frand(&r, (size_t)N * C, -2, 2), *w = fl_test_frand(&r, C, 0.5f, 1.5f), *dy = fl_test_frand(&r, (size_t)N * C, -1, 1);
    for (int k = 0; k < C; k++) x[(size_t)(N / 2) * C + k] += 3.0f; /* a row with a large mean */
    float *want = malloc((size_t)N * C * 4), *wr = malloc((size_t)N * 4);
    for (int n = 0; n < N; n++) { /* float64 reference */
        double ss = 0;
        for (int k = 0; k < C; k++) ss += (double)x[(size_t)n * C + k] * x[(size_t)n * C + k];
        double rs = 1.0 / sqrt(ss / C + eps);
        wr[n] = (float)rs;
        for (int k = 0; k < C; k++) want[(size_t)n * C + k] = (float)(x[(size_t)n * C + k] * rs * w[k]);
    }
    float *dx0 = fl_test_frand(&r, (size_t)N * C, -1, 1), *dw0 = fl_test_frand(&r, C, -1, 1); /* += contract */
    float *cdx = fl_test_fdup(dx0, (size_t)N * C), *cdw = fl_test_fdup(dw0, C), *crstd = malloc((size_t)N * 4);
    float *cout = malloc((size_t)N * C * 4);
    be.rmsnorm_forward(&be, cout, crstd, x, w, N, C, eps);
    be.rmsnorm_backward(&be, cdx, cdw, dy, x, w, crstd, N, C);
    for (size_t k = 0; k < sizeof k_seeds / sizeof k_seeds[0]; k++) {
        fl_cu_emu_set_seed(k_seeds[k]);
        float *out = malloc((size_t)N * C * 4), *rstd = malloc((size_t)N * 4);
        float *dx = fl_test_fdup(dx0, (size_t)N * C), *dw = fl_test_fdup(dw0, C), *dx2 = fl_test_fdup(dx0, (size_t)N * C);
        EMU_OK(fl_cuemu_rmsnorm_forward(out, rstd, x, w, N, C, eps, NULL));
        FL_CHECK(fl_test_allclose("emu rmsnorm out", out, want, (size_t)N * C, 1e-5, 1e-6));
        FL_CHECK(fl_test_allclose("emu rmsnorm rstd", rstd, wr, N, 1e-5, 0));
        EMU_OK(fl_cuemu_rmsnorm_backward(dx, dw, dy, x, w, rstd, N, C, EMU_WORK, NULL));
        FL_CHECKF(grad_close("emu rmsnorm dinp", dx, cdx, (size_t)N * C), "N%d C%d dinp", N, C);
        FL_CHECKF(grad_close("emu rmsnorm dw", dw, cdw, C), "N%d C%d dw", N, C);
        EMU_OK(fl_cuemu_rmsnorm_backward(dx2, NULL, dy, x, w, rstd, N, C, EMU_WORK, NULL)); /* NULL dw: skipped */
        FL_CHECK(memcmp(dx2, dx, (size_t)N * C * 4) == 0);
        free(out); free(rstd); free(dx); free(dw); free(dx2);
    }
    free(x); free(w); free(dy); free(want); free(wr); free(dx0); free(dw0); free(cdx); free(cdw); free(crstd); free(cout);
}

FL_TEST(cuda_emu_rmsnorm) {
    rmsnorm_case(7, 13);  /* one partial warp per row */
    rmsnorm_case(5, 300); /* 8 warps, strided: two elements per thread for some */
    rmsnorm_case(3, 33);  /* two warps, the second with one live element */
    rmsnorm_case(533, 21); /* dw's column sum: 4 row groups, four rows per iteration and a remainder, a partial column block */
}

/* ---- cross-entropy -------------------------------------------------------------------------- */

static void xent_case(int N, int V, float spread, int ramp) {
    fl_backend be = cpu2();
    fl_test_rng r = {(unsigned long long)V};
    float *x = fl_test_frand(&r, (size_t)N * V, -spread, spread);
    if (ramp) /* the max keeps growing along the row (exercises the online rescale) */
        for (int n = 0; n < N; n++)
            for (int v = 0; v < V; v++) x[(size_t)n * V + v] += 20.0f * v / V;
    int32_t *tg = malloc((size_t)N * 4);
    for (int n = 0; n < N; n++) tg[n] = (int32_t)(fl_test_rng_u64(&r) % V);
    tg[1] = FL_IGNORE_INDEX;
    tg[N - 1] = FL_IGNORE_INDEX;
    tg[0] = V - 1;
    const float gs = 0.37f;
    float *want = malloc((size_t)N * 4);
    for (int n = 0; n < N; n++) { /* float64 reference */
        const float *xr = x + (size_t)n * V;
        if (tg[n] == FL_IGNORE_INDEX) { want[n] = 0; continue; }
        double mx = -INFINITY, s = 0;
        for (int v = 0; v < V; v++) mx = xr[v] > mx ? xr[v] : mx;
        for (int v = 0; v < V; v++) s += exp(xr[v] - mx);
        want[n] = (float)(mx + log(s) - xr[tg[n]]);
    }
    float *closs = malloc((size_t)N * 4), *cdl = malloc((size_t)N * V * 4);
    be.cross_entropy(&be, closs, cdl, x, tg, N, V, gs, FL_IGNORE_INDEX);
    char what[64];
    snprintf(what, sizeof what, "emu xent N%d V%d", N, V);
    for (size_t k = 0; k < sizeof k_seeds / sizeof k_seeds[0]; k++) {
        fl_cu_emu_set_seed(k_seeds[k]);
        float *loss = malloc((size_t)N * 4), *dl = malloc((size_t)N * V * 4), *loss2 = malloc((size_t)N * 4);
        for (size_t i = 0; i < (size_t)N * V; i++) dl[i] = NAN; /* every entry must be written */
        EMU_OK(fl_cuemu_cross_entropy(loss, dl, x, tg, N, V, gs, FL_IGNORE_INDEX, EMU_WORK, NULL));
        FL_CHECKF(fl_test_allclose(what, loss, want, N, 1e-5, 1e-6), "%s: loss", what);
        FL_CHECKF(grad_close(what, dl, cdl, (size_t)N * V), "%s: dlogits", what);
        int zero_ok = 1;
        for (int v = 0; v < V; v++) zero_ok &= dl[(size_t)V + v] == 0.0f && dl[(size_t)(N - 1) * V + v] == 0.0f;
        FL_CHECKF(zero_ok, "%s: ignored rows must have zero gradient", what);
        /* loss only, and in place (dlogits aliases logits): the same bits */
        EMU_OK(fl_cuemu_cross_entropy(loss2, NULL, x, tg, N, V, gs, FL_IGNORE_INDEX, EMU_WORK, NULL));
        FL_CHECK(memcmp(loss2, loss, (size_t)N * 4) == 0);
        float *xa = fl_test_fdup(x, (size_t)N * V);
        EMU_OK(fl_cuemu_cross_entropy(loss2, xa, xa, tg, N, V, gs, FL_IGNORE_INDEX, EMU_WORK, NULL));
        FL_CHECKF(memcmp(loss2, loss, (size_t)N * 4) == 0 && memcmp(xa, dl, (size_t)N * V * 4) == 0,
                  "%s: in place differs", what);
        /* cross_entropy_dbf16 (the LM head's bf16 path): the same loss bits, the gradient only in bf16, each
         * element the RNE of the fp32 launch's (0xffff, a NaN no finite value rounds to, marks unwritten ones) */
        uint16_t *d16 = malloc((size_t)N * V * 2);
        memset(d16, 0xff, (size_t)N * V * 2);
        memset(loss2, 0xff, (size_t)N * 4);
        EMU_OK(fl_cuemu_cross_entropy_dbf16(loss2, d16, x, tg, N, V, V, gs, FL_IGNORE_INDEX, EMU_WORK, NULL));
        size_t bad16 = 0;
        for (size_t i = 0; i < (size_t)N * V; i++) bad16 += d16[i] != fl_f32_to_bf16(dl[i]);
        FL_CHECKF(memcmp(loss2, loss, (size_t)N * 4) == 0 && bad16 == 0,
                  "%s: cross_entropy_dbf16: loss %s, %zu gradient elements not bf16(fp32 gradient)", what,
                  memcmp(loss2, loss, (size_t)N * 4) ? "differs" : "equal", bad16);
        /* padded rows (the LM head's fl_logits_ld: V rounded up to 8, or 8 more where it is one): the same loss and
         * gradient bits in each row's first V columns, the padding neither read (NaN logits there) nor written (a
         * sentinel kept); 16-byte aligned rows take the 128-bit path up to the row's last whole run of 4 */
        const int ld = V % 8 ? (V + 7) / 8 * 8 : V + 8;
        float *xp = aligned_alloc(64, ((size_t)N * ld * 4 + 63) / 64 * 64);
        uint16_t *dp = aligned_alloc(64, ((size_t)N * ld * 2 + 63) / 64 * 64);
        for (int n = 0; n < N; n++)
            for (int v = 0; v < ld; v++) xp[(size_t)n * ld + v] = v < V ? x[(size_t)n * V + v] : NAN;
        for (size_t i = 0; i < (size_t)N * ld; i++) dp[i] = 0x7e5a;
        memset(loss2, 0xff, (size_t)N * 4);
        EMU_OK(fl_cuemu_cross_entropy_dbf16(loss2, dp, xp, tg, N, V, ld, gs, FL_IGNORE_INDEX, EMU_WORK, NULL));
        size_t badp = 0, padw = 0;
        for (int n = 0; n < N; n++)
            for (int v = 0; v < ld; v++) {
                const uint16_t g = dp[(size_t)n * ld + v];
                if (v < V) badp += g != d16[(size_t)n * V + v];
                else padw += g != 0x7e5a;
            }
        FL_CHECKF(memcmp(loss2, loss, (size_t)N * 4) == 0 && badp == 0 && padw == 0,
                  "%s: cross_entropy_dbf16 over rows of %d: loss %s, %zu gradient elements differ from the compact "
                  "rows', %zu padding elements written", what, ld, memcmp(loss2, loss, (size_t)N * 4) ? "differs" : "equal",
                  badp, padw);
        free(xp), free(dp);
        free(d16);
        free(loss); free(dl); free(loss2); free(xa);
    }
    free(x); free(tg); free(want); free(closs); free(cdl);
}

FL_TEST(cuda_emu_cross_entropy) {
    xent_case(9, 101, 3.0f, 0); /* 4 warps, the last partial */
    xent_case(5, 1301, 2.0f, 1); /* 256 threads, several elements each, growing max */
    xent_case(3, 7, 1.0f, 0);   /* fewer elements than lanes: empty (m, s) pairs merge */
}

/* ---- AdamW ---------------------------------------------------------------------------------- */

FL_TEST(cuda_emu_adamw) {
    fl_backend be = cpu2();
    const size_t sizes[] = {103, 1037}; /* one block; five, the last partial */
    for (int si = 0; si < 2; si++) {
        size_t n = sizes[si];
        fl_test_rng r = {12 + (unsigned long long)n};
        float *p = fl_test_frand(&r, n, -1, 1), *m = calloc(n, 4), *v = calloc(n, 4);
        float *cp = fl_test_fdup(p, n), *cm = calloc(n, 4), *cv = calloc(n, 4);
        double *dp = malloc(n * 8), *dm = calloc(n, 8), *dv = calloc(n, 8);
        for (size_t i = 0; i < n; i++) dp[i] = p[i];
        const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, gs = 0.5f;
        for (int step = 1; step <= 4; step++) {
            fl_cu_emu_set_seed(k_seeds[step & 1]);
            float *g = fl_test_frand(&r, n, -2, 2);
            g[0] = 0.0f;
            g[1] = 1e-6f;
            EMU_OK(fl_cuemu_adamw_update(p, g, m, v, n, lr, b1, b2, eps, wd, step, gs, NULL));
            be.adamw_update(&be, cp, FL_F32, g, FL_F32, cm, cv, FL_F32, n, lr, b1, b2, eps, wd, step, gs);
            double bc1 = 1 - pow(b1, step), bc2 = 1 - pow(b2, step);
            for (size_t i = 0; i < n; i++) {
                double gi = (double)g[i] * gs;
                dp[i] *= 1 - (double)lr * wd;
                dm[i] = b1 * dm[i] + (1 - (double)b1) * gi;
                dv[i] = b2 * dv[i] + (1 - (double)b2) * gi * gi;
                dp[i] -= lr / bc1 * dm[i] / (sqrt(dv[i]) / sqrt(bc2) + eps);
            }
            free(g);
        }
        float *wp = malloc(n * 4), *wm = malloc(n * 4), *wv = malloc(n * 4);
        for (size_t i = 0; i < n; i++) { wp[i] = (float)dp[i]; wm[i] = (float)dm[i]; wv[i] = (float)dv[i]; }
        FL_CHECK(fl_test_allclose("emu adamw p", p, wp, n, 1e-5, 1e-7));
        FL_CHECK(fl_test_allclose("emu adamw m", m, wm, n, 1e-5, 1e-7));
        FL_CHECK(fl_test_allclose("emu adamw v", v, wv, n, 1e-5, 1e-9));
        FL_CHECK(memcmp(p, cp, n * 4) == 0 && memcmp(m, cm, n * 4) == 0 && memcmp(v, cv, n * 4) == 0);
        free(p); free(m); free(v); free(cp); free(cm); free(cv); free(dp); free(dm); free(dv); free(wp); free(wm); free(wv);
    }
}

/* 16-bit storage (bf16-true: all BF16; f16 params with fp32 grads and bf16 state): bit for bit the
 * CPU backend's adamw_update_ex, which test_prec.c checks against double-then-round references. */
FL_TEST(cuda_emu_adamw_ex) {
    fl_backend be = cpu2();
    const struct { fl_dtype tp, tg, ts; } combos[] = {{FL_BF16, FL_BF16, FL_BF16}, {FL_F16, FL_F32, FL_BF16},
                                                       {FL_F32, FL_BF16, FL_F32}};
    const size_t n = 515;
    for (int c = 0; c < 3; c++) {
        fl_test_rng r = {40 + (unsigned long long)c};
        size_t sp = fl_dtype_size(combos[c].tp), sg = fl_dtype_size(combos[c].tg), ss = fl_dtype_size(combos[c].ts);
        float *pf = fl_test_frand(&r, n, -1, 1);
        void *p = malloc(n * sp), *cp = malloc(n * sp), *g = malloc(n * sg), *m = calloc(n, ss), *v = calloc(n, ss);
        void *cm = calloc(n, ss), *cv = calloc(n, ss);
        FL_REQUIRE_OK(be.convert(&be, p, combos[c].tp, pf, FL_F32, n));
        memcpy(cp, p, n * sp);
        for (int step = 1; step <= 3; step++) {
            float *gf = fl_test_frand(&r, n, -2, 2);
            FL_REQUIRE_OK(be.convert(&be, g, combos[c].tg, gf, FL_F32, n));
            EMU_OK(fl_cuemu_adamw_update_ex(p, combos[c].tp, g, combos[c].tg, m, v, combos[c].ts, n, 1e-2f, 0.9f, 0.95f,
                                            1e-8f, 0.1f, step, 0.5f, NULL));
            FL_REQUIRE_OK(be.adamw_update(&be, cp, combos[c].tp, g, combos[c].tg, cm, cv, combos[c].ts, n, 1e-2f, 0.9f,
                                             0.95f, 1e-8f, 0.1f, step, 0.5f));
            free(gf);
        }
        FL_CHECKF(memcmp(p, cp, n * sp) == 0 && memcmp(m, cm, n * ss) == 0 && memcmp(v, cv, n * ss) == 0,
                  "adamw_ex %s/%s/%s differs from the CPU backend", fl_dtype_name(combos[c].tp),
                  fl_dtype_name(combos[c].tg), fl_dtype_name(combos[c].ts));
        free(pf); free(p); free(cp); free(g); free(m); free(v); free(cm); free(cv);
    }
    int dummy = 0;
    FL_CHECK(fl_cuemu_adamw_update_ex(&dummy, FL_F64, &dummy, FL_F32, &dummy, &dummy, FL_F32, 1, 1e-2f, 0.9f, 0.95f,
                                      1e-8f, 0.f, 1, 1.f, NULL) == -1);
}

/* ---- conversions ---------------------------------------------------------------------------- */

FL_TEST(cuda_emu_convert) {
    fl_backend be = cpu2();
    const size_t n = 1000 + 37;
    fl_test_rng r = {9};
    float *src = fl_test_frand(&r, n, -70000, 70000); /* beyond f16's range: inf */
    const float special[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-40f, -3e-8f, 6.1e-5f, 65504.0f, 65520.0f,
                             1.0f + 1.0f / 256, 1.0f + 3.0f / 512, 1.0f + 1.0f / 2048, FLT_MIN, FLT_MAX};
    memcpy(src, special, sizeof special);
    for (size_t i = sizeof special / 4; i < 400; i++) src[i] *= 1e-9f; /* subnormal halves and bf16 ties */
    const fl_dtype ts[3] = {FL_F32, FL_BF16, FL_F16};
    for (int a = 0; a < 3; a++) {
        void *s = malloc(n * 4);
        FL_REQUIRE_OK(be.convert(&be, s, ts[a], src, FL_F32, n));
        for (int b = 0; b < 3; b++) {
            size_t db = fl_dtype_size(ts[b]);
            void *d = malloc(n * db), *cd = malloc(n * db);
            memset(d, 0x5a, n * db);
            EMU_OK(fl_cuemu_convert(d, ts[b], s, ts[a], n, NULL));
            FL_REQUIRE_OK(be.convert(&be, cd, ts[b], s, ts[a], n));
            FL_CHECKF(memcmp(d, cd, n * db) == 0, "convert %s -> %s differs from the CPU backend",
                      fl_dtype_name(ts[a]), fl_dtype_name(ts[b]));
            free(d); free(cd);
        }
        free(s);
    }
    FL_CHECK(fl_cuemu_convert(src, FL_F64, src, FL_F32, 1, NULL) == -1);
    free(src);
}

/* ---- LayerNorm (two block sums in a row: the reduction's trailing barrier matters) ----------------- */

static void layernorm_case(int N, int C, int with_bias) {
    fl_backend be = cpu2();
    fl_test_rng r = {(unsigned long long)(N * 977 + C + with_bias)};
    const float eps = 1e-5f;
    size_t nc = (size_t)N * C;
    float *x = fl_test_frand(&r, nc, -2, 2), *w = fl_test_frand(&r, C, 0.5f, 1.5f), *b = fl_test_frand(&r, C, -1, 1), *dy = fl_test_frand(&r, nc, -1, 1);
    for (int k = 0; k < C; k++) x[(size_t)(N / 2) * C + k] += 3.0f; /* a row with a large mean */
    float *want = malloc(nc * 4), *wm = malloc((size_t)N * 4), *wr = malloc((size_t)N * 4);
    for (int n = 0; n < N; n++) { /* float64 reference, two-pass variance */
        const float *xr = x + (size_t)n * C;
        double mu = 0, v = 0;
        for (int k = 0; k < C; k++) mu += xr[k];
        mu /= C;
        for (int k = 0; k < C; k++) v += (xr[k] - mu) * (xr[k] - mu);
        double rs = 1.0 / sqrt(v / C + eps);
        wm[n] = (float)mu;
        wr[n] = (float)rs;
        for (int k = 0; k < C; k++) want[(size_t)n * C + k] = (float)((xr[k] - mu) * rs * w[k] + (with_bias ? b[k] : 0.0));
    }
    const float *bb = with_bias ? b : NULL;
    float *dx0 = fl_test_frand(&r, nc, -1, 1), *dw0 = fl_test_frand(&r, C, -1, 1), *db0 = fl_test_frand(&r, C, -1, 1);
    float *cdx = fl_test_fdup(dx0, nc), *cdw = fl_test_fdup(dw0, C), *cdb = fl_test_fdup(db0, C), *cm = malloc((size_t)N * 4);
    float *cr = malloc((size_t)N * 4), *co = malloc(nc * 4);
    be.layernorm_forward(&be, co, cm, cr, x, w, bb, N, C, eps);
    be.layernorm_backward(&be, cdx, cdw, cdb, dy, x, w, cm, cr, N, C);
    for (size_t k = 0; k < sizeof k_seeds / sizeof k_seeds[0]; k++) {
        fl_cu_emu_set_seed(k_seeds[k]);
        float *out = malloc(nc * 4), *mean = malloc((size_t)N * 4), *rstd = malloc((size_t)N * 4);
        float *dx = fl_test_fdup(dx0, nc), *dw = fl_test_fdup(dw0, C), *db = fl_test_fdup(db0, C);
        EMU_OK(fl_cuemu_layernorm_forward(out, mean, rstd, x, w, bb, N, C, eps, NULL));
        FL_CHECK(fl_test_allclose("emu layernorm out", out, want, nc, 1e-5, 1e-6));
        FL_CHECK(fl_test_allclose("emu layernorm rstd", rstd, wr, N, 1e-5, 0));
        FL_CHECK(fl_test_allclose("emu layernorm mean", mean, wm, N, 1e-5, 1e-6));
        EMU_OK(fl_cuemu_layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, N, C, EMU_WORK, NULL));
        FL_CHECKF(grad_close("emu layernorm dinp", dx, cdx, nc), "N%d C%d dinp", N, C);
        FL_CHECKF(grad_close("emu layernorm dw", dw, cdw, C), "N%d C%d dw", N, C);
        FL_CHECKF(grad_close("emu layernorm db", db, cdb, C), "N%d C%d db", N, C);
        free(out); free(mean); free(rstd); free(dx); free(dw); free(db);
    }
    free(x); free(w); free(b); free(dy); free(want); free(wm); free(wr); free(dx0); free(dw0); free(db0);
    free(cdx); free(cdw); free(cdb); free(cm); free(cr); free(co);
}

FL_TEST(cuda_emu_layernorm) {
    layernorm_case(7, 13, 1);
    layernorm_case(5, 300, 0);
    layernorm_case(4, 97, 1);
    layernorm_case(389, 19, 1); /* dw/db's column sum: 3 row groups and a remainder */
}

/* ---- activations ------------------------------------------------------------------------------ */

FL_TEST(cuda_emu_swiglu_gelu) {
    fl_backend be = cpu2();
    fl_test_rng r = {8};
    const int N = 7, F = 13, n = 301;
    float *gu = fl_test_frand(&r, (size_t)N * 2 * F, -4, 4), *dy = fl_test_frand(&r, (size_t)N * F, -1, 1);
    gu[0] = -30.0f; gu[1] = 30.0f; /* saturated sigmoid */
    float *x = fl_test_frand(&r, n, -5, 5), *dyg = fl_test_frand(&r, n, -1, 1);
    x[0] = 0.0f; x[1] = 1e-3f; x[2] = -12.0f; x[3] = 12.0f;
    float *ws = malloc((size_t)N * F * 4), *wg = malloc((size_t)n * 4);
    for (int k = 0; k < N; k++)
        for (int i = 0; i < F; i++) { /* float64 references (test_ops.c) */
            double g = gu[(size_t)k * 2 * F + i], u = gu[(size_t)k * 2 * F + F + i];
            ws[(size_t)k * F + i] = (float)(g / (1 + exp(-g)) * u);
        }
    for (int i = 0; i < n; i++) {
        double v = x[i];
        wg[i] = (float)(0.5 * v * (1 + tanh(sqrt(2 / M_PI) * (v + 0.044715 * v * v * v))));
    }
    float *dgu0 = fl_test_frand(&r, (size_t)N * 2 * F, -1, 1), *dx0 = fl_test_frand(&r, n, -1, 1);
    float *cdgu = fl_test_fdup(dgu0, (size_t)N * 2 * F), *cdx = fl_test_fdup(dx0, n);
    be.swiglu_backward(&be, cdgu, dy, gu, N, F);
    be.gelu_backward(&be, cdx, dyg, x, n);
    for (size_t k = 0; k < sizeof k_seeds / sizeof k_seeds[0]; k++) {
        fl_cu_emu_set_seed(k_seeds[k]);
        float *o = malloc((size_t)N * F * 4), *og = malloc((size_t)n * 4);
        float *dgu = fl_test_fdup(dgu0, (size_t)N * 2 * F), *dx = fl_test_fdup(dx0, n);
        EMU_OK(fl_cuemu_swiglu_forward(o, gu, N, F, NULL));
        FL_CHECK(fl_test_allclose("emu swiglu fwd", o, ws, (size_t)N * F, 1e-5, 1e-7));
        EMU_OK(fl_cuemu_swiglu_backward(dgu, dy, gu, N, F, NULL));
        FL_CHECK(grad_close("emu swiglu dgu", dgu, cdgu, (size_t)N * 2 * F));
        EMU_OK(fl_cuemu_gelu_forward(og, x, n, NULL));
        FL_CHECK(fl_test_allclose("emu gelu fwd", og, wg, n, 1e-5, 1e-7));
        EMU_OK(fl_cuemu_gelu_backward(dx, dyg, x, n, NULL));
        FL_CHECK(grad_close("emu gelu dinp", dx, cdx, n));
        free(o); free(og); free(dgu); free(dx);
    }
    free(gu); free(dy); free(x); free(dyg); free(ws); free(wg); free(dgu0); free(dx0); free(cdgu); free(cdx);
}

/* ---- RoPE ------------------------------------------------------------------------------------- */

FL_TEST(cuda_emu_rope) {
    fl_backend be = cpu2();
    fl_test_rng r = {21};
    const int B = 2, T = 5, nh = 3, HD = 12, maxT = 16, pos0 = 3, H = HD / 2;
    const size_t rs = (size_t)nh * HD + 7; /* strided rows (heads of a fused QKV row); the tail is untouched */
    float *cs = malloc((size_t)maxT * H * 4), *sn = malloc((size_t)maxT * H * 4);
    fl_rope_table_init(cs, sn, maxT, HD, 10000.0f, NULL);
    size_t nx = (size_t)B * T * rs;
    float *x = fl_test_frand(&r, nx, -2, 2), *want = fl_test_fdup(x, nx), *cx = fl_test_fdup(x, nx);
    for (int n = 0; n < B * T; n++) /* float64 reference */
        for (int h = 0; h < nh; h++)
            for (int j = 0; j < H; j++) {
                size_t o = (size_t)n * rs + (size_t)h * HD + j;
                double a = pos0 + n % T, c = cs[(size_t)(pos0 + n % T) * H + j], s_ = sn[(size_t)(pos0 + n % T) * H + j];
                (void)a;
                want[o] = (float)(x[o] * c - x[o + H] * s_);
                want[o + H] = (float)(x[o + H] * c + x[o] * s_);
            }
    be.rope_forward(&be, cx, B, T, nh, HD, rs, cs, sn, pos0);
    fl_cu_emu_set_seed(k_seeds[0]);
    float *y = fl_test_fdup(x, nx);
    EMU_OK(fl_cuemu_rope(y, B, T, nh, HD, rs, cs, sn, pos0, 0, NULL));
    FL_CHECK(fl_test_allclose("emu rope fwd", y, want, nx, 1e-6, 1e-7));
    FL_CHECK(fl_test_allclose("emu rope fwd vs cpu", y, cx, nx, 1e-6, 1e-7));
    EMU_OK(fl_cuemu_rope(y, B, T, nh, HD, rs, cs, sn, pos0, 1, NULL)); /* backward = the inverse rotation */
    FL_CHECK(fl_test_allclose("emu rope bwd(fwd(x))", y, x, nx, 1e-6, 1e-6));
    be.rope_backward(&be, cx, B, T, nh, HD, rs, cs, sn, pos0);
    FL_CHECK(fl_test_allclose("emu rope bwd vs cpu", y, cx, nx, 1e-6, 1e-7));
    free(cs); free(sn); free(x); free(want); free(cx); free(y);
}

/* ---- SGD, check_finite, accumulate16, sumsq, add/scale/bias --------------------------------------- */

FL_TEST(cuda_emu_sgd) {
    fl_backend be = cpu2();
    const struct { fl_dtype tp, tg, ts; float mom; int nesterov; } cs[] = {
        {FL_F32, FL_F32, FL_F32, 0.9f, 1}, {FL_BF16, FL_BF16, FL_BF16, 0.9f, 0}, {FL_F32, FL_F16, FL_F32, 0.0f, 0}};
    const size_t n = 777;
    for (int c = 0; c < 3; c++) {
        fl_test_rng r = {60 + (unsigned long long)c};
        size_t sp = fl_dtype_size(cs[c].tp), sg = fl_dtype_size(cs[c].tg), ss = fl_dtype_size(cs[c].ts);
        float *pf = fl_test_frand(&r, n, -1, 1);
        void *p = malloc(n * sp), *cp = malloc(n * sp), *g = malloc(n * sg);
        void *buf = cs[c].mom != 0.0f ? calloc(n, ss) : NULL, *cbuf = cs[c].mom != 0.0f ? calloc(n, ss) : NULL;
        FL_REQUIRE_OK(be.convert(&be, p, cs[c].tp, pf, FL_F32, n));
        memcpy(cp, p, n * sp);
        for (int step = 1; step <= 3; step++) {
            float *gf = fl_test_frand(&r, n, -2, 2);
            FL_REQUIRE_OK(be.convert(&be, g, cs[c].tg, gf, FL_F32, n));
            fl_cu_emu_set_seed(k_seeds[step & 1]);
            EMU_OK(fl_cuemu_sgd_update_ex(p, cs[c].tp, g, cs[c].tg, buf, cs[c].ts, n, 0.05f, cs[c].mom, 0.1f, 0.01f,
                                          cs[c].nesterov, step == 1, 0.5f, NULL));
            FL_REQUIRE_OK(be.sgd_update(&be, cp, cs[c].tp, g, cs[c].tg, cbuf, cs[c].ts, n, 0.05f, cs[c].mom, 0.1f,
                                           0.01f, cs[c].nesterov, step == 1, 0.5f));
            free(gf);
        }
        FL_CHECKF(memcmp(p, cp, n * sp) == 0 && (!buf || memcmp(buf, cbuf, n * ss) == 0),
                  "sgd %s/%s/%s differs from the CPU backend", fl_dtype_name(cs[c].tp), fl_dtype_name(cs[c].tg),
                  fl_dtype_name(cs[c].ts));
        free(pf); free(p); free(cp); free(g); free(buf); free(cbuf);
    }
}

FL_TEST(cuda_emu_check_finite_accumulate16) {
    fl_backend be = cpu2();
    const size_t n = 600;
    fl_test_rng r = {70};
    float *x = fl_test_frand(&r, n, -100, 100);
    const fl_dtype ts[3] = {FL_F32, FL_BF16, FL_F16};
    for (int k = 0; k < 3; k++) {
        void *v = malloc(n * 4);
        for (int variant = 0; variant < 4; variant++) {
            float *y = fl_test_fdup(x, n);
            if (variant == 1) y[517] = INFINITY;
            if (variant == 2) y[3] = NAN;
            float inv = variant == 3 ? 1e37f : 0.5f; /* 3: finite values overflow once scaled */
            FL_REQUIRE_OK(be.convert(&be, v, ts[k], y, FL_F32, n));
            int fe = 0, fc = 0;
            EMU_OK(fl_cuemu_check_finite(v, ts[k], n, inv, &fe, NULL));
            FL_REQUIRE_OK(be.check_finite(&be, v, ts[k], n, inv, &fc));
            FL_CHECKF(fe == fc && fe == (variant != 0), "check_finite %s variant %d: emu %d cpu %d",
                      fl_dtype_name(ts[k]), variant, fe, fc);
            free(y);
        }
        if (k > 0) { /* accumulate16 into 16-bit storage: bit for bit */
            uint16_t *a = malloc(n * 2), *ca = malloc(n * 2);
            float *src = fl_test_frand(&r, n, -3, 3);
            FL_REQUIRE_OK(be.convert(&be, a, ts[k], x, FL_F32, n));
            memcpy(ca, a, n * 2);
            EMU_OK(fl_cuemu_accumulate16(a, ts[k], src, n, NULL));
            FL_REQUIRE_OK(be.accumulate16(&be, ca, ts[k], src, n));
            FL_CHECKF(memcmp(a, ca, n * 2) == 0, "accumulate16 %s differs", fl_dtype_name(ts[k]));
            free(a); free(ca); free(src);
        }
        free(v);
    }
    free(x);
}

FL_TEST(cuda_emu_sumsq) {
    fl_backend be = cpu2();
    const size_t n = 20011; /* ranges of 312-313 elements: partial strides in every block */
    fl_test_rng r = {80};
    float *x = fl_test_frand(&r, n, -3, 3);
    const fl_dtype ts[3] = {FL_F32, FL_BF16, FL_F16};
    double work[FL_CU_SUMSQ_PARTS];
    for (int k = 0; k < 3; k++) {
        void *v = malloc(n * 4);
        FL_REQUIRE_OK(be.convert(&be, v, ts[k], x, FL_F32, n));
        float *w = malloc(n * 4);
        FL_REQUIRE_OK(be.convert(&be, w, FL_F32, v, ts[k], n));
        double want = 0; /* float64 of the stored values: exact squares, error ~ n * 2^-53 relative */
        for (size_t i = 0; i < n; i++) want += (double)w[i] * w[i];
        double got[2];
        for (int s = 0; s < 2; s++) {
            fl_cu_emu_set_seed(k_seeds[s]);
            EMU_OK(fl_cuemu_sumsq_ex(&got[s], work, v, ts[k], n, NULL));
        }
        FL_CHECKF(fabs(got[0] - want) <= 1e-12 * want, "sumsq %s: %.17g want %.17g", fl_dtype_name(ts[k]), got[0], want);
        FL_CHECKF(memcmp(&got[0], &got[1], sizeof(double)) == 0, "sumsq %s: depends on the fiber order", fl_dtype_name(ts[k]));
        FL_CHECK(fabs(be.sumsq(&be, v, ts[k], n) - want) <= 1e-12 * want);
        free(v); free(w);
    }
    free(x);
}

FL_TEST(cuda_emu_add_scale_bias) {
    fl_backend be = cpu2();
    fl_test_rng r = {90};
    const int N = 9, OC = 37;
    const size_t n = (size_t)N * OC;
    float *a = fl_test_frand(&r, n, -1, 1), *b = fl_test_frand(&r, n, -1, 1), *o = malloc(n * 4), *co = malloc(n * 4);
    EMU_OK(fl_cuemu_add(o, a, b, n, NULL));
    be.add(&be, co, a, b, n);
    FL_CHECK(memcmp(o, co, n * 4) == 0);
    EMU_OK(fl_cuemu_scale(o, n, -0.3f, NULL));
    be.scale(&be, co, n, -0.3f);
    FL_CHECK(memcmp(o, co, n * 4) == 0);
    float *bias = fl_test_frand(&r, OC, -1, 1);
    EMU_OK(fl_cuemu_bias_forward(o, bias, N, OC, NULL));
    be.bias_forward(&be, co, bias, N, OC);
    FL_CHECK(memcmp(o, co, n * 4) == 0);
    float *db = fl_test_frand(&r, OC, -1, 1), *cdb = fl_test_fdup(db, OC);
    EMU_OK(fl_cuemu_bias_backward(db, a, N, OC, EMU_WORK, NULL));
    be.bias_backward(&be, cdb, a, N, OC);
    FL_CHECK(grad_close("emu bias db", db, cdb, OC));
    free(a); free(b); free(o); free(co); free(bias); free(db); free(cdb);
}
#endif

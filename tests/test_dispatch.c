/* Run-time CPU dispatch: the level API (include/fitllm/cpu.h), and every SIMD variant the CPU
 * has against the scalar code it replaces, bit for bit: 16-bit conversions (core/cvt.c, through
 * fl_convert, the backend's convert and accumulate16) and the 8-bit optimizer's quantizer and
 * update. Variants the CPU lacks are reported and skipped. Run: fitllm_tests dispatch */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu-impl.h"
#include "core/cvt.h"
#include "fitllm/cpu.h"
#include "test.h"

/* Levels to test: those the CPU has; prints the others. Returns how many. */
static int test_levels(int *lv) {
    int n = 0;
    for (int l = FL_CPU_GENERIC; l <= FL_CPU_AVX512; l++) {
        if (l > (int)fl_cpu_level_detected())
            fprintf(stderr, "  level %s: not on this CPU, skipped\n", fl_cpu_level_name((fl_cpu_level_t)l));
        else
            lv[n++] = l;
    }
    return n;
}

static float f_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

FL_TEST(dispatch_cpu_levels) {
    unsigned f = fl_cpu_features_detected();
    fl_cpu_level_t hw = fl_cpu_level_detected();
    fprintf(stderr, "  cpu: %s; level %s (in use: %s)\n", fl_cpu_features_string(), fl_cpu_level_name(hw),
            fl_cpu_level_name(fl_cpu_level()));
    FL_CHECK(fl_cpu_level() <= hw);
    FL_CHECK((hw >= FL_CPU_AVX2) == ((f & (FL_CPU_F_AVX2 | FL_CPU_F_FMA | FL_CPU_F_F16C)) ==
                                     (FL_CPU_F_AVX2 | FL_CPU_F_FMA | FL_CPU_F_F16C)));
    FL_CHECK(((f & FL_CPU_F_AVX2) != 0) == (strstr(fl_cpu_features_string(), "avx2") != NULL));
    /* the cap clamps to the hardware and lowers the usable features */
    FL_CHECK(fl_cpu_set_level(FL_CPU_AVX512 + 5) == hw);
    FL_CHECK(fl_cpu_set_level(FL_CPU_GENERIC) == FL_CPU_GENERIC);
    FL_CHECK(fl_cpu_features() == (f & ~(unsigned)(FL_CPU_F_AVX2 | FL_CPU_F_FMA | FL_CPU_F_F16C | FL_CPU_F_AVX512F |
                                                   FL_CPU_F_AVX512BW | FL_CPU_F_AVX512VL | FL_CPU_F_AVX512BF16)));
    FL_CHECK(!fl_cpu_has_avx512bf16());
    FL_CHECK(!strcmp(fl_cvt_path(), "scalar") && !strcmp(fl_cpu_adam8bit_quantizer_path(), "scalar-table"));
    fl_cpu_kernel_info k;
    fl_cpu_kernels(&k);
    FL_CHECK(!strcmp(k.cpu_level, "generic") && !strcmp(k.gemm_library, fl_cpu_gemm_library()) && k.threads >= 1);
    const char *env = getenv("FITLLM_BF16_GEMM");
    if (!env && strcmp(fl_cpu_gemm_library(), "naive")) /* library build, no override: widening, scalar */
        FL_CHECKF(!strcmp(k.bf16_gemm, "widen+sgemm"), "bf16 path at generic: %s", k.bf16_gemm);
    fl_cpu_set_level(-1);
    fl_cpu_kernels(&k);
    fprintf(stderr, "  kernels: level %s, gemm %s, bf16 %s, f16 %s, adam8bit %s, convert %s, threads %d\n", k.cpu_level,
            k.gemm_library, k.bf16_gemm, k.f16_gemm, k.adam8bit, k.convert, k.threads);
    if (hw >= FL_CPU_AVX2 && fl_cpu_level() >= FL_CPU_AVX2)
        FL_CHECK(strcmp(k.convert, "scalar") != 0 && strcmp(k.adam8bit, "scalar") != 0);
}

/* fp32 inputs that exercise every rounding case of both 16-bit formats: for every bf16 and
 * every f16 value h, the midpoint to the next value (a tie: exact in fp32) and the floats
 * either side of it, the value itself; every NaN class (quiet, signalling, payloads, both
 * signs), +-inf, +-0, fp32 subnormals; then random bit patterns. */
static float *conversion_inputs(size_t *n_out) {
    size_t n = 65536 * 4 + 65536 * 4 + 64 + 500000, k = 0;
    float *x = malloc(n * sizeof(float));
    for (uint32_t h = 0; h < 65536; h++) {
        uint32_t b = h << 16;
        x[k++] = f_of(b), x[k++] = f_of(b | 0x8000), x[k++] = f_of(b | 0x7fff), x[k++] = f_of(b | 0x8001);
    }
    for (uint32_t h = 0; h < 65536; h++) {
        float v = fl_f16_to_f32((uint16_t)h);
        x[k++] = v;
        if ((h & 0x7c00) == 0x7c00 || (h & 0x7fff) == 0x7bff) { /* inf/NaN, largest finite: neighbours */
            x[k++] = nextafterf(v, 0), x[k++] = nextafterf(v, INFINITY), x[k++] = -v;
            continue;
        }
        double next = fl_f16_to_f32((uint16_t)(h + 1)), mid = ((double)v + next) / 2; /* exact in fp32 */
        float m = (float)mid;
        x[k++] = m, x[k++] = nextafterf(m, -INFINITY), x[k++] = nextafterf(m, INFINITY);
    }
    const uint32_t sp[] = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fbfffffu,
                           0x7fffffffu, 0xffffffffu, 0x7f80ffffu, 0x7f810000u, 0x7fa00000u, 0x00000001u, 0x80000001u,
                           0x007fffffu, 0x807fffffu, 0x00800000u, 0x7f7fffffu, 0xff7fffffu, 0x7f7f8000u, 0x477ff000u,
                           0x477fefffu, 0xc77ff000u, 0x33000000u, 0x33000001u, 0x32ffffffu, 0x38800000u, 0x387fffffu,
                           0x387ff000u, 0x00000000u, 0x80000000u, 0x3f808000u, 0x3f818000u, 0x3f800001u};
    for (size_t i = 0; i < sizeof sp / sizeof sp[0]; i++) x[k++] = f_of(sp[i]);
    fl_test_rng rng = {2024};
    while (k < n) x[k++] = f_of((uint32_t)fl_test_rng_u64(&rng));
    *n_out = n;
    return x;
}

static size_t count_diff(const void *a, const void *b, size_t n, size_t elem, size_t *first) {
    size_t d = 0;
    for (size_t i = 0; i < n; i++)
        if (memcmp((const char *)a + i * elem, (const char *)b + i * elem, elem)) {
            if (!d) *first = i;
            d++;
        }
    return d;
}

FL_TEST(dispatch_convert_variants_bit_exact) {
    size_t n;
    float *x = conversion_inputs(&n);
    uint16_t *all16 = malloc(65536 * 2);
    for (uint32_t h = 0; h < 65536; h++) all16[h] = (uint16_t)h;
    /* scalar references */
    uint16_t *rb = malloc(n * 2), *rh = malloc(n * 2), *got16 = malloc(n * 2);
    float *rr = malloc(n * 4), *wb = calloc(65536, 4), *wh = calloc(65536, 4), *gotf = malloc(n * 4);
    for (size_t i = 0; i < n; i++) {
        rb[i] = fl_f32_to_bf16(x[i]);
        rh[i] = fl_f32_to_f16(x[i]);
        rr[i] = fl_bf16_to_f32(rb[i]);
    }
    for (uint32_t h = 0; h < 65536; h++) wb[h] = fl_bf16_to_f32((uint16_t)h), wh[h] = fl_f16_to_f32((uint16_t)h);
    fl_backend be;
    fl_cpu_backend_init(&be, 2);
    int lv[3], nl = test_levels(lv);
    for (int li = 0; li < nl; li++) {
        fl_cpu_set_level(lv[li]);
        const char *L = fl_cpu_level_name((fl_cpu_level_t)lv[li]);
        size_t first = 0, d;
        /* odd start and length: the SIMD bodies and the scalar tails */
        for (int off = 0; off < 2; off++) {
            size_t m = n - off - 3;
            fl_cvt_f32_to_bf16(got16 + off, x + off, m);
            d = count_diff(got16 + off, rb + off, m, 2, &first);
            FL_CHECKF(d == 0, "%s f32->bf16: %zu differ, first x=%08x got %04x want %04x", L, d,
                      ((uint32_t *)x)[off + first], got16[off + first], rb[off + first]);
            fl_cvt_f32_to_f16(got16 + off, x + off, m);
            d = count_diff(got16 + off, rh + off, m, 2, &first);
            FL_CHECKF(d == 0, "%s f32->f16: %zu differ, first x=%08x got %04x want %04x", L, d,
                      ((uint32_t *)x)[off + first], got16[off + first], rh[off + first]);
            fl_cvt_f32_round_bf16(gotf + off, x + off, m);
            d = count_diff(gotf + off, rr + off, m, 4, &first);
            FL_CHECKF(d == 0, "%s f32 round bf16: %zu differ", L, d);
            fl_cvt_bf16_to_f32(gotf + off, all16 + off, 65536 - off - 3);
            d = count_diff(gotf + off, wb + off, 65536 - off - 3, 4, &first);
            FL_CHECKF(d == 0, "%s bf16->f32: %zu differ", L, d);
            fl_cvt_f16_to_f32(gotf + off, all16 + off, 65536 - off - 3);
            d = count_diff(gotf + off, wh + off, 65536 - off - 3, 4, &first);
            FL_CHECKF(d == 0, "%s f16->f32: %zu differ, first h=%04zx got %08x want %08x", L, d, first + off,
                      ((uint32_t *)gotf)[off + first], ((uint32_t *)wh)[off + first]);
        }
        /* in place rounding */
        memcpy(gotf, x, n * 4);
        fl_cvt_f32_round_bf16(gotf, gotf, n);
        FL_CHECKF(count_diff(gotf, rr, n, 4, &first) == 0, "%s f32 round bf16 in place", L);
        /* the public and backend bulk conversions on top */
        for (int t = 0; t < 2; t++) {
            fl_dtype d16 = t ? FL_F16 : FL_BF16;
            const uint16_t *want16 = t ? rh : rb;
            const float *wantw = t ? wh : wb;
            FL_REQUIRE(fl_convert(got16, d16, x, FL_F32, n) == 0);
            FL_CHECKF(count_diff(got16, want16, n, 2, &first) == 0, "%s fl_convert F32->%s", L, fl_dtype_name(d16));
            FL_REQUIRE_OK(be.convert(&be, got16, d16, x, FL_F32, n));
            FL_CHECKF(count_diff(got16, want16, n, 2, &first) == 0, "%s convert F32->%s", L, fl_dtype_name(d16));
            FL_REQUIRE(fl_convert(gotf, FL_F32, all16, d16, 65536) == 0);
            FL_CHECKF(count_diff(gotf, wantw, 65536, 4, &first) == 0, "%s fl_convert %s->F32", L, fl_dtype_name(d16));
            FL_REQUIRE_OK(be.convert(&be, gotf, FL_F32, all16, d16, 65536));
            FL_CHECKF(count_diff(gotf, wantw, 65536, 4, &first) == 0, "%s convert %s->F32", L, fl_dtype_name(d16));
            /* 16 -> other 16 through fp32 */
            fl_dtype o = t ? FL_BF16 : FL_F16;
            uint16_t *w2 = malloc(65536 * 2);
            for (uint32_t h = 0; h < 65536; h++) w2[h] = o == FL_BF16 ? fl_f32_to_bf16(wantw[h]) : fl_f32_to_f16(wantw[h]);
            FL_REQUIRE(fl_convert(got16, o, all16, d16, 65536) == 0);
            FL_CHECKF(count_diff(got16, w2, 65536, 2, &first) == 0, "%s fl_convert %s->%s", L, fl_dtype_name(d16),
                      fl_dtype_name(o));
            FL_REQUIRE_OK(be.convert(&be, got16, o, all16, d16, 65536));
            FL_CHECKF(count_diff(got16, w2, 65536, 2, &first) == 0, "%s convert %s->%s", L, fl_dtype_name(d16),
                      fl_dtype_name(o));
            free(w2);
            /* accumulate16: dst = round(widen(dst) + src) */
            size_t na = 200003;
            uint16_t *acc = malloc(na * 2), *want = malloc(na * 2);
            fl_test_rng rng = {(unsigned long long)(77 + t)};
            for (size_t i = 0; i < na; i++) {
                acc[i] = (uint16_t)fl_test_rng_u64(&rng);
                float a = t ? fl_f16_to_f32(acc[i]) : fl_bf16_to_f32(acc[i]);
                /* NaN + NaN: which payload x86 keeps depends on the operand order, which the
                 * compiler may swap (the add is commutative): not the conversions' business */
                if (isnan(a) && isnan(x[i])) acc[i] = 0, a = 0;
                volatile float s = a + x[i]; /* one IEEE add, as the kernel */
                want[i] = t ? fl_f32_to_f16(s) : fl_f32_to_bf16(s);
            }
            FL_REQUIRE_OK(be.accumulate16(&be, acc, d16, x, na));
            d = count_diff(acc, want, na, 2, &first);
            FL_CHECKF(d == 0, "%s accumulate16 %s: %zu differ, first x=%08x got %04x want %04x", L, fl_dtype_name(d16), d,
                      ((uint32_t *)x)[first], acc[first], want[first]);
            free(acc), free(want);
        }
    }
    fl_cpu_set_level(-1);
    free(x), free(all16), free(rb), free(rh), free(got16), free(rr), free(wb), free(wh), free(gotf);
}

/* The table quantizer (backend/cpu/adam8bit.c) against bnb's search over every float bit pattern, both code tables, at
 * every level this CPU has: 2 x 2^32 values, ~2 minutes a level, so only with FITLLM_TEST_EXHAUSTIVE=1 (run when the
 * table was written: 0 differ, AVX2 and generic; the quick tier checks every code, midpoint and neighbour and random
 * bit patterns in dispatch_adam8bit_variants_bit_exact). */
FL_TEST(dispatch_adam8bit_table_exhaustive) {
    const char *e = getenv("FITLLM_TEST_EXHAUSTIVE");
    if (!e || strcmp(e, "1")) {
        fl_test_skip("FITLLM_TEST_EXHAUSTIVE=1 runs it (every float, ~2 minutes a level)");
        return;
    }
    int lv[3], nl = test_levels(lv);
    enum { CH = 1 << 16 };
    float *x = malloc(CH * 4);
    uint8_t *got = malloc(CH);
    FL_REQUIRE(x && got);
    for (int li = 0; li < nl; li++) {
        fl_cpu_set_level(lv[li]);
        for (int sgn = 0; sgn < 2; sgn++) {
            const float *code = sgn ? fl_adam8bit_code_signed : fl_adam8bit_code_unsigned;
            uint64_t bad = 0, first = 0;
            for (uint64_t u0 = 0; u0 < (1ull << 32); u0 += CH) {
                for (uint32_t i = 0; i < CH; i++) {
                    const uint32_t u = (uint32_t)(u0 + i);
                    memcpy(&x[i], &u, 4);
                }
                fl_adam8bit_quantize_n(code, sgn, x, CH, got);
                for (uint32_t i = 0; i < CH; i++)
                    if (got[i] != fl_adam8bit_quantize(code, sgn, x[i]) && !bad++) first = u0 + i;
            }
            FL_CHECKF(bad == 0, "%s %s: %llu of 2^32 differ, first bits 0x%08llx", fl_cpu_level_name((fl_cpu_level_t)lv[li]),
                      sgn ? "signed" : "unsigned", (unsigned long long)bad, (unsigned long long)first);
            printf("      %s %s quantizer (%s): every float, %llu differ\n", fl_cpu_level_name((fl_cpu_level_t)lv[li]),
                   sgn ? "signed" : "unsigned", fl_cpu_adam8bit_quantizer_path(), (unsigned long long)bad);
        }
    }
    fl_cpu_set_level(FL_CPU_AVX512 + 5);
    free(x), free(got);
}

FL_TEST(dispatch_adam8bit_variants_bit_exact) {
    int lv[3], nl = test_levels(lv);
    /* the quantizer on random values, every code, every midpoint and its neighbours, NaN, inf */
    size_t n = 0, cap = 300000;
    float *x = malloc(cap * 4);
    uint8_t *want = malloc(cap), *got = malloc(cap);
    fl_test_rng rng = {5};
    for (int sgn = 0; sgn < 2; sgn++) {
        const float *code = sgn ? fl_adam8bit_code_signed : fl_adam8bit_code_unsigned;
        n = 0;
        for (int i = 0; i < 100000; i++) {
            float v = fl_test_rng_uniform(&rng, sgn ? -1.0f : 0.0f, 1.0f);
            x[n++] = i % 3 ? v : v * v * v * v; /* small magnitudes too */
        }
        for (int c = 0; c < 256; c++) {
            float mid = c < 255 ? (code[c] + code[c + 1]) * 0.5f : code[c];
            x[n++] = code[c], x[n++] = mid, x[n++] = nextafterf(mid, -2), x[n++] = nextafterf(mid, 2);
        }
        const float sp[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1.5f, -1.5f, 1e-30f, -1e-30f};
        for (size_t i = 0; i < sizeof sp / sizeof sp[0]; i++) x[n++] = sp[i];
        for (int i = 0; i < 50000; i++) { /* any bit pattern: NaN payloads, denormals, huge values, every bucket */
            uint32_t u = (uint32_t)(fl_test_rng_u64(&rng) >> 32);
            memcpy(&x[n++], &u, 4);
        }
        n -= 5; /* odd length: the scalar tail too */
        for (size_t i = 0; i < n; i++) want[i] = fl_adam8bit_quantize(code, sgn, x[i]);
        for (int li = 0; li < nl; li++) {
            fl_cpu_set_level(lv[li]);
            fl_adam8bit_quantize_n(code, sgn, x, (int)n, got);
            size_t first = 0, d = count_diff(got, want, n, 1, &first);
            FL_CHECKF(d == 0, "%s quantizer (%s): %zu of %zu differ, first x=%a got %d want %d",
                      fl_cpu_level_name((fl_cpu_level_t)lv[li]), sgn ? "signed" : "unsigned", d, n, x[first],
                      got[first], want[first]);
        }
    }
    /* whole 8-bit updates (F32 and BF16 params) at each level: identical params and state */
    size_t np = 9000;
    size_t bytes = fl_adam8bit_state_bytes(np);
    float *g = malloc(np * 4), *p0 = malloc(np * 4);
    fl_test_fill(&rng, g, np, -0.1f, 0.1f);
    fl_test_fill(&rng, p0, np, -1, 1);
    g[17] = NAN;
    void *ref_mem = NULL;
    float *ref_p = NULL;
    for (int li = 0; li < nl; li++) {
        fl_cpu_set_level(lv[li]);
        fl_backend be;
        fl_cpu_backend_init(&be, 2);
        void *mem = calloc(1, bytes);
        float *p = malloc(np * 4);
        memcpy(p, p0, np * 4);
        fl_adam8bit_state st;
        FL_REQUIRE_OK(fl_adam8bit_state_bind(&st, np, mem));
        for (int s = 1; s <= 3; s++)
            FL_REQUIRE_OK(be.adam8bit_update(&be, p, FL_F32, g, FL_F32, &st, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.01f, s, 1.0f));
        if (!ref_mem) {
            ref_mem = mem, ref_p = p;
            continue;
        }
        FL_CHECKF(memcmp(p, ref_p, np * 4) == 0 && memcmp(mem, ref_mem, bytes) == 0,
                  "adam8bit update at %s differs from generic", fl_cpu_level_name((fl_cpu_level_t)lv[li]));
        free(mem), free(p);
    }
    fl_cpu_set_level(-1);
    free(ref_mem), free(ref_p), free(g), free(p0), free(x), free(want), free(got);
}

/* A backend made with the default thread count (0: all cores) gets the same count however many GEMMs
 * ran before: the GEMM sets the calling thread's OpenMP count to 1 for a small product, and the default
 * used to be read from it (omp_get_max_threads at init), so every later default backend of the process
 * ran on one thread (the lab's rows after the first; a selftest's second training gave other bits). */
FL_TEST(cpu_default_threads_survive_a_small_gemm) {
    fl_backend a, b;
    FL_REQUIRE_OK(fl_cpu_backend_init(&a, 0));
    float x[4] = {1, 2, 3, 4}, y[4] = {0};
    FL_REQUIRE_OK(a.gemm(&a, 0, 0, 2, 2, 2, 1.0f, x, FL_F32, 2, x, FL_F32, 2, 0.0f, y, FL_F32, 2));
    FL_REQUIRE_OK(fl_cpu_backend_init(&b, 0));
    FL_CHECKF(a.n_threads == b.n_threads && a.n_threads == fl_cpu_default_threads(),
              "default backends: %d threads, then %d after a small GEMM (default %d)", a.n_threads, b.n_threads,
              fl_cpu_default_threads());
    FL_CHECK(y[0] == 7.0f && y[3] == 22.0f); /* [1 2; 3 4]^2 */
    /* and that count is all cores (libgomp's default without OMP_NUM_THREADS: the CPUs this process may use) */
    if (!getenv("OMP_NUM_THREADS") && !getenv("OMP_THREAD_LIMIT"))
        FL_CHECKF(a.n_threads == (omp_get_num_procs() < FL_CPU_MAX_THREADS ? omp_get_num_procs() : FL_CPU_MAX_THREADS),
                  "default backend: %d threads on %d usable CPUs", a.n_threads, omp_get_num_procs());
    fl_cpu_backend_free(&a);
    fl_cpu_backend_free(&b);
}

/* The attention kernels' tile product (attn_mm.c) at every level the CPU has: C = [C +] A B with
 * strided A (row-major and transposed, as the kernels call it), ragged M (register-tile edges),
 * N a multiple of 16 (avx512), of 8 only (avx2) and neither (portable), acc on (C read) and off
 * (C holding NaN must not be read). Every element against float64 within the classic bound of a
 * K-term chain, |err| <= gamma_{K+1} (|C0| + sum |a||b|), gamma_n = n u / (1 - n u); and, where
 * an FMA variant runs, bit for bit against a scalar fmaf chain over k ascending (their
 * documented per-element order, whatever the tile an element falls in; so the avx512 and avx2
 * variants also give the same bits). */
FL_TEST(dispatch_attn_tile_product) {
    static const int shapes[][3] = {{32, 32, 64}, {13, 32, 48}, {32, 64, 32}, {7, 8, 5}, {1, 16, 1},
                                    {29, 40, 17}, {6, 24, 0}, {5, 12, 9}, {32, 256, 32}};
    fl_test_rng r = {4242};
    int lv[3], nl = test_levels(lv);
    for (int li = 0; li < nl; li++) {
        fl_cpu_set_level(lv[li]);
        const char *L = fl_cpu_level_name((fl_cpu_level_t)lv[li]);
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
            for (int trans = 0; trans < 2; trans++)
                for (int acc = 0; acc < 2; acc++) {
                    int M = shapes[si][0], N = shapes[si][1], K = shapes[si][2], ldb = N + 3, ldc = N + 5;
                    int ai = trans ? 1 : K + 2, ak = trans ? M + 1 : 1; /* A or A^T stored with padding */
                    size_t na = (size_t)(trans ? (K > 0 ? K : 1) * (M + 1) : M * (K + 2));
                    float *A = fl_test_frand(&r, na, -1, 1), *B = fl_test_frand(&r, (size_t)(K > 0 ? K : 1) * ldb, -1, 1);
                    float *C = fl_test_frand(&r, (size_t)M * ldc, -1, 1), *C0 = fl_test_fdup(C, (size_t)M * ldc);
                    if (!acc)
                        for (size_t i = 0; i < (size_t)M * ldc; i++) C[i] = NAN;
                    fl_cpu_attn_mm(C, ldc, A, ai, ak, B, ldb, M, N, K, acc);
                    int exact = N % 8 == 0 && strcmp(fl_cpu_attn_mm_path(), "portable");
                    int bad = 0;
                    for (int i = 0; i < M && !bad; i++)
                        for (int n = 0; n < N && !bad; n++) {
                            float c0 = acc ? C0[(size_t)i * ldc + n] : 0.0f, f = c0;
                            double ref = c0, mag = fabs(c0);
                            for (int k = 0; k < K; k++) {
                                float a = A[(size_t)i * ai + (size_t)k * ak], b = B[(size_t)k * ldb + n];
                                ref += (double)a * b;
                                mag += fabs((double)a * b);
                                f = fmaf(a, b, f);
                            }
                            double u = 0x1p-24, g = (K + 1) * u / (1 - (K + 1) * u);
                            float got = C[(size_t)i * ldc + n];
                            if (!(fabs(got - ref) <= g * mag) || (exact && memcmp(&got, &f, 4))) {
                                FL_CHECKF(0, "%s M%d N%d K%d trans %d acc %d: C[%d][%d] = %.9g, float64 %.9g (bound %.3g), fmaf chain %.9g",
                                          L, M, N, K, trans, acc, i, n, got, ref, g * mag, f);
                                bad = 1;
                            }
                        }
                    /* columns past N and C's padding are not written */
                    for (int i = 0; i < M && !bad; i++)
                        for (int n = N; n < ldc; n++)
                            if (memcmp(&C[(size_t)i * ldc + n], acc ? &C0[(size_t)i * ldc + n] : &(float){NAN}, 4) &&
                                !(isnan(C[(size_t)i * ldc + n]) && !acc)) {
                                FL_CHECKF(0, "%s M%d N%d K%d: padding C[%d][%d] written", L, M, N, K, i, n);
                                bad = 1;
                                break;
                            }
                    free(A), free(B), free(C), free(C0);
                }
        fprintf(stderr, "  level %s: attention tile product %s\n", L, fl_cpu_attn_mm_path());
    }
    fl_cpu_set_level(-1);
}

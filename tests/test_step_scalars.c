/* Issue 30 item 5: the step scalars' ops (fitllm/backend.h: step_scalars, grad_norm_dev, loss_sum_dev,
 * adamw_update_ss, sgd_update_ss), optional slots, on every backend that has them (CUDA and cuda-emu; the others
 * lack them and the step reads on the host): the norm against float64 (the sum of the stored values' exact
 * squares: error ~ n 2^-53 relative), the clip scale against the float64 formula (one float rounding), the loss sum
 * against float64 and bit for bit against the host's sum in index order, the updates bit for bit against
 * adamw_update / sgd_update with the scale the host would pass (the same kernels' arithmetic), and a non-finite
 * norm: a NaN scale, the updates leave every parameter and state element as it was. Odd sizes: more than one sumsq
 * part (n > 2^16) and a tail past the 8-wide vector path. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/adam8bit.h"
#include "fitllm/backend.h"
#include "fitllm/mem.h"
#include "fitllm/model.h"
#include "fitllm/train.h"
#include "test.h"

typedef struct {
    const fl_backend *be;
    fl_mem_pool pool, hpool;
} ss_rig;

static void *dev_copy(ss_rig *r, const void *host, size_t bytes) {
    void *d = NULL;
    if (fl_mem_alloc(&r->pool, FL_TAG_WORKSPACE, bytes, &d) != FL_OK) return NULL;
    if (r->be->to_device(r->be, d, host, bytes) != FL_OK) return NULL;
    return d;
}

/* 8-bit AdamW (adam8bit_update_ss: the 8-bit state when n >= FL_ADAM8BIT_MIN_SIZE, else the fp32 one) against
 * adam8bit_update with the host's scale: p and every state byte equal; a NaN scale (nan_at >= 0): p as it was */
static void adam8_pair(ss_rig *r, const void *g, fl_dtype tg, size_t n, const double *ss, float sc_host, long nan_at,
                       const float *p0) {
    const fl_backend *be = r->be;
    if (!be->adam8bit_update_ss || !fl_adam8bit_dtype_ok(tg)) return;
    const int q8 = n >= FL_ADAM8BIT_MIN_SIZE;
    const size_t nb = q8 ? (n + FL_ADAM8BIT_BLOCK - 1) / FL_ADAM8BIT_BLOCK : 0;
    /* one region per state in the library's layout (fl_adam8bit_state_bind_ex: the absmax arrays aligned) */
    const size_t sb = fl_adam8bit_state_bytes_ex(n, q8), fb = n * sizeof(float);
    const size_t xb = sb > fb ? sb : fb;
    unsigned char *zero = calloc(1, sb), *x = malloc(xb), *y = malloc(xb);
    FL_REQUIRE(zero && x && y);
    void *pd[2], *sd[2];
    fl_adam8bit_state st[2];
    for (int k = 0; k < 2; k++) {
        pd[k] = dev_copy(r, p0, fb), sd[k] = dev_copy(r, zero, sb);
        FL_REQUIRE(pd[k] && sd[k]);
        FL_REQUIRE_OK(fl_adam8bit_state_bind_ex(&st[k], n, q8, sd[k]));
        FL_REQUIRE(st[k].n_blocks == nb);
    }
    FL_REQUIRE_OP(be, FL_RUN(be, adam8bit_update_ss, pd[0], FL_F32, g, tg, &st[0], 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 2,
                             ss));
    if (nan_at < 0)
        FL_REQUIRE_OK(FL_RUN(be, adam8bit_update, pd[1], FL_F32, g, tg, &st[1], 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 2,
                             sc_host));
    FL_REQUIRE_OK(be->to_host(be, x, sd[0], sb));
    FL_REQUIRE_OK(be->to_host(be, y, sd[1], sb));
    FL_CHECKF(!memcmp(x, y, sb), "%s n %zu adam8bit_update_ss: the state differs from %s", fl_dtype_name(tg), n,
              nan_at >= 0 ? "its value before" : "adam8bit_update's");
    FL_REQUIRE_OK(be->to_host(be, x, pd[0], fb));
    FL_REQUIRE_OK(be->to_host(be, y, pd[1], fb));
    FL_CHECKF(!memcmp(x, y, fb) && (nan_at < 0 || !memcmp(x, p0, fb)), "%s n %zu adam8bit_update_ss: p differs",
              fl_dtype_name(tg), n);
    for (int k = 0; k < 2; k++) fl_mem_free(&r->pool, pd[k]), fl_mem_free(&r->pool, sd[k]);
    free(zero), free(x), free(y);
}

/* grad_norm_dev then both updates on g (n, tg), max_norm; nan_at >= 0 puts a NaN into g there, nan_at == -2 a NaN
 * into the second of two loss sums (the gradients finite) */
static void norm_and_update(ss_rig *r, fl_dtype tg, size_t n, float max_norm, float scale, long nan_at) {
    const fl_backend *be = r->be;
    fl_test_rng rng = {31 + (uint64_t)n};
    float *g32 = fl_test_frand(&rng, n, -0.02f, 0.02f), *p0 = fl_test_frand(&rng, n, -1, 1);
    float *m0 = fl_test_frand(&rng, n, -0.01f, 0.01f), *v0 = fl_test_frand(&rng, n, 0, 1e-4f);
    if (nan_at >= 0) g32[nan_at] = NAN;
    const int bad_loss = nan_at == -2;
    if (bad_loss) nan_at = 0; /* skipped as for a NaN gradient */
    void *gh = malloc(n * 4);
    FL_REQUIRE(gh && be->convert);
    /* the stored gradient (tg) and its exact fp32 widening, from the CPU's conversion (the reference's) */
    fl_backend cpu;
    FL_REQUIRE_OK(fl_cpu_backend_init(&cpu, 1));
    FL_REQUIRE_OK(cpu.convert(&cpu, gh, tg, g32, FL_F32, n));
    FL_REQUIRE_OK(cpu.convert(&cpu, g32, FL_F32, gh, tg, n));
    fl_cpu_backend_free(&cpu);
    const size_t gb = n * fl_dtype_size(tg);
    void *g = dev_copy(r, gh, gb);
    double *ss = be->step_scalars(be, FL_SS_LOSS + 2);
    FL_REQUIRE(g && ss && !be->step_scalars(be, FL_SS_MAX + 1));
    const double head[FL_SS_LOSS + 2] = {[FL_SS_LOSS] = 1.5, [FL_SS_LOSS + 1] = bad_loss ? NAN : 2.5}; /* no overflow */
    FL_REQUIRE_OK(be->to_device(be, ss, head, sizeof head));
    FL_REQUIRE_OP(be, FL_RUN(be, grad_norm_dev, g, tg, n, max_norm, scale, 2, ss));
    double h[2];
    FL_REQUIRE_OK(be->to_host(be, h, ss, sizeof h));
    double want = 0; /* float64 */
    for (size_t i = 0; i < n; i++) want += (double)g32[i] * g32[i];
    want = sqrt(want) * scale;
    const double sq = be->sumsq(be, g, tg, n); /* the host path's arithmetic on the same sum */
    const double norm_host = sqrt(sq) * scale;
    float sc_host = scale;
    if (max_norm > 0) {
        const double c = max_norm / (norm_host + 1e-6);
        if (c < 1.0) sc_host = (float)(c * sc_host);
    }
    if (bad_loss) {
        FL_CHECKF(h[FL_SS_NORM] == norm_host && isnan(h[FL_SS_SCALE]), "%s: a NaN loss: norm %g, scale %g",
                  fl_dtype_name(tg), h[FL_SS_NORM], h[FL_SS_SCALE]);
    } else if (nan_at >= 0) {
        FL_CHECKF(!isfinite(h[FL_SS_NORM]) && isnan(h[FL_SS_SCALE]), "%s: a NaN gradient: norm %g, scale %g",
                  fl_dtype_name(tg), h[FL_SS_NORM], h[FL_SS_SCALE]);
    } else {
        FL_CHECKF(fabs(h[FL_SS_NORM] - want) <= 1e-12 * want && h[FL_SS_NORM] == norm_host,
                  "%s n %zu: norm %.17g, float64 %.17g, host %.17g", fl_dtype_name(tg), n, h[FL_SS_NORM], want,
                  norm_host);
        const double c64 = max_norm > 0 && max_norm / (want + 1e-6) < 1 ? max_norm / (want + 1e-6) * scale : scale;
        FL_CHECKF(h[FL_SS_SCALE] == (double)sc_host && fabs(h[FL_SS_SCALE] - c64) <= 1e-6 * c64,
                  "%s: scale %.9g, host %.9g, float64 %.9g", fl_dtype_name(tg), h[FL_SS_SCALE], (double)sc_host, c64);
    }
    /* AdamW and SGD (momentum) reading the scale on the device vs the host's scale in the plain slots */
    const size_t fb = n * 4;
    void *pa = dev_copy(r, p0, fb), *ma = dev_copy(r, m0, fb), *va = dev_copy(r, v0, fb);
    void *pb = dev_copy(r, p0, fb), *mb = dev_copy(r, m0, fb), *vb = dev_copy(r, v0, fb);
    FL_REQUIRE(pa && ma && va && pb && mb && vb);
    FL_REQUIRE_OP(be, FL_RUN(be, adamw_update_ss, pa, FL_F32, g, tg, ma, va, FL_F32, n, 1e-3f, 0.9f, 0.95f, 1e-8f,
                             0.1f, 3, ss));
    if (nan_at < 0)
        FL_REQUIRE_OK(FL_RUN(be, adamw_update, pb, FL_F32, g, tg, mb, vb, FL_F32, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f,
                             3, sc_host));
    float *x = malloc(fb), *y = malloc(fb);
    FL_REQUIRE(x && y);
    const void *pairs[3][2] = {{pa, pb}, {ma, mb}, {va, vb}};
    for (int k = 0; k < 3; k++) {
        FL_REQUIRE_OK(be->to_host(be, x, pairs[k][0], fb));
        FL_REQUIRE_OK(be->to_host(be, y, pairs[k][1], fb));
        FL_CHECKF(!memcmp(x, y, fb), "%s adamw_update_ss: array %d differs from %s", fl_dtype_name(tg), k,
                  nan_at >= 0 ? "its value before (a NaN scale changes nothing)" : "adamw_update's");
    }
    FL_REQUIRE_OP(be, FL_RUN(be, sgd_update_ss, pa, FL_F32, g, tg, ma, FL_F32, n, 1e-2f, 0.9f, 0.0f, 0.01f, 0, 0, ss));
    if (nan_at < 0)
        FL_REQUIRE_OK(FL_RUN(be, sgd_update, pb, FL_F32, g, tg, mb, FL_F32, n, 1e-2f, 0.9f, 0.0f, 0.01f, 0, 0, sc_host));
    for (int k = 0; k < 2; k++) {
        FL_REQUIRE_OK(be->to_host(be, x, pairs[k][0], fb));
        FL_REQUIRE_OK(be->to_host(be, y, pairs[k][1], fb));
        FL_CHECKF(!memcmp(x, y, fb), "%s sgd_update_ss: array %d differs", fl_dtype_name(tg), k);
    }
    if (nan_at >= 0) { /* still the starting values */
        FL_REQUIRE_OK(be->to_host(be, x, pa, fb));
        FL_CHECK(!memcmp(x, p0, fb));
    }
    adam8_pair(r, g, tg, n, ss, sc_host, nan_at, p0);
    void *bufs[7] = {g, pa, ma, va, pb, mb, vb};
    for (int k = 0; k < 7; k++) fl_mem_free(&r->pool, bufs[k]);
    free(g32), free(p0), free(m0), free(v0), free(gh), free(x), free(y);
}

static void loss_sum(ss_rig *r) {
    const fl_backend *be = r->be;
    enum { N = 1003 };
    fl_test_rng rng = {77};
    float *l = fl_test_frand(&rng, N, 0, 12);
    int32_t tg[N];
    for (int i = 0; i < N; i++) tg[i] = i % 7 == 3 ? -100 : i % 50;
    float *dl = dev_copy(r, l, sizeof(float) * N);
    int32_t *dt = dev_copy(r, tg, sizeof tg);
    double *ss = be->step_scalars(be, FL_SS_LOSS + 2), zero[FL_SS_LOSS + 2] = {0}, h[FL_SS_LOSS + 2];
    FL_REQUIRE(dl && dt && ss);
    FL_REQUIRE_OK(be->to_device(be, ss, zero, sizeof zero));
    FL_REQUIRE_OP(be, FL_RUN(be, loss_sum_dev, dl, dt, N, -100, ss + FL_SS_LOSS));
    FL_REQUIRE_OP(be, FL_RUN(be, loss_sum_dev, dl, dt, N / 2, -100, ss + FL_SS_LOSS + 1));
    FL_REQUIRE_OP(be, FL_RUN(be, loss_sum_dev, dl + N / 2, dt + N / 2, N - N / 2, -100, ss + FL_SS_LOSS + 1));
    FL_REQUIRE_OK(be->to_host(be, h, ss, sizeof h));
    double host = 0, host2 = 0, f64 = 0; /* the host path's sum (fl_lm_sum_losses), in order */
    for (int i = 0; i < N; i++)
        if (tg[i] != -100) host += l[i], f64 += (double)l[i];
    for (int i = 0; i < N; i++) /* accumulated over two calls: the same order */
        if (tg[i] != -100) host2 += l[i];
    FL_CHECKF(h[FL_SS_LOSS] == host && fabs(h[FL_SS_LOSS] - f64) <= 1e-12 * f64 && h[FL_SS_LOSS + 1] == host2,
              "loss sum %.17g, host %.17g, float64 %.17g; two calls %.17g", h[FL_SS_LOSS], host, f64, h[FL_SS_LOSS + 1]);
    FL_CHECK(h[0] == 0 && h[1] == 0 && h[FL_SS_FOUND] == 0); /* nothing else written */
    fl_mem_free(&r->pool, dl), fl_mem_free(&r->pool, dt);
    free(l);
}

/* check_finite_dev: ss[FL_SS_FOUND] as check_finite's verdict (x * inv_scale inf/NaN: a stored inf, a finite value
 * that the unscaling overflows, none), nothing else written; a set flag makes grad_norm_dev skip the update (a NaN
 * scale) with the norm still computed */
static void overflow_flag(ss_rig *r, fl_dtype t) {
    const fl_backend *be = r->be;
    enum { N = 1029 };
    static const struct { long at; float v, inv; } cases[] = {{-1, 0, 0.5f}, {517, INFINITY, 1.0f}, {N - 1, 3e38f, 4.0f},
                                                              {3, NAN, 1.0f}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        if (t != FL_F32 && cases[c].v == 3e38f) continue; /* a 16-bit store would round it to inf already */
        float x[N];
        for (int i = 0; i < N; i++) x[i] = 0.01f * (float)(i % 13) - 0.05f;
        if (cases[c].at >= 0) x[cases[c].at] = cases[c].v;
        uint16_t x16[N];
        fl_backend cpu;
        FL_REQUIRE_OK(fl_cpu_backend_init(&cpu, 1));
        if (t != FL_F32) FL_REQUIRE_OK(cpu.convert(&cpu, x16, t, x, FL_F32, N));
        fl_cpu_backend_free(&cpu);
        void *d = dev_copy(r, t == FL_F32 ? (const void *)x : x16, N * fl_dtype_size(t));
        double *ss = be->step_scalars(be, FL_SS_LOSS + 1), z[FL_SS_LOSS + 1] = {0}, h[FL_SS_LOSS + 1];
        FL_REQUIRE(d && ss);
        FL_REQUIRE_OK(be->to_device(be, ss, z, sizeof z));
        FL_REQUIRE_OP(be, FL_RUN(be, check_finite_dev, d, t, N, cases[c].inv, ss));
        int found = 0;
        FL_REQUIRE_OK(be->check_finite(be, d, t, N, cases[c].inv, &found));
        FL_REQUIRE_OK(be->to_host(be, h, ss, sizeof h));
        const int want = cases[c].at >= 0; /* every injected value is inf/NaN once unscaled */
        FL_CHECKF(h[FL_SS_FOUND] == (double)want && found == want && h[0] == 0 && h[1] == 0 && h[FL_SS_LOSS] == 0,
                  "%s case %zu: flag %g, check_finite %d, want %d", fl_dtype_name(t), c, h[FL_SS_FOUND], found, want);
        if (want && c == 1 && t == FL_F32) { /* the update skipped on the flag alone: a finite gradient's norm */
            x[cases[c].at] = 0.0f;
            FL_REQUIRE_OK(be->to_device(be, d, x, sizeof x));
            {
                FL_REQUIRE_OP(be, FL_RUN(be, grad_norm_dev, d, t, N, 1.0f, 1.0f, 0, ss));
                FL_REQUIRE_OK(be->to_host(be, h, ss, sizeof h));
                FL_CHECKF(isfinite(h[FL_SS_NORM]) && h[FL_SS_NORM] > 0 && isnan(h[FL_SS_SCALE]),
                          "an overflow flag: norm %g, scale %g", h[FL_SS_NORM], h[FL_SS_SCALE]);
            }
        }
        fl_mem_free(&r->pool, d);
    }
}

static void ss_case(fl_backend *be) {
    if (!be->step_scalars) { /* optional: the step reads its norm and losses on the host */
        FL_CHECK(!be->grad_norm_dev && !be->loss_sum_dev && !be->adamw_update_ss && !be->sgd_update_ss &&
                 !be->check_finite_dev);
        return;
    }
    ss_rig r = {.be = be};
    FL_REQUIRE_OK(fl_backend_pools_init(be, &r.pool, &r.hpool, "ss", 0));
    const size_t n = fl_test_backend_emulated(be) ? 65536 + 1029 : 3 * 65536 + 1029;
    norm_and_update(&r, FL_F32, n, 0.05f, 1.0f, -1);    /* clipped */
    norm_and_update(&r, FL_BF16, n, 1000.0f, 1.0f, -1); /* not clipped */
    norm_and_update(&r, FL_F32, 1029, 0.0f, 0.125f, -1); /* no clipping, a loss scale's inverse */
    norm_and_update(&r, FL_F16, 1029, 0.01f, 0.5f, -1);
    norm_and_update(&r, FL_F32, 1029, 1.0f, 1.0f, 517); /* a NaN: skipped */
    norm_and_update(&r, FL_F32, 1029, 1.0f, 1.0f, -2);  /* a NaN loss sum: skipped */
    loss_sum(&r);
    overflow_flag(&r, FL_F32);
    overflow_flag(&r, FL_F16);
    fl_backend_pools_free(&r.pool, &r.hpool);
}

FL_TEST(step_scalars_ops) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) ss_case(&be);
}

/* A step whose loss is NaN (every parameter poisoned) with the step scalars and with FITLLM_CUDA_STEP_SCALARS=0: the
 * same failure (FL_ERR_NONFINITE "the loss is NaN" at micro-batch 0), the weights and the optimizer's count as
 * before: on the device path the NaN reaches the host only at the step's end, after the device skipped the update. */
static void nan_step(int on, fl_status *st, char *msg, size_t msz, int *failed_k, int *changed, int *count) {
    if (!on) setenv("FITLLM_CUDA_STEP_SCALARS", "0", 1);
    fl_backend be;
    fl_status s = fl_backend_init_by_name("cuda-emu", &be, 1);
    unsetenv("FITLLM_CUDA_STEP_SCALARS");
    FL_REQUIRE_OK(s);
    FL_REQUIRE(!on == !be.step_scalars);
    fl_mem_pool pool, hpool;
    fl_model m;
    fl_optimizer o;
    fl_model_config c;
    fl_optim_config oc;
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &hpool, "nan", 0));
    FL_REQUIRE_OK(fl_preset_find("micro", &c));
    FL_REQUIRE_OK(fl_model_init(&m, &c, &be, &pool));
    fl_model_init_random(&m, 7);
    FL_REQUIRE_OK(fl_model_alloc_grads(&m));
    FL_REQUIRE_OK(fl_model_alloc_acts(&m, 1, 8));
    fl_optim_config_default(&oc, FL_OPT_ADAMW);
    FL_REQUIRE_OK(fl_optim_init(&o, &m, &oc));
    const size_t pb = o.w.n * fl_dtype_size(o.w.pt);
    float *w0 = malloc(pb), *w1 = malloc(pb);
    FL_REQUIRE(w0 && w1 && o.w.pt == FL_F32);
    for (size_t i = 0; i < o.w.n; i++) w0[i] = NAN;
    FL_REQUIRE_OK(be.to_device(&be, o.w.p, w0, pb));
    int32_t ids[8], tg[8];
    for (int i = 0; i < 8; i++) ids[i] = i + 1, tg[i] = i + 2;
    fl_micro_batch mb = {.ids = ids, .targets = tg, .B = 1, .T = 8};
    fl_step_ctx sc = {.mbs = &mb, .n_micro = 1, .step_valid = 8, .lr = 1e-3f, .max_norm = 1.0f};
    *st = fl_step_run(&m, &o, &sc, NULL);
    snprintf(msg, msz, "%s", fl_error_message());
    *failed_k = sc.failed_k;
    FL_REQUIRE_OK(be.to_host(&be, w1, o.w.p, pb));
    *changed = memcmp(w0, w1, pb) != 0;
    *count = o.step;
    free(w0), free(w1);
    fl_optim_free(&o);
    fl_model_free(&m);
    fl_backend_pools_free(&pool, &hpool);
    fl_backend_free(&be);
}

FL_TEST(step_scalars_nan_loss_fails_alike) {
#ifdef FL_HAVE_CUDA_EMU
    if (!fl_test_asan_budget()) return; /* two emulated steps: the release pass */
    fl_status s[2];
    char msg[2][256];
    int k[2], changed[2], count[2];
    for (int on = 0; on < 2; on++) nan_step(on, &s[on], msg[on], sizeof msg[on], &k[on], &changed[on], &count[on]);
    for (int on = 0; on < 2; on++)
        FL_CHECKF(s[on] == FL_ERR_NONFINITE && strstr(msg[on], "the loss is NaN") && k[on] == 0 && !changed[on] &&
                      count[on] == 0,
                  "step scalars %d: status %d '%s', failed at %d, weights changed %d, %d updates counted", on, (int)s[on],
                  msg[on], k[on], changed[on], count[on]);
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

/* FITLLM_CUDA_STEP_SCALARS: 0 takes the slots away (the host path), another value than 0 / 1 is refused by name */
FL_TEST(step_scalars_variable) {
#ifdef FL_HAVE_CUDA_EMU
    fl_backend be;
    setenv("FITLLM_CUDA_STEP_SCALARS", "yes", 1);
    fl_status s = fl_backend_init_by_name("cuda-emu", &be, 1);
    FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "FITLLM_CUDA_STEP_SCALARS=yes"), "status %d: %s", (int)s,
              fl_error_message());
    if (s == FL_OK) fl_backend_free(&be);
    setenv("FITLLM_CUDA_STEP_SCALARS", "0", 1);
    s = fl_backend_init_by_name("cuda-emu", &be, 1);
    unsetenv("FITLLM_CUDA_STEP_SCALARS");
    FL_REQUIRE_OK(s);
    FL_CHECK(!be.step_scalars && !be.grad_norm_dev && !be.loss_sum_dev && !be.adamw_update_ss && !be.sgd_update_ss &&
             !be.check_finite_dev);
    fl_backend_free(&be);
    FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
    FL_CHECK(be.step_scalars && be.grad_norm_dev && be.loss_sum_dev && be.adamw_update_ss && be.sgd_update_ss &&
             be.check_finite_dev);
    fl_backend_free(&be);
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

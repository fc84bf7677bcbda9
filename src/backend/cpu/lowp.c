/* Reduced-precision helpers: bulk dtype conversion, optimizer updates over bf16/f16 storage,
 * and the inf/NaN check of dynamic loss scaling. Semantics: include/fitllm/backend.h.
 *
 * The optimizer updates work in chunks of FL_PREC_CHUNK elements: widen p, g, m, v to fp32
 * stack arrays, run exactly the fp32 formula of optim_kernels.c, round and store. Compiled with
 * -ffp-contract=off (CMakeLists.txt) so the fp32 arithmetic is the written sequence of
 * IEEE operations (what the double-then-round references in the tests model). */
#include <math.h>
#include <omp.h>

#include "backend/cpu/cpu-impl.h"
#include "core/cvt.h"

#define FL_PREC_CHUNK 1024

static int is16(fl_dtype t) { return t == FL_BF16 || t == FL_F16; }
static int isfloat(fl_dtype t) { return t == FL_F32 || is16(t); }

/* The 16-bit loops are core/cvt.c's SIMD row kernels (run-time dispatch, bit-identical to the
 * scalar fl_bf16_to_f32 / fl_f32_to_bf16 / fl_f16_to_f32 / fl_f32_to_f16). */
static void widen(float *dst, const void *src, fl_dtype t, size_t off, size_t n) {
    if (t == FL_F32)
        memcpy(dst, (const float *)src + off, n * sizeof(float));
    else if (t == FL_BF16)
        fl_cvt_bf16_to_f32(dst, (const uint16_t *)src + off, n);
    else
        fl_cvt_f16_to_f32(dst, (const uint16_t *)src + off, n);
}

static void narrow(void *dst, fl_dtype t, size_t off, const float *src, size_t n) {
    if (t == FL_F32)
        memcpy((float *)dst + off, src, n * sizeof(float));
    else if (t == FL_BF16)
        fl_cvt_f32_to_bf16((uint16_t *)dst + off, src, n);
    else
        fl_cvt_f32_to_f16((uint16_t *)dst + off, src, n);
}

static int nthreads(const fl_backend *be) { return be && be->n_threads > 0 ? be->n_threads : 1; }

fl_status fl_cpu_convert(const fl_backend *be, void *dst, fl_dtype dt, const void *src, fl_dtype st, size_t n) {
    if (!isfloat(dt) || !isfloat(st))
        return fl_errorf(FL_ERR_UNSUPPORTED, "convert: %s -> %s not supported (F32/BF16/F16)", fl_dtype_name(st),
                         fl_dtype_name(dt));
    if (n == 0) return FL_OK;
    if (!dst || !src) return fl_errorf(FL_ERR_INVALID, "convert: NULL buffer (n=%zu)", n);
    size_t nc = (n + FL_PREC_CHUNK - 1) / FL_PREC_CHUNK;
    int nt = nthreads(be);
#pragma omp parallel for num_threads(nt) schedule(static) if (n > 32768)
    for (size_t c = 0; c < nc; c++) {
        size_t off = c * FL_PREC_CHUNK, k = n - off < FL_PREC_CHUNK ? n - off : FL_PREC_CHUNK;
        if (st == dt) {
            memcpy((char *)dst + off * fl_dtype_size(dt), (const char *)src + off * fl_dtype_size(st),
                   k * fl_dtype_size(st));
        } else if (st == FL_F32) {
            narrow(dst, dt, off, (const float *)src + off, k);
        } else if (dt == FL_F32) {
            widen((float *)dst + off, src, st, off, k);
        } else {
            float tmp[FL_PREC_CHUNK];
            widen(tmp, src, st, off, k);
            narrow(dst, dt, off, tmp, k);
        }
    }
    return FL_OK;
}

fl_status fl_cpu_adamw_update(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg, void *m,
                              void *v, fl_dtype ts, size_t n, float lr, float beta1, float beta2, float eps,
                              float weight_decay, int step, float grad_scale) {
    if (!isfloat(tp) || !isfloat(tg) || (ts != FL_F32 && ts != FL_BF16))
        return fl_errorf(FL_ERR_UNSUPPORTED, "adamw_update: p=%s g=%s state=%s not supported", fl_dtype_name(tp),
                         fl_dtype_name(tg), fl_dtype_name(ts));
    if (n == 0) return FL_OK;
    if (!p || !g || !m || !v || step < 1) return fl_errorf(FL_ERR_INVALID, "adamw_update: NULL buffer or step %d", step);
    if (tp == FL_F32 && tg == FL_F32 && ts == FL_F32) { /* fp32 training: the plain loop (optim_kernels.c) */
        fl_cpu_adamw_f32(be, p, g, m, v, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale);
        return FL_OK;
    }
    /* The same constants and operation order as fl_cpu_adamw_f32 (optim_kernels.c). */
    double bc1 = 1.0 - pow((double)beta1, step), bc2 = 1.0 - pow((double)beta2, step);
    float step_size = (float)(lr / bc1), bc2_sqrt = (float)sqrt(bc2);
    float decay = 1.0f - lr * weight_decay, w1 = 1.0f - beta1, w2 = 1.0f - beta2;
    size_t nc = (n + FL_PREC_CHUNK - 1) / FL_PREC_CHUNK;
    if (tp == FL_BF16 && tg == FL_BF16 && ts == FL_BF16) { /* bf16-true: everything in bf16 */
        uint16_t *p16 = p, *m16 = m, *v16 = v;
        const uint16_t *g16 = g;
        /* One pass: each element widened, updated and rounded in registers (the chunked path
         * below streams every operand through a stack array and back: 2x the time at this
         * size). The same operations in the same order, and the scalar conversions of
         * fitllm/dtype.h: the same bits. */
#pragma omp parallel for num_threads(nthreads(be)) schedule(static)
        for (size_t c = 0; c < nc; c++) {
            size_t off = c * FL_PREC_CHUNK, k = n - off < FL_PREC_CHUNK ? n - off : FL_PREC_CHUNK;
            /* FL_VECTORIZE: adamw16 */
#pragma omp simd
            for (size_t i = off; i < off + k; i++) {
                float gi = fl_bf16_to_f32(g16[i]) * grad_scale;
                float mo = fl_bf16_to_f32(m16[i]);
                float pi = fl_bf16_to_f32(p16[i]) * decay;
                float mi = mo + w1 * (gi - mo);
                float vi = beta2 * fl_bf16_to_f32(v16[i]) + w2 * gi * gi;
                float denom = sqrtf(vi) / bc2_sqrt + eps;
                p16[i] = fl_f32_to_bf16(pi - step_size * (mi / denom));
                m16[i] = fl_f32_to_bf16(mi);
                v16[i] = fl_f32_to_bf16(vi);
            }
        }
        return FL_OK;
    }
#pragma omp parallel for num_threads(nthreads(be)) schedule(static)
    for (size_t c = 0; c < nc; c++) {
        size_t off = c * FL_PREC_CHUNK, k = n - off < FL_PREC_CHUNK ? n - off : FL_PREC_CHUNK;
        float pf[FL_PREC_CHUNK], gf[FL_PREC_CHUNK], mf[FL_PREC_CHUNK], vf[FL_PREC_CHUNK];
        widen(pf, p, tp, off, k);
        widen(gf, g, tg, off, k);
        widen(mf, m, ts, off, k);
        widen(vf, v, ts, off, k);
#pragma omp simd
        for (size_t i = 0; i < k; i++) {
            float gi = gf[i] * grad_scale;
            float pi = pf[i] * decay;
            float mi = mf[i] + w1 * (gi - mf[i]);
            float vi = beta2 * vf[i] + w2 * gi * gi;
            float denom = sqrtf(vi) / bc2_sqrt + eps;
            pf[i] = pi - step_size * (mi / denom);
            mf[i] = mi;
            vf[i] = vi;
        }
        narrow(p, tp, off, pf, k);
        narrow(m, ts, off, mf, k);
        narrow(v, ts, off, vf, k);
    }
    return FL_OK;
}

fl_status fl_cpu_sgd_update(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg, void *buf,
                            fl_dtype ts, size_t n, float lr, float momentum, float dampening, float weight_decay,
                            int nesterov, int first_step, float grad_scale) {
    if (!isfloat(tp) || !isfloat(tg) || (ts != FL_F32 && ts != FL_BF16))
        return fl_errorf(FL_ERR_UNSUPPORTED, "sgd_update: p=%s g=%s buf=%s not supported", fl_dtype_name(tp),
                         fl_dtype_name(tg), fl_dtype_name(ts));
    if (n == 0) return FL_OK;
    if (!p || !g) return fl_errorf(FL_ERR_INVALID, "sgd_update: NULL buffer");
    if (tp == FL_F32 && tg == FL_F32 && ts == FL_F32) { /* fp32 training: the plain loop (optim_kernels.c) */
        fl_cpu_sgd_f32(be, p, g, buf, n, lr, momentum, dampening, weight_decay, nesterov, first_step, grad_scale);
        return FL_OK;
    }
    int use_mom = momentum != 0.0f && buf != NULL;
    size_t nc = (n + FL_PREC_CHUNK - 1) / FL_PREC_CHUNK;
#pragma omp parallel for num_threads(nthreads(be)) schedule(static)
    for (size_t c = 0; c < nc; c++) {
        size_t off = c * FL_PREC_CHUNK, k = n - off < FL_PREC_CHUNK ? n - off : FL_PREC_CHUNK;
        float pf[FL_PREC_CHUNK], gf[FL_PREC_CHUNK], bf[FL_PREC_CHUNK];
        widen(pf, p, tp, off, k);
        widen(gf, g, tg, off, k);
        if (use_mom) widen(bf, buf, ts, off, k);
#pragma omp simd
        for (size_t i = 0; i < k; i++) {
            float d = gf[i] * grad_scale + weight_decay * pf[i];
            if (use_mom) {
                float b = first_step ? d : momentum * bf[i] + (1.0f - dampening) * d;
                bf[i] = b;
                d = nesterov ? d + momentum * b : b;
            }
            pf[i] -= lr * d;
        }
        narrow(p, tp, off, pf, k);
        if (use_mom) narrow(buf, ts, off, bf, k);
    }
    return FL_OK;
}

fl_status fl_cpu_check_finite(const fl_backend *be, const void *x, fl_dtype t, size_t n, float inv_scale,
                              int *found_inf) {
    if (!isfloat(t)) return fl_errorf(FL_ERR_UNSUPPORTED, "check_finite: dtype %s not supported", fl_dtype_name(t));
    if (!found_inf) return fl_errorf(FL_ERR_INVALID, "check_finite: NULL found_inf");
    if (n == 0) return FL_OK;
    if (!x) return fl_errorf(FL_ERR_INVALID, "check_finite: NULL x (n=%zu)", n);
    size_t nc = (n + FL_PREC_CHUNK - 1) / FL_PREC_CHUNK;
    int bad = 0;
#pragma omp parallel for num_threads(nthreads(be)) schedule(static) reduction(| : bad) if (n > 32768)
    for (size_t c = 0; c < nc; c++) {
        size_t off = c * FL_PREC_CHUNK, k = n - off < FL_PREC_CHUNK ? n - off : FL_PREC_CHUNK;
        float xf[FL_PREC_CHUNK];
        widen(xf, x, t, off, k);
        int b = 0;
        /* x*s - x*s is 0 for finite values and NaN for inf/NaN: branch-free and vectorizable. */
#pragma omp simd reduction(| : b)
        for (size_t i = 0; i < k; i++) {
            float y = xf[i] * inv_scale;
            b |= (y - y) != 0.0f;
        }
        bad |= b;
    }
    if (bad) *found_inf = 1;
    return FL_OK;
}

fl_status fl_cpu_accumulate16(const fl_backend *be, uint16_t *dst, fl_dtype t, const float *src, size_t n) {
    if (!is16(t)) return fl_errorf(FL_ERR_UNSUPPORTED, "accumulate16: dst dtype %s (BF16 or F16)", fl_dtype_name(t));
    if (n == 0) return FL_OK;
    if (!dst || !src) return fl_errorf(FL_ERR_INVALID, "accumulate16: NULL buffer (n=%zu)", n);
    size_t nc = (n + FL_PREC_CHUNK - 1) / FL_PREC_CHUNK;
#pragma omp parallel for num_threads(nthreads(be)) schedule(static) if (n > 32768)
    for (size_t c = 0; c < nc; c++) {
        size_t off = c * FL_PREC_CHUNK, k = n - off < FL_PREC_CHUNK ? n - off : FL_PREC_CHUNK;
        float tmp[FL_PREC_CHUNK];
        widen(tmp, dst, t, off, k);
        const float *s = src + off;
#pragma omp simd
        for (size_t i = 0; i < k; i++) tmp[i] += s[i];
        narrow(dst, t, off, tmp, k);
    }
    return FL_OK;
}

double fl_cpu_sumsq(const fl_backend *be, const void *x, fl_dtype t, size_t n) {
    if (t == FL_F32) return fl_cpu_sumsq_f32(be, (const float *)x, n);
    if (!is16(t) || n == 0) return 0.0;
    /* the ranges of fl_cpu_sum_parts (fixed by n), partials added in order: the same bits for any
     * thread count */
    const int P = fl_cpu_sum_parts(n);
    double part[FL_CPU_SUM_PARTS]; // (P) per-range partial sums
#pragma omp parallel for num_threads(nthreads(be)) schedule(static) if (n > 32768)
    for (int c = 0; c < P; c++) {
        size_t b = n * (size_t)c / (size_t)P, e = n * (size_t)(c + 1) / (size_t)P;
        double s = 0.0;
        float tmp[FL_PREC_CHUNK];
        for (size_t off = b; off < e; off += FL_PREC_CHUNK) {
            size_t k = e - off < FL_PREC_CHUNK ? e - off : FL_PREC_CHUNK;
            widen(tmp, x, t, off, k);
            /* vector lanes, as fl_cpu_sumsq's loop (a scalar chain of double adds ran at one
             * element per add latency: 65 ms of the small bf16-true step) */
            /* FL_VECTORIZE: sumsq16 */
#pragma omp simd reduction(+ : s)
            for (size_t i = 0; i < k; i++) s += (double)tmp[i] * tmp[i];
        }
        part[c] = s;
    }
    double total = 0.0;
    for (int c = 0; c < P; c++) total += part[c];
    return total;
}

/* Rotary position embedding, HF "rotate_half" layout: dimension j pairs with
 * j + HD/2 (not the interleaved 2j, 2j+1 of the original paper / Meta code).
 *
 *   y[j]      = x[j] c - x[j+H] s
 *   y[j+H]    = x[j+H] c + x[j] s        (H = HD/2, c/s = cos/sin(pos * inv_freq_j))
 *
 * The rotation is orthogonal, so backward is its transpose (rotation by -angle),
 * applied in place. */
#include <math.h>
#include <omp.h>

#include "backend/cpu/cpu-impl.h"

static void rope_apply(const fl_backend *be, float *x, int B, int T, int nh, int HD, size_t row_stride,
                       const float *cos_t /*(maxT,HD/2)*/, const float *sin_t /*(maxT,HD/2)*/, int pos0,
                       float sign /* +1 forward, -1 backward (transpose) */) {
    int H = HD / 2, N = B * T;
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)N * nh * HD >= FL_CPU_PAR_MIN)
    for (int n = 0; n < N; n++) {
        int t = n % T;
        const float *c = cos_t + (size_t)(pos0 + t) * H;
        const float *s = sin_t + (size_t)(pos0 + t) * H;
        float *row = x + (size_t)n * row_stride; // (nh, HD) heads of row (b,t)
        for (int h = 0; h < nh; h++) {
            float *a = row + (size_t)h * HD, *b = a + H;
            /* FL_VECTORIZE: rope */
#pragma omp simd
            for (int j = 0; j < H; j++) {
                float x0 = a[j], x1 = b[j], sn = sign * s[j];
                a[j] = x0 * c[j] - x1 * sn;
                b[j] = x1 * c[j] + x0 * sn;
            }
        }
    }
}

void fl_cpu_rope_forward(const fl_backend *be, float *x, int B, int T, int nh, int HD, size_t row_stride,
                         const float *cos_t, const float *sin_t, int pos0) {
    rope_apply(be, x, B, T, nh, HD, row_stride, cos_t, sin_t, pos0, 1.0f);
}

void fl_cpu_rope_backward(const fl_backend *be, float *dx, int B, int T, int nh, int HD, size_t row_stride,
                          const float *cos_t, const float *sin_t, int pos0) {
    rope_apply(be, dx, B, T, nh, HD, row_stride, cos_t, sin_t, pos0, -1.0f);
}

/* Attention of one new query row against a KV cache (generation decode step).
 *
 * Per query head h (kv head g = h / (NH/NKV)): scores s_t = q.k_t / sqrt(HD)
 * over the T cached keys, out = sum_t softmax(s)_t v_t. Keys are visited in
 * tiles of DBK with an online softmax (running max m, sum l, rescaled output
 * accumulator o), so no (T) score buffer exists and the work is O(T*HD) per
 * head. Work item = one query head; each item's arithmetic does not depend on
 * the thread that runs it, so results are bit-identical for any thread count.
 * Stack tiles only (ops never allocate), sized for HD <= FL_CPU_ATTN_MAX_HD. */
#include <math.h>
#include <omp.h>

#include "backend/cpu/cpu-impl.h"

#define DBK 64 /* keys per tile */
#define MAXHD FL_CPU_ATTN_MAX_HD

void fl_cpu_attention_decode(const fl_backend *be, float *out /*(NH*HD)*/, const float *q /*(NH*HD)*/,
                             const float *kcache, const float *vcache, int T, int NH, int NKV, int HD,
                             size_t head_stride) {
    if (HD > MAXHD || HD <= 0 || NKV <= 0 || NH % NKV || T <= 0) {
        for (long i = 0; i < (long)NH * (HD > 0 ? HD : 0); i++) out[i] = NAN;
        return;
    }
    const int rep = NH / NKV;
    const float scale = 1.0f / sqrtf((float)HD);
    /* Threads only pay off once there is real work (a fork/join costs a few us). */
    const long work = (long)NH * T * HD;
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if (work > 65536)
    for (int h = 0; h < NH; h++) {
        const int g = h / rep;
        const float *K = kcache + (size_t)g * head_stride; // (T,HD)
        const float *V = vcache + (size_t)g * head_stride; // (T,HD)
        float qs[MAXHD], o[MAXHD], s[DBK];
        for (int d = 0; d < HD; d++) {
            qs[d] = q[(size_t)h * HD + d] * scale;
            o[d] = 0.0f;
        }
        float m = -INFINITY, l = 0.0f;
        for (int t0 = 0; t0 < T; t0 += DBK) {
            const int kn = T - t0 < DBK ? T - t0 : DBK;
            /* scores of the tile: s[j] = q . k_j, vectorized over keys (d outer) */
            const float *Kt = K + (size_t)t0 * HD; // (kn,HD) contiguous
            for (int j = 0; j < DBK; j++) s[j] = 0.0f;
            for (int d = 0; d < HD; d++) {
                const float a = qs[d];
#pragma omp simd
                for (int j = 0; j < kn; j++) s[j] += a * Kt[(size_t)j * HD + d];
            }
            float smax = -INFINITY;
            for (int j = 0; j < kn; j++) smax = s[j] > smax ? s[j] : smax;
            const float mnew = smax > m ? smax : m;
            const float corr = fl_cpu_expf(m - mnew); /* first tile: m = -inf -> ~0; o and l are 0 */
            float ps = 0.0f;
#pragma omp simd reduction(+ : ps)
            for (int j = 0; j < kn; j++) {
                float p = fl_cpu_expf(s[j] - mnew);
                s[j] = p;
                ps += p;
            }
            l = l * corr + ps;
            m = mnew;
#pragma omp simd
            for (int d = 0; d < HD; d++) o[d] *= corr;
            for (int j = 0; j < kn; j++) {
                const float *v = V + (size_t)(t0 + j) * HD;
                const float p = s[j];
#pragma omp simd
                for (int d = 0; d < HD; d++) o[d] += p * v[d];
            }
        }
        const float inv = 1.0f / l;
        float *dst = out + (size_t)h * HD;
        for (int d = 0; d < HD; d++) dst[d] = o[d] * inv;
    }
}

/* Attention forward and the KV-cache decode step, semantics of backend.h's attention_forward,
 * attention_forward_ex and attention_decode (the backward: attention_bwd.cu).
 *
 * Forward, flash-attention style in fp32 (no tensor cores): block = (query tile of BQ rows,
 * head h, batch b), 128 threads; the tile's q (times scale) sits in shared memory, key tiles of
 * BK rows of K and V are loaded into shared memory in turn (coalesced, rows padded to D+1 so the
 * strided reads below hit distinct banks). Each row belongs to 8 consecutive lanes: a lane
 * computes the scores of its RPT rows against every 8th key of the tile, the row max is 3 xor
 * shuffles, and an online softmax (running max m, sum l, output rescaled by exp(m_old - m_new))
 * means the (Tq, Tk) scores never exist; P goes through shared memory to the O += P V update,
 * where a lane owns every 8th dimension of its rows. Visibility of key j for row t: j < Tk, the
 * key mask, and (causal) j <= t + Tk - Tq; hidden keys get p = +0 exactly; a row with no visible
 * key ends with l = 0: out 0, lse -inf. Each lane keeps a partial l of its own keys, summed once
 * at the end. Every sum has a fixed order (no atomics): the same bits every run. The fused
 * causal op is the general one on qkv views (ldq = ldk = ldv = (NH+2*NKV)*HD).
 *
 * Decode: block per query head, 4 warps take every 4th cached key; a warp's lanes split the
 * dimensions, the dot product is a warp sum, each warp keeps its own online softmax, and the 4
 * partial (m, l, o) are merged in warp order through shared memory. */
#include "backend/cuda/kernels/attn_common.h"

template <class C> __global__ static void fl_cu_attn_fwd_k(fl_cu_attn_p p) {
    enum { D = C::D, BQ = C::BQ, BK = C::BK, RPT = C::RPT, DP = D + 1, KP = BK + 1, KPT = BK / 8, DPT = D / 8 };
    FL_CU_DYN_SMEM(float, sm);
    float *Qs = sm;           // (BQ, DP) q * scale
    float *Ks = Qs + BQ * DP; // (BK, DP)
    float *Vs = Ks + BK * DP; // (BK, DP)
    float *Ps = Vs + BK * DP; // (BQ, KP) probabilities of the tile
    __shared__ int km[BK];    // key exists and is not padding
    const int tx = threadIdx.x & 7, ry = threadIdx.x >> 3;
    const int qt = (int)gridDim.x - 1 - (int)blockIdx.x; /* causal: the heaviest tiles start first */
    const int h = blockIdx.y, b = blockIdx.z, g = h / p.rep, HD = p.HD;
    const int q0 = qt * BQ, qn = p.Tq - q0 < BQ ? p.Tq - q0 : BQ;
    fl_cu_attn_load_tile<D, BQ>(Qs, p.q + ((size_t)b * p.Tq + q0) * p.ldq + (size_t)h * HD, p.ldq, qn, HD, p.scale);
    const fl_cu_fptr K = p.k + (size_t)b * p.Tk * p.ldk + (size_t)g * HD; // (Tk, HD) stride ldk
    const fl_cu_fptr V = p.v + (size_t)b * p.Tk * p.ldv + (size_t)g * HD; // (Tk, HD) stride ldv
    float m[RPT], l[RPT], o[RPT][DPT];
    int lim[RPT];
    for (int i = 0; i < RPT; i++) {
        int r = ry * RPT + i;
        m[i] = -INFINITY;
        l[i] = 0.0f;
        lim[i] = r < qn ? fl_cu_attn_key_limit(p, q0 + r) : 0; /* padding rows see nothing */
        for (int c = 0; c < DPT; c++) o[i][c] = 0.0f;
    }
    const int kend = qn > 0 ? fl_cu_attn_key_limit(p, q0 + qn - 1) : 0; /* no row of the tile sees keys >= kend */
    for (int k0 = 0; k0 < kend; k0 += BK) {
        const int kn = kend - k0 < BK ? kend - k0 : BK;
        __syncthreads(); /* the previous tile's Ks / Vs / Ps are read */
        fl_cu_attn_load_tile<D, BK>(Ks, K + (size_t)k0 * p.ldk, p.ldk, kn, HD, 1.0f);
        fl_cu_attn_load_tile<D, BK>(Vs, V + (size_t)k0 * p.ldv, p.ldv, kn, HD, 1.0f);
        for (int j = threadIdx.x; j < BK; j += FL_CU_ATTN_THREADS)
            km[j] = j < kn && (!p.kmask || p.kmask[(size_t)b * p.Tk + k0 + j]);
        __syncthreads();
        float s[RPT][KPT];
        for (int i = 0; i < RPT; i++)
            for (int c = 0; c < KPT; c++) s[i][c] = 0.0f;
        for (int d = 0; d < D; d++) {
            float qv[RPT], kv[KPT];
            for (int i = 0; i < RPT; i++) qv[i] = Qs[(ry * RPT + i) * DP + d];
            for (int c = 0; c < KPT; c++) kv[c] = Ks[(tx + 8 * c) * DP + d];
            for (int i = 0; i < RPT; i++)
                for (int c = 0; c < KPT; c++) s[i][c] += qv[i] * kv[c];
        }
        for (int i = 0; i < RPT; i++) {
            const int r = ry * RPT + i;
            const float *br = p.bias && lim[i] > 0 ? p.bias + ((size_t)h * p.Tq + q0 + r) * p.Tk + k0 : NULL;
            float mx = -INFINITY;
            for (int c = 0; c < KPT; c++) {
                int j = tx + 8 * c;
                int vis = km[j] && k0 + j < lim[i];
                s[i][c] = vis ? s[i][c] + (br ? br[j] : 0.0f) : -INFINITY;
                mx = fmaxf(mx, s[i][c]);
            }
            mx = fl_cu_attn_max8(mx);
            const float mnew = fmaxf(m[i], mx);
            /* nothing visible yet: the state stays (m = -inf, l = 0, o = 0), p = 0 */
            const float corr = mnew == -INFINITY ? 1.0f : expf(m[i] - mnew);
            float ps = 0.0f;
            for (int c = 0; c < KPT; c++) {
                float pv = s[i][c] == -INFINITY ? 0.0f : expf(s[i][c] - mnew);
                /* dropout: V sees the dropped weights, l sums the softmax's own */
                Ps[r * KP + tx + 8 * c] = p.drop_p > 0.0f ? pv * fl_cu_attn_dropf(p, b, h, q0 + r, k0 + tx + 8 * c) : pv;
                ps += pv;
            }
            l[i] = l[i] * corr + ps;
            m[i] = mnew;
            for (int c = 0; c < DPT; c++) o[i][c] *= corr;
        }
        __syncthreads(); /* Ps complete */
        for (int j = 0; j < kn; j++) {
            float vv[DPT];
            for (int c = 0; c < DPT; c++) vv[c] = Vs[j * DP + tx + 8 * c];
            for (int i = 0; i < RPT; i++) {
                float pj = Ps[(ry * RPT + i) * KP + j];
                for (int c = 0; c < DPT; c++) o[i][c] += pj * vv[c];
            }
        }
    }
    for (int i = 0; i < RPT; i++) {
        const int r = ry * RPT + i;
        const float lsum = fl_cu_attn_sum8(l[i]);
        if (r >= qn) continue;
        const size_t at = ((size_t)b * p.Tq + q0 + r) * p.ldo + (size_t)h * HD;
        float *dst = p.o ? p.o + at : NULL; /* NULL: the bf16 copy only */
        uint16_t *dst16 = p.o16 ? p.o16 + at : NULL;
        const float inv = lsum > 0.0f ? 1.0f / lsum : 0.0f; /* no visible key: out 0 */
        for (int c = 0; c < DPT; c++) {
            int d = tx + 8 * c;
            if (d < HD) fl_cu_put16(dst, dst16, (size_t)d, o[i][c] * inv);
        }
        if (tx == 0) p.l[((size_t)b * p.NH + h) * p.Tq + q0 + r] = lsum > 0.0f ? m[i] + logf(lsum) : -INFINITY;
    }
}

template <class C> static int fl_cu_attn_fwd_launch(const fl_cu_attn_p &p, void *stream) {
    enum { D = C::D, BQ = C::BQ, BK = C::BK };
    const size_t smem = sizeof(float) * ((size_t)BQ * (D + 1) + 2 * (size_t)BK * (D + 1) + (size_t)BQ * (BK + 1));
    if (FL_CU_SMEM_OPTIN(fl_cu_attn_fwd_k<C>, smem)) return fl_cu_launch_error();
    dim3 grid((unsigned)((p.Tq + BQ - 1) / BQ), (unsigned)p.NH, (unsigned)p.B);
    FL_CU_LAUNCH(fl_cu_attn_fwd_k<C>, grid, dim3(FL_CU_ATTN_THREADS), smem, (fl_cu_stream)stream, p);
    return fl_cu_launch_error();
}

static int attn_fwd(const fl_attn_desc *a, float *out, void *out16, float *lse, const void *q, const void *k,
                    const void *v, const float *bias, const uint8_t *kmask, int in16, void *stream) {
    fl_cu_attn_p p;
    int rc = fl_cu_attn_fwd_setup(&p, a, out, out16, lse, q, k, v, bias, kmask, 0, in16);
    if (rc) return rc < 0 ? rc : 0;
    switch (fl_cu_attn_bucket(a->HD)) {
    case 32: return fl_cu_attn_fwd_launch<fl_cu_attn_cfg<32> >(p, stream);
    case 64: return fl_cu_attn_fwd_launch<fl_cu_attn_cfg<64> >(p, stream);
    case 128: return fl_cu_attn_fwd_launch<fl_cu_attn_cfg<128> >(p, stream);
    default: return fl_cu_attn_fwd_launch<fl_cu_attn_cfg<256> >(p, stream);
    }
}
extern "C" int FL_CUK(attention_forward_ex)(const fl_attn_desc *a, float *out, void *out16, float *lse,
                                            const float *q, const float *k, const float *v, const float *bias,
                                            const uint8_t *kmask, void *stream) {
    return attn_fwd(a, out, out16, lse, q, k, v, bias, kmask, 0, stream);
}
extern "C" int FL_CUK(attention_forward_ex16)(const fl_attn_desc *a, float *out, void *out16, float *lse,
                                              const void *q16, const void *k16, const void *v16, const uint8_t *kmask,
                                              void *stream) {
    return attn_fwd(a, out, out16, lse, q16, k16, v16, NULL, kmask, 1, stream);
}

extern "C" int FL_CUK(attention_forward)(float *out, float *lse, const float *qkv, int B, int T, int NH, int NKV,
                                         int HD, void *stream) {
    fl_attn_desc a = fl_attn_desc_qkv(B, T, NH, NKV, HD);
    if (!qkv || NKV <= 0 || HD <= 0) return HD > FL_CU_ATTN_MAX_HD ? FL_CU_ATTN_UNSUPPORTED : FL_CU_ATTN_INVALID;
    return FL_CUK(attention_forward_ex)(&a, out, NULL, lse, qkv, qkv + (size_t)NH * HD, qkv + (size_t)(NH + NKV) * HD,
                                        NULL, NULL, stream);
}

/* ---- decode -------------------------------------------------------------------------------- */

#define FL_CU_DEC_WARPS 4

template <int D> __global__ static void fl_cu_attn_decode_k(float *out, const float *q, const float *kcache,
                                                            const float *vcache, int T, int rep, int HD,
                                                            size_t head_stride, float scale) {
    enum { DPL = D / 32 }; /* dimensions per lane */
    __shared__ float wm[FL_CU_DEC_WARPS], wl[FL_CU_DEC_WARPS], wo[FL_CU_DEC_WARPS][D];
    const int h = blockIdx.x, g = h / rep, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float *K = kcache + (size_t)g * head_stride, *V = vcache + (size_t)g * head_stride; // (T, HD)
    float qv[DPL], o[DPL];
    for (int c = 0; c < DPL; c++) {
        int d = lane + 32 * c;
        qv[c] = d < HD ? q[(size_t)h * HD + d] * scale : 0.0f;
        o[c] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int t = warp; t < T; t += FL_CU_DEC_WARPS) {
        const float *kr = K + (size_t)t * HD, *vr = V + (size_t)t * HD;
        float s = 0.0f;
        for (int c = 0; c < DPL; c++) {
            int d = lane + 32 * c;
            if (d < HD) s += qv[c] * kr[d];
        }
        s = fl_cu_warp_sum(s); /* every lane the same bits */
        const float mnew = fmaxf(m, s), corr = expf(m - mnew), pv = expf(s - mnew);
        l = l * corr + pv;
        m = mnew;
        for (int c = 0; c < DPL; c++) {
            int d = lane + 32 * c;
            o[c] = o[c] * corr + (d < HD ? pv * vr[d] : 0.0f);
        }
    }
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
    for (int c = 0; c < DPL; c++) wo[warp][lane + 32 * c] = o[c];
    __syncthreads();
    float M = wm[0];
    for (int w = 1; w < FL_CU_DEC_WARPS; w++) M = fmaxf(M, wm[w]); /* finite: T >= 1 */
    float L = 0.0f;
    for (int w = 0; w < FL_CU_DEC_WARPS; w++) L += wl[w] * expf(wm[w] - M); /* an idle warp: 0 * 0 */
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float acc = 0.0f;
        for (int w = 0; w < FL_CU_DEC_WARPS; w++) acc += wo[w][d] * expf(wm[w] - M);
        out[(size_t)h * HD + d] = acc / L;
    }
}

extern "C" int FL_CUK(attention_decode)(float *out, const float *q, const float *kcache, const float *vcache, int T,
                                        int NH, int NKV, int HD, size_t head_stride, void *stream) {
    if (HD > FL_CU_ATTN_MAX_HD) return FL_CU_ATTN_UNSUPPORTED;
    if (!out || !q || !kcache || !vcache || T <= 0 || NH <= 0 || NKV <= 0 || HD <= 0 || NH % NKV ||
        (NKV > 1 && head_stride < (size_t)T * HD))
        return FL_CU_ATTN_INVALID;
    const int rep = NH / NKV;
    const float scale = 1.0f / sqrtf((float)HD);
    const dim3 grid((unsigned)NH), block(32 * FL_CU_DEC_WARPS);
    switch (fl_cu_attn_bucket(HD)) {
    case 32:
        FL_CU_LAUNCH(fl_cu_attn_decode_k<32>, grid, block, 0, (fl_cu_stream)stream, out, q, kcache, vcache, T, rep,
                     HD, head_stride, scale);
        break;
    case 64:
        FL_CU_LAUNCH(fl_cu_attn_decode_k<64>, grid, block, 0, (fl_cu_stream)stream, out, q, kcache, vcache, T, rep,
                     HD, head_stride, scale);
        break;
    case 128:
        FL_CU_LAUNCH(fl_cu_attn_decode_k<128>, grid, block, 0, (fl_cu_stream)stream, out, q, kcache, vcache, T,
                     rep, HD, head_stride, scale);
        break;
    default:
        FL_CU_LAUNCH(fl_cu_attn_decode_k<256>, grid, block, 0, (fl_cu_stream)stream, out, q, kcache, vcache, T,
                     rep, HD, head_stride, scale);
        break;
    }
    return fl_cu_launch_error();
}

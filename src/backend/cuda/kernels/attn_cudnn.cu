/* The kernel of the cuDNN attention path (cuda-cudnn-impl.h) besides the copies: attention_heads2d moves each head's
 * columns between a call's head size and cuDNN's (a multiple of 8: OpenLLaMA 3B's 100 runs at 104), zero-padding
 * the operands' copies and dropping the padding of the results, and adds cuDNN's 16-bit dQ, dK, dV into the fp32
 * gradients (the backend's attention_backward ACCUMULATES; one head of the whole row where the sizes agree). */
#include "backend/cuda/cu_compat.h"
#include "backend/cuda/cu_kernels_attn.h"

/* grid (ceil(heads * wdst / 256), min(rows, 65535)); element (r, h, c), c < wdst: c < w ? src[r lds + h shs + c] : 0,
 * into (or, acc, added to) dst[r ldd + h dhs + c] */
__global__ static void fl_cu_attn_heads2d_k(void *dst, int dt, size_t ldd, int dhs, const void *src, int st, size_t lds,
                                            int shs, int rows, int heads, int w, int wdst, int acc) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= heads * wdst) return;
    const int h = i / wdst, c = i - h * wdst;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        float v = 0.0f;
        if (c < w) {
            const size_t o = (size_t)r * lds + (size_t)h * shs + c;
            v = st == FL_F32 ? ((const float *)src)[o]
                : st == FL_BF16 ? fl_cu_bf16_to_f32(((const uint16_t *)src)[o]) : fl_cu_f16_to_f32(((const uint16_t *)src)[o]);
        }
        const size_t o = (size_t)r * ldd + (size_t)h * dhs + c;
        if (dt == FL_F32) ((float *)dst)[o] = acc ? ((float *)dst)[o] + v : v;
        else ((uint16_t *)dst)[o] = fl_cu_f32_to_bf16(v);
    }
}

extern "C" int FL_CUK(attention_heads2d)(void *dst, fl_dtype dt, size_t ldd, int dhs, const void *src, fl_dtype st,
                                         size_t lds, int shs, int rows, int heads, int w, int wdst, int acc,
                                         void *stream) {
    if ((dt != FL_F32 && dt != FL_BF16) || (st != FL_F32 && st != FL_BF16 && st != FL_F16) || (acc && dt != FL_F32) ||
        rows < 0 || heads < 0 || w < 0 || wdst < w || dhs < wdst || shs < w ||
        (heads && (ldd < (size_t)(heads - 1) * dhs + wdst || lds < (size_t)(heads - 1) * shs + w)))
        return FL_CU_ATTN_INVALID;
    if (!rows || !heads || !wdst) return 0;
    if (!dst || !src) return FL_CU_ATTN_INVALID;
    dim3 grid((unsigned)((heads * wdst + 255) / 256), (unsigned)(rows < 65535 ? rows : 65535));
    FL_CU_LAUNCH(fl_cu_attn_heads2d_k, grid, dim3(256), 0, (fl_cu_stream)stream, dst, (int)dt, ldd, dhs, src, (int)st,
                 lds, shs, rows, heads, w, wdst, acc);
    return fl_cu_launch_error();
}

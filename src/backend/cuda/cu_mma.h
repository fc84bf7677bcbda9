/* fitllm CUDA kernels: the tensor-core MMA, in both worlds of cu_compat.h (include after it).
 *
 * fl_cu_mma_bf16_16816(d, a, b, c): D (16x8) = A (16x16) B (16x8) + C, bf16 operands, fp32
 * accumulator: PTX `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`, one warp, every lane
 * of which must call it (converged; sm_80 and later). Fragments, per the PTX ISA ("Matrix
 * Fragments for mma.m16n8k16 with floating point type"), with g = lane / 4, t = lane % 4; a
 * uint32_t holds two bf16, the lower-indexed element in the low 16 bits:
 *   A (row-major 16x16): a[0] = A[g][2t, 2t+1]      a[1] = A[g+8][2t, 2t+1]
 *                        a[2] = A[g][2t+8, 2t+9]    a[3] = A[g+8][2t+8, 2t+9]
 *   B (16x8, "col": k down, n across): b[0] = B[2t, 2t+1][g]   b[1] = B[2t+8, 2t+9][g]
 *   C, D (16x8 fp32):    c[0], c[1] = C[g][2t, 2t+1]            c[2], c[3] = C[g+8][2t, 2t+1]
 * So an accumulator pair (c[0], c[1]) of two neighbouring n-tiles packs into an A fragment of
 * the next product (flash attention's P and dS stay in registers), and a B fragment of a
 * row-major (n, k) matrix (keys x dims) is one 32-bit shared-memory read per register.
 *
 * The emulator (FL_CU_EMULATED): the lanes' fragments are gathered through the warp's exchange
 * slots (fl_cu_emu_warp_gather: one warp barrier phase), then each lane computes its 4 outputs
 * in fp32 as d = c, then d += a_k b_k for k = 0..15 in order, each product exact (8-bit
 * significands: 16 bits fit fp32's 24) and each add rounded to nearest even. The hardware's
 * order and internal rounding are unspecified (NVIDIA documents neither; tensor cores are known
 * to align the addends to the largest exponent and truncate): tests must not compare bits with
 * it; they bound |D - exact| by the fp32 accumulation bound over the 16 + 1 terms (doubled for
 * truncation), which holds for any order. Inputs that are small integers give exact results on
 * both (tests/test_cuda_attn.c's cuda_attn_mma, and the GPU check of tests/cuda/check_attn.c). */
#ifndef FL_CU_MMA_H
#define FL_CU_MMA_H

#include "backend/cuda/cu_compat.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "cu_mma.h: bf16 mma.sync needs sm_80 or later (FL_CUDA_ARCHS)"
#endif

FL_CU_DEV void fl_cu_mma_bf16_16816(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}
/* Two floats as a bf16 pair (lo in the low half), each rounded to nearest even: cvt.rn.bf16x2.f32,
 * the bits of fl_cu_f32_to_bf16 (NaN stays NaN). */
FL_CU_DEV uint32_t fl_cu_pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

#else /* the emulator */

FL_CU_DEV void fl_cu_mma_bf16_16816(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
    const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
    const unsigned char *v = fl_cu_emu_warp_gather_begin(mine, sizeof mine); /* lane l's 6 words at l * GATHER_MAX */
    static const unsigned char zeros[32 * FL_CU_EMU_GATHER_MAX] = {0};
    if (!v) v = zeros;
    const int lane = fl_cu_emu_lane(), g = lane >> 2, t = lane & 3;
    float out[4];
    for (int i = 0; i < 4; i++) {
        const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        float acc = c[i];
        for (int k = 0; k < 16; k++) {
            uint32_t aw, bw;
            /* A[row][k]: lane (row % 8) * 4 + (k % 8) / 2, register (row >= 8) + 2 (k >= 8) */
            memcpy(&aw, v + ((row & 7) * 4 + ((k & 7) >> 1)) * FL_CU_EMU_GATHER_MAX + 4 * ((row >> 3) + 2 * (k >> 3)), 4);
            /* B[k][col]: lane col * 4 + (k % 8) / 2, register 4 + (k >= 8) */
            memcpy(&bw, v + (col * 4 + ((k & 7) >> 1)) * FL_CU_EMU_GATHER_MAX + 4 * (4 + (k >> 3)), 4);
            const float av = fl_cu_bf16_to_f32((uint16_t)(k & 1 ? aw >> 16 : aw & 0xffffu));
            const float bv = fl_cu_bf16_to_f32((uint16_t)(k & 1 ? bw >> 16 : bw & 0xffffu));
            acc += av * bv;
        }
        out[i] = acc;
    }
    fl_cu_emu_warp_gather_end();
    for (int i = 0; i < 4; i++) d[i] = out[i]; /* d may be c */
}
FL_CU_DEV uint32_t fl_cu_pack_bf16(float lo, float hi) {
    return (uint32_t)fl_cu_f32_to_bf16(lo) | ((uint32_t)fl_cu_f32_to_bf16(hi) << 16);
}
#endif
#endif

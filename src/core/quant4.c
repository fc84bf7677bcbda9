/* 4-bit NF4/FP4 quantization with bitsandbytes' CUDA-kernel semantics (see fitllm/quant4.h),
 * the format and its reference quantize / dequantize, used by every backend and by the model's
 * loaders (the CPU's fused dequantize-matmul ops are backend/cpu/q4matmul.c).
 *
 * Compiled with -ffp-contract=off (CMakeLists.txt): the double-quantized absmax is
 * code * scale + offset with two roundings, as bnb computes it (dequantize_blockwise, then +=).
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <omp.h>
#include <stdio.h>
#include <string.h>

#include "fitllm/adam8bit.h"
#include "fitllm/cpu.h"
#include "fitllm/quant4.h"

const float fl_q4_nf4_code[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f,
};
/* fp4_dequantization_lut[q & 7] * (q & 8 ? -1 : 1) */
const float fl_q4_fp4_code[16] = {
    0.0f, 0.005208333333f, 0.66666667f, 1.0f, 0.33333333f, 0.5f, 0.16666667f, 0.25f,
    -0.0f, -0.005208333333f, -0.66666667f, -1.0f, -0.33333333f, -0.5f, -0.16666667f, -0.25f,
};

/* dQuantizeNF4: the kernel's tree, thresholds as its float literals. */
static inline uint8_t q_nf4(float x) {
    if (x > 0.03979014977812767f) {
        if (x > 0.3893125355243683f) {
            if (x > 0.6427869200706482f) return x > 0.8614784181118011f ? 15 : 14;
            return x > 0.5016634166240692f ? 13 : 12;
        }
        if (x > 0.2035212516784668f) return x > 0.2920137718319893f ? 11 : 10;
        return x > 0.1202552504837513f ? 9 : 8;
    }
    if (x > -0.33967943489551544f) {
        if (x > -0.13791173323988914f) return x > -0.045525018125772476f ? 7 : 6;
        return x > -0.23460740596055984f ? 5 : 4;
    }
    if (x > -0.6106329262256622f) return x > -0.4599952697753906f ? 3 : 2;
    return x > -0.8480964004993439f ? 1 : 0;
}

/* dQuantizeFP4 */
static inline uint8_t q_fp4(float x) {
    int sign = x < 0 ? 8 : 0;
    x = fabsf(x);
    if (x > 0.29166667f) {
        if (x > 0.583333f) return (uint8_t)((x > 0.8333333f ? 3 : 2) + sign);
        return (uint8_t)((x > 0.4166667f ? 5 : 4) + sign);
    }
    if (x > 0.0859375f) return (uint8_t)((x > 0.20833333f ? 7 : 6) + sign);
    return (uint8_t)((x > 0.00260417f ? 1 : 0) + sign);
}

/* dQuantize<0> (non-stochastic): binary search over the 256-entry code, midpoint ties. */
static uint8_t q_dynamic(const float *code, float x) {
    int pivot = 127, upper_pivot = 255, lower_pivot = 0;
    float lower = -1.0f, upper = 1.0f;
    float val = code[pivot];
    for (int i = 64; i > 0; i >>= 1) {
        if (x > val) {
            lower_pivot = pivot;
            lower = val;
            pivot += i;
        } else {
            upper_pivot = pivot;
            upper = val;
            pivot -= i;
        }
        val = code[pivot];
    }
    if (upper_pivot == 255) upper = code[upper_pivot];
    if (lower_pivot == 0) lower = code[lower_pivot];
    if (x > val) {
        float mid = (upper + val) * 0.5f;
        return (uint8_t)(x > mid ? upper_pivot : pivot);
    }
    float mid = (lower + val) * 0.5f;
    return (uint8_t)(x < mid ? lower_pivot : pivot);
}

static size_t round4(size_t x) { return (x + 3) & ~(size_t)3; }

size_t fl_q4_bytes(size_t n, int double_quant) {
    size_t nb = (n + FL_Q4_BLOCK - 1) / FL_Q4_BLOCK;
    size_t b = round4((n + 1) / 2);
    if (!double_quant) return b + 4 * nb;
    size_t ndq = (nb + FL_Q4_DQ_BLOCK - 1) / FL_Q4_DQ_BLOCK;
    return b + round4(nb) + 4 * ndq + 4;
}

size_t fl_q4_mapped_bytes(int rows, size_t n_blocks) {
    return n_blocks * (FL_Q4_BLOCK / 2) + 4 * n_blocks + 4 * (size_t)rows;
}

size_t fl_q4_weight_bytes(const fl_q4_weight *w) {
    return w->row_start ? fl_q4_mapped_bytes(w->rows, w->n_blocks) : fl_q4_bytes(w->n, w->double_quant);
}

fl_status fl_q4_bind_mapped(fl_q4_weight *w, int rows, int cols, fl_q4_type type, size_t n_blocks, void *mem) {
    FL_TRY(fl_q4_bind(w, rows, cols, type, 0, mem));
    w->n_blocks = n_blocks;
    w->absmax = (float *)((uint8_t *)mem + n_blocks * (FL_Q4_BLOCK / 2));
    w->row_start = (uint32_t *)(w->absmax + n_blocks);
    return FL_OK;
}

size_t fl_q4_map_rows(const size_t *st, size_t R, size_t K, size_t *src_block, uint32_t *row_start) {
    const size_t B = FL_Q4_BLOCK;
    int cut = 0; /* whole blocks already: every contiguous run starts on a block and is whole blocks long */
    for (size_t row = 0; row < R && !cut; row++) {
        const int run_start = row == 0 || st[row] != st[row - 1] + K;
        const int run_end = row + 1 == R || st[row + 1] != st[row] + K;
        if (run_start && st[row] % B) cut = 1;
        if (run_end && (st[row] + K) % B) cut = 1;
    }
    size_t nb = 0, seg_base = 0, seg_b0 = 0, seg_b1 = 0;
    for (size_t row = 0; row < R && cut; row++) {
        const size_t b0 = st[row] / B, b1 = (st[row] + K + B - 1) / B;
        if (nb == 0 || b0 < seg_b0 || b0 > seg_b1) seg_base = nb, seg_b0 = seg_b1 = b0; /* a new run of blocks */
        for (; seg_b1 < b1; seg_b1++, nb++)
            if (src_block) src_block[nb] = seg_b1;
        if (row_start) row_start[row] = (uint32_t)(seg_base * B + (st[row] - seg_b0 * B));
    }
    return nb;
}

fl_status fl_q4_take_blocks(const fl_q4_weight *whole, const size_t *src_block, fl_q4_weight *part) {
    const size_t BB = FL_Q4_BLOCK / 2;
    for (size_t k = 0; k < part->n_blocks; k++) { /* whole block src_block[k]: its codes and dequantized absmax */
        const size_t b = src_block[k];
        if (b >= whole->n_blocks)
            return fl_errorf(FL_ERR_INVALID, "4-bit blocks: block %zu of %zu", b, whole->n_blocks);
        const size_t left = (whole->n - b * FL_Q4_BLOCK + 1) / 2;
        memcpy(part->packed + k * BB, whole->packed + b * BB, left < BB ? left : BB);
        part->absmax[k] = fl_q4_block_absmax(whole, b);
    }
    return FL_OK;
}

fl_status fl_q4_parse_mode(const char *mode, fl_q4_type *type, int *double_quant) {
    static const char *valid = "bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.fp4-dq";
    if (!mode) return fl_errorf(FL_ERR_INVALID, "quantize: no mode given (valid: %s)", valid);
    const char *m = strncmp(mode, "bnb.", 4) == 0 ? mode + 4 : mode;
    static const struct { const char *s; fl_q4_type t; int dq; } tab[] = {
        {"nf4", FL_Q4_NF4, 0}, {"nf4-dq", FL_Q4_NF4, 1}, {"fp4", FL_Q4_FP4, 0}, {"fp4-dq", FL_Q4_FP4, 1}};
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++)
        if (strcmp(m, tab[i].s) == 0) {
            if (type) *type = tab[i].t;
            if (double_quant) *double_quant = tab[i].dq;
            return FL_OK;
        }
    return fl_errorf(FL_ERR_INVALID, "quantize: unsupported mode '%s' (valid: %s)", mode, valid);
}

const char *fl_q4_mode_name(fl_q4_type type, int double_quant) {
    if (type == FL_Q4_NF4) return double_quant ? "nf4-dq" : "nf4";
    return double_quant ? "fp4-dq" : "fp4";
}

fl_status fl_q4_bind(fl_q4_weight *w, int rows, int cols, fl_q4_type type, int double_quant, void *mem) {
    if (!w || rows <= 0 || cols <= 0 || (type != FL_Q4_NF4 && type != FL_Q4_FP4))
        return fl_errorf(FL_ERR_INVALID, "fl_q4_bind: bad shape (%d, %d) or type %d", rows, cols, (int)type);
    if (!mem || ((uintptr_t)mem & 3)) return fl_errorf(FL_ERR_INVALID, "fl_q4_bind: memory NULL or not 4-byte aligned");
    memset(w, 0, sizeof *w);
    w->rows = rows;
    w->cols = cols;
    w->type = type;
    w->double_quant = double_quant ? 1 : 0;
    w->n = (size_t)rows * (size_t)cols;
    w->n_blocks = (w->n + FL_Q4_BLOCK - 1) / FL_Q4_BLOCK;
    uint8_t *p = mem;
    w->packed = p;
    p += round4((w->n + 1) / 2);
    if (!double_quant) {
        w->absmax = (float *)p;
    } else {
        w->n_dq_blocks = (w->n_blocks + FL_Q4_DQ_BLOCK - 1) / FL_Q4_DQ_BLOCK;
        w->q_absmax = p;
        p += round4(w->n_blocks);
        w->absmax_scale = (float *)p;
        p += 4 * w->n_dq_blocks;
        w->offset = (float *)p;
    }
    return FL_OK;
}

/* Quantize one block of 64 (or fewer) into codes; returns absmax. Codes are written as nibbles
 * into packed (elements [i0, i0+len), i0 even). */
static float quant_block(const float *x, size_t len, size_t i0, uint8_t *packed, fl_q4_type t) {
    float am = -FLT_MAX;
    for (size_t j = 0; j < len; j++) am = fmaxf(am, fabsf(x[j]));
    if (len == 0) am = 0;
    float r = 1.0f / am; /* absmax 0 -> inf -> NaN codes -> 0, as the kernel */
    for (size_t j = 0; j < len; j += 2) {
        uint8_t hi = t == FL_Q4_NF4 ? q_nf4(x[j] * r) : q_fp4(x[j] * r);
        uint8_t lo = 0;
        if (j + 1 < len) lo = t == FL_Q4_NF4 ? q_nf4(x[j + 1] * r) : q_fp4(x[j + 1] * r);
        packed[(i0 + j) / 2] = (uint8_t)((hi << 4) | lo);
    }
    return am;
}

fl_status fl_q4_quantize(fl_q4_weight *w, const float *src, int n_threads) {
    if (!w || !w->packed || !src) return fl_errorf(FL_ERR_INVALID, "fl_q4_quantize: unbound weight or NULL source");
    if (w->row_start)
        return fl_errorf(FL_ERR_UNSUPPORTED, "fl_q4_quantize: a tensor-parallel part of whole blocks is copied "
                         "from one process's quantization, not quantized");
    const size_t n = w->n, nb = w->n_blocks;
    int nt = n_threads > 0 ? n_threads : fl_cpu_default_threads();
    float *am = w->absmax;
    /* dq: the raw absmax go into a temporary (the only allocation: quantization is a load-time step). */
    float *raw = am;
    if (w->double_quant) {
        raw = malloc(nb * sizeof(float));
        if (!raw) return fl_errorf(FL_ERR_OOM, "fl_q4_quantize: %zu absmax values", nb);
    }
#pragma omp parallel for num_threads(nt) schedule(static)
    for (size_t b = 0; b < nb; b++) {
        size_t i0 = b * FL_Q4_BLOCK;
        size_t len = n - i0 < FL_Q4_BLOCK ? n - i0 : FL_Q4_BLOCK;
        raw[b] = quant_block(src + i0, len, i0, w->packed, w->type);
    }
    if (w->double_quant) {
        double s = 0;
        for (size_t b = 0; b < nb; b++) s += raw[b];
        float off = (float)(s / (double)nb);
        *w->offset = off;
        const float *code = fl_adam8bit_code_signed;
        for (size_t d = 0; d < w->n_dq_blocks; d++) {
            size_t b0 = d * FL_Q4_DQ_BLOCK, b1 = b0 + FL_Q4_DQ_BLOCK < nb ? b0 + FL_Q4_DQ_BLOCK : nb;
            float m = -FLT_MAX;
            for (size_t b = b0; b < b1; b++) m = fmaxf(m, fabsf(raw[b] - off));
            w->absmax_scale[d] = m;
            float r = 1.0f / m;
            for (size_t b = b0; b < b1; b++) w->q_absmax[b] = q_dynamic(code, (raw[b] - off) * r);
        }
        free(raw);
    }
    return FL_OK;
}

float fl_q4_block_absmax(const fl_q4_weight *w, size_t b) {
    if (!w->double_quant) return w->absmax[b];
    float v = fl_adam8bit_code_signed[w->q_absmax[b]] * w->absmax_scale[b / FL_Q4_DQ_BLOCK];
    return v + *w->offset;
}

void fl_q4_dequantize_tile(const fl_q4_weight *w, int r0, int nr, int c0, int c1, float *dst, int ldd) {
    const float *code = w->type == FL_Q4_NF4 ? fl_q4_nf4_code : fl_q4_fp4_code;
    const uint8_t *pk = w->packed;
    for (int r = 0; r < nr; r++) {
        size_t i = (w->row_start ? (size_t)w->row_start[r0 + r] : (size_t)(r0 + r) * (size_t)w->cols) + (size_t)c0;
        size_t iend = i + (size_t)(c1 - c0);
        float *d = dst + (size_t)r * ldd;
        while (i < iend) {
            size_t b = i / FL_Q4_BLOCK;
            size_t bend = (b + 1) * FL_Q4_BLOCK < iend ? (b + 1) * FL_Q4_BLOCK : iend;
            float am = fl_q4_block_absmax(w, b);
            float lut[16];
            for (int q = 0; q < 16; q++) lut[q] = code[q] * am;
            if (i & 1) { *d++ = lut[pk[i >> 1] & 15]; i++; }
            for (; i + 1 < bend; i += 2) {
                uint8_t byte = pk[i >> 1];
                d[0] = lut[byte >> 4];
                d[1] = lut[byte & 15];
                d += 2;
            }
            if (i < bend) { *d++ = lut[pk[i >> 1] >> 4]; i++; }
        }
    }
}

fl_status fl_q4_dequantize(const fl_q4_weight *w, float *dst, int n_threads) {
    if (!w || !w->packed || !dst) return fl_errorf(FL_ERR_INVALID, "fl_q4_dequantize: unbound weight or NULL dst");
    int nt = n_threads > 0 ? n_threads : fl_cpu_default_threads();
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int r = 0; r < w->rows; r++) fl_q4_dequantize_tile(w, r, 1, 0, w->cols, dst + (size_t)r * w->cols, w->cols);
    return FL_OK;
}


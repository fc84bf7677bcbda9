/* fitllm: 4-bit weights with bitsandbytes semantics (QLoRA bases).
 *
 * What bnb.functional.quantize_4bit does on a GPU (csrc/kernels.cu kQuantizeBlockwise<float, 64,
 * 2, 0, NF4|FP4>), reproduced bit for bit (tests/ref/quant4_ref.py, tests/test_quant4.c):
 *   - the weight (rows, cols) is taken row-major as n = rows*cols elements, in blocks of
 *     FL_Q4_BLOCK = 64 (the last block may be partial); one fp32 absmax = max|x| per block;
 *   - each element gets the 4-bit code of x * (1.0f / absmax) from the kernel's decision tree
 *     (dQuantizeNF4 / dQuantizeFP4: "x > threshold" goes up, so a value exactly on a midpoint
 *     takes the lower code); an all-zero block has absmax 0, x * inf = NaN, and every code is 0
 *     (NF4 code 0 is -1.0, so it dequantizes to -0.0; bnb's CPU path writes code 7 instead);
 *   - two codes per byte, element 2k in the HIGH nibble, 2k+1 in the low nibble; an odd n leaves
 *     the last low nibble 0;
 *   - dequantized value = code_value[q] * absmax (fp32). FP4 codes are sign | 3 bits
 *     (fl_q4_fp4_code is indexed by the 4-bit pattern).
 * Double quantization ("-dq", bnb compress_statistics=True): offset = mean(absmax) (fp32 of the
 * float64 mean; bnb's torch fp32 mean can differ by an ulp), then absmax - offset is quantized
 * block-wise (FL_Q4_DQ_BLOCK = 256) to 8-bit codes of the signed dynamic map
 * (fl_adam8bit_code_signed) with bnb's dQuantize<0> (binary search, midpoint ties), one fp32
 * scale (= max|absmax - offset| of the 256) per block; the dequantized absmax is
 * code[q_absmax] * scale + offset (two fp32 roundings, no FMA).
 *
 * Storage: ONE contiguous buffer of fl_q4_bytes(n, dq) bytes (tag PARAMS), 4-byte aligned:
 *   packed[(n+1)/2] | pad to 4 | plain: absmax f32[nb]
 *                                dq:    q_absmax u8[nb] | pad to 4 | scale f32[ceil(nb/256)] | offset f32
 * nf4-dq costs 4 + 8/64 + 32/(64*256) = 4.127 bits per parameter (plus < 12 bytes of padding and
 * the 4-byte offset per tensor); nf4 without -dq 4.5 bits.
 * The fused matmul over such a weight is backend->q4_matmul_forward / q4_matmul_backward.
 */
#ifndef FITLLM_QUANT4_H
#define FITLLM_QUANT4_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FL_Q4_BLOCK 64
#define FL_Q4_DQ_BLOCK 256
/* the most 4-bit parts a fused linear's output has (q|k|v; gate|up: 2) */
#define FL_Q4_MAX_PARTS 3

typedef enum { FL_Q4_NF4 = 0, FL_Q4_FP4 = 1 } fl_q4_type;

typedef struct {
    int rows, cols;        /* (out, in) of the linear layer, HF orientation */
    fl_q4_type type;
    int double_quant;      /* 1: absmax stored as q_absmax/absmax_scale/offset */
    size_t n;              /* rows * cols */
    size_t n_blocks;       /* ceil(n / 64) */
    size_t n_dq_blocks;    /* ceil(n_blocks / 256) when double_quant, else 0 */
    uint8_t *packed;       /* (n+1)/2 bytes, first element in the high nibble */
    float *absmax;         /* (n_blocks) when !double_quant, else NULL */
    uint8_t *q_absmax;     /* (n_blocks) codes into fl_adam8bit_code_signed when double_quant */
    float *absmax_scale;   /* (n_dq_blocks) */
    float *offset;         /* (1) mean of the absmax values */
    /* A tensor-parallel rank's part that cuts the blocks (src/model/tp.c fl_tp_q4_map): the stored data are whole
     * blocks of one process's quantization (n_blocks of them, plain fp32 absmax), and element (r, c) is stored element
     * row_start[r] + c (NULL: r * cols + c, the plain layout). Built by block copies, never by fl_q4_quantize. */
    uint32_t *row_start;
} fl_q4_weight;

/* bnb's code books: NF4 (16 values, ascending, code 7 == 0) and FP4 by bit pattern
 * (0, 0.0052, 0.6667, 1, 0.3333, 0.5, 0.1667, 0.25, then the same negated). */
extern const float fl_q4_nf4_code[16];
extern const float fl_q4_fp4_code[16];

/* Bytes of the buffer for n elements (exact, including alignment padding). Pure. */
size_t fl_q4_bytes(size_t n, int double_quant);

/* Parse a quantize mode: "nf4", "nf4-dq", "fp4", "fp4-dq", optionally prefixed "bnb." (LitGPT's
 * --quantize values). Anything else (e.g. "bnb.int8", "nf4-mixed") -> FL_ERR_INVALID naming the
 * valid ones. */
fl_status fl_q4_parse_mode(const char *mode, fl_q4_type *type, int *double_quant);
/* "nf4", "nf4-dq", ... */
const char *fl_q4_mode_name(fl_q4_type type, int double_quant);

/* Point w into mem (fl_q4_bytes(rows*cols, dq) bytes, 4-byte aligned). Does not touch mem. */
fl_status fl_q4_bind(fl_q4_weight *w, int rows, int cols, fl_q4_type type, int double_quant, void *mem);

/* The mapped layout (row_start): bytes of its buffer (packed n_blocks x 32 | absmax f32[n_blocks] | row_start
 * u32[rows]), binding w into mem, and any bound weight's buffer bytes. */
size_t fl_q4_mapped_bytes(int rows, size_t n_blocks);
fl_status fl_q4_bind_mapped(fl_q4_weight *w, int rows, int cols, fl_q4_type type, size_t n_blocks, void *mem);
size_t fl_q4_weight_bytes(const fl_q4_weight *w);
/* The mapped layout of a part of a weight quantized as one: the part's R rows of K elements start at the whole's flat
 * elements starts[0..R). Returns 0 when every maximal run of rows contiguous in the whole starts and ends on a block
 * boundary (the part is whole blocks: no map), else the count of the whole's blocks kept (each run's covering blocks
 * once), filling where not NULL src_block (the whole's block index of each kept block, in order) and row_start (each
 * row's first element among the kept ones). Pure. (src/model/tp.c fl_tp_q4_map gives it a TP slice's starts.) */
size_t fl_q4_map_rows(const size_t *starts, size_t R, size_t K, size_t *src_block, uint32_t *row_start);
/* Fill a mapped part (bound by fl_q4_bind_mapped, row_start set) with the whole's blocks src_block[0..n_blocks):
 * their codes and their fp32 absmax (dequantized when whole is double-quantized). FL_ERR_INVALID naming the block
 * when one is past the whole's. */
fl_status fl_q4_take_blocks(const fl_q4_weight *whole, const size_t *src_block, fl_q4_weight *part);

/* Quantize src (rows, cols) f32 into a bound w. Parallel over blocks (OpenMP, n_threads <= 0:
 * default); the result does not depend on the thread count. */
fl_status fl_q4_quantize(fl_q4_weight *w, const float *src, int n_threads);

/* The fp32 absmax of block b (dequantizing the double-quantized state when dq). */
float fl_q4_block_absmax(const fl_q4_weight *w, size_t b);

/* dst (nr, c1-c0) = deq(W)[r0:r0+nr, c0:c1], row stride ldd. The tile primitive of the fused
 * matmul; also used by merge/export. */
void fl_q4_dequantize_tile(const fl_q4_weight *w, int r0, int nr, int c0, int c1, float *dst, int ldd);
/* dst (rows, cols) = deq(W): the full copy (merge/export/tests only, never in training). */
fl_status fl_q4_dequantize(const fl_q4_weight *w, float *dst, int n_threads);

#ifdef __cplusplus
}
#endif
#endif

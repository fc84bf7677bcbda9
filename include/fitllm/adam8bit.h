/* fitllm: 8-bit Adam state layout (bitsandbytes block-wise dynamic quantization).
 *
 * A tensor of n >= FL_ADAM8BIT_MIN_SIZE elements keeps m and v as one byte per element each
 * (codes into the signed / unsigned dynamic maps of bitsandbytes'
 * create_dynamic_map(signed, max_exponent_bits=7)) plus one fp32 absmax per block of
 * FL_ADAM8BIT_BLOCK elements per state: value = code[q] * absmax[block]. Smaller tensors keep
 * fp32 m and v (bnb's min_8bit_size rule). All-zero memory is the initial state (bnb starts
 * from zero codes and zero absmax, which dequantize to 0).
 *
 * Memory (one contiguous, 8-byte aligned buffer, see fl_adam8bit_state_bind):
 *   8-bit path: q_m[n] q_v[n] (U8), pad to 4, absmax_m[n_blocks] absmax_v[n_blocks] (F32);
 *   fp32 path:  m[n] v[n] (F32).
 * The op is backend->adam8bit_update (fitllm/backend.h).
 */
#ifndef FITLLM_ADAM8BIT_H
#define FITLLM_ADAM8BIT_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/dtype.h"
#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FL_ADAM8BIT_BLOCK 256      /* bnb: blocksize 256 for the 8-bit optimizers */
#define FL_ADAM8BIT_MIN_SIZE 4096  /* bnb: min_8bit_size; smaller tensors keep fp32 state */

typedef struct {
    size_t n;          /* elements */
    size_t n_blocks;   /* ceil(n / FL_ADAM8BIT_BLOCK) (8-bit path), 0 on the fp32 path */
    uint8_t *q_m;      /* (n) codes into fl_adam8bit_code_signed, or NULL on the fp32 path */
    uint8_t *q_v;      /* (n) codes into fl_adam8bit_code_unsigned */
    float *absmax_m;   /* (n_blocks) */
    float *absmax_v;   /* (n_blocks) */
    float *m, *v;      /* (n) fp32 state when n < FL_ADAM8BIT_MIN_SIZE, else NULL */
    /* (n_blocks) or NULL (bind leaves them NULL): each block's new absmax is at least this. FULL_SHARD
     * (src/train/optim.c) updates a block whose elements lie on two ranks on each of them with the
     * max over the whole block's new |m| / v (exchanged) here, so both quantize with one-process
     * scales. max is exact, so max(floor, the part's max) is the whole block's max bit for bit.
     * The backend's memory (device memory on a GPU), like the state; every backend implements it. */
    const float *floor_m, *floor_v;
} fl_adam8bit_state;

/* 1 if a tensor of n elements gets 8-bit state. */
static inline int fl_adam8bit_is_8bit(size_t n) { return n >= FL_ADAM8BIT_MIN_SIZE; }
/* Parameter and gradient dtypes of the update: F32, BF16 and F16 (bnb's kernels take float, bf16 and
 * half; the values are widened to fp32, updated, and rounded once to the parameter type). */
static inline int fl_adam8bit_dtype_ok(fl_dtype t) { return t == FL_F32 || t == FL_BF16 || t == FL_F16; }

/* Bytes of optimizer state for n elements (for the memory planner): 8-bit path
 * 2*n + 8*ceil(n/256) (+ up to 3 bytes padding so the absmax arrays are 4-aligned);
 * fp32 path 8*n. */
size_t fl_adam8bit_state_bytes(size_t n);

/* Point st into mem (fl_adam8bit_state_bytes(n) bytes, 4-byte aligned). Does not clear it:
 * zero the memory once for a fresh state. */
fl_status fl_adam8bit_state_bind(fl_adam8bit_state *st, size_t n, void *mem);
/* The same for a block-aligned piece of n elements of a tensor whose size chose the path
 * (eight_bit = fl_adam8bit_is_8bit(tensor's numel)): ZeRO keeps state for the blocks of the
 * tensor that meet its chunk (src/train/optim.c). The update takes the path the state has
 * (q_m set: 8-bit). */
size_t fl_adam8bit_state_bytes_ex(size_t n, int eight_bit);
fl_status fl_adam8bit_state_bind_ex(fl_adam8bit_state *st, size_t n, int eight_bit, void *mem);

/* bitsandbytes' code tables (create_dynamic_map(signed=True/False), sorted ascending;
 * signed[127] == 0, signed[255] == unsigned[255] == 1, unsigned[0] == 0). */
extern const float fl_adam8bit_code_signed[256];
extern const float fl_adam8bit_code_unsigned[256];

/* The kernel's quantizer (quantize_2D): binary search over the sorted code with its
 * midpoint tie rules; x is the value divided by the block's absmax. */
uint8_t fl_adam8bit_quantize(const float *code, int is_signed, float x);
/* The same for n values (16 at a time with AVX-512 gathers where available). */
void fl_adam8bit_quantize_n(const float *code, int is_signed, const float *x, int n, uint8_t *out);

#ifdef __cplusplus
}
#endif
#endif

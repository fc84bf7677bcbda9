/* A part of a 4-bit weight as a tensor-parallel rank whose part cuts the blocks holds it (issue 35: fl_q4_weight's
 * row map), for the per-op tests of the 4-bit kernels (tests/test_lora.c on every backend, tests/test_cuda_more.c on
 * the CUDA emulator): the whole weight quantized as one, the part's rows given by their start in the whole's flat
 * elements, built with the library's own fl_q4_map_rows / fl_q4_take_blocks (what src/model/tp.c uses). The part's
 * expected values are the whole's dequantized values at the part's elements: independent of the row map. */
#ifndef FITLLM_TEST_Q4_PART_H
#define FITLLM_TEST_Q4_PART_H

#include <stdlib.h>
#include <string.h>

#include "fitllm/quant4.h"

/* the part's shape: R rows of K elements; which of the whole (RW, KW) */
typedef enum {
    Q4P_COLS = 0, /* a row-parallel part: every row's columns [c0, c0 + K) */
    Q4P_ROWS,     /* a column-parallel part: rows [r0, r0 + R) */
    Q4P_FUSED,    /* a fused column-parallel part (QKV, gate/up): rows [r0, r0 + R/2) and [r1, r1 + R/2) */
} q4p_kind;

/* starts (R) of the kind (a: c0 or r0, b: r1) */
static inline void q4p_starts(q4p_kind kind, int R, int KW, int a, int b, size_t *starts) {
    for (int r = 0; r < R; r++) {
        const int row = kind == Q4P_COLS ? r : kind == Q4P_ROWS || r < R / 2 ? a + r : b + r - R / 2;
        starts[r] = (size_t)row * (size_t)KW + (kind == Q4P_COLS ? (size_t)a : 0);
    }
}

/* The part (R, K) at starts of whole into part (its buffer *mem: free() it) and deq (R * K: the whole's dequantized
 * values whole_deq at the part's elements). 1 on success (0: out of memory, or the part cuts no block). */
static inline int q4p_make(const fl_q4_weight *whole, const float *whole_deq, const size_t *starts, int R, int K,
                           fl_q4_weight *part, void **mem, float *deq) {
    *mem = NULL;
    const size_t nb = fl_q4_map_rows(starts, (size_t)R, (size_t)K, NULL, NULL);
    size_t *src = nb ? malloc(nb * sizeof *src) : NULL;
    uint32_t *rs = malloc((size_t)R * sizeof *rs);
    *mem = nb ? calloc(1, fl_q4_mapped_bytes(R, nb)) : NULL;
    int ok = src && rs && *mem && fl_q4_map_rows(starts, (size_t)R, (size_t)K, src, rs) == nb &&
             fl_q4_bind_mapped(part, R, K, whole->type, nb, *mem) == FL_OK;
    if (ok) memcpy(part->row_start, rs, (size_t)R * sizeof *rs);
    ok = ok && fl_q4_take_blocks(whole, src, part) == FL_OK;
    for (int r = 0; ok && r < R; r++) memcpy(deq + (size_t)r * K, whole_deq + starts[r], (size_t)K * sizeof(float));
    free(src);
    free(rs);
    return ok;
}

#endif

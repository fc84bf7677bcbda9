/* The 8-bit AdamW state of fitllm/adam8bit.h: bitsandbytes' dynamic code tables, the state's
 * layout (fl_adam8bit_state_bytes / bind) and the reference quantizer (quantize_2D of the CUDA
 * kernel), shared by every backend's 8-bit AdamW and by the optimizer's state accounting (the
 * CPU's vectorized quantizer and update: backend/cpu/adam8bit.c). Compiled with
 * -ffp-contract=off (CMakeLists.txt), as the update. */
#include <stdint.h>
#include <string.h>

#include "core/adam8bit_codes.inc"
#include "fitllm/adam8bit.h"

const float fl_adam8bit_code_signed[256] = {FL_ADAM8BIT_CODE_SIGNED_VALUES};
const float fl_adam8bit_code_unsigned[256] = {FL_ADAM8BIT_CODE_UNSIGNED_VALUES};

size_t fl_adam8bit_state_bytes(size_t n) { return fl_adam8bit_state_bytes_ex(n, fl_adam8bit_is_8bit(n)); }

size_t fl_adam8bit_state_bytes_ex(size_t n, int eight_bit) {
    if (!eight_bit) return 8 * n;
    size_t nb = (n + FL_ADAM8BIT_BLOCK - 1) / FL_ADAM8BIT_BLOCK;
    size_t q = (2 * n + 3) & ~(size_t)3;
    return q + 8 * nb;
}

fl_status fl_adam8bit_state_bind(fl_adam8bit_state *st, size_t n, void *mem) {
    return fl_adam8bit_state_bind_ex(st, n, fl_adam8bit_is_8bit(n), mem);
}

fl_status fl_adam8bit_state_bind_ex(fl_adam8bit_state *st, size_t n, int eight_bit, void *mem) {
    if (!st || (!mem && n)) return fl_errorf(FL_ERR_INVALID, "adam8bit_state_bind: NULL state or memory (n=%zu)", n);
    if ((uintptr_t)mem % 4)
        return fl_errorf(FL_ERR_INVALID, "adam8bit_state_bind: memory %p not 4-byte aligned", mem);
    memset(st, 0, sizeof *st);
    st->n = n;
    uint8_t *b = mem;
    if (!eight_bit) {
        st->m = (float *)b;
        st->v = (float *)(b + 4 * n);
        return FL_OK;
    }
    st->n_blocks = (n + FL_ADAM8BIT_BLOCK - 1) / FL_ADAM8BIT_BLOCK;
    st->q_m = b;
    st->q_v = b + n;
    size_t q = (2 * n + 3) & ~(size_t)3;
    st->absmax_m = (float *)(b + q);
    st->absmax_v = (float *)(b + q + 4 * st->n_blocks);
    return FL_OK;
}

/* quantize_2D<SIGNED> of the kernel: 7 halving steps from pivot 127, then the midpoint test.
 * Ties: x > val and x == midpoint -> pivot (lower code); x <= val and x == midpoint -> pivot
 * (higher code). NaN compares false everywhere and ends at code 0. */
uint8_t fl_adam8bit_quantize(const float *code, int is_signed, float x) {
    /* bnb's search, written with selects instead of branches: the same comparisons and
     * the same result, but no data-dependent branch per step (each would mispredict
     * about half the time; this loop is the 8-bit optimizer's hot spot). */
    int pivot = 127, upper_pivot = 255, lower_pivot = 0;
    float lower = is_signed ? -1.0f : 0.0f, upper = 1.0f;
    float val = code[pivot];
    for (int i = 64; i > 0; i >>= 1) {
        int gt = x > val;
        lower_pivot = gt ? pivot : lower_pivot;
        lower = gt ? val : lower;
        upper_pivot = gt ? upper_pivot : pivot;
        upper = gt ? upper : val;
        pivot += gt ? i : -i;
        val = code[pivot];
    }
    int gt = x > val;
    float mid = ((gt ? upper : lower) + val) * 0.5f;
    int up = x > mid, down = x < mid;
    return (uint8_t)(gt ? (up ? upper_pivot : pivot) : (down ? lower_pivot : pivot));
}

/* fitllm: precision policies (LitGPT/Lightning names), one object instead of
 * scattered ifs. Each policy says what dtype every kind of buffer has:
 *
 *   policy       PARAMS                       GRADS  OPTIM   matmul operands
 *   32-true      f32                          f32    f32     f32 x f32
 *   bf16-mixed   f32 master + bf16 copy       f32    f32     f32 acts x bf16 weight copy (fp32 accumulate)
 *   bf16-true    bf16                         bf16   bf16    f32 acts x bf16 weights (fp32 accumulate)
 *   16-mixed     f32 master + f16 copy        f32    f32     f32 acts x f16 weight copy, loss scaling
 *   16-true      f16                          f16    f32     f32 acts x f16 weights, loss scaling
 *
 * On the CPU, activations and elementwise ops (norms, attention, activations,
 * cross-entropy) compute in fp32 under every policy, but the 16-bit policies
 * STORE activations in act_dtype: the bf16 policies everything a step stores (the
 * residual stream and every block's slots, rounded as each op writes them: half of
 * ACTS; fp32 only for norm / attention statistics and the loss), the fp16 ones the
 * activations saved for backward (widened back to fp32 block by block). The saving of the mixed
 * policy is otherwise speed (bf16 GEMMs with avx512_bf16 / oneDNN), at the cost of the
 * bf16 weight copy in PARAMS. bf16-true halves PARAMS, GRADS and OPTIM: the
 * flat buffers are bf16; a group's gradients are computed in fp32 into a
 * one-group staging buffer (WORKSPACE) and added into the bf16 gradients once
 * per micro-batch (see fl_model in model.h).
 */
#ifndef FITLLM_PRECISION_H
#define FITLLM_PRECISION_H

#include <stddef.h>

#include "fitllm/dtype.h"
#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    FL_PREC_32_TRUE = 0,
    FL_PREC_BF16_MIXED,
    FL_PREC_BF16_TRUE,
    FL_PREC_16_MIXED,
    FL_PREC_16_TRUE,
    FL_PREC_COUNT
} fl_precision_kind;

typedef struct {
    fl_precision_kind kind;
    const char *name;        /* "32-true", ... */
    fl_dtype param_dtype;    /* storage of the trained (master) parameters */
    fl_dtype compute_dtype;  /* weights as the matmuls read them */
    int compute_copy;        /* a separate compute-dtype copy of the weights exists (mixed) */
    fl_dtype grad_dtype;
    int loss_scaling;        /* dynamic loss scaling (fp16 policies) */
    int available;           /* implemented in this build */
    fl_dtype optim_dtype;    /* AdamW / SGD-momentum state (bf16-true: BF16; 16-true keeps F32 state:
                              * fp16's range cannot hold Adam's second moment) */
    fl_dtype act_dtype;      /* storage of the activations saved for backward (16-bit policies: BF16 /
                              * F16, as PyTorch's autocast and *-true keep them); ops still compute in
                              * fp32 (see fl_act_opts in model.h) */
} fl_precision;

/* Look up a policy by LitGPT name; FL_ERR_INVALID for unknown names. An
 * existing but unavailable policy is returned with available = 0. */
fl_status fl_precision_find(const char *name, fl_precision *out);
const fl_precision *fl_precision_get(fl_precision_kind k);

/* Bytes of the compute-dtype weight copy for n parameters (0 without a copy). */
size_t fl_precision_copy_bytes(const fl_precision *p, size_t n_params);

#ifdef __cplusplus
}
#endif
#endif

/* fitllm: an optimizer's configuration (kind and hyperparameters), a plain value the run
 * configuration (fitllm/config.h) holds and the optimizers (fitllm/train.h) read. It sits below
 * both, so the configuration layer does not reach up into training. Code: src/config/optim_config.c. */
#ifndef FITLLM_OPTIM_CONFIG_H
#define FITLLM_OPTIM_CONFIG_H

#include "fitllm/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ADAMW8BIT: bitsandbytes' block-wise 8-bit AdamW (bnb.optim.AdamW8bit / Adam8bit),
 * state per parameter tensor (see fitllm/adam8bit.h). */
typedef enum { FL_OPT_ADAMW = 0, FL_OPT_SGD, FL_OPT_ADAMW8BIT, FL_OPT_COUNT } fl_optim_kind;

typedef struct {
    fl_optim_kind kind;
    float lr;
    float beta1, beta2, eps;   /* AdamW */
    float weight_decay;        /* AdamW: decoupled; SGD: L2 added to the gradient (torch semantics) */
    float momentum, dampening; /* SGD */
    int nesterov;              /* SGD */
    fl_dtype state_dtype;      /* AdamW / SGD momentum state: FL_F32 (default) or FL_BF16 */
} fl_optim_config;

/* torch defaults: AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8, wd 0.01; SGD lr 1e-3, no momentum. */
void fl_optim_config_default(fl_optim_config *c, fl_optim_kind kind);
const char *fl_optim_name(fl_optim_kind kind);

#ifdef __cplusplus
}
#endif
#endif

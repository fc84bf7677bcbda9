/* An optimizer's configuration: torch's defaults and the names (fitllm/optim_config.h); the learning
 * rate schedule (fitllm/config.h). */
#include <math.h>
#include <string.h>

#include "fitllm/config.h"
#include "fitllm/optim_config.h"

void fl_optim_config_default(fl_optim_config *c, fl_optim_kind kind) {
    memset(c, 0, sizeof *c);
    c->kind = kind;
    c->lr = 1e-3f;
    c->state_dtype = FL_F32;
    if (kind == FL_OPT_ADAMW || kind == FL_OPT_ADAMW8BIT) {
        c->beta1 = 0.9f;
        c->beta2 = 0.999f;
        c->eps = 1e-8f;
        c->weight_decay = 0.01f;
    }
}

const char *fl_optim_name(fl_optim_kind kind) {
    static const char *n[FL_OPT_COUNT] = {"AdamW", "SGD", "AdamW8bit"};
    return (kind >= 0 && kind < FL_OPT_COUNT) ? n[kind] : "?";
}

double fl_lr_schedule(double lr, double min_lr, long step, long warmup, long max_steps) {
    if (min_lr > lr) min_lr = lr; /* a floor above the rate: constant after the warm-up (LitGPT's formula rose to it) */
    if (warmup > 0 && step < warmup) return lr * (double)step / (double)warmup;
    if (max_steps <= warmup) return lr;
    double progress = (double)(step - warmup) / (double)(max_steps - warmup);
    if (progress > 1) progress = 1;
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + cos(M_PI * progress));
}

/* An optimizer's configuration: torch's defaults and the names (fitllm/optim_config.h). */
#include <string.h>

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

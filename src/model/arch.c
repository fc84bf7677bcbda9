/* The architectures this build knows (fl_arch_get): one descriptor each, in src/model/arch_<name>.c. */
#include "fitllm/model.h"

extern const fl_arch_info fl_arch_llama, fl_arch_gpt2, fl_arch_opt, fl_arch_bert, fl_arch_t5, fl_arch_blip2_vision,
    fl_arch_blip2_qformer;

const fl_arch_info *fl_arch_get(fl_arch a) {
    static const fl_arch_info *const all[FL_ARCH_COUNT] = {[FL_ARCH_LLAMA] = &fl_arch_llama, [FL_ARCH_GPT2] = &fl_arch_gpt2,
                                                            [FL_ARCH_OPT] = &fl_arch_opt, [FL_ARCH_BERT] = &fl_arch_bert,
                                                            [FL_ARCH_T5] = &fl_arch_t5,
                                                            [FL_ARCH_BLIP2_VISION] = &fl_arch_blip2_vision,
                                                            [FL_ARCH_BLIP2_QFORMER] = &fl_arch_blip2_qformer};
    return a >= 0 && a < FL_ARCH_COUNT ? all[a] : NULL;
}

int fl_model_is_s2s(const fl_model_config *c) { return c->n_dec_layers > 0 || c->pp_enc > 0; }

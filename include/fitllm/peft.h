/* fitllm: PEFT LoRA adapter folders (what peft's save_pretrained writes and
 * PeftModel.from_pretrained reads):
 *   adapter_config.json        peft_type "LORA", r, lora_alpha, lora_dropout, target_modules (list),
 *                              bias "none", task_type "CAUSAL_LM", base_model_name_or_path,
 *                              use_rslora, fan_in_fan_out (true for GPT-2's Conv1D), inference_mode
 *   adapter_model.safetensors  "base_model.model.<module>.lora_A.weight" (r, in) and
 *                              "base_model.model.<module>.lora_B.weight" (out, r), F32
 *                              (GPT-2 Conv1D modules too: PEFT builds A/B as nn.Linear(in, r) /
 *                              nn.Linear(r, out) and transposes only the merged delta).
 *                              With lm_head among the targets PEFT's save_pretrained also writes
 *                              "base_model.model.lm_head.base_layer.weight" (out, in), the base head
 *                              (save_embedding_layers="auto"); PEFT loads it into the base model.
 *                              Read here: it becomes the base of that module when merging. Written
 *                              only when the caller gives it (fitllm's trainer does not: its head is
 *                              frozen, so the base model's lm_head.weight is that weight).
 * Errors name the file and the key at fault.
 */
#ifndef FITLLM_PEFT_H
#define FITLLM_PEFT_H

#include "fitllm/lora.h"
#include "fitllm/model.h"
#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    fl_lora_config lora;          /* r, alpha, dropout, use_rslora, target_modules */
    char base_model[1024];        /* base_model_name_or_path ("" = null) */
    int fan_in_fan_out;
    int inference_mode;
    int seq2seq;       /* an encoder-decoder: task_type SEQ_2_SEQ_LM (else CAUSAL_LM) */
} fl_peft_config;

/* One adapted module, by its HF module path ("model.layers.0.self_attn.q_proj"). */
typedef struct {
    char name[FL_PARAM_NAME_MAX];
    int in, out;
    float *A;   /* (r, in)   loaded: malloc'd; for fl_peft_save: the caller's data */
    float *B;   /* (out, r) */
    float *W;   /* (out, in) "<module>.base_layer.weight" (PEFT saves it for lm_head), or NULL */
    int w_out, w_in; /* loaded: W's shape (checked to be (out, in)) */
    int r;          /* loaded: the module's rank (rank_pattern's, else the config's r); 0: the config's */
    float scaling;  /* loaded: its scaling (alpha_pattern's lora_alpha, else the config's, over r or sqrt(r)) */
} fl_peft_module;

typedef struct {
    fl_peft_config cfg;
    int n;
    fl_peft_module *mods;         /* in file order */
} fl_peft_adapter;

/* Write dir/adapter_config.json and dir/adapter_model.safetensors (dir is created if missing;
 * both files atomic). Validates r > 0, alpha > 0 and module sizes. */
fl_status fl_peft_save(const char *dir, const fl_peft_config *cfg, const fl_peft_module *mods, int n);

/* Read an adapter folder. Checks: peft_type LORA, r > 0, lora_alpha > 0, bias "none", every
 * tensor named base_model.model.<module>.lora_{A,B}.weight (or <module>.base_layer.weight),
 * 2-D F32/BF16/F16 (converted to f32), A (r, in) and B (out, r) with the module's r, each module
 * with both A and B, a base_layer weight (out, in). A module's r and lora_alpha are rank_pattern's and
 * alpha_pattern's when a key of theirs matches its name as PEFT's get_pattern_key does (the first key, in the
 * file's order, for which the regular expression "(.*\.)?(KEY)$" matches the whole name), else r and lora_alpha
 * (fl_peft_module.r, .scaling); a key that is no regular expression, or a value that is no positive integer
 * (rank_pattern) / number (alpha_pattern), is refused naming the key. */
fl_status fl_peft_load(const char *dir, fl_peft_adapter *a);
void fl_peft_free(fl_peft_adapter *a);

/* Module m's rank and scaling: its own (fl_peft_load's), else the config's (a module filled by hand). */
int fl_peft_module_r(const fl_peft_adapter *a, const fl_peft_module *m);
float fl_peft_module_scaling(const fl_peft_adapter *a, const fl_peft_module *m);

/* Check an adapter against a model: every module must be a 2-D weight "<module>.weight" of the
 * layout with shape (out, in); target_modules must be valid for the architecture. When
 * expect_base is non-NULL and the config names a base model, the two must be equal.
 * On success *param_index (malloc'd, a->n entries) gives each module's layout entry. */
fl_status fl_peft_check_model(const fl_peft_adapter *a, const fl_model_config *mc, const fl_param_layout *lay,
                              const char *expect_base, int **param_index);

/* Merge every module into the model's flat parameters: W += scaling * B @ A (its r and scaling; W = the module's
 * base_layer weight first when the adapter holds one, as PEFT loads it). */
fl_status fl_peft_merge_into(const fl_peft_adapter *a, const fl_param_layout *lay, float *params);

#ifdef __cplusplus
}
#endif
#endif

/* Model presets: real shapes of the models our users fine-tune, and small
 * shapes for CPU experiments. Values are those of the models' HF config.json. */
#include <stdio.h>
#include <string.h>

#include "fitllm/model.h"

typedef struct {
    const char *name;
    fl_model_config c;
} preset;

#define LLAMA(nm, V, C, F, L, NH, NKV, HD, MAXT, EPS, THETA, TIE)                                                    \
    {nm, {.arch = FL_ARCH_LLAMA, .name = nm, .vocab_size = V, .dim = C, .ffn_dim = F, .n_layers = L, .n_heads = NH, \
          .n_kv_heads = NKV, .head_dim = HD, .max_seq = MAXT, .norm_eps = EPS, .rope_theta = THETA,                 \
          .tie_embeddings = TIE}}
#define LLAMA3(nm, V, C, F, L, NH, NKV, HD, MAXT, TIE)                                                               \
    {nm, {.arch = FL_ARCH_LLAMA, .name = nm, .vocab_size = V, .dim = C, .ffn_dim = F, .n_layers = L, .n_heads = NH, \
          .n_kv_heads = NKV, .head_dim = HD, .max_seq = MAXT, .norm_eps = 1e-5f, .rope_theta = 500000.0f,            \
          .tie_embeddings = TIE,                                                                                      \
          .rope_scaling = {FL_ROPE_LLAMA3, 32.0f, 1.0f, 4.0f, 8192}}}
#define GPT2(nm, C, L, NH)                                                                                            \
    {nm, {.arch = FL_ARCH_GPT2, .name = nm, .vocab_size = 50257, .dim = C, .ffn_dim = 4 * C, .n_layers = L,          \
          .n_heads = NH, .n_kv_heads = NH, .head_dim = C / NH, .max_seq = 1024, .norm_eps = 1e-5f,                   \
          .tie_embeddings = 1, .attention_bias = 1, .mlp_bias = 1}}

static const preset k_presets[] = {
    /* CPU-sized LLaMA shapes (the benchmark's "tiny" and "small"). */
    LLAMA("micro", 512, 64, 172, 5, 8, 4, 8, 512, 1e-5f, 10000.0f, 1),
    LLAMA("tiny", 32000, 288, 768, 6, 6, 6, 48, 1024, 1e-5f, 10000.0f, 0),
    LLAMA("small", 32000, 768, 2048, 12, 12, 12, 64, 1024, 1e-5f, 10000.0f, 0),
    /* A GPT-2 shape small enough for tests (planner vs runtime, byte tokenizer). */
    {"gpt2-micro", {.arch = FL_ARCH_GPT2, .name = "gpt2-micro", .vocab_size = 512, .dim = 64, .ffn_dim = 256,
                    .n_layers = 2, .n_heads = 4, .n_kv_heads = 4, .head_dim = 16, .max_seq = 512, .norm_eps = 1e-5f,
                    .tie_embeddings = 1, .attention_bias = 1, .mlp_bias = 1}},
    /* The lab's models scaled for a CPU (`fitllm lab`, docs/ARCHITECTURE.md "Planner and lab"):
     * every width (C, F, heads x head_dim, vocabulary) / 16, depth and head structure kept,
     * so parameters scale by ~1/256 and one token's activations per parameter by 16. */
    LLAMA("lab-1b", 2000, 128, 352, 22, 8, 1, 16, 2048, 1e-5f, 10000.0f, 0),   /* tinyllama-1.1b / 16 */
    LLAMA("lab-3b", 2000, 200, 540, 26, 10, 10, 20, 2048, 1e-6f, 10000.0f, 0), /* open-llama-3b / 16 (HD even) */
    LLAMA("lab-7b", 2000, 256, 688, 32, 8, 8, 32, 2048, 1e-6f, 10000.0f, 0),   /* open-llama-7b / 16 */
    LLAMA("lab-13b", 2000, 320, 864, 40, 10, 10, 32, 2048, 1e-6f, 10000.0f, 0), /* open-llama-13b / 16 */
    LLAMA("tinyllama-1.1b", 32000, 2048, 5632, 22, 32, 4, 64, 2048, 1e-5f, 10000.0f, 0),
    LLAMA("open-llama-3b", 32000, 3200, 8640, 26, 32, 32, 100, 2048, 1e-6f, 10000.0f, 0),
    LLAMA("open-llama-7b", 32000, 4096, 11008, 32, 32, 32, 128, 2048, 1e-6f, 10000.0f, 0),
    LLAMA("open-llama-13b", 32000, 5120, 13824, 40, 40, 40, 128, 2048, 1e-6f, 10000.0f, 0),
    LLAMA("llama-2-7b", 32000, 4096, 11008, 32, 32, 32, 128, 4096, 1e-5f, 10000.0f, 0),
    LLAMA("llama-2-13b", 32000, 5120, 13824, 40, 40, 40, 128, 4096, 1e-5f, 10000.0f, 0),
    LLAMA3("llama-3.2-1b", 128256, 2048, 8192, 16, 32, 8, 64, 131072, 1),
    LLAMA3("llama-3.2-3b", 128256, 3072, 8192, 28, 24, 8, 128, 131072, 1),
    LLAMA("llama-3-8b", 128256, 4096, 14336, 32, 32, 8, 128, 8192, 1e-5f, 500000.0f, 0),
    GPT2("gpt2", 768, 12, 12),
    GPT2("gpt2-medium", 1024, 24, 16),
    GPT2("gpt2-large", 1280, 36, 20),
    GPT2("gpt2-xl", 1600, 48, 25),
};

static const char *k_names[sizeof k_presets / sizeof k_presets[0] + 1];

const char *const *fl_preset_names(void) {
    size_t n = sizeof k_presets / sizeof k_presets[0];
    for (size_t i = 0; i < n; i++) k_names[i] = k_presets[i].name;
    k_names[n] = NULL;
    return k_names;
}

fl_status fl_preset_find(const char *name, fl_model_config *cfg) {
    size_t n = sizeof k_presets / sizeof k_presets[0];
    for (size_t i = 0; i < n; i++)
        if (strcmp(k_presets[i].name, name) == 0) {
            *cfg = k_presets[i].c;
            return fl_config_validate(cfg);
        }
    char list[1024];
    size_t off = 0;
    for (size_t i = 0; i < n && off < sizeof list; i++)
        off += (size_t)snprintf(list + off, sizeof list - off, "%s%s", i ? ", " : "", k_presets[i].name);
    return fl_errorf(FL_ERR_NOT_FOUND, "unknown model preset '%s' (known: %s)", name, list);
}

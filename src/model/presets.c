/* Model presets: real shapes of the models our users fine-tune, and small
 * shapes for CPU experiments. Values are those of the models' HF config.json. */
#include <stdio.h>
#include <ctype.h>
#include <string.h>
#include <strings.h>

#include "fitllm/model.h"

typedef struct {
    const char *name;
    fl_model_config c;
} preset;

/* HEAD: fl_model_config.logits_chunk_rows (0: the default chunk; the lab's presets: LAB_HEAD) */
#define LLAMA_H(nm, V, C, F, L, NH, NKV, HD, MAXT, EPS, THETA, TIE, HEAD)                                            \
    {nm, {.arch = FL_ARCH_LLAMA, .name = nm, .vocab_size = V, .dim = C, .ffn_dim = F, .n_layers = L, .n_heads = NH, \
          .n_kv_heads = NKV, .head_dim = HD, .max_seq = MAXT, .norm_eps = EPS, .rope_theta = THETA,                 \
          .tie_embeddings = TIE, .logits_chunk_rows = HEAD}}
#define LLAMA(nm, V, C, F, L, NH, NKV, HD, MAXT, EPS, THETA, TIE)                                                    \
    LLAMA_H(nm, V, C, F, L, NH, NKV, HD, MAXT, EPS, THETA, TIE, 0)
#define LLAMA3(nm, V, C, F, L, NH, NKV, HD, MAXT, TIE)                                                               \
    {nm, {.arch = FL_ARCH_LLAMA, .name = nm, .vocab_size = V, .dim = C, .ffn_dim = F, .n_layers = L, .n_heads = NH, \
          .n_kv_heads = NKV, .head_dim = HD, .max_seq = MAXT, .norm_eps = 1e-5f, .rope_theta = 500000.0f,            \
          .tie_embeddings = TIE,                                                                                      \
          .rope_scaling = {FL_ROPE_LLAMA3, 32.0f, 1.0f, 4.0f, 8192}}}
#define GPT2(nm, C, L, NH)                                                                                            \
    {nm, {.arch = FL_ARCH_GPT2, .name = nm, .vocab_size = 50257, .dim = C, .ffn_dim = 4 * C, .n_layers = L,          \
          .n_heads = NH, .n_kv_heads = NH, .head_dim = C / NH, .max_seq = 1024, .norm_eps = 1e-5f,                   \
          .tie_embeddings = 1, .attention_bias = 1, .mlp_bias = 1}}

/* The lab's scaled presets (lab-*): the LM head's logits chunk is the real model's (vocabulary VR) rows / 16, as
 * the tokens (fl_model_config.logits_chunk_rows), so its bytes are the real chunk's / 256 as the parameters' */
#define LAB_HEAD(VR) ((int)(FL_LOGITS_CHUNK_BYTES / ((VR) * 4L) / 16))
#define LAB_LLAMA(nm, V, C, F, L, NH, NKV, HD, MAXT, EPS, THETA, TIE)                                                \
    LLAMA_H(nm, V, C, F, L, NH, NKV, HD, MAXT, EPS, THETA, TIE, LAB_HEAD(32000))

/* T5: vocabulary 32128, d_kv 64, 32 buckets up to distance 128, eps 1e-6, pad 0 = decoder start, eos 1 */
#define T5(nm, C, F, L, NH, GATED)                                                                                    \
    {nm, {.arch = FL_ARCH_T5, .name = nm, .vocab_size = 32128, .dim = C, .ffn_dim = F, .n_layers = L,                 \
          .n_dec_layers = L, .n_heads = NH, .n_kv_heads = NH, .head_dim = 64, .max_seq = 512, .norm_eps = 1e-6f,    \
          .tie_embeddings = !(GATED), .head_scale = !(GATED), .ffn_gated = GATED, .rel_buckets = 32,                 \
          .rel_max_dist = 128, .dec_start_id = 0, .pad_id = 0, .eos_id = 1, .dropout_rate = 0.1f}}

#define OPT(nm, C, F, L, NH)                                                                                          \
    {nm, {.arch = FL_ARCH_OPT, .name = nm, .vocab_size = 50272, .dim = C, .ffn_dim = F, .n_layers = L, .n_heads = NH,  \
          .n_kv_heads = NH, .head_dim = C / NH, .max_seq = 2048, .norm_eps = 1e-5f, .tie_embeddings = 1,               \
          .attention_bias = 1, .mlp_bias = 1}}

static const preset k_presets[] = {
    /* CPU-sized LLaMA shapes (the benchmark's "tiny" and "small"). */
    LLAMA("micro", 512, 64, 172, 5, 8, 4, 8, 512, 1e-5f, 10000.0f, 1),
    LLAMA("tiny", 32000, 288, 768, 6, 6, 6, 48, 1024, 1e-5f, 10000.0f, 0),
    LLAMA("small", 32000, 768, 2048, 12, 12, 12, 64, 1024, 1e-5f, 10000.0f, 0),
    /* A GPT-2 shape small enough for tests (planner vs runtime, byte tokenizer). */
    {"gpt2-micro", {.arch = FL_ARCH_GPT2, .name = "gpt2-micro", .vocab_size = 512, .dim = 64, .ffn_dim = 256,
                    .n_layers = 2, .n_heads = 4, .n_kv_heads = 4, .head_dim = 16, .max_seq = 512, .norm_eps = 1e-5f,
                    .tie_embeddings = 1, .attention_bias = 1, .mlp_bias = 1}},
    /* An OPT shape small enough for tests (byte tokenizer). */
    {"opt-micro", {.arch = FL_ARCH_OPT, .name = "opt-micro", .vocab_size = 512, .dim = 64, .ffn_dim = 256,
                   .n_layers = 2, .n_heads = 4, .n_kv_heads = 4, .head_dim = 16, .max_seq = 512, .norm_eps = 1e-5f,
                   .tie_embeddings = 1, .attention_bias = 1, .mlp_bias = 1}},
    /* The lab's models scaled for a CPU (`fitllm lab`, docs/ARCHITECTURE.md "Planner and lab"):
     * every width (C, F, heads x head_dim, vocabulary) / 16, depth and head structure kept,
     * so parameters scale by ~1/256 and one token's activations per parameter by 16. */
    LAB_LLAMA("lab-1b", 2000, 128, 352, 22, 8, 1, 16, 2048, 1e-5f, 10000.0f, 0),   /* tinyllama-1.1b / 16 */
    LAB_LLAMA("lab-3b", 2000, 200, 540, 26, 10, 10, 20, 2048, 1e-6f, 10000.0f, 0), /* open-llama-3b / 16 (HD even) */
    LAB_LLAMA("lab-7b", 2000, 256, 688, 32, 8, 8, 32, 2048, 1e-6f, 10000.0f, 0),   /* open-llama-7b / 16 */
    LAB_LLAMA("lab-13b", 2000, 320, 864, 40, 10, 10, 32, 2048, 1e-6f, 10000.0f, 0), /* open-llama-13b / 16 */
    /* gpt2-xl / 16 (`fitllm lab --suite fsdp`): 25 heads x 64 -> 5 x 20 (25 does not divide by 4 as the
     * LLaMA presets' heads do), vocabulary 50257 / 16 */
    {"lab-gpt2-xl", {.arch = FL_ARCH_GPT2, .name = "lab-gpt2-xl", .vocab_size = 3141, .dim = 100, .ffn_dim = 400,
                     .n_layers = 48, .n_heads = 5, .n_kv_heads = 5, .head_dim = 20, .max_seq = 1024, .norm_eps = 1e-5f,
                     .tie_embeddings = 1, .attention_bias = 1, .mlp_bias = 1, .logits_chunk_rows = LAB_HEAD(50257)}},
    /* gpt2-xxl / 16 (`fitllm lab --suite fsdp --model gpt2-xxl`): 32 heads x 80 -> 8 x 20 */
    {"lab-gpt2-xxl", {.arch = FL_ARCH_GPT2, .name = "lab-gpt2-xxl", .vocab_size = 3141, .dim = 160, .ffn_dim = 640,
                      .n_layers = 32, .n_heads = 8, .n_kv_heads = 8, .head_dim = 20, .max_seq = 1024, .norm_eps = 1e-5f,
                      .tie_embeddings = 1, .attention_bias = 1, .mlp_bias = 1, .logits_chunk_rows = LAB_HEAD(50257)}},
    LLAMA("tinyllama-1.1b", 32000, 2048, 5632, 22, 32, 4, 64, 2048, 1e-5f, 10000.0f, 0),
    LLAMA("open-llama-3b", 32000, 3200, 8640, 26, 32, 32, 100, 2048, 1e-6f, 10000.0f, 0),
    LLAMA("open-llama-7b", 32000, 4096, 11008, 32, 32, 32, 128, 2048, 1e-6f, 10000.0f, 0),
    LLAMA("open-llama-13b", 32000, 5120, 13824, 40, 40, 40, 128, 2048, 1e-6f, 10000.0f, 0),
    LLAMA("llama-2-7b", 32000, 4096, 11008, 32, 32, 32, 128, 4096, 1e-5f, 10000.0f, 0),
    LLAMA("llama-2-13b", 32000, 5120, 13824, 40, 40, 40, 128, 4096, 1e-5f, 10000.0f, 0),
    LLAMA3("llama-3.2-1b", 128256, 2048, 8192, 16, 32, 8, 64, 131072, 1),
    LLAMA3("llama-3.2-3b", 128256, 3072, 8192, 28, 24, 8, 128, 131072, 1),
    LLAMA("llama-3-8b", 128256, 4096, 14336, 32, 32, 8, 128, 8192, 1e-5f, 500000.0f, 0),
    /* LitGPT's micro-llama-300M (keeeeenw/MicroLlama; the microllama pretrain recipe) */
    LLAMA("micro-llama-300M", 32000, 1024, 5632, 12, 16, 4, 64, 2048, 1e-5f, 10000.0f, 0),
    GPT2("gpt2", 768, 12, 12),
    GPT2("gpt2-medium", 1024, 24, 16),
    GPT2("gpt2-large", 1280, 36, 20),
    GPT2("gpt2-xl", 1600, 48, 25),
    /* the course's FSDP benchmark's "gpt2-xxl" (~3 B): its shape is not in the course's table; GPT-3 2.7B's
     * (32 layers, width 2560, 32 heads) with GPT-2's vocabulary and context: 2.65 B parameters */
    GPT2("gpt2-xxl", 2560, 32, 32),
    /* OPT (pre-norm sizes; OPT-350m's post-norm blocks and embedding projection are not supported);
     * opt-2.7b is BLIP-2's language model */
    /* T5 v1.0 (ReLU, tied head) and Flan-T5 (gated-GELU, lm_head); t5-micro a Flan-T5 shape for CPU tests */
    {"t5-micro", {.arch = FL_ARCH_T5, .name = "t5-micro", .vocab_size = 512, .dim = 64, .ffn_dim = 96, .n_layers = 2,
                  .n_dec_layers = 2, .n_heads = 4, .n_kv_heads = 4, .head_dim = 16, .max_seq = 512, .norm_eps = 1e-6f,
                  .ffn_gated = 1, .rel_buckets = 32, .rel_max_dist = 128, .dec_start_id = 0, .pad_id = 0, .eos_id = 1,
                  .dropout_rate = 0.1f}},
    T5("t5-small", 512, 2048, 6, 8, 0),
    T5("flan-t5-small", 512, 1024, 8, 6, 1),
    T5("flan-t5-base", 768, 2048, 12, 12, 1),
    T5("flan-t5-large", 1024, 2816, 24, 16, 1),
    T5("flan-t5-xl", 2048, 5120, 24, 32, 1),
    T5("flan-t5-xxl", 4096, 10240, 24, 64, 1),
    OPT("opt-125m", 768, 3072, 12, 12),
    OPT("opt-1.3b", 2048, 8192, 24, 32),
    OPT("opt-2.7b", 2560, 10240, 32, 32),
    OPT("opt-6.7b", 4096, 16384, 32, 32),
};

/* LitGPT's names (litgpt/config.py) and Hugging Face repo ids of the presets, so
 * that recipes and command lines written for LitGPT name the same model here.
 * Matching ignores case; "org/name" and "name" both match. */
static const struct { const char *alias, *preset; } k_aliases[] = {
    {"google-t5/t5-small", "t5-small"},
    {"google/flan-t5-small", "flan-t5-small"},
    {"google/flan-t5-base", "flan-t5-base"},
    {"google/flan-t5-large", "flan-t5-large"},
    {"google/flan-t5-xl", "flan-t5-xl"},
    {"google/flan-t5-xxl", "flan-t5-xxl"},
    {"facebook/opt-125m", "opt-125m"},
    {"facebook/opt-1.3b", "opt-1.3b"},
    {"facebook/opt-2.7b", "opt-2.7b"},
    {"facebook/opt-6.7b", "opt-6.7b"},
    {"tiny-llama-1.1b", "tinyllama-1.1b"},
    {"TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T", "tinyllama-1.1b"},
    {"tiny-llama-1.1b-chat", "tinyllama-1.1b"},
    {"TinyLlama/TinyLlama-1.1B-Chat-v1.0", "tinyllama-1.1b"},
    {"open_llama_3b", "open-llama-3b"},
    {"openlm-research/open_llama_3b", "open-llama-3b"},
    {"open_llama_7b", "open-llama-7b"},
    {"openlm-research/open_llama_7b", "open-llama-7b"},
    {"open_llama_13b", "open-llama-13b"},
    {"openlm-research/open_llama_13b", "open-llama-13b"},
    {"meta-llama/Llama-2-7b-hf", "llama-2-7b"},
    {"meta-llama/Llama-2-7b-chat-hf", "llama-2-7b"},
    {"meta-llama/Llama-2-13b-hf", "llama-2-13b"},
    {"meta-llama/Llama-2-13b-chat-hf", "llama-2-13b"},
    {"meta-llama/Meta-Llama-3-8B", "llama-3-8b"},
    {"meta-llama/Meta-Llama-3-8B-Instruct", "llama-3-8b"},
    {"Llama-3-8B", "llama-3-8b"},
    {"Llama-3-8B-Instruct", "llama-3-8b"},
    {"meta-llama/Llama-3.2-1B", "llama-3.2-1b"},
    {"meta-llama/Llama-3.2-1B-Instruct", "llama-3.2-1b"},
    {"meta-llama/Llama-3.2-3B", "llama-3.2-3b"},
    {"meta-llama/Llama-3.2-3B-Instruct", "llama-3.2-3b"},
    {"keeeeenw/MicroLlama", "micro-llama-300M"},
    {"openai-community/gpt2", "gpt2"},
    {"openai-community/gpt2-medium", "gpt2-medium"},
    {"openai-community/gpt2-large", "gpt2-large"},
    {"openai-community/gpt2-xl", "gpt2-xl"},
};

/* LitGPT families this build cannot construct, and why (for the error). */
static const struct { const char *prefix, *why; } k_unbuilt[] = {
    {"pythia", "GPT-NeoX: parallel residual and partial rotary embeddings"},
    {"EleutherAI/pythia", "GPT-NeoX: parallel residual and partial rotary embeddings"},
    {"stablelm", "GPT-NeoX: parallel residual and partial rotary embeddings"},
    {"falcon", "Falcon: parallel attention and multi-query layout"},
    {"gemma", "Gemma: scaled embeddings, GeGLU and soft-capping"},
    {"google/gemma", "Gemma: scaled embeddings, GeGLU and soft-capping"},
    {"phi", "Phi: parallel residual and partial rotary embeddings"},
    {"microsoft/phi", "Phi: parallel residual and partial rotary embeddings"},
    {"mistral", "Mistral: sliding-window attention"},
    {"mistralai/", "Mistral: sliding-window attention"},
};

static const char *k_names[sizeof k_presets / sizeof k_presets[0] + 1];

const char *const *fl_preset_names(void) {
    size_t n = sizeof k_presets / sizeof k_presets[0];
    for (size_t i = 0; i < n; i++) k_names[i] = k_presets[i].name;
    k_names[n] = NULL;
    return k_names;
}

const char *fl_preset_repo_at(size_t i, const char **preset) {
    size_t na = sizeof k_aliases / sizeof k_aliases[0];
    for (size_t k = 0; k < na; k++) {
        if (!strchr(k_aliases[k].alias, '/')) continue;
        if (i-- == 0) {
            if (preset) *preset = k_aliases[k].preset;
            return k_aliases[k].alias;
        }
    }
    return NULL;
}

const char *fl_preset_repo_id(const char *name) {
    fl_model_config c;
    if (fl_preset_find(name, &c) != FL_OK) return NULL;
    const char *p;
    for (size_t i = 0; fl_preset_repo_at(i, &p); i++)
        if (!strcmp(p, c.name)) return fl_preset_repo_at(i, NULL);
    return NULL;
}

/* "org/name" matches "name" too (LitGPT's Config.from_name does the same). */
static int name_is(const char *name, const char *known) {
    if (!strcasecmp(name, known)) return 1;
    const char *slash = strchr(known, '/');
    if (slash && !strchr(name, '/') && !strcasecmp(name, slash + 1)) return 1;
    slash = strchr(name, '/');
    return slash && !strchr(known, '/') && !strcasecmp(slash + 1, known);
}


static int contains_nocase(const char *hay, const char *needle) {
    size_t n = strlen(needle);
    for (; *hay; hay++)
        if (!strncasecmp(hay, needle, n)) return 1;
    return n == 0;
}

fl_status fl_preset_find(const char *name, fl_model_config *cfg) {
    size_t n = sizeof k_presets / sizeof k_presets[0], na = sizeof k_aliases / sizeof k_aliases[0];
    const char *target = name;
    for (size_t i = 0; i < na; i++)
        if (name_is(name, k_aliases[i].alias)) { target = k_aliases[i].preset; break; }
    for (size_t i = 0; i < n; i++)
        if (name_is(target, k_presets[i].name)) {
            *cfg = k_presets[i].c;
            return fl_config_validate(cfg);
        }
    /* near matches: the three closest names (presets and aliases), by edit distance
     * on the part after any "org/" */
    const char *best[3] = {NULL, NULL, NULL};
    size_t bd[3] = {(size_t)-1, (size_t)-1, (size_t)-1};
    const char *q = strrchr(name, '/') ? strrchr(name, '/') + 1 : name;
    for (size_t i = 0; i < n + na; i++) {
        const char *cand = i < n ? k_presets[i].name : k_aliases[i - n].alias;
        if (strchr(cand, '/')) continue; /* a repo id means the downloaded weights (fitllm download) */
        const char *cs = strrchr(cand, '/') ? strrchr(cand, '/') + 1 : cand;
        size_t d = fl_edit_distance(q, cs);
        if (contains_nocase(cs, q) || contains_nocase(q, cs)) d = d / 2; /* "llama-2" ~ "llama-2-7b" */
        for (int k = 0; k < 3; k++)
            if (d < bd[k]) {
                for (int m = 2; m > k; m--) best[m] = best[m - 1], bd[m] = bd[m - 1];
                best[k] = cand, bd[k] = d;
                break;
            }
    }
    char why[160] = "";
    for (size_t i = 0; i < sizeof k_unbuilt / sizeof k_unbuilt[0]; i++)
        if (!strncasecmp(name, k_unbuilt[i].prefix, strlen(k_unbuilt[i].prefix))) {
            snprintf(why, sizeof why, "; it is a LitGPT model of an architecture fitllm does not build (%s)",
                     k_unbuilt[i].why);
            break;
        }
    char list[1024];
    size_t off = 0;
    for (size_t i = 0; i < n && off < sizeof list; i++)
        off += (size_t)snprintf(list + off, sizeof list - off, "%s%s", i ? ", " : "", k_presets[i].name);
    if (why[0]) /* a near name would be a different model, not a typo */
        return fl_errorf(FL_ERR_NOT_FOUND, "unknown model preset '%s'%s; presets: %s", name, why, list);
    return fl_errorf(FL_ERR_NOT_FOUND, "unknown model preset '%s' (nearest: %s, %s, %s; presets (a model's shape, "
                     "randomly initialized): %s; LitGPT names of these are accepted too; for a model's weights give "
                     "its Hugging Face repo id, `fitllm download ORG/NAME` fetches it)", name, best[0], best[1],
                     best[2], list);
}

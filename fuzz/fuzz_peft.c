/* libFuzzer harness: PEFT LoRA adapter folders. The input is cut at FZ_SEP
 * into adapter_config.json and adapter_model.safetensors (empty parts are not
 * written) and read with fl_peft_load. An accepted adapter is checked against
 * a tiny LLaMA or GPT-2 (by the input size's low bit) with
 * fl_peft_check_model; when it fits, it is merged into a zeroed parameter
 * buffer of that model. It is also written back with fl_peft_save and read
 * again: what we write must load, with the same modules and shapes (abort
 * otherwise). Build: fuzz/build.sh */
#include "fuzz_util.h"

#include "fitllm/model.h"
#include "fitllm/peft.h"

static void tiny_model(fl_model_config *c, int gpt2) {
    memset(c, 0, sizeof *c);
    c->arch = gpt2 ? FL_ARCH_GPT2 : FL_ARCH_LLAMA;
    c->vocab_size = 32;
    c->dim = 16;
    c->n_layers = 2;
    c->n_heads = 2;
    c->n_kv_heads = gpt2 ? 2 : 1;
    c->head_dim = 8;
    c->ffn_dim = gpt2 ? 64 : 24;
    c->max_seq = 16;
    c->norm_eps = 1e-5f;
    c->rope_theta = gpt2 ? 0.0f : 10000.0f;
    c->tie_embeddings = gpt2;
    c->attention_bias = c->mlp_bias = gpt2;
    if (fl_config_validate(c) != FL_OK) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static const char *names[] = {"adapter_config.json", "adapter_model.safetensors"};
    static fl_model_config mc[2];
    static fl_param_layout lay[2];
    static float *params[2];
    if (!params[0])
        for (int g = 0; g < 2; g++) {
            tiny_model(&mc[g], g);
            if (fl_layout_build(&lay[g], &mc[g]) != FL_OK) abort();
            params[g] = malloc(lay[g].numel * sizeof(float));
            if (!params[g]) abort();
        }
    const char *dir = fz_fresh_dir("adapter");
    const uint8_t *p = data, *part;
    size_t n;
    char path[600];
    for (int k = 0; k < 2 && fz_next_part(&p, data + size, &part, &n); k++) {
        if (!n) continue;
        snprintf(path, sizeof path, "%s/%s", dir, names[k]);
        fz_write(path, part, n);
    }
    fl_peft_adapter a, b;
    if (fz_dbg(fl_peft_load(dir, &a)) != FL_OK) return 0;
    if (a.n <= 0 || a.cfg.lora.r <= 0) abort();
    int g = (int)(size & 1);
    int *idx = NULL;
    if (fl_peft_check_model(&a, &mc[g], &lay[g], size & 2 ? "base" : NULL, &idx) == FL_OK) {
        for (int k = 0; k < a.n; k++)
            if (idx[k] < 0 || idx[k] >= lay[g].n) abort();
        memset(params[g], 0, lay[g].numel * sizeof(float));
        if (fl_peft_merge_into(&a, &lay[g], params[g]) != FL_OK) abort();
        free(idx);
    }
    const char *dir2 = fz_fresh_dir("saved");
    if (fl_peft_save(dir2, &a.cfg, a.mods, a.n) != FL_OK) abort();
    if (fl_peft_load(dir2, &b) != FL_OK) abort();
    if (b.n != a.n || b.cfg.lora.r != a.cfg.lora.r) abort();
    for (int k = 0; k < a.n; k++)
        if (strcmp(a.mods[k].name, b.mods[k].name) || a.mods[k].in != b.mods[k].in || a.mods[k].out != b.mods[k].out ||
            !a.mods[k].W != !b.mods[k].W)
            abort();
    fl_peft_free(&b);
    fl_peft_free(&a);
    return 0;
}

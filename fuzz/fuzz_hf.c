/* libFuzzer harness for Hugging Face model folders.
 *
 * Default (fuzz_hf_config): arbitrary bytes as config.json, read with
 * fl_hf_load_config; an accepted config gets its parameter layout built (the
 * bookkeeping only, never the weights) and is written back with
 * fl_hf_save_config and read again: what we write must load, with the same
 * sizes (abort otherwise).
 *
 * -DFL_FUZZ_FOLDER (fuzz_hf_folder): the input is cut at FZ_SEP into
 * config.json, model.safetensors, model.safetensors.index.json and two shards
 * (model-00001-of-00002.safetensors, model-00002-of-00002.safetensors); empty
 * parts are not written. The folder is loaded with fl_hf_load_model (fp32, CPU
 * backend): a tiny input must never make it allocate more than its files can
 * fill. Build: fuzz/build.sh */
/* binaries built from this file (fuzz/harnesses.cmake reads these lines: name, then defines): */
// fuzz-build: fuzz_hf_config
// fuzz-build: fuzz_hf_folder FL_FUZZ_FOLDER
#include "fuzz_util.h"

#include "fitllm/backend.h"
#include "fitllm/io.h"
#include "fitllm/mem.h"
#include "fitllm/model.h"

#ifndef FL_FUZZ_FOLDER
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static char path[512], back[512];
    if (!path[0]) {
        snprintf(path, sizeof path, "%s/config.json", fz_tmpdir());
        snprintf(back, sizeof back, "%s/saved.json", fz_tmpdir());
    }
    fz_write(path, data, size);
    fl_model_config c, c2;
    if (fz_dbg(fl_hf_load_config(path, &c)) != FL_OK) return 0;
    fl_param_layout lay;
    if (fl_layout_build(&lay, &c) == FL_OK) {
        if (lay.n <= 0 || fl_sizing_param_count(&c) != lay.numel) abort();
        fl_layout_free(&lay);
    }
    if (fl_hf_save_config(back, &c) != FL_OK) abort();
    if (fl_hf_load_config(back, &c2) != FL_OK) abort();
    if (c.arch != c2.arch || c.vocab_size != c2.vocab_size || c.dim != c2.dim || c.n_layers != c2.n_layers ||
        c.n_heads != c2.n_heads || c.n_kv_heads != c2.n_kv_heads || c.head_dim != c2.head_dim ||
        c.ffn_dim != c2.ffn_dim || c.max_seq != c2.max_seq || c.tie_embeddings != c2.tie_embeddings)
        abort();
    return 0;
}
#else
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static const char *names[] = {"config.json", "model.safetensors", "model.safetensors.index.json",
                                  "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
    static fl_backend be;
    static int be_ok;
    if (!be_ok) {
        if (fl_cpu_backend_init(&be, 1) != FL_OK) abort();
        be_ok = 1;
    }
    const char *dir = fz_fresh_dir("model");
    const uint8_t *p = data, *part;
    size_t n;
    char path[600];
    for (int k = 0; k < 5 && fz_next_part(&p, data + size, &part, &n); k++) {
        if (!n) continue;
        snprintf(path, sizeof path, "%s/%s", dir, names[k]);
        fz_write(path, part, n);
    }
    fl_mem_pool pool;
    if (fl_mem_pool_init(&pool, "fuzz", 0) != FL_OK) abort();
    fl_model m;
    memset(&m, 0, sizeof m);
    if (fz_dbg(fl_hf_load_model(&m, dir, &be, &pool)) == FL_OK) fl_model_free(&m);
    fl_mem_pool_free(&pool);
    return 0;
}
#endif

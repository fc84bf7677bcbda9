/* libFuzzer harness: tokenizer files read through the public fl_tok_load.
 *
 *   -DFL_FUZZ_SPM      (fuzz_tokenizer_model)   the bytes are a SentencePiece tokenizer.model (protobuf)
 *   -DFL_FUZZ_LLAMA2C  (fuzz_tokenizer_llama2c) the bytes are a llama2.c tokenizer (tok512.bin)
 *   -DFL_FUZZ_DIR      (fuzz_tokenizer_dir)     the bytes are cut at FZ_SEP into a model folder:
 *                      tokenizer.json, config.json, special_tokens_map.json, tokenizer_config.json
 *                      (BOS/EOS side files; empty parts are not written)
 *
 * An accepted tokenizer encodes a few strings (ASCII, whitespace runs, invalid
 * UTF-8, special-token text, U+2581, an emoji, empty) with its default and
 * with forced BOS/EOS; every id must be in [0, vocab) and BOS/EOS ids in range
 * or -1 (abort otherwise); the ids are decoded with and without skip_special,
 * and out-of-range ids are decoded too. Build: fuzz/build.sh */
/* binaries built from this file (fuzz/harnesses.cmake reads these lines: name, then defines): */
// fuzz-build: fuzz_tokenizer_model FL_FUZZ_SPM
// fuzz-build: fuzz_tokenizer_llama2c FL_FUZZ_LLAMA2C
// fuzz-build: fuzz_tokenizer_dir FL_FUZZ_DIR
#include "fuzz_util.h"

#include "fitllm/tokenizer.h"

static void fz_exercise(const fl_tokenizer *t) {
    static const char *texts[] = {"Hello world", " ", "  a\n\tb", "\xff\xfe ok", "<s>x</s><unk>",
                                  "\xe2\x96\x81 \xf0\x9f\x98\x80", "", "<0x41>"};
    const int V = fl_tok_vocab_size(t);
    if (V <= 0) abort();
    int bos = fl_tok_bos_id(t), eos = fl_tok_eos_id(t);
    if (bos < -1 || bos >= V || eos < -1 || eos >= V) abort();
    for (size_t k = 0; k < sizeof texts / sizeof texts[0]; k++) {
        int32_t *ids = NULL;
        size_t n = 0;
        int force = (int)(k % 3) - 1; /* -1 default, 0 none, 1 both */
        if (fl_tok_encode(t, texts[k], strlen(texts[k]), force, force, &ids, &n) != FL_OK) continue;
        for (size_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= V) abort();
        char *txt = NULL;
        size_t tl;
        if (fl_tok_decode(t, ids, n, (int)(k & 1), &txt, &tl) == FL_OK) {
            if (strlen(txt) > tl) abort(); /* NUL-terminated at len (embedded NULs allowed) */
            free(txt);
        }
        free(ids);
    }
    int32_t junk[5] = {0, V - 1, -5, V, 1 << 30};
    char *txt = NULL;
    size_t tl;
    if (fl_tok_decode(t, junk, 5, 0, &txt, &tl) == FL_OK) free(txt);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char path[600];
#if defined(FL_FUZZ_DIR)
    static const char *names[] = {"tokenizer.json", "config.json", "special_tokens_map.json", "tokenizer_config.json"};
    const char *dir = fz_fresh_dir("tok");
    const uint8_t *p = data, *part;
    size_t n;
    for (int k = 0; k < 4 && fz_next_part(&p, data + size, &part, &n); k++) {
        if (!n) continue;
        snprintf(path, sizeof path, "%s/%s", dir, names[k]);
        fz_write(path, part, n);
    }
    snprintf(path, sizeof path, "%s", dir);
#else
#if defined(FL_FUZZ_SPM)
    snprintf(path, sizeof path, "%s/tokenizer.model", fz_tmpdir());
#elif defined(FL_FUZZ_LLAMA2C)
    snprintf(path, sizeof path, "%s/tok512.bin", fz_tmpdir());
#else
#error "build with -DFL_FUZZ_SPM, -DFL_FUZZ_LLAMA2C or -DFL_FUZZ_DIR"
#endif
    fz_write(path, data, size);
#endif
    fl_tokenizer *t = NULL;
    if (fz_dbg(fl_tok_load(&t, path)) != FL_OK) return 0;
    fz_exercise(t);
    fl_tok_free(t);
    return 0;
}

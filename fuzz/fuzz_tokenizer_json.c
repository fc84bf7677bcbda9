/* libFuzzer harness: arbitrary bytes as tokenizer.json content. When the
 * loader accepts them, encode and decode a few strings (including invalid
 * UTF-8) and check the decode of the encode does not crash. Build: fuzz/build.sh */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "fitllm/tokenizer.h"
#include "tokenizer/tok-impl.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static const char *texts[] = {"Hello world", " ", "  a\n\tb", "\xff\xfe ok", "<s>x</s>", "\xe2\x96\x81 \xf0\x9f\x98\x80", ""};
    fl_tokenizer *t = NULL;
    if (fl_tok_load_hf_json_mem(&t, (const char *)data, size, "fuzz.json") != FL_OK) return 0;
    for (size_t k = 0; k < sizeof texts / sizeof texts[0]; k++) {
        int32_t *ids = NULL;
        size_t n = 0;
        const char *s = texts[k];
        size_t len = 0;
        while (s[len]) len++;
        if (fl_tok_encode(t, s, len, -1, -1, &ids, &n) == FL_OK) {
            for (size_t i = 0; i < n; i++)
                if (ids[i] < 0 || ids[i] >= fl_tok_vocab_size(t)) abort(); /* ids must be in range */
            char *txt = NULL;
            size_t tl;
            if (fl_tok_decode(t, ids, n, k & 1, &txt, &tl) == FL_OK) free(txt);
            free(ids);
        }
    }
    /* decode arbitrary ids (including out of range) */
    int32_t junk[4] = {0, 1, -5, 1 << 30};
    char *txt = NULL;
    size_t tl;
    if (fl_tok_decode(t, junk, 4, 0, &txt, &tl) == FL_OK) free(txt);
    fl_tok_free(t);
    return 0;
}

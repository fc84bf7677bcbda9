/* libFuzzer harness: arbitrary bytes as an instruction dataset file, parsed as
 * .json (default) or .jsonl (built with -DFL_FUZZ_JSONL), then split with
 * torch's random_split and tokenized into SFT samples with the built-in byte
 * tokenizer, then batched; the same bytes also as seq2seq pairs (fl_s2s_*). Any crash, leak or sanitizer report is a bug: bad
 * input must come back as an fl_status. Build: fuzz/build.sh. */
/* binaries built from this file (fuzz/harnesses.cmake reads these lines: name, then defines): */
// fuzz-build: fuzz_json_dataset_json
// fuzz-build: fuzz_json_dataset_jsonl FL_FUZZ_JSONL
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "data/data-impl.h"
#include "fitllm/data.h"
#include "fitllm/tokenizer.h"

#ifdef FL_FUZZ_JSONL
#define SOURCE "fuzz.jsonl"
#else
#define SOURCE "fuzz.json"
#endif

static fl_tokenizer *g_tok;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!g_tok && fl_tok_builtin_bytes(&g_tok) != FL_OK) abort();
    fl_data_records rs = {0};
    fl_status s = fl_data_read_records((const char *)data, size, SOURCE, &rs);
    if (s == FL_OK && rs.n > 0) {
        fl_data_config c;
        fl_data_config_default(&c, FL_DATA_JSON);
        c.mask_prompt = (int)(size & 1);
        c.max_seq_length = (size & 2) ? 64 : -1;
        c.val_split_fraction = 0.25f;
        fl_dataset *d = NULL;
        size_t *perm = NULL, nt, nv;
        fl_data_split_lengths(rs.n, c.val_split_fraction, &nt, &nv);
        if (fl_data_new(&d) == FL_OK && fl_data_torch_randperm(c.seed, rs.n, &perm) == FL_OK) {
            d->ignore_index = c.ignore_index;
            s = fl_data_sft_tokenize(&rs, perm, nt, &c, g_tok, &d->split[FL_SPLIT_TRAIN], &d->stats, SOURCE);
            if (s == FL_OK)
                s = fl_data_sft_tokenize(&rs, perm + nt, nv, &c, g_tok, &d->split[FL_SPLIT_VAL], &d->stats, SOURCE);
            for (int sp = 0; s == FL_OK && sp < FL_SPLIT_COUNT; sp++) s = fl_data_split_finish(&d->split[sp]);
            fl_loader *l = NULL;
            if (s == FL_OK && nt > 0 && fl_loader_init(&l, d, FL_SPLIT_TRAIN, 3, 32, 1, 1) == FL_OK) {
                fl_batch b;
                int ne;
                for (size_t i = 0; i < 4; i++) fl_loader_next(l, &b, &ne);
                fl_loader_free(l);
            }
        }
        free(perm);
        fl_data_free(d);
    }
    fl_data_records_free(&rs);
    /* the same bytes as seq2seq pairs (issue 31): tokenize, limit, batch */
    fl_s2s_config sc;
    fl_s2s_config_default(&sc);
    sc.max_source_length = (size & 4) ? 8 : 0;
    sc.max_target_length = (size & 8) ? 4 : 0;
    sc.strict = (int)((size >> 4) & 1);
    fl_s2s_data *sd = NULL;
    if (fl_s2s_load_mem(&sd, (const char *)data, size, SOURCE, &sc, g_tok) == FL_OK) {
        fl_s2s_loader *sl = NULL;
        if (fl_s2s_loader_init(&sl, sd, 2, 0, 0, 7, 1) == FL_OK) {
            fl_s2s_batch b;
            for (int i = 0; i < 3; i++) {
                fl_s2s_loader_next(sl, &b, NULL);
                for (int k = 0; k < b.B * b.Tt; k++)
                    if (b.labels[k] != -100 && (b.labels[k] < 0 || b.labels[k] >= fl_tok_vocab_size(g_tok))) abort();
            }
            fl_s2s_loader_free(sl);
        }
        fl_s2s_free(sd);
    }
    return 0;
}

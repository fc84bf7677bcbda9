/* libFuzzer harness: datasets read from a folder through the public
 * fl_data_load (built-in byte tokenizer), so the folder listing, file reading,
 * tokenized-dataset cache and splits are fuzzed along with the parsers.
 *
 *   default (fuzz_dataset_dir_json): the input is cut at FZ_SEP into train.json,
 *       val.json, train.jsonl, val.jsonl (JSON data module, json_path = the folder).
 *   -DFL_FUZZ_TEXTFILES (fuzz_dataset_dir_textfiles): the parts become train/0.txt,
 *       train/1.txt, ... (TextFiles); when the input starts with 'V' the last part is
 *       val/v.txt and val_data_path is set. max_seq_length = 1 + size % 16.
 * Empty parts are not written. On odd-sized inputs a cache_dir is set and the
 * folder is loaded twice: the second load must be a cache hit that gives the same
 * samples (abort otherwise). An accepted dataset feeds a shuffled loader for a
 * few micro-batches, whose ids must be tokens of the tokenizer. Build: fuzz/build.sh */
/* binaries built from this file (fuzz/harnesses.cmake reads these lines: name, then defines): */
// fuzz-build: fuzz_dataset_dir_json
// fuzz-build: fuzz_dataset_dir_textfiles FL_FUZZ_TEXTFILES
#include "fuzz_util.h"

#include "fitllm/data.h"
#include "fitllm/tokenizer.h"

static fl_tokenizer *g_tok;

static int same_data(const fl_dataset *a, const fl_dataset *b) {
    for (int sp = 0; sp < FL_SPLIT_COUNT; sp++) {
        if (fl_data_count(a, sp) != fl_data_count(b, sp)) return 0;
        for (size_t i = 0; i < fl_data_count(a, sp); i++) {
            const fl_sample *x = fl_data_get(a, sp, i), *y = fl_data_get(b, sp, i);
            if (x->len != y->len || x->prompt_len != y->prompt_len ||
                memcmp(x->ids, y->ids, (size_t)x->len * sizeof *x->ids) ||
                memcmp(x->labels, y->labels, (size_t)x->len * sizeof *x->labels))
                return 0;
        }
    }
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!g_tok && fl_tok_builtin_bytes(&g_tok) != FL_OK) abort();
    char path[700];
    const char *root = fz_fresh_dir("data");
    const uint8_t *p = data;
    fl_data_config c;
#ifndef FL_FUZZ_TEXTFILES
    static const char *names[] = {"train.json", "val.json", "train.jsonl", "val.jsonl"};
    const uint8_t *part;
    size_t n;
    fl_data_config_default(&c, FL_DATA_JSON);
    for (int k = 0; k < 4 && fz_next_part(&p, data + size, &part, &n); k++) {
        if (!n) continue;
        snprintf(path, sizeof path, "%s/%s", root, names[k]);
        fz_write(path, part, n);
    }
    snprintf(c.json_path, sizeof c.json_path, "%s", root);
    c.mask_prompt = (int)((size >> 1) & 1);
    c.max_seq_length = (size & 4) ? 48 : -1;
#else
    fl_data_config_default(&c, FL_DATA_TEXTFILES);
    char train[600], val[600];
    snprintf(train, sizeof train, "%s/train", root);
    snprintf(val, sizeof val, "%s/val", root);
    if (mkdir(train, 0700) || mkdir(val, 0700)) abort();
    const uint8_t *parts[8];
    size_t lens[8];
    int np = 0;
    while (np < 8 && fz_next_part(&p, data + size, &parts[np], &lens[np])) np++;
    int has_val = size > 0 && data[0] == 'V' && np > 1;
    for (int k = 0; k < np; k++) {
        if (!lens[k]) continue;
        if (has_val && k == np - 1) snprintf(path, sizeof path, "%s/v.txt", val);
        else snprintf(path, sizeof path, "%s/%d.txt", train, k);
        fz_write(path, parts[k], lens[k]);
    }
    snprintf(c.train_data_path, sizeof c.train_data_path, "%s", train);
    if (has_val) snprintf(c.val_data_path, sizeof c.val_data_path, "%s", val);
    c.max_seq_length = 1 + (int)(size % 16);
#endif
    int cached = (int)(size & 1);
    if (cached) snprintf(c.cache_dir, sizeof c.cache_dir, "%s", fz_fresh_dir("cache"));
    fl_dataset *d = NULL;
    if (fz_dbg(fl_data_load(&d, &c, g_tok)) != FL_OK) return 0;
    if (cached) {
        fl_dataset *d2 = NULL;
        if (fl_data_load(&d2, &c, g_tok) != FL_OK) abort();
        if (!fl_data_get_stats(d2)->cache_hit || !same_data(d, d2)) abort();
        fl_data_free(d2);
    }
    fl_loader *l = NULL;
    if (fl_loader_init(&l, d, FL_SPLIT_TRAIN, 3, 32, 1, 1) == FL_OK) {
        fl_batch b;
        int ne;
        for (int i = 0; i < 4; i++) {
            if (fl_loader_next(l, &b, &ne) != FL_OK) break;
            for (int j = 0; j < b.B * b.T; j++)
                if (b.ids[j] < 0 || b.ids[j] >= fl_tok_vocab_size(g_tok)) abort();
        }
        fl_loader_free(l);
    }
    fl_data_free(d);
    return 0;
}

/* Synthetic: a built-in instruction dataset a small model visibly learns, a
 * deterministic function of (seed, split, index). Four tasks, in turn picked at
 * random:
 *   "Add 23 and 41"         -> "64"       (operands 0..99)
 *   "Reverse: abcd"         -> "dcba"     (3..6 lowercase letters)
 *   "Copy: xyz"             -> "xyz"      (3..6 lowercase letters)
 *   "Sort the digits 3142"  -> "1234"     (4..6 digits)
 * Records are formatted with the configured prompt style and tokenized like
 * Alpaca records, so the byte tokenizer works. The val split uses its own
 * stream, so it is not a copy of the first train records. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data-impl.h"
#include "fitllm/lengths.h"
#include "fitllm/tokenizer.h"

static void rand_letters(uint64_t *st, char *o, int n) {
    for (int i = 0; i < n; i++) o[i] = (char)('a' + fl_data_rand_below(st, 26));
    o[n] = '\0';
}

static int cmp_char(const void *a, const void *b) { return *(const char *)a - *(const char *)b; }

fl_status fl_data_synthetic_records(uint64_t seed, fl_split split, size_t n, fl_data_records *out) {
    uint64_t st = seed * 0x9e3779b97f4a7c15ULL + ((uint64_t)split + 1) * 0xd1b54a32d192ed03ULL;
    char ins[64], ans[16], w[16];
    for (size_t i = 0; i < n; i++) {
        int task = (int)fl_data_rand_below(&st, 4);
        switch (task) {
        case 0: {
            int a = (int)fl_data_rand_below(&st, 100), b = (int)fl_data_rand_below(&st, 100);
            snprintf(ins, sizeof ins, "Add %d and %d", a, b);
            snprintf(ans, sizeof ans, "%d", a + b);
            break;
        }
        case 1: {
            int l = 3 + (int)fl_data_rand_below(&st, 4);
            rand_letters(&st, w, l);
            snprintf(ins, sizeof ins, "Reverse: %s", w);
            for (int k = 0; k < l; k++) ans[k] = w[l - 1 - k];
            ans[l] = '\0';
            break;
        }
        case 2: {
            int l = 3 + (int)fl_data_rand_below(&st, 4);
            rand_letters(&st, w, l);
            snprintf(ins, sizeof ins, "Copy: %s", w);
            snprintf(ans, sizeof ans, "%s", w);
            break;
        }
        default: {
            int l = 4 + (int)fl_data_rand_below(&st, 3);
            for (int k = 0; k < l; k++) w[k] = (char)('0' + fl_data_rand_below(&st, 10));
            w[l] = '\0';
            snprintf(ins, sizeof ins, "Sort the digits %s", w);
            memcpy(ans, w, (size_t)l + 1);
            qsort(ans, (size_t)l, 1, cmp_char);
            break;
        }
        }
        FL_TRY(fl_data_records_add(out, ins, NULL, ans));
    }
    return FL_OK;
}

/* data.lengths: sample i of a split is fl_lengths_draw(seed, split, i) tokens (cut to max_seq_length, as a
 * record would be) of random letters, every token a target. The lengths are what matters (memory, time:
 * the trainer sizes activations for the longest, the loader pads each micro batch to its longest), and
 * `fitllm plan` draws the same ones. */
static fl_status build_lengths(fl_dataset *d, const fl_data_config *cfg, const fl_tokenizer *tok) {
    fl_lengths t;
    FL_TRY(fl_error_prefix(fl_lengths_load(cfg->lengths, &t), "data.lengths"));
    int32_t *pool = NULL;
    size_t np = 0;
    FL_TRY(fl_tok_encode(tok, "abcdefghijklmnopqrstuvwxyz", 26, 0, 0, &pool, &np));
    if (np == 0) { free(pool); return fl_errorf(FL_ERR_INVALID, "data.lengths: the tokenizer encodes no letters"); }
    int cap = t.len[t.n - 1];
    int32_t *buf = malloc((size_t)cap * sizeof *buf);
    fl_status s = buf ? FL_OK : fl_errorf(FL_ERR_OOM, "data.lengths: out of memory");
    for (int sp = 0; sp < FL_SPLIT_COUNT && s == FL_OK; sp++) {
        size_t n = (size_t)(sp == FL_SPLIT_TRAIN ? cfg->synthetic_train : cfg->synthetic_val);
        uint64_t st = cfg->seed * 0x9e3779b97f4a7c15ULL + ((uint64_t)sp + 1) * 0xd1b54a32d192ed03ULL;
        for (size_t i = 0; i < n && s == FL_OK; i++) {
            int len = fl_lengths_draw(&t, cfg->seed, sp, i);
            if (cfg->max_seq_length > 0 && len > cfg->max_seq_length) len = cfg->max_seq_length, d->stats.n_truncated++;
            for (int k = 0; k < len; k++) buf[k] = pool[fl_data_rand_below(&st, np)];
            s = fl_data_split_push(&d->split[sp], buf, buf, len, 0);
        }
    }
    free(buf);
    free(pool);
    return s;
}

fl_status fl_data_build_synthetic(fl_dataset *d, const fl_data_config *cfg, const fl_tokenizer *tok) {
    if (cfg->lengths[0]) return build_lengths(d, cfg, tok);
    fl_status s = FL_OK;
    for (int sp = 0; sp < FL_SPLIT_COUNT && s == FL_OK; sp++) {
        fl_data_records rs = {0};
        size_t n = (size_t)(sp == FL_SPLIT_TRAIN ? cfg->synthetic_train : cfg->synthetic_val);
        s = fl_data_synthetic_records(cfg->seed, (fl_split)sp, n, &rs);
        if (s == FL_OK) s = fl_data_sft_tokenize(&rs, NULL, rs.n, cfg, tok, &d->split[sp], &d->stats, "Synthetic");
        fl_data_records_free(&rs);
    }
    return s;
}

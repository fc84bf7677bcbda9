/* TextFiles (LitGPT litgpt/data/text_files.py): every .txt file is read as
 * UTF-8, stripped (Python str.strip()), encoded with BOS and without EOS, the
 * files of a split are concatenated in sorted order and cut into blocks of
 * max_seq_length + 1 tokens (litdata TokensLoader); the tail shorter than a
 * block is dropped (drop_last). labels == ids, prompt_len = 0. */
#include <stdlib.h>
#include <string.h>

#include "data-internal.h"

static fl_status tokenize_split(const fl_data_files *fs, size_t from, size_t to, const fl_data_config *cfg,
                                const fl_tokenizer *tok, fl_data_split_buf *b, fl_data_stats *st, int is_train) {
    int32_t *all = NULL;
    size_t n_all = 0, cap = 0;
    fl_status s = FL_OK;
    for (size_t i = from; i < to && s == FL_OK; i++) {
        const fl_data_file *f = &fs->f[i];
        size_t bad = 0, b0, b1;
        if (!fl_data_utf8_valid(f->data, f->len, &bad)) {
            s = fl_errorf(FL_ERR_FORMAT, "%s: not valid UTF-8 (byte offset %zu)", f->path, bad);
            break;
        }
        fl_data_strip(f->data, f->len, &b0, &b1);
        int32_t *ids = NULL;
        size_t n = 0;
        s = fl_tok_encode(tok, f->data + b0, b1 - b0, 1, 0, &ids, &n);
        if (s != FL_OK) {
            s = fl_error_prefix(s, "%s: tokenizing", f->path);
            break;
        }
        if (n_all + n > cap) {
            size_t c = cap ? cap : 4096;
            while (c < n_all + n) c *= 2;
            int32_t *na = realloc(all, c * sizeof *na);
            if (!na) s = fl_errorf(FL_ERR_OOM, "%s: out of memory (%zu tokens)", f->path, n_all + n);
            else all = na, cap = c;
        }
        if (s == FL_OK && n) {
            memcpy(all + n_all, ids, n * sizeof *ids);
            n_all += n;
        }
        free(ids);
    }
    size_t block = (size_t)cfg->max_seq_length + 1;
    if (s == FL_OK) {
        size_t nb = n_all / block;
        if (nb == 0 && is_train)
            s = fl_errorf(FL_ERR_FORMAT, "%s: %zu tokens in the train files, fewer than one block of max_seq_length+1 = %zu",
                          cfg->train_data_path, n_all, block);
        if (nb == 0 && !is_train) st->n_warnings++;
        if (n_all % block) st->n_warnings++;
        for (size_t k = 0; k < nb && s == FL_OK; k++)
            s = fl_data_split_push(b, all + k * block, all + k * block, (int)block, 0);
    }
    free(all);
    return s;
}

fl_status fl_data_build_textfiles(fl_dataset *d, const fl_data_config *cfg, const fl_tokenizer *tok,
                                  const fl_data_files *fs, size_t n_train_files) {
    FL_TRY(tokenize_split(fs, 0, n_train_files, cfg, tok, &d->split[FL_SPLIT_TRAIN], &d->stats, 1));
    return tokenize_split(fs, n_train_files, fs->n, cfg, tok, &d->split[FL_SPLIT_VAL], &d->stats, 0);
}

/* TextFiles (LitGPT litgpt/data/text_files.py): every .txt file is read as
 * UTF-8, stripped (Python str.strip()), encoded with BOS and without EOS, the
 * files of a split are concatenated in sorted order and cut into blocks of
 * max_seq_length + 1 tokens (litdata TokensLoader); the tail shorter than a
 * block is dropped (drop_last). labels == ids, prompt_len = 0.
 * Validation: the files of val_data_path; else, as LitGPT, the first train file in
 * sorted order; else (fitllm: one train file) its last val_split_fraction of blocks.
 * The run names which (fl_data_stats.val_source): LitGPT's rule silently validated a
 * TinyStories run on Shakespeare, the alphabetically first file of its folder. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data-impl.h"

static const char *base_name(const char *p) {
    const char *s = strrchr(p, '/');
    return s && s[1] ? s + 1 : p;
}

void fl_data_textfiles_describe(const fl_data_config *cfg, const fl_data_files *fs, size_t n_train_files, char *buf,
                                size_t n) {
    if (!n) return;
    buf[0] = 0;
    if (n_train_files >= fs->n) {
        snprintf(buf, n, "the last %g%% of the blocks of %s (data.val_split_fraction %g, train_data_path being one "
                 "file; data.val_data_path names validation text instead)",
                 (double)cfg->val_split_fraction * 100, fs->n ? base_name(fs->f[0].path) : "?",
                 (double)cfg->val_split_fraction);
        return;
    }
    size_t o = 0;
    for (size_t i = n_train_files; i < fs->n && o + 1 < n; i++) {
        if (i - n_train_files == 4) { /* a long list: the first four and the count */
            snprintf(buf + o, n - o, " and %zu more", fs->n - i);
            break;
        }
        snprintf(buf + o, n - o, "%s%s", i > n_train_files ? ", " : "", base_name(fs->f[i].path));
        o = strlen(buf);
    }
    o = strlen(buf);
    if (o + 1 >= n) return;
    if (cfg->val_data_path[0])
        snprintf(buf + o, n - o, " (data.val_data_path %s)", cfg->val_data_path);
    else
        snprintf(buf + o, n - o, ", the first .txt of train_data_path in sorted order, as LitGPT's TextFiles (choose "
                 "with data.val_data_path: a folder or a .txt file)");
}

/* The files [from, to) as blocks; the last n_hold blocks (val_split_fraction of them, when hold is
 * set: one train file, no validation files) go to hold. */
static fl_status tokenize_split(const fl_data_files *fs, size_t from, size_t to, const fl_data_config *cfg,
                                const fl_tokenizer *tok, fl_data_split_buf *b, fl_data_stats *st, int is_train,
                                fl_data_split_buf *hold) {
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
        if (nb == 0 && is_train) { /* which files those are, and the one validating (LitGPT's rule) */
            char which[512] = "";
            size_t o = 0;
            for (size_t i = from; i < to && i < from + 3 && o < sizeof which; i++)
                o += (size_t)snprintf(which + o, sizeof which - o, "%s%s", i > from ? ", " : "", base_name(fs->f[i].path));
            if (to - from > 3 && o < sizeof which) snprintf(which + o, sizeof which - o, ", ... (%zu files)", to - from);
            const int val_taken = to < fs->n && !cfg->val_data_path[0]; /* the first .txt of train_data_path */
            s = fl_errorf(FL_ERR_FORMAT, "%s: %zu tokens in the train files (%s), fewer than one block of "
                          "max_seq_length+1 = %zu%s%s%s", cfg->train_data_path, n_all, which, block,
                          val_taken ? "; " : "", val_taken ? base_name(fs->f[to].path) : "",
                          val_taken ? " validates (the first .txt in sorted order, as LitGPT; choose with "
                                      "data.val_data_path)" : "");
        }
        if (nb == 0 && !is_train) st->n_warnings++;
        if (n_all % block) st->n_warnings++;
        size_t n_train = nb, n_val = 0;
        if (hold) {
            fl_data_split_lengths(nb, cfg->val_split_fraction, &n_train, &n_val);
            if (n_val == 0) st->n_warnings++;
        }
        for (size_t k = 0; k < nb && s == FL_OK; k++)
            s = fl_data_split_push(k < n_train ? b : hold, all + k * block, all + k * block, (int)block, 0);
    }
    free(all);
    return s;
}

fl_status fl_data_build_textfiles(fl_dataset *d, const fl_data_config *cfg, const fl_tokenizer *tok,
                                  const fl_data_files *fs, size_t n_train_files) {
    const int hold = n_train_files >= fs->n; /* no validation files: split the one train file */
    FL_TRY(tokenize_split(fs, 0, n_train_files, cfg, tok, &d->split[FL_SPLIT_TRAIN], &d->stats, 1,
                          hold ? &d->split[FL_SPLIT_VAL] : NULL));
    if (hold) return FL_OK;
    return tokenize_split(fs, n_train_files, fs->n, cfg, tok, &d->split[FL_SPLIT_VAL], &d->stats, 0, NULL);
}

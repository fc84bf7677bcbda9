/* Datasets: configuration defaults, sample storage, and fl_data_load (source
 * files -> cache lookup -> build by kind -> cache store). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data-impl.h"

void fl_data_config_default(fl_data_config *c, fl_data_kind kind) {
    memset(c, 0, sizeof *c);
    c->kind = kind;
    snprintf(c->prompt_style, sizeof c->prompt_style, "%s", "alpaca");
    c->mask_prompt = 0;
    c->ignore_index = -100;
    c->val_split_fraction = kind == FL_DATA_ALPACA ? 0.03865f : 0.05f;
    c->seed = 42;
    c->max_seq_length = -1;
    c->synthetic_train = 2000;
    c->synthetic_val = 100;
    c->max_source_length = 512;
    c->max_target_length = 128;
}

const char *fl_data_kind_name(fl_data_kind k) {
    switch (k) {
    case FL_DATA_SYNTHETIC: return "Synthetic";
    case FL_DATA_ALPACA: return "Alpaca";
    case FL_DATA_JSON: return "JSON";
    case FL_DATA_TEXTFILES: return "TextFiles";
    default: return "?";
    }
}

/* ---- sample storage ----------------------------------------------------------- */

static fl_status grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return FL_OK;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *q = realloc(*p, c * elem);
    if (!q) return fl_errorf(FL_ERR_OOM, "dataset: out of memory (%zu elements)", c);
    *p = q;
    *cap = c;
    return FL_OK;
}

fl_status fl_data_split_push(fl_data_split_buf *b, const int32_t *ids, const int32_t *labels, int len, int plen) {
    size_t ct = b->cap_tok, cn = b->cap;
    FL_TRY(grow((void **)&b->ids, &ct, b->n_tok + (size_t)len, sizeof(int32_t)));
    ct = b->cap_tok;
    FL_TRY(grow((void **)&b->labels, &ct, b->n_tok + (size_t)len, sizeof(int32_t)));
    b->cap_tok = ct;
    FL_TRY(grow((void **)&b->len, &cn, b->n + 1, sizeof(int32_t)));
    cn = b->cap;
    FL_TRY(grow((void **)&b->plen, &cn, b->n + 1, sizeof(int32_t)));
    b->cap = cn;
    if (len) {
        memcpy(b->ids + b->n_tok, ids, (size_t)len * sizeof(int32_t));
        memcpy(b->labels + b->n_tok, labels, (size_t)len * sizeof(int32_t));
    }
    b->len[b->n] = len;
    b->plen[b->n] = plen;
    b->n_tok += (size_t)len;
    b->n++;
    return FL_OK;
}

fl_status fl_data_split_finish(fl_data_split_buf *b) {
    free(b->samples);
    b->samples = calloc(b->n ? b->n : 1, sizeof *b->samples);
    if (!b->samples) return fl_errorf(FL_ERR_OOM, "dataset: out of memory (%zu samples)", b->n);
    size_t off = 0;
    for (size_t i = 0; i < b->n; i++) {
        b->samples[i].ids = b->ids + off;
        b->samples[i].labels = b->labels + off;
        b->samples[i].len = b->len[i];
        b->samples[i].prompt_len = b->plen[i];
        off += (size_t)b->len[i];
    }
    return FL_OK;
}

void fl_data_split_free(fl_data_split_buf *b) {
    free(b->ids);
    free(b->labels);
    free(b->len);
    free(b->plen);
    free(b->samples);
    memset(b, 0, sizeof *b);
}

fl_status fl_data_new(fl_dataset **out) {
    *out = calloc(1, sizeof **out);
    if (!*out) return fl_errorf(FL_ERR_OOM, "dataset: out of memory");
    return FL_OK;
}

void fl_data_free(fl_dataset *d) {
    if (!d) return;
    for (int s = 0; s < FL_SPLIT_COUNT; s++) fl_data_split_free(&d->split[s]);
    free(d);
}

size_t fl_data_count(const fl_dataset *d, fl_split split) {
    if (!d || split < 0 || split >= FL_SPLIT_COUNT) return 0;
    return d->split[split].n;
}

const fl_sample *fl_data_get(const fl_dataset *d, fl_split split, size_t i) {
    if (!d || split < 0 || split >= FL_SPLIT_COUNT || i >= d->split[split].n) return NULL;
    return &d->split[split].samples[i];
}

const fl_data_stats *fl_data_get_stats(const fl_dataset *d) { return &d->stats; }

uint64_t fl_data_fp_extend(uint64_t h, const int32_t *v, size_t n) { return fl_data_fp_words(h, v, n); }

uint64_t fl_data_fingerprint(const fl_dataset *d, fl_split split) {
    uint64_t h = FL_DATA_FP_BASIS;
    if (!d || split < 0 || split >= FL_SPLIT_COUNT) return h;
    const fl_data_split_buf *b = &d->split[split];
    /* the count, each sample's length and prompt length (the boundaries), then every id and label in order */
    h = fl_data_fp_count(h, b->n);
    h = fl_data_fp_words(h, b->len, b->n);
    h = fl_data_fp_words(h, b->plen, b->n);
    h = fl_data_fp_count(h, b->n_tok);
    h = fl_data_fp_words(h, b->ids, b->n_tok);
    return fl_data_fp_words(h, b->labels, b->n_tok);
}

/* ---- load ------------------------------------------------------------------------ */

static fl_status check_config(const fl_data_config *cfg, const fl_tokenizer *tok) {
    if (!cfg) return fl_errorf(FL_ERR_INVALID, "data: no config");
    if (!tok) return fl_errorf(FL_ERR_INVALID, "data %s: no tokenizer", fl_data_kind_name(cfg->kind));
    if (cfg->kind < 0 || cfg->kind >= FL_DATA_KIND_COUNT)
        return fl_errorf(FL_ERR_INVALID, "data: unknown kind %d (known: Synthetic, Alpaca, JSON, TextFiles)", (int)cfg->kind);
    if (cfg->kind != FL_DATA_TEXTFILES) {
        char *probe = NULL;
        FL_TRY(fl_data_format_prompt(cfg->prompt_style, "", NULL, &probe));
        free(probe);
    }
    if ((cfg->kind == FL_DATA_ALPACA || cfg->kind == FL_DATA_JSON) &&
        !(cfg->val_split_fraction >= 0.0f && cfg->val_split_fraction <= 1.0f))
        return fl_errorf(FL_ERR_INVALID, "data %s: val_split_fraction %g is not in [0, 1]", fl_data_kind_name(cfg->kind),
                         (double)cfg->val_split_fraction);
    if (cfg->kind == FL_DATA_SYNTHETIC && (cfg->synthetic_train < 1 || cfg->synthetic_val < 0))
        return fl_errorf(FL_ERR_INVALID, "data Synthetic: synthetic_train %d must be >= 1 and synthetic_val %d >= 0",
                         cfg->synthetic_train, cfg->synthetic_val);
    if (cfg->kind == FL_DATA_TEXTFILES && cfg->max_seq_length < 1)
        return fl_errorf(FL_ERR_INVALID, "data TextFiles: max_seq_length must be set (>= 1), got %d", cfg->max_seq_length);
    return FL_OK;
}

static void recount(fl_dataset *d) {
    d->stats.n_tokens = 0;
    for (int s = 0; s < FL_SPLIT_COUNT; s++) {
        d->stats.n_samples[s] = d->split[s].n;
        d->stats.n_tokens += d->split[s].n_tok;
    }
}

fl_status fl_data_load(fl_dataset **out, const fl_data_config *cfg, const fl_tokenizer *tok) {
    *out = NULL;
    FL_TRY(check_config(cfg, tok));
    fl_data_files fs = {0};
    size_t n_train_files = 0;
    fl_dataset *d = NULL;
    fl_status s = FL_OK;
    uint64_t key[2] = {0, 0};
    char cpath[4200];
    int use_cache = cfg->cache_dir[0] != '\0';

    if (cfg->kind != FL_DATA_SYNTHETIC) s = fl_data_sources(cfg, &fs, &n_train_files);
    if (s == FL_OK && use_cache) {
        s = fl_data_cache_key(cfg, tok, &fs, key);
        if (s == FL_OK) s = fl_data_cache_path(cfg, key, cpath, sizeof cpath);
    }
    if (s == FL_OK) s = fl_data_new(&d);
    if (s == FL_OK) d->ignore_index = cfg->ignore_index;
    char val_source[sizeof d->stats.val_source] = "";
    if (s == FL_OK && cfg->kind == FL_DATA_TEXTFILES)
        fl_data_textfiles_describe(cfg, &fs, n_train_files, val_source, sizeof val_source);
    if (s == FL_OK) memcpy(d->stats.val_source, val_source, sizeof val_source);
    if (s == FL_OK && use_cache) {
        fl_status cs = fl_data_cache_read(cpath, key, d);
        if (cs == FL_OK) {
            d->stats.cache_hit = 1;
            recount(d);
            fl_data_files_free(&fs);
            *out = d;
            return FL_OK;
        }
        /* miss or corrupt (never trusted): rebuild from the sources */
        fl_data_free(d);
        d = NULL;
        fl_error_clear();
        s = fl_data_new(&d);
        if (s == FL_OK) d->ignore_index = cfg->ignore_index;
        if (s == FL_OK) memcpy(d->stats.val_source, val_source, sizeof val_source);
    }
    if (s == FL_OK) {
        switch (cfg->kind) {
        case FL_DATA_SYNTHETIC: s = fl_data_build_synthetic(d, cfg, tok); break;
        case FL_DATA_ALPACA:
        case FL_DATA_JSON: s = fl_data_build_json(d, cfg, tok, &fs, n_train_files); break;
        case FL_DATA_TEXTFILES: s = fl_data_build_textfiles(d, cfg, tok, &fs, n_train_files); break;
        default: s = fl_errorf(FL_ERR_INTERNAL, "data: kind %d", (int)cfg->kind);
        }
    }
    for (int sp = 0; s == FL_OK && sp < FL_SPLIT_COUNT; sp++) s = fl_data_split_finish(&d->split[sp]);
    if (s == FL_OK) {
        recount(d);
        if (d->split[FL_SPLIT_TRAIN].n == 0)
            s = fl_errorf(FL_ERR_FORMAT, "data %s: the train split is empty", fl_data_kind_name(cfg->kind));
    }
    if (s == FL_OK && use_cache) {
        /* a cache that cannot be written is not fatal: the data is in memory */
        if (fl_data_cache_write(cpath, key, d) != FL_OK) {
            d->stats.n_warnings++;
            fl_error_clear();
        }
    }
    fl_data_files_free(&fs);
    if (s != FL_OK) {
        fl_data_free(d);
        return s;
    }
    *out = d;
    return FL_OK;
}

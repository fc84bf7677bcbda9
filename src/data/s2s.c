/* Seq2seq pairs for encoder-decoder models (T5): records -> (source ids, target ids) -> padded
 * batches (src, src_mask, dec_in, labels). See include/fitllm/data.h and docs/ARCHITECTURE.md
 * "Data" for the record format, the instruction/input join, EOS and the length limits. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data-impl.h"
#include "fitllm/backend.h" /* FL_IGNORE_INDEX */
#include "fitllm/json.h"

struct fl_s2s_data {
    int32_t *tok;           /* all ids, back to back: source then target of each pair */
    size_t n_tok, cap_tok;
    size_t *off;            /* per pair: offset of its source in tok */
    int32_t *ns, *nt;       /* per pair: lengths */
    size_t n, cap;
    fl_s2s_stats stats;
};

struct fl_s2s_loader {
    const fl_s2s_data *d;
    int B, pad, start, shuffle, max_s, max_t;
    uint64_t seed;
    int64_t epoch, pos, perm_epoch;
    size_t *perm;
    int32_t *src, *dec_in, *labels;
    uint8_t *mask;
    const int32_t **bs, **bt; /* per batch row: views of the pair */
    int *bns, *bnt;
};

void fl_s2s_config_default(fl_s2s_config *c) {
    memset(c, 0, sizeof *c);
    c->max_source_length = 512;
    c->max_target_length = 128;
}

int fl_s2s_source_limit(int max_source, int max_seq) {
    if (max_seq <= 0) return max_source;
    return max_source <= 0 || max_seq < max_source ? max_seq : max_source;
}

void fl_s2s_free(fl_s2s_data *d) {
    if (!d) return;
    free(d->tok);
    free(d->off);
    free(d->ns);
    free(d->nt);
    free(d);
}

size_t fl_s2s_count(const fl_s2s_data *d) { return d ? d->n : 0; }
const fl_s2s_stats *fl_s2s_get_stats(const fl_s2s_data *d) { return d ? &d->stats : NULL; }

uint64_t fl_s2s_fingerprint(const fl_s2s_data *d) {
    uint64_t h = fl_data_fp_count(FL_DATA_FP_BASIS, fl_s2s_count(d));
    for (size_t i = 0; i < fl_s2s_count(d); i++) { /* each pair's lengths (its boundaries), then its ids */
        const int32_t *a, *b;
        int na, nb;
        fl_s2s_get(d, i, &a, &na, &b, &nb);
        const int32_t n[2] = {na, nb};
        h = fl_data_fp_words(h, n, 2);
        h = fl_data_fp_words(h, a, (size_t)na);
        h = fl_data_fp_words(h, b, (size_t)nb);
    }
    return h;
}

void fl_s2s_get(const fl_s2s_data *d, size_t i, const int32_t **src, int *n_src, const int32_t **tgt, int *n_tgt) {
    *src = d->tok + d->off[i];
    *n_src = d->ns[i];
    *tgt = *src + d->ns[i];
    *n_tgt = d->nt[i];
}

static fl_status s2s_oom(void) { return fl_errorf(FL_ERR_OOM, "seq2seq data: out of memory"); }

static const char *jtype(const fl_json *v) {
    static const char *const names[] = {"null", "a boolean", "a number", "a string", "an array", "an object"};
    return (unsigned)v->type < 6 ? names[v->type] : "?";
}

/* An optional string field: absent or null -> NULL (null allowed only where nullable). */
static fl_status opt_str(const fl_json *o, const char *key, int nullable, const char *where, const fl_json **out) {
    const fl_json *v = fl_json_get(o, key);
    *out = NULL;
    if (!v) return FL_OK;
    if (v->type == FL_JSON_NULL && nullable) return FL_OK;
    if (v->type != FL_JSON_STRING) return fl_errorf(FL_ERR_FORMAT, "%s: \"%s\" must be a string, got %s", where, key, jtype(v));
    if (strlen(v->str) != v->len) return fl_errorf(FL_ERR_FORMAT, "%s: \"%s\" contains a NUL character (\\u0000)", where, key);
    *out = v;
    return FL_OK;
}

/* Encode with EOS, apply the limit; returns the kept length in *n (ids stay malloc'd in *ids). */
static fl_status encode_limited(const fl_tokenizer *tok, const char *s, size_t len, int limit, int strict, const char *where,
                                const char *what, const char *opt, int32_t **ids, size_t *n, int *cut) {
    FL_TRY(fl_tok_encode(tok, s, len, 0, 1, ids, n));
    *cut = 0;
    if (limit > 0 && *n > (size_t)limit) {
        if (strict) {
            fl_status e = fl_errorf(FL_ERR_INVALID, "%s: the %s has %zu tokens (with EOS), over %s %d", where, what, *n, opt, limit);
            free(*ids);
            *ids = NULL;
            return e;
        }
        (*ids)[limit - 1] = (*ids)[*n - 1]; /* EOS stays last, as HF's truncation=True */
        *n = (size_t)limit;
        *cut = 1;
    }
    return FL_OK;
}

static fl_status push_pair(fl_s2s_data *d, const int32_t *s, size_t ns, const int32_t *t, size_t nt) {
    if (d->n == d->cap) {
        size_t c = d->cap ? d->cap * 2 : 64;
        size_t *o = realloc(d->off, c * sizeof *o);
        if (o) d->off = o;
        int32_t *a = realloc(d->ns, c * sizeof *a);
        if (a) d->ns = a;
        int32_t *b = realloc(d->nt, c * sizeof *b);
        if (b) d->nt = b;
        if (!o || !a || !b) return s2s_oom();
        d->cap = c;
    }
    if (d->n_tok + ns + nt > d->cap_tok) {
        size_t c = d->cap_tok ? d->cap_tok : 1024;
        while (c < d->n_tok + ns + nt) c *= 2;
        int32_t *p = realloc(d->tok, c * sizeof *p);
        if (!p) return s2s_oom();
        d->tok = p, d->cap_tok = c;
    }
    d->off[d->n] = d->n_tok;
    memcpy(d->tok + d->n_tok, s, ns * sizeof *s);
    memcpy(d->tok + d->n_tok + ns, t, nt * sizeof *t);
    d->n_tok += ns + nt;
    d->ns[d->n] = (int32_t)ns;
    d->nt[d->n] = (int32_t)nt;
    d->n++;
    d->stats.n_source_tokens += ns;
    d->stats.n_target_tokens += nt;
    return FL_OK;
}

fl_status fl_s2s_split(const fl_s2s_data *d, float val_fraction, uint64_t seed, fl_s2s_data **train, fl_s2s_data **val) {
    *train = *val = NULL;
    if (!(val_fraction >= 0.0f && val_fraction <= 1.0f))
        return fl_errorf(FL_ERR_INVALID, "val_split_fraction %g is not in [0, 1]", (double)val_fraction);
    size_t nt, nv, *perm = NULL;
    fl_data_split_lengths(d->n, val_fraction, &nt, &nv);
    FL_TRY(fl_data_torch_randperm(seed, d->n, &perm));
    fl_s2s_data *o[2] = {calloc(1, sizeof **train), calloc(1, sizeof **val)};
    fl_status s = o[0] && o[1] ? FL_OK : s2s_oom();
    /* LitGPT's random_split: the first n_train of the permutation; no validation pairs: the file's order (what a run
     * without a split trained on before there was one; the loader shuffles per epoch either way) */
    for (size_t i = 0; s == FL_OK && i < d->n; i++) {
        const size_t k = nv ? perm[i] : i;
        s = push_pair(o[i >= nt], d->tok + d->off[k], (size_t)d->ns[k], d->tok + d->off[k] + d->ns[k], (size_t)d->nt[k]);
    }
    free(perm);
    if (s != FL_OK) {
        fl_s2s_free(o[0]), fl_s2s_free(o[1]);
        return s;
    }
    for (int k = 0; k < 2; k++) { /* the loading's counts stay with the training split; each its own records */
        const fl_s2s_stats tok = o[k]->stats;
        o[k]->stats = k ? (fl_s2s_stats){0} : d->stats;
        o[k]->stats.n_records = o[k]->n;
        o[k]->stats.n_source_tokens = tok.n_source_tokens, o[k]->stats.n_target_tokens = tok.n_target_tokens;
    }
    *train = o[0], *val = o[1];
    return FL_OK;
}

/* One record: validate, join the encoder text, tokenize, limit, store. */
static fl_status add_record(fl_s2s_data *d, const fl_json *o, const char *where, const fl_s2s_config *cfg, const fl_tokenizer *tok) {
    if (o->type != FL_JSON_OBJECT)
        return fl_errorf(FL_ERR_FORMAT, "%s: expected an object with \"input\" (or \"instruction\") and \"output\", got %s", where, jtype(o));
    const fl_json *ins, *inp, *out;
    FL_TRY(opt_str(o, "instruction", 0, where, &ins));
    FL_TRY(opt_str(o, "input", 1, where, &inp));
    FL_TRY(opt_str(o, "output", 0, where, &out));
    if (!out) return fl_errorf(FL_ERR_FORMAT, "%s: missing \"output\" (the target text)", where);
    if (!ins && !inp) return fl_errorf(FL_ERR_FORMAT, "%s: missing \"input\" (or \"instruction\"): no encoder text", where);
    size_t li = ins ? ins->len : 0, lp = inp ? inp->len : 0, sn = 0;
    char *sp = malloc(li + lp + 3);
    if (!sp) return s2s_oom();
    if (li) memcpy(sp, ins->str, li), sn = li;
    if (li && lp) memcpy(sp + sn, "\n\n", 2), sn += 2;
    if (lp) memcpy(sp + sn, inp->str, lp), sn += lp;
    int32_t *s = NULL, *t = NULL;
    size_t ns = 0, nt = 0;
    int cs = 0, ct = 0;
    fl_status st = encode_limited(tok, sp, sn, cfg->max_source_length, cfg->strict, where, "source", "max_source_length", &s, &ns, &cs);
    free(sp);
    if (st == FL_OK)
        st = encode_limited(tok, out->str, out->len, cfg->max_target_length, cfg->strict, where, "target", "max_target_length", &t, &nt, &ct);
    if (st == FL_OK) st = push_pair(d, s, ns, t, nt);
    d->stats.n_truncated_source += cs;
    d->stats.n_truncated_target += ct;
    free(s);
    free(t);
    return st;
}

static int ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}

static fl_status read_records(fl_s2s_data *d, const char *text, size_t n, const char *source, const fl_s2s_config *cfg,
                              const fl_tokenizer *tok) {
    char where[4300];
    if (ends_with(source, ".jsonl")) {
        size_t pos = 0, line = 0;
        while (pos < n) {
            const char *nl = memchr(text + pos, '\n', n - pos);
            size_t end = nl ? (size_t)(nl - text) : n, k = pos;
            line++;
            while (k < end && (text[k] == ' ' || text[k] == '\t' || text[k] == '\r')) k++;
            if (k == end) d->stats.n_blank++;
            else {
                snprintf(where, sizeof where, "%s: line %zu (record %zu)", source, line, d->n);
                fl_json *o = NULL;
                FL_TRY(fl_json_parse(text + pos, end - pos, where, &o));
                fl_status s = add_record(d, o, where, cfg, tok);
                fl_json_free(o);
                FL_TRY(s);
            }
            pos = end + 1;
        }
        return FL_OK;
    }
    if (!ends_with(source, ".json")) return fl_errorf(FL_ERR_INVALID, "%s: unsupported file format (expected .json or .jsonl)", source);
    fl_json *root = NULL;
    FL_TRY(fl_json_parse(text, n, source, &root));
    fl_status s = FL_OK;
    if (root->type != FL_JSON_ARRAY) s = fl_errorf(FL_ERR_FORMAT, "%s: expected a JSON array of records, got %s", source, jtype(root));
    size_t i = 0;
    for (const fl_json *e = root->type == FL_JSON_ARRAY ? root->child : NULL; e && s == FL_OK; e = e->next, i++) {
        snprintf(where, sizeof where, "%s: record %zu", source, i);
        s = add_record(d, e, where, cfg, tok);
    }
    fl_json_free(root);
    return s;
}

fl_status fl_s2s_load_mem(fl_s2s_data **out, const char *text, size_t n, const char *source, const fl_s2s_config *cfg,
                          const fl_tokenizer *tok) {
    if (!out || !cfg || !tok || !source || (!text && n)) return fl_errorf(FL_ERR_INVALID, "fl_s2s_load: NULL argument");
    *out = NULL;
    if (fl_tok_eos_id(tok) < 0) return fl_errorf(FL_ERR_INVALID, "%s: the tokenizer has no EOS token (seq2seq appends EOS)", source);
    if ((cfg->max_source_length > 0 && cfg->max_source_length < 2) || (cfg->max_target_length > 0 && cfg->max_target_length < 2))
        return fl_errorf(FL_ERR_INVALID, "%s: max_source_length %d / max_target_length %d: each must be >= 2 (a token and EOS) or <= 0 (no limit)",
                         source, cfg->max_source_length, cfg->max_target_length);
    fl_s2s_data *d = calloc(1, sizeof *d);
    if (!d) return s2s_oom();
    fl_status s = read_records(d, text, n, source, cfg, tok);
    if (s == FL_OK && d->n == 0) s = fl_errorf(FL_ERR_FORMAT, "%s: no records", source);
    if (s != FL_OK) { fl_s2s_free(d); return s; }
    d->stats.n_records = d->n;
    *out = d;
    return FL_OK;
}

fl_status fl_s2s_load(fl_s2s_data **out, const char *path, const fl_s2s_config *cfg, const fl_tokenizer *tok) {
    if (!out || !path) return fl_errorf(FL_ERR_INVALID, "fl_s2s_load: NULL argument");
    *out = NULL;
    fl_data_file f;
    FL_TRY(fl_data_file_read(path, &f));
    fl_status s = fl_s2s_load_mem(out, f.data, f.len, path, cfg, tok);
    free(f.data);
    return s;
}

/* ---- batches ------------------------------------------------------------------------------ */

/* Fill b's arrays (capacity B*Ts, B*Tt) from B pairs. */
static void fill_batch(fl_s2s_batch *b, const int32_t *const *src, const int *ns, const int32_t *const *tgt, const int *nt, int pad,
                       int start) {
    for (int i = 0; i < b->B; i++) {
        int32_t *sr = b->src + (size_t)i * b->Ts, *lr = b->labels + (size_t)i * b->Tt, *dr = b->dec_in + (size_t)i * b->Tt;
        uint8_t *mr = b->src_mask + (size_t)i * b->Ts;
        for (int t = 0; t < b->Ts; t++) sr[t] = t < ns[i] ? src[i][t] : pad, mr[t] = t < ns[i];
        for (int t = 0; t < b->Tt; t++) lr[t] = t < nt[i] ? tgt[i][t] : FL_IGNORE_INDEX;
        dr[0] = start;
        for (int t = 1; t < b->Tt; t++) dr[t] = lr[t - 1] == FL_IGNORE_INDEX ? pad : lr[t - 1];
    }
}

static int max_len(const int *n, int B) {
    int m = 1;
    for (int i = 0; i < B; i++) m = n[i] > m ? n[i] : m;
    return m;
}

fl_status fl_s2s_collate(const int32_t *const *src, const int *n_src, const int32_t *const *tgt, const int *n_tgt, int B,
                         int pad_id, int decoder_start_token_id, fl_s2s_batch *out) {
    if (!out || !src || !n_src || !tgt || !n_tgt || B < 1) return fl_errorf(FL_ERR_INVALID, "fl_s2s_collate: NULL argument or B < 1");
    memset(out, 0, sizeof *out);
    for (int i = 0; i < B; i++)
        if (n_src[i] < 1 || n_tgt[i] < 1)
            return fl_errorf(FL_ERR_INVALID, "fl_s2s_collate: pair %d has an empty %s", i, n_src[i] < 1 ? "source" : "target");
    out->B = B, out->Ts = max_len(n_src, B), out->Tt = max_len(n_tgt, B);
    size_t S = (size_t)B * out->Ts, T = (size_t)B * out->Tt;
    out->src = malloc(S * sizeof *out->src);
    out->src_mask = malloc(S);
    out->dec_in = malloc(T * sizeof *out->dec_in);
    out->labels = malloc(T * sizeof *out->labels);
    if (!out->src || !out->src_mask || !out->dec_in || !out->labels) { fl_s2s_batch_free(out); return s2s_oom(); }
    fill_batch(out, src, n_src, tgt, n_tgt, pad_id, decoder_start_token_id);
    return FL_OK;
}

void fl_s2s_batch_free(fl_s2s_batch *b) {
    if (!b) return;
    free(b->src);
    free(b->src_mask);
    free(b->dec_in);
    free(b->labels);
    memset(b, 0, sizeof *b);
}

/* ---- loader ------------------------------------------------------------------------------- */

void fl_s2s_loader_free(fl_s2s_loader *l) {
    if (!l) return;
    free(l->perm);
    free(l->src);
    free(l->mask);
    free(l->dec_in);
    free(l->labels);
    free(l->bs);
    free(l->bt);
    free(l->bns);
    free(l->bnt);
    free(l);
}

fl_status fl_s2s_loader_init(fl_s2s_loader **out, const fl_s2s_data *d, int B, int pad_id, int decoder_start_token_id,
                             uint64_t seed, int shuffle) {
    if (!out || !d) return fl_errorf(FL_ERR_INVALID, "fl_s2s_loader_init: NULL argument");
    *out = NULL;
    if (B < 1) return fl_errorf(FL_ERR_INVALID, "seq2seq loader: micro-batch size %d must be >= 1", B);
    if (d->n == 0) return fl_errorf(FL_ERR_INVALID, "seq2seq loader: no pairs");
    fl_s2s_loader *l = calloc(1, sizeof *l);
    if (!l) return s2s_oom();
    l->d = d, l->B = B, l->pad = pad_id, l->start = decoder_start_token_id, l->shuffle = shuffle, l->seed = seed;
    l->perm_epoch = -1;
    for (size_t i = 0; i < d->n; i++) {
        if (d->ns[i] > l->max_s) l->max_s = d->ns[i];
        if (d->nt[i] > l->max_t) l->max_t = d->nt[i];
    }
    size_t S = (size_t)B * (size_t)l->max_s, T = (size_t)B * (size_t)l->max_t;
    l->perm = malloc(d->n * sizeof *l->perm);
    l->src = malloc(S * sizeof *l->src);
    l->mask = malloc(S);
    l->dec_in = malloc(T * sizeof *l->dec_in);
    l->labels = malloc(T * sizeof *l->labels);
    l->bs = malloc((size_t)B * sizeof *l->bs);
    l->bt = malloc((size_t)B * sizeof *l->bt);
    l->bns = malloc((size_t)B * sizeof *l->bns);
    l->bnt = malloc((size_t)B * sizeof *l->bnt);
    if (!l->perm || !l->src || !l->mask || !l->dec_in || !l->labels || !l->bs || !l->bt || !l->bns || !l->bnt) {
        fl_s2s_loader_free(l);
        return s2s_oom();
    }
    *out = l;
    return FL_OK;
}

fl_status fl_s2s_loader_next(fl_s2s_loader *l, fl_s2s_batch *b, int *new_epoch) {
    const fl_s2s_data *d = l->d;
    if (l->pos >= (int64_t)d->n) l->epoch++, l->pos = 0;
    if (new_epoch) *new_epoch = l->pos == 0;
    if (l->perm_epoch != l->epoch) fl_data_epoch_perm(l->seed, l->epoch, l->shuffle, d->n, l->perm), l->perm_epoch = l->epoch;
    int Bc = (int)((int64_t)d->n - l->pos < l->B ? (int64_t)d->n - l->pos : l->B);
    for (int i = 0; i < Bc; i++) fl_s2s_get(d, l->perm[l->pos + i], &l->bs[i], &l->bns[i], &l->bt[i], &l->bnt[i]);
    b->B = Bc, b->Ts = max_len(l->bns, Bc), b->Tt = max_len(l->bnt, Bc);
    b->src = l->src, b->src_mask = l->mask, b->dec_in = l->dec_in, b->labels = l->labels;
    fill_batch(b, l->bs, l->bns, l->bt, l->bnt, l->pad, l->start);
    l->pos += Bc;
    return FL_OK;
}

void fl_s2s_loader_get_state(const fl_s2s_loader *l, fl_loader_state *s) {
    s->seed = l->seed;
    s->epoch = l->epoch;
    s->pos = l->pos;
}

fl_status fl_s2s_loader_set_state(fl_s2s_loader *l, const fl_loader_state *s) {
    if (s->epoch < 0 || s->pos < 0 || s->pos > (int64_t)l->d->n)
        return fl_errorf(FL_ERR_INVALID, "seq2seq loader state: epoch %lld, position %lld is out of range (%zu pairs)",
                         (long long)s->epoch, (long long)s->pos, l->d->n);
    l->seed = s->seed, l->epoch = s->epoch, l->pos = s->pos, l->perm_epoch = -1;
    return FL_OK;
}

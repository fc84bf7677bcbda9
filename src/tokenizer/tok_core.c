/* fitllm tokenizers: public API. Loading dispatch (folder or file), BOS/EOS
 * from tokenizer_config.json / special_tokens_map.json / config.json, the
 * built-in byte tokenizer, encoding with added-token splitting, accessors. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fitllm/json.h"
#include "tok-impl.h"

static int fl_tok_is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}
static int fl_tok_is_file(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

void fl_tok_free(fl_tokenizer *t) {
    if (!t) return;
    free(t->arena);
    free(t->off);
    free(t->len);
    free(t->type);
    free(t->score);
    free(t->uscore);
    free(t->trie.key);
    free(t->trie.child);
    free(t->trie.piece);
    free(t->cm_units);
    free(t->cm_str);
    if (t->grapheme_re) fl_tok_regex_free(t->grapheme_re);
    free(t->vocab.slot);
    free(t->merges.slot);
    for (int i = 0; i < t->n_norm; i++) free(t->norm[i].a), free(t->norm[i].b);
    free(t->norm);
    for (int i = 0; i < t->n_pre; i++) {
        free(t->pre[i].repl);
        if (t->pre[i].re) fl_tok_regex_free(t->pre[i].re);
    }
    free(t->pre);
    for (int i = 0; i < t->n_added; i++) free(t->added[i].s);
    free(t->added);
    for (int i = 0; i < t->n_dec; i++) free(t->dec[i].a), free(t->dec[i].b);
    free(t->dec);
    free(t);
}

static int fl_tok_added_cmp(const void *a, const void *b) {
    const fl_tok_added *x = a, *y = b;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

void fl_tok_finish_added(fl_tokenizer *t) {
    if (t->n_added) qsort(t->added, (size_t)t->n_added, sizeof *t->added, fl_tok_added_cmp);
    memset(t->added_first, 0, sizeof t->added_first);
    t->n_added_norm = 0;
    for (int i = 0; i < t->n_added; i++) {
        if (t->added[i].len) t->added_first[(unsigned char)t->added[i].s[0]] = 1;
        t->n_added_norm += t->added[i].normalized;
    }
}

static int fl_tok_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
static int fl_tok_wordc(unsigned char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c >= 0x80;
}

/* Leftmost-longest matching of the added tokens (HF's AddedVocabulary), with
 * lstrip / rstrip / single_word. */
fl_status fl_tok_split_added(const fl_tokenizer *t, const char *s, size_t n, int normalized, fl_tok_seg_fn fn, void *ctx,
                             int32_t **ids, size_t *n_ids, size_t *cap) {
    size_t seg = 0; /* start of the pending text segment */
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        const fl_tok_added *hit = NULL;
        if (t->added_first[u[i]])
            for (int k = 0; k < t->n_added; k++) {
                const fl_tok_added *a = &t->added[k];
                if (a->normalized != normalized || !a->len || a->len > n - i || memcmp(a->s, s + i, a->len)) continue;
                if (a->single_word && ((i > 0 && fl_tok_wordc(u[i - 1])) || (i + a->len < n && fl_tok_wordc(u[i + a->len]))))
                    continue;
                hit = a;
                break;
            }
        if (!hit) { i++; continue; }
        size_t ms = i, me = i + hit->len;
        if (hit->lstrip) while (ms > seg && fl_tok_ws(u[ms - 1])) ms--;
        if (hit->rstrip) while (me < n && fl_tok_ws(u[me])) me++;
        if (ms > seg) FL_TRY(fn(ctx, s + seg, ms - seg, seg == 0));
        if (fl_tok_ids_push(ids, n_ids, cap, hit->id)) return fl_errorf(FL_ERR_OOM, "tokenizer: out of memory");
        i = seg = me;
    }
    if (n > seg) FL_TRY(fn(ctx, s + seg, n - seg, seg == 0));
    return FL_OK;
}

typedef struct {
    const fl_tokenizer *t;
    fl_tok_work *w;
    int32_t **ids;
    size_t *n_ids, *cap;
} fl_tok_enc_ctx;

static fl_status fl_tok_enc_seg(void *vc, const char *s, size_t n, int at0) {
    fl_tok_enc_ctx *c = vc;
    return fl_tok_encode_segment(c->t, c->w, s, n, at0, c->ids, c->n_ids, c->cap);
}

fl_status fl_tok_encode(const fl_tokenizer *t, const char *text, size_t n, int bos, int eos, int32_t **ids,
                        size_t *n_ids) {
    if (!t || !ids || !n_ids || (!text && n)) return fl_errorf(FL_ERR_INVALID, "fl_tok_encode: NULL argument");
    *ids = NULL;
    *n_ids = 0;
    int32_t *out = NULL;
    size_t no = 0, cap = 0;
    int add_bos = bos < 0 ? t->add_bos : bos > 0, add_eos = eos < 0 ? t->add_eos : eos > 0;
    fl_status st = FL_OK;
    fl_tok_work *w = NULL;
    if (add_bos && t->bos_id >= 0 && fl_tok_ids_push(&out, &no, &cap, t->bos_id)) goto oom;
    if (t->kind == FL_TOK_BYTES) {
        for (size_t i = 0; i < n; i++)
            if (fl_tok_ids_push(&out, &no, &cap, (unsigned char)text[i])) goto oom;
    } else if (n) {
        if (!(w = fl_tok_work_new())) goto oom;
        fl_tok_enc_ctx c = {t, w, &out, &no, &cap};
        if (t->kind == FL_TOK_BPE_BL || t->kind == FL_TOK_BPE_SP || t->unigram)
            st = fl_tok_split_added(t, text, n, 0, fl_tok_enc_seg, &c, &out, &no, &cap);
        else st = fl_tok_enc_seg(&c, text, n, 1);
        fl_tok_work_free(w);
        if (st != FL_OK) { free(out); return st; }
    }
    if (add_eos && t->n_eos && fl_tok_ids_push(&out, &no, &cap, t->eos_ids[0])) goto oom;
    if (!out && !(out = malloc(sizeof *out))) goto oom;
    *ids = out;
    *n_ids = no;
    return FL_OK;
oom:
    free(out);
    return fl_errorf(FL_ERR_OOM, "tokenizer: out of memory encoding %zu bytes", n);
}

fl_status fl_tok_decode(const fl_tokenizer *t, const int32_t *ids, size_t n, int skip_special, char **text,
                        size_t *len) {
    if (!t || !text || (!ids && n)) return fl_errorf(FL_ERR_INVALID, "fl_tok_decode: NULL argument");
    return fl_tok_decode_impl(t, ids, n, skip_special, text, len);
}

int fl_tok_vocab_size(const fl_tokenizer *t) { return t ? t->n_vocab : 0; }
int fl_tok_bos_id(const fl_tokenizer *t) { return t ? t->bos_id : -1; }
int fl_tok_eos_id(const fl_tokenizer *t) { return t && t->n_eos ? t->eos_ids[0] : -1; }
int fl_tok_pad_id(const fl_tokenizer *t) { return t ? t->pad_id : -1; }
int fl_tok_is_eos(const fl_tokenizer *t, int32_t id) {
    for (int i = 0; t && i < t->n_eos; i++)
        if (t->eos_ids[i] == id) return 1;
    return 0;
}
const char *fl_tok_kind(const fl_tokenizer *t) {
    static const char *names[] = {"bytes", "bpe-bytelevel", "bpe-sentencepiece", "spm-model", "llama2c"};
    if (t && t->unigram) return t->kind == FL_TOK_SPM ? "spm-unigram" : "unigram";
    return t && t->kind >= 0 && t->kind <= FL_TOK_L2C ? names[t->kind] : "?";
}

fl_status fl_tok_builtin_bytes(fl_tokenizer **out) {
    if (!out) return fl_errorf(FL_ERR_INVALID, "fl_tok_builtin_bytes: NULL argument");
    *out = NULL;
    fl_tokenizer *t = fl_tok_new(FL_TOK_BYTES);
    if (!t) return fl_errorf(FL_ERR_OOM, "tokenizer: out of memory");
    fl_status st = FL_OK;
    for (int b = 0; b < 256 && st == FL_OK; b++) {
        char c = (char)b;
        st = fl_tok_set_piece(t, b, &c, 1);
    }
    if (st == FL_OK) st = fl_tok_set_piece(t, 256, "<bos>", 5);
    if (st == FL_OK) st = fl_tok_set_piece(t, 257, "<eos>", 5);
    if (st != FL_OK) { fl_tok_free(t); return st; }
    t->type[256] = t->type[257] = FL_SP_CONTROL;
    t->bos_id = 256;
    t->eos_ids[0] = 257;
    t->n_eos = 1;
    *out = t;
    return FL_OK;
}

/* ---- BOS / EOS from the side files -------------------------------------------------- */

/* A token given as a string or {"content": ...}; returns NULL if absent / null. */
static const char *fl_tok_token_str(const fl_json *j, int *is_null) {
    if (is_null) *is_null = j && j->type == FL_JSON_NULL;
    if (!j) return NULL;
    if (j->type == FL_JSON_STRING) return j->str;
    const fl_json *c = fl_json_get(j, "content");
    return c && c->type == FL_JSON_STRING ? c->str : NULL;
}

static void fl_tok_add_eos(fl_tokenizer *t, int32_t id, int front) {
    if (id < 0 || id >= t->n_vocab) return;
    for (int i = 0; i < t->n_eos; i++)
        if (t->eos_ids[i] == id) {
            if (front) { t->eos_ids[i] = t->eos_ids[0]; t->eos_ids[0] = id; }
            return;
        }
    if (t->n_eos == 8) return;
    if (front) {
        memmove(t->eos_ids + 1, t->eos_ids, (size_t)t->n_eos * sizeof(int32_t));
        t->eos_ids[0] = id;
    } else t->eos_ids[t->n_eos] = id;
    t->n_eos++;
}

static fl_status fl_tok_apply_side_files(fl_tokenizer *t, const char *dir) {
    char path[4200];
    fl_json *j = NULL;
    /* config.json: ids (eos may be a list) */
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (fl_tok_is_file(path)) {
        FL_TRY(fl_json_parse_file(path, &j));
        const fl_json *b = fl_json_get(j, "bos_token_id"), *e = fl_json_get(j, "eos_token_id"), *pd = fl_json_get(j, "pad_token_id");
        if (pd && pd->type == FL_JSON_NUMBER && pd->is_int && pd->i >= 0 && pd->i < t->n_vocab) t->pad_id = (int)pd->i;
        if (b && b->type == FL_JSON_NUMBER && b->is_int && b->i >= 0 && b->i < t->n_vocab) t->bos_id = (int)b->i;
        if (e && e->type == FL_JSON_NUMBER && e->is_int) fl_tok_add_eos(t, (int32_t)e->i, 1);
        if (e && e->type == FL_JSON_ARRAY) {
            int first = 1;
            for (const fl_json *c = e->child; c; c = c->next)
                if (c->type == FL_JSON_NUMBER && c->is_int) fl_tok_add_eos(t, (int32_t)c->i, first), first = 0;
        }
        fl_json_free(j);
        j = NULL;
    }
    static const char *names[] = {"special_tokens_map.json", "tokenizer_config.json"};
    for (int f = 0; f < 2; f++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[f]);
        if (!fl_tok_is_file(path)) continue;
        FL_TRY(fl_json_parse_file(path, &j));
        if (j->type != FL_JSON_OBJECT) {
            fl_json_free(j);
            return fl_errorf(FL_ERR_FORMAT, "%s: expected a JSON object", path);
        }
        int isnull;
        const char *bs = fl_tok_token_str(fl_json_get(j, "bos_token"), &isnull);
        if (bs) {
            int32_t id = fl_tok_lookup(t, bs, strlen(bs));
            if (id >= 0) t->bos_id = id;
        } else if (isnull) t->bos_id = -1;
        const char *es = fl_tok_token_str(fl_json_get(j, "eos_token"), NULL);
        const char *ps = fl_tok_token_str(fl_json_get(j, "pad_token"), NULL);
        int32_t pid = ps ? fl_tok_lookup(t, ps, strlen(ps)) : -1;
        if (pid >= 0) t->pad_id = pid;
        if (es) fl_tok_add_eos(t, fl_tok_lookup(t, es, strlen(es)), 1);
        const fl_json *ab = fl_json_get(j, "add_bos_token"), *ae = fl_json_get(j, "add_eos_token");
        if (ab && ab->type == FL_JSON_BOOL) t->add_bos = ab->b;
        if (ae && ae->type == FL_JSON_BOOL) t->add_eos = ae->b;
        fl_json_free(j);
        j = NULL;
    }
    return FL_OK;
}

/* A Unigram .model loaded as T5Tokenizer loads spiece.model: tokenizer_config.json's "extra_ids"
 * sentinels (default 100, as T5Tokenizer) follow the pieces. */
static fl_status fl_tok_t5_extra_ids(fl_tokenizer *t, const char *dir) {
    char path[4200];
    int n = 100;
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    if (fl_tok_is_file(path)) {
        fl_json *j = NULL;
        FL_TRY(fl_json_parse_file(path, &j));
        const fl_json *e = fl_json_get(j, "extra_ids");
        if (e && (e->type != FL_JSON_NUMBER || !e->is_int || e->i < 0 || e->i > 10000)) {
            fl_json_free(j);
            return fl_errorf(FL_ERR_FORMAT, "%s: \"extra_ids\" must be an integer in [0, 10000]", path);
        }
        if (e) n = (int)e->i;
        fl_json_free(j);
    }
    return fl_tok_spm_add_extra_ids(t, n);
}

/* ---- loading -------------------------------------------------------------------------- */

static int fl_tok_ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

static fl_status fl_tok_load_file(fl_tokenizer **out, const char *path) {
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    if (fl_tok_ends_with(base, ".json")) {
        if (!strcmp(base, "tokenizer_config.json") || !strcmp(base, "config.json") ||
            !strcmp(base, "special_tokens_map.json"))
            return fl_errorf(FL_ERR_INVALID, "%s: this is not a tokenizer; pass tokenizer.json or the model folder", path);
        fl_json *j = NULL;
        FL_TRY(fl_json_parse_file(path, &j));
        fl_status s = fl_tok_load_hf_json(out, j, path);
        fl_json_free(j);
        return s;
    }
    if (fl_tok_ends_with(base, ".model")) return fl_tok_load_spm(out, path);
    if (fl_tok_ends_with(base, ".bin")) return fl_tok_load_llama2c(out, path);
    return fl_errorf(FL_ERR_UNSUPPORTED, "%s: unknown tokenizer file type (expected tokenizer.json, tokenizer.model, spiece.model or a llama2.c tok*.bin)", path);
}

fl_status fl_tok_load(fl_tokenizer **out, const char *path) {
    if (!out || !path) return fl_errorf(FL_ERR_INVALID, "fl_tok_load: NULL argument");
    *out = NULL;
    char dir[4096], file[4400];
    if (strlen(path) >= sizeof dir - 64) return fl_errorf(FL_ERR_INVALID, "%s: path too long", path);
    if (fl_tok_is_dir(path)) {
        snprintf(dir, sizeof dir, "%s", path);
        static const char *cands[] = {"tokenizer.json", "tokenizer.model", "spiece.model", "tokenizer.bin"};
        file[0] = 0;
        for (int i = 0; i < 4 && !file[0]; i++) {
            snprintf(file, sizeof file, "%s/%s", dir, cands[i]);
            if (!fl_tok_is_file(file)) file[0] = 0;
        }
        if (!file[0]) { /* llama2.c: tok*.bin */
            DIR *d = opendir(dir);
            struct dirent *e;
            while (d && (e = readdir(d)))
                if (!strncmp(e->d_name, "tok", 3) && fl_tok_ends_with(e->d_name, ".bin")) {
                    snprintf(file, sizeof file, "%s/%s", dir, e->d_name);
                    break;
                }
            if (d) closedir(d);
        }
        if (!file[0])
            return fl_errorf(FL_ERR_NOT_FOUND, "%s: no tokenizer found (tokenizer.json, tokenizer.model, spiece.model or tok*.bin)", path);
    } else {
        if (!fl_tok_is_file(path)) return fl_errorf(FL_ERR_NOT_FOUND, "%s: no such tokenizer file or folder", path);
        snprintf(file, sizeof file, "%s", path);
        const char *sl = strrchr(path, '/');
        if (sl) snprintf(dir, sizeof dir, "%.*s", (int)(sl - path), path);
        else snprintf(dir, sizeof dir, ".");
        if (!dir[0]) snprintf(dir, sizeof dir, "/");
    }
    fl_tokenizer *t = NULL;
    FL_TRY(fl_tok_load_file(&t, file));
    fl_status s = t->unigram && t->kind == FL_TOK_SPM ? fl_tok_t5_extra_ids(t, dir) : FL_OK;
    if (s == FL_OK) s = fl_tok_apply_side_files(t, dir);
    if (s != FL_OK) { fl_tok_free(t); return s; }
    *out = t;
    return FL_OK;
}

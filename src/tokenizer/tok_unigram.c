/* fitllm tokenizers: the SentencePiece Unigram model (T5, Flan-T5, ALBERT-style vocabularies).
 *
 * Encoding is the best segmentation by summed piece score (Viterbi over a lattice built on
 * the fly from a byte trie of the pieces), exactly as sentencepiece's EncodeOptimized and HF
 * tokenizers' Unigram::encode_optimized walk it: start positions in order, pieces from one
 * start by increasing length, a candidate replaces the best path into its end only when
 * strictly better (so ties keep the earlier start), and a character no one-char piece covers
 * gets an <unk> node scored min_score - 10. Consecutive <unk> nodes are fused into one <unk>;
 * with byte_fallback an <unk> becomes the <0xNN> pieces of its bytes.
 * The two references differ in three details, kept apart by flags:
 *   - sentencepiece sums path scores in float, HF in double (uni_f32);
 *   - sentencepiece's lattice holds NORMAL and USER_DEFINED pieces (the latter with the bonus
 *     length * max_score - 0.1), and min_score is over NORMAL pieces; HF's holds every vocab
 *     entry and takes the min over all scores;
 *   - sentencepiece runs on the whole normalized text; HF on each pre-token (T5: split on
 *     whitespace, then Metaspace).
 * The precompiled charsmap (normalizer_spec.precompiled_charsmap, HF's "Precompiled") is a
 * darts-clone double array over UTF-8 sources whose values index NUL-terminated replacements;
 * at each position the longest source wins, else the char is copied (sentencepiece turns an
 * invalid byte into U+FFFD). */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <math.h>
#include <pcre2.h>
#include <stdlib.h>
#include <string.h>

#include "tok-impl.h"

static fl_status uoom(const char *src) { return fl_errorf(FL_ERR_OOM, "%s: out of memory", src ? src : "tokenizer"); }

/* ---- UTF-8 / whitespace ------------------------------------------------------------------ */

uint32_t fl_tok_utf8_cp(const unsigned char *s, size_t n, int *len) {
    int l = fl_tok_utf8_len(s, n);
    *len = l;
    if (l == 1) return s[0] < 0x80 ? s[0] : 0xFFFFFFFFu;
    uint32_t cp = s[0] & (0x3F >> (l - 1));
    for (int i = 1; i < l; i++) cp = (cp << 6) | (s[i] & 0x3F);
    return cp;
}

int fl_tok_is_uspace(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
           c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

/* ---- precompiled charsmap ---------------------------------------------------------------- */

fl_status fl_tok_charsmap_set(fl_tokenizer *t, const uint8_t *b, size_t n, const char *src) {
    if (n == 0) return FL_OK; /* no charsmap: identity */
    if (n < 4) return fl_errorf(FL_ERR_FORMAT, "%s: precompiled_charsmap is %zu bytes (truncated: no trie size)", src, n);
    uint32_t ts = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
    if (ts % 4 || ts > n - 4)
        return fl_errorf(FL_ERR_FORMAT, "%s: precompiled_charsmap: trie size %u does not fit in %zu bytes (corrupt)", src, ts, n);
    t->cm_n = ts / 4;
    t->cm_str_n = n - 4 - ts;
    t->cm_units = malloc(ts ? ts : 4);
    t->cm_str = malloc(t->cm_str_n + 1);
    if (!t->cm_units || !t->cm_str) return uoom(src);
    for (size_t i = 0; i < t->cm_n; i++) {
        const uint8_t *u = b + 4 + 4 * i;
        t->cm_units[i] = (uint32_t)u[0] | (uint32_t)u[1] << 8 | (uint32_t)u[2] << 16 | (uint32_t)u[3] << 24;
    }
    memcpy(t->cm_str, b + 4 + ts, t->cm_str_n);
    t->cm_str[t->cm_str_n] = 0; /* a corrupt blob cannot run a replacement off the end */
    return FL_OK;
}

/* Longest (first: shortest) charsmap source at s: returns its length (0 = none) and the replacement. */
static size_t cm_match(const fl_tokenizer *t, const unsigned char *s, size_t n, int first, const char **rep, size_t *rep_n) {
    const uint32_t *a = t->cm_units;
    size_t N = t->cm_n, best = 0;
    if (!N) return 0;
#define CM_OFFSET(u) (((u) >> 10) << (((u) & (1u << 9)) >> 6))
    size_t pos = CM_OFFSET(a[0]);
    for (size_t i = 0; i < n; i++) {
        pos ^= s[i];
        if (pos >= N) break;
        uint32_t u = a[pos];
        if ((u & ((1u << 31) | 0xFF)) != s[i]) break; /* label */
        pos ^= CM_OFFSET(u);
        if ((u >> 8) & 1) { /* has leaf: value in the unit at pos */
            if (pos >= N) break;
            uint32_t v = a[pos] & 0x7FFFFFFFu;
            if (v >= t->cm_str_n) break;
            best = i + 1;
            *rep = t->cm_str + v;
            if (first) break;
        }
    }
#undef CM_OFFSET
    if (best) *rep_n = strlen(*rep);
    return best;
}

/* HF's Precompiled (spm_precompiled::normalize_string) goes by extended grapheme cluster, not by
 * longest match: a cluster under 6 bytes whose *shortest* charsmap prefix matches is replaced whole
 * by that prefix's replacement (the rest of the cluster is dropped); otherwise each char of the
 * cluster is replaced by its shortest-prefix match, or kept. This differs from sentencepiece on
 * combining sequences and Hangul jamo runs; both are followed exactly (clusters from PCRE2's \X;
 * an invalid byte, which HF never sees, is its own cluster and kept). */
int fl_tok_charsmap_normalize(const fl_tokenizer *t, const char *s, size_t n, fl_tok_buf *out) {
    const unsigned char *u = (const unsigned char *)s;
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    int bad = !md || fl_tok_buf_put(out, "", 0);
    for (size_t i = 0; i < n && !bad;) {
        size_t g = 1; /* cluster length */
        /* match in a window (pcre2_match checks the UTF-8 of its whole subject on every call: a window
         * keeps a long text linear); a cluster reaching the window's end is matched again in a wider one */
        for (size_t w = 64;; w *= 4) {
            size_t wn = n - i < w ? n - i : w;
            int rc = pcre2_match((pcre2_code *)t->grapheme_re, (PCRE2_SPTR)(s + i), wn, 0, PCRE2_ANCHORED, md, NULL);
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            if (rc > 0 && ov[1] > 0) g = ov[1];
            if (rc <= 0 || ov[1] < wn || wn == n - i) break;
        }
        const char *rep;
        size_t rn;
        if (g < 6 && cm_match(t, u + i, g, 1, &rep, &rn)) {
            bad = fl_tok_buf_put(out, rep, rn);
        } else {
            for (size_t k = i; k < i + g && !bad;) {
                size_t l = (size_t)fl_tok_utf8_len(u + k, i + g - k);
                bad = cm_match(t, u + k, l, 1, &rep, &rn) ? fl_tok_buf_put(out, rep, rn) : fl_tok_buf_put(out, s + k, l);
                k += l;
            }
        }
        i += g;
    }
    pcre2_match_data_free(md);
    return bad;
}

/* sentencepiece's NormalizePrefix: the replacement of the longest source at s, else the char,
 * else (invalid UTF-8) U+FFFD for one byte. Returns bytes consumed. */
static size_t spm_prefix(const fl_tokenizer *t, const unsigned char *s, size_t n, const char **rep, size_t *rn) {
    size_t m = cm_match(t, s, n, 0, rep, rn);
    if (m) return m;
    int l = fl_tok_utf8_len(s, n);
    if (l == 1 && s[0] >= 0x80) { *rep = "\xef\xbf\xbd"; *rn = 3; return 1; }
    *rep = (const char *)s;
    *rn = (size_t)l;
    return (size_t)l;
}

/* ---- trie ------------------------------------------------------------------------------------ */

static int32_t trie_child(const fl_tok_trie *tr, int32_t node, unsigned char c) {
    if (!tr->mask) return -1;
    uint64_t k = (uint64_t)node << 8 | c, h = k * 0x9E3779B97F4A7C15ULL;
    for (uint32_t i = (uint32_t)(h >> 32) & tr->mask;; i = (i + 1) & tr->mask) {
        if (tr->key[i] == UINT64_MAX) return -1;
        if (tr->key[i] == k) return tr->child[i];
    }
}

static int trie_insert(fl_tok_trie *tr, const unsigned char *s, size_t n, int32_t id) {
    int32_t node = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t c = trie_child(tr, node, s[i]);
        if (c < 0) {
            if (tr->n_nodes == tr->cap_nodes) {
                int32_t nc = tr->cap_nodes * 2;
                int32_t *p = realloc(tr->piece, (size_t)nc * sizeof *p);
                if (!p) return -1;
                tr->piece = p, tr->cap_nodes = nc;
            }
            c = tr->n_nodes++;
            tr->piece[c] = -1;
            uint64_t k = (uint64_t)node << 8 | s[i], h = k * 0x9E3779B97F4A7C15ULL;
            uint32_t j = (uint32_t)(h >> 32) & tr->mask;
            while (tr->key[j] != UINT64_MAX) j = (j + 1) & tr->mask;
            tr->key[j] = k, tr->child[j] = c, tr->n_edges++;
        }
        node = c;
    }
    if (tr->piece[node] < 0) tr->piece[node] = id; /* duplicates: the first id wins (HF, sentencepiece) */
    return 0;
}

fl_status fl_tok_unigram_finish(fl_tokenizer *t, int hf, const char *src) {
    double mn = INFINITY, mx = -INFINITY;
    size_t bytes = 1;
    for (int32_t i = 0; i < t->uni_n; i++) {
        size_t l;
        if (!fl_tok_piece(t, i, &l) || isnan(t->uscore[i])) continue;
        bytes += l;
        if (hf || t->type[i] == FL_SP_NORMAL) mn = fmin(mn, t->uscore[i]), mx = fmax(mx, t->uscore[i]);
    }
    if (!isfinite(mn)) mn = mx = 0;
    t->max_score = mx;
    t->unk_score = hf ? mn - 10.0 : (double)((float)mn - 10.0f);
    t->uni_f32 = !hf;
    t->unigram = 1;
    fl_tok_trie *tr = &t->trie;
    uint32_t cap = 64;
    while (cap < 2 * bytes) cap *= 2;
    tr->key = malloc(cap * sizeof *tr->key);
    tr->child = malloc(cap * sizeof *tr->child);
    tr->piece = malloc(64 * sizeof *tr->piece);
    if (!tr->key || !tr->child || !tr->piece) return uoom(src);
    memset(tr->key, 0xFF, cap * sizeof *tr->key);
    tr->mask = cap - 1;
    tr->cap_nodes = 64, tr->n_nodes = 1, tr->piece[0] = -1;
    for (int32_t i = 0; i < t->uni_n; i++) {
        size_t l;
        const char *p = fl_tok_piece(t, i, &l);
        if (!p || !l || isnan(t->uscore[i])) continue;
        if (!hf && t->type[i] != FL_SP_NORMAL && t->type[i] != FL_SP_USER_DEFINED && t->type[i] != FL_SP_UNUSED) continue;
        if (trie_insert(tr, (const unsigned char *)p, l, i)) return uoom(src);
    }
    return FL_OK;
}

/* ---- Viterbi ---------------------------------------------------------------------------------- */

typedef struct {
    double score;
    int32_t start, id; /* start -1: unreached */
} uni_node;

/* 0 ok, -1 out of memory, 1 no unk id */
static int emit_unk(const fl_tokenizer *t, const unsigned char *s, size_t n, int32_t **ids, size_t *n_ids, size_t *cap) {
    if (t->unk_id < 0) return 1;
    if (!t->byte_fallback) return fl_tok_ids_push(ids, n_ids, cap, t->unk_id) ? -1 : 0;
    for (size_t i = 0; i < n; i++) {
        int32_t b = t->byte_id[s[i]];
        if (fl_tok_ids_push(ids, n_ids, cap, b >= 0 ? b : t->unk_id)) return -1;
    }
    return 0;
}

fl_status fl_tok_unigram_word(const fl_tokenizer *t, const char *str, size_t n, int32_t **ids, size_t *n_ids, size_t *cap) {
    if (n == 0) return FL_OK;
    const unsigned char *s = (const unsigned char *)str;
    uni_node *best = malloc((n + 1) * sizeof *best);
    int32_t *path = malloc((n + 1) * sizeof *path);
    if (!best || !path) { free(best); free(path); return uoom(NULL); }
    for (size_t i = 0; i <= n; i++) best[i].start = -1, best[i].score = 0, best[i].id = -1;
    best[0].start = 0;
    const fl_tok_trie *tr = &t->trie;
    for (size_t st = 0; st < n;) {
        size_t mb = (size_t)fl_tok_utf8_len(s + st, n - st);
        double here = best[st].score;
        int single = 0;
        int32_t node = 0;
        for (size_t k = st; k < n; k++) {
            if ((node = trie_child(tr, node, s[k])) < 0) break;
            int32_t id = tr->piece[node];
            if (id < 0) continue;
            int ty = t->type[id];
            if (t->uni_f32 && ty == FL_SP_UNUSED) continue;
            size_t len = k + 1 - st;
            double sc;
            if (!t->uni_f32) sc = t->uscore[id] + here;
            else if (ty == FL_SP_USER_DEFINED) /* sentencepiece: length * max_score_ - 0.1 in double, stored as float */
                sc = (double)(float)((double)((float)len * (float)t->max_score) - 0.1 + here);
            else sc = (double)((float)t->uscore[id] + (float)here);
            uni_node *tg = &best[k + 1];
            if (tg->start < 0 || sc > tg->score) tg->score = sc, tg->start = (int32_t)st, tg->id = id;
            if (len == mb) single = 1;
        }
        if (!single) {
            double sc = t->uni_f32 ? (double)((float)t->unk_score + (float)here) : t->unk_score + here;
            uni_node *tg = &best[st + mb];
            if (tg->start < 0 || sc > tg->score) tg->score = sc, tg->start = (int32_t)st, tg->id = -2;
        }
        st += mb;
    }
    /* backtrack into path[] (end positions, reversed), then emit forward fusing unk runs */
    size_t np = 0;
    for (size_t e = n; e > 0; e = (size_t)best[e].start) path[np++] = (int32_t)e;
    int bad = 0;
    for (size_t k = np; k-- > 0 && !bad;) {
        size_t e = (size_t)path[k], b = (size_t)best[e].start;
        int32_t id = best[e].id;
        if (id == -2 || id == t->unk_id) {
            size_t e2 = e;
            while (k > 0 && (best[path[k - 1]].id == -2 || best[path[k - 1]].id == t->unk_id)) e2 = (size_t)path[--k];
            bad = emit_unk(t, s + b, e2 - b, ids, n_ids, cap);
        } else bad = fl_tok_ids_push(ids, n_ids, cap, id) ? -1 : 0;
    }
    free(best);
    free(path);
    if (bad == 1) return fl_errorf(FL_ERR_INVALID, "tokenizer: the text has a character no Unigram piece covers and the model has no unk_id");
    return bad ? uoom(NULL) : FL_OK;
}

/* sentencepiece Normalizer::Normalize, then one Viterbi pass over the whole text. */
fl_status fl_tok_encode_spm_unigram(const fl_tokenizer *t, const char *str, size_t n, int32_t **ids, size_t *n_ids,
                                    size_t *cap) {
    const unsigned char *s = (const unsigned char *)str;
    const char *ws = t->spm_escape_ws ? "\xe2\x96\x81" : " ";
    size_t wl = strlen(ws), i = 0, rn, c;
    const char *rep;
    if (t->spm_remove_extra_ws)
        while (i < n && (c = spm_prefix(t, s + i, n - i, &rep, &rn)) && rn == 1 && rep[0] == ' ') i += c;
    if (i >= n) return FL_OK;
    fl_tok_buf b = {0};
    int bad = fl_tok_buf_put(&b, "", 0);
    if (t->spm_dummy_prefix) bad |= fl_tok_buf_put(&b, ws, wl);
    int prev_space = t->spm_remove_extra_ws;
    while (i < n && !bad) {
        c = spm_prefix(t, s + i, n - i, &rep, &rn);
        if (prev_space)
            while (rn && rep[0] == ' ') rep++, rn--;
        if (rn) {
            for (size_t k = 0; k < rn && !bad; k++)
                bad = rep[k] == ' ' && t->spm_escape_ws ? fl_tok_buf_put(&b, ws, wl) : fl_tok_buf_put(&b, rep + k, 1);
            prev_space = rep[rn - 1] == ' ';
        }
        i += c;
        if (!t->spm_remove_extra_ws) prev_space = 0;
    }
    if (t->spm_remove_extra_ws)
        while (!bad && b.n >= wl && !memcmp(b.p + b.n - wl, ws, wl)) b.n -= wl;
    fl_status st = bad ? uoom(NULL) : fl_tok_unigram_word(t, b.p, b.n, ids, n_ids, cap);
    free(b.p);
    return st;
}

/* ---- tokenizer.json "Unigram" ------------------------------------------------------------------- */

fl_status fl_tok_load_unigram_vocab(fl_tokenizer *t, const fl_json *model, const char *src) {
    const fl_json *v = fl_json_get(model, "vocab");
    if (!v || v->type != FL_JSON_ARRAY)
        return fl_errorf(FL_ERR_FORMAT, "%s: model.vocab of a Unigram model must be an array of [piece, score] pairs", src);
    if (v->len == 0) return fl_errorf(FL_ERR_FORMAT, "%s: model.vocab of a Unigram model is empty", src);
    if (v->len > (1u << 26)) return fl_errorf(FL_ERR_FORMAT, "%s: model.vocab has too many entries", src);
    t->uscore = malloc(v->len * sizeof *t->uscore);
    if (!t->uscore) return uoom(src);
    int32_t id = 0;
    for (const fl_json *c = v->child; c; c = c->next, id++) {
        const fl_json *p = c->type == FL_JSON_ARRAY && c->len == 2 ? c->child : NULL;
        if (!p || p->type != FL_JSON_STRING || p->next->type != FL_JSON_NUMBER || !isfinite(p->next->num))
            return fl_errorf(FL_ERR_FORMAT, "%s: model.vocab[%d] must be a [piece (string), score (finite number)] pair", src, (int)id);
        FL_TRY(fl_tok_set_piece(t, id, p->str, p->len));
        t->uscore[id] = p->next->num;
    }
    t->uni_n = id;
    const fl_json *u = fl_json_get(model, "unk_id");
    t->unk_id = -1;
    if (u && u->type != FL_JSON_NULL) {
        if (u->type != FL_JSON_NUMBER || !u->is_int || u->i < 0 || u->i >= (int64_t)v->len)
            return fl_errorf(FL_ERR_FORMAT, "%s: model.unk_id must be an id in [0, %zu)", src, v->len);
        t->unk_id = (int32_t)u->i;
    }
    const fl_json *bf = fl_json_get(model, "byte_fallback");
    t->byte_fallback = bf && bf->type == FL_JSON_BOOL && bf->b;
    t->fuse_unk = 1;
    return FL_OK;
}

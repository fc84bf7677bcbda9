/* fitllm tokenizers: decoding. Ids -> pieces -> the HF decoder chain
 * (Replace, ByteFallback, Fuse, Strip, ByteLevel, Metaspace), step by step as
 * HF tokenizers applies it to the list of token strings. SentencePiece .model
 * and llama2.c tokenizers use the chain HF's LLaMA conversion writes. */
#include <stdlib.h>
#include <string.h>

#include "tok-impl.h"

typedef struct {
    fl_tok_buf *tok;
    size_t n, cap;
} fl_tok_list;

static void fl_tok_list_free(fl_tok_list *l) {
    for (size_t i = 0; i < l->n; i++) free(l->tok[i].p);
    free(l->tok);
    l->tok = NULL;
    l->n = l->cap = 0;
}

static int fl_tok_list_add(fl_tok_list *l, const char *s, size_t n) {
    if (l->n == l->cap) {
        size_t nc = l->cap ? l->cap * 2 : 16;
        fl_tok_buf *p = realloc(l->tok, nc * sizeof *p);
        if (!p) return -1;
        l->tok = p;
        l->cap = nc;
    }
    fl_tok_buf b = {0};
    if (fl_tok_buf_put(&b, s, n)) return -1;
    l->tok[l->n++] = b;
    return 0;
}

/* Length of the maximal invalid subpart at s (Unicode / Rust from_utf8_lossy). */
static size_t fl_tok_invalid_span(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    size_t need;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) need = 2;
    else if (c >= 0xE0 && c <= 0xEF) need = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    else if (c >= 0xF0 && c <= 0xF4) need = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    else return 1;
    size_t k = 1;
    if (k < n && s[k] >= lo && s[k] <= hi) {
        k++;
        while (k < need && k < n && (s[k] & 0xC0) == 0x80) k++;
    }
    return k;
}

/* Append s[0..n) to b, replacing invalid UTF-8 by U+FFFD per maximal subpart. */
static int fl_tok_put_lossy(fl_tok_buf *b, const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, run = 0;
    while (i < n) {
        int l = fl_tok_utf8_len(u + i, n - i);
        if (l > 1 || u[i] < 0x80) { i += (size_t)l; continue; }
        if (fl_tok_buf_put(b, s + run, i - run) || fl_tok_buf_put(b, "\xef\xbf\xbd", 3)) return -1;
        i += fl_tok_invalid_span(u + i, n - i);
        run = i;
    }
    return fl_tok_buf_put(b, s + run, n - run);
}

static int fl_tok_utf8_valid(const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        int l = fl_tok_utf8_len((const unsigned char *)s + i, n - i);
        if (l == 1 && (unsigned char)s[i] >= 0x80) return 0;
        i += (size_t)l;
    }
    return 1;
}

static int fl_tok_hexv(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int fl_tok_is_byte_token(const fl_tok_buf *b, unsigned char *v) {
    if (b->n != 6 || memcmp(b->p, "<0x", 3) || b->p[5] != '>') return 0;
    int h = fl_tok_hexv(b->p[3]), l = fl_tok_hexv(b->p[4]);
    if (h < 0 || l < 0) return 0;
    *v = (unsigned char)(h * 16 + l);
    return 1;
}

/* One decoder step: in -> out (in is consumed). */
static int fl_tok_dec_step(const fl_tokenizer *t, const fl_tok_dec *d, fl_tok_list *in, fl_tok_list *out) {
    switch (d->type) {
    case FL_DEC_REPLACE:
    case FL_DEC_METASPACE: {
        const char *pat = d->a;
        const char *rep = d->type == FL_DEC_REPLACE ? d->b : " ";
        size_t pl = strlen(pat), rl = strlen(rep);
        for (size_t k = 0; k < in->n; k++) {
            fl_tok_buf b = {0}, *s = &in->tok[k];
            if (fl_tok_buf_put(&b, "", 0)) return -1;
            size_t run = 0;
            for (size_t i = 0; i < s->n;) {
                if (pl && i + pl <= s->n && !memcmp(s->p + i, pat, pl)) {
                    int drop = d->type == FL_DEC_METASPACE && k == 0 && d->prepend;
                    if (fl_tok_buf_put(&b, s->p + run, i - run) || (!drop && fl_tok_buf_put(&b, rep, rl))) return free(b.p), -1;
                    i += pl;
                    run = i;
                } else i++;
            }
            if (fl_tok_buf_put(&b, s->p + run, s->n - run)) return free(b.p), -1;
            if (fl_tok_list_add(out, "", 0)) return free(b.p), -1;
            free(out->tok[out->n - 1].p);
            out->tok[out->n - 1] = b;
        }
        return 0;
    }
    case FL_DEC_BYTEFALLBACK: {
        fl_tok_buf bytes = {0};
        size_t nb = 0;
        for (size_t k = 0; k <= in->n; k++) {
            unsigned char v;
            if (k < in->n && fl_tok_is_byte_token(&in->tok[k], &v)) {
                if (fl_tok_buf_put(&bytes, &v, 1)) return free(bytes.p), -1;
                nb++;
                continue;
            }
            if (nb) {
                if (fl_tok_utf8_valid(bytes.p, bytes.n)) {
                    if (fl_tok_list_add(out, bytes.p, bytes.n)) return free(bytes.p), -1;
                } else
                    for (size_t r = 0; r < nb; r++)
                        if (fl_tok_list_add(out, "\xef\xbf\xbd", 3)) return free(bytes.p), -1;
                bytes.n = 0;
                nb = 0;
            }
            if (k < in->n && fl_tok_list_add(out, in->tok[k].p, in->tok[k].n)) return free(bytes.p), -1;
        }
        free(bytes.p);
        return 0;
    }
    case FL_DEC_FUSE: {
        fl_tok_buf b = {0};
        if (fl_tok_buf_put(&b, "", 0)) return -1;
        for (size_t k = 0; k < in->n; k++)
            if (fl_tok_buf_put(&b, in->tok[k].p, in->tok[k].n)) return free(b.p), -1;
        int r = fl_tok_list_add(out, b.p, b.n);
        free(b.p);
        return r;
    }
    case FL_DEC_STRIP: {
        size_t cl = strlen(d->a);
        for (size_t k = 0; k < in->n; k++) {
            const char *p = in->tok[k].p;
            size_t n = in->tok[k].n;
            for (int i = 0; i < d->start && cl && n >= cl && !memcmp(p, d->a, cl); i++) p += cl, n -= cl;
            for (int i = 0; i < d->stop && cl && n >= cl && !memcmp(p + n - cl, d->a, cl); i++) n -= cl;
            if (fl_tok_list_add(out, p, n)) return -1;
        }
        return 0;
    }
    case FL_DEC_BYTELEVEL: {
        fl_tok_buf raw = {0}, b = {0};
        if (fl_tok_buf_put(&raw, "", 0) || fl_tok_buf_put(&b, "", 0)) return free(raw.p), free(b.p), -1;
        for (size_t k = 0; k < in->n; k++) {
            const unsigned char *u = (const unsigned char *)in->tok[k].p;
            size_t n = in->tok[k].n, start = raw.n;
            int ok = 1;
            for (size_t i = 0; i < n && ok;) {
                int l = fl_tok_utf8_len(u + i, n - i);
                unsigned cp = l == 1 ? u[i] : l == 2 ? ((u[i] & 0x1Fu) << 6 | (u[i + 1] & 0x3Fu)) : 0xFFFF;
                if (l == 1 && u[i] >= 0x80) cp = 0xFFFF;
                if (cp >= 512 || t->u2b[cp] < 0) { ok = 0; break; }
                unsigned char c = (unsigned char)t->u2b[cp];
                if (fl_tok_buf_put(&raw, &c, 1)) return free(raw.p), free(b.p), -1;
                i += (size_t)l;
            }
            if (!ok) { /* not byte-level text (e.g. an added token): its own bytes */
                raw.n = start;
                if (fl_tok_buf_put(&raw, in->tok[k].p, n)) return free(raw.p), free(b.p), -1;
            }
        }
        int r = fl_tok_put_lossy(&b, raw.p, raw.n) || fl_tok_list_add(out, b.p, b.n);
        free(raw.p);
        free(b.p);
        return r;
    }
    }
    return -1;
}

fl_status fl_tok_decode_impl(const fl_tokenizer *t, const int32_t *ids, size_t n, int skip_special, char **text,
                             size_t *len) {
    *text = NULL;
    if (len) *len = 0;
    fl_tok_list a = {0}, b = {0};
    fl_tok_buf res = {0};
    if (fl_tok_buf_put(&res, "", 0)) goto oom;
    for (size_t i = 0; i < n; i++) { /* unknown ids are skipped, as HF does */
        size_t pl;
        const char *p = fl_tok_piece(t, ids[i], &pl);
        if (!p) continue;
        uint8_t ty = t->type[ids[i]];
        if (skip_special && (ty == FL_SP_CONTROL || (t->kind == FL_TOK_SPM && ty == FL_SP_UNKNOWN))) continue;
        if (t->kind == FL_TOK_BYTES) {
            if (fl_tok_buf_put(&res, p, pl)) goto oom;
            continue;
        }
        if (t->kind == FL_TOK_L2C && pl > 2 && p[0] == '\n' && p[pl - 1] == '\n' && ty == FL_SP_CONTROL) p++, pl -= 2;
        if (fl_tok_list_add(&a, p, pl)) goto oom;
    }
    if (t->kind != FL_TOK_BYTES) {
        for (int k = 0; k < t->n_dec; k++) {
            if (fl_tok_dec_step(t, &t->dec[k], &a, &b)) goto oom;
            fl_tok_list_free(&a);
            a = b;
            memset(&b, 0, sizeof b);
        }
        for (size_t k = 0; k < a.n; k++)
            if ((t->dec_join_space && k && fl_tok_buf_put(&res, " ", 1)) || fl_tok_buf_put(&res, a.tok[k].p, a.tok[k].n))
                goto oom;
    }
    fl_tok_list_free(&a);
    *text = res.p;
    if (len) *len = res.n;
    return FL_OK;
oom:
    fl_tok_list_free(&a);
    fl_tok_list_free(&b);
    free(res.p);
    return fl_errorf(FL_ERR_OOM, "tokenizer: out of memory decoding %zu ids", n);
}

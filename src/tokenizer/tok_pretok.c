/* fitllm tokenizers: front ends. HF normalizers (Prepend, Replace) and
 * pre-tokenizers (ByteLevel with the GPT-2 regex, Metaspace, Split) with PCRE2;
 * SentencePiece .model normalization (dummy prefix, whitespace escaping,
 * extra-whitespace removal); llama2.c's dummy prefix. Each word then goes
 * through the BPE engine. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdlib.h>
#include <string.h>

#include "tok-impl.h"

void fl_tok_bytelevel_tables(fl_tokenizer *t) {
    int n = 0;
    for (int i = 0; i < 512; i++) t->u2b[i] = -1;
    for (int b = 0; b < 256; b++) {
        int keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        t->b2u[b] = (uint16_t)(keep ? b : 256 + n++);
        t->u2b[t->b2u[b]] = (int16_t)b;
    }
    for (int b = 0; b < 256; b++) { /* id of the one-char piece of each byte */
        char tmp[2];
        uint16_t cp = t->b2u[b];
        size_t l = 0;
        if (cp < 0x80) tmp[l++] = (char)cp;
        else tmp[l++] = (char)(0xC0 | (cp >> 6)), tmp[l++] = (char)(0x80 | (cp & 0x3F));
        t->bl_id[b] = fl_tok_lookup(t, tmp, l);
    }
}

fl_status fl_tok_regex_compile(const char *pattern, size_t n, const char *src, void **out) {
    int err;
    PCRE2_SIZE off;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, n, PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &off, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return fl_errorf(FL_ERR_FORMAT, "%s: regex /%.*s/ does not compile at offset %zu: %s", src, (int)(n > 200 ? 200 : n),
                         pattern, (size_t)off, (const char *)msg);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* best effort: falls back to the interpreter */
    *out = re;
    return FL_OK;
}

void fl_tok_regex_free(void *re) { pcre2_code_free((pcre2_code *)re); }

/* ---- HF pipeline -------------------------------------------------------------------- */

typedef struct {
    const fl_tokenizer *t;
    fl_tok_work *w;
    pcre2_match_data *md;
    int32_t **ids;
    size_t *n_ids, *cap;
} fl_tok_ctx;

static fl_status fl_tok_pre_run(fl_tok_ctx *c, int step, const char *s, size_t n, int at0);

static fl_status fl_tok_oom(void) { return fl_errorf(FL_ERR_OOM, "tokenizer: out of memory"); }

/* Regex split, SplitDelimiterBehavior::Isolated: matches and the gaps between them. */
static fl_status fl_tok_regex_split(fl_tok_ctx *c, int step, void *rev, const char *s, size_t n, int at0) {
    pcre2_code *re = rev;
    size_t pos = 0, from = 0;
    while (from < n) {
        int rc = pcre2_match(re, (PCRE2_SPTR)s, n, from, 0, c->md, NULL);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT) rc = pcre2_match(re, (PCRE2_SPTR)s, n, from, PCRE2_NO_JIT, c->md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[128];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return fl_errorf(FL_ERR_INTERNAL, "tokenizer: regex match failed: %s", (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(c->md);
        size_t ms = ov[0], me = ov[1];
        if (me <= ms) { /* empty match: HF ignores it */
            from = ms + (size_t)fl_tok_utf8_len((const unsigned char *)s + ms, n - ms);
            continue;
        }
        if (ms > pos) FL_TRY(fl_tok_pre_run(c, step + 1, s + pos, ms - pos, at0 && pos == 0));
        FL_TRY(fl_tok_pre_run(c, step + 1, s + ms, me - ms, at0 && ms == 0));
        pos = from = me;
    }
    if (pos < n) FL_TRY(fl_tok_pre_run(c, step + 1, s + pos, n - pos, at0 && pos == 0));
    return FL_OK;
}

static fl_status fl_tok_pre_run(fl_tok_ctx *c, int step, const char *s, size_t n, int at0) {
    const fl_tokenizer *t = c->t;
    if (n == 0) return FL_OK;
    if (step == t->n_pre)
        return t->unigram ? fl_tok_unigram_word(t, s, n, c->ids, c->n_ids, c->cap) : fl_tok_bpe_text(t, c->w, s, n, c->ids, c->n_ids, c->cap);
    const fl_tok_pre *p = &t->pre[step];
    if (p->type == FL_PRE_WSPLIT) { /* HF WhitespaceSplit: runs of non-whitespace (Unicode White_Space) */
        size_t start = 0, i = 0;
        while (i < n) {
            int l;
            uint32_t cp = fl_tok_utf8_cp((const unsigned char *)s + i, n - i, &l);
            if (fl_tok_is_uspace(cp)) {
                if (i > start) FL_TRY(fl_tok_pre_run(c, step + 1, s + start, i - start, at0 && start == 0));
                start = i + (size_t)l;
            }
            i += (size_t)l;
        }
        return n > start ? fl_tok_pre_run(c, step + 1, s + start, n - start, at0 && start == 0) : FL_OK;
    }
    if (p->type == FL_PRE_SPLIT) return fl_tok_regex_split(c, step, p->re, s, n, at0);
    if (p->type == FL_PRE_BYTELEVEL) {
        if (p->add_prefix_space && s[0] != ' ') {
            char *b = malloc(n + 1);
            if (!b) return fl_tok_oom();
            b[0] = ' ';
            memcpy(b + 1, s, n);
            fl_status st = p->use_regex ? fl_tok_regex_split(c, step, p->re, b, n + 1, at0)
                                        : fl_tok_pre_run(c, step + 1, b, n + 1, at0);
            free(b);
            return st;
        }
        return p->use_regex ? fl_tok_regex_split(c, step, p->re, s, n, at0) : fl_tok_pre_run(c, step + 1, s, n, at0);
    }
    /* METASPACE: ' ' -> replacement, prepend per scheme, split before each replacement */
    size_t rl = strlen(p->repl), spaces = 0;
    for (size_t i = 0; i < n; i++) spaces += s[i] == ' ';
    char *b = malloc(n + spaces * rl + rl + 1);
    if (!b) return fl_tok_oom();
    size_t bl = 0;
    int starts = n >= rl && memcmp(s, p->repl, rl) == 0;
    if (s[0] == ' ') starts = rl == 1 && p->repl[0] == ' ' ? starts : 1;
    if (!starts && (p->prepend_scheme == FL_PREPEND_ALWAYS || (p->prepend_scheme == FL_PREPEND_FIRST && at0)))
        memcpy(b, p->repl, rl), bl = rl;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') memcpy(b + bl, p->repl, rl), bl += rl;
        else b[bl++] = s[i];
    }
    fl_status st = FL_OK;
    if (!p->split) st = fl_tok_pre_run(c, step + 1, b, bl, at0);
    else {
        size_t start = 0;
        for (size_t i = 1; i + rl <= bl && st == FL_OK; i++)
            if (memcmp(b + i, p->repl, rl) == 0) {
                st = fl_tok_pre_run(c, step + 1, b + start, i - start, at0 && start == 0);
                start = i;
                i += rl - 1;
            }
        if (st == FL_OK) st = fl_tok_pre_run(c, step + 1, b + start, bl - start, at0 && start == 0);
    }
    free(b);
    return st;
}

static fl_status fl_tok_pre_seg(void *ctx, const char *s, size_t n, int at0) {
    return fl_tok_pre_run(ctx, 0, s, n, at0);
}

/* Apply the HF normalizer sequence; *out is malloc'd. */
static fl_status fl_tok_normalize(const fl_tokenizer *t, const char *s, size_t n, char **out, size_t *on) {
    fl_tok_buf a = {0};
    if (fl_tok_buf_put(&a, s, n)) return fl_tok_oom();
    for (int k = 0; k < t->n_norm; k++) {
        const fl_tok_norm *m = &t->norm[k];
        fl_tok_buf b = {0};
        int bad = 0;
        if (m->type == FL_NORM_PRECOMPILED) bad = fl_tok_charsmap_normalize(t, a.p, a.n, &b);
        else if (m->type == FL_NORM_STRIP) {
            size_t i = 0, e = a.n;
            int l;
            while (m->left && i < e && fl_tok_is_uspace(fl_tok_utf8_cp((const unsigned char *)a.p + i, e - i, &l))) i += (size_t)l;
            while (m->right && e > i) {
                size_t k = e - 1; /* start of the last char */
                while (k > i && ((unsigned char)a.p[k] & 0xC0) == 0x80 && e - k < 4) k--;
                if (fl_tok_utf8_len((const unsigned char *)a.p + k, e - k) != (int)(e - k)) k = e - 1;
                if (!fl_tok_is_uspace(fl_tok_utf8_cp((const unsigned char *)a.p + k, e - k, &l))) break;
                e = k;
            }
            bad = fl_tok_buf_put(&b, a.p + i, e - i);
        } else if (m->type == FL_NORM_PREPEND) {
            if (a.n) bad = fl_tok_buf_put(&b, m->a, strlen(m->a)) || fl_tok_buf_put(&b, a.p, a.n);
            else bad = fl_tok_buf_put(&b, "", 0);
        } else { /* REPLACE */
            size_t pl = strlen(m->a), rl = strlen(m->b), i = 0, run = 0;
            bad = fl_tok_buf_put(&b, "", 0);
            while (!bad && i < a.n) {
                if (pl && i + pl <= a.n && memcmp(a.p + i, m->a, pl) == 0) {
                    bad = fl_tok_buf_put(&b, a.p + run, i - run) || fl_tok_buf_put(&b, m->b, rl);
                    i += pl;
                    run = i;
                } else i++;
            }
            if (!bad) bad = fl_tok_buf_put(&b, a.p + run, a.n - run);
        }
        free(a.p);
        if (bad) { free(b.p); return fl_tok_oom(); }
        a = b;
    }
    *out = a.p;
    *on = a.n;
    return FL_OK;
}

static fl_status fl_tok_encode_sp_model(const fl_tokenizer *t, fl_tok_work *w, const char *s, size_t n, int32_t **ids,
                                        size_t *n_ids, size_t *cap) {
    static const char ws[] = "\xe2\x96\x81"; /* U+2581 */
    fl_tok_buf b = {0};
    int bad = fl_tok_buf_put(&b, "", 0);
    size_t i = 0, end = n;
    if (t->spm_remove_extra_ws) {
        while (i < end && s[i] == ' ') i++;
        while (end > i && s[end - 1] == ' ') end--;
    }
    if (i < end && t->spm_dummy_prefix) bad |= t->spm_escape_ws ? fl_tok_buf_put(&b, ws, 3) : fl_tok_buf_put(&b, " ", 1);
    for (; i < end && !bad; i++) {
        if (s[i] == ' ') {
            if (t->spm_remove_extra_ws && i > 0 && s[i - 1] == ' ') continue;
            bad = t->spm_escape_ws ? fl_tok_buf_put(&b, ws, 3) : fl_tok_buf_put(&b, " ", 1);
        } else bad = fl_tok_buf_put(&b, s + i, 1);
    }
    if (bad) { free(b.p); return fl_tok_oom(); }
    fl_status st = fl_tok_bpe_text(t, w, b.p, b.n, ids, n_ids, cap);
    free(b.p);
    return st;
}

fl_status fl_tok_encode_segment(const fl_tokenizer *t, fl_tok_work *w, const char *s, size_t n, int first,
                                int32_t **ids, size_t *n_ids, size_t *cap) {
    if (t->kind == FL_TOK_SPM && t->unigram) return fl_tok_encode_spm_unigram(t, s, n, ids, n_ids, cap);
    if (t->kind == FL_TOK_SPM) return fl_tok_encode_sp_model(t, w, s, n, ids, n_ids, cap);
    if (t->kind == FL_TOK_L2C) {
        if (n == 0) return FL_OK;
        char *b = malloc(n + 1);
        if (!b) return fl_tok_oom();
        b[0] = ' '; /* llama2.c: dummy prefix */
        memcpy(b + 1, s, n);
        fl_status st = fl_tok_bpe_text(t, w, b, n + 1, ids, n_ids, cap);
        free(b);
        return st;
    }
    char *norm = NULL;
    size_t nn = n;
    if (t->n_norm) FL_TRY(fl_tok_normalize(t, s, n, &norm, &nn));
    fl_tok_ctx c = {t, w, NULL, ids, n_ids, cap};
    c.md = pcre2_match_data_create(4, NULL);
    fl_status st;
    if (!c.md) st = fl_tok_oom();
    else if (t->n_added_norm) st = fl_tok_split_added(t, norm ? norm : s, nn, 1, fl_tok_pre_seg, &c, ids, n_ids, cap);
    else st = fl_tok_pre_run(&c, 0, norm ? norm : s, nn, first);
    pcre2_match_data_free(c.md);
    free(norm);
    return st;
}

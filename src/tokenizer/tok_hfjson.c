/* fitllm tokenizers: HF tokenizer.json loader (model type BPE).
 *
 * model "Unigram" (T5): vocab [[piece, score], ...], unk_id, byte_fallback; normalizers
 * Precompiled (base64 charsmap) and Strip; pre-tokenizer WhitespaceSplit.
 * Reads the vocabulary, merges (both "a b" strings and [a, b] pairs),
 * added_tokens, the normalizer (Prepend, Replace, Sequence), the
 * pre-tokenizer (ByteLevel, Metaspace, Split, Sequence), the decoder
 * (ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence) and the
 * TemplateProcessing post-processor (default BOS/EOS). Any other type is
 * FL_ERR_UNSUPPORTED naming the type and the file.
 */
#include <stdlib.h>
#include <string.h>

#include "tok-impl.h"

static const char k_gpt2_regex[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static const char *jstr(const fl_json *j, const char *key) {
    const fl_json *v = fl_json_get(j, key);
    return v && v->type == FL_JSON_STRING ? v->str : NULL;
}
static int jbool(const fl_json *j, const char *key, int def) {
    const fl_json *v = fl_json_get(j, key);
    return v && v->type == FL_JSON_BOOL ? v->b : def;
}
static char *jdup(const char *s) {
    size_t n = strlen(s);
    char *p = malloc(n + 1);
    if (p) memcpy(p, s, n + 1);
    return p;
}
static fl_status oom(const char *src) { return fl_errorf(FL_ERR_OOM, "%s: out of memory", src); }

/* {"String": "x"} -> "x"; {"Regex": ...} -> UNSUPPORTED (regex_out NULL) or returned via regex_out. */
static fl_status pattern_of(const fl_json *j, const char *src, const char *what, const char **str, const char **regex) {
    const fl_json *p = fl_json_get(j, "pattern");
    *str = jstr(p, "String");
    if (regex) *regex = jstr(p, "Regex");
    if (*str || (regex && *regex)) return FL_OK;
    if (jstr(p, "Regex")) return fl_errorf(FL_ERR_UNSUPPORTED, "%s: %s with a Regex pattern is not supported", src, what);
    return fl_errorf(FL_ERR_FORMAT, "%s: %s: missing \"pattern\"", src, what);
}

/* Standard base64 (padding optional); -1 on a bad character. */
static long b64_decode(const char *s, size_t n, uint8_t *out) {
    uint32_t acc = 0;
    int bits = 0;
    long o = 0;
    for (size_t i = 0; i < n && s[i] != '='; i++) {
        char c = s[i];
        int v = c >= 'A' && c <= 'Z' ? c - 'A' : c >= 'a' && c <= 'z' ? c - 'a' + 26 : c >= '0' && c <= '9' ? c - '0' + 52
              : c == '+' ? 62 : c == '/' ? 63 : -1;
        if (v < 0) return -1;
        acc = acc << 6 | (uint32_t)v;
        if ((bits += 6) >= 8) out[o++] = (uint8_t)(acc >> (bits -= 8));
    }
    return o;
}

static fl_status add_precompiled(fl_tokenizer *t, const fl_json *j, const char *src) {
    const fl_json *cm = fl_json_get(j, "precompiled_charsmap");
    if (cm && cm->type == FL_JSON_NULL) return FL_OK;
    if (!cm || cm->type != FL_JSON_STRING) return fl_errorf(FL_ERR_FORMAT, "%s: Precompiled normalizer: \"precompiled_charsmap\" must be a base64 string", src);
    if (t->cm_units) return fl_errorf(FL_ERR_UNSUPPORTED, "%s: more than one Precompiled normalizer is not supported", src);
    uint8_t *b = malloc(cm->len / 4 * 3 + 4);
    if (!b) return oom(src);
    long n = b64_decode(cm->str, cm->len, b);
    fl_status s = n < 0 ? fl_errorf(FL_ERR_FORMAT, "%s: Precompiled normalizer: precompiled_charsmap is not valid base64", src)
                        : fl_tok_charsmap_set(t, b, (size_t)n, src);
    free(b);
    return s;
}

static fl_status add_norm(fl_tokenizer *t, const fl_json *j, const char *src) {
    const char *ty = jstr(j, "type");
    if (!ty) return fl_errorf(FL_ERR_FORMAT, "%s: normalizer without a \"type\"", src);
    if (!strcmp(ty, "Sequence")) {
        const fl_json *l = fl_json_get(j, "normalizers");
        if (!l || l->type != FL_JSON_ARRAY) return fl_errorf(FL_ERR_FORMAT, "%s: Sequence normalizer without \"normalizers\"", src);
        for (const fl_json *c = l->child; c; c = c->next) FL_TRY(add_norm(t, c, src));
        return FL_OK;
    }
    fl_tok_norm m = {0};
    if (!strcmp(ty, "Prepend")) {
        const char *p = jstr(j, "prepend");
        if (!p) return fl_errorf(FL_ERR_FORMAT, "%s: Prepend normalizer without \"prepend\"", src);
        m.type = FL_NORM_PREPEND;
        m.a = jdup(p);
        m.b = jdup("");
    } else if (!strcmp(ty, "Replace")) {
        const char *p, *c = jstr(j, "content");
        FL_TRY(pattern_of(j, src, "Replace normalizer", &p, NULL));
        if (!c) return fl_errorf(FL_ERR_FORMAT, "%s: Replace normalizer without \"content\"", src);
        m.type = FL_NORM_REPLACE;
        m.a = jdup(p);
        m.b = jdup(c);
    } else if (!strcmp(ty, "Precompiled")) {
        FL_TRY(add_precompiled(t, j, src));
        if (!t->cm_units) return FL_OK; /* empty charsmap: identity */
        m.type = FL_NORM_PRECOMPILED;
        FL_TRY(fl_tok_regex_compile("\\X", 2, src, &t->grapheme_re));
        m.a = jdup(""), m.b = jdup("");
    } else if (!strcmp(ty, "Strip")) {
        m.type = FL_NORM_STRIP;
        m.left = jbool(j, "strip_left", 1), m.right = jbool(j, "strip_right", 1);
        m.a = jdup(""), m.b = jdup("");
    } else
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: normalizer type \"%s\" is not supported (supported: Prepend, Replace, Precompiled, Strip, Sequence)", src, ty);
    fl_tok_norm *nn = realloc(t->norm, (size_t)(t->n_norm + 1) * sizeof *nn);
    if (!nn || !m.a || !m.b) { free(m.a); free(m.b); if (nn) t->norm = nn; return oom(src); }
    t->norm = nn;
    t->norm[t->n_norm++] = m;
    return FL_OK;
}

static int prepend_scheme(const fl_json *j) {
    const char *s = jstr(j, "prepend_scheme");
    if (s) return !strcmp(s, "first") ? FL_PREPEND_FIRST : !strcmp(s, "never") ? FL_PREPEND_NEVER : FL_PREPEND_ALWAYS;
    return jbool(j, "add_prefix_space", 1) ? FL_PREPEND_ALWAYS : FL_PREPEND_NEVER;
}

static fl_status add_pre(fl_tokenizer *t, const fl_json *j, const char *src) {
    const char *ty = jstr(j, "type");
    if (!ty) return fl_errorf(FL_ERR_FORMAT, "%s: pre_tokenizer without a \"type\"", src);
    if (!strcmp(ty, "Sequence")) {
        const fl_json *l = fl_json_get(j, "pretokenizers");
        if (!l || l->type != FL_JSON_ARRAY) return fl_errorf(FL_ERR_FORMAT, "%s: Sequence pre_tokenizer without \"pretokenizers\"", src);
        for (const fl_json *c = l->child; c; c = c->next) FL_TRY(add_pre(t, c, src));
        return FL_OK;
    }
    if (t->n_pre && t->pre[t->n_pre - 1].type == FL_PRE_BYTELEVEL)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: pre_tokenizer \"%s\" after ByteLevel is not supported", src, ty);
    fl_tok_pre p = {0};
    fl_status s = FL_OK;
    if (!strcmp(ty, "WhitespaceSplit")) p.type = FL_PRE_WSPLIT;
    else if (!strcmp(ty, "ByteLevel")) {
        p.type = FL_PRE_BYTELEVEL;
        p.add_prefix_space = jbool(j, "add_prefix_space", 0);
        p.use_regex = jbool(j, "use_regex", 1);
        if (p.use_regex) s = fl_tok_regex_compile(k_gpt2_regex, strlen(k_gpt2_regex), src, &p.re);
    } else if (!strcmp(ty, "Metaspace")) {
        const char *r = jstr(j, "replacement");
        p.type = FL_PRE_METASPACE;
        p.repl = jdup(r ? r : "\xe2\x96\x81");
        p.prepend_scheme = prepend_scheme(j);
        p.split = jbool(j, "split", 1);
        if (!p.repl) s = oom(src);
        else if (!p.repl[0]) s = fl_errorf(FL_ERR_FORMAT, "%s: Metaspace with an empty replacement", src);
    } else if (!strcmp(ty, "Split")) {
        const char *str, *rx, *beh = jstr(j, "behavior");
        FL_TRY(pattern_of(j, src, "Split pre_tokenizer", &str, &rx));
        if (jbool(j, "invert", 0)) return fl_errorf(FL_ERR_UNSUPPORTED, "%s: Split pre_tokenizer with invert=true is not supported", src);
        if (!beh || strcmp(beh, "Isolated"))
            return fl_errorf(FL_ERR_UNSUPPORTED, "%s: Split pre_tokenizer behavior \"%s\" is not supported (only Isolated)", src,
                             beh ? beh : "(missing)");
        p.type = FL_PRE_SPLIT;
        if (rx) s = fl_tok_regex_compile(rx, strlen(rx), src, &p.re);
        else { /* literal string: quote it */
            fl_tok_buf q = {0};
            int bad = fl_tok_buf_put(&q, "\\Q", 2) || fl_tok_buf_put(&q, str, strlen(str)) || fl_tok_buf_put(&q, "\\E", 2);
            s = bad ? oom(src) : fl_tok_regex_compile(q.p, q.n, src, &p.re);
            free(q.p);
        }
    } else
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: pre_tokenizer type \"%s\" is not supported (supported: ByteLevel, Metaspace, Split, WhitespaceSplit, Sequence)", src, ty);
    fl_tok_pre *np = s == FL_OK ? realloc(t->pre, (size_t)(t->n_pre + 1) * sizeof *np) : NULL;
    if (!np) {
        free(p.repl);
        if (p.re) fl_tok_regex_free(p.re);
        return s != FL_OK ? s : oom(src);
    }
    t->pre = np;
    t->pre[t->n_pre++] = p;
    return FL_OK;
}

static fl_status add_dec(fl_tokenizer *t, const fl_json *j, const char *src) {
    const char *ty = jstr(j, "type");
    if (!ty) return fl_errorf(FL_ERR_FORMAT, "%s: decoder without a \"type\"", src);
    if (!strcmp(ty, "Sequence")) {
        const fl_json *l = fl_json_get(j, "decoders");
        if (!l || l->type != FL_JSON_ARRAY) return fl_errorf(FL_ERR_FORMAT, "%s: Sequence decoder without \"decoders\"", src);
        for (const fl_json *c = l->child; c; c = c->next) FL_TRY(add_dec(t, c, src));
        return FL_OK;
    }
    fl_tok_dec d = {0};
    if (!strcmp(ty, "ByteLevel")) d.type = FL_DEC_BYTELEVEL;
    else if (!strcmp(ty, "ByteFallback")) d.type = FL_DEC_BYTEFALLBACK;
    else if (!strcmp(ty, "Fuse")) d.type = FL_DEC_FUSE;
    else if (!strcmp(ty, "Replace")) {
        const char *p, *c = jstr(j, "content");
        FL_TRY(pattern_of(j, src, "Replace decoder", &p, NULL));
        if (!c) return fl_errorf(FL_ERR_FORMAT, "%s: Replace decoder without \"content\"", src);
        d.type = FL_DEC_REPLACE;
        if (!(d.a = jdup(p)) || !(d.b = jdup(c))) { free(d.a); return oom(src); }
    } else if (!strcmp(ty, "Strip")) {
        const char *c = jstr(j, "content");
        const fl_json *a = fl_json_get(j, "start"), *b = fl_json_get(j, "stop");
        d.type = FL_DEC_STRIP;
        d.start = a && a->type == FL_JSON_NUMBER && a->is_int && a->i >= 0 && a->i < 1000 ? (int)a->i : 0;
        d.stop = b && b->type == FL_JSON_NUMBER && b->is_int && b->i >= 0 && b->i < 1000 ? (int)b->i : 0;
        if (!(d.a = jdup(c ? c : " "))) return oom(src);
    } else if (!strcmp(ty, "Metaspace")) {
        const char *r = jstr(j, "replacement");
        d.type = FL_DEC_METASPACE;
        d.prepend = prepend_scheme(j) != FL_PREPEND_NEVER;
        if (!(d.a = jdup(r && r[0] ? r : "\xe2\x96\x81"))) return oom(src);
    } else
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: decoder type \"%s\" is not supported (supported: ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence)", src, ty);
    fl_tok_dec *nd = realloc(t->dec, (size_t)(t->n_dec + 1) * sizeof *nd);
    if (!nd) { free(d.a); free(d.b); return oom(src); }
    t->dec = nd;
    t->dec[t->n_dec++] = d;
    return FL_OK;
}

static fl_status id_of(const fl_json *v, const char *src, const char *what, int32_t *id) {
    if (!v || v->type != FL_JSON_NUMBER || !v->is_int || v->i < 0 || v->i >= (1 << 26))
        return fl_errorf(FL_ERR_FORMAT, "%s: %s: id must be an integer in [0, 2^26)", src, what);
    *id = (int32_t)v->i;
    return FL_OK;
}

static fl_status load_added(fl_tokenizer *t, const fl_json *l, const char *src) {
    if (!l || l->type == FL_JSON_NULL) return FL_OK;
    if (l->type != FL_JSON_ARRAY) return fl_errorf(FL_ERR_FORMAT, "%s: \"added_tokens\" must be an array", src);
    if (l->len > (1u << 20)) return fl_errorf(FL_ERR_FORMAT, "%s: too many added tokens", src);
    t->added = calloc(l->len ? l->len : 1, sizeof *t->added);
    if (!t->added) return oom(src);
    for (const fl_json *c = l->child; c; c = c->next) {
        const fl_json *ct = fl_json_get(c, "content");
        int32_t id = 0;
        if (!ct || ct->type != FL_JSON_STRING) return fl_errorf(FL_ERR_FORMAT, "%s: added token without \"content\"", src);
        FL_TRY(id_of(fl_json_get(c, "id"), src, "added token", &id));
        if (!fl_tok_piece(t, id, NULL)) FL_TRY(fl_tok_set_piece(t, id, ct->str, ct->len));
        fl_tok_added *a = &t->added[t->n_added++];
        if (!(a->s = malloc(ct->len + 1))) return oom(src);
        memcpy(a->s, ct->str, ct->len + 1);
        a->len = ct->len;
        a->id = id;
        a->special = (uint8_t)jbool(c, "special", 0);
        a->normalized = (uint8_t)jbool(c, "normalized", !a->special);
        a->lstrip = (uint8_t)jbool(c, "lstrip", 0);
        a->rstrip = (uint8_t)jbool(c, "rstrip", 0);
        a->single_word = (uint8_t)jbool(c, "single_word", 0);
    }
    return FL_OK;
}

static fl_status load_merges(fl_tokenizer *t, const fl_json *l, const char *src) {
    if (!l || l->type == FL_JSON_NULL) return fl_tok_pairmap_init(t, 0);
    if (l->type != FL_JSON_ARRAY) return fl_errorf(FL_ERR_FORMAT, "%s: model.merges must be an array", src);
    FL_TRY(fl_tok_pairmap_init(t, l->len));
    fl_tok_buf cat = {0};
    fl_status s = FL_OK;
    size_t rank = 0;
    for (const fl_json *c = l->child; c && s == FL_OK; c = c->next, rank++) {
        const char *a, *b;
        size_t al, bl;
        if (c->type == FL_JSON_STRING) {
            const char *sp = memchr(c->str, ' ', c->len);
            if (!sp || memchr(sp + 1, ' ', c->len - (size_t)(sp + 1 - c->str))) {
                s = fl_errorf(FL_ERR_FORMAT, "%s: merge %zu (\"%.60s\") is not two tokens separated by one space", src, rank, c->str);
                break;
            }
            a = c->str, al = (size_t)(sp - c->str), b = sp + 1, bl = c->len - al - 1;
        } else if (c->type == FL_JSON_ARRAY && c->len == 2 && c->child->type == FL_JSON_STRING &&
                   c->child->next->type == FL_JSON_STRING) {
            a = c->child->str, al = c->child->len, b = c->child->next->str, bl = c->child->next->len;
        } else {
            s = fl_errorf(FL_ERR_FORMAT, "%s: merge %zu must be a string \"a b\" or a pair [a, b]", src, rank);
            break;
        }
        int32_t ia = fl_tok_lookup(t, a, al), ib = fl_tok_lookup(t, b, bl);
        cat.n = 0;
        if (fl_tok_buf_put(&cat, a, al) || fl_tok_buf_put(&cat, b, bl)) { s = oom(src); break; }
        int32_t im = fl_tok_lookup(t, cat.p, cat.n);
        if (ia < 0 || ib < 0 || im < 0) {
            s = fl_errorf(FL_ERR_FORMAT, "%s: merge %zu (\"%.*s\" + \"%.*s\"): %s not in the vocabulary", src, rank, (int)(al > 60 ? 60 : al), a,
                          (int)(bl > 60 ? 60 : bl), b, ia < 0 ? "first token" : ib < 0 ? "second token" : "merged token");
            break;
        }
        s = fl_tok_pairmap_put(t, ia, ib, (float)rank, im);
    }
    free(cat.p);
    return s;
}

static void load_template(fl_tokenizer *t, const fl_json *pp) {
    const fl_json *single = fl_json_get(pp, "single"), *sp = fl_json_get(pp, "special_tokens");
    if (!single || single->type != FL_JSON_ARRAY) return;
    int seen_a = 0, bos = 0, eos = 0;
    for (const fl_json *c = single->child; c; c = c->next) {
        if (fl_json_get(c, "Sequence")) { seen_a = 1; continue; }
        const char *name = jstr(fl_json_get(c, "SpecialToken"), "id");
        if (!name) continue;
        const fl_json *ids = fl_json_get(fl_json_get(sp, name), "ids");
        const fl_json *v = fl_json_at(ids, 0);
        int32_t id = v && v->type == FL_JSON_NUMBER && v->is_int && v->i >= 0 && v->i < t->n_vocab ? (int32_t)v->i
                                                                                                   : fl_tok_lookup(t, name, strlen(name));
        if (id < 0) continue;
        if (!seen_a && !bos) t->bos_id = id, bos = 1;
        else if (seen_a && !eos) t->eos_ids[0] = id, t->n_eos = 1, eos = 1;
    }
    t->add_bos = bos;
    t->add_eos = eos;
}

/* normalizer, pre_tokenizer, decoder */
static fl_status load_pipeline(fl_tokenizer *t, const fl_json *root, const char *src) {
    const fl_json *n = fl_json_get(root, "normalizer"), *p = fl_json_get(root, "pre_tokenizer"), *d = fl_json_get(root, "decoder");
    if (n && n->type != FL_JSON_NULL) FL_TRY(add_norm(t, n, src));
    if (p && p->type != FL_JSON_NULL) FL_TRY(add_pre(t, p, src));
    if (d && d->type != FL_JSON_NULL) FL_TRY(add_dec(t, d, src));
    if (!d || d->type == FL_JSON_NULL) t->dec_join_space = 1;
    return FL_OK;
}

/* special added tokens, default BOS/EOS, TemplateProcessing */
static void finish_common(fl_tokenizer *t, const fl_json *root) {
    for (int i = 0; i < t->n_added; i++) {
        if (t->added[i].special) t->type[t->added[i].id] = FL_SP_CONTROL;
        if (!t->n_norm) t->added[i].normalized = 0; /* identical without a normalizer */
    }
    fl_tok_finish_added(t);
    if (t->kind == FL_TOK_BPE_SP && !t->unigram) fl_tok_detect_ws_split(t, "\xe2\x96\x81");
    /* defaults: LLaMA-style adds <s>; GPT-2 adds nothing; a TemplateProcessing post-processor decides */
    int32_t bos = fl_tok_lookup(t, "<s>", 3), eos = fl_tok_lookup(t, "</s>", 4);
    if (t->kind == FL_TOK_BPE_BL) bos = eos = fl_tok_lookup(t, "<|endoftext|>", 13);
    t->bos_id = bos;
    if (eos >= 0) t->eos_ids[0] = eos, t->n_eos = 1;
    t->add_bos = t->kind == FL_TOK_BPE_SP && bos >= 0;
    const fl_json *pp = fl_json_get(root, "post_processor");
    if (pp && jstr(pp, "type") && !strcmp(jstr(pp, "type"), "TemplateProcessing")) load_template(t, pp);
}

/* model "Unigram" (T5): vocab [[piece, score], ...]; the rest of the file as for BPE. */
static fl_status load_unigram(fl_tokenizer **out, const fl_json *root, const fl_json *model, const char *src) {
    const fl_json *added = fl_json_get(root, "added_tokens"), *mv = fl_json_get(model, "vocab");
    size_t n_def = (mv && mv->type == FL_JSON_ARRAY ? mv->len : 0) + (added && added->type == FL_JSON_ARRAY ? added->len : 0);
    for (const fl_json *c = added && added->type == FL_JSON_ARRAY ? added->child : NULL; c; c = c->next) {
        const fl_json *v = fl_json_get(c, "id");
        if (v && v->type == FL_JSON_NUMBER && v->is_int && (uint64_t)v->i >= 2 * (uint64_t)n_def + 1024)
            return fl_errorf(FL_ERR_FORMAT, "%s: added_tokens: token id %lld but only %zu tokens are defined (ids must be dense: "
                             "below 2 x tokens + 1024)", src, (long long)v->i, n_def);
    }
    fl_tokenizer *t = fl_tok_new(FL_TOK_BPE_SP);
    if (!t) return oom(src);
    fl_status s = fl_tok_load_unigram_vocab(t, model, src);
    if (s == FL_OK) s = load_added(t, added, src);
    if (s == FL_OK) s = fl_tok_build_vocab_map(t, 0);
    if (s == FL_OK) s = load_pipeline(t, root, src);
    if (s == FL_OK) s = fl_tok_unigram_finish(t, 1, src);
    if (s != FL_OK) { fl_tok_free(t); return s; }
    fl_tok_find_byte_pieces(t);
    finish_common(t, root);
    *out = t;
    return FL_OK;
}

fl_status fl_tok_load_hf_json(fl_tokenizer **out, const fl_json *root, const char *src) {
    *out = NULL;
    if (!root || root->type != FL_JSON_OBJECT) return fl_errorf(FL_ERR_FORMAT, "%s: expected a JSON object", src);
    const fl_json *model = fl_json_get(root, "model");
    if (!model || model->type != FL_JSON_OBJECT) return fl_errorf(FL_ERR_FORMAT, "%s: missing \"model\" object", src);
    const char *mt = jstr(model, "type");
    int uni = mt && !strcmp(mt, "Unigram");
    if (mt && strcmp(mt, "BPE") && !uni)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: model type \"%s\" is not supported (only BPE and Unigram)", src, mt);
    if (uni) return load_unigram(out, root, model, src);
    const fl_json *vocab = fl_json_get(model, "vocab");
    if (!vocab || vocab->type != FL_JSON_OBJECT) return fl_errorf(FL_ERR_FORMAT, "%s: model.vocab must be an object", src);
    {
        /* Ids index dense per-token tables: two tokens with ids near 2^26 would make a 60-byte file cost
         * gigabytes and seconds. Real vocabularies are dense (added tokens continue the model's ids), so
         * the largest id must stay below 2 x the tokens defined + 1024. */
        const fl_json *added = fl_json_get(root, "added_tokens");
        size_t n_def = vocab->len + (added && added->type == FL_JSON_ARRAY ? added->len : 0);
        int64_t max_id = -1;
        const char *where = "model.vocab";
        for (const fl_json *c = vocab->child; c; c = c->next)
            if (c->type == FL_JSON_NUMBER && c->is_int && c->i > max_id) max_id = c->i;
        for (const fl_json *c = added && added->type == FL_JSON_ARRAY ? added->child : NULL; c; c = c->next) {
            const fl_json *v = fl_json_get(c, "id");
            if (v && v->type == FL_JSON_NUMBER && v->is_int && v->i > max_id) max_id = v->i, where = "added_tokens";
        }
        if (max_id >= 0 && (uint64_t)max_id >= 2 * (uint64_t)n_def + 1024)
            return fl_errorf(FL_ERR_FORMAT, "%s: %s: token id %lld but only %zu tokens are defined (ids must be dense: "
                             "below 2 x tokens + 1024)", src, where, (long long)max_id, n_def);
    }
    const fl_json *drop = fl_json_get(model, "dropout");
    if (drop && drop->type == FL_JSON_NUMBER && drop->num != 0.0)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: BPE dropout is not supported", src);
    const char *csp = jstr(model, "continuing_subword_prefix"), *eow = jstr(model, "end_of_word_suffix");
    if ((csp && csp[0]) || (eow && eow[0]))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: continuing_subword_prefix / end_of_word_suffix are not supported", src);

    fl_tokenizer *t = fl_tok_new(FL_TOK_BPE_SP);
    if (!t) return oom(src);
    fl_status s = FL_OK;
    for (const fl_json *c = vocab->child; c && s == FL_OK; c = c->next) {
        int32_t id = 0;
        s = id_of(c, src, "model.vocab", &id);
        if (s == FL_OK) s = fl_tok_set_piece(t, id, c->key, strlen(c->key));
    }
    if (s == FL_OK) s = fl_tok_build_vocab_map(t, 0); /* merges refer to model pieces */
    if (s == FL_OK) s = load_merges(t, fl_json_get(model, "merges"), src);
    if (s == FL_OK) s = load_added(t, fl_json_get(root, "added_tokens"), src);
    if (s == FL_OK) s = fl_tok_build_vocab_map(t, 0);
    if (s == FL_OK) s = load_pipeline(t, root, src);
    if (s != FL_OK) { fl_tok_free(t); return s; }
    for (int i = 0; i < t->n_pre; i++)
        if (t->pre[i].type == FL_PRE_BYTELEVEL) t->kind = FL_TOK_BPE_BL;
    const char *unk = jstr(model, "unk_token");
    t->unk_id = unk ? fl_tok_lookup(t, unk, strlen(unk)) : -1;
    t->fuse_unk = jbool(model, "fuse_unk", 0);
    t->byte_fallback = jbool(model, "byte_fallback", 0);
    t->ignore_merges = jbool(model, "ignore_merges", 0);
    fl_tok_find_byte_pieces(t);
    if (t->kind == FL_TOK_BPE_BL) fl_tok_bytelevel_tables(t);
    finish_common(t, root);
    *out = t;
    return FL_OK;
}

fl_status fl_tok_load_hf_json_mem(fl_tokenizer **out, const char *text, size_t n, const char *src) {
    fl_json *j = NULL;
    *out = NULL;
    FL_TRY(fl_json_parse(text, n, src, &j));
    fl_status s = fl_tok_load_hf_json(out, j, src);
    fl_json_free(j);
    return s;
}

/* fitllm tokenizers: SentencePiece tokenizer.model (protobuf ModelProto,
 * decoded here) and the llama2.c tokenizer .bin.
 *
 * Both encode with score-based BPE: adjacent symbols merge when their
 * concatenation is a piece, highest score first, leftmost on ties
 * (sentencepiece bpe_model.cc; llama2.c's encode loop), with byte fallback.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tok-impl.h"

static fl_status read_all(const char *path, uint8_t **buf, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return fl_errorf(errno == ENOENT ? FL_ERR_NOT_FOUND : FL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    size_t cap = 1 << 16, len = 0;
    uint8_t *b = malloc(cap);
    for (;;) {
        if (!b) { fclose(f); return fl_errorf(FL_ERR_OOM, "%s: out of memory reading file", path); }
        size_t r = fread(b + len, 1, cap - len, f);
        len += r;
        if (r == 0) break;
        if (len == cap) {
            uint8_t *nb = realloc(b, cap *= 2);
            if (!nb) free(b);
            b = nb;
        }
    }
    int err = ferror(f);
    fclose(f);
    if (err) { free(b); return fl_errorf(FL_ERR_IO, "%s: read error", path); }
    *buf = b;
    *n = len;
    return FL_OK;
}

/* SentencePiece-style decoder chain: Replace(U+2581 -> ' '), ByteFallback, Fuse, [Strip one leading ' ']. */
static fl_status sp_decoder(fl_tokenizer *t, int strip, const char *src) {
    t->dec = calloc(4, sizeof *t->dec);
    if (!t->dec) return fl_errorf(FL_ERR_OOM, "%s: out of memory", src);
    t->dec[0].type = FL_DEC_REPLACE;
    t->dec[0].a = malloc(4);
    t->dec[0].b = malloc(2);
    t->n_dec = 1; /* so fl_tok_free releases a, b */
    if (!t->dec[0].a || !t->dec[0].b) return fl_errorf(FL_ERR_OOM, "%s: out of memory", src);
    memcpy(t->dec[0].a, "\xe2\x96\x81", 4);
    memcpy(t->dec[0].b, " ", 2);
    t->dec[1].type = FL_DEC_BYTEFALLBACK;
    t->dec[2].type = FL_DEC_FUSE;
    t->n_dec = 3;
    if (strip) {
        t->dec[3].type = FL_DEC_STRIP;
        t->dec[3].start = 1;
        if (!(t->dec[3].a = malloc(2))) return fl_errorf(FL_ERR_OOM, "%s: out of memory", src);
        memcpy(t->dec[3].a, " ", 2);
        t->n_dec = 4;
    }
    return FL_OK;
}

/* ---- protobuf ------------------------------------------------------------------------- */

typedef struct {
    const uint8_t *p, *end;
} pb;

static int pb_varint(pb *r, uint64_t *v) {
    uint64_t x = 0;
    for (int sh = 0; sh < 64; sh += 7) {
        if (r->p >= r->end) return -1;
        uint8_t b = *r->p++;
        x |= (uint64_t)(b & 0x7F) << sh;
        if (!(b & 0x80)) { *v = x; return 0; }
    }
    return -1;
}

/* Read the next field: key, and for LEN fields the payload view; scalars in *v. */
static int pb_field(pb *r, uint32_t *field, int *wt, uint64_t *v, pb *sub) {
    uint64_t key;
    if (pb_varint(r, &key)) return -1;
    *field = (uint32_t)(key >> 3);
    *wt = (int)(key & 7);
    switch (*wt) {
    case 0: return pb_varint(r, v);
    case 1:
        if (r->end - r->p < 8) return -1;
        memcpy(v, r->p, 8);
        r->p += 8;
        return 0;
    case 5: {
        if (r->end - r->p < 4) return -1;
        uint32_t x;
        memcpy(&x, r->p, 4);
        *v = x;
        r->p += 4;
        return 0;
    }
    case 2: {
        uint64_t len;
        if (pb_varint(r, &len) || len > (uint64_t)(r->end - r->p)) return -1;
        sub->p = r->p;
        sub->end = r->p + len;
        r->p += len;
        return 0;
    }
    default: return -1; /* groups are not used by sentencepiece */
    }
}

typedef struct {
    int model_type, byte_fallback, unk_id, bos_id, eos_id, pad_id;
    int dummy_prefix, remove_ws, escape_ws;
    const uint8_t *name, *charsmap;
    size_t name_n, charsmap_n;
} spm_spec;

/* UNIGRAM (T5's spiece.model): the charsmap normalizer and Viterbi (tok_unigram.c); T5Tokenizer's
 * conventions: no BOS, EOS appended, the control / unknown pieces (<pad>, </s>, <unk>) matched
 * as special tokens in text (the extra ids are added by fl_tok_load). */
static fl_status spm_unigram(fl_tokenizer *t, const spm_spec *sp, const float *scores, int32_t np, const char *src) {
    t->unk_id = -1;
    for (int32_t i = 0; i < np && t->unk_id < 0; i++)
        if (t->type[i] == FL_SP_UNKNOWN) t->unk_id = i;
    if (t->unk_id < 0) return fl_errorf(FL_ERR_FORMAT, "%s: UNIGRAM model without an UNKNOWN (<unk>) piece (sentencepiece requires one)", src);
    if (!(t->uscore = malloc((size_t)np * sizeof *t->uscore))) return fl_errorf(FL_ERR_OOM, "%s: out of memory", src);
    for (int32_t i = 0; i < np; i++) t->uscore[i] = scores[i];
    t->uni_n = np;
    FL_TRY(fl_tok_build_vocab_map(t, 1));
    FL_TRY(fl_tok_charsmap_set(t, sp->charsmap, sp->charsmap_n, src));
    FL_TRY(fl_tok_unigram_finish(t, 0, src));
    FL_TRY(sp_decoder(t, sp->dummy_prefix, src));
    int n_sp = 0;
    for (int32_t i = 0; i < np; i++) n_sp += t->type[i] == FL_SP_CONTROL || t->type[i] == FL_SP_UNKNOWN;
    if (!(t->added = calloc((size_t)n_sp + 1, sizeof *t->added))) return fl_errorf(FL_ERR_OOM, "%s: out of memory", src);
    for (int32_t i = 0; i < np; i++) {
        if (t->type[i] != FL_SP_CONTROL && t->type[i] != FL_SP_UNKNOWN) continue;
        size_t pl;
        const char *p = fl_tok_piece(t, i, &pl);
        fl_tok_added *a = &t->added[t->n_added];
        if (!pl) continue;
        if (!(a->s = malloc(pl + 1))) return fl_errorf(FL_ERR_OOM, "%s: out of memory", src);
        memcpy(a->s, p, pl + 1);
        a->len = pl, a->id = i, a->special = 1;
        t->n_added++;
        t->type[i] = FL_SP_CONTROL; /* skipped by decode(skip_special), as HF skips <unk> */
    }
    fl_tok_finish_added(t);
    t->byte_fallback = sp->byte_fallback;
    t->fuse_unk = 1;
    fl_tok_find_byte_pieces(t);
    t->spm_dummy_prefix = sp->dummy_prefix;
    t->spm_remove_extra_ws = sp->remove_ws;
    t->spm_escape_ws = sp->escape_ws;
    t->bos_id = sp->bos_id >= 0 && sp->bos_id < np ? sp->bos_id : -1;
    if (sp->eos_id >= 0 && sp->eos_id < np) t->eos_ids[0] = sp->eos_id, t->n_eos = 1;
    t->pad_id = sp->pad_id >= 0 && sp->pad_id < np ? sp->pad_id : -1;
    t->add_bos = 0;
    t->add_eos = t->n_eos > 0;
    return FL_OK;
}

fl_status fl_tok_spm_add_extra_ids(fl_tokenizer *t, int n) {
    if (!t->unigram || t->kind != FL_TOK_SPM || n <= 0) return FL_OK;
    if (n > 10000) return fl_errorf(FL_ERR_INVALID, "tokenizer: extra_ids %d is implausible", n);
    int32_t base = t->n_vocab;
    fl_tok_added *na = realloc(t->added, (size_t)(t->n_added + n) * sizeof *na);
    if (!na) return fl_errorf(FL_ERR_OOM, "tokenizer: out of memory");
    t->added = na;
    for (int k = 0; k < n; k++) { /* T5: <extra_id_0> is the last id */
        char buf[32];
        int l = snprintf(buf, sizeof buf, "<extra_id_%d>", n - 1 - k);
        FL_TRY(fl_tok_set_piece(t, base + k, buf, (size_t)l));
        t->type[base + k] = FL_SP_CONTROL;
        fl_tok_added *a = &t->added[t->n_added];
        memset(a, 0, sizeof *a);
        if (!(a->s = malloc((size_t)l + 1))) return fl_errorf(FL_ERR_OOM, "tokenizer: out of memory");
        memcpy(a->s, buf, (size_t)l + 1);
        a->len = (size_t)l, a->id = base + k, a->special = 1;
        t->n_added++;
    }
    fl_tok_finish_added(t);
    return fl_tok_build_vocab_map(t, 1);
}

#define PB_BAD(what) fl_errorf(FL_ERR_FORMAT, "%s: malformed protobuf in %s (truncated or corrupt tokenizer.model)", src, what)

fl_status fl_tok_load_spm_mem(fl_tokenizer **out, const uint8_t *data, size_t n, const char *src) {
    *out = NULL;
    spm_spec sp = {1, 0, 0, 1, 2, -1, 1, 1, 1, NULL, NULL, 0, 0};
    fl_tokenizer *t = fl_tok_new(FL_TOK_SPM);
    if (!t) return fl_errorf(FL_ERR_OOM, "%s: out of memory", src);
    fl_status s = FL_OK;
    pb r = {data, data + n}, sub;
    int32_t np = 0;
    int have_trainer = 0;
    float *scores = NULL;
    size_t scap = 0;
    while (r.p < r.end && s == FL_OK) {
        uint32_t f;
        int wt;
        uint64_t v;
        if (pb_field(&r, &f, &wt, &v, &sub)) { s = PB_BAD("ModelProto"); break; }
        if (f == 1 && wt == 2) { /* SentencePiece */
            const uint8_t *ps = NULL;
            size_t pn = 0;
            float score = 0;
            int type = FL_SP_NORMAL, has_piece = 0;
            while (sub.p < sub.end) {
                uint32_t g;
                int w2;
                uint64_t x;
                pb ss;
                if (pb_field(&sub, &g, &w2, &x, &ss)) { s = PB_BAD("a SentencePiece"); break; }
                if (g == 1 && w2 == 2) ps = ss.p, pn = (size_t)(ss.end - ss.p), has_piece = 1;
                else if (g == 2 && w2 == 5) { uint32_t u = (uint32_t)x; memcpy(&score, &u, 4); }
                else if (g == 3 && w2 == 0) type = (int)x;
            }
            if (s != FL_OK) break;
            if (!has_piece) { s = fl_errorf(FL_ERR_FORMAT, "%s: piece %d has no text", src, (int)np); break; }
            if (type < 1 || type > 6) { s = fl_errorf(FL_ERR_FORMAT, "%s: piece %d has unknown type %d", src, (int)np, type); break; }
            if ((s = fl_tok_set_piece(t, np, (const char *)ps, pn)) != FL_OK) break;
            t->type[np] = (uint8_t)type;
            if ((size_t)np >= scap) {
                scap = scap ? scap * 2 : 1024;
                float *ns = realloc(scores, scap * sizeof *ns);
                if (!ns) { s = fl_errorf(FL_ERR_OOM, "%s: out of memory", src); break; }
                scores = ns;
            }
            scores[np++] = score;
        } else if (f == 2 && wt == 2) { /* TrainerSpec */
            have_trainer = 1;
            while (sub.p < sub.end) {
                uint32_t g;
                int w2;
                uint64_t x;
                pb ss;
                if (pb_field(&sub, &g, &w2, &x, &ss)) { s = PB_BAD("trainer_spec"); break; }
                if (w2 != 0) continue;
                if (g == 3) sp.model_type = (int)x;
                else if (g == 35) sp.byte_fallback = x != 0;
                else if (g == 40) sp.unk_id = (int)(int64_t)x;
                else if (g == 41) sp.bos_id = (int)(int64_t)x;
                else if (g == 42) sp.eos_id = (int)(int64_t)x;
                else if (g == 43) sp.pad_id = (int)(int64_t)x;
            }
        } else if (f == 3 && wt == 2) { /* NormalizerSpec */
            while (sub.p < sub.end) {
                uint32_t g;
                int w2;
                uint64_t x;
                pb ss;
                if (pb_field(&sub, &g, &w2, &x, &ss)) { s = PB_BAD("normalizer_spec"); break; }
                if (g == 1 && w2 == 2) sp.name = ss.p, sp.name_n = (size_t)(ss.end - ss.p);
                else if (g == 2 && w2 == 2) sp.charsmap = ss.p, sp.charsmap_n = (size_t)(ss.end - ss.p);
                else if (g == 3 && w2 == 0) sp.dummy_prefix = x != 0;
                else if (g == 4 && w2 == 0) sp.remove_ws = x != 0;
                else if (g == 5 && w2 == 0) sp.escape_ws = x != 0;
            }
        }
    }
    if (s == FL_OK && np == 0) s = fl_errorf(FL_ERR_FORMAT, "%s: no pieces (not a SentencePiece model?)", src);
    if (s == FL_OK && !have_trainer) s = fl_errorf(FL_ERR_FORMAT, "%s: no trainer_spec (not a SentencePiece model?)", src);
    if (s == FL_OK && sp.model_type != 2 && sp.model_type != 1) {
        static const char *mt[] = {"?", "UNIGRAM", "BPE", "WORD", "CHAR"};
        s = fl_errorf(FL_ERR_UNSUPPORTED, "%s: trainer_spec.model_type %s is not supported (only BPE and UNIGRAM)", src,
                      sp.model_type >= 1 && sp.model_type <= 4 ? mt[sp.model_type] : "unknown");
    }
    if (s == FL_OK && sp.model_type == 1) {
        s = spm_unigram(t, &sp, scores, np, src);
        free(scores);
        if (s != FL_OK) { fl_tok_free(t); return s; }
        *out = t;
        return FL_OK;
    }
    if (s == FL_OK && sp.charsmap_n && !(sp.name_n == 8 && !memcmp(sp.name, "identity", 8)))
        s = fl_errorf(FL_ERR_UNSUPPORTED, "%s: normalizer_spec \"%.*s\" (a precompiled Unicode normalization) is not supported", src,
                      (int)(sp.name_n > 40 ? 40 : sp.name_n), sp.name ? (const char *)sp.name : "");
    if (s == FL_OK) {
        t->score = scores;
        scores = NULL;
        s = fl_tok_build_vocab_map(t, 1);
    }
    free(scores);
    static const uint8_t mergeable[8] = {0, 1, 0, 0, 1, 1, 0, 0}; /* NORMAL, USER_DEFINED, UNUSED */
    if (s == FL_OK) s = fl_tok_build_score_merges(t, mergeable);
    if (s == FL_OK) s = sp_decoder(t, sp.dummy_prefix, src);
    int n_user = 0;
    for (int32_t i = 0; s == FL_OK && i < np; i++) n_user += t->type[i] == FL_SP_USER_DEFINED;
    if (s == FL_OK && n_user) {
        t->added = calloc((size_t)n_user, sizeof *t->added);
        if (!t->added) s = fl_errorf(FL_ERR_OOM, "%s: out of memory", src);
        for (int32_t i = 0; s == FL_OK && i < np; i++) {
            if (t->type[i] != FL_SP_USER_DEFINED) continue;
            size_t pl;
            const char *p = fl_tok_piece(t, i, &pl);
            fl_tok_added *a = &t->added[t->n_added++];
            if (!(a->s = malloc(pl + 1))) { s = fl_errorf(FL_ERR_OOM, "%s: out of memory", src); break; }
            memcpy(a->s, p, pl + 1);
            a->len = pl;
            a->id = i;
        }
        fl_tok_finish_added(t);
    }
    if (s != FL_OK) { fl_tok_free(t); return s; }
    t->byte_fallback = sp.byte_fallback;
    t->fuse_unk = 1;
    t->unk_id = -1;
    for (int32_t i = 0; i < np && t->unk_id < 0; i++)
        if (t->type[i] == FL_SP_UNKNOWN) t->unk_id = i;
    fl_tok_find_byte_pieces(t);
    fl_tok_detect_ws_split(t, sp.escape_ws ? "\xe2\x96\x81" : " ");
    t->spm_dummy_prefix = sp.dummy_prefix;
    t->spm_remove_extra_ws = sp.remove_ws;
    t->spm_escape_ws = sp.escape_ws;
    t->bos_id = sp.bos_id >= 0 && sp.bos_id < np ? sp.bos_id : -1;
    if (sp.eos_id >= 0 && sp.eos_id < np) t->eos_ids[0] = sp.eos_id, t->n_eos = 1;
    t->add_bos = t->bos_id >= 0; /* LlamaTokenizer default */
    *out = t;
    return FL_OK;
}

fl_status fl_tok_load_spm(fl_tokenizer **out, const char *path) {
    uint8_t *buf;
    size_t n;
    *out = NULL;
    FL_TRY(read_all(path, &buf, &n));
    fl_status s = fl_tok_load_spm_mem(out, buf, n, path);
    free(buf);
    return s;
}

/* ---- llama2.c tokenizer .bin ------------------------------------------------------------ */

fl_status fl_tok_load_llama2c(fl_tokenizer **out, const char *path) {
    uint8_t *buf;
    size_t n;
    *out = NULL;
    FL_TRY(read_all(path, &buf, &n));
    fl_status s = FL_OK;
    fl_tokenizer *t = fl_tok_new(FL_TOK_L2C);
    int32_t maxlen = 0, np = 0;
    size_t pos = 4, scap = 0;
    float *scores = NULL;
    if (!t) s = fl_errorf(FL_ERR_OOM, "%s: out of memory", path);
    else if (n < 4) s = fl_errorf(FL_ERR_FORMAT, "%s: too short for a llama2.c tokenizer (%zu bytes)", path, n);
    else {
        memcpy(&maxlen, buf, 4);
        if (maxlen <= 0 || maxlen > 4096) s = fl_errorf(FL_ERR_FORMAT, "%s: max_token_length %d is implausible (not a llama2.c tokenizer?)", path, (int)maxlen);
    }
    while (s == FL_OK && pos < n) {
        float sc;
        int32_t len;
        if (n - pos < 8) { s = fl_errorf(FL_ERR_FORMAT, "%s: truncated at token %d (offset %zu)", path, (int)np, pos); break; }
        memcpy(&sc, buf + pos, 4);
        memcpy(&len, buf + pos + 4, 4);
        pos += 8;
        if (len < 0 || len > maxlen || (size_t)len > n - pos) {
            s = fl_errorf(FL_ERR_FORMAT, "%s: token %d has length %d (max %d, %zu bytes left)", path, (int)np, (int)len, (int)maxlen, n - pos);
            break;
        }
        if ((s = fl_tok_set_piece(t, np, (const char *)buf + pos, (size_t)len)) != FL_OK) break;
        pos += (size_t)len;
        if ((size_t)np >= scap) {
            scap = scap ? scap * 2 : 1024;
            float *ns = realloc(scores, scap * sizeof *ns);
            if (!ns) { s = fl_errorf(FL_ERR_OOM, "%s: out of memory", path); break; }
            scores = ns;
        }
        scores[np++] = sc;
    }
    free(buf);
    if (s == FL_OK && np < 3) s = fl_errorf(FL_ERR_FORMAT, "%s: only %d tokens", path, (int)np);
    if (s == FL_OK) {
        t->score = scores;
        scores = NULL;
        s = fl_tok_build_vocab_map(t, 1);
    }
    free(scores);
    static const uint8_t all[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    if (s == FL_OK) s = fl_tok_build_score_merges(t, all);
    if (s == FL_OK) s = sp_decoder(t, 1, path);
    if (s != FL_OK) { fl_tok_free(t); return s; }
    t->type[0] = FL_SP_UNKNOWN;
    t->type[1] = t->type[2] = FL_SP_CONTROL;
    t->byte_fallback = 1;
    fl_tok_find_byte_pieces(t);
    t->bos_id = 1;
    t->eos_ids[0] = 2;
    t->n_eos = 1;
    t->add_bos = 1;
    fl_tok_detect_ws_split(t, " ");
    *out = t;
    return FL_OK;
}

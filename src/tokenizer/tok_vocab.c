/* fitllm tokenizers: vocabulary storage, string and pair hash maps, score-based
 * merge tables, UTF-8 helper. */
#include <stdlib.h>
#include <string.h>

#include "tok-impl.h"

int fl_tok_buf_put(fl_tok_buf *b, const void *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap * 2 : 256;
        while (nc < b->n + n + 1) nc *= 2;
        char *p = realloc(b->p, nc);
        if (!p) return -1;
        b->p = p;
        b->cap = nc;
    }
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

int fl_tok_ids_push(int32_t **ids, size_t *n, size_t *cap, int32_t id) {
    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 64;
        int32_t *p = realloc(*ids, nc * sizeof *p);
        if (!p) return -1;
        *ids = p;
        *cap = nc;
    }
    (*ids)[(*n)++] = id;
    return 0;
}

uint64_t fl_tok_hash(const char *s, size_t n) { /* FNV-1a 64 + final mix */
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ULL;
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ULL;
    return h ^ (h >> 32);
}

int fl_tok_utf8_len(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    int l;
    unsigned min;
    if (c < 0x80) return 1;
    else if (c >= 0xC2 && c < 0xE0) l = 2, min = 0x80;
    else if (c >= 0xE0 && c < 0xF0) l = 3, min = 0x800;
    else if (c >= 0xF0 && c < 0xF5) l = 4, min = 0x10000;
    else return 1;
    if ((size_t)l > n) return 1;
    unsigned cp = c & (0x3F >> (l - 1));
    for (int i = 1; i < l; i++) {
        if ((s[i] & 0xC0) != 0x80) return 1;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000)) return 1;
    return l;
}

fl_tokenizer *fl_tok_new(int kind) {
    fl_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->kind = kind;
    t->unk_id = -1;
    t->bos_id = -1;
    t->pad_id = -1;
    t->add_bos = 0;
    for (int i = 0; i < 256; i++) t->byte_id[i] = -1, t->bl_id[i] = -1;
    return t;
}

static fl_status fl_tok_grow(fl_tokenizer *t, int32_t id) {
    if (id < t->n_vocab) return FL_OK;
    int need = id + 1;
    if (need > t->vocab_cap) {
        int alloc = t->vocab_cap ? t->vocab_cap : 256;
        while (alloc < need) alloc *= 2;
        uint32_t *o = realloc(t->off, (size_t)alloc * sizeof *o);
        if (o) t->off = o;
        uint32_t *l = realloc(t->len, (size_t)alloc * sizeof *l);
        if (l) t->len = l;
        uint8_t *ty = realloc(t->type, (size_t)alloc);
        if (ty) t->type = ty;
        if (!o || !l || !ty) return fl_errorf(FL_ERR_OOM, "tokenizer: out of memory for %d pieces", need);
        if (t->score) {
            float *sc = realloc(t->score, (size_t)alloc * sizeof *sc);
            if (!sc) return fl_errorf(FL_ERR_OOM, "tokenizer: out of memory for %d pieces", need);
            t->score = sc;
        }
        t->vocab_cap = alloc;
    }
    for (int i = t->n_vocab; i < need; i++) {
        t->off[i] = 0;
        t->len[i] = UINT32_MAX;
        t->type[i] = FL_SP_NORMAL;
        if (t->score) t->score[i] = 0.0f;
    }
    t->n_vocab = need;
    return FL_OK;
}

fl_status fl_tok_set_piece(fl_tokenizer *t, int32_t id, const char *s, size_t n) {
    if (id < 0 || id >= (1 << 26)) return fl_errorf(FL_ERR_FORMAT, "tokenizer: token id %d out of range", (int)id);
    if (n >= (1u << 20)) return fl_errorf(FL_ERR_FORMAT, "tokenizer: piece of %zu bytes is too long", n);
    FL_TRY(fl_tok_grow(t, id));
    if (t->arena_n + n + 1 > t->arena_cap) {
        size_t nc = t->arena_cap ? t->arena_cap * 2 : 65536;
        while (nc < t->arena_n + n + 1) nc *= 2;
        if (nc > UINT32_MAX) return fl_errorf(FL_ERR_FORMAT, "tokenizer: vocabulary text exceeds 4 GiB");
        char *p = realloc(t->arena, nc);
        if (!p) return fl_errorf(FL_ERR_OOM, "tokenizer: out of memory for the vocabulary");
        t->arena = p;
        t->arena_cap = nc;
    }
    memcpy(t->arena + t->arena_n, s, n);
    t->arena[t->arena_n + n] = 0;
    t->off[id] = (uint32_t)t->arena_n;
    t->len[id] = (uint32_t)n;
    t->arena_n += n + 1;
    return FL_OK;
}

const char *fl_tok_piece(const fl_tokenizer *t, int32_t id, size_t *n) {
    if (id < 0 || id >= t->n_vocab || t->len[id] == UINT32_MAX) return NULL;
    if (n) *n = t->len[id];
    return t->arena + t->off[id];
}

fl_status fl_tok_build_vocab_map(fl_tokenizer *t, int keep_first) {
    free(t->vocab.slot);
    uint32_t cap = 64;
    while (cap < (uint32_t)t->n_vocab * 2u + 2) cap *= 2;
    t->vocab.slot = malloc((size_t)cap * sizeof(int32_t));
    if (!t->vocab.slot) return fl_errorf(FL_ERR_OOM, "tokenizer: out of memory for the vocabulary map");
    memset(t->vocab.slot, 0xff, (size_t)cap * sizeof(int32_t));
    t->vocab.mask = cap - 1;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        if (t->len[id] == UINT32_MAX) continue;
        const char *s = t->arena + t->off[id];
        size_t n = t->len[id];
        uint32_t h = (uint32_t)fl_tok_hash(s, n) & t->vocab.mask;
        for (;;) {
            int32_t o = t->vocab.slot[h];
            if (o < 0) { t->vocab.slot[h] = id; break; }
            if (t->len[o] == n && memcmp(t->arena + t->off[o], s, n) == 0) {
                if (!keep_first) t->vocab.slot[h] = id;
                break;
            }
            h = (h + 1) & t->vocab.mask;
        }
    }
    return FL_OK;
}

int32_t fl_tok_lookup(const fl_tokenizer *t, const char *s, size_t n) {
    if (!t->vocab.slot) return -1;
    uint32_t h = (uint32_t)fl_tok_hash(s, n) & t->vocab.mask;
    for (;;) {
        int32_t o = t->vocab.slot[h];
        if (o < 0) return -1;
        if (t->len[o] == n && memcmp(t->arena + t->off[o], s, n) == 0) return o;
        h = (h + 1) & t->vocab.mask;
    }
}

static inline uint32_t fl_tok_pairhash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return (uint32_t)k;
}

fl_status fl_tok_pairmap_init(fl_tokenizer *t, size_t expected) {
    free(t->merges.slot);
    size_t cap = 64;
    while (cap < expected * 2 + 2) cap *= 2;
    if (cap > (1u << 30)) return fl_errorf(FL_ERR_FORMAT, "tokenizer: too many merges (%zu)", expected);
    t->merges.slot = malloc(cap * sizeof(fl_tok_pair));
    if (!t->merges.slot) return fl_errorf(FL_ERR_OOM, "tokenizer: out of memory for %zu merges", expected);
    for (size_t i = 0; i < cap; i++) t->merges.slot[i].key = UINT64_MAX;
    t->merges.mask = (uint32_t)(cap - 1);
    t->merges.n = 0;
    return FL_OK;
}

fl_status fl_tok_pairmap_put(fl_tokenizer *t, int32_t a, int32_t b, float prio, int32_t id) {
    fl_tok_pairmap *m = &t->merges;
    if ((size_t)(m->n + 1) * 2 > (size_t)m->mask + 1) { /* grow */
        fl_tok_pairmap old = *m;
        m->slot = NULL;
        FL_TRY(fl_tok_pairmap_init(t, (size_t)(old.mask + 1)));
        for (uint32_t i = 0; i <= old.mask; i++)
            if (old.slot[i].key != UINT64_MAX) {
                uint32_t h = fl_tok_pairhash(old.slot[i].key) & m->mask;
                while (m->slot[h].key != UINT64_MAX) h = (h + 1) & m->mask;
                m->slot[h] = old.slot[i];
                m->n++;
            }
        free(old.slot);
    }
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    uint32_t h = fl_tok_pairhash(key) & m->mask;
    while (m->slot[h].key != UINT64_MAX && m->slot[h].key != key) h = (h + 1) & m->mask;
    if (m->slot[h].key == key) {
        if (prio < m->slot[h].prio) m->slot[h].prio = prio, m->slot[h].id = id;
        return FL_OK;
    }
    m->slot[h].key = key;
    m->slot[h].prio = prio;
    m->slot[h].id = id;
    m->n++;
    return FL_OK;
}

const fl_tok_pair *fl_tok_pairmap_get(const fl_tokenizer *t, int32_t a, int32_t b) {
    const fl_tok_pairmap *m = &t->merges;
    if (!m->slot) return NULL;
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    uint32_t h = fl_tok_pairhash(key) & m->mask;
    for (;;) {
        const fl_tok_pair *p = &m->slot[h];
        if (p->key == key) return p;
        if (p->key == UINT64_MAX) return NULL;
        h = (h + 1) & m->mask;
    }
}

fl_status fl_tok_build_score_merges(fl_tokenizer *t, const uint8_t mergeable[8]) {
    FL_TRY(fl_tok_pairmap_init(t, (size_t)t->n_vocab * 2));
    for (int32_t id = 0; id < t->n_vocab; id++) {
        size_t n;
        const char *s = fl_tok_piece(t, id, &n);
        if (!s || n < 2 || !mergeable[t->type[id] & 7]) continue;
        for (size_t k = 1; k < n; k++) {
            int32_t l = fl_tok_lookup(t, s, k);
            if (l < 0 || !mergeable[t->type[l] & 7]) continue;
            int32_t r = fl_tok_lookup(t, s + k, n - k);
            if (r < 0 || !mergeable[t->type[r] & 7]) continue;
            FL_TRY(fl_tok_pairmap_put(t, l, r, -t->score[id], id));
        }
    }
    return FL_OK;
}

void fl_tok_find_byte_pieces(fl_tokenizer *t) {
    static const char hx[] = "0123456789ABCDEF";
    for (int b = 0; b < 256; b++) {
        char s[7] = {'<', '0', 'x', hx[b >> 4], hx[b & 15], '>', 0};
        t->byte_id[b] = fl_tok_lookup(t, s, 6);
    }
}

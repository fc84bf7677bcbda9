/* fitllm tokenizers: the BPE engine shared by every family.
 *
 * A word is a doubly linked list of symbols (ids) over an array; candidate
 * merges of adjacent symbols live in a binary min-heap ordered by (priority,
 * position of the left symbol). Popping an entry whose symbols changed since
 * it was pushed is skipped (lazy deletion). This is exactly the order of HF
 * tokenizers' Word::merge_all (rank, then leftmost) and of sentencepiece's
 * bpe_model.cc agenda (highest score, then leftmost), in O(n log n).
 */
#include <stdlib.h>
#include <string.h>

#include "tok-impl.h"

typedef struct {
    float prio;
    int32_t pos, left, right, id;
} fl_tok_cand;

struct fl_tok_work {
    int32_t *sym, *prev, *next;
    size_t sym_cap;
    fl_tok_cand *heap;
    size_t heap_n, heap_cap;
};

fl_tok_work *fl_tok_work_new(void) { return calloc(1, sizeof(fl_tok_work)); }

void fl_tok_work_free(fl_tok_work *w) {
    if (!w) return;
    free(w->sym);
    free(w->prev);
    free(w->next);
    free(w->heap);
    free(w);
}

static int fl_tok_work_reserve(fl_tok_work *w, size_t n) {
    if (n <= w->sym_cap) return 0;
    size_t c = w->sym_cap ? w->sym_cap : 256;
    while (c < n) c *= 2;
    int32_t *a = realloc(w->sym, c * sizeof *a);
    if (a) w->sym = a;
    int32_t *b = realloc(w->prev, c * sizeof *b);
    if (b) w->prev = b;
    int32_t *d = realloc(w->next, c * sizeof *d);
    if (d) w->next = d;
    if (!a || !b || !d) return -1;
    w->sym_cap = c;
    return 0;
}

static inline int fl_tok_less(const fl_tok_cand *a, const fl_tok_cand *b) {
    return a->prio < b->prio || (a->prio == b->prio && a->pos < b->pos);
}

static int fl_tok_heap_push(fl_tok_work *w, fl_tok_cand c) {
    if (w->heap_n == w->heap_cap) {
        size_t nc = w->heap_cap ? w->heap_cap * 2 : 256;
        fl_tok_cand *p = realloc(w->heap, nc * sizeof *p);
        if (!p) return -1;
        w->heap = p;
        w->heap_cap = nc;
    }
    size_t i = w->heap_n++;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (!fl_tok_less(&c, &w->heap[up])) break;
        w->heap[i] = w->heap[up];
        i = up;
    }
    w->heap[i] = c;
    return 0;
}

static fl_tok_cand fl_tok_heap_pop(fl_tok_work *w) {
    fl_tok_cand top = w->heap[0], last = w->heap[--w->heap_n];
    size_t i = 0, n = w->heap_n;
    for (;;) {
        size_t l = 2 * i + 1;
        if (l >= n) break;
        if (l + 1 < n && fl_tok_less(&w->heap[l + 1], &w->heap[l])) l++;
        if (!fl_tok_less(&w->heap[l], &last)) break;
        w->heap[i] = w->heap[l];
        i = l;
    }
    if (n) w->heap[i] = last;
    return top;
}

static int fl_tok_try_pair(const fl_tokenizer *t, fl_tok_work *w, int32_t pos) {
    if (pos < 0) return 0;
    int32_t nx = w->next[pos];
    if (nx < 0) return 0;
    const fl_tok_pair *p = fl_tok_pairmap_get(t, w->sym[pos], w->sym[nx]);
    if (!p) return 0;
    fl_tok_cand c = {p->prio, pos, w->sym[pos], w->sym[nx], p->id};
    return fl_tok_heap_push(w, c);
}

/* Longest user-defined piece (SentencePiece) starting at s, 0 if none. */
static size_t fl_tok_user_match(const fl_tokenizer *t, const char *s, size_t n, int32_t *id) {
    if (!t->added_first[(unsigned char)s[0]]) return 0;
    for (int i = 0; i < t->n_added; i++) /* longest first */
        if (t->added[i].len <= n && memcmp(t->added[i].s, s, t->added[i].len) == 0) {
            *id = t->added[i].id;
            return t->added[i].len;
        }
    return 0;
}

fl_status fl_tok_bpe_word(const fl_tokenizer *t, fl_tok_work *w, const char *s, size_t n, int32_t **ids,
                          size_t *n_ids, size_t *cap) {
    if (n == 0) return FL_OK;
    const int bytelevel = t->kind == FL_TOK_BPE_BL;
    if (t->ignore_merges && !bytelevel) {
        int32_t id = fl_tok_lookup(t, s, n);
        if (id >= 0) return fl_tok_ids_push(ids, n_ids, cap, id) ? fl_errorf(FL_ERR_OOM, "tokenizer: out of memory") : FL_OK;
    }
    if (fl_tok_work_reserve(w, n)) return fl_errorf(FL_ERR_OOM, "tokenizer: out of memory for a %zu-byte word", n);
    /* initial symbols */
    int32_t ns = 0;
    int prev_unk = 0;
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        if (bytelevel) {
            int32_t id = t->bl_id[u[i]];
            i++;
            if (id >= 0) w->sym[ns++] = id;
            continue;
        }
        int32_t id = -1;
        size_t cl = 0;
        if (t->kind == FL_TOK_SPM && t->n_added) cl = fl_tok_user_match(t, s + i, n - i, &id);
        if (!cl) {
            cl = (size_t)fl_tok_utf8_len(u + i, n - i);
            id = fl_tok_lookup(t, s + i, cl);
            if (id >= 0 && t->kind == FL_TOK_SPM && (t->type[id] == FL_SP_CONTROL || t->type[id] == FL_SP_BYTE ||
                                                    t->type[id] == FL_SP_UNKNOWN))
                id = -1; /* sentencepiece: only NORMAL / USER_DEFINED / UNUSED pieces match text */
        }
        if (id >= 0) {
            w->sym[ns++] = id;
            prev_unk = 0;
        } else {
            int all = t->byte_fallback;
            for (size_t k = 0; all && k < cl; k++) all = t->byte_id[u[i + k]] >= 0;
            if (all) {
                for (size_t k = 0; k < cl; k++) w->sym[ns++] = t->byte_id[u[i + k]];
                prev_unk = 0;
            } else if (t->unk_id >= 0) {
                if (!(t->fuse_unk && prev_unk)) w->sym[ns++] = t->unk_id;
                prev_unk = 1;
            }
        }
        i += cl;
    }
    if (bytelevel && t->ignore_merges) {
        /* the word is in the vocab as a whole: HF checks this on the mapped string */
        char tmp[256];
        size_t tl = 0;
        int fits = 1;
        for (size_t i = 0; i < n && fits; i++) {
            uint16_t cp = t->b2u[u[i]];
            if (tl + 2 > sizeof tmp) fits = 0;
            else if (cp < 0x80) tmp[tl++] = (char)cp;
            else tmp[tl++] = (char)(0xC0 | (cp >> 6)), tmp[tl++] = (char)(0x80 | (cp & 0x3F));
        }
        int32_t id = fits ? fl_tok_lookup(t, tmp, tl) : -1;
        if (id >= 0) return fl_tok_ids_push(ids, n_ids, cap, id) ? fl_errorf(FL_ERR_OOM, "tokenizer: out of memory") : FL_OK;
    }
    for (int32_t i = 0; i < ns; i++) w->prev[i] = i - 1, w->next[i] = i + 1 < ns ? i + 1 : -1;
    w->heap_n = 0;
    for (int32_t i = 0; i + 1 < ns; i++)
        if (fl_tok_try_pair(t, w, i)) return fl_errorf(FL_ERR_OOM, "tokenizer: out of memory");
    while (w->heap_n) {
        fl_tok_cand c = fl_tok_heap_pop(w);
        int32_t r = w->next[c.pos];
        if (w->sym[c.pos] != c.left || r < 0 || w->sym[r] != c.right) continue; /* stale */
        w->sym[c.pos] = c.id;
        w->sym[r] = -2; /* dead */
        int32_t rn = w->next[r];
        w->next[c.pos] = rn;
        if (rn >= 0) w->prev[rn] = c.pos;
        if (w->prev[c.pos] >= 0 && fl_tok_try_pair(t, w, w->prev[c.pos])) return fl_errorf(FL_ERR_OOM, "tokenizer: out of memory");
        if (fl_tok_try_pair(t, w, c.pos)) return fl_errorf(FL_ERR_OOM, "tokenizer: out of memory");
    }
    for (int32_t i = ns ? 0 : -1; i >= 0; i = w->next[i])
        if (fl_tok_ids_push(ids, n_ids, cap, w->sym[i])) return fl_errorf(FL_ERR_OOM, "tokenizer: out of memory");
    return FL_OK;
}

/* fitllm tokenizers: internal representation shared by the loaders, the BPE
 * engine, the pre-tokenizers and the decoders (not public API).
 *
 * Every family is reduced to the same pieces:
 *   - a vocabulary: id -> piece bytes (arena), piece bytes -> id (hash map);
 *   - a pair map (left id, right id) -> (priority, merged id): HF merges give
 *     priority = rank; SentencePiece / llama2.c give priority = -score of the
 *     merged piece (built from every split of every piece);
 *   - one BPE engine (tok_bpe.c): lowest priority first, leftmost on ties,
 *     which is both HF's and sentencepiece's order;
 *   - a front end (normalizer + pre-tokenizer, tok_pretok.c) and a decoder
 *     chain (tok_decode.c) described by small enums, not by code per family.
 */
#ifndef FITLLM_TOK_IMPL_H
#define FITLLM_TOK_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/json.h"
#include "fitllm/tokenizer.h"

enum { FL_TOK_BYTES, FL_TOK_BPE_BL, FL_TOK_BPE_SP, FL_TOK_SPM, FL_TOK_L2C };

/* SentencePiece piece types (sentencepiece_model.proto numbering). */
enum { FL_SP_NORMAL = 1, FL_SP_UNKNOWN = 2, FL_SP_CONTROL = 3, FL_SP_USER_DEFINED = 4, FL_SP_UNUSED = 5, FL_SP_BYTE = 6 };

/* ---- growable byte buffer ------------------------------------------------------- */
typedef struct {
    char *p;
    size_t n, cap;
} fl_tok_buf;
int fl_tok_buf_put(fl_tok_buf *b, const void *s, size_t n); /* 0 ok, -1 OOM */
int fl_tok_ids_push(int32_t **ids, size_t *n, size_t *cap, int32_t id);

/* ---- hash maps ---------------------------------------------------------------------- */
typedef struct {
    int32_t *slot; /* id or -1 */
    uint32_t mask;
} fl_tok_strmap;

typedef struct {
    uint64_t key; /* (uint64)left << 32 | right; UINT64_MAX = empty */
    float prio;
    int32_t id;
} fl_tok_pair;

typedef struct {
    fl_tok_pair *slot;
    uint32_t mask, n;
} fl_tok_pairmap;

uint64_t fl_tok_hash(const char *s, size_t n);

/* ---- decoder chain ---------------------------------------------------------------- */
enum { FL_DEC_REPLACE, FL_DEC_BYTEFALLBACK, FL_DEC_FUSE, FL_DEC_STRIP, FL_DEC_BYTELEVEL, FL_DEC_METASPACE };
typedef struct {
    int type;
    char *a, *b; /* REPLACE: pattern -> content; STRIP: content char */
    int start, stop;  /* STRIP */
    int prepend;      /* METASPACE: strip the leading space of the first token */
} fl_tok_dec;

/* ---- normalizer / pre-tokenizer steps ------------------------------------------------ */
enum { FL_NORM_PREPEND, FL_NORM_REPLACE };
typedef struct {
    int type;
    char *a, *b; /* PREPEND: a; REPLACE: a -> b */
} fl_tok_norm;

enum { FL_PRE_BYTELEVEL, FL_PRE_METASPACE, FL_PRE_SPLIT };
enum { FL_PREPEND_ALWAYS, FL_PREPEND_FIRST, FL_PREPEND_NEVER };
typedef struct {
    int type;
    int add_prefix_space, use_regex; /* BYTELEVEL */
    char *repl;                      /* METASPACE replacement */
    int prepend_scheme, split;       /* METASPACE */
    void *re;                        /* BYTELEVEL (use_regex) / SPLIT: pcre2_code_8 */
    int invert;                      /* SPLIT: only false supported */
} fl_tok_pre;

typedef struct {
    char *s;
    size_t len;
    int32_t id;
    uint8_t special, normalized, lstrip, rstrip, single_word;
} fl_tok_added;

struct fl_tokenizer {
    int kind;
    int n_vocab; /* max id + 1 */
    int vocab_cap;
    /* id -> piece (arena offsets); len UINT32_MAX = no piece with this id */
    char *arena;
    size_t arena_n, arena_cap;
    uint32_t *off, *len;
    uint8_t *type;    /* FL_SP_* per id (HF: NORMAL, CONTROL for special added tokens) */
    float *score;     /* SPM / llama2.c, else NULL */
    fl_tok_strmap vocab;
    fl_tok_pairmap merges;
    int32_t byte_id[256]; /* <0xNN> pieces (-1 if absent) */
    int byte_fallback, unk_id, fuse_unk, ignore_merges;
    /* byte-level */
    int32_t bl_id[256];       /* id of the single byte-level char of byte b */
    uint16_t b2u[256];        /* byte -> code point */
    int16_t u2b[512];         /* code point (< 512) -> byte or -1 */
    /* front end (HF) */
    fl_tok_norm *norm;
    int n_norm;
    fl_tok_pre *pre;
    int n_pre;
    /* SentencePiece .model normalizer */
    int spm_dummy_prefix, spm_remove_extra_ws, spm_escape_ws;
    /* added tokens, longest first */
    fl_tok_added *added;
    int n_added, n_added_norm; /* n_added_norm: how many have .normalized */
    uint8_t added_first[256]; /* first-byte filter */
    /* decoder chain; n_dec == 0 and dec_join_space: join tokens with ' ' (HF: no decoder) */
    fl_tok_dec *dec;
    int n_dec, dec_join_space;
    /* BOS / EOS */
    int bos_id, add_bos, add_eos;
    int32_t eos_ids[8];
    int n_eos;
};

/* ---- vocabulary (tok_vocab.c) ---------------------------------------------------------- */
fl_tokenizer *fl_tok_new(int kind);
/* Set piece for id (grows arrays); returns FL_OK or FL_ERR_OOM. Does not touch the map. */
fl_status fl_tok_set_piece(fl_tokenizer *t, int32_t id, const char *s, size_t n);
const char *fl_tok_piece(const fl_tokenizer *t, int32_t id, size_t *n); /* NULL if none */
/* Build the string map over all ids with a piece (later ids win on duplicates, or
 * earlier ones when keep_first). */
fl_status fl_tok_build_vocab_map(fl_tokenizer *t, int keep_first);
int32_t fl_tok_lookup(const fl_tokenizer *t, const char *s, size_t n); /* -1 if absent */
fl_status fl_tok_pairmap_init(fl_tokenizer *t, size_t expected);
/* Insert (a,b)->(prio,id); an existing key keeps the better (lower) prio. */
fl_status fl_tok_pairmap_put(fl_tokenizer *t, int32_t a, int32_t b, float prio, int32_t id);
const fl_tok_pair *fl_tok_pairmap_get(const fl_tokenizer *t, int32_t a, int32_t b);
/* Score-based merges (SentencePiece, llama2.c): for every piece p with
 * mergeable[type] and every split p = l + r with l, r pieces: (l, r) -> (-score[p], p). */
fl_status fl_tok_build_score_merges(fl_tokenizer *t, const uint8_t mergeable[8]);
/* Fill byte_id[] from "<0xNN>" pieces. */
void fl_tok_find_byte_pieces(fl_tokenizer *t);
/* Length of the UTF-8 char at s (1..4), 1 for an invalid or truncated sequence. */
int fl_tok_utf8_len(const unsigned char *s, size_t n);

/* ---- BPE engine (tok_bpe.c) --------------------------------------------------------- */
typedef struct fl_tok_work fl_tok_work; /* per-call scratch */
fl_tok_work *fl_tok_work_new(void);
void fl_tok_work_free(fl_tok_work *w);
/* BPE-encode one word: initial symbols are UTF-8 chars looked up in the vocab
 * (byte fallback / unk otherwise), merged by the pair map; appends ids. */
fl_status fl_tok_bpe_word(const fl_tokenizer *t, fl_tok_work *w, const char *s, size_t n, int32_t **ids,
                          size_t *n_ids, size_t *cap);

/* ---- front ends (tok_pretok.c) ---------------------------------------------------------- */
void fl_tok_bytelevel_tables(fl_tokenizer *t);
/* Compile a PCRE2 pattern (UTF, UCP, invalid UTF allowed, JIT); NULL + error on failure. */
fl_status fl_tok_regex_compile(const char *pattern, size_t n, const char *src, void **out);
void fl_tok_regex_free(void *re);
/* Encode a text segment that contains no added tokens (HF: normalizer,
 * pre-tokenizer, BPE; SPM / llama2.c: their own normalization, BPE). first:
 * the segment starts at offset 0 of the input. */
fl_status fl_tok_encode_segment(const fl_tokenizer *t, fl_tok_work *w, const char *s, size_t n, int first,
                                int32_t **ids, size_t *n_ids, size_t *cap);

/* Split s on added tokens (those with .normalized == normalized): matched
 * tokens are appended as ids, the text between them goes to fn. */
typedef fl_status (*fl_tok_seg_fn)(void *ctx, const char *s, size_t n, int at0);
fl_status fl_tok_split_added(const fl_tokenizer *t, const char *s, size_t n, int normalized, fl_tok_seg_fn fn, void *ctx,
                             int32_t **ids, size_t *n_ids, size_t *cap);

/* ---- loaders ---------------------------------------------------------------------------- */
fl_status fl_tok_load_hf_json(fl_tokenizer **out, const fl_json *root, const char *src);
fl_status fl_tok_load_hf_json_mem(fl_tokenizer **out, const char *text, size_t n, const char *src);
fl_status fl_tok_load_spm(fl_tokenizer **out, const char *path);
fl_status fl_tok_load_spm_mem(fl_tokenizer **out, const uint8_t *p, size_t n, const char *src);
fl_status fl_tok_load_llama2c(fl_tokenizer **out, const char *path);
/* Sort added tokens longest first and fill the first-byte filter. */
void fl_tok_finish_added(fl_tokenizer *t);

/* ---- decoding (tok_decode.c) ------------------------------------------------------------- */
fl_status fl_tok_decode_impl(const fl_tokenizer *t, const int32_t *ids, size_t n, int skip_special, char **text,
                             size_t *len);

#endif

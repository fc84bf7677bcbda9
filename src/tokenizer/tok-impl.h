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
enum { FL_NORM_PREPEND, FL_NORM_REPLACE, FL_NORM_PRECOMPILED, FL_NORM_STRIP };
typedef struct {
    int type;
    char *a, *b; /* PREPEND: a; REPLACE: a -> b */
    int left, right; /* STRIP */
} fl_tok_norm;

enum { FL_PRE_BYTELEVEL, FL_PRE_METASPACE, FL_PRE_SPLIT, FL_PRE_WSPLIT };
enum { FL_PREPEND_ALWAYS, FL_PREPEND_FIRST, FL_PREPEND_NEVER };
typedef struct {
    int type;
    int add_prefix_space, use_regex; /* BYTELEVEL */
    char *repl;                      /* METASPACE replacement */
    int prepend_scheme, split;       /* METASPACE */
    void *re;                        /* BYTELEVEL (use_regex) / SPLIT: pcre2_code_8 */
    int invert;                      /* SPLIT: only false supported */
} fl_tok_pre;

/* Byte trie of the Unigram pieces: node 0 is the root; (node, byte) -> child in a hash. */
typedef struct {
    uint64_t *key; /* (uint64)node << 8 | byte; UINT64_MAX = empty */
    int32_t *child;
    uint32_t mask, n_edges;
    int32_t *piece; /* per node: id of the piece ending here, -1 if none */
    int32_t n_nodes, cap_nodes;
} fl_tok_trie;

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
    /* Exact speed-up for texts BPE'd as one long word (SentencePiece style):
     * when no piece has ws_split inside it after a different char, no merge
     * can cross the start of a ws_split run, so the text is cut there. */
    char ws_split[4];
    size_t ws_split_n; /* 0 = off */
    /* byte-level */
    int32_t bl_id[256];       /* id of the single byte-level char of byte b */
    uint16_t b2u[256];        /* byte -> code point */
    int16_t u2b[512];         /* code point (< 512) -> byte or -1 */
    /* front end (HF) */
    fl_tok_norm *norm;
    int n_norm;
    fl_tok_pre *pre;
    int n_pre;
    /* Unigram (SentencePiece): Viterbi over the trie instead of BPE */
    int unigram, uni_f32;  /* uni_f32: sentencepiece sums path scores in float, HF in double */
    double *uscore;        /* per model id < uni_n: lattice score (NaN: not in the lattice) */
    int32_t uni_n;
    double unk_score, max_score;
    fl_tok_trie trie;
    /* precompiled charsmap: darts-clone double array + NUL-terminated replacement strings */
    uint32_t *cm_units;
    size_t cm_n;
    char *cm_str;
    size_t cm_str_n;
    void *grapheme_re; /* HF Precompiled: PCRE2 \X (extended grapheme clusters) */
    /* SentencePiece .model normalizer */
    int spm_dummy_prefix, spm_remove_extra_ws, spm_escape_ws;
    /* added tokens, longest first */
    fl_tok_added *added;
    int n_added, n_added_norm; /* n_added_norm: how many have .normalized */
    uint8_t added_first[256]; /* first-byte filter */
    /* decoder chain; n_dec == 0 and dec_join_space: join tokens with ' ' (HF: no decoder) */
    fl_tok_dec *dec;
    int n_dec, dec_join_space;
    /* BOS / EOS / PAD */
    int bos_id, add_bos, add_eos, pad_id;
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

/* Same, cutting a long text before each whitespace marker run when exact (see ws_split). */
fl_status fl_tok_bpe_text(const fl_tokenizer *t, fl_tok_work *w, const char *s, size_t n, int32_t **ids,
                          size_t *n_ids, size_t *cap);
/* Enable ws_split for marker ws ("\xe2\x96\x81" or " ") if the vocabulary allows it. */
void fl_tok_detect_ws_split(fl_tokenizer *t, const char *ws);

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
/* T5Tokenizer: n sentinel tokens <extra_id_{n-1}> .. <extra_id_0> after the pieces (UNIGRAM .model only). */
fl_status fl_tok_spm_add_extra_ids(fl_tokenizer *t, int n);
fl_status fl_tok_load_llama2c(fl_tokenizer **out, const char *path);
/* Sort added tokens longest first and fill the first-byte filter. */
void fl_tok_finish_added(fl_tokenizer *t);

/* ---- Unigram (tok_unigram.c) ------------------------------------------------------------- */
/* Take a SentencePiece precompiled charsmap blob (uint32 trie size, trie, strings); copies it. */
fl_status fl_tok_charsmap_set(fl_tokenizer *t, const uint8_t *blob, size_t n, const char *src);
/* HF Precompiled normalizer over a whole string; *out is appended to. */
int fl_tok_charsmap_normalize(const fl_tokenizer *t, const char *s, size_t n, fl_tok_buf *out);
/* After the vocabulary, scores and types are set: unk score, trie. hf: HF's rules (every piece in
 * the lattice, min over all scores, double sums), else sentencepiece's (NORMAL + USER_DEFINED). */
fl_status fl_tok_unigram_finish(fl_tokenizer *t, int hf, const char *src);
/* Viterbi-segment one word (or, for sentencepiece, the whole normalized text); appends ids. */
fl_status fl_tok_unigram_word(const fl_tokenizer *t, const char *s, size_t n, int32_t **ids, size_t *n_ids, size_t *cap);
/* sentencepiece's normalizer (charsmap, dummy prefix, extra-whitespace removal, escaping) + Viterbi. */
fl_status fl_tok_encode_spm_unigram(const fl_tokenizer *t, const char *s, size_t n, int32_t **ids, size_t *n_ids,
                                    size_t *cap);
/* tokenizer.json model "Unigram": vocab [[piece, score], ...], unk_id, byte_fallback. */
fl_status fl_tok_load_unigram_vocab(fl_tokenizer *t, const fl_json *model, const char *src);
/* Unicode White_Space (Rust char::is_whitespace). */
int fl_tok_is_uspace(uint32_t cp);
/* Decode the UTF-8 char at s (len from fl_tok_utf8_len; an invalid byte gives 0xFFFFFFFF). */
uint32_t fl_tok_utf8_cp(const unsigned char *s, size_t n, int *len);

/* ---- decoding (tok_decode.c) ------------------------------------------------------------- */
fl_status fl_tok_decode_impl(const fl_tokenizer *t, const int32_t *ids, size_t n, int skip_special, char **text,
                             size_t *len);

#endif

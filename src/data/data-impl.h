/* fitllm data: pieces shared by the dataset readers, the cache and the loader
 * (not public API). */
#ifndef FITLLM_DATA_INTERNAL_H
#define FITLLM_DATA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/data.h"
#include "fitllm/status.h"
#include "fitllm/tokenizer.h"

/* Bumped whenever tokenization, formatting or the cache layout changes: old
 * cache files then simply miss. */
#define FL_DATA_FORMAT_VERSION 1

/* fl_data_fingerprint / fl_s2s_fingerprint: 64-bit FNV-1a over 32-bit values (with a shift to spread the high
 * bits), taken by value so that every machine gets the same number for the same ids. */
static inline uint64_t fl_data_fp_words(uint64_t h, const int32_t *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        h = (h ^ (uint32_t)p[i]) * 0x100000001b3ULL;
        h ^= h >> 29;
    }
    return h;
}
static inline uint64_t fl_data_fp_count(uint64_t h, uint64_t v) {
    const int32_t w[2] = {(int32_t)(uint32_t)v, (int32_t)(uint32_t)(v >> 32)};
    return fl_data_fp_words(h, w, 2);
}

/* ---- one split's samples: tokens in two flat arrays ------------------------ */

typedef struct {
    int32_t *ids, *labels;   /* all tokens of all samples, back to back */
    size_t n_tok, cap_tok;
    int32_t *len, *plen;     /* per sample */
    size_t n, cap;
    fl_sample *samples;      /* views into ids/labels, built by fl_data_split_finish */
} fl_data_split_buf;

struct fl_dataset {
    fl_data_split_buf split[FL_SPLIT_COUNT];
    fl_data_stats stats;
    int ignore_index;        /* what masked labels hold (the loader pads targets with it) */
};

fl_status fl_data_split_push(fl_data_split_buf *b, const int32_t *ids, const int32_t *labels, int len, int plen);
fl_status fl_data_split_finish(fl_data_split_buf *b);
void fl_data_split_free(fl_data_split_buf *b);
/* Allocate an empty dataset. */
fl_status fl_data_new(fl_dataset **out);

/* ---- instruction records (Alpaca / JSON / Synthetic) ------------------------ */

typedef struct {
    char *instruction, *input, *output; /* input may be NULL (absent or null) */
} fl_data_record;

typedef struct {
    fl_data_record *r;
    size_t n, cap;
    size_t n_blank;          /* .jsonl: blank lines skipped */
} fl_data_records;

/* Parse a .json array of records / a .jsonl file (one object per line) held in
 * text[0..n). `source` names the file in errors, which give the record index
 * (0-based) or line (1-based) and what is wrong. */
fl_status fl_data_read_json(const char *text, size_t n, const char *source, fl_data_records *out);
fl_status fl_data_read_jsonl(const char *text, size_t n, const char *source, fl_data_records *out);
/* Dispatch on the file suffix (.json or .jsonl). */
fl_status fl_data_read_records(const char *text, size_t n, const char *source, fl_data_records *out);
fl_status fl_data_records_add(fl_data_records *rs, const char *instruction, const char *input, const char *output);
void fl_data_records_free(fl_data_records *rs);

/* Tokenize records into SFT samples (LitGPT SFTDataset) and append them to b. */
fl_status fl_data_sft_tokenize(const fl_data_records *rs, const size_t *order, size_t n, const fl_data_config *cfg,
                               const fl_tokenizer *tok, fl_data_split_buf *b, fl_data_stats *st, const char *source);

/* ---- torch.utils.data.random_split ------------------------------------------ */

/* torch.randperm(n, generator=torch.Generator().manual_seed(seed)) on the CPU. */
fl_status fl_data_torch_randperm(uint64_t seed, size_t n, size_t **perm);
/* Lengths random_split computes for fractions [1 - f, f] of n items. */
void fl_data_split_lengths(size_t n, float val_fraction, size_t *n_train, size_t *n_val);
/* The float as the shortest decimal that round-trips, then as a double (what
 * the same number typed in Python would be: 0.03865f -> 0.03865). */
double fl_data_float_to_double(float f);

/* ---- kinds -------------------------------------------------------------------- */

/* Read the bytes of all source files (for hashing and parsing). */
typedef struct {
    char path[4096];
    char *data;
    size_t len;
} fl_data_file;

typedef struct {
    fl_data_file *f;
    size_t n, cap;
} fl_data_files;

fl_status fl_data_file_read(const char *path, fl_data_file *out);
fl_status fl_data_files_add(fl_data_files *fs, const char *path);
void fl_data_files_free(fl_data_files *fs);

/* Collect the source files of a config (without tokenizing): JSON/Alpaca: the
 * file, or train + val of a folder; TextFiles: sorted *.txt of the folders.
 * n_train_files tells TextFiles/JSON which of fs belong to the train split. */
fl_status fl_data_sources(const fl_data_config *cfg, fl_data_files *fs, size_t *n_train_files);

fl_status fl_data_build_json(fl_dataset *d, const fl_data_config *cfg, const fl_tokenizer *tok,
                             const fl_data_files *fs, size_t n_train_files);
/* TextFiles: which text validates, in words (file names and how they were chosen), into buf. */
void fl_data_textfiles_describe(const fl_data_config *cfg, const fl_data_files *fs, size_t n_train_files, char *buf,
                                size_t n);
fl_status fl_data_build_textfiles(fl_dataset *d, const fl_data_config *cfg, const fl_tokenizer *tok,
                                  const fl_data_files *fs, size_t n_train_files);
fl_status fl_data_build_synthetic(fl_dataset *d, const fl_data_config *cfg, const fl_tokenizer *tok);
/* Generate the synthetic records of one split (exposed for tests). */
fl_status fl_data_synthetic_records(uint64_t seed, fl_split split, size_t n, fl_data_records *out);

/* The loaders' order for one epoch: identity, or a Fisher-Yates shuffle driven by splitmix64(seed, epoch). */
void fl_data_epoch_perm(uint64_t seed, int64_t epoch, int shuffle, size_t n, size_t *perm);

/* ---- hashing and cache --------------------------------------------------------- */

typedef struct {
    uint64_t a, b, len;
    uint8_t buf[8];
    int nbuf;
} fl_data_hash;

void fl_data_hash_init(fl_data_hash *h, uint64_t seed);
void fl_data_hash_update(fl_data_hash *h, const void *p, size_t n);
void fl_data_hash_u64(fl_data_hash *h, uint64_t v);
void fl_data_hash_str(fl_data_hash *h, const char *s); /* length-prefixed */
void fl_data_hash_final(const fl_data_hash *h, uint64_t out[2]);

/* Fingerprint of a tokenizer (kind, sizes, special ids, every piece decoded,
 * a probe encoding with default BOS/EOS). */
fl_status fl_data_tok_fingerprint(const fl_tokenizer *tok, uint64_t out[2]);
/* Cache key of a config + its sources + tokenizer. */
fl_status fl_data_cache_key(const fl_data_config *cfg, const fl_tokenizer *tok, const fl_data_files *fs,
                            uint64_t key[2]);
/* Path of the cache file for key in cfg->cache_dir. */
fl_status fl_data_cache_path(const fl_data_config *cfg, const uint64_t key[2], char *buf, size_t n);
/* FL_OK and a filled dataset on a valid hit; FL_ERR_NOT_FOUND on a miss;
 * FL_ERR_FORMAT if the file exists but is corrupt (the caller rebuilds). */
fl_status fl_data_cache_read(const char *path, const uint64_t key[2], fl_dataset *d);
fl_status fl_data_cache_write(const char *path, const uint64_t key[2], const fl_dataset *d);

/* ---- text helpers -------------------------------------------------------------- */

/* 1 if s[0..n) is valid UTF-8; else 0 and *bad = offset of the first bad byte. */
int fl_data_utf8_valid(const char *s, size_t n, size_t *bad);
/* Python's str.strip(): trim Unicode whitespace from both ends of valid UTF-8. */
void fl_data_strip(const char *s, size_t n, size_t *begin, size_t *end);

/* splitmix64 step. */
static inline uint64_t fl_data_splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
/* Unbiased integer in [0, n) (n > 0). */
static inline uint64_t fl_data_rand_below(uint64_t *s, uint64_t n) {
    uint64_t lim = UINT64_MAX - UINT64_MAX % n;
    uint64_t r;
    do r = fl_data_splitmix64(s); while (r >= lim);
    return r % n;
}

#endif

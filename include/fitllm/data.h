/* fitllm: datasets and micro-batches (LitGPT's data modules).
 *
 * A dataset is a list of tokenized samples, each with its input ids and its
 * labels (same length, unshifted, as LitGPT: labels == ids except masked prompt
 * positions, which hold ignore_index). The loader turns samples into (B, T)
 * micro-batches for fl_model_forward: ids = sample[0..n-2], targets =
 * labels[1..n-1] (the next-token shift), padded to the longest sample in the
 * micro-batch with pad id 0 and target ignore_index.
 */
#ifndef FITLLM_DATA_H
#define FITLLM_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/status.h"
#include "fitllm/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { FL_DATA_SYNTHETIC = 0, FL_DATA_ALPACA, FL_DATA_JSON, FL_DATA_TEXTFILES, FL_DATA_KIND_COUNT } fl_data_kind;
typedef enum { FL_SPLIT_TRAIN = 0, FL_SPLIT_VAL, FL_SPLIT_COUNT } fl_split;

typedef struct {
    fl_data_kind kind;
    char json_path[4096];       /* Alpaca/JSON: .json array, .jsonl, or folder with train.json/val.json */
    char train_data_path[4096]; /* TextFiles: folder of .txt for training */
    char val_data_path[4096];   /* TextFiles: folder for validation ("" = split from train) */
    char prompt_style[32];      /* "alpaca" (default) */
    int mask_prompt;            /* LitGPT default false */
    int ignore_index;           /* default -100 */
    float val_split_fraction;   /* default 0.05 (Alpaca: 0.03865 as LitGPT) */
    uint64_t seed;              /* default 42 */
    int max_seq_length;         /* samples longer are truncated (counted); -1 = no limit */
    int synthetic_train, synthetic_val; /* Synthetic sizes (defaults 2000 / 100) */
    char lengths[4096];         /* Synthetic: a length table (fitllm/lengths.h); "" = the built-in tasks */
    char cache_dir[4096];       /* tokenized-dataset cache ("" = no cache) */
    /* an encoder-decoder's pairs (fl_s2s_config): tokens incl. EOS, <= 0 no limit (defaults 512 / 128) */
    int max_source_length, max_target_length;
} fl_data_config;

void fl_data_config_default(fl_data_config *c, fl_data_kind kind);
const char *fl_data_kind_name(fl_data_kind k); /* "Synthetic", "Alpaca", "JSON", "TextFiles" */

typedef struct {
    int32_t *ids;     /* (len) */
    int32_t *labels;  /* (len) */
    int len;
    int prompt_len;   /* tokens belonging to the prompt */
} fl_sample;

typedef struct {
    size_t n_samples[FL_SPLIT_COUNT];
    size_t n_truncated;       /* samples cut to max_seq_length */
    size_t n_tokens;          /* all tokens of all samples (after truncation) */
    int cache_hit;            /* loaded from the cache without tokenizing */
    size_t n_warnings;        /* things skipped where LitGPT would go on (blank .jsonl lines,
                                 an empty split, text past the last full TextFiles block) */
    char val_source[640];     /* TextFiles: the validation text and how it was chosen, in words ("" otherwise) */
} fl_data_stats;

typedef struct fl_dataset fl_dataset; /* opaque */

fl_status fl_data_load(fl_dataset **out, const fl_data_config *cfg, const fl_tokenizer *tok);
void fl_data_free(fl_dataset *d);
size_t fl_data_count(const fl_dataset *d, fl_split split);
const fl_sample *fl_data_get(const fl_dataset *d, fl_split split, size_t i);
const fl_data_stats *fl_data_get_stats(const fl_dataset *d);
/* A fingerprint of one split as tokenized (not a security hash): its sample count, each sample's length and
 * prompt length, then every id and label, in order. Equal splits give equal numbers on any machine (the values are
 * hashed, not their bytes); a cache hit gives the load's. Computed on each call (one pass over the tokens): the
 * data-parallel trainer compares the ranks' at start-up. */
uint64_t fl_data_fingerprint(const fl_dataset *d, fl_split split);
/* The fingerprints' hash, for other data of the same kind (BLIP-2's captions and images): h (FL_DATA_FP_BASIS to start)
 * extended by n 32-bit values, taken by value (the same number on every machine). */
#define FL_DATA_FP_BASIS 0xcbf29ce484222325ULL
uint64_t fl_data_fp_extend(uint64_t h, const int32_t *v, size_t n);

/* Format one instruction record with a prompt style ("alpaca": LitGPT's text).
 * *out is malloc'd. */
fl_status fl_data_format_prompt(const char *style, const char *instruction, const char *input, char **out);

/* ---- micro-batches ------------------------------------------------------- */

typedef struct {
    int B, T;            /* this batch: B samples padded to T positions */
    int32_t *ids;        /* (B, T) */
    int32_t *targets;    /* (B, T), ignore_index where masked or padded */
    long real_tokens;    /* non-pad positions (ids) */
    long prompt_tokens;  /* of which prompt */
    long padded_tokens;  /* B*T */
    long target_tokens;  /* targets != ignore_index */
    int truncated;       /* samples of this batch cut to T_max+1 tokens */
} fl_batch;

/* Resumable position: epoch, index into the epoch's permutation (the next
 * sample to serve). The permutation of epoch e is a Fisher-Yates shuffle driven
 * by splitmix64(seed, e): a pure function of (seed, epoch, n). */
typedef struct {
    uint64_t seed;
    int64_t epoch;
    int64_t pos;
} fl_loader_state;

typedef struct fl_loader fl_loader; /* opaque */

/* Loader over one split with micro-batch size B and at most T_max positions
 * (samples longer than T_max+1 tokens are truncated). Train: shuffled per
 * epoch by (seed, epoch); val: in order, no shuffle. Buffers for (B, T_max)
 * are allocated once. */
fl_status fl_loader_init(fl_loader **out, const fl_dataset *d, fl_split split, int B, int T_max, uint64_t seed,
                         int shuffle);
void fl_loader_free(fl_loader *l);
/* Next micro-batch (valid until the next call). At the end of an epoch it
 * wraps to the next epoch (*new_epoch = 1 when this batch is the first of an
 * epoch, the very first batch of epoch 0 included). The last batch of an epoch
 * holds the n % B leftover samples (no drop_last). */
fl_status fl_loader_next(fl_loader *l, fl_batch *b, int *new_epoch);
void fl_loader_get_state(const fl_loader *l, fl_loader_state *s);
fl_status fl_loader_set_state(fl_loader *l, const fl_loader_state *s);
/* Batches per epoch (ceil(n / B)). */
size_t fl_loader_batches_per_epoch(const fl_loader *l);

/* ---- seq2seq pairs (encoder-decoder models: T5) ------------------------------------------
 * Records of a .json array or .jsonl file: "output" (the target text, a string) and "input"
 * and/or "instruction" (strings; "input" may be null). The encoder text is the instruction, then
 * "\n\n", then the input when both are non-empty; else whichever is present (LitGPT's
 * instruction/input/output records therefore need no prompt template). Source and target are
 * encoded without BOS and with EOS appended, as T5's tokenizer does. A sequence over its limit is
 * cut to the limit keeping EOS last (HF's truncation=True) and counted in the stats, or, with
 * strict, refused with an error naming the file and the record. */
typedef struct {
    int max_source_length; /* tokens including EOS; <= 0: no limit (default 512) */
    int max_target_length; /* default 128 */
    int strict;            /* 1: a record over a limit is an error; 0 (default): truncated and counted */
} fl_s2s_config;

void fl_s2s_config_default(fl_s2s_config *c);
/* The source limit a training run cuts to: data.max_source_length (max_source, <= 0: none) capped by
 * train.max_seq_length (max_seq, LitGPT's sample limit; <= 0: none), as the trainer and the planner read them. */
int fl_s2s_source_limit(int max_source, int max_seq);

typedef struct {
    size_t n_records;
    size_t n_truncated_source, n_truncated_target; /* records cut to the limits (not strict) */
    size_t n_blank;                               /* .jsonl blank lines skipped */
    size_t n_source_tokens, n_target_tokens;      /* after truncation */
} fl_s2s_stats;

typedef struct fl_s2s_data fl_s2s_data; /* opaque: tokenized pairs */

/* Read and tokenize path (.json or .jsonl). */
fl_status fl_s2s_load(fl_s2s_data **out, const char *path, const fl_s2s_config *cfg, const fl_tokenizer *tok);
/* The same from text in memory; source names it in errors and its suffix picks .json / .jsonl. */
fl_status fl_s2s_load_mem(fl_s2s_data **out, const char *text, size_t n, const char *source, const fl_s2s_config *cfg,
                          const fl_tokenizer *tok);
void fl_s2s_free(fl_s2s_data *d);
size_t fl_s2s_count(const fl_s2s_data *d);
/* Pair i: views valid while d lives. */
void fl_s2s_get(const fl_s2s_data *d, size_t i, const int32_t **src, int *n_src, const int32_t **tgt, int *n_tgt);
const fl_s2s_stats *fl_s2s_get_stats(const fl_s2s_data *d);
/* fl_data_fingerprint for pairs: the count, then each pair's source and target lengths and ids, in order. */
uint64_t fl_s2s_fingerprint(const fl_s2s_data *d);
/* LitGPT's split of one JSON file (random_split with torch.Generator().manual_seed(seed), as the decoder-only JSON
 * data): the pairs in torch.randperm(n) order, the first n_train of them *train (the lengths as random_split's: floors,
 * the remainder round-robin from train), the rest *val; when that leaves no validation pairs, *train keeps d's order
 * (either may be empty; both new, fl_s2s_free). The training split keeps d's truncation and blank-line counts. */
fl_status fl_s2s_split(const fl_s2s_data *d, float val_fraction, uint64_t seed, fl_s2s_data **train, fl_s2s_data **val);

/* One padded micro-batch. src (B, Ts): source ids right-padded with pad_id to the longest source
 * of the batch; src_mask (B, Ts): 1 = real token, 0 = pad; labels (B, Tt): target ids, padded with
 * FL_IGNORE_INDEX; dec_in (B, Tt): decoder_start_token_id, then labels[:-1] with pad_id where the
 * label is FL_IGNORE_INDEX (teacher forcing, HF's shift_tokens_right). */
typedef struct {
    int B, Ts, Tt;
    int32_t *src;
    uint8_t *src_mask;
    int32_t *dec_in;
    int32_t *labels;
} fl_s2s_batch;

/* Collate B (source, target) id sequences into a batch whose arrays are malloc'd (free with
 * fl_s2s_batch_free). For callers that hold ids already (e.g. `loss --tokens-file`). */
fl_status fl_s2s_collate(const int32_t *const *src, const int *n_src, const int32_t *const *tgt, const int *n_tgt, int B,
                         int pad_id, int decoder_start_token_id, fl_s2s_batch *out);
void fl_s2s_batch_free(fl_s2s_batch *b);

/* Loader: micro-batches of B pairs; shuffled per epoch exactly as fl_loader (Fisher-Yates driven by
 * splitmix64(seed, epoch)) when shuffle, else in order; the last batch of an epoch is the
 * remainder. State (seed, epoch, pos) as fl_loader_state. */
typedef struct fl_s2s_loader fl_s2s_loader;
fl_status fl_s2s_loader_init(fl_s2s_loader **out, const fl_s2s_data *d, int B, int pad_id, int decoder_start_token_id,
                             uint64_t seed, int shuffle);
void fl_s2s_loader_free(fl_s2s_loader *l);
/* Next batch (arrays valid until the next call); *new_epoch as fl_loader_next. */
fl_status fl_s2s_loader_next(fl_s2s_loader *l, fl_s2s_batch *b, int *new_epoch);
void fl_s2s_loader_get_state(const fl_s2s_loader *l, fl_loader_state *s);
fl_status fl_s2s_loader_set_state(fl_s2s_loader *l, const fl_loader_state *s);

#ifdef __cplusplus
}
#endif
#endif

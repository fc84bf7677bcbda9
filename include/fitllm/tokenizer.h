/* fitllm: tokenizers (encode/decode), exact against the Hugging Face reference.
 *
 * Families: HF tokenizer.json BPE, byte-level (GPT-2: regex pre-tokenization,
 * byte-to-unicode map) and SentencePiece-style (metaspace, byte fallback
 * <0xNN>, merges by rank); tokenizer.json Unigram (T5); SentencePiece
 * tokenizer.model / spiece.model (protobuf; BPE or Unigram); the
 * llama2.c tokenizer .bin; and a built-in byte-level tokenizer (no files) for
 * demos and tests. BOS/EOS come from tokenizer_config.json / config.json.
 * The tokenizer is immutable after loading and safe to share across threads.
 */
#ifndef FITLLM_TOKENIZER_H
#define FITLLM_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fl_tokenizer fl_tokenizer; /* opaque */

/* Load from a model folder (tokenizer.json preferred, else tokenizer.model, else
 * spiece.model, else tokenizer.bin/tok*.bin; plus tokenizer_config.json / config.json /
 * special_tokens_map.json for BOS/EOS) or from a single file (.json, .model,
 * llama2.c .bin). Errors name the file and what is wrong. */
fl_status fl_tok_load(fl_tokenizer **out, const char *path);
/* The built-in byte-level tokenizer: ids 0..255 are the bytes, 256 = <bos>,
 * 257 = <eos>; vocab size 258. Lossless for any byte string. */
fl_status fl_tok_builtin_bytes(fl_tokenizer **out);
void fl_tok_free(fl_tokenizer *t);
/* The built-in byte tokenizer as Hugging Face files (what a checkpoint of a run that used it
 * carries): tokenizer.json (BPE over the 256 byte-level pieces, no merges, ByteLevel without the
 * regex; <bos>/<eos> special added tokens 256/257) and tokenizer_config.json (bos/eos tokens, none
 * added). fl_tok_load and transformers' AutoTokenizer load them; the ids of a text are the
 * built-in's but for the literal strings "<bos>"/"<eos>", matched as the special tokens.
 * *text is malloc'd and NUL-terminated; *len excludes the NUL; the caller frees it. */
fl_status fl_tok_builtin_bytes_hf_json(char **text, size_t *len);
fl_status fl_tok_builtin_bytes_hf_config(char **text, size_t *len);

/* Encode n bytes of UTF-8 text (invalid UTF-8 handled as the HF tokenizer does).
 * bos/eos: -1 = the tokenizer's default (add_bos_token / add_eos_token), 0 = no,
 * 1 = yes. *ids is malloc'd; the caller frees it. */
fl_status fl_tok_encode(const fl_tokenizer *t, const char *text, size_t n, int bos, int eos, int32_t **ids,
                        size_t *n_ids);
/* Decode ids to UTF-8 (special tokens skipped when skip_special). *text is
 * malloc'd and NUL-terminated; *len excludes the NUL. */
fl_status fl_tok_decode(const fl_tokenizer *t, const int32_t *ids, size_t n, int skip_special, char **text,
                        size_t *len);

int fl_tok_vocab_size(const fl_tokenizer *t);
int fl_tok_bos_id(const fl_tokenizer *t);   /* -1 if none */
int fl_tok_eos_id(const fl_tokenizer *t);   /* first EOS id, -1 if none */
int fl_tok_is_eos(const fl_tokenizer *t, int32_t id); /* any of the EOS ids */
/* PAD: config.json pad_token_id, then special_tokens_map.json / tokenizer_config.json pad_token
 * (later wins), or a SentencePiece .model's pad_id; -1 if none (T5: 0). */
int fl_tok_pad_id(const fl_tokenizer *t);
/* "bpe-bytelevel", "bpe-sentencepiece", "spm-model", "spm-unigram" (a Unigram .model), "unigram"
 * (tokenizer.json Unigram), "llama2c", "bytes" */
const char *fl_tok_kind(const fl_tokenizer *t);

#ifdef __cplusplus
}
#endif
#endif

/* fitllm: model files in and out.
 *
 *  - Hugging Face folders: config.json (LLaMA, GPT-2), model.safetensors or a
 *    sharded set with model.safetensors.index.json; F32/BF16/F16 on disk are
 *    converted to the run's dtype; files are read through mmap.
 *  - PyTorch checkpoints (pytorch_model*.bin, LitGPT lit_model.pth) in the same
 *    folders, through fitllm/torch_ckpt.h (a restricted unpickler, nothing executed).
 *  - llama2.c .bin checkpoints (v0 header), converted to HF layout (Meta's
 *    interleaved RoPE rows permuted to rotate-half order).
 *  - writing safetensors (HF names, 8-byte aligned header, __metadata__),
 *    atomically (temp file, fsync, rename).
 * Every error names the file and the key or tensor at fault.
 */
#ifndef FITLLM_IO_H
#define FITLLM_IO_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/dtype.h"
#include "fitllm/model.h"
#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- safetensors reading ------------------------------------------------- */

#define FL_ST_MAX_HEADER (100u * 1000u * 1000u) /* 100 MB, as the reference lib */

typedef struct {
    char *name;
    fl_dtype dtype;
    int ndim;
    int64_t shape[8];
    size_t begin, end;     /* byte offsets relative to the data section */
    const void *data;      /* pointer into the mapping */
} fl_st_tensor;

typedef struct {
    char *path;
    void *map;             /* mmap of the whole file */
    size_t map_size;
    const uint8_t *data;   /* start of the data section */
    size_t data_size;
    fl_st_tensor *tensors;
    int n_tensors;
    char **meta_keys, **meta_vals; /* __metadata__ (string -> string) */
    int n_meta;
    void *owned;           /* tensor data regrouped off the mapping (LitGPT's interleaved qkv); freed by close */
} fl_st_file;

/* Open and validate: header length sane (<= FL_ST_MAX_HEADER, within file),
 * header is a JSON object, each tensor has a known dtype, a shape whose byte
 * count equals end-begin, offsets inside the data section, ranges ordered and
 * non-overlapping and covering the data section exactly. */
fl_status fl_st_open(fl_st_file *f, const char *path);
void fl_st_close(fl_st_file *f);
const fl_st_tensor *fl_st_find(const fl_st_file *f, const char *name);

/* ---- safetensors writing ------------------------------------------------- */

typedef struct fl_st_write_tensor_s {
    const char *name;
    fl_dtype dtype;       /* dtype to WRITE */
    int ndim;
    int64_t shape[8];
    const void *data;     /* source elements */
    fl_dtype src_dtype;   /* dtype of data (converted on write) */
    int transpose2d;      /* write the 2-D source (shape[1], shape[0]) transposed */
    /* Optional producer instead of data: fills dst with the tensor's source (numel fp32
     * values; src_dtype is then F32), called while writing, so only one such tensor is
     * ever materialized (a dequantized 4-bit weight when saving a QLoRA model). */
    fl_status (*fill)(void *ud, float *dst);
    void *fill_ud;
    /* Non-NULL: data is device memory of this backend, read through be->to_host in bounded
     * host slices (a transposed tensor: staged whole on the host, one tensor at a time). */
    const struct fl_backend *be;
    /* Optional ranged producer instead of data and fill: writes elements [off, off + n) of the
     * tensor's source (src_dtype, in the source's order: before transpose2d) to dst. Called in
     * increasing off over slices of at most FL_ST_FILL_SLICE elements (a transposed tensor: once,
     * whole), so a tensor larger than any buffer streams from wherever it lives (FSDP's
     * consolidated checkpoint gathers it from the ranks unit by unit). */
    fl_status (*fill_range)(void *ud, void *dst, size_t off, size_t n);
} fl_st_write_tensor;
#define FL_ST_FILL_SLICE ((size_t)1 << 20)

/* Write tensors (in the given order) with optional metadata pairs to `path`
 * atomically: path.tmp, fsync, rename. */
fl_status fl_st_write(const char *path, const fl_st_write_tensor *t, int n, const char *const *meta_keys,
                      const char *const *meta_vals, int n_meta);

/* ---- Hugging Face model folders ------------------------------------------ */

/* Parse config.json (LLaMA: model_type "llama" or architectures LlamaForCausalLM,
 * also mistral-free llama variants; GPT-2: model_type "gpt2"). Unknown
 * architecture, missing or mistyped keys give FL_ERR_FORMAT naming file and key. */
fl_status fl_hf_load_config(const char *config_json_path, fl_model_config *cfg);
/* The same from a parsed object (a composite's text_config; path: for messages). */
struct fl_json;
fl_status fl_hf_config_from_json(const char *path, const struct fl_json *obj, fl_model_config *cfg);
/* Write config.json for cfg, its weights' dtype dt (F32, BF16, F16) as "torch_dtype" (what transformers 4 reads
 * and writes) and "dtype" (transformers 5's name): from_pretrained(dtype="auto"), transformers 5's default, loads
 * them as they are stored. fl_hf_save_config: float32. */
fl_status fl_hf_save_config(const char *path, const fl_model_config *cfg);
fl_status fl_hf_save_config_dtype(const char *path, const fl_model_config *cfg, fl_dtype dt);
/* config.json's text (n bytes) with the value of every "torch_dtype" and "dtype" key that holds a string (the top
 * level's and a composite's parts') set to dt's name, into *out (malloc'd, *out_n bytes): a config copied beside
 * weights written in dt. Nothing else changes. */
fl_status fl_hf_config_text_set_dtype(const char *text, size_t n, fl_dtype dt, char **out, size_t *out_n);
/* The ids that end generation in a model folder, as transformers' generate takes them: generation_config.json's
 * eos_token_id when the file has that key (not null), else config.json's (else its text_config's: a composite such
 * as BLIP-2), an id or a list (Llama-3: [128001, 128008, 128009]). Up to cap distinct ids into ids, *n their count
 * (0: none given, no such file, or dir is not a folder: a llama2.c .bin, a preset); *from (may be NULL) the file
 * they came from ("" none). A file that is not JSON, or an id that is not a non-negative integer: FL_ERR_FORMAT
 * naming the file and key. */
fl_status fl_hf_eos_ids(const char *dir, int32_t *ids, int cap, int *n, const char **from);
/* fl_hf_eos_ids, then the tokenizer's EOS ids (tok may be NULL) not among them: every id that ends generation;
 * *from names both sources ("generation_config.json + the tokenizer", "the tokenizer", ...). */
struct fl_tokenizer;
fl_status fl_hf_stop_ids(const char *dir, const struct fl_tokenizer *tok, int32_t *ids, int cap, int *n,
                         const char **from);

/* Load all parameters of m from a folder's model.safetensors or sharded index (or, when the
 * folder has none, pytorch_model.bin, its sharded index or lit_model.pth: fitllm/torch_ckpt.h).
 * Every layout entry must be present with the right shape (tied lm_head may be
 * absent or equal to wte); tensors not in the layout are an error, except
 * known buffers (rotary inv_freq, GPT-2 attn.bias/masked_bias). */
fl_status fl_hf_load_weights(fl_model *m, const char *dir);

/* Convenience: config + model init + weights. */
fl_status fl_hf_load_model(fl_model *m, const char *dir, const fl_backend *be, fl_mem_pool *pool);
/* The same with a parameter storage (NULL = fp32; bf16: the weights are
 * converted tensor by tensor, never held in fp32). */
fl_status fl_hf_load_model_ex(fl_model *m, const char *dir, const fl_backend *be, fl_mem_pool *pool,
                              const fl_model_storage *st);

/* Save m as an HF folder (config.json + model.safetensors, or shards
 * model-0000i-of-0000N.safetensors + model.safetensors.index.json above the
 * shard size, 5 GB by default as save_pretrained), atomically. */
fl_status fl_hf_save_model(const fl_model *m, const char *dir);
/* The same writer (file names, shards, tensor order, header) for tensors that come from elsewhere:
 * t[k] is layout entry k, name and dtype set by the caller (data, or a fill callback producing it
 * one tensor at a time: fitllm merge_shards), shape and transposition as fl_hf_tensor_shape sets
 * them; config.json from cfg. */
fl_status fl_hf_save_tensors(const char *dir, const fl_model_config *cfg, const fl_param_layout *lay,
                             const fl_st_write_tensor *t);
/* The dtype most of the tensors t[0..lay->n) are written in (by elements; the first of a tie): the torch_dtype of
 * the config.json beside them, what from_pretrained(dtype="auto") loads them as (a bf16-true run's: bfloat16). */
fl_dtype fl_hf_tensors_dtype(const fl_param_layout *lay, const fl_st_write_tensor *t);
/* The HF shape of layout entry p into t (GPT-2 Conv1D weights transposed on disk). */
void fl_hf_tensor_shape(const fl_param_info *p, fl_st_write_tensor *t);
/* FL_ERR_FORMAT naming file, tensor and element when the n values of `data` (dtype dt, any
 * alignment) hold an inf or NaN: the loaders' and convert's one refusal of a corrupt weight. */
fl_status fl_hf_check_finite(const char *file, const char *tensor, const void *data, fl_dtype dt, size_t n);
/* Shard size for fl_hf_save_model (0 = the 5 GB default); tests use small values. */
void fl_hf_set_max_shard_bytes(size_t bytes);

/* ---- llama2.c checkpoints ------------------------------------------------ */

/* Load a llama2.c v0 .bin (header: dim, hidden_dim, n_layers, n_heads,
 * n_kv_heads, vocab_size (negative = separate classifier), seq_len; then
 * weights in llama2.c order, freq_cis tables included). */
fl_status fl_llama2c_load_model(fl_model *m, const char *path, const fl_backend *be, fl_mem_pool *pool);
fl_status fl_llama2c_load_model_ex(fl_model *m, const char *path, const fl_backend *be, fl_mem_pool *pool,
                                   const fl_model_storage *st);

/* Any of the above by sniffing: a directory with config.json (HF), a .bin
 * file (llama2.c), or a config.json path (random-init shape only: weights not
 * loaded, *weights_loaded = 0). */
fl_status fl_model_load_auto(fl_model *m, const char *path, const fl_backend *be, fl_mem_pool *pool,
                             int *weights_loaded);
fl_status fl_model_load_auto_ex(fl_model *m, const char *path, const fl_backend *be, fl_mem_pool *pool,
                                const fl_model_storage *st, int *weights_loaded);

/* ---- files that travel with a model folder ------------------------------- */

/* Copy the tokenizer and generation files of a model folder that exist in src_dir
 * (tokenizer.json, tokenizer.model, tokenizer_config.json, special_tokens_map.json,
 * added_tokens.json, vocab.json, merges.txt, chat_template.jinja, generation_config.json,
 * tokenizer.bin, tok512.bin, else another tok*.bin) into dst_dir, each written atomically.
 * *n_copied (may be NULL) gets how many were copied. */
fl_status fl_io_copy_tokenizer_files(const char *src_dir, const char *dst_dir, int *n_copied);
/* 1 if dir holds a tokenizer fitllm reads (tokenizer.json, tokenizer.model, tokenizer.bin,
 * a llama2.c tok*.bin). */
int fl_io_has_tokenizer(const char *dir);
/* The tokenizer of a run into a checkpoint folder dst_dir. src: a folder (its files, as
 * fl_io_copy_tokenizer_files), one tokenizer file (copied as tokenizer.json / tokenizer.model /
 * tok*.bin, the name fl_tok_load looks for, with its folder's tokenizer_config.json,
 * special_tokens_map.json, added_tokens.json, generation_config.json), or NULL: the built-in byte
 * tokenizer, written as tokenizer.json + tokenizer_config.json (fl_tok_builtin_bytes_hf_json).
 * *n_written (may be NULL): how many files. */
fl_status fl_io_write_tokenizer(const char *src, const char *dst_dir, int *n_written);

/* Fault injection for tests: the (n+1)-th file write from now fails as if the
 * disk were full (ENOSPC); -1 disables. Covers safetensors, config and
 * checkpoint writes. */
void fl_io_fail_writes_after(long n);
/* Writes left before the injected failure (-1: off): after a run armed with a large n, n minus
 * this is how many writes the run made. */
long fl_io_writes_left(void);

#ifdef __cplusplus
}
#endif
#endif

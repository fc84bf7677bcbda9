/* fitllm: PyTorch checkpoints in (torch.save zip files: Hugging Face
 * pytorch_model.bin and its shards, LitGPT lit_model.pth).
 *
 * The file is mapped and its data.pkl is read by a restricted unpickler that knows
 * only what torch.save writes for a state dict: any other pickle opcode or global
 * (os.system, builtins.eval, torch.storage._load_from_bytes, ...) is refused by
 * name and nothing in the file is ever executed. Tensors are read in place from
 * the zip's stored entries <archive>/data/<key>, exactly as safetensors tensors
 * are, through the same fl_st_file (see fitllm/io.h): every loader that takes a
 * safetensors file takes these. Refused with a message naming the file:
 * compressed or encrypted entries, the legacy (pre-1.6, non-zip) torch format,
 * big-endian files, non-contiguous tensors, storages out of bounds, dtypes other
 * than F32/F16/BF16/F64/I64/I32/U8.
 */
#ifndef FITLLM_TORCH_CKPT_H
#define FITLLM_TORCH_CKPT_H

#include "fitllm/io.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Open a torch.save file as an fl_st_file: f->tensors in the state dict's order,
 * data pointing into the mapping (f->data = the mapping, begin/end its byte
 * offsets); close with fl_st_close. */
fl_status fl_torch_open(fl_st_file *f, const char *path);

/* Open a model file by its kind: safetensors (a name ending in .safetensors) or
 * torch.save (anything else: .bin, .pth, .pt). */
fl_status fl_weights_open(fl_st_file *f, const char *path);

/* The same over bytes in memory (the fuzz harness and tests): the tensors' data
 * point into p, which must outlive f. f->map stays NULL (nothing to unmap). */
fl_status fl_torch_open_mem(fl_st_file *f, const void *p, size_t n, const char *name);

/* LitGPT names (transformer.h.N.attn.qkv.weight, ...) to Hugging Face LLaMA names
 * (model.layers.N.self_attn.q_proj.weight, ...), in place: the fused qkv weight
 * becomes three tensors (LitGPT >= 0.3 stores [q; k; v] stacked; the older
 * attn.attn.weight interleaves them per key/value group and is regrouped into a
 * buffer f owns). n_heads, n_kv_heads, head_dim from the model's config. */
fl_status fl_torch_lit_to_hf(fl_st_file *f, int n_heads, int n_kv_heads, int head_dim);

/* The weight files of a Hugging Face folder, opened as fl_hf_load_weights opens them (the
 * first of model.safetensors, its index, pytorch_model.bin, its index, lit_model.pth; cfg
 * gives the head counts LitGPT's fused qkv is split by). Close with fl_hf_close_weight_files. */
fl_status fl_hf_open_weight_files(const char *dir, const fl_model_config *cfg, fl_st_file **files, int *n_files);
void fl_hf_close_weight_files(fl_st_file *files, int n_files);

/* fitllm convert: the model folder src_dir (any of the weight formats above, config.json)
 * written as a new folder dst_dir with model.safetensors (shards + index above the shard
 * size, fl_hf_set_max_shard_bytes), every tensor in its dtype on disk, config.json copied
 * (its torch_dtype / dtype set to the tensors' dtype: fl_hf_config_text_set_dtype) and the
 * tokenizer/generation files copied as they are. src_dir may be a llama2.c .bin instead: its
 * model as fl_llama2c_load_model loads it (fp32), with the tokenizer files of its folder
 * (tok512.bin) when there are any. dst_dir must not exist; it is built beside itself and
 * renamed into place, so a failure leaves nothing. *n_tensors (may be NULL) gets the number
 * written. */
fl_status fl_hf_convert(const char *src_dir, const char *dst_dir, int *n_tensors);

/* LitGPT's model_config.yaml (litgpt.Config fields: n_layer, n_embd, n_head, n_query_groups,
 * intermediate_size, padded_vocab_size, ...) as a LLaMA model config; a field fitllm cannot build
 * is refused naming it. */
fl_status fl_lit_load_config(const char *yaml_path, fl_model_config *cfg);

/* fl_hf_load_model_ex with the config already read (a LitGPT folder's model_config.yaml):
 * checked against the weight files, model built, weights loaded. */
fl_status fl_hf_load_model_cfg(fl_model *m, const char *dir, const fl_model_config *cfg, const char *cfg_source,
                               const fl_backend *be, fl_mem_pool *pool, const fl_model_storage *st);

#ifdef __cplusplus
}
#endif
#endif

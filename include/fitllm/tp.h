/* fitllm: tensor parallelism (Megatron-style column / row splits of each block's linears).
 *
 * A rank of a tensor-parallel group of N holds a model whose config is its slice of the whole one
 * (fl_tp_config): n_heads / N query heads, n_kv_heads / N key/value heads, ffn_dim / N MLP columns;
 * head_dim, hidden size, vocabulary, norms and embeddings are the whole model's. Its layout therefore
 * has the whole model's entries, in the same order, under the same HF names, with the split entries
 * narrower:
 *   column-parallel (rank r keeps r's rows of each part): the fused q|k|v weight and bias (each of
 *     q, k, v split by heads), gate|up or fc weight and bias;
 *   row-parallel (rank r keeps r's columns): o_proj / c_proj / out_proj and down_proj / mlp.c_proj /
 *     fc2 weights; their biases are whole on every rank and added by rank 0 alone (src/model/store.c);
 *   vocabulary-parallel (rank r keeps rows [r V / N, (r + 1) V / N)): the token embeddings, lm_head; the
 *     embedding's rows are summed over the group and the cross-entropy combines the ranks' row statistics
 *     (src/model/tp_vocab.c);
 *   replicated: norms, the position table.
 * The block graph gets the ALLREDUCE ops that make the slices compute the whole block (graph_tp.c),
 * over the group set with fl_model_set_tp. Everything replicated computes the same bits on every rank
 * (its inputs and gradients are the same after the sums), so replicated parameters get the same
 * gradients and updates everywhere without communication. See docs/ARCHITECTURE.md "Tensor parallelism". */
#ifndef FITLLM_TP_H
#define FITLLM_TP_H

#include "fitllm/comm.h"
#include "fitllm/model.h"
#include "fitllm/pp.h"
#include "fitllm/train.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Rank `rank`'s slice of the (validated) whole config for a group of `size`. FL_ERR_UNSUPPORTED naming
 * --tensor_parallel and the dimension when a split is not exact (heads, key/value heads, MLP width not
 * divisible by size) or the architecture is not a decoder with these splits (BERT); size 1: a copy. */
fl_status fl_tp_config(const fl_model_config *whole, int size, int rank, fl_model_config *out);

/* The group the blocks' collectives run over (comm's size must be m->cfg.tp_size; on the backend's
 * memory: a device communicator for a backend whose memory the host cannot read). NULL: detach. */
fl_status fl_model_set_tp(fl_model *m, fl_comm *comm);
/* The same group on host memory (src/model/tp_vocab.c): the gathered logits of generation go through it, and set it
 * says the cross-entropy has its group (its row statistics are all-gathered over tp_comm, on the device).
 * fl_model_set_tp sets it to comm on a backend with host memory; a device communicator's caller passes the host group
 * it was made from. NULL: no sums (a test's broken group). */
fl_status fl_model_set_tp_host(fl_model *m, fl_comm *host);
/* Sequence parallelism (Megatron-LM's; docs/ARCHITECTURE.md "Sequence parallelism"): between the tensor-parallel
 * linears the residual stream holds the rank's rows [r B T / N, (r + 1) B T / N) of each pass, the norms and residual
 * adds run on them, and the blocks all-gather / reduce-scatter over tp_comm instead of all-reducing. Set on a slice
 * (tp_size > 1) before fl_model_alloc_acts; a pass's B T must be a multiple of tp_size. Not with a pipeline stage. */
fl_status fl_model_set_sp(fl_model *m, int on);

/* How layout entry i is split (the same index in the whole and the slice's layouts). */
typedef enum { FL_TP_REPLICATED = 0, FL_TP_COLUMN, FL_TP_ROW, FL_TP_VOCAB } fl_tp_split;
/* FL_TP_VOCAB: the token embeddings and lm_head, rank r keeps rows [r V / N, (r + 1) V / N) (fl_config_vocab_rows;
 * the ranks' row counts differ by at most one when N does not divide V). */
fl_tp_split fl_tp_entry_split(const fl_param_layout *lay, int i);

/* Element maps between entry i of the whole model (our (out, in) orientation, whole_cfg's dims) and
 * rank r's slice of it (size ranks): take copies r's elements out of the whole entry, place puts them
 * back. A replicated entry is copied whole. */
void fl_tp_take(const fl_model_config *whole_cfg, const fl_param_layout *whole_lay, int i, int size, int r,
                const float *whole, float *slice);
void fl_tp_place(const fl_model_config *whole_cfg, const fl_param_layout *whole_lay, int i, int size, int r,
                 const float *slice, float *whole);

/* LoRA on a split linear (the adapter of layout entry i, of rank lr; docs/ARCHITECTURE.md "Tensor parallelism"): on a
 * column-parallel or vocabulary linear A (lr, in) is whole on every rank and B (out, lr) takes the rank's rows as the
 * weight does; on a row-parallel one A takes the rank's columns and B is whole. take copies rank r's elements of the
 * whole A (is_b 0) or B (is_b 1) out, place puts them back; fl_tp_lora_split: whether that matrix is split (else
 * every rank holds it whole: its gradient is a partial sum the group adds, and it counts once in the norm). */
void fl_tp_lora_take(const fl_model_config *whole_cfg, const fl_param_layout *whole_lay, int i, int size, int r, int lr,
                     int is_b, const float *whole, float *slice);
void fl_tp_lora_place(const fl_model_config *whole_cfg, const fl_param_layout *whole_lay, int i, int size, int r, int lr,
                      int is_b, const float *slice, float *whole);
int fl_tp_lora_split(const fl_param_layout *lay, int i, int is_b);

/* Fill the slice model `part` (fl_tp_config of whole's config) with its elements of `whole`'s parameters,
 * entry by entry through fp32 (any storage of either). */
fl_status fl_tp_scatter(const fl_model *whole, fl_model *part);
/* The reverse, collective over host_comm (the tensor-parallel group on host memory, rank order = tp_rank):
 * every rank passes its part; rank 0's `whole` (a model of the whole config; NULL elsewhere) receives every
 * entry, split entries assembled from the ranks' slices (one entry's fp32 at a time in host memory).
 * grads: the gradients instead of the parameters (fp32 storage; whole's gradient buffer). */
fl_status fl_tp_gather(fl_model *part, fl_comm *host_comm, fl_model *whole, int grads);
/* QLoRA on the slices: 0 when rank r's part of entry i of the whole layout (config whole, split over size ranks)
 * is made of whole 64-element blocks of the whole's 4-bit entry (bitsandbytes' blocks run over the row-major
 * weight): a column-parallel part's rows x the width, a row-parallel part's columns of each row, multiples of 64.
 * Then the slice's own blocks hold exactly the whole's (re-quantizing the dequantized slice gives the whole's
 * codes and, as fp32, its dequantized absmax). Else the elements of the part that cut a block. */
size_t fl_tp_q4_cut(const fl_model_config *whole, const fl_param_layout *lay, int size, int i);
/* Where it does cut them (QLoRA where a rank's part cuts a 4-bit block): entry i of a slice's layout (config slice,
 * tp_size > 1) is stored as the whole blocks of one process's quantization that cover the rank's part (fl_q4_weight's
 * row map): returns their count (0: the entry does not cut a block, or is not 4-bit), and fills, where not NULL,
 * src_block (the whole entry's block index of each stored block, in order) and row_start (each slice row's first
 * element among the stored ones). Each maximal run of the part's rows that is contiguous in the whole (a
 * column-parallel part; a row-parallel part's rows where the rows' gaps are under a block) stores its covering blocks
 * once: at most one extra block at each end of a run. */
size_t fl_tp_q4_map(const fl_model_config *slice, const fl_param_layout *lay, int i, size_t *src_block,
                    uint32_t *row_start);
/* The same for the parameters from src, the part's whole flat store in host memory (dtype dt, the layout's
 * offsets): FSDP on the data axis gathers them from the pieces first (the part holds a shard). */
fl_status fl_tp_gather_params_host(fl_model *part, fl_comm *host_comm, const void *src, fl_dtype dt, fl_model *whole);
/* The same for an array of one element per parameter at the layout's offsets (optimizer state: F32 or BF16,
 * src in src_be's memory, dst in dst_be's, a NULL backend: host memory; dst NULL but on rank 0), collective
 * over host_comm. */
fl_status fl_tp_gather_array(fl_model *part, fl_comm *host_comm, const fl_backend *src_be, const void *src,
                             fl_model *whole, const fl_backend *dst_be, void *dst, fl_dtype dt);
/* The reverse without communication: part's elements of the whole array src into part's array dst. */
fl_status fl_tp_scatter_array(fl_model *whole, const fl_backend *src_be, const void *src, fl_model *part,
                              const fl_backend *dst_be, void *dst, fl_dtype dt);

/* The optimizer of a rank's slice (src/train/tp.c; or of its LoRA adapters, the whole matrices' partial gradients
 * summed over the group first: fl_optim_dist.reduce): clipping and fp16 overflow skips decide on the whole
 * model's gradient (the split entries' squared norms of every rank summed in rank order, in double, over
 * host_comm, the replicated entries counted once; an overflow on any rank), so every rank clips and skips
 * alike and the replicated parameters stay the same bits. d is the caller's storage, alive while o is; o
 * was made for the slice by fl_optim_init, without data-parallel hooks or with DDP's (the grid's data-parallel
 * axis: kept for its sums; ZeRO's sharded hooks are refused). */
typedef struct {
    fl_optim_dist dist;
    fl_comm *comm;
    const fl_model *m;
    const fl_optim_dist *inner; /* DDP's hooks on the data-parallel axis (o's before the attach), or NULL */
    fl_comm *pipe;              /* TP x PP: the pipeline of this rank's tensor-parallel rank (set after the attach;
                                 * NULL: none). The norm then counts the entries the stage trains (fl_pp_stage_owns)
                                 * and every sum and verdict runs over the group, then over the stages in order. */
    fl_pp *pp;                  /* TP x PP under the interleaved schedule (set after the attach; NULL: one chunk per
                                 * rank): every chunk's optimizer has a fl_tp_dist of its own (pp->ch[c].o); the norm
                                 * is every chunk's, computed by the step's first call and kept in pp->norm_sq (the
                                 * step resets pp->norm_ok), and the fp16 verdict is pp's over every chunk
                                 * (pp->amp_found while pp->amp_ok) */
} fl_tp_dist;
fl_status fl_tp_optim_attach(fl_optimizer *o, fl_comm *host_comm, fl_tp_dist *d);
/* LoRA on a slice (fl_model_lora_init done with the run's seed): the row-parallel linears' A made the rank's
 * columns of the whole model's initial A (the slice drew (r, in / N) values of its own), so the slices start
 * where one process starts; column-parallel A and every B (zeros) are the whole's already. */
fl_status fl_tp_lora_init(fl_model *m, uint64_t seed);
/* One array at the adapters' offsets (the adapters, or an optimizer state array of theirs: F32 in the backend's
 * memory) of the slices gathered into rank 0's whole model's (whole NULL elsewhere; collective over the group on
 * host memory), and the reverse without communication (the slice's elements of the whole's). Both models carry the
 * same LoRA config (the whole one made for the whole config). */
fl_status fl_tp_lora_gather(const fl_model *part, fl_comm *host_comm, const fl_backend *src_be, const float *src,
                            const fl_model *whole, const fl_backend *dst_be, float *dst);
fl_status fl_tp_lora_scatter(const fl_model *whole, const fl_backend *src_be, const float *src, const fl_model *part,
                             const fl_backend *dst_be, float *dst);

#ifdef __cplusplus
}
#endif
#endif

/* Private to src/train: sharded checkpoints (--fsdp.state_dict_type sharded) and the pieces of
 * checkpoint.c they share. See src/train/shard_ckpt.c and docs/ARCHITECTURE.md "Sharded
 * checkpoints".
 *
 * The abstraction: a checkpoint is a list of FLAT BUFFERS (the trainable parameters, AdamW's m and
 * v, SGD's momentum, 8-bit AdamW's per-tensor codes and block absmax). Buffer element k stands for
 * element base + k * gran of the split space [0, split_n): the trainable elements. A rank HOLDS a
 * list of ranges of each buffer in memory (pieces: the whole buffer, its chunk, 8-bit AdamW's
 * block-widened piece, or FULL_SHARD's per-unit pieces) and OWNS some of them, which it writes:
 *   - the chunk rule (DDP, ZeRO-1/2): rank r owns the buffer elements whose split element falls in
 *     its fl_comm_chunk of [0, split_n), one range that must lie in one held piece (so a buffer
 *     every rank holds whole, like ZeRO-1/2's parameters, is stored once, not N times);
 *   - own_held (ZeRO-3 / FULL_SHARD): rank r owns exactly what it holds, its pieces of every unit
 *     (fl_fsdp_ranges; each unit split by fl_comm_chunk on its own), several ranges per buffer.
 * Either way the ranks' owned ranges tile every buffer exactly once. On resume a rank reads each
 * held piece from whichever files' ranges overlap it, whatever rule wrote them.
 */
#ifndef FL_TRAIN_SHARD_CKPT_H
#define FL_TRAIN_SHARD_CKPT_H

#include <stdint.h>

#include "dp.h"
#include "fitllm/checkpoint.h"
#include "fitllm/io.h"

/* ---- checkpoint.c, shared -------------------------------------------------------------------- */

/* A metadata-only safetensors file at path: the training state (format, optimizer, step, iter,
 * data position, counters, loss scale; fl_ckpt_save's training_state metadata) plus nx extra pairs. */
fl_status fl_ckpt_write_state_meta(const char *path, const char *format, const fl_optimizer *o,
                                   const fl_train_state *st, const fl_run_config *cfg, size_t numel,
                                   const char *const *xk, const char *const *xv, int nx);
/* That metadata back into st (and o's step and loss scale; o may be NULL). path: for messages. */
fl_status fl_ckpt_read_state_meta(const fl_st_file *f, const char *path, fl_optimizer *o, fl_train_state *st);
/* dir/hyperparameters.yaml (fl_cfg_write_yaml), atomically. */
fl_status fl_ckpt_write_hparams(const char *dir, const fl_run_config *cfg);
/* Commit the finished folder tmp as out_dir/name: fsync, move an old one aside, rename, then the
 * COMMITTED marker (atomic). When the marker cannot be written the folder goes back to tmp (the caller
 * removes it) and the old one returns: a failed commit leaves no uncommitted out_dir/name. */
fl_status fl_ckpt_commit(const char *out_dir, const char *name, const char *tmp);

/* ---- flat buffers ------------------------------------------------------------------------------ */

#define FL_SHARD_NAME_MAX 160
#define FL_SHARD_META_FILE "sharded_state.safetensors" /* the one shared metadata file */

/* Held elements [k0, k0 + n) of a buffer at data (backend memory). */
typedef struct {
    size_t k0, n;
    void *data;
} fl_shard_piece;

typedef struct {
    char name[FL_SHARD_NAME_MAX]; /* "params", "optimizer.exp_avg", "optimizer.state8.<tensor>.q_m", ... */
    fl_dtype dtype;               /* in memory and on disk */
    size_t count;                 /* elements of the whole buffer */
    size_t base, gran;            /* element k <-> split element base + k * gran */
    fl_shard_piece *pc;           /* held pieces, ascending and disjoint (malloc'd) */
    int npc;
    /* own_held only: own_sub 1 = the rank owns [own_k0, own_k0 + own_n) of its one held piece, not all
     * of it (FULL_SHARD 8-bit AdamW's scales: a block cut by a rank edge is held by both ranks and
     * owned by the one holding its first element) */
    int own_sub;
    size_t own_k0, own_n;
    const struct fl_optimizer *opt; /* the optimizer whose state data is (NULL: set->be's memory): copied through
                                     * its state's backend (CPU offload: the host's; NVMe: the pages dropped behind) */
} fl_shard_buf;

typedef struct {
    fl_shard_buf *b;
    int n, cap;
    size_t split_n;              /* the trainable elements (the whole model's, also under FULL_SHARD) */
    int own_held;                /* a rank owns what it holds (FULL_SHARD), else the chunk rule */
    const fl_backend *be;        /* whose memory data is (to_host / to_device) */
} fl_shard_set;

/* One held piece [h0, h0 + hn) at data. */
fl_status fl_shard_set_add(fl_shard_set *s, const char *name, fl_dtype dt, size_t count, size_t base, size_t gran,
                           void *data, size_t h0, size_t hn);
/* Several held pieces (copied; ascending, disjoint, inside [0, count)). */
fl_status fl_shard_set_add_pieces(fl_shard_set *s, const char *name, fl_dtype dt, size_t count, size_t base,
                                  size_t gran, const fl_shard_piece *pc, int npc);
void fl_shard_set_free(fl_shard_set *s);
/* The elements [*k0, *k1) of b that rank `rank` of `world` owns under the chunk rule. */
void fl_shard_owned(const fl_shard_buf *b, size_t split_n, int world, int rank, size_t *k0, size_t *k1);
/* An optimizer's buffers as it holds them: "params" (o->w.p, held whole) and its state (held
 * [s_off, s_off + s_len), or 8-bit AdamW's pieces per tensor). Full-model training only. */
fl_status fl_shard_set_from_optim(fl_shard_set *s, const fl_model *m, const fl_optimizer *o);
/* ZeRO-3 / FULL_SHARD (dp->fsdp): "params" and the optimizer state (AdamW m, v or SGD momentum;
 * o runs on the shard) held as this rank's per-unit pieces (fl_fsdp_ranges), own_held; 8-bit AdamW:
 * its piece of every tensor's codes (fp32 m, v) and the scales of the blocks the piece meets, owning
 * those whose first element is its. */
fl_status fl_shard_set_from_fsdp(fl_shard_set *s, const fl_dp *dp, const fl_model *m, const fl_optimizer *o);
/* The layout fingerprint (FNV-1a over every entry's name, shape and offset, and the element count):
 * shards of another model or layout are refused. */
uint64_t fl_shard_fingerprint(const fl_param_layout *lay, size_t n);

/* ---- save, load, export -------------------------------------------------------------------------- */

/* Collective. Every rank writes out_dir/.tmp-<name>-shards/shard-RRRRR-of-NNNNN.safetensors (its
 * owned ranges of every buffer in set, one tensor per buffer holding them one after another;
 * metadata: "range.<buffer>" = "k0 k1 count" for one range, "ranges.<buffer>" = "count k0 k1 k0 k1
 * ..." for several, rank, world, fingerprint, step);
 * rank 0 also writes sharded_state.safetensors (training state, world, fingerprint, buffers),
 * config.json, hyperparameters.yaml and the tokenizer files. After every rank reported success
 * (fl_dp_agree), rank 0 writes the consolidated HF export when export_hf (final/: streamed from
 * the shard files, one tensor at a time), renames the folder into place and writes COMMITTED;
 * a last agreement gives every rank rank 0's outcome. Any failure: nothing is committed, every
 * rank returns the error (naming the rank). */
fl_status fl_shard_ckpt_save(fl_dp *dp, const fl_shard_set *set, const char *out_dir, const char *name,
                             const fl_model *m, const fl_optimizer *o, const fl_train_state *st,
                             const fl_run_config *cfg, const char *tok_dir, int export_hf);
/* Read this rank's held pieces of every buffer of set from whichever shard files own it (any saved
 * world size), then the training state. Everything is checked before anything is written (files
 * present, same fingerprint, step and world in every file, buffer dtypes, ranges covering what is
 * needed, finite parameters): an error names the file and the range, and nothing is resumed. Not
 * collective. lay: the run's layout (fingerprint). */
fl_status fl_shard_ckpt_load(const char *dir, const fl_shard_set *set, const fl_param_layout *lay, fl_optimizer *o,
                             fl_train_state *st);

#endif

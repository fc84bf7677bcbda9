/* Private to src/train: the data-parallel (DDP, NO_SHARD) context of one training run.
 *
 * The trainer keeps one fl_dp per run and calls the same functions at every world size; with
 * one rank (no communicator, or a size-1 one) each is a no-op or a copy, so the loop has no
 * "if distributed" branches beyond asking which global micro-batches are this rank's.
 *
 * Semantics (issue #14, LitGPT's): a step's global batch is world x accum micro-batches taken in
 * order from ONE stream (the loader's global permutation, walked by every rank); global
 * micro-batch j of a step belongs to rank j % world, so rank r trains j = k*world + r for
 * k = 0..accum-1. Every rank walks the whole stream (index copies only) so the loader position,
 * the token counters and the step's valid-target count are the global ones on every rank with
 * no collective, and a checkpoint's data position does not depend on the world size. Gradients
 * are summed (deterministic, rank order) once per step after the last micro-batch; the loss is
 * normalized by the global count, so the sum is the gradient of the global mean loss.
 */
#ifndef FL_TRAIN_DP_H
#define FL_TRAIN_DP_H

#include "fitllm/checkpoint.h"
#include "fitllm/comm.h"
#include "fitllm/config.h"
#include "fitllm/io.h"
#include "fitllm/train.h"
#include "fitllm/trainer.h"

typedef struct fl_dp {
    fl_comm *comm; /* NULL: one process. Host-memory collectives (losses, counts, configuration) */
    fl_comm *dev;  /* the backend's device-memory communicator (NCCL), owned; NULL: comm takes the
                    * backend's buffers directly (host-memory backends) */
    int rank, world;
    int stage;     /* ZeRO stage of the run's strategy: 0 DDP (NO_SHARD), 1, 2 (see zero.c), 3 (fsdp.c; LoRA: 2);
                    * 0 in one process */
    fl_optim_dist dist; /* the optimizer's hooks (fl_dp_optim_init) */
    /* bucketed reduction (fl_dp_buckets_arm): the optimizer whose gradients the buckets reduce, the
     * bucket in flight, the elements posted this step */
    fl_optimizer *bk_o;
    fl_comm_req *bk_req;
    size_t bk_done;
    struct fl_fsdp *fsdp; /* stage 3 (FULL_SHARD) of the full model: the sharding (fsdp.c), else NULL */
    fl_comm *node, *rep;  /* HYBRID_SHARD across nodes (fl_fsdp_prepare, owned): this rank's node (the shard group)
                           * and its replica group (the ranks of its local rank on every node); NULL otherwise.
                           * Host communicators (host-side sums, sharded checkpoints' bookkeeping) */
    fl_comm *dnode, *drep; /* the same groups split from dev (owned; NULL without a device communicator): the
                            * gathers and reductions of device buffers */
    const fl_backend *be;  /* the run's backend (NULL: host memory, memcpy): the checkpoint streams read device
                            * memory through its to_host, write it through to_device */
    const fl_optim_offload *offload; /* CPU offload (fl_cfg_offload): the optimizer's host backend and tier; NULL none */
    size_t bucket;         /* --bucket_size: the gradient reductions' bucket bytes (0: one collective each; dp_bucket.c) */
    fl_comm *grid;         /* tensor parallel: the whole grid (comm is its data-parallel axis), over which the set-up's
                            * agreements and the configuration check run; NULL: comm */
    /* parameter offload (fl_cfg_param_offload; the trainer sets it before fl_fsdp_prepare): the tier the shards of
     * the parameters and gradients live in (pool: the host tier or the NVMe disk pool; disk: it is the disk pool),
     * the host backend of its memory, the host tier (scratch of the gradients' way down) and the prefetch depth
     * (--offload_prefetch). pool NULL: the shards on the device. With it FULL_SHARD runs at one rank too.
     * overlap (--offload_overlap): a fetch posted ahead is copied out of the tier by a worker thread (fetch.c)
     * while the unit before it computes. */
    struct {
        const fl_backend *be;
        fl_mem_pool *pool, *host;
        int disk, prefetch, overlap;
    } ptier;
    int update_overlap; /* --offload_update_overlap: fl_fsdp_update_arm may run the update unit by unit */
    fl_grad_sync sync;  /* the step's interface to this context (fl_dp_init installs it; fitllm/train.h) */
} fl_dp;

/* The parameter-offload fetch worker (fetch.c): one thread copying units' pieces out of the tier in post order.
 * A job belongs to its caller from fl_fetch_post until fl_fetch_wait returns (state 0 idle, 1 queued or running,
 * 2 done); waiting for an idle job returns at once. */
typedef struct fl_fetch fl_fetch;
typedef struct fl_fetch_job {
    void *dst;
    const void *src;
    size_t bytes;
    int state;
    struct fl_fetch_job *next;
    fl_status (*run)(void *ud); /* fl_fetch_post_run: a function in place of the copy, its status and message */
    void *ud;
    fl_status st;
    char msg[512];
} fl_fetch_job;
fl_status fl_fetch_start(fl_fetch **out);
void fl_fetch_post(fl_fetch *w, fl_fetch_job *j, void *dst, const void *src, size_t bytes);
/* run(ud) on the worker, in post order with the copies (its status and error message: j->st, j->msg) */
void fl_fetch_post_run(fl_fetch *w, fl_fetch_job *j, fl_status (*run)(void *ud), void *ud);
void fl_fetch_wait(fl_fetch *w, fl_fetch_job *j);
int fl_fetch_posted(fl_fetch *w, const fl_fetch_job *j); /* posted and not yet waited for */
int fl_fetch_done(fl_fetch *w, const fl_fetch_job *j);   /* posted and finished (not yet waited for) */
void fl_fetch_stop(fl_fetch *w); /* runs the queued jobs, then joins */
unsigned long fl_fetch_count(void); /* copy jobs done so far by every worker of the process */
unsigned long fl_fetch_run_count(void); /* function jobs (fl_fetch_post_run) done so far */

/* A checkpoint writer's source for one optimizer state array arr of o (es-byte elements): t->data read
 * through the state's backend, or in an NVMe tier a fill_range producer that streams it from its files a
 * slice at a time (fl_optim_state_read; src holds the producer's state and must outlive the write). */
typedef struct {
    const fl_optimizer *o;
    const void *arr;
    size_t es;
} fl_optim_state_src;
void fl_optim_state_source(const fl_optimizer *o, fl_st_write_tensor *t, const void *arr, size_t es,
                           fl_optim_state_src *src);

/* The optimizer update of elements [a, a + n) of o's range as update number `step`, unscaled (no clipping, no loss
 * scaling), in place on the host (optim.c; not where the update is staged through the host tier). Elementwise: the
 * parts together are the whole update's bits. Safe on a second thread while the model computes (it allocates
 * nothing; NVMe: the same residency hints as the whole update, on the part's pages). */
/* The squared norm of the optimizer's gradients [off, off + len) of its buffer (double, on the backend that holds
 * them; len 0: 0): the pieces every norm of the step sums (optim.c's one range, zero.c's chunks in rank order). */
fl_status fl_optim_grad_sumsq(const fl_optimizer *o, size_t off, size_t len, double *v);
fl_status fl_optim_update_part(const fl_optimizer *o, size_t a, size_t n, float lr, int step);
/* AdamW / SGD on be over n elements of parameters p and gradients g (this rank's range, or one piece of it) with the
 * state from element st of the rank's state arrays (optim.c; the offloaded update's pieces run it too). */
fl_status fl_optim_update_range(const fl_optimizer *o, const fl_backend *be, void *p, const void *g, size_t st, size_t n,
                                float lr, float scale, int step);
/* The offloaded update (optim_offload.c), fl_optim_init_offload's fl_optim_home.update where the update is staged
 * through the host tier or the state or the parameters are on NVMe. */
extern const fl_optim_update_ops fl_optim_offload_update;
/* FULL_SHARD / ZeRO-3 with the optimizer offloaded (--offload_update_overlap, fsdp.c): before the LAST micro-batch
 * of a step, arm the unit-by-unit update: when a unit's gradient is final (its reduction in that backward) its
 * update is queued on the fetch worker, so it runs beside the next units' backward, fetches and reductions. Only
 * where nothing needs every shard's gradient first: no clipping (max_norm <= 0), no loss scaling; AdamW or SGD
 * updated in place on the CPU backend's kernels (the host backend; not staged). Otherwise a no-op and the update
 * runs after the backward as before. fl_dp_reduce_grads waits for the queued updates and marks the step updated
 * (o->home.updated). Same bits either way (elementwise). */
fl_status fl_fsdp_update_arm(fl_dp *dp, fl_optimizer *o, float lr, float max_norm);
/* Wait for the units' updates fl_fsdp_update_arm queued (none armed: nothing): the first failure (status and
 * message), a unit whose update was not queued (FL_ERR_INTERNAL); then o->home.updated = 1. */
fl_status fl_fsdp_update_wait(fl_dp *dp, fl_optimizer *o);
/* After fl_fsdp_update_arm (not armed: no-op): unit g's update is not queued when its gradient is final but run by
 * fl_fsdp_update_wait on the caller's thread, after the queued ones (the pipeline's tied table: its gradient is summed
 * over the end stages after the schedule, pp_step.c). fl_fsdp_update_armed: this step's updates are armed. */
fl_status fl_fsdp_update_hold(fl_dp *dp, int g);
int fl_fsdp_update_armed(const fl_dp *dp);
/* The units' updates queued on the fetch worker (queued) and those already finished when their step's wait began
 * (early: they ran beside the backward, the schedule's rest or the wait for the other stages): dp NULL: set to the
 * process's counts since it started (every rank, every step; sched unused); else dp's bookkeeping's added to *early,
 * *queued and *sched (those finished when fl_fsdp_update_mark was called: the pipeline's schedule's end) */
void fl_fsdp_update_counts(const fl_dp *dp, unsigned long *early, unsigned long *queued, unsigned long *sched);
void fl_fsdp_update_mark(fl_dp *dp);
/* comm may be NULL (rank 0 of 1). */
void fl_dp_init(fl_dp *dp, fl_comm *comm, fl_mem_pool *pool);
/* Detach the scratch pool before it is freed; give back FSDP's bookkeeping (fl_fsdp_free) and destroy
 * the device and HYBRID_SHARD communicators. */
void fl_dp_done(fl_dp *dp);
/* Several ranks on a backend with a device communicator (be->comm_create: NCCL on cuda, its CPU
 * stand-in on cuda-emu and opaque): make it over dp->comm; every collective on the backend's buffers
 * (the gradients' reductions, the parameters' broadcast, ZeRO's all-gather and 8-bit halo, FSDP's
 * gathers and reduce-scatters) then goes through it, the host-side sums and the checkpoint streams'
 * host staging stay on dp->comm. Collective. No-op in one process or when the backend has none. */
fl_status fl_dp_device_comm(fl_dp *dp, const fl_backend *be);
/* Bytes this rank has sent over its host communicators: the world's, and HYBRID_SHARD's node and
 * replica groups (fl_comm_traffic). */
unsigned long long fl_dp_sent(const fl_dp *dp);
/* The communicator of the backend's buffers (gradients, parameters). */
static inline fl_comm *fl_dp_dcomm(const fl_dp *dp) { return dp->dev ? dp->dev : dp->comm; }
/* bytes of device memory src (the backend's buffers) into host memory dst: dp->be's to_host, memcpy without
 * a backend */
fl_status fl_dp_to_host(const fl_dp *dp, void *dst, const void *src, size_t bytes);
/* Whether global micro-batch j (0-based within its step or evaluation) is this rank's. */
static inline int fl_dp_mine(const fl_dp *dp, long j) { return j % dp->world == dp->rank; }
/* v[0..n) := the sum over ranks of v, in rank order in double. The doubles travel bit for bit
 * (an all-gather, no arithmetic on the wire), so the result is the same on every rank and the
 * same every run. */
fl_status fl_dp_sum(fl_dp *dp, double *v, int n);
/* Every rank's value of v[0..n) (rank-major into all[world * n]). */
fl_status fl_dp_gather(fl_dp *dp, const double *v, int n, double *all);
/* v[0..n) := its elementwise max over ranks (fmaxf; a NaN is dropped), from an all-gather of
 * every rank's v (host scratch outside the pool, as fl_dp_sum's): the same bits on every rank. */
fl_status fl_dp_max(fl_dp *dp, float *v, size_t n);
/* 8-bit AdamW under FULL_SHARD (src/train/optim.c): copy the packed state of the pieces (a[i],
 * len[i]) of every tensor of lay (fl_optim_8bit_fsdp_piece's, of some rank; the pieces' spans one
 * after another, as fl_optim_init binds them) to (to_full) or from the single-process layout full
 * (fl_adam8bit_state_bind per tensor, in layout order). Host memory. A cut block's absmax is
 * written by each rank that holds a part, with the same bits. */
fl_status fl_optim_8bit_fsdp_copy(const fl_param_layout *lay, const size_t *a, const size_t *len, void *packed,
                                  void *full, int to_full);
/* ZeRO-1/2 8-bit AdamW (zero.c): the single-process layout's bytes of o's tensors, and this rank's
 * pieces (o->q8.p_a / p_n: whole blocks around its chunk) taken out of that layout `full` (a
 * checkpoint's optimizer.state8, mapped: no whole copy). Host memory. */
size_t fl_zero8_full_bytes(const fl_optimizer *o);
fl_status fl_zero8_take(fl_optimizer *o, const void *full);
/* Every rank's run configuration must be rank 0's (the YAML dump compared line by line):
 * FL_ERR_INVALID on the ranks that differ, naming the first differing line. Collective. */
fl_status fl_dp_check_config(fl_dp *dp, const fl_run_config *cfg);
/* Every rank must read rank 0's data: mine, a text describing what this rank read (fl_tr_check_data: each split's
 * samples, tokens and fingerprint), compared with rank 0's line by line; files names this rank's data files for the
 * message. Collective and agreed (fl_dp_agree): every rank returns the lowest differing rank's FL_ERR_INVALID. */
fl_status fl_dp_check_data(fl_dp *dp, const char *mine, const char *files);
/* What data parallelism cannot run (gradient dtypes other than F32, BF16, F16), checked at set-up. */
fl_status fl_dp_check(const fl_dp *dp, const fl_optimizer *o);
/* Sum the trainable gradients (o->w.g, F32, BF16 or F16) over ranks in place: DDP and ZeRO-1 of the full
 * model wait for the last bucket (fl_dp_buckets_arm), with LoRA one all-reduce of the adapters
 * (every rank holds the whole sum), ZeRO-2 one reduce-scatter (each rank holds the sum of its chunk, in place at its offset;
 * the rest of the buffer is dead: GRADS live = the chunk's bytes, fl_dp_reduced_live). With several
 * ranks the step (fl_step_run) records the live bytes and the memory snapshot "after_reduce" next. */
fl_status fl_dp_reduce_grads(fl_dp *dp, fl_optimizer *o);
/* The bytes of the gradient buffer o->w.g still live after fl_dp_reduce_grads: ZeRO-2's chunk (and the
 * 8-bit halo), else SIZE_MAX (all of it). */
size_t fl_dp_reduced_live(const fl_dp *dp, const fl_optimizer *o);
/* Bucketed reduction (DDP and ZeRO-1, full-model training): before the LAST micro-batch of a step
 * (last = 1) the model's backward posts an all-reduce of each layout group's gradients as the group
 * becomes final (the head group, block L-1 ... 0, the embeddings), so the reduction of one block
 * overlaps the backward of the next; fl_dp_reduce_grads then waits for the last. One bucket is in
 * flight at a time (the previous one is waited for before the next is posted), so the MPI scratch
 * held during backward is one bucket's, at fixed points (the planner replays it). The sums are the
 * whole-buffer all-reduce's bits (each element: the same rank-order sum). last = 0, one process,
 * ZeRO-2 (one reduce-scatter after backward) and LoRA (one all-reduce of the adapters): not armed. */
void fl_dp_buckets_arm(fl_dp *dp, fl_optimizer *o, int last);

/* ZeRO-2 with 8-bit AdamW: the reduced gradients a rank fetches from its neighbours beyond its
 * chunk (FL_OPTIM_8BIT_HALO from each), 0 otherwise. */
size_t fl_dp_zero2_halo(int world, int rank, const fl_optim_config *c);

/* ---- bounded communication scratch (dp_bucket.c) --------------------------------------------- */

/* dst[0..len(rank)) = the sum over comm's ranks of src[off(rank) .. +len(rank)) (fl_comm_chunk of n), as
 * fl_comm_reduce_scatter, in strided buckets of at most `bucket` bytes when n's bytes exceed it (bucket 0:
 * one collective). dst may be src + off(rank). Each element's bits are the unbucketed reduction's. The
 * bucket's packing (WORKSPACE, fl_dp_rs_workspace bytes) comes from pool; be's copies move it. */
fl_status fl_dp_reduce_scatter(fl_comm *comm, const fl_backend *be, fl_mem_pool *pool, const void *src, void *dst,
                               size_t n, fl_dtype dt, size_t bucket);
/* Whether fl_dp_reduce_scatter cuts n elements into buckets, and the packing it then holds. */
int fl_dp_rs_bucketed(size_t n, int N, fl_dtype dt, size_t bucket);
size_t fl_dp_rs_workspace(size_t n, int N, fl_dtype dt, size_t bucket);

/* ---- ZeRO (src/train/zero.c) ---------------------------------------------------------------- */

/* The optimizer of the run: the strategy's ZeRO stage (cfg->strategy, fsdp.sharding_strategy) is
 * read into dp->stage; stages 1 and 2 hold state for this rank's chunk only (fl_optim_init_shard),
 * and every stage gets the hooks (o->shard.dist: the rank-ordered sum the clipping norm uses, the
 * all-gather of the updated parameters). */
fl_status fl_dp_optim_init(fl_dp *dp, const fl_run_config *cfg, fl_optimizer *o, fl_model *m);
/* Checkpoints in the single-process format at every stage. Save: under ZeRO the ranks' optimizer
 * state chunks travel to rank 0 (one broadcast per rank, into a full-size host staging buffer on
 * rank 0 and a chunk-sized one elsewhere, outside the pool: checkpoint I/O staging), then rank 0
 * (`write`) saves. Collective under ZeRO. o may be NULL (no optimizer state saved). */
fl_status fl_dp_ckpt_save(fl_dp *dp, int write, const char *out_dir, const char *name, const fl_model *m,
                          const fl_optimizer *o, const fl_train_state *st, const fl_run_config *cfg,
                          const char *tok_dir);
/* Load: every rank reads the checkpoint; under ZeRO the full state goes through host staging and
 * each rank keeps its chunk. Not collective. */
fl_status fl_dp_ckpt_load(fl_dp *dp, const char *dir, fl_model *m, fl_optimizer *o, fl_train_state *st);
/* "DDP", "ZeRO-1", "ZeRO-2". */
const char *fl_dp_stage_name(const fl_dp *dp);
/* Rank 0's trainable parameters (and so the compute copy) to every rank. */
fl_status fl_dp_broadcast_params(fl_dp *dp, fl_optimizer *o);
/* A collective verdict on a phase every rank runs (set-up): each rank's status in, FL_OK on
 * every rank when all succeeded, else the lowest failing rank's status on every rank, the
 * message "rank R of N: <its message>". Must be called by every rank at the same point. */
fl_status fl_dp_agree(fl_dp *dp, fl_status mine);

/* ---- FSDP FULL_SHARD / ZeRO-3 (src/train/fsdp.c) ----------------------------------------------- */

/* Under stage 3 with several ranks (full model; LoRA's adapters train as ZeRO-2): refuse what
 * FULL_SHARD cannot run; HYBRID_SHARD across nodes: split the world into the nodes (dp->node: ranks
 * node*devices .. +devices-1, the shard group) and the replica groups (dp->rep), collective; and set
 * stg's shard callback so that the model is created SHARDED:
 * fl_model_init_ex allocates only this rank's shard of every unit (PARAMS) and sets m->pp, then
 * the loader (fl_hf_load_weights, the llama2.c reader) or the random init fills only this rank's
 * pieces, reading them from the files or generating the same values the whole-model init gives
 * (fl_model_param_piece): no rank ever holds the whole model, and no collective runs at load.
 * Run before the model is created (stg: fl_trainer_storage's). No-op otherwise. */
fl_status fl_fsdp_prepare(fl_dp *dp, const fl_run_config *cfg, const fl_precision *prec, fl_model_storage *stg);
/* Parameter offload on NVMe: a failed allocation s of the tier that its disk refused (no space, a file-size limit)
 * as an I/O error naming the folder's reason and this rank's bytes of `what` ("parameter", "gradient"); else s. */
fl_status fl_fsdp_tier_fault(const fl_dp *dp, fl_status s, const char *what, size_t bytes);
/* After fl_model_set_precision, before fl_model_alloc_grads (which then allocates the shard) and
 * the optimizer (which then sees the shard): the gathered units' compute copy of mixed policies
 * (no whole copy exists). FL_ERR_INTERNAL when stage 3 applies but the model was not created
 * through fl_fsdp_prepare's storage. No-op otherwise. */
fl_status fl_fsdp_init(fl_dp *dp, const fl_run_config *cfg, fl_model *m);
/* This rank's element ranges (for sharded checkpoints): unit g's piece is the whole-model elements
 * [flat_off[g], flat_off[g] + len[g]) and sits at shard_off[g] of the shard (params, grads, optimizer
 * state alike). Fills the arrays (layout.n_groups entries each, any may be NULL) and returns the
 * number of units; 0 when the run is not sharded. */
int fl_fsdp_ranges(const fl_dp *dp, size_t *flat_off, size_t *shard_off, size_t *len);
/* Give back the gathered buffers and the bookkeeping (before fl_model_free). */
void fl_fsdp_free(fl_dp *dp);
/* The model was freed before fl_fsdp_free could run (a composite's failed load freed its parts): forget it, so that
 * fl_fsdp_free gives back only the bookkeeping (nothing was gathered yet). */
void fl_fsdp_drop_model(fl_dp *dp);
/* The whole parameters (layout order, storage dtype) on every rank, gathered unit by unit into a
 * malloc'd host buffer (the step hook's view). Collective. */
fl_status fl_fsdp_whole_params(fl_dp *dp, void **out, size_t *bytes);
/* The same for any array laid out as the shard (an optimizer state array; es bytes an element) into full (the
 * model's layout.numel elements, host memory); a collective of the shard group. */
fl_status fl_fsdp_whole_array(fl_dp *dp, const void *shard, size_t es, void *full);
/* o->shard.dist's sum under stage 3 (the clipping norm, loss scaling's verdict): over the shard group, so that
 * each distinct shard counts once (HYBRID_SHARD: the node; every node holds the same reduced shards),
 * rank order, the same bits on every rank. Else fl_dp_sum. */
fl_status fl_fsdp_sum(fl_dp *dp, double *v, int n);
/* inf/NaN in any rank's parameter shard (decided alike on every rank). Collective. */
fl_status fl_fsdp_check_finite(fl_dp *dp, const fl_optimizer *o, int *found);
/* Consolidated checkpoints in the single-process format: every unit's parameters and optimizer
 * state gathered one unit at a time; rank 0 stages the whole parameters and state in host memory
 * (outside the pool, what the single-process writer reads) and writes; the other ranks hold one
 * unit's buffer at a time. Load: every rank reads only its pieces of the weights and optimizer
 * state from the checkpoint's files (fl_ckpt_load on the sharded model). Save is collective. */
fl_status fl_fsdp_ckpt_save(fl_dp *dp, int write, const char *out_dir, const char *name, const fl_model *m,
                            const fl_optimizer *o, const fl_train_state *st, const fl_run_config *cfg,
                            const char *tok_dir);
fl_status fl_fsdp_ckpt_load(fl_dp *dp, const char *dir, fl_model *m, fl_optimizer *o, fl_train_state *st);

/* ---- consolidated checkpoints, streamed (ckpt_stream.c) ------------------------------------
 * One whole-model array of es-byte elements as n_units consecutive units [start[u], start[u+1]);
 * fetch(s, u) is a collective that leaves unit u in s->buf on rank 0 (the other ranks take part:
 * an all-gather, a broadcast from its owner); every rank fetches the units in order. Rank 0's
 * writer reads through fl_st_write_tensor.fill_range = fl_dp_stream_fill (forward only); the
 * others call fl_dp_stream_drain meanwhile, and rank 0 drains after its writer returns. */
typedef struct fl_dp_stream {
    fl_dp *dp;
    int n_units;
    const size_t *start; /* (n_units + 1) */
    size_t es;
    fl_status (*fetch)(struct fl_dp_stream *s, int unit);
    const void *src;     /* this rank's part of the array (fetch reads it) */
    size_t src_off;      /* whole-array element of src[0] (ZeRO: the rank's chunk offset) */
    char *buf;           /* one unit (the largest) */
    int next;            /* next unit to fetch */
    fl_status err;       /* a failed fetch: every later request fails too */
    void *ctx;           /* fetch's own context (8-bit state: fl_dp_stream8) */
} fl_dp_stream;
typedef struct {
    fl_dp_stream *s;
    size_t start; /* the tensor's first element in the array */
} fl_dp_stream_tensor;
fl_status fl_dp_stream_upto(fl_dp_stream *s, int unit);
fl_status fl_dp_stream_drain(fl_dp_stream *s);
fl_status fl_dp_stream_fill(void *ud, void *dst, size_t off, size_t n); /* ud: fl_dp_stream_tensor */
/* The training state's optimizer tensors (checkpoint.c's names and dtypes) over streams: us[0..2] the
 * exp_avg, exp_avg_sq and momentum arrays of numel elements (src NULL: absent), u8 the 8-bit blob (or
 * NULL). Fills t and ut (4 each at most); returns how many. */
int fl_dp_stream_state_tensors(const fl_optimizer *o, size_t numel, fl_dp_stream *us, fl_dp_stream *u8,
                               fl_dp_stream_tensor *ut, fl_st_write_tensor *t);
/* 8-bit AdamW's state in the single-process layout (optimizer.state8: every tensor's
 * fl_adam8bit_state_bytes, in order), streamed tensor by tensor: unit i is tensor i's state, each
 * rank of the group holding a piece of it broadcasts the piece (ZeRO-1/2: fl_optim_8bit_piece of the
 * world; FULL_SHARD: fl_optim_8bit_fsdp_piece of the shard group, lay given) and rank 0 places it
 * (fl_optim_8bit_piece_to_full). skip: this rank takes no part (HYBRID: another node's replica). */
typedef struct {
    fl_comm *comm;
    int world, me, skip, n_t;
    const fl_optimizer *o;
    size_t *t_n, *a, *len, *own, *start; /* (n_t) sizes; (world x n_t) pieces; (n_t) own packed offsets; (n_t + 1) */
    char *stage;                          /* one piece (the largest) */
} fl_dp_stream8;
fl_status fl_dp_stream8_init(fl_dp_stream *s, fl_dp_stream8 *c, fl_dp *dp, fl_comm *comm, int world, int me, int skip,
                             const fl_optimizer *o, const fl_param_layout *lay);
void fl_dp_stream8_free(fl_dp_stream *s, fl_dp_stream8 *c);
fl_status fl_optim_8bit_piece_to_full(size_t tn, size_t a, size_t len, const void *packed, void *full);
/* ZeRO's pieces (elements of one rank's chunk per broadcast; 0: the default, 1 Mi). Tests use small
 * odd sizes so a chunk spans several pieces. */
void fl_dp_set_stream_piece(size_t elements);

#endif

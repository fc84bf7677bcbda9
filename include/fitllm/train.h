/* fitllm: optimizers and the one-step training API the CLI drives.
 *
 * A step = n_micro micro-batches (gradient accumulation) then one optimizer
 * update. The loss of a step is the mean over ALL non-ignored target tokens of
 * all its micro-batches: the step counts them first and gives each micro-batch
 * grad_scale = 1/total, so accumulation equals one large batch exactly (up to
 * float summation order).
 */
#ifndef FITLLM_TRAIN_H
#define FITLLM_TRAIN_H

#include "fitllm/adam8bit.h"
#include "fitllm/loss_scale.h"
#include "fitllm/model.h"
#include "fitllm/optim_config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Optimizer state bytes for n parameters in one tensor (shared with the planner). */
size_t fl_optim_state_bytes(const fl_optim_config *c, size_t n_params);
/* Exact optimizer state bytes for a model's parameter layout: 8-bit state is
 * per tensor (blocks and the fp32 fallback for small tensors), the others are
 * per element. This is what fl_optim_init allocates (tag OPTIM). */
size_t fl_optim_state_bytes_layout(const fl_optim_config *c, const fl_param_layout *lay);

struct fl_optimizer;
/* Data-parallel hooks of an optimizer (src/train/dp.c sets them; NULL in one process). Under ZeRO
 * (stage 1: optimizer state sharded, stage 2: also the reduced gradients) a rank holds state for,
 * and updates, only its range [s_off, s_off + s_len) of the flat trainable buffer: fl_comm's chunk
 * layout of n over `world` ranks. */
typedef struct fl_optim_dist {
    int world, rank, stage; /* stage 0: DDP (NO_SHARD), 1: ZeRO-1, 2: ZeRO-2, 3: ZeRO-3 / FSDP FULL_SHARD (the
                             * optimizer then sees only the rank's shard: src/train/fsdp.c) */
    void *ud;
    /* v[0..n) := its sum over ranks, in rank order (the same bits on every rank) */
    fl_status (*sum)(void *ud, double *v, int n);
    /* after this rank updated its range: every rank's range of o->w.p to every rank (stages 1 and 2) */
    fl_status (*gather)(void *ud, struct fl_optimizer *o);
    /* v[0..n) := its elementwise max over ranks (the same bits on every rank; 8-bit AdamW under
     * FULL_SHARD: the partial absmax of the blocks cut by a rank edge) */
    fl_status (*max)(void *ud, float *v, size_t n);
    /* tensor parallel (src/train/tp.c), else NULL: the squared norm of the WHOLE model's gradient (the ranks'
     * split entries summed in rank order, the replicated ones once) and the fp16 overflow verdict of every rank,
     * so each rank clips and skips alike */
    fl_status (*grad_sumsq)(void *ud, const struct fl_optimizer *o, double *out);
    fl_status (*any)(void *ud, int *flag);
    /* tensor-parallel LoRA (src/train/tp.c), else NULL: at the start of the step, the gradients that are partial
     * sums of the ranks' (the adapters' whole A or B) summed over the group */
    fl_status (*reduce)(void *ud, struct fl_optimizer *o);
} fl_optim_dist;

/* What an optimizer trains: the model's flat parameters, or its LoRA adapters. */
typedef struct {
    void *p, *g;         /* the parameters and their gradients */
    fl_dtype pt, gt;     /* their dtypes (BF16/F16 with 16-bit parameter storage) */
    size_t pes, ges;     /* their element sizes (fl_dtype_size of pt, gt: set with them) */
    size_t n;
    int n_tensors;       /* tensors of p, for per-tensor (8-bit) state */
    size_t *t_off, *t_n; /* (n_tensors) element offset and size of each */
} fl_optim_train;

/* The per-element state (s_len elements each, OPTIM tag; fp32, or bf16 with bf16-true): AdamW's
 * moments, SGD's momentum buffer (NULL when absent). */
typedef struct {
    float *m, *v;
    float *buf;
} fl_optim_state;

/* 8-bit AdamW's block-wise state. */
typedef struct {
    void *state;              /* one OPTIM block bound per tensor into st */
    size_t state_bytes;
    fl_adam8bit_state *st;    /* (n_tensors) host bookkeeping */
    size_t *p_a, *p_n;        /* (n_tensors) the piece of each tensor whose state st[i] holds
                               * (fl_optim_8bit_piece; the whole tensor but under ZeRO) */
    /* under FULL_SHARD (the model sharded, m->pp): t_off / t_n describe the layout's tensors, p_a / p_n
     * each tensor's elements in this rank's piece of its unit (fl_optim_8bit_fsdp_piece, not widened: a
     * block cut by a rank edge is split between the ranks, its codes each rank's part, its two absmax on
     * both), p_s (n_tensors) where that piece lies in the shard; slot (2 x n_tensors) the exchange slot
     * of the piece's first and last block when a rank edge cuts it, else -1; n_slots the cut blocks of
     * the whole model; x (OPTIM, x_bytes) the exchange vector and the scratch of the first pass
     * (fl_optim_8bit_fsdp_bytes) */
    size_t *p_s;
    int *slot;
    int n_slots;
    void *x;
    size_t x_bytes;
} fl_optim_q8;

/* Loss scaling, the one interface the step and the update call for it (fp16 policies: 16-mixed, 16-true). The
 * optimizer's set-up installs fl_loss_scaler_dynamic (src/train/loss_scale.c: torch.amp.GradScaler over the
 * optimizer's amp.ls) when the precision policy scales the loss (model->prec.loss_scaling); NULL: no scaling, and the
 * step never enters loss_scale.c. Per step: the step multiplies d(loss) by value(o); before the update fl_optim_step
 * calls unscale(o, &inv, &skip) once: the overflow check of the scaled gradients (every rank decides alike:
 * fl_optim_found_inf) and the scale's update; *skip 1: an inf/NaN was found, the update is skipped (the scale
 * backed off); else *inv is the factor the update multiplies the gradients by (times any clipping factor). unscale
 * returns an error status with its message set (the check's collective). */
typedef struct fl_loss_scaler {
    const char *name;
    float (*value)(const struct fl_optimizer *o);
    fl_status (*unscale)(struct fl_optimizer *o, float *inv, int *skip);
    /* Where the overflow check runs on the device (the backend's check_finite_dev beside the norm, the update
     * skipping itself on the flag): inv(o) is the factor that update multiplies the gradients by, and update(o, found)
     * takes the device's verdict when the step's scalars are read (the scale's update; returns 1: the step skipped). */
    float (*inv)(const struct fl_optimizer *o);
    int (*update)(struct fl_optimizer *o, int found);
} fl_loss_scaler;
extern const fl_loss_scaler fl_loss_scaler_dynamic;

/* Dynamic loss scaling's state: on = the policy scales the loss (what the checkpoint and the trainers read), scaler
 * the interface above (set with on), ls GradScaler's state. */
typedef struct {
    int on;
    const fl_loss_scaler *scaler;
    fl_loss_scale ls;
    int skipped; /* the last fl_optim_step skipped the update (overflow) */
} fl_optim_amp;

/* The range of p / g whose state this optimizer holds (m, v, buf: len elements) and which
 * fl_optim_step updates: [0, n) except under ZeRO (fl_optim_init_shard); the data-parallel hooks. */
typedef struct {
    size_t off, len;
    const fl_optim_dist *dist; /* NULL in one process */
} fl_optim_shard;

/* The update of the optimizer's range where it does not run in place in one call (CPU offload staged through the
 * host tier, the state or the parameters on NVMe: src/train/optim_offload.c installs fl_optim_offload_update in
 * fl_optim_init_offload; NULL: fl_optim_step updates the range in place with home.be's kernels). range updates
 * elements [a, a + n) of the rank's range as update number `step`, the gradients times `scale` (the clipping and
 * loss-scaling factor): AdamW or SGD, elementwise, so the pieces it walks give the bits of one call over the
 * range. It returns an error status with its message set. */
struct fl_optimizer;
typedef struct fl_optim_update_ops {
    const char *name;
    fl_status (*range)(const struct fl_optimizer *o, size_t a, size_t n, float lr, float scale, int step);
} fl_optim_update_ops;

/* Where the state lives and the update runs: be's memory from pool (the model's backend and pool;
 * under CPU offload, fl_optim_init_offload, the host backend and the host tier). Checkpoints read
 * and write m, v and buf through be. */
typedef struct {
    const fl_backend *be;
    struct fl_mem_pool *pool;
    int disk;                  /* the state in a disk pool (NVMe offload): the update walks it piece by
                                * piece, prefetching the next piece and releasing the last (fl_mem_disk_*) */
    struct fl_mem_pool *hpool; /* the host tier the staging comes from */
    void *hp, *hg;             /* offload on a device whose memory the host cannot read: one piece of the
                                * parameters and of the gradients in the host tier (WORKSPACE), staged per update */
    size_t piece;              /* the update's piece (staged or on disk), elements */
    int params_host;           /* parameter offload: the parameters and gradients it updates are in the host tier
                                * (or NVMe files): the norm, the overflow check and the update run on be, in place */
    struct fl_mem_pool *ppool; /* parameter offload on NVMe: their disk pool (the update reads ahead and drops their
                                * pieces as it does the state's), else NULL */
    int updated;               /* this step's update already ran unit by unit beside the backward (FULL_SHARD with
                                * the optimizer offloaded, no clipping or loss scaling: src/train/fsdp.c): the next
                                * fl_optim_step only counts it and reports the norm */
    const fl_optim_update_ops *update; /* the offloaded update (fl_optim_init_offload), or NULL: in place */
} fl_optim_home;

typedef struct fl_optimizer {
    fl_optim_config cfg;
    const char *name;   /* cfg.kind's name ("AdamW", "SGD", "AdamW8bit": fl_optim_name at set-up), for messages */
    fl_model *model;
    int step;           /* updates done */
    fl_optim_train w;   /* what it trains */
    fl_optim_state st;  /* the per-element state */
    fl_optim_q8 q8;     /* 8-bit AdamW's state */
    fl_optim_amp amp;   /* loss scaling */
    fl_optim_shard shard; /* the range it updates, the data-parallel hooks */
    fl_optim_home home; /* where the state lives */
    /* issue 30 item 5: the device's step scalars (fl_backend.step_scalars) the caller lends for one fl_optim_step
     * (fl_step_run; NULL: none): where the backend has the slots and the update runs on the model's backend in one
     * process (AdamW or SGD, no offload), the norm and the clip scale stay there (ss_pending = 1, *norm_out NaN)
     * until fl_optim_step_finish gets them from the caller's read */
    double *ss;
    double *ss_home; /* the model's backend's step-scalar memory (its set-up slot step_scalars, asked once by the
                      * optimizer's set-up: the same memory for every step), or NULL: the backend has none */
    int ss_nloss;   /* the loss sums in ss (ss[FL_SS_LOSS + k]) that must be finite for the update to run */
    int ss_pending;
} fl_optimizer;

/* CPU offload (ZeRO-Offload; fl_cfg_offload): the host backend the update runs on (the model's own
 * backend when its memory is host memory) and the host tier its state comes from (be->host_pool_init of
 * the model's backend: outside the device pool and its budget). */
typedef struct {
    const fl_backend *be;
    struct fl_mem_pool *pool;
    struct fl_mem_pool *state_pool; /* NVMe offload: the state's disk pool (fl_mem_disk_pool_init, or a plan's
                                     * stand-in); NULL: the state in pool */
    int params_host;                /* parameter offload (fl_cfg_param_offload): the model's parameter and gradient
                                     * shards are host memory (the host tier or NVMe files) that be updates in place */
    struct fl_mem_pool *param_pool; /* parameter offload on NVMe: the shards' disk pool, else NULL */
} fl_optim_offload;

/* Optimizer over the model's trainable parameters: all of them, or only the
 * LoRA adapters when the model has LoRA (the base is frozen). */
fl_status fl_optim_init(fl_optimizer *o, fl_model *model, const fl_optim_config *cfg);
/* The same holding state only for rank `rank`'s chunk of the trainable elements among `world`
 * (fl_comm_chunk's layout: ZeRO). world 1 = fl_optim_init. 8-bit AdamW keeps its block-wise
 * state per tensor: see fl_optim_8bit_piece. A sharded model (FULL_SHARD, m->pp): state for the
 * whole shard; world and rank place 8-bit AdamW's pieces (fl_optim_8bit_fsdp_piece). */
fl_status fl_optim_init_shard(fl_optimizer *o, fl_model *model, const fl_optim_config *cfg, int world, int rank);
/* The same with the state in off's host tier and the update on off's backend (off NULL: as
 * fl_optim_init_shard). AdamW (fp32 or bf16 state) and SGD; not 8-bit AdamW, nor a sharded model
 * (FULL_SHARD's parameters stay on the device: parameter offload is not built). Each step copies this
 * rank's range of the (reduced) gradients and the parameters to the host piece by piece, updates them
 * there with the host's kernels and copies the parameters back: the same arithmetic as the update on the
 * device where the kernels are the same (cpu, opaque); on a backend whose memory is host memory nothing is
 * copied (the update runs in place, only the state lives in the host tier). */
fl_status fl_optim_init_offload(fl_optimizer *o, fl_model *model, const fl_optim_config *cfg, int world, int rank,
                                const fl_optim_offload *off);
/* Copies of the optimizer's state (m, v, buf) to or from host memory, through the state's backend, in
 * slices; NVMe offload: each slice's pages are written back and dropped once copied, so a checkpoint of
 * a state larger than the host's memory streams through a slice of it. `state` points into o's state. */
fl_status fl_optim_state_read(const fl_optimizer *o, void *host, const void *state, size_t bytes);
fl_status fl_optim_state_write(const fl_optimizer *o, void *state, const void *host, size_t bytes);
/* Elements per piece of the offloaded update's staging (0: the default, 4 Mi: 16 MiB of fp32 each for
 * parameters and gradients). Tests use small odd sizes so the range spans several pieces. */
void fl_optim_set_offload_piece(size_t elements);
/* 8-bit AdamW under ZeRO: the piece [*a, *a + *len) of a tensor (t_n elements at flat offset t_off
 * of n) whose state rank `rank` of `world` keeps and updates: the tensor's elements inside the
 * rank's chunk, widened to whole blocks of 256 on 8-bit tensors (fl_adam8bit_is_8bit(t_n)), so
 * every block is quantized over the same elements as in one process; a block cut by a chunk edge
 * is kept, and updated alike, by both neighbours. *len 0: none. world 1: the whole tensor. */
void fl_optim_8bit_piece(size_t n, size_t t_off, size_t t_n, int world, int rank, size_t *a, size_t *len);
/* 8-bit AdamW under FULL_SHARD / ZeRO-3: tensor i of lay within rank `rank`'s piece of its unit
 * (each unit split by fl_comm_chunk among `world` on its own, src/train/fsdp.c): the tensor's elements
 * [*a, *a + *len), at element *shard_off of the rank's shard (*len 0: none). Not widened to blocks:
 * a block cut by the edge between two ranks' pieces keeps its codes split between them and its scale
 * on both; each quantizes it with the max over the whole block, exchanged (src/train/optim.c). */
void fl_optim_8bit_fsdp_piece(const fl_param_layout *lay, int i, int world, int rank, size_t *a, size_t *len,
                              size_t *shard_off);
/* The blocks of 8-bit tensors that a rank edge cuts under FULL_SHARD at `world` ranks, numbered in
 * layout order over the whole model (the exchange slots); edge_slot (n_groups x (world + 1), may be
 * NULL) gets for each unit g and rank e the slot of the block holding the edge where rank e's piece
 * starts, or -1. Returns the count. */
int fl_optim_8bit_fsdp_slots(const fl_param_layout *lay, int world, int *edge_slot);
/* The state bytes of a piece [a, a + len) of a tensor of t_n elements: 8-bit tensors: codes 2 per
 * element padded to 4, two fp32 absmax per block the piece meets; else fp32 m and v. */
size_t fl_adam8bit_piece_bytes(size_t t_n, size_t a, size_t len);
/* What 8-bit AdamW under FULL_SHARD holds as OPTIM on rank `rank`: its pieces' state (one
 * allocation) and, when any block is cut, the exchange scratch (a second); *scratch (may be NULL)
 * gets the latter's bytes. What fl_optim_init allocates on a sharded model; the planner's figure. */
size_t fl_optim_8bit_fsdp_bytes(const fl_param_layout *lay, int world, int rank, size_t *scratch);
/* The widest reach of a rank's 8-bit pieces beyond its chunk, in elements (< 256): ZeRO-2 fetches
 * that many reduced gradients from each neighbour. */
#define FL_OPTIM_8BIT_HALO (FL_ADAM8BIT_BLOCK - 1)
void fl_optim_free(fl_optimizer *o);
/* Global L2 norm of the model's gradients (double accumulation). fl_optim_step computes the norm
 * it clips with as the sum, in rank order, of the squared norms of the world's gradient chunks
 * (one chunk in one process: the same value), so DDP, ZeRO-1 and ZeRO-2 clip with the same bits. */
double fl_grad_norm(const fl_model *model);
/* Loss scaling's overflow check: *found 1 when any of the gradients o updates, times inv_scale, is inf or NaN; the
 * verdict of every rank (ZeRO-2: each checks its range and the verdicts are summed; tensor / pipeline parallel:
 * dist->any), so every rank skips alike. */
fl_status fl_optim_found_inf(const fl_optimizer *o, float inv_scale, int *found);
/* One update with learning rate lr. If max_norm > 0 the gradients are clipped
 * to that global norm (torch.nn.utils.clip_grad_norm_: coef = max_norm /
 * (norm + 1e-6), applied when < 1). *norm_out (may be NULL) gets the norm
 * before clipping. With loss scaling, an inf/NaN among the scaled gradients
 * skips the update (o->amp.skipped = 1, *norm_out = NAN) and backs the scale
 * off; otherwise the gradients are unscaled inside the update. */
fl_status fl_optim_step(fl_optimizer *o, float lr, float max_norm, double *norm_out);
/* After an fl_optim_step that left its norm on the device (o->ss_pending): ss the step scalars read back
 * (FL_SS_NORM, FL_SS_SCALE, FL_SS_FOUND): *norm_out := the norm; a NaN scale (the device skipped the update: a
 * non-finite norm or loss, fp16's overflow; the weights and state are as before) leaves the step uncounted. Under
 * loss scaling the overflow flag updates the scale (fl_loss_scale_update) and an overflow is a skipped step
 * (o->amp.skipped, *norm_out NaN), as fl_optim_step's host check makes it; otherwise a non-finite norm is
 * FL_ERR_NONFINITE as fl_optim_step says it. */
fl_status fl_optim_step_finish(fl_optimizer *o, const double *ss, double *norm_out);
/* 1 when fl_optim_step, lent the step scalars, keeps the norm and the update's scale on the device (the backend
 * has the slots; one process, no offload, AdamW or SGD) */
int fl_optim_device_step(const fl_optimizer *o);

typedef struct {
    double loss;        /* mean over valid targets of the step */
    long n_valid;       /* valid targets */
    double grad_norm;   /* before clipping (unscaled) */
    int skipped;        /* loss scaling: inf/NaN gradients, update skipped */
    float loss_scale;   /* loss scale after the step (0 without loss scaling) */
    /* wall ms per phase, summed over the micro-batches: ms_fwd embedding + blocks + final norm,
     * ms_head lm_head + cross-entropy + the head's backward (they run chunk by chunk inside the
     * forward), ms_bwd the backward of the final norm, blocks and embedding, ms_opt the optimizer
     * (gradient norm, clipping, update); ms_total the whole step (also the gradient clear) */
    double ms_fwd, ms_bwd, ms_opt, ms_total;
    double ms_head;
} fl_step_result;

/* fl_micro_batch, one micro-batch of a step: fitllm/model.h (fl_model_forward_micro reads it). */

struct fl_dp; /* data parallelism (src/train/dp.h) */

/* Gradient synchronisation over the data-parallel ranks, the one interface the step calls for it (DDP's buckets,
 * ZeRO-1/2's reduce-scatter, FSDP's per-unit reduce-scatter and offloaded update: src/train/dp.c installs it in
 * fl_dp_init, over the run's struct fl_dp; one process: the same calls, each a no-op). The step calls, per step:
 * arm(k) before each micro-batch's forward (last: k is the step's last, whose backward reduces as gradients become
 * ready and may run an offloaded update unit by unit, lr / max_norm that update's), then reduce once after the last
 * backward: the sum over the ranks of o's gradients in place (what fl_optim_step then reads), and in *live the
 * bytes of o->w.g still live after it (SIZE_MAX: nothing to say; e.g. ZeRO-2's chunk) with *snap 1 when several
 * ranks took part (the step's after_reduce snapshot). Either returns an error status with its message set. */
typedef struct fl_grad_sync {
    void *self;
    int world, rank;
    fl_status (*arm)(void *self, struct fl_optimizer *o, int last, float lr, float max_norm);
    fl_status (*reduce)(void *self, struct fl_optimizer *o, size_t *live, int *snap);
} fl_grad_sync;

/* One training step, the one the trainer, bench-step, the demo and the tests all run
 * (fl_step_run): zero the gradients; for each micro-batch k the forward (phase "forward") and the
 * backward ("backward"), gradients accumulating; the reduction over the ranks (sync, fl_grad_sync); the optimizer
 * update ("optimizer step"). Memory snapshots before_fwd, after_fwd, after_bwd (micro-batch 0's) and
 * after_opt_step; the live bytes of each phase (fl_model_live) recorded at its boundary. */
typedef struct {
    const fl_micro_batch *mbs; /* (n_micro) this rank's micro-batches of the step */
    int n_micro;
    long step_valid;           /* the step's valid targets over every rank: grad scale 1 / step_valid */
    int skip_empty;            /* step_valid <= 0: no forward, no update (else an error) */
    float lr, max_norm;
    struct fl_dp *dp;          /* data parallel (the pipeline's step reads it); NULL: one process */
    const fl_grad_sync *sync;  /* the gradient synchronisation fl_step_run calls (the run's dp->sync); NULL: none */
    int seeded;                /* set the LoRA dropout seed of each micro-batch: seed + its global index
                                * iter0 + k x world + rank (the same masks at any world size, and resumed) */
    uint64_t seed;
    long iter0;                /* global micro-batches before this step */
    double *mb_stats;          /* (2 n_micro) or NULL: each micro-batch's loss sum and valid targets */
    double *mb_ms;             /* (n_micro) or NULL: each micro-batch's wall ms, the last one's with the update */
    int failed_k;              /* out, on failure: the micro-batch that failed, n_micro the update; else -1 */
    fl_status (*fault)(fl_model *m); /* test hook (fitllm/fault.h): the fault injected into this rank's gradients once
                                      * they are zeroed, or NULL */
    /* 1: an asynchronous device (FL_CAP_ASYNC without host memory: a GPU) is synchronized at the phase edges,
     * so ms_fwd / ms_head / ms_bwd / ms_opt are the device's times (bench-step). 0: no synchronization inside
     * the step (issue 30 item 5: the trainer), the host only waits where a value must reach it (the loss, the
     * gradient norm); the phase times are then the host's enqueue times and ms_total ends when the last op
     * was queued (a run's total time is exact all the same: the next step's loss read waits for this one) */
    int phase_times;
} fl_step_ctx;
/* res (may be NULL): the loss (local micro-batches' summed loss / step_valid), phase timings, the
 * update's norm / skip / loss scale. */
fl_status fl_step_run(fl_model *m, fl_optimizer *o, fl_step_ctx *c, fl_step_result *res);

/* fl_step_run in one process over n_micro micro-batches of (B,T) ids/targets laid out
 * consecutively ((n_micro, B, T) each); step_valid counted from targets. */
fl_status fl_train_step(fl_model *m, fl_optimizer *o, const int32_t *ids, const int32_t *targets, int n_micro, int B,
                        int T, float lr, float max_norm, fl_step_result *res);

#ifdef __cplusplus
}
#endif
#endif

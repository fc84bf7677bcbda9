/* FSDP FULL_SHARD / ZeRO-3 (Lightning's `fsdp` with its default sharding_strategy, DeepSpeed's
 * deepspeed_stage_3) on fl_comm: see dp.h and docs/ARCHITECTURE.md "Parameter sharding".
 *
 * Units. The model's layout groups are the FSDP units: 0 the embeddings, 1..L the blocks, L+1 the
 * final norm and lm_head (as FSDP wraps each block and leaves the rest to the root). Each unit of
 * n_g elements is split by fl_comm's chunk layout over the ranks ON ITS OWN, so rank r keeps
 * len_r(n_g) elements of it at offset off_r(n_g); its shard is these pieces, unit after unit
 * (loc[g]: the piece's offset in the shard). Why per unit and not one chunk of the whole flat
 * buffer (ZeRO-1/2's): then a unit's gather is exactly fl_comm's all-gather of n_g elements and its
 * gradient exactly a reduce-scatter of n_g (each rank moves (N-1)/N of the unit either way, the
 * traffic of a ring); with one global chunk per rank a block lies in one or two ranks' chunks, its
 * gather would be an all-gather of unequal pieces and its reduction a reduce to one owner, N-1
 * times the traffic into that rank (fl_comm has neither). PyTorch's FSDP shards each FlatParameter
 * (unit) the same way.
 *
 * Load. The model is created sharded (fl_fsdp_prepare: the storage's shard callback allocates the
 * shard in place of the whole buffer and makes the model's parameter store a shard with the pieces: fl_model_store_shard); the loaders and the random
 * init then fill only this rank's pieces (fl_model_param_piece), so no rank ever holds the whole
 * model and no collective runs at load.
 *
 * What each rank holds: its shard of the parameters (PARAMS; bf16-mixed: of the fp32 master
 * weights; the bf16 copy the matmuls read exists only for a gathered unit), of the gradients
 * (GRADS) and of the optimizer state (OPTIM: the optimizer runs on the shard as on a whole buffer,
 * elementwise), and while a unit is in use its gathered parameters and its gradient of the current
 * micro-batch (GATHER). The model asks for each unit right before using it (fl_param_provider,
 * transformer.c): gather(g, next) waits for g's all-gather (posted ahead while the previous unit
 * computed) and posts next's; at most 2 blocks' parameter buffers exist at once (limit_all_gathers:
 * a prefetch is not posted while two blocks are gathered), the head group and, with tied
 * embeddings, the embeddings come on top at the head. In backward each block is gathered again
 * (activation checkpointing recomputes from the same gathered buffer), its gradient accumulates in
 * a zeroed gathered-gradient buffer, and when its backward ends one reduce-scatter sums it over the
 * ranks into the rank's gradient piece: the first micro-batch of a step writes it, the later ones
 * add to it (the reduced piece of that micro-batch, rounded once per add).
 *
 * Bits. The gather copies bits; the reduce-scatter of element i is x_0[i] + ... + x_{N-1}[i] in rank
 * order (fl_comm). With accumulation 1 the reduced gradient is therefore DDP's / ZeRO-2's bit for bit
 * and the update is elementwise on the same bits, so FULL_SHARD gives ZeRO-2's parameters exactly
 * except for the clipping norm: it is the rank-order sum of the ranks' squared shard norms (double),
 * a different partition from ZeRO-2's chunks, so its last bits may differ (without clipping: the
 * same bits, checked in tests/test_fsdp.c). With accumulation > 1 the order differs from DDP's:
 * FSDP sums the ranks first and then the micro-batches (sum_k (sum_r g_rk)), DDP the micro-batches
 * first (sum_r (sum_k g_rk)); the same reassociation as tests/ddp_ref.h's bound covers.
 *
 * HYBRID_SHARD (--fsdp.sharding_strategy HYBRID_SHARD, pretrain's auto across nodes; PyTorch FSDP's
 * semantics): FULL_SHARD within each node, replicated across the nodes. The world of devices x
 * num_nodes ranks is split (fl_fsdp_prepare, fl_comm_split) into the nodes, dp->node = ranks
 * k*devices .. k*devices + devices-1 (Lightning's --devices per node, the launcher's block placement:
 * mpirun --map-by ppr:D:node, srun), and the replica groups, dp->rep = the ranks of one local rank
 * on every node, in node order. Everything above runs over the node instead of the world: the units
 * are chunked over the node's ranks (rank r keeps its local rank's pieces, the same on every node),
 * gathered within the node; a unit's gradient is reduce-scattered within the node, then its piece
 * all-reduced over the replica group (the nodes holding the same piece), so every node ends with the
 * same reduced shard, and the elementwise update keeps the nodes' shards bit-identical. The data is
 * not split by node: rank r still trains global micro-batches j = k*world + r of the one stream.
 * Bits: element i's gradient is sum_n (sum_l g_(n,l)[i]), each node's rank-order sum first (fp32;
 * BF16 gradients rounded once there), then the nodes' in node order (rounded once more): DDP's
 * rank-order sum reassociated ((g0 + g1) + (g2 + g3) where DDP adds ((g0 + g1) + g2) + g3; with one
 * rank per node it IS DDP's order, with one node it is FULL_SHARD), within tests/ddp_ref.h's bound.
 * The clipping norm sums each distinct shard once: over the node (fl_fsdp_sum), not over the
 * replicas. Checkpoints: consolidated ones are gathered within node 0 (rank 0 writes); sharded
 * ones are written by node 0's ranks (shard_ckpt.c). HYBRID on one node is FULL_SHARD (no split). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dp.h"
#include "fitllm/checkpoint.h"
#include "fitllm/io.h"

struct fl_fsdp {
    fl_dp *dp;
    fl_comm *sc, *rc;       /* the shard group (the world; HYBRID: the node) and the replica group (HYBRID, else NULL)
                             * of the backend's buffers: the device communicator's (dp->dev and its splits) when
                             * the run has one, else the host's */
    fl_comm *hsc;           /* the shard group over host memory (the checkpoint streams' staged units) */
    fl_model *m;
    fl_param_provider pp;
    int G;                  /* units: layout groups */
    size_t *n;              /* (G) elements of each unit */
    size_t *coff, *clen;    /* (G) this rank's chunk of the unit (fl_comm_chunk of n[g]) */
    size_t *foff;           /* (G) that chunk's whole-model offset: group_offset[g] + coff[g] */
    size_t *loc;            /* (G + 1) offset of that chunk in the shard; loc[G] = shard elements */
    fl_group_view *views;   /* (G) */
    void **pbuf, **cbuf;    /* (G) gathered parameters (store dtype) and compute copy (mixed) */
    fl_comm_req **req;      /* (G) a gather in flight */
    int *fresh;             /* (G) the next reduction writes the shard's gradient (first micro-batch) */
    int no_bwd_prefetch;    /* fsdp.backward_prefetch off (fl_fsdp_init): in backward no gather is posted ahead */
    int live_blocks;        /* blocks (units 1..L) whose parameters are gathered or in flight */
    size_t es, ces;         /* element bytes of the storage and of the compute copy (0: none) */
    fl_dtype word;          /* what the all-gather moves: F32, or 16-bit storage as BF16 words */
    /* parameter offload (dp->ptier): the shards of the parameters and gradients are host memory of tbe (tpool: the
     * host tier or NVMe files); sc NULL: one rank (a unit's gather is the copy of the whole unit up, its reduction
     * the copy down) */
    const fl_backend *tbe;
    fl_mem_pool *tpool;
    int staged;             /* the shard group's communicator takes device buffers only: each piece goes up into
                             * sbuf[g] first (GATHER) and is all-gathered from there */
    void **sbuf;            /* (G) */
    fl_comm *own;           /* one rank: the host shard group of the checkpoint streams (a single communicator) */
    /* --offload_overlap (fetch.c): the worker copying a posted unit's piece (one rank: the unit) out of the tier
     * while the unit before it computes; direct: straight into device memory (a host-memory backend), else into
     * host-tier staging hslot[g] (page-locked on a GPU) that goes up when the unit arrives */
    fl_fetch *fw;
    fl_fetch_job *job;      /* (G) */
    void **hslot;           /* (G) */
    int direct;
    int afetch;             /* the fetches ahead go through fw (fw may run the updates alone: afetch 0) */
    /* --offload_update_overlap (fl_fsdp_update_arm): this step's units' updates on fw, queued as each unit's
     * gradient becomes final; the optimizer, lr and update number of the step, each unit's job and argument */
    int uarmed, ustep, uposted;
    int uhold; /* fl_fsdp_update_hold: the unit whose update waits for fl_fsdp_update_wait (-1: none) */
    unsigned long n_early, n_queued, n_sched; /* fl_fsdp_update_counts, this bookkeeping's */
    float ulr;
    const fl_optimizer *uo;
    fl_fetch_job *ujob;     /* (G) */
    struct fsdp_unit_upd *uarg; /* (G) */
};

struct fsdp_unit_upd {
    struct fl_fsdp *f;
    int g;
};

#define FSDP_BLOCK_LIMIT 2 /* limit_all_gathers: blocks gathered at once */

static int is_block(const struct fl_fsdp *f, int g) { return g >= 1 && g <= f->G - 2; }

size_t fl_fsdp_shard_numel(const fl_param_layout *lay, int world, int rank) {
    size_t total = 0;
    for (int g = 0; g < lay->n_groups; g++) {
        size_t off, len;
        fl_comm_chunk(lay->group_offset[g + 1] - lay->group_offset[g], world, rank, &off, &len);
        total += len;
    }
    return total;
}

const char *fl_fsdp_refusal(const fl_run_config *cfg, const fl_precision *p) {
    (void)cfg, (void)p; /* every optimizer and precision runs, on host and device memory (AdamW8bit: blocks cut
                        * by a rank edge exchange their scales, src/train/optim.c; 16-true: F16 shards, reduced
                        * like BF16) */
    return NULL;
}

/* ---- the provider (model-side hooks) -------------------------------------------------------- */

/* The tests' hold in a parameter fetch (tests/mpi_test.sh: a rank killed during one): with
 * FITLLM_TEST_FETCH_HOLD=FILE, once FILE exists and holds this rank's number, the rank's next fetch writes its pid
 * to FILE.held and waits there until the process ends. */
static void test_fetch_hold(const struct fl_fsdp *f) {
    const char *path = getenv("FITLLM_TEST_FETCH_HOLD");
    FILE *in = path && path[0] ? fopen(path, "r") : NULL;
    int r = -1;
    if (!in) return;
    if (fscanf(in, "%d", &r) != 1) r = -1;
    fclose(in);
    if (r != f->dp->rank) return;
    char held[4200];
    snprintf(held, sizeof held, "%s.held", path);
    FILE *out = fopen(held, "w");
    if (out) fprintf(out, "%ld\n", (long)getpid()), fclose(out);
    for (;;) nanosleep(&(struct timespec){0, 100000000L}, NULL);
}

/* --offload_overlap: unit g's piece (one rank: the unit) is copied out of the tier by the worker, straight into
 * the buffer the gather reads on a host-memory backend, else into host-tier staging; the rest (the copy up from
 * the staging, several ranks' all-gather) happens when the unit arrives (arrive). The planner's null backend takes
 * the same allocations and copies nothing (its addresses are counted, not memory). */
static fl_status post_async(struct fl_fsdp *f, int g, const void *src) {
    fl_model *m = f->m;
    const size_t bytes = (f->sc ? f->clen[g] : f->n[g]) * f->es;
    void *dst = f->pbuf[g];
    if (!f->direct) {
        FL_TRY(fl_mem_alloc(f->dp->ptier.host, FL_TAG_WORKSPACE, bytes, &f->hslot[g]));
        dst = f->hslot[g];
    } else if (f->sc) {
        FL_TRY(fl_mem_alloc(m->pool, FL_TAG_GATHER, bytes, &f->sbuf[g]));
        dst = f->sbuf[g];
    }
    fl_fetch_post(f->fw, &f->job[g], dst, src, fl_backend_discards(m->be) ? 0 : bytes);
    return FL_OK;
}

/* The worker's copy of unit g has landed (waited for): up from the staging, then (several ranks) the all-gather of
 * the pieces, blocking: the collective runs in unit order on every rank, as the posts do. */
static fl_status arrive(struct fl_fsdp *f, int g) {
    fl_model *m = f->m;
    fl_fetch_wait(f->fw, &f->job[g]);
    const size_t bytes = (f->sc ? f->clen[g] : f->n[g]) * f->es;
    fl_status s = FL_OK;
    if (f->hslot[g]) {
        void *dst = f->pbuf[g];
        if (f->sc) {
            s = fl_mem_alloc(m->pool, FL_TAG_GATHER, bytes, &f->sbuf[g]);
            dst = f->sbuf[g];
        }
        if (s == FL_OK) s = FL_RUN(m->be, to_device, dst, f->hslot[g], bytes);
        /* a queued copy (a GPU's stream) must have read the staging before it is freed and reused */
        if (s == FL_OK && (m->be->caps & FL_CAP_ASYNC)) s = FL_RUN(m->be, sync);
        fl_mem_free(f->dp->ptier.host, f->hslot[g]);
        f->hslot[g] = NULL;
    }
    if (s == FL_OK && f->sc) s = fl_comm_all_gather(f->sc, f->sbuf[g], f->pbuf[g], f->n[g], f->word);
    return fl_error_prefix(s, "parameter offload: fetching unit %d (%zu elements)", g, f->n[g]);
}

static fl_status post(struct fl_fsdp *f, int g) {
    fl_model *m = f->m;
    FL_TRY(fl_mem_alloc(m->pool, FL_TAG_GATHER, f->n[g] * f->es, &f->pbuf[g]));
    if (f->ces) {
        fl_status s = fl_mem_alloc(m->pool, FL_TAG_GATHER, f->n[g] * f->ces, &f->cbuf[g]);
        if (s != FL_OK) {
            fl_mem_free(m->pool, f->pbuf[g]);
            f->pbuf[g] = NULL;
            return s;
        }
    }
    if (is_block(f, g)) f->live_blocks++;
    const char *shard = (const char *)fl_model_params_data(m);
    const void *src = shard + f->loc[g] * f->es;
    if (f->tbe) { /* parameter offload: the piece comes up from the host tier (NVMe: read from its file) */
        test_fetch_hold(f);
        if (f->afetch) return post_async(f, g, src);
        if (!f->sc) /* one rank: the piece is the unit */
            return fl_error_prefix(FL_RUN(m->be, to_device, f->pbuf[g], src, f->n[g] * f->es),
                                   "parameter offload: fetching unit %d (%zu elements) from the host", g, f->n[g]);
        if (f->staged) {
            FL_TRY(fl_mem_alloc(m->pool, FL_TAG_GATHER, f->clen[g] * f->es, &f->sbuf[g]));
            FL_TRY(fl_error_prefix(FL_RUN(m->be, to_device, f->sbuf[g], src, f->clen[g] * f->es),
                                   "parameter offload: fetching unit %d's piece (%zu elements) from the host", g,
                                   f->clen[g]));
            src = f->sbuf[g];
        }
    }
    return fl_error_prefix(fl_comm_iall_gather(f->sc, src, f->pbuf[g], f->n[g], f->word, &f->req[g]),
                           "FSDP: gathering unit %d (%zu elements)", g, f->n[g]);
}

/* Parameter offload on NVMe: unit g's piece of the shard leaves the process's memory once it is on the device
 * (written back when the update dirtied it); the next `prefetch` units' pieces are read ahead. */
static fl_status tier_done(struct fl_fsdp *f, int g) {
    if (!f->tbe || !f->dp->ptier.disk) return FL_OK;
    const char *shard = (const char *)fl_model_params_data(f->m);
    return fl_error_prefix(fl_mem_disk_advise(f->tpool, shard + f->loc[g] * f->es, f->clen[g] * f->es, FL_DISK_RELEASE),
                           "parameter offload: unit %d", g);
}

static void tier_read_ahead(struct fl_fsdp *f, int g, int next) {
    if (!f->tbe || !f->dp->ptier.disk || next < 0) return;
    const char *shard = (const char *)fl_model_params_data(f->m);
    const int d = next > g ? 1 : -1;
    for (int k = 0, u = next; k < f->dp->ptier.prefetch && u >= 0 && u < f->G; k++, u += d)
        fl_mem_disk_advise(f->tpool, shard + f->loc[u] * f->es, f->clen[u] * f->es, FL_DISK_PREFETCH);
}

static void free_stage(struct fl_fsdp *f, int g) {
    if (f->sbuf && f->sbuf[g]) fl_mem_free(f->m->pool, f->sbuf[g]);
    if (f->sbuf) f->sbuf[g] = NULL;
    if (f->hslot && f->hslot[g]) fl_mem_free(f->dp->ptier.host, f->hslot[g]);
    if (f->hslot) f->hslot[g] = NULL;
}

static fl_status pp_gather(void *ud, int g, int next) {
    struct fl_fsdp *f = ud;
    fl_model *m = f->m;
    if (!f->pbuf[g]) FL_TRY(post(f, g));
    if (!f->views[g].p) { /* it arrives: the parameters, then (mixed) the copy the matmuls read */
        if (f->req[g]) FL_TRY(fl_error_prefix(fl_comm_wait(&f->req[g]), "FSDP: gathering unit %d", g));
        if (f->fw && fl_fetch_posted(f->fw, &f->job[g])) FL_TRY(arrive(f, g));
        free_stage(f, g);
        FL_TRY(tier_done(f, g));
        if (f->ces) FL_TRY(FL_RUN(m->be, convert, f->cbuf[g], m->prec.compute_dtype, f->pbuf[g], FL_F32, f->n[g]));
        f->views[g].p = f->pbuf[g];
        f->views[g].wc = f->cbuf[g];
    }
    /* backward walks the units down (next < g): without backward prefetch each is gathered when it is needed;
     * parameter offload with --offload_prefetch 0: nothing is fetched ahead in either direction */
    tier_read_ahead(f, g, next);
    if (next >= 0 && next < f->G && !f->pbuf[next] && (!is_block(f, next) || f->live_blocks < FSDP_BLOCK_LIMIT) &&
        (next > g || !f->no_bwd_prefetch) && (!f->tbe || f->dp->ptier.prefetch > 0))
        FL_TRY(post(f, next));
    return FL_OK;
}

static void pp_release(void *ud, int g) {
    struct fl_fsdp *f = ud;
    if (!f->pbuf[g]) return;
    if (f->req[g]) (void)fl_comm_wait(&f->req[g]); /* posted, never used: it must land before the buffer goes */
    if (f->fw) fl_fetch_wait(f->fw, &f->job[g]);
    free_stage(f, g);
    fl_mem_free(f->m->pool, f->cbuf[g]);
    fl_mem_free(f->m->pool, f->pbuf[g]);
    f->cbuf[g] = f->pbuf[g] = NULL;
    f->views[g].p = f->views[g].wc = NULL;
    if (is_block(f, g)) f->live_blocks--;
}

static fl_status pp_grads_begin(void *ud, int g) {
    struct fl_fsdp *f = ud;
    if (f->views[g].g) return FL_OK;
    FL_TRY(fl_mem_alloc(f->m->pool, FL_TAG_GATHER, f->n[g] * f->es, &f->views[g].g));
    if (f->tbe && !f->sc && !f->fresh[g]) {
        /* parameter offload at one rank, a later micro-batch of the step: the unit's gradient so far comes up and
         * the ops accumulate into it, as they do into a whole model's gradient buffer (the one-process run's
         * arithmetic, hence its bits; grads_ready copies it back down) */
        const char *src = (const char *)fl_model_grads_data(f->m) + f->loc[g] * f->es;
        fl_status s = FL_RUN(f->m->be, to_device, f->views[g].g, src, f->n[g] * f->es);
        if (s == FL_OK && f->dp->ptier.disk) s = fl_mem_disk_advise(f->tpool, src, f->n[g] * f->es, FL_DISK_RELEASE);
        return fl_error_prefix(s, "parameter offload: unit %d's gradient so far to the device", g);
    }
    FL_RUN(f->m->be, zero, f->views[g].g, f->n[g] * f->es);
    return FL_OK;
}

/* Parameter offload: the rank's reduced piece `red` (device memory, len elements of gt) down into the host
 * gradient shard dst: the step's first micro-batch copies it, later ones add it on the host's kernels with the
 * device run's arithmetic (fp32: one add; 16-bit: widened on the device into gstage, added into the 16-bit shard
 * rounded once), through host-tier scratch. NVMe: the piece's pages are written back and dropped after. */
static fl_status grads_down(struct fl_fsdp *f, int g, const void *red, char *dst, size_t len, fl_dtype gt) {
    fl_model *m = f->m;
    const fl_backend *be = m->be, *hb = f->tbe;
    fl_status s = FL_OK;
    if (f->fresh[g]) {
        s = FL_RUN(be, to_host, dst, red, len * f->es);
    } else if (len) {
        fl_mem_pool *hp = f->dp->ptier.host;
        void *h = NULL;
        s = fl_mem_alloc(hp, FL_TAG_WORKSPACE, len * sizeof(float), &h);
        if (s == FL_OK && gt == FL_F32) {
            s = FL_RUN(be, to_host, h, red, len * sizeof(float));
            if (s == FL_OK) FL_RUN(hb, add, (float *)dst, (const float *)dst, h, len);
        } else if (s == FL_OK) {
            float *gstage = fl_model_grad_stage(m);
            s = FL_RUN(be, convert, gstage, FL_F32, red, gt, len);
            if (s == FL_OK) s = FL_RUN(be, to_host, h, gstage, len * sizeof(float));
            if (s == FL_OK) s = FL_RUN(hb, accumulate16, (uint16_t *)dst, gt, h, len);
        }
        fl_mem_free(hp, h);
    }
    if (s == FL_OK && f->dp->ptier.disk) s = fl_mem_disk_advise(f->tpool, dst, len * f->es, FL_DISK_RELEASE);
    return fl_error_prefix(s, "parameter offload: unit %d's gradient piece to the host", g);
}

/* --offload_update_overlap: unit g's update on the fetch worker (its piece of the shard: the optimizer's range is
 * the shard, so the unit's elements are [loc[g], loc[g] + clen[g]) of it) */
static fl_status unit_update(void *ud) {
    const struct fsdp_unit_upd *u = ud;
    const struct fl_fsdp *f = u->f;
    return fl_error_prefix(fl_optim_update_part(f->uo, f->loc[u->g], f->clen[u->g], f->ulr, f->ustep),
                           "the optimizer's update of unit %d (on the fetch worker)", u->g);
}

/* The unit's gradient is final (the last micro-batch's reduction): its update is queued. Nothing reads or writes
 * the unit's piece of the parameters, gradients or state until the step ends (the backward walks the other units;
 * the next forward's fetches queue behind it), so the worker owns them meanwhile. */
static fl_status post_update(struct fl_fsdp *f, int g) {
    if (fl_fetch_posted(f->fw, &f->ujob[g]) || f->uarg[g].f)
        return fl_errorf(FL_ERR_INTERNAL, "FSDP: unit %d's gradient was reduced twice in the step's last backward", g);
    f->uarg[g] = (struct fsdp_unit_upd){f, g};
    if (g != f->uhold) fl_fetch_post_run(f->fw, &f->ujob[g], unit_update, &f->uarg[g]); /* held: updated at the wait */
    f->uposted++;
    return FL_OK;
}

static fl_status pp_grads_ready(void *ud, int g) {
    struct fl_fsdp *f = ud;
    fl_model *m = f->m;
    if (!f->views[g].g) return fl_errorf(FL_ERR_INTERNAL, "FSDP: unit %d has no gradient to reduce", g);
    fl_dtype gt = fl_model_store_dtype(m);
    char *dst = (char *)fl_model_grads_data(m) + f->loc[g] * f->es;
    size_t len = f->clen[g];
    fl_status s;
    if (f->tbe && !f->sc) { /* parameter offload at one rank: the unit's gradient (accumulated over the step's
                             * micro-batches on the device, pp_grads_begin) replaces the host's */
        s = FL_RUN(m->be, to_host, dst, f->views[g].g, len * f->es);
        if (s == FL_OK && f->dp->ptier.disk) s = fl_mem_disk_advise(f->tpool, dst, len * f->es, FL_DISK_RELEASE);
        f->fresh[g] = 0;
    } else if (f->tbe) { /* reduced into device scratch (HYBRID: then over the nodes), then down to the host */
        void *tmp = NULL;
        s = fl_mem_alloc(m->pool, FL_TAG_GATHER, len * f->es, &tmp);
        if (s == FL_OK) s = fl_dp_reduce_scatter(f->sc, m->be, m->pool, f->views[g].g, tmp, f->n[g], gt, f->dp->bucket);
        if (s == FL_OK && f->rc) s = fl_comm_all_reduce(f->rc, tmp, tmp, len, gt, FL_COMM_SUM);
        if (s == FL_OK) s = grads_down(f, g, tmp, dst, len, gt);
        f->fresh[g] = 0;
        fl_mem_free(m->pool, tmp);
    } else if (f->fresh[g]) { /* the step's first micro-batch: the reduced piece is the shard's gradient */
        /* HYBRID: the node's sum of the piece, then the nodes' (all-reduce over the replica group, in place) */
        s = fl_dp_reduce_scatter(f->sc, m->be, m->pool, f->views[g].g, dst, f->n[g], gt, f->dp->bucket);
        if (s == FL_OK && f->rc) s = fl_comm_all_reduce(f->rc, dst, dst, len, gt, FL_COMM_SUM);
        f->fresh[g] = 0;
    } else { /* later ones: reduced into scratch, then added (rounded once) */
        void *tmp = NULL;
        s = fl_mem_alloc(m->pool, FL_TAG_GATHER, len * f->es, &tmp);
        if (s == FL_OK) s = fl_dp_reduce_scatter(f->sc, m->be, m->pool, f->views[g].g, tmp, f->n[g], gt, f->dp->bucket);
        if (s == FL_OK && f->rc) s = fl_comm_all_reduce(f->rc, tmp, tmp, len, gt, FL_COMM_SUM);
        if (s == FL_OK && len) {
            if (gt == FL_F32) {
                FL_RUN(m->be, add, (float *)dst, (const float *)dst, tmp, len);
            } else { /* widened into the (free) fp32 gradient staging, added into the 16-bit shard */
                float *gstage = fl_model_grad_stage(m);
                s = FL_RUN(m->be, convert, gstage, FL_F32, tmp, gt, len);
                if (s == FL_OK) s = FL_RUN(m->be, accumulate16, (uint16_t *)dst, gt, gstage, len);
            }
        }
        fl_mem_free(m->pool, tmp);
    }
    fl_mem_free(m->pool, f->views[g].g);
    f->views[g].g = NULL;
    if (s == FL_OK && f->uarmed) s = post_update(f, g);
    return fl_error_prefix(s, "FSDP: reduce-scattering unit %d's gradients (%zu elements)", g, f->n[g]);
}

static void pp_zero_grads(void *ud) {
    struct fl_fsdp *f = ud;
    for (int g = 0; g < f->G; g++) f->fresh[g] = 1;
}

/* ---- set-up ---------------------------------------------------------------------------------- */

void fl_fsdp_free(fl_dp *dp) {
    struct fl_fsdp *f = dp->fsdp;
    if (!f) return;
    for (int g = 0; g < f->G; g++) {
        pp_release(f, g);
        if (f->views && f->views[g].g) fl_mem_free(f->m->pool, f->views[g].g);
    }
    fl_fetch_stop(f->fw);
    if (f->m && fl_model_provider(f->m) == &f->pp) fl_model_store_unshard(f->m);
    free(f->n), free(f->coff), free(f->clen), free(f->foff), free(f->loc), free(f->views), free(f->pbuf), free(f->cbuf);
    free(f->req), free(f->fresh), free(f->sbuf), free(f->job), free(f->hslot), free(f->ujob), free(f->uarg);
    fl_comm_destroy(f->own);
    free(f);
    dp->fsdp = NULL;
}

void fl_fsdp_drop_model(fl_dp *dp) {
    if (dp->fsdp) dp->fsdp->m = NULL;
}

/* The model's storage callback (fl_model_storage.shard), run by fl_model_init_ex in place of the
 * whole parameter buffer: the bookkeeping, this rank's shard (PARAMS) and the provider with its
 * pieces. The loaders and the random init then fill the shard alone (fl_model_param_piece). */
static fl_status shard_model(void *ud, void *mp) {
    fl_dp *dp = ud;
    fl_model *m = mp;
    fl_fsdp_free(dp); /* a model created again (a failed load retried) */
    struct fl_fsdp *f = calloc(1, sizeof *f);
    if (!f) return fl_errorf(FL_ERR_OOM, "FSDP bookkeeping: out of host memory");
    dp->fsdp = f;
    dp->stage = 3;
    f->dp = dp;
    f->hsc = dp->node ? dp->node : dp->comm;
    f->sc = dp->dev ? (dp->dnode ? dp->dnode : dp->dev) : f->hsc;
    f->rc = dp->dev ? dp->drep : dp->rep;
    if (!dp->comm) { /* parameter offload at one rank: no collective moves a unit; the checkpoint streams' host
                      * shard group is a single communicator (its all-gather a copy of host memory) */
        fl_status c = fl_comm_init_single(&f->own);
        if (c != FL_OK) {
            fl_fsdp_free(dp);
            return c;
        }
        f->hsc = f->own;
        f->sc = NULL;
    }
    f->tbe = dp->ptier.be;
    f->tpool = dp->ptier.pool;
    /* a device communicator (NCCL) takes device buffers only; the plan's null one takes anything, and stages
     * as the backend it stands in for would: a GPU's (host memory 0), not a CPU's */
    f->staged = f->tbe && f->sc && dp->dev && (!fl_backend_discards(m->be) || !fl_backend_host_memory(m->be));
    f->m = m;
    f->G = m->layout.n_groups;
    size_t G = (size_t)f->G + 1;
    f->n = calloc(G, sizeof *f->n), f->coff = calloc(G, sizeof *f->coff), f->clen = calloc(G, sizeof *f->clen);
    f->foff = calloc(G, sizeof *f->foff);
    f->loc = calloc(G, sizeof *f->loc), f->views = calloc(G, sizeof *f->views);
    f->pbuf = calloc(G, sizeof *f->pbuf), f->cbuf = calloc(G, sizeof *f->cbuf), f->req = calloc(G, sizeof *f->req);
    f->fresh = calloc(G, sizeof *f->fresh), f->sbuf = calloc(G, sizeof *f->sbuf);
    f->job = calloc(G, sizeof *f->job), f->hslot = calloc(G, sizeof *f->hslot);
    f->ujob = calloc(G, sizeof *f->ujob), f->uarg = calloc(G, sizeof *f->uarg);
    if (!f->n || !f->coff || !f->clen || !f->foff || !f->loc || !f->views || !f->pbuf || !f->cbuf || !f->req ||
        !f->fresh || !f->sbuf || !f->job || !f->hslot || !f->ujob || !f->uarg) {
        fl_fsdp_free(dp);
        return fl_errorf(FL_ERR_OOM, "FSDP bookkeeping: out of host memory");
    }
    f->es = fl_dtype_size(fl_model_store_dtype(m));
    f->ces = 0; /* set by fl_fsdp_init once the precision policy is known */
    f->word = fl_model_store_dtype(m) == FL_F32 ? FL_F32 : FL_BF16;
    for (int g = 0; g < f->G; g++) {
        f->n[g] = m->layout.group_offset[g + 1] - m->layout.group_offset[g];
        fl_comm_chunk(f->n[g], fl_comm_size(f->hsc), fl_comm_rank(f->hsc), &f->coff[g], &f->clen[g]);
        f->foff[g] = m->layout.group_offset[g] + f->coff[g];
        f->loc[g + 1] = f->loc[g] + f->clen[g];
        f->fresh[g] = 1;
    }
    void *shard = NULL;
    /* parameter offload: in the host tier or the NVMe files (a disk's fresh pages read as zeros) */
    fl_status s = f->tbe ? fl_backend_calloc(f->tbe, f->tpool, FL_TAG_PARAMS, f->loc[f->G] * f->es, &shard)
                         : fl_mem_alloc(m->pool, FL_TAG_PARAMS, f->loc[f->G] * f->es, &shard);
    if (s != FL_OK) {
        const size_t n = f->loc[f->G];
        fl_fsdp_free(dp);
        s = fl_fsdp_tier_fault(dp, s, "parameter", n * fl_dtype_size(fl_model_store_dtype(m)));
        return fl_error_prefix(s, "FSDP: allocating this rank's parameter shard (%zu elements%s)", n,
                               !dp->ptier.pool ? "" : dp->ptier.disk ? ", parameter offload: NVMe files" : ", parameter offload: host tier");
    }
    f->pp = (fl_param_provider){f,         f->loc[f->G],  f->views, pp_gather, pp_release, pp_grads_begin,
                                pp_grads_ready, pp_zero_grads, f->foff, f->loc, f->clen};
    if (f->tbe) fl_model_store_offload(m, shard, &f->pp, f->tbe, f->tpool);
    else fl_model_store_shard(m, shard, &f->pp);
    return FL_OK;
}

fl_status fl_fsdp_tier_fault(const fl_dp *dp, fl_status s, const char *what, size_t bytes) {
    const fl_mem_pool *p = dp->ptier.pool;
    if (s == FL_OK || !dp->ptier.disk || !p || !p->raw_why || !p->raw_why(p->raw_ud)[0]) return s;
    char why[512];
    snprintf(why, sizeof why, "%s", p->raw_why(p->raw_ud));
    return fl_errorf(FL_ERR_IO, "parameter offload (NVMe): %zu bytes of this rank's %s shard in files under nvme_path: "
                     "%s; free space there or give another --nvme_path", bytes, what, why);
}

fl_status fl_fsdp_prepare(fl_dp *dp, const fl_run_config *cfg, const fl_precision *prec, fl_model_storage *stg) {
    int stage = 0;
    FL_TRY(fl_cfg_zero_stage(cfg->strategy, cfg->sharding_strategy, &stage));
    /* one process: unsharded, except under parameter offload (the whole model is the rank's shard, in the tier) */
    if ((!dp->comm && !dp->ptier.pool) || stage != 3 || cfg->command == FL_CMD_FINETUNE_LORA) return FL_OK;
    const char *why = fl_fsdp_refusal(cfg, prec);
    if (why) return fl_errorf(FL_ERR_UNSUPPORTED, "%s", why);
    if (stg->quant4) return fl_errorf(FL_ERR_UNSUPPORTED, "FULL_SHARD of a 4-bit model: QLoRA trains adapters only");
    if (dp->comm && fl_cfg_hybrid_shard(cfg->strategy, cfg->sharding_strategy) && cfg->num_nodes > 1 && !dp->node) {
        /* HYBRID_SHARD: the nodes and the replica groups (collective; every rank agrees first, so a rank
         * that failed earlier in set-up is not left alone in the split) */
        /* a model-parallel grid (pipeline stages x tensor-parallel ranks, M of them per data-parallel rank, placed
         * consecutively: trainer_tp.c / trainer_pp.c): its axis holds one rank of each group, a node holds whole
         * groups, so the axis' ranks per node are devices / M */
        const int M = dp->grid && fl_comm_size(dp->grid) > dp->world ? fl_comm_size(dp->grid) / dp->world : 1;
        if (cfg->devices % M)
            return fl_errorf(FL_ERR_INVALID, "HYBRID_SHARD on the data-parallel axis of a grid of %d model-parallel ranks "
                             "(--pipeline_parallel x --tensor_parallel): --devices %d per node does not hold whole groups "
                             "(give a multiple of %d)", M, cfg->devices, M);
        const int per = cfg->devices / M;
        if (per * cfg->num_nodes != dp->world)
            return fl_errorf(FL_ERR_INVALID, "HYBRID_SHARD: devices x num_nodes = %d x %d, but the run has %d ranks",
                             cfg->devices, cfg->num_nodes, dp->world * M);
        FL_TRY(fl_dp_agree(dp, FL_OK));
        fl_status s = fl_comm_split(dp->comm, dp->rank / per, dp->rank, &dp->node);
        if (s == FL_OK) s = fl_comm_split(dp->comm, dp->rank % per, dp->rank, &dp->rep);
        if (s != FL_OK) {
            fl_comm_destroy(dp->rep), fl_comm_destroy(dp->node);
            dp->rep = dp->node = NULL;
            return fl_error_prefix(s, "HYBRID_SHARD: splitting the %d ranks into %d nodes of %d", dp->world,
                                   cfg->num_nodes, per);
        }
        fl_comm_set_pool(dp->node, dp->comm->pool); /* their MPI scratch in the run's pool, as the world's */
        fl_comm_set_pool(dp->rep, dp->comm->pool);
        /* the same groups of the device communicator (NCCL: its host part split, a communicator bootstrapped
         * over each), for the gathers and reductions of device buffers */
        if (s == FL_OK && dp->dev) s = fl_comm_split(dp->dev, dp->rank / per, dp->rank, &dp->dnode);
        if (s == FL_OK && dp->dev) s = fl_comm_split(dp->dev, dp->rank % per, dp->rank, &dp->drep);
        if (s != FL_OK) {
            fl_comm_destroy(dp->drep), fl_comm_destroy(dp->dnode);
            dp->drep = dp->dnode = NULL;
            return fl_error_prefix(s, "HYBRID_SHARD: splitting the device communicator into %d nodes of %d",
                                   cfg->num_nodes, per);
        }
    }
    stg->shard = shard_model;
    stg->shard_ud = dp;
    return FL_OK;
}

fl_status fl_fsdp_init(fl_dp *dp, const fl_run_config *cfg, fl_model *m) {
    int stage = 0;
    FL_TRY(fl_cfg_zero_stage(cfg->strategy, cfg->sharding_strategy, &stage));
    if ((!dp->comm && !dp->ptier.pool) || stage != 3 || m->lora) return FL_OK;
    struct fl_fsdp *f = dp->fsdp;
    if (!f || fl_model_provider(m) != &f->pp)
        return fl_errorf(FL_ERR_INTERNAL, "FSDP: the model was not created sharded (fl_fsdp_prepare's storage)");
    f->ces = m->prec.compute_copy ? fl_dtype_size(m->prec.compute_dtype) : 0; /* mixed: per gathered unit */
    f->no_bwd_prefetch = fl_cfg_backward_prefetch(cfg) == 0;
    /* --offload_overlap: only where something is fetched ahead (prefetch 0 waits for each unit when it is needed) */
    f->direct = fl_backend_host_memory(m->be);
    f->afetch = f->tbe && dp->ptier.overlap && dp->ptier.prefetch > 0;
    if (f->afetch && !f->fw) FL_TRY(fl_fetch_start(&f->fw));
    return FL_OK;
}

fl_status fl_fsdp_update_arm(fl_dp *dp, fl_optimizer *o, float lr, float max_norm) {
    struct fl_fsdp *f = dp->fsdp;
    if (!f) return FL_OK;
    f->uarmed = 0;
    /* the update runs on the host in place (not staged through the host tier), elementwise (AdamW, SGD), on the
     * CPU backend's kernels (which run on any thread; the plan's null backend computes nothing), and needs no
     * total over every shard's gradient first (clipping's norm, fp16's overflow verdict) */
    const fl_backend *hb = o->home.be;
    const int cpu = hb && (!strcmp(hb->name, "cpu") || fl_backend_discards(hb));
    if (!dp->update_overlap || !dp->offload || fl_model_provider(f->m) != &f->pp || o->model != f->m || o->home.hp ||
        !cpu || o->amp.on || max_norm > 0 || (o->cfg.kind != FL_OPT_ADAMW && o->cfg.kind != FL_OPT_SGD) ||
        o->shard.off != 0 || o->shard.len != f->loc[f->G])
        return FL_OK;
    if (!f->fw) FL_TRY(fl_fetch_start(&f->fw)); /* the updates alone (no fetch ahead): a worker all the same */
    f->uo = o;
    f->ulr = lr;
    f->ustep = o->step + 1; /* fl_optim_step counts it when the step ends */
    f->uposted = 0;
    memset(f->uarg, 0, (size_t)f->G * sizeof *f->uarg);
    f->uhold = -1;
    f->uarmed = 1;
    return FL_OK;
}

int fl_fsdp_update_armed(const fl_dp *dp) { return dp->fsdp && dp->fsdp->uarmed; }

fl_status fl_fsdp_update_hold(fl_dp *dp, int g) {
    struct fl_fsdp *f = dp->fsdp;
    if (!f || !f->uarmed) return FL_OK;
    if (g < 0 || g >= f->G) return fl_errorf(FL_ERR_INTERNAL, "FSDP: no unit %d to hold (%d units)", g, f->G);
    f->uhold = g;
    return FL_OK;
}

static pthread_mutex_t g_early_mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned long g_early, g_queued; /* the units' updates done before their step's wait, and queued (all ranks) */

void fl_fsdp_update_mark(fl_dp *dp) {
    struct fl_fsdp *f = dp->fsdp;
    for (int g = 0; f && f->uarmed && g < f->G; g++)
        if (f->uarg[g].f && g != f->uhold) f->n_sched += fl_fetch_done(f->fw, &f->ujob[g]);
}

void fl_fsdp_update_counts(const fl_dp *dp, unsigned long *early, unsigned long *queued, unsigned long *sched) {
    if (dp) {
        *early += dp->fsdp ? dp->fsdp->n_early : 0;
        *queued += dp->fsdp ? dp->fsdp->n_queued : 0;
        *sched += dp->fsdp ? dp->fsdp->n_sched : 0;
        return;
    }
    pthread_mutex_lock(&g_early_mu);
    if (early) *early = g_early;
    if (queued) *queued = g_queued;
    pthread_mutex_unlock(&g_early_mu);
}

fl_status fl_fsdp_update_wait(fl_dp *dp, fl_optimizer *o) {
    struct fl_fsdp *f = dp->fsdp;
    if (!f || !f->uarmed) return FL_OK;
    f->uarmed = 0;
    fl_status s = FL_OK;
    unsigned long early = 0, queued = 0; /* the overlap's evidence: updates already done when the wait began */
    for (int g = 0; g < f->G; g++)
        if (f->uarg[g].f && g != f->uhold) queued++, early += fl_fetch_done(f->fw, &f->ujob[g]);
    pthread_mutex_lock(&g_early_mu);
    g_early += early, g_queued += queued;
    pthread_mutex_unlock(&g_early_mu);
    f->n_early += early, f->n_queued += queued;
    for (int g = 0; g < f->G; g++) { /* every queued job waited for, failed or not */
        if (!f->uarg[g].f || g == f->uhold) continue;
        fl_fetch_wait(f->fw, &f->ujob[g]);
        if (s == FL_OK && f->ujob[g].st != FL_OK) s = fl_errorf(f->ujob[g].st, "%s", f->ujob[g].msg);
    }
    /* the held unit (its gradient final only now: the pipeline's tied sum) on this thread, after the queued ones */
    if (s == FL_OK && f->uhold >= 0 && f->uarg[f->uhold].f) s = unit_update(&f->uarg[f->uhold]);
    if (s == FL_OK && f->uposted != f->G)
        s = fl_errorf(FL_ERR_INTERNAL, "FSDP: %d of %d units' updates were queued in the step's last backward",
                      f->uposted, f->G);
    if (s == FL_OK) o->home.updated = 1;
    return s;
}

int fl_fsdp_ranges(const fl_dp *dp, size_t *flat_off, size_t *shard_off, size_t *len) {
    const struct fl_fsdp *f = dp->fsdp;
    if (!f) return 0;
    for (int g = 0; g < f->G; g++) {
        if (flat_off) flat_off[g] = f->foff[g];
        if (shard_off) shard_off[g] = f->loc[g];
        if (len) len[g] = f->clen[g];
    }
    return f->G;
}

/* ---- whole copies (the step hook, checkpoints) ----------------------------------------------- */

/* full[go[g] ..] (every unit, layout order) = the units gathered from the ranks' shards `shard`
 * (elements of es bytes); one unit's buffer at a time (host memory, outside the pool: checkpoint
 * I/O staging). full may be NULL on ranks that only send (root >= 0 and rank != root). node0: only
 * node 0 gathers (HYBRID_SHARD's checkpoints: rank 0 writes; the other nodes hold the same bytes). */
/* Unit g of the array whose shard (the backend's memory) is `shard` into host memory dst (n[g]
 * elements): this rank's piece copied to the host (stage: clen[g] elements), then all-gathered over
 * the host shard group. Every rank of the group calls it; a failed copy still takes part. */
static fl_status gather_unit_host(fl_dp *dp, const void *shard, size_t es, int g, void *dst, void *stage) {
    struct fl_fsdp *f = dp->fsdp;
    const char *piece = (const char *)shard + f->loc[g] * es;
    /* parameter offload: the shard is host memory of the tier's backend (NVMe: its pages dropped once copied) */
    fl_status c = f->tbe ? FL_RUN(f->tbe, to_host, stage, piece, f->clen[g] * es) : fl_dp_to_host(dp, stage, piece, f->clen[g] * es);
    if (c == FL_OK && f->tbe && dp->ptier.disk)
        c = fl_mem_disk_advise(f->tpool, piece, f->clen[g] * es, FL_DISK_RELEASE);
    fl_status s = fl_comm_all_gather(f->hsc, stage, dst, f->n[g], es == 4 ? FL_F32 : FL_BF16); /* HYBRID: in the node */
    return c != FL_OK ? c : s;
}

static size_t max_unit(const struct fl_fsdp *f, const size_t *n) {
    size_t cap = 0;
    for (int g = 0; g < f->G; g++) cap = n[g] > cap ? n[g] : cap;
    return cap;
}

static fl_status gather_whole(fl_dp *dp, const void *shard, size_t es, void *full, int node0) {
    struct fl_fsdp *f = dp->fsdp;
    const size_t cap = max_unit(f, f->n);
    const int skip = node0 && f->rc && fl_comm_rank(f->rc) != 0;
    char *tmp = full || skip ? NULL : malloc(cap * es + 4);
    char *stage = skip ? NULL : malloc(max_unit(f, f->clen) * es + 4); /* this rank's piece in host memory */
    fl_status s = fl_dp_agree(dp, (full || tmp || skip) && (stage || skip) ? FL_OK
                                                                           : fl_errorf(FL_ERR_OOM, "FSDP: out of host memory"));
    for (int g = 0; s == FL_OK && !skip && g < f->G; g++) {
        char *dst = full ? (char *)full + f->m->layout.group_offset[g] * es : tmp;
        s = gather_unit_host(dp, shard, es, g, dst, stage);
    }
    free(stage);
    free(tmp);
    return fl_error_prefix(s, "FSDP: gathering the whole parameters or state");
}

fl_status fl_fsdp_whole_params(fl_dp *dp, void **out, size_t *bytes) {
    struct fl_fsdp *f = dp->fsdp;
    fl_model *m = f->m;
    *bytes = m->layout.numel * f->es;
    *out = malloc(*bytes + 4);
    fl_status s = gather_whole(dp, fl_model_params_data(m), f->es, *out, 0);
    if (s != FL_OK) {
        free(*out);
        *out = NULL;
    }
    return s;
}

fl_status fl_fsdp_whole_array(fl_dp *dp, const void *shard, size_t es, void *full) {
    return gather_whole(dp, shard, es, full, 0);
}

fl_status fl_fsdp_sum(fl_dp *dp, double *v, int n) {
    if (!dp->node) return fl_dp_sum(dp, v, n);
    const int w = fl_comm_size(dp->node);
    if (w < 2 || n <= 0) return FL_OK;
    double *all = malloc((size_t)n * w * sizeof *all);
    if (!all) return fl_errorf(FL_ERR_OOM, "FSDP: out of host memory");
    /* doubles as pairs of F32 words: an all-gather copies bits; the sum in rank order, as fl_dp_sum */
    fl_status s = fl_comm_all_gather(dp->node, v, all, (size_t)n * 2 * w, FL_F32);
    for (int i = 0; s == FL_OK && i < n; i++) {
        double acc = 0;
        for (int r = 0; r < w; r++) acc += all[(size_t)r * n + i];
        v[i] = acc;
    }
    free(all);
    return fl_error_prefix(s, "HYBRID_SHARD: summing over the node");
}

fl_status fl_fsdp_check_finite(fl_dp *dp, const fl_optimizer *o, int *found) {
    const fl_backend *be = o->home.params_host ? o->home.be : o->model->be; /* parameter offload: the host's */
    FL_TRY(FL_RUN(be, check_finite, o->w.p, o->w.pt, o->w.n, 1.0f, found));
    double v = *found != 0; /* every rank decides alike */
    FL_TRY(fl_dp_sum(dp, &v, 1));
    *found = v > 0;
    return FL_OK;
}

/* ---- the consolidated checkpoint, streamed (dp.h: fl_dp_stream) -----------------------------
 * The single-process format, written by rank 0 while the bytes are gathered: each whole-model
 * array (the parameters, then each optimizer state) streams unit by unit, unit g all-gathered when
 * the writer first asks for an element of it. Host memory: one unit's buffer per rank (the
 * largest), never the whole model or state. */
typedef struct {
    void *stage;            /* the piece's host staging */
    const fl_optimizer *o;  /* an optimizer state array: read through the state's memory (offload: the host
                             * tier; NVMe: its files, released behind); NULL: the parameters (the backend's) */
} unit_src;

static fl_status fetch_unit(fl_dp_stream *u, int g) {
    const unit_src *x = u->ctx;
    if (!x->o) return gather_unit_host(u->dp, u->src, u->es, g, u->buf, x->stage);
    struct fl_fsdp *f = u->dp->fsdp;
    fl_status c = fl_optim_state_read(x->o, x->stage, (const char *)u->src + f->loc[g] * u->es, f->clen[g] * u->es);
    fl_status s = fl_comm_all_gather(f->hsc, x->stage, u->buf, f->n[g], u->es == 4 ? FL_F32 : FL_BF16);
    return c != FL_OK ? c : s;
}

static size_t state_es(const fl_optimizer *o) { return o->cfg.state_dtype == FL_BF16 ? 2 : 4; }

fl_status fl_fsdp_ckpt_save(fl_dp *dp, int write, const char *out_dir, const char *name, const fl_model *m,
                            const fl_optimizer *o, const fl_train_state *st, const fl_run_config *cfg,
                            const char *tok_dir) {
    struct fl_fsdp *f = dp->fsdp;
    const fl_param_layout *lay = &m->layout;
    const int lead = dp->rank == 0, L = lay->n, other_node = f->rc && fl_comm_rank(f->rc) != 0;
    /* the arrays, in the order the writer reads them: the parameters, then the optimizer's state */
    const size_t ses = o ? state_es(o) : 4;
    const void *arr[4] = {fl_model_params_data(m), o ? o->st.m : NULL,
                          o ? o->st.v : NULL, o ? o->st.buf : NULL};
    const size_t aes[4] = {f->es, ses, ses, ses};
    const size_t wes = f->es > ses ? f->es : ses;
    char *buf = malloc(max_unit(f, f->n) * wes + 4);
    char *stage = malloc(max_unit(f, f->clen) * wes + 4); /* this rank's piece of a unit, copied to the host */
    fl_dp_stream us[4];
    unit_src xs[2] = {{stage, NULL}, {stage, o}};
    for (int a = 0; a < 4; a++)
        us[a] = (fl_dp_stream){dp, f->G, lay->group_offset, aes[a], fetch_unit, arr[a], 0, buf, 0, FL_OK, &xs[a > 0]};
    fl_st_write_tensor *t = lead ? calloc((size_t)L + 4, sizeof *t) : NULL;
    fl_dp_stream_tensor *ut = lead ? calloc((size_t)L + 4, sizeof *ut) : NULL;
    /* 8-bit AdamW: the single-process layout streams tensor by tensor, each piece copied to the host and
     * broadcast by its rank of the shard group (HYBRID: node 0's) over the host communicator */
    fl_dp_stream u8;
    fl_dp_stream8 c8;
    memset(&u8, 0, sizeof u8);
    memset(&c8, 0, sizeof c8);
    fl_status s = !buf || !stage || (lead && (!t || !ut)) ? fl_errorf(FL_ERR_OOM, "checkpoint: out of host memory") : FL_OK;
    const int has8 = o && o->q8.state;
    if (s == FL_OK && has8)
        s = fl_dp_stream8_init(&u8, &c8, dp, f->hsc, fl_comm_size(f->hsc), fl_comm_rank(f->hsc), other_node, o, lay);
    s = fl_dp_agree(dp, s);
    if (s != FL_OK) {
        free(t), free(ut), free(buf), free(stage);
        fl_dp_stream8_free(&u8, &c8);
        return s;
    }
    if (lead && write) {
        for (int k = 0; k < L; k++) { /* model.safetensors: each entry in the storage dtype, as one process writes */
            const fl_param_info *p = &lay->params[k];
            ut[k] = (fl_dp_stream_tensor){&us[0], p->offset};
            t[k] = (fl_st_write_tensor){.name = p->name, .dtype = fl_model_store_dtype(m), .src_dtype = fl_model_store_dtype(m),
                                        .fill_range = fl_dp_stream_fill, .fill_ud = &ut[k]};
            fl_hf_tensor_shape(p, &t[k]);
        }
        /* training_state.safetensors: the optimizer's state, whole-model arrays */
        const int ns = o ? fl_dp_stream_state_tensors(o, lay->numel, us + 1, has8 ? &u8 : NULL, ut + L, t + L) : 0;
        s = fl_ckpt_save_streamed(out_dir, name, m, o, st, cfg, tok_dir, t, t + L, ns);
    }
    /* every rank of node 0 (HYBRID: the other nodes hold the same shards and take no part): every unit of
     * every array, in order (rank 0: those its writer did not ask for) */
    fl_status g = FL_OK;
    for (int a = 0; g == FL_OK && !other_node && a < 4; a++)
        if (arr[a]) g = fl_dp_stream_drain(&us[a]);
    if (g == FL_OK && has8) g = fl_dp_stream_drain(&u8);
    if (s == FL_OK) s = g;
    free(t);
    free(ut);
    free(buf);
    free(stage);
    fl_dp_stream8_free(&u8, &c8);
    return fl_dp_agree(dp, s);
}

fl_status fl_fsdp_ckpt_load(fl_dp *dp, const char *dir, fl_model *m, fl_optimizer *o, fl_train_state *st) {
    (void)dp;
    /* the model is sharded (fl_model_provider): fl_ckpt_load reads this rank's pieces of the weights
     * (fl_hf_load_weights through fl_model_param_piece) and of the optimizer state straight from the
     * checkpoint's files, no whole staging */
    return fl_ckpt_load(dir, m, o, st);
}

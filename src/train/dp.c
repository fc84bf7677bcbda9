/* The data-parallel context of a training run: see dp.h. */
#include "dp.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/text.h"

/* fl_grad_sync over a fl_dp (fitllm/train.h): the buckets and FSDP's unit-by-unit update armed for the last
 * micro-batch, then the reduction and what it leaves live. */
static fl_status sync_arm(void *self, fl_optimizer *o, int last, float lr, float max_norm) {
    fl_dp *dp = self;
    fl_dp_buckets_arm(dp, o, last); /* the last backward reduces block by block */
    return o && last ? fl_fsdp_update_arm(dp, o, lr, max_norm) : FL_OK;
}

static fl_status sync_reduce(void *self, fl_optimizer *o, size_t *live, int *snap) {
    fl_dp *dp = self;
    FL_TRY(fl_dp_reduce_grads(dp, o));
    *snap = dp->comm != NULL;
    *live = *snap ? fl_dp_reduced_live(dp, o) : SIZE_MAX;
    return FL_OK;
}

void fl_dp_init(fl_dp *dp, fl_comm *comm, fl_mem_pool *pool) {
    dp->comm = comm && fl_comm_size(comm) > 1 ? comm : NULL;
    dp->rank = dp->comm ? fl_comm_rank(comm) : 0;
    dp->world = dp->comm ? fl_comm_size(comm) : 1;
    dp->sync = (fl_grad_sync){.self = dp, .world = dp->world, .rank = dp->rank, .arm = sync_arm, .reduce = sync_reduce};
    /* the MPI reduce-scatter's receive scratch ((N-1) x chunk) comes from the run's pool under
     * WORKSPACE, so the memory report and the budget see it */
    if (dp->comm) fl_comm_set_pool(dp->comm, pool);
}

void fl_dp_done(fl_dp *dp) {
    if (dp->comm) fl_comm_set_pool(dp->comm, NULL);
    fl_fsdp_free(dp); /* its gathers in flight use dp->node (dp->dnode) */
    fl_comm_destroy(dp->drep); /* before dev: split from it */
    fl_comm_destroy(dp->dnode);
    dp->drep = dp->dnode = NULL;
    fl_comm_destroy(dp->rep);
    fl_comm_destroy(dp->node);
    dp->rep = dp->node = NULL;
    fl_comm_destroy(dp->dev);
    dp->dev = NULL;
}

fl_status fl_dp_device_comm(fl_dp *dp, const fl_backend *be) {
    if (!dp->comm || dp->dev || !be->comm_create) return FL_OK;
    FL_TRY(fl_error_prefix(be->comm_create(be, dp->comm, &dp->dev), "data parallel: the %s backend's communicator",
                           be->name));
    /* the host communicator now carries host memory only: its scratch is not the device pool's */
    if (dp->dev) fl_comm_set_pool(dp->comm, NULL);
    return FL_OK;
}

fl_status fl_dp_to_host(const fl_dp *dp, void *dst, const void *src, size_t bytes) {
    if (!bytes) return FL_OK;
    if (dp->be) return FL_RUN(dp->be, to_host, dst, src, bytes);
    memcpy(dst, src, bytes);
    return FL_OK;
}

unsigned long long fl_dp_sent(const fl_dp *dp) {
    const fl_comm *cs[3] = {dp->comm, dp->node, dp->rep};
    unsigned long long sent = 0;
    for (int i = 0; i < 3; i++) {
        fl_comm_traffic t;
        fl_comm_get_traffic(cs[i], &t); /* zeros for NULL */
        sent += t.sent;
    }
    return sent;
}

/* Doubles travel as pairs of F32 words: all-gather copies bits, it never adds. */
fl_status fl_dp_gather(fl_dp *dp, const double *v, int n, double *all) {
    if (!dp->comm) {
        memcpy(all, v, (size_t)n * sizeof *v);
        return FL_OK;
    }
    size_t words = (size_t)n * 2; /* per rank; the chunk layout gives every rank exactly `words` */
    return fl_comm_all_gather(dp->comm, v, all, words * (size_t)dp->world, FL_F32);
}

fl_status fl_dp_sum(fl_dp *dp, double *v, int n) {
    if (!dp->comm || n <= 0) return FL_OK;
    double stack[64], *all = (size_t)n * dp->world <= 64 ? stack : malloc((size_t)n * dp->world * sizeof *all);
    if (!all) return fl_errorf(FL_ERR_OOM, "data parallel: out of host memory");
    fl_status s = fl_dp_gather(dp, v, n, all);
    if (s == FL_OK)
        for (int i = 0; i < n; i++) {
            double acc = 0;
            for (int r = 0; r < dp->world; r++) acc += all[(size_t)r * n + i]; /* rank order */
            v[i] = acc;
        }
    if (all != stack) free(all);
    return s;
}

fl_status fl_dp_max(fl_dp *dp, float *v, size_t n) {
    if (!dp->comm || n == 0) return FL_OK;
    float *all = malloc(n * (size_t)dp->world * sizeof *all);
    if (!all) return fl_errorf(FL_ERR_OOM, "data parallel: out of host memory");
    fl_status s = fl_comm_all_gather(dp->comm, v, all, n * (size_t)dp->world, FL_F32); /* n words per rank */
    for (size_t i = 0; s == FL_OK && i < n; i++) {
        float m = all[i];
        for (int r = 1; r < dp->world; r++) m = fmaxf(m, all[(size_t)r * n + i]);
        v[i] = m;
    }
    free(all);
    return s;
}

fl_status fl_dp_check(const fl_dp *dp, const fl_optimizer *o) {
    /* F16 (16-true) is reduced like BF16: in fp32, rounded once; a sum beyond fp16's range comes out
     * inf, which the loss scaler's check (after the reduction, on the reduced gradients) sees */
    if (dp->comm && o->w.gt != FL_F32 && o->w.gt != FL_BF16 && o->w.gt != FL_F16)
        return fl_errorf(FL_ERR_UNSUPPORTED, "data parallel: %s gradients cannot be reduced (F32, BF16 and F16 only)",
                         fl_dtype_name(o->w.gt));
    /* ZeRO-1/2 and FULL_SHARD reach device memory through the device communicator (gathers, reductions)
     * and the backend's copies (the 8-bit halo, checkpoint streams): no stage is refused here */
    return FL_OK;
}

/* ZeRO-2 with 8-bit AdamW: a rank's pieces reach up to FL_OPTIM_8BIT_HALO elements into each
 * neighbour's chunk (whole blocks), so after the reduce-scatter every rank sends its chunk's first
 * and last H reduced gradients to all (one all-gather of 2H per rank, WORKSPACE while it runs) and
 * takes its neighbours' into place. Every chunk holds >= H elements (fl_dp_optim_init). The
 * gradients are the backend's memory: moved by its copies and the device communicator. */
static fl_status halo_8bit(fl_dp *dp, fl_optimizer *o) {
    const fl_backend *be = o->model->be;
    const size_t H = FL_OPTIM_8BIT_HALO, es = fl_dtype_size(o->w.gt), per = 2 * H;
    char *g = o->w.g, *buf;
    FL_TRY(fl_mem_alloc(o->model->pool, FL_TAG_WORKSPACE, ((size_t)dp->world + 1) * per * es, (void **)&buf));
    char *mine = buf + (size_t)dp->world * per * es;
    fl_status s = FL_RUN(be, copy, mine, g + o->shard.off * es, H * es);
    if (s == FL_OK) s = FL_RUN(be, copy, mine + H * es, g + (o->shard.off + o->shard.len - H) * es, H * es);
    if (s == FL_OK)
        s = fl_comm_all_gather(fl_dp_dcomm(dp), mine, buf, (size_t)dp->world * per, es == 4 ? FL_F32 : FL_BF16);
    if (s == FL_OK && dp->rank > 0) /* the tail of rank - 1's chunk ends where ours starts */
        s = FL_RUN(be, copy, g + (o->shard.off - H) * es, buf + ((size_t)(dp->rank - 1) * per + H) * es, H * es);
    if (s == FL_OK && dp->rank < dp->world - 1) /* the head of rank + 1's */
        s = FL_RUN(be, copy, g + (o->shard.off + o->shard.len) * es, buf + (size_t)(dp->rank + 1) * per * es, H * es);
    fl_mem_free(o->model->pool, buf);
    return fl_error_prefix(s, "ZeRO-2: the 8-bit optimizer's neighbouring gradients");
}

size_t fl_dp_zero2_halo(int world, int rank, const fl_optim_config *c) {
    if (c->kind != FL_OPT_ADAMW8BIT || world < 2) return 0;
    return (size_t)FL_OPTIM_8BIT_HALO * ((rank > 0) + (rank < world - 1));
}

int fl_trainer_dp_bucketed(int world, int stage, int lora) { return world > 1 && stage < 2 && !lora; }

static fl_status bucket_ready(void *ud, size_t off, size_t n) {
    fl_dp *dp = ud;
    fl_optimizer *o = dp->bk_o;
    const size_t es = fl_dtype_size(o->w.gt), S = dp->bucket / es ? dp->bucket / es : n; /* --bucket_size */
    /* a group larger than the bucket: consecutive slices (the same elementwise sums, dp_bucket.c) */
    for (size_t a = 0; a < n; a += S) {
        const size_t k = n - a < S ? n - a : S;
        /* one bucket in flight: the previous one completes (and frees its scratch) first */
        FL_TRY(fl_error_prefix(fl_comm_wait(&dp->bk_req), "data parallel: reducing a gradient bucket"));
        char *g = (char *)o->w.g + (off + a) * es;
        FL_TRY(fl_error_prefix(fl_comm_iall_reduce(fl_dp_dcomm(dp), g, g, k, o->w.gt, FL_COMM_SUM, &dp->bk_req),
                               "data parallel: posting a gradient bucket (elements %zu..%zu)", off + a, off + a + k));
        dp->bk_done += k;
    }
    return FL_OK;
}

void fl_dp_buckets_arm(fl_dp *dp, fl_optimizer *o, int last) {
    fl_model *m = o->model;
    int on = last && dp->comm && fl_trainer_dp_bucketed(dp->world, dp->stage, m->lora != NULL) && fl_dp_check(dp, o) == FL_OK;
    dp->bk_o = on ? o : NULL;
    dp->bk_done = 0;
    fl_model_set_grad_ready(m, on ? bucket_ready : NULL, on ? dp : NULL);
}

fl_status fl_dp_reduce_grads(fl_dp *dp, fl_optimizer *o) {
    FL_TRY(fl_fsdp_update_wait(dp, o)); /* FULL_SHARD offload: the units' updates run beside the backward (any world) */
    if (!dp->comm) return FL_OK;
    FL_TRY(fl_dp_check(dp, o));
    if (dp->fsdp) {
        /* FULL_SHARD: every unit was reduce-scattered into the shard as its backward ended */
    } else if (dp->bk_o) { /* bucketed: the last bucket (the embeddings) is still in flight */
        fl_model_set_grad_ready(o->model, NULL, NULL);
        dp->bk_o = NULL;
        FL_TRY(fl_error_prefix(fl_comm_wait(&dp->bk_req), "data parallel: reducing a gradient bucket"));
        if (dp->bk_done != o->w.n)
            return fl_errorf(FL_ERR_INTERNAL, "data parallel: the gradient buckets covered %zu of %zu elements",
                             dp->bk_done, o->w.n);
    } else if (dp->stage == 2) {
        /* ZeRO-2: rank r receives the sum of its chunk only, in place at its offset; element i is
         * still x_0[i] + ... + x_{N-1}[i] in rank order, the all-reduce's bits */
        size_t es = fl_dtype_size(o->w.gt);
        FL_TRY(fl_error_prefix(fl_dp_reduce_scatter(fl_dp_dcomm(dp), o->model->be, o->model->pool, o->w.g,
                                                    (char *)o->w.g + o->shard.off * es, o->w.n, o->w.gt, dp->bucket),
                               "ZeRO-2: reduce-scattering the gradients"));
        if (o->cfg.kind == FL_OPT_ADAMW8BIT) FL_TRY(halo_8bit(dp, o));
    } else { /* one all-reduce of the flat buffer (LoRA's adapters) */
        FL_TRY(fl_error_prefix(fl_comm_all_reduce(fl_dp_dcomm(dp), o->w.g, o->w.g, o->w.n, o->w.gt, FL_COMM_SUM),
                               "data parallel: reducing the gradients"));
    }
    return FL_OK;
}

size_t fl_dp_reduced_live(const fl_dp *dp, const fl_optimizer *o) {
    if (!dp->comm || dp->fsdp || dp->stage != 2) return SIZE_MAX;
    /* ZeRO-2: what this rank still needs is its chunk (and the 8-bit halo) */
    return (o->shard.len + fl_dp_zero2_halo(dp->world, dp->rank, &o->cfg)) * fl_dtype_size(o->w.gt);
}

fl_status fl_dp_broadcast_params(fl_dp *dp, fl_optimizer *o) {
    /* FULL_SHARD: each rank read or generated its pieces of the same weights (fl_fsdp_prepare); a
     * resume gave every rank its pieces of the same checkpoint */
    if (!dp->comm || dp->fsdp) return FL_OK;
    /* a copy, no arithmetic: 16-bit storage (BF16 or F16) travels as BF16 words */
    fl_dtype t = fl_dtype_size(o->w.pt) == 4 ? FL_F32 : FL_BF16;
    FL_TRY(fl_error_prefix(fl_comm_broadcast(fl_dp_dcomm(dp), o->w.p, o->w.n, t, 0), "data parallel: broadcasting the parameters"));
    if (!o->model->lora) fl_model_sync_compute_copy(o->model);
    return FL_OK;
}

#define AGREE_MSG_WORDS 255 /* the failing rank's message (1020 bytes) */

/* Two steps, so the common case moves one word per rank: every rank's status (an all-gather of N
 * words), then, only when one failed, the lowest failing rank's message (a broadcast). Gathering
 * every rank's message instead cost N x 1 KiB per rank at each agreement: at 4096 thread ranks (a
 * plan rehearsing them in one process) 16 GiB at once. */
fl_status fl_dp_agree(fl_dp *dp, fl_status mine) {
    fl_comm *c = dp->grid ? dp->grid : dp->comm;
    if (!c) return mine;
    const int world = fl_comm_size(c);
    float *all = calloc((size_t)world + 1, sizeof(float));
    if (!all) return fl_errorf(FL_ERR_OOM, "data parallel: out of host memory");
    int32_t st = (int32_t)mine;
    memcpy(all + world, &st, sizeof st); /* the send word */
    char mine_msg[AGREE_MSG_WORDS * sizeof(float)];
    snprintf(mine_msg, sizeof mine_msg, "%s", mine != FL_OK ? fl_error_message() : "");
    fl_status s = fl_comm_all_gather(c, all + world, all, (size_t)world, FL_F32);
    int bad = -1;
    int32_t v = FL_OK;
    for (int r = 0; s == FL_OK && r < world && bad < 0; r++) {
        memcpy(&v, all + r, sizeof v);
        if (v != FL_OK) bad = r;
    }
    free(all);
    if (s != FL_OK || bad < 0) return s;
    float words[AGREE_MSG_WORDS];
    memcpy(words, mine_msg, sizeof words); /* significant on the failing rank only */
    s = fl_comm_broadcast(c, words, AGREE_MSG_WORDS, FL_F32, bad);
    if (s != FL_OK) return s;
    char msg[AGREE_MSG_WORDS * sizeof(float)];
    memcpy(msg, words, sizeof msg);
    msg[sizeof msg - 1] = 0;
    return fl_errorf((fl_status)v, "rank %d of %d: %s", bad, world, msg);
}

/* Rank 0's text (its length, then the text as 2-byte words: a broadcast copies bits) into *root (malloc'd,
 * NUL-terminated); *differs: whether this rank's text is another. */
static fl_status root_text(fl_comm *c, const char *mine, size_t len, char **root, int *differs) {
    *root = NULL;
    *differs = 0;
    float lw = (float)len; /* exact below 2^24 */
    FL_TRY(fl_comm_broadcast(c, &lw, 1, FL_F32, 0));
    size_t n0 = (size_t)lw, words = (n0 + 2) / 2;
    char *r = calloc(words, 2);
    if (!r) return fl_errorf(FL_ERR_OOM, "data parallel: out of host memory");
    if (fl_comm_rank(c) == 0) memcpy(r, mine, len);
    fl_status s = fl_comm_broadcast(c, r, words, FL_BF16, 0);
    if (s != FL_OK) {
        free(r);
        return s;
    }
    *root = r;
    *differs = n0 != len || memcmp(r, mine, len);
    return FL_OK;
}

fl_status fl_dp_check_config(fl_dp *dp, const fl_run_config *cfg) {
    fl_comm *c = dp->grid ? dp->grid : dp->comm;
    if (!c) return FL_OK;
    char *mine = NULL, *root = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&mine, &len);
    if (!f) return fl_errorf(FL_ERR_OOM, "data parallel: out of host memory");
    fl_cfg_write_yaml(cfg, f);
    fclose(f);
    int differs = 0;
    fl_status s = root_text(c, mine, len, &root, &differs);
    if (s == FL_OK && differs) {
        char here[200], there[200];
        fl_text_first_diff(mine, root, here, there, sizeof here);
        s = fl_errorf(FL_ERR_INVALID, "the ranks were started with different configurations: rank %d has '%s' where "
                      "rank 0 has '%s' (every rank must run the same command line and recipe)", fl_comm_rank(c), here, there);
    }
    free(root);
    free(mine);
    return s;
}

fl_status fl_dp_check_data(fl_dp *dp, const char *mine, const char *files) {
    fl_comm *c = dp->grid ? dp->grid : dp->comm;
    if (!c) return FL_OK;
    char *root = NULL;
    int differs = 0;
    fl_status s = root_text(c, mine, strlen(mine), &root, &differs);
    if (s != FL_OK) return s; /* a collective failed: every rank's fails */
    if (differs) {
        char here[200], there[200];
        fl_text_first_diff(mine, root, here, there, sizeof here);
        s = fl_errorf(FL_ERR_INVALID, "the ranks read different data: rank %d has '%s' where rank 0 has '%s' (rank %d "
                      "read %s; every rank must read the same data files: check each rank's working directory and "
                      "copy of the data)", fl_comm_rank(c), here, there, fl_comm_rank(c), files);
    }
    free(root);
    return fl_dp_agree(dp, s); /* the lowest rank that differs, on every rank */
}

/* ZeRO-1 and ZeRO-2 (DeepSpeed's stages 1 and 2; Lightning's deepspeed_stage_1/2 and FSDP's
 * SHARD_GRAD_OP) on fl_comm: see dp.h and docs/ARCHITECTURE.md "Data-parallel training". ZeRO-3 /
 * FULL_SHARD is src/train/fsdp.c; this file routes its optimizer set-up and checkpoints there.
 *
 * What is divided. The trainable elements [0, n) of the flat buffer are split by fl_comm's chunk
 * layout (rank r owns len(r) = n/N + (r < n%N) elements at off(r)); rank r keeps optimizer state
 * (AdamW m and v, SGD momentum) for its chunk only and updates only those parameters, then one
 * all-gather gives every rank the whole updated buffer:
 *   stage 1: gradients all-reduced (every rank holds the whole sum, as DDP), state divided by N;
 *   stage 2: gradients reduce-scattered (each rank receives the sum of its chunk only, the rest of
 *            its gradient buffer is dead after the reduction), state divided by N. fitllm's backward
 *            accumulates every micro-batch into the whole flat gradient buffer, so that buffer stays
 *            reserved in full (GRADS); what shrinks to the chunk is the reduced gradient a rank keeps
 *            (GRADS live after the reduction) and the traffic (reduce-scatter + all-gather of the
 *            parameters = 2 psi, as DDP's all-reduce; stage 1 moves 3 psi).
 * Parameters (and fp32 master weights of the mixed policies, which are the model's own parameters
 * here: norms, embeddings and checkpoints read them) are not divided: that is ZeRO-3 / FULL_SHARD.
 *
 * Same bits as DDP. The reduced gradient of element i is the same rank-order sum under every stage
 * (reduce-scatter is the first half of fl_comm's all-reduce); the clipping norm is the rank-order
 * sum of the chunks' squared norms at every stage (optim.c); the updates are elementwise with
 * rounding as written (-ffp-contract=off), so a chunk updates with the arithmetic of the whole
 * buffer; the all-gather copies bits. DDP, ZeRO-1 and ZeRO-2 at one world size therefore give the
 * same parameters bit for bit (tests/test_zero.c checks it). */
#include <stdlib.h>
#include <string.h>

#include "dp.h"
#include "shard_ckpt.h"
#include "fitllm/checkpoint.h"

const char *fl_dp_stage_name(const fl_dp *dp) {
    return dp->stage == 1 ? "ZeRO-1" : dp->stage == 2 ? "ZeRO-2" : dp->stage == 3 ? (dp->node ? "FSDP HYBRID_SHARD" : "ZeRO-3 (FSDP FULL_SHARD)") : "DDP";
}

/* stage 3: over the shard group (HYBRID_SHARD: each node holds every shard once) */
static fl_status dist_sum(void *ud, double *v, int n) { return ((fl_dp *)ud)->fsdp ? fl_fsdp_sum(ud, v, n) : fl_dp_sum(ud, v, n); }
static fl_status dist_max(void *ud, float *v, size_t n) { return fl_dp_max(ud, v, n); }

/* 16-bit storage travels as BF16 words: an all-gather copies, it never adds */
static fl_dtype word_type(fl_dtype t) { return fl_dtype_size(t) == 4 ? FL_F32 : FL_BF16; }

static fl_status dist_gather(void *ud, fl_optimizer *o) {
    fl_dp *dp = ud;
    if (!dp->comm || dp->stage == 3) return FL_OK; /* FULL_SHARD: the parameters stay sharded */
    size_t es = fl_dtype_size(o->w.pt);
    return fl_error_prefix(fl_comm_all_gather(fl_dp_dcomm(dp), (char *)o->w.p + o->shard.off * es, o->w.p, o->w.n, word_type(o->w.pt)),
                           "%s: gathering the updated parameters", fl_dp_stage_name(dp));
}

/* The squared gradient norm every data-parallel stage clips with alike: the squared norms of the world's chunks
 * (fl_comm_chunk: the reduce-scatter's layout, ZeRO's ranges) summed in rank order in double. DDP and ZeRO-1 hold
 * every chunk and add them here; ZeRO-2 and FULL_SHARD ranks hold their own and add them with dist_sum (the same
 * order): all clip with the same bits. */
static fl_status dist_grad_sumsq(void *ud, const fl_optimizer *o, double *out) {
    const fl_dp *dp = ud;
    double acc = 0, v;
    if (dp->stage >= 2) { /* this rank's reduced chunk only */
        FL_TRY(fl_optim_grad_sumsq(o, o->shard.off, o->shard.len, &v));
        FL_TRY(dist_sum((void *)dp, &v, 1));
        *out = v;
        return FL_OK;
    }
    for (int r = 0; r < dp->world; r++) {
        size_t off, len;
        fl_comm_chunk(o->w.n, dp->world, r, &off, &len);
        FL_TRY(fl_optim_grad_sumsq(o, off, len, &v));
        acc += v;
    }
    *out = acc;
    return FL_OK;
}

fl_status fl_dp_optim_init(fl_dp *dp, const fl_run_config *cfg, fl_optimizer *o, fl_model *m) {
    int stage = 0;
    FL_TRY(fl_cfg_zero_stage(cfg->strategy, cfg->sharding_strategy, &stage));
    dp->stage = dp->comm ? stage : 0; /* one process: every stage is the plain optimizer */
    dp->bucket = cfg->bucket_size;    /* the gradient reductions' buckets (dp_bucket.c) */
    /* FULL_SHARD of LoRA: the frozen base stays whole on every rank and the adapters (the trainable
     * parameters) train as under ZeRO-2 (fl_fsdp_prepare shards full-model runs only) */
    if (dp->stage == 3 && !dp->fsdp) dp->stage = 2;
    dp->dist = (fl_optim_dist){dp->world, dp->rank, dp->stage, dp, dist_sum, dist_gather, dist_max,
                              dist_grad_sumsq, NULL, NULL};
    /* ZeRO-3: the optimizer runs on this rank's shard (fl_model_provider) as on a whole buffer (8-bit AdamW: its
     * pieces of the tensors, placed by the shard group's size and this rank's place in it: HYBRID_SHARD
     * shards within the node) */
    const int sw = dp->stage == 3 && dp->node ? fl_comm_size(dp->node) : dp->world;
    const int sr = dp->stage == 3 && dp->node ? fl_comm_rank(dp->node) : dp->rank;
    if (dp->stage >= 1) FL_TRY(fl_optim_init_offload(o, m, &cfg->optimizer, sw, sr, dp->offload));
    else FL_TRY(fl_optim_init_offload(o, m, &cfg->optimizer, 1, 0, dp->offload));
    if (dp->stage == 2 && o->cfg.kind == FL_OPT_ADAMW8BIT && o->w.n / (size_t)dp->world < FL_OPTIM_8BIT_HALO) {
        size_t n = o->w.n;
        fl_optim_free(o);
        return fl_errorf(FL_ERR_UNSUPPORTED, "ZeRO-2 with AdamW8bit needs at least %d trainable elements per rank "
                         "(a block of 256 reaches one neighbour only); %zu over %d ranks: use deepspeed_stage_1",
                         FL_OPTIM_8BIT_HALO, n, dp->world);
    }
    if (dp->comm) o->shard.dist = &dp->dist;
    return FL_OK;
}

/* ---- checkpoints: the single-process format ------------------------------------------------- */

static int sharded(const fl_dp *dp, const fl_optimizer *o) { return dp->comm && (dp->stage == 1 || dp->stage == 2) && o; }

static size_t state_es(const fl_optimizer *o) { return o->cfg.state_dtype == FL_BF16 ? 2 : 4; }

/* 8-bit AdamW: the bytes of rank r's state (its pieces, tensor by tensor: what it allocated) */
static size_t packed_bytes(const fl_optimizer *o, int world, int r) {
    size_t total = 0;
    for (int i = 0; i < o->w.n_tensors; i++) {
        size_t a, len;
        fl_optim_8bit_piece(o->w.n, o->w.t_off[i], o->w.t_n[i], world, r, &a, &len);
        total += fl_adam8bit_state_bytes_ex(len, fl_adam8bit_is_8bit(o->w.t_n[i]));
    }
    return total;
}

/* Copy rank r's packed 8-bit state to (to_full) or from the single-process layout `full`. A block
 * that two ranks keep is written twice with the same bytes. */
static fl_status unpack8(const fl_optimizer *o, int world, int r, void *packed, void *full, int to_full) {
    size_t po = 0, fo = 0;
    for (int i = 0; i < o->w.n_tensors; i++) {
        size_t a, len, tn = o->w.t_n[i];
        int e8 = fl_adam8bit_is_8bit(tn);
        fl_optim_8bit_piece(o->w.n, o->w.t_off[i], tn, world, r, &a, &len);
        fl_adam8bit_state ps, fs;
        FL_TRY(fl_adam8bit_state_bind_ex(&ps, len, e8, (char *)packed + po));
        FL_TRY(fl_adam8bit_state_bind(&fs, tn, (char *)full + fo));
        po += fl_adam8bit_state_bytes_ex(len, e8);
        fo += fl_adam8bit_state_bytes(tn);
        if (!len) continue;
#define CP(dst, src, bytes) memcpy(to_full ? (void *)(dst) : (void *)(src), to_full ? (const void *)(src) : (const void *)(dst), bytes)
        if (e8) {
            size_t b0 = a / FL_ADAM8BIT_BLOCK;
            CP(fs.q_m + a, ps.q_m, len);
            CP(fs.q_v + a, ps.q_v, len);
            CP(fs.absmax_m + b0, ps.absmax_m, ps.n_blocks * sizeof(float));
            CP(fs.absmax_v + b0, ps.absmax_v, ps.n_blocks * sizeof(float));
        } else {
            CP(fs.m + a, ps.m, len * sizeof(float));
            CP(fs.v + a, ps.v, len * sizeof(float));
        }
#undef CP
    }
    return FL_OK;
}

size_t fl_zero8_full_bytes(const fl_optimizer *o) { return packed_bytes(o, 1, 0); }

fl_status fl_zero8_take(fl_optimizer *o, const void *full) {
    if (!o->shard.dist) return fl_errorf(FL_ERR_INTERNAL, "8-bit ZeRO state: no rank");
    /* the rank's pieces are assembled in host memory (its own state's bytes, outside the pool: checkpoint
     * I/O staging), then copied to the backend's memory */
    const fl_backend *be = o->model->be;
    void *host = calloc(1, o->q8.state_bytes + 4);
    if (!host) return fl_errorf(FL_ERR_OOM, "8-bit ZeRO state: out of host memory");
    fl_status s = unpack8(o, o->shard.dist->world, o->shard.dist->rank, host, (void *)full, 0);
    if (s == FL_OK && o->q8.state_bytes) s = FL_RUN(be, to_device, o->q8.state, host, o->q8.state_bytes);
    free(host);
    return s;
}

/* ZeRO-1/2's consolidated checkpoint (AdamW, SGD, 8-bit AdamW), streamed (dp.h: fl_dp_stream): the parameters
 * are whole on every rank (rank 0 writes its own); each optimizer state is cut into pieces of at
 * most g_piece elements (1 Mi) of one rank's chunk, each broadcast by its owner when rank 0's writer
 * reaches it. Host memory: one piece per rank, never the whole state (before: rank 0 staged it). */
static size_t g_piece = (size_t)1 << 20;
void fl_dp_set_stream_piece(size_t elements) { g_piece = elements ? elements : (size_t)1 << 20; }

static fl_status fetch_piece(fl_dp_stream *u, int k) {
    size_t off, len, a = u->start[k], n = u->start[k + 1] - a;
    int r = 0; /* the owner: the rank whose chunk holds the piece */
    for (; r + 1 < u->dp->world; r++) {
        fl_comm_chunk(u->start[u->n_units], u->dp->world, r, &off, &len);
        if (a < off + len) break;
    }
    /* the owner's piece of device memory into host memory, then over the host communicator */
    const void *src = (const char *)u->src + (a - u->src_off) * u->es;
    const fl_optimizer *o = u->ctx; /* the state's owner (CPU offload: host tier; NVMe: its files, released behind) */
    fl_status c = r != u->dp->rank ? FL_OK : fl_optim_state_read(o, u->buf, src, n * u->es);
    fl_status b = fl_comm_broadcast(u->dp->comm, u->buf, n, u->es == 4 ? FL_F32 : FL_BF16, r); /* every rank takes part */
    return c != FL_OK ? c : b;
}

static fl_status zero_save_streamed(fl_dp *dp, int write, const char *out_dir, const char *name, const fl_model *m,
                                    const fl_optimizer *o, const fl_train_state *st, const fl_run_config *cfg,
                                    const char *tok_dir) {
    const int lead = dp->rank == 0;
    const size_t es = state_es(o), n = o->w.n;
    const size_t P = g_piece;
    int units = 0; /* pieces: each rank's chunk cut every P elements, in rank order (= element order) */
    for (int r = 0; r < dp->world; r++) {
        size_t off, len;
        fl_comm_chunk(n, dp->world, r, &off, &len);
        units += (int)((len + P - 1) / P);
    }
    size_t *start = malloc(((size_t)units + 1) * sizeof *start);
    char *buf = malloc(P * es + 4);
    fl_status s = start && buf ? FL_OK : fl_errorf(FL_ERR_OOM, "checkpoint: out of host memory");
    if (start) {
        int u = 0;
        for (int r = 0; r < dp->world; r++) {
            size_t off, len;
            fl_comm_chunk(n, dp->world, r, &off, &len);
            for (size_t a = 0; a < len; a += P) start[u++] = off + a;
        }
        start[units] = n;
    }
    fl_dp_stream u8; /* 8-bit AdamW: its single-process layout, tensor by tensor */
    fl_dp_stream8 c8;
    memset(&u8, 0, sizeof u8);
    memset(&c8, 0, sizeof c8);
    if (s == FL_OK && o->q8.state) s = fl_dp_stream8_init(&u8, &c8, dp, dp->comm, dp->world, dp->rank, 0, o, NULL);
    s = fl_dp_agree(dp, s);
    if (s != FL_OK) {
        free(start), free(buf);
        fl_dp_stream8_free(&u8, &c8);
        return s;
    }
    const void *arr[3] = {o->st.m, o->st.v, o->st.buf};
    fl_dp_stream us[3];
    for (int a = 0; a < 3; a++)
        us[a] = (fl_dp_stream){dp, units, start, es, fetch_piece, arr[a], o->shard.off, buf, 0, FL_OK, (void *)o};
    fl_dp_stream_tensor ut[4];
    fl_st_write_tensor t[4];
    const int nt = fl_dp_stream_state_tensors(o, n, us, o->q8.state ? &u8 : NULL, ut, t);
    if (lead && write) s = fl_ckpt_save_streamed(out_dir, name, m, o, st, cfg, tok_dir, NULL, t, nt);
    fl_status g = FL_OK; /* every rank: every piece, in order (rank 0: those its writer did not ask for) */
    for (int a = 0; g == FL_OK && a < 3; a++)
        if (arr[a]) g = fl_dp_stream_drain(&us[a]);
    if (g == FL_OK && o->q8.state) g = fl_dp_stream_drain(&u8);
    fl_dp_stream8_free(&u8, &c8);
    if (s == FL_OK) s = g;
    free(start);
    free(buf);
    return fl_dp_agree(dp, s);
}

fl_status fl_dp_ckpt_save(fl_dp *dp, int write, const char *out_dir, const char *name, const fl_model *m,
                          const fl_optimizer *o, const fl_train_state *st, const fl_run_config *cfg,
                          const char *tok_dir) {
    if (cfg && o && !strcmp(cfg->state_dict_type, "sharded")) { /* each rank its ranges: shard_ckpt.c */
        fl_shard_set set; /* FULL_SHARD: its pieces of every unit, else the chunk rule */
        FL_TRY(dp->fsdp ? fl_shard_set_from_fsdp(&set, dp, m, o) : fl_shard_set_from_optim(&set, m, o));
        fl_status s = fl_shard_ckpt_save(dp, &set, out_dir, name, m, o, st, cfg, tok_dir, !strcmp(name, "final"));
        fl_shard_set_free(&set);
        return s;
    }
    if (dp->fsdp) return fl_fsdp_ckpt_save(dp, write, out_dir, name, m, o, st, cfg, tok_dir);
    if (!sharded(dp, o)) return write ? fl_ckpt_save(out_dir, name, m, o, st, cfg, tok_dir) : FL_OK;
    return zero_save_streamed(dp, write, out_dir, name, m, o, st, cfg, tok_dir);
}

fl_status fl_dp_ckpt_load(fl_dp *dp, const char *dir, fl_model *m, fl_optimizer *o, fl_train_state *st) {
    if (fl_ckpt_is_sharded(dir)) { /* saved sharded, at any world size: each rank reads what it holds */
        fl_shard_set set; /* FULL_SHARD: each piece from the overlapping ranges */
        FL_TRY(dp->fsdp ? fl_shard_set_from_fsdp(&set, dp, m, o) : fl_shard_set_from_optim(&set, m, o));
        fl_status s = fl_shard_ckpt_load(dir, &set, &m->layout, o, st);
        fl_shard_set_free(&set);
        return s;
    }
    if (dp->fsdp) return fl_fsdp_ckpt_load(dp, dir, m, o, st);
    /* fl_ckpt_load reads this rank's part alone: AdamW / SGD its chunk of each state ([s_off, s_off + s_len)),
     * 8-bit AdamW its pieces out of the mapped single-process layout (fl_zero8_take) */
    return fl_ckpt_load(dir, m, o, st);
}

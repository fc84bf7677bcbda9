/* Sharded checkpoints (--fsdp.state_dict_type sharded; Lightning's / LitGPT's name): each rank
 * writes the element ranges it owns of every flat buffer to its own file, one shared metadata file
 * says what the checkpoint is, and ONE commit marker, written by rank 0 after every rank reported
 * success, makes it resumable. See shard_ckpt.h for the buffer abstraction.
 *
 * A checkpoint folder (step-XXXXXX/ or final/):
 *   shard-RRRRR-of-NNNNN.safetensors  rank R's owned ranges of every buffer, one 1-D tensor each
 *                                      (named as the buffer, the ranges one after another);
 *                                      metadata: format, rank, world_size, fingerprint, step, iter,
 *                                      and "range.<buffer>" = "k0 k1 count" (one range) or
 *                                      "ranges.<buffer>" = "count k0 k1 k0 k1 ..." (FULL_SHARD: its
 *                                      piece of every unit)
 *   sharded_state.safetensors          no tensors; the training state (fl_ckpt_save's metadata),
 *                                      shard_files, fingerprint, stage, the buffer list
 *   config.json, hyperparameters.yaml, tokenizer files (rank 0)
 *   COMMITTED                          rank 0, last, after every rank's file was fsynced
 *   final/ only: model.safetensors (the consolidated HF export, streamed from the shard files)
 * The parameters are in the shard files once (each rank its range; the HF export of final/ is a
 * second, consolidated copy for transformers and generate); `fitllm merge_shards` writes the same
 * export offline from any committed sharded checkpoint.
 *
 * Resume at any world size and strategy: a rank reads each held piece of each buffer from the
 * files whose owned ranges overlap it (through the files' mmaps, straight into its buffers);
 * ranges that no file covers, a missing file, a file of another step, world size or layout are
 * refused before anything is written. The ranges are fl_comm_chunk's over the trainable elements
 * (DDP, ZeRO-1/2) or over each FSDP unit (FULL_SHARD), so a buffer's owned ranges tile it at every
 * world size whichever strategy saved it. HYBRID_SHARD: the ranks of node 0 write their node's
 * shards (shard_files = ranks per node); the other nodes hold the same bytes and write nothing. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/fs.h"
#include "fitllm/comm.h"
#include "shard_ckpt.h"

#define SHARD_FORMAT "fitllm-checkpoint-shard"
#define META_FORMAT "fitllm-sharded-state"
#define TMP_SUFFIX "-shards"

/* ---- buffers ------------------------------------------------------------------------------------ */

fl_status fl_shard_set_add_pieces(fl_shard_set *s, const char *name, fl_dtype dt, size_t count, size_t base,
                                  size_t gran, const fl_shard_piece *pc, int npc) {
    if (strlen(name) >= FL_SHARD_NAME_MAX) return fl_errorf(FL_ERR_INVALID, "sharded checkpoint: buffer name too long: %s", name);
    for (int i = 0; i < npc; i++) /* ascending, disjoint, inside the buffer */
        if (gran == 0 || pc[i].k0 + pc[i].n > count || (i && pc[i].k0 < pc[i - 1].k0 + pc[i - 1].n))
            return fl_errorf(FL_ERR_INVALID, "sharded checkpoint: buffer %s: held range [%zu, %zu) outside [0, %zu) or "
                             "out of order", name, pc[i].k0, pc[i].k0 + pc[i].n, count);
    if (s->n == s->cap) {
        int cap = s->cap ? 2 * s->cap : 16;
        fl_shard_buf *b = realloc(s->b, (size_t)cap * sizeof *b);
        if (!b) return fl_errorf(FL_ERR_OOM, "sharded checkpoint: out of host memory");
        s->b = b;
        s->cap = cap;
    }
    fl_shard_buf *b = &s->b[s->n];
    memset(b, 0, sizeof *b);
    b->pc = malloc((size_t)(npc ? npc : 1) * sizeof *b->pc);
    if (!b->pc) return fl_errorf(FL_ERR_OOM, "sharded checkpoint: out of host memory");
    if (npc) memcpy(b->pc, pc, (size_t)npc * sizeof *pc);
    b->npc = npc;
    s->n++;
    snprintf(b->name, sizeof b->name, "%s", name);
    b->dtype = dt;
    b->count = count;
    b->base = base;
    b->gran = gran;
    return FL_OK;
}

fl_status fl_shard_set_add(fl_shard_set *s, const char *name, fl_dtype dt, size_t count, size_t base, size_t gran,
                           void *data, size_t h0, size_t hn) {
    fl_shard_piece pc = {h0, hn, data};
    return fl_shard_set_add_pieces(s, name, dt, count, base, gran, &pc, 1);
}

void fl_shard_set_free(fl_shard_set *s) {
    for (int i = 0; i < s->n; i++) free(s->b[i].pc);
    free(s->b);
    memset(s, 0, sizeof *s);
}

static size_t ceil_div(size_t a, size_t b) { return a / b + (a % b != 0); }

void fl_shard_owned(const fl_shard_buf *b, size_t split_n, int world, int rank, size_t *k0, size_t *k1) {
    size_t off, len;
    fl_comm_chunk(split_n, world, rank, &off, &len);
    /* k with base + k * gran in [off, off + len) */
    size_t lo = off <= b->base ? 0 : ceil_div(off - b->base, b->gran);
    size_t hi = off + len <= b->base ? 0 : ceil_div(off + len - b->base, b->gran);
    if (lo > b->count) lo = b->count;
    if (hi > b->count) hi = b->count;
    *k0 = lo;
    *k1 = hi > lo ? hi : lo;
}

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++) h = (h ^ c[i]) * 0x100000001b3ULL;
    return h;
}

uint64_t fl_shard_fingerprint(const fl_param_layout *lay, size_t n) {
    uint64_t h = 0xcbf29ce484222325ULL;
    uint64_t v = n;
    h = fnv(h, &v, sizeof v);
    for (int i = 0; i < lay->n; i++) {
        const fl_param_info *p = &lay->params[i];
        h = fnv(h, p->name, strlen(p->name) + 1);
        uint64_t w[4] = {(uint64_t)p->shape[0], (uint64_t)(p->ndim == 2 ? p->shape[1] : 0), p->offset, p->numel};
        h = fnv(h, w, sizeof w);
    }
    return h;
}

fl_status fl_shard_set_from_optim(fl_shard_set *s, const fl_model *m, const fl_optimizer *o) {
    void *params = o->w.p;
    size_t p_h0 = 0, p_hn = o->w.n;
    memset(s, 0, sizeof *s);
    if (m->lora)
        return fl_errorf(FL_ERR_UNSUPPORTED, "sharded checkpoints hold full-model training (finetune_full, pretrain); "
                         "LoRA adapters are saved whole");
    s->split_n = o->w.n;
    s->be = fl_model_params_be(m); /* the parameters' memory (parameter offload: the host tier's) */
    fl_status st = fl_shard_set_add(s, "params", o->w.pt, o->w.n, 0, 1, params, p_h0, p_hn);
    fl_dtype sd = o->cfg.state_dtype;
    if (st == FL_OK && o->st.m) {
        st = fl_shard_set_add(s, "optimizer.exp_avg", sd, o->w.n, 0, 1, o->st.m, o->shard.off, o->shard.len);
        if (st == FL_OK) s->b[s->n - 1].opt = o; /* the state's memory (CPU offload: the host tier) */
        if (st == FL_OK) st = fl_shard_set_add(s, "optimizer.exp_avg_sq", sd, o->w.n, 0, 1, o->st.v, o->shard.off, o->shard.len);
        if (st == FL_OK) s->b[s->n - 1].opt = o;
    } else if (st == FL_OK && o->st.buf) {
        st = fl_shard_set_add(s, "optimizer.momentum_buffer", sd, o->w.n, 0, 1, o->st.buf, o->shard.off, o->shard.len);
        if (st == FL_OK) s->b[s->n - 1].opt = o;
    } else if (st == FL_OK && o->q8.state) {
        /* bitsandbytes' state per tensor: codes per element, one absmax per block of 256 from the
         * tensor's start (a block belongs to the owner of its first element), fp32 m/v for tensors
         * under 4096 elements; each rank holds its piece (whole blocks around its chunk) */
        for (int i = 0; st == FL_OK && i < o->w.n_tensors; i++) {
            const fl_adam8bit_state *a = &o->q8.st[i];
            size_t tn = o->w.t_n[i], to = o->w.t_off[i], p0 = o->q8.p_a[i], pn = o->q8.p_n[i];
            char nm[FL_SHARD_NAME_MAX];
            const char *tname = i < m->layout.n ? m->layout.params[i].name : "?";
#define ADD(suffix, dt, cnt, gran, ptr, h0, hn)                                                      \
    do {                                                                                             \
        snprintf(nm, sizeof nm, "optimizer.state8.%s.%s", tname, suffix);                            \
        if (st == FL_OK) st = fl_shard_set_add(s, nm, dt, cnt, to, gran, ptr, h0, hn);               \
    } while (0)
            if (fl_adam8bit_is_8bit(tn)) {
                size_t nb = ceil_div(tn, FL_ADAM8BIT_BLOCK), b0 = p0 / FL_ADAM8BIT_BLOCK;
                ADD("q_m", FL_U8, tn, 1, a->q_m, p0, pn);
                ADD("q_v", FL_U8, tn, 1, a->q_v, p0, pn);
                ADD("absmax_m", FL_F32, nb, FL_ADAM8BIT_BLOCK, a->absmax_m, b0, a->n_blocks);
                ADD("absmax_v", FL_F32, nb, FL_ADAM8BIT_BLOCK, a->absmax_v, b0, a->n_blocks);
            } else {
                ADD("m", FL_F32, tn, 1, a->m, p0, pn);
                ADD("v", FL_F32, tn, 1, a->v, p0, pn);
            }
#undef ADD
        }
    }
    if (st != FL_OK) fl_shard_set_free(s);
    return st;
}

fl_status fl_shard_set_from_fsdp(fl_shard_set *s, const fl_dp *dp, const fl_model *m, const fl_optimizer *o) {
    memset(s, 0, sizeof *s);
    const int G = m->layout.n_groups;
    if (m->lora || (o->q8.state && !o->q8.p_s) || o->shard.off != 0 || o->shard.len != o->w.n)
        return fl_errorf(FL_ERR_INTERNAL, "sharded checkpoint under FULL_SHARD: full-model training on the shard only");
    size_t *foff = calloc((size_t)G + 1, sizeof *foff), *loc = calloc((size_t)G + 1, sizeof *loc),
           *len = calloc((size_t)G + 1, sizeof *len);
    fl_shard_piece *pc = calloc((size_t)G + 1, sizeof *pc);
    fl_status st = foff && loc && len && pc ? FL_OK : fl_errorf(FL_ERR_OOM, "sharded checkpoint: out of host memory");
    int units = st == FL_OK ? fl_fsdp_ranges(dp, foff, loc, len) : 0;
    if (st == FL_OK && units != G)
        st = fl_errorf(FL_ERR_INTERNAL, "sharded checkpoint under FULL_SHARD: %d units, the layout has %d groups", units, G);
    s->split_n = m->layout.numel; /* the whole model's elements: the pieces are whole-model offsets */
    s->own_held = 1;              /* each rank owns its pieces of every unit: they tile each buffer */
    s->be = fl_model_params_be(m); /* the parameters' memory (parameter offload: the host tier's) */
    /* every buffer is held alike: unit g's piece at loc[g] of the shard (params, m, v, momentum) */
    void *bufs[3] = {o->w.p, o->st.m ? o->st.m : o->st.buf, o->st.m ? o->st.v : NULL};
    const char *names[3] = {"params", o->st.m ? "optimizer.exp_avg" : "optimizer.momentum_buffer", "optimizer.exp_avg_sq"};
    fl_dtype dts[3] = {o->w.pt, o->cfg.state_dtype, o->cfg.state_dtype};
    for (int k = 0; st == FL_OK && k < 3; k++) {
        if (!bufs[k]) continue;
        size_t es = fl_dtype_size(dts[k]);
        int np = 0;
        for (int g = 0; g < G; g++)
            if (len[g]) pc[np++] = (fl_shard_piece){foff[g], len[g], (char *)bufs[k] + loc[g] * es};
        st = fl_shard_set_add_pieces(s, names[k], dts[k], s->split_n, 0, 1, pc, np);
        if (st == FL_OK && k > 0) s->b[s->n - 1].opt = o; /* the state's memory (CPU offload: the host tier) */
    }
    /* 8-bit AdamW: per tensor, as fl_shard_set_from_optim names them (any strategy resumes them):
     * this rank's piece [a, a + len) of the codes (fp32 m, v), the scales of the blocks it meets
     * (held), of those starting in it (owned: a cut block is written once, by its first element's
     * rank) */
    for (int i = 0; st == FL_OK && o->q8.state && i < o->w.n_tensors; i++) {
        const fl_adam8bit_state *a = &o->q8.st[i];
        const size_t tn = o->w.t_n[i], to = o->w.t_off[i], p0 = o->q8.p_a[i], pn = o->q8.p_n[i], B = FL_ADAM8BIT_BLOCK;
        char nm[FL_SHARD_NAME_MAX];
        const char *tname = m->layout.params[i].name;
#define ADD(suffix, dt, cnt, gran, ptr, h0, hn)                                                      \
    do {                                                                                             \
        snprintf(nm, sizeof nm, "optimizer.state8.%s.%s", tname, suffix);                            \
        if (st == FL_OK) st = fl_shard_set_add(s, nm, dt, cnt, to, gran, ptr, h0, hn);               \
    } while (0)
        if (fl_adam8bit_is_8bit(tn)) {
            const size_t nb = ceil_div(tn, B), b0 = p0 / B, k0 = ceil_div(p0, B), k1 = ceil_div(p0 + pn, B);
            ADD("q_m", FL_U8, tn, 1, a->q_m, p0, pn);
            ADD("q_v", FL_U8, tn, 1, a->q_v, p0, pn);
            for (int k = 0; k < 2 && st == FL_OK; k++) {
                ADD(k ? "absmax_v" : "absmax_m", FL_F32, nb, B, k ? a->absmax_v : a->absmax_m, b0, pn ? a->n_blocks : 0);
                if (st != FL_OK) break;
                fl_shard_buf *b = &s->b[s->n - 1];
                b->own_sub = 1;
                b->own_k0 = pn ? k0 : b0;
                b->own_n = pn && k1 > k0 ? k1 - k0 : 0;
            }
        } else {
            ADD("m", FL_F32, tn, 1, a->m, p0, pn);
            ADD("v", FL_F32, tn, 1, a->v, p0, pn);
        }
#undef ADD
    }
    free(foff), free(loc), free(len), free(pc);
    if (st != FL_OK) fl_shard_set_free(s);
    return st;
}

/* ---- files ------------------------------------------------------------------------------------- */

static void shard_name(char *buf, size_t n, int rank, int world) {
    snprintf(buf, n, "shard-%05d-of-%05d.safetensors", rank, world);
}

static const char *meta(const fl_st_file *f, const char *key) {
    for (int i = 0; i < f->n_meta; i++)
        if (!strcmp(f->meta_keys[i], key)) return f->meta_vals[i];
    return NULL;
}

/* The ranges of b rank `rank` of `world` owns and where they are held: own_held, its non-empty
 * pieces; else its chunk, inside one held piece. *n = 0: none. pc: room for b->npc + 1. */
static fl_status owned_pieces(const fl_shard_set *set, const fl_shard_buf *b, int world, int rank, const char *path,
                              fl_shard_piece *pc, int *n) {
    *n = 0;
    if (set->own_held && b->own_sub) {
        if (b->npc != 1 || b->own_k0 < b->pc[0].k0 || b->own_k0 + b->own_n > b->pc[0].k0 + b->pc[0].n)
            return fl_errorf(FL_ERR_INTERNAL, "%s: buffer %s: owned range outside the held one", path, b->name);
        if (b->own_n)
            pc[(*n)++] = (fl_shard_piece){b->own_k0, b->own_n,
                                          (char *)b->pc[0].data + (b->own_k0 - b->pc[0].k0) * fl_dtype_size(b->dtype)};
        return FL_OK;
    }
    if (set->own_held) {
        for (int i = 0; i < b->npc; i++)
            if (b->pc[i].n) pc[(*n)++] = b->pc[i];
        return FL_OK;
    }
    size_t k0, k1;
    fl_shard_owned(b, set->split_n, world, rank, &k0, &k1);
    if (k1 == k0) return FL_OK; /* nothing of this buffer is this rank's */
    for (int i = 0; i < b->npc; i++) {
        const fl_shard_piece *h = &b->pc[i];
        if (k0 >= h->k0 && k1 <= h->k0 + h->n) {
            pc[(*n)++] = (fl_shard_piece){k0, k1 - k0, (char *)h->data + (k0 - h->k0) * fl_dtype_size(b->dtype)};
            return FL_OK;
        }
    }
    return fl_errorf(FL_ERR_INVALID, "%s: buffer %s: rank %d owns elements [%zu, %zu) but does not hold them", path,
                     b->name, rank, k0, k1);
}

/* This rank's shard file: its owned ranges of every buffer, one tensor per buffer (the ranges one
 * after another: FULL_SHARD's pieces lie so in its shard). */
static fl_status write_shard(const char *dir, const fl_shard_set *set, int rank, int world, uint64_t fp,
                             const fl_train_state *st) {
    char path[FL_CFG_PATH + 400], name[64];
    shard_name(name, sizeof name, rank, world);
    FL_TRY(fl_fs_join(path, sizeof path, dir, name));
    int nk = 7 + set->n, maxp = 1;
    for (int i = 0; i < set->n; i++) maxp = set->b[i].npc + 1 > maxp ? set->b[i].npc + 1 : maxp;
    size_t vcap = 64 + (size_t)maxp * 44; /* "count" and two numbers per range */
    fl_st_write_tensor *t = calloc((size_t)set->n + 1, sizeof *t);
    char *v = calloc((size_t)nk, vcap);
    char (*keys)[FL_SHARD_NAME_MAX + 16] = calloc((size_t)nk, sizeof *keys);
    const char **kp = calloc((size_t)nk, sizeof *kp), **vp = calloc((size_t)nk, sizeof *vp);
    fl_shard_piece *pc = calloc((size_t)maxp, sizeof *pc);
    fl_optim_state_src *src = calloc((size_t)set->n + 1, sizeof *src);
    fl_status s = t && v && keys && kp && vp && pc && src ? FL_OK : fl_errorf(FL_ERR_OOM, "%s: out of host memory", path);
    int nt = 0, k = 0;
#define KV(key, ...) (snprintf(keys[k], sizeof keys[k], "%s", key), snprintf(v + k * vcap, vcap, __VA_ARGS__), k++)
    if (s == FL_OK) {
        KV("format", SHARD_FORMAT);
        KV("version", "%d", set->own_held ? 2 : 1); /* 2: "ranges.<buffer>" lists */
        KV("rank", "%d", rank);
        KV("world_size", "%d", world);
        KV("fingerprint", "%016" PRIx64, fp);
        KV("step", "%ld", st->step);
        KV("iter", "%ld", st->iter);
    }
    for (int i = 0; s == FL_OK && i < set->n; i++) {
        const fl_shard_buf *b = &set->b[i];
        int np = 0;
        s = owned_pieces(set, b, world, rank, path, pc, &np);
        if (s != FL_OK) break;
        size_t es = fl_dtype_size(b->dtype), total = 0;
        char rk[FL_SHARD_NAME_MAX + 16];
        snprintf(rk, sizeof rk, "%s.%s", np > 1 ? "ranges" : "range", b->name);
        if (np <= 1) {
            KV(rk, "%zu %zu %zu", np ? pc[0].k0 : 0, np ? pc[0].k0 + pc[0].n : 0, b->count);
        } else { /* "count k0 k1 k0 k1 ...", ascending */
            char *o = v + k * vcap;
            size_t used = (size_t)snprintf(o, vcap, "%zu", b->count);
            for (int j = 0; j < np && used < vcap; j++)
                used += (size_t)snprintf(o + used, vcap - used, " %zu %zu", pc[j].k0, pc[j].k0 + pc[j].n);
            snprintf(keys[k++], sizeof keys[0], "%s", rk);
        }
        for (int j = 0; j < np; j++) {
            if (j && (char *)pc[j].data != (char *)pc[j - 1].data + pc[j - 1].n * es) {
                s = fl_errorf(FL_ERR_INTERNAL, "%s: buffer %s: the owned ranges are not held one after another", path,
                              b->name);
                break;
            }
            total += pc[j].n;
        }
        if (s == FL_OK && np) {
            t[nt] = (fl_st_write_tensor){b->name, b->dtype, 1, {(int64_t)total}, pc[0].data, b->dtype, 0, NULL, NULL,
                                         set->be, NULL};
            if (b->opt) fl_optim_state_source(b->opt, &t[nt], pc[0].data, es, &src[nt]); /* the state's memory */
            nt++;
        }
    }
#undef KV
    for (int i = 0; s == FL_OK && i < k; i++) kp[i] = keys[i], vp[i] = v + i * vcap;
    if (s == FL_OK) s = fl_st_write(path, t, nt, kp, vp, k); /* fsynced, renamed into place */
    free(src);
    free(t);
    free(v);
    free(keys);
    free(kp);
    free(vp);
    free(pc);
    return s;
}

static fl_status write_meta(const char *dir, const fl_dp *dp, const fl_shard_set *set, const fl_optimizer *o,
                            const fl_train_state *st, const fl_run_config *cfg, uint64_t fp) {
    char path[FL_CFG_PATH + 400], files[16], fps[24], *buffers = NULL;
    size_t blen = 0;
    FL_TRY(fl_fs_join(path, sizeof path, dir, FL_SHARD_META_FILE));
    FILE *f = open_memstream(&buffers, &blen);
    if (!f) return fl_errorf(FL_ERR_OOM, "%s: out of host memory", path);
    for (int i = 0; i < set->n; i++)
        fprintf(f, "%s%s %s %zu", i ? ";" : "", set->b[i].name, fl_dtype_name(set->b[i].dtype), set->b[i].count);
    fclose(f);
    snprintf(files, sizeof files, "%d", dp->node ? fl_comm_size(dp->node) : dp->world); /* HYBRID: one node's */
    snprintf(fps, sizeof fps, "%016" PRIx64, fp);
    const char *xk[] = {"shard_files", "fingerprint", "stage", "buffers"};
    const char *xv[] = {files, fps, fl_dp_stage_name(dp), buffers};
    fl_status s = fl_ckpt_write_state_meta(path, META_FORMAT, o, st, cfg, set->split_n, xk, xv, 4);
    free(buffers);
    return s;
}

/* ---- reading ----------------------------------------------------------------------------------- */

typedef struct {
    char dir[FL_CFG_PATH + 8];
    fl_st_file meta;
    int meta_open;
    int world;
    fl_st_file *f; /* (world) */
    int *open;
    char (*path)[FL_CFG_PATH + 64];
    const char *undone; /* what a refusal left undone: "nothing was resumed" (a resume), "nothing was written" (merge_shards) */
} shards;

static void shards_close(shards *sh) {
    if (sh->meta_open) fl_st_close(&sh->meta);
    for (int r = 0; r < sh->world && sh->f; r++)
        if (sh->open[r]) fl_st_close(&sh->f[r]);
    free(sh->f);
    free(sh->open);
    free(sh->path);
    memset(sh, 0, sizeof *sh);
}

/* Open dir's metadata and every shard file; each must be of the same checkpoint (world size, step,
 * layout fingerprint fp) and say which rank wrote it. */
static fl_status shards_open(shards *sh, const char *dir, uint64_t fp, size_t numel, const char *undone) {
    memset(sh, 0, sizeof *sh);
    sh->undone = undone;
    snprintf(sh->dir, sizeof sh->dir, "%s", dir);
    char mp[FL_CFG_PATH + 64];
    FL_TRY(fl_fs_join(mp, sizeof mp, dir, FL_SHARD_META_FILE));
    FL_TRY(fl_st_open(&sh->meta, mp));
    sh->meta_open = 1;
    const char *fmt = meta(&sh->meta, "format"), *w = meta(&sh->meta, "shard_files"),
               *mfp = meta(&sh->meta, "fingerprint"), *n = meta(&sh->meta, "numel"), *step = meta(&sh->meta, "step");
    char want[24];
    snprintf(want, sizeof want, "%016" PRIx64, fp);
    fl_status s = FL_OK;
    if (!fmt || strcmp(fmt, META_FORMAT) || !w || !mfp || !n || !step)
        s = fl_errorf(FL_ERR_FORMAT, "%s: not the metadata of a fitllm sharded checkpoint", mp);
    else if (strtoull(n, NULL, 10) != numel)
        s = fl_errorf(FL_ERR_FORMAT, "%s: saved for %s trainable elements, this model has %zu (another model)", mp, n,
                      numel);
    else if (strcmp(mfp, want))
        s = fl_errorf(FL_ERR_FORMAT, "%s: saved for another model layout (fingerprint %s, this model's %s: tensor names, "
                      "shapes or order differ)", mp, mfp, want);
    long world = w ? strtol(w, NULL, 10) : 0;
    if (s == FL_OK && (world < 1 || world > 1 << 20)) s = fl_errorf(FL_ERR_FORMAT, "%s: shard_files '%s' out of range", mp, w);
    if (s != FL_OK) {
        shards_close(sh);
        return s;
    }
    sh->world = (int)world;
    sh->f = calloc((size_t)world, sizeof *sh->f);
    sh->open = calloc((size_t)world, sizeof *sh->open);
    sh->path = calloc((size_t)world, sizeof *sh->path);
    if (!sh->f || !sh->open || !sh->path) s = fl_errorf(FL_ERR_OOM, "%s: out of host memory", dir);
    for (int r = 0; s == FL_OK && r < sh->world; r++) {
        char name[64];
        shard_name(name, sizeof name, r, sh->world);
        s = fl_fs_join(sh->path[r], sizeof sh->path[r], dir, name);
        if (s != FL_OK) break;
        if (!fl_fs_is_file(sh->path[r])) {
            s = fl_errorf(FL_ERR_NOT_FOUND, "%s: missing: this checkpoint was saved by %d rank%s and needs every rank's "
                          "shard file (%s)", sh->path[r], sh->world, sh->world == 1 ? "" : "s", sh->undone);
            break;
        }
        s = fl_st_open(&sh->f[r], sh->path[r]);
        if (s != FL_OK) break;
        sh->open[r] = 1;
        const fl_st_file *f = &sh->f[r];
        const char *ff = meta(f, "format"), *fr = meta(f, "rank"), *fw = meta(f, "world_size"),
                   *ffp = meta(f, "fingerprint"), *fs = meta(f, "step");
        if (!ff || strcmp(ff, SHARD_FORMAT) || !fr || !fw || !ffp || !fs)
            s = fl_errorf(FL_ERR_FORMAT, "%s: not a fitllm checkpoint shard", sh->path[r]);
        else if (strtol(fr, NULL, 10) != r || strtol(fw, NULL, 10) != world)
            s = fl_errorf(FL_ERR_FORMAT, "%s: written by rank %s of %s, expected rank %d of %ld", sh->path[r], fr, fw, r, world);
        else if (strcmp(ffp, mfp))
            s = fl_errorf(FL_ERR_FORMAT, "%s: of another model layout (fingerprint %s, the checkpoint's %s)", sh->path[r],
                          ffp, mfp);
        else if (strcmp(fs, step))
            s = fl_errorf(FL_ERR_FORMAT, "%s: of step %s, the checkpoint is step %s (a file from another save)",
                          sh->path[r], fs, step);
    }
    if (s != FL_OK) shards_close(sh);
    return s;
}

/* One range of a buffer in a shard file: elements [k0, k1) at src (the file's mmap). */
typedef struct {
    size_t k0, k1;
    int r;
    const char *src;
} frange;

static int frange_cmp(const void *a, const void *b) {
    const frange *x = a, *y = b;
    return x->k0 < y->k0 ? -1 : x->k0 > y->k0 ? 1 : x->r - y->r;
}

/* Every file's ranges of buffer b ("range.<b>" = "k0 k1 count" or "ranges.<b>" = "count k0 k1 ...",
 * ascending within a file, one after another in the file's tensor <b>), checked against b's dtype
 * and count, non-empty ones only, sorted by k0. *out: malloc'd. */
static fl_status buf_ranges(const shards *sh, const fl_shard_buf *b, frange **out, int *nout) {
    *out = NULL;
    *nout = 0;
    int cap = 0, n = 0;
    frange *fr = NULL;
    fl_status s = FL_OK;
    char rk[FL_SHARD_NAME_MAX + 16], lk[FL_SHARD_NAME_MAX + 16];
    snprintf(rk, sizeof rk, "range.%s", b->name);
    snprintf(lk, sizeof lk, "ranges.%s", b->name);
    size_t es = fl_dtype_size(b->dtype);
    for (int r = 0; s == FL_OK && r < sh->world; r++) {
        const char *v1 = meta(&sh->f[r], rk), *vl = meta(&sh->f[r], lk), *v = v1 ? v1 : vl, *key = v1 ? rk : lk;
        if (!v) continue; /* holds nothing of it (a gap if someone needs it) */
        unsigned long long c, a, e;
        int used = 0, first = n;
        size_t total = 0, prev = 0;
        if (v1) { /* "k0 k1 count" */
            if (sscanf(v, "%llu %llu %llu%n", &a, &e, &c, &used) != 3 || a > e || e > c)
                s = fl_errorf(FL_ERR_FORMAT, "%s: metadata %s = '%s': not a range 'k0 k1 count'", sh->path[r], key, v);
        } else if (sscanf(v, "%llu%n", &c, &used) != 1) {
            s = fl_errorf(FL_ERR_FORMAT, "%s: metadata %s: not 'count k0 k1 ...'", sh->path[r], key);
        }
        if (s == FL_OK && c != b->count)
            s = fl_errorf(FL_ERR_FORMAT, "%s: buffer %s has %llu elements, this run's %zu (another model or optimizer "
                          "layout)", sh->path[r], b->name, c, b->count);
        const char *q = v + used;
        for (int more = 1; s == FL_OK && more;) {
            if (v1) {
                more = 0; /* the one range read above */
            } else {
                int u = 0;
                if (sscanf(q, "%llu %llu%n", &a, &e, &u) != 2) break; /* the list's end */
                q += u;
                if (a > e || e > c || a < prev)
                    s = fl_errorf(FL_ERR_FORMAT, "%s: metadata %s: range [%llu, %llu) out of order or outside [0, %llu)",
                                  sh->path[r], key, a, e, c);
            }
            if (s != FL_OK || e == a) continue;
            prev = (size_t)e;
            if (n == cap) {
                cap = cap ? 2 * cap : 16;
                frange *x = realloc(fr, (size_t)cap * sizeof *fr);
                if (!x) {
                    s = fl_errorf(FL_ERR_OOM, "%s: out of host memory", sh->dir);
                    break;
                }
                fr = x;
            }
            fr[n++] = (frange){(size_t)a, (size_t)e, r, NULL};
            total += (size_t)(e - a);
        }
        if (s != FL_OK || n == first) continue;
        const fl_st_tensor *t = fl_st_find(&sh->f[r], b->name);
        if (!t)
            s = fl_errorf(FL_ERR_FORMAT, "%s: range [%zu, %zu) of %s listed but the tensor is missing", sh->path[r],
                          fr[first].k0, fr[first].k1, b->name);
        else if (t->dtype != b->dtype)
            s = fl_errorf(FL_ERR_FORMAT, "%s: buffer %s is %s, this run's is %s (precision or optimizer.state_dtype "
                          "changed?)", sh->path[r], b->name, fl_dtype_name(t->dtype), fl_dtype_name(b->dtype));
        else if (t->end - t->begin != total * es)
            s = fl_errorf(FL_ERR_FORMAT, "%s: tensor %s holds %zu bytes, its range%s [%zu, %zu)%s need%s %zu", sh->path[r],
                          b->name, t->end - t->begin, n - first > 1 ? "s" : "", fr[first].k0, fr[first].k1,
                          n - first > 1 ? " ..." : "", n - first > 1 ? "" : "s", total * es);
        size_t off = 0; /* where each range sits in the tensor */
        for (int i = first; s == FL_OK && i < n; i++) {
            fr[i].src = (const char *)t->data + off * es;
            off += fr[i].k1 - fr[i].k0;
        }
    }
    if (s != FL_OK) {
        free(fr);
        return s;
    }
    qsort(fr, (size_t)n, sizeof *fr, frange_cmp);
    *out = fr;
    *nout = n;
    return FL_OK;
}

/* Every element of [a, e) of b in some file's range (fr: sorted), else an error naming the first
 * gap and the file that ends where it starts. */
static fl_status covered(const shards *sh, const fl_shard_buf *b, const frange *fr, int n, size_t a, size_t e) {
    size_t pos = a;
    for (int i = 0; pos < e; i++) {
        if (i < n && fr[i].k0 <= pos) {
            if (fr[i].k1 > pos) pos = fr[i].k1;
            continue;
        }
        size_t next = i < n && fr[i].k0 < e ? fr[i].k0 : e;
        int before = -1;
        for (int j = 0; j < n; j++)
            if (fr[j].k1 == pos) before = fr[j].r;
        char after[FL_CFG_PATH + 120] = "";
        if (before >= 0) {
            const char *slash = strrchr(sh->path[before], '/');
            snprintf(after, sizeof after, "; it follows %s's range", slash ? slash + 1 : sh->path[before]);
        }
        return fl_errorf(FL_ERR_FORMAT, "%s: buffer %s: elements [%zu, %zu) of %zu are in none of the %d shard "
                         "files%s (%s)", sh->dir, b->name, pos, next, b->count, sh->world, after, sh->undone);
    }
    return FL_OK;
}

fl_status fl_shard_ckpt_load(const char *dir, const fl_shard_set *set, const fl_param_layout *lay, fl_optimizer *o,
                             fl_train_state *st) {
    if (!fl_ckpt_is_committed(dir))
        return fl_errorf(FL_ERR_FORMAT, "%s: not a committed checkpoint (no COMMITTED file: a save that did not finish)", dir);
    shards sh;
    FL_TRY(shards_open(&sh, dir, fl_shard_fingerprint(lay, set->split_n), set->split_n, "nothing was resumed"));
    fl_status s = FL_OK;
    const char *opt = meta(&sh.meta, "optimizer");
    if (o && opt && strcmp(opt, fl_optim_name(o->cfg.kind)))
        s = fl_errorf(FL_ERR_INVALID, "%s/" FL_SHARD_META_FILE ": saved with optimizer %s, this run uses %s (--optimizer: "
                      "resume with the checkpoint's)", dir, opt, fl_optim_name(o->cfg.kind));
    frange **fr = calloc((size_t)set->n + 1, sizeof *fr);
    int *nfr = calloc((size_t)set->n + 1, sizeof *nfr);
    if (s == FL_OK && (!fr || !nfr)) s = fl_errorf(FL_ERR_OOM, "%s: out of host memory", dir);
    /* check everything first: nothing is written into the run's buffers unless all of it loads */
    for (int i = 0; s == FL_OK && i < set->n; i++) {
        const fl_shard_buf *b = &set->b[i];
        s = buf_ranges(&sh, b, &fr[i], &nfr[i]);
        for (int p = 0; s == FL_OK && p < b->npc; p++)
            s = covered(&sh, b, fr[i], nfr[i], b->pc[p].k0, b->pc[p].k0 + b->pc[p].n);
        if (s != FL_OK || strcmp(b->name, "params")) continue;
        for (int j = 0; s == FL_OK && j < nfr[i]; j++) { /* no inf/NaN weight is resumed */
            const frange *x = &fr[i][j];
            long long bad = fl_dtype_first_nonfinite(x->src, b->dtype, x->k1 - x->k0);
            if (bad >= 0)
                s = fl_errorf(FL_ERR_FORMAT, "%s: parameter element %llu (in [%zu, %zu)) is inf/NaN: the checkpoint was "
                              "saved from a diverged run", sh.path[x->r], (unsigned long long)x->k0 + (unsigned long long)bad,
                              x->k0, x->k1);
        }
    }
    /* each held piece from the overlap of every file range with it */
    for (int i = 0; s == FL_OK && i < set->n; i++) {
        const fl_shard_buf *b = &set->b[i];
        size_t es = fl_dtype_size(b->dtype);
        for (int p = 0; s == FL_OK && p < b->npc; p++) {
            const fl_shard_piece *h = &b->pc[p];
            size_t h1 = h->k0 + h->n;
            for (int j = 0; s == FL_OK && j < nfr[i]; j++) {
                const frange *x = &fr[i][j];
                size_t lo = x->k0 > h->k0 ? x->k0 : h->k0, hi = x->k1 < h1 ? x->k1 : h1;
                char *d = (char *)h->data + (lo - h->k0) * es;
                if (lo < hi && b->opt) s = fl_optim_state_write(b->opt, d, x->src + (lo - x->k0) * es, (hi - lo) * es);
                else if (lo < hi) s = FL_RUN(set->be, to_device, d, x->src + (lo - x->k0) * es, (hi - lo) * es);
            }
        }
    }
    for (int i = 0; fr && i < set->n; i++) free(fr[i]);
    free(fr);
    free(nfr);
    if (s == FL_OK) s = fl_ckpt_read_state_meta(&sh.meta, sh.dir, o, st);
    shards_close(&sh);
    return s;
}

/* ---- the consolidated Hugging Face export ------------------------------------------------------ */

typedef struct {
    const shards *sh;
    const fl_shard_buf *b; /* "params" */
    const frange *fr;      /* its ranges in the files, sorted */
    int nfr;
    size_t off, n;         /* the tensor's elements of it */
} fill_ctx;

/* One output tensor, as fp32 (what fl_st_write's fill takes; 16-bit values widen exactly and are
 * narrowed back on write), from the file ranges that overlap it. */
static fl_status fill_tensor(void *ud, float *dst) {
    const fill_ctx *c = ud;
    size_t es = fl_dtype_size(c->b->dtype), e = c->off + c->n;
    for (int j = 0; j < c->nfr; j++) {
        const frange *x = &c->fr[j];
        size_t lo = x->k0 > c->off ? x->k0 : c->off, hi = x->k1 < e ? x->k1 : e;
        if (lo >= hi) continue;
        if (fl_convert(dst + (lo - c->off), FL_F32, x->src + (lo - x->k0) * es, c->b->dtype, hi - lo))
            return fl_errorf(FL_ERR_UNSUPPORTED, "%s: cannot convert %s parameters", c->sh->path[x->r],
                             fl_dtype_name(c->b->dtype));
    }
    return FL_OK;
}

/* config.json + model.safetensors of ckpt into out (out may be ckpt itself: final/ before its
 * commit), streamed: fl_st_write asks for one tensor at a time. */
static fl_status export_hf(const char *ckpt, const char *out, int *n_tok) {
    char p[FL_CFG_PATH + 64];
    FL_TRY(fl_fs_join(p, sizeof p, ckpt, "config.json"));
    fl_model_config mc;
    FL_TRY(fl_error_prefix(fl_hf_load_config(p, &mc), "%s: the model's config.json", ckpt));
    fl_param_layout lay;
    FL_TRY(fl_layout_build(&lay, &mc));
    shards sh;
    fl_status s = shards_open(&sh, ckpt, fl_shard_fingerprint(&lay, lay.numel), lay.numel, "nothing was written");
    if (s != FL_OK) {
        fl_layout_free(&lay);
        return s;
    }
    fl_shard_buf pb;
    memset(&pb, 0, sizeof pb);
    snprintf(pb.name, sizeof pb.name, "params");
    pb.count = lay.numel;
    pb.gran = 1;
    pb.dtype = FL_DTYPE_COUNT;
    for (int r = 0; r < sh.world && pb.dtype == FL_DTYPE_COUNT; r++) { /* the dtype as saved */
        const fl_st_tensor *t = fl_st_find(&sh.f[r], "params");
        if (t) pb.dtype = t->dtype;
    }
    if (pb.dtype == FL_DTYPE_COUNT) s = fl_errorf(FL_ERR_FORMAT, "%s: no shard file holds parameters", ckpt);
    frange *fr = NULL;
    int nfr = 0;
    if (s == FL_OK) s = buf_ranges(&sh, &pb, &fr, &nfr);
    if (s == FL_OK) s = covered(&sh, &pb, fr, nfr, 0, pb.count);
    fl_st_write_tensor *t = calloc((size_t)lay.n + 1, sizeof *t);
    fill_ctx *fc = calloc((size_t)lay.n + 1, sizeof *fc);
    if (s == FL_OK && (!t || !fc)) s = fl_errorf(FL_ERR_OOM, "%s: out of host memory", out);
    for (int k = 0; s == FL_OK && k < lay.n; k++) {
        const fl_param_info *pi = &lay.params[k];
        fc[k] = (fill_ctx){&sh, &pb, fr, nfr, pi->offset, pi->numel};
        t[k].name = pi->name;
        t[k].dtype = pb.dtype; /* as fl_hf_save_model: the storage dtype */
        t[k].src_dtype = FL_F32;
        t[k].fill = fill_tensor;
        t[k].fill_ud = &fc[k];
        fl_hf_tensor_shape(pi, &t[k]);
    }
    if (s == FL_OK) s = fl_hf_save_tensors(out, &mc, &lay, t);
    if (s == FL_OK && strcmp(ckpt, out)) s = fl_io_copy_tokenizer_files(ckpt, out, n_tok);
    free(t);
    free(fc);
    free(fr);
    shards_close(&sh);
    fl_layout_free(&lay);
    return s;
}

int fl_ckpt_is_sharded(const char *dir) {
    char p[FL_CFG_PATH + 512];
    snprintf(p, sizeof p, "%s/" FL_SHARD_META_FILE, dir);
    return fl_fs_is_file(p);
}

fl_status fl_ckpt_merge_shards(const char *ckpt_dir, const char *out_dir, int *n_tok) {
    if (n_tok) *n_tok = 0;
    if (!fl_fs_is_dir(ckpt_dir)) return fl_errorf(FL_ERR_NOT_FOUND, "%s: no such checkpoint folder", ckpt_dir);
    char p[FL_CFG_PATH + 64];
    if (!fl_ckpt_is_sharded(ckpt_dir))
        return fl_errorf(FL_ERR_INVALID, "%s: not a sharded checkpoint (no " FL_SHARD_META_FILE ")%s", ckpt_dir,
                         fl_fs_join(p, sizeof p, ckpt_dir, "model.safetensors") == FL_OK && fl_fs_is_file(p)
                             ? ": it holds model.safetensors already, a consolidated model" : "");
    if (!fl_ckpt_is_committed(ckpt_dir))
        return fl_errorf(FL_ERR_FORMAT, "%s: not committed (no COMMITTED file): a save that did not finish", ckpt_dir);
    return fl_error_prefix(export_hf(ckpt_dir, out_dir, n_tok), "merge_shards %s", ckpt_dir);
}

/* ---- save -------------------------------------------------------------------------------------- */

fl_status fl_shard_ckpt_save(fl_dp *dp, const fl_shard_set *set, const char *out_dir, const char *name,
                             const fl_model *m, const fl_optimizer *o, const fl_train_state *st,
                             const fl_run_config *cfg, const char *tok_dir, int export_hf_too) {
    char tmp[FL_CFG_PATH + 300], dst[FL_CFG_PATH + 300], p[FL_CFG_PATH + 400];
    /* one folder name for every rank (a pid would differ); fl_ckpt_clean_tmp removes leftovers */
    snprintf(tmp, sizeof tmp, "%s/.tmp-%s" TMP_SUFFIX, out_dir, name);
    snprintf(dst, sizeof dst, "%s/%s", out_dir, name);
    const uint64_t fp = fl_shard_fingerprint(&m->layout, set->split_n);
    fl_status s = FL_OK;
    if (dp->rank == 0) { /* the folder and the shared files first */
        fl_fs_remove_dir(tmp);
        fl_fs_tmp_track(tmp); /* a stop by a signal removes it (the CLI) */
        if (mkdir(out_dir, 0755) != 0 && errno != EEXIST)
            s = fl_errorf(FL_ERR_IO, "%s: cannot create output folder: %s", out_dir, strerror(errno));
        if (s == FL_OK && mkdir(tmp, 0755) != 0) s = fl_errorf(FL_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
        if (s == FL_OK) s = fl_fs_join(p, sizeof p, tmp, "config.json");
        if (s == FL_OK) s = fl_hf_save_config_dtype(p, &m->cfg, fl_model_store_dtype(m)); /* the shards' dtype */
        if (s == FL_OK && cfg) s = fl_ckpt_write_hparams(tmp, cfg);
        if (s == FL_OK) s = fl_io_write_tokenizer(tok_dir, tmp, NULL); /* NULL: the built-in bytes */
        if (s == FL_OK) s = write_meta(tmp, dp, set, o, st, cfg, fp);
    }
    s = fl_dp_agree(dp, s); /* the folder exists before any rank writes into it */
    /* HYBRID_SHARD: every node holds the same shards; node 0's ranks write them, as ranks 0..devices-1 of
     * `devices` files (they tile every buffer, so any world size and strategy resumes them) */
    const int wrank = dp->node ? fl_comm_rank(dp->node) : dp->rank, wworld = dp->node ? fl_comm_size(dp->node) : dp->world;
    const int writes = !dp->rep || fl_comm_rank(dp->rep) == 0;
    if (s == FL_OK) s = fl_dp_agree(dp, writes ? write_shard(tmp, set, wrank, wworld, fp, st) : FL_OK); /* fsynced */
    if (s == FL_OK) {
        fl_status c = FL_OK;
        if (dp->rank == 0) {
            if (export_hf_too) c = export_hf(tmp, tmp, NULL); /* final/: the consolidated model too */
            if (c == FL_OK) c = fl_ckpt_commit(out_dir, name, tmp); /* the one marker */
        }
        s = fl_dp_agree(dp, c);
    }
    if (s != FL_OK && dp->rank == 0) fl_fs_remove_dir(tmp);
    if (dp->rank == 0) fl_fs_tmp_untrack(tmp);
    return s == FL_OK ? FL_OK : fl_error_prefix(s, "saving sharded checkpoint %s", dst);
}

/* Sharded checkpoints (--fsdp.state_dict_type sharded; Lightning's / LitGPT's name): each rank
 * writes the element ranges it owns of every flat buffer to its own file, one shared metadata file
 * says what the checkpoint is, and ONE commit marker, written by rank 0 after every rank reported
 * success, makes it resumable. See shard_ckpt.h for the buffer abstraction.
 *
 * A checkpoint folder (step-XXXXXX/ or final/):
 *   shard-RRRRR-of-NNNNN.safetensors  rank R's owned range of every buffer, one 1-D tensor each
 *                                      (named as the buffer); metadata: format, rank, world_size,
 *                                      fingerprint, step, iter, and "range.<buffer>" = "k0 k1 count"
 *   sharded_state.safetensors          no tensors; the training state (fl_ckpt_save's metadata),
 *                                      shard_files, fingerprint, stage, the buffer list
 *   config.json, hyperparameters.yaml, tokenizer files (rank 0)
 *   COMMITTED                          rank 0, last, after every rank's file was fsynced
 *   final/ only: model.safetensors (the consolidated HF export, streamed from the shard files)
 * The parameters are in the shard files once (each rank its range; the HF export of final/ is a
 * second, consolidated copy for transformers and generate); `fitllm merge_shards` writes the same
 * export offline from any committed sharded checkpoint.
 *
 * Resume at any world size: a rank reads its held range of each buffer from the files whose owned
 * ranges overlap it (through the files' mmaps, straight into its buffers); ranges that no file
 * covers, a missing file, a file of another step, world size or layout are refused before anything
 * is written. The ranges are fl_comm_chunk's over the trainable elements, so a buffer's owned
 * ranges tile it at every world size. */
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

fl_status fl_shard_set_add(fl_shard_set *s, const char *name, fl_dtype dt, size_t count, size_t base, size_t gran,
                           void *data, size_t h0, size_t hn) {
    if (strlen(name) >= FL_SHARD_NAME_MAX) return fl_errorf(FL_ERR_INVALID, "sharded checkpoint: buffer name too long: %s", name);
    if (gran == 0 || h0 + hn > count)
        return fl_errorf(FL_ERR_INVALID, "sharded checkpoint: buffer %s: held range [%zu, %zu) outside [0, %zu)", name, h0,
                         h0 + hn, count);
    if (s->n == s->cap) {
        int cap = s->cap ? 2 * s->cap : 16;
        fl_shard_buf *b = realloc(s->b, (size_t)cap * sizeof *b);
        if (!b) return fl_errorf(FL_ERR_OOM, "sharded checkpoint: out of host memory");
        s->b = b;
        s->cap = cap;
    }
    fl_shard_buf *b = &s->b[s->n++];
    memset(b, 0, sizeof *b);
    snprintf(b->name, sizeof b->name, "%s", name);
    b->dtype = dt;
    b->count = count;
    b->base = base;
    b->gran = gran;
    b->data = data;
    b->h0 = h0;
    b->hn = hn;
    return FL_OK;
}

void fl_shard_set_free(fl_shard_set *s) {
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
    return fl_shard_set_from_optim_ex(s, m, o, o->p, 0, o->n);
}

fl_status fl_shard_set_from_optim_ex(fl_shard_set *s, const fl_model *m, const fl_optimizer *o, void *params,
                                     size_t p_h0, size_t p_hn) {
    memset(s, 0, sizeof *s);
    if (m->lora)
        return fl_errorf(FL_ERR_UNSUPPORTED, "sharded checkpoints hold full-model training (finetune_full, pretrain); "
                         "LoRA adapters are saved whole");
    s->split_n = o->n;
    s->be = m->be;
    fl_status st = fl_shard_set_add(s, "params", o->pt, o->n, 0, 1, params, p_h0, p_hn);
    fl_dtype sd = o->cfg.state_dtype;
    if (st == FL_OK && o->m) {
        st = fl_shard_set_add(s, "optimizer.exp_avg", sd, o->n, 0, 1, o->m, o->s_off, o->s_len);
        if (st == FL_OK) st = fl_shard_set_add(s, "optimizer.exp_avg_sq", sd, o->n, 0, 1, o->v, o->s_off, o->s_len);
    } else if (st == FL_OK && o->buf) {
        st = fl_shard_set_add(s, "optimizer.momentum_buffer", sd, o->n, 0, 1, o->buf, o->s_off, o->s_len);
    } else if (st == FL_OK && o->state8) {
        /* bitsandbytes' state per tensor: codes per element, one absmax per block of 256 from the
         * tensor's start (a block belongs to the owner of its first element), fp32 m/v for tensors
         * under 4096 elements; each rank holds its piece (whole blocks around its chunk) */
        for (int i = 0; st == FL_OK && i < o->n_tensors; i++) {
            const fl_adam8bit_state *a = &o->st8[i];
            size_t tn = o->t_n[i], to = o->t_off[i], p0 = o->p8_a[i], pn = o->p8_n[i];
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

/* ---- files ------------------------------------------------------------------------------------- */

static void shard_name(char *buf, size_t n, int rank, int world) {
    snprintf(buf, n, "shard-%05d-of-%05d.safetensors", rank, world);
}

static const char *meta(const fl_st_file *f, const char *key) {
    for (int i = 0; i < f->n_meta; i++)
        if (!strcmp(f->meta_keys[i], key)) return f->meta_vals[i];
    return NULL;
}

/* This rank's shard file: its owned range of every buffer. */
static fl_status write_shard(const char *dir, const fl_shard_set *set, int rank, int world, uint64_t fp,
                             const fl_train_state *st) {
    char path[FL_CFG_PATH + 400], name[64];
    shard_name(name, sizeof name, rank, world);
    FL_TRY(fl_fs_join(path, sizeof path, dir, name));
    int nk = 7 + set->n;
    fl_st_write_tensor *t = calloc((size_t)set->n + 1, sizeof *t);
    char (*v)[FL_SHARD_NAME_MAX + 16] = calloc((size_t)nk, sizeof *v);
    char (*keys)[FL_SHARD_NAME_MAX + 16] = calloc((size_t)nk, sizeof *keys);
    const char **kp = calloc((size_t)nk, sizeof *kp), **vp = calloc((size_t)nk, sizeof *vp);
    fl_status s = t && v && keys && kp && vp ? FL_OK : fl_errorf(FL_ERR_OOM, "%s: out of host memory", path);
    int nt = 0, k = 0;
#define KV(key, ...) (snprintf(keys[k], sizeof keys[k], "%s", key), snprintf(v[k], sizeof v[k], __VA_ARGS__), k++)
    if (s == FL_OK) {
        KV("format", SHARD_FORMAT);
        KV("version", "1");
        KV("rank", "%d", rank);
        KV("world_size", "%d", world);
        KV("fingerprint", "%016" PRIx64, fp);
        KV("step", "%ld", st->step);
        KV("iter", "%ld", st->iter);
    }
    for (int i = 0; s == FL_OK && i < set->n; i++) {
        const fl_shard_buf *b = &set->b[i];
        size_t k0, k1;
        fl_shard_owned(b, set->split_n, world, rank, &k0, &k1);
        if (k1 > k0 && (k0 < b->h0 || k1 > b->h0 + b->hn)) {
            s = fl_errorf(FL_ERR_INVALID, "%s: buffer %s: rank %d owns elements [%zu, %zu) but holds [%zu, %zu)", path,
                          b->name, rank, k0, k1, b->h0, b->h0 + b->hn);
            break;
        }
        char rk[FL_SHARD_NAME_MAX + 16];
        snprintf(rk, sizeof rk, "range.%s", b->name);
        KV(rk, "%zu %zu %zu", k0, k1, b->count);
        if (k1 == k0) continue; /* nothing of this buffer is this rank's */
        size_t es = fl_dtype_size(b->dtype);
        t[nt++] = (fl_st_write_tensor){b->name, b->dtype, 1, {(int64_t)(k1 - k0)}, (const char *)b->data + (k0 - b->h0) * es,
                                       b->dtype, 0, NULL, NULL, set->be};
    }
#undef KV
    for (int i = 0; s == FL_OK && i < k; i++) kp[i] = keys[i], vp[i] = v[i];
    if (s == FL_OK) s = fl_st_write(path, t, nt, kp, vp, k); /* fsynced, renamed into place */
    free(t);
    free(v);
    free(keys);
    free(kp);
    free(vp);
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
    snprintf(files, sizeof files, "%d", dp->world);
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
static fl_status shards_open(shards *sh, const char *dir, uint64_t fp, size_t numel) {
    memset(sh, 0, sizeof *sh);
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
                          "shard file (nothing was resumed)", sh->path[r], sh->world, sh->world == 1 ? "" : "s");
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

/* File r's range [*k0, *k1) of buffer b and the tensor holding it (NULL when empty); checked
 * against b's dtype and count. */
static fl_status file_range(const shards *sh, int r, const fl_shard_buf *b, size_t *k0, size_t *k1,
                            const fl_st_tensor **t) {
    char rk[FL_SHARD_NAME_MAX + 16];
    snprintf(rk, sizeof rk, "range.%s", b->name);
    const char *v = meta(&sh->f[r], rk);
    *k0 = *k1 = 0;
    *t = NULL;
    if (!v) return FL_OK; /* holds nothing of it (a gap if someone needs it) */
    unsigned long long a, e, c;
    if (sscanf(v, "%llu %llu %llu", &a, &e, &c) != 3 || a > e || e > c)
        return fl_errorf(FL_ERR_FORMAT, "%s: metadata %s = '%s': not a range 'k0 k1 count'", sh->path[r], rk, v);
    if (c != b->count)
        return fl_errorf(FL_ERR_FORMAT, "%s: buffer %s has %llu elements, this run's %zu (another model or optimizer "
                         "layout)", sh->path[r], b->name, c, b->count);
    *k0 = (size_t)a;
    *k1 = (size_t)e;
    if (e == a) return FL_OK;
    *t = fl_st_find(&sh->f[r], b->name);
    size_t es = fl_dtype_size(b->dtype);
    if (!*t) return fl_errorf(FL_ERR_FORMAT, "%s: range [%llu, %llu) of %s listed but the tensor is missing", sh->path[r], a, e, b->name);
    if ((*t)->dtype != b->dtype)
        return fl_errorf(FL_ERR_FORMAT, "%s: buffer %s is %s, this run's is %s (precision or optimizer.state_dtype "
                         "changed?)", sh->path[r], b->name, fl_dtype_name((*t)->dtype), fl_dtype_name(b->dtype));
    if ((*t)->end - (*t)->begin != (size_t)(e - a) * es)
        return fl_errorf(FL_ERR_FORMAT, "%s: tensor %s holds %zu bytes, its range [%llu, %llu) needs %zu", sh->path[r],
                         b->name, (*t)->end - (*t)->begin, a, e, (size_t)(e - a) * es);
    return FL_OK;
}

/* Every element of [a, e) of b in some file's range, else an error naming the first gap and the
 * file that ends where it starts. */
static fl_status covered(const shards *sh, const fl_shard_buf *b, size_t a, size_t e) {
    size_t pos = a;
    while (pos < e) {
        size_t best = pos, next = e;
        int before = -1;
        for (int r = 0; r < sh->world; r++) {
            size_t k0, k1;
            const fl_st_tensor *t;
            FL_TRY(file_range(sh, r, b, &k0, &k1, &t));
            if (k0 <= pos && pos < k1 && k1 > best) best = k1;
            if (k0 > pos && k0 < next) next = k0;
            if (k1 == pos && k1 > k0) before = r;
        }
        if (best == pos) {
            char after[FL_CFG_PATH + 120] = "";
            if (before >= 0) {
                const char *slash = strrchr(sh->path[before], '/');
                snprintf(after, sizeof after, "; it follows %s's range", slash ? slash + 1 : sh->path[before]);
            }
            return fl_errorf(FL_ERR_FORMAT, "%s: buffer %s: elements [%zu, %zu) of %zu are in none of the %d shard "
                             "files%s (nothing was resumed)", sh->dir, b->name, pos, next, b->count, sh->world, after);
        }
        pos = best;
    }
    return FL_OK;
}

fl_status fl_shard_ckpt_load(const char *dir, const fl_shard_set *set, const fl_param_layout *lay, fl_optimizer *o,
                             fl_train_state *st) {
    if (!fl_ckpt_is_committed(dir))
        return fl_errorf(FL_ERR_FORMAT, "%s: not a committed checkpoint (no COMMITTED file: a save that did not finish)", dir);
    shards sh;
    FL_TRY(shards_open(&sh, dir, fl_shard_fingerprint(lay, set->split_n), set->split_n));
    fl_status s = FL_OK;
    const char *opt = meta(&sh.meta, "optimizer");
    if (o && opt && strcmp(opt, fl_optim_name(o->cfg.kind)))
        s = fl_errorf(FL_ERR_FORMAT, "%s/" FL_SHARD_META_FILE ": saved with optimizer %s, this run uses %s", dir, opt,
                      fl_optim_name(o->cfg.kind));
    /* check everything first: nothing is written into the run's buffers unless all of it loads */
    for (int i = 0; s == FL_OK && i < set->n; i++) {
        const fl_shard_buf *b = &set->b[i];
        s = covered(&sh, b, b->h0, b->h0 + b->hn);
        if (s != FL_OK || strcmp(b->name, "params")) continue;
        for (int r = 0; s == FL_OK && r < sh.world; r++) { /* no inf/NaN weight is resumed */
            size_t k0, k1;
            const fl_st_tensor *t;
            s = file_range(&sh, r, b, &k0, &k1, &t);
            long long bad = s == FL_OK && t ? fl_dtype_first_nonfinite(t->data, b->dtype, k1 - k0) : -1;
            if (bad >= 0)
                s = fl_errorf(FL_ERR_FORMAT, "%s: parameter element %llu (in [%zu, %zu)) is inf/NaN: the checkpoint was "
                              "saved from a diverged run", sh.path[r], (unsigned long long)k0 + (unsigned long long)bad,
                              k0, k1);
        }
    }
    for (int i = 0; s == FL_OK && i < set->n; i++) {
        const fl_shard_buf *b = &set->b[i];
        size_t es = fl_dtype_size(b->dtype), h1 = b->h0 + b->hn;
        for (int r = 0; s == FL_OK && r < sh.world; r++) {
            size_t k0, k1;
            const fl_st_tensor *t;
            s = file_range(&sh, r, b, &k0, &k1, &t);
            size_t lo = k0 > b->h0 ? k0 : b->h0, hi = k1 < h1 ? k1 : h1;
            if (s == FL_OK && t && lo < hi)
                s = set->be->to_device(set->be, (char *)b->data + (lo - b->h0) * es,
                                       (const char *)t->data + (lo - k0) * es, (hi - lo) * es);
        }
    }
    if (s == FL_OK) s = fl_ckpt_read_state_meta(&sh.meta, sh.dir, o, st);
    shards_close(&sh);
    return s;
}

/* ---- the consolidated Hugging Face export ------------------------------------------------------ */

typedef struct {
    const shards *sh;
    const fl_shard_buf *b; /* "params" */
    size_t off, n;         /* the tensor's elements of it */
} fill_ctx;

/* One output tensor, as fp32 (what fl_st_write's fill takes; 16-bit values widen exactly and are
 * narrowed back on write), from the file ranges that overlap it. */
static fl_status fill_tensor(void *ud, float *dst) {
    const fill_ctx *c = ud;
    size_t es = fl_dtype_size(c->b->dtype), e = c->off + c->n;
    for (int r = 0; r < c->sh->world; r++) {
        size_t k0, k1;
        const fl_st_tensor *t;
        FL_TRY(file_range(c->sh, r, c->b, &k0, &k1, &t));
        size_t lo = k0 > c->off ? k0 : c->off, hi = k1 < e ? k1 : e;
        if (!t || lo >= hi) continue;
        if (fl_convert(dst + (lo - c->off), FL_F32, (const char *)t->data + (lo - k0) * es, c->b->dtype, hi - lo))
            return fl_errorf(FL_ERR_UNSUPPORTED, "%s: cannot convert %s parameters", c->sh->path[r],
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
    fl_status s = shards_open(&sh, ckpt, fl_shard_fingerprint(&lay, lay.numel), lay.numel);
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
    if (s == FL_OK) s = covered(&sh, &pb, 0, pb.count);
    fl_st_write_tensor *t = calloc((size_t)lay.n + 1, sizeof *t);
    fill_ctx *fc = calloc((size_t)lay.n + 1, sizeof *fc);
    if (s == FL_OK && (!t || !fc)) s = fl_errorf(FL_ERR_OOM, "%s: out of host memory", out);
    for (int k = 0; s == FL_OK && k < lay.n; k++) {
        const fl_param_info *pi = &lay.params[k];
        fc[k] = (fill_ctx){&sh, &pb, pi->offset, pi->numel};
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
        if (mkdir(out_dir, 0755) != 0 && errno != EEXIST)
            s = fl_errorf(FL_ERR_IO, "%s: cannot create output folder: %s", out_dir, strerror(errno));
        if (s == FL_OK && mkdir(tmp, 0755) != 0) s = fl_errorf(FL_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
        if (s == FL_OK) s = fl_fs_join(p, sizeof p, tmp, "config.json");
        if (s == FL_OK) s = fl_hf_save_config(p, &m->cfg);
        if (s == FL_OK && cfg) s = fl_ckpt_write_hparams(tmp, cfg);
        if (s == FL_OK && tok_dir) s = fl_io_copy_tokenizer_files(tok_dir, tmp, NULL);
        if (s == FL_OK) s = write_meta(tmp, dp, set, o, st, cfg, fp);
    }
    s = fl_dp_agree(dp, s); /* the folder exists before any rank writes into it */
    if (s == FL_OK) s = fl_dp_agree(dp, write_shard(tmp, set, dp->rank, dp->world, fp, st)); /* every rank's file, fsynced */
    if (s == FL_OK) {
        fl_status c = FL_OK;
        if (dp->rank == 0) {
            if (export_hf_too) c = export_hf(tmp, tmp, NULL); /* final/: the consolidated model too */
            if (c == FL_OK) c = fl_ckpt_commit(out_dir, name, tmp); /* the one marker */
        }
        s = fl_dp_agree(dp, c);
    }
    if (s != FL_OK && dp->rank == 0) fl_fs_remove_dir(tmp);
    return s == FL_OK ? FL_OK : fl_error_prefix(s, "saving sharded checkpoint %s", dst);
}

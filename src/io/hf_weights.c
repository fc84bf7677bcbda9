/* Hugging Face model folders: weights in (model.safetensors or a sharded set
 * with model.safetensors.index.json) and whole-folder save. */
#include "fitllm/io.h"
#include "fitllm/json.h"
#include "fitllm/torch_ckpt.h"

#include "core/fs.h"

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define FL_HF_PATH_MAX 4096

static int fl_hf_ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

/* Buffers HF keeps in some checkpoints that are not parameters. */
static int fl_hf_is_ignored_buffer(const char *name) {
    return fl_hf_ends_with(name, ".attn.bias") || fl_hf_ends_with(name, ".attn.masked_bias") ||
           fl_hf_ends_with(name, "rotary_emb.inv_freq");
}

/* name is in the NULL-terminated list (NULL: empty) */
static int fl_hf_listed(const char *const *list, const char *name) {
    for (int i = 0; list && list[i]; i++)
        if (strcmp(list[i], name) == 0) return 1;
    return 0;
}

static void fl_hf_fmt_shape(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t k = (size_t)snprintf(buf, n, "[");
    for (int d = 0; d < ndim && k < n; d++) k += (size_t)snprintf(buf + k, n - k, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (k < n) snprintf(buf + k, n - k, "]");
}

/* a NaN weight poisons every output: refused naming the tensor, instead of training or generating NaN silently */
static fl_status fl_hf_non_finite(const char *file, const char *tensor, long long at) {
    return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s' holds a non-finite value (inf/NaN) at element %lld: the file is "
                     "corrupt or was saved from a diverged run", file, tensor, at);
}

fl_status fl_hf_check_finite(const char *file, const char *tensor, const void *data, fl_dtype dt, size_t n) {
    const long long bad = fl_dtype_first_nonfinite(data, dt, n);
    return bad >= 0 ? fl_hf_non_finite(file, tensor, bad) : FL_OK;
}

/* A sharded model (fl_model_provider, FSDP FULL_SHARD): only this rank's piece of entry pi, its elements
 * [k0, k1) (fl_model_param_piece), read from the mapped file: only those elements' bytes are
 * touched (a contiguous run; for a Conv1D weight stored transposed, the strided disk elements of the
 * piece's output rows). Checked and converted exactly as fl_hf_copy_tensor's whole-tensor paths do
 * (the file dtype straight to the storage dtype; transposed: through fp32), so the piece holds the
 * whole load's bits. Fixed slices copied into the (device) storage: no whole-tensor staging. */
static fl_status fl_hf_copy_tensor_range(fl_model *m, int pi, const fl_st_file *f, const fl_st_tensor *t) {
    const fl_param_info *p = &m->layout.params[pi];
    size_t k0, k1;
    fl_dtype dt;
    char *dst = fl_model_param_piece(m, pi, &k0, &k1, &dt);
    if (!dst) return FL_OK; /* nothing of this tensor is ours */
    const size_t es = fl_dtype_size(t->dtype), ds = fl_dtype_size(dt);
    const int tr = p->ndim == 2 && p->transposed_on_disk;
    const size_t out = (size_t)p->shape[0], in = tr ? (size_t)p->shape[1] : 1; /* storage (o, i) = disk (i, o) */
    const char *src = t->data;
    enum { SLICE = 1 << 16 };
    double *buf = malloc(SLICE * sizeof(double) + SLICE * sizeof(float)); /* file slice (or fp32) | converted */
    if (!buf) return fl_errorf(FL_ERR_OOM, "%s: out of memory loading '%s'", f->path, t->name);
    char *cv = (char *)(buf + SLICE);
    fl_status s = FL_OK;
    for (size_t a = k0; a < k1 && s == FL_OK; a += SLICE) {
        const size_t n = k1 - a < SLICE ? k1 - a : SLICE;
        long long bad = -1;
        if (!tr) {
            memcpy(buf, src + a * es, n * es); /* copied out first: the file does not promise alignment */
            bad = fl_dtype_first_nonfinite(buf, t->dtype, n);
            if (bad >= 0) bad += (long long)a;
            else if (fl_convert(cv, dt, buf, t->dtype, n))
                s = fl_errorf(FL_ERR_INTERNAL, "%s: tensor '%s': conversion failed", f->path, t->name);
        } else {
            float *row = (float *)buf;
            for (size_t j = 0; j < n && bad < 0; j++) {
                const size_t k = a + j, o = k / in, i = k % in, at = i * out + o; /* disk element */
                double raw;
                memcpy(&raw, src + at * es, es);
                if (fl_dtype_first_nonfinite(&raw, t->dtype, 1) >= 0) bad = (long long)at;
                else fl_convert(&row[j], FL_F32, &raw, t->dtype, 1);
            }
            if (bad < 0) fl_convert(cv, dt, row, FL_F32, n);
        }
        if (bad >= 0) {
            s = fl_hf_non_finite(f->path, t->name, bad);
        } else if (s == FL_OK) {
            const fl_backend *pbe = fl_model_params_be(m); /* parameter offload: the host tier's */
            if (pbe) s = FL_RUN(pbe, to_device, dst + (a - k0) * ds, cv, n * ds);
            else memcpy(dst + (a - k0) * ds, cv, n * ds); /* a model without a backend: host memory */
        }
    }
    free(buf);
    return s;
}

/* Copy one file tensor into the parameter entry, converting dtype and
 * transposing Conv1D weights ([in,out] on disk -> (out,in)). */
static fl_status fl_hf_copy_tensor(fl_model *m, const fl_param_info *p, const fl_st_file *f, const fl_st_tensor *t,
                                   float *q4stage) {
    int64_t want[2];
    int want_nd = p->ndim;
    if (p->ndim == 2 && p->transposed_on_disk) { want[0] = p->shape[1]; want[1] = p->shape[0]; }
    else { want[0] = p->shape[0]; want[1] = p->shape[1]; }
    int ok = t->ndim == want_nd;
    for (int d = 0; ok && d < want_nd; d++) ok = t->shape[d] == want[d];
    if (!ok) {
        char a[128], b[128];
        fl_hf_fmt_shape(a, sizeof a, want_nd, want);
        fl_hf_fmt_shape(b, sizeof b, t->ndim, t->shape);
        return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': expected shape %s (from config.json) but the file has %s", f->path,
                         t->name, a, b);
    }
    if (t->dtype != FL_F32 && t->dtype != FL_BF16 && t->dtype != FL_F16 && t->dtype != FL_F64)
        return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': dtype %s cannot be loaded as a parameter (F32, BF16, F16)",
                         f->path, t->name, fl_dtype_name(t->dtype));
    int pi = (int)(p - m->layout.params);
    if (fl_model_provider(m)) return fl_hf_copy_tensor_range(m, pi, f, t); /* sharded: this rank's piece alone */
    fl_dtype dt;
    void *dst = fl_model_param_data(m, pi, &dt);
    /* a 4-bit entry: read as fp32 into the pool's staging (fl_model_q4_staging), then quantized */
    float *q4src = NULL;
    if (!dst) {
        if (!q4stage) return fl_errorf(FL_ERR_INTERNAL, "%s: '%s': no 4-bit staging", f->path, t->name);
        dst = q4src = q4stage;
        dt = FL_F32;
    }
    size_t es = fl_dtype_size(t->dtype), ds = fl_dtype_size(dt);
    const void *src = t->data;
    fl_status s = FL_OK;
    FL_TRY(fl_hf_check_finite(f->path, t->name, src, t->dtype, p->numel));
    if (q4src && !(p->ndim == 2 && p->transposed_on_disk) && (uintptr_t)src % es == 0) {
        /* into the host staging of a 4-bit entry */
        if (fl_convert(dst, dt, src, t->dtype, p->numel))
            s = fl_errorf(FL_ERR_INTERNAL, "%s: tensor '%s': conversion failed", f->path, t->name);
    } else if (!(p->ndim == 2 && p->transposed_on_disk)) {
        /* dense storage is device memory: fixed slices copied out of the file (it does not promise
         * alignment), converted on the host, copied in through the backend (never a whole-tensor copy) */
        enum { SLICE = 1 << 16 };
        double *buf = malloc(SLICE * sizeof(double) + SLICE * sizeof(float)); /* file slice | converted slice */
        if (!buf) return fl_errorf(FL_ERR_OOM, "%s: out of memory loading '%s'", f->path, t->name);
        char *cv = (char *)(buf + SLICE);
        for (size_t k0 = 0; k0 < p->numel && s == FL_OK; k0 += SLICE) {
            size_t n = p->numel - k0 < SLICE ? p->numel - k0 : SLICE;
            memcpy(buf, (const char *)src + k0 * es, n * es);
            if (fl_convert(cv, dt, buf, t->dtype, n))
                s = fl_errorf(FL_ERR_INTERNAL, "%s: tensor '%s': conversion failed", f->path, t->name);
            else if (q4src)
                memcpy((char *)dst + k0 * ds, cv, n * ds);
            else if (m->be)
                s = FL_RUN(fl_model_params_be(m), to_device, (char *)dst + k0 * ds, cv, n * ds);
            else /* a model without a backend (the I/O tools): host memory */
                memcpy((char *)dst + k0 * ds, cv, n * ds);
        }
        free(buf);
    } else if (!q4src && m->be && !fl_backend_host_memory(m->be)) {
        /* transposed into device memory: bands of output rows gathered on the host (each element
         * widened to fp32 and rounded to the storage dtype once, as below), copied in */
        size_t out = (size_t)p->shape[0], in = (size_t)p->shape[1];
        size_t band = ((size_t)1 << 16) / in ? ((size_t)1 << 16) / in : 1;
        float *row = malloc(in * sizeof(float));
        char *cv = malloc(band * in * ds);
        if (!row || !cv) s = fl_errorf(FL_ERR_OOM, "%s: out of memory loading '%s'", f->path, t->name);
        for (size_t o0 = 0; s == FL_OK && o0 < out; o0 += band) {
            size_t nb = out - o0 < band ? out - o0 : band;
            for (size_t o = o0; o < o0 + nb; o++) {
                for (size_t i = 0; i < in; i++) { /* disk (i, o): copied out first (the file may be unaligned) */
                    double raw;
                    memcpy(&raw, (const char *)src + (i * out + o) * es, es);
                    fl_convert(&row[i], FL_F32, &raw, t->dtype, 1);
                }
                fl_convert(cv + (o - o0) * in * ds, dt, row, FL_F32, in);
            }
            s = FL_RUN(fl_model_params_be(m), to_device, (char *)dst + o0 * in * ds, cv, nb * in * ds);
        }
        free(row);
        free(cv);
    } else {
        size_t out = (size_t)p->shape[0], in = (size_t)p->shape[1];
        /* one disk row at a time (out elements, copied out first: the file may be unaligned) */
        float *row = malloc(out * sizeof(float));
        double *raw = malloc(out * sizeof(double));
        if (!row || !raw) s = fl_errorf(FL_ERR_OOM, "%s: out of memory loading '%s'", f->path, t->name);
        for (size_t i = 0; s == FL_OK && i < in; i++) { /* disk row i: out elements */
            memcpy(raw, (const char *)src + i * out * es, out * es);
            fl_convert(row, FL_F32, raw, t->dtype, out);
            for (size_t o = 0; o < out; o++) fl_convert((char *)dst + (o * in + i) * ds, dt, &row[o], FL_F32, 1);
        }
        free(row);
        free(raw);
    }
    if (q4src && s == FL_OK) fl_model_write_param(m, pi, q4src);
    return s;
}


typedef struct {
    fl_st_file *files;
    int n_files;
    char (*names)[256]; /* shard file names */
} fl_hf_shards;

static void fl_hf_shards_free(fl_hf_shards *s) {
    for (int i = 0; i < s->n_files; i++) fl_st_close(&s->files[i]);
    free(s->files);
    free(s->names);
    memset(s, 0, sizeof *s);
}

/* The shards named by an index (model.safetensors.index.json or pytorch_model.bin.index.json),
 * each opened once. */
static fl_status fl_hf_open_index(const char *dir, const char *ipath, fl_hf_shards *sh) {
    char path[FL_HF_PATH_MAX];
    fl_json *idx = NULL;
    FL_TRY(fl_json_parse_file(ipath, &idx));
    fl_status s = FL_OK;
    const fl_json *wm = fl_json_get(idx, "weight_map");
    if (!wm || wm->type != FL_JSON_OBJECT) {
        s = fl_errorf(FL_ERR_FORMAT, "%s: missing key 'weight_map' (an object of tensor name -> shard file)", ipath);
        goto done;
    }
    sh->files = calloc(wm->len ? wm->len : 1, sizeof *sh->files);
    sh->names = calloc(wm->len ? wm->len : 1, sizeof *sh->names);
    if (!sh->files || !sh->names) { s = fl_errorf(FL_ERR_OOM, "%s: out of memory", ipath); goto done; }
    for (const fl_json *e = wm->child; e && s == FL_OK; e = e->next) {
        if (e->type != FL_JSON_STRING) { s = fl_errorf(FL_ERR_FORMAT, "%s: weight_map['%s'] must be a file name string", ipath, e->key); break; }
        if (strchr(e->str, '/') || strlen(e->str) >= sizeof sh->names[0] || !e->str[0]) {
            s = fl_errorf(FL_ERR_FORMAT, "%s: weight_map['%s'] = '%s' is not a plain file name in the folder", ipath, e->key, e->str);
            break;
        }
        int k = 0;
        while (k < sh->n_files && strcmp(sh->names[k], e->str) != 0) k++;
        if (k == sh->n_files) {
            snprintf(sh->names[k], sizeof sh->names[k], "%s", e->str);
            s = fl_fs_join(path, sizeof path, dir, e->str);
            if (s == FL_OK) s = fl_weights_open(&sh->files[k], path);
            if (s != FL_OK) break;
            sh->n_files++;
        }
        if (!fl_st_find(&sh->files[k], e->key))
            s = fl_errorf(FL_ERR_FORMAT, "%s: weight_map says tensor '%s' is in %s, but that shard does not have it", ipath, e->key, e->str);
    }
done:
    fl_json_free(idx);
    return s;
}

/* One weights file as the whole model. */
static fl_status fl_hf_open_single(const char *path, fl_hf_shards *sh) {
    sh->files = calloc(1, sizeof *sh->files);
    if (!sh->files) return fl_errorf(FL_ERR_OOM, "%s: out of memory", path);
    FL_TRY(fl_weights_open(&sh->files[0], path));
    sh->n_files = 1;
    return FL_OK;
}

/* Open the folder's weights, the first of: model.safetensors, model.safetensors.index.json (and its
 * shards), pytorch_model.bin, pytorch_model.bin.index.json (and its shards), lit_model.pth (LitGPT
 * names mapped to Hugging Face ones with cfg's head counts). Safetensors first, as transformers
 * prefers them when a folder holds both. */
static fl_status fl_hf_open_shards(const char *dir, const fl_model_config *cfg, fl_hf_shards *sh) {
    static const char *const single[] = {"model.safetensors", NULL, "pytorch_model.bin", NULL, "lit_model.pth"};
    static const char *const index[] = {NULL, "model.safetensors.index.json", NULL, "pytorch_model.bin.index.json", NULL};
    char path[FL_HF_PATH_MAX];
    memset(sh, 0, sizeof *sh);
    if (!fl_fs_is_dir(dir)) return fl_errorf(FL_ERR_NOT_FOUND, "%s: no such folder", dir);
    for (int i = 0; i < 5; i++) {
        FL_TRY(fl_fs_join(path, sizeof path, dir, single[i] ? single[i] : index[i]));
        if (!fl_fs_is_file(path)) continue;
        if (!single[i]) return fl_hf_open_index(dir, path, sh);
        FL_TRY(fl_hf_open_single(path, sh));
        if (i == 4) {
            int hd = cfg->head_dim ? cfg->head_dim : cfg->dim / (cfg->n_heads ? cfg->n_heads : 1);
            return fl_torch_lit_to_hf(&sh->files[0], cfg->n_heads, cfg->n_kv_heads ? cfg->n_kv_heads : cfg->n_heads, hd);
        }
        return FL_OK;
    }
    char spath[FL_HF_PATH_MAX]; /* a sharded training checkpoint (src/train/shard_ckpt.c) */
    int sharded = fl_fs_join(spath, sizeof spath, dir, "sharded_state.safetensors") == FL_OK && fl_fs_is_file(spath);
    return fl_errorf(FL_ERR_NOT_FOUND, "%s: no model.safetensors, model.safetensors.index.json, pytorch_model.bin, "
                     "pytorch_model.bin.index.json or lit_model.pth%s", dir,
                     sharded ? " (a sharded checkpoint: write its Hugging Face folder with fitllm merge_shards "
                               "<dir>, or resume it with --resume)" : "");
}

fl_status fl_hf_load_weights(fl_model *m, const char *dir) {
    fl_hf_shards sh;
    fl_status s = fl_hf_open_shards(dir, &m->cfg, &sh);
    if (s != FL_OK) { fl_hf_shards_free(&sh); return s; }
    const fl_param_layout *lay = &m->layout;
    char *seen = calloc((size_t)lay->n + 1, 1);
    if (!seen) { fl_hf_shards_free(&sh); return fl_errorf(FL_ERR_OOM, "%s: out of memory", dir); }
    float *q4stage = NULL;
    s = fl_model_q4_staging(m, &q4stage);
    int wte = fl_layout_role(lay, 0, FL_ROLE_EMBED);
    for (int fi = 0; fi < sh.n_files && s == FL_OK; fi++) {
        const fl_st_file *f = &sh.files[fi];
        for (int ti = 0; ti < f->n_tensors && s == FL_OK; ti++) {
            const fl_st_tensor *t = &f->tensors[ti];
            int k = fl_layout_find(lay, t->name);
            if (k < 0) {
                const fl_arch_info *ai = fl_arch_get(m->cfg.arch);
                if (fl_hf_is_ignored_buffer(t->name) || fl_hf_listed(ai->hf_ignored, t->name)) continue;
                if (((m->cfg.tie_embeddings && strcmp(t->name, "lm_head.weight") == 0) ||
                     fl_hf_listed(ai->hf_embed_aliases, t->name)) && wte >= 0) {
                    const fl_param_info *p = &lay->params[wte];
                    if (t->ndim != 2 || t->shape[0] != p->shape[0] || t->shape[1] != p->shape[1])
                        s = fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s' (tied to the embeddings) has a shape different from %s",
                                      f->path, t->name, p->name);
                    continue; /* tied: the embedding is the head (or a copy of it) */
                }
                s = fl_errorf(FL_ERR_FORMAT, "%s: unexpected tensor '%s' (not a parameter of this %s model per config.json)",
                              f->path, t->name, fl_arch_get(m->cfg.arch)->display);
                break;
            }
            if (seen[k]) {
                s = fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s' appears twice (as '%s')", f->path, lay->params[k].name, t->name);
                break;
            }
            seen[k] = 1;
            s = fl_hf_copy_tensor(m, &lay->params[k], f, t, q4stage);
        }
    }
    for (int k = 0; k < lay->n && s == FL_OK; k++)
        if (!seen[k]) s = fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s' not found in the model files", dir, lay->params[k].name);
    free(seen);
    fl_mem_free(fl_mem_host_pool(m->pool), q4stage);
    fl_hf_shards_free(&sh);
    return s;
}

/* config.json against the tensors, before anything of the config's size is
 * built: a config claiming 10^9 layers must fail in milliseconds, not after
 * minutes of allocation. The layer count and the embedding shape are enough
 * to catch a config that does not belong to the weights; every other shape is
 * checked tensor by tensor while loading. */
static fl_status fl_hf_check_config_vs_files(const char *dir, const char *cfg_path, const fl_model_config *c) {
    fl_hf_shards sh;
    fl_status s = fl_hf_open_shards(dir, c, &sh);
    if (s != FL_OK) { fl_hf_shards_free(&sh); return s; }
    const fl_arch_info *ai = fl_arch_get(c->arch);
    const char *pre = ai->hf_block, *emb = ai->hf_embed, *opt = ai->hf_prefix; /* names after the optional prefix */
    long max_layer = -1;
    const fl_st_tensor *e = NULL;
    for (int fi = 0; fi < sh.n_files; fi++)
        for (int ti = 0; ti < sh.files[fi].n_tensors; ti++) {
            const fl_st_tensor *t = &sh.files[fi].tensors[ti];
            const char *nm = t->name;
            if (opt && !strncmp(nm, opt, strlen(opt))) nm += strlen(opt); /* both spellings (GPT-2: with and without) */
            if (!strcmp(nm, emb)) e = t;
            if (strncmp(nm, pre, strlen(pre))) continue;
            char *end;
            long k = strtol(nm + strlen(pre), &end, 10);
            if (end != nm + strlen(pre) && *end == '.' && k > max_layer) max_layer = k;
        }
    if (max_layer >= 0 && max_layer + 1 != c->n_layers)
        s = fl_errorf(FL_ERR_FORMAT, "%s: says %d layers (%s) but the weights in %s hold %ld (%s0 .. %s%ld)", cfg_path,
                      c->n_layers, ai->hf_layers_key, dir, max_layer + 1, pre, pre, max_layer);
    else if (e && (e->ndim != 2 || e->shape[0] != c->vocab_size || e->shape[1] != c->dim))
        s = fl_errorf(FL_ERR_FORMAT, "%s: vocab_size %d x hidden size %d does not match the embedding '%s' of shape "
                      "[%lld, %lld] in %s", cfg_path, c->vocab_size, c->dim, e->name, (long long)e->shape[0],
                      (long long)(e->ndim > 1 ? e->shape[1] : 0), dir);
    if (s == FL_OK) {
        /* Every parameter comes from the files at 2 bytes or more (F16/BF16): a config the files
         * cannot fill (no layer or embedding tensors to compare with) must not get its model
         * allocated. */
        uint64_t have = 0;
        for (int fi = 0; fi < sh.n_files; fi++)
            for (int ti = 0; ti < sh.files[fi].n_tensors; ti++)
                have += sh.files[fi].tensors[ti].end - sh.files[fi].tensors[ti].begin;
        size_t np = fl_sizing_param_count(c);
        if ((double)have < 2.0 * (double)np)
            s = fl_errorf(FL_ERR_FORMAT, "%s: describes %zu parameters (at least %.4g MB as 16-bit) but the weights in %s "
                          "hold %llu bytes", cfg_path, np, 2e-6 * (double)np, dir, (unsigned long long)have);
    }
    fl_hf_shards_free(&sh);
    return s;
}

fl_status fl_hf_load_model(fl_model *m, const char *dir, const fl_backend *be, fl_mem_pool *pool) {
    return fl_hf_load_model_ex(m, dir, be, pool, NULL);
}

fl_status fl_hf_load_model_ex(fl_model *m, const char *dir, const fl_backend *be, fl_mem_pool *pool,
                              const fl_model_storage *st) {
    char path[FL_HF_PATH_MAX];
    FL_TRY(fl_fs_join(path, sizeof path, dir, "config.json"));
    fl_model_config cfg;
    FL_TRY(fl_hf_load_config(path, &cfg));
    return fl_hf_load_model_cfg(m, dir, &cfg, path, be, pool, st);
}

fl_status fl_hf_load_model_cfg(fl_model *m, const char *dir, const fl_model_config *cfg, const char *cfg_source,
                               const fl_backend *be, fl_mem_pool *pool, const fl_model_storage *st) {
    FL_TRY(fl_hf_check_config_vs_files(dir, cfg_source, cfg));
    FL_TRY(fl_model_init_ex(m, cfg, be, pool, st));
    fl_status s = fl_hf_load_weights(m, dir);
    if (s != FL_OK) fl_model_free(m);
    return s;
}

/* ---- saving ------------------------------------------------------------- */

/* Hugging Face shards weights above 5 GB ("5GB" = 5e9 bytes in save_pretrained). */
static size_t g_max_shard_bytes = 5000000000ull;

void fl_hf_set_max_shard_bytes(size_t bytes) { g_max_shard_bytes = bytes ? bytes : 5000000000ull; }

/* A 4-bit entry is written dequantized (and LoRA-merged after fl_model_lora_merge), one
 * tensor at a time, in the dense dtype. */
typedef struct {
    const fl_model *m;
    int i;
} fl_hf_fill_ctx;

static fl_status fl_hf_fill_q4(void *ud, float *dst) {
    const fl_hf_fill_ctx *c = ud;
    fl_model_read_param(c->m, c->i, dst);
    return FL_OK;
}

fl_dtype fl_hf_tensors_dtype(const fl_param_layout *lay, const fl_st_write_tensor *t) {
    size_t n[FL_DTYPE_COUNT] = {0};
    fl_dtype best = FL_F32;
    for (int k = 0; k < lay->n; k++)
        if ((int)t[k].dtype >= 0 && t[k].dtype < FL_DTYPE_COUNT) n[t[k].dtype] += lay->params[k].numel;
    for (int d = 0; d < FL_DTYPE_COUNT; d++)
        if (n[d] > n[best]) best = (fl_dtype)d;
    return best;
}

/* config.json + the layout's tensors t[0..lay->n) (layout order) into dir: model.safetensors, or
 * shards of at most g_max_shard_bytes (of the written dtypes) + model.safetensors.index.json. */
static fl_status fl_hf_write_tensor_files(const char *dir, const fl_model_config *cfg, const fl_param_layout *lay,
                                          const fl_st_write_tensor *t) {
    char path[FL_HF_PATH_MAX];
    int *shard = calloc((size_t)lay->n + 1, sizeof *shard);
    if (!shard) return fl_errorf(FL_ERR_OOM, "%s: out of memory", dir);
    /* pack tensors, in layout order, into shards of at most g_max_shard_bytes */
    int n_shards = 1;
    size_t cur = 0, total = 0;
    for (int k = 0; k < lay->n; k++) {
        size_t b = lay->params[k].numel * fl_dtype_size(t[k].dtype);
        if (cur > 0 && cur + b > g_max_shard_bytes) { n_shards++; cur = 0; }
        cur += b;
        total += b;
        shard[k] = n_shards - 1;
    }
    const char *mk[] = {"format"}, *mv[] = {"pt"};
    fl_status s = FL_OK;
    if (n_shards == 1) {
        s = fl_fs_join(path, sizeof path, dir, "model.safetensors");
        if (s == FL_OK) s = fl_st_write(path, t, lay->n, mk, mv, 1);
    } else {
        /* model-0000i-of-0000N.safetensors + model.safetensors.index.json */
        char *index = NULL;
        size_t ilen = 0;
        FILE *f = open_memstream(&index, &ilen);
        if (!f) s = fl_errorf(FL_ERR_OOM, "%s: out of memory", dir);
        if (f) fprintf(f, "{\n  \"metadata\": {\"total_size\": %zu},\n  \"weight_map\": {\n", total);
        for (int sh = 0, first = 0; s == FL_OK && sh < n_shards; sh++) {
            int k0 = first, k1 = k0;
            while (k1 < lay->n && shard[k1] == sh) k1++;
            char name[64];
            snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", sh + 1, n_shards);
            s = fl_fs_join(path, sizeof path, dir, name);
            if (s == FL_OK) s = fl_st_write(path, t + k0, k1 - k0, mk, mv, 1);
            for (int k = k0; k < k1; k++)
                fprintf(f, "    \"%s\": \"%s\"%s\n", t[k].name, name, k + 1 < lay->n ? "," : "");
            first = k1;
        }
        if (f) {
            fprintf(f, "  }\n}\n");
            fclose(f);
        }
        if (s == FL_OK) s = fl_fs_join(path, sizeof path, dir, "model.safetensors.index.json");
        if (s == FL_OK) s = fl_fs_write_file_atomic(path, index, ilen);
        free(index);
    }
    free(shard);
    if (s == FL_OK) s = fl_fs_join(path, sizeof path, dir, "config.json");
    if (s == FL_OK) s = fl_hf_save_config_dtype(path, cfg, fl_hf_tensors_dtype(lay, t));
    return s;
}

/* The tensors of a model: its storage (device memory read in slices), 4-bit entries dequantized */
static fl_status fl_hf_write_files(const fl_model *m, const char *dir) {
    const fl_param_layout *lay = &m->layout;
    fl_st_write_tensor *t = calloc((size_t)lay->n + 1, sizeof *t);
    fl_hf_fill_ctx *fc = calloc((size_t)lay->n + 1, sizeof *fc);
    if (!t || !fc) { free(t); free(fc); return fl_errorf(FL_ERR_OOM, "%s: out of memory", dir); }
    for (int k = 0; k < lay->n; k++) {
        const fl_param_info *p = &lay->params[k];
        fl_dtype sdt;
        const void *data = fl_model_param_data(m, k, &sdt);
        t[k].name = p->name;
        t[k].dtype = sdt; /* saved in the storage dtype: a bf16-true run writes bf16 */
        t[k].src_dtype = sdt;
        t[k].data = data;
        t[k].be = m->be; /* the storage is device memory (NULL: a model without a backend, host) */
        if (!data) {
            fc[k] = (fl_hf_fill_ctx){m, k};
            t[k].src_dtype = FL_F32;
            t[k].fill = fl_hf_fill_q4;
            t[k].fill_ud = &fc[k];
        }
        fl_hf_tensor_shape(p, &t[k]);
    }
    fl_status s = fl_hf_write_tensor_files(dir, &m->cfg, lay, t);
    free(t);
    free(fc);
    return s;
}

void fl_hf_tensor_shape(const fl_param_info *p, fl_st_write_tensor *t) {
    t->ndim = p->ndim;
    if (p->ndim == 2 && p->transposed_on_disk) {
        t->shape[0] = p->shape[1];
        t->shape[1] = p->shape[0];
        t->transpose2d = 1;
    } else {
        t->shape[0] = p->shape[0];
        t->shape[1] = p->shape[1];
    }
}

/* Into an existing folder (it may hold tokenizer files): the files replaced, each atomically
 * (weights first, then the config); a new folder is built beside the target and renamed into
 * place. */
static fl_status fl_hf_save_folder(const char *dir, const fl_model *m, const fl_model_config *cfg,
                                   const fl_param_layout *lay, const fl_st_write_tensor *t) {
    if (fl_fs_is_dir(dir)) {
        fl_status s = m ? fl_hf_write_files(m, dir) : fl_hf_write_tensor_files(dir, cfg, lay, t);
        if (s == FL_OK) fl_fs_sync_dir(dir);
        return s;
    }
    char tmp[FL_HF_PATH_MAX];
    size_t dl = strlen(dir);
    while (dl > 1 && dir[dl - 1] == '/') dl--;
    int w = snprintf(tmp, sizeof tmp, "%.*s.tmp-%ld", (int)dl, dir, (long)getpid());
    if (w < 0 || (size_t)w >= sizeof tmp) return fl_errorf(FL_ERR_INVALID, "%s: path too long", dir);
    fl_fs_remove_dir(tmp); /* stale leftover of a crashed save by this pid */
    if (mkdir(tmp, 0755) != 0) return fl_errorf(FL_ERR_IO, "%s: cannot create folder %s: %s", dir, tmp, strerror(errno));
    fl_fs_tmp_track(tmp); /* a stop by a signal removes it (the CLI) */
    fl_status s = m ? fl_hf_write_files(m, tmp) : fl_hf_write_tensor_files(tmp, cfg, lay, t);
    if (s == FL_OK) {
        fl_fs_sync_dir(tmp);
        if (rename(tmp, dir) != 0) s = fl_errorf(FL_ERR_IO, "%s: cannot rename %s into place: %s", dir, tmp, strerror(errno));
    }
    if (s != FL_OK) fl_fs_remove_dir(tmp);
    fl_fs_tmp_untrack(tmp);
    return s;
}

fl_status fl_hf_save_model(const fl_model *m, const char *dir) {
    if (!m || !fl_model_params_data(m) || !dir || !dir[0]) return fl_errorf(FL_ERR_INVALID, "fl_hf_save_model: no model or folder");
    return fl_hf_save_folder(dir, m, NULL, NULL, NULL);
}

fl_status fl_hf_save_tensors(const char *dir, const fl_model_config *cfg, const fl_param_layout *lay,
                             const fl_st_write_tensor *t) {
    if (!cfg || !lay || !t || !dir || !dir[0]) return fl_errorf(FL_ERR_INVALID, "fl_hf_save_tensors: no tensors or folder");
    return fl_hf_save_folder(dir, NULL, cfg, lay, t);
}

/* ---- the weight files alone (fitllm convert) ------------------------------ */

fl_status fl_hf_open_weight_files(const char *dir, const fl_model_config *cfg, fl_st_file **files, int *n_files) {
    fl_hf_shards sh;
    *files = NULL;
    *n_files = 0;
    fl_status s = fl_hf_open_shards(dir, cfg, &sh);
    if (s != FL_OK) { fl_hf_shards_free(&sh); return s; }
    free(sh.names);
    *files = sh.files;
    *n_files = sh.n_files;
    return FL_OK;
}

void fl_hf_close_weight_files(fl_st_file *files, int n_files) {
    for (int i = 0; i < n_files; i++) fl_st_close(&files[i]);
    free(files);
}

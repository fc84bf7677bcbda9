/* fitllm convert: a model folder in any weight format fitllm reads (safetensors,
 * pytorch_model*.bin, lit_model.pth) or a llama2.c .bin to a Hugging Face safetensors
 * folder; see fl_hf_convert in include/fitllm/torch_ckpt.h. A folder's tensors are
 * written straight from the mapped source files in their own dtype (nothing is
 * converted or held in memory but the header), in the layout's order, with the same
 * shard writer as fl_hf_save_model; a llama2.c .bin is loaded as generate loads it
 * (fl_llama2c_load_model: fp32, the RoPE rows permuted to HF's order) and saved. */
#include "fitllm/torch_ckpt.h"
#include "fitllm/mem.h"

#include "core/fs.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define CV_PATH_MAX 4096

static int cv_ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

/* The layout's tensors out of the opened files, checked as the loader checks them. */
static fl_status cv_collect(const fl_param_layout *lay, const fl_model_config *cfg, const char *src, const fl_st_file *fs,
                            int nf, fl_st_write_tensor *t) {
    for (int k = 0; k < lay->n; k++) {
        const fl_param_info *p = &lay->params[k];
        const fl_st_tensor *x = NULL;
        int fi = 0; /* the file holding it */
        for (int i = 0; i < nf && !x; i++)
            if ((x = fl_st_find(&fs[i], p->name))) fi = i;
        if (!x) return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s' not found in the model files", src, p->name);
        fl_st_write_tensor w = {0};
        fl_hf_tensor_shape(p, &w); /* the shape on disk */
        int ok = x->ndim == w.ndim;
        for (int d = 0; ok && d < w.ndim; d++) ok = x->shape[d] == w.shape[d];
        if (!ok) return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': the file's shape does not match config.json", src, p->name);
        if (x->dtype != FL_F32 && x->dtype != FL_BF16 && x->dtype != FL_F16 && x->dtype != FL_F64)
            return fl_errorf(FL_ERR_UNSUPPORTED, "tensor '%s': dtype %s is not a parameter dtype (F32, BF16, F16, F64)",
                             p->name, fl_dtype_name(x->dtype));
        /* an inf/NaN weight is refused as the loaders refuse it: nothing is written */
        FL_TRY(fl_hf_check_finite(fs[fi].path, p->name, x->data, x->dtype, p->numel));
        t[k] = (fl_st_write_tensor){.name = p->name, .dtype = x->dtype, .src_dtype = x->dtype, .ndim = x->ndim,
                                    .data = x->data};
        memcpy(t[k].shape, x->shape, sizeof t[k].shape); /* as on disk: no transpose */
    }
    for (int i = 0; i < nf; i++)
        for (int j = 0; j < fs[i].n_tensors; j++) {
            const char *n = fs[i].tensors[j].name;
            if (fl_layout_find(lay, n) >= 0 || cv_ends_with(n, ".attn.bias") || cv_ends_with(n, ".attn.masked_bias") ||
                cv_ends_with(n, "rotary_emb.inv_freq") || (cfg->tie_embeddings && !strcmp(n, "lm_head.weight")))
                continue; /* buffers, and a tied head that is the embedding */
            return fl_errorf(FL_ERR_FORMAT, "%s: unexpected tensor '%s' (not a parameter of this model per config.json)",
                             fs[i].path, n);
        }
    return FL_OK;
}

/* A model folder's tensors and files into tmp (which exists). */
static fl_status cv_folder(const char *src, const char *tmp, int *n_tensors) {
    char cfg_path[CV_PATH_MAX], path[CV_PATH_MAX];
    FL_TRY(fl_fs_join(cfg_path, sizeof cfg_path, src, "config.json"));
    fl_model_config cfg;
    char *cfg_bytes = NULL;
    size_t cfg_len = 0;
    if (fl_fs_is_file(cfg_path)) {
        FL_TRY(fl_hf_load_config(cfg_path, &cfg));
        FL_TRY(fl_fs_read_file(cfg_path, 64u << 20, &cfg_bytes, &cfg_len)); /* copied: our writer drops keys */
    } else { /* a LitGPT folder: config.json is written from model_config.yaml's model */
        FL_TRY(fl_fs_join(cfg_path, sizeof cfg_path, src, "model_config.yaml"));
        if (!fl_fs_is_file(cfg_path))
            return fl_errorf(FL_ERR_NOT_FOUND, "%s: no config.json (Hugging Face) or model_config.yaml (LitGPT)", src);
        FL_TRY(fl_lit_load_config(cfg_path, &cfg));
    }
    fl_param_layout lay;
    fl_status s = fl_layout_build(&lay, &cfg);
    if (s != FL_OK) { free(cfg_bytes); return s; }
    fl_st_file *fs = NULL;
    int nf = 0;
    char *cfg_out = NULL;
    size_t out_len = 0;
    fl_st_write_tensor *t = calloc((size_t)lay.n + 1, sizeof *t);
    if (!t) s = fl_errorf(FL_ERR_OOM, "%s: out of memory", src);
    if (s == FL_OK) s = fl_hf_open_weight_files(src, &cfg, &fs, &nf);
    if (s == FL_OK) s = cv_collect(&lay, &cfg, src, fs, nf, t);
    if (s == FL_OK) s = fl_hf_save_tensors(tmp, &cfg, &lay, t); /* into tmp, which exists: in place */
    /* the source's config.json, its torch_dtype / dtype those of the tensors as written when they share one (they
     * keep theirs: a config that said otherwise would have from_pretrained(dtype="auto") load them as another dtype);
     * tensors of several dtypes: the source's word kept, a copy byte for byte (no one dtype is theirs) */
    int one = 1;
    for (int k = 1; s == FL_OK && k < lay.n; k++) one &= t[k].dtype == t[0].dtype;
    if (s == FL_OK && cfg_bytes && one)
        s = fl_hf_config_text_set_dtype(cfg_bytes, cfg_len, fl_hf_tensors_dtype(&lay, t), &cfg_out, &out_len);
    else if (s == FL_OK && cfg_bytes && !(cfg_out = malloc(cfg_len + 1)))
        s = fl_errorf(FL_ERR_OOM, "%s: out of memory", src);
    else if (s == FL_OK && cfg_bytes)
        memcpy(cfg_out, cfg_bytes, cfg_len), out_len = cfg_len;
    if (s == FL_OK && cfg_bytes) s = fl_fs_join(path, sizeof path, tmp, "config.json");
    if (s == FL_OK && cfg_bytes) s = fl_fs_write_file_atomic(path, cfg_out, out_len);
    if (s == FL_OK) s = fl_io_copy_tokenizer_files(src, tmp, NULL);
    if (s == FL_OK && n_tensors) *n_tensors = lay.n;
    fl_hf_close_weight_files(fs, nf);
    free(t);
    fl_layout_free(&lay);
    free(cfg_bytes);
    free(cfg_out);
    return s;
}

/* A llama2.c .bin into tmp (which exists): the model loaded as generate loads it, saved (config.json + fp32
 * model.safetensors), with the tokenizer files of its folder (tok512.bin, ...) when it has any. */
static fl_status cv_llama2c(const char *src, const char *tmp, int *n_tensors) {
    fl_mem_pool pool;
    fl_model m;
    FL_TRY(fl_mem_pool_init(&pool, "convert", 0));
    fl_status s = fl_llama2c_load_model(&m, src, NULL, &pool);
    if (s == FL_OK) {
        s = fl_hf_save_model(&m, tmp); /* into tmp, which exists: in place */
        if (s == FL_OK && n_tensors) *n_tensors = m.layout.n;
        fl_model_free(&m);
    }
    char dir[CV_PATH_MAX];
    const char *slash = strrchr(src, '/');
    snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - src) : 1, slash ? (slash == src ? "/" : src) : ".");
    if (s == FL_OK) s = fl_io_copy_tokenizer_files(dir, tmp, NULL);
    fl_mem_pool_free(&pool);
    return s;
}

fl_status fl_hf_convert(const char *src, const char *dst, int *n_tensors) {
    if (n_tensors) *n_tensors = 0;
    if (!src || !dst || !src[0] || !dst[0]) return fl_errorf(FL_ERR_INVALID, "convert: no source or destination folder");
    struct stat st;
    if (stat(dst, &st) == 0) return fl_errorf(FL_ERR_INVALID, "%s: already exists (convert writes a new folder)", dst);
    if (stat(src, &st) != 0) return fl_errorf(FL_ERR_NOT_FOUND, "%s: no such file or folder", src);
    const int bin = S_ISREG(st.st_mode);
    if (bin && !cv_ends_with(src, ".bin"))
        return fl_errorf(FL_ERR_INVALID, "%s: a file: convert takes a model folder or a llama2.c .bin", src);
    char tmp[CV_PATH_MAX];
    size_t dl = strlen(dst);
    while (dl > 1 && dst[dl - 1] == '/') dl--;
    int w = snprintf(tmp, sizeof tmp, "%.*s.tmp-%ld", (int)dl, dst, (long)getpid());
    if (w < 0 || (size_t)w >= sizeof tmp) return fl_errorf(FL_ERR_INVALID, "%s: path too long", dst);
    fl_fs_remove_dir(tmp); /* a crashed convert's leftover with this pid */
    fl_fs_tmp_track(tmp);  /* a stop by a signal removes it (the CLI) */
    fl_status s = FL_OK;
    if (mkdir(tmp, 0755) != 0) s = fl_errorf(FL_ERR_IO, "%s: cannot create folder %s: %s", dst, tmp, strerror(errno));
    if (s == FL_OK) s = bin ? cv_llama2c(src, tmp, n_tensors) : cv_folder(src, tmp, n_tensors);
    if (s == FL_OK) {
        fl_fs_sync_dir(tmp);
        if (rename(tmp, dst) != 0) s = fl_errorf(FL_ERR_IO, "%s: cannot rename %s into place: %s", dst, tmp, strerror(errno));
    }
    if (s != FL_OK) {
        fl_fs_remove_dir(tmp);
        if (n_tensors) *n_tensors = 0;
    }
    fl_fs_tmp_untrack(tmp);
    return s;
}

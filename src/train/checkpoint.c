/* Checkpoints: HF folder + training state, built in a temp folder, renamed,
 * then committed with a marker. See include/fitllm/checkpoint.h. */
#include <dirent.h>
#include <limits.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/fs.h"
#include "fitllm/checkpoint.h"
#include "fitllm/io.h"
#include "fitllm/peft.h"
#include "shard_ckpt.h"

#define STATE_FILE "training_state.safetensors"
#define MARKER "COMMITTED"
#define TMP_PREFIX ".tmp-"

/* The PEFT adapter of a LoRA model (its adapters as they are now) into dir. base_model: what
 * adapter_config.json names as base_model_name_or_path; an existing local folder is stored as
 * its absolute path, so merge_lora / generate / PEFT find it from any working directory. */
fl_status fl_ckpt_save_adapter(const fl_model *m, const char *dir, const char *base_model) {
    fl_lora_adapters ad, *st = &ad;
    if (!fl_model_lora_adapters(m, st))
        return fl_errorf(FL_ERR_INVALID, "%s: the model has no LoRA adapters to save", dir);
    fl_peft_module *mods = calloc((size_t)st->n_mods + 1, sizeof *mods);
    /* the adapters are device memory: one host copy of them (small: r x (in + out) per module) */
    float *host = malloc(st->numel * sizeof(float) + 1);
    fl_status cs = mods && host ? FL_RUN(m->be, to_host, host, st->params, st->numel * sizeof(float)) : FL_ERR_OOM;
    if (cs != FL_OK) {
        free(mods);
        free(host);
        return cs == FL_ERR_OOM ? fl_errorf(FL_ERR_OOM, "out of host memory") : cs;
    }
    for (int j = 0; j < st->n_mods; j++) {
        snprintf(mods[j].name, sizeof mods[j].name, "%s", st->mods[j].name);
        mods[j].in = st->mods[j].in;
        mods[j].out = st->mods[j].out;
        mods[j].A = host + st->off[2 * j];
        mods[j].B = host + st->off[2 * j + 1];
    }
    fl_peft_config pc;
    memset(&pc, 0, sizeof pc);
    pc.lora = *st->cfg;
    char abs[PATH_MAX];
    const char *b = base_model && base_model[0] && realpath(base_model, abs) ? abs : base_model; /* else a preset */
    if (b && strlen(b) >= sizeof pc.base_model) {
        free(mods);
        free(host);
        return fl_errorf(FL_ERR_INVALID, "%s: base model path too long for adapter_config.json: %s", dir, b);
    }
    if (b) memcpy(pc.base_model, b, strlen(b) + 1);
    pc.fan_in_fan_out = fl_arch_get(m->cfg.arch)->conv1d; /* PEFT's flag for GPT-2's Conv1D */
    pc.inference_mode = 1;
    pc.seq2seq = fl_model_is_s2s(&m->cfg);
    fl_status s = fl_peft_save(dir, &pc, mods, st->n_mods);
    free(mods);
    free(host);
    return s;
}

/* The running loss's window (fl_train_state.loss_window) as metadata text: its last min(n, size) losses, oldest
 * first, comma-separated, exactly ("%.17g"); *text malloc'd, NULL when there is none or it is empty. */
static fl_status window_text(const fl_train_state *st, char **text) {
    *text = NULL;
    const long S = st->loss_window_size, n = st->loss_window_n;
    if (!st->loss_window || S <= 0 || n <= 0) return FL_OK;
    const long cnt = n < S ? n : S;
    char *t = malloc((size_t)cnt * 32 + 1);
    if (!t) return fl_errorf(FL_ERR_OOM, "out of host memory");
    size_t o = 0;
    for (long p = n - cnt; p < n; p++)
        o += (size_t)snprintf(t + o, 32, "%s%.17g", p > n - cnt ? "," : "", st->loss_window[p % S]);
    *text = t;
    return FL_OK;
}

/* The training state's metadata (format, optimizer, counters, data position, loss scale, the running loss's window)
 * into keys/vals (storage v; win: the window's text, window_text's); returns how many. numel: the trainable
 * elements. */
#define STATE_META_MAX 28
static int state_meta(const char *format, const fl_optimizer *o, const fl_train_state *st, const fl_run_config *cfg,
                      size_t numel, const char *win, char v[][64], const char **keys, const char **vals) {
    int k = 0;
#define META(key, ...) (keys[k] = key, snprintf(v[k], 64, __VA_ARGS__), vals[k] = v[k], k++)
    META("format", "%s", format);
    META("version", "1");
    META("optimizer", "%s", o ? fl_optim_name(o->cfg.kind) : "none");
    META("optimizer_step", "%d", o ? o->step : 0);
    META("step", "%ld", st->step);
    META("iter", "%ld", st->iter);
    META("loader_seed", "%llu", (unsigned long long)st->loader.seed);
    META("loader_epoch", "%lld", (long long)st->loader.epoch);
    META("loader_pos", "%lld", (long long)st->loader.pos);
    META("tokens_real", "%lld", st->tokens_real);
    META("tokens_prompt", "%lld", st->tokens_prompt);
    META("tokens_padded", "%lld", st->tokens_padded);
    META("train_seconds", "%.17g", st->train_seconds);
    META("flops", "%.17g", st->flops);
    META("world_size", "%d", cfg ? cfg->devices * cfg->num_nodes : 1);
    META("numel", "%lld", (long long)numel);
    if (o && o->amp.on) { /* fp16 loss scaler: resumed exactly */
        META("loss_scale", "%.9g", (double)o->amp.ls.scale);
        META("loss_scale_growth_tracker", "%d", o->amp.ls.growth_tracker);
    }
    if (st->dv_set) { /* the divergence detector's window: exactly (the EMA's bits in hex floats; NaN before a loss) */
        META("diverge_ema", "%a", st->dv_ema);
        META("diverge_above", "%d", st->dv_above);
        META("diverge_since", "%ld", st->dv_since);
        META("diverge_last_good", "%ld", st->dv_last_good);
    }
    if (st->loss_window && st->loss_window_size > 0) {
        META("loss_window_n", "%ld", st->loss_window_n);
        if (win) keys[k] = "loss_window", vals[k++] = win;
    }
#undef META
    return k;
}

fl_status fl_ckpt_write_state_meta(const char *path, const char *format, const fl_optimizer *o,
                                   const fl_train_state *st, const fl_run_config *cfg, size_t numel,
                                   const char *const *xk, const char *const *xv, int nx) {
    char v[STATE_META_MAX][64], *win = NULL;
    const char **keys = malloc((size_t)(STATE_META_MAX + nx) * sizeof *keys);
    const char **vals = malloc((size_t)(STATE_META_MAX + nx) * sizeof *vals);
    fl_status s = keys && vals ? window_text(st, &win) : fl_errorf(FL_ERR_OOM, "%s: out of host memory", path);
    if (s == FL_OK) {
        int k = state_meta(format, o, st, cfg, numel, win, v, keys, vals);
        for (int i = 0; i < nx; i++) keys[k] = xk[i], vals[k++] = xv[i];
        s = fl_st_write(path, NULL, 0, keys, vals, k);
    }
    free(win);
    free(keys);
    free(vals);
    return s;
}

/* The training state file: the optimizer's tensors (given: produced while written; NULL: o's own
 * buffers) and the metadata. */
static fl_status write_state(const char *dir, const fl_model *m, const fl_optimizer *o, const fl_train_state *st,
                             const fl_run_config *cfg, const fl_st_write_tensor *given, int n_given) {
    char path[FL_CFG_PATH + 64];
    FL_TRY(fl_fs_join(path, sizeof path, dir, STATE_FILE));
    fl_st_write_tensor t[8];
    int nt = 0;
    if (n_given < 0 || n_given > 4) return fl_errorf(FL_ERR_INVALID, "%s: %d state tensors", path, n_given);
    /* the trainable parameters: all of them, or the LoRA adapters (base frozen) */
    fl_lora_adapters ad;
    const int lora = fl_model_lora_adapters(m, &ad);
    int64_t n = (int64_t)(lora ? ad.numel : m->layout.numel);
    if (lora) t[nt++] = (fl_st_write_tensor){"lora.params", FL_F32, 1, {n}, ad.params, FL_F32, 0, NULL, NULL, m->be, NULL};
    fl_dtype sd = o ? o->cfg.state_dtype : FL_F32;
    fl_optim_state_src src[2]; /* NVMe offload: the state streams from its files, a slice at a time */
    const size_t es = fl_dtype_size(sd);
    if (given) {
        for (int i = 0; i < n_given; i++) t[nt++] = given[i];
    } else if (o && o->st.m) {
        t[nt] = (fl_st_write_tensor){"optimizer.exp_avg", sd, 1, {n}, NULL, sd, 0, NULL, NULL, NULL, NULL};
        fl_optim_state_source(o, &t[nt++], o->st.m, es, &src[0]);
        t[nt] = (fl_st_write_tensor){"optimizer.exp_avg_sq", sd, 1, {n}, NULL, sd, 0, NULL, NULL, NULL, NULL};
        fl_optim_state_source(o, &t[nt++], o->st.v, es, &src[1]);
    } else if (o && o->st.buf) {
        t[nt] = (fl_st_write_tensor){"optimizer.momentum_buffer", sd, 1, {n}, NULL, sd, 0, NULL, NULL, NULL, NULL};
        fl_optim_state_source(o, &t[nt++], o->st.buf, es, &src[0]);
    } else if (o && o->q8.state) {
        /* block-wise 8-bit state of every tensor, bound in layout order: one raw blob */
        t[nt++] = (fl_st_write_tensor){"optimizer.state8", FL_U8, 1, {(int64_t)o->q8.state_bytes}, o->q8.state, FL_U8, 0, NULL, NULL, m->be, NULL};
    }
    char v[STATE_META_MAX][64], *win = NULL;
    const char *keys[STATE_META_MAX], *vals[STATE_META_MAX];
    FL_TRY(window_text(st, &win));
    int k = state_meta("fitllm-training-state", o, st, cfg, (size_t)n, win, v, keys, vals);
    fl_status s = fl_st_write(path, t, nt, keys, vals, k);
    free(win);
    return s;
}

static void remove_tree(const char *dir) { fl_fs_remove_dir(dir); }

int fl_ckpt_remove_run(const char *out_dir, char *said, size_t n) {
    int k = 0;
    size_t o = 0;
    if (n) said[0] = 0;
    DIR *d = opendir(out_dir);
    if (!d) return 0;
    struct dirent *e;
    char p[FL_CFG_PATH + 300];
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, "step-", 5) && strcmp(e->d_name, "final") && strcmp(e->d_name, FL_CKPT_BASE)) continue;
        snprintf(p, sizeof p, "%s/%s", out_dir, e->d_name);
        if (!fl_fs_is_dir(p)) continue;
        remove_tree(p);
        k++;
        if (o < n) o += (size_t)snprintf(said + o, n - o, "%s%s", o ? ", " : "", e->d_name);
    }
    closedir(d);
    return k;
}

void fl_ckpt_clean_tmp(const char *out_dir) {
    DIR *d = opendir(out_dir);
    if (!d) return;
    struct dirent *e;
    char p[FL_CFG_PATH + 300];
    while ((e = readdir(d)) != NULL)
        if (!strncmp(e->d_name, TMP_PREFIX, strlen(TMP_PREFIX)) || strstr(e->d_name, ".trash-")) {
            snprintf(p, sizeof p, "%s/%s", out_dir, e->d_name);
            remove_tree(p);
        }
    closedir(d);
}

static fl_status save(const char *out_dir, const char *name, const fl_model *m, const fl_optimizer *o,
                      const fl_train_state *st, const fl_run_config *cfg, const char *tokenizer_src,
                      const fl_st_write_tensor *model, const fl_st_write_tensor *state, int n_state) {
    char tmp[FL_CFG_PATH + 300], dst[FL_CFG_PATH + 300], p[FL_CFG_PATH + 400];
    if (mkdir(out_dir, 0755) != 0 && errno != EEXIST)
        return fl_errorf(FL_ERR_IO, "%s: cannot create output folder: %s", out_dir, strerror(errno));
    snprintf(tmp, sizeof tmp, "%s/" TMP_PREFIX "%s-%d", out_dir, name, (int)getpid());
    snprintf(dst, sizeof dst, "%s/%s", out_dir, name);
    remove_tree(tmp);
    fl_fs_tmp_track(tmp); /* a stop by a signal removes it (the CLI) */
    /* the folder first: the savers below write into it in place (else each would build its own X.tmp-PID inside) */
    fl_status s = mkdir(tmp, 0755) == 0 ? FL_OK : fl_errorf(FL_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
    char base_dir[FL_CFG_PATH + 300];
    const char *base = cfg ? fl_ckpt_adapter_base(out_dir, cfg, base_dir, sizeof base_dir) : NULL;
    if (s != FL_OK) {
    } else if (m->lora && o) {
        /* a LoRA training checkpoint: the base is frozen and stays in checkpoint_dir (random
         * weights: in out_dir/base, fl_ckpt_save_base), so only
         * the training state (adapters included) and the PEFT adapter, so that merge_lora,
         * generate and PEFT use this step without waiting for final/. No config.json: as in
         * PEFT's checkpoint-N/ folders; transformers takes a folder holding one for a full
         * model and would not load the base that adapter_config.json names. */
        s = fl_ckpt_save_adapter(m, tmp, base);
    } else if (model) { /* produced tensor by tensor as they are written */
        s = fl_hf_save_tensors(tmp, &m->cfg, &m->layout, model);
    } else {
        s = fl_hf_save_model(m, tmp); /* config.json + model.safetensors, fsynced */
        if (s == FL_OK && m->lora) { /* LoRA final/: the merged model + adapter/, committed together;
                                      * adapter/ with the tokenizer too, usable on its own */
            snprintf(p, sizeof p, "%s/adapter", tmp);
            s = fl_ckpt_save_adapter(m, p, base);
            if (s == FL_OK) s = fl_io_write_tokenizer(tokenizer_src, p, NULL);
        }
    }
    if (s == FL_OK && st) s = write_state(tmp, m, o, st, cfg, state, n_state);
    if (s == FL_OK && cfg) s = fl_ckpt_write_hparams(tmp, cfg);
    /* every checkpoint carries the run's tokenizer (NULL: the built-in bytes, as tokenizer.json) */
    if (s == FL_OK) s = fl_io_write_tokenizer(tokenizer_src, tmp, NULL);
    if (s == FL_OK) s = fl_ckpt_commit(out_dir, name, tmp);
    if (s != FL_OK) remove_tree(tmp);
    fl_fs_tmp_untrack(tmp);
    return s == FL_OK ? FL_OK : fl_error_prefix(s, "saving checkpoint %s", dst);
}

const char *fl_ckpt_adapter_base(const char *out_dir, const fl_run_config *cfg, char *buf, size_t n) {
    snprintf(buf, n, "%s/" FL_CKPT_BASE, out_dir);
    return fl_ckpt_is_committed(buf) ? buf : cfg->checkpoint_dir;
}

fl_status fl_ckpt_save_base(const char *out_dir, const fl_model *m, const char *tokenizer_src) {
    char tmp[FL_CFG_PATH + 300];
    FL_TRY(fl_fs_mkdir_p(out_dir));
    snprintf(tmp, sizeof tmp, "%s/" TMP_PREFIX FL_CKPT_BASE "-%d", out_dir, (int)getpid());
    remove_tree(tmp);
    fl_fs_tmp_track(tmp); /* a stop by a signal removes it (the CLI) */
    /* the weights as the model holds them now: a LoRA model's base (not merged yet; 4-bit dequantized) */
    fl_status s = mkdir(tmp, 0755) == 0 ? FL_OK : fl_errorf(FL_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
    if (s == FL_OK) s = fl_hf_save_model(m, tmp);
    if (s == FL_OK) s = fl_io_write_tokenizer(tokenizer_src, tmp, NULL);
    if (s == FL_OK) s = fl_ckpt_commit(out_dir, FL_CKPT_BASE, tmp);
    if (s != FL_OK) remove_tree(tmp);
    fl_fs_tmp_untrack(tmp);
    return s == FL_OK ? FL_OK : fl_error_prefix(s, "saving the base model to %s/" FL_CKPT_BASE, out_dir);
}

fl_status fl_ckpt_save(const char *out_dir, const char *name, const fl_model *m, const fl_optimizer *o,
                       const fl_train_state *st, const fl_run_config *cfg, const char *tokenizer_src) {
    return save(out_dir, name, m, o, st, cfg, tokenizer_src, NULL, NULL, 0);
}

fl_status fl_ckpt_save_streamed(const char *out_dir, const char *name, const fl_model *m, const fl_optimizer *o,
                                const fl_train_state *st, const fl_run_config *cfg, const char *tokenizer_src,
                                const fl_st_write_tensor *model, const fl_st_write_tensor *state, int n_state) {
    if ((model && m->lora) || (n_state > 0 && !state))
        return fl_errorf(FL_ERR_INVALID, "fl_ckpt_save_streamed: a LoRA model's weights are not streamed");
    return save(out_dir, name, m, o, st, cfg, tokenizer_src, model, state, n_state);
}

fl_status fl_ckpt_write_hparams(const char *dir, const fl_run_config *cfg) {
    char p[FL_CFG_PATH + 400];
    FL_TRY(fl_fs_join(p, sizeof p, dir, "hyperparameters.yaml"));
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return fl_errorf(FL_ERR_OOM, "%s: out of memory", p);
    fl_cfg_write_yaml(cfg, f);
    fclose(f);
    fl_status s = fl_fs_write_file_atomic(p, text, len);
    free(text);
    return s;
}

fl_status fl_ckpt_commit(const char *out_dir, const char *name, const char *tmp) {
    char dst[FL_CFG_PATH + 300], p[FL_CFG_PATH + 400];
    snprintf(dst, sizeof dst, "%s/%s", out_dir, name);
    fl_status s = FL_OK;
    fl_fs_sync_dir(tmp);
    /* Replace an existing checkpoint of the same name: move it aside first so
     * a crash between the renames leaves either the old or the new one. */
    char trash[FL_CFG_PATH + 320];
    snprintf(trash, sizeof trash, "%s/%s.trash-%d", out_dir, name, (int)getpid());
    int had_old = fl_fs_is_dir(dst);
    if (had_old && rename(dst, trash) != 0)
        s = fl_errorf(FL_ERR_IO, "%s: cannot move the previous checkpoint aside: %s", dst, strerror(errno));
    if (s == FL_OK && rename(tmp, dst) != 0) {
        s = fl_errorf(FL_ERR_IO, "%s: cannot rename %s into place: %s", dst, tmp, strerror(errno));
        if (had_old) rename(trash, dst);
    }
    if (s == FL_OK) {
        fl_fs_sync_dir(out_dir);
        snprintf(p, sizeof p, "%s/" MARKER, dst);
        s = fl_fs_write_file_atomic(p, "fitllm checkpoint v1\n", 21);
        fl_fs_sync_dir(dst);
        /* no marker (a full disk): the folder goes back to tmp, which the caller removes, and the previous one of
         * this name returns, so a failed save leaves nothing of itself */
        if (s != FL_OK) {
            if (rename(dst, tmp) == 0 && had_old) rename(trash, dst);
        } else if (had_old) {
            remove_tree(trash);
        }
    }
    return s;
}

int fl_ckpt_is_committed(const char *dir) {
    char p[FL_CFG_PATH + 512]; /* dir: up to out_dir + "/" + a folder name */
    snprintf(p, sizeof p, "%s/" MARKER, dir);
    return fl_fs_is_file(p);
}

fl_status fl_ckpt_find_latest(const char *out_dir, char *path, size_t n) {
    DIR *d = opendir(out_dir);
    if (!d) return fl_errorf(FL_ERR_NOT_FOUND, "%s: no such output folder", out_dir);
    struct dirent *e;
    long best = -1;
    char p[FL_CFG_PATH + 300];
    while ((e = readdir(d)) != NULL) {
        long step;
        char tail;
        if (sscanf(e->d_name, "step-%ld%c", &step, &tail) != 1) continue;
        snprintf(p, sizeof p, "%s/%s", out_dir, e->d_name);
        if (step > best && fl_ckpt_is_committed(p)) {
            best = step;
            snprintf(path, n, "%s", p);
        }
    }
    closedir(d);
    if (best < 0) return fl_errorf(FL_ERR_NOT_FOUND, "%s: no committed checkpoint (step-*/" MARKER ")", out_dir);
    return FL_OK;
}

static int cmp_long_desc(const void *a, const void *b) {
    long x = *(const long *)a, y = *(const long *)b;
    return (x < y) - (x > y);
}

void fl_ckpt_rotate(const char *out_dir, int keep) {
    if (keep <= 0) return;
    DIR *d = opendir(out_dir);
    if (!d) return;
    long steps[4096];
    int n = 0;
    struct dirent *e;
    char p[FL_CFG_PATH + 300];
    while ((e = readdir(d)) != NULL && n < 4096) {
        long step;
        char tail;
        if (sscanf(e->d_name, "step-%ld%c", &step, &tail) != 1) continue;
        snprintf(p, sizeof p, "%s/%s", out_dir, e->d_name);
        if (fl_ckpt_is_committed(p)) steps[n++] = step;
    }
    closedir(d);
    qsort(steps, (size_t)n, sizeof *steps, cmp_long_desc);
    for (int i = keep; i < n; i++) {
        /* un-commit first, so a crash mid-delete never leaves a resumable half */
        snprintf(p, sizeof p, "%s/step-%06ld/" MARKER, out_dir, steps[i]);
        unlink(p);
        snprintf(p, sizeof p, "%s/step-%06ld", out_dir, steps[i]);
        remove_tree(p);
    }
}

static const char *meta(const fl_st_file *f, const char *key) {
    for (int i = 0; i < f->n_meta; i++)
        if (!strcmp(f->meta_keys[i], key)) return f->meta_vals[i];
    return NULL;
}

fl_status fl_ckpt_load(const char *dir, fl_model *m, fl_optimizer *o, fl_train_state *st) {
    if (!fl_ckpt_is_committed(dir))
        return fl_errorf(FL_ERR_FORMAT, "%s: not a committed checkpoint (no " MARKER " file)", dir);
    if (fl_ckpt_is_sharded(dir)) /* the trainer reads those (fl_dp_ckpt_load) */
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: a sharded checkpoint: resume it with --resume, or consolidate it "
                         "with fitllm merge_shards %s", dir, dir);
    if (!m->lora) FL_TRY(fl_hf_load_weights(m, dir)); /* LoRA: the frozen base is the run's checkpoint_dir */
    char p[FL_CFG_PATH + 64];
    FL_TRY(fl_fs_join(p, sizeof p, dir, STATE_FILE));
    fl_st_file f;
    FL_TRY(fl_st_open(&f, p));
    fl_status s = FL_OK;
    const char *fmt = meta(&f, "format"), *numel = meta(&f, "numel");
    if (!fmt || strcmp(fmt, "fitllm-training-state"))
        s = fl_errorf(FL_ERR_FORMAT, "%s: not a fitllm training state", p);
    fl_lora_adapters ad;
    const int lora = fl_model_lora_adapters(m, &ad);
    size_t tn = lora ? ad.numel : m->layout.numel;
    if (s == FL_OK && (!numel || strtoull(numel, NULL, 10) != tn))
        s = numel ? fl_errorf(FL_ERR_INVALID, "%s: state is for %s trainable parameters, this run has %zu (another "
                              "model, or other LoRA settings: lora_r, the targets; resume with the checkpoint's)", p,
                              numel, tn)
                  : fl_errorf(FL_ERR_FORMAT, "%s: state has no trainable-parameter count", p);
    if (s == FL_OK && m->lora) {
        const fl_st_tensor *lt = fl_st_find(&f, "lora.params");
        if (!lt || lt->dtype != FL_F32 || lt->end - lt->begin != tn * sizeof(float))
            s = fl_errorf(FL_ERR_FORMAT, "%s: missing or mis-sized tensor lora.params (LoRA settings changed?)", p);
        else if (fl_dtype_first_nonfinite(lt->data, FL_F32, tn) >= 0)
            s = fl_errorf(FL_ERR_FORMAT, "%s: tensor 'lora.params' holds a non-finite value (inf/NaN) at element %lld: "
                          "the checkpoint was saved from a diverged run", p, fl_dtype_first_nonfinite(lt->data, FL_F32, tn));
        else s = FL_RUN(m->be, to_device, ad.params, lt->data, tn * sizeof(float));
    }
    const char *opt = meta(&f, "optimizer");
    if (s == FL_OK && o && opt && strcmp(opt, fl_optim_name(o->cfg.kind)))
        s = fl_errorf(FL_ERR_INVALID, "%s: saved with optimizer %s, this run uses %s (--optimizer: resume with the "
                      "checkpoint's)", p, opt, fl_optim_name(o->cfg.kind));
    size_t es = o && o->cfg.state_dtype == FL_BF16 ? 2 : 4;
    fl_dtype sd = es == 2 ? FL_BF16 : FL_F32;
    struct { const char *name; void *dst; size_t bytes; fl_dtype dt; } want[4] = {
        {"optimizer.exp_avg", o ? o->st.m : NULL, tn * es, sd},
        {"optimizer.exp_avg_sq", o ? o->st.v : NULL, tn * es, sd},
        {"optimizer.momentum_buffer", o ? o->st.buf : NULL, tn * es, sd},
        {"optimizer.state8", o ? o->q8.state : NULL, o ? o->q8.state_bytes : 0, FL_U8}};
    const fl_param_provider *pp = fl_model_provider(m);
    const int pieces8 = pp && !m->lora && o && o->q8.state; /* FULL_SHARD 8-bit: the file is the whole state */
    if (pieces8) want[3].bytes = fl_optim_state_bytes_layout(&o->cfg, &m->layout);
    /* ZeRO-1/2 8-bit (a chunk of the trainable elements): the file is the whole state too */
    const int zero8 = !pieces8 && o && o->q8.state && (o->shard.off != 0 || o->shard.len != tn);
    if (zero8) want[3].bytes = fl_zero8_full_bytes(o);
    for (int i = 0; s == FL_OK && i < 4; i++) {
        if (!want[i].dst) continue;
        const fl_st_tensor *t = fl_st_find(&f, want[i].name);
        if (!t) { s = fl_errorf(FL_ERR_NOT_FOUND, "%s: missing tensor %s", p, want[i].name); break; }
        if (t->dtype != want[i].dt || t->end - t->begin != want[i].bytes) {
            s = fl_errorf(FL_ERR_FORMAT, "%s: tensor %s has the wrong size or dtype (optimizer settings changed?)", p,
                          want[i].name);
            break;
        }
        if (pp && !m->lora && i < 3) { /* sharded (FSDP): this rank's pieces of the flat state, read alone, into
                                         * the state's memory (offload: the host tier, NVMe: its files) */
            for (int g = 0; s == FL_OK && g < m->layout.n_groups; g++)
                s = fl_optim_state_write(o, (char *)want[i].dst + pp->shard_off[g] * es,
                                         (const char *)t->data + pp->flat_off[g] * es, pp->len[g] * es);
        } else if (i == 3 && zero8) { /* this rank's pieces, out of the mapped file (host memory) */
            s = fl_zero8_take(o, t->data);
        } else if (i == 3 && pieces8) { /* this rank's pieces of every tensor's state: assembled in host memory
                                          * (outside the pool: I/O staging), then to the backend's */
            void *h = calloc(1, o->q8.state_bytes + 4);
            s = h ? fl_optim_8bit_fsdp_copy(&m->layout, o->q8.p_a, o->q8.p_n, h, (void *)t->data, 0)
                  : fl_errorf(FL_ERR_OOM, "%s: out of host memory", p);
            if (s == FL_OK && o->q8.state_bytes) s = FL_RUN(m->be, to_device, o->q8.state, h, o->q8.state_bytes);
            free(h);
        } else if (i < 3 && (o->shard.off != 0 || o->shard.len != tn)) { /* ZeRO: this rank's chunk, read alone */
            s = fl_optim_state_write(o, want[i].dst, (const char *)t->data + o->shard.off * es, o->shard.len * es);
        } else if (i < 3) { /* the state's memory (the device's; CPU offload: the host tier; NVMe: its files) */
            s = fl_optim_state_write(o, want[i].dst, t->data, want[i].bytes);
        } else {
            s = FL_RUN(m->be, to_device, want[i].dst, t->data, want[i].bytes);
        }
    }
    if (s == FL_OK) s = fl_ckpt_read_state_meta(&f, p, o, st);
    fl_st_close(&f);
    return s;
}

/* The running loss's window from the metadata into st's buffer (its size kept): the same ring when the size is the
 * saved one, else the last losses that fit (pushed anew when fewer than the window's were saved); none saved: empty. */
static fl_status window_read(const fl_st_file *f, const char *p, fl_train_state *st) {
    const long S = st->loss_window_size;
    const char *nx = meta(f, "loss_window_n"), *vx = meta(f, "loss_window");
    if (!st->loss_window || S <= 0) return FL_OK;
    memset(st->loss_window, 0, (size_t)S * sizeof *st->loss_window);
    if (!nx) return FL_OK; /* an older checkpoint: an empty window */
    char *end;
    const long n = strtol(nx, &end, 10);
    long cnt = vx && *vx ? 1 : 0;
    for (const char *q = vx; cnt && *q; q++) cnt += *q == ',';
    if (*end || n < 0 || cnt > n) return fl_errorf(FL_ERR_FORMAT, "%s: malformed metadata 'loss_window_n'", p);
    double *v = malloc((size_t)cnt * sizeof *v + 1);
    if (!v) return fl_errorf(FL_ERR_OOM, "%s: out of host memory", p);
    const char *q = vx;
    for (long i = 0; i < cnt; i++) {
        v[i] = strtod(q, &end);
        if (end == q || (*end != ',' && *end != 0) || (*end == 0 && i != cnt - 1)) {
            free(v);
            return fl_errorf(FL_ERR_FORMAT, "%s: malformed metadata 'loss_window' (value %ld)", p, i + 1);
        }
        q = end + (*end == ',');
    }
    const long lim = n < S ? n : S;
    if (cnt >= lim) { /* the last lim losses where the ring of S holds them */
        for (long i = 0; i < lim; i++) st->loss_window[(n - lim + i) % S] = v[cnt - lim + i];
        st->loss_window_n = n;
    } else { /* fewer saved than this window holds (a smaller one): those, pushed anew */
        for (long i = 0; i < cnt; i++) st->loss_window[i] = v[i];
        st->loss_window_n = cnt;
    }
    free(v);
    return FL_OK;
}

fl_status fl_ckpt_read_state_meta(const fl_st_file *f, const char *p, fl_optimizer *o, fl_train_state *st) {
    fl_status s = FL_OK;
    {
        const char *need[] = {"step", "iter", "loader_seed", "loader_epoch", "loader_pos", "optimizer_step"};
        for (size_t i = 0; i < sizeof need / sizeof need[0]; i++)
            if (!meta(f, need[i])) { s = fl_errorf(FL_ERR_FORMAT, "%s: missing metadata '%s'", p, need[i]); break; }
    }
    if (s == FL_OK) {
        double *win = st->loss_window; /* the caller's buffer */
        const int ws = st->loss_window_size;
        memset(st, 0, sizeof *st);
        st->loss_window = win, st->loss_window_size = ws;
        st->step = strtol(meta(f, "step"), NULL, 10);
        st->iter = strtol(meta(f, "iter"), NULL, 10);
        st->loader.seed = strtoull(meta(f, "loader_seed"), NULL, 10);
        st->loader.epoch = strtoll(meta(f, "loader_epoch"), NULL, 10);
        st->loader.pos = strtoll(meta(f, "loader_pos"), NULL, 10);
        const char *x;
        if ((x = meta(f, "tokens_real"))) st->tokens_real = strtoll(x, NULL, 10);
        if ((x = meta(f, "tokens_prompt"))) st->tokens_prompt = strtoll(x, NULL, 10);
        if ((x = meta(f, "tokens_padded"))) st->tokens_padded = strtoll(x, NULL, 10);
        if ((x = meta(f, "train_seconds"))) st->train_seconds = strtod(x, NULL);
        if ((x = meta(f, "flops"))) st->flops = strtod(x, NULL);
        if (o) o->step = (int)strtol(meta(f, "optimizer_step"), NULL, 10);
        if (o && o->amp.on && (x = meta(f, "loss_scale"))) {
            o->amp.ls.scale = strtof(x, NULL);
            if ((x = meta(f, "loss_scale_growth_tracker"))) o->amp.ls.growth_tracker = (int)strtol(x, NULL, 10);
        }
        s = window_read(f, p, st);
    }
    const char *dv[4] = {meta(f, "diverge_ema"), meta(f, "diverge_above"), meta(f, "diverge_since"),
                         meta(f, "diverge_last_good")};
    if (s == FL_OK && dv[0] && dv[1] && dv[2] && dv[3]) { /* none: an older checkpoint, the detector starts afresh */
        char *e[4];
        st->dv_ema = strtod(dv[0], &e[0]);
        st->dv_above = (int)strtol(dv[1], &e[1], 10);
        st->dv_since = strtol(dv[2], &e[2], 10);
        st->dv_last_good = strtol(dv[3], &e[3], 10);
        for (int i = 0; i < 4 && s == FL_OK; i++)
            if (e[i] == dv[i] || *e[i])
                s = fl_errorf(FL_ERR_FORMAT, "%s: malformed metadata '%s'", p,
                              (const char *[]){"diverge_ema", "diverge_above", "diverge_since", "diverge_last_good"}[i]);
        st->dv_set = s == FL_OK;
    }
    return s;
}

/* Alpaca and JSON datasets (LitGPT litgpt/data/alpaca.py, json_data.py): the
 * source files of a config, and records -> train/val SFT samples. A single
 * file is split with torch's random_split(seed); a folder supplies train.json
 * (or .jsonl) and val.json (or .jsonl). */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "data-impl.h"
#include "core/fs.h"

fl_status fl_data_file_read(const char *path, fl_data_file *out) {
    memset(out, 0, sizeof *out);
    if (snprintf(out->path, sizeof out->path, "%s", path) >= (int)sizeof out->path)
        return fl_errorf(FL_ERR_INVALID, "%s: path too long", path);
    FILE *f = fopen(path, "rb");
    if (!f) return fl_errorf(errno == ENOENT ? FL_ERR_NOT_FOUND : FL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    fl_status s = FL_OK;
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap + 1);
    while (buf) {
        if (len == cap) {
            char *nb = realloc(buf, cap * 2 + 1);
            if (!nb) break;
            buf = nb;
            cap *= 2;
        }
        size_t r = fread(buf + len, 1, cap - len, f);
        len += r;
        if (r == 0) break;
    }
    if (!buf) s = fl_errorf(FL_ERR_OOM, "%s: out of memory", path);
    else if (ferror(f)) s = fl_errorf(FL_ERR_IO, "%s: read failed", path);
    else if (len == cap && !feof(f)) s = fl_errorf(FL_ERR_OOM, "%s: out of memory", path);
    fclose(f);
    if (s != FL_OK) {
        free(buf);
        return s;
    }
    buf[len] = '\0';
    out->data = buf;
    out->len = len;
    return FL_OK;
}

fl_status fl_data_files_add(fl_data_files *fs, const char *path) {
    if (fs->n == fs->cap) {
        size_t c = fs->cap ? fs->cap * 2 : 8;
        fl_data_file *f = realloc(fs->f, c * sizeof *f);
        if (!f) return fl_errorf(FL_ERR_OOM, "data: out of memory");
        fs->f = f;
        fs->cap = c;
    }
    FL_TRY(fl_data_file_read(path, &fs->f[fs->n]));
    fs->n++;
    return FL_OK;
}

void fl_data_files_free(fl_data_files *fs) {
    for (size_t i = 0; i < fs->n; i++) free(fs->f[i].data);
    free(fs->f);
    memset(fs, 0, sizeof *fs);
}

/* ---- sources ----------------------------------------------------------------------- */

static fl_status find_split_file(const char *dir, const char *name, char *buf, size_t n) {
    static const char *const suffixes[] = {".json", ".jsonl"};
    char fname[64];
    for (int i = 0; i < 2; i++) {
        snprintf(fname, sizeof fname, "%s%s", name, suffixes[i]);
        FL_TRY(fl_fs_join(buf, n, dir, fname));
        if (fl_fs_is_file(buf)) return FL_OK;
    }
    return fl_errorf(FL_ERR_NOT_FOUND, "%s: folder has no %s.json or %s.jsonl (a JSON dataset folder needs train.json and val.json)",
                     dir, name, name);
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Sorted *.txt regular files of dir (like sorted(glob(dir/"*.txt"))), or dir itself when it is a
 * file (fitllm: one text file for a split, which LitGPT's folders cannot name). */
static fl_status add_txt_files(const char *dir, fl_data_files *fs, size_t *count) {
    *count = 0;
    if (fl_fs_is_file(dir)) {
        FL_TRY(fl_data_files_add(fs, dir));
        *count = 1;
        return FL_OK;
    }
    if (!fl_fs_is_dir(dir))
        return fl_errorf(FL_ERR_NOT_FOUND, "%s: TextFiles data folder (or .txt file) does not exist", dir);
    DIR *d = opendir(dir);
    if (!d) return fl_errorf(FL_ERR_IO, "%s: cannot open folder: %s", dir, strerror(errno));
    char **names = NULL;
    size_t n = 0, cap = 0;
    fl_status s = FL_OK;
    struct dirent *e;
    char path[4200];
    while ((e = readdir(d)) != NULL && s == FL_OK) {
        size_t l = strlen(e->d_name);
        if (e->d_name[0] == '.' || l < 4 || strcmp(e->d_name + l - 4, ".txt") != 0) continue;
        if (fl_fs_join(path, sizeof path, dir, e->d_name) != FL_OK || !fl_fs_is_file(path)) continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 16;
            char **nn = realloc(names, cap * sizeof *nn);
            if (!nn) { s = fl_errorf(FL_ERR_OOM, "%s: out of memory", dir); break; }
            names = nn;
        }
        names[n] = strdup(e->d_name);
        if (!names[n]) s = fl_errorf(FL_ERR_OOM, "%s: out of memory", dir);
        else n++;
    }
    closedir(d);
    if (s == FL_OK && n > 1) qsort(names, n, sizeof *names, cmp_str);
    for (size_t i = 0; i < n && s == FL_OK; i++) {
        s = fl_fs_join(path, sizeof path, dir, names[i]);
        if (s == FL_OK) s = fl_data_files_add(fs, path);
    }
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
    if (s == FL_OK && n == 0) s = fl_errorf(FL_ERR_NOT_FOUND, "%s: no .txt files found", dir);
    if (s == FL_OK) *count = n;
    return s;
}

fl_status fl_data_sources(const fl_data_config *cfg, fl_data_files *fs, size_t *n_train_files) {
    const char *kind = fl_data_kind_name(cfg->kind);
    *n_train_files = 0;
    if (cfg->kind == FL_DATA_ALPACA || cfg->kind == FL_DATA_JSON) {
        const char *p = cfg->json_path;
        if (!p[0])
            return fl_errorf(FL_ERR_INVALID, "data %s: json_path is not set (a .json/.jsonl file or a folder with "
                                             "train.json and val.json; fitllm does not download datasets)", kind);
        if (fl_fs_is_dir(p)) {
            char tr[4200], va[4200];
            FL_TRY(find_split_file(p, "train", tr, sizeof tr));
            FL_TRY(find_split_file(p, "val", va, sizeof va));
            FL_TRY(fl_data_files_add(fs, tr));
            FL_TRY(fl_data_files_add(fs, va));
            *n_train_files = 1;
            return FL_OK;
        }
        if (!fl_fs_is_file(p))
            return fl_errorf(FL_ERR_NOT_FOUND, "%s: does not exist (data %s json_path must be a .json/.jsonl file or a "
                                               "folder with train.json and val.json)", p, kind);
        FL_TRY(fl_data_files_add(fs, p));
        *n_train_files = 1;
        return FL_OK;
    }
    if (cfg->kind == FL_DATA_TEXTFILES) {
        if (!cfg->train_data_path[0]) return fl_errorf(FL_ERR_INVALID, "data TextFiles: train_data_path is not set");
        size_t nt = 0, nv = 0;
        FL_TRY(add_txt_files(cfg->train_data_path, fs, &nt));
        if (cfg->val_data_path[0]) {
            FL_TRY(add_txt_files(cfg->val_data_path, fs, &nv));
            *n_train_files = nt;
            return FL_OK;
        }
        /* one file: fl_data_build_textfiles holds out its last val_split_fraction of blocks */
        if (nt == 1) {
            *n_train_files = 1;
            return FL_OK;
        }
        /* LitGPT: val_files, *train_files = sorted(train files); the run names the file */
        fl_data_file first = fs->f[0];
        memmove(fs->f, fs->f + 1, (fs->n - 1) * sizeof *fs->f);
        fs->f[fs->n - 1] = first;
        *n_train_files = nt - 1;
        return FL_OK;
    }
    return FL_OK;
}

/* ---- build ---------------------------------------------------------------------------- */

fl_status fl_data_build_json(fl_dataset *d, const fl_data_config *cfg, const fl_tokenizer *tok,
                             const fl_data_files *fs, size_t n_train_files) {
    fl_data_records rs[2] = {{0}};
    size_t *perm = NULL;
    fl_status s = FL_OK;
    for (size_t i = 0; i < fs->n && i < 2 && s == FL_OK; i++) {
        s = fl_data_read_records(fs->f[i].data, fs->f[i].len, fs->f[i].path, &rs[i]);
        d->stats.n_warnings += rs[i].n_blank;
    }
    if (s == FL_OK && rs[0].n == 0)
        s = fl_errorf(FL_ERR_FORMAT, "%s: no records (empty dataset)", fs->f[0].path);
    if (s == FL_OK && fs->n == 1) {
        size_t n = rs[0].n, n_train, n_val;
        fl_data_split_lengths(n, cfg->val_split_fraction, &n_train, &n_val);
        s = fl_data_torch_randperm(cfg->seed, n, &perm);
        if (s == FL_OK)
            s = fl_data_sft_tokenize(&rs[0], perm, n_train, cfg, tok, &d->split[FL_SPLIT_TRAIN], &d->stats, fs->f[0].path);
        if (s == FL_OK)
            s = fl_data_sft_tokenize(&rs[0], perm + n_train, n_val, cfg, tok, &d->split[FL_SPLIT_VAL], &d->stats,
                                     fs->f[0].path);
        if (s == FL_OK && (n_train == 0 || n_val == 0)) d->stats.n_warnings++;
    } else if (s == FL_OK) {
        (void)n_train_files;
        s = fl_data_sft_tokenize(&rs[0], NULL, rs[0].n, cfg, tok, &d->split[FL_SPLIT_TRAIN], &d->stats, fs->f[0].path);
        if (s == FL_OK)
            s = fl_data_sft_tokenize(&rs[1], NULL, rs[1].n, cfg, tok, &d->split[FL_SPLIT_VAL], &d->stats, fs->f[1].path);
        if (s == FL_OK && rs[1].n == 0) d->stats.n_warnings++;
    }
    free(perm);
    fl_data_records_free(&rs[0]);
    fl_data_records_free(&rs[1]);
    return s;
}

/* Tokenizer files beside a model (save_pretrained's side files): detection and copying. */
#include "core/fs.h"
#include "fitllm/io.h"
#include "fitllm/tokenizer.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the public fault-injection hook (io.h) drives the file layer's */
void fl_io_fail_writes_after(long n) { fl_fs_fail_writes_after(n); }
long fl_io_writes_left(void) { return fl_fs_writes_left(); }

/* what save_pretrained writes beside the weights (tokenizer and generation settings), plus
 * llama2.c's tokenizer files */
static const char *const k_tok_files[] = {"tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                                          "special_tokens_map.json", "added_tokens.json", "vocab.json",
                                          "merges.txt", "chat_template.jinja", "generation_config.json",
                                          "tokenizer.bin", "tok512.bin"};

static fl_status copy_file(const char *src, const char *dst) {
    FILE *f = fopen(src, "rb");
    if (!f) return fl_errorf(FL_ERR_IO, "%s: cannot open: %s", src, strerror(errno));
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = n > 0 ? malloc((size_t)n) : NULL;
    if (n > 0 && (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n)) {
        fclose(f);
        free(buf);
        return fl_errorf(FL_ERR_IO, "%s: read failed", src);
    }
    fclose(f);
    fl_status s = fl_fs_write_file_atomic(dst, buf ? buf : "", n > 0 ? (size_t)n : 0);
    free(buf);
    return s;
}

/* llama2.c's tokenizer: tok<N>.bin (what fl_tok_load finds in a folder) */
static int is_tok_bin(const char *name) {
    size_t n = strlen(name);
    return n > 7 && !strncmp(name, "tok", 3) && !strcmp(name + n - 4, ".bin");
}

/* the first tok*.bin in dir into name (n bytes); 0 if none */
static int find_tok_bin(const char *dir, char *name, size_t n) {
    DIR *d = opendir(dir);
    struct dirent *e;
    char p[4096];
    int found = 0;
    while (d && !found && (e = readdir(d)))
        if (is_tok_bin(e->d_name) && fl_fs_join(p, sizeof p, dir, e->d_name) == FL_OK && fl_fs_is_file(p) &&
            strlen(e->d_name) < n) {
            memcpy(name, e->d_name, strlen(e->d_name) + 1);
            found = 1;
        }
    if (d) closedir(d);
    return found;
}

int fl_io_has_tokenizer(const char *dir) {
    static const char *const main_files[] = {"tokenizer.json", "tokenizer.model", "tokenizer.bin"};
    char p[4096], name[256];
    for (size_t i = 0; i < sizeof main_files / sizeof main_files[0]; i++)
        if (fl_fs_join(p, sizeof p, dir, main_files[i]) == FL_OK && fl_fs_is_file(p)) return 1;
    return find_tok_bin(dir, name, sizeof name);
}

fl_status fl_io_copy_tokenizer_files(const char *src_dir, const char *dst_dir, int *n_copied) {
    char p[4096], q[4096], name[256];
    int n = 0;
    if (n_copied) *n_copied = 0;
    for (size_t i = 0; i < sizeof k_tok_files / sizeof k_tok_files[0]; i++) {
        FL_TRY(fl_fs_join(p, sizeof p, src_dir, k_tok_files[i]));
        if (!fl_fs_is_file(p)) continue;
        FL_TRY(fl_fs_join(q, sizeof q, dst_dir, k_tok_files[i]));
        FL_TRY(copy_file(p, q));
        n++;
    }
    /* another llama2.c vocabulary size (tok4096.bin ...) when there is no tok512.bin */
    FL_TRY(fl_fs_join(p, sizeof p, src_dir, "tok512.bin"));
    if (!fl_fs_is_file(p) && find_tok_bin(src_dir, name, sizeof name)) {
        FL_TRY(fl_fs_join(p, sizeof p, src_dir, name));
        FL_TRY(fl_fs_join(q, sizeof q, dst_dir, name));
        FL_TRY(copy_file(p, q));
        n++;
    }
    if (n_copied) *n_copied = n;
    return FL_OK;
}

static fl_status write_text(const char *dst_dir, const char *name,
                            fl_status (*make)(char **, size_t *)) {
    char p[4096], *text = NULL;
    size_t len = 0;
    FL_TRY(fl_fs_join(p, sizeof p, dst_dir, name));
    FL_TRY(make(&text, &len));
    fl_status s = fl_fs_write_file_atomic(p, text, len);
    free(text);
    return s;
}

fl_status fl_io_write_tokenizer(const char *src, const char *dst_dir, int *n_written) {
    char p[4096], q[4096];
    int n = 0;
    if (n_written) *n_written = 0;
    if (!src) { /* the built-in byte tokenizer */
        FL_TRY(write_text(dst_dir, "tokenizer.json", fl_tok_builtin_bytes_hf_json));
        FL_TRY(write_text(dst_dir, "tokenizer_config.json", fl_tok_builtin_bytes_hf_config));
        if (n_written) *n_written = 2;
        return FL_OK;
    }
    if (fl_fs_is_dir(src)) return fl_io_copy_tokenizer_files(src, dst_dir, n_written);
    if (!fl_fs_is_file(src)) return fl_errorf(FL_ERR_NOT_FOUND, "%s: no such tokenizer file or folder", src);
    /* one tokenizer file: under the name fl_tok_load looks for in a folder, with the BOS/EOS side
     * files of its folder (not its other tokenizer files: they would be found first) */
    const char *base = strrchr(src, '/');
    base = base ? base + 1 : src;
    size_t bl = strlen(base);
    const char *as = bl > 5 && !strcmp(base + bl - 5, ".json") ? "tokenizer.json"
                     : bl > 6 && !strcmp(base + bl - 6, ".model") ? "tokenizer.model"
                     : is_tok_bin(base) ? base : "tokenizer.bin";
    FL_TRY(fl_fs_join(q, sizeof q, dst_dir, as));
    FL_TRY(copy_file(src, q));
    n++;
    static const char *const side[] = {"tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                                       "generation_config.json"};
    char dir[4096];
    snprintf(dir, sizeof dir, "%.*s", base == src ? 1 : (int)(base - src - 1), base == src ? "." : src);
    if (!dir[0]) snprintf(dir, sizeof dir, "/");
    for (size_t i = 0; i < sizeof side / sizeof side[0]; i++) {
        FL_TRY(fl_fs_join(p, sizeof p, dir, side[i]));
        if (!fl_fs_is_file(p)) continue;
        FL_TRY(fl_fs_join(q, sizeof q, dst_dir, side[i]));
        FL_TRY(copy_file(p, q));
        n++;
    }
    if (n_written) *n_written = n;
    return FL_OK;
}

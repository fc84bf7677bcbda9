/* Tokenizer files beside a model (save_pretrained's side files): detection and copying. */
#include "core/fs.h"
#include "fitllm/io.h"

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

int fl_io_has_tokenizer(const char *dir) {
    static const char *const main_files[] = {"tokenizer.json", "tokenizer.model", "tokenizer.bin", "tok512.bin"};
    char p[4096];
    for (size_t i = 0; i < sizeof main_files / sizeof main_files[0]; i++)
        if (fl_fs_join(p, sizeof p, dir, main_files[i]) == FL_OK && fl_fs_is_file(p)) return 1;
    return 0;
}

fl_status fl_io_copy_tokenizer_files(const char *src_dir, const char *dst_dir, int *n_copied) {
    char p[4096], q[4096];
    int n = 0;
    if (n_copied) *n_copied = 0;
    for (size_t i = 0; i < sizeof k_tok_files / sizeof k_tok_files[0]; i++) {
        FL_TRY(fl_fs_join(p, sizeof p, src_dir, k_tok_files[i]));
        if (!fl_fs_is_file(p)) continue;
        FL_TRY(fl_fs_join(q, sizeof q, dst_dir, k_tok_files[i]));
        FL_TRY(copy_file(p, q));
        n++;
    }
    if (n_copied) *n_copied = n;
    return FL_OK;
}


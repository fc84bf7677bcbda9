/* Filesystem helpers for the io module; see io-internal.h. */
#include "io-internal.h"

#include "fitllm/io.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Fault injection for tests: -1 = off, else writes left before one fails. */
static long g_fail_writes = -1;

void fl_io_fail_writes_after(long n) { g_fail_writes = n; }

int fl_io_write_fault(void) {
    if (g_fail_writes < 0) return 0;
    if (g_fail_writes == 0) { errno = ENOSPC; return 1; }
    g_fail_writes--;
    return 0;
}

int fl_io_write_all(int fd, const void *data, size_t n) {
    const char *c = data;
    while (n) {
        ssize_t w = fl_io_write_fault() ? -1 : write(fd, c, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

fl_status fl_io_mkdir_p(const char *path) {
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf)
        return fl_errorf(FL_ERR_INVALID, "%s: path too long", path);
    for (char *p = buf + 1; *p; p++)
        if (*p == '/') {
            *p = '\0';
            if (mkdir(buf, 0755) != 0 && errno != EEXIST)
                return fl_errorf(FL_ERR_IO, "%s: cannot create folder: %s", buf, strerror(errno));
            *p = '/';
        }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST)
        return fl_errorf(FL_ERR_IO, "%s: cannot create folder: %s", buf, strerror(errno));
    return FL_OK;
}

fl_status fl_io_join(char *buf, size_t n, const char *dir, const char *name) {
    size_t dl = strlen(dir);
    int slash = dl > 0 && dir[dl - 1] != '/';
    int w = snprintf(buf, n, "%s%s%s", dir, slash ? "/" : "", name);
    if (w < 0 || (size_t)w >= n) return fl_errorf(FL_ERR_INVALID, "%s/%s: path too long", dir, name);
    return FL_OK;
}

int fl_io_is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

int fl_io_is_file(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

fl_status fl_io_write_file_atomic(const char *path, const void *data, size_t len) {
    size_t pl = strlen(path);
    char *tmp = malloc(pl + 5);
    if (!tmp) return fl_errorf(FL_ERR_OOM, "%s: out of memory", path);
    memcpy(tmp, path, pl);
    memcpy(tmp + pl, ".tmp", 5);
    fl_status s = FL_OK;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        s = fl_errorf(FL_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
        free(tmp);
        return s;
    }
    if (fl_io_write_all(fd, data, len) != 0) s = fl_errorf(FL_ERR_IO, "%s: write failed: %s", tmp, strerror(errno));
    if (s == FL_OK && fsync(fd) != 0) s = fl_errorf(FL_ERR_IO, "%s: fsync failed: %s", tmp, strerror(errno));
    if (close(fd) != 0 && s == FL_OK) s = fl_errorf(FL_ERR_IO, "%s: close failed: %s", tmp, strerror(errno));
    if (s == FL_OK && rename(tmp, path) != 0) s = fl_errorf(FL_ERR_IO, "%s: rename to %s failed: %s", tmp, path, strerror(errno));
    if (s != FL_OK) unlink(tmp);
    free(tmp);
    return s;
}

/* depth bounds the recursion: fitllm's folders nest at most twice (final/adapter,
 * step-N/merged); deeper content is left in place (rmdir then fails, harmlessly). */
static void remove_dir_depth(const char *path, int depth) {
    DIR *d = opendir(path);
    if (d) {
        struct dirent *e;
        char buf[4096];
        while ((e = readdir(d)) != NULL) {
            if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
            if (fl_io_join(buf, sizeof buf, path, e->d_name) != FL_OK) continue;
            struct stat st;
            /* lstat: a symlink is unlinked, never followed */
            if (depth > 0 && lstat(buf, &st) == 0 && S_ISDIR(st.st_mode)) remove_dir_depth(buf, depth - 1);
            else unlink(buf);
        }
        closedir(d);
    }
    rmdir(path);
}

void fl_io_remove_dir(const char *path) { remove_dir_depth(path, 4); }

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
    fl_status s = fl_io_write_file_atomic(dst, buf ? buf : "", n > 0 ? (size_t)n : 0);
    free(buf);
    return s;
}

int fl_io_has_tokenizer(const char *dir) {
    static const char *const main_files[] = {"tokenizer.json", "tokenizer.model", "tokenizer.bin", "tok512.bin"};
    char p[4096];
    for (size_t i = 0; i < sizeof main_files / sizeof main_files[0]; i++)
        if (fl_io_join(p, sizeof p, dir, main_files[i]) == FL_OK && fl_io_is_file(p)) return 1;
    return 0;
}

fl_status fl_io_copy_tokenizer_files(const char *src_dir, const char *dst_dir, int *n_copied) {
    char p[4096], q[4096];
    int n = 0;
    if (n_copied) *n_copied = 0;
    for (size_t i = 0; i < sizeof k_tok_files / sizeof k_tok_files[0]; i++) {
        FL_TRY(fl_io_join(p, sizeof p, src_dir, k_tok_files[i]));
        if (!fl_io_is_file(p)) continue;
        FL_TRY(fl_io_join(q, sizeof q, dst_dir, k_tok_files[i]));
        FL_TRY(copy_file(p, q));
        n++;
    }
    if (n_copied) *n_copied = n;
    return FL_OK;
}

void fl_io_sync_dir(const char *path) {
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        (void)fsync(fd);
        close(fd);
    }
}

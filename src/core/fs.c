/* Filesystem helpers shared by every module that reads or writes files (io, data, train, lab):
 * see core/fs.h. */
#include "core/fs.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Fault injection for tests: -1 = off, else writes left before one fails. */
static long g_fail_writes = -1;

void fl_fs_fail_writes_after(long n) { g_fail_writes = n; }
long fl_fs_writes_left(void) { return g_fail_writes; }

int fl_fs_write_fault(void) {
    if (g_fail_writes < 0) return 0;
    if (g_fail_writes == 0) { errno = ENOSPC; return 1; }
    g_fail_writes--;
    return 0;
}

/* A testing aid: FITLLM_FAULT_WRITE_DELAY_MS=N makes every fl_fs_write_all wait N ms first (a slow disk: the tests
 * stop a write under way by a signal at a point they can see); read once. */
static void write_delay(void) {
    static long ms = -1;
    if (ms < 0) {
        const char *v = getenv("FITLLM_FAULT_WRITE_DELAY_MS");
        char *end = NULL;
        long x = v ? strtol(v, &end, 10) : 0;
        ms = v && end != v && !*end && x > 0 && x <= 60000 ? x : 0;
    }
    if (ms > 0) {
        struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
        while (nanosleep(&t, &t) != 0 && errno == EINTR) {}
    }
}

int fl_fs_write_all(int fd, const void *data, size_t n) {
    const char *c = data;
    write_delay();
    while (n) {
        ssize_t w = fl_fs_write_fault() ? -1 : write(fd, c, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

fl_status fl_fs_mkdir_p(const char *path) {
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

fl_status fl_fs_join(char *buf, size_t n, const char *dir, const char *name) {
    size_t dl = strlen(dir);
    int slash = dl > 0 && dir[dl - 1] != '/';
    int w = snprintf(buf, n, "%s%s%s", dir, slash ? "/" : "", name);
    if (w < 0 || (size_t)w >= n) return fl_errorf(FL_ERR_INVALID, "%s/%s: path too long", dir, name);
    return FL_OK;
}

int fl_fs_is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

int fl_fs_is_file(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static pthread_mutex_t g_tmp_lock = PTHREAD_MUTEX_INITIALIZER;
static char g_tmp_paths[FL_FS_TMP_SLOTS][4096];

void fl_fs_tmp_track(const char *path) {
    if (!path || !*path || strlen(path) >= sizeof g_tmp_paths[0]) return;
    pthread_mutex_lock(&g_tmp_lock);
    for (int i = 0; i < FL_FS_TMP_SLOTS; i++)
        if (!g_tmp_paths[i][0]) {
            strcpy(g_tmp_paths[i], path);
            break;
        }
    pthread_mutex_unlock(&g_tmp_lock);
}

void fl_fs_tmp_untrack(const char *path) {
    if (!path) return;
    pthread_mutex_lock(&g_tmp_lock);
    for (int i = 0; i < FL_FS_TMP_SLOTS; i++)
        if (!strcmp(g_tmp_paths[i], path)) {
            g_tmp_paths[i][0] = 0;
            break;
        }
    pthread_mutex_unlock(&g_tmp_lock);
}

int fl_fs_tmp_remove_all(void) {
    int n = 0;
    pthread_mutex_lock(&g_tmp_lock);
    for (int i = 0; i < FL_FS_TMP_SLOTS; i++) {
        const char *p = g_tmp_paths[i];
        struct stat st;
        if (!p[0] || lstat(p, &st) != 0) continue;
        n++;
        /* a writer still running may create a file in the folder meanwhile: a second pass */
        for (int k = 0; k < 2 && S_ISDIR(st.st_mode) && lstat(p, &st) == 0; k++) fl_fs_remove_dir(p);
        if (!S_ISDIR(st.st_mode)) unlink(p);
    }
    pthread_mutex_unlock(&g_tmp_lock);
    return n;
}

/* An existing path that is neither a regular file nor a folder (a device such as /dev/null or /dev/stdout, a FIFO, a
 * terminal, a socket), or a dangling link (create: its target made): written where it is. No fsync (a pipe or a terminal has none) and nothing removed on failure. */
static fl_status write_in_place(const char *path, const void *data, size_t len, int create) {
    int fd = open(path, O_WRONLY | O_TRUNC | O_CLOEXEC | (create ? O_CREAT : 0), 0644);
    if (fd < 0) return fl_errorf(FL_ERR_IO, "%s: cannot open for writing: %s", path, strerror(errno));
    fl_status s = FL_OK;
    if (fl_fs_write_all(fd, data, len) != 0) s = fl_errorf(FL_ERR_IO, "%s: write failed: %s", path, strerror(errno));
    if (close(fd) != 0 && s == FL_OK) s = fl_errorf(FL_ERR_IO, "%s: close failed: %s", path, strerror(errno));
    return s;
}

fl_status fl_fs_write_file_atomic(const char *path, const void *data, size_t len) {
    struct stat st;
    char *real = NULL;
    if (lstat(path, &st) == 0) {
        if (S_ISLNK(st.st_mode)) { /* the link's target is what gets replaced (the link kept); a dangling one: created */
            if (stat(path, &st) != 0) return write_in_place(path, data, len, 1);
            if (S_ISREG(st.st_mode) && !(real = realpath(path, NULL)))
                return fl_errorf(FL_ERR_IO, "%s: cannot resolve the link: %s", path, strerror(errno));
        }
        if (S_ISDIR(st.st_mode)) return fl_errorf(FL_ERR_IO, "%s: is a folder, not a file", path);
        if (!S_ISREG(st.st_mode)) return write_in_place(path, data, len, 0);
    }
    const char *target = real ? real : path;
    size_t pl = strlen(target);
    char *tmp = malloc(pl + 5);
    if (!tmp) {
        free(real);
        return fl_errorf(FL_ERR_OOM, "%s: out of memory", path);
    }
    memcpy(tmp, target, pl);
    memcpy(tmp + pl, ".tmp", 5);
    fl_status s = FL_OK;
    fl_fs_tmp_track(tmp);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        s = fl_errorf(FL_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
        fl_fs_tmp_untrack(tmp);
        free(tmp);
        free(real);
        return s;
    }
    if (fl_fs_write_all(fd, data, len) != 0) s = fl_errorf(FL_ERR_IO, "%s: write failed: %s", tmp, strerror(errno));
    if (s == FL_OK && fsync(fd) != 0) s = fl_errorf(FL_ERR_IO, "%s: fsync failed: %s", tmp, strerror(errno));
    if (close(fd) != 0 && s == FL_OK) s = fl_errorf(FL_ERR_IO, "%s: close failed: %s", tmp, strerror(errno));
    if (s == FL_OK && rename(tmp, target) != 0)
        s = fl_errorf(FL_ERR_IO, "%s: rename to %s failed: %s", tmp, target, strerror(errno));
    if (s != FL_OK) unlink(tmp);
    fl_fs_tmp_untrack(tmp);
    free(tmp);
    free(real);
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
            if (fl_fs_join(buf, sizeof buf, path, e->d_name) != FL_OK) continue;
            struct stat st;
            /* lstat: a symlink is unlinked, never followed */
            if (depth > 0 && lstat(buf, &st) == 0 && S_ISDIR(st.st_mode)) remove_dir_depth(buf, depth - 1);
            else unlink(buf);
        }
        closedir(d);
    }
    rmdir(path);
}

void fl_fs_remove_dir(const char *path) { remove_dir_depth(path, 4); }

void fl_fs_sync_dir(const char *path) {
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        (void)fsync(fd);
        close(fd);
    }
}

fl_status fl_fs_read_file(const char *path, size_t max_bytes, char **out, size_t *len) {
    *out = NULL;
    *len = 0;
    if (fl_fs_is_dir(path)) return fl_errorf(FL_ERR_INVALID, "%s: is a folder, not a file", path);
    FILE *f = fopen(path, "rb");
    if (!f) return fl_errorf(errno == ENOENT ? FL_ERR_NOT_FOUND : FL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    char *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n == cap) { /* doubling from 64 KiB: O(n) copies in all */
            size_t nc = cap ? cap * 2 : 65536;
            char *nb = realloc(buf, nc);
            if (!nb) { free(buf); fclose(f); return fl_errorf(FL_ERR_OOM, "%s: out of memory reading file", path); }
            buf = nb;
            cap = nc;
        }
        size_t r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (max_bytes && n > max_bytes) {
            free(buf);
            fclose(f);
            return fl_errorf(FL_ERR_FORMAT, "%s: larger than %zu bytes", path, max_bytes);
        }
        if (r == 0) break;
    }
    const int err = ferror(f) ? errno : 0;
    fclose(f);
    if (err) { free(buf); return fl_errorf(FL_ERR_IO, "%s: read error: %s", path, strerror(err)); }
    *out = buf;
    *len = n;
    return FL_OK;
}

const char *fl_fs_tmpdir(void) {
    const char *t = getenv("TMPDIR");
    return t && t[0] == '/' && strlen(t) < 200 ? t : "/tmp";
}

int fl_fs_is_path_form(const char *s) {
    return s && (s[0] == '/' || s[0] == '~' || !strncmp(s, "./", 2) || !strncmp(s, "../", 3) || !strcmp(s, ".") ||
                 !strcmp(s, ".."));
}

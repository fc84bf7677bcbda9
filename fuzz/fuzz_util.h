/* Helpers shared by the harnesses whose loaders take a path: each process gets
 * its own temp folder (mkdtemp; removed at exit), inputs are written there, and
 * a multi-file input is cut into parts at FZ_SEP (a readable separator the
 * fuzzer learns from the seeds and from its memmem comparison hooks). */
#ifndef FITLLM_FUZZ_UTIL_H
#define FITLLM_FUZZ_UTIL_H

#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define FZ_SEP "\n@@FILE@@\n"
#define FZ_SEP_LEN (sizeof FZ_SEP - 1)

#include "fitllm/status.h"

static char fz_root[256];

/* FZ_DEBUG=1 in the environment: print each refusal (to see why an input is turned away). */
static fl_status fz_dbg(fl_status s) {
    static int on = -1;
    if (on < 0) on = getenv("FZ_DEBUG") != NULL;
    if (on && s != FL_OK) fprintf(stderr, "refused: %s\n", fl_error_message());
    return s;
}

/* A property the harness checks failed: say which, with the library's last error, then abort. */
#define FZ_CHECK(cond)                                                                            \
    do {                                                                                          \
        if (!(cond)) {                                                                            \
            fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
                    fl_error_message() ? fl_error_message() : "none");                            \
            abort();                                                                              \
        }                                                                                         \
    } while (0)

/* Remove every plain file of dir, then dir (harness folders are flat or one level deep). */
static void fz_rm_tree(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char p[1024];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        struct stat st;
        if (lstat(p, &st) == 0 && S_ISDIR(st.st_mode)) fz_rm_tree(p);
        else unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

static void fz_cleanup(void) {
    if (fz_root[0]) fz_rm_tree(fz_root);
}

/* The per-process temp folder (created on first use). */
static const char *fz_tmpdir(void) {
    if (!fz_root[0]) {
        const char *base = getenv("TMPDIR");
        snprintf(fz_root, sizeof fz_root, "%s/fitllm-fuzz-XXXXXX", base && base[0] ? base : "/tmp");
        if (!mkdtemp(fz_root)) abort();
        atexit(fz_cleanup);
    }
    return fz_root;
}

/* A fresh empty sub-folder of the temp folder for this input. */
static inline const char *fz_fresh_dir(const char *name) {
    static char p[512];
    snprintf(p, sizeof p, "%s/%s", fz_tmpdir(), name);
    fz_rm_tree(p);
    if (mkdir(p, 0700) != 0) abort();
    return p;
}

static inline void fz_write(const char *path, const void *data, size_t n) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) abort();
    const char *p = data;
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w <= 0) abort();
        p += w;
        n -= (size_t)w;
    }
    close(fd);
}

/* Next part of [*p, end) up to FZ_SEP (the whole rest if there is none); 0 when done. */
static inline int fz_next_part(const uint8_t **p, const uint8_t *end, const uint8_t **part, size_t *n) {
    if (!*p) return 0;
    const uint8_t *s = memmem(*p, (size_t)(end - *p), FZ_SEP, FZ_SEP_LEN);
    *part = *p;
    if (s) {
        *n = (size_t)(s - *p);
        *p = s + FZ_SEP_LEN;
    } else {
        *n = (size_t)(end - *p);
        *p = NULL;
    }
    return 1;
}

#endif

/* The seeds' replay without libFuzzer (`make test`'s quick tier, tests/run_all.sh's fuzz-smoke stage): a harness's
 * LLVMFuzzerTestOneInput linked with this main() in the ASan + UBSan build (gcc; FL_FUZZ_REPLAY, fuzz/harnesses.cmake)
 * runs once on every input named on the command line, files or the plain files of folders (one level, in name
 * order), each cut to -max_len=N bytes as libFuzzer cuts a corpus input longer than its max_len. A crash, a
 * sanitizer report or a failed property aborts (non-zero exit; the input's path printed first); a leak is reported by
 * LeakSanitizer at exit. Prints "replay: N inputs". The mutation campaigns are libFuzzer's (fuzz/build.sh, clang):
 * `make fuzz`, and 10 s per harness in `make test-full`. */
#define _GNU_SOURCE
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static size_t g_max_len; /* 0: whole files */
static long g_inputs;

static int run_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "replay: cannot open %s\n", path);
        return 1;
    }
    size_t cap = 1 << 16, n = 0;
    uint8_t *buf = malloc(cap);
    for (;;) {
        if (!buf) {
            fclose(f);
            fprintf(stderr, "replay: out of memory reading %s\n", path);
            return 1;
        }
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap || (g_max_len && n >= g_max_len)) break;
        uint8_t *nb = realloc(buf, cap * 2);
        if (!nb) free(buf);
        buf = nb;
        cap *= 2;
    }
    fclose(f);
    if (g_max_len && n > g_max_len) n = g_max_len;
    /* an exact-size copy: ASan sees a read past the input's end as libFuzzer's own copy would show it */
    uint8_t *in = malloc(n ? n : 1);
    if (!in) {
        free(buf);
        return 1;
    }
    memcpy(in, buf, n);
    free(buf);
    fprintf(stderr, "replay: %s (%zu bytes)\n", path, n); /* the last line before a crash names the input */
    LLVMFuzzerTestOneInput(in, n);
    free(in);
    g_inputs++;
    return 0;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int run_path(const char *path) {
    struct stat st;
    if (stat(path, &st) != 0) {
        fprintf(stderr, "replay: %s: no such file or folder\n", path);
        return 1;
    }
    if (!S_ISDIR(st.st_mode)) return run_file(path);
    DIR *d = opendir(path);
    if (!d) {
        fprintf(stderr, "replay: cannot read the folder %s\n", path);
        return 1;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", path, e->d_name);
        if (stat(p, &st) != 0 || !S_ISREG(st.st_mode)) continue;
        if (n == cap) {
            char **nn = realloc(names, (cap = cap ? 2 * cap : 64) * sizeof *names);
            if (!nn) break;
            names = nn;
        }
        names[n++] = strdup(p);
    }
    closedir(d);
    if (n) qsort(names, n, sizeof *names, cmp_str);
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        if (names[i]) bad |= run_file(names[i]);
        free(names[i]);
    }
    free(names);
    return bad;
}

int main(int argc, char **argv) {
    int bad = 0, paths = 0;
    for (int i = 1; i < argc; i++) {
        if (!strncmp(argv[i], "-max_len=", 9)) {
            g_max_len = (size_t)strtoull(argv[i] + 9, NULL, 10);
            continue;
        }
        if (argv[i][0] == '-') continue; /* libFuzzer's other flags: not used by a replay */
        paths++;
        bad |= run_path(argv[i]);
    }
    if (!paths) {
        fprintf(stderr, "usage: %s [-max_len=N] FILE|FOLDER...\n", argv[0]);
        return 2;
    }
    printf("replay: %ld inputs\n", g_inputs);
    return bad;
}

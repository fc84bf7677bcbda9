/* Test runner: runs every FL_TEST (or those whose name contains an argv
 * filter) and prints a summary line "N passed, N failed, N skipped". */
#define _XOPEN_SOURCE 700
#include <math.h>
#include <ftw.h>
#include <stdarg.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fitllm/backend.h"
#include "fitllm/status.h"
#include "test.h"

#define MAX_TESTS 1024

static struct { const char *name, *file; fl_test_fn fn; } g_tests[MAX_TESTS];
static int g_n;
static int g_failed, g_skipped;
static const char *g_cur;

void fl_test_register(const char *name, const char *file, fl_test_fn fn) {
    if (g_n < MAX_TESTS) { g_tests[g_n].name = name; g_tests[g_n].file = file; g_tests[g_n].fn = fn; g_n++; }
}

void fl_test_fail(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    const char *base = strrchr(file, '/');
    fprintf(stderr, "  FAIL %s (%s:%d): ", g_cur, base ? base + 1 : file, line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    g_failed = 1;
}

void fl_test_skip(const char *why) {
    fprintf(stderr, "  SKIP %s: %s\n", g_cur, why);
    g_skipped = 1;
}

int fl_test_failed(void) { return g_failed; }

const char *fl_test_data_dir(void) {
    static char buf[4096];
    const char *d = getenv("FITLLM_DATA");
    if (!d || !*d) d = "../shared/data";
    struct stat st;
    if (stat(d, &st) != 0 || !S_ISDIR(st.st_mode)) return NULL;
    snprintf(buf, sizeof buf, "%s", d);
    return buf;
}

const char *fl_test_data_path(const char *rel) {
    static char buf[8][4096];
    static int k;
    const char *d = fl_test_data_dir();
    if (!d) return NULL;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/%s", d, rel);
    return buf[k];
}

/* Every test's scratch folder lives under one root per run, removed at exit
 * (set FITLLM_KEEP_TMP=1 to keep it for debugging). */
static char g_tmp_root[128];

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st; (void)flag; (void)ftw;
    return remove(path);
}

static void remove_tmp_root(void) {
    if (g_tmp_root[0] && !getenv("FITLLM_KEEP_TMP")) nftw(g_tmp_root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

const char *fl_test_tmpdir(void) {
    static char buf[256];
    static int k;
    if (!g_tmp_root[0]) {
        snprintf(g_tmp_root, sizeof g_tmp_root, "/tmp/fitllm-test-%d", (int)getpid());
        mkdir(g_tmp_root, 0700);
        atexit(remove_tmp_root);
    }
    snprintf(buf, sizeof buf, "%s/%d", g_tmp_root, k++);
    mkdir(buf, 0700);
    return buf;
}

double fl_test_max_rel_err(const float *a, const float *b, size_t n, double floor, size_t *worst) {
    double m = 0;
    size_t w = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        double s = fabs((double)b[i]);
        double r = d / (s > floor ? s : floor);
        if (r > m || isnan(r)) { m = isnan(r) ? INFINITY : r; w = i; }
    }
    if (worst) *worst = w;
    return m;
}

int fl_test_allclose(const char *what, const float *a, const float *b, size_t n, double rtol, double atol) {
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (!(d <= atol + rtol * fabs((double)b[i]))) {
            fprintf(stderr, "  %s: mismatch at %zu: got %.9g want %.9g (|diff| %.3g, rtol %.1g atol %.1g)\n", what, i,
                    a[i], b[i], d, rtol, atol);
            return 0;
        }
    }
    return 1;
}

int main(int argc, char **argv) {
    fl_cpu_process_init(argv); /* idle OpenMP workers sleep (may re-execute the program once) */
    int passed = 0, failed = 0, skipped = 0;
    for (int i = 0; i < g_n; i++) {
        int run = argc < 2;
        for (int a = 1; a < argc; a++)
            if (strstr(g_tests[i].name, argv[a])) run = 1;
        if (!run) continue;
        g_cur = g_tests[i].name;
        g_failed = g_skipped = 0;
        fl_error_clear();
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        g_tests[i].fn();
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
        const char *st = g_failed ? "FAIL" : g_skipped ? "skip" : "ok";
        printf("%-4s %-48s %8.1f ms\n", st, g_tests[i].name, ms);
        fflush(stdout);
        if (g_failed) failed++;
        else if (g_skipped) skipped++;
        else passed++;
    }
    printf("\n%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    return failed ? 1 : 0;
}

double fl_test_scaled_err(const float *a, const float *ref, size_t n, size_t *worst) {
    double md = 0, mr = 0;
    size_t w = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - ref[i]);
        if (d > md || isnan(d)) { md = isnan(d) ? INFINITY : d; w = i; }
        if (fabs(ref[i]) > mr) mr = fabs(ref[i]);
    }
    if (worst) *worst = w;
    return mr > 0 ? md / mr : md;
}

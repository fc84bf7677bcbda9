/* Test runner: runs every FL_TEST (or those whose name contains an argv
 * filter) and prints a summary line "N passed, N failed, N skipped". */
#define _XOPEN_SOURCE 700
#include <errno.h>
#include <math.h>
#include <ftw.h>
#include <stdarg.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fitllm/backend.h"
#include "fitllm/config.h"
#include "fitllm/status.h"
#include "fitllm/trainer.h"
#include "test.h"
#include "core/fs.h" /* fl_fs_tmpdir */
#ifdef FL_HAVE_CUDA_EMU
#include "backend/cuda/cuda-impl.h"
#endif

#define MAX_TESTS 1024

static struct { const char *name, *file; fl_test_fn fn; double ms; } g_tests[MAX_TESTS];
static int g_n;
static int g_failed, g_skipped;
static const char *g_cur;

void fl_test_register(const char *name, const char *file, fl_test_fn fn) {
    if (g_n < MAX_TESTS) { g_tests[g_n].name = name; g_tests[g_n].file = file; g_tests[g_n].fn = fn; g_n++; }
}

/* The backend an FL_FOR_EACH_BACKEND loop is running ("" outside one): failures name it. */
static const char *g_be_cur = "";
/* Per registered backend: the tests that ran it, and the cases it skipped as unsupported. */
#define MAX_BACKENDS 16
static int g_be_tests[MAX_BACKENDS], g_be_unsup[MAX_BACKENDS], g_be_counted[MAX_BACKENDS];

void fl_test_fail(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    const char *base = strrchr(file, '/');
    if (*g_be_cur) fprintf(stderr, "  FAIL %s [backend %s] (%s:%d): ", g_cur, g_be_cur, base ? base + 1 : file, line);
    else fprintf(stderr, "  FAIL %s (%s:%d): ", g_cur, base ? base + 1 : file, line);
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

/* The tier (FITLLM_TEST_TIER, tests/test.h): "full" runs every case everywhere; anything else (unset: the quick
 * tier `make test` runs) lets the tests below keep to one case per path. */
int fl_test_quick(void) {
    const char *e = getenv("FITLLM_TEST_TIER");
    return !(e && !strcmp(e, "full"));
}

int fl_test_full_only(const char *covered_by) {
    if (!fl_test_quick()) return 1;
    char why[256];
    snprintf(why, sizeof why, "full tier only (FITLLM_TEST_TIER=full runs it); the quick tier covers its paths in %.180s",
             covered_by);
    fl_test_skip(why);
    return 0;
}

/* Under ASan (unless FITLLM_TEST_ASAN_ALL=1 or the full tier) a test with many cases of one path runs a
 * representative subset: every code path still runs under the sanitizers, the release pass runs every case. */
int fl_test_asan_light(void) {
#ifdef __SANITIZE_ADDRESS__
    const char *e = getenv("FITLLM_TEST_ASAN_ALL");
    return !(e && !strcmp(e, "1")) && fl_test_quick();
#else
    return 0;
#endif
}

int fl_test_asan_budget(void) {
    if (!fl_test_asan_light()) return 1;
    fl_test_skip("the release pass runs it (FITLLM_TEST_TIER=full or FITLLM_TEST_ASAN_ALL=1 runs it under ASan)");
    return 0;
}

static const char *test_backend_env(void) {
    const char *e = getenv("FITLLM_TEST_BACKEND");
    return e && *e ? e : "cpu";
}

const char *fl_test_backend_name(void) { return test_backend_env(); }

fl_status fl_test_backend(fl_backend *be, int n_threads) {
    return fl_backend_init_by_name(test_backend_env(), be, n_threads);
}

int fl_test_backend_next(int *i, fl_backend *be, int n_threads) {
    if (*i > 0) fl_backend_free(be);
    for (; *i < fl_backend_count(); ++*i) {
        const char *name = fl_backend_name(*i);
        fl_status st = fl_backend_init_by_name(name, be, n_threads);
        g_be_cur = name;
        if (st == FL_OK && be->device == FL_DEV_CUDA && !fl_backend_host_memory(be)) {
            /* a GPU's memory: the op suite passes host buffers, so the real CUDA backend is checked
             * by `fitllm selftest --accelerator cuda` and fitllm_cuda_check instead (its code runs
             * here as "cuda-emu") */
            fl_backend_free(be);
            continue;
        }
        if (st == FL_OK && fl_backend_discards(be)) { /* the planner's null backend computes nothing (its table is
                                             * checked by ops_backend_vtables, its use by the plan tests) */
            fl_backend_free(be);
            continue;
        }
        if (st == FL_OK) {
            if (*i < MAX_BACKENDS && !g_be_counted[*i]) g_be_counted[*i] = 1, g_be_tests[*i]++;
            return 1;
        }
        if (st == FL_ERR_UNSUPPORTED) continue; /* built in but not usable on this machine (no GPU) */
        fl_test_fail(__FILE__, __LINE__, "backend %s: init failed: %s", name, fl_error_message());
    }
    g_be_cur = "";
    return 0;
}

int fl_test_backend_emulated(const fl_backend *be) { return be && be->name && !strcmp(be->name, "cuda-emu"); }

int fl_test_unsupported(const fl_backend *be, fl_status st, const char *what) {
    if (st != FL_ERR_UNSUPPORTED) return 0;
    if (!strcmp(be->name, "cpu") || !strcmp(be->name, "ref")) {
        fprintf(stderr, "  FAIL %s [backend %s]: %s: unsupported (%s), but this backend implements the whole "
                        "contract\n", g_cur, be->name, what, fl_error_message());
        g_failed = 1;
        return 1;
    }
    fprintf(stderr, "  SKIP %s [backend %s]: %s: not supported by this backend (%s)\n", g_cur, be->name, what,
            fl_error_message());
    for (int i = 0; i < fl_backend_count() && i < MAX_BACKENDS; i++)
        if (!strcmp(fl_backend_name(i), be->name)) g_be_unsup[i]++;
    g_skipped = 1;
    return 1;
}

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
static char g_tmp_root[256];

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st; (void)flag; (void)ftw;
    return remove(path);
}

static void remove_tmp_root(void) {
    if (g_tmp_root[0] && !getenv("FITLLM_KEEP_TMP")) nftw(g_tmp_root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

fl_status fl_test_emu_micro(fl_backend *be, fl_mem_pool *pool, fl_mem_pool *host, fl_model *m, const char *tag, int B,
                            int T) {
    fl_model_config c;
    FL_TRY(fl_backend_init_by_name("cuda-emu", be, 1));
    FL_TRY(fl_preset_find("micro", &c));
    FL_TRY(fl_backend_pools_init(be, pool, host, tag, 0));
    FL_TRY(fl_model_init(m, &c, be, pool));
    fl_model_init_random(m, 5);
    FL_TRY(fl_model_set_precision(m, fl_precision_get(FL_PREC_BF16_MIXED)));
    return fl_model_alloc_acts(m, B, T);
}
void fl_test_emu_micro_free(fl_backend *be, fl_mem_pool *pool, fl_mem_pool *host, fl_model *m) {
    fl_model_free(m);
    fl_backend_pools_free(pool, host);
    fl_backend_free(be);
}

void fl_test_tiny_run_config(fl_run_config *c, fl_cmd_kind cmd, const char *preset, const char *out, int T) {
    fl_cfg_defaults(c, cmd);
    snprintf(c->checkpoint_dir, sizeof c->checkpoint_dir, "%s", preset);
    snprintf(c->out_dir, sizeof c->out_dir, "%s/%s", fl_test_tmpdir(), out);
    c->data.kind = FL_DATA_SYNTHETIC;
    c->data.synthetic_train = 16;
    c->data.synthetic_val = 2;
    c->train.micro_batch_size = 1;
    c->train.global_batch_size = 2;
    c->train.lr_warmup_steps = 0;
    c->train.max_steps = 1;
    c->train.save_interval = 0;
    c->train.max_seq_length = T;
    c->eval.interval = 100;
    c->eval.final_validation = 0;
    c->optimizer.lr = 3e-3f;
    c->threads = 1;
    c->seed = 7;
}

int fl_test_record_step(void *ud, long step, double loss, const void *params, size_t bytes) {
    fl_test_step_rec *r = ud;
    if (step == 1) r->loss = loss;
    r->steps = step;
    free(r->params);
    r->params = malloc(bytes + 1);
    if (!r->params) return 1;
    memcpy(r->params, params, bytes);
    r->n = bytes;
    return 0;
}

fl_status fl_test_emu_knob_run(fl_test_step_rec *rec, const char *knob, const char *v, const char *tag,
                               const char *preset, const char *prec, int ckpt, int lora) {
    return fl_test_emu_knob_run_t(rec, knob, v, tag, preset, prec, ckpt, lora, 8);
}
fl_status fl_test_emu_knob_run_t(fl_test_step_rec *rec, const char *knob, const char *v, const char *tag,
                                 const char *preset, const char *prec, int ckpt, int lora, int T) {
    fl_run_config c;
    char out[160];
    snprintf(out, sizeof out, "%s-%s-%s-%s%s%s", tag, preset, prec, v, ckpt ? "-ckpt" : "", lora ? "-lora" : "");
    fl_test_tiny_run_config(&c, lora ? FL_CMD_FINETUNE_LORA : FL_CMD_FINETUNE_FULL, preset, out, T);
    c.train.global_batch_size = 2;
    c.train.max_norm = 1.0f;
    if (lora) c.lora.query = c.lora.value = 1, c.lora.mlp = 0;
    FL_TRY(fl_cfg_set(&c, "precision", prec));
    if (ckpt) FL_TRY(fl_cfg_set(&c, "train.activation_checkpointing", "true"));
    setenv("FITLLM_BACKEND", "cuda-emu", 1);
    setenv(knob, v, 1);
    fl_status s = fl_trainer_run(&c, NULL, 0, fl_test_record_step, rec, NULL);
    unsetenv(knob);
    unsetenv("FITLLM_BACKEND");
    return s;
}
void fl_test_emu_knob_refused(const char *knob) {
    setenv(knob, "yes", 1); /* another value than 0 / 1: refused at set-up, by name */
    fl_backend be;
    fl_status s = fl_backend_init_by_name("cuda-emu", &be, 1);
    unsetenv(knob);
    char want[96];
    snprintf(want, sizeof want, "%s=yes", knob);
    FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), want), "%s=yes: status %d: %s", knob, (int)s,
              fl_error_message());
    if (s == FL_OK) fl_backend_free(&be);
}
void fl_test_emu_knob_ab(const char *knob, const char *tag, const char *preset, const char *prec, int ckpt, int lora) {
    fl_test_step_rec off, on;
    memset(&off, 0, sizeof off), memset(&on, 0, sizeof on);
    fl_status s = fl_test_emu_knob_run(&off, knob, "0", tag, preset, prec, ckpt, lora);
    FL_CHECKF(s == FL_OK, "%s %s %s=0: %s", preset, prec, knob, fl_error_message());
    if (s == FL_OK) s = fl_test_emu_knob_run(&on, knob, "1", tag, preset, prec, ckpt, lora);
    FL_CHECKF(s == FL_OK, "%s %s %s=1: %s", preset, prec, knob, fl_error_message());
    if (s == FL_OK) {
        FL_CHECKF(off.steps == 1 && on.steps == 1 && off.n && off.n == on.n && !memcmp(off.params, on.params, off.n),
                  "%s %s%s%s: the parameters differ in bits with %s", preset, prec, ckpt ? " ckpt" : "",
                  lora ? " lora" : "", tag);
        FL_CHECKF(off.loss == on.loss, "%s %s: loss %.9g with %s, %.9g without", preset, prec, on.loss, tag, off.loss);
        printf("      %s %s%s%s: loss %.9g both ways, %zu parameter bytes equal (%s 0 / 1)\n", preset, prec,
               ckpt ? " ckpt" : "", lora ? " lora" : "", on.loss, on.n, knob);
    }
    free(off.params), free(on.params);
}

/* the folders fl_test_tmpdir made in this process are g_tmp_root/0 .. g_tmp_next - 1; run_one removes a passed
 * test's own (the suite writes ~6 GB of checkpoints and offload files in all: kept to the run's end they would hold
 * ~5 GB at once, too much for a TMPDIR in memory, tests/run_all.sh) */
static int g_tmp_next;
static void remove_tmp_since(int k0) {
    char p[sizeof g_tmp_root + 16];
    if (!g_tmp_root[0] || getenv("FITLLM_KEEP_TMP")) return;
    for (int j = k0; j < g_tmp_next; j++) {
        snprintf(p, sizeof p, "%s/%d", g_tmp_root, j);
        nftw(p, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    }
}

const char *fl_test_tmpdir(void) {
    static char buf[sizeof g_tmp_root + 16];
    int k = g_tmp_next;
    if (!g_tmp_root[0]) {
        /* a fresh folder (mkdtemp), never one a killed run of a process with the same id left behind: the tests
         * that count a folder's entries would see its files */
        const char *td = fl_fs_tmpdir(); /* $TMPDIR (under 200 bytes) or /tmp, as the lab's and selftest's */
        snprintf(g_tmp_root, sizeof g_tmp_root, "%s/fitllm-test-%d-XXXXXX", td, (int)getpid());
        if (!mkdtemp(g_tmp_root)) {
            fprintf(stderr, "fitllm_tests: cannot create a folder under %s (TMPDIR): %s\n", td, strerror(errno));
            exit(2);
        }
        atexit(remove_tmp_root);
    }
    g_tmp_next = k + 1;
    snprintf(buf, sizeof buf, "%s/%d", g_tmp_root, k);
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

static int cmp_ms_desc(const void *a, const void *b) {
    double x = g_tests[*(const int *)a].ms, y = g_tests[*(const int *)b].ms;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* FITLLM_TEST_TIMES=1 (or a count): the slowest tests of this run and their share of the total,
 * for keeping `make test` short */
static void print_slowest(void) {
    const char *e = getenv("FITLLM_TEST_TIMES");
    if (!e || !*e || !strcmp(e, "0")) return;
    int top = atoi(e) > 1 ? atoi(e) : 20;
    static int idx[MAX_TESTS];
    int n = 0;
    double total = 0;
    for (int i = 0; i < g_n; i++)
        if (g_tests[i].ms > 0) idx[n++] = i, total += g_tests[i].ms;
    qsort(idx, n, sizeof idx[0], cmp_ms_desc);
    if (top > n) top = n;
    double shown = 0;
    printf("\nslowest %d of %d tests (FITLLM_TEST_TIMES):\n", top, n);
    for (int k = 0; k < top; k++) {
        shown += g_tests[idx[k]].ms;
        const char *f = strrchr(g_tests[idx[k]].file, '/');
        printf("  %9.1f ms  %-56s %s\n", g_tests[idx[k]].ms, g_tests[idx[k]].name, f ? f + 1 : g_tests[idx[k]].file);
    }
    printf("  these %d: %.1f s of %.1f s (%.0f%%)\n", top, shown / 1e3, total / 1e3, total > 0 ? 100 * shown / total : 0);
}

/* user + system time of this process (all its threads) and its waited-for children, in ms */
static double cpu_ms(void) {
    double t = 0;
    struct rusage ru;
    for (int k = 0; k < 2; k++)
        if (getrusage(k ? RUSAGE_CHILDREN : RUSAGE_SELF, &ru) == 0)
            t += (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e3 + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e3;
    return t;
}

/* Runs test i, prints its status line; returns 0 passed, 1 failed, 2 skipped. */
static int run_one(int i) {
    g_cur = g_tests[i].name;
    g_failed = g_skipped = 0;
    g_be_cur = "";
    memset(g_be_counted, 0, sizeof g_be_counted);
    fl_error_clear();
    struct timespec t0, t1;
    const double c0 = cpu_ms();
    clock_gettime(CLOCK_MONOTONIC, &t0);
    const int k0 = g_tmp_next;
    g_tests[i].fn();
    if (!g_failed) remove_tmp_since(k0); /* a failed test's files stay to the run's end (FITLLM_KEEP_TMP=1: after it) */
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
    const double cpu = cpu_ms() - c0;
    const char *st = g_failed ? "FAIL" : g_skipped ? "skip" : "ok";
    g_tests[i].ms = ms;
    /* the CPU time (user + system, every thread and waited-for child) beside the wall time: on a loaded machine
     * the CPU time is what to compare (the CLI and MPI logs print theirs the same way) */
    printf("%-4s %-48s [cpu %6.0f ms] %8.1f ms\n", st, g_tests[i].name, cpu, ms);
    fflush(stdout);
    return g_failed ? 1 : g_skipped ? 2 : 0;
}

/* FITLLM_TEST_JOBS=N: the selected tests run in N forked worker processes (make test uses 2: most
 * tests keep one core busy, and a test of several threads mostly waits on their barriers). The
 * parent writes the test indices into a pipe that the workers read one at a time (so a long test
 * does not hold up a fixed share), and prints each test's output whole when it ends. A worker that
 * dies (a crash, an ASan report) fails the test it was running; one that exits non-zero after its
 * last test (LeakSanitizer at exit) is a failure too; the other workers take the remaining tests. */
typedef struct {
    int kind; /* 0: started, 1: finished */
    int worker, idx, status;
    double ms;
    unsigned char be_counted[MAX_BACKENDS];
    int be_unsup[MAX_BACKENDS];
} job_msg; /* under PIPE_BUF: one write() each, never interleaved */

static void job_out_path(char *buf, size_t n, const char *dir, int idx) { snprintf(buf, n, "%s/%d.out", dir, idx); }

static void job_cat(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return;
    char b[8192];
    size_t n;
    while ((n = fread(b, 1, sizeof b, f)) > 0) fwrite(b, 1, n, stdout);
    fclose(f);
    remove(path);
    fflush(stdout);
}

static void job_worker(int w, int qfd, int rfd, const char *dir) {
    int out = dup(1), err = dup(2);
    int idx;
    while (read(qfd, &idx, sizeof idx) == (ssize_t)sizeof idx) {
        char path[300];
        job_out_path(path, sizeof path, dir, idx);
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd < 0) _exit(3);
        fflush(stdout);
        fflush(stderr);
        dup2(fd, 1);
        dup2(fd, 2);
        close(fd);
        job_msg m = {0};
        m.worker = w, m.idx = idx;
        if (write(rfd, &m, sizeof m) != (ssize_t)sizeof m) _exit(3);
        int unsup0[MAX_BACKENDS];
        memcpy(unsup0, g_be_unsup, sizeof unsup0);
        m.status = run_one(idx);
        fflush(stderr);
        m.kind = 1, m.ms = g_tests[idx].ms;
        memcpy(m.be_counted, g_be_counted, sizeof m.be_counted);
        for (int b = 0; b < MAX_BACKENDS; b++) m.be_unsup[b] = g_be_unsup[b] - unsup0[b];
        if (write(rfd, &m, sizeof m) != (ssize_t)sizeof m) _exit(3);
    }
    dup2(out, 1);
    dup2(err, 2);
    exit(0); /* atexit: this worker's scratch folder; then LeakSanitizer's check, on the terminal */
}

static pid_t start_worker(int w, int q0, int r[2], const char *dir) {
    fflush(stdout);
    fflush(stderr);
    pid_t p = fork();
    if (p == 0) {
        close(r[0]);
        job_worker(w, q0, r[1], dir);
    }
    if (p < 0) perror("fork");
    return p;
}

/* more_path / more_jobs (FITLLM_TEST_JOBS_MORE=PATH:N): when the file PATH appears, the workers become N (the ones
 * started later read the same queue: the tests not yet taken). tests/run_all.sh starts the ASan pass with one worker
 * while the MPI stage still runs, and gives it its second when that stage ends. */
static int run_parallel(const int *sel, int nsel, int jobs, const char *more_path, int more_jobs, int *passed,
                        int *failed, int *skipped) {
    char dir[] = "/tmp/fitllm-testjobs-XXXXXX";
    int q[2], r[2];
    if (!mkdtemp(dir) || pipe(q) != 0 || pipe(r) != 0) {
        perror("FITLLM_TEST_JOBS");
        return -1;
    }
    /* every index up front (4 KB at most: fits the pipe), then EOF for the workers */
    if (write(q[1], sel, nsel * sizeof sel[0]) != (ssize_t)(nsel * sizeof sel[0])) return -1;
    close(q[1]);
    pid_t pid[16];
    int running[16];
    if (more_jobs > 16) more_jobs = 16;
    if (!more_path || more_jobs <= jobs) more_path = NULL;
    for (int w = 0; w < jobs; w++) {
        if ((pid[w] = start_worker(w, q[0], r, dir)) < 0) return -1;
        running[w] = -1;
    }
    if (!more_path) close(q[0]);
    job_msg m;
    char path[300];
    static unsigned char done[MAX_TESTS], started[MAX_TESTS];
    for (;;) {
        if (more_path) { /* the later workers: look for the file twice a second while the results come */
            struct pollfd pf = {.fd = r[0], .events = POLLIN};
            int queued = 0; /* bytes of test indices not yet taken: none left, no later worker is needed */
            if (ioctl(q[0], FIONREAD, &queued) != 0) queued = 1;
            if (queued == 0) {
                close(q[0]);
                more_path = NULL;
            } else if (access(more_path, F_OK) == 0) {
                for (int w = jobs; w < more_jobs; w++) {
                    if ((pid[w] = start_worker(w, q[0], r, dir)) < 0) break;
                    running[w] = -1;
                    jobs = w + 1;
                }
                close(q[0]);
                more_path = NULL;
            } else if (poll(&pf, 1, 500) == 0) {
                continue;
            }
        }
        if (r[1] >= 0 && !more_path) { /* every worker started: their ends of the results pipe are theirs alone */
            close(r[1]);
            r[1] = -1;
        }
        if (read(r[0], &m, sizeof m) != (ssize_t)sizeof m) break;
        if (m.kind == 0) {
            running[m.worker] = m.idx;
            started[m.idx] = 1;
            continue;
        }
        running[m.worker] = -1;
        done[m.idx] = 1;
        g_tests[m.idx].ms = m.ms;
        job_out_path(path, sizeof path, dir, m.idx);
        job_cat(path);
        for (int b = 0; b < MAX_BACKENDS; b++) g_be_tests[b] += m.be_counted[b], g_be_unsup[b] += m.be_unsup[b];
        if (m.status == 1) ++*failed;
        else if (m.status == 2) ++*skipped;
        else ++*passed;
    }
    close(r[0]);
    for (int w = 0; w < jobs; w++) {
        int ws = 0;
        waitpid(pid[w], &ws, 0);
        if (WIFEXITED(ws) && WEXITSTATUS(ws) == 0) continue;
        char how[64];
        if (WIFSIGNALED(ws)) snprintf(how, sizeof how, "killed by signal %d", WTERMSIG(ws));
        else snprintf(how, sizeof how, "exit status %d", WEXITSTATUS(ws));
        ++*failed;
        if (running[w] >= 0) {
            job_out_path(path, sizeof path, dir, running[w]);
            job_cat(path);
            printf("FAIL %-48s the test process died (%s)\n", g_tests[running[w]].name, how);
            done[running[w]] = 1;
        } else {
            printf("FAIL test worker %d (pid %d) ended with %s after its last test (a LeakSanitizer report "
                   "above?)\n", w, (int)pid[w], how);
        }
    }
    for (int k = 0; k < nsel; k++)
        if (!done[sel[k]] && !started[sel[k]]) {
            printf("FAIL %-48s not run: every test process died\n", g_tests[sel[k]].name);
            ++*failed;
        }
    fflush(stdout);
    rmdir(dir);
    return 0;
}

int main(int argc, char **argv) {
    fl_cpu_process_init(argv); /* idle OpenMP workers sleep (may re-execute the program once) */
#ifdef FL_HAVE_CUDA_EMU
    /* the CUDA backend's own code over the CPU emulator: the op suite runs it like any backend */
    if (fl_backend_register("cuda-emu", "the CUDA backend over the CPU emulator (tests only)", fl_cuemu_backend_init,
                            fl_cuemu_backend_free) != FL_OK)
        return 2;
#endif
    fl_backend probe;
    if (fl_test_backend(&probe, 1) != FL_OK) { /* a typo must not quietly test the CPU */
        fprintf(stderr, "FITLLM_TEST_BACKEND: %s\n", fl_error_message());
        return 2;
    }
    fl_backend_free(&probe);
    static int sel[MAX_TESTS];
    int nsel = 0;
    for (int i = 0; i < g_n; i++) {
        int run = argc < 2;
        for (int a = 1; a < argc; a++)
            if (strstr(g_tests[i].name, argv[a])) run = 1;
        if (run) sel[nsel++] = i;
    }
    int passed = 0, failed = 0, skipped = 0;
    const char *je = getenv("FITLLM_TEST_JOBS"), *jm = getenv("FITLLM_TEST_JOBS_MORE");
    int jobs = je ? atoi(je) : 1;
    if (jobs < 1) jobs = 1;
    char more_path[512] = "";
    int more_jobs = 0;
    if (jm && *jm) { /* PATH:N */
        const char *colon = strrchr(jm, ':');
        if (!colon || colon == jm || atoi(colon + 1) < 1 || (size_t)(colon - jm) >= sizeof more_path) {
            fprintf(stderr, "FITLLM_TEST_JOBS_MORE must be PATH:N (got '%s')\n", jm);
            return 2;
        }
        memcpy(more_path, jm, (size_t)(colon - jm));
        more_jobs = atoi(colon + 1);
    }
    if ((jobs > 1 || more_jobs > jobs) && nsel > 1) {
        if (run_parallel(sel, nsel, jobs < 16 ? jobs : 16, more_path[0] ? more_path : NULL, more_jobs, &passed, &failed,
                         &skipped) != 0)
            return 2;
    } else {
        for (int k = 0; k < nsel; k++) {
            int st = run_one(sel[k]);
            if (st == 1) failed++;
            else if (st == 2) skipped++;
            else passed++;
        }
    }
    /* which backends the op tests ran, and what each one skipped as unsupported */
    int any = 0;
    for (int i = 0; i < fl_backend_count() && i < MAX_BACKENDS; i++) any |= g_be_tests[i] > 0;
    if (any) {
        printf("\nbackends (op tests run against every one; others use FITLLM_TEST_BACKEND=%s):\n",
               fl_test_backend_name());
        for (int i = 0; i < fl_backend_count() && i < MAX_BACKENDS; i++)
            printf("  %-8s %d tests, %d cases unsupported (skipped)\n", fl_backend_name(i), g_be_tests[i],
                   g_be_unsup[i]);
    }
    print_slowest();
    printf("\n%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    fflush(stdout); /* before LeakSanitizer's report, which ends the process without flushing stdio */
    return failed ? 1 : 0;
}

char *fl_test_slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *b = NULL;
    long sz = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    if (sz >= 0 && fseek(f, 0, SEEK_SET) == 0) b = malloc((size_t)sz + 1);
    if (b && fread(b, 1, (size_t)sz, f) != (size_t)sz) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b) b[sz] = 0, *len = (size_t)sz;
    return b;
}

int fl_test_t5_folder(const char *dir, const char *fixture) {
    static const char *tok[] = {"spiece.model", "tokenizer.json", "tokenizer_config.json"};
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) return -1;
    for (int i = 0; i < 4; i++) {
        char p[1200];
        size_t n = 0;
        if (i < 3) snprintf(p, sizeof p, "tests/fixtures/t5-tok/%s", tok[i]);
        else snprintf(p, sizeof p, "tests/fixtures/%s/config.json", fixture);
        char *s = fl_test_slurp(p, &n);
        if (!s) return -1;
        char *v = i == 3 ? strstr(s, "\"vocab_size\": 97") : NULL;
        snprintf(p, sizeof p, "%s/%s", dir, i < 3 ? tok[i] : "config.json");
        FILE *f = i < 3 || v ? fopen(p, "wb") : NULL;
        if (!f) {
            free(s);
            return -1;
        }
        if (v) fprintf(f, "%.*s\"vocab_size\": 500%s", (int)(v - s), s, v + 16);
        else fwrite(s, 1, n, f);
        fclose(f);
        free(s);
    }
    return 0;
}

unsigned char *fl_test_st_data(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    unsigned char h[8];
    unsigned char *d = NULL;
    if (fread(h, 1, 8, f) == 8) {
        uint64_t hl = 0;
        for (int i = 7; i >= 0; i--) hl = hl << 8 | h[i];
        fseek(f, 0, SEEK_END);
        long size = ftell(f);
        if (size > (long)(8 + hl)) {
            *len = (size_t)size - 8 - hl;
            d = malloc(*len);
            fseek(f, (long)(8 + hl), SEEK_SET);
            if (d && fread(d, 1, *len, f) != *len) {
                free(d);
                d = NULL;
            }
        }
    }
    fclose(f);
    return d;
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

/* The CLI around a multi-rank training run (issue #14's faults):
 *  - at start-up, every rank must run the same fitllm and read the same model files: rank 0's
 *    description is broadcast, each rank compares its own, and the lowest rank that differs names
 *    the first difference (the trainer then compares the configurations, fl_dp_check_config);
 *  - when the run fails, the message names the last committed checkpoint (what --resume auto
 *    continues from), also when the launcher ends this rank because another one died. */
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "core/text.h"
#include "fitllm/checkpoint.h"
#include "fitllm/io.h"

/* ---- what each rank runs and reads ------------------------------------------------------- */

/* 64-bit FNV-1a over 8-byte words (a fingerprint, not a security hash). */
static uint64_t fnv_words(uint64_t h, const unsigned char *p, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0x100000001b3ULL;
        h ^= h >> 29;
    }
    for (; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ULL;
    return h;
}

#define WHOLE ((off_t)128 << 20) /* files up to this size are read whole; beyond, the first and last half */

/* "NAME SIZE bytes, fingerprint HEX": the whole file up to 128 MiB, else its first and last
 * 64 MiB (a model's shards are read in full by training anyway; this keeps start-up short). */
static void describe_file(FILE *out, const char *label, const char *path, const char *name) {
    int fd = open(path, O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        fprintf(out, "%s %s: unreadable\n", label, name);
        if (fd >= 0) close(fd);
        return;
    }
    static unsigned char buf[1 << 20];
    uint64_t h = 0xcbf29ce484222325ULL;
    off_t size = st.st_size, ranges[2][2] = {{0, size}, {size, size}};
    if (size > WHOLE) {
        ranges[0][1] = WHOLE / 2;
        ranges[1][0] = size - WHOLE / 2;
    }
    for (int r = 0; r < 2; r++)
        for (off_t o = ranges[r][0]; o < ranges[r][1];) {
            size_t want = (size_t)(ranges[r][1] - o < (off_t)sizeof buf ? ranges[r][1] - o : (off_t)sizeof buf);
            ssize_t got = pread(fd, buf, want, o);
            if (got <= 0) break;
            h = fnv_words(h, buf, (size_t)got);
            o += got;
        }
    close(fd);
    fprintf(out, "%s %s: %lld bytes, fingerprint %016llx\n", label, name, (long long)size, (unsigned long long)h);
}

static int cmp_names(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* A model path as the trainer reads it: a folder's files (sorted; not its subfolders: those are
 * other checkpoints), one file, or a preset name (nothing to read). */
static void describe_path(FILE *out, const char *label, const char *path) {
    struct stat st;
    if (!path[0]) return;
    if (stat(path, &st) != 0) {
        fprintf(out, "%s: '%s' (not a file or folder here: a preset, or missing)\n", label, path);
        return;
    }
    if (!S_ISDIR(st.st_mode)) {
        const char *base = strrchr(path, '/');
        describe_file(out, label, path, base ? base + 1 : path);
        return;
    }
    DIR *d = opendir(path);
    if (!d) {
        fprintf(out, "%s: folder unreadable\n", label);
        return;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    for (struct dirent *e; (e = readdir(d));) {
        char p[FL_CLI_PATH * 2];
        snprintf(p, sizeof p, "%s/%s", path, e->d_name);
        if (e->d_name[0] == '.' || stat(p, &st) != 0 || !S_ISREG(st.st_mode)) continue;
        if (n == cap) {
            char **g = realloc(names, (cap = cap ? cap * 2 : 16) * sizeof *names);
            if (!g) break;
            names = g;
        }
        if (!(names[n] = strdup(e->d_name))) break;
        n++;
    }
    closedir(d);
    if (n) qsort(names, n, sizeof *names, cmp_names);
    for (size_t i = 0; i < n; i++) {
        char p[FL_CLI_PATH * 2];
        snprintf(p, sizeof p, "%s/%s", path, names[i]);
        describe_file(out, label, p, names[i]);
        free(names[i]);
    }
    free(names);
}

int fl_cli_check_ranks(const char *cmd, const fl_run_config *cfg, fl_comm *comm) {
    const int rank = fl_comm_rank(comm), size = fl_comm_size(comm);
    char *mine = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&mine, &len);
    if (!f) {
        fprintf(stderr, "fitllm %s: error: rank %d: out of host memory\n", cmd, rank);
        fl_comm_abort(comm, FL_EXIT_RUNTIME, "out of host memory");
        return FL_EXIT_RUNTIME;
    }
    fprintf(f, "fitllm %s\n", fl_cli_version());
    describe_path(f, "checkpoint_dir", cfg->checkpoint_dir);
    if (strcmp(cfg->resume, "false") && strcmp(cfg->resume, "true") && strcmp(cfg->resume, "auto"))
        describe_path(f, "resume", cfg->resume);
    fclose(f);
    /* rank 0's length, then its text as 2-byte words (a broadcast copies the bits); then the lowest
     * rank that differs, as MAX over (size - rank), so that every rank knows whether to go on */
    float lw = (float)len; /* exact below 2^24 */
    char *root = NULL;
    fl_status s = fl_comm_broadcast(comm, &lw, 1, FL_F32, 0);
    size_t n0 = (size_t)lw, words = (n0 + 2) / 2;
    if (s == FL_OK && !(root = calloc(words, 2))) s = fl_errorf(FL_ERR_OOM, "out of host memory");
    if (s == FL_OK && rank == 0) memcpy(root, mine, len);
    if (s == FL_OK) s = fl_comm_broadcast(comm, root, words, FL_BF16, 0);
    int differs = s == FL_OK && (n0 != len || memcmp(root, mine, len));
    float worst = differs ? (float)(size - rank) : 0.0f;
    if (s == FL_OK) s = fl_comm_all_reduce(comm, &worst, &worst, 1, FL_F32, FL_COMM_MAX);
    if (s != FL_OK) { /* a collective failed: this rank cannot tell the others */
        char msg[1200];
        snprintf(msg, sizeof msg, "fitllm %s: error: start-up check: %s", cmd, fl_error_message());
        free(root);
        free(mine);
        fl_comm_abort(comm, FL_EXIT_RUNTIME, msg);
        return FL_EXIT_RUNTIME;
    }
    int first = worst > 0 ? size - (int)worst : -1, rc = first >= 0 ? FL_EXIT_USAGE : 0;
    if (first == rank) {
        char here[512], there[512];
        fl_text_first_diff(mine, root, here, there, sizeof here);
        int version = !strncmp(here, "fitllm ", 7) || !strncmp(there, "fitllm ", 7);
        fflush(stdout);
        fprintf(stderr, "fitllm %s: error: rank %d of %d: the ranks were started with different %s: rank %d has '%s' "
                "where rank 0 has '%s' (every rank must run the same fitllm build on the same model files)\n", cmd,
                rank, size, version ? "fitllm versions" : "model files", rank, here, there);
    }
    free(root);
    free(mine);
    return rc;
}

/* ---- the last committed checkpoint, when the run fails ----------------------------------- */

/* two buffers: the step hook writes the one the handler does not read, then flips */
static char g_term_msg[2][3 * FL_CLI_PATH];
static volatile sig_atomic_t g_term_len, g_term_buf;
static const char *g_out_dir;
static char g_cmd[64];
static int g_rank = -1, g_size;
static volatile long g_step; /* the last step the trainer's hook saw (0: none yet) */

/* Writes the message computed beforehand (a handler may only write), then dies of the signal. */
static void on_term(int sig) {
    size_t n = (size_t)g_term_len;
    if (n && write(STDERR_FILENO, g_term_msg[g_term_buf], n) < 0) { /* nothing to do */ }
    signal(sig, SIG_DFL);
    raise(sig);
}

void fl_cli_last_checkpoint(const char *out_dir, char *buf, size_t n) {
    char last[FL_CLI_PATH + 300];
    /* the callers print the error that ended the run beside this: looking for the checkpoint must not replace it
     * (none committed sets this thread's message; a failed eval sample's error was printed as "no committed
     * checkpoint" so) */
    char *keep = strdup(fl_error_message());
    if (fl_ckpt_find_latest(out_dir, last, sizeof last) == FL_OK)
        snprintf(buf, n, "the last committed checkpoint is '%s' (to continue from it, run the same command with "
                 "--resume auto)", last);
    else
        snprintf(buf, n, "no checkpoint was committed in '%s' (a new run starts over: --overwrite)", out_dir);
    if (keep) (void)fl_errorf(FL_ERR_INTERNAL, "%s", keep);
    free(keep);
}

/* A wait for the other ranks that timed out (FITLLM_COMM_TIMEOUT, fl_comm_set_timeout_note): where the run was and
 * where it can continue from (this rank's look at out_dir: the waiting rank may be any). */
static void timeout_note(char *buf, size_t n) {
    char where[2 * FL_CLI_PATH];
    fl_cli_last_checkpoint(g_out_dir, where, sizeof where);
    if (g_step > 0) snprintf(buf, n, "this rank was past step %ld; %s", (long)g_step, where);
    else snprintf(buf, n, "this rank was in the run's first step (or its set-up); %s", where);
}

void fl_cli_faults_begin(const char *cmd, const fl_run_config *cfg, int rank, int size) {
    g_out_dir = cfg->out_dir;
    g_rank = rank;
    g_size = size;
    snprintf(g_cmd, sizeof g_cmd, "%s", cmd);
    fl_cli_faults_step(cfg, 0);
    if (size > 1) fl_comm_set_timeout_note(timeout_note);
    /* mpirun (and srun) end every rank with SIGTERM when one dies or fails: rank 0 says where to
     * resume from; the others stay quiet (the launcher names the rank that failed) */
    if (rank == 0 && size > 1) signal(SIGTERM, on_term);
}

void fl_cli_faults_step(const fl_run_config *cfg, long step) {
    /* testing a full disk: FITLLM_FAULT_DISK_FULL_AFTER_STEP=K makes every file write after step K's
     * checkpoint fail with ENOSPC (as fl_io_fail_writes_after; tests/cli_test.sh) */
    const char *df = getenv("FITLLM_FAULT_DISK_FULL_AFTER_STEP");
    if (df && *df && step > 0 && step == atol(df)) fl_io_fail_writes_after(0);
    g_step = step;
    if (g_rank != 0 || g_size < 2) return;
    /* the trainer's hook runs after a due checkpoint was committed: rescan only then */
    if (step != 0 && (cfg->train.save_interval <= 0 || step % cfg->train.save_interval != 0)) return;
    char where[2 * FL_CLI_PATH];
    fl_cli_last_checkpoint(g_out_dir, where, sizeof where);
    int b = !g_term_buf;
    /* your own mpirun's Ctrl-C ends the ranks this way too (fitllm's own launcher turns the first signal into a stop
     * after the step): say what stops after the step instead */
    const char *hint = getenv("FITLLM_LAUNCHED") ? "" : "; to stop a run after its step instead, send SIGUSR1 to "
                                                        "mpirun (kill -USR1 <its pid>), not Ctrl-C or SIGTERM";
    int w = snprintf(g_term_msg[b], sizeof g_term_msg[b], "fitllm %s: rank 0 of %d: ended by the launcher (a rank "
                     "failed or the job was cancelled: see the launcher's message); %s%s\n", g_cmd, g_size, where, hint);
    g_term_len = 0; /* a signal between these lines writes nothing rather than half a message */
    g_term_buf = b;
    g_term_len = w > 0 ? ((size_t)w < sizeof g_term_msg[b] ? w : (int)sizeof g_term_msg[b] - 1) : 0;
}

void fl_cli_faults_term(int sig) {
    size_t n = (size_t)g_term_len;
    fflush(stdout); /* the log's lines whole */
    if (g_rank == 0 && n && write(STDERR_FILENO, g_term_msg[g_term_buf], n) < 0) { /* nothing to do */ }
    fl_cli_die_of(sig);
}

void fl_cli_faults_end(void) {
    if (g_rank == 0 && g_size > 1) signal(SIGTERM, SIG_DFL);
    fl_comm_set_timeout_note(NULL);
    g_step = 0;
    g_term_len = 0;
    g_rank = -1;
}

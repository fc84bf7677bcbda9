/* Stop signals of the long commands (training, `fitllm lab`): SIGINT, SIGTERM, SIGUSR1 and, under fitllm's launcher,
 * SIGUSR2 taken by a thread of their own; the first asks the command to stop after its step (fl_cli_interrupted), the
 * second stops at once. Moved from cmd_train.c so that the lab shares it. */
#include <omp.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "core/fs.h"
#include "fitllm/config.h"

/* Stopping by a signal: SIGINT (Ctrl-C), SIGTERM (Slurm's scancel and time limit, Kubernetes, systemd)
 * and SIGUSR1 (Slurm's pre-emption notice, sbatch --signal=B:USR1@120 / srun --signal=USR1@120) all
 * stop the run after the current step, committing its checkpoint under train.save_on_signal; a
 * second one stops at once. The exit status is the shell's for a process killed by the first signal,
 * 128 + its number: 130, 143, 138 (SIGUSR1: non-zero, so a batch script does not take the run for a
 * finished one, and apart from errors (1), so it can requeue it with --resume auto).
 * SIGUSR2 is fitllm's launcher asking its ranks to stop (it took the user's signal: launch.c). */
static volatile sig_atomic_t g_interrupted; /* the first signal's number; 0 = none */
static fl_cli_signals g_sigs = {.cmd = "train", .out_dir = ".", .world = 1}; /* fl_cli_signals_begin's, copied */

const char *fl_cli_signal_name(int sig) {
    return sig == SIGINT ? "SIGINT (Ctrl-C)" : sig == SIGTERM ? "SIGTERM" : sig == SIGUSR1 ? "SIGUSR1" :
           sig == SIGUSR2 ? "SIGUSR2" : sig == SIGHUP ? "SIGHUP" : "a signal";
}

/* The first signal, from the signals' thread (or as the handler before that thread exists, or after its
 * pthread_create failed: only async-signal-safe calls). */
static char g_resume_msg[FL_CFG_PATH + 256], g_stop_what[256];

static void on_signal(int sig) {
    if (g_interrupted) { /* the second, in a thread that does not block it (one MPI started): stop now */
        if (write(STDERR_FILENO, g_resume_msg, strlen(g_resume_msg)) < 0) { /* nothing to do */ }
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    g_interrupted = sig;
    if (sig == SIGUSR2 || g_sigs.rank != 0) return; /* the launcher said it; rank 0 speaks for the ranks */
    char m[256];
    const char *name = fl_cli_signal_name(sig);
    size_t n = 0;
#define PUT(str) do { size_t l_ = strlen(str); if (n + l_ < sizeof m) { memcpy(m + n, str, l_); n += l_; } } while (0)
    PUT("\nfitllm: ");
    PUT(name);
    PUT(": ");
    PUT(g_stop_what);
    PUT(" (the same signal again, or Ctrl-C, stops now)\n");
#undef PUT
    if (write(STDERR_FILENO, m, n) < 0) { /* nothing to do */ }
}

/* The signals are taken by a thread of its own (sigwait), blocked in every other thread: the
 * training thread and the OpenMP pool, whose threads are started here and inherit the mask. With
 * the signal delivered asynchronously to the training threads, the heap was corrupted in about 1 run
 * of 5 (`finetune_ctrl_c` at 2 threads: a oneDNN GEMM's free aborted; never with --threads 1). */
static volatile sig_atomic_t g_sig_done, g_thread_live;
static pthread_t g_sig_thread;

/* The handler, for a thread that does not block the signals (started before fl_cli_signals_begin: MPI's, or the
 * OpenMP pool of a command that made its backend first): the signal goes on to the signals' thread, which takes it
 * as any other (a stop at once removes the temporary files there: nothing a handler may do); before that thread
 * exists (fl_cli_signals_early), on_signal. pthread_kill is async-signal-safe. */
static void on_signal_async(int sig) {
    if (g_thread_live) {
        pthread_kill(g_sig_thread, sig);
        return;
    }
    on_signal(sig);
}
static sigset_t g_sig_old, g_sig_set;

/* Stop now: what was printed is flushed whole (stdio's lock: no line is cut), the message names the
 * last committed checkpoint (or is the command's at_once), and the process dies of the signal (the shell's
 * 128 + number). */
static void stop_now(int sig) {
    fflush(stdout);
    fl_fs_tmp_remove_all(); /* before the message: what it says is left is what is left */
    if (g_sigs.at_once) g_sigs.at_once(sig);
    else if (g_sigs.first_stops)
        fprintf(stderr, "fitllm %s: stopped by %s; %s\n", g_sigs.cmd, fl_cli_signal_name(sig),
                g_sigs.left ? g_sigs.left : "nothing was written");
    else {
        char where[2 * FL_CFG_PATH];
        fl_cli_last_checkpoint(g_sigs.out_dir, where, sizeof where);
        fprintf(stderr, "fitllm %s: stopped at once by %s; %s\n", g_sigs.cmd, fl_cli_signal_name(sig), where);
    }
    fflush(stderr);
    fl_cli_die_of(sig);
}

void fl_cli_die_of(int sig) {
    fl_fs_tmp_remove_all(); /* no half-written file or folder left (a checkpoint's, a convert's, a merge's) */
    signal(sig, SIG_DFL);
    /* unblock this signal only: the training thread may be ending the run at this moment, and
     * signals_end's SIGINT (sent to wake this thread) would otherwise be taken here by on_signal,
     * which prints a second message and dies of SIGINT (exit 130 for a SIGTERM: the CLI case
     * sigterm_twice failed so, about 1 run in 10 under load) */
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    pthread_sigmask(SIG_UNBLOCK, &one, NULL);
    raise(sig);
}

static void *signal_thread(void *arg) {
    (void)arg;
    for (;;) {
        int sig;
        if (sigwait(&g_sig_set, &sig) != 0) continue;
        if (g_sig_done) return NULL;
        /* several ranks: mpirun and srun end every rank with SIGTERM when one fails (the others
         * would wait for it in a collective): rank 0 names the last checkpoint and all end now */
        if (sig == SIGTERM && g_sigs.world > 1) fl_cli_faults_term(sig);
        if (g_interrupted || g_sigs.first_stops) { /* the second (or the first of a command without steps): now */
            stop_now(sig == SIGUSR2 ? SIGTERM : sig);
            return NULL;
        }
        on_signal(sig);
    }
}

void fl_cli_signals_begin(const fl_cli_signals *s) {
    g_sigs = *s; /* g_interrupted kept: the launcher's SIGUSR2 may have come while MPI started (fl_cli_signals_early) */
    snprintf(g_resume_msg, sizeof g_resume_msg, "%s", s->at_once_msg ? s->at_once_msg : "fitllm: stopped at once\n");
    snprintf(g_stop_what, sizeof g_stop_what, "%s", s->stop_what ? s->stop_what : "stopping after this step");
    const int launched = s->launched;
    int nt = s->threads;
    sigemptyset(&g_sig_set);
    sigaddset(&g_sig_set, SIGINT);
    sigaddset(&g_sig_set, SIGTERM);
    sigaddset(&g_sig_set, SIGUSR1);
    if (launched) sigaddset(&g_sig_set, SIGUSR2);
    pthread_sigmask(SIG_BLOCK, &g_sig_set, &g_sig_old);
    if (omp_get_max_threads() > nt) nt = omp_get_max_threads();
#pragma omp parallel num_threads(nt)
    { /* nothing: the pool's threads exist from now on, the signals blocked */ }
    /* a thread started before this (MPI's, an earlier OpenMP pool) takes them by the handler, which passes them on */
    signal(SIGINT, on_signal_async);
    signal(SIGUSR1, on_signal_async);
    if (g_sigs.world <= 1) signal(SIGTERM, on_signal_async);
    if (launched) signal(SIGUSR2, on_signal_async);
    g_sig_done = 0;
    if (pthread_create(&g_sig_thread, NULL, signal_thread, NULL) != 0) pthread_sigmask(SIG_SETMASK, &g_sig_old, NULL);
    else g_thread_live = 1;
}

void fl_cli_signals_end(void) {
    const int launched = g_sigs.launched;
    const int live = g_thread_live;
    g_thread_live = 0;
    g_sig_done = 1;
    if (live) {
        pthread_kill(g_sig_thread, SIGINT);
        pthread_join(g_sig_thread, NULL);
    }
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGUSR1, SIG_DFL);
    if (launched) signal(SIGUSR2, SIG_DFL);
    pthread_sigmask(SIG_SETMASK, &g_sig_old, NULL);
}

void fl_cli_signals_early(int sig) { signal(sig, on_signal_async); }

int fl_cli_interrupted(void) { return g_interrupted; }

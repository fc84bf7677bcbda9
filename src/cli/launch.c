/* Starting the ranks of a data-parallel run that was started without a launcher:
 * `fitllm finetune_full ... --devices 4` on one machine re-executes itself through Open MPI's
 * mpirun (the same command line, -np 4), so a user need not know mpirun's flags. Several nodes
 * cannot be guessed (which hosts?): they get the exact `mpirun --hostfile` command to run. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "fitllm/comm.h"

/* Set in the environment of the ranks we start: a rank that sees it but no launcher variables
 * (an mpirun that is not Open MPI's, which sets other variables) must not launch again. */
#define MARKER "FITLLM_LAUNCHED"

/* Cores this process may run on, counted as Open MPI counts slots: physical cores (hardware
 * threads of one core share a thread_siblings_list), within our affinity mask. */
int fl_cli_usable_cpus(int *physical) {
    cpu_set_t set;
    int n = 0, phys = 0;
    char seen[256][32];
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        for (int cpu = 0; cpu < CPU_SETSIZE; cpu++) {
            if (!CPU_ISSET(cpu, &set)) continue;
            n++;
            char p[128], s[32] = "";
            snprintf(p, sizeof p, "/sys/devices/system/cpu/cpu%d/topology/thread_siblings_list", cpu);
            FILE *f = fopen(p, "r");
            if (!f || !fgets(s, sizeof s, f)) snprintf(s, sizeof s, "cpu%d", cpu);
            if (f) fclose(f);
            s[strcspn(s, "\n")] = 0;
            int dup = 0;
            for (int i = 0; i < phys && !dup; i++) dup = !strcmp(seen[i], s);
            if (!dup && phys < 256) snprintf(seen[phys++], sizeof seen[0], "%s", s);
        }
    }
    if (n == 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        n = c > 0 ? (int)c : 1;
    }
    *physical = phys > 0 ? phys : n;
    return n;
}

/* One argument as a shell reads it back: plain, or in single quotes (' as '\''). */
static size_t put_arg(char *buf, size_t n, size_t o, const char *a) {
    int plain = *a != 0;
    for (const char *c = a; *c; c++)
        if (!strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_=./:,+@%", *c)) plain = 0;
    if (o >= n) return o;
    if (plain) return o + (size_t)snprintf(buf + o, n - o, " %s", a);
    o += (size_t)snprintf(buf + o, n - o, " '");
    for (const char *c = a; *c && o < n; c++)
        o += (size_t)(*c == '\'' ? snprintf(buf + o, n - o, "'\\''") : snprintf(buf + o, n - o, "%c", *c));
    if (o < n) o += (size_t)snprintf(buf + o, n - o, "'");
    return o;
}

static void self_exe(char *exe, size_t n) {
    ssize_t len = readlink("/proc/self/exe", exe, n - 1);
    if (len > 0) exe[len] = 0;
    else snprintf(exe, n, "fitllm");
}

static int executable(const char *p) {
    struct stat st;
    return p && *p && stat(p, &st) == 0 && S_ISREG(st.st_mode) && access(p, X_OK) == 0;
}

/* The mpirun to start the ranks with: $FITLLM_MPIRUN (a path; "none" = do not start ranks), the
 * launcher of the MPI this build was compiled against (CMake's MPIEXEC_EXECUTABLE: it matches the
 * linked library even when PATH holds another MPI's), then mpirun on PATH. 0 when none. */
static int find_mpirun(char *out, size_t n, char *looked, size_t ln) {
    const char *e = getenv("FITLLM_MPIRUN");
    size_t o = 0;
    looked[0] = 0;
    if (e && *e) {
        snprintf(looked, ln, "FITLLM_MPIRUN=%s", e);
        if (!strcmp(e, "none") || !strcmp(e, "0")) return 0;
        if (!executable(e)) return 0;
        snprintf(out, n, "%s", e);
        return 1;
    }
#ifdef FL_MPIEXEC
    /* CMake names mpiexec; Open MPI's mpirun beside it is the same program, under the name users know */
    const char *slash = strrchr(FL_MPIEXEC, '/');
    if (slash) {
        snprintf(out, n, "%.*s/mpirun", (int)(slash - FL_MPIEXEC), FL_MPIEXEC);
        if (executable(out)) return 1;
    }
    o += (size_t)snprintf(looked + o, ln - o, "%s (this build's MPI), ", FL_MPIEXEC);
    if (executable(FL_MPIEXEC)) {
        snprintf(out, n, "%s", FL_MPIEXEC);
        return 1;
    }
#endif
    if (o < ln) snprintf(looked + o, ln - o, "mpirun on PATH");
    const char *path = getenv("PATH");
    if (!path) return 0;
    char *dup = strdup(path);
    if (!dup) return 0;
    int found = 0;
    for (char *save = NULL, *d = strtok_r(dup, ":", &save); d && !found; d = strtok_r(NULL, ":", &save)) {
        snprintf(out, n, "%s/mpirun", *d ? d : ".");
        found = executable(out);
    }
    free(dup);
    return found;
}

/* mpirun as a child in a process group of its own, this process staying to take the user's signals:
 * mpirun aborts the job on SIGINT/SIGTERM (exit 1, no checkpoint), so the terminal's Ctrl-C must not
 * reach it. The first SIGINT, SIGTERM or SIGUSR1 becomes SIGUSR2 to mpirun, which forwards it to the
 * ranks: they stop together after the step, commit its checkpoint (train.save_on_signal) and exit 0;
 * this process then names the signal and the checkpoint and exits 128 + the signal. A second signal
 * ends mpirun (it ends the ranks) at once. Without a signal, mpirun's status is the run's; a rank's
 * death (killed, or its error) also names the last committed checkpoint here, whichever rank it was. */
static int run_ranks(const char *cmd, const fl_run_config *cfg, const char *mpirun, char **av, const char *line) {
    sigset_t set, old;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGUSR1);
    sigaddset(&set, SIGCHLD);
    sigprocmask(SIG_BLOCK, &set, &old);
    pid_t pid = fork();
    if (pid < 0) {
        sigprocmask(SIG_SETMASK, &old, NULL);
        fprintf(stderr, "fitllm %s: error: cannot start %s: %s; start the ranks with\n  %s\n", cmd, mpirun,
                strerror(errno), line);
        return FL_EXIT_RUNTIME;
    }
    if (pid == 0) {
        setpgid(0, 0);                         /* out of the terminal's foreground group: no Ctrl-C */
        prctl(PR_SET_PDEATHSIG, SIGTERM);      /* this process killed (SIGKILL): mpirun ends the job */
        int nul = open("/dev/null", O_RDONLY); /* a background group reading the terminal would stop */
        if (nul >= 0) { dup2(nul, STDIN_FILENO); close(nul); }
        sigprocmask(SIG_SETMASK, &old, NULL);
        execv(mpirun, av);
        fprintf(stderr, "fitllm %s: error: cannot run %s: %s; start the ranks with\n  %s\n", cmd, mpirun,
                strerror(errno), line);
        _exit(FL_EXIT_RUNTIME);
    }
    setpgid(pid, pid); /* also here: whichever runs first */
    int first = 0, status = 0;
    for (;;) {
        int sig = 0;
        if (sigwait(&set, &sig) != 0) continue;
        if (sig == SIGCHLD) {
            pid_t w = waitpid(pid, &status, WNOHANG);
            if (w == pid) break;
            continue;
        }
        if (!first) {
            first = sig;
            fprintf(stderr, "\nfitllm: %s: the ranks stop after this step%s (the same signal again, or Ctrl-C, stops "
                    "now)\n", fl_cli_signal_name(sig), cfg->train.save_on_signal ? " and commit its checkpoint" : "");
            kill(pid, SIGUSR2); /* mpirun forwards SIGUSR1/2 to every rank */
        } else {
            fprintf(stderr, "\nfitllm: %s again: stopping the ranks now\n", fl_cli_signal_name(sig));
            kill(pid, SIGTERM); /* mpirun ends every rank */
        }
    }
    sigprocmask(SIG_SETMASK, &old, NULL);
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 1;
    char where[3 * FL_CLI_PATH];
    fl_cli_last_checkpoint(cfg->out_dir, where, sizeof where);
    fflush(stdout);
    if (first) {
        fprintf(stderr, "fitllm %s: stopped by %s%s; %s\n", cmd, fl_cli_signal_name(first),
                code == 0 ? " after the ranks' last step" : " (the ranks ended at once)", where);
        return 128 + first; /* as the shell reports a process killed by it */
    }
    /* 2: a usage error every rank agreed on (printed); 3: out of memory (the breakdown printed) */
    if (code != 0 && code != FL_EXIT_USAGE && code != FL_EXIT_OOM)
        fprintf(stderr, "fitllm %s: error: the ranks failed (mpirun's status %d; its message above names the rank); "
                "%s\n", cmd, code, where);
    return code;
}

int fl_cli_start_ranks(const char *cmd, const fl_run_config *cfg, int argc, char **argv) {
    const int want = cfg->devices * cfg->num_nodes, root = geteuid() == 0;
    int phys, cpus = fl_cli_usable_cpus(&phys);
    char exe[FL_CLI_PATH], args[8192];
    self_exe(exe, sizeof exe);
    size_t ao = 0;
    args[0] = 0;
    for (int i = 0; i < argc; i++) ao = put_arg(args, sizeof args, ao, argv[i]); /* argv[0] is the subcommand */
    const char *root_flag = root ? " --allow-run-as-root" : "";

    if (cfg->num_nodes > 1) {
        /* one cannot guess the hosts: the command with a hostfile, a line "HOST slots=D" per node */
        fflush(stdout);
        fprintf(stderr,
                "fitllm %s: error: --devices %d x --num_nodes %d asks for %d ranks on %d machines, but this process was "
                "not started by a launcher and cannot know the other machines. List them in a hostfile, one line per "
                "node ('HOST slots=%d'), give every node the same fitllm, model and data paths, and run on one of "
                "them:\n  mpirun -np %d --hostfile HOSTS --map-by ppr:%d:node%s --bind-to none %s%s\n"
                "(or srun --mpi=pmix -N %d --ntasks-per-node %d under Slurm; README \"Data-parallel training\")\n",
                cmd, cfg->devices, cfg->num_nodes, want, cfg->num_nodes, cfg->devices, want, cfg->devices, root_flag,
                exe, args, cfg->num_nodes, cfg->devices);
        return FL_EXIT_USAGE;
    }
    const char *oversub = want > phys ? " --oversubscribe" : "";
    char why[3 * FL_CLI_PATH] = "", mpirun[FL_CLI_PATH] = "", looked[FL_CLI_PATH + 64] = "";
    int is_ompi = fl_comm_mpi_built() && !strncmp(fl_comm_mpi_library(), "Open MPI", 8);
    if (!fl_comm_mpi_built())
        snprintf(why, sizeof why, "this fitllm was built without MPI, which multi-process training needs: apt-get "
                 "install openmpi-bin libopenmpi-dev (or `make setup` as root), then configure and build again "
                 "(cmake -S . -B build && cmake --build build; `fitllm --version` shows the MPI built in)");
    else if (getenv(MARKER))
        snprintf(why, sizeof why, "this process was started by fitllm's own mpirun (%s is set) but sees no Open MPI rank "
                 "variables: that mpirun is not the one of the MPI fitllm was built with (set FITLLM_MPIRUN to it)",
                 MARKER);
    else if (!is_ompi)
        snprintf(why, sizeof why, "this build's MPI (%s) is not Open MPI, whose mpirun fitllm knows how to drive",
                 fl_comm_mpi_library());
    else if (!find_mpirun(mpirun, sizeof mpirun, looked, sizeof looked)) {
        const char *e = getenv("FITLLM_MPIRUN");
        if (e && (!strcmp(e, "none") || !strcmp(e, "0"))) snprintf(why, sizeof why, "FITLLM_MPIRUN=%s: told not to", e);
        else snprintf(why, sizeof why, "no mpirun found at %s: apt-get install openmpi-bin, or set FITLLM_MPIRUN", looked);
    }
    if (why[0]) {
        fflush(stdout);
        fprintf(stderr, "fitllm %s: error: --devices %d asks for %d ranks (data parallel), but this process was not "
                "started by a launcher and cannot start them itself (%s); start the ranks with\n  mpirun -np %d%s%s "
                "--bind-to none %s%s\n", cmd, cfg->devices, want, why, want, root_flag, oversub, exe, args);
        return FL_EXIT_USAGE;
    }

    /* threads: --threads (or OMP_NUM_THREADS) given = per rank, as the user wrote it; else the
     * usable CPUs shared out, at least one each (otherwise every rank would start one per core) */
    char omp[64] = "";
    const char *user_omp = getenv("OMP_NUM_THREADS");
    if (user_omp && *user_omp) snprintf(omp, sizeof omp, "OMP_NUM_THREADS=%s", user_omp);
    else snprintf(omp, sizeof omp, "OMP_NUM_THREADS=%d", cpus / want > 0 ? cpus / want : 1);
    /* Open MPI refuses root without --allow-run-as-root; its documentation names the two
     * variables as the equivalent (set here too, for an mpirun that reads them first) */
    if (root) {
        setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
        setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    }
    char *av[64 + 4096];
    int k = 0;
    if (argc > 4096) return fl_cli_usage(cmd, "too many arguments to start ranks with (%d)", argc);
    char np[16], marker[] = MARKER "=1";
    /* the ranks' stdout is mpirun's pseudo-terminal even when mpirun's own goes to a file: tell them
     * which it is, so that a log file gets no progress bar or terminal escapes */
    char tty[] = "FITLLM_STDOUT_TTY=0";
    if (isatty(STDOUT_FILENO)) tty[sizeof tty - 2] = '1';
    snprintf(np, sizeof np, "%d", want);
    av[k++] = mpirun;
    av[k++] = "-np";
    av[k++] = np;
    if (root) av[k++] = "--allow-run-as-root";
    if (*oversub) av[k++] = "--oversubscribe";
    /* Open MPI binds each rank to one core by default (2 ranks or fewer): its OpenMP threads would share it */
    av[k++] = "--bind-to";
    av[k++] = "none";
    av[k++] = "-x";
    av[k++] = omp;
    av[k++] = "-x";
    av[k++] = marker;
    av[k++] = "-x";
    av[k++] = tty;
    av[k++] = exe;
    for (int i = 0; i < argc; i++) av[k++] = argv[i];
    av[k] = NULL;
    char line[8192 + FL_CLI_PATH * 2];
    size_t o = (size_t)snprintf(line, sizeof line, "%s", mpirun);
    for (int i = 1; i < k && o < sizeof line; i++) o = put_arg(line, sizeof line, o, av[i]);
    fflush(stdout);
    fprintf(stderr, "fitllm: starting %d ranks: %s\n", want, line);
    fflush(stderr);
    return run_ranks(cmd, cfg, mpirun, av, line);
}

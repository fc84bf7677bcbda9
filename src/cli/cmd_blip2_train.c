/* `fitllm finetune_full` / `finetune_lora` on a BLIP-2 folder: image-caption fine-tuning through the library's
 * fl_blip2_train (fitllm/blip2_train.h: the data, the loop, checkpoints, resume, DDP). Here: the CLI's signal polling,
 * the progress on stdout, the memory report unless --quiet, and the exit codes and messages of the training commands. */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "fitllm/blip2_train.h"
#include "fitllm/checkpoint.h"

static int poll_signal(void *ud) {
    (void)ud;
    return fl_cli_interrupted();
}

/* after each step but the last (its checkpoint committed): the training commands' fault hooks (ranks.c: testing a
 * full disk with FITLLM_FAULT_DISK_FULL_AFTER_STEP) */
static void after_step(void *ud, long step) { fl_cli_faults_step(ud, step); }

/* Stopped by a signal: rank 0 names the checkpoint to continue from; the exit status the shell's for a process killed
 * by it (130 SIGINT, 143 SIGTERM, 138 SIGUSR1), 0 for fitllm's launcher's request (it reports itself). */
static int stopped_message(const fl_run_config *cfg, const fl_blip2_train_result *res, int rank, const char *cmd) {
    const int sig = res->stopped;
    if (sig == SIGUSR2) return 0;
    char last[4400];
    if (!rank) {
        fflush(stdout);
        if (fl_ckpt_find_latest(cfg->out_dir, last, sizeof last) == FL_OK)
            fprintf(stderr, "fitllm %s: stopped by %s after step %ld; the last checkpoint is '%s': to continue, run the "
                    "same command with --resume auto (out_dir '%s')\n", cmd, fl_cli_signal_name(sig), res->steps,
                    last, cfg->out_dir);
        else
            fprintf(stderr, "fitllm %s: stopped by %s after step %ld, before any checkpoint was committed "
                    "(train.save_interval %d, train.save_on_signal %s): nothing to resume from\n", cmd,
                    fl_cli_signal_name(sig), res->steps, cfg->train.save_interval,
                    cfg->train.save_on_signal ? "true" : "false");
    }
    return 128 + sig;
}

int fl_cli_blip2_train(const char *cmd, const fl_run_config *cfg, fl_comm *comm) {
    const int rank = comm ? fl_comm_rank(comm) : 0, world = comm ? fl_comm_size(comm) : 1;
    fl_blip2_train_opts o;
    memset(&o, 0, sizeof o);
    o.comm = comm;
    o.out = stdout;
    o.report = cfg->quiet ? NULL : stdout;
    o.stop = poll_signal;
    o.stop_ud = (void *)cfg;
    o.after_step = after_step;
    fl_blip2_train_result res;
    const fl_status s = fl_blip2_train(cfg, &o, &res);
    /* the training commands' exit codes: configuration problems (bad values, a missing file, what is not built) 2.
     * DDP: a failure in training (an image one rank read) ends the job (fl_comm_abort names the rank: the others
     * wait in the next reduction); one every rank hits the same way before any reduction (a refused --resume) is
     * rank 0's to say */
    const int usage = s == FL_ERR_INVALID || s == FL_ERR_NOT_FOUND || s == FL_ERR_UNSUPPORTED;
    int rc = 0;
    if (s != FL_OK) {
        rc = usage ? FL_EXIT_USAGE : s == FL_ERR_OOM ? FL_EXIT_OOM : FL_EXIT_RUNTIME;
        fl_mem_pool oom; /* the breakdown of an out-of-memory failure (fl_mem_print_oom reads the record alone) */
        memset(&oom, 0, sizeof oom);
        oom.oom = res.oom;
        /* a failure after the set-up (a full disk, a file that cannot be written) names the checkpoint to continue
         * from, as the trainer's commands do (cmd_train.c) */
        char msg[1024 + 3 * FL_CLI_PATH];
        const int where = res.set_up && !usage && s != FL_ERR_OOM && s != FL_ERR_NONFINITE;
        if (where) {
            char err[1024], last[2 * FL_CLI_PATH];
            snprintf(err, sizeof err, "%s", fl_error_message()); /* before the checkpoint scan sets another */
            fl_cli_last_checkpoint(cfg->out_dir, last, sizeof last);
            snprintf(msg, sizeof msg, "%s; %s", err, last);
        } else {
            snprintf(msg, sizeof msg, "%s", fl_error_message());
        }
        if (!res.quiet && (!rank || !res.set_up || !usage)) {
            if (where) {
                fflush(stdout);
                fprintf(stderr, "fitllm %s: error: %s\n", cmd, msg);
            } else {
                fl_cli_fail(cmd, s, usage ? NULL : &oom);
            }
        }
        if (world > 1 && res.set_up && !usage) fl_comm_abort(comm, rc, msg);
    }
    if (s == FL_OK && res.stopped) rc = stopped_message(cfg, &res, rank, cmd);
    return rc;
}

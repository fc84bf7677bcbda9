#define _POSIX_C_SOURCE 200809L /* getline */
/* Metrics logger: out_dir/logs/metrics.csv (or .jsonl), one row per log line
 * or evaluation, flushed as written so a crash loses nothing already logged. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fitllm/trainer.h"
#include "metrics.h"

static const char *k_cols[] = {"iter", "step", "epoch", "loss", "iter_time", "tokens", "total_tokens",
                               "learning_rate", "val_loss", "val_ppl", "tok_s", "mem_params", "mem_grads",
                               "mem_optim", "mem_acts", "mem_workspace", "mem_other", "mem_peak", "comm_sent"};
#define N_COLS (sizeof k_cols / sizeof k_cols[0])

/* The iteration a logged line belongs to: the first CSV field, or JSONL's "iter". -1 if none. */
static long line_iter(const char *line, int jsonl) {
    const char *p = line;
    if (jsonl) {
        p = strstr(line, "\"iter\":");
        if (!p) return -1;
        p += 7;
    }
    char *end;
    long v = strtol(p, &end, 10);
    return end == p ? -1 : v;
}

/* A resumed run continues from the checkpoint's iteration: rows logged after it (by the
 * run that went on past its last checkpoint) are dropped, so no iteration appears twice. */
static fl_status keep_upto(const char *path, int jsonl, long keep_iter) {
    FILE *in = fopen(path, "r");
    if (!in) return FL_OK; /* nothing logged yet */
    char tmp[4400];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *out = fopen(tmp, "w");
    if (!out) { fclose(in); return fl_errorf(FL_ERR_IO, "%s: cannot write: %s", tmp, strerror(errno)); }
    char *line = NULL;
    size_t cap = 0;
    long n = 0;
    ssize_t len;
    int bad = 0;
    while ((len = getline(&line, &cap, in)) > 0) {
        long it = line_iter(line, jsonl);
        int header = !jsonl && n == 0 && it < 0;
        n++;
        if (!header && (it < 0 || it > keep_iter)) continue;
        if (fwrite(line, 1, (size_t)len, out) != (size_t)len) bad = 1;
    }
    free(line);
    fclose(in);
    if (fclose(out) != 0 || bad) { remove(tmp); return fl_errorf(FL_ERR_IO, "%s: write failed", tmp); }
    if (rename(tmp, path) != 0) return fl_errorf(FL_ERR_IO, "%s: cannot replace: %s", path, strerror(errno));
    return FL_OK;
}

fl_status fl_metrics_open(fl_metrics *mt, const char *out_dir, const char *kind, int append, long keep_iter) {
    memset(mt, 0, sizeof *mt);
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/logs", out_dir);
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return fl_errorf(FL_ERR_IO, "%s: cannot create: %s", dir, strerror(errno));
    mt->jsonl = !strcmp(kind, "jsonl");
    snprintf(mt->path, sizeof mt->path, "%s/metrics.%s", dir, mt->jsonl ? "jsonl" : "csv");
    if (append && keep_iter >= 0) FL_TRY(keep_upto(mt->path, mt->jsonl, keep_iter));
    struct stat st;
    int exists = stat(mt->path, &st) == 0 && st.st_size > 0;
    mt->f = fopen(mt->path, append ? "a" : "w");
    if (!mt->f) return fl_errorf(FL_ERR_IO, "%s: cannot open: %s", mt->path, strerror(errno));
    if (!mt->jsonl && !(append && exists)) {
        for (size_t i = 0; i < N_COLS; i++) fprintf(mt->f, "%s%s", i ? "," : "", k_cols[i]);
        fputc('\n', mt->f);
        fflush(mt->f);
    }
    return FL_OK;
}

void fl_metrics_row(fl_metrics *mt, const fl_metrics_values *v) {
    if (!mt->f) return;
    const int ranks = mt->ranks > 1 ? mt->ranks : 1;
    double vals[N_COLS] = {(double)v->iter, (double)v->step, (double)v->epoch, v->loss, v->iter_time,
                           (double)v->total_tokens / ranks, (double)v->total_tokens, v->learning_rate, v->val_loss,
                           fl_trainer_perplexity(v->val_loss), v->tok_s}; /* beyond a sane range: inf */
    for (int t = 0; t < 6; t++) vals[11 + t] = (double)v->mem[t];
    vals[17] = (double)v->mem_peak;
    vals[18] = v->comm_sent;
    int present[N_COLS];
    for (size_t i = 0; i < N_COLS; i++) present[i] = !isnan(vals[i]);
    if (mt->jsonl) {
        fputc('{', mt->f);
        int first = 1;
        for (size_t i = 0; i < N_COLS; i++) {
            if (!present[i]) continue;
            /* inf as Python's json writes it (JSON has no spelling for it) */
            if (isinf(vals[i])) fprintf(mt->f, "%s\"%s\": %sInfinity", first ? "" : ", ", k_cols[i], vals[i] < 0 ? "-" : "");
            else fprintf(mt->f, "%s\"%s\": %.10g", first ? "" : ", ", k_cols[i], vals[i]);
            first = 0;
        }
        fputs("}\n", mt->f);
    } else {
        for (size_t i = 0; i < N_COLS; i++) {
            if (i) fputc(',', mt->f);
            if (present[i]) fprintf(mt->f, "%.10g", vals[i]);
        }
        fputc('\n', mt->f);
    }
    fflush(mt->f);
}

void fl_metrics_close(fl_metrics *mt) {
    if (mt->f) fclose(mt->f);
    mt->f = NULL;
}

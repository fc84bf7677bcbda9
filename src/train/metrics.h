/* Private to src/train: the metrics logger (CSV or JSONL). */
#ifndef FL_METRICS_H
#define FL_METRICS_H

#include <stdio.h>

#include "fitllm/status.h"

typedef struct {
    FILE *f;
    int jsonl;
    char path[4300];
} fl_metrics;

/* NaN = column absent in this row. */
typedef struct {
    long iter, step, epoch;
    double loss, iter_time, learning_rate, val_loss, tok_s;
    long long tokens, total_tokens;
    double mem[6];
    double mem_peak;
    double comm_sent;   /* bytes this rank sent in the step (fl_comm_traffic), on the step's last row of a
                         * multi-rank run; NaN otherwise (mem_values sets it) */
} fl_metrics_values;

/* append: continue the file of a resumed run, keeping only its rows of iterations <= keep_iter
 * (the checkpoint's; -1 keeps all); else start a new file. */
fl_status fl_metrics_open(fl_metrics *mt, const char *out_dir, const char *kind, int append, long keep_iter);
void fl_metrics_row(fl_metrics *mt, const fl_metrics_values *v);
void fl_metrics_close(fl_metrics *mt);

#endif

/* Private to src/train: the metrics logger (CSV or JSONL). */
#ifndef FL_METRICS_H
#define FL_METRICS_H

#include <stdio.h>

#include "fitllm/status.h"

typedef struct {
    FILE *f;
    int jsonl;
    int ranks;          /* data-parallel ranks (the opener sets it; 0 counts as 1): tokens = total_tokens / ranks */
    char path[4300];
} fl_metrics;

/* One row; NaN = column absent in this row. The columns and their units are README's "Logs and metrics" (one schema
 * for every trainer, LitGPT's meanings): iter = iterations so far (micro-batches, every rank's counted), step =
 * optimizer steps done after this iteration (0 until the first step's last micro-batch), epoch from 0, iter_time in
 * seconds, tok_s tokens per second on one rank, tokens = this rank's share of total_tokens (total / ranks, LitGPT's
 * total_tokens = tokens x world size), mem_* bytes, comm_sent bytes. */
typedef struct {
    long iter, step, epoch;
    double loss, iter_time, learning_rate, val_loss, tok_s;
    long long total_tokens; /* every rank's tokens so far */
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

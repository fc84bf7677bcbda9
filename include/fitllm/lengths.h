/* Sample lengths drawn from a measured length table (issue 33): recipes/data/alpaca-lengths.tsv holds
 * the quantiles of Alpaca's sample lengths (tokens); the sampler draws lengths from the piecewise-linear
 * inverse CDF through those points, as a pure function of (seed, split, index), so the Synthetic data of
 * a run (data.lengths) and `fitllm plan` see the same lengths and the same longest sample. */
#ifndef FITLLM_LENGTHS_H
#define FITLLM_LENGTHS_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FL_LENGTHS_MAX_ROWS 256

typedef struct {
    int n;                          /* rows: quantile 0 first, quantile 1 last */
    double q[FL_LENGTHS_MAX_ROWS];  /* strictly increasing in [0, 1] */
    int len[FL_LENGTHS_MAX_ROWS];   /* non-decreasing, >= 2 tokens */
    char path[4096];
} fl_lengths;

/* Parse a table: '#' lines are comments, every other non-blank line is "quantile<TAB or spaces>length".
 * Errors name the file and line (FL_ERR_FORMAT; FL_ERR_NOT_FOUND when it cannot be opened). */
fl_status fl_lengths_load(const char *path, fl_lengths *out);
/* The length at probability u in [0, 1]: linear between the table's points, rounded to the nearest token. */
int fl_lengths_at(const fl_lengths *t, double u);
/* Sample `index` of `split` (0 train, 1 val) for this seed: fl_lengths_at(u) with u uniform from a hash. */
int fl_lengths_draw(const fl_lengths *t, uint64_t seed, int split, uint64_t index);
/* The longest of n_train + n_val draws, each cut to cap tokens (cap <= 0: no cap): what sizes the trainer's
 * activations (its T is this minus one). */
int fl_lengths_longest(const fl_lengths *t, uint64_t seed, size_t n_train, size_t n_val, int cap);

#ifdef __cplusplus
}
#endif
#endif

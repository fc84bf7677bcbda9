/* fitllm: pipeline parallelism's building blocks (issue 35 item 2; EXPERIMENTAL: the trainer does not run
 * --pipeline_parallel yet).
 *
 * A pipeline of S stages holds contiguous blocks of the model's layers (fl_pp_split balances them by a per-layer
 * cost); a step's M micro-batches (the gradient accumulation steps) flow forward through the stages and their
 * gradients backward, the activations and activation gradients between neighbouring stages travelling with
 * fl_comm_send / fl_comm_recv. fl_pp_schedule_ops gives each stage's order of work:
 *   GPipe: every forward, then every backward (M micro-batches' activations in flight at each stage);
 *   1F1B:  stage s runs min(S - s - 1, M) warm-up forwards, then alternates one forward and one backward, then
 *          the remaining backwards: at most min(S - s, M) micro-batches in flight (stage 0 the most).
 * In both, a stage's backwards run in micro-batch order 0, 1, ..., M - 1, the order a single process accumulates
 * its micro-batches' gradients in, so a pipeline's gradient sums are the single process's bit for bit where each
 * layer's math is unchanged (tests/test_pp.c runs a toy pipeline over threads and checks exactly that). */
#ifndef FITLLM_PP_H
#define FITLLM_PP_H

#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { FL_PP_GPIPE = 0, FL_PP_1F1B, FL_PP_SCHEDULE_COUNT } fl_pp_schedule;
typedef enum { FL_PP_FWD = 0, FL_PP_BWD } fl_pp_kind;
typedef struct {
    fl_pp_kind kind;
    int mb; /* micro-batch 0 .. M - 1 */
} fl_pp_op;

/* "gpipe", "1f1b"; and the reverse (FL_ERR_INVALID naming the choices). */
const char *fl_pp_schedule_name(fl_pp_schedule k);
fl_status fl_pp_schedule_parse(const char *name, fl_pp_schedule *out);

/* Stage `stage`'s 2 M operations in order into ops[0 .. 2 M). FL_ERR_INVALID for stages < 1, stage outside
 * [0, stages), micro < 1. */
fl_status fl_pp_schedule_ops(fl_pp_schedule k, int stages, int stage, int micro, fl_pp_op *ops);
/* The most micro-batches whose forward ran and backward did not, over ops[0 .. n): the activations a stage
 * keeps at once (the planner's "activations in flight"). */
int fl_pp_in_flight(const fl_pp_op *ops, int n);

/* Contiguous stages of n_layers layers: stage s holds layers [first[s], first[s + 1]), first[0] = 0,
 * first[stages] = n_layers, every stage at least one layer, the largest stage cost (sum of cost[] over its layers;
 * NULL: 1 each) as small as it can be; among splits with that cost the later stages take as many layers as they
 * can (stage 0 keeps the most micro-batches' activations under 1F1B). FL_ERR_INVALID naming --pipeline_parallel when stages exceeds n_layers or is below 1, or a cost is negative
 * or not finite. */
fl_status fl_pp_split(int n_layers, const double *cost, int stages, int *first);

#ifdef __cplusplus
}
#endif
#endif

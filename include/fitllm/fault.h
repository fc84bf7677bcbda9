/* fitllm: test-only fault injection (in the spirit of SQLite's sqlite3_test_control).
 *
 * Compiled into the library, off by default: nothing happens until a test arms a fault with fl_fault_set, or the
 * CLI is run with the documented test variable FITLLM_FAULT_GRAD_OVERFLOW (fl_fault_from_env; README, beside
 * FITLLM_FAULT_DISK_FULL_AFTER_STEP). No option
 * or configuration key reaches it.
 *
 * FL_FAULT_GRAD_OVERFLOW: an fp16 overflow in one rank's gradients. At optimizer step `step` (1-based, the
 * trainer's count: skipped steps count, a resumed run continues it) the rank `rank` of the grid (the world
 * communicator's rank; -1: every rank) gets +inf in the first element of its gradient buffer right after the step
 * zeroes it (fl_step_run, the pipeline's fl_pp_step_run: its first chunk), before any backward. The backward
 * accumulates onto it, so it is as if that rank's backward had overflowed: the data-parallel reductions carry it,
 * and each layout's overflow check (the local check_finite, the TP group's / ZeRO-2's / the stages' shared verdict;
 * on a GPU the device's check) must find it and skip the step on every rank. Not under FULL_SHARD / ZeRO-3 (the
 * first reduction replaces the shard's gradient: the injected value is lost).
 *
 * The state is process-wide (the in-process grids' rank threads share it): arm it before the ranks start and clear
 * it after they end. */
#ifndef FITLLM_FAULT_H
#define FITLLM_FAULT_H

#include "fitllm/model.h"
#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { FL_FAULT_GRAD_OVERFLOW = 1 } fl_fault_kind;

#define FL_FAULT_MAX 4 /* faults armed at once */

/* Arm a fault at (rank, step) (rank -1: every rank); FL_ERR_INVALID for step < 1, rank < -1 or a full table. */
fl_status fl_fault_set(fl_fault_kind kind, int rank, long step);
/* Disarm every fault. */
void fl_fault_clear(void);
/* 1 when a fault of this kind is armed at (rank, step). */
int fl_fault_due(fl_fault_kind kind, int rank, long step);
/* Arm what FITLLM_FAULT_GRAD_OVERFLOW says (unset or empty: nothing): a comma-separated list of STEP[:RANK] (RANK
 * omitted: every rank), each an FL_FAULT_GRAD_OVERFLOW. A malformed value is an error naming the variable. */
fl_status fl_fault_from_env(void);

/* FL_FAULT_GRAD_OVERFLOW's injection: +inf (in the buffer's dtype) into element 0 of m's gradient buffer (the
 * adapters' under LoRA) through the backend (device memory too). */
fl_status fl_fault_overflow_grads(fl_model *m);

/* The step's side: a fault is a plug-in, as the other optional features are. The trainer's set-up installs the query
 * fl_fault_at only when a fault is armed (fl_fault_armed), and each step's context (fl_step_ctx.fault, fitllm/train.h)
 * gets what it returns: the injection due for this rank at this step (fl_fault_overflow_grads), or NULL. A run with
 * nothing armed never enters this module. */
typedef fl_status (*fl_fault_fn)(fl_model *m);
int fl_fault_armed(void);
fl_fault_fn fl_fault_at(int rank, long step);

#ifdef __cplusplus
}
#endif
#endif

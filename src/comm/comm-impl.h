/* Internal to src/comm/: what the implementations share (the one reduction kernel that makes
 * them bit-identical, scratch, messages). */
#ifndef FITLLM_COMM_IMPL_H
#define FITLLM_COMM_IMPL_H

#include <stdarg.h>

#include "fitllm/comm.h"

/* dst[i] = op over r = 0..n-1 (in that order) of src[r][i], i < len, for dtype dt (F32, BF16 or
 * F16). Accumulates in fp32 (16-bit widened exactly), AVG divides the sum by n in fp32, and the result
 * is rounded to dt once. dst may alias any src[r] at the same index (blocks are staged in a
 * stack accumulator). The same function runs in every implementation: that, with the fixed rank
 * order, is what makes their results bit-identical. */
void fl_comm_reduce_kernel(void *dst, const void *const *src, int n, size_t len, fl_dtype dt, fl_comm_op op);

/* "all_reduce(count 1000, BF16, sum)" / "broadcast(count 7, F32, root 2)" into buf. */
const char *fl_comm_what(char *buf, size_t n, fl_coll_kind kind, size_t count, fl_dtype dt, fl_comm_op op, int root);

/* Record "comm <impl>: rank R of N: <what>: <fmt...>" and return s. */
fl_status fl_comm_fail(const fl_comm *c, fl_status s, const char *what, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Scratch for pending collectives: from c->pool (WORKSPACE) when set, else malloc. */
fl_status fl_comm_scratch_alloc(fl_comm *c, size_t bytes, void **out);
void fl_comm_scratch_free(fl_comm *c, void *p);

/* A request that is complete when posted (single, staged): made by done_req, released by the
 * implementation's test / wait, which are these two. */
fl_status fl_comm_done_req(fl_comm *c, fl_coll_kind kind, size_t count, fl_dtype dt, fl_comm_op op,
                           fl_comm_req **req);
fl_status fl_comm_done_test(fl_comm *c, fl_comm_req *r, int *done);
fl_status fl_comm_done_wait(fl_comm *c, fl_comm_req *r);

/* Allocate and fill the common fields of a handle (impl-specific fields are the caller's). */
fl_status fl_comm_alloc_handle(const fl_comm_vtable *vt, int rank, int size, fl_comm **out);
/* The same for an implementation over a host communicator (staged, nccl, null): host's rank, size,
 * node-local rank and size and launch, with impl set. */
fl_status fl_comm_alloc_handle_over(const fl_comm_vtable *vt, const fl_comm *host, void *impl, fl_comm **out);
/* Their split: host split (collective over it), then make(part, ud, out) over the part; the part is
 * destroyed if make fails, else the new handle owns it (the caller marks its impl so). */
typedef fl_status (*fl_comm_over_fn)(fl_comm *part, void *ud, fl_comm **out);
fl_status fl_comm_split_over(fl_comm *host, int color, int key, fl_comm_over_fn make, void *ud, fl_comm **out);

/* fl_comm_split's membership, computed alike on every rank of c: every rank's (color, key) travels
 * as bits (one all-gather over c, host memory: not for nccl handles); the ranks with this rank's
 * color ordered by (key, rank in c). *members (malloc'd, *new_size entries): c's rank of each new
 * rank; *new_rank: this rank's place. */
fl_status fl_comm_split_members(fl_comm *c, int color, int key, int *new_rank, int *new_size, int **members);

/* The threads implementation only (any other request: returns at once): block until req's rank can
 * move one of its requests on (every rank reached its stage), req is complete, the group broke, or max_s
 * seconds passed. Moves no data and never breaks the group (fl_comm_test then does the work): the NCCL
 * stand-in's blocking wait (src/comm/nccl_standin.c), so its ranks sleep instead of polling. */
fl_status fl_comm_threads_idle_wait(fl_comm_req *req, double max_s);

/* The message of a wait that reached fl_comm_timeout(): "comm <impl>: rank R of N: <what> did not complete in L s
 * (...): ...; <the note>". Returns buf. */
const char *fl_comm_timeout_text(const fl_comm *c, const char *what, double limit_s, char *buf, size_t n);
/* CLOCK_MONOTONIC in seconds. */
double fl_comm_now_s(void);

#ifdef FL_HAVE_MPI
fl_status fl_comm_mpi_init(fl_comm **out, const fl_launch_info *li, int *argc, char ***argv);
#endif

#endif

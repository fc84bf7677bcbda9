/* fitllm: the one allocator.
 *
 * Every buffer on every device is allocated through a pool with a tag saying
 * what it is for. The pool keeps current and peak bytes per tag and in total,
 * named phase snapshots (before_fwd, after_fwd, after_bwd, after_opt_step) and
 * an optional byte budget: an allocation that would exceed it fails with
 * FL_ERR_OOM and the pool keeps the request and the breakdown at that moment
 * (fl_mem_last_oom) so the CLI can print an exact report.
 *
 * Reserved and live. An allocation's bytes are *reserved* from fl_mem_alloc to
 * fl_mem_free (the counters above, the budget, the OOM record). Its *live*
 * bytes are the part that holds data a later phase still reads: PARAMS, OPTIM,
 * OTHER and GATHER allocations are live in full (weights, optimizer state carried
 * from step to step, the step's token buffers); GRADS, ACTS and WORKSPACE
 * allocations start with nothing live and their owner says what is with
 * fl_mem_set_live (the activation arena after a training forward, the
 * gradients between the step's first gradient write and the optimizer step:
 * see docs/ARCHITECTURE.md "Reserved and live memory"). Snapshots record both,
 * so a report shows activations appear after forward and go after backward
 * even though their arena is reserved once for the whole run.
 *
 * Bytes are counted exactly as requested (alignment padding is not counted),
 * so PARAMS/GRADS/OPTIM equal their analytic counts. The raw allocator is
 * pluggable (host aligned memory by default; CUDA device and pinned-host pools
 * plug in their own raw_alloc/raw_free later, the accounting stays here).
 *
 * Ownership: the pool owns nothing it did not hand out; fl_mem_pool_free()
 * releases the bookkeeping and reports (fl_mem_live_count) what is still live.
 * Not thread-safe: allocate from the driving thread only (kernels never allocate).
 */
#ifndef FITLLM_MEM_H
#define FITLLM_MEM_H

#include <stddef.h>
#include <stdio.h>

#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    FL_TAG_PARAMS = 0, /* model weights (and master copies) */
    FL_TAG_GRADS,      /* parameter gradients */
    FL_TAG_OPTIM,      /* optimizer state */
    FL_TAG_ACTS,       /* activations saved for backward */
    FL_TAG_WORKSPACE,  /* temporaries: activation grads, logits chunks, scratch */
    FL_TAG_OTHER,      /* everything else (token buffers, bookkeeping) */
    FL_TAG_GATHER,     /* FSDP / ZeRO-3: the gathered units' parameters and their unreduced gradients
                        * (src/train/fsdp.c); 0 in every other run */
    FL_TAG_COUNT
} fl_mem_tag;

/* FL_DEV_DISK: a disk pool (fl_mem_disk_pool_init): host-addressable memory whose pages are a file's */
typedef enum { FL_DEV_CPU = 0, FL_DEV_CUDA, FL_DEV_CUDA_HOST, FL_DEV_DISK, FL_DEV_COUNT } fl_device;

const char *fl_mem_tag_name(fl_mem_tag t); /* "PARAMS", ... */

#define FL_MEM_MAX_PHASES 32
#define FL_MEM_PHASE_NAME 32

/* State recorded by fl_mem_snapshot(). `peak*` are the maxima reached since the
 * previous snapshot (or since fl_mem_reset_phases), i.e. during the phase that
 * the snapshot closes, including the moment of the snapshot. */
typedef struct {
    char name[FL_MEM_PHASE_NAME];
    size_t cur[FL_TAG_COUNT];
    size_t cur_total;
    size_t peak[FL_TAG_COUNT];
    size_t peak_total;
    size_t live[FL_TAG_COUNT];  /* bytes holding data still needed (fl_mem_set_live), <= cur */
    size_t live_total;
} fl_mem_phase;

/* Details of the last failed allocation. */
typedef struct {
    int valid;
    fl_mem_tag tag;
    size_t requested;
    size_t budget;     /* 0 = no budget (the OS refused) */
    size_t in_use;     /* total bytes live at the time */
    size_t cur[FL_TAG_COUNT];
    char phase[FL_MEM_PHASE_NAME];
} fl_mem_oom;

typedef void *(*fl_raw_alloc_fn)(size_t bytes, void *ud);
typedef void (*fl_raw_free_fn)(void *ptr, size_t bytes, void *ud);

typedef struct fl_mem_entry fl_mem_entry; /* private */

typedef struct fl_mem_pool {
    char name[32];
    fl_device device;
    size_t budget;                 /* 0 = unlimited */
    size_t cur[FL_TAG_COUNT];
    size_t peak[FL_TAG_COUNT];     /* all-time */
    size_t cur_total, peak_total;  /* all-time peak */
    size_t phase_peak[FL_TAG_COUNT], phase_peak_total; /* since last snapshot */
    size_t live[FL_TAG_COUNT], live_total;             /* now: live bytes (see above) */
    fl_mem_phase phases[FL_MEM_MAX_PHASES];
    int n_phases;
    char phase[FL_MEM_PHASE_NAME]; /* label used in OOM reports */
    fl_mem_oom oom;
    long fail_after;               /* fault injection: -1 off, else allocs left before failure */
    size_t n_allocs;               /* total successful allocations */
    /* private: open-addressing table ptr -> (bytes, tag) */
    fl_mem_entry *tab;
    size_t tab_cap, tab_len;
    fl_raw_alloc_fn raw_alloc;
    fl_raw_free_fn raw_free;
    void *raw_ud;
    /* The host pool paired with this device pool (fl_backend_pools_init): where code that works
     * on this pool's tensors takes its host staging (file reads, conversions, checkpoint
     * writes). NULL: this pool's memory is host memory, staging comes from it too. */
    struct fl_mem_pool *host;
    /* The pool whose counters, budget, fault injection and OOM record this pool's allocations
     * charge (NULL: its own). The memory still comes from this pool's raw allocator. The planner
     * plans a backend with host memory (one pool for tensors and host staging) on the null
     * backend: its tensors get addresses nobody may touch, while the host staging that host code
     * writes must be real memory, charged to the same counters (src/plan/plan.c). */
    struct fl_mem_pool *account;
    /* optional, for raw allocators with state of their own (the disk pool): why the last raw_alloc
     * failed (appended to the OOM message), and the release of raw_ud when the pool is freed */
    const char *(*raw_why)(void *ud);
    void (*raw_done)(void *ud);
} fl_mem_pool;

/* The pool host staging for p's tensors comes from: p->host, or p itself (host memory). */
static inline fl_mem_pool *fl_mem_host_pool(fl_mem_pool *p) { return p && p->host ? p->host : p; }

/* Initialize a host pool (64-byte aligned memory). budget 0 = unlimited. */
fl_status fl_mem_pool_init(fl_mem_pool *p, const char *name, size_t budget);
/* Same with a custom raw allocator (device pools). */
fl_status fl_mem_pool_init_raw(fl_mem_pool *p, const char *name, fl_device dev, size_t budget,
                               fl_raw_alloc_fn a, fl_raw_free_fn f, void *ud);
/* Frees the bookkeeping. Live allocations are released too (and counted as leaks). */
void fl_mem_pool_free(fl_mem_pool *p);

/* A pool on disk (NVMe offload, the host tier's lower level): every allocation is a file of its own in
 * `dir`, created (mkstemp), unlinked at once (nothing is left behind, whatever way the process ends),
 * its blocks reserved (posix_fallocate: a full disk fails here, naming the folder, not later with a
 * SIGBUS on a page that cannot be written) and mapped MAP_SHARED: the memory is the file's pages,
 * which the kernel reads in when touched and may write back and drop, so the process holds only
 * what it touches. A fresh allocation reads as zeros (pool device FL_DEV_DISK: fl_mem_calloc and
 * fl_backend_calloc do not write it). The folder must exist and take a file (checked here). */
fl_status fl_mem_disk_pool_init(fl_mem_pool *p, const char *name, const char *dir);
/* Residency of [ptr, ptr + bytes) of one of a disk pool's allocations, one entry for every advice (as madvise):
 * page-aligned inwards for a release or flush, outwards for the rest; no-ops (FL_OK) on any other pool (a plan's
 * stand-in). FL_DISK_PREFETCH: start reading it in (MADV_WILLNEED: the kernel's read-ahead, asynchronous);
 * FL_DISK_WRITEBACK: start writing its dirty pages (sync_file_range, asynchronous); FL_DISK_RELEASE: write them
 * back and wait, then drop the pages from the process and the page cache (the next touch reads them from the
 * file); FL_DISK_FLUSH: the release outside a training step (a fill at load: written whole, then dropped, so
 * loading a tier larger than the RAM holds one tensor's pages at a time): the tests' injected write failure
 * (FITLLM_TEST_NVME_FAIL_AFTER) does not count it. Only a release or a flush can fail (the write-back). */
typedef enum { FL_DISK_PREFETCH, FL_DISK_WRITEBACK, FL_DISK_RELEASE, FL_DISK_FLUSH } fl_disk_advice;
fl_status fl_mem_disk_advise(fl_mem_pool *p, const void *ptr, size_t bytes, fl_disk_advice what);

/* Allocate `bytes` (may be 0: returns a unique non-NULL pointer) tagged `tag`.
 * On failure *out = NULL and FL_ERR_OOM with a message naming tag, request,
 * budget and the breakdown. Memory is uninitialized; fl_mem_calloc zeroes. */
fl_status fl_mem_alloc(fl_mem_pool *p, fl_mem_tag tag, size_t bytes, void **out);
fl_status fl_mem_calloc(fl_mem_pool *p, fl_mem_tag tag, size_t bytes, void **out);
/* Free a pointer from this pool; NULL is a no-op. */
void fl_mem_free(fl_mem_pool *p, void *ptr);
/* Say that `bytes` of the allocation at ptr hold data still needed (clamped
 * to its size; 0 = nothing). Unknown pointers are ignored. */
void fl_mem_set_live(fl_mem_pool *p, const void *ptr, size_t bytes);
/* Live bytes recorded for ptr (0 if unknown). */
size_t fl_mem_live_of(const fl_mem_pool *p, const void *ptr);
/* One allocation and the bytes of it live after a phase of a training step (SIZE_MAX: all of it; at_least:
 * raise it to that, never lower it: accumulation may hold all of it already). */
typedef struct {
    const void *ptr;
    size_t bytes;
    int at_least;
} fl_mem_live_region;
/* What a phase leaves live, recorded at its boundary (the regions fl_model_live gives): fl_mem_set_live for each
 * region (an at_least one only when that raises it). */
void fl_mem_record_live(fl_mem_pool *p, const fl_mem_live_region *r, int n);
/* A phase boundary of a training step (src/train/step.c), in this order: the n regions' live bytes
 * (fl_mem_record_live), the snapshot `tag` (NULL: none), the label of the phase that follows (`next`, NULL: kept). */
void fl_mem_phase_edge(fl_mem_pool *p, const fl_mem_live_region *r, int n, const char *tag, const char *next);
/* Bytes recorded for a live pointer (0 if unknown). */
size_t fl_mem_size_of(const fl_mem_pool *p, const void *ptr);

size_t fl_mem_live_count(const fl_mem_pool *p);
void fl_mem_set_budget(fl_mem_pool *p, size_t budget);
/* Fault injection for tests: the (n+1)-th allocation from now fails with OOM; -1 disables. */
void fl_mem_fail_after(fl_mem_pool *p, long n);

/* Label the phase now running (used in OOM reports), e.g. "forward". */
void fl_mem_set_phase(fl_mem_pool *p, const char *name);
/* Record a named snapshot; starts a new phase-peak window. */
void fl_mem_snapshot(fl_mem_pool *p, const char *name);
/* Forget snapshots and restart the phase-peak window (peaks stay). */
void fl_mem_reset_phases(fl_mem_pool *p);
const fl_mem_phase *fl_mem_find_phase(const fl_mem_pool *p, const char *name);

/* Print the phase report table (two rows per snapshot: reserved and live
 * bytes per tag and in total, and the phase peak of the reserved bytes)
 * followed by the all-time peak per tag. */
void fl_mem_print_report(const fl_mem_pool *p, FILE *f);
/* Print the OOM breakdown of the last failure (nothing if none). */
void fl_mem_print_oom(const fl_mem_pool *p, FILE *f);

/* Format a byte count as "1.23 GiB" / "512.0 KiB" / "17 B" into buf. */
const char *fl_fmt_bytes(size_t bytes, char *buf, size_t n);
/* Parse "80GB", "512MiB", "1.5G", "1000000B" (SI units: powers of 1000; *iB: 1024;
 * bare K/M/G/T: 1024; B: bytes). Returns 0, -1 (not a size) or -2 (a number without a
 * unit, other than 0: "80" is refused rather than read as 80 bytes). */
int fl_parse_bytes(const char *s, size_t *out);
/* Why fl_parse_bytes refused v, for an error message (names the units to use); returns buf. */
const char *fl_bytes_refusal(const char *v, char *buf, size_t n);

#ifdef __cplusplus
}
#endif
#endif

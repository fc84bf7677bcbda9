/* fitllm CUDA emulator: the fiber scheduler behind cu_compat.h (see cu_emu.h).
 *
 * A block is a set of ucontext fibers, one per CUDA thread, each on its own mmap'd stack. The
 * scheduler (the launching OS thread's own stack) picks a warp, runs its runnable fibers in a
 * freshly shuffled order until each blocks at a barrier or returns, and releases the warp when
 * its live lanes all wait at a warp barrier; warps so advance independently (one may run far
 * ahead) until every live thread waits at __syncthreads, which releases the block. Nothing to
 * run while fibers still wait is a deadlock (a barrier in divergent code): recorded as an error,
 * the block is abandoned. Exited threads count
 * as arrived (as on Volta and later GPUs). AddressSanitizer is told about each stack switch. */
#define _GNU_SOURCE
#include "backend/cuda/emu/cu_emu.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>

#if defined(__SANITIZE_ADDRESS__)
#define FL_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FL_EMU_ASAN 1
#endif
#endif
#ifdef FL_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
/* ASan's redzones need more; and its swapcontext interceptor clears the shadow of the whole
 * target stack at every switch, so a larger stack makes every switch slower */
#define FL_EMU_STACK (128u << 10)
#else
#define FL_EMU_STACK (64u << 10)
#endif
/* The distance between two fibers' stacks: three cache lines more than a stack, so that the fibers' stack tops (where
 * each switch pushes and pops) fall in different cache sets; at a power-of-two distance they all shared one set of
 * L1 and L2 and every switch missed to L3 (half of an emulated step's time in the switch's first pop). */
#define FL_EMU_STRIDE (FL_EMU_STACK + 192u)
#define FL_EMU_MAX_THREADS 1024

/* The fiber switch. glibc's swapcontext saves and restores the signal mask with a system call at
 * every switch (rt_sigprocmask): three quarters of an emulated training step went to it. On
 * x86-64 a switch is the System V ABI's callee-saved registers only: rbx, rbp, r12-r15, pushed on the old stack; the
 * stack pointer is stored and the other's loaded. The MXCSR and x87 control words (callee-saved too) are not switched:
 * every fiber runs on the launching thread with its control words, which nothing in fitllm changes (saving and
 * loading them, stmxcsr / fnstcw / ldmxcsr / fldcw, was four fifths of a switch's time, a quarter of an emulated
 * step's).
 * A fiber is entered the first time through a prepared stack whose "return address" is
 * fiber_main. Elsewhere: ucontext. Under ASan the switches keep their fiber annotations (the
 * interface is made for hand-written switches), and a stack is unpoisoned before it is prepared
 * again for the next block, as the swapcontext interceptor would do. */
#if defined(__x86_64__) && defined(__GNUC__)
#define FL_EMU_FAST_SWITCH 1
void fl_emu_switch(void **save_sp, void *load_sp) __attribute__((visibility("hidden")));
__asm__(".text\n"
        ".p2align 4\n"
        ".globl fl_emu_switch\n"
        ".hidden fl_emu_switch\n"
        ".type fl_emu_switch, @function\n"
        "fl_emu_switch:\n"
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
        "  ret\n"
        ".size fl_emu_switch, .-fl_emu_switch\n");
#endif

enum { RUNNABLE, AT_BLOCK, AT_WARP, DONE };

typedef struct {
#ifdef FL_EMU_FAST_SWITCH
    void *sp; /* saved stack pointer while switched out */
#else
    ucontext_t ctx;
#endif
    fl_cu_emu_dim tid;
    int linear, state;
    int ncp, cp_groups; /* cp.async copies in flight (emu.cp's row), groups committed (see fl_cu_emu_cp_async) */
#ifdef FL_EMU_ASAN
    void *fake; /* ASan's fake stack of this fiber while it is switched out */
#endif
} fiber;

typedef struct {
    fiber *f;
    int nthreads;
    char *stacks;
    size_t stacks_bytes;
#ifdef FL_EMU_FAST_SWITCH
    void *sched_sp;
#else
    ucontext_t sched;
#endif
    fiber *cur;
    fl_cu_emu_dim grid, block, bid;
    void (*fn)(void *);
    void *ctx;
    unsigned char *smem;
    struct cp_rec *cp; /* FL_EMU_CP_MAX a fiber (the launch cache's; NULL if it could not be allocated) */
    uint64_t xchg[FL_EMU_MAX_THREADS];
    unsigned char gat[FL_EMU_MAX_THREADS][FL_CU_EMU_GATHER_MAX]; /* fl_cu_emu_warp_gather's slots */
    int order[FL_EMU_MAX_THREADS];
    int nrun[FL_EMU_MAX_THREADS / 32]; /* each warp's RUNNABLE fibers (run_block's choice without a scan) */
#ifdef FL_EMU_ASAN
    const void *sched_bottom;
    size_t sched_size;
#endif
} emu;

/* cp.async in flight (fl_cu_emu_cp_async): a copy's destination, its bytes as read at the issue, its group (0: not
 * committed yet) */
#define FL_EMU_CP_MAX 256
typedef struct cp_rec {
    unsigned char *dst;
    unsigned char data[16];
    int bytes, group;
} cp_rec;

static __thread emu *g_emu;
static __thread uint64_t g_seed = 0x9e3779b97f4a7c15ull, g_rng, g_switches;
static __thread char g_err[256];
static __thread int g_has_err;

static void set_err(const char *fmt, ...) {
    if (g_has_err) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
    g_has_err = 1;
}

void fl_cu_emu_set_seed(uint64_t seed) { g_seed = seed; g_rng = seed; }
uint64_t fl_cu_emu_get_seed(void) { return g_seed; }
const char *fl_cu_emu_error(void) { return g_has_err ? g_err : NULL; }
void fl_cu_emu_clear_error(void) { g_has_err = 0; g_err[0] = 0; }
uint64_t fl_cu_emu_switches(void) { return g_switches; }

static uint64_t rng_next(void) { /* splitmix64 */
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

const fl_cu_emu_dim *fl_cu_emu_thread_idx(void) { return &g_emu->cur->tid; }
const fl_cu_emu_dim *fl_cu_emu_block_idx(void) { return &g_emu->bid; }
const fl_cu_emu_dim *fl_cu_emu_block_dim(void) { return &g_emu->block; }
const fl_cu_emu_dim *fl_cu_emu_grid_dim(void) { return &g_emu->grid; }
void *fl_cu_emu_dyn_smem(void) { return g_emu->smem; }
int fl_cu_emu_lane(void) { return g_emu->cur->linear & 31; }

/* Fiber side: give control back to the scheduler (state already set). */
static void yield_to_sched(void) {
    emu *e = g_emu;
    fiber *f = e->cur;
    g_switches++;
#ifdef FL_EMU_ASAN
    __sanitizer_start_switch_fiber(&f->fake, e->sched_bottom, e->sched_size);
#endif
#ifdef FL_EMU_FAST_SWITCH
    fl_emu_switch(&f->sp, e->sched_sp);
#else
    swapcontext(&f->ctx, &e->sched);
#endif
#ifdef FL_EMU_ASAN
    __sanitizer_finish_switch_fiber(f->fake, NULL, NULL);
#endif
}

static void fiber_main(void) {
    emu *e = g_emu;
#ifdef FL_EMU_ASAN
    __sanitizer_finish_switch_fiber(NULL, &e->sched_bottom, &e->sched_size);
#endif
    e->fn(e->ctx);
    if (e->cur->ncp) /* on a GPU they would land in shared memory the SM may have given to the next block */
        set_err("thread %d of block (%u,%u,%u) returned with %d cp.async copies not waited for (cp.async.wait_group)",
                e->cur->linear, e->bid.x, e->bid.y, e->bid.z, e->cur->ncp);
    e->cur->state = DONE;
    g_switches++;
#ifdef FL_EMU_ASAN
    __sanitizer_start_switch_fiber(NULL, e->sched_bottom, e->sched_size); /* NULL: this fiber is gone */
#endif
#ifdef FL_EMU_FAST_SWITCH
    void *dead;
    fl_emu_switch(&dead, e->sched_sp); /* never comes back: the stack is re-prepared for a new block */
    __builtin_unreachable();
#else
    setcontext(&e->sched);
#endif
}

void fl_cu_emu_syncthreads(void) {
    g_emu->cur->state = AT_BLOCK;
    yield_to_sched();
}

void fl_cu_emu_syncwarp(void) {
    g_emu->cur->state = AT_WARP;
    yield_to_sched();
}

uint64_t fl_cu_emu_exchange(uint64_t mine, int src_lane) {
    emu *e = g_emu;
    int me = e->cur->linear, base = me & ~31;
    e->xchg[me] = mine;
    fl_cu_emu_syncwarp();
    uint64_t r = mine;
    int src = base + src_lane;
    if (src_lane >= 0 && src_lane < 32 && src < e->nthreads && e->f[src].state != DONE) r = e->xchg[src];
    fl_cu_emu_syncwarp();
    return r;
}

const unsigned char *fl_cu_emu_warp_gather_begin(const void *mine, size_t bytes) {
    emu *e = g_emu;
    int me = e->cur->linear, base = me & ~31, ok = base + 32 <= e->nthreads && bytes <= FL_CU_EMU_GATHER_MAX;
    if (ok) memcpy(e->gat[me], mine, bytes);
    fl_cu_emu_syncwarp();
    for (int l = 0; l < 32 && ok; l++) ok = e->f[base + l].state != DONE;
    if (ok) return e->gat[base];
    set_err("warp gather (mma): thread %d: the whole warp must be live and converged, at most %d bytes", me,
            FL_CU_EMU_GATHER_MAX);
    return NULL;
}

void fl_cu_emu_warp_gather_end(void) { fl_cu_emu_syncwarp(); }

void fl_cu_emu_warp_gather(const void *mine, size_t bytes, void *all) {
    const unsigned char *v = fl_cu_emu_warp_gather_begin(mine, bytes);
    if (v)
        for (int l = 0; l < 32; l++) memcpy((unsigned char *)all + (size_t)l * bytes, v + (size_t)l * FL_CU_EMU_GATHER_MAX, bytes);
    else
        memset(all, 0, 32 * bytes);
    fl_cu_emu_warp_gather_end();
}

/* ---- cp.async (attn_mma.h fl_cu_cp16 / fl_cu_cp8 under the emulator) ----
 * As the GPU promises no more: the destination is undefined from the issue until the issuing thread's
 * cp.async.wait_group completes the copy's group, and the block sees it after a barrier that follows. So the emulator
 * fills the destination with 0xff bytes (a float NaN) at the issue, which a reader of the buffer's previous contents
 * (a missing barrier before the reuse of a double buffer) then gets, and lands the bytes read at the issue only at the
 * wait that completes their group, which a reader before it (a missing wait, or a barrier before the wait) misses. */
void fl_cu_emu_cp_async(void *dst, const void *src, int bytes, int valid) {
    emu *e = g_emu;
    fiber *f = e->cur;
    if (!e->cp) {
        set_err("cp.async: no record space (out of host memory)");
        return;
    }
    if (f->ncp == FL_EMU_CP_MAX || bytes < 1 || bytes > 16) {
        set_err("cp.async: thread %d: %d bytes, %d copies in flight (the emulator holds %d)", f->linear, bytes, f->ncp,
                FL_EMU_CP_MAX);
        return;
    }
    cp_rec *r = &e->cp[(size_t)f->linear * FL_EMU_CP_MAX + (size_t)f->ncp++];
    r->dst = dst, r->bytes = bytes, r->group = 0;
    if (valid) memcpy(r->data, src, (size_t)bytes);
    else memset(r->data, 0, (size_t)bytes);
    memset(dst, 0xff, (size_t)bytes);
}
void fl_cu_emu_cp_commit(void) { /* the uncommitted copies as one group (an empty one when there are none, as PTX) */
    fiber *f = g_emu->cur;
    cp_rec *r = g_emu->cp ? &g_emu->cp[(size_t)f->linear * FL_EMU_CP_MAX] : NULL;
    f->cp_groups++;
    for (int i = 0; i < f->ncp; i++)
        if (r[i].group == 0) r[i].group = f->cp_groups;
}
void fl_cu_emu_cp_wait(int n) { /* every committed group but the newest n lands; the others stay in flight */
    fiber *f = g_emu->cur;
    if (!g_emu->cp || !f->ncp) return;
    cp_rec *r = &g_emu->cp[(size_t)f->linear * FL_EMU_CP_MAX];
    int k = 0;
    for (int i = 0; i < f->ncp; i++) {
        if (r[i].group != 0 && r[i].group <= f->cp_groups - n) memcpy(r[i].dst, r[i].data, (size_t)r[i].bytes);
        else r[k++] = r[i];
    }
    f->ncp = k;
}

static void run_fiber(emu *e, fiber *f) {
    e->cur = f;
    g_switches++;
#ifdef FL_EMU_ASAN
    void *fake = NULL;
    __sanitizer_start_switch_fiber(&fake, (char *)e->stacks + (size_t)f->linear * FL_EMU_STRIDE, FL_EMU_STACK);
#endif
#ifdef FL_EMU_FAST_SWITCH
    fl_emu_switch(&e->sched_sp, f->sp);
#else
    swapcontext(&e->sched, &f->ctx);
#endif
#ifdef FL_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, NULL, NULL);
#endif
}

/* Run the RUNNABLE fibers of warp w (shuffled unless the seed is 0) until each blocks or
 * returns; then release the warp if all its live lanes wait at a warp barrier. */
static void run_warp(emu *e, int w) {
    int end = w + 32 < e->nthreads ? w + 32 : e->nthreads, n = 0, waiting = 0, other = 0;
    for (int i = w; i < end; i++)
        if (e->f[i].state == RUNNABLE) e->order[n++] = i;
    if (g_seed != 0)
        for (int i = n - 1; i > 0; i--) {
            int j = (int)(rng_next() % (uint64_t)(i + 1)), t = e->order[i];
            e->order[i] = e->order[j];
            e->order[j] = t;
        }
    for (int i = 0; i < n; i++) run_fiber(e, &e->f[e->order[i]]);
    for (int i = w; i < end; i++) {
        if (e->f[i].state == AT_WARP) waiting++;
        else if (e->f[i].state != DONE) other++;
    }
    e->nrun[w / 32] = 0; /* each ran until it blocked or returned */
    if (waiting && !other) {
        for (int i = w; i < end; i++)
            if (e->f[i].state == AT_WARP) e->f[i].state = RUNNABLE;
        e->nrun[w / 32] = waiting;
    }
}

static int warp_runnable(const emu *e, int w) { return e->nrun[w / 32] > 0; }

/* One block. Warps progress independently between block barriers, as on a GPU: the scheduler
 * picks one warp with runnable fibers at a time, and (shuffled runs) keeps running the same
 * warp with probability 3/4, so a warp often gets far ahead of the others (a missing barrier
 * between two uses of the same shared memory shows); seed 0 takes the lowest warp every time.
 * Returns 0 when all fibers returned, -1 on a deadlock. */
static int run_block(emu *e) {
    int last = -1;
    for (;;) {
        int cand[FL_EMU_MAX_THREADS / 32], nw = 0;
        for (int w = 0; w < e->nthreads; w += 32)
            if (warp_runnable(e, w)) cand[nw++] = w;
        if (nw) {
            int w = cand[0];
            if (g_seed != 0) {
                uint64_t r = rng_next();
                w = (last >= 0 && warp_runnable(e, last) && (r & 3) != 0) ? last : cand[(r >> 2) % (uint64_t)nw];
            }
            run_warp(e, w);
            last = w;
            continue;
        }
        int live = 0, at_block = 0;
        for (int i = 0; i < e->nthreads; i++) {
            if (e->f[i].state != DONE) live++;
            if (e->f[i].state == AT_BLOCK) at_block++;
        }
        if (live == 0) return 0;
        if (at_block != live) return -1; /* some wait at a warp barrier their warp cannot complete */
        for (int i = 0; i < e->nthreads; i++)
            if (e->f[i].state == AT_BLOCK) e->f[i].state = RUNNABLE, e->nrun[i / 32]++;
        last = -1;
    }
}

/* What a launch needs, kept per OS thread from one launch to the next (grown when a launch needs more): the
 * scheduler's state, the fibers, the stacks and the dynamic shared memory. A fresh mapping per launch page-faulted
 * and zero-filled every fiber's stack top at every launch (a tenth of an emulated step), and the unmapping was as
 * much again. Returned at the thread's exit (a key's destructor); the process's first thread keeps its own. */
typedef struct {
    emu *e;
    fiber *f;
    size_t nf;
    char *stacks;
    size_t stacks_bytes;
    unsigned char *smem;
    size_t smem_bytes;
    cp_rec *cp; /* FL_EMU_CP_MAX records a fiber, ncp fibers' worth */
    size_t ncp;
} emu_cache;
static __thread emu_cache t_cache;
static pthread_key_t g_cache_key;
static pthread_once_t g_cache_once = PTHREAD_ONCE_INIT;

static void cache_release(void *p) {
    emu_cache *c = p;
    if (c->stacks) munmap(c->stacks, c->stacks_bytes);
#ifdef FL_EMU_ASAN
    if (c->smem) __asan_unpoison_memory_region(c->smem, c->smem_bytes);
#endif
    free(c->smem);
    free(c->cp);
    free(c->f);
    free(c->e);
    memset(c, 0, sizeof *c);
}
static void cache_key_make(void) {
    if (pthread_key_create(&g_cache_key, cache_release) != 0) g_cache_key = (pthread_key_t)-1;
}

/* the cache grown to nt fibers and dyn_smem bytes (0: out of host memory) */
static int cache_get(size_t nt, size_t dyn_smem) {
    emu_cache *c = &t_cache;
    if (!c->e) {
        pthread_once(&g_cache_once, cache_key_make);
        if (g_cache_key != (pthread_key_t)-1) pthread_setspecific(g_cache_key, c);
        if (!(c->e = calloc(1, sizeof *c->e))) return 0;
    }
    if (c->nf < nt) {
        fiber *f = realloc(c->f, nt * sizeof *f);
        if (!f) return 0;
        c->f = f, c->nf = nt;
    }
    const size_t sbytes = nt * FL_EMU_STRIDE;
    if (c->stacks_bytes < sbytes) {
        if (c->stacks) munmap(c->stacks, c->stacks_bytes);
        c->stacks = NULL, c->stacks_bytes = 0;
        char *st = mmap(NULL, sbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (st == MAP_FAILED) return 0;
        c->stacks = st, c->stacks_bytes = sbytes;
    }
    if (c->smem_bytes < dyn_smem || !c->smem) {
#ifdef FL_EMU_ASAN
        if (c->smem) __asan_unpoison_memory_region(c->smem, c->smem_bytes);
#endif
        unsigned char *m = realloc(c->smem, dyn_smem ? dyn_smem : 1);
        if (!m) return 0;
        c->smem = m, c->smem_bytes = dyn_smem ? dyn_smem : 1;
    }
    if (c->ncp < nt) { /* the cp.async records (a failure here: a launch that issues one records an error) */
        free(c->cp);
        c->cp = malloc(nt * FL_EMU_CP_MAX * sizeof *c->cp);
        c->ncp = c->cp ? nt : 0;
    }
    return 1;
}

void fl_cu_emu_launch(fl_cu_emu_dim grid, fl_cu_emu_dim block, size_t dyn_smem, void (*fn)(void *), void *ctx) {
    size_t nt = (size_t)block.x * block.y * block.z;
    /* FL_CU_LAUNCH reported an empty or oversized configuration already (fl_cu_emu_launch_ok); these guard the
     * scheduler's arrays for any other caller */
    if (nt == 0 || (size_t)grid.x * grid.y * grid.z == 0) return;
    if (nt > FL_EMU_MAX_THREADS) {
        set_err("launch: %zu threads per block (at most %d)", nt, FL_EMU_MAX_THREADS);
        return;
    }
    if (g_emu) {
        set_err("launch: a kernel launched another kernel (dynamic parallelism is not emulated)");
        return;
    }
    if (!cache_get(nt, dyn_smem)) {
        set_err("launch: out of host memory for %zu fibers", nt);
        return;
    }
    emu *e = t_cache.e;
    fiber *f = t_cache.f;
    char *stacks = t_cache.stacks;
    unsigned char *smem = t_cache.smem;
#ifdef FL_EMU_ASAN
    /* the cached buffer outlives launches of more shared memory: what lies past this launch's dyn_smem bytes is not
     * the block's, so an access there (a kernel indexing past the size its launcher asked) is an ASan error here, as
     * it is out of bounds or another block's memory on a GPU */
    __asan_unpoison_memory_region(smem, dyn_smem);
    if (t_cache.smem_bytes > dyn_smem) __asan_poison_memory_region(smem + dyn_smem, t_cache.smem_bytes - dyn_smem);
#endif
    e->f = f;
    e->nthreads = (int)nt;
    e->stacks = stacks;
    e->stacks_bytes = nt * FL_EMU_STRIDE;
    e->cur = NULL;
    e->grid = grid;
    e->block = block;
    e->fn = fn;
    e->ctx = ctx;
    e->smem = smem;
    e->cp = t_cache.cp;
    g_emu = e;
    if (g_rng == 0) g_rng = g_seed;
    int failed = 0;
    for (unsigned bz = 0; bz < grid.z && !failed; bz++)
        for (unsigned by = 0; by < grid.y && !failed; by++)
            for (unsigned bx = 0; bx < grid.x && !failed; bx++) {
                e->bid = (fl_cu_emu_dim){bx, by, bz};
                memset(smem, 0xff, dyn_smem);
                for (size_t i = 0; i < nt; i++) {
                    fiber *fb = &f[i];
                    fb->linear = (int)i;
                    fb->tid = (fl_cu_emu_dim){(unsigned)(i % block.x), (unsigned)(i / block.x % block.y),
                                              (unsigned)(i / ((size_t)block.x * block.y))};
                    fb->state = RUNNABLE;
                    fb->ncp = fb->cp_groups = 0;
#ifdef FL_EMU_FAST_SWITCH
                    /* the top of the stack as fl_emu_switch leaves it: six callee-saved registers
                     * (zero), then fiber_main as the return address; the zero above it stands for
                     * fiber_main's own return address, so that at its entry rsp + 8 is 16-byte
                     * aligned as the ABI requires */
#ifdef FL_EMU_ASAN
                    __asan_unpoison_memory_region(stacks + i * FL_EMU_STRIDE, FL_EMU_STACK);
#endif
                    uint64_t *top = (uint64_t *)(stacks + i * FL_EMU_STRIDE + FL_EMU_STACK);
                    top[-1] = 0;
                    top[-2] = (uint64_t)(uintptr_t)fiber_main;
                    for (int r = 3; r <= 8; r++) top[-r] = 0;
                    fb->sp = &top[-8];
#else
                    getcontext(&fb->ctx);
                    fb->ctx.uc_stack.ss_sp = stacks + i * FL_EMU_STRIDE;
                    fb->ctx.uc_stack.ss_size = FL_EMU_STACK;
                    fb->ctx.uc_link = NULL; /* fiber_main never returns: it setcontext()s back */
                    makecontext(&fb->ctx, fiber_main, 0);
#endif
                }
                for (size_t w = 0; w < nt; w += 32) e->nrun[w / 32] = (int)(nt - w < 32 ? nt - w : 32);
                if (run_block(e) < 0) {
                    set_err("block (%u,%u,%u): barrier deadlock (a __syncthreads or shuffle not reached by "
                            "every live thread of its block or warp)", bx, by, bz);
                    failed = 1;
                }
            }
    g_emu = NULL;
#ifdef FL_EMU_ASAN
    /* a fiber's last frames (fiber_main's, which never returns) leave their redzones poisoned: clear the
     * shadow before the next launch prepares these stacks again */
    __asan_unpoison_memory_region(stacks, nt * FL_EMU_STRIDE);
#endif
}

/* ---- launch limits and the dynamic shared memory opt-ins (cu_emu.h fl_cu_emu_launch_ok) ---- */
#define FL_EMU_SMEM_DEFAULT 49152u    /* what every kernel may ask without an opt-in */
#define FL_EMU_SMEM_MAX_SM90 232448u  /* cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90 */
enum { FL_EMU_OPTINS = 512 };
static struct {
    uintptr_t key;
    size_t bytes;
} g_optin[FL_EMU_OPTINS];
static int g_noptin;
static size_t g_smem_max; /* 0 until first read: FITLLM_EMU_SMEM_MAX (bytes) or sm_90's */
static pthread_mutex_t g_optin_mu = PTHREAD_MUTEX_INITIALIZER;
static size_t smem_max_locked(void) {
    if (!g_smem_max) {
        const char *e = getenv("FITLLM_EMU_SMEM_MAX");
        char *end = NULL;
        const unsigned long long v = e && *e ? strtoull(e, &end, 10) : 0;
        g_smem_max = v >= FL_EMU_SMEM_DEFAULT && end && !*end ? (size_t)v : FL_EMU_SMEM_MAX_SM90;
    }
    return g_smem_max;
}
static __thread int g_pending;
unsigned long fl_cu_emu_smem_refusals;

void fl_cu_emu_set_smem_max(size_t bytes) {
    pthread_mutex_lock(&g_optin_mu);
    g_smem_max = bytes ? bytes : FL_EMU_SMEM_MAX_SM90;
    pthread_mutex_unlock(&g_optin_mu);
}
size_t fl_cu_emu_smem_max(void) {
    pthread_mutex_lock(&g_optin_mu);
    const size_t m = smem_max_locked();
    pthread_mutex_unlock(&g_optin_mu);
    return m;
}
int fl_cu_emu_take_pending(void) {
    const int p = g_pending;
    g_pending = 0;
    return p;
}
int fl_cu_emu_smem_optin(uintptr_t kernel, size_t bytes) {
    int rc = 0;
    pthread_mutex_lock(&g_optin_mu);
    if (bytes > smem_max_locked()) {
        fl_cu_emu_smem_refusals++;
        g_pending = 1;
        rc = -1;
    } else {
        int i = 0;
        while (i < g_noptin && g_optin[i].key != kernel) i++;
        if (i == g_noptin && g_noptin < FL_EMU_OPTINS) g_noptin++;
        if (i < FL_EMU_OPTINS) g_optin[i].key = kernel, g_optin[i].bytes = bytes;
    }
    pthread_mutex_unlock(&g_optin_mu);
    return rc;
}
int fl_cu_emu_launch_ok(uintptr_t kernel, fl_cu_emu_dim grid, fl_cu_emu_dim block, size_t dyn_smem) {
    if (!grid.x || !grid.y || !grid.z || !block.x || !block.y || !block.z) { /* cudaErrorInvalidConfiguration */
        set_err("launch: an empty grid (%u, %u, %u) or block (%u, %u, %u): CUDA refuses it (guard the empty case)",
                grid.x, grid.y, grid.z, block.x, block.y, block.z);
        return 0;
    }
    if (grid.x > 0x7fffffffu || grid.y > 65535u || grid.z > 65535u) {
        set_err("launch: grid (%u, %u, %u) over CUDA's (2^31 - 1, 65535, 65535)", grid.x, grid.y, grid.z);
        return 0;
    }
    if (block.x > 1024u || block.y > 1024u || block.z > 64u ||
        (size_t)block.x * block.y * block.z > FL_EMU_MAX_THREADS) {
        set_err("launch: block (%u, %u, %u): over CUDA's 1024 threads per block or (1024, 1024, 64)", block.x,
                block.y, block.z);
        return 0;
    }
    if (dyn_smem <= FL_EMU_SMEM_DEFAULT) return 1;
    size_t have = 0;
    pthread_mutex_lock(&g_optin_mu);
    for (int i = 0; i < g_noptin; i++)
        if (g_optin[i].key == kernel) have = g_optin[i].bytes;
    pthread_mutex_unlock(&g_optin_mu);
    if (have < dyn_smem) {
        set_err("launch: %zu bytes of dynamic shared memory, over 48 KiB, with the kernel's opt-in at %zu "
                "(cudaFuncSetAttribute(MaxDynamicSharedMemorySize) first)",
                dyn_smem, have ? have : (size_t)FL_EMU_SMEM_DEFAULT);
        return 0;
    }
    return 1;
}

unsigned long fl_cu_emu_convert_launches, fl_cu_emu_convert2d_launches, fl_cu_emu_vec_accesses;
unsigned long fl_cu_emu_dnn_own_buffers, fl_cu_emu_dnn_b16, fl_cu_emu_dnn_b16_grads, fl_cu_emu_dnn_b16_dout;
unsigned long fl_cu_emu_norm_add_launches;
unsigned long fl_cu_emu_gemm_calls, fl_cu_emu_gemm_misaligned;
char fl_cu_emu_gemm_misaligned_what[192];

/* ---- stream capture (CUDA Graphs) ----
 * While this OS thread captures, launches and stream copies are recorded as nodes (a kernel's closure with its
 * arguments by value; a copy's arguments) instead of run; a host read-back or a stream synchronization
 * invalidates the capture, as it does on the GPU. fl_cu_emu_graph_launch runs the nodes in order. */
typedef struct {
    fl_cu_emu_dim grid, block; /* kernel nodes; grid.x == 0: a call node */
    size_t smem;
    void (*fn)(void *);
    void *ctx;
    void (*del)(void *);
} emu_node;
struct fl_cu_emu_graph {
    emu_node *n;
    size_t count, cap;
};
static __thread fl_cu_emu_graph *g_cap;
static __thread const char *g_cap_bad;

static void graph_free_nodes(fl_cu_emu_graph *gr) {
    for (size_t i = 0; i < gr->count; i++)
        if (gr->n[i].del) gr->n[i].del(gr->n[i].ctx);
    free(gr->n);
}

int fl_cu_emu_capture_begin(void) {
    if (g_cap) return -1;
    g_cap = calloc(1, sizeof *g_cap);
    g_cap_bad = NULL;
    return g_cap ? 0 : -1;
}
int fl_cu_emu_capturing(void) { return g_cap != NULL; }

static void capture_push(emu_node nd) {
    if (g_cap_bad) {
        if (nd.del) nd.del(nd.ctx);
        return;
    }
    if (g_cap->count == g_cap->cap) {
        size_t cap = g_cap->cap ? 2 * g_cap->cap : 64;
        emu_node *n = realloc(g_cap->n, cap * sizeof *n);
        if (!n) {
            g_cap_bad = "out of host memory for the graph's nodes";
            if (nd.del) nd.del(nd.ctx);
            return;
        }
        g_cap->n = n, g_cap->cap = cap;
    }
    g_cap->n[g_cap->count++] = nd;
}

void fl_cu_emu_capture_kernel(fl_cu_emu_dim grid, fl_cu_emu_dim block, size_t dyn_smem, void (*fn)(void *), void *ctx,
                              void (*del)(void *)) {
    capture_push((emu_node){grid, block, dyn_smem, fn, ctx, del});
}

void fl_cu_emu_capture_call(void (*fn)(void *), const void *args, size_t bytes) {
    void *c = malloc(bytes ? bytes : 1);
    if (!c) {
        g_cap_bad = "out of host memory for the graph's nodes";
        return;
    }
    memcpy(c, args, bytes);
    capture_push((emu_node){{0, 0, 0}, {0, 0, 0}, 0, fn, c, free});
}

void fl_cu_emu_capture_invalidate(const char *why) {
    if (g_cap && !g_cap_bad) g_cap_bad = why;
}

fl_cu_emu_graph *fl_cu_emu_capture_end(const char **why) {
    fl_cu_emu_graph *gr = g_cap;
    g_cap = NULL;
    if (why) *why = g_cap_bad;
    if (gr && g_cap_bad) {
        graph_free_nodes(gr);
        free(gr);
        gr = NULL;
    }
    g_cap_bad = NULL;
    return gr;
}

unsigned long fl_cu_emu_graph_launches;
void fl_cu_emu_graph_launch(const fl_cu_emu_graph *gr) {
    fl_cu_emu_graph_launches++;
    for (size_t i = 0; i < gr->count; i++) {
        const emu_node *nd = &gr->n[i];
        if (nd->grid.x) fl_cu_emu_launch(nd->grid, nd->block, nd->smem, nd->fn, nd->ctx);
        else nd->fn(nd->ctx);
    }
}

size_t fl_cu_emu_graph_nodes(const fl_cu_emu_graph *gr) { return gr ? gr->count : 0; }

void fl_cu_emu_graph_free(fl_cu_emu_graph *gr) {
    if (!gr) return;
    graph_free_nodes(gr);
    free(gr);
}

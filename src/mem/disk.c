/* The disk pool (include/fitllm/mem.h fl_mem_disk_pool_init): NVMe offload's tier. Each allocation is
 * an unlinked file mapped MAP_SHARED, so its memory is page cache the kernel can write back and drop;
 * the optimizer streams through it piece by piece (src/train/optim.c) and tells the pool which pieces
 * it will touch next (prefetch) and which it is done with (writeback, release), which keeps the
 * process's share of it to a few pieces however large the state is. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fitllm/mem.h"

typedef struct {
    void *base;
    size_t bytes; /* mapped (the request rounded up to pages; at least one page) */
    int fd;
} disk_file;

typedef struct {
    char dir[4096];
    disk_file *f;
    int n, cap;
    char why[4400]; /* the last failure, for the pool's OOM message */
    atomic_long fail_after; /* fault injection (FITLLM_TEST_NVME_FAIL_AFTER): releases left before one fails as a
                             * full disk would, -1 off (atomic: the fetch worker's unit updates release too) */
} disk_ud;

static size_t page_size(void) {
    long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? (size_t)p : 4096;
}

static void *disk_alloc(size_t bytes, void *ud) {
    disk_ud *d = ud;
    const size_t pg = page_size(), len = bytes ? (bytes + pg - 1) / pg * pg : pg;
    d->why[0] = '\0';
    if (d->n == d->cap) {
        int cap = d->cap ? 2 * d->cap : 8;
        disk_file *f = realloc(d->f, (size_t)cap * sizeof *f);
        if (!f) return NULL;
        d->f = f;
        d->cap = cap;
    }
    char path[4200];
    snprintf(path, sizeof path, "%s/.fitllm-offload-XXXXXX", d->dir);
    int fd = mkstemp(path);
    if (fd < 0) {
        snprintf(d->why, sizeof d->why, "nvme offload: cannot create a file in '%s': %s", d->dir, strerror(errno));
        return NULL;
    }
    unlink(path); /* the mapping keeps it; nothing stays behind */
    int e = posix_fallocate(fd, 0, (off_t)len);
    if (e) {
        snprintf(d->why, sizeof d->why, "nvme offload: cannot reserve %zu bytes in '%s': %s", len, d->dir, strerror(e));
        close(fd);
        return NULL;
    }
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        snprintf(d->why, sizeof d->why, "nvme offload: cannot map %zu bytes of a file in '%s': %s", len, d->dir,
                 strerror(errno));
        close(fd);
        return NULL;
    }
    (void)madvise(p, len, MADV_SEQUENTIAL); /* the update walks it in order: read ahead, drop behind */
    d->f[d->n++] = (disk_file){p, len, fd};
    return p;
}

static void disk_free(void *ptr, size_t bytes, void *ud) {
    (void)bytes;
    disk_ud *d = ud;
    for (int i = 0; i < d->n; i++)
        if (d->f[i].base == ptr) {
            munmap(d->f[i].base, d->f[i].bytes);
            close(d->f[i].fd);
            d->f[i] = d->f[--d->n];
            return;
        }
}

static const char *disk_why(void *ud) { return ((disk_ud *)ud)->why; }

static void disk_done(void *ud) {
    disk_ud *d = ud;
    for (int i = 0; i < d->n; i++) { /* leaks the pool reported: still unmapped and closed */
        munmap(d->f[i].base, d->f[i].bytes);
        close(d->f[i].fd);
    }
    free(d->f);
    free(d);
}

fl_status fl_mem_disk_pool_init(fl_mem_pool *p, const char *name, const char *dir) {
    memset(p, 0, sizeof *p);
    if (!dir || !*dir) return fl_errorf(FL_ERR_INVALID, "nvme offload: no folder given (nvme_path)");
    disk_ud *d = calloc(1, sizeof *d);
    if (!d) return fl_errorf(FL_ERR_OOM, "nvme offload: out of host memory");
    if (strlen(dir) >= sizeof d->dir) {
        free(d);
        return fl_errorf(FL_ERR_INVALID, "nvme offload: nvme_path '%.64s...' is too long", dir);
    }
    snprintf(d->dir, sizeof d->dir, "%s", dir);
    /* the tests' stand-in for a disk that fills while the run goes on (the files are reserved at set-up, so a
     * real one fails only through an I/O error of the device): the write-back after N releases fails */
    const char *fa = getenv("FITLLM_TEST_NVME_FAIL_AFTER");
    d->fail_after = fa && fa[0] ? atol(fa) : -1;
    /* the folder takes a file: a clear error now rather than at the optimizer's first allocation */
    void *probe = disk_alloc(1, d);
    if (!probe) {
        fl_status s = fl_errorf(FL_ERR_INVALID, "%s (nvme_path)", d->why); /* a bad option: exit 2 */
        free(d->f);
        free(d);
        return s;
    }
    disk_free(probe, 1, d);
    fl_status s = fl_mem_pool_init_raw(p, name, FL_DEV_DISK, 0, disk_alloc, disk_free, d);
    if (s != FL_OK) {
        disk_done(d);
        return s;
    }
    p->raw_why = disk_why;
    p->raw_done = disk_done;
    return FL_OK;
}

/* The file, offset and page-aligned range of [ptr, ptr + bytes) (inward: only whole pages inside it;
 * outward: every page it touches); NULL when ptr is not one of the pool's. */
static const disk_file *find(const fl_mem_pool *p, const void *ptr, size_t bytes, int inward, uintptr_t *lo,
                             uintptr_t *hi) {
    if (!p || p->device != FL_DEV_DISK || p->raw_alloc != disk_alloc || !bytes) return NULL;
    const disk_ud *d = p->raw_ud;
    const uintptr_t a = (uintptr_t)ptr, b = a + bytes, pg = page_size();
    for (int i = 0; i < d->n; i++) {
        const uintptr_t base = (uintptr_t)d->f[i].base, end = base + d->f[i].bytes;
        if (a < base || b > end) continue;
        *lo = inward ? (a + pg - 1) / pg * pg : a / pg * pg;
        *hi = inward ? b / pg * pg : (b + pg - 1) / pg * pg;
        if (*hi > end) *hi = end;
        return *lo < *hi ? &d->f[i] : NULL;
    }
    return NULL;
}

/* counted: a release the tests' injected failure (FITLLM_TEST_NVME_FAIL_AFTER) counts, i.e. one of a step's */
static fl_status drop(fl_mem_pool *p, const void *ptr, size_t bytes, int counted) {
    uintptr_t lo, hi;
    /* inward: a page shared with a neighbouring piece stays (the neighbour may be in use) */
    const disk_file *f = find(p, ptr, bytes, 1, &lo, &hi);
    if (!f) return FL_OK;
    disk_ud *d = p->raw_ud;
    long left = counted ? atomic_load(&d->fail_after) : -1;
    while (left > 0 && !atomic_compare_exchange_weak(&d->fail_after, &left, left - 1)) {
    }
    if (left == 0)
        return fl_errorf(FL_ERR_IO, "nvme offload: writing back to its file in '%s': %s (injected: "
                         "FITLLM_TEST_NVME_FAIL_AFTER)", d->dir, strerror(ENOSPC));
    if (msync((void *)lo, hi - lo, MS_SYNC) != 0)
        return fl_errorf(FL_ERR_IO, "nvme offload: writing back to its file in '%s': %s", d->dir, strerror(errno));
    (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
    (void)posix_fadvise(f->fd, (off_t)(lo - (uintptr_t)f->base), (off_t)(hi - lo), POSIX_FADV_DONTNEED);
    return FL_OK;
}

fl_status fl_mem_disk_advise(fl_mem_pool *p, const void *ptr, size_t bytes, fl_disk_advice what) {
    if (what == FL_DISK_RELEASE || what == FL_DISK_FLUSH) return drop(p, ptr, bytes, what == FL_DISK_RELEASE);
    uintptr_t lo, hi;
    const disk_file *f = find(p, ptr, bytes, 0, &lo, &hi);
    if (f && what == FL_DISK_PREFETCH) (void)madvise((void *)lo, hi - lo, MADV_WILLNEED);
    else if (f) (void)sync_file_range(f->fd, (off_t)(lo - (uintptr_t)f->base), (off_t)(hi - lo), SYNC_FILE_RANGE_WRITE);
    return FL_OK;
}

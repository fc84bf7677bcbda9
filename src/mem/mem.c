/* The tagged, budgeted allocator; see include/fitllm/mem.h. */
#include "fitllm/mem.h"

#include <ctype.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct fl_mem_entry {
    void *ptr;      /* NULL = empty slot, (void*)1 = tombstone */
    size_t bytes;
    size_t live;    /* bytes holding data still needed (fl_mem_set_live) */
    fl_mem_tag tag;
};

#define TOMB ((void *)1)
#define ALIGN 64

static const char *k_tag[FL_TAG_COUNT] = {"PARAMS", "GRADS", "OPTIM", "ACTS", "WORKSPACE", "OTHER", "GATHER"};

const char *fl_mem_tag_name(fl_mem_tag t) { return (t >= 0 && t < FL_TAG_COUNT) ? k_tag[t] : "?"; }

static void *host_alloc(size_t bytes, void *ud) {
    (void)ud;
    size_t n = (bytes + ALIGN - 1) / ALIGN * ALIGN;
    if (n == 0) n = ALIGN;
    return aligned_alloc(ALIGN, n);
}

static void host_free(void *ptr, size_t bytes, void *ud) {
    (void)bytes; (void)ud;
    free(ptr);
}

fl_status fl_mem_pool_init_raw(fl_mem_pool *p, const char *name, fl_device dev, size_t budget,
                               fl_raw_alloc_fn a, fl_raw_free_fn f, void *ud) {
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s", name ? name : "pool");
    p->device = dev;
    p->budget = budget;
    p->fail_after = -1;
    p->raw_alloc = a;
    p->raw_free = f;
    p->raw_ud = ud;
    p->tab_cap = 64;
    p->tab = calloc(p->tab_cap, sizeof *p->tab);
    if (!p->tab) return fl_errorf(FL_ERR_OOM, "memory pool '%s': cannot allocate bookkeeping", p->name);
    snprintf(p->phase, sizeof p->phase, "setup");
    return FL_OK;
}

fl_status fl_mem_pool_init(fl_mem_pool *p, const char *name, size_t budget) {
    return fl_mem_pool_init_raw(p, name, FL_DEV_CPU, budget, host_alloc, host_free, NULL);
}

static size_t hash_ptr(const void *ptr, size_t cap) {
    uint64_t x = (uint64_t)(uintptr_t)ptr;
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33;
    return (size_t)(x & (cap - 1));
}

static fl_mem_entry *find_slot(const fl_mem_pool *p, const void *ptr) {
    size_t i = hash_ptr(ptr, p->tab_cap);
    for (size_t n = 0; n < p->tab_cap; n++, i = (i + 1) & (p->tab_cap - 1)) {
        fl_mem_entry *e = &p->tab[i];
        if (e->ptr == ptr) return e;
        if (e->ptr == NULL) return NULL;
    }
    return NULL;
}

static int insert_entry(fl_mem_pool *p, void *ptr, size_t bytes, size_t live, fl_mem_tag tag);

static int grow(fl_mem_pool *p) {
    fl_mem_entry *old = p->tab;
    size_t oldcap = p->tab_cap;
    fl_mem_entry *t = calloc(oldcap * 2, sizeof *t);
    if (!t) return -1;
    p->tab = t;
    p->tab_cap = oldcap * 2;
    p->tab_len = 0;
    for (size_t i = 0; i < oldcap; i++)
        if (old[i].ptr && old[i].ptr != TOMB) insert_entry(p, old[i].ptr, old[i].bytes, old[i].live, old[i].tag);
    free(old);
    return 0;
}

static int insert_entry(fl_mem_pool *p, void *ptr, size_t bytes, size_t live, fl_mem_tag tag) {
    if ((p->tab_len + 1) * 2 > p->tab_cap && grow(p) != 0) return -1;
    size_t i = hash_ptr(ptr, p->tab_cap);
    while (p->tab[i].ptr && p->tab[i].ptr != TOMB) i = (i + 1) & (p->tab_cap - 1);
    p->tab[i].ptr = ptr;
    p->tab[i].bytes = bytes;
    p->tab[i].live = live;
    p->tab[i].tag = tag;
    p->tab_len++;
    return 0;
}

static void breakdown(const size_t cur[FL_TAG_COUNT], char *buf, size_t n) {
    size_t off = 0;
    buf[0] = '\0';
    for (int t = 0; t < FL_TAG_COUNT && off < n; t++) {
        char b[32];
        off += (size_t)snprintf(buf + off, n - off, "%s%s %s", t ? ", " : "", k_tag[t],
                                fl_fmt_bytes(cur[t], b, sizeof b));
    }
}

static fl_status fail_oom(fl_mem_pool *p, fl_mem_tag tag, size_t bytes, int os_refused) {
    fl_mem_oom *o = &p->oom;
    o->valid = 1;
    o->tag = tag;
    o->requested = bytes;
    o->budget = os_refused ? 0 : p->budget;
    o->in_use = p->cur_total;
    memcpy(o->cur, p->cur, sizeof o->cur);
    memcpy(o->phase, p->phase, sizeof o->phase);
    char rq[32], bu[32], iu[32], bd[512];
    breakdown(p->cur, bd, sizeof bd);
    fl_fmt_bytes(bytes, rq, sizeof rq);
    fl_fmt_bytes(p->cur_total, iu, sizeof iu);
    if (os_refused)
        return fl_errorf(FL_ERR_OOM,
                         "out of memory on %s during %s: the system refused %s for %s (in use %s: %s)",
                         p->name, p->phase, rq, k_tag[tag], iu, bd);
    fl_fmt_bytes(p->budget, bu, sizeof bu);
    return fl_errorf(FL_ERR_OOM,
                     "out of memory on %s during %s: requested %s for %s, budget %s, in use %s, "
                     "available %s (%s)",
                     p->name, p->phase, rq, k_tag[tag], bu, iu,
                     fl_fmt_bytes(p->budget > p->cur_total ? p->budget - p->cur_total : 0,
                                  (char[32]){0}, 32),
                     bd);
}

fl_status fl_mem_alloc(fl_mem_pool *p, fl_mem_tag tag, size_t bytes, void **out) {
    *out = NULL;
    if (tag < 0 || tag >= FL_TAG_COUNT) return fl_errorf(FL_ERR_INTERNAL, "fl_mem_alloc: bad tag %d", (int)tag);
    fl_mem_pool *a = p->account ? p->account : p; /* whose counters, budget and OOM record */
    if (a->fail_after >= 0) {
        if (a->fail_after == 0) return fail_oom(a, tag, bytes, 1);
        a->fail_after--;
    }
    if (a->budget && (bytes > a->budget || a->cur_total > a->budget - bytes)) return fail_oom(a, tag, bytes, 0);
    void *ptr = p->raw_alloc(bytes, p->raw_ud);
    if (!ptr) {
        fl_status st = fail_oom(a, tag, bytes, 1);
        const char *why = p->raw_why ? p->raw_why(p->raw_ud) : NULL;
        return why && *why ? fl_error_prefix(st, "%s", why) : st;
    }
    /* weights, optimizer state and token buffers hold their data from the start; gradients,
     * activations and scratch hold nothing needed until their owner says so (fl_mem_set_live) */
    size_t live = (tag == FL_TAG_PARAMS || tag == FL_TAG_OPTIM || tag == FL_TAG_OTHER || tag == FL_TAG_GATHER) ? bytes : 0;
    if (insert_entry(p, ptr, bytes, live, tag) != 0) {
        p->raw_free(ptr, bytes, p->raw_ud);
        return fail_oom(a, tag, bytes, 1);
    }
    a->n_allocs++;
    a->cur[tag] += bytes;
    a->cur_total += bytes;
    a->live[tag] += live;
    a->live_total += live;
    if (a->cur[tag] > a->peak[tag]) a->peak[tag] = a->cur[tag];
    if (a->cur_total > a->peak_total) a->peak_total = a->cur_total;
    if (a->cur[tag] > a->phase_peak[tag]) a->phase_peak[tag] = a->cur[tag];
    if (a->cur_total > a->phase_peak_total) a->phase_peak_total = a->cur_total;
    *out = ptr;
    return FL_OK;
}

fl_status fl_mem_calloc(fl_mem_pool *p, fl_mem_tag tag, size_t bytes, void **out) {
    FL_TRY(fl_mem_alloc(p, tag, bytes, out));
    if (p->device == FL_DEV_CPU || p->device == FL_DEV_CUDA_HOST) memset(*out, 0, bytes); /* FL_DEV_DISK: zeros */
    return FL_OK;
}

void fl_mem_free(fl_mem_pool *p, void *ptr) {
    if (!ptr) return;
    fl_mem_entry *e = find_slot(p, ptr);
    if (!e) return; /* not ours: ignore rather than corrupt the counts */
    fl_mem_pool *a = p->account ? p->account : p;
    a->cur[e->tag] -= e->bytes;
    a->cur_total -= e->bytes;
    a->live[e->tag] -= e->live;
    a->live_total -= e->live;
    p->raw_free(ptr, e->bytes, p->raw_ud);
    e->ptr = TOMB;
    p->tab_len--;
}

void fl_mem_set_live(fl_mem_pool *p, const void *ptr, size_t bytes) {
    fl_mem_entry *e = ptr ? find_slot(p, ptr) : NULL;
    if (!e) return;
    if (bytes > e->bytes) bytes = e->bytes;
    fl_mem_pool *a = p->account ? p->account : p;
    a->live[e->tag] = a->live[e->tag] - e->live + bytes;
    a->live_total = a->live_total - e->live + bytes;
    e->live = bytes;
}

size_t fl_mem_live_of(const fl_mem_pool *p, const void *ptr) {
    const fl_mem_entry *e = ptr ? find_slot(p, ptr) : NULL;
    return e ? e->live : 0;
}

void fl_mem_record_live(fl_mem_pool *p, const fl_mem_live_region *r, int n) {
    for (int i = 0; i < n; i++)
        if (!r[i].at_least || r[i].bytes > fl_mem_live_of(p, r[i].ptr)) fl_mem_set_live(p, r[i].ptr, r[i].bytes);
}

void fl_mem_phase_edge(fl_mem_pool *p, const fl_mem_live_region *r, int n, const char *tag, const char *next) {
    fl_mem_record_live(p, r, n);
    if (tag) fl_mem_snapshot(p, tag);
    if (next) fl_mem_set_phase(p, next);
}

size_t fl_mem_size_of(const fl_mem_pool *p, const void *ptr) {
    const fl_mem_entry *e = ptr ? find_slot(p, ptr) : NULL;
    return e ? e->bytes : 0;
}

size_t fl_mem_live_count(const fl_mem_pool *p) { return p->tab_len; }

void fl_mem_pool_free(fl_mem_pool *p) {
    if (!p->tab) return;
    for (size_t i = 0; i < p->tab_cap; i++)
        if (p->tab[i].ptr && p->tab[i].ptr != TOMB) p->raw_free(p->tab[i].ptr, p->tab[i].bytes, p->raw_ud);
    free(p->tab);
    p->tab = NULL;
    p->tab_len = 0;
    if (p->raw_done) p->raw_done(p->raw_ud);
    p->raw_done = NULL;
}

void fl_mem_set_budget(fl_mem_pool *p, size_t budget) { p->budget = budget; }
void fl_mem_fail_after(fl_mem_pool *p, long n) { p->fail_after = n; }

void fl_mem_set_phase(fl_mem_pool *p, const char *name) { snprintf(p->phase, sizeof p->phase, "%s", name); }

void fl_mem_snapshot(fl_mem_pool *p, const char *name) {
    fl_mem_phase *ph;
    const fl_mem_phase *existing = fl_mem_find_phase(p, name);
    if (existing) ph = (fl_mem_phase *)existing; /* a repeated step overwrites its row */
    else if (p->n_phases < FL_MEM_MAX_PHASES) ph = &p->phases[p->n_phases++];
    else return;
    snprintf(ph->name, sizeof ph->name, "%s", name);
    memcpy(ph->cur, p->cur, sizeof ph->cur);
    ph->cur_total = p->cur_total;
    memcpy(ph->peak, p->phase_peak, sizeof ph->peak);
    ph->peak_total = p->phase_peak_total;
    memcpy(ph->live, p->live, sizeof ph->live);
    ph->live_total = p->live_total;
    memcpy(p->phase_peak, p->cur, sizeof p->phase_peak);
    p->phase_peak_total = p->cur_total;
}

void fl_mem_reset_phases(fl_mem_pool *p) {
    p->n_phases = 0;
    memcpy(p->phase_peak, p->cur, sizeof p->phase_peak);
    p->phase_peak_total = p->cur_total;
}

const fl_mem_phase *fl_mem_find_phase(const fl_mem_pool *p, const char *name) {
    for (int i = 0; i < p->n_phases; i++)
        if (strcmp(p->phases[i].name, name) == 0) return &p->phases[i];
    return NULL;
}

const char *fl_fmt_bytes(size_t bytes, char *buf, size_t n) {
    const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)bytes;
    int i = 0;
    while (v >= 1024.0 && i < 4) { v /= 1024.0; i++; }
    if (i == 0) snprintf(buf, n, "%zu B", bytes);
    else snprintf(buf, n, "%.2f %s", v, u[i]);
    return buf;
}

int fl_parse_bytes(const char *s, size_t *out) {
    char *end;
    while (isspace((unsigned char)*s)) s++;
    if (*s == '-' || !*s) return -1;
    double v = strtod(s, &end);
    if (end == s || v < 0) return -1;
    while (isspace((unsigned char)*end)) end++;
    char u[8] = {0};
    size_t k = 0;
    while (*end && k < sizeof u - 1) u[k++] = (char)toupper((unsigned char)*end++);
    if (*end) return -1;
    double mul;
    /* a bare number is refused, zero aside: "--device-memory 80" meant 80 GB, not 80 bytes */
    if (!strcmp(u, "")) {
        if (v != 0) return -2;
        mul = 1;
    } else if (!strcmp(u, "B")) mul = 1;
    else if (!strcmp(u, "K") || !strcmp(u, "KIB")) mul = 1024.0;
    else if (!strcmp(u, "M") || !strcmp(u, "MIB")) mul = 1024.0 * 1024;
    else if (!strcmp(u, "G") || !strcmp(u, "GIB")) mul = 1024.0 * 1024 * 1024;
    else if (!strcmp(u, "T") || !strcmp(u, "TIB")) mul = 1024.0 * 1024 * 1024 * 1024;
    else if (!strcmp(u, "KB")) mul = 1e3;
    else if (!strcmp(u, "MB")) mul = 1e6;
    else if (!strcmp(u, "GB")) mul = 1e9;
    else if (!strcmp(u, "TB")) mul = 1e12;
    else return -1;
    double r = v * mul;
    if (r >= 1.8e19) return -1;
    *out = (size_t)(r + 0.5);
    return 0;
}

const char *fl_bytes_refusal(const char *v, char *buf, size_t n) {
    size_t x;
    if (!v) v = "";
    if (fl_parse_bytes(v, &x) == -2) {
        const char *s = v;
        while (isspace((unsigned char)*s)) s++;
        size_t l = strlen(s);
        while (l && isspace((unsigned char)s[l - 1])) l--;
        snprintf(buf, n, "'%s' has no unit: write %.*sGB (10^9 bytes) or %.*sGiB (2^30 bytes), MB / MiB likewise, or "
                 "%.*sB if you mean bytes", v, (int)l, s, (int)l, s, (int)l, s);
    } else {
        snprintf(buf, n, "'%s' is not a size like 80GB, 24GiB or 512MiB", v);
    }
    return buf;
}

void fl_mem_print_report(const fl_mem_pool *p, FILE *f) {
    char b[32];
    fprintf(f, "memory report (%s): reserved = allocated, live = holding data a later phase still reads\n", p->name);
    fprintf(f, "%-16s %-8s", "phase", "");
    for (int t = 0; t < FL_TAG_COUNT; t++) fprintf(f, " %11s", k_tag[t]);
    fprintf(f, " %11s %11s\n", "total", "phase peak");
    for (int i = 0; i < p->n_phases; i++) {
        const fl_mem_phase *ph = &p->phases[i];
        fprintf(f, "%-16s %-8s", ph->name, "reserved");
        for (int t = 0; t < FL_TAG_COUNT; t++) fprintf(f, " %11s", fl_fmt_bytes(ph->cur[t], b, sizeof b));
        fprintf(f, " %11s", fl_fmt_bytes(ph->cur_total, b, sizeof b));
        fprintf(f, " %11s\n", fl_fmt_bytes(ph->peak_total, b, sizeof b));
        fprintf(f, "%-16s %-8s", "", "live");
        for (int t = 0; t < FL_TAG_COUNT; t++) fprintf(f, " %11s", fl_fmt_bytes(ph->live[t], b, sizeof b));
        fprintf(f, " %11s\n", fl_fmt_bytes(ph->live_total, b, sizeof b));
    }
    fprintf(f, "%-16s %-8s", "peak", "reserved");
    for (int t = 0; t < FL_TAG_COUNT; t++) fprintf(f, " %11s", fl_fmt_bytes(p->peak[t], b, sizeof b));
    fprintf(f, " %11s\n", fl_fmt_bytes(p->peak_total, b, sizeof b));
    if (p->budget) fprintf(f, "budget %s\n", fl_fmt_bytes(p->budget, b, sizeof b));
}

void fl_mem_print_oom(const fl_mem_pool *p, FILE *f) {
    const fl_mem_oom *o = &p->oom;
    if (!o->valid) return;
    char b[32];
    fprintf(f, "out of memory during %s\n", o->phase);
    fprintf(f, "  requested  %s for %s\n", fl_fmt_bytes(o->requested, b, sizeof b), k_tag[o->tag]);
    if (o->budget) {
        fprintf(f, "  budget     %s\n", fl_fmt_bytes(o->budget, b, sizeof b));
        fprintf(f, "  available  %s\n",
                fl_fmt_bytes(o->budget > o->in_use ? o->budget - o->in_use : 0, b, sizeof b));
    }
    fprintf(f, "  in use     %s\n", fl_fmt_bytes(o->in_use, b, sizeof b));
    for (int t = 0; t < FL_TAG_COUNT; t++)
        fprintf(f, "    %-10s %s\n", k_tag[t], fl_fmt_bytes(o->cur[t], b, sizeof b));
}

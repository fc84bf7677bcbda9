/* safetensors reading (mmap + strict validation) and atomic writing; see
 * include/fitllm/io.h. Validation follows the reference implementation
 * (huggingface/safetensors): header length bounded and inside the file,
 * header a JSON object, known dtypes, byte counts matching shapes, ranges
 * contiguous and covering the data section exactly.
 */
#include "fitllm/io.h"
#include "core/fs.h"
#include "fitllm/json.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- reading ------------------------------------------------------------ */

void fl_st_close(fl_st_file *f) {
    if (!f) return;
    if (f->map && f->map_size) munmap(f->map, f->map_size);
    for (int i = 0; i < f->n_tensors; i++) free(f->tensors[i].name);
    free(f->tensors);
    for (int i = 0; i < f->n_meta; i++) { free(f->meta_keys[i]); free(f->meta_vals[i]); }
    free(f->meta_keys);
    free(f->meta_vals);
    free(f->owned);
    free(f->path);
    memset(f, 0, sizeof *f);
}

const fl_st_tensor *fl_st_find(const fl_st_file *f, const char *name) {
    if (!f || !name) return NULL;
    for (int i = 0; i < f->n_tensors; i++)
        if (strcmp(f->tensors[i].name, name) == 0) return &f->tensors[i];
    return NULL;
}

static char *fl_st_strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/* Non-negative integer JSON number -> size_t. */
static int fl_st_get_uint(const fl_json *j, uint64_t *out) {
    if (!j || j->type != FL_JSON_NUMBER || !j->is_int || j->i < 0) return -1;
    *out = (uint64_t)j->i;
    return 0;
}

static fl_status fl_st_parse_tensor(fl_st_file *f, const fl_json *e, fl_st_tensor *t) {
    const char *path = f->path, *name = e->key;
    if (e->type != FL_JSON_OBJECT)
        return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': header entry is not an object", path, name);
    const fl_json *dt = fl_json_get(e, "dtype"), *sh = fl_json_get(e, "shape"), *off = fl_json_get(e, "data_offsets");
    if (!dt || dt->type != FL_JSON_STRING)
        return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': missing or non-string \"dtype\"", path, name);
    if (fl_dtype_parse(dt->str, &t->dtype) != 0)
        return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': unknown dtype '%s' (known: F32, BF16, F16, F64, I32, I64, U8)",
                         path, name, dt->str);
    if (!sh || sh->type != FL_JSON_ARRAY)
        return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': missing or non-array \"shape\"", path, name);
    if (sh->len > 8)
        return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': shape has %zu dimensions (at most 8 supported)", path, name, sh->len);
    t->ndim = (int)sh->len;
    uint64_t numel = 1;
    int overflow = 0;
    int d = 0;
    for (const fl_json *c = sh->child; c; c = c->next, d++) {
        uint64_t v;
        if (fl_st_get_uint(c, &v))
            return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': shape[%d] is not a non-negative integer", path, name, d);
        t->shape[d] = (int64_t)v;
        if (v && numel > UINT64_MAX / v) overflow = 1;
        numel *= v;
    }
    if (!off || off->type != FL_JSON_ARRAY || off->len != 2)
        return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': \"data_offsets\" must be an array [begin, end]", path, name);
    uint64_t b, en;
    if (fl_st_get_uint(fl_json_at(off, 0), &b) || fl_st_get_uint(fl_json_at(off, 1), &en))
        return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': data_offsets must be non-negative integers", path, name);
    if (b > en)
        return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': data_offsets begin %llu > end %llu", path, name,
                         (unsigned long long)b, (unsigned long long)en);
    if (en > f->data_size)
        return fl_errorf(FL_ERR_FORMAT,
                         "%s: tensor '%s': data_offsets end %llu is past the end of the data section (%zu bytes; "
                         "file truncated?)",
                         path, name, (unsigned long long)en, f->data_size);
    size_t es = fl_dtype_size(t->dtype);
    if (overflow || (es && numel > UINT64_MAX / es)) { /* the byte count itself does not fit 64 bits */
        char shp[200];
        size_t o = 0;
        for (int k = 0; k < t->ndim && o < sizeof shp; k++)
            o += (size_t)snprintf(shp + o, sizeof shp - o, "%s%lld", k ? ", " : "", (long long)t->shape[k]);
        return fl_errorf(FL_ERR_FORMAT,
                         "%s: tensor '%s': shape [%s] of %s overflows: it would need more than 2^64 bytes (data_offsets "
                         "span %llu bytes)", path, name, shp, fl_dtype_name(t->dtype), (unsigned long long)(en - b));
    }
    if (numel * es != en - b)
        return fl_errorf(FL_ERR_FORMAT,
                         "%s: tensor '%s': shape needs %llu bytes (%llu elements of %s) but data_offsets span %llu bytes",
                         path, name, (unsigned long long)(numel * es), (unsigned long long)numel,
                         fl_dtype_name(t->dtype), (unsigned long long)(en - b));
    t->begin = (size_t)b;
    t->end = (size_t)en;
    t->data = f->data + b;
    return FL_OK;
}

static fl_status fl_st_parse_meta(fl_st_file *f, const fl_json *m) {
    if (m->type != FL_JSON_OBJECT)
        return fl_errorf(FL_ERR_FORMAT, "%s: key '__metadata__' must be an object of strings", f->path);
    if (m->len == 0) return FL_OK;
    f->meta_keys = calloc(m->len, sizeof(char *));
    f->meta_vals = calloc(m->len, sizeof(char *));
    if (!f->meta_keys || !f->meta_vals) return fl_errorf(FL_ERR_OOM, "%s: out of memory", f->path);
    for (const fl_json *c = m->child; c; c = c->next) {
        if (c->type != FL_JSON_STRING)
            return fl_errorf(FL_ERR_FORMAT, "%s: __metadata__ key '%s': value must be a string", f->path, c->key);
        f->meta_keys[f->n_meta] = fl_st_strdup(c->key);
        f->meta_vals[f->n_meta] = fl_st_strdup(c->str);
        f->n_meta++;
        if (!f->meta_keys[f->n_meta - 1] || !f->meta_vals[f->n_meta - 1]) return fl_errorf(FL_ERR_OOM, "%s: out of memory", f->path);
    }
    return FL_OK;
}

typedef struct {
    size_t begin, end;
    int idx;
} fl_st_range;

static int fl_st_cmp_range(const void *a, const void *b) {
    const fl_st_range *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return x->idx - y->idx;
}

static fl_status fl_st_check_ranges(fl_st_file *f) {
    int n = f->n_tensors;
    if (n == 0) {
        if (f->data_size != 0)
            return fl_errorf(FL_ERR_FORMAT, "%s: no tensors but a %zu-byte data section", f->path, f->data_size);
        return FL_OK;
    }
    fl_st_range *r = malloc((size_t)n * sizeof *r);
    if (!r) return fl_errorf(FL_ERR_OOM, "%s: out of memory", f->path);
    for (int i = 0; i < n; i++) { r[i].begin = f->tensors[i].begin; r[i].end = f->tensors[i].end; r[i].idx = i; }
    qsort(r, (size_t)n, sizeof *r, fl_st_cmp_range);
    fl_status s = FL_OK;
    size_t pos = 0;
    const char *prev = NULL;
    for (int k = 0; k < n && s == FL_OK; k++) {
        const fl_st_tensor *t = &f->tensors[r[k].idx];
        if (t->begin < pos)
            s = fl_errorf(FL_ERR_FORMAT, "%s: tensors '%s' and '%s' overlap (bytes [%zu,%zu) start before %zu)", f->path,
                          prev, t->name, t->begin, t->end, pos);
        else if (t->begin > pos)
            s = prev ? fl_errorf(FL_ERR_FORMAT, "%s: gap of %zu bytes between tensors '%s' and '%s' (at byte %zu)", f->path,
                                 t->begin - pos, prev, t->name, pos)
                     : fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s' starts at byte %zu, data section must start at 0 (gap)",
                                 f->path, t->name, t->begin);
        pos = t->end;
        prev = t->name;
    }
    if (s == FL_OK && pos != f->data_size)
        s = fl_errorf(FL_ERR_FORMAT, "%s: data section is %zu bytes but tensors cover %zu (last tensor '%s')", f->path,
                      f->data_size, pos, prev);
    free(r);
    return s;
}

static fl_status fl_st_open_impl(fl_st_file *f, const char *path) {
    f->path = fl_st_strdup(path);
    if (!f->path) return fl_errorf(FL_ERR_OOM, "%s: out of memory", path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return fl_errorf(errno == ENOENT ? FL_ERR_NOT_FOUND : FL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return fl_errorf(FL_ERR_IO, "%s: stat failed: %s", path, strerror(e));
    }
    size_t size = (size_t)st.st_size;
    if (size < 8) {
        close(fd);
        return fl_errorf(FL_ERR_FORMAT, "%s: file is %zu bytes, too small for the 8-byte safetensors header length", path, size);
    }
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED) return fl_errorf(FL_ERR_IO, "%s: mmap failed: %s", path, strerror(e));
    f->map = map;
    f->map_size = size;
    const uint8_t *b = map;
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | b[i];
    if (n > FL_ST_MAX_HEADER)
        return fl_errorf(FL_ERR_FORMAT, "%s: header length %llu exceeds the %u-byte limit", path, (unsigned long long)n,
                         (unsigned)FL_ST_MAX_HEADER);
    if (8 + n > size)
        return fl_errorf(FL_ERR_FORMAT, "%s: header length %llu runs past the end of the file (%zu bytes)", path,
                         (unsigned long long)n, size);
    f->data = b + 8 + n;
    f->data_size = size - 8 - (size_t)n;
    fl_json *h = NULL;
    fl_status s = fl_json_parse((const char *)b + 8, (size_t)n, path, &h);
    if (s != FL_OK) return fl_error_prefix(s, "%s: safetensors header is not valid JSON", path);
    if (h->type != FL_JSON_OBJECT) {
        fl_json_free(h);
        return fl_errorf(FL_ERR_FORMAT, "%s: safetensors header is not a JSON object", path);
    }
    f->tensors = calloc(h->len ? h->len : 1, sizeof *f->tensors);
    if (!f->tensors) { fl_json_free(h); return fl_errorf(FL_ERR_OOM, "%s: out of memory", path); }
    for (const fl_json *c = h->child; c && s == FL_OK; c = c->next) {
        if (strcmp(c->key, "__metadata__") == 0) {
            if (f->meta_keys || f->n_meta) s = fl_errorf(FL_ERR_FORMAT, "%s: duplicate '__metadata__'", path);
            else s = fl_st_parse_meta(f, c);
            continue;
        }
        if (fl_st_find(f, c->key)) { s = fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s' appears twice in the header", path, c->key); break; }
        fl_st_tensor *t = &f->tensors[f->n_tensors];
        s = fl_st_parse_tensor(f, c, t);
        if (s != FL_OK) break;
        t->name = fl_st_strdup(c->key);
        if (!t->name) { s = fl_errorf(FL_ERR_OOM, "%s: out of memory", path); break; }
        f->n_tensors++;
    }
    fl_json_free(h);
    if (s != FL_OK) return s;
    return fl_st_check_ranges(f);
}

fl_status fl_st_open(fl_st_file *f, const char *path) {
    memset(f, 0, sizeof *f);
    if (!path) return fl_errorf(FL_ERR_INVALID, "fl_st_open: NULL path");
    fl_status s = fl_st_open_impl(f, path);
    if (s != FL_OK) fl_st_close(f);
    return s;
}

/* ---- writing ------------------------------------------------------------ */

typedef struct {
    char *b;
    size_t len, cap;
    int oom;
} fl_st_sb;

static void fl_st_sb_put(fl_st_sb *s, const char *p, size_t n) {
    if (s->oom) return;
    if (s->len + n + 1 > s->cap) {
        size_t c = s->cap ? s->cap : 1024;
        while (c < s->len + n + 1) c *= 2;
        char *nb = realloc(s->b, c);
        if (!nb) { s->oom = 1; return; }
        s->b = nb;
        s->cap = c;
    }
    memcpy(s->b + s->len, p, n);
    s->len += n;
    s->b[s->len] = '\0';
}
static void fl_st_sb_str(fl_st_sb *s, const char *p) { fl_st_sb_put(s, p, strlen(p)); }
static void fl_st_sb_json_str(fl_st_sb *s, const char *p) {
    fl_st_sb_put(s, "\"", 1);
    for (; *p; p++) {
        unsigned char c = (unsigned char)*p;
        char esc[8];
        if (c == '"' || c == '\\') { esc[0] = '\\'; esc[1] = (char)c; fl_st_sb_put(s, esc, 2); }
        else if (c < 0x20) { snprintf(esc, sizeof esc, "\\u%04x", c); fl_st_sb_put(s, esc, 6); }
        else fl_st_sb_put(s, (const char *)&c, 1);
    }
    fl_st_sb_put(s, "\"", 1);
}

static size_t fl_st_numel(const fl_st_write_tensor *t) {
    size_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= (size_t)t->shape[d];
    return n;
}

/* Convert n elements src (st) -> dst (dt): same dtype copies bytes (any dtype). */
static int fl_st_conv(void *dst, fl_dtype dt, const void *src, fl_dtype st, size_t n) {
    if (dt == st) { memcpy(dst, src, n * fl_dtype_size(st)); return 0; }
    return fl_convert(dst, dt, src, st, n);
}

static fl_status fl_st_write_data(int fd, const char *tmp, const fl_st_write_tensor *t) {
    size_t numel = fl_st_numel(t), ss = fl_dtype_size(t->src_dtype), ds = fl_dtype_size(t->dtype);
    if (numel == 0) return FL_OK;
    if (t->fill) { /* produce the fp32 source now, write it like any other tensor */
        float *buf = malloc(numel * sizeof(float));
        if (!buf) return fl_errorf(FL_ERR_OOM, "%s: out of memory writing '%s'", tmp, t->name);
        fl_st_write_tensor x = *t;
        x.fill = NULL;
        x.data = buf;
        x.src_dtype = FL_F32;
        x.be = NULL; /* the filled buffer is host memory, whatever holds the tensor's storage */
        fl_status s = t->fill(t->fill_ud, buf);
        if (s == FL_OK) s = fl_st_write_data(fd, tmp, &x);
        free(buf);
        return s;
    }
    if (t->fill_range) { /* produced slice by slice (a transposed tensor: whole, it is gathered) */
        size_t chunk = t->transpose2d || numel < FL_ST_FILL_SLICE ? numel : FL_ST_FILL_SLICE;
        void *h = malloc(chunk * ss);
        if (!h) return fl_errorf(FL_ERR_OOM, "%s: out of memory writing '%s'", tmp, t->name);
        fl_st_write_tensor x = *t;
        x.fill_range = NULL;
        x.be = NULL;
        x.data = h;
        fl_status s = FL_OK;
        for (size_t i = 0; i < numel && s == FL_OK; i += chunk) {
            size_t m = numel - i < chunk ? numel - i : chunk;
            s = t->fill_range(t->fill_ud, h, i, m);
            x.ndim = t->transpose2d ? t->ndim : 1;
            if (!t->transpose2d) x.shape[0] = (int64_t)m;
            if (s == FL_OK) s = fl_st_write_data(fd, tmp, &x);
        }
        free(h);
        return s;
    }
    if (t->be) { /* device memory: to the host in slices (a transposed tensor: whole, it is gathered) */
        size_t chunk = t->transpose2d ? numel : (size_t)1 << 18;
        if (chunk > numel) chunk = numel;
        void *h = malloc(chunk * ss);
        if (!h) return fl_errorf(FL_ERR_OOM, "%s: out of memory writing '%s'", tmp, t->name);
        fl_st_write_tensor x = *t;
        x.be = NULL;
        x.data = h;
        fl_status s = FL_OK;
        for (size_t i = 0; i < numel && s == FL_OK; i += chunk) {
            size_t m = numel - i < chunk ? numel - i : chunk;
            s = FL_RUN(t->be, to_host, h, (const char *)t->data + i * ss, m * ss);
            x.ndim = t->transpose2d ? t->ndim : 1;
            if (!t->transpose2d) x.shape[0] = (int64_t)m;
            if (s == FL_OK) s = fl_st_write_data(fd, tmp, &x);
        }
        free(h);
        return s;
    }
    if (t->transpose2d) {
        size_t rows = (size_t)t->shape[0], cols = (size_t)t->shape[1]; /* output shape; source is (cols, rows) */
        char *gather = malloc(cols * ss), *out = malloc(cols * ds);
        if (!gather || !out) { free(gather); free(out); return fl_errorf(FL_ERR_OOM, "%s: out of memory writing '%s'", tmp, t->name); }
        const char *src = t->data;
        fl_status s = FL_OK;
        for (size_t i = 0; i < rows && s == FL_OK; i++) {
            for (size_t j = 0; j < cols; j++) memcpy(gather + j * ss, src + (j * rows + i) * ss, ss);
            if (fl_st_conv(out, t->dtype, gather, t->src_dtype, cols)) s = fl_errorf(FL_ERR_UNSUPPORTED, "%s: tensor '%s': cannot convert %s to %s", tmp, t->name, fl_dtype_name(t->src_dtype), fl_dtype_name(t->dtype));
            else if (fl_fs_write_all(fd, out, cols * ds)) s = fl_errorf(FL_ERR_IO, "%s: write failed for tensor '%s': %s", tmp, t->name, strerror(errno));
        }
        free(gather);
        free(out);
        return s;
    }
    if (t->dtype == t->src_dtype) {
        if (fl_fs_write_all(fd, t->data, numel * ds)) return fl_errorf(FL_ERR_IO, "%s: write failed for tensor '%s': %s", tmp, t->name, strerror(errno));
        return FL_OK;
    }
    size_t chunk = 1u << 18;
    char *out = malloc((numel < chunk ? numel : chunk) * ds);
    if (!out) return fl_errorf(FL_ERR_OOM, "%s: out of memory writing '%s'", tmp, t->name);
    fl_status s = FL_OK;
    for (size_t i = 0; i < numel && s == FL_OK; i += chunk) {
        size_t m = numel - i < chunk ? numel - i : chunk;
        if (fl_convert(out, t->dtype, (const char *)t->data + i * ss, t->src_dtype, m))
            s = fl_errorf(FL_ERR_UNSUPPORTED, "%s: tensor '%s': cannot convert %s to %s", tmp, t->name, fl_dtype_name(t->src_dtype), fl_dtype_name(t->dtype));
        else if (fl_fs_write_all(fd, out, m * ds))
            s = fl_errorf(FL_ERR_IO, "%s: write failed for tensor '%s': %s", tmp, t->name, strerror(errno));
    }
    free(out);
    return s;
}

fl_status fl_st_write(const char *path, const fl_st_write_tensor *t, int n, const char *const *meta_keys,
                      const char *const *meta_vals, int n_meta) {
    if (!path || n < 0 || (n > 0 && !t) || n_meta < 0 || (n_meta > 0 && (!meta_keys || !meta_vals)))
        return fl_errorf(FL_ERR_INVALID, "fl_st_write(%s): invalid arguments", path ? path : "(null)");
    /* validate tensors and build the header */
    for (int i = 0; i < n; i++) {
        const fl_st_write_tensor *x = &t[i];
        if (!x->name) return fl_errorf(FL_ERR_INVALID, "%s: tensor #%d has no name", path, i);
        if (x->ndim < 0 || x->ndim > 8) return fl_errorf(FL_ERR_INVALID, "%s: tensor '%s': ndim %d out of range", path, x->name, x->ndim);
        if ((unsigned)x->dtype >= FL_DTYPE_COUNT || (unsigned)x->src_dtype >= FL_DTYPE_COUNT)
            return fl_errorf(FL_ERR_INVALID, "%s: tensor '%s': bad dtype", path, x->name);
        for (int d = 0; d < x->ndim; d++)
            if (x->shape[d] < 0) return fl_errorf(FL_ERR_INVALID, "%s: tensor '%s': negative dimension", path, x->name);
        if (x->transpose2d && x->ndim != 2) return fl_errorf(FL_ERR_INVALID, "%s: tensor '%s': transpose2d needs a 2-D tensor", path, x->name);
        if (x->fill && x->fill_range) return fl_errorf(FL_ERR_INVALID, "%s: tensor '%s': fill and fill_range both given", path, x->name);
        if (fl_st_numel(x) && !x->data && !x->fill && !x->fill_range) return fl_errorf(FL_ERR_INVALID, "%s: tensor '%s': NULL data", path, x->name);
        if (x->dtype != (x->fill ? FL_F32 : x->src_dtype)) {
            char o[8] = {0};
            if (fl_convert(o, x->dtype, o, x->src_dtype, 0))
                return fl_errorf(FL_ERR_UNSUPPORTED, "%s: tensor '%s': cannot convert %s to %s", path, x->name,
                                 fl_dtype_name(x->src_dtype), fl_dtype_name(x->dtype));
        }
        if (strcmp(x->name, "__metadata__") == 0) return fl_errorf(FL_ERR_INVALID, "%s: '__metadata__' is not a tensor name", path);
        for (int k = 0; k < i; k++)
            if (strcmp(t[k].name, x->name) == 0) return fl_errorf(FL_ERR_INVALID, "%s: tensor '%s' given twice", path, x->name);
    }
    fl_st_sb h = {0};
    char num[64];
    fl_st_sb_str(&h, "{");
    int first = 1;
    if (n_meta > 0) {
        fl_st_sb_str(&h, "\"__metadata__\":{");
        for (int i = 0; i < n_meta; i++) {
            if (i) fl_st_sb_str(&h, ",");
            fl_st_sb_json_str(&h, meta_keys[i]);
            fl_st_sb_str(&h, ":");
            fl_st_sb_json_str(&h, meta_vals[i]);
        }
        fl_st_sb_str(&h, "}");
        first = 0;
    }
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        const fl_st_write_tensor *x = &t[i];
        if (!first) fl_st_sb_str(&h, ",");
        first = 0;
        fl_st_sb_json_str(&h, x->name);
        fl_st_sb_str(&h, ":{\"dtype\":\"");
        fl_st_sb_str(&h, fl_dtype_name(x->dtype));
        fl_st_sb_str(&h, "\",\"shape\":[");
        for (int d = 0; d < x->ndim; d++) {
            snprintf(num, sizeof num, d ? ",%lld" : "%lld", (long long)x->shape[d]);
            fl_st_sb_str(&h, num);
        }
        size_t bytes = fl_st_numel(x) * fl_dtype_size(x->dtype);
        snprintf(num, sizeof num, "],\"data_offsets\":[%zu,%zu]}", off, off + bytes);
        fl_st_sb_str(&h, num);
        off += bytes;
    }
    fl_st_sb_str(&h, "}");
    while (h.len % 8) fl_st_sb_put(&h, " ", 1);
    if (h.oom) { free(h.b); return fl_errorf(FL_ERR_OOM, "%s: out of memory building the header", path); }

    size_t plen = strlen(path);
    char *tmp = malloc(plen + 5);
    if (!tmp) { free(h.b); return fl_errorf(FL_ERR_OOM, "%s: out of memory", path); }
    memcpy(tmp, path, plen);
    memcpy(tmp + plen, ".tmp", 5);
    fl_status s = FL_OK;
    fl_fs_tmp_track(tmp); /* a stop by a signal removes it (the CLI) */
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        s = fl_errorf(FL_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
        fl_fs_tmp_untrack(tmp);
        free(h.b);
        free(tmp);
        return s;
    }
    uint8_t len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)h.len >> (8 * i));
    if (fl_fs_write_all(fd, len8, 8) || fl_fs_write_all(fd, h.b, h.len))
        s = fl_errorf(FL_ERR_IO, "%s: write failed: %s", tmp, strerror(errno));
    free(h.b);
    for (int i = 0; i < n && s == FL_OK; i++) s = fl_st_write_data(fd, tmp, &t[i]);
    if (s == FL_OK && fsync(fd) != 0) s = fl_errorf(FL_ERR_IO, "%s: fsync failed: %s", tmp, strerror(errno));
    if (close(fd) != 0 && s == FL_OK) s = fl_errorf(FL_ERR_IO, "%s: close failed: %s", tmp, strerror(errno));
    if (s == FL_OK && rename(tmp, path) != 0) s = fl_errorf(FL_ERR_IO, "%s: rename to %s failed: %s", tmp, path, strerror(errno));
    if (s != FL_OK) unlink(tmp);
    fl_fs_tmp_untrack(tmp);
    free(tmp);
    return s;
}

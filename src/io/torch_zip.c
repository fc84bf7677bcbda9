/* torch.save files: the zip container (stored entries only) and the mapping of the
 * unpickled state dict onto its data/<key> entries; see include/fitllm/torch_ckpt.h.
 *
 * torch.save (PyTorchStreamWriter, miniz) writes every entry stored, 64-byte aligned,
 * and always ends the file with zip64 end records (even for a 1 KB file), so zip64 is
 * read; what is refused is what torch never writes: compression, encryption, archives
 * spanning disks. The central directory is the authority for sizes (local headers may
 * defer them to a data descriptor); each local header's name must match its central
 * entry so two readers cannot see two different files.
 */
#include "fitllm/torch_ckpt.h"
#include "io/torch-impl.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static uint64_t zle(const uint8_t *b, int k) {
    uint64_t x = 0;
    for (int i = k - 1; i >= 0; i--) x = (x << 8) | b[i];
    return x;
}

#define ZIP_EOCD 0x06054b50u
#define ZIP_EOCD64 0x06064b50u
#define ZIP_LOC64 0x07064b50u
#define ZIP_CEN 0x02014b50u
#define ZIP_LOC 0x04034b50u

/* The central directory's place: (offset, size, entries), from the end records. */
static fl_status zip_find_cd(const uint8_t *m, size_t size, const char *path, uint64_t *cd_off, uint64_t *cd_size,
                             uint64_t *n_ent, size_t *cd_limit) {
    if (size < 22) return fl_errorf(FL_ERR_FORMAT, "%s: %zu bytes, too small to be a zip (torch.save) file", path, size);
    size_t lo = size > 22 + 0xffff ? size - 22 - 0xffff : 0, e = size - 22 + 1;
    int found = 0;
    while (e-- > lo)
        if (zle(m + e, 4) == ZIP_EOCD && e + 22 + zle(m + e + 20, 2) == size) { found = 1; break; }
    if (!found) return fl_errorf(FL_ERR_FORMAT, "%s: no zip end-of-central-directory record (truncated file?)", path);
    if (zle(m + e + 4, 2) != 0 || zle(m + e + 6, 2) != 0)
        return fl_errorf(FL_ERR_FORMAT, "%s: a zip spanning several disks is not supported", path);
    *n_ent = zle(m + e + 10, 2);
    *cd_size = zle(m + e + 12, 4);
    *cd_off = zle(m + e + 16, 4);
    *cd_limit = e;
    if (e >= 20 && zle(m + e - 20, 4) == ZIP_LOC64) { /* zip64: the 64-bit record is the truth */
        uint64_t z = zle(m + e - 20 + 8, 8);
        if (zle(m + e - 20 + 4, 4) != 0 || zle(m + e - 20 + 16, 4) > 1)
            return fl_errorf(FL_ERR_FORMAT, "%s: a zip spanning several disks is not supported", path);
        if (z > e - 20 || e - 20 - z < 56 || zle(m + z, 4) != ZIP_EOCD64)
            return fl_errorf(FL_ERR_FORMAT, "%s: zip64 end record locator points outside the file or at no record", path);
        if (zle(m + z + 16, 4) != 0 || zle(m + z + 20, 4) != 0)
            return fl_errorf(FL_ERR_FORMAT, "%s: a zip spanning several disks is not supported", path);
        *n_ent = zle(m + z + 32, 8);
        *cd_size = zle(m + z + 40, 8);
        *cd_off = zle(m + z + 48, 8);
        *cd_limit = (size_t)z;
    } else if (*n_ent == 0xffff || *cd_size == 0xffffffffu || *cd_off == 0xffffffffu) {
        return fl_errorf(FL_ERR_FORMAT, "%s: zip end record defers to a zip64 record that is missing", path);
    }
    if (*cd_off > *cd_limit || *cd_size > *cd_limit - *cd_off)
        return fl_errorf(FL_ERR_FORMAT, "%s: zip central directory (%llu bytes at %llu) lies outside the file (truncated?)",
                         path, (unsigned long long)*cd_size, (unsigned long long)*cd_off);
    if (*n_ent > *cd_size / 46)
        return fl_errorf(FL_ERR_FORMAT, "%s: zip claims %llu entries in a %llu-byte central directory", path,
                         (unsigned long long)*n_ent, (unsigned long long)*cd_size);
    return FL_OK;
}

/* The zip64 extended-information extra field overrides the 32-bit fields that are all ones. */
static int zip_extra64(const uint8_t *x, size_t xlen, uint64_t *usize, uint64_t *csize, uint64_t *lho) {
    size_t o = 0;
    while (o + 4 <= xlen) {
        unsigned id = (unsigned)zle(x + o, 2), len = (unsigned)zle(x + o + 2, 2);
        if (len > xlen - o - 4) return -1;
        if (id == 1) {
            const uint8_t *f = x + o + 4;
            unsigned k = 0;
            uint64_t *v[3] = {usize, csize, lho};
            for (int i = 0; i < 3; i++)
                if (*v[i] == 0xffffffffu) {
                    if (k + 8 > len) return -1;
                    *v[i] = zle(f + k, 8);
                    k += 8;
                }
            return 0;
        }
        o += 4 + len;
    }
    return 0;
}

fl_status fl_zip_list(const uint8_t *m, size_t size, const char *path, fl_zip_entry **out, int *n_out) {
    *out = NULL;
    *n_out = 0;
    uint64_t cd_off = 0, cd_size = 0, n_ent = 0;
    size_t cd_limit = 0;
    FL_TRY(zip_find_cd(m, size, path, &cd_off, &cd_size, &n_ent, &cd_limit));
    if (n_ent > (1u << 24)) return fl_errorf(FL_ERR_FORMAT, "%s: zip claims %llu entries (more than 2^24)", path, (unsigned long long)n_ent);
    fl_zip_entry *es = calloc((size_t)n_ent + 1, sizeof *es);
    if (!es) return fl_errorf(FL_ERR_OOM, "%s: out of memory listing the zip", path);
    size_t p = (size_t)cd_off, end = (size_t)(cd_off + cd_size);
    fl_status s = FL_OK;
    for (uint64_t i = 0; i < n_ent && s == FL_OK; i++) {
        if (end - p < 46 || zle(m + p, 4) != ZIP_CEN) { s = fl_errorf(FL_ERR_FORMAT, "%s: zip central directory entry #%llu is malformed", path, (unsigned long long)i); break; }
        unsigned flags = (unsigned)zle(m + p + 8, 2), method = (unsigned)zle(m + p + 10, 2);
        uint64_t csize = zle(m + p + 20, 4), usize = zle(m + p + 24, 4), lho = zle(m + p + 42, 4);
        size_t nlen = (size_t)zle(m + p + 28, 2), xlen = (size_t)zle(m + p + 30, 2), clen = (size_t)zle(m + p + 32, 2);
        if (end - p - 46 < nlen + xlen + clen) { s = fl_errorf(FL_ERR_FORMAT, "%s: zip central directory entry #%llu runs past the directory", path, (unsigned long long)i); break; }
        const char *name = (const char *)m + p + 46;
        int nl = (int)(nlen < 200 ? nlen : 200);
        if (zip_extra64(m + p + 46 + nlen, xlen, &usize, &csize, &lho)) { s = fl_errorf(FL_ERR_FORMAT, "%s: entry '%.*s': malformed zip64 extra field", path, nl, name); break; }
        if (flags & 1) { s = fl_errorf(FL_ERR_UNSUPPORTED, "%s: entry '%.*s' is encrypted (torch.save never encrypts)", path, nl, name); break; }
        if (method != 0) {
            s = fl_errorf(FL_ERR_UNSUPPORTED, "%s: entry '%.*s' is compressed (zip method %u); torch.save writes stored entries, "
                          "so this file was re-zipped: unzip it and zip it again with `zip -0`, or re-save it with torch.save",
                          path, nl, name, method);
            break;
        }
        if (csize != usize) { s = fl_errorf(FL_ERR_FORMAT, "%s: stored entry '%.*s' has compressed size %llu != size %llu", path, nl, name, (unsigned long long)csize, (unsigned long long)usize); break; }
        if (lho > size || size - lho < 30 || zle(m + lho, 4) != ZIP_LOC) { s = fl_errorf(FL_ERR_FORMAT, "%s: entry '%.*s': local header offset %llu is outside the file or not a header", path, nl, name, (unsigned long long)lho); break; }
        size_t lnl = (size_t)zle(m + lho + 26, 2), lxl = (size_t)zle(m + lho + 28, 2);
        if (lnl != nlen || size - lho - 30 < lnl + lxl || memcmp(m + lho + 30, name, nlen)) { s = fl_errorf(FL_ERR_FORMAT, "%s: entry '%.*s': local header names a different file", path, nl, name); break; }
        uint64_t d = lho + 30 + lnl + lxl;
        if (d > cd_limit || usize > cd_limit - d) { s = fl_errorf(FL_ERR_FORMAT, "%s: entry '%.*s': %llu bytes at %llu run past the end of the data (truncated file?)", path, nl, name, (unsigned long long)usize, (unsigned long long)d); break; }
        es[i] = (fl_zip_entry){name, nlen, m + d, usize};
        p += 46 + nlen + xlen + clen;
    }
    if (s != FL_OK) { free(es); return s; }
    *out = es;
    *n_out = (int)n_ent;
    return FL_OK;
}

static int zip_cmp(const void *a, const void *b) {
    const fl_zip_entry *x = a, *y = b;
    size_t n = x->name_len < y->name_len ? x->name_len : y->name_len;
    int c = memcmp(x->name, y->name, n);
    return c ? c : (x->name_len > y->name_len) - (x->name_len < y->name_len);
}

static const fl_zip_entry *zip_find(const fl_zip_entry *es, int n, const char *name) {
    fl_zip_entry k = {name, strlen(name), NULL, 0};
    return bsearch(&k, es, (size_t)n, sizeof *es, zip_cmp);
}

/* The state dict's tensors onto the storages: f->tensors. */
static fl_status torch_bind(fl_st_file *f, const uint8_t *base, const fl_zip_entry *es, int n_es, const char *pre,
                            fl_torch_rec *r, int n) {
    f->tensors = calloc((size_t)n + 1, sizeof *f->tensors);
    if (!f->tensors) return fl_errorf(FL_ERR_OOM, "%s: out of memory", f->path);
    for (int i = 0; i < n; i++) {
        char nm[400];
        snprintf(nm, sizeof nm, "%sdata/%s", pre, r[i].storage_key);
        const fl_zip_entry *e = zip_find(es, n_es, nm);
        if (!e) return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': its storage entry '%s' is not in the zip", f->path, r[i].name, nm);
        size_t esz = fl_dtype_size(r[i].dtype);
        if ((uint64_t)r[i].storage_numel > e->size / esz || (uint64_t)r[i].storage_numel * esz != e->size)
            return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': storage '%s' should hold %lld %s elements but its entry has %llu bytes",
                             f->path, r[i].name, nm, (long long)r[i].storage_numel, fl_dtype_name(r[i].dtype), (unsigned long long)e->size);
        fl_st_tensor *t = &f->tensors[f->n_tensors];
        t->dtype = r[i].dtype;
        t->ndim = r[i].ndim;
        memcpy(t->shape, r[i].shape, sizeof t->shape);
        t->begin = (size_t)(e->data - base) + (size_t)r[i].offset * esz;
        t->end = t->begin + (size_t)r[i].numel * esz;
        t->data = base + t->begin;
        t->name = r[i].name; /* moved */
        r[i].name = NULL;
        f->n_tensors++;
    }
    return FL_OK;
}

static fl_status torch_open_impl(fl_st_file *f, const uint8_t *m, size_t size) {
    const char *path = f->path;
    if (size >= 2 && m[0] == 0x80 && m[1] <= 5)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: a legacy (non-zip) torch.save file (torch < 1.6, or "
                         "_use_new_zipfile_serialization=False); it is not read: re-save it with a current torch "
                         "(torch.save(torch.load(f), f)) or convert it to safetensors", path);
    if (size >= 262 && !memcmp(m + 257, "ustar", 5))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: a legacy tar-format torch.save file (torch < 0.4); it is not read: "
                         "re-save it with a current torch", path);
    if (size < 4 || zle(m, 4) != ZIP_LOC)
        return fl_errorf(FL_ERR_FORMAT, "%s: not a PyTorch checkpoint (torch.save writes a zip file starting with 'PK')", path);
    fl_zip_entry *es = NULL;
    int n_es = 0;
    FL_TRY(fl_zip_list(m, size, path, &es, &n_es));
    qsort(es, (size_t)n_es, sizeof *es, zip_cmp);
    fl_status s = FL_OK;
    const fl_zip_entry *pkl = NULL;
    char pre[260] = "";
    for (int i = 0; i < n_es && s == FL_OK; i++) {
        const fl_zip_entry *e = &es[i];
        if (e->name_len < 8 || memcmp(e->name + e->name_len - 8, "data.pkl", 8)) continue;
        const char *slash = memchr(e->name, '/', e->name_len);
        size_t pl = e->name_len - 8;
        if (pl && (!slash || (size_t)(slash - e->name) != pl - 1 || pl > 250)) continue; /* "<archive>/data.pkl" only */
        if (pkl) s = fl_errorf(FL_ERR_FORMAT, "%s: two data.pkl entries in the zip", path);
        pkl = e;
        snprintf(pre, sizeof pre, "%.*s", (int)pl, e->name);
    }
    if (s == FL_OK && !pkl) s = fl_errorf(FL_ERR_FORMAT, "%s: a zip file without <archive>/data.pkl (not written by torch.save)", path);
    if (s == FL_OK) {
        char bo[300];
        snprintf(bo, sizeof bo, "%sbyteorder", pre);
        const fl_zip_entry *b = zip_find(es, n_es, bo);
        if (b && !(b->size == 6 && !memcmp(b->data, "little", 6)))
            s = fl_errorf(FL_ERR_UNSUPPORTED, "%s: saved on a big-endian machine (byteorder is not 'little'); not supported", path);
    }
    fl_torch_rec *r = NULL;
    int n = 0;
    if (s == FL_OK) s = fl_torch_unpickle(pkl->data, (size_t)pkl->size, path, &r, &n);
    if (s == FL_OK) s = torch_bind(f, m, es, n_es, pre, r, n);
    fl_torch_recs_free(r, n);
    free(es);
    return s;
}

fl_status fl_torch_open_mem(fl_st_file *f, const void *p, size_t n, const char *name) {
    memset(f, 0, sizeof *f);
    f->path = strdup(name ? name : "(memory)");
    if (!f->path) return fl_errorf(FL_ERR_OOM, "out of memory");
    f->data = p;
    f->data_size = n;
    fl_status s = torch_open_impl(f, p, n);
    if (s != FL_OK) fl_st_close(f);
    return s;
}

fl_status fl_torch_open(fl_st_file *f, const char *path) {
    memset(f, 0, sizeof *f);
    if (!path) return fl_errorf(FL_ERR_INVALID, "fl_torch_open: NULL path");
    f->path = strdup(path);
    if (!f->path) return fl_errorf(FL_ERR_OOM, "%s: out of memory", path);
    fl_status s = FL_OK;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0) s = fl_errorf(errno == ENOENT ? FL_ERR_NOT_FOUND : FL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    else if (fstat(fd, &st) != 0) s = fl_errorf(FL_ERR_IO, "%s: stat failed: %s", path, strerror(errno));
    else if (st.st_size == 0) s = fl_errorf(FL_ERR_FORMAT, "%s: empty file (not a PyTorch checkpoint)", path);
    else {
        void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) s = fl_errorf(FL_ERR_IO, "%s: mmap failed: %s", path, strerror(errno));
        else {
            f->map = map;
            f->map_size = (size_t)st.st_size;
            f->data = map;
            f->data_size = f->map_size;
            s = torch_open_impl(f, map, f->map_size);
        }
    }
    if (fd >= 0) close(fd);
    if (s != FL_OK) fl_st_close(f);
    return s;
}

static int torch_ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

fl_status fl_weights_open(fl_st_file *f, const char *path) {
    return torch_ends_with(path, ".safetensors") ? fl_st_open(f, path) : fl_torch_open(f, path);
}

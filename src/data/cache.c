/* Tokenized-dataset cache. The key is a 128-bit hash of: the format version,
 * every option that changes the samples, the tokenizer fingerprint, and the
 * bytes (and names) of every source file. The file is
 *   cache_dir/<kind>-<key hex>.bin
 * written atomically (tmp + fsync + rename) and laid out as (native endian):
 *   u64 magic "FLDATAC1", u64 version, u64 key[2], u64 n_samples[2],
 *   u64 n_tokens[2], u64 n_truncated, u64 n_warnings,
 *   per split: i32 len[n], i32 prompt_len[n], i32 ids[n_tokens], i32 labels[n_tokens],
 *   u64 checksum (the 128-bit hash's first word over all bytes before it).
 * A file whose size, header, key, checksum or sample table does not add up is
 * reported as FL_ERR_FORMAT and rebuilt by the caller: never trusted. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "data-impl.h"
#include "fitllm/lengths.h"
#include "core/fs.h"

#define CACHE_MAGIC 0x3143415441444c46ULL /* "FLDATAC1" in little-endian bytes */
#define HDR_WORDS 10

/* ---- hash ------------------------------------------------------------------------------ */

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 33)) * 0xff51afd7ed558ccdULL;
    z = (z ^ (z >> 33)) * 0xc4ceb9fe1a85ec53ULL;
    return z ^ (z >> 33);
}

void fl_data_hash_init(fl_data_hash *h, uint64_t seed) {
    memset(h, 0, sizeof *h);
    h->a = seed ^ 0x243f6a8885a308d3ULL;
    h->b = ~seed ^ 0x13198a2e03707344ULL;
}

static inline void hash_word(fl_data_hash *h, uint64_t w) {
    h->a = rotl(h->a ^ mix64(w), 29) * 0x9e3779b97f4a7c15ULL;
    h->b = rotl(h->b ^ mix64(w + 0xa0761d6478bd642fULL), 31) * 0xc2b2ae3d27d4eb4fULL;
}

void fl_data_hash_update(fl_data_hash *h, const void *p, size_t n) {
    const uint8_t *s = p;
    h->len += n;
    while (n && h->nbuf) {
        h->buf[h->nbuf++] = *s++;
        n--;
        if (h->nbuf == 8) {
            uint64_t w;
            memcpy(&w, h->buf, 8);
            hash_word(h, w);
            h->nbuf = 0;
        }
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        hash_word(h, w);
        s += 8;
        n -= 8;
    }
    while (n--) h->buf[h->nbuf++] = *s++;
}

void fl_data_hash_u64(fl_data_hash *h, uint64_t v) { fl_data_hash_update(h, &v, sizeof v); }

void fl_data_hash_str(fl_data_hash *h, const char *s) {
    size_t n = s ? strlen(s) : 0;
    fl_data_hash_u64(h, n);
    if (n) fl_data_hash_update(h, s, n);
}

void fl_data_hash_final(const fl_data_hash *h, uint64_t out[2]) {
    fl_data_hash t = *h;
    uint64_t w = 0;
    if (t.nbuf) memcpy(&w, t.buf, (size_t)t.nbuf);
    hash_word(&t, w ^ ((uint64_t)t.nbuf << 56));
    out[0] = mix64(t.a ^ t.len ^ mix64(t.b));
    out[1] = mix64(t.b ^ out[0]);
}

/* ---- key ---------------------------------------------------------------------------------- */

fl_status fl_data_tok_fingerprint(const fl_tokenizer *tok, uint64_t out[2]) {
    static const char probe[] = "Hello world!  The quick brown fox jumps over 1234 lazy dogs.\n\t caf\xc3\xa9 "
                                "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x98\x80 ### Response:\n";
    fl_data_hash h;
    fl_data_hash_init(&h, 0x746f6b656e697a65ULL);
    fl_data_hash_str(&h, fl_tok_kind(tok));
    int V = fl_tok_vocab_size(tok);
    fl_data_hash_u64(&h, (uint64_t)(int64_t)V);
    fl_data_hash_u64(&h, (uint64_t)(int64_t)fl_tok_bos_id(tok));
    fl_data_hash_u64(&h, (uint64_t)(int64_t)fl_tok_eos_id(tok));
    for (int32_t id = 0; id < V; id++) {
        char *t = NULL;
        size_t len = 0;
        fl_status s = fl_tok_decode(tok, &id, 1, 0, &t, &len);
        fl_data_hash_u64(&h, (uint64_t)s);
        if (s == FL_OK) {
            fl_data_hash_u64(&h, len);
            fl_data_hash_update(&h, t, len);
        }
        free(t);
    }
    fl_error_clear();
    int32_t *ids = NULL;
    size_t n = 0;
    FL_TRY(fl_tok_encode(tok, probe, sizeof probe - 1, -1, -1, &ids, &n));
    fl_data_hash_u64(&h, n);
    fl_data_hash_update(&h, ids, n * sizeof *ids);
    free(ids);
    fl_data_hash_final(&h, out);
    return FL_OK;
}

fl_status fl_data_cache_key(const fl_data_config *cfg, const fl_tokenizer *tok, const fl_data_files *fs,
                            uint64_t key[2]) {
    uint64_t tf[2];
    FL_TRY(fl_data_tok_fingerprint(tok, tf));
    fl_data_hash h;
    fl_data_hash_init(&h, 0x6669746c6c6d6461ULL);
    fl_data_hash_u64(&h, FL_DATA_FORMAT_VERSION);
    fl_data_hash_u64(&h, (uint64_t)cfg->kind);
    fl_data_hash_str(&h, cfg->kind == FL_DATA_TEXTFILES ? "" : cfg->prompt_style);
    fl_data_hash_u64(&h, (uint64_t)cfg->mask_prompt);
    fl_data_hash_u64(&h, (uint64_t)(int64_t)cfg->ignore_index);
    float f = cfg->val_split_fraction;
    uint32_t fb;
    memcpy(&fb, &f, 4);
    fl_data_hash_u64(&h, fb);
    fl_data_hash_u64(&h, cfg->seed);
    fl_data_hash_u64(&h, (uint64_t)(int64_t)cfg->max_seq_length);
    fl_data_hash_u64(&h, (uint64_t)(int64_t)cfg->synthetic_train);
    fl_data_hash_u64(&h, (uint64_t)(int64_t)cfg->synthetic_val);
    if (cfg->lengths[0]) { /* the table's content decides the samples */
        fl_lengths t;
        FL_TRY(fl_error_prefix(fl_lengths_load(cfg->lengths, &t), "data.lengths"));
        for (int i = 0; i < t.n; i++) {
            uint64_t qb;
            memcpy(&qb, &t.q[i], 8);
            fl_data_hash_u64(&h, qb);
            fl_data_hash_u64(&h, (uint64_t)t.len[i]);
        }
    }
    fl_data_hash_u64(&h, tf[0]);
    fl_data_hash_u64(&h, tf[1]);
    fl_data_hash_u64(&h, fs->n);
    for (size_t i = 0; i < fs->n; i++) {
        /* names matter for TextFiles order and for .json vs .jsonl parsing */
        const char *base = strrchr(fs->f[i].path, '/');
        fl_data_hash_str(&h, base ? base + 1 : fs->f[i].path);
        fl_data_hash_u64(&h, fs->f[i].len);
        fl_data_hash_update(&h, fs->f[i].data, fs->f[i].len);
    }
    fl_data_hash_final(&h, key);
    return FL_OK;
}

static fl_status mkdir_p(const char *dir) {
    char buf[4096];
    size_t n = strlen(dir);
    if (n == 0 || n >= sizeof buf) return fl_errorf(FL_ERR_INVALID, "%s: bad cache_dir", dir);
    memcpy(buf, dir, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] == '/' || buf[i] == '\0') {
            char c = buf[i];
            buf[i] = '\0';
            if (mkdir(buf, 0755) != 0 && errno != EEXIST)
                return fl_errorf(FL_ERR_IO, "%s: cannot create cache folder: %s", buf, strerror(errno));
            buf[i] = c;
        }
    }
    return FL_OK;
}

fl_status fl_data_cache_path(const fl_data_config *cfg, const uint64_t key[2], char *buf, size_t n) {
    char name[96];
    static const char *const kinds[] = {"synthetic", "alpaca", "json", "textfiles"};
    snprintf(name, sizeof name, "%s-%016llx%016llx.bin", kinds[cfg->kind], (unsigned long long)key[0],
             (unsigned long long)key[1]);
    return fl_fs_join(buf, n, cfg->cache_dir, name);
}

/* ---- read / write ---------------------------------------------------------------------------- */

static uint64_t checksum(const void *p, size_t n) {
    fl_data_hash h;
    uint64_t o[2];
    fl_data_hash_init(&h, 0x636865636b73756dULL);
    fl_data_hash_update(&h, p, n);
    fl_data_hash_final(&h, o);
    return o[0];
}

fl_status fl_data_cache_read(const char *path, const uint64_t key[2], fl_dataset *d) {
    if (!fl_fs_is_file(path)) return fl_errorf(FL_ERR_NOT_FOUND, "%s: not cached", path);
    fl_data_file f;
    FL_TRY(fl_data_file_read(path, &f));
    fl_status s = FL_OK;
    const uint8_t *p = (const uint8_t *)f.data;
    uint64_t hdr[HDR_WORDS];
    if (f.len < sizeof hdr + 8) {
        s = fl_errorf(FL_ERR_FORMAT, "%s: truncated cache file (%zu bytes)", path, f.len);
        goto out;
    }
    memcpy(hdr, p, sizeof hdr);
    if (hdr[0] != CACHE_MAGIC || hdr[1] != FL_DATA_FORMAT_VERSION || hdr[2] != key[0] || hdr[3] != key[1]) {
        s = fl_errorf(FL_ERR_FORMAT, "%s: not a cache file for this key and version", path);
        goto out;
    }
    /* expected size, with overflow guarded by bounding each count by the file size */
    size_t need = sizeof hdr + 8;
    for (int sp = 0; sp < 2; sp++) {
        uint64_t ns = hdr[4 + sp], nt = hdr[6 + sp];
        if (ns > f.len / 8 || nt > f.len / 8) {
            s = fl_errorf(FL_ERR_FORMAT, "%s: corrupt cache header", path);
            goto out;
        }
        need += (size_t)ns * 8 + (size_t)nt * 8;
    }
    if (need != f.len) {
        s = fl_errorf(FL_ERR_FORMAT, "%s: cache file is %zu bytes, expected %zu (truncated or corrupt)", path, f.len, need);
        goto out;
    }
    uint64_t sum;
    memcpy(&sum, p + f.len - 8, 8);
    if (sum != checksum(p, f.len - 8)) {
        s = fl_errorf(FL_ERR_FORMAT, "%s: cache checksum mismatch (corrupt)", path);
        goto out;
    }
    size_t off = sizeof hdr;
    for (int sp = 0; sp < 2 && s == FL_OK; sp++) {
        fl_data_split_buf *b = &d->split[sp];
        size_t ns = (size_t)hdr[4 + sp], nt = (size_t)hdr[6 + sp];
        b->len = malloc((ns ? ns : 1) * 4);
        b->plen = malloc((ns ? ns : 1) * 4);
        b->ids = malloc((nt ? nt : 1) * 4);
        b->labels = malloc((nt ? nt : 1) * 4);
        if (!b->len || !b->plen || !b->ids || !b->labels) {
            s = fl_errorf(FL_ERR_OOM, "%s: out of memory", path);
            break;
        }
        b->n = b->cap = ns;
        b->n_tok = b->cap_tok = nt;
        memcpy(b->len, p + off, ns * 4), off += ns * 4;
        memcpy(b->plen, p + off, ns * 4), off += ns * 4;
        memcpy(b->ids, p + off, nt * 4), off += nt * 4;
        memcpy(b->labels, p + off, nt * 4), off += nt * 4;
        size_t tot = 0;
        for (size_t i = 0; i < ns; i++) {
            if (b->len[i] < 0 || b->plen[i] < 0 || b->plen[i] > b->len[i]) {
                s = fl_errorf(FL_ERR_FORMAT, "%s: corrupt sample table", path);
                break;
            }
            tot += (size_t)b->len[i];
        }
        if (s == FL_OK && tot != nt) s = fl_errorf(FL_ERR_FORMAT, "%s: sample lengths do not add up", path);
        if (s == FL_OK) s = fl_data_split_finish(b);
    }
    if (s == FL_OK) {
        d->stats.n_truncated = (size_t)hdr[8];
        d->stats.n_warnings = (size_t)hdr[9];
    }
out:
    free(f.data);
    return s;
}

fl_status fl_data_cache_write(const char *path, const uint64_t key[2], const fl_dataset *d) {
    {
        char dir[4200];
        snprintf(dir, sizeof dir, "%s", path);
        char *sl = strrchr(dir, '/');
        if (sl && sl != dir) {
            *sl = '\0';
            FL_TRY(mkdir_p(dir));
        }
    }
    uint64_t hdr[HDR_WORDS] = {CACHE_MAGIC, FL_DATA_FORMAT_VERSION, key[0], key[1],
                               d->split[0].n, d->split[1].n, d->split[0].n_tok, d->split[1].n_tok,
                               d->stats.n_truncated, d->stats.n_warnings};
    size_t size = sizeof hdr + 8;
    for (int sp = 0; sp < 2; sp++) size += d->split[sp].n * 8 + d->split[sp].n_tok * 8;
    uint8_t *buf = malloc(size);
    if (!buf) return fl_errorf(FL_ERR_OOM, "%s: out of memory (%zu bytes)", path, size);
    size_t off = 0;
    memcpy(buf, hdr, sizeof hdr), off += sizeof hdr;
    for (int sp = 0; sp < 2; sp++) {
        const fl_data_split_buf *b = &d->split[sp];
        if (b->n) {
            memcpy(buf + off, b->len, b->n * 4), off += b->n * 4;
            memcpy(buf + off, b->plen, b->n * 4), off += b->n * 4;
        }
        if (b->n_tok) {
            memcpy(buf + off, b->ids, b->n_tok * 4), off += b->n_tok * 4;
            memcpy(buf + off, b->labels, b->n_tok * 4), off += b->n_tok * 4;
        }
    }
    uint64_t sum = checksum(buf, off);
    memcpy(buf + off, &sum, 8);
    fl_status s = fl_fs_write_file_atomic(path, buf, size);
    free(buf);
    return s;
}

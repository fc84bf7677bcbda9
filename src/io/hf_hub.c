/* fl_hub_download: a repo's model files from the Hugging Face Hub (libcurl), as `litgpt
 * download` fetches them. The Hub's HTTP API:
 *   GET  {endpoint}/api/models/{repo}/revision/{rev}?blobs=true   the commit and the file list
 *        ("siblings": rfilename, size, lfs.sha256)
 *   HEAD {endpoint}/{repo}/resolve/{commit}/{file}   X-Linked-ETag (an LFS file's sha256) and
 *        X-Linked-Size on the redirect to the CDN, ETag and Content-Length otherwise
 *   GET  the same, with Range: bytes=N- to resume
 * Errors carry X-Error-Code (RepoNotFound, GatedRepo, RevisionNotFound, EntryNotFound).
 * Files are fetched from the commit main pointed at when the list was taken, so a push during
 * the download cannot mix two versions. */
#include "fitllm/hub.h"

#include "core/fs.h"
#include "io/sha256.h"
#include "fitllm/json.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#ifdef FL_HAVE_CURL
#include <curl/curl.h>
#endif

int fl_hub_download_built(void) {
#ifdef FL_HAVE_CURL
    return 1;
#else
    return 0;
#endif
}

/* ---- which files ------------------------------------------------------------------- */

static int is_tokenizer_file(const char *f) {
    static const char *const k[] = {"special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                                    "chat_template.jinja"};
    if (!strncmp(f, "tokenizer", 9)) return 1; /* LitGPT's "tokenizer*" */
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++)
        if (!strcmp(f, k[i])) return 1;
    return 0;
}

static int has_name(const char *const *names, int n, const char *want) {
    for (int i = 0; i < n; i++)
        if (names[i] && !strcmp(names[i], want)) return 1;
    return 0;
}

static fl_status add_name(char *buf, size_t n, size_t *off, int *count, const char *name) {
    size_t len = strlen(name) + 1;
    if (*off + len > n) return fl_errorf(FL_ERR_INVALID, "hub: the repo's file list is too long");
    memcpy(buf + *off, name, len);
    *off += len;
    (*count)++;
    return FL_OK;
}

fl_status fl_hub_pick_files(const char *const *names, int n_names, int tokenizer_only, char *buf, size_t n,
                            int *n_picked, char *index, size_t index_n, const char **weights) {
    size_t off = 0;
    *n_picked = 0;
    if (index) index[0] = 0;
    if (weights) *weights = "";
    if (!has_name(names, n_names, "config.json"))
        return fl_errorf(FL_ERR_NOT_FOUND, "the repo has no config.json (not a Hugging Face transformers model)");
    if (!tokenizer_only) {
        /* safetensors first (no pickle, mmap-able); LitGPT's order was .bin first */
        static const struct { const char *index, *single, *kind; } k_w[] = {
            {"model.safetensors.index.json", "model.safetensors", "safetensors"},
            {"pytorch_model.bin.index.json", "pytorch_model.bin", "bin"},
        };
        int found = 0;
        for (size_t k = 0; k < 2 && !found; k++) {
            const char *pick = has_name(names, n_names, k_w[k].index)    ? k_w[k].index
                               : has_name(names, n_names, k_w[k].single) ? k_w[k].single : NULL;
            if (!pick) continue;
            FL_TRY(add_name(buf, n, &off, n_picked, pick));
            if (pick == k_w[k].index && index) snprintf(index, index_n, "%s", pick);
            if (weights) *weights = k_w[k].kind;
            found = 1;
        }
        if (!found)
            return fl_errorf(FL_ERR_NOT_FOUND, "the repo has no weights fitllm reads: none of model.safetensors, "
                             "model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json");
    }
    for (int i = 0; i < n_names; i++)
        if (names[i] && !strchr(names[i], '/') && is_tokenizer_file(names[i]))
            FL_TRY(add_name(buf, n, &off, n_picked, names[i]));
    if (has_name(names, n_names, "generation_config.json"))
        FL_TRY(add_name(buf, n, &off, n_picked, "generation_config.json"));
    return add_name(buf, n, &off, n_picked, "config.json"); /* last: a folder with it is complete */
}

#ifndef FL_HAVE_CURL

fl_status fl_hub_download(const fl_hub_download_opts *o, char *out, size_t n) {
    (void)o, (void)out, (void)n;
    return fl_errorf(FL_ERR_UNSUPPORTED, "this fitllm was built without libcurl, so it cannot download (install "
                     "libcurl4-openssl-dev and rebuild); models already in the Hugging Face cache are found by name");
}

#else

/* ---- one HTTP request ------------------------------------------------------------- */

typedef struct {
    long status;             /* of the last response seen (after redirects: the final one) */
    char linked_etag[128];   /* X-Linked-ETag of any response in the chain (the Hub's 302) */
    char etag[128];          /* ETag of the last response */
    int64_t linked_size;     /* X-Linked-Size, -1 none */
    int64_t content_length;  /* of the last response, -1 none */
    char content_range[128];
    char err_code[64], err_msg[256];
    /* the body: into fd (2xx) or mem */
    int fd;
    char *mem;
    size_t mem_n, mem_cap, mem_max;
    fl_sha256 *sha;
    int64_t offset;          /* bytes already in the file (a resumed transfer starts there) */
    int64_t written;         /* body bytes written this request */
    int started, write_err;  /* write_err: errno of a failed write, or -1: a 206 for the wrong range */
    const fl_hub_download_opts *o;
    const char *file;
    int64_t total;
} xfer;

static void xfer_reset(xfer *x) {
    x->status = 0;
    x->etag[0] = x->content_range[0] = x->err_code[0] = x->err_msg[0] = 0;
    x->content_length = -1;
}

static void trim_value(char *dst, size_t n, const char *v, size_t len) {
    while (len && isspace((unsigned char)*v)) v++, len--;
    while (len && isspace((unsigned char)v[len - 1])) len--;
    if (len >= 2 && !strncmp(v, "W/", 2)) v += 2, len -= 2;
    if (len >= 2 && v[0] == '"' && v[len - 1] == '"') v++, len -= 2;
    if (len >= n) len = n - 1;
    memcpy(dst, v, len);
    dst[len] = 0;
}

static size_t on_header(char *p, size_t size, size_t nitems, void *ud) {
    xfer *x = ud;
    size_t len = size * nitems;
    if (len >= 5 && !strncmp(p, "HTTP/", 5)) { /* a new response (after a redirect or a 100) */
        xfer_reset(x);
        const char *sp = memchr(p, ' ', len);
        if (sp) x->status = strtol(sp + 1, NULL, 10);
        return len;
    }
    const char *colon = memchr(p, ':', len);
    if (!colon) return len;
    size_t kn = (size_t)(colon - p), vn = len - kn - 1;
    const char *v = colon + 1;
    char tmp[128];
#define IS(name) (kn == strlen(name) && !strncasecmp(p, name, kn))
    if (IS("X-Linked-ETag")) trim_value(x->linked_etag, sizeof x->linked_etag, v, vn);
    else if (IS("ETag")) trim_value(x->etag, sizeof x->etag, v, vn);
    else if (IS("Content-Range")) trim_value(x->content_range, sizeof x->content_range, v, vn);
    else if (IS("X-Error-Code")) trim_value(x->err_code, sizeof x->err_code, v, vn);
    else if (IS("X-Error-Message")) trim_value(x->err_msg, sizeof x->err_msg, v, vn);
    else if (IS("X-Linked-Size") || IS("Content-Length")) {
        trim_value(tmp, sizeof tmp, v, vn);
        char *end;
        long long val = strtoll(tmp, &end, 10);
        if (end != tmp && !*end && val >= 0) {
            if (IS("X-Linked-Size")) x->linked_size = val;
            else x->content_length = val;
        }
    }
#undef IS
    return len;
}

static size_t mem_append(xfer *x, const char *p, size_t n) {
    if (x->mem_n + n + 1 > x->mem_cap) {
        if (x->mem_n + n + 1 > x->mem_max) return 0; /* an answer far beyond any file list */
        size_t cap = x->mem_cap ? x->mem_cap : 4096;
        while (cap < x->mem_n + n + 1) cap *= 2;
        char *m = realloc(x->mem, cap);
        if (!m) return 0;
        x->mem = m, x->mem_cap = cap;
    }
    memcpy(x->mem + x->mem_n, p, n);
    x->mem_n += n;
    x->mem[x->mem_n] = 0;
    return n;
}

static size_t on_body(char *p, size_t size, size_t nmemb, void *ud) {
    xfer *x = ud;
    size_t n = size * nmemb;
    int ok = x->status >= 200 && x->status < 300;
    if (x->fd < 0 || !ok) { /* the API's JSON, or an error page (kept short) */
        if (!ok && x->mem_n > 4096) return n;
        return mem_append(x, p, n) == n ? n : 0;
    }
    if (!x->started) {
        x->started = 1;
        if (x->status == 200 && x->offset > 0) { /* the server ignored the Range: start over */
            if (ftruncate(x->fd, 0) != 0 || lseek(x->fd, 0, SEEK_SET) != 0) { x->write_err = errno; return 0; }
            fl_sha256_init(x->sha);
            x->offset = 0;
        } else if (x->status == 206) {
            char want[64];
            snprintf(want, sizeof want, "bytes %lld-", (long long)x->offset);
            if (strncmp(x->content_range, want, strlen(want))) { x->write_err = -1; return 0; }
        }
    }
    if (fl_fs_write_all(x->fd, p, n) != 0) { x->write_err = errno ? errno : EIO; return 0; }
    fl_sha256_update(x->sha, p, n);
    x->written += (int64_t)n;
    return n;
}

static int on_progress(void *ud, curl_off_t dltotal, curl_off_t dlnow, curl_off_t ultotal, curl_off_t ulnow) {
    (void)dltotal, (void)ultotal, (void)ulnow;
    xfer *x = ud;
    if (x->o->progress && x->fd >= 0 && x->started) {
        fl_hub_event ev = {FL_HUB_EV_PROGRESS, x->file, x->offset + (int64_t)dlnow, x->total, NULL};
        x->o->progress(x->o->ud, &ev);
    }
    return 0;
}

typedef struct {
    const char *endpoint, *repo, *token;
    char rev[128]; /* the commit the files come from */
} hub;

/* One request: method HEAD (head=1) or GET, from `range_from` (> 0: Range). x holds the answer. */
static CURLcode perform(const hub *h, const char *url, int head, xfer *x, char *errbuf) {
    CURL *c = curl_easy_init();
    if (!c) return CURLE_OUT_OF_MEMORY;
    char range[64];
    errbuf[0] = 0;
    xfer_reset(x);
    x->linked_etag[0] = 0;
    x->linked_size = -1;
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(c, CURLOPT_MAXREDIRS, 10L);
    curl_easy_setopt(c, CURLOPT_USERAGENT, "fitllm/0.9 (libcurl)");
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, errbuf);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, 30L);
    /* a stalled connection (no byte for 60 s) fails and is retried, resuming */
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, 60L);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, x);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, x);
    curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(c, CURLOPT_XFERINFODATA, x);
    curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
    if (h->token && h->token[0]) {
        /* curl sends a bearer token only to the host it was given for, not to the CDN a
         * redirect leads to (custom Authorization headers would follow redirects) */
        curl_easy_setopt(c, CURLOPT_HTTPAUTH, CURLAUTH_BEARER);
        curl_easy_setopt(c, CURLOPT_XOAUTH2_BEARER, h->token);
    }
    if (head) curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
    else if (x->offset > 0) {
        snprintf(range, sizeof range, "%lld-", (long long)x->offset);
        curl_easy_setopt(c, CURLOPT_RANGE, range);
    }
    CURLcode rc = curl_easy_perform(c);
    curl_easy_cleanup(c);
    return rc;
}

/* The message for a failed request (HTTP status or curl error). */
static fl_status request_error(const hub *h, const xfer *x, CURLcode rc, const char *errbuf, const char *url,
                               const char *what) {
    if (rc != CURLE_OK)
        return fl_errorf(FL_ERR_IO, "network error fetching %s (%s): %s", what, url,
                         errbuf[0] ? errbuf : curl_easy_strerror(rc));
    const char *code = x->err_code, *msg = x->err_msg[0] ? x->err_msg : "";
    const int has_token = h->token && h->token[0];
    if (!strcmp(code, "RepoNotFound") || (x->status == 404 && !code[0]))
        return fl_errorf(FL_ERR_NOT_FOUND, "no model repo %s on %s (HTTP %ld%s%s)%s", h->repo, h->endpoint, x->status,
                         msg[0] ? ": " : "", msg,
                         has_token ? "" : "; if it is private, pass --access_token TOKEN (or set HF_TOKEN)");
    if (!strcmp(code, "RevisionNotFound"))
        return fl_errorf(FL_ERR_NOT_FOUND, "%s has no revision '%s' (HTTP %ld)", h->repo, h->rev, x->status);
    if (!strcmp(code, "EntryNotFound") || x->status == 404)
        return fl_errorf(FL_ERR_NOT_FOUND, "%s: %s is listed but cannot be fetched (HTTP %ld%s%s)", h->repo, what,
                         x->status, msg[0] ? ": " : "", msg);
    if (x->status == 401 || x->status == 403 || !strcmp(code, "GatedRepo"))
        return fl_errorf(FL_ERR_INVALID,
                         "%s is gated or private (HTTP %ld fetching %s): %s; accept the model's license on "
                         "%s/%s while logged in, and pass --access_token TOKEN (or set HF_TOKEN) with a token "
                         "from %s/settings/tokens", h->repo, x->status, what,
                         has_token ? "the token given was refused" : "no access token was given", h->endpoint,
                         h->repo, h->endpoint);
    return fl_errorf(FL_ERR_IO, "HTTP %ld fetching %s (%s)%s%s", x->status, what, url, msg[0] ? ": " : "", msg);
}

static int is_sha256(const char *s) {
    if (strlen(s) != 64) return 0;
    for (int i = 0; i < 64; i++)
        if (!isxdigit((unsigned char)s[i])) return 0;
    return 1;
}

static int retryable(CURLcode rc) {
    switch (rc) {
    case CURLE_PARTIAL_FILE: case CURLE_RECV_ERROR: case CURLE_SEND_ERROR: case CURLE_GOT_NOTHING:
    case CURLE_OPERATION_TIMEDOUT: case CURLE_COULDNT_CONNECT: case CURLE_HTTP2: case CURLE_HTTP2_STREAM:
    case CURLE_SSL_CONNECT_ERROR:
        return 1;
    default:
        return 0;
    }
}

static void emit(const fl_hub_download_opts *o, fl_hub_event_kind k, const char *file, int64_t done, int64_t total,
                 const char *msg) {
    if (!o->progress) return;
    fl_hub_event ev = {k, file, done, total, msg};
    o->progress(o->ud, &ev);
}

/* Hash the first `len` bytes of path into sha (a resumed .part). */
static fl_status hash_prefix(const char *path, int64_t len, fl_sha256 *sha) {
    FILE *f = fopen(path, "rb");
    if (!f) return fl_errorf(FL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    const size_t cap = 1 << 16;
    char *buf = malloc(cap);
    if (!buf) {
        fclose(f);
        return fl_errorf(FL_ERR_OOM, "%s: out of memory", path);
    }
    while (len > 0) {
        size_t want = len > (int64_t)cap ? cap : (size_t)len;
        size_t got = fread(buf, 1, want, f);
        if (got != want) {
            fclose(f);
            free(buf);
            return fl_errorf(FL_ERR_IO, "%s: read failed", path);
        }
        fl_sha256_update(sha, buf, got);
        len -= (int64_t)got;
    }
    free(buf);
    fclose(f);
    return FL_OK;
}

static fl_status url_of(const hub *h, const char *file, char *url, size_t n) {
    if (snprintf(url, n, "%s/%s/resolve/%s/%s", h->endpoint, h->repo, h->rev, file) >= (int)n)
        return fl_errorf(FL_ERR_INVALID, "hub: URL too long for %s", file);
    return FL_OK;
}

/* One file into dir: HEAD for the size and checksum, then GET into FILE.part (resuming), check,
 * rename. api_size / api_sha: the file list's (-1 / "" unknown). */
static fl_status fetch_file(const hub *h, const fl_hub_download_opts *o, const char *dir, const char *file,
                            int64_t api_size, const char *api_sha) {
    char url[FL_HUB_PATH], final[FL_HUB_PATH], part[FL_HUB_PATH + 8], errbuf[CURL_ERROR_SIZE];
    FL_TRY(url_of(h, file, url, sizeof url));
    FL_TRY(fl_fs_join(final, sizeof final, dir, file));
    snprintf(part, sizeof part, "%s.part", final);
    xfer x;
    memset(&x, 0, sizeof x);
    x.fd = -1, x.o = o, x.file = file, x.mem_max = 1 << 16;
    CURLcode rc = perform(h, url, 1, &x, errbuf);
    if (rc != CURLE_OK || x.status < 200 || x.status >= 300) {
        fl_status s = request_error(h, &x, rc, errbuf, url, file);
        free(x.mem);
        return s;
    }
    free(x.mem);
    x.mem = NULL, x.mem_n = x.mem_cap = 0;
    char want_sha[65] = "";
    if (is_sha256(x.linked_etag)) snprintf(want_sha, sizeof want_sha, "%s", x.linked_etag);
    else if (is_sha256(x.etag)) snprintf(want_sha, sizeof want_sha, "%s", x.etag);
    else if (api_sha && is_sha256(api_sha)) snprintf(want_sha, sizeof want_sha, "%s", api_sha);
    for (char *q = want_sha; *q; q++) *q = (char)tolower((unsigned char)*q);
    int64_t size = x.linked_size >= 0 ? x.linked_size : x.content_length >= 0 ? x.content_length : api_size;
    struct stat st;
    if (size >= 0 && stat(final, &st) == 0 && S_ISREG(st.st_mode) && (int64_t)st.st_size == size) {
        emit(o, FL_HUB_EV_SKIP, file, size, size, NULL);
        return FL_OK;
    }
    const int attempts = o->retries > 0 ? o->retries : 3;
    fl_sha256 sha;
    x.sha = &sha;
    x.total = size;
    for (int attempt = 1;; attempt++) {
        int fd = open(part, O_WRONLY | O_CREAT, 0644);
        if (fd < 0) return fl_errorf(FL_ERR_IO, "%s: cannot create: %s", part, strerror(errno));
        off_t have = lseek(fd, 0, SEEK_END);
        if (have < 0 || (size >= 0 && have > size)) { /* longer than the file: not a prefix of it */
            if (ftruncate(fd, 0) != 0) have = -1;
            else have = lseek(fd, 0, SEEK_SET);
        }
        if (have < 0) {
            int e = errno;
            close(fd);
            return fl_errorf(FL_ERR_IO, "%s: %s", part, strerror(e));
        }
        fl_sha256_init(&sha);
        fl_status s = have > 0 ? hash_prefix(part, have, &sha) : FL_OK;
        if (s != FL_OK) { close(fd); return s; }
        x.fd = fd, x.offset = have, x.written = 0, x.started = 0, x.write_err = 0;
        emit(o, FL_HUB_EV_START, file, have, size, NULL);
        rc = CURLE_OK;
        if (size < 0 || have < size) rc = perform(h, url, 0, &x, errbuf);
        else x.status = 206; /* the .part is whole (a run that stopped before the rename) */
        int sync_bad = fsync(fd) != 0;
        close(fd);
        x.fd = -1;
        if (x.write_err == -1) { /* a 206 for another range than asked: start over */
            unlink(part);
            if (attempt < attempts) continue;
            return fl_errorf(FL_ERR_FORMAT, "%s: the server answered a resume with the wrong range (%s)", file,
                             x.content_range);
        }
        if (x.write_err > 0 || sync_bad)
            return fl_errorf(FL_ERR_IO, "writing %s: %s", part, strerror(x.write_err > 0 ? x.write_err : errno));
        if (rc == CURLE_OK && x.status == 416) { /* nothing left to send from `have`: start over */
            unlink(part);
            if (attempt < attempts) continue;
        }
        if (rc != CURLE_OK && retryable(rc) && attempt < attempts) {
            char why[CURL_ERROR_SIZE + 32];
            snprintf(why, sizeof why, "%s", errbuf[0] ? errbuf : curl_easy_strerror(rc));
            emit(o, FL_HUB_EV_RETRY, file, x.offset + x.written, size, why);
            struct timespec ts = {0, 250000000L * attempt};
            nanosleep(&ts, NULL);
            continue;
        }
        if (rc != CURLE_OK) {
            free(x.mem);
            return fl_errorf(FL_ERR_IO, "network error downloading %s at %lld of %lld bytes: %s; the part is kept in "
                             "%s: run the same command again to resume", file, (long long)(x.offset + x.written),
                             (long long)size, errbuf[0] ? errbuf : curl_easy_strerror(rc), part);
        }
        if (x.status < 200 || x.status >= 300) {
            s = request_error(h, &x, rc, errbuf, url, file);
            free(x.mem);
            if (stat(part, &st) == 0 && st.st_size == 0) unlink(part); /* nothing to resume */
            return s;
        }
        break;
    }
    free(x.mem);
    if (stat(part, &st) != 0) return fl_errorf(FL_ERR_IO, "%s: %s", part, strerror(errno));
    if (size >= 0 && (int64_t)st.st_size != size) {
        unlink(part);
        return fl_errorf(FL_ERR_FORMAT, "%s: downloaded %lld bytes, the Hub says %lld (the .part was deleted: run "
                         "the command again)", file, (long long)st.st_size, (long long)size);
    }
    char got[65];
    fl_sha256_final_hex(&sha, got);
    if (want_sha[0] && strcmp(got, want_sha)) {
        unlink(part);
        return fl_errorf(FL_ERR_FORMAT, "%s: checksum mismatch: the Hub says sha256 %s, the download has %s (the "
                         ".part was deleted: run the command again; if it repeats, the file on the server or a "
                         "proxy is corrupt)", file, want_sha, got);
    }
    if (rename(part, final) != 0) return fl_errorf(FL_ERR_IO, "%s -> %s: %s", part, final, strerror(errno));
    fl_fs_sync_dir(dir);
    emit(o, FL_HUB_EV_DONE, file, (int64_t)st.st_size, (int64_t)st.st_size, want_sha[0] ? "sha256 ok" : "size ok");
    return FL_OK;
}

/* ---- the whole repo ------------------------------------------------------------------- */

typedef struct {
    char **names;
    int64_t *sizes;
    char (*shas)[65];
    int n;
} file_list;

static void list_free(file_list *l) {
    for (int i = 0; i < l->n; i++) free(l->names[i]);
    free(l->names), free(l->sizes), free(l->shas);
    memset(l, 0, sizeof *l);
}

static int list_find(const file_list *l, const char *name) {
    for (int i = 0; i < l->n; i++)
        if (!strcmp(l->names[i], name)) return i;
    return -1;
}

/* The API's answer: the commit and the files (top level and below: names only matter). */
static fl_status parse_listing(const char *text, size_t n, const char *src, file_list *l, char *sha, size_t sha_n) {
    fl_json *root;
    FL_TRY(fl_json_parse(text, n, src, &root));
    const fl_json *sib = fl_json_get(root, "siblings"), *commit = fl_json_get(root, "sha");
    if (!sib || sib->type != FL_JSON_ARRAY) {
        fl_json_free(root);
        return fl_errorf(FL_ERR_FORMAT, "%s: the answer has no \"siblings\" list of files", src);
    }
    if (commit && commit->type == FL_JSON_STRING) snprintf(sha, sha_n, "%s", commit->str);
    l->names = calloc(sib->len + 1, sizeof *l->names);
    l->sizes = calloc(sib->len + 1, sizeof *l->sizes);
    l->shas = calloc(sib->len + 1, sizeof *l->shas);
    if (!l->names || !l->sizes || !l->shas) {
        fl_json_free(root);
        return fl_errorf(FL_ERR_OOM, "%s: out of memory", src);
    }
    for (const fl_json *e = sib->child; e; e = e->next) {
        const fl_json *name = fl_json_get(e, "rfilename"), *size = fl_json_get(e, "size"),
                      *lfs = fl_json_get(e, "lfs"), *lsha = fl_json_get(lfs, "sha256");
        if (!name || name->type != FL_JSON_STRING || !name->str[0] || strlen(name->str) != name->len) continue;
        int i = l->n++;
        l->names[i] = strdup(name->str);
        l->sizes[i] = size && size->type == FL_JSON_NUMBER && size->is_int ? size->i : -1;
        snprintf(l->shas[i], sizeof l->shas[i], "%s", lsha && lsha->type == FL_JSON_STRING ? lsha->str : "");
        if (!l->names[i]) {
            fl_json_free(root);
            return fl_errorf(FL_ERR_OOM, "%s: out of memory", src);
        }
    }
    fl_json_free(root);
    return FL_OK;
}

/* The shards a weight index names (weight_map values), each a top-level file the repo lists. */
static fl_status index_shards(const char *path, const file_list *l, char ***out, int *n_out) {
    fl_json *root;
    FL_TRY(fl_json_parse_file(path, &root));
    const fl_json *wm = fl_json_get(root, "weight_map");
    *out = NULL, *n_out = 0;
    if (!wm || wm->type != FL_JSON_OBJECT || !wm->len) {
        fl_json_free(root);
        return fl_errorf(FL_ERR_FORMAT, "%s: no \"weight_map\" object", path);
    }
    char **v = calloc(wm->len, sizeof *v);
    int n = 0;
    fl_status s = v ? FL_OK : fl_errorf(FL_ERR_OOM, "%s: out of memory", path);
    for (const fl_json *e = wm->child; e && s == FL_OK; e = e->next) {
        if (e->type != FL_JSON_STRING || strchr(e->str, '/') || list_find(l, e->str) < 0) {
            s = fl_errorf(FL_ERR_FORMAT, "%s: weight_map[\"%s\"] names '%s', not a file of the repo", path, e->key,
                          e->type == FL_JSON_STRING ? e->str : "(not a string)");
            break;
        }
        int dup = 0;
        for (int k = 0; k < n && !dup; k++) dup = !strcmp(v[k], e->str);
        if (!dup && !(v[n++] = strdup(e->str))) s = fl_errorf(FL_ERR_OOM, "%s: out of memory", path);
    }
    fl_json_free(root);
    if (s != FL_OK) {
        for (int k = 0; k < n; k++) free(v[k]);
        free(v);
        return s;
    }
    *out = v, *n_out = n;
    return FL_OK;
}

static fl_status fetch_listed(const hub *h, const fl_hub_download_opts *o, const char *dir, const file_list *l,
                              const char *name) {
    int i = list_find(l, name);
    return fetch_file(h, o, dir, name, i >= 0 ? l->sizes[i] : -1, i >= 0 ? l->shas[i] : "");
}

static fl_status download_files(const hub *h, const fl_hub_download_opts *o, const char *dir, file_list *l) {
    const char **names = calloc((size_t)l->n + 1, sizeof *names);
    if (!names) return fl_errorf(FL_ERR_OOM, "out of memory");
    for (int i = 0; i < l->n; i++) names[i] = l->names[i];
    size_t cap = 1 << 16;
    char *picked = malloc(cap), index[256], info[512];
    int np = 0;
    const char *weights = "";
    fl_status s = picked ? fl_hub_pick_files(names, l->n, o->tokenizer_only, picked, cap, &np, index, sizeof index,
                                             &weights)
                         : fl_errorf(FL_ERR_OOM, "out of memory");
    free(names);
    if (s != FL_OK) {
        free(picked);
        return fl_error_prefix(s, "%s (revision %s)", h->repo, h->rev);
    }
    snprintf(info, sizeof info, "%s at commit %s: %d files%s%s%s", h->repo, h->rev, np, weights[0] ? ", weights " : "",
             weights, !strcmp(weights, "bin") ? " (PyTorch pickles; no safetensors in the repo)" : "");
    emit(o, FL_HUB_EV_INFO, NULL, 0, 0, info);
    const char *f = picked;
    for (int k = 0; k < np && s == FL_OK; k++, f += strlen(f) + 1) {
        s = fetch_listed(h, o, dir, l, f);
        if (s != FL_OK || !index[0] || strcmp(f, index)) continue;
        char ip[FL_HUB_PATH], **shards = NULL;
        int ns = 0;
        if ((s = fl_fs_join(ip, sizeof ip, dir, index)) == FL_OK) s = index_shards(ip, l, &shards, &ns);
        for (int j = 0; j < ns; j++) {
            if (s == FL_OK) s = fetch_listed(h, o, dir, l, shards[j]);
            free(shards[j]);
        }
        free(shards);
    }
    free(picked);
    return s;
}

static fl_status download(const fl_hub_download_opts *o, hub *h, char *out, size_t n) {
    char url[FL_HUB_PATH], errbuf[CURL_ERROR_SIZE], dir[FL_HUB_PATH], src[FL_HUB_PATH + 32];
    const char *rev = o->revision && o->revision[0] ? o->revision : "main";
    snprintf(h->rev, sizeof h->rev, "%s", rev);
    char *esc = curl_easy_escape(NULL, rev, 0); /* "refs/pr/1" -> refs%2Fpr%2F1 */
    if (!esc) return fl_errorf(FL_ERR_OOM, "out of memory");
    int w = snprintf(url, sizeof url, "%s/api/models/%s/revision/%s?blobs=true", h->endpoint, h->repo, esc);
    curl_free(esc);
    if (w >= (int)sizeof url) return fl_errorf(FL_ERR_INVALID, "hub: URL too long");
    xfer x;
    memset(&x, 0, sizeof x);
    x.fd = -1, x.o = o, x.mem_max = 64u << 20;
    CURLcode rc = perform(h, url, 0, &x, errbuf);
    if (rc != CURLE_OK || x.status != 200) {
        fl_status s = request_error(h, &x, rc, errbuf, url, "the file list");
        free(x.mem);
        return s;
    }
    file_list l = {0};
    char sha[128] = "";
    snprintf(src, sizeof src, "%s (the Hub's file list)", url);
    fl_status s = parse_listing(x.mem ? x.mem : "", x.mem_n, src, &l, sha, sizeof sha);
    free(x.mem);
    /* fetch from the commit the list belongs to (a 40-hex id), else from the revision named */
    int hex = strlen(sha) == 40;
    for (int i = 0; hex && i < 40; i++) hex = isxdigit((unsigned char)sha[i]) != 0;
    if (hex) snprintf(h->rev, sizeof h->rev, "%s", sha);
    else if ((esc = curl_easy_escape(NULL, rev, 0))) {
        snprintf(h->rev, sizeof h->rev, "%s", esc);
        curl_free(esc);
    }
    const char *root = o->checkpoint_dir && o->checkpoint_dir[0] ? o->checkpoint_dir : fl_hub_download_root();
    if (s == FL_OK) s = fl_fs_join(dir, sizeof dir, root, h->repo);
    if (s == FL_OK) s = fl_fs_mkdir_p(dir);
    if (s == FL_OK) {
        s = download_files(h, o, dir, &l);
        if (s != FL_OK && rmdir(dir) == 0) { /* nothing was written (a refused token): leave no empty ORG/NAME */
            char *slash = strrchr(dir, '/');
            if (slash) *slash = 0, rmdir(dir), *slash = '/';
        }
    }
    list_free(&l);
    if (s == FL_OK && out && snprintf(out, n, "%s", dir) >= (int)n) s = fl_errorf(FL_ERR_INVALID, "path too long");
    return s;
}

fl_status fl_hub_download(const fl_hub_download_opts *o, char *out, size_t n) {
    if (!o || !fl_hub_is_repo_id(o->repo))
        return fl_errorf(FL_ERR_INVALID, "'%s' is not a Hugging Face repo id (ORG/NAME, e.g. "
                         "TinyLlama/TinyLlama-1.1B-Chat-v1.0)", o && o->repo ? o->repo : "");
    static int inited;
    if (!inited) {
        if (curl_global_init(CURL_GLOBAL_DEFAULT) != 0) return fl_errorf(FL_ERR_IO, "libcurl failed to initialize");
        inited = 1;
    }
    char endpoint[1024];
    const char *ep = o->endpoint && o->endpoint[0] ? o->endpoint : getenv("HF_ENDPOINT");
    snprintf(endpoint, sizeof endpoint, "%s", ep && ep[0] ? ep : "https://huggingface.co");
    size_t el = strlen(endpoint);
    while (el > 0 && endpoint[el - 1] == '/') endpoint[--el] = 0;
    hub h = {.endpoint = endpoint, .repo = o->repo, .token = o->token ? o->token : getenv("HF_TOKEN")};
    return download(o, &h, out, n);
}

#endif /* FL_HAVE_CURL */

/* A Hugging Face Hub stand-in on the loopback, for the `fitllm download` tests (tests/cli_test.sh).
 * Plain POSIX sockets, one request per connection, one connection at a time.
 *
 * usage: fitllm_hub_server --root DIR --port-file FILE [--log FILE] [--drop-after N [--drop-once]]
 *                          [--max-seconds S]
 * Serves DIR/ORG/NAME/ as the model repo ORG/NAME at one commit (k_commit, also "main"):
 *   GET  /api/models/ORG/NAME/revision/REV   {"id", "sha", "siblings": [{"rfilename", "size"}]}
 *   HEAD|GET /ORG/NAME/resolve/REV/FILE      a file named in DIR/ORG/NAME/.sha256 (sha256sum's output:
 *        "HEX  FILE" lines) is an LFS file: 302 to /cdn/ORG/NAME/FILE with X-Linked-ETag "HEX" and
 *        X-Linked-Size, as the Hub answers; other files are served here (ETag: a 40-hex git id)
 *   HEAD|GET /cdn/ORG/NAME/FILE             the bytes (ETag not a sha256, as a CDN's), Range: bytes=N-
 * A repo with a .token file wants "Authorization: Bearer <its contents>" for its files: none 401,
 * another 403, both with X-Error-Code: GatedRepo (its file list stays public, as a gated model's).
 * Unknown repo 404 RepoNotFound, unknown revision 404 RevisionNotFound, unknown file 404 EntryNotFound.
 * --drop-after N: a GET body of more than N bytes is cut after N bytes and the connection closed
 * (every time, or the first time only with --drop-once): a network failure mid-file.
 * The port (chosen by the kernel) is written to the port file once listening. The log gets one line
 * per request: "METHOD PATH range=VALUE auth=yes|no". Exits after --max-seconds (default 600). */
#include <arpa/inet.h>
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *k_commit = "0123456789abcdef0123456789abcdef01234567";
static const char *g_root;
static FILE *g_log;
static long g_drop_after = -1;
static int g_drop_once, g_dropped;

typedef struct {
    char method[8], path[2048], range[128], auth[512];
} request;

static int send_all(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        c += w, n -= (size_t)w;
    }
    return 0;
}

static void sendf(int fd, const char *fmt, ...) {
    char buf[8192];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n > 0) send_all(fd, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
}

static void status_only(int fd, int code, const char *reason, const char *err_code, const char *extra) {
    char body[256];
    int n = snprintf(body, sizeof body, "{\"error\": \"%s\"}", reason);
    sendf(fd, "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s%s%s%s"
              "Connection: close\r\n\r\n%s", code, reason, n, err_code ? "X-Error-Code: " : "", err_code ? err_code : "",
          err_code ? "\r\n" : "", extra ? extra : "", body);
}

static void url_decode(char *s) {
    char *o = s;
    for (; *s; s++) {
        if (*s == '%' && isxdigit((unsigned char)s[1]) && isxdigit((unsigned char)s[2])) {
            char h[3] = {s[1], s[2], 0};
            *o++ = (char)strtol(h, NULL, 16);
            s += 2;
        } else {
            *o++ = *s;
        }
    }
    *o = 0;
}

static int read_request(int fd, request *r) {
    char buf[16384];
    size_t n = 0;
    while (n < sizeof buf - 1) {
        ssize_t got = read(fd, buf + n, sizeof buf - 1 - n);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return -1;
        n += (size_t)got;
        buf[n] = 0;
        if (strstr(buf, "\r\n\r\n")) break;
    }
    memset(r, 0, sizeof *r);
    if (sscanf(buf, "%7s %2047s", r->method, r->path) != 2) return -1;
    for (char *line = strstr(buf, "\r\n"); line && line[2]; line = strstr(line + 2, "\r\n")) {
        char *h = line + 2, *end = strstr(h, "\r\n");
        if (!end) break;
        if (!strncasecmp(h, "Range:", 6)) snprintf(r->range, sizeof r->range, "%.*s", (int)(end - h - 6), h + 6);
        if (!strncasecmp(h, "Authorization:", 14))
            snprintf(r->auth, sizeof r->auth, "%.*s", (int)(end - h - 14), h + 14);
    }
    char *q = strchr(r->path, '?');
    if (q) *q = 0;
    url_decode(r->path);
    for (char *v = r->range; *v == ' ';) memmove(v, v + 1, strlen(v));
    for (char *v = r->auth; *v == ' ';) memmove(v, v + 1, strlen(v));
    return 0;
}

/* "ORG/NAME" from p (advanced past it); 0 if p does not start with two path parts. */
static int take_repo(const char **p, char *repo, size_t n) {
    const char *s = *p, *a = strchr(s, '/');
    if (!a) return 0;
    const char *b = strchr(a + 1, '/');
    size_t len = b ? (size_t)(b - s) : strlen(s);
    if (len >= n || a == s || len == (size_t)(a - s) + 1) return 0;
    memcpy(repo, s, len);
    repo[len] = 0;
    *p = b ? b + 1 : s + len;
    return 1;
}

static int repo_dir(const char *repo, char *out, size_t n) {
    if (strstr(repo, "..") || repo[0] == '.') return 0;
    snprintf(out, n, "%s/%s", g_root, repo);
    struct stat st;
    return stat(out, &st) == 0 && S_ISDIR(st.st_mode);
}

/* The sha256 .sha256 gives for file, into hex[65]; 0 if none (a file not in LFS). */
static int lfs_sha(const char *dir, const char *file, char hex[65]) {
    char p[4096], line[4200];
    snprintf(p, sizeof p, "%s/.sha256", dir);
    FILE *f = fopen(p, "r");
    if (!f) return 0;
    int found = 0;
    while (!found && fgets(line, sizeof line, f)) {
        char h[128], name[4096];
        if (sscanf(line, "%127s %4095s", h, name) != 2) continue;
        const char *nm = name[0] == '*' ? name + 1 : name; /* sha256sum -b marks binary files with '*' */
        if (!strcmp(nm, file) && strlen(h) == 64) {
            snprintf(hex, 65, "%s", h);
            found = 1;
        }
    }
    fclose(f);
    return found;
}

/* 1 when the request may read the repo's files (no .token, or the right one); else answered. */
static int authorized(int fd, const char *dir, const request *r) {
    char p[4096], tok[512] = "";
    snprintf(p, sizeof p, "%s/.token", dir);
    FILE *f = fopen(p, "r");
    if (!f) return 1;
    if (!fgets(tok, sizeof tok, f)) tok[0] = 0;
    fclose(f);
    tok[strcspn(tok, "\r\n")] = 0;
    char want[600];
    snprintf(want, sizeof want, "Bearer %s", tok);
    if (!r->auth[0]) {
        status_only(fd, 401, "Unauthorized", "GatedRepo", "X-Error-Message: Access to model is restricted.\r\n");
        return 0;
    }
    if (strcmp(r->auth, want)) {
        status_only(fd, 403, "Forbidden", "GatedRepo", "X-Error-Message: Access to model is restricted.\r\n");
        return 0;
    }
    return 1;
}

static void serve_file(int fd, const request *r, const char *path, const char *etag) {
    FILE *f = fopen(path, "rb");
    struct stat st;
    if (!f || stat(path, &st) != 0 || !S_ISREG(st.st_mode)) {
        if (f) fclose(f);
        status_only(fd, 404, "Not Found", "EntryNotFound", NULL);
        return;
    }
    long size = (long)st.st_size, from = 0;
    int partial = 0;
    if (r->range[0]) {
        if (sscanf(r->range, "bytes=%ld-", &from) != 1 || from < 0) from = 0;
        if (from >= size) {
            fclose(f);
            char extra[128];
            snprintf(extra, sizeof extra, "Content-Range: bytes */%ld\r\n", size);
            status_only(fd, 416, "Range Not Satisfiable", NULL, extra);
            return;
        }
        partial = 1;
    }
    sendf(fd, "HTTP/1.1 %s\r\nContent-Length: %ld\r\nETag: \"%s\"\r\nAccept-Ranges: bytes\r\n", partial ? "206 Partial Content" : "200 OK",
          size - from, etag);
    if (partial) sendf(fd, "Content-Range: bytes %ld-%ld/%ld\r\n", from, size - 1, size);
    sendf(fd, "Connection: close\r\n\r\n");
    if (!strcmp(r->method, "HEAD")) { fclose(f); return; }
    long limit = size - from;
    if (g_drop_after >= 0 && limit > g_drop_after && !(g_drop_once && g_dropped)) {
        limit = g_drop_after;
        g_dropped = 1;
        fprintf(g_log, "drop after %ld bytes\n", limit);
    }
    fseek(f, from, SEEK_SET);
    char buf[65536];
    while (limit > 0) {
        size_t want = limit > (long)sizeof buf ? sizeof buf : (size_t)limit;
        size_t got = fread(buf, 1, want, f);
        if (!got || send_all(fd, buf, got)) break;
        limit -= (long)got;
    }
    fclose(f);
}

static void api_listing(int fd, const char *repo, const char *dir) {
    char body[65536];
    size_t off = (size_t)snprintf(body, sizeof body, "{\"id\": \"%s\", \"sha\": \"%s\", \"siblings\": [", repo, k_commit);
    int first = 1;
    /* the top level and one level of folders (files there are never picked) */
    char subname[256];
    DIR *d = opendir(dir);
    struct dirent *e;
    for (int pass = 0; pass < 2 && d; pass++) {
        rewinddir(d);
        while ((e = readdir(d)) && off < sizeof body - 512) {
            if (e->d_name[0] == '.') continue;
            char p[4096];
            struct stat st;
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            if (stat(p, &st) != 0) continue;
            if (pass == 0 && S_ISREG(st.st_mode)) {
                off += (size_t)snprintf(body + off, sizeof body - off, "%s{\"rfilename\": \"%s\", \"size\": %ld}",
                                        first ? "" : ", ", e->d_name, (long)st.st_size);
                first = 0;
            } else if (pass == 1 && S_ISDIR(st.st_mode)) {
                DIR *s = opendir(p);
                struct dirent *f;
                while (s && (f = readdir(s)) && off < sizeof body - 512) {
                    if (f->d_name[0] == '.') continue;
                    snprintf(subname, sizeof subname, "%s/%s", e->d_name, f->d_name);
                    off += (size_t)snprintf(body + off, sizeof body - off, "%s{\"rfilename\": \"%s\"}", first ? "" : ", ",
                                            subname);
                    first = 0;
                }
                if (s) closedir(s);
            }
        }
    }
    if (d) closedir(d);
    off += (size_t)snprintf(body + off, sizeof body - off, "], \"gated\": false}");
    sendf(fd, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n",
          off);
    send_all(fd, body, off);
}

static void handle(int fd) {
    request r;
    if (read_request(fd, &r)) return;
    fprintf(g_log, "%s %s range=%s auth=%s\n", r.method, r.path, r.range[0] ? r.range : "-", r.auth[0] ? "yes" : "no");
    fflush(g_log);
    if (strcmp(r.method, "GET") && strcmp(r.method, "HEAD")) {
        status_only(fd, 405, "Method Not Allowed", NULL, NULL);
        return;
    }
    if (strstr(r.path, "..")) {
        status_only(fd, 400, "Bad Request", NULL, NULL);
        return;
    }
    char repo[512], dir[4096], file[4096];
    const char *p = r.path + 1;
    if (!strncmp(p, "api/models/", 11)) {
        p += 11;
        if (!take_repo(&p, repo, sizeof repo) || !repo_dir(repo, dir, sizeof dir)) {
            status_only(fd, 404, "Not Found", "RepoNotFound", "X-Error-Message: Repository not found\r\n");
            return;
        }
        if (strncmp(p, "revision/", 9) || (strcmp(p + 9, "main") && strcmp(p + 9, k_commit))) {
            status_only(fd, 404, "Not Found", "RevisionNotFound", NULL);
            return;
        }
        api_listing(fd, repo, dir);
        return;
    }
    int cdn = !strncmp(p, "cdn/", 4);
    if (cdn) p += 4;
    if (!take_repo(&p, repo, sizeof repo) || !repo_dir(repo, dir, sizeof dir)) {
        status_only(fd, 404, "Not Found", "RepoNotFound", "X-Error-Message: Repository not found\r\n");
        return;
    }
    if (!cdn) {
        if (strncmp(p, "resolve/", 8)) {
            status_only(fd, 404, "Not Found", NULL, NULL);
            return;
        }
        p += 8;
        const char *slash = strchr(p, '/');
        if (!slash || (strncmp(p, "main/", 5) && strncmp(p, k_commit, strlen(k_commit)))) {
            status_only(fd, 404, "Not Found", "RevisionNotFound", NULL);
            return;
        }
        p = slash + 1;
        if (!authorized(fd, dir, &r)) return;
        char hex[65];
        snprintf(file, sizeof file, "%s/%s", dir, p);
        struct stat st;
        if (stat(file, &st) != 0 || !S_ISREG(st.st_mode) || p[0] == '.') {
            status_only(fd, 404, "Not Found", "EntryNotFound", NULL);
            return;
        }
        if (lfs_sha(dir, p, hex)) {
            sendf(fd, "HTTP/1.1 302 Found\r\nLocation: /cdn/%s/%s\r\nX-Linked-ETag: \"%s\"\r\nX-Linked-Size: %ld\r\n"
                      "ETag: \"%s\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", repo, p, hex, (long)st.st_size, hex);
            return;
        }
        serve_file(fd, &r, file, "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c");
        return;
    }
    snprintf(file, sizeof file, "%s/%s", dir, p);
    if (p[0] == '.') {
        status_only(fd, 404, "Not Found", "EntryNotFound", NULL);
        return;
    }
    serve_file(fd, &r, file, "cdn-object-1");
}

int main(int argc, char **argv) {
    const char *port_file = NULL, *log_path = NULL;
    int max_seconds = 600;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--root") && v) g_root = argv[++i];
        else if (!strcmp(argv[i], "--port-file") && v) port_file = argv[++i];
        else if (!strcmp(argv[i], "--log") && v) log_path = argv[++i];
        else if (!strcmp(argv[i], "--drop-after") && v) g_drop_after = atol(argv[++i]);
        else if (!strcmp(argv[i], "--drop-once")) g_drop_once = 1;
        else if (!strcmp(argv[i], "--max-seconds") && v) max_seconds = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s --root DIR --port-file FILE [--log FILE] [--drop-after N [--drop-once]] "
                            "[--max-seconds S]\n", argv[0]);
            return 2;
        }
    }
    if (!g_root || !port_file) {
        fprintf(stderr, "%s: --root and --port-file are required\n", argv[0]);
        return 2;
    }
    g_log = log_path ? fopen(log_path, "a") : stderr;
    if (!g_log) { perror(log_path); return 1; }
    signal(SIGPIPE, SIG_IGN);
    alarm((unsigned)max_seconds); /* never outlive a test script that died */
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (s < 0 || bind(s, (struct sockaddr *)&a, sizeof a) || listen(s, 16) || getsockname(s, (struct sockaddr *)&a, &al)) {
        perror("hub_server: socket");
        return 1;
    }
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", port_file);
    FILE *pf = fopen(tmp, "w");
    if (!pf || fprintf(pf, "%d\n", ntohs(a.sin_port)) < 0 || fclose(pf) || rename(tmp, port_file)) {
        perror(port_file);
        return 1;
    }
    for (;;) {
        int c = accept(s, NULL, NULL);
        if (c < 0) {
            if (errno == EINTR) continue;
            perror("hub_server: accept");
            return 1;
        }
        handle(c);
        shutdown(c, SHUT_WR);
        close(c);
    }
}

/* Models by name: a Hugging Face repo id -> the local folder holding it (fitllm's download
 * folder, then the user's Hugging Face cache). The cache layout is huggingface_hub's:
 *   <cache>/models--ORG--NAME/refs/main        the commit hash main points at
 *   <cache>/models--ORG--NAME/snapshots/<rev>/  the files (symlinks into ../../blobs/)
 */
#include "fitllm/hub.h"

#include "core/fs.h"

#include <ctype.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int part_ok(const char *s, size_t n) {
    if (n == 0) return 0;
    /* the Hub's \b[\w\-.]+\b: word characters at both ends */
    if (!(isalnum((unsigned char)s[0]) || s[0] == '_') || !(isalnum((unsigned char)s[n - 1]) || s[n - 1] == '_'))
        return 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (!(isalnum(c) || c == '_' || c == '-' || c == '.')) return 0;
        if (i && (c == '-' || c == '.') && s[i - 1] == c) return 0; /* "--" and ".." are reserved */
    }
    return 1;
}

int fl_hub_is_repo_id(const char *s) {
    if (!s) return 0;
    size_t n = strlen(s);
    const char *slash = strchr(s, '/');
    if (n > 96 || !slash || strchr(slash + 1, '/')) return 0;
    return part_ok(s, (size_t)(slash - s)) && part_ok(slash + 1, n - (size_t)(slash - s) - 1);
}

int fl_hub_repo_of(const char *name, char *repo, size_t n) {
    if (!name || !name[0]) return 0;
    if (fl_hub_is_repo_id(name)) {
        snprintf(repo, n, "%s", name);
        return 1;
    }
    /* .../checkpoints/ORG/NAME[/] */
    char p[FL_HUB_PATH];
    if (snprintf(p, sizeof p, "%s", name) >= (int)sizeof p) return 0;
    size_t len = strlen(p);
    while (len > 1 && p[len - 1] == '/') p[--len] = 0;
    char *s2 = strrchr(p, '/');
    if (!s2) return 0;
    *s2 = 0;
    char *s1 = strrchr(p, '/');
    if (!s1) return 0;
    *s1 = 0;
    const char *parent = strrchr(p, '/') ? strrchr(p, '/') + 1 : p;
    if (strcmp(parent, "checkpoints")) return 0;
    char id[256];
    if (snprintf(id, sizeof id, "%s/%s", s1 + 1, s2 + 1) >= (int)sizeof id || !fl_hub_is_repo_id(id)) return 0;
    snprintf(repo, n, "%s", id);
    return 1;
}

fl_status fl_hub_cache_dir(char *buf, size_t n) {
    const char *v;
    int w;
    if ((v = getenv("HF_HUB_CACHE")) && v[0]) w = snprintf(buf, n, "%s", v);
    else if ((v = getenv("HUGGINGFACE_HUB_CACHE")) && v[0]) w = snprintf(buf, n, "%s", v); /* the older name */
    else if ((v = getenv("HF_HOME")) && v[0]) w = snprintf(buf, n, "%s/hub", v);
    else if ((v = getenv("XDG_CACHE_HOME")) && v[0]) w = snprintf(buf, n, "%s/huggingface/hub", v);
    else if ((v = getenv("HOME")) && v[0]) w = snprintf(buf, n, "%s/.cache/huggingface/hub", v);
    else return fl_errorf(FL_ERR_NOT_FOUND, "no Hugging Face cache: none of HF_HUB_CACHE, HF_HOME, HOME is set");
    if (w < 0 || (size_t)w >= n) return fl_errorf(FL_ERR_INVALID, "Hugging Face cache path too long: %s", v);
    return FL_OK;
}

const char *fl_hub_download_root(void) {
    const char *v = getenv("FITLLM_CHECKPOINTS");
    return v && v[0] ? v : "checkpoints";
}

const char *fl_hub_where_name(fl_hub_where w) {
    switch (w) {
    case FL_HUB_DOWNLOAD_DIR: return "fitllm's download folder";
    case FL_HUB_HF_CACHE: return "the Hugging Face cache";
    default: return "nowhere";
    }
}

static int has_config(const char *dir) {
    char p[FL_HUB_PATH];
    return fl_fs_join(p, sizeof p, dir, "config.json") == FL_OK && fl_fs_is_file(p);
}

/* <repo_dir>/snapshots/<rev> holding config.json: rev from refs/main, else the newest snapshot
 * with one (a cache filled by revision only has no refs/main). 1 found, 0 not; *had_snapshot:
 * some snapshot exists (an incomplete download, for the message). */
static int cache_snapshot(const char *repo_dir, char *out, size_t n, int *had_snapshot) {
    char p[FL_HUB_PATH], rev[128] = "";
    *had_snapshot = 0;
    if (snprintf(p, sizeof p, "%s/refs/main", repo_dir) < (int)sizeof p) {
        FILE *f = fopen(p, "r");
        if (f) {
            if (!fgets(rev, sizeof rev, f)) rev[0] = 0;
            fclose(f);
            rev[strcspn(rev, " \t\r\n")] = 0;
        }
    }
    if (rev[0] && !strchr(rev, '/') && strcmp(rev, "..") && strcmp(rev, ".")) {
        if (snprintf(out, n, "%s/snapshots/%s", repo_dir, rev) < (int)n && fl_fs_is_dir(out)) {
            *had_snapshot = 1;
            if (has_config(out)) return 1;
        }
    }
    if (snprintf(p, sizeof p, "%s/snapshots", repo_dir) >= (int)sizeof p) return 0;
    DIR *d = opendir(p);
    if (!d) return 0;
    struct dirent *e;
    time_t best_t = 0;
    int found = 0;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char s[FL_HUB_PATH], c[FL_HUB_PATH];
        if (snprintf(s, sizeof s, "%s/%s", p, e->d_name) >= (int)sizeof s || !fl_fs_is_dir(s)) continue;
        *had_snapshot = 1;
        struct stat st;
        if (fl_fs_join(c, sizeof c, s, "config.json") != FL_OK || stat(c, &st) != 0) continue;
        if (!found || st.st_mtime > best_t) {
            snprintf(out, n, "%s", s);
            best_t = st.st_mtime;
            found = 1;
        }
    }
    closedir(d);
    return found;
}

fl_status fl_hub_resolve(const char *name, char *out, size_t n, fl_hub_where *where) {
    char repo[128];
    if (where) *where = FL_HUB_NOWHERE;
    if (!fl_hub_repo_of(name, repo, sizeof repo))
        return fl_errorf(FL_ERR_INVALID, "'%s' is not a Hugging Face repo id (ORG/NAME)", name ? name : "");
    const int by_path = strcmp(name, repo) != 0; /* checkpoints/ORG/NAME */
    const char *root = fl_hub_download_root();
    char dl[FL_HUB_PATH];
    if (fl_fs_join(dl, sizeof dl, root, repo) == FL_OK && has_config(dl)) {
        if (snprintf(out, n, "%s", dl) >= (int)n) return fl_errorf(FL_ERR_INVALID, "path too long: %s", dl);
        if (where) *where = FL_HUB_DOWNLOAD_DIR;
        return FL_OK;
    }
    char cache[FL_HUB_PATH], rd[FL_HUB_PATH], snap[FL_HUB_PATH];
    const char *slash = strchr(repo, '/');
    int have_cache = fl_hub_cache_dir(cache, sizeof cache) == FL_OK;
    if (!have_cache) snprintf(cache, sizeof cache, "(no cache: HOME is not set)");
    int had = 0;
    if (have_cache &&
        snprintf(rd, sizeof rd, "%s/models--%.*s--%s", cache, (int)(slash - repo), repo, slash + 1) < (int)sizeof rd &&
        cache_snapshot(rd, snap, sizeof snap, &had)) {
        if (snprintf(out, n, "%s", snap) >= (int)n) return fl_errorf(FL_ERR_INVALID, "path too long: %s", snap);
        if (where) *where = FL_HUB_HF_CACHE;
        return FL_OK;
    }
    char dest[FL_HUB_PATH];
    snprintf(dest, sizeof dest, "%s/%s", root, repo);
    const char *state = had ? " (it is there, but no snapshot has a config.json: an incomplete download)" : "";
    if (by_path) {
        /* the folder above ORG/NAME: where `fitllm download` must write */
        char parent[FL_HUB_PATH];
        snprintf(parent, sizeof parent, "%s", name);
        for (int k = 0; k < 2; k++) {
            size_t len = strlen(parent);
            while (len > 1 && parent[len - 1] == '/') parent[--len] = 0;
            char *s = strrchr(parent, '/');
            if (s) *s = 0;
        }
        int dflt = !strcmp(parent, root);
        return fl_errorf(FL_ERR_NOT_FOUND,
                         "'%s' does not exist, and the model %s is not in the Hugging Face cache (%s)%s: "
                         "run `fitllm download %s%s%s` to put it there",
                         name, repo, cache, state, repo, dflt ? "" : " --checkpoint_dir ", dflt ? "" : parent);
    }
    return fl_errorf(FL_ERR_NOT_FOUND,
                     "the model %s is not downloaded: not in %s, nor in the Hugging Face cache (%s)%s; "
                     "run `fitllm download %s` first", repo, dest, cache, state, repo);
}

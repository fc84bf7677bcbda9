/* Image-caption datasets (include/fitllm/image.h): JSON / JSONL records and image folders with a
 * captions file. Every record is checked at load (a text string, an image that exists), so a
 * training run fails before its first step with the file and record named, not mid-epoch. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <strings.h>
#include <sys/stat.h>

#include "fitllm/image.h"
#include "fitllm/json.h"
#include "image/image-impl.h"

void fl_img_captions_free(fl_img_captions *c) {
    if (!c) return;
    for (size_t i = 0; i < c->n; i++) free(c->image[i]), free(c->text[i]);
    free(c->image), free(c->text);
    memset(c, 0, sizeof *c);
}

static fl_status add(fl_img_captions *c, size_t *cap, const char *dir, const char *name, size_t name_len,
                     const char *text, size_t text_len, const char *src, const char *unit, size_t rec) {
    if (name_len == 0) return fl_errorf(FL_ERR_FORMAT, "%s: %s %zu: empty image name", src, unit, rec);
    if (memchr(name, 0, name_len))
        return fl_errorf(FL_ERR_FORMAT, "%s: %s %zu: NUL in the image name", src, unit, rec);
    if (c->n == *cap) {
        size_t nc = *cap ? *cap * 2 : 64;
        char **a = realloc(c->image, nc * sizeof *a);
        if (a) c->image = a;
        char **b = a ? realloc(c->text, nc * sizeof *b) : NULL;
        if (!b) return fl_errorf(FL_ERR_OOM, "%s: out of memory", src);
        c->text = b;
        *cap = nc;
    }
    size_t dl = name[0] == '/' ? 0 : strlen(dir);
    char *path = malloc(dl + 1 + name_len + 1), *t = malloc(text_len + 1);
    if (!path || !t) {
        free(path), free(t);
        return fl_errorf(FL_ERR_OOM, "%s: out of memory", src);
    }
    if (dl) memcpy(path, dir, dl), path[dl] = '/';
    memcpy(path + (dl ? dl + 1 : 0), name, name_len);
    path[(dl ? dl + 1 : 0) + name_len] = 0;
    memcpy(t, text, text_len);
    t[text_len] = 0;
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) {
        fl_status s = fl_errorf(FL_ERR_NOT_FOUND, "%s: %s %zu: image %s not found", src, unit, rec, path);
        free(path), free(t);
        return s;
    }
    c->image[c->n] = path;
    c->text[c->n] = t;
    c->n++;
    return FL_OK;
}

static fl_status add_json(fl_img_captions *c, size_t *cap, const char *dir, const fl_json *o, const char *src,
                          const char *unit, size_t rec) {
    if (!o || o->type != FL_JSON_OBJECT)
        return fl_errorf(FL_ERR_FORMAT, "%s: %s %zu: not a JSON object", src, unit, rec);
    const fl_json *im = fl_json_get(o, "image");
    if (!im) im = fl_json_get(o, "file_name");
    const fl_json *tx = fl_json_get(o, "text");
    if (!tx) tx = fl_json_get(o, "caption");
    if (!im || im->type != FL_JSON_STRING)
        return fl_errorf(FL_ERR_FORMAT, "%s: %s %zu: key \"image\" (or \"file_name\"): %s", src, unit, rec,
                         im ? "not a string" : "missing");
    if (!tx || tx->type != FL_JSON_STRING)
        return fl_errorf(FL_ERR_FORMAT, "%s: %s %zu: key \"text\" (or \"caption\"): %s (the caption)", src, unit,
                         rec, tx ? "not a string" : "missing");
    if (tx->len == 0) return fl_errorf(FL_ERR_FORMAT, "%s: %s %zu: key \"%s\": empty caption", src, unit, rec,
                                       fl_json_get(o, "text") ? "text" : "caption");
    return add(c, cap, dir, im->str, im->len, tx->str, tx->len, src, unit, rec);
}

static fl_status parse_jsonl(fl_img_captions *c, size_t *cap, const char *dir, const char *buf, size_t n,
                             const char *src) {
    size_t rec = 0;
    for (size_t pos = 0; pos < n;) {
        const char *nl = memchr(buf + pos, '\n', n - pos);
        size_t end = nl ? (size_t)(nl - buf) : n, len = end - pos;
        size_t k = 0;
        rec++; /* the line number */
        while (k < len && (buf[pos + k] == ' ' || buf[pos + k] == '\t' || buf[pos + k] == '\r')) k++;
        if (k < len) {
            fl_json *j = NULL;
            fl_status s = fl_json_parse(buf + pos, len, src, &j);
            if (s == FL_OK) s = add_json(c, cap, dir, j, src, "line", rec);
            fl_json_free(j);
            if (s != FL_OK) return s;
        }
        pos = end + 1;
    }
    return FL_OK;
}

static fl_status parse_tsv(fl_img_captions *c, size_t *cap, const char *dir, const char *buf, size_t n,
                           const char *src) {
    size_t rec = 0;
    for (size_t pos = 0; pos < n;) {
        const char *nl = memchr(buf + pos, '\n', n - pos);
        size_t end = nl ? (size_t)(nl - buf) : n, len = end - pos;
        if (len && buf[pos + len - 1] == '\r') len--;
        rec++; /* the line number */
        if (len) {
            const char *tab = memchr(buf + pos, '\t', len);
            if (!tab) return fl_errorf(FL_ERR_FORMAT, "%s: %s %zu: no tab between the file name and the caption",
                                       src, "line", rec);
            size_t nl_ = (size_t)(tab - (buf + pos));
            size_t tl = len - nl_ - 1;
            if (tl == 0) return fl_errorf(FL_ERR_FORMAT, "%s: %s %zu: empty caption", src, "line", rec);
            FL_TRY(add(c, cap, dir, buf + pos, nl_, tab + 1, tl, src, "line", rec));
        }
        pos = end + 1;
    }
    return FL_OK;
}

static int ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

static int is_image_name(const char *n) {
    const char *dot = strrchr(n, '.');
    return dot && n[0] != '.' && (!strcasecmp(dot, ".jpg") || !strcasecmp(dot, ".jpeg") || !strcasecmp(dot, ".png"));
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* A folder of images, each with its caption in a text file of the same stem (a.jpg + a.txt), in name order. An
 * image without its .txt, or an empty one, is an error naming the file. Returns FL_ERR_NOT_FOUND (nothing set) when
 * *none: the folder holds no image at all (FL_OK returned, nothing loaded). */
static fl_status load_txt_folder(const char *dir, fl_img_captions *out, int *none) {
    *none = 0;
    DIR *d = opendir(dir);
    if (!d) return fl_errorf(FL_ERR_IO, "%s: cannot read the folder", dir);
    char **names = NULL;
    size_t n = 0, cap = 0;
    fl_status s = FL_OK;
    for (struct dirent *e; s == FL_OK && (e = readdir(d));) {
        if (!is_image_name(e->d_name)) continue;
        if (n == cap) {
            char **nn = realloc(names, (cap = cap ? 2 * cap : 64) * sizeof *nn);
            if (!nn) s = fl_errorf(FL_ERR_OOM, "%s: out of memory", dir);
            else names = nn;
        }
        if (s == FL_OK && !(names[n++] = strdup(e->d_name))) s = fl_errorf(FL_ERR_OOM, "%s: out of memory", dir), n--;
    }
    closedir(d);
    if (s == FL_OK && n == 0) *none = 1;
    if (s == FL_OK && n > 1) qsort(names, n, sizeof *names, cmp_str); /* names is NULL when n is 0 */
    size_t ocap = 0;
    for (size_t i = 0; s == FL_OK && i < n; i++) {
        char txt[4096];
        const size_t stem = (size_t)(strrchr(names[i], '.') - names[i]);
        snprintf(txt, sizeof txt, "%s/%.*s.txt", dir, (int)stem, names[i]);
        struct stat st;
        if (stat(txt, &st) != 0) {
            s = fl_errorf(FL_ERR_NOT_FOUND, "%s: image %s has no caption file %.*s.txt (an image folder holds "
                          "captions.jsonl, captions.tsv, or a NAME.txt caption beside each image)", dir, names[i],
                          (int)stem, names[i]);
            break;
        }
        uint8_t *buf = NULL;
        size_t len = 0;
        s = fl_img_read_file(txt, "caption file", &buf, &len);
        while (s == FL_OK && len && strchr(" \t\r\n", buf[len - 1])) len--; /* the file's final newline */
        if (s == FL_OK && len == 0) s = fl_errorf(FL_ERR_FORMAT, "%s: empty caption", txt);
        if (s == FL_OK && memchr(buf, 0, len)) s = fl_errorf(FL_ERR_FORMAT, "%s: NUL byte in the caption", txt);
        if (s == FL_OK) s = add(out, &ocap, dir, names[i], strlen(names[i]), (const char *)buf, len, txt, "line", 1);
        free(buf);
    }
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
    if (s != FL_OK) fl_img_captions_free(out);
    return s;
}

fl_status fl_img_captions_load(const char *path, fl_img_captions *out) {
    memset(out, 0, sizeof *out);
    struct stat st;
    if (stat(path, &st) != 0) return fl_errorf(FL_ERR_NOT_FOUND, "%s: caption dataset not found", path);
    char file[4096], dir[4096];
    int kind; /* 0 json, 1 jsonl, 2 tsv */
    if (S_ISDIR(st.st_mode)) {
        snprintf(dir, sizeof dir, "%s", path);
        snprintf(file, sizeof file, "%s/captions.jsonl", path);
        kind = 1;
        if (stat(file, &st) != 0) {
            snprintf(file, sizeof file, "%s/captions.tsv", path);
            kind = 2;
            if (stat(file, &st) != 0) {
                int none;
                fl_status s = load_txt_folder(path, out, &none);
                if (s == FL_OK && none)
                    return fl_errorf(FL_ERR_NOT_FOUND, "%s: an image folder needs captions.jsonl, captions.tsv or a "
                                     "NAME.txt caption beside each image (Hugging Face save_to_disk folders: convert "
                                     "with tools/hf_to_captions.py)", path);
                return s;
            }
        }
    } else {
        snprintf(file, sizeof file, "%s", path);
        snprintf(dir, sizeof dir, "%s", path);
        char *slash = strrchr(dir, '/');
        if (slash) *slash = 0;
        else snprintf(dir, sizeof dir, ".");
        if (ends_with(path, ".json")) kind = 0;
        else if (ends_with(path, ".jsonl")) kind = 1;
        else if (ends_with(path, ".tsv")) kind = 2;
        else return fl_errorf(FL_ERR_UNSUPPORTED, "%s: a caption dataset is a .json, .jsonl or .tsv file or an image "
                              "folder", path);
    }
    uint8_t *buf;
    size_t n, cap = 0;
    FL_TRY(fl_img_read_file(file, "captions file", &buf, &n));
    fl_status s = FL_OK;
    if (kind == 0) {
        fl_json *j = NULL;
        s = fl_json_parse((const char *)buf, n, file, &j);
        if (s == FL_OK && j->type != FL_JSON_ARRAY)
            s = fl_errorf(FL_ERR_FORMAT, "%s: a .json caption file is an array of {\"image\", \"text\"} records", file);
        size_t rec = 0;
        for (const fl_json *e = s == FL_OK ? j->child : NULL; e && s == FL_OK; e = e->next)
            s = add_json(out, &cap, dir, e, file, "record", ++rec);
        fl_json_free(j);
    } else if (kind == 1) {
        s = parse_jsonl(out, &cap, dir, (const char *)buf, n, file);
    } else {
        s = parse_tsv(out, &cap, dir, (const char *)buf, n, file);
    }
    free(buf);
    if (s == FL_OK && out->n == 0) s = fl_errorf(FL_ERR_FORMAT, "%s: no records", file);
    if (s != FL_OK) fl_img_captions_free(out);
    return s;
}

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

void fl_img_captions_shuffle(fl_img_captions *c, uint64_t seed) {
    uint64_t st = seed;
    for (size_t i = c->n; i > 1; i--) {
        size_t j = (size_t)(splitmix64(&st) % i); /* modulo bias < i / 2^64: negligible */
        char *a = c->image[i - 1], *t = c->text[i - 1];
        c->image[i - 1] = c->image[j], c->text[i - 1] = c->text[j];
        c->image[j] = a, c->text[j] = t;
    }
}

void fl_img_captions_limit(fl_img_captions *c, size_t n) {
    for (size_t i = n; i < c->n; i++) free(c->image[i]), free(c->text[i]);
    if (n < c->n) c->n = n;
}

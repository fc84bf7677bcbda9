/* Instruction records from .json (an array of objects) and .jsonl (one object
 * per line), plus UTF-8 helpers. A record needs string "instruction" and
 * "output"; "input" may be absent, null or a string; other keys are ignored
 * (Alpaca's "text"). Errors name the file and the record index (0-based) or
 * the line (1-based). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data-impl.h"
#include "fitllm/json.h"

static char *dupn(const char *s, size_t n) {
    char *o = malloc(n + 1);
    if (!o) return NULL;
    memcpy(o, s, n);
    o[n] = '\0';
    return o;
}

fl_status fl_data_records_add(fl_data_records *rs, const char *instruction, const char *input, const char *output) {
    if (rs->n == rs->cap) {
        size_t c = rs->cap ? rs->cap * 2 : 64;
        fl_data_record *r = realloc(rs->r, c * sizeof *r);
        if (!r) return fl_errorf(FL_ERR_OOM, "records: out of memory");
        rs->r = r;
        rs->cap = c;
    }
    fl_data_record *r = &rs->r[rs->n];
    r->instruction = dupn(instruction, strlen(instruction));
    r->input = input ? dupn(input, strlen(input)) : NULL;
    r->output = dupn(output, strlen(output));
    if (!r->instruction || !r->output || (input && !r->input)) {
        free(r->instruction);
        free(r->input);
        free(r->output);
        return fl_errorf(FL_ERR_OOM, "records: out of memory");
    }
    rs->n++;
    return FL_OK;
}

void fl_data_records_free(fl_data_records *rs) {
    for (size_t i = 0; i < rs->n; i++) {
        free(rs->r[i].instruction);
        free(rs->r[i].input);
        free(rs->r[i].output);
    }
    free(rs->r);
    memset(rs, 0, sizeof *rs);
}

static const char *type_name(fl_json_type t) {
    static const char *const names[] = {"null", "a boolean", "a number", "a string", "an array", "an object"};
    return (unsigned)t < 6 ? names[t] : "?";
}

/* `where` is e.g. "x.json: record 3" or "x.jsonl: line 4". */
static fl_status string_field(const fl_json *obj, const char *key, int optional, const char *where, const char **out) {
    const fl_json *v = fl_json_get(obj, key);
    *out = NULL;
    if (!v || v->type == FL_JSON_NULL) {
        if (optional) return FL_OK;
        return fl_errorf(FL_ERR_FORMAT, "%s: missing \"%s\" (a record needs string \"instruction\" and \"output\")",
                         where, key);
    }
    if (v->type != FL_JSON_STRING)
        return fl_errorf(FL_ERR_FORMAT, "%s: \"%s\" must be a string, got %s", where, key, type_name(v->type));
    if (strlen(v->str) != v->len)
        return fl_errorf(FL_ERR_FORMAT, "%s: \"%s\" contains a NUL character (\\u0000), not supported", where, key);
    *out = v->str;
    return FL_OK;
}

static fl_status add_object(fl_data_records *rs, const fl_json *obj, const char *where) {
    if (obj->type != FL_JSON_OBJECT)
        return fl_errorf(FL_ERR_FORMAT, "%s: expected an object with \"instruction\" and \"output\", got %s", where,
                         type_name(obj->type));
    const char *ins, *inp, *out;
    FL_TRY(string_field(obj, "instruction", 0, where, &ins));
    FL_TRY(string_field(obj, "input", 1, where, &inp));
    FL_TRY(string_field(obj, "output", 0, where, &out));
    return fl_data_records_add(rs, ins, inp, out);
}

fl_status fl_data_read_json(const char *text, size_t n, const char *source, fl_data_records *out) {
    fl_json *root = NULL;
    FL_TRY(fl_json_parse(text, n, source, &root));
    fl_status s = FL_OK;
    if (root->type != FL_JSON_ARRAY) {
        s = fl_errorf(FL_ERR_FORMAT, "%s: expected a JSON array of records, got %s", source, type_name(root->type));
    } else {
        size_t i = 0;
        char where[4200];
        for (const fl_json *e = root->child; e && s == FL_OK; e = e->next, i++) {
            snprintf(where, sizeof where, "%s: record %zu", source, i);
            s = add_object(out, e, where);
        }
    }
    fl_json_free(root);
    return s;
}

static int blank(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r' && s[i] != '\n') return 0;
    return 1;
}

fl_status fl_data_read_jsonl(const char *text, size_t n, const char *source, fl_data_records *out) {
    size_t pos = 0, line = 0;
    char where[4200];
    while (pos < n) {
        const char *nl = memchr(text + pos, '\n', n - pos);
        size_t end = nl ? (size_t)(nl - text) : n;
        line++;
        if (blank(text + pos, end - pos)) {
            out->n_blank++;
        } else {
            snprintf(where, sizeof where, "%s: line %zu (record %zu)", source, line, out->n);
            fl_json *obj = NULL;
            fl_status s = fl_json_parse(text + pos, end - pos, where, &obj);
            if (s != FL_OK) return s;
            s = add_object(out, obj, where);
            fl_json_free(obj);
            if (s != FL_OK) return s;
        }
        pos = end + 1;
    }
    return FL_OK;
}

static int ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

fl_status fl_data_read_records(const char *text, size_t n, const char *source, fl_data_records *out) {
    if (ends_with(source, ".jsonl")) return fl_data_read_jsonl(text, n, source, out);
    if (ends_with(source, ".json")) return fl_data_read_json(text, n, source, out);
    return fl_errorf(FL_ERR_INVALID, "%s: unsupported file format (expected .json or .jsonl)", source);
}

/* ---- UTF-8 ------------------------------------------------------------------------ */

static size_t utf8_len(const unsigned char *s, size_t avail, unsigned *cp_out) {
    unsigned c = s[0], cp;
    size_t n;
    if (c < 0x80) { *cp_out = c; return 1; }
    if (c >= 0xC2 && c <= 0xDF) { n = 2; cp = c & 0x1F; }
    else if (c >= 0xE0 && c <= 0xEF) { n = 3; cp = c & 0x0F; }
    else if (c >= 0xF0 && c <= 0xF4) { n = 4; cp = c & 0x07; }
    else return 0;
    if (avail < n) return 0;
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF))) return 0;
    if (cp >= 0xD800 && cp <= 0xDFFF) return 0;
    *cp_out = cp;
    return n;
}

int fl_data_utf8_valid(const char *s, size_t n, size_t *bad) {
    size_t i = 0;
    unsigned cp;
    while (i < n) {
        size_t l = utf8_len((const unsigned char *)s + i, n - i, &cp);
        if (!l) {
            if (bad) *bad = i;
            return 0;
        }
        i += l;
    }
    return 1;
}

/* Python str.isspace() for code points (White_Space + bidi WS/B/S). */
static int py_space(unsigned cp) {
    return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
           cp == 0x3000;
}

void fl_data_strip(const char *s, size_t n, size_t *begin, size_t *end) {
    const unsigned char *u = (const unsigned char *)s;
    size_t b = 0, e = 0, i = 0;
    int seen = 0;
    unsigned cp;
    while (i < n) {
        size_t l = utf8_len(u + i, n - i, &cp);
        if (!l) l = 1, cp = 0xFFFD;
        if (!py_space(cp)) {
            if (!seen) b = i, seen = 1;
            e = i + l;
        }
        i += l;
    }
    if (!seen) b = e = 0;
    *begin = b;
    *end = e;
}

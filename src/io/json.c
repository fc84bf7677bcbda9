/* Strict RFC 8259 JSON parser; see include/fitllm/json.h.
 *
 * Recursive descent with a depth limit (FL_JSON_MAX_DEPTH) so hostile inputs
 * cannot overflow the stack. Strings are validated as UTF-8, \uXXXX escapes
 * (surrogate pairs included) are decoded to UTF-8. Errors carry
 * "source:line:col" and what was expected.
 */
#include "fitllm/json.h"
#include "core/fs.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FL_JSON_MAX_DEPTH 512

typedef struct {
    const char *s;
    size_t n, pos;
    const char *src;
    int depth;
} fl_json_parser;

static fl_status fl_json_err(const fl_json_parser *p, size_t at, const char *fmt, const char *what) {
    int line = 1, col = 1;
    for (size_t i = 0; i < at && i < p->n; i++) {
        if (p->s[i] == '\n') { line++; col = 1; } else col++;
    }
    char near[16];
    if (at >= p->n) snprintf(near, sizeof near, "end of input");
    else {
        unsigned char c = (unsigned char)p->s[at];
        if (c >= 0x20 && c < 0x7f) snprintf(near, sizeof near, "'%c'", c);
        else snprintf(near, sizeof near, "byte 0x%02x", c);
    }
    char msg[256];
    snprintf(msg, sizeof msg, fmt, what ? what : "");
    return fl_errorf(FL_ERR_FORMAT, "%s:%d:%d: %s (found %s)", p->src ? p->src : "<json>", line, col, msg, near);
}

static void fl_json_skip_ws(fl_json_parser *p) {
    while (p->pos < p->n) {
        char c = p->s[p->pos];
        if (c == ' ' || c == '\t' || c == '\n' || c == '\r') p->pos++;
        else break;
    }
}

static fl_json *fl_json_node(fl_json_type t) {
    fl_json *j = calloc(1, sizeof *j);
    if (j) j->type = t;
    return j;
}

void fl_json_free(fl_json *j) {
    while (j) {
        fl_json *next = j->next;
        fl_json_free(j->child);
        free(j->key);
        free(j->str);
        free(j);
        j = next;
    }
}

/* ---- strings ---------------------------------------------------------------- */

typedef struct {
    char *b;
    size_t len, cap;
} fl_json_buf;

static int fl_json_buf_put(fl_json_buf *b, const char *src, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 32;
        while (cap < b->len + n + 1) cap *= 2;
        char *nb = realloc(b->b, cap);
        if (!nb) return -1;
        b->b = nb;
        b->cap = cap;
    }
    memcpy(b->b + b->len, src, n);
    b->len += n;
    b->b[b->len] = '\0';
    return 0;
}

static int fl_json_hex4(const char *s, unsigned *out) {
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return -1;
    }
    *out = v;
    return 0;
}

static size_t fl_json_utf8_encode(unsigned cp, char *o) {
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xC0 | (cp >> 6)); o[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12)); o[1] = (char)(0x80 | ((cp >> 6) & 0x3F)); o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18)); o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Length of a valid UTF-8 sequence starting at s[0..avail), or 0 if invalid. */
static size_t fl_json_utf8_len(const unsigned char *s, size_t avail) {
    unsigned c = s[0];
    size_t n;
    unsigned cp;
    if (c < 0x80) return 1;
    else if (c >= 0xC2 && c <= 0xDF) { n = 2; cp = c & 0x1F; }
    else if (c >= 0xE0 && c <= 0xEF) { n = 3; cp = c & 0x0F; }
    else if (c >= 0xF0 && c <= 0xF4) { n = 4; cp = c & 0x07; }
    else return 0;
    if (avail < n) return 0;
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF))) return 0; /* overlong / range */
    if (cp >= 0xD800 && cp <= 0xDFFF) return 0;                                           /* surrogates */
    return n;
}

/* p->pos at the opening quote. */
static fl_status fl_json_parse_string(fl_json_parser *p, char **out, size_t *out_len) {
    fl_json_buf b = {0};
    p->pos++; /* '"' */
    for (;;) {
        if (p->pos >= p->n) { free(b.b); return fl_json_err(p, p->pos, "unterminated string: expected '\"'%s", ""); }
        unsigned char c = (unsigned char)p->s[p->pos];
        if (c == '"') { p->pos++; break; }
        if (c < 0x20) { free(b.b); return fl_json_err(p, p->pos, "control character in string: expected '\\u00XX' escape%s", ""); }
        if (c == '\\') {
            size_t esc = p->pos;
            if (p->pos + 1 >= p->n) { free(b.b); return fl_json_err(p, p->pos + 1, "unterminated escape in string%s", ""); }
            char e = p->s[p->pos + 1];
            char ch;
            int simple = 1;
            switch (e) {
            case '"': ch = '"'; break;
            case '\\': ch = '\\'; break;
            case '/': ch = '/'; break;
            case 'b': ch = '\b'; break;
            case 'f': ch = '\f'; break;
            case 'n': ch = '\n'; break;
            case 'r': ch = '\r'; break;
            case 't': ch = '\t'; break;
            case 'u': simple = 0; ch = 0; break;
            default:
                free(b.b);
                return fl_json_err(p, p->pos + 1, "invalid escape: expected one of \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX%s", "");
            }
            if (simple) {
                if (fl_json_buf_put(&b, &ch, 1)) { free(b.b); return fl_errorf(FL_ERR_OOM, "%s: out of memory parsing JSON", p->src); }
                p->pos += 2;
                continue;
            }
            unsigned cp;
            if (p->pos + 6 > p->n || fl_json_hex4(p->s + p->pos + 2, &cp)) {
                free(b.b);
                return fl_json_err(p, p->pos + 2, "invalid \\u escape: expected 4 hex digits%s", "");
            }
            p->pos += 6;
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                unsigned lo;
                if (p->pos + 6 > p->n || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u' ||
                    fl_json_hex4(p->s + p->pos + 2, &lo) || lo < 0xDC00 || lo > 0xDFFF) {
                    free(b.b);
                    return fl_json_err(p, esc, "unpaired high surrogate: expected a \\uDC00-\\uDFFF escape to follow%s", "");
                }
                p->pos += 6;
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                free(b.b);
                return fl_json_err(p, esc, "unpaired low surrogate in \\u escape%s", "");
            }
            char u[4];
            size_t un = fl_json_utf8_encode(cp, u);
            if (fl_json_buf_put(&b, u, un)) { free(b.b); return fl_errorf(FL_ERR_OOM, "%s: out of memory parsing JSON", p->src); }
            continue;
        }
        /* run of plain bytes */
        size_t un = fl_json_utf8_len((const unsigned char *)p->s + p->pos, p->n - p->pos);
        if (!un) { free(b.b); return fl_json_err(p, p->pos, "invalid UTF-8 in string%s", ""); }
        if (fl_json_buf_put(&b, p->s + p->pos, un)) { free(b.b); return fl_errorf(FL_ERR_OOM, "%s: out of memory parsing JSON", p->src); }
        p->pos += un;
    }
    if (!b.b) {
        b.b = malloc(1);
        if (!b.b) return fl_errorf(FL_ERR_OOM, "%s: out of memory parsing JSON", p->src);
        b.b[0] = '\0';
    }
    *out = b.b;
    *out_len = b.len;
    return FL_OK;
}

/* ---- numbers ---------------------------------------------------------------- */

static int fl_json_isdigit(char c) { return c >= '0' && c <= '9'; }

static fl_status fl_json_parse_number(fl_json_parser *p, fl_json *j) {
    size_t start = p->pos, i = p->pos;
    int is_int = 1;
    if (i < p->n && p->s[i] == '-') i++;
    if (i >= p->n || !fl_json_isdigit(p->s[i])) return fl_json_err(p, i, "invalid number: expected a digit%s", "");
    if (p->s[i] == '0') {
        i++;
        if (i < p->n && fl_json_isdigit(p->s[i])) return fl_json_err(p, i, "invalid number: leading zeros are not allowed%s", "");
    } else {
        while (i < p->n && fl_json_isdigit(p->s[i])) i++;
    }
    if (i < p->n && p->s[i] == '.') {
        is_int = 0;
        i++;
        if (i >= p->n || !fl_json_isdigit(p->s[i])) return fl_json_err(p, i, "invalid number: expected a digit after '.'%s", "");
        while (i < p->n && fl_json_isdigit(p->s[i])) i++;
    }
    if (i < p->n && (p->s[i] == 'e' || p->s[i] == 'E')) {
        is_int = 0;
        i++;
        if (i < p->n && (p->s[i] == '+' || p->s[i] == '-')) i++;
        if (i >= p->n || !fl_json_isdigit(p->s[i])) return fl_json_err(p, i, "invalid number: expected a digit in the exponent%s", "");
        while (i < p->n && fl_json_isdigit(p->s[i])) i++;
    }
    size_t len = i - start;
    char tmp[128];
    char *buf = len < sizeof tmp ? tmp : malloc(len + 1);
    if (!buf) return fl_errorf(FL_ERR_OOM, "%s: out of memory parsing JSON", p->src);
    memcpy(buf, p->s + start, len);
    buf[len] = '\0';
    j->num = strtod(buf, NULL);
    if (is_int) {
        /* exact int64 parse with overflow check */
        const char *q = buf;
        int neg = 0;
        if (*q == '-') { neg = 1; q++; }
        uint64_t v = 0;
        int ok = 1;
        for (; *q; q++) {
            unsigned d = (unsigned)(*q - '0');
            if (v > (UINT64_MAX - d) / 10) { ok = 0; break; }
            v = v * 10 + d;
        }
        if (ok && !neg && v > (uint64_t)INT64_MAX) ok = 0;
        if (ok && neg && v > (uint64_t)INT64_MAX + 1u) ok = 0;
        if (ok) {
            j->is_int = 1;
            j->i = neg ? (v == (uint64_t)INT64_MAX + 1u ? INT64_MIN : -(int64_t)v) : (int64_t)v;
        }
    }
    if (buf != tmp) free(buf);
    p->pos = i;
    return FL_OK;
}

/* ---- values ----------------------------------------------------------------- */

static fl_status fl_json_parse_value(fl_json_parser *p, fl_json **out);

static fl_status fl_json_parse_container(fl_json_parser *p, fl_json *j, int is_obj) {
    char close = is_obj ? '}' : ']';
    if (++p->depth > FL_JSON_MAX_DEPTH) return fl_json_err(p, p->pos, "nesting deeper than %s levels", "512");
    p->pos++; /* '{' or '[' */
    fl_json_skip_ws(p);
    fl_json *last = NULL;
    if (p->pos < p->n && p->s[p->pos] == close) {
        p->pos++;
        p->depth--;
        return FL_OK;
    }
    for (;;) {
        char *key = NULL;
        size_t klen = 0;
        fl_json_skip_ws(p);
        if (is_obj) {
            if (p->pos >= p->n || p->s[p->pos] != '"')
                return fl_json_err(p, p->pos, "expected a member name string%s", j->len ? " (trailing comma?)" : "");
            FL_TRY(fl_json_parse_string(p, &key, &klen));
            fl_json_skip_ws(p);
            if (p->pos >= p->n || p->s[p->pos] != ':') { free(key); return fl_json_err(p, p->pos, "expected ':' after member name%s", ""); }
            p->pos++;
            fl_json_skip_ws(p);
        } else if (p->pos < p->n && p->s[p->pos] == ']') {
            return fl_json_err(p, p->pos, "expected a value after ',' (trailing comma?)%s", "");
        }
        fl_json *v = NULL;
        fl_status s = fl_json_parse_value(p, &v);
        if (s != FL_OK) { free(key); return s; }
        v->key = key;
        if (last) last->next = v; else j->child = v;
        last = v;
        j->len++;
        fl_json_skip_ws(p);
        if (p->pos < p->n && p->s[p->pos] == ',') { p->pos++; continue; }
        if (p->pos < p->n && p->s[p->pos] == close) { p->pos++; break; }
        return fl_json_err(p, p->pos, is_obj ? "expected ',' or '}' in object%s" : "expected ',' or ']' in array%s", "");
    }
    p->depth--;
    return FL_OK;
}

static fl_status fl_json_parse_value(fl_json_parser *p, fl_json **out) {
    fl_json_skip_ws(p);
    if (p->pos >= p->n) return fl_json_err(p, p->pos, "expected a value%s", "");
    char c = p->s[p->pos];
    fl_json *j = NULL;
    fl_status s = FL_OK;
    static const struct { const char *lit; fl_json_type t; int b; } lits[] = {
        {"true", FL_JSON_BOOL, 1}, {"false", FL_JSON_BOOL, 0}, {"null", FL_JSON_NULL, 0}};
    if (c == '{' || c == '[') {
        j = fl_json_node(c == '{' ? FL_JSON_OBJECT : FL_JSON_ARRAY);
        if (!j) return fl_errorf(FL_ERR_OOM, "%s: out of memory parsing JSON", p->src);
        s = fl_json_parse_container(p, j, c == '{');
    } else if (c == '"') {
        j = fl_json_node(FL_JSON_STRING);
        if (!j) return fl_errorf(FL_ERR_OOM, "%s: out of memory parsing JSON", p->src);
        s = fl_json_parse_string(p, &j->str, &j->len);
    } else if (c == '-' || fl_json_isdigit(c)) {
        j = fl_json_node(FL_JSON_NUMBER);
        if (!j) return fl_errorf(FL_ERR_OOM, "%s: out of memory parsing JSON", p->src);
        s = fl_json_parse_number(p, j);
    } else {
        for (size_t k = 0; k < sizeof lits / sizeof lits[0]; k++) {
            size_t L = strlen(lits[k].lit);
            if (p->n - p->pos >= L && memcmp(p->s + p->pos, lits[k].lit, L) == 0) {
                j = fl_json_node(lits[k].t);
                if (!j) return fl_errorf(FL_ERR_OOM, "%s: out of memory parsing JSON", p->src);
                j->b = lits[k].b;
                p->pos += L;
                break;
            }
        }
        if (!j) return fl_json_err(p, p->pos, "expected a value (object, array, string, number, true, false or null)%s", "");
    }
    if (s != FL_OK) { fl_json_free(j); return s; }
    *out = j;
    return FL_OK;
}

fl_status fl_json_parse(const char *text, size_t n, const char *source, fl_json **out) {
    *out = NULL;
    fl_json_parser p = {text, n, 0, source ? source : "<json>", 0};
    if (!text && n) return fl_errorf(FL_ERR_INVALID, "%s: NULL JSON text", p.src);
    /* skip a UTF-8 BOM? RFC 8259 says parsers MAY ignore it; be lenient. */
    if (n >= 3 && (unsigned char)text[0] == 0xEF && (unsigned char)text[1] == 0xBB && (unsigned char)text[2] == 0xBF) p.pos = 3;
    fl_json *root = NULL;
    FL_TRY(fl_json_parse_value(&p, &root));
    fl_json_skip_ws(&p);
    if (p.pos != p.n) {
        fl_json_free(root);
        return fl_json_err(&p, p.pos, "expected end of input after the top-level value%s", "");
    }
    *out = root;
    return FL_OK;
}

fl_status fl_json_parse_file(const char *path, fl_json **out) {
    *out = NULL;
    char *buf;
    size_t len;
    FL_TRY(fl_fs_read_file(path, 0, &buf, &len));
    fl_status s = fl_json_parse(buf, len, path, out);
    free(buf);
    return s;
}

const fl_json *fl_json_get(const fl_json *j, const char *key) {
    if (!j || j->type != FL_JSON_OBJECT || !key) return NULL;
    const fl_json *found = NULL;
    for (const fl_json *c = j->child; c; c = c->next)
        if (c->key && strcmp(c->key, key) == 0) found = c; /* last one wins, like Python */
    return found;
}

const fl_json *fl_json_at(const fl_json *j, size_t i) {
    if (!j || (j->type != FL_JSON_ARRAY && j->type != FL_JSON_OBJECT)) return NULL;
    const fl_json *c = j->child;
    while (c && i--) c = c->next;
    return c;
}

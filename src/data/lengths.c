/* The length sampler (include/fitllm/lengths.h). The table is a distribution's quantiles; between two
 * points the inverse CDF is linear, so a draw is exact to the table at every listed quantile (up to the
 * rounding to whole tokens) and the draws' empirical quantiles converge to the table's (tests: DKW). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/lengths.h"

static int blank(const char *s) {
    for (; *s; s++)
        if (*s != ' ' && *s != '\t' && *s != '\r' && *s != '\n') return 0;
    return 1;
}

/* One "quantile length" line into row t->n; errors name path:line. */
static fl_status parse_row(fl_lengths *t, const char *path, int line, char *s) {
    s[strcspn(s, "\r\n")] = '\0'; /* the line's end is not part of what it says (a message quoting it was cut in two) */
    char *end;
    errno = 0;
    double q = strtod(s, &end);
    if (end == s || errno || !isfinite(q))
        return fl_errorf(FL_ERR_FORMAT, "%s:%d: expected 'quantile<TAB>length', got '%s'", path, line, s);
    char *s2 = end;
    long len = strtol(s2, &end, 10);
    if (end == s2 || errno)
        return fl_errorf(FL_ERR_FORMAT, "%s:%d: quantile %g has no length (expected 'quantile<TAB>length')", path, line,
                         q);
    if (!blank(end)) return fl_errorf(FL_ERR_FORMAT, "%s:%d: unexpected text after the length: '%s'", path, line, end);
    if (q < 0 || q > 1) return fl_errorf(FL_ERR_FORMAT, "%s:%d: quantile %g is not in [0, 1]", path, line, q);
    if (len < 2 || len > (1L << 24))
        return fl_errorf(FL_ERR_FORMAT, "%s:%d: length %ld is not in [2, 16777216] tokens", path, line, len);
    if (t->n > 0 && q <= t->q[t->n - 1])
        return fl_errorf(FL_ERR_FORMAT, "%s:%d: quantile %g does not increase (the previous row's is %g)", path, line, q,
                         t->q[t->n - 1]);
    if (t->n > 0 && len < t->len[t->n - 1])
        return fl_errorf(FL_ERR_FORMAT, "%s:%d: length %ld is less than the previous row's %d (quantiles of a "
                         "distribution never decrease)", path, line, len, t->len[t->n - 1]);
    if (t->n == FL_LENGTHS_MAX_ROWS)
        return fl_errorf(FL_ERR_FORMAT, "%s:%d: more than %d rows", path, line, FL_LENGTHS_MAX_ROWS);
    t->q[t->n] = q;
    t->len[t->n++] = (int)len;
    return FL_OK;
}

fl_status fl_lengths_load(const char *path, fl_lengths *out) {
    memset(out, 0, sizeof *out);
    snprintf(out->path, sizeof out->path, "%s", path);
    FILE *f = fopen(path, "r");
    if (!f)
        return fl_errorf(errno == ENOENT ? FL_ERR_NOT_FOUND : FL_ERR_IO, "%s: cannot open the length table: %s", path,
                         strerror(errno));
    char buf[512];
    int line = 0;
    fl_status s = FL_OK;
    while (s == FL_OK && fgets(buf, sizeof buf, f)) {
        line++;
        if (!strchr(buf, '\n') && !feof(f)) s = fl_errorf(FL_ERR_FORMAT, "%s:%d: line longer than 510 bytes", path, line);
        else if (buf[strspn(buf, " \t")] == '#' || blank(buf)) continue;
        else s = parse_row(out, path, line, buf);
    }
    if (s == FL_OK && ferror(f)) s = fl_errorf(FL_ERR_IO, "%s: read failed", path);
    fclose(f);
    if (s != FL_OK) return s;
    if (out->n < 2) return fl_errorf(FL_ERR_FORMAT, "%s: %d rows; a length table needs at least quantiles 0 and 1", path, out->n);
    if (out->q[0] != 0.0)
        return fl_errorf(FL_ERR_FORMAT, "%s: the first quantile is %g; the table must start at quantile 0 (the "
                         "shortest sample)", path, out->q[0]);
    if (out->q[out->n - 1] != 1.0)
        return fl_errorf(FL_ERR_FORMAT, "%s: the last quantile is %g; the table must end at quantile 1 (the longest "
                         "sample)", path, out->q[out->n - 1]);
    return FL_OK;
}

int fl_lengths_at(const fl_lengths *t, double u) {
    if (u <= 0) return t->len[0];
    if (u >= 1) return t->len[t->n - 1];
    int i = 1;
    while (i < t->n - 1 && t->q[i] < u) i++; /* q[i-1] < u <= q[i] */
    double f = (u - t->q[i - 1]) / (t->q[i] - t->q[i - 1]);
    double x = t->len[i - 1] + f * (t->len[i] - t->len[i - 1]);
    return (int)floor(x + 0.5);
}

/* splitmix64's finalizer over (seed, split, index): independent uniform draws without a shared stream, so
 * sample i's length does not depend on how many samples came before it. */
static uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

int fl_lengths_draw(const fl_lengths *t, uint64_t seed, int split, uint64_t index) {
    uint64_t h = mix(seed * 0x9e3779b97f4a7c15ULL + 0x6c656e67ULL);
    h = mix(h ^ ((uint64_t)(split + 1) * 0xd1b54a32d192ed03ULL));
    h = mix(h + index * 0x9e3779b97f4a7c15ULL);
    double u = (double)(h >> 11) * 0x1.0p-53; /* [0, 1) */
    return fl_lengths_at(t, u);
}

int fl_lengths_longest(const fl_lengths *t, uint64_t seed, size_t n_train, size_t n_val, int cap) {
    int best = 0;
    for (int sp = 0; sp < 2; sp++)
        for (size_t i = 0; i < (sp ? n_val : n_train); i++) {
            int l = fl_lengths_draw(t, seed, sp, i);
            if (cap > 0 && l > cap) l = cap;
            if (l > best) best = l;
        }
    return best;
}

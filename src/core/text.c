/* fitllm core: text helpers (see text.h). */
#include "core/text.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void fl_text_first_diff(const char *a, const char *b, char *la, char *lb, size_t n) {
    while (*a && *b) {
        const char *ea = strchr(a, '\n'), *eb = strchr(b, '\n');
        size_t na = ea ? (size_t)(ea - a) : strlen(a), nb = eb ? (size_t)(eb - b) : strlen(b);
        if (na != nb || memcmp(a, b, na)) break;
        a += na + (ea != NULL);
        b += nb + (eb != NULL);
    }
    snprintf(la, n, "%.*s", (int)strcspn(*a ? a : "(nothing)", "\n"), *a ? a : "(nothing)");
    snprintf(lb, n, "%.*s", (int)strcspn(*b ? b : "(nothing)", "\n"), *b ? b : "(nothing)");
}

void fl_text_float(float v, char *buf, size_t n) {
    for (int prec = 1; prec <= 9; prec++) {
        snprintf(buf, n, "%.*g", prec, (double)v);
        if ((float)strtod(buf, NULL) == v) return; /* as fl_data_float_to_double reads it back (data/split.c) */
    }
}

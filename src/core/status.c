#include <ctype.h>
/* Thread-local error message storage; see include/fitllm/status.h. */
#include "fitllm/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define FL_ERRMSG_MAX 2048

static _Thread_local char g_msg[FL_ERRMSG_MAX];

fl_status fl_errorf(fl_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_msg, sizeof g_msg, fmt, ap);
    va_end(ap);
    return s;
}

fl_status fl_error_prefix(fl_status s, const char *fmt, ...) {
    if (s == FL_OK) return s; /* no error: the message (maybe an earlier, reported one) stays as it is */
    char pre[FL_ERRMSG_MAX], old[FL_ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pre, sizeof pre, fmt, ap);
    va_end(ap);
    memcpy(old, g_msg, sizeof old);
    snprintf(g_msg, sizeof g_msg, "%s: %s", pre, old);
    return s;
}

void fl_errlist_add(fl_errlist *l, fl_status s, const char *fmt, ...) {
    if (!l->n++) l->first = s;
    if (l->len + 1 >= sizeof l->text) return;
    if (l->n > 1) l->len += (size_t)snprintf(l->text + l->len, sizeof l->text - l->len, "; ");
    if (l->len + 1 >= sizeof l->text) { l->len = sizeof l->text - 1; return; }
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(l->text + l->len, sizeof l->text - l->len, fmt, ap);
    va_end(ap);
    l->len = w < 0 ? l->len : l->len + (size_t)w < sizeof l->text ? l->len + (size_t)w : sizeof l->text - 1;
}

fl_status fl_errlist_fail(const fl_errlist *l) { return l->n ? fl_errorf(l->first, "%s", l->text) : FL_OK; }

const char *fl_error_message(void) { return g_msg; }
void fl_error_clear(void) { g_msg[0] = '\0'; }

const char *fl_status_name(fl_status s) {
    static const char *names[FL_STATUS_COUNT] = {
        "OK", "INVALID", "IO", "FORMAT", "OOM", "UNSUPPORTED", "NOT_FOUND", "INTERNAL", "NONFINITE"};
    return (s >= 0 && s < FL_STATUS_COUNT) ? names[s] : "UNKNOWN";
}

size_t fl_edit_distance(const char *a, const char *b) {
    size_t n = strlen(a), m = strlen(b), prev[128], cur[128];
    if (m >= 127) m = 127;
    for (size_t j = 0; j <= m; j++) prev[j] = j;
    for (size_t i = 1; i <= n; i++) {
        cur[0] = i;
        for (size_t j = 1; j <= m; j++) {
            size_t sub = prev[j - 1] + (tolower((unsigned char)a[i - 1]) != tolower((unsigned char)b[j - 1]));
            size_t del = prev[j] + 1, ins = cur[j - 1] + 1;
            cur[j] = sub < del ? (sub < ins ? sub : ins) : (del < ins ? del : ins);
        }
        memcpy(prev, cur, (m + 1) * sizeof *prev);
    }
    return prev[m];
}

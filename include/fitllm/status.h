/* fitllm: status codes and error messages.
 *
 * Library code never exits and never prints: every fallible function returns an
 * fl_status and, on failure, records a human-readable message (naming the file,
 * key or tensor at fault) with fl_errorf(). The message lives in thread-local
 * storage, like errno/dlerror, so deep I/O code does not have to thread a
 * context through every call. Only the CLI prints it and picks the exit code.
 */
#ifndef FITLLM_STATUS_H
#define FITLLM_STATUS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    FL_OK = 0,
    FL_ERR_INVALID,     /* bad argument or bad user input (config, options) */
    FL_ERR_IO,          /* open/read/write/mmap failed */
    FL_ERR_FORMAT,      /* malformed or inconsistent file contents */
    FL_ERR_OOM,         /* allocation failed or the memory budget is exhausted */
    FL_ERR_UNSUPPORTED, /* valid request this build or backend cannot do (yet) */
    FL_ERR_NOT_FOUND,   /* missing file, tensor or key */
    FL_ERR_INTERNAL,    /* a bug: an invariant did not hold */
    FL_ERR_NONFINITE,   /* training diverged: a loss or gradient is inf/NaN */
    FL_STATUS_COUNT
} fl_status;

/* Record a formatted message for status s and return s (so callers can write
 * `return fl_errorf(FL_ERR_FORMAT, "%s: ...", path);`). */
fl_status fl_errorf(fl_status s, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Prepend context to the current message: "ctx: <old message>" when s is an error (FL_OK: the
 * message is left alone, so a success path never rewrites an earlier error). Returns s. */
fl_status fl_error_prefix(fl_status s, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Several refusals in one message (a config with two bad fields names both at once, not one a run):
 * fl_errlist_add records a clause (the list's status is its first clause's); fl_errlist_fail records the message
 * "<clause>; <clause>; ..." and returns that status (FL_OK, the message left alone, when nothing was added). Start
 * from a zeroed list; a text past the buffer is cut, the count kept. */
typedef struct {
    char text[2048];
    size_t len;
    int n;
    fl_status first;
} fl_errlist;
void fl_errlist_add(fl_errlist *l, fl_status s, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
fl_status fl_errlist_fail(const fl_errlist *l);

/* The last message recorded on this thread ("" if none). */
const char *fl_error_message(void);
void fl_error_clear(void);

/* Short name of a status ("OOM", "FORMAT", ...). */
const char *fl_status_name(fl_status s);
/* Case-insensitive Levenshtein distance (the first 127 characters of b), for the nearest valid
 * names an error message suggests (options, presets, model_config fields). */
size_t fl_edit_distance(const char *a, const char *b);

#define FL_TRY(expr)                                                           \
    do {                                                                       \
        fl_status fl_try_s_ = (expr);                                          \
        if (fl_try_s_ != FL_OK) return fl_try_s_;                              \
    } while (0)

#ifdef __cplusplus
}
#endif
#endif

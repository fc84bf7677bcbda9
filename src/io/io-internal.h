/* fitllm io: small filesystem helpers shared by the model-file readers and
 * writers (not public API). */
#ifndef FITLLM_IO_INTERNAL_H
#define FITLLM_IO_INTERNAL_H

#include <stddef.h>

#include "fitllm/dtype.h"
#include "fitllm/status.h"

/* Join dir and name with '/' into buf; FL_ERR_INVALID naming both if too long. */
fl_status fl_io_join(char *buf, size_t n, const char *dir, const char *name);
/* 1 if path exists and is a directory / regular file. */
int fl_io_is_dir(const char *path);
int fl_io_is_file(const char *path);
/* Write len bytes to path atomically: path.tmp, fsync, rename; the temp file
 * is removed on failure. */
fl_status fl_io_write_file_atomic(const char *path, const void *data, size_t len);
/* Remove a directory with its files and subfolders (a few levels deep; symlinks are
 * removed, not followed), then itself; best effort. */
void fl_io_remove_dir(const char *path);
/* fsync a directory so a rename inside it is durable; best effort. */
void fl_io_sync_dir(const char *path);

/* write() all n bytes (retrying EINTR, honouring the injected fault); 0 or -1 (errno). */
int fl_io_write_all(int fd, const void *data, size_t n);
/* mkdir -p. */
fl_status fl_io_mkdir_p(const char *path);
/* 1 when the write fault injected by fl_io_fail_writes_after fires (errno = ENOSPC). */
int fl_io_write_fault(void);

/* Index of the first inf/NaN among n floating-point values of dtype t (F32, F64,
 * BF16, F16; any alignment), or -1 when all are finite or t is not a float. */
long long fl_io_first_nonfinite(const void *x, fl_dtype t, size_t n);

#endif

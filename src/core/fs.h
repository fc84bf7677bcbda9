/* fitllm core: small filesystem helpers shared by io/, data/, train/, lab/ (library-internal,
 * not public API). fl_fs_*. */
#ifndef FITLLM_CORE_FS_H
#define FITLLM_CORE_FS_H

#include <stddef.h>

#include "fitllm/dtype.h"
#include "fitllm/status.h"

/* Join dir and name with '/' into buf; FL_ERR_INVALID naming both if too long. */
fl_status fl_fs_join(char *buf, size_t n, const char *dir, const char *name);
/* 1 if path exists and is a directory / regular file. */
int fl_fs_is_dir(const char *path);
int fl_fs_is_file(const char *path);
/* Write len bytes to path atomically: path.tmp, fsync, rename; the temp file is removed on failure. A symlink's
 * target is what gets replaced (the link kept). A path that exists and is neither a regular file nor a folder (a
 * device such as /dev/null or /dev/stdout, a FIFO, a terminal) is written in place: replacing a device node or a
 * pipe by a file would be wrong, and as root it is possible. A folder: FL_ERR_IO naming it. */
fl_status fl_fs_write_file_atomic(const char *path, const void *data, size_t len);
/* Remove a directory with its files and subfolders (a few levels deep; symlinks are
 * removed, not followed), then itself; best effort. */
void fl_fs_remove_dir(const char *path);
/* Temporary paths a write renames into place when it completes (a file's path.tmp, a folder's X.tmp-PID or a
 * checkpoint's .tmp-step-N): tracked while they may exist, so that a command stopped by a signal removes them before
 * it dies (fl_fs_tmp_remove_all, from the CLI's signal thread: the writer may still run, so best effort) instead of
 * leaving a half-written file or folder. Thread-safe; FL_FS_TMP_SLOTS paths at once (more are not tracked). */
#define FL_FS_TMP_SLOTS 16
void fl_fs_tmp_track(const char *path);
void fl_fs_tmp_untrack(const char *path);
/* Removes every tracked path (a folder with its content, or a file); the number that existed. */
int fl_fs_tmp_remove_all(void);
/* fsync a directory so a rename inside it is durable; best effort. */
void fl_fs_sync_dir(const char *path);

/* 1 when s can only be a path (it starts with '/', "./", "../" or "~"), never a preset name or a Hugging Face repo id:
 * a model argument that does not exist is then "no such file or folder", not an unknown preset with suggestions. */
int fl_fs_is_path_form(const char *s);
/* The folder for temporary files: $TMPDIR when it is set to an absolute path (of a usable length), else "/tmp". */
const char *fl_fs_tmpdir(void);

/* write() all n bytes (retrying EINTR, honouring the injected fault); 0 or -1 (errno). */
int fl_fs_write_all(int fd, const void *data, size_t n);
/* mkdir -p. */
fl_status fl_fs_mkdir_p(const char *path);
/* The whole file at path in a new malloc'd buffer (*out, *len bytes; the caller frees it). max_bytes
 * > 0 refuses a longer file (FL_ERR_FORMAT, naming it); a missing file is FL_ERR_NOT_FOUND. */
fl_status fl_fs_read_file(const char *path, size_t max_bytes, char **out, size_t *len);
/* Fault injection (tests, through fl_io_fail_writes_after): the (n+1)-th write from now fails
 * with ENOSPC; -1 disables. fl_fs_write_fault: 1 when it fires (errno = ENOSPC). */
void fl_fs_fail_writes_after(long n);
long fl_fs_writes_left(void);
int fl_fs_write_fault(void);


#endif

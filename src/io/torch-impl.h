/* PyTorch checkpoints (torch.save zip files) read in place: the pieces shared by
 * torch_zip.c (the archive, binding tensors to storages) and torch_pickle.c (the
 * restricted unpickler). Private: the public API is fitllm/torch_ckpt.h.
 *
 * NOTE: this header was reconstructed from its users by a duplicate helper that
 * overwrote the original by mistake (see TORCH-HELPER-NOTE.txt); check it. */
#ifndef FL_IO_TORCH_IMPL_H
#define FL_IO_TORCH_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/dtype.h"
#include "fitllm/status.h"

/* One stored zip entry: its name (not NUL-terminated, points into the mapping) and bytes. */
typedef struct {
    const char *name;
    size_t name_len;
    const uint8_t *data; /* the entry's bytes in the mapping */
    uint64_t size;
} fl_zip_entry;

/* The central directory of the zip in m[0..size) (path for messages): *out (malloc'd, free())
 * holds *n_out entries, every one stored, unencrypted and inside the file. */
fl_status fl_zip_list(const uint8_t *m, size_t size, const char *path, fl_zip_entry **out, int *n_out);

/* One tensor of the state dict: its storage data/<storage_key> and its place in it. */
typedef struct {
    char *name;            /* state-dict key (owned) */
    char *storage_key;     /* storage entry key (owned) */
    fl_dtype dtype;        /* the storage's element type */
    int64_t storage_numel; /* elements the storage declares */
    int64_t offset;        /* storage_offset (elements) */
    int64_t numel;         /* elements of the tensor */
    int ndim;
    int64_t shape[8];
} fl_torch_rec;

/* Unpickle data.pkl (p[0..n)) of `path` without executing anything: the records of the
 * state dict's tensors (*recs malloc'd, free with fl_torch_recs_free). */
fl_status fl_torch_unpickle(const uint8_t *p, size_t n, const char *path, fl_torch_rec **recs, int *n_recs);
void fl_torch_recs_free(fl_torch_rec *r, int n);

#endif

/* PyTorch checkpoints (torch.save zip files), library-internal: the zip reader
 * (torch_zip.c) and the restricted unpickler (torch_pickle.c). The public entry
 * points are in include/fitllm/torch_ckpt.h. */
#ifndef FITLLM_IO_TORCH_IMPL_H
#define FITLLM_IO_TORCH_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/dtype.h"
#include "fitllm/status.h"

/* One tensor of the state dict, as _rebuild_tensor_v2 describes it. */
typedef struct {
    char *name;            /* state-dict key (owned) */
    char *storage_key;     /* the zip entry <archive>/data/<storage_key> holds the storage (owned) */
    fl_dtype dtype;        /* from the storage class (torch.FloatStorage -> F32, ...) */
    int64_t storage_numel; /* elements of the whole storage, as the persistent id says */
    int64_t offset;        /* first element of the tensor in its storage */
    int64_t numel;
    int ndim;
    int64_t shape[8];
} fl_torch_rec;

/* Run the restricted unpickler over data.pkl (p, n bytes; `path` names the file in
 * errors). Only the opcodes and globals torch.save writes for a state dict are
 * accepted; anything else is refused by name before it is acted on. On success
 * *recs holds *n_recs tensors (contiguous, inside their storages' element counts;
 * a Lightning-style {"model": state_dict, ...} is unwrapped to the state dict).
 * Free with fl_torch_recs_free. */
fl_status fl_torch_unpickle(const uint8_t *p, size_t n, const char *path, fl_torch_rec **recs, int *n_recs);
void fl_torch_recs_free(fl_torch_rec *r, int n);

/* One stored entry of a zip file, pointing into the caller's mapping. */
typedef struct {
    const char *name; /* not NUL-terminated */
    size_t name_len;
    const uint8_t *data;
    uint64_t size;
} fl_zip_entry;

/* List the entries of a zip held in memory (map, size). Every entry must be stored
 * (method 0), unencrypted, with its data inside the file; zip64 end records and
 * extra fields are read (torch writes them). *out is malloc'd (free it). */
fl_status fl_zip_list(const uint8_t *map, size_t size, const char *path, fl_zip_entry **out, int *n);

#endif

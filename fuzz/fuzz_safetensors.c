/* libFuzzer harness: arbitrary bytes as a .safetensors file (8-byte header
 * length, JSON header, data section), opened with fl_st_open (mmap + strict
 * validation). When it is accepted, every tensor's byte range is read in full
 * (ASan sees any range outside the mapping's file bytes as a SEGV or an
 * overflow), looked up by name, and the metadata strings are read. Any crash,
 * leak or sanitizer report is a bug. Build: fuzz/build.sh */
#include "fuzz_util.h"

#include "fitllm/dtype.h"
#include "fitllm/io.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static char path[512];
    if (!path[0]) snprintf(path, sizeof path, "%s/fuzz.safetensors", fz_tmpdir());
    fz_write(path, data, size);
    fl_st_file f;
    if (fz_dbg(fl_st_open(&f, path)) != FL_OK) return 0;
    volatile unsigned sum = 0;
    size_t covered = 0;
    for (int i = 0; i < f.n_tensors; i++) {
        const fl_st_tensor *t = &f.tensors[i];
        if (t->end < t->begin || t->end > f.data_size) abort(); /* validated ranges */
        const uint8_t *p = t->data;
        for (size_t k = 0; k < t->end - t->begin; k++) sum += p[k];
        covered += t->end - t->begin;
        if (fl_st_find(&f, t->name) == NULL) abort();
        size_t numel = 1;
        for (int d = 0; d < t->ndim; d++) numel *= (size_t)t->shape[d];
        if (numel * fl_dtype_size(t->dtype) != t->end - t->begin) abort();
    }
    if (covered != f.data_size) abort(); /* the ranges cover the data section exactly */
    for (int i = 0; i < f.n_meta; i++) sum += (unsigned)strlen(f.meta_keys[i]) + (unsigned)strlen(f.meta_vals[i]);
    fl_st_close(&f);
    (void)sum;
    return 0;
}

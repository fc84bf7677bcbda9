/* libFuzzer harness: arbitrary bytes as a torch.save file (pytorch_model.bin,
 * lit_model.pth), opened with fl_torch_open_mem (zip central directory, stored
 * entries, the restricted unpickler, tensors bound to their storages). The input
 * buffer is exactly `size` bytes, so ASan reports any read past it. When it is
 * accepted, every tensor's bytes are read in full and must lie inside the input
 * with a byte count matching shape x dtype; then LitGPT's renaming (a fused qkv
 * split, an interleaved one regrouped into an owned buffer) runs on it and the
 * result is read again. Any crash, leak or sanitizer report is a bug; no input may
 * make it run anything (it has nothing to run: the unpickler imports nothing).
 * Build: fuzz/build.sh */
#include "fuzz_util.h"

#include "fitllm/dtype.h"
#include "fitllm/torch_ckpt.h"

static unsigned fz_read_tensors(const fl_st_file *f, const uint8_t *data, size_t size, int in_input) {
    unsigned sum = 0;
    for (int i = 0; i < f->n_tensors; i++) {
        const fl_st_tensor *t = &f->tensors[i];
        const uint8_t *p = t->data;
        size_t n = t->end - t->begin, numel = 1;
        for (int d = 0; d < t->ndim; d++) numel *= (size_t)t->shape[d];
        FZ_CHECK(t->end >= t->begin && numel * fl_dtype_size(t->dtype) == n);
        if (in_input) FZ_CHECK(n == 0 || (p >= data && p + n <= data + size));
        for (size_t k = 0; k < n; k++) sum += p[k];
        FZ_CHECK(fl_st_find(f, t->name) != NULL);
    }
    return sum;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fl_st_file f;
    if (fz_dbg(fl_torch_open_mem(&f, data, size, "fuzz.bin")) != FL_OK) return 0;
    volatile unsigned sum = fz_read_tensors(&f, data, size, 1);
    /* 4 heads, 2 kv groups, head_dim 2: qkv of 16 rows */
    if (fz_dbg(fl_torch_lit_to_hf(&f, 4, 2, 2)) == FL_OK) sum += fz_read_tensors(&f, data, size, 0);
    fl_st_close(&f);
    (void)sum;
    return 0;
}

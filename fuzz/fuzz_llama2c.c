/* libFuzzer harness: arbitrary bytes as a llama2.c v0 checkpoint (.bin: a
 * 28-byte header of seven int32 sizes, then fp32 weights), loaded with
 * fl_llama2c_load_model (fp32, CPU backend). The loader must refuse a header
 * whose sizes the file does not hold before it allocates anything of that
 * size. Seeds: fuzz/seeds-llama2c/ (tiny checkpoints written by
 * fuzz/make_seeds.py); ../shared/data/stories260K/stories260K.bin is longer
 * than -max_len and only lends its header. Build: fuzz/build.sh */
#include "fuzz_util.h"

#include "fitllm/backend.h"
#include "fitllm/io.h"
#include "fitllm/mem.h"
#include "fitllm/model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static char path[512];
    static fl_backend be;
    if (!path[0]) {
        snprintf(path, sizeof path, "%s/model.bin", fz_tmpdir());
        if (fl_cpu_backend_init(&be, 1) != FL_OK) abort();
    }
    fz_write(path, data, size);
    fl_mem_pool pool;
    if (fl_mem_pool_init(&pool, "fuzz", 0) != FL_OK) abort();
    fl_model m;
    memset(&m, 0, sizeof m);
    if (fz_dbg(fl_llama2c_load_model(&m, path, &be, &pool)) == FL_OK) {
        /* the loader's layout holds the header's sizes */
        if (m.cfg.arch != FL_ARCH_LLAMA || m.layout.n <= 0) abort();
        fl_model_free(&m);
    }
    fl_mem_pool_free(&pool);
    return 0;
}

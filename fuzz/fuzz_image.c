/* libFuzzer harness: arbitrary bytes as an image file (fl_img_decode: libjpeg-turbo / libpng
 * behind our error hooks), then, when it decodes, the BLIP preprocessing to a small size (PIL
 * bicubic resize, rescale, normalize). Any crash, leak, sanitizer report or exit() from a library
 * is a bug: bad input must come back as an fl_status. Two binaries from this file, one per
 * format, each started from its own seeds (fuzz/seeds-image-png, fuzz/seeds-image-jpeg: the small
 * test images of tests/fixtures/images); the decoder dispatches on the signature either way.
 * Build: fuzz/build.sh. */
/* binaries built from this file (fuzz/harnesses.cmake reads these lines: name, then defines): */
// fuzz-build: fuzz_image_png
// fuzz-build: fuzz_image_jpeg FL_FUZZ_JPEG
#include <stdint.h>
#include <stdlib.h>

#include "fitllm/image.h"

#ifdef FL_FUZZ_JPEG
#define SOURCE "fuzz.jpg"
#else
#define SOURCE "fuzz.png"
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fl_img im;
    if (fl_img_decode(data, size, SOURCE, &im) != FL_OK) return 0;
    if (im.rgb == NULL || im.width <= 0 || im.height <= 0) abort();
    fl_img_proc p;
    fl_img_proc_default(&p);
    p.height = 1 + (int)(size % 13);
    p.width = 1 + (int)(size % 17);
    p.resample = (size & 1) ? FL_IMG_BICUBIC : FL_IMG_BILINEAR;
    float *pv = NULL;
    int h, w;
    if (fl_img_preprocess_alloc(&p, &im, &pv, &h, &w) == FL_OK && (h != p.height || w != p.width)) abort();
    free(pv);
    fl_img_free(&im);
    return 0;
}

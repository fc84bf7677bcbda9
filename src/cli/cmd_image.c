/* fitllm image-info: decode an image as the library does (PIL + transformers' convert_to_rgb) and,
 * with a model folder's image processor, print the pixel_values' shape and checksums so a user can
 * compare their preprocessing with Hugging Face's (--dump writes the raw float32 values). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "core/fs.h"
#include "fitllm/image.h"

static void help(void) {
    printf("usage: fitllm image-info FILE [--processor DIR|preprocessor_config.json] [--dump OUT.f32]\n\n"
           "  FILE               a JPEG or PNG image (decoded with libjpeg-turbo / libpng to 8-bit RGB as\n"
           "                     PIL + transformers' convert_to_rgb: alpha over white, no EXIF rotation)\n"
           "  --processor P      a model folder (its preprocessor_config.json) or that file: also run the\n"
           "                     BLIP image processor (resize with PIL's bicubic, rescale, normalize) and\n"
           "                     print pixel_values' shape, sum, min, max and an FNV-1a hash of its bytes\n"
           "  --dump OUT.f32     write pixel_values (float32 little-endian, C x H x W) to OUT.f32\n\n"
           "Compare with Hugging Face (transformers' PIL backend):\n"
           "  python -c \"import numpy as np; from PIL import Image; from transformers import BlipImageProcessorPil as P;\n"
           "  a = P.from_pretrained('DIR')(Image.open('FILE'), return_tensors='np')['pixel_values'][0];\n"
           "  b = np.fromfile('OUT.f32', '<f4').reshape(a.shape); print(abs(a - b).max())\"\n");
}

int fl_cmd_image_info(int argc, char **argv) {
    const char *cmd = "image-info", *file = NULL, *proc = NULL, *dump = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            help();
            return 0;
        } else if (!strcmp(a, "--processor") && i + 1 < argc) {
            proc = argv[++i];
        } else if (!strcmp(a, "--dump") && i + 1 < argc) {
            dump = argv[++i];
        } else if (a[0] == '-' && a[1]) {
            return fl_cli_unknown_option(cmd, a, (const char *const[]){"--dump", "--help", "--processor", NULL});
        } else if (!file) {
            file = a;
        } else {
            return fl_cli_usage(cmd, "unexpected argument '%s'", a);
        }
    }
    if (!file) return fl_cli_usage(cmd, "missing FILE");
    if (dump && !proc) return fl_cli_usage(cmd, "--dump needs --processor");
    fl_img im;
    fl_status s = fl_img_load(file, &im);
    if (s != FL_OK) return fl_cli_fail(cmd, s, NULL);
    printf("%s: %d x %d RGB\n", file, im.width, im.height);
    if (!proc) {
        fl_img_free(&im);
        return 0;
    }
    fl_img_proc p;
    float *pv = NULL;
    int h = 0, w = 0;
    s = fl_img_proc_load(proc, &p);
    if (s == FL_OK) s = fl_img_preprocess_alloc(&p, &im, &pv, &h, &w);
    fl_img_free(&im);
    if (s != FL_OK) return fl_cli_fail(cmd, s, NULL);
    size_t n = (size_t)3 * h * w;
    double sum = 0;
    float mn = pv[0], mx = pv[0];
    uint64_t hash = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) {
        sum += pv[i];
        mn = pv[i] < mn ? pv[i] : mn;
        mx = pv[i] > mx ? pv[i] : mx;
        uint32_t b;
        memcpy(&b, &pv[i], 4);
        for (int k = 0; k < 4; k++) hash = (hash ^ ((b >> (8 * k)) & 0xff)) * 0x100000001b3ULL;
    }
    printf("pixel_values: 3 x %d x %d float32 (resize %s, rescale %s, normalize %s), sum %.6f, min %.6f, max %.6f, "
           "fnv1a64 %016llx\n", h, w, p.do_resize ? (p.resample == FL_IMG_BICUBIC ? "bicubic" : "bilinear") : "off",
           p.do_rescale ? "on" : "off", p.do_normalize ? "on" : "off", sum, mn, mx, (unsigned long long)hash);
    int rc = 0;
    if (dump) {
        /* x86/ARM hosts are little-endian; a file: through dump.tmp, renamed; a device or a pipe: written in place */
        fl_status ws = fl_fs_write_file_atomic(dump, pv, n * sizeof(float));
        if (ws != FL_OK) {
            rc = fl_cli_fail(cmd, fl_error_prefix(ws, "cannot write pixel_values"), NULL);
        } else {
            printf("wrote %s (%zu float32)\n", dump, n);
        }
    }
    free(pv);
    return rc;
}

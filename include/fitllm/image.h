/* fitllm: images for vision-language models (issue 32): JPEG/PNG decoding, the BLIP image
 * processor's preprocessing (transformers' BlipImageProcessor, PIL backend) and caption datasets.
 *
 * Decoding: libjpeg-turbo and libpng (Debian's libjpeg62-turbo-dev, libpng-dev), with their
 * error hooks turned into fl_status (never exit, never print). The result is always 8-bit RGB,
 * converted as transformers' convert_to_rgb does with PIL: grayscale replicated, palettes
 * expanded, and an image with alpha (RGBA, LA, or a tRNS transparency chunk) composited onto an
 * opaque white background with PIL's integer alpha_composite (transformers 5 does this, not
 * PIL's plain convert("RGB") that drops alpha). 16-bit PNG colour/alpha channels keep their high
 * byte (PIL's RGB;16B raw modes); 16-bit grayscale PNG (PIL mode I;16) and CMYK/YCCK JPEG are
 * refused with a clear error. EXIF orientation is NOT applied (neither does BLIP's processor).
 * Images over FL_IMG_MAX_PIXELS pixels are refused before their pixels are decoded.
 */
#ifndef FITLLM_IMAGE_H
#define FITLLM_IMAGE_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* PIL's Image.MAX_IMAGE_PIXELS (its decompression-bomb warning threshold, 1024*1024*1024/4/3). */
#define FL_IMG_MAX_PIXELS 89478485LL

typedef struct {
    int width, height;
    uint8_t *rgb; /* height x width x 3, row-major (HWC), owned */
} fl_img;

/* Decode JPEG or PNG bytes (told apart by their signature); `source` names the input in errors. */
fl_status fl_img_decode(const void *data, size_t n, const char *source, fl_img *out);
/* Read and decode a file. */
fl_status fl_img_load(const char *path, fl_img *out);
void fl_img_free(fl_img *im);

/* PIL's Image.resize with BICUBIC (3) or BILINEAR (2) on 8-bit RGB: separable convolution, the
 * filter support widened by the scale factor when downscaling, 22-bit fixed-point coefficients,
 * horizontal pass then vertical pass, each rounded to 8 bits (Pillow's Resample.c algorithm). */
#define FL_IMG_BILINEAR 2
#define FL_IMG_BICUBIC 3
fl_status fl_img_resize(const fl_img *in, int width, int height, int resample, fl_img *out);

/* The image processor settings of a folder's preprocessor_config.json (BLIP's defaults when a
 * key is absent: 384x384, bicubic, rescale 1/255, normalize with OpenAI CLIP's mean/std). */
typedef struct {
    int do_resize, do_rescale, do_normalize, do_convert_rgb;
    int height, width; /* size {height, width} */
    int resample;
    double rescale_factor;
    double image_mean[3], image_std[3];
} fl_img_proc;

void fl_img_proc_default(fl_img_proc *p);
/* path: a preprocessor_config.json, or a folder holding one. */
fl_status fl_img_proc_load(const char *path, fl_img_proc *p);
/* pixel_values of one image: float32 CHW, 3 x p->height x p->width (or the image's own size when
 * do_resize is off: out_h and out_w say which; either may be NULL). `out` holds 3*h*w floats. */
fl_status fl_img_preprocess(const fl_img_proc *p, const fl_img *im, float *out, int *out_h, int *out_w);
/* The same into a newly allocated buffer (free()). */
fl_status fl_img_preprocess_alloc(const fl_img_proc *p, const fl_img *im, float **out, int *out_h, int *out_w);

/* ---- caption datasets ------------------------------------------------------------------------
 * fl_img_captions_load(path):
 *   - a .json file (an array of {"image": PATH, "text": CAPTION} objects) or a .jsonl file (one
 *     such object per line); PATH relative to the file's folder (absolute paths kept);
 *   - a folder holding captions.jsonl ({"file_name" or "image": NAME, "text": CAPTION} per line,
 *     the Hugging Face imagefolder metadata layout) or captions.tsv (NAME<TAB>CAPTION per line),
 *     names relative to the folder; without either, every .jpg/.jpeg/.png with its caption in a
 *     text file of the same stem beside it (a.jpg + a.txt; name order; a missing or empty .txt is
 *     an error naming it).
 *   "caption" is accepted for "text"; an empty caption, or a key of the wrong type, is refused
 *   naming the file, the line (record) and the key.
 * Every named image must exist (checked at load: the error names the captions file, the record
 * and the image). Hugging Face save_to_disk folders: tools/hf_to_captions.py converts. */
typedef struct {
    size_t n;
    char **image; /* resolved paths */
    char **text;
} fl_img_captions;

fl_status fl_img_captions_load(const char *path, fl_img_captions *out);
/* Seeded Fisher-Yates shuffle (the same order for the same seed on every machine). */
void fl_img_captions_shuffle(fl_img_captions *c, uint64_t seed);
/* Keep the first n records (num_train_samples; n >= c->n keeps all). */
void fl_img_captions_limit(fl_img_captions *c, size_t n);
void fl_img_captions_free(fl_img_captions *c);

#ifdef __cplusplus
}
#endif
#endif

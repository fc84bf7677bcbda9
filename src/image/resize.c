/* PIL's resampling (Image.resize, BICUBIC/BILINEAR, 8 bits per channel) and the BLIP image
 * processor: resize, rescale, normalize to float32 CHW pixel_values.
 *
 * The resize follows the algorithm of Pillow's Resample.c (written here from its description, not
 * copied): for each output position a window of input samples centred at (i + 0.5) * scale, the
 * filter's support multiplied by the scale when downscaling (an antialiasing low-pass), weights
 * normalized to sum 1 in double, then turned into 22-bit fixed-point integers rounded half away
 * from zero; each output sample is (2^21 + sum w*x) >> 22 clamped to [0, 255]. One pass per axis
 * whose size changes, the first's 8-bit result feeding the second (order: fl_img_resize). This file is compiled without
 * floating-point contraction (CMakeLists.txt): an FMA would change the double weights and so,
 * rarely, a fixed-point coefficient. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/image.h"
#include "fitllm/json.h"

#define PREC_BITS 22

static double filt_bicubic(double x) {
    const double a = -0.5; /* PIL's (and Keys') cubic convolution parameter */
    if (x < 0.0) x = -x;
    if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
    if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
    return 0.0;
}
static double filt_bilinear(double x) {
    if (x < 0.0) x = -x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

/* Fixed-point weights of a 1-D resize in_size -> out_size: per output i, first input index
 * bounds[2i], count bounds[2i+1], weights k[i*ksize ...]. Returns ksize, 0 on OOM. */
static int coeffs(int in_size, int out_size, int resample, int **bounds_out, int32_t **k_out) {
    double (*f)(double) = resample == FL_IMG_BICUBIC ? filt_bicubic : filt_bilinear;
    double support0 = resample == FL_IMG_BICUBIC ? 2.0 : 1.0;
    double scale = (double)in_size / out_size, fscale = scale < 1.0 ? 1.0 : scale;
    double support = support0 * fscale;
    int ksize = (int)ceil(support) * 2 + 1;
    double *w = malloc(sizeof(double) * ksize);
    int *bounds = malloc(sizeof(int) * 2 * out_size);
    int32_t *k = calloc((size_t)out_size * ksize, sizeof(int32_t));
    if (!w || !bounds || !k) {
        free(w), free(bounds), free(k);
        return 0;
    }
    for (int i = 0; i < out_size; i++) {
        double center = (i + 0.5) * scale, ss = 1.0 / fscale, sum = 0.0;
        int lo = (int)(center - support + 0.5), hi = (int)(center + support + 0.5);
        if (lo < 0) lo = 0;
        if (hi > in_size) hi = in_size;
        int cnt = hi - lo;
        for (int x = 0; x < cnt; x++) {
            w[x] = f(((double)(x + lo) - center + 0.5) * ss);
            sum += w[x];
        }
        for (int x = 0; x < cnt; x++) {
            double v = sum != 0.0 ? w[x] / sum : w[x];
            v *= (double)(1 << PREC_BITS);
            k[(size_t)i * ksize + x] = (int32_t)(v < 0 ? v - 0.5 : v + 0.5);
        }
        bounds[2 * i] = lo;
        bounds[2 * i + 1] = cnt;
    }
    free(w);
    *bounds_out = bounds;
    *k_out = k;
    return ksize;
}

static inline uint8_t clip8(int64_t v) {
    v >>= PREC_BITS;
    return (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
}

/* One pass along x (horiz) or y of an RGB image w x h into ow x oh (one of them unchanged). */
static void pass(const uint8_t *in, int w, int h, uint8_t *out, int ow, int oh, int horiz, const int *bounds,
                 const int32_t *k, int ksize) {
    for (int y = 0; y < oh; y++)
        for (int x = 0; x < ow; x++) {
            int i = horiz ? x : y, lo = bounds[2 * i], cnt = bounds[2 * i + 1];
            const int32_t *kk = k + (size_t)i * ksize;
            for (int c = 0; c < 3; c++) {
                int64_t acc = 1 << (PREC_BITS - 1);
                for (int t = 0; t < cnt; t++) {
                    size_t src = horiz ? ((size_t)y * w + lo + t) : ((size_t)(lo + t) * w + x);
                    acc += (int64_t)in[src * 3 + c] * kk[t];
                }
                out[((size_t)y * ow + x) * 3 + c] = clip8(acc);
            }
        }
}

fl_status fl_img_resize(const fl_img *in, int width, int height, int resample, fl_img *out) {
    memset(out, 0, sizeof *out);
    if (resample != FL_IMG_BICUBIC && resample != FL_IMG_BILINEAR)
        return fl_errorf(FL_ERR_UNSUPPORTED, "image resize: resample %d is not supported (2 bilinear, 3 bicubic)",
                         resample);
    if (width <= 0 || height <= 0 || (long long)width * height > FL_IMG_MAX_PIXELS)
        return fl_errorf(FL_ERR_INVALID, "image resize: bad target size %dx%d", width, height);
    /* Pillow 13 runs the downscaling pass first when one axis grows and the other shrinks
     * (measured against it: width up + height down = vertical first; every other case horizontal
     * first), so the 8-bit intermediate is the smaller image. */
    int vfirst = width > in->width && height < in->height;
    const uint8_t *cur = in->rgb;
    uint8_t *tmp = NULL, *res = NULL;
    int cw = in->width, chh = in->height;
    for (int step = 0; step < 2; step++) {
        int horiz = vfirst ? step == 1 : step == 0;
        int ow = horiz ? width : cw, oh = horiz ? chh : height;
        if (ow == cw && oh == chh) continue; /* PIL resizes only the axes whose size changes */
        int *b = NULL;
        int32_t *k = NULL;
        int ks = coeffs(horiz ? cw : chh, horiz ? ow : oh, resample, &b, &k);
        uint8_t *dst = ks ? malloc((size_t)ow * oh * 3) : NULL;
        if (!dst) {
            if (ks) free(b), free(k);
            free(tmp);
            return fl_errorf(FL_ERR_OOM, "image resize: out of memory");
        }
        pass(cur, cw, chh, dst, ow, oh, horiz, b, k, ks);
        free(b), free(k);
        free(tmp);
        cur = tmp = dst;
        cw = ow, chh = oh;
    }
    res = tmp;
    if (!res) { /* same size: a copy */
        res = malloc((size_t)width * height * 3);
        if (!res) return fl_errorf(FL_ERR_OOM, "image resize: out of memory");
        memcpy(res, in->rgb, (size_t)width * height * 3);
    }
    out->width = width;
    out->height = height;
    out->rgb = res;
    return FL_OK;
}

/* ---- the BLIP image processor ---------------------------------------------------------------- */

void fl_img_proc_default(fl_img_proc *p) {
    /* transformers' BlipImageProcessor defaults (OPENAI_CLIP_MEAN / OPENAI_CLIP_STD) */
    static const double mean[3] = {0.48145466, 0.4578275, 0.40821073}, std[3] = {0.26862954, 0.26130258, 0.27577711};
    memset(p, 0, sizeof *p);
    p->do_resize = p->do_rescale = p->do_normalize = p->do_convert_rgb = 1;
    p->height = p->width = 384;
    p->resample = FL_IMG_BICUBIC;
    p->rescale_factor = 1.0 / 255.0;
    memcpy(p->image_mean, mean, sizeof mean);
    memcpy(p->image_std, std, sizeof std);
}

static fl_status get_bool(const fl_json *j, const char *key, int *v, const char *src) {
    const fl_json *e = fl_json_get(j, key);
    if (!e || e->type == FL_JSON_NULL) return FL_OK;
    if (e->type != FL_JSON_BOOL) return fl_errorf(FL_ERR_FORMAT, "%s: \"%s\" must be true or false", src, key);
    *v = e->b;
    return FL_OK;
}

static fl_status get_triple(const fl_json *j, const char *key, double *v, int positive, const char *src) {
    const fl_json *e = fl_json_get(j, key);
    if (!e || e->type == FL_JSON_NULL) return FL_OK;
    if (e->type == FL_JSON_NUMBER) {
        v[0] = v[1] = v[2] = e->num;
    } else if (e->type == FL_JSON_ARRAY && e->len == 3) {
        int i = 0;
        for (const fl_json *c = e->child; c; c = c->next, i++) {
            if (c->type != FL_JSON_NUMBER) break;
            v[i] = c->num;
        }
        if (i != 3) return fl_errorf(FL_ERR_FORMAT, "%s: \"%s\" must be 3 numbers", src, key);
    } else {
        return fl_errorf(FL_ERR_FORMAT, "%s: \"%s\" must be a number or a list of 3 numbers", src, key);
    }
    for (int i = 0; positive && i < 3; i++)
        if (!(v[i] > 0)) return fl_errorf(FL_ERR_FORMAT, "%s: \"%s\" must be positive", src, key);
    return FL_OK;
}

static fl_status proc_from_json(const fl_json *j, const char *src, fl_img_proc *p) {
    if (j->type != FL_JSON_OBJECT) return fl_errorf(FL_ERR_FORMAT, "%s: not a JSON object", src);
    FL_TRY(get_bool(j, "do_resize", &p->do_resize, src));
    FL_TRY(get_bool(j, "do_rescale", &p->do_rescale, src));
    FL_TRY(get_bool(j, "do_normalize", &p->do_normalize, src));
    FL_TRY(get_bool(j, "do_convert_rgb", &p->do_convert_rgb, src));
    if (fl_json_get(j, "do_center_crop") && fl_json_get(j, "do_center_crop")->type == FL_JSON_BOOL &&
        fl_json_get(j, "do_center_crop")->b)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: do_center_crop is not supported (BLIP's processor has none)", src);
    if (fl_json_get(j, "do_pad") && fl_json_get(j, "do_pad")->type == FL_JSON_BOOL && fl_json_get(j, "do_pad")->b)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: do_pad is not supported", src);
    const fl_json *sz = fl_json_get(j, "size");
    if (sz && sz->type == FL_JSON_OBJECT) {
        const fl_json *h = fl_json_get(sz, "height"), *w = fl_json_get(sz, "width");
        if (!h || !w || !h->is_int || !w->is_int || h->i <= 0 || w->i <= 0 || h->i > 65535 || w->i > 65535)
            return fl_errorf(FL_ERR_UNSUPPORTED, "%s: \"size\" must be {\"height\": H, \"width\": W} with positive "
                             "integers (shortest_edge / max sizes are not supported)", src);
        p->height = (int)h->i;
        p->width = (int)w->i;
    } else if (sz && sz->type == FL_JSON_NUMBER && sz->is_int && sz->i > 0 && sz->i <= 65535) {
        p->height = p->width = (int)sz->i; /* old configs: an int means a square */
    } else if (sz && sz->type != FL_JSON_NULL) {
        return fl_errorf(FL_ERR_FORMAT, "%s: \"size\" must be {\"height\": H, \"width\": W}", src);
    }
    const fl_json *rs = fl_json_get(j, "resample");
    if (rs && rs->type != FL_JSON_NULL) {
        if (!rs->is_int || (rs->i != FL_IMG_BICUBIC && rs->i != FL_IMG_BILINEAR))
            return fl_errorf(FL_ERR_UNSUPPORTED, "%s: \"resample\" must be 3 (bicubic) or 2 (bilinear)", src);
        p->resample = (int)rs->i;
    }
    const fl_json *rf = fl_json_get(j, "rescale_factor");
    if (rf && rf->type != FL_JSON_NULL) {
        if (rf->type != FL_JSON_NUMBER) return fl_errorf(FL_ERR_FORMAT, "%s: \"rescale_factor\" must be a number", src);
        p->rescale_factor = rf->num;
    }
    FL_TRY(get_triple(j, "image_mean", p->image_mean, 0, src));
    return get_triple(j, "image_std", p->image_std, 1, src);
}

fl_status fl_img_proc_load(const char *path, fl_img_proc *p) {
    fl_img_proc_default(p);
    char buf[4096];
    size_t n = strlen(path);
    if (n < 5 || strcmp(path + n - 5, ".json") != 0) {
        snprintf(buf, sizeof buf, "%s/preprocessor_config.json", path);
        path = buf;
    }
    fl_json *j = NULL;
    FL_TRY(fl_json_parse_file(path, &j));
    fl_status s = proc_from_json(j, path, p);
    fl_json_free(j);
    return s;
}

fl_status fl_img_preprocess(const fl_img_proc *p, const fl_img *im, float *out, int *out_h, int *out_w) {
    fl_img rs = {0};
    const fl_img *src = im;
    if (p->do_resize && (p->width != im->width || p->height != im->height)) {
        FL_TRY(fl_img_resize(im, p->width, p->height, p->resample, &rs));
        src = &rs;
    }
    size_t hw = (size_t)src->width * src->height;
    /* numpy's order: rescale in float64 then float32; normalize in float32 ((x - mean) / std with
     * mean and std as float32 arrays) */
    for (int c = 0; c < 3; c++) {
        float m = (float)p->image_mean[c], sd = (float)p->image_std[c];
        for (size_t i = 0; i < hw; i++) {
            float v = src->rgb[i * 3 + c];
            if (p->do_rescale) v = (float)((double)src->rgb[i * 3 + c] * p->rescale_factor);
            if (p->do_normalize) v = (v - m) / sd;
            out[c * hw + i] = v;
        }
    }
    if (out_h) *out_h = src->height;
    if (out_w) *out_w = src->width;
    fl_img_free(&rs);
    return FL_OK;
}

fl_status fl_img_preprocess_alloc(const fl_img_proc *p, const fl_img *im, float **out, int *out_h, int *out_w) {
    int h = p->do_resize ? p->height : im->height, w = p->do_resize ? p->width : im->width;
    *out = malloc(sizeof(float) * 3 * (size_t)h * w);
    if (!*out) return fl_errorf(FL_ERR_OOM, "image preprocess: out of memory (%dx%d)", h, w);
    fl_status s = fl_img_preprocess(p, im, *out, out_h, out_w);
    if (s != FL_OK) {
        free(*out);
        *out = NULL;
    }
    return s;
}

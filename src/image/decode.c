/* JPEG (libjpeg-turbo) and PNG (libpng) decoding to 8-bit RGB, as transformers' convert_to_rgb
 * sees images that PIL opened: include/fitllm/image.h states the conversions. Both libraries
 * report fatal errors through a callback that must not return: ours longjmp back to the decode
 * function, which frees what it allocated and returns an fl_status naming the source. */
#include <errno.h>
#include <setjmp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
/* after stdio.h: jpeglib.h uses FILE and size_t without including them */
#include <jpeglib.h>
#include <jerror.h>
#include <png.h>

#include "fitllm/image.h"
#include "image/image-impl.h"

void fl_img_free(fl_img *im) {
    if (!im) return;
    free(im->rgb);
    im->rgb = NULL;
    im->width = im->height = 0;
}

static fl_status check_size(const char *src, long long w, long long h) {
    if (w <= 0 || h <= 0) return fl_errorf(FL_ERR_FORMAT, "%s: image has no pixels (%lldx%lld)", src, w, h);
    if (w * h > FL_IMG_MAX_PIXELS)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: image is %lldx%lld = %lld pixels, over the limit of %lld pixels "
                         "(PIL's MAX_IMAGE_PIXELS)", src, w, h, w * h, (long long)FL_IMG_MAX_PIXELS);
    return FL_OK;
}

/* PIL's alpha_composite of (r,g,b,a) over opaque white, in its 7-bit-precision integer form:
 * the output alpha is 255, so the blend weight of the source is a/255 in units of 1/128. */
static uint8_t over_white(unsigned c, unsigned a) {
    if (a == 0) return 255;
    unsigned outa255 = a * 255 + 255 * (255 - a);
    unsigned coef1 = a * 255 * 255 * 128 / outa255;
    unsigned coef2 = 255 * 128 - coef1;
    unsigned t = c * coef1 + 255 * coef2 + (0x80 << 7);
    return (uint8_t)((((t >> 8) + t) >> 8) >> 7);
}

/* ---- JPEG ---------------------------------------------------------------------------------- */

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jb;
    int truncated;
    char msg[JMSG_LENGTH_MAX];
} jerr_t;

static void j_error_exit(j_common_ptr c) {
    jerr_t *e = (jerr_t *)c->err;
    c->err->format_message(c, e->msg);
    longjmp(e->jb, 1);
}

/* Warnings are not printed; a premature end of data is an error (PIL: "image file is
 * truncated"), other recoverable corruption is tolerated as PIL does. */
static void j_emit(j_common_ptr c, int level) {
    jerr_t *e = (jerr_t *)c->err;
    if (level < 0) {
        c->err->num_warnings++;
        if (c->err->msg_code == JWRN_JPEG_EOF) e->truncated = 1;
    }
}

static fl_status decode_jpeg(const uint8_t *data, size_t n, const char *src, fl_img *out) {
    struct jpeg_decompress_struct ci;
    jerr_t je;
    memset(&je, 0, sizeof je);
    ci.err = jpeg_std_error(&je.pub);
    je.pub.error_exit = j_error_exit;
    je.pub.emit_message = j_emit;
    uint8_t *volatile pix = NULL;
    if (setjmp(je.jb)) {
        jpeg_destroy_decompress(&ci);
        free(pix);
        return fl_errorf(FL_ERR_FORMAT, "%s: corrupt JPEG: %s", src, je.msg);
    }
    jpeg_create_decompress(&ci);
    jpeg_mem_src(&ci, data, (unsigned long)n);
    jpeg_read_header(&ci, TRUE);
    fl_status s = check_size(src, ci.image_width, ci.image_height);
    if (s == FL_OK && (ci.jpeg_color_space == JCS_CMYK || ci.jpeg_color_space == JCS_YCCK))
        s = fl_errorf(FL_ERR_UNSUPPORTED, "%s: CMYK JPEG is not supported (convert it to RGB first, e.g. with "
                      "PIL's convert(\"RGB\"))", src);
    if (s != FL_OK) {
        jpeg_destroy_decompress(&ci);
        return s;
    }
    /* PIL's decoder leaves libjpeg's defaults (JDCT_ISLOW, fancy upsampling) unless draft mode
     * is asked for, and reads YCbCr/grayscale as RGB/L: the same bytes. */
    ci.out_color_space = JCS_RGB;
    ci.dct_method = JDCT_ISLOW;
    ci.do_fancy_upsampling = TRUE;
    jpeg_start_decompress(&ci);
    size_t w = ci.output_width, h = ci.output_height;
    if (ci.output_components != 3) longjmp(je.jb, 1);
    pix = malloc(w * h * 3);
    if (!pix) {
        jpeg_destroy_decompress(&ci);
        return fl_errorf(FL_ERR_OOM, "%s: no memory for a %zux%zu image", src, w, h);
    }
    while (ci.output_scanline < ci.output_height && !je.truncated) {
        JSAMPROW row = pix + (size_t)ci.output_scanline * w * 3;
        jpeg_read_scanlines(&ci, &row, 1);
    }
    if (je.truncated) {
        jpeg_destroy_decompress(&ci);
        free(pix);
        return fl_errorf(FL_ERR_FORMAT, "%s: truncated JPEG (the data ends before the image does)", src);
    }
    jpeg_destroy_decompress(&ci); /* not jpeg_finish_decompress: trailing garbage is no error */
    out->width = (int)w;
    out->height = (int)h;
    out->rgb = pix;
    return FL_OK;
}

/* ---- PNG ----------------------------------------------------------------------------------- */

typedef struct {
    const uint8_t *data;
    size_t n, pos;
    char msg[256];
} pngsrc_t;

static void p_error(png_structp p, png_const_charp m) {
    pngsrc_t *ps = png_get_error_ptr(p);
    snprintf(ps->msg, sizeof ps->msg, "%s", m);
    png_longjmp(p, 1);
}
static void p_warning(png_structp p, png_const_charp m) { (void)p, (void)m; }

static void p_read(png_structp p, png_bytep dst, size_t len) {
    pngsrc_t *ps = png_get_io_ptr(p);
    if (len > ps->n - ps->pos) png_error(p, "truncated PNG (the data ends before the image does)");
    memcpy(dst, ps->data + ps->pos, len);
    ps->pos += len;
}

static fl_status decode_png(const uint8_t *data, size_t n, const char *src, fl_img *out) {
    pngsrc_t ps = {data, n, 0, {0}};
    png_structp p = png_create_read_struct(PNG_LIBPNG_VER_STRING, &ps, p_error, p_warning);
    if (!p) return fl_errorf(FL_ERR_OOM, "%s: libpng could not start", src);
    png_infop info = png_create_info_struct(p);
    uint8_t *volatile pix = NULL;
    png_bytep *volatile rows = NULL;
    if (!info || setjmp(png_jmpbuf(p))) {
        png_destroy_read_struct(&p, info ? &info : NULL, NULL);
        free(pix);
        free(rows);
        return fl_errorf(FL_ERR_FORMAT, "%s: corrupt PNG: %s", src, ps.msg[0] ? ps.msg : "out of memory");
    }
    png_set_read_fn(p, &ps, p_read);
    /* our own limit, checked below with the file name; libpng's (1M x 1M) only guards overflow */
    png_set_user_limits(p, 0x7fffffff, 0x7fffffff);
    png_read_info(p, info);
    png_uint_32 w = png_get_image_width(p, info), h = png_get_image_height(p, info);
    int depth = png_get_bit_depth(p, info), ct = png_get_color_type(p, info);
    fl_status s = check_size(src, w, h);
    if (s == FL_OK && depth == 16 && ct == PNG_COLOR_TYPE_GRAY)
        s = fl_errorf(FL_ERR_UNSUPPORTED, "%s: 16-bit grayscale PNG is not supported (PIL opens it as mode I;16, "
                      "whose RGB conversion clips; convert it to 8 bits first)", src);
    if (s != FL_OK) {
        png_destroy_read_struct(&p, &info, NULL);
        return s;
    }
    int alpha = (ct & PNG_COLOR_MASK_ALPHA) || png_get_valid(p, info, PNG_INFO_tRNS);
    if (depth == 16) png_set_strip_16(p); /* the high byte, as PIL's ;16B raw modes */
    if (ct == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(p);
    if (ct == PNG_COLOR_TYPE_GRAY && depth < 8) png_set_expand_gray_1_2_4_to_8(p);
    if (png_get_valid(p, info, PNG_INFO_tRNS)) png_set_tRNS_to_alpha(p);
    if (!(ct & PNG_COLOR_MASK_COLOR)) png_set_gray_to_rgb(p);
    png_set_interlace_handling(p);
    png_read_update_info(p, info);
    size_t ch = png_get_channels(p, info), rb = png_get_rowbytes(p, info);
    if (ch != (alpha ? 4u : 3u) || rb != (size_t)w * ch) png_error(p, "unexpected layout after conversion");
    pix = malloc((size_t)h * rb);
    rows = malloc(sizeof(png_bytep) * h);
    if (!pix || !rows) png_error(p, "out of memory");
    for (size_t y = 0; y < h; y++) rows[y] = pix + y * rb;
    png_read_image(p, rows);
    png_destroy_read_struct(&p, &info, NULL);
    free(rows);
    if (alpha) { /* RGBA -> RGB over white, in place (the output never overtakes the input) */
        size_t np = (size_t)w * h;
        for (size_t i = 0; i < np; i++) {
            uint8_t a = pix[4 * i + 3];
            for (int c = 0; c < 3; c++) pix[3 * i + c] = over_white(pix[4 * i + c], a);
        }
    }
    out->width = (int)w;
    out->height = (int)h;
    out->rgb = pix;
    return FL_OK;
}

fl_status fl_img_decode(const void *data, size_t n, const char *source, fl_img *out) {
    const uint8_t *b = data;
    static const uint8_t png_sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    memset(out, 0, sizeof *out);
    if (!source) source = "<image>";
    if (n >= 3 && b[0] == 0xff && b[1] == 0xd8 && b[2] == 0xff) return decode_jpeg(b, n, source, out);
    if (n >= 8 && !memcmp(b, png_sig, 8)) return decode_png(b, n, source, out);
    return fl_errorf(FL_ERR_FORMAT, "%s: not a JPEG or PNG image (%zu bytes; unknown signature)", source, n);
}

fl_status fl_img_read_file(const char *path, const char *what, uint8_t **data, size_t *size) {
    *data = NULL;
    *size = 0;
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) return fl_errorf(FL_ERR_INVALID, "%s: is a folder; the %s must be a file", path, what);
    FILE *f = fopen(path, "rb");
    if (!f) return fl_errorf(errno == ENOENT ? FL_ERR_NOT_FOUND : FL_ERR_IO, "%s: cannot open %s: %s", path, what,
                             strerror(errno));
    uint8_t *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n == cap) {
            cap = cap ? cap * 2 : 65536;
            uint8_t *nb = realloc(buf, cap + 1);
            if (!nb) {
                free(buf);
                fclose(f);
                return fl_errorf(FL_ERR_OOM, "%s: no memory to read the %s", path, what);
            }
            buf = nb;
        }
        size_t r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (r == 0) break;
    }
    const int err = ferror(f) ? errno : 0;
    fclose(f);
    if (err) {
        free(buf);
        return fl_errorf(FL_ERR_IO, "%s: read error: %s", path, strerror(err));
    }
    buf[n] = 0; /* room kept: text readers get a terminated string */
    *data = buf;
    *size = n;
    return FL_OK;
}

fl_status fl_img_load(const char *path, fl_img *out) {
    memset(out, 0, sizeof *out);
    uint8_t *buf;
    size_t n;
    FL_TRY(fl_img_read_file(path, "image", &buf, &n));
    fl_status s = fl_img_decode(buf, n, path, out);
    free(buf);
    return s;
}

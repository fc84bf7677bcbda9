/* Images (issue 32 item 2): the decoders against PIL's decoding + transformers' convert_to_rgb,
 * PIL's bicubic resize bit for bit, and BlipImageProcessorPil's pixel_values, from the fixtures
 * of tests/ref/image_ref.py (tests/fixtures/images); bad inputs; caption datasets. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fitllm/image.h"
#include "test.h"

#define IMG_DIR "tests/fixtures/images"

static const char *const k_good[] = {
    "rgb420_97x61.jpg", "prog_50x33.jpg",    "gray_23x17.jpg", "rgb444_41x29.jpg", "rgb422_128x96.jpg",
    "rgb_13x7.png",     "gray_80x75.png",    "palette_45x31.png", "rgba_37x53.png", "la_19x21.png",
    "palette_trns_24x16.png", "rgb16_20x12.png", "interlaced_33x9.png", "one_1x1.png",
};
#define N_GOOD (sizeof k_good / sizeof k_good[0])

static void *fixture(const char *img, const char *ext, size_t *n) {
    char p[512];
    snprintf(p, sizeof p, IMG_DIR "/%s", img);
    char *dot = strrchr(p, '.');
    snprintf(dot, sizeof p - (dot - p), "%s", ext);
    return fl_test_slurp(p, n);
}

/* Decoding = PIL's decoding (libjpeg-turbo on both sides: ISLOW DCT, fancy upsampling; libpng
 * vs PIL's PNG reader) followed by transformers' convert_to_rgb (alpha over white): every byte. */
FL_TEST(image_decode_matches_pil) {
    for (size_t i = 0; i < N_GOOD; i++) {
        char p[512];
        snprintf(p, sizeof p, IMG_DIR "/%s", k_good[i]);
        fl_img im;
        FL_REQUIRE_OK(fl_img_load(p, &im));
        size_t n = 0;
        uint8_t *ref = fixture(k_good[i], ".rgb", &n);
        FL_REQUIRE(ref);
        FL_CHECKF(n == (size_t)im.width * im.height * 3, "%s: %dx%d vs %zu bytes", k_good[i], im.width, im.height, n);
        size_t bad = 0, first = 0;
        for (size_t k = 0; k < n && n == (size_t)im.width * im.height * 3; k++)
            if (im.rgb[k] != ref[k] && bad++ == 0) first = k;
        FL_CHECKF(bad == 0, "%s: %zu of %zu bytes differ from PIL (first at %zu: %d vs %d)", k_good[i], bad, n, first,
                  im.rgb[first], ref[first]);
        free(ref);
        fl_img_free(&im);
    }
}

/* The resize from the PIL-decoded bytes (so this checks the resize alone), bit for bit; then the
 * whole chain (our decoding, resize, rescale, normalize) against HF's pixel_values: bit for bit
 * too, and in any case within one 8-bit level (1/255/std), the anchor the issue allows. */
FL_TEST(image_blip_preprocess_matches_hf) {
    fl_img_proc pp;
    FL_REQUIRE_OK(fl_img_proc_load(IMG_DIR, &pp));
    FL_CHECK(pp.height == 30 && pp.width == 40 && pp.resample == FL_IMG_BICUBIC);
    for (size_t i = 0; i < N_GOOD; i++) {
        char p[512];
        snprintf(p, sizeof p, IMG_DIR "/%s", k_good[i]);
        size_t n = 0, nr = 0, np = 0;
        uint8_t *rgb = fixture(k_good[i], ".rgb", &n), *rs = fixture(k_good[i], ".rs", &nr);
        float *pv = fixture(k_good[i], ".pv", &np);
        FL_REQUIRE(rgb && rs && pv && nr == 30 * 40 * 3 && np == 4 * 3 * 30 * 40);
        fl_img im;
        FL_REQUIRE_OK(fl_img_load(p, &im));
        FL_REQUIRE(n == (size_t)im.width * im.height * 3);
        fl_img src = {im.width, im.height, rgb}, out;
        FL_REQUIRE_OK(fl_img_resize(&src, 40, 30, FL_IMG_BICUBIC, &out));
        FL_CHECKF(memcmp(out.rgb, rs, nr) == 0, "%s: resize differs from PIL's BICUBIC", k_good[i]);
        fl_img_free(&out);
        float *mine = NULL;
        int h = 0, w = 0;
        FL_REQUIRE_OK(fl_img_preprocess_alloc(&pp, &im, &mine, &h, &w));
        FL_CHECK(h == 30 && w == 40);
        size_t exact = 0;
        double worst = 0;
        for (size_t k = 0; k < 3 * 30 * 40; k++) {
            exact += mine[k] == pv[k];
            double lvl = 1.0 / 255.0 / pp.image_std[k / (30 * 40)];
            double d = fabs((double)mine[k] - pv[k]) / lvl;
            if (d > worst) worst = d;
        }
        FL_CHECKF(worst <= 1.0 + 1e-6, "%s: pixel_values off by %.3f 8-bit levels", k_good[i], worst);
        FL_CHECKF(exact == 3 * 30 * 40, "%s: %zu of 3600 pixel_values bit-equal to HF", k_good[i], exact);
        free(mine);
        fl_img_free(&im);
        free(rgb), free(rs), free(pv);
    }
}

/* Properties independent of PIL: the same size is a copy; the weights sum to 1, so a constant
 * image stays constant at every size (up, down, mixed, 1x1); bad arguments are refused. */
FL_TEST(image_resize_identity_and_constant) {
    uint8_t px[7 * 5 * 3];
    for (size_t i = 0; i < sizeof px; i++) px[i] = (uint8_t)(i * 37 % 251);
    fl_img in = {7, 5, px}, out;
    FL_REQUIRE_OK(fl_img_resize(&in, 7, 5, FL_IMG_BICUBIC, &out));
    FL_CHECK(memcmp(out.rgb, px, sizeof px) == 0);
    fl_img_free(&out);
    memset(px, 200, sizeof px);
    const int sizes[][2] = {{1, 1}, {3, 2}, {20, 11}, {6, 9}};
    for (int s = 0; s < 4; s++) {
        FL_REQUIRE_OK(fl_img_resize(&in, sizes[s][0], sizes[s][1], FL_IMG_BICUBIC, &out));
        int ok = 1;
        for (int k = 0; k < sizes[s][0] * sizes[s][1] * 3; k++) ok &= out.rgb[k] == 200;
        FL_CHECKF(ok, "a constant image resized to %dx%d is not constant", sizes[s][0], sizes[s][1]);
        fl_img_free(&out);
    }
    FL_CHECK(fl_img_resize(&in, 0, 3, FL_IMG_BICUBIC, &out) == FL_ERR_INVALID);
    FL_CHECK(fl_img_resize(&in, 3, 3, 1, &out) == FL_ERR_UNSUPPORTED);
}

static int msg_has(const char *s) { return strstr(fl_error_message(), s) != NULL; }

FL_TEST(image_bad_inputs) {
    fl_img im;
    FL_CHECK(fl_img_load(IMG_DIR "/no_such.png", &im) == FL_ERR_NOT_FOUND && msg_has("no_such.png"));
    FL_CHECK(fl_img_load(IMG_DIR "/bad_cmyk_8x8.jpg", &im) == FL_ERR_UNSUPPORTED && msg_has("CMYK") &&
             msg_has("bad_cmyk_8x8.jpg"));
    FL_CHECK(fl_img_load(IMG_DIR "/bad_gray16_8x8.png", &im) == FL_ERR_UNSUPPORTED && msg_has("16-bit") &&
             msg_has("bad_gray16_8x8.png"));
    FL_CHECK(fl_img_decode("hello", 5, "x.txt", &im) == FL_ERR_FORMAT && msg_has("x.txt") && msg_has("not a JPEG"));
    FL_CHECK(fl_img_decode("", 0, "empty.png", &im) == FL_ERR_FORMAT);
    /* every truncation and a corrupted byte of each good file: an error or a defined image, never a crash */
    const char *files[] = {"rgb420_97x61.jpg", "prog_50x33.jpg", "palette_45x31.png", "interlaced_33x9.png"};
    for (int f = 0; f < 4; f++) {
        char p[512];
        snprintf(p, sizeof p, IMG_DIR "/%s", files[f]);
        size_t n = 0;
        uint8_t *b = (uint8_t *)fl_test_slurp(p, &n);
        FL_REQUIRE(b && n > 100);
        int errs = 0;
        for (size_t cut = 1; cut < n; cut += 1 + cut / 16) {
            fl_status s = fl_img_decode(b, cut, p, &im);
            if (s == FL_OK) fl_img_free(&im);
            else errs += msg_has(files[f]);
        }
        FL_CHECKF(errs > 0, "%s: no truncation was reported", files[f]);
        /* truncated well inside the pixel data: always an error, never a grey/partial image */
        FL_CHECKF(fl_img_decode(b, n * 3 / 4, p, &im) == FL_ERR_FORMAT && msg_has("truncated"), "%s: %s", files[f],
                  fl_error_message());
        for (size_t k = 0; k < n; k += 7) {
            uint8_t keep = b[k];
            b[k] ^= 0x5a;
            if (fl_img_decode(b, n, p, &im) == FL_OK) fl_img_free(&im);
            b[k] = keep;
        }
        free(b);
    }
}

/* A 20000x20000 header is refused by the pixel limit before any pixel is decoded. */
FL_TEST(image_pixel_limit) {
    size_t n = 0;
    uint8_t *b = (uint8_t *)fl_test_slurp(IMG_DIR "/rgb_13x7.png", &n);
    FL_REQUIRE(b && n > 33);
    /* IHDR width/height at bytes 16..23; the chunk CRC then mismatches, so fix it: libpng checks it */
    uint8_t *c = b + 16;
    c[0] = 0, c[1] = 0, c[2] = 0x4e, c[3] = 0x20, c[4] = 0, c[5] = 0, c[6] = 0x4e, c[7] = 0x20;
    uint32_t crc = 0xffffffffu;
    for (int i = 12; i < 29; i++) {
        crc ^= b[i];
        for (int k = 0; k < 8; k++) crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1)));
    }
    crc ^= 0xffffffffu;
    b[29] = crc >> 24, b[30] = crc >> 16, b[31] = crc >> 8, b[32] = crc;
    fl_img im;
    FL_CHECK(fl_img_decode(b, n, "big.png", &im) == FL_ERR_UNSUPPORTED && msg_has("big.png") &&
             msg_has("20000x20000") && msg_has("limit"));
    free(b);
    /* JPEG: SOF0 height/width */
    b = (uint8_t *)fl_test_slurp(IMG_DIR "/rgb444_41x29.jpg", &n);
    FL_REQUIRE(b);
    for (size_t i = 2; i + 9 < n; i++)
        if (b[i] == 0xff && b[i + 1] == 0xc0) {
            b[i + 5] = 0x4e, b[i + 6] = 0x20, b[i + 7] = 0x4e, b[i + 8] = 0x20;
            break;
        }
    FL_CHECK(fl_img_decode(b, n, "big.jpg", &im) == FL_ERR_UNSUPPORTED && msg_has("big.jpg") && msg_has("limit"));
    free(b);
}

FL_TEST(image_proc_config) {
    char dir[] = "/tmp/fl_imgproc_XXXXXX";
    FL_REQUIRE(mkdtemp(dir));
    char p[256];
    snprintf(p, sizeof p, "%s/preprocessor_config.json", dir);
    fl_img_proc pp;
    FL_CHECK(fl_img_proc_load(dir, &pp) != FL_OK && msg_has("preprocessor_config.json"));
    FILE *f = fopen(p, "w");
    fputs("{\"size\": {\"shortest_edge\": 224}}", f);
    fclose(f);
    FL_CHECK(fl_img_proc_load(dir, &pp) == FL_ERR_UNSUPPORTED && msg_has("size"));
    f = fopen(p, "w");
    fputs("{\"image_std\": [0.5, 0, 0.5]}", f);
    fclose(f);
    FL_CHECK(fl_img_proc_load(p, &pp) == FL_ERR_FORMAT && msg_has("image_std"));
    f = fopen(p, "w");
    fputs("{\"size\": {\"height\": 5, \"width\": 7}, \"do_normalize\": false, \"image_mean\": 0.5}", f);
    fclose(f);
    FL_REQUIRE_OK(fl_img_proc_load(p, &pp));
    FL_CHECK(pp.height == 5 && pp.width == 7 && !pp.do_normalize && pp.do_rescale && pp.image_mean[2] == 0.5);
    unlink(p);
    rmdir(dir);
}

static void put(const char *dir, const char *name, const char *text) {
    char p[1100];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "w");
    if (f) fputs(text, f), fclose(f);
}

FL_TEST(image_captions_formats_and_errors) {
    char dir[] = "/tmp/fl_imgcap_XXXXXX";
    FL_REQUIRE(mkdtemp(dir));
    char p[1100], sub[512];
    snprintf(sub, sizeof sub, "%s/imgs", dir);
    FL_REQUIRE(mkdir(sub, 0755) == 0);
    put(sub, "a.png", "x");
    put(sub, "b.jpg", "x");
    put(sub, "c.jpg", "x");
    /* JSON array, paths relative to the file */
    put(dir, "d.json", "[{\"image\": \"imgs/a.png\", \"text\": \"a cat\"}, {\"image\": \"imgs/b.jpg\", \"text\": \"b\"}]");
    fl_img_captions c;
    snprintf(p, sizeof p, "%s/d.json", dir);
    FL_REQUIRE_OK(fl_img_captions_load(p, &c));
    FL_CHECK(c.n == 2 && strcmp(c.text[0], "a cat") == 0 && strstr(c.image[1], "/imgs/b.jpg"));
    fl_img_captions_free(&c);
    /* JSONL; blank lines skipped; errors name the file and the line */
    put(dir, "d.jsonl", "{\"image\": \"imgs/a.png\", \"text\": \"one\"}\n\n{\"image\": \"imgs/c.jpg\", \"text\": \"two\"}\n");
    snprintf(p, sizeof p, "%s/d.jsonl", dir);
    FL_REQUIRE_OK(fl_img_captions_load(p, &c));
    FL_CHECK(c.n == 2 && strcmp(c.text[1], "two") == 0);
    fl_img_captions_free(&c);
    put(dir, "bad1.jsonl", "{\"image\": \"imgs/a.png\", \"text\": \"one\"}\n{\"image\": \"imgs/zz.png\", \"text\": \"t\"}\n");
    snprintf(p, sizeof p, "%s/bad1.jsonl", dir);
    FL_CHECK(fl_img_captions_load(p, &c) == FL_ERR_NOT_FOUND && msg_has("bad1.jsonl: line 2") && msg_has("zz.png"));
    put(dir, "bad2.jsonl", "{\"image\": \"imgs/a.png\"}\n");
    snprintf(p, sizeof p, "%s/bad2.jsonl", dir);
    FL_CHECK(fl_img_captions_load(p, &c) == FL_ERR_FORMAT && msg_has("bad2.jsonl: line 1") && msg_has("text"));
    put(dir, "bad3.json", "[{\"text\": \"no image\"}]");
    snprintf(p, sizeof p, "%s/bad3.json", dir);
    FL_CHECK(fl_img_captions_load(p, &c) == FL_ERR_FORMAT && msg_has("record 1") && msg_has("image"));
    put(dir, "empty.jsonl", "\n");
    snprintf(p, sizeof p, "%s/empty.jsonl", dir);
    FL_CHECK(fl_img_captions_load(p, &c) == FL_ERR_FORMAT && msg_has("no records"));
    /* a folder: no captions file, then captions.tsv, then captions.jsonl (preferred) */
    FL_CHECK(fl_img_captions_load(sub, &c) == FL_ERR_NOT_FOUND && msg_has("captions.tsv"));
    put(sub, "captions.tsv", "a.png\ta red square\r\nb.jpg\tblue\n\nc.jpg\tgreen\n");
    FL_REQUIRE_OK(fl_img_captions_load(sub, &c));
    FL_CHECK(c.n == 3 && strcmp(c.text[0], "a red square") == 0 && strcmp(c.text[2], "green") == 0);
    /* seeded shuffle: a permutation, the same for the same seed; then the limit */
    fl_img_captions d;
    FL_REQUIRE_OK(fl_img_captions_load(sub, &d));
    fl_img_captions_shuffle(&c, 7);
    fl_img_captions_shuffle(&d, 7);
    int same = 1, found = 0;
    for (size_t i = 0; i < 3; i++) {
        same &= strcmp(c.text[i], d.text[i]) == 0;
        found += strcmp(c.text[i], "blue") == 0;
    }
    FL_CHECK(same && found == 1);
    fl_img_captions_limit(&c, 2);
    FL_CHECK(c.n == 2);
    fl_img_captions_limit(&c, 10);
    FL_CHECK(c.n == 2);
    fl_img_captions_free(&c);
    fl_img_captions_free(&d);
    put(sub, "captions.jsonl", "{\"file_name\": \"b.jpg\", \"text\": \"from jsonl\"}\n");
    FL_REQUIRE_OK(fl_img_captions_load(sub, &c));
    FL_CHECK(c.n == 1 && strcmp(c.text[0], "from jsonl") == 0);
    fl_img_captions_free(&c);
    put(sub, "captions.jsonl", "{\"file_name\": \"b.jpg\", \"text\": \"x\"}\n{\"file_name\": \"nope.jpg\", \"text\": \"y\"}\n");
    FL_CHECK(fl_img_captions_load(sub, &c) == FL_ERR_NOT_FOUND && msg_has("captions.jsonl: line 2") &&
             msg_has("nope.jpg"));
    put(sub, "captions.jsonl", "");
    snprintf(p, sizeof p, "%s/captions.jsonl", sub);
    unlink(p);
    put(sub, "captions.tsv", "a.png no tab\n");
    FL_CHECK(fl_img_captions_load(sub, &c) == FL_ERR_FORMAT && msg_has("captions.tsv: line 1") && msg_has("tab"));
    FL_CHECK(fl_img_captions_load("/nonexistent/caps.jsonl", &c) == FL_ERR_NOT_FOUND && msg_has("caps.jsonl"));
    /* "caption" for "text"; a key of the wrong type or an empty caption is named with its line */
    put(dir, "cap.jsonl", "{\"image\": \"imgs/a.png\", \"caption\": \"via caption\"}\n");
    snprintf(p, sizeof p, "%s/cap.jsonl", dir);
    FL_REQUIRE_OK(fl_img_captions_load(p, &c));
    FL_CHECK(c.n == 1 && strcmp(c.text[0], "via caption") == 0);
    fl_img_captions_free(&c);
    put(dir, "cap.jsonl", "{\"image\": \"imgs/a.png\", \"caption\": \"x\"}\n{\"image\": 3, \"caption\": \"y\"}\n");
    FL_CHECK(fl_img_captions_load(p, &c) == FL_ERR_FORMAT && msg_has("cap.jsonl: line 2") && msg_has("\"image\"") &&
             msg_has("not a string"));
    put(dir, "cap.jsonl", "{\"image\": \"imgs/a.png\", \"caption\": 7}\n");
    FL_CHECK(fl_img_captions_load(p, &c) == FL_ERR_FORMAT && msg_has("cap.jsonl: line 1") && msg_has("\"caption\")"));
    put(dir, "cap.jsonl", "{\"image\": \"imgs/a.png\", \"text\": \"\"}\n");
    FL_CHECK(fl_img_captions_load(p, &c) == FL_ERR_FORMAT && msg_has("line 1") && msg_has("empty caption"));
    /* a folder of images with NAME.txt captions beside them (name order); a missing or empty .txt is named */
    snprintf(p, sizeof p, "%s/captions.tsv", sub);
    unlink(p);
    FL_CHECK(fl_img_captions_load(sub, &c) == FL_ERR_NOT_FOUND && msg_has("a.png has no caption file a.txt"));
    put(sub, "c.txt", "green\n");
    put(sub, "a.txt", "a red square\r\n");
    put(sub, "b.txt", "blue");
    FL_REQUIRE_OK(fl_img_captions_load(sub, &c));
    FL_CHECK(c.n == 3 && strcmp(c.text[0], "a red square") == 0 && strcmp(c.text[1], "blue") == 0 &&
             strstr(c.image[2], "imgs/c.jpg"));
    fl_img_captions_free(&c);
    put(sub, "b.txt", " \n");
    FL_CHECK(fl_img_captions_load(sub, &c) == FL_ERR_FORMAT && msg_has("b.txt: empty caption"));
    snprintf(p, sizeof p, "%s/empty_dir", dir);
    FL_REQUIRE(mkdir(p, 0755) == 0);
    FL_CHECK(fl_img_captions_load(p, &c) == FL_ERR_NOT_FOUND && msg_has("NAME.txt"));
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    FL_CHECK(system(cmd) == 0);
}

/* The built-in byte tokenizer written as Hugging Face files (what every checkpoint of a run that
 * used it carries): loaded back, it encodes every byte string to the built-in's ids and decodes
 * them back; fl_io_write_tokenizer's sources (none, a folder, one file) and its errors. That
 * transformers / tokenizers load the same files to the same ids was checked once with
 * tokenizers 0.21.1 and transformers 4.51.3 (the commit message says how); no python here. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fitllm/io.h"
#include "fitllm/tokenizer.h"
#include "test.h"

static int is_file(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

/* ids of text under both tokenizers, with BOS/EOS as asked; 1 if they are the same */
static int same_ids(const fl_tokenizer *a, const fl_tokenizer *b, const char *text, size_t n, int bos, int eos) {
    int32_t *x = NULL, *y = NULL;
    size_t nx = 0, ny = 0;
    int ok = fl_tok_encode(a, text, n, bos, eos, &x, &nx) == FL_OK && fl_tok_encode(b, text, n, bos, eos, &y, &ny) == FL_OK &&
             nx == ny && !memcmp(x, y, nx * sizeof *x);
    free(x);
    free(y);
    return ok;
}

static fl_tokenizer *load_written(const char *dir) {
    fl_tokenizer *t = NULL;
    int n = 0;
    mkdir(dir, 0755);
    if (fl_io_write_tokenizer(NULL, dir, &n) != FL_OK || n != 2) return NULL;
    if (fl_tok_load(&t, dir) != FL_OK) return NULL;
    return t;
}

FL_TEST(tok_bytes_json_same_encoder) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s/bytes", fl_test_tmpdir());
    fl_tokenizer *j = load_written(dir), *b = NULL;
    FL_REQUIRE(j);
    FL_REQUIRE_OK(fl_tok_builtin_bytes(&b));
    char p[700];
    snprintf(p, sizeof p, "%s/tokenizer_config.json", dir);
    FL_CHECK(is_file(p));
    /* the same vocabulary and special ids (BOS/EOS from tokenizer_config.json) */
    FL_CHECK(fl_tok_vocab_size(j) == 258);
    FL_CHECK(fl_tok_bos_id(j) == 256 && fl_tok_eos_id(j) == 257 && fl_tok_is_eos(j, 257) && !fl_tok_is_eos(j, 256));
    FL_CHECKF(!strcmp(fl_tok_kind(j), "bpe-bytelevel"), "kind %s", fl_tok_kind(j));
    /* every single byte is its own id */
    for (int c = 0; c < 256; c++) {
        char s = (char)c;
        int32_t *ids = NULL;
        size_t n = 0;
        FL_CHECK(fl_tok_encode(j, &s, 1, -1, -1, &ids, &n) == FL_OK);
        FL_CHECKF(n == 1 && ids[0] == c, "byte %d -> %zu ids, first %d", c, n, n ? (int)ids[0] : -1);
        free(ids);
    }
    /* byte strings: text, whitespace runs, all bytes in a row (invalid UTF-8 included), random bytes;
     * default BOS/EOS (none), and both asked for */
    char all[255];
    for (int c = 1; c < 256; c++) all[c - 1] = (char)c;
    const char *texts[] = {"Hello, world!", "  two  spaces\tand\ttabs\n\nnew lines\r\n", "w\xc3\xb6rld \xf0\x9f\xa6\x99 llama",
                           "quote \" backslash \\ slash /", "", "\xff\xfe\x80 lone continuation bytes \xc3"};
    for (size_t k = 0; k < sizeof texts / sizeof texts[0]; k++)
        for (int be = 0; be < 2; be++)
            FL_CHECKF(same_ids(j, b, texts[k], strlen(texts[k]), be ? 1 : -1, be ? 1 : -1), "text %zu (bos/eos %d) differs", k, be);
    FL_CHECK(same_ids(j, b, all, sizeof all, -1, -1));
    uint64_t r = 0x9E3779B97F4A7C15ull;
    char rnd[4096];
    for (int it = 0; it < 20; it++) {
        size_t n = 1 + (size_t)(it * 197) % sizeof rnd;
        for (size_t i = 0; i < n; i++) {
            r ^= r << 13, r ^= r >> 7, r ^= r << 17;
            rnd[i] = (char)(r >> 24);
        }
        FL_CHECKF(same_ids(j, b, rnd, n, -1, -1), "random bytes %d (%zu) differ", it, n);
    }
    /* decoding valid UTF-8 gives the text back, specials as their strings (skipped when asked) */
    int32_t ids[] = {256, 'H', 0xc3, 0xb6, 257};
    char *txt = NULL;
    size_t len = 0;
    FL_CHECK(fl_tok_decode(j, ids, 5, 0, &txt, &len) == FL_OK && txt && !strcmp(txt, "<bos>H\xc3\xb6<eos>"));
    free(txt);
    txt = NULL;
    FL_CHECK(fl_tok_decode(j, ids, 5, 1, &txt, &len) == FL_OK && txt && !strcmp(txt, "H\xc3\xb6"));
    free(txt);
    /* the one documented difference: the literal "<eos>" is the special token (as in Hugging Face) */
    int32_t *e = NULL;
    size_t ne = 0;
    FL_CHECK(fl_tok_encode(j, "a<eos>b", 7, 0, 0, &e, &ne) == FL_OK && ne == 3 && e[1] == 257);
    free(e);
    fl_tok_free(j);
    fl_tok_free(b);
}

/* A long text is one pre-token (no regex split): still linear enough, and the same ids */
FL_TEST(tok_bytes_json_long_text) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s/bytes", fl_test_tmpdir());
    fl_tokenizer *j = load_written(dir), *b = NULL;
    FL_REQUIRE(j);
    FL_REQUIRE_OK(fl_tok_builtin_bytes(&b));
    size_t n = 200000;
    char *s = malloc(n);
    FL_REQUIRE(s);
    for (size_t i = 0; i < n; i++) s[i] = "The quick brown fox jumps over the lazy dog.\n"[i % 45];
    FL_CHECK(same_ids(j, b, s, n, -1, -1));
    free(s);
    fl_tok_free(j);
    fl_tok_free(b);
}

FL_TEST(tok_write_tokenizer_sources) {
    const char *tmp = fl_test_tmpdir();
    char a[600], b[600], c[600], p[700], q[700];
    snprintf(a, sizeof a, "%s/src", tmp);
    snprintf(b, sizeof b, "%s/dst", tmp);
    snprintf(c, sizeof c, "%s/dst2", tmp);
    mkdir(a, 0755);
    mkdir(b, 0755);
    mkdir(c, 0755);
    /* one file of another name, with a side file: copied under the name a folder is searched for */
    char *json = NULL;
    size_t len = 0;
    FL_REQUIRE_OK(fl_tok_builtin_bytes_hf_json(&json, &len));
    snprintf(p, sizeof p, "%s/custom.json", a);
    FILE *f = fopen(p, "wb");
    FL_REQUIRE(f);
    fwrite(json, 1, len, f);
    fclose(f);
    free(json);
    snprintf(q, sizeof q, "%s/tokenizer_config.json", a);
    f = fopen(q, "wb");
    FL_REQUIRE(f);
    fputs("{\"eos_token\": \"<bos>\"}", f); /* odd on purpose: it must travel */
    fclose(f);
    int n = 0;
    FL_CHECK(fl_io_write_tokenizer(p, b, &n) == FL_OK && n == 2);
    snprintf(q, sizeof q, "%s/tokenizer.json", b);
    FL_CHECK(is_file(q));
    FL_CHECK(fl_io_has_tokenizer(b));
    fl_tokenizer *t = NULL;
    FL_REQUIRE_OK(fl_tok_load(&t, b));
    FL_CHECK(fl_tok_eos_id(t) == 256); /* the side file came along */
    fl_tok_free(t);
    /* a folder: its files */
    FL_CHECK(fl_io_write_tokenizer(b, c, &n) == FL_OK && n == 2);
    FL_CHECK(fl_io_has_tokenizer(c));
    /* a llama2.c tokenizer of another size than 512 travels too */
    if (fl_test_data_dir()) {
        char l2[600], l3[600];
        snprintf(l2, sizeof l2, "%s/l2c", tmp);
        snprintf(l3, sizeof l3, "%s/l2c-out", tmp);
        mkdir(l2, 0755);
        mkdir(l3, 0755);
        snprintf(q, sizeof q, "%s/tok4096.bin", l2);
        FILE *in = fopen(fl_test_data_path("stories260K/tok512.bin"), "rb"), *out = fopen(q, "wb");
        FL_REQUIRE(in && out);
        char buf[4096];
        size_t k;
        while ((k = fread(buf, 1, sizeof buf, in)) > 0) fwrite(buf, 1, k, out);
        fclose(in);
        fclose(out);
        FL_CHECK(fl_io_has_tokenizer(l2));
        FL_CHECK(fl_io_copy_tokenizer_files(l2, l3, &n) == FL_OK && n == 1);
        snprintf(q, sizeof q, "%s/tok4096.bin", l3);
        FL_CHECK(is_file(q));
    }
    /* errors: a source that is not there is named; a failed write is reported */
    snprintf(p, sizeof p, "%s/nope/tokenizer.json", tmp);
    FL_CHECK(fl_io_write_tokenizer(p, b, NULL) == FL_ERR_NOT_FOUND);
    FL_CHECKF(strstr(fl_error_message(), "nope/tokenizer.json") != NULL, "message: %s", fl_error_message());
    fl_io_fail_writes_after(0);
    fl_status s = fl_io_write_tokenizer(NULL, c, NULL);
    fl_io_fail_writes_after(-1);
    FL_CHECKF(s != FL_OK && strstr(fl_error_message(), "tokenizer.json"), "status %d: %s", (int)s, fl_error_message());
}

/* Tests for model-file I/O: JSON, safetensors, HF config/weights, llama2.c. */
#include <dirent.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fitllm/io.h"
#include "fitllm/json.h"
#include "core/fs.h"
#include "test.h"

/* ---- helpers ---------------------------------------------------------------- */

static char *tdir(void) {
    static char b[8][256];
    static int k;
    k = (k + 1) % 8;
    const char *t = fl_test_tmpdir();
    size_t n = strlen(t);
    memcpy(b[k], t, n + 1 < sizeof b[k] ? n + 1 : sizeof b[k]);
    b[k][sizeof b[k] - 1] = 0;
    return b[k];
}

static const char *pj(const char *a, const char *b) {
    static char buf[8][512];
    static int k;
    k = (k + 1) % 8;
    char tmp[512];
    snprintf(tmp, sizeof tmp, "%s/%s", a, b);
    memcpy(buf[k], tmp, sizeof tmp);
    return buf[k];
}

static int write_bytes(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = fwrite(p, 1, n, f);
    fclose(f);
    return w == n ? 0 : -1;
}

static int write_text(const char *path, const char *s) { return write_bytes(path, s, strlen(s)); }

/* 8-byte LE length + header + data */
static int write_st_raw(const char *path, const char *header, const void *data, size_t n) {
    size_t hl = strlen(header);
    unsigned char *b = malloc(8 + hl + n + 1);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)hl >> (8 * i));
    memcpy(b + 8, header, hl);
    if (n) memcpy(b + 8 + hl, data, n);
    int r = write_bytes(path, b, 8 + hl + n);
    free(b);
    return r;
}

static int has(const char *msg, const char *s) { return strstr(msg, s) != NULL; }

#define CHECK_MSG(s) FL_CHECKF(has(fl_error_message(), s), "message lacks '%s': %s", s, fl_error_message())

static int count_entries(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

/* ---- JSON ------------------------------------------------------------------- */

FL_TEST(json_valid) {
    const char *t =
        "{\"a\": [1, -2.5e3, 0, 9223372036854775807, -9223372036854775808, 1e2, 18446744073709551616, -0.0],\n"
        " \"s\": \"x\\\"\\\\\\/\\b\\f\\n\\r\\t\\u00e9\\ud83d\\ude00\\u0000z\",\n"
        " \"n\": null, \"t\": true, \"f\": false, \"o\": {\"p\": {\"q\": [[], {}]}}, \"e\": [], \"u\": \"\xc3\xa9\"}";
    fl_json *j = NULL;
    FL_REQUIRE_OK(fl_json_parse(t, strlen(t), "t.json", &j));
    FL_CHECK(j->type == FL_JSON_OBJECT && j->len == 8);
    const fl_json *a = fl_json_get(j, "a");
    FL_REQUIRE(a && a->type == FL_JSON_ARRAY && a->len == 8);
    FL_CHECK(fl_json_at(a, 0)->is_int && fl_json_at(a, 0)->i == 1);
    FL_CHECK(!fl_json_at(a, 1)->is_int && fl_json_at(a, 1)->num == -2500.0);
    FL_CHECK(fl_json_at(a, 2)->is_int && fl_json_at(a, 2)->i == 0);
    FL_CHECK(fl_json_at(a, 3)->is_int && fl_json_at(a, 3)->i == INT64_MAX);
    FL_CHECK(fl_json_at(a, 4)->is_int && fl_json_at(a, 4)->i == INT64_MIN);
    FL_CHECK(!fl_json_at(a, 5)->is_int && fl_json_at(a, 5)->num == 100.0);
    FL_CHECK(!fl_json_at(a, 6)->is_int && fl_json_at(a, 6)->num == 18446744073709551616.0);
    FL_CHECK(fl_json_at(a, 8) == NULL);
    const fl_json *s = fl_json_get(j, "s");
    const char want[] = "x\"\\/\b\f\n\r\t\xc3\xa9\xf0\x9f\x98\x80\0z";
    FL_REQUIRE(s && s->type == FL_JSON_STRING);
    FL_CHECK(s->len == sizeof want - 1 && memcmp(s->str, want, sizeof want - 1) == 0);
    FL_CHECK(fl_json_get(j, "n")->type == FL_JSON_NULL);
    FL_CHECK(fl_json_get(j, "t")->b == 1 && fl_json_get(j, "f")->b == 0);
    const fl_json *q = fl_json_get(fl_json_get(fl_json_get(j, "o"), "p"), "q");
    FL_CHECK(q && q->len == 2 && fl_json_at(q, 1)->type == FL_JSON_OBJECT);
    FL_CHECK(strcmp(fl_json_get(j, "u")->str, "\xc3\xa9") == 0);
    FL_CHECK(fl_json_get(j, "missing") == NULL);
    fl_json_free(j);
    /* scalars at top level and surrounding whitespace */
    FL_REQUIRE_OK(fl_json_parse(" 42 ", 4, "s.json", &j));
    FL_CHECK(j->is_int && j->i == 42);
    fl_json_free(j);
}

FL_TEST(json_invalid) {
    static const struct { const char *text, *where, *what; } cases[] = {
        {"{\"a\": 1,}", "bad.json:1:9", "trailing comma"},
        {"[1, 2,]", "bad.json:1:7", "trailing comma"},
        {"{\n  \"a\": \"\\q\"\n}", "bad.json:2:10", "invalid escape"},
        {"{\"a\": \"abc", "bad.json:1:11", "unterminated"},
        {"\"\\ud800\"", "bad.json:1:2", "surrogate"},
        {"\"\\udc00\"", "bad.json:1:2", "surrogate"},
        {"\"\\u12g4\"", "bad.json:1:4", "hex"},
        {"[01]", "bad.json:1:3", "leading zero"},
        {"[1.]", "bad.json:1:4", "digit"},
        {"[-]", "bad.json:1:3", "digit"},
        {"{\"a\" 1}", "bad.json:1:6", "':'"},
        {"{1: 2}", "bad.json:1:2", "member name"},
        {"[1 2]", "bad.json:1:4", "','"},
        {"tru", "bad.json:1:1", "expected a value"},
        {"", "bad.json:1:1", "expected a value"},
        {"{} x", "bad.json:1:4", "end of input"},
        {"\"a\tb\"", "bad.json:1:3", "control character"},
        {"\"\xff\"", "bad.json:1:2", "UTF-8"},
        {"\"\xc0\xaf\"", "bad.json:1:2", "UTF-8"},
        {"[NaN]", "bad.json:1:2", "expected a value"},
        {"{'a': 1}", "bad.json:1:2", "member name"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fl_json *j = (fl_json *)1;
        fl_status s = fl_json_parse(cases[i].text, strlen(cases[i].text), "bad.json", &j);
        FL_CHECKF(s == FL_ERR_FORMAT, "case %zu '%s' gave %s", i, cases[i].text, fl_status_name(s));
        FL_CHECK(j == NULL);
        FL_CHECKF(has(fl_error_message(), cases[i].where) && has(fl_error_message(), cases[i].what),
                  "case %zu '%s': message '%s' lacks '%s' / '%s'", i, cases[i].text, fl_error_message(), cases[i].where,
                  cases[i].what);
    }
    /* deep nesting: rejected cleanly, no stack overflow */
    size_t depth = 100000;
    char *deep = malloc(depth * 2);
    memset(deep, '[', depth);
    memset(deep + depth, ']', depth);
    fl_json *j = NULL;
    FL_CHECK(fl_json_parse(deep, depth * 2, "deep.json", &j) == FL_ERR_FORMAT);
    CHECK_MSG("deep.json:1:513");
    CHECK_MSG("nesting");
    /* but 500 levels are fine */
    FL_CHECK(fl_json_parse(deep + depth - 500, 1000, "ok.json", &j) == FL_OK);
    fl_json_free(j);
    free(deep);
    /* file loading names the file */
    FL_CHECK(fl_json_parse_file("/nonexistent/x.json", &j) == FL_ERR_NOT_FOUND);
    CHECK_MSG("/nonexistent/x.json");
}

/* ---- safetensors ------------------------------------------------------------ */

FL_TEST(safetensors_roundtrip) {
    const char *d = tdir();
    const char *path = pj(d, "t.safetensors");
    float a[6] = {1, 2, 3, 4, 5, 6};                    /* (2,3) */
    double b[4] = {0.5, -1.25, 1e300, -0.0};
    int32_t c[3] = {-7, 0, 2147483647};
    int64_t e[2] = {INT64_MIN, 42};
    uint8_t u[5] = {0, 1, 2, 254, 255};
    float h[4] = {1.5f, -2.0f, 0.15625f, 65504.0f};     /* exact in bf16? 65504 no: rounds */
    float tsrc[6] = {1, 2, 3, 4, 5, 6};                 /* source (3,2): written as (2,3) transposed */
    fl_st_write_tensor t[] = {
        {.name = "a", .dtype = FL_F32, .ndim = 2, .shape = {2, 3}, .data = a, .src_dtype = FL_F32},
        {.name = "b", .dtype = FL_F64, .ndim = 1, .shape = {4}, .data = b, .src_dtype = FL_F64},
        {.name = "c", .dtype = FL_I32, .ndim = 1, .shape = {3}, .data = c, .src_dtype = FL_I32},
        {.name = "e", .dtype = FL_I64, .ndim = 1, .shape = {2}, .data = e, .src_dtype = FL_I64},
        {.name = "bf", .dtype = FL_BF16, .ndim = 2, .shape = {2, 2}, .data = h, .src_dtype = FL_F32},
        {.name = "hf", .dtype = FL_F16, .ndim = 1, .shape = {4}, .data = h, .src_dtype = FL_F32},
        {.name = "tr", .dtype = FL_F32, .ndim = 2, .shape = {2, 3}, .data = tsrc, .src_dtype = FL_F32, .transpose2d = 1},
        {.name = "trh", .dtype = FL_BF16, .ndim = 2, .shape = {2, 3}, .data = tsrc, .src_dtype = FL_F32, .transpose2d = 1},
        {.name = "empty", .dtype = FL_F32, .ndim = 2, .shape = {0, 4}, .data = NULL, .src_dtype = FL_F32},
        {.name = "scalar", .dtype = FL_F32, .ndim = 0, .data = a, .src_dtype = FL_F32},
        {.name = "u\"q", .dtype = FL_U8, .ndim = 1, .shape = {5}, .data = u, .src_dtype = FL_U8},
    };
    int n = (int)(sizeof t / sizeof t[0]);
    const char *mk[] = {"format", "note"}, *mv[] = {"pt", "a \"quoted\" \\ value"};
    FL_REQUIRE_OK(fl_st_write(path, t, n, mk, mv, 2));
    FL_CHECK(access(pj(d, "t.safetensors.tmp"), F_OK) != 0);
    /* header length is a multiple of 8 */
    FILE *f = fopen(path, "rb");
    unsigned char l8[8];
    FL_REQUIRE(f && fread(l8, 1, 8, f) == 8);
    fclose(f);
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = (hl << 8) | l8[i];
    FL_CHECK(hl % 8 == 0);

    fl_st_file st;
    FL_REQUIRE_OK(fl_st_open(&st, path));
    FL_CHECK(st.n_tensors == n);
    FL_CHECK(st.n_meta == 2);
    int found = 0;
    for (int i = 0; i < st.n_meta; i++)
        if (!strcmp(st.meta_keys[i], "note") && !strcmp(st.meta_vals[i], mv[1])) found = 1;
    FL_CHECK(found);
    const fl_st_tensor *x = fl_st_find(&st, "a");
    FL_REQUIRE(x && x->dtype == FL_F32 && x->ndim == 2 && x->shape[0] == 2 && x->shape[1] == 3);
    FL_CHECK(memcmp(x->data, a, sizeof a) == 0);
    x = fl_st_find(&st, "b");
    FL_REQUIRE(x && x->dtype == FL_F64 && memcmp(x->data, b, sizeof b) == 0);
    x = fl_st_find(&st, "c");
    FL_REQUIRE(x && x->dtype == FL_I32 && memcmp(x->data, c, sizeof c) == 0);
    x = fl_st_find(&st, "e");
    FL_REQUIRE(x && x->dtype == FL_I64 && memcmp(x->data, e, sizeof e) == 0);
    x = fl_st_find(&st, "u\"q");
    FL_REQUIRE(x && x->dtype == FL_U8 && memcmp(x->data, u, sizeof u) == 0);
    x = fl_st_find(&st, "bf");
    FL_REQUIRE(x && x->dtype == FL_BF16 && x->end - x->begin == 8);
    float back[6];
    uint16_t al[8]; /* the U8 tensor before it leaves this one unaligned: copy out first */
    memcpy(al, x->data, 8);
    fl_convert(back, FL_F32, al, FL_BF16, 4);
    for (int i = 0; i < 4; i++) FL_CHECK(back[i] == fl_bf16_to_f32(fl_f32_to_bf16(h[i])));
    FL_CHECK(back[0] == 1.5f && back[1] == -2.0f && back[2] == 0.15625f && back[3] == 65536.0f);
    x = fl_st_find(&st, "hf");
    FL_REQUIRE(x && x->dtype == FL_F16);
    memcpy(al, x->data, 8);
    fl_convert(back, FL_F32, al, FL_F16, 4);
    for (int i = 0; i < 4; i++) FL_CHECK(back[i] == h[i]);
    x = fl_st_find(&st, "tr");
    FL_REQUIRE(x && x->shape[0] == 2 && x->shape[1] == 3);
    const float *tv = x->data;
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 3; j++) FL_CHECK(tv[i * 3 + j] == tsrc[j * 2 + i]);
    x = fl_st_find(&st, "trh");
    FL_REQUIRE(x && x->dtype == FL_BF16);
    memcpy(al, x->data, 12);
    fl_convert(back, FL_F32, al, FL_BF16, 6);
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 3; j++) FL_CHECK(back[i * 3 + j] == tsrc[j * 2 + i]);
    x = fl_st_find(&st, "empty");
    FL_CHECK(x && x->begin == x->end);
    x = fl_st_find(&st, "scalar");
    FL_CHECK(x && x->ndim == 0 && x->end - x->begin == 4 && *(const float *)x->data == 1.0f);
    FL_CHECK(fl_st_find(&st, "nope") == NULL);
    /* data offsets consecutive in the given order */
    for (int i = 1; i < n; i++) FL_CHECK(st.tensors[i].begin == st.tensors[i - 1].end);
    fl_st_close(&st);

    /* unsupported conversion is refused before anything is written */
    int32_t iv[2] = {1, 2};
    fl_st_write_tensor bad = {.name = "i", .dtype = FL_F32, .ndim = 1, .shape = {2}, .data = iv, .src_dtype = FL_I32};
    const char *p2 = pj(d, "bad.safetensors");
    FL_CHECK(fl_st_write(p2, &bad, 1, NULL, NULL, 0) == FL_ERR_UNSUPPORTED);
    FL_CHECK(access(p2, F_OK) != 0 && access(pj(d, "bad.safetensors.tmp"), F_OK) != 0);
    /* writing into a missing folder fails cleanly */
    FL_CHECK(fl_st_write(pj(d, "no/such/x.safetensors"), t, 1, NULL, NULL, 0) == FL_ERR_IO);
}

/* Each bad file: status and the message names the file and (if given) the tensor. */
static void expect_st_error(const char *path, fl_status want, const char *tensor, const char *tensor2, const char *what) {
    fl_st_file st;
    fl_status s = fl_st_open(&st, path);
    FL_CHECKF(s == want, "%s: got %s (%s), want %s", path, fl_status_name(s), fl_error_message(), fl_status_name(want));
    FL_CHECK(st.map == NULL && st.tensors == NULL); /* closed on error */
    CHECK_MSG(path);
    if (tensor) CHECK_MSG(tensor);
    if (tensor2) CHECK_MSG(tensor2);
    if (what) CHECK_MSG(what);
    if (s == FL_OK) fl_st_close(&st);
}

FL_TEST(safetensors_bad_header_len_past_eof) {
    const char *p = pj(tdir(), "x.safetensors");
    unsigned char b[16] = {200, 0, 0, 0, 0, 0, 0, 0, '{', '}', ' ', ' ', ' ', ' ', ' ', ' '};
    FL_REQUIRE(write_bytes(p, b, sizeof b) == 0);
    expect_st_error(p, FL_ERR_FORMAT, NULL, NULL, "past the end of the file");
    FL_REQUIRE(write_bytes(p, b, 5) == 0); /* shorter than 8 bytes */
    expect_st_error(p, FL_ERR_FORMAT, NULL, NULL, "too small");
}

FL_TEST(safetensors_bad_header_too_big) {
    const char *p = pj(tdir(), "x.safetensors");
    uint64_t n = 100000001ull;
    unsigned char b[16] = {0};
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(n >> (8 * i));
    FL_REQUIRE(write_bytes(p, b, sizeof b) == 0);
    expect_st_error(p, FL_ERR_FORMAT, NULL, NULL, "limit");
}

FL_TEST(safetensors_bad_header_not_json) {
    const char *p = pj(tdir(), "x.safetensors");
    FL_REQUIRE(write_st_raw(p, "{\"a\": {\"dtype\": \"F32\",}}", NULL, 0) == 0);
    expect_st_error(p, FL_ERR_FORMAT, NULL, NULL, "not valid JSON");
    CHECK_MSG(":1:");
}

FL_TEST(safetensors_bad_header_not_object) {
    const char *p = pj(tdir(), "x.safetensors");
    FL_REQUIRE(write_st_raw(p, "[1, 2]  ", NULL, 0) == 0);
    expect_st_error(p, FL_ERR_FORMAT, NULL, NULL, "not a JSON object");
    FL_REQUIRE(write_st_raw(p, "{\"w\": 3}", NULL, 0) == 0);
    expect_st_error(p, FL_ERR_FORMAT, "'w'", NULL, "not an object");
    FL_REQUIRE(write_st_raw(p, "{\"__metadata__\": {\"k\": 1}}", NULL, 0) == 0);
    expect_st_error(p, FL_ERR_FORMAT, "__metadata__", NULL, "string");
}

FL_TEST(safetensors_bad_unknown_dtype) {
    const char *p = pj(tdir(), "x.safetensors");
    float d[2] = {0};
    FL_REQUIRE(write_st_raw(p, "{\"w.weight\": {\"dtype\": \"F8_E9\", \"shape\": [2], \"data_offsets\": [0, 8]}}", d, 8) == 0);
    expect_st_error(p, FL_ERR_FORMAT, "w.weight", "F8_E9", "unknown dtype");
}

FL_TEST(safetensors_bad_shape_bytes) {
    const char *p = pj(tdir(), "x.safetensors");
    float d[3] = {0};
    FL_REQUIRE(write_st_raw(p, "{\"w.weight\": {\"dtype\": \"F32\", \"shape\": [2, 2], \"data_offsets\": [0, 12]}}", d, 12) == 0);
    expect_st_error(p, FL_ERR_FORMAT, "w.weight", "16 bytes", "12 bytes");
    FL_REQUIRE(write_st_raw(p, "{\"w.weight\": {\"dtype\": \"F32\", \"shape\": [-3], \"data_offsets\": [0, 12]}}", d, 12) == 0);
    expect_st_error(p, FL_ERR_FORMAT, "w.weight", "shape[0]", NULL);
    FL_REQUIRE(write_st_raw(p, "{\"w.weight\": {\"dtype\": \"F32\", \"data_offsets\": [0, 12]}}", d, 12) == 0);
    expect_st_error(p, FL_ERR_FORMAT, "w.weight", "shape", NULL);
    /* a shape whose element or byte count overflows 64 bits is reported as that, not as "needs 0 bytes" */
    FL_REQUIRE(write_st_raw(p, "{\"w.weight\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296], "
                               "\"data_offsets\": [0, 12]}}", d, 12) == 0);
    expect_st_error(p, FL_ERR_FORMAT, "[4294967296, 4294967296]", "overflows", "more than 2^64 bytes");
    FL_CHECK(!strstr(fl_error_message(), "needs 0 bytes"));
    FL_REQUIRE(write_st_raw(p, "{\"w.weight\": {\"dtype\": \"F32\", \"shape\": [4611686018427387905], "
                               "\"data_offsets\": [0, 12]}}", d, 12) == 0); /* numel fits, bytes do not */
    expect_st_error(p, FL_ERR_FORMAT, "w.weight", "overflows", NULL);
}

FL_TEST(safetensors_bad_offsets_past_end) {
    const char *p = pj(tdir(), "x.safetensors");
    float d[2] = {0};
    FL_REQUIRE(write_st_raw(p, "{\"w.weight\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}}", d, 8) == 0);
    expect_st_error(p, FL_ERR_FORMAT, "w.weight", NULL, "past the end");
    FL_REQUIRE(write_st_raw(p, "{\"w.weight\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [8, 0]}}", d, 8) == 0);
    expect_st_error(p, FL_ERR_FORMAT, "w.weight", NULL, "begin");
}

FL_TEST(safetensors_bad_overlap) {
    const char *p = pj(tdir(), "x.safetensors");
    float d[4] = {0};
    FL_REQUIRE(write_st_raw(p,
                            "{\"a\": {\"dtype\": \"F32\", \"shape\": [3], \"data_offsets\": [0, 12]},"
                            " \"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [8, 16]}}",
                            d, 16) == 0);
    expect_st_error(p, FL_ERR_FORMAT, "'a'", "'b'", "overlap");
}

FL_TEST(safetensors_bad_gap_and_order) {
    const char *d0 = tdir();
    const char *p = pj(d0, "x.safetensors");
    float d[4] = {0};
    /* listed out of order but contiguous: valid */
    FL_REQUIRE(write_st_raw(p,
                            "{\"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [8, 16]},"
                            " \"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}",
                            d, 16) == 0);
    fl_st_file st;
    FL_REQUIRE_OK(fl_st_open(&st, p));
    FL_CHECK(st.n_tensors == 2 && fl_st_find(&st, "a")->begin == 0);
    fl_st_close(&st);
    /* gap between tensors */
    FL_REQUIRE(write_st_raw(p,
                            "{\"b\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [12, 16]},"
                            " \"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}",
                            d, 16) == 0);
    expect_st_error(p, FL_ERR_FORMAT, "'a'", "'b'", "gap");
    /* data section not fully covered */
    FL_REQUIRE(write_st_raw(p, "{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}", d, 16) == 0);
    expect_st_error(p, FL_ERR_FORMAT, "'a'", NULL, "16 bytes");
    /* first tensor not at 0 */
    FL_REQUIRE(write_st_raw(p, "{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [8, 16]}}", d, 16) == 0);
    expect_st_error(p, FL_ERR_FORMAT, "'a'", NULL, "gap");
}

FL_TEST(safetensors_bad_truncated) {
    const char *p = pj(tdir(), "x.safetensors");
    float a[64];
    for (int i = 0; i < 64; i++) a[i] = (float)i;
    fl_st_write_tensor t[2] = {{.name = "first", .dtype = FL_F32, .ndim = 1, .shape = {32}, .data = a},
                               {.name = "last.weight", .dtype = FL_F32, .ndim = 2, .shape = {4, 8}, .data = a + 32}};
    FL_REQUIRE_OK(fl_st_write(p, t, 2, NULL, NULL, 0));
    struct stat sb;
    FL_REQUIRE(stat(p, &sb) == 0);
    FL_REQUIRE(truncate(p, sb.st_size - 5) == 0);
    expect_st_error(p, FL_ERR_FORMAT, "last.weight", NULL, "truncated");
}

/* fill_range (io.h): a tensor produced slice by slice is written with the bytes of the same tensor
 * given whole (converted, transposed, > FL_ST_FILL_SLICE elements: several slices, in order); a
 * producer's error stops the write and leaves no file. */
typedef struct {
    const float *src;
    size_t next, calls, fail_at;
} range_src;
static fl_status range_fill(void *ud, void *dst, size_t off, size_t n) {
    range_src *r = ud;
    if (off != r->next) return fl_errorf(FL_ERR_INTERNAL, "slice at %zu, expected %zu", off, r->next);
    if (r->fail_at && r->calls + 1 == r->fail_at) return fl_errorf(FL_ERR_IO, "producer failed at slice %zu", r->calls);
    memcpy(dst, r->src + off, n * sizeof(float));
    r->next = off + n;
    r->calls++;
    return FL_OK;
}

static fl_status never_fill(void *ud, float *dst) {
    (void)ud, (void)dst;
    return fl_errorf(FL_ERR_INTERNAL, "not to be called");
}

static unsigned char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)len + 1);
    *n = b && fread(b, 1, (size_t)len, f) == (size_t)len ? (size_t)len : 0;
    fclose(f);
    return b;
}

FL_TEST(safetensors_fill_range_streams_the_same_bytes) {
    const size_t big = FL_ST_FILL_SLICE * 2 + 77; /* three slices */
    float *a = malloc(big * sizeof(float));
    FL_REQUIRE(a != NULL);
    for (size_t i = 0; i < big; i++) a[i] = (float)((i * 2654435761u) % 1000003) / 7.0f - 50.0f;
    range_src r[3] = {{a, 0, 0, 0}, {a, 0, 0, 0}, {a, 0, 0, 0}};
    fl_st_write_tensor whole[3] = {
        {.name = "big", .dtype = FL_BF16, .ndim = 1, .shape = {(int64_t)big}, .data = a, .src_dtype = FL_F32},
        {.name = "tr", .dtype = FL_F32, .ndim = 2, .shape = {5, 7}, .data = a, .src_dtype = FL_F32, .transpose2d = 1},
        {.name = "small", .dtype = FL_F32, .ndim = 2, .shape = {3, 4}, .data = a + 9, .src_dtype = FL_F32}};
    fl_st_write_tensor ranged[3];
    memcpy(ranged, whole, sizeof whole);
    for (int i = 0; i < 3; i++) {
        ranged[i].data = NULL;
        ranged[i].fill_range = range_fill;
        ranged[i].fill_ud = &r[i];
    }
    r[2].src = a + 9;
    char p1[512], p2[512];
    snprintf(p1, sizeof p1, "%s", pj(tdir(), "whole.safetensors"));
    snprintf(p2, sizeof p2, "%s", pj(tdir(), "ranged.safetensors"));
    FL_REQUIRE_OK(fl_st_write(p1, whole, 3, NULL, NULL, 0));
    FL_REQUIRE_OK(fl_st_write(p2, ranged, 3, NULL, NULL, 0));
    FL_CHECK(r[0].calls == 3 && r[0].next == big && r[1].calls == 1 && r[2].calls == 1);
    size_t n1 = 0, n2 = 0;
    unsigned char *b1 = slurp(p1, &n1), *b2 = slurp(p2, &n2);
    FL_CHECK(n1 > big * 2 && n1 == n2 && b1 && b2 && !memcmp(b1, b2, n1));
    free(b1);
    free(b2);
    /* a failing producer: an error naming it, no file, no temporary */
    range_src rf = {a, 0, 0, 2};
    ranged[0].fill_ud = &rf;
    const char *p3 = pj(tdir(), "failed.safetensors");
    FL_CHECK(fl_st_write(p3, ranged, 1, NULL, NULL, 0) == FL_ERR_IO && strstr(fl_error_message(), "producer failed"));
    FL_CHECK(access(p3, F_OK) != 0);
    char tmp[600];
    snprintf(tmp, sizeof tmp, "%s.tmp", p3);
    FL_CHECK(access(tmp, F_OK) != 0);
    /* fill and fill_range together: refused */
    fl_st_write_tensor both = ranged[2];
    both.fill = never_fill;
    both.src_dtype = FL_F32;
    FL_CHECK(fl_st_write(p3, &both, 1, NULL, NULL, 0) == FL_ERR_INVALID && strstr(fl_error_message(), "fill_range"));
    free(a);
}

/* ---- config ----------------------------------------------------------------- */

static const char *LLAMA_CFG =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", \"hidden_size\": 16,"
    " \"intermediate_size\": 24, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2,"
    " \"vocab_size\": 32, \"max_position_embeddings\": 32, \"rms_norm_eps\": 1e-06, \"rope_theta\": 500000.0,"
    " \"rope_scaling\": %s, \"tie_word_embeddings\": false, \"attention_bias\": true%s}";

FL_TEST(config_llama_and_errors) {
    const char *d = tdir();
    const char *p = pj(d, "config.json");
    char buf[2048];
    fl_model_config c;
    snprintf(buf, sizeof buf, LLAMA_CFG,
             "{\"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0,"
             " \"original_max_position_embeddings\": 8192, \"rope_type\": \"llama3\"}",
             "");
    FL_REQUIRE(write_text(p, buf) == 0);
    FL_REQUIRE_OK(fl_hf_load_config(p, &c));
    FL_CHECK(c.arch == FL_ARCH_LLAMA && c.dim == 16 && c.ffn_dim == 24 && c.n_layers == 2 && c.n_heads == 4);
    FL_CHECK(c.n_kv_heads == 2 && c.head_dim == 4 && c.vocab_size == 32 && c.max_seq == 32);
    FL_CHECK(c.norm_eps == 1e-6f && c.rope_theta == 500000.0f && !c.tie_embeddings && c.attention_bias && !c.mlp_bias);
    FL_CHECK(c.rope_scaling.type == FL_ROPE_LLAMA3 && c.rope_scaling.factor == 8.0f);
    FL_CHECK(c.rope_scaling.low_freq_factor == 1.0f && c.rope_scaling.high_freq_factor == 4.0f);
    FL_CHECK(c.rope_scaling.original_max_position == 8192);
    /* save -> load round trip */
    const char *p2 = pj(d, "config2.json");
    FL_REQUIRE_OK(fl_hf_save_config(p2, &c));
    fl_model_config c2;
    FL_REQUIRE_OK(fl_hf_load_config(p2, &c2));
    FL_CHECK(memcmp(&c, &c2, sizeof c) == 0);
    /* floats written as transformers writes them: the shortest decimal (1e-06, not 9.99999997e-07) */
    char *txt = NULL;
    size_t tl = 0;
    FL_REQUIRE_OK(fl_fs_read_file(p2, 0, &txt, &tl));
    FL_CHECKF(strstr(txt, "\"rms_norm_eps\": 1e-06,") && strstr(txt, "\"rope_theta\": 500000.0"), "%s", txt);
    free(txt);
    /* linear scaling with legacy "type" */
    snprintf(buf, sizeof buf, LLAMA_CFG, "{\"type\": \"linear\", \"factor\": 2.0}", "");
    FL_REQUIRE(write_text(p, buf) == 0);
    FL_REQUIRE_OK(fl_hf_load_config(p, &c));
    FL_CHECK(c.rope_scaling.type == FL_ROPE_LINEAR && c.rope_scaling.factor == 2.0f);
    /* unsupported scaling */
    snprintf(buf, sizeof buf, LLAMA_CFG, "{\"rope_type\": \"yarn\", \"factor\": 2.0}", "");
    FL_REQUIRE(write_text(p, buf) == 0);
    FL_CHECK(fl_hf_load_config(p, &c) == FL_ERR_UNSUPPORTED);
    CHECK_MSG("yarn");
    /* missing key */
    FL_REQUIRE(write_text(p, "{\"model_type\": \"llama\", \"intermediate_size\": 24, \"num_hidden_layers\": 2,"
                             " \"num_attention_heads\": 4, \"vocab_size\": 32, \"max_position_embeddings\": 32,"
                             " \"rms_norm_eps\": 1e-6}") == 0);
    FL_CHECK(fl_hf_load_config(p, &c) == FL_ERR_FORMAT);
    CHECK_MSG(p);
    CHECK_MSG("missing key 'hidden_size'");
    /* a null value is said as null, not missing */
    FL_REQUIRE(write_text(p, "{\"model_type\": \"llama\", \"hidden_size\": 16, \"intermediate_size\": 24, "
                             "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"vocab_size\": 32, "
                             "\"max_position_embeddings\": 32, \"rms_norm_eps\": null}") == 0);
    FL_CHECK(fl_hf_load_config(p, &c) == FL_ERR_FORMAT);
    CHECK_MSG("null key 'rms_norm_eps' (a number is needed)");
    /* mistyped key */
    snprintf(buf, sizeof buf, LLAMA_CFG, "null", ", \"num_hidden_layers\": \"2\"");
    FL_REQUIRE(write_text(p, buf) == 0);
    FL_CHECK(fl_hf_load_config(p, &c) == FL_ERR_FORMAT);
    CHECK_MSG("'num_hidden_layers'");
    CHECK_MSG("integer");
    snprintf(buf, sizeof buf, LLAMA_CFG, "null", ", \"tie_word_embeddings\": 1");
    FL_REQUIRE(write_text(p, buf) == 0);
    FL_CHECK(fl_hf_load_config(p, &c) == FL_ERR_FORMAT);
    CHECK_MSG("'tie_word_embeddings'");
    /* a number a float cannot hold (found by fuzz_hf_config: it loaded as inf and saved as the non-JSON "inf") */
    snprintf(buf, sizeof buf, LLAMA_CFG, "null", "");
    char *e = strstr(buf, "1e-06");
    FL_REQUIRE(e != NULL);
    memcpy(e, "1e105", 5);
    FL_REQUIRE(write_text(p, buf) == 0);
    FL_CHECK(fl_hf_load_config(p, &c) == FL_ERR_FORMAT);
    CHECK_MSG(p);
    CHECK_MSG("'rms_norm_eps' = 1e+105 is outside the range of a float");
    /* unknown architecture (BERT, then T5 were the example until they became ones: src/model/arch_bert.c, arch_t5.c) */
    FL_REQUIRE(write_text(p, "{\"model_type\": \"mamba\", \"architectures\": [\"MambaForCausalLM\"], \"hidden_size\": 8}") == 0);
    FL_CHECK(fl_hf_load_config(p, &c) == FL_ERR_UNSUPPORTED);
    CHECK_MSG(p);
    CHECK_MSG("'mamba'");
    /* invalid values are caught by validation */
    snprintf(buf, sizeof buf, LLAMA_CFG, "null", ", \"num_key_value_heads\": 3");
    FL_REQUIRE(write_text(p, buf) == 0);
    FL_CHECK(fl_hf_load_config(p, &c) == FL_ERR_FORMAT);
    CHECK_MSG(p);
    /* broken JSON names file and position */
    FL_REQUIRE(write_text(p, "{\"model_type\": \"llama\",\n}") == 0);
    FL_CHECK(fl_hf_load_config(p, &c) == FL_ERR_FORMAT);
    CHECK_MSG(":2:1");
    FL_CHECK(fl_hf_load_config(pj(d, "absent.json"), &c) == FL_ERR_NOT_FOUND);
}

/* Epsilons, RoPE's base and its scaling factors at 0 or below were replaced by defaults (or divided by): refused,
 * naming the file and the key, in every architecture's parser. */
FL_TEST(config_nonpositive_floats_refused) {
#define LL "{\"model_type\": \"llama\", \"hidden_size\": 16, \"intermediate_size\": 24, \"num_hidden_layers\": 2," \
           " \"num_attention_heads\": 4, \"vocab_size\": 32, \"max_position_embeddings\": 32"
    static const struct { const char *json, *key; } cases[] = {
        {LL ", \"rms_norm_eps\": %s}", "'rms_norm_eps'"},
        {LL ", \"rms_norm_eps\": 1e-5, \"rope_theta\": %s}", "'rope_theta'"},
        {LL ", \"rms_norm_eps\": 1e-5, \"rope_parameters\": {\"rope_theta\": %s, \"rope_type\": \"default\"}}",
         "'rope_theta'"},
        {LL ", \"rms_norm_eps\": 1e-5, \"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": %s}}", "'factor'"},
        {"{\"model_type\": \"gpt2\", \"n_embd\": 16, \"n_layer\": 2, \"n_head\": 2, \"n_ctx\": 64, \"vocab_size\": 50,"
         " \"layer_norm_epsilon\": %s}", "'layer_norm_epsilon'"},
        {"{\"model_type\": \"t5\", \"d_model\": 16, \"d_ff\": 32, \"num_layers\": 1, \"num_heads\": 2, \"d_kv\": 8,"
         " \"vocab_size\": 40, \"layer_norm_epsilon\": %s}", "'layer_norm_epsilon'"},
        {"{\"model_type\": \"bert\", \"hidden_size\": 16, \"intermediate_size\": 32, \"num_hidden_layers\": 1,"
         " \"num_attention_heads\": 2, \"max_position_embeddings\": 32, \"vocab_size\": 40, \"layer_norm_eps\": %s}",
         "'layer_norm_eps'"},
    };
#undef LL
    static const char *bad[] = {"0", "-1e-5", "0.0"};
    const char *p = pj(tdir(), "config.json");
    char buf[1024];
    fl_model_config c;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(buf, sizeof buf, cases[i].json, "0.5"); /* the fixture itself loads */
        FL_REQUIRE(write_text(p, buf) == 0);
        FL_CHECKF(fl_hf_load_config(p, &c) == FL_OK, "case %zu: %s", i, fl_error_message());
        for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++) {
            snprintf(buf, sizeof buf, cases[i].json, bad[b]);
            FL_REQUIRE(write_text(p, buf) == 0);
            FL_CHECKF(fl_hf_load_config(p, &c) == FL_ERR_FORMAT, "case %zu value %s loaded", i, bad[b]);
            CHECK_MSG(p);
            CHECK_MSG(cases[i].key);
            CHECK_MSG("must be a positive number");
        }
    }
}

FL_TEST(config_gpt2_defaults) {
    const char *p = pj(tdir(), "config.json");
    FL_REQUIRE(write_text(p, "{\"model_type\": \"gpt2\", \"n_embd\": 16, \"n_layer\": 2, \"n_head\": 2, \"n_ctx\": 64,"
                             " \"vocab_size\": 50, \"n_inner\": null, \"activation_function\": \"gelu_new\"}") == 0);
    fl_model_config c;
    FL_REQUIRE_OK(fl_hf_load_config(p, &c));
    FL_CHECK(c.arch == FL_ARCH_GPT2 && c.dim == 16 && c.n_layers == 2 && c.n_heads == 2 && c.n_kv_heads == 2);
    FL_CHECK(c.max_seq == 64 && c.ffn_dim == 64 && c.norm_eps == 1e-5f && c.tie_embeddings == 1);
    FL_CHECK(c.attention_bias && c.mlp_bias && c.head_dim == 8);
    fl_model_config c2;
    FL_REQUIRE_OK(fl_hf_save_config(p, &c));
    FL_REQUIRE_OK(fl_hf_load_config(p, &c2));
    FL_CHECK(memcmp(&c, &c2, sizeof c) == 0);
    FL_REQUIRE(write_text(p, "{\"model_type\": \"gpt2\", \"n_embd\": 16, \"n_layer\": 2, \"n_head\": 2,"
                             " \"vocab_size\": 50}") == 0);
    FL_CHECK(fl_hf_load_config(p, &c) == FL_ERR_FORMAT);
    CHECK_MSG("'n_positions'");
}

/* OPT: the keys of a real config (facebook/opt-125m's, shrunk), the save/load round trip, and the
 * variants refused by name: post-norm blocks (OPT-350m), a projected embedding, another activation */
FL_TEST(config_opt_keys_and_refusals) {
    const char *p = pj(tdir(), "config.json");
#define OPT_CFG "{\"model_type\": \"opt\", \"architectures\": [\"OPTForCausalLM\"], \"hidden_size\": 16, " \
                "\"num_hidden_layers\": 2, \"num_attention_heads\": 2, \"ffn_dim\": 40, \"vocab_size\": 50, "    \
                "\"max_position_embeddings\": 32, \"activation_function\": \"relu\", \"enable_bias\": true, "     \
                "\"word_embed_proj_dim\": %d, \"do_layer_norm_before\": %s%s}"
    char buf[1024];
    snprintf(buf, sizeof buf, OPT_CFG, 16, "true", "");
    FL_REQUIRE(write_text(p, buf) == 0);
    fl_model_config c, c2;
    FL_REQUIRE_OK(fl_hf_load_config(p, &c));
    FL_CHECK(c.arch == FL_ARCH_OPT && c.dim == 16 && c.n_layers == 2 && c.n_heads == 2 && c.n_kv_heads == 2);
    FL_CHECK(c.ffn_dim == 40 && c.max_seq == 32 && c.norm_eps == 1e-5f && c.tie_embeddings == 1 && c.head_dim == 8);
    FL_CHECK(c.attention_bias && c.mlp_bias);
    FL_REQUIRE_OK(fl_hf_save_config(p, &c));
    FL_REQUIRE_OK(fl_hf_load_config(p, &c2));
    FL_CHECK(memcmp(&c, &c2, sizeof c) == 0);
    fl_param_layout lay; /* the position table holds the 2 offset rows: HF's (max_position_embeddings + 2, C) */
    FL_REQUIRE_OK(fl_layout_build(&lay, &c));
    int pe = fl_layout_role(&lay, 0, FL_ROLE_POS_EMBED);
    FL_CHECK(pe >= 0 && lay.params[pe].shape[0] == 34 && !strcmp(lay.params[pe].name, "model.decoder.embed_positions.weight"));
    FL_CHECK(fl_layout_find(&lay, "decoder.layers.1.fc2.bias") >= 0); /* OPTModel files: no "model." prefix */
    fl_layout_free(&lay);
    snprintf(buf, sizeof buf, OPT_CFG, 16, "false", "");
    FL_REQUIRE(write_text(p, buf) == 0);
    FL_CHECK(fl_hf_load_config(p, &c) == FL_ERR_UNSUPPORTED);
    CHECK_MSG("'do_layer_norm_before'");
    snprintf(buf, sizeof buf, OPT_CFG, 8, "true", "");
    FL_REQUIRE(write_text(p, buf) == 0);
    FL_CHECK(fl_hf_load_config(p, &c) == FL_ERR_UNSUPPORTED);
    CHECK_MSG("'word_embed_proj_dim'");
    snprintf(buf, sizeof buf, OPT_CFG, 16, "true", ", \"activation_function\": \"gelu\"");
    FL_REQUIRE(write_text(p, buf) == 0);
    FL_CHECK(fl_hf_load_config(p, &c) == FL_ERR_UNSUPPORTED);
    CHECK_MSG("'activation_function'");
#undef OPT_CFG
}

/* ---- weights ---------------------------------------------------------------- */

static fl_model_config small_llama(void) {
    fl_model_config c;
    memset(&c, 0, sizeof c);
    c.arch = FL_ARCH_LLAMA;
    c.vocab_size = 32; c.dim = 16; c.n_layers = 2; c.n_heads = 4; c.n_kv_heads = 2; c.ffn_dim = 24; c.max_seq = 32;
    c.norm_eps = 1e-5f; c.rope_theta = 10000.0f; c.attention_bias = 1;
    return c;
}

static fl_model_config small_gpt2(void) {
    fl_model_config c;
    memset(&c, 0, sizeof c);
    c.arch = FL_ARCH_GPT2;
    c.vocab_size = 40; c.dim = 16; c.n_layers = 2; c.n_heads = 2; c.n_kv_heads = 2; c.ffn_dim = 64; c.max_seq = 16;
    c.norm_eps = 1e-5f; c.tie_embeddings = 1;
    return c;
}

static void fill_random(fl_model *m, unsigned long long seed) {
    fl_test_rng r = {seed};
    fl_test_fill(&r, fl_model_params_f32(m), m->layout.numel, -1.0f, 1.0f);
}

/* Write m's parameters (entries [lo,hi)) to a safetensors file, optionally
 * dropping/renaming entries and adding extras. */
static fl_status write_subset(const fl_model *m, const char *path, int lo, int hi, const char *skip, const char *prefix_strip,
                              fl_dtype dt, const fl_st_write_tensor *extra, int n_extra) {
    const fl_param_layout *lay = &m->layout;
    fl_st_write_tensor *t = calloc((size_t)(hi - lo + n_extra + 1), sizeof *t);
    int n = 0;
    for (int i = 0; i < n_extra; i++) t[n++] = extra[i]; /* first: an odd-sized one misaligns the rest */
    for (int k = lo; k < hi; k++) {
        const fl_param_info *p = &lay->params[k];
        if (skip && strcmp(p->name, skip) == 0) continue;
        const char *nm = p->name;
        if (prefix_strip && strncmp(nm, prefix_strip, strlen(prefix_strip)) == 0) nm += strlen(prefix_strip);
        t[n].name = nm;
        t[n].dtype = dt;
        t[n].src_dtype = FL_F32;
        t[n].data = fl_model_params_f32(m) + p->offset;
        t[n].ndim = p->ndim;
        t[n].transpose2d = p->transposed_on_disk;
        t[n].shape[0] = p->transposed_on_disk ? p->shape[1] : p->shape[0];
        t[n].shape[1] = p->transposed_on_disk ? p->shape[0] : p->shape[1];
        n++;
    }
    fl_status s = fl_st_write(path, t, n, NULL, NULL, 0);
    free(t);
    return s;
}

static int cfg_eq(const fl_model_config *a, const fl_model_config *b) {
    return a->arch == b->arch && a->vocab_size == b->vocab_size && a->dim == b->dim && a->n_layers == b->n_layers &&
           a->n_heads == b->n_heads && a->n_kv_heads == b->n_kv_heads && a->head_dim == b->head_dim &&
           a->ffn_dim == b->ffn_dim && a->max_seq == b->max_seq && a->norm_eps == b->norm_eps &&
           (a->arch == FL_ARCH_GPT2 || a->rope_theta == b->rope_theta) &&
           memcmp(&a->rope_scaling, &b->rope_scaling, sizeof a->rope_scaling) == 0 &&
           a->tie_embeddings == b->tie_embeddings && a->attention_bias == b->attention_bias && a->mlp_bias == b->mlp_bias;
}

static void roundtrip(fl_model_config cfg, unsigned long long seed) {
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "io", 0));
    fl_model m, m2;
    FL_REQUIRE_OK(fl_model_init(&m, &cfg, NULL, &pool));
    fill_random(&m, seed);
    const char *d = tdir();
    const char *out = pj(d, "saved");
    FL_REQUIRE_OK(fl_hf_save_model(&m, out));
    FL_CHECK(count_entries(d) == 1); /* no temp folder left beside it */
    FL_CHECK(count_entries(out) == 2);
    FL_REQUIRE_OK(fl_hf_load_model(&m2, out, NULL, &pool));
    FL_CHECK(cfg_eq(&m.cfg, &m2.cfg));
    FL_REQUIRE(m2.layout.numel == m.layout.numel);
    FL_CHECK(memcmp(fl_model_params_f32(&m), fl_model_params_f32(&m2), m.layout.numel * sizeof(float)) == 0);
    /* metadata and the on-disk orientation */
    fl_st_file st;
    FL_REQUIRE_OK(fl_st_open(&st, pj(out, "model.safetensors")));
    FL_CHECK(st.n_meta == 1 && !strcmp(st.meta_keys[0], "format") && !strcmp(st.meta_vals[0], "pt"));
    FL_CHECK(st.n_tensors == m.layout.n);
    if (cfg.arch == FL_ARCH_GPT2) {
        const fl_st_tensor *t = fl_st_find(&st, "transformer.h.1.attn.c_attn.weight");
        FL_REQUIRE(t && t->shape[0] == cfg.dim && t->shape[1] == 3 * cfg.dim);
        const float *w = fl_model_param(&m, "transformer.h.1.attn.c_attn.weight");
        const float *fw = t->data;
        int C = cfg.dim;
        for (int o = 0; o < 3 * C; o++)
            for (int i = 0; i < C; i++) FL_CHECK(w[o * C + i] == fw[i * 3 * C + o]);
    }
    fl_st_close(&st);
    /* saving again over an existing folder replaces the files in place */
    fill_random(&m, seed + 1);
    FL_REQUIRE_OK(fl_hf_save_model(&m, out));
    FL_CHECK(count_entries(out) == 2);
    FL_REQUIRE_OK(fl_hf_load_weights(&m2, out));
    FL_CHECK(memcmp(fl_model_params_f32(&m), fl_model_params_f32(&m2), m.layout.numel * sizeof(float)) == 0);
    fl_model_free(&m2);
    fl_model_free(&m);
    FL_CHECK(fl_mem_live_count(&pool) == 0);
    fl_mem_pool_free(&pool);
}

FL_TEST(weights_roundtrip_llama) { roundtrip(small_llama(), 11); }
FL_TEST(weights_roundtrip_gpt2) { roundtrip(small_gpt2(), 12); }
FL_TEST(weights_roundtrip_gpt2_untied) {
    fl_model_config c = small_gpt2();
    c.tie_embeddings = 0;
    roundtrip(c, 13);
}

FL_TEST(weights_errors) {
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "io", 0));
    fl_model_config cfg = small_llama();
    fl_model m, m2;
    FL_REQUIRE_OK(fl_model_init(&m, &cfg, NULL, &pool));
    fill_random(&m, 3);
    const char *d = tdir();
    FL_REQUIRE_OK(fl_hf_save_config(pj(d, "config.json"), &cfg));
    const char *st = pj(d, "model.safetensors");
    /* missing tensor: a malformed model folder (the CLI's exit 1, as an unexpected or misshapen tensor; a missing
     * folder or file is FL_ERR_NOT_FOUND, exit 2) */
    FL_REQUIRE_OK(write_subset(&m, st, 0, m.layout.n, "model.layers.1.mlp.up_proj.weight", NULL, FL_F32, NULL, 0));
    memset(&m2, 0xab, sizeof m2);
    FL_CHECK(fl_hf_load_model(&m2, d, NULL, &pool) == FL_ERR_FORMAT);
    CHECK_MSG("model.layers.1.mlp.up_proj.weight");
    CHECK_MSG(d);
    FL_CHECK(fl_mem_live_count(&pool) == 1);
    /* unexpected extra tensor */
    float junk[4] = {0};
    fl_st_write_tensor ex[2] = {{.name = "model.layers.0.self_attn.rotary_emb.inv_freq", .ndim = 1, .shape = {2}, .data = junk},
                                {.name = "model.layers.0.extra.weight", .ndim = 1, .shape = {4}, .data = junk}};
    FL_REQUIRE_OK(write_subset(&m, st, 0, m.layout.n, NULL, NULL, FL_F32, ex, 1)); /* ignored buffer only: OK */
    FL_REQUIRE_OK(fl_hf_load_model(&m2, d, NULL, &pool));
    FL_CHECK(memcmp(fl_model_params_f32(&m), fl_model_params_f32(&m2), m.layout.numel * sizeof(float)) == 0);
    fl_model_free(&m2);
    FL_REQUIRE_OK(write_subset(&m, st, 0, m.layout.n, NULL, NULL, FL_F32, ex, 2));
    FL_CHECK(fl_hf_load_model(&m2, d, NULL, &pool) == FL_ERR_FORMAT);
    CHECK_MSG("model.layers.0.extra.weight");
    CHECK_MSG(st);
    /* shape mismatch between config.json and the weights */
    FL_REQUIRE_OK(write_subset(&m, st, 0, m.layout.n, NULL, NULL, FL_F32, NULL, 0));
    fl_model_config big = cfg;
    big.ffn_dim = 28;
    FL_REQUIRE_OK(fl_hf_save_config(pj(d, "config.json"), &big));
    FL_CHECK(fl_hf_load_model(&m2, d, NULL, &pool) == FL_ERR_FORMAT);
    CHECK_MSG("model.layers.0.mlp.gate_proj.weight");
    CHECK_MSG("[28, 16]");
    CHECK_MSG("[24, 16]");
    CHECK_MSG(st);
    /* no weights at all */
    FL_REQUIRE_OK(fl_hf_save_config(pj(d, "config.json"), &cfg));
    unlink(st);
    FL_CHECK(fl_hf_load_model(&m2, d, NULL, &pool) == FL_ERR_NOT_FOUND);
    CHECK_MSG("model.safetensors");
    /* BF16 weights are converted on load */
    FL_REQUIRE_OK(write_subset(&m, st, 0, m.layout.n, NULL, NULL, FL_BF16, NULL, 0));
    FL_REQUIRE_OK(fl_hf_load_model(&m2, d, NULL, &pool));
    int ok = 1;
    for (size_t i = 0; i < m.layout.numel; i++) ok &= fl_model_params_f32(&m2)[i] == fl_bf16_to_f32(fl_f32_to_bf16(fl_model_params_f32(&m)[i]));
    FL_CHECK(ok);
    fl_model_free(&m2);
    /* F16 too */
    FL_REQUIRE_OK(write_subset(&m, st, 0, m.layout.n, NULL, NULL, FL_F16, NULL, 0));
    FL_REQUIRE_OK(fl_hf_load_model(&m2, d, NULL, &pool));
    ok = 1;
    for (size_t i = 0; i < m.layout.numel; i++) ok &= fabsf(fl_model_params_f32(&m2)[i] - fl_model_params_f32(&m)[i]) <= 1e-3f;
    FL_CHECK(ok);
    fl_model_free(&m2);
    /* a NaN or inf weight (a diverged run's save) is refused, naming the tensor and the element,
     * in every dtype the loader reads */
    int k = fl_layout_find(&m.layout, "model.layers.1.self_attn.v_proj.weight");
    FL_REQUIRE(k >= 0);
    float *w = fl_model_params_f32(&m) + m.layout.params[k].offset;
    const fl_dtype dts[3] = {FL_F32, FL_BF16, FL_F16};
    for (int i = 0; i < 3; i++) {
        float keep = w[5];
        w[5] = i == 1 ? INFINITY : NAN;
        FL_REQUIRE_OK(write_subset(&m, st, 0, m.layout.n, NULL, NULL, dts[i], NULL, 0));
        w[5] = keep;
        memset(&m2, 0xab, sizeof m2);
        FL_CHECK(fl_hf_load_model(&m2, d, NULL, &pool) == FL_ERR_FORMAT);
        CHECK_MSG("model.layers.1.self_attn.v_proj.weight");
        CHECK_MSG("non-finite");
        CHECK_MSG("element 5");
    }
    fl_model_free(&m);
    FL_CHECK(fl_mem_live_count(&pool) == 0);
    fl_mem_pool_free(&pool);
}

FL_TEST(weights_sharded) {
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "io", 0));
    fl_model_config cfg = small_llama();
    fl_model m, m2;
    FL_REQUIRE_OK(fl_model_init(&m, &cfg, NULL, &pool));
    fill_random(&m, 5);
    const char *d = tdir();
    FL_REQUIRE_OK(fl_hf_save_config(pj(d, "config.json"), &cfg));
    int half = m.layout.n / 2;
    FL_REQUIRE_OK(write_subset(&m, pj(d, "model-00001-of-00002.safetensors"), 0, half, NULL, NULL, FL_F32, NULL, 0));
    FL_REQUIRE_OK(write_subset(&m, pj(d, "model-00002-of-00002.safetensors"), half, m.layout.n, NULL, NULL, FL_F32, NULL, 0));
    size_t cap = 65536, len = 0;
    char *idx = malloc(cap);
    len += (size_t)snprintf(idx + len, cap - len, "{\"metadata\": {\"total_size\": %zu}, \"weight_map\": {",
                            m.layout.numel * 4);
    for (int k = 0; k < m.layout.n; k++)
        len += (size_t)snprintf(idx + len, cap - len, "%s\"%s\": \"model-0000%d-of-00002.safetensors\"", k ? ", " : "",
                                m.layout.params[k].name, k < half ? 1 : 2);
    snprintf(idx + len, cap - len, "}}");
    FL_REQUIRE(write_text(pj(d, "model.safetensors.index.json"), idx) == 0);
    FL_REQUIRE_OK(fl_hf_load_model(&m2, d, NULL, &pool));
    FL_CHECK(memcmp(fl_model_params_f32(&m), fl_model_params_f32(&m2), m.layout.numel * sizeof(float)) == 0);
    fl_model_free(&m2);
    /* index pointing at the wrong shard */
    char *q = strstr(idx, "\"model.norm.weight\": \"model-00002");
    FL_REQUIRE(q);
    q[strlen("\"model.norm.weight\": \"model-0000")] = '1';
    FL_REQUIRE(write_text(pj(d, "model.safetensors.index.json"), idx) == 0);
    FL_CHECK(fl_hf_load_model(&m2, d, NULL, &pool) == FL_ERR_FORMAT);
    CHECK_MSG("model.norm.weight");
    /* missing shard file */
    q[strlen("\"model.norm.weight\": \"model-0000")] = '2';
    FL_REQUIRE(write_text(pj(d, "model.safetensors.index.json"), idx) == 0);
    unlink(pj(d, "model-00002-of-00002.safetensors"));
    FL_CHECK(fl_hf_load_model(&m2, d, NULL, &pool) == FL_ERR_NOT_FOUND);
    CHECK_MSG("model-00002-of-00002.safetensors");
    free(idx);
    fl_model_free(&m);
    FL_CHECK(fl_mem_live_count(&pool) == 0);
    fl_mem_pool_free(&pool);
}

FL_TEST(weights_gpt2_variants) {
    /* GPT-2 files without the "transformer." prefix, with a tied lm_head
     * present and the attn.bias buffers: all accepted. */
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "io", 0));
    fl_model_config cfg = small_gpt2();
    fl_model m, m2;
    FL_REQUIRE_OK(fl_model_init(&m, &cfg, NULL, &pool));
    fill_random(&m, 9);
    const char *d = tdir();
    FL_REQUIRE_OK(fl_hf_save_config(pj(d, "config.json"), &cfg));
    static float mask[16 * 16];
    fl_st_write_tensor ex[3] = {
        {.name = "lm_head.weight", .ndim = 2, .shape = {cfg.vocab_size, cfg.dim}, .data = fl_model_param(&m, "transformer.wte.weight")},
        {.name = "h.0.attn.bias", .dtype = FL_U8, .src_dtype = FL_U8, .ndim = 4, .shape = {1, 1, 1, 3}, .data = mask},
        {.name = "h.1.attn.masked_bias", .ndim = 0, .data = mask}};
    FL_REQUIRE_OK(write_subset(&m, pj(d, "model.safetensors"), 0, m.layout.n, NULL, "transformer.", FL_F32, ex, 3));
    FL_REQUIRE_OK(fl_hf_load_model(&m2, d, NULL, &pool));
    FL_CHECK(memcmp(fl_model_params_f32(&m), fl_model_params_f32(&m2), m.layout.numel * sizeof(float)) == 0);
    fl_model_free(&m2);
    fl_model_free(&m);
    FL_CHECK(fl_mem_live_count(&pool) == 0);
    fl_mem_pool_free(&pool);
}

FL_TEST(save_leaves_nothing_on_failure) {
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "io", 0));
    fl_model_config cfg = small_llama();
    fl_model m;
    FL_REQUIRE_OK(fl_model_init(&m, &cfg, NULL, &pool));
    fill_random(&m, 1);
    const char *d = tdir();
    /* parent folder missing */
    FL_CHECK(fl_hf_save_model(&m, pj(d, "a/b")) == FL_ERR_IO);
    FL_CHECK(count_entries(d) == 0);
    /* target exists as a regular file: the final rename fails after the
     * files were written; the temp folder must be gone and the file intact */
    const char *f = pj(d, "target");
    FL_REQUIRE(write_text(f, "keep") == 0);
    FL_CHECK(fl_hf_save_model(&m, f) == FL_ERR_IO);
    CHECK_MSG(f);
    FL_CHECK(count_entries(d) == 1);
    struct stat sb;
    FL_CHECK(stat(f, &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_size == 4);
    fl_model_free(&m);
    fl_mem_pool_free(&pool);
}

/* ---- llama2.c --------------------------------------------------------------- */

/* Build a llama2.c v0 file for cfg with values = index (so the mapping can be
 * checked exactly). Returns the number of floats. */
static size_t write_llama2c(const char *path, const fl_model_config *c, int shared, size_t trunc_bytes) {
    size_t C = c->dim, F = c->ffn_dim, L = c->n_layers, V = c->vocab_size, HS = c->dim / c->n_heads;
    size_t KV = c->n_kv_heads * HS, T = c->max_seq;
    size_t n = V * C + L * (2 * C + 2 * C * C + 2 * KV * C + 3 * F * C) + C + T * HS + (shared ? 0 : V * C);
    int32_t h[7] = {c->dim, c->ffn_dim, c->n_layers, c->n_heads, c->n_kv_heads, shared ? c->vocab_size : -c->vocab_size, c->max_seq};
    size_t bytes = 28 + 4 * n;
    char *b = malloc(bytes);
    memcpy(b, h, 28);
    float *w = (float *)(b + 28);
    for (size_t i = 0; i < n; i++) w[i] = (float)i;
    write_bytes(path, b, bytes - trunc_bytes);
    free(b);
    return n;
}

FL_TEST(llama2c_synthetic) {
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "io", 0));
    fl_model_config c = small_llama();
    c.attention_bias = 0;
    const char *d = tdir();
    const char *p = pj(d, "m.bin");
    write_llama2c(p, &c, 0, 0);
    fl_model m;
    FL_REQUIRE_OK(fl_llama2c_load_model(&m, p, NULL, &pool));
    FL_CHECK(!m.cfg.tie_embeddings && m.cfg.n_kv_heads == 2 && m.cfg.norm_eps == 1e-5f && m.cfg.rope_theta == 10000.0f);
    size_t C = 16, V = 32, L = 2, KV = 8, F = 24, HD = 4;
    /* embedding is first */
    FL_CHECK(fl_model_param(&m, "model.embed_tokens.weight")[5] == 5.0f);
    /* wq of layer 1: rows permuted: hf row h*HD + t*HD/2 + i <- meta row h*HD + 2i + t */
    size_t wq0 = V * C + L * C;
    const float *q = fl_model_param(&m, "model.layers.1.self_attn.q_proj.weight");
    int ok = 1;
    for (size_t h = 0; h < 4; h++)
        for (size_t t = 0; t < 2; t++)
            for (size_t i = 0; i < HD / 2; i++)
                for (size_t col = 0; col < C; col++)
                    ok &= q[(h * HD + t * HD / 2 + i) * C + col] == (float)(wq0 + C * C + (h * HD + 2 * i + t) * C + col);
    FL_CHECK(ok);
    size_t wk0 = wq0 + L * C * C;
    const float *k = fl_model_param(&m, "model.layers.0.self_attn.k_proj.weight");
    FL_CHECK(k[(0 * HD + 1 * HD / 2 + 0) * C + 3] == (float)(wk0 + (0 * HD + 2 * 0 + 1) * C + 3));
    FL_CHECK(k[(1 * HD + 0 + 1) * C] == (float)(wk0 + (1 * HD + 2) * C));
    size_t w10 = V * C + L * C + L * C * C + 2 * L * KV * C + L * C * C + L * C;
    FL_CHECK(fl_model_param(&m, "model.layers.0.mlp.gate_proj.weight")[0] == (float)w10);
    FL_CHECK(fl_model_param(&m, "model.layers.0.mlp.down_proj.weight")[0] == (float)(w10 + L * F * C));
    FL_CHECK(fl_model_param(&m, "model.layers.0.mlp.up_proj.weight")[0] == (float)(w10 + L * F * C + L * C * F));
    size_t fin = w10 + 3 * L * F * C;
    FL_CHECK(fl_model_param(&m, "model.norm.weight")[0] == (float)fin);
    FL_CHECK(fl_model_param(&m, "lm_head.weight")[0] == (float)(fin + C + 32 * HD));
    fl_model_free(&m);
    /* truncated */
    write_llama2c(p, &c, 1, 6);
    FL_CHECK(fl_llama2c_load_model(&m, p, NULL, &pool) == FL_ERR_FORMAT);
    CHECK_MSG(p);
    CHECK_MSG("truncated");
    /* garbage header */
    FL_REQUIRE(write_text(p, "this is not a checkpoint at all, just text") == 0);
    FL_CHECK(fl_llama2c_load_model(&m, p, NULL, &pool) == FL_ERR_FORMAT);
    CHECK_MSG(p);
    FL_CHECK(fl_mem_live_count(&pool) == 0);
    fl_mem_pool_free(&pool);
}

FL_TEST(load_auto) {
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "io", 0));
    fl_model_config c = small_llama();
    const char *d = tdir();
    FL_REQUIRE_OK(fl_hf_save_config(pj(d, "config.json"), &c));
    fl_model m;
    int wl = -1;
    FL_REQUIRE_OK(fl_model_load_auto(&m, pj(d, "config.json"), NULL, &pool, &wl));
    FL_CHECK(wl == 0 && m.cfg.dim == 16);
    fl_model_free(&m);
    FL_CHECK(fl_model_load_auto(&m, d, NULL, &pool, &wl) == FL_ERR_NOT_FOUND); /* no weights */
    c.attention_bias = 0;
    write_llama2c(pj(d, "x.bin"), &c, 1, 0);
    FL_REQUIRE_OK(fl_model_load_auto(&m, pj(d, "x.bin"), NULL, &pool, &wl));
    FL_CHECK(wl == 1 && m.cfg.tie_embeddings);
    fl_model_free(&m);
    FL_CHECK(fl_model_load_auto(&m, pj(d, "nothing"), NULL, &pool, &wl) == FL_ERR_NOT_FOUND);
    FL_CHECK(fl_mem_live_count(&pool) == 0);
    fl_mem_pool_free(&pool);
}

/* ---- real data -------------------------------------------------------------- */

FL_TEST(real_stories260K_bin_matches_hf) {
    FL_SKIP_IF_NO_DATA();
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "io", 0));
    fl_model a, b;
    int wl = 0;
    FL_REQUIRE_OK(fl_model_load_auto(&a, fl_test_data_path("stories260K/stories260K.bin"), NULL, &pool, &wl));
    FL_CHECK(wl == 1);
    FL_REQUIRE_OK(fl_model_load_auto(&b, fl_test_data_path("stories260K-hf"), NULL, &pool, &wl));
    FL_CHECK(a.cfg.dim == 64 && a.cfg.ffn_dim == 172 && a.cfg.n_layers == 5 && a.cfg.n_heads == 8 && a.cfg.n_kv_heads == 4);
    FL_CHECK(a.cfg.vocab_size == 512 && a.cfg.max_seq == 512 && a.cfg.tie_embeddings);
    FL_CHECK(a.cfg.dim == b.cfg.dim && a.cfg.n_kv_heads == b.cfg.n_kv_heads && a.cfg.tie_embeddings == b.cfg.tie_embeddings);
    FL_REQUIRE(a.layout.numel == b.layout.numel && a.layout.n == b.layout.n);
    for (int k = 0; k < a.layout.n; k++) {
        const fl_param_info *p = &a.layout.params[k];
        size_t worst = 0;
        double e = fl_test_max_rel_err(fl_model_params_f32(&a) + p->offset, fl_model_params_f32(&b) + p->offset, p->numel, 1e-3, &worst);
        FL_CHECKF(e <= 1e-6, "%s differs (rel err %g at %zu)", p->name, e, worst);
    }
    FL_CHECK(memcmp(fl_model_params_f32(&a), fl_model_params_f32(&b), a.layout.numel * sizeof(float)) == 0);
    /* the check has teeth: HF q row 4 is Meta row 1 (head 0, pair 0, odd half) */
    FILE *f = fopen(fl_test_data_path("stories260K/stories260K.bin"), "rb");
    FL_REQUIRE(f);
    float meta[2 * 64];
    long wq0 = 28 + 4L * (512 * 64 + 5 * 64); /* header, embeddings, rms_att */
    FL_REQUIRE(fseek(f, wq0, SEEK_SET) == 0 && fread(meta, sizeof(float), 128, f) == 128);
    fclose(f);
    const float *qb = fl_model_param(&b, "model.layers.0.self_attn.q_proj.weight");
    FL_CHECK(memcmp(qb + 4 * 64, meta + 64, 64 * sizeof(float)) == 0);
    FL_CHECK(memcmp(qb + 1 * 64, meta + 64, 64 * sizeof(float)) != 0);
    fl_model_free(&a);
    fl_model_free(&b);
    FL_CHECK(fl_mem_live_count(&pool) == 0);
    fl_mem_pool_free(&pool);
}

FL_TEST(real_stories260K_truncated) {
    FL_SKIP_IF_NO_DATA();
    const char *src = fl_test_data_path("stories260K/stories260K.bin");
    FILE *f = fopen(src, "rb");
    FL_REQUIRE(f);
    char *b = malloc(1 << 21);
    size_t n = fread(b, 1, 1 << 21, f);
    fclose(f);
    const char *p = pj(tdir(), "t.bin");
    FL_REQUIRE(write_bytes(p, b, n - 100) == 0);
    free(b);
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "io", 0));
    fl_model m;
    FL_CHECK(fl_llama2c_load_model(&m, p, NULL, &pool) == FL_ERR_FORMAT);
    char want[64];
    snprintf(want, sizeof want, "expected %zu bytes", n);
    CHECK_MSG(want);
    CHECK_MSG("truncated");
    FL_CHECK(fl_mem_live_count(&pool) == 0);
    fl_mem_pool_free(&pool);
}

FL_TEST(real_tiny_gpt2) {
    FL_SKIP_IF_NO_DATA();
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "io", 0));
    const char *dir = fl_test_data_path("tiny-gpt2-hf");
    fl_model m;
    FL_REQUIRE_OK(fl_hf_load_model(&m, dir, NULL, &pool));
    FL_CHECK(m.cfg.arch == FL_ARCH_GPT2 && m.cfg.dim == 16 && m.cfg.n_layers == 1 && m.cfg.vocab_size == 50257);
    FL_CHECK(m.cfg.max_seq == 256 && m.cfg.ffn_dim == 64 && m.cfg.tie_embeddings);
    fl_st_file st;
    FL_REQUIRE_OK(fl_st_open(&st, pj(dir, "model.safetensors")));
    const fl_st_tensor *t = fl_st_find(&st, "transformer.h.0.attn.c_attn.weight");
    FL_REQUIRE(t && t->shape[0] == 16 && t->shape[1] == 48);
    const float *fw = t->data, *w = fl_model_param(&m, "transformer.h.0.attn.c_attn.weight");
    int ok = 1;
    for (int o = 0; o < 48; o++)
        for (int i = 0; i < 16; i++) ok &= w[o * 16 + i] == fw[i * 48 + o];
    FL_CHECK(ok);
    FL_CHECK(w[5 * 16 + 3] == fw[3 * 48 + 5] && w[5 * 16 + 3] != fw[5 * 48 + 3]);
    t = fl_st_find(&st, "transformer.wte.weight");
    FL_CHECK(memcmp(t->data, fl_model_param(&m, "transformer.wte.weight"), 50257 * 16 * sizeof(float)) == 0);
    fl_st_close(&st);
    /* save + reload round trip of a real checkpoint */
    const char *out = pj(tdir(), "copy");
    FL_REQUIRE_OK(fl_hf_save_model(&m, out));
    fl_model m2;
    FL_REQUIRE_OK(fl_hf_load_model(&m2, out, NULL, &pool));
    FL_CHECK(memcmp(fl_model_params_f32(&m), fl_model_params_f32(&m2), m.layout.numel * sizeof(float)) == 0);
    fl_model_free(&m2);
    fl_model_free(&m);
    FL_CHECK(fl_mem_live_count(&pool) == 0);
    fl_mem_pool_free(&pool);
}

/* transformers 5 writes rope_theta and the scaling inside "rope_parameters". */
FL_TEST(config_llama_rope_parameters_v5) {
    const char *d = tdir();
    const char *p = pj(d, "config.json");
    FL_REQUIRE(write_text(p, "{\"model_type\": \"llama\", \"hidden_size\": 16, \"intermediate_size\": 24,"
                             " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"vocab_size\": 32,"
                             " \"max_position_embeddings\": 32, \"rms_norm_eps\": 1e-05,"
                             " \"rope_parameters\": {\"rope_theta\": 500000.0, \"rope_type\": \"llama3\", \"factor\": 32.0,"
                             " \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0,"
                             " \"original_max_position_embeddings\": 8192}}") == 0);
    fl_model_config c;
    FL_REQUIRE_OK(fl_hf_load_config(p, &c));
    FL_CHECK(c.rope_theta == 500000.0f && c.rope_scaling.type == FL_ROPE_LLAMA3 && c.rope_scaling.factor == 32.0f);
    FL_CHECK(c.rope_scaling.original_max_position == 8192);
    FL_REQUIRE(write_text(p, "{\"model_type\": \"llama\", \"hidden_size\": 16, \"intermediate_size\": 24,"
                             " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"vocab_size\": 32,"
                             " \"max_position_embeddings\": 32, \"rms_norm_eps\": 1e-05,"
                             " \"rope_parameters\": {\"rope_theta\": 20000.0, \"rope_type\": \"default\"}}") == 0);
    FL_REQUIRE_OK(fl_hf_load_config(p, &c));
    FL_CHECK(c.rope_theta == 20000.0f && c.rope_scaling.type == FL_ROPE_NONE);
}

/* Saving above the shard size writes model-0000i-of-0000N.safetensors and an
 * index that loads back to the same parameters. */
FL_TEST(weights_save_sharded_roundtrip) {
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 1));
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "cpu", 0));
    fl_model_config c;
    FL_REQUIRE_OK(fl_preset_find("micro", &c));
    fl_model a, b;
    FL_REQUIRE_OK(fl_model_init(&a, &c, &be, &pool));
    fl_model_init_random(&a, 3);
    char dir[600];
    snprintf(dir, sizeof dir, "%s/sharded", fl_test_tmpdir());
    fl_hf_set_max_shard_bytes(300000); /* ~1 MB of weights -> 4 shards */
    fl_status s = fl_hf_save_model(&a, dir);
    fl_hf_set_max_shard_bytes(0);
    FL_REQUIRE_OK(s);
    char p[700];
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    FILE *f = fopen(p, "r");
    FL_REQUIRE(f != NULL);
    fclose(f);
    snprintf(p, sizeof p, "%s/model-00004-of-00004.safetensors", dir);
    f = fopen(p, "r");
    FL_CHECK(f != NULL);
    if (f) fclose(f);
    FL_REQUIRE_OK(fl_hf_load_model(&b, dir, &be, &pool));
    FL_CHECK(b.layout.numel == a.layout.numel && memcmp(fl_model_params_f32(&a), fl_model_params_f32(&b), a.layout.numel * 4) == 0);
    fl_model_free(&a);
    fl_model_free(&b);
    fl_mem_pool_free(&pool);
    fl_cpu_backend_free(&be);
}

/* Tokenizer tests: the llama.cpp vectors (HF ids for LLaMA-2 and GPT-2)
 * through tokenizer.json, tokenizer.model and encoder.json-free paths, decode
 * round trips, hard cases from tests/fixtures/tokenizer-hard-cases.json
 * (written by tests/ref/tokenizer_ref.py with HF tokenizers), llama2.c .bin vs
 * tokenizer.json, BOS/EOS, and bad inputs. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/json.h"
#include "fitllm/tokenizer.h"
#include "test.h"
#include "tokenizer/tok-impl.h"

static void write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (f) { fwrite(data, 1, n, f); fclose(f); }
}

typedef struct {
    int n;
    char *inp[64];
    size_t inp_n[64];
    int32_t *ids[64];
    size_t n_ids[64];
    char *buf_inp, *buf_out;
} vectors;

/* Strings are separated by "\n__ggml_vocab_test__\n" (each string also ends
 * before that newline); outputs are one line of space-separated ids each. */
static int load_vectors(vectors *v, const char *name) {
    char rel[128];
    size_t ni, no;
    memset(v, 0, sizeof *v);
    snprintf(rel, sizeof rel, "tokenizer-vectors/%s.inp", name);
    v->buf_inp = fl_test_slurp(fl_test_data_path(rel), &ni);
    snprintf(rel, sizeof rel, "tokenizer-vectors/%s.out", name);
    v->buf_out = fl_test_slurp(fl_test_data_path(rel), &no);
    if (!v->buf_inp || !v->buf_out) return -1;
    static const char sep[] = "\n__ggml_vocab_test__\n";
    char *p = v->buf_inp, *end = v->buf_inp + ni;
    while (p < end && v->n < 64) {
        char *q = strstr(p, sep);
        if (!q) break;
        v->inp[v->n] = p;
        v->inp_n[v->n] = (size_t)(q - p);
        *q = 0;
        v->n++;
        p = q + sizeof sep - 1;
    }
    char *line = v->buf_out;
    for (int i = 0; i < v->n; i++) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = 0;
        v->ids[i] = malloc(256 * sizeof(int32_t));
        v->n_ids[i] = 0;
        char *tok = line, *e;
        for (;;) {
            long x = strtol(tok, &e, 10);
            if (e == tok) break;
            v->ids[i][v->n_ids[i]++] = (int32_t)x;
            tok = e;
        }
        line = nl ? nl + 1 : line + strlen(line);
    }
    return 0;
}

static void free_vectors(vectors *v) {
    for (int i = 0; i < v->n; i++) free(v->ids[i]);
    free(v->buf_inp);
    free(v->buf_out);
}

static void print_ids(const char *what, const int32_t *ids, size_t n) {
    fprintf(stderr, "    %s:", what);
    for (size_t i = 0; i < n && i < 64; i++) fprintf(stderr, " %d", (int)ids[i]);
    fprintf(stderr, "\n");
}

/* Encode every vector, compare ids exactly; optionally check the decode round trip. */
static int check_vectors(const char *tok_rel, const char *vec, int roundtrip) {
    vectors v;
    fl_tokenizer *t = NULL;
    if (load_vectors(&v, vec)) { fl_test_fail(__FILE__, __LINE__, "cannot read vectors %s", vec); return 0; }
    fl_status s = fl_tok_load(&t, fl_test_data_path(tok_rel));
    if (s != FL_OK) {
        fl_test_fail(__FILE__, __LINE__, "load %s: %s", tok_rel, fl_error_message());
        free_vectors(&v);
        return 0;
    }
    int ok = 0;
    for (int i = 0; i < v.n; i++) {
        int32_t *ids = NULL;
        size_t n = 0;
        s = fl_tok_encode(t, v.inp[i], v.inp_n[i], 0, 0, &ids, &n);
        int same = s == FL_OK && n == v.n_ids[i] && (n == 0 || !memcmp(ids, v.ids[i], n * sizeof *ids));
        if (!same) {
            fl_test_fail(__FILE__, __LINE__, "%s via %s: vector %d (\"%.40s\") ids differ", vec, tok_rel, i, v.inp[i]);
            print_ids("got ", ids, n);
            print_ids("want", v.ids[i], v.n_ids[i]);
        }
        if (same && roundtrip) {
            char *txt = NULL;
            size_t tl = 0;
            s = fl_tok_decode(t, ids, n, 1, &txt, &tl);
            if (s != FL_OK || tl != v.inp_n[i] || memcmp(txt, v.inp[i], tl)) {
                fl_test_fail(__FILE__, __LINE__, "%s via %s: vector %d decode round trip: \"%s\"", vec, tok_rel, i, txt ? txt : "(null)");
                same = 0;
            }
            free(txt);
        }
        ok += same;
        free(ids);
    }
    fprintf(stderr, "    %s via %s: %d/%d exact\n", vec, tok_rel, ok, v.n);
    fl_tok_free(t);
    free_vectors(&v);
    return ok;
}

FL_TEST(tok_llama_vectors_json) {
    FL_SKIP_IF_NO_DATA();
    FL_CHECK(check_vectors("llama2-tokenizer/tokenizer.json", "llama-spm", 1) == 46);
}

FL_TEST(tok_llama_vectors_model) {
    FL_SKIP_IF_NO_DATA();
    FL_CHECK(check_vectors("llama2-tokenizer/tokenizer.model", "llama-spm", 1) == 46);
}

FL_TEST(tok_gpt2_vectors_json) {
    FL_SKIP_IF_NO_DATA();
    FL_CHECK(check_vectors("gpt2-tokenizer/tokenizer.json", "gpt-2", 1) == 46);
    FL_CHECK(check_vectors("tiny-gpt2-hf/tokenizer.json", "gpt-2", 1) == 46);
}

static int ids_eq(const int32_t *a, size_t na, const fl_json *want) {
    if (!want || want->type != FL_JSON_ARRAY || want->len != na) return 0;
    size_t i = 0;
    for (const fl_json *c = want->child; c; c = c->next, i++)
        if (c->i != a[i]) return 0;
    return 1;
}

/* Hard cases from HF tokenizers (tests/ref/tokenizer_ref.py). via_model: use
 * llama2-tokenizer/tokenizer.model for the llama2-tokenizer cases. */
static void run_hard_cases(int via_model) {
    fl_json *root = NULL;
    const char *fx = "tests/fixtures/tokenizer-hard-cases.json";
    FL_REQUIRE_OK(fl_json_parse_file(fx, &root));
    const fl_json *cases = fl_json_get(root, "cases");
    FL_REQUIRE(cases && cases->type == FL_JSON_ARRAY && cases->len > 50);
    char cur[64] = "";
    fl_tokenizer *t = NULL;
    int n_ok = 0, n_run = 0;
    for (const fl_json *c = cases->child; c; c = c->next) {
        const char *name = fl_json_get(c, "tokenizer")->str;
        const fl_json *text = fl_json_get(c, "text");
        if (via_model && strcmp(name, "llama2-tokenizer")) continue;
        /* sentencepiece never matches control pieces in text */
        if (via_model && (strstr(text->str, "<s>") || strstr(text->str, "</s>") || strstr(text->str, "<unk>"))) continue;
        if (strcmp(cur, name)) {
            fl_tok_free(t);
            t = NULL;
            char rel[128];
            snprintf(rel, sizeof rel, "%s%s", name, via_model ? "/tokenizer.model" : "");
            fl_status s = fl_tok_load(&t, fl_test_data_path(rel));
            if (s != FL_OK) { fl_test_fail(__FILE__, __LINE__, "load %s: %s", rel, fl_error_message()); break; }
            snprintf(cur, sizeof cur, "%s", name);
        }
        n_run++;
        int32_t *ids = NULL, *ids2 = NULL;
        size_t n = 0, n2 = 0;
        char *d1 = NULL, *d2 = NULL;
        size_t l1 = 0, l2 = 0;
        int ok = fl_tok_encode(t, text->str, text->len, 0, 0, &ids, &n) == FL_OK && ids_eq(ids, n, fl_json_get(c, "ids"));
        ok = ok && fl_tok_encode(t, text->str, text->len, -1, -1, &ids2, &n2) == FL_OK &&
             ids_eq(ids2, n2, fl_json_get(c, "ids_special"));
        const fl_json *w1 = fl_json_get(c, "decoded"), *w2 = fl_json_get(c, "decoded_skip");
        ok = ok && fl_tok_decode(t, ids2, n2, 0, &d1, &l1) == FL_OK && l1 == w1->len && !memcmp(d1, w1->str, l1);
        ok = ok && fl_tok_decode(t, ids2, n2, 1, &d2, &l2) == FL_OK && l2 == w2->len && !memcmp(d2, w2->str, l2);
        if (!ok) {
            fl_test_fail(__FILE__, __LINE__, "%s%s: \"%.40s\"", name, via_model ? " (.model)" : "", text->str);
            print_ids("got ", ids, n);
            print_ids("got+special", ids2, n2);
            fprintf(stderr, "    decoded: \"%s\" / \"%s\"; want \"%s\" / \"%s\"\n", d1 ? d1 : "", d2 ? d2 : "", w1->str, w2->str);
        }
        n_ok += ok;
        free(ids);
        free(ids2);
        free(d1);
        free(d2);
    }
    fprintf(stderr, "    hard cases%s: %d/%d\n", via_model ? " via tokenizer.model" : "", n_ok, n_run);
    fl_tok_free(t);
    fl_json_free(root);
}

FL_TEST(tok_hard_cases_json) {
    FL_SKIP_IF_NO_DATA();
    run_hard_cases(0);
}

FL_TEST(tok_hard_cases_model) {
    FL_SKIP_IF_NO_DATA();
    run_hard_cases(1);
}

FL_TEST(tok_llama2c_bin_matches_json) {
    FL_SKIP_IF_NO_DATA();
    fl_tokenizer *a = NULL, *b = NULL;
    FL_REQUIRE_OK(fl_tok_load(&a, fl_test_data_path("stories260K/tok512.bin")));
    fl_status s = fl_tok_load(&b, fl_test_data_path("stories260K-hf/tokenizer.json"));
    if (s != FL_OK) { fl_tok_free(a); FL_REQUIRE_OK(s); }
    FL_CHECK(!strcmp(fl_tok_kind(a), "llama2c"));
    FL_CHECK(fl_tok_vocab_size(a) == 512 && fl_tok_vocab_size(b) == 512);
    FL_CHECK(fl_tok_bos_id(a) == 1 && fl_tok_eos_id(a) == 2);
    size_t n;
    char *text = fl_test_slurp(fl_test_data_path("text/tinystories-val-prefix.txt"), &n);
    FL_REQUIRE(text);
    /* line by line over the first 200 lines, then one 20 KB chunk */
    char *p = text;
    int lines = 0, same = 0;
    for (; lines < 200 && p < text + n; lines++) {
        char *nl = memchr(p, '\n', (size_t)(text + n - p));
        size_t len = nl ? (size_t)(nl - p) : (size_t)(text + n - p);
        int32_t *x = NULL, *y = NULL;
        size_t nx = 0, ny = 0;
        if (fl_tok_encode(a, p, len, -1, 0, &x, &nx) == FL_OK && fl_tok_encode(b, p, len, -1, 0, &y, &ny) == FL_OK &&
            nx == ny && !memcmp(x, y, nx * sizeof *x)) {
            same++;
            char *d = NULL;
            size_t dl;
            if (fl_tok_decode(a, x, nx, 1, &d, &dl) != FL_OK || dl != len || memcmp(d, p, len)) {
                fl_test_fail(__FILE__, __LINE__, "llama2.c decode round trip, line %d", lines);
                same--;
            }
            free(d);
        } else
            fl_test_fail(__FILE__, __LINE__, "tok512.bin vs tokenizer.json differ on line %d: \"%.60s\"", lines, p);
        free(x);
        free(y);
        p = nl ? nl + 1 : text + n;
    }
    FL_CHECK(same == lines);
    int32_t *x = NULL, *y = NULL;
    size_t nx = 0, ny = 0;
    size_t chunk = n < 20000 ? n : 20000;
    FL_CHECK(fl_tok_encode(a, text, chunk, 1, 1, &x, &nx) == FL_OK);
    FL_CHECK(fl_tok_encode(b, text, chunk, 1, 1, &y, &ny) == FL_OK);
    FL_CHECK(nx == ny && nx > 1000 && !memcmp(x, y, nx * sizeof *x));
    FL_CHECK(x && x[0] == 1 && x[nx - 1] == 2);
    free(x);
    free(y);
    free(text);
    fl_tok_free(a);
    fl_tok_free(b);
}

static void expect_ids(fl_tokenizer *t, const char *s, size_t n, const int32_t *want, size_t nw, const char *what) {
    int32_t *ids = NULL;
    size_t ni = 0;
    fl_status st = fl_tok_encode(t, s, n, 0, 0, &ids, &ni);
    int ok = st == FL_OK && ni == nw && (nw == 0 || !memcmp(ids, want, nw * sizeof *ids));
    if (!ok) {
        fl_test_fail(__FILE__, __LINE__, "%s: ids differ (%s)", what, st == FL_OK ? "" : fl_error_message());
        print_ids("got ", ids, ni);
        print_ids("want", want, nw);
    }
    free(ids);
}

static void expect_decode(fl_tokenizer *t, const int32_t *ids, size_t n, const char *want, const char *what) {
    char *d = NULL;
    size_t l = 0;
    fl_status st = fl_tok_decode(t, ids, n, 1, &d, &l);
    FL_CHECKF(st == FL_OK && l == strlen(want) && !memcmp(d, want, l), "%s: decoded \"%s\", want \"%s\"", what, d ? d : "", want);
    free(d);
}

/* Invalid UTF-8 cannot reach HF tokenizers (Python str). We encode the raw
 * bytes losslessly: byte-level BPE maps each byte to its byte-level char;
 * SentencePiece-style emits <0xNN>. Decoding follows HF: invalid sequences
 * become U+FFFD (ByteLevel: from_utf8_lossy; ByteFallback: one per byte token). */
FL_TEST(tok_invalid_utf8) {
    FL_SKIP_IF_NO_DATA();
    fl_tokenizer *ll = NULL, *g = NULL, *m = NULL;
    FL_REQUIRE_OK(fl_tok_load(&ll, fl_test_data_path("llama2-tokenizer/tokenizer.json")));
    FL_REQUIRE_OK(fl_tok_load(&m, fl_test_data_path("llama2-tokenizer/tokenizer.model")));
    FL_REQUIRE_OK(fl_tok_load(&g, fl_test_data_path("gpt2-tokenizer/tokenizer.json")));
    const int32_t w1[] = {29871, 258}; /* "▁", <0xFF> */
    expect_ids(ll, "\xff", 1, w1, 2, "llama json \\xff");
    expect_ids(m, "\xff", 1, w1, 2, "llama model \\xff");
    const int32_t w2[] = {29871, 231, 192, 263}; /* truncated U+4F60, then "▁a" */
    expect_ids(ll, "\xe4\xbd a", 4, w2, 4, "llama json truncated CJK");
    expect_ids(m, "\xe4\xbd a", 4, w2, 4, "llama model truncated CJK");
    expect_decode(ll, w1, 2, "\xef\xbf\xbd", "llama decode <0xFF>");
    expect_decode(ll, w2, 4, "\xef\xbf\xbd\xef\xbf\xbd a", "llama decode truncated CJK");
    /* GPT-2: 'a' \xff 'b' -> a, ÿ (byte 0xFF's byte-level char), b */
    int32_t a = fl_tok_lookup(g, "a", 1), y = fl_tok_lookup(g, "\xc3\xbf", 2), b = fl_tok_lookup(g, "b", 1);
    const int32_t w3[] = {a, y, b};
    expect_ids(g, "a\xff" "b", 3, w3, 3, "gpt2 a\\xffb");
    expect_decode(g, w3, 3, "a\xef\xbf\xbd" "b", "gpt2 decode a\\xffb");
    /* a lone continuation byte, an overlong NUL, a surrogate */
    const char *bad[] = {"\x80", "\xc0\x80", "\xed\xa0\x80", "ok\xf4\x90\x80\x80!"};
    for (int i = 0; i < 4; i++) {
        int32_t *ids = NULL;
        size_t n = 0;
        FL_CHECK(fl_tok_encode(g, bad[i], strlen(bad[i]), 0, 0, &ids, &n) == FL_OK && n >= 1);
        free(ids);
        FL_CHECK(fl_tok_encode(ll, bad[i], strlen(bad[i]), 0, 0, &ids, &n) == FL_OK && n >= 2);
        free(ids);
    }
    fl_tok_free(ll);
    fl_tok_free(m);
    fl_tok_free(g);
}

FL_TEST(tok_builtin_bytes) {
    fl_tokenizer *t = NULL;
    FL_REQUIRE_OK(fl_tok_builtin_bytes(&t));
    FL_CHECK(fl_tok_vocab_size(t) == 258 && fl_tok_bos_id(t) == 256 && fl_tok_eos_id(t) == 257);
    FL_CHECK(fl_tok_is_eos(t, 257) && !fl_tok_is_eos(t, 256) && !strcmp(fl_tok_kind(t), "bytes"));
    const char s[] = "h\xc3\xa9\xff\0z";
    int32_t *ids = NULL;
    size_t n = 0;
    FL_REQUIRE_OK(fl_tok_encode(t, s, 6, 1, 1, &ids, &n));
    FL_CHECK(n == 8 && ids[0] == 256 && ids[1] == 'h' && ids[2] == 0xc3 && ids[4] == 0xff && ids[5] == 0 && ids[7] == 257);
    char *d = NULL;
    size_t l = 0;
    FL_REQUIRE_OK(fl_tok_decode(t, ids, n, 1, &d, &l));
    FL_CHECK(l == 6 && !memcmp(d, s, 6));
    free(d);
    FL_REQUIRE_OK(fl_tok_decode(t, ids, n, 0, &d, &l));
    FL_CHECK(l == 16 && !memcmp(d, "<bos>h", 6));
    free(d);
    free(ids);
    FL_REQUIRE_OK(fl_tok_encode(t, NULL, 0, 0, 0, &ids, &n));
    FL_CHECK(n == 0 && ids != NULL);
    free(ids);
    fl_tok_free(t);
}

FL_TEST(tok_bos_eos_config) {
    FL_SKIP_IF_NO_DATA();
    fl_tokenizer *t = NULL;
    int32_t *ids = NULL;
    size_t n = 0;
    FL_REQUIRE_OK(fl_tok_load(&t, fl_test_data_path("llama2-tokenizer")));
    FL_CHECK(!strcmp(fl_tok_kind(t), "bpe-sentencepiece") && fl_tok_bos_id(t) == 1 && fl_tok_eos_id(t) == 2);
    FL_REQUIRE_OK(fl_tok_encode(t, "Hi", 2, -1, -1, &ids, &n));
    FL_CHECK(n >= 2 && ids[0] == 1 && ids[n - 1] != 2);
    free(ids);
    FL_REQUIRE_OK(fl_tok_encode(t, "Hi", 2, 0, 1, &ids, &n));
    FL_CHECK(n >= 1 && ids[0] != 1 && ids[n - 1] == 2);
    free(ids);
    fl_tok_free(t);
    FL_REQUIRE_OK(fl_tok_load(&t, fl_test_data_path("llama2-tokenizer/tokenizer.model")));
    FL_CHECK(!strcmp(fl_tok_kind(t), "spm-model") && fl_tok_bos_id(t) == 1 && fl_tok_eos_id(t) == 2 && fl_tok_vocab_size(t) == 32000);
    fl_tok_free(t);
    FL_REQUIRE_OK(fl_tok_load(&t, fl_test_data_path("tiny-gpt2-hf")));
    FL_CHECK(!strcmp(fl_tok_kind(t), "bpe-bytelevel") && fl_tok_bos_id(t) == 50256 && fl_tok_eos_id(t) == 50256);
    FL_REQUIRE_OK(fl_tok_encode(t, "Hi", 2, -1, -1, &ids, &n));
    FL_CHECK(n == 1 && ids[0] != 50256); /* GPT-2 adds nothing by default */
    free(ids);
    fl_tok_free(t);

    /* a folder with tokenizer_config.json ({"content"} form, add_eos) and config.json (eos list) */
    const char *dir = fl_test_tmpdir();
    char p[512], q[512];
    size_t sn;
    char *seed = fl_test_slurp("fuzz/seeds-tok/sp.json", &sn);
    FL_REQUIRE(seed);
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    write_file(p, seed, sn);
    free(seed);
    snprintf(q, sizeof q, "%s/tokenizer_config.json", dir);
    const char *tc = "{\"add_bos_token\": false, \"add_eos_token\": true, \"eos_token\": {\"content\": \"</s>\", \"lstrip\": false}}";
    write_file(q, tc, strlen(tc));
    snprintf(q, sizeof q, "%s/config.json", dir);
    const char *cc = "{\"bos_token_id\": 1, \"eos_token_id\": [2, 0]}";
    write_file(q, cc, strlen(cc));
    FL_REQUIRE_OK(fl_tok_load(&t, dir));
    FL_CHECK(fl_tok_eos_id(t) == 2 && fl_tok_is_eos(t, 0) && fl_tok_is_eos(t, 2) && !fl_tok_is_eos(t, 1));
    FL_REQUIRE_OK(fl_tok_encode(t, "Hello world", 11, -1, -1, &ids, &n));
    FL_CHECK(n >= 2 && ids[0] != 1 && ids[n - 1] == 2);
    char *d = NULL;
    size_t l;
    FL_REQUIRE_OK(fl_tok_decode(t, ids, n, 1, &d, &l));
    FL_CHECKF(!strcmp(d, "Hello world"), "decoded \"%s\"", d);
    free(d);
    free(ids);
    fl_tok_free(t);
}

static void expect_load_error(const char *path, fl_status want, const char *needle) {
    fl_tokenizer *t = NULL;
    fl_status s = fl_tok_load(&t, path);
    FL_CHECKF(s == want && t == NULL, "%s: got %s (%s), want %s", path, fl_status_name(s), fl_error_message(), fl_status_name(want));
    FL_CHECKF(strstr(fl_error_message(), needle) != NULL, "%s: message \"%s\" lacks \"%s\"", path, fl_error_message(), needle);
    fl_tok_free(t);
}

static const char *tmpfile_with(const char *name, const void *data, size_t n) {
    static char p[512];
    snprintf(p, sizeof p, "%s/%s", fl_test_tmpdir(), name);
    write_file(p, data, n);
    return p;
}

FL_TEST(tok_bad_inputs) {
    expect_load_error("/nonexistent/tok", FL_ERR_NOT_FOUND, "/nonexistent/tok");
    expect_load_error(fl_test_tmpdir(), FL_ERR_NOT_FOUND, "no tokenizer found");
    const char *trunc = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0";
    expect_load_error(tmpfile_with("trunc.json", trunc, strlen(trunc)), FL_ERR_FORMAT, "trunc.json");
    const char *wp = "{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}}}";
    expect_load_error(tmpfile_with("wp.json", wp, strlen(wp)), FL_ERR_UNSUPPORTED, "WordPiece");
    const char *nf = "{\"normalizer\": {\"type\": \"NFKC\"}, \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}";
    expect_load_error(tmpfile_with("nf.json", nf, strlen(nf)), FL_ERR_UNSUPPORTED, "NFKC");
    const char *pt = "{\"pre_tokenizer\": {\"type\": \"Whitespace\"}, \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}";
    expect_load_error(tmpfile_with("pt.json", pt, strlen(pt)), FL_ERR_UNSUPPORTED, "Whitespace");
    const char *dc = "{\"decoder\": {\"type\": \"WordPiece\"}, \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}";
    expect_load_error(tmpfile_with("dc.json", dc, strlen(dc)), FL_ERR_UNSUPPORTED, "WordPiece");
    const char *mg = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": [\"a b\"]}}";
    expect_load_error(tmpfile_with("mg.json", mg, strlen(mg)), FL_ERR_FORMAT, "merged token not in the vocabulary");
    const char *mg2 = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"a\"]}}";
    expect_load_error(tmpfile_with("mg2.json", mg2, strlen(mg2)), FL_ERR_FORMAT, "mg2.json");
    const char *neg = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": -3}, \"merges\": []}}";
    expect_load_error(tmpfile_with("neg.json", neg, strlen(neg)), FL_ERR_FORMAT, "neg.json");
    const char *cfg = "{}";
    expect_load_error(tmpfile_with("tokenizer_config.json", cfg, 2), FL_ERR_INVALID, "not a tokenizer");
    expect_load_error(tmpfile_with("x.txt", "hi", 2), FL_ERR_UNSUPPORTED, "x.txt");
    /* SentencePiece: garbage, truncated real model, a WORD model (UNIGRAM is supported since issue 31:
     * tests/test_tok_unigram.c; a UNIGRAM model without <unk> is refused there) */
    expect_load_error(tmpfile_with("garbage.model", "\xff\xff\xff", 3), FL_ERR_FORMAT, "garbage.model");
    static const uint8_t word[] = {0x0a, 0x08, 0x0a, 0x01, 'a', 0x15, 0, 0, 0, 0, /* piece "a" score 0 */
                                   0x12, 0x02, 0x18, 0x03};                         /* trainer_spec model_type=3 */
    expect_load_error(tmpfile_with("word.model", word, sizeof word), FL_ERR_UNSUPPORTED, "WORD");
    if (fl_test_data_dir()) {
        size_t n;
        char *m = fl_test_slurp(fl_test_data_path("llama2-tokenizer/tokenizer.model"), &n);
        FL_REQUIRE(m);
        expect_load_error(tmpfile_with("trunc.model", m, 1001), FL_ERR_FORMAT, "trunc.model");
        for (size_t cut = 7; cut < 20000; cut = cut * 3 + 1) { /* never a crash at any cut */
            fl_tokenizer *t = NULL;
            fl_status s = fl_tok_load(&t, tmpfile_with("cut.model", m, cut));
            FL_CHECK(s != FL_OK && t == NULL);
        }
        free(m);
        char *b = fl_test_slurp(fl_test_data_path("stories260K/tok512.bin"), &n);
        FL_REQUIRE(b);
        expect_load_error(tmpfile_with("tok_trunc.bin", b, n - 3), FL_ERR_FORMAT, "tok_trunc.bin");
        expect_load_error(tmpfile_with("tok_tiny.bin", b, 2), FL_ERR_FORMAT, "tok_tiny.bin");
        free(b);
    }
    /* API misuse */
    fl_tokenizer *t = NULL;
    FL_CHECK(fl_tok_load(NULL, "x") == FL_ERR_INVALID);
    FL_CHECK(fl_tok_load(&t, NULL) == FL_ERR_INVALID);
    fl_tok_free(NULL);
}

/* The whitespace-run cut (ws_split) is an exact speed-up: same ids as one long word. */
FL_TEST(tok_ws_split_exact) {
    FL_SKIP_IF_NO_DATA();
    const char *paths[] = {"llama2-tokenizer/tokenizer.json", "llama2-tokenizer/tokenizer.model", "stories260K/tok512.bin"};
    size_t n;
    char *text = fl_test_slurp(fl_test_data_path("text/tinyshakespeare.txt"), &n);
    FL_REQUIRE(text);
    size_t len = n < 60000 ? n : 60000;
    for (int k = 0; k < 3; k++) {
        fl_tokenizer *t = NULL;
        FL_REQUIRE_OK(fl_tok_load(&t, fl_test_data_path(paths[k])));
        FL_CHECKF(t->ws_split_n > 0, "%s: ws_split not enabled", paths[k]);
        int32_t *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        FL_CHECK(fl_tok_encode(t, text, len, 0, 0, &a, &na) == FL_OK);
        size_t saved = t->ws_split_n;
        t->ws_split_n = 0;
        FL_CHECK(fl_tok_encode(t, text, len, 0, 0, &b, &nb) == FL_OK);
        t->ws_split_n = saved;
        FL_CHECKF(na == nb && na > 10000 && !memcmp(a, b, na * sizeof *a), "%s: cut vs whole differ", paths[k]);
        free(a);
        free(b);
        fl_tok_free(t);
    }
    free(text);
}

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

static char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)sz + 1);
    if (b && fread(b, 1, (size_t)sz, f) != (size_t)sz) { free(b); b = NULL; }
    fclose(f);
    if (b) b[sz] = 0, *n = (size_t)sz;
    return b;
}

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
    v->buf_inp = slurp(fl_test_data_path(rel), &ni);
    snprintf(rel, sizeof rel, "tokenizer-vectors/%s.out", name);
    v->buf_out = slurp(fl_test_data_path(rel), &no);
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

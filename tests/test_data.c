/* Datasets and the micro-batch loader: LitGPT parity (prompt, SFT ids/labels,
 * random_split) against tests/fixtures/alpaca-ref.json (tests/ref/alpaca_ref.py),
 * layouts, TextFiles, Synthetic, the cache, the loader, and bad inputs. */
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data/data-impl.h"
#include "fitllm/data.h"
#include "fitllm/json.h"
#include "fitllm/tokenizer.h"
#include "test.h"

#define REF_FIXTURE "tests/fixtures/alpaca-ref.json"

static const char *write_file(const char *dir, const char *name, const char *text, size_t n) {
    static char buf[8][4200];
    static int k;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/%s", dir, name);
    FILE *f = fopen(buf[k], "wb");
    if (!f) return NULL;
    fwrite(text, 1, n, f);
    fclose(f);
    return buf[k];
}
#define WRITE(dir, name, lit) write_file(dir, name, lit, sizeof(lit) - 1)

static int json_ints_equal(const fl_json *arr, const int32_t *v, int n) {
    if (!arr || arr->type != FL_JSON_ARRAY || (int)arr->len != n) return 0;
    int i = 0;
    for (const fl_json *e = arr->child; e; e = e->next, i++)
        if ((int64_t)v[i] != e->i) return 0;
    return 1;
}

static int samples_equal(const fl_dataset *a, const fl_dataset *b) {
    for (int sp = 0; sp < FL_SPLIT_COUNT; sp++) {
        if (fl_data_count(a, sp) != fl_data_count(b, sp)) return 0;
        for (size_t i = 0; i < fl_data_count(a, sp); i++) {
            const fl_sample *x = fl_data_get(a, sp, i), *y = fl_data_get(b, sp, i);
            if (x->len != y->len || x->prompt_len != y->prompt_len) return 0;
            if (memcmp(x->ids, y->ids, (size_t)x->len * 4) || memcmp(x->labels, y->labels, (size_t)x->len * 4)) return 0;
        }
    }
    return 1;
}

/* n records "instruction i" -> "answer i" (every third with an input) as a .json array. */
static const char *write_records(const char *dir, const char *name, int n, int jsonl) {
    size_t cap = 256 + (size_t)n * 128;
    char *t = malloc(cap);
    size_t k = 0;
    if (!jsonl) t[k++] = '[';
    for (int i = 0; i < n; i++) {
        k += (size_t)snprintf(t + k, cap - k, "%s{\"instruction\": \"instruction %d\", \"input\": \"%s\", \"output\": \"answer %d\"}%s",
                              (!jsonl && i) ? ",\n" : "", i, i % 3 == 0 ? "some input" : "", i, jsonl ? "\n" : "");
    }
    if (!jsonl) t[k++] = ']';
    const char *p = write_file(dir, name, t, k);
    free(t);
    return p;
}

static fl_tokenizer *bytes_tok(void) {
    fl_tokenizer *t = NULL;
    if (fl_tok_builtin_bytes(&t) != FL_OK) return NULL;
    return t;
}

/* ---- prompt style ------------------------------------------------------------------- */

FL_TEST(data_prompt_alpaca) {
    char *p = NULL;
    FL_REQUIRE_OK(fl_data_format_prompt("alpaca", "Say hi", NULL, &p));
    FL_CHECK(strcmp(p, "Below is an instruction that describes a task. Write a response that appropriately completes "
                       "the request.\n\n### Instruction:\nSay hi\n\n### Response:\n") == 0);
    free(p);
    FL_REQUIRE_OK(fl_data_format_prompt("alpaca", "Say hi", "", &p)); /* empty input = no input (Python falsy) */
    FL_CHECK(strstr(p, "### Input") == NULL);
    free(p);
    FL_REQUIRE_OK(fl_data_format_prompt("alpaca", "Translate", "bonjour", &p));
    FL_CHECK(strcmp(p, "Below is an instruction that describes a task, paired with an input that provides further "
                       "context. Write a response that appropriately completes the request.\n\n### Instruction:\n"
                       "Translate\n\n### Input:\nbonjour\n\n### Response:\n") == 0);
    free(p);
    fl_status s = fl_data_format_prompt("chatml", "x", NULL, &p);
    FL_CHECK(s == FL_ERR_INVALID && p == NULL);
    FL_CHECKF(strstr(fl_error_message(), "chatml") && strstr(fl_error_message(), "alpaca"), "msg: %s", fl_error_message());
}

/* ---- torch parity: randperm and random_split ---------------------------------------------- */

FL_TEST(data_randperm_and_split_match_torch) {
    fl_json *ref = NULL;
    FL_REQUIRE_OK(fl_json_parse_file(REF_FIXTURE, &ref));
    size_t *perm = NULL;
    int32_t v[100];
    FL_REQUIRE_OK(fl_data_torch_randperm(42, 100, &perm));
    for (int i = 0; i < 100; i++) v[i] = (int32_t)perm[i];
    FL_CHECK(json_ints_equal(fl_json_get(ref, "randperm_100"), v, 100));
    free(perm);
    FL_REQUIRE_OK(fl_data_torch_randperm(1234, 7, &perm));
    for (int i = 0; i < 7; i++) v[i] = (int32_t)perm[i];
    FL_CHECK(json_ints_equal(fl_json_get(ref, "randperm_7_seed1234"), v, 7));
    free(perm);
    for (const fl_json *sp = fl_json_get(ref, "splits")->child; sp; sp = sp->next) {
        float f = (float)fl_json_get(sp, "val_split_fraction")->num;
        size_t nt, nv;
        fl_data_split_lengths(100, f, &nt, &nv);
        FL_CHECKF(nt == fl_json_get(sp, "train")->len && nv == fl_json_get(sp, "val")->len, "fraction %g: %zu/%zu", (double)f, nt, nv);
    }
    fl_json_free(ref);
}

/* ---- LitGPT SFT parity with the LLaMA-2 tokenizer ---------------------------------------- */

FL_TEST(data_alpaca_matches_litgpt_reference) {
    FL_SKIP_IF_NO_DATA();
    fl_json *ref = NULL;
    fl_tokenizer *tok = NULL;
    FL_REQUIRE_OK(fl_json_parse_file(REF_FIXTURE, &ref));
    fl_status s = fl_tok_load(&tok, fl_test_data_path("llama2-tokenizer"));
    if (s != FL_OK) {
        fl_json_free(ref);
        FL_REQUIRE_OK(s);
    }
    fl_data_config c;
    fl_data_config_default(&c, FL_DATA_JSON);
    snprintf(c.json_path, sizeof c.json_path, "%s", fl_test_data_path("instruct/alpaca-tiny.json"));
    fl_dataset *dm = NULL, *du = NULL, *dt = NULL;
    c.mask_prompt = 1;
    FL_REQUIRE_OK(fl_data_load(&dm, &c, tok));
    c.mask_prompt = 0;
    FL_REQUIRE_OK(fl_data_load(&du, &c, tok));
    c.mask_prompt = 1;
    c.max_seq_length = 24;
    FL_REQUIRE_OK(fl_data_load(&dt, &c, tok));
    FL_CHECK(fl_data_count(dm, FL_SPLIT_TRAIN) == 95 && fl_data_count(dm, FL_SPLIT_VAL) == 5);
    int checked = 0;
    for (const fl_json *e = fl_json_get(ref, "samples")->child; e; e = e->next) {
        int val = strcmp(fl_json_get(e, "split")->str, "val") == 0;
        int k = (int)fl_json_get(e, "k")->i, mask = fl_json_get(e, "mask_prompt")->b;
        int msl = (int)fl_json_get(e, "max_seq_length")->i;
        const fl_dataset *d = msl > 0 ? dt : (mask ? dm : du);
        const fl_sample *x = fl_data_get(d, val ? FL_SPLIT_VAL : FL_SPLIT_TRAIN, (size_t)k);
        FL_REQUIRE(x);
        FL_CHECKF(json_ints_equal(fl_json_get(e, "ids"), x->ids, x->len), "ids of %s[%d] (record %lld, mask %d, max %d)",
                  val ? "val" : "train", k, (long long)fl_json_get(e, "record")->i, mask, msl);
        FL_CHECKF(json_ints_equal(fl_json_get(e, "labels"), x->labels, x->len), "labels of %s[%d] (mask %d, max %d)",
                  val ? "val" : "train", k, mask, msl);
        checked++;
    }
    FL_CHECK(checked == 11);
    FL_CHECK(fl_data_get_stats(dt)->n_truncated == 100);
    /* a record with an input, through the folder layout (train.json = val.json = the file, in order) */
    const char *dir = fl_test_tmpdir();
    char tr[4200], va[4200], abs[4096];
    FL_REQUIRE(realpath(fl_test_data_path("instruct/alpaca-tiny.json"), abs));
    snprintf(tr, sizeof tr, "%s/train.json", dir);
    snprintf(va, sizeof va, "%s/val.json", dir);
    FL_REQUIRE(symlink(abs, tr) == 0 && symlink(abs, va) == 0);
    fl_data_config_default(&c, FL_DATA_JSON);
    snprintf(c.json_path, sizeof c.json_path, "%s", dir);
    c.mask_prompt = 1;
    fl_dataset *df = NULL;
    FL_REQUIRE_OK(fl_data_load(&df, &c, tok));
    const fl_json *wi = fl_json_get(ref, "with_input");
    const fl_sample *x = fl_data_get(df, FL_SPLIT_TRAIN, (size_t)fl_json_get(wi, "record")->i);
    FL_CHECK(fl_data_count(df, FL_SPLIT_TRAIN) == 100 && fl_data_count(df, FL_SPLIT_VAL) == 100);
    FL_CHECK(x && json_ints_equal(fl_json_get(wi, "ids"), x->ids, x->len));
    FL_CHECK(x && json_ints_equal(fl_json_get(wi, "labels"), x->labels, x->len));
    fl_data_free(dm);
    fl_data_free(du);
    fl_data_free(dt);
    fl_data_free(df);
    fl_tok_free(tok);
    fl_json_free(ref);
}

/* Prompt strings of the fixture (no tokenizer needed). */
FL_TEST(data_alpaca_prompt_matches_litgpt_reference) {
    FL_SKIP_IF_NO_DATA();
    fl_json *ref = NULL, *recs = NULL;
    FL_REQUIRE_OK(fl_json_parse_file(REF_FIXTURE, &ref));
    FL_REQUIRE_OK(fl_json_parse_file(fl_test_data_path("instruct/alpaca-tiny.json"), &recs));
    int n = 0;
    for (const fl_json *e = fl_json_get(ref, "samples")->child; e; e = e->next, n++) {
        const fl_json *r = fl_json_at(recs, (size_t)fl_json_get(e, "record")->i);
        char *p = NULL;
        FL_REQUIRE_OK(fl_data_format_prompt("alpaca", fl_json_get(r, "instruction")->str, fl_json_get(r, "input")->str, &p));
        FL_CHECK(strcmp(p, fl_json_get(e, "prompt")->str) == 0);
        free(p);
    }
    const fl_json *wi = fl_json_get(ref, "with_input");
    const fl_json *r = fl_json_at(recs, (size_t)fl_json_get(wi, "record")->i);
    char *p = NULL;
    FL_REQUIRE_OK(fl_data_format_prompt("alpaca", fl_json_get(r, "instruction")->str, fl_json_get(r, "input")->str, &p));
    FL_CHECK(strcmp(p, fl_json_get(wi, "prompt")->str) == 0 && strstr(p, "### Input:\n"));
    free(p);
    FL_CHECK(n == 11);
    fl_json_free(ref);
    fl_json_free(recs);
}

/* ---- SFT assembly with the byte tokenizer ------------------------------------------------- */

FL_TEST(data_sft_ids_labels_mask_truncation) {
    fl_tokenizer *tok = bytes_tok();
    FL_REQUIRE(tok);
    const char *dir = fl_test_tmpdir();
    write_records(dir, "train.json", 4, 0);
    write_records(dir, "val.json", 2, 0);
    fl_data_config c;
    fl_data_config_default(&c, FL_DATA_JSON);
    snprintf(c.json_path, sizeof c.json_path, "%s", dir);
    for (int mask = 0; mask < 2; mask++) {
        c.mask_prompt = mask;
        fl_dataset *d = NULL;
        FL_REQUIRE_OK(fl_data_load(&d, &c, tok));
        FL_CHECK(fl_data_count(d, FL_SPLIT_TRAIN) == 4 && fl_data_count(d, FL_SPLIT_VAL) == 2);
        const fl_sample *x = fl_data_get(d, FL_SPLIT_TRAIN, 1); /* record 1: no input */
        char *prompt = NULL;
        int32_t *p = NULL, *o = NULL;
        size_t np = 0, no = 0;
        FL_REQUIRE_OK(fl_data_format_prompt("alpaca", "instruction 1", NULL, &prompt));
        FL_REQUIRE_OK(fl_tok_encode(tok, prompt, strlen(prompt), -1, 0, &p, &np));
        FL_REQUIRE_OK(fl_tok_encode(tok, "answer 1", 8, 0, 1, &o, &no));
        FL_REQUIRE(x && x->len == (int)(np + no) && x->prompt_len == (int)np);
        FL_CHECK(memcmp(x->ids, p, np * 4) == 0 && memcmp(x->ids + np, o, no * 4) == 0);
        FL_CHECK(x->ids[x->len - 1] == fl_tok_eos_id(tok));
        for (int i = 0; i < x->len; i++)
            FL_CHECK(x->labels[i] == ((mask && i < (int)np) ? -100 : x->ids[i]));
        free(prompt);
        free(p);
        free(o);
        fl_data_free(d);
    }
    c.max_seq_length = 10;
    c.mask_prompt = 1;
    fl_dataset *d = NULL;
    FL_REQUIRE_OK(fl_data_load(&d, &c, tok));
    const fl_sample *x = fl_data_get(d, FL_SPLIT_VAL, 0);
    FL_CHECK(x->len == 10 && x->prompt_len == 10);
    for (int i = 0; i < 10; i++) FL_CHECK(x->labels[i] == -100);
    FL_CHECK(fl_data_get_stats(d)->n_truncated == 6);
    fl_data_free(d);
    fl_tok_free(tok);
}

/* ---- layouts and split determinism ------------------------------------------------------- */

FL_TEST(data_json_jsonl_folder_and_split_determinism) {
    fl_tokenizer *tok = bytes_tok();
    FL_REQUIRE(tok);
    const char *dir = fl_test_tmpdir();
    const char *pj = write_records(dir, "all.json", 40, 0);
    fl_data_config c;
    fl_data_config_default(&c, FL_DATA_JSON);
    snprintf(c.json_path, sizeof c.json_path, "%s", pj);
    fl_dataset *a = NULL, *b = NULL, *e = NULL, *jl = NULL;
    FL_REQUIRE_OK(fl_data_load(&a, &c, tok));
    FL_REQUIRE_OK(fl_data_load(&b, &c, tok));
    FL_CHECK(fl_data_count(a, FL_SPLIT_TRAIN) == 38 && fl_data_count(a, FL_SPLIT_VAL) == 2);
    FL_CHECK(samples_equal(a, b));
    c.seed = 7;
    FL_REQUIRE_OK(fl_data_load(&e, &c, tok));
    FL_CHECK(!samples_equal(a, e));
    /* the same records as .jsonl (with a blank line, counted) split identically */
    c.seed = 42;
    size_t cap = 8192, k = 0;
    char *t = malloc(cap);
    for (int i = 0; i < 40; i++)
        k += (size_t)snprintf(t + k, cap - k, "{\"instruction\": \"instruction %d\", \"input\": \"%s\", \"output\": \"answer %d\"}\n%s",
                              i, i % 3 == 0 ? "some input" : "", i, i == 5 ? "\n" : "");
    snprintf(c.json_path, sizeof c.json_path, "%s", write_file(dir, "all.jsonl", t, k));
    free(t);
    FL_REQUIRE_OK(fl_data_load(&jl, &c, tok));
    FL_CHECK(samples_equal(a, jl));
    FL_CHECK(fl_data_get_stats(jl)->n_warnings == 1);
    /* folder: train.jsonl + val.json, no split */
    const char *sub = fl_test_tmpdir();
    write_records(sub, "train.jsonl", 5, 1);
    write_records(sub, "val.json", 3, 0);
    snprintf(c.json_path, sizeof c.json_path, "%s", sub);
    fl_dataset *f = NULL;
    FL_REQUIRE_OK(fl_data_load(&f, &c, tok));
    FL_CHECK(fl_data_count(f, FL_SPLIT_TRAIN) == 5 && fl_data_count(f, FL_SPLIT_VAL) == 3);
    fl_data_free(a);
    fl_data_free(b);
    fl_data_free(e);
    fl_data_free(jl);
    fl_data_free(f);
    fl_tok_free(tok);
}

/* ---- bad inputs: clear errors naming file and record, never a crash --------------------- */

FL_TEST(data_bad_inputs) {
    fl_tokenizer *tok = bytes_tok();
    FL_REQUIRE(tok);
    static const struct { const char *name, *text, *expect; } cases[] = {
        {"a.json", "[{\"instruction\": \"x\", \"output\": \"y\"}, {\"output\": \"y\"}]", "record 1: missing \"instruction\""},
        {"b.json", "[{\"instruction\": \"x\"}]", "record 0: missing \"output\""},
        {"c.json", "[{\"instruction\": \"x\", \"output\": 3}]", "record 0: \"output\" must be a string, got a number"},
        {"d.json", "[{\"instruction\": [1], \"output\": \"y\"}]", "\"instruction\" must be a string, got an array"},
        {"e.json", "[{\"instruction\": \"x\", \"input\": true, \"output\": \"y\"}]", "\"input\" must be a string"},
        {"f.json", "{\"instruction\": \"x\", \"output\": \"y\"}", "expected a JSON array of records, got an object"},
        {"g.json", "[1, 2]", "record 0: expected an object"},
        {"h.json", "[]", "no records (empty dataset)"},
        {"i.json", "", "i.json"},
        {"j.json", "[{\"instruction\": \"x\", \"output\": \"y\"", "j.json"},
        {"k.json", "[{\"instruction\": \"\xff\xfe\", \"output\": \"y\"}]", "UTF-8"},
        {"l.json", "[{\"instruction\": \"a\\u0000b\", \"output\": \"y\"}]", "NUL"},
        {"m.jsonl", "{\"instruction\": \"x\", \"output\": \"y\"}\n{\"instruction\": \"x\"\n", "line 2"},
        {"n.jsonl", "{\"instruction\": \"x\", \"output\": \"y\"}\n[1]\n", "line 2 (record 1): expected an object"},
        {"o.jsonl", "\n\n  \n", "no records"},
        {"p.txt", "[]", "unsupported file format"},
        {"q.json", "[{\"instruction\": \"x\", \"output\": \"y\"}] trailing", "q.json"},
        {"r.json", "[{\"instruction\": \"\\ud800\", \"output\": \"y\"}]", "surrogate"},
    };
    const char *dir = fl_test_tmpdir();
    fl_data_config c;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fl_data_config_default(&c, FL_DATA_JSON);
        snprintf(c.json_path, sizeof c.json_path, "%s", write_file(dir, cases[i].name, cases[i].text, strlen(cases[i].text)));
        fl_dataset *d = NULL;
        fl_status s = fl_data_load(&d, &c, tok);
        FL_CHECKF(s != FL_OK && d == NULL, "%s: expected an error", cases[i].name);
        FL_CHECKF(strstr(fl_error_message(), cases[i].expect) && strstr(fl_error_message(), cases[i].name),
                  "%s: message '%s' lacks '%s'", cases[i].name, fl_error_message(), cases[i].expect);
    }
    /* config errors */
    fl_dataset *d = NULL;
    fl_data_config_default(&c, FL_DATA_ALPACA);
    FL_CHECK(fl_data_load(&d, &c, tok) == FL_ERR_INVALID && strstr(fl_error_message(), "json_path"));
    snprintf(c.json_path, sizeof c.json_path, "%s/nope.json", dir);
    FL_CHECK(fl_data_load(&d, &c, tok) == FL_ERR_NOT_FOUND && strstr(fl_error_message(), "nope.json"));
    const char *sub = fl_test_tmpdir();
    write_records(sub, "train.json", 3, 0);
    snprintf(c.json_path, sizeof c.json_path, "%s", sub);
    FL_CHECK(fl_data_load(&d, &c, tok) == FL_ERR_NOT_FOUND && strstr(fl_error_message(), "val.json"));
    fl_data_config_default(&c, FL_DATA_SYNTHETIC);
    snprintf(c.prompt_style, sizeof c.prompt_style, "%s", "nope");
    FL_CHECK(fl_data_load(&d, &c, tok) == FL_ERR_INVALID && strstr(fl_error_message(), "known: alpaca"));
    fl_data_config_default(&c, FL_DATA_TEXTFILES);
    snprintf(c.train_data_path, sizeof c.train_data_path, "%s", dir);
    FL_CHECK(fl_data_load(&d, &c, tok) == FL_ERR_INVALID && strstr(fl_error_message(), "max_seq_length"));
    FL_CHECK(d == NULL);
    fl_tok_free(tok);
}

/* ---- TextFiles ------------------------------------------------------------------------------ */

FL_TEST(data_textfiles_chunking) {
    fl_tokenizer *tok = bytes_tok();
    FL_REQUIRE(tok);
    const char *dir = fl_test_tmpdir();
    WRITE(dir, "a.txt", "  val text here\n");
    WRITE(dir, "c.txt", "third file, the tail\n\n");
    WRITE(dir, "b.txt", "\n second file body ");
    WRITE(dir, "skip.md", "not a txt");
    fl_data_config c;
    fl_data_config_default(&c, FL_DATA_TEXTFILES);
    snprintf(c.train_data_path, sizeof c.train_data_path, "%s", dir);
    c.max_seq_length = 7;
    fl_dataset *d = NULL;
    FL_REQUIRE_OK(fl_data_load(&d, &c, tok));
    /* train = encode("second file body", bos) ++ encode("third file, the tail", bos), blocks of 8 */
    int32_t *x = NULL, *y = NULL;
    size_t nx, ny;
    FL_REQUIRE_OK(fl_tok_encode(tok, "second file body", 16, 1, 0, &x, &nx));
    FL_REQUIRE_OK(fl_tok_encode(tok, "third file, the tail", 20, 1, 0, &y, &ny));
    size_t total = nx + ny, nb = total / 8;
    int32_t *all = malloc(total * 4);
    memcpy(all, x, nx * 4);
    memcpy(all + nx, y, ny * 4);
    FL_CHECK(fl_data_count(d, FL_SPLIT_TRAIN) == nb);
    for (size_t i = 0; i < nb && i < fl_data_count(d, FL_SPLIT_TRAIN); i++) {
        const fl_sample *s = fl_data_get(d, FL_SPLIT_TRAIN, i);
        FL_CHECK(s->len == 8 && s->prompt_len == 0);
        FL_CHECK(memcmp(s->ids, all + i * 8, 32) == 0 && memcmp(s->labels, s->ids, 32) == 0);
    }
    int32_t *v = NULL;
    size_t nv;
    FL_REQUIRE_OK(fl_tok_encode(tok, "val text here", 13, 1, 0, &v, &nv));
    FL_CHECK(fl_data_count(d, FL_SPLIT_VAL) == nv / 8);
    FL_CHECK(memcmp(fl_data_get(d, FL_SPLIT_VAL, 0)->ids, v, 32) == 0);
    /* the run names the validation file and the rule that chose it */
    const char *vs = fl_data_get_stats(d)->val_source;
    FL_CHECKF(!strncmp(vs, "a.txt, the first .txt", 21) && strstr(vs, "data.val_data_path"), "%s", vs);
    free(x), free(y), free(v), free(all);
    fl_data_free(d);
    d = NULL;
    /* explicit val folder; non-UTF-8 file named in the error; one file without val folder */
    const char *vd = fl_test_tmpdir();
    WRITE(vd, "v.txt", "validation words, enough of them");
    snprintf(c.val_data_path, sizeof c.val_data_path, "%s", vd);
    FL_REQUIRE_OK(fl_data_load(&d, &c, tok));
    FL_CHECK(fl_data_count(d, FL_SPLIT_VAL) == 34 / 8);
    FL_CHECKF(!strncmp(fl_data_get_stats(d)->val_source, "v.txt (data.val_data_path ", 26), "%s",
              fl_data_get_stats(d)->val_source);
    fl_data_free(d);
    d = NULL;
    WRITE(vd, "w.txt", "bad \xc3\x28 byte");
    fl_status s = fl_data_load(&d, &c, tok);
    FL_CHECK(s == FL_ERR_FORMAT && strstr(fl_error_message(), "w.txt") && strstr(fl_error_message(), "UTF-8"));
    /* one train file (a folder of one, or the file itself), no validation files: its last
     * val_split_fraction of blocks validates; the two splits hold disjoint, consecutive blocks */
    const char *one = fl_test_tmpdir();
    WRITE(one, "only.txt", "just one file, long enough for twenty blocks of five tokens: abcdefghijklmnopqrstuvwxyz");
    fl_data_config_default(&c, FL_DATA_TEXTFILES);
    c.max_seq_length = 4;
    c.val_split_fraction = 0.25f;
    char onef[4000];
    snprintf(onef, sizeof onef, "%.3900s/only.txt", one);
    for (int as_file = 0; as_file < 2; as_file++) {
        snprintf(c.train_data_path, sizeof c.train_data_path, "%s", as_file ? onef : one);
        FL_REQUIRE_OK(fl_data_load(&d, &c, tok));
        const char *txt = "just one file, long enough for twenty blocks of five tokens: abcdefghijklmnopqrstuvwxyz";
        FL_REQUIRE_OK(fl_tok_encode(tok, txt, strlen(txt), 1, 0, &x, &nx));
        size_t nbk = nx / 5, ntr = fl_data_count(d, FL_SPLIT_TRAIN), nva = fl_data_count(d, FL_SPLIT_VAL);
        FL_CHECKF(ntr + nva == nbk && nva == nbk / 4, "%zu + %zu blocks of %zu", ntr, nva, nbk);
        for (size_t i = 0; i < nva; i++)
            FL_CHECK(memcmp(fl_data_get(d, FL_SPLIT_VAL, i)->ids, x + (ntr + i) * 5, 20) == 0);
        FL_CHECK(memcmp(fl_data_get(d, FL_SPLIT_TRAIN, ntr - 1)->ids, x + (ntr - 1) * 5, 20) == 0);
        FL_CHECKF(strstr(fl_data_get_stats(d)->val_source, "the last 25% of the blocks of only.txt"), "%s",
                  fl_data_get_stats(d)->val_source);
        free(x);
        x = NULL;
        fl_data_free(d);
        d = NULL;
    }
    snprintf(c.train_data_path, sizeof c.train_data_path, "%s/nope.txt", one);
    FL_CHECK(fl_data_load(&d, &c, tok) == FL_ERR_NOT_FOUND && strstr(fl_error_message(), "nope.txt"));
    const char *empty = fl_test_tmpdir();
    snprintf(c.train_data_path, sizeof c.train_data_path, "%s", empty);
    FL_CHECK(fl_data_load(&d, &c, tok) == FL_ERR_NOT_FOUND && strstr(fl_error_message(), "no .txt"));
    fl_tok_free(tok);
}

FL_TEST(data_textfiles_shared_text) {
    FL_SKIP_IF_NO_DATA();
    fl_tokenizer *tok = bytes_tok();
    FL_REQUIRE(tok);
    fl_data_config c;
    fl_data_config_default(&c, FL_DATA_TEXTFILES);
    snprintf(c.train_data_path, sizeof c.train_data_path, "%s", fl_test_data_path("text"));
    c.max_seq_length = 255;
    fl_dataset *d = NULL;
    FL_REQUIRE_OK(fl_data_load(&d, &c, tok));
    /* sorted: tinyshakespeare.txt (val), tinystories-val-prefix.txt (train); the run says so */
    FL_CHECK(fl_data_count(d, FL_SPLIT_VAL) > 4000 && fl_data_count(d, FL_SPLIT_TRAIN) > 3000);
    FL_CHECKF(!strncmp(fl_data_get_stats(d)->val_source, "tinyshakespeare.txt, the first", 30), "%s",
              fl_data_get_stats(d)->val_source);
    FL_CHECK(fl_data_get(d, FL_SPLIT_VAL, 0)->ids[0] == fl_tok_bos_id(tok));
    fl_data_free(d);
    fl_tok_free(tok);
}

/* ---- Synthetic ------------------------------------------------------------------------------ */

FL_TEST(data_synthetic_deterministic_and_correct) {
    fl_tokenizer *tok = bytes_tok();
    FL_REQUIRE(tok);
    fl_data_config c;
    fl_data_config_default(&c, FL_DATA_SYNTHETIC);
    c.synthetic_train = 300;
    c.synthetic_val = 20;
    c.mask_prompt = 1;
    fl_dataset *a = NULL, *b = NULL, *e = NULL;
    FL_REQUIRE_OK(fl_data_load(&a, &c, tok));
    FL_REQUIRE_OK(fl_data_load(&b, &c, tok));
    FL_CHECK(fl_data_count(a, FL_SPLIT_TRAIN) == 300 && fl_data_count(a, FL_SPLIT_VAL) == 20);
    FL_CHECK(samples_equal(a, b));
    c.seed = 43;
    FL_REQUIRE_OK(fl_data_load(&e, &c, tok));
    FL_CHECK(!samples_equal(a, e));
    const fl_sample *s = fl_data_get(a, FL_SPLIT_TRAIN, 0);
    FL_CHECK(s->labels[0] == -100 && s->labels[s->len - 1] == fl_tok_eos_id(tok) && s->prompt_len < s->len);
    /* answers are right, all four tasks appear */
    fl_data_records rs = {0};
    FL_REQUIRE_OK(fl_data_synthetic_records(42, FL_SPLIT_TRAIN, 200, &rs));
    int seen[4] = {0};
    for (size_t i = 0; i < rs.n; i++) {
        const char *in = rs.r[i].instruction, *out = rs.r[i].output;
        int x, y;
        if (sscanf(in, "Add %d and %d", &x, &y) == 2) {
            seen[0]++;
            FL_CHECK(atoi(out) == x + y);
        } else if (strncmp(in, "Reverse: ", 9) == 0) {
            seen[1]++;
            size_t l = strlen(in + 9);
            FL_CHECK(strlen(out) == l);
            for (size_t k = 0; k < l; k++) FL_CHECK(out[k] == in[9 + l - 1 - k]);
        } else if (strncmp(in, "Copy: ", 6) == 0) {
            seen[2]++;
            FL_CHECK(strcmp(out, in + 6) == 0);
        } else if (strncmp(in, "Sort the digits ", 16) == 0) {
            seen[3]++;
            for (size_t k = 1; out[k]; k++) FL_CHECK(out[k - 1] <= out[k]);
            FL_CHECK(strlen(out) == strlen(in + 16));
        } else {
            FL_CHECKF(0, "unknown task '%s'", in);
        }
    }
    FL_CHECK(seen[0] && seen[1] && seen[2] && seen[3]);
    fl_data_records_free(&rs);
    fl_data_free(a);
    fl_data_free(b);
    fl_data_free(e);
    fl_tok_free(tok);
}

/* ---- cache ------------------------------------------------------------------------------------ */

static int count_bin(const char *dir, char *path, size_t n) {
    char cmd[4300];
    snprintf(cmd, sizeof cmd, "ls %s/*.bin 2>/dev/null", dir);
    FILE *p = popen(cmd, "r");
    int k = 0;
    char line[4200];
    while (p && fgets(line, sizeof line, p)) {
        line[strcspn(line, "\n")] = 0;
        snprintf(path, n, "%s", line);
        k++;
    }
    if (p) pclose(p);
    return k;
}

FL_TEST(data_cache_hit_miss_corruption) {
    fl_tokenizer *tok = bytes_tok();
    FL_REQUIRE(tok);
    const char *dir = fl_test_tmpdir();
    char cache[1024], bin[4200];
    snprintf(cache, sizeof cache, "%s/cache/sub", dir);
    const char *src = write_records(dir, "all.json", 30, 0);
    fl_data_config c;
    fl_data_config_default(&c, FL_DATA_JSON);
    snprintf(c.json_path, sizeof c.json_path, "%s", src);
    snprintf(c.cache_dir, sizeof c.cache_dir, "%s", cache);
    fl_dataset *ref = NULL, *d = NULL;
    FL_REQUIRE_OK(fl_data_load(&ref, &c, tok));
    FL_CHECK(fl_data_get_stats(ref)->cache_hit == 0);
    FL_REQUIRE(count_bin(cache, bin, sizeof bin) == 1);
    FL_REQUIRE_OK(fl_data_load(&d, &c, tok));
    FL_CHECK(fl_data_get_stats(d)->cache_hit == 1 && samples_equal(ref, d));
    FL_CHECK(fl_data_get_stats(d)->n_tokens == fl_data_get_stats(ref)->n_tokens);
    fl_data_free(d);
    /* any option change misses */
    c.mask_prompt = 1;
    FL_REQUIRE_OK(fl_data_load(&d, &c, tok));
    FL_CHECK(fl_data_get_stats(d)->cache_hit == 0);
    fl_data_free(d);
    c.mask_prompt = 0;
    /* corrupt one byte in the middle: detected, rebuilt, same samples, then hits again */
    struct stat st;
    FL_REQUIRE(stat(bin, &st) == 0);
    FILE *f = fopen(bin, "r+b");
    FL_REQUIRE(f);
    fseek(f, st.st_size / 2, SEEK_SET);
    int ch = fgetc(f);
    fseek(f, st.st_size / 2, SEEK_SET);
    fputc(ch ^ 0x5a, f);
    fclose(f);
    FL_REQUIRE_OK(fl_data_load(&d, &c, tok));
    FL_CHECK(fl_data_get_stats(d)->cache_hit == 0 && samples_equal(ref, d));
    fl_data_free(d);
    FL_REQUIRE_OK(fl_data_load(&d, &c, tok));
    FL_CHECK(fl_data_get_stats(d)->cache_hit == 1 && samples_equal(ref, d));
    fl_data_free(d);
    /* truncated */
    FL_REQUIRE(truncate(bin, st.st_size - 13) == 0);
    FL_REQUIRE_OK(fl_data_load(&d, &c, tok));
    FL_CHECK(fl_data_get_stats(d)->cache_hit == 0 && samples_equal(ref, d));
    fl_data_free(d);
    FL_REQUIRE(truncate(bin, 5) == 0);
    FL_REQUIRE_OK(fl_data_load(&d, &c, tok));
    FL_CHECK(fl_data_get_stats(d)->cache_hit == 0 && samples_equal(ref, d));
    fl_data_free(d);
    /* source content change misses */
    write_records(dir, "all.json", 31, 0);
    FL_REQUIRE_OK(fl_data_load(&d, &c, tok));
    FL_CHECK(fl_data_get_stats(d)->cache_hit == 0 && fl_data_count(d, FL_SPLIT_TRAIN) + fl_data_count(d, FL_SPLIT_VAL) == 31);
    fl_data_free(d);
    fl_data_free(ref);
    fl_tok_free(tok);
}

/* ---- loader ------------------------------------------------------------------------------------ */

static fl_dataset *loader_dataset(fl_tokenizer *tok, int n, int mask) {
    const char *dir = fl_test_tmpdir();
    write_records(dir, "train.json", n, 0);
    write_records(dir, "val.json", 5, 0);
    fl_data_config c;
    fl_data_config_default(&c, FL_DATA_JSON);
    snprintf(c.json_path, sizeof c.json_path, "%s", dir);
    c.mask_prompt = mask;
    fl_dataset *d = NULL;
    if (fl_data_load(&d, &c, tok) != FL_OK) return NULL;
    return d;
}

FL_TEST(data_loader_shift_pad_counts) {
    fl_tokenizer *tok = bytes_tok();
    FL_REQUIRE(tok);
    fl_dataset *d = loader_dataset(tok, 7, 1);
    FL_REQUIRE(d);
    fl_loader *l = NULL;
    FL_REQUIRE_OK(fl_loader_init(&l, d, FL_SPLIT_VAL, 3, 512, 1, 0));
    fl_batch b;
    int ne = 0;
    FL_REQUIRE_OK(fl_loader_next(l, &b, &ne));
    FL_CHECK(ne == 1 && b.B == 3 && b.truncated == 0);
    int maxlen = 0;
    long real = 0, prompt = 0, tgt = 0;
    for (int i = 0; i < 3; i++) {
        const fl_sample *s = fl_data_get(d, FL_SPLIT_VAL, (size_t)i); /* val: in order */
        if (s->len > maxlen) maxlen = s->len;
    }
    FL_CHECK(b.T == maxlen - 1 && b.padded_tokens == 3L * b.T);
    for (int i = 0; i < 3; i++) {
        const fl_sample *s = fl_data_get(d, FL_SPLIT_VAL, (size_t)i);
        for (int t = 0; t < b.T; t++) {
            int32_t id = b.ids[i * b.T + t], tg = b.targets[i * b.T + t];
            if (t < s->len - 1) {
                FL_CHECK(id == s->ids[t] && tg == s->labels[t + 1]);
                if (tg != -100) tgt++;
            } else {
                FL_CHECK(id == 0 && tg == -100);
            }
        }
        real += s->len - 1;
        prompt += s->prompt_len;
    }
    FL_CHECK(b.real_tokens == real && b.prompt_tokens == prompt && b.target_tokens == tgt);
    FL_CHECK(tgt == real - prompt + 3); /* masked prompt: targets start at the last prompt position */
    FL_REQUIRE_OK(fl_loader_next(l, &b, &ne));
    FL_CHECK(ne == 0 && b.B == 2); /* 5 = 3 + 2 */
    FL_CHECK(fl_loader_batches_per_epoch(l) == 2);
    FL_REQUIRE_OK(fl_loader_next(l, &b, &ne));
    FL_CHECK(ne == 1 && b.B == 3);
    fl_loader_free(l);
    /* truncation to T_max + 1 tokens */
    FL_REQUIRE_OK(fl_loader_init(&l, d, FL_SPLIT_VAL, 2, 16, 1, 0));
    FL_REQUIRE_OK(fl_loader_next(l, &b, &ne));
    const fl_sample *s0 = fl_data_get(d, FL_SPLIT_VAL, 0);
    FL_CHECK(b.T == 16 && b.truncated == 2 && b.real_tokens == 32 && b.target_tokens == 0);
    FL_CHECK(b.ids[15] == s0->ids[15] && b.targets[15] == s0->labels[16]);
    fl_loader_free(l);
    FL_CHECK(fl_loader_init(&l, d, FL_SPLIT_VAL, 0, 16, 1, 0) == FL_ERR_INVALID && l == NULL);
    fl_data_free(d);
    fl_tok_free(tok);
}

FL_TEST(data_loader_epochs_shuffle_resume) {
    fl_tokenizer *tok = bytes_tok();
    FL_REQUIRE(tok);
    fl_dataset *d = loader_dataset(tok, 23, 0);
    FL_REQUIRE(d);
    fl_loader *l = NULL, *m = NULL;
    FL_REQUIRE_OK(fl_loader_init(&l, d, FL_SPLIT_TRAIN, 4, 256, 99, 1));
    FL_CHECK(fl_loader_batches_per_epoch(l) == 6);
    /* identify samples by their first differing token run: use the ids pointer's content hash */
    uint64_t order[3][23];
    for (int ep = 0; ep < 3; ep++) {
        int seen[23] = {0}, k = 0;
        for (int bi = 0; bi < 6; bi++) {
            fl_batch b;
            int ne;
            FL_REQUIRE_OK(fl_loader_next(l, &b, &ne));
            FL_CHECK(ne == (bi == 0));
            for (int i = 0; i < b.B; i++) {
                int found = -1;
                for (size_t j = 0; j < 23; j++) {
                    const fl_sample *s = fl_data_get(d, FL_SPLIT_TRAIN, j);
                    int n = s->len - 1 < b.T ? s->len - 1 : b.T;
                    if (memcmp(b.ids + i * b.T, s->ids, (size_t)n * 4) == 0 && (n == b.T || b.ids[i * b.T + n] == 0)) found = (int)j;
                }
                FL_REQUIRE(found >= 0);
                seen[found]++;
                order[ep][k++] = (uint64_t)found;
            }
        }
        for (int j = 0; j < 23; j++) FL_CHECK(seen[j] == 1);
    }
    FL_CHECK(memcmp(order[0], order[1], sizeof order[0]) != 0 && memcmp(order[1], order[2], sizeof order[0]) != 0);
    int in_order = 1;
    for (int j = 0; j < 23; j++) in_order &= order[0][j] == (uint64_t)j;
    FL_CHECK(!in_order);
    /* resume: state after 7 batches, the next 10 batches match exactly */
    fl_loader_free(l);
    FL_REQUIRE_OK(fl_loader_init(&l, d, FL_SPLIT_TRAIN, 4, 256, 5, 1));
    fl_batch b;
    int ne;
    for (int i = 0; i < 7; i++) FL_REQUIRE_OK(fl_loader_next(l, &b, &ne));
    fl_loader_state st;
    fl_loader_get_state(l, &st);
    FL_CHECK(st.epoch == 1 && st.pos == 4 && st.seed == 5);
    int32_t *ref_ids[10];
    int ref_T[10], ref_B[10], ref_ne[10];
    for (int i = 0; i < 10; i++) {
        FL_REQUIRE_OK(fl_loader_next(l, &b, &ne));
        ref_T[i] = b.T, ref_B[i] = b.B, ref_ne[i] = ne;
        ref_ids[i] = malloc((size_t)b.B * b.T * 8);
        memcpy(ref_ids[i], b.ids, (size_t)b.B * b.T * 4);
        memcpy(ref_ids[i] + b.B * b.T, b.targets, (size_t)b.B * b.T * 4);
    }
    FL_REQUIRE_OK(fl_loader_init(&m, d, FL_SPLIT_TRAIN, 4, 256, 12345, 1));
    FL_REQUIRE_OK(fl_loader_next(m, &b, &ne)); /* some other position first */
    FL_REQUIRE_OK(fl_loader_set_state(m, &st));
    for (int i = 0; i < 10; i++) {
        FL_REQUIRE_OK(fl_loader_next(m, &b, &ne));
        FL_CHECK(b.T == ref_T[i] && b.B == ref_B[i] && ne == ref_ne[i]);
        FL_CHECK(memcmp(b.ids, ref_ids[i], (size_t)b.B * b.T * 4) == 0);
        FL_CHECK(memcmp(b.targets, ref_ids[i] + b.B * b.T, (size_t)b.B * b.T * 4) == 0);
        free(ref_ids[i]);
    }
    fl_loader_state bad = {5, 0, 24};
    FL_CHECK(fl_loader_set_state(m, &bad) == FL_ERR_INVALID);
    bad.pos = 0, bad.epoch = -1;
    FL_CHECK(fl_loader_set_state(m, &bad) == FL_ERR_INVALID);
    fl_loader_free(l);
    fl_loader_free(m);
    fl_data_free(d);
    fl_tok_free(tok);
}

/* ---- fingerprint (the data-parallel start-up check) -------------------------------------------- */

/* write_records' records in reverse order: the same samples and tokens */
static const char *write_records_reversed(const char *dir, const char *name, int n) {
    size_t cap = 256 + (size_t)n * 128, k = 0;
    char *t = malloc(cap);
    t[k++] = '[';
    for (int i = n - 1; i >= 0; i--)
        k += (size_t)snprintf(t + k, cap - k, "%s{\"instruction\": \"instruction %d\", \"input\": \"%s\", \"output\": \"answer %d\"}",
                              i < n - 1 ? ",\n" : "", i, i % 3 == 0 ? "some input" : "", i);
    t[k++] = ']';
    const char *p = write_file(dir, name, t, k);
    free(t);
    return p;
}

FL_TEST(data_fingerprint_ids_labels_boundaries) {
    fl_tokenizer *tok = bytes_tok();
    FL_REQUIRE(tok);
    const char *dir = fl_test_tmpdir();
    fl_data_config c;
    fl_data_config_default(&c, FL_DATA_JSON);
    snprintf(c.json_path, sizeof c.json_path, "%s", write_records(dir, "a.json", 40, 0));
    snprintf(c.cache_dir, sizeof c.cache_dir, "%s/cache", dir);
    fl_dataset *a = NULL, *b = NULL, *r = NULL, *m = NULL;
    FL_REQUIRE_OK(fl_data_load(&a, &c, tok));
    FL_REQUIRE_OK(fl_data_load(&b, &c, tok)); /* from the cache: the same numbers */
    FL_CHECK(fl_data_get_stats(b)->cache_hit == 1);
    for (int sp = 0; sp < FL_SPLIT_COUNT; sp++) FL_CHECK(fl_data_fingerprint(a, sp) == fl_data_fingerprint(b, sp));
    FL_CHECK(fl_data_fingerprint(a, FL_SPLIT_TRAIN) != fl_data_fingerprint(a, FL_SPLIT_VAL));
    /* the same records reversed: the same tokens, other samples in each split */
    snprintf(c.json_path, sizeof c.json_path, "%s", write_records_reversed(dir, "r.json", 40));
    FL_REQUIRE_OK(fl_data_load(&r, &c, tok));
    FL_CHECK(fl_data_get_stats(r)->n_tokens == fl_data_get_stats(a)->n_tokens);
    FL_CHECK(fl_data_fingerprint(a, FL_SPLIT_TRAIN) != fl_data_fingerprint(r, FL_SPLIT_TRAIN));
    /* the labels count (the prompt masked: the same ids) */
    snprintf(c.json_path, sizeof c.json_path, "%s/a.json", dir);
    c.mask_prompt = 1;
    FL_REQUIRE_OK(fl_data_load(&m, &c, tok));
    FL_CHECK(samples_equal(a, m) == 0 && fl_data_fingerprint(a, FL_SPLIT_TRAIN) != fl_data_fingerprint(m, FL_SPLIT_TRAIN));
    /* the boundaries count: two samples of ids [1 2] [3] differ from [1] [2 3] */
    fl_dataset *x = NULL, *y = NULL;
    FL_REQUIRE_OK(fl_data_new(&x));
    FL_REQUIRE_OK(fl_data_new(&y));
    const int32_t ids[3] = {1, 2, 3};
    FL_REQUIRE_OK(fl_data_split_push(&x->split[FL_SPLIT_TRAIN], ids, ids, 2, 0));
    FL_REQUIRE_OK(fl_data_split_push(&x->split[FL_SPLIT_TRAIN], ids + 2, ids + 2, 1, 0));
    FL_REQUIRE_OK(fl_data_split_push(&y->split[FL_SPLIT_TRAIN], ids, ids, 1, 0));
    FL_REQUIRE_OK(fl_data_split_push(&y->split[FL_SPLIT_TRAIN], ids + 1, ids + 1, 2, 0));
    FL_CHECK(fl_data_fingerprint(x, FL_SPLIT_TRAIN) != fl_data_fingerprint(y, FL_SPLIT_TRAIN));
    /* an empty split and a missing dataset: the basis, never a crash */
    FL_CHECK(fl_data_fingerprint(x, FL_SPLIT_VAL) == fl_data_fingerprint(y, FL_SPLIT_VAL));
    FL_CHECK(fl_data_fingerprint(NULL, FL_SPLIT_TRAIN) == fl_data_fingerprint(NULL, FL_SPLIT_VAL));
    fl_data_free(x), fl_data_free(y);
    fl_data_free(a), fl_data_free(b), fl_data_free(r), fl_data_free(m);
    fl_tok_free(tok);
}

/* Seq2seq data (issue 31): records -> source/target ids (EOS appended) -> padded batches
 * (src, src_mask, dec_in, labels). Hand-checked arrays with the byte tokenizer (ids = bytes,
 * EOS 257), the limits (truncate keeping EOS / strict error), bad records naming file and record,
 * the loader's order and resumable state, and the T5 fixture tokenizer. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"
#include "fitllm/data.h"
#include "fitllm/tokenizer.h"
#include "test.h"

#define IG FL_IGNORE_INDEX

static const char k_recs[] = "[{\"input\": \"ab\", \"output\": \"x\"},"
                             " {\"instruction\": \"I\", \"input\": \"c\", \"output\": \"yz\"},"
                             " {\"input\": \"hello\", \"output\": \"\", \"extra\": 1}]";

static int arr_eq(const int32_t *a, const int32_t *b, size_t n) { return !memcmp(a, b, n * sizeof *a); }

FL_TEST(s2s_hand_checked_batch) {
    fl_tokenizer *tok = NULL;
    FL_REQUIRE_OK(fl_tok_builtin_bytes(&tok));
    fl_s2s_config c;
    fl_s2s_config_default(&c);
    fl_s2s_data *d = NULL;
    FL_REQUIRE_OK(fl_s2s_load_mem(&d, k_recs, strlen(k_recs), "recs.json", &c, tok));
    FL_CHECK(fl_s2s_count(d) == 3);
    const int32_t *s, *t;
    int ns, nt;
    fl_s2s_get(d, 1, &s, &ns, &t, &nt);
    static const int32_t s1[] = {'I', '\n', '\n', 'c', 257}, t1[] = {'y', 'z', 257};
    FL_CHECK(ns == 5 && arr_eq(s, s1, 5) && nt == 3 && arr_eq(t, t1, 3)); /* instruction + "\n\n" + input, EOS */
    fl_s2s_loader *l = NULL;
    FL_REQUIRE_OK(fl_s2s_loader_init(&l, d, 3, 0, 5, 1, 0));
    fl_s2s_batch b;
    int ne = 0;
    FL_REQUIRE_OK(fl_s2s_loader_next(l, &b, &ne));
    FL_CHECK(ne == 1 && b.B == 3 && b.Ts == 6 && b.Tt == 3);
    static const int32_t src[] = {'a', 'b', 257, 0, 0, 0, 'I', '\n', '\n', 'c', 257, 0, 'h', 'e', 'l', 'l', 'o', 257};
    static const uint8_t mask[] = {1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1};
    static const int32_t lab[] = {'x', 257, IG, 'y', 'z', 257, 257, IG, IG};
    static const int32_t dec[] = {5, 'x', 257, 5, 'y', 'z', 5, 257, 0};
    FL_CHECK(arr_eq(b.src, src, 18));
    FL_CHECK(!memcmp(b.src_mask, mask, 18));
    FL_CHECK(arr_eq(b.labels, lab, 9));
    FL_CHECK(arr_eq(b.dec_in, dec, 9));
    /* next call wraps to epoch 1 */
    FL_REQUIRE_OK(fl_s2s_loader_next(l, &b, &ne));
    FL_CHECK(ne == 1 && b.B == 3);
    fl_s2s_loader_free(l);
    /* collate from ids directly: the same arrays */
    const int32_t *ss[3], *tt[3];
    int nss[3], ntt[3];
    for (int i = 0; i < 3; i++) fl_s2s_get(d, (size_t)i, &ss[i], &nss[i], &tt[i], &ntt[i]);
    fl_s2s_batch cb;
    FL_REQUIRE_OK(fl_s2s_collate(ss, nss, tt, ntt, 3, 0, 5, &cb));
    FL_CHECK(cb.Ts == 6 && cb.Tt == 3 && arr_eq(cb.src, src, 18) && arr_eq(cb.labels, lab, 9) && arr_eq(cb.dec_in, dec, 9) &&
             !memcmp(cb.src_mask, mask, 18));
    fl_s2s_batch_free(&cb);
    /* B = 2: the last batch of the epoch is the remainder, padded to its own longest */
    FL_REQUIRE_OK(fl_s2s_loader_init(&l, d, 2, 0, 0, 1, 0));
    FL_REQUIRE_OK(fl_s2s_loader_next(l, &b, NULL));
    FL_CHECK(b.B == 2 && b.Ts == 5 && b.Tt == 3);
    FL_REQUIRE_OK(fl_s2s_loader_next(l, &b, &ne));
    FL_CHECK(ne == 0 && b.B == 1 && b.Ts == 6 && b.Tt == 1 && b.labels[0] == 257 && b.dec_in[0] == 0);
    fl_s2s_loader_free(l);
    fl_s2s_free(d);
    fl_tok_free(tok);
}

FL_TEST(s2s_limits) {
    fl_tokenizer *tok = NULL;
    FL_REQUIRE_OK(fl_tok_builtin_bytes(&tok));
    fl_s2s_config c;
    fl_s2s_config_default(&c);
    c.max_source_length = 3;
    c.max_target_length = 2;
    fl_s2s_data *d = NULL;
    FL_REQUIRE_OK(fl_s2s_load_mem(&d, k_recs, strlen(k_recs), "recs.json", &c, tok));
    const int32_t *s, *t;
    int ns, nt;
    fl_s2s_get(d, 2, &s, &ns, &t, &nt);
    static const int32_t s2[] = {'h', 'e', 257};
    FL_CHECK(ns == 3 && arr_eq(s, s2, 3) && nt == 1 && t[0] == 257); /* cut, EOS kept last */
    fl_s2s_get(d, 1, &s, &ns, &t, &nt);
    FL_CHECK(ns == 3 && s[2] == 257 && nt == 2 && t[0] == 'y' && t[1] == 257);
    const fl_s2s_stats *st = fl_s2s_get_stats(d);
    FL_CHECKF(st->n_truncated_source == 2 && st->n_truncated_target == 1 && st->n_source_tokens == 9 && st->n_target_tokens == 5,
              "trunc %zu %zu tokens %zu %zu", st->n_truncated_source, st->n_truncated_target, st->n_source_tokens, st->n_target_tokens);
    fl_s2s_free(d);
    /* strict: the first record over a limit is an error naming the file, record and limit */
    c.strict = 1;
    c.max_source_length = 5;
    c.max_target_length = 0;
    fl_status s_ = fl_s2s_load_mem(&d, k_recs, strlen(k_recs), "recs.json", &c, tok);
    FL_CHECKF(s_ != FL_OK && d == NULL && strstr(fl_error_message(), "recs.json: record 2: the source has 6 tokens (with EOS), over max_source_length 5"),
              "%s", fl_error_message());
    c.max_source_length = 0; /* no limit */
    c.max_target_length = 2;
    s_ = fl_s2s_load_mem(&d, k_recs, strlen(k_recs), "recs.json", &c, tok);
    FL_CHECKF(s_ != FL_OK && strstr(fl_error_message(), "record 1: the target has 3 tokens (with EOS), over max_target_length 2"), "%s",
              fl_error_message());
    c.max_target_length = 1;
    FL_CHECK(fl_s2s_load_mem(&d, k_recs, strlen(k_recs), "recs.json", &c, tok) == FL_ERR_INVALID && strstr(fl_error_message(), ">= 2"));
    fl_tok_free(tok);
}

static void expect_bad(const fl_tokenizer *tok, const char *text, const char *source, const char *needle) {
    fl_s2s_config c;
    fl_s2s_config_default(&c);
    fl_s2s_data *d = NULL;
    fl_status s = fl_s2s_load_mem(&d, text, strlen(text), source, &c, tok);
    FL_CHECKF(s != FL_OK && d == NULL, "%s: loaded", text);
    FL_CHECKF(strstr(fl_error_message(), needle) != NULL, "message \"%s\" lacks \"%s\"", fl_error_message(), needle);
    fl_s2s_free(d);
}

FL_TEST(s2s_bad_records) {
    fl_tokenizer *tok = NULL;
    FL_REQUIRE_OK(fl_tok_builtin_bytes(&tok));
    expect_bad(tok, "[{\"input\": \"a\", \"output\": \"b\"}, {\"input\": \"a\"}]", "p.json", "p.json: record 1: missing \"output\"");
    expect_bad(tok, "[{\"input\": \"a\", \"output\": 3}]", "p.json", "p.json: record 0: \"output\" must be a string, got a number");
    expect_bad(tok, "[{\"input\": [\"a\"], \"output\": \"b\"}]", "p.json", "record 0: \"input\" must be a string, got an array");
    expect_bad(tok, "[{\"instruction\": null, \"input\": \"a\", \"output\": \"b\"}]", "p.json", "\"instruction\" must be a string, got null");
    expect_bad(tok, "[{\"output\": \"b\"}]", "p.json", "record 0: missing \"input\" (or \"instruction\")");
    expect_bad(tok, "[{\"input\": null, \"output\": \"b\"}]", "p.json", "record 0: missing \"input\"");
    expect_bad(tok, "[\"just text\"]", "p.json", "record 0: expected an object");
    expect_bad(tok, "{\"input\": \"a\", \"output\": \"b\"}", "p.json", "p.json: expected a JSON array of records, got an object");
    expect_bad(tok, "[]", "p.json", "p.json: no records");
    expect_bad(tok, "[{\"input\": \"a\", \"output\": \"b\"", "p.json", "p.json");
    expect_bad(tok, "{\"input\": \"a\", \"output\": \"b\"}\n\n{\"input\": \"a\", \"output\": false}\n", "q.jsonl",
               "q.jsonl: line 3 (record 1): \"output\" must be a string, got a boolean");
    expect_bad(tok, "{\"input\": \"a\", \"output\": \"b\"}\n{oops\n", "q.jsonl", "q.jsonl: line 2");
    expect_bad(tok, "[]", "p.csv", "expected .json or .jsonl");
    fl_s2s_data *d = NULL;
    fl_s2s_config c;
    fl_s2s_config_default(&c);
    FL_CHECK(fl_s2s_load(&d, "/nonexistent/pairs.json", &c, tok) != FL_OK && strstr(fl_error_message(), "/nonexistent/pairs.json"));
    /* jsonl with a blank line and a null input next to an instruction */
    const char *ok = "{\"instruction\": \"i\", \"input\": null, \"output\": \"o\"}\n\n{\"input\": \"\", \"instruction\": \"j\", \"output\": \"p\"}\n";
    FL_REQUIRE_OK(fl_s2s_load_mem(&d, ok, strlen(ok), "ok.jsonl", &c, tok));
    const int32_t *s, *t;
    int ns, nt;
    fl_s2s_get(d, 1, &s, &ns, &t, &nt);
    FL_CHECK(fl_s2s_count(d) == 2 && fl_s2s_get_stats(d)->n_blank == 1 && ns == 2 && s[0] == 'j' && s[1] == 257);
    fl_s2s_free(d);
    fl_tok_free(tok);
}

/* Loader order: a permutation per epoch, reproducible from (seed, epoch, pos), different per epoch. */
FL_TEST(s2s_loader_order_and_state) {
    fl_tokenizer *tok = NULL;
    FL_REQUIRE_OK(fl_tok_builtin_bytes(&tok));
    char text[2048] = "[";
    for (int i = 0; i < 10; i++)
        snprintf(text + strlen(text), sizeof text - strlen(text), "%s{\"input\": \"%c\", \"output\": \"%c%c\"}", i ? "," : "", 'a' + i, 'A' + i,
                 'A' + i);
    strcat(text, "]");
    fl_s2s_config c;
    fl_s2s_config_default(&c);
    fl_s2s_data *d = NULL;
    FL_REQUIRE_OK(fl_s2s_load_mem(&d, text, strlen(text), "ten.json", &c, tok));
    fl_s2s_loader *a = NULL, *b2 = NULL;
    FL_REQUIRE_OK(fl_s2s_loader_init(&a, d, 3, 0, 0, 42, 1));
    FL_REQUIRE_OK(fl_s2s_loader_init(&b2, d, 3, 0, 0, 42, 1));
    int order[2][10], k = 0, e0_same_as_e1 = 1;
    fl_s2s_batch b;
    fl_loader_state mid = {0};
    int32_t after_mid[3] = {0};
    for (int step = 0; step < 8; step++) { /* 4 batches per epoch: 3+3+3+1 */
        FL_REQUIRE_OK(fl_s2s_loader_next(a, &b, NULL));
        for (int i = 0; i < b.B; i++, k++) order[k / 10][k % 10] = b.src[(size_t)i * b.Ts] - 'a';
        if (step == 4) fl_s2s_loader_get_state(a, &mid);
        if (step == 5) memcpy(after_mid, b.src, sizeof after_mid);
    }
    for (int e = 0; e < 2; e++) {
        int seen = 0;
        for (int i = 0; i < 10; i++) seen |= 1 << order[e][i];
        FL_CHECKF(seen == 0x3FF, "epoch %d is not a permutation", e);
    }
    for (int i = 0; i < 10; i++) e0_same_as_e1 &= order[0][i] == order[1][i];
    FL_CHECK(!e0_same_as_e1);
    FL_CHECK(mid.epoch == 1 && mid.pos == 3);
    FL_REQUIRE_OK(fl_s2s_loader_set_state(b2, &mid));
    FL_REQUIRE_OK(fl_s2s_loader_next(b2, &b, NULL));
    FL_CHECK(!memcmp(b.src, after_mid, sizeof after_mid));
    fl_loader_state bad = {42, 0, 11};
    FL_CHECK(fl_s2s_loader_set_state(b2, &bad) == FL_ERR_INVALID && strstr(fl_error_message(), "out of range"));
    fl_s2s_loader_free(a);
    fl_s2s_loader_free(b2);
    fl_s2s_free(d);
    fl_tok_free(tok);
}

/* With the T5 fixture tokenizer: source/target ids are the tokenizer's (EOS 1 once, no BOS). */
FL_TEST(s2s_t5_tokenizer) {
    fl_tokenizer *tok = NULL;
    FL_REQUIRE_OK(fl_tok_load(&tok, "tests/fixtures/t5-tok"));
    const char *rec = "[{\"instruction\": \"Spot saw\", \"input\": \"the car <extra_id_0>\", \"output\": \"<extra_id_0> shiny\"}]";
    fl_s2s_config c;
    fl_s2s_config_default(&c);
    fl_s2s_data *d = NULL;
    FL_REQUIRE_OK(fl_s2s_load_mem(&d, rec, strlen(rec), "t5.json", &c, tok));
    int32_t *want = NULL, *want_t = NULL;
    size_t nw, nwt;
    FL_REQUIRE_OK(fl_tok_encode(tok, "Spot saw\n\nthe car <extra_id_0>", 30, -1, -1, &want, &nw));
    FL_REQUIRE_OK(fl_tok_encode(tok, "<extra_id_0> shiny", 18, -1, -1, &want_t, &nwt));
    const int32_t *s, *t;
    int ns, nt;
    fl_s2s_get(d, 0, &s, &ns, &t, &nt);
    FL_CHECK((size_t)ns == nw && arr_eq(s, want, nw) && s[ns - 1] == 1 && s[ns - 2] == 499);
    FL_CHECK((size_t)nt == nwt && arr_eq(t, want_t, nwt) && t[0] == 499 && t[nt - 1] == 1);
    free(want);
    free(want_t);
    fl_s2s_free(d);
    fl_tok_free(tok);
}

/* The validation split (fl_s2s_split) against torch: random_split(range(8), [0.75, 0.25],
 * generator=torch.Generator().manual_seed(42)) gives train [6, 3, 0, 7, 2, 1] and val [4, 5] (torch 2.15.0); at 0.05
 * the val split is empty and the training pairs keep the file's order. Records are told apart by their output byte. */
FL_TEST(s2s_split_as_torch_random_split) {
    fl_tokenizer *tok = NULL;
    FL_REQUIRE_OK(fl_tok_builtin_bytes(&tok));
    char text[512];
    size_t n = (size_t)snprintf(text, sizeof text, "[");
    for (int i = 0; i < 8; i++)
        n += (size_t)snprintf(text + n, sizeof text - n, "%s{\"input\": \"in%d\", \"output\": \"%c\"}", i ? ", " : "", i,
                              'a' + i);
    n += (size_t)snprintf(text + n, sizeof text - n, "]");
    fl_s2s_config c;
    fl_s2s_config_default(&c);
    c.max_source_length = 3; /* "in0" + EOS: 4 tokens, cut: every record counts as truncated */
    fl_s2s_data *d = NULL, *tr = NULL, *va = NULL;
    FL_REQUIRE_OK(fl_s2s_load_mem(&d, text, n, "eight.json", &c, tok));
    FL_REQUIRE_OK(fl_s2s_split(d, 0.25f, 42, &tr, &va));
    static const int want_tr[] = {6, 3, 0, 7, 2, 1}, want_va[] = {4, 5};
    FL_CHECK(fl_s2s_count(tr) == 6 && fl_s2s_count(va) == 2);
    const int32_t *s, *t;
    int ns, nt;
    for (size_t i = 0; i < fl_s2s_count(tr); i++) {
        fl_s2s_get(tr, i, &s, &ns, &t, &nt);
        FL_CHECKF(nt == 2 && t[0] == 'a' + want_tr[i], "train pair %zu: output %c, torch %c", i, t[0], 'a' + want_tr[i]);
    }
    for (size_t i = 0; i < fl_s2s_count(va); i++) {
        fl_s2s_get(va, i, &s, &ns, &t, &nt);
        FL_CHECKF(nt == 2 && t[0] == 'a' + want_va[i], "val pair %zu: output %c, torch %c", i, t[0], 'a' + want_va[i]);
    }
    FL_CHECK(fl_s2s_get_stats(tr)->n_records == 6 && fl_s2s_get_stats(tr)->n_truncated_source == 8 &&
             fl_s2s_get_stats(va)->n_records == 2);
    fl_s2s_free(tr), fl_s2s_free(va);
    FL_REQUIRE_OK(fl_s2s_split(d, 0.05f, 42, &tr, &va));
    FL_CHECK(fl_s2s_count(tr) == 8 && fl_s2s_count(va) == 0);
    for (size_t i = 0; i < fl_s2s_count(tr); i++) {
        fl_s2s_get(tr, i, &s, &ns, &t, &nt);
        FL_CHECK(t[0] == 'a' + (int)i);
    }
    fl_s2s_free(tr), fl_s2s_free(va);
    FL_CHECK(fl_s2s_split(d, 1.5f, 42, &tr, &va) == FL_ERR_INVALID && !tr && !va);
    fl_s2s_free(d);
    fl_tok_free(tok);
}

/* fl_s2s_fingerprint: equal for the same pairs, another for the pairs in another order or a pair's boundary moved */
FL_TEST(s2s_fingerprint) {
    fl_tokenizer *tok = NULL;
    FL_REQUIRE_OK(fl_tok_builtin_bytes(&tok));
    static const char fwd[] = "[{\"input\": \"ab\", \"output\": \"x\"}, {\"input\": \"c\", \"output\": \"yz\"}]";
    static const char rev[] = "[{\"input\": \"c\", \"output\": \"yz\"}, {\"input\": \"ab\", \"output\": \"x\"}]";
    static const char cut[] = "[{\"input\": \"a\", \"output\": \"bx\"}, {\"input\": \"c\", \"output\": \"yz\"}]";
    fl_s2s_config c;
    fl_s2s_config_default(&c);
    fl_s2s_data *a = NULL, *b = NULL, *r = NULL, *k = NULL;
    FL_REQUIRE_OK(fl_s2s_load_mem(&a, fwd, strlen(fwd), "a.json", &c, tok));
    FL_REQUIRE_OK(fl_s2s_load_mem(&b, fwd, strlen(fwd), "b.json", &c, tok));
    FL_REQUIRE_OK(fl_s2s_load_mem(&r, rev, strlen(rev), "r.json", &c, tok));
    FL_REQUIRE_OK(fl_s2s_load_mem(&k, cut, strlen(cut), "k.json", &c, tok));
    FL_CHECK(fl_s2s_fingerprint(a) == fl_s2s_fingerprint(b));
    FL_CHECK(fl_s2s_fingerprint(a) != fl_s2s_fingerprint(r));
    FL_CHECK(fl_s2s_fingerprint(a) != fl_s2s_fingerprint(k));
    FL_CHECK(fl_s2s_fingerprint(NULL) != fl_s2s_fingerprint(a));
    fl_s2s_free(a), fl_s2s_free(b), fl_s2s_free(r), fl_s2s_free(k);
    fl_tok_free(tok);
}

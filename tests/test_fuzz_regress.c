/* Regression tests for what the fuzzers (fuzz/, docs/FUZZING.md) found: each
 * case is the minimized input (or the property) of one finding. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"
#include "fitllm/config.h"
#include "fitllm/io.h"
#include "fitllm/mem.h"
#include "fitllm/tokenizer.h"
#include "test.h"

/* fuzz_recipe_yaml: hyperparameters.yaml (fl_cfg_write_yaml) repeated "train:" / "eval:" before every
 * key of the section (PyYAML keeps only the last duplicate key), and wrote max_memory: null, which
 * fl_cfg_set refused. What we write must read back, section by section, to the same configuration. */
FL_TEST(fuzz_regress_cfg_written_yaml_reads_back) {
    for (int cmd = 0; cmd < FL_CMD_COUNT; cmd++) {
        fl_run_config c, c2;
        fl_cfg_defaults(&c, (fl_cmd_kind)cmd);
        FL_REQUIRE_OK(fl_cfg_set(&c, "checkpoint_dir", "ckpt"));
        FL_REQUIRE_OK(fl_cfg_set(&c, "train.micro_batch_size", "2"));
        FL_REQUIRE_OK(fl_cfg_set(&c, "train.max_steps", "7"));
        FL_REQUIRE_OK(fl_cfg_set(&c, "eval.interval", "3"));
        if (cmd == FL_CMD_PRETRAIN) FL_REQUIRE_OK(fl_cfg_set(&c, "data.train_data_path", "txt"));
        FL_REQUIRE_OK(fl_cfg_validate(&c));
        char *y = NULL;
        size_t n = 0;
        FILE *f = open_memstream(&y, &n);
        FL_REQUIRE(f != NULL);
        fl_cfg_write_yaml(&c, f);
        fclose(f);
        const char *sections[] = {"\ntrain:\n", "\neval:\n", "\ndata:\n", "\noptimizer:\n"};
        for (int s = 0; s < 4; s++) {
            const char *a = strstr(y, sections[s]);
            FL_CHECKF(a && !strstr(a + 1, sections[s]), "cmd %d: section '%s' %s:\n%s", cmd, sections[s] + 1,
                      a ? "repeated" : "missing", y);
        }
        fl_cfg_defaults(&c2, (fl_cmd_kind)cmd);
        FL_CHECKF(fl_cfg_apply_yaml(&c2, y, n, "written.yaml") == FL_OK, "cmd %d: %s", cmd, fl_error_message());
        FL_CHECKF(fl_cfg_validate(&c2) == FL_OK, "cmd %d: %s", cmd, fl_error_message());
        FL_CHECK(c2.train.micro_batch_size == 2 && c2.train.max_steps == 7 && c2.eval.interval == 3);
        FL_CHECK(c2.max_memory == 0 && !strcmp(c2.checkpoint_dir, "ckpt"));
        free(y);
    }
    /* null is "no budget" on the command line too */
    fl_run_config c;
    fl_cfg_defaults(&c, FL_CMD_PRETRAIN);
    FL_REQUIRE_OK(fl_cfg_set(&c, "max_memory", "2GB"));
    FL_CHECK(c.max_memory > 0);
    FL_REQUIRE_OK(fl_cfg_set(&c, "max_memory", "null"));
    FL_CHECK(c.max_memory == 0);
    FL_CHECK(fl_cfg_set(&c, "max_memory", "lots") == FL_ERR_INVALID);
}

static void put_file(const char *dir, const char *name, const void *data, size_t n) {
    char p[4200];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    if (!f) return;
    fwrite(data, 1, n, f);
    fclose(f);
}

/* fuzz_hf_folder: a 400-byte folder (a config.json of LLaMA-3-8B's size next to a safetensors file
 * holding one unrelated 4-byte tensor, so neither the layer count nor the embedding could be
 * compared) made fl_hf_load_model allocate 35 GB of parameters before finding no tensor to
 * fill them with. The files must hold 2 bytes per parameter before anything is allocated. */
FL_TEST(fuzz_regress_hf_config_larger_than_its_weights) {
    const char *dir = fl_test_tmpdir();
    const char *cfg = "{\"model_type\":\"llama\",\"hidden_size\":4096,\"intermediate_size\":14336,"
                      "\"num_hidden_layers\":32,\"num_attention_heads\":32,\"num_key_value_heads\":8,"
                      "\"vocab_size\":128256,\"max_position_embeddings\":4,\"rms_norm_eps\":1e-5}";
    put_file(dir, "config.json", cfg, strlen(cfg));
    char st[128];
    const char *hdr = "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}";
    size_t hl = strlen(hdr), pad = (8 - hl % 8) % 8;
    uint64_t n = hl + pad;
    memcpy(st, &n, 8);
    memcpy(st + 8, hdr, hl);
    memset(st + 8 + hl, ' ', pad);
    memset(st + 8 + n, 0, 4);
    put_file(dir, "model.safetensors", st, 8 + n + 4);
    fl_backend be;
    FL_REQUIRE_OK(fl_cpu_backend_init(&be, 1));
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "t", (size_t)1 << 30)); /* before the fix: FL_ERR_OOM here */
    fl_model m;
    memset(&m, 0, sizeof m);
    fl_status s = fl_hf_load_model(&m, dir, &be, &pool);
    FL_CHECKF(s == FL_ERR_FORMAT, "%s: %s", fl_status_name(s), fl_error_message());
    FL_CHECKF(strstr(fl_error_message(), "config.json") && strstr(fl_error_message(), "parameters"), "%s",
              fl_error_message());
    FL_CHECK(pool.peak_total == 0);
    if (s == FL_OK) fl_model_free(&m);
    fl_mem_pool_free(&pool);
}

/* Found by hand while fuzzing tokenizer.json (each allocation stayed under the fuzzer's 2 GB
 * malloc limit): a 60-byte tokenizer.json with the ids 0 and 2^26-1 made the loader build
 * per-token tables for 67M ids (1.8 GB and 35 s under ASan). Ids must be dense enough. */
FL_TEST(fuzz_regress_tokenizer_json_sparse_ids) {
    const char *dir = fl_test_tmpdir();
    char path[4200];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    const char *bad = "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":67108863,\"b\":0},\"merges\":[]}}";
    const char *bad_added = "{\"added_tokens\":[{\"id\":50000000,\"content\":\"<x>\"}],"
                            "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":1,\"b\":0},\"merges\":[]}}";
    const char *ok = "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"c\":1000},\"merges\":[]}}";
    const char *cases[3] = {bad, bad_added, ok};
    for (int k = 0; k < 3; k++) {
        put_file(dir, "tokenizer.json", cases[k], strlen(cases[k]));
        fl_tokenizer *t = NULL;
        fl_status s = fl_tok_load(&t, path);
        if (k < 2) {
            FL_CHECKF(s == FL_ERR_FORMAT, "case %d: %s", k, fl_status_name(s));
            FL_CHECKF(strstr(fl_error_message(), k ? "added_tokens" : "model.vocab") &&
                          strstr(fl_error_message(), "tokenizer.json"), "case %d: %s", k, fl_error_message());
        } else {
            FL_CHECKF(s == FL_OK, "a vocabulary with a small gap loads: %s", fl_error_message());
            FL_CHECK(s != FL_OK || fl_tok_vocab_size(t) == 1001);
        }
        fl_tok_free(t);
    }
}

/* Found reviewing the YAML walk while fuzzing recipes: a 1.1 KB recipe whose mappings alias the
 * previous one twice ("billion laughs" of empty mappings, never reaching an option, so no error
 * stopped it) kept `fitllm finetune_full --config` busy for 2^39 mapping visits. */
FL_TEST(fuzz_regress_yaml_alias_bomb) {
    char y[4096];
    size_t o = (size_t)snprintf(y, sizeof y, "m0: &m0 {}\n");
    for (int k = 1; k < 40; k++) o += (size_t)snprintf(y + o, sizeof y - o, "m%d: &m%d {a: *m%d, b: *m%d}\n", k, k, k - 1, k - 1);
    fl_run_config c;
    fl_cfg_defaults(&c, FL_CMD_FINETUNE_FULL);
    fl_status s = fl_cfg_apply_yaml(&c, y, o, "bomb.yaml");
    FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "bomb.yaml"), "%s: %s", fl_status_name(s),
              fl_error_message());
    /* fuzz_recipe_yaml (rerun after the fix above, ~420 s): a mapping holding itself under an empty key
     * ("&m1 {&a : *m1}", minimized from the crash input) recursed until the stack overflowed. */
    const char *self = "&m1 {&m1umetraiepochsb: *m1}\nm:";
    s = fl_cfg_apply_yaml(&c, self, strlen(self), "self.yaml");
    FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "self.yaml"), "%s: %s", fl_status_name(s),
              fl_error_message());
    const char *self2 = "a: &x {b: *x}\n"; /* non-empty keys: the dotted key outgrows its 256 bytes */
    FL_CHECK(fl_cfg_apply_yaml(&c, self2, strlen(self2), "self2.yaml") == FL_ERR_INVALID);
    /* aliases as such still work: one mapping used twice */
    const char *ok = "train: &t {micro_batch_size: 2}\neval: {interval: 3}\n";
    FL_CHECKF(fl_cfg_apply_yaml(&c, ok, strlen(ok), "ok.yaml") == FL_OK, "%s", fl_error_message());
    FL_CHECK(c.train.micro_batch_size == 2 && c.eval.interval == 3);
}

/* fuzz_recipe_yaml (10-minute campaign, at 600 s): string options were written to
 * hyperparameters.yaml unquoted, so an out_dir holding a newline (a YAML block or quoted scalar can
 * give one) broke the document; ": ", " #" or a leading '-' would change its structure or cut the
 * value. Strings YAML cannot read back plainly are now double-quoted with escapes. */
FL_TEST(fuzz_regress_cfg_written_yaml_quotes_strings) {
    static const char *vals[] = {"o/run\n textmodel_config", "a: b", "x #comment", "-dash", "say \"hi\"\\",
                                 "tab\there", " lead", "trail ", "[x]", "caf\xc3\xa9/ok", "plain/path_1.2"};
    for (size_t i = 0; i < sizeof vals / sizeof vals[0]; i++) {
        static fl_run_config c, c2;
        fl_cfg_defaults(&c, FL_CMD_FINETUNE_FULL);
        FL_REQUIRE_OK(fl_cfg_set(&c, "checkpoint_dir", "ckpt"));
        FL_REQUIRE_OK(fl_cfg_set(&c, "out_dir", vals[i]));
        FL_REQUIRE_OK(fl_cfg_set(&c, "data", "JSON")); /* json_path is an option of JSON (and Alpaca) */
        FL_REQUIRE_OK(fl_cfg_set(&c, "data.json_path", vals[i]));
        char *y = NULL;
        size_t n = 0;
        FILE *f = open_memstream(&y, &n);
        FL_REQUIRE(f != NULL);
        fl_cfg_write_yaml(&c, f);
        fclose(f);
        fl_cfg_defaults(&c2, FL_CMD_FINETUNE_FULL);
        FL_CHECKF(fl_cfg_apply_yaml(&c2, y, n, "written.yaml") == FL_OK, "value '%s': %s\n%s", vals[i],
                  fl_error_message(), y);
        FL_CHECKF(!strcmp(c2.out_dir, vals[i]) && !strcmp(c2.data.json_path, vals[i]), "value '%s' came back as '%s' / '%s'",
                  vals[i], c2.out_dir, c2.data.json_path);
        FL_CHECK(!strstr(y, "\"plain/path_1.2\"")); /* plain strings stay plain */
        free(y);
    }
}

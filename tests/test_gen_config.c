/* Tests for the generation settings a model folder carries (fl_hf_eos_ids / fl_hf_stop_ids: the ids that end
 * generation, as transformers' generate reads them) and for the dtype its config.json names (fl_hf_save_config_dtype,
 * fl_hf_config_text_set_dtype: torch_dtype / dtype as the weights are stored). */
#include <stdio.h>
#include <string.h>

#include "core/fs.h"
#include "fitllm/io.h"
#include "fitllm/json.h"
#include "fitllm/tokenizer.h"
#include "test.h"

static void put(const char *dir, const char *name, const char *text) {
    char p[1024];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "w");
    FL_REQUIRE(f);
    fputs(text, f);
    fclose(f);
}

static int ids_are(const int32_t *ids, int n, const int32_t *want, int nw) {
    return n == nw && !memcmp(ids, want, (size_t)n * sizeof *ids);
}

FL_TEST(hf_eos_ids_generation_config_then_config) {
    const char *d = fl_test_tmpdir();
    int32_t ids[8];
    int n = -1;
    const char *from = NULL;
    FL_REQUIRE_OK(fl_hf_eos_ids(d, ids, 8, &n, &from)); /* no file: none */
    FL_CHECK(n == 0 && !strcmp(from, ""));
    put(d, "config.json", "{\"model_type\": \"llama\", \"eos_token_id\": [2, 13, 2]}");
    FL_REQUIRE_OK(fl_hf_eos_ids(d, ids, 8, &n, &from)); /* a list, each id once */
    FL_CHECK(ids_are(ids, n, (const int32_t[]){2, 13}, 2) && !strcmp(from, "config.json"));
    put(d, "generation_config.json", "{\"bos_token_id\": 1, \"eos_token_id\": null}");
    FL_REQUIRE_OK(fl_hf_eos_ids(d, ids, 8, &n, &from)); /* null there: config.json's */
    FL_CHECK(ids_are(ids, n, (const int32_t[]){2, 13}, 2) && !strcmp(from, "config.json"));
    put(d, "generation_config.json", "{\"eos_token_id\": [128001, 128008, 128009]}"); /* Llama-3's */
    FL_REQUIRE_OK(fl_hf_eos_ids(d, ids, 8, &n, &from));
    FL_CHECK(ids_are(ids, n, (const int32_t[]){128001, 128008, 128009}, 3) && !strcmp(from, "generation_config.json"));
    put(d, "generation_config.json", "{\"eos_token_id\": 5}");
    FL_REQUIRE_OK(fl_hf_eos_ids(d, ids, 8, &n, &from));
    FL_CHECK(ids_are(ids, n, (const int32_t[]){5}, 1));
    /* a composite (BLIP-2): the language model's text_config */
    put(d, "generation_config.json", "{}");
    put(d, "config.json", "{\"model_type\": \"blip-2\", \"text_config\": {\"eos_token_id\": 50118}}");
    FL_REQUIRE_OK(fl_hf_eos_ids(d, ids, 8, &n, &from));
    FL_CHECK(ids_are(ids, n, (const int32_t[]){50118}, 1) && !strcmp(from, "config.json"));
    /* bad values: the file and the key named */
    put(d, "generation_config.json", "{\"eos_token_id\": [2, \"</s>\"]}");
    FL_CHECK(fl_hf_eos_ids(d, ids, 8, &n, &from) == FL_ERR_FORMAT);
    FL_CHECK(strstr(fl_error_message(), "generation_config.json: key 'eos_token_id' must be a token id") != NULL);
    put(d, "generation_config.json", "{\"eos_token_id\": -1}");
    FL_CHECK(fl_hf_eos_ids(d, ids, 8, &n, &from) == FL_ERR_FORMAT);
    put(d, "generation_config.json", "[1]");
    FL_CHECK(fl_hf_eos_ids(d, ids, 8, &n, &from) == FL_ERR_FORMAT);
    /* a file (a llama2.c .bin) or nothing: none */
    char p[1024];
    snprintf(p, sizeof p, "%s/config.json", d);
    FL_REQUIRE_OK(fl_hf_eos_ids(p, ids, 8, &n, &from));
    FL_CHECK(n == 0);
    FL_REQUIRE_OK(fl_hf_eos_ids(NULL, ids, 8, &n, NULL));
    FL_CHECK(n == 0);
}

FL_TEST(hf_stop_ids_add_the_tokenizers) {
    const char *d = fl_test_tmpdir();
    fl_tokenizer *tok = NULL;
    FL_REQUIRE_OK(fl_tok_builtin_bytes(&tok)); /* EOS 257 */
    int32_t ids[8];
    int n = 0;
    const char *from = NULL;
    put(d, "config.json", "{\"eos_token_id\": [2, 257]}");
    FL_REQUIRE_OK(fl_hf_stop_ids(d, tok, ids, 8, &n, &from)); /* 257 already there: once */
    FL_CHECK(ids_are(ids, n, (const int32_t[]){2, 257}, 2) && !strcmp(from, "config.json"));
    put(d, "config.json", "{\"eos_token_id\": 13}");
    FL_REQUIRE_OK(fl_hf_stop_ids(d, tok, ids, 8, &n, &from));
    FL_CHECK(ids_are(ids, n, (const int32_t[]){13, 257}, 2) && !strcmp(from, "config.json + the tokenizer"));
    FL_REQUIRE_OK(fl_hf_stop_ids(NULL, tok, ids, 8, &n, &from)); /* no folder: the tokenizer's */
    FL_CHECK(ids_are(ids, n, (const int32_t[]){257}, 1) && !strcmp(from, "the tokenizer"));
    FL_REQUIRE_OK(fl_hf_stop_ids(d, NULL, ids, 8, &n, &from)); /* --prompt-ids: no tokenizer */
    FL_CHECK(ids_are(ids, n, (const int32_t[]){13}, 1) && !strcmp(from, "config.json"));
    fl_tok_free(tok);
}

/* torch's name of the dtype safetensors spells s (the file's own word: the anchor the config must agree with) */
static const char *torch_name(fl_dtype dt) {
    return dt == FL_BF16 ? "bfloat16" : dt == FL_F16 ? "float16" : dt == FL_F32 ? "float32" : "?";
}

static const char *key_str(const fl_json *j, const char *key) {
    const fl_json *v = fl_json_get(j, key);
    return v && v->type == FL_JSON_STRING ? v->str : "(none)";
}

/* a bf16-true (16-true, 32-true) model saved: config.json's torch_dtype and dtype are the weights' dtype on disk */
FL_TEST(hf_save_config_names_the_weights_dtype) {
    const fl_dtype dts[] = {FL_BF16, FL_F16, FL_F32};
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "dtype", 0));
    for (int i = 0; i < 3; i++) {
        fl_model_config cfg;
        FL_REQUIRE_OK(fl_preset_find("micro", &cfg));
        fl_model_storage st = {.param_dtype = dts[i]};
        fl_model m;
        FL_REQUIRE_OK(fl_model_init_ex(&m, &cfg, NULL, &pool, &st));
        memset(fl_model_params_data(&m), 0, m.layout.numel * fl_dtype_size(dts[i]));
        char dir[1024], p[1100];
        snprintf(dir, sizeof dir, "%s/m%d", fl_test_tmpdir(), i);
        FL_REQUIRE_OK(fl_hf_save_model(&m, dir));
        fl_model_free(&m);
        fl_st_file f;
        snprintf(p, sizeof p, "%s/model.safetensors", dir);
        FL_REQUIRE_OK(fl_st_open(&f, p));
        const fl_dtype on_disk = f.tensors[0].dtype;
        fl_st_close(&f);
        FL_CHECK(on_disk == dts[i]);
        fl_json *j = NULL;
        snprintf(p, sizeof p, "%s/config.json", dir);
        FL_REQUIRE_OK(fl_json_parse_file(p, &j));
        FL_CHECKF(!strcmp(key_str(j, "torch_dtype"), torch_name(on_disk)), "torch_dtype %s, weights %s",
                  key_str(j, "torch_dtype"), fl_dtype_name(on_disk));
        FL_CHECKF(!strcmp(key_str(j, "dtype"), torch_name(on_disk)), "dtype %s, weights %s", key_str(j, "dtype"),
                  fl_dtype_name(on_disk));
        fl_json_free(j);
    }
    fl_mem_pool_free(&pool);
}

/* a copied config.json (convert): every torch_dtype / dtype string set, nothing else touched */
FL_TEST(hf_config_text_set_dtype) {
    const char *in = "{\"torch_dtype\": \"float32\", \"text_config\": {\"torch_dtype\" :\"float16\", \"dtype\": \"x\"},\n"
                     " \"quantization_config\": {\"bnb_4bit_compute_dtype\": \"float16\"}, \"name\": \"torch_dtype\",\n"
                     " \"dtype_note\": \"dtype\", \"esc\": \"a\\\"torch_dtype\\\": \\\"float32\"}";
    char *out = NULL;
    size_t n = 0;
    FL_REQUIRE_OK(fl_hf_config_text_set_dtype(in, strlen(in), FL_BF16, &out, &n));
    fl_json *j = NULL;
    FL_REQUIRE_OK(fl_json_parse(out, n, "out", &j));
    FL_CHECK(!strcmp(key_str(j, "torch_dtype"), "bfloat16"));
    const fl_json *t = fl_json_get(j, "text_config");
    FL_CHECK(!strcmp(key_str(t, "torch_dtype"), "bfloat16") && !strcmp(key_str(t, "dtype"), "bfloat16"));
    FL_CHECK(!strcmp(key_str(fl_json_get(j, "quantization_config"), "bnb_4bit_compute_dtype"), "float16"));
    FL_CHECK(!strcmp(key_str(j, "name"), "torch_dtype") && !strcmp(key_str(j, "dtype_note"), "dtype"));
    FL_CHECK(!strcmp(key_str(j, "esc"), "a\"torch_dtype\": \"float32"));
    fl_json_free(j);
    free(out);
    const char *null_in = "{\"torch_dtype\": null}"; /* not a string: as it was */
    FL_REQUIRE_OK(fl_hf_config_text_set_dtype(null_in, strlen(null_in), FL_BF16, &out, &n));
    FL_CHECK(n == strlen(null_in) && !memcmp(out, null_in, n));
    free(out);
}

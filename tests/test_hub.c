/* Models by name (fitllm/hub.h): SHA-256 against FIPS 180-4's examples, repo ids, the Hugging
 * Face cache layout, the files a download picks. The downloads themselves run against a local
 * stand-in of the Hub in tests/cli_test.sh (tests/hub/hub_server.c). */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <utime.h>

#include "io/sha256.h"
#include "fitllm/hub.h"
#include "fitllm/model.h"
#include "test.h"

static void sha_hex(const void *p, size_t n, size_t chunk, char hex[65]) {
    fl_sha256 s;
    fl_sha256_init(&s);
    const char *c = p;
    for (size_t off = 0; off < n; off += chunk) fl_sha256_update(&s, c + off, n - off < chunk ? n - off : chunk);
    fl_sha256_final_hex(&s, hex);
}

FL_TEST(hub_sha256_fips_vectors) {
    /* FIPS 180-4 / NIST CSRC example values: "", "abc", the 448-bit two-block message, a million 'a' */
    char hex[65];
    sha_hex("", 0, 1, hex);
    FL_CHECKF(!strcmp(hex, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"), "%s", hex);
    sha_hex("abc", 3, 1, hex);
    FL_CHECKF(!strcmp(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"), "%s", hex);
    const char *m = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"; /* 56 bytes: padding spills */
    for (size_t chunk = 1; chunk <= 64; chunk += 7) {
        sha_hex(m, strlen(m), chunk, hex);
        FL_CHECKF(!strcmp(hex, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"), "chunk %zu: %s",
                  chunk, hex);
    }
    char *a = malloc(1000000);
    FL_REQUIRE(a);
    memset(a, 'a', 1000000);
    sha_hex(a, 1000000, 65537, hex); /* chunks across block boundaries */
    FL_CHECKF(!strcmp(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"), "%s", hex);
    free(a);
}

FL_TEST(hub_repo_ids) {
    static const char *ok[] = {"TinyLlama/TinyLlama-1.1B-Chat-v1.0", "openlm-research/open_llama_3b", "a/b",
                               "meta-llama/Llama-3.2-1B", "org_1/x.y-z"};
    static const char *bad[] = {"gpt2", "/abs/path", "a/b/c", "org/", "/name", "a--b/c", "a/b..c", "-a/b", "a/b-",
                                "./x", "a b/c", ""};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) FL_CHECKF(fl_hub_is_repo_id(ok[i]), "%s", ok[i]);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) FL_CHECKF(!fl_hub_is_repo_id(bad[i]), "%s", bad[i]);
    char r[128];
    FL_CHECK(fl_hub_repo_of("checkpoints/TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T", r, sizeof r) &&
             !strcmp(r, "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T"));
    FL_CHECK(fl_hub_repo_of("/data/checkpoints/org/name/", r, sizeof r) && !strcmp(r, "org/name"));
    FL_CHECK(fl_hub_repo_of("org/name", r, sizeof r) && !strcmp(r, "org/name"));
    FL_CHECK(!fl_hub_repo_of("out/org/name", r, sizeof r));   /* not under a checkpoints folder */
    FL_CHECK(!fl_hub_repo_of("x/checkpoints/name", r, sizeof r));
    FL_CHECK(!fl_hub_repo_of("tinyllama-1.1b", r, sizeof r));
    /* a preset's repo id (the note of a random initialization names it) */
    FL_CHECK(fl_preset_repo_id("gpt2") && !strcmp(fl_preset_repo_id("gpt2"), "openai-community/gpt2"));
    FL_CHECK(fl_preset_repo_id("micro") == NULL);
    /* a preset error suggests preset names, not repo ids (a repo id now means downloaded weights) */
    fl_model_config mc;
    FL_CHECK(fl_preset_find("TinyLlama-1.1B-intermediate", &mc) == FL_ERR_NOT_FOUND);
    const char *msg = fl_error_message(), *near = strstr(msg, "nearest:");
    FL_REQUIRE(near);
    size_t span = strcspn(near, ";");
    FL_CHECKF(!memchr(near, '/', span) && strstr(near, "tinyllama-1.1b"), "%.*s", (int)span, near);
}

static void put(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

static void mkdirs(const char *path) {
    char p[4096];
    snprintf(p, sizeof p, "%s", path);
    for (char *s = p + 1; *s; s++)
        if (*s == '/') *s = 0, mkdir(p, 0755), *s = '/';
    mkdir(p, 0755);
}

/* Environment variables a test sets, restored after. */
typedef struct { const char *name; char *old; } env_save;
static void env_set(env_save *e, const char *name, const char *v) {
    const char *o = getenv(name);
    e->name = name;
    e->old = o ? strdup(o) : NULL;
    if (v) setenv(name, v, 1);
    else unsetenv(name);
}
static void env_restore(env_save *e) {
    if (e->old) setenv(e->name, e->old, 1);
    else unsetenv(e->name);
    free(e->old);
}

FL_TEST(hub_cache_dir_environment) {
    env_save e[5];
    char d[4096];
    env_set(&e[0], "HF_HUB_CACHE", "/x/cache");
    env_set(&e[1], "HF_HOME", "/y/home");
    env_set(&e[2], "HOME", "/z");
    env_set(&e[3], "HUGGINGFACE_HUB_CACHE", NULL);
    env_set(&e[4], "XDG_CACHE_HOME", NULL);
    FL_CHECK(fl_hub_cache_dir(d, sizeof d) == FL_OK && !strcmp(d, "/x/cache"));
    unsetenv("HF_HUB_CACHE");
    FL_CHECK(fl_hub_cache_dir(d, sizeof d) == FL_OK && !strcmp(d, "/y/home/hub"));
    unsetenv("HF_HOME");
    FL_CHECK(fl_hub_cache_dir(d, sizeof d) == FL_OK && !strcmp(d, "/z/.cache/huggingface/hub"));
    for (int i = 4; i >= 0; i--) env_restore(&e[i]);
}

FL_TEST(hub_resolve_cache_and_download_folder) {
    const char *t = fl_test_tmpdir();
    char cache[1024], dl[1024], p[4096], out[4096];
    snprintf(cache, sizeof cache, "%s/hf/hub", t);
    snprintf(dl, sizeof dl, "%s/ckpts", t);
    env_save e[2];
    env_set(&e[0], "HF_HUB_CACHE", cache);
    env_set(&e[1], "FITLLM_CHECKPOINTS", dl);
    fl_hub_where w;
    /* refs/main -> snapshots/<rev>; an older snapshot beside it is not taken */
    snprintf(p, sizeof p, "%s/models--org--model/snapshots/rev2", cache);
    mkdirs(p);
    snprintf(p, sizeof p, "%s/models--org--model/snapshots/rev2/config.json", cache);
    put(p, "{}");
    snprintf(p, sizeof p, "%s/models--org--model/snapshots/rev1", cache);
    mkdirs(p);
    snprintf(p, sizeof p, "%s/models--org--model/snapshots/rev1/config.json", cache);
    put(p, "{}");
    struct utimbuf later = {time(NULL) + 3600, time(NULL) + 3600}; /* the newest: taken were refs/main ignored */
    utime(p, &later);
    snprintf(p, sizeof p, "%s/models--org--model/refs", cache);
    mkdirs(p);
    snprintf(p, sizeof p, "%s/models--org--model/refs/main", cache);
    put(p, "rev2\n");
    FL_REQUIRE_OK(fl_hub_resolve("org/model", out, sizeof out, &w));
    snprintf(p, sizeof p, "%s/models--org--model/snapshots/rev2", cache);
    FL_CHECKF(!strcmp(out, p) && w == FL_HUB_HF_CACHE, "%s", out);
    /* LitGPT's recipe path checkpoints/ORG/NAME finds the cache's copy too */
    FL_REQUIRE_OK(fl_hub_resolve("checkpoints/org/model", out, sizeof out, &w));
    FL_CHECKF(!strcmp(out, p), "%s", out);
    /* no refs/main: the one snapshot with a config.json */
    snprintf(p, sizeof p, "%s/models--org--norefs/snapshots/abc", cache);
    mkdirs(p);
    snprintf(p, sizeof p, "%s/models--org--norefs/snapshots/abc/config.json", cache);
    put(p, "{}");
    FL_REQUIRE_OK(fl_hub_resolve("org/norefs", out, sizeof out, &w));
    FL_CHECKF(strstr(out, "models--org--norefs/snapshots/abc") != NULL, "%s", out);
    /* a snapshot without config.json: an incomplete download, said so */
    snprintf(p, sizeof p, "%s/models--org--partial/snapshots/abc", cache);
    mkdirs(p);
    FL_CHECK(fl_hub_resolve("org/partial", out, sizeof out, &w) == FL_ERR_NOT_FOUND);
    FL_CHECKF(strstr(fl_error_message(), "incomplete download") && strstr(fl_error_message(), "fitllm download org/partial"),
              "%s", fl_error_message());
    /* not anywhere: where it looked and what to run */
    FL_CHECK(fl_hub_resolve("org/absent", out, sizeof out, &w) == FL_ERR_NOT_FOUND && w == FL_HUB_NOWHERE);
    FL_CHECKF(strstr(fl_error_message(), cache) && strstr(fl_error_message(), "`fitllm download org/absent`"), "%s",
              fl_error_message());
    FL_CHECK(fl_hub_resolve("checkpoints/org/absent", out, sizeof out, &w) == FL_ERR_NOT_FOUND);
    /* FITLLM_CHECKPOINTS names another folder: the command says where the recipe looks */
    FL_CHECKF(strstr(fl_error_message(), "`fitllm download org/absent --checkpoint_dir checkpoints`"), "%s",
              fl_error_message());
    /* fitllm's download folder comes first */
    snprintf(p, sizeof p, "%s/org/model", dl);
    mkdirs(p);
    snprintf(p, sizeof p, "%s/org/model/config.json", dl);
    put(p, "{}");
    FL_REQUIRE_OK(fl_hub_resolve("org/model", out, sizeof out, &w));
    snprintf(p, sizeof p, "%s/org/model", dl);
    FL_CHECKF(!strcmp(out, p) && w == FL_HUB_DOWNLOAD_DIR, "%s", out);
    /* not a repo id: the caller's business (a preset) */
    FL_CHECK(fl_hub_resolve("gpt2", out, sizeof out, &w) == FL_ERR_INVALID);
    for (int i = 1; i >= 0; i--) env_restore(&e[i]);
}

static int pick(const char *const *names, int n, int tok_only, const char *want, const char *want_index,
                const char *want_weights) {
    char buf[4096], index[256], got[4096] = "";
    int np;
    const char *weights;
    if (fl_hub_pick_files(names, n, tok_only, buf, sizeof buf, &np, index, sizeof index, &weights) != FL_OK) {
        fl_test_fail(__FILE__, __LINE__, "pick: %s", fl_error_message());
        return 0;
    }
    const char *f = buf;
    for (int i = 0; i < np; i++, f += strlen(f) + 1) {
        strcat(got, i ? " " : "");
        strcat(got, f);
    }
    int ok = !strcmp(got, want) && !strcmp(index, want_index) && !strcmp(weights, want_weights);
    if (!ok) fl_test_fail(__FILE__, __LINE__, "picked '%s' (index '%s', %s), want '%s'", got, index, weights, want);
    return ok;
}

FL_TEST(hub_pick_files) {
    /* safetensors preferred over .bin; subfolders, other formats and READMEs left out; config.json last */
    static const char *both[] = {"README.md", ".gitattributes", "config.json", "model.safetensors", "pytorch_model.bin",
                                 "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                                 "generation_config.json", "onnx/model.onnx", "original/tokenizer.model", "flax_model.msgpack"};
    pick(both, 13, 0,
         "model.safetensors tokenizer.json tokenizer_config.json tokenizer.model special_tokens_map.json "
         "generation_config.json config.json", "", "safetensors");
    static const char *sharded[] = {"config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                    "model.safetensors.index.json", "pytorch_model.bin.index.json",
                                    "pytorch_model-00001-of-00002.bin", "vocab.json", "merges.txt"};
    pick(sharded, 8, 0, "model.safetensors.index.json vocab.json merges.txt config.json", "model.safetensors.index.json",
         "safetensors");
    static const char *bins[] = {"config.json", "pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin",
                                 "tokenizer.model"};
    pick(bins, 4, 0, "pytorch_model.bin.index.json tokenizer.model config.json", "pytorch_model.bin.index.json", "bin");
    static const char *bin1[] = {"pytorch_model.bin", "config.json"};
    pick(bin1, 2, 0, "pytorch_model.bin config.json", "", "bin");
    pick(both, 13, 1, "tokenizer.json tokenizer_config.json tokenizer.model special_tokens_map.json "
                      "generation_config.json config.json", "", "");
    /* refused: no config.json; no weights fitllm reads */
    char buf[512];
    int np;
    static const char *nocfg[] = {"model.safetensors", "tokenizer.json"};
    FL_CHECK(fl_hub_pick_files(nocfg, 2, 0, buf, sizeof buf, &np, NULL, 0, NULL) == FL_ERR_NOT_FOUND);
    FL_CHECKF(strstr(fl_error_message(), "config.json"), "%s", fl_error_message());
    static const char *now[] = {"config.json", "model.gguf", "onnx/model.safetensors"};
    FL_CHECK(fl_hub_pick_files(now, 3, 0, buf, sizeof buf, &np, NULL, 0, NULL) == FL_ERR_NOT_FOUND);
    FL_CHECKF(strstr(fl_error_message(), "no weights"), "%s", fl_error_message());
    FL_CHECK(fl_hub_pick_files(now, 3, 1, buf, sizeof buf, &np, NULL, 0, NULL) == FL_OK && np == 1);
}

FL_TEST(hub_download_refusals) {
    /* the checks before any network: a bad repo id; a build without libcurl says so */
    fl_hub_download_opts o = {.repo = "not a repo"};
    FL_CHECK(fl_hub_download(&o, NULL, 0) == (fl_hub_download_built() ? FL_ERR_INVALID : FL_ERR_UNSUPPORTED));
    if (fl_hub_download_built()) FL_CHECKF(strstr(fl_error_message(), "ORG/NAME"), "%s", fl_error_message());
    else FL_CHECKF(strstr(fl_error_message(), "without libcurl"), "%s", fl_error_message());
}

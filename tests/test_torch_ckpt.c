/* PyTorch checkpoints in (src/io/torch_zip.c, torch_pickle.c, torch_lit.c): files written
 * by real torch (tests/ref/make_torch_fixtures.py) load bit for bit as their safetensors
 * twins; hostile or broken files (crafted here with a small zip/pickle writer) are refused
 * by name and nothing in them runs. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fitllm/io.h"
#include "fitllm/mem.h"
#include "fitllm/torch_ckpt.h"
#include "test.h"

#define FX "tests/fixtures/torch/"

static int has(const char *s) { return strstr(fl_error_message(), s) != NULL; }
#define CHECK_MSG(s) FL_CHECKF(has(s), "message lacks '%s': %s", s, fl_error_message())

/* Every tensor of `got` equals the same-named one of `ref`: dtype, shape, bytes. Returns the count. */
static int same_tensors(const fl_st_file *got, const fl_st_file *ref) {
    int n = 0;
    for (int i = 0; i < got->n_tensors; i++) {
        const fl_st_tensor *a = &got->tensors[i], *b = fl_st_find(ref, a->name);
        FL_CHECKF(b != NULL, "%s: '%s' not in the reference", got->path, a->name);
        if (!b) continue;
        FL_CHECKF(a->dtype == b->dtype && a->ndim == b->ndim && !memcmp(a->shape, b->shape, sizeof a->shape[0] * (size_t)a->ndim),
                  "%s: '%s' dtype/shape differ", got->path, a->name);
        FL_CHECKF(a->end - a->begin == b->end - b->begin && !memcmp(a->data, b->data, b->end - b->begin),
                  "%s: '%s' bytes differ", got->path, a->name);
        n++;
    }
    return n;
}

FL_TEST(torch_tensors_equal_safetensors) {
    fl_st_file ref, f;
    FL_REQUIRE_OK(fl_st_open(&ref, FX "tiny-st/model.safetensors"));
    FL_REQUIRE_OK(fl_torch_open(&f, FX "tiny-bin/pytorch_model.bin"));
    FL_CHECK(f.n_tensors == ref.n_tensors && same_tensors(&f, &ref) == ref.n_tensors);
    /* layer 0's q, k, v are slices of one storage: the same entry at increasing offsets */
    const fl_st_tensor *q = fl_st_find(&f, "model.layers.0.self_attn.q_proj.weight"),
                       *k = fl_st_find(&f, "model.layers.0.self_attn.k_proj.weight");
    FL_REQUIRE(q && k);
    FL_CHECK(k->begin == q->end);
    fl_st_close(&f);
    int total = 0;
    const char *sh[] = {FX "tiny-sharded/pytorch_model-00001-of-00002.bin", FX "tiny-sharded/pytorch_model-00002-of-00002.bin"};
    for (int i = 0; i < 2; i++) {
        FL_REQUIRE_OK(fl_weights_open(&f, sh[i]));
        total += same_tensors(&f, &ref);
        fl_st_close(&f);
    }
    FL_CHECK(total == ref.n_tensors);
    fl_st_close(&ref);
}

/* The folders load into the same parameters as the safetensors folder. */
FL_TEST(torch_model_folders_load) {
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "torch", 0));
    fl_model ref, m;
    FL_REQUIRE_OK(fl_hf_load_model(&ref, FX "tiny-st", NULL, &pool));
    const char *dirs[] = {FX "tiny-bin", FX "tiny-sharded", FX "tiny-lit", FX "tiny-lit-old"};
    for (int i = 0; i < 4; i++) {
        fl_status s = fl_hf_load_model(&m, dirs[i], NULL, &pool);
        FL_CHECKF(s == FL_OK, "%s: %s", dirs[i], fl_error_message());
        if (s != FL_OK) continue;
        FL_CHECKF(m.layout.numel == ref.layout.numel && !memcmp(fl_model_params_f32(&m), fl_model_params_f32(&ref), ref.layout.numel * sizeof(float)),
                  "%s: parameters differ from tiny-st", dirs[i]);
        fl_model_free(&m);
    }
    int loaded = 0;
    FL_REQUIRE_OK(fl_model_load_auto(&m, FX "tiny-lit", NULL, &pool, &loaded));
    FL_CHECK(loaded && !memcmp(fl_model_params_f32(&m), fl_model_params_f32(&ref), ref.layout.numel * sizeof(float)));
    fl_model_free(&m);
    /* LitGPT's own folder: model_config.yaml instead of config.json, the same model */
    loaded = 0;
    FL_REQUIRE_OK(fl_model_load_auto(&m, FX "tiny-lit-yaml", NULL, &pool, &loaded));
    FL_CHECK(loaded && m.cfg.n_layers == ref.cfg.n_layers && m.cfg.n_kv_heads == ref.cfg.n_kv_heads &&
             m.cfg.vocab_size == ref.cfg.vocab_size && m.cfg.ffn_dim == ref.cfg.ffn_dim && !m.cfg.tie_embeddings &&
             m.cfg.norm_eps == ref.cfg.norm_eps && m.cfg.rope_theta == ref.cfg.rope_theta);
    FL_CHECK(m.layout.numel == ref.layout.numel && !memcmp(fl_model_params_f32(&m), fl_model_params_f32(&ref), ref.layout.numel * sizeof(float)));
    fl_model_free(&m);
    fl_model_free(&ref);
    FL_CHECK(fl_mem_live_count(&pool) == 0);
    fl_mem_pool_free(&pool);
}

/* Real TinyStories weights saved by torch in bfloat16: each element is torch's rounding of the
 * fp32 safetensors value, which must equal ours (round to nearest even) bit for bit. */
FL_TEST(torch_stories_bf16) {
    FL_SKIP_IF_NO_DATA();
    fl_st_file ref, f;
    FL_REQUIRE_OK(fl_st_open(&ref, fl_test_data_path("stories260K-hf/model.safetensors")));
    FL_REQUIRE_OK(fl_torch_open(&f, FX "stories260K-bf16/pytorch_model.bin"));
    FL_CHECK(f.n_tensors == ref.n_tensors);
    size_t bad = 0, n = 0;
    for (int i = 0; i < f.n_tensors; i++) {
        const fl_st_tensor *a = &f.tensors[i], *b = fl_st_find(&ref, a->name);
        FL_REQUIRE(b && a->dtype == FL_BF16 && b->dtype == FL_F32);
        size_t ne = (b->end - b->begin) / 4;
        FL_REQUIRE(a->end - a->begin == 2 * ne);
        for (size_t j = 0; j < ne; j++, n++) {
            float x;
            uint16_t h;
            memcpy(&x, (const char *)b->data + 4 * j, 4);
            memcpy(&h, (const char *)a->data + 2 * j, 2);
            bad += h != fl_f32_to_bf16(x);
        }
    }
    FL_CHECKF(bad == 0 && n > 200000, "%zu of %zu elements differ", bad, n);
    fl_st_close(&f);
    fl_st_close(&ref);
}

FL_TEST(torch_refuses_evil_and_legacy) {
    const char *marker = "/tmp/fitllm-torch-pwned";
    unlink(marker);
    fl_st_file f;
    FL_CHECK(fl_torch_open(&f, FX "evil.bin") == FL_ERR_FORMAT);
    CHECK_MSG("evil.bin: pickle global posix.system is not allowed (only torch state dicts are read");
    struct stat st;
    FL_CHECK(stat(marker, &st) != 0);
    FL_CHECK(fl_torch_open(&f, FX "legacy.bin") == FL_ERR_UNSUPPORTED);
    CHECK_MSG("legacy.bin: a legacy (non-zip) torch.save file");
    FL_CHECK(fl_torch_open(&f, FX "tiny-st/model.safetensors") == FL_ERR_FORMAT);
    CHECK_MSG("not a PyTorch checkpoint");
    FL_CHECK(fl_torch_open(&f, FX "nope.bin") == FL_ERR_NOT_FOUND);
}

/* ---- a small writer of torch-style zips and pickles ------------------------------------ */

typedef struct {
    uint8_t b[8192];
    size_t n;
} buf;

static void put(buf *x, const void *p, size_t n) {
    if (x->n + n <= sizeof x->b) memcpy(x->b + x->n, p, n);
    x->n += n;
}
static void put_le(buf *x, uint64_t v, int k) {
    for (int i = 0; i < k; i++) { uint8_t c = (uint8_t)(v >> (8 * i)); put(x, &c, 1); }
}
static void put_s(buf *x, const char *s) { put(x, s, strlen(s)); }
static void put_uni(buf *x, const char *s) { put_s(x, "X"); put_le(x, strlen(s), 4); put_s(x, s); }

typedef struct {
    const char *name;
    const void *data;
    size_t len;
    int method;
} zent;

/* Entries as local header + data, then the central directory, zip64 end records (as torch
 * writes them) when z64, and the end record. */
static void make_zip(buf *z, const zent *e, int n, int z64) {
    uint64_t off[16];
    z->n = 0;
    for (int i = 0; i < n; i++) {
        off[i] = z->n;
        put_le(z, 0x04034b50, 4); put_le(z, 20, 2); put_le(z, 0, 2); put_le(z, (uint64_t)e[i].method, 2);
        put_le(z, 0, 4); put_le(z, 0, 4); put_le(z, e[i].len, 4); put_le(z, e[i].len, 4);
        put_le(z, strlen(e[i].name), 2); put_le(z, 0, 2); put_s(z, e[i].name);
        put(z, e[i].data, e[i].len);
    }
    uint64_t cd = z->n;
    for (int i = 0; i < n; i++) {
        put_le(z, 0x02014b50, 4); put_le(z, 20, 2); put_le(z, 20, 2); put_le(z, 0, 2); put_le(z, (uint64_t)e[i].method, 2);
        put_le(z, 0, 4); put_le(z, 0, 4); put_le(z, e[i].len, 4); put_le(z, e[i].len, 4);
        put_le(z, strlen(e[i].name), 2); put_le(z, 0, 2); put_le(z, 0, 2); put_le(z, 0, 2); put_le(z, 0, 2);
        put_le(z, 0, 4); put_le(z, off[i], 4); put_s(z, e[i].name);
    }
    uint64_t cds = z->n - cd;
    if (z64) {
        uint64_t at = z->n;
        put_le(z, 0x06064b50, 4); put_le(z, 44, 8); put_le(z, 45, 2); put_le(z, 45, 2); put_le(z, 0, 4); put_le(z, 0, 4);
        put_le(z, (uint64_t)n, 8); put_le(z, (uint64_t)n, 8); put_le(z, cds, 8); put_le(z, cd, 8);
        put_le(z, 0x07064b50, 4); put_le(z, 0, 4); put_le(z, at, 8); put_le(z, 1, 4);
    }
    put_le(z, 0x06054b50, 4); put_le(z, 0, 2); put_le(z, 0, 2); put_le(z, (uint64_t)n, 2); put_le(z, (uint64_t)n, 2);
    put_le(z, z64 ? 0xffffffffu : cds, 4); put_le(z, z64 ? 0xffffffffu : cd, 4); put_le(z, 0, 2);
}

/* {"w": tensor of `shape` (ndim 1 or 2) over storage '0' of `numel` floats at `offset`, strides given} */
static void tensor_pickle(buf *p, int64_t numel, int64_t offset, int ndim, const int64_t *shape, const int64_t *stride,
                          const char *storage_cls) {
    p->n = 0;
    put_s(p, "\x80\x02}(");
    put_uni(p, "w");
    put_s(p, "ctorch._utils\n_rebuild_tensor_v2\n((");
    put_uni(p, "storage");
    put_s(p, "ctorch\n"); put_s(p, storage_cls); put_s(p, "\n");
    put_uni(p, "0");
    put_uni(p, "cpu");
    put_s(p, "J"); put_le(p, (uint64_t)numel, 4);
    put_s(p, "tQ");
    put_s(p, "J"); put_le(p, (uint64_t)offset, 4);
    put_s(p, "(");
    for (int d = 0; d < ndim; d++) { put_s(p, "J"); put_le(p, (uint64_t)shape[d], 4); }
    put_s(p, "t(");
    for (int d = 0; d < ndim; d++) { put_s(p, "J"); put_le(p, (uint64_t)stride[d], 4); }
    put_s(p, "t\x89" "ccollections\nOrderedDict\n)RtRu.");
}

static fl_status open_zip(fl_st_file *f, const buf *z) { return fl_torch_open_mem(f, z->b, z->n, "crafted.bin"); }

/* A crafted archive with data.pkl = p and storage '0' of `sbytes` bytes. */
static fl_status open_crafted(fl_st_file *f, buf *z, const buf *p, size_t sbytes, int z64, int method) {
    static float data[64];
    for (int i = 0; i < 64; i++) data[i] = (float)i;
    zent e[] = {{"archive/data.pkl", p->b, p->n, 0}, {"archive/byteorder", "little", 6, 0},
                {"archive/data/0", data, sbytes, method}, {"archive/version", "3\n", 2, 0}};
    make_zip(z, e, 4, z64);
    return open_zip(f, z);
}

FL_TEST(torch_crafted_valid) {
    buf p, z;
    fl_st_file f;
    int64_t shape[2] = {3, 4}, stride[2] = {4, 1};
    tensor_pickle(&p, 16, 2, 2, shape, stride, "FloatStorage");
    for (int z64 = 0; z64 < 2; z64++) {
        FL_REQUIRE_OK(open_crafted(&f, &z, &p, 64, z64, 0));
        FL_REQUIRE(f.n_tensors == 1 && !strcmp(f.tensors[0].name, "w") && f.tensors[0].dtype == FL_F32);
        FL_CHECK(f.tensors[0].ndim == 2 && f.tensors[0].shape[0] == 3 && f.tensors[0].shape[1] == 4);
        float v[12];
        memcpy(v, f.tensors[0].data, sizeof v);
        FL_CHECK(v[0] == 2.0f && v[11] == 13.0f); /* the storage offset of 2 elements */
        fl_st_close(&f);
    }
}

FL_TEST(torch_refuses_malicious_pickles) {
    struct { const char *pkl; size_t n; const char *msg; } cases[] = {
#define P(s) s, sizeof(s) - 1
        {P("\x80\x02" "cos\nsystem\nX\x02\x00\x00\x00id\x85R."), "crafted.bin: pickle global os.system is not allowed (only torch state dicts are read"},
        {P("\x80\x02" "cbuiltins\neval\nX\x01\x00\x00\x00" "1\x85R."), "pickle global builtins.eval is not allowed"},
        {P("\x80\x02" "ctorch.storage\n_load_from_bytes\nX\x01\x00\x00\x00" "a\x85R."), "pickle global torch.storage._load_from_bytes is not allowed"},
        {P("\x80\x04\x8c\x05posix\x8c\x06system\x93X\x02\x00\x00\x00id\x85R."), "pickle global posix.system is not allowed"},
        {P("\x80\x02(X\x02\x00\x00\x00idios\nsystem\n."), "pickle opcode INST (0x69)"},
        {P("\x80\x02" "ctorch\nFloatStorage\n)R."), "REDUCE of a torch storage class is not allowed"},
        {P("\x80\x02" "ccollections\nOrderedDict\nX\x01\x00\x00\x00" "a\x85R."), "OrderedDict called with arguments"},
        {P("\x80\x02}X\x01\x00\x00\x00" "a"), "ends without STOP"},
        {P("\x80\x02}h\x05."), "memo GET of index 5 that was never PUT"},
        {P("\x80\x02}X\x01\x00\x00\x00" "aK\x01s."), "state dict entry 'a' is a int, not a tensor"},
        {P("\x80\x02]."), "pickle opcode EMPTY_LIST"},
        {P("\x80\x02X\xff\xff\xff\x7f."), "string runs past the end"},
#undef P
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        buf p = {.n = 0}, z;
        put(&p, cases[i].pkl, cases[i].n);
        fl_st_file f;
        fl_status s = open_crafted(&f, &z, &p, 64, 0, 0);
        FL_CHECKF(s != FL_OK && has(cases[i].msg), "case %zu: %s", i, fl_error_message());
        if (s == FL_OK) fl_st_close(&f);
    }
}

FL_TEST(torch_refuses_bad_storages_and_zips) {
    buf p, z;
    fl_st_file f;
    int64_t shape[2] = {3, 4}, stride[2] = {4, 1}, tstride[2] = {1, 3};
    tensor_pickle(&p, 16, 6, 2, shape, stride, "FloatStorage"); /* 6 + 12 > 16 */
    FL_CHECK(open_crafted(&f, &z, &p, 64, 0, 0) == FL_ERR_FORMAT);
    CHECK_MSG("tensor 'w': offset 6 + 12 elements run past its storage '0' of 16 elements");
    tensor_pickle(&p, 16, 0, 2, shape, stride, "FloatStorage");
    FL_CHECK(open_crafted(&f, &z, &p, 60, 0, 0) == FL_ERR_FORMAT); /* entry shorter than the storage */
    CHECK_MSG("storage 'archive/data/0' should hold 16 F32 elements but its entry has 60 bytes");
    tensor_pickle(&p, 16, 0, 2, shape, tstride, "FloatStorage");
    FL_CHECK(open_crafted(&f, &z, &p, 64, 0, 0) == FL_ERR_UNSUPPORTED);
    CHECK_MSG("tensor 'w' is not contiguous");
    tensor_pickle(&p, 16, 0, 2, shape, stride, "BoolStorage");
    FL_CHECK(open_crafted(&f, &z, &p, 64, 0, 0) == FL_ERR_UNSUPPORTED);
    CHECK_MSG("torch.BoolStorage are not supported");
    tensor_pickle(&p, 16, 0, 2, shape, stride, "FloatStorage");
    FL_CHECK(open_crafted(&f, &z, &p, 64, 0, 8) == FL_ERR_UNSUPPORTED);
    CHECK_MSG("crafted.bin: entry 'archive/data/0' is compressed (zip method 8)");
    /* zip64 records that point nowhere */
    FL_REQUIRE_OK(open_crafted(&f, &z, &p, 64, 1, 0));
    fl_st_close(&f);
    z.b[z.n - 22 - 20 + 8] ^= 0x40; /* the locator's record offset */
    FL_CHECK(open_zip(&f, &z) == FL_ERR_FORMAT);
    CHECK_MSG("zip64 end record locator points outside the file");
    /* a data entry missing from the zip */
    static float d[16];
    zent e[] = {{"archive/data.pkl", p.b, p.n, 0}};
    make_zip(&z, e, 1, 0);
    FL_CHECK(open_zip(&f, &z) == FL_ERR_FORMAT);
    CHECK_MSG("its storage entry 'archive/data/0' is not in the zip");
    zent e2[] = {{"archive/data/0", d, 64, 0}};
    make_zip(&z, e2, 1, 0);
    FL_CHECK(open_zip(&f, &z) == FL_ERR_FORMAT);
    CHECK_MSG("without <archive>/data.pkl");
    zent e3[] = {{"archive/data.pkl", p.b, p.n, 0}, {"archive/byteorder", "big", 3, 0}, {"archive/data/0", d, 64, 0}};
    make_zip(&z, e3, 3, 0);
    FL_CHECK(open_zip(&f, &z) == FL_ERR_UNSUPPORTED);
    CHECK_MSG("big-endian");
}

/* Every truncation of a real torch file is refused cleanly (no crash, no tensor past the end). */
FL_TEST(torch_truncated_files) {
    FILE *fp = fopen(FX "tiny-sharded/pytorch_model-00001-of-00002.bin", "rb");
    FL_REQUIRE(fp);
    static uint8_t b[1 << 16];
    size_t n = fread(b, 1, sizeof b, fp);
    fclose(fp);
    FL_REQUIRE(n > 1000 && n < sizeof b);
    int ok = 0;
    for (size_t k = 0; k < n; k += (k + 300 < n && k > 300) ? 97 : 1) {
        fl_st_file f;
        uint8_t *c = malloc(k + 1); /* exactly k bytes valid: ASan sees any read past them */
        memcpy(c, b, k);
        fl_status s = fl_torch_open_mem(&f, c, k, "cut.bin");
        if (s == FL_OK) { ok++; fl_st_close(&f); }
        else FL_CHECKF(s == FL_ERR_FORMAT || s == FL_ERR_UNSUPPORTED, "cut at %zu: %s", k, fl_error_message());
        free(c);
    }
    FL_CHECK(ok == 0);
}

/* fitllm convert: the same bytes as the safetensors twin; a failure at any write leaves nothing. */
FL_TEST(torch_convert_atomic) {
    const char *td = fl_test_tmpdir(); /* a new folder each call: taken once */
    char dst[512];
    snprintf(dst, sizeof dst, "%s/out", td);
    int n = 0;
    FL_REQUIRE_OK(fl_hf_convert(FX "tiny-sharded", dst, &n));
    FL_CHECK(n == 21);
    char p[600];
    snprintf(p, sizeof p, "%s/model.safetensors", dst);
    fl_st_file a, b;
    FL_REQUIRE_OK(fl_st_open(&a, p));
    FL_REQUIRE_OK(fl_st_open(&b, FX "tiny-st/model.safetensors"));
    FL_CHECK(a.map_size == b.map_size && !memcmp(a.map, b.map, a.map_size));
    fl_st_close(&a);
    fl_st_close(&b);
    snprintf(dst, sizeof dst, "%s/yaml", td); /* a LitGPT folder: config.json written from model_config.yaml */
    FL_REQUIRE_OK(fl_hf_convert(FX "tiny-lit-yaml", dst, NULL));
    snprintf(p, sizeof p, "%s/model.safetensors", dst);
    FL_REQUIRE_OK(fl_st_open(&a, p));
    FL_REQUIRE_OK(fl_st_open(&b, FX "tiny-st/model.safetensors"));
    FL_CHECK(a.map_size == b.map_size && !memcmp(a.map, b.map, a.map_size));
    fl_st_close(&a);
    fl_st_close(&b);
    fl_model_config c;
    snprintf(p, sizeof p, "%s/config.json", dst);
    FL_REQUIRE_OK(fl_hf_load_config(p, &c));
    FL_CHECK(c.n_layers == 2 && c.n_heads == 4 && c.n_kv_heads == 2 && c.dim == 32 && c.vocab_size == 64);
    FL_CHECK(fl_hf_convert(FX "tiny-bin", dst, NULL) == FL_ERR_INVALID);
    CHECK_MSG("already exists");
    fl_io_fail_writes_after(1000000);
    snprintf(dst, sizeof dst, "%s/count", td);
    FL_REQUIRE_OK(fl_hf_convert(FX "tiny-lit", dst, NULL));
    long writes = 1000000 - fl_io_writes_left();
    fl_io_fail_writes_after(-1);
    FL_REQUIRE(writes > 2);
    for (long k = 0; k < writes; k++) {
        snprintf(dst, sizeof dst, "%s/f%ld", td, k);
        fl_io_fail_writes_after(k);
        fl_status s = fl_hf_convert(FX "tiny-lit", dst, NULL);
        fl_io_fail_writes_after(-1);
        FL_CHECKF(s == FL_ERR_IO, "write %ld failing: %s", k, fl_status_name(s));
    }
    /* nothing but the three good outputs in the folder: no f<k>, no temp folders */
    char cmd[700];
    snprintf(cmd, sizeof cmd, "test $(ls -A '%s' | wc -l) -eq 3", td);
    FL_CHECK(system(cmd) == 0);
}

/* torch.save with pickle_protocol=4 (FRAME, MEMOIZE, SHORT_BINUNICODE, STACK_GLOBAL) and an
 * nn.Parameter (_rebuild_parameter) read as well; float64 and zero-dim tensors too. */
FL_TEST(torch_protocol4_and_parameters) {
    fl_st_file f;
    FL_REQUIRE_OK(fl_torch_open(&f, "fuzz/seeds-torch/proto4.bin"));
    const fl_st_tensor *c = fl_st_find(&f, "c"), *e = fl_st_find(&f, "e");
    FL_REQUIRE(f.n_tensors == 5 && c && e);
    float v[4];
    double x;
    memcpy(v, c->data, sizeof v); /* a[2:] of arange(6) */
    memcpy(&x, e->data, sizeof x);
    FL_CHECK(c->ndim == 1 && c->shape[0] == 4 && v[0] == 2.0f && v[3] == 5.0f);
    FL_CHECK(e->ndim == 0 && e->dtype == FL_F64 && x == 1.5);
    fl_st_close(&f);
    FL_REQUIRE_OK(fl_torch_open(&f, "fuzz/seeds-torch/param.bin"));
    FL_CHECK(f.n_tensors == 1 && !strcmp(f.tensors[0].name, "x") && f.tensors[0].shape[0] == 2);
    fl_st_close(&f);
}

/* convert refused an inf/NaN weight no more than the loaders do: it copied it without a word. The loaders' refusal,
 * naming file, tensor and element, and nothing written. */
FL_TEST(torch_convert_refuses_nonfinite) {
    const char *td = fl_test_tmpdir();
    char src[512], p[600], dst[512];
    snprintf(src, sizeof src, "%s/nan", td);
    FL_REQUIRE(mkdir(src, 0755) == 0);
    size_t nc = 0, nw = 0;
    char *cfg = fl_test_slurp(FX "tiny-st/config.json", &nc), *w = fl_test_slurp(FX "tiny-st/model.safetensors", &nw);
    FL_REQUIRE(cfg && w);
    fl_st_file f;
    FL_REQUIRE_OK(fl_st_open(&f, FX "tiny-st/model.safetensors"));
    const char *name = "model.layers.1.mlp.down_proj.weight";
    const fl_st_tensor *t = fl_st_find(&f, name);
    FL_REQUIRE(t && t->dtype == FL_F16); /* the fixture mixes F32, BF16 and F16 */
    const uint16_t inf16 = 0x7c00;
    memcpy(w + ((const char *)t->data - (const char *)f.map) + 3 * sizeof inf16, &inf16, sizeof inf16); /* element 3 */
    fl_st_close(&f);
    snprintf(p, sizeof p, "%s/config.json", src);
    FILE *o = fopen(p, "wb");
    FL_REQUIRE(o && fwrite(cfg, 1, nc, o) == nc && fclose(o) == 0);
    snprintf(p, sizeof p, "%s/model.safetensors", src);
    o = fopen(p, "wb");
    FL_REQUIRE(o && fwrite(w, 1, nw, o) == nw && fclose(o) == 0);
    free(cfg), free(w);
    snprintf(dst, sizeof dst, "%s/out", td);
    FL_CHECK(fl_hf_convert(src, dst, NULL) == FL_ERR_FORMAT);
    CHECK_MSG("nan/model.safetensors: tensor 'model.layers.1.mlp.down_proj.weight' holds a non-finite value (inf/NaN) "
              "at element 3");
    char cmd[700]; /* only the source folder: no out, no temp folder */
    snprintf(cmd, sizeof cmd, "test \"$(ls -A '%s')\" = nan", td);
    FL_CHECK(system(cmd) == 0);
}

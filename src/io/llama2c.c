/* llama2.c v0 .bin checkpoints -> LLaMA model in HF layout.
 *
 * llama2.c keeps wq/wk rows in Meta's interleaved RoPE order (pairs (2j,2j+1)
 * within a head); HF LLaMA rotates halves (pairs (j, j+hd/2)). We apply the
 * row permutation of HF's convert_llama_weights_to_hf.py `permute`:
 *   w.view(n_heads, hd/2, 2, dim).transpose(1, 2).reshape(n_heads*hd, dim)
 * i.e. hf_row[h*hd + t*hd/2 + i] = meta_row[h*hd + 2*i + t].
 */
#include "fitllm/io.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* dst (dtype dt) = src rows permuted from llama2.c's interleaved RoPE halves to HF's (n_heads
 * blocks of hd rows of cols floats; n_heads = 0: no permutation), converted row by row. */
static void fl_llama2c_put_rows(void *dst, fl_dtype dt, const float *src, int n_heads, int hd, int cols, size_t numel) {
    size_t ds = fl_dtype_size(dt);
    if (!n_heads) {
        fl_convert(dst, dt, src, FL_F32, numel);
        return;
    }
    int half = hd / 2;
    for (int h = 0; h < n_heads; h++)
        for (int t = 0; t < 2; t++)
            for (int i = 0; i < half; i++)
                fl_convert((char *)dst + ((size_t)h * hd + (size_t)t * half + i) * cols * ds, dt,
                           src + ((size_t)h * hd + 2 * (size_t)i + t) * cols, FL_F32, (size_t)cols);
}

/* Elements [k0, k1) of a tensor (HF order, rows of cols) into dst (dtype dt): each row's segment
 * converted from its source row (permuted as fl_llama2c_put_rows permutes; n_heads = 0: none), the
 * same fp32 -> dt rounding as the whole tensor's. Device storage: through one host buffer of the
 * range, copied in. */
static fl_status fl_llama2c_put_range(fl_model *m, const char *path, const char *name, char *dst, fl_dtype dt,
                                      const float *src, size_t k0, size_t k1, int n_heads, size_t cols) {
    const size_t ds = fl_dtype_size(dt), hd = (size_t)m->cfg.head_dim, half = hd / 2;
    const int dev = m->be && !fl_backend_host_memory(m->be);
    char *h = dev ? malloc((k1 - k0) * ds + 1) : dst;
    if (!h) return fl_errorf(FL_ERR_OOM, "%s: out of host memory loading '%s'", path, name);
    for (size_t a = k0; a < k1;) {
        const size_t r = a / cols, e = (r + 1) * cols < k1 ? (r + 1) * cols : k1; /* row r's segment [a, e) */
        size_t sr = r;
        if (n_heads) {
            const size_t hh = r / hd, rem = r % hd;
            sr = hh * hd + 2 * (rem % half) + rem / half; /* hf row h*hd + t*half + i <- meta row h*hd + 2i + t */
        }
        fl_convert(h + (a - k0) * ds, dt, src + sr * cols + (a - r * cols), FL_F32, e - a);
        a = e;
    }
    fl_status s = dev ? FL_RUN(fl_model_params_be(m), to_device, dst, h, (k1 - k0) * ds) : FL_OK;
    if (dev) free(h);
    return s;
}

static fl_status fl_llama2c_put(fl_model *m, const char *path, const char *name, const float *src, size_t numel,
                                int permute_heads) {
    int k = fl_layout_find(&m->layout, name);
    if (k < 0) return fl_errorf(FL_ERR_INTERNAL, "%s: layout has no tensor '%s'", path, name);
    const fl_param_info *p = &m->layout.params[k];
    if (p->numel != numel)
        return fl_errorf(FL_ERR_INTERNAL, "%s: tensor '%s': layout has %zu elements, checkpoint %zu", path, name, p->numel, numel);
    fl_dtype dt;
    if (fl_model_provider(m)) { /* sharded (FSDP FULL_SHARD): this rank's piece alone, fl_model_param_piece */
        size_t k0, k1;
        char *dst = fl_model_param_piece(m, k, &k0, &k1, &dt);
        return dst ? fl_llama2c_put_range(m, path, name, dst, dt, src, k0, k1, permute_heads,
                                          p->ndim == 2 ? (size_t)p->shape[1] : numel)
                   : FL_OK;
    }
    void *data = fl_model_param_data(m, k, &dt);
    if (data && m->be && !fl_backend_host_memory(m->be)) { /* device storage: permuted on the host (one tensor), written in */
        float *tmp = malloc(numel * sizeof(float) + 1);
        if (!tmp) return fl_errorf(FL_ERR_OOM, "%s: out of host memory loading '%s'", path, name);
        fl_llama2c_put_rows(tmp, FL_F32, src, permute_heads, m->cfg.head_dim, (int)p->shape[1], numel);
        fl_model_write_param(m, k, tmp);
        free(tmp);
        return FL_OK;
    }
    if (data) { /* dense storage (fp32 or 16-bit): converted straight into it */
        fl_llama2c_put_rows(data, dt, src, permute_heads, m->cfg.head_dim, (int)p->shape[1], numel);
        return FL_OK;
    }
    /* a 4-bit entry: through the pool's fp32 staging, then quantized whole */
    float *tmp = NULL;
    FL_TRY(fl_model_q4_staging(m, &tmp));
    if (!tmp) return fl_errorf(FL_ERR_INTERNAL, "%s: '%s': no 4-bit staging", path, name);
    fl_llama2c_put_rows(tmp, FL_F32, src, permute_heads, m->cfg.head_dim, (int)p->shape[1], numel);
    fl_model_write_param(m, k, tmp);
    fl_mem_free(fl_mem_host_pool(m->pool), tmp);
    return FL_OK;
}

static fl_status fl_llama2c_fill(fl_model *m, const char *path, const float *w, int shared) {
    const fl_model_config *c = &m->cfg;
    size_t C = (size_t)c->dim, F = (size_t)c->ffn_dim, L = (size_t)c->n_layers, V = (size_t)c->vocab_size;
    size_t KV = (size_t)c->n_kv_heads * c->head_dim, HS = (size_t)c->head_dim, T = (size_t)c->max_seq;
    const float *emb = w;                w += V * C;
    const float *rms_att = w;            w += L * C;
    const float *wq = w;                 w += L * C * C;
    const float *wk = w;                 w += L * KV * C;
    const float *wv = w;                 w += L * KV * C;
    const float *wo = w;                 w += L * C * C;
    const float *rms_ffn = w;            w += L * C;
    const float *w1 = w;                 w += L * F * C;
    const float *w2 = w;                 w += L * C * F;
    const float *w3 = w;                 w += L * F * C;
    const float *rms_final = w;          w += C;
    w += T * HS / 2;                     /* freq_cis_real */
    w += T * HS / 2;                     /* freq_cis_imag */
    const float *wcls = shared ? NULL : w;
    char nm[FL_PARAM_NAME_MAX];
    FL_TRY(fl_llama2c_put(m, path, "model.embed_tokens.weight", emb, V * C, 0));
    for (size_t l = 0; l < L; l++) {
#define PUT(fmt, src, n, perm) \
    (snprintf(nm, sizeof nm, "model.layers.%zu." fmt, l), fl_llama2c_put(m, path, nm, src, n, perm))
        FL_TRY(PUT("input_layernorm.weight", rms_att + l * C, C, 0));
        FL_TRY(PUT("self_attn.q_proj.weight", wq + l * C * C, C * C, c->n_heads));
        FL_TRY(PUT("self_attn.k_proj.weight", wk + l * KV * C, KV * C, c->n_kv_heads));
        FL_TRY(PUT("self_attn.v_proj.weight", wv + l * KV * C, KV * C, 0));
        FL_TRY(PUT("self_attn.o_proj.weight", wo + l * C * C, C * C, 0));
        FL_TRY(PUT("post_attention_layernorm.weight", rms_ffn + l * C, C, 0));
        FL_TRY(PUT("mlp.gate_proj.weight", w1 + l * F * C, F * C, 0));
        FL_TRY(PUT("mlp.down_proj.weight", w2 + l * C * F, C * F, 0));
        FL_TRY(PUT("mlp.up_proj.weight", w3 + l * F * C, F * C, 0));
#undef PUT
    }
    FL_TRY(fl_llama2c_put(m, path, "model.norm.weight", rms_final, C, 0));
    if (!shared) FL_TRY(fl_llama2c_put(m, path, "lm_head.weight", wcls, V * C, 0));
    return FL_OK;
}

fl_status fl_llama2c_load_model(fl_model *m, const char *path, const fl_backend *be, fl_mem_pool *pool) {
    return fl_llama2c_load_model_ex(m, path, be, pool, NULL);
}

fl_status fl_llama2c_load_model_ex(fl_model *m, const char *path, const fl_backend *be, fl_mem_pool *pool,
                                   const fl_model_storage *stg) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return fl_errorf(errno == ENOENT ? FL_ERR_NOT_FOUND : FL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return fl_errorf(FL_ERR_IO, "%s: stat failed: %s", path, strerror(e));
    }
    size_t size = (size_t)st.st_size;
    int32_t h[7];
    if (size < sizeof h) {
        close(fd);
        return fl_errorf(FL_ERR_FORMAT, "%s: file is %zu bytes, too small for the 28-byte llama2.c header", path, size);
    }
    ssize_t r = pread(fd, h, sizeof h, 0);
    if (r != (ssize_t)sizeof h) {
        int e = errno;
        close(fd);
        return fl_errorf(FL_ERR_IO, "%s: cannot read header: %s", path, r < 0 ? strerror(e) : "short read");
    }
    static const char *keys[7] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"};
    for (int i = 0; i < 7; i++) {
        int64_t v = h[i] < 0 && i == 5 ? -(int64_t)h[i] : h[i];
        if (v <= 0 || v > (1 << 24)) {
            close(fd);
            return fl_errorf(FL_ERR_FORMAT, "%s: header field '%s' = %d is not a plausible size (not a llama2.c v0 checkpoint?)",
                             path, keys[i], h[i]);
        }
    }
    fl_model_config c;
    memset(&c, 0, sizeof c);
    c.arch = FL_ARCH_LLAMA;
    snprintf(c.name, sizeof c.name, "llama2c");
    c.dim = h[0];
    c.ffn_dim = h[1];
    c.n_layers = h[2];
    c.n_heads = h[3];
    c.n_kv_heads = h[4];
    int shared = h[5] > 0;
    c.vocab_size = shared ? h[5] : -h[5];
    c.max_seq = h[6];
    c.norm_eps = 1e-5f;
    c.rope_theta = 10000.0f;
    c.tie_embeddings = shared;
    if (c.dim % c.n_heads || c.n_heads % c.n_kv_heads || (c.dim / c.n_heads) % 2) {
        close(fd);
        return fl_errorf(FL_ERR_FORMAT, "%s: header dim %d / n_heads %d / n_kv_heads %d are inconsistent", path, c.dim, c.n_heads,
                         c.n_kv_heads);
    }
    c.head_dim = c.dim / c.n_heads;
    uint64_t C = (uint64_t)c.dim, F = (uint64_t)c.ffn_dim, L = (uint64_t)c.n_layers, V = (uint64_t)c.vocab_size;
    uint64_t KV = (uint64_t)c.n_kv_heads * (uint64_t)c.head_dim, T = (uint64_t)c.max_seq, HS = (uint64_t)c.head_dim;
    uint64_t nfl = V * C + L * (2 * C + 2 * C * C + 2 * KV * C + 3 * F * C) + C + T * HS + (shared ? 0 : V * C);
    double approx = (double)V * C + (double)L * (2.0 * C + 2.0 * C * C + 2.0 * KV * C + 3.0 * F * C) + (double)T * HS;
    if (approx > 1e14) {
        close(fd);
        return fl_errorf(FL_ERR_FORMAT, "%s: header sizes describe %.3g parameters (not a llama2.c v0 checkpoint?)", path, approx);
    }
    uint64_t expect = 28 + 4 * nfl;
    if ((uint64_t)size != expect) {
        close(fd);
        return fl_errorf(FL_ERR_FORMAT, "%s: expected %llu bytes for the header's sizes but the file has %zu (%s)", path,
                         (unsigned long long)expect, size, (uint64_t)size < expect ? "truncated" : "trailing data");
    }
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED) return fl_errorf(FL_ERR_IO, "%s: mmap failed: %s", path, strerror(e));
    fl_status s = fl_model_init_ex(m, &c, be, pool, stg);
    if (s == FL_OK) {
        s = fl_llama2c_fill(m, path, (const float *)((const char *)map + 28), shared);
        if (s != FL_OK) fl_model_free(m);
    } else {
        fl_error_prefix(s, "%s", path);
    }
    munmap(map, size);
    return s;
}

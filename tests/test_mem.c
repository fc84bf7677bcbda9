/* Allocator accounting, budgets, OOM reports, fault injection, and the exact
 * memory of a model's buffers against their analytic counts. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fitllm/backend.h"
#include "fitllm/mem.h"
#include "fitllm/model.h"
#include "fitllm/train.h"
#include "test.h"

FL_TEST(mem_accounting_per_tag_and_peak) {
    fl_mem_pool p;
    FL_REQUIRE_OK(fl_mem_pool_init(&p, "t", 0));
    void *a, *b, *c;
    FL_REQUIRE_OK(fl_mem_alloc(&p, FL_TAG_PARAMS, 1000, &a));
    FL_REQUIRE_OK(fl_mem_alloc(&p, FL_TAG_ACTS, 333, &b));
    FL_REQUIRE_OK(fl_mem_calloc(&p, FL_TAG_ACTS, 7, &c));
    FL_CHECK(((unsigned char *)c)[6] == 0);
    FL_CHECK(((size_t)a % 64) == 0 && ((size_t)b % 64) == 0);
    FL_CHECK(p.cur[FL_TAG_PARAMS] == 1000 && p.cur[FL_TAG_ACTS] == 340 && p.cur_total == 1340);
    FL_CHECK(fl_mem_size_of(&p, b) == 333);
    fl_mem_free(&p, b);
    FL_CHECK(p.cur[FL_TAG_ACTS] == 7 && p.peak[FL_TAG_ACTS] == 340 && p.peak_total == 1340);
    fl_mem_free(&p, NULL);
    fl_mem_free(&p, a);
    fl_mem_free(&p, c);
    FL_CHECK(p.cur_total == 0 && fl_mem_live_count(&p) == 0);
    fl_mem_pool_free(&p);
}

FL_TEST(mem_many_allocs_table_growth) {
    fl_mem_pool p;
    FL_REQUIRE_OK(fl_mem_pool_init(&p, "t", 0));
    void *ptrs[500];
    for (int i = 0; i < 500; i++) FL_REQUIRE_OK(fl_mem_alloc(&p, (fl_mem_tag)(i % FL_TAG_COUNT), (size_t)i + 1, &ptrs[i]));
    size_t want = 500 * 501 / 2;
    FL_CHECK(p.cur_total == want);
    for (int i = 0; i < 500; i += 2) fl_mem_free(&p, ptrs[i]);
    for (int i = 1; i < 500; i += 2) FL_CHECK(fl_mem_size_of(&p, ptrs[i]) == (size_t)i + 1);
    for (int i = 1; i < 500; i += 2) fl_mem_free(&p, ptrs[i]);
    FL_CHECK(p.cur_total == 0 && fl_mem_live_count(&p) == 0);
    fl_mem_pool_free(&p);
}

FL_TEST(mem_phase_snapshots) {
    fl_mem_pool p;
    FL_REQUIRE_OK(fl_mem_pool_init(&p, "t", 0));
    void *a, *b;
    FL_REQUIRE_OK(fl_mem_alloc(&p, FL_TAG_PARAMS, 100, &a));
    fl_mem_snapshot(&p, "before_fwd");
    FL_REQUIRE_OK(fl_mem_alloc(&p, FL_TAG_WORKSPACE, 50, &b));
    fl_mem_free(&p, b);
    fl_mem_snapshot(&p, "after_fwd");
    const fl_mem_phase *f = fl_mem_find_phase(&p, "after_fwd");
    FL_REQUIRE(f != NULL);
    FL_CHECK(f->cur_total == 100 && f->peak_total == 150 && f->peak[FL_TAG_WORKSPACE] == 50 && f->cur[FL_TAG_WORKSPACE] == 0);
    FL_CHECK(fl_mem_find_phase(&p, "before_fwd")->peak_total == 100);
    fl_mem_snapshot(&p, "before_fwd"); /* a repeated name overwrites its row */
    FL_CHECK(p.n_phases == 2);
    fl_mem_free(&p, a);
    fl_mem_pool_free(&p);
}

/* Live bytes: PARAMS/OPTIM/OTHER live in full from the allocation, GRADS/ACTS/WORKSPACE
 * only as their owner says; snapshots record them beside the reserved bytes; a free
 * takes its live bytes with it. */
FL_TEST(mem_live_bytes) {
    fl_mem_pool p;
    FL_REQUIRE_OK(fl_mem_pool_init(&p, "t", 0));
    void *w, *g, *a, *o, *x;
    FL_REQUIRE_OK(fl_mem_alloc(&p, FL_TAG_PARAMS, 100, &w));
    FL_REQUIRE_OK(fl_mem_alloc(&p, FL_TAG_GRADS, 100, &g));
    FL_REQUIRE_OK(fl_mem_alloc(&p, FL_TAG_ACTS, 1000, &a));
    FL_REQUIRE_OK(fl_mem_alloc(&p, FL_TAG_OPTIM, 200, &o));
    FL_REQUIRE_OK(fl_mem_alloc(&p, FL_TAG_OTHER, 8, &x));
    FL_CHECK(p.live[FL_TAG_PARAMS] == 100 && p.live[FL_TAG_GRADS] == 0 && p.live[FL_TAG_ACTS] == 0 &&
             p.live[FL_TAG_OPTIM] == 200 && p.live[FL_TAG_OTHER] == 8 && p.live_total == 308);
    fl_mem_snapshot(&p, "before_fwd");
    fl_mem_set_live(&p, a, 600);
    fl_mem_snapshot(&p, "after_fwd");
    fl_mem_set_live(&p, a, 0);
    fl_mem_set_live(&p, g, 5000); /* clamped to the allocation */
    fl_mem_snapshot(&p, "after_bwd");
    const fl_mem_phase *b = fl_mem_find_phase(&p, "before_fwd"), *f = fl_mem_find_phase(&p, "after_fwd"),
                       *k = fl_mem_find_phase(&p, "after_bwd");
    FL_REQUIRE(b && f && k);
    /* reserved never moves; live does */
    FL_CHECK(b->cur_total == 1408 && f->cur_total == 1408 && k->cur_total == 1408);
    FL_CHECK(b->live[FL_TAG_ACTS] == 0 && f->live[FL_TAG_ACTS] == 600 && k->live[FL_TAG_ACTS] == 0);
    FL_CHECK(f->live[FL_TAG_GRADS] == 0 && k->live[FL_TAG_GRADS] == 100 && fl_mem_live_of(&p, g) == 100);
    FL_CHECK(f->live_total == 908 && k->live_total == 408);
    fl_mem_set_live(&p, (void *)&p, 10); /* not ours: ignored */
    fl_mem_free(&p, g);
    FL_CHECK(p.live[FL_TAG_GRADS] == 0 && p.live_total == 308);
    fl_mem_free(&p, w);
    fl_mem_free(&p, a);
    fl_mem_free(&p, o);
    fl_mem_free(&p, x);
    FL_CHECK(p.live_total == 0 && p.cur_total == 0);
    fl_mem_pool_free(&p);
}

FL_TEST(mem_budget_oom_reports_breakdown) {
    fl_mem_pool p;
    FL_REQUIRE_OK(fl_mem_pool_init(&p, "gpu0", 1000));
    void *a, *b;
    FL_REQUIRE_OK(fl_mem_alloc(&p, FL_TAG_PARAMS, 600, &a));
    fl_mem_set_phase(&p, "forward");
    fl_status s = fl_mem_alloc(&p, FL_TAG_ACTS, 401, &b);
    FL_CHECK(s == FL_ERR_OOM && b == NULL);
    FL_CHECK(p.oom.valid && p.oom.requested == 401 && p.oom.tag == FL_TAG_ACTS && p.oom.in_use == 600 &&
             p.oom.cur[FL_TAG_PARAMS] == 600 && !strcmp(p.oom.phase, "forward"));
    const char *msg = fl_error_message();
    FL_CHECKF(strstr(msg, "ACTS") && strstr(msg, "forward") && strstr(msg, "PARAMS 600 B") && strstr(msg, "401 B"),
              "OOM message lacks the breakdown: %s", msg);
    FL_CHECK(p.cur_total == 600); /* the failed request left no trace */
    FL_REQUIRE_OK(fl_mem_alloc(&p, FL_TAG_ACTS, 400, &b)); /* exactly the budget fits */
    fl_mem_free(&p, a);
    fl_mem_free(&p, b);
    fl_mem_pool_free(&p);
}

FL_TEST(mem_parse_bytes) {
    size_t v;
    FL_CHECK(fl_parse_bytes("80GB", &v) == 0 && v == 80000000000ULL);
    FL_CHECK(fl_parse_bytes("512MiB", &v) == 0 && v == 512ULL << 20);
    FL_CHECK(fl_parse_bytes("1.5G", &v) == 0 && v == (size_t)(1.5 * (1ULL << 30)));
    FL_CHECK(fl_parse_bytes("1000B", &v) == 0 && v == 1000);
    /* a bare number is refused (-2, "80" is not 80 bytes), zero aside */
    FL_CHECK(fl_parse_bytes("1000", &v) == -2);
    FL_CHECK(fl_parse_bytes("80", &v) == -2);
    FL_CHECK(fl_parse_bytes("0", &v) == 0 && v == 0);
    char why[300];
    FL_CHECK(strstr(fl_bytes_refusal("80", why, sizeof why), "'80' has no unit: write 80GB") != NULL);
    FL_CHECK(strstr(why, "80GiB") != NULL);
    FL_CHECK(strstr(fl_bytes_refusal("lots", why, sizeof why), "not a size") != NULL);
    FL_CHECK(fl_parse_bytes("12XB", &v) == -1);
    FL_CHECK(fl_parse_bytes("-3GB", &v) == -1);
    FL_CHECK(fl_parse_bytes("", &v) == -1);
}

static fl_model_config small_llama(void) {
    fl_model_config c = {0};
    c.arch = FL_ARCH_LLAMA;
    c.vocab_size = 101;
    c.dim = 48;
    c.n_layers = 2;
    c.n_heads = 6;
    c.n_kv_heads = 2;
    c.ffn_dim = 72;
    c.max_seq = 64;
    c.norm_eps = 1e-5f;
    c.rope_theta = 10000.0f;
    return c;
}

/* Analytic parameter count, written independently of the layout code. */
static size_t analytic_llama_params(const fl_model_config *c) {
    size_t C = c->dim, HD = C / c->n_heads, kv = HD * c->n_kv_heads;
    size_t per = C /*ln1*/ + C * C /*q*/ + 2 * kv * C /*k,v*/ + C * C /*o*/ + C /*ln2*/ + 3 * C * c->ffn_dim;
    return c->vocab_size * C * (c->tie_embeddings ? 1 : 2) + c->n_layers * per + C;
}

FL_TEST(mem_model_buffers_equal_analytic_counts) {
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    fl_mem_pool p;
    FL_REQUIRE_OK(fl_mem_pool_init(&p, "cpu", 0));
    fl_model_config c = small_llama();
    fl_model m;
    FL_REQUIRE_OK(fl_model_init(&m, &c, &be, &p));
    size_t np = analytic_llama_params(&c);
    FL_CHECK(m.layout.numel == np);
    FL_CHECK(p.cur[FL_TAG_PARAMS] == np * 4);
    FL_REQUIRE_OK(fl_model_alloc_grads(&m));
    FL_CHECK(p.cur[FL_TAG_GRADS] == np * 4);
    fl_optimizer o;
    fl_optim_config oc;
    fl_optim_config_default(&oc, FL_OPT_ADAMW);
    FL_REQUIRE_OK(fl_optim_init(&o, &m, &oc));
    FL_CHECK(p.cur[FL_TAG_OPTIM] == 2 * np * 4);
    FL_CHECK(fl_optim_state_bytes(&oc, np) == 2 * np * 4);
    FL_REQUIRE_OK(fl_model_alloc_acts(&m, 3, 17));
    fl_act_sizes sz;
    fl_sizing_acts(&c, 3, 17, &sz);
    FL_CHECK(p.cur[FL_TAG_ACTS] == sz.acts_bytes && p.cur[FL_TAG_WORKSPACE] == sz.workspace_bytes);
    /* The ACTS formula, written out: per layer 4 (N,C) + qkv + att + fc + act + 2 rstd + lse, plus
     * L+1 residuals and the final norm; each view rounded up to 64 bytes. */
    size_t N = 51, C = 48, HD = 8, QKV = (6 + 4) * HD, F = 72;
#define R64(x) (((x) * 4 + 63) / 64 * 64)
    size_t per = 3 * R64(N * C) + R64(N * QKV) + R64(N * 6 * HD) + R64(N * 6) + R64(N * 2 * F) + R64(N * F) + 2 * R64(N);
    size_t want = 2 * per + 3 * R64(N * C) + R64(N * C) + R64(N);
    FL_CHECKF(sz.acts_bytes == want, "ACTS %zu != formula %zu", sz.acts_bytes, want);
    FL_CHECK(sz.per_layer_acts_bytes == per + R64(N * C)); /* a layer also adds one residual */
#undef R64
    fl_optim_free(&o);
    fl_model_free(&m);
    FL_CHECK(p.cur_total == 0 && fl_mem_live_count(&p) == 0);
    fl_mem_pool_free(&p);
    fl_cpu_backend_free(&be);
}

/* Every allocation of a training set-up failing in turn returns FL_ERR_OOM and
 * leaves nothing allocated once the caller frees what it owns. */
FL_TEST(mem_fault_injection_sweep_setup) {
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 1));
    fl_model_config c = small_llama();
    int failures = 0;
    for (long k = 0; k < 64; k++) {
        fl_mem_pool p;
        FL_REQUIRE_OK(fl_mem_pool_init(&p, "cpu", 0));
        fl_mem_fail_after(&p, k);
        fl_model m = {0};
        fl_optimizer o = {0};
        fl_optim_config oc;
        fl_optim_config_default(&oc, FL_OPT_ADAMW);
        fl_status s = fl_model_init(&m, &c, &be, &p);
        int inited = s == FL_OK;
        if (s == FL_OK) s = fl_model_alloc_grads(&m);
        if (s == FL_OK) s = fl_optim_init(&o, &m, &oc);
        if (s == FL_OK) s = fl_model_alloc_acts(&m, 2, 9);
        if (s != FL_OK) {
            failures++;
            FL_CHECKF(s == FL_ERR_OOM, "k=%ld: status %s", k, fl_status_name(s));
        }
        fl_optim_free(&o);
        if (inited) fl_model_free(&m);
        FL_CHECKF(p.cur_total == 0 && fl_mem_live_count(&p) == 0, "k=%ld: %zu bytes leaked", k, p.cur_total);
        fl_mem_pool_free(&p);
        if (s == FL_OK) break; /* k is past the last allocation */
    }
    FL_CHECK(failures >= 5); /* params, grads, m, v, acts, workspace */
    fl_cpu_backend_free(&be);
}

FL_TEST(mem_budget_oom_during_setup_names_phase) {
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 1));
    fl_model_config c = small_llama();
    fl_mem_pool p;
    /* enough for params + grads + AdamW, not for the activations */
    size_t np = analytic_llama_params(&c) * 4;
    FL_REQUIRE_OK(fl_mem_pool_init(&p, "cpu", 4 * np + 1000));
    fl_model m;
    fl_optimizer o;
    fl_optim_config oc;
    fl_optim_config_default(&oc, FL_OPT_ADAMW);
    FL_REQUIRE_OK(fl_model_init(&m, &c, &be, &p));
    FL_REQUIRE_OK(fl_model_alloc_grads(&m));
    FL_REQUIRE_OK(fl_optim_init(&o, &m, &oc));
    fl_mem_set_phase(&p, "activation setup");
    fl_status s = fl_model_alloc_acts(&m, 8, 64);
    FL_CHECK(s == FL_ERR_OOM);
    FL_CHECK(p.oom.valid && p.oom.tag == FL_TAG_ACTS && p.oom.cur[FL_TAG_OPTIM] == 2 * np);
    FL_CHECKF(strstr(fl_error_message(), "activation setup") != NULL, "%s", fl_error_message());
    fl_optim_free(&o);
    fl_model_free(&m);
    FL_CHECK(p.cur_total == 0 && fl_mem_live_count(&p) == 0);
    fl_mem_pool_free(&p);
    fl_cpu_backend_free(&be);
}

/* fl_mem_pool.account (the null backend standing in for host memory): a host pool's bytes charge
 * another pool's counters, live bytes, budget and OOM record, its memory being its own; and the
 * null backend's pools: fake addresses for tensors, real host staging, one set of counters. */
FL_TEST(mem_account_pool_and_null_pools) {
    fl_mem_pool dev, host;
    FL_REQUIRE_OK(fl_mem_pool_init(&dev, "dev", 1000));
    FL_REQUIRE_OK(fl_mem_pool_init(&host, "host", 0));
    host.account = &dev;
    void *a = NULL, *b = NULL, *c = NULL;
    FL_REQUIRE_OK(fl_mem_alloc(&dev, FL_TAG_PARAMS, 600, &a));
    FL_REQUIRE_OK(fl_mem_alloc(&host, FL_TAG_WORKSPACE, 300, &b));
    memset(b, 1, 300); /* the host pool's memory is real */
    FL_CHECK(dev.cur_total == 900 && dev.cur[FL_TAG_WORKSPACE] == 300 && host.cur_total == 0);
    fl_mem_set_live(&host, b, 100);
    FL_CHECK(dev.live[FL_TAG_WORKSPACE] == 100 && dev.live_total == 700);
    fl_mem_set_phase(&dev, "setup");
    FL_CHECK(fl_mem_alloc(&host, FL_TAG_OTHER, 101, &c) == FL_ERR_OOM && c == NULL); /* dev's budget */
    FL_CHECK(dev.oom.valid && dev.oom.requested == 101 && dev.oom.in_use == 900 && dev.oom.tag == FL_TAG_OTHER);
    FL_CHECK(!host.oom.valid);
    fl_mem_free(&host, b);
    FL_CHECK(dev.cur_total == 600 && dev.live_total == 600 && dev.peak_total == 900);
    fl_mem_free(&dev, a);
    fl_mem_pool_free(&dev);
    fl_mem_pool_free(&host);

    fl_backend nb;
    fl_mem_pool np, nh;
    FL_REQUIRE_OK(fl_null_backend_init_for(&nb, "cpu"));
    FL_REQUIRE_OK(fl_backend_pools_init(&nb, &np, &nh, "cpu", 0));
    FL_CHECK(fl_mem_host_pool(&np) == &nh && nh.account == &np);
    void *t = NULL, *h = NULL;
    const size_t big = (size_t)1 << 40; /* 1 TiB of tensor: nothing reserved */
    FL_REQUIRE_OK(fl_mem_alloc(&np, FL_TAG_PARAMS, big, &t));
    FL_REQUIRE_OK(fl_mem_alloc(fl_mem_host_pool(&np), FL_TAG_OTHER, 4096, &h));
    memset(h, 0, 4096);
    FL_CHECK(t != NULL && np.cur_total == big + 4096 && np.cur[FL_TAG_OTHER] == 4096);
    float x = 1.0f;
    FL_REQUIRE_OK(nb.to_host(&nb, &x, t, sizeof x)); /* what the host reads back: zeros */
    FL_CHECK(x == 0.0f);
    fl_mem_free(fl_mem_host_pool(&np), h);
    fl_mem_free(&np, t);
    FL_CHECK(np.cur_total == 0);
    fl_backend_pools_free(&np, &nh);
    fl_backend_free(&nb);
}

/* NVMe residency, one entry per advice (fl_mem_disk_advise): a released range reads back the bytes written (its
 * pages dropped, then read from the file); prefetch and write-back are hints (FL_OK); every advice is a no-op on a
 * pool that is not on disk; the injected write failure (FITLLM_TEST_NVME_FAIL_AFTER) counts the releases of a step
 * only, never a flush. */
FL_TEST(mem_disk_advise) {
    char dir[] = "/tmp/fl_diskadv_XXXXXX";
    FL_REQUIRE(mkdtemp(dir));
    const size_t pg = (size_t)sysconf(_SC_PAGESIZE), n = 4 * pg;
    setenv("FITLLM_TEST_NVME_FAIL_AFTER", "1", 1); /* the second counted release fails */
    fl_mem_pool d, h;
    fl_status s = fl_mem_disk_pool_init(&d, "disk", dir);
    unsetenv("FITLLM_TEST_NVME_FAIL_AFTER");
    FL_REQUIRE_OK(s);
    FL_REQUIRE_OK(fl_mem_pool_init(&h, "host", 0));
    unsigned char *x, *y;
    FL_REQUIRE_OK(fl_mem_alloc(&d, FL_TAG_OPTIM, n, (void **)&x));
    FL_REQUIRE_OK(fl_mem_alloc(&h, FL_TAG_OPTIM, n, (void **)&y));
    for (size_t i = 0; i < n; i++) x[i] = y[i] = (unsigned char)(i * 7 + 3);
    const fl_disk_advice all[] = {FL_DISK_PREFETCH, FL_DISK_WRITEBACK, FL_DISK_RELEASE, FL_DISK_FLUSH};
    for (int k = 0; k < 4; k++) FL_CHECK(fl_mem_disk_advise(&h, y, n, all[k]) == FL_OK); /* not on disk: no-op */
    FL_CHECK(fl_mem_disk_advise(&d, x, n, FL_DISK_FLUSH) == FL_OK); /* not counted */
    FL_CHECK(fl_mem_disk_advise(&d, x + pg, 2 * pg, FL_DISK_WRITEBACK) == FL_OK);
    FL_CHECK(fl_mem_disk_advise(&d, x + pg, 2 * pg, FL_DISK_RELEASE) == FL_OK); /* the first counted release */
    FL_CHECK(fl_mem_disk_advise(&d, x, n, FL_DISK_PREFETCH) == FL_OK);
    FL_CHECK(memcmp(x, y, n) == 0); /* the dropped pages read back from the file */
    FL_CHECK(fl_mem_disk_advise(&d, x, n, FL_DISK_FLUSH) == FL_OK);
    FL_CHECK(fl_mem_disk_advise(&d, x, n, FL_DISK_RELEASE) == FL_ERR_IO && strstr(fl_error_message(), dir));
    FL_CHECK(fl_mem_disk_advise(&d, x, n, FL_DISK_FLUSH) == FL_OK);
    fl_mem_free(&d, x);
    fl_mem_free(&h, y);
    fl_mem_pool_free(&d);
    fl_mem_pool_free(&h);
    FL_CHECK(rmdir(dir) == 0); /* no file left behind */
}

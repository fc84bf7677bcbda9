/* Sharded checkpoints (--fsdp.state_dict_type sharded, src/train/shard_ckpt.c) with the ranks as
 * threads of this process (tests/zero_ref.h's scenarios: the `micro` preset, 260032 parameters,
 * split 86678/86677/86677 over 3 ranks and 130016/130016 over 2).
 *
 * The anchors:
 *   - the same world size: a run resumed from its own sharded step-3 checkpoint ends with the
 *     bits of the uninterrupted run (losses and parameters);
 *   - another world size: a sharded checkpoint saved at N ranks and resumed at M (and in one
 *     process) gives the bits that the FULL checkpoint of the same state gives when resumed at M
 *     (the consolidated format, whose resume is tested in tests/test_zero.c, reads through a
 *     different path: rank 0's gathered file, no ranges); at M ranks DDP, ZeRO-1 and ZeRO-2 resume
 *     to the same bits (they train alike per world size);
 *   - a run uninterrupted at M ranks that saved sharded and is resumed at M equals itself;
 *   - the files: the parameters are stored once (the ranks' "params" ranges tile [0, n) without
 *     overlap: n elements in all), no model.safetensors in a step checkpoint, and merge_shards
 *     writes the bytes of the full checkpoint's model.safetensors;
 *   - bad input (a missing shard file, a range gap, a file of another step or layout, another
 *     model, an uncommitted folder): an error naming the file and the range, nothing resumed;
 *   - a save that fails at any file write (fault injection) commits nothing: the newest committed
 *     checkpoint is whole (it merges). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fitllm/checkpoint.h"
#include "fitllm/io.h"
#include "test.h"
#include "zero_ref.h"

#define SK_MAX_RANKS 4

/* zero_ref.h's helpers this file does not use */
static inline void sk_unused_(void) {
    (void)zr_check_memory;
    (void)zr_compare_one_process;
}

typedef struct {
    fl_run_config cfg;
    zr_rec rec[SK_MAX_RANKS];
    fl_status st[SK_MAX_RANKS];
    char msg[SK_MAX_RANKS][700];
} skjob;

static fl_status skrank(fl_comm *c, int rank, void *ud) {
    skjob *j = ud;
    fl_status s = fl_trainer_run_comm(&j->cfg, c, NULL, 0, zr_record, &j->rec[rank], NULL);
    j->st[rank] = s;
    if (s != FL_OK) snprintf(j->msg[rank], sizeof j->msg[rank], "%s", fl_error_message());
    return s;
}

static void skfree(skjob *j) {
    if (!j) return;
    for (int r = 0; r < SK_MAX_RANKS; r++) zr_free(&j->rec[r]);
    free(j);
}

/* Scenario sc with the global batch of `gworld` ranks, run at `ranks` ranks (1: one process);
 * resume: "" or a checkpoint folder. Returns the job (rank 0's record is the run's). */
static skjob *sk_run(int sc, int gworld, int ranks, const char *strategy, const char *sdt, int steps, int save_every,
                     const char *resume, const char *tag) {
    skjob *j = calloc(1, sizeof *j);
    if (!j) abort();
    char out[FL_CFG_PATH];
    snprintf(out, sizeof out, "%s/%s-%s", fl_test_tmpdir(), zr_names[sc], tag);
    zr_config(&j->cfg, sc, gworld, ranks, 1, strategy, NULL, out);
    j->cfg.train.max_steps = steps;
    j->cfg.train.save_interval = save_every;
    snprintf(j->cfg.state_dict_type, sizeof j->cfg.state_dict_type, "%s", sdt);
    if (resume && resume[0]) snprintf(j->cfg.resume, sizeof j->cfg.resume, "%s", resume);
    fl_status s = ranks == 1 ? fl_trainer_run(&j->cfg, NULL, 0, zr_record, &j->rec[0], NULL)
                             : fl_comm_threads_run(ranks, skrank, j);
    if (ranks == 1) j->st[0] = s;
    FL_CHECKF(s == FL_OK, "%s %s (%d ranks, %s, %s): %s", zr_names[sc], tag, ranks, strategy, sdt, fl_error_message());
    for (int r = 1; s == FL_OK && r < ranks; r++)
        FL_CHECKF(zr_same(&j->rec[r], &j->rec[0]), "%s %s: rank %d's bits differ from rank 0's", zr_names[sc], tag, r);
    return j;
}

/* Same parameters and the same losses of steps from..steps. */
static int same_from(const zr_rec *a, const zr_rec *b, int from) {
    return a->bytes && b->bytes && a->nbytes == b->nbytes && a->steps == b->steps &&
           !memcmp(a->bytes, b->bytes, a->nbytes) &&
           !memcmp(a->loss + from, b->loss + from, (size_t)(a->steps - from) * sizeof(double));
}

static int same_file(const char *a, const char *b) {
    size_t la = 0, lb = 0;
    unsigned char *da = (unsigned char *)fl_test_slurp(a, &la), *db = (unsigned char *)fl_test_slurp(b, &lb);
    int ok = da && db && la == lb && !memcmp(da, db, la);
    free(da);
    free(db);
    return ok;
}

static int exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0;
}

static int rcmp(const void *a, const void *b) {
    const size_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

/* The "params" ranges of the shard files of dir tile [0, n) once: returns the elements stored.
 * chunk_rule (DDP, ZeRO-1/2): each file holds one range, fl_comm's chunk of rank r; else
 * (FULL_SHARD) each file lists several ranges ("ranges.params": its pieces of the units), and all
 * files' ranges together tile [0, n). */
static size_t params_stored(const char *dir, int world, size_t n, int chunk_rule, int *tiled) {
    size_t total = 0, next = 0, (*all)[2] = calloc(4096, sizeof *all);
    int na = 0;
    *tiled = all != NULL;
    for (int r = 0; r < world && all; r++) {
        char p[FL_CFG_PATH + 200];
        snprintf(p, sizeof p, "%s/shard-%05d-of-%05d.safetensors", dir, r, world);
        fl_st_file f;
        if (fl_st_open(&f, p) != FL_OK) { *tiled = 0; break; }
        const fl_st_tensor *t = fl_st_find(&f, "params");
        size_t k0 = 0, k1 = 0, cnt = 0, in_file = 0;
        int nr = 0;
        for (int i = 0; i < f.n_meta; i++) {
            if (!strcmp(f.meta_keys[i], "range.params") && sscanf(f.meta_vals[i], "%zu %zu %zu", &k0, &k1, &cnt) == 3 &&
                na < 4096) {
                all[na][0] = k0, all[na++][1] = k1, nr++, in_file += k1 - k0;
            } else if (!strcmp(f.meta_keys[i], "ranges.params")) {
                const char *q = f.meta_vals[i];
                int u = 0;
                if (sscanf(q, "%zu%n", &cnt, &u) != 1) *tiled = 0;
                for (q += u; na < 4096 && sscanf(q, "%zu %zu%n", &k0, &k1, &u) == 2; q += u)
                    all[na][0] = k0, all[na++][1] = k1, nr++, in_file += k1 - k0;
            }
        }
        if (chunk_rule) {
            size_t off, len;
            fl_comm_chunk(n, world, r, &off, &len); /* what rank r owns: fl_comm's chunk */
            if (nr != 1 || k0 != off || k1 != off + len) *tiled = 0;
        } else if (nr < 2) {
            *tiled = 0; /* FULL_SHARD: a piece of every unit */
        }
        if (!t || cnt != n || (t->end - t->begin) / fl_dtype_size(t->dtype) != in_file) *tiled = 0;
        if (t) total += (t->end - t->begin) / fl_dtype_size(t->dtype);
        fl_st_close(&f);
    }
    if (all) qsort(all, (size_t)na, sizeof *all, rcmp);
    for (int i = 0; i < na; i++) {
        if (all[i][0] != next) *tiled = 0;
        next = all[i][1];
    }
    if (next != n) *tiled = 0;
    free(all);
    return total;
}

/* Save sharded at `sw` ranks with `sstrat` (the global batch of `gw` ranks: 4 x gw), and full alongside (same training); then the checks
 * of the header at the world sizes in rw[] (0-terminated; 1 = one process), each with the
 * strategies strat[] (NULL-terminated) and against the full checkpoint's resume with the last. */
static void scenario(int sc, int gw, int sw, const char *sstrat, const int *rw, const char *const *strat) {
    skjob *a = sk_run(sc, gw, sw, sstrat, "sharded", 5, 3, NULL, "save-sharded");
    skjob *b = sk_run(sc, gw, sw, sstrat, "full", 5, 3, NULL, "save-full");
    if (a->st[0] != FL_OK || b->st[0] != FL_OK) goto out;
    FL_CHECKF(zr_same(&a->rec[0], &b->rec[0]), "%s: the checkpoint format changed the training", zr_names[sc]);
    char sdir[FL_CFG_PATH + 32], fdir[FL_CFG_PATH + 32], p[FL_CFG_PATH + 200], q[FL_CFG_PATH + 200];
    snprintf(sdir, sizeof sdir, "%s/step-000003", a->cfg.out_dir);
    snprintf(fdir, sizeof fdir, "%s/step-000003", b->cfg.out_dir);
    /* the files: parameters once, merge = the full checkpoint's bytes */
    int tiled = 0;
    size_t n = a->rec[0].nbytes / (sc == ZR_BF16 ? 2 : 4);
    int chunk_rule = strcmp(sstrat, "fsdp") && strcmp(sstrat, "deepspeed_stage_3");
    size_t stored = params_stored(sdir, sw, n, chunk_rule, &tiled);
    FL_CHECKF(tiled && stored == n, "%s: the shard files hold %zu parameter elements (tiling %d), the model %zu",
              zr_names[sc], stored, tiled, n);
    snprintf(p, sizeof p, "%s/model.safetensors", sdir);
    FL_CHECKF(!exists(p), "%s: a sharded step checkpoint holds model.safetensors (the parameters twice)", p);
    snprintf(p, sizeof p, "%s/merged", sdir);
    FL_REQUIRE_OK(fl_ckpt_merge_shards(sdir, p, NULL));
    snprintf(p, sizeof p, "%s/merged/model.safetensors", sdir);
    snprintf(q, sizeof q, "%s/model.safetensors", fdir);
    FL_CHECKF(same_file(p, q), "%s: merge_shards' model.safetensors differs from the full checkpoint's", zr_names[sc]);
    snprintf(p, sizeof p, "%s/final/model.safetensors", a->cfg.out_dir);
    snprintf(q, sizeof q, "%s/final/model.safetensors", b->cfg.out_dir);
    FL_CHECKF(same_file(p, q), "%s: final/'s streamed export differs from the full final/", zr_names[sc]);
    /* the same world size: the uninterrupted run's bits */
    skjob *r = sk_run(sc, gw, sw, sstrat, "full", 5, 0, sdir, "resume-same");
    FL_CHECKF(r->st[0] == FL_OK && same_from(&r->rec[0], &a->rec[0], 3),
              "%s: resumed at %d ranks from its sharded checkpoint, the bits differ from the uninterrupted run",
              zr_names[sc], sw);
    skfree(r);
    /* other world sizes: every strategy the full checkpoint's bits */
    for (int w = 0; rw[w]; w++) {
        char tag[64];
        skjob *ref = NULL;
        for (int k = 0; strat[k]; k++) {
            if (rw[w] == 1 && k > 0) break; /* one process: one strategy (DDP: every strategy is one process) */
            const char *sname = rw[w] == 1 ? "ddp" : strat[k];
            snprintf(tag, sizeof tag, "resume%d-%s", rw[w], sname);
            skjob *x = sk_run(sc, gw, rw[w], sname, "full", 5, 0, sdir, tag);
            if (!ref) {
                snprintf(tag, sizeof tag, "resume%d-from-full", rw[w]);
                ref = sk_run(sc, gw, rw[w], sname, "full", 5, 0, fdir, tag);
            }
            FL_CHECKF(x->st[0] == FL_OK && ref->st[0] == FL_OK && same_from(&x->rec[0], &ref->rec[0], 3),
                      "%s: saved sharded at %d ranks, resumed at %d (%s): bits differ from the full checkpoint's resume",
                      zr_names[sc], sw, rw[w], sname);
            skfree(x);
        }
        skfree(ref);
    }
out:
    skfree(a);
    skfree(b);
}

/* Under ASan (make test's second pass, for memory and error paths) the 8-bit scenario, the bad
 * input and the failed writes run; these two bit-for-bit matrices run in the release pass. */
#if defined(__SANITIZE_ADDRESS__)
#define SK_RELEASE_ONLY() \
    do { fl_test_skip("the release pass runs it (make test's time; the 8-bit scenario covers this code under ASan)"); return; } while (0)
#else
#define SK_RELEASE_ONLY() do { } while (0)
#endif

FL_TEST(shard_ckpt_threads_sgd_momentum_saved_at_3_resumed_at_2_and_1) {
    SK_RELEASE_ONLY();
    static const int rw[] = {2, 1, 0};
    static const char *const st[] = {"ddp", "deepspeed_stage_2", NULL};
    scenario(ZR_SGDM, 3, 3, "deepspeed_stage_2", rw, st);
    /* uninterrupted at 2 ranks (DDP), saved sharded, resumed at 2 (ZeRO-2): itself */
    skjob *a = sk_run(ZR_SGDM, 3, 2, "ddp", "sharded", 5, 3, NULL, "u2");
    char d[FL_CFG_PATH + 32];
    snprintf(d, sizeof d, "%s/step-000003", a->cfg.out_dir);
    skjob *r = sk_run(ZR_SGDM, 3, 2, "deepspeed_stage_2", "sharded", 5, 0, d, "u2-resumed");
    FL_CHECKF(a->st[0] == FL_OK && r->st[0] == FL_OK && same_from(&r->rec[0], &a->rec[0], 3),
              "saved sharded at 2 ranks (DDP), resumed at 2 (ZeRO-2): bits differ from the uninterrupted run");
    skfree(a);
    skfree(r);
}

/* 8-bit AdamW: codes per element and one absmax per block of 256 from each tensor's start; a
 * block cut by a chunk edge is held by both neighbours and stored by the owner of its first
 * element; resumed at 2 ranks each rank reads its block-widened pieces. */
FL_TEST(shard_ckpt_threads_adamw8bit_saved_at_3_resumed_at_2) {
    static const int rw[] = {2, 0};
    static const char *const st[] = {"deepspeed_stage_1", NULL};
    scenario(ZR_ADAMW8, 3, 3, "deepspeed_stage_2", rw, st);
}

/* bf16-true AdamW: bf16 parameters and state; saved by DDP at 2 ranks, resumed by ZeRO-2 at 3. */
FL_TEST(shard_ckpt_threads_bf16_true_saved_at_2_resumed_at_3) {
    SK_RELEASE_ONLY();
    static const int rw[] = {3, 0};
    static const char *const st[] = {"deepspeed_stage_2", NULL};
    scenario(ZR_BF16, 3, 2, "ddp", rw, st); /* global batch 12: 2 x 2 x 3 and 3 x 2 x 2 */
}

/* FULL_SHARD (ZeRO-3): each rank writes its pieces of every unit (several ranges per buffer:
 * bf16 parameters, AdamW's m and v); saved at 3 ranks, resumed by FULL_SHARD at 2 (each piece from
 * the overlapping ranges of the 3-rank files) and by DDP in one process; at 3 ranks the
 * uninterrupted run's bits; merge_shards = the full checkpoint's model.safetensors. Runs under ASan
 * too (without the one-process resume): the ranges lists are this scenario's alone. */
FL_TEST(shard_ckpt_threads_fsdp_bf16_true_saved_at_3_resumed_at_2_and_1) {
#if defined(__SANITIZE_ADDRESS__)
    static const int rw[] = {2, 0}; /* make test's time: the release pass adds the one-process resume */
#else
    static const int rw[] = {2, 1, 0};
#endif
    static const char *const st[] = {"fsdp", NULL};
    scenario(ZR_BF16, 3, 3, "fsdp", rw, st); /* global batch 12: 3 x 2 x 2 and 2 x 2 x 3 */
}

/* The other direction: SGD momentum saved by ZeRO-2 at 2 ranks (one chunk per rank), resumed by
 * FULL_SHARD at 3 (each unit's piece from the 2 files' chunks). */
FL_TEST(shard_ckpt_threads_zero2_saved_at_2_resumed_by_fsdp_at_3) {
    SK_RELEASE_ONLY();
    static const int rw[] = {3, 0};
    static const char *const st[] = {"fsdp", NULL};
    scenario(ZR_SGDM, 3, 2, "deepspeed_stage_2", rw, st);
}

/* ---- bad input ------------------------------------------------------------------------------ */

static void copy_dir(const char *src, const char *dst) {
    char cmd[4 * FL_CFG_PATH];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s' '%s'", dst, src, dst);
    if (system(cmd) != 0) fl_test_fail(__FILE__, __LINE__, "cannot copy %s", src);
}

/* Rewrite a shard file with metadata key `key` set to `val`; when trim > 0 the tensor `tensor`
 * loses its first `trim` elements (fp32) and the range says so. */
static fl_status rewrite_shard(const char *path, const char *key, const char *val, const char *tensor, size_t trim) {
    fl_st_file f;
    FL_TRY(fl_st_open(&f, path));
    fl_st_write_tensor t[64];
    const char *k[64], *v[64];
    int nt = 0, nk = 0;
    for (int i = 0; i < f.n_tensors && nt < 64; i++) {
        const fl_st_tensor *x = &f.tensors[i];
        int64_t len = x->shape[0];
        const char *d = x->data;
        if (trim && !strcmp(x->name, tensor)) len -= (int64_t)trim, d += trim * 4;
        t[nt++] = (fl_st_write_tensor){x->name, x->dtype, 1, {len}, d, x->dtype, 0, NULL, NULL, NULL, NULL};
    }
    for (int i = 0; i < f.n_meta && nk < 64; i++) {
        k[nk] = f.meta_keys[i];
        v[nk++] = strcmp(f.meta_keys[i], key) ? f.meta_vals[i] : val;
    }
    fl_status s = fl_st_write(path, t, nt, k, v, nk); /* a new file renamed over the mapped one */
    fl_st_close(&f);
    return s;
}

/* Resume dir in one process into out: must fail with `code`, the message holding every needle,
 * and nothing resumed (no final/). */
static void refuse(const char *dir, fl_status code, const char *what, const char *n1, const char *n2) {
    fl_run_config c;
    char out[FL_CFG_PATH];
    static int seq;
    snprintf(out, sizeof out, "%s/refused-%d", fl_test_tmpdir(), seq++);
    zr_config(&c, ZR_SGDM, 3, 1, 1, "auto", NULL, out);
    c.train.max_steps = 5;
    snprintf(c.resume, sizeof c.resume, "%s", dir);
    fl_status s = fl_trainer_run(&c, NULL, 0, NULL, NULL, NULL);
    const char *m = fl_error_message();
    FL_CHECKF(s == code && strstr(m, n1) && (!n2 || strstr(m, n2)), "%s: status %d (want %d): %s", what, (int)s,
              (int)code, m);
    char p[FL_CFG_PATH + 300];
    snprintf(p, sizeof p, "%s/final", out);
    FL_CHECKF(!exists(p), "%s: the refused resume trained and saved %s", what, p);
    /* merge_shards refuses the same folder (for a missing file or a gap) */
    if (code == FL_ERR_NOT_FOUND || strstr(what, "gap")) {
        snprintf(p, sizeof p, "%s/merged", out);
        FL_CHECKF(fl_ckpt_merge_shards(dir, p, NULL) != FL_OK && strstr(fl_error_message(), n1) && !exists(p),
                  "%s: merge_shards: %s", what, fl_error_message());
    }
}

FL_TEST(shard_ckpt_bad_input_refused_naming_file_and_range) {
    /* step-1 and step-2 of a 3-rank ZeRO-2 run, saved sharded */
    skjob *a = sk_run(ZR_SGDM, 3, 3, "deepspeed_stage_2", "sharded", 2, 1, NULL, "bad");
    if (a->st[0] != FL_OK) { skfree(a); return; }
    char s1[FL_CFG_PATH + 32], s2[FL_CFG_PATH + 32], d[FL_CFG_PATH], p[3 * FL_CFG_PATH], q[FL_CFG_PATH + 200];
    snprintf(s1, sizeof s1, "%s/step-000001", a->cfg.out_dir);
    snprintf(s2, sizeof s2, "%s/step-000002", a->cfg.out_dir);
    /* the intact one resumes in one process */
    skjob *ok = sk_run(ZR_SGDM, 3, 1, "auto", "full", 3, 0, s2, "bad-intact");
    FL_CHECK(ok->st[0] == FL_OK && ok->rec[0].steps == 3);
    skfree(ok);
    /* a missing shard file */
    snprintf(d, sizeof d, "%s/missing", fl_test_tmpdir());
    copy_dir(s2, d);
    snprintf(p, sizeof p, "%s/shard-00001-of-00003.safetensors", d);
    unlink(p);
    refuse(d, FL_ERR_NOT_FOUND, "missing file", "shard-00001-of-00003.safetensors: missing", "saved by 3 ranks");
    /* a gap: rank 1's file starts 10 elements late */
    size_t off, len;
    fl_comm_chunk(260032, 3, 1, &off, &len);
    snprintf(d, sizeof d, "%s/gap", fl_test_tmpdir());
    copy_dir(s2, d);
    snprintf(p, sizeof p, "%s/shard-00001-of-00003.safetensors", d);
    snprintf(q, sizeof q, "%zu %zu 260032", off + 10, off + len);
    FL_REQUIRE_OK(rewrite_shard(p, "range.params", q, "params", 10));
    snprintf(q, sizeof q, "params: elements [%zu, %zu) of 260032 are in none of the 3 shard files", off, off + 10);
    refuse(d, FL_ERR_FORMAT, "range gap", q, "follows shard-00000-of-00003.safetensors's range");
    /* a file of another step */
    snprintf(d, sizeof d, "%s/mixed", fl_test_tmpdir());
    copy_dir(s2, d);
    snprintf(p, sizeof p, "cp '%s/shard-00002-of-00003.safetensors' '%s/'", s1, d);
    FL_REQUIRE(system(p) == 0);
    refuse(d, FL_ERR_FORMAT, "another step", "shard-00002-of-00003.safetensors: of step 1, the checkpoint is step 2",
           NULL);
    /* a file of another layout */
    snprintf(d, sizeof d, "%s/layout", fl_test_tmpdir());
    copy_dir(s2, d);
    snprintf(p, sizeof p, "%s/shard-00000-of-00003.safetensors", d);
    FL_REQUIRE_OK(rewrite_shard(p, "fingerprint", "0123456789abcdef", NULL, 0));
    refuse(d, FL_ERR_FORMAT, "another layout", "shard-00000-of-00003.safetensors: of another model layout", NULL);
    /* not committed */
    snprintf(d, sizeof d, "%s/uncommitted", fl_test_tmpdir());
    copy_dir(s2, d);
    snprintf(p, sizeof p, "%s/COMMITTED", d);
    unlink(p);
    refuse(d, FL_ERR_FORMAT, "uncommitted", "not a committed checkpoint", NULL);
    /* another model: gpt2-micro resuming micro's checkpoint */
    fl_run_config c;
    snprintf(d, sizeof d, "%s/other-model", fl_test_tmpdir());
    zr_config(&c, ZR_SGDM, 3, 1, 1, "auto", NULL, d);
    snprintf(c.checkpoint_dir, sizeof c.checkpoint_dir, "gpt2-micro");
    memcpy(c.resume, s2, strlen(s2) + 1); /* s2 is shorter than c.resume */
    /* named by the checkpoint's hyperparameters.yaml (src/train/resume_check.c) */
    FL_CHECKF(fl_trainer_run(&c, NULL, 0, NULL, NULL, NULL) == FL_ERR_INVALID &&
                  strstr(fl_error_message(), "trained from model 'micro', this run's model is 'gpt2-micro'"),
              "another model: %s", fl_error_message());
    /* without it, by the state's element count */
    snprintf(d, sizeof d, "%s/no-hparams", fl_test_tmpdir());
    copy_dir(s2, d);
    snprintf(p, sizeof p, "%s/hyperparameters.yaml", d);
    FL_REQUIRE(unlink(p) == 0);
    memcpy(c.resume, d, strlen(d) + 1);
    snprintf(c.out_dir, sizeof c.out_dir, "%s/other-model-2", fl_test_tmpdir());
    FL_CHECKF(fl_trainer_run(&c, NULL, 0, NULL, NULL, NULL) == FL_ERR_FORMAT &&
                  strstr(fl_error_message(), "sharded_state.safetensors: saved for 260032 trainable elements"),
              "another model: %s", fl_error_message());
    /* a full checkpoint is not a sharded one */
    FL_CHECK(fl_ckpt_merge_shards(a->cfg.out_dir, d, NULL) == FL_ERR_INVALID);
    skfree(a);
}

/* A sharded save that fails at its k-th file write (ENOSPC, whichever rank writes it: k = 0..11
 * covers step-2's folder, metadata, both ranks' shard files and the marker) fails the run on every
 * rank and commits nothing: the newest committed checkpoint is still whole (it merges). */
FL_TEST(shard_ckpt_threads_failed_write_commits_nothing) {
    skjob *a = sk_run(ZR_SGDM, 2, 2, "deepspeed_stage_1", "sharded", 1, 1, NULL, "fault-base");
    if (a->st[0] != FL_OK) { skfree(a); return; }
    int failures = 0;
    for (long k = 0; k < 12; k++) {
        skjob *j = calloc(1, sizeof *j);
        FL_REQUIRE(j != NULL);
        j->cfg = a->cfg;
        j->cfg.train.max_steps = 2;
        j->cfg.eval.final_validation = 0;
        snprintf(j->cfg.resume, sizeof j->cfg.resume, "auto");
        fl_io_fail_writes_after(k);
        fl_status s = fl_comm_threads_run(2, skrank, j);
        fl_io_fail_writes_after(-1);
        int done = s == FL_OK;
        if (!done) {
            failures++;
            for (int r = 0; r < 2; r++)
                FL_CHECKF(j->st[r] == FL_ERR_IO, "k=%ld rank %d: %d %s", k, r, (int)j->st[r], j->msg[r]);
            char latest[FL_CFG_PATH + 32], m[FL_CFG_PATH + 64];
            FL_REQUIRE_OK(fl_ckpt_find_latest(a->cfg.out_dir, latest, sizeof latest));
            snprintf(m, sizeof m, "%s/merged-check", fl_test_tmpdir());
            FL_CHECKF(fl_ckpt_merge_shards(latest, m, NULL) == FL_OK, "k=%ld: the newest committed %s: %s", k, latest,
                      fl_error_message());
        }
        skfree(j);
        if (done) break;
    }
    FL_CHECKF(failures >= 8, "only %d failing writes before a save went through", failures);
    skfree(a);
}

/* The attention's scratch in the plan (issue 30: cuDNN's fused attention copies its operands to bf16 and takes a
 * workspace; they were a buffer of the CUDA backend's own, outside the pools and the plan). A backend states the
 * bytes through fl_backend.attn_scratch_bytes; the model lends scratch_bytes + those from its WORKSPACE and the
 * planner's null backend, standing in for the backend, makes the same allocation. Checked here: the size of cuDNN's
 * copies against a count written from the layout, the facts of "cuda" (what a plan on this machine assumes), and
 * a bf16 step on cuda-emu with a stated size against its plan (every tag's peak) and against the same step
 * without (WORKSPACE grows by exactly the bytes, the lent scratch by them too). */
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda-impl.h"
#include "backend/cuda/cudnn-impl.h"
#include "fitllm/config.h"
#include "fitllm/trainer.h"
#include "test.h"

static size_t up256(size_t b) { return (b + 255) / 256 * 256; }

/* cuDNN's workspace allowance written from its contract (cudnn-impl.h): rows up to 64, an fp32 dQ-sized array, with
 * grouped heads two 16-bit full-head dK / dV arrays, 1 KiB */
static size_t allow(size_t B, size_t Tq, size_t Tk, size_t NH, size_t NKV, size_t HD) {
    const size_t rq = (Tq + 63) / 64 * 64, rk = (Tk + 63) / 64 * 64;
    return up256(B * NH * rq * HD * 4) + (NKV < NH ? 2 * up256(B * NH * rk * HD * 2) : 0) + 1024;
}

FL_TEST(cudnn_sdpa_scratch_bytes_counts) {
    /* B 1, T 7, NH 3, NKV 1, HD 64: q-sized copies 1*7*3*64*2 = 2688 -> 2816 bytes, k-sized 896 -> 1024; the
     * backward's q o dO dQ | k v dK dV, the graph's fp32 dQ accumulator 7*3*64*4 = 5376 bytes, then the allowance
     * for the plan's own workspace: rows 7 -> 64, 3*64*64*4 = 49152 + 2 * 3*64*64*2 + 1024 = 99328 */
    FL_CHECK(allow(1, 7, 7, 3, 1, 64) == 99328);
    FL_CHECK(fl_cudnn_sdpa_scratch_bytes(1, 7, 3, 1, 64) == 4 * 2816 + 4 * 1024 + 5376 + 99328);
    FL_CHECK(fl_cudnn_sdpa_scratch_bytes(2, 33, 8, 2, 128) == 4 * up256(2 * 33 * 8 * 128 * 2) +
                                                                 4 * up256(2 * 33 * 2 * 128 * 2) +
                                                                 up256(2 * 33 * 8 * 128 * 4) + allow(2, 33, 33, 8, 2, 128));
    /* HD 80 (a multiple of 8) as it is; 100 at cuDNN's 104 (its copies zero-padded per head); not NH % NKV != 0, nor
     * a head above 128 */
    FL_CHECK(fl_cudnn_sdpa_scratch_bytes(1, 7, 3, 1, 80) ==
             4 * up256(7 * 3 * 80 * 2) + 4 * up256(7 * 80 * 2) + up256(7 * 3 * 80 * 4) + allow(1, 7, 7, 3, 1, 80));
    FL_CHECK(fl_cudnn_sdpa_scratch_bytes(1, 7, 3, 1, 100) ==
             4 * up256(7 * 3 * 104 * 2) + 4 * up256(7 * 104 * 2) + up256(7 * 3 * 104 * 4) + allow(1, 7, 7, 3, 1, 104));
    FL_CHECK(fl_cudnn_sdpa_scratch_bytes(1, 7, 3, 2, 64) == 0);
    FL_CHECK(fl_cudnn_sdpa_scratch_bytes(1, 7, 3, 1, 136) == 0);
    /* TinyLlama-1.1B (B 4, T 2048, 32 / 4 heads, HD 64): cuDNN 9.19 asks 128 MiB + 128 on an A100, 64 MiB + 256 on an
     * H200 (tests/test_cudnn.c: cudnn_plan_without_a_device) */
    fl_attn_desc tl = {.B = 4, .Tq = 2048, .Tk = 2048, .NH = 32, .NKV = 4, .HD = 64};
    FL_CHECK(fl_cudnn_sdpa_workspace_allowance(&tl) == (size_t)128 * 1024 * 1024 + 1024);
    FL_CHECK(fl_cudnn_sdpa_workspace_allowance(&tl) >= (size_t)134217856 && fl_cudnn_sdpa_workspace_allowance(&tl) >= 67109120);
    fl_attn_desc a = {.B = 1, .Tq = 5, .Tk = 9, .NH = 4, .NKV = 2, .HD = 64};
    FL_CHECK(fl_cudnn_sdpa_copy_bytes(&a, 0) == 2 * up256(5 * 4 * 64 * 2) + 2 * up256(9 * 2 * 64 * 2));
    FL_CHECK(fl_cudnn_sdpa_copy_bytes(&a, 1) == 4 * up256(5 * 4 * 64 * 2) + 4 * up256(9 * 2 * 64 * 2));
    FL_CHECK(fl_cudnn_sdpa_dqacc_bytes(&a) == up256(5 * 4 * 64 * 4));
}

/* A plan for a GPU on this machine counts cuDNN's copies exactly when the backend would load cuDNN here. */
FL_TEST(cuda_facts_attn_scratch_follow_cudnn) {
    fl_cudnn_api api;
    char why[256];
    const int here = fl_cudnn_load(&api, NULL, why, sizeof why) == 0;
    if (here) fl_cudnn_unload(&api);
    fl_backend_facts f;
    setenv("FITLLM_CUDA_ATTN", "own", 1);
    fl_status s = fl_backend_facts_of("cuda", &f);
    unsetenv("FITLLM_CUDA_ATTN");
    FL_REQUIRE_OK(s);
    FL_CHECKF(f.attn_scratch_bytes == NULL, "FITLLM_CUDA_ATTN=own: no cuDNN copies to plan");
    FL_REQUIRE_OK(fl_backend_facts_of("cuda", &f));
    FL_CHECKF(here ? f.attn_scratch_bytes == fl_cudnn_sdpa_scratch_bytes : f.attn_scratch_bytes == NULL,
              "cuDNN %s here, the facts %s", here ? "loads" : "does not load", f.attn_scratch_bytes ? "count it" : "do not");
    fl_backend nb;
    FL_REQUIRE_OK(fl_null_backend_init_for(&nb, "cuda"));
    FL_CHECK(nb.attn_scratch_bytes == f.attn_scratch_bytes);
    fl_null_backend_free(&nb);
}

#ifdef FL_HAVE_CUDA_EMU
static int g_args[5];
static size_t fake_attn_scratch(int B, int T, int NH, int NKV, int HD) {
    g_args[0] = B, g_args[1] = T, g_args[2] = NH, g_args[3] = NKV, g_args[4] = HD;
    return 100003 + (size_t)B * T; /* odd: the carver's 64-byte rounding shows */
}
static void (*g_set_scratch)(const fl_backend *, void *, size_t);
static size_t g_lent;
static void rec_set_scratch(const fl_backend *be, void *p, size_t bytes) {
    if (bytes > g_lent) g_lent = bytes;
    g_set_scratch(be, p, bytes);
}

static fl_status step_on(fl_backend *be, int stated, fl_trainer_result *r) {
    fl_run_config c;
    fl_cfg_defaults(&c, FL_CMD_FINETUNE_FULL);
    snprintf(c.checkpoint_dir, sizeof c.checkpoint_dir, "micro");
    c.train.max_seq_length = 24;
    FL_TRY(fl_cfg_set(&c, "precision", "bf16-true"));
    fl_model_config mc;
    FL_TRY(fl_preset_find("micro", &mc));
    be->attn_scratch_bytes = stated ? fake_attn_scratch : NULL;
    return fl_trainer_rehearse(&c, &mc, be, 0, 2, 24, 1, 0, r);
}
#endif

FL_TEST(cuda_attn_scratch_planned_equals_lent) {
#ifdef FL_HAVE_CUDA_EMU
    fl_cuemu_set_host_memory(0); /* the GPU's paths: a device pool beside the host one */
    fl_backend be, nb;
    fl_status s = fl_backend_init_by_name("cuda-emu", &be, 1);
    if (s == FL_OK) s = fl_null_backend_init_for(&nb, "cuda-emu");
    fl_cuemu_set_host_memory(1);
    FL_REQUIRE_OK(s);
    g_set_scratch = be.set_scratch;
    be.set_scratch = rec_set_scratch;
    fl_trainer_result plain, meas, plan;
    FL_REQUIRE_OK(step_on(&be, 0, &plain));
    const size_t lent_plain = g_lent;
    g_lent = 0;
    memset(g_args, 0, sizeof g_args);
    FL_REQUIRE_OK(step_on(&be, 1, &meas));
    FL_CHECKF(g_args[0] == 2 && g_args[1] == 24 && g_args[2] == 8 && g_args[3] == 4 && g_args[4] == 8,
              "asked for B %d T %d NH %d NKV %d HD %d", g_args[0], g_args[1], g_args[2], g_args[3], g_args[4]);
    const size_t extra = fake_attn_scratch(2, 24, 8, 4, 8);
    FL_CHECKF(lent_plain == be.scratch_bytes && g_lent == be.scratch_bytes + extra, "lent %zu, then %zu (scratch %zu + %zu)",
              lent_plain, g_lent, be.scratch_bytes, extra);
    FL_CHECKF(meas.peak[FL_TAG_WORKSPACE] == plain.peak[FL_TAG_WORKSPACE] + (extra + 63) / 64 * 64,
              "WORKSPACE %zu with the attention's scratch, %zu without (+%zu)", meas.peak[FL_TAG_WORKSPACE],
              plain.peak[FL_TAG_WORKSPACE], extra);
    FL_REQUIRE_OK(step_on(&nb, 1, &plan));
    for (int t = 0; t < FL_TAG_COUNT; t++)
        FL_CHECKF(plan.peak[t] == meas.peak[t], "tag %d: planned %zu, measured %zu", t, plan.peak[t], meas.peak[t]);
    be.set_scratch = g_set_scratch;
    fl_null_backend_free(&nb);
    fl_backend_free(&be);
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

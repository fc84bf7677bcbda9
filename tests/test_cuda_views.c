/* bf16 storage without the fp32 views nothing reads (issue 30 item 1, FL_CAP_VIEWS16: cuda, cuda-emu). A bf16 run's
 * stored slots are written in bf16 by the ops that make them; on the CPU backends each also keeps an fp32 view in
 * WORKSPACE (they compute in fp32). On a backend whose bf16 ops take out == NULL, the views no forward op, backward
 * op or head reads (fl_block_views32, exec.c) are neither written nor carved. Checked here:
 *   - the bytes: WORKSPACE's peak of one step with every view (FITLLM_CUDA_VIEWS32=1, the earlier layout) minus the
 *     default's is at least the dropped slots' views (a ratchet: keeping one again fails), by slot name and width,
 *     for LLaMA (RMSNorm, SwiGLU), GPT-2 and OPT (LayerNorm, biases, GELU / ReLU), bf16-true and bf16-mixed,
 *     checkpointing and LoRA (whose adapters read their input's view: kept); planned (the null backend standing in
 *     for cuda-emu) = measured on cuda-emu for every tag, both layouts;
 *   - an adapter attached after the arena that left out its input's view: refused by name, the model unchanged;
 *   - a needed view forgotten (fl_views_test_forget: the decision made wrong on purpose) fails the step with the
 *     backend's error naming the NULL tensor, not a crash and not a silent read: the emulator's ops refuse NULL;
 *   - the bits: tests/bitident (cuda-emu bf16 cases against the build before this change) and the op tests'
 *     out == NULL paths (test_cuda_bf16.c, test_cuda_more.c, test_cuda_ln16.c). */
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda-impl.h"
#include "fitllm/config.h"
#include "fitllm/lora.h"
#include "fitllm/trainer.h"
#include "model/model-impl.h"
#include "model/graph.h"
#include "test.h"

#ifdef FL_HAVE_CUDA_EMU

enum { B = 2, T = 24 };

static int g_layers; /* the blocks of the preset's model (0: the preset's) */
static fl_status step(const fl_backend *be, const char *preset, const char *prec, int ckpt, int lora,
                      fl_trainer_result *r) {
    fl_run_config c;
    fl_cfg_defaults(&c, lora ? FL_CMD_FINETUNE_LORA : FL_CMD_FINETUNE_FULL);
    snprintf(c.checkpoint_dir, sizeof c.checkpoint_dir, "%s", preset);
    c.train.max_seq_length = T;
    FL_TRY(fl_cfg_set(&c, "precision", prec));
    if (ckpt) FL_TRY(fl_cfg_set(&c, "train.activation_checkpointing", "true"));
    if (lora == 2) FL_TRY(fl_cfg_set(&c, "quantize", "bnb.nf4")); /* QLoRA */
    fl_model_config mc;
    FL_TRY(fl_preset_find(preset, &mc));
    if (g_layers) mc.n_layers = g_layers;
    return fl_trainer_rehearse(&c, &mc, be, 0, B, T, 1, 0, r);
}

/* the null backend standing in for cuda-emu (views32: with FITLLM_CUDA_VIEWS32=1, every view kept), or cuda-emu */
static fl_status backend(int null, int views32, fl_backend *be) {
    if (views32) setenv("FITLLM_CUDA_VIEWS32", "1", 1);
    fl_cuemu_set_host_memory(0); /* the GPU's paths: a device pool beside the host one */
    fl_status s = null ? fl_null_backend_init_for(be, "cuda-emu") : fl_backend_init_by_name("cuda-emu", be, 1);
    fl_cuemu_set_host_memory(1);
    unsetenv("FITLLM_CUDA_VIEWS32");
    return s;
}
static void backend_free(int null, fl_backend *be) {
    if (null) fl_null_backend_free(be);
    else fl_backend_free(be);
}

/* slot `name`'s index in the preset's block graph (-1: none), and its fp32 view's carved bytes at B x T rows */
static int slot_of(const char *preset, const char *name, size_t *bytes) {
    fl_model_config mc;
    fl_block_graph g;
    if (fl_preset_find(preset, &mc) != FL_OK || fl_block_graph_build_ex(&mc, 0, &g) != FL_OK) {
        FL_CHECKF(0, "%s: no block graph", preset);
        return -1;
    }
    for (int k = 0; k < g.n_slots; k++)
        if (!strcmp(g.slot[k].name, name)) {
            if (bytes) *bytes = ((size_t)B * T * g.slot[k].width * sizeof(float) + 63) / 64 * 64;
            return k;
        }
    FL_CHECKF(0, "%s has no slot '%s'", preset, name);
    return -1;
}

/* micro's bytes at B x T rows (0: no preset or graph): *blocks the blocks' bf16 dy scratch (N x max(C, QKV, FCW)), *head
 * a logits chunk's (chunk x V), *gsave the gradient buffer's width without d(gate|up) (2 F - (C + 2 KVD) floats a row) */
static int dy16_sizes(size_t *blocks, size_t *head, size_t *gsave) {
    fl_model_config mc;
    fl_block_graph g;
    if (fl_preset_find("micro", &mc) != FL_OK || fl_block_graph_build_ex(&mc, 0, &g) != FL_OK) return 0;
    const size_t wide = (size_t)(g.lin_out_max > mc.dim ? g.lin_out_max : mc.dim);
    const size_t kvd = (size_t)mc.n_kv_heads * (mc.dim / mc.n_heads);
    *blocks = (size_t)B * T * wide * 2;
    *head = (size_t)fl_logits_chunk_rows(mc.vocab_size, B * T) * mc.vocab_size * 2;
    *gsave = (size_t)B * T * (2 * (size_t)mc.ffn_dim - (mc.dim + 2 * kvd)) * sizeof(float);
    return 1;
}

/* the index of the preset's first block op of kind (-1: none) */
static int op_of(const char *preset, int kind) {
    fl_model_config mc;
    fl_block_graph g;
    if (fl_preset_find(preset, &mc) != FL_OK || fl_block_graph_build_ex(&mc, 0, &g) != FL_OK) return -1;
    for (int i = 0; i < g.n_ops; i++)
        if (g.op[i].kind == kind) return i;
    return -1;
}

/* WORKSPACE with every view minus without >= the named slots' views (planned on the null backend; measure: also on
 * cuda-emu, planned = measured for every tag) */
static void views_case(const char *preset, const char *prec, int ckpt, int lora, const char *dropped, int measure) {
    size_t want = 0;
    char names[128];
    snprintf(names, sizeof names, "%s", dropped);
    for (char *t = strtok(names, ","); t; t = strtok(NULL, ",")) {
        size_t b = 0;
        FL_REQUIRE(slot_of(preset, t, &b) >= 0);
        want += b;
    }
    fl_trainer_result r[2][2]; /* [views32][null] */
    for (int v = 0; v < 2; v++)
        for (int n = 1; n >= (measure ? 0 : 1); n--) {
            fl_backend be;
            FL_REQUIRE_OK(backend(n, v, &be));
            memset(&r[v][n], 0, sizeof r[v][n]);
            fl_status s = step(&be, preset, prec, ckpt, lora, &r[v][n]);
            backend_free(n, &be);
            FL_REQUIRE_OK(s);
        }
    const size_t all = r[1][1].peak[FL_TAG_WORKSPACE], none = r[0][1].peak[FL_TAG_WORKSPACE];
    FL_CHECKF(all >= none && all - none >= want,
              "%s %s%s%s: WORKSPACE %zu with every fp32 view, %zu without: %zd fewer bytes, the views of %s are %zu",
              preset, prec, ckpt ? " ckpt" : "", lora ? " lora" : "", all, none, (ptrdiff_t)(all - none), dropped, want);
    printf("      %-10s %-10s%s%s WORKSPACE %zu -> %zu bytes (%s not carved: %zu)\n", preset, prec, ckpt ? " ckpt" : "",
           lora ? " lora" : "", all, none, dropped, want);
    for (int v = 0; measure && v < 2; v++)
        for (int t = 0; t < FL_TAG_COUNT; t++)
            FL_CHECKF(r[v][1].peak[t] == r[v][0].peak[t], "%s %s views32 %d tag %d: planned %zu, measured %zu", preset,
                      prec, v, t, r[v][1].peak[t], r[v][0].peak[t]);
}
#endif

FL_TEST(cuda_emu_views16_workspace) {
#ifdef FL_HAVE_CUDA_EMU
    /* planned = measured on cuda-emu (under ASan's quick tier the plans alone: cuda_attn_scratch_planned_equals_lent
     * measures the same step there) */
    views_case("micro", "bf16-true", 0, 0, "ln1,att,ln2,fc,act", !fl_test_asan_light());
    views_case("micro", "bf16-mixed", 0, 0, "ln1,att,ln2,fc,act", 0);
    views_case("micro", "bf16-true", 1, 0, "ln1,att,ln2,fc,act", 0);
    views_case("micro", "bf16-true", 0, 1, "att,ln2,fc,act", 0); /* LoRA on q, v: their adapters read ln1 */
    /* GPT-2 / OPT: fc's view stays (a biased linear writes fp32, the activation rounds it as it reads), and qkv's
     * (gemm_to_attn16's scratch where cuBLASLt refuses the bf16 output) */
    views_case("gpt2-micro", "bf16-true", 0, 0, "ln1,att,ln2,act", 0);
    views_case("opt-micro", "bf16-true", 0, 0, "ln1,att,ln2,act", 0);
    setenv("FITLLM_CUDA_VIEWS32", "yes", 1); /* another value than 0 / 1: refused at set-up, by name */
    fl_backend be;
    fl_status s = fl_backend_init_by_name("cuda-emu", &be, 1);
    unsetenv("FITLLM_CUDA_VIEWS32");
    FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "FITLLM_CUDA_VIEWS32=yes"), "status %d: %s", (int)s,
              fl_error_message());
    if (s == FL_OK) fl_backend_free(&be);
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

FL_TEST(cuda_emu_views16_forgotten_view_fails) {
#ifdef FL_HAVE_CUDA_EMU
    static const char *const needed[] = {"res_mid", "qkv"}; /* o_proj's output the residual add reads; RoPE's input */
    /* (o_proj writes its fp32 output only without the add in its GEMM: gemm_res16 writes the sum's bf16 rows) */
    setenv("FITLLM_CUDA_RESGEMM", "0", 1);
    for (int k = 0; k < 2; k++) {
        const int sl = slot_of("micro", needed[k], NULL);
        FL_REQUIRE(sl >= 0);
        fl_views_test_forget = 1u << sl;
        fl_backend be;
        fl_trainer_result r;
        fl_status s = backend(0, 0, &be);
        if (s == FL_OK) {
            s = step(&be, "micro", "bf16-true", 0, 0, &r);
            backend_free(0, &be);
        }
        fl_views_test_forget = 0;
        FL_CHECKF(s != FL_OK && strstr(fl_error_message(), "NULL tensor"),
                  "'%s' forgotten: status %d (%s), expected the backend's refusal of a NULL tensor", needed[k], (int)s,
                  s == FL_OK ? "ok" : fl_error_message());
    }
    unsetenv("FITLLM_CUDA_RESGEMM");
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

/* LoRA on q, v reads ln1's fp32 view: attached after fl_model_alloc_acts left that view out, the attach is refused
 * naming the slot (not a NULL read at the first step), and the model keeps no adapter */
FL_TEST(cuda_emu_views16_late_adapter_refused) {
#ifdef FL_HAVE_CUDA_EMU
    fl_backend be;
    fl_mem_pool pool, host;
    fl_model m;
    FL_REQUIRE_OK(fl_test_emu_micro(&be, &pool, &host, &m, "views", B, T));
    fl_model_config c;
    FL_REQUIRE_OK(fl_preset_find("micro", &c));
    const int ln1 = slot_of("micro", "ln1", NULL);
    FL_REQUIRE(ln1 >= 0);
    FL_REQUIRE(m.acts->drop32 >> ln1 & 1u); /* the premise: ln1 written in bf16 only */
    fl_lora_config lc;
    FL_REQUIRE_OK(fl_lora_config_init(&lc, &c, 4, 8, 0.0f, 0, "q_proj,v_proj"));
    fl_status s = fl_model_lora_init(&m, &lc, 7);
    FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "fp32 view of 'ln1'") &&
                  strstr(fl_error_message(), "before fl_model_alloc_acts"),
              "status %d: %s", (int)s, s == FL_OK ? "ok" : fl_error_message());
    FL_CHECKF(m.lora == NULL, "the refused LoRA left its state on the model");
    fl_test_emu_micro_free(&be, &pool, &host, &m);
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

/* The fp32 results no op reads (fl_block_only16, exec.c): RoPE's rotated q|k|v in the forward (the attention reads
 * the bf16 rows), the activation's and RoPE's d(in) in the backward (the LINEAR before reads its bf16 dy). A ratchet
 * on the emulator's count of those ops run with a NULL fp32 output (fl_cu_counters.only16) and the fp32 bytes not
 * written, per step of micro cut to 2 LLaMA blocks: forward RoPE, backward SwiGLU and RoPE in each block (checkpointing:
 * RoPE again in the recompute); LoRA on q, v: the forward's RoPE and the backward's SwiGLU (the frozen gate|up base
 * reads its dy in bf16 alone: fl_act_opts.dy_bf16), not the backward's RoPE (the q|k|v linear's adapters read
 * d(q|k|v) in fp32); QLoRA under FITLLM_CUDA_Q4=fp32: the forward's RoPE only (the fp32 4-bit kernels read dy in
 * fp32); QLoRA at a bf16 run's default (scratch, its 4-bit bases reading the bf16 dy: FL_CAP_Q4X16): LoRA's two, the
 * frozen 4-bit gate|up reading its dy in bf16 alone; every view kept (FITLLM_CUDA_VIEWS32=1): none (a step in
 * the full tier; the quick tier checks that the knob drops FL_CAP_VIEWS16, which fl_block_only16 requires). Each
 * step also succeeds, so no op was handed a NULL it reads. */
#ifdef FL_HAVE_CUDA_EMU
static void only16_case(const char *prec, int ckpt, int lora, int views32, long want_ops, long want_bytes) {
    fl_backend be;
    fl_trainer_result r;
    FL_REQUIRE_OK(backend(0, views32, &be));
    fl_cu_counters c0, c1;
    fl_cuemu_backend_counters(&be, &c0);
    fl_status s = step(&be, "micro", prec, ckpt, lora, &r);
    fl_cuemu_backend_counters(&be, &c1);
    backend_free(0, &be);
    FL_CHECKF(s == FL_OK, "%s ckpt %d lora %d views32 %d: %s", prec, ckpt, lora, views32, fl_error_message());
    const long ops = c1.only16 - c0.only16, bytes = c1.only16_bytes - c0.only16_bytes;
    FL_CHECKF(ops == want_ops && bytes == want_bytes,
              "%s ckpt %d lora %d views32 %d: %ld ops wrote bf16 only (%ld fp32 bytes not written), expected %ld (%ld)",
              prec, ckpt, lora, views32, ops, bytes, want_ops, want_bytes);
    printf("      micro %-10s%s%s%s: %ld ops bf16 only, %ld fp32 bytes not written\n", prec, ckpt ? " ckpt" : "",
           lora == 1 ? " lora" : lora == 2 ? " qlora" : "", views32 ? " views32" : "", ops, bytes);
}
#endif

FL_TEST(cuda_emu_only16_ratchet) {
#ifdef FL_HAVE_CUDA_EMU
    fl_model_config mc;
    FL_REQUIRE_OK(fl_preset_find("micro", &mc));
    g_layers = 2; /* micro's blocks, two of its five (the time) */
    const long L = g_layers, N = B * T, QKV = (long)(mc.n_heads + 2 * mc.n_kv_heads) * (mc.dim / mc.n_heads);
    const long rope = N * QKV * 4, swiglu = N * 2L * mc.ffn_dim * 4; /* one op's fp32 bytes */
    only16_case("bf16-true", 0, 0, 0, 3 * L, L * (2 * rope + swiglu));
    only16_case("bf16-mixed", 1, 0, 0, 4 * L - 1, (2 * L - 1) * rope + L * (rope + swiglu)); /* block L-1 kept live */
    if (!fl_test_asan_light()) {
        only16_case("bf16-true", 0, 1, 0, 2 * L, L * (rope + swiglu));
        setenv("FITLLM_CUDA_Q4", "fp32", 1);
        only16_case("bf16-mixed", 0, 2, 0, L, L * rope);
        unsetenv("FITLLM_CUDA_Q4");
        only16_case("bf16-mixed", 0, 2, 0, 2 * L, L * (rope + swiglu));
    }
    if (!fl_test_quick()) only16_case("bf16-true", 0, 0, 1, 0, 0); /* full tier; quick: VIEWS32 drops the capability */
    fl_backend be;
    FL_REQUIRE_OK(backend(0, 1, &be));
    FL_CHECKF(!(be.caps & FL_CAP_VIEWS16), "FITLLM_CUDA_VIEWS32=1 kept FL_CAP_VIEWS16 (fl_block_only16 would skip writes)");
    backend_free(0, &be);
    g_layers = 0;
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

/* A frozen bf16 base's dy scratch (fl_act_opts.dy_bf16: LoRA on an FL_CAP_COMPUTE_BF16 backend; test_cuda_lora16.c
 * checks its bits): WORKSPACE grows by exactly max(N x max(C, QKV, FCW), a logits chunk x V) bf16 against
 * FITLLM_CUDA_LORA16=0 (QLoRA under FITLLM_CUDA_Q4=fp32: the chunk's alone, for the head; its default bf16 path:
 * cuda_emu_q416_workspace), less LoRA's d(gate|up) gradient width (held in
 * bf16 only once its frozen base reads a bf16 dy: cuda_emu_grads16_sizing), planned (the null backend standing in for cuda-emu)
 * = measured on cuda-emu for every tag, both ways. */
FL_TEST(cuda_emu_lora16_workspace) {
#ifdef FL_HAVE_CUDA_EMU
    size_t blocks, head, gs;
    FL_REQUIRE(dy16_sizes(&blocks, &head, &gs));
    g_layers = 2;
    for (int lora = 1; lora <= (fl_test_asan_light() ? 1 : 2); lora++) {
        fl_trainer_result r[2][2]; /* [knob on][null] */
        if (lora == 2) setenv("FITLLM_CUDA_Q4", "fp32", 1); /* the fp32 4-bit kernels (a bf16 run's default: scratch) */
        for (int on = 0; on < 2; on++)
            for (int n = 1; n >= 0; n--) {
                fl_backend be;
                FL_REQUIRE_OK(backend(n, 0, &be));
                memset(&r[on][n], 0, sizeof r[on][n]);
                if (!on) setenv("FITLLM_CUDA_LORA16", "0", 1);
                fl_status s = step(&be, "micro", "bf16-true", 0, lora, &r[on][n]);
                unsetenv("FITLLM_CUDA_LORA16");
                backend_free(n, &be);
                FL_REQUIRE_OK(s);
                for (int t = 0; n == 0 && t < FL_TAG_COUNT; t++)
                    FL_CHECKF(r[on][1].peak[t] == r[on][0].peak[t], "%s knob %d tag %d: planned %zu, measured %zu",
                              lora == 1 ? "LoRA" : "QLoRA", on, t, r[on][1].peak[t], r[on][0].peak[t]);
            }
        const size_t w0 = r[0][0].peak[FL_TAG_WORKSPACE], w1 = r[1][0].peak[FL_TAG_WORKSPACE];
        const size_t want = lora == 1 ? (blocks > head ? blocks : head) : head;
        /* LoRA (not 4-bit): the frozen gate|up base then reads its dy in bf16 alone, so SwiGLU's d(gate|up) is not held
         * in fp32 and gradient buffer 2 shrinks to d(q|k|v)'s width (fl_block_grads_dropped) */
        const size_t gsave = lora == 1 ? gs : 0;
        FL_CHECKF((ptrdiff_t)(w1 - w0) == (ptrdiff_t)want - (ptrdiff_t)gsave,
                  "%s bf16-true: WORKSPACE %zu with the dy scratch, %zu without: %zd bytes, want %zu - %zu",
                  lora == 1 ? "LoRA" : "QLoRA", w1, w0, (ptrdiff_t)(w1 - w0), want, gsave);
        printf("      micro %s bf16-true WORKSPACE %zu -> %zu bytes (the dy scratch: %zu; d(gate|up) in bf16 only: -%zu)\n",
               lora == 1 ? "LoRA" : "QLoRA", w0, w1, want, gsave);
        unsetenv("FITLLM_CUDA_Q4");
    }
    g_layers = 0;
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

/* QLoRA's 4-bit bases over the stored bf16 input and dy (FL_CAP_Q4X16: FITLLM_CUDA_Q4=tc; test_cuda_lora16.c checks the
 * bits): against FITLLM_CUDA_Q4X16=0, WORKSPACE loses exactly the fp32 views only the bases read (att, ln2, act: LoRA on
 * q, v keeps ln1's, its adapters read it) and SwiGLU's d(gate|up) gradient width (the frozen gate|up base reads its dy
 * in bf16 alone), and gains the blocks' dy scratch over the head's chunk (fl_act_opts.dy_bf16 2 -> 1); planned (the
 * null backend standing in for cuda-emu) = measured for every tag, both ways; fl_block_only16 adds SwiGLU's backward
 * in each block (its fp32 d(gate|up) not written). */
FL_TEST(cuda_emu_q416_workspace) {
#ifdef FL_HAVE_CUDA_EMU
    size_t blocks, head, gsave;
    FL_REQUIRE(dy16_sizes(&blocks, &head, &gsave));
    g_layers = 2;
    size_t views = 0, v;
    FL_REQUIRE(slot_of("micro", "att", &v) >= 0);
    views += v;
    FL_REQUIRE(slot_of("micro", "ln2", &v) >= 0);
    views += v;
    FL_REQUIRE(slot_of("micro", "act", &v) >= 0);
    views += v;
    fl_trainer_result r[2][2]; /* [knob on][null] */
    long only16[2] = {0, 0};
    setenv("FITLLM_CUDA_Q4", "tc", 1);
    for (int on = 0; on < 2; on++)
        for (int n = 1; n >= 0; n--) {
            fl_backend be;
            if (!on) setenv("FITLLM_CUDA_Q4X16", "0", 1);
            fl_status s = backend(n, 0, &be);
            memset(&r[on][n], 0, sizeof r[on][n]);
            fl_cu_counters c0 = {0}, c1 = {0};
            if (s == FL_OK && !n) fl_cuemu_backend_counters(&be, &c0);
            if (s == FL_OK) s = step(&be, "micro", "bf16-true", 0, 2, &r[on][n]);
            if (s == FL_OK && !n) fl_cuemu_backend_counters(&be, &c1), only16[on] = (long)(c1.only16 - c0.only16);
            unsetenv("FITLLM_CUDA_Q4X16");
            backend_free(n, &be);
            FL_CHECKF(s == FL_OK, "QLoRA tc knob %d %s: %s", on, n ? "planned" : "measured", fl_error_message());
            if (s != FL_OK) break;
            for (int t = 0; n == 0 && t < FL_TAG_COUNT; t++)
                FL_CHECKF(r[on][1].peak[t] == r[on][0].peak[t], "QLoRA tc knob %d tag %d: planned %zu, measured %zu",
                          on, t, r[on][1].peak[t], r[on][0].peak[t]);
        }
    unsetenv("FITLLM_CUDA_Q4");
    /* the variable unset: a bf16 run's default (scratch; its panel is the work area's, already counted) plans and
     * measures alike, every tag, and binds as tc does (the same views and dy scratch: tc's WORKSPACE) */
    fl_trainer_result rd[2]; /* [null] */
    for (int n = 1; n >= 0; n--) {
        fl_backend be;
        FL_REQUIRE_OK(backend(n, 0, &be));
        memset(&rd[n], 0, sizeof rd[n]);
        fl_status s = step(&be, "micro", "bf16-true", 0, 2, &rd[n]);
        backend_free(n, &be);
        FL_REQUIRE_OK(s);
    }
    for (int t = 0; t < FL_TAG_COUNT; t++)
        FL_CHECKF(rd[1].peak[t] == rd[0].peak[t], "QLoRA default tag %d: planned %zu, measured %zu", t, rd[1].peak[t],
                  rd[0].peak[t]);
    FL_CHECKF(rd[0].peak[FL_TAG_WORKSPACE] == r[1][0].peak[FL_TAG_WORKSPACE],
              "QLoRA bf16-true WORKSPACE %zu at the default (scratch), %zu under tc", rd[0].peak[FL_TAG_WORKSPACE],
              r[1][0].peak[FL_TAG_WORKSPACE]);
    const size_t w0 = r[0][0].peak[FL_TAG_WORKSPACE], w1 = r[1][0].peak[FL_TAG_WORKSPACE];
    const ptrdiff_t want = (ptrdiff_t)(blocks > head ? blocks - head : 0) - (ptrdiff_t)views - (ptrdiff_t)gsave;
    FL_CHECKF((ptrdiff_t)(w1 - w0) == want,
              "QLoRA tc bf16-true: WORKSPACE %zu with the bf16 4-bit inputs, %zu without: %zd bytes, want +%zu (dy "
              "scratch) - %zu (att, ln2, act views) - %zu (d(gate|up))", w1, w0, (ptrdiff_t)(w1 - w0),
              blocks > head ? blocks - head : 0, views, gsave);
    FL_CHECKF(only16[0] == g_layers && only16[1] == 2 * g_layers,
              "QLoRA tc: %ld ops bf16-only with the knob off, %ld on; expected %d -> %d", only16[0], only16[1], g_layers,
              2 * g_layers);
    printf("      micro QLoRA tc bf16-true WORKSPACE %zu -> %zu bytes; ops bf16-only %ld -> %ld\n", w0, w1, only16[0],
           only16[1]);
    /* a wrong decision fails the step naming the slot: the 4-bit linears bound without q416 (fl_q416_test_unbind)
     * where set-up left their inputs' views out (the o projection reads att first) */
    fl_backend be;
    fl_trainer_result rr;
    setenv("FITLLM_CUDA_Q4", "tc", 1);
    FL_REQUIRE_OK(backend(0, 0, &be));
    fl_q416_test_unbind = 1;
    fl_status s = step(&be, "micro", "bf16-true", 0, 2, &rr);
    fl_q416_test_unbind = 0;
    backend_free(0, &be);
    unsetenv("FITLLM_CUDA_Q4");
    FL_CHECKF(s != FL_OK && strstr(fl_error_message(), "fp32 view of 'att'"), "QLoRA tc unbound: status %d (%s)",
              (int)s, s == FL_OK ? "ok" : fl_error_message());
    g_layers = 0;
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

/* A wrong decision fails the step naming the slot, not a read of stale or unwritten memory: RoPE made bf16-only
 * where the attention reads fp32 (the backend without attention_forward_in16), and GELU's d(fc) made bf16-only where
 * GPT-2's biased c_fc reads it in fp32 for its bias gradient (fl_only16_test_force) */
FL_TEST(cuda_emu_only16_forced_fails) {
#ifdef FL_HAVE_CUDA_EMU
    static const struct { const char *preset; int kind; const char *want; } cs[] = {
        {"micro", FL_GOP_ROPE, "fp32 view of 'qkv', which RoPE wrote in bf16 only"},
        {"gpt2-micro", FL_GOP_GELU, "reads d('fc') in fp32"},
    };
    for (int k = 0; k < 2; k++) {
        const int i = op_of(cs[k].preset, cs[k].kind);
        FL_REQUIRE(i >= 0);
        fl_backend be;
        fl_trainer_result r;
        FL_REQUIRE_OK(backend(0, 0, &be));
        if (k == 0) be.attention_forward_in16 = NULL;
        fl_only16_test_force = 1u << i;
        g_layers = 1;
        fl_status s = step(&be, cs[k].preset, "bf16-true", 0, 0, &r);
        g_layers = 0;
        fl_only16_test_force = 0;
        backend_free(0, &be);
        FL_CHECKF(s != FL_OK && strstr(fl_error_message(), cs[k].want), "%s op %d forced bf16-only: status %d (%s)",
                  cs[k].preset, i, (int)s, s == FL_OK ? "ok" : fl_error_message());
    }
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

/* The gradient buffers sized without the fp32 gradients no backward pass writes (fl_block_grads_dropped, exec16.c;
 * acts.c's gdrop): a LLaMA block's d(gate|up) is held in bf16 only (act_backward16 with din NULL, the gate|up LINEAR
 * reading its bf16 dy), so buffer 2 needs d(q|k|v)'s width only. Checked: which slots, by name, for LLaMA bf16-true /
 * bf16-mixed / checkpointed and LoRA on q, v (its frozen gate|up base reads a bf16 dy: fc) and where the LINEAR reads
 * d(fc) in fp32 (none: GPT-2 / OPT's biased c_fc, LoRA on gate|up (its adapters), FITLLM_CUDA_LORA16=0, QLoRA); the bytes against the shapes (micro: B T x (2 F - (C + 2 KVD)) floats; TinyLlama-1.1B at B 4,
 * T 2048 planned: 8,192 x (11,264 - 2,560) x 4 = 285,212,672); planned = measured on cuda-emu with it is
 * cuda_emu_views16_workspace's; a pass that would write a dropped slot's fp32 gradient fails naming it, and an adapter
 * attached after the arena whose linear would need one is refused naming it. */
#ifdef FL_HAVE_CUDA_EMU
static fl_status grads_model(const char *preset, int prec, int ckpt, const char *lora, fl_backend *be,
                             fl_mem_pool *pool, fl_model *m) {
    fl_model_config c;
    FL_TRY(fl_preset_find(preset, &c));
    c.n_layers = 2;
    fl_model_storage st;
    fl_model_storage_for(fl_precision_get(prec), &st);
    FL_TRY(fl_model_init_ex(m, &c, be, pool, &st));
    m->act_ckpt = ckpt;
    fl_model_init_random(m, 5);
    FL_TRY(fl_model_set_precision(m, fl_precision_get(prec)));
    if (lora) {
        fl_lora_config lc;
        FL_TRY(fl_lora_config_init(&lc, &c, 4, 8, 0.0f, 0, lora));
        FL_TRY(fl_model_lora_init(m, &lc, 7));
    } else
        FL_TRY(fl_model_alloc_grads(m));
    return fl_model_alloc_acts(m, B, T);
}
static void grads_case(const char *preset, int prec, int ckpt, const char *lora, const char *want) {
    fl_backend be;
    FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
    fl_mem_pool pool, host;
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &host, "grads16", 0));
    fl_model m;
    memset(&m, 0, sizeof m);
    fl_status s = grads_model(preset, prec, ckpt, lora, &be, &pool, &m);
    FL_CHECKF(s == FL_OK, "%s: %s", preset, fl_error_message());
    const unsigned want_bits = *want ? 1u << slot_of(preset, want, NULL) : 0;
    if (s == FL_OK)
        FL_CHECKF(m.acts->gdrop == want_bits, "%s prec %d ckpt %d lora %s: gradients held in bf16 only 0x%x, expected "
                  "0x%x ('%s')", preset, prec, ckpt, lora ? lora : "-", m.acts->gdrop, want_bits, want);
    fl_model_free(&m);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}
#endif

FL_TEST(cuda_emu_grads16_sizing) {
#ifdef FL_HAVE_CUDA_EMU
    grads_case("micro", FL_PREC_BF16_TRUE, 0, NULL, "fc");
    grads_case("micro", FL_PREC_BF16_MIXED, 1, NULL, "fc");
    grads_case("micro", FL_PREC_32_TRUE, 0, NULL, ""); /* fp32 activations: no bf16 ops */
    grads_case("micro", FL_PREC_BF16_TRUE, 0, "q_proj,v_proj", "fc"); /* the frozen gate|up reads its bf16 dy alone */
    grads_case("micro", FL_PREC_BF16_TRUE, 0, "q_proj,v_proj,gate_proj,up_proj", ""); /* its adapters read fp32 dy */
    setenv("FITLLM_CUDA_LORA16", "0", 1); /* the frozen bases read the fp32 dy */
    grads_case("micro", FL_PREC_BF16_TRUE, 0, "q_proj,v_proj", "");
    unsetenv("FITLLM_CUDA_LORA16");
    grads_case("gpt2-micro", FL_PREC_BF16_TRUE, 0, NULL, ""); /* c_fc's bias gradient sums the fp32 d(fc) */
    grads_case("opt-micro", FL_PREC_BF16_TRUE, 0, NULL, "");
    /* the bytes: the sizing with and without, against the shapes */
    static const struct { const char *preset; int B, T; } sh[] = {{"micro", B, T}, {"tinyllama-1.1b", 4, 2048}};
    for (int k = 0; k < 2; k++) {
        fl_model_config c;
        FL_REQUIRE_OK(fl_preset_find(sh[k].preset, &c));
        const int fc = slot_of("micro", "fc", NULL);
        fl_act_opts o = {0, FL_BF16, 1, FL_F32, 0, 0, 0, 0, 0, 0};
        fl_act_sizes with, without;
        fl_sizing_acts_ex(&c, sh[k].B, sh[k].T, &o, &without);
        o.gdrop = 1u << fc;
        fl_sizing_acts_ex(&c, sh[k].B, sh[k].T, &o, &with);
        const size_t n = (size_t)sh[k].B * sh[k].T, kvd = (size_t)c.n_kv_heads * (c.dim / c.n_heads);
        const size_t want = n * (2 * (size_t)c.ffn_dim - (c.dim + 2 * kvd)) * sizeof(float);
        FL_CHECKF(without.workspace_bytes - with.workspace_bytes == want,
                  "%s B %d T %d: WORKSPACE %zu -> %zu, %zd fewer bytes, expected %zu", sh[k].preset, sh[k].B, sh[k].T,
                  without.workspace_bytes, with.workspace_bytes,
                  (ptrdiff_t)(without.workspace_bytes - with.workspace_bytes), want);
        printf("      %-15s B %d T %-5d WORKSPACE %zu -> %zu bytes (d(gate|up) in bf16 only)\n", sh[k].preset, sh[k].B,
               sh[k].T, without.workspace_bytes, with.workspace_bytes);
    }
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

/* a pass that would write an fp32 gradient the buffers lack fails naming it (the sizing made wrong on purpose: 'qkv'
 * taken as dropped); an adapter on the gate|up linear attached after the arena is refused naming d(fc) (its views
 * taken as all carved, so the gradient's refusal is the one reached) */
FL_TEST(cuda_emu_grads16_lacking_refused) {
#ifdef FL_HAVE_CUDA_EMU
    fl_backend be;
    FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
    fl_mem_pool pool, host;
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &host, "grads16", 0));
    fl_model m;
    memset(&m, 0, sizeof m);
    FL_REQUIRE_OK(grads_model("micro", FL_PREC_BF16_TRUE, 0, NULL, &be, &pool, &m));
    const int qkv = slot_of("micro", "qkv", NULL), fc = slot_of("micro", "fc", NULL);
    FL_REQUIRE(m.acts->gdrop == 1u << fc);
    m.acts->gdrop |= 1u << qkv;
    int32_t ids[B * T], tg[B * T];
    for (int i = 0; i < B * T; i++) ids[i] = (i * 7 + 3) % m.cfg.vocab_size, tg[i] = (i * 5 + 1) % m.cfg.vocab_size;
    fl_status s = fl_model_forward(&m, ids, tg, B, T, 1.0f / (B * T), NULL);
    if (s == FL_OK) s = fl_model_backward(&m);
    FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "writes d('qkv') in fp32") &&
                  strstr(fl_error_message(), "sized without"),
              "status %d: %s", (int)s, s == FL_OK ? "ok" : fl_error_message());
    fl_model_free(&m);
    /* LoRA on gate|up (+ down) attached late: its frozen base reads d(fc) in fp32 */
    memset(&m, 0, sizeof m);
    FL_REQUIRE_OK(grads_model("micro", FL_PREC_BF16_TRUE, 0, NULL, &be, &pool, &m));
    m.acts->drop32 = 0; /* (every view carved: the views' refusal is cuda_emu_views16_late_adapter_refused's) */
    fl_model_config c = m.cfg;
    fl_lora_config lc;
    FL_REQUIRE_OK(fl_lora_config_init(&lc, &c, 4, 8, 0.0f, 0, "gate_proj,up_proj"));
    s = fl_model_lora_init(&m, &lc, 7);
    FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "fp32 gradient of 'fc'"), "status %d: %s", (int)s,
              s == FL_OK ? "ok" : fl_error_message());
    fl_model_free(&m);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

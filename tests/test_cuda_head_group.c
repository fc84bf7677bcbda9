/* A trained bf16 LM head's weight gradient over a group of loss chunks in one GEMM (FL_CAP_HEAD_GROUP: cuda,
 * cuda-emu; FITLLM_CUDA_HEAD_GROUP=0 off; src/model/transformer.c). On the H200 the head's per-chunk dW GEMM
 * (32000 x 2048 x 262 for TinyLlama) ran at 41% of cuBLASLt's peak: K, a chunk's ~262 rows, is too short. The chunks'
 * bf16 dlogits now sit side by side in the dy scratch (which is sized for the widest linear's (N, out) and holds
 * several) and one GEMM reads the group.
 *
 * The exact check: a group of G chunks of R rows is, for the dW, a chunk of G*R rows: each row's logits, loss, dlogits
 * and dx are the same whatever the chunking (the emulated GEMM's element is one float64 chain over k, whatever M), and
 * the grouped dW GEMM is the same call as the larger chunk's. So training with chunks of 8 rows grouped (G = 2 at this
 * shape) gives the same bits as chunks of 16 rows without grouping, parameters and loss; and it differs from chunks
 * of 8 without grouping in bf16-mixed's fp32 master weights (the dW sums split at another place), which shows the
 * grouping ran (bf16-true's bf16 weights round so small a difference away). Chunk rows forced through the tests'
 * hook fl_logits_chunk_rows_test (micro: 512 tokens, T 32: one chunk otherwise). A bad knob value is named. */
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"
#include "fitllm/model.h"
#include "test.h"

#if defined(FL_HAVE_CUDA_EMU) && !defined(__SANITIZE_ADDRESS__)
static void run(fl_test_step_rec *r, int rows, const char *group, const char *prec) {
    fl_logits_chunk_rows_test = rows;
    char tag[32];
    snprintf(tag, sizeof tag, "hg%d", rows);
    fl_status s = fl_test_emu_knob_run_t(r, "FITLLM_CUDA_HEAD_GROUP", group, tag, "micro", prec, 0, 0, 32);
    fl_logits_chunk_rows_test = 0;
    FL_CHECKF(s == FL_OK && r->steps == 1 && r->n, "micro %s, chunks of %d, FITLLM_CUDA_HEAD_GROUP=%s: %s", prec, rows,
              group, s == FL_OK ? "no step recorded" : fl_error_message());
}
static void group_case(const char *prec) {
    fl_test_step_rec g2, c4, c2;
    memset(&g2, 0, sizeof g2), memset(&c4, 0, sizeof c4), memset(&c2, 0, sizeof c2);
    /* 32 rows: the dy scratch holds (32, 344) bf16 (gate|up), two chunks of (8, 512) logits: G = 2 */
    run(&g2, 8, "1", prec); /* 4 chunks of 8 rows, two groups of 2 */
    run(&c4, 16, "0", prec); /* 2 chunks of 16 rows */
    run(&c2, 8, "0", prec); /* 4 chunks of 8 rows, a dW GEMM each */
    if (g2.n && c4.n && c2.n) {
        FL_CHECKF(g2.n == c4.n && !memcmp(g2.params, c4.params, g2.n) && g2.loss == c4.loss,
                  "micro %s: chunks of 8 grouped by 2 differ from chunks of 16 (loss %.9g / %.9g)", prec, g2.loss,
                  c4.loss);
        /* bf16-mixed's fp32 master weights show the dW's other rounding; bf16-true's bf16 weights round it away */
        const int differ = g2.n == c2.n && memcmp(g2.params, c2.params, g2.n) != 0;
        FL_CHECKF(g2.loss == c2.loss && (differ || strcmp(prec, "bf16-mixed")),
                  "micro %s: grouping changed %s (loss %.9g / %.9g)", prec,
                  g2.loss != c2.loss ? "the loss" : "no parameter bit: it did not run", g2.loss, c2.loss);
        printf("      micro %s: loss %.9g; chunks of 8 grouped = chunks of 16 in every parameter bit, %s ungrouped\n",
               prec, g2.loss, differ ? "!=" : "==");
    }
    free(g2.params), free(c4.params), free(c2.params);
}
#endif

FL_TEST(cuda_emu_head_group_bits) {
#if defined(FL_HAVE_CUDA_EMU) && !defined(__SANITIZE_ADDRESS__)
    group_case("bf16-true");
    group_case("bf16-mixed");
#elif defined(FL_HAVE_CUDA_EMU)
    fl_test_skip("the release pass runs it (emulated kernels under ASan)");
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

FL_TEST(cuda_emu_head_group_knob) {
#ifdef FL_HAVE_CUDA_EMU
    fl_backend be;
    FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
    FL_CHECK(be.caps & FL_CAP_HEAD_GROUP); /* on by default */
    fl_backend_free(&be);
    setenv("FITLLM_CUDA_HEAD_GROUP", "0", 1);
    FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
    FL_CHECK(!(be.caps & FL_CAP_HEAD_GROUP));
    fl_backend_free(&be);
    unsetenv("FITLLM_CUDA_HEAD_GROUP");
    fl_test_emu_knob_refused("FITLLM_CUDA_HEAD_GROUP");
#else
    fl_test_skip("no CUDA emulator in this build");
#endif
}

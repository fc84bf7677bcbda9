/* The running loss's window in the training state (src/train/checkpoint.c). */
#include <stdio.h>

#include "test.h"
#include "train/shard_ckpt.h"

/* The running loss's window through the training state's metadata: the same ring back into a window of its size, the
 * last losses that fit into a smaller one, those saved pushed anew into a larger one; a state without it (an older
 * checkpoint) loads with an empty window. */
FL_TEST(resume_loss_window_in_training_state) {
    char p[600], q[600];
    snprintf(p, sizeof p, "%s/state.safetensors", fl_test_tmpdir());
    snprintf(q, sizeof q, "%s/old.safetensors", fl_test_tmpdir());
    double ring[4] = {0.25, 1.0 / 3, 2.5, 3.75}; /* pushes 0 .. 5: 0.25 at 0 and 4, 1/3 at 1 and 5 */
    fl_train_state st = {.step = 3, .iter = 6, .loss_window = ring, .loss_window_size = 4, .loss_window_n = 6};
    FL_REQUIRE_OK(fl_ckpt_write_state_meta(p, "fitllm-training-state", NULL, &st, NULL, 0, NULL, NULL, 0));
    fl_train_state none = {.step = 3, .iter = 6};
    FL_REQUIRE_OK(fl_ckpt_write_state_meta(q, "fitllm-training-state", NULL, &none, NULL, 0, NULL, NULL, 0));
    static const struct {
        int size;
        long n;
        double want[8];
    } cases[] = {
        {4, 6, {0.25, 1.0 / 3, 2.5, 3.75}}, /* the same ring, bit for bit */
        {2, 6, {0.25, 1.0 / 3}},            /* the last two (pushes 4 and 5) where a ring of 2 holds them */
        {3, 6, {3.75, 0.25, 1.0 / 3}},      /* pushes 3, 4, 5 (3.75, 0.25, 1/3) at 3 % 3 = 0, 1, 2 */
        {8, 4, {2.5, 3.75, 0.25, 1.0 / 3}}, /* only 4 of the 6 were kept: pushed anew, oldest first */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        double w[8];
        for (int j = 0; j < 8; j++) w[j] = -1;
        fl_train_state got = {.loss_window = w, .loss_window_size = cases[i].size};
        fl_st_file f;
        FL_REQUIRE_OK(fl_st_open(&f, p));
        fl_status s = fl_ckpt_read_state_meta(&f, p, NULL, &got);
        fl_st_close(&f);
        FL_REQUIRE_OK(s);
        FL_CHECKF(got.step == 3 && got.iter == 6 && got.loss_window == w && got.loss_window_size == cases[i].size,
                  "size %d: the state or the caller's window lost", cases[i].size);
        FL_CHECKF(got.loss_window_n == cases[i].n, "size %d: n %ld, want %ld", cases[i].size, got.loss_window_n,
                  cases[i].n);
        for (int j = 0; j < cases[i].size; j++)
            FL_CHECKF(w[j] == (j < 4 || cases[i].size < 8 ? cases[i].want[j] : 0), "size %d: [%d] = %.17g",
                      cases[i].size, j, w[j]);
    }
    double w[4] = {9, 9, 9, 9};
    fl_train_state got = {.loss_window = w, .loss_window_size = 4, .loss_window_n = 7};
    fl_st_file f;
    FL_REQUIRE_OK(fl_st_open(&f, q));
    fl_status s = fl_ckpt_read_state_meta(&f, q, NULL, &got);
    fl_st_close(&f);
    FL_REQUIRE_OK(s);
    FL_CHECK(got.loss_window_n == 0 && w[0] == 0 && w[3] == 0 && got.step == 3);
}

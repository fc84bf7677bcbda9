/* Point-to-point cases of fl_comm (fl_comm_send / fl_comm_recv), shared by tests/test_comm_p2p.c (threads, in the
 * normal suite) and tests/mpi/comm_mpi_test.c (MPI under mpirun), so both implementations pass the same cases:
 *   - a ring where every rank sends before it receives (deadlocks unless sends are buffered, as promised);
 *   - tags: a later message of another tag is received first; one tag's messages arrive in the order sent;
 *   - bits: fp32 NaN payloads, int32 and an empty message arrive unchanged;
 *   - a collective between a send and its receive (the receiver progresses collectives while it waits).
 * Header-only (static functions): include it in one translation unit per program. */
#ifndef FL_TEST_COMM_P2P_REF_H
#define FL_TEST_COMM_P2P_REF_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/comm.h"

/* the pattern rank `from` sends as its k-th message (bits that no conversion keeps: NaN payloads, -0) */
static inline uint32_t cp_word(int from, int k, size_t i) {
    uint32_t z = (uint32_t)(from * 7919 + k * 104729) ^ (uint32_t)(i * 2654435761u);
    return (i % 5 == 0) ? (0x7fc00001u | (z & 0x3ffffu)) : (i % 7 == 0) ? 0x80000000u : z;
}

/* Run every case on c (size >= 2). Returns the number of failed checks; the first failure's text in err. */
static int cp_exercise(fl_comm *c, char *err, size_t errn) {
    const int n = fl_comm_size(c), r = fl_comm_rank(c), next = (r + 1) % n, prev = (r + n - 1) % n;
    int fails = 0;
#define CP_FAIL(...)                                                    \
    do {                                                                \
        if (!fails++) snprintf(err, errn, __VA_ARGS__);                 \
    } while (0)
#define CP_OK(call)                                                     \
    do {                                                                \
        if ((call) != FL_OK) {                                          \
            CP_FAIL("rank %d: %s: %s", r, #call, fl_error_message());   \
            return fails;                                               \
        }                                                               \
    } while (0)
    /* the ring: send first, then receive (count differs per sender: 1000 + sender) */
    uint32_t *out = malloc(2000 * sizeof *out), *in = malloc(2000 * sizeof *in);
    if (!out || !in) {
        free(out), free(in);
        CP_FAIL("rank %d: out of memory", r);
        return fails;
    }
    for (size_t i = 0; i < 1000 + (size_t)r; i++) out[i] = cp_word(r, 0, i);
    CP_OK(fl_comm_send(c, out, 1000 + (size_t)r, FL_F32, next, 1));
    memset(out, 0, 2000 * sizeof *out); /* buffered: the message is the bits at the call */
    CP_OK(fl_comm_recv(c, in, 1000 + (size_t)prev, FL_F32, prev, 1));
    for (size_t i = 0; i < 1000 + (size_t)prev; i++)
        if (in[i] != cp_word(prev, 0, i)) {
            CP_FAIL("rank %d: ring word %zu from rank %d: %08x, want %08x", r, i, prev, in[i], cp_word(prev, 0, i));
            break;
        }
    /* tags and order: rank 0 sends k = 1, 2, 3 with tag 5, then k = 4 with tag 7 and an empty message with tag 9;
     * rank n - 1 receives tag 9, tag 7, then tag 5's in order */
    if (r == 0) {
        for (int k = 1; k <= 4; k++) {
            for (size_t i = 0; i < 64; i++) out[i] = cp_word(0, k, i);
            CP_OK(fl_comm_send(c, out, 64, FL_I32, n - 1, k < 4 ? 5 : 7));
        }
        CP_OK(fl_comm_send(c, NULL, 0, FL_BF16, n - 1, 9));
    } else if (r == n - 1) {
        CP_OK(fl_comm_recv(c, NULL, 0, FL_BF16, 0, 9));
        const int order[4] = {4, 1, 2, 3};
        for (int j = 0; j < 4; j++) {
            CP_OK(fl_comm_recv(c, in, 64, FL_I32, 0, order[j] < 4 ? 5 : 7));
            for (size_t i = 0; i < 64; i++)
                if (in[i] != cp_word(0, order[j], i)) {
                    CP_FAIL("rank %d: message %d (tag %d) word %zu: %08x, want %08x", r, order[j],
                            order[j] < 4 ? 5 : 7, i, in[i], cp_word(0, order[j], i));
                    break;
                }
        }
    }
    /* a collective between a send and its receive: rank 1 receives only after the all-reduce every rank joins */
    float v = (float)r, sum = 0;
    if (r == 0) CP_OK(fl_comm_send(c, &v, 1, FL_F32, 1, 3));
    CP_OK(fl_comm_all_reduce(c, &v, &sum, 1, FL_F32, FL_COMM_SUM));
    if (sum != (float)(n * (n - 1) / 2)) CP_FAIL("rank %d: all-reduce between p2p: %g", r, sum);
    if (r == 1) {
        float got = -1;
        CP_OK(fl_comm_recv(c, &got, 1, FL_F32, 0, 3));
        if (got != 0.0f) CP_FAIL("rank 1: after the all-reduce got %g from rank 0, want 0", got);
    }
    CP_OK(fl_comm_barrier(c));
    free(out);
    free(in);
#undef CP_OK
#undef CP_FAIL
    return fails;
}

#endif

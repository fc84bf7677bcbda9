/* fl_comm point to point (fl_comm_send / fl_comm_recv) on the threads implementation: the shared cases of
 * tests/comm_p2p_ref.h, argument errors, a size mismatch and a sender that never sends. MPI runs the same cases in
 * tests/mpi/comm_mpi_test.c. */
#include <string.h>

#include "comm_p2p_ref.h"
#include "fitllm/comm.h"
#include "test.h"

typedef struct {
    int fails[8];
    char err[8][512];
} p2p_ctx;

static fl_status p2p_rank(fl_comm *c, int rank, void *ud) {
    p2p_ctx *x = ud;
    x->fails[rank] = cp_exercise(c, x->err[rank], sizeof x->err[rank]);
    return FL_OK;
}

FL_TEST(comm_p2p_threads_cases) {
    for (int n = 2; n <= 5; n += 3) {
        p2p_ctx x;
        memset(&x, 0, sizeof x);
        FL_REQUIRE_OK(fl_comm_threads_run(n, p2p_rank, &x));
        for (int r = 0; r < n; r++) FL_CHECKF(x.fails[r] == 0, "%d ranks, rank %d: %d failures: %s", n, r, x.fails[r], x.err[r]);
    }
}

/* the traffic counters see the payload: a send of 10 fp32 is 40 bytes out, its receive 40 in */
static fl_status traffic_rank(fl_comm *c, int rank, void *ud) {
    float v[10] = {0};
    if (rank == 0) FL_TRY(fl_comm_send(c, v, 10, FL_F32, 1, 0));
    else FL_TRY(fl_comm_recv(c, v, 10, FL_F32, 0, 0));
    fl_comm_get_traffic(c, &((fl_comm_traffic *)ud)[rank]);
    return FL_OK;
}

FL_TEST(comm_p2p_traffic) {
    fl_comm_traffic t[2];
    FL_REQUIRE_OK(fl_comm_threads_run(2, traffic_rank, t));
    FL_CHECK(t[0].sent == 40 && t[0].received == 0 && t[0].p2p_sends == 1 && t[0].p2p_recvs == 0);
    FL_CHECK(t[1].sent == 0 && t[1].received == 40 && t[1].p2p_sends == 0 && t[1].p2p_recvs == 1);
}

FL_TEST(comm_p2p_bad_arguments) {
    fl_comm *c[2];
    FL_REQUIRE_OK(fl_comm_threads_create(2, 5, c));
    float v = 0;
    FL_CHECK(fl_comm_send(c[0], &v, 1, FL_F32, 0, 0) == FL_ERR_INVALID); /* itself */
    FL_CHECK(strstr(fl_error_message(), "send(count 1, F32, to rank 0, tag 0)") &&
             strstr(fl_error_message(), "peer 0 is not another rank of the 2"));
    FL_CHECK(fl_comm_recv(c[0], &v, 1, FL_F32, 2, 0) == FL_ERR_INVALID); /* no such rank */
    FL_CHECK(fl_comm_send(c[0], &v, 1, FL_F32, 1, FL_COMM_TAG_LIMIT) == FL_ERR_INVALID);
    FL_CHECK(strstr(fl_error_message(), "tag 256 outside [0, 256)"));
    FL_CHECK(fl_comm_send(c[0], &v, 1, FL_F32, 1, -1) == FL_ERR_INVALID);
    FL_CHECK(fl_comm_recv(c[1], NULL, 1, FL_F32, 0, 0) == FL_ERR_INVALID);
    FL_CHECK(fl_comm_send(NULL, &v, 1, FL_F32, 1, 0) == FL_ERR_INVALID);
    fl_comm_destroy(c[0]);
    fl_comm_destroy(c[1]);
    /* a single rank has no peer */
    fl_comm *s;
    FL_REQUIRE_OK(fl_comm_init_single(&s));
    FL_CHECK(fl_comm_send(s, &v, 1, FL_F32, 1, 0) == FL_ERR_INVALID);
    fl_comm_destroy(s);
}

/* a receive of another size than sent fails naming both sizes, and breaks the group (the sender's next call
 * fails too); a receive whose sender never sends gives up after the group's timeout naming what it waited for */
typedef struct {
    fl_status st[2];
    char msg[2][1024];
} mis_ctx;

static fl_status mismatch_rank(fl_comm *c, int rank, void *ud) {
    mis_ctx *x = ud;
    float v[8] = {0};
    fl_status s = rank == 0 ? fl_comm_send(c, v, 8, FL_F32, 1, 2) : fl_comm_recv(c, v, 4, FL_F32, 0, 2);
    if (s == FL_OK && rank == 0) s = fl_comm_barrier(c);
    x->st[rank] = s;
    snprintf(x->msg[rank], sizeof x->msg[rank], "%s", s == FL_OK ? "" : fl_error_message());
    return FL_OK;
}

FL_TEST(comm_p2p_size_mismatch) {
    mis_ctx x;
    memset(&x, 0, sizeof x);
    FL_REQUIRE_OK(fl_comm_threads_run(2, mismatch_rank, &x));
    FL_CHECKF(x.st[1] == FL_ERR_INVALID && strstr(x.msg[1], "rank 0 sent 32 bytes (tag 2) where rank 1 receives 16"),
              "%d '%s'", x.st[1], x.msg[1]);
    FL_CHECKF(x.st[0] == FL_ERR_IO && strstr(x.msg[0], "rank 0 sent 32 bytes"), "%d '%s'", x.st[0], x.msg[0]);
}

FL_TEST(comm_p2p_never_sent) {
    fl_comm *c[2];
    FL_REQUIRE_OK(fl_comm_threads_create(2, 0.3, c));
    float v = 0;
    FL_CHECK(fl_comm_recv(c[1], &v, 1, FL_F32, 0, 4) == FL_ERR_IO);
    FL_CHECKF(strstr(fl_error_message(), "recv(4 bytes from rank 0, tag 4)"), "'%s'", fl_error_message());
    fl_comm_destroy(c[0]);
    fl_comm_destroy(c[1]);
}

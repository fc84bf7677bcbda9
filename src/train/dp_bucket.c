/* Bounded communication scratch (--bucket_size): the gradient reductions of data parallelism in
 * buckets of at most `bucket` bytes, so the memory a reduction holds does not grow with the model.
 *
 * Reduce-scatter (ZeRO-2's whole gradient buffer; FULL_SHARD's per unit). Rank r must receive the sum
 * of ITS chunk of the buffer (fl_comm_chunk of n over N ranks): off(r), len(r). A reduce-scatter of a
 * contiguous slice would hand each rank a chunk of the slice instead, so a bucket is strided: piece k of
 * every rank's chunk, [off(r) + k P, off(r) + k P + P), packed one after another in rank order into one
 * buffer of N q elements (q = P, the last bucket's longest piece; shorter pieces zero-padded), and one
 * reduce-scatter of N q gives rank r exactly the sum of its own piece k. Held while a bucket runs: the
 * packed buffer and a receive piece ((N + 1) P elements <= bucket bytes, WORKSPACE from the run's
 * pool) and the MPI implementation's receive scratch ((N - 1) q, fl_comm's own from the same pool):
 * under twice the bucket, whatever the model. Traffic is unchanged ((N-1)/N of the buffer per rank),
 * in ceil(len(0) / P) collectives instead of one.
 *
 * All-reduce (DDP and ZeRO-1's per-group buckets, dp.c): a group larger than the bucket is posted as
 * consecutive slices of at most bucket bytes, one in flight at a time (bucket_ready in dp.c).
 *
 * Bits. Every fl_comm implementation (threads, MPI, the NCCL stand-in, the staged and null ones)
 * reduces element i as x_0[i] + x_1[i] + ... + x_{N-1}[i] in rank order (fp32, 16-bit types rounded
 * once), independent of the count and of where the element sits in the message: a bucketed reduction
 * gives every element the bits of the unbucketed one, at every bucket size. Not guaranteed on real NCCL
 * (its ring and tree algorithms, chosen by message size, associate the ranks' terms differently; not
 * run on GPUs here). The all-gathers of ZeRO-1/2 (in place) and FULL_SHARD (into the unit's GATHER
 * buffer) take no scratch, so they are not cut. */
#include <string.h>

#include "dp.h"

/* the bucket's elements per rank: (N + 1) P elements of es bytes fit in `bucket` bytes (at least 1) */
static size_t piece_elems(size_t bucket, int N, size_t es) {
    size_t p = bucket / (((size_t)N + 1) * es);
    return p ? p : 1;
}

int fl_dp_rs_bucketed(size_t n, int N, fl_dtype dt, size_t bucket) {
    return bucket && N > 1 && n * fl_dtype_size(dt) > bucket;
}

fl_status fl_dp_reduce_scatter(fl_comm *comm, const fl_backend *be, fl_mem_pool *pool, const void *src, void *dst,
                               size_t n, fl_dtype dt, size_t bucket) {
    const int N = fl_comm_size(comm), me = fl_comm_rank(comm);
    if (!fl_dp_rs_bucketed(n, N, dt, bucket)) return fl_comm_reduce_scatter(comm, src, dst, n, dt, FL_COMM_SUM);
    const size_t es = fl_dtype_size(dt), P = piece_elems(bucket, N, es);
    size_t off0, len0, offm, lenm;
    fl_comm_chunk(n, N, 0, &off0, &len0); /* rank 0's chunk is the longest */
    fl_comm_chunk(n, N, me, &offm, &lenm);
    char *pack = NULL;
    FL_TRY(fl_mem_alloc(pool, FL_TAG_WORKSPACE, ((size_t)N + 1) * P * es, (void **)&pack));
    char *spare = pack + (size_t)N * P * es; /* this rank's piece when it is shorter than the bucket's q */
    fl_status s = FL_OK;
    for (size_t a = 0; s == FL_OK && a < len0; a += P) {
        const size_t q = len0 - a < P ? len0 - a : P;
        for (int r = 0; s == FL_OK && r < N; r++) {
            size_t off, len;
            fl_comm_chunk(n, N, r, &off, &len);
            size_t l = len > a ? (len - a < q ? len - a : q) : 0;
            char *to = pack + (size_t)r * q * es;
            if (l) s = FL_RUN(be, copy, to, (const char *)src + (off + a) * es, l * es);
            if (l < q) FL_RUN(be, zero, to + l * es, (q - l) * es); /* padding: summed, never read */
        }
        const size_t lm = lenm > a ? (lenm - a < q ? lenm - a : q) : 0;
        char *out = (char *)dst + a * es;
        if (s == FL_OK) s = fl_comm_reduce_scatter(comm, pack, lm == q ? out : spare, (size_t)N * q, dt, FL_COMM_SUM);
        if (s == FL_OK && lm && lm < q) s = FL_RUN(be, copy, out, spare, lm * es);
    }
    fl_mem_free(pool, pack);
    return s;
}

size_t fl_dp_rs_workspace(size_t n, int N, fl_dtype dt, size_t bucket) {
    if (!fl_dp_rs_bucketed(n, N, dt, bucket)) return 0;
    return ((size_t)N + 1) * piece_elems(bucket, N, fl_dtype_size(dt)) * fl_dtype_size(dt);
}

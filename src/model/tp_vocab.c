/* Tensor parallelism's vocabulary split (fitllm/tp.h, docs/ARCHITECTURE.md "Tensor parallelism"): rank r of a
 * group of N holds rows [r V/N, (r + 1) V/N) of the token embeddings and of lm_head (fl_config_vocab_rows; the
 * ranks' counts differ by at most one row when N does not divide V). The embedding looks up the rows it owns (zero elsewhere) and the group sums them: one
 * non-zero term per element, so the sum is exact and every rank holds the single process's bits. The head computes
 * its (rows, V/N) logits chunk; the cross-entropy combines the ranks' row statistics (max, sum of exponentials,
 * the target's logit from its owner: backend.h's vocab_stats / vocab_xent, on the device) so the whole logits never
 * exist on a rank; d(the head's input) is the group's sum of the ranks' parts. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/comm.h"
#include "fitllm/tp.h"
#include "model-impl.h"
#include "store.h"

int fl_tp_vocab_split(const fl_model *m) { return m->cfg.tp_size > 1; }

fl_status fl_model_set_tp_host(fl_model *m, fl_comm *host) {
    const int n = m->cfg.tp_size > 1 ? m->cfg.tp_size : 1;
    if (host && (fl_comm_size(host) != n || (n > 1 && fl_comm_rank(host) != m->cfg.tp_rank)))
        return fl_errorf(FL_ERR_INVALID, "tensor parallel: a host group of %d (rank %d) for a model sliced for %d "
                         "(rank %d)", fl_comm_size(host), fl_comm_rank(host), n, m->cfg.tp_rank);
    m->tp_host = host;
    return FL_OK;
}

/* out (B T, C) = the owned rows of wte[ids] (zero for the others), summed over the group, (+ wpe[pos0 + t]) */
fl_status fl_tp_embed_forward(const fl_model *m, const fl_outer_params *op, float *out, const int32_t *ids, int B,
                              int T, int pos0) {
    const fl_backend *be = m->be;
    const int C = m->cfg.dim, N = B * T, f32 = m->store->dtype == FL_F32;
    int lo;
    const int n = fl_config_vocab_rows(&m->cfg, &lo);
    for (int r = 0; r < N; r++) {
        float *o = out + (size_t)r * C;
        const int id = ids[r] - lo;
        if (id < 0 || id >= n)
            FL_RUN(be, zero, o, (size_t)C * sizeof(float));
        else if (f32)
            FL_TRY(FL_RUN(be, copy, o, op->wte + (size_t)id * C, (size_t)C * sizeof(float)));
        else
            FL_TRY(FL_RUN(be, convert, o, FL_F32, fl_store_param_at(m->store, op->wte_off + (size_t)id * C),
                          m->store->dtype, C));
    }
    if (m->tp_comm && fl_comm_size(m->tp_comm) > 1)
        FL_TRY(fl_error_prefix(fl_comm_all_reduce(m->tp_comm, out, out, (size_t)N * C, FL_F32, FL_COMM_SUM),
                               "tensor parallel: the vocabulary-parallel embedding"));
    if (op->wpe_off == (size_t)-1) return FL_OK;
    float *row = f32 ? NULL : m->store->pstage + fl_pstage_block_start(m) - C; /* one fp32 row */
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            float *o = out + ((size_t)b * T + t) * C;
            const float *p = op->wpe ? op->wpe + (size_t)(pos0 + t) * C : row;
            if (!f32)
                FL_TRY(FL_RUN(be, convert, row, FL_F32,
                              fl_store_param_at(m->store, op->wpe_off + (size_t)(pos0 + t) * C), m->store->dtype, C));
            FL_RUN(be, add, o, o, p, C); /* (e + 0 + ...) + p: the single process's e + p */
        }
    return FL_OK;
}

/* d(the owned rows of wte) += dout's rows, in row order (the single process's order per element); d(wpe) whole */
fl_status fl_tp_embed_backward(fl_model *m, const fl_outer_params *op, const float *dout, const int32_t *dids, int B,
                               int T) {
    const fl_backend *be = m->be;
    const int C = m->cfg.dim, N = B * T;
    int lo;
    const int n = fl_config_vocab_rows(&m->cfg, &lo);
    if (op->dwte) {
        int32_t *ids = malloc((size_t)N * sizeof *ids);
        if (!ids) return fl_errorf(FL_ERR_OOM, "tensor parallel: out of host memory for the embedding's ids");
        fl_status s = FL_RUN(be, to_host, ids, dids, (size_t)N * sizeof *ids);
        for (int r = 0; s == FL_OK && r < N; r++) {
            const int id = ids[r] - lo;
            if (id >= 0 && id < n)
                FL_RUN(be, add, op->dwte + (size_t)id * C, op->dwte + (size_t)id * C, dout + (size_t)r * C, C);
        }
        free(ids);
        FL_TRY(s);
    }
    if (op->dwpe) FL_RUN(be, embedding_backward, NULL, op->dwpe, dout, dids, B, T, C);
    return FL_OK;
}

/* The vocabulary-parallel cross-entropy of `rows` rows: logits (rows, n) this rank's columns, dtargets the rows'
 * whole-vocabulary ids, both device memory. The backend's vocab_stats writes each row's statistics of the rank's
 * slice (its max m, the sum of exp(l - m) in double, the target's logit where it owns it: 3 doubles) into the arena's
 * tp_stats; they are all-gathered as bits over the group on the device (tp_comm: NCCL on a GPU; a host-memory
 * backend's group itself), and vocab_xent combines them in rank order, so every rank computes the same lse = M +
 * log(S) and loss = lse - l[target] (the fp32 kernel's formula) and dlogits (may alias logits) = grad_scale (softmax -
 * onehot) on the rank's columns; nothing goes through the host. Ignored targets: loss 0, no gradient. */
fl_status fl_tp_cross_entropy(fl_model *m, float *loss, float *dlogits, const float *logits, const int32_t *dtargets,
                              int rows, float grad_scale) {
    const fl_backend *be = m->be;
    const int P = m->cfg.tp_size, me = m->cfg.tp_rank;
    int lo;
    const int n = fl_config_vocab_rows(&m->cfg, &lo);
    const fl_acts *a = m->acts;
    if (!be->supports_op(be, FL_OP_VOCAB_XENT, FL_F32, FL_F32, FL_F32))
        return fl_errorf(FL_ERR_UNSUPPORTED, "tensor parallel: backend %s has no vocabulary-parallel cross-entropy "
                         "(vocab_stats / vocab_xent)", be->name);
    if (!a || !a->tp_stats || rows > a->tp_stats_rows)
        return fl_errorf(FL_ERR_INTERNAL, "tensor parallel: the cross-entropy's statistics hold %d rows, not %d",
                         a && a->tp_stats ? a->tp_stats_rows : 0, rows);
    double *mine = a->tp_stats, *all = mine + (size_t)3 * rows;
    FL_TRY(FL_RUN(be, vocab_stats, mine, logits, dtargets, rows, n, lo));
    if (m->tp_host) {
        FL_TRY(fl_error_prefix(fl_comm_all_gather(m->tp_comm ? m->tp_comm : m->tp_host, mine, all, (size_t)P * rows * 6,
                                                  FL_F32),
                               "tensor parallel: the cross-entropy's row statistics"));
    } else { /* no group (a test's rank without the head's sums): the other ranks' terms are missing */
        double *h = malloc((size_t)P * rows * 3 * sizeof *h);
        if (!h) return fl_errorf(FL_ERR_OOM, "tensor parallel: out of host memory for the row statistics");
        for (size_t i = 0; i < (size_t)P * rows; i++) h[3 * i] = -INFINITY, h[3 * i + 1] = h[3 * i + 2] = 0;
        fl_status s = FL_RUN(be, to_device, all, h, (size_t)P * rows * 3 * sizeof *h);
        free(h);
        FL_TRY(s);
        FL_TRY(FL_RUN(be, copy, all + (size_t)me * rows * 3, mine, (size_t)rows * 3 * sizeof *mine));
    }
    return FL_RUN(be, vocab_xent, loss, dlogits, logits, all, dtargets, rows, n, lo, P, me, m->cfg.vocab_size,
                  grad_scale, FL_IGNORE_INDEX);
}

/* d(the head's input) (N, C): the group's sum of the ranks' parts (each rank's head sees its columns only) */
fl_status fl_tp_head_dx_sum(fl_model *m, float *dx, int N) {
    if (!fl_tp_vocab_split(m) || !m->tp_comm || fl_comm_size(m->tp_comm) <= 1) return FL_OK;
    if (m->sp) { /* sequence parallel: the final norm's backward reads the rank's rows only (reduce-scatter) */
        size_t r0;
        fl_sp_part(m, N, &r0);
        return fl_error_prefix(fl_comm_reduce_scatter(m->tp_comm, dx, dx + r0 * m->cfg.dim, (size_t)N * m->cfg.dim,
                                                      FL_F32, FL_COMM_SUM),
                               "sequence parallel: the vocabulary-parallel head's input gradient");
    }
    return fl_error_prefix(fl_comm_all_reduce(m->tp_comm, dx, dx, (size_t)N * m->cfg.dim, FL_F32, FL_COMM_SUM),
                           "tensor parallel: the vocabulary-parallel head's input gradient");
}

fl_status fl_sp_gather(fl_model *m, const float *part, float *whole, int N) {
    if (!m->tp_comm || fl_comm_size(m->tp_comm) != m->cfg.tp_size)
        return fl_errorf(FL_ERR_INVALID, "sequence parallel: the model has no group of %d (fl_model_set_tp)",
                         m->cfg.tp_size);
    return fl_error_prefix(fl_comm_all_gather(m->tp_comm, part, whole, (size_t)N * m->cfg.dim, FL_F32),
                           "sequence parallel: gathering the stream's rows");
}

/* The whole (rows, V) logits on the host of every rank from the ranks' (rows, n) column slices (device memory; it
 * may be out's start on a host-memory backend): each rank's columns in place, zeros elsewhere, summed over the
 * group (one non-zero term per element: exact). */
fl_status fl_tp_logits_out(fl_model *m, float *out, const float *part, int rows) {
    const fl_backend *be = m->be;
    const int V = m->cfg.vocab_size;
    int lo;
    const int n = fl_config_vocab_rows(&m->cfg, &lo);
    float *h = malloc((size_t)rows * n * sizeof *h);
    if (!h) return fl_errorf(FL_ERR_OOM, "tensor parallel: out of host memory for the logits");
    fl_status s = FL_RUN(be, to_host, h, part, (size_t)rows * n * sizeof *h);
    if (s == FL_OK) {
        memset(out, 0, (size_t)rows * V * sizeof *out);
        for (int i = 0; i < rows; i++) memcpy(out + (size_t)i * V + lo, h + (size_t)i * n, (size_t)n * sizeof *h);
        if (m->tp_host)
            s = fl_error_prefix(fl_comm_all_reduce(m->tp_host, out, out, (size_t)rows * V, FL_F32, FL_COMM_SUM),
                                "tensor parallel: gathering the logits");
    }
    free(h);
    return s;
}

/* The blocks' collectives over the group c (fl_model_tp_ops.sum / move). */
static fl_status tp_sum(struct fl_comm *c, float *p, size_t n) {
    if (!c || fl_comm_size(c) <= 1) return FL_OK;
    return fl_comm_all_reduce(c, p, p, n, FL_F32, FL_COMM_SUM);
}

static fl_status tp_move(struct fl_comm *c, int gather, float *whole, float *part, size_t n_whole) {
    if (!c || fl_comm_size(c) <= 1) return fl_errorf(FL_ERR_INVALID, "sequence parallel: the block needs its group");
    if (gather) return fl_comm_all_gather(c, part, whole, n_whole, FL_F32);
    return fl_comm_reduce_scatter(c, whole, part, n_whole, FL_F32, FL_COMM_SUM);
}

/* Tensor parallelism's passes (model-impl.h), installed by fl_model_init_ex in a rank's slice. */
const fl_model_tp_ops fl_tp_model_ops = {.embed_forward = fl_tp_embed_forward,
                                         .embed_backward = fl_tp_embed_backward,
                                         .cross_entropy = fl_tp_cross_entropy,
                                         .logits_out = fl_tp_logits_out,
                                         .head_dx_sum = fl_tp_head_dx_sum,
                                         .sum = tp_sum,
                                         .move = tp_move,
                                         .norm_sum = fl_sp_norm_end,
                                         .sp_gather = fl_sp_gather};

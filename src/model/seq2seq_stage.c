/* A pipeline stage of an encoder-decoder (fitllm/pp.h; issue 35 item 2, EXPERIMENTAL): the streams between stages and
 * the stash of a micro-batch in flight.
 *
 * The stages split [encoder blocks; decoder blocks] (fl_pp_stage_config). What crosses the boundary before block b
 * of that sequence (Le encoder blocks):
 *   b < Le:  the encoder's residual stream (B Ts, C) forward, its gradient backward;
 *   b == Le: the encoder output (its final norm's, dropped out) forward, d(encoder output) backward: the sum over
 *            every decoder block's cross-attention, which the stage holding the encoder's last block reads;
 *   b > Le:  the encoder output and the decoder's residual stream (B Tt, C) forward, and backward the partial sum of
 *            d(encoder output) over the later decoder blocks (each stage adds its blocks' and passes it on: the one
 *            process's order of accumulation) and d(decoder stream).
 * Each stage computes its stacks' relative biases from its copy of the tables (seq2seq.c), so no bias crosses.
 * The message is [encoder part (B Ts C)][decoder part (B Tt C), b > Le only]. */
#include <stdlib.h>
#include <string.h>

#include "fitllm/pp.h"
#include "seq2seq-impl.h"

/* the boundary before the stage's blocks (in) or after them (out), in [encoder; decoder] blocks */
static int boundary(const fl_model *m, int out) {
    return m->cfg.pp_first + (out ? m->cfg.n_layers + m->cfg.n_dec_layers : 0);
}

/* Sequence parallelism (a->sp > 1; TP x PP): the pass runs B padded as seq2seq.c's sp_pad pads it (rows the group
 * divides), and the residual streams cross as the rank's rows (B T / sp), the encoder output whole (its final norm's
 * output, gathered), d(encoder output) as the rank's partial sum over its heads (reduce-scattered once, where the
 * encoder's norm runs) */
static int sp_of(const fl_model *m) { return m->acts && m->acts->s2s && m->acts->s2s->sp > 1 ? m->acts->s2s->sp : 1; }
static int pass_B(const fl_model *m, int B, int Ts, int Tt) {
    const int n = sp_of(m);
    while (n > 1 && ((B * Ts) % n || (B * Tt) % n)) B++;
    return B;
}
/* the message's encoder part's and decoder part's elements (a pass of B sequences) at the stage's in or out side */
static void part_elems(const fl_model *m, int out, int B, int Ts, int Tt, size_t *ne, size_t *nd) {
    const size_t C = (size_t)m->cfg.dim, n = (size_t)sp_of(m), Bp = (size_t)pass_B(m, B, Ts, Tt);
    const int b = boundary(m, out), Le = m->cfg.pp_enc;
    *ne = Bp * Ts * C / (b < Le ? n : 1);
    *nd = b > Le ? Bp * Tt * C / n : 0;
}

size_t fl_model_stage_elems_s2s(const fl_model *m, int B, int Ts, int Tt, int out) {
    size_t ne, nd;
    part_elems(m, out, B, Ts, Tt, &ne, &nd);
    return ne + nd;
}

size_t fl_model_stage_max_elems(const fl_model *m) {
    if (!m->acts || !m->acts->s2s) return (size_t)m->B * m->T * m->cfg.dim;
    const struct fl_s2s_acts *a = m->acts->s2s;
    return (size_t)a->B * (a->st[0].Tmax + a->st[1].Tmax) * m->cfg.dim;
}

/* the device buffers of the boundary's message: the encoder part's, the decoder part's (NULL: none). Forward (grad 0):
 * the encoder's stream at block b (res[b - first] of the stage's), or its output; the decoder's stream. Backward: d of
 * the same: dres (gb[0]) for a stream, dstream for the encoder output. */
static void parts(const fl_model *m, int out, int grad, float **enc, float **dec) {
    struct fl_s2s_acts *a = m->acts->s2s;
    const int b = boundary(m, out), Le = m->cfg.pp_enc;
    *dec = NULL;
    if (b < Le) {
        *enc = grad ? a->gb[0] : a->st[0].res[out ? a->st[0].L : 0];
        return;
    }
    *enc = grad ? a->dstream : a->st[0].nout;
    if (b > Le) *dec = grad ? a->gb[0] : a->st[1].res[out ? a->st[1].L : 0];
}

/* x (host) -> the message's device buffers, or back */
static fl_status move(const fl_model *m, int out, int grad, float *x, int to_dev, int B, int Ts, int Tt) {
    float *enc, *dec;
    parts(m, out, grad, &enc, &dec);
    size_t ne, nd;
    part_elems(m, out, B, Ts, Tt, &ne, &nd);
    if (to_dev) FL_TRY(FL_RUN(m->be, to_device, enc, x, ne * sizeof(float)));
    else FL_TRY(FL_RUN(m->be, to_host, x, enc, ne * sizeof(float)));
    if (!dec) return FL_OK;
    return to_dev ? FL_RUN(m->be, to_device, dec, x + ne, nd * sizeof(float)) : FL_RUN(m->be, to_host, x + ne, dec, nd * sizeof(float));
}

static fl_status check_stage(const fl_model *m, int need_in, int need_out, const char *fn) {
    if (!m->acts || !m->acts->s2s || m->cfg.pp_enc <= 0 || (need_in && !m->stage.in) || (need_out && !m->stage.out))
        return fl_errorf(FL_ERR_INVALID, "%s: not a%s stage of an encoder-decoder", fn,
                         need_in ? " later" : need_out ? "n earlier" : "");
    return FL_OK;
}

fl_status fl_model_stage_input_s2s(fl_model *m, const float *x, int B, int Ts, int Tt) {
    FL_TRY(check_stage(m, 1, 0, "fl_model_stage_input_s2s"));
    const struct fl_s2s_acts *a = m->acts->s2s;
    if (B > a->B || Ts > a->st[0].Tmax || Tt > a->st[1].Tmax)
        return fl_errorf(FL_ERR_INVALID, "fl_model_stage_input_s2s: (%d, %d, %d) exceeds the arena's (%d, %d, %d)", B, Ts,
                         Tt, a->B, a->st[0].Tmax, a->st[1].Tmax);
    return move(m, 0, 0, (float *)x, 1, B, Ts, Tt);
}

/* after a forward / before and after a backward: the pass's shapes (the last forward's, or the restored one's) */
fl_status fl_s2s_stage_output(const fl_model *m, float *y) {
    FL_TRY(check_stage(m, 0, 1, "fl_model_stage_output"));
    const struct fl_s2s_acts *a = m->acts->s2s;
    return move(m, 1, 0, y, 0, a->Bp, a->T[0], a->T[1]);
}
fl_status fl_s2s_stage_dout(fl_model *m, const float *dy) {
    FL_TRY(check_stage(m, 0, 1, "fl_model_stage_dout"));
    const struct fl_s2s_acts *a = m->acts->s2s;
    return move(m, 1, 1, (float *)dy, 1, a->Bp, a->T[0], a->T[1]);
}
fl_status fl_s2s_stage_dinput(const fl_model *m, float *dx) {
    FL_TRY(check_stage(m, 1, 0, "fl_model_stage_dinput"));
    const struct fl_s2s_acts *a = m->acts->s2s;
    return move(m, 0, 1, dx, 0, a->Bp, a->T[0], a->T[1]);
}

/* ---- the stash of a micro-batch in flight: the ACTS arena and what the backward reads outside it ---- */

enum { MAX_REGIONS = 12 };
struct fl_s2s_stash {
    void *copy[MAX_REGIONS];
    int n;
    int Bp, T[FL_MODEL_GRAPH_MAX_STACKS], kmask_on, fwd_B, fwd_T, fwd_train;
    float drop_p;
};

/* the regions (at most MAX_REGIONS): the ACTS arena; each stack's ids, relative bias and buckets (the bias and its buckets depend on the
 * pass's lengths), the key padding mask, and on the last stage d(the decoder's norm output) the head left in gb[1] */
static int regions(const fl_model *m, void **at, size_t *bytes) {
    const struct fl_s2s_acts *a = m->acts->s2s;
    const size_t B = (size_t)a->B, NH = (size_t)m->cfg.n_heads;
    int n = 0;
    at[n] = m->acts_arena, bytes[n++] = m->sizes.acts_bytes;
    for (int k = 0; k < a->n_stacks; k++) {
        const size_t T = (size_t)a->st[k].Tmax;
        at[n] = a->st[k].ids, bytes[n++] = B * T * sizeof(int32_t);
        at[n] = a->st[k].bias, bytes[n++] = NH * T * T * sizeof(float);
        at[n] = a->st[k].buckets, bytes[n++] = (2 * T - 1) * sizeof(int32_t);
    }
    at[n] = a->kmask, bytes[n++] = B * (size_t)a->st[0].Tmax;
    if (!m->stage.out) at[n] = a->gb[1], bytes[n++] = B * (size_t)a->st[a->n_stacks - 1].Tmax * m->cfg.dim * sizeof(float);
    void *ad = NULL; /* LoRA: the adapters' saved activations (their h, dropped inputs), outside the arena */
    const size_t adb = m->adapt && m->adapt->h.acts_region ? m->adapt->h.acts_region(m, &ad) : 0;
    if (adb) at[n] = ad, bytes[n++] = adb;
    return n;
}

size_t fl_s2s_stash_bytes(const fl_model *m) {
    void *at[MAX_REGIONS];
    size_t bytes[MAX_REGIONS], t = 0;
    const int n = regions(m, at, bytes);
    for (int i = 0; i < n; i++) t += bytes[i];
    return t;
}

void fl_s2s_stash_free(fl_model *m, fl_s2s_stash *s) {
    if (!s) return;
    for (int i = 0; i < s->n; i++) fl_mem_free(m->pool, s->copy[i]);
    free(s);
}

fl_status fl_s2s_stash_new(fl_model *m, fl_s2s_stash **out) {
    *out = NULL;
    fl_s2s_stash *s = calloc(1, sizeof *s);
    if (!s) return fl_errorf(FL_ERR_OOM, "pipeline stash: out of host memory");
    void *at[MAX_REGIONS];
    size_t bytes[MAX_REGIONS];
    const int n = regions(m, at, bytes);
    fl_status st = FL_OK;
    for (int i = 0; i < n && st == FL_OK; i++) {
        st = fl_mem_alloc(m->pool, FL_TAG_ACTS, bytes[i], &s->copy[i]);
        if (st == FL_OK) s->n = i + 1;
    }
    if (st != FL_OK) {
        fl_s2s_stash_free(m, s);
        return fl_error_prefix(st, "pipeline stash (a micro-batch in flight)");
    }
    *out = s;
    return FL_OK;
}

static void meta_save(const fl_model *m, fl_s2s_stash *s) {
    const struct fl_s2s_acts *a = m->acts->s2s;
    s->Bp = a->Bp, s->kmask_on = a->kmask_on, s->drop_p = a->drop_p;
    memcpy(s->T, a->T, sizeof s->T);
    s->fwd_B = m->fwd_B, s->fwd_T = m->fwd_T, s->fwd_train = m->fwd_train;
}
static void meta_load(fl_model *m, const fl_s2s_stash *s) {
    struct fl_s2s_acts *a = m->acts->s2s;
    a->Bp = s->Bp, a->kmask_on = s->kmask_on, a->drop_p = s->drop_p;
    memcpy(a->T, s->T, sizeof a->T);
    m->fwd_B = s->fwd_B, m->fwd_T = s->fwd_T, m->fwd_train = s->fwd_train;
}

fl_status fl_s2s_stash_save(fl_model *m, fl_s2s_stash *s) {
    void *at[MAX_REGIONS];
    size_t bytes[MAX_REGIONS];
    const int n = regions(m, at, bytes);
    if (n != s->n) return fl_errorf(FL_ERR_INTERNAL, "pipeline stash: the arena changed");
    for (int i = 0; i < n; i++) FL_TRY(FL_RUN(m->be, copy, s->copy[i], at[i], bytes[i]));
    meta_save(m, s);
    return FL_OK;
}

fl_status fl_s2s_stash_restore(fl_model *m, const fl_s2s_stash *s) {
    void *at[MAX_REGIONS];
    size_t bytes[MAX_REGIONS];
    const int n = regions(m, at, bytes);
    if (n != s->n) return fl_errorf(FL_ERR_INTERNAL, "pipeline stash: the arena changed");
    for (int i = 0; i < n; i++) FL_TRY(FL_RUN(m->be, copy, at[i], s->copy[i], bytes[i]));
    meta_load(m, s);
    return FL_OK;
}

fl_status fl_s2s_stash_swap(fl_model *m, fl_s2s_stash *s, void *scratch, size_t sb) {
    void *at[MAX_REGIONS];
    size_t bytes[MAX_REGIONS];
    const int n = regions(m, at, bytes);
    if (n != s->n) return fl_errorf(FL_ERR_INTERNAL, "pipeline stash: the arena changed");
    for (int i = 0; i < n; i++)
        for (size_t o = 0; o < bytes[i]; o += sb) {
            const size_t k = bytes[i] - o < sb ? bytes[i] - o : sb;
            char *x = (char *)at[i] + o, *y = (char *)s->copy[i] + o;
            FL_TRY(FL_RUN(m->be, copy, scratch, x, k));
            FL_TRY(FL_RUN(m->be, copy, x, y, k));
            FL_TRY(FL_RUN(m->be, copy, y, scratch, k));
        }
    fl_s2s_stash t;
    meta_save(m, &t);
    meta_load(m, s);
    s->Bp = t.Bp, s->kmask_on = t.kmask_on, s->drop_p = t.drop_p, s->fwd_B = t.fwd_B, s->fwd_T = t.fwd_T;
    s->fwd_train = t.fwd_train;
    memcpy(s->T, t.T, sizeof s->T);
    return FL_OK;
}

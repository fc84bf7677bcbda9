/* Micro-batch loader: (B, T) ids/targets from a dataset split, with the
 * next-token shift (ids = s[0..n-2], targets = labels[1..n-1]), samples cut to
 * T_max+1 tokens, right padding to the longest sample of the batch (pad id 0,
 * target ignore_index). Train order: a Fisher-Yates permutation per epoch
 * seeded by splitmix64(seed, epoch) (not torch's RandomSampler stream); val:
 * in order. The state (seed, epoch, pos) fully determines what comes next. */
#include <stdlib.h>
#include <string.h>

#include "data-impl.h"

struct fl_loader {
    const fl_dataset *d;
    fl_split split;
    int B, T_max, shuffle, ignore_index;
    uint64_t seed;
    int64_t epoch, pos;
    size_t n;
    size_t *perm;
    int64_t perm_epoch; /* epoch perm was built for, -1 = none */
    int32_t *ids, *targets;
};

fl_status fl_loader_init(fl_loader **out, const fl_dataset *d, fl_split split, int B, int T_max, uint64_t seed,
                         int shuffle) {
    *out = NULL;
    if (!d) return fl_errorf(FL_ERR_INVALID, "loader: no dataset");
    if (split < 0 || split >= FL_SPLIT_COUNT) return fl_errorf(FL_ERR_INVALID, "loader: bad split %d", (int)split);
    const char *sn = split == FL_SPLIT_TRAIN ? "train" : "val";
    if (B < 1 || T_max < 1) return fl_errorf(FL_ERR_INVALID, "loader: micro-batch size %d and T_max %d must be >= 1", B, T_max);
    size_t n = fl_data_count(d, split);
    if (n == 0) return fl_errorf(FL_ERR_INVALID, "loader: the %s split has no samples", sn);
    fl_loader *l = calloc(1, sizeof *l);
    if (!l) return fl_errorf(FL_ERR_OOM, "loader: out of memory");
    l->d = d;
    l->split = split;
    l->B = B;
    l->T_max = T_max;
    l->shuffle = shuffle;
    l->ignore_index = d->ignore_index;
    l->seed = seed;
    l->n = n;
    l->perm_epoch = -1;
    l->perm = malloc(n * sizeof *l->perm);
    l->ids = malloc((size_t)B * (size_t)T_max * sizeof *l->ids);
    l->targets = malloc((size_t)B * (size_t)T_max * sizeof *l->targets);
    if (!l->perm || !l->ids || !l->targets) {
        fl_loader_free(l);
        return fl_errorf(FL_ERR_OOM, "loader: out of memory (B %d, T_max %d, %zu samples)", B, T_max, n);
    }
    *out = l;
    return FL_OK;
}

void fl_loader_free(fl_loader *l) {
    if (!l) return;
    free(l->perm);
    free(l->ids);
    free(l->targets);
    free(l);
}

void fl_data_epoch_perm(uint64_t seed, int64_t epoch, int shuffle, size_t n, size_t *perm) {
    for (size_t i = 0; i < n; i++) perm[i] = i;
    if (shuffle) {
        uint64_t st = seed ^ 0x6c6f616465720000ULL;
        uint64_t e = (uint64_t)epoch;
        st = fl_data_splitmix64(&st) ^ (e * 0xd1b54a32d192ed03ULL);
        for (size_t i = n; i > 1; i--) {
            size_t j = (size_t)fl_data_rand_below(&st, i);
            size_t t = perm[i - 1];
            perm[i - 1] = perm[j];
            perm[j] = t;
        }
    }
}

static void build_perm(fl_loader *l) {
    fl_data_epoch_perm(l->seed, l->epoch, l->shuffle, l->n, l->perm);
    l->perm_epoch = l->epoch;
}

fl_status fl_loader_next(fl_loader *l, fl_batch *b, int *new_epoch) {
    if (l->pos >= (int64_t)l->n) {
        l->epoch++;
        l->pos = 0;
    }
    if (new_epoch) *new_epoch = l->pos == 0;
    if (l->perm_epoch != l->epoch) build_perm(l);
    int Bc = (int)((int64_t)l->n - l->pos < l->B ? (int64_t)l->n - l->pos : l->B);
    int Tcap = l->T_max + 1;
    int T = 1, trunc = 0;
    for (int i = 0; i < Bc; i++) {
        const fl_sample *s = fl_data_get(l->d, l->split, l->perm[l->pos + i]);
        int len = s->len < Tcap ? s->len : Tcap;
        if (s->len > Tcap) trunc++;
        if (len - 1 > T) T = len - 1;
    }
    memset(b, 0, sizeof *b);
    b->B = Bc;
    b->T = T;
    b->ids = l->ids;
    b->targets = l->targets;
    b->truncated = trunc;
    for (int i = 0; i < Bc; i++) {
        const fl_sample *s = fl_data_get(l->d, l->split, l->perm[l->pos + i]);
        int len = s->len < Tcap ? s->len : Tcap;
        int npos = len > 0 ? len - 1 : 0;
        int32_t *ir = l->ids + (size_t)i * T, *tr = l->targets + (size_t)i * T;
        for (int t = 0; t < T; t++) {
            if (t < npos) {
                ir[t] = s->ids[t];
                tr[t] = s->labels[t + 1];
                if (tr[t] != l->ignore_index) b->target_tokens++;
            } else {
                ir[t] = 0;
                tr[t] = l->ignore_index;
            }
        }
        b->real_tokens += npos;
        b->prompt_tokens += s->prompt_len < npos ? s->prompt_len : npos;
    }
    b->padded_tokens = (long)Bc * T;
    l->pos += Bc;
    return FL_OK;
}

void fl_loader_get_state(const fl_loader *l, fl_loader_state *s) {
    s->seed = l->seed;
    s->epoch = l->epoch;
    s->pos = l->pos;
}

fl_status fl_loader_set_state(fl_loader *l, const fl_loader_state *s) {
    if (s->epoch < 0 || s->pos < 0 || s->pos > (int64_t)l->n)
        return fl_errorf(FL_ERR_INVALID, "loader state: epoch %lld, position %lld is out of range (%zu samples)",
                         (long long)s->epoch, (long long)s->pos, l->n);
    l->seed = s->seed;
    l->epoch = s->epoch;
    l->pos = s->pos;
    l->perm_epoch = -1;
    return FL_OK;
}

size_t fl_loader_batches_per_epoch(const fl_loader *l) { return (l->n + (size_t)l->B - 1) / (size_t)l->B; }

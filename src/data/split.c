/* torch.utils.data.random_split, bit for bit:
 *   lengths: floor(n * frac) per fraction, the remainder added round-robin
 *            starting at the first split;
 *   indices: torch.randperm(n, generator=torch.Generator().manual_seed(seed)),
 *            which on the CPU (n < 2^32/20) is a forward Fisher-Yates over
 *            0..n-1 with z = mt19937() % (n - i), mt19937 seeded as
 *            std::mt19937(seed & 0xffffffff);
 *   train = indices[0:n_train], val = indices[n_train:]. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/text.h"
#include "data-impl.h"

typedef struct {
    uint32_t s[624];
    int i;
} mt19937;

static void mt_seed(mt19937 *m, uint32_t seed) {
    m->s[0] = seed;
    for (int j = 1; j < 624; j++) m->s[j] = 1812433253u * (m->s[j - 1] ^ (m->s[j - 1] >> 30)) + (uint32_t)j;
    m->i = 624;
}

static uint32_t mt_next(mt19937 *m) {
    if (m->i >= 624) {
        for (int k = 0; k < 624; k++) {
            uint32_t y = (m->s[k] & 0x80000000u) | (m->s[(k + 1) % 624] & 0x7fffffffu);
            m->s[k] = m->s[(k + 397) % 624] ^ (y >> 1) ^ ((y & 1u) ? 0x9908b0dfu : 0u);
        }
        m->i = 0;
    }
    uint32_t y = m->s[m->i++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
}

fl_status fl_data_torch_randperm(uint64_t seed, size_t n, size_t **perm) {
    *perm = malloc((n ? n : 1) * sizeof **perm);
    if (!*perm) return fl_errorf(FL_ERR_OOM, "randperm: out of memory (%zu)", n);
    if ((uint64_t)n >= 0xffffffffULL / 20)
        return free(*perm), *perm = NULL,
               fl_errorf(FL_ERR_UNSUPPORTED, "randperm: %zu items is beyond torch's small-n algorithm", n);
    size_t *p = *perm;
    for (size_t i = 0; i < n; i++) p[i] = i;
    mt19937 m;
    mt_seed(&m, (uint32_t)(seed & 0xffffffffu));
    for (size_t i = 0; i + 1 < n; i++) {
        size_t z = (size_t)(mt_next(&m) % (uint32_t)(n - i));
        size_t t = p[i];
        p[i] = p[z + i];
        p[z + i] = t;
    }
    return FL_OK;
}

double fl_data_float_to_double(float f) {
    char buf[64];
    fl_text_float(f, buf, sizeof buf);
    return strtod(buf, NULL);
}

void fl_data_split_lengths(size_t n, float val_fraction, size_t *n_train, size_t *n_val) {
    double f = fl_data_float_to_double(val_fraction);
    double fr[2] = {1.0 - f, f};
    size_t len[2];
    size_t sum = 0;
    for (int i = 0; i < 2; i++) {
        len[i] = (size_t)floor((double)n * fr[i]);
        sum += len[i];
    }
    for (size_t i = 0; sum + i < n; i++) len[i % 2]++;
    *n_train = len[0];
    *n_val = len[1];
}

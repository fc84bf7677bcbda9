/* The golden fixtures' reference tensors (tests/ref/make_golden.py): shared by test_model.c's golden tests and
 * tests/tp_ref.h (the tensor-parallel scenarios, also built into the MPI test program). */
#ifndef FL_GOLDEN_REF_H
#define FL_GOLDEN_REF_H

#include <stdio.h>
#include <string.h>

#include "fitllm/io.h"

/* The reference tensor prefix + name ("grad.", "after5." ...), GPT-2's names also without "transformer.". */
static inline const fl_st_tensor *fl_golden_find(const fl_st_file *g, const char *prefix, const char *name) {
    char key[256];
    snprintf(key, sizeof key, "%s%s", prefix, name);
    const fl_st_tensor *t = fl_st_find(g, key);
    if (!t && !strncmp(name, "transformer.", 12)) {
        snprintf(key, sizeof key, "%s%s", prefix, name + 12);
        t = fl_st_find(g, key);
    }
    return t;
}

#endif

/* The lab rows' data (fl_lab_run): the course's own file (--data, --tokenizer), the real scale's drawn sample lengths
 * (--lengths), or a generated folder of random-letter text in blocks of T + 1 tokens (the default at both scales). */
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/fs.h"
#include "fitllm/lengths.h"
#include "fitllm/model.h"
#include "fitllm/tokenizer.h"
#include "lab-impl.h"

/* The rows' default data (both scales): a TextFiles folder (the first file, in name order, is the validation split)
 * of deterministic lowercase byte text, long enough for every row (the largest global batch x steps
 * samples of T + 1 tokens, plus the trainer's margin), so each sample is exactly T + 1 tokens. */
fl_status fl_lab_write_text_dir(const char *dir, int T, long steps, int max_global) {
    FL_TRY(fl_fs_mkdir_p(dir));
    static const char *names[2] = {"0-val.txt", "1-train.txt"};
    const size_t per = (size_t)T + 1, want[2] = {8 * per, ((size_t)max_global * (size_t)steps + 16) * per};
    uint64_t st = 0x243f6a8885a308d3ULL;
    char path[4300], line[128];
    for (int f = 0; f < 2; f++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[f]);
        FILE *fp = fopen(path, "w");
        if (!fp) return fl_errorf(FL_ERR_IO, "%s: cannot write: %s", path, strerror(errno));
        for (size_t done = 0; done < want[f];) {
            int n = 0;
            while (n < 79) {
                st = st * 6364136223846793005ULL + 1442695040888963407ULL;
                int k = (int)((st >> 33) % 27);
                line[n++] = k == 26 ? ' ' : (char)('a' + k);
            }
            line[n++] = '\n';
            if (fwrite(line, 1, (size_t)n, fp) != (size_t)n) {
                fclose(fp);
                return fl_errorf(FL_ERR_IO, "%s: write failed", path);
            }
            done += (size_t)n;
        }
        if (fclose(fp) != 0) return fl_errorf(FL_ERR_IO, "%s: write failed", path);
    }
    return FL_OK;
}

/* The real scale's sample lengths (quick, full suites): --lengths, else the bundled Alpaca table found from the
 * working directory or next to the executable (build/fitllm -> recipes/ beside build/), else fixed lengths, said. */
fl_status fl_lab_real_lengths(const fl_lab_opts *o, fl_lab_report *rep) {
    static const char *rel = "recipes/data/alpaca-lengths.tsv";
    char path[4096] = "", exe[2048];
    if (o->lengths && !strcmp(o->lengths, "fixed")) return FL_OK;
    if (o->lengths && *o->lengths) snprintf(path, sizeof path, "%s", o->lengths);
    else if (access(rel, R_OK) == 0) snprintf(path, sizeof path, "%s", rel);
    else {
        ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
        char *slash = n > 0 ? (exe[n] = '\0', strrchr(exe, '/')) : NULL;
        if (slash) {
            *slash = '\0';
            snprintf(path, sizeof path, "%s/../%s", exe, rel);
            if (access(path, R_OK) != 0) path[0] = '\0';
        }
    }
    if (!path[0]) return FL_OK; /* the banner says: fixed lengths */
    FL_TRY(fl_error_prefix(fl_lengths_load(path, &rep->table), "lab --lengths"));
    snprintf(rep->lengths, sizeof rep->lengths, "%s", path);
    rep->max_seq_length = COURSE_MAX_SEQ_LENGTH;
    return FL_OK;
}

/* The course's own data: --data, else at the real scale the recipes' data/alpaca2k/alpaca2k.json when the working
 * directory has it; its tokenizer (--tokenizer; else the built-in bytes). */
fl_status fl_lab_course_data(const fl_lab_opts *o, fl_lab_report *rep) {
    static const char *recipe = "data/alpaca2k/alpaca2k.json";
    const char *d = o->data && *o->data ? o->data : rep->real_scale && access(recipe, R_OK) == 0 ? recipe : NULL;
    const char *tok = o->tokenizer && *o->tokenizer ? o->tokenizer : "";
    if (!d && tok[0])
        return fl_errorf(FL_ERR_INVALID, "lab --tokenizer %s: only with --data (the course's data it tokenizes)", tok);
    if (!d) return FL_OK;
    if (!fl_fs_is_file(d))
        return fl_errorf(FL_ERR_NOT_FOUND, "lab --data %s: no such file (an Alpaca-style JSON or JSONL file, e.g. the "
                         "recipes' data/alpaca2k/alpaca2k.json)", d);
    if (tok[0] && !fl_fs_is_dir(tok))
        return fl_errorf(FL_ERR_NOT_FOUND, "lab --tokenizer %s: no such folder (a tokenizer folder: tokenizer.json or "
                         "tokenizer.model)", tok);
    if (tok[0] && !rep->real_scale) { /* the lab-* presets' vocabulary is the real one's / 16: a real tokenizer's ids
                                       * fall outside it in every row; said once, before any row */
        fl_model_config mc;
        fl_tokenizer *t = NULL;
        FL_TRY(fl_preset_find(LAB_MODEL, &mc));
        FL_TRY(fl_error_prefix(fl_tok_load(&t, tok), "lab --tokenizer %s", tok));
        const int tv = fl_tok_vocab_size(t);
        fl_tok_free(t);
        if (tv > mc.vocab_size)
            return fl_errorf(FL_ERR_INVALID, "lab --tokenizer %s: its %d ids do not fit the lab scale's models (%s ... "
                             "have %d: every width, the vocabulary too, is the real model's / 16); give --scale real "
                             "with it, or leave --tokenizer out (the built-in bytes)", tok, tv, LAB_MODEL, mc.vocab_size);
    }
    snprintf(rep->data, sizeof rep->data, "%s", d);
    snprintf(rep->tokenizer, sizeof rep->tokenizer, "%s", tok);
    return FL_OK;
}


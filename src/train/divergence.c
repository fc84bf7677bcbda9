/* Finite divergence: a loss that stays above a uniform guess's after the warm-up stops the run
 * (see include/fitllm/trainer.h, "finite divergence", for the rule, the margin and the window). */
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/checkpoint.h"
#include "fitllm/trainer.h"

void fl_trainer_diverge_init(fl_trainer_diverge *d, int vocab_size, long warmup) {
    memset(d, 0, sizeof *d);
    d->ln_v = log(vocab_size > 1 ? (double)vocab_size : 2.0);
    d->limit = d->ln_v + FL_DIVERGE_MARGIN;
    d->warmup = warmup > 0 ? warmup : 0;
    d->ema = NAN;
    d->value = NAN;
    d->last_good = -1; /* none known yet (a resumed run's weights are vouched for by its first loss) */
}

/* The loss of step `step` is computed with the weights of step - 1 (before its update): a loss within
 * the limit vouches for those weights, the checkpoint step-(step-1). */
int fl_trainer_diverge_train(fl_trainer_diverge *d, long step, double loss) {
    if (isnan(loss)) return 0; /* a fully masked step: no loss */
    /* inf stays inf in the EMA (the NaN/inf path of the trainer stops such a run first) */
    d->ema = isnan(d->ema) ? loss : d->ema + FL_DIVERGE_ALPHA * (loss - d->ema);
    if (loss <= d->limit && d->ema <= d->limit && step - 1 > d->last_good) d->last_good = step - 1;
    if (!(d->ema > d->limit) || step < d->warmup) { /* within, or above in the warm-up: does not count */
        d->above = 0;
        return 0;
    }
    if (d->above++ == 0) d->since = step;
    if (d->above < FL_DIVERGE_WINDOW) return 0;
    d->value = d->ema;
    d->by_val = 0;
    return 1;
}

/* a validation after `step` steps evaluates the weights of step-`step` itself */
int fl_trainer_diverge_val(fl_trainer_diverge *d, long step, double val_loss) {
    if (isnan(val_loss)) return 0;
    if (val_loss <= d->limit) {
        if (step > d->last_good) d->last_good = step;
        return 0;
    }
    if (d->last_good >= step) d->last_good = step - 1; /* these weights are the bad ones */
    if (step < d->warmup || step < 1) return 0;
    d->value = val_loss;
    d->by_val = 1;
    d->since = step;
    return 1;
}

int fl_trainer_diverge_suspect(const fl_trainer_diverge *d) { return d->ema > d->limit; }

double fl_trainer_perplexity(double loss) {
    if (isnan(loss)) return NAN;
    return loss > FL_PPL_MAX_LOSS ? INFINITY : exp(loss);
}

int fl_trainer_ckpt_at_or_before(const char *out_dir, long max_step, char *path, size_t n) {
    DIR *dir = opendir(out_dir);
    if (!dir) return 0;
    long best = -1;
    char name[64] = "";
    for (struct dirent *e; (e = readdir(dir));) {
        long k;
        char tail;
        if (sscanf(e->d_name, "step-%ld%c", &k, &tail) != 1 || k > max_step || k <= best) continue;
        char p[4200];
        snprintf(p, sizeof p, "%s/%s", out_dir, e->d_name);
        if (!fl_ckpt_is_committed(p)) continue;
        best = k;
        snprintf(name, sizeof name, "%.60s", e->d_name);
    }
    closedir(dir);
    if (best < 0) return 0;
    snprintf(path, n, "%s/%s", out_dir, name);
    return 1;
}

fl_status fl_trainer_diverge_error(const fl_trainer_diverge *d, const char *out_dir, double lr, long step, long iter) {
    char what[512], kept[8600], good[4200];
    if (d->by_val)
        snprintf(what, sizeof what, "the validation loss %.4g is above %.3g, a uniform guess's loss ln(vocab) = %.3f "
                 "+ %.0f", d->value, d->limit, d->ln_v, FL_DIVERGE_MARGIN);
    else
        snprintf(what, sizeof what, "the smoothed training loss (EMA %.2f) stayed above %.3g, a uniform guess's loss "
                 "ln(vocab) = %.3f + %.0f, for %d steps (since step %ld; now %.4g)", FL_DIVERGE_ALPHA, d->limit, d->ln_v,
                 FL_DIVERGE_MARGIN, FL_DIVERGE_WINDOW, d->since, d->value);
    if (d->last_good >= 0 && fl_trainer_ckpt_at_or_before(out_dir, d->last_good, good, sizeof good))
        snprintf(kept, sizeof kept, "the last good checkpoint, '%s', is kept: resume from it with --resume '%s' and a "
                 "lower learning rate", good, good);
    else if (d->last_good >= 0)
        snprintf(kept, sizeof kept, "no committed checkpoint holds weights from before the divergence (the last good "
                 "ones: step %ld)", d->last_good);
    else
        snprintf(kept, sizeof kept, "no weights of this run gave a loss within the limit: no checkpoint is a good one");
    return fl_errorf(FL_ERR_NONFINITE,
                     "training diverged at step %ld (iter %ld): %s; stopped without saving final/ (%s). hint: lower "
                     "the learning rate (--optimizer.lr, now %g), clip gradients (--train.max_norm 1.0) or warm up "
                     "longer (--train.lr_warmup_steps); --train.divergence_check false turns this check off",
                     step, iter, what, kept, lr);
}

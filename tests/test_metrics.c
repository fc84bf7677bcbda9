/* logs/metrics.csv (src/train/metrics.c): one schema for every trainer (README "Logs and metrics"): the columns in
 * order, tokens = this rank's share of total_tokens (every rank's: LitGPT's total_tokens = tokens x world size), an
 * absent value an empty field (JSONL: no key). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test.h"
#include "train/metrics.h"

FL_TEST(metrics_schema_tokens_per_rank) {
    const char *dir = fl_test_tmpdir();
    char p[4400];
    for (int jsonl = 0; jsonl < 2; jsonl++)
        for (int ranks = 1; ranks <= 2; ranks++) {
            fl_metrics mt;
            FL_REQUIRE_OK(fl_metrics_open(&mt, dir, jsonl ? "jsonl" : "csv", 0, -1));
            mt.ranks = ranks;
            fl_metrics_values v = {.iter = 3, .step = 1, .epoch = 0, .loss = 2.5, .iter_time = 0.25, .learning_rate = 1e-3,
                                   .val_loss = NAN, .tok_s = 400, .total_tokens = 200, .comm_sent = NAN};
            fl_metrics_row(&mt, &v);
            fl_metrics_close(&mt);
            snprintf(p, sizeof p, "%s/logs/metrics.%s", dir, jsonl ? "jsonl" : "csv");
            size_t n = 0;
            char *text = fl_test_slurp(p, &n);
            FL_REQUIRE(text);
            char want[512];
            if (jsonl)
                snprintf(want, sizeof want, "{\"iter\": 3, \"step\": 1, \"epoch\": 0, \"loss\": 2.5, \"iter_time\": 0.25, "
                         "\"tokens\": %d, \"total_tokens\": 200, \"learning_rate\": 0.001, \"tok_s\": 400, ", 200 / ranks);
            else
                snprintf(want, sizeof want, "iter,step,epoch,loss,iter_time,tokens,total_tokens,learning_rate,val_loss,val_ppl,"
                         "tok_s,mem_params,mem_grads,mem_optim,mem_acts,mem_workspace,mem_other,mem_peak,comm_sent\n"
                         "3,1,0,2.5,0.25,%d,200,0.001,,,400,0,0,0,0,0,0,0,\n", 200 / ranks);
            FL_CHECKF(!strncmp(text, want, strlen(want)), "%s, %d ranks:\n%s\nwant\n%s", jsonl ? "jsonl" : "csv", ranks,
                      text, want);
            free(text);
        }
}

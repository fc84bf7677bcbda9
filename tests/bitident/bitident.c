/* fitllm_bitident: a fingerprint of training, for refactors that must not change a bit.
 *
 * Runs a fixed matrix of short training runs (every precision, accumulation, activation
 * checkpointing, SGD / AdamW / 8-bit AdamW, LoRA, QLoRA, CPU offload, DDP, ZeRO-1/2, FSDP; LLaMA,
 * GPT-2 and OPT) on the backends named on the command line, through the public trainer API
 * (fl_trainer_run_comm, ranks as threads), and prints one line per optimizer step:
 *
 *     backend case step loss-bits params-fnv1a64
 *
 * loss-bits is the IEEE-754 bit pattern of the step's loss (%a), params-fnv1a64 the FNV-1a hash of
 * the raw bytes of the trained parameters (or the LoRA adapters) after that step, every rank's
 * (FULL_SHARD: whole parameters, hook_whole_params). Two builds train identically when their
 * outputs are the same text: tests/bitident/compare.sh runs both and diffs.
 *
 *     fitllm_bitident [--steps N] [--only SUBSTR] [--list] BACKEND...   (cpu, ref, opaque, cuda-emu)
 *
 * The matrix is part of the fingerprint: changing it changes every baseline, so cases are only
 * ever appended. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fitllm/backend.h"
#include "fitllm/comm.h"
#include "fitllm/config.h"
#include "fitllm/cpu.h"
#include "fitllm/trainer.h"

#ifdef FL_HAVE_CUDA_EMU
fl_status fl_cuemu_backend_init(fl_backend *be, int n_threads);
void fl_cuemu_backend_free(fl_backend *be);
#endif

#define BI_MAX_RANKS 4
#define BI_MAX_STEPS 64

typedef struct {
    const char *name;
    int lora;         /* 1 finetune_lora, 2 pretrain (random init from model_config), 0 finetune_full */
    int world;        /* ranks (threads) */
    const char *set;  /* "key=value;key=value" applied with fl_cfg_set after the defaults below */
    int cpu_only;     /* on the cpu backend only */
} bi_case;

/* The defaults of every case: micro (LLaMA shape, random init) on synthetic instructions, micro 2 x
 * accumulation 2 per rank, warm-up 1 step, clipping on. */
static const bi_case g_cases[] = {
    {"full-32true-adamw", 0, 1, "", 0},
    {"full-bf16true-adamw", 0, 1, "precision=bf16-true", 0},
    {"full-16true-adamw", 0, 1, "precision=16-true", 0},
    {"full-bf16mixed-adamw", 0, 1, "precision=bf16-mixed", 0},
    {"full-16mixed-adamw", 0, 1, "precision=16-mixed", 0},
    {"full-32true-ckpt", 0, 1, "train.activation_checkpointing=true", 0},
    {"full-bf16true-ckpt", 0, 1, "precision=bf16-true;train.activation_checkpointing=true", 0},
    {"full-32true-sgdm", 0, 1, "optimizer=SGD;optimizer.momentum=0.9;optimizer.lr=0.1", 0},
    {"full-32true-adamw8bit", 0, 1, "optimizer=AdamW8bit", 0},
    {"full-32true-accum1", 0, 1, "train.global_batch_size=2", 0},
    {"lora-32true", 1, 1, "lora_mlp=true;lora_dropout=0.1", 0},
    {"lora-bf16true", 1, 1, "precision=bf16-true;lora_mlp=true", 0},
    {"lora-bf16mixed-ckpt", 1, 1, "precision=bf16-mixed;train.activation_checkpointing=true", 0},
    {"qlora-nf4dq-bf16true", 1, 1, "quantize=bnb.nf4-dq;precision=bf16-true;lora_mlp=true", 0},
    {"qlora-fp4-32true", 1, 1, "quantize=bnb.fp4", 0},
    {"offload-zero2-32true", 0, 1, "strategy=deepspeed_stage_2_offload", 0},
    {"gpt2-pretrain-32true", 2, 1, "model_config=@TMP/gpt2.json", 0},
    {"gpt2-pretrain-bf16mixed", 2, 1, "model_config=@TMP/gpt2.json;precision=bf16-mixed", 0},
    /* the real tiny GPT-2 (Conv1D weights on disk, vocabulary 50257): on cpu only, its head's GEMMs
     * take the single-threaded backends minutes (and exceed the CUDA emulator's GEMM panel) */
    {"gpt2-hf-full-32true", 0, 1, "checkpoint_dir=@DATA/tiny-gpt2-hf", 1},
    {"gpt2-hf-lora-bf16mixed", 1, 1, "checkpoint_dir=@DATA/tiny-gpt2-hf;precision=bf16-mixed;lora_mlp=true", 1},
    {"opt-pretrain-bf16true", 2, 1, "model_config=@TMP/opt.json;precision=bf16-true", 0},
    {"llama-hf-full-32true", 0, 1, "checkpoint_dir=@DATA/stories260K-hf", 0},
    {"ddp2-32true", 0, 2, "strategy=ddp", 0},
    {"zero1-2-bf16mixed", 0, 2, "strategy=deepspeed_stage_1;precision=bf16-mixed", 0},
    {"zero2-2-32true", 0, 2, "strategy=deepspeed_stage_2", 0},
    {"fsdp2-32true", 0, 2, "strategy=fsdp", 0},
    {"fsdp2-bf16true", 0, 2, "strategy=fsdp;precision=bf16-true", 0},
    {"ddp2-lora", 1, 2, "strategy=ddp;lora_mlp=true;lora_dropout=0.1", 0},
    {"offload-zero2-2-32true", 0, 2, "strategy=deepspeed_stage_2_offload", 0},
    /* ZeRO-3 with the optimizer offloaded: the fingerprint of fsdp2-32true (the same math) */
    {"offload-zero3-2-32true", 0, 2, "strategy=deepspeed_stage_3_offload", 0},
    {"offload-zero3-2-bf16true", 0, 2, "strategy=deepspeed_stage_3_offload;precision=bf16-true", 0},
};
#define BI_N_CASES ((int)(sizeof g_cases / sizeof g_cases[0]))

typedef struct {
    double loss[BI_MAX_STEPS];
    uint64_t hash[BI_MAX_STEPS];
    long steps;
} bi_rec;

typedef struct {
    fl_run_config cfg;
    bi_rec rec[BI_MAX_RANKS];
    fl_status st[BI_MAX_RANKS];
    char msg[BI_MAX_RANKS][512];
} bi_job;

static uint64_t fnv1a(const void *p, size_t n) {
    const unsigned char *b = p;
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
    return h;
}

static int record(void *ud, long step, double loss, const void *params, size_t bytes) {
    bi_rec *r = ud;
    if (step >= 1 && step <= BI_MAX_STEPS) {
        r->loss[step - 1] = loss;
        r->hash[step - 1] = params ? fnv1a(params, bytes) : 0;
    }
    r->steps = step;
    return 0;
}

static fl_status run_rank(fl_comm *c, int rank, void *ud) {
    bi_job *j = ud;
    fl_status s = fl_trainer_run_comm(&j->cfg, c, NULL, 0, record, &j->rec[rank], NULL);
    j->st[rank] = s;
    if (s != FL_OK) snprintf(j->msg[rank], sizeof j->msg[rank], "%s", fl_error_message());
    return s;
}

/* A tiny OPT (ReLU, learned positions with OPT's offset of 2, biases) whose vocabulary holds the
 * built-in byte tokenizer: @TMP/opt.json. Dropout 0 (OPTConfig's default 0.1 is applied in training since issue 32:
 * the case keeps its fingerprints, builds before that ignore the key). */
static const char g_opt_json[] =
    "{\"model_type\": \"opt\", \"activation_function\": \"relu\", \"do_layer_norm_before\": true, \"dropout\": 0.0,\n"
    " \"enable_bias\": true, \"ffn_dim\": 96, \"hidden_size\": 64, \"word_embed_proj_dim\": 64,\n"
    " \"max_position_embeddings\": 64, \"num_attention_heads\": 4, \"num_hidden_layers\": 2,\n"
    " \"tie_word_embeddings\": true, \"vocab_size\": 320, \"bos_token_id\": 2, \"eos_token_id\": 2,\n"
    " \"pad_token_id\": 1}\n";
static const char g_gpt2_json[] =
    "{\"model_type\": \"gpt2\", \"n_embd\": 64, \"n_head\": 4, \"n_layer\": 2, \"n_positions\": 64,\n"
    " \"vocab_size\": 320, \"activation_function\": \"gelu_new\", \"layer_norm_epsilon\": 1e-5,\n"
    " \"tie_word_embeddings\": true, \"bos_token_id\": 256, \"eos_token_id\": 256}\n";
static const char *g_tmp;

static int write_file(const char *dir, const char *name, const char *text) {
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    if (f && fputs(text, f) >= 0 && fclose(f) == 0) return 0;
    perror(path);
    return -1;
}

/* "@DATA/x" -> $FITLLM_DATA_DIR/x (default ../shared/data), "@FIX/x" -> tests/fixtures/x (from the
 * source tree: FL_SOURCE_DIR), "@TMP/x" -> this run's temporary folder. */
static void expand(const char *v, char *out, size_t n) {
    const char *data = getenv("FITLLM_DATA_DIR");
    if (!strncmp(v, "@TMP/", 5))
        snprintf(out, n, "%s/%s", g_tmp, v + 5);
    else if (!strncmp(v, "@DATA/", 6))
        snprintf(out, n, "%s/%s", data && *data ? data : "../shared/data", v + 6);
    else if (!strncmp(v, "@FIX/", 5))
        snprintf(out, n, "%s/tests/fixtures/%s", FL_SOURCE_DIR, v + 5);
    else
        snprintf(out, n, "%s", v);
}

static fl_status configure(const bi_case *k, const char *backend, int steps, const char *tmp, fl_run_config *c) {
    fl_cfg_defaults(c, k->lora == 1 ? FL_CMD_FINETUNE_LORA : k->lora == 2 ? FL_CMD_PRETRAIN : FL_CMD_FINETUNE_FULL);
    if (k->lora != 2) snprintf(c->checkpoint_dir, sizeof c->checkpoint_dir, "micro");
    snprintf(c->out_dir, sizeof c->out_dir, "%s/%s-%s", tmp, backend, k->name);
    c->data.kind = FL_DATA_SYNTHETIC;
    c->data.synthetic_train = 257;
    c->data.synthetic_val = 7;
    snprintf(c->data.prompt_style, sizeof c->data.prompt_style, "default");
    c->train.micro_batch_size = 2;
    c->train.global_batch_size = 4 * k->world;
    c->train.lr_warmup_steps = 1;
    c->train.max_steps = steps;
    c->train.save_interval = 0;
    c->train.max_seq_length = 24;
    c->train.max_norm = 1.0f;
    c->eval.interval = 1000000;
    c->eval.max_iters = 2;
    c->eval.max_new_tokens = 0;
    c->eval.final_validation = 0;
    c->threads = 1;
    c->seed = 7;
    c->devices = k->world;
    c->optimizer.lr = 3e-3f;
    c->hook_whole_params = 1;
    if (k->world > 1) snprintf(c->strategy, sizeof c->strategy, "ddp");
    char buf[512];
    snprintf(buf, sizeof buf, "%s", k->set);
    for (char *tok = strtok(buf, ";"); tok; tok = strtok(NULL, ";")) {
        char *eq = strchr(tok, '=');
        if (!eq) return fl_errorf(FL_ERR_INTERNAL, "case %s: '%s' has no '='", k->name, tok);
        *eq = 0;
        char val[600];
        expand(eq + 1, val, sizeof val);
        fl_status s = fl_cfg_set(c, tok, val);
        if (s != FL_OK) return s;
    }
    return FL_OK;
}

int main(int argc, char **argv) {
    fl_cpu_process_init(argv);
#ifdef FL_HAVE_CUDA_EMU
    if (fl_backend_register("cuda-emu", "the CUDA backend over the CPU emulator (tests only)", fl_cuemu_backend_init,
                            fl_cuemu_backend_free) != FL_OK)
        return 2;
#endif
    int steps = 20, list = 0, nb = 0;
    const char *only = NULL, *backends[8];
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
        else if (!strcmp(argv[i], "--list")) list = 1;
        else if (nb < 8) backends[nb++] = argv[i];
    }
    if (list) {
        for (int k = 0; k < BI_N_CASES; k++) printf("%s\n", g_cases[k].name);
        return 0;
    }
    if (steps < 1 || steps > BI_MAX_STEPS || nb == 0) {
        fprintf(stderr, "usage: fitllm_bitident [--steps 1..%d] [--only SUBSTR] [--list] BACKEND...\n", BI_MAX_STEPS);
        return 2;
    }
    char tmp[] = "/tmp/fitllm-bitident-XXXXXX";
    if (!mkdtemp(tmp)) {
        perror("mkdtemp");
        return 2;
    }
    g_tmp = tmp;
    if (write_file(tmp, "opt.json", g_opt_json) || write_file(tmp, "gpt2.json", g_gpt2_json)) return 2;
    int failed = 0;
    for (int b = 0; b < nb; b++) {
        setenv("FITLLM_BACKEND", backends[b], 1);
        for (int k = 0; k < BI_N_CASES; k++) {
            const bi_case *kc = &g_cases[k];
            if (only && !strstr(kc->name, only)) continue;
            if (kc->cpu_only && strcmp(backends[b], "cpu")) continue;
            bi_job *j = calloc(1, sizeof *j);
            if (!j) return 2;
            struct timespec t0, t1;
            clock_gettime(CLOCK_MONOTONIC, &t0);
            fl_status s = configure(kc, backends[b], steps, tmp, &j->cfg);
            if (s == FL_OK) s = fl_comm_threads_run(kc->world, run_rank, j);
            if (s != FL_OK) {
                const char *why = j->msg[0][0] ? j->msg[0] : fl_error_message();
                printf("%s %s ERROR %s\n", backends[b], kc->name, why);
                failed++;
                free(j);
                continue;
            }
            for (long t = 0; t < j->rec[0].steps && t < BI_MAX_STEPS; t++) {
                uint64_t h = 0;
                for (int r = 0; r < kc->world; r++) h = h * 31 + j->rec[r].hash[t];
                printf("%s %s %ld %a %016llx\n", backends[b], kc->name, t + 1, j->rec[0].loss[t], (unsigned long long)h);
            }
            fflush(stdout);
            clock_gettime(CLOCK_MONOTONIC, &t1);
            fprintf(stderr, "%s %s: %.1f s\n", backends[b], kc->name,
                    (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
            free(j);
        }
    }
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmp);
    return failed ? 1 : 0;
}

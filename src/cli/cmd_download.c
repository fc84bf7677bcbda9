/* fitllm download: a model's files from the Hugging Face Hub into checkpoints/ORG/NAME, as
 * `litgpt download` lays them out (src/io/hf_hub.c does the work; this prints). */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "core/fs.h"
#include "fitllm/hub.h"
#include "fitllm/torch_ckpt.h"

static void help(void) {
    printf("usage: fitllm download [REPO] [--access_token TOKEN] [--checkpoint_dir DIR] [--revision REV]\n"
           "                       [--tokenizer_only true|false]\n\n"
           "Fetch a model from the Hugging Face Hub, as `litgpt download` does: config.json,\n"
           "generation_config.json, the tokenizer files and the weights (model.safetensors or its shards;\n"
           "without safetensors, pytorch_model*.bin) into DIR/ORG/NAME. Without REPO: the repo ids of the\n"
           "models fitllm builds.\n\n"
           "  REPO                   the model's repo id, ORG/NAME (e.g. TinyLlama/TinyLlama-1.1B-Chat-v1.0)\n"
           "  --access_token TOKEN   for gated and private models (default: $HF_TOKEN); accept a gated\n"
           "                         model's license on its Hub page first\n"
           "  --checkpoint_dir DIR   where ORG/NAME goes (default: $FITLLM_CHECKPOINTS, else checkpoints)\n"
           "  --revision REV         branch, tag or commit (default main)\n"
           "  --tokenizer_only true  config, generation config and tokenizer files only\n"
           "  --convert_checkpoint B a repo without safetensors: its pytorch_model*.bin converted to\n"
           "                         model.safetensors beside them (default true, as LitGPT converts; the\n"
           "                         .bin files stay and may be deleted; fitllm also reads them as they are)\n\n"
           "Each file is written to FILE.part and renamed when complete and verified (SHA-256 of the large\n"
           "files against the Hub's checksum, else the size); an interrupted download resumes from the\n"
           ".part when run again; config.json is written last, so a folder with one is complete.\n"
           "Environment: HF_ENDPOINT (default https://huggingface.co), HF_TOKEN.\n\n"
           "Models by name: wherever fitllm takes a model (finetune_*, pretrain --initial_checkpoint_dir,\n"
           "generate, loss, plan, merge_lora --base, bench-step), ORG/NAME or checkpoints/ORG/NAME means the\n"
           "downloaded folder: checkpoints/ORG/NAME, else the Hugging Face cache ($HF_HUB_CACHE, else\n"
           "$HF_HOME/hub, else ~/.cache/huggingface/hub), where transformers and huggingface-cli put models.\n"
           "A preset name (gpt2, tinyllama-1.1b, ...) is only a model's shape: its weights are random.\n\n"
           "exit codes: 0 ok, 1 runtime error (network, HTTP, checksum, disk), 2 usage error\n");
}

typedef struct {
    int tty;
    double last_ms;
    int64_t start_done;
    double start_ms;
    int bar_open;
} progress_state;

static void human(char *buf, size_t n, double bytes) {
    const char *u[] = {"B", "kB", "MB", "GB", "TB"};
    int k = 0;
    while (bytes >= 1000 && k < 4) bytes /= 1000, k++;
    snprintf(buf, n, k ? "%.1f %s" : "%.0f %s", bytes, u[k]);
}

static void end_bar(progress_state *p) {
    if (p->bar_open) fputc('\n', stdout);
    p->bar_open = 0;
}

static void on_event(void *ud, const fl_hub_event *ev) {
    progress_state *p = ud;
    char a[32], b[32];
    double now = fl_cli_now_ms();
    switch (ev->kind) {
    case FL_HUB_EV_INFO:
        end_bar(p);
        printf("%s\n", ev->msg);
        break;
    case FL_HUB_EV_START:
        end_bar(p);
        p->start_done = ev->done, p->start_ms = now, p->last_ms = 0;
        human(b, sizeof b, (double)ev->total);
        if (ev->done > 0) {
            human(a, sizeof a, (double)ev->done);
            printf("%s: resuming at %s of %s\n", ev->file, a, ev->total >= 0 ? b : "?");
        } else if (!p->tty) {
            printf("%s: downloading %s\n", ev->file, ev->total >= 0 ? b : "(size unknown)");
        }
        break;
    case FL_HUB_EV_PROGRESS:
        if (!p->tty || now - p->last_ms < 100) break; /* a bar on a terminal only, 10 redraws a second */
        p->last_ms = now;
        {
            double frac = ev->total > 0 ? (double)ev->done / (double)ev->total : 0;
            int fill = (int)(frac * 30);
            double rate = now > p->start_ms ? (double)(ev->done - p->start_done) / ((now - p->start_ms) / 1e3) : 0;
            char r[32], bar[31];
            for (int i = 0; i < 30; i++) bar[i] = i < fill ? '#' : '.';
            bar[30] = 0;
            human(a, sizeof a, (double)ev->done);
            human(b, sizeof b, (double)ev->total);
            human(r, sizeof r, rate);
            printf("\r%-28.28s [%s] %3.0f%% %s / %s  %s/s   ", ev->file, bar, frac * 100, a, ev->total >= 0 ? b : "?",
                   r);
            fflush(stdout);
            p->bar_open = 1;
        }
        break;
    case FL_HUB_EV_RETRY:
        end_bar(p);
        human(a, sizeof a, (double)ev->done);
        printf("%s: connection lost at %s (%s); resuming\n", ev->file, a, ev->msg ? ev->msg : "");
        break;
    case FL_HUB_EV_DONE:
        end_bar(p);
        human(a, sizeof a, (double)ev->done);
        printf("%s: %s, %s\n", ev->file, a, ev->msg ? ev->msg : "done");
        break;
    case FL_HUB_EV_SKIP:
        end_bar(p);
        printf("%s: already complete\n", ev->file);
        break;
    default:
        break;
    }
    fflush(stdout);
}

static int has_file(const char *dir, const char *name) {
    char p[FL_CLI_PATH];
    return snprintf(p, sizeof p, "%s/%s", dir, name) < (int)sizeof p && fl_fs_is_file(p);
}

/* A download that brought pytorch_model*.bin and no safetensors: the weights converted into
 * model.safetensors (or its shards + index) beside them, as LitGPT converts what it downloads.
 * fl_hf_convert builds a new folder atomically; its safetensors files are then renamed into dir
 * (same file system), the index last, so a folder never holds an index without its shards. A
 * failure leaves the .bin files, which fitllm reads as they are: said, not fatal. */
static void convert_bin(const char *cmd, const char *dir) {
    if (has_file(dir, "model.safetensors") || has_file(dir, "model.safetensors.index.json")) return;
    if (!has_file(dir, "pytorch_model.bin") && !has_file(dir, "pytorch_model.bin.index.json")) return;
    char tmp[FL_CLI_PATH], a[FL_CLI_PATH], b[FL_CLI_PATH];
    if (snprintf(tmp, sizeof tmp, "%s/.fitllm-convert-%ld", dir, (long)getpid()) >= (int)sizeof tmp) return;
    int n = 0;
    fl_status s = fl_hf_convert(dir, tmp, &n);
    if (s != FL_OK) {
        fprintf(stderr, "fitllm %s: note: the pytorch_model*.bin weights were not converted to safetensors (%s); "
                        "fitllm reads the .bin files as they are\n", cmd, fl_error_message());
        return;
    }
    DIR *d = opendir(tmp);
    int ok = d != NULL, pass;
    for (pass = 0; ok && pass < 2; pass++) { /* shards first, the index second */
        rewinddir(d);
        struct dirent *e;
        while (ok && (e = readdir(d))) {
            size_t L = strlen(e->d_name);
            int is_index = !strcmp(e->d_name, "model.safetensors.index.json");
            int is_st = L > 12 && !strcmp(e->d_name + L - 12, ".safetensors");
            if (!(pass == 0 ? is_st : is_index)) continue;
            if (snprintf(a, sizeof a, "%s/%s", tmp, e->d_name) >= (int)sizeof a ||
                snprintf(b, sizeof b, "%s/%s", dir, e->d_name) >= (int)sizeof b || rename(a, b) != 0) {
                fprintf(stderr, "fitllm %s: note: cannot move the converted %s into %s (%s); fitllm reads the .bin "
                                "files as they are\n", cmd, e->d_name, dir, strerror(errno));
                ok = 0;
            }
        }
    }
    if (d) closedir(d);
    fl_fs_remove_dir(tmp);
    if (ok)
        printf("converted pytorch_model*.bin to safetensors (%d tensors) in %s; the .bin files may be deleted "
               "(--convert_checkpoint false skips this)\n", n, dir);
}

static int parse_bool(const char *v, int *out) {
    if (!strcmp(v, "true") || !strcmp(v, "True") || !strcmp(v, "1")) { *out = 1; return 0; }
    if (!strcmp(v, "false") || !strcmp(v, "False") || !strcmp(v, "0")) { *out = 0; return 0; }
    return -1;
}

int fl_cmd_download(int argc, char **argv) {
    const char *cmd = "download";
    fl_hub_download_opts o = {0};
    int convert = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = NULL;
        char key[64];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { help(); return 0; }
        if (strncmp(a, "--", 2)) {
            if (o.repo) return fl_cli_usage(cmd, "unexpected argument '%s' (one repo id per command)", a);
            o.repo = a;
            continue;
        }
        const char *eq = strchr(a, '=');
        snprintf(key, sizeof key, "%.*s", eq ? (int)(eq - a - 2) : (int)strlen(a + 2), a + 2);
        if (eq) v = eq + 1;
        else if (i + 1 < argc) v = argv[++i];
        else return fl_cli_usage(cmd, "option %s needs a value", a);
        if (!strcmp(key, "repo_id")) o.repo = v; /* LitGPT's older spelling */
        else if (!strcmp(key, "access_token")) o.token = v;
        else if (!strcmp(key, "checkpoint_dir")) o.checkpoint_dir = v;
        else if (!strcmp(key, "revision")) o.revision = v;
        else if (!strcmp(key, "tokenizer_only")) {
            if (parse_bool(v, &o.tokenizer_only)) return fl_cli_usage(cmd, "--tokenizer_only takes true or false, not '%s'", v);
        } else if (!strcmp(key, "convert_checkpoint")) {
            /* LitGPT converts to its own format; fitllm converts .bin weights to safetensors */
            if (parse_bool(v, &convert)) return fl_cli_usage(cmd, "--convert_checkpoint takes true or false, not '%s'", v);
        } else {
            return fl_cli_usage(cmd, "unknown option '%s'", a);
        }
    }
    if (!o.repo) {
        printf("Repo ids of the models fitllm builds (`fitllm download REPO`; other repos of these architectures "
               "work too):\n");
        const char *preset;
        for (size_t i = 0; fl_preset_repo_at(i, &preset); i++) printf("  %-52s (%s)\n", fl_preset_repo_at(i, NULL), preset);
        return 0;
    }
    if (!fl_hub_is_repo_id(o.repo))
        return fl_cli_usage(cmd, "'%s' is not a Hugging Face repo id: ORG/NAME, e.g. TinyLlama/TinyLlama-1.1B-Chat-v1.0",
                            o.repo);
    if (!fl_hub_download_built()) {
        fprintf(stderr, "fitllm download: error: this fitllm was built without libcurl, so it cannot download "
                        "(install libcurl4-openssl-dev and rebuild); fitllm also finds models that transformers or "
                        "`huggingface-cli download %s` put in the Hugging Face cache\n", o.repo);
        return FL_EXIT_RUNTIME;
    }
    progress_state ps = {.tty = isatty(STDOUT_FILENO)};
    o.progress = on_event;
    o.ud = &ps;
    char dir[FL_CLI_PATH];
    fl_status s = fl_hub_download(&o, dir, sizeof dir);
    end_bar(&ps);
    if (s != FL_OK) return fl_cli_fail(cmd, s, NULL);
    /* the default folder resolves by name; another needs FITLLM_CHECKPOINTS or the path */
    int by_name = !o.checkpoint_dir || !strcmp(o.checkpoint_dir, fl_hub_download_root());
    printf("Saved %s to %s\n", o.repo, dir);
    if (convert && !o.tokenizer_only) convert_bin(cmd, dir);
    if (!o.tokenizer_only)
        printf("use it as `%s` wherever fitllm takes a model (finetune_full, finetune_lora, generate, ...)%s\n",
               by_name ? o.repo : dir, by_name ? " from this folder, or by its path" : "");
    return 0;
}

/* fitllm: models by name. A Hugging Face repo id ("ORG/NAME") given where a model is accepted
 * resolves to a local folder: fitllm's download folder (checkpoints/ORG/NAME, as `litgpt
 * download` lays it out) or the user's Hugging Face cache (what transformers and
 * huggingface-cli download into). fl_hub_download fetches a repo from the Hub (libcurl).
 *
 * Nothing here prints; errors say where the model was looked for and how to get it.
 */
#ifndef FITLLM_HUB_H
#define FITLLM_HUB_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FL_HUB_PATH 4096

/* 1 if s is a Hub model id "ORG/NAME": two parts of [A-Za-z0-9._-], each starting with a letter
 * or digit, no "--" or "..", at most 96 characters (the Hub's rules). */
int fl_hub_is_repo_id(const char *s);
/* The repo id a model name means, into repo[n]: "ORG/NAME" itself, or the last two parts of a
 * path under a "checkpoints" folder ("checkpoints/ORG/NAME", `litgpt download`'s layout, as
 * LitGPT's recipes name their base models). 0 if the name means no repo. */
int fl_hub_repo_of(const char *name, char *repo, size_t n);

/* The Hugging Face hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub. */
fl_status fl_hub_cache_dir(char *buf, size_t n);
/* fitllm's download folder (the parent of ORG/NAME): $FITLLM_CHECKPOINTS, else "checkpoints"
 * (relative to the current directory, as LitGPT's). */
const char *fl_hub_download_root(void);

/* Where fl_hub_resolve found a model. */
typedef enum { FL_HUB_NOWHERE = 0, FL_HUB_DOWNLOAD_DIR, FL_HUB_HF_CACHE, FL_HUB_WHERE_COUNT } fl_hub_where;

/* A model name that is not a file or folder here -> the local folder holding it (a folder with
 * config.json): <download root>/ORG/NAME, then the HF cache's models--ORG--NAME/snapshots/<rev>
 * with <rev> from refs/main (else its one snapshot with a config.json). `name` is a repo id or a
 * checkpoints/ORG/NAME path. FL_OK: out holds the folder, *where (may be NULL) where it was.
 * FL_ERR_NOT_FOUND: a repo id that is not there; the message says where it looked and to run
 * `fitllm download ORG/NAME`. FL_ERR_INVALID: the name is no repo id (callers try presets). */
fl_status fl_hub_resolve(const char *name, char *out, size_t n, fl_hub_where *where);
const char *fl_hub_where_name(fl_hub_where w);

/* ---- downloading (src/io/hf_hub.c; needs libcurl) ------------------------------------ */

/* 1 when this build can download (it was linked with libcurl). */
int fl_hub_download_built(void);

typedef enum {
    FL_HUB_EV_INFO,     /* msg: what was chosen (the revision, the weight format) */
    FL_HUB_EV_START,    /* file: a transfer begins at `done` bytes (resumed when > 0) of `total` */
    FL_HUB_EV_PROGRESS, /* file: done of total bytes (total -1: unknown) */
    FL_HUB_EV_RETRY,    /* file: the connection broke at `done`; msg: why; trying again */
    FL_HUB_EV_DONE,     /* file: complete, verified (msg: "sha256 ok" or "size ok") and in place */
    FL_HUB_EV_SKIP,     /* file: already there with the Hub's size */
    FL_HUB_EV_COUNT
} fl_hub_event_kind;

typedef struct {
    fl_hub_event_kind kind;
    const char *file; /* the file's name in the repo */
    int64_t done, total;
    const char *msg;
} fl_hub_event;

typedef struct {
    const char *repo;           /* "ORG/NAME" (required) */
    const char *revision;       /* NULL: "main" */
    const char *token;          /* NULL: $HF_TOKEN; sent as Authorization: Bearer */
    const char *checkpoint_dir; /* NULL: fl_hub_download_root(); files go to <it>/ORG/NAME */
    const char *endpoint;       /* NULL: $HF_ENDPOINT, else https://huggingface.co */
    int tokenizer_only;         /* config, generation config and tokenizer files only */
    int retries;                /* attempts per file after a broken connection (< 1: 3) */
    void (*progress)(void *ud, const fl_hub_event *ev); /* may be NULL */
    void *ud;
} fl_hub_download_opts;

/* Fetch a repo's model files as `litgpt download` does into <checkpoint_dir>/ORG/NAME:
 * config.json, generation_config.json, the tokenizer files, and the weights (model.safetensors
 * or the shards of model.safetensors.index.json; without safetensors pytorch_model*.bin and its
 * index). Each file goes to FILE.part, resumes from it with a Range request, is checked (SHA-256
 * of LFS files against the Hub's X-Linked-ETag / ETag / lfs.sha256, else the size) and renamed
 * into place only then; config.json comes last, so a folder with one is complete. A bad checksum
 * deletes the .part. out (may be NULL) gets the folder. Errors: FL_ERR_NOT_FOUND (no such repo,
 * revision or weights), FL_ERR_INVALID (401/403: a gated or private repo, with what to do),
 * FL_ERR_IO (network or disk; the .part kept to resume), FL_ERR_FORMAT (checksum, size, the API's
 * answer), FL_ERR_UNSUPPORTED (built without libcurl). */
fl_status fl_hub_download(const fl_hub_download_opts *o, char *out, size_t n);

/* The files to fetch from a repo's file list (the API's "siblings" rfilenames, top level only),
 * written as NUL-separated names into buf[n] in download order (weights, tokenizer,
 * generation_config.json, config.json last); *index (may be NULL) gets the weight index file
 * whose weight_map names further shards ("" when none). *weights: "safetensors", "bin" or "".
 * FL_ERR_NOT_FOUND: no config.json, or no weights and !tokenizer_only. (Exposed for the tests.) */
fl_status fl_hub_pick_files(const char *const *names, int n_names, int tokenizer_only, char *buf, size_t n,
                            int *n_picked, char *index, size_t index_n, const char **weights);

#ifdef __cplusplus
}
#endif
#endif

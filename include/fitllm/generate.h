/* fitllm: text generation with a KV cache (inference for LLaMA and GPT-2).
 *
 *  - fl_kv_cache: K and V of every layer for up to max_T positions, each
 *    (L, B=1, NKV, max_T, HD) float32, allocated from the model's pool with
 *    tag ACTS: the cache is the activation state that later steps read (it
 *    grows with the sequence exactly as saved activations grow with T, and a
 *    planner sizes it the same way); the per-step scratch (one row of every
 *    activation, RoPE tables (max_T, HD/2)) is WORKSPACE, and so is prefill's
 *    temporary (n rows) scratch, which is freed when prefill returns.
 *  - prefill: the prompt's tokens in one batched pass (causal attention op on
 *    the prompt, K/V rows copied into the cache); decode: one token at position
 *    p (RoPE with pos0 = p, attention_decode of one query against cached keys
 *    0..p). Per decode step the work is O(p) and no (T,T) or (T) buffer exists.
 *  - sampling: greedy (temperature 0) or temperature / top-k / top-p with a
 *    seeded deterministic RNG, in LitGPT's order (top-k, temperature, top-p).
 *
 * Nothing here prints; fl_generate reports each token through a callback.
 */
#ifndef FITLLM_GENERATE_H
#define FITLLM_GENERATE_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/mem.h"
#include "fitllm/model.h"
#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int n_layers, n_kv_heads, head_dim; /* L, NKV, HD */
    int max_T;                          /* capacity in positions (<= cfg.max_seq) */
    int pos;                            /* positions filled; the next token goes at pos */
    float *k, *v;                       /* (L, 1, NKV, max_T, HD) each, ACTS */
    /* private */
    float *rope_cos, *rope_sin;         /* (max_T, HD/2) LLaMA, WORKSPACE */
    float *step;                        /* one-row scratch of the decode step, WORKSPACE */
    void *be_scratch;                   /* the backend's op scratch (fl_backend.set_scratch), WORKSPACE,
                                         * when the model's ops need one and it has no activation arena
                                         * holding one (fl_model_backend_scratch); else NULL */
    fl_mem_pool *pool;
    /* a backend whose memory is not host memory only (else NULL): the step's token ids and the
     * last row's logits in device memory, copied from / to the caller's host buffers */
    int32_t *dids;                      /* (max_T) OTHER */
    float *dlogits;                     /* (V) WORKSPACE */
} fl_kv_cache;

/* Bytes of K+V for a config and capacity (what fl_kv_cache_init allocates as ACTS). */
size_t fl_kv_cache_bytes(const fl_model_config *cfg, int max_T);

/* Every buffer that generating from an n_prompt-token prompt with a cache of
 * max_T positions allocates, in bytes (shared with the planner, src/plan/).
 * Allocation order at run time: kv K, kv V (ACTS, kv_bytes/2 each), RoPE cos,
 * sin (WORKSPACE, rope_bytes/2 each, LLaMA only), the decode step scratch
 * (fl_kv_cache_init); then sampler probs and idx (sampler_bytes/2 each),
 * logits, and prefill's n_prompt-row scratch, freed when prefill returns
 * (fl_generate). */
typedef struct {
    size_t kv_bytes;       /* ACTS: K + V = fl_kv_cache_bytes */
    size_t rope_bytes;     /* WORKSPACE: cos + sin tables (max_T, HD/2) each; 0 for GPT-2 */
    size_t step_bytes;     /* WORKSPACE: one-row decode scratch */
    size_t sampler_bytes;  /* WORKSPACE: probs (V floats) + idx (V int32) */
    size_t logits_bytes;   /* WORKSPACE: (V) floats */
    size_t prefill_bytes;  /* WORKSPACE, transient: n_prompt-row scratch; 0 when n_prompt <= 1 */
} fl_gen_sizes;
void fl_sizing_generate(const fl_model_config *cfg, int n_prompt, int max_T, fl_gen_sizes *out);
/* Allocate the cache for m (max_T <= 0: the model's max_seq). Empty (pos 0). */
fl_status fl_kv_cache_init(fl_kv_cache *kv, const fl_model *m, int max_T);
void fl_kv_cache_free(fl_kv_cache *kv);
/* Forget the cached positions (pos = 0); the memory stays. */
void fl_kv_cache_reset(fl_kv_cache *kv);
/* Offset (elements) of layer l, kv head g, position t in kv->k / kv->v. */
static inline size_t fl_kv_cache_index(const fl_kv_cache *kv, int l, int g, int t) {
    return (((size_t)l * kv->n_kv_heads + g) * kv->max_T + t) * kv->head_dim;
}

/* Run n tokens at positions kv->pos .. kv->pos+n-1, appending their K/V to the
 * cache, and write the logits (V) of the last one into `logits` (host memory) (NULL: skip
 * the head). On an empty cache the n tokens go through one batched forward
 * (scratch of n rows, WORKSPACE, freed before returning); on a non-empty one
 * they are decoded one by one. Fails if the cache would overflow. */
fl_status fl_model_prefill(fl_model *m, fl_kv_cache *kv, const int32_t *ids, int n, float *logits);
/* One token at position kv->pos (then pos += 1); logits (V) of that position. */
fl_status fl_model_decode(fl_model *m, fl_kv_cache *kv, int32_t id, float *logits);

/* ---- sampling ------------------------------------------------------------ */

typedef struct {
    int max_new_tokens;  /* default 50 */
    float temperature;   /* default 0.8; 0 = greedy (argmax, first index on ties) */
    int top_k;           /* default 50; <= 0 = off. Logits below the k-th largest are dropped (ties kept) */
    float top_p;         /* default 1.0 = off; nucleus: drop the least likely tokens whose
                          * cumulative probability (ascending) is <= 1 - top_p, keep >= 1 */
    uint64_t seed;       /* default 1337 */
} fl_gen_params;

/* LitGPT's generate defaults (max_new_tokens 50, temperature 0.8, top_k 50, top_p 1.0), seed 1337. */
void fl_gen_params_default(fl_gen_params *p);
fl_status fl_gen_params_validate(const fl_gen_params *p);

typedef struct {
    fl_gen_params p;
    int V;
    uint64_t rng;      /* splitmix64 state, from seed */
    float *probs;      /* (V) WORKSPACE */
    int32_t *idx;      /* (V) WORKSPACE */
    fl_mem_pool *pool;
} fl_sampler;

fl_status fl_sampler_init(fl_sampler *s, fl_mem_pool *pool, int V, const fl_gen_params *p);
void fl_sampler_free(fl_sampler *s);
/* Choose the next token from logits (V); logits are modified (filtered, scaled). */
int32_t fl_sampler_sample(fl_sampler *s, float *logits);

/* An encoder-decoder (T5) from one source sequence src (Ts tokens; src_mask (Ts) or NULL): the encoder once, then
 * the decoder token by token with its KV cache (fl_model_generate_s2s's; without it when the arena checkpoints)
 * from the start token, each token chosen by the sampler of gp (temperature 0: greedy, the first of equal maxima;
 * else temperature, top-k, top-p, seeded), until eos or gp->max_new_tokens; out (max_new_tokens + 1) gets the start
 * token and the generated ids, *n_out their count (max_new_tokens 0: the start token alone, nothing run). The arena
 * (fl_model_alloc_gen_s2s: linear in max_new_tokens; or a training one, fl_model_alloc_acts_s2s) must hold source >= Ts
 * and target >= max_new_tokens; the sampler's probabilities and indices are WORKSPACE while it runs. */
fl_status fl_generate_s2s(fl_model *m, const int32_t *src, const uint8_t *src_mask, int Ts, const fl_gen_params *gp,
                          int32_t *out, int *n_out);
/* fl_generate_s2s for B sources (B, Ts) with their mask (B, Ts) or NULL, as fl_model_generate_s2s_batch lays out
 * out (B rows of max_new_tokens + 1, pad after each row's eos) and *n_out; the sampler draws row by row each step. */
fl_status fl_generate_s2s_batch(fl_model *m, const int32_t *src, const uint8_t *src_mask, int B, int Ts,
                                const fl_gen_params *gp, int32_t *out, int *n_out);

/* ---- the generation loop ------------------------------------------------- */

typedef enum {
    FL_GEN_STOP_MAX_TOKENS = 0, /* max_new_tokens reached */
    FL_GEN_STOP_EOS,            /* an EOS id was generated (it is the last token of out) */
    FL_GEN_STOP_CONTEXT,        /* prompt + generated reached the cache capacity (model context) */
    FL_GEN_STOP_CALLBACK        /* the callback asked to stop */
} fl_gen_stop;

/* Called after each new token; return nonzero to stop. */
typedef int (*fl_gen_callback)(void *ud, int32_t id);

/* Reset the cache, prefill the prompt (n_prompt >= 1) and generate up to
 * p->max_new_tokens tokens into out (capacity p->max_new_tokens). Stops at any
 * of eos_ids (n_eos may be 0), at max_new_tokens, or when prompt + generated
 * reaches kv->max_T. *n_out = tokens written; *why (may be NULL) says why it
 * stopped. cb may be NULL. */
fl_status fl_generate(fl_model *m, fl_kv_cache *kv, const int32_t *prompt, int n_prompt, const fl_gen_params *p,
                      const int32_t *eos_ids, int n_eos, int32_t *out, int *n_out, fl_gen_stop *why,
                      fl_gen_callback cb, void *ud);

#ifdef __cplusplus
}
#endif
#endif

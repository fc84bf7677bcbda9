/* fitllm: rotary position embedding tables (core/rope.c). The rotation itself is a backend op
 * (fitllm/backend.h rope_forward / rope_backward over tables in device memory, rope_tables). */
#ifndef FITLLM_ROPE_H
#define FITLLM_ROPE_H

#ifdef __cplusplus
extern "C" {
#endif

/* RoPE frequency scaling (HF config.json "rope_scaling"). */
typedef enum { FL_ROPE_NONE = 0, FL_ROPE_LINEAR, FL_ROPE_LLAMA3, FL_ROPE_SCALING_COUNT } fl_rope_scaling_type;
typedef struct {
    fl_rope_scaling_type type;
    float factor;                 /* linear and llama3 */
    float low_freq_factor;        /* llama3 */
    float high_freq_factor;       /* llama3 */
    int original_max_position;    /* llama3: original_max_position_embeddings */
} fl_rope_scaling;

/* RoPE tables: cos_t/sin_t (maxT, HD/2). inv_freq_j = theta^(-2j/HD), adjusted
 * by `scaling` (NULL or FL_ROPE_NONE: none); angle = pos * inv_freq_j. */
void fl_rope_table_init(float *cos_t, float *sin_t, int maxT, int HD, float theta, const fl_rope_scaling *scaling);

#ifdef __cplusplus
}
#endif
#endif

/* RoPE tables (fitllm/rope.h): cos/sin of position x inverse frequency, with HF's frequency
 * scalings. Host code, no backend: the model fills them through a backend's rope_tables slot,
 * whose CPU version calls this. */
#include <math.h>
#include <stddef.h>

#include "fitllm/rope.h"

void fl_rope_table_init(float *cos_t /*(maxT,HD/2)*/, float *sin_t /*(maxT,HD/2)*/, int maxT, int HD, float theta,
                        const fl_rope_scaling *scaling) {
    int H = HD / 2;
    for (int j = 0; j < H; j++) {
        /* Computed in double (HF uses float32 here; double is the exact value
         * both approximate, and the tables are stored as float anyway). */
        double inv = pow((double)theta, -(2.0 * j) / (double)HD);
        if (scaling && scaling->type == FL_ROPE_LINEAR) {
            inv /= (double)scaling->factor;
        } else if (scaling && scaling->type == FL_ROPE_LLAMA3) {
            /* transformers.modeling_rope_utils._compute_llama3_parameters */
            double factor = scaling->factor, lo = scaling->low_freq_factor, hi = scaling->high_freq_factor;
            double old_ctx = scaling->original_max_position;
            double low_freq_wavelen = old_ctx / lo, high_freq_wavelen = old_ctx / hi;
            double wavelen = 2.0 * M_PI / inv;
            double inv_l = wavelen > low_freq_wavelen ? inv / factor : inv;
            int medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
            if (medium) {
                double smooth = (old_ctx / wavelen - lo) / (hi - lo);
                inv_l = (1.0 - smooth) * inv_l / factor + smooth * inv_l;
            }
            inv = inv_l;
        }
        for (int p = 0; p < maxT; p++) {
            double a = (double)p * inv;
            cos_t[(size_t)p * H + j] = (float)cos(a);
            sin_t[(size_t)p * H + j] = (float)sin(a);
        }
    }
}

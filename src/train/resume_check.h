/* Resume checks of the BLIP-2 trainer (resume_check.c; the language-model trainer's: fl_ckpt_check_resume,
 * include/fitllm/checkpoint.h). Private to src/train. */
#ifndef FL_RESUME_CHECK_H
#define FL_RESUME_CHECK_H

#include "fitllm/blip2.h"
#include "fitllm/config.h"

/* fl_ckpt_check_resume for a BLIP-2 run: the model's architecture compared part by part (vision_config.,
 * qformer_config., text_config. and how they join), the table's keys that apply to BLIP-2 (seed refused: it shuffles
 * the captions; blip2.train refused as the parts it names), the LoRA targets on the language model; the same
 * messages, notes and status as the language-model trainer's. */
fl_status fl_ckpt_check_resume_blip2(const char *dir, const fl_run_config *cfg, const fl_blip2_config *bc, char *notes,
                                     size_t n);

/* Whether a run's checkpoint_dir holds weights the loader reads (a model folder: HF or LitGPT; a llama2.c .bin), as
 * against a preset name or a config.json alone, which give random weights of their shape whatever --init says. */
int fl_rs_has_weights(const char *checkpoint_dir);

#endif

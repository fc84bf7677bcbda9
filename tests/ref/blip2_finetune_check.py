#!/usr/bin/env python3
"""Checks a folder written by `fitllm finetune_full|finetune_lora` on a BLIP-2 checkpoint (src/train/blip2_train.c through src/cli/cmd_blip2_train.c)
with transformers: the final folder loads into Blip2ForConditionalGeneration (every tensor, no missing or unexpected
key), its caption loss on an image equals the one `fitllm loss FOLDER --image` printed, and under LoRA the PEFT
adapter (final/adapter) applied to the base checkpoint gives the same loss (within fp32 noise, 1e-4 relative).

Pinned versions (tests/ref/requirements.txt): torch 2.15.0, transformers 5.23.0, peft 0.21.2.
Not run by make test (no Python there). Usage, from the repo root:
    python tests/ref/blip2_finetune_check.py FINAL_DIR IMAGE "CAPTION IDS" FITLLM_LOSS [BASE_DIR]
The Flan-T5 variant: FITLLM_B2_SRC="SOURCE IDS" in the environment (the prompt after the placeholders); CAPTION IDS
is then the target (with its EOS).
"""
import os
import sys

import torch
from PIL import Image
from transformers import Blip2ForConditionalGeneration, BlipImageProcessor


def caption_loss(model, px, ids, src=None):
    nq = model.config.num_query_tokens
    if src is not None:  # the Flan-T5 variant: the source (placeholders, prompt) and the target's loss
        inp = torch.tensor([[model.config.image_token_index] * nq + src])
        with torch.no_grad():
            return model(pixel_values=px, input_ids=inp, labels=torch.tensor([ids])).loss.item()
    inp = torch.tensor([[model.config.image_token_index] * nq + ids])
    with torch.no_grad():
        logits = model(pixel_values=px, input_ids=inp).logits[0, -len(ids):]
    return torch.nn.functional.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:])).item()


def main():
    final, image, cap, want = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split()], float(sys.argv[4])
    px = BlipImageProcessor.from_pretrained(final)(Image.open(image), return_tensors="pt").pixel_values
    model, info = Blip2ForConditionalGeneration.from_pretrained(final, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k != "mismatched_keys" or (k == "mismatched_keys" and v)}
    assert not bad, f"loading {final}: {bad}"
    src = [int(x) for x in os.environ["FITLLM_B2_SRC"].split()] if "FITLLM_B2_SRC" in os.environ else None
    got = caption_loss(model.eval(), px, cap, src)
    print(f"{final}: transformers loss {got:.6f}, fitllm {want:.6f}")
    assert abs(got - want) <= 1e-4 * abs(want) + 1e-5, "the saved weights' loss differs"
    if len(sys.argv) > 5:
        from peft import PeftModel
        base = Blip2ForConditionalGeneration.from_pretrained(sys.argv[5])
        peft = PeftModel.from_pretrained(base, final + "/adapter").eval()
        got = caption_loss(peft, px, cap, src)
        print(f"{final}/adapter on {sys.argv[5]}: PEFT loss {got:.6f}")
        assert abs(got - want) <= 1e-4 * abs(want) + 1e-5, "the PEFT adapter's loss differs"
    print("ok")


if __name__ == "__main__":
    main()

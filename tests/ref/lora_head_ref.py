"""LoRA on lm_head (PEFT target "lm_head", LitGPT lora_head) -> tests/fixtures/peft-llama-head/.

The golden-llama fixture model (tests/fixtures/golden-llama: LLaMA, untied lm_head, V 257, C 96,
3 layers), LoraConfig(r=4, lora_alpha=8, target_modules=[q_proj, v_proj, lm_head],
lora_dropout=0), A as PEFT initializes it (torch.manual_seed(0)), B set to non-zero random values.
Written:
  adapter_config.json + adapter_model.safetensors   save_pretrained (keys
      base_model.model.lm_head.lora_A.weight, ...)
  grads-ref.safetensors   a training batch: ids (2, 12), targets (2, 12; -100 = ignored), the
      mean cross-entropy over the valid targets (loss), its logits (2*12, V), and the gradient of
      that loss for every adapter tensor, keyed "grad.<module>.lora_A" / "grad.<module>.lora_B"
      (the base is frozen: requires_grad False on every non-LoRA weight)
  merged-ref.safetensors  merge_and_unload(): merged lm_head.weight and q_proj of layer 0, the
      merged model's logits for fixed ids (the format of peft_ref.py's merged-ref)
Usage (repo root): /work/venv/bin/python tests/ref/lora_head_ref.py
"""
import os

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file

SRC = "tests/fixtures/golden-llama"
DST = "tests/fixtures/peft-llama-head"


def main():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(SRC, dtype=torch.float32)
    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    model.eval()
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], lora_dropout=0.0,
                     bias="none", task_type="CAUSAL_LM")
    pm = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(4321)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert all("lora_" in n for n in trainable), trainable
    assert any("lm_head.lora_A" in n for n in trainable)
    pm.peft_config["default"].base_model_name_or_path = os.path.basename(SRC)
    os.makedirs(DST, exist_ok=True)
    pm.save_pretrained(DST)

    # training batch: 2 x 12 ids, targets with a few ignored positions
    gi = torch.Generator().manual_seed(99)
    ids = torch.randint(0, 257, (2, 12), generator=gi)
    targets = torch.randint(0, 257, (2, 12), generator=gi)
    targets[0, 3] = -100
    targets[1, 0] = -100
    targets[1, 11] = -100
    logits = pm(input_ids=ids).logits  # (2, 12, V)
    V = logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=-100)
    loss.backward()
    out = {"ids": ids.to(torch.int32), "targets": targets.to(torch.int32), "loss": loss.detach().reshape(1),
           "logits": logits.detach().reshape(-1, V).contiguous()}
    for n, p in pm.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, n
            continue
        # base_model.model.lm_head.lora_A.default.weight -> grad.lm_head.lora_A
        mod = n[len("base_model.model."):].replace(".default.weight", "")
        out["grad." + mod] = p.grad.detach().contiguous()
    meta = {"peft": peft.__version__, "torch": torch.__version__, "transformers": transformers.__version__}
    save_file(out, os.path.join(DST, "grads-ref.safetensors"), metadata=meta)
    print("loss", loss.item(), "| grad lm_head A max", out["grad.lm_head.lora_A"].abs().max().item(),
          "B max", out["grad.lm_head.lora_B"].abs().max().item())

    # merged model: weights and logits
    fixed = [1, 17, 42, 99, 3, 250, 7, 128, 64, 5, 200, 31]
    x = torch.tensor([fixed])
    with torch.no_grad():
        logits_peft = pm(input_ids=x).logits[0].float()
        merged = pm.merge_and_unload()
        lm = merged(input_ids=x).logits[0].float()
    print("max |peft - merged| logits", (logits_peft - lm).abs().max().item())
    sd = merged.state_dict()
    mref = {"ids": torch.tensor(fixed, dtype=torch.int32), "logits": lm.contiguous(),
            "lm_head.weight": sd["lm_head.weight"].contiguous(),
            "model.layers.0.self_attn.q_proj.weight": sd["model.layers.0.self_attn.q_proj.weight"].contiguous()}
    save_file(mref, os.path.join(DST, "merged-ref.safetensors"), metadata=meta)
    for f in sorted(os.listdir(DST)):
        print(" ", f, os.path.getsize(os.path.join(DST, f)))


if __name__ == "__main__":
    main()

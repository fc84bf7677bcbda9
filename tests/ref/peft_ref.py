"""PEFT adapter reference -> tests/fixtures/peft-llama/ and tests/fixtures/peft-gpt2/.

LLaMA: the golden-llama fixture model (tests/fixtures/golden-llama), LoraConfig(r=4, lora_alpha=8,
target_modules=[q_proj, v_proj, down_proj], lora_dropout=0), B set to non-zero random values,
saved with save_pretrained (adapter_config.json + adapter_model.safetensors); then
merge_and_unload() and the merged model's logits for fixed ids, plus two merged weights, go to
merged-ref.safetensors in the same folder.
GPT-2: the golden-gpt2 model, target c_attn and c_fc (Conv1D: fan_in_fan_out=True), same
procedure; merged Conv1D weights are stored as HF holds them, (in, out).
LLaMA with per-module ranks and alphas -> tests/fixtures/peft-llama-pattern/: the LLaMA adapter's targets with
rank_pattern {"v_proj": 2, "layers.1.self_attn.q_proj": 6} and alpha_pattern {"down_proj": 3, "q_proj": 12}
(PEFT's get_pattern_key: the first key whose "(.*\.)?(KEY)$" matches the module name).
Usage (repo root): /work/venv/bin/python tests/ref/peft_ref.py [pattern]  (pattern: that fixture alone)
"""
import os

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file


def run(src, dst, targets, fan_in_fan_out, keep, ids, rank_pattern=None, alpha_pattern=None):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.eval()
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, bias="none",
                     task_type="CAUSAL_LM", fan_in_fan_out=fan_in_fan_out, rank_pattern=rank_pattern or {},
                     alpha_pattern=alpha_pattern or {})
    pm = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    pm.peft_config["default"].base_model_name_or_path = os.path.basename(src)
    pm.save_pretrained(dst)
    for name, p in pm.named_parameters():
        if "lora_" in name and "layers.0." in name or ".h.0." in name and "lora_" in name:
            print(name, tuple(p.shape))
    x = torch.tensor([ids])
    with torch.no_grad():
        logits_peft = pm(input_ids=x).logits[0].float()
        merged = pm.merge_and_unload()
        logits = merged(input_ids=x).logits[0].float()
    print(dst, "max |peft - merged| logits", (logits_peft - logits).abs().max().item())
    sd = merged.state_dict()
    out = {"ids": torch.tensor(ids, dtype=torch.int32), "logits": logits.contiguous()}
    for k in keep:
        out[k] = sd[k].contiguous()
    save_file(out, os.path.join(dst, "merged-ref.safetensors"),
              metadata={"peft": peft.__version__, "torch": torch.__version__, "transformers": transformers.__version__})
    for f in sorted(os.listdir(dst)):
        print(" ", f, os.path.getsize(os.path.join(dst, f)))


def main():
    import sys
    ids = [1, 17, 42, 99, 3, 250, 7, 128, 64, 5, 200, 31]
    run("tests/fixtures/golden-llama", "tests/fixtures/peft-llama-pattern", ["q_proj", "v_proj", "down_proj"], False,
        ["model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight",
         "model.layers.2.mlp.down_proj.weight"], ids,
        rank_pattern={"v_proj": 2, "layers.1.self_attn.q_proj": 6}, alpha_pattern={"down_proj": 3, "q_proj": 12})
    if sys.argv[1:] == ["pattern"]:
        return
    run("tests/fixtures/golden-llama", "tests/fixtures/peft-llama", ["q_proj", "v_proj", "down_proj"], False,
        ["model.layers.0.self_attn.q_proj.weight", "model.layers.2.mlp.down_proj.weight"], ids)
    run("tests/fixtures/golden-gpt2", "tests/fixtures/peft-gpt2", ["c_attn", "c_fc"], True,
        ["transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_fc.weight"], ids)


if __name__ == "__main__":
    main()

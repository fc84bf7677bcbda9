"""Reference for the Alpaca/JSON dataset: LitGPT's prompt template, Tokenizer.encode
and SFTDataset.__getitem__ (litgpt/prompts.py Alpaca, litgpt/tokenizer.py,
litgpt/data/base.py) re-stated here so the script needs only `tokenizers` and
`torch`, plus torch.utils.data.random_split exactly as LitGPT calls it.

    /work/venv/bin/python tests/ref/alpaca_ref.py [DATA_DIR] > tests/fixtures/alpaca-ref.json

DATA_DIR defaults to ../shared/data. Writes JSON to stdout.
"""
import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from torch.utils.data import random_split

data = Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/data")
tok_dir = data / "llama2-tokenizer"
hf = HFTokenizer.from_file(str(tok_dir / "tokenizer.json"))
cfg = json.load(open(tok_dir / "tokenizer_config.json"))
use_bos = cfg.get("add_bos_token", cfg.get("tokenizer_class") == "LlamaTokenizer")
bos_id = hf.token_to_id(cfg["bos_token"])
eos_id = hf.token_to_id(cfg["eos_token"])


def encode(s, bos=None, eos=False, max_length=-1):  # litgpt.Tokenizer.encode
    tokens = hf.encode(s).ids
    if bos or (bos is None and use_bos):
        if not tokens or tokens[0] != bos_id:
            tokens = [bos_id] + tokens
    elif tokens and tokens[0] == bos_id:
        tokens = tokens[1:]
    if eos and (not tokens or tokens[-1] != eos_id):
        tokens = tokens + [eos_id]
    elif tokens and tokens[-1] == eos_id:
        tokens = tokens[:-1]
    if max_length > 0:
        tokens = tokens[:max_length]
    return tokens


def alpaca(prompt, **kw):  # litgpt.prompts.Alpaca.apply
    if kw.get("input"):
        return ("Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n"
                f"### Instruction:\n{prompt}\n\n### Input:\n{kw['input']}\n\n### Response:\n")
    return ("Below is an instruction that describes a task. "
            "Write a response that appropriately completes the request.\n\n"
            f"### Instruction:\n{prompt}\n\n### Response:\n")


def sft(example, max_seq_length=-1, mask_prompt=True, ignore_index=-100):  # SFTDataset.__getitem__
    prompt = alpaca(prompt=example["instruction"], **example)
    p = encode(prompt, max_length=max_seq_length)
    r = encode(example["output"], bos=False, eos=True, max_length=max_seq_length)
    ids = p + r
    if max_seq_length > 0:
        ids = ids[:max_seq_length]
    labels = list(ids)
    if mask_prompt:
        labels[:len(p)] = [ignore_index] * min(len(p), len(labels))
    return prompt, ids, labels


records = json.load(open(data / "instruct" / "alpaca-tiny.json", encoding="utf-8"))
out = {"source": "instruct/alpaca-tiny.json", "n_records": len(records), "seed": 42,
       "randperm_100": torch.randperm(100, generator=torch.Generator().manual_seed(42)).tolist(),
       "randperm_7_seed1234": torch.randperm(7, generator=torch.Generator().manual_seed(1234)).tolist(),
       "splits": [], "samples": []}
for frac in (0.05, 0.03865, 0.5):
    tr, va = random_split(records, [1.0 - frac, frac], generator=torch.Generator().manual_seed(42))
    out["splits"].append({"val_split_fraction": frac, "train": list(tr.indices), "val": list(va.indices)})

tr, va = random_split(records, [0.95, 0.05], generator=torch.Generator().manual_seed(42))
picks = [("train", k, tr.indices[k]) for k in range(3)] + [("val", k, va.indices[k]) for k in range(2)]
with_input = next(i for i, r in enumerate(records) if r["input"])
for split, k, ri in picks:
    for mask in (True, False):
        prompt, ids, labels = sft(records[ri], mask_prompt=mask)
        out["samples"].append({"split": split, "k": k, "record": ri, "mask_prompt": mask, "max_seq_length": -1,
                               "prompt": prompt, "ids": ids, "labels": labels})
prompt, ids, labels = sft(records[tr.indices[0]], max_seq_length=24, mask_prompt=True)
out["samples"].append({"split": "train", "k": 0, "record": tr.indices[0], "mask_prompt": True, "max_seq_length": 24,
                       "prompt": prompt, "ids": ids, "labels": labels})
prompt, ids, labels = sft(records[with_input], mask_prompt=True)
out["with_input"] = {"record": with_input, "prompt": prompt, "ids": ids, "labels": labels}
json.dump(out, sys.stdout, ensure_ascii=False)
sys.stdout.write("\n")

#!/usr/bin/env python3
# Sample-length quantiles of the 100 real Alpaca records in ../shared/data/instruct/alpaca-tiny.json,
# tokenized as LitGPT's SFTDataset does (Alpaca prompt template + response + EOS, BOS on the prompt)
# with the LLaMA-2 tokenizer (../shared/data/llama2-tokenizer/tokenizer.json). Writes the table the
# lab's synthetic Alpaca-like length sampler is meant to follow (issue 33, Deliver 1).
# Pinned: tokenizers==0.23.3 (tests/ref/requirements.txt). Run:
#   /work/venv-graph/bin/python tests/ref/alpaca_lengths.py > recipes/data/alpaca-lengths.tsv
import json, os, sys
from tokenizers import Tokenizer
sys.path.insert(0, os.path.dirname(__file__))
import contextlib, io
with contextlib.redirect_stdout(io.StringIO()):  # alpaca_ref prints its fixture when imported
    from alpaca_ref import alpaca  # same template as src/data/sft.c

D = os.environ.get("FITLLM_SHARED_DATA", os.path.join(os.path.dirname(__file__), "../../../shared/data"))
tok = Tokenizer.from_file(os.path.join(D, "llama2-tokenizer/tokenizer.json"))
recs = json.load(open(os.path.join(D, "instruct/alpaca-tiny.json")))
lens = []
for r in recs:
    p = tok.encode(alpaca(r["instruction"], **r), add_special_tokens=False).ids
    o = tok.encode(r["output"], add_special_tokens=False).ids
    lens.append(1 + len(p) + len(o) + 1)  # BOS + prompt + response + EOS
# cross-check against alpaca_ref.sft (the fixture the C loader is tested with): same length per record
with contextlib.redirect_stdout(io.StringIO()):
    from alpaca_ref import sft
for i in (5, 42, 62):
    assert len(sft(recs[i])[1]) == lens[i], (i, len(sft(recs[i])[1]), lens[i])
lens.sort()
n = len(lens)
print(f"# Alpaca sample lengths (tokens, LLaMA-2 tokenizer, BOS+prompt+response+EOS), n={n} records of")
print("# shared/data/instruct/alpaca-tiny.json; made by tests/ref/alpaca_lengths.py (nearest-rank quantiles)")
print("# quantile\tlength")
for q in (0.0, 0.05, 0.10, 0.25, 0.50, 0.75, 0.90, 0.95, 0.99, 1.0):
    k = min(n - 1, max(0, int(-(-q * n // 1)) - 1)) if q > 0 else 0
    print(f"{q:.2f}\t{lens[k]}")
print(f"# mean\t{sum(lens)/n:.1f}")

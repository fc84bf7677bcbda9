#!/usr/bin/env python3
"""HF `tokenizers` encode speed, one thread, same texts and table as
bench/bench_tokenizer.c: whole text as one string and line by line, median of 5, MB/s.

    RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false /work/venv/bin/python bench/bench_tokenizer_hf.py [data_dir]
"""
import os
import sys

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import statistics  # noqa: E402
import time  # noqa: E402

from tokenizers import Tokenizer  # noqa: E402


def main():
    data = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("FITLLM_DATA", "../shared/data")
    toks = [("llama2-tokenizer/tokenizer.json", "LLaMA-2 tokenizer.json (HF)"),
            ("gpt2-tokenizer/tokenizer.json", "GPT-2 tokenizer.json (HF)")]
    texts = ["text/tinystories-val-prefix.txt", "text/tinyshakespeare.txt"]
    print("| tokenizer | text | MB | mode | tokens | median s | MB/s |\n|---|---|---|---|---|---|---|")
    for rel, name in toks:
        tok = Tokenizer.from_file(os.path.join(data, rel))
        for tx in texts:
            with open(os.path.join(data, tx), "rb") as f:
                raw = f.read()
            text = raw.decode("utf-8")
            lines = text.split("\n")
            for mode in ("whole", "lines"):
                ts = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    if mode == "whole":
                        ntok = len(tok.encode(text, add_special_tokens=False).ids)
                    else:  # one call per line, like the C benchmark (no batching: batch calls use the thread pool)
                        ntok = sum(len(tok.encode(ln, add_special_tokens=False).ids) for ln in lines)
                    ts.append(time.perf_counter() - t0)
                s = statistics.median(ts)
                print(f"| {name} | {os.path.basename(tx)} | {len(raw) / 1e6:.2f} | {mode} | {ntok} | {s:.3f} | {len(raw) / 1e6 / s:.2f} |",
                      flush=True)


if __name__ == "__main__":
    main()

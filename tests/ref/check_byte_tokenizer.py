#!/usr/bin/env python3
"""Check, by hand, that the built-in byte tokenizer fitllm writes into every checkpoint of a run
on it (tokenizer.json + tokenizer_config.json, src/tokenizer/tok_export.c) loads in Hugging Face
`tokenizers` and transformers' AutoTokenizer to the same ids as fitllm (the built-in and the
written file, through `fitllm tokenize`), and decodes back to the text.

    python tests/ref/check_byte_tokenizer.py CHECKPOINT_DIR [--fitllm ./build/fitllm] [--data ../shared/data]

CHECKPOINT_DIR: e.g. out/final of `fitllm finetune_full micro --data Synthetic --train.max_steps 1`.
Versions: tests/ref/requirements.txt (tokenizers, transformers; no torch needed). Exit 1 on a mismatch.
"""
import argparse
import os
import random
import subprocess
import sys

import tokenizers
import transformers
from tokenizers import Tokenizer
from transformers import AutoTokenizer


def fitllm_ids(exe, tok, text):
    r = subprocess.run([exe, "tokenize", tok, "--text", text], capture_output=True, text=True)
    if r.returncode != 0:
        return ("exit", r.returncode, r.stderr.strip())
    return [int(x) for x in r.stdout.split()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--fitllm", default="./build/fitllm")
    ap.add_argument("--data", default=os.environ.get("FITLLM_DATA", "../shared/data"))
    a = ap.parse_args()
    tk = Tokenizer.from_file(os.path.join(a.ckpt, "tokenizer.json"))
    at = AutoTokenizer.from_pretrained(a.ckpt)
    print(f"tokenizers {tokenizers.__version__}, transformers {transformers.__version__}: {type(at).__name__}, "
          f"bos {at.bos_token!r} {at.bos_token_id}, eos {at.eos_token!r} {at.eos_token_id}, vocab {tk.get_vocab_size()}")
    ok = tk.get_vocab_size() == 258 and at.bos_token_id == 256 and at.eos_token_id == 257
    texts = ["Hello wörld", "", " leading  and trailing ", "tab\tnew\nline\r\n", "emoji 🦙 llamas",
             "quote \" backslash \\ end", "控制 \x01\x02\x7f", "ÿþ£€"]
    shakespeare = os.path.join(a.data, "text", "tinyshakespeare.txt")
    if os.path.exists(shakespeare):
        texts.append(open(shakespeare, encoding="utf-8").read()[:20000])
    rnd = random.Random(0)
    for _ in range(50):
        texts.append("".join(chr(rnd.choice([rnd.randrange(32, 127), rnd.randrange(0xA0, 0x3000), rnd.randrange(1, 32)]))
                             for _ in range(rnd.randrange(1, 60))))
    bad = 0
    for t in texts:
        want = list(t.encode("utf-8"))  # the built-in byte tokenizer: id = byte, nothing added
        got = {"tokenizers": tk.encode(t).ids,
               "AutoTokenizer": at(t, add_special_tokens=True)["input_ids"],
               "fitllm tokenize CKPT": fitllm_ids(a.fitllm, a.ckpt, t),
               "fitllm tokenize bytes": fitllm_ids(a.fitllm, "bytes", t)}
        dec = {"tokenizers": tk.decode(want), "AutoTokenizer": at.decode(want)}
        wrong = [k for k, v in got.items() if v != want] + [k + " decode" for k, v in dec.items() if v != t]
        if wrong:
            bad += 1
            print("MISMATCH", repr(t[:60]), wrong)
    # specials: decoded as their strings, dropped with skip_special_tokens; a literal "<eos>" is matched
    # (Hugging Face matches every added token in the text; fitllm's built-in encodes its bytes)
    ok = ok and tk.decode([256, 72, 105, 257], skip_special_tokens=False) == "<bos>Hi<eos>"
    ok = ok and tk.decode([256, 72, 105, 257]) == "Hi" and tk.encode("a<eos>b").ids == [97, 257, 98]
    print(f"{len(texts)} texts, {bad} mismatches; specials {'ok' if ok else 'WRONG'}")
    return 0 if ok and not bad else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Reference ids for the tokenizer hard cases, from Hugging Face `tokenizers`.

Writes tests/fixtures/tokenizer-hard-cases.json: for each tokenizer.json in
../shared/data and each text, the ids without and with special tokens
(Tokenizer.encode(text, add_special_tokens=...)) and the decodes of the
special-token ids with and without skip_special_tokens.

    /work/venv/bin/python tests/ref/tokenizer_ref.py [--data ../shared/data]
"""
import argparse
import json
import os

import tokenizers
from tokenizers import Tokenizer

TEXTS = [
    "",
    " ",
    "  ",
    "    ",
    "a  b   c",
    "\n",
    "\n\n\n",
    "\t",
    "x\ty\tz",
    "line one\r\nline two\n",
    "   leading and trailing   ",
    "Hello, world! 12345 678",
    "don't you're I'LL we've",
    "\U0001F999\U0001F44D\U0001F3FD emoji",
    "\U0001F468\u200d\U0001F469\u200d\U0001F467 family",
    "\u4f60\u597d\uff0c\u4e16\u754c",
    "\u3053\u3093\u306b\u3061\u306f\u4e16\u754c",
    "e\u0301 a\u0308 n\u0303",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "nbsp\u00a0here and\u3000ideographic",
    "\u2581already\u2581metaspace",
    "<s>hello</s> world",
    "Hello<|endoftext|>world",
    "<unk> <0x41>",
    "x" * 300,
    "!!!???...,,,;;;",
    "\u00e9t\u00e9 caf\u00e9 na\u00efve",
]

TOKENIZERS = ["llama2-tokenizer", "gpt2-tokenizer", "stories260K-hf"]


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    ap.add_argument("--data", default=os.path.join(root, "..", "shared", "data"))
    ap.add_argument("--out", default=os.path.join(root, "tests", "fixtures", "tokenizer-hard-cases.json"))
    a = ap.parse_args()
    cases = []
    for name in TOKENIZERS:
        tok = Tokenizer.from_file(os.path.join(a.data, name, "tokenizer.json"))
        for text in TEXTS:
            ids = tok.encode(text, add_special_tokens=False).ids
            ids_sp = tok.encode(text, add_special_tokens=True).ids
            cases.append({
                "tokenizer": name,
                "text": text,
                "ids": ids,
                "ids_special": ids_sp,
                "decoded": tok.decode(ids_sp, skip_special_tokens=False),
                "decoded_skip": tok.decode(ids_sp, skip_special_tokens=True),
            })
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump({"generator": "tests/ref/tokenizer_ref.py", "tokenizers_version": tokenizers.__version__,
                   "cases": cases}, f, ensure_ascii=True, indent=0)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {a.out}")


if __name__ == "__main__":
    main()

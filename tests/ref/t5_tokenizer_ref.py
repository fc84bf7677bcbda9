#!/usr/bin/env python3
"""T5-style SentencePiece Unigram tokenizer fixture and test vectors (issue 31).

Trains a small Unigram model with sentencepiece on ../shared/data/text (T5's special-id layout:
pad 0, eos 1, unk 2, no bos), with a small custom normalization rule table (so the precompiled
charsmap -- the same darts-clone trie + string blob as T5's nmt_nfkc, only smaller -- is
exercised while the fixture stays small), converts it with transformers' T5Tokenizer (100
extra_ids, tokenizer.json with Precompiled + WhitespaceSplit + Metaspace + TemplateProcessing),
and writes test vectors from BOTH sentencepiece and HF tokenizers:

  tests/fixtures/t5-tok/{spiece.model, tokenizer.json, tokenizer_config.json, config.json}
  tests/fixtures/t5-tok-vectors.json   [{text, sp_ids, sp_decode, hf_ids, hf_decode}, ...]

sp_ids: SentencePieceProcessor.encode(text) (no EOS); hf_ids: T5Tokenizer(text).input_ids (EOS
appended); hf_decode: decode(hf_ids, skip_special_tokens=True); sp_decode: sp.decode(sp_ids).

Pinned: sentencepiece==0.2.3 tokenizers==0.23.3 transformers==5.23.0 (venv /work/venv-graph).
    /work/venv-graph/bin/python tests/ref/t5_tokenizer_ref.py [--data ../shared/data]
"""
import argparse
import json
import os
import random
import shutil
import tempfile

import sentencepiece as spm
import tokenizers
import transformers
from transformers import T5Tokenizer

assert spm.__version__ == "0.2.3", spm.__version__
assert tokenizers.__version__ == "0.23.3", tokenizers.__version__
assert transformers.__version__ == "5.23.0", transformers.__version__

# Normalization rules (source chars -> normalized chars): whitespace kinds, a ligature, a
# multi-char source (e + combining acute -> e-acute, longest match), fullwidth letters.
RULES = [
    ("\t", " "), ("\n", " "), ("\r", " "), ("\u00a0", " "), ("\u3000", " "),
    ("\ufb01", "fi"), ("\u2122", "TM"), ("\u2460", "1"), ("e\u0301", "\u00e9"),
    ("\uff21", "A"), ("\uff41", "a"), ("\u2026", "..."), ("\u00bd", "1/2"), ("\u24be", "I"),
]

FIXED = [
    "", " ", "  ", "   ", "a", "A", "hello", "Hello world", "Hello  world", "  leading", "trailing  ",
    "   both   ", "a  b   c    d", "x\ty\tz", "line one\r\nline two\n", "\n\n\n", "\t", "\u00a0",
    "nbsp\u00a0here and\u3000ideographic", "The year 1984 and 3.14159 and 42!", "0123456789",
    "don't you're I'LL we've", "!!!???...,,,;;;", "caf\u00e9 na\u00efve \u00e9t\u00e9", "cafe\u0301",
    "e\u0301e\u0301e\u0301", "\ufb01ne \ufb01sh", "Trade\u2122 mark", "\u2460 first", "\uff21\uff41 fullwidth",
    "wait\u2026 what", "\u00bd cup", "\u4f60\u597d\uff0c\u4e16\u754c", "\u3053\u3093\u306b\u3061\u306f",
    "\U0001F999 emoji \U0001F44D\U0001F3FD", "\U0001F468\u200d\U0001F469\u200d\U0001F467 family",
    "\u0645\u0631\u062d\u0628\u0627", "\u2581already\u2581metaspace", "\u2581", "\u2581\u2581 x",
    "<extra_id_0>", "<extra_id_0> hello <extra_id_1>", "The <extra_id_0> walks in <extra_id_1> park",
    "x<extra_id_99>y", "<extra_id_5><extra_id_6>", "<extra_id_100>", "<extra_id_>", "</s>", "a</s>b",
    "<pad> <unk>", "<s>hello", "~`@#$%^&*()_+-={}[]|\\:\";'<>?,./", "ALL CAPS SHOUTING", "MiXeD CaSe",
    "Spot saw the shiny car.", "First Citizen: Before we proceed any further, hear me speak.",
    "x" * 200, "ab" * 60, "the " * 30, "\u00e9" * 20, "Q", "qqqq", "zzz", "Zebra",
    "He said, \"Wow!\"", "it's 5 o'clock", "e-mail: someone@example.com", "http://example.com/a?b=c",
    "tab\there", "\u200b zero width", "\ufeffbom", "\u00c5ngstr\u00f6m", "\u0130stanbul",
    # grapheme clusters where HF's Precompiled (by cluster, shortest prefix) and sentencepiece
    # (longest match per position) differ: a short cluster whose first char maps loses its marks
    "\u24be\u031d", "x\u24be\u0301y", "e\u0301\u0302", "\u24be\u0301\u0302", "ae\u0301\u0302b \u24be\u24be\u0301",
    "\u1100\u1161\u11a8 hangul jamo", "\r\n", "a\r\nb", "\U0001F1EF\U0001F1F5 flag",
]


def random_texts(words, rng, n):
    extras = ["\u00e9", "\u4f60", "\U0001F600", "\u00a0", "\t", "\n", "  ", "   ", "<extra_id_3>", "e\u0301",
              "\ufb01", "\u2026", "123", "4.5", "!", "?", "\u00bd", "\uff21", "\u0416", "\u2581"]
    out = []
    for _ in range(n):
        k = rng.randint(1, 12)
        parts = []
        for _ in range(k):
            r = rng.random()
            if r < 0.7: parts.append(rng.choice(words))
            else: parts.append(rng.choice(extras))
        seps = [rng.choice([" ", " ", " ", "", "  "]) for _ in parts]
        s = "".join(p + q for p, q in zip(parts, seps))
        if rng.random() < 0.2: s = " " + s
        out.append(s)
    return out


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    ap.add_argument("--data", default=os.path.join(root, "..", "shared", "data"))
    ap.add_argument("--out", default=os.path.join(root, "tests", "fixtures"))
    a = ap.parse_args()
    tmp = tempfile.mkdtemp()
    corpus = os.path.join(tmp, "train.txt")
    with open(os.path.join(a.data, "text", "tinyshakespeare.txt"), encoding="utf-8") as f: text = f.read()[:150000]
    with open(os.path.join(a.data, "text", "tinystories-val-prefix.txt"), encoding="utf-8") as f: text += f.read()[:150000]
    with open(corpus, "w", encoding="utf-8") as f: f.write(text)
    rules = os.path.join(tmp, "rules.tsv")
    with open(rules, "w") as f:
        for k, v in RULES:
            f.write("%s\t%s\n" % (" ".join("%X" % ord(c) for c in k), " ".join("%X" % ord(c) for c in v)))
    spm.SentencePieceTrainer.train(input=corpus, model_prefix=os.path.join(tmp, "m"), vocab_size=400,
                                   model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   normalization_rule_tsv=rules, num_threads=1, minloglevel=2)
    folder = os.path.join(a.out, "t5-tok")
    shutil.rmtree(folder, ignore_errors=True)
    src = os.path.join(tmp, "src")
    os.makedirs(src)
    shutil.copy(os.path.join(tmp, "m.model"), os.path.join(src, "spiece.model"))
    hf = T5Tokenizer.from_pretrained(src)
    hf.save_pretrained(folder)
    shutil.copy(os.path.join(tmp, "m.model"), os.path.join(folder, "spiece.model"))
    with open(os.path.join(folder, "config.json"), "w") as f:  # the ids a T5 config.json carries
        json.dump({"model_type": "t5", "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0}, f, indent=1)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(folder, "spiece.model"))

    words = sorted(set(text.split()))
    rng = random.Random(31)
    texts = FIXED + random_texts(words, rng, 120) + rng.sample([l for l in text.split("\n") if l.strip()], 60)
    cases, diff = [], 0
    for t in texts:
        sp_ids = sp.encode(t)
        hf_ids = hf(t).input_ids
        # sp_hf_same: sentencepiece's ids + EOS equal HF's (texts without special tokens; they differ on
        # a literal U+2581 and on the grapheme clusters above)
        plain = "<extra_id_" not in t and "</s>" not in t and "<pad>" not in t and "<unk>" not in t
        c = {"text": t, "sp_ids": sp_ids, "sp_decode": sp.decode(sp_ids), "hf_ids": hf_ids,
             "hf_decode": hf.decode(hf_ids, skip_special_tokens=True), "sp_hf_same": plain and sp_ids + [1] == hf_ids}
        if plain and sp_ids + [1] != hf_ids:
            diff += 1
            print("sp != hf:", repr(t), sp_ids, hf_ids)
        cases.append(c)
    with open(os.path.join(a.out, "t5-tok-vectors.json"), "w", encoding="utf-8") as f:
        json.dump({"versions": {"sentencepiece": spm.__version__, "tokenizers": tokenizers.__version__,
                                "transformers": transformers.__version__}, "cases": cases}, f, ensure_ascii=False)
    print("%d cases, %d where sentencepiece and HF disagree" % (len(cases), diff))
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()

"""Shared helper for the reference scripts (tiny_gpt2_ref.py, stories_ref.py)."""
import json
import os

import torch
import torch.nn.functional as F
import transformers


def pick_tokens(model_dir, text, n, bos=None, vocab_limit=None):
    """Encode `text` with the folder's tokenizer (tokenizer.json) and take n ids.
    Falls back to nothing clever: raises if the text is too short."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids
    if bos is not None:
        ids = [bos] + ids
    if len(ids) < n:
        raise SystemExit(f"text encodes to {len(ids)} < {n} tokens")
    ids = ids[:n]
    if vocab_limit is not None:
        assert all(0 <= i < vocab_limit for i in ids), ids
    return ids


@torch.no_grad()
def reference(model, tokens, out_path, extra):
    model.eval()
    ids = torch.tensor([tokens], dtype=torch.long)
    logits = model(input_ids=ids).logits[0].float()  # (T, V)
    loss = F.cross_entropy(logits[:-1], ids[0, 1:])
    # float64 cross-check of the same computation (informative)
    m64 = model.double()
    loss64 = F.cross_entropy(m64(input_ids=ids).logits[0][:-1], ids[0, 1:]).item()
    model.float()
    res = {
        "tokens": tokens,
        "loss": loss.item(),
        "loss_f64": loss64,
        "logits_first_row": [float(x) for x in logits[0, :8]],
        "logits_last_row": [float(x) for x in logits[-1, :8]],
        "argmax_last": int(logits[-1].argmax()),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    res.update(extra)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    print(json.dumps(res))

#!/usr/bin/env python3
"""Convert a Hugging Face `datasets` save_to_disk folder (an image column and a text column) into
an image folder fitllm reads: the images as files plus captions.jsonl ({"file_name", "text"}).

    python tools/hf_to_captions.py SAVED_DIR OUT_DIR [--image-column image] [--text-column text] [--split train]

Run it with your own Python (needs `datasets`; images stored as {bytes, path} are written as they
are, byte for byte, so fitllm decodes the same JPEG/PNG data PIL would). The same as a one-liner:

    python -c "import datasets,json,os,sys; d=datasets.load_from_disk(sys.argv[1]).cast_column('image',datasets.Image(decode=False)); os.makedirs(sys.argv[2],exist_ok=True); f=open(os.path.join(sys.argv[2],'captions.jsonl'),'w'); [(open(os.path.join(sys.argv[2],'%06d%s'%(i,os.path.splitext(r['image']['path'] or '.png')[1] or '.png')),'wb').write(r['image']['bytes']), f.write(json.dumps({'file_name':'%06d%s'%(i,os.path.splitext(r['image']['path'] or '.png')[1] or '.png'),'text':r['text']})+'\\n')) for i,r in enumerate(d)]" SAVED_DIR OUT_DIR

(for a DatasetDict folder, add ["train"] after load_from_disk(...)). Checked with datasets 5.2.0 /
pyarrow 26.0.1: a DatasetDict of a JPEG and a PNG converts to the same bytes and captions either way.
"""
import argparse
import json
import os


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("saved_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--image-column", default="image")
    ap.add_argument("--text-column", default="text")
    ap.add_argument("--split", default="train", help="the split of a DatasetDict folder (default train)")
    a = ap.parse_args()
    import datasets
    d = datasets.load_from_disk(a.saved_dir)
    if isinstance(d, datasets.DatasetDict):
        d = d[a.split]
    d = d.cast_column(a.image_column, datasets.Image(decode=False))
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, "captions.jsonl"), "w") as f:
        for i, r in enumerate(d):
            im = r[a.image_column]
            if not im or im.get("bytes") is None:
                raise SystemExit(f"row {i}: no image bytes in column {a.image_column!r}")
            ext = os.path.splitext(im.get("path") or "")[1].lower() or ".png"
            name = "%06d%s" % (i, ext)
            with open(os.path.join(a.out_dir, name), "wb") as g:
                g.write(im["bytes"])
            text = r[a.text_column]
            if not isinstance(text, str):
                raise SystemExit(f"row {i}: column {a.text_column!r} is not a string")
            f.write(json.dumps({"file_name": name, "text": text}) + "\n")
    print(f"wrote {len(d)} images and captions.jsonl to {a.out_dir}")


if __name__ == "__main__":
    main()

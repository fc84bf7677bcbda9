#!/usr/bin/env python3
"""Test images and the BLIP image processor's reference outputs (issue 32 item 2).

Makes a dozen small images (tests/fixtures/images/*.jpg|png: varied and odd sizes, up- and
down-scaling to the test size, grayscale, palette, RGBA, LA, tRNS, 16-bit RGB, interlaced PNG,
progressive JPEG, 4:4:4 and 4:2:0 JPEG), a few bad ones (CMYK JPEG, 16-bit grayscale PNG), a
preprocessor_config.json with a small size, and for each good image three raw files:
  NAME.rgb  the decoded RGB image as transformers' convert_to_rgb returns it (uint8 HWC)
  NAME.rs   that image resized by PIL (Image.resize(..., BICUBIC), what the PIL backend runs) (uint8 HWC)
  NAME.pv   BlipImageProcessorPil(...)(image)["pixel_values"][0] (float32 CHW, little-endian)
The C test (tests/test_image.c) checks its decoder, its resize and its pixel_values against them.

    /work/venv-graph/bin/python tests/ref/image_ref.py
Pinned: transformers==5.23.0, pillow==13.0.0 (bundling libjpeg-turbo 3.x), numpy==2.4.6.
"""
import io
import json
import os

import numpy as np
import PIL
from PIL import Image
import transformers
from transformers.image_transforms import convert_to_rgb
from transformers.models.blip.image_processing_pil_blip import BlipImageProcessorPil

assert transformers.__version__ == "5.23.0", transformers.__version__
assert PIL.__version__ == "13.0.0", PIL.__version__

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "images")
H, W = 30, 40   # the test processor's size (height, width)
rng = np.random.default_rng(32)


def picture(h, w, ch=3):
    """Smooth gradients plus noise: JPEG has real work, resizing has edges."""
    y, x = np.mgrid[0:h, 0:w]
    base = [(x * 255 / max(w - 1, 1)), (y * 255 / max(h - 1, 1)), ((x + y) * 7 % 256)]
    a = np.stack([base[i % 3] for i in range(ch)], -1).astype(np.float64)
    a += rng.normal(0, 30, a.shape)
    a[h // 3:h // 2, w // 4:w // 2] = 255 - a[h // 3:h // 2, w // 4:w // 2]   # a sharp block
    return np.clip(a, 0, 255).astype(np.uint8)


def save(name, im, **kw):
    path = os.path.join(OUT, name)
    im.save(path, **kw)
    assert os.path.getsize(path) < 20000, (name, os.path.getsize(path))
    return path


def main():
    os.makedirs(OUT, exist_ok=True)
    good = []
    good.append(save("rgb420_97x61.jpg", Image.fromarray(picture(61, 97)), quality=85))
    good.append(save("prog_50x33.jpg", Image.fromarray(picture(33, 50)), quality=90, progressive=True))
    good.append(save("gray_23x17.jpg", Image.fromarray(picture(17, 23, 1)[..., 0], "L"), quality=80))
    good.append(save("rgb444_41x29.jpg", Image.fromarray(picture(29, 41)), quality=92, subsampling=0))
    good.append(save("rgb422_128x96.jpg", Image.fromarray(picture(96, 128)), quality=60, subsampling=1))
    good.append(save("rgb_13x7.png", Image.fromarray(picture(7, 13))))
    good.append(save("gray_80x75.png", Image.fromarray(picture(75, 80, 1)[..., 0], "L")))
    good.append(save("palette_45x31.png", Image.fromarray(picture(31, 45)).quantize(37)))
    rgba = picture(53, 37, 4)
    rgba[:5, :, 3] = 0
    rgba[5:9, :, 3] = 255
    good.append(save("rgba_37x53.png", Image.fromarray(rgba, "RGBA")))
    good.append(save("la_19x21.png", Image.fromarray(picture(21, 19, 2), "LA")))
    pal = Image.fromarray(picture(16, 24)).quantize(9)
    good.append(save("palette_trns_24x16.png", pal, transparency=bytes([0, 128, 255, 40])))
    p16 = picture(12, 20).astype(np.uint16) * 257 + rng.integers(0, 256, (12, 20, 3)).astype(np.uint16)
    # PIL cannot write 16-bit RGB: write it with a minimal PNG writer (zlib, filter 0)
    good.append(write_png16_rgb("rgb16_20x12.png", p16))
    good.append(write_interlaced("interlaced_33x9.png", picture(9, 33)))
    good.append(save("one_1x1.png", Image.fromarray(picture(1, 1))))
    # bad inputs
    save("bad_cmyk_8x8.jpg", Image.fromarray(picture(8, 8, 4), "CMYK"))
    save("bad_gray16_8x8.png", Image.fromarray(picture(8, 8, 1)[..., 0].astype(np.uint16) * 257))

    proc_cfg = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
                "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_processor_type": "BlipImageProcessor",
                "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3,
                "rescale_factor": 0.00392156862745098, "size": {"height": H, "width": W}}
    with open(os.path.join(OUT, "preprocessor_config.json"), "w") as f:
        json.dump(proc_cfg, f, indent=2)
    proc = BlipImageProcessorPil(**{k: v for k, v in proc_cfg.items() if k != "image_processor_type"})
    for path in good:
        im = Image.open(path)
        rgb = convert_to_rgb(im, return_numpy=True)
        rs = np.array(Image.fromarray(rgb).resize((W, H), Image.Resampling.BICUBIC))
        pv = proc(Image.open(path), return_tensors="np")["pixel_values"][0]
        assert pv.dtype == np.float32 and pv.shape == (3, H, W), (pv.dtype, pv.shape)
        # the chain HF runs: rescale in float64 then float32, normalize in float32
        mine = ((rs.astype(np.float64) * proc_cfg["rescale_factor"]).astype(np.float32)
                - np.array(proc_cfg["image_mean"], np.float32)) / np.array(proc_cfg["image_std"], np.float32)
        assert np.array_equal(mine.transpose(2, 0, 1), pv), path
        base = os.path.splitext(path)[0]
        rgb.astype(np.uint8).tofile(base + ".rgb")
        rs.astype(np.uint8).tofile(base + ".rs")
        pv.astype("<f4").tofile(base + ".pv")
        print(os.path.basename(path), im.mode, im.size, "->", pv.shape)


def chunk(tag, data):
    import struct
    import zlib
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xffffffff)


def write_png16_rgb(name, a):
    import struct
    import zlib
    h, w, _ = a.shape
    raw = b"".join(b"\0" + a[y].astype(">u2").tobytes() for y in range(h))
    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    path = os.path.join(OUT, name)
    open(path, "wb").write(data)
    assert Image.open(path).mode == "RGB"
    return path


def write_interlaced(name, a):
    """An Adam7-interlaced 8-bit RGB PNG (PIL writes no interlaced PNG)."""
    import struct
    import zlib
    h, w, _ = a.shape
    passes = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)]
    raw = b""
    for x0, y0, dx, dy in passes:
        sub = a[y0::dy, x0::dx]
        if sub.size == 0:
            continue
        raw += b"".join(b"\0" + sub[y].tobytes() for y in range(sub.shape[0]))
    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 1))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    path = os.path.join(OUT, name)
    open(path, "wb").write(data)
    assert np.array_equal(np.array(Image.open(path)), a)
    return path


if __name__ == "__main__":
    main()

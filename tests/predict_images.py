#!/usr/bin/env python3
"""Digit images for tests/e2e_model_use.sh, written and checked without our C++ (numpy and zlib only).

    predict_images.py make DATA_DIR LOGITS.npy OUT_DIR     # images + OUT_DIR/manifest.txt
    predict_images.py verify OUT_DIR PREDICT.json LOGITS.npy

make: for each label, the first MNIST test image that the model gets right (LOGITS.npy from
`mnist_mpi evaluate --logits-file`) is written as
  wb_*.png   8-bit grey PNG, white on black, 28x28 (as MNIST)
  bw_*.png   8-bit RGB PNG, black on white (the inverted case)
  p16_*.pgm  16-bit binary PGM, white on black
  big_*.png  a 200x300 (width x height) RGBA PNG on a transparent canvas, black ink: the digit
             scaled 6x (bilinear) to 168x168 and put off centre, as a drawing program would save it
manifest.txt: one line per image: file label test_index identity, where identity = 1 when MNIST's
own preprocessing leaves the image as it is (longer side of its box 20, brightest pixel 255,
centre of mass within half a pixel of (14, 14)): then predict must give exactly the model's
softmax of LOGITS.npy for it, up to float rounding.
verify: every image is classified as its label; every identity image's probabilities match.
"""
import json
import os
import struct
import sys
import zlib

import numpy as np


def png(path, pixels, colour_type, depth=8):
    """pixels: (H, W) or (H, W, channels) uint8 / uint16. colour_type: 0 grey, 2 RGB, 6 RGBA."""
    a = np.asarray(pixels)
    h, w = a.shape[:2]
    rows = a.reshape(h, -1).astype(">u2" if depth == 16 else np.uint8).tobytes()
    stride = len(rows) // h
    raw = b"".join(b"\x00" + rows[y * stride:(y + 1) * stride] for y in range(h))  # filter 0 (None)

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xffffffff)

    ihdr = struct.pack(">IIBBBBB", w, h, depth, colour_type, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def pgm16(path, pixels):
    a = np.asarray(pixels, dtype=">u2")
    with open(path, "wb") as f:
        f.write(b"P5\n# written by tests/predict_images.py\n%d %d\n65535\n" % (a.shape[1], a.shape[0]) + a.tobytes())


def bilinear(img, factor):  # pixel centres aligned, as predict's own upscaling (but numpy's code)
    h, w = img.shape
    ys = np.clip((np.arange(h * factor) + 0.5) / factor - 0.5, 0, h - 1)
    xs = np.clip((np.arange(w * factor) + 0.5) / factor - 0.5, 0, w - 1)
    y0, x0 = np.floor(ys).astype(int), np.floor(xs).astype(int)
    y1, x1 = np.minimum(y0 + 1, h - 1), np.minimum(x0 + 1, w - 1)
    fy, fx = (ys - y0)[:, None], (xs - x0)[None, :]
    f = img.astype(np.float64)
    top = f[y0][:, x0] * (1 - fx) + f[y0][:, x1] * fx
    bottom = f[y1][:, x0] * (1 - fx) + f[y1][:, x1] * fx
    return top * (1 - fy) + bottom * fy


def identity(img):
    nz = img > 0
    rows, cols = np.where(nz.any(1))[0], np.where(nz.any(0))[0]
    longer = max(rows[-1] - rows[0] + 1, cols[-1] - cols[0] + 1)
    f = img.astype(np.float64)
    ys, xs = np.mgrid[0:28, 0:28]
    cy, cx = (f * ys).sum() / f.sum(), (f * xs).sum() / f.sum()
    return int(longer == 20 and img.max() == 255 and abs(cy - 14) < 0.5 and abs(cx - 14) < 0.5)


def make(data_dir, logits_path, out):
    raw = open(os.path.join(data_dir, "t10k-images-idx3-ubyte"), "rb").read()
    images = np.frombuffer(raw, np.uint8, offset=16).reshape(-1, 28, 28)
    labels = np.frombuffer(open(os.path.join(data_dir, "t10k-labels-idx1-ubyte"), "rb").read(), np.uint8, offset=8)
    right = np.load(logits_path).argmax(1) == labels
    os.makedirs(out, exist_ok=True)
    lines = []
    for label in range(10):
        i = int(np.where(right & (labels == label))[0][0])
        img = images[i]
        ident = identity(img)
        png(f"{out}/wb_{label}.png", img, 0)
        png(f"{out}/bw_{label}.png", np.repeat((255 - img)[:, :, None], 3, axis=2), 2)
        pgm16(f"{out}/p16_{label}.pgm", img.astype(np.uint32) * 257)
        ink = np.clip(np.rint(bilinear(img, 6)), 0, 255).astype(np.uint8)  # (168, 168)
        canvas = np.zeros((300, 200, 4), np.uint8)  # transparent black
        canvas[100:268, 12:180, 3] = ink  # black ink: colour 0, coverage in alpha
        png(f"{out}/big_{label}.png", canvas, 6)
        for name in (f"wb_{label}.png", f"bw_{label}.png", f"p16_{label}.pgm"):
            lines.append(f"{name} {label} {i} {ident}")
        lines.append(f"big_{label}.png {label} {i} 0")
    with open(f"{out}/manifest.txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"predict_images: {len(lines)} images of test digits "
          f"{[l.split()[2] for l in lines[::4]]} in {out}")


def verify(out, predict_json, logits_path):
    logits = np.load(logits_path).astype(np.float64)
    doc = json.load(open(predict_json))
    got = {os.path.basename(e["file"]): e for e in doc["images"]}
    bad, checked, worst = 0, 0, 0.0
    for line in open(f"{out}/manifest.txt"):
        name, label, index, ident = line.split()
        e = got.get(name)
        if e is None or "digit" not in e:
            print(f"FAIL {name}: not classified ({e})")
            bad += 1
            continue
        if e["digit"] != int(label):
            print(f"FAIL {name}: predicted {e['digit']} ({e['probability']:.4f}), label {label}; top3 {e['top3']}")
            bad += 1
        if ident == "1":
            z = logits[int(index)] - logits[int(index)].max()
            p = np.exp(z) / np.exp(z).sum()
            diff = np.abs(np.array(e["probabilities"]) - p).max()
            worst = max(worst, diff)
            checked += 1
            if diff > 1e-5:
                print(f"FAIL {name}: probabilities differ from softmax(evaluate's logits) by {diff:.3g}")
                bad += 1
    if checked == 0:
        print("FAIL: no image of the sample is unchanged by the preprocessing; the exact comparison did not run")
        bad += 1
    print(f"predict_images: {len(got)} classified, {bad} failures; {checked} unchanged-by-preprocessing images "
          f"match evaluate's softmax to {worst:.3g}")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "make":
        make(*sys.argv[2:])
    elif len(sys.argv) == 5 and sys.argv[1] == "verify":
        sys.exit(verify(*sys.argv[2:]))
    else:
        sys.exit(__doc__)

"""The peer: ONNX Runtime from Python on the same ONNX graph and images, with PIL + numpy
preprocessing equivalent to Kestrel's spec (shorter side 256 bilinear, centre crop 224,
(x/255 - mean)/std). Prints one JSON line like `trainer bench --json`."""
import argparse, glob, json, os, time

import numpy as np
import onnxruntime as ort
from PIL import Image


def preprocess(path, mean, std):
    img = Image.open(path).convert("RGB")
    w, h = img.size
    k = 256 / min(w, h)
    img = img.resize((max(224, round(w * k)), max(224, round(h * k))), Image.BILINEAR)
    w, h = img.size
    x0, y0 = (w - 224) // 2, (h - 224) // 2
    a = np.asarray(img.crop((x0, y0, x0 + 224, y0 + 224)), dtype=np.float32) / 255.0
    return ((a - mean) / std).transpose(2, 0, 1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mean", type=float, nargs=3, default=[0.5, 0.5, 0.5])
    p.add_argument("--std", type=float, nargs=3, default=[0.5, 0.5, 0.5])
    p.add_argument("--latency", action="store_true",
                   help="batch-1 inference time of the first image (preprocessed once), in ms")
    p.add_argument("--all", action="store_true",
                   help="process every image once in batches (extraction time) instead of timed rounds")
    p.add_argument("images", nargs="+", help="image files, or directories searched recursively for *.png and *.jpg")
    a = p.parse_args()
    files = []
    for x in a.images:
        files += sorted(f for e in ("png", "jpg") for f in glob.glob(os.path.join(x, "**", "*." + e), recursive=True)) \
            if os.path.isdir(x) else [x]
    a.images = files
    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(a.model, so, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    paths = [a.images[i % len(a.images)] for i in range(a.batch)]
    mean = np.array(a.mean, dtype=np.float32)
    std = np.array(a.std, dtype=np.float32)

    def once():
        x = np.stack([preprocess(q, mean, std) for q in paths])
        sess.run(None, {name: x})

    if a.latency:
        x = preprocess(a.images[0], mean, std)[None]
        sess.run(None, {name: x})
        t = time.perf_counter()
        for _ in range(a.rounds):
            sess.run(None, {name: x})
        ms = (time.perf_counter() - t) * 1000 / a.rounds
        print(json.dumps({"engine": "python-ort", "ms": ms, "ort_version": ort.__version__}))
        return
    if a.all:
        t = time.perf_counter()
        for i in range(0, len(a.images), a.batch):
            x = np.stack([preprocess(q, mean, std) for q in a.images[i:i + a.batch]])
            sess.run(None, {name: x})
        s = time.perf_counter() - t
        print(json.dumps({"engine": "python-ort", "images": len(a.images), "seconds": s,
                          "images_per_s": len(a.images) / s, "ort_version": ort.__version__}))
        return
    once()
    t = time.perf_counter()
    for _ in range(a.rounds):
        once()
    s = time.perf_counter() - t
    n = a.rounds * a.batch
    print(json.dumps({"engine": "python-ort", "batch": a.batch, "threads": a.threads, "images": n,
                      "seconds": s, "images_per_s": n / s, "ort_version": ort.__version__}))


if __name__ == "__main__":
    main()

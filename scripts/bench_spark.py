"""Bench rows for `kestrel.spark` (scripts/bench.sh runs it): Spark's overhead on feature
extraction and training, against the CLI on the same images.

- `kestrel.spark.features` on 2 executors (a standalone cluster on this machine, one core each)
  against `trainer prepare --workers 2 --threads 2` (fresh cache), on the same photos: first on
  fresh executors (their Python workers start and each loads the backbone: a fixed ~3 s), then
  on warm executors (a notebook's later cells: 5 calls after a second one, whose JVM is still
  warming up its Arrow path), each after a `trainer prepare` run, medians compared: the machine's
  speed drifts by more than the overhead measured, so the two sides take turns;
- `kestrel.spark.fit(num_workers=2)` against `trainer fit --workers 2`, on the same staged table,
  and `KestrelClassifier(numWorkers=2).fit(df)` (staging, barrier fit, export on the driver)
  against `trainer fit --workers 2` plus `trainer export`: 3 rounds taking turns, medians;
- `kestrel.fit` (the Python API, in-process) against `trainer fit`, taking turns, 5 each.

    python scripts/bench_spark.py PHOTO_DIR   # an ImageFolder (scripts/camera_photos.py writes one)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python" / "tests"))
from cluster import BIN, session, standalone  # noqa: E402

ROUNDS = 5  # warm features calls, each beside a `trainer prepare`
FIT_ROUNDS = 5  # `kestrel.fit` beside `trainer fit`
SPARK_ROUNDS = 3  # `kestrel.spark.fit` and the estimator beside `trainer fit` (and export)


def timed(f):
    start = time.perf_counter()
    out = f()
    return out, time.perf_counter() - start


def trainer(*args: str) -> str:
    r = subprocess.run([str(BIN / "trainer"), *args], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        sys.exit(f"trainer {' '.join(args)}: {r.stderr}")
    return r.stdout


def row(what: str, kestrel_s: float, peer: str, peer_s: float) -> None:
    print(f"{what:<44}{kestrel_s:>9.2f} s  {peer:<34}{peer_s:>9.2f} s  {kestrel_s / peer_s:>6.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("photos", type=Path)
    args = ap.parse_args()
    import kestrel
    import kestrel.spark as ks
    from pyspark.sql import functions as F

    work = Path(tempfile.mkdtemp(prefix="kestrel-bench-spark-"))
    n = sum(1 for p in args.photos.rglob("*") if p.is_file())
    def prepare(i: int) -> float:
        return timed(lambda: trainer("prepare", "--data", str(args.photos), "--workers", "2", "--threads", "2",
                                     "--engine", "tract", "--cache", str(work / f"cache-{i}"), "--json"))[1]

    def cli_fit(i):
        return timed(lambda: json.loads(trainer("fit", "--data", str(work / "staged"), "--workers", "2", "--out",
                                                str(work / f"run-cli-{i}"), "--cache", str(work / f"cache-cli-{i}"),
                                                "--no-mlflow", "--json")))

    with standalone(2) as (master, _):
        spark = session(master, 2, app="kestrel-bench")
        df = (
            spark.read.format("binaryFile").option("recursiveFileLookup", "true")
            .load(str(args.photos))
            .withColumn("label", F.element_at(F.split("path", "/"), -2))
            .repartition(4)
        )
        df.cache().count()  # the files read once, outside the timed part

        def features():
            return ks.features(df, engine="tract").select("path", "features").count()

        # First on fresh executors (Spark starts their Python workers, each loads the backbone),
        # then again, as a notebook's later cells find them.
        rows, cold_s = timed(features)
        assert rows == n, (rows, n)
        _, again_s = timed(features)
        # This machine's speed drifts by more than the overhead measured: the CLI and Spark take
        # turns, and each side's median is compared.
        pairs = [(prepare(i), timed(features)[1]) for i in range(ROUNDS)]
        prep_s = statistics.median(p for p, _ in pairs)
        feat_s = statistics.median(f for _, f in pairs)
        staged = str(work / "staged")
        ks.stage(df, staged)
        from kestrel.spark.ml import KestrelClassifier

        # Each round: the CLI's fit (and export), `kestrel.spark.fit` on the same staged table, and
        # the Spark ML estimator on the DataFrame (staging, a barrier fit, the export on the
        # driver); medians compared, as above.
        fits = []
        for i in range(SPARK_ROUNDS):
            cli = cli_fit(f"s{i}")
            _, export_s = timed(lambda: trainer("export", "--run", str(work / f"run-cli-s{i}"), "--out",
                                                str(work / f"art-cli-{i}"), "--no-mlflow", "--json"))
            spark_out, sfit_s = timed(
                lambda: ks.fit(staged, out=str(work / f"run-spark-{i}"), num_workers=2, no_mlflow=True,
                               cache=str(work / f"cache-spark-{i}"))
            )
            _, ml_s = timed(
                lambda: KestrelClassifier(outputDir=str(work / f"ml-{i}"), numWorkers=2,
                                          trainerArgs=["--cache", str(work / f"cache-ml-{i}")]).fit(df)
            )
            fits.append((cli[1], export_s, sfit_s, ml_s))
        spark.stop()
    cfit_spark_s = statistics.median(f[0] for f in fits)
    cfit_export_s = statistics.median(f[0] + f[1] for f in fits)
    sfit_s = statistics.median(f[2] for f in fits)
    ml_s = statistics.median(f[3] for f in fits)

    def py_fit(i: int):
        return timed(lambda: kestrel.fit(staged, out=str(work / f"run-py-{i}"), workers=2, no_mlflow=True,
                                         cache=str(work / f"cache-py-{i}")))

    pairs = [(cli_fit(i), py_fit(i)) for i in range(FIT_ROUNDS)]
    cli_fit_out, py_fit_out = pairs[0][0][0], pairs[0][1][0]
    cfit_s = statistics.median(c[1] for c, _ in pairs)
    pfit_s = statistics.median(p[1] for _, p in pairs)
    print(f"# kestrel.spark on a standalone cluster (2 workers, 1 core each) vs the CLI, {n} photos; "
          "fresh caches (each fit extracts its features)")
    print(f"{'kestrel':<44}{'':>11}  {'peer':<34}{'':>11}  {'ratio':>7}")
    row("kestrel.spark.features, fresh executors", cold_s, "trainer prepare --workers 2", prep_s)
    row("kestrel.spark.features, second call", again_s, "trainer prepare --workers 2", prep_s)
    row(f"kestrel.spark.features, warm (median of {ROUNDS})", feat_s, "trainer prepare --workers 2", prep_s)
    row(f"kestrel.spark.fit(num_workers=2), median of {SPARK_ROUNDS}", sfit_s, "trainer fit --workers 2", cfit_spark_s)
    row(f"kestrel.fit(workers=2), median of {FIT_ROUNDS}", pfit_s, "trainer fit --workers 2", cfit_s)
    row(f"KestrelClassifier(numWorkers=2).fit(df), median of {SPARK_ROUNDS}", ml_s, "trainer fit --workers 2 + export",
        cfit_export_s)
    print(f"val_loss: spark {spark_out['val_loss']:.6f}, python {py_fit_out['val_loss']:.6f}, "
          f"cli {cli_fit_out['val_loss']:.6f}")


if __name__ == "__main__":
    main()

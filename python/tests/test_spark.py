"""kestrel.spark on a real standalone cluster of two isolated workers (conftest.py), against the
trainer binary. What the executors open is under `shared`; the driver's own files (`tmp_path`)
reach them only through Spark."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import kestrel
from kestrel import KestrelError
from kestrel import spark as ks

from conftest import tasks_per_executor, trainer


def local(path: str) -> str:
    return path[len("file:"):] if path.startswith("file:") else path


def cached_features(summary: dict) -> dict:
    """`trainer prepare --json`'s feature cache, by sample id."""
    fdir = Path(summary["features_cache"])
    sdir = Path(summary["samples_cache"])
    ids = json.loads((sdir / "meta.json").read_text())["ids"]
    dims = json.loads((fdir / "meta.json").read_text())["dims"]
    data = np.fromfile(fdir / "features.f32", dtype="<f4").reshape(len(ids), int(np.prod(dims)))
    return dict(zip(ids, data))


def test_features_on_two_executors_equal_trainer_prepare(spark, lfw, lfw_dir, shared, tmp_path):
    before = tasks_per_executor(spark)
    stored = shared / "from-spark"
    rows = (
        ks.features(lfw, engine="tract", threads=1, cache=str(stored))
        .select("path", "features", "error")
        .collect()
    )
    after = tasks_per_executor(spark)
    assert len(rows) == 200 and all(r.error is None for r in rows)
    prepare = ("prepare", "--data", str(lfw_dir), "--engine", "tract", "--json", "--cache")
    expected = cached_features(json.loads(trainer(*prepare, str(tmp_path / "fresh"))))
    worst = max(
        float(np.abs(np.asarray(r.features, dtype=np.float32) - expected[local(r.path)]).max())
        for r in rows
    )
    print(f"features: max abs diff from trainer prepare {worst:e}")
    assert worst <= 1e-5, worst
    worked = [e for e in after if after[e] > before.get(e, 0)]
    assert len(worked) == 2, f"both executors ran tasks: before {before}, after {after}"
    # The tasks stored their rows as a feature cache: prepare with it runs no backbone and
    # reads the executors' rows.
    summary = json.loads(trainer(*prepare, str(stored)))
    assert summary["backbone_runs"] == 0, summary
    reused = cached_features(summary)
    assert all(
        np.array_equal(np.asarray(r.features, dtype=np.float32), reused[local(r.path)]) for r in rows
    )


def test_a_bad_row_names_itself_or_is_kept(spark, lfw):
    from pyspark.sql import Row

    bad = spark.createDataFrame(
        [Row(path="file:/nowhere/broken.png", modificationTime=None, length=9, content=b"not a png", label="face")],
        schema=lfw.schema,
    )
    mixed = lfw.limit(6).unionByName(bad)
    with pytest.raises(Exception, match="broken.png"):
        ks.features(mixed).collect()
    rows = {local(r.path): r for r in ks.features(mixed, on_error="keep").collect()}
    assert len(rows) == 7
    assert rows["/nowhere/broken.png"].features is None
    assert "broken.png" in rows["/nowhere/broken.png"].error
    assert sum(r.features is not None for r in rows.values()) == 6
    with pytest.raises(KestrelError, match="no column `content_bytes`"):
        ks.features(lfw, content="content_bytes")
    with pytest.raises(KestrelError, match="no column `species`"):
        ks.fit(lfw, out="/tmp/never", label="species", num_workers=2)


def test_fit_on_a_barrier_stage_equals_trainer_fit_workers(spark, lfw, shared, tmp_path):
    cache = str(shared / "cache")
    common = ["--engine", "tract", "--cache", cache, "--no-mlflow", "--epochs", "3",
              "--optimizer", "sgd", "--threads", "1"]
    staged = ks.stage(lfw, str(shared / "staged"))
    spark_run = ks.fit(
        staged, out=str(shared / "fit-spark"), num_workers=2, engine="tract",
        cache=cache, no_mlflow=True, epochs=3, optimizer="sgd", threads=1,
    )
    cli_run = json.loads(
        trainer("fit", "--data", staged, "--out", str(tmp_path / "cli"), "--workers", "2", *common, "--json")
    )
    print(f"val loss: spark {spark_run['val_loss']!r}, cli {cli_run['val_loss']!r}")
    assert abs(spark_run["val_loss"] - cli_run["val_loss"]) <= 1e-6
    assert spark_run["val_accuracy"] == cli_run["val_accuracy"]
    with pytest.raises(KestrelError, match="needs 3 task slots.*has 2"):
        ks.fit(staged, out=str(shared / "x"), num_workers=3)


def test_predict_gives_trainer_predicts_classes(spark, lfw, lfw_dir, tmp_path):
    run = tmp_path / "run"
    art = tmp_path / "art"
    kestrel.fit(str(lfw_dir), out=str(run), no_mlflow=True, cache=str(tmp_path / "cache"), engine="tract")
    kestrel.export(str(run), out=str(art), no_mlflow=True)
    out = tmp_path / "p.parquet"
    trainer("predict", "--model", str(art), "--data", str(lfw_dir), "--out", str(out))
    expected = {r["path"]: r["prediction"] for r in pq.read_table(out).to_pylist()}
    rows = ks.predict(lfw, str(art), k=2).collect()
    assert len(rows) == 200
    got = {local(r.path): r.prediction for r in rows}
    assert got == expected
    assert all(len(r.top) == 2 and r.top[0].label == r.prediction for r in rows)
    correct = sum(r.prediction == r.label for r in rows)
    assert correct >= 190, correct


def test_a_worker_killed_during_features_is_retried_with_the_same_result(spark, lfw):
    from pyspark import TaskContext

    def die_once(batches):
        ctx = TaskContext.get()
        for b in batches:
            yield b  # features runs on this batch, then
            if ctx.partitionId() == 0 and ctx.attemptNumber() == 0:
                os._exit(137)  # the Python worker dies in the middle of its task

    clean = {local(r.path): r.features for r in ks.features(lfw).collect()}
    killed = lfw.mapInArrow(die_once, lfw.schema)
    failed = sum(tasks_per_executor(spark, "failedTasks").values())
    again = {local(r.path): r.features for r in ks.features(killed).collect()}
    assert sum(tasks_per_executor(spark, "failedTasks").values()) > failed, "a task was killed"
    assert again == clean


def test_tune_spreads_its_trials_over_a_barrier_stage(spark, lfw, shared, monkeypatch):
    # The ranks find rank 0 through Spark's allGather here (the other tests: the driver's relay).
    monkeypatch.setenv("KESTREL_SPARK_RENDEZVOUS", "barrier")
    before = tasks_per_executor(spark)
    s = ks.tune(
        lfw, out=str(shared / "tune"), num_workers=2, trials=4, startup=2, engine="tract",
        cache=str(shared / "cache"), no_mlflow=True, threads=1,
    )
    after = tasks_per_executor(spark)
    assert sorted(t["trial"] for t in s["trials"]) == [0, 1, 2, 3]
    assert s["best"]["val_loss"] == min(t["val_loss"] for t in s["trials"])
    assert all(after[e] > before.get(e, 0) for e in after), (before, after)

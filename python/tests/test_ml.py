"""kestrel.spark.ml and what a cluster of several hosts asks of kestrel.spark, on the isolated
two-worker cluster of conftest.py: the executors have their own /tmp and Kestrel home and share
only `shared` with the driver."""

from __future__ import annotations

import os

import pytest

from kestrel import ConfigError, DataError, _native
from kestrel import spark as ks

from conftest import needs_isolation


def on_executors(spark, fn):
    """`fn()` on one task per slot of a barrier stage (so on every executor); the results."""
    n = ks.slots(spark)
    return spark.sparkContext.parallelize(range(n), n).barrier().mapPartitions(lambda _: [fn()]).collect()


@needs_isolation
def test_a_driver_local_location_is_refused_before_any_work(spark, lfw, tmp_path):
    with pytest.raises(ConfigError, match=r"out `.*` is the driver's alone: the executors at .*127\.0\.0\.1"):
        ks.fit(lfw, out=str(tmp_path / "run"), num_workers=2, no_mlflow=True)
    assert not (tmp_path / "run" / ks.STAGED).exists(), "nothing staged"
    with pytest.raises(ConfigError, match="cache"):
        ks.features(lfw, cache=str(tmp_path / "cache"))


def test_locations_name_one_place_for_spark_and_for_the_trainer():
    assert ks.locate("dbfs:/kestrel/runs") == ("dbfs:/kestrel/runs", "/dbfs/kestrel/runs")
    assert ks.locate("/dbfs/kestrel/runs") == ("dbfs:/kestrel/runs", "/dbfs/kestrel/runs")
    assert ks.locate("s3a://bucket/t") == ("s3a://bucket/t", "s3://bucket/t")
    assert ks.locate("abfss://c@a.dfs.core.windows.net/t")[1] == "abfss://c@a.dfs.core.windows.net/t"
    assert ks.locate("file:///shared/x") == ("file:/shared/x", "/shared/x")
    assert ks.locate("/Volumes/main/default/v") == ("file:/Volumes/main/default/v", "/Volumes/main/default/v")


@needs_isolation
def test_executors_provision_the_backbone_themselves(spark, lfw):
    driver_weights = _native.pretrained_path("efficientnet-lite0")

    def look():
        from kestrel import _native as n

        return n.pretrained_path("efficientnet-lite0"), os.path.isfile(n.pretrained_path("efficientnet-lite0")), os.path.isfile(driver_weights)

    rows = ks.features(lfw.limit(8), engine="tract", threads=1).collect()
    assert len(rows) == 8 and all(r.error is None and len(r.features) == 1280 for r in rows)
    seen = on_executors(spark, look)
    assert all(path.startswith("/tmp/kestrel-home/") for path, _, _ in seen), seen
    assert not any(theirs for _, _, theirs in seen), "the driver's weights are hidden from executors"
    assert any(have for _, have, _ in seen), f"an executor that ran features holds the weights: {seen}"


def test_classifier_fits_in_a_pipeline_that_saves_and_loads(spark, lfw, shared):
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.feature import StringIndexer

    from kestrel.spark.ml import KestrelClassifier, KestrelModel

    indexer = StringIndexer(inputCol="label", outputCol="labelIndex")
    clf = KestrelClassifier(
        outputDir=str(shared / "ml-runs"), labelCol="labelIndex", numWorkers=2, epochs=8,
        engine="tract", threads=1, seed=7,
    )
    assert clf.getOrDefault("numWorkers") == 2 and clf.getOrDefault("backbone") == "efficientnet-lite0"
    model = Pipeline(stages=[indexer, clf]).fit(lfw)
    kmodel = model.stages[-1]
    assert isinstance(kmodel, KestrelModel)
    assert kmodel.getOrDefault("labels") == ["0.0", "1.0"] and kmodel.getOrDefault("numericLabels")
    assert kmodel.summary["val_accuracy"] > 0.8, kmodel.summary
    assert (shared / "ml-runs" / os.path.basename(kmodel.run_dir) / ks.STAGED).is_dir(), "staged in the run"
    scored = model.transform(lfw).select("path", "labelIndex", "prediction", "probability", "predictedLabel")
    rows = {r.path: r for r in scored.collect()}
    assert len(rows) == 200
    acc = MulticlassClassificationEvaluator(labelCol="labelIndex", metricName="accuracy").evaluate(scored)
    print(f"pipeline accuracy on LFW: {acc:.3f}")
    assert acc >= 0.9, acc
    for r in rows.values():
        assert len(r.probability) == 2 and abs(sum(r.probability) - 1.0) < 1e-4
        assert r.prediction == float(r.probability.argmax())
        assert r.predictedLabel == str(r.prediction)

    where = "file:" + str(shared / "pipeline")
    model.save(where)
    again = PipelineModel.load(where)
    assert isinstance(again.stages[-1], KestrelModel)
    assert again.stages[-1].artifact == kmodel.artifact, "the artifact saved byte for byte"
    reloaded = {r.path: r for r in again.transform(lfw).select("path", "prediction", "probability").collect()}
    assert all(reloaded[p].prediction == rows[p].prediction for p in rows)
    assert all(list(reloaded[p].probability) == list(rows[p].probability) for p in rows)


def test_a_bad_image_on_an_executor_is_a_data_error_on_the_driver(spark, lfw, shared):
    from pyspark.errors import PythonException
    from pyspark.sql import Row

    bad = spark.createDataFrame(
        [Row(path="file:/nowhere/broken.png", modificationTime=None, length=9, content=b"not a png", label="face")],
        schema=lfw.schema,
    )
    mixed = lfw.limit(4).unionByName(bad)
    with pytest.raises(DataError, match="broken.png") as caught:
        ks.features(mixed).collect()
    assert isinstance(caught.value, PythonException), "still Spark's exception class too"
    assert "raised on an executor" in str(caught.value)

    with pytest.raises(DataError, match="broken.png"):
        ks.fit(mixed, out=str(shared / "bad-fit"), num_workers=2, no_mlflow=True, epochs=1, engine="tract")


@needs_isolation
def test_executors_find_onnx_runtime_in_their_own_wheel(spark, lfw):
    """engine="ort" with the driver's ORT_DYLIB_PATH hidden from the executors: each finds the
    library of its `onnxruntime` wheel; the features are tract's within 1e-4."""
    import numpy as np

    some = lfw.orderBy("path").limit(6)
    ort = {r.path: np.asarray(r.features) for r in ks.features(some, engine="ort", threads=1).collect()}
    tract = {r.path: np.asarray(r.features) for r in ks.features(some, engine="tract", threads=1).collect()}
    assert len(ort) == 6 and ort.keys() == tract.keys()
    assert max(float(np.abs(ort[p] - tract[p]).max()) for p in ort) <= 1e-4


def test_each_rank_takes_the_gpu_spark_assigned_to_its_task():
    """`use_gpu=True`: the rank's `--compute-device` is the first GPU address in its task's
    resources (Spark's `TaskContext.resources()`), not its rank; none assigned is a ConfigError.
    (No GPU here: what runs on it is in docs/gpu.md.)"""
    from types import SimpleNamespace

    from kestrel.spark._cluster import gpu_of_task

    def task(**resources):
        return SimpleNamespace(resources=lambda: {k: SimpleNamespace(addresses=v) for k, v in resources.items()})

    assert gpu_of_task(task(gpu=["3", "5"])) == "cuda:3"
    with pytest.raises(ConfigError, match="spark.task.resource.gpu.amount"):
        gpu_of_task(task())
    with pytest.raises(ConfigError, match="assigned this task no GPU"):
        gpu_of_task(task(gpu=[]))

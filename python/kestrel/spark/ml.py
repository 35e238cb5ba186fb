"""Kestrel as Spark ML stages: :class:`KestrelClassifier` (an ``Estimator``) and
:class:`KestrelModel` (a ``Model``), with typed ``Params``, save/load, and a place in a
``Pipeline``::

    from pyspark.ml import Pipeline
    from pyspark.ml.feature import StringIndexer
    from kestrel.spark.ml import KestrelClassifier

    indexer = StringIndexer(inputCol="species", outputCol="label")
    clf = KestrelClassifier(outputDir="/dbfs/kestrel/runs", numWorkers=2, epochs=15)
    model = Pipeline(stages=[indexer, clf]).fit(images)   # images: path, content, species
    model.transform(images).select("path", "prediction", "probability")
    model.save("dbfs:/kestrel/models/flowers")

``fit`` trains with ``numWorkers`` ranks on a barrier stage (:func:`kestrel.spark.fit`), exports
the run (ONNX, int8 as ``quantize`` says, the manifest, golden samples) on the driver and returns
a :class:`KestrelModel` holding the exported artifact. ``transform`` runs the artifact on the
executors (``mapInArrow``; the artifact broadcast once per executor, loaded and health-checked as
the edge agent loads it) and adds ``prediction`` (double), ``probability`` (a vector) and
``predictedLabel`` (the class name).

Labels: a string label column is used as it is, and ``prediction`` is the class index in the
model's ``labels`` order (sorted). A numeric label column (a ``StringIndexer``'s output) is
trained on its values, and ``prediction`` is the predicted *value*, ``probability[i]`` the
probability of value ``i``: what ``MulticlassClassificationEvaluator`` and ``IndexToString``
expect.
"""

from __future__ import annotations

import os
import secrets
import time
from typing import Any, Dict, List, Optional

from pyspark import keyword_only
from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import (
    DefaultParamsReadable,
    DefaultParamsReader,
    DefaultParamsWritable,
    DefaultParamsWriter,
    MLReadable,
    MLReader,
    MLWritable,
    MLWriter,
)

import kestrel
from kestrel import DataError, KestrelError
from kestrel import spark as ks

__all__ = ["KestrelClassifier", "KestrelModel"]


def _param(name: str, doc: str, conv) -> Param:
    return Param(Params._dummy(), name, doc, typeConverter=conv)


class _Columns(Params):
    """Columns shared by the estimator and the model."""

    pathCol = _param("pathCol", "column of each image's path or id", TypeConverters.toString)
    contentCol = _param("contentCol", "column of each image's encoded bytes", TypeConverters.toString)
    labelCol = _param("labelCol", "label column (string, or a StringIndexer's index)", TypeConverters.toString)
    predictionCol = _param("predictionCol", "prediction column (double)", TypeConverters.toString)
    probabilityCol = _param("probabilityCol", "class probabilities column (vector)", TypeConverters.toString)
    predictedLabelCol = _param("predictedLabelCol", "predicted class name column (string)", TypeConverters.toString)
    threads = _param("threads", "inference threads per task", TypeConverters.toInt)
    onError = _param(
        "onError",
        "an image that does not decode: 'raise' (a kestrel.DataError naming it) or 'keep' (null prediction)",
        TypeConverters.toString,
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(
            pathCol="path",
            contentCol="content",
            labelCol="label",
            predictionCol="prediction",
            probabilityCol="probability",
            predictedLabelCol="predictedLabel",
            threads=1,
            onError="raise",
        )


#: Estimator params passed to ``trainer fit`` as flags (param name -> flag keyword).
_FIT_FLAGS = {
    "backbone": "backbone",
    "epochs": "epochs",
    "batchSize": "batch_size",
    "learningRate": "lr",
    "optimizer": "optimizer",
    "fineTune": "fine_tune",
    "seed": "seed",
    "valFraction": "val_fraction",
    "testFraction": "test_fraction",
    "classWeights": "class_weights",
    "labelSmoothing": "label_smoothing",
    "earlyStopping": "early_stopping",
    "augment": "augment",
    "engine": "engine",
    "threads": "threads",
}


class KestrelClassifier(Estimator, _Columns, DefaultParamsReadable, DefaultParamsWritable):
    """Trains a head (or fine-tunes) on a frozen pretrained backbone over a DataFrame of images
    (``path``, ``content``, a label), on ``numWorkers`` ranks of a barrier stage; ``fit`` returns
    a :class:`KestrelModel`. Params left unset take ``trainer fit``'s defaults."""

    outputDir = _param(
        "outputDir",
        "directory every node sees (/dbfs/..., /Volumes/..., a shared mount) for the runs",
        TypeConverters.toString,
    )
    numWorkers = _param("numWorkers", "ranks (task slots of one barrier stage)", TypeConverters.toInt)
    useGpu = _param("useGpu", "each rank on the GPU Spark assigned to its task", TypeConverters.toBoolean)
    backbone = _param("backbone", "frozen backbone: a pretrained name or a checkpoint path", TypeConverters.toString)
    epochs = _param("epochs", "training epochs", TypeConverters.toInt)
    batchSize = _param("batchSize", "global batch size", TypeConverters.toInt)
    learningRate = _param("learningRate", "learning rate", TypeConverters.toFloat)
    optimizer = _param("optimizer", "sgd or adam", TypeConverters.toString)
    fineTune = _param("fineTune", "also train the backbone's last N blocks", TypeConverters.toInt)
    seed = _param("seed", "seed of the split, initialisation and shuffling", TypeConverters.toInt)
    valFraction = _param("valFraction", "validation share of the data", TypeConverters.toFloat)
    testFraction = _param("testFraction", "test share of the data", TypeConverters.toFloat)
    classWeights = _param("classWeights", "none or balanced", TypeConverters.toString)
    labelSmoothing = _param("labelSmoothing", "label smoothing epsilon", TypeConverters.toFloat)
    earlyStopping = _param("earlyStopping", "patience in epochs", TypeConverters.toInt)
    augment = _param("augment", "augmentations (trainer fit --augment)", TypeConverters.toListString)
    engine = _param("engine", "engine of the frozen backbone: tract or ort", TypeConverters.toString)
    quantize = _param("quantize", "exported forms (trainer export --quantize)", TypeConverters.toString)
    trainerArgs = _param("trainerArgs", "more `trainer fit` flags, as on its command line", TypeConverters.toListString)
    timeoutS = _param("timeoutS", "seconds a rank waits for the others", TypeConverters.toFloat)

    @keyword_only
    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._setDefault(numWorkers=1, useGpu=False, backbone="efficientnet-lite0", trainerArgs=[], timeoutS=600.0)
        self._set(**self._input_kwargs)

    @keyword_only
    def setParams(self, **kwargs: Any) -> "KestrelClassifier":
        return self._set(**self._input_kwargs)

    def _fit(self, dataset) -> "KestrelModel":
        from pyspark.sql.types import StringType

        if not self.isDefined(self.outputDir):
            raise KestrelError("KestrelClassifier needs outputDir: a directory every node sees, for the runs")
        label = self.getOrDefault(self.labelCol)
        if label not in dataset.columns:
            raise DataError(f"the DataFrame has no column `{label}` (it has: {', '.join(dataset.columns)})")
        numeric = not isinstance(dataset.schema[label].dataType, StringType)
        base = ks.locate(self.getOrDefault(self.outputDir))[1]
        run = os.path.join(base, f"run-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}")
        flags = {kw: self.getOrDefault(p) for p, kw in _FIT_FLAGS.items() if self.isDefined(getattr(self, p))}
        if not self.isSet(self.threads):
            flags.pop("threads", None)
        extra: List[str] = self.getOrDefault(self.trainerArgs)
        summary = ks.fit(
            dataset,
            out=run,
            label=label,
            num_workers=self.getOrDefault(self.numWorkers),
            path=self.getOrDefault(self.pathCol),
            content=self.getOrDefault(self.contentCol),
            timeout_s=self.getOrDefault(self.timeoutS),
            use_gpu=self.getOrDefault(self.useGpu),
            **flags,
            **_extra_flags(extra),
        )
        art = os.path.join(run, "artifact")
        quantize = self.getOrDefault(self.quantize) if self.isDefined(self.quantize) else None
        kestrel.export(run, out=art, no_mlflow=True, quantize=quantize)
        model = KestrelModel._from_files(ks.artifact_files(art), numeric)
        model._summary = summary
        model._run_dir = run
        for p in _Columns().params:
            if self.isSet(getattr(self, p.name)):
                model._set(**{p.name: self.getOrDefault(getattr(self, p.name))})
        return model


def _extra_flags(argv: List[str]) -> Dict[str, Any]:
    """``trainerArgs`` (``["--l2", "0.01", "--skip-invalid"]``) as keyword flags."""
    out: Dict[str, Any] = {}
    i = 0
    while i < len(argv):
        flag = argv[i]
        if not flag.startswith("--"):
            raise KestrelError(f"trainerArgs: `{flag}` is not a flag (flags start with --)")
        key = flag[2:].replace("-", "_")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[key] = argv[i + 1]
            i += 2
        else:
            out[key] = True
            i += 1
    return out


class KestrelModel(Model, _Columns, MLReadable, MLWritable):
    """An exported Kestrel artifact as a Spark ML ``Model``: ``transform(df)`` adds
    ``prediction``, ``probability`` and ``predictedLabel``. Saved with its artifact (the ONNX
    files, manifest and golden samples, byte for byte); loaded models are checked (hashes and
    golden samples) before any task runs."""

    labels = _param("labels", "class names in class order", TypeConverters.toListString)
    numericLabels = _param(
        "numericLabels", "trained on a numeric label column (predictions are label values)", TypeConverters.toBoolean
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(numericLabels=False)
        self._files: Dict[str, bytes] = {}
        self._broadcast = None
        self._summary: Optional[dict] = None
        self._run_dir: Optional[str] = None

    @classmethod
    def _from_files(cls, files: Dict[str, bytes], numeric: bool) -> "KestrelModel":
        import json

        m = cls()
        m._files = files
        manifest = json.loads(files["manifest.json"])
        m._set(labels=list(manifest["labels"]), numericLabels=numeric)
        return m

    @property
    def summary(self) -> Optional[dict]:
        """The training run's summary (``trainer fit --json``), on the model ``fit`` returned."""
        return self._summary

    @property
    def run_dir(self) -> Optional[str]:
        """The training run's directory (with the staged data and the export), on the model
        ``fit`` returned."""
        return self._run_dir

    @property
    def artifact(self) -> Dict[str, bytes]:
        """The exported artifact's files by relative path (write them out to publish the model)."""
        return dict(self._files)

    def log_mlflow(self, name: str = "model", registered_model_name: Optional[str] = None) -> Any:
        """Logs the artifact in the active MLflow run as a model over images
        (:mod:`kestrel.pyfunc`: usable with ``mlflow.pyfunc.spark_udf``); MLflow's ``ModelInfo``."""
        import tempfile

        from kestrel import pyfunc

        with tempfile.TemporaryDirectory(prefix="kestrel-artifact-") as d:
            ks.write_files(self._files, d)
            return pyfunc.log_model(d, name=name, registered_model_name=registered_model_name)

    def _index(self) -> Dict[str, int]:
        """Position of each class in ``probability`` (the label value for numeric labels)."""
        labels = self.getOrDefault(self.labels)
        if self.getOrDefault(self.numericLabels):
            values = [float(x) for x in labels]
            if all(v >= 0 and v == int(v) for v in values):
                return {l: int(v) for l, v in zip(labels, values)}
        return {l: i for i, l in enumerate(labels)}

    def _transform(self, dataset):
        import pyarrow as pa
        from pyspark.ml.functions import array_to_vector
        from pyspark.sql import functions as F
        from pyspark.sql.types import ArrayType, DoubleType, StringType, StructField, StructType

        path, content = self.getOrDefault(self.pathCol), self.getOrDefault(self.contentCol)
        ks._require(dataset, path, content)
        spark = dataset.sparkSession
        if self._broadcast is None or self._broadcast[2] != spark.sparkContext.applicationId:
            bc, key = ks.broadcast_artifact(spark, self._files)
            self._broadcast = (bc, key, spark.sparkContext.applicationId)
        bc, key, _ = self._broadcast
        threads, keep = self.getOrDefault(self.threads), self.getOrDefault(self.onError) == "keep"
        labels, index = self.getOrDefault(self.labels), self._index()
        numeric = self.getOrDefault(self.numericLabels)
        width = max(index.values()) + 1
        pred, prob, named = (
            self.getOrDefault(self.predictionCol),
            self.getOrDefault(self.probabilityCol),
            self.getOrDefault(self.predictedLabelCol),
        )
        ks._small_batches(spark, ks.BATCH_ROWS)
        schema = StructType(
            list(dataset.schema.fields)
            + [
                StructField(pred, DoubleType(), True),
                StructField(prob, ArrayType(DoubleType()), True),
                StructField(named, StringType(), True),
            ]
        )

        def run(batches):
            model = ks._predictor(bc, key, threads)
            for batch in batches:
                ids = [str(p) for p in batch.column(path).to_pylist()]
                images = [b if b is not None else b"" for b in batch.column(content).to_pylist()]
                preds, probs, names = [], [], []
                for name, (top, err) in zip(ids, model.predict(ids, images, len(labels))):
                    if top is None:
                        if not keep:
                            raise DataError(f"row `{name}` (column `{content}`): {err}")
                        preds.append(None), probs.append(None), names.append(None)
                        continue
                    p = [0.0] * width
                    for label, _, score in top:
                        p[index[label]] = float(score)
                    best = top[0][0]
                    preds.append(float(best) if numeric else float(index[best]))
                    probs.append(p)
                    names.append(best)
                cols = list(batch.columns) + [
                    pa.array(preds, type=pa.float64()),
                    pa.array(probs, type=pa.list_(pa.float64())),
                    pa.array(names, type=pa.string()),
                ]
                yield pa.RecordBatch.from_arrays(cols, names=list(batch.schema.names) + [pred, prob, named])

        out = dataset.mapInArrow(run, schema)
        return out.withColumn(prob, array_to_vector(F.col(prob)))

    def write(self) -> MLWriter:
        return _ModelWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        return _ModelReader()


class _ModelWriter(MLWriter):
    """``path/metadata`` (the params, as Spark ML writes them) and ``path/artifact`` (the
    artifact's files as a Parquet table of name and bytes: through Spark's filesystem, so any
    location Spark writes works: dbfs:/, s3a://, a local path)."""

    def __init__(self, instance: KestrelModel) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sparkSession)
        rows = [(n, bytearray(b)) for n, b in sorted(self.instance._files.items())]
        df = self.sparkSession.createDataFrame(rows, "name string, content binary")
        df.coalesce(1).write.parquet(os.path.join(path, "artifact"))


class _ModelReader(MLReader):
    def load(self, path: str) -> KestrelModel:
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        m = KestrelModel()
        m._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(m, metadata)
        rows = self.sparkSession.read.parquet(os.path.join(path, "artifact")).collect()
        m._files = {r.name: bytes(r.content) for r in rows}
        if "manifest.json" not in m._files:
            raise DataError(f"{path}: not a saved KestrelModel (its artifact has no manifest.json)")
        return m

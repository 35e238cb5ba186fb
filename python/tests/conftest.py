"""A real Spark cluster for the tests: a standalone master and two workers (one core each),
started from the pyspark wheel's own `spark-class` on loopback, and a session on it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

HOME = Path(os.environ.get("KESTREL_HOME", Path.home() / ".cache" / "kestrel"))
BIN = Path(os.environ.get("KESTREL_BIN", HOME / "target" / "release"))
LFW = HOME / "datasets" / "lfw" / "imagefolder"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(what: str, check, timeout: float = 90.0):
    """Polls `check` until it returns something true (the cluster's own state, not a fixed
    sleep); fails naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = check()
        if v:
            return v
        time.sleep(0.2)
    raise TimeoutError(f"{what} after {timeout:.0f}s")


def alive_workers(ui: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=2) as r:
            state = json.load(r)
    except OSError:
        return 0
    return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")


@pytest.fixture(scope="session")
def cluster():
    """(master URL, workers' log dir) of a running standalone cluster with two workers."""
    import pyspark

    spark_home = Path(pyspark.__file__).parent
    logs = Path(tempfile.mkdtemp(prefix="kestrel-spark-"))
    env = dict(
        os.environ,
        SPARK_HOME=str(spark_home),
        SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_PYTHON=sys.executable,
        SPARK_WORKER_DIR=str(logs / "work"),
    )
    port, ui = free_port(), free_port()
    master = f"spark://127.0.0.1:{port}"
    spark_class = str(spark_home / "bin" / "spark-class")
    procs = []

    def start(name, *args):
        out = open(logs / f"{name}.log", "wb")
        procs.append(subprocess.Popen([spark_class, *args], env=env, stdout=out, stderr=out))

    start(
        "master",
        "org.apache.spark.deploy.master.Master",
        "--host", "127.0.0.1", "--port", str(port), "--webui-port", str(ui),
    )
    for i in range(2):
        start(
            f"worker{i}",
            "org.apache.spark.deploy.worker.Worker",
            "--cores", "1", "--memory", "1g", "--webui-port", str(free_port()), master,
        )
    try:
        wait_until("two Spark workers registered", lambda: alive_workers(ui) == 2)
        yield master, logs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(logs, ignore_errors=True)


@pytest.fixture(scope="session")
def spark(cluster):
    from pyspark.sql import SparkSession

    master, _ = cluster
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    s = (
        SparkSession.builder.master(master)
        .appName("kestrel-tests")
        .config("spark.executor.memory", "768m")
        .config("spark.executor.cores", "1")
        .config("spark.ui.port", str(free_port()))
        .config("spark.sql.shuffle.partitions", "2")
        # A killed task is retried (the fault test), a barrier stage fails fast.
        .config("spark.task.maxFailures", "4")
        .config("spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures", "1")
        .config("spark.executorEnv.KESTREL_HOME", str(HOME))
        .config("spark.executorEnv.ORT_DYLIB_PATH", os.environ.get("ORT_DYLIB_PATH", ""))
        .getOrCreate()
    )
    # Both executors registered before any test counts on two.
    wait_until(
        "two executors",
        lambda: s.sparkContext._jsc.sc().getExecutorMemoryStatus().size() >= 3,
    )
    yield s
    s.stop()


@pytest.fixture(scope="session")
def lfw(spark):
    """The LFW subset as Spark's binaryFile reader gives it, with `label` from the folder."""
    from pyspark.sql import functions as F

    if not LFW.is_dir():
        pytest.fail(f"{LFW} is missing: run scripts/fetch-datasets.sh (scripts/test.sh does)")
    df = (
        spark.read.format("binaryFile")
        .option("recursiveFileLookup", "true")
        .load(str(LFW))
    )
    return df.withColumn("label", F.element_at(F.split("path", "/"), -2)).repartition(4)


def trainer(*args: str) -> str:
    """The `trainer` binary, as a user runs it; its stdout."""
    r = subprocess.run([str(BIN / "trainer"), *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise AssertionError(f"trainer {' '.join(args)}: {r.stderr}")
    return r.stdout


def tasks_per_executor(spark, field: str = "totalTasks") -> dict:
    """Tasks each executor has run (or failed: `failedTasks`) so far, from the application's REST
    API, by executor id."""
    sc = spark.sparkContext
    url = f"{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}/executors"
    with urllib.request.urlopen(url, timeout=10) as r:
        return {e["id"]: e[field] for e in json.load(r) if e["id"] != "driver"}

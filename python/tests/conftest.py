"""A real Spark cluster for the tests: a standalone master and two workers (one core each),
started from the pyspark wheel's own `spark-class` on loopback, each worker in a mount namespace
of its own (a private /tmp and Kestrel home, the driver's weights, caches and datasets hidden),
as two hosts would be; `shared` is the one directory they have in common with the driver,
standing for object storage (cluster.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import pytest

from cluster import BIN, HOME, LFW, can_isolate, free_port, session, standalone, wait_until  # noqa: F401

#: Workers in mount namespaces of their own when this machine allows it; else they share the
#: driver's files and the tests that need them apart are skipped, saying why.
ISOLATED = can_isolate()
needs_isolation = pytest.mark.skipif(
    not ISOLATED, reason="needs `unshare --mount` (root with CAP_SYS_ADMIN) to keep the workers' files apart"
)


@pytest.fixture(scope="session")
def shared():
    """The directory every node sees (outside /tmp, which each worker has to itself)."""
    d = Path(tempfile.mkdtemp(prefix="kestrel-shared-", dir="/var/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster():
    """(master URL, workers' log dir) of a running standalone cluster with two isolated workers."""
    with standalone(2, isolated=ISOLATED) as c:
        yield c


@pytest.fixture(scope="session")
def spark(cluster):
    s = session(cluster[0], 2, isolated=ISOLATED)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def lfw_dir(shared):
    """The LFW subset (an image folder, `face` and `nonface`) in the shared directory."""
    if not LFW.is_dir():
        pytest.fail(f"{LFW} is missing: run scripts/fetch-datasets.sh (scripts/test.sh does)")
    d = shared / "lfw"
    shutil.copytree(LFW, d)
    return d


@pytest.fixture(scope="session")
def lfw(spark, lfw_dir):
    """The LFW subset as Spark's binaryFile reader gives it, with `label` from the folder."""
    from pyspark.sql import functions as F

    df = (
        spark.read.format("binaryFile")
        .option("recursiveFileLookup", "true")
        .load(str(lfw_dir))
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


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` (SQLite backend, proxied artifacts) on a free port: its URL."""
    import os
    import sys

    d = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    exe = Path(sys.executable).with_name("mlflow")
    log = open(d / "server.log", "wb")
    p = subprocess.Popen(
        [str(exe), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--serve-artifacts", "--backend-store-uri", f"sqlite:///{d}/mlflow.db",
         "--artifacts-destination", str(d / "artifacts")],
        stdout=log, stderr=log, start_new_session=True,
        env=dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
    )
    url = f"http://127.0.0.1:{port}"

    def healthy():
        assert p.poll() is None, (d / "server.log").read_text()[-2000:]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    wait_until("mlflow server up", healthy, timeout=120)
    yield url
    os.killpg(p.pid, 15)
    p.wait(timeout=30)

"""A real Spark cluster for the tests: a standalone master and two workers (one core each),
started from the pyspark wheel's own `spark-class` on loopback, and a session on it
(cluster.py)."""

from __future__ import annotations

import json
import subprocess
import urllib.request

import pytest

from cluster import BIN, HOME, LFW, free_port, session, standalone, wait_until  # noqa: F401


@pytest.fixture(scope="session")
def cluster():
    """(master URL, workers' log dir) of a running standalone cluster with two workers."""
    with standalone(2) as c:
        yield c


@pytest.fixture(scope="session")
def spark(cluster):
    s = session(cluster[0], 2)
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

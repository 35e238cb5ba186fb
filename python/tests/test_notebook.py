"""The seed notebook's cells as docs/coming-from-databricks.md translates them, run as written on
the isolated cluster (conftest.py), and what a notebook user sees of the work: log records as
`logging` records while a command runs, `init_logging` that takes effect when called."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

import kestrel

DOC = Path(__file__).resolve().parents[2] / "docs" / "coming-from-databricks.md"


def cells() -> list:
    """The Python blocks of the doc's cell-by-cell section, in order."""
    text = DOC.read_text().split("## The seed notebook, cell by cell", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_the_seed_notebook_translated_runs_as_written(spark, lfw_dir, shared, tmp_path):
    blocks = cells()
    assert len(blocks) >= 6, blocks
    assert blocks[0].lstrip().startswith("# Where the images are"), blocks[0]
    work = shared / "notebook"
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/notebook.db")
    # Artifacts beside the database (a SQLite store's default is ./mlruns, in the checkout).
    mlflow.set_experiment(experiment_id=mlflow.create_experiment("seed", artifact_location=f"file:{tmp_path}/a"))
    ns = {"spark": spark, "print": print}
    try:
        # The first cell names the locations: the test's own, in the same shape.
        exec(f"IMAGES, WORK = {('file:' + str(lfw_dir))!r}, {str(work)!r}", ns)
        for code in blocks[1:]:
            if code.lstrip().startswith("# not run by the test"):
                continue
            exec(compile(code, str(DOC), "exec"), ns)
    finally:
        while mlflow.active_run() is not None:
            mlflow.end_run()
    try:
        assert ns["search"]["best"]["val_loss"] == min(t["val_loss"] for t in ns["search"]["trials"])
        assert ns["accuracy"] >= 0.9, ns["accuracy"]
        from pyspark.ml import PipelineModel

        saved = PipelineModel.load(f"{work}/models/faces")
        assert saved.stages[-1].artifact == ns["model"].stages[-1].artifact
        runs = MlflowClient().search_runs([mlflow.get_experiment_by_name("seed").experiment_id])
        parent = [r for r in runs if r.info.run_name == "faces"]
        assert len(parent) == 1
        kids = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id]
        assert len(kids) == 1 and kids[0].data.metrics["val_accuracy"] > 0.8, kids
    finally:
        mlflow.set_tracking_uri(before)


def test_log_records_reach_logging_while_the_command_runs(lfw_dir, tmp_path):
    run = tmp_path / "run"
    seen = []

    class Live(logging.Handler):
        def emit(self, r):
            m = run / "metrics.jsonl"
            done = len(m.read_text().splitlines()) if m.is_file() else 0
            seen.append((r.name, r.levelno, r.getMessage(), done))

    h = Live()
    logging.getLogger("kestrel").addHandler(h)
    bars = []

    def progress(bar, line):
        m = run / "metrics.jsonl"
        bars.append((bar, line, len(m.read_text().splitlines()) if m.is_file() else 0))

    kestrel.set_progress(progress)
    try:
        kestrel.init_logging(-1)
        kestrel.fit(str(lfw_dir), out=str(tmp_path / "quiet"), epochs=2, optimizer="sgd", no_mlflow=True,
                    engine="tract", cache=str(tmp_path / "cache"))
        assert not [s for s in seen if s[1] < logging.ERROR], seen
        kestrel.init_logging(0)
        kestrel.fit(str(lfw_dir), out=str(run), epochs=200, batch_size=4, optimizer="sgd", no_mlflow=True,
                    engine="tract", cache=str(tmp_path / "cache"))
    finally:
        logging.getLogger("kestrel").removeHandler(h)
        kestrel.set_progress(None)
        kestrel.init_logging(0)
    # The CLI's bars, as it draws them, while the run goes on: each epoch's batches.
    drawn = [(b, m) for b, line, done in bars if (m := re.match(r"\s*epoch (\d+) [^[]*\[[=> ]+\] (\d+)/(\d+)", line))]
    print(f"{len({b for b, _ in drawn})} of 200 epoch bars drawn (4 redraws a second)")
    assert len({b for b, _ in drawn}) >= 5, sorted({line.split("[")[0] for _, line, _ in bars})
    assert all(m.group(3) == drawn[0][1].group(3) for _, m in drawn), drawn[:5]
    assert min(done for _, line, done in bars if line.strip().startswith("epoch")) < 200
    epochs = [s for s in seen if re.match(r"epoch +\d+/200:", s[2])]
    assert len(epochs) == 200, seen
    assert all(name.startswith("kestrel.") and level == logging.INFO for name, level, _, _ in epochs)
    print(f"epochs written when the first epoch's record arrived: {epochs[0][3]} of 200")
    assert epochs[0][3] < 200, "the first epoch's record arrived while the run went on"


def test_the_ranks_epochs_show_on_the_driver(spark, lfw, shared):
    from kestrel import spark as ks

    seen = []

    class Driver(logging.Handler):
        def emit(self, r):
            seen.append((r.name, r.getMessage()))

    h = Driver()
    logging.getLogger("kestrel").addHandler(h)
    try:
        ks.fit(lfw, out=str(shared / "relayed"), num_workers=2, epochs=3, optimizer="sgd", no_mlflow=True,
               engine="tract", threads=1, cache=str(shared / "cache"))
    finally:
        logging.getLogger("kestrel").removeHandler(h)
    epochs = [m for n, m in seen if re.match(r"\[rank 0\] epoch +\d+/3:", m)]
    assert len(epochs) == 3, seen
    assert all(n.startswith("kestrel.") for n, m in seen if m.startswith("[rank 0] epoch")), seen

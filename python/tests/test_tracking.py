"""The notebook's MLflow: Kestrel's runs are children of the active run, on an HTTP tracking
server (the trainer logs itself, from the rank that writes the run) and on a URI only the Python
client understands (kestrel.tracking logs the run directory)."""

from __future__ import annotations

import mlflow
import pytest
from mlflow.tracking import MlflowClient

import kestrel
from kestrel import spark as ks


@pytest.fixture
def notebook_mlflow():
    """The tracking URI is the notebook's to set; put back afterwards."""
    before = mlflow.get_tracking_uri()
    yield
    while mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.set_tracking_uri(before)


def children(parent) -> list:
    c = MlflowClient()
    return c.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )


def test_a_spark_fit_is_a_child_of_the_notebooks_run(notebook_mlflow, mlflow_server, spark, lfw, shared):
    mlflow.set_tracking_uri(mlflow_server)
    mlflow.set_experiment("kestrel-notebook")
    with mlflow.start_run(run_name="notebook") as parent:
        s = ks.fit(lfw, out=str(shared / "tracked"), num_workers=2, epochs=2, optimizer="sgd",
                   engine="tract", threads=1, cache=str(shared / "cache"))
    runs = children(parent)
    assert len(runs) == 1, runs
    run = runs[0]
    assert run.data.metrics["val_accuracy"] == pytest.approx(s["val_accuracy"])
    history = MlflowClient().get_metric_history(run.info.run_id, "val_loss")
    assert [m.step for m in history] == [1, 2]


def test_a_uri_only_python_knows_gets_the_run_from_its_directory(notebook_mlflow, lfw_dir, tmp_path):
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/notebook.db")
    # Artifacts beside the database (a SQLite store's default is ./mlruns, in the checkout).
    mlflow.set_experiment(experiment_id=mlflow.create_experiment("kestrel-notebook", artifact_location=f"file:{tmp_path}/a"))
    with mlflow.start_run(run_name="notebook") as parent:
        s = kestrel.fit(str(lfw_dir), out=str(tmp_path / "run"), epochs=3, optimizer="sgd",
                        engine="tract", cache=str(tmp_path / "cache"))
    runs = children(parent)
    assert len(runs) == 1, runs
    run = runs[0]
    assert run.data.params["optimizer"] == "sgd"
    assert run.data.metrics["val_accuracy"] == pytest.approx(s["val_accuracy"])
    assert [m.step for m in MlflowClient().get_metric_history(run.info.run_id, "train_loss")] == [1, 2, 3]
    assert {a.path for a in MlflowClient().list_artifacts(run.info.run_id)} >= {"params.json", "summary.json"}


def test_the_model_scores_images_through_mlflow_spark_udf(notebook_mlflow, spark, lfw, lfw_dir, tmp_path):
    from kestrel import pyfunc

    run, art = tmp_path / "run", tmp_path / "art"
    kestrel.fit(str(lfw_dir), out=str(run), no_mlflow=True, engine="tract", cache=str(tmp_path / "cache"))
    kestrel.export(str(run), out=str(art), no_mlflow=True)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/models.db")
    mlflow.set_experiment(experiment_id=mlflow.create_experiment("models", artifact_location=f"file:{tmp_path}/a"))
    with mlflow.start_run():
        info = pyfunc.log_model(str(art), name="faces")
    expected = {r.path: r.prediction for r in ks.predict(lfw, str(art)).collect()}
    local = mlflow.pyfunc.load_model(info.model_uri)
    rows = lfw.select("path", "content").limit(5).toPandas()
    assert list(local.predict(rows[["content"]])) == [expected[p] for p in rows["path"]]
    udf = mlflow.pyfunc.spark_udf(spark, info.model_uri, result_type="string")
    got = {r.path: r.pred for r in lfw.select("path", udf("content").alias("pred")).collect()}
    assert got == expected

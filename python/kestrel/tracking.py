"""The notebook's MLflow: Kestrel's runs go where the Python ``mlflow`` client points, under the
notebook's active run.

- A tracking server over HTTP(S) (``mlflow.set_tracking_uri("http://...")``, or
  ``MLFLOW_TRACKING_URI``): the trainer logs to it itself (its own REST client, on whichever
  rank writes the run), as a child of the active run (``--parent-run-id``).
- Any other URI the Python client accepts (``databricks``, ``databricks-uc``, ``sqlite:///``, a
  file store): the trainer does not track, and when the command ends this module logs the run
  from its directory through the Python client, as a nested run: its parameters
  (``params.json``, flattened), every epoch's metrics by step (``metrics.jsonl``), the summary's
  numbers and the run's record files as artifacts.

Without ``mlflow`` installed, or with ``no_mlflow=True`` / ``mlflow=...`` passed explicitly,
nothing here changes what the trainer does.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, Optional, Tuple

#: Flags with which the caller already decided where tracking goes.
_EXPLICIT = ("mlflow", "no_mlflow", "run_id", "parent_run_id")

Finish = Callable[[str], None]


def _noop(_run_dir: str) -> None:
    return None


def plan(kwargs: Dict[str, Any]) -> Tuple[Dict[str, Any], Finish]:
    """The trainer flags for the notebook's MLflow, and what to do with the run directory once
    the command has ended (log it through the Python client, or nothing)."""
    if any(kwargs.get(k) not in (None, False) for k in _EXPLICIT):
        return {}, _noop
    try:
        import mlflow
    except ImportError:
        return {}, _noop
    active = mlflow.active_run()
    uri = mlflow.get_tracking_uri()
    env_uri = os.environ.get("MLFLOW_TRACKING_URI")
    if active is None and not env_uri:
        return {}, _noop
    if uri.startswith(("http://", "https://")):
        flags: Dict[str, Any] = {"mlflow": uri}
        if active is not None:
            flags["parent_run_id"] = active.info.run_id
        return flags, _noop
    return {"no_mlflow": True}, _log_from_directory


def _flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, str]:
    out: Dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = "" if v is None else str(v)[:6000]
    return out


def _log_from_directory(run_dir: str) -> None:
    """Logs a finished run directory as a run nested under the active run (or a new run)."""
    import mlflow

    def read(name: str) -> Optional[Any]:
        p = os.path.join(run_dir, name)
        if not os.path.isfile(p):
            return None
        with open(p) as f:
            return json.load(f)

    params = read("params.json") or {}
    summary = read("summary.json") or {}
    nested = mlflow.active_run() is not None
    with mlflow.start_run(run_name=os.path.basename(run_dir.rstrip("/")), nested=nested):
        mlflow.set_tag("kestrel.run_dir", run_dir)
        mlflow.log_params(_flatten(params))
        metrics = os.path.join(run_dir, "metrics.jsonl")
        if os.path.isfile(metrics):
            with open(metrics) as f:
                for line in f:
                    m = json.loads(line)
                    step = int(m.pop("epoch", 0))
                    mlflow.log_metrics({k: float(v) for k, v in m.items() if isinstance(v, (int, float))}, step=step)
        final = {k: float(v) for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if final:
            mlflow.log_metrics(final)
        for name in ("params.json", "summary.json", "split.json", "confusion_matrix.json"):
            p = os.path.join(run_dir, name)
            if os.path.isfile(p):
                mlflow.log_artifact(p)

"""Kestrel from Python: the ``trainer`` commands as functions, over the same Rust library.

Every function runs the command the CLI runs, in this process, with the GIL released::

    import kestrel
    s = kestrel.fit("lfw.parquet", out="runs/lfw", epochs=15, workers=2)
    s["val_accuracy"]

Keyword arguments are the command's flags (``--label-column`` is ``label_column=``; ``True``
gives a switch, ``None``/``False`` leave it out, a list repeats the flag), typed for IDEs by
the TypedDicts of ``kestrel._flags`` (written from the CLI by ``scripts/gen-flags.py``). The result is the
command's ``--json`` summary as a dict (a list of dicts for commands that print one object per
line). A failure raises a :class:`KestrelError` with the CLI's message, of the class that says
what failed: :class:`DataError` (a table, column, image, label or weights file),
:class:`ConfigError` (a flag, URL or setting; a backbone or engine not installed),
:class:`ServiceError` (a broker, MLflow or a peer did not answer: worth retrying) or
:class:`GateError` (a check refused the result). Ctrl-C ("interrupt kernel") stops a command
within one batch and raises ``KeyboardInterrupt``; what the command wrote is whole (every write
is crash-safe). ``kestrel.spark`` runs extraction, training, tuning and batch inference on a
Spark cluster, and ``kestrel.spark.ml`` has them as Spark ML estimator and model.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Union

from . import _native, _progress, tracking
from ._native import (
    ConfigError,
    DataError,
    Extractor,
    GateError,
    KestrelError,
    Predictor,
    ServiceError,
    __version__,
)

if TYPE_CHECKING:  # the flags' types for IDEs and type checkers (scripts/gen-flags.py)
    from typing_extensions import Unpack

    from ._flags import (
        EvaluateFlags,
        ExportFlags,
        FitFlags,
        PredictFlags,
        PrepareFlags,
        PublishFlags,
        StatusFlags,
        TuneFlags,
    )

__all__ = [
    "KestrelError",
    "DataError",
    "ConfigError",
    "ServiceError",
    "GateError",
    "Extractor",
    "Predictor",
    "prepare",
    "fit",
    "tune",
    "evaluate",
    "export",
    "predict",
    "publish",
    "status",
    "run",
    "flags",
    "init_logging",
    "set_progress",
]

Summary = Union[Dict[str, Any], List[Dict[str, Any]]]


def flags(**kwargs: Any) -> List[str]:
    """The command-line flags for keyword arguments: ``epochs=15`` is ``--epochs 15``,
    ``json=True`` is ``--json``, ``None`` and ``False`` are left out, a list or tuple repeats the
    flag once per item."""
    out: List[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            for v in value:
                out += [flag, str(v)]
        else:
            out += [flag, str(value)]
    return out


def run(*argv: str, **kwargs: Any) -> str:
    """Runs ``trainer ARGV... FLAGS...`` in this process and returns what it printed
    (``kestrel.run("fit", "--help")`` prints the CLI's help)."""
    return _native.run(list(argv) + flags(**kwargs))


def _summary(command: str, **kwargs: Any) -> Summary:
    """Runs ``command`` with ``--json`` and parses its output."""
    text = run(*command.split(), json=True, **kwargs)
    return parse_json_output(text)


def parse_json_output(text: str) -> Summary:
    """One JSON object, or one per line."""
    text = text.strip()
    if not text:
        return {}
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def prepare(data: Union[str, List[str]], **kwargs: Unpack[PrepareFlags]) -> Summary:
    """``trainer prepare``: the table's sample cache, and the frozen backbone's features once per
    sample. ``data``: a table (Delta, Parquet, CSV manifest, image folder; a path or an
    ``s3://``/``abfss://``/``gs://`` URL), or several. Returns the caches' summary."""
    return _summary("prepare", data=data, **kwargs)


def fit(data: Union[str, List[str]], *, out: str, **kwargs: Unpack[FitFlags]) -> Summary:
    """``trainer fit``: trains a head (or fine-tunes) on ``data`` into the run directory ``out``
    (``epochs=``, ``lr=``, ``workers=``, ``backbone=``, ``no_mlflow=True``...). Tracked in the
    notebook's MLflow under its active run (:mod:`kestrel.tracking`). Returns the run's
    ``summary.json``."""
    return _tracked("fit", data, out, kwargs)


def tune(data: Union[str, List[str]], *, out: str, **kwargs: Unpack[TuneFlags]) -> Summary:
    """``trainer tune``: TPE search over trials (``trials=``, ``parallel=``, ``space=``...),
    tracked as :func:`fit` is."""
    return _tracked("tune", data, out, kwargs)


def _tracked(command: str, data: Union[str, List[str]], out: str, kwargs: Dict[str, Any]) -> Summary:
    extra, finish = tracking.plan(kwargs)
    summary = _summary(command, data=data, out=out, **kwargs, **extra)
    finish(out)
    return summary


def evaluate(run_dir: Optional[str] = None, **kwargs: Unpack[EvaluateFlags]) -> Summary:
    """``trainer evaluate``: a run (``run_dir``) or an exported artifact (``model=``) on its test
    split or on ``data=``."""
    return _summary("evaluate", run=run_dir, **kwargs)


def export(run_dir: str, *, out: Optional[str] = None, **kwargs: Unpack[ExportFlags]) -> Summary:
    """``trainer export``: the run as a self-describing artifact (ONNX f32/int8, manifest,
    safetensors) in ``out`` (``quantize=``, ``register=``...)."""
    return _summary("export", run=run_dir, out=out, **kwargs)


def predict(model: str, data: str, *, out: str, **kwargs: Unpack[PredictFlags]) -> Summary:
    """``trainer predict``: the artifact ``model`` over every row of ``data``, written to ``out``
    (Parquet)."""
    return _summary("predict", model=model, data=data, out=out, **kwargs)


def publish(artifact: str, *, broker: str, **kwargs: Unpack[PublishFlags]) -> Summary:
    """``trainer publish``: offers the signed artifact to the fleet on ``broker``
    (``key=``, ``target=``...)."""
    return _summary("publish", artifact=artifact, broker=broker, **kwargs)


def status(*, broker: str, **kwargs: Unpack[StatusFlags]) -> Summary:
    """``trainer status``: the devices' reported state (one dict per device)."""
    result = _summary("status", broker=broker, **kwargs)
    return [result] if isinstance(result, dict) and result else result


def init_logging(verbosity: int = 0) -> None:
    """The Rust code's log records as Python ``logging`` records, on the loggers ``kestrel.*``
    (``kestrel.trainer.train.fit``, libraries under ``kestrel.lib``): 0 information (each epoch,
    each trial, each rank's start), 1 debug, -1 errors only (``RUST_LOG`` overrides). Takes effect
    when called. They are handed to ``logging`` while a command runs, so a notebook shows them in
    the cell as they happen; unless ``logging.getLogger("kestrel")`` already has handlers, one is
    added that writes them to ``sys.stderr`` (configure that logger to send them elsewhere)."""
    logger = logging.getLogger("kestrel")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.DEBUG if verbosity > 0 else logging.INFO if verbosity == 0 else logging.ERROR)
    _native.init_logging(verbosity)


def set_progress(hook: Optional[Callable[[int, str], None]]) -> None:
    """Sends the progress bars' lines to ``hook(bar, line)`` (``bar`` a number per bar, ``line``
    its text as the CLI draws it, empty once cleared) instead of the default: a display updated in
    place in a notebook cell, one rewritten line on a terminal's stderr. ``None`` restores it."""
    _progress.set_hook(hook)


init_logging(0)

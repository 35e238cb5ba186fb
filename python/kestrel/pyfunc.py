"""An exported Kestrel artifact as an MLflow model over images: the ``python_function`` flavor
of :class:`ImageClassifier` takes encoded images (a ``content`` column of bytes, or the first
column) and returns the predicted class names, so that ``mlflow.pyfunc.spark_udf(spark, uri,
result_type="string")`` scores a ``binaryFile`` DataFrame on the executors and
``mlflow.pyfunc.load_model(uri).predict(df)`` does it in the notebook. The artifact goes with the
model byte for byte and is loaded as the edge loads it (hashes, golden-sample health check).

(``trainer export --register`` logs the artifact as an ``onnx`` + ``python_function`` model over
preprocessed tensors, for ONNX tools; this flavor is the one for images.)
"""

from __future__ import annotations

from typing import Any, Optional

import mlflow.pyfunc

__all__ = ["ImageClassifier", "log_model"]


class ImageClassifier(mlflow.pyfunc.PythonModel):
    """Images in, class names out, through the Kestrel artifact logged with the model."""

    def load_context(self, context) -> None:
        from kestrel import _native

        self._model = _native.Predictor(context.artifacts["artifact"], 1)

    def predict(self, context, model_input, params: Optional[dict] = None):
        import pandas as pd

        if isinstance(model_input, pd.DataFrame):
            column = model_input["content"] if "content" in model_input.columns else model_input.iloc[:, 0]
        else:
            column = pd.Series(list(model_input))
        images = [bytes(b) if b is not None else b"" for b in column]
        names = [f"row {i}" for i in range(len(images))]
        results = self._model.predict(names, images, 1)
        return pd.Series([top[0][0] if top else None for top, _ in results], dtype="object")


def log_model(artifact: str, name: str = "model", registered_model_name: Optional[str] = None) -> Any:
    """Logs the exported artifact directory ``artifact`` as an :class:`ImageClassifier` model in
    the active MLflow run (``registered_model_name`` also registers it); MLflow's ``ModelInfo``."""
    import kestrel

    return mlflow.pyfunc.log_model(
        name=name,
        python_model=ImageClassifier(),
        artifacts={"artifact": artifact},
        pip_requirements=[f"kestrel=={kestrel.__version__}", "pandas"],
        registered_model_name=registered_model_name,
    )

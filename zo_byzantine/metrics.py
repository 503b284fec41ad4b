"""``compute_metrics`` for the Trainer: accuracy and macro-F1 by scikit-learn, offline.

scikit-learn's ``accuracy_score`` and ``f1_score(average="macro")`` (the mean over the classes present in the
predictions or the references, as GLUE's and LM-BFF's macro-F1) are plain functions: nothing to download.
``evaluate.load("accuracy")`` would fetch its script from the Hub, which an offline machine cannot.
"""

from __future__ import annotations

import numpy as np
from sklearn.metrics import accuracy_score, f1_score

METRICS = {
    "accuracy": lambda predicted, references: float(accuracy_score(references, predicted)),
    "f1": lambda predicted, references: float(f1_score(references, predicted, average="macro")),
}


def compute_metrics_fn(names: list[str]):
    """``compute_metrics(EvalPrediction) -> {name: value}`` from class logits (``accuracy``, ``f1``: macro)."""
    unknown = [name for name in names if name not in METRICS]
    if unknown:
        raise ValueError(f"metric {unknown[0]!r} is not supported; accepted: {', '.join(METRICS)}.")

    def compute_metrics(prediction):
        logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        predicted = np.asarray(logits).argmax(axis=-1)
        return {name: METRICS[name](predicted, np.asarray(prediction.label_ids)) for name in names}

    return compute_metrics

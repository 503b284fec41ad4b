"""``compute_metrics`` for the Trainer through the ``evaluate`` library, offline.

``evaluate.load("accuracy")`` fetches the metric script from the Hub; we load our own metric
modules from their file paths instead (evaluate's local-module mechanism), which needs no network.
"""

from __future__ import annotations

from importlib import resources

import evaluate
import numpy as np

MODULES = {"accuracy": "accuracy.py", "f1": "macro_f1.py"}


def load_metric(name: str):
    """An ``evaluate`` module for ``accuracy`` or ``f1`` (macro), loaded from a local file."""
    if name not in MODULES:
        raise ValueError(f"metric {name!r} is not supported; accepted: {', '.join(MODULES)}.")
    path = resources.files("zo_byzantine.evaluate_modules") / MODULES[name]
    return evaluate.load(str(path))


def compute_metrics_fn(names: list[str]):
    """``compute_metrics(EvalPrediction) -> {name: value}`` from class logits."""
    modules = {name: load_metric(name) for name in names}

    def compute_metrics(prediction):
        logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        predicted = np.asarray(logits).argmax(axis=-1)
        out = {}
        for module in modules.values():
            out.update(module.compute(predictions=predicted, references=prediction.label_ids))
        return out

    return compute_metrics

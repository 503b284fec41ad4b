"""Macro-F1: the unweighted mean over classes of F1 = 2 TP / (2 TP + FP + FN)."""

import datasets
import evaluate
import numpy as np


class MacroF1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Macro-F1 over the classes present in predictions or references.",
            citation="",
            inputs_description="predictions, references: class indices.",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        p, r = np.asarray(predictions), np.asarray(references)
        scores = []
        for c in np.union1d(p, r):
            tp, fp, fn = np.sum((p == c) & (r == c)), np.sum((p == c) & (r != c)), np.sum((p != c) & (r == c))
            scores.append(2 * tp / (2 * tp + fp + fn))
        return {"f1": float(np.mean(scores))}

"""Accuracy: the fraction of predictions equal to the references."""

import datasets
import evaluate
import numpy as np


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Accuracy = (1/N) sum_i [prediction_i == reference_i].",
            citation="",
            inputs_description="predictions, references: class indices.",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        return {"accuracy": float(np.mean(np.asarray(predictions) == np.asarray(references)))}

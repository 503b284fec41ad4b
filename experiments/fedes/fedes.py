"""FedES on MNIST (papers/001, Table I and Fig. 1) as a configuration of ``ZOByzantineTrainer`` (issue 20, item 2).

The paper's model: a 784-1024-1024-10 ReLU MLP (N = 1,863,690 parameters), cross-entropy, learning rate 0.01.
Its "# Data" column (94 batches at n_B = 64) means 10 clients of 6,000 training images. In a FedES round every
client k draws B_k = ceil(6,000 / n_B) antithetic Gaussian directions from its own seed, evaluates direction b on
its batch b, sends the B_k loss differences, and the server steps ``w -= alpha sum_k rho_k / B_k sum_b z_k^b l_k^b``
(with ``eps = sigma z`` and ``l = (f(w + eps) - f(w - eps)) / (2 sigma)``, eq. (7)).

Our configuration: ``directions="per_client"``, ``aggregator="mean"``, n = 10, b = 0, ``num_perturbations`` = B_k,
``per_device_train_batch_size`` = n_B, ``zo_eps`` = sigma = 1e-3 (the paper does not state sigma), constant
learning rate 0.01. ``--batches per_direction`` (``zo_direction_batch_size`` = n_B, ``per_device_train_batch_size``
= B_k n_B) gives each direction its own batch of n_B as FedES does (one epoch a round, its last batch filled from
the next epoch: 6,016 images per client at n_B = 64); ``--batches one`` (the runs before it; names without ``_db``)
evaluates all B_k directions on one batch of n_B examples per round (640 images a round over the federation at
n_B = 64): the directions, their number and the update are the paper's, the estimate averaging over fewer
examples.
FedGD (the paper's first-order reference, Fig. 1): ``estimator="first_order"``, each client's gradient on its whole
6,000 images, the server averaging them (full-batch gradient descent), learning rate 0.01; on equal-sized clients
only (``iid``, ``shards``). Under ``dirichlet`` the clients' sizes differ: FedES weights their scalars by size, as the
paper's rho_k, but every client uses the same number of directions (the paper's B_k = n_k / n_B differs by client).

Splits: ``iid``; non-IID (the paper does not say how its split is made): ``dirichlet`` (label proportions from a
Dirichlet(1) per client: unequal sizes, the server weighting by them) and ``shards`` (two label shards per client).

    python experiments/fedes/fedes.py --method fedes --n_B 1024 --split iid --minutes 50  # one run (resumes, below)
    python experiments/fedes/fedes.py --report                                           # fedes.md from the runs
    python experiments/fedes/fedes.py --smoke                                            # CI smoke

A run keeps a checkpoint under ``--runs_dir``/tmp/<run> at every evaluation and when its time is up; started again,
it resumes from there (the trainer's resume: the same trajectory) until ``--rounds``, and writes
``--runs_dir``/<run>.json with the whole curve. Table I's runs need more time than one CPU session: each can be
continued on another day or on a GPU by carrying its checkpoint.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import re
import sys
import tempfile
import time

import torch
from torch import nn
from transformers import TrainerCallback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # _common.py, shared with the benchmarks
sys.path.insert(0, HERE)
from _common import Progress, load_example  # noqa: E402

from zo_byzantine import ZOByzantineArguments, ZOByzantineTrainer  # noqa: E402
from zo_byzantine.metrics import compute_metrics_fn  # noqa: E402

CLIENTS, PER_CLIENT = 10, 6000
METHODS = ("fedes", "fedgd")
SPLITS = ("iid", "dirichlet", "shards")
SCHEDULES = ("constant", "linear", "cosine")
STARTED = time.monotonic()
RESULTS = HERE  # the committed runs and report, beside this script
LEARNING_RATE = 0.01  # the paper's alpha; constant unless --schedule decays it
PAPER = {64: (95.64, 95.58), 256: (94.15, 94.13), 1024: (93.76, 93.90)}  # Table I: i.i.d., non-i.i.d. (%)
LEVELS = (85.0, 90.0, 91.0, 92.0, 93.0, 94.0, 95.0)  # test accuracies (%) whose first round the report lists


class MLP(nn.Module):
    """784 -> 1024 -> ReLU -> 1024 -> ReLU -> 10 (1,863,690 parameters); ``loss`` = cross-entropy."""

    def __init__(self, width: int = 1024):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                    nn.Linear(width, 10))
        self.num_labels = 10

    def forward(self, x, labels=None):
        logits = self.layers(x)
        return {"logits": logits, "loss": None if labels is None else nn.functional.cross_entropy(logits, labels)}


def initial_model(seed: int) -> MLP:
    """A run's initial weights: PyTorch's default initialisation under ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return MLP()


def batches_per_client(n_b: int, per_client: int = PER_CLIENT) -> int:
    """B_k = ceil(n_k / n_B): 94, 24, 6 at n_B = 64, 256, 1024 (the paper's "# Data" column)."""
    return math.ceil(per_client / n_b)


def arguments(out: str, method: str, split: str, n_b: int, seed: int, rounds: int, eval_every: int,
              budget_gb: float, per_client: int, per_direction: bool = False,
              schedule: str = "constant") -> ZOByzantineArguments:
    """The federation of a FedES (or FedGD) run; see the module's docstring. ``schedule``: the learning rate's,
    from 0.01 (the paper's, constant) over ``rounds`` (``transformers``' ``lr_scheduler_type``)."""
    if method not in METHODS:
        raise ValueError(f"--method={method!r}; accepted: {', '.join(METHODS)}.")
    if split not in SPLITS:
        raise ValueError(f"--split={split!r}; accepted: {', '.join(SPLITS)}.")
    if schedule not in SCHEDULES:
        raise ValueError(f"--schedule={schedule!r}; accepted: {', '.join(SCHEDULES)}.")
    common = dict(
        output_dir=out, num_clients=CLIENTS, num_byzantine=0, aggregator="mean", attack="none", partition=split,
        learning_rate=LEARNING_RATE, lr_scheduler_type=schedule, max_steps=rounds, eval_strategy="steps",
        eval_steps=eval_every, logging_steps=eval_every, save_strategy="steps", save_steps=eval_every,
        save_total_limit=1, report_to=[], disable_tqdm=True,
        remove_unused_columns=False, seed=seed, per_device_eval_batch_size=10_000, zo_cache_budget_gb=budget_gb,
    )
    if method == "fedgd":
        return ZOByzantineArguments(**common, estimator="first_order", per_device_train_batch_size=per_client)
    nu = batches_per_client(n_b, per_client)
    return ZOByzantineArguments(**common, directions="per_client", zo_eps=1e-3, num_perturbations=nu,
                                per_device_train_batch_size=nu * n_b if per_direction else n_b,
                                zo_direction_batch_size=n_b if per_direction else 0)


def stem(method: str, split: str, n_b: int, seed: int, smoke: bool = False, inputs: str = "standardized",
         batches: str = "one", schedule: str = "constant", rounds: int = 0) -> str:
    """A run's file name: ``fedes_iid_nB64_s0``; FedGD has no n_B (full local batches): ``fedgd_iid_s0``; ``_unit``
    for pixels in [0, 1]; ``_db`` for a batch per direction; ``_cosine900`` for a learning rate decaying over 900
    rounds (the schedule depends on the length: another length is another run); a smoke run's name starts with
    ``smoke_`` (its checkpoints never meet a real run's)."""
    name = f"fedes_{split}_nB{n_b}_s{seed}" if method == "fedes" else f"fedgd_{split}_s{seed}"
    name += "_unit" if inputs == "unit" else ""
    name += "_db" if batches == "per_direction" and method == "fedes" else ""
    name += f"_{schedule}{rounds}" if schedule != "constant" else ""
    return "smoke_" + name if smoke else name


STEM = re.compile(rf"(?P<smoke>smoke_)?(?P<method>fedes|fedgd)_(?P<split>{'|'.join(SPLITS)})(_nB(?P<n_B>\d+))?"
                  rf"_s(?P<seed>\d+)(?P<unit>_unit)?(?P<db>_db)?(_(?P<schedule>{'|'.join(SCHEDULES[1:])})(?P<rounds>\d+))?")


def parse_stem(name: str) -> dict | None:
    """``stem``'s arguments from a run's name (None for a name ``stem`` does not write): method, split, n_B (None
    for FedGD), seed, smoke, inputs, batches, schedule, rounds (0 for the constant rate)."""
    match = STEM.fullmatch(name)
    if match is None:
        return None
    parsed = {"method": match["method"], "split": match["split"],
              "n_B": int(match["n_B"]) if match["n_B"] else None, "seed": int(match["seed"]),
              "smoke": bool(match["smoke"]), "inputs": "unit" if match["unit"] else "standardized",
              "batches": "per_direction" if match["db"] else "one", "schedule": match["schedule"] or "constant",
              "rounds": int(match["rounds"] or 0)}
    if parsed["schedule"] != "constant" and parsed["rounds"] < 1:
        return None
    arguments = {key: value for key, value in parsed.items() if key != "n_B"}
    return parsed if stem(n_b=parsed["n_B"] or 0, **arguments) == name else None  # no leading zeros, no fedgd _db


def run_stem(args) -> str:
    """``stem`` of the command line's run."""
    return stem(args.method, args.split, args.n_B, args.seed, args.smoke, args.inputs, args.batches, args.schedule,
                args.rounds)


class StopWhenDiverged(TrainerCallback):
    """Ends a run that can learn nothing more and records the round in ``diverged_at``: its evaluation loss is no
    longer finite (the weights overflowed), or every round since the previous training log was skipped (the
    trainer skips a round whose aggregate is not finite and logs the count; weights that large can stay finite,
    as the non-IID n_B = 1,024 run's did at an evaluation loss of 1.5e26, and then every round is skipped)."""

    def __init__(self):
        self.diverged_at = None
        self.logged_at = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.logged_at = state.global_step  # a resumed run's window starts at its checkpoint

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "skipped_rounds" in logs:
            window, self.logged_at = state.global_step - self.logged_at, state.global_step
            if window > 0 and logs["skipped_rounds"] >= window:
                self.stop(state, control)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if not math.isfinite(metrics["eval_loss"]):
            self.stop(state, control)

    def stop(self, state, control):
        if self.diverged_at is None:
            self.diverged_at = state.global_step
        control.should_training_stop = True


def last_checkpoint(folder: str) -> str | None:
    """The newest complete checkpoint under ``folder`` (``checkpoint-<round>`` holding its ``trainer_state.json``,
    which the Trainer writes after the weights), or None."""
    steps = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        step = name.removeprefix("checkpoint-")
        if name != step and step.isdigit() and os.path.isfile(os.path.join(folder, name, "trainer_state.json")):
            steps.append(int(step))
    return os.path.join(folder, f"checkpoint-{max(steps)}") if steps else None


def run(args, previous: dict | None) -> dict:
    """Train (or resume) one run until ``--rounds`` or its time; ``previous``: the run's JSON from earlier legs."""
    mnist = load_example("run_mnist_fed")
    standardized = args.inputs == "standardized"
    train, test = mnist.MNIST(args.data, "train", standardized), mnist.MNIST(args.data, "test", standardized)
    per_client = PER_CLIENT
    if args.smoke:  # 10 clients of 64 images, 500 test images
        keep = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))[: CLIENTS * 64]
        train.x, train.labels = train.x[keep], train.labels[keep]
        test.x, test.labels = test.x[:500], test.labels[:500]
        per_client = 64
    progress = Progress(None if args.minutes is None else 60 * args.minutes,
                        None if args.wall_minutes is None else STARTED + 60 * args.wall_minutes)
    folder = os.path.join(args.runs_dir, "tmp", run_stem(args))
    zo = arguments(folder, args.method, args.split, args.n_B, args.seed, args.rounds, args.eval_every,
                   args.budget_gb, per_client, args.batches == "per_direction", args.schedule)
    trainer = ZOByzantineTrainer(model=initial_model(args.seed), args=zo, train_dataset=train, eval_dataset=test,
                                 data_collator=mnist.collate, compute_metrics=compute_metrics_fn(["accuracy"]),
                                 callbacks=[progress, diverged := StopWhenDiverged()])
    start = trainer.evaluate()["eval_accuracy"]  # the seeded initial model (train() starts a history without it)
    resume = last_checkpoint(folder)
    began = int(resume.rsplit("-", 1)[1]) if resume else 0
    if began >= args.rounds:  # a leg that saved its last checkpoint but not its JSON: nothing left to train
        with open(os.path.join(resume, "trainer_state.json")) as f:
            history, rounds = json.load(f)["log_history"], began
    else:
        trainer.train(resume_from_checkpoint=resume)
        history, rounds = trainer.state.log_history, trainer.state.global_step  # restored: the whole run's
    curve = [(0, start)] + [(e["step"], e["eval_accuracy"]) for e in history if "eval_accuracy" in e]
    device = next(trainer.model.parameters()).device
    device = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    legs = [leg for leg in (previous or {}).get("legs", []) if leg["to"] <= began] if resume else []
    if rounds > began:
        legs.append({"device": device, "from": began, "to": rounds, "seconds": round(progress.spent, 2)})
    result = {
        "method": args.method, "split": args.split, "n_B": args.n_B, "seed": args.seed, "inputs": args.inputs,
        "batches": args.batches if args.method == "fedes" else None,
        "schedule": args.schedule, "schedule_rounds": args.rounds if args.schedule != "constant" else None,
        "clients": CLIENTS, "diverged_at": diverged.diverged_at,
        "per_client": per_client, "estimator": zo.estimator, "directions": zo.directions,
        "directions_per_client": zo.num_perturbations if args.method == "fedes" else None,
        "parameters": sum(p.numel() for p in trainer.model.parameters()), "device": device,
        "start": start, "max": max(a for _, a in curve), "final": curve[-1][1], "rounds": rounds,
        "seconds": sum(leg["seconds"] for leg in legs), "ms_per_round": 1000 * progress.spent / max(rounds - began, 1),
        "legs": legs, "curve": curve, "loss": [(e["step"], e["loss"]) for e in history if "loss" in e],
    }
    print(f"{args.method} {args.split} n_B {args.n_B}: start {start:.3f} max {result['max']:.3f} final "
          f"{result['final']:.3f} after {rounds} rounds ({result['ms_per_round']:.1f} ms/round on {device}, "
          f"from round {began})", flush=True)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="fedes", choices=METHODS)
    parser.add_argument("--split", default="iid", choices=SPLITS)
    parser.add_argument("--n_B", type=int, default=None,
                        help="FedES batch size n_B (directions = ceil(6000 / n_B)); default 64; not for fedgd")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--inputs", default="standardized", choices=("standardized", "unit"),
                        help="pixels (x/255 - 0.1307)/0.3081 or x/255 (the paper does not say)")
    parser.add_argument("--batches", default="one", choices=("one", "per_direction"),
                        help="one batch of n_B for all directions of a round, or one per direction (FedES only)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of the run (default: until its time is up; required with --schedule)")
    parser.add_argument("--schedule", default="constant", choices=SCHEDULES,
                        help="learning rate from 0.01 (the paper's: constant), decaying to 0 over --rounds")
    parser.add_argument("--minutes", type=float, default=None, help="stop after this much training time")
    parser.add_argument("--wall_minutes", type=float, default=None, help="stop at this wall time since start")
    parser.add_argument("--eval_every", type=int, default=50)
    parser.add_argument("--budget_gb", type=float, default=2.0, help="zo_cache_budget_gb (stacked models, cache)")
    parser.add_argument("--data", default=os.path.join(ROOT, "..", "shared", "data", "mnist"))
    parser.add_argument("--runs_dir", default=None, help="<run>.json and the checkpoints (tmp/<run>) of each run; "
                        "default fedes_runs beside this script (--smoke: a temporary folder)")
    parser.add_argument("--report", action="store_true",
                        help="write fedes.md from the runs of --runs_dir (this script's folder for the default), "
                        "run nothing")
    parser.add_argument("--restart", action="store_true",
                        help="train a run whose JSON is there but whose checkpoint is not again from round 0, "
                        "replacing its JSON (refused without it)")
    parser.add_argument("--smoke", action="store_true", help="10 clients x 64 images, 4 rounds")
    args = parser.parse_args(argv)
    if args.method == "fedgd" and (args.n_B is not None or args.batches != "one"):
        parser.error("--method fedgd: each client's gradient on its whole data; --n_B and --batches are FedES's "
                     "(accepted with fedgd: neither).")
    args.n_B = 64 if args.n_B is None else args.n_B
    if args.rounds is None:
        if args.schedule != "constant":
            parser.error(f"--schedule {args.schedule} decays the learning rate over --rounds: give --rounds "
                         "(accepted values: integers >= 1).")
        args.rounds = 100_000
    for name in ("n_B", "rounds", "eval_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)}: accepted values are integers >= 1.")
    if args.seed < 0:
        parser.error(f"--seed={args.seed}: accepted values are integers >= 0.")
    for name in ("minutes", "wall_minutes"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            parser.error(f"--{name}={getattr(args, name)}: accepted values are numbers > 0.")
    if not args.budget_gb >= 0:
        parser.error(f"--budget_gb={args.budget_gb}: accepted values are numbers >= 0.")
    if args.method == "fedgd" and args.split == "dirichlet":
        parser.error("--method fedgd --split dirichlet: FedGD's full local batch needs clients of equal size; "
                     "accepted splits for fedgd: iid, shards.")
    if args.report and args.smoke:
        parser.error("--report --smoke: --report reads the runs of --runs_dir, --smoke runs in a new temporary "
                     "folder; give one of them.")
    default_runs = args.runs_dir is None
    if default_runs:
        args.runs_dir = tempfile.mkdtemp(prefix="fedes_smoke_") if args.smoke else os.path.join(RESULTS, "fedes_runs")
    if args.report:
        if not os.path.isdir(args.runs_dir):
            parser.error(f"--runs_dir={args.runs_dir!r}: no such folder (nothing has been run there).")
        if importlib.util.find_spec("matplotlib") is None:  # before the table is written, not after
            parser.error("--report draws Fig. 1 with matplotlib, which is not installed: pip install -e '.[bench]'.")
        return report(args.runs_dir, os.path.join(RESULTS if default_runs else args.runs_dir, "fedes.md"))
    if args.smoke:
        args.rounds, args.eval_every = min(args.rounds, 4), 2
    path = os.path.join(args.runs_dir, run_stem(args) + ".json")
    previous = None
    if os.path.exists(path):
        with open(path) as f:
            previous = json.load(f)
        if previous["rounds"] >= args.rounds or previous.get("diverged_at") is not None:
            print(f"{path}: finished ({previous['rounds']} rounds); kept as it is.")
            return previous
        folder = os.path.join(args.runs_dir, "tmp", run_stem(args))
        if last_checkpoint(folder) is None and not args.restart:
            parser.error(f"{path} records {previous['rounds']} rounds but {folder} holds no checkpoint to resume "
                         "from: give --restart to train this run again from round 0 (its JSON is replaced).")
    logging.disable(logging.WARNING)
    result = run(args, previous)
    os.makedirs(args.runs_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f)
    return result


def first_round(curve: list, level: float) -> int | None:
    """The first evaluated round of ``curve`` (``(round, accuracy in [0, 1])`` pairs) whose accuracy is at least
    ``level`` percent, or None when no evaluation reaches it."""
    return next((step for step, accuracy in curve if 100 * accuracy >= level), None)


def report(runs_dir: str, path: str, plots: bool = True) -> list[str]:
    """Table I's layout from the runs found (smoke runs left out): per n_B (and FedGD) and split, the best test
    accuracy of each seed, after how many rounds, the mean time per round and the devices; the paper's figure
    beside it. Then the first round at which each run reached each of ``LEVELS`` and, with ``plots``, Fig. 1's
    comparison (``fedes_fig1.png`` beside ``path``: test accuracy and the clients' training loss against rounds of
    the i.i.d. runs at the constant rate, FedES and FedGD)."""
    runs: dict[tuple, list[dict]] = {}
    for name in sorted(os.listdir(runs_dir)):
        if name.endswith(".json") and not name.startswith("smoke_"):
            with open(os.path.join(runs_dir, name)) as f:
                r = json.load(f)
            n_b = r["n_B"] if r["method"] == "fedes" else None
            key = (r["method"], r["split"], n_b, r.get("inputs", "standardized"), r.get("batches") or "one",
                   r.get("schedule", "constant"), r.get("schedule_rounds") or 0)
            runs.setdefault(key, []).append(r)

    def cell(key):
        if key not in runs:
            return "not run"
        parts = []
        for r in runs[key]:
            legs = r.get("legs", [{"device": r["device"], "from": 0, "to": r["rounds"], "seconds": r["seconds"]}])
            devices = sorted({"H100" if "H100" in leg["device"] else leg["device"] for leg in legs})
            timed = sum(leg["to"] - leg["from"] for leg in legs)  # legs may leave gaps (a leg not recorded)
            pace = f"{sum(leg['seconds'] for leg in legs) / timed:.2f} s/round" if timed else "time not recorded"
            end = f"diverged at round {r['diverged_at']}" if r.get("diverged_at") is not None else pace
            parts.append(f"{100 * r['max']:.2f} ({r['rounds']} rounds, {end}, {'+'.join(devices)})")
        return " / ".join(parts)

    lines = ["| method | inputs | batches | learning rate | n_B | directions per client | paper i.i.d. | ours iid | "
             "paper non-i.i.d. | ours dirichlet | ours shards |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    first = ("standardized", "one", "constant", 0)
    kinds = sorted({key[3:] for key in runs} | {first}, key=lambda kind: (kind != first, kind))  # first: the paper's
    for kind in kinds:
        inputs, batches, schedule, length = kind
        rate = f"{LEARNING_RATE:g}" + ("" if schedule == "constant" else f", {schedule} to 0 over {length} rounds")
        for n_b, (iid, non_iid) in PAPER.items():
            cells = [cell(("fedes", split, n_b, *kind)) for split in SPLITS]
            if any(c != "not run" for c in cells) or kind == first:
                lines.append(f"| FedES | {inputs} | {batches} | {rate} | {n_b} | {batches_per_client(n_b)} | {iid} | "
                             f"{cells[0]} | {non_iid} | {cells[1]} | {cells[2]} |")
        cells = [cell(("fedgd", split, None, *kind)) for split in SPLITS]
        if any(c != "not run" for c in cells) or kind == first:
            lines.append(f"| FedGD | {inputs} | (all) | {rate} | {PER_CLIENT} | (gradient) | | {cells[0]} | | "
                         f"{cells[1]} | {cells[2]} |")
    named = {stem(method, split, n_b or 0, r["seed"], inputs=inputs, batches=batches, schedule=schedule,
                  rounds=length): r
             for (method, split, n_b, inputs, batches, schedule, length), group in runs.items() for r in group}
    lines += ["", "First evaluated round with a test accuracy at or above each level (-: not within the rounds run; "
              "a round is known to the run's evaluation interval):", "",
              "| run | rounds run | " + " | ".join(f"{level:g} %" for level in LEVELS) + " |",
              "|---|---|" + "---|" * len(LEVELS)]
    for name, r in named.items():
        found = [first_round(r["curve"], level) for level in LEVELS]
        lines.append(f"| {name} | {r['rounds']} | " + " | ".join("-" if f is None else str(f) for f in found) + " |")
    lines += ["", "Test accuracy (%) at every evaluation (round: accuracy):", ""]
    for name, r in named.items():
        lines.append(f"- {name}: " + ", ".join(f"{point[0]}: {100 * point[1]:.1f}" for point in r["curve"]))
    with open(path, "w") as f:
        f.write("\n".join(["# FedES on MNIST (papers/001, Table I), `python experiments/fedes/fedes.py --report`", ""]
                          + lines) + "\n")
    print("\n".join(lines))
    if plots:
        plot_fig1(named, os.path.join(os.path.dirname(path), "fedes_fig1.png"))
    return lines


def plot_fig1(named: dict, path: str) -> None:
    """Fig. 1's comparison: the i.i.d. runs at the paper's constant rate (FedES per n_B and batches; FedGD), test
    accuracy and the clients' training loss against communication rounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = {name: r for name, r in named.items()
             if r["split"] == "iid" and r.get("schedule", "constant") == "constant"
             and r.get("inputs", "standardized") == "standardized"}
    fig, (accuracy, loss) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in shown.items():
        accuracy.plot(*zip(*[(step, 100 * a) for step, a in r["curve"]], strict=True), label=name)
        if r["loss"]:
            loss.plot(*zip(*r["loss"], strict=True), label=name)
    accuracy.set(xlabel="communication round", ylabel="test accuracy (%)", ylim=(40, 100),
                 title=f"FedES and FedGD on MNIST, i.i.d., learning rate {LEARNING_RATE:g}")
    loss.set(xlabel="communication round", ylabel="training loss (logged)", yscale="log",
             title="training loss reported by the clients")
    for ax in (accuracy, loss):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()

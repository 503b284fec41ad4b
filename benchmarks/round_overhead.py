"""Time per federated round / time of two plain forwards, and generator passes, against n.

Total examples per round fixed (64 by default, sequences padded to 64 tokens); n clients x
64/n examples each. Batched schedule (ours: perturb once, one forward over all clients) vs the
naive schedule (perturb, forward, restore per client, as FedKSeed/DeComFL simulate it).

    python benchmarks/round_overhead.py [--examples 64] [--seq-len 64] [--clients 1 4 16 64]
"""

from __future__ import annotations

import argparse
import logging
import tempfile

import torch
from _common import RandomTokens, best_time, machine, minilm

from zo_byzantine import ZOByzantineArguments, ZOByzantineTrainer
from zo_byzantine.perturbation import COUNTER, direction_seed


def build(model, n, examples, seq_len, tmp):
    dataset = RandomTokens(4 * examples, seq_len, model.config.vocab_size)
    args = ZOByzantineArguments(
        output_dir=tmp,
        num_clients=n,
        per_device_train_batch_size=examples // n,
        max_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        learning_rate=1e-7,
        remove_unused_columns=False,
    )
    trainer = ZOByzantineTrainer(model=model, args=args, train_dataset=dataset)
    trainer.create_optimizer()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    return trainer, inputs


def batched_round(trainer, model, inputs):
    trainer.training_step(model, inputs)
    trainer.optimizer.step()


def naive_round(trainer, model, inputs, n, per_client):
    """Per client: perturb +mu, forward, perturb -mu, forward, restore; then the update."""
    seed = direction_seed(0, trainer.state.global_step, 1, 0)
    mu = trainer.args.zo_eps
    model.eval()
    with torch.no_grad():
        for c in range(n):
            chunk = {k: v[c * per_client : (c + 1) * per_client] for k, v in inputs.items()}
            trainer.round_clients(model, chunk, 1).losses([[(seed, mu)]])
            trainer.round_clients(model, chunk, 1).losses([[(seed, -mu)]])
    trainer.optimizer.stage([(seed, 0.0)])
    trainer.optimizer.step()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("zo_byzantine").setLevel(logging.ERROR)
    model, source = minilm()
    d = sum(p.numel() for p in model.parameters())
    print(f"# round overhead: BERT {d / 1e6:.1f}M parameters, {source}; {machine()}")
    print(f"# {args.examples} examples per round, {args.seq_len} tokens, nu=1, K=1, fp32")
    print(
        "| n | two forwards (s) | batched round (s) | ratio | gen passes | naive round (s) | naive ratio "
        "| naive passes |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.clients:
            trainer, inputs = build(model, n, args.examples, args.seq_len, tmp)
            model.eval()

            def two_forwards():
                with torch.no_grad():
                    model(**inputs)
                    model(**inputs)

            floor = best_time(two_forwards, args.repeats)
            start = COUNTER.drawn
            ours = best_time(lambda: batched_round(trainer, model, inputs), args.repeats)
            passes = (COUNTER.drawn - start) / (args.repeats + 1) / d
            start = COUNTER.drawn
            per = args.examples // n
            naive = best_time(lambda: naive_round(trainer, model, inputs, n, per), args.repeats)
            naive_passes = (COUNTER.drawn - start) / (args.repeats + 1) / d
            rows[n] = (floor, ours, naive)
            print(
                f"| {n} | {floor:.3f} | {ours:.3f} | {ours / floor:.2f} | {passes:.0f} | {naive:.3f} | "
                f"{naive / floor:.2f} | {naive_passes:.0f} |",
                flush=True,
            )
    if 4 in rows and 64 in rows:
        growth = (rows[64][1] / rows[64][0]) / (rows[4][1] / rows[4][0])
        print(f"ratio(n=64) / ratio(n=4) = {growth:.3f} (target <= 1.2)")
    if 16 in rows:
        floor, ours, naive = rows[16]
        print(
            f"overhead at n=16: batched {ours - floor:.3f} s, naive {naive - floor:.3f} s, "
            f"naive/batched = {(naive - floor) / max(ours - floor, 1e-9):.1f}x (target >= 5)"
        )


if __name__ == "__main__":
    main()

"""The MNIST round of paper 004's table (n = 40 clients x 64 examples, b = 10 ALIE with omega searched, CWTM,
nu = 64, logistic regression 784 -> 10) in our trainer against a straightforward batched implementation of the
same round written here for the comparison (issue 19's target: ours <= 1.0x its time per round).

The peer round, in plain torch: draw the 64 directions of the 7,850 weights at once; evaluate all 128 models
``W +- mu z_r`` on the round's 2,560 examples in one contraction; per-client losses; ``g = (l+ - l-) / 2 mu``;
ALIE ``mean - omega std`` for 41 omegas at once, each aggregated by CWTM, the attacker keeping the omega that moves
the aggregate furthest from the honest mean; ``W -= lr / nu sum_r a_r z_r``. Same shapes and arithmetic as ours,
none of the protocol's bookkeeping (ledger, sanitising, participants, Trainer loop).

    python benchmarks/mnist_peer.py                      # 2 threads, 5 x 100 rounds each, alternating
    python benchmarks/mnist_peer.py --rounds 20 --repeats 1   # a quick look

Ours: ``examples/run_mnist_fed.py --attack alie --attack_kwargs '{"omega": "auto"}'`` (evaluation off), its
``train_runtime`` / rounds (data loading included, as a user sees it). Printed: median ms per round of each and the
median of the per-repeat ratios ours / peer.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _common import load_example, machine  # noqa: E402

N, BATCH, BYZANTINE, NU, MU, LR = 40, 64, 10, 64, 1e-3, 0.01
OMEGAS = torch.linspace(0.0, 10.0, 41, dtype=torch.float64)


def cwtm(vectors: torch.Tensor, trim: int) -> torch.Tensor:
    """Coordinate-wise trimmed mean over dim -2 (clients): drop ``trim`` lowest and highest per coordinate."""
    ordered = vectors.sort(dim=-2).values
    return ordered[..., trim : vectors.shape[-2] - trim, :].mean(dim=-2)


def peer_round(weights: torch.Tensor, x1: torch.Tensor, y: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One round on ``weights`` [10, 785] (bias last) with inputs ``x1`` [N * BATCH, 785] (a 1 appended)."""
    z = torch.randn(NU, *weights.shape, generator=generator)
    models = torch.cat([weights + MU * z, weights - MU * z])  # [2 nu, 10, 785]
    logits = torch.einsum("ed,gkd->gek", x1, models)  # [2 nu, N * BATCH, 10]
    losses = F.cross_entropy(logits.reshape(-1, 10), y.repeat(2 * NU), reduction="none")
    losses = losses.view(2 * NU, N, BATCH).double().mean(dim=-1)  # [2 nu, N]
    g = ((losses[:NU] - losses[NU:]) / (2 * MU)).T  # [N, nu]
    honest = g[BYZANTINE:]
    mean, std = honest.mean(dim=0), honest.std(dim=0)
    attacked = (mean - OMEGAS[:, None] * std)[:, None, :].expand(len(OMEGAS), BYZANTINE, NU)
    candidates = torch.cat([attacked, honest.expand(len(OMEGAS), *honest.shape)], dim=1)  # [41, N, nu]
    outputs = cwtm(candidates, BYZANTINE)  # [41, nu]
    chosen = outputs[(outputs - mean).norm(dim=-1).argmax()]
    step = (chosen.float() @ z.view(NU, -1)).view_as(weights) / NU
    return weights - LR * step


def time_peer(rounds: int, x1: torch.Tensor, y: torch.Tensor) -> float:
    weights = torch.zeros(10, 785)
    generator = torch.Generator().manual_seed(0)
    peer_round(weights, x1[: N * BATCH], y[: N * BATCH], generator)  # warm-up
    began = time.perf_counter()
    for t in range(rounds):
        start = (t * N * BATCH) % (len(y) - N * BATCH)  # the round's 2,560 examples
        weights = peer_round(weights, x1[start : start + N * BATCH], y[start : start + N * BATCH], generator)
    return (time.perf_counter() - began) / rounds


def time_ours(ex, data_dir: str, rounds: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        metrics = ex.main(["--data_dir", data_dir, "--output_dir", out, "--max_steps", str(rounds),
                           "--eval_strategy", "no", "--logging_steps", str(rounds),
                           "--attack", "alie", "--attack_kwargs", '{"omega": "auto"}'])
    return metrics["train_runtime"] / rounds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default=os.path.join(ROOT, "..", "shared", "data", "mnist"))
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)
    ex = load_example("run_mnist_fed")
    train = ex.MNIST(args.data_dir, "train")
    x1 = torch.cat([train.x, torch.ones(len(train.x), 1)], dim=1)
    time_ours(ex, args.data_dir, 2)  # warm-up (imports, allocator)
    peer, ours = [], []
    for _ in range(args.repeats):
        peer.append(time_peer(args.rounds, x1, train.labels))
        ours.append(time_ours(ex, args.data_dir, args.rounds))
    ratios = [o / p for o, p in zip(ours, peer, strict=True)]
    print(f"# MNIST round, n = {N} x {BATCH}, b = {BYZANTINE} ALIE (41 omegas), CWTM, nu = {NU}; {machine()}; "
          f"{args.repeats} x {args.rounds} rounds each, alternating")
    print(f"peer (batched, plain torch): {statistics.median(peer) * 1000:.1f} ms/round "
          f"(runs: {', '.join(f'{p * 1000:.1f}' for p in peer)})")
    print(f"ours (ZOByzantineTrainer):   {statistics.median(ours) * 1000:.1f} ms/round "
          f"(runs: {', '.join(f'{o * 1000:.1f}' for o in ours)})")
    print(f"ours / peer: {statistics.median(ratios):.2f} (median of the runs' ratios; target <= 1.0)")


if __name__ == "__main__":
    main()

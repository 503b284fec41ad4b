"""Cost of the attacker's omega search: every candidate's vector set at once (``aggregate_many``) against a loop
over the candidates, in one run, alternating the two.

    python benchmarks/omega_search.py     # MNIST Table 5 sizes: 30 honest + 10 Byzantine, nu = 64, 41 candidates

Both pick the same omega (tests/test_batched_search.py); the ratio is loop time / batched time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import machine

from zo_byzantine import build_aggregator, build_attack
from zo_byzantine.context import RoundContext


def loop_search(attack, honest, own, chain, ctx):
    """The search before batching: one rule call per candidate."""
    hbar, a = honest.mean(dim=0), attack.direction(honest)
    search = RoundContext(ctx.key, len(honest) + len(own), ctx.num_byzantine)
    best, best_gap = attack.candidates[0], -1.0
    for omega in attack.candidates:
        sent = (hbar + omega * a).expand(len(own), -1)
        gap = float((chain(torch.cat([honest, sent]), search).value - hbar).norm())
        if gap > best_gap:
            best, best_gap = omega, gap
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--honest", type=int, default=30)
    parser.add_argument("--byzantine", type=int, default=10)
    parser.add_argument("--width", type=int, default=64, help="nu (7850 for the parameter-space rows)")
    parser.add_argument("--candidates", type=int, default=41)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    honest = torch.randn(args.honest, args.width, generator=g, dtype=torch.float64)
    own = torch.randn(args.byzantine, args.width, generator=g, dtype=torch.float64)
    m = args.honest + args.byzantine
    ctx = RoundContext((0, 1, 1), m, args.byzantine, torch.tensor([False] * args.honest + [True] * args.byzantine))
    grid = [i * 10 / (args.candidates - 1) for i in range(args.candidates)]
    print(f"# omega search: {args.honest} honest + {args.byzantine} Byzantine vectors of {args.width}, "
          f"{args.candidates} candidates; {machine()}; median of {args.repeats}, alternating")
    print("| attack | pipeline | loop (ms) | batched (ms) | loop / batched | same omega |\n|---|---|---|---|---|---|")
    for name in ("alie", "foe"):
        attack = build_attack(name, omega="auto", candidates=grid)
        for rule, steps in (("cwtm", []), ("median", []), ("cwtm", ["nnm"]), ("krum", [])):
            chain = build_aggregator(rule, steps)
            times = {"loop": [], "batched": []}
            for _ in range(args.repeats):
                start = time.perf_counter()
                a = loop_search(attack, honest, own, chain, ctx)
                times["loop"].append(time.perf_counter() - start)
                start = time.perf_counter()
                b = attack(honest, own, chain, ctx).diagnostics["omega"]
                times["batched"].append(time.perf_counter() - start)
            loop, batched = (statistics.median(times[k]) * 1000 for k in ("loop", "batched"))
            print(f"| {name} | {'+'.join([*steps, rule])} | {loop:.2f} | {batched:.2f} | {loop / batched:.1f} | "
                  f"{a == b} |", flush=True)


if __name__ == "__main__":
    main()

"""Local steps linear in K (issue 19, item 2): a K = 8 round against eight K = 1 rounds (timed together), MiniLM,
4 clients x 4 examples, nu = 1, two forwards per direction, in one run with the rows interleaved.

    python benchmarks/local_steps.py               # target: K = 8 round <= 1.3 x 8 x the K = 1 round

Rows (``zo_cache_budget_gb`` 1, the default, unless said): 8 rounds of K = 1 timed together, one K = 1 round, and a
K = 8 round, with ``zo_schedule="auto"`` (K = 8: the clients' local models kept and, after the first step, all
clients in one forward: ``batched_clients.BatchedClients.stacked_clients``); K = 8 with ``two_forwards`` (local models
kept, one forward per client); K = 8 with them regenerated from their terms at every forward (``two_forwards``,
budget 0, the first path). Printed: best seconds, the ratio to the 8 rounds of K = 1 (best times, and the median
of the per-repeat ratios), the ratio to 8 x the best single K = 1 round, generator passes per round (units of d).
"""

from __future__ import annotations

import argparse
import logging
import tempfile

from _common import interleaved, machine, minilm
from overhead import build, ours

from zo_byzantine.directions import COUNTER


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    model, source = minilm()
    d = sum(p.numel() for p in model.parameters())
    k = args.steps
    print(f"# local steps: BERT {d / 1e6:.1f}M ({source}); {machine()}; 4 clients x 4 examples, {args.seq_len} "
          f"tokens, nu = 1; {args.repeats} rounds of all rows in turn")
    with tempfile.TemporaryDirectory() as tmp:
        base_row = f"{k} rounds of K = 1"  # timed together: one short round alone is at the mercy of the machine
        one_row = "K = 1, one round"
        settings = {base_row: (1, 1.0, "auto"), one_row: (1, 1.0, "auto"),
                    f"K = {k}, clients stacked (auto)": (k, 1.0, "auto"),
                    f"K = {k}, local models kept, client by client": (k, 1.0, "two_forwards"),
                    f"K = {k}, regenerated (budget 0)": (k, 0.0, "two_forwards")}
        rows, passes = {}, {}
        for name, (steps, budget, schedule) in settings.items():
            trainer, inputs = build(model, 4, 4, args.seq_len, tmp, zo_schedule=schedule, local_steps=steps,
                                    local_learning_rate=1e-7, zo_cache_budget_gb=budget)
            rounds = k if name == base_row else 1
            rows[name] = (lambda t=trainer, i=inputs, n=rounds: [ours(t, model, i) for _ in range(n)])
            start = COUNTER.drawn
            rows[name]()
            passes[name] = (COUNTER.drawn - start) / d / rounds
        times = interleaved(rows, args.repeats, reference=base_row)
    print(f"| row | best time (s) | ratio to {k} rounds of K = 1 (best) | median of the per-repeat ratios "
          f"| ratio to {k} x the best K = 1 round | generator passes per round |\n|---|---|---|---|---|---|")
    base, one = times[base_row][0], times[one_row][0]
    for name, (seconds, ratio) in times.items():
        print(f"| {name} | {seconds:.3f} | {seconds / base:.2f} | {ratio:.2f} | {seconds / (k * one):.2f} "
              f"| {passes[name]:.0f} |")


if __name__ == "__main__":
    main()

"""Which of the history rule's statistics tell FOE and ALIE from honest clients on MNIST, per round and per client?

Runs MNIST (``foe_rules.build_trainer``'s: n = 40, b = 10, nu = 64, Dirichlet 0.1) under plain CWTM with a fixed
attack and omega, records every round's per-row statistics of ``zo_byzantine.history.statistics`` (component along
the trimmed-mean reference ``c``, distance to it, sign balance of the residual) plus the residual's angle to the
reference, ``cos_i = <v_i - c, c> / (||v_i - c|| ||c||)``, and the row's own cosine to it, each also as a robust z
score over the round's rows, and writes ``separability.md``: per statistic, the honest rows' spread in one round, and
the range of the honest clients' means over the rounds beside the Byzantine clients' mean. A statistic separates an
attack where the Byzantine mean lies outside the honest clients' range.

    python experiments/foe_rules/separability.py                  # none, FOE 0.5 / 2 / 7 / 10, ALIE 1 / 3.8
"""

from __future__ import annotations

import argparse
import os
import statistics as stats
import sys
import tempfile
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import foe_rules  # noqa: E402

from zo_byzantine.aggregators import Rule, build_aggregator, register_aggregator  # noqa: E402
from zo_byzantine.history import robust_z, statistics  # noqa: E402

NAMES = ("z_along", "z_distance", "z_balance", "z_angle", "angle", "cos", "z_cos")
RECORDS: list[dict] = []


@register_aggregator("separability_probe")
class Probe(Rule):
    """CWTM, recording each call's per-row statistics (simulation: ``ctx.byzantine`` says which rows attack)."""

    name = "separability_probe"

    def __init__(self):
        self.inner = build_aggregator("cwtm")

    def check(self, m, f):
        self.inner.check(m, f)

    def aggregate(self, vectors, ctx):
        found, ref = statistics(vectors, ctx.num_byzantine)
        residual = vectors.double() - ref
        angle = (residual @ ref) / (found["distance"] * ref.norm()).clamp_min(torch.finfo(torch.float64).tiny)
        tiny = torch.finfo(torch.float64).tiny
        cos = (vectors.double() @ ref) / (vectors.double().norm(dim=1) * ref.norm()).clamp_min(tiny)
        values = {"z_along": robust_z(found["along"]), "z_distance": robust_z(found["distance"]),
                  "z_balance": robust_z(found["balance"]), "z_angle": robust_z(angle), "angle": angle,
                  "cos": cos, "z_cos": robust_z(cos)}
        RECORDS.append({"clients": list(ctx.clients), "byzantine": ctx.byzantine.tolist(),
                        **{k: v.tolist() for k, v in values.items()}})
        return self.inner(vectors, ctx)


def probe(attack: str, omega: float, rounds: int, mnist_dir: str) -> list[dict]:
    """One run's records (a fixed omega: the probe must see one attack, not an attacker's search over it)."""
    RECORDS.clear()
    args = types.SimpleNamespace(mnist_dir=mnist_dir, rounds=rounds, eval_every=rounds)
    kwargs = {"omega": omega} if attack in ("foe", "alie") else {}
    with tempfile.TemporaryDirectory() as out:
        trainer = foe_rules.build_trainer("mnist", 0, "separability_probe", attack, None, out, args,
                                          pre_aggregators=[], aggregator_kwargs={}, attack_kwargs=kwargs)
        trainer.train()
    return list(RECORDS)


def summary(records: list[dict], name: str, skip: int) -> str:
    """``honest sd in a round; honest clients' means min..max; Byzantine mean``."""
    within = stats.fmean(stats.pstdev([x for x, b in zip(r[name], r["byzantine"], strict=True) if not b])
                         for r in records[skip:])
    per_client: dict[tuple[int, bool], list[float]] = {}
    for r in records[skip:]:
        for c, x, b in zip(r["clients"], r[name], r["byzantine"], strict=True):
            per_client.setdefault((c, b), []).append(x)
    honest = [stats.fmean(v) for (_, b), v in per_client.items() if not b]
    byzantine = [stats.fmean(v) for (_, b), v in per_client.items() if b]
    tail = f"{stats.fmean(byzantine):.2f}" if byzantine else "-"
    return f"{within:.2f}; {min(honest):.2f}..{max(honest):.2f}; {tail}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", default=["none:0", "foe:0.5", "foe:2", "foe:7", "foe:10", "alie:1",
                                                      "alie:3.8"], help="attack:omega")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--skip", type=int, default=20, help="rounds left out of the means (the start)")
    parser.add_argument("--mnist_dir", default=os.path.join(HERE, "..", "..", "..", "shared", "data", "mnist"))
    parser.add_argument("--out", default=os.path.join(HERE, "separability.md"))
    args = parser.parse_args(argv)
    runs = [(attack, float(omega)) for attack, _, omega in (r.partition(":") for r in args.runs)]
    given = " ".join(sys.argv[1:] if argv is None else argv)
    lines = [f"Command: `{' '.join(['python experiments/foe_rules/separability.py', given]).strip()}`", "",
             f"MNIST, seed 0, plain CWTM, {args.rounds} rounds, means over rounds {args.skip}..{args.rounds}. Per "
             "statistic: "
             "the honest rows' standard deviation within a round (mean over rounds); the honest clients' means over "
             "the rounds, min..max; the Byzantine clients' mean (under none: the 10 designated clients' own honest "
             "rows). z_*: robust z over the round's rows; angle: cos of the residual v_i - c to the reference c; cos: "
             "cos of v_i itself to c (FOE's -hbar direction is invisible in it at omega 7 and 10: c is pulled by "
             "the attack's rows).", "",
             "| attack | omega | " + " | ".join(NAMES) + " |", "|---|---|" + "---|" * len(NAMES)]
    for attack, omega in runs:
        records = probe(attack, omega, args.rounds, args.mnist_dir)
        lines.append(f"| {attack} | {omega:g} | " + " | ".join(summary(records, n, args.skip) for n in NAMES) + " |")
        print(lines[-1], flush=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""Every client's report of a real SmolLM2 run, kept, and the rules' room under ALIE measured on them (issue 49).

With one direction a round every report is one scalar, ``g_i = z . grad L_i``. ``room.py`` measures ALIE's room
against CWTM by running the model; this measures it for any rule without the model. ``record`` runs the table's
``cpu_long`` cell without attack through ``examples/run_glue_fed.py`` (in process, CWTM as the rule) and writes each
round's 12 reports to a JSON-lines file. ``compare`` then replays those rounds for each rule named: the clients the
run marked Byzantine (0-2) are the attackers, ALIE is tuned against the rule each round as in training
(``server.robust_aggregate``, the server's own code path; a stateful rule carries its state from round to round),
and it prints per rule the mean ``||R - hbar||`` without attack and under ALIE, beside the mean ``||hbar||``, and
the rows a rule left out (for issue 46's history rule also the attackers' and the honest clients' agreement
and final scores). The honest reports come from one trajectory (the no-attack run's): the rules are compared
on the same rounds, not on the trajectories they would have led to.

    python experiments/smollm2/reports.py record --rounds 300          # ~7 minutes on the idle 2-core CPU
    python experiments/smollm2/reports.py compare                      # seconds
    python experiments/smollm2/reports.py compare --attack sf          # or foe
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
from table import EXAMPLE, HERE, command

from zo_byzantine.aggregators import CWTM, build_aggregator, register_aggregator
from zo_byzantine.attacks import build_attack
from zo_byzantine.context import RoundContext
from zo_byzantine.server import SkipRound, robust_aggregate

DEFAULT_FILE = os.path.join(HERE, "runs", "reports", "sst2_none_s0.jsonl")
RULES = {  # name -> (rule, pre-aggregation steps, the rule's settings)
    "mean": ("mean", (), {}),  # the reference: no robustness (ALIE's largest omega moves it furthest)
    "cwtm": ("cwtm", (), {}),
    "median": ("median", (), {}),
    "history(cwtm)": ("history", (), {"base": "cwtm"}),
    "history(median)": ("history", (), {"base": "median"}),
    "nnm+cwtm": ("cwtm", ("nnm",), {}),
    "cclip": ("cclip", (), {}),
    "geomed": ("geomed", (), {}),
    "krum": ("krum", (), {}),
}


class RecordedCWTM(CWTM):
    """CWTM that appends every call's rows to ``path`` (one JSON line: round, clients, Byzantine mask, values).
    Registered by :func:`record` only, so that importing this file leaves the library's registry as it is."""

    name = "recorded_cwtm"

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def aggregate(self, vectors, ctx):
        mask = None if ctx.byzantine is None else ctx.byzantine.tolist()
        with open(self.path, "a") as f:
            f.write(json.dumps({"round": ctx.key[1], "clients": list(ctx.clients or ()), "byzantine": mask,
                                "vectors": vectors.double().tolist()}) + "\n")
        return super().aggregate(vectors, ctx)


def record(path: str, rounds: int, seed: int, model: str) -> None:
    """Run the ``cpu_long`` no-attack cell for ``rounds`` rounds, appending every round's reports to ``path``."""
    if os.path.exists(path):
        raise SystemExit(f"{path} exists: remove it or name another --file (rounds would be appended twice)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    import run_glue_fed

    register_aggregator("recorded_cwtm", exist_ok=True)(RecordedCWTM)
    folder = os.path.join(os.path.dirname(path), f"run_s{seed}")
    extra = ("--aggregator", "recorded_cwtm", "--aggregator_kwargs", json.dumps({"path": path}), "--max_steps",
             str(rounds), "--do_eval", "false", "--eval_strategy", "no", "--save_strategy", "no")
    run_glue_fed.main(command("cpu_long", "sst2", "none", seed, folder, model, extra)[2:])


def load(path: str) -> list[dict]:
    """The recorded rounds, in order."""
    with open(path) as f:
        rounds = [json.loads(line) for line in f if line.strip()]
    if not rounds:
        raise SystemExit(f"{path}: no round recorded")
    return rounds


def replay(rounds: list[dict], rule: str, steps: tuple, settings: dict, attack) -> dict:
    """Means over ``rounds`` of ``||R - hbar||``, ``||hbar||`` and the rows left out, ``rule`` fed the recorded
    reports with the Byzantine rows replaced by ``attack``'s (None: their own reports). A stateful rule (issue 46's
    ``history``) adds ``agreement``, its mean per-round agreement record over the attackers' and the honest rows,
    and ``scores``, the clients' final scores (attackers, honest)."""
    chain = build_aggregator(rule, list(steps), **settings)
    state, shifts, norms, found = {}, [], [], {"byzantine_excluded": 0, "honest_excluded": 0}
    agreement = {True: [], False: []}
    for r in rounds:
        vectors = torch.tensor(r["vectors"], dtype=torch.float64)
        mask = torch.tensor(r["byzantine"]) if r["byzantine"] is not None else None
        f = sum(r["byzantine"] or ())  # the run's Byzantine clients: the rule is sized for them
        ctx = RoundContext((0, r["round"], 1), len(vectors), f, mask, tuple(r["clients"]), state)
        try:
            _, _, diagnostics, _, update = robust_aggregate(vectors, ctx, chain, attack)
        except SkipRound:
            continue
        if update is not None:
            state = update.state
            for byzantine, a in zip(r["byzantine"], update.record, strict=True):
                agreement[byzantine].append(a)
        shifts.append(diagnostics["aggregate_shift"])
        norms.append(diagnostics["honest_mean_norm"])
        for name in found:
            found[name] += diagnostics.get(name, 0)
    out = {"rounds": len(shifts), "shift": statistics.fmean(shifts), "signal": statistics.fmean(norms),
           **{name: count / max(len(shifts), 1) for name, count in found.items()}}
    if agreement[True] and agreement[False]:
        attackers = {c for r in rounds for c, b in zip(r["clients"], r["byzantine"], strict=True) if b}
        out["agreement"] = (statistics.fmean(agreement[True]), statistics.fmean(agreement[False]))
        out["scores"] = tuple(sorted(round(state[c][0], 2) for c in state if (c in attackers) == side)
                              for side in (True, False))
    return out


ATTACKS = {"alie": ("ALIE", {"omega": "auto"}), "sf": ("SF", {}), "foe": ("FOE", {"omega": "auto"})}


def compare(path: str, names: list[str], attack: str = "alie") -> str:
    """The table: per rule, mean shift without attack and under ``attack`` (ALIE and FOE tuned against the rule),
    and exclusions."""
    rounds = load(path)
    if any(r["byzantine"] is None or sum(r["byzantine"]) != 3 for r in rounds):
        raise SystemExit(f"{path}: every round must mark 3 clients Byzantine (the table's b = 3)")
    label, kwargs = ATTACKS[attack]
    adversary = build_attack(attack, **kwargs)
    lines = [f"{len(rounds)} rounds of `{os.path.relpath(path, HERE)}` (mean ||hbar|| over the 9 honest clients: "
             f"{replay(rounds, 'mean', (), {}, None)['signal']:.2f})", "",
             f"| rule | no attack: mean ‖R - hbar‖ | {label}: mean ‖R - hbar‖ | {label} / no attack "
             "| attackers left out a round | honest clients left out a round |", "|---|---|---|---|---|---|"]
    notes = []
    for name in names:
        rule, steps, settings = RULES[name]
        calm, attacked = (replay(rounds, rule, steps, settings, sent) for sent in (None, adversary))
        lines.append(f"| {name} | {calm['shift']:.2f} | {attacked['shift']:.2f} | "
                     f"{attacked['shift'] / calm['shift']:.2f} | {attacked['byzantine_excluded']:.2f} | "
                     f"{attacked['honest_excluded']:.2f} |")
        print(lines[-1], flush=True)
        if "agreement" in attacked:
            notes.append(f"{name} under {label}: mean agreement a round, attackers {attacked['agreement'][0]:.2f}, "
                         f"honest {attacked['agreement'][1]:.2f}; final scores, attackers {attacked['scores'][0]}, "
                         f"honest {attacked['scores'][1]}")
    return "\n".join([*lines, "", *notes])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    rec = sub.add_parser("record", help="run the no-attack cell and keep every round's reports")
    rec.add_argument("--rounds", type=int, default=300)
    rec.add_argument("--seed", type=int, default=0)
    rec.add_argument("--model", default="smollm2-135m", help="a shipped model name or a model folder")
    cmp = sub.add_parser("compare", help="each rule's shift on the recorded rounds, without attack and under an attack")
    cmp.add_argument("--attack", choices=list(ATTACKS), default="alie")
    cmp.add_argument("--rules", nargs="+", choices=list(RULES), default=list(RULES))
    for p in (rec, cmp):
        p.add_argument("--file", default=DEFAULT_FILE, help="the JSON-lines file of reports")
    args = parser.parse_args(argv)
    if args.mode == "record":
        if args.rounds < 1:
            parser.error(f"--rounds={args.rounds} must be >= 1")
        record(args.file, args.rounds, args.seed, args.model)
    else:
        print(compare(args.file, args.rules, args.attack))


if __name__ == "__main__":
    main()

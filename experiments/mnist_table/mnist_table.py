"""Reproduce paper 004 Table 5 (= paper 003 Table 1): MNIST logistic regression under attack.

Runs the grid (algorithm x rule x NNM x attack) over seeds with ``examples/run_mnist_fed.py``'s
``main``, one JSON per run under ``experiments/mnist_table/mnist_runs/`` (finished runs are skipped, so
the grid can be resumed), then writes ``mnist_table.csv``, ``mnist_table.md`` and PNG plots of
accuracy against rounds and against communicated bytes.

    python experiments/mnist_table/mnist_table.py                       # the whole grid, 3 seeds, 2 worker processes
    python experiments/mnist_table/mnist_table.py --smoke               # two cells, 20 rounds: the CI smoke
    python experiments/mnist_table/mnist_table.py --only "FedByZO CWTM" # a subset (prefix of the row name)
    python experiments/mnist_table/mnist_table.py --report              # tables and plots from finished runs only
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RESULTS = HERE  # the committed runs and reports, beside this script
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # _common.py, shared with the benchmarks
sys.path.insert(0, HERE)
from _common import load_example, run_jobs  # noqa: E402

# paper 004 Table 5 (mean of maximum accuracy, %); None where the paper has no cell
PAPER = {
    ("FedByZO", "cwtm", False): [87.4, None, 69.9, None, 71.2, 87.6],
    ("FedByZO", "cwtm", True): [90.3, 88.9, 74.0, 58.9, 59.2, 90.1],
    ("FedByZO", "krum", False): [65.1, None, 34.7, None, 44.1, 66.3],
    ("FedByZO", "krum", True): [90.6, 89.9, 70.4, 56.9, 58.2, 87.1],
    ("FedZO", "cwtm", False): [86.9, None, 61.8, None, 69.6, 87.3],
    ("FedZO", "cwtm", True): [90.1, 89.4, 74.3, 59.2, 62.7, 90.6],
    ("FedZO", "krum", False): [72.2, None, 32.2, None, 41.7, 67.2],
    ("FedZO", "krum", True): [90.4, 89.9, 67.0, 56.4, 65.2, 90.2],
    ("FedAvg", "cwtm", False): [87.6, None, 41.7, None, 42.5, 80.8],
    ("FedAvg", "cwtm", True): [90.6, 86.9, 76.8, 58.5, 67.3, 87.9],
    ("FedAvg", "krum", False): [75.7, None, 23.9, None, 50.0, 55.9],
    ("FedAvg", "krum", True): [88.6, 86.9, 73.0, 50.0, 57.7, 83.9],
}
COLUMNS = ["ALIE", "ALIE-NNM", "FOE", "FOE-NNM", "SF", "LF"]
ALGORITHMS = {
    "FedByZO": [],
    "FedZO": ["--aggregation_space", "parameter"],
    "FedAvg": ["--estimator", "first_order"],
}
# omega candidates: the paper leaves the grid open; 0, 0.5, ..., 10 (21 values) for every algorithm
OMEGA = {"omega": "auto", "candidates": [i / 2 for i in range(21)]}


def attack_args(column: str) -> list[str]:
    if column == "SF":
        return ["--attack", "sf"]
    if column == "LF":
        return ["--attack", "lf", "--attack_kwargs", json.dumps({"num_classes": 10})]
    name = column.split("-")[0].lower()
    target = "pipeline" if column.endswith("-NNM") else "rule"  # plain columns: tuned against the rule only
    return ["--attack", name, "--attack_kwargs", json.dumps({**OMEGA, "target": target})]


def cells(only: str | None = None):
    """(cell name, argv) for every cell of the table, plus the FedAvg baseline without attack."""
    out = [
        (
            "FedAvg mean no-attack",
            ["--estimator", "first_order", "--aggregator", "mean", "--num_byzantine", "0", "--attack", "none"],
        )
    ]
    for (algorithm, rule, nnm), paper in PAPER.items():
        for column, value in zip(COLUMNS, paper, strict=True):
            if value is None:
                continue
            name = f"{algorithm} {rule.upper()} {'NNM' if nnm else 'noNNM'} {column}"
            argv = [*ALGORITHMS[algorithm], "--aggregator", rule, *attack_args(column)]
            argv += ["--pre_aggregators", "nnm"] if nnm else []
            out.append((name, argv))
    return [c for c in out if only is None or c[0].startswith(only)]


def expected_cost(name: str) -> int:
    """A rough rank of a cell's run time, to start the longest runs first (two workers then finish together):
    the omega searches through NNM in R^d (FedZO, FedAvg; the sets themselves) > other R^d runs > FedByZO (R^nu)."""
    words = name.split()
    algorithm, rule, column = words[0], words[1], words[-1]
    cost = {"FedZO": 3, "FedByZO": 2, "FedAvg": 1}[algorithm]
    if column.endswith("-NNM") and algorithm != "FedByZO":
        cost += 10 if rule == "CWTM" else 5
    return cost


def file_stem(name: str) -> str:
    """A cell name as a file name: characters other than letters, digits, ``-``, ``.``, ``=`` become ``_``."""
    return "".join(c if c.isalnum() or c in "-.=" else "_" for c in name)


def run_one(job):
    """One run of ``examples/run_mnist_fed.py`` -> ``<runs_dir>/<cell>-seed<seed>.json`` (skipped if it exists)."""
    name, argv, seed, rounds, runs_dir, data_dir, eval_steps = job
    import torch

    torch.set_num_threads(1)
    path = os.path.join(runs_dir, f"{file_stem(name)}-seed{seed}.json")
    if os.path.exists(path):
        return path
    out = os.path.join(runs_dir, "tmp", f"{file_stem(name)}-{seed}")
    start = time.perf_counter()
    metrics = load_example("run_mnist_fed").main(
        [*argv, "--seed", str(seed), "--max_steps", str(rounds), "--output_dir", out, "--data_dir", data_dir,
         "--eval_steps", str(eval_steps), "--disable_tqdm", "true"]  # the grid's own bar counts the runs
    )
    metrics.update(cell=name, seed=seed, rounds=rounds, seconds=time.perf_counter() - start)
    with open(path, "w") as f:
        json.dump(metrics, f)
    print(f"{name} seed {seed}: max {metrics['max_accuracy']:.4f} ({metrics['seconds']:.0f} s)", flush=True)
    return path


def report(runs_dir: str, prefix: str = "mnist_table", out_dir: str = RESULTS, plots: bool = True) -> None:
    runs = [json.load(open(os.path.join(runs_dir, f))) for f in sorted(os.listdir(runs_dir)) if f.endswith(".json")]
    others = [r for r in runs if not isinstance(r, dict) or "cell" not in r]
    runs = [r for r in runs if r not in others]
    if not runs:
        raise SystemExit(f"{runs_dir!r} holds no grid runs (this script's runs carry a 'cell' key; {len(others)} other "
                         "JSON files). For a run of your own, use: python -m zo_byzantine inspect|plot RUN_DIR.")
    if others:
        print(f"skipped {len(others)} JSON files of {runs_dir!r} that are not grid runs", flush=True)
    by_cell: dict[str, list] = {}
    for run in runs:
        by_cell.setdefault(run["cell"], []).append(run)
    rows = []
    for name, group in by_cell.items():
        maxima = [100 * r["max_accuracy"] for r in group]
        # the same runs' maxima over the evaluations at rounds 20, 40, ... only (differs when --eval_steps < 20)
        every20 = [100 * max(a for s, a in r["curve"] if s % 20 == 0) for r in group]
        algorithm, rule, nnm, *column = name.split(" ")
        paper = None
        if column and column[0] in COLUMNS:
            paper = PAPER[(algorithm, rule.lower(), nnm == "NNM")][COLUMNS.index(column[0])]
        elif name == "FedAvg mean no-attack":
            paper = 91.0
        rows.append(
            {
                "cell": name,
                "seeds": len(group),
                "mean": statistics.mean(maxima),
                "std": statistics.stdev(maxima) if len(maxima) > 1 else 0.0,
                "mean_every20": statistics.mean(every20),
                "paper": paper,
                "omega": statistics.mean(o for r in group for o in r["attack_omega"])
                if group[0]["attack_omega"]
                else None,
                "seconds_per_run": statistics.mean(r["seconds"] for r in group),
            }
        )
    with open(os.path.join(out_dir, f"{prefix}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    dense = any(r["mean_every20"] != r["mean"] for r in rows)
    extra = " max at rounds 20, 40, ... |" if dense else ""
    lines = [
        f"| cell | ours (max acc. %, mean ± std) | seeds | paper | ours − paper | mean omega | s/run |{extra}",
        "|---|---|---|---|---|---|---|" + ("---|" if dense else ""),
    ]
    for r in rows:
        diff = "" if r["paper"] is None else f"{r['mean'] - r['paper']:+.1f}"
        omega = "" if r["omega"] is None else f"{r['omega']:.2f}"
        lines.append(
            f"| {r['cell']} | {r['mean']:.1f} ± {r['std']:.1f} | {r['seeds']} | {r['paper']} | {diff} "
            f"| {omega} | {r['seconds_per_run']:.0f} |" + (f" {r['mean_every20']:.1f} |" if dense else "")
        )
    with open(os.path.join(out_dir, f"{prefix}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    if plots:
        plot(by_cell, prefix, out_dir)


def plot(by_cell: dict, prefix: str, out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for column in COLUMNS:
        chosen = {k: v for k, v in by_cell.items() if k.endswith(f" {column}") and " CWTM " in k}
        if not chosen:
            continue
        fig, (by_round, by_bytes) = plt.subplots(1, 2, figsize=(11, 4))
        for name, group in sorted(chosen.items()):
            run = group[0]
            steps = [s for s, _ in run["curve"]][:-1]
            acc = [100 * a for _, a in run["curve"]][:-1]
            by_round.plot(steps, acc, label=name)
            if run["uplink_bytes_per_client_round"] is not None:  # None when the run ended before its first log
                up = run["uplink_bytes_per_client_round"] + run["downlink_bytes_per_client_round"]
                by_bytes.plot([s * up for s in steps], acc, label=name)
        by_round.set_xlabel("round")
        by_bytes.set_xlabel("bytes per client (up + down)")
        by_bytes.set_xscale("log")
        for ax in (by_round, by_bytes):
            ax.set_ylabel("test accuracy (%)")
            ax.grid(alpha=0.3)
        by_round.legend(fontsize=6)
        fig.suptitle(f"MNIST, n=40, b=10, alpha=0.1, {column} (seed {group[0]['seed']})")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"{prefix}_{column}.png"), dpi=90)
        plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--eval_steps", type=int, default=20, help="rounds between test evaluations")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--only", default=None, help="run only cells whose name starts with this")
    parser.add_argument("--data_dir", default=os.path.join(ROOT, "..", "shared", "data", "mnist"))
    parser.add_argument("--runs_dir", default=os.path.join(RESULTS, "mnist_runs"))
    parser.add_argument("--smoke", action="store_true", help="two cells, 20 rounds, one seed, into --runs_dir")
    parser.add_argument("--report", action="store_true", help="only write the table and plots")
    args = parser.parse_args()
    if args.smoke:
        import tempfile

        if args.runs_dir == os.path.join(RESULTS, "mnist_runs"):
            args.runs_dir = tempfile.mkdtemp()
        args.rounds, args.seeds = 20, [0]
        jobs = [c for c in cells() if c[0] in ("FedByZO CWTM noNNM ALIE", "FedAvg mean no-attack")]
    else:
        jobs = cells(args.only)
    os.makedirs(os.path.join(args.runs_dir, "tmp"), exist_ok=True)
    if not args.report:
        work = [
            (name, argv, seed, args.rounds, args.runs_dir, args.data_dir, args.eval_steps)
            for name, argv in sorted(jobs, key=lambda job: -expected_cost(job[0]))  # longest first
            for seed in args.seeds
        ]
        run_jobs(run_one, [(job,) for job in work], args.workers)
    if args.smoke:
        report(args.runs_dir, "mnist_smoke", args.runs_dir, plots=False)  # no matplotlib needed (CI)
    else:  # the committed results only from the committed runs; any other --runs_dir gets its own report
        committed = args.runs_dir == os.path.join(RESULTS, "mnist_runs")
        report(args.runs_dir, out_dir=RESULTS if committed else args.runs_dir)


if __name__ == "__main__":
    main()

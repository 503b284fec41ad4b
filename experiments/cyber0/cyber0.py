"""Reproduce the first CYBER-0 paper (papers/000): Table 1 and Figure 1c, MNIST logistic regression.

Table 1 (m = 40 clients, k = nu = 64, lr 0.01, batch 64, 400 steps, beta = alpha, 3 seeds): test accuracy of

- CYBER-0 (FedByZO: CWTM on the clients' R^nu scalars) under its Full-Knowledge attack (``tma``),
- first-order trimmed mean (FedAvg + CWTM in R^d) under Fang et al.'s full-knowledge trim attack (``fang_trim``),
- first-order Krum (FedAvg + Krum in R^d) under Fang et al.'s full-knowledge Krum attack (``fang_krum``),

for Byzantine fractions alpha in {0.125, 0.25, 0.375} (b = 5, 10, 15), on an IID split and on a label-skewed one
(``shards``: sorted by label, two shards per client, so each client holds one or two digits). Extra rows, not in
the paper: CYBER-0 under the Fang trim attack (the same attack on R^nu), CYBER-0 under the Full-Knowledge attack
with its order statistic taken among all m clients' true values (``tma`` with ``ranked="all"``: Alg. 3 as written
ranks the honest values only, which stops harming the trimmed mean once floor(beta m) passes half of them), and the
two references without Byzantine clients (FedAvg with the mean; CYBER-0 with the mean).

Figure 1c (m = 12, b = 3, alpha = beta = 0.25, non-IID): the honest training loss against rounds under the
Full-Knowledge, Always Small, Always Large, Random Choice and Label Flipping attacks (and no attack).

One JSON per run under ``experiments/cyber0/cyber0_runs/`` (finished runs are skipped: the script resumes), then
``cyber0.md``, ``cyber0.json`` and ``cyber0_fig1c.png`` beside this script.

    python experiments/cyber0/cyber0.py               # everything, 3 seeds, 2 worker processes
    python experiments/cyber0/cyber0.py --smoke       # every configuration for 10 rounds, one seed (the CI smoke)
    python experiments/cyber0/cyber0.py --report      # tables and plot from finished runs only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RESULTS = HERE  # the committed runs and reports, beside this script
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # _common.py, shared with the benchmarks
sys.path.insert(0, os.path.join(ROOT, "experiments", "mnist_table"))  # mnist_table.run_one: one run of the grid
sys.path.insert(0, HERE)
from _common import run_jobs  # noqa: E402
from mnist_table import run_one  # noqa: E402

ALPHAS = (0.125, 0.25, 0.375)
CLIENTS = 40
# paper 000 Table 1: test accuracy (%), mean and std over 3 seeds, for alpha = 0.125, 0.25, 0.375
PAPER = {
    "Krum / Fang Krum": [(69.2, 1.6), (10.2, 1.2), (6.9, 2.5)],
    "Trimmed mean / Fang trim": [(86.6, 0.3), (74.8, 1.1), (36.0, 4.1)],
    "CYBER-0 / Full-Knowledge": [(87.1, 0.8), (80.8, 1.0), (60.3, 2.9)],
}
ROWS = {  # row -> argv (alpha-dependent parts added by table_cells)
    "Krum / Fang Krum": ["--estimator", "first_order", "--aggregator", "krum", "--attack", "fang_krum"],
    "Trimmed mean / Fang trim": ["--estimator", "first_order", "--aggregator", "cwtm", "--attack", "fang_trim"],
    "CYBER-0 / Full-Knowledge": ["--aggregator", "cwtm", "--attack", "tma"],
    "CYBER-0 / Fang trim": ["--aggregator", "cwtm", "--attack", "fang_trim"],
    # Alg. 3's order statistic taken among all m clients' true values (the Byzantine clients' own included)
    "CYBER-0 / Full-Knowledge ranked among all": ["--aggregator", "cwtm", "--attack", "tma", "--attack_kwargs",
                                                  json.dumps({"ranked": "all"})],
}
REFERENCES = {  # no Byzantine clients, the mean
    "FedAvg / no Byzantine": ["--estimator", "first_order", "--aggregator", "mean", "--num_byzantine", "0"],
    "CYBER-0 mean / no Byzantine": ["--aggregator", "mean", "--num_byzantine", "0"],
}
SPLITS = {"iid": ["--partition", "iid"], "non-iid": ["--partition", "shards"]}
FIGURE_ATTACKS = {  # paper 000 Figure 1c: m = 12, b = 3, beta = 0.25, non-IID
    "Full-Knowledge": ["--attack", "tma"],
    "Always Small": ["--attack", "always_small"],
    "Always Large": ["--attack", "always_large"],
    "Random Choice": ["--attack", "random_choice"],
    "Label Flipping": ["--attack", "lf", "--attack_kwargs", json.dumps({"num_classes": 10})],
    "no attack": ["--attack", "none"],
}
COMMON = ["--num_clients", str(CLIENTS), "--num_perturbations", "64", "--learning_rate", "0.01",
          "--per_device_train_batch_size", "64", "--lr_scheduler_type", "constant"]


def table_cells() -> list[tuple[str, list[str]]]:
    """(cell name, argv) of Table 1: ``"<row> | <split> | alpha=<a>"``, and the references per split."""
    out = []
    for split, split_argv in SPLITS.items():
        for row, argv in ROWS.items():
            for alpha in ALPHAS:
                b = round(alpha * CLIENTS)
                rule = json.dumps({"beta": alpha}) if "cwtm" in argv else "{}"
                out.append((f"{row} | {split} | alpha={alpha}",
                            [*COMMON, *split_argv, *argv, "--num_byzantine", str(b), "--aggregator_kwargs", rule]))
        for row, argv in REFERENCES.items():
            out.append((f"{row} | {split} | alpha=0", [*COMMON, *split_argv, *argv, "--attack", "none"]))
    return out


def figure_cells() -> list[tuple[str, list[str]]]:
    """(cell name, argv) of Figure 1c; losses logged every 10 rounds."""
    argv = ["--num_clients", "12", "--num_byzantine", "3", "--num_perturbations", "64", "--learning_rate", "0.01",
            "--per_device_train_batch_size", "64", "--partition", "shards", "--aggregator", "cwtm",
            "--aggregator_kwargs", json.dumps({"beta": 0.25}), "--logging_steps", "10"]
    return [(f"Figure 1c | {name}", [*argv, *attack]) for name, attack in FIGURE_ATTACKS.items()]


def load_runs(runs_dir: str) -> dict[str, list[dict]]:
    by_cell: dict[str, list[dict]] = {}
    for file in sorted(os.listdir(runs_dir)):
        if file.endswith(".json"):
            run = json.load(open(os.path.join(runs_dir, file)))
            if isinstance(run, dict) and "cell" in run:
                by_cell.setdefault(run["cell"], []).append(run)
    return by_cell


def stats(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def report(runs_dir: str, out_dir: str, plots: bool = True) -> dict:
    """Table 1 (final and maximum test accuracy, ours against the paper's), Figure 1c's final losses; JSON and md."""
    by_cell = load_runs(runs_dir)
    if not by_cell:
        raise SystemExit(f"{runs_dir!r} holds no runs of this script.")
    summary = {}
    for name, runs in sorted(by_cell.items()):
        final, best = stats([100 * r["final_accuracy"] for r in runs]), stats([100 * r["max_accuracy"] for r in runs])
        losses = [r["loss_curve"][-1][1] for r in runs if r["loss_curve"]]
        summary[name] = {"seeds": sorted(r["seed"] for r in runs), "rounds": runs[0]["rounds"], "final": final,
                         "max": best,
                         "last_loss": stats(losses) if losses else None,
                         "seconds_per_run": statistics.mean(r["seconds"] for r in runs)}
        lambdas = [v for r in runs for v in r.get("attack_lambda", [])]
        if lambdas:
            summary[name]["mean_lambda"] = statistics.mean(lambdas)
    rounds = max(s["rounds"] for s in summary.values())
    lines = []
    for split in SPLITS:
        lines += [f"### {split}: test accuracy after {rounds} rounds (max over evaluations in brackets), %", "",
                  "| row | " + " | ".join(f"alpha = {a}: ours | paper" for a in ALPHAS) + " |",
                  "|---|" + "---|---|" * len(ALPHAS)]
        for row in ROWS:
            cells = []
            for i, alpha in enumerate(ALPHAS):
                s = summary.get(f"{row} | {split} | alpha={alpha}")
                ours = "—" if s is None else f"{s['final'][0]:.1f} ± {s['final'][1]:.1f} ({s['max'][0]:.1f})"
                paper = f"{PAPER[row][i][0]} ± {PAPER[row][i][1]}" if row in PAPER else "—"
                cells.append(f"{ours} | {paper}")
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
        for row in REFERENCES:
            s = summary.get(f"{row} | {split} | alpha=0")
            if s is not None:
                ours = f"{s['final'][0]:.1f} ± {s['final'][1]:.1f} ({s['max'][0]:.1f})"
                lines.append(f"| {row} | {ours} | — |" + " | |" * (len(ALPHAS) - 1))
        lines.append("")
    figure = {k: v for k, v in summary.items() if k.startswith("Figure 1c")}
    if figure:
        lines += ["### Figure 1c (m = 12, b = 3, non-IID): honest training loss (mean of the last 10 rounds)", "",
                  f"| attack | loss at round {rounds} | final test accuracy, % |", "|---|---|---|"]
        for name, s in sorted(figure.items(), key=lambda kv: -(kv[1]["last_loss"] or (0, 0))[0]):
            loss = "—" if s["last_loss"] is None else f"{s['last_loss'][0]:.3f} ± {s['last_loss'][1]:.3f}"
            lines.append(f"| {name.split(' | ')[1]} | {loss} | {s['final'][0]:.1f} ± {s['final'][1]:.1f} |")
        lines.append("")
    seconds = sum(r["seconds"] for runs in by_cell.values() for r in runs)
    lines.append(f"{sum(len(r) for r in by_cell.values())} runs, {seconds / 60:.1f} CPU-minutes of runs.")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "cyber0.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "cyber0.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(text)
    if plots and figure:
        plot_figure(by_cell, out_dir)
    return summary


def plot_figure(by_cell: dict, out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in FIGURE_ATTACKS:
        runs = by_cell.get(f"Figure 1c | {name}")
        if not runs:
            continue
        steps = [s for s, _ in runs[0]["loss_curve"]]
        mean = [statistics.mean(r["loss_curve"][i][1] for r in runs) for i in range(len(steps))]
        ax.plot(steps, mean, label=f"{name} ({len(runs)} seeds)")
    ax.set_xlabel("round")
    ax.set_ylabel("honest training loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("CYBER-0, MNIST, m = 12, alpha = beta = 0.25, non-IID (paper 000 Fig. 1c)", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "cyber0_fig1c.png"), dpi=90)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--only", default=None, help="run only cells whose name starts with this")
    parser.add_argument("--data_dir", default=os.path.join(ROOT, "..", "shared", "data", "mnist"))
    parser.add_argument("--runs_dir", default=os.path.join(RESULTS, "cyber0_runs"))
    parser.add_argument("--smoke", action="store_true", help="every configuration, 10 rounds, seed 0, in a temp dir")
    parser.add_argument("--report", action="store_true", help="only write the tables and the plot")
    args = parser.parse_args()
    cells = table_cells() + figure_cells()
    if args.smoke:
        if args.runs_dir == os.path.join(RESULTS, "cyber0_runs"):
            args.runs_dir = tempfile.mkdtemp()
        args.rounds, args.seeds, args.workers = 10, [0], 1
        # each configuration's code path once: the rows at alpha = 0.25 on one split, one figure attack
        cells = [(name, [*argv, "--logging_steps", "5"]) for name, argv in cells
                 if name.endswith(("| iid | alpha=0.25", "| iid | alpha=0")) or name == "Figure 1c | Random Choice"]
    elif args.only:
        cells = [c for c in cells if c[0].startswith(args.only)]
    os.makedirs(os.path.join(args.runs_dir, "tmp"), exist_ok=True)
    start = time.perf_counter()
    if not args.report:
        eval_steps = 5 if args.smoke else 20
        jobs = [(name, argv, seed, args.rounds, args.runs_dir, args.data_dir, eval_steps)
                for name, argv in cells for seed in args.seeds]
        run_jobs(run_one, [(job,) for job in jobs], args.workers)
        print(f"runs done in {(time.perf_counter() - start) / 60:.1f} min of wall time", flush=True)
    committed = args.runs_dir == os.path.join(RESULTS, "cyber0_runs")
    report(args.runs_dir, RESULTS if committed else args.runs_dir, plots=not args.smoke)


if __name__ == "__main__":
    main()

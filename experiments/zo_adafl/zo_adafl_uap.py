"""Reproduce ZO-AdaFL's federated black-box attack (papers/002, Section 5, Figure 2): a universal adversarial
perturbation of MNIST digit "4" images, learnt by 50 clients from the losses of a black-box classifier.

1. The black box: a small CNN (no dropout or batch norm: the Trainer's ``train()`` mode changes nothing) trained
   first-order on MNIST (Adam, 8 epochs, learning rate 1e-3 x 0.7 per epoch, one thread), kept in the repository
   (``zo_adafl_black_box.pt`` beside this script, 98.74 % test accuracy; the paper's has 99.4 %): training it again
   gives another box on another thread count (98.72 % on two) or possibly another CPU, so the runs attack the
   committed one and record its weights' digest.
2. The data: 200 training images of digit 4 (seeded). The paper distributes "|D_i| = 60 samples to each client" of
   50: 50 x 60 = 3,000 > 200, so the clients' sets overlap. We build 3,000 rows that repeat each of the 200 images 15
   times and split them IID over the 50 clients (the library's split): each client holds 60 images of the pool
   (a client may hold one twice), every image is held by about 15 clients.
3. The trainable parameter is the perturbation ``delta`` (784 values) alone; the image seen by the black box is
   ``x' = (tanh(atanh(2x - 1) + delta) + 1) / 2`` (inside [0, 1]). Per-image attack loss, the form of ZO-signSGD's and
   ZO-AdaMM's universal attack (the paper gives none): ``c * max(Z_y(x') - max_{j != y} Z_j(x'), -kappa) +
   ||x' - x||^2`` with ``c = 10``, ``kappa = 0`` (``Z`` the logits); attack success = the black box misclassifies
   ``x'``; distortion = ``||x' - x||^2``, averaged over the 200 images.
4. ZO-AdaFL: ``estimator="one_point"``, K local ZO-SGD steps at eta = 0.001 (``local_learning_rate``), server AMSGrad
   (``server_optimizer="amsgrad"``) with alpha = 0.02, beta1 0.9, beta2 0.99, eps 1e-8, v0 = 1e-5. FedZO: the same
   clients, the server averages the local models (``server_optimizer="sgd"``, learning rate = eta). ZONES and DZOPA
   are not configurations of ours (primal-dual / decentralised), so they are not run.

Runs (one JSON each under ``experiments/zo_adafl/zo_adafl_runs/``, finished ones skipped: resumable), then
``zo_adafl.md``, ``zo_adafl.json`` and ``zo_adafl.png`` beside this script:

    python experiments/zo_adafl/zo_adafl_uap.py           # the comparison and Figure 2's K and m sweeps
    python experiments/zo_adafl/zo_adafl_uap.py --smoke   # ZO-AdaFL and FedZO, 3 rounds, K 2, a quick black box (CI)
    python experiments/zo_adafl/zo_adafl_uap.py --report  # tables and plot from finished runs only
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RESULTS = HERE  # the committed runs, reports and black box, beside this script
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # _common.py, shared with the benchmarks
sys.path.insert(0, HERE)
from _common import load_example, run_jobs  # noqa: E402

POOL, CLIENTS, PER_CLIENT, DIGIT = 200, 50, 60, 4
RUNS = os.path.join(RESULTS, "zo_adafl_runs")
BOX, BOX_DIGEST = os.path.join(RESULTS, "zo_adafl_black_box.pt"), "bacb6e0abc6ac3ff"  # the committed black box
SETTINGS = ("batch", "mu", "eta", "m", "K", "rounds", "server", "lr")  # what makes runs of one name alike


class BlackBox(nn.Module):
    """conv(1->8, 5) - ReLU - maxpool 2 - conv(8->16, 5) - ReLU - maxpool 2 - linear(256 -> 10); inputs in [0, 1].
    Small on purpose: its forwards are the whole cost of a round (m K B images twice)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 5), nn.ReLU(),
                                      nn.MaxPool2d(2), nn.Flatten())
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        return self.head(self.features(x.view(-1, 1, 28, 28)))


class UniversalPerturbation(nn.Module):
    """The federated attack's model: a frozen black box and the trainable perturbation ``delta``.

    ``forward(x, labels)`` returns the per-image attack loss ``c * max(Z_y - max_{j != y} Z_j, -kappa) + ||x' - x||^2``
    of ``x' = (tanh(atanh(2x - 1) + delta) + 1) / 2`` (only ``loss``, of shape [batch]: the clients' losses)."""

    def __init__(self, black_box: nn.Module, c: float = 10.0, kappa: float = 0.0):
        super().__init__()
        self.black_box = black_box.requires_grad_(False)
        self.delta = nn.Parameter(torch.zeros(784))
        self.c, self.kappa = c, kappa

    def adversarial(self, x):
        return (torch.tanh(torch.atanh((2 * x - 1).clamp(-1 + 1e-6, 1 - 1e-6)) + self.delta) + 1) / 2

    def terms(self, x, labels):
        """``(margin, distortion, logits)`` per image."""
        adv = self.adversarial(x)
        logits = self.black_box(adv)
        true = logits.gather(1, labels[:, None])[:, 0]
        other = logits.masked_fill(nn.functional.one_hot(labels, logits.shape[1]).bool(), -torch.inf).amax(dim=1)
        return (true - other).clamp(min=-self.kappa), (adv - x).pow(2).sum(dim=1), logits

    def forward(self, x, labels):
        margin, distortion, _ = self.terms(x, labels)
        return {"loss": self.c * margin + distortion}


def mnist(data_dir: str, split: str):
    """MNIST ``split`` ("train" or "test") with pixels in [0, 1]."""
    return load_example("run_mnist_fed").MNIST(data_dir, split, normalize=False)


def load_black_box(path: str) -> BlackBox:
    """The black box saved at ``path`` (tensors only: ``weights_only``); a file that is not one is refused by name."""
    model = BlackBox()
    try:
        model.load_state_dict(torch.load(path, weights_only=True))
    except Exception as error:  # unpickling, missing or mis-shaped tensors: say which file
        raise SystemExit(f"{path!r} is not a black box of this script ({type(error).__name__}: {error})") from error
    return model.eval()


def black_box(data_dir: str, path: str, epochs: int = 8, examples: int | None = None) -> tuple[BlackBox, float]:
    """The black box, trained and saved at ``path`` unless it is there (``examples``: train on the first ones only),
    and its test accuracy."""
    if not os.path.exists(path):
        train = mnist(data_dir, "train")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the kernels' reduction order depends on the threads: 98.74 % on one, 98.72 on two
        try:
            torch.manual_seed(0)
            model = BlackBox()
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            g = torch.Generator().manual_seed(0)
            decay = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
            for _ in range(epochs):
                for idx in torch.randperm(examples or len(train), generator=g).split(64):
                    loss = nn.functional.cross_entropy(model(train.x[idx]), train.labels[idx])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                decay.step()
        finally:
            torch.set_num_threads(threads)
        torch.save(model.state_dict(), path)
    model, test = load_black_box(path), mnist(data_dir, "test")
    with torch.no_grad():
        accuracy = float((model(test.x).argmax(1) == test.labels).float().mean())
    return model, accuracy


def digest(model: nn.Module) -> str:
    """Which black box a run attacked: the first 16 hex digits of the SHA-256 of the model's tensors (each name, then
    its bytes, in the state dict's order; not the SHA-256 of the saved file). Not ``ledger.weights_fingerprint``: that
    one covers trainable tensors only, and the box is frozen inside the attack."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class Rows(torch.utils.data.Dataset):
    def __init__(self, x, labels):
        self.x, self.labels = x, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.labels[i]}


def attack_data(data_dir: str, seed: int = 0):
    """The pool of 200 digit-4 training images, and the 3,000 client rows (each pool image 15 times)."""
    train = mnist(data_dir, "train")
    fours = np.flatnonzero(train.labels.numpy() == DIGIT)
    pool = np.sort(np.random.default_rng(seed).choice(fours, POOL, replace=False))
    rows = np.tile(pool, CLIENTS * PER_CLIENT // POOL)
    return Rows(train.x[pool], train.labels[pool]), Rows(train.x[rows], train.labels[rows])


def collate(items):
    return {"x": torch.stack([i["x"] for i in items]), "labels": torch.stack([i["labels"] for i in items])}


def evaluate(model: UniversalPerturbation, pool: Rows) -> dict:
    with torch.no_grad():
        margin, distortion, logits = model.terms(pool.x, pool.labels)
        return {"attack_loss": float((model.c * margin + distortion).mean()),
                "success_rate": float((logits.argmax(1) != pool.labels).float().mean()),
                "distortion": float(distortion.mean())}


def run(name: str, settings: dict, box_path: str, data_dir: str, runs_dir: str, seed: int) -> dict:
    """One federated attack of ``settings["rounds"]`` rounds -> ``<runs_dir>/<name>-seed<seed>.json`` (skipped when
    it exists); one thread (two runs share the machine's two cores)."""
    from zo_byzantine import ZOByzantineArguments, ZOByzantineTrainer

    torch.set_num_threads(1)
    rounds = settings["rounds"]
    path = os.path.join(runs_dir, f"{name.replace(' ', '_')}-seed{seed}.json")
    if os.path.exists(path):
        return json.load(open(path))
    box = load_black_box(box_path)  # trained by main() before any run
    pool, rows = attack_data(data_dir)
    model = UniversalPerturbation(box)
    args = ZOByzantineArguments(
        output_dir=os.path.join(runs_dir, "tmp", f"{name.replace(' ', '_')}-{seed}"), num_clients=CLIENTS,
        max_steps=rounds,
        per_device_train_batch_size=settings["batch"], local_steps=settings["K"],
        clients_per_round=settings["m"], estimator="one_point", zo_eps=settings["mu"], num_perturbations=1,
        local_learning_rate=settings["eta"], learning_rate=settings["lr"], server_optimizer=settings["server"],
        server_betas=(0.9, 0.99), server_eps=1e-8, server_v0=1e-5, lr_scheduler_type="constant", seed=seed,
        logging_steps=settings.get("log", 10), save_strategy="no", report_to=[], disable_tqdm=True,
        remove_unused_columns=False, per_device_eval_batch_size=POOL,
    )
    start = time.perf_counter()
    trainer = ZOByzantineTrainer(model=model, args=args, train_dataset=rows, data_collator=collate)
    trainer.train()
    curve = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e and "step" in e]
    result = {"name": name, "seed": seed, **settings, "black_box": digest(box), "loss_curve": curve,
              **evaluate(model, pool), "seconds": time.perf_counter() - start,
              "uplink_scalars_per_client": next((e["uplink_scalars_per_client"] for e in trainer.state.log_history
                                                 if "uplink_scalars_per_client" in e), None)}
    with open(path, "w") as f:
        json.dump(result, f)
    print(f"{name} seed {seed}: loss {result['attack_loss']:.2f}, success {result['success_rate']:.3f}, "
          f"distortion {result['distortion']:.2f} ({result['seconds']:.0f} s)", flush=True)
    return result


def configurations(rounds: int = 600, sweep_rounds: int = 100) -> dict[str, dict]:
    """ZO-AdaFL against FedZO (K = 10, m = 50, ``rounds``); Figure 2a's K sweep (m = 50) and 2b's m sweep (K = 50)
    for ``sweep_rounds`` (a round costs m K B images twice: K = 100 is 10 times K = 10)."""
    base = {"batch": 5, "mu": 0.005, "eta": 0.001, "m": 50, "K": 10, "rounds": rounds}
    ada, fedzo = {**base, "server": "amsgrad", "lr": 0.02}, {**base, "server": "sgd", "lr": 0.001}
    out = {"ZO-AdaFL K=10 m=50": ada, "FedZO K=10 m=50": fedzo}
    for k in (50, 100):
        out[f"ZO-AdaFL K={k} m=50"] = {**ada, "K": k, "rounds": sweep_rounds}
    for m in (10, 30):
        out[f"ZO-AdaFL K=50 m={m}"] = {**ada, "K": 50, "m": m, "rounds": sweep_rounds}
    return out


def mean_curve(curves: list[list]) -> list[tuple[int, float]]:
    """The seeds' loss curves averaged round by round, over the rounds every seed logged."""
    logged = [dict(map(tuple, curve)) for curve in curves]
    return [(step, statistics.mean(c[step] for c in logged)) for step in sorted(set.intersection(*map(set, logged)))]


def mean_std(summary: dict, key: str, scale: float = 1.0, digits: int = 2) -> str:
    """``"mean ± std"`` of ``summary[key]`` and ``summary[key + "_std"]`` (only the mean for one seed)."""
    spread = summary[f"{key}_std"]
    return f"{scale * summary[key]:.{digits}f}" + ("" if spread is None else f" ± {scale * spread:.{digits}f}")


def seconds_range(low: float, high: float) -> str:
    """The runs' wall seconds as ``"min-max"`` (one value when they round alike): runs timed on shared cores and alone
    differ by more than their seeds do, so a mean would describe neither."""
    low_text, high_text = f"{low:.0f}", f"{high:.0f}"
    return low_text if low_text == high_text else f"{low_text}-{high_text}"


def report(runs_dir: str, out_dir: str, box_accuracy: float | None, plots: bool = True,
           box_digest: str | None = None) -> dict:
    """Tables, JSON and plot of the finished runs under ``runs_dir``; with ``box_digest``, runs that attacked another
    black box (their ``black_box`` digest differs) are refused by name, runs that recorded none are counted."""
    files = {f: json.load(open(os.path.join(runs_dir, f))) for f in sorted(os.listdir(runs_dir)) if f.endswith(".json")}
    files = {f: r for f, r in files.items() if isinstance(r, dict) and "attack_loss" in r}
    if not files:
        raise SystemExit(f"{runs_dir!r} holds no runs of this script.")
    foreign_box = sorted(f for f, r in files.items() if None not in (box_digest, r.get("black_box")) and
                         r["black_box"] != box_digest)
    if foreign_box:
        raise SystemExit(f"{runs_dir!r}: {foreign_box} attacked another black box than {box_digest}; move them away "
                         "or train their runs again.")
    unrecorded = sum(r.get("black_box") is None for r in files.values())
    by_name: dict[str, list] = {}
    for r in files.values():
        by_name.setdefault(r["name"], []).append(r)
    box = f" (weights' digest {box_digest})" if box_digest else ""
    lines = [f"Black box: test accuracy {100 * box_accuracy:.2f} %{box}." if box_accuracy is not None else "",
             f"{unrecorded} of the {len(files)} runs recorded no black-box digest: which box they attacked is not "
             "recorded." if unrecorded else "",
             "", "Mean ± standard deviation over the seeds (± omitted for one seed).", "",
             "| configuration | rounds | seeds | attack loss (200 images) | attack success rate, % | distortion "
             "| uplink scalars / client / round | s / run (seeds' range) |", "|---|---|---|---|---|---|---|---|"]
    summary, curves = {}, {}
    for name, group in sorted(by_name.items()):
        differ = [key for key in SETTINGS if len({r.get(key) for r in group}) > 1]
        if differ:
            raise SystemExit(f"{runs_dir!r}: the runs of {name!r} differ in their {', '.join(differ)} "
                             f"({[[r.get(key) for key in differ] for r in group]}); keep one setting per folder.")
        summary[name] = {"rounds": group[0]["rounds"], "seeds": sorted(r["seed"] for r in group),
                         "seconds_min": min(r["seconds"] for r in group),
                         "seconds_max": max(r["seconds"] for r in group)}
        for key in ("attack_loss", "success_rate", "distortion"):
            values = [r[key] for r in group]
            summary[name][key] = statistics.mean(values)
            summary[name][f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else None
        curves[name] = mean_curve([r["loss_curve"] for r in group])
        s = summary[name]
        lines.append(f"| {name} | {s['rounds']} | {len(group)} | {mean_std(s, 'attack_loss')} | "
                     f"{mean_std(s, 'success_rate', 100, 1)} | {mean_std(s, 'distortion')} | "
                     f"{group[0]['uplink_scalars_per_client']} | {seconds_range(s['seconds_min'], s['seconds_max'])} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "zo_adafl.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "zo_adafl.json"), "w") as f:
        json.dump({"black_box_accuracy": box_accuracy, "black_box": box_digest, "runs": summary,
                   "curves": curves}, f, indent=1)
    print(text)
    if plots:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        panels = [("ZO-AdaFL vs FedZO (K = 10, m = 50)", lambda n: n.endswith("K=10 m=50")),
                  ("ZO-AdaFL, m = 50: local iterations K", lambda n: n.startswith("ZO-AdaFL") and n.endswith("m=50")),
                  ("ZO-AdaFL, K = 50: participating clients m", lambda n: n.startswith("ZO-AdaFL K=50"))]
        for ax, (title, keep) in zip(axes, panels, strict=True):
            shown = [name for name in summary if keep(name)]
            for name in shown:
                s = summary[name]
                ax.plot(*zip(*curves[name], strict=True),
                        label=f"{name} ({s['rounds']} rounds, {len(s['seeds'])} seed(s))")
            if shown:  # the sweeps side by side over the rounds they all ran
                ax.set_xlim(0, min(summary[name]["rounds"] for name in shown))
            ax.set(title=title, xlabel="communication round", ylabel="attack loss (clients' batches, seeds' mean)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "zo_adafl.png"), dpi=90)
        plt.close(fig)
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=600, help="ZO-AdaFL against FedZO")
    parser.add_argument("--sweep_rounds", type=int, default=100, help="Figure 2's K and m sweeps")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--only", nargs="+", default=None,
                        help="run only the configurations named (as in the table: 'FedZO K=10 m=50')")
    parser.add_argument("--data_dir", default=os.path.join(ROOT, "..", "shared", "data", "mnist"))
    parser.add_argument("--runs_dir", default=RUNS)
    parser.add_argument("--black_box", default=None,
                        help=f"the black box's weights (default: the committed {os.path.relpath(BOX, ROOT)}, checked "
                             "against its digest); another path is trained there if missing")
    parser.add_argument("--smoke", action="store_true", help="ZO-AdaFL and FedZO for 3 rounds with K = 2")
    parser.add_argument("--report", action="store_true", help="only write the table and the plot")
    args = parser.parse_args()
    unknown = sorted(set(args.only or ()) - set(configurations()))
    if unknown:
        parser.error(f"--only: unknown configuration(s) {unknown}; accepted: {sorted(configurations())}")
    if args.smoke and args.only:
        parser.error("--smoke runs its two configurations (K=10 m=50): give no --only with it")
    if args.smoke and args.black_box is not None:
        parser.error("--smoke trains its own quick black box: give no --black_box with it")
    if args.black_box is None and not args.smoke and not os.path.exists(BOX):
        parser.error(f"--black_box: the committed {BOX} is missing (restore it: git checkout -- "
                     f"{os.path.relpath(BOX, ROOT)}), or give another path to train a black box there")
    if args.smoke and args.runs_dir == RUNS:
        args.runs_dir = tempfile.mkdtemp()
    os.makedirs(os.path.join(args.runs_dir, "tmp"), exist_ok=True)
    box_path = os.path.join(args.runs_dir, "black_box.pt") if args.smoke else args.black_box or BOX
    if args.smoke and not os.path.exists(box_path):
        black_box(args.data_dir, box_path, epochs=1, examples=12000)
    box, accuracy = black_box(args.data_dir, box_path)
    box_digest = digest(box)
    if box_path == BOX and box_digest != BOX_DIGEST:
        raise SystemExit(f"{BOX}: weights' digest {box_digest}, not the committed box's {BOX_DIGEST}; restore it "
                         f"(git checkout -- {os.path.relpath(BOX, ROOT)}) or give another --black_box")
    print(f"black box: test accuracy {100 * accuracy:.2f} %, weights' digest {box_digest}", flush=True)
    if not args.report:
        configs = configurations(args.rounds, args.sweep_rounds)
        if args.smoke:
            args.seeds, args.workers = [0], 1
            configs = {n: {**c, "K": 2, "log": 1, "rounds": 3} for n, c in configs.items() if n.endswith("K=10 m=50")}
        jobs = [(name, settings, box_path, args.data_dir, args.runs_dir, seed) for name, settings in configs.items()
                if args.only is None or name in args.only for seed in args.seeds]
        jobs.sort(key=lambda job: -job[1]["rounds"] * job[1]["K"] * job[1]["m"])  # longest first
        start = time.perf_counter()
        run_jobs(run, jobs, args.workers)
        print(f"runs done in {(time.perf_counter() - start) / 60:.1f} min of wall time", flush=True)
    committed = args.runs_dir == RUNS
    report(args.runs_dir, RESULTS if committed else args.runs_dir, accuracy, plots=not args.smoke,
           box_digest=box_digest)


if __name__ == "__main__":
    main()

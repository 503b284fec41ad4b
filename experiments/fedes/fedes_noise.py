"""FedES's estimate at a checkpoint: its signal, its noise, and what each does to the loss in one step.

Why (issue 20, item 2): at the paper's constant learning rate our non-IID FedES stalls near 90 % and then diverges
where IID keeps learning. With the antithetic Gaussian directions of Algorithm 1 (sigma -> 0), client k's direction
b on its batch b reports ``(z_k^b)^T g_k^b`` (``g_k^b``: the gradient of that batch's loss) and the server steps along

    g_hat = sum_k rho_k / B_k sum_b z_k^b (z_k^b)^T g_k^b,     E g_hat = g = sum_k rho_k / B_k sum_b g_k^b,

    E ||g_hat - g||^2 = (N + 1) sum_k rho_k^2 / B_k^2 sum_b ||g_k^b||^2      (independent z ~ N(0, I_N)),

since ``E ||z z^T v - v||^2 = (N + 1) ||v||^2``. The noise grows with the batches' own gradients, not with their
mean: label-skewed batches keep large gradients where the global gradient is small. With directions shared by all
clients (``directions="shared"``, one ``z^b`` per batch index) it would be ``(N + 1) / B^2 sum_b ||sum_k rho_k
g_k^b||^2`` (printed for comparison; not the paper's FedES).

The script loads a run's checkpoint, forms every client's batches as the run does (``zo_direction_batch_size``
batches from its partition, its size weight rho_k), computes each batch's gradient (float64 sums), and measures on
``--probe`` training examples: the loss change of the mean step ``L(w - alpha g) - L(w)`` and the mean loss increase
of a random step of the noise's norm, ``(L(w + e) + L(w - e)) / 2 - L(w)`` with ``e`` Gaussian, ``||e|| = alpha
sqrt(E ||g_hat - g||^2)`` (the noise part of ``g_hat`` is such a vector: a sum of Gaussian directions), averaged over
``--directions`` draws. A ratio above 1 says a step's noise costs more loss than its mean gains.

The noise also moves the weights: a random walk of step ``lr ||g_hat - g||`` grows ``||w||`` (``random_walk``,
``--walk``), and in a ReLU network larger weights mean larger gradients and so more noise.

    python experiments/fedes/fedes_noise.py --run fedes_iid_nB256_s0_db
    python experiments/fedes/fedes_noise.py --run fedes_dirichlet_nB1024_s0_db \
        --walk experiments/fedes/fedes_noise.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # _common.py, shared with the benchmarks
sys.path.insert(0, HERE)
from _common import load_example  # noqa: E402
from fedes import (  # noqa: E402
    CLIENTS,
    LEARNING_RATE,
    MLP,
    PER_CLIENT,
    arguments,
    batches_per_client,
    initial_model,
    last_checkpoint,
    parse_stem,
)

from zo_byzantine.checks import build_federation  # noqa: E402


def batch_gradient(model: MLP, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The gradient of the mean cross-entropy on ``(x, labels)``, flat, float64."""
    model.zero_grad(set_to_none=True)
    model(x, labels)["loss"].backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()


def client_batches(partition: np.ndarray, count: int, size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``count`` batches of ``size`` from the client's data as a stream of shuffled passes (the run's layout:
    one epoch a round, the last batch filled from the next pass)."""
    passes = -(-count * size // len(partition))
    stream = np.concatenate([rng.permutation(partition) for _ in range(passes)])
    return [stream[i * size:(i + 1) * size] for i in range(count)]


@torch.no_grad()
def loss_at(model: MLP, flat: torch.Tensor, x: torch.Tensor, labels: torch.Tensor) -> float:
    """The mean cross-entropy on ``x`` with the weights ``flat``."""
    torch.nn.utils.vector_to_parameters(flat.float(), model.parameters())
    return float(model(x, labels)["loss"])


def measure(model: MLP, federation, x, labels, n_b: int, nu: int, lr: float, probe: int, directions: int,
            seed: int) -> dict:
    """The quantities of the module's docstring for the weights in ``model``."""
    rng = np.random.default_rng(seed)
    sizes = np.array([len(p) for p in federation.partitions], dtype=np.float64)
    rho = sizes / sizes.sum()
    n = sum(p.numel() for p in model.parameters())
    batches = [client_batches(part, nu, n_b, rng) for part in federation.partitions]
    means = [torch.zeros(n, dtype=torch.float64) for _ in rho]
    client_squares, shared_squares = np.zeros(len(rho)), 0.0
    for b in range(nu):  # batch index outermost: sum_k rho_k g_k^b in one vector, not nu of them
        shared = torch.zeros(n, dtype=torch.float64)
        for k, r in enumerate(rho):
            grad = batch_gradient(model, x[batches[k][b]], labels[batches[k][b]])
            means[k] += grad / nu
            shared += r * grad
            client_squares[k] += float(grad @ grad)
        shared_squares += float(shared @ shared)
    g = sum(r * mean for r, mean in zip(rho, means, strict=True))
    noise2 = (n + 1) * float(np.sum(rho ** 2 / nu ** 2 * client_squares))
    noise2_shared = (n + 1) / nu ** 2 * shared_squares
    client_norms = [float(mean.norm()) for mean in means]
    batch_rms = [float(s) for s in np.sqrt(client_squares / nu)]
    del means, shared
    w = torch.nn.utils.parameters_to_vector(model.parameters()).detach().double()
    keep = torch.as_tensor(rng.choice(len(labels), probe, replace=False))
    xp, lp = x[keep], labels[keep]
    base = loss_at(model, w, xp, lp)
    descent = loss_at(model, w - lr * g, xp, lp) - base
    generator = torch.Generator().manual_seed(seed)

    def noise_cost(norm2: float) -> tuple[float, float]:
        costs = []
        for _ in range(directions):
            e = torch.randn(n, generator=generator, dtype=torch.float64)
            e *= lr * norm2 ** 0.5 / e.norm()
            costs.append((loss_at(model, w + e, xp, lp) + loss_at(model, w - e, xp, lp)) / 2 - base)
        return float(np.mean(costs)), float(np.std(costs) / np.sqrt(directions))

    cost, cost_se = noise_cost(noise2)
    cost_shared, cost_shared_se = noise_cost(noise2_shared)
    torch.nn.utils.vector_to_parameters(w.float(), model.parameters())
    return {
        "parameters": n, "weight_norm": float(w.norm()), "loss": base, "grad_norm": float(g.norm()),
        "client_grad_norms": client_norms, "batch_grad_rms": batch_rms, "rho": rho.tolist(),
        "noise_norm": noise2 ** 0.5, "noise_to_signal": noise2 ** 0.5 / float(g.norm()),
        "descent": descent, "noise_cost": cost, "noise_cost_se": cost_se, "ratio": cost / -descent,
        "shared_noise_norm": noise2_shared ** 0.5, "shared_noise_cost": cost_shared,
        "shared_noise_cost_se": cost_shared_se, "shared_ratio": cost_shared / -descent,
    }


def random_walk(initial_norm: float, noise: dict[int, float], lr: float, rounds: list[int]) -> dict[int, float]:
    """The weight norm that the estimate's noise alone predicts at each of ``rounds``. A round's noise is a sum of
    fresh Gaussian directions, uncorrelated with ``w``, so (the mean steps left out)

        E ||w_t||^2 = ||w_0||^2 + lr^2 sum_{s < t} E ||g_hat_s - g_s||^2,

    with ``noise`` the measured ``sqrt(E ||g_hat_s - g_s||^2)`` by round, interpolated linearly between the
    measured rounds and held at the nearest one outside them."""
    measured = sorted(noise)
    per_round = np.interp(np.arange(max(rounds)), measured, [noise[s] for s in measured]) ** 2
    squares = initial_norm ** 2 + lr ** 2 * np.concatenate([[0.0], np.cumsum(per_round)])
    return {t: float(np.sqrt(squares[t])) for t in rounds}


def walk(path: str, run: str, seed: int, n_b: int, lr: float) -> list[str]:
    """``random_walk`` against the weight norms measured at ``run``'s checkpoints (the lines of ``path`` for that
    run and its own n_B, measured at ``lr``: the rate of the ratio shown), from the run's seeded initial weights, the
    walk at the run's own constant rate ``LEARNING_RATE``: one line per checkpoint. A checkpoint measured twice, or a
    line whose checkpoint is not ``checkpoint-<round>``, is refused."""
    at: dict[int, dict] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            record = json.loads(line)
            if (record["run"], record["n_B"], record["lr"]) != (run, n_b, lr) or "weight_norm" not in record:
                continue
            step = record["checkpoint"].removeprefix("checkpoint-")
            if not step.isdigit():
                raise SystemExit(f"--walk={path!r} line {number}: checkpoint {record['checkpoint']!r} is not "
                                 "checkpoint-<round>.")
            if int(step) in at:
                raise SystemExit(f"--walk={path!r} line {number}: {record['checkpoint']} of {run} at n_B {n_b} "
                                 f"and lr {lr} is measured twice.")
            at[int(step)] = record
    if not at:
        raise SystemExit(f"--walk={path!r}: no measurement of {run} at n_B {n_b} and lr {lr} with a weight norm.")
    start = float(torch.nn.utils.parameters_to_vector(initial_model(seed).parameters()).detach().norm())
    predicted = random_walk(start, {t: r["noise_norm"] for t, r in at.items()}, LEARNING_RATE, sorted(at))
    rows = [f"round 0: weight norm {start:.2f}"] + [
        f"round {t}: weight norm {at[t]['weight_norm']:.2f}, predicted by the noise alone {predicted[t]:.2f} "
        f"(noise norm {at[t]['noise_norm']:.0f}, ratio {at[t]['ratio']:.2f})" for t in sorted(at)]
    print("\n".join(rows))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a run's name under --runs_dir/tmp, e.g. fedes_iid_nB256_s0_db")
    parser.add_argument("--checkpoint", default=None, help="checkpoint-<round> folder (default: the run's newest)")
    parser.add_argument("--runs_dir", default=os.path.join(HERE, "fedes_runs"))
    parser.add_argument("--data", default=os.path.join(ROOT, "..", "shared", "data", "mnist"))
    parser.add_argument("--probe", type=int, default=5000, help="training examples the losses are measured on")
    parser.add_argument("--directions", type=int, default=8, help="random noise steps averaged")
    parser.add_argument("--n_B", type=int, default=None,
                        help="measure with this batch size (B_k = ceil(6,000 / n_B) directions) instead of the run's")
    parser.add_argument("--lr", type=float, default=LEARNING_RATE, help="the rate of the step measured")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="append the result as one JSON line to this file")
    parser.add_argument("--walk", default=None, metavar="JSONL",
                        help="measure nothing: compare the weight norms recorded in JSONL for --run (at --n_B, ratios "
                        "at --lr) with the growth its noise alone predicts at the run's rate (random_walk)")
    args = parser.parse_args(argv)
    for name in ("probe", "directions"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)}: accepted values are integers >= 1.")
    if args.probe > CLIENTS * PER_CLIENT:
        parser.error(f"--probe={args.probe}: accepted values are 1 to {CLIENTS * PER_CLIENT:,} (the training set).")
    if not args.lr > 0:
        parser.error(f"--lr={args.lr}: accepted values are numbers > 0.")
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        parser.error(f"--out={args.out!r}: its folder does not exist.")
    run = parse_stem(args.run)
    if run is None or run["method"] != "fedes" or run["n_B"] is None or run["smoke"] \
            or run["batches"] != "per_direction":
        parser.error(f"--run={args.run!r}: accepted runs are FedES with a batch per direction, named "
                     "fedes_<split>_nB<n_B>_s<seed>[_unit]_db[_<schedule><rounds>].")
    split, seed, unit = run["split"], run["seed"], run["inputs"] == "unit"
    n_b = run["n_B"] if args.n_B is None else args.n_B
    if n_b < 1:
        parser.error(f"--n_B={n_b}: accepted values are integers >= 1.")
    if args.walk is not None:
        if not os.path.isfile(args.walk):
            parser.error(f"--walk={args.walk!r}: no such file.")
        if run["schedule"] != "constant":
            parser.error(f"--walk with --run={args.run!r}: the walk assumes the constant rate; accepted runs are "
                         "those without a _<schedule><rounds> suffix.")
        for name in ("probe", "directions", "checkpoint", "out", "runs_dir", "data"):
            if getattr(args, name) != parser.get_default(name):
                parser.error(f"--{name} with --walk: --walk measures nothing and reads only --walk, --run, --n_B "
                             "and --lr.")
        return walk(args.walk, args.run, seed, n_b, args.lr)
    folder = os.path.join(args.runs_dir, "tmp", args.run)
    checkpoint = args.checkpoint or last_checkpoint(folder)
    if checkpoint is None or not os.path.isfile(os.path.join(checkpoint, "model.safetensors")):
        parser.error(f"--checkpoint={args.checkpoint!r}: no model.safetensors in it." if args.checkpoint else
                     f"--run={args.run!r}: no checkpoint with model.safetensors under {folder}.")
    nu = batches_per_client(n_b)
    mnist = load_example("run_mnist_fed")
    train = mnist.MNIST(args.data, "train", not unit)
    zo = arguments(folder, "fedes", split, n_b, seed, 1, 1, 0.0, PER_CLIENT, True)
    federation = build_federation(zo, train)
    assert federation.num_clients == CLIENTS
    model = MLP()
    model.load_state_dict(load_file(os.path.join(checkpoint, "model.safetensors")))
    result = {"run": args.run, "checkpoint": os.path.basename(checkpoint), "lr": args.lr, "n_B": n_b,
              **measure(model, federation, train.x, train.labels, n_b, nu, args.lr, args.probe, args.directions,
                        args.seed)}
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=1))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()

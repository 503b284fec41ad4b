"""Cost of one FedByZO round of the MNIST table's setting, against its floor of 2 nu plain forwards.

One round: n = 40 clients x 64 examples, nu = 64 directions, two forwards per direction of the
logistic regression (784 -> 10) over the round's 2,560 examples. The floor is those 2 nu = 128
forwards (and losses) of the unperturbed model on the same batch, timed in the same process; the
ratio round / floor is the trainer's overhead (perturbation, aggregation, update, data loading).

    python benchmarks/mnist_round.py            # one thread, as each worker of mnist_table.py
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _common import load_example, machine  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default=os.path.join(ROOT, "..", "shared", "data", "mnist"))
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)
    ex = load_example("run_mnist_fed")
    train = ex.MNIST(args.data_dir, "train")
    n, batch, nu = 40, 64, 64
    model = ex.LogisticRegression()
    x, y = train.x[: n * batch], train.labels[: n * batch]

    def floor():
        with torch.no_grad():
            for _ in range(2 * nu):
                model(x, y)

    floor()
    began = time.perf_counter()
    for _ in range(3):
        floor()
    floor_s = (time.perf_counter() - began) / 3
    rows = [f"machine: {machine()}", f"floor, {2 * nu} plain forwards + losses of {n * batch} x 784: "
            f"{floor_s * 1000:.1f} ms ({2 * nu * n * batch * 784 * 10 * 2 / floor_s / 1e9:.1f} GFLOP/s)"]
    # ALIE with omega searched over the table's 21 candidates through NNM + CWTM (its "-NNM" column)
    alie_nnm = ["--pre_aggregators", "nnm", "--attack", "alie", "--attack_kwargs",
                '{"omega": "auto", "target": "pipeline", "candidates": ' + str([i / 2 for i in range(21)]) + "}"]
    for label, extra in (("FedByZO CWTM, no attack", []), ("FedByZO CWTM, SF", ["--attack", "sf"]),
                         ("FedByZO CWTM, ALIE auto omega (21 candidates)", alie_nnm[2:6]),
                         ("FedByZO NNM + CWTM, ALIE-NNM (21 candidates through NNM)", alie_nnm),
                         ("FedZO CWTM (parameter space), no attack", ["--aggregation_space", "parameter"]),
                         ("FedZO NNM + CWTM, ALIE-NNM", ["--aggregation_space", "parameter", *alie_nnm]),
                         ("FedAvg CWTM (first order), no attack", ["--estimator", "first_order"]),
                         ("FedAvg NNM + CWTM, ALIE-NNM", ["--estimator", "first_order", *alie_nnm])):
        with tempfile.TemporaryDirectory() as out:
            argv = ["--data_dir", args.data_dir, "--output_dir", out, "--max_steps", str(args.rounds),
                    "--eval_strategy", "no", "--logging_steps", str(args.rounds), *extra]
            began = time.perf_counter()
            metrics = ex.main(argv)
            total = time.perf_counter() - began
        per_round = metrics["train_runtime"] / args.rounds
        rows.append(f"{label}: {per_round * 1000:.1f} ms/round = {per_round / floor_s:.2f} x floor "
                    f"(whole run with data loading {total:.1f} s)")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

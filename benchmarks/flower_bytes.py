"""Bytes on the wire per round and per client in a Flower deployment: zo_byzantine's plan and report records beside
a Flower FedAvg of the same model (an ``ArrayRecord`` of the trainable weights each way).

Sizes are Flower's own serialisation of the message content: the sum of the deflated objects of the ``RecordDict``
tree (what the SuperLink stores and forwards; HTTP/gRPC framing and the message metadata, the same for both, are
not counted). Steady state: a node that answered the previous round receives the plan of round t with round t-1's
ledger entry (nu seeds and scalars); a node that missed r rounds receives r entries more.

    python benchmarks/flower_bytes.py                       # MNIST logistic regression and all-MiniLM-L6-v2
    python benchmarks/flower_bytes.py --nu 64 --clients 12
"""

from __future__ import annotations

import argparse

import torch
from _common import load_example, minilm
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from zo_byzantine import Report
from zo_byzantine.flower import Replica, plan_content, read_run_config, report_content
from zo_byzantine.flower.config import Task
from zo_byzantine.flower.coordinator import Coordinator


def wire_bytes(content: RecordDict) -> int:
    """Bytes of ``content`` as Flower serialises it (every deflated object of its tree)."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(content).values())


def fedavg_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(downlink, uplink) of one FedAvg round: the trainable weights as an ``ArrayRecord`` each way (float32)."""
    weights = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    down = RecordDict({"arrays": ArrayRecord(weights), "config": ConfigRecord({"lr": 0.1, "server-round": 1})})
    up = RecordDict({"arrays": ArrayRecord(weights), "metrics": MetricRecord({"num-examples": 100})})
    return wire_bytes(down), wire_bytes(up)


def ours(model: torch.nn.Module, nu: int, clients: int, missed: int) -> tuple[int, int, int]:
    """(downlink, uplink, uplink float scalars) of round t for a node that answered round t - 1 - ``missed``."""
    config = {"task": "unused:unused", "num_clients": clients, "clients_per_round": clients, "num_byzantine": 0,
              "aggregator": "mean", "num_perturbations": nu, "zo_seed": 0, "rounds": missed + 2}
    deployment = read_run_config(config)
    coordinator = Coordinator(deployment, Task(model=model, train_dataset=None))
    t = missed + 1
    gen = torch.Generator().manual_seed(0)
    for r in range(t):  # rounds 0..t-1 as the server records them: nu seed tuples and nu aggregated scalars
        plan = coordinator.server.plan(r, range(clients), 0.1)
        coordinator.ledger.record(r, plan.keys(1, 0), torch.randn(nu, generator=gen).tolist(), 0.1,
                                  participants=list(range(clients)))
    replica: Replica = coordinator.replica
    plan = coordinator.server.plan(t, range(clients), 0.1)
    entries = coordinator.ledger.rounds[t - 1 - missed : t]
    down = wire_bytes(plan_content(plan, t - 1 - missed, entries, replica.start, replica.fingerprint()))
    report = Report(t, 0, torch.randn(1, nu, dtype=torch.float64, generator=gen), 0.69, 100)
    return down, wire_bytes(report_content(report, t - 1 - missed)), nu


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nu", type=int, default=64)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--skip-minilm", action="store_true")
    args = parser.parse_args(argv)
    models = [("MNIST logistic regression", load_example("run_mnist_fed").LogisticRegression())]
    if not args.skip_minilm:
        models.append(("all-MiniLM-L6-v2 + head", minilm()[0]))
    print(f"nu = {args.nu}, K = 1, {args.clients} participants per round; bytes per client per round")
    print("| model | d | ours down | ours up | ours down, 10 rounds missed | FedAvg down | FedAvg up | "
          "FedAvg up / ours up |")
    print("|---|---|---|---|---|---|---|---|")
    for name, model in models:
        d = sum(p.numel() for p in model.parameters() if p.requires_grad)
        down, up, _ = ours(model, args.nu, args.clients, missed=0)
        late, _, _ = ours(model, args.nu, args.clients, missed=10)
        fed_down, fed_up = fedavg_bytes(model)
        print(f"| {name} | {d:,} | {down:,} | {up:,} | {late:,} | {fed_down:,} | {fed_up:,} | {fed_up / up:,.0f}x |")


if __name__ == "__main__":
    main()

"""The model card of a run: the Trainer's, made true for the protocol, with the federation described."""

from __future__ import annotations

from .ledger import LEDGER_NAME


def rewrite_card(path: str, args, rounds: int, uplink_scalars: int, d: int, digest: str) -> None:
    """Rewrite the card at ``path``: the optimizer and batch lines, then a section on the federation
    (n, b, f, rule, attack, mu, nu, K, rounds, bytes per client against dense FedAvg, the ledger's digest)."""
    lines = []
    for line in open(path, encoding="utf-8").read().splitlines():
        if line.startswith("- optimizer:"):
            line = f"- optimizer: ZOOptimizer (zeroth-order, seeded updates), server rule {args.server_optimizer}"
        elif line.startswith("- train_batch_size:"):
            line = f"- train_batch_size: {args.per_device_train_batch_size} per client"
        elif line.startswith("- total_train_batch_size:"):
            per_round = args.per_device_train_batch_size * (args.clients_per_round or args.num_clients)
            line = f"- total_train_batch_size: {per_round} per round"
        lines.append(line)
    lines += [
        "", "## Federated zeroth-order training (zo_byzantine)", "",
        f"- clients: n={args.num_clients}, {args.clients_per_round or args.num_clients} per round, "
        f"b={args.num_byzantine} Byzantine (rules tolerate f={args.byzantine_bound()})",
        f"- rule: {'+'.join([*args.pre_aggregators, args.aggregator])} {args.aggregator_kwargs or ''}".rstrip(),
        f"- attack: {args.attack} {args.attack_kwargs or ''}".rstrip(),
        f"- estimator: {args.estimator}, mu={args.zo_eps}, nu={args.num_perturbations}, K={args.local_steps} "
        f"({args.local_update}), directions {args.directions}, aggregation in {args.aggregation_space} space",
        f"- rounds: {rounds}",
        f"- bytes sent per client per round: {uplink_scalars * 4} (dense FedAvg: {d * 4})",
        f"- ledger: {LEDGER_NAME}, digest {digest}",
    ]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")

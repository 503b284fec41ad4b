"""The model card of a run: the Trainer's, made true for the protocol, with the federation described.

Read and written with ``huggingface_hub.ModelCard`` (the YAML metadata as ``ModelCardData``, the Markdown body as
text), so that the metadata gets the protocol's tags whatever the body says. The Trainer's hyperparameter bullets
that the protocol replaces are found by what their key names (a key naming the optimizer, the train batch size or
the total train batch size), not by the Trainer's exact wording; if transformers words them so that none is found,
the card still carries the true values in its federation section.
"""

from __future__ import annotations

import re

from huggingface_hub import ModelCard

from .ledger import LEDGER_NAME

TAGS = ("zo_byzantine", "federated-learning", "zeroth-order")
BULLET = re.compile(r"^(\s*[-*]\s*)([A-Za-z_ ]+?)\s*:")


def _replaced(key: str, args) -> str | None:
    """The true value of a Trainer hyperparameter bullet the protocol replaces, else None."""
    key = key.lower().replace(" ", "_")
    per_round = args.per_device_train_batch_size * (args.clients_per_round or args.num_clients)
    if "optim" in key:
        return f"ZOOptimizer (zeroth-order, seeded updates), server rule {args.server_optimizer}"
    if "batch_size" in key and "total" in key and "train" in key:
        return f"{per_round} per round"
    if "batch_size" in key and "train" in key:
        return f"{args.per_device_train_batch_size} per client"
    return None


def rewrite_card(path: str, args, rounds: int, uplink_scalars: int, d: int, digest: str,
                 run_rounds: int | None = None) -> None:
    """Rewrite the card at ``path``: the protocol's tags, the optimizer and batch bullets, then a section on the
    federation (n, b, f, rule, attack, mu, nu, K, the rounds of the weights -- ``run_rounds`` when more were run, as
    after ``load_best_model_at_end`` -- bytes per client against dense FedAvg, the ledger's digest)."""
    card = ModelCard.load(path)
    card.data.tags = [*(card.data.tags or []), *(tag for tag in TAGS if tag not in (card.data.tags or []))]
    lines = []
    for line in card.text.splitlines():
        found = BULLET.match(line)
        value = found and _replaced(found.group(2), args)
        lines.append(f"{found.group(1)}{found.group(2)}: {value}" if value else line)
    ran = f" (the best checkpoint's weights; {run_rounds} rounds were run)" \
        if run_rounds is not None and run_rounds != rounds else ""
    lines += [
        "", "## Federated zeroth-order training (zo_byzantine)", "",
        f"- optimizer: {_replaced('optimizer', args)}",
        f"- batch: {args.per_device_train_batch_size} examples per client, {_replaced('total_train_batch_size', args)}",
        f"- clients: n={args.num_clients}, {args.clients_per_round or args.num_clients} per round, "
        f"b={args.num_byzantine} Byzantine (rules tolerate f={args.byzantine_bound()})",
        f"- rule: {'+'.join([*args.pre_aggregators, args.aggregator])} {args.aggregator_kwargs or ''}".rstrip(),
        f"- attack: {args.attack} {args.attack_kwargs or ''}".rstrip(),
        f"- estimator: {args.estimator}, mu={args.zo_eps}, nu={args.num_perturbations}, K={args.local_steps} "
        f"({args.local_update}), directions {args.directions}, aggregation in {args.aggregation_space} space",
        f"- rounds: {rounds}{ran}",
        f"- bytes sent per client per round: {uplink_scalars * 4} (dense FedAvg: {d * 4})",
        f"- ledger: {LEDGER_NAME}, digest {digest}",
    ]
    card.text = "\n".join(lines) + "\n"
    card.save(path)

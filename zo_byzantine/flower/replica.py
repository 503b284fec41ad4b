"""A copy of the model at the ledger's weights, on the server (for its checks and evaluation) and on every node.

It applies ledger rounds with the library's one update path (``ledger.apply_round``: the ``ZOOptimizer`` step that
replay uses), so ``start weights + rounds 0..k-1`` gives the same bits everywhere, and keeps ``applied = k``.
Between a node's messages (each runs in a fresh ClientApp process) its weights and ``applied`` live in the node's
Flower ``Context.state``, which never leaves the node.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from ..arguments import ZOByzantineArguments
from ..directions import build_directions
from ..ledger import LedgerError, apply_round, weights_fingerprint
from ..optim import ZOOptimizer
from ..perturbation import ParameterTable

WEIGHTS, PROGRESS = "zo_weights", "zo_progress"


class Replica:
    """``model`` (at its start weights) with the run's parameter table and update rule.

    Attributes:
        table: the trainable parameters and the run's direction generator.
        optimizer: plain ``ZOOptimizer`` (``sgd``, no weight decay: what a deployment runs).
        start: fingerprint of the start weights (``ledger.weights_fingerprint``).
        applied: the number of ledger rounds applied (rounds ``0..applied-1``).
    """

    def __init__(self, model: torch.nn.Module, args: ZOByzantineArguments):
        self.model = model
        self.table = ParameterTable(model, build_directions(args.zo_generator, args.zo_distribution))
        local_lr = args.local_learning_rate if args.local_learning_rate is not None else args.learning_rate
        self.optimizer = ZOOptimizer(self.table, [{"params": self.table.params, "weight_decay": 0.0}],
                                     lr=args.learning_rate, local_lr=local_lr)
        self.start = weights_fingerprint(self.table)
        self.applied = 0

    def fingerprint(self) -> str:
        """Fingerprint of the current trainable weights."""
        return weights_fingerprint(self.table)

    def apply(self, entries: list[dict]) -> None:
        """Apply checked ledger rounds ``applied, applied + 1, ...`` in order; raises ``LedgerError`` on a gap."""
        for entry in entries:
            if entry["round"] != self.applied:
                raise LedgerError(f"ledger round {entry['round']} given after {self.applied} applied rounds")
            apply_round(self.optimizer, entry)
            self.applied += 1

    def save(self, state: RecordDict) -> None:
        """Keep the weights (exact bytes) and ``applied`` in a node's ``Context.state``."""
        state[WEIGHTS] = ArrayRecord({name: p.detach().cpu() for name, p in zip(self.table.names, self.table.params,
                                                                                   strict=True)})
        state[PROGRESS] = ConfigRecord({"applied": self.applied, "start": self.start})

    def load(self, state: RecordDict) -> bool:
        """Restore what :meth:`save` kept, if it is there and for these start weights; returns whether it was."""
        if WEIGHTS not in state or PROGRESS not in state or state[PROGRESS].get("start") != self.start:
            return False
        kept = state[WEIGHTS].to_torch_state_dict()
        with torch.no_grad():
            for name, param in zip(self.table.names, self.table.params, strict=True):
                param.copy_(kept[name])
        self.applied = int(state[PROGRESS]["applied"])
        return True

    def reset(self, state: RecordDict) -> None:
        """Forget the kept state (a node out of sync starts over from the start weights at its next plan)."""
        for key in (WEIGHTS, PROGRESS):
            if key in state:
                del state[key]

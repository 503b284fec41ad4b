"""A copy of the model at the ledger's weights, on the server (for its checks and evaluation) and on every node.

It applies ledger rounds with the library's one update path (``ledger.apply_round``: the ``ZOOptimizer`` step that
replay uses), so ``start weights + rounds 0..k-1`` gives the same bits everywhere, and keeps ``applied = k``.
Between a node's messages (each runs in a fresh ClientApp process) its weights live in the node's store (a
safetensors file on the node's disk, :class:`~zo_byzantine.flower.store.NodeStore`), and only ``applied`` and the
start fingerprint in its Flower ``Context.state`` (a small record: what SuperNode and ClientApp exchange per message
does not grow with the model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from flwr.app import ConfigRecord, RecordDict

from ..directions import build_directions
from ..ledger import LedgerError, apply_round, weights_fingerprint
from ..optim import ZOOptimizer
from ..perturbation import ParameterTable

if TYPE_CHECKING:
    from ..arguments import ZOByzantineArguments
    from .store import NodeStore

PROGRESS = "zo_progress"  # the Context record: {"applied", "start"}; the weights are in the node's store
LEGACY_WEIGHTS = "zo_weights"  # where weights were kept before the store (an ArrayRecord): removed when found


class Replica:
    """``model`` (at its start weights) with the run's parameter table and update rule.

    Attributes:
        table: the trainable parameters and the run's direction generator.
        optimizer: plain ``ZOOptimizer`` (``sgd``, no weight decay: what a deployment runs).
        start: fingerprint of the start weights (``ledger.weights_fingerprint``).
        applied: the number of ledger rounds applied (rounds ``0..applied-1``).
        in_sync: whether the weights in memory are the start weights plus ``applied`` rounds (``False`` after
            :meth:`reset`: a process that keeps this replica between messages must build a new one).
    """

    def __init__(self, model: torch.nn.Module, args: ZOByzantineArguments):
        self.model = model
        self.table = ParameterTable(model, build_directions(args.zo_generator, args.zo_distribution))
        local_lr = args.local_learning_rate if args.local_learning_rate is not None else args.learning_rate
        self.optimizer = ZOOptimizer(self.table, [{"params": self.table.params, "weight_decay": 0.0}],
                                     lr=args.learning_rate, local_lr=local_lr, rounding=args.update_rounding)
        self.start = weights_fingerprint(self.table)
        self.applied = 0
        self.in_sync = True

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

    def save(self, state: RecordDict, store: NodeStore) -> None:
        """Keep the weights (exact bytes) in ``store`` (once per number of applied rounds: the same rounds from the
        same start give the same bits) and ``applied`` in the node's ``Context.state``."""
        if not store.has_weights(self.start, self.applied):
            store.save_weights(self.start, self.applied, dict(zip(self.table.names, self.table.params, strict=True)))
        state[PROGRESS] = ConfigRecord({"applied": self.applied, "start": self.start})
        if LEGACY_WEIGHTS in state:
            del state[LEGACY_WEIGHTS]

    def load(self, state: RecordDict, store: NodeStore) -> bool:
        """Restore what :meth:`save` kept, if both the record and the weights file are there for these start
        weights; returns whether they were (if not: ``applied`` stays as it was, 0 for a new replica, and the node
        asks for the ledger). A replica kept in memory that already holds the recorded rounds reads nothing."""
        progress = state.get(PROGRESS)
        if not isinstance(progress, ConfigRecord) or progress.get("start") != self.start:
            return False
        applied = progress.get("applied")
        if type(applied) is not int or applied < 0:
            return False
        if applied == self.applied and self.in_sync:
            return True
        kept = store.load_weights(self.start, applied, self.table.names)
        if kept is None:
            return False
        with torch.no_grad():
            for name, param in zip(self.table.names, self.table.params, strict=True):
                if kept[name].shape != param.shape or kept[name].dtype != param.dtype:
                    return False
            for name, param in zip(self.table.names, self.table.params, strict=True):
                param.copy_(kept[name])
        self.applied = applied
        return True

    def reset(self, state: RecordDict, store: NodeStore) -> None:
        """Forget the kept state (a node out of sync starts over from the start weights at its next plan); this
        replica's weights are no longer the start weights plus ``applied`` rounds (``in_sync`` is ``False``)."""
        self.in_sync = False
        for key in (PROGRESS, LEGACY_WEIGHTS):
            if key in state:
                del state[key]
        store.remove_weights()

"""The ledger: every round's seed tuples, aggregated coefficients and learning rate.

It is the protocol's whole downlink: ``replay(model, ledger)`` rebuilds the trained weights
from the starting weights, bitwise, by applying ``w <- w - lr_t * (sum_r R_t[r] z_{t,r} + wd w)``
round after round (with the server's AMSGrad state when it uses one). Stored as JSON (safe to load
from an untrusted source) with a SHA-256 digest of its rounds, so a corrupt or truncated file fails
loudly. Dense rounds (first-order, parameter-space aggregation) are marked and cannot be replayed.
"""

from __future__ import annotations

import hashlib
import json
import os

from torch import nn

from .optim import ZOOptimizer
from .perturbation import ParameterTable, direction_seed

LEDGER_NAME = "zo_ledger.json"
FORMAT = "zo_byzantine.ledger"
VERSION = 1


class LedgerError(ValueError):
    """A ledger file that cannot be trusted or does not match the model."""


def _digest(rounds: list) -> str:
    return hashlib.sha256(json.dumps(rounds, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class Ledger:
    """Append-only record of a run's rounds."""

    def __init__(self, optimizer: ZOOptimizer, rounds: list | None = None):
        table = optimizer.table
        self.parameters = [[name, list(p.shape)] for name, p in zip(table.names, table.params, strict=True)]
        self.weight_decay = {table.names[i]: wd for i, wd in sorted(optimizer.weight_decay().items())}
        self.server = {
            "optimizer": optimizer.server,
            "local_lr": optimizer.local_lr,
            "betas": list(optimizer.betas),
            "eps": optimizer.eps,
            "v0": optimizer.v0,
        }
        self.rounds: list[dict] = rounds or []

    def record(
        self,
        round_index: int,
        seed_tuples,
        coefficients,
        lr: float | None,
        skipped: str | None = None,
        dense: bool = False,
    ):
        """One round: its seed tuples and coefficients ``R``, or why it was skipped, or that it was dense."""
        entry = {"round": int(round_index), "lr": lr, "seeds": [list(map(int, s)) for s in seed_tuples]}
        entry["coefficients"] = [float(c) for c in coefficients]
        if skipped:
            entry["skipped"] = skipped
        if dense:
            entry["dense"] = True  # first-order or parameter-space update: not in the span of the directions
        self.rounds = [r for r in self.rounds if r["round"] < round_index] + [entry]

    def append(self, downlink) -> None:
        """The round of a :class:`~zo_byzantine.messages.Downlink`."""
        self.record(downlink.round, downlink.seed_tuples, downlink.coefficients, downlink.lr,
                    skipped=downlink.skipped, dense=downlink.dense is not None)

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "parameters": self.parameters,
            "weight_decay": self.weight_decay,
            "server": self.server,
            "rounds": self.rounds,
            "digest": _digest(self.rounds),
        }

    def save(self, directory: str) -> str:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, LEDGER_NAME)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, separators=(",", ":"))
        return path

    @staticmethod
    def read(path: str) -> dict:
        """Load and check a ledger file (or the ledger in a directory)."""
        if os.path.isdir(path):
            path = os.path.join(path, LEDGER_NAME)
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
            raise LedgerError(f"Cannot read ledger {path!r}: {err} (corrupt or truncated?)") from err
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
            raise LedgerError(f"{path!r} is not a {FORMAT} version {VERSION} file.")
        missing = {"parameters", "weight_decay", "server", "rounds", "digest"} - set(data)
        if missing:
            raise LedgerError(f"Ledger {path!r} lacks {sorted(missing)}.")
        if _digest(data["rounds"]) != data["digest"]:
            raise LedgerError(f"Ledger {path!r} fails its digest check: it was modified or corrupted.")
        return data


def replay(model: nn.Module, ledger: dict | str) -> nn.Module:
    """Apply every recorded round to ``model`` (at its starting weights), in place; returns it."""
    data = Ledger.read(ledger) if isinstance(ledger, str) else ledger
    table = ParameterTable(model)
    expected = [[name, list(p.shape)] for name, p in zip(table.names, table.params, strict=True)]
    if expected != data["parameters"]:
        raise LedgerError(
            "The model's trainable parameters (names, shapes) differ from those the ledger was written for."
        )
    index = {name: i for i, name in enumerate(table.names)}
    decayed = {index[name]: wd for name, wd in data["weight_decay"].items()}
    groups = [{"params": [p], "weight_decay": decayed.get(j, 0.0)} for j, p in table]
    server = data["server"]
    optimizer = ZOOptimizer(
        table,
        groups,
        lr=0.0,
        server=server["optimizer"],
        local_lr=server["local_lr"],
        betas=tuple(server["betas"]),
        eps=server["eps"],
        v0=server["v0"],
    )
    for entry in data["rounds"]:
        if entry.get("dense"):
            raise LedgerError(
                f"Round {entry['round']} applied a dense update (first-order or parameter-space "
                "aggregation), which the ledger cannot replay."
            )
        if entry.get("skipped"):
            continue
        for group in optimizer.param_groups:
            group["lr"] = entry["lr"]
        seeds = [direction_seed(*s) for s in entry["seeds"]]
        optimizer.stage(list(zip(seeds, entry["coefficients"], strict=True)))
        optimizer.step()
    return model

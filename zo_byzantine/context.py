"""The contract between the server and its rules, pre-aggregation steps and attacks (SPEC 8).

Every call gets a :class:`RoundContext` and returns its result with its diagnostics; nothing is read
back from attributes after a call, so a rule or attack written against this contract in one file runs
unchanged in the simulation and in a deployment.

    rule(vectors: Tensor[m, nu], ctx) -> Aggregation(value: Tensor[nu], diagnostics: dict[, update: StateUpdate])
    step(vectors: Tensor[m, nu], ctx) -> Tensor[m', nu]
    attack(honest: Tensor[h, nu], own: Tensor[k, nu], rule, ctx) -> AttackOutput(vectors: Tensor[k, nu], diagnostics)

``diagnostics`` maps names to numbers (summed over rounds in the logs; ``omega`` is averaged).

A rule that keeps per-client state across rounds (``zo_byzantine.history``) reads it from ``ctx.state`` (the state
before the call, keyed by client id, rows named by ``ctx.clients``) and returns the state after the call in
``Aggregation.update``, with the record the ledger keeps to rebuild it; the server holds the run's state and passes
it in at every call (stateless rules leave ``update`` as ``None``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from . import seeds


class SizingError(ValueError):
    """A rule or pre-aggregation step cannot hold for the number of vectors and Byzantine bound it gets."""


@dataclass(frozen=True)
class RoundContext:
    """What one rule, step or attack call knows about the round it serves.

    Attributes:
        key: round key ``(s, t, uplink)``; seeded randomness draws from ``ctx.rng(domain)``.
        num_vectors: ``m``, the number of vectors the call receives.
        num_byzantine: ``f``, the number of Byzantine vectors among them the rule must tolerate.
        byzantine: simulation only: mask of the Byzantine rows (diagnostics; rules must not use it to
            aggregate). ``None`` in a deployment and after a step that mixes rows (bucketing).
        clients: the client id of each row (``None`` where unknown, and after a step that mixes rows).
        state: a stateful rule's state before this call (a mapping keyed by client id; ``None``: none kept).
    """

    key: tuple[int, ...]
    num_vectors: int
    num_byzantine: int
    byzantine: torch.Tensor | None = None
    clients: tuple[int, ...] | None = None
    state: dict | None = None

    def rng(self, domain: int):
        """A numpy generator seeded by ``(domain, *key)``."""
        return seeds.rng(domain, *self.key)

    def generator(self, domain: int, device="cpu") -> torch.Generator:
        """A ``torch.Generator`` seeded by ``(domain, *key)``."""
        return seeds.torch_generator(domain, *self.key, device=device)

    def after_step(self, num_vectors: int, keeps_rows: bool) -> RoundContext:
        """The context of the next call in a chain: ``num_vectors`` left; the mask kept if rows still
        belong to the same clients."""
        if keeps_rows:
            return replace(self, num_vectors=num_vectors)
        return replace(self, num_vectors=num_vectors, byzantine=None, clients=None)

    def byzantine_rows(self) -> torch.Tensor | None:
        """The mask, if known and non-empty."""
        if self.byzantine is None or not bool(self.byzantine.any()):
            return None
        return self.byzantine


class StateUpdate(NamedTuple):
    """A stateful rule's state after a call (keyed by client id) and ``record``: the numbers of the call (one per
    row, JSON floats) that the ledger keeps, from which the rule's ``fold`` rebuilds the state bitwise."""

    state: dict
    record: list


class Aggregation(NamedTuple):
    """A rule's output: the aggregate, what it observed (e.g. ``byzantine_values_kept``) and, for a stateful
    rule, its :class:`StateUpdate` (``None`` for the others)."""

    value: torch.Tensor
    diagnostics: dict
    update: StateUpdate | None = None


class AttackOutput(NamedTuple):
    """An attack's output: what the Byzantine clients send, and its choices (e.g. ``omega``)."""

    vectors: torch.Tensor
    diagnostics: dict


def recorded_settings(obj) -> dict:
    """The settings of a rule, step or attack that the ledger's protocol records: its public attributes, less those
    at the value its class's ``unrecorded_defaults`` names (settings added after ledgers recorded the object without
    them: left out at that value, such a ledger still resumes)."""
    omitted = getattr(type(obj), "unrecorded_defaults", {})
    return {name: value for name, value in sorted(getattr(obj, "__dict__", {}).items())
            if not name.startswith("_") and not (name in omitted and value == omitted[name])}

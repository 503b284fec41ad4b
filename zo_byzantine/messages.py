"""The messages between the protocol's two roles (SPEC 8): plan, report, downlink.

    plan      server -> sampled clients   round, participants, seed tuples of every local step, mu, nu, K, local lr
    report    client -> server            K x nu (or nu) scalars, honest loss, example count, round
    downlink  server -> everyone          the aggregate R per uplink, the learning rate, the update's (seed, c)

They hold numbers and tuples only, so that a deployment can put them on the wire as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .perturbation import direction_seed

LOCAL_UPDATES = ("unbiased", "biased", "compressed")


@dataclass(frozen=True)
class Plan:
    """What the sampled clients compute in round ``t``.

    ``seed_tuples[l][r]`` is the seed tuple ``(s, t, l', r)`` of direction ``r`` at local step ``l``
    (``l = 0``: the basis ``Z_t`` of ``local_update="compressed"``; ``l' = 1`` for every step of
    ``"biased"``). With ``per_client``, client ``c`` uses ``seed_tuples[l][r] + (c,)`` (FedES).
    """

    round: int
    participants: tuple[int, ...]
    seed_tuples: tuple[tuple[tuple[int, ...], ...], ...]
    per_client: bool
    estimator: str
    mu: float
    num_perturbations: int
    local_steps: int
    local_lr: float
    local_update: str
    generator: tuple[str, int, str]  # the direction generator's (name, version, distribution)

    def keys(self, step: int, client: int) -> list[tuple[int, ...]]:
        """Seed tuples of ``client``'s directions at local step ``step``."""
        return [k + (int(client),) if self.per_client else k for k in self.seed_tuples[step]]

    def seeds(self, step: int, client: int) -> list[int]:
        return [direction_seed(*k) for k in self.keys(step, client)]

    def num_directions(self, num_clients: int) -> int:
        """Directions ``num_clients`` of this round's participants evaluate (what ``cached`` keeps): none in a
        first-order round (backprop gradients)."""
        if self.first_order:
            return 0
        per_step = self.num_perturbations * (num_clients if self.per_client else 1)
        return per_step * (self.local_steps + (self.local_update == "compressed"))

    @property
    def first_order(self) -> bool:
        return self.estimator == "first_order"

    @property
    def uplink_steps(self) -> list[int]:
        """The step whose directions each uplink vector is expressed in (one vector per uplink)."""
        if self.first_order or self.local_update == "biased":
            return [1]
        if self.local_update == "compressed":
            return [0]
        return list(range(1, self.local_steps + 1))


@dataclass
class Report:
    """One client's reply: ``scalars[u]`` is its vector for uplink ``u`` (``nu`` values; ``d`` for the
    first-order baseline), ``loss`` its loss at ``w`` (for the logs), ``num_examples`` its data size."""

    round: int
    client: int
    scalars: torch.Tensor
    loss: float
    num_examples: int


@dataclass
class Downlink:
    """The server's reply to round ``t``: the update ``w <- w - lr sum_k c_k z_k`` as seed tuples and
    coefficients (or ``dense`` per parameter), the aggregates ``R`` per uplink, and what the round saw.

    A skipped round has ``skipped`` set and no update; ``loss`` is NaN when it was not computed."""

    round: int
    lr: float
    seed_tuples: list[tuple[int, ...]] = field(default_factory=list)
    coefficients: list[float] = field(default_factory=list)
    aggregates: list[list[float]] = field(default_factory=list)
    dense: list[torch.Tensor] | None = None
    skipped: str | None = None
    loss: float = math.nan
    nonfinite: int = 0
    participants: list[int] = field(default_factory=list)  # the clients whose reports entered the round
    received: int = 0
    rejected: int = 0
    diagnostics: list[dict] = field(default_factory=list)  # one dict per uplink
    history: list[list[float]] | None = None  # a stateful rule's record per uplink (one number per participant)

    def terms(self) -> list[tuple[int, float]]:
        """``(direction seed, coefficient)`` pairs of the update."""
        return [(direction_seed(*k), c) for k, c in zip(self.seed_tuples, self.coefficients, strict=True)]

"""The two-point schedule of a run (``zo_schedule``): how a step's forwards at ``w + mu z`` and ``w - mu z`` and the
update get their directions, decided once per run. Every schedule is exact (the losses of two_forwards, bitwise
for cached):

    two_forwards  two forwards, z drawn (fused into p + c z) for each and for the update: 3 passes
    cached        z drawn once per round and kept (nu d values) for the second forward and the update
    antithetic    one forward of the doubled batch [x; x], each module drawing z once for +mu and -mu
                  (checked against two forwards at its first round; two_forwards if it does not match)
    auto          two_forwards when the generator draws and adds in one fused pass (regenerating z costs
                  less than reading it back) and a forward is one chunk; else cached when the round's directions fit
                  ``zo_cache_budget_gb``; else two_forwards. And, when the clients share their model and 2 nu
                  copies of the trainable weights fit the budget, the 2 nu evaluations of a step in stacked
                  forwards (``perturbation.stacked``) if a shared input meets every direction's weights in one
                  matrix product (a first ``nn.Linear``: MLPs, logistic regression) and they give the
                  one-direction-at-a-time losses at the first round. And, when the clients hold different
                  models (local steps after the first, per-client directions) and their local models fit the
                  budget, all clients in one forward (``stacked_clients``: a batched product per linear layer,
                  the rows each client reads of each embedding table) if it gives the client-by-client losses at
                  its first use

``auto`` keeps the round's directions (cached, when they fit the budget) when a forward is split into chunks
(``chunks.forward_chunks``), since a fused draw is made again for every chunk.
"""

from __future__ import annotations

import logging

import torch

from .perturbation import ParameterTable

logger = logging.getLogger(__name__)

RESOLVES_TO = {"auto": ("two_forwards", "cached"), "antithetic": ("two_forwards",)}  # after their checks


class Schedule:
    """The two-point schedule of a run; ``"auto"`` resolves at the first round and stays resolved.

    Args:
        name: ``zo_schedule``.
        cache_budget_gb: ``zo_cache_budget_gb``, the memory ``auto`` may spend on keeping a round's directions.
    """

    def __init__(self, name: str, cache_budget_gb: float = 0.0):
        self.name, self.cache_budget_gb = name, cache_budget_gb
        self.setting = (name, float(cache_budget_gb))  # zo_schedule and zo_cache_budget_gb as given
        self.verified = name != "antithetic"  # antithetic is checked against two forwards once
        self.stack = None if name == "auto" else False  # stacked directions: decided and checked at a first step
        self.stack_rows = 0  # examples x models of one stacked forward (from the probe, when stacked)
        self.stack_clients = None if name == "auto" else False  # clients' local models in one forward: checked once
        self.rows_only: tuple[int, ...] = ()  # then, the embedding tables the clients' local models keep by rows

    def decisions(self) -> dict:
        """What the checks decided, as plain values (``None``: not decided yet, left out): a Flower node keeps them
        in its state so that it checks once per run, as the trainer does, not at every plan."""
        values = {"format": 1, "for_schedule": self.setting[0], "for_budget": self.setting[1], "name": self.name,
                  "verified": self.verified, "stack_rows": self.stack_rows, "stack": self.stack,
                  "stack_clients": self.stack_clients}
        return {key: value for key, value in values.items() if value is not None}

    @classmethod
    def restored(cls, name: str, cache_budget_gb: float, decisions=None) -> Schedule:
        """A schedule for ``zo_schedule=name`` carrying ``decisions`` (from :meth:`decisions` of a schedule of the
        same settings; anything else, or values of other types, is ignored and checked again)."""
        schedule = cls(name, cache_budget_gb)
        decisions = dict(decisions or {})
        settings = (decisions.get("format"), decisions.get("for_schedule"), decisions.get("for_budget"))
        if settings != (1, *schedule.setting):
            return schedule
        verified = decisions.get("verified")
        if (decisions.get("name") not in {name, *RESOLVES_TO.get(name, ())} or type(verified) is not bool
                or (not verified and name != "antithetic")):  # only antithetic starts unchecked
            return schedule
        schedule.name, schedule.verified = decisions["name"], decisions["verified"]
        if name == "auto":
            for key, kind in (("stack", bool), ("stack_clients", bool), ("stack_rows", int)):
                if type(decisions.get(key)) is kind:
                    setattr(schedule, key, decisions[key])
        return schedule

    def _fits(self, table: ParameterTable, copies: int) -> bool:
        return copies * sum(p.numel() * p.element_size() for p in table.params) <= self.cache_budget_gb * 2**30

    def keeps_local_models(self, table: ParameterTable, num_clients: int) -> bool:
        """Whether ``num_clients`` local models (one copy of the trainable float32/float64 weights each, and one
        scratch copy) fit ``cache_budget_gb``: then local steps advance each client's model instead of
        regenerating its terms."""
        if table.stream is not None or any(p.dtype not in (torch.float32, torch.float64) for p in table.params):
            return False  # streamed weights have no room for copies; a half-precision local model would be rounded
        return self._fits(table, num_clients + 1)

    def resolve(self, table: ParameterTable, num_directions: int, chunks: int = 1) -> str:
        """The schedule of a round that evaluates ``num_directions`` directions of ``table``'s parameters in
        forwards of ``chunks`` chunks each (:func:`forward_chunks`): a fused draw is regenerated per chunk, so
        split forwards keep the round's directions when they fit. An offloaded model (``table.stream``) streams each
        layer once per forward, perturbed in place: ``auto`` is ``two_forwards`` and stacks nothing. A round without
        directions (first order) decides nothing: ``auto`` stays undecided."""
        if num_directions == 0:
            return self.name
        if table.stream is not None:
            self.stack = self.stack_clients = False
            if self.name == "auto":
                self.name = "two_forwards"
                logger.info("zo_schedule='auto': two_forwards (offloaded model: weights streamed, directions "
                            "regenerated).")
        if self.name == "auto":  # decided once, at the first round
            directions = table.directions
            kept_bytes = directions.kept_bytes(table.params) * num_directions
            fused = all(directions.fused(p) for p in table.params)
            fits = kept_bytes <= self.cache_budget_gb * 2**30
            self.name = "cached" if fits and (not fused or chunks > 1) else "two_forwards"
            logger.info("zo_schedule='auto': %s (fused draws: %s; %d chunks per forward; the round's directions "
                        "take %.3g GB, zo_cache_budget_gb=%g).", self.name, fused, chunks, kept_bytes / 2**30,
                        self.cache_budget_gb)
        return self.name

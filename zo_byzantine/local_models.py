"""The clients' local models within a round (local steps after the first, SPEC 1.5), and the trainable tensors
they may keep by rows."""

from __future__ import annotations

from collections import Counter

import torch

from .perturbation import ParameterTable, Terms, kept_buffer


class LocalModels:
    """The clients' local models within a round, ``w_i = w + sum_k c_{i,k} z_k`` (their earlier local steps), kept
    as one tensor ``[m, ...]`` per parameter and advanced in place by the terms added since the last call: a
    forward at local step ``l`` then draws its perturbation only (``nu`` terms per advance), not the ``l nu``
    terms of its model (SPEC 1.5); with shared directions each is drawn once for all clients (``cache``). Equal to
    the regenerated sum up to rounding (the sum is accumulated in a different order).

    ``rows_only``: parameters read by rows alone (embedding tables, when the clients are stacked): kept only at
    the rows each client reads (:meth:`perturbed_rows`), by the same arithmetic as the whole tensor, so the same
    bits; :meth:`materialize` forms them whole when a plain forward needs them.
    """

    def __init__(self, table: ParameterTable, num_clients: int, rows_only=frozenset()):
        self.table, self.m = table, num_clients
        self.rows_only = set(rows_only)
        self.held: list[tuple] = [() for _ in range(num_clients)]  # the terms each client's weights hold
        self.steps: list[list[Terms]] = [[] for _ in range(num_clients)]  # each client's advances, in order
        self.weights: list[torch.Tensor | None] | None = None  # per parameter [m, ...]; None: rows only
        self.scratch: dict = {}  # per parameter, one copy (when drawing into a cache)
        self.row_models: dict = {}  # (index, client) -> (its rows, its model there, advances applied)
        self.row_draws: dict = {}  # (seed, index, client) -> (its rows, z there)

    def _extends(self, client: int, terms) -> bool:
        """Whether ``terms`` extend the terms client ``client``'s weights hold."""
        return tuple(terms[: len(self.held[client])]) == self.held[client]

    def _copies(self, param: torch.Tensor) -> torch.Tensor:
        return param.detach().unsqueeze(0).repeat(self.m, *[1] * param.dim())

    def pending(self, terms_per_client: list[Terms]) -> list[Terms]:
        """The terms each client's weights still lack for ``terms_per_client`` (all of them when not an extension)."""
        return [list(terms[len(self.held[i]):]) if self._extends(i, terms) else list(terms)
                for i, terms in enumerate(terms_per_client)]

    def advance(self, terms_per_client: list[Terms], cache: dict | None = None,
                keep=frozenset()) -> list[torch.Tensor | None] | None:
        """Every client's weights ``w + sum terms_i`` (per parameter ``[m, ...]``; ``None`` for a parameter kept by
        rows), or ``None`` when all terms are empty (``w`` itself). A direction several clients add is drawn once
        into ``cache`` (and dropped after each tensor unless its seed is in ``keep``); one a single client adds is
        drawn and added in place by the generator's fused pass."""
        terms_per_client = [tuple(terms) for terms in terms_per_client]
        if not any(terms_per_client):
            return None
        params = [p.detach() for p in self.table.params]
        if self.weights is None:
            self.weights = [None if j in self.rows_only else self._copies(p) for j, p in enumerate(params)]
        new = []
        for i, terms in enumerate(terms_per_client):
            if not self._extends(i, terms):  # not an extension of the model held: start again from w
                for w, p in zip(self.weights, params, strict=True):
                    if w is not None:
                        w[i].copy_(p)
                self.held[i], self.steps[i] = (), []
                for key in [key for key in self.row_models if key[1] == i]:
                    del self.row_models[key]
            new.append(list(terms[len(self.held[i]):]))
            self.held[i] = terms
            if new[i]:
                self.steps[i].append(new[i])
        directions = self.table.directions
        uses = Counter(seed for terms in new for seed, _ in terms)
        for j, w in enumerate(self.weights):
            if w is None:
                continue
            for i, terms in enumerate(new):
                if terms and cache is not None and any(uses[seed] > 1 for seed, _ in terms):
                    scratch = kept_buffer(self.scratch, j, params[j])  # the sum into kept memory: none new per step
                    w[i].add_(directions.total(scratch, j, terms, cache, out=scratch))
                elif terms:
                    directions.step_(w[i], j, terms, lr=-1.0)  # w_i + sum c z, the same arithmetic
            if cache is not None:
                for seed in uses:
                    if seed not in keep:
                        cache.pop((seed, j), None)
        return self.weights

    def materialize(self) -> list[torch.Tensor] | None:
        """The weights with every parameter kept whole (those kept by rows formed from ``w`` and the advances)."""
        for j in sorted(self.rows_only):
            self.rows_only.discard(j)
            if self.weights is None:
                continue
            self.weights[j] = self._copies(self.table.params[j])
            for i in range(self.m):
                for terms in self.steps[i]:
                    self.table.directions.step_(self.weights[j][i], j, terms, lr=-1.0)
        return self.weights

    def _draws(self, index: int, client: int, rows: torch.Tensor, terms: Terms) -> dict:
        """``z[rows]`` of each direction of ``terms``, drawn at those rows only, kept for the round."""
        directions, like, out = self.table.directions, self.table.params[index], {}
        for seed, _ in terms:
            held = self.row_draws.get((seed, index, client))
            if held is None or not torch.equal(held[0], rows):
                held = (rows, directions.draw_rows(like, seed, index, rows))
                self.row_draws[(seed, index, client)] = held
            out[(seed, index)] = held[1]
        return out

    def perturbed_rows(self, index: int, client: int, rows: torch.Tensor, terms: Terms) -> torch.Tensor:
        """Rows ``rows`` of client ``client``'s parameter ``index`` (kept by rows) plus ``sum terms``: the bits of
        ``perturb(its whole local model, terms)[rows]``."""
        directions = self.table.directions
        held_rows, model, applied = self.row_models.get((index, client), (None, None, 0))
        if held_rows is None or not torch.equal(held_rows, rows):
            model, applied = self.table.params[index].detach()[rows].clone(), 0
        for step in self.steps[client][applied:]:  # the advances of the whole tensor, on these rows
            model.add_(directions.total(model, index, step, self._draws(index, client, rows, step)))
        self.row_models[(index, client)] = (rows, model, len(self.steps[client]))
        if not terms:
            return model
        return directions.perturb(model, index, terms, self._draws(index, client, rows, terms))


def rows_only_parameters(table: ParameterTable) -> set[int]:
    """Trainable parameters read only by rows: the weight of a plain ``nn.Embedding`` (no ``max_norm``), not tied
    to another module, and not inside another module that owns trainable parameters (which runs once per client
    with whole weights)."""
    if not table.directions.draws_rows:  # drawing a table's rows would draw the whole table, per client
        return set()
    owners = [module for module, _ in table.owners]
    found = set()
    for module, owned in table.owners:
        plain = type(module).forward is torch.nn.Embedding.forward and "forward" not in module.__dict__
        nested = any(other is not module and any(m is module for m in other.modules()) for other in owners)
        if plain and module.max_norm is None and not nested:
            found.update(index for name, index in owned if name == "weight" and index not in table.tied)
    return found

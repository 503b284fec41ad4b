"""The round's participants of one process, evaluated together (SPEC 7): what ``client.client_reports``
calls ``clients``.

Every participant's examples are stacked in one batch; losses at ``w + sum_k c_k z_k`` come from one
batched forward per sign when all clients share their terms (one per client otherwise), split per client
by ``client_of_example``. Schedules of the two-point pair (``zo_schedule``), all exact (the losses of
two_forwards, bitwise for cached):

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

``zo_group_by_length``: the forwards' chunks hold examples of similar length, each cut to its longest example
(:func:`token_extents`), and their per-example losses are put back in the examples' order: the same losses up to
rounding, without the forwards over the round's padding. ``auto`` keeps the round's directions (cached, when they
fit the budget) when a forward is split into chunks, since a fused draw is made again for every chunk. The
stacked-clients forward (local steps after the first) runs whole, padded as given.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable

import torch

from .losses import IGNORE_INDEX, client_losses, per_example_loss
from .perturbation import ParameterTable, Terms, antithetic, kept_buffer, perturbed, stacked

logger = logging.getLogger(__name__)

STACKED_BYTES = 2**30  # the activations of one stacked forward (module outputs, measured per row by the probe)
MIN_ROW_BYTES = 1024  # a row's activations when the probe sees no tensor output


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
        if any(p.dtype not in (torch.float32, torch.float64) for p in table.params):
            return False  # a half-precision local model would be rounded at every step
        return self._fits(table, num_clients + 1)

    def resolve(self, table: ParameterTable, num_directions: int, chunks: int = 1) -> str:
        """The schedule of a round that evaluates ``num_directions`` directions of ``table``'s parameters in
        forwards of ``chunks`` chunks each (:func:`forward_chunks`): a fused draw is regenerated per chunk, so
        split forwards keep the round's directions when they fit."""
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


def _tensor_bytes(value) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or dicts, tuples and lists of them)."""
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, tuple | list):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _rows(inputs: dict) -> int:
    return next(v.shape[0] for v in inputs.values() if torch.is_tensor(v))


def _slice(inputs: dict, start: int, stop: int, total: int) -> dict:
    return {k: v[start:stop] if torch.is_tensor(v) and v.shape[:1] == (total,) else v for k, v in inputs.items()}


def chunk_size(rows: int, forward_batch_size: int, batch: int, group_by_length: bool) -> int:
    """Examples per forward chunk: ``forward_batch_size``, else a client's ``batch`` when grouped by length, else
    all ``rows``."""
    return forward_batch_size or (batch if group_by_length else rows)


def forward_chunks(rows: int, forward_batch_size: int, batch: int, group_by_length: bool) -> int:
    """Forward chunks of ``rows`` examples (:func:`chunk_size` each)."""
    return -(-rows // max(chunk_size(rows, forward_batch_size, batch, group_by_length), 1))


def token_extents(inputs: dict) -> torch.Tensor:
    """Per example, the columns a forward must keep: ``1 + the last column`` that is attended (``attention_mask``)
    or a target (token ``labels`` other than -100). The columns after it are right padding, which no kept
    position attends to and no loss reads: exact (up to rounding) for models that see padding through the
    attention mask alone (BERT, GPT-2, Llama, ...), not for those that read pad embeddings (convolutions over
    tokens, Funnel's pooling)."""
    mask = inputs.get("attention_mask")
    if not torch.is_tensor(mask) or mask.dim() != 2:
        raise ValueError("zo_group_by_length=True needs an `attention_mask` of shape [examples, tokens] in every "
                         f"batch (a padding collator's); this batch has {sorted(inputs)}.")
    needed = mask != 0
    labels = inputs.get("labels")
    if torch.is_tensor(labels) and labels.shape == mask.shape and not labels.is_floating_point():
        needed = needed | (labels != IGNORE_INDEX)
    columns = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (needed * columns).amax(dim=1)


def _trimmed(inputs: dict, rows: torch.Tensor, extents: torch.Tensor, total: int, width: int) -> dict:
    """Examples ``rows`` of ``inputs``, their token-aligned tensors (``[examples, tokens, ...]``, or ``[1, tokens,
    ...]`` shared by all, as ``position_ids`` may be) cut to the longest extent among them (at least one column).
    Float ``labels`` are never cut (multi-label targets ``[examples, labels]``): float token targets are not
    supported."""
    keep = max(int(extents[rows].max()), 1)
    out = {}
    for key, value in inputs.items():
        if torch.is_tensor(value) and value.shape[:1] in ((total,), (1,)) and value.dim() >= 1:
            if value.shape[0] == total:
                value = value[rows]
            if value.dim() >= 2 and value.shape[1] == width and not (key == "labels" and value.is_floating_point()):
                value = value[:, :keep]
        out[key] = value
    return out


class BatchedClients:
    """``m`` clients of ``batch`` examples each, stacked in ``inputs`` (client-major).

    Args:
        forward: ``forward(model, inputs) -> (per-example loss sums, counts)``.
        forward_batch_size: examples per forward chunk (0: all at once).
        group_by_length: forward chunks of examples of similar length (``forward_batch_size`` each, else ``batch``),
            each cut to its own longest example (:func:`token_extents`): the same losses up to rounding, without
            the forwards over the round's padding.
        context: a context-manager factory wrapped around every forward (autocast).
        cache: the round's directions by ``(seed, tensor)`` for ``schedule="cached"``, else ``None``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        table: ParameterTable,
        inputs: dict,
        num_clients: int,
        batch: int,
        forward: Callable,
        schedule: Schedule,
        forward_batch_size: int = 0,
        context: Callable = contextlib.nullcontext,
        cache: dict | None = None,
        direction_batch: int = 0,
        group_by_length: bool = False,
    ):
        total = _rows(inputs)
        if total != num_clients * batch:
            raise ValueError(f"A round's batch has {total} rows; expected {num_clients} clients x {batch} examples.")
        if direction_batch and batch % direction_batch:
            raise ValueError(f"zo_direction_batch_size={direction_batch} does not divide the clients' batch {batch}.")
        self.direction_batch = direction_batch
        self._per_direction: BatchedClients | None = None  # the m nu (client, direction) batches, built once
        self.model, self.table, self.inputs = model, table, inputs
        self.m, self.batch, self.forward, self.schedule = num_clients, batch, forward, schedule
        self.chunk, self.context, self.cache = forward_batch_size, context, cache
        self.group_by_length = group_by_length
        # the directions of the latest local step, drawn once for all clients' forwards and advances (stacked
        # clients, or the local models' advances), dropped when no client needs them any more
        self.recent: dict = {}
        self.scratch: dict = {}  # the stacked weights' memory, kept from one forward to the next
        self._sizes: tuple[int, int, int] | None = None  # bytes: all trainable, the largest tensor, linear layers'
        keeps = schedule.keeps_local_models(table, num_clients)
        rows_only = set(schedule.rows_only) if schedule.stack_clients is True else set()
        self.local = LocalModels(table, num_clients, rows_only) if keeps else None
        self.rows = torch.arange(num_clients, device=next(v for v in inputs.values() if torch.is_tensor(v)).device)
        self.rows = self.rows.repeat_interleave(batch)

    def client_inputs(self, i: int) -> dict:
        return _slice(self.inputs, i * self.batch, (i + 1) * self.batch, self.m * self.batch)

    def _chunks(self, inputs: dict) -> tuple[list[dict], torch.Tensor | None]:
        """The forward chunks of ``inputs`` and, when grouped by length, the inverse of the order they hold the
        examples in (the chunks' outputs, concatenated, are put back in the examples' order by it)."""
        total = _rows(inputs)
        size = chunk_size(total, self.chunk, self.batch, self.group_by_length)
        if not self.group_by_length:
            return [_slice(inputs, start, start + size, total) for start in range(0, total, size)], None
        extents = token_extents(inputs)
        order = torch.argsort(extents, stable=True)
        width = inputs["attention_mask"].shape[1]
        chunks = [_trimmed(inputs, order[s : s + size], extents, total, width) for s in range(0, total, size)]
        return chunks, torch.argsort(order)

    @staticmethod
    def _in_order(values: list[torch.Tensor], inverse: torch.Tensor | None) -> torch.Tensor:
        """The chunks' per-example ``values`` (examples on the last dimension) in the examples' order."""
        joined = torch.cat(values, dim=-1)
        return joined if inverse is None else joined[..., inverse.to(joined.device)]

    def batched_losses(self, inputs: dict, client_of_example, num_clients: int, terms: Terms, cache=None,
                       base: list[torch.Tensor] | None = None):
        """Loss of each client at ``w + sum_k c_k z_k`` (``base + ...`` when given): forwards over all clients'
        examples."""
        sums, counts = [], []
        chunks, inverse = self._chunks(inputs)
        with perturbed(self.table, terms, cache, base), self.context():
            for chunk in chunks:
                s, c = self.forward(self.model, chunk)
                sums.append(s)
                counts.append(c)
        return client_losses(self._in_order(sums, inverse), self._in_order(counts, inverse), client_of_example,
                             num_clients)

    def antithetic_losses(self, inputs: dict, client_of_example, num_clients: int, base: Terms, seed: int, mu: float):
        """Losses at ``w + base + mu z`` and ``w + base - mu z`` from forwards of doubled batches ``[x; x]``."""
        halves = [[], [], [], []]  # plus sums, plus counts, minus sums, minus counts
        chunks, inverse = self._chunks(inputs)
        for chunk in chunks:
            n = _rows(chunk)
            doubled = {k: torch.cat([v, v]) if torch.is_tensor(v) and v.shape[:1] == (n,) else v
                       for k, v in chunk.items()}
            with antithetic(self.table, base, seed, mu, 2 * n), self.context():
                s, c = self.forward(self.model, doubled)
            for store, value in zip(halves, (s[:n], c[:n], s[n:], c[n:]), strict=True):
                store.append(value)
        plus, minus = (client_losses(self._in_order(halves[k], inverse), self._in_order(halves[k + 1], inverse),
                                     client_of_example, num_clients) for k in (0, 2))
        return plus.cpu(), minus.cpu()

    def losses(self, terms_per_client: list, cache: dict | None = None) -> torch.Tensor:
        """One batched evaluation when all clients share their terms, else (float64, on CPU) with local models
        kept client ``i`` is evaluated at its model ``w + terms[:-1]`` plus the last term: all clients in one
        forward when stacking clients was chosen (:meth:`stacked_clients`), else one forward per client."""
        first = terms_per_client[0]
        if all(terms == first for terms in terms_per_client):
            return self.batched_losses(self.inputs, self.rows, self.m, first, cache).cpu()
        if cache is None and self._may_stack_clients(terms_per_client):
            if self.schedule.stack_clients is None:
                return self.checked_client_stacking(terms_per_client)
            try:
                return self.stacked_clients(terms_per_client)
            except Exception as err:  # noqa: BLE001 -- a later step the check did not see: fall back, keep training
                logger.warning("Stacked clients failed (%s: %s); evaluating client by client from here on.",
                               type(err).__name__, err)
                self.schedule.stack_clients = False
        return self.client_by_client(terms_per_client, cache)

    def _may_stack_clients(self, terms_per_client: list) -> bool:
        """Stacking clients needs, within the budget: their local models and the directions they draw (a
        direction several clients add, one tensor at a time; each distinct last term, whole), each linear layer's
        stacked weights and their sum (m + 1 copies of its weight and bias, frozen or not); and all examples in
        one forward."""
        split = self.chunk and self.chunk < _rows(self.inputs)
        if self.schedule.stack_clients is False or self.local is None or split:
            return False
        if self._sizes is None:  # the same for every step of the round
            size = [p.numel() * p.element_size() for p in self.table.params]
            linear = sum(sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
                         for module, _ in self.table.owners if isinstance(module, torch.nn.Linear))
            self._sizes = (sum(size), max(size), linear)
        whole, largest, linear = self._sizes
        pending = self.local.pending([terms[:-1] for terms in terms_per_client])
        uses = Counter(seed for terms in pending for seed, _ in terms)
        last = {terms[-1][0] for terms in terms_per_client if terms}
        needed = ((self.m + 1 + len(last)) * whole + (self.m + 1) * linear
                  + sum(1 for n in uses.values() if n > 1) * largest)
        return needed <= self.schedule.cache_budget_gb * 2**30

    def _bases(self, terms_per_client: list, stacking: bool = False) -> tuple[list[torch.Tensor] | None, list]:
        """The clients' local models ``w + terms_i[:-1]`` (per parameter ``[m, ...]``; ``None``: all at ``w``) and
        the terms left to add on them; ``stacking``: directions several clients share are drawn once into the
        recent ones, which keep only what a client still needs."""
        last = {seed for terms in terms_per_client for seed, _ in terms[-1:]}
        bases = self.local.advance([terms[:-1] for terms in terms_per_client], self.recent if stacking else None,
                                   keep=last)
        rest = terms_per_client if bases is None else [terms[-1:] for terms in terms_per_client]
        needed = {seed for terms in rest for seed, _ in terms}
        for key in [k for k in self.recent if k[0] not in needed]:
            del self.recent[key]
        return bases, rest

    def stacked_clients(self, terms_per_client: list, usage: dict | None = None) -> torch.Tensor:
        """Client ``i`` at ``w + sum terms_i`` for all clients in one forward of the stacked batch: each linear
        layer one batched product over the clients' weights, each embedding only the rows a client reads."""
        bases, rest = self._bases(terms_per_client, stacking=True)
        by_rows = {} if bases is None else {j: self._rows_of(j) for j in self.local.rows_only}
        with stacked(self.table, rest, self.batch, usage, bases=bases, cache=self.recent, per_group_products=True,
                     scratch=self.scratch, rows_of=by_rows), self.context():
            sums, counts = self.forward(self.model, self.inputs)
        return client_losses(sums, counts, self.rows, self.m).cpu()

    def _rows_of(self, index: int) -> Callable:
        return lambda client, rows, terms: self.local.perturbed_rows(index, client, rows, terms)

    def checked_client_stacking(self, terms_per_client: list) -> torch.Tensor:
        """At the first step whose clients hold different models: the stacked losses if they give the
        client-by-client ones (then used from here on), else those."""
        reference = self.client_by_client(terms_per_client)
        self.schedule.stack_clients = False  # unless the check below passes
        usage: dict = {}
        try:
            candidate = self.stacked_clients(terms_per_client, usage)
        except Exception as err:  # noqa: BLE001 -- any model may fail to run stacked: then it is not stacked
            logger.info("zo_schedule='auto': clients not stacked (%s: %s).", type(err).__name__, err)
            return reference
        agrees = torch.allclose(candidate, reference, rtol=1e-4, atol=1e-6)
        self.schedule.stack_clients = bool(agrees)
        # from the next round, the embedding tables this forward read by rows only are kept by rows
        by_rows = usage.get("read_by_rows", set()) - usage.get("read_whole", set())
        self.schedule.rows_only = tuple(sorted(by_rows & rows_only_parameters(self.table)))
        logger.info("zo_schedule='auto': clients' local models %s.", "stacked in one forward" if agrees else
                    "not stacked (the stacked forward does not give the client-by-client losses)")
        # as for stacked directions: the checking step returns what every later step computes
        return candidate if agrees else reference

    def client_by_client(self, terms_per_client: list, cache: dict | None = None) -> torch.Tensor:
        """One forward per client at ``w + sum terms_i`` (its local model plus the last term when kept)."""
        bases, rest = self._bases(terms_per_client) if self.local is not None else (None, terms_per_client)
        if bases is not None and self.local.rows_only:  # a plain forward reads whole tables
            bases = self.local.materialize()
        each = self._each_client(lambda i, inputs, one: self.batched_losses(
            inputs, one, 1, rest[i], cache, None if bases is None else [w[i] for w in bases]))
        return torch.cat(each).cpu()

    def _each_client(self, evaluate: Callable) -> list:
        """``evaluate(i, inputs_i, one)`` for every client ``i`` on its own examples (``one``: their client index
        within ``inputs_i``, all 0)."""
        one = torch.zeros(self.batch, dtype=torch.long, device=self.rows.device)
        return [evaluate(i, self.client_inputs(i), one) for i in range(self.m)]

    @staticmethod
    def _joined(pairs: list) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([plus for plus, _ in pairs]), torch.cat([minus for _, minus in pairs])

    def loss_pairs(self, offsets: list, seeds: list[list[int]], mu: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Losses at ``w_i + offset_i +- mu z_{i,r}`` for every direction ``r`` of ``seeds[i]`` (m x nu each):
        stacked forwards when the clients share their model (``offset_i`` alike: K = 1, or a first local step) and
        stacking was chosen, else one direction at a time. Shared directions stack every client's examples in each
        forward; per-client directions (FedES) stack each client's 2 nu models on its own examples."""
        if self.direction_batch:
            return self._direction_batches(offsets, seeds, mu)
        same_model = all(o == offsets[0] for o in offsets)
        if same_model and self.schedule.stack is None:
            self.schedule.stack = False  # unless the check below passes
            reference = self._one_at_a_time(offsets, seeds, mu)
            candidate = self.checked_stacking(offsets[0], seeds, mu, reference)
            self.schedule.stack = candidate is not None
            # the checking round returns what every later round will compute, so that a run resumed after it
            # (which checks at another round) follows the same trajectory bitwise
            return reference if candidate is None else candidate
        if same_model and self.schedule.stack:
            return self._stacked(offsets[0], seeds, mu)
        return self._one_at_a_time(offsets, seeds, mu)

    def _direction_batches(self, offsets: list, seeds: list[list[int]], mu: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Direction ``r`` of client ``i`` on examples ``[r n_B, (r+1) n_B)`` of its batch (FedES's one loss
        difference per batch): the same rows cut into ``m nu`` batches of ``n_B`` are ``m nu`` clients of one
        direction each, evaluated by the same schedule; their losses reshaped to ``m x nu``."""
        nu = len(seeds[0])
        if nu * self.direction_batch != self.batch:
            raise ValueError(f"{nu} directions of zo_direction_batch_size={self.direction_batch} examples need a "
                             f"batch of {nu * self.direction_batch} per client; it has {self.batch}.")
        if self._per_direction is None:
            self._per_direction = BatchedClients(
                self.model, self.table, self.inputs, self.m * nu, self.direction_batch, self.forward, self.schedule,
                self.chunk, self.context, self.cache, group_by_length=self.group_by_length)
        plus, minus = self._per_direction.loss_pairs([o for o in offsets for _ in range(nu)],
                                                     [[seed] for row in seeds for seed in row], mu)
        return plus.view(self.m, nu), minus.view(self.m, nu)

    def _one_at_a_time(self, offsets, seeds, mu):
        pairs = [self.loss_pair(offsets, [s[r] for s in seeds], mu) for r in range(len(seeds[0]))]
        return torch.stack([p for p, _ in pairs], dim=1), torch.stack([m for _, m in pairs], dim=1)

    def _stacked(self, offset: Terms, seeds: list[list[int]], mu: float) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`stacked_pairs` over all clients at once when they share their directions, else client by client."""
        if all(s == seeds[0] for s in seeds):
            return self.stacked_pairs(self.inputs, self.rows, self.m, offset, seeds[0], mu)
        return self._joined(self._each_client(
            lambda i, inputs, one: self.stacked_pairs(inputs, one, 1, offset, seeds[i], mu)))

    def stacked_pairs(self, inputs: dict, client_of_example, num_clients: int, offset: Terms, seeds: list[int],
                      mu: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The clients of ``inputs`` at ``w + offset +- mu z_r`` for all ``r``, the 2 nu models evaluated in stacked
        forwards of at most ``schedule.stack_rows`` examples x models (num_clients x nu each)."""
        models = [[*offset, (seed, sign * mu)] for seed in seeds for sign in (1.0, -1.0)]
        sums, counts = [], []  # per example chunk: [models, rows]
        chunks, inverse = self._chunks(inputs)
        for chunk in chunks:
            rows = _rows(chunk)
            per = max(1, self.schedule.stack_rows // rows)
            parts = []
            for start in range(0, len(models), per):
                group = models[start : start + per]
                s, c = self._stacked_forward(chunk, group)
                parts.append((s.view(len(group), rows), c.view(len(group), rows)))
            sums.append(torch.cat([s for s, _ in parts]))
            counts.append(torch.cat([c for _, c in parts]))
        sums, counts = self._in_order(sums, inverse), self._in_order(counts, inverse)
        losses = client_losses(sums, counts, client_of_example, num_clients).cpu()  # [2 nu, num_clients]
        return losses[0::2].T, losses[1::2].T

    def _stacked_forward(self, inputs: dict, models: list[Terms], usage: dict | None = None):
        """Per-example ``(sums, counts)`` of ``models`` on ``inputs`` (labels repeated per model), model-major."""
        rows, labels = _rows(inputs), inputs.get("labels")
        if torch.is_tensor(labels) and labels.dim() > 0 and labels.shape[0] == rows:
            inputs = {**inputs, "labels": labels.repeat(len(models), *[1] * (labels.dim() - 1))}
        with stacked(self.table, models, rows, usage), self.context():
            return self.forward(self.model, inputs)

    def checked_stacking(self, offset: Terms, seeds: list[list[int]], mu: float, reference) -> tuple | None:
        """The stacked losses if stacked forwards fit the budget, make a shared matrix product (else they would
        only split each module's forward, which costs more than it saves) and give ``reference`` (the
        one-at-a-time losses); else ``None``."""
        if not self.schedule._fits(self.table, 2 * len(seeds[0])):
            return None
        usage: dict = {}
        seen = [0]  # bytes of every module's outputs in the probe

        def count(_module, _inputs, outputs):
            seen[0] += _tensor_bytes(outputs)

        hooks = [module.register_forward_hook(count) for module in self.model.modules()]
        try:  # a probe first: two unperturbed models (nothing drawn) on one example
            try:
                self._stacked_forward(_slice(self.inputs, 0, 1, _rows(self.inputs)), [[], []], usage)
            finally:
                for hook in hooks:
                    hook.remove()
            if not usage.get("shared_products"):
                logger.info("zo_schedule='auto': stacked directions not used (no shared matrix product).")
                return None
            self.schedule.stack_rows = max(1, STACKED_BYTES // max(MIN_ROW_BYTES, seen[0] // 2))
            candidate = self._stacked(offset, seeds, mu)
        except Exception as err:  # noqa: BLE001 -- any model may fail to run stacked: then it is not stacked
            logger.info("zo_schedule='auto': stacked directions not used (%s: %s).", type(err).__name__, err)
            return None
        agrees = all(torch.allclose(c, r, rtol=1e-4, atol=1e-6) for c, r in zip(candidate, reference, strict=True))
        logger.info("zo_schedule='auto': stacked directions %s.", "used" if agrees else
                    "not used (they do not give the one-at-a-time losses)")
        return candidate if agrees else None

    def loss_pair(self, offsets: list, seeds: list[int], mu: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Losses at ``w_i + offset_i +- mu z_i`` with the run's schedule."""
        if not self.schedule.verified:
            self.schedule.name = self.choose_schedule(offsets, seeds, mu)
            self.schedule.verified = True
        if self.schedule.name == "antithetic":
            if all(o == offsets[0] for o in offsets) and len(set(seeds)) == 1:
                return self.antithetic_losses(self.inputs, self.rows, self.m, offsets[0], seeds[0], mu)
            return self._joined(self._each_client(
                lambda i, inputs, one: self.antithetic_losses(inputs, one, 1, offsets[i], seeds[i], mu)))
        cache = self.cache if self.schedule.name == "cached" else None
        plus = self.losses([o + [(s, mu)] for o, s in zip(offsets, seeds, strict=True)], cache)
        minus = self.losses([o + [(s, -mu)] for o, s in zip(offsets, seeds, strict=True)], cache)
        return plus, minus

    def choose_schedule(self, offsets, seeds, mu) -> str:
        """The antithetic forward if it gives the two-forward losses for this model, else two_forwards."""
        reference = self.losses([o + [(s, mu)] for o, s in zip(offsets, seeds, strict=True)])
        self.schedule.verified = True
        try:
            candidate = self.loss_pair(offsets, seeds, mu)[0]
            agrees = torch.allclose(candidate, reference, rtol=1e-4, atol=1e-6)
        except (TypeError, RuntimeError, ValueError) as err:
            agrees, reference = False, err
        if not agrees:
            logger.warning(
                "The antithetic (doubled-batch) forward does not reproduce two plain forwards for this "
                "model (%s); using zo_schedule='two_forwards'.",
                reference,
            )
        return "antithetic" if agrees else "two_forwards"

    def gradients(self, terms_per_client: list):
        """Each client's backprop gradient of its loss at ``w + sum terms_i`` (one backward per client)."""
        table, grads, losses = self.table, [], []
        for i, terms in enumerate(terms_per_client):
            chunk = self.client_inputs(i)
            with torch.enable_grad(), perturbed(table, terms), self.context():
                sums, counts = per_example_loss(self.model, self.model(**chunk), chunk.get("labels"))
                loss = sums.sum() / counts.sum()
                found = torch.autograd.grad(loss, table.params, allow_unused=True)
            grads.append([torch.zeros_like(p) if g is None else g for p, g in zip(table.params, found, strict=True)])
            losses.append(loss.detach())
        return grads, torch.stack(losses).double().cpu()


def model_num_labels(model) -> int | None:
    """The model's number of classes (``num_labels`` or ``config.num_labels``), if it says."""
    return getattr(model, "num_labels", None) or getattr(getattr(model, "config", None), "num_labels", None)


def flip_labels(inputs: dict, rows: torch.Tensor, num_classes: int | None) -> dict:
    """Label flipping on the Byzantine clients' ``rows``: ``y -> C - 1 - y`` (ignored labels kept)."""
    labels = inputs.get("labels")
    if labels is None or labels.dim() != 1:
        raise ValueError("attack='lf' needs class labels of shape [batch] in the inputs.")
    if not num_classes:
        raise ValueError("attack='lf' needs the number of classes: set attack_kwargs={'num_classes': C}.")
    return {**inputs, "labels": torch.where(rows & (labels >= 0), num_classes - 1 - labels, labels)}

"""The per-client forward engine: the round's participants of one process, evaluated together (SPEC 7), what
``client.client_reports`` calls ``clients``; the trainer (every participant) and a Flower node (its own client)
use it alike.

Every participant's examples are stacked in one batch; losses at ``w + sum_k c_k z_k`` come from one
batched forward per sign when all clients share their terms (one per client otherwise), split per client
by ``client_of_example``. The pair's schedule (``schedule.Schedule``) decides how directions are drawn; the
forward chunks come from ``chunks``; local steps after the first advance ``local_models.LocalModels``. The
stacked-clients forward (local steps after the first) runs whole, padded as given.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable

import torch

from .chunks import chunk_size, rows_of, slice_rows, token_extents, trimmed
from .local_models import LocalModels, rows_only_parameters
from .losses import client_losses
from .perturbation import ParameterTable, Terms, antithetic, perturbed, stacked
from .schedule import Schedule

logger = logging.getLogger(__name__)

STACKED_BYTES = 2**30  # the activations of one stacked forward (module outputs, measured per row by the probe)
MIN_ROW_BYTES = 1024  # a row's activations when the probe sees no tensor output


def _tensor_bytes(value) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or dicts, tuples and lists of them)."""
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, tuple | list):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class _Reached(Exception):
    """Ends a probe forward at the first trainable module it reaches."""


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
        total = rows_of(inputs)
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
        return slice_rows(self.inputs, i * self.batch, (i + 1) * self.batch, self.m * self.batch)

    def _chunks(self, inputs: dict) -> tuple[list[dict], torch.Tensor | None]:
        """The forward chunks of ``inputs`` and, when grouped by length, the inverse of the order they hold the
        examples in (the chunks' outputs, concatenated, are put back in the examples' order by it)."""
        total = rows_of(inputs)
        size = chunk_size(total, self.chunk, self.batch, self.group_by_length)
        if not self.group_by_length:
            return [slice_rows(inputs, start, start + size, total) for start in range(0, total, size)], None
        extents = token_extents(inputs)
        order = torch.argsort(extents, stable=True)
        width = inputs["attention_mask"].shape[1]
        chunks = [trimmed(inputs, order[s : s + size], extents, total, width) for s in range(0, total, size)]
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
            n = rows_of(chunk)
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
        split = self.chunk and self.chunk < rows_of(self.inputs)
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
            rows = rows_of(chunk)
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
        rows, labels = rows_of(inputs), inputs.get("labels")
        if torch.is_tensor(labels) and labels.dim() > 0 and labels.shape[0] == rows:
            inputs = {**inputs, "labels": labels.repeat(len(models), *[1] * (labels.dim() - 1))}
        with stacked(self.table, models, rows, usage), self.context():
            return self.forward(self.model, inputs)

    def _first_owner_reads_the_input(self) -> bool:
        """Whether the first trainable module one plain forward (of one example) reaches is a plain ``nn.Linear`` on
        that example's rows: only then do stacked models share a matrix product. Once another owner (an embedding, a
        norm) has run, every later module reads activations that differ between the models, and the model's own
        per-row tensors (an attention mask, the positions a head reads) no longer match them."""
        first = []

        def hook(module, args, kwargs):
            first.append(type(module).forward is torch.nn.Linear.forward and "forward" not in module.__dict__
                         and len(args) == 1 and not kwargs and torch.is_tensor(args[0]) and args[0].dim() > 1
                         and args[0].shape[0] == 1)
            raise _Reached

        hooks = [module.register_forward_pre_hook(hook, with_kwargs=True) for module, _ in self.table.owners]
        try:
            with torch.no_grad(), self.context():
                self.forward(self.model, slice_rows(self.inputs, 0, 1, rows_of(self.inputs)))
        except _Reached:
            pass
        finally:
            for handle in hooks:
                handle.remove()
        return bool(first and first[0])

    def checked_stacking(self, offset: Terms, seeds: list[list[int]], mu: float, reference) -> tuple | None:
        """The stacked losses if stacked forwards fit the budget, make a shared matrix product (else they would
        only split each module's forward, which costs more than it saves) and give ``reference`` (the
        one-at-a-time losses); else ``None``."""
        if not self.schedule._fits(self.table, 2 * len(seeds[0])):
            return None
        if not self._first_owner_reads_the_input():
            logger.info("zo_schedule='auto': stacked directions not used (the first trainable module a forward reaches "
                        "is not a linear layer on the examples: no shared matrix product).")
            return None
        usage: dict = {}
        seen = [0]  # bytes of every module's outputs in the probe

        def count(_module, _inputs, outputs):
            seen[0] += _tensor_bytes(outputs)

        hooks = [module.register_forward_hook(count) for module in self.model.modules()]
        try:  # a probe first: two unperturbed models (nothing drawn) on one example
            try:
                self._stacked_forward(slice_rows(self.inputs, 0, 1, rows_of(self.inputs)), [[], []], usage)
            finally:
                for hook in hooks:
                    hook.remove()
            if not usage.get("shared_products"):
                logger.info("zo_schedule='auto': stacked directions not used (no shared matrix product).")
                return None
            self.schedule.stack_rows = max(1, STACKED_BYTES // max(MIN_ROW_BYTES, seen[0] // 2))
            candidate = self._stacked(offset, seeds, mu)
        except (RuntimeError, ValueError) as err:  # shapes a model cannot take stacked (its own per-row tensors read
            # beside the stacked activations): then it is not stacked; another error is a bug, raised
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
                sums, counts = self.forward(self.model, chunk)  # the rounds' loss route (losses.PerExampleForward)
                loss = sums.sum() / counts.sum()
                found = torch.autograd.grad(loss, table.params, allow_unused=True)
            grads.append([torch.zeros_like(p) if g is None else g for p, g in zip(table.params, found, strict=True)])
            losses.append(loss.detach())
        return grads, torch.stack(losses).double().cpu()

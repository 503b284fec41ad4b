"""Clients: partition of the training set, Byzantine set, client sampling, per-round batches.

Everything is a deterministic function of ``(zo_seed, round)``: the batch of round ``t`` does
not depend on what ran before, so resuming from a checkpoint continues the same trajectory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from . import seeds

PARTITIONS = ("iid", "dirichlet", "shards")


def iid_partition(num_examples: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle, then split into ``num_clients`` parts of (almost) equal size."""
    return [np.sort(part) for part in np.array_split(rng.permutation(num_examples), num_clients)]


def dirichlet_partition(labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator):
    """Per class ``c``: proportions ``p_c ~ Dir(alpha * 1_n)`` over clients; split class ``c`` by ``p_c``."""
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        cuts = (np.cumsum(rng.dirichlet(np.full(num_clients, alpha))) * len(members)).astype(int)[:-1]
        for client, chunk in enumerate(np.split(members, cuts)):
            parts[client].extend(chunk.tolist())
    return [np.sort(np.asarray(part, dtype=np.int64)) for part in parts]


def shards_partition(labels: np.ndarray, num_clients: int, rng: np.random.Generator, shards_per_client: int = 2):
    """Sort by label, cut into ``shards_per_client * n`` shards, deal them out at random."""
    order = np.argsort(labels, kind="stable")
    shards = np.array_split(order, shards_per_client * num_clients)
    dealt = rng.permutation(len(shards)).reshape(num_clients, shards_per_client)
    return [np.sort(np.concatenate([shards[s] for s in row])) for row in dealt]


def partition_dataset(
    kind: str,
    num_examples: int,
    num_clients: int,
    seed: int,
    labels: Sequence[int] | None = None,
    alpha: float = 1.0,
    min_examples: int = 1,
    max_draws: int = 100,
) -> list[np.ndarray]:
    """Indices of each client's examples. Re-draws (seeded) until every client has ``min_examples``."""
    if kind not in PARTITIONS:
        raise ValueError(f"partition={kind!r} is not supported; accepted: {', '.join(PARTITIONS)}.")
    if num_examples < num_clients * min_examples:
        raise ValueError(
            f"The training set has {num_examples} examples: too few for num_clients={num_clients} "
            f"with min_client_examples={min_examples}."
        )
    if kind != "iid" and labels is None:
        raise ValueError(f"partition={kind!r} needs labels: give the training set a 'label' or 'labels' column.")
    labels = None if labels is None else np.asarray(labels)
    for draw in range(max_draws):
        rng = seeds.rng(seed, seeds.PARTITION, draw)
        if kind == "iid":
            parts = iid_partition(num_examples, num_clients, rng)
        elif kind == "dirichlet":
            parts = dirichlet_partition(labels, num_clients, alpha, rng)
        else:
            parts = shards_partition(labels, num_clients, rng)
        if min(len(p) for p in parts) >= min_examples:
            return parts
    raise ValueError(
        f"partition={kind!r} (dirichlet_alpha={alpha}) left a client with fewer than min_client_examples="
        f"{min_examples} examples in {max_draws} seeded draws; raise dirichlet_alpha or lower min_client_examples."
    )


def byzantine_mask(num_clients: int, num_byzantine: int, seed: int, selection: str = "first") -> np.ndarray:
    """Which clients are Byzantine: ``0..b-1`` (``"first"``) or ``b`` drawn by ``(seed, BYZANTINE_SET)``."""
    if selection == "first":
        chosen = np.arange(num_byzantine)
    else:
        chosen = seeds.rng(seed, seeds.BYZANTINE_SET).choice(num_clients, num_byzantine, replace=False)
    mask = np.zeros(num_clients, dtype=bool)
    mask[chosen] = True
    return mask


def with_root(parts: list[np.ndarray], trusted: Sequence[int], root_examples: int, num_examples: int,
              seed: int) -> list[np.ndarray]:
    """``parts`` with each trusted client's share replaced by the root data set: ``root_examples`` indices drawn
    uniformly without replacement from the whole training set by ``(seed, ROOT)`` (FLTrust's clean sample of the
    task's distribution; the same for every trusted client). Raises if the set is smaller than ``root_examples``."""
    if root_examples > num_examples:
        raise ValueError(f"root_examples={root_examples}: the training set has {num_examples} examples; accepted: "
                         f"0 (off) or 1..{num_examples}.")
    root = np.sort(seeds.rng(seed, seeds.ROOT).choice(num_examples, root_examples, replace=False))
    return [root.copy() if client in trusted else part for client, part in enumerate(parts)]


def dataset_labels(dataset) -> np.ndarray | None:
    """The label column of ``dataset`` (``labels`` or ``label``), one class per example, or ``None`` when it has
    none. Labels that are not one number per example (token-level labels: sequences) raise a ``ValueError`` naming
    the column."""
    names = getattr(dataset, "column_names", None)
    for column in ("labels", "label"):
        if names is not None and column in names:
            return _one_per_example(dataset[column], column)
    try:
        first = dataset[0]
    except (TypeError, IndexError, KeyError):
        return None
    for column in ("labels", "label"):
        if isinstance(first, dict) and column in first:
            values = [dataset[i][column] for i in range(len(dataset))]
            return _one_per_example([v.item() if getattr(v, "ndim", None) == 0 else v for v in values], column)
    return None


def _one_per_example(values, column: str) -> np.ndarray:
    try:
        labels = np.asarray(values)
    except ValueError:  # sequences of different lengths
        labels = None
    if labels is None or labels.ndim != 1 or labels.dtype.kind not in "biuf":
        example = values[0] if len(values) else None
        raise ValueError(f"the training set's {column!r} are not one class per example (example 0: "
                         f"{str(example)[:40]}, {type(example).__name__}): token-level labels?")
    return labels


class Federation:
    """Clients of a run: their data, who is Byzantine, who takes part in round ``t``.

    Client ``c``'s data is an endless stream: pass ``p`` over its partition is shuffled by
    ``(seed, c, p)``; round ``t`` takes stream positions ``[t B, (t + 1) B)``.
    """

    def __init__(
        self,
        partitions: list[np.ndarray],
        batch_size: int,
        num_byzantine: int,
        seed: int,
        clients_per_round: int | None = None,
        byzantine_selection: str = "first",
    ):
        self.partitions = partitions
        self.num_clients = len(partitions)
        self.batch_size = batch_size
        self.seed = seed
        self.clients_per_round = clients_per_round or self.num_clients
        self.is_byzantine = byzantine_mask(self.num_clients, num_byzantine, seed, byzantine_selection)
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def participants(self, round_index: int) -> np.ndarray:
        """Sorted ids of the clients of round ``t``: all, or ``clients_per_round`` drawn by ``(seed, t)``."""
        if self.clients_per_round == self.num_clients:
            return np.arange(self.num_clients)
        draw = seeds.rng(self.seed, seeds.SAMPLING, round_index)
        chosen = draw.choice(self.num_clients, self.clients_per_round, replace=False)
        return np.sort(chosen)

    def _stream(self, client: int, positions: np.ndarray) -> np.ndarray:
        part = self.partitions[client]
        passes, within = np.divmod(positions, len(part))
        out = np.empty(len(positions), dtype=np.int64)
        for p in np.unique(passes):
            key = (client, int(p))
            if key not in self._perms:
                if len(self._perms) > 4 * self.num_clients:
                    self._perms.clear()
                self._perms[key] = part[seeds.rng(self.seed, seeds.DATA_ORDER, client, key[1]).permutation(len(part))]
            chosen = passes == p
            out[chosen] = self._perms[key][within[chosen]]
        return out

    def share(self, rank: int = 0, world: int = 1) -> slice:
        """Positions (in ``participants(t)``) of the clients that process ``rank`` of ``world`` evaluates."""
        sizes = [len(a) for a in np.array_split(np.arange(self.clients_per_round), world)]
        start = sum(sizes[:rank])
        return slice(start, start + sizes[rank])

    def round_indices(self, round_index: int, share: slice = slice(None)) -> list[int]:
        """Dataset indices of round ``t``: ``batch_size`` per participant (of ``share``), participants in order."""
        positions = np.arange(round_index * self.batch_size, (round_index + 1) * self.batch_size)
        clients = self.participants(round_index)[share]
        return np.concatenate([self._stream(int(c), positions) for c in clients]).tolist()

    @property
    def total_examples(self) -> int:
        return sum(len(p) for p in self.partitions)


class FederatedBatchSampler(torch.utils.data.Sampler):
    """Yields round ``t = epoch * len(self) + i`` as one batch of every participant's examples (of this
    process's share when the clients are spread over several processes).

    An epoch is ``ceil(N / (clients_per_round * B))`` rounds: about one pass over the data.
    """

    def __init__(self, federation: Federation, rank: int = 0, world: int = 1):
        self.federation, self.epoch = federation, 0
        self.share = federation.share(rank, world)  # this process's clients of every round

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        fed = self.federation
        return max(1, math.ceil(fed.total_examples / (fed.clients_per_round * fed.batch_size)))

    def __iter__(self):
        for i in range(len(self)):
            yield self.federation.round_indices(self.epoch * len(self) + i, self.share)

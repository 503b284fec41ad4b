"""Pre-flight checks of a run: the settings against the rule, the model and the data, before any work."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from torch.utils.data import IterableDataset

from .attacks import Attack, model_num_labels
from .bounds import check_ledger_size, memory_quarter_gb
from .federation import FederatedBatchSampler, Federation, dataset_labels, partition_dataset, with_root
from .trusted import trusted_clients

if TYPE_CHECKING:
    from .arguments import ZOByzantineArguments

logger = logging.getLogger(__name__)


def check_processes_and_objects(args: ZOByzantineArguments, aggregator, attack) -> None:
    """One device per process, at least one client per process, and no ``*_kwargs`` beside a rule or attack object
    given to the trainer (they would be ignored)."""
    if args.n_gpu > 1:
        raise ValueError(
            "ZOByzantineTrainer uses one device per process: launch one process per GPU "
            "(accelerate launch / torchrun) instead of DataParallel (n_gpu > 1)."
        )
    if (args.clients_per_round or args.num_clients) < args.world_size:
        raise ValueError(
            f"clients_per_round={args.clients_per_round or args.num_clients} must be >= the number of "
            f"processes ({args.world_size}): each process evaluates a share of the clients."
        )
    objects = ((aggregator, args.aggregator_kwargs, "aggregator"), (attack, args.attack_kwargs, "attack"))
    for given, kwargs, name in objects:
        if given is not None and kwargs:
            raise ValueError(f"{name}_kwargs={kwargs!r} would be ignored: an {name} object was passed to the "
                             "trainer (configure the object instead).")


def check_dense_memory(args: ZOByzantineArguments, d: int) -> None:
    """R^d aggregation (FedAvg, FedZO) holds n x d float64 values: refuse before training if they do not fit."""
    if args.estimator != "first_order" and args.aggregation_space != "parameter":
        return
    need = 3 * args.num_clients * d * 8  # vectors, attacked copy, reconstruction
    limit = args.dense_memory_limit_gb
    if limit is None:
        limit = memory_quarter_gb()
    if need > limit * 2**30:
        raise ValueError(
            f"Aggregating in R^d (estimator={args.estimator!r}, aggregation_space={args.aggregation_space!r}) needs "
            f"about {need / 2**30:.1f} GiB for n={args.num_clients} x d={d}; dense_memory_limit_gb={limit:.1f}. "
            "Use fewer clients, a smaller model (or a PEFT adapter), or raise dense_memory_limit_gb."
        )


def check_epoch_rounds(args: ZOByzantineArguments, federation: Federation) -> None:
    """``max_steps <= 0`` (train for ``num_train_epochs``): the ledger of the rounds that makes, now that the rounds
    per epoch are known (the clients' data), must stay readable."""
    if args.max_steps > 0:
        return
    per_epoch = max(1, len(FederatedBatchSampler(federation)) // max(1, args.gradient_accumulation_steps))
    rounds = math.ceil(args.num_train_epochs * per_epoch)
    check_ledger_size(args, rounds, f"num_train_epochs={args.num_train_epochs} x {per_epoch} rounds per epoch = "
                                    f"{rounds}")


def build_federation(zo: ZOByzantineArguments, dataset) -> Federation:
    """Partition ``dataset`` over the clients (seeded by ``zo_seed``); a streaming dataset is refused."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError(
            f"train_dataset is a {type(dataset).__name__} without a length (streaming), which is not supported: the "
            "training examples are partitioned over the clients by index; use a map-style dataset (datasets: "
            "load_dataset(..., streaming=False); torch: a Dataset with __len__ and __getitem__)."
        )
    try:
        labels = None if zo.partition == "iid" else dataset_labels(dataset)
    except ValueError as err:
        raise ValueError(f"partition={zo.partition!r} splits the clients' data by class, but {err} Accepted for "
                         "such data: partition='iid'.") from None
    parts = partition_dataset(
        zo.partition, len(dataset), zo.num_clients, zo.zo_seed, labels, zo.dirichlet_alpha, zo.min_client_examples
    )
    if zo.root_examples:
        parts = with_root(parts, trusted_clients(zo.aggregator, zo.aggregator_kwargs), zo.root_examples, len(dataset),
                          zo.zo_seed)
    small = [(c, len(p)) for c, p in enumerate(parts) if len(p) < zo.per_device_train_batch_size]
    if small:
        logger.warning(
            "%d clients hold fewer examples than per_device_train_batch_size=%d (client: examples %s): their "
            "batches repeat examples within a round. Raise min_client_examples (the partition is re-drawn) or "
            "lower the batch to avoid it.", len(small), zo.per_device_train_batch_size,
            ", ".join(f"{c}: {k}" for c, k in small[:10]),
        )
    return Federation(parts, zo.per_device_train_batch_size, zo.num_byzantine, zo.zo_seed, zo.clients_per_round,
                      zo.byzantine_selection)


def check_label_flipping(attack: Attack, model, dataset) -> None:
    """``attack='lf'``: the number of classes must be known and cover the model's and the data's labels."""
    if not attack.flips_labels:
        return
    model_classes = model_num_labels(model)
    classes = attack.num_classes or model_classes
    if not classes:
        raise ValueError("attack='lf' needs the number of classes: set attack_kwargs={'num_classes': C}.")
    if model_classes and classes > model_classes:
        raise ValueError(f"attack_kwargs num_classes={classes} exceeds the model's {model_classes} labels: flipped "
                         f"labels C - 1 - y would not exist; accepted: 2 <= num_classes <= {model_classes}.")
    try:
        labels = None if dataset is None else dataset_labels(dataset)
    except ValueError as err:
        raise ValueError(f"attack='lf' flips class labels, but {err} Accepted: one class label per example.") from None
    if labels is not None and len(labels) and int(labels.max()) >= classes:
        raise ValueError(f"attack_kwargs num_classes={classes} but the training set has label {int(labels.max())};"
                         f" accepted: num_classes > every label.")

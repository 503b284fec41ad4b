"""Pre-flight checks of a run: the settings against the rule, the model and the data, before any work."""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING

from torch.utils.data import IterableDataset

from .attacks import Attack, model_num_labels
from .federation import FederatedBatchSampler, Federation, dataset_labels, partition_dataset
from .ledger import MAX_BYTES
from .validation import is_number

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


def memory_quarter_gb() -> float:
    """A quarter of this machine's memory, in GiB: the default cap of what the server may hold."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 4 / 2**30


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


# what a round holds in memory, per unit (Python objects): a seed tuple in the plan and the ledger with its coefficient;
# a client's scalar (float64) in its report, the gathered matrix, the attack's and the rule's copies; an example index
# of the round's batch (numpy, then a list of ints); a client's partition and data-stream bookkeeping
BYTES_PER_DIRECTION, BYTES_PER_SCALAR, BYTES_PER_INDEX, BYTES_PER_CLIENT = 200, 32, 64, 512
# a ledger's file per update direction, at least: "[s, t, l, r]" (s's digits + ~12) and its coefficient (~18)
FILE_BYTES_PER_DIRECTION = 30
STEP_SETTINGS = ("logging_steps", "eval_steps", "save_steps")
STAGED_HUB_STRATEGIES = ("checkpoint", "all_checkpoints")  # push_to_hub strategies that upload a checkpoint's folder


def round_directions(args: ZOByzantineArguments, clients: int) -> tuple[int, int]:
    """Seed tuples a round plans (every local step's and the compressed basis), and those its update applies."""
    nu, k = args.num_perturbations, args.local_steps
    per_client = clients if args.directions == "per_client" else 1
    applied = 0 if args.estimator == "first_order" or args.aggregation_space == "parameter" else \
        nu * (k if args.local_update == "unbiased" else 1) * per_client
    return nu * (k + 1) * per_client, applied


def check_bounds(args: ZOByzantineArguments) -> None:
    """Sizes, steps and the checkpoint to resume from, before any work: what a round holds must fit a quarter of the
    memory, the ledger of ``max_steps`` rounds must stay readable (:data:`ledger.MAX_BYTES`), the logging, evaluation
    and save intervals must be positive, and a checkpoint path must exist."""
    n, m, b = args.num_clients, args.clients_per_round or args.num_clients, args.per_device_train_batch_size
    planned, _ = round_directions(args, m)
    need = planned * BYTES_PER_DIRECTION + m * args.local_steps * args.num_perturbations * BYTES_PER_SCALAR + \
        m * b * BYTES_PER_INDEX + n * BYTES_PER_CLIENT
    limit = memory_quarter_gb()
    if need > limit * 2**30:
        raise ValueError(
            f"num_clients={n}, clients_per_round={args.clients_per_round}, num_perturbations={args.num_perturbations}, "
            f"local_steps={args.local_steps}, per_device_train_batch_size={b}: a round would hold about "
            f"{need / 2**30:.1f} GiB of seed tuples, client scalars and example indices, over a quarter of this "
            f"machine's memory ({limit:.1f} GiB); accepted: settings whose round fits (fewer directions x local steps "
            "x clients, or a smaller batch)."
        )
    if args.max_steps > 0:  # else the rounds follow from the data: check_epoch_rounds, once the clients are built
        check_ledger_size(args, args.max_steps, f"max_steps={args.max_steps}")
    if args.push_to_hub and str(args.hub_strategy) in STAGED_HUB_STRATEGIES and str(args.save_strategy) != "no":
        raise ValueError(f"push_to_hub with hub_strategy={str(args.hub_strategy)!r} uploads each checkpoint in the "
                         "background from the folder it is written in, which is a staging folder renamed right after "
                         "(checkpoints are written complete or not at all); accepted: hub_strategy='every_save' or "
                         "'end'.")
    for name in STEP_SETTINGS:
        value = getattr(args, name)
        if value is not None and (not is_number(value) or not 0 < value < math.inf):
            unset = "; leave it unset to evaluate every logging_steps" if name == "eval_steps" else ""
            raise ValueError(f"{name}={value!r} must be a finite number > 0 (an interval in rounds, or a fraction of "
                             f"the run below 1){unset}.")
    resume = args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() not in ("true", "last") and not os.path.isdir(resume):
        raise ValueError(f"resume_from_checkpoint={resume!r}: no such checkpoint folder; accepted: the path of a "
                         "checkpoint-N folder, or true / last (the newest complete checkpoint in output_dir).")


def check_ledger_size(args: ZOByzantineArguments, rounds: int, what: str) -> None:
    """The ledger of ``rounds`` rounds (``what``: the settings that make them) must stay readable
    (:data:`ledger.MAX_BYTES`)."""
    _, applied = round_directions(args, args.clients_per_round or args.num_clients)
    per_direction = len(str(args.seed if args.zo_seed is None else args.zo_seed)) + FILE_BYTES_PER_DIRECTION
    file_bytes = rounds * applied * per_direction
    if file_bytes > MAX_BYTES:
        raise ValueError(
            f"{what} rounds of {applied} directions (num_perturbations={args.num_perturbations}, "
            f"local_steps={args.local_steps}) make a ledger of about {file_bytes / 2**30:.1f} GiB, over the "
            f"{MAX_BYTES / 2**30:.0f} GiB a ledger may have to be read back (resume, replay); accepted: rounds x "
            f"directions per round up to about {MAX_BYTES // per_direction}."
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

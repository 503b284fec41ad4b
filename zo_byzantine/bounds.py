"""Sizes, seeds and intervals of a run bounded at the arguments, before any work: what a round holds against the
machine's memory, the ledger a run writes against what can be read back (:data:`ledger.MAX_BYTES`). ``args`` is a
:class:`~zo_byzantine.ZOByzantineArguments` (not imported: the arguments call these checks)."""

from __future__ import annotations

import math
import os

from .ledger import MAX_BYTES
from .validation import is_number


def memory_quarter_gb() -> float:
    """A quarter of this machine's memory, in GiB: the default cap of what the server may hold."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 4 / 2**30


# what a round holds in memory, per unit (Python objects): a seed tuple in the plan and the ledger with its coefficient;
# a client's scalar (float64) in its report, the gathered matrix, the attack's and the rule's copies; an example index
# of the round's batch (numpy, then a list of ints); a client's partition and data-stream bookkeeping
BYTES_PER_DIRECTION, BYTES_PER_SCALAR, BYTES_PER_INDEX, BYTES_PER_CLIENT = 200, 32, 64, 512
# a ledger's file per update direction, at least: "[s, t, l, r]" (s's digits + ~12) and its coefficient (~18)
FILE_BYTES_PER_DIRECTION = 30
STEP_SETTINGS = ("logging_steps", "eval_steps", "save_steps")
STAGED_HUB_STRATEGIES = ("checkpoint", "all_checkpoints")  # push_to_hub strategies that upload a checkpoint's folder


def round_directions(args, clients: int) -> tuple[int, int]:
    """Seed tuples a round plans (every local step's and the compressed basis), and those its update applies."""
    nu, k = args.num_perturbations, args.local_steps
    per_client = clients if args.directions == "per_client" else 1
    applied = 0 if args.estimator == "first_order" or args.aggregation_space == "parameter" else \
        nu * (k if args.local_update == "unbiased" else 1) * per_client
    return nu * (k + 1) * per_client, applied


def check_bounds(args) -> None:
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


def check_ledger_size(args, rounds: int, what: str) -> None:
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

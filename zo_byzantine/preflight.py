"""What the trainer builds and checks from its arguments before any work, and again for each hyperparameter-search
trial, so that a trial's settings get the constructor's validation and construction (the rule and the attack, the
clients' partition), not half of them: the launcher, the rounds' loss route (:mod:`loss_routes`), the callbacks.
Each refusal is one line naming the argument and what to use."""

from __future__ import annotations

import dataclasses
import logging
import os

from transformers import TrainingArguments

from . import callbacks
from .aggregators import build_aggregator
from .attacks import build_attack
from .checks import build_federation, check_epoch_rounds, check_label_flipping, check_processes_and_objects
from .loss_routes import LossFuncForward, probe_loss_route
from .losses import PerExampleForward
from .round_log import RoundLog
from .schedule import Schedule

logger = logging.getLogger(__name__)

TRIAL_WITH_OBJECT = {"aggregator": "rule", "aggregator_kwargs": "rule", "attack": "attack", "attack_kwargs": "attack"}


def check_launcher(args) -> None:
    """``accelerate launch --num_processes N`` (N > 1) on CPU without ``--multi_gpu`` or MPI runs accelerate's simple
    launcher, which starts the script once: it sets ``MASTER_ADDR`` for the N processes it was asked for but no
    ``WORLD_SIZE``. Refused, saying how to get N processes, when ``MASTER_ADDR`` is the launcher's own loopback
    default; only warned when it names another host (a job environment may export it for a one-process launch)."""
    env = os.environ
    if args.world_size == 1 and "ACCELERATE_MIXED_PRECISION" in env and "MASTER_ADDR" in env \
            and "WORLD_SIZE" not in env:
        message = (
            "accelerate launch --num_processes asked for several processes but started one (on CPU its simple "
            "launcher runs the script once: MASTER_ADDR is set, WORLD_SIZE is not): for N processes use "
            "`torchrun --nproc_per_node N SCRIPT ...` (gloo on CPU, each process a share of the clients); for one, "
            "drop --num_processes."
        )
        if env["MASTER_ADDR"] in ("127.0.0.1", "localhost"):
            raise ValueError(message)
        logger.warning("%s (MASTER_ADDR=%s came with the environment: one process it is.)", message,
                       env["MASTER_ADDR"])


def overrides_per_example_losses(trainer) -> bool:
    """Whether ``trainer``'s class replaces ``ZOByzantineTrainer.per_example_losses`` (by name: this module is below
    the trainer's)."""
    return type(trainer).per_example_losses.__qualname__ != "ZOByzantineTrainer.per_example_losses"


def set_up(trainer, aggregator=None, attack=None) -> None:
    """Build (or rebuild) everything the rounds take from ``trainer.args``; ``aggregator`` / ``attack``: the objects
    given to the constructor, used instead of the arguments' names."""
    zo = trainer.args
    check_processes_and_objects(zo, aggregator, attack)
    check_launcher(zo)
    trainer.rule_object, trainer.attack_object = aggregator, attack
    if not hasattr(trainer, "zo_seed_follows_seed"):
        trainer.zo_seed_follows_seed = zo.zo_seed == zo.seed
    trainer.aggregator = build_aggregator(aggregator or zo.aggregator, zo.pre_aggregators, **zo.aggregator_kwargs)
    zo.check_sizing(trainer.aggregator)  # also for a rule object passed here
    trainer.attack = build_attack(attack or zo.attack, **zo.attack_kwargs)
    # data-dependent checks now, before any evaluation or training: partition, labels, batch vs client data, loss
    dataset = trainer._partitioned = trainer.train_dataset
    trainer.federation = None if dataset is None else build_federation(zo, dataset)
    if trainer.federation is not None:
        check_epoch_rounds(zo, trainer.federation)  # max_steps <= 0: the ledger of num_train_epochs
    check_label_flipping(trainer.attack, trainer.model, dataset)
    func = trainer.compute_loss_func
    trainer.forward_per_example = PerExampleForward() if func is None else LossFuncForward(func)
    if dataset is not None and not overrides_per_example_losses(trainer):
        probe_loss_route(trainer)
    trainer.table = trainer.zo_optimizer = trainer.server = trainer.ledger = None
    trainer.schedule = Schedule(zo.zo_schedule, zo.zo_cache_budget_gb)
    trainer._checked_reach = False
    trainer.round_log = RoundLog()  # the logging window and train_loss (NaN, not 0, if no round computed one)
    callbacks.install(trainer)


def apply_trial(trainer, trial) -> None:
    """A hyperparameter-search trial's settings (already set on ``trainer.args`` by the Trainer): validated by the
    arguments' own ``__post_init__`` (a fresh copy is built), then :func:`set_up` again. ``zo_seed`` follows a trial's
    ``seed`` when it followed ``seed`` at construction. A trial may not set what a rule or attack object replaces."""
    if trial is None or trainer.hp_search_backend is None:
        return
    params = trial if isinstance(trial, dict) else dict(getattr(trial, "params", None) or {})
    for name, kind in TRIAL_WITH_OBJECT.items():
        given = trainer.rule_object if kind == "rule" else trainer.attack_object
        if name in params and given is not None:
            raise ValueError(f"hyperparameter search: the trial sets {name}={params[name]!r}, but an {kind} object "
                             f"was given to the trainer and is used instead; leave {name} out of the search space, or "
                             "pass the name in the arguments instead of the object.")
    zo = trainer.args
    if "seed" in params and "zo_seed" not in params and trainer.zo_seed_follows_seed:
        zo.zo_seed = zo.seed
    try:
        checked = dataclasses.replace(zo)  # every check the constructor makes, on the trial's settings
    except ValueError as err:
        raise ValueError(f"hyperparameter search trial {params}: {err}") from err
    for f in dataclasses.fields(zo):  # the protocol's fields as validated (JSON kwargs parsed)
        if f.init and f.name not in TrainingArguments.__dataclass_fields__:
            setattr(zo, f.name, getattr(checked, f.name))
    set_up(trainer, trainer.rule_object, trainer.attack_object)

"""The run's files around the Trainer's checkpoints: checkpoints written complete or not at all, the checkpoint a resume
starts from (checked before any work), the ledger a resumed run continues, the ledger of the best checkpoint, the
protocol settings the ledger records, and a model saved without ``save_pretrained``."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from contextlib import contextmanager

import safetensors.torch
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from transformers.utils import SAFE_WEIGHTS_NAME

from .context import recorded_settings
from .ledger import (
    LEDGER_NAME,
    Ledger,
    LedgerError,
    protocol_differences,
    refuse_differences,
    refuse_unchecked,
    remove_stale_temporaries,
    temporary_name,
)

logger = logging.getLogger(__name__)

# the settings that change what a round computes (besides the ledger's header: parameters, weight decay, server
# optimizer, direction generator); zo_schedule, zo_forward_batch_size, zo_group_by_length and zo_cache_budget_gb
# change how a round is evaluated (the same losses up to rounding), and the learning rate is recorded per round
PROTOCOL_SETTINGS = ("zo_seed", "estimator", "zo_eps", "num_perturbations", "local_steps", "local_update", "directions",
                     "aggregation_space", "num_clients", "num_byzantine", "byzantine_selection", "partition",
                     "min_client_examples", "per_device_train_batch_size", "zo_direction_batch_size")
COMPLETE = (TRAINER_STATE_NAME, LEDGER_NAME)  # written last by a save: a checkpoint without them is incomplete
_CHECKPOINT = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)")
_LEFTOVER = re.compile(rf"\.{PREFIX_CHECKPOINT_DIR}-(\d+)\.(staging|old)")  # a save killed before its rename
_MAX_LISTED = 1024  # a rule's or attack's list attribute longer than this is not a setting (it is state)


def save_plain_model(model, output_dir: str, processing_class=None) -> None:
    """A model that is not a ``PreTrainedModel`` (e.g. a wrapper around one with tied weights), saved with
    ``safetensors.torch.save_model``, which stores shared tensors once (``save_file`` refuses them)."""
    os.makedirs(output_dir, exist_ok=True)
    safetensors.torch.save_model(model, os.path.join(output_dir, SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
    if processing_class is not None:
        processing_class.save_pretrained(output_dir)


def missing_untied(model, missing_keys: list[str]) -> list[str]:
    """The keys truly missing from a checkpoint of ``model``: a key absent only because its tensor is shared with a
    key that was loaded (tied weights, stored once by :func:`save_plain_model`) was loaded through that key."""
    missing = set(missing_keys)
    by_storage: dict[tuple, set[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.device.type == "meta" or tensor.numel() == 0:  # no storage to share (data_ptr 0 for all)
            continue
        by_storage.setdefault((tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
                               tuple(tensor.shape)), set()).add(name)
    loaded_through = {name for names in by_storage.values() if names - missing for name in names}
    return [key for key in missing_keys if key not in loaded_through]


# ----- the protocol settings ------------------------------------------------------------------------


def _setting(value):
    """``value`` as a ledger value: JSON scalars (a non-finite float by its name) and short lists of them; anything
    else (tensors, objects, long lists) is not a setting: ``...``."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple) and len(value) <= _MAX_LISTED:
        items = [_setting(v) for v in value]
        return ... if ... in items or any(isinstance(v, list) for v in items) else items
    return ...


def _parameters(obj) -> dict:
    """The recorded settings of a rule, pre-aggregation step or attack (``context.recorded_settings``), as JSON."""
    found = {name: _setting(value) for name, value in recorded_settings(obj).items()}
    return {name: value for name, value in found.items() if value is not ...}


def run_protocol(trainer) -> dict:
    """What the ledger records as a trainer's protocol: every setting that changes what a round computes, as in
    effect (``clients_per_round``: ``m``; ``max_byzantine_per_round``: ``f``; ``dirichlet_alpha`` only for the
    Dirichlet partition; ``root_examples`` only where set), the pipeline and the attack with their parameters, and
    the training set's size."""
    return protocol_of(trainer.args, trainer.aggregator, trainer.attack, trainer.train_dataset)


def protocol_of(args, aggregator, attack, dataset) -> dict:
    """:func:`run_protocol` from its parts (the Flower coordinator's: no simulated attack, ``attack=None``)."""
    protocol = {name: getattr(args, name) for name in PROTOCOL_SETTINGS}
    protocol.update(
        clients_per_round=args.clients_per_round or args.num_clients,
        max_byzantine_per_round=args.byzantine_bound(),
        dirichlet_alpha=args.dirichlet_alpha if args.partition == "dirichlet" else None,
        root_examples=args.root_examples or None,  # the trusted clients' data (fltrust); none: null
        aggregator=[[step.name, _parameters(step)] for step in [*aggregator.steps, aggregator.rule]],
        attack=None if attack is None else [type(attack).__name__, _parameters(attack)],
        train_examples=len(dataset) if hasattr(dataset, "__len__") else None,
    )
    return json.loads(json.dumps(protocol, allow_nan=False))  # as the ledger reads it back (lists, not tuples)


# ----- checkpoints complete or absent ---------------------------------------------------------------


@contextmanager
def staged_checkpoint(trainer, trial):
    """Around ``Trainer._save_checkpoint``: the checkpoint is written into ``.checkpoint-N.staging/checkpoint-N``
    (model, ledger, optimizer, RNG and trainer state), then renamed into place once every process has written its
    part, so that ``checkpoint-N`` is complete or absent whenever the run is killed (the Trainer writes in place).
    The Trainer's output folder for the save is the staging one (``_get_output_dir``, for this call only); the best
    checkpoint's path and the rotation of old checkpoints are then set and done on the real folder."""
    run_dir = trainer._get_output_dir(trial=trial)
    name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    final, root = os.path.join(run_dir, name), os.path.join(run_dir, f".{name}.staging")
    main = trainer.args.should_save
    # each node's local process zero publishes and cleans its node's staging folder, after the main process (on a
    # shared filesystem the main process's publish leaves nothing to the others; on a node with its own disk, its
    # processes' files, e.g. rng_state_<i>.pth, are published there): phases separated by barriers, never racing
    node = not main and trainer.args.local_process_index == 0
    for turn in (main, node):
        if turn:
            shutil.rmtree(root, ignore_errors=True)
        trainer.accelerator.wait_for_everyone()
    trainer._get_output_dir = lambda trial=None: root
    try:
        yield
    finally:
        del trainer._get_output_dir  # the class's method again
    trainer.accelerator.wait_for_everyone()
    state, staged = trainer.state, os.path.join(root, name)
    if state.best_model_checkpoint and os.path.dirname(os.path.abspath(state.best_model_checkpoint)) == \
            os.path.abspath(root):
        state.best_model_checkpoint = final
        if main:
            state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
    for turn in (main, node):
        if turn and os.path.isdir(root):
            if os.path.isdir(staged):
                _publish(staged, final)
            os.rmdir(root)
            rotate_checkpoints(run_dir, trainer.args.save_total_limit, state.best_model_checkpoint, use_mtime=True)
        trainer.accelerator.wait_for_everyone()


def _publish(staged: str, final: str) -> None:
    """Rename ``staged`` to ``final``; a ``final`` of the same step written before (a run started over in its output
    folder) is moved aside first, then removed."""
    if not os.path.isdir(final):
        os.replace(staged, final)
        return
    old = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(final, old)
    os.replace(staged, final)
    shutil.rmtree(old, ignore_errors=True)


def _complete(folder: str) -> bool:
    return all(os.path.isfile(os.path.join(folder, name)) for name in COMPLETE)


def _recover(output_dir: str) -> None:
    """A save killed between ``_publish``'s two renames left ``checkpoint-N`` moved aside (``.checkpoint-N.old``) and
    its complete new copy staged (``.checkpoint-N.staging/checkpoint-N``): the staged copy is published (the old one
    put back when the staged one is not complete), so that cleaning the leftovers does not lose checkpoint-N."""
    for name in sorted(os.listdir(output_dir)):
        match = _LEFTOVER.fullmatch(name)
        if match is None or match.group(2) != "old":
            continue
        checkpoint = f"{PREFIX_CHECKPOINT_DIR}-{match.group(1)}"
        final = os.path.join(output_dir, checkpoint)
        if os.path.isdir(final):
            continue
        staged = os.path.join(output_dir, f".{checkpoint}.staging", checkpoint)
        source = staged if _complete(staged) else os.path.join(output_dir, name)
        if _complete(source):
            os.replace(source, final)
            logger.warning("A save killed between its renames left %s aside: restored it from %s.", checkpoint,
                           os.path.relpath(source, output_dir))


def remove_leftovers(output_dir: str) -> list[str]:
    """Remove what killed saves left in ``output_dir``: staging folders, checkpoints moved aside, ledger temporaries
    (a checkpoint a save had moved aside and not yet replaced is first put back: :func:`_recover`). Returns the names
    removed."""
    _recover(output_dir)
    removed = [name for name in os.listdir(output_dir) if _LEFTOVER.fullmatch(name)]
    for name in removed:
        shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
    removed += remove_stale_temporaries(output_dir)
    if removed:
        logger.info("Removed what interrupted saves left in %s: %s.", output_dir, ", ".join(sorted(removed)))
    return removed


def latest_checkpoint(output_dir: str) -> tuple[str | None, list[str]]:
    """The newest complete checkpoint of ``output_dir`` (holding ``trainer_state.json`` and ``zo_ledger.json``), or
    None, and the newer incomplete ones it passed over (``"checkpoint-N (missing ...)"``)."""
    steps = []
    if os.path.isdir(output_dir):
        steps = sorted((int(m.group(1)), name) for name in os.listdir(output_dir)
                       if (m := _CHECKPOINT.fullmatch(name)) and os.path.isdir(os.path.join(output_dir, name)))
    skipped = []
    for _, name in reversed(steps):
        missing = [f for f in COMPLETE if not os.path.isfile(os.path.join(output_dir, name, f))]
        if not missing:
            return os.path.join(output_dir, name), skipped
        skipped.append(f"{name} (missing {', '.join(missing)})")
    return None, skipped


def prepare_resume(trainer, resume_from_checkpoint):
    """``train(resume_from_checkpoint=...)``, checked before any work (model loading, the start evaluation): what
    killed saves left is removed; ``True`` becomes the newest complete checkpoint (naming the incomplete ones
    skipped); the checkpoint must exist, have rounds left before ``max_steps`` and hold a ledger whose protocol
    settings are this run's. Returns the checkpoint's path, or None for a fresh start."""
    args = trainer.args
    if args.should_save and os.path.isdir(args.output_dir):
        remove_leftovers(args.output_dir)
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    checkpoint = resume_from_checkpoint
    if checkpoint is True:
        checkpoint, skipped = latest_checkpoint(args.output_dir)
        if checkpoint is None:
            raise ValueError(f"resume_from_checkpoint=True: no complete checkpoint in output_dir={args.output_dir!r}"
                             f"{' (incomplete: ' + '; '.join(skipped) + ')' if skipped else ''}; accepted: a folder "
                             "checkpoint-N holding trainer_state.json and zo_ledger.json, or a fresh start (None).")
        if skipped:
            logger.warning("resume_from_checkpoint=True: skipped incomplete %s; resuming from %s.", "; ".join(skipped),
                           checkpoint)
    if not isinstance(checkpoint, str | os.PathLike) or not os.path.isdir(checkpoint):
        raise ValueError(f"resume_from_checkpoint={resume_from_checkpoint!r}: no such checkpoint folder; accepted: "
                         "the path of a checkpoint-N folder, True (the newest complete one in output_dir) or None.")
    checkpoint = os.fspath(checkpoint)
    refuse_finished_checkpoint(checkpoint, args.max_steps, trainer)
    _require_ledger(checkpoint)
    source = f"checkpoint {checkpoint!r}'s ledger"
    data, protocol = Ledger.read(checkpoint), run_protocol(trainer)
    refuse_differences(protocol_differences(data.get("protocol"), protocol), source)
    refuse_unchecked(data, "protocol", protocol, source)
    return checkpoint


# ----- the resumed and the best ledger --------------------------------------------------------------


def _require_ledger(checkpoint: str) -> None:
    if not os.path.isfile(os.path.join(checkpoint, LEDGER_NAME)):
        raise LedgerError(
            f"Checkpoint {checkpoint!r} has no {LEDGER_NAME}: resuming would write a ledger that cannot replay "
            "the run. Restore the file from the run's output directory (or start a new run)."
        )


def resume_ledger(trainer, checkpoint: str) -> list[float]:
    """Continue the trainer's ledger from ``checkpoint``'s (the run's start fingerprint and rounds ``0 .. t-1``), once
    the checkpoint's weights and trainer state are loaded; returns the losses of the rounds done. A checkpoint without
    a ledger, whose ledger has other settings, was saved with other weights than the checkpoint's or disagrees with
    its trainer state on the round, is refused: the final ledger could not replay the run. A stateful rule's state
    (``history.py``) is rebuilt from the ledger's records: the checkpoint keeps it in its ledger."""
    _require_ledger(checkpoint)
    ledger, step = trainer.ledger, trainer.state.global_step
    ledger.continue_from(Ledger.read(checkpoint), weights=trainer.table, source=f"checkpoint {checkpoint!r}'s ledger")
    if len(ledger.rounds) != step:
        raise LedgerError(f"Checkpoint {checkpoint!r}: its ledger holds {len(ledger.rounds)} rounds, its trainer state "
                          f"{step}: the ledger belongs to another checkpoint.")
    trainer.server.restore_history(ledger.rounds)  # a stateful rule's per-client state, rebuilt from the ledger
    return [r["loss"] for r in ledger.rounds if r.get("loss") is not None]


def continue_from_best(ledger: Ledger, best_checkpoint: str | None) -> None:
    """After ``load_best_model_at_end``: the loaded weights' ledger (the best checkpoint's), not the last round's."""
    if best_checkpoint and os.path.isfile(os.path.join(best_checkpoint, LEDGER_NAME)):
        ledger.continue_from(Ledger.read(best_checkpoint))


def refuse_finished_checkpoint(checkpoint: str, max_steps: int, trainer=None) -> None:
    """A checkpoint already at ``max_steps`` leaves nothing to train, but the Trainer's loop would still run one more
    round before it checks (a re-run of a finished job would add a round each time): refused instead. With
    ``trainer``, a run killed inside its final ledger write is completed first: when the checkpoint is its output
    folder's newest, the output folder's ledger is restored (:func:`restore_output_ledger`) and the refusal says so."""
    if max_steps <= 0:
        return
    state = _trainer_state(checkpoint)
    step = state.get("global_step")
    if isinstance(step, int) and step >= max_steps:
        restored = "" if trainer is None else restore_output_ledger(trainer, checkpoint, state)
        raise ValueError(f"resume_from_checkpoint={checkpoint!r}: the checkpoint is at round {step}, "
                         f"max_steps={max_steps}; nothing is left to train{restored} (accepted: a checkpoint before "
                         "round max_steps, or a larger max_steps to continue the run).")


def _trainer_state(checkpoint: str) -> dict:
    try:
        with open(os.path.join(checkpoint, TRAINER_STATE_NAME)) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return {}  # the Trainer's own loading reports what is wrong with it
    return state if isinstance(state, dict) else {}


def restore_output_ledger(trainer, checkpoint: str, state: dict) -> str:
    """A finished run killed inside its final ``ledger.save(output_dir)`` has no (or a half-replaced) output ledger:
    when ``checkpoint`` is the output folder's newest complete one, the ledger the run ended with (the checkpoint's,
    or with ``load_best_model_at_end`` the best checkpoint's) is written there again, unless it is already there.
    Returns what was done, for the refusal's message ("" when nothing)."""
    args = trainer.args
    output_dir = args.output_dir
    newest, _ = latest_checkpoint(output_dir)
    if not args.should_save or newest is None or os.path.abspath(newest) != os.path.abspath(checkpoint):
        return ""
    best = state.get("best_model_checkpoint")
    source = checkpoint
    if args.load_best_model_at_end and isinstance(best, str) and os.path.isfile(os.path.join(best, LEDGER_NAME)):
        source = best
    try:
        ended = Ledger.read(source)
    except LedgerError:
        return ""  # resuming reports it
    try:
        if Ledger.read(output_dir)["digest"] == ended["digest"]:
            return ""
        found = "another ledger"
    except LedgerError:
        found = "no readable ledger"
    _write_atomically(os.path.join(output_dir, LEDGER_NAME), os.path.join(source, LEDGER_NAME))
    logger.warning("output_dir=%r held %s (the run was interrupted while writing its final ledger): restored its %s "
                   "from %s.", output_dir, found, LEDGER_NAME, source)
    return f"; output_dir held {found}: its {LEDGER_NAME} was restored from {source!r}, the ledger the run ended with"


def _write_atomically(path: str, source: str) -> None:
    tmp = os.path.join(os.path.dirname(path), temporary_name())
    try:
        shutil.copyfile(source, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)

"""The run's files around the Trainer's checkpoints: a model saved without ``save_pretrained``, the ledger a resumed
run continues, the ledger of the best checkpoint, and a finished checkpoint refused before any work."""

from __future__ import annotations

import json
import os

import safetensors.torch
from transformers.trainer_utils import get_last_checkpoint
from transformers.utils import SAFE_WEIGHTS_NAME

from .ledger import LEDGER_NAME, Ledger, LedgerError


def save_plain_model(model, output_dir: str, processing_class=None) -> None:
    """A model that is not a ``PreTrainedModel`` (e.g. a wrapper around one with tied weights), saved with
    ``safetensors.torch.save_model``, which stores shared tensors once (``save_file`` refuses them)."""
    os.makedirs(output_dir, exist_ok=True)
    safetensors.torch.save_model(model, os.path.join(output_dir, SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
    if processing_class is not None:
        processing_class.save_pretrained(output_dir)


def resume_ledger(ledger: Ledger, checkpoint: str, global_step: int) -> list[float]:
    """Continue ``ledger`` from ``checkpoint``'s (the run's start fingerprint and rounds ``0 .. t-1``); returns the
    losses of the rounds done. A checkpoint without a ledger, or whose ledger and trainer state disagree on the
    round, is refused: the final ledger could not replay the run."""
    if not os.path.isfile(os.path.join(checkpoint, LEDGER_NAME)):
        raise LedgerError(
            f"Checkpoint {checkpoint!r} has no {LEDGER_NAME}: resuming would write a ledger that cannot replay "
            "the run. Restore the file from the run's output directory (or start a new run)."
        )
    ledger.continue_from(Ledger.read(checkpoint))
    if len(ledger.rounds) != global_step:
        raise LedgerError(
            f"Checkpoint {checkpoint!r}: its ledger holds {len(ledger.rounds)} rounds, its trainer state "
            f"{global_step}."
        )
    return [r["loss"] for r in ledger.rounds if r.get("loss") is not None]


def continue_from_best(ledger: Ledger, best_checkpoint: str | None) -> None:
    """After ``load_best_model_at_end``: the loaded weights' ledger (the best checkpoint's), not the last round's."""
    if best_checkpoint and os.path.isfile(os.path.join(best_checkpoint, LEDGER_NAME)):
        ledger.continue_from(Ledger.read(best_checkpoint))


def refuse_finished_checkpoint(resume_from_checkpoint, output_dir: str, max_steps: int) -> None:
    """A checkpoint already at ``max_steps`` leaves nothing to train, but the Trainer's loop would still run one more
    round before it checks (a re-run of a finished job would add a round each time): refused instead."""
    checkpoint = resume_from_checkpoint
    if checkpoint is True and os.path.isdir(output_dir):  # the Trainer's "the last one"
        checkpoint = get_last_checkpoint(output_dir)
    if not isinstance(checkpoint, str) or max_steps <= 0:
        return
    try:
        with open(os.path.join(checkpoint, "trainer_state.json")) as f:
            step = json.load(f)["global_step"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # the Trainer's own loading reports what is wrong with it
    if isinstance(step, int) and step >= max_steps:
        raise ValueError(f"resume_from_checkpoint={resume_from_checkpoint!r}: the checkpoint is at round {step}, "
                         f"max_steps={max_steps}; nothing is left to train (accepted: a checkpoint before round "
                         "max_steps, or a larger max_steps to continue the run).")

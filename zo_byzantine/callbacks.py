"""The trainer's ``TrainerCallback``s: the progress bar counts rounds beside the honest loss, and the run's
``trainer_state.json`` is written at the end of ``train()`` (beside the ledger), so that ``python -m zo_byzantine
inspect|plot`` read a plain Trainer script's output directory whole, ``save_state()`` called or not."""

from __future__ import annotations

import os

from transformers.trainer_callback import ProgressCallback, TrainerCallback

TRAINER_STATE_NAME = "trainer_state.json"  # the Trainer's (transformers.trainer.TRAINER_STATE_NAME)


class HonestLossProgress(ProgressCallback):
    """The Trainer's progress bar, its steps named rounds, with the honest clients' mean loss of the last log."""

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if self.training_bar is not None:
            self.training_bar.set_description("rounds", refresh=False)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.training_bar is not None and logs and "loss" in logs:
            self.training_bar.set_postfix(honest_loss=f"{logs['loss']:.4f}", refresh=False)
        super().on_log(args, state, control, logs=logs, **kwargs)


class SaveStateAtEnd(TrainerCallback):
    """``trainer_state.json`` (the log history) written to ``output_dir`` when training ends."""

    def on_train_end(self, args, state, control, **kwargs):
        if args.should_save:
            os.makedirs(args.output_dir, exist_ok=True)
            state.save_to_json(os.path.join(args.output_dir, TRAINER_STATE_NAME))


def install(trainer) -> None:
    """The Trainer's plain progress bar swapped for :class:`HonestLossProgress` (a notebook's or a user's bar is
    kept), and :class:`SaveStateAtEnd` added (once)."""
    handler = trainer.callback_handler
    plain = [callback for callback in handler.callbacks if type(callback) is ProgressCallback]
    if plain:
        handler.remove_callback(plain[0])
        handler.add_callback(HonestLossProgress())
    if not any(isinstance(callback, SaveStateAtEnd) for callback in handler.callbacks):
        handler.add_callback(SaveStateAtEnd())

"""One leg of the kill-during-save run (``test_kill_during_save.py``), in its own process: train (or resume from the
newest complete checkpoint) and, when armed, die by SIGKILL at a chosen moment.

    python kill_worker.py OUTPUT_DIR MOMENT COUNT

MOMENT: ``none``; ``ledger_write`` (the COUNT-th ledger write, halfway through its temporary file);
``ledger_rename`` (the COUNT-th ledger write, its temporary file written, before the rename); ``state`` (the COUNT-th
trainer state, half written); ``timer`` (COUNT microseconds after the first round ends: the rounds and saves
that follow take ~35 ms on a CPU, half of it saving)."""

import os
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from helpers import LogisticRegression, VectorDataset, make_trainer  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

SETTINGS = dict(num_clients=4, max_steps=6, learning_rate=0.1, num_perturbations=2, lr_scheduler_type="linear",
                weight_decay=0.01, save_strategy="steps", save_steps=1)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class DyingFile:
    """A ledger's temporary file that kills the process halfway through the write, or once written and closed."""

    def __init__(self, file, moment: str):
        self.file, self.moment = file, moment

    def __enter__(self):
        return self

    def write(self, text: str) -> None:
        if self.moment == "ledger_write":
            self.file.write(text[: len(text) // 2])
            self.file.flush()
            die()
        self.file.write(text)

    def __exit__(self, *exc) -> None:
        self.file.close()
        die()


class KillAfterFirstRound(TrainerCallback):
    def __init__(self, delay: float):
        self.delay = delay

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            threading.Timer(self.delay, die).start()


def arm(moment: str, count: int) -> None:
    from transformers.trainer_callback import TrainerState

    import zo_byzantine.ledger as ledger

    calls = []
    if moment in ("ledger_write", "ledger_rename"):
        def dying_open(path, mode="r", *args, **kwargs):
            file = open(path, mode, *args, **kwargs)
            if "w" not in mode:  # reads (Ledger.read) are not counted
                return file
            calls.append(path)
            return DyingFile(file, moment) if len(calls) == count else file

        ledger.open = dying_open  # the module's name for open: its writes only
    elif moment == "state":
        real = TrainerState.save_to_json

        def dying_save(self, path):
            calls.append(path)
            if len(calls) == count:
                with open(path, "w") as f:
                    f.write('{"global_step": ')
                    f.flush()
                    die()
            real(self, path)

        TrainerState.save_to_json = dying_save


def main(output_dir: str, moment: str, count: int) -> None:
    arm(moment, count)
    saved = os.path.isdir(output_dir) and any(name.startswith("checkpoint-") for name in os.listdir(output_dir))
    torch.manual_seed(0)
    trainer = make_trainer(LogisticRegression(), VectorDataset(128), output_dir, **SETTINGS)
    if moment == "timer":
        trainer.add_callback(KillAfterFirstRound(count / 1e6))
    try:
        trainer.train(resume_from_checkpoint=True if saved else None)
    except ValueError as err:  # the newest checkpoint is the last round: what the kill left is cleaned, and the
        if "nothing is left to train" not in str(err):  # output folder's ledger restored if the kill was in its write
            raise
    os._exit(0)  # before a timer fires


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))

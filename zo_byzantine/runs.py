"""Reading a finished (or checkpointed) run: what ``python -m zo_byzantine inspect|replay|plot RUN_DIR`` does.

A run directory holds ``zo_ledger.json`` (written by the trainer at ``save_model`` and at the end of ``train``)
and, when the caller ran ``trainer.save_state()`` (or in a checkpoint), ``trainer_state.json`` with the
Trainer's ``log_history``. Everything here reads the ledger through :meth:`Ledger.read` (size, schema, digest,
and with a key the HMAC): a ledger that fails any check raises :class:`~zo_byzantine.ledger.LedgerError`.
``trainer_state.json`` is optional; what comes from it is marked as such, and its absence is said, not guessed.

The functions return data or text (:func:`load_run`, :func:`summarize`, :func:`format_summary`,
:func:`format_rounds`, :func:`plot_figure`, :func:`replay_run`); ``__main__`` is only the command line.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import sys
import textwrap
from dataclasses import dataclass, field

import torch
from torch import nn

from .ledger import LEDGER_NAME, MAX_BYTES, Ledger, LedgerError, replay
from .perturbation import ParameterTable
from .server import BYTES_PER_SCALAR
from .validation import is_number

TRAINER_STATE = "trainer_state.json"
RESULTS = "all_results.json"  # trainer.save_metrics(...)'s summary: the main job's start_accuracy is there
START = (f"no start_accuracy in {RESULTS} nor an eval_accuracy at step 0 in the log history: eval_on_start=True, or "
         "trainer.save_metrics('eval', {'start_accuracy': ...}) after evaluate(metric_key_prefix='start'), records it")
STATE_MAX_BYTES = 1 << 28  # 256 MiB: a trainer_state.json larger than this is not read
FEW = 3  # rounds shown at each end of the participants' summary
IDS_SHOWN = 8  # client ids shown per round before "..."


@dataclass
class Run:
    """A run directory, read: the checked ledger, and the Trainer's log history when there is one."""

    directory: str
    ledger_path: str
    ledger: dict
    ledger_bytes: int
    hmac_checked: bool
    state_path: str | None = None  # trainer_state.json, when it was found and read
    log_history: list[dict] = field(default_factory=list)
    state_note: str = ""  # why there is no log history, when there is none
    results: dict = field(default_factory=dict)  # all_results.json, when there is one

    @property
    def rounds(self) -> list[dict]:
        return self.ledger["rounds"]


def _read_json(path: str) -> dict:
    """A JSON object from ``path`` (at most :data:`STATE_MAX_BYTES`)."""
    if os.path.getsize(path) > STATE_MAX_BYTES:
        raise ValueError(f"larger than {STATE_MAX_BYTES} bytes")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def load_run(path: str | os.PathLike, key: bytes | None = None, max_bytes: int = MAX_BYTES) -> Run:
    """Read the run in ``path`` (a directory holding ``zo_ledger.json``, or the ledger file itself): the ledger,
    checked (with ``key``, its HMAC too: a file without one is refused), and ``trainer_state.json`` beside it
    when there is one. Raises :class:`LedgerError` when the ledger is missing or fails a check."""
    path = os.fspath(path)
    if os.path.isdir(path):
        directory, ledger_path = path, os.path.join(path, LEDGER_NAME)
    else:
        directory, ledger_path = os.path.dirname(path) or ".", path
    if not os.path.isfile(ledger_path):
        raise LedgerError(f"No ledger at {ledger_path!r}: RUN_DIR must be a run's output directory (or a checkpoint) "
                          f"holding {LEDGER_NAME}, or the ledger file itself.")
    ledger = Ledger.read(ledger_path, key=key, max_bytes=max_bytes)
    run = Run(directory, ledger_path, ledger, os.path.getsize(ledger_path), key is not None)
    try:
        run.results = _read_json(os.path.join(directory, RESULTS))
    except (OSError, ValueError, RecursionError):
        pass  # optional: a missing or unreadable summary only loses the start accuracy
    state_path = os.path.join(directory, TRAINER_STATE)
    if not os.path.isfile(state_path):  # a run made before the trainer wrote it at the end of train(): a checkpoint's
        from transformers.trainer_utils import get_last_checkpoint

        last = get_last_checkpoint(directory) if os.path.isdir(directory) else None
        state_path = os.path.join(last, TRAINER_STATE) if last else state_path
    if not os.path.isfile(state_path):
        run.state_note = (f"no {TRAINER_STATE} in {directory} nor in a checkpoint of it (the trainer writes it at the "
                          "end of train(), and trainer.save_state() after a final evaluation)")
        return run
    try:
        history = _read_json(state_path).get("log_history")
        if not isinstance(history, list):
            raise ValueError("it has no log_history list")
    except (OSError, ValueError, RecursionError) as err:
        run.state_note = f"{TRAINER_STATE} could not be read: {err}"
        return run
    run.state_path = state_path
    run.log_history = [entry for entry in history if isinstance(entry, dict)]
    return run


# ----- series --------------------------------------------------------------------------------------


def _number(value) -> float | None:
    if is_number(value) and math.isfinite(value):
        return float(value)
    return None


def loss_series(run: Run) -> tuple[list[int], list[float]] | None:
    """``(rounds, losses)`` of the rounds whose honest loss was computed; None when the ledger records no loss
    (written before the field existed)."""
    if not any("loss" in entry for entry in run.rounds):
        return None
    pairs = [(entry["round"], entry["loss"]) for entry in run.rounds if entry.get("loss") is not None]
    return [t for t, _ in pairs], [loss for _, loss in pairs]


def log_series(run: Run, name: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of ``name`` in the log history (finite numbers with an int ``step`` only)."""
    steps, values = [], []
    for entry in run.log_history:
        value, step = _number(entry.get(name)), entry.get("step")
        if value is not None and isinstance(step, int) and not isinstance(step, bool):
            steps.append(step)
            values.append(value)
    return steps, values


def start_accuracy(run: Run) -> tuple[int, float] | None:
    """``(0, accuracy)`` of the evaluation before training: an ``eval_accuracy`` logged at step 0 (``eval_on_start``),
    else ``start_accuracy`` in ``all_results.json`` (``evaluate(metric_key_prefix="start")`` before ``train()``,
    saved with ``save_metrics``, as the main job does: ``train()`` starts a log history without it); None when
    there is none."""
    steps, values = log_series(run, "eval_accuracy")
    if steps and steps[0] == 0:
        return 0, values[0]
    value = _number(run.results.get("start_accuracy"))
    return None if value is None else (0, value)


def bytes_per_client(run: Run) -> tuple[float, float] | None:
    """Uplink bytes per participating client per round, and dense FedAvg's, from the last log that has them."""
    for entry in reversed(run.log_history):
        ours, dense = _number(entry.get("uplink_bytes_per_client")), _number(entry.get("fedavg_bytes_per_client"))
        if ours is not None and dense is not None:
            return ours, dense
    return None


def _missing(run: Run, name: str) -> str:
    """Why a log-history series is not available."""
    if run.state_path is None:
        return run.state_note
    return f"no {name} in {TRAINER_STATE}'s log_history"


def numel(ledger: dict) -> int:
    return sum(math.prod(shape) for _, shape in ledger["parameters"])


# ----- inspect -------------------------------------------------------------------------------------


def summarize(run: Run) -> dict:
    """The numbers ``inspect`` prints, as data."""
    rounds = run.rounds
    skipped = [entry for entry in rounds if entry.get("skipped")]
    reasons: dict[str, list[int]] = {}
    for entry in skipped:
        reasons.setdefault(entry["skipped"], []).append(entry["round"])
    recorded = [entry for entry in rounds if "participants" in entry]
    counts = [len(entry["participants"]) for entry in recorded]
    losses = loss_series(run)
    rates = [entry["lr"] for entry in rounds if entry["lr"] is not None]
    directions = [len(entry["seeds"]) for entry in rounds if not entry.get("skipped") and not entry.get("dense")]
    out = {
        "run": run.directory,
        "ledger": run.ledger_path,
        "ledger_bytes": run.ledger_bytes,
        "version": run.ledger["version"],
        "hmac": ("checked" if run.hmac_checked else "present") if "hmac" in run.ledger else None,
        "digest": run.ledger["digest"],
        "fingerprint": run.ledger.get("fingerprint"),
        "tensors": len(run.ledger["parameters"]),
        "parameters": numel(run.ledger),
        "weight_decay": run.ledger["weight_decay"],
        "server": run.ledger["server"],
        "rounds": len(rounds),
        "dense": sum(1 for entry in rounds if entry.get("dense")),
        "skipped": len(skipped),
        "skipped_reasons": reasons,
        "participants_recorded": len(recorded),
        "participants": {entry["round"]: entry["participants"] for entry in recorded[:FEW] + recorded[-FEW:]},
        "participants_elided": max(len(recorded) - 2 * FEW, 0),  # rounds between the first and last few
        "participants_min": min(counts, default=None),
        "participants_max": max(counts, default=None),
        "directions_min": min(directions, default=None),
        "directions_max": max(directions, default=None),
        "lr_min": min(rates, default=None),
        "lr_max": max(rates, default=None),
        "loss": None,
        "eval_accuracy": None,
        "bytes": None,
        "trainer_state": run.state_path,
        "trainer_state_note": run.state_note,
    }
    if losses is not None:
        steps, values = losses
        low = min(range(len(values)), key=values.__getitem__, default=None)
        out["loss"] = {
            "not_computed": len(rounds) - len(values),
            "start": (steps[0], values[0]) if values else None,
            "end": (steps[-1], values[-1]) if values else None,
            "min": (steps[low], values[low]) if values else None,
        }
    start, (steps, values) = start_accuracy(run), log_series(run, "eval_accuracy")
    if values or start:
        evals = list(zip(steps, values, strict=True))
        if start and evals[:1] == [start]:  # a step-0 eval_accuracy is the start
            evals = evals[1:]
        pairs = [start, *evals] if start else evals
        out["eval_accuracy"] = {"start": start, "first": pairs[0], "best": max(pairs, key=lambda pair: pair[1]),
                                "last": pairs[-1], "evaluations": len(pairs)}
    figures = bytes_per_client(run)
    if figures is not None:
        ours, dense = figures
        out["bytes"] = {"uplink_per_round": ours, "fedavg_per_round": dense, "uplink_total": ours * len(rounds),
                        "fedavg_total": dense * len(rounds)}
    return out


def _g(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _ids(ids: list[int]) -> str:
    shown = ", ".join(map(str, ids[:IDS_SHOWN]))
    return f"[{shown}{', ...' if len(ids) > IDS_SHOWN else ''}]"


def _list_rounds(rounds: list[int], limit: int = 10) -> str:
    text = ", ".join(map(str, rounds[:limit]))
    return text + (f", ... ({len(rounds)} rounds)" if len(rounds) > limit else "")


def _at(pair, unit: str = "round") -> str:
    return f"{_g(pair[1])} ({unit} {pair[0]})"


def format_summary(summary: dict) -> str:
    """The ``inspect`` table: one ``field  value`` row per line (continuation lines indented)."""
    s = summary
    rows: list[tuple[str, str]] = [
        ("run", s["run"]),
        ("ledger", f"{s['ledger']} (format version {s['version']}, {s['ledger_bytes']} bytes)"),
        ("digest", f"checked (SHA-256 of the whole content): {s['digest']}"),
        ("hmac", {None: "none (the file is not authenticated)", "present": "present, not checked (give --key)",
                  "checked": "checked with the key"}[s["hmac"]]),
        ("fingerprint", s["fingerprint"] or "none recorded (the starting weights cannot be checked)"),
        ("parameters", f"{s['parameters']} trainable values in {s['tensors']} tensors; weight decay "
                       + (", ".join(f"{name} {_g(wd)}" for name, wd in s["weight_decay"].items()) or "none")),
        ("server", ", ".join(f"{name} {_g(value)}" for name, value in s["server"].items())),
        ("rounds", f"{s['rounds']} (applied {s['rounds'] - s['skipped'] - s['dense']}, skipped {s['skipped']}, "
                   f"dense {s['dense']})"),
    ]
    if s["skipped_reasons"]:
        for reason, rounds in s["skipped_reasons"].items():
            rows.append(("skipped", f"{reason}: round {_list_rounds(rounds)}"))
    else:
        rows.append(("skipped", "none"))
    if s["participants_recorded"]:
        low, high = s["participants_min"], s["participants_max"]
        rows.append(("participants", f"{low} per round" if low == high else f"{low} to {high} per round"))
        for i, (t, ids) in enumerate(s["participants"].items()):
            if i == FEW and s["participants_elided"]:
                rows.append(("", f"... ({s['participants_elided']} rounds)"))
            rows.append(("", f"round {t}: {len(ids)} {_ids(ids)}"))
    else:
        rows.append(("participants", "not recorded in this ledger"))
    if s["directions_min"] is not None:
        low, high = s["directions_min"], s["directions_max"]
        rows.append(("directions", f"{low} per applied round" if low == high else f"{low} to {high} per applied round"))
    loss = s["loss"]
    if loss is None:
        rows.append(("honest loss", "not recorded in this ledger"))
    elif loss["start"] is None:
        rows.append(("honest loss", "not computed in any round"))
    else:
        text = f"start {_at(loss['start'])}, end {_at(loss['end'])}, min {_at(loss['min'])}"
        if loss["not_computed"]:
            text += f"; not computed in {loss['not_computed']} round(s)"
        rows.append(("honest loss", text))
    if s["lr_min"] is not None:
        rows.append(("learning rate", f"{_g(s['lr_min'])} to {_g(s['lr_max'])}"))
    accuracy = s["eval_accuracy"]
    if accuracy is None:
        rows.append(("eval accuracy", "not available: " + (s["trainer_state_note"] or "no eval_accuracy in "
                                                            f"{TRAINER_STATE}'s log_history")))
    else:
        start = f"start {_at(accuracy['start'], 'step')}" if accuracy["start"] else \
            f"start not evaluated ({START}); first {_at(accuracy['first'], 'step')}"
        rows.append(("eval accuracy", f"{start}, best {_at(accuracy['best'], 'step')}, "
                                      f"last {_at(accuracy['last'], 'step')} ({accuracy['evaluations']} evaluations)"))
    figures = s["bytes"]
    if figures is None:
        rows.append(("uplink/client", "not available: " + (s["trainer_state_note"] or "no uplink_bytes_per_client "
                                                            f"in {TRAINER_STATE}'s log_history")))
    else:
        ratio = figures["fedavg_per_round"] / figures["uplink_per_round"] if figures["uplink_per_round"] else math.inf
        rows.append(("uplink/client", f"{_g(figures['uplink_per_round'])} bytes per round, dense FedAvg "
                                      f"{_g(figures['fedavg_per_round'])} ({ratio:.4g}x less)"))
        rows.append(("", f"over {s['rounds']} rounds: {_g(figures['uplink_total'])} bytes, dense FedAvg "
                         f"{_g(figures['fedavg_total'])}"))
    if s["trainer_state"]:
        rows.append(("trainer state", s["trainer_state"]))
    width = max(len(name) for name, _ in rows) + 2
    return "\n".join(f"{name:<{width}}{value}".rstrip() for name, value in rows) + "\n"


def round_rows(run: Run) -> list[dict]:
    """One dict per round: round, lr, loss (None: not computed; missing: not recorded), participants count
    (None when not recorded), directions, skipped reason or dense."""
    rows = []
    for entry in run.rounds:
        row = {"round": entry["round"], "lr": entry["lr"], "directions": len(entry["seeds"]),
               "participants": len(entry["participants"]) if "participants" in entry else None,
               "note": entry.get("skipped") or ("dense" if entry.get("dense") else "")}
        if "loss" in entry:
            row["loss"] = entry["loss"]
        rows.append(row)
    return rows


def format_rounds(run: Run) -> str:
    """``inspect --rounds``: one line per round; numbers written exactly (shortest round-trip form), ``null`` for a
    loss not computed, ``-`` for a field the ledger does not record."""

    def cell(row, name):
        if name not in row or (row[name] is None and name == "participants"):
            return "-"
        return "null" if row[name] is None else repr(row[name])

    lines = [f"{'round':>6}  {'lr':<22}  {'loss':<22}  {'clients':>7}  {'directions':>10}  skipped/dense"]
    for row in round_rows(run):
        lines.append(f"{row['round']:>6}  {cell(row, 'lr'):<22}  {cell(row, 'loss'):<22}  "
                     f"{cell(row, 'participants'):>7}  {row['directions']:>10}  {row['note']}".rstrip())
    return "\n".join(lines) + "\n"


# ----- plot ----------------------------------------------------------------------------------------


PANELS = ("honest loss", "evaluation accuracy", "aggregate shift", "cumulative uplink bytes per client")
EXPLAINED = (  # one line under each panel's title
    "the honest clients' mean loss on their batches, each round (ledger)",
    "on the evaluation set; the first point, at 0, is before training",
    "||R - honest mean||: how far the rule's output lands from the honest vectors' mean",
    "what a client sends, against dense FedAvg's d floats per round",
)
NOTE_WIDTH = 48  # characters per line of a note inside a panel


def _unavailable(ax, text: str) -> None:
    ax.text(0.5, 0.5, textwrap.fill("not available: " + text, NOTE_WIDTH), ha="center", va="center",
            transform=ax.transAxes, fontsize=8, color="0.35")
    ax.set_xticks([])
    ax.set_yticks([])


def plot_figure(run: Run):
    """A matplotlib ``Figure`` (no pyplot, Agg-renderable) with four panels, in :data:`PANELS` order, each explained in
    one line (:data:`EXPLAINED`): honest loss per round (ledger), evaluation accuracy from the start (before
    training) on, aggregate shift (``log_history``), cumulative uplink bytes per participating client against dense
    FedAvg. A panel whose series is missing says why."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 8), layout="constrained")
    (ax_loss, ax_acc), (ax_shift, ax_bytes) = fig.subplots(2, 2)
    fig.suptitle(f"{run.directory}: {len(run.rounds)} rounds")
    for ax, title, line in zip((ax_loss, ax_acc, ax_shift, ax_bytes), PANELS, EXPLAINED, strict=True):
        ax.set_title(f"{title}\n{line}", fontsize=10)

    losses = loss_series(run)
    skipped = [entry["round"] for entry in run.rounds if entry.get("skipped")]
    if losses is None:
        _unavailable(ax_loss, "this ledger records no per-round loss")
    elif not losses[1]:
        _unavailable(ax_loss, "no round computed an honest loss"
                     + (f" ({len(skipped)} skipped)" if skipped else ""))
    else:
        ax_loss.plot(*losses, marker="." if len(losses[0]) < 50 else None, label="mean honest loss")
        for i, t in enumerate(skipped):
            ax_loss.axvline(t, color="tab:red", alpha=0.3, lw=1, label="skipped round" if i == 0 else None)
        ax_loss.set_xlabel("round")
        ax_loss.legend(fontsize=8)

    accuracy = summarize(run)["eval_accuracy"]
    steps, values = log_series(run, "eval_accuracy")
    if accuracy is None:
        _unavailable(ax_acc, _missing(run, "eval_accuracy"))
    else:
        if accuracy["start"]:
            ax_acc.plot(*accuracy["start"], marker="o", linestyle="none", color="tab:gray", label="start")
        if values:
            ax_acc.plot(steps, values, marker="." if len(steps) < 50 else None, label="eval_accuracy")
        ax_acc.set_xlabel("rounds completed (step)")
        ax_acc.set_ylabel("accuracy")
        ax_acc.legend(fontsize=8)
    steps, values = log_series(run, "aggregate_shift")
    if not values:
        _unavailable(ax_shift, _missing(run, "aggregate_shift"))
    else:
        ax_shift.plot(steps, values, marker="." if len(steps) < 50 else None)
        ax_shift.set_xlabel("rounds completed (step)")
        ax_shift.set_ylabel("||R - mean||")

    rounds = list(range(1, len(run.rounds) + 1))
    figures = bytes_per_client(run)
    if not rounds:
        _unavailable(ax_bytes, "the ledger holds no round")
    else:
        dense = figures[1] if figures else numel(run.ledger) * BYTES_PER_SCALAR
        ax_bytes.plot(rounds, [dense * t for t in rounds], label=f"dense FedAvg ({_g(dense)} B/round)")
        if figures:
            ax_bytes.plot(rounds, [figures[0] * t for t in rounds], label=f"zeroth-order ({_g(figures[0])} B/round)")
        else:
            note = "zeroth-order uplink not available: " + _missing(run, "uplink_bytes_per_client")
            ax_bytes.text(0.5, 0.25, textwrap.fill(note, NOTE_WIDTH), ha="center", va="center",
                          transform=ax_bytes.transAxes, fontsize=8, color="0.35")
        ax_bytes.set_yscale("log")
        ax_bytes.set_xlabel("round")
        ax_bytes.set_ylabel("bytes (a client in every round)")
        ax_bytes.legend(fontsize=8)
    return fig


def plot_run(path, out: str, key: bytes | None = None, max_bytes: int = MAX_BYTES) -> str:
    """Read the run in ``path`` and write :func:`plot_figure` as a PNG to ``out``; returns ``out``."""
    fig = plot_figure(load_run(path, key=key, max_bytes=max_bytes))
    directory = os.path.dirname(os.path.abspath(out))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out


# ----- replay --------------------------------------------------------------------------------------


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def load_factory(spec: str):
    """The callable named by ``module:callable`` or ``path/to/file.py:callable`` (``callable`` may be dotted)."""
    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"--model-factory {spec!r}: expected MODULE:CALLABLE or FILE.py:CALLABLE")
    if module_name.endswith(".py") or os.sep in module_name:
        if not os.path.isfile(module_name):
            raise ValueError(f"--model-factory {spec!r}: no file {module_name!r}")
        name = f"_zo_byzantine_factory_{os.path.splitext(os.path.basename(module_name))[0]}"
        loader = importlib.util.spec_from_file_location(name, module_name)
        module = importlib.util.module_from_spec(loader)
        sys.path.insert(0, os.path.dirname(os.path.abspath(module_name)))  # its own sibling imports
        try:
            loader.loader.exec_module(module)
        finally:
            sys.path.pop(0)
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            raise ValueError(f"--model-factory {spec!r}: {err} (is its folder the current directory or on "
                             "PYTHONPATH? Or give FILE.py:CALLABLE)") from err
    target = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"--model-factory {spec!r}: {module_name} has no {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"--model-factory {spec!r}: {attribute!r} is not callable")
    return target


def load_pretrained(directory: str, dtype: str = "auto") -> nn.Module:
    """A model saved with ``save_pretrained``: the class named in its ``config.json`` (``architectures``), else
    ``AutoModel``, loaded with ``from_pretrained`` (local files only) in ``dtype`` (``auto``: the saved one)."""
    import transformers

    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"--model {directory!r}: no config.json, so not a save_pretrained folder (for another "
                         "model, give --model-factory MODULE:CALLABLE and --start FILE)")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    architectures = config.get("architectures") if isinstance(config, dict) else None
    name = architectures[0] if isinstance(architectures, list) and architectures else None
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None or not hasattr(cls, "from_pretrained"):
        cls = transformers.AutoModel
    return cls.from_pretrained(directory, dtype=dtype if dtype == "auto" else DTYPES[dtype], local_files_only=True)


def load_state(path: str) -> dict[str, torch.Tensor]:
    """Tensors by name from a ``.safetensors`` file, or a ``torch.save``'d state dict (read with
    ``weights_only=True``: no arbitrary pickle)."""
    if not os.path.isfile(path):
        raise ValueError(f"--start {path!r}: no such file")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # unpickling, safetensors and zip errors have no common base
        raise ValueError(f"--start {path!r} could not be read: {type(err).__name__}: {err}") from err
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise ValueError(f"--start {path!r}: expected a state dict (names to tensors)")
    return state


def build_start_model(ledger: dict, model: str | None = None, start: str | None = None, factory: str | None = None,
                      dtype: str = "auto") -> nn.Module:
    """The run's starting model: built by ``factory`` (no arguments) or from the ``save_pretrained`` folder
    ``model``, then, with ``start``, loaded with those weights (all of the ledger's trainable parameters must be in
    it). The ledger's parameters are made trainable and every other one frozen, as in the run."""
    if (model is None) == (factory is None):
        raise ValueError("give the architecture with exactly one of --model DIR (a save_pretrained folder) and "
                         "--model-factory MODULE:CALLABLE")
    if factory is not None:
        built = load_factory(factory)()
        if not isinstance(built, nn.Module):
            raise ValueError(f"--model-factory {factory!r} returned a {type(built).__name__}, not a torch module")
        if dtype != "auto":
            built = built.to(DTYPES[dtype])
    else:
        built = load_pretrained(model, dtype)
    names = [name for name, _ in ledger["parameters"]]
    if start is not None:
        state = load_state(start)
        own = built.state_dict()
        unexpected = sorted(set(state) - set(own))
        missing = [name for name in names if name not in state]
        if unexpected or missing:
            raise ValueError(f"--start {start!r} does not fit the model: "
                             + "; ".join(f"{label} {items[:5]}{' ...' if len(items) > 5 else ''}"
                                         for label, items in (("unexpected", unexpected), ("missing", missing))
                                         if items))
        try:
            built.load_state_dict(state, strict=False)
        except RuntimeError as err:  # shapes that differ
            raise ValueError(f"--start {start!r} does not fit the model: {err}") from err
    wanted = set(names)
    params = dict(built.named_parameters())
    absent = [name for name in names if name not in params]
    if absent:
        raise LedgerError(f"The model has no parameter(s) {absent[:5]} that the ledger trains: another architecture?")
    for name, param in params.items():
        param.requires_grad_(name in wanted)
    return built


def trainable_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable tensors by name (table order), on the CPU, contiguous: what ``replay`` writes."""
    table = ParameterTable(model)
    return {name: p.detach().cpu().contiguous() for name, p in zip(table.names, table.params, strict=True)}


def replay_run(path, out: str, model: str | None = None, start: str | None = None, factory: str | None = None,
               key: bytes | None = None, dtype: str = "auto", device: str = "cpu",
               max_bytes: int = MAX_BYTES) -> dict:
    """Rebuild the trained weights of the run in ``path`` from its starting model (see :func:`build_start_model`)
    by :func:`~zo_byzantine.ledger.replay`, on ``device`` (any device for the ``counter`` generator; for a run
    made with the ``torch`` generator, the run's device type: its CPU and CUDA streams differ), and write the
    trainable ones to ``out`` (safetensors). Returns what was done."""
    run = load_run(path, key=key, max_bytes=max_bytes)
    built = build_start_model(run.ledger, model=model, start=start, factory=factory, dtype=dtype).to(device)
    replay(built, run.ledger, key=key, progress=True)
    weights = trainable_weights(built)
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    metadata = {"format": "pt", "zo_byzantine.ledger_digest": run.ledger["digest"],
                "zo_byzantine.rounds": str(len(run.rounds))}
    save_file(weights, out, metadata=metadata)
    return {"out": out, "tensors": len(weights), "parameters": sum(w.numel() for w in weights.values()),
            "rounds": len(run.rounds), "skipped": sum(1 for entry in run.rounds if entry.get("skipped")),
            "digest": run.ledger["digest"]}

"""The rounds' loss from the Trainer's ``compute_loss_func``, and the loss route decided before any work.

``compute_loss_func(outputs, labels, num_items_in_batch)`` gives one number per batch; a round needs each client's
(SPEC 1.4). :class:`LossFuncForward` calls it on each example's rows of the outputs, ``l_e``, and takes the
weighting ``w_e`` (one per example, or the example's target tokens: labels other than -100, shifted by one or not)
under which the batch value is the weighted mean of the ``l_e``: ``(sums, counts) = (w_e l_e, w_e)``, so a client's
loss is what the function computes on that client's examples alone. A function no weighting reproduces (class
weights, a loss mixing examples) cannot be split by client and is refused. It costs one call per example and forward.

:func:`probe_loss_route` decides the route (this one, or the model's own: ``losses.PerExampleForward``) on the first
few training examples when the trainer is built, so that a loss the rounds cannot split is refused before any
evaluation or round; the random states (collators that mask at random) are left as they were.
"""

from __future__ import annotations

import contextlib
import math
import random

import numpy as np
import torch
from transformers.utils import ModelOutput

from .losses import IGNORE_INDEX, OVERRIDE_HINT, close, mean_of, without_labels

PROBE_ROWS = 8  # training examples the route is decided on


def example_rows(value, start: int, stop: int, rows: int):
    """Rows ``start:stop`` of every tensor of ``value`` (outputs: tensors, dicts, ``ModelOutput``s, tuples) that has
    ``rows`` rows; other values as they are."""
    if torch.is_tensor(value):
        return value[start:stop] if value.dim() and value.shape[0] == rows else value
    if isinstance(value, ModelOutput):
        return type(value)(**{k: example_rows(v, start, stop, rows) for k, v in value.items()})
    if isinstance(value, dict):
        return {k: example_rows(v, start, stop, rows) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(example_rows(v, start, stop, rows) for v in value)
    return value


def _scalar(value, name: str = "compute_loss_func") -> torch.Tensor:
    loss = torch.as_tensor(value)
    if loss.numel() != 1:
        raise ValueError(f"{name} returned a loss of shape {tuple(loss.shape)}; expected one number per batch.")
    return loss.reshape(()).double()


def weightings(labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """The weightings a batch loss may use, per example: one, or its target tokens (token labels only)."""
    ones = torch.ones(labels.shape[0], dtype=torch.float64, device=labels.device)
    if labels.dim() != 2 or labels.is_floating_point():
        return {"examples": ones}
    return {"examples": ones, "target tokens": (labels != IGNORE_INDEX).sum(1).double(),
            "target tokens shifted by one": (labels[:, 1:] != IGNORE_INDEX).sum(1).double()}


class LossFuncForward:
    """``(sums, counts)`` per example of ``compute_loss_func`` (module docstring). The model is called without its
    labels, as the Trainer calls it with a ``compute_loss_func``; the weighting is decided by the first batch with
    finite losses that tells the weightings apart (until then every batch is checked)."""

    def __init__(self, func):
        self.func = func
        self.weighting: str | None = None

    def __call__(self, model, inputs: dict):
        labels = inputs.get("labels")
        if labels is None:
            raise ValueError("compute_loss_func needs `labels` in the training batches (the rounds call it as the "
                             "Trainer does, with the labels taken out of the inputs).")
        outputs, rows = model(**without_labels(inputs)), labels.shape[0]
        values = torch.stack([_scalar(self.func(example_rows(outputs, e, e + 1, rows), labels[e : e + 1],
                                                num_items_in_batch=None)) for e in range(rows)])
        weights = weightings(labels)
        weight = weights[self.weighting or self._decide(outputs, labels, values, weights)]
        return torch.where(weight > 0, values * weight, 0.0), weight

    def probe(self, model, inputs: dict) -> None:
        self(model, inputs)

    def _decide(self, outputs, labels: torch.Tensor, values: torch.Tensor, weights: dict) -> str:
        batch = float(_scalar(self.func(outputs, labels, num_items_in_batch=None)))
        means = {name: mean_of(torch.where(w > 0, values * w, 0.0), w) for name, w in weights.items()}
        if not math.isfinite(batch) or not all(map(math.isfinite, means.values())):
            return "examples"  # undecided: a later batch decides
        found = [name for name, mean in means.items() if close(mean, batch)]
        if not found:
            read = ", ".join(f"by {name} {mean:.6g}" for name, mean in means.items())
            raise ValueError(f"compute_loss_func cannot be split by client: its batch loss {batch:.6g} is not a "
                             f"weighted mean of its per-example losses ({read}); {OVERRIDE_HINT}.")
        if len({float(mean) for mean in means.values()}) == len(means) or len(found) == len(means):
            self.weighting = found[0]  # told apart (or all the same: any one is right)
        return found[0]


@contextlib.contextmanager
def random_states_kept():
    """Python's, numpy's and torch's (CPU and the current GPU's) random states restored on exit."""
    python, numpy_state = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy_state)


def training_data(trainer, dataset) -> tuple:
    """``(dataset, collator)`` as the Trainer feeds training batches: unused columns removed from a ``datasets``
    dataset, else by the collator."""
    try:
        import datasets

        is_hf_dataset = isinstance(dataset, datasets.Dataset)
    except ImportError:
        is_hf_dataset = False
    if is_hf_dataset:
        return trainer._remove_unused_columns(dataset, description="Training"), trainer.data_collator
    return dataset, trainer._get_collator_with_removed_columns(trainer.data_collator, description="Training")


def probe_batch(trainer, rows: int = PROBE_ROWS) -> dict:
    """The first ``rows`` training examples, collated and prepared as the train dataloader's batches are."""
    dataset, collator = training_data(trainer, trainer.train_dataset)
    return trainer._prepare_inputs(collator([dataset[i] for i in range(min(rows, len(dataset)))]))


def probe_loss_route(trainer) -> None:
    """Decide ``trainer.forward_per_example``'s route on the first training examples, in eval mode without
    gradients, leaving the random states and the model's mode as they were."""
    model = trainer.model
    training = model.training
    with random_states_kept(), torch.no_grad(), trainer.compute_loss_context_manager():
        model.eval()
        try:
            trainer.forward_per_example.probe(model, probe_batch(trainer))
        finally:
            model.train(training)

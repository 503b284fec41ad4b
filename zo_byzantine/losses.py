"""Per-example losses from one batched forward, so that each client's loss can be read off.

For example ``e``: ``(sum_e, count_e)`` with ``sum_e`` the summed loss over its targets and
``count_e`` their number; client ``i``'s loss is ``sum_{e in i} sum_e / sum_{e in i} count_e``,
exactly the mean the model computes on that client's batch alone.

Which loss: the one the user trains on (:class:`PerExampleForward`). A model whose forward returns a per-example
``loss`` (shape ``[batch]``) gives it; otherwise the losses are read off the ``logits``, in the convention that
reproduces the model's own batch loss when it returns one (token labels shifted by one or not: a causal LM inside
the user's own wrapper is recognised by its loss, not by its class name). A batch loss that no convention
reproduces (class weights, label smoothing inside the model) cannot be split by client and is refused. The
Trainer's ``compute_loss_func`` is split per example by :class:`~zo_byzantine.loss_routes.LossFuncForward`.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
FEW_CLASSES = 64  # up to this many classes, cross-entropy by rows (faster than log_softmax's kernel on CPU)
RTOL, ATOL = 1e-4, 1e-6  # a convention reproduces a batch loss within these (float32 sums in another order)
OVERRIDE_HINT = "override ZOByzantineTrainer.per_example_losses(model, inputs) -> (sums, counts) per example"
SPLIT_HINT = f"return a per-example loss of shape [batch] from forward (reduction='none'), or {OVERRIDE_HINT}"
CONVENTIONS = {None: "read from the logits", False: "labels not shifted", True: "labels shifted by one"}


def is_causal_lm(model: nn.Module) -> bool:
    """True for models whose token labels are shifted by one (``*ForCausalLM``, ``*LMHeadModel``), by class name:
    the convention assumed for a model that computes no loss of its own to check it against."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    return name.endswith("ForCausalLM") or name.endswith("LMHeadModel")


def output(outputs, name: str):
    """``outputs[name]`` of a dict or ``ModelOutput``, ``outputs.name`` otherwise; None when absent."""
    return outputs.get(name) if isinstance(outputs, dict) else getattr(outputs, name, None)


def per_example_loss(model: nn.Module | None, outputs, labels: torch.Tensor | None, shift: bool | None = None):
    """``(sums, counts)`` per example, from ``outputs.loss`` of shape ``[N]`` or from logits and labels; token labels
    are shifted by one when ``shift`` (``None``: :func:`is_causal_lm`)."""
    loss, logits = output(outputs, "loss"), output(outputs, "logits")
    if loss is not None and loss.dim() == 1:
        return loss.double(), torch.ones_like(loss, dtype=torch.float64)
    if logits is None or labels is None:
        raise ValueError(
            "A zeroth-order round needs per-example losses: the model must return `logits` (with `labels` in the "
            "inputs) or a `loss` of shape [batch]."
        )
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if logits.dim() == 2 and labels.dim() == 1:
        if logits.shape[-1] == 1 and labels.is_floating_point():  # regression
            sums = (logits.squeeze(-1) - labels.float()).pow(2)
            return sums.double(), torch.ones_like(sums, dtype=torch.float64)
        return _class_cross_entropy(logits, labels)
    if logits.dim() == 3 and labels.dim() == 2:
        if (is_causal_lm(model) if shift is None else shift):
            logits, labels = logits[:, :-1], labels[:, 1:]
        token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
        mask = labels != IGNORE_INDEX
        return (token * mask).sum(dim=1).double(), mask.sum(dim=1).double()
    raise ValueError(
        f"Cannot read per-example losses from logits {tuple(logits.shape)} and labels {tuple(labels.shape)}."
    )


def _class_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums, counts)`` of ``[N, C]`` logits: ``sums_e = logsumexp(x_e) - x_{e, y_e}`` (0 where ``y_e`` is
    ignored). With few classes it is computed by rows, ``m_e + log sum_c exp(x_ec - m_e) - x_{e, y_e}`` with
    ``m_e = max_c x_ec`` (CPU's ``log_softmax`` is slow on short rows: a stacked MNIST round spends most of its time
    there) when no gradient is asked for; equal to ``F.cross_entropy(reduction="none")`` up to rounding."""
    counts = (labels != IGNORE_INDEX).double()
    if logits.shape[-1] > FEW_CLASSES or logits.requires_grad:  # (its backward is slower than torch's fused one)
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none").double(), counts
    if ((labels < 0) & (labels != IGNORE_INDEX)).any() or (labels >= logits.shape[-1]).any():
        raise IndexError(f"labels must be in [0, {logits.shape[-1]}) or {IGNORE_INDEX} (ignored).")
    peak = logits.amax(dim=1, keepdim=True)
    lse = (logits - peak).exp_().sum(dim=1).log_().add_(peak.squeeze(1))
    picked = logits.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    return torch.where(labels != IGNORE_INDEX, lse - picked, 0.0).double(), counts


def mean_of(sums: torch.Tensor, counts: torch.Tensor) -> float:
    """The batch mean ``sum sums / sum counts`` (what a model's mean loss is)."""
    return float(sums.sum() / counts.sum())


def close(a: float, b: float, *dtypes: torch.dtype) -> bool:
    """Equal up to the rounding of float32 sums taken in another order, or of values held in ``dtypes`` (a half
    precision model's loss: two of its epsilons)."""
    rtol = max([RTOL, *(2 * torch.finfo(t).eps for t in dtypes if t.is_floating_point)])
    return math.isclose(a, b, rel_tol=rtol, abs_tol=ATOL)


def without_labels(inputs: dict) -> dict:
    return {k: v for k, v in inputs.items() if k != "labels"}


class PerExampleForward:
    """``(sums, counts)`` of one forward, by the route the model's own loss shows (module docstring).

    Decided from the first batch with labels (:meth:`probe`: at the trainer's construction, on a few training
    examples; else at the first round): the forward is called with the labels; a ``loss`` of shape ``[batch]`` is
    used as is; a batch ``loss`` picks the logits convention that reproduces it, or is refused (one line) when none
    does; a model without a loss of its own gets :func:`is_causal_lm`'s convention. Then labels are kept out of the
    model call when the model returns logits without them (its own mean loss would be computed and thrown away).
    While the model's loss or the logits' are not finite, nothing is decided and labels are passed."""

    def __init__(self):
        self.decided = False
        self.shift: bool | None = None  # token labels shifted by one; None: by class name
        self.pass_labels: bool | None = None  # None: not known yet

    def __call__(self, model: nn.Module, inputs: dict):
        labels = inputs.get("labels")
        if labels is None:
            return per_example_loss(model, model(**inputs), None)
        if not self.decided:
            return self._decide(model, inputs, labels)
        if self.pass_labels is None:  # once: the labels left out (only a TypeError, raised before any module runs)
            try:
                outputs = model(**without_labels(inputs))
                self.pass_labels = output(outputs, "logits") is None
            except TypeError:
                self.pass_labels = True
            if not self.pass_labels:
                return per_example_loss(model, outputs, labels, self.shift)
        outputs = model(**inputs) if self.pass_labels else model(**without_labels(inputs))
        return per_example_loss(model, outputs, labels, self.shift)

    def probe(self, model: nn.Module, inputs: dict) -> None:
        """Decide the route on ``inputs`` (a few training examples, before any work), and whether the labels can be
        left out: the model returns the same logits without them (an exception, or other logits: they cannot)."""
        self(model, inputs)
        if not self.decided or self.pass_labels is not None or inputs.get("labels") is None:
            return
        try:
            plain = output(model(**without_labels(inputs)), "logits")
        except Exception:  # noqa: BLE001 -- e.g. an encoder-decoder's ValueError: it needs its labels
            plain = None
        self.pass_labels = plain is None or not torch.equal(plain, output(model(**inputs), "logits"))

    def _decide(self, model: nn.Module, inputs: dict, labels: torch.Tensor):
        try:
            outputs = model(**inputs)
        except TypeError:  # a forward without `labels`: no loss of its own to follow
            outputs, self.pass_labels = model(**without_labels(inputs)), False
        loss, logits = output(outputs, "loss"), output(outputs, "logits")
        if loss is not None and loss.dim() == 1:  # the model's own per-example loss
            self.decided, self.pass_labels = True, self.pass_labels is not False
        elif loss is not None and self.pass_labels is None:
            if logits is None:
                raise ValueError(f"The model returns one loss for the batch and no logits, which cannot be split by "
                                 f"client: {SPLIT_HINT}.")
            self.decided = self._follow(model, loss, logits, labels)
        else:
            self.decided = True
            if logits is not None and logits.dim() == 3 and labels.dim() == 2 and not is_causal_lm(model):
                logger.warning("Token labels and no loss of the model's own to check their convention against: the "
                               "rounds take labels[:, t] as the target of logits[:, t] (not shifted); a causal LM's "
                               "labels are shifted by one: return the model's loss to have it followed.")
        return per_example_loss(model, outputs, labels, self.shift)

    def _follow(self, model: nn.Module, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> bool:
        """Take the convention whose batch mean is the model's ``loss``; False (undecided) while they are not finite.
        In half precision a difference under two epsilons is not seen (the model's own rounding)."""
        shifts = (False, True) if logits.dim() == 3 and labels.dim() == 2 else (None,)
        means = {shift: mean_of(*per_example_loss(model, {"logits": logits}, labels, bool(shift))) for shift in shifts}
        value = float(loss)
        if not math.isfinite(value) or not all(map(math.isfinite, means.values())):
            return False
        found = [shift for shift, mean in means.items() if close(mean, value, loss.dtype, logits.dtype)]
        if not found:
            read = ", ".join(f"{CONVENTIONS[shift]} {mean:.6g}" for shift, mean in means.items())
            raise ValueError(f"The model's own loss ({value:.6g}) is not the mean of the per-example losses read "
                             f"from its logits ({read}), so the rounds cannot split it by client: {SPLIT_HINT}.")
        self.shift = found[0]
        return True


def client_losses(sums: torch.Tensor, counts: torch.Tensor, client_of_example: torch.Tensor, num_clients: int):
    """Each client's mean loss: ``sum of its sums / sum of its counts`` (float64); ``sums`` and ``counts`` per example
    (``[rows]``) or per model and example (``[models, rows]``, one row of losses per model)."""
    shape = (*sums.shape[:-1], num_clients)
    total = torch.zeros(shape, dtype=torch.float64, device=sums.device).index_add_(-1, client_of_example, sums)
    count = torch.zeros(shape, dtype=torch.float64, device=sums.device).index_add_(-1, client_of_example, counts)
    return total / count

"""Per-example losses from one batched forward, so that each client's loss can be read off.

For example ``e``: ``(sum_e, count_e)`` with ``sum_e`` the summed loss over its targets and
``count_e`` their number; client ``i``'s loss is ``sum_{e in i} sum_e / sum_{e in i} count_e``,
exactly the mean the model computes on that client's batch alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
FEW_CLASSES = 64  # up to this many classes, cross-entropy by rows (faster than log_softmax's kernel on CPU)


def is_causal_lm(model: nn.Module) -> bool:
    """True for models whose token labels are shifted by one (``*ForCausalLM``, ``*LMHeadModel``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    return name.endswith("ForCausalLM") or name.endswith("LMHeadModel")


def per_example_loss(model: nn.Module, outputs, labels: torch.Tensor | None):
    """``(sums, counts)`` per example, from ``outputs.loss`` of shape ``[N]`` or from logits and labels."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else getattr(outputs, "loss", None)
    logits = outputs.get("logits") if isinstance(outputs, dict) else getattr(outputs, "logits", None)
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
        if is_causal_lm(model):
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


class PerExampleForward:
    """``(sums, counts)`` of one forward. Labels are kept out of the model call when the model returns
    logits without them (the model's own mean loss would be computed and thrown away); models that
    need labels to return a per-example ``loss`` get them. Decided at the first call."""

    def __init__(self):
        self.pass_labels: bool | None = None

    def __call__(self, model: nn.Module, inputs: dict):
        labels = inputs.get("labels")
        if labels is not None and self.pass_labels is not True:
            try:
                outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
            except TypeError:
                outputs = None
            logits = (
                None
                if outputs is None
                else (outputs.get("logits") if isinstance(outputs, dict) else getattr(outputs, "logits", None))
            )
            if logits is not None:
                self.pass_labels = False
                return per_example_loss(model, outputs, labels)
            self.pass_labels = True
        return per_example_loss(model, model(**inputs), labels)


def client_losses(sums: torch.Tensor, counts: torch.Tensor, client_of_example: torch.Tensor, num_clients: int):
    """Each client's mean loss: ``sum of its sums / sum of its counts`` (float64); ``sums`` and ``counts`` per example
    (``[rows]``) or per model and example (``[models, rows]``, one row of losses per model)."""
    shape = (*sums.shape[:-1], num_clients)
    total = torch.zeros(shape, dtype=torch.float64, device=sums.device).index_add_(-1, client_of_example, sums)
    count = torch.zeros(shape, dtype=torch.float64, device=sums.device).index_add_(-1, client_of_example, counts)
    return total / count

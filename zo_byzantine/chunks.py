"""A round's examples cut into forward chunks (``zo_forward_batch_size``, ``zo_group_by_length``).

``zo_group_by_length``: the forwards' chunks hold examples of similar length, each cut to its longest example
(:func:`token_extents`), and their per-example losses are put back in the examples' order: the same losses up to
rounding, without the forwards over the round's padding.
"""

from __future__ import annotations

import torch

from .losses import IGNORE_INDEX


def rows_of(inputs: dict) -> int:
    return next(v.shape[0] for v in inputs.values() if torch.is_tensor(v))


def slice_rows(inputs: dict, start: int, stop: int, total: int) -> dict:
    return {k: v[start:stop] if torch.is_tensor(v) and v.shape[:1] == (total,) else v for k, v in inputs.items()}


def chunk_size(rows: int, forward_batch_size: int, batch: int, group_by_length: bool) -> int:
    """Examples per forward chunk: ``forward_batch_size``, else a client's ``batch`` when grouped by length, else
    all ``rows``."""
    return forward_batch_size or (batch if group_by_length else rows)


def forward_chunks(rows: int, forward_batch_size: int, batch: int, group_by_length: bool) -> int:
    """Forward chunks of ``rows`` examples (:func:`chunk_size` each)."""
    return -(-rows // max(chunk_size(rows, forward_batch_size, batch, group_by_length), 1))


def token_extents(inputs: dict) -> torch.Tensor:
    """Per example, the columns a forward must keep: ``1 + the last column`` that is attended (``attention_mask``)
    or a target (token ``labels`` other than -100). The columns after it are right padding, which no kept
    position attends to and no loss reads: exact (up to rounding) for models that see padding through the
    attention mask alone (BERT, GPT-2, Llama, ...), not for those that read pad embeddings (convolutions over
    tokens, Funnel's pooling)."""
    mask = inputs.get("attention_mask")
    if not torch.is_tensor(mask) or mask.dim() != 2:
        raise ValueError("zo_group_by_length=True needs an `attention_mask` of shape [examples, tokens] in every "
                         f"batch (a padding collator's); this batch has {sorted(inputs)}.")
    needed = mask != 0
    labels = inputs.get("labels")
    if torch.is_tensor(labels) and labels.shape == mask.shape and not labels.is_floating_point():
        needed = needed | (labels != IGNORE_INDEX)
    columns = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (needed * columns).amax(dim=1)


def trimmed(inputs: dict, rows: torch.Tensor, extents: torch.Tensor, total: int, width: int) -> dict:
    """Examples ``rows`` of ``inputs``, their token-aligned tensors (``[examples, tokens, ...]``, or ``[1, tokens,
    ...]`` shared by all, as ``position_ids`` may be) cut to the longest extent among them (at least one column).
    Float ``labels`` are never cut (multi-label targets ``[examples, labels]``): float token targets are not
    supported."""
    keep = max(int(extents[rows].max()), 1)
    out = {}
    for key, value in inputs.items():
        if torch.is_tensor(value) and value.shape[:1] in ((total,), (1,)) and value.dim() >= 1:
            if value.shape[0] == total:
                value = value[rows]
            if value.dim() >= 2 and value.shape[1] == width and not (key == "labels" and value.is_floating_point()):
                value = value[:, :keep]
        out[key] = value
    return out

"""A classification head on frozen sentence features: the cheapest configuration faithful to the protocol.

With the encoder frozen, its output does not depend on the perturbation, so each example's sentence
embedding is computed once (``h = sum_t m_t e_t / sum_t m_t``, the sentence-transformers mean pooling),
standardised with the training set's statistics, and the trainer perturbs and updates only the head
``logits = W h + b``. Seeds, per-client vectors, attacks, rule and update are the library's, unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``h = sum_t m_t e_t / sum_t m_t`` over the tokens ``t`` (``m`` the attention mask)."""
    mask = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1)


@torch.no_grad()
def embed(encoder: nn.Module, tokenizer, texts: list[str], max_length: int, batch: int = 64,
          progress: bool = True) -> torch.Tensor:
    """Mean-pooled embeddings of ``texts`` (sentence pairs as ``(a, b)`` tuples) from a frozen ``encoder``, in
    batches of ``batch`` in the given order, with a progress bar (``progress``).

    Not ``sentence_transformers.SentenceTransformer.encode``, although it pools the same way, shows a bar and is faster
    (length-sorted batches: 1.3-4x here): (1) it builds its own model from a path, while the callers pass the encoder
    they hold (the probe-then-fine-tune classifier's, an untrained one in tests); (2) its length-sorted batches give
    other floats (up to 7e-7 on SST-2 and RTE dev sentences, the same encoder), so every run recorded on these
    features, its ledger included, would stop reproducing bitwise."""
    encoder.eval()
    device = next(encoder.parameters()).device
    out = []
    bar = tqdm(total=len(texts), desc="Embedding", unit="examples", disable=not progress)
    for start in range(0, len(texts), batch):
        chunk = texts[start : start + batch]
        pairs = [t if isinstance(t, tuple) else (t,) for t in chunk]
        first, second = [p[0] for p in pairs], [p[1] if len(p) > 1 else None for p in pairs]
        enc = tokenizer(first, *([second] if any(s is not None for s in second) else []), padding=True,
                        truncation=True, max_length=max_length, return_tensors="pt")
        enc = {k: v.to(device) for k, v in enc.items()}
        out.append(mean_pool(encoder(**enc).last_hidden_state, enc["attention_mask"]).float().cpu())
        bar.update(len(chunk))
    bar.close()
    return torch.cat(out)


def moments(train: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The training features' per-dimension mean and standard deviation. A dimension that does not vary
    (std below 1e-6 times the median std: all-MiniLM-L6-v2's pooled output has one) gets std = inf, so that
    its standardised value is 0 also when a fine-tuned encoder moves it (dividing by a tiny std would blow
    a perturbation of 1e-3 up to 1e9)."""
    std = train.std(0)
    return train.mean(0), torch.where(std > 1e-6 * std.median(), std, torch.inf)


def standardize(train: torch.Tensor, *others: torch.Tensor) -> list[torch.Tensor]:
    """``(x - mean) / std`` with the training features' statistics, for ``train`` and each of ``others``."""
    mean, std = moments(train)
    return [(x - mean) / std for x in (train, *others)]


class Features(torch.utils.data.Dataset):
    """Rows ``{"x": features, "labels": class}``."""

    def __init__(self, x: torch.Tensor, labels):
        self.x, self.labels = x, torch.as_tensor(labels, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.labels[i]}


class FeatureHead(nn.Module):
    """``logits = W h + b`` on the sentence features ``h``; ``loss`` is the cross-entropy."""

    def __init__(self, dim: int, num_labels: int):
        super().__init__()
        self.classifier = nn.Linear(dim, num_labels)
        self.num_labels = num_labels

    def forward(self, x, labels=None):
        logits = self.classifier(x)
        return {"logits": logits, "loss": None if labels is None else nn.functional.cross_entropy(logits, labels)}


def collate_features(items: list[dict]) -> dict:
    return {"x": torch.stack([i["x"] for i in items]), "labels": torch.stack([i["labels"] for i in items])}


class PooledClassifier(nn.Module):
    """The encoder made trainable under a head trained on its frozen features (probe, then fine-tune):
    ``logits = head((mean_pool(encoder(x)) - mean) / std)``, ``mean`` and ``std`` the frozen features'
    statistics (buffers), so that at the start its logits are the probe's."""

    def __init__(self, encoder: nn.Module, head: FeatureHead, mean: torch.Tensor, std: torch.Tensor):
        super().__init__()
        self.encoder, self.head = encoder, head
        self.register_buffer("mean", mean.detach().clone())
        self.register_buffer("std", std.detach().clone())

    def forward(self, input_ids, attention_mask, token_type_ids=None, labels=None):
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state
        return self.head((mean_pool(hidden, attention_mask) - self.mean) / self.std, labels)

"""Prompt-based classification (LM-BFF / MeZO): templates, label words, prompt models.

Masked LM: ``*cls**sent_0*_It_was*mask*.*sep+*`` -> class logits = LM logits at ``<mask>``
restricted to the label words. Causal LM: ``"{text_a} It was"`` -> class logits = next-token
logits after the prompt restricted to the (single-token) options, i.e. the options'
log-likelihoods up to a shared constant (MeZO's ``train_as_classification``). The model returns
``logits`` of shape ``[batch, num_labels]``, so ``Trainer.evaluate``/``predict`` and
``compute_metrics`` work unchanged; the loss the rounds minimise is :class:`PromptModel`'s ``loss``.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput

from .tasks import TaskSpec

KINDS = ("masked_lm", "causal_lm")
LOSSES = ("label_words", "vocabulary")
_SENT = re.compile(r"^(\+)?sent(l)?(-)?_(\d)$")


def label_token_ids(spec: TaskSpec, tokenizer, kind: str) -> list[int]:
    """One token id per class. Masked LM words get a leading space (a no-op for WordPiece); causal
    options are taken verbatim. A word that is not one token fails, naming word and tokenizer."""
    ids = []
    for label in spec.labels:
        word = (" " if kind == "masked_lm" else "") + spec.words(kind)[label]
        tokens = tokenizer(word, add_special_tokens=False)["input_ids"]
        if len(tokens) != 1:
            pieces = tokenizer.convert_ids_to_tokens(tokens)
            raise ValueError(
                f"Label word {word!r} of task {spec.name!r} is {len(tokens)} tokens {pieces} for tokenizer "
                f"{type(tokenizer).__name__} ({getattr(tokenizer, 'name_or_path', '')!r}); "
                "label words must be one token."
            )
        ids.append(tokens[0])
    if len(set(ids)) != len(ids):
        raise ValueError(f"Label words of task {spec.name!r} share a token for this tokenizer: {ids}.")
    return ids


def _special(tokenizer, name: str) -> list[int]:
    token_id = getattr(tokenizer, f"{name}_token_id", None)
    if token_id is None:
        if name == "mask":
            raise ValueError(f"Tokenizer {type(tokenizer).__name__} has no mask token: use a causal LM template.")
        return []
    return [token_id]


def encode_masked(template: str, texts: list[str | None], tokenizer, max_length: int) -> list[int]:
    """LM-BFF template -> token ids; sentences are shortened (longest first) to fit ``max_length``."""
    pieces: list[tuple[bool, list[int]]] = []  # (is a sentence, ids)
    for part in filter(None, template.split("*")):
        match = _SENT.match(part)
        if part in ("cls", "mask", "sep", "sep+"):
            pieces.append((False, _special(tokenizer, part.rstrip("+"))))
        elif match:
            space, lower, drop_last, index = match.groups()
            text = texts[int(index)]
            if text is None:
                raise ValueError(f"Template {template!r} uses sentence {index}, which this example lacks.")
            text = text[:-1] if drop_last else text
            text = text[:1].lower() + text[1:] if lower else text
            text = " " + text if space else text
            pieces.append((True, tokenizer(text, add_special_tokens=False)["input_ids"]))
        else:
            pieces.append((False, tokenizer(part.replace("_", " "), add_special_tokens=False)["input_ids"]))
    overflow = sum(len(ids) for _, ids in pieces) - max_length
    while overflow > 0:
        longest = max((p for p in pieces if p[0]), key=lambda p: len(p[1]))
        if not longest[1]:
            raise ValueError(f"max_length={max_length} is too short for template {template!r}.")
        longest[1].pop()
        overflow -= 1
    return [i for _, ids in pieces for i in ids]


def encode_causal(template: str, texts: list[str | None], tokenizer, max_length: int) -> list[int]:
    """``[bos] + template.format(text_a=..., text_b=...)`` -> ids, no end token (the next token is scored);
    keeps the last ``max_length`` tokens."""
    prompt = template.format(text_a=texts[0], text_b=texts[1] if len(texts) > 1 else None)
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return (bos + ids)[-max_length:]


def encode_example(example: dict, spec: TaskSpec, tokenizer, kind: str, max_length: int | None = None) -> dict:
    """``{"input_ids", "attention_mask", "labels"}`` for one example."""
    texts = [example["text_a"], example.get("text_b")]
    encode = encode_masked if kind == "masked_lm" else encode_causal
    ids = encode(spec.template(kind), texts, tokenizer, max_length or spec.max_length)
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": example["label"]}


def _split(lm: nn.Module):
    """(backbone, head) when the LM is ``base_model`` + one head module, else None (full forward)."""
    base = getattr(lm, "base_model", None)
    heads = [m for _, m in lm.named_children() if m is not base]
    return (base, heads[0]) if base is not None and base is not lm and len(heads) == 1 else None


def _tied_rows(lm: nn.Module, head: nn.Module, label_ids: list[int]) -> nn.Embedding | None:
    """The input embedding when ``head`` is a plain bias-free ``nn.Linear`` that shares its weight (a tied LM head:
    SmolLM2, GPT-2, OPT), else None. Its rows at the label words are then the label words' output weights, and
    looking them up through the embedding module reads 2 of the head's rows instead of forming all of them. Not where
    a label word is the embedding's ``padding_idx`` (``F.embedding`` zeroes that row's gradient; the head does not)."""
    try:
        embedding = lm.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # transformers' default raises where it finds none
        return None
    return embedding if (type(head) is nn.Linear and head.bias is None and isinstance(embedding, nn.Embedding)
                         and type(embedding).forward is nn.Embedding.forward and embedding.max_norm is None
                         and embedding.weight is head.weight
                         and embedding.padding_idx not in label_ids) else None  # its rows' gradient: zeroed


def load_prompt_lm(name_or_path: str, kind: str = "auto", argument: str = "--head prompt",
                   alternative: str = "--head seq_cls", **placement):
    """``(lm, tokenizer, kind)`` for prompt scoring: the checkpoint's masked LM (a masked-LM architecture that is not
    a decoder, for ``kind="auto"``) or causal LM with its head, and its tokenizer (padding with EOS where it has no
    pad token). Refuses, naming ``argument`` and the ``alternative`` setting, a checkpoint without the LM head's
    weights (the label words would be scored by a head drawn at random); refuses an unknown ``kind``.
    ``placement``: ``from_pretrained``'s ``device_map``, ``max_memory``, ``offload_folder``."""
    from transformers import (
        MODEL_FOR_MASKED_LM_MAPPING,
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForMaskedLM,
        AutoTokenizer,
    )

    if kind not in ("auto", *KINDS):
        raise ValueError(f"prompt kind {kind!r} is not supported; accepted: auto, {', '.join(KINDS)}.")
    config = AutoConfig.from_pretrained(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if kind == "auto":
        kind = "masked_lm" if type(config) in MODEL_FOR_MASKED_LM_MAPPING and not config.is_decoder else "causal_lm"
    auto = AutoModelForMaskedLM if kind == "masked_lm" else AutoModelForCausalLM
    lm, info = auto.from_pretrained(name_or_path, output_loading_info=True, **placement)
    head = sorted(k for k in info["missing_keys"] if not k.startswith(f"{lm.base_model_prefix}."))
    if head:
        raise ValueError(f"{argument} needs the model's LM head, and {name_or_path!r} has none ({len(head)} head "
                         f"weights missing, e.g. {head[0]}): use a classification head ({alternative}), or a "
                         "masked/causal LM checkpoint (python -m zo_byzantine.models smollm2-135m gives one).")
    return lm, tokenizer, kind


class PromptModel(nn.Module):
    """Wraps an ``AutoModelForMaskedLM`` / ``AutoModelForCausalLM``; returns class logits over label words.

    Only the hidden state at the scored position goes through the LM head (one position per example; the rest of the
    sequence never meets the head: SmolLM2's tied head is 49,152 x 576, ~20 % of a forward over every position). A
    model that is not ``base_model`` + one head module runs whole and its logits are read at that position.

    With the ``label_words`` loss and a head tied to the input embedding, only the label words' rows ``E_y`` of the
    head are read, through the embedding module: ``x_y = h . E_y`` (the same logits; no ``[vocab, d]`` product). A
    perturbed forward then perturbs those rows alone (``perturbation.perturbed`` perturbs an embedding by the rows
    it reads): no perturbed copy of the 113 MB table is formed, the round's peak memory over inference's.

    ``loss``: what the rounds minimise, per example, at the scored position.

    - ``"label_words"`` (default): cross-entropy over the label words' logits, ``logsumexp_c x_c - x_y``. This is
      what the task's accuracy reads (the argmax over the label words), and what MeZO (``train_as_classification``,
      its setting for SST-2, RTE, CB, BoolQ with OPT) and DeComFL's ``last_token`` loss train: for one-token options the
      cross-entropy over their log-likelihoods is this one, the shared log-normaliser cancelling. Mass the model puts
      on other tokens costs nothing, so the few examples a client holds pull only on the decision they are scored by.
    - ``"vocabulary"``: the LM's cross-entropy of the label word over the whole vocabulary (teacher forcing of the
      one-token answer: MeZO with ``train_as_classification False``, its setting for generation tasks). It also
      raises the label words against every other token, which helps a model that will generate its answer; it adds
      ``log sum_v exp x_v`` to the objective, a term that accuracy never sees. Returned per example (``[batch]``).
    """

    _keys_to_ignore_on_save = None  # read by Trainer after loading a checkpoint (tied weights are stored once)

    def __init__(self, lm: nn.Module, label_ids: list[int], kind: str, mask_token_id: int | None = None,
                 loss: str = "label_words"):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not supported; accepted: {', '.join(KINDS)}.")
        if loss not in LOSSES:
            raise ValueError(f"PromptModel loss={loss!r} is not supported; accepted: {', '.join(LOSSES)} "
                             "(cross-entropy over the label words, or over the whole vocabulary).")
        if kind == "masked_lm" and mask_token_id is None:
            raise ValueError("A masked-LM prompt model needs mask_token_id.")
        self.lm, self.kind, self.mask_token_id, self.loss = lm, kind, mask_token_id, loss
        self.register_buffer("label_ids", torch.tensor(label_ids), persistent=False)
        self.label_list = [int(i) for i in label_ids]
        self.num_labels = len(label_ids)
        self.config = getattr(lm, "config", None)

    def positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        if self.kind == "masked_lm":
            is_mask = input_ids == self.mask_token_id
            if not is_mask.any(dim=1).all():
                raise ValueError("Every masked-LM prompt needs a mask token (was it truncated?).")
            return is_mask.int().argmax(dim=1)
        if attention_mask is None:
            return torch.full((len(input_ids),), input_ids.shape[1] - 1, device=input_ids.device)
        last = torch.arange(input_ids.shape[1], device=input_ids.device) * attention_mask  # last attended token
        return last.argmax(dim=1)

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        rows = torch.arange(len(input_ids), device=input_ids.device)
        at = self.positions(input_ids, attention_mask)
        split, tied = _split(self.lm), None
        if split is not None:
            backbone, head = split
            hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
            tied = _tied_rows(self.lm, head, self.label_list) if self.loss == "label_words" else None
            if tied is not None:  # [1 or batch, labels, d]: one lookup, or one per stacked group and example
                words = tied(self.label_ids[None, :]).to(hidden.device, hidden.dtype)
                logits = torch.matmul(words, hidden[rows, at, :, None])[..., 0]
            else:
                vocab_logits = head(hidden[rows, at])
        else:
            vocab_logits = self.lm(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits[rows, at]
        if tied is None:
            logits = vocab_logits[:, self.label_ids]
        if labels is None:
            loss = None
        elif self.loss == "label_words":
            loss = F.cross_entropy(logits.float(), labels)
        else:  # per example: the batch mean of a vocabulary loss is not what the logits returned can reproduce
            loss = F.cross_entropy(vocab_logits.float(), self.label_ids[labels], reduction="none")
        return SequenceClassifierOutput(loss=loss, logits=logits)

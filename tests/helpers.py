"""Tiny, offline models and data for tests: configs with random weights, a tokenizer trained here."""

from __future__ import annotations

import os
import random
import string
import sys

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
)

POSITIVE = ["good", "great", "fine", "lovely", "superb", "nice"]
NEGATIVE = ["bad", "awful", "poor", "dull", "terrible", "weak"]
FILLER = ["the", "movie", "was", "plot", "a", "really", "acting", "film", "quite", "story"]


def sentences(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """Sentences whose label is whether a positive or a negative word appears."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        label = rng.randrange(2)
        words = rng.sample(FILLER, 4) + [rng.choice(POSITIVE if label else NEGATIVE)]
        rng.shuffle(words)
        out.append((" ".join(words), label))
    return out


SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _bert_style(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """``tok`` (a WordPiece model) with BERT's lower-casing and splitting."""
    from tokenizers import decoders

    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    return tok


def _fast(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """``tok`` with the ``[CLS] ... [SEP]`` template, as a transformers tokenizer."""
    from tokenizers.processors import TemplateProcessing

    tok.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def train_wordpiece(corpus: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A BERT-style WordPiece tokenizer ([CLS] ... [SEP], lower case) trained on ``corpus``."""
    tok = _bert_style(Tokenizer(models.WordPiece(unk_token="[UNK]")))
    tok.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIALS))
    return _fast(tok)


def wordpiece_tokenizer() -> PreTrainedTokenizerFast:
    """A BERT-style WordPiece tokenizer over a fixed vocabulary: the special tokens, the sentences' words, then single
    characters and their ``##`` continuations (any other text). The same ids in every process: a trained vocabulary
    is not (the trainer breaks ties in an order that changes from process to process)."""
    chars = string.ascii_lowercase + string.digits
    vocab = [*SPECIALS, *sorted(set(POSITIVE + NEGATIVE + FILLER)), *chars, *string.punctuation,
             *(f"##{c}" for c in chars)]
    return _fast(_bert_style(Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))))


def tiny_bert(num_labels: int = 2, vocab_size: int = 200, seed: int = 0, dropout: float = 0.0):
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
        num_labels=num_labels,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    return BertForSequenceClassification(config)


def tiny_gpt2(vocab_size: int = 200, seed: int = 0, dropout: float = 0.0):
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=64,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return GPT2LMHeadModel(config)


class TextDataset(torch.utils.data.Dataset):
    """Tokenised sentences as dicts (``input_ids``, ``attention_mask``, ``labels``)."""

    def __init__(self, tokenizer, n: int = 96, seed: int = 0, causal: bool = False):
        self.items = []
        for text, label in sentences(n, seed):
            enc = tokenizer(text, truncation=True, max_length=24)
            labels = list(enc["input_ids"]) if causal else label
            self.items.append(
                {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}
            )

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(tokenizer):
    """Pad ``input_ids``/``attention_mask``; token labels padded with -100."""

    def fn(items):
        width = max(len(x["input_ids"]) for x in items)
        pad = tokenizer.pad_token_id
        ids = torch.tensor([x["input_ids"] + [pad] * (width - len(x["input_ids"])) for x in items])
        mask = torch.tensor([x["attention_mask"] + [0] * (width - len(x["attention_mask"])) for x in items])
        if isinstance(items[0]["labels"], list):
            labels = torch.tensor([x["labels"] + [-100] * (width - len(x["labels"])) for x in items])
        else:
            labels = torch.tensor([x["labels"] for x in items])
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return fn


class LogisticRegression(torch.nn.Module):
    """A plain module (not a PreTrainedModel): logits and mean loss, like a user's own model."""

    def __init__(self, dim: int = 8, classes: int = 2):
        super().__init__()
        self.linear = torch.nn.Linear(dim, classes)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = torch.nn.functional.cross_entropy(logits, labels)
        return out


class VectorDataset(torch.utils.data.Dataset):
    """Linearly separable points: label = [w* . x > 0]."""

    def __init__(self, n: int = 256, dim: int = 8, seed: int = 0, dtype: torch.dtype = torch.float32):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = (self.x @ torch.linspace(-1, 1, dim) > 0).long()
        self.x = self.x.to(dtype)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def make_trainer(model, dataset, output_dir, collator=None, trainer_kwargs=None, **kwargs):
    """A ZOByzantineTrainer with quiet defaults for tests; ``kwargs`` go to ZOByzantineArguments."""
    from zo_byzantine import ZOByzantineArguments, ZOByzantineTrainer

    defaults = dict(
        num_clients=4,
        per_device_train_batch_size=4,
        max_steps=6,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    defaults.update(kwargs)
    args = ZOByzantineArguments(output_dir=str(output_dir), **defaults)
    return ZOByzantineTrainer(
        model=model, args=args, train_dataset=dataset, data_collator=collator, **(trainer_kwargs or {})
    )


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def dataset_loss(model, dataset: VectorDataset) -> float:
    """Cross-entropy of ``model`` on the whole ``dataset`` (no grad)."""
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(dataset.x)["logits"], dataset.y).item()


sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from _common import load_example  # noqa: E402,F401  (one loader of examples/*.py, shared with the benchmarks and experiments)


def gaussian_like(param, seed: int, index: int):
    """``z_index`` of direction ``seed`` from the default generator, in ``param``'s dtype (a test's reference)."""
    from zo_byzantine.directions import build_directions

    return build_directions().draw(param, seed, index).to(param.dtype)


def updated(weights, index: int, terms, lr: float):
    """The default generator's update of tensor ``index``, written out: ``acc = z_0 (-lr c_0)``, ``acc = acc + z_k
    (-lr c_k)``, ``w + acc`` (float32 arithmetic, float64 for float64 weights)."""
    acc = None
    for seed, coeff in terms:
        z = gaussian_like(weights, seed, index) if weights.dtype == torch.float64 else \
            gaussian_like(weights.float(), seed, index)
        term = z * (-lr * coeff)
        acc = term if acc is None else acc + term
    return (weights.to(acc.dtype) + acc).to(weights.dtype)

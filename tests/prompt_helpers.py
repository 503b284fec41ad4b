"""Tokenizers trained here (WordPiece, byte-level BPE) and tiny prompt models saved to a folder."""

from __future__ import annotations

import os

import torch
from helpers import train_wordpiece
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    RobertaConfig,
    RobertaForMaskedLM,
)

DATA = os.environ.get("ZO_DATA_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))

WORDS = (
    "terrible great Description Entity Expression Human Location Number Yes No Maybe It was a good film "
    "the movie is What Who Where How many Does this mean that true or imply Question The answer to this question "
    'is a and an , . ? : ! " plot acting bad Review Sentiment negative positive True False Answer type description '
    "entity abbreviation person location number"
).split()


def corpus() -> list[str]:
    lines = []
    with open(os.path.join(DATA, "sst2", "dev.tsv"), encoding="utf-8") as f:
        lines += [line.split("\t")[0] for line in list(f)[1:400]]
    return lines + [" ".join(WORDS)] * 200 + [" " + " ".join(WORDS)] * 200 + WORDS * 50


def wordpiece() -> PreTrainedTokenizerFast:
    return train_wordpiece(corpus(), 1500)


def byte_bpe(roberta: bool = True) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok.train_from_iterator(
        corpus(),
        trainers.BpeTrainer(
            vocab_size=1500, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    if roberta:
        tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<s>",
            eos_token="</s>",
            cls_token="<s>",
            sep_token="</s>",
            pad_token="<pad>",
            unk_token="<unk>",
            mask_token="<mask>",
        )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def save_tiny_roberta(folder: str) -> str:
    tokenizer = byte_bpe()
    torch.manual_seed(0)
    config = RobertaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=300,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    RobertaForMaskedLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def tiny_bert_mlm(vocab_size: int):
    torch.manual_seed(0)
    return BertForMaskedLM(
        BertConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=300,
        )
    )


def tiny_gpt2_lm(vocab_size: int):
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=300))

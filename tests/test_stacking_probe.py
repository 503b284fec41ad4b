"""The stacked-directions probe of ``zo_schedule='auto'`` (issue 48, item 6): a model whose first trainable module is
not a linear layer on the examples (a BERT masked-LM prompt model: embeddings first) is not stacked, without running
the stacked forward that failed with an IndexError (logged at INFO as a fallback); only the failures of a model that
cannot take stacked shapes fall back, any other error is raised."""

import logging

import pytest
import torch
from helpers import LogisticRegression, VectorDataset, collate, make_trainer, sentences, wordpiece_tokenizer
from prompt_helpers import tiny_bert_mlm

from zo_byzantine.batched_clients import BatchedClients
from zo_byzantine.prompts import PromptModel, encode_example, label_token_ids
from zo_byzantine.tasks import load_task


def test_a_masked_lm_prompt_model_is_not_stacked_and_no_error_is_logged(tmp_path, caplog):
    tokenizer, spec = wordpiece_tokenizer(), load_task("sst2")
    lm = tiny_bert_mlm(len(tokenizer))
    model = PromptModel(lm, label_token_ids(spec, tokenizer, "masked_lm"), "masked_lm", tokenizer.mask_token_id)
    examples = [encode_example({"text_a": text + " really" * (i % 4), "text_b": None, "label": label}, spec, tokenizer,
                               "masked_lm") for i, (text, label) in enumerate(sentences(32))]  # padded rows
    trainer = make_trainer(model, examples, tmp_path, collate(tokenizer), max_steps=2, num_perturbations=2)
    with caplog.at_level(logging.INFO, logger="zo_byzantine.batched_clients"):
        trainer.train()
    stacking = [r.getMessage() for r in caplog.records if "stacked directions" in r.getMessage()]
    assert stacking == ["zo_schedule='auto': stacked directions not used (the first trainable module a forward "
                        "reaches is not a linear layer on the examples: no shared matrix product)."]
    assert trainer.schedule.stack is False


def _run(tmp_path, **settings):
    torch.manual_seed(0)
    trainer = make_trainer(LogisticRegression(), VectorDataset(64), tmp_path, max_steps=2, num_perturbations=2,
                           **settings)
    trainer.train()
    return trainer


def test_the_probe_stacks_a_linear_model_and_raises_a_bug(tmp_path, monkeypatch):
    assert _run(tmp_path / "plain").schedule.stack is True
    # the torch generator's unperturbed model (no terms) was a TypeError, swallowed: never stacked
    assert _run(tmp_path / "torch", zo_generator="torch").schedule.stack is True

    def fails(error):
        def stacked(self, *args):
            raise error
        return stacked

    monkeypatch.setattr(BatchedClients, "_stacked", fails(RuntimeError("shape mismatch")))
    assert _run(tmp_path / "runtime").schedule.stack is False  # a shape the model cannot take: not stacked
    monkeypatch.setattr(BatchedClients, "_stacked", fails(IndexError("index 1 is out of bounds")))
    with pytest.raises(IndexError, match="index 1 is out of bounds"):
        _run(tmp_path / "index")

"""Refusals before any work, naming the setting or file and what is accepted (issue 48, items 4 and 5)."""

import json
import os

import pytest
import torch
from helpers import (
    LogisticRegression,
    TextDataset,
    VectorDataset,
    collate,
    make_trainer,
    tiny_gpt2,
    wordpiece_tokenizer,
)

from zo_byzantine import ZOByzantineArguments
from zo_byzantine.tasks import load_local_split, load_task


def _args(tmp_path, **kwargs):
    return ZOByzantineArguments(output_dir=str(tmp_path), report_to=[], **kwargs)


# ----- item 4: sizes and seeds bounded at the arguments, refusals before the start evaluation ---------------------


@pytest.mark.parametrize("setting, value, message", [
    ("num_perturbations", 10**9, r"num_perturbations=1000000000, .* a round would hold about .* GiB .* over a "
                                 r"quarter of this machine's memory"),
    ("local_steps", 10**9, r"local_steps=1000000000, .* a round would hold"),
    ("per_device_train_batch_size", 10**9, r"per_device_train_batch_size=1000000000: a round would hold"),
    ("num_clients", 10**10, r"num_clients=10000000000, .* a round would hold"),
    ("zo_seed", 2**64, r"zo_seed=18446744073709551616 must be an integer in \[0, 18446744073709551615\]"),
    ("max_steps", 10**8, r"max_steps=100000000 rounds of 1 directions .* over the 1 GiB a ledger may have to be read "
                         r"back"),
    ("resume_from_checkpoint", "/nonexistent", r"resume_from_checkpoint='/nonexistent': no such checkpoint folder; "
                                               r"accepted: the path of a checkpoint-N folder, or true / last"),
    ("eval_steps", 0, r"eval_steps=0 must be a finite number > 0 .* leave it unset to evaluate every logging_steps"),
    ("save_steps", -1, r"save_steps=-1 must be a finite number > 0"),
])
def test_sizes_seeds_steps_and_the_checkpoint_are_bounded_at_the_arguments(tmp_path, setting, value, message):
    with pytest.raises(ValueError, match=message):
        _args(tmp_path, **{setting: value})


def test_the_ledger_of_an_epoch_run_is_bounded_before_any_work(tmp_path):
    """max_steps=-1 (train for num_train_epochs): the ledger's size was not bounded (max_steps x directions < 0). The
    trainer bounds num_train_epochs x rounds per epoch once the clients' data is known, at construction."""
    with pytest.raises(ValueError, match=r"num_train_epochs=10000000 x 8 rounds per epoch = 80000000 rounds of 64 "
                                         r"directions .* over the 1 GiB a ledger may have to be read back"):
        make_trainer(LogisticRegression(), VectorDataset(128), tmp_path, max_steps=-1, num_train_epochs=10**7,
                     num_perturbations=64)
    make_trainer(LogisticRegression(), VectorDataset(128), tmp_path, max_steps=-1, num_train_epochs=2,
                 num_perturbations=64)


@pytest.mark.parametrize("strategy", ["checkpoint", "all_checkpoints"])
def test_pushing_staged_checkpoints_to_the_hub_is_refused_naming_hub_strategy(tmp_path, strategy):
    """Checkpoints are written in a staging folder, renamed right after: the hub strategies that upload a checkpoint's
    folder in the background would read it while it moves."""
    with pytest.raises(ValueError, match=rf"push_to_hub with hub_strategy='{strategy}' uploads each checkpoint .* "
                                         r"accepted: hub_strategy='every_save' or 'end'"):
        _args(tmp_path, push_to_hub=True, hub_strategy=strategy, save_strategy="steps", save_steps=2, max_steps=4)
    _args(tmp_path, push_to_hub=True, hub_strategy="every_save", save_strategy="steps", save_steps=2, max_steps=4)


def test_a_missing_checkpoint_is_refused_before_the_start_evaluation(tmp_path):
    dataset = VectorDataset(64)
    trainer = make_trainer(LogisticRegression(), dataset, tmp_path, trainer_kwargs={"eval_dataset": dataset},
                           eval_on_start=True, eval_strategy="steps", eval_steps=2)
    evaluated = []
    trainer.evaluate = lambda *a, **k: evaluated.append(1)
    with pytest.raises(ValueError, match="resume_from_checkpoint='.*missing': no such checkpoint folder"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "missing"))
    assert not evaluated and trainer.ledger is None


# ----- item 5: refusals that say what is wrong ---------------------------------------------------------------------


@pytest.mark.parametrize("name, kwargs, message", [
    ("aggregator", {"aggregator": "cwtm", "aggregator_kwargs": {"beta": "x"}},
     r"cwtm: beta='x' must be in \[0, 0.5\) \(a number"),
    ("aggregator", {"aggregator": "krum", "aggregator_kwargs": {"squared": "false"}},
     r"krum: squared='false' must be True or False"),
    ("attack", {"num_byzantine": 1, "attack": "tma", "attack_kwargs": {"beta": [0.2]}},
     r"TMA: beta=\[0.2\] must be in \(0, 0.5\) \(a number"),
    ("attack", {"num_byzantine": 1, "attack": "alie", "attack_kwargs": {"candidates": 3}},
     r"candidates=3: a non-empty list of numbers"),
])
def test_rule_and_attack_parameters_of_the_wrong_type_are_named(tmp_path, name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _args(tmp_path, **kwargs)


def _spec(tmp_path, edit) -> str:
    with open(os.path.join(os.path.dirname(__file__), "..", "tasks", "sst2.json")) as f:
        data = json.load(f)
    edit(data)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_task_specs_are_checked_when_loaded_naming_the_field(tmp_path):
    values = _spec(tmp_path, lambda d: d["local"]["label_values"].update({"1": "pos"}))
    with pytest.raises(ValueError, match=r"local.label_values\['1'\]='pos' is not a label of the spec; accepted: "
                                         r"'negative', 'positive', or null"):
        load_task(values)
    hub = _spec(tmp_path, lambda d: d["hub"]["label_values"].update({"0": "neg"}))
    with pytest.raises(ValueError, match=r"hub.label_values\['0'\]='neg' is not a label"):
        load_task(hub)
    string = _spec(tmp_path, lambda d: d["local"].update({"train": "train.tsv"}))
    with pytest.raises(ValueError, match=r"local.train='train.tsv' must be a list of file names"):
        load_task(string)


def test_a_missing_template_or_label_words_are_named(tmp_path):
    from zo_byzantine.prompts import encode_example, label_token_ids

    spec = load_task(_spec(tmp_path, lambda d: d["templates"].pop("masked_lm")))
    example = {"text_a": "a fine film", "text_b": None, "label": 1}
    with pytest.raises(ValueError, match=r"Task 'sst2' has no 'masked_lm' template \(its templates: \['causal_lm'\]\)"):
        encode_example(example, spec, wordpiece_tokenizer(), "masked_lm")
    spec = load_task(_spec(tmp_path, lambda d: d.pop("causal_lm_words")))
    with pytest.raises(ValueError, match=r"Task 'sst2' has no causal_lm_words \(needed by a causal_lm prompt model\)"):
        label_token_ids(spec, wordpiece_tokenizer(), "causal_lm")


@pytest.mark.parametrize("encoding, byte", [("latin-1", r"\\xe9"), ("utf-16", r"\\xff")])
def test_a_file_that_is_not_utf8_is_named(tmp_path, encoding, byte):
    (tmp_path / "train.tsv").write_text("sentence\tlabel\nun café crème\t1\n", encoding=encoding)
    with pytest.raises(ValueError, match=rf"train.tsv is not UTF-8 text \(byte b'{byte}' at offset \d+\); accepted: "
                                         r"UTF-8 files"):
        load_local_split(load_task("sst2"), str(tmp_path), "train")


@pytest.mark.parametrize("partition", ["shards", "dirichlet"])
def test_class_partitions_of_token_level_labels_are_refused_naming_the_partition(tmp_path, partition):
    tokenizer = wordpiece_tokenizer()
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=rf"partition='{partition}' splits the clients' data by class, but the "
                                         r"training set's 'labels' are not one class per example .* Accepted for "
                                         r"such data: partition='iid'"):
        make_trainer(tiny_gpt2(vocab_size=len(tokenizer)), TextDataset(tokenizer, 24, causal=True), tmp_path,
                     collate(tokenizer), partition=partition)

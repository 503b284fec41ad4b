"""Issue 47, the drop-in's last mile: every route to the loss honoured (or refused before any work), Trainer features
that broke or half-applied (hyperparameter search, streaming data, checkpointing, accelerate on CPU), the model card
after load_best_model_at_end, progress bars."""

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    LogisticRegression,
    TextDataset,
    VectorDataset,
    collate,
    make_trainer,
    tiny_bert,
    tiny_gpt2,
    wordpiece_tokenizer,
)
from transformers import DataCollatorForLanguageModeling
from transformers.trainer_utils import HPSearchBackend

from zo_byzantine import ZOByzantineArguments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mean_of(sums, counts) -> float:
    return float(sums.sum() / counts.sum())


class Wrapped(torch.nn.Module):
    """A user's own module around a causal LM: returns the LM's loss (labels shifted inside) and logits."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask=None, labels=None):
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        return {"loss": out.loss, "logits": out.logits}


def _lm_items(tokenizer, n=32):
    """Sentences of different lengths, as a causal-LM dataset (no labels: the collator makes them)."""
    texts = [" ".join(["the movie was"] * (1 + i % 4)) + (" good" if i % 2 else " bad") for i in range(n)]
    return [dict(tokenizer(text)) for text in texts]


def _batch(trainer, items):
    return trainer._prepare_inputs(trainer.data_collator(items))


# ----- 1. a causal LM in the user's own wrapper ------------------------------------------------------


def test_a_causal_lm_in_a_users_wrapper_trains_on_its_own_shifted_loss(tmp_path):
    tokenizer = wordpiece_tokenizer()
    model = Wrapped(tiny_gpt2(vocab_size=tokenizer.vocab_size))
    items = _lm_items(tokenizer)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = make_trainer(model, items, tmp_path, collator, max_steps=2, num_clients=4)
    assert trainer.forward_per_example.shift is True  # found by the model's own loss, not by its class name
    batch = _batch(trainer, items[:12])
    with torch.no_grad():
        own = float(model(**batch)["loss"])
        rounds = mean_of(*trainer.per_example_losses(model, batch))
    assert rounds == pytest.approx(own, rel=1e-5)
    trainer.train()
    assert len(trainer.ledger.rounds) == 2


def test_the_route_is_decided_without_touching_the_random_states(tmp_path):
    """The probe runs a masking collator on the first examples: torch's, numpy's and Python's states stay as they
    were (a run's masks and data order do not depend on whether the route was probed)."""
    import random

    import numpy as np
    from transformers import BertConfig, BertForMaskedLM

    from zo_byzantine.loss_routes import probe_loss_route

    tokenizer = wordpiece_tokenizer()
    model = BertForMaskedLM(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=16, num_hidden_layers=1,
                                       num_attention_heads=2, intermediate_size=32, max_position_embeddings=64))
    trainer = make_trainer(model, _lm_items(tokenizer), tmp_path, DataCollatorForLanguageModeling(tokenizer),
                           max_steps=1)
    assert trainer.forward_per_example.decided and trainer.forward_per_example.shift is False
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    before = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    probe_loss_route(trainer)
    assert torch.equal(torch.get_rng_state(), before[0]) and (np.random.get_state()[1] == before[1]).all()
    assert random.getstate() == before[2]


# ----- 2. compute_loss_func and a model's own loss ----------------------------------------------------


def test_compute_loss_func_is_the_rounds_loss(tmp_path):
    tokenizer = wordpiece_tokenizer()
    calls = []

    def smoothed(outputs, labels, num_items_in_batch=None):
        calls.append(len(labels))
        return F.cross_entropy(outputs["logits"], labels, label_smoothing=0.3)

    model = tiny_bert(vocab_size=tokenizer.vocab_size)
    data = TextDataset(tokenizer, n=48)
    trainer = make_trainer(model, data, tmp_path, collate(tokenizer), max_steps=3,
                           trainer_kwargs={"compute_loss_func": smoothed})
    calls.clear()
    trainer.train()
    assert len(calls) > 3 * 16  # every example of every forward of the 3 rounds
    batch = _batch(trainer, [data[i] for i in range(16)])
    with torch.no_grad():
        outputs = model(**{k: v for k, v in batch.items() if k != "labels"})
        expected = float(smoothed(outputs, batch["labels"]))
        assert mean_of(*trainer.per_example_losses(model, batch)) == pytest.approx(expected, rel=1e-6)


def test_a_token_level_compute_loss_func_is_split_by_its_target_tokens(tmp_path):
    tokenizer = wordpiece_tokenizer()

    def shifted_token_mean(outputs, labels, num_items_in_batch=None):
        logits = outputs.logits[:, :-1]
        return F.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=-100)

    model = tiny_gpt2(vocab_size=tokenizer.vocab_size)
    items = _lm_items(tokenizer)
    trainer = make_trainer(model, items, tmp_path, DataCollatorForLanguageModeling(tokenizer, mlm=False),
                           max_steps=1, trainer_kwargs={"compute_loss_func": shifted_token_mean})
    assert trainer.forward_per_example.weighting == "target tokens shifted by one"
    batch = _batch(trainer, items[5:13])  # another mix of lengths than the probe's
    with torch.no_grad():
        sums, counts = trainer.per_example_losses(model, batch)
        expected = float(shifted_token_mean(model(input_ids=batch["input_ids"]), batch["labels"]))
    # a client of examples 0..3: the function on those examples alone
    with torch.no_grad():
        part = float(shifted_token_mean(model(input_ids=batch["input_ids"][:4]), batch["labels"][:4]))
    assert mean_of(sums, counts) == pytest.approx(expected, rel=1e-5)
    assert mean_of(sums[:4], counts[:4]) == pytest.approx(part, rel=1e-5)


def _class_weighted(logits, labels):
    return F.cross_entropy(logits, labels, weight=torch.tensor([1.0, 3.0]))


def test_losses_that_cannot_be_split_by_client_are_refused_before_any_work(tmp_path):
    class Weighted(LogisticRegression):  # the model's own loss: class-weighted cross-entropy
        def forward(self, x, labels=None):
            out = super().forward(x, labels)
            if labels is not None:
                out["loss"] = _class_weighted(out["logits"], labels)
            return out

    with pytest.raises(ValueError, match=r"model's own loss .* cannot split it by client: .*per_example_losses"):
        make_trainer(Weighted(), VectorDataset(64), tmp_path)
    with pytest.raises(ValueError, match=r"compute_loss_func cannot be split by client: .*per_example_losses"):
        make_trainer(LogisticRegression(), VectorDataset(64), tmp_path, trainer_kwargs={
            "compute_loss_func": lambda outputs, labels, num_items_in_batch=None: _class_weighted(outputs["logits"],
                                                                                                  labels)})


def test_a_models_own_per_example_loss_is_used(tmp_path):
    class PerExample(LogisticRegression):  # logits, and its own per-example loss (weighted by class)
        def forward(self, x, labels=None):
            out = super().forward(x, labels)
            if labels is not None:
                out["loss"] = F.cross_entropy(out["logits"], labels, weight=torch.tensor([1.0, 3.0]),
                                              reduction="none")
            return out

    model, data = PerExample(), VectorDataset(64)
    trainer = make_trainer(model, data, tmp_path, max_steps=2)
    batch = {"x": data.x[:16], "labels": data.y[:16]}
    with torch.no_grad():
        sums, counts = trainer.per_example_losses(model, batch)
        assert torch.equal(sums, model(**batch)["loss"].double()) and torch.equal(counts, torch.ones(16).double())
    trainer.train()


# ----- 3. hyperparameter search -----------------------------------------------------------------------


def _trial(trainer, params):
    trainer.hp_search_backend = HPSearchBackend.OPTUNA  # what hyperparameter_search sets; the trial as optuna's
    trainer.hp_space = lambda trial: trial.params
    trainer._hp_search_setup(SimpleNamespace(params=params))


def test_a_trials_settings_are_validated_and_built_as_the_constructors(tmp_path):
    trainer = make_trainer(LogisticRegression(), VectorDataset(64), tmp_path, num_clients=6, aggregator="cwtm")
    _trial(trainer, {"aggregator": "krum", "num_byzantine": 1, "num_clients": 8})
    assert trainer.aggregator.name == "krum" and trainer.args.aggregator == "krum"
    assert len(trainer.federation.partitions) == 8 and trainer.ledger is None
    small = make_trainer(LogisticRegression(), VectorDataset(64), tmp_path / "small", num_clients=4)
    with pytest.raises(ValueError, match=r"trial .*num_byzantine=2 must satisfy 0 <= b < num_clients/2 = 2.0"):
        _trial(small, {"aggregator": "krum", "num_byzantine": 2})
    from zo_byzantine.aggregators import build_aggregator

    given = make_trainer(LogisticRegression(), VectorDataset(64), tmp_path / "given",
                         trainer_kwargs={"aggregator": build_aggregator("median", [])})
    with pytest.raises(ValueError, match="the trial sets aggregator='krum', but an rule object"):
        _trial(given, {"aggregator": "krum"})


# ----- 4, 11, 12: refused before any work -------------------------------------------------------------


def test_streaming_training_data_is_refused_naming_it(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from VectorDataset(16)

    with pytest.raises(ValueError, match=r"train_dataset is a Stream without a length \(streaming\)"):
        make_trainer(LogisticRegression(), Stream(), tmp_path)


@pytest.mark.parametrize("name", ["gradient_checkpointing", "activation_checkpointing"])
def test_checkpointing_is_refused_as_the_other_replaced_fields(tmp_path, name):
    with pytest.raises(ValueError, match=f"{name}=True is not used by ZOByzantineTrainer: zeroth-order forwards"):
        ZOByzantineArguments(output_dir=str(tmp_path), **{name: True})


def test_an_accelerate_launch_that_started_one_process_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # accelerate's simple launcher, asked for --num_processes 2
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="started one .*torchrun --nproc_per_node N"):
        make_trainer(LogisticRegression(), VectorDataset(64), tmp_path)


def test_a_master_addr_from_the_job_environment_only_warns(tmp_path, monkeypatch, caplog):
    """A one-process ``accelerate launch`` in a job that exports ``MASTER_ADDR`` (a cluster's host name): a warning,
    not a refusal, since accelerate's launcher sets the loopback default only when it was asked for several."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setenv("MASTER_ADDR", "node17.cluster")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with caplog.at_level("WARNING", logger="zo_byzantine.preflight"):
        make_trainer(LogisticRegression(), VectorDataset(64), tmp_path)
    assert "MASTER_ADDR=node17.cluster came with the environment" in caplog.text


@pytest.mark.slow
def test_accelerate_launch_with_two_processes_on_cpu_says_how_to_get_two(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{os.path.join(ROOT, "tests")!r}, {ROOT!r}]
        from helpers import LogisticRegression, VectorDataset, make_trainer
        make_trainer(LogisticRegression(), VectorDataset(64), {str(tmp_path / "out")!r})
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--cpu",
                           "--num_processes", "2", str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0 and "torchrun --nproc_per_node N" in done.stderr


# ----- 8. the model card after load_best_model_at_end -------------------------------------------------


def test_the_model_card_counts_the_rounds_of_the_weights_it_describes(tmp_path):
    import itertools

    tokenizer = wordpiece_tokenizer()
    order = itertools.count()  # every evaluation scores lower than the one before: the best is the first, round 2
    extra = {"eval_dataset": TextDataset(tokenizer, n=16, seed=1), "compute_metrics": lambda _: {"score": -next(order)}}
    trainer = make_trainer(tiny_bert(vocab_size=tokenizer.vocab_size), TextDataset(tokenizer, n=32), tmp_path,
                           collate(tokenizer), trainer_kwargs=extra, max_steps=8, eval_strategy="steps", eval_steps=2,
                           save_strategy="steps", save_steps=2, load_best_model_at_end=True,
                           metric_for_best_model="score", greater_is_better=True)
    trainer.train()
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    trainer.create_model_card()
    card = (tmp_path / "README.md").read_text()
    assert "- rounds: 2 (the best checkpoint's weights; 8 rounds were run)" in card
    assert "- zeroth-order" in card.split("---")[1]  # a tag in the card's metadata


def test_the_card_is_made_true_whatever_the_trainers_wording(tmp_path):
    from zo_byzantine.card import rewrite_card

    path = tmp_path / "README.md"
    path.write_text("---\nlibrary_name: transformers\ntags:\n- generated_from_trainer\n---\n\n# run\n\n"
                    "### Training hyperparameters\n\n- optimizer_name: Use adamw_torch with betas=(0.9,0.999)\n"
                    "- Train batch size: 8\n- total train batch size: 8\n- seed: 42\n")
    args = ZOByzantineArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, num_clients=4)
    rewrite_card(str(path), args, 3, 1, 18, "abc")
    card = path.read_text()
    assert "adamw" not in card and "- optimizer_name: ZOOptimizer" in card and "- seed: 42" in card
    assert "- Train batch size: 8 per client" in card and "- total train batch size: 32 per round" in card
    assert "- generated_from_trainer" in card and "- federated-learning" in card and "- rounds: 3\n" in card


# ----- 9. progress ------------------------------------------------------------------------------------


def test_long_work_shows_progress(tmp_path, capsys):
    from transformers import BertConfig, BertModel

    from zo_byzantine.features import embed

    tokenizer = wordpiece_tokenizer()
    encoder = BertModel(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, intermediate_size=32, max_position_embeddings=64))
    embed(encoder, tokenizer, ["a good film"] * 10, max_length=16, batch=4)
    err = capsys.readouterr().err
    assert "Embedding: 100%" in err and "10/10" in err
    from zo_byzantine.callbacks import HonestLossProgress

    trainer = make_trainer(LogisticRegression(), VectorDataset(64), tmp_path, max_steps=2, disable_tqdm=False)
    bars = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, HonestLossProgress)]
    assert len(bars) == 1
    trainer.train()
    err = capsys.readouterr().err
    assert "rounds: 100%" in err and "honest_loss=" in err
    from helpers import load_example

    fields = load_example("run_mnist_fed").MnistFedArguments.__dataclass_fields__
    assert fields["disable_tqdm"].default is False  # the MNIST job shows its rounds too

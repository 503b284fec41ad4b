"""Every evaluation schedule gives the reference schedule's scalars and weights; half precision is exact."""

import copy

import pytest
import torch
from helpers import (
    TextDataset,
    collate,
    make_trainer,
    tiny_bert,
    tiny_gpt2,
    updated,
    wordpiece_tokenizer,
)

from zo_byzantine.perturbation import COUNTER, ParameterTable, direction_seed


@pytest.fixture(scope="module")
def tokenizer():
    return wordpiece_tokenizer()


def _run(model, tokenizer, tmp_path, causal=False, **kwargs):
    settings = dict(num_clients=3, per_device_train_batch_size=4, num_perturbations=2, max_steps=3,
                    learning_rate=1e-2, logging_steps=3)
    settings.update(kwargs)
    trainer = make_trainer(model, TextDataset(tokenizer, 48, causal=causal), tmp_path, collate(tokenizer), **settings)
    start = COUNTER.drawn
    trainer.train()
    passes = (COUNTER.drawn - start) / (3 * 2 * ParameterTable(model).numel)  # per direction per round
    return trainer, passes


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
@pytest.mark.parametrize("schedule", ["antithetic", "cached", "auto"])
def test_schedules_match_two_forwards(tmp_path, tokenizer, kind, schedule):
    build = tiny_gpt2 if kind == "gpt2" else tiny_bert
    reference_model = build(vocab_size=tokenizer.vocab_size, dropout=0.1)
    model = copy.deepcopy(reference_model)
    causal = kind == "gpt2"
    reference, reference_passes = _run(reference_model, tokenizer, tmp_path / "ref", causal, zo_schedule="two_forwards")
    trainer, passes = _run(model, tokenizer, tmp_path / "new", causal, zo_schedule=schedule)
    got = torch.tensor([r["coefficients"] for r in trainer.ledger.rounds])
    expected = torch.tensor([r["coefficients"] for r in reference.ledger.rounds])
    pairs = list(zip(ParameterTable(model).params, ParameterTable(reference_model).params, strict=True))
    if schedule == "antithetic":  # the doubled batch changes the forwards' blocking: close, not equal
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        for a, b in pairs:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    else:  # the same forwards and the same fused sums from kept directions: bitwise
        assert torch.equal(got, expected)
        assert all(torch.equal(a, b) for a, b in pairs)
    # +mu forward, -mu forward, update; the forwards draw only the embedding rows they read (the whole table where
    # it is tied to an LM head): fewer than 3 passes, more than the rest of the model's
    whole = 1 - _embedding_share(reference_model, tied=causal)
    assert 1 + 2 * whole < reference_passes < 3.0
    if schedule == "antithetic":  # one draw for both forwards, one for the update; round 1 checks with a +mu forward
        assert 1 + 4 / 3 * whole < passes < 7 / 3
    elif schedule == "cached":
        assert passes == 1.0  # one draw, kept for the second forward and the update
    else:  # auto: the counter generator's fused CPU kernel regenerates z more cheaply than it reads it back
        assert trainer.schedule.name == "two_forwards" and passes == reference_passes


def _embedding_share(model, tied: bool) -> float:
    """The share of the trainable values in embedding tables a forward reads by rows (a tied one is read whole)."""
    heads = {id(p) for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()}
    rows = sum(m.weight.numel() for m in model.modules()
               if isinstance(m, torch.nn.Embedding) and not (tied and id(m.weight) in heads))
    return rows / ParameterTable(model).numel


def test_auto_keeps_directions_that_are_not_fused_when_they_fit_the_budget(tmp_path, tokenizer):
    model = tiny_bert(vocab_size=tokenizer.vocab_size)
    d = ParameterTable(model).numel
    budget = 2 * d * 4 / 2**30  # nu = 2 float32 directions fit exactly; a third would not
    runs = {}
    for name, settings in {"fits": {"zo_cache_budget_gb": budget}, "over": {"zo_cache_budget_gb": budget * 0.99},
                           "zero": {"zo_cache_budget_gb": 0}, "fused": {"zo_generator": "counter"}}.items():
        generator = settings.pop("zo_generator", "torch")  # float32 weights: torch's draws take 4 bytes too
        runs[name] = _run(copy.deepcopy(model), tokenizer, tmp_path / name, zo_schedule="auto",
                          zo_generator=generator, **settings)
    # torch's generator draws whole tensors (3 passes); the counter's draws embedding rows only (fewer)
    assert [(runs[k][0].schedule.name, runs[k][1]) for k in runs][:3] == [
        ("cached", 1.0), ("two_forwards", 3.0), ("two_forwards", 3.0)]
    assert runs["fused"][0].schedule.name == "two_forwards" and 1.0 < runs["fused"][1] < 3.0
    assert runs["fits"][0].ledger.rounds == runs["over"][0].ledger.rounds  # the schedule never changes the run


def test_first_order_rounds_decide_no_schedule(tmp_path, tokenizer, caplog):
    """Backprop rounds evaluate no directions: ``auto`` is neither resolved nor logged (it used to report the
    directions' memory of a round that draws none)."""
    caplog.set_level("INFO", logger="zo_byzantine.schedule")
    trainer, passes = _run(tiny_bert(vocab_size=tokenizer.vocab_size), tokenizer, tmp_path, zo_schedule="auto",
                           estimator="first_order", num_perturbations=1)
    assert trainer.state.global_step == 3 and passes == 0
    assert trainer.schedule.name == "auto"
    assert not [r for r in caplog.records if "zo_schedule" in r.getMessage()]


def test_zeroth_order_forwards_run_without_dropout(tmp_path, tokenizer):
    with_dropout = tiny_bert(vocab_size=tokenizer.vocab_size, dropout=0.5)
    without = tiny_bert(vocab_size=tokenizer.vocab_size, dropout=0.0)
    assert all(torch.equal(a, b) for a, b in zip(with_dropout.parameters(), without.parameters(), strict=True))
    a, _ = _run(with_dropout, tokenizer, tmp_path / "a")
    b, _ = _run(without, tokenizer, tmp_path / "b")
    assert [r["coefficients"] for r in a.ledger.rounds] == [r["coefficients"] for r in b.ledger.rounds]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("schedule", ["antithetic", "two_forwards"])
def test_half_precision_round_is_exactly_w_minus_lr_update(tmp_path, tokenizer, dtype, schedule):
    model = tiny_bert(vocab_size=tokenizer.vocab_size).to(dtype)
    start = [p.detach().clone() for p in ParameterTable(model).params]
    # rounded to nearest, as ``updated`` computes it (stochastic rounding, the default, has tests/test_bf16.py)
    trainer, _ = _run(model, tokenizer, tmp_path, zo_schedule=schedule, max_steps=1, num_perturbations=2,
                      update_rounding="nearest")
    entry = trainer.ledger.rounds[0]
    seeds = [direction_seed(*s) for s in entry["seeds"]]
    for j, (p, w) in enumerate(zip(ParameterTable(model).params, start, strict=True)):
        # no +mu/-2mu/+mu drift: the forwards never wrote w
        expected = updated(w, j, list(zip(seeds, entry["coefficients"], strict=True)), entry["lr"])
        assert torch.equal(p.detach(), expected), ParameterTable(model).names[j]


def test_antithetic_forward_restores_the_module_forwards(tokenizer):
    from zo_byzantine.perturbation import antithetic

    model = tiny_bert(vocab_size=tokenizer.vocab_size).eval()
    table = ParameterTable(model)
    ids = torch.tensor([[2, 10, 11, 3], [2, 12, 13, 3]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with antithetic(table, [], direction_seed(0, 0, 1, 0), 1e-3, batch=4):
            doubled = model(input_ids=torch.cat([ids, ids])).logits
        after = model(input_ids=ids).logits
    assert torch.equal(before, after) and not any("forward" in m.__dict__ for m, _ in table.owners)
    assert not torch.equal(doubled[:2], doubled[2:])  # the halves saw w + mu z and w - mu z

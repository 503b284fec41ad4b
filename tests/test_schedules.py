"""Every evaluation schedule gives the reference schedule's scalars and weights; half precision is exact."""

import copy

import pytest
import torch
from helpers import TextDataset, collate, make_trainer, tiny_bert, tiny_gpt2, wordpiece_tokenizer

from zo_byzantine.perturbation import COUNTER, ParameterTable, direction_seed, gaussian_like


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
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    for a, b in zip(ParameterTable(model).params, ParameterTable(reference_model).params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert reference_passes == 3.0  # +mu forward, -mu forward, update
    if schedule == "antithetic":
        assert passes == 2.0  # one draw for both forwards, one for the update
    elif schedule == "cached":
        assert passes == 1.0  # one draw, kept for the second forward and the update
    else:
        assert trainer.schedule.name == "antithetic"


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
    trainer, _ = _run(model, tokenizer, tmp_path, zo_schedule=schedule, max_steps=1, num_perturbations=2)
    entry = trainer.ledger.rounds[0]
    seeds = [direction_seed(*s) for s in entry["seeds"]]
    for j, (p, w) in enumerate(zip(ParameterTable(model).params, start, strict=True)):
        update = gaussian_like(w, seeds[0], j).mul_(entry["coefficients"][0])
        update.add_(gaussian_like(w, seeds[1], j), alpha=entry["coefficients"][1])
        expected = w.add(update, alpha=-entry["lr"])  # no +mu/-2mu/+mu drift: the forwards never wrote w
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

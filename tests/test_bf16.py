"""Updates into bfloat16 / float16 weights (issue 49 item 3): seeded stochastic rounding is unbiased, the same bits for
the same seeds (a ledger replays a bf16 run bitwise), float32 runs unchanged, and rounding to nearest warns when a
step rounds away."""

import copy
import logging

import pytest
import torch
from helpers import TextDataset, collate, make_trainer, wordpiece_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

import zo_byzantine.rounding as rounding
from zo_byzantine import replay
from zo_byzantine.directions import direction_seed
from zo_byzantine.optim import ZOOptimizer
from zo_byzantine.perturbation import ParameterTable, apply_update, rounded_away
from zo_byzantine.rounding import rounding_key, stochastic_round


def _neighbours(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The values of ``dtype`` just below and just above each ``x`` (equal where ``x`` is one), in float64, found by
    ``nextafter`` in ``dtype`` (another route than the rounding's bit arithmetic)."""
    near = x.to(dtype)
    above = near.double() > x.double()
    step = torch.where(above, -torch.inf, torch.inf).to(dtype)
    other = torch.nextafter(near, step)
    exact = near.double() == x.double()
    lo = torch.where(above, other, near).double()
    hi = torch.where(above | exact, near, other).double()
    return lo, hi


def _values(dtype: torch.dtype, n: int = 512) -> torch.Tensor:
    torch.manual_seed(0)
    top = 4.0 if dtype == torch.bfloat16 else 4.5  # float16 ends at 65504
    x = torch.randn(n) * torch.logspace(-7, top, n)
    x[:4] = torch.tensor([0.0, 1.0, -3.0, 0.15625])  # representable: kept as they are
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_is_one_of_the_two_neighbours_and_unbiased(dtype):
    x = _values(dtype)
    lo, hi = _neighbours(x, dtype)
    draws = torch.stack([stochastic_round(x, dtype, key).double() for key in range(1, 2001)])
    assert ((draws == lo) | (draws == hi)).all()
    assert torch.equal(draws[:, :4], x[:4].double().expand(len(draws), 4))
    gap = (hi - lo)[4:]
    p = (x.double()[4:] - lo[4:]) / gap  # the probability of rounding up, in float64
    up = (draws[:, 4:] == hi[4:]).double().mean(dim=0)
    # a Bernoulli(p) mean over 2000 draws: within 5 standard deviations (+ 1/2000 for p near 0 or 1)
    assert ((up - p).abs() <= 5 * (p * (1 - p) / len(draws)).sqrt() + 1 / len(draws)).all()
    mean_error = (draws.mean(dim=0)[4:] - x.double()[4:]) / gap  # in units of the local spacing
    assert mean_error.abs().max() < 0.06
    nearest_error = (x.to(dtype).double()[4:] - x.double()[4:]) / gap
    assert nearest_error.abs().mean() > 0.15  # what rounding to nearest leaves, for contrast


def test_the_same_key_gives_the_same_bits_whatever_the_chunking(monkeypatch):
    x = torch.randn(10_001) * 1e-2
    first = stochastic_round(x, torch.bfloat16, 77)
    assert torch.equal(first.view(torch.int16), stochastic_round(x, torch.bfloat16, 77).view(torch.int16))
    assert not torch.equal(first, stochastic_round(x, torch.bfloat16, 78))
    monkeypatch.setattr(rounding, "CHUNK", 1 << 10)  # an element's bits depend on its position only
    assert torch.equal(first.view(torch.int16), stochastic_round(x, torch.bfloat16, 77).view(torch.int16))
    strided = torch.empty(10_001, 2, dtype=torch.bfloat16)[:, 0]  # a non-contiguous target
    rounding.stochastic_round_(strided, x, 77)
    assert torch.equal(strided.contiguous().view(torch.int16), first.view(torch.int16))


def test_the_rounding_bits_are_the_counter_words_16_bits_at_a_time():
    from zo_byzantine.counter import mix

    key, start = 0x1234_5678_9ABC, 4096
    bits = rounding.uniform_bits(key, start, 1001, "cpu")
    for k in (0, 1, 2, 3, 4, 517, 1000):
        word = int(mix(key, torch.tensor([(start + k) // 4]))) % 2**64  # as an unsigned 64-bit integer
        assert int(bits[k]) == (word >> (16 * ((start + k) % 4))) & 0xFFFF


def test_the_rounding_key_is_the_update_s_seeds_and_salt():
    terms = [(direction_seed(0, 1, 0, 0), 2.0), (direction_seed(0, 1, 0, 1), -1.0)]
    assert rounding_key(terms) == rounding_key([(s, 5.0) for s, _ in terms])  # seeds, not coefficients
    assert rounding_key(terms) != rounding_key(terms[:1])
    assert rounding_key(terms) != rounding_key(terms, salt=1)
    assert rounding_key([]) != rounding_key([], salt=1)
    assert 0 <= rounding_key(terms) < 2**63


class Linear(torch.nn.Module):
    def __init__(self, dtype, n=4096):
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter((torch.randn(n) * 0.05).to(dtype))
        self.bias = torch.nn.Parameter(torch.zeros(3, dtype=dtype))


def _updates(steps: int, t0: int = 0):
    return [[(direction_seed(3, t, 0, 0), 1.5), (direction_seed(3, t, 0, 1), -0.7)] for t in range(t0, t0 + steps)]


def test_float32_weights_are_written_as_before_under_either_rounding():
    models = {r: Linear(torch.float32) for r in ("stochastic", "nearest")}
    reference = Linear(torch.float32)
    table = ParameterTable(reference)
    for terms in _updates(5):
        for r, model in models.items():
            apply_update(ParameterTable(model), terms, 1e-3, {0: 0.1}, rounding=r)
        with torch.no_grad():  # the update as written before stochastic rounding existed, by hand
            for j, p in table:
                p.mul_(1 - 1e-3 * 0.1) if j == 0 else None
                table.directions.step_(p, j, terms, 1e-3)
    for model in models.values():
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_small_steps_accumulate_in_low_precision_as_in_float32(dtype):
    """300 steps of lr 1e-5 (float16: 1.25e-6) along one direction (new rounding bits each step: ``salt``), each ~3 %
    of the spacing of the weights: stochastic rounding follows the float32 trajectory without drift; rounding to
    nearest leaves nearly every weight where it was."""
    exact, stochastic, nearest = Linear(torch.float32), Linear(dtype), Linear(dtype)
    exact.weight.data.copy_(stochastic.weight.float())
    start = nearest.weight.detach().clone()
    terms = [(direction_seed(3, 0, 0, 0), 1.0)]
    lr = 1e-5 * torch.finfo(dtype).eps / torch.finfo(torch.bfloat16).eps  # float16: 8 times finer
    assert rounded_away(ParameterTable(nearest), terms, lr)[dtype] > 0.9
    for t in range(300):
        apply_update(ParameterTable(exact), terms, lr, salt=t)
        apply_update(ParameterTable(stochastic), terms, lr, salt=t)
        apply_update(ParameterTable(nearest), terms, lr, rounding="nearest", salt=t)
    moved = exact.weight.detach().double() - start.double()
    spacing = start.double().abs() * torch.finfo(dtype).eps
    error = stochastic.weight.detach().double() - exact.weight.detach().double()
    assert (moved.abs() > 5 * spacing).float().mean() > 0.5  # the float32 weights moved by many spacings
    assert error.abs().mean() < 0.5 * moved.abs().mean()  # a martingale of ~3 spacings after 300 steps
    assert abs(float((error * moved.sign()).mean())) < 0.05 * float(moved.abs().mean())  # no drift: unbiased
    assert (nearest.weight == start).float().mean() > 0.9


def test_an_unknown_rounding_is_refused_naming_the_setting_and_the_accepted_values(tmp_path):
    with pytest.raises(ValueError, match=r"update_rounding='up' is not supported; accepted: stochastic, nearest"):
        apply_update(ParameterTable(Linear(torch.bfloat16)), _updates(1)[0], 1e-3, rounding="up")
    model = Linear(torch.bfloat16)
    with pytest.raises(ValueError, match=r"update_rounding='up'.*accepted: stochastic, nearest"):
        ZOOptimizer(ParameterTable(model), [{"params": list(model.parameters())}], lr=1e-3, rounding="up")
    from zo_byzantine import ZOByzantineArguments

    with pytest.raises(ValueError, match=r"update_rounding='up'.*accepted: stochastic, nearest"):
        ZOByzantineArguments(output_dir=str(tmp_path), update_rounding="up", report_to=[])


@pytest.mark.parametrize("server", ["sgd", "amsgrad"])
def test_the_optimizer_rounds_stochastically_by_default_and_moves_bf16_weights(server):
    model = Linear(torch.bfloat16)
    start = model.weight.detach().clone()
    opt = ZOOptimizer(ParameterTable(model), [{"params": list(model.parameters())}], lr=1e-5, server=server)
    assert opt.rounding == "stochastic"
    for terms in _updates(3):
        opt.stage(terms)
        opt.step()
    assert (model.weight != start).float().mean() > 0.01


def _tiny_llama(dtype):
    torch.manual_seed(0)
    tokenizer = wordpiece_tokenizer()
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config).to(dtype), tokenizer


def test_a_bf16_run_replays_bitwise_from_its_ledger_and_differs_from_nearest(tmp_path):
    model, tokenizer = _tiny_llama(torch.bfloat16)
    start = copy.deepcopy(model)
    nearest = copy.deepcopy(model)
    dataset = TextDataset(tokenizer, n=64, causal=True)
    settings = dict(max_steps=4, learning_rate=1e-4, lr_scheduler_type="constant", num_perturbations=2,
                    weight_decay=0.01)
    trainer = make_trainer(model, dataset, tmp_path / "sr", collate(tokenizer), **settings)
    trainer.train()
    path = trainer.ledger.save(str(tmp_path / "sr"))
    moved = [(a != b).float().mean().item() for a, b in zip(model.parameters(), start.parameters(), strict=True)]
    assert sum(moved) / len(moved) > 0.05  # rounded to nearest, lr 1e-4 moves ~1 % of bf16 weights per round
    replayed = replay(copy.deepcopy(start), path)
    for a, b in zip(replayed.parameters(), model.parameters(), strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16))
    other = make_trainer(nearest, dataset, tmp_path / "nearest", collate(tokenizer), update_rounding="nearest",
                         **settings)
    other.train()
    assert other.ledger.rounds[0]["coefficients"] == trainer.ledger.rounds[0]["coefficients"]  # same first round
    assert not all(torch.equal(a, b) for a, b in zip(nearest.parameters(), model.parameters(), strict=True))
    # the ledger records a rounding that is not the default, and its replay rounds the same way
    assert "rounding" not in trainer.ledger.server and other.ledger.server["rounding"] == "nearest"
    replayed = replay(copy.deepcopy(start), other.ledger.save(str(tmp_path / "nearest")))
    for a, b in zip(replayed.parameters(), nearest.parameters(), strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_rounding_to_nearest_warns_once_when_the_step_rounds_away(tmp_path, caplog):
    model, tokenizer = _tiny_llama(torch.bfloat16)
    dataset = TextDataset(tokenizer, n=32, causal=True)
    with caplog.at_level(logging.WARNING, logger="zo_byzantine.optim"):
        make_trainer(model, dataset, tmp_path / "a", collate(tokenizer), max_steps=3, learning_rate=1e-7,
                     update_rounding="nearest").train()
    warnings = [r.getMessage() for r in caplog.records if "rounds away" in r.getMessage()]
    assert len(warnings) == 1
    assert "learning_rate=1e-07" in warnings[0] and "torch.bfloat16" in warnings[0]
    assert "update_rounding='stochastic'" in warnings[0]
    caplog.clear()
    for rounding_, lr in (("stochastic", 1e-7), ("nearest", 1.0)):  # stochastic rounding on; a step that shows
        model, _ = _tiny_llama(torch.bfloat16)
        with caplog.at_level(logging.WARNING, logger="zo_byzantine.optim"):
            make_trainer(model, dataset, tmp_path / rounding_, collate(tokenizer), max_steps=2, learning_rate=lr,
                         update_rounding=rounding_).train()
        assert not [r for r in caplog.records if "rounds away" in r.getMessage()]


def test_an_offloaded_bf16_model_is_updated_where_it_lives_with_the_same_bits(tmp_path):
    """The streamed homes (store file, CPU memory) get the same stochastically rounded weights as a model in memory,
    and the store file holds them."""
    import os

    from test_offload import PARTIAL, save_llama
    from transformers import AutoModelForCausalLM

    folder = save_llama(tmp_path / "llama")
    memory = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    offloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map=PARTIAL,
                                                     offload_folder=str(tmp_path / "offload"))
    table_m, table_o = ParameterTable(memory), ParameterTable(offloaded)
    stream = table_o.stream
    streamed = [j for j, p in table_o if stream.holds(p)]
    assert streamed
    start = [p.detach().clone() for p in table_o.params]
    for terms in _updates(3):
        apply_update(table_m, terms, 1e-4, {streamed[0]: 0.1})
        apply_update(table_o, terms, 1e-4, {streamed[0]: 0.1})
    for j in range(len(table_m)):
        assert torch.equal(table_m.params[j].view(torch.int16), table_o.params[j].view(torch.int16)), table_m.names[j]
    j = streamed[-1]
    assert not torch.equal(table_o.params[j], start[j])
    entry = stream.entries[id(table_o.params[j])]
    raw = torch.frombuffer(bytearray(os.pread(stream.fd, entry.nbytes, entry.offset)), dtype=torch.bfloat16)
    assert torch.equal(raw.view_as(table_m.params[j]).view(torch.int16), table_m.params[j].view(torch.int16))


def test_a_ledger_with_an_unknown_rounding_is_refused_naming_the_field(tmp_path):
    import json

    from zo_byzantine.ledger import Ledger, LedgerError

    model, tokenizer = _tiny_llama(torch.bfloat16)
    trainer = make_trainer(model, TextDataset(tokenizer, n=16, causal=True), tmp_path, collate(tokenizer),
                           max_steps=1, update_rounding="nearest")
    trainer.train()
    data = json.loads(open(trainer.ledger.save(str(tmp_path))).read())
    data["server"]["rounding"] = "up"
    with pytest.raises(LedgerError, match=r"server\.rounding"):
        Ledger.loads(json.dumps(data))


def test_a_flower_node_s_replica_rounds_as_the_run_config_says(tmp_path):
    from zo_byzantine import ZOByzantineArguments
    from zo_byzantine.flower.config import NODE_SETTINGS
    from zo_byzantine.flower.replica import Replica

    assert "update_rounding" in NODE_SETTINGS  # kept per node and checked against the run config
    model, _ = _tiny_llama(torch.bfloat16)
    for mode in ("stochastic", "nearest"):
        args = ZOByzantineArguments(output_dir=str(tmp_path), update_rounding=mode, report_to=[])
        assert Replica(model, args).optimizer.rounding == mode


@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
@pytest.mark.parametrize(("numel", "terms", "decay"), [
    (1_000_003, 2, 0.0),  # odd, over the kernel's threading threshold: several pair ranges
    (1_001, 1, 0.1),  # weight decay folded in before the sum
    (777, 0, 50.0),  # decay alone (lr decay 5e-4): no sum added (x + 0 would turn -0 into +0)
])
def test_the_compiled_rounded_step_writes_the_bits_of_the_plain_update_and_rounding(distribution, numel, terms, decay):
    """``CounterDirections.step_rounded_`` (one pass of the kernel) against the obvious path it replaces: the float32
    update (``_exact_update``) then ``rounding.stochastic_round_`` with the same key; bitwise, zeros and both signs
    included."""
    from zo_byzantine import native
    from zo_byzantine.directions import CounterDirections
    from zo_byzantine.perturbation import _exact_update

    if native.library() is None:
        pytest.skip("no C compiler here: the kernel path is not taken")
    directions = CounterDirections(distribution)
    gen = torch.Generator().manual_seed(numel)
    weights = (torch.randn(numel, generator=gen) * 0.05).to(torch.bfloat16)
    weights[:8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, 1e-3, -1e-3])
    seeds = [(direction_seed(7, 3, 0, r), c) for r, c in zip(range(terms), (4.0, -9.5), strict=False)]
    key, lr = rounding.tensor_key(rounding_key(seeds, salt=3), 5), 1e-5
    assert directions.rounds_fused(weights, None)
    expected = weights.clone()
    rounding.stochastic_round_(expected, _exact_update(directions, expected, 5, seeds, lr, decay, None), key)
    got = weights.clone()
    directions.step_rounded_(got, 5, seeds, lr, decay, key)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    assert not torch.equal(got, weights)  # it moved


def test_apply_update_writes_the_same_bits_through_the_compiled_rounding_as_through_the_plain_one(monkeypatch):
    """``apply_update`` on a bfloat16 model (two terms, weight decay on some tensors) takes the kernel's fused rounding;
    forced onto the plain path (float32 update, then ``rounding.py``) it writes the same bits into every weight."""
    from zo_byzantine import native
    from zo_byzantine.directions import CounterDirections

    if native.library() is None:
        pytest.skip("no C compiler here: the kernel path is not taken")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).to(torch.bfloat16)
    other, start = copy.deepcopy(model), copy.deepcopy(model)
    terms = [(direction_seed(1, 4, 0, 0), 30.0), (direction_seed(1, 4, 0, 1), -12.5)]
    decay = {0: 0.1, 3: 0.01}
    table = ParameterTable(model)
    assert all(table.directions.rounds_fused(p, None) for p in table.params)
    apply_update(table, terms, 1e-5, weight_decay=decay)
    monkeypatch.setattr(CounterDirections, "rounds_fused", lambda self, param, cache: False)
    apply_update(ParameterTable(other), terms, 1e-5, weight_decay=decay)
    pairs = list(zip(model.parameters(), other.parameters(), strict=True))
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in pairs)
    assert sum(int((a != b).sum()) for a, b in zip(model.parameters(), start.parameters(), strict=True)) > 1000

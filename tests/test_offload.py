"""Rounds over offloaded, streamed weights (``zo_byzantine.offload``): a model dispatched by accelerate with disk
offload trains to the in-memory run's ledger and weights, bitwise; perturbed forwards see ``w + sum c z`` and never
write it back; the update lands once in the store; replay, refusals, read-ahead, the budget, a Flower node."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import make_trainer
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from zo_byzantine import replay
from zo_byzantine.directions import build_directions
from zo_byzantine.offload import check_offload_settings, stream_of, stream_weights
from zo_byzantine.perturbation import ParameterTable, apply_update, perturbed

VOCAB, LENGTH = 96, 12
PARTIAL = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
           "model.norm": "disk", "lm_head": "cpu"}


def save_llama(folder, tie: bool = True, seed: int = 0) -> str:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                         max_position_embeddings=64)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("llama") / "tied")


def load(folder, device_map=None, offload_folder=None):
    if device_map is None:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map=device_map,
                                                offload_folder=str(offload_folder))


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, seed: int = 0):
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(LENGTH, dtype=torch.long),
                "labels": self.ids[i]}


def train(model, out, **kwargs):
    settings = dict(max_steps=3, num_clients=2, per_device_train_batch_size=2)
    settings.update(kwargs)
    trainer = make_trainer(model, Tokens(), out, **settings)
    trainer.train()
    return trainer


def bits(trainer) -> dict:
    return {n: p.detach().clone().view(torch.int32) for n, p in zip(trainer.table.names, trainer.table.params,
                                                                     strict=True)}


@pytest.mark.parametrize("device_map, settings", [
    ({"": "disk"}, {}),
    (PARTIAL, {"num_perturbations": 2, "weight_decay": 0.1, "zo_forward_batch_size": 2}),
])
def test_offloaded_run_writes_the_in_memory_ledger_and_weights(tmp_path, llama, device_map, settings):
    reference = train(load(llama), tmp_path / "memory", **settings)
    model = load(llama, device_map, tmp_path / "offload")
    offloaded = train(model, tmp_path / "disk", **settings)
    stream = stream_of(model, attach=False)
    assert stream is not None and stream.stored_bytes > 0 and offloaded.table.stream is stream
    assert offloaded.ledger.to_dict() == reference.ledger.to_dict()
    expected, got = bits(reference), bits(offloaded)
    assert expected.keys() == got.keys() and all(torch.equal(expected[n], got[n]) for n in expected)
    # tied embeddings stay one tensor (the trainer's probe forward ran accelerate's hooks, which untie them)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not os.listdir(tmp_path / "offload") or all(not f.startswith("zo_byzantine-weights-")
                                                        for f in os.listdir(tmp_path / "offload"))


@pytest.mark.slow
@pytest.mark.parametrize("settings", [
    {"estimator": "one_point"}, {"zo_schedule": "cached"}, {"zo_generator": "torch"}, {"directions": "per_client"},
    {"local_steps": 2, "zo_cache_budget_gb": 0.0}, {"local_steps": 2, "local_update": "compressed",
                                                    "zo_cache_budget_gb": 0.0},
])
def test_offloaded_run_equals_in_memory_run_across_settings(tmp_path, llama, settings):
    reference = train(load(llama), tmp_path / "memory", **settings)
    offloaded = train(load(llama, {"": "disk"}, tmp_path / "offload"), tmp_path / "disk", **settings)
    assert offloaded.ledger.to_dict() == reference.ledger.to_dict()
    expected, got = bits(reference), bits(offloaded)
    assert all(torch.equal(expected[n], got[n]) for n in expected)


def test_perturbed_forward_sees_w_plus_cz_after_loading_and_never_writes_back(tmp_path, llama):
    memory, offloaded = load(llama), load(llama, {"": "disk"}, tmp_path)
    table_m, table_o = ParameterTable(memory), ParameterTable(offloaded)
    assert table_o.stream is not None and table_m.names == table_o.names
    start = [p.detach().clone() for p in table_o.params]
    terms = [(123, 1e-3), (456, -2e-3)]
    seen = {}
    q_proj = offloaded.model.layers[1].self_attn.q_proj

    def capture(module, args):  # the weight the module computes with, once loaded and perturbed
        seen.setdefault("w", module.weight.detach().clone())

    batch = {"input_ids": Tokens()[0]["input_ids"][None], "labels": Tokens()[0]["labels"][None]}
    with torch.no_grad():
        with perturbed(table_m, terms):
            expected = memory(**batch).loss
        with perturbed(table_o, terms):
            handle = q_proj.register_forward_pre_hook(capture)  # after the stream's and the perturbation's
            got = offloaded(**batch).loss
            handle.remove()
    assert torch.equal(expected, got)
    index = table_o.names.index("model.layers.1.self_attn.q_proj.weight")
    directions = build_directions()
    assert torch.equal(seen["w"], directions.perturb(start[index], index, terms))  # w + sum c z, inside the module
    # the homes (the store file's mapping) never saw a perturbed value
    assert all(torch.equal(a, b) for a, b in zip(start, table_o.params, strict=True))
    entry = table_o.stream.entries[id(table_o.params[index])]
    raw = os.pread(table_o.stream.fd, entry.nbytes, entry.offset)
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32).view_as(start[index]), start[index])


def test_the_update_lands_once_where_each_weight_lives(tmp_path, llama):
    memory, offloaded = load(llama), load(llama, PARTIAL, tmp_path)
    table_m, table_o = ParameterTable(memory), ParameterTable(offloaded)
    stream = table_o.stream
    streamed = [j for j, p in table_o if stream.holds(p)]
    assert streamed and len(streamed) < len(table_o)  # some weights in the store file, some resident
    terms, decay = [(7, 0.5), (8, -0.25)], {0: 0.1, streamed[0]: 0.1}
    with torch.no_grad():
        apply_update(table_m, terms, 1e-2, decay)
        apply_update(table_o, terms, 1e-2, decay)
    for j in range(len(table_m)):
        assert torch.equal(table_m.params[j], table_o.params[j]), table_m.names[j]
    j = streamed[-1]  # and in the file itself, not only in this process's view of it
    entry = stream.entries[id(table_o.params[j])]
    raw = torch.frombuffer(bytearray(os.pread(stream.fd, entry.nbytes, entry.offset)), dtype=torch.float32)
    assert torch.equal(raw.view_as(table_m.params[j]), table_m.params[j])


def test_replay_onto_an_offloaded_model_gives_the_trained_weights(tmp_path, llama):
    trained = train(load(llama), tmp_path / "run")
    model = load(llama, {"": "disk"}, tmp_path / "offload")
    replay(model, trained.ledger)
    table = ParameterTable(model)
    assert all(torch.equal(a, b) for a, b in zip(trained.table.params, table.params, strict=True))


@pytest.mark.parametrize("setting, value", [
    ("estimator", "first_order"), ("estimator", "gradient_projection"), ("aggregation_space", "parameter"),
    ("server_optimizer", "amsgrad"), ("zo_schedule", "antithetic"),
])
def test_settings_offload_cannot_run_are_refused_before_any_work(tmp_path, llama, setting, value):
    model = load(llama, {"": "disk"}, tmp_path / "offload")
    extra = {"num_byzantine": 0, "local_steps": 1}
    with pytest.raises(ValueError, match=f"{setting}='{value}'"):
        make_trainer(model, Tokens(), tmp_path, **extra, **{setting: value})
    assert stream_of(model, attach=False) is None  # refused before the stream copied anything


def test_cached_directions_larger_than_the_budget_are_refused(tmp_path, llama):
    model = load(llama, {"": "disk"}, tmp_path / "offload")
    with pytest.raises(ValueError, match="zo_schedule='cached'.*zo_cache_budget_gb=1e-06"):
        make_trainer(model, Tokens(), tmp_path, zo_schedule="cached", zo_cache_budget_gb=1e-6)
    resident = make_trainer(load(llama), Tokens(), tmp_path, zo_schedule="cached", zo_cache_budget_gb=1e-6)
    check_offload_settings(resident.args, resident.model)  # a resident model: nothing to refuse


@pytest.mark.parametrize("read_thread", [True, False])
def test_read_ahead_loads_the_next_modules_while_one_computes(tmp_path, llama, monkeypatch, read_thread):
    import threading

    from zo_byzantine import offload

    model = load(llama, {"": "disk"}, tmp_path)
    stream = stream_weights(model, window_bytes=1 << 20, read_thread=read_thread)
    reads, advised = [], []
    original = stream._read

    def spy(unit):
        reads.append(threading.current_thread().name.startswith("zo-weight-stream"))
        return original(unit)

    def advise(fd, offset, length, advice):
        advised.append(offset)

    monkeypatch.setattr(stream, "_read", spy)
    monkeypatch.setattr(offload.os, "posix_fadvise", advise)
    ids = Tokens()[0]["input_ids"][None]
    with torch.no_grad():
        model(ids)  # learns the order the modules run in
        reads.clear()
        advised.clear()
        model(ids)
    assert len(reads) == len(stream.units) and not stream._ahead  # nothing left in flight after the forward
    if read_thread:  # the thread made every copy but the first module's
        assert sum(reads) == len(reads) - 1 and not advised
    else:  # the kernel was asked for every module's pages but the first's; the copies made as each one starts
        assert not any(reads) and len(advised) == sum(len(u.entries) for u in stream.units[1:])
    plain = load(llama, {"": "disk"}, tmp_path / "plain")
    quiet = stream_weights(plain, window_bytes=0, read_thread=True)
    monkeypatch.setattr(quiet, "_read", spy)
    reads.clear()
    advised.clear()
    with torch.no_grad():
        plain(ids)
    assert reads and not any(reads) and not advised  # window 0: each module's weights read when it starts


def test_a_budget_streams_modules_accelerate_left_resident(tmp_path, llama):
    placed = load(llama, PARTIAL, tmp_path / "a")
    kept = stream_weights(placed)
    assert any(p.device.type == "cpu" and not kept.holds(p) for p in placed.parameters())
    small = load(llama, PARTIAL, tmp_path / "b")
    stream = stream_weights(small, budget_bytes=0)
    assert all(stream.holds(p) for p in small.parameters())  # nothing fits: everything streamed
    assert small.lm_head.weight is small.model.embed_tokens.weight
    memory = load(llama)
    batch = {"input_ids": Tokens()[1]["input_ids"][None], "labels": Tokens()[1]["labels"][None]}
    with torch.no_grad():
        assert torch.equal(memory(**batch).loss, small(**batch).loss)


def test_schedule_auto_is_two_forwards_without_local_models_when_streamed(tmp_path, llama):
    from zo_byzantine.schedule import Schedule

    table = ParameterTable(load(llama, {"": "disk"}, tmp_path))
    schedule = Schedule("auto", cache_budget_gb=10.0)
    assert schedule.resolve(table, 4, chunks=3) == "two_forwards"
    assert schedule.stack is False and schedule.stack_clients is False
    assert not schedule.keeps_local_models(table, 4)


def offloaded_task(config: dict):
    """A Flower task (``task = "test_offload:offloaded_task"``): a tiny Llama from ``task-model``, offloaded to
    disk when ``task-offload`` is true."""
    from zo_byzantine.flower import Task

    folder = str(config["task-model"])
    if config.get("task-offload"):
        import tempfile

        model = load(folder, {"": "disk"}, tempfile.mkdtemp(prefix="zo-offload-test-"))
    else:
        model = load(folder)
    return Task(model=model, train_dataset=[Tokens()[i] for i in range(24)])


@pytest.mark.slow
def test_a_flower_node_trains_an_offloaded_model_to_the_same_ledger(tmp_path, llama):
    pytest.importorskip("flwr")
    from flower_helpers import LoopbackGrid, coordinator, node_weights, nodes, run_config

    results = []
    for offload in (False, True):
        config = run_config(task="test_offload:offloaded_task", rounds=2, num_clients=2, clients_per_round=2,
                            num_byzantine=0, aggregator="mean", per_device_train_batch_size=2, num_perturbations=1,
                            learning_rate=1e-2, **{"min-nodes": 2, "task-model": llama, "task-offload": offload})
        config.pop("task-examples", None)
        grid = LoopbackGrid(config, nodes(2))
        coord = coordinator(config, grid)
        coord.register(grid)
        for t in range(2):
            assert coord.round(grid, t)["accepted"] == [0, 1]
        results.append((coord.ledger.to_dict()["rounds"], node_weights(grid, 100)))
    (rounds_m, weights_m), (rounds_o, weights_o) = results
    assert rounds_m == rounds_o
    assert all(torch.equal(a, b) for a, b in zip(weights_m, weights_o, strict=True))

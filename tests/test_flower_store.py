"""A node's state between Flower messages (#43): a ClientApp imports what a node needs only, its weights live in the
node's store (not in ``Context.state``: what SuperNode and ClientApp exchange does not grow with the model), and
its checked settings and partition are computed once per node and run."""

import json
import os
import subprocess
import sys

import pytest
import torch
from flower_helpers import ROOT, LoopbackGrid, coordinator, node_weights, nodes, replayed_weights, run_config

pytest.importorskip("flwr")
from flwr.app import Context  # noqa: E402
from flwr.common.serde import context_to_proto  # noqa: E402

from zo_byzantine.flower.config import node_deployment, read_node_config, read_run_config  # noqa: E402
from zo_byzantine.flower.store import NodeStore, store_root  # noqa: E402

HEAVY = ("transformers", "peft", "datasets", "sklearn", "pandas", "scipy", "evaluate", "sympy")  # sympy last


def _python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "examples", "flower")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_a_clientapp_imports_no_trainer_datasets_or_peft():
    """What Flower's ClientApp process imports (the example app's client_app and task modules, the node's modules):
    none of transformers, peft, datasets, scikit-learn, pandas, scipy. ``import zo_byzantine`` alone imports none of
    the library's modules."""
    loaded = json.loads(_python(
        "import sys, json, zo_byzantine\n"
        "bare = sorted(m for m in sys.modules if m.startswith('zo_byzantine.'))\n"
        "import zo_flower_app.client_app, zo_flower_app.task, zo_byzantine.flower.node, zo_byzantine.flower.store\n"
        f"print(json.dumps([bare, [m for m in {HEAVY!r} if m in sys.modules]]))"))
    assert loaded == [[], []]


def test_a_vectors_node_answers_a_plan_without_importing_transformers(tmp_path):
    """A node's later message (settings in its store) on the example's ``vectors`` task: a fresh process answers the
    plan, and neither transformers nor anything heavier was imported (sympy is: torch imports it with
    ``torch._dynamo``, on the first ``torch.optim`` optimizer built); the task's collator is transformers' default
    collator's result on its items."""
    from transformers import default_data_collator
    from zo_flower_app.task import stack, vectors

    from zo_byzantine.flower import plan_content

    items = vectors({})
    items = [items.train_dataset[i] for i in range(5)]
    ours, theirs = stack(items), default_data_collator(items)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    config = run_config()
    coord = coordinator(config)
    plan = coord.server.plan(0, coord.sampler.participants(0), 0.05)
    content = plan_content(plan, 0, [], coord.replica.start, coord.replica.fingerprint())
    node_deployment(config, NodeStore(str(tmp_path)))  # the node's first message checked the run config
    code = ("import json, sys\nfrom flwr.app import ConfigRecord, RecordDict\n"
            "from zo_byzantine.flower.apps import client_app\n"
            "from zo_byzantine.flower.config import build_task, node_deployment, read_node_config\n"
            "from zo_byzantine.flower.node import answer\nfrom zo_byzantine.flower.replica import Replica\n"
            "from zo_byzantine.flower.store import NodeStore\n"
            f"config, plan = json.loads({json.dumps(json.dumps([config, dict(content['plan'])]))})\n"
            f"store = NodeStore({str(tmp_path)!r})\ndeployment = node_deployment(config, store)\n"
            "node = read_node_config({'partition-id': 0, 'num-partitions': 3}, 3)\n"
            "task = build_task(deployment, config)\n"
            "reply = answer(RecordDict({'plan': ConfigRecord(plan)}), RecordDict(), deployment, task, node, store,\n"
            "               Replica(task.model, deployment.args))\n"
            f"print(json.dumps([reply['report']['client'], [m for m in {HEAVY[:-1]!r} if m in sys.modules]]))")
    assert json.loads(_python(code)) == [0, []]


def test_a_node_checks_the_run_config_once_and_reads_its_settings_back_without_transformers(tmp_path):
    config = run_config()
    store = NodeStore(str(tmp_path))
    first = node_deployment(config, store)  # checked by ZOByzantineArguments, kept
    args = read_run_config(config).args
    assert vars(first.args) == {k: getattr(args, k) for k in vars(first.args)}
    code = (f"import sys, json\nsys.path.insert(0, {os.path.join(ROOT, 'tests')!r})\n"
            "from zo_byzantine.flower.config import node_deployment\nfrom zo_byzantine.flower.store import NodeStore\n"
            f"d = node_deployment(json.loads({json.dumps(json.dumps(config))}), NodeStore({str(tmp_path)!r}))\n"
            "print(json.dumps([vars(d.args), d.task, 'transformers' in sys.modules]))")
    kept_args, task, imported = json.loads(_python(code))
    assert kept_args == vars(first.args) and task == first.task and not imported
    # another run config is checked again (same errors as the server's check)
    with pytest.raises(ValueError, match="run config 'rounds'=0 must be an integer >= 1"):
        node_deployment({**config, "rounds": 0}, store)


def test_settings_and_partition_are_computed_once_per_node(monkeypatch):
    import zo_byzantine.flower.config as config_module
    import zo_byzantine.flower.node as node_module

    config = run_config(rounds=4)
    grid = LoopbackGrid(config, nodes(3))
    coord = coordinator(config, grid)  # the server's own check first
    checks, partitions = [], []
    read, build = config_module.read_run_config, node_module.build_federation
    monkeypatch.setattr(config_module, "read_run_config", lambda *a, **k: checks.append(1) or read(*a, **k))
    monkeypatch.setattr(node_module, "build_federation", lambda *a: partitions.append(1) or build(*a))
    coord.run(grid)
    assert len(checks) == 3 and len(partitions) == 3  # one per node (its registration query; its first plan)


@pytest.mark.parametrize("dim", [8, 4096])
def test_context_holds_a_small_record_whatever_the_model_size(dim):
    """The node's ``Context`` (sent SuperNode <-> ClientApp with every message) keeps its progress and schedule
    records only: the same size for 18 and 8,194 weights; the weights are in the store."""
    config = run_config(rounds=3, **{"task-dim": dim})
    grid = LoopbackGrid(config, nodes(3))
    coord = coordinator(config, grid)
    coord.run(grid)
    for node in grid.nodes:
        assert set(grid.states[node].keys()) == {"zo_progress", "zo_schedule"}
        context = Context(1, node, grid.nodes[node], grid.states[node], config)
        assert context_to_proto(context).ByteSize() < 2048
        assert all(torch.equal(a, b) for a, b in zip(node_weights(grid, node),
                                                     replayed_weights(config, coord.ledger, 2), strict=True))


def test_the_store_keeps_the_newest_weights_only_and_a_node_that_lost_it_catches_up():
    config = run_config(rounds=5)
    grid = LoopbackGrid(config, nodes(3))
    coord = coordinator(config, grid)
    coord.register(grid)
    for t in range(3):
        coord.round(grid, t)
    store = grid.store(101)
    (name,) = store.weight_files()
    assert name == store.weights_name(coord.replica.start, 2)
    with open(store.path(".weights-left-by-a-killed-write.tmp"), "wb") as f:
        f.write(b"\0" * 10)  # a temporary file of an interrupted write is never read
    store.remove_weights()  # the node's disk lost its store; its Context still says it has applied 2 rounds
    entry = coord.round(grid, 3)
    assert entry["catch_up"] == [1] and coord.applied[101] == 0
    entry = coord.round(grid, 4)
    assert entry["accepted"] == [0, 1, 2]
    assert all(torch.equal(a, b) for a, b in zip(node_weights(grid, 101), replayed_weights(config, coord.ledger, 4),
                                                 strict=True))


def test_store_writes_are_atomic_and_checked(tmp_path):
    store = NodeStore(str(tmp_path / "s"))
    weights = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(2, dtype=torch.float64)}
    store.save_weights("f" * 64, 3, weights)
    loaded = store.load_weights("f" * 64, 3, ["a", "b"])
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in weights.items())
    assert store.load_weights("e" + "f" * 63, 3, ["a", "b"]) is None  # other start weights (same name prefix)
    assert store.load_weights("f" * 64, 3, ["a"]) is None and store.load_weights("f" * 64, 2, ["a", "b"]) is None
    store.save_weights("f" * 64, 4, weights)
    assert store.weight_files() == [store.weights_name("f" * 64, 4)]
    assert not [n for n in os.listdir(store.folder) if n.endswith(".tmp")]
    calls = []
    assert [list(p) for p in store.partitions("k", lambda: calls.append(1) or [[0, 2], [], [1]])] == [[0, 2], [], [1]]
    assert [list(p) for p in store.partitions("k", lambda: calls.append(1) or [[9]])] == [[0, 2], [], [1]]
    assert [list(p) for p in store.partitions("other", lambda: calls.append(1) or [[9]])] == [[9]]
    assert len(calls) == 2


def test_store_dir_is_checked_and_defaults_to_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert store_root({}) == os.path.join(str(tmp_path), "zo_byzantine", "flower")
    assert store_root({"store-dir": "rel"}) == os.path.abspath("rel")
    with pytest.raises(ValueError, match="node config 'store-dir': expected a string"):
        store_root({"store-dir": 3})
    assert read_node_config({"partition-id": 0, "num-partitions": 3, "store-dir": "/x"}, 3).client == 0
    assert NodeStore.of({"store-dir": str(tmp_path)}, 7, 9).folder == os.path.join(str(tmp_path), "node-7", "run-9")

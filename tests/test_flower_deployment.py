"""A real deployment on loopback: ``flower-superlink`` and SuperNodes as subprocesses on free ports, the example
app run with ``flwr run``; its ledger is the one ``ZOByzantineTrainer`` writes in one process; hostile SuperNodes
(a reply typed as another message, a registration answered late) neither hijack a client nor stall a round.
Bounded in time; every process is stopped, also on failure."""

import json
import os
import shutil
import time

import pytest
import torch
from flower_helpers import (
    EXAMPLE_APP,
    LocalDeployment,
    assert_same_rounds,
    make_certificates,
    make_node_keys,
    run_config,
    trainer_ledger,
    weight_tolerance,
)

from zo_byzantine import Ledger, replay
from zo_byzantine.flower import read_rounds_log, read_run_config
from zo_byzantine.flower.apps import TIMINGS_ENV, TIMINGS_FILE
from zo_byzantine.flower.config import build_task

pytestmark = pytest.mark.slow  # each test starts a SuperLink and SuperNodes


@pytest.mark.parametrize("resident", [False, True, "shared"], ids=["clientapp-per-message", "resident", "shared"])
def test_loopback_deployment_writes_the_trainers_ledger(tmp_path, resident):
    """However a node runs its messages (a ClientApp process each; its resident runtime: every plan of the node in
    one process, its weights kept in memory, the SuperNode started by ``zo-byzantine-supernode`` with its waits
    capped; one resident runtime for all nodes), the deployment writes the Trainer's ledger."""
    out = tmp_path / "server_out"
    n = 3
    config = run_config(rounds=3, **{"output-dir": str(out), "min-nodes": n, "round-timeout": 120.0})
    start = time.monotonic()
    with LocalDeployment(tmp_path) as deployment:
        deployment.env[TIMINGS_ENV] = "1"
        deployment.start_superlink()
        for i in range(n):  # node 0 is Byzantine: Gaussian noise instead of its scalars (a client-mountable attack)
            deployment.start_supernode(f"node{i}", {"partition-id": i, "num-partitions": n,
                                                    **({"attack": "gaussian"} if i == 0 else {})}, resident=resident,
                                       idle_poll=0.2 if resident is True else None)
        if resident == "shared":
            deployment.start_resident("resident", [f"node{i}" for i in range(n)])
        result = deployment.run(EXAMPLE_APP, config, timeout=240)
        logs = {name: deployment.tail(name) for name in deployment.logs}
    elapsed = time.monotonic() - start
    assert os.path.isfile(out / "zo_ledger.json"), (result.stdout[-3000:], result.stderr[-3000:], logs)
    deployed = Ledger.read(str(out))
    rounds_log = read_rounds_log(str(out))
    assert [r["accepted"] for r in rounds_log] == [[0, 1, 2]] * 3, rounds_log
    plans = [(path.parent, json.loads(line)) for path in (tmp_path / "stores").rglob(TIMINGS_FILE)
             for line in path.read_text().splitlines()]  # (the node's store, one plan's record)
    processes = {(node, plan["pid"]) for node, plan in plans}
    pids = {plan["pid"] for _, plan in plans}
    assert len(plans) == 3 * n and len(processes) == (n if resident else 3 * n), plans
    assert len(pids) == {False: 3 * n, True: n, "shared": 1}[resident], plans
    assert all(r["rejected"] == 0 and not r["problems"] for r in rounds_log), rounds_log
    reference, trained = trainer_ledger(config, tmp_path / "reference", attack="gaussian")
    assert_same_rounds(deployed["rounds"], reference.rounds, mu=1e-3)
    # the deployment's ledger replays from the start weights (fingerprint checked) to the simulation's weights
    model = build_task(read_run_config(config), config).model
    replay(model, deployed)
    for a, b in zip(model.parameters(), trained.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=weight_tolerance(config, 1e-3))
    print(f"loopback deployment ({'resident' if resident else 'ClientApp per message'}): {elapsed:.1f} s for {n} "
          "nodes x 3 rounds")


def _wait_for_rounds(out, count: int, deadline: float, deployment) -> list[dict]:
    while len(log := read_rounds_log(str(out))) < count:
        assert time.monotonic() < deadline, (log, {n: deployment.tail(n) for n in deployment.logs})
        time.sleep(0.5)
    return log


@pytest.mark.skipif(not os.environ.get("ZO_FLOWER_FAULTS"), reason="minutes on 2 cores: set ZO_FLOWER_FAULTS=1")
@pytest.mark.parametrize("resident", [False, True], ids=["clientapp-per-message", "resident"])
def test_a_killed_supernode_restarts_and_catches_up_from_the_ledger(tmp_path, resident):
    """SIGKILL one SuperNode after round 0: the run goes on (its round aggregates the replies received: Flower
    answers for the dead node with an error reply once its heartbeats stop, or the deadline passes); a new SuperNode
    with the same node config registers (a query beside a round's plans: it takes part from the next round),
    receives every ledger round in its next plan (no weights), replays them and answers, which it does only when its
    weights' SHA-256 fingerprint equals the server's replica (bitwise the same weights; a node that differs
    refuses). With a resident runtime, the node's runtime is killed with it (the machine went down)."""
    out = tmp_path / "server_out"
    # 8 rounds: the restarted SuperNode's start and its registration query take tens of seconds on a loaded machine,
    # while a round of the others takes a few; it must be back with rounds to spare
    config = run_config(rounds=8, num_byzantine=0, aggregator="mean",
                        **{"output-dir": str(out), "round-timeout": 60.0})
    deadline = time.monotonic() + 600
    with LocalDeployment(tmp_path) as deployment:
        deployment.start_superlink()
        for i in range(3):
            deployment.start_supernode(f"node{i}", {"partition-id": i, "num-partitions": 3}, resident=resident)
        deployment.start_run(EXAMPLE_APP, config)
        _wait_for_rounds(out, 1, deadline, deployment)
        deployment.stop_process("node2", grace=0.1)  # SIGTERM, then SIGKILL of its whole process group
        deployment.stop_process("node2-resident", grace=0.1)
        _wait_for_rounds(out, 2, deadline, deployment)
        deployment.start_supernode("node2-restarted", {"partition-id": 2, "num-partitions": 3}, resident=resident)
        log = _wait_for_rounds(out, 8, deadline, deployment)
    summary = [(r["round"], r["accepted"], r["catch_up"], r["problems"]) for r in log]
    print("killed and restarted node:", summary)
    assert log[0]["accepted"] == [0, 1, 2] and log[1]["accepted"] == [0, 1], summary  # the run went on without it
    back = [r["round"] for r in log if 2 in r["accepted"] and r["round"] >= 2]
    assert back and all(2 in r["accepted"] for r in log[back[0]:]), summary
    problems = [p for r in log for p in r["problems"]]
    assert all(r["skipped"] is None for r in log), summary
    # what the dead node caused, and nothing else: no reply (the deadline), a reply that is Flower's error, its id
    # still held while the SuperLink counts it connected, its client without a node for a round
    expected = ("no reply by the deadline", "error reply", "held by connected node", "no registered node connected")
    assert all(any(e in p["reason"] for e in expected) for p in problems), problems
    assert sum(r["rejected"] for r in log) == sum(p["reason"].startswith("reply rejected") for p in problems)
    deployed = Ledger.read(str(out))
    model = build_task(read_run_config(config), config).model
    replay(model, deployed)  # the server's ledger replays from the start weights
    assert [r["participants"] for r in deployed["rounds"]] == [r["accepted"] for r in log]


def test_with_tls_and_supernode_authentication_a_node_is_the_client_its_key_is_bound_to(tmp_path):
    """TLS with a CA and server certificate made here (127.0.0.1), ``--enable-supernode-auth``, and ``client-keys``
    binding the registered keys to client ids: the SuperNode whose key is bound to client 0 takes part as client 0;
    a registered SuperNode whose key is bound to client 1 but which claims client 0 is refused by the server (for
    the run, recorded); one with an unregistered key is refused by the SuperLink and never becomes a node."""
    out = tmp_path / "server_out"
    certificates = make_certificates(tmp_path)
    registered, registered_public = make_node_keys(tmp_path, "registered")
    impostor, impostor_public = make_node_keys(tmp_path, "impostor")
    stranger, _ = make_node_keys(tmp_path, "stranger")
    bindings = tmp_path / "client_keys.txt"
    bindings.write_text("".join(f"{c} {open(k).read().strip()}\n" for c, k in ((0, registered_public),
                                                                               (1, impostor_public))))
    config = run_config(rounds=1, num_clients=2, clients_per_round=2, num_byzantine=0, aggregator="mean",
                        **{"output-dir": str(out), "min-nodes": 1, "round-timeout": 60.0,
                           "client-keys": str(bindings)})
    with LocalDeployment(tmp_path, certificates=certificates) as deployment:
        deployment.start_superlink(supernode_auth=True)
        for public in (registered_public, impostor_public):
            registration = deployment.register(public)
            assert registration.returncode == 0, (registration.stdout, registration.stderr)
        deployment.start_supernode("registered", {"partition-id": 0, "num-partitions": 2}, private_key=registered)
        deployment.start_supernode("impostor", {"partition-id": 0, "num-partitions": 2}, private_key=impostor)
        deployment.start_supernode("stranger", {"partition-id": 1, "num-partitions": 2}, private_key=stranger)
        result = deployment.run(EXAMPLE_APP, config, timeout=200)
        logs = {name: deployment.tail(name) for name in deployment.logs}
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-2000:], logs)
    (entry,) = read_rounds_log(str(out))
    assert entry["accepted"] == [0], entry
    reasons = [p["reason"] for p in entry["problems"]]
    assert "no registered node connected" in reasons and any(
        "claims client 0; its public key is bound to client 1" in r for r in reasons), entry
    assert "Failed to activate SuperNode" in logs["stranger"], logs["stranger"]
    assert Ledger.read(str(out))["rounds"][0]["participants"] == [0]


def _hostile_app(root) -> str:
    """The example app with ``tests/hostile_clientapp.py`` as its ClientApp (the ServerApp unchanged)."""
    app = os.path.join(str(root), "hostile_app")
    shutil.copytree(EXAMPLE_APP, app, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(os.path.dirname(__file__), "hostile_clientapp.py"),
                os.path.join(app, "zo_flower_app", "hostile.py"))
    project = os.path.join(app, "pyproject.toml")
    with open(project) as f:
        text = f.read()
    assert 'clientapp = "zo_flower_app.client_app:app"' in text
    with open(project, "w") as f:
        f.write(text.replace('clientapp = "zo_flower_app.client_app:app"', 'clientapp = "zo_flower_app.hostile:app"'))
    return app


def test_a_hostile_supernode_neither_switches_client_by_message_type_nor_stalls_rounds(tmp_path):
    """Four SuperNodes: clients 0 and 1 honest; node "switch" (client 2) answers every plan with a reply typed
    ``query`` claiming client 3; node "slow" (client 3) answers its registration query after 1000 s. Each reply is
    judged against the message it answers: "switch" stays client 2 (its replies rejected and recorded) and client 3
    gets no node; no round waits for the slow registration (each ends when its plans are answered, far inside
    round-timeout)."""
    out = tmp_path / "server_out"
    timeout = 150.0
    config = run_config(rounds=2, num_clients=4, clients_per_round=4, num_byzantine=0, aggregator="mean",
                        **{"output-dir": str(out), "min-nodes": 3, "round-timeout": timeout})
    app = _hostile_app(tmp_path)
    with LocalDeployment(tmp_path) as deployment:
        deployment.start_superlink()
        for name, client, hostile in (("node0", 0, {}), ("node1", 1, {}),
                                      ("switch", 2, {"hostile": "type-switch", "hostile-client": 3}),
                                      ("slow", 3, {"hostile": "slow-query", "hostile-seconds": 1000.0})):
            deployment.start_supernode(name, {"partition-id": client, "num-partitions": 4, **hostile})
        result = deployment.run(app, config, timeout=2 * timeout)  # today's code: 3 x round-timeout, or more
        logs = {name: deployment.tail(name) for name in deployment.logs}
    log = read_rounds_log(str(out))
    assert result.returncode == 0 and len(log) == 2, (result.stdout[-2000:], result.stderr[-2000:], logs)
    summary = [(r["round"], r["accepted"], r["seconds"], r["problems"]) for r in log]
    print("hostile nodes:", summary)
    for entry in log:
        assert entry["accepted"] == [0, 1] and entry["seconds"] < timeout / 2, summary
        switched = [p for p in entry["problems"] if p["client"] == 2]
        assert [p["reason"] for p in switched] == ["reply rejected: a reply typed 'query' to a 'train' message"]
        assert switched[0]["node"] is not None and switched[0]["round"] == entry["round"]
        assert {"round": entry["round"], "node": None, "client": 3,
                "reason": "no registered node connected"} in entry["problems"], summary

"""The Flower deployment's roles in one process (real Flower messages, a loopback grid): the same ledger as the
Trainer, strict parsing of every record, hostile replies rejected or sanitised and logged, deadlines and too-few
replies, catch-up from the ledger, refused plans, configuration errors."""

import json
import math
import os

import pytest
import torch
from flower_helpers import (
    EXAMPLE_APP,
    LoopbackGrid,
    assert_same_rounds,
    coordinator,
    node_weights,
    nodes,
    replayed_weights,
    run_config,
    trainer_ledger,
)

from zo_byzantine import Ledger, replay
from zo_byzantine.batched_clients import BatchedClients
from zo_byzantine.flower import (
    PlanRefused,
    Replica,
    WireError,
    answer,
    plan_content,
    read_node_config,
    read_plan,
    read_reply,
    read_run_config,
    report_content,
)
from zo_byzantine.flower.config import build_task
from zo_byzantine.flower.store import NodeStore
from zo_byzantine.flower.wire import REPORT, catch_up_content
from zo_byzantine.schedule import Schedule

pytest.importorskip("flwr")
from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict  # noqa: E402

# ----- equivalence with the simulation -------------------------------------------------------------------------

CASES = {
    "cwtm, gaussian node": (dict(), {"0": {"attack": "gaussian"}}, "gaussian"),
    "mean, sampled clients, 2 local steps": (
        dict(num_clients=4, clients_per_round=3, num_byzantine=0, aggregator="mean", local_steps=2,
             **{"min-nodes": 4}), {}, "none"),
    "per-client directions (FedES), unequal partitions": (
        dict(num_clients=4, clients_per_round=4, num_byzantine=0, aggregator="mean", directions="per_client",
             **{"min-nodes": 4, "task-examples": 90}), {}, "none"),
    "FedES, each direction on its own batch": (
        dict(num_clients=4, clients_per_round=4, num_byzantine=0, aggregator="mean", directions="per_client",
             per_device_train_batch_size=6, zo_direction_batch_size=3, **{"min-nodes": 4, "task-examples": 90}),
        {}, "none"),
    "cwtm, label-flipping node": (
        dict(num_clients=4, clients_per_round=4, **{"min-nodes": 4, "task-examples": 90}),
        {"0": {"attack": "lf:num_classes=2"}}, "lf:num_classes=2"),
    "median, nonfinite node, compressed": (
        dict(num_clients=4, clients_per_round=4, aggregator="median", local_steps=2, local_update="compressed",
             **{"min-nodes": 4}), {"0": {"attack": "nonfinite"}}, "nonfinite"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_deployment_writes_the_trainers_ledger(tmp_path, case):
    overrides, node_extra, attack = CASES[case]
    config = run_config(rounds=3, **overrides)
    grid = LoopbackGrid(config, nodes(config["num_clients"], **node_extra))
    coord = coordinator(config, grid)
    coord.run(grid)
    reference, _ = trainer_ledger(config, tmp_path, attack=attack)
    assert_same_rounds(coord.ledger.rounds, reference.rounds, mu=1e-3)
    assert all(r["rejected"] == 0 and not r["problems"] for r in coord.rounds_log)
    # the server's replica is the ledger's replay from the start weights, bitwise
    model = build_task(read_run_config(config), config).model
    replay(model, coord.ledger)
    for ours, replayed in zip(coord.replica.table.params, model.parameters(), strict=True):
        assert torch.equal(ours, replayed)
    if attack == "nonfinite":  # the Byzantine node's NaNs were sanitised and counted, as in the simulation
        assert [r["nonfinite"] for r in coord.rounds_log] == [config["num_perturbations"]] * 3


# ----- the wire format ------------------------------------------------------------------------------------------


def _plan_and_entries(rounds: int = 2, **overrides):
    config = run_config(rounds=rounds, **overrides)
    grid = LoopbackGrid(config, nodes(config["num_clients"]))
    coord = coordinator(config, grid)
    coord.run(grid)
    plan = coord.server.plan(rounds, coord.sampler.participants(rounds), 0.05)
    return coord, plan


@pytest.mark.parametrize("directions", ["shared", "per_client"])
def test_plan_message_round_trip(directions):
    overrides = {} if directions == "shared" else dict(directions="per_client", aggregator="mean", num_byzantine=0)
    coord, plan = _plan_and_entries(**overrides)
    content = plan_content(plan, 0, coord.ledger.rounds, coord.replica.start, coord.replica.fingerprint())
    message = read_plan(content)
    assert message.plan == plan and message.since == 0
    assert message.start == coord.replica.start and message.weights == coord.replica.fingerprint()
    for ours, theirs in zip(message.entries, coord.ledger.rounds, strict=True):
        assert {k: ours[k] for k in ("round", "lr", "seeds", "coefficients")} == \
            {k: theirs[k] for k in ("round", "lr", "seeds", "coefficients")}
    assert len(message.entries[0]["seeds"][0]) == (4 if directions == "shared" else 5)
    later = read_plan(plan_content(plan, 1, coord.ledger.rounds[1:], coord.replica.start, "x"))
    assert later.since == 1 and [e["round"] for e in later.entries] == [1]


def _corrupt(content, key, value):
    record = content["plan"]
    record[key] = value
    return content


@pytest.mark.parametrize(("key", "value", "match"), [
    ("round", 2.0, "plan.round: expected int"),
    ("round", True, "plan.round: expected int"),
    ("seeds", [1, 2, 3], "plan.seeds: expected 16 values, got 3"),  # (K + 1) x nu x 4
    ("coefficients", [0.5] * 3, "plan.coefficients: expected 4 values"),
    ("since", 7, r"plan.since: expected an int in \[0, 3\)"),
    ("local_update", "sideways", "plan.local_update: expected one of"),
    ("lr", [0.05, math.nan], r"ledger entry 1: .*lr: expected a finite number"),
    ("participants", [0, 0, 1], "listed twice"),
])
def test_plan_parsing_is_strict(key, value, match):
    coord, plan = _plan_and_entries()
    content = plan_content(plan, 0, coord.ledger.rounds, coord.replica.start, coord.replica.fingerprint())
    with pytest.raises(WireError, match=match):
        read_plan(_corrupt(content, key, value))
    content = plan_content(plan, 0, coord.ledger.rounds, coord.replica.start, coord.replica.fingerprint())
    content["plan"]["extra"] = 1
    with pytest.raises(WireError, match=r"unknown key\(s\) \['extra'\]"):
        read_plan(content)


def _report(**values) -> RecordDict:
    record = {"round": 3, "client": 1, "applied": 3, "scalars": [0.5, -0.25], "loss": 0.7, "num_examples": 10}
    record.update(values)
    return RecordDict({REPORT: MetricRecord(record)})


def test_report_round_trip_and_catch_up_request():
    from zo_byzantine import Report

    report = Report(3, 1, torch.tensor([[0.5, -0.25]], dtype=torch.float64), 0.7, 10)
    parsed = read_reply(report_content(report, 3), (1, 2), 3)
    assert parsed.applied == 3 and parsed.report.client == 1 and parsed.report.round == 3
    assert torch.equal(parsed.report.scalars, report.scalars) and parsed.report.num_examples == 10
    request = read_reply(catch_up_content(3, 1, 0), (1, 2), 3)
    assert request.report is None and request.applied == 0 and request.client == 1


@pytest.mark.parametrize(("content", "match"), [
    (_report(scalars=[1, 2]), "report.scalars: expected a list of float"),
    (_report(scalars=[0.5] * 3), "report.scalars: expected 2 values, got 3"),
    (_report(scalars=[0.0] * 10**6), "report.scalars: expected 2 values, got 1000000"),
    (_report(client=1.0), "report.client: expected int"),
    (_report(num_examples=0), r"report.num_examples: expected an int in \[1, "),
    (_report(applied=4), r"report.applied: expected an int in \[0, 4\)"),
    (_report(loss=1), "report.loss: expected float"),
    (_report(extra=1.0), r"unknown key\(s\) \['extra'\]"),
    (RecordDict({REPORT: ConfigRecord({"round": 3})}), "reply.report: expected a MetricRecord"),
    (RecordDict({REPORT: MetricRecord({"round": 3}), "more": MetricRecord({})}), "exactly one record 'report'"),
    ("not a record", "reply: expected a RecordDict"),
])
def test_reply_parsing_is_strict(content, match):
    with pytest.raises(WireError, match=match):
        read_reply(content, (1, 2), 3)


# ----- hostile replies ------------------------------------------------------------------------------------------

HOSTILE = run_config(rounds=2, num_clients=5, clients_per_round=4, **{"min-nodes": 5})


def _forged(message, content) -> Message:
    return Message(content, reply_to=message)


def _reply_values(reply) -> dict:
    return dict(reply.content[REPORT])


def _hostile_cases(victim: int, outsider_node: int):
    """name -> (tamper(reply, message) -> replies, rejected, nonfinite, victim's report kept)"""

    def edit(**values):
        return lambda reply, message: [_forged(message, _report(**{**_reply_values(reply), **values}))]

    def outsider(reply, message):  # the unsampled node answers too, with a well-formed report of its own
        fake = Message(RecordDict({}), message_type="train", dst_node_id=outsider_node)
        values = {**_reply_values(reply), "client": outsider_node - 100}
        return [reply, _forged(fake, _report(**values))]

    return {
        "non-participant": (outsider, 1, 0, True),
        "duplicate": (lambda reply, message: [reply, _forged(message, _report(**{
            **_reply_values(reply), "scalars": [1e6, -1e6]}))], 1, 0, True),
        "stale round": (edit(round=0), 1, 0, False),
        "wrong length": (edit(scalars=[0.1, 0.2, 0.3]), 1, 0, False),
        "oversized payload": (edit(scalars=[0.1] * 200_000), 1, 0, False),
        "wrong types": (edit(scalars=[1, 2]), 1, 0, False),
        "impersonation": (edit(client=int(victim + 1) % 5), 1, 0, False),
        "nan and inf": (edit(scalars=[math.nan, -math.inf]), 0, 2, True),
        "error reply": (lambda reply, message: [Message(Error(code=0, reason="boom"), reply_to=message)],
                        1, 0, False),
        "no record": (lambda reply, message: [_forged(message, RecordDict({}))], 1, 0, False),
    }


@pytest.mark.parametrize("case", ["non-participant", "duplicate", "stale round", "wrong length", "oversized payload",
                                  "wrong types", "impersonation", "nan and inf", "error reply", "no record"])
def test_hostile_reply_is_rejected_or_sanitised_and_logged(case, caplog):
    grid = LoopbackGrid(HOSTILE, nodes(5))
    clean = coordinator(HOSTILE, grid)
    clean.run(grid)
    participants = list(clean.sampler.participants(1))
    victim = int(participants[0])
    outsider = next(c for c in range(5) if c not in participants)
    tamper, rejected, nonfinite, kept = _hostile_cases(victim, 100 + outsider)[case]
    state = {}

    def hostile(reply, message):
        if message.metadata.message_type != "train" or message.metadata.dst_node_id != 100 + victim:
            return [reply]
        if read_plan(message.content).plan.round != 1:
            return [reply]
        state["hit"] = True
        return tamper(reply, message)

    grid = LoopbackGrid(HOSTILE, nodes(5), tamper=hostile)
    coord = coordinator(HOSTILE, grid)
    coord.run(grid)
    entry = coord.rounds_log[1]
    assert state["hit"] and entry["skipped"] is None  # never a crash; the round is applied
    assert entry["rejected"] == rejected and entry["nonfinite"] == nonfinite, entry
    assert (victim in entry["accepted"]) == kept and len(entry["accepted"]) == 3 + kept
    # each rejection is recorded (rounds log and log) with the node, the client of its plan and the round
    found = [p for p in entry["problems"] if p["reason"].startswith("reply rejected")]
    assert len(found) == rejected and all(p["round"] == 1 for p in found), entry["problems"]
    expected_node = 100 + (outsider if case == "non-participant" else victim)
    assert all(p["node"] == expected_node and p["client"] in (victim, None) for p in found), found
    if rejected:
        assert f"Round 1: node {expected_node}" in caplog.text and "reply rejected" in caplog.text
    if case in ("non-participant", "duplicate"):  # the genuine report alone entered: the clean run's round
        assert coord.ledger.rounds[1]["coefficients"] == clean.ledger.rounds[1]["coefficients"]
    else:
        assert coord.ledger.rounds[1]["coefficients"] != clean.ledger.rounds[1]["coefficients"]


# ----- deadline, too few replies, catch-up ----------------------------------------------------------------------


def test_late_and_missing_replies_are_left_out_and_too_few_skip_the_round(caplog):
    config = run_config(rounds=2, **{"round-timeout": 5.0})
    grid = LoopbackGrid(config, nodes(3), delays={102: 1.0})
    coord = coordinator(config, grid)
    coord.register(grid)
    coord.round(grid, 0)  # all in time: applied
    grid.delays[102] = 60.0  # past the deadline: CWTM (f = 1) cannot hold for 2 reports
    start = [p.detach().clone() for p in coord.replica.table.params]
    entry = coord.round(grid, 1)
    assert entry["accepted"] == [0, 1] and entry["received"] == 2 and entry["missed"] == 1
    assert entry["problems"] == [{"round": 1, "node": 102, "client": 2,
                                  "reason": "no reply by the deadline (round-timeout=5 s)"}]
    assert entry["seconds"] == 5.0  # the deadline, on the grid's clock
    assert entry["skipped"].startswith("2 reports are too few for the rule")
    assert coord.ledger.rounds[1]["skipped"] == entry["skipped"] and coord.ledger.rounds[1]["coefficients"] == []
    assert all(torch.equal(a, b) for a, b in zip(start, coord.replica.table.params, strict=True))
    assert "Round 1 skipped (2 reports are too few" in caplog.text


def test_a_node_back_after_missed_rounds_catches_up_from_the_ledger():
    config = run_config(rounds=4, num_clients=4, clients_per_round=4, **{"min-nodes": 4})
    grid = LoopbackGrid(config, nodes(4))
    coord = coordinator(config, grid)
    coord.register(grid)
    assert coord.round(grid, 0)["accepted"] == [0, 1, 2, 3]
    grid.down = {103}  # connected, silent: rounds 1 and 2 go on with 3 reports (CWTM, f = 1)
    for t in (1, 2):
        assert coord.round(grid, t)["accepted"] == [0, 1, 2]
    grid.down = set()
    assert coord.round(grid, 3)["accepted"] == [0, 1, 2, 3]
    sent = [read_plan(m.content) for m in grid.sent if m.metadata.dst_node_id == 103 and
            m.metadata.message_type == "train"]
    # its reply to round 0 said it had applied no round: each later plan brings rounds 0..t-1 (the downlink of a
    # round travels with the next plan; no weights on the wire); it applies them when it answers round 3
    assert [(m.plan.round, m.since, len(m.entries)) for m in sent] == [(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 0, 3)]
    # the node's weights after catching up are the server's replay of rounds 0..2, bitwise
    assert all(torch.equal(a, b) for a, b in zip(node_weights(grid, 103), replayed_weights(config, coord.ledger, 3),
                                                 strict=True))
    assert grid.states[103]["zo_progress"]["applied"] == 3


def test_a_restarted_node_catches_up_and_one_that_lost_its_state_asks_for_it():
    config = run_config(rounds=4, num_clients=4, clients_per_round=4, **{"min-nodes": 4})
    grid = LoopbackGrid(config, nodes(4))
    coord = coordinator(config, grid)
    coord.register(grid)
    for t in range(2):
        coord.round(grid, t)
    # node 101 restarts as a new SuperNode (new node id, empty state); the old one is gone
    grid.nodes[201] = grid.nodes.pop(101)
    grid.states[201] = RecordDict()
    # node 102 keeps its id but lost its state: the server believes it has applied rounds 0, 1
    grid.states[102] = RecordDict()
    entry = coord.round(grid, 2)  # 201 registers (a query beside the plans); 102 asks to catch up
    assert coord.clients[201] == 1 and 101 not in coord.clients
    assert entry["catch_up"] == [2] and entry["accepted"] == [0, 3]
    assert {"round": 2, "node": None, "client": 1, "reason": "no registered node connected"} in entry["problems"]
    entry = coord.round(grid, 3)
    assert entry["accepted"] == [0, 1, 2, 3] and entry["catch_up"] == []
    # both replayed rounds 0..2 from the ledger entries of their plan: the server's replay, bitwise
    for node in (201, 102):
        assert grid.states[node]["zo_progress"]["applied"] == 3
        replayed = replayed_weights(config, coord.ledger, 3)
        assert all(torch.equal(a, b) for a, b in zip(node_weights(grid, node), replayed, strict=True))


def _four_nodes_after_two_rounds():
    config = run_config(rounds=4, num_clients=4, clients_per_round=4, **{"min-nodes": 4})
    grid = LoopbackGrid(config, nodes(4))
    coord = coordinator(config, grid)
    coord.register(grid)
    coord.round(grid, 0)
    coord.round(grid, 1)
    return grid, coord


def test_a_node_out_of_sync_refuses_then_starts_over():
    grid, coord = _four_nodes_after_two_rounds()
    from safetensors import safe_open
    from safetensors.torch import save_file

    store = grid.store(101)
    (name,) = store.weight_files()
    with safe_open(store.path(name), framework="pt") as f:
        kept, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    save_file({k: v + 1e-3 for k, v in kept.items()}, store.path(name), metadata=metadata)  # its weights drifted
    entry = coord.round(grid, 2)
    assert 1 not in entry["accepted"]
    assert any("weights differ from the server's" in p["reason"] for p in entry["problems"])
    assert "zo_progress" not in grid.states[101] and store.weight_files() == []
    assert coord.round(grid, 3)["catch_up"] == [1]  # it starts over: asks for every round
    assert coord.applied[101] == 0


# ----- refused plans and configuration --------------------------------------------------------------------------


def _node_inputs(config):
    deployment = read_run_config(config)
    coord = coordinator(config)
    plan = coord.server.plan(0, coord.sampler.participants(0), 0.05)
    return deployment, coord, plan


def test_a_node_refuses_a_plan_it_cannot_reproduce(tmp_path):
    config = run_config()
    deployment, coord, plan = _node_inputs(config)
    task = build_task(deployment, config)
    node = read_node_config({"partition-id": 0, "num-partitions": 3}, 3)
    content = plan_content(plan, 0, [], coord.replica.start, coord.replica.fingerprint())
    store = NodeStore(str(tmp_path))
    reply = answer(content, RecordDict(), deployment, task, node, store, Replica(task.model, deployment.args))
    assert reply[REPORT]["client"] == 0  # as sent: answered
    other = plan_content(plan, 0, [], coord.replica.start, coord.replica.fingerprint())
    other["plan"]["generator_name"] = "torch"
    with pytest.raises(PlanRefused, match="cannot reproduce them"):
        answer(other, RecordDict(), deployment, task, node, store, Replica(task.model, deployment.args))
    with pytest.raises(PlanRefused, match="start weights differ"):
        answer(plan_content(plan, 0, [], "0" * 64, coord.replica.fingerprint()), RecordDict(), deployment, task, node,
               store, Replica(task.model, deployment.args))
    import dataclasses

    unsampled = dataclasses.replace(plan, participants=(1, 2))
    with pytest.raises(PlanRefused, match="client 0 was not sampled in round 0"):
        answer(plan_content(unsampled, 0, [], coord.replica.start, coord.replica.fingerprint()), RecordDict(),
               deployment, task, node, store, Replica(task.model, deployment.args))


@pytest.mark.parametrize(("overrides", "match"), [
    ({"colour": "red"}, r"unknown key\(s\) \['colour'\]"),
    ({"estimator": "first_order"}, "'estimator'='first_order' sends d floats each way"),
    ({"attack": "alie"}, "attacks are mounted by nodes"),
    ({"server_optimizer": "amsgrad"}, "'server_optimizer'='amsgrad' is not supported in a Flower deployment"),
    ({"rounds": 0}, "run config 'rounds'=0 must be an integer >= 1"),
    ({"round-timeout": "soon"}, "run config 'round-timeout': expected float"),
    ({"aggregator": "nope"}, "aggregator"),
    ({"clients_per_round": 2}, "aggregator='cwtm' cannot hold for the vectors of a round"),
])
def test_bad_run_config_is_refused_before_any_work(overrides, match):
    config = run_config(**overrides)
    with pytest.raises(ValueError, match=match):
        coordinator(config)


@pytest.mark.parametrize(("node_config", "match"), [
    ({"partition-id": 3, "num-partitions": 3}, r"partition-id'=3 must be an integer in \[0, 2\]"),
    ({"partition-id": 0, "num-partitions": 4}, "must equal the run's num_clients=3"),
    ({"partition-id": "0", "num-partitions": 3}, "'partition-id': expected an int"),
    ({"partition-id": 0, "num-partitions": 3, "attack": "alie"}, "accepted: none, sf, gaussian, nonfinite, lf"),
])
def test_bad_node_config_is_refused(node_config, match):
    with pytest.raises(ValueError, match=match):
        read_node_config(node_config, 3)


def test_replica_keeps_exact_weights_in_the_node_store(tmp_path):
    config = run_config()
    deployment = read_run_config(config)
    replica = Replica(build_task(deployment, config).model, deployment.args)
    with torch.no_grad():
        for p in replica.table.params:
            p.add_(torch.randn_like(p) * 1e-3)
    replica.applied = 5
    state, store = RecordDict(), NodeStore(str(tmp_path))
    replica.save(state, store)
    assert set(state.keys()) == {"zo_progress"}  # the Context holds the progress record only
    other = Replica(build_task(deployment, config).model, deployment.args)
    assert other.load(state, store) and other.applied == 5 and other.fingerprint() == replica.fingerprint()


def test_a_node_checks_its_schedule_at_its_first_plan_only(monkeypatch):
    """The stacked-directions check (``zo_schedule="auto"``) runs at a node's first plan; its decisions live in the
    node state, so later plans of the run evaluate the way the trainer's later rounds do, without checking again."""
    checks = []
    original = BatchedClients.checked_stacking
    monkeypatch.setattr(BatchedClients, "checked_stacking", lambda self, *a: checks.append(1) or original(self, *a))
    config = run_config(rounds=3, num_clients=3, clients_per_round=3, **{"min-nodes": 3})
    grid = LoopbackGrid(config, nodes(3))
    coord = coordinator(config, grid)
    coord.run(grid)
    assert len(checks) == 3  # one per node, at its first plan
    decided = dict(grid.states[100]["zo_schedule"])
    assert decided["stack"] is True and decided["for_schedule"] == "auto" and decided["name"] == "two_forwards"


def test_a_kept_schedule_is_used_only_for_the_same_settings():
    decided = Schedule("auto", 1.0)
    decided.name, decided.stack, decided.stack_rows, decided.stack_clients = "cached", True, 64, False
    values = decided.decisions()
    restored = Schedule.restored("auto", 1.0, values)
    assert (restored.name, restored.stack, restored.stack_rows, restored.stack_clients) == ("cached", True, 64, False)
    for name, budget, changed in (("auto", 2.0, {}), ("two_forwards", 1.0, {}), ("auto", 1.0, {"name": "bogus"}),
                                  ("auto", 1.0, {"verified": "yes"}), ("auto", 1.0, {"for_budget": "1.0"}),
                                  ("auto", 1.0, {"verified": False}), ("auto", 1.0, {"format": 2})):
        fresh = Schedule.restored(name, budget, {**values, **changed})
        assert (fresh.name, fresh.stack, fresh.stack_clients) == (name, None if name == "auto" else False,
                                                                  None if name == "auto" else False)
    wrong_type = Schedule.restored("auto", 1.0, {**values, "stack": 1, "stack_rows": "64"})
    assert wrong_type.name == "cached" and wrong_type.stack is None and wrong_type.stack_rows == 0
    assert Schedule.restored("antithetic", 1.0, Schedule("antithetic", 1.0).decisions()).verified is False


def test_server_evaluates_its_replica_on_a_schedule():
    config = run_config(rounds=4, **{"eval-every": 2})
    grid = LoopbackGrid(config, nodes(3))
    coord = coordinator(config, grid)
    coord.run(grid)
    evaluated = [r for r in coord.rounds_log if "eval_loss" in r]
    assert [r["round"] for r in evaluated] == [1, 3]
    # an independent reference: the ledger's first 2 and 4 rounds replayed, cross-entropy and accuracy by hand
    task = build_task(read_run_config(config), config)
    x = torch.stack([item["x"] for item in task.eval_dataset])
    y = torch.stack([item["labels"] for item in task.eval_dataset])
    for entry in evaluated:
        weights = replayed_weights(config, coord.ledger, entry["round"] + 1)
        logits = x @ weights[0].T + weights[1]
        assert entry["eval_loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, y)), rel=1e-6)
        assert entry["eval_accuracy"] == pytest.approx(float((logits.argmax(1) == y).double().mean()))


def test_a_ledger_with_a_long_skip_reason_is_saved_and_read_back(tmp_path):
    """A deployment's skipped rounds carry long reasons ("2 reports are too few for the rule: ..."); the ledger file
    keeps such a string on one line (it was once written as a list of its characters, and then refused)."""
    config = run_config(rounds=1)
    coord = coordinator(config)
    reason = "2 reports are too few for the rule: " + "cwtm needs 2 f < m " * 8
    coord.ledger.record(0, [], [], 0.05, skipped=reason, loss=math.nan, participants=[0, 2])
    coord.ledger.save(str(tmp_path))
    assert Ledger.read(str(tmp_path))["rounds"][0]["skipped"] == reason


@pytest.mark.slow  # about 5 s each on 2 cores (a BERT's forwards)
@pytest.mark.parametrize("head_only", [True, False])
def test_text_task_from_a_model_folder_writes_the_trainers_ledger(tmp_path, head_only):
    """The example's ``text`` task: a (tiny) BERT from a folder and sentences from a TSV file. Each node pads its own
    batch, the simulation pads all clients' batches together: the rounds agree within the tolerance."""
    from helpers import tiny_bert, wordpiece_tokenizer

    folder = tmp_path / "model"
    tiny_bert().save_pretrained(folder)
    wordpiece_tokenizer().save_pretrained(folder)
    config = run_config(rounds=2, task="zo_flower_app.task:text", **{
        "task-model": str(folder), "task-data": str(_sentences_tsv(tmp_path)), "task-examples": 60,
        "task-eval-examples": 20,
        "task-head-only": head_only, "eval-every": 2})
    grid = LoopbackGrid(config, nodes(3, **{"0": {"attack": "gaussian"}}))
    coord = coordinator(config, grid)
    coord.run(grid)
    reference, _ = trainer_ledger(config, tmp_path / "reference", attack="gaussian")
    assert_same_rounds(coord.ledger.rounds, reference.rounds, mu=1e-3)
    trainable = sum(p.numel() for p in coord.replica.table.params)
    assert (trainable == 16 * 2 + 2) == head_only  # only the classification head, or every weight
    assert 0.0 <= coord.rounds_log[1]["eval_accuracy"] <= 1.0 and math.isfinite(coord.rounds_log[1]["eval_loss"])


def _sentences_tsv(tmp_path, count: int = 80):
    from helpers import sentences

    data = tmp_path / "train.tsv"
    data.write_text("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in sentences(count)))
    return data


PARTIAL = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
           "model.norm": "disk", "lm_head": "cpu"}  # one layer and the final norm offloaded to disk


@pytest.mark.parametrize("offload", [False, True], ids=["in-memory", "disk-offloaded"])
def test_text_task_with_a_causal_lms_prompt_writes_the_trainers_ledger(tmp_path, offload):
    """``task-head = "prompt"``: a (tiny) Llama scores SST-2's causal label words with its own LM head, every weight
    trained; the deployment writes the Trainer's ledger. Dispatched with disk offload (``task-device-map``), on the
    server and every node, it writes the same ledger and reaches the same weights, bitwise."""
    from prompt_helpers import byte_bpe
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "llama"
    tokenizer = byte_bpe(roberta=False)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                 max_position_embeddings=128)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    config = run_config(rounds=2, task="zo_flower_app.task:text", **{
        "task-model": str(folder), "task-data": str(_sentences_tsv(tmp_path)), "task-examples": 60,
        "task-eval-examples": 20, "task-head": "prompt", "eval-every": 2})
    ran = {}
    for placed in (False, True) if offload else (False,):
        if placed:
            config = {**config, "task-device-map": json.dumps(PARTIAL), "task-offload-folder": str(tmp_path / "off")}
        grid = LoopbackGrid(config, nodes(3, **{"0": {"attack": "gaussian"}}))
        coord = coordinator(config, grid)
        coord.run(grid)
        assert all(r["rejected"] == 0 and not r["problems"] for r in coord.rounds_log)
        ran[placed] = coord.ledger.to_dict()["rounds"], node_weights(grid, 101), coord
    if offload:
        from zo_byzantine.offload import is_offloaded

        assert is_offloaded(coord.task.model)  # (the nodes build theirs from the same config)
        (rounds_m, weights_m, _), (rounds_o, weights_o, _) = ran[False], ran[True]
        assert rounds_m == rounds_o and all(torch.equal(a, b) for a, b in zip(weights_m, weights_o, strict=True))
        return
    assert type(coord.task.model).__name__ == "PromptModel" and coord.task.model.kind == "causal_lm"
    reference, _ = trainer_ledger(config, tmp_path / "reference", attack="gaussian")
    assert_same_rounds(coord.ledger.rounds, reference.rounds, mu=1e-3)
    assert sum(p.numel() for p in coord.replica.table.params) == sum(
        p.numel() for p in LlamaForCausalLM.from_pretrained(folder).parameters())  # every weight (head tied)


def test_every_task_key_the_example_reads_is_declared_in_its_pyproject():
    """Flower refuses a run config key its app does not declare (``flwr run`` fails before any round)."""
    import re

    with open(os.path.join(EXAMPLE_APP, "zo_flower_app", "task.py")) as f:
        read = set(re.findall(r'"(task-[a-z-]+)"', f.read()))  # every key the task names
    with open(os.path.join(EXAMPLE_APP, "pyproject.toml")) as f:  # (tomllib: Python 3.11+)
        declared = set(re.findall(r"^(task-[a-z-]+) = ", f.read(), flags=re.MULTILINE))
    assert {"task-head", "task-template", "task-model", "task-device-map", "task-max-memory"} <= read <= declared, \
        read - declared


def test_a_node_refuses_a_schedule_its_offloaded_model_cannot_run(tmp_path, caplog):
    from prompt_helpers import byte_bpe
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "llama"
    tokenizer = byte_bpe(roberta=False)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    config = run_config(rounds=1, task="zo_flower_app.task:text", zo_schedule="antithetic", **{
        "task-model": str(folder), "task-data": str(_sentences_tsv(tmp_path)), "task-examples": 60,
        "task-eval-examples": 0, "task-head": "prompt", "task-device-map": json.dumps(PARTIAL),
        "task-offload-folder": str(tmp_path / "off")})
    grid = LoopbackGrid(config, nodes(3))
    coord = coordinator(config, grid)
    coord.run(grid)
    reasons = [p["reason"] for r in coord.rounds_log for p in r["problems"]]
    assert len(reasons) == 3 and all("zo_schedule='antithetic'" in r and "offloaded" in r for r in reasons), reasons


def test_text_task_refuses_a_prompt_head_on_a_model_without_one_and_an_unknown_head(tmp_path):
    from helpers import tiny_bert, wordpiece_tokenizer

    folder = tmp_path / "model"
    tiny_bert().save_pretrained(folder)  # a classification model: no masked-LM head
    wordpiece_tokenizer().save_pretrained(folder)
    config = run_config(task="zo_flower_app.task:text", **{"task-model": str(folder), "task-data": str(
        _sentences_tsv(tmp_path)), "task-examples": 60, "task-eval-examples": 20})
    with pytest.raises(ValueError, match=r"task-head='prompt' needs the model's LM head.*task-head='classifier'"):
        build_task(read_run_config(config), {**config, "task-head": "prompt"})
    with pytest.raises(ValueError, match=r"task-head='lm': accepted: classifier, prompt"):
        build_task(read_run_config(config), {**config, "task-head": "lm"})


# ----- a process that runs many messages (the resident runtime) keeps each node in memory -------------------------


@pytest.fixture
def keeping(monkeypatch):
    """``keep_in_memory`` on, as in ``zo-byzantine-resident``; counts the tasks the nodes build."""
    from zo_byzantine.flower import apps

    built = []

    def counted(deployment, config):
        built.append(1)
        return build_task(deployment, config)

    monkeypatch.setattr(apps, "build_task", counted)
    apps.keep_in_memory(True)
    yield built
    apps.keep_in_memory(False)


def test_nodes_kept_in_memory_write_the_same_ledger_and_build_their_task_once(keeping):
    config = run_config(rounds=3)
    fresh = coordinator(config, grid := LoopbackGrid(config, nodes(3, **{"0": {"attack": "gaussian"}})))
    from zo_byzantine.flower import apps

    apps.keep_in_memory(False)
    fresh.run(grid)
    per_message = len(keeping)
    apps.keep_in_memory(True)
    keeping.clear()
    kept = coordinator(config, grid := LoopbackGrid(config, nodes(3, **{"0": {"attack": "gaussian"}})))
    kept.run(grid)
    assert per_message == 3 * 3 and len(keeping) == 3  # a task per plan; a task per node
    assert kept.ledger.rounds == fresh.ledger.rounds
    assert all(r["rejected"] == 0 and not r["problems"] for r in kept.rounds_log)


def test_a_kept_node_whose_weights_drift_refuses_then_starts_over_from_a_new_task(keeping):
    grid, coord = _four_nodes_after_two_rounds()
    from zo_byzantine.flower import apps

    ((_, replica),) = [v for k, v in apps._KEPT.items() if k[1] == 101]
    with torch.no_grad():
        replica.table.params[0].add_(1e-3)  # its weights in memory drifted
    built = len(keeping)
    entry = coord.round(grid, 2)
    assert 1 not in entry["accepted"] and not replica.in_sync
    assert any("weights differ from the server's" in p["reason"] for p in entry["problems"])
    assert coord.round(grid, 3)["catch_up"] == [1]  # a new replica at the start weights asks for every round
    assert len(keeping) == built + 1 and coord.applied[101] == 0


def test_the_supernode_launcher_caps_flowers_waits_only(monkeypatch):
    import importlib
    import time

    from zo_byzantine.flower import supernode

    loop = importlib.import_module(supernode.LOOP)
    monkeypatch.setattr(loop, "time", time)  # restored after the test
    assert supernode.cap_waits(0.05) and isinstance(loop.time, supernode.CappedTime)
    start = time.monotonic()
    loop.time.sleep(3)  # the SuperNode's wait after an empty poll
    assert time.monotonic() - start < 1.0 and loop.time.monotonic is time.monotonic  # the rest of time unchanged
    assert not supernode.cap_waits(0.05)  # already capped: not Flower's loop as expected any more
    with pytest.raises(ValueError, match=r"--idle-poll 0: expected seconds > 0"):
        supernode.cap_waits(0)

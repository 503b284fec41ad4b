"""The deployment's trust boundary (issue 44): what one SuperNode can and cannot do to a run, each checked with a node
that tries, in one process (the real ClientApp behind a loopback grid, real Flower messages, a virtual clock).

A hostile node controls every byte of its reply (values, length, round, type, client) and when it answers; it cannot
change which message it answers (the SuperLink pairs a reply with the message sent to that node)."""

import math
import os

import pytest
import torch
from flower_helpers import (
    LoopbackGrid,
    assert_same_rounds,
    coordinator,
    make_node_keys,
    node_weights,
    nodes,
    replayed_weights,
    run_config,
    trainer_ledger,
)

from zo_byzantine.flower import read_client_keys, read_plan, read_rounds_log
from zo_byzantine.flower.wire import REASON_LIMIT, REPORT, catch_up_content

pytest.importorskip("flwr")
from flwr.app import Error, Message, MetricRecord, RecordDict  # noqa: E402


def _round_of(message) -> int | None:
    """The round of a plan message (``None`` for a query)."""
    return read_plan(message.content).plan.round if message.metadata.message_type == "train" else None


def _values(reply) -> dict:
    return dict(reply.content[REPORT])


def _report(message, **values) -> Message:
    return Message(RecordDict({REPORT: MetricRecord(values)}), reply_to=message)


def _hostile(node: int, forge):
    """A tamper for the loopback grid: ``forge(reply, message, t)`` replaces node ``node``'s replies to plans (or
    returns ``None`` to leave one as it is)."""

    def tamper(reply, message):
        if message.metadata.dst_node_id != node or message.metadata.message_type != "train":
            return [reply]
        forged = forge(reply, message, _round_of(message))
        return [reply] if forged is None else forged

    return tamper


def _reasons(coord, node=None) -> list[str]:
    return [p["reason"] for r in coord.rounds_log for p in r["problems"] if node is None or p["node"] == node]


# ----- 1. a reply is judged against the message it answers -----------------------------------------------------


def test_a_reply_typed_query_to_a_plan_does_not_switch_the_nodes_client():
    """Node 102 (client 2) answers its round-0 plan with a reply typed ``query`` claiming client 3, which has no
    node: the server sent it a plan, so the reply is a rejected plan reply; node 102 stays client 2's."""
    config = run_config(rounds=3, num_clients=4, clients_per_round=4, num_byzantine=0, aggregator="mean")

    def switch(reply, message, t):
        if t != 0:
            return None
        forged = Message(RecordDict({"hello": MetricRecord({"client": 3})}), reply_to=message)
        forged.metadata.message_type = "query"
        return [forged]

    grid = LoopbackGrid(config, {n: c for n, c in nodes(4).items() if n != 103}, tamper=_hostile(102, switch))
    coord = coordinator(config, grid)
    coord.run(grid)
    assert coord.clients == {100: 0, 101: 1, 102: 2}
    assert [r["accepted"] for r in coord.rounds_log] == [[0, 1], [0, 1, 2], [0, 1, 2]]
    (problem,) = [p for p in coord.rounds_log[0]["problems"] if p["node"] == 102]
    assert problem == {"round": 0, "node": 102, "client": 2,
                       "reason": "reply rejected: a reply typed 'query' to a 'train' message"}
    assert all(p["client"] == 3 and p["reason"] == "no registered node connected"
               for r in coord.rounds_log for p in r["problems"] if p["node"] is None)


def test_a_reply_from_another_node_than_the_plans_is_rejected_and_recorded_once():
    """Node 102's round-0 plan is answered by a reply that says it comes from node 101 (the SuperLink refuses such a
    reply; the server checks it too): rejected, recorded under the sending node, once although it comes three times
    (as a SuperLink returns a reply at every pull until it is taken); client 2 misses round 0 and takes part again
    from round 1."""
    config = run_config(rounds=2, num_clients=4, clients_per_round=4, num_byzantine=0, aggregator="mean")

    def other_node(reply, message, t):
        if t != 0:
            return None
        reply.metadata.__dict__["_src_node_id"] = 101
        return [reply] * 3

    grid = LoopbackGrid(config, nodes(4), tamper=_hostile(102, other_node))
    coord = coordinator(config, grid)
    coord.run(grid)
    assert [r["accepted"] for r in coord.rounds_log] == [[0, 1, 3], [0, 1, 2, 3]]
    assert _reasons(coord, 101) == ["reply rejected: a reply to node 102's train message from another node"]


def test_the_superlinks_error_reply_for_a_gone_node_is_that_nodes_error():
    """A node that died: the SuperLink answers its plan with an error reply from the SuperLink's own node id (1).
    It is taken as that node's error reply (the client misses the round, one problem), not as a foreign reply
    recorded at every pull until the deadline."""
    config = run_config(rounds=2, num_clients=4, clients_per_round=4, num_byzantine=0, aggregator="mean")

    def gone(reply, message, t):
        if t != 0:
            return None
        error = Message(Error(code=0, reason="node unavailable"), reply_to=message)
        error.metadata.__dict__["_src_node_id"] = 1
        return [error]

    grid = LoopbackGrid(config, nodes(4), tamper=_hostile(102, gone))
    coord = coordinator(config, grid)
    coord.run(grid)
    assert [r["accepted"] for r in coord.rounds_log] == [[0, 1, 3], [0, 1, 2, 3]]
    assert _reasons(coord) == ["reply rejected: error reply: node unavailable"]
    assert coord.rounds_log[0]["missed"] == 0


# ----- 2. registration delays no round; a refused claimant is not asked every round ---------------------------


def test_a_slow_or_refused_claimant_delays_no_round_and_is_not_queried_every_round():
    """Node 103 answers its registration query after 400 s (round-timeout 150 s), node 104 claims client 0, which
    node 100 holds. The rounds last what their participants take (100 s: node 102); 103's reply is taken when it
    comes (a later round), and it takes part from the next round; 104 is refused, recorded naming both nodes, and
    asked again after 1, then 2, then 4 rounds, not every round."""
    config = run_config(rounds=7, num_clients=4, clients_per_round=4, num_byzantine=0, aggregator="mean",
                        **{"round-timeout": 150.0, "startup-timeout": 300.0})
    members = {**nodes(4), 104: {"partition-id": 0, "num-partitions": 4}}
    grid = LoopbackGrid(config, members, delays={102: 100.0, 103: 400.0})
    coord = coordinator(config, grid)
    coord.register(grid)
    durations = []
    for t in range(config["rounds"]):
        before = grid.clock()
        coord.round(grid, t)
        durations.append(grid.clock() - before)
        if 103 in coord.clients:  # registered: it answers its plans at once
            grid.delays.pop(103, None)
    assert max(durations) < config["round-timeout"], durations  # no round waited for a registration
    joined = next(r["round"] for r in coord.rounds_log if 3 in r["accepted"])
    assert coord.clients[103] == 3 and all(3 in r["accepted"] for r in coord.rounds_log[joined:])
    queries = [m for m in grid.sent if m.metadata.dst_node_id == 104]
    assert len(queries) == 3, len(queries)  # before round 0, then rounds 1 and 3 (backing off): not 8
    refusals = _reasons(coord, 104)
    assert len(refusals) == 3 and all("claims client 0, held by connected node 100" in r for r in refusals)
    assert 104 not in coord.clients


# ----- 3. client ids bound to SuperNode keys --------------------------------------------------------------------


def _keys(tmp_path, members: dict[int, int | None]) -> tuple[str, dict[int, bytes]]:
    """A key pair per node; the ``client-keys`` file binding the keys of the nodes whose value is a client id;
    node id -> the public key as the SuperLink reports it (PEM)."""
    from cryptography.hazmat.primitives import serialization

    lines, pem = ["# client  OpenSSH public key"], {}
    for node, client in members.items():
        _, public = make_node_keys(tmp_path, f"node{node}")
        text = open(public).read().strip()
        key = serialization.load_ssh_public_key(text.encode())
        pem[node] = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        if client is not None:
            lines.append(f"{client} {text}")
    path = os.path.join(tmp_path, "client_keys.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path, pem


def test_client_ids_are_bound_to_supernode_keys_not_to_the_first_claim(tmp_path):
    """With ``client-keys``: node 50 (its key bound to client 3) and node 60 (a key bound to nothing) both claim
    client 0 and answer before its rightful node 100: both are refused for good, and node 100 is client 0."""
    path, pem = _keys(tmp_path, {100: 0, 101: 1, 102: 2, 50: 3, 60: None})
    config = run_config(rounds=2, num_clients=4, clients_per_round=4, **{"client-keys": path})
    claim_0 = {"partition-id": 0, "num-partitions": 4}
    members = {50: claim_0, 60: claim_0, **{n: c for n, c in nodes(4).items() if n != 103}}
    grid = LoopbackGrid(config, members, keys=pem)
    coord = coordinator(config, grid)
    coord.run(grid)
    assert coord.clients == {100: 0, 101: 1, 102: 2}
    assert [r["accepted"] for r in coord.rounds_log] == [[0, 1, 2]] * 2
    assert _reasons(coord, 50) == ["registration refused: claims client 0; its public key is bound to client 3 "
                                   "(client-keys)"]
    assert _reasons(coord, 60) == ["registration refused: its public key is bound to no client (client-keys)"]
    assert sum(m.metadata.dst_node_id in (50, 60) for m in grid.sent) == 2  # never asked again


def test_a_client_keys_file_is_checked(tmp_path):
    path, _ = _keys(tmp_path, {1: 0, 2: 1})
    assert sorted(read_client_keys(path, 2).values()) == [0, 1]
    with pytest.raises(ValueError, match=r"line 3: expected '<client id in \[0, 1\)>"):
        read_client_keys(path, 1)
    text = open(path).read().splitlines()
    for lines, match in (([text[1], text[1].replace("0 ", "1 ", 1)], "listed twice"),
                         (["0 ecdsa-sha2-nistp384 AAAAnotakey"], "not an OpenSSH public key")):
        with open(path, "w") as f:
            f.write("\n".join(lines))
        with pytest.raises(ValueError, match=match):
            read_client_keys(path, 2)


# ----- 4. a forged loss -----------------------------------------------------------------------------------------


def test_a_forged_loss_does_not_move_the_rounds_loss():
    """Node 100 reports loss 1e308 (round 0) and NaN (round 1): the round's loss is the reports' mean trimmed by
    f = 1 per side, inside the honest losses; the NaN is recorded and left out."""
    config = run_config(rounds=2, num_clients=4, clients_per_round=4)
    honest = {}

    def forge(reply, message, t):
        honest[t] = []
        return [_report(message, **{**_values(reply), "loss": [1e308, math.nan][t]})]

    def note(reply, message):
        if message.metadata.message_type == "train" and message.metadata.dst_node_id != 100:
            honest.setdefault(_round_of(message), []).append(_values(reply)["loss"])
        return _hostile(100, forge)(reply, message)

    grid = LoopbackGrid(config, nodes(4), tamper=note)
    coord = coordinator(config, grid)
    coord.run(grid)
    for t, entry in enumerate(coord.rounds_log):
        assert entry["accepted"] == [0, 1, 2, 3] and len(honest[t]) == 3
        assert min(honest[t]) <= entry["loss"] <= max(honest[t]), (entry["loss"], honest[t])
        assert coord.ledger.rounds[t]["loss"] == entry["loss"]
    assert _reasons(coord, 100) == ["non-finite loss: left out of the round's loss"]


# ----- 5. FedES weights from the server's partition sizes -------------------------------------------------------


def test_fedes_weights_come_from_the_servers_partition_sizes():
    """``directions="per_client"`` with ``mean`` weighs each client by its data size: node 100 says it holds
    2^63 - 1 examples. The server knows each partition's size: the report is rejected, the others keep their
    weights (size / sum of the sizes received)."""
    config = run_config(rounds=2, num_clients=4, clients_per_round=4, num_byzantine=0, aggregator="mean",
                        directions="per_client", **{"task-examples": 90})

    def forge(reply, message, t):
        return [_report(message, **{**_values(reply), "num_examples": 2**63 - 1})]

    grid = LoopbackGrid(config, nodes(4), tamper=_hostile(100, forge))
    coord = coordinator(config, grid)
    coord.run(grid)
    assert [r["accepted"] for r in coord.rounds_log] == [[1, 2, 3]] * 2
    assert all(abs(c) > 1e-9 for r in coord.ledger.rounds for c in r["coefficients"])
    size = coord.sizes[0]
    assert _reasons(coord, 100) == [f"reply rejected: num_examples={2**63 - 1}; client 0's partition has {size} "
                                    "examples"] * 2


# ----- 6. catch-up: checked against the round, bounded per node per round -------------------------------------


def test_a_catch_up_request_for_another_round_is_rejected_and_recorded():
    config = run_config(rounds=2)

    def forge(reply, message, t):
        return [Message(catch_up_content(t + 5, 0, 0), reply_to=message)] if t == 1 else None

    grid = LoopbackGrid(config, nodes(3), tamper=_hostile(100, forge))
    coord = coordinator(config, grid)
    coord.run(grid)
    entry = coord.rounds_log[1]
    assert entry["catch_up"] == [] and entry["rejected"] == 1
    assert entry["problems"] == [{"round": 1, "node": 100, "client": 0,
                                  "reason": "reply rejected: answers round 6; its plan was round 1's"}]


def test_a_node_asking_for_the_whole_ledger_every_round_gets_at_most_catch_up_limit_rounds():
    config = run_config(rounds=6, **{"catch-up-limit": 2})

    def forge(reply, message, t):
        return [Message(catch_up_content(t, 0, 0), reply_to=message)]

    grid = LoopbackGrid(config, nodes(3), tamper=_hostile(100, forge))
    coord = coordinator(config, grid)
    coord.run(grid)
    plans = [read_plan(m.content) for m in grid.sent if m.metadata.dst_node_id == 100 and _round_of(m) is not None]
    assert [(p.since, len(p.entries)) for p in plans] == [(0, 0), (0, 1), (0, 2), (0, 2), (0, 2), (0, 2)]
    assert [r["catch_up"] for r in coord.rounds_log] == [[0]] * 6


def test_a_node_far_behind_catches_up_over_rounds_within_the_limit():
    """Node 103 misses rounds 1-3; with catch-up-limit 3 its round-4 plan carries rounds 0-2 (it applies them and
    asks for more), its round-5 plan rounds 3-4: it answers, at the server's weights, bitwise."""
    config = run_config(rounds=6, num_clients=4, clients_per_round=4, **{"catch-up-limit": 3})
    grid = LoopbackGrid(config, nodes(4))
    coord = coordinator(config, grid)
    coord.register(grid)
    for t in range(6):
        grid.down = {103} if t in (1, 2, 3) else set()
        coord.round(grid, t)
    assert [r["catch_up"] for r in coord.rounds_log[4:]] == [[3], []]
    assert coord.rounds_log[5]["accepted"] == [0, 1, 2, 3]
    plans = [read_plan(m.content) for m in grid.sent if m.metadata.dst_node_id == 103 and _round_of(m) is not None]
    assert [(p.plan.round, p.since, len(p.entries)) for p in plans[-2:]] == [(4, 0, 3), (5, 3, 2)]
    assert grid.states[103]["zo_progress"]["applied"] == 5 and coord.applied[103] == 5
    assert all(torch.equal(a, b) for a, b in zip(node_weights(grid, 103), replayed_weights(config, coord.ledger, 5),
                                                 strict=True))


# ----- 7. attacker text and sizes; the rounds log is appended ---------------------------------------------------


def test_attacker_text_and_sizes_stay_out_of_the_servers_files(tmp_path, caplog):
    """An error reply of 5 MB (with a forged log line), a reply with 100,000 extra keys, and a registration error of
    5 MB: each is one problem of at most REASON_LIMIT characters; the rounds log gets one line per round, the
    earlier lines left as they were."""
    config = run_config(rounds=3, num_clients=4, clients_per_round=4, **{"output-dir": str(tmp_path)})
    huge = "x" * 5_000_000 + "\nRound 9: node 1: all is well"

    def forge(reply, message, t):
        if t == 0:
            return [Message(Error(code=0, reason=huge), reply_to=message)]
        if t == 1:
            return [_report(message, **_values(reply), **{f"k{i}": 0.0 for i in range(100_000)})]
        return None

    def tamper(reply, message):
        if message.metadata.message_type == "query" and message.metadata.dst_node_id == 103:
            return [Message(Error(code=0, reason=huge), reply_to=message)]
        return _hostile(100, forge)(reply, message)

    grid = LoopbackGrid(config, nodes(4), tamper=tamper)
    coord = coordinator(config, grid)
    coord.register(grid)
    texts = [""]
    for t in range(config["rounds"]):
        coord.round(grid, t)
        texts.append((tmp_path / "flower_rounds.jsonl").read_text())
        assert texts[-1].startswith(texts[-2]) and texts[-1].count("\n") == t + 1  # appended, not rewritten
    problems = [p for r in coord.rounds_log for p in r["problems"]]
    assert {(p["node"], p["round"]) for p in problems} >= {(100, 0), (100, 1), (103, 0)}
    assert all(len(p["reason"]) <= REASON_LIMIT and "\n" not in p["reason"] for p in problems), problems
    assert len(texts[-1]) < 20_000 and len(caplog.text) < 20_000
    assert read_rounds_log(str(tmp_path)) == json_safe(coord.rounds_log)


def json_safe(entries):
    import json

    return json.loads(json.dumps(entries, default=str))


# ----- 8. every rejection recorded -----------------------------------------------------------------------------


def test_every_rejection_and_missed_deadline_is_recorded_with_node_client_and_round():
    """Round by round, the first participant's node answers for a stale round, a future round, twice, as a client
    not sampled, and too late: each is a problem naming its node, its plan's client and the round."""
    config = run_config(rounds=6, num_clients=5, clients_per_round=4, **{"min-nodes": 5, "round-timeout": 30.0})
    grid = LoopbackGrid(config, nodes(5))
    coord = coordinator(config, grid)
    victims = {t: int(coord.sampler.participants(t)[0]) for t in range(6)}
    outsiders = {t: next(c for c in range(5) if c not in coord.sampler.participants(t)) for t in range(6)}
    forgeries = {
        1: lambda v, t: [_report_of(v, round=0)],
        2: lambda v, t: [_report_of(v, round=t + 1)],
        3: lambda v, t: [v["reply"], _report_of(v)],
        4: lambda v, t: [_report_of(v, client=outsiders[t])],
    }

    def _report_of(v, **changed):
        return _report(v["message"], **{**_values(v["reply"]), **changed})

    def tamper(reply, message):
        t = _round_of(message)
        if t not in forgeries or message.metadata.dst_node_id != 100 + victims[t]:
            return [reply]
        return forgeries[t]({"reply": reply, "message": message}, t)

    grid.tamper = tamper
    coord.register(grid)
    for t in range(6):
        grid.delays = {100 + victims[t]: 60.0} if t == 5 else {}
        coord.round(grid, t)
    reasons = {1: "reply rejected: answers round 0; its plan was round 1's",
               2: "reply rejected: answers round 3; its plan was round 2's",
               3: "reply rejected: a second reply to its train message",
               4: f"reply rejected: names client {outsiders[4]}; its plan was client {victims[4]}'s",
               5: "no reply by the deadline (round-timeout=30 s)"}
    for t, reason in reasons.items():
        entry = coord.rounds_log[t]
        assert entry["problems"] == [{"round": t, "node": 100 + victims[t], "client": victims[t], "reason": reason}]
        assert entry["rejected"] == (t < 5) and entry["missed"] == (t == 5)


# ----- 4. a trusted client (fltrust): bound by its key, on its root set ------------------------------------------


def test_fltrust_runs_with_its_trusted_node_bound_by_client_keys_as_the_trainer_does(tmp_path):
    """The trusted client 3 holds the 20-example root set on its node and on the server (the report's size is checked
    against the server's partition), a Byzantine node 0, and the ledger is the trainer's: the paper's rule with a
    sign-flipping node, and the median scale and sign weights with a node sending seeded Gaussian rows (the same rows
    as the simulation's; a node's sign flip is ``-own``, the simulation's ``-hbar``, of another norm, which the median
    scale sees)."""
    path, pem = _keys(tmp_path, {100: 0, 101: 1, 102: 2, 103: 3})
    for kwargs, attack in (('{"trusted": [3]}', "sf"),
                           ('{"trusted": [3], "scale": "median", "weights": "sign"}', "gaussian")):
        config = run_config(rounds=3, num_clients=4, clients_per_round=4, aggregator="fltrust",
                            aggregator_kwargs=kwargs, root_examples=20,
                            **{"min-nodes": 4, "task-examples": 90, "client-keys": path})
        grid = LoopbackGrid(config, nodes(4, **{"0": {"attack": attack}}), keys=pem)
        coord = coordinator(config, grid)
        coord.run(grid)
        assert coord.sizes[3] == 20 and all(r["rejected"] == 0 and not r["problems"] for r in coord.rounds_log)
        reference, _ = trainer_ledger(config, tmp_path / f"simulation-{attack}", attack=attack)
        assert_same_rounds(coord.ledger.rounds, reference.rounds, mu=1e-3)


def test_fltrust_without_client_keys_is_refused_naming_both():
    from zo_byzantine.flower import read_run_config

    with pytest.raises(ValueError, match="'aggregator'='fltrust' trusts clients \\[2\\], but 'client-keys' is empty"):
        read_run_config(run_config(aggregator="fltrust", aggregator_kwargs='{"trusted": [2]}'))
    with pytest.raises(ValueError, match="fltrust: weights='relu' is not supported; accepted: cosine, sign"):
        read_run_config(run_config(aggregator="fltrust", aggregator_kwargs='{"trusted": [2], "weights": "relu"}'))

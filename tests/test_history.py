"""The agreement-history rule (issue 46): its numbers against slow references, its state through the server, the
ledger, resume and the Flower coordinator, its bounds, and the adaptive attacker against it."""

import json
import statistics

import pytest
import torch
from helpers import LogisticRegression, VectorDataset, assert_same_weights, make_trainer, state

from zo_byzantine import Ledger, LedgerError
from zo_byzantine.aggregators import CWTM, build_aggregator
from zo_byzantine.attacks import Adaptive, build_attack
from zo_byzantine.context import RoundContext
from zo_byzantine.history import History, agreements, robust_z
from zo_byzantine.ledger import LEDGER_NAME, check_round
from zo_byzantine.messages import Report
from zo_byzantine.perturbation import ParameterTable
from zo_byzantine.server import Server, Settings


def ctx(m, f, clients=None, state=None, byzantine=None, t=0):
    return RoundContext((0, t, 1), m, f, byzantine, tuple(clients or range(m)), state)


# ----- the numbers, against slow references ----------------------------------------------------------------------


def _slow_z(values):
    med = statistics.median(values)
    scale = 1.4826 * statistics.median([abs(v - med) for v in values])
    return [0.0 if scale == 0 else (v - med) / scale for v in values]


def _slow_agreements(rows, f, cap):
    """Lists and ``statistics``: the trimmed reference, components along it, distances, robust z, the worst side."""
    m, nu = len(rows), len(rows[0])
    ref = [statistics.mean(sorted(r[j] for r in rows)[f : m - f]) for j in range(nu)]
    size = sum(c * c for c in ref)
    along = [sum(a * c for a, c in zip(r, ref, strict=True)) / size for r in rows]
    dist = [sum((a - c) ** 2 for a, c in zip(r, ref, strict=True)) ** 0.5 for r in rows]
    balance = [sum((a > c) - (a < c) for a, c in zip(r, ref, strict=True)) / nu for r in rows]
    return [max(-cap, min(zp, -abs(zd), -abs(zb), 0.0))
            for zp, zd, zb in zip(_slow_z(along), _slow_z(dist), _slow_z(balance), strict=True)]


def test_robust_z_and_agreements_match_slow_references():
    x = torch.tensor([1.0, 2.0, 4.0, 7.0, 11.0])  # median 4, deviations 3 2 0 3 7 -> MAD 3
    assert robust_z(x).tolist() == pytest.approx([(v - 4) / (1.4826 * 3) for v in x.tolist()], rel=1e-12)
    assert robust_z(torch.ones(4)).tolist() == [0.0] * 4  # no spread: no evidence
    torch.manual_seed(0)
    rows = torch.randn(12, 6, dtype=torch.float64) + 1.0
    rows[9:] = -3 * rows[:9].mean(0)  # FOE's rows
    ours, _ = agreements(rows, 3, 8.0)
    assert ours.tolist() == pytest.approx(_slow_agreements(rows.tolist(), 3, 8.0), rel=1e-9, abs=1e-12)
    assert (ours[9:] < ours[:9].min()).all() and (ours <= 0).all() and (ours >= -8).all()


def test_fold_is_the_decayed_mean_and_keeps_unseen_clients():
    rule = History(decay=0.5)
    state = rule.fold({}, [3, 5], [-1.0, 0.0], 0)
    assert state == {3: (-0.5, 1, 0), 5: (0.0, 1, 0)}
    state = rule.fold(state, [5, 8], [-2.0, -4.0], 7)  # client 3 not sampled: kept as it was
    assert state == {3: (-0.5, 1, 0), 5: (-1.0, 2, 7), 8: (-2.0, 1, 7)}


# ----- the rule: exclusion, bounds, sizing ---------------------------------------------------------------------------


def _honest(m, nu=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, nu, generator=g, dtype=torch.float64) + 2.0


def test_a_persistent_foe_client_is_left_out_and_honest_ones_are_not():
    rule, state, excluded = History(), {}, []
    for t in range(30):
        honest = _honest(9, seed=t)
        rows = torch.cat([honest, (-2 * honest.mean(0)).expand(3, -1)])
        mask = torch.tensor([False] * 9 + [True] * 3)
        out = rule(rows, ctx(12, 3, state=state, byzantine=mask, t=t))
        state = out.update.state
        excluded.append((out.diagnostics["byzantine_excluded"], out.diagnostics["honest_excluded"]))
        assert out.update.record == agreements(rows, 3, rule.cap)[0].tolist()
    assert sum(h for _, h in excluded) == 0
    assert all(b == 3 for b, _ in excluded[5:])  # out within a few rounds, and kept out
    # once out, the output is the inner rule on the honest rows
    assert torch.equal(out.value, CWTM()(honest, RoundContext((0, 29, 1), 9, 3)).value)


@pytest.mark.parametrize("seed", range(5))
def test_per_round_bound_holds_whatever_the_state(seed):
    """A state that puts every honest client at the bottom: the exclusions hit honest rows, yet cwtm sized for f
    keeps the output inside the kept honest rows' per-coordinate range (the docstring's bound)."""
    honest = _honest(9, seed=seed)
    byzantine = torch.full((3, 8), 1e6, dtype=torch.float64)
    rows = torch.cat([honest, byzantine])
    state = {c: (-100.0, 10, 0) for c in range(3)}  # three honest clients framed
    out = History()(rows, ctx(12, 3, state=state))
    assert out.diagnostics["excluded"] == 3
    kept = honest[3:]  # the three lowest-scored (ties broken by row) left out
    assert (out.value >= kept.min(0).values - 1e-12).all() and (out.value <= kept.max(0).values + 1e-12).all()


def test_sizing_and_refusals():
    rule = History()
    assert rule.most_excluded(12, 3) == 3 and rule.most_excluded(7, 3) == 0 and rule.most_excluded(8, 3) == 1
    with pytest.raises(ValueError, match="client id"):
        rule(_honest(5), RoundContext((0, 0, 1), 5, 1))
    with pytest.raises(ValueError, match="decay"):
        History(decay=1.0)
    with pytest.raises(ValueError, match="nest"):
        History(base="history")
    assert build_aggregator("history", base="median", base_pre_aggregators=["nnm"]).name == "history(nnm+median)"


def test_stateless_rules_return_no_update():
    out = build_aggregator("cwtm")(_honest(5), ctx(5, 1))
    assert out.update is None and len(out) == 3


# ----- through the server, the ledger and resume -----------------------------------------------------------------


def _server(rule="history", **kwargs):
    table = ParameterTable(torch.nn.Linear(2, 1))  # shapes and dtypes only: nothing is evaluated
    return Server(Settings(zo_seed=1, num_perturbations=8, num_byzantine=2), build_aggregator(rule, **kwargs), table)


def _round(server, t, clients, rows):
    plan = server.plan(t, clients, 0.1)
    reports = [Report(t, c, rows[i][None].clone(), 1.0, 4) for i, c in enumerate(clients)]
    return server.aggregate(plan, reports, 0.1)


def test_the_server_keeps_the_state_records_it_and_rebuilds_it_from_the_ledger_bitwise(tmp_path):
    server, ledger_rounds = _server(), []
    sampled = [[0, 1, 2, 3, 4, 5, 6], [2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 8]]
    for t, clients in enumerate(sampled):  # client sampling: 7 and 8 unseen in some rounds
        rows = _honest(7, seed=t)
        rows[-2:] = -3 * rows[:5].mean(0)
        downlink = _round(server, t, clients, rows)
        assert downlink.history is not None and len(downlink.history[0]) == 7
        ledger_rounds.append({"round": t, "lr": 0.1, "participants": downlink.participants,
                              "seeds": [list(k) for k in downlink.seed_tuples], "coefficients": downlink.coefficients,
                              "history": downlink.history})
        check_round(ledger_rounds[-1], t)
    assert server.history[7][2] == 1  # last seen in round 1
    rebuilt = _server().restore_history(json.loads(json.dumps(ledger_rounds)))  # through JSON, as read from a file
    assert rebuilt == server.history  # floats compared exactly
    assert _server("cwtm").restore_history([{**r, "history": None} for r in ledger_rounds]) == {}
    with pytest.raises(ValueError, match="keeps none"):
        _server("cwtm").restore_history(ledger_rounds)


def test_a_skipped_round_leaves_the_state_as_it_was():
    server = _server()
    _round(server, 0, list(range(7)), _honest(7))
    before = dict(server.history)
    downlink = _round(server, 1, list(range(7)), _honest(7) * 1e300)  # the aggregate overflows the update guard
    assert downlink.skipped and downlink.history is None and server.history == before


def test_the_ledger_checks_the_history_field():
    entry = {"round": 0, "lr": 0.1, "participants": [0, 1], "seeds": [[1, 0, 1, 0]], "coefficients": [0.5],
             "history": [[-0.5, 0.0]]}
    check_round(entry, 0)
    for bad, match in (([[-0.5]], "1 numbers for 2"), ([[float("nan"), 0.0]], "finite"), ("x", "list")):
        with pytest.raises(LedgerError, match=match):
            check_round({**entry, "history": bad}, 0)
    with pytest.raises(LedgerError, match="applied round"):
        check_round({**entry, "skipped": "why", "coefficients": [], "seeds": [], "lr": None}, 0)


SETTINGS = dict(num_clients=7, num_byzantine=2, max_steps=8, learning_rate=0.1, num_perturbations=4,
                partition="dirichlet", aggregator="history", attack="foe", attack_kwargs={"omega": 3.0})


def _model():
    torch.manual_seed(0)
    return LogisticRegression()


def test_resume_rebuilds_the_state_and_continues_the_same_run_bitwise(tmp_path):
    straight = _model()
    first = make_trainer(straight, VectorDataset(128), tmp_path / "a", **SETTINGS)
    first.train()
    assert all("history" in r for r in first.ledger.rounds)
    assert first.server.history == first.server.restore_history(first.ledger.rounds)

    make_trainer(_model(), VectorDataset(128), tmp_path / "b", **SETTINGS, save_strategy="steps", save_steps=4).train()
    fresh = _model()
    resumed = make_trainer(fresh, VectorDataset(128), tmp_path / "c", **SETTINGS)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-4"))
    assert_same_weights(state(fresh), state(straight))
    assert resumed.ledger.rounds == first.ledger.rounds and resumed.server.history == first.server.history
    saved = Ledger.read(str(tmp_path / "a" / LEDGER_NAME))
    assert saved["rounds"] == first.ledger.rounds


def test_stateless_ledgers_have_no_history_field(tmp_path):
    trainer = make_trainer(_model(), VectorDataset(64), tmp_path, **{**SETTINGS, "aggregator": "cwtm", "max_steps": 2})
    trainer.train()
    assert all("history" not in r for r in trainer.ledger.rounds) and trainer.server.history == {}


# ----- the adaptive attacker ---------------------------------------------------------------------------------------


def test_adaptive_attacker_keeps_its_clients_in_and_strikes_when_its_scores_allow():
    rule, attack, state = build_aggregator("history"), build_attack("adaptive", strike="foe"), {}
    mask = torch.tensor([False] * 9 + [True] * 3)
    struck, excluded = 0, 0
    for t in range(40):
        honest = _honest(9, seed=t)
        c = ctx(12, 3, state=state, byzantine=mask, t=t)
        sent, found = attack(honest, honest[:3].clone(), rule, c)
        out = rule(torch.cat([honest, sent]), c)
        state, struck, excluded = out.update.state, struck + found["struck"], excluded + out.diagnostics["excluded"]
    assert excluded == 0 and struck > 0
    # the same attacker against a stateless pipeline strikes every round
    _, found = attack(_honest(9), _honest(3), build_aggregator("cwtm"), ctx(12, 3, byzantine=mask))
    assert found["struck"] == 1
    with pytest.raises(ValueError, match="mode"):
        Adaptive(mode="sometimes")


def test_omega_search_sees_the_state():
    """FOE's omega search runs the stateful rule with the round's state and the client ids in the sets' order
    (honest first): a state that has the Byzantine clients out makes every omega equally harmless."""
    honest, mask = _honest(9), torch.tensor([True] * 3 + [False] * 9)
    rule = build_aggregator("history")
    out_state = {c: (-50.0, 20, 0) for c in range(3)}  # clients 0-2 (the Byzantine rows) far below
    attack = build_attack("foe", omega="auto", candidates=[0.0, 5.0])
    _, found = attack(honest, honest[:3].clone(), rule, ctx(12, 3, state=out_state, byzantine=mask))
    _, fresh = attack(honest, honest[:3].clone(), rule, ctx(12, 3, state={}, byzantine=mask))
    assert found["omega"] == 0.0 and fresh["omega"] == 5.0


# ----- the Flower coordinator -------------------------------------------------------------------------------------


def test_the_flower_coordinator_keeps_and_records_the_state_with_no_change():
    pytest.importorskip("flwr")
    from flower_helpers import LoopbackGrid, coordinator, nodes, run_config

    config = run_config(rounds=3, num_clients=5, clients_per_round=4, aggregator="history", **{"min-nodes": 5})
    grid = LoopbackGrid(config, nodes(config["num_clients"]))
    coord = coordinator(config, grid)
    coord.run(grid)
    rounds = coord.ledger.rounds
    assert all(len(r["history"][0]) == len(r["participants"]) == 4 for r in rounds)
    assert coord.server.history == coord.server.restore_history(rounds) and len(coord.server.history) == 5


def test_history_on_one_scalar_a_report_is_warned_about_before_any_work(tmp_path, caplog):
    import logging

    from zo_byzantine import ZOByzantineArguments

    common = dict(output_dir=str(tmp_path), num_clients=8, num_byzantine=2, report_to=[])
    cases = [("history", 1, "projection", 1), ("history", 4, "projection", 0), ("history", 1, "parameter", 0),
             ("cwtm", 1, "projection", 0)]
    for aggregator, nu, space, expected in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="zo_byzantine.arguments"):
            ZOByzantineArguments(**common, aggregator=aggregator, num_perturbations=nu, aggregation_space=space)
        warned = [r.getMessage() for r in caplog.records if "aggregator='history'" in r.getMessage()]
        assert len(warned) == expected, (aggregator, nu, space, warned)
        assert all("one scalar" in w and "num_perturbations > 1" in w for w in warned)

"""The protocol's roles without the Trainer: server driven by plain tensors, user rules and attacks by name,
sampled configurations sized per round."""

import math

import pytest
import torch
from helpers import LogisticRegression, VectorDataset, dataset_loss, make_trainer

from zo_byzantine import (
    AGGREGATORS,
    ATTACKS,
    Aggregation,
    Attack,
    AttackOutput,
    ParameterTable,
    Plan,
    Report,
    Rule,
    Server,
    Settings,
    SizingError,
    build_aggregator,
    build_attack,
    register_aggregator,
    register_attack,
)

SEED, ROUND = 7, 3


def _server(rule="cwtm", attack="sf", num_byzantine=1, nu=2, **settings):
    table = ParameterTable(torch.nn.Linear(2, 1))  # shapes and dtypes only: nothing is evaluated
    return Server(Settings(SEED, num_perturbations=nu, num_byzantine=num_byzantine, **settings),
                  build_aggregator(rule), table, build_attack(attack))


def _fake_clients(plan: Plan, rows: dict) -> list[Report]:
    """A client role that answers the plan with given scalars (and checks what the plan asks for)."""
    assert plan.keys(1, 0) == [(SEED, ROUND, 1, 0), (SEED, ROUND, 1, 1)]
    return [Report(plan.round, c, torch.tensor([rows[c]], dtype=torch.float64), float(c), 10 + c)
            for c in plan.participants]


def test_server_round_by_hand_with_an_attack():
    server = _server()
    plan = server.plan(ROUND, [0, 1, 2, 3, 4], local_lr=0.0)
    rows = {0: [0.0, 0.0], 1: [1.0, 2.0], 2: [3.0, 4.0], 3: [5.0, 0.0], 4: [7.0, -2.0]}
    downlink = server.aggregate(plan, _fake_clients(plan, rows), lr=0.5, byzantine=[True, False, False, False, False])
    # hbar = [4, 1]; SF: client 0 sends [-4, -1]; CWTM (f = 1) per coordinate:
    #   {-4, 1, 3, 5, 7} -> mean(1, 3, 5) = 3;  {-1, 2, 4, 0, -2} -> mean(-1, 0, 2) = 1/3 (keeps -1: Byzantine)
    assert downlink.skipped is None and downlink.aggregates == [[3.0, pytest.approx(1 / 3)]]
    assert downlink.seed_tuples == [(SEED, ROUND, 1, 0), (SEED, ROUND, 1, 1)]
    assert downlink.coefficients == [3.0, pytest.approx(1 / 3)] and downlink.lr == 0.5
    assert downlink.loss == pytest.approx((1 + 2 + 3 + 4) / 4)  # honest clients only
    (found,) = downlink.diagnostics
    assert found["byzantine_values_kept"] == 1 and found["byzantine_over_bound"] == 0
    assert found["aggregate_shift"] == pytest.approx(math.hypot(1.0, 2 / 3))
    assert found["honest_mean_norm"] == pytest.approx(math.hypot(4.0, 1.0))


def test_server_checks_every_report_and_sizes_the_rule_for_those_received():
    server = _server(attack="none")
    plan = server.plan(ROUND, [0, 1, 2, 3, 4], local_lr=0.0)
    good = _fake_clients(plan, {c: [float(c), -float(c)] for c in plan.participants})
    hostile = [
        Report(ROUND, 9, torch.zeros(1, 2, dtype=torch.float64), 0.0, 1),  # not sampled
        Report(ROUND, 1, torch.full((1, 2), 1e9, dtype=torch.float64), 0.0, 1),  # a second report from client 1
        Report(ROUND - 1, 4, torch.zeros(1, 2, dtype=torch.float64), 0.0, 1),  # stale round
        Report(ROUND, 3, torch.zeros(1, 3, dtype=torch.float64), 0.0, 1),  # wrong length
        "not a report",
        Report(ROUND, [3], torch.zeros(1, 2, dtype=torch.float64), 0.0, 1),  # unhashable client id
        Report(ROUND, 3.0, torch.zeros(1, 2, dtype=torch.float64), 0.0, 1),  # float client id
        Report(torch.tensor([ROUND, ROUND]), 3, torch.zeros(1, 2, dtype=torch.float64), 0.0, 1),  # tensor round
        Report(ROUND, 3, torch.zeros(1, 2, dtype=torch.float64), "0.1", 1),  # loss not a number
        Report(ROUND, 3, torch.zeros(1, 2, dtype=torch.complex128), 0.0, 1),  # complex scalars
        Report(ROUND, 3, torch.zeros(1, 2, dtype=torch.float64).to_sparse(), 0.0, 1),  # sparse
        Report(ROUND, 3, torch.zeros(1, 2, dtype=torch.float64, device="meta"), 0.0, 1),  # not on the CPU
        Report(ROUND, 3, torch.zeros(1, 2, dtype=torch.long), 0.0, 1),  # integers
        Report(ROUND, 3, torch.zeros(1, 2, dtype=torch.float64), 0.0, 0),  # no examples
        Report(ROUND, True, torch.zeros(1, 2, dtype=torch.float64), 0.0, 1),  # bool id
    ]
    downlink = server.aggregate(plan, good[:3] + hostile, lr=0.1)  # clients 0, 1, 2 valid
    assert downlink.received == 3 and downlink.rejected == len(hostile) and downlink.participants == [0, 1, 2]
    assert downlink.aggregates == [[1.0, -1.0]]  # CWTM of {0, 1, 2} trimming f = 1 per side: the median
    # two valid reports are too few for the trimmed mean with f = 1: the round is skipped, not applied
    short = server.aggregate(plan, good[:2], lr=0.1)
    assert short.skipped.startswith("2 reports are too few for the rule") and short.coefficients == []


def test_a_round_of_byzantine_clients_only_is_skipped_not_a_crash():
    for attack in ("tma", "alie", "always_small", "random_choice", "gaussian", "sf"):
        server = _server(attack=attack)
        plan = server.plan(ROUND, [0, 1, 2], local_lr=0.0)
        reports = _fake_clients(plan, {0: [1.0, 1.0], 1: [2.0, 0.0], 2: [0.0, 3.0]})
        downlink = server.aggregate(plan, reports, lr=0.1, byzantine=[True, True, True])
        assert downlink.skipped == "no honest report (every sampled client is Byzantine)", attack
        assert downlink.coefficients == []


def test_per_client_directions_refuse_a_pipeline_they_would_not_apply():
    with pytest.raises(ValueError, match="directions='per_client'.*would not be applied"):
        _server(rule="median", attack="none", directions="per_client")
    with pytest.raises(ValueError, match="no pre_aggregators"):
        from zo_byzantine import ZOByzantineArguments

        ZOByzantineArguments(output_dir="/tmp/never", report_to=[], directions="per_client", pre_aggregators=["nnm"])


def test_skipped_round_keeps_what_it_computed():
    server = _server(attack="none")
    plan = server.plan(ROUND, [0, 1, 2], local_lr=0.0)
    reports = _fake_clients(plan, {0: [1.0, 1.0], 1: [math.nan, 0.0], 2: [0.0, 0.0]})
    downlink = server.aggregate(plan, reports, lr=0.1, byzantine=[False, False, False])
    assert downlink.skipped == "non-finite honest estimate" and downlink.loss == pytest.approx(1.0)


def test_user_rule_and_attack_by_name_receive_the_context(tmp_path):
    seen = {"rule": [], "attack": []}

    @register_aggregator("recording_median")
    class RecordingMedian(Rule):
        name = "recording_median"

        def check(self, m, f):
            super().check(m, f)
            if 2 * f >= m:
                raise SizingError(f"recording_median: needs 2f < m (m={m}, f={f})")

        def aggregate(self, vectors, ctx):
            seen["rule"].append((ctx.key, ctx.num_vectors, ctx.num_byzantine, ctx.byzantine is not None))
            return Aggregation(vectors.median(dim=0).values, {"calls": 1})

    @register_attack("recording_flip")
    class RecordingFlip(Attack):
        def __call__(self, honest, own, rule, ctx):
            seen["attack"].append((ctx.key, len(honest), len(own)))
            return AttackOutput(-honest.mean(dim=0).expand_as(own).clone(), {"omega": 2.0})

    try:
        trainer = make_trainer(LogisticRegression(), VectorDataset(256), tmp_path, num_clients=8, num_byzantine=2,
                               clients_per_round=6, aggregator="recording_median", attack="recording_flip",
                               max_steps=3, logging_steps=3)
        trainer.train()
    finally:
        AGGREGATORS.unregister("recording_median")
        ATTACKS.unregister("recording_flip")
    seed = trainer.args.zo_seed
    fed = trainer.federation
    rounds_with_byzantine = [t for t in range(3) if fed.is_byzantine[fed.participants(t)].any()]
    assert [k for k, *_ in seen["rule"]] == [(seed, t, 1) for t in range(3)]
    assert all(m == 6 and f == 2 and has_mask for _, m, f, has_mask in seen["rule"])
    assert [k for k, *_ in seen["attack"]] == [(seed, t, 1) for t in rounds_with_byzantine]
    (log,) = [e for e in trainer.state.log_history if "calls" in e]
    assert log["calls"] == 3 and (log.get("attack_omega") == 2.0) == bool(rounds_with_byzantine)


SAMPLED = [("cwtm", []), ("median", []), ("krum", []), ("multikrum", []), ("geomed", []), ("cclip", []),
           ("cwtm", ["nnm"]), ("median", ["clip:c=1.0"]), ("mean", ["bucketing:s=2"])]


@pytest.mark.parametrize(("rule", "pre"), SAMPLED)
def test_sampled_configuration_that_can_hold_trains(tmp_path, rule, pre):
    # n = 12, b = 2, m = 8 per round: every rule and step is sized for the 8 vectors it receives
    torch.manual_seed(0)
    model, dataset = LogisticRegression(), VectorDataset(512)
    before = dataset_loss(model, dataset)
    trainer = make_trainer(model, dataset, tmp_path, num_clients=12, num_byzantine=2, clients_per_round=8,
                           aggregator=rule, pre_aggregators=pre, attack="alie", per_device_train_batch_size=16,
                           max_steps=40, learning_rate=0.2, num_perturbations=4, logging_steps=40)
    trainer.train()
    (log,) = [e for e in trainer.state.log_history if "skipped_rounds" in e]
    assert log["skipped_rounds"] == 0 and all(r.get("skipped") is None for r in trainer.ledger.rounds)
    assert dataset_loss(model, dataset) < 0.8 * before

"""FLTrust in R^nu (``zo_byzantine/trusted.py``, issue 46): the rule against a slow reference and its guarantee on
hostile rows, the refusals, the trusted clients' root data set, and a run that resumes and replays bitwise."""

import math

import numpy as np
import pytest
import torch
from helpers import LogisticRegression, VectorDataset, assert_same_weights, make_trainer, state

from zo_byzantine import Ledger, LedgerError, ZOByzantineArguments, replay
from zo_byzantine.aggregators import build_aggregator
from zo_byzantine.checks import build_federation
from zo_byzantine.context import RoundContext
from zo_byzantine.federation import byzantine_mask, partition_dataset, with_root
from zo_byzantine.ledger import LEDGER_NAME
from zo_byzantine.trusted import FLTrust, merging_cosine, unit_rows


def ctx(m, clients=None, byzantine=None, f=1):
    return RoundContext((0, 0, 1), m, f, byzantine, tuple(range(m)) if clients is None else tuple(clients))


def _slow_fltrust(rows, trusted_rows, scale="g0", weights="cosine"):
    """Lists and math: g0 the trusted rows' mean; weights relu(cos) (or 1 where cos > 0); rows rescaled to ||g0||
    (or to the median norm of all rows, trusted ones included); g0 (at that norm) when every weight is 0."""
    nu = len(rows[0]) if rows else len(trusted_rows[0])
    g0 = [sum(r[j] for r in trusted_rows) / len(trusted_rows) for j in range(nu)]
    size = g0_norm = math.sqrt(sum(x * x for x in g0))
    if scale == "median":
        norms = sorted(math.sqrt(sum(x * x for x in r)) for r in rows + trusted_rows)
        half = len(norms) // 2
        size = norms[half] if len(norms) % 2 else (norms[half - 1] + norms[half]) / 2
    out, total = [0.0] * nu, 0.0
    for r in rows:
        norm = math.sqrt(sum(x * x for x in r))
        if norm == 0 or g0_norm == 0:
            continue
        cosine = sum(a * b for a, b in zip(r, g0, strict=True)) / (norm * g0_norm)
        trust = max(0.0, cosine) if weights == "cosine" else float(cosine > 0)
        total += trust
        out = [o + trust * size * x / norm for o, x in zip(out, r, strict=True)]
    if total == 0:
        return [size * x / g0_norm if g0_norm else 0.0 for x in g0]
    return [o / total for o in out]


@pytest.mark.parametrize("scale,weights", [("g0", "cosine"), ("median", "cosine"), ("g0", "sign"),
                                           ("median", "sign")])
@pytest.mark.parametrize("seed", range(6))
def test_fltrust_matches_a_slow_reference(seed, scale, weights):
    g = torch.Generator().manual_seed(seed)
    m, nu = 9 - seed % 2, 5  # an odd and an even number of rows: the median norm of both kinds
    rows = torch.randn(m, nu, generator=g, dtype=torch.float64) * torch.rand(m, 1, generator=g, dtype=torch.float64)
    rows[2] = 0.0  # a zero row scores 0
    trusted = [7] if seed % 2 else [3, 7]
    out = FLTrust(trusted=trusted, scale=scale, weights=weights)(rows, ctx(m)).value
    others = [rows[i].tolist() for i in range(m) if i not in trusted]
    expected = _slow_fltrust(others, [rows[i].tolist() for i in trusted], scale, weights)
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_the_median_scale_is_set_by_the_honest_norms_and_sign_weights_count_rows():
    """b < m / 2 rows of any norm leave the median norm in the honest norms' range; with sign weights every row at a
    positive cosine counts once (two identical rows: twice), whatever its cosine; g0 alone is rescaled too."""
    g0, honest = torch.tensor([1.0, 0.0]), torch.tensor([[0.0, 3.0], [1.0, 1.0], [4.0, -1.0]])
    rule = FLTrust(trusted=[0], scale="median", weights="sign")
    kept = unit_rows(torch.tensor([[1.0, 1.0], [4.0, -1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]))  # cos > 0 to g0
    for byzantine, median in ((1e30, math.sqrt(17)), (1e-30, 1.0)):  # huge or tiny, 3 of 7 rows: an honest median
        vectors = torch.cat([g0[None], honest, byzantine * torch.tensor([[1.0, 1.0]]).expand(3, -1)])
        out = rule(vectors, ctx(7, f=3)).value
        torch.testing.assert_close(out, median * kept.mean(dim=0))
    vectors = torch.tensor([[2.0, 0.0], [1.0, 0.1], [1.0, 3.0], [1.0, 3.0], [-1.0, 0.0]])
    out = rule(vectors, ctx(5, f=0)).value  # median norm 2 (of 1, 1.005, 2, 3.16, 3.16); kept: cos 0.995, 0.32, 0.32
    units = unit_rows(vectors[1:4])
    torch.testing.assert_close(out, 2.0 * units.mean(dim=0))
    alone = rule(torch.tensor([[2.0, 0.0], [-1.0, 0.0], [-5.0, 0.0], [-4.0, 0.0], [-3.0, 0.0]]), ctx(5, f=0)).value
    torch.testing.assert_close(alone, torch.tensor([3.0, 0.0]))  # no row agrees: g0 rescaled to the median norm 3


def test_the_median_scale_needs_fewer_than_half_byzantine_rows():
    """Half of a round's rows could set the median norm (a deployment's round with fewer reports): refused by
    ``check`` (the server skips such a round), as the paper's scale is not."""
    from zo_byzantine.context import SizingError

    with pytest.raises(SizingError, match="scale='median' takes the median row norm.*needs 2f < m .m=4 vectors, f=2"):
        FLTrust(trusted=[0], scale="median").check(4, 2)
    FLTrust(trusted=[0], scale="median").check(5, 2)
    FLTrust(trusted=[0]).check(4, 2)


def test_merge_cosine_gives_near_identical_rows_one_weight():
    """Rows at cosine >= merge_cosine to each other share one weight: three identical rows count as one; distinct
    rows keep theirs; against a slow per-row count."""
    g0 = torch.tensor([1.0, 0.0, 0.0])
    honest = torch.tensor([[1.0, 1.0, 0.0], [1.0, -1.0, 0.5], [2.0, 0.0, -1.0]])
    copies = torch.tensor([[1.0, 0.2, 1.0]]).expand(3, -1)
    vectors = torch.cat([g0[None], honest, copies])
    rule = FLTrust(trusted=[0], weights="sign", merge_cosine=0.99)
    units = unit_rows(torch.cat([honest, copies]))
    expected = (units[:3].sum(dim=0) + units[3]) / 4  # three honest rows and the copies' one weight
    torch.testing.assert_close(rule(vectors, ctx(7, f=3)).value, expected)
    unmerged = FLTrust(trusted=[0], weights="sign")(vectors, ctx(7, f=3)).value
    torch.testing.assert_close(unmerged, units.mean(dim=0))
    with pytest.raises(ValueError, match="fltrust: merge_cosine"):
        FLTrust(trusted=[0], merge_cosine=0.0)
    # merge_cosine=1.0 merges exact copies, whose cosines round to just below 1 (float32 and float64)
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.float64):
        for _ in range(20):
            rows = torch.randn(3, 64, generator=g, dtype=dtype)
            vectors = torch.cat([rows[:1], rows[1:2], rows[2:3].expand(3, -1)])
            out = FLTrust(trusted=[0], weights="sign", merge_cosine=1.0)(vectors, ctx(5, f=3)).value
            units = unit_rows(vectors[1:3])
            kept = (units @ unit_rows(rows[:1])[0] > 0).to(dtype)
            if bool(kept.any()):
                expected = rows[0].norm() * (kept[:, None] * units).sum(dim=0) / kept.sum()  # the copies: one weight
                torch.testing.assert_close(out, expected)


def test_the_adaptive_attacker_spreads_its_rows_just_below_the_merge_cosine():
    """Against a rule that merges rows, the adaptive attacker sends distinct rows: pairwise cosines just below the
    merge, each one the strike plus a part orthogonal to it; the same rows for the same round (seeded)."""
    from zo_byzantine.attacks import Adaptive

    g = torch.Generator().manual_seed(3)
    nu, h, k = 16, 9, 4
    honest = torch.randn(h, nu, generator=g, dtype=torch.float64) * 0.5 + 1.0
    own = torch.randn(k, nu, generator=g, dtype=torch.float64)
    mask = torch.tensor([True] * k + [False] * h)
    ctx = RoundContext((0, 5, 1), h + k, k, mask, tuple(range(h + k)))
    rule = build_aggregator("fltrust", trusted=[h + k - 1], scale="median", weights="sign", merge_cosine=0.9)
    sent = Adaptive()(honest, own, rule, ctx).vectors
    units = unit_rows(sent)
    pairwise = (units @ units.T)[~torch.eye(k, dtype=torch.bool)]
    assert bool((pairwise < 0.9 - 9e-5).all()) and bool((pairwise > 0.9 - 1.1e-4).all())  # c = 0.9 - 1e-4
    torch.testing.assert_close(Adaptive()(honest, own, rule, ctx).vectors, sent)
    # around a history, each choice is evaluated as it is sent: the rows sent are among those the rule was given
    from zo_byzantine.history import History

    history = History(base="fltrust", base_kwargs={"trusted": [h + k - 1], "scale": "median", "weights": "sign",
                                                   "merge_cosine": 0.9})
    assert merging_cosine(history) == 0.9 == merging_cosine(rule) and merging_cosine(plain_rule()) is None
    seen = []

    class Spy:
        rule = history

        def __call__(self, vectors, context):
            seen.append(vectors[h:].clone())
            return history(vectors, context)

    stateful_ctx = RoundContext((0, 5, 1), h + k, k, mask, tuple(range(h + k)), {})
    sent = Adaptive()(honest, own, Spy(), stateful_ctx).vectors
    units = unit_rows(sent)
    assert bool(((units @ units.T)[~torch.eye(k, dtype=torch.bool)] < 0.9).all())
    assert any(torch.equal(rows, sent) for rows in seen)
    identical = Adaptive()(honest, own, plain_rule(), ctx).vectors
    assert torch.equal(identical, identical[:1].expand(k, -1))


def plain_rule():
    return build_aggregator("fltrust", trusted=[12], scale="median", weights="sign")


@pytest.mark.parametrize("kwargs,match", [({"scale": "max"}, "fltrust: scale='max' is not supported; accepted: "
                                           "g0, median"),
                                          ({"weights": "relu"}, "fltrust: weights='relu' is not supported; accepted: "
                                           "cosine, sign")])
def test_bad_scale_or_weights_are_refused_naming_them(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        ZOByzantineArguments(output_dir=str(tmp_path), aggregator="fltrust", num_clients=4, num_byzantine=1,
                             aggregator_kwargs={"trusted": [3], **kwargs}, root_examples=8)


def test_rows_against_the_reference_get_no_weight_and_the_output_is_g0_when_none_agrees():
    g0 = torch.tensor([1.0, 2.0, 0.0])
    honest = torch.tensor([[2.0, 1.0, 1.0], [0.5, 3.0, -1.0]])
    foe = -4.0 * honest.mean(dim=0)  # (1 - omega) hbar, omega = 5: against g0 here
    rule = FLTrust(trusted=[0])
    clean = rule(torch.cat([g0[None], honest]), ctx(3, f=0)).value
    attacked = rule(torch.cat([g0[None], honest, foe.expand(3, -1)]), ctx(6, byzantine=torch.tensor(
        [False, False, False, True, True, True]), f=3))
    torch.testing.assert_close(attacked.value, clean)
    assert attacked.diagnostics == {"zero_trust": 3, "byzantine_zero_trust": 3, "honest_zero_trust": 0,
                                    "byzantine_weight": 0.0}
    alone = rule(torch.cat([g0[None], -honest]), ctx(3, f=0))
    torch.testing.assert_close(alone.value, g0)


@pytest.mark.parametrize("seed", range(8))
def test_the_output_stays_in_g0s_ball_and_half_space_whatever_the_byzantine_rows(seed):
    g = torch.Generator().manual_seed(seed)
    nu = 6
    honest = torch.randn(5, nu, generator=g, dtype=torch.float64) + 0.5
    scale = [1e-300, 1.0, 1e150, 1e300][seed % 4]
    byzantine = scale * torch.randn(4, nu, generator=g, dtype=torch.float64)
    vectors = torch.cat([honest, byzantine])
    g0 = honest[0]
    for options in ({}, {"weights": "sign"}):
        out = FLTrust(trusted=[0], **options)(vectors, ctx(9, f=4)).value
        assert torch.isfinite(out).all()
        assert float(out.norm()) <= float(g0.norm()) * (1 + 1e-12)
        assert float(out @ g0) >= -1e-12 * float(g0.norm()) ** 2
    for weights in ("cosine", "sign"):  # the median norm's ball: 4 Byzantine rows of 9 leave it an honest norm
        out = FLTrust(trusted=[0], scale="median", weights=weights)(vectors, ctx(9, f=4)).value
        assert torch.isfinite(out).all()
        assert float(out.norm()) <= float(honest.norm(dim=1).max()) * (1 + 1e-12)
        assert float(out @ g0) >= -1e-12 * float(out.norm()) * float(g0.norm())


def test_unit_rows_do_not_overflow_and_leave_zero_rows_zero():
    x = torch.tensor([[3e300, 4e300], [0.0, 0.0], [float("inf"), 1.0]], dtype=torch.float64)
    torch.testing.assert_close(unit_rows(x), torch.tensor([[0.6, 0.8], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("trusted", [[], (), "3", [1, 1], [-1], [1.0], [True], None])
def test_bad_trusted_is_refused_naming_it(trusted):
    with pytest.raises(ValueError, match="trusted"):
        build_aggregator("fltrust", trusted=trusted)


def test_a_round_without_the_trusted_client_or_without_client_ids_is_refused():
    rows = torch.ones(3, 2)
    with pytest.raises(ValueError, match="no row of a trusted client"):
        FLTrust(trusted=[5])(rows, ctx(3))
    with pytest.raises(ValueError, match="client id of every row"):
        FLTrust(trusted=[0])(rows, RoundContext((0, 0, 1), 3, 1))


@pytest.mark.parametrize("settings,match", [
    (dict(aggregator="cwtm", root_examples=10), "root_examples=10"),
    (dict(aggregator="fltrust", aggregator_kwargs={"trusted": [8]}), "< num_clients=8"),
    (dict(aggregator="fltrust", aggregator_kwargs={"trusted": [1]}), "clients 0..1 are Byzantine"),
    (dict(aggregator="fltrust", aggregator_kwargs={"trusted": [7]}, clients_per_round=4), "clients_per_round=4"),
    (dict(aggregator="fltrust", aggregator_kwargs={"trusted": [7]}, root_examples=-1), "root_examples"),
    (dict(aggregator="fltrust"), "trusted"),
    (dict(aggregator="fltrust", aggregator_kwargs={"trusted": [7]}, pre_aggregators=["nnm"]), "pre-aggregation"),
    (dict(aggregator="history", aggregator_kwargs={"base": "fltrust", "base_kwargs": {"trusted": [7]},
                                                   "base_pre_aggregators": ["bucketing:s=2"]}), "pre-aggregation"),
])
def test_arguments_refuse_trust_settings_that_cannot_hold(tmp_path, settings, match):
    with pytest.raises(ValueError, match=match):
        ZOByzantineArguments(output_dir=str(tmp_path), num_clients=8, num_byzantine=2, report_to=[], **settings)


def test_the_root_set_is_seeded_uniform_and_replaces_only_the_trusted_shares():
    parts = partition_dataset("iid", 200, 5, seed=3)
    rooted = with_root(parts, (1, 4), 30, 200, seed=3)
    assert all(np.array_equal(a, b) for i, (a, b) in enumerate(zip(parts, rooted, strict=True)) if i not in (1, 4))
    assert np.array_equal(rooted[1], rooted[4]) and len(rooted[1]) == 30 == len(set(rooted[1].tolist()))
    assert np.array_equal(rooted[1], with_root(parts, (1,), 30, 200, seed=3)[1])
    assert not np.array_equal(rooted[1], with_root(parts, (1,), 30, 200, seed=4)[1])
    with pytest.raises(ValueError, match="root_examples=201: .* accepted: 0 \\(off\\) or 1..200"):
        with_root(parts, (1,), 201, 200, seed=3)


def test_a_trusted_client_drawn_byzantine_is_refused_before_any_work(tmp_path):
    common = dict(output_dir=str(tmp_path), num_clients=8, num_byzantine=3, byzantine_selection="random", report_to=[],
                  aggregator="fltrust")
    refused = set()
    for client in range(8):
        try:
            args = ZOByzantineArguments(**common, aggregator_kwargs={"trusted": [client]})
        except ValueError as err:
            assert "names Byzantine clients" in str(err) and f"clients [{client}] are drawn Byzantine" in str(err)
            refused.add(client)
            continue
        assert not build_federation(args, VectorDataset(64)).is_byzantine[client]
    assert refused == set(np.flatnonzero(byzantine_mask(8, 3, common_seed(tmp_path), "random")).tolist())
    assert len(refused) == 3


def common_seed(tmp_path) -> int:
    """The zo_seed a run without one gets: its seed (TrainingArguments' default 42)."""
    return ZOByzantineArguments(output_dir=str(tmp_path), report_to=[]).zo_seed


def test_a_round_without_a_trusted_report_is_skipped_not_a_crash():
    from zo_byzantine.messages import Report
    from zo_byzantine.perturbation import ParameterTable
    from zo_byzantine.server import Server, Settings

    rules = (("fltrust", {"trusted": [4]}), ("history", {"base": "fltrust", "base_kwargs": {"trusted": [4]}}))
    for rule, kwargs in rules:
        server = Server(Settings(zo_seed=1, num_perturbations=3, num_byzantine=1), build_aggregator(rule, **kwargs),
                        ParameterTable(torch.nn.Linear(2, 1)))
        plan = server.plan(0, [0, 1, 2, 3], 0.1)
        reports = [Report(0, c, torch.ones(1, 3, dtype=torch.float64), 1.0, 4) for c in range(4)]
        downlink = server.aggregate(plan, reports, 0.1)  # the trusted client 4 did not report (a Flower timeout)
        assert downlink.skipped and "trusted client [4]" in downlink.skipped


SETTINGS = dict(num_clients=6, num_byzantine=2, max_steps=8, learning_rate=0.1, num_perturbations=4,
                partition="dirichlet", aggregator="fltrust", aggregator_kwargs={"trusted": [5]}, root_examples=24,
                attack="foe", attack_kwargs={"omega": 3.0})


def _model():
    torch.manual_seed(0)
    return LogisticRegression()


def test_a_run_resumes_and_replays_bitwise_and_the_ledger_records_the_root_set(tmp_path):
    straight = _model()
    start = state(straight)
    first = make_trainer(straight, VectorDataset(128), tmp_path / "a", **SETTINGS)
    first.train()
    assert not torch.equal(state(straight)["linear.weight"], start["linear.weight"])
    saved = Ledger.read(str(tmp_path / "a" / LEDGER_NAME))
    assert saved["protocol"]["root_examples"] == 24 and saved["protocol"]["aggregator"][-1][1] == {"trusted": [5]}
    fresh = _model()
    replay(fresh, Ledger.read(str(tmp_path / "a" / LEDGER_NAME)))
    assert_same_weights(state(fresh), state(straight))

    make_trainer(_model(), VectorDataset(128), tmp_path / "b", **SETTINGS, save_strategy="steps", save_steps=4).train()
    resumed_model = _model()
    resumed = make_trainer(resumed_model, VectorDataset(128), tmp_path / "c", **SETTINGS)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-4"))
    assert_same_weights(state(resumed_model), state(straight))
    other = make_trainer(_model(), VectorDataset(128), tmp_path / "d", **{**SETTINGS, "root_examples": 12})
    with pytest.raises(LedgerError, match="protocol.root_examples: the ledger has int 24, this run int 12"):
        other.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-4"))
    # the scale and weights are recorded where they are not the paper's (a ledger written before them, which
    # records {"trusted": [5]}, still resumes: the same protocol as above), and a resume that changes them is refused
    options = {"trusted": [5], "scale": "median", "weights": "sign"}
    make_trainer(_model(), VectorDataset(128), tmp_path / "e", **{**SETTINGS, "aggregator_kwargs": options},
                 save_strategy="steps", save_steps=4).train()
    assert Ledger.read(str(tmp_path / "e" / LEDGER_NAME))["protocol"]["aggregator"][-1][1] == options
    changed = make_trainer(_model(), VectorDataset(128), tmp_path / "f",
                           **{**SETTINGS, "aggregator_kwargs": {**options, "weights": "cosine"}})
    with pytest.raises(LedgerError, match="protocol.aggregator"):
        changed.train(resume_from_checkpoint=str(tmp_path / "e" / "checkpoint-4"))


def test_history_around_fltrust_never_leaves_the_trusted_row_out_and_names_its_clients():
    from zo_byzantine.history import History
    from zo_byzantine.trusted import trusted_clients

    rule = History(base="fltrust", base_kwargs={"trusted": [0]}, threshold=1e-9)
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(7, 4, generator=g) + 1.0
    rows[0] = torch.tensor([40.0, -40.0, 40.0, -40.0])  # the trusted row: the worst agreement of the round
    state = {0: (-5.0, 3, 2)}  # a state that would leave it out first
    out = rule(rows, RoundContext((0, 3, 1), 7, 2, None, tuple(range(7)), state))
    assert out.update.state[0][0] < min(out.update.state[c][0] for c in range(1, 7))
    assert out.diagnostics["excluded"] >= 1  # others were left out, the trusted row was not (fltrust found it)
    assert trusted_clients("history", {"base": "fltrust", "base_kwargs": {"trusted": [4, 2]}}) == (2, 4)
    # the ledger's record of the inner pipeline: the paper's settings unnamed (as before the options), others named
    assert rule.pipeline == "fltrust"
    options = {"trusted": [0], "scale": "median", "weights": "sign"}
    assert History(base="fltrust", base_kwargs=options).pipeline == "fltrust(scale=median,weights=sign)"
    assert trusted_clients("history", {"base": "cwtm"}) == () == trusted_clients("cwtm", {"trusted": [1]})


def test_the_cone_strike_keeps_its_cosine_to_g0_and_pushes_against_the_honest_mean():
    from zo_byzantine.attacks import Adaptive

    g = torch.Generator().manual_seed(1)
    honest = torch.randn(6, 5, generator=g, dtype=torch.float64) + 1.0
    clients = (0, 1, 2, 3, 4, 5, 6, 7)  # honest first (the attacker's search order), 6 and 7 Byzantine
    rows = Adaptive(strike="cone", cones=[0.1, 0.5]).cone_strikes(honest, clients, (5,))
    g0, hbar = honest[5], honest.mean(dim=0)
    u = g0 / g0.norm()
    torch.testing.assert_close(unit_rows(rows) @ u, torch.tensor([0.1, 0.5], dtype=torch.float64))
    torch.testing.assert_close(rows.norm(dim=1), hbar.norm().expand(2))
    against = -hbar - (-hbar @ u) * u  # what the strike pushes along, besides u
    perp = rows - (rows @ u)[:, None] * u
    torch.testing.assert_close(unit_rows(perp) @ (against / against.norm()), torch.ones(2, dtype=torch.float64))
    assert len(Adaptive(strike="cone").cone_strikes(honest, clients, ())) == 0  # no trusted report, no cone


def test_the_adaptive_attacker_uses_the_cone_against_fltrust_and_does_more_damage_than_without():
    from zo_byzantine.attacks import Adaptive

    g = torch.Generator().manual_seed(2)
    nu, h, k = 8, 9, 3
    honest = torch.randn(h, nu, generator=g, dtype=torch.float64) * 0.5 + 1.0
    own = torch.randn(k, nu, generator=g, dtype=torch.float64)
    mask = torch.tensor([True] * k + [False] * h)
    ctx = RoundContext((0, 0, 1), h + k, k, mask, tuple(range(h + k)))  # clients 0..2 Byzantine, 11 trusted
    rule = build_aggregator("fltrust", trusted=[h + k - 1])
    hbar = honest.mean(dim=0)

    def damage(sent):  # the progress taken away along the honest mean
        return float((hbar - rule(torch.cat([sent, honest]), ctx).value) @ hbar / hbar.norm())

    with_cone = Adaptive(objective="against")(honest, own, rule, ctx)
    without = Adaptive(strike="foe", objective="against")(honest, own, rule, ctx)
    assert with_cone.diagnostics["struck"] == 1 and with_cone.diagnostics["omega"] in Adaptive().cones
    assert damage(with_cone.vectors) > damage(without.vectors)
    sent = unit_rows(with_cone.vectors) @ unit_rows(honest[-1:].clone())[0]
    assert bool((sent > 0).all())  # inside the cone: FLTrust still weights it


def test_fltrust_on_one_scalar_a_round_is_warned_about_before_any_work(tmp_path, caplog):
    import logging

    common = dict(output_dir=str(tmp_path), num_clients=8, num_byzantine=2, report_to=[], aggregator="fltrust",
                  aggregator_kwargs={"trusted": [7]})
    for nu, expected in ((1, 1), (4, 0)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="zo_byzantine.arguments"):
            ZOByzantineArguments(**common, num_perturbations=nu)
        warned = [r.getMessage() for r in caplog.records if "num_perturbations=1" in r.getMessage()]
        assert len(warned) == expected, (nu, warned)
        assert all("trusts clients [7]" in w and "sign" in w for w in warned)

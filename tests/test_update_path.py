"""The update path never applies a non-finite or overflowing step, whatever the lr and dtype; a round that
computed no loss is logged as NaN, never 0."""

import copy
import math

import pytest
import torch
from helpers import LogisticRegression, VectorDataset, make_trainer

from zo_byzantine import ZOOptimizer
from zo_byzantine.perturbation import ParameterTable


class Cast(LogisticRegression):
    """Inputs in the weights' dtype."""

    def forward(self, x, labels=None):
        return super().forward(x.to(self.linear.weight.dtype), labels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lr", [0.0, 1e-30, 1e-3, 100.0])
@pytest.mark.parametrize(("attack", "kwargs"), [("nonfinite", {"value": "inf"}), ("gaussian", {"std": 1e30}),
                                                ("gaussian", {"std": 1e300})])
def test_mean_rule_fed_extreme_values_never_moves_the_weights_to_nonfinite(tmp_path, dtype, lr, attack, kwargs):
    torch.manual_seed(0)
    model = Cast().to(dtype)
    start = [p.detach().clone() for p in model.parameters()]
    trainer = make_trainer(model, VectorDataset(64), tmp_path, num_byzantine=1, aggregator="mean", attack=attack,
                           attack_kwargs=kwargs, learning_rate=lr, lr_scheduler_type="constant", max_steps=3,
                           logging_steps=3)
    trainer.train()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    (log,) = [e for e in trainer.state.log_history if "skipped_rounds" in e]
    assert math.isfinite(log["loss"])  # the honest loss was computed, also in skipped rounds: kept
    # the mean of FLOAT32_MAX-sized values fits float64 weights (3.4e38 << sqrt(1.8e308)); nothing else does
    fits = dtype == torch.float64 and kwargs.get("std") != 1e300
    if not fits:
        assert all(torch.equal(a, b) for a, b in zip(start, model.parameters(), strict=True))  # every round refused
        assert [r.get("skipped") for r in trainer.ledger.rounds] == ["aggregate overflows the parameters' dtype"] * 3
        assert log["skipped_rounds"] == 3


class Exploding(LogisticRegression):
    def forward(self, x, labels=None):
        out = super().forward(x, labels)
        out["logits"] = out["logits"] * float("inf")
        return out


def test_rounds_that_computed_no_loss_log_nan_not_zero(tmp_path):
    trainer = make_trainer(Exploding(), VectorDataset(64), tmp_path, max_steps=2, logging_steps=1)
    output = trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "skipped_rounds" in e]
    assert len(losses) == 2 and all(math.isnan(x) for x in losses)
    assert math.isnan(output.training_loss) and math.isnan(output.metrics["train_loss"])
    final = next(e for e in trainer.state.log_history if "train_loss" in e)
    assert math.isnan(final["train_loss"])


def test_logged_loss_is_the_mean_honest_loss_of_the_window(tmp_path):
    trainer = make_trainer(LogisticRegression(), VectorDataset(64), tmp_path, max_steps=4, logging_steps=2)
    losses = []
    original = trainer.server.aggregate if trainer.server else None
    assert original is None  # the server is built with the optimizer, inside train()
    record = trainer.round_log.record

    def spy(downlink):
        losses.append(downlink.loss)
        record(downlink)

    trainer.round_log.record = spy
    output = trainer.train()
    logged = [e["loss"] for e in trainer.state.log_history if "skipped_rounds" in e]
    assert logged == pytest.approx([(losses[0] + losses[1]) / 2, (losses[2] + losses[3]) / 2], rel=1e-12)
    assert output.training_loss == pytest.approx(sum(losses) / 4, rel=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"eps": -1.0}, "eps=-1.0"), ({"eps": 0.0}, "eps=0"), ({"v0": -1.0}, "v0=-1.0"), ({"v0": math.nan}, "v0=nan"),
     ({"betas": (1.5, -1)}, "betas="), ({"betas": (0.9,)}, "betas="), ({"local_lr": -0.1}, "local_lr=-0.1")],
)
def test_server_optimizer_refuses_bad_hyperparameters(kwargs, message):
    table = ParameterTable(LogisticRegression())
    with pytest.raises(ValueError, match=message):
        ZOOptimizer(table, [{"params": table.params}], lr=0.1, server="amsgrad", **kwargs)


def test_optimizer_refuses_a_negative_or_nonfinite_scheduled_rate():
    table = ParameterTable(LogisticRegression())
    optimizer = ZOOptimizer(table, [{"params": table.params}], lr=0.1)
    for rate in (-0.1, math.nan, math.inf):
        optimizer.param_groups[0]["lr"] = rate
        optimizer.stage([(1, 1.0)])
        with pytest.raises(ValueError, match="learning rate"):
            optimizer.step()


def test_an_ordinary_float16_round_is_applied():
    """The guard's limit for float16 is its largest value, not its square root (256, which honest steps reach)."""
    from zo_byzantine import Downlink, Server, Settings, build_aggregator

    table = ParameterTable(LogisticRegression().half())
    server = Server(Settings(0, num_perturbations=16), build_aggregator("mean"), table)
    downlink = Downlink(0, 1e-6, seed_tuples=[(0, 0, 1, r) for r in range(16)], coefficients=[2.0] * 16)
    server._check_overflow(downlink)  # sum |c| = 32: applied
    downlink.coefficients = [1e4] * 16  # 10 * 1.6e5 > 65504: would overflow float16
    with pytest.raises(Exception, match="overflows"):
        server._check_overflow(downlink)


def test_replay_refuses_a_well_formed_ledger_whose_update_overflows_and_leaves_the_model_untouched(tmp_path):
    from zo_byzantine import LedgerError, replay

    torch.manual_seed(0)
    model = LogisticRegression()
    start = copy.deepcopy(model)
    trainer = make_trainer(model, VectorDataset(64), tmp_path, max_steps=3)
    trainer.train()
    trainer.ledger.rounds[1]["coefficients"] = [1e300] * len(trainer.ledger.rounds[1]["coefficients"])
    forged = trainer.ledger.to_dict()  # the digest recomputed: well-formed, only the HMAC would tell
    before = [p.detach().clone() for p in start.parameters()]
    with pytest.raises(LedgerError, match="Round 1: its update would overflow"):
        replay(start, forged)
    assert all(torch.equal(a, b) for a, b in zip(before, start.parameters(), strict=True))


def test_a_dense_update_reaches_parameters_on_another_device():
    """The server aggregates R^d updates (first order, FedZO) on the CPU; the model may sit on an accelerator
    (found on an H100: FedGD stopped at its first step). The meta device stands in for it; it lets a plain
    ``add_`` of a CPU tensor through, but not AMSGrad's arithmetic on the state, so the server optimizer is AMSGrad
    (both servers read the update through the same line)."""
    table = ParameterTable(LogisticRegression().to("meta"))
    optimizer = ZOOptimizer(table, [{"params": table.params}], lr=0.1, server="amsgrad", local_lr=0.01)
    optimizer.stage_dense([torch.ones(p.shape, dtype=torch.float64) for _, p in table])
    optimizer.step()
    assert all(p.device.type == "meta" for _, p in table)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize("config", [
    {"estimator": "first_order"},  # FedAvg / FedGD: R^d gradients aggregated on the CPU
    {"aggregation_space": "parameter"},  # FedZO: R^d estimates reconstructed from the CPU scalars
    {"local_steps": 2, "local_update": "compressed", "local_learning_rate": 1e-2},  # Z_t^T Z_l streamed
    {"directions": "per_client"},  # FedES, stacked per client
])
def test_every_update_path_trains_on_cuda_as_on_the_cpu(tmp_path, config):
    """Found on an H100: a CPU aggregate met CUDA weights. Each path's weights after 3 rounds on CUDA equal the CPU's
    (float64; the directions are the same bits on both devices)."""
    torch.manual_seed(0)
    models = {device: LogisticRegression().double() for device in ("cpu", "cuda")}
    models["cuda"].load_state_dict(models["cpu"].state_dict())
    for device, model in models.items():
        make_trainer(model, VectorDataset(64, dtype=torch.float64), tmp_path / device, max_steps=3, num_perturbations=2,
                     use_cpu=device == "cpu", **config).train()
    for a, b in zip(models["cpu"].parameters(), models["cuda"].parameters(), strict=True):
        assert b.device.type == "cuda"
        torch.testing.assert_close(a, b.cpu(), rtol=1e-9, atol=1e-12)

"""Local steps, estimator variants and baselines against slow obvious implementations (float64)."""

import copy

import pytest
import torch
from helpers import LogisticRegression, VectorDataset, gaussian_like, make_trainer

from zo_byzantine import LedgerError, replay
from zo_byzantine.client import Oracle
from zo_byzantine.perturbation import ParameterTable, direction_seed, perturbed

B, N, NU, MU = 4, 3, 2, 1e-3


def _model():
    torch.manual_seed(0)
    return LogisticRegression().double()


class Data(VectorDataset):
    def __getitem__(self, i):
        item = super().__getitem__(i)
        return {"x": item["x"].double(), "labels": item["labels"]}


def _trainer(model, tmp_path, **kwargs):
    settings = dict(
        num_clients=N,
        per_device_train_batch_size=B,
        num_perturbations=NU,
        zo_eps=MU,
        max_steps=2,
        learning_rate=0.1,
        lr_scheduler_type="constant",
        logging_steps=1,
    )
    settings.update(kwargs)
    return make_trainer(model, Data(96), tmp_path, **settings)


def _flat(model):
    return torch.cat([p.detach().flatten() for p in ParameterTable(model).params])


class Reference:
    """Copies models; evaluates each client alone at explicit weight vectors."""

    def __init__(self, model, dataset, trainer):
        self.model, self.dataset, self.fed, self.seed = (
            copy.deepcopy(model),
            dataset,
            trainer.federation,
            trainer.args.zo_seed,
        )
        self.table = ParameterTable(self.model)

    def z(self, *key):
        seed = direction_seed(*key)
        return torch.cat([gaussian_like(p, seed, j).flatten() for j, p in self.table])

    def loss(self, w, t, client):
        return self.loss_on(w, self.fed.round_indices(t)[client * B : (client + 1) * B])

    def loss_on(self, w, indices):
        """Loss at the weight vector ``w`` on the examples ``indices`` of the data set."""
        start = 0
        with torch.no_grad():
            for p in self.table.params:
                p.copy_(w[start : start + p.numel()].view_as(p))
                start += p.numel()
            x = torch.stack([self.dataset[i]["x"] for i in indices])
            y = torch.stack([self.dataset[i]["labels"] for i in indices])
            return torch.nn.functional.cross_entropy(self.model(x)["logits"], y)

    def v(self, w, t, client, zs, estimator="two_point"):
        if estimator == "one_point":
            base = self.loss(w, t, client)
            return torch.stack([(self.loss(w + MU * z, t, client) - base) / MU for z in zs]) / len(zs)
        return torch.stack(
            [(self.loss(w + MU * z, t, client) - self.loss(w - MU * z, t, client)) / (2 * MU) for z in zs]
        ) / len(zs)


def _reference_rounds(model, trainer, mode, K, lr, local_lr, rounds, estimator="two_point", server=None):
    ref = Reference(model, trainer.train_dataset, trainer)
    w = _flat(model).clone()
    for t in range(rounds):
        steps = []  # (zs, [v_i])
        local = [w.clone() for _ in range(N)]
        for l in range(1, K + 1):
            zs = [ref.z(ref.seed, t, 1 if mode == "biased" else l, r) for r in range(NU)]
            vs = [ref.v(local[i], t, i, zs, estimator) for i in range(N)]
            steps.append((zs, vs))
            for i in range(N):
                local[i] = local[i] - local_lr * sum(vs[i][r] * zs[r] for r in range(NU))
        if mode == "unbiased":
            g = sum(sum(torch.stack(vs).mean(0)[r] * zs[r] for r in range(NU)) for zs, vs in steps)
        elif mode == "biased":
            zs = steps[0][0]
            sent = [sum(vs[i] for _, vs in steps) for i in range(N)]
            g = sum(torch.stack(sent).mean(0)[r] * zs[r] for r in range(NU))
        else:  # compressed
            z0 = [ref.z(ref.seed, t, 0, r) for r in range(NU)]
            u = [sum(sum(vs[i][r] * zs[r] for r in range(NU)) for zs, vs in steps) for i in range(N)]
            sent = [torch.stack([torch.dot(z, u[i]) for z in z0]) / NU for i in range(N)]
            g = sum(torch.stack(sent).mean(0)[r] * z0[r] for r in range(NU))
        w = server(g) if server else w - lr * g
    return w


@pytest.mark.parametrize("mode", ["unbiased", "biased", "compressed"])
def test_local_steps_match_a_slow_implementation_that_copies_models(tmp_path, mode):
    model = _model()
    start = copy.deepcopy(model)
    trainer = _trainer(model, tmp_path, local_steps=3, local_update=mode, local_learning_rate=0.5)
    before = _flat(model).clone()
    trainer.train()
    expected = _reference_rounds(start, trainer, mode, K=3, lr=0.1, local_lr=0.5, rounds=2)
    torch.testing.assert_close(_flat(model), expected, rtol=1e-9, atol=1e-12)
    assert not torch.equal(_flat(model), before)


@pytest.mark.parametrize("mode", ["unbiased", "compressed"])
def test_kept_local_models_equal_regenerated_ones_with_passes_linear_in_k(tmp_path, mode):
    """Local models kept (the default budget) or regenerated from their terms (budget 0): the same rounds up to
    rounding; generator passes per round (units of d; N = 3 clients, nu = 2, K = 4, two forwards):
    kept:        4 (step 1, shared) + 3 steps x 3 clients x (nu to advance + 2 nu perturbed) + K nu update = 66
    regenerated: 4 + 3 clients x sum_{l=2..4} 2 nu ((l - 1) nu + 1) + 8 = 192 (unbiased)."""
    runs = {}
    for budget in (1.0, 0.0):
        model = _model()
        trainer = _trainer(model, tmp_path / str(budget), local_steps=4, local_update=mode, local_learning_rate=0.5,
                           zo_cache_budget_gb=budget, zo_schedule="two_forwards")
        trainer.train()
        passes = [e["generator_passes_per_round"] for e in trainer.state.log_history if "loss" in e]
        runs[budget] = (_flat(model), passes, [r["coefficients"] for r in trainer.ledger.rounds])
    (kept, kept_passes, kept_coeffs), (regen, regen_passes, regen_coeffs) = runs[1.0], runs[0.0]
    torch.testing.assert_close(kept, regen, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(torch.tensor(kept_coeffs), torch.tensor(regen_coeffs), rtol=1e-9, atol=1e-12)
    # compressed: the update draws the basis Z_t (nu = 2 instead of K nu = 8), and the projection Z_t^T Z_l
    # draws nu + K nu = 10: 4 more in all
    extra = 4 if mode == "compressed" else 0
    assert kept_passes == [66 + extra] * 2 and regen_passes == [192 + extra] * 2


def test_k1_biased_and_unbiased_are_bitwise_identical(tmp_path):
    a, b = _model(), _model()
    _trainer(a, tmp_path / "a", local_update="unbiased").train()
    _trainer(b, tmp_path / "b", local_update="biased").train()
    assert torch.equal(_flat(a), _flat(b))


def test_round_leaves_global_weights_exactly_at_the_update(tmp_path):
    model = LogisticRegression()  # float32: the replay applies only the updates, bitwise
    start = copy.deepcopy(model)
    trainer = make_trainer(
        model,
        VectorDataset(96),
        tmp_path,
        num_clients=3,
        local_steps=3,
        local_learning_rate=0.3,
        num_perturbations=2,
        max_steps=3,
    )
    trainer.train()
    replay(start, trainer.ledger.to_dict())
    assert torch.equal(_flat(start), _flat(model))


def test_parameter_space_mean_equals_projection_space_mean(tmp_path):
    a, b = _model(), _model()
    _trainer(a, tmp_path / "a", aggregation_space="parameter").train()
    _trainer(b, tmp_path / "b").train()
    torch.testing.assert_close(_flat(a), _flat(b), rtol=1e-10, atol=1e-12)


def test_parameter_space_is_refused_when_it_does_not_fit(tmp_path):
    trainer = _trainer(_model(), tmp_path, aggregation_space="parameter", dense_memory_limit_gb=1e-9)
    with pytest.raises(ValueError, match="needs about .* GiB for n=3 x d=18; dense_memory_limit_gb"):
        trainer.train()


def test_gradient_projection_on_a_quadratic_is_exact():
    torch.manual_seed(0)
    A, b = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, dtype=torch.float64)

    class Quadratic(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))

        def forward(self):
            return 0.5 * ((A @ self.w - b) ** 2).sum()

    model = Quadratic()
    table = ParameterTable(model)

    class Clients:
        def gradients(self, terms_per_client):
            with torch.enable_grad(), perturbed(table, terms_per_client[0]):
                loss = model()
                return [list(torch.autograd.grad(loss, table.params))], loss.detach().reshape(1)

    seeds = [[direction_seed(1, 2, 3, r) for r in range(3)]]
    oracle = Oracle(Clients(), table, seeds, [[]])
    grad = A.T @ (A @ model.w.detach() - b)
    for r in range(3):
        z = gaussian_like(model.w, seeds[0][r], 0)
        assert oracle.grad_dot(r).item() == pytest.approx(torch.dot(grad, z).item(), rel=1e-12)


def test_gradient_projection_trains_through_the_trainer(tmp_path):
    model = _model()
    before = _flat(model).clone()
    _trainer(model, tmp_path, estimator="gradient_projection", max_steps=3).train()
    assert not torch.equal(before, _flat(model))


def test_zo_adafl_server_matches_the_formulas_for_three_steps(tmp_path):
    model = _model()
    start = copy.deepcopy(model)
    trainer = _trainer(
        model,
        tmp_path,
        estimator="one_point",
        local_steps=2,
        local_learning_rate=0.05,
        server_optimizer="amsgrad",
        learning_rate=0.01,
        max_steps=3,
    )
    trainer.train()
    state = {}

    def amsgrad(g, w=None):
        h = 0.05 * g
        if not state:
            state.update(m=torch.zeros_like(h), v=torch.full_like(h, 1e-5), vhat=torch.full_like(h, 1e-5))
        state["m"] = 0.9 * state["m"] + 0.1 * h
        state["v"] = 0.99 * state["v"] + 0.01 * h * h
        state["vhat"] = torch.maximum(state["vhat"], state["v"])
        return state["m"] / torch.sqrt(state["vhat"] + 1e-8)

    w = _flat(start).clone()
    ref_w = [w]

    def server(g):
        ref_w[0] = ref_w[0] - 0.01 * amsgrad(g)
        return ref_w[0]

    expected = _reference_rounds(
        start, trainer, "unbiased", K=2, lr=0.01, local_lr=0.05, rounds=3, estimator="one_point", server=server
    )
    torch.testing.assert_close(_flat(model), expected, rtol=1e-9, atol=1e-12)
    replayed = copy.deepcopy(start)
    replay(replayed, trainer.ledger.to_dict())  # the ledger replays the AMSGrad server too, bitwise
    assert torch.equal(_flat(replayed), _flat(model))


def test_fedes_with_one_client_is_the_antithetic_two_point_step(tmp_path):
    model = _model()
    start = copy.deepcopy(model)
    trainer = _trainer(model, tmp_path, num_clients=1, directions="per_client", num_perturbations=1, max_steps=1)
    trainer.train()
    ref = Reference(start, trainer.train_dataset, trainer)
    w = _flat(start)
    z = ref.z(trainer.args.zo_seed, 0, 1, 0, 0)  # client 0's own direction
    g = (ref.loss(w + MU * z, 0, 0) - ref.loss(w - MU * z, 0, 0)) / (2 * MU)
    torch.testing.assert_close(_flat(model), w - 0.1 * g * z, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("directions", ["per_client", "shared"])
def test_each_direction_on_its_own_batch_is_the_papers_fedes_step(tmp_path, directions):
    """``zo_direction_batch_size = n_B``: direction ``r`` of client ``i`` is evaluated on examples ``[r n_B, (r+1)
    n_B)`` of the client's batch (FedES's one loss difference per batch), written out by copying the model."""
    n_b, nu, rounds = 3, 4, 2
    model = _model()
    start = copy.deepcopy(model)
    trainer = _trainer(model, tmp_path, directions=directions, aggregator="mean", num_perturbations=nu,
                       per_device_train_batch_size=nu * n_b, zo_direction_batch_size=n_b, max_steps=rounds)
    trainer.train()
    ref = Reference(start, trainer.train_dataset, trainer)
    w = _flat(start)
    for t in range(rounds):
        indices = trainer.federation.round_indices(t)
        g = torch.zeros_like(w)
        for i in range(N):
            for r in range(nu):
                rows = indices[i * nu * n_b + r * n_b : i * nu * n_b + (r + 1) * n_b]
                z = ref.z(ref.seed, t, 1, r, i) if directions == "per_client" else ref.z(ref.seed, t, 1, r)
                slope = (ref.loss_on(w + MU * z, rows) - ref.loss_on(w - MU * z, rows)) / (2 * MU)
                g = g + slope / nu * z / N
        w = w - 0.1 * g
    torch.testing.assert_close(_flat(model), w, rtol=1e-10, atol=1e-12)
    replayed = copy.deepcopy(start)
    replay(replayed, trainer.ledger.to_dict())
    assert torch.equal(_flat(replayed), _flat(model))


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(per_device_train_batch_size=5), "per_device_train_batch_size = num_perturbations x"),
    (dict(estimator="one_point"), "estimator='two_point'"),
    (dict(local_steps=2), "local_steps=1"),
    (dict(zo_direction_batch_size=-1), "zo_direction_batch_size"),
])
def test_direction_batches_refuse_what_they_cannot_mean(tmp_path, kwargs, match):
    settings = {"num_perturbations": 2, "per_device_train_batch_size": 6, "zo_direction_batch_size": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        _trainer(_model(), tmp_path, **settings)


def test_fedes_clients_use_their_own_directions_and_data_size_weights(tmp_path):
    trainer = _trainer(
        _model(),
        tmp_path,
        num_clients=3,
        directions="per_client",
        max_steps=1,
        partition="dirichlet",
        dirichlet_alpha=0.5,
        min_client_examples=4,
    )
    trainer.train()
    seeds = trainer.ledger.rounds[0]["seeds"]
    assert sorted({s[4] for s in seeds}) == [0, 1, 2] and len(seeds) == 3 * NU


def test_first_order_fedavg_learns_and_is_not_replayable(tmp_path):
    model = _model()
    start = copy.deepcopy(model)
    dataset = Data(256)
    before = torch.nn.functional.cross_entropy(model(dataset.x.double())["logits"], dataset.y).item()
    trainer = _trainer(model, tmp_path, estimator="first_order", max_steps=30, learning_rate=0.5, aggregator="median")
    trainer.train()
    after = torch.nn.functional.cross_entropy(model(dataset.x.double())["logits"], dataset.y).item()
    assert after < 0.7 * before
    with pytest.raises(LedgerError, match="dense update"):
        replay(start, trainer.ledger.to_dict())


@pytest.mark.parametrize(
    ("kwargs", "up", "down"),
    [
        ({"local_steps": 3, "local_update": "unbiased"}, 3 * NU, 3 * NU),
        ({"local_steps": 3, "local_update": "biased"}, NU, NU),
        ({"local_steps": 3, "local_update": "compressed"}, NU, NU),
        ({"estimator": "first_order"}, 18, 18),
        ({"aggregation_space": "parameter"}, NU, 18),
        ({"directions": "per_client"}, NU, N * NU),
    ],
)
def test_communication_counters_follow_the_variant(tmp_path, kwargs, up, down):
    trainer = _trainer(_model(), tmp_path, max_steps=1, **kwargs)
    trainer.train()
    log = next(e for e in trainer.state.log_history if "uplink_scalars_per_client" in e)
    assert (log["uplink_scalars_per_client"], log["downlink_scalars_per_client"]) == (up, down)
    assert log["uplink_bytes_total"] == N * up * 4 and log["fedavg_bytes_per_client"] == 18 * 4

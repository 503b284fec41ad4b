"""Seeds, directions, perturbed forwards and the update, against obvious references."""

import copy

import pytest
import torch
from helpers import gaussian_like, tiny_bert, tiny_gpt2

from zo_byzantine.perturbation import (
    COUNTER,
    ParameterTable,
    apply_update,
    direction_seed,
    perturbed,
)


def _direction(table, seed):
    return [gaussian_like(p, seed, j) for j, p in table]


def test_same_seed_tuple_same_direction_and_different_tuples_differ():
    table = ParameterTable(tiny_bert())
    a = _direction(table, direction_seed(7, 3, 1, 0))
    b = _direction(table, direction_seed(7, 3, 1, 0))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for other in [(8, 3, 1, 0), (7, 4, 1, 0), (7, 3, 2, 0), (7, 3, 1, 1)]:
        c = _direction(table, direction_seed(*other))
        assert not any(torch.equal(x, y) for x, y in zip(a, c, strict=True)), other


def test_global_rng_untouched():
    table = ParameterTable(tiny_bert())
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    _direction(table, direction_seed(1, 2, 3, 4))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_perturbed_forward_sees_w_plus_cz_and_restores_exactly(dtype):
    model = tiny_bert().to(dtype).eval()
    table = ParameterTable(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seeds = [direction_seed(0, 0, 1, 0), direction_seed(0, 0, 1, 1)]
    terms = [(seeds[0], 1e-3), (seeds[1], -2e-3)]
    ids = torch.tensor([[2, 10, 11, 12, 3], [2, 13, 14, 3, 0]])

    reference = copy.deepcopy(model)  # obvious implementation: write w + sum c z into a copy
    with torch.no_grad():
        for j, p in ParameterTable(reference):
            p.add_(gaussian_like(p, seeds[0], j) * 1e-3 + gaussian_like(p, seeds[1], j) * -2e-3)
        expected = reference(input_ids=ids).logits

    with torch.no_grad(), perturbed(table, terms):
        got = model(input_ids=ids).logits
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
    assert not torch.equal(got, model(input_ids=ids).logits)  # the perturbation did something
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # bitwise: stored weights never written


@pytest.mark.parametrize("build", [tiny_bert, tiny_gpt2])
def test_embeddings_are_perturbed_by_the_rows_they_read_with_the_same_bits(build):
    """A plain embedding read without gradients gets only the rows its input reads (``perturb_rows``): the forward's
    output is bitwise the one of the weights ``perturb`` forms whole (an obvious reference: written into a copy);
    the draws count the rest of the model whole and, per embedding, those rows; a tied LM head (GPT-2) is drawn
    whole by the head, and no perturbed table is held through the forward."""
    model = build().eval()
    table = ParameterTable(model)
    terms = [(direction_seed(0, 0, 1, 0), 1e-3), (direction_seed(0, 0, 1, 1), -2e-3)]
    ids = torch.tensor([[2, 10, 11, 12, 3], [2, 13, 14, 3, 0]])
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for j, p in ParameterTable(reference):
            p.copy_(table.directions.perturb(p, j, terms))
        expected = reference(input_ids=ids).logits
        start = COUNTER.drawn
        with perturbed(table, terms):
            got = model(input_ids=ids).logits
    assert torch.equal(got, expected)
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    read = {"word_embeddings": ids.unique().numel(), "wte": ids.unique().numel(), "position_embeddings": 5,
            "wpe": 5, "token_type_embeddings": 1}
    names = {id(m): name.split(".")[-1] for name, m in model.named_modules()}
    tied = build is tiny_gpt2  # wte is also the head's weight: drawn whole there
    whole = table.numel - sum(m.weight.numel() for m in embeddings) + (model.transformer.wte.weight.numel()
                                                                     if tied else 0)
    rows = sum(read[names[id(m)]] * m.embedding_dim for m in embeddings)
    assert COUNTER.drawn - start == len(terms) * (whole + rows)
    assert all(m.padding_idx == r.padding_idx for m, r in zip(model.modules(), reference.modules(), strict=True)
               if isinstance(m, torch.nn.Embedding))


def test_perturbed_restores_after_exception():
    model = tiny_bert().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(IndexError), perturbed(ParameterTable(model), [(1, 1.0)]):
        model(input_ids=torch.tensor([[10_000]]))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())


def test_apply_update_matches_formula_with_weight_decay():
    model = tiny_bert()
    table = ParameterTable(model)
    w0 = [p.detach().clone() for p in table.params]
    seeds = [direction_seed(5, 1, 1, r) for r in range(3)]
    coeffs = [0.5, -1.25, 2.0]
    lr, wd = 0.1, 0.01
    apply_update(table, list(zip(seeds, coeffs, strict=True)), lr, {0: wd})
    for j, p in table:
        step = sum(c * gaussian_like(p, s, j).double() for s, c in zip(seeds, coeffs, strict=True))
        decay = wd * w0[j].double() if j == 0 else 0.0
        expected = w0[j].double() - lr * (step + decay)
        torch.testing.assert_close(p.double(), expected, rtol=1e-6, atol=1e-6)


def test_generator_count_is_per_element():
    model = tiny_bert()
    table = ParameterTable(model)
    start = COUNTER.drawn
    apply_update(table, [(1, 1.0), (2, 1.0)], 0.0)
    assert COUNTER.drawn - start == 2 * table.numel


class Cubic(torch.nn.Module):
    """F(w) = sum(w^3)/3 + sum(w^2): gradient w^2 + 2w."""

    def __init__(self, d=50):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, d, dtype=torch.float64))

    def forward(self):
        return (self.w**3).sum() / 3 + (self.w**2).sum()


def test_two_point_estimate_is_directional_derivative_up_to_mu_squared():
    from zo_byzantine.estimators import TwoPoint

    model = Cubic()
    table = ParameterTable(model)
    seed = direction_seed(0, 0, 1, 0)
    z = gaussian_like(model.w, seed, 0)
    exact = torch.dot(model.w.detach() ** 2 + 2 * model.w.detach(), z).item()

    class Oracle:  # one client, direction 0 = z
        def loss(self, r, coeff):
            with torch.no_grad(), perturbed(table, [] if r is None else [(seed, coeff)]):
                return model().reshape(1)

        def loss_pairs(self, mu):  # [clients, directions] each
            return self.loss(0, mu)[:, None], self.loss(0, -mu)[:, None]

    errors = []
    for mu in (1e-1, 1e-2):
        estimate = TwoPoint(mu)(Oracle(), 1).vectors[0, 0].item()
        errors.append(abs(estimate - exact))
        # central difference of a cubic: error = mu^2 * sum(z^3) / 3 exactly
        assert errors[-1] == pytest.approx(abs(mu**2 * (z**3).sum().item() / 3), rel=1e-4)
    assert errors[1] < errors[0] / 50  # O(mu^2)

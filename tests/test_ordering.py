"""The NumPy sorts of ``zo_byzantine.ordering`` against torch's: same values, same stable order, same layout."""

import pytest
import torch

from zo_byzantine.ordering import argsort_stable, sort_values


def awkward(shape, dtype, seed):
    """Values with ties, signed zeros, infinities and NaNs (where torch and NumPy could disagree)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, shape, generator=g).to(dtype) / 2
    pick = torch.rand(shape, generator=g)
    x[pick < 0.05] = -0.0
    x[(pick >= 0.05) & (pick < 0.08)] = float("nan")
    x[(pick >= 0.08) & (pick < 0.10)] = float("inf")
    x[(pick >= 0.10) & (pick < 0.12)] = -float("inf")
    x[pick > 0.6] = torch.randn(int((pick > 0.6).sum()), generator=g).to(dtype)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("shape", "dim"), [((40, 300), 0), ((300, 31), 1), ((5, 40, 70), 1), ((3, 7, 9), -1)])
def test_sort_values_equals_torch(dtype, shape, dim):
    x = awkward(shape, dtype, seed=len(shape) * 100 + dim)
    ours, theirs = sort_values(x, dim), x.sort(dim=dim).values
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype and ours.is_contiguous()
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(torch.nan_to_num(ours), torch.nan_to_num(theirs))
    # a window mean computed from either has the same bits
    assert torch.equal(torch.nan_to_num(ours).narrow(dim, 1, 3).mean(dim=dim),
                       torch.nan_to_num(theirs).narrow(dim, 1, 3).mean(dim=dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("shape", "dim"), [((40, 300), 0), ((6, 40, 40), -1), ((200, 12), 1)])
def test_argsort_stable_equals_torch(dtype, shape, dim):
    x = awkward(shape, dtype, seed=7 + dim)
    ours = argsort_stable(x, dim)
    assert ours.dtype == torch.int64
    assert torch.equal(ours, x.argsort(dim=dim, stable=True))


def test_non_contiguous_input_and_torch_fallbacks():
    x = awkward((30, 50), torch.float64, seed=3).T  # a transposed view
    assert torch.equal(torch.nan_to_num(sort_values(x, 1)), torch.nan_to_num(x.sort(dim=1).values))
    assert torch.equal(argsort_stable(x, 0), x.argsort(dim=0, stable=True))
    half = torch.randn(20, 8).half()  # no NumPy path: torch's sort
    assert torch.equal(sort_values(half, 0), half.sort(dim=0).values)
    grad = torch.randn(20, 8, requires_grad=True)
    assert torch.equal(sort_values(grad, 0), grad.sort(dim=0).values)
    ints = torch.randint(0, 5, (20, 8))
    assert torch.equal(argsort_stable(ints, 0), ints.argsort(dim=0, stable=True))

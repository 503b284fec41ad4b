"""benchmarks/fedes_noise.py: FedES's noise formula against Monte-Carlo draws of the estimate itself."""

import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from fedes import MLP  # noqa: E402
from fedes_noise import batch_gradient, client_batches, measure  # noqa: E402


def test_noise_norm_is_the_spread_of_sampled_estimates():
    """Two clients of unequal size (rho 1/3, 2/3) holding alike examples of one label, 2 directions of 5 examples each:
    ``noise_norm``^2 equals the mean ``||g_hat - g||^2`` of 4,000 estimates drawn as Algorithm 1 forms them (a
    Gaussian z per client and batch, ``z z^T g_k^b``), within 5 %; the shared-direction form likewise with one z per
    batch index. With one label the clients' gradients align, so the shared form is larger by far more than the
    tolerance (for equal gradients sqrt((1/3 + 2/3)^2 / (1/9 + 4/9)) = 1.34): neither passes for the other. Both
    also equal the formulas written out on the batches' gradients (1e-9)."""
    torch.manual_seed(0)
    model = MLP(width=3)
    x, labels = torch.randn(784) + 0.1 * torch.randn(30, 784), torch.zeros(30, dtype=torch.long)  # alike
    federation = SimpleNamespace(partitions=[np.arange(10), np.arange(10, 30)])
    nu, n_b, seed = 2, 5, 3
    got = measure(model, federation, x, labels, n_b, nu, lr=0.01, probe=30, directions=2, seed=seed)

    rng = np.random.default_rng(seed)  # the batches measure() formed: same generator, same order
    grads = [torch.stack([batch_gradient(model, x[b], labels[b]) for b in client_batches(p, nu, n_b, rng)])
             for p in federation.partitions]
    rho = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
    g = sum(r * gk.mean(0) for r, gk in zip(rho, grads, strict=True))
    n, draws = g.numel(), 4000
    generator = torch.Generator().manual_seed(1)
    per_client, shared = torch.zeros(draws, n, dtype=torch.float64), torch.zeros(draws, n, dtype=torch.float64)
    common = torch.randn(draws, nu, n, generator=generator, dtype=torch.float64)
    for r, gk in zip(rho, grads, strict=True):
        z = torch.randn(draws, nu, n, generator=generator, dtype=torch.float64)
        per_client += r / nu * torch.einsum("db,dbn->dn", torch.einsum("dbm,bm->db", z, gk), z)
        shared += r / nu * torch.einsum("db,dbn->dn", torch.einsum("dbm,bm->db", common, gk), common)
    sampled = (per_client - g).pow(2).sum(1).mean().sqrt()
    sampled_shared = (shared - g).pow(2).sum(1).mean().sqrt()
    assert abs(got["noise_norm"] / float(sampled) - 1) < 0.05, (got["noise_norm"], float(sampled))
    assert abs(got["shared_noise_norm"] / float(sampled_shared) - 1) < 0.05
    assert got["shared_noise_norm"] > 1.2 * got["noise_norm"]  # the two forms are told apart
    exact = (n + 1) * sum(r ** 2 / nu ** 2 * float(gk.pow(2).sum()) for r, gk in zip(rho, grads, strict=True))
    exact_shared = (n + 1) / nu ** 2 * float(sum(r * gk for r, gk in zip(rho, grads, strict=True)).pow(2).sum())
    assert abs(got["noise_norm"] ** 2 / exact - 1) < 1e-9
    assert abs(got["shared_noise_norm"] ** 2 / exact_shared - 1) < 1e-9
    assert abs(got["grad_norm"] / float(g.norm()) - 1) < 1e-9
    assert got["descent"] < 0  # a small step along -g lowers the loss


@pytest.mark.parametrize(("argv", "message"), [
    (["--probe", "0"], "--probe=0: accepted values are integers >= 1"),
    (["--probe", "60001"], "--probe=60001: accepted values are 1 to 60,000"),
    (["--directions", "0"], "--directions=0"), (["--lr", "0"], "--lr=0.0: accepted values are numbers > 0"),
    (["--out", "/nonexistent/noise.jsonl"], "--out='/nonexistent/noise.jsonl': its folder does not exist"),
    (["--checkpoint", "/nonexistent"], "--checkpoint='/nonexistent': no model.safetensors in it"),
    (["--runs_dir", "/nonexistent"], "--run='fedes_iid_nB64_s0_db': no checkpoint"),
])
def test_fedes_noise_refuses_bad_arguments_before_any_work(argv, message, capsys):
    from fedes_noise import main

    with pytest.raises(SystemExit):
        main(["--run", "fedes_iid_nB64_s0_db", "--data", "/nonexistent", *argv])
    assert message in capsys.readouterr().err

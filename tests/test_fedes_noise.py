"""experiments/fedes/fedes_noise.py: FedES's noise formula against Monte-Carlo draws of the estimate itself."""

import json
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments", "fedes"))

from fedes import MLP  # noqa: E402
from fedes_noise import batch_gradient, client_batches, measure, random_walk, walk  # noqa: E402


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
    (["--walk", "/nonexistent.jsonl"], "--walk='/nonexistent.jsonl': no such file"),
    (["--walk", __file__, "--out", "/tmp/noise.jsonl"], "--out with --walk: --walk measures nothing"),
    (["--walk", __file__, "--probe", "100"], "--probe with --walk"),
])
def test_fedes_noise_refuses_bad_arguments_before_any_work(argv, message, capsys):
    from fedes_noise import main

    with pytest.raises(SystemExit):
        main(["--run", "fedes_iid_nB64_s0_db", "--data", "/nonexistent", *argv])
    assert message in capsys.readouterr().err


def test_random_walk_adds_the_noise_of_every_round_before_t():
    """Hand-computed: ||w_0|| = 3, noise 100 at round 0 and 300 at round 2 (interpolated: 200 at round 1, held at
    300 after 2), lr 0.01: ||w_t||^2 = 9 + 1e-4 (1e4 + 4e4 + 9e4 + 9e4) at t = 4, the rounds before t only."""
    got = random_walk(3.0, {0: 100.0, 2: 300.0}, 0.01, [1, 2, 4])
    assert got == pytest.approx({1: 10 ** 0.5, 2: 14 ** 0.5, 4: 32 ** 0.5}, rel=1e-12)
    # before the first measured round (as a run's first checkpoint at round 10): held at its value, 100 each round
    assert random_walk(3.0, {5: 100.0, 9: 500.0}, 0.01, [3]) == pytest.approx({3: 12 ** 0.5}, rel=1e-12)


def test_walk_refuses_a_run_with_a_decaying_rate(capsys):
    from fedes_noise import main

    with pytest.raises(SystemExit):
        main(["--run", "fedes_dirichlet_nB256_s0_db_cosine1200", "--walk", __file__])
    assert "the walk assumes the constant rate" in capsys.readouterr().err


def test_walk_reads_one_runs_measurements_and_starts_from_its_seeded_weights(tmp_path, capsys):
    """``--walk``: only the run's lines at its n_B and the asked lr, with a weight norm, count; round 0 is
    fedes.run's seeded MLP; the walk steps at the run's rate (0.01) whatever lr the ratios were measured at; a file
    without such a line, a checkpoint measured twice and a checkpoint that is not checkpoint-<round> are refused."""
    torch.manual_seed(2)
    start = float(torch.nn.utils.parameters_to_vector(MLP().parameters()).detach().norm())
    run = "fedes_dirichlet_nB1024_s2_db"
    lines = [{"run": run, "checkpoint": "checkpoint-10", "n_B": 1024, "lr": 0.005, "weight_norm": 40.0,
              "noise_norm": 100.0, "ratio": 0.5},
             {"run": run, "checkpoint": "checkpoint-10", "n_B": 1024, "lr": 0.01, "weight_norm": 40.0,
              "noise_norm": 7e9, "ratio": 8.0},  # another lr: left out
             {"run": run, "checkpoint": "checkpoint-15", "n_B": 1024, "lr": 0.005, "noise_norm": 7e9,
              "ratio": 8.0},  # no weight norm: left out
             {"run": run, "checkpoint": "checkpoint-20", "n_B": 64, "lr": 0.005, "weight_norm": 1.0,
              "noise_norm": 9e9, "ratio": 9.0},  # another n_B: left out
             {"run": "fedes_iid_nB64_s0_db", "checkpoint": "checkpoint-30", "n_B": 1024, "lr": 0.005,
              "weight_norm": 1.0, "noise_norm": 9e9, "ratio": 9.0}]  # another run: left out
    path = tmp_path / "noise.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = walk(str(path), run, 2, 1024, 0.005)
    walked = (start ** 2 + 10 * (0.01 * 100.0) ** 2) ** 0.5  # 10 rounds of noise 100 at the run's rate 0.01
    assert rows == [f"round 0: weight norm {start:.2f}",
                    f"round 10: weight norm 40.00, predicted by the noise alone {walked:.2f} (noise norm 100, "
                    "ratio 0.50)"]
    with pytest.raises(SystemExit, match="no measurement of fedes_dirichlet_nB1024_s2_db at n_B 256"):
        walk(str(path), run, 2, 256, 0.005)
    twice = tmp_path / "twice.jsonl"
    twice.write_text("".join(json.dumps(line) + "\n" for line in [lines[0], lines[0]]))
    with pytest.raises(SystemExit, match="line 2: checkpoint-10 of fedes_dirichlet_nB1024_s2_db .* measured twice"):
        walk(str(twice), run, 2, 1024, 0.005)
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({**lines[0], "checkpoint": ""}) + "\n")
    with pytest.raises(SystemExit, match="line 1: checkpoint '' is not checkpoint-<round>"):
        walk(str(odd), run, 2, 1024, 0.005)

"""MNIST: IDX reading with the published counts; the smokes of the Table 5 grid and of paper 000 (CYBER-0)."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from helpers import load_example
from prompt_helpers import DATA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example():
    return load_example("run_mnist_fed")


def test_idx_files_have_the_published_counts():
    example = _example()
    train = example.MNIST(os.path.join(DATA, "mnist"), "train")
    test = example.MNIST(os.path.join(DATA, "mnist"), "test", normalize=False)
    assert len(train) == 60000 and len(test) == 10000 and train.x.shape[1] == 784
    assert np.bincount(test.labels.numpy()).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert float(test.x.min()) == 0.0 and float(test.x.max()) == 1.0
    assert abs(float(train.x.mean())) < 0.01  # (x/255 - 0.1307)/0.3081 centres the training pixels


def test_table_smoke_runs_two_cells(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "mnist_table.py"), "--smoke", "--workers", "1",
           "--runs_dir", str(tmp_path), "--data_dir", os.path.join(DATA, "mnist")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    table = (tmp_path / "mnist_smoke.md").read_text().splitlines()
    rows = [line for line in table if line.startswith("| Fed")]
    assert len(rows) == 2
    for row in rows:
        accuracy = float(row.split("|")[2].split("±")[0])
        assert accuracy > 30.0, row  # 20 rounds: well above chance (10 %)


def test_table_report_on_a_users_own_run_says_what_to_use(tmp_path):
    (tmp_path / "mnist_results.json").write_text('{"final_accuracy": 0.9}')
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "mnist_table.py"), "--report",
                          "--runs_dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "holds no grid runs" in out.stderr and "zo_byzantine inspect" in out.stderr


def test_cyber0_smoke_runs_every_configuration(tmp_path):
    """Paper 000's Table 1 rows (alpha = 0.25, IID), the references and one Figure 1c attack, 10 rounds each."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "cyber0.py"), "--smoke", "--runs_dir", str(tmp_path),
           "--data_dir", os.path.join(DATA, "mnist")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "cyber0.json").read_text())
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import cyber0

    assert len(summary) == len(cyber0.ROWS) + len(cyber0.REFERENCES) + 1  # each row at alpha 0.25, one figure attack
    assert all(s["seeds"] == [0] and s["rounds"] == 10 for s in summary.values())
    assert summary["CYBER-0 / Full-Knowledge ranked among all | iid | alpha=0.25"]["final"][0] > 10.0
    clean = summary["FedAvg / no Byzantine | iid | alpha=0"]["final"][0]
    assert clean > 40.0  # 10 rounds at lr 0.01: well above chance (10 %)
    krum = summary["Krum / Fang Krum | iid | alpha=0.25"]
    assert krum["final"][0] < clean - 30 and krum["mean_lambda"] > 0  # Krum picks the crafted gradient
    assert summary["Trimmed mean / Fang trim | iid | alpha=0.25"]["final"][0] < clean
    assert "| CYBER-0 / Full-Knowledge |" in (tmp_path / "cyber0.md").read_text()


def _uap_module():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import zo_adafl_uap

    return zo_adafl_uap


def test_universal_perturbation_loss_on_a_hand_computed_example():
    """delta = 0 leaves the images as they are (distortion 0) and the loss is c times the logit margin; a delta
    moves every image the same way in tanh space."""
    import torch

    uap = _uap_module()

    class Fixed(torch.nn.Module):  # logits = [sum x, 1, 2]: margin of label 0 = sum x - 2, of label 2 = 2 - sum x
        def forward(self, x):
            s = x.sum(dim=1, keepdim=True)
            return torch.cat([s, torch.ones_like(s), 2 * torch.ones_like(s)], dim=1)

    model = uap.UniversalPerturbation(Fixed(), c=10.0, kappa=0.5)
    x = torch.full((2, 784), 0.25)
    x[1] = 0.5
    labels = torch.tensor([0, 2])
    loss = model(x, labels)["loss"]
    # sums 196 and 392: margins 194 and max(2 - 392, -0.5) = -0.5
    torch.testing.assert_close(loss, torch.tensor([1940.0, -5.0]), rtol=1e-5, atol=1e-3)
    with torch.no_grad():
        model.delta.fill_(1.0)
    adv = model.adversarial(x)
    expected = (torch.tanh(torch.atanh(torch.tensor([-0.5, 0.0])) + 1.0) + 1) / 2
    torch.testing.assert_close(adv[:, 0], expected)
    margin, distortion, _ = model.terms(x, labels)
    torch.testing.assert_close(distortion, 784 * (expected - torch.tensor([0.25, 0.5])) ** 2)
    assert not any(p.requires_grad for p in model.black_box.parameters())
    assert [name for name, p in model.named_parameters() if p.requires_grad] == ["delta"]


def test_zo_adafl_smoke_runs_both_servers(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "zo_adafl_uap.py"), "--smoke", "--runs_dir",
           str(tmp_path), "--data_dir", os.path.join(DATA, "mnist")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "zo_adafl.json").read_text())
    assert summary["black_box_accuracy"] > 0.9  # the smoke's black box: one pass over 12,000 images
    runs = summary["runs"]
    assert set(runs) == {"ZO-AdaFL K=10 m=50", "FedZO K=10 m=50"} and all(r["rounds"] == 3 for r in runs.values())
    # both servers moved delta (distortion > 0 from 0 at the start), and differently (AMSGrad against averaging)
    ada, fedzo = runs["ZO-AdaFL K=10 m=50"]["distortion"], runs["FedZO K=10 m=50"]["distortion"]
    assert ada > 0 and fedzo > 0 and ada != fedzo
    assert all(len(curve) == 3 for curve in summary["curves"].values())


def _fedes_process(runs_dir, *extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "fedes.py"), "--smoke", "--runs_dir", str(runs_dir),
           "--data", os.path.join(DATA, "mnist"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _fedes(runs_dir, *extra):
    done = _fedes_process(runs_dir, *extra)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(next(p for p in runs_dir.iterdir() if p.suffix == ".json").read_text())


def test_fedes_smoke_resumes_on_the_same_trajectory(tmp_path):
    """FedES on the paper's MLP (papers/001): 2 rounds, then resumed to 4, equals 4 rounds in one go."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from fedes import batches_per_client

    assert [batches_per_client(n) for n in (64, 256, 1024)] == [94, 24, 6]  # Table I's "# Data" column
    straight = _fedes(tmp_path / "straight")
    _fedes(tmp_path / "resumed", "--rounds", "2")
    resumed = _fedes(tmp_path / "resumed")
    assert straight["parameters"] == 1_863_690 and straight["rounds"] == resumed["rounds"] == 4
    assert (straight["estimator"], straight["directions"]) == ("two_point", "per_client")
    assert [(leg["from"], leg["to"]) for leg in resumed["legs"]] == [(0, 2), (2, 4)]
    assert [(leg["from"], leg["to"]) for leg in straight["legs"]] == [(0, 4)]
    assert resumed["curve"] == straight["curve"] and resumed["loss"] == straight["loss"]
    assert straight["curve"][-1][1] != straight["start"]  # the model moved
    again = _fedes(tmp_path / "resumed")  # a finished run started again is kept as it is
    assert again == resumed


def test_fedes_writes_the_result_of_a_leg_stopped_before_its_json(tmp_path):
    """A checkpoint at --rounds and no JSON (the process stopped in between): the JSON is written from the
    checkpoint, no round is trained (the trainer refuses a finished checkpoint)."""
    first = _fedes(tmp_path, "--rounds", "2")
    next(p for p in tmp_path.iterdir() if p.suffix == ".json").unlink()
    checkpoint = next((tmp_path / "tmp").iterdir()) / "checkpoint-2" / "model.safetensors"
    saved = checkpoint.stat().st_mtime_ns
    again = _fedes(tmp_path, "--rounds", "2")
    assert again["rounds"] == 2 and again["curve"] == first["curve"] and again["loss"] == first["loss"]
    assert again["legs"] == [] and checkpoint.stat().st_mtime_ns == saved  # nothing trained, nothing saved


def test_fedes_refuses_a_recorded_run_without_its_checkpoint(tmp_path):
    """A JSON whose run is not finished and no checkpoint to resume (a fresh clone: tmp/ is not committed): refused,
    the JSON kept, unless --restart, which trains from round 0 and replaces it."""
    _fedes(tmp_path, "--rounds", "2")
    shutil.rmtree(tmp_path / "tmp")
    path = next(p for p in tmp_path.iterdir() if p.suffix == ".json")
    recorded = path.read_text()
    done = _fedes_process(tmp_path)
    assert done.returncode != 0 and "holds no checkpoint to resume from: give --restart" in done.stderr
    assert path.read_text() == recorded
    restarted = _fedes(tmp_path, "--restart")
    assert restarted["rounds"] == 4 and [(leg["from"], leg["to"]) for leg in restarted["legs"]] == [(0, 4)]


def test_fedgd_smoke_is_first_order_full_batch(tmp_path):
    result = _fedes(tmp_path, "--method", "fedgd", "--split", "shards")
    assert result["estimator"] == "first_order" and result["directions_per_client"] is None and result["rounds"] == 4
    assert result["curve"][-1][1] != result["start"]


def test_fedes_smoke_with_a_batch_per_direction(tmp_path):
    """``--batches per_direction``: 4 directions of 16 images each per client (its 64), a run of its own name."""
    result = _fedes(tmp_path, "--batches", "per_direction", "--n_B", "16")
    assert (result["batches"], result["directions_per_client"], result["rounds"]) == ("per_direction", 4, 4)
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".json"] == ["smoke_fedes_iid_nB16_s0_db.json"]
    assert result["curve"][-1][1] != result["start"]


@pytest.mark.parametrize("argv", [
    ("fedes", "iid", 64, 0, False, "standardized", "one", "constant", 0),
    ("fedes", "dirichlet", 256, 3, False, "unit", "per_direction", "cosine", 1200),
    ("fedgd", "shards", None, 1, True, "standardized", "one", "linear", 7),
])
def test_fedes_run_names_parse_back_to_their_arguments(argv):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from fedes import parse_stem, stem

    method, split, n_b, seed, smoke, inputs, batches, schedule, rounds = argv
    parsed = parse_stem(stem(method, split, n_b or 0, seed, smoke, inputs, batches, schedule, rounds))
    assert tuple(parsed.values()) == argv
    assert parse_stem("fedes_iid_nB64_s0_db_cosine") is None and parse_stem("fedes_random_nB64_s0") is None


@pytest.mark.parametrize("name", ["fedgd_iid_nB64_s0", "fedes_iid_s0", "fedgd_iid_s0_db", "fedes_iid_nB64_s0_cosine0",
                                  "fedes_iid_nB064_s0", "fedes_iid_nB64_s01"])
def test_fedes_parse_stem_refuses_names_stem_never_writes(name):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from fedes import parse_stem

    assert parse_stem(name) is None


def test_fedes_smoke_with_a_decaying_learning_rate(tmp_path):
    """``--schedule cosine --rounds 4``: a run of its own name whose steps after the first are smaller than the
    constant rate's: the first two rounds' losses are the constant run's (rounds 1 and 2 start from the same
    weights), the last two's are not."""
    constant = _fedes(tmp_path / "constant")
    cosine = _fedes(tmp_path / "cosine", "--schedule", "cosine", "--rounds", "4")
    assert [p.name for p in (tmp_path / "cosine").iterdir() if p.suffix == ".json"] == \
        ["smoke_fedes_iid_nB64_s0_cosine4.json"]
    assert (cosine["schedule"], cosine["schedule_rounds"], constant["schedule_rounds"]) == ("cosine", 4, None)
    assert cosine["loss"][0] == constant["loss"][0] and cosine["loss"][1] != constant["loss"][1]


def test_fedes_decaying_rate_resumes_on_the_same_trajectory(tmp_path):
    """A cosine run stopped by its time after its first round and started again ends where the run in one go ends
    (the scheduler's state travels in the checkpoint); a linear decay over the same rounds is another trajectory."""
    straight = _fedes(tmp_path / "straight", "--schedule", "cosine", "--rounds", "4")
    _fedes(tmp_path / "resumed", "--schedule", "cosine", "--rounds", "4", "--minutes", "1e-6")
    resumed = _fedes(tmp_path / "resumed", "--schedule", "cosine", "--rounds", "4")
    assert [(leg["from"], leg["to"]) for leg in resumed["legs"]] == [(0, 1), (1, 4)]
    # the logged loss at round 2 averages only round 2 after the resume (the Trainer does not keep a partial
    # logging window in a checkpoint); rounds 3-4's window and the final weights' accuracy are the same
    assert resumed["loss"][1] == straight["loss"][1] and resumed["curve"][-1] == straight["curve"][-1]
    linear = _fedes(tmp_path / "linear", "--schedule", "linear", "--rounds", "4")
    assert linear["loss"][0] == straight["loss"][0] and linear["loss"][1] != straight["loss"][1]


@pytest.mark.parametrize(("argv", "message"), [
    (["--schedule", "cosine"], "--schedule cosine decays the learning rate over --rounds: give --rounds"),
    (["--n_B", "0"], "--n_B=0"), (["--rounds", "0"], "--rounds=0"), (["--eval_every", "-1"], "--eval_every=-1"),
    (["--method", "fedgd", "--split", "dirichlet"], "accepted splits for fedgd: iid, shards"),
    (["--split", "random"], "invalid choice: 'random'"), (["--seed", "-1"], "--seed=-1"),
    (["--wall_minutes", "0"], "--wall_minutes=0"), (["--minutes", "-2"], "--minutes=-2.0"),
    (["--budget_gb", "-1"], "--budget_gb=-1.0"), (["--report", "--smoke"], "--report --smoke"),
    (["--method", "fedgd", "--n_B", "64"], "--method fedgd: each client's gradient on its whole data"),
    (["--method", "fedgd", "--batches", "per_direction"], "accepted with fedgd: neither"),
])
def test_fedes_refuses_bad_arguments_before_any_work(argv, message, capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from fedes import main

    with pytest.raises(SystemExit):
        main(["--data", "/nonexistent", *argv])
    assert message in capsys.readouterr().err

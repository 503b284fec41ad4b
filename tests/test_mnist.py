"""MNIST: IDX reading with the published counts; the smokes of the Table 5 grid and of paper 000 (CYBER-0)."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import load_example
from prompt_helpers import DATA

pytestmark = pytest.mark.slow  # the experiments' smokes and MNIST end-to-end runs (minutes in all)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(ROOT, "experiments")


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
    cmd = [sys.executable, os.path.join(EXPERIMENTS, "mnist_table", "mnist_table.py"), "--smoke", "--workers", "1",
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
    out = subprocess.run([sys.executable, os.path.join(EXPERIMENTS, "mnist_table", "mnist_table.py"), "--report",
                          "--runs_dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "holds no grid runs" in out.stderr and "zo_byzantine inspect" in out.stderr


def test_cyber0_smoke_runs_every_configuration(tmp_path):
    """Paper 000's Table 1 rows (alpha = 0.25, IID), the references and one Figure 1c attack, 10 rounds each."""
    cmd = [sys.executable, os.path.join(EXPERIMENTS, "cyber0", "cyber0.py"), "--smoke", "--runs_dir", str(tmp_path),
           "--data_dir", os.path.join(DATA, "mnist")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "cyber0.json").read_text())
    sys.path.insert(0, os.path.join(EXPERIMENTS, "cyber0"))
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
    sys.path.insert(0, os.path.join(EXPERIMENTS, "zo_adafl"))
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


def _uap_process(*args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.join(EXPERIMENTS, "zo_adafl", "zo_adafl_uap.py"), "--data_dir",
           os.path.join(DATA, "mnist"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_zo_adafl_smoke_runs_both_servers(tmp_path):
    done = _uap_process("--smoke", "--runs_dir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "zo_adafl.json").read_text())
    assert summary["black_box_accuracy"] > 0.9  # the smoke's black box: one pass over 12,000 images
    runs = summary["runs"]
    assert set(runs) == {"ZO-AdaFL K=10 m=50", "FedZO K=10 m=50"} and all(r["rounds"] == 3 for r in runs.values())
    # both servers moved delta (distortion > 0 from 0 at the start), and differently (AMSGrad against averaging)
    ada, fedzo = runs["ZO-AdaFL K=10 m=50"]["distortion"], runs["FedZO K=10 m=50"]["distortion"]
    assert ada > 0 and fedzo > 0 and ada != fedzo
    assert all(len(curve) == 3 for curve in summary["curves"].values())
    # every run records the box it attacked: the smoke's own, whose digest the report names
    recorded = {json.loads(p.read_text())["black_box"] for p in tmp_path.glob("*-seed0.json")}
    uap = _uap_module()
    assert recorded == {summary["black_box"]} == {uap.digest(uap.load_black_box(str(tmp_path / "black_box.pt")))}
    assert summary["black_box"] != uap.BOX_DIGEST


def test_zo_adafl_refuses_bad_arguments_before_work(tmp_path):
    """Unknown --only names and the smoke's conflicting options fail at once, naming the argument (and the accepted
    names), before any black box is trained or run."""
    for args, expected in ((["--only", "ZO-AdaFL K=7 m=50"], "accepted: ['FedZO K=10 m=50'"),
                           (["--smoke", "--only", "FedZO K=10 m=50"], "--smoke runs its two configurations"),
                           (["--smoke", "--black_box", str(tmp_path / "box.pt")], "give no --black_box")):
        done = _uap_process("--runs_dir", str(tmp_path), *args)
        assert done.returncode == 2 and "--" in done.stderr and expected in done.stderr, done.stderr[-1000:]
    assert list(tmp_path.iterdir()) == []


def test_committed_black_box_is_the_one_the_runs_name():
    """The committed black box loads (tensors only) and carries the digest the script checks and the runs record."""
    uap = _uap_module()
    assert uap.digest(uap.load_black_box(uap.BOX)) == uap.BOX_DIGEST


def _uap_run(name="FedZO K=10 m=50", seed=0, rounds=600, **values) -> dict:
    """A finished run's JSON as ``run()`` writes it (the settings of ``configurations()``), with ``values`` set."""
    settings = _uap_module().configurations()[name]
    return {"name": name, "seed": seed, **settings, "rounds": rounds, "attack_loss": 1.0, "success_rate": 0.5,
            "distortion": 1.0, "seconds": 1.0, "loss_curve": [[10, 2.0]], "uplink_scalars_per_client": 10, **values}


def test_zo_adafl_report_averages_the_seeds(tmp_path):
    """Two seeds of one configuration: the table's mean ± std and the curve's round-by-round mean (over the rounds
    both logged), by hand; a single seed's row has no ±; runs of one name with different settings are refused."""
    uap = _uap_module()

    def write(seed, loss, success, curve, **settings):
        run = _uap_run(seed=seed, attack_loss=loss, success_rate=success, seconds=10.0 * (seed + 1),
                       loss_curve=curve, **settings)
        (tmp_path / f"run-seed{seed}.json").write_text(json.dumps(run))

    write(0, 16.0, 0.70, [[10, 80.0], [20, 60.0]])
    write(1, 18.0, 0.80, [[10, 70.0], [20, 50.0], [30, 40.0]])
    (tmp_path / "other.json").write_text(json.dumps([1, 2]))  # not a run: ignored
    summary = uap.report(str(tmp_path), str(tmp_path), None, plots=False)["FedZO K=10 m=50"]
    assert summary["seeds"] == [0, 1] and (summary["seconds_min"], summary["seconds_max"]) == (10.0, 20.0)
    assert summary["attack_loss"] == 17.0 and abs(summary["attack_loss_std"] - 2 ** 0.5) < 1e-12
    table = (tmp_path / "zo_adafl.md").read_text()
    assert "| FedZO K=10 m=50 | 600 | 2 | 17.00 ± 1.41 | 75.0 ± 7.1 | 1.00 ± 0.00 | 10 | 10-20 |" in table
    assert "2 of the 2 runs recorded no black-box digest" in table
    curves = json.loads((tmp_path / "zo_adafl.json").read_text())["curves"]
    assert curves["FedZO K=10 m=50"] == [[10, 75.0], [20, 55.0]]
    (tmp_path / "run-seed1.json").unlink()
    uap.report(str(tmp_path), str(tmp_path), None, plots=False)
    assert "| FedZO K=10 m=50 | 600 | 1 | 16.00 | 70.0 | 1.00 | 10 | 10 |" in (tmp_path / "zo_adafl.md").read_text()
    write(2, 17.0, 0.75, [[10, 75.0]], rounds=100)
    with pytest.raises(SystemExit, match=r"differ in their rounds \(\[\[600\], \[100\]\]\)"):
        uap.report(str(tmp_path), str(tmp_path), None, plots=False)
    write(2, 17.0, 0.75, [[10, 75.0]], lr=0.02)
    with pytest.raises(SystemExit, match="differ in their lr"):
        uap.report(str(tmp_path), str(tmp_path), None, plots=False)


def test_zo_adafl_report_refuses_another_black_box(tmp_path):
    """A run that attacked another black box (its recorded digest differs) is refused by file name; the digest is
    the weights' (one changed value changes it, a reloaded copy does not)."""
    uap = _uap_module()
    box = uap.BlackBox()
    copy = uap.BlackBox()
    copy.load_state_dict(box.state_dict())
    assert uap.digest(copy) == uap.digest(box)
    with torch.no_grad():
        copy.head.bias[0] += 1e-6
    assert uap.digest(copy) != uap.digest(box)
    for seed, recorded in ((0, uap.digest(box)), (1, uap.digest(copy))):
        (tmp_path / f"run-seed{seed}.json").write_text(json.dumps(_uap_run(seed=seed, black_box=recorded)))
    with pytest.raises(SystemExit, match=r"\['run-seed1.json'\] attacked another black box"):
        uap.report(str(tmp_path), str(tmp_path), None, plots=False, box_digest=uap.digest(box))
    (tmp_path / "run-seed1.json").unlink()
    summary = uap.report(str(tmp_path), str(tmp_path), 0.99, plots=False, box_digest=uap.digest(box))
    assert summary["FedZO K=10 m=50"]["seeds"] == [0]
    table = (tmp_path / "zo_adafl.md").read_text()
    assert uap.digest(box) in table and "recorded no black-box digest" not in table
    (tmp_path / "box.pt").write_text("not a state dict")
    with pytest.raises(SystemExit, match="box.pt' is not a black box"):
        uap.load_black_box(str(tmp_path / "box.pt"))


def _fedes_process(runs_dir, *extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.join(EXPERIMENTS, "fedes", "fedes.py"), "--smoke", "--runs_dir", str(runs_dir),
           "--data", os.path.join(DATA, "mnist"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _fedes(runs_dir, *extra):
    done = _fedes_process(runs_dir, *extra)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(next(p for p in runs_dir.iterdir() if p.suffix == ".json").read_text())


LONG = pytest.mark.skipif(not os.environ.get("ZO_LONG_SMOKES"), reason="an experiment script's resume over two "
                          "legs (1-3 min): ZO_LONG_SMOKES=1 runs it; left out of CI to keep it under 20 minutes")


@LONG
def test_fedes_smoke_resumes_on_the_same_trajectory(tmp_path):
    """FedES on the paper's MLP (papers/001): 2 rounds, then resumed to 4, equals 4 rounds in one go."""
    sys.path.insert(0, os.path.join(EXPERIMENTS, "fedes"))
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
    sys.path.insert(0, os.path.join(EXPERIMENTS, "fedes"))
    from fedes import parse_stem, stem

    method, split, n_b, seed, smoke, inputs, batches, schedule, rounds = argv
    parsed = parse_stem(stem(method, split, n_b or 0, seed, smoke, inputs, batches, schedule, rounds))
    assert tuple(parsed.values()) == argv
    assert parse_stem("fedes_iid_nB64_s0_db_cosine") is None and parse_stem("fedes_random_nB64_s0") is None


@pytest.mark.parametrize("name", ["fedgd_iid_nB64_s0", "fedes_iid_s0", "fedgd_iid_s0_db", "fedes_iid_nB64_s0_cosine0",
                                  "fedes_iid_nB064_s0", "fedes_iid_nB64_s01"])
def test_fedes_parse_stem_refuses_names_stem_never_writes(name):
    sys.path.insert(0, os.path.join(EXPERIMENTS, "fedes"))
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


@LONG
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
    sys.path.insert(0, os.path.join(EXPERIMENTS, "fedes"))
    from fedes import main

    with pytest.raises(SystemExit):
        main(["--data", "/nonexistent", *argv])
    assert message in capsys.readouterr().err


def _fedes_record(runs_dir, method, n_b, curve, loss):
    """A finished run's JSON as ``fedes.py`` writes it, with a hand-made curve."""
    sys.path.insert(0, os.path.join(EXPERIMENTS, "fedes"))
    from fedes import stem

    rounds = curve[-1][0]
    record = {"method": method, "split": "iid", "n_B": n_b, "seed": 0, "inputs": "standardized",
              "batches": "per_direction" if method == "fedes" else None, "schedule": "constant",
              "schedule_rounds": None, "diverged_at": None, "device": "cpu", "max": max(a for _, a in curve),
              "rounds": rounds, "seconds": 2.0 * rounds, "legs": [{"device": "cpu", "from": 0, "to": rounds,
                                                                    "seconds": 2.0 * rounds}],
              "curve": curve, "loss": loss}
    name = stem(method, "iid", n_b or 0, 0, batches=record["batches"] or "one")
    (runs_dir / f"{name}.json").write_text(json.dumps(record))
    return name


def test_fedes_report_lists_the_first_round_at_each_accuracy_and_draws_fig1(tmp_path):
    """The rounds-to-accuracy table against hand-read curves: the first evaluation at or above each level (an
    exact hit counts), '-' for a level never reached; Fig. 1's plot is written beside the table."""
    sys.path.insert(0, os.path.join(EXPERIMENTS, "fedes"))
    from fedes import LEVELS, first_round, report

    curve = [(0, 0.1), (100, 0.85), (200, 0.8999), (300, 0.91), (400, 0.905), (500, 0.93)]
    assert [first_round(curve, level) for level in LEVELS] == [100, 300, 300, 500, 500, None, None]
    assert first_round([], 85.0) is None
    fedes = _fedes_record(tmp_path, "fedes", 64, curve, [(100, 0.5), (500, 0.3)])
    fedgd = _fedes_record(tmp_path, "fedgd", None, [(0, 0.1), (50, 0.96)], [(50, 0.2)])
    lines = report(str(tmp_path), str(tmp_path / "fedes.md"), plots=False)
    assert f"| {fedes} | 500 | 100 | 300 | 300 | 500 | 500 | - | - |" in lines
    assert f"| {fedgd} | 50 | 50 | 50 | 50 | 50 | 50 | 50 | 50 |" in lines
    assert not (tmp_path / "fedes_fig1.png").exists()
    assert "| FedES | standardized | per_direction | 0.01 | 64 | 94 | 95.64 | 93.00 (500 rounds, 2.00 s/round, cpu)" \
        in (tmp_path / "fedes.md").read_text()
    pytest.importorskip("matplotlib")
    assert report(str(tmp_path), str(tmp_path / "fedes.md")) == lines
    assert (tmp_path / "fedes_fig1.png").stat().st_size > 0


def test_fedes_stops_a_run_whose_rounds_are_all_skipped_or_whose_loss_overflowed():
    """``StopWhenDiverged``: a log window with every round skipped, or a non-finite evaluation loss, stops the run
    at that round; a window with some applied round does not; a resumed run's first window starts at its
    checkpoint."""
    from types import SimpleNamespace

    sys.path.insert(0, os.path.join(EXPERIMENTS, "fedes"))
    from fedes import StopWhenDiverged

    def step(callback, state, **logs):
        control = SimpleNamespace(should_training_stop=False)
        if "eval_loss" in logs:
            callback.on_evaluate(None, state, control, metrics=logs)
        else:
            callback.on_log(None, state, control, logs=logs)
        return control.should_training_stop

    callback, state = StopWhenDiverged(), SimpleNamespace(global_step=90)
    callback.on_train_begin(None, state, None)  # resumed at round 90
    state.global_step = 100
    assert not step(callback, state, loss=2.0, skipped_rounds=9)  # rounds 91-100: one applied
    resumed = StopWhenDiverged()
    resumed.on_train_begin(None, SimpleNamespace(global_step=90), None)
    assert step(resumed, state, loss=1e26, skipped_rounds=10)  # rounds 91-100 all skipped: the window is 10, not 100
    assert resumed.diverged_at == 100
    assert not step(callback, state, eval_loss=1.5e26)  # large but finite
    state.global_step = 110
    assert step(callback, state, loss=1e26, skipped_rounds=10) and callback.diverged_at == 110
    assert not step(StopWhenDiverged(), state, loss=2.0, skipped_rounds=100)  # window 0-110: 10 applied
    fresh = StopWhenDiverged()
    assert step(fresh, state, eval_loss=float("inf")) and fresh.diverged_at == 110
    assert step(fresh, SimpleNamespace(global_step=120), eval_loss=float("nan")) and fresh.diverged_at == 110

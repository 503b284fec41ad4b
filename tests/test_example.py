"""The main job, examples/run_glue_fed.py, end to end on a tiny model; the wheel carries the task specs."""

import collections
import dataclasses
import json
import os
import subprocess
import sys
import zipfile

import pytest
import torch
from helpers import load_example
from prompt_helpers import DATA, save_tiny_roberta
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example():
    return load_example("run_glue_fed")


def _argv(model_dir, out, rounds=20, *extra):
    return [
        "--task", "sst2", "--data_dir", os.path.join(DATA, "sst2"), "--model_name_or_path", model_dir,
        "--output_dir", str(out), "--max_steps", str(rounds), "--num_train_per_class", "16", "--num_eval", "64",
        "--per_device_train_batch_size", "2", "--eval_steps", "10", "--logging_steps", "5",
        "--learning_rate", "1e-3", "--disable_tqdm", "true", *extra,
    ]


def test_twenty_rounds_of_the_main_job_write_metrics_and_a_ledger(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_dir = save_tiny_roberta(str(tmp_path / "model"))
    out = tmp_path / "out"
    metrics = _example().main(_argv(model_dir, out))
    for name in ("eval_results.json", "all_results.json", "trainer_state.json", "zo_ledger.json"):
        assert (out / name).is_file(), name
    results = json.loads((out / "eval_results.json").read_text())
    assert 0.0 <= results["eval_accuracy"] <= 1.0 and "start_accuracy" in results and "eval_best_accuracy" in results
    assert metrics["eval_accuracy"] == results["eval_accuracy"]
    ledger = json.loads((out / "zo_ledger.json").read_text())
    assert [r["round"] for r in ledger["rounds"]] == list(range(20))
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 20


@pytest.mark.parametrize(
    "head, tuning, trained",
    [
        ("seq_cls", "head", "classifier"),
        ("seq_cls", "lora", "lora_"),
        ("seq_cls", "prompt_tuning", "prompt_embeddings"),
        ("prompt", "lora", "lora_"),
    ],
)
def test_tuning_selects_the_trained_parameters_and_saves_them(tmp_path, monkeypatch, head, tuning, trained):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_dir = save_tiny_roberta(str(tmp_path / "model"))
    out = tmp_path / "out"
    extra = ["--head", head, "--tuning", tuning, "--save_final_model", "true", "--learning_rate", "1e-1"]
    _example().main(_argv(model_dir, out, 4, *extra))
    start = load_file(os.path.join(model_dir, "model.safetensors"))
    if tuning == "head":  # a whole model is saved: the backbone is bitwise the pretrained one
        final = load_file(str(out / "model.safetensors"))
        backbone = [n for n in final if n.startswith("roberta.")]
        assert backbone and all(torch.equal(final[n], start[n]) for n in backbone)
        assert {n for n in final if not n.startswith("roberta.")} and all("classifier" in n for n in final
                                                                           if not n.startswith("roberta."))
    else:  # peft: only the adapter is saved, and it moved (lora_B starts at zero)
        assert json.loads((out / "adapter_config.json").read_text())["peft_type"] in ("LORA", "PROMPT_TUNING")
        adapter = load_file(str(out / "adapter_model.safetensors"))
        assert adapter and all(trained in n or "classifier" in n for n in adapter)
        if tuning == "lora":
            assert any("lora_B" in n and bool(adapter[n].abs().sum() > 0) for n in adapter)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tuning", "head"], "tuning='head' needs head='seq_cls'"),
        (["--tuning", "lora", "--lora_r", "0"], "lora_r and num_virtual_tokens must be >= 1"),
    ],
)
def test_bad_model_arguments_fail_naming_the_argument(flags, message):
    with pytest.raises(ValueError, match=message):
        _example().main(["--task", "sst2", "--output_dir", "/tmp/never", *flags])


def test_a_refusal_on_the_command_line_is_one_line_naming_the_flag(capsys):
    cli = _example().cli
    for flags, message in ((["--optim", "adamw_torch"], "optim='adamw_torch' is not used by ZOByzantineTrainer"),
                           (["--gradient_checkpointing", "true"], "gradient_checkpointing=True is not used"),
                           (["--num_byzantine", "6"], "num_byzantine=6 must satisfy")):
        assert cli(["--task", "sst2", "--output_dir", "/tmp/never", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [err[0]] and err[0].startswith(f"run_glue_fed.py: error: {message}")
    with pytest.raises(SystemExit):  # argparse's own: the usage line and the choices, not the 400 flags
        cli(["--head", "mlm"])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "argument --head: invalid choice: 'mlm' (choose from 'prompt', 'seq_cls')" in err[1]
    assert _example().ModelArguments.__dataclass_fields__["tuning"].type  # (peft's prefix: refused in code too)
    with pytest.raises(ValueError, match="tuning='prefix' is not supported; accepted: .*features .*cache"):
        _example().ModelArguments(tuning="prefix")


def test_prompt_head_on_an_encoder_without_its_lm_head_is_refused(tmp_path):
    """all-MiniLM-L6-v2 ships its encoder alone: ``--head prompt`` would score the label words with a masked-LM head
    drawn at random; refused before any evaluation, naming a missing head weight and what to use."""
    with pytest.raises(ValueError, match=r"--head prompt needs the model's LM head.*cls\.predictions.*--head seq_cls"):
        _example().main(["--task", "sst2", "--data_dir", os.path.join(DATA, "sst2"), "--output_dir",
                         str(tmp_path), "--head", "prompt", "--tuning", "full", "--max_steps", "1"])
    assert not os.path.exists(os.path.join(tmp_path, "zo_ledger.json"))

def test_offline_without_data_stops_at_once_naming_the_flag(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as stop:
        _example().main(["--task", "sst2", "--output_dir", "/tmp/never", "--model_name_or_path", "/nonexistent"])
    assert "--data_dir" in str(stop.value) and "--model_name_or_path" in str(stop.value)
    with pytest.raises(SystemExit) as stop:  # no model named: the embedded one is used, but data cannot be
        _example().main(["--task", "sst2", "--output_dir", "/tmp/never"])
    assert "--data_dir" in str(stop.value) and "--model_name_or_path" not in str(stop.value)


@pytest.mark.slow  # subprocesses or an end-to-end job
def test_offline_first_run_falls_back_to_the_embedded_model_and_says_so(tmp_path, monkeypatch, caplog, capsys):
    """README's first command, shortened: no model named and no Hub -> MiniLM features head, a readable result."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    with caplog.at_level("INFO"):
        metrics = _example().main(["--task", "sst2", "--data_dir", os.path.join(DATA, "sst2"), "--output_dir", str(out),
                                   "--num_train_per_class", "48", "--num_eval", "64", "--max_steps", "6",
                                   "--eval_steps", "3", "--logging_steps", "3", "--disable_tqdm", "true"])
    first = next(r.getMessage() for r in caplog.records if r.name == "run_glue_fed")
    assert first.startswith("The Hugging Face Hub is unreachable") and "all-MiniLM-L6-v2" in first
    printed = capsys.readouterr().out
    assert "sst2: accuracy" in printed and "over 6 rounds" in printed and "attack=alie" in printed
    assert "dense FedAvg would send" in printed and 0.0 <= metrics["eval_best_accuracy"] <= 1.0
    ledger = json.loads((out / "zo_ledger.json").read_text())
    assert len(ledger["rounds"]) == 6 and all(len(r["coefficients"]) == 64 for r in ledger["rounds"])


def test_unknown_task_fails_before_anything(monkeypatch):
    with pytest.raises(ValueError, match="Unknown task 'nope'"):
        _example().main(["--task", "nope", "--output_dir", "/tmp/never"])


@pytest.mark.slow  # subprocesses or an end-to-end job
def test_wheel_carries_task_specs(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), ROOT],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("zo_byzantine-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for task in ("sst2", "snli", "mnli", "rte", "trec"):
        assert f"zo_byzantine/task_specs/{task}.json" in names
    assert not any("evaluate_modules" in name for name in names)  # metrics are scikit-learn's
    # the installed layout resolves specs through importlib.resources, as from a source checkout
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = "from zo_byzantine.tasks import available_tasks, load_task; print(available_tasks(), load_task('rte').name)"
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert out.stdout.strip() == "['mnli', 'rte', 'snli', 'sst2', 'trec'] rte"


@pytest.mark.slow  # subprocesses or an end-to-end job
def test_example_follows_the_transformers_script_conventions(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_dir = save_tiny_roberta(str(tmp_path / "model"))
    out = tmp_path / "out"
    _example().main(_argv(model_dir, out, 6, "--save_strategy", "steps", "--save_steps", "3"))
    for name in ("train_results.json", "eval_results.json", "all_results.json", "model.safetensors"):
        assert (out / name).is_file(), name  # the model is saved by default
    straight = json.loads((out / "zo_ledger.json").read_text())["rounds"]
    with pytest.raises(ValueError, match="overwrite_output_dir"):  # a previous run is not written over silently
        _example().main(_argv(model_dir, out, 6))
    # resuming continues the same trajectory: the resumed run's ledger is the straight run's
    resumed_dir = tmp_path / "resumed"
    _example().main(_argv(model_dir, resumed_dir, 6, "--resume_from_checkpoint", str(out / "checkpoint-3")))
    assert json.loads((resumed_dir / "zo_ledger.json").read_text())["rounds"] == straight
    # --do_train false --do_eval false: nothing trained or evaluated; --do_predict writes predictions
    only = tmp_path / "predict"
    metrics = _example().main(_argv(model_dir, only, 6, "--do_train", "false", "--do_eval", "false",
                                    "--do_predict", "true"))
    assert metrics == {} and not (only / "zo_ledger.json").exists() and not (only / "eval_results.json").exists()
    import csv

    with open(only / "predictions.tsv", encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    assert list(rows[0]) == ["row", "text_a", "label", "prediction"] and len(rows) == 64
    with open(os.path.join(DATA, "sst2", "dev.tsv"), encoding="utf-8") as f:  # joinable with the file, by row
        dev = [line.rstrip("\n").split("\t") for line in list(f)[1:]]
    names = {"0": "negative", "1": "positive"}
    for row in rows:
        text, label = dev[int(row["row"])]
        assert row["text_a"] == text.strip() and row["label"] == names[label]
        assert row["prediction"] in ("negative", "positive")


def test_help_groups_the_flags_shows_every_choice_and_the_offline_configuration():
    module = _example()
    text = module.build_parser().format_help()
    groups = ["model:", "data:", *(f"{title}:" for title in module.GROUPS)]
    assert [text.index(g) for g in groups] == sorted(text.index(g) for g in groups)  # in this order
    assert text.index("\n  --num_clients") < text.index("\n  --learning_rate") < text.index("\n  --report_to")
    assert "--head {prompt,seq_cls}" in text and "--tuning {full,lora,prompt_tuning,head,features}" in text
    for choice in ("cwtm", "multikrum", "alie", "random_choice", "bucketing", "per_client", "antithetic"):
        assert choice in text, choice
    assert " ".join(module.OFFLINE[:6]) in " ".join(text.split())  # the configuration that runs offline
    for refused in ("--optim ", "--adam_beta1", "--max_grad_norm", "--label_smoothing_factor", "--torch_compile ",
                    "--gradient_checkpointing ", "--fsdp "):
        assert f"\n  {refused}" not in text, refused  # not offered (the description names them as refused)
    assert len(text.splitlines()) < 600  # was 785


def test_the_main_job_runs_trec_with_its_defaults():
    """TREC's ABBR class has 86 training examples: the default k per class takes all of them; k asked for is
    refused naming the largest that fits."""
    module = _example()
    spec = module.load_task("trec")
    data = module.DataArguments(task="trec", data_dir=os.path.join(DATA, "trec"), num_train_per_class=1000,
                                per_class_at_most=True)
    train, evaluation = module.raw_splits(spec, data, 42)
    assert sorted(collections.Counter(train["label"]).values()) == [86, 835, 896, 1000, 1000, 1000]
    assert list(evaluation["row"]) == list(range(500))  # the whole test file, in its order
    with pytest.raises(ValueError, match=r"num_train_per_class=1000 but class 2 has only 86 examples; accepted: "
                                         r"num_train_per_class <= 86, or num_train"):
        module.raw_splits(spec, dataclasses.replace(data, per_class_at_most=False), 42)


def test_every_client_holds_a_batch_when_the_data_allow():
    """The offline default (SST-2, 1,000 per class, 12 clients, Dirichlet alpha 1, batch 64) no longer warns that
    clients hold fewer examples than their batch: min_client_examples is fitted, as large as the partition allows."""
    module = _example()
    args = module.GlueFedArguments(output_dir="/tmp/never", report_to=[])
    labels = [0] * 1000 + [1] * 1000
    assert module.fit_min_client_examples(args, module.Features(torch.zeros(2000, 1), labels)) == 64
    assert module.fit_min_client_examples(args, module.Features(torch.zeros(96, 1), labels[:48] + labels[-48:])) <= 8


@pytest.mark.slow
def test_trec_end_to_end_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    metrics = _example().main(["--task", "trec", "--data_dir", os.path.join(DATA, "trec"), "--output_dir",
                               str(tmp_path), "--max_steps", "4", "--eval_steps", "2", "--logging_steps", "2",
                               "--num_train_per_class", "40", "--disable_tqdm", "true"])  # 40 of the 86 of class 2
    assert 0.0 <= metrics["eval_best_accuracy"] <= 1.0

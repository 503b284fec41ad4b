"""The main job, examples/run_glue_fed.py, end to end on a tiny model; the wheel carries the task specs."""

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
        (["--head", "mlm"], "head='mlm' is not supported; accepted: prompt, seq_cls"),
        (["--tuning", "prefix"],
         "tuning='prefix' is not supported; accepted: full, lora, prompt_tuning, head, features .*cache"),
        (["--tuning", "head"], "tuning='head' needs head='seq_cls'"),
        (["--tuning", "lora", "--lora_r", "0"], "lora_r and num_virtual_tokens must be >= 1"),
    ],
)
def test_bad_model_arguments_fail_naming_the_argument(flags, message):
    with pytest.raises(ValueError, match=message):
        _example().main(["--task", "sst2", "--output_dir", "/tmp/never", *flags])


def test_offline_without_data_stops_at_once_naming_the_flag(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as stop:
        _example().main(["--task", "sst2", "--output_dir", "/tmp/never", "--model_name_or_path", "/nonexistent"])
    assert "--data_dir" in str(stop.value) and "--model_name_or_path" in str(stop.value)
    with pytest.raises(SystemExit) as stop:  # no model named: the embedded one is used, but data cannot be
        _example().main(["--task", "sst2", "--output_dir", "/tmp/never"])
    assert "--data_dir" in str(stop.value) and "--model_name_or_path" not in str(stop.value)


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


def test_wheel_carries_task_specs_and_metric_modules(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), ROOT],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("zo_byzantine-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for task in ("sst2", "snli", "mnli", "rte", "trec"):
        assert f"zo_byzantine/task_specs/{task}.json" in names
    assert {"zo_byzantine/evaluate_modules/accuracy.py", "zo_byzantine/evaluate_modules/macro_f1.py"} <= names
    # the installed layout resolves specs through importlib.resources, as from a source checkout
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = "from zo_byzantine.tasks import available_tasks, load_task; print(available_tasks(), load_task('rte').name)"
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert out.stdout.strip() == "['mnli', 'rte', 'snli', 'sst2', 'trec'] rte"


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
    lines = (only / "predictions.tsv").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 65 and lines[1].split("\t")[1] in ("negative", "positive")


def test_help_lists_the_protocol_flags_first_and_every_choice():
    module = _example()
    from transformers import HfArgumentParser

    text = module.protocol_first(HfArgumentParser((module.ModelArguments, module.DataArguments,
                                                   module.GlueFedArguments))).format_help()
    assert text.index("--num_clients") < text.index("--learning_rate") < text.index("--lr_scheduler_type")
    assert text.index("--attack ") < text.index("--report_to")
    for choice in ("cwtm", "multikrum", "alie", "random_choice", "bucketing", "per_client", "antithetic", "features"):
        assert choice in text, choice

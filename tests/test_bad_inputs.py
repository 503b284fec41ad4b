"""The bad-input battery: every bad setting is refused before any round (and before the model is loaded where
the scripts load one), with an error naming the argument. Each case is distinct; the counts go to the note."""

import json
import os

import pytest
import torch
from helpers import LogisticRegression, VectorDataset, load_example, make_trainer
from prompt_helpers import DATA

from zo_byzantine import ZOByzantineArguments

NAN, INF = float("nan"), float("inf")

# (keyword arguments of ZOByzantineArguments, the argument the error must name)
API = [
    ({"learning_rate": NAN}, "learning_rate"), ({"learning_rate": INF}, "learning_rate"),
    ({"learning_rate": -1e-3}, "learning_rate"), ({"learning_rate": 1e30}, "learning_rate"),
    ({"learning_rate": "0.1"}, "learning_rate"), ({"weight_decay": -0.1}, "weight_decay"),
    ({"weight_decay": NAN}, "weight_decay"), ({"zo_eps": INF}, "zo_eps"), ({"zo_eps": 1e30}, "zo_eps"),
    ({"zo_eps": NAN}, "zo_eps"), ({"zo_eps": 0.0}, "zo_eps"), ({"zo_eps": -1e-3}, "zo_eps"),
    ({"local_learning_rate": NAN}, "local_learning_rate"), ({"local_learning_rate": -1.0}, "local_learning_rate"),
    ({"local_learning_rate": INF}, "local_learning_rate"),
    ({"per_device_train_batch_size": 0}, "per_device_train_batch"),
    ({"per_device_train_batch_size": -4}, "per_device_train_batch"),
    ({"per_device_train_batch_size": 2.5}, "per_device_train_batch"),
    ({"per_device_eval_batch_size": 0}, "per_device_eval_batch"), ({"seed": -1}, "seed"),
    ({"zo_seed": -1}, "zo_seed"), ({"zo_seed": 1.5}, "zo_seed"), ({"num_clients": 0}, "num_clients"),
    ({"num_clients": -3}, "num_clients"), ({"num_clients": 4.0}, "num_clients"), ({"num_clients": True}, "num_clients"),
    ({"num_byzantine": -1}, "num_byzantine"), ({"num_clients": 4, "num_byzantine": 2}, "num_byzantine"),
    ({"num_byzantine": 1.5}, "num_byzantine"), ({"clients_per_round": 0}, "clients_per_round"),
    ({"clients_per_round": 13}, "clients_per_round"), ({"clients_per_round": 2.5}, "clients_per_round"),
    ({"num_byzantine": 1, "max_byzantine_per_round": 2}, "max_byzantine_per_round"),
    ({"num_byzantine": 1, "max_byzantine_per_round": -1}, "max_byzantine_per_round"),
    ({"byzantine_selection": "last"}, "byzantine_selection"), ({"partition": "random"}, "partition"),
    ({"dirichlet_alpha": 0.0}, "dirichlet_alpha"), ({"dirichlet_alpha": -1.0}, "dirichlet_alpha"),
    ({"dirichlet_alpha": INF}, "dirichlet_alpha"), ({"dirichlet_alpha": NAN}, "dirichlet_alpha"),
    ({"min_client_examples": 0}, "min_client_examples"), ({"estimator": "three_point"}, "estimator"),
    ({"num_perturbations": 0}, "num_perturbations"), ({"num_perturbations": 1.5}, "num_perturbations"),
    ({"local_steps": 0}, "local_steps"), ({"local_update": "lazy"}, "local_update"),
    ({"zo_forward_batch_size": -1}, "zo_forward_batch_size"), ({"zo_schedule": "fastest"}, "zo_schedule"),
    ({"directions": "random"}, "directions"), ({"aggregation_space": "gradient"}, "aggregation_space"),
    ({"dense_memory_limit_gb": 0.0}, "dense_memory_limit_gb"), ({"dense_memory_limit_gb": NAN}, "dense_memory_limit"),
    ({"server_optimizer": "adam"}, "server_optimizer"), ({"server_betas": (0.9,)}, "server_betas"),
    ({"server_betas": (1.5, -1)}, "server_betas"), ({"server_betas": (0.9, 1.0)}, "server_betas"),
    ({"server_betas": (NAN, 0.9)}, "server_betas"), ({"server_eps": -1.0}, "server_eps"),
    ({"server_eps": 0.0}, "server_eps"), ({"server_eps": INF}, "server_eps"), ({"server_v0": -1.0}, "server_v0"),
    ({"server_v0": NAN}, "server_v0"), ({"aggregator": "trimmed"}, "aggregator"),
    ({"aggregator": "cwtm", "aggregator_kwargs": {"beta": 0.6}}, "beta"),
    ({"aggregator": "cclip", "aggregator_kwargs": {"tau": NAN}}, "tau"),
    ({"aggregator": "cclip", "aggregator_kwargs": {"tau": -1.0}}, "tau"),
    ({"aggregator": "cclip", "aggregator_kwargs": {"iters": 2.5}}, "iters"),
    ({"aggregator": "geomed", "aggregator_kwargs": {"max_iter": 1.5}}, "max_iter"),
    ({"aggregator": "geomed", "aggregator_kwargs": {"eps": 0.0}}, "eps"),
    ({"aggregator": "krum", "aggregator_kwargs": {"f": -1}}, "f="),
    ({"aggregator": "multikrum", "aggregator_kwargs": {"m": 0}}, "m="),
    ({"aggregator": "median", "aggregator_kwargs": {"beta": 0.1}}, "aggregator_kwargs"),
    ({"aggregator_kwargs": "{not json"}, "aggregator_kwargs"), ({"aggregator_kwargs": "[1, 2]"}, "aggregator_kwargs"),
    ({"pre_aggregators": ["mixing"]}, "pre_aggregators"), ({"pre_aggregators": ["bucketing:s=0"]}, "s=0"),
    ({"pre_aggregators": ["clip:c=-1"]}, "c=-1"), ({"pre_aggregators": ["bucketing:size=2"]}, "pre_aggregators"),
    ({"pre_aggregators": ["clip:c"]}, "pre_aggregators"), ({"attack": "flood"}, "attack"),
    ({"attack": "sf"}, "attack"), ({"num_byzantine": 1, "attack": "alie", "attack_kwargs": {"omega": "big"}}, "omega"),
    ({"num_byzantine": 1, "attack": "alie", "attack_kwargs": {"omega": INF}}, "omega"),
    ({"num_byzantine": 1, "attack": "alie", "attack_kwargs": {"candidates": []}}, "candidates"),
    ({"num_byzantine": 1, "attack": "foe", "attack_kwargs": {"candidates": [1.0, NAN]}}, "candidates"),
    ({"num_byzantine": 1, "attack": "alie", "attack_kwargs": {"target": "server"}}, "target"),
    ({"num_byzantine": 1, "attack": "gaussian", "attack_kwargs": {"std": -1.0}}, "std"),
    ({"num_byzantine": 1, "attack": "gaussian", "attack_kwargs": {"std": INF}}, "std"),
    ({"num_byzantine": 1, "attack": "nonfinite", "attack_kwargs": {"value": "huge"}}, "value"),
    ({"num_byzantine": 1, "attack": "lf", "attack_kwargs": {"num_classes": 0}}, "num_classes"),
    ({"num_byzantine": 1, "attack": "lf", "attack_kwargs": {"num_classes": 1}}, "num_classes"),
    ({"num_byzantine": 1, "attack": "lf", "attack_kwargs": {"num_classes": -3}}, "num_classes"),
    ({"num_byzantine": 1, "attack": "tma", "attack_kwargs": {"beta": 0.7}}, "beta"),
    ({"num_byzantine": 1, "attack": "sf", "attack_kwargs": {"scale": 2}}, "attack_kwargs"),
    ({"attack_kwargs": "nope"}, "attack_kwargs"), ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps"),
    ({"estimator": "first_order", "local_steps": 2}, "estimator"),
    ({"directions": "per_client", "aggregator": "median"}, "directions"),
    ({"aggregation_space": "parameter", "local_update": "compressed", "local_steps": 2}, "aggregation_space"),
    ({"server_optimizer": "amsgrad", "aggregation_space": "parameter"}, "server_optimizer"),
    ({"num_clients": 12, "num_byzantine": 3, "clients_per_round": 6, "aggregator": "cwtm"}, "clients_per_round"),
    ({"num_clients": 12, "num_byzantine": 2, "clients_per_round": 5, "aggregator": "krum"}, "clients_per_round"),
    ({"num_clients": 4, "num_byzantine": 1, "aggregator": "krum"}, "num_byzantine"),
    ({"num_clients": 8, "num_byzantine": 2, "aggregator": "cwtm", "pre_aggregators": ["bucketing:s=4"]},
     "num_byzantine"),
]


@pytest.mark.parametrize(("kwargs", "names"), API, ids=[f"api{i}" for i in range(len(API))])
def test_python_api_refuses_at_construction(tmp_path, kwargs, names):
    with pytest.raises(ValueError) as err:
        ZOByzantineArguments(output_dir=str(tmp_path), report_to=[], **kwargs)
    assert names in str(err.value), str(err.value)


def _lf_labels_too_large():
    data = VectorDataset(64)
    data.y[3] = 5
    return data


# refused by the trainer's construction: data-dependent, before any evaluation or round
TRAINER = [
    (lambda: VectorDataset(16), {"num_clients": 4, "min_client_examples": 5}, "min_client_examples"),
    (lambda: VectorDataset(64), {"num_clients": 8, "partition": "dirichlet", "dirichlet_alpha": 0.01,
                                 "min_client_examples": 6}, "min_client_examples"),
    (lambda: VectorDataset(3), {"num_clients": 4}, "num_clients"),
    (lambda: VectorDataset(64), {"num_byzantine": 1, "attack": "lf"}, "num_classes"),
    (_lf_labels_too_large, {"num_byzantine": 1, "attack": "lf", "attack_kwargs": {"num_classes": 2}}, "num_classes"),
    (lambda: [{"x": torch.zeros(8)} for _ in range(64)], {"partition": "dirichlet"}, "partition"),
]


@pytest.mark.parametrize(("data", "kwargs", "name"), TRAINER, ids=[f"trainer{i}" for i in range(len(TRAINER))])
def test_trainer_refuses_data_problems_at_construction(tmp_path, data, kwargs, name):
    with pytest.raises(ValueError) as err:
        make_trainer(LogisticRegression(), data(), tmp_path, **kwargs)
    assert name in str(err.value), str(err.value)


def test_trainer_refuses_label_flipping_beyond_the_model(tmp_path):
    with pytest.raises(ValueError, match="num_classes=3 exceeds the model's 2 labels"):
        model = LogisticRegression()
        model.num_labels = 2
        make_trainer(model, VectorDataset(64), tmp_path, num_byzantine=1, attack="lf",
                     attack_kwargs={"num_classes": 3})


def _spec(tmp_path, name, content):
    path = tmp_path / f"{name}.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


GOOD_SPEC = {"name": "t", "labels": ["neg", "pos"], "label_words": {"neg": "bad", "pos": "good"},
             "templates": {"masked_lm": "*cls**sent_0*_It_was*mask*.*sep+*"}, "max_length": 64, "metrics": ["accuracy"]}

# (flags for examples/run_glue_fed.py, the argument the error must name); the model must not be loaded
GLUE = [
    (["--learning_rate", "nan"], "learning_rate"), (["--learning_rate", "-1"], "learning_rate"),
    (["--learning_rate", "1e30"], "learning_rate"), (["--zo_eps", "inf"], "zo_eps"),
    (["--zo_eps", "1e30"], "zo_eps"), (["--local_learning_rate", "nan"], "local_learning_rate"),
    (["--per_device_train_batch_size", "0"], "per_device_train_batch_size"), (["--zo_seed", "-1"], "zo_seed"),
    (["--num_train_per_class", "-1"], "num_train_per_class"), (["--num_eval", "0"], "num_eval"),
    (["--num_train", "0"], "num_train"), (["--max_length", "0"], "max_length"),
    (["--dirichlet_alpha", "inf"], "dirichlet_alpha"), (["--num_byzantine", "6"], "num_byzantine"),
    (["--aggregator", "trimmed"], "aggregator"), (["--attack", "flood"], "attack"),
    (["--zo_schedule", "fastest"], "zo_schedule"), (["--partition", "random"], "partition"),
    (["--server_betas", "0.9"], "server_betas"), (["--server_eps", "-1"], "server_eps"),
    (["--server_optimizer", "amsgrad", "--server_v0", "-1"], "server_v0"),
    (["--aggregator_kwargs", "{not json"], "aggregator_kwargs"), (["--attack_kwargs", '{"omega": "big"}',
                                                                   "--attack", "alie"], "omega"),
    (["--head", "linear"], "head"), (["--tuning", "prefix"], "tuning"), (["--tuning", "head"], "tuning"),
    (["--lora_r", "0"], "lora_r"), (["--lora_alpha", "nan"], "lora_alpha"), (["--prompt_kind", "seq2seq"],
                                                                              "prompt_kind"),
    (["--data_dir", "/nonexistent/sst2"], "data_dir"), (["--task", "nli9"], "task"),
    (["--clients_per_round", "6"], "clients_per_round"),
]


@pytest.mark.parametrize(("flags", "name"), GLUE, ids=[f"glue{i}" for i in range(len(GLUE))])
def test_main_job_refuses_before_loading_the_model(monkeypatch, capsys, flags, name):
    module = load_example("run_glue_fed")
    monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    argv = ["--output_dir", "/tmp/unused", "--data_dir", os.path.join(DATA, "sst2"), "--model_name_or_path",
            "/nonexistent/model", *flags]
    with pytest.raises((ValueError, SystemExit)) as err:
        module.main(argv)
    message = str(err.value) + capsys.readouterr().err
    assert name in message, message


SPECS = [
    ("malformed", "{not json", "cannot be read as JSON"), ("list", "[1, 2]", "must be a JSON object"),
    ("nolabels", {k: v for k, v in GOOD_SPEC.items() if k != "labels"}, "lacks ['labels']"),
    ("onelabel", {**GOOD_SPEC, "labels": ["pos"], "label_words": {"pos": "good"}}, "labels="),
    ("duplicate", {**GOOD_SPEC, "labels": ["pos", "pos"]}, "labels="),
    ("words", {**GOOD_SPEC, "label_words": {"neg": "bad"}}, "label_words lacks"),
    ("maxlen", {**GOOD_SPEC, "max_length": 0}, "max_length"), ("metric", {**GOOD_SPEC, "metrics": ["bleu"]}, "metrics"),
    ("templates", {**GOOD_SPEC, "templates": {}}, "templates"), ("unknown", {**GOOD_SPEC, "extra": 1}, "unknown keys"),
]


@pytest.mark.parametrize(("name", "content", "message"), SPECS, ids=[s[0] for s in SPECS])
def test_task_spec_refused_with_the_file_named(tmp_path, monkeypatch, name, content, message):
    module = load_example("run_glue_fed")
    monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    path = _spec(tmp_path, name, content)
    with pytest.raises(ValueError) as err:
        module.main(["--output_dir", str(tmp_path / "out"), "--task", path, "--data_dir", os.path.join(DATA, "sst2"),
                     "--model_name_or_path", "/nonexistent"])
    assert message in str(err.value) and ("t'" in str(err.value) or path in str(err.value)), str(err.value)


MNIST = [
    (["--data_dir", "/nonexistent"], "data_dir"), (["--num_byzantine", "20"], "num_byzantine"),
    (["--learning_rate", "inf"], "learning_rate"), (["--num_perturbations", "0"], "num_perturbations"),
    (["--aggregator", "krum", "--clients_per_round", "8"], "clients_per_round"),
]


@pytest.mark.parametrize(("flags", "name"), MNIST, ids=[f"mnist{i}" for i in range(len(MNIST))])
def test_mnist_example_refuses_before_reading_data(monkeypatch, capsys, flags, name):
    module = load_example("run_mnist_fed")
    monkeypatch.setattr(module, "MNIST", lambda *a, **k: pytest.fail("the data were read"))
    with pytest.raises((ValueError, SystemExit)) as err:
        module.main(["--output_dir", "/tmp/unused", *flags])
    message = str(err.value) + capsys.readouterr().err
    assert name in message, message


def test_battery_size():
    """The issue asks for at least 100 distinct bad configurations."""
    total = len(API) + len(TRAINER) + 1 + len(GLUE) + len(SPECS) + len(MNIST)
    print(f"bad configurations: {total}")
    assert total >= 100

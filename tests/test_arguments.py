"""Every invalid configuration fails at construction, naming the field and what it accepts."""

import pytest
from helpers import LogisticRegression, VectorDataset, make_trainer

from zo_byzantine import ZOByzantineArguments


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_clients": 4, "num_byzantine": 2}, "num_byzantine=2"),
        ({"num_clients": 4, "num_byzantine": -1}, "num_byzantine=-1"),
        ({"num_perturbations": 0}, "num_perturbations=0"),
        ({"zo_eps": 0.0}, "zo_eps=0.0"),
        ({"zo_eps": -1e-3}, "zo_eps=-0.001"),
        ({"num_clients": 4, "clients_per_round": 5}, r"clients_per_round=5 must be in \[1"),
        ({"clients_per_round": 0}, "clients_per_round=0"),
        ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps=2"),
        ({"aggregator": "nope"},
         "aggregator='nope'.*accepted: cclip, cwtm, .*geomed, history, krum, mean, median, multikrum"),
        ({"attack": "nope"}, "attack='nope'.*accepted: adaptive, alie, always_large"),
        ({"estimator": "nope"}, "estimator='nope'.*accepted: first_order, gradient_projection, one_point, two_point"),
        ({"partition": "nope"}, "partition='nope'.*accepted: iid, dirichlet, shards"),
        ({"local_update": "nope"}, "local_update='nope'"),
        ({"byzantine_selection": "nope"}, "byzantine_selection='nope'"),
        ({"pre_aggregators": ["nope"]}, "pre_aggregators entry='nope'.*accepted: bucketing, clip, nnm"),
        (
            {"num_clients": 4, "num_byzantine": 1, "aggregator": "krum"},
            r"aggregator='krum' cannot hold.*krum: needs m > 2f \+ 2 = 4 \(m=4 vectors, f=1 Byzantine\)",
        ),
        ({"num_clients": 6, "num_byzantine": 2, "aggregator": "cwtm", "aggregator_kwargs": {"beta": 0.5}},
         r"cwtm: beta=0.5 must be in \[0, 0.5\)"),
        (
            {"num_clients": 8, "num_byzantine": 2, "aggregator": "krum", "pre_aggregators": ["bucketing:s=2"]},
            r"aggregator='bucketing\+krum'.*krum: needs m > 2f \+ 2 = 6 \(m=4 vectors, f=2 Byzantine\)",
        ),
        ({"num_byzantine": 1, "max_byzantine_per_round": 2}, r"max_byzantine_per_round=2 must be in \[0, num_byz"),
        ({"server_betas": [0.9]}, "server_betas=.*two numbers"),
        ({"aggregator": "geomed", "aggregator_kwargs": {"max_iter": 1.5}}, "geomed: max_iter=1.5 must be an integer"),
        ({"aggregator": "cclip", "aggregator_kwargs": {"iters": 2.5}}, "cclip: iters=2.5 must be an integer"),
        ({"aggregator": "cclip", "aggregator_kwargs": {"tau": float("nan")}}, "cclip: tau=nan"),
        ({"num_byzantine": 1, "attack": "lf", "attack_kwargs": {"num_classes": 1}}, "lf: num_classes=1"),
        ({"aggregator_kwargs": {"nope": 1}}, "aggregator_kwargs.*nope"),
        ({"num_byzantine": 1, "attack": "alie", "attack_kwargs": {"omega": "big"}}, "omega='big'"),
        ({"num_byzantine": 1, "attack": "alie", "attack_kwargs": {"target": "x"}}, "target='x'"),
        ({"attack": "sf"}, "attack='sf' needs Byzantine clients"),
        ({"num_byzantine": 1, "attack": "nonfinite", "attack_kwargs": {"value": "huge"}}, "value='huge'"),
        ({"dirichlet_alpha": 0.0}, "dirichlet_alpha=0.0"),
        ({"min_client_examples": 0}, "min_client_examples=0"),
        ({"local_steps": 0}, "local_steps=0"),
        ({"directions": "nope"}, "directions='nope'.*accepted: shared, per_client"),
        ({"aggregation_space": "nope"}, "aggregation_space='nope'.*accepted: projection, parameter"),
        ({"server_optimizer": "adam"}, "server_optimizer='adam'.*accepted: sgd, amsgrad"),
        ({"estimator": "first_order", "local_steps": 2}, "estimator='first_order'"),
        ({"directions": "per_client", "aggregator": "median"}, "directions='per_client'"),
        ({"aggregation_space": "parameter", "local_update": "compressed", "local_steps": 2}, "does not combine"),
        ({"aggregator_kwargs": "{not json"}, "aggregator_kwargs must be a JSON object"),
    ],
)
def test_invalid_configuration_raises(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ZOByzantineArguments(output_dir=str(tmp_path), report_to=[], **kwargs)


@pytest.mark.parametrize(
    ("rule", "pre"),
    [("cwtm", []), ("median", []), ("krum", []), ("multikrum", []), ("geomed", []), ("cclip", []),
     ("cwtm", ["nnm"]), ("krum", ["bucketing:s=2"])],
)
def test_sampled_configuration_that_cannot_hold_is_refused_naming_the_fields(tmp_path, rule, pre):
    # 6 of 12 clients, b = 3: a round may hold f = min(3, 6) = 3 Byzantine vectors of 6
    with pytest.raises(ValueError) as err:
        ZOByzantineArguments(output_dir=str(tmp_path), report_to=[], num_clients=12, num_byzantine=3,
                             clients_per_round=6, aggregator=rule, pre_aggregators=pre)
    message = str(err.value)
    for part in ("clients_per_round=6", "num_byzantine=3", f"{rule}", "m=6", "f=3"):
        assert part in message, (part, message)
    # the documented per-round bound makes the same sampling valid for the trimmed mean
    ZOByzantineArguments(output_dir=str(tmp_path), report_to=[], num_clients=12, num_byzantine=3,
                         clients_per_round=6, aggregator="cwtm", max_byzantine_per_round=2)


def test_command_line_lists_choices_and_parses_betas():
    from transformers import HfArgumentParser

    parser = HfArgumentParser(ZOByzantineArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", "out", "--report_to", "none", "--server_betas", "0.8", "0.95", "--partition", "shards"]
    )
    assert args.server_betas == (0.8, 0.95) and args.partition == "shards"
    text = parser.format_help()
    for choice in ("gradient_projection", "first_order", "per_client", "antithetic", "amsgrad", "dirichlet"):
        assert choice in text, choice
    for name in ("multikrum", "geomed", "cclip", "alie", "random_choice", "bucketing"):  # registered names
        assert name in text, name
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(["--output_dir", "out", "--zo_schedule", "fastest"])


def test_json_kwargs_are_parsed(tmp_path):
    args = ZOByzantineArguments(
        output_dir=str(tmp_path), report_to=[], num_byzantine=1, attack="alie", attack_kwargs='{"omega": 2}'
    )
    assert args.attack_kwargs == {"omega": 2}
    assert args.zo_seed == args.seed


def test_partition_problems_fail_at_construction_before_any_evaluation(tmp_path):
    with pytest.raises(ValueError, match="too few for num_clients=4"):
        make_trainer(LogisticRegression(), VectorDataset(16), tmp_path, num_clients=4, min_client_examples=5)
    with pytest.raises(ValueError, match="min_client_examples=6"):
        make_trainer(LogisticRegression(), VectorDataset(64), tmp_path, num_clients=8, partition="dirichlet",
                     dirichlet_alpha=0.01, min_client_examples=6)
    with pytest.raises(ValueError, match="attack='lf' needs the number of classes"):
        make_trainer(LogisticRegression(), VectorDataset(64), tmp_path, num_byzantine=1, attack="lf")
    with pytest.raises(ValueError, match="num_classes=2 but the training set has label 2"):
        data = VectorDataset(64)
        data.y[0] = 2
        make_trainer(LogisticRegression(), data, tmp_path, num_byzantine=1, attack="lf",
                     attack_kwargs={"num_classes": 2})


def test_trainer_needs_zo_arguments(tmp_path):
    from transformers import TrainingArguments

    from zo_byzantine import ZOByzantineTrainer

    with pytest.raises(TypeError, match="ZOByzantineArguments"):
        ZOByzantineTrainer(model=LogisticRegression(), args=TrainingArguments(output_dir=str(tmp_path), report_to=[]))

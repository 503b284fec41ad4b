"""One federated round: batched evaluation vs a per-client reference, counts, MeZO equivalence."""

import copy

import numpy as np
import pytest
import torch
from helpers import (
    LogisticRegression,
    TextDataset,
    VectorDataset,
    collate,
    dataset_loss,
    gaussian_like,
    make_trainer,
    tiny_bert,
    tiny_gpt2,
    wordpiece_tokenizer,
)

from zo_byzantine.perturbation import COUNTER, ParameterTable, direction_seed


@pytest.fixture(scope="module")
def tokenizer():
    return wordpiece_tokenizer()


def _first_round(trainer):
    """Run set-up and one training_step by hand; return the round's batch and estimate inputs."""
    trainer.create_optimizer()
    loader = trainer.get_train_dataloader()
    inputs = next(iter(loader))
    return inputs


def _reference_client_losses(model, dataset, collator, trainer, seed, coeff):
    """Each client alone: a copy of the model with w + coeff z written in, its own padded batch, model's loss."""
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        for j, p in ParameterTable(ref):
            p.add_(gaussian_like(p, seed, j), alpha=coeff)
    fed, batch = trainer.federation, trainer.args.per_device_train_batch_size
    indices = fed.round_indices(0)
    losses = []
    for k in range(len(fed.participants(0))):
        items = [dataset[i] for i in indices[k * batch : (k + 1) * batch]]
        with torch.no_grad():
            losses.append(ref(**collator(items)).loss.double())
    return torch.stack(losses)


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_batched_round_equals_per_client_loop(tmp_path, tokenizer, kind):
    causal = kind == "gpt2"
    model = (tiny_gpt2 if causal else tiny_bert)(vocab_size=tokenizer.vocab_size)
    dataset = TextDataset(tokenizer, n=64, causal=causal)
    collator = collate(tokenizer)
    trainer = make_trainer(model, dataset, tmp_path, collator, num_clients=4, partition="iid")
    inputs = trainer._prepare_inputs(_first_round(trainer))
    seed = direction_seed(trainer.args.zo_seed, 0, 1, 0)
    client_of = torch.arange(4).repeat_interleave(4)
    for coeff in (1e-3, -1e-3):
        with torch.no_grad():
            model.eval()
            got = trainer.round_clients(model, inputs, 4).batched_losses(inputs, client_of, 4, [(seed, coeff)])
        expected = _reference_client_losses(model, dataset, collator, trainer, seed, coeff)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


def test_chunked_forwards_give_the_same_losses(tmp_path, tokenizer):
    model = tiny_bert(vocab_size=tokenizer.vocab_size)
    dataset = TextDataset(tokenizer, n=64)
    whole = make_trainer(model, dataset, tmp_path, collate(tokenizer))
    chunked = make_trainer(model, dataset, tmp_path, collate(tokenizer), zo_forward_batch_size=3)
    inputs = whole._prepare_inputs(_first_round(whole))
    _first_round(chunked)
    client_of = torch.arange(4).repeat_interleave(4)
    with torch.no_grad():
        a = whole.round_clients(model.eval(), inputs, 4).batched_losses(inputs, client_of, 4, [(11, 1e-3)])
        b = chunked.round_clients(model.eval(), inputs, 4).batched_losses(inputs, client_of, 4, [(11, 1e-3)])
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def _drawn_per_round(tmp_path, num_clients, batch, schedule):
    model = LogisticRegression()
    trainer = make_trainer(
        model,
        VectorDataset(512),
        tmp_path,
        num_clients=num_clients,
        per_device_train_batch_size=batch,
        max_steps=3,
        num_perturbations=2,
        zo_schedule=schedule,
    )
    start = COUNTER.drawn
    trainer.train()
    return (COUNTER.drawn - start) / 3 / ParameterTable(model).numel


def test_generator_passes_do_not_depend_on_number_of_clients(tmp_path):
    passes = [_drawn_per_round(tmp_path, n, 32 // n, "two_forwards") for n in (1, 4, 16)]
    assert passes == [6.0, 6.0, 6.0]  # 2 perturbed forwards + 1 update per direction, nu = 2
    passes = [_drawn_per_round(tmp_path, n, 32 // n, "antithetic") for n in (1, 4, 16)]
    # 1 draw for both forwards + 1 update per direction; the first round also runs the +mu forward once to check
    # the doubled batch against it: (6 + 4 + 4) / 3
    assert passes == [14 / 3] * 3


@pytest.mark.parametrize("schedule", ["two_forwards", "auto"])
def test_single_client_equals_mezo_reference(tmp_path, schedule):
    """One direction at a time: bitwise (the loss of few classes is computed by rows, as here);
    auto (stacked directions, one matrix product for +mu and -mu): the
    same up to float32 rounding."""
    torch.manual_seed(0)
    model = LogisticRegression()
    reference = copy.deepcopy(model)
    dataset = VectorDataset(64)
    lr, mu, steps = 0.05, 1e-3, 5
    trainer = make_trainer(
        model,
        dataset,
        tmp_path,
        num_clients=1,
        per_device_train_batch_size=8,
        max_steps=steps,
        learning_rate=lr,
        zo_eps=mu,
        lr_scheduler_type="constant",
        zo_schedule=schedule,
    )
    trainer.train()
    assert trainer.schedule.stack is (schedule == "auto")

    table = ParameterTable(reference)
    w = [p.detach().clone() for p in table.params]
    for t in range(steps):
        idx = trainer.federation.round_indices(t)
        x = torch.stack([dataset[i]["x"] for i in idx])
        y = torch.stack([dataset[i]["labels"] for i in idx])
        seed = direction_seed(trainer.args.zo_seed, t, 1, 0)
        z = [gaussian_like(p, seed, j) for j, p in table]

        def loss(sign):
            with torch.no_grad():
                for p, w0, zj in zip(table.params, w, z, strict=True):
                    p.copy_(w0 + zj * (sign * mu))
                logits = reference(x)["logits"]  # cross-entropy as max + log sum exp(x - max) - x_y
                peak = logits.max(dim=1).values
                per_example = peak + (logits - peak[:, None]).exp().sum(dim=1).log() - logits[torch.arange(len(y)), y]
                return per_example.double().mean()

        g = ((loss(1) - loss(-1)) / (2 * mu)).item()
        w = [w0 + zj * (-lr * g) for w0, zj in zip(w, z, strict=True)]  # w - lr g z
    for p, expected in zip(ParameterTable(model).params, w, strict=True):
        if schedule == "two_forwards":
            assert torch.equal(p.detach(), expected)
        else:
            torch.testing.assert_close(p.detach(), expected, rtol=1e-4, atol=1e-5)  # rounding / (2 mu)


def test_loss_decreases_on_learnable_task(tmp_path):
    model = LogisticRegression()
    dataset = VectorDataset(512)
    trainer = make_trainer(
        model,
        dataset,
        tmp_path,
        num_clients=8,
        per_device_train_batch_size=16,
        max_steps=150,
        learning_rate=0.2,
        num_perturbations=4,
        logging_steps=50,
    )

    before = dataset_loss(model, dataset)
    trainer.train()
    after = dataset_loss(model, dataset)
    assert after < 0.6 * before, (before, after)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses[-1] < losses[0]


def test_one_point_estimator_trains(tmp_path):
    model = LogisticRegression()
    dataset = VectorDataset(256)
    trainer = make_trainer(
        model,
        dataset,
        tmp_path,
        estimator="one_point",
        max_steps=100,
        learning_rate=0.2,
        num_perturbations=4,
        logging_steps=100,
    )
    start = dataset_loss(model, dataset)
    trainer.train()
    end = dataset_loss(model, dataset)
    assert end < start


def test_client_sampling_changes_participants_and_keeps_batch_layout(tmp_path):
    trainer = make_trainer(LogisticRegression(), VectorDataset(256), tmp_path, num_clients=8, clients_per_round=3)
    trainer.create_optimizer()
    trainer.get_train_dataloader()
    rounds = [tuple(trainer.federation.participants(t)) for t in range(10)]
    assert all(len(r) == 3 for r in rounds) and len(set(rounds)) > 1
    trainer.train()
    assert trainer.state.global_step == 6


def test_communication_logged_beside_fedavg(tmp_path):
    model = LogisticRegression()
    trainer = make_trainer(model, VectorDataset(128), tmp_path, num_perturbations=3, max_steps=2)
    trainer.train()
    log = next(entry for entry in trainer.state.log_history if "loss" in entry)
    assert log["uplink_scalars_per_client"] == 3 and log["uplink_bytes_per_client"] == 12
    assert log["fedavg_bytes_per_client"] == 4 * sum(p.numel() for p in model.parameters())
    assert "grad_norm" not in log and log["skipped_rounds"] == 0


def test_same_seed_same_result(tmp_path):
    results = []
    for _ in range(2):
        model = LogisticRegression()
        torch.manual_seed(1)
        model.linear.reset_parameters()
        make_trainer(model, VectorDataset(128), tmp_path, max_steps=4, partition="dirichlet").train()
        results.append(np.concatenate([p.detach().numpy().ravel() for p in model.parameters()]))
    assert np.array_equal(results[0], results[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_class_cross_entropy_by_rows_equals_torch(dtype):
    """The per-example cross-entropy of few-class logits (computed by rows) against ``F.cross_entropy``: same
    values up to rounding, ignored labels give 0 and count 0 (even with non-finite logits), bad labels raise."""
    from zo_byzantine.losses import IGNORE_INDEX, per_example_loss

    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(500, 10, generator=generator) * 8).to(dtype)
    labels = torch.randint(0, 10, (500,), generator=generator)
    labels[::9] = IGNORE_INDEX
    logits[9, 3] = float("inf")  # an ignored example: its loss is 0, as torch's
    sums, counts = per_example_loss(None, {"logits": logits}, labels)
    expected = torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
    tolerance = {"rtol": 1e-6, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(sums, expected.double(), **tolerance)
    assert torch.equal(counts, (labels != IGNORE_INDEX).double())
    with_grad, _ = per_example_loss(None, {"logits": logits.clone().requires_grad_()}, labels)  # torch's (backward)
    assert torch.equal(with_grad.detach(), expected.double()) and with_grad.requires_grad
    for bad in (-1, 10):
        with pytest.raises(IndexError, match="labels must be in"):
            per_example_loss(None, {"logits": logits}, torch.full((500,), bad))

"""Stacked directions (``perturbation.stacked``, ``zo_schedule="auto"``): several models in one forward, equal to
one forward per model; chosen for a first ``nn.Linear`` (a shared matrix product), not for a BERT."""

import copy

import pytest
import torch
from helpers import (
    LogisticRegression,
    TextDataset,
    VectorDataset,
    collate,
    make_trainer,
    tiny_bert,
    wordpiece_tokenizer,
)

from zo_byzantine import batched_clients, local_models
from zo_byzantine.directions import TorchDirections
from zo_byzantine.perturbation import COUNTER, ParameterTable, direction_seed, perturbed, stacked


class Shift(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.b = torch.nn.Parameter(torch.randn(7))

    def forward(self, scale):
        return scale + self.b


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)
        self.norm, self.shift = torch.nn.LayerNorm(7), Shift()

    def forward(self, x, scale):  # scale: a broadcast input (leading dimension 1) of an owning module
        shift = self.shift(scale)
        return {"logits": self.second(torch.relu(self.norm(self.first(x))) * shift), "shift": shift}


def _models():
    seeds = [direction_seed(1, 0, 1, r) for r in range(3)]
    return [[(s, sign * 1e-2)] for s in seeds for sign in (1.0, -1.0)] + [[(seeds[0], 0.3), (seeds[1], -0.2)], []]


# pairs: the product by linearity (pairs_and_base: with the unperturbed model, out of the pairs' order); general: one
# weight per model
@pytest.mark.parametrize("kind", ["pairs", "pairs_after_offset", "pairs_and_base", "general"])
@pytest.mark.parametrize("shared", [True, False])
def test_stacked_forward_equals_one_forward_per_model(shared, kind):
    torch.manual_seed(0)
    model = MLP().double()
    table = ParameterTable(model)
    x, scale = torch.randn(4, 5, dtype=torch.float64), torch.rand(1, 7, dtype=torch.float64)
    models = {"pairs": _models()[:6], "general": _models(), "pairs_and_base": [[], *_models()[:6]],
              "pairs_after_offset": [[(direction_seed(2, 0, 1, 0), 0.4), *m] for m in _models()[:6]]}[kind]
    usage = {}
    with torch.no_grad(), stacked(table, models, 4, usage):
        out = model(x if shared else x.repeat(len(models), 1), scale)
    expected = []
    for terms in models:
        with torch.no_grad(), perturbed(table, terms):
            expected.append(model(x, scale)["logits"])
    torch.testing.assert_close(out["logits"], torch.cat(expected), rtol=1e-12, atol=1e-12)
    assert out["shift"].shape == (len(models) * 4, 7)  # an output of a broadcast input, expanded per example
    assert usage.get("shared_products", 0) == (1 if shared else 0)  # the first Linear, when its input is shared
    assert all(torch.equal(a, b) for a, b in zip(ParameterTable(model).params, table.params, strict=True))


def _run(tmp_path, model, **kwargs):
    trainer = make_trainer(model, VectorDataset(128, dtype=torch.float64), tmp_path, max_steps=3, num_perturbations=4,
                           logging_steps=1, num_clients=4, per_device_train_batch_size=8, **kwargs)
    start = COUNTER.drawn
    trainer.train()
    return trainer, (COUNTER.drawn - start) / ParameterTable(model).numel


@pytest.mark.parametrize("directions", ["shared", "per_client"])  # per_client: FedES, each client its own 2 nu models
@pytest.mark.parametrize("split", [False, True])  # split: the 8 models of a step in 4 forwards of 2
def test_auto_stacks_a_linear_model_and_equals_one_direction_at_a_time(tmp_path, monkeypatch, split, directions):
    # rows of a forward = STACKED_BYTES / (its activations per row, at least MIN_ROW_BYTES): 2 models x the examples
    # of a forward (all 4 clients' 8 with shared directions, one client's 8 with per-client directions)
    split_rows = 2 * (8 if directions == "per_client" else 32)
    if split:
        monkeypatch.setattr(batched_clients, "STACKED_BYTES", split_rows * batched_clients.MIN_ROW_BYTES)
    torch.manual_seed(0)
    model = LogisticRegression().double()
    reference_model = copy.deepcopy(model)
    trainer, passes = _run(tmp_path / "auto", model, directions=directions)  # zo_schedule="auto", the default
    reference, reference_passes = _run(tmp_path / "ref", reference_model, zo_schedule="two_forwards",
                                       directions=directions)
    assert trainer.schedule.stack is True and reference.schedule.stack is False
    unsplit_rows = batched_clients.STACKED_BYTES // batched_clients.MIN_ROW_BYTES
    assert trainer.schedule.stack_rows == (split_rows if split else unsplit_rows)
    got = torch.tensor([r["coefficients"] for r in trainer.ledger.rounds])
    expected = torch.tensor([r["coefficients"] for r in reference.ledger.rounds])
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    for a, b in zip(ParameterTable(model).params, ParameterTable(reference_model).params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    # nu = 4, 3 rounds: one at a time 3 draws per direction (+mu, -mu, update); stacked 2 (both signs, update).
    # Round 1 runs one at a time (8), checks stacking (4), updates (4); rounds 2-3 stack (4) and update (4); with
    # per-client directions, each of the 4 clients draws its own, and round 1's one-at-a-time evaluations (clients
    # at w + mu z_i: different models) stack the clients once checked: direction 1 draws for the client-by-client
    # check and the stacked forward (2), directions 2-4 once for both signs (1 each): 5 instead of 8
    bases = 4 if directions == "per_client" else 1
    assert reference_passes == bases * 3 * 4 * 3
    first = 5 if directions == "per_client" else 8
    assert passes == bases * (first + 4 + 4 + 2 * (4 + 4))
    assert trainer.schedule.stack_clients is (True if directions == "per_client" else None)  # None: never needed


def test_auto_does_not_stack_a_bert(tmp_path):
    tokenizer = wordpiece_tokenizer()
    model = tiny_bert(vocab_size=tokenizer.vocab_size)
    trainer = make_trainer(model, TextDataset(tokenizer, 24), tmp_path, collate(tokenizer), max_steps=1)
    trainer.train()
    assert trainer.schedule.stack is False  # its first owners are embeddings: no shared matrix product


# --- the clients' different local models in one forward (K > 1: ``BatchedClients.stacked_clients``) ---


def _bert_run(tmp_path, tokenizer, schedule, **kwargs):
    model = tiny_bert(vocab_size=tokenizer.vocab_size).double()
    settings = dict(max_steps=2, num_clients=3, per_device_train_batch_size=4, local_steps=3, local_learning_rate=0.5,
                    learning_rate=0.1, logging_steps=1, zo_schedule=schedule)
    settings.update(kwargs)
    trainer = make_trainer(model, TextDataset(tokenizer, 48), tmp_path, collate(tokenizer), **settings)
    start = COUNTER.drawn
    trainer.train()
    return trainer, model, (COUNTER.drawn - start) / ParameterTable(model).numel


@pytest.mark.parametrize("num_perturbations", [1, 2])
def test_auto_stacks_clients_of_a_bert_and_equals_client_by_client(tmp_path, monkeypatch, num_perturbations):
    """After the first local step the 3 clients hold different models; auto evaluates them in one forward (a
    batched product per linear layer, the rows each client reads of each embedding table): the same rounds as one
    forward per client (float64), with each step's direction drawn once for all clients. From the second round
    the embedding tables' local models are kept at the rows each client reads."""
    calls = []
    by_rows = local_models.LocalModels.perturbed_rows
    monkeypatch.setattr(local_models.LocalModels, "perturbed_rows",
                        lambda self, *a: calls.append(a[0]) or by_rows(self, *a))
    tokenizer = wordpiece_tokenizer()  # one for both runs: their examples must be the same tokens
    trainer, model, passes = _bert_run(tmp_path / "auto", tokenizer, "auto", num_perturbations=num_perturbations)
    reference, reference_model, reference_passes = _bert_run(tmp_path / "ref", tokenizer, "two_forwards",
                                                             num_perturbations=num_perturbations)
    assert trainer.schedule.stack_clients is True and reference.schedule.stack_clients is False
    got = torch.tensor([r["coefficients"] for r in trainer.ledger.rounds])
    expected = torch.tensor([r["coefficients"] for r in reference.ledger.rounds])
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    for a, b in zip(ParameterTable(model).params, ParameterTable(reference_model).params, strict=True):
        # a batched product rounds as it does: a loss difference's last bits (~1e-14) times 1 / (2 mu) = 500 and the
        # local steps reach 1.1e-11 on some CPUs (a Xeon with AVX-512, 2026-11-29)
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    assert passes < reference_passes
    names = ParameterTable(model).names
    assert {names[j] for j in calls} == {f"bert.embeddings.{e}_embeddings.weight" for e in ("word", "position",
                                                                                          "token_type")}


def test_local_models_kept_by_rows_are_the_bits_of_whole_ones():
    """``LocalModels`` with the embedding tables kept at the rows read: those rows plus a last term are the bits
    of the whole local model's, every other tensor is the same, and ``materialize`` gives the whole tensors."""
    model = tiny_bert(vocab_size=60)
    table = ParameterTable(model)
    rows_only = local_models.rows_only_parameters(table)
    assert {table.names[j] for j in rows_only} == {f"bert.embeddings.{e}_embeddings.weight"
                                                   for e in ("word", "position", "token_type")}
    whole, by_rows = local_models.LocalModels(table, 3), local_models.LocalModels(table, 3, rows_only)
    seeds = [direction_seed(4, 0, step, 0) for step in range(4)]
    rows = [torch.tensor([0, 5, 17, 59]), torch.tensor([1]), torch.tensor([0, 2, 3])]
    # steps 1-3, then client models that do not extend the held ones (each starts again from w)
    for step, sign in ((1, 1), (2, 1), (3, 1), (2, -1)):
        prefix = [[(seeds[k], sign * 0.1 * (i + 1) * (-1) ** k) for k in range(step)] for i in range(3)]
        full, kept = whole.advance(prefix), by_rows.advance(prefix)
        last = [(seeds[step], 1e-3)]
        for j, (a, b) in enumerate(zip(full, kept, strict=True)):
            if j not in rows_only:
                assert torch.equal(a, b)
                continue
            assert b is None
            for i in range(3):
                r = rows[i].clamp(max=a.shape[1] - 1)
                expected = table.directions.perturb(a[i], j, last)[r]
                assert torch.equal(by_rows.perturbed_rows(j, i, r, last).view(torch.int32), expected.view(torch.int32))
    for a, b in zip(whole.advance(prefix), by_rows.materialize(), strict=True):
        assert torch.equal(a, b)
    assert not by_rows.rows_only


class Wrapped(torch.nn.Module):
    """An owner of a trainable parameter with an embedding inside: it runs once per client with whole weights."""

    def __init__(self):
        super().__init__()
        self.scale, self.inner = torch.nn.Parameter(torch.ones(())), torch.nn.Embedding(9, 3)

    def forward(self, ids):
        return self.inner(ids) * self.scale


class Broadcast(torch.nn.Module):
    """A linear layer on a broadcast input (leading dimension 1), beside one on the examples."""

    def __init__(self):
        super().__init__()
        self.first, self.side = torch.nn.Linear(5, 3), torch.nn.Linear(4, 3)
        self.register_buffer("ones", torch.ones(1, 4))

    def forward(self, x):
        return {"logits": self.first(x) + self.side(self.ones)}


def test_stacked_clients_with_one_example_each_use_their_own_weights_on_a_broadcast_input():
    """One example per client: a linear layer's broadcast input has the leading dimension of a client's rows; it must
    still meet each client's own local model (not ``w``), as one perturbed forward per client does."""
    torch.manual_seed(0)
    model = Broadcast().double()
    table = ParameterTable(model)
    x = torch.randn(3, 5, dtype=torch.float64)
    bases = [torch.stack([p.detach() + 0.5 * g * torch.randn_like(p) for g in range(3)]) for p in table.params]
    groups = [[(direction_seed(5, 0, 1, 0), 1e-2)]] * 3
    with torch.no_grad(), stacked(table, groups, 1, bases=bases, cache={}, per_group_products=True, scratch={}):
        got = model(x)["logits"]
    expected = []
    for g in range(3):
        with torch.no_grad(), perturbed(table, groups[g], base=[b[g] for b in bases]):
            expected.append(model(x[g : g + 1])["logits"])
    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-12, atol=1e-12)


class KeywordEmbedding(torch.nn.Module):
    """An embedding called with a keyword argument (the stacked forward then runs it whole, once per client)."""

    def __init__(self):
        super().__init__()
        self.table, self.head = torch.nn.Embedding(16, 4), torch.nn.Linear(4, 2)

    def forward(self, x, labels=None):
        ids = (x.abs() * 3).long().clamp(max=15)
        return {"logits": self.head(self.table(input=ids).mean(dim=1))}


def _auto_and_client_by_client(tmp_path, make_model, rounds: int):
    """The same K = 3 run with ``zo_schedule`` auto and two_forwards: (auto trainer, auto weights, reference
    weights)."""
    runs = {}
    for schedule in ("auto", "two_forwards"):
        torch.manual_seed(0)
        model = make_model().double()
        trainer = make_trainer(model, VectorDataset(96, dtype=torch.float64), tmp_path / schedule, max_steps=rounds,
                               num_clients=3, per_device_train_batch_size=4, local_steps=3, local_learning_rate=0.5,
                               logging_steps=1, zo_schedule=schedule)
        trainer.train()
        runs[schedule] = (trainer, [p.detach().clone() for p in model.parameters()])
    return runs["auto"][0], runs["auto"][1], runs["two_forwards"][1]


def test_an_embedding_the_check_saw_read_whole_is_kept_whole_in_later_rounds(tmp_path):
    trainer, got, expected = _auto_and_client_by_client(tmp_path, KeywordEmbedding, rounds=3)
    assert trainer.schedule.stack_clients is True and trainer.schedule.rows_only == ()
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("budget_bytes, stacks", [(300, False), (2000, True)])
def test_the_budget_counts_the_frozen_weights_a_stacked_linear_layer_copies(tmp_path, budget_bytes, stacks):
    """Only the bias trainable (16 bytes): stacking 3 clients copies the frozen 8 x 2 weight per client, which the
    budget must count (656 bytes needed here, 160 when counting trainable values only)."""
    torch.manual_seed(0)
    model = LogisticRegression().double()
    model.linear.weight.requires_grad_(False)
    trainer = make_trainer(model, VectorDataset(96, dtype=torch.float64), tmp_path, max_steps=1, num_clients=3,
                           per_device_train_batch_size=4, local_steps=2, zo_cache_budget_gb=budget_bytes / 2**30)
    trainer.train()
    assert trainer.schedule.stack_clients is (True if stacks else None)


def test_only_plain_untied_unnested_embeddings_are_kept_by_rows():
    model = torch.nn.ModuleDict({"plain": torch.nn.Embedding(9, 3), "wrapped": Wrapped(),
                                 "capped": torch.nn.Embedding(9, 3, max_norm=1.0), "tied": torch.nn.Embedding(9, 3),
                                 "head": torch.nn.Linear(3, 9)})
    model["head"].weight = model["tied"].weight  # tied to a linear layer: read whole
    table = ParameterTable(model)
    assert {table.names[j] for j in local_models.rows_only_parameters(table)} == {"plain.weight"}
    # the torch generator draws a whole tensor for any of its rows: nothing is kept by rows
    assert local_models.rows_only_parameters(ParameterTable(model, TorchDirections())) == set()


def _client_by_client(model, table, inputs, groups, bases):
    """Each client's 2 examples in a plain perturbed forward at ``bases[.][g] + groups[g]``."""
    logits = []
    for g, terms in enumerate(groups):
        part = {k: v[2 * g : 2 * g + 2] for k, v in inputs.items()}
        with torch.no_grad(), perturbed(table, terms, base=[b[g] for b in bases]):
            logits.append(model(**part).logits)
    return torch.cat(logits)


def test_stacked_clients_equal_perturbed_forwards_at_their_local_models():
    """``stacked(..., bases, per_group_products=True)`` against one plain perturbed forward per client at
    ``base_i + terms_i``, float64, each client on its own rows; tied and frozen parameters included."""
    tokenizer = wordpiece_tokenizer()
    model = tiny_bert(vocab_size=tokenizer.vocab_size).double()
    model.bert.encoder.layer[0].attention.self.query.bias.requires_grad_(False)  # a frozen bias of a trainable layer
    table = ParameterTable(model)
    batch = collate(tokenizer)([TextDataset(tokenizer, 6)[i] for i in range(6)])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    seeds = [direction_seed(3, 0, 1, r) for r in range(2)]
    bases = [torch.stack([p.detach() + 0.01 * g * torch.randn_like(p) for g in range(3)]) for p in table.params]
    groups = [[(seeds[0], 1e-2 * (g + 1)), (seeds[1], -0.3)] for g in range(3)]
    with torch.no_grad(), stacked(table, groups, 2, bases=bases, cache={}, per_group_products=True, scratch={}):
        got = model(**inputs).logits
    torch.testing.assert_close(got, _client_by_client(model, table, inputs, groups, bases), rtol=1e-12, atol=1e-12)
    # the same groups sharing their terms: one broadcast sum per linear layer, into the kept scratch
    shared = [groups[0]] * 3
    scratch = {}
    for _ in range(2):  # the second forward reuses the scratch memory
        with torch.no_grad(), stacked(table, shared, 2, bases=bases, cache={}, per_group_products=True,
                                      scratch=scratch):
            again = model(**inputs).logits
    torch.testing.assert_close(again, _client_by_client(model, table, inputs, shared, bases), rtol=1e-12, atol=1e-12)
    assert scratch  # the linear layers' stacked weights were kept
    assert all(torch.equal(a, b) for a, b in zip(ParameterTable(model).params, table.params, strict=True))


class BatchCentred(torch.nn.Module):
    """Mixes examples: subtracts the batch mean of its input (a BatchNorm-like layer without parameters)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 2)

    def forward(self, x, labels=None):
        h = x - x.mean(dim=0, keepdim=True)
        return {"logits": self.linear(h)}


def test_clients_not_stacked_when_the_stacked_forward_differs(tmp_path):
    """A model whose output depends on the other examples of the batch gives other losses when the clients
    are stacked: the check at the first local step refuses it, and the run equals client by client."""
    trainer, got, expected = _auto_and_client_by_client(tmp_path, BatchCentred, rounds=2)
    assert trainer.schedule.stack_clients is False
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)

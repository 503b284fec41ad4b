"""The ledger: every round's seed tuples, aggregated coefficients and learning rate.

It is the protocol's whole downlink: ``replay(model, ledger)`` rebuilds the trained weights
from the starting weights, bitwise, by applying ``w <- w - lr_t * (sum_r R_t[r] z_{t,r} + wd w)``
round after round (with the server's AMSGrad state when it uses one). Dense rounds (first-order,
parameter-space aggregation) are marked and cannot be replayed.

File format (version 3), one JSON object::

    format        "zo_byzantine.ledger"
    version       3
    parameters    [[name, [dim, ...]], ...]       trainable parameters, table order
    weight_decay  {name: wd}                      decayed parameters only
    server        {optimizer, local_lr, betas, eps, v0}
    generator     optional: {name, version, distribution} of the direction generator (``directions.py``);
                  absent in files written before it was recorded, which were all made by ``torch`` version 1
    fingerprint   SHA-256 (hex) of the starting trainable weights (see :func:`weights_fingerprint`), or
                  null when unknown (a run resumed from a version-1 ledger)
    protocol      the protocol settings the rounds were computed with (every setting that changes what a round
                  computes: seed, estimator, mu, directions per step, local steps, clients, Byzantine clients,
                  partition, batch, rule and attack with their parameters; see ``checkpoints.run_protocol``): an
                  object, or null when the driver that wrote the ledger did not give them
    end_fingerprint  SHA-256 (hex) of the trainable weights after the last round, taken when the file was saved
                  (a checkpoint's ledger names the checkpoint's weights), or null when not known
    rounds        [{round, lr[, loss][, participants], seeds, coefficients[, skipped][, dense]}, ...]
                  ``round`` == its index; ``loss``: the round's mean honest loss (a finite number), or null when
                  it was not computed (or not finite); ``participants``: ids (distinct ints >= 0) of the clients
                  whose reports entered the round; ``skipped``: why the round was not applied. ``loss`` and
                  ``participants`` are optional (files written before them still read and replay); when present,
                  they are type-checked and, like every field, covered by the digest.
                  ``history`` (optional, rounds of a stateful rule only, ``history.py``): per uplink, one finite number
                  per participant (the agreements the rule folded into its per-client state), so that a resumed run
                  and a replay rebuild the state bitwise; files of stateless rules have none, as before.
    hmac          optional: HMAC-SHA256 (hex) with a secret key, over the canonical JSON of every other
                  field except ``digest``
    digest        SHA-256 (hex) of the canonical JSON (sorted keys, no spaces, ASCII) of every other field

The file is written indented (one field per line, short lists kept on one line) so that it can be read and
diffed; the layout does not matter to the digest, which is over the canonical form.

Reading is meant for files from an untrusted place: the size is checked before parsing (``max_bytes``,
default :data:`MAX_BYTES` = 1 GiB, more than twice a ledger of 10^5 rounds x 64 directions with 100
participants per round), the nesting depth before parsing (at most :data:`MAX_DEPTH`), NaN/Infinity
literals, duplicate keys, unknown keys and wrong types are refused, and every problem raises
:class:`LedgerError` naming the field (``rounds[3].coefficients[1]: expected a finite number, got ...``).

What the digest protects against: accidental corruption (any bit flip), truncation, and edits by
someone who does not recompute the digest, in the header as in the rounds. What it does not: anyone
can edit the file and recompute a plain SHA-256. Only the HMAC (``save(directory, key=...)``, checked by
``read(path, key=...)`` and ``replay(..., key=...)``) authenticates the file, for whoever holds the key.

The fingerprint ties the ledger to the starting weights: ``replay`` refuses a model whose trainable
weights (values, dtypes, shapes) differ from those the run started from, so a different initialisation
cannot replay "successfully" into wrong weights.

The protocol and the end fingerprint tie a checkpoint's ledger to its run: a resumed run refuses a ledger whose
protocol differs from its own settings (naming each setting) or whose end fingerprint is not that of the
checkpoint's weights (another run's ledger, or another checkpoint's).

Version-2 files (no protocol, no end fingerprint) are still read, replayed and resumed from, with a logged
warning on resume: their settings and their checkpoint's weights cannot be checked. A version-3 file whose protocol or
end fingerprint is null is refused on resume by a run that has them (its settings or weights cannot be checked).
Version-1 files (digest over the rounds only, no fingerprint) are still read, for replay and to resume, with a
logged warning: their header (parameters, weight decay, server) is not protected and their starting weights cannot be
checked. Given a key, they are refused (they carry no HMAC).
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import json
import logging
import math
import os
import re
import socket
import time

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from .directions import DISTRIBUTIONS, GENERATORS, TorchDirections, from_description
from .optim import SERVER_OPTIMIZERS, ZOOptimizer, update_fits
from .perturbation import ParameterTable, direction_seed
from .rounding import ROUNDINGS
from .validation import is_number

logger = logging.getLogger(__name__)

LEDGER_NAME = "zo_ledger.json"
FORMAT = "zo_byzantine.ledger"
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
MAX_BYTES = 1 << 30  # 1 GiB: 10^5 rounds x 64 directions x 100 participants take about 0.4 GB
MAX_DEPTH = 8  # a valid ledger nests 5 deep (object, rounds, round, seeds, seed tuple)
SEED_LIMIT = 1 << 64  # seed tuple entries are in [0, 2^64)
SEED_TUPLE_LENGTHS = (4, 5)  # (s, t, l, r) or (s, t, l, r, client)

HEADER = ("parameters", "weight_decay", "server", "generator")
SERVER_KEYS = ("optimizer", "local_lr", "betas", "eps", "v0")  # and "rounding" when not ROUNDING_DEFAULT
ROUNDING_DEFAULT = ROUNDINGS[0]  # stochastic: what a ledger without "rounding" was written with
_KEYS = {
    1: ({"format", "version", "parameters", "weight_decay", "server", "rounds", "digest"}, set()),
    2: ({"format", "version", "parameters", "weight_decay", "server", "fingerprint", "rounds", "digest"},
        {"hmac", "generator"}),
    3: ({"format", "version", "parameters", "weight_decay", "server", "fingerprint", "protocol", "end_fingerprint",
         "rounds", "digest"}, {"hmac", "generator"}),
}
_ROUND_KEYS = ({"round", "lr", "seeds", "coefficients"}, {"loss", "participants", "skipped", "dense", "history"})
CLIENT_LIMIT = 1 << 63  # client ids are in [0, 2^63)
INDENT = 2  # the file's layout: nested containers indented by 2 spaces, ...
WIDTH = 100  # ... kept on one line when they fit in 100 columns
_HEX64 = re.compile(r"[0-9a-f]{64}")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class LedgerError(ValueError):
    """A ledger file that cannot be trusted or does not match the model."""


class _Constant:
    """A NaN/Infinity literal met while parsing: refused by the schema check, which names its field."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"{self.name} literal"


# ----- schema --------------------------------------------------------------------------------------


def _describe(value) -> str:
    if isinstance(value, _Constant):
        return repr(value)
    kind = {type(None): "null", bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "object"}
    text = repr(value)
    return f"{kind.get(type(value), type(value).__name__)} {text[:40] + '...' if len(text) > 40 else text}"


def _fail(path: str, expected: str, value) -> None:
    raise LedgerError(f"{path}: expected {expected}, got {_describe(value)}")


def _finite(value, path: str, low: float | None = None, high: float | None = None, open_high: bool = False):
    ok = is_number(value)
    if ok:
        try:
            ok = math.isfinite(float(value))
        except OverflowError:
            ok = False
    if ok and low is not None:
        ok = value >= low
    if ok and high is not None:
        ok = value < high if open_high else value <= high
    if not ok:
        bounds = ""
        if low is not None:
            bounds = f" >= {low}" if high is None else f" in [{low}, {high}{')' if open_high else ']'}"
        _fail(path, f"a finite number{bounds}", value)


def _int(value, path: str, low: int = 0, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value >= high):
        _fail(path, f"an int >= {low}" if high is None else f"an int in [{low}, {high})", value)


def _object(value, path: str, keys: tuple[set, set]) -> None:
    required, optional = keys
    if not isinstance(value, dict):
        _fail(path, "an object", value)
    missing = sorted(required - set(value))
    if missing:
        raise LedgerError(f"{path}: missing key(s) {missing}")
    unknown = sorted(set(value) - required - optional, key=str)
    if unknown:
        raise LedgerError(f"{path}: unknown key(s) {unknown}")


def _list(value, path: str) -> None:
    if not isinstance(value, list):
        _fail(path, "a list", value)


def _hex64(value, path: str) -> None:
    if not isinstance(value, str) or not _HEX64.fullmatch(value):
        _fail(path, "64 lower-case hex digits", value)


def _check_round(entry, path: str, index: int) -> None:
    _object(entry, path, _ROUND_KEYS)
    _int(entry["round"], f"{path}.round")
    if entry["round"] != index:
        raise LedgerError(f"{path}.round: expected {index} (rounds are contiguous from 0), got {entry['round']}")
    skipped = entry.get("skipped")
    if "skipped" in entry and (not isinstance(skipped, str) or not skipped):
        _fail(f"{path}.skipped", "a non-empty str", skipped)
    if "dense" in entry and not isinstance(entry["dense"], bool):
        _fail(f"{path}.dense", "a bool", entry["dense"])
    lr = entry["lr"]
    if lr is not None or not (skipped or entry.get("dense")):  # null: only where nothing is applied
        _finite(lr, f"{path}.lr", low=0)
    if "loss" in entry and entry["loss"] is not None:  # null: not computed
        _finite(entry["loss"], f"{path}.loss")
    if "participants" in entry:
        participants = entry["participants"]
        _list(participants, f"{path}.participants")
        for i, client in enumerate(participants):
            _int(client, f"{path}.participants[{i}]", 0, CLIENT_LIMIT)
        if len(set(participants)) != len(participants):
            raise LedgerError(f"{path}.participants: a client is listed twice in {_describe(participants)}")
    if "history" in entry:
        _check_history(entry, path)
    seeds, coefficients = entry["seeds"], entry["coefficients"]
    _list(seeds, f"{path}.seeds")
    for i, key in enumerate(seeds):
        if not isinstance(key, list) or len(key) not in SEED_TUPLE_LENGTHS:
            _fail(f"{path}.seeds[{i}]", f"a list of {' or '.join(map(str, SEED_TUPLE_LENGTHS))} ints", key)
        for j, k in enumerate(key):
            _int(k, f"{path}.seeds[{i}][{j}]", 0, SEED_LIMIT)
    _list(coefficients, f"{path}.coefficients")
    for i, c in enumerate(coefficients):
        _finite(c, f"{path}.coefficients[{i}]")
    if len(coefficients) != len(seeds):
        raise LedgerError(f"{path}: {len(coefficients)} coefficients for {len(seeds)} seed tuples")


def _check_history(entry: dict, path: str) -> None:
    """``history``: a stateful rule's record, one list per uplink of one finite number per participant."""
    history = entry["history"]
    _list(history, f"{path}.history")
    if "participants" not in entry or entry.get("skipped"):
        raise LedgerError(f"{path}.history: recorded only with the participants of an applied round")
    for u, record in enumerate(history):
        _list(record, f"{path}.history[{u}]")
        if len(record) != len(entry["participants"]):
            count = len(entry["participants"])
            raise LedgerError(f"{path}.history[{u}]: {len(record)} numbers for {count} participants")
        for i, value in enumerate(record):
            _finite(value, f"{path}.history[{u}][{i}]")


def check_round(entry, index: int) -> None:
    """Schema of one round entry at position ``index`` (the file's rules: types, finite numbers, ``round == index``,
    as many coefficients as seed tuples); raises :class:`LedgerError` naming the field."""
    _check_round(entry, f"rounds[{index}]", index)


def _check_rounds(rounds, path: str = "rounds") -> None:
    _list(rounds, path)
    for i, entry in enumerate(rounds):
        _check_round(entry, f"{path}[{i}]", i)


def _check_header(data: dict) -> None:
    parameters = data["parameters"]
    _list(parameters, "parameters")
    if not parameters:
        raise LedgerError("parameters: expected at least one trainable parameter, got []")
    names = set()
    for i, item in enumerate(parameters):
        if not isinstance(item, list) or len(item) != 2:
            _fail(f"parameters[{i}]", "a [name, shape] pair", item)
        name, shape = item
        if not isinstance(name, str) or not name:
            _fail(f"parameters[{i}][0]", "a non-empty str", name)
        if name in names:
            raise LedgerError(f"parameters[{i}][0]: duplicate name {name!r}")
        names.add(name)
        _list(shape, f"parameters[{i}][1]")
        for j, dim in enumerate(shape):
            _int(dim, f"parameters[{i}][1][{j}]")
    decay = data["weight_decay"]
    if not isinstance(decay, dict):
        _fail("weight_decay", "an object", decay)
    for name, wd in decay.items():
        if name not in names:
            raise LedgerError(f"weight_decay: {name!r} is not one of the parameters")
        _finite(wd, f"weight_decay[{name!r}]")
    server = data["server"]
    _object(server, "server", (set(SERVER_KEYS), {"rounding"}))
    if server.get("rounding", ROUNDING_DEFAULT) not in ROUNDINGS:
        _fail("server.rounding", f"one of {list(ROUNDINGS)}", server["rounding"])
    if not isinstance(server["optimizer"], str) or server["optimizer"] not in SERVER_OPTIMIZERS:
        _fail("server.optimizer", f"one of {list(SERVER_OPTIMIZERS)}", server["optimizer"])
    _finite(server["local_lr"], "server.local_lr", low=0)
    _finite(server["eps"], "server.eps", low=0)
    if server["eps"] == 0:
        _fail("server.eps", "a finite number > 0", server["eps"])
    _finite(server["v0"], "server.v0", low=0)
    betas = server["betas"]
    if not isinstance(betas, list) or len(betas) != 2:
        _fail("server.betas", "a list of 2 numbers", betas)
    for i, beta in enumerate(betas):
        _finite(beta, f"server.betas[{i}]", low=0, high=1, open_high=True)


def _check_generator(generator) -> None:
    _object(generator, "generator", ({"name", "version", "distribution"}, set()))
    if generator["name"] not in GENERATORS:
        _fail("generator.name", f"one of {list(GENERATORS)}", generator["name"])
    _int(generator["version"], "generator.version")
    if generator["distribution"] not in DISTRIBUTIONS:
        _fail("generator.distribution", f"one of {list(DISTRIBUTIONS)}", generator["distribution"])


def _check_value(value, path: str) -> None:
    """A JSON value of a settings object: null, bool, str, finite number, or a list / object (str keys) of them."""
    if isinstance(value, dict):
        for name, item in value.items():
            _check_value(item, f"{path}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_value(item, f"{path}[{i}]")
    elif is_number(value):
        _finite(value, path)
    elif value is not None and not isinstance(value, bool | str):
        _fail(path, "a JSON value (null, bool, str, finite number, list or object)", value)


def _check_protocol(protocol) -> None:
    if protocol is None:
        return
    if not isinstance(protocol, dict):
        _fail("protocol", "an object or null", protocol)
    _check_value(protocol, "protocol")


def generator_of(data: dict) -> dict:
    """The generator a checked ledger names; files without the field were written with ``torch`` version 1."""
    return data.get("generator") or TorchDirections().describe()


def _check_content(data) -> int:
    """Schema of a whole ledger (not its digest); returns its version."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise LedgerError(f"not a {FORMAT} file")
    version = data.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise LedgerError(f"not a {FORMAT} file of version {' or '.join(map(str, READABLE_VERSIONS))}: "
                          f"version is {_describe(version)}")
    _object(data, "ledger", _KEYS[version])
    _check_header(data)
    if version >= 2:
        if "generator" in data:
            _check_generator(data["generator"])
        if data["fingerprint"] is not None:
            _hex64(data["fingerprint"], "fingerprint")
        if version >= 3:
            _check_protocol(data["protocol"])
            if data["end_fingerprint"] is not None:
                _hex64(data["end_fingerprint"], "end_fingerprint")
        if "hmac" in data:
            _hex64(data["hmac"], "hmac")
    _hex64(data["digest"], "digest")
    _check_rounds(data["rounds"])
    return version


# ----- digests -------------------------------------------------------------------------------------


def _canonical(data: dict, exclude: tuple[str, ...]) -> bytes:
    content = {k: v for k, v in data.items() if k not in exclude}
    return json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _digest(data: dict) -> str:
    """Version 2: SHA-256 of the canonical JSON of every field but ``digest``."""
    return hashlib.sha256(_canonical(data, ("digest",))).hexdigest()


def _digest_v1(rounds: list) -> str:
    return hashlib.sha256(json.dumps(rounds, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _check_key(key) -> bytes:
    if not isinstance(key, bytes | bytearray) or not key:
        raise LedgerError(f"key: expected non-empty bytes, got {type(key).__name__}")
    return bytes(key)


def _hmac(key: bytes, data: dict) -> str:
    return hmac.new(_check_key(key), _canonical(data, ("digest", "hmac")), hashlib.sha256).hexdigest()


def _check(data, source: str, key: bytes | None = None) -> dict:
    """Schema, digest and (with ``key``) HMAC of a parsed ledger; returns it."""
    try:
        version = _check_content(data)
        if version == 1:
            if key is not None:
                raise LedgerError("a version-1 ledger has no HMAC, and a key was given")
            if not hmac.compare_digest(_digest_v1(data["rounds"]), data["digest"]):
                raise LedgerError("fails its digest check: it was modified or corrupted")
            logger.warning(
                "Ledger %s is a version-1 file: its digest covers the rounds only, so its header (parameters, "
                "weight_decay, server) is not protected, and it records no fingerprint of the starting weights.",
                source,
            )
        else:
            if not hmac.compare_digest(_digest(data), data["digest"]):
                raise LedgerError("fails its digest check: it was modified or corrupted")
            if key is not None:
                if "hmac" not in data:
                    raise LedgerError("has no HMAC, and a key was given: it cannot be authenticated")
                if not hmac.compare_digest(_hmac(key, data), data["hmac"]):
                    raise LedgerError("fails its HMAC check: a wrong key, or the file was modified")
    except LedgerError as err:
        raise LedgerError(f"Ledger {source}: {err}") from None
    return data


# ----- parsing -------------------------------------------------------------------------------------


def _unique_keys(pairs: list) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise LedgerError(f"duplicate key {k!r} in an object")
        out[k] = v
    return out


def _nesting_depth(raw: bytes) -> int:
    """Deepest ``[``/``{`` nesting outside strings, without recursion (strings dropped, then brackets kept)."""
    brackets = _STRING.sub(b'""', raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    return int(np.cumsum(np.where((codes == 0x5B) | (codes == 0x7B), 1, -1), dtype=np.int64).max())


def _parse(raw: bytes | str, source: str, max_bytes: int):
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if len(raw) > max_bytes:
        raise LedgerError(f"Ledger {source} is {len(raw)} bytes, over the limit max_bytes={max_bytes}")
    depth = _nesting_depth(raw)
    if depth > MAX_DEPTH:
        raise LedgerError(f"Ledger {source} nests {depth} levels deep, over the limit {MAX_DEPTH} (corrupt?)")
    try:
        text = raw.decode("utf-8")
        return json.loads(text, parse_constant=_Constant, object_pairs_hook=_unique_keys)
    except LedgerError as err:
        raise LedgerError(f"Cannot read ledger {source}: {err} (corrupt or truncated?)") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError, too many digits
        raise LedgerError(f"Cannot read ledger {source}: {err} (corrupt or truncated?)") from None


def _check_max_bytes(max_bytes) -> int:
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
        raise LedgerError(f"max_bytes: expected a positive int, got {max_bytes!r}")
    return max_bytes


# ----- layout --------------------------------------------------------------------------------------


def _inline(value, budget: int) -> str | None:
    """``value`` as one line of JSON (``", "`` and ``": "`` separators), or None when it is over ``budget``
    characters. One ``json.dumps`` call (a ledger's whole text is written at most a few times over: a value by
    value layout in Python took ~1 s for 400 MNIST rounds)."""
    text = _ONE_LINE.encode(value)
    return text if len(text) <= budget else None


_ONE_LINE = json.JSONEncoder(separators=(", ", ": "), allow_nan=False)  # made once (json.dumps with options: per call)


def _flat(value) -> bool:
    """A scalar, or a list of scalars."""
    return not isinstance(value, dict) and (not isinstance(value, list) or not any(
        isinstance(v, dict | list) for v in value))


def _layout(value, indent: int, room: int, lines: list[str], head: str, tail: str) -> None:
    """Append the lines of ``head + value + tail`` at ``indent``: on one line when it fits in ``room``; else a
    list of scalars or of lists of scalars (coefficients, seed tuples, participants) as many items per line as
    fit, other containers one item per line, indented. A scalar (a long ``skipped`` reason) stays on one line."""
    pad = " " * indent
    text = _inline(value, room - indent - len(head) - len(tail))
    if text is None and not isinstance(value, dict | list):
        text = _inline(value, 1 << 62)
    if text is not None:
        lines.append(pad + head + text + tail)
        return
    opening, closing = "{}" if isinstance(value, dict) else "[]"
    lines.append(pad + head + opening)
    inner = " " * (indent + INDENT)
    if isinstance(value, list) and all(_flat(v) for v in value):
        line = ""
        for i, item in enumerate(value):
            text = _inline(item, 1 << 62) + ("," if i + 1 < len(value) else "")
            if line and len(inner) + len(line) + 1 + len(text) > room:
                lines.append(inner + line)
                line = ""
            line = f"{line} {text}" if line else text
        lines.append(inner + line)
        lines.append(pad + closing + tail)
        return
    items = list(value.items()) if isinstance(value, dict) else [(None, v) for v in value]
    for i, (name, item) in enumerate(items):
        _layout(item, indent + INDENT, room, lines, "" if name is None else json.dumps(name) + ": ",
                "," if i + 1 < len(items) else "")
    lines.append(pad + closing + tail)


def dumps(data: dict) -> str:
    """The text of a ledger file: indented JSON, short containers on one line, ASCII, no NaN/Infinity. Parsing it
    gives ``data`` back exactly (floats are written with their shortest round-trip repr)."""
    lines: list[str] = []
    _layout(data, 0, WIDTH, lines, "", "")
    return "\n".join(lines) + "\n"


# ----- the ledger ----------------------------------------------------------------------------------


def weights_fingerprint(model: nn.Module | ParameterTable) -> str:
    """SHA-256 (hex) over the trainable tensors in table order: each one's dtype and shape, then its bytes."""
    table = model if isinstance(model, ParameterTable) else ParameterTable(model)
    digest = hashlib.sha256(b"zo_byzantine.weights/1\n")
    with torch.no_grad():
        for param in table.params:
            tensor = param.detach()
            digest.update(json.dumps([str(tensor.dtype), list(tensor.shape)]).encode() + b"\n")
            data = tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            digest.update(memoryview(data))
    return digest.hexdigest()


def protocol_differences(theirs: dict | None, ours: dict | None) -> list[str]:
    """``protocol.<setting>: the ledger has <value>, this run <value>`` for every setting that differs between two
    protocol objects (the ledger's, this run's); none when either is unknown (null)."""
    if theirs is None or ours is None:
        return []
    return [f"protocol.{name}: the ledger has {_describe(theirs.get(name))}, this run {_describe(ours.get(name))}"
            for name in sorted(set(theirs) | set(ours)) if theirs.get(name) != ours.get(name)]


def refuse_differences(details: list[str], source: str) -> None:
    """Raise :class:`LedgerError` listing ``details`` (settings that differ between ``source`` and this run), if any."""
    if details:
        names = ", ".join(detail.split(":")[0] for detail in details)
        raise LedgerError(f"Cannot continue {source}: its {names} differ from this run's ({'; '.join(details)}). "
                          "Resume with the run's settings, or start a new run (another output_dir).")


UNCHECKED = {  # a version-3 field null in a ledger to continue: what cannot be checked then
    "protocol": "this run's settings cannot be checked against those its rounds were computed with",
    "end_fingerprint": "it cannot be checked against the loaded weights (those it was saved with)",
}


def refuse_unchecked(data: dict, field: str, ours, source: str) -> None:
    """A ledger to continue whose ``field`` (``protocol`` or ``end_fingerprint``) is null while this run has what it
    is checked against (``ours``): refused for a version-3 file (which records it), a logged warning for older files
    (written before it was recorded)."""
    if data.get(field) is not None or ours is None:
        return
    if data["version"] >= 3:
        raise LedgerError(f"Cannot continue {source}: it is a version-{data['version']} ledger whose {field} is null, "
                          f"so {UNCHECKED[field]}. Restore the checkpoint's own {LEDGER_NAME} (or start a new run).")
    logger.warning("%s has no %s (written before version 3): %s.", source.capitalize(), field, UNCHECKED[field])


# a ledger writer's temporary file: ``.zo_ledger.json.<host>.<pid>.tmp`` (``.zo_ledger.json.<pid>.tmp`` before the
# host was named); pids are judged only on their own host, any other file once it is older than STALE_SECONDS
_TEMPORARY = re.compile(r"\." + re.escape(LEDGER_NAME) + r"\.(?:(.+)\.)?(\d+)\.tmp")
STALE_SECONDS = 3600.0  # a ledger (at most MAX_BYTES) is written in seconds: a temporary file this old is dead


def _host() -> str:
    """This machine's name as it appears in a temporary file's name (characters other than ``[A-Za-z0-9_-]``
    replaced by ``_``)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"


def temporary_name(pid: int | None = None) -> str:
    """The name of this process's temporary ledger file."""
    return f".{LEDGER_NAME}.{_host()}.{os.getpid() if pid is None else pid}.tmp"


def _stale(directory: str, name: str, host: str | None, pid: int) -> bool:
    if host == _host():
        return pid != os.getpid() and not _alive(pid)
    try:  # another host's (or an unnamed host's) pid says nothing here: only its age does
        age = time.time() - os.stat(os.path.join(directory, name)).st_mtime
    except FileNotFoundError:
        return False
    return age > STALE_SECONDS


def remove_stale_temporaries(directory: str) -> list[str]:
    """Remove the temporary files that ledger writers left in ``directory`` when they died (killed while writing):
    a file of this host whose process is gone, or any file older than :data:`STALE_SECONDS` (another host's, whose
    pid cannot be checked here); a live process's file is kept. Returns the names removed."""
    removed = []
    for name in os.listdir(directory):
        match = _TEMPORARY.fullmatch(name)
        if match is None or not _stale(directory, name, match.group(1), int(match.group(2))):
            continue
        try:
            os.remove(os.path.join(directory, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process, or no such pid here: keep the file
        pass
    return True


class Ledger:
    """Append-only record of a run's rounds, the fingerprint of its starting weights and its protocol settings.

    Created when the optimizer is (the model holds its starting weights then); a resumed run calls
    :meth:`continue_from` with the checkpoint's ledger, which brings the run's fingerprint and rounds.
    ``protocol``: the settings that change what a round computes (a JSON object), checked on resume.
    """

    def __init__(self, optimizer: ZOOptimizer, rounds: list | None = None, protocol: dict | None = None):
        table = optimizer.table
        self.parameters = [[name, [int(d) for d in p.shape]] for name, p in zip(table.names, table.params, strict=True)]
        self.weight_decay = {table.names[i]: float(wd) for i, wd in sorted(optimizer.weight_decay().items())}
        self.server = {
            "optimizer": optimizer.server,
            "local_lr": float(optimizer.local_lr),
            "betas": [float(b) for b in optimizer.betas],
            "eps": float(optimizer.eps),
            "v0": float(optimizer.v0),
        }
        if optimizer.rounding != ROUNDING_DEFAULT:  # recorded when not the default: earlier ledgers read unchanged
            self.server["rounding"] = optimizer.rounding
        self.generator = table.directions.describe()
        self.fingerprint: str | None = weights_fingerprint(table)
        if protocol is not None:  # JSON values only (it is written), as read back
            protocol = json.loads(json.dumps(protocol, allow_nan=False))
            _check_protocol(protocol)
        self.protocol = protocol
        self.end_fingerprint: str | None = None  # the weights after the last round, set when saved with them
        self._rounds: list[dict] = []
        if rounds:
            self.rounds = rounds

    @property
    def rounds(self) -> list[dict]:
        return self._rounds

    @rounds.setter
    def rounds(self, rounds: list[dict]) -> None:
        """Replace the rounds (checked: contiguous from 0). The fingerprint stays: to resume a run from its
        checkpoint, use :meth:`continue_from`, which also adopts the run's fingerprint."""
        try:
            _check_rounds(rounds)
        except LedgerError as err:
            raise LedgerError(f"Ledger rounds: {err}") from None
        self._rounds = copy.deepcopy(list(rounds))
        self.end_fingerprint = None

    def record(
        self,
        round_index: int,
        seed_tuples,
        coefficients,
        lr: float | None,
        skipped: str | None = None,
        dense: bool = False,
        loss: float | None = None,
        participants=None,
        history=None,
    ):
        """One round: its seed tuples and coefficients ``R``, or why it was skipped, or that it was dense.

        ``loss``: the round's mean honest loss, NaN when it was not computed (written as null; so is any other
        non-finite value); ``participants``: the ids of the clients whose reports entered the round. Either,
        left None, is not recorded; ``history``: a stateful rule's record per uplink (one number per participant),
        from which the rule's state is rebuilt (``Server.restore_history``); absent for stateless rules.

        Rounds are contiguous from 0: ``round_index`` is the next round, or an earlier one, which is then
        recorded again and the rounds after it are dropped (a repeated round replaces its entry)."""
        t = int(round_index)
        if not 0 <= t <= len(self._rounds):
            raise LedgerError(
                f"Ledger: round {t} recorded after {len(self._rounds)} rounds: rounds must be contiguous from 0 "
                "(resume a run with continue_from)."
            )
        entry = {
            "round": t,
            "lr": None if lr is None else float(lr),
        }
        if loss is not None:
            loss = float(loss)
            entry["loss"] = loss if math.isfinite(loss) else None
        if participants is not None:
            entry["participants"] = [int(c) for c in participants]
        entry["seeds"] = [[int(k) for k in s] for s in seed_tuples]
        entry["coefficients"] = [float(c) for c in coefficients]
        if skipped:
            entry["skipped"] = str(skipped)
        if dense:
            entry["dense"] = True  # first-order or parameter-space update: not in the span of the directions
        if history is not None:  # a stateful rule's record (``history.py``): the state is rebuilt from it
            entry["history"] = [[float(a) for a in record] for record in history]
        try:
            _check_round(entry, f"rounds[{t}]", t)
        except LedgerError as err:
            raise LedgerError(f"Ledger.record: {err}") from None
        del self._rounds[t:]
        self._rounds.append(entry)
        self.end_fingerprint = None  # the weights after this round are known when saved

    def append(self, downlink) -> None:
        """The round of a :class:`~zo_byzantine.messages.Downlink`, with its honest loss and participants."""
        self.record(downlink.round, downlink.seed_tuples, downlink.coefficients, downlink.lr,
                    skipped=downlink.skipped, dense=downlink.dense is not None, loss=downlink.loss,
                    participants=downlink.participants, history=downlink.history)

    def continue_from(self, data: dict, key: bytes | None = None, weights: nn.Module | ParameterTable | None = None,
                      source: str = "the ledger") -> None:
        """Resume: adopt the fingerprints and rounds of ``data`` (a ledger as :meth:`read` returns it, checked
        again here, with its HMAC given ``key``), whose header (parameters, weight_decay, server, generator) and
        protocol settings must equal this ledger's. With ``weights`` (the model or table the run continues from),
        their fingerprint must be the ledger's ``end_fingerprint``: a ledger saved with other weights (another
        run's, another checkpoint's) is refused. Raises :class:`LedgerError` naming every field that differs."""
        data = _check(data, "to continue from", key)
        theirs = {**{name: data[name] for name in HEADER if name in data}, "generator": generator_of(data)}
        differ = [name for name in HEADER if theirs[name] != getattr(self, name)]
        details = [f"{name}: the ledger has {_describe(theirs[name])}, this run {_describe(getattr(self, name))}"
                   for name in differ]
        protocol = data.get("protocol")
        refuse_differences(details + protocol_differences(protocol, self.protocol), source)
        refuse_unchecked(data, "protocol", self.protocol, source)
        refuse_unchecked(data, "end_fingerprint", weights, source)
        end = data.get("end_fingerprint")
        loaded = None if weights is None or end is None else weights_fingerprint(weights)
        if loaded is not None and loaded != end:
            raise LedgerError(
                f"Cannot continue {source}: it was saved with other weights than those loaded (its end_fingerprint "
                f"{end[:12]}... is not the loaded weights' {loaded[:12]}...): it belongs to another run or another "
                "checkpoint. Restore the checkpoint's own zo_ledger.json."
            )
        fingerprint = data.get("fingerprint")
        if fingerprint is None:
            logger.warning("The ledger continued records no fingerprint of the starting weights: its replay will not "
                           "check them.")
        self.fingerprint, self.end_fingerprint = fingerprint, end
        if protocol is not None:
            self.protocol = copy.deepcopy(protocol)
        self._rounds = copy.deepcopy(list(data["rounds"]))

    def to_dict(self, key: bytes | None = None) -> dict:
        """The file's content; with ``key``, an HMAC-SHA256 of it too (see the module docstring)."""
        data = {
            "format": FORMAT,
            "version": VERSION,
            "parameters": self.parameters,
            "weight_decay": self.weight_decay,
            "server": self.server,
            "generator": self.generator,
            "fingerprint": self.fingerprint,
            "protocol": self.protocol,
            "end_fingerprint": self.end_fingerprint,
            "rounds": self._rounds,
        }
        if key is not None:
            data["hmac"] = _hmac(key, data)
        data["digest"] = _digest(data)
        return data

    def save(self, directory: str, key: bytes | None = None, weights: nn.Module | ParameterTable | None = None) -> str:
        """Write ``directory/zo_ledger.json`` (atomically: a crash leaves the previous file, and the temporary files
        of writers that died are removed); with ``key``, an HMAC that :meth:`read` checks when given the same key.
        ``weights``: the model (or table) after the last round, whose fingerprint is recorded (``end_fingerprint``)."""
        if weights is not None:
            self.end_fingerprint = weights_fingerprint(weights)
        os.makedirs(directory, exist_ok=True)
        remove_stale_temporaries(directory)
        path = os.path.join(directory, LEDGER_NAME)
        text = dumps(self.to_dict(key))
        tmp = os.path.join(directory, temporary_name())
        try:
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        return path

    @staticmethod
    def loads(raw: bytes | str, key: bytes | None = None, max_bytes: int = MAX_BYTES, source: str = "<bytes>") -> dict:
        """Parse and check a ledger's text (see :meth:`read`)."""
        if key is not None:
            _check_key(key)
        return _check(_parse(raw, source, _check_max_bytes(max_bytes)), source, key)

    @staticmethod
    def read(path: str, key: bytes | None = None, max_bytes: int = MAX_BYTES) -> dict:
        """Load and check a ledger file (or the ledger in a directory): size (at most ``max_bytes``, checked
        before reading), nesting, schema, digest, and with ``key`` its HMAC (a file without one is refused).
        Raises :class:`LedgerError` on any problem."""
        max_bytes = _check_max_bytes(max_bytes)
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, LEDGER_NAME)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > max_bytes:
                    raise LedgerError(f"Ledger {path!r} is {size} bytes, over the limit max_bytes={max_bytes}")
                raw = f.read(max_bytes + 1)
        except OSError as err:
            raise LedgerError(f"Cannot read ledger {path!r}: {err} (corrupt or truncated?)") from err
        return Ledger.loads(raw, key=key, max_bytes=max_bytes, source=repr(path))


def apply_round(optimizer: ZOOptimizer, entry: dict) -> None:
    """Apply one checked ledger round to ``optimizer``'s parameters: ``w <- w - lr (sum_k c_k z_k + wd w)`` (with
    the optimizer's server rule); nothing for a skipped round. The one update path of replay and of a deployment's
    catch-up. Raises :class:`LedgerError` when the update would overflow the weights' dtype (before any write) or
    cannot be applied."""
    if entry.get("skipped"):
        return
    table = optimizer.table
    if not update_fits(table.params, entry["lr"], sum(abs(c) for c in entry["coefficients"])):
        raise LedgerError(f"Round {entry['round']}: its update would overflow the weights' dtype (the "
                          "training server skips such rounds; this ledger was not written by it).")
    try:
        for group in optimizer.param_groups:
            group["lr"] = entry["lr"]
        seeds = [direction_seed(*s) for s in entry["seeds"]]
        optimizer.stage(list(zip(seeds, entry["coefficients"], strict=True)))
        optimizer.step()
    except (ValueError, TypeError, RuntimeError, OverflowError) as err:
        raise LedgerError(f"Round {entry['round']} could not be applied: {err}") from err


def replay(
    model: nn.Module, ledger: dict | str | os.PathLike | Ledger, key: bytes | None = None, max_bytes: int = MAX_BYTES,
    progress: bool = False,
) -> nn.Module:
    """Apply every recorded round to ``model`` (at its starting weights), in place; returns it (``progress``: a
    progress bar of the rounds on stderr).

    ``ledger``: a path (file or directory), a dict (as :meth:`Ledger.read` or :meth:`Ledger.to_dict` returns
    it: checked again) or a :class:`Ledger`. Refused with :class:`LedgerError`, before any weight is written:
    a malformed ledger, a failed digest (or HMAC, given ``key``), a model whose trainable parameters (names,
    shapes) or starting weights (fingerprint) differ from the run's, a dense round."""
    if isinstance(ledger, Ledger):
        data = _check(ledger.to_dict(), "in memory", key)
    elif isinstance(ledger, str | os.PathLike):
        data = Ledger.read(ledger, key=key, max_bytes=max_bytes)
    else:
        data = _check(ledger, "given as a dict", key)
    try:
        directions = from_description(generator_of(data))
    except ValueError as err:
        raise LedgerError(str(err)) from err
    table = ParameterTable(model, directions)
    expected = [[name, list(p.shape)] for name, p in zip(table.names, table.params, strict=True)]
    if expected != data["parameters"]:
        raise LedgerError(
            "The model's trainable parameters (names, shapes) differ from those the ledger was written for."
        )
    fingerprint = data.get("fingerprint")
    if fingerprint is None:
        logger.warning("The ledger records no fingerprint of the starting weights: replay cannot check them.")
    elif weights_fingerprint(table) != fingerprint:
        raise LedgerError(
            "The model's trainable weights differ from the starting weights the ledger was written for (fingerprint "
            "mismatch): load the run's initial weights (same initialisation, dtype and shapes) before replaying."
        )
    dense = [entry["round"] for entry in data["rounds"] if entry.get("dense")]
    if dense:
        raise LedgerError(
            f"Round {dense[0]} applied a dense update (first-order or parameter-space "
            "aggregation), which the ledger cannot replay."
        )
    index = {name: i for i, name in enumerate(table.names)}
    decayed = {index[name]: wd for name, wd in data["weight_decay"].items()}
    groups = [{"params": [p], "weight_decay": decayed.get(j, 0.0)} for j, p in table]
    server = data["server"]
    try:
        optimizer = ZOOptimizer(
            table,
            groups,
            lr=0.0,
            server=server["optimizer"],
            local_lr=server["local_lr"],
            betas=tuple(server["betas"]),
            eps=server["eps"],
            v0=server["v0"],
            rounding=server.get("rounding", ROUNDING_DEFAULT),
        )
    except (ValueError, TypeError) as err:
        raise LedgerError(f"Ledger server settings: {err}") from err
    start = [p.detach().clone() for p in table.params]  # a refused replay leaves the model as it was
    try:
        for entry in tqdm(data["rounds"], desc="replaying", unit="round", disable=not progress):
            apply_round(optimizer, entry)
        if not all(bool(torch.isfinite(p).all()) for p in table.params):
            raise LedgerError("The replayed weights are not finite: the ledger's updates overflow the weights.")
    except LedgerError:
        with torch.no_grad():
            for p, saved in zip(table.params, start, strict=True):
                p.copy_(saved)
        raise
    end = data.get("end_fingerprint")
    if end is not None and weights_fingerprint(table) != end:
        logger.warning("The replayed weights differ from those the ledger was saved with (end_fingerprint): replay on "
                       "the device type the run trained on (torch-generator runs), or check the ledger's origin.")
    return model

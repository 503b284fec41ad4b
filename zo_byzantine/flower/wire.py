"""The protocol's messages as Flower records, and back (SPEC 8): what crosses the network, and its strict parsing.

    server -> node   RecordDict({"plan": ConfigRecord})      the plan of round t, the ledger entries the node lacks
                                                             (catch-up: no weights), fingerprints of the start weights
                                                             and of the weights at round t
    node -> server   RecordDict({"report": MetricRecord})    round, client, applied, K x nu scalars (float64),
                                                             honest loss, example count; or, from a node that cannot
                                                             catch up, round, client, applied only (a catch-up request)

Every record from the other side is parsed strictly (:class:`WireError` names the field): exact key set, exact
types (``bool`` is not an int, an int is not a float), lengths checked before anything is built from a list, ints
in range. A Byzantine node controls every byte of its reply; this module is where that stops. Text it chose (key
names, an error reply's reason) reaches the server's logs only through :func:`clip`: escaped, at most
``REASON_LIMIT`` characters.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from ..ledger import LedgerError, check_round
from ..messages import LOCAL_UPDATES, Plan, Report

PLAN = "plan"
REPORT = "report"
REASON_LIMIT = 240  # characters of a problem's reason (logs, flower_rounds.jsonl); a node's text is cut to it
NAMES_SHOWN = 4  # key names quoted in an error about a record's keys
INT_LIMIT = 1 << 63  # ids, rounds and seed-tuple entries on the wire are in [0, 2^63)
SEED_TUPLE = 4  # a plan's seed tuples are (s, t, l, r)
REPORT_KEYS = frozenset({"round", "client", "applied", "scalars", "loss", "num_examples"})
CATCH_UP_KEYS = frozenset({"round", "client", "applied"})
_PLAN_KEYS = frozenset({
    "round", "participants", "seeds", "per_client", "estimator", "mu", "nu", "K", "local_lr", "local_update",
    "generator_name", "generator_version", "generator_distribution", "start", "weights",
    "since", "lr", "skipped", "terms", "widths", "entry_seeds", "coefficients",
})


class WireError(ValueError):
    """A record that does not follow the wire format; the message names the field."""


def clip(text, limit: int = REASON_LIMIT) -> str:
    """``text`` for a log line: non-printable characters escaped, at most ``limit`` characters (the rest counted)."""
    text = str(text)
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    if len(shown) <= limit and len(text) <= limit:
        return shown
    tail = f"... ({len(text)} characters)"
    return shown[: max(limit - len(tail), 0)] + tail


def _names(keys) -> str:
    """At most ``NAMES_SHOWN`` key names (each clipped), and how many there are."""
    keys = [str(k) for k in keys]
    shown = [clip(k, 40) for k in heapq.nsmallest(NAMES_SHOWN, keys)]
    more = len(keys) - len(shown)
    return f"{shown}{f' and {more} more' if more else ''}"


@dataclass(frozen=True)
class Reply:
    """A parsed reply: the node's client id, the round it answers, the rounds it has applied, and its report, or
    ``None`` for a catch-up request (the plan's ledger entries started after the rounds it has applied)."""

    round: int
    client: int
    applied: int
    report: Report | None


@dataclass(frozen=True)
class PlanMessage:
    """A parsed plan message: the plan, the ledger entries ``since, since + 1, ...`` (checked dicts, as the ledger
    stores them), the fingerprints of the start weights and of the weights at the plan's round."""

    plan: Plan
    since: int
    entries: list[dict]
    start: str
    weights: str


# ----- strict field readers ------------------------------------------------------------------------------------


def _get(record, key: str, kind: type, where: str):
    value = record[key]
    if type(value) is not kind:
        raise WireError(f"{where}.{key}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _int(record, key: str, where: str, low: int = 0, high: int = INT_LIMIT) -> int:
    value = _get(record, key, int, where)
    if not low <= value < high:
        raise WireError(f"{where}.{key}: expected an int in [{low}, {high}), got {value}")
    return value


def _list(record, key: str, kind: type, where: str, length: int | None = None) -> list:
    """A list of ``kind`` (an empty list is untyped on the wire), of exactly ``length`` items if given; the length
    is checked before any item is read."""
    value = record[key]
    if not isinstance(value, list):
        raise WireError(f"{where}.{key}: expected a list of {kind.__name__}, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise WireError(f"{where}.{key}: expected {length} values, got {len(value)}")
    if any(type(v) is not kind for v in value):
        raise WireError(f"{where}.{key}: expected a list of {kind.__name__}")
    if kind is int and any(not 0 <= v < INT_LIMIT for v in value):
        raise WireError(f"{where}.{key}: expected ints in [0, {INT_LIMIT})")
    return value


def _keys(record, expected: frozenset, where: str) -> None:
    keys = set(record.keys())
    if keys != expected:
        raise WireError(f"{where}: missing key(s) {_names(expected - keys)}, unknown key(s) {_names(keys - expected)}")


def _only(content, name: str, kind: type, where: str):
    """The one record ``name`` of ``content``, of type ``kind``; nothing else may be there."""
    if not isinstance(content, RecordDict):
        raise WireError(f"{where}: expected a RecordDict, got {type(content).__name__}")
    if set(content.keys()) != {name}:
        raise WireError(f"{where}: expected exactly one record {name!r}, got {_names(content.keys())}")
    record = content[name]
    if not isinstance(record, kind):
        raise WireError(f"{where}.{name}: expected a {kind.__name__}, got {type(record).__name__}")
    return record


# ----- plan: server -> node ------------------------------------------------------------------------------------


def plan_content(plan: Plan, since: int, entries: list[dict], start: str, weights: str) -> RecordDict:
    """The message of ``plan`` to a node that has applied rounds ``0..since-1``: ``entries`` are the ledger's
    rounds ``since..plan.round-1``, or the first of them (a node far behind catches up over several plans). Seed
    tuples are flattened (``K + 1`` steps x ``nu`` x 4); each entry's seed tuples are flattened with their count
    (``terms``) and width (4, or 5 with per-client directions)."""
    seeds = [int(k) for step in plan.seed_tuples for key in step for k in key]
    record = ConfigRecord({
        "round": plan.round,
        "participants": [int(c) for c in plan.participants],
        "seeds": seeds,
        "per_client": bool(plan.per_client),
        "estimator": plan.estimator,
        "mu": float(plan.mu),
        "nu": int(plan.num_perturbations),
        "K": int(plan.local_steps),
        "local_lr": float(plan.local_lr),
        "local_update": plan.local_update,
        "generator_name": plan.generator[0],
        "generator_version": int(plan.generator[1]),
        "generator_distribution": plan.generator[2],
        "start": start,
        "weights": weights,
        "since": int(since),
        "lr": [float(e["lr"]) if e["lr"] is not None else 0.0 for e in entries],
        "skipped": [bool(e.get("skipped")) for e in entries],
        "terms": [len(e["seeds"]) for e in entries],
        "widths": [len(e["seeds"][0]) if e["seeds"] else SEED_TUPLE for e in entries],
        "entry_seeds": [int(k) for e in entries for key in e["seeds"] for k in key],
        "coefficients": [float(c) for e in entries for c in e["coefficients"]],
    })
    return RecordDict({PLAN: record})


def read_plan(content) -> PlanMessage:
    """Parse a plan message (:func:`plan_content`); raises :class:`WireError` naming the field."""
    where = PLAN
    record = _only(content, PLAN, ConfigRecord, "plan message")
    _keys(record, _PLAN_KEYS, where)
    t = _int(record, "round", where)
    nu, steps = _int(record, "nu", where, 1), _int(record, "K", where, 1)
    participants = _list(record, "participants", int, where)
    if len(set(participants)) != len(participants):
        raise WireError(f"{where}.participants: a client is listed twice")
    flat = _list(record, "seeds", int, where, length=(steps + 1) * nu * SEED_TUPLE)
    keys = [tuple(flat[i : i + SEED_TUPLE]) for i in range(0, len(flat), SEED_TUPLE)]
    local_update = _get(record, "local_update", str, where)
    if local_update not in LOCAL_UPDATES:
        raise WireError(f"{where}.local_update: expected one of {list(LOCAL_UPDATES)}, got {local_update!r}")
    plan = Plan(
        round=t,
        participants=tuple(participants),
        seed_tuples=tuple(tuple(keys[s * nu : (s + 1) * nu]) for s in range(steps + 1)),
        per_client=_get(record, "per_client", bool, where),
        estimator=_get(record, "estimator", str, where),
        mu=_get(record, "mu", float, where),
        num_perturbations=nu,
        local_steps=steps,
        local_lr=_get(record, "local_lr", float, where),
        local_update=local_update,
        generator=(_get(record, "generator_name", str, where), _int(record, "generator_version", where),
                   _get(record, "generator_distribution", str, where)),
    )
    since = _int(record, "since", where, 0, t + 1)
    lrs = _list(record, "lr", float, where)
    count = len(lrs)  # t - since, or fewer: the server's bound on the rounds one plan carries (catch-up-limit)
    if count > t - since:
        raise WireError(f"{where}.lr: {count} ledger entries from round {since} pass the plan's round {t}")
    skipped = _list(record, "skipped", bool, where, length=count)
    terms = _list(record, "terms", int, where, length=count)
    widths = _list(record, "widths", int, where, length=count)
    if any(w not in (SEED_TUPLE, SEED_TUPLE + 1) for w in widths):
        raise WireError(f"{where}.widths: expected 4 or 5 per entry")
    total = sum(k * w for k, w in zip(terms, widths, strict=True))
    entry_seeds = _list(record, "entry_seeds", int, where, length=total)
    coefficients = _list(record, "coefficients", float, where, length=sum(terms))
    entries, at, position = [], 0, 0
    for i in range(count):
        k, w = terms[i], widths[i]
        seeds = [entry_seeds[at + j * w : at + (j + 1) * w] for j in range(k)]
        entry = {"round": since + i, "lr": lrs[i], "seeds": seeds,
                 "coefficients": coefficients[position : position + k]}
        if skipped[i]:
            entry["skipped"] = "skipped by the server"
        try:
            check_round(entry, since + i)
        except LedgerError as err:
            raise WireError(f"{where}: ledger entry {since + i}: {err}") from None
        entries.append(entry)
        at, position = at + k * w, position + k
    fingerprints = [_get(record, name, str, where) for name in ("start", "weights")]
    return PlanMessage(plan, since, entries, *fingerprints)


# ----- report: node -> server ----------------------------------------------------------------------------------


def report_content(report: Report, applied: int) -> RecordDict:
    """A node's report as a ``MetricRecord``: ``scalars`` flattened (uplinks x width, float64)."""
    return RecordDict({REPORT: MetricRecord({
        "round": int(report.round),
        "client": int(report.client),
        "applied": int(applied),
        "scalars": [float(v) for v in report.scalars.double().flatten().tolist()],
        "loss": float(report.loss),
        "num_examples": int(report.num_examples),
    })})


def catch_up_content(round_index: int, client: int, applied: int) -> RecordDict:
    """A node's request for the ledger entries from ``applied`` on (it could not apply the plan's)."""
    return RecordDict({REPORT: MetricRecord({"round": int(round_index), "client": int(client),
                                             "applied": int(applied)})})


def read_reply(content, shape: tuple[int, int], round_index: int) -> Reply:
    """Parse a node's reply to round ``round_index``'s plan; ``shape``: (uplinks, width) of its scalars. The
    values are only typed and sized here; the coordinator checks round, client and example count against the plan
    the reply answers, and the server role sanitises non-finite values. Raises :class:`WireError` naming the
    field."""
    where = REPORT
    record = _only(content, REPORT, MetricRecord, "reply")
    catch_up = set(record.keys()) == CATCH_UP_KEYS
    if not catch_up:
        _keys(record, REPORT_KEYS, where)
    t, client = _int(record, "round", where), _int(record, "client", where)
    applied = _int(record, "applied", where, 0, round_index + 1)
    if catch_up:
        return Reply(t, client, applied, None)
    scalars = _list(record, "scalars", float, where, length=shape[0] * shape[1])
    loss = _get(record, "loss", float, where)
    num_examples = _int(record, "num_examples", where, 1)
    report = Report(t, client, torch.tensor(scalars, dtype=torch.float64).view(shape), loss, num_examples)
    return Reply(t, client, applied, report)

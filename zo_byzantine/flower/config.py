"""A deployment's configuration: the run config (one per run, the same on the server and every node) and a node's
own config, checked before any work, with errors that name the key and what is accepted.

Run config (``[tool.flwr.app.config]`` or ``flwr run --run-config``):

    task              "module:function", ``function(run_config) -> Task``: the model at its start weights and the
                      shared training set (see :class:`Task`); imported on the server and on every node
    rounds            rounds to run (>= 1)
    round-timeout     seconds the server waits for a round's replies (the deadline)
    min-nodes         registered nodes the server waits for before round 0 (default: num_clients)
    startup-timeout   seconds it waits for them (then it starts with those registered)
    output-dir        where the server writes ``zo_ledger.json`` and ``flower_rounds.jsonl`` ("" : nowhere)
    eval-every        evaluate the server's replica on the task's eval set every k rounds (0: never)
    catch-up-limit    ledger rounds one plan carries at most (64): a node further behind catches up over rounds
    client-keys       "" (default: a client id is held by the first connected node that claims it), or the path, on
                      the server, of a file binding SuperNode public keys to client ids (:func:`read_client_keys`;
                      meaningful with ``flower-superlink --enable-supernode-auth``, where a key is authenticated)
    task-*            the task's own settings (model folder, data file, ...), read by ``task`` only
    every other key   a :class:`~zo_byzantine.ZOByzantineArguments` field (num_clients, per_device_train_batch_size,
                      clients_per_round, num_byzantine, aggregator, pre_aggregators (separated by ';'), zo_eps,
                      num_perturbations, local_steps, learning_rate, zo_seed, partition, ...), checked by it

Node config (``flower-supernode --node-config``): ``partition-id`` (this node's client id), ``num-partitions``
(must equal num_clients), optional ``attack`` (:data:`NODE_ATTACKS`, ``name:key=value,...``), optional
``store-dir`` (the folder of the node's store, ``store.NodeStore``; "": ``~/.cache/zo_byzantine/flower``).

A node checks the run config with ``ZOByzantineArguments`` (which imports transformers' ``TrainingArguments``:
seconds) at its first message of a run only, and keeps the settings it uses in its store (:func:`node_deployment`):
its later messages, each a fresh ClientApp process, read them back.

Not in a deployment (refused here): dense updates (``estimator='first_order'``, ``aggregation_space='parameter'``:
d floats each way), ``server_optimizer='amsgrad'`` and ``weight_decay`` (the nodes replay the plain update), learning
rate schedules (constant ``learning_rate``), and server-side attacks: omniscient ones (ALIE, FOE, TMA, ...) need
every honest vector and stay in the simulation; a node mounts what it can alone (node config ``attack``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from ..aggregators import parse_step
from ..attacks import Attack, build_attack
from ..trusted import trusted_clients
from ..validation import check_choice, check_integer, check_real

if TYPE_CHECKING:
    from ..arguments import ZOByzantineArguments
    from .store import NodeStore

DEPLOYMENT_KEYS = {
    "task": str, "rounds": int, "round-timeout": float, "min-nodes": int, "startup-timeout": float,
    "output-dir": str, "eval-every": int, "catch-up-limit": int, "client-keys": str,
}
TASK_PREFIX = "task-"  # keys the task reads (model, data); not checked here
NODE_ATTACKS = ("none", "sf", "gaussian", "nonfinite", "lf")  # what one node can mount from its own vector and data
# the ZOByzantineArguments fields a node reads (partition, sampling, batch, directions, update, schedule): what
# node_deployment keeps in the node's store
NODE_SETTINGS = (
    "num_clients", "clients_per_round", "num_byzantine", "byzantine_selection", "partition", "dirichlet_alpha",
    "min_client_examples", "per_device_train_batch_size", "zo_seed", "zo_generator", "zo_distribution",
    "learning_rate", "local_learning_rate", "zo_schedule", "zo_cache_budget_gb", "zo_forward_batch_size",
    "zo_group_by_length", "zo_direction_batch_size", "update_rounding", "aggregator", "aggregator_kwargs",
    "root_examples",
)
SETTINGS_FORMAT = 3  # of the kept settings: a change makes every node check its run config again


@dataclass
class Task:
    """What ``task`` builds, identically on the server and on every node: ``model`` at its start weights (the ledger
    fingerprints them), ``train_dataset`` (every node partitions the same set and keeps its own part),
    ``data_collator`` (``None``: ``transformers.default_data_collator``), optional ``eval_dataset``."""

    model: torch.nn.Module
    train_dataset: object
    data_collator: object = None
    eval_dataset: object = None


@dataclass(frozen=True)
class Deployment:
    """The checked run config: the protocol's arguments and the deployment's own settings."""

    args: ZOByzantineArguments
    task: str
    rounds: int
    round_timeout: float
    min_nodes: int
    startup_timeout: float
    output_dir: str
    eval_every: int = 0
    catch_up_limit: int = 64
    client_keys: str = ""


def _value(config: dict, key: str, kind: type, default):
    value = config.get(key, default)
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind:
        raise ValueError(f"run config {key!r}: expected {kind.__name__}, got {value!r}.")
    return value


def read_run_config(config: dict, output_dir: str = "/tmp/zo_byzantine_flower") -> Deployment:
    """Check a Flower run config (see the module docstring); ``output_dir`` is the Trainer arguments' scratch
    folder (nothing is written there). Raises ``ValueError`` naming the key."""
    from ..arguments import ZOByzantineArguments  # transformers' TrainingArguments: only where a config is checked

    config = dict(config)
    fields = {f.name for f in dataclasses.fields(ZOByzantineArguments)}
    known = set(DEPLOYMENT_KEYS) | fields
    unknown = sorted(k for k in config if k not in known and not k.startswith(TASK_PREFIX))
    if unknown:
        raise ValueError(f"run config: unknown key(s) {unknown}; accepted: {sorted(DEPLOYMENT_KEYS)}, "
                         f"ZOByzantineArguments fields (num_clients, aggregator, zo_eps, ...) and {TASK_PREFIX}* keys "
                         "(the task's own).")
    if "task" not in config:
        raise ValueError("run config 'task': missing; expected 'module:function' returning a zo_byzantine.flower.Task.")
    task = _value(config, "task", str, "")
    rounds = check_integer("run config 'rounds'", _value(config, "rounds", int, 1), 1)
    timeout = check_real("run config 'round-timeout'", _value(config, "round-timeout", float, 600.0), 0.0,
                         low_open=True)
    startup = check_real("run config 'startup-timeout'", _value(config, "startup-timeout", float, 600.0), 0.0)
    out = _value(config, "output-dir", str, "")
    zo = {k: v for k, v in config.items() if k in fields}
    if isinstance(zo.get("pre_aggregators"), str):
        zo["pre_aggregators"] = [s.strip() for s in zo["pre_aggregators"].split(";") if s.strip()]
    if zo.get("estimator") == "first_order":
        raise ValueError("run config 'estimator'='first_order' sends d floats each way: not in a deployment; "
                         "accepted: the zeroth-order estimators (two_point, ...).")
    refused = {"aggregation_space": "projection", "server_optimizer": "sgd", "lr_scheduler_type": "constant",
               "attack": "none", "weight_decay": 0.0}
    for key, accepted in refused.items():
        if key in zo and zo[key] != accepted:
            reason = ("attacks are mounted by nodes (node config 'attack'); omniscient ones stay in the simulation"
                      if key == "attack" else "the nodes replay the plain constant-rate update")
            raise ValueError(f"run config {key!r}={zo[key]!r} is not supported in a Flower deployment ({reason}); "
                             f"accepted: {accepted!r}.")
    zo.setdefault("lr_scheduler_type", "constant")
    zo.setdefault("report_to", [])
    args = ZOByzantineArguments(output_dir=output_dir, max_steps=rounds, **zo)
    min_nodes = check_integer("run config 'min-nodes'", _value(config, "min-nodes", int, args.num_clients), 0,
                              args.num_clients)
    eval_every = check_integer("run config 'eval-every'", _value(config, "eval-every", int, 0), 0)
    catch_up = check_integer("run config 'catch-up-limit'", _value(config, "catch-up-limit", int, 64), 1)
    keys = _value(config, "client-keys", str, "")
    trusted = trusted_clients(args.aggregator, args.aggregator_kwargs)
    if trusted and not keys:
        raise ValueError(f"run config 'aggregator'={args.aggregator!r} trusts clients {list(trusted)}, but "
                         "'client-keys' is empty: the first node to claim a trusted id would hold it, a Byzantine one "
                         "included. Accepted: 'client-keys' naming the file that binds SuperNode public keys to client "
                         "ids.")
    return Deployment(args, task, rounds, timeout, min_nodes, startup, out, eval_every, catch_up, keys)


def config_digest(config: dict) -> str:
    """SHA-256 of a run config (keys sorted) with the library's version and :data:`SETTINGS_FORMAT`."""
    from .. import __version__

    text = json.dumps({"config": dict(config), "version": __version__, "format": SETTINGS_FORMAT}, sort_keys=True,
                      default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def node_deployment(config: dict, store: NodeStore) -> Deployment:
    """The checked run config as a node uses it: :func:`read_run_config` at the node's first message of the run
    (same checks, same errors), its :data:`NODE_SETTINGS` kept in ``store``; later messages read them back (same
    digest of the run config) without importing transformers. ``args`` is then a namespace of those fields."""
    from .store import SETTINGS_FILE

    digest = config_digest(config)
    kept = store.read_json(SETTINGS_FILE)
    if kept is None or kept.get("digest") != digest:
        deployment = read_run_config(config)
        kept = {"digest": digest, "args": {name: getattr(deployment.args, name) for name in NODE_SETTINGS},
                "deployment": {f.name: getattr(deployment, f.name) for f in dataclasses.fields(Deployment)
                               if f.name != "args"}}
        store.write_json(SETTINGS_FILE, kept)
    return Deployment(SimpleNamespace(**kept["args"]), **kept["deployment"])


def build_task(deployment: Deployment, config: dict) -> Task:
    """Import and call the run config's ``task`` (``module:function``) with the run config."""
    module, sep, name = deployment.task.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"run config 'task'={deployment.task!r}: expected 'module:function'.")
    task = getattr(importlib.import_module(module), name)(dict(config))
    if not isinstance(task, Task):
        raise TypeError(f"run config 'task'={deployment.task!r} returned {type(task).__name__}, not a "
                        "zo_byzantine.flower.Task.")
    return task


@dataclass(frozen=True)
class Node:
    """A node's checked config: its client id and the attack it mounts (``none`` for an honest node)."""

    client: int
    attack: Attack
    attack_name: str


def read_node_config(config: dict, num_clients: int) -> Node:
    """Check a SuperNode's node config against the run's ``num_clients``. Raises ``ValueError`` naming the key."""
    for key in ("partition-id", "num-partitions"):
        if type(config.get(key)) is not int:
            raise ValueError(f"node config {key!r}: expected an int, got {config.get(key)!r}.")
    if config["num-partitions"] != num_clients:
        raise ValueError(f"node config 'num-partitions'={config['num-partitions']}: must equal the run's "
                         f"num_clients={num_clients}.")
    client = check_integer("node config 'partition-id'", config["partition-id"], 0, num_clients - 1)
    spec = config.get("attack", "none")
    if not isinstance(spec, str):
        raise ValueError(f"node config 'attack': expected a string, got {spec!r}.")
    name, kwargs = parse_step(spec)
    check_choice("node config 'attack'", name, NODE_ATTACKS)
    return Node(client, build_attack(name, **kwargs), name)


def public_key_id(key: bytes) -> bytes | None:
    """A SuperNode public key as the SuperLink reports it (``NodeInfo.public_key``: PEM), or OpenSSH text, as DER
    (SubjectPublicKeyInfo) bytes: the form keys are compared in; ``None`` if it is neither."""
    from cryptography.hazmat.primitives import serialization

    loaders = (serialization.load_pem_public_key, serialization.load_ssh_public_key)
    for load in loaders:
        try:
            return load(bytes(key)).public_bytes(serialization.Encoding.DER,
                                                 serialization.PublicFormat.SubjectPublicKeyInfo)
        except (ValueError, TypeError, AttributeError):
            continue
    return None


def read_client_keys(path: str, num_clients: int) -> dict[bytes, int]:
    """The run config's ``client-keys`` file: one line per client, ``<client id> <OpenSSH public key>`` (the
    ``.pub`` file a SuperNode's ``--auth-supernode-private-key`` belongs to, as registered with ``flwr supernode
    register``); blank lines and ``#`` comments are skipped. Returns key (DER) -> client id. Raises ``ValueError``
    naming the file and line (a client or a key listed twice, a malformed key, an id out of range)."""
    keys: dict[bytes, int] = {}
    with open(path) as f:
        lines = f.read().splitlines()
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"run config 'client-keys' file {path!r}, line {number}"
        client, _, text = line.partition(" ")
        if not client.isdigit() or not 0 <= int(client) < num_clients:
            raise ValueError(f"{where}: expected '<client id in [0, {num_clients})> <OpenSSH public key>'.")
        key = public_key_id(text.strip().encode())
        if key is None:
            raise ValueError(f"{where}: not an OpenSSH public key.")
        if key in keys or int(client) in keys.values():
            raise ValueError(f"{where}: a key or a client id is listed twice (one SuperNode per client).")
        keys[key] = int(client)
    return keys

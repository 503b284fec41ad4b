"""The client role on one node (SPEC 8): plan message -> catch-up -> report.

    answer(content, state, deployment, task, node, store, replica) -> reply content
        parse the plan (strict)                     refuse: not sampled, another generator, other start weights
        apply the ledger entries it lacks           (Replica: the library's update path; no weights on the wire)
          entries start after what it has applied -> a catch-up request (round, client, applied)
          entries end before round t (catch-up-limit) -> apply them, then a catch-up request
        its weights' fingerprint == the server's    else refuse and start over from the start weights
        its batch of round t                        (Federation: the simulation's partition, computed once per node
                                                     and kept in its store, and data stream)
        client_reports(plan, one-client evaluator)  (the simulation's client role, ids = [c]; the schedule's
                                                     checks made at its first plan, kept in the node state)
        node attack, if configured                  (an Attack given only this node's vector: honest = own)

The replica's weights between plans: the node's store (a safetensors file), ``applied`` in ``Context.state``; a
process that runs many plans (``resident``) keeps the replica in memory and reads nothing back.
A refusal raises :class:`PlanRefused`; Flower returns it to the server as an error reply.
"""

from __future__ import annotations

import contextlib
import json
import time

import torch
from flwr.app import ConfigRecord, RecordDict

from ..attacks import flip_labels, model_num_labels
from ..batched_clients import BatchedClients
from ..checks import build_federation, check_label_flipping
from ..chunks import forward_chunks
from ..client import client_reports
from ..context import RoundContext
from ..federation import Federation
from ..losses import PerExampleForward
from ..schedule import Schedule
from .config import Deployment, Node, Task
from .replica import Replica
from .store import NodeStore
from .wire import catch_up_content, read_plan, report_content

SCHEDULE = "zo_schedule"  # the node state's record of its schedule's decisions (checked once per run)


class PlanRefused(RuntimeError):
    """A plan this node will not answer; the reason goes back to the server."""


def local_attack(node: Node, vectors: torch.Tensor, zo_seed: int, round_index: int) -> torch.Tensor:
    """What a Byzantine node sends instead of its ``vectors`` (uplinks x nu): per uplink ``u`` the node's attack
    with only its own vector known (``honest = own``), context key ``(s, t, u + 1)`` as in the simulation (so a
    seeded attack draws the simulation's numbers for one Byzantine client)."""
    if node.attack_name in ("none", "lf"):  # lf poisons the labels instead
        return vectors
    rows = []
    for u in range(len(vectors)):
        own = vectors[u : u + 1]
        rows.append(node.attack(own, own, None, RoundContext((zo_seed, round_index, u + 1), 1, 0)).vectors[0])
    return torch.stack(rows).to(vectors)


def node_federation(args, dataset, store: NodeStore) -> Federation:
    """The run's ``Federation`` (``checks.build_federation``), its partition computed at the node's first plan and
    read back from ``store`` at later ones (the same settings and the same number of examples)."""
    key = json.dumps([len(dataset), args.partition, args.num_clients, args.zo_seed, args.dirichlet_alpha,
                      args.min_client_examples, args.root_examples, args.aggregator, args.aggregator_kwargs])
    built = []

    def build() -> list:
        built.append(build_federation(args, dataset))
        return built[0].partitions

    parts = store.partitions(key, build)
    if built:
        return built[0]
    return Federation(parts, args.per_device_train_batch_size, args.num_byzantine, args.zo_seed,
                      args.clients_per_round, args.byzantine_selection)


def round_batch(deployment: Deployment, task: Task, client: int, round_index: int,
                store: NodeStore) -> tuple[dict, int]:
    """Client ``client``'s examples of round ``t`` (the simulation's stream: same partition, same order), collated,
    and its partition size."""
    args = deployment.args
    federation = node_federation(args, task.train_dataset, store)
    participants = [int(c) for c in federation.participants(round_index)]
    if client not in participants:
        raise PlanRefused(f"client {client} is not a participant of round {round_index} under this run's sampling.")
    position = participants.index(client)
    indices = federation.round_indices(round_index, slice(position, position + 1))
    if task.data_collator is None:  # the Trainer's default: transformers' data collator (not its Trainer)
        from transformers import default_data_collator
    collator = task.data_collator or default_data_collator
    return collator([task.train_dataset[i] for i in indices]), len(federation.partitions[client])


def answer(content, state: RecordDict, deployment: Deployment, task: Task, node: Node, store: NodeStore,
           replica: Replica, marks: dict | None = None) -> RecordDict:
    """This node's reply to a plan message (see the module docstring); ``state``: the node's ``Context.state``;
    ``store``: its store; ``replica``: ``Replica(task.model, deployment.args)``, new or kept from this process's
    earlier plans while ``replica.in_sync``; ``marks``, if given, gets the wall-clock times (``time.time()``) of
    the steps done (``caught_up``, ``computed``)."""
    message = read_plan(content)
    plan, t = message.plan, message.plan.round
    check_label_flipping(node.attack, task.model, task.train_dataset)
    if node.client not in plan.participants:
        raise PlanRefused(f"client {node.client} was not sampled in round {t}.")
    if tuple(plan.generator) != replica.table.directions.identity():
        raise PlanRefused(f"the plan's directions come from generator {plan.generator}; this node draws "
                          f"{replica.table.directions.identity()} and cannot reproduce them.")
    if message.start != replica.start:
        raise PlanRefused("this node's start weights differ from the run's (fingerprint mismatch): check the task.")
    replica.load(state, store)
    if message.since > replica.applied or replica.applied > t:
        if replica.applied > t:
            replica.reset(state, store)
            replica.applied = 0
        return catch_up_content(t, node.client, replica.applied)
    replica.apply(message.entries[replica.applied - message.since :])
    if replica.applied < t:  # the plan carried the first of the rounds it lacks (the server's catch-up-limit)
        replica.save(state, store)
        return catch_up_content(t, node.client, replica.applied)
    if replica.fingerprint() != message.weights:
        replica.reset(state, store)
        raise PlanRefused(f"after round {t - 1} this node's weights differ from the server's; it starts over from "
                          "the start weights at its next plan.")
    replica.save(state, store)
    if marks is not None:
        marks["caught_up"] = time.time()
    inputs, size = round_batch(deployment, task, node.client, t, store)
    if node.attack.flips_labels:
        rows = torch.ones(len(inputs["labels"]), dtype=torch.bool)
        inputs = flip_labels(inputs, rows, node.attack.num_classes or model_num_labels(task.model))
    args = deployment.args
    decided = state.get(SCHEDULE)  # what this node's checks decided at an earlier plan of the run
    schedule = Schedule.restored(args.zo_schedule, args.zo_cache_budget_gb,
                                 dict(decided) if isinstance(decided, ConfigRecord) else None)
    chunks = forward_chunks(args.per_device_train_batch_size, args.zo_forward_batch_size,
                            args.per_device_train_batch_size, args.zo_group_by_length)
    cache = {} if schedule.resolve(replica.table, plan.num_directions(1), chunks) == "cached" else None
    task.model.eval()
    clients = BatchedClients(task.model, replica.table, inputs, 1, args.per_device_train_batch_size,
                             PerExampleForward(), schedule, args.zo_forward_batch_size, contextlib.nullcontext, cache,
                             args.zo_direction_batch_size, args.zo_group_by_length)
    with torch.no_grad():
        (report,) = client_reports(plan, clients, replica.table, [node.client], [size])
    report.scalars = local_attack(node, report.scalars, args.zo_seed, t)
    state[SCHEDULE] = ConfigRecord(schedule.decisions())
    if marks is not None:
        marks["computed"] = time.time()
    return report_content(report, replica.applied)

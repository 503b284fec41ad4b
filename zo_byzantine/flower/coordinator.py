"""The server role across a Flower grid (SPEC 8): register nodes, plan, collect replies until the deadline, validate,
aggregate with ``Server``, append the ``Ledger``, apply it to the server's replica.

Written against the two grid calls it uses, ``get_node_ids()`` and ``send_and_receive(messages, timeout=)`` (a
Flower ``Grid``, or a test's stand-in), so the loop runs the same in-process and on a SuperLink. One round ``t``:

    plan = server.plan(t, federation.participants(t), local_lr)      (the simulation's sampling of client ids)
    to each participant's node: plan + ledger rounds since what it last said it applied + fingerprints;
    to each connected node not yet known: a registration query ("query": it says its client id; a claim on a
    client held by another connected node is refused), so that it takes part from the next round
    replies until round-timeout: parsed strictly (wire.read_reply); sender must be the node registered for the
        client it names; catch-up requests noted; every other problem rejected and logged
    downlink = server.aggregate(plan, reports, lr)      (sampled, one each, round t, shape; non-finite sanitised;
        the rule sized for the reports received; too few -> skipped and logged)
    ledger.append(downlink); replica.apply(the new round)
    every eval-every rounds: the replica on the task's eval set (evaluation.py), into the rounds log
"""

from __future__ import annotations

import json
import logging
import os
import time

import numpy as np
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from ..aggregators import build_aggregator
from ..federation import Federation
from ..ledger import Ledger
from ..server import Server
from .config import Deployment, Task
from .evaluation import evaluate_model
from .replica import Replica
from .wire import WireError, plan_content, read_reply

logger = logging.getLogger(__name__)

ROUNDS_LOG = "flower_rounds.json"
QUERY, TRAIN = "query", "train"


class Coordinator:
    """The server of a deployment.

    Args:
        deployment: the checked run config.
        task: the model at its start weights (the replica; the ledger's fingerprint).
        clock: ``time.monotonic`` (tests may pass their own).

    Attributes:
        ledger: the run's ledger (the same format as the Trainer's).
        rounds_log: one dict per round: ``round, participants, sent, received, rejected, catch_up, nonfinite,
            skipped, problems`` (each problem a string naming the node and why), and ``eval_loss, eval_accuracy``
            in rounds that evaluate.
    """

    def __init__(self, deployment: Deployment, task: Task, clock=time.monotonic):
        args = deployment.args
        self.deployment, self.task, self.clock = deployment, task, clock
        rule = build_aggregator(args.aggregator, args.pre_aggregators, **args.aggregator_kwargs)
        args.check_sizing(rule)
        self.replica = Replica(task.model, args)
        self.server = Server(args.protocol_settings(), rule, self.replica.table)
        self.ledger = Ledger(self.replica.optimizer)
        # sampling only: participants(t) depends on (zo_seed, t, num_clients, clients_per_round), not on data
        empty = [np.zeros(0, dtype=np.int64)] * args.num_clients
        self.sampler = Federation(empty, args.per_device_train_batch_size, 0, args.zo_seed, args.clients_per_round)
        self.clients: dict[int, int] = {}  # node id -> client id
        self.applied: dict[int, int] = {}  # node id -> ledger rounds it last said it has applied
        self.rounds_log: list[dict] = []

    # ----- nodes -------------------------------------------------------------------------------------------

    def queries(self, connected: set[int]) -> list[Message]:
        """A registration query to every connected node not yet known (it answers with its client id)."""
        return [Message(content=RecordDict({"hello": ConfigRecord({})}), message_type=QUERY, dst_node_id=n)
                for n in sorted(connected - set(self.clients))]

    def registered(self, reply, connected: set[int]) -> str | None:
        """Register the sender of a query reply; returns the problem, if any (a claim on a client that another
        connected node holds is refused; one held by a node gone is taken over)."""
        node = reply.metadata.src_node_id
        try:
            client = self._claim(reply)
        except WireError as err:
            return f"node {node}: registration refused: {err}"
        holder = next((n for n, c in self.clients.items() if c == client), None)
        if holder is not None and holder != node and holder in connected:
            return f"node {node}: claims client {client}, held by connected node {holder}"
        if holder is not None:
            del self.clients[holder]
            self.applied.pop(holder, None)
        self.clients[node] = client
        return None

    def register(self, grid) -> list[str]:
        """Ask the connected nodes not yet known for their client id (before round 0; later rounds send these
        queries beside their plans); returns the problems met."""
        connected = set(grid.get_node_ids())
        messages = self.queries(connected)
        replies = grid.send_and_receive(messages, timeout=self.deployment.round_timeout) if messages else []
        problems = [p for p in (self.registered(r, connected) for r in replies) if p]
        for problem in problems:
            logger.warning("Registration: %s.", problem)
        return problems

    def _claim(self, reply) -> int:
        if reply.has_error():
            raise WireError(f"error reply: {reply.error.reason}")
        content = reply.content
        if set(content.keys()) != {"hello"} or not isinstance(content["hello"], MetricRecord):
            raise WireError("expected one MetricRecord 'hello'")
        record = content["hello"]
        client = record.get("client") if set(record.keys()) == {"client"} else None
        if type(client) is not int or not 0 <= client < self.deployment.args.num_clients:
            raise WireError(f"'client' must be an int in [0, {self.deployment.args.num_clients})")
        return client

    def wait_for_nodes(self, grid) -> None:
        """Block until ``min-nodes`` nodes are connected, or ``startup-timeout`` passes (the run then goes on)."""
        deadline = self.clock() + self.deployment.startup_timeout
        while len(set(grid.get_node_ids())) < self.deployment.min_nodes and self.clock() < deadline:
            time.sleep(0.5)

    # ----- rounds ------------------------------------------------------------------------------------------

    def run(self, grid) -> Ledger:
        """Wait for ``min-nodes``, register them, then every round of the run; the ledger and the rounds log are
        written after each round."""
        self.wait_for_nodes(grid)
        self.register(grid)
        for t in range(len(self.ledger.rounds), self.deployment.rounds):
            self.round(grid, t)
        return self.ledger

    def round(self, grid, t: int) -> dict:
        """Round ``t``; returns its log entry."""
        args = self.deployment.args
        problems = []
        lr = args.learning_rate
        local_lr = args.local_learning_rate if args.local_learning_rate is not None else lr
        plan = self.server.plan(t, self.sampler.participants(t), local_lr)
        connected = set(grid.get_node_ids())
        node_of = {c: n for n, c in self.clients.items() if n in connected}
        weights = self.replica.fingerprint()
        messages = []
        for client in plan.participants:
            if client not in node_of:
                problems.append(f"client {client}: no connected node")
                continue
            node = node_of[client]
            since = min(self.applied.get(node, 0), t)
            content = plan_content(plan, since, self.ledger.rounds[since:t], self.replica.start, weights)
            messages.append(Message(content=content, message_type=TRAIN, dst_node_id=node))
        plans = len(messages)
        messages += self.queries(connected)  # nodes not yet known: they register now, take part from next round
        replies = list(grid.send_and_receive(messages, timeout=self.deployment.round_timeout)) if messages else []
        reports, catch_up, rejected, received = [], [], 0, 0
        shape = (len(plan.uplink_steps), self.server.width())
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.metadata.message_type == QUERY:
                problems += [p for p in [self.registered(reply, connected)] if p]
                continue
            received += 1
            try:
                if reply.has_error():
                    raise WireError(f"error reply: {reply.error.reason}")
                parsed = read_reply(reply.content, shape, t)
                if self.clients.get(node) != parsed.client:
                    raise WireError(f"names client {parsed.client}, registered as {self.clients.get(node)}")
            except WireError as err:
                rejected += 1
                problems.append(f"node {node}: reply rejected: {err}")
                continue
            self.applied[node] = parsed.applied
            if parsed.report is None:
                catch_up.append(parsed.client)
            else:
                reports.append(parsed.report)
        downlink = self.server.aggregate(plan, reports, lr)
        self.ledger.append(downlink)
        self.replica.apply(self.ledger.rounds[t:])
        entry = {
            "round": t, "participants": list(plan.participants), "sent": plans, "received": received,
            "accepted": downlink.participants, "rejected": rejected + downlink.rejected, "catch_up": catch_up,
            "nonfinite": downlink.nonfinite, "skipped": downlink.skipped, "loss": downlink.loss, "problems": problems,
        }
        every = self.deployment.eval_every
        if every and (t + 1) % every == 0 and self.task.eval_dataset is not None:
            entry.update(evaluate_model(self.replica.model, self.task.eval_dataset, self.task.data_collator,
                                        args.per_device_eval_batch_size))
        self.rounds_log.append(entry)
        for problem in problems:
            logger.warning("Round %d: %s.", t, problem)
        if downlink.skipped:
            logger.warning("Round %d skipped (%s); the model is left unchanged.", t, downlink.skipped)
        self.write()
        return entry

    def write(self) -> None:
        """The ledger and the rounds log, into ``output-dir`` (if set)."""
        out = self.deployment.output_dir
        if not out:
            return
        self.ledger.save(out)
        tmp = os.path.join(out, f".{ROUNDS_LOG}.tmp")
        with open(tmp, "w") as f:
            json.dump(self.rounds_log, f, indent=1, default=str)
        os.replace(tmp, os.path.join(out, ROUNDS_LOG))

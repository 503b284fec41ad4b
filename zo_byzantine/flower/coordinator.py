"""The server role across a Flower grid (SPEC 8): register nodes, plan, collect replies until the deadline, validate,
aggregate with ``Server``, append the ``Ledger``, apply it to the server's replica.

Written against the grid calls it uses, ``get_node_ids()``, ``get_nodes()`` (with ``client-keys``: the nodes'
public keys), ``push_messages(messages)`` and ``pull_messages(message_ids)`` (a Flower ``Grid``, or a test's
stand-in), so the loop runs the same in-process and on a SuperLink. Every message sent is kept by its id
(:class:`Sent`: kind, node, round, client); a reply is judged against the message it answers, never by what it
says about itself. One round ``t``:

    plan = server.plan(t, federation.participants(t), local_lr)      (the simulation's sampling of client ids)
    to each participant's registered node: plan + at most catch-up-limit ledger rounds from what it last said it
        applied + fingerprints
    to each connected node not yet known, with no query outstanding and not backing off after a refusal: a
        registration query ("query": it says its client id); never waited on: its reply is taken whenever it
        arrives (this round or a later one), so that the node takes part from the next round
    replies to this round's plans until all are in or round-timeout passes: each must answer a message sent and
        still outstanding, be typed as that message, and name its round and client; parsed strictly
        (wire.read_reply); example count = the server's own partition size; catch-up requests noted
    downlink = server.aggregate(plan, reports, lr)      (the rule sized for the reports received; the round's loss
        trimmed by f per side; too few -> skipped and logged)
    ledger.append(downlink); replica.apply(the new round)
    every eval-every rounds: the replica on the task's eval set (evaluation.py), into the rounds log
    the round's entry appended to flower_rounds.jsonl (one JSON line per round)

Who is which client: with ``client-keys``, the client a node's (authenticated) public key is bound to, and only if
the node claims that client; without, the first connected node that claims a client holds it (a later claim while
it is connected is refused and recorded naming both nodes; a client whose node is gone is taken over).

Every rejection, refusal and missed deadline is a problem ``{"round", "node", "client", "reason"}`` in the rounds
log and the log, its reason at most ``wire.REASON_LIMIT`` characters.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass

from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID as SUPERLINK_NODE

from ..aggregators import build_aggregator
from ..checkpoints import protocol_of
from ..checks import build_federation
from ..ledger import Ledger
from ..server import Server
from .config import Deployment, Task, public_key_id, read_client_keys
from .replica import Replica
from .wire import WireError, clip, plan_content, read_reply

logger = logging.getLogger(__name__)

ROUNDS_LOG = "flower_rounds.jsonl"
QUERY, TRAIN = "query", "train"
POLL = 1.0  # seconds between pulls while replies are outstanding: at most (a round's first pulls come sooner)
FIRST_POLL = 0.02  # seconds before a round's second pull; each wait doubles, up to POLL
REJECTED = "reply rejected"  # how a rejected reply's problem starts (the round's ``rejected`` counts them)
BACKOFF_CAP = 64  # rounds: the longest wait before a refused node is queried again


@dataclass(frozen=True)
class Sent:
    """A message the server sent, by its id: what a reply to it must answer."""

    kind: str  # QUERY or TRAIN
    node: int
    round: int  # the round it was sent in
    client: int | None = None  # a plan's client


def read_rounds_log(folder: str) -> list[dict]:
    """The entries of ``folder``'s ``flower_rounds.jsonl`` (one JSON object a line); a last line still being
    written is left out."""
    try:
        with open(os.path.join(folder, ROUNDS_LOG)) as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        return []
    entries = []
    for line in lines[:-1]:  # the text after the last newline is not a complete entry yet
        entries.append(json.loads(line))
    return entries


class Coordinator:
    """The server of a deployment.

    Args:
        deployment: the checked run config.
        task: the model at its start weights (the replica; the ledger's fingerprint), the training set (the
            clients' partitions: their sizes weight FedES).
        clock, sleep: ``time.monotonic`` and ``time.sleep`` (tests may pass their own).

    Attributes:
        ledger: the run's ledger (the same format as the Trainer's).
        clients: node id -> client id of the registered nodes.
        rounds_log: one dict per round: ``round, participants, sent, received, accepted, rejected, missed,
            catch_up, nonfinite, skipped, loss, seconds, problems`` (see the module docstring), ``timing`` (``started``:
            wall-clock time of the round's start; ``replies``: seconds until the last reply or the deadline;
            ``aggregate``: seconds of validation, aggregation, ledger and replica), and ``eval_loss, eval_accuracy``
            in rounds that evaluate.
    """

    def __init__(self, deployment: Deployment, task: Task, clock=time.monotonic, sleep=time.sleep):
        args = deployment.args
        self.deployment, self.task, self.clock, self.sleep = deployment, task, clock, sleep
        rule = build_aggregator(args.aggregator, args.pre_aggregators, **args.aggregator_kwargs)
        args.check_sizing(rule)
        self.replica = Replica(task.model, args)
        self.server = Server(args.protocol_settings(), rule, self.replica.table)
        self.ledger = Ledger(self.replica.optimizer, protocol=protocol_of(args, rule, None, task.train_dataset))
        # the simulation's partitions: participants(t) (seeded sampling) and each client's example count
        self.sampler = build_federation(args, task.train_dataset)
        self.sizes = [len(p) for p in self.sampler.partitions]
        self.bound = read_client_keys(deployment.client_keys, args.num_clients) if deployment.client_keys else None
        self.keys: dict[int, bytes | None] = {}  # node id -> its public key (DER), with client-keys
        self.clients: dict[int, int] = {}  # node id -> client id
        self.applied: dict[int, int] = {}  # node id -> ledger rounds it last said it has applied
        self.pending: dict[str, Sent] = {}  # message id -> the message, while its reply is outstanding
        self.answered: dict[str, Sent] = {}  # message id -> the message, answered in this round (or at startup)
        self.foreign: set[tuple[str, int]] = set()  # (message id, node) of replies from another node (this round)
        self.refusals: dict[int, tuple[int, float]] = {}  # node id -> (refusals, round it may be queried again)
        self.rounds_log: list[dict] = []
        self.carried: list[dict] = []  # problems met before round 0 (registration), recorded with round 0
        self._log_open = False

    # ----- problems ----------------------------------------------------------------------------------------

    def problem(self, problems: list, t: int, node: int | None, client: int | None, reason: str) -> None:
        """Record (and log) a problem of round ``t``; ``reason`` is clipped to ``wire.REASON_LIMIT`` characters."""
        entry = {"round": t, "node": node, "client": client, "reason": clip(reason)}
        problems.append(entry)
        logger.warning("Round %d: node %s, client %s: %s.", t, node, client, entry["reason"])

    # ----- messages ----------------------------------------------------------------------------------------

    def _push(self, grid, messages: list[tuple[Message, Sent]], problems: list, t: int) -> list[str]:
        """Send ``messages``; each is kept (pending) by its id until its reply is taken, or its deadline passes."""
        if not messages:
            return []
        ids = list(grid.push_messages([m for m, _ in messages]))
        kept = []
        for message_id, (_, sent) in zip(ids, messages, strict=True):
            if not message_id:
                self.problem(problems, t, sent.node, sent.client, f"the {sent.kind} message could not be sent")
                continue
            self.pending[message_id] = sent
            kept.append(message_id)
        return kept

    def _pull(self, grid, problems: list, t: int) -> list[tuple[Sent, Message]]:
        """Replies to pending messages, each with the message it answers; one that answers no pending message (a
        second reply, one to a message already judged or never sent) is rejected and recorded."""
        if not self.pending:
            return []
        matched = []
        for reply in grid.pull_messages(list(self.pending)):
            answers = reply.metadata.reply_to_message_id
            sent = self.pending.get(answers)
            source = reply.metadata.src_node_id
            # the SuperLink's check, made here too; the SuperLink itself answers (an error, from its own node id) for
            # a node that is gone, and no SuperNode can send as the SuperLink
            if sent is not None and source != sent.node and not (source == SUPERLINK_NODE and reply.has_error()):
                if (answers, source) not in self.foreign:  # a reply pulled again is recorded once
                    self.foreign.add((answers, source))
                    self.problem(problems, t, source, sent.client,
                                 f"{REJECTED}: a reply to node {sent.node}'s {sent.kind} message from another node")
                continue
            sent = self.pending.pop(answers, None)
            if sent is not None:
                self.answered[answers] = sent
                matched.append((sent, reply))
            elif answers in self.answered:
                earlier = self.answered[answers]
                self.problem(problems, t, earlier.node, earlier.client,
                             f"{REJECTED}: a second reply to its {earlier.kind} message")
            else:
                self.problem(problems, t, reply.metadata.src_node_id, None,
                             f"{REJECTED}: it answers no outstanding message (one to another round's or node's)")
        return matched

    def _connected(self, grid) -> set[int]:
        """The connected nodes; with ``client-keys``, their public keys are noted too."""
        if self.bound is None:
            connected = set(grid.get_node_ids())
        else:
            infos = list(grid.get_nodes())
            self.keys = {int(i.node_id): public_key_id(getattr(i, "public_key", b"") or b"") for i in infos}
            connected = set(self.keys)
        for message_id, sent in list(self.pending.items()):  # a query to a node gone: asked again if it returns
            if sent.kind == QUERY and sent.node not in connected:
                del self.pending[message_id]
        return connected

    # ----- registration ------------------------------------------------------------------------------------

    def queries(self, connected: set[int], t: int) -> list[tuple[Message, Sent]]:
        """A registration query to every connected node not yet known, with none outstanding, and not backing off
        after a refusal (it answers with its client id)."""
        asked = {s.node for s in self.pending.values() if s.kind == QUERY}
        nodes = [n for n in sorted(connected - set(self.clients) - asked) if self.refusals.get(n, (0, 0))[1] <= t]
        return [(Message(content=RecordDict({"hello": ConfigRecord({})}), message_type=QUERY, dst_node_id=n),
                 Sent(QUERY, n, t)) for n in nodes]

    def _refuse(self, problems: list, t: int, node: int, client: int | None, reason: str, final: bool) -> None:
        """Refuse a registration; the node is asked again after 1, 2, 4, ... rounds (never, if ``final``)."""
        count = self.refusals.get(node, (0, 0))[0] + 1
        again = math.inf if final else t + min(2 ** (count - 1), BACKOFF_CAP)
        self.refusals[node] = (count, again)
        self.problem(problems, t, node, client, f"registration refused: {reason}")

    def registered(self, reply: Message, sent: Sent, connected: set[int], problems: list, t: int) -> None:
        """Register the node a query was sent to from its reply, or refuse it (recorded)."""
        node = sent.node
        try:
            client = self._claim(reply)
        except WireError as err:
            self._refuse(problems, t, node, None, str(err), final=False)
            return
        if self.bound is not None:
            key = self.keys.get(node)
            if key not in self.bound:
                self._refuse(problems, t, node, client, "its public key is bound to no client (client-keys)",
                             final=True)
                return
            if self.bound[key] != client:
                self._refuse(problems, t, node, client, f"claims client {client}; its public key is bound to client "
                             f"{self.bound[key]} (client-keys)", final=True)
                return
        holder = next((n for n, c in self.clients.items() if c == client), None)
        if holder is not None and holder != node and holder in connected and self.bound is None:
            self._refuse(problems, t, node, client, f"claims client {client}, held by connected node {holder} (the "
                         "first claim holds a client id; bind clients to SuperNode keys with client-keys)", final=False)
            return
        if holder is not None:
            del self.clients[holder]
            self.applied.pop(holder, None)
        self.clients[node] = client
        self.refusals.pop(node, None)

    def _claim(self, reply: Message) -> int:
        if reply.has_error():
            raise WireError(f"error reply: {clip(reply.error.reason)}")
        if reply.metadata.message_type != QUERY:
            raise WireError(f"a reply typed {clip(reply.metadata.message_type, 40)!r} to a {QUERY!r} message")
        content = reply.content
        if set(content.keys()) != {"hello"} or not isinstance(content["hello"], MetricRecord):
            raise WireError("expected one MetricRecord 'hello'")
        record = content["hello"]
        client = record.get("client") if set(record.keys()) == {"client"} else None
        if type(client) is not int or not 0 <= client < self.deployment.args.num_clients:
            raise WireError(f"'client' must be an int in [0, {self.deployment.args.num_clients})")
        return client

    def _take_queries(self, grid, connected: set[int], problems: list, t: int) -> list[tuple[Sent, Message]]:
        """Pull: registration replies are taken at once; plan replies are returned."""
        plans = []
        for sent, reply in self._pull(grid, problems, t):
            if sent.kind == QUERY:
                self.registered(reply, sent, connected, problems, t)
            else:
                plans.append((sent, reply))
        return plans

    def register(self, grid) -> list[dict]:
        """Before round 0: query the connected nodes (and those that connect meanwhile) until ``min-nodes`` have
        registered, or ``startup-timeout`` passes (the run then starts with those registered; the others register
        during the rounds). Returns the problems met (recorded with round 0)."""
        deadline = self.clock() + self.deployment.startup_timeout
        problems = []
        while True:
            connected = self._connected(grid)
            self._push(grid, self.queries(connected, 0), problems, 0)
            self._take_queries(grid, connected, problems, 0)
            if len(self.clients) >= self.deployment.min_nodes or self.clock() >= deadline:
                break
            self.sleep(POLL)
        self.carried += problems
        return problems

    # ----- rounds ------------------------------------------------------------------------------------------

    def run(self, grid) -> Ledger:
        """Register ``min-nodes`` nodes, then every round of the run; the ledger and the round's line of the rounds
        log are written after each round."""
        self.register(grid)
        for t in range(len(self.ledger.rounds), self.deployment.rounds):
            self.round(grid, t)
        return self.ledger

    def _plans(self, plan, connected: set[int], problems: list, t: int) -> list[tuple[Message, Sent]]:
        """The round's plan messages: to each participant's registered node, with the ledger rounds it lacks (at
        most catch-up-limit of them)."""
        node_of = {c: n for n, c in self.clients.items() if n in connected}
        weights = self.replica.fingerprint()
        messages = []
        for client in plan.participants:
            client = int(client)
            if client not in node_of:
                self.problem(problems, t, None, client, "no registered node connected")
                continue
            node = node_of[client]
            since = min(self.applied.get(node, 0), t)
            entries = self.ledger.rounds[since : min(t, since + self.deployment.catch_up_limit)]
            content = plan_content(plan, since, entries, self.replica.start, weights)
            messages.append((Message(content=content, message_type=TRAIN, dst_node_id=node),
                             Sent(TRAIN, node, t, client)))
        return messages

    def _judge(self, sent: Sent, reply: Message, shape: tuple[int, int]):
        """A plan reply checked against its plan (type, round, client, the client's example count); raises
        :class:`WireError` naming what is wrong."""
        if reply.has_error():
            raise WireError(f"error reply: {clip(reply.error.reason)}")
        if reply.metadata.message_type != TRAIN:
            raise WireError(f"a reply typed {clip(reply.metadata.message_type, 40)!r} to a {TRAIN!r} message")
        parsed = read_reply(reply.content, shape, sent.round)
        if parsed.round != sent.round:
            raise WireError(f"answers round {parsed.round}; its plan was round {sent.round}'s")
        if parsed.client != sent.client:
            raise WireError(f"names client {parsed.client}; its plan was client {sent.client}'s")
        if parsed.report is not None and parsed.report.num_examples != self.sizes[sent.client]:
            raise WireError(f"num_examples={parsed.report.num_examples}; client {sent.client}'s partition has "
                            f"{self.sizes[sent.client]} examples")
        return parsed

    def round(self, grid, t: int) -> dict:
        """Round ``t``; returns its log entry."""
        args = self.deployment.args
        start, started = self.clock(), time.time()
        problems, self.carried = self.carried, []
        self.answered.clear()
        self.foreign.clear()
        lr = args.learning_rate
        local_lr = args.local_learning_rate if args.local_learning_rate is not None else lr
        plan = self.server.plan(t, self.sampler.participants(t), local_lr)
        connected = self._connected(grid)
        outgoing = self._plans(plan, connected, problems, t)
        plan_ids = self._push(grid, outgoing, problems, t)
        self._push(grid, self.queries(connected, t), problems, t)  # not waited on
        deadline = start + self.deployment.round_timeout
        replies, poll = [], FIRST_POLL
        while True:
            replies += self._take_queries(grid, connected, problems, t)
            waiting = [i for i in plan_ids if i in self.pending]
            if not waiting or self.clock() >= deadline:
                break
            self.sleep(min(poll, max(deadline - self.clock(), 0.0)))
            poll = min(2 * poll, POLL)
        replied = self.clock()
        for message_id in waiting:
            sent = self.pending.pop(message_id)
            self.problem(problems, t, sent.node, sent.client,
                         f"no reply by the deadline (round-timeout={self.deployment.round_timeout:g} s)")
        reports, catch_up = [], []
        shape = (len(plan.uplink_steps), self.server.width())
        for sent, reply in replies:
            try:
                parsed = self._judge(sent, reply, shape)
            except WireError as err:
                self.problem(problems, t, sent.node, sent.client, f"{REJECTED}: {err}")
                continue
            self.applied[sent.node] = parsed.applied
            if parsed.report is None:
                catch_up.append(parsed.client)
                continue
            if not math.isfinite(parsed.report.loss):
                self.problem(problems, t, sent.node, sent.client, "non-finite loss: left out of the round's loss")
            reports.append(parsed.report)
        downlink = self.server.aggregate(plan, reports, lr)
        if downlink.rejected:  # not expected: every check of Server.accept was made above
            self.problem(problems, t, None, None, f"{downlink.rejected} report(s) refused by the server role")
        self.ledger.append(downlink)
        self.replica.apply(self.ledger.rounds[t:])
        rejected = sum(p["reason"].startswith(REJECTED) for p in problems)
        entry = {
            "round": t, "participants": [int(c) for c in plan.participants], "sent": len(plan_ids),
            "received": len(replies), "accepted": downlink.participants, "rejected": rejected + downlink.rejected,
            "missed": len(waiting), "catch_up": catch_up, "nonfinite": downlink.nonfinite,
            "skipped": downlink.skipped, "loss": downlink.loss, "seconds": round(self.clock() - start, 3),
            "problems": problems,
            "timing": {"started": started, "replies": round(replied - start, 3),
                       "aggregate": round(self.clock() - replied, 3)},
        }
        every = self.deployment.eval_every
        if every and (t + 1) % every == 0 and self.task.eval_dataset is not None:
            from .evaluation import evaluate_model  # scikit-learn's metric: imported by a run that evaluates

            entry.update(evaluate_model(self.replica.model, self.task.eval_dataset, self.task.data_collator,
                                        args.per_device_eval_batch_size))
        self.rounds_log.append(entry)
        if downlink.skipped:
            logger.warning("Round %d skipped (%s); the model is left unchanged.", t, downlink.skipped)
        self.write(entry)
        return entry

    def write(self, entry: dict) -> None:
        """The ledger, and ``entry`` appended to the rounds log (one JSON line; the first of the run starts the
        file), into ``output-dir`` (if set)."""
        out = self.deployment.output_dir
        if not out:
            return
        self.ledger.save(out)
        with open(os.path.join(out, ROUNDS_LOG), "a" if self._log_open else "w") as f:
            f.write(json.dumps(entry, default=str) + "\n")
        self._log_open = True

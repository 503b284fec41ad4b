"""The Flower apps: thin drivers of the two roles (``Coordinator`` on the SuperLink, ``node.answer`` on a SuperNode).

    server_app() -> ServerApp    @main: check the run config, build the task, Coordinator(...).run(grid)
    client_app() -> ClientApp    @query: this node's client id;  @train: answer a plan (node.answer)

A Flower App (``examples/flower``) exposes them: ``app = server_app()``, ``app = client_app()``.

Flower runs every message to a node in a fresh ClientApp process, so the ClientApp imports only what a node needs
(no transformers Trainer, peft, datasets or scikit-learn: see ``zo_byzantine/__init__.py``); the node's store
(``store.NodeStore``) keeps its checked settings, partition and weights between the messages. A process that runs
many messages (the resident runtime, ``resident``) also keeps the task and the replica in memory
(:func:`kept_node`): no model load and no weights read per plan. With the environment
variable ``ZO_FLOWER_TIMINGS=1`` on the SuperNode, every plan appends its steps' wall-clock times to
``timings.jsonl`` in the node's store (``benchmarks/flower_round.py`` reads them).
"""

from __future__ import annotations

import json
import os
import time

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from .config import Deployment, Task, build_task, node_deployment, read_node_config, read_run_config
from .store import NodeStore

TIMINGS_ENV, TIMINGS_FILE = "ZO_FLOWER_TIMINGS", "timings.jsonl"
_KEPT: dict | None = None  # kept_node's {(run id, node id, run config): (task, replica)}; None: keeping is off


def keep_in_memory(on: bool = True) -> None:
    """Whether :func:`kept_node` keeps each node's task and replica between the messages this process runs: on in
    the resident runtime (``resident``); off by default, where a process runs one message (Flower's ClientApp
    process) or plays many nodes' messages as fresh processes would (tests)."""
    global _KEPT
    _KEPT = {} if on else None


def server_app() -> ServerApp:
    """A ``ServerApp`` running the run config's deployment on the grid."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        from .coordinator import Coordinator  # the server's imports (evaluation, checkpoints): not a ClientApp's

        deployment = read_run_config(context.run_config)
        Coordinator(deployment, build_task(deployment, context.run_config)).run(grid)

    return app


def process_start() -> float | None:
    """This process's start, wall clock (Linux ``/proc``), or ``None`` where it cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def content_bytes(content: RecordDict) -> int:
    """Bytes of ``content`` as Flower serialises it between processes (every deflated object of its tree)."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return sum(len(obj.deflate()) for obj in get_all_nested_objects(content).values())


def record_timings(store: NodeStore, marks: dict, msg: Message, reply: RecordDict, context: Context) -> None:
    """Append one plan's line to ``timings.jsonl`` in the node's store: the wall-clock times of its steps, the
    round, and the bytes SuperNode and ClientApp exchanged for it (plan, reply, and the ``Context`` each way)."""
    from flwr.common.serde import context_to_proto

    marks.update(process=process_start(), round=int(msg.content["plan"]["round"]),
                 plan_bytes=content_bytes(msg.content), reply_bytes=content_bytes(reply),
                 context_bytes=context_to_proto(context).ByteSize(), pid=os.getpid())
    with open(store.path(TIMINGS_FILE), "a") as f:
        f.write(json.dumps(marks) + "\n")


def kept_node(context: Context, deployment: Deployment):
    """``(task, replica)`` of this node in this run: the run config's task built and a new ``Replica`` of its model;
    with :func:`keep_in_memory` on, kept from this process's earlier plans while the replica is in sync
    (:attr:`Replica.in_sync`; what was kept for other runs, and for this node under another config, is released
    before a new one is built)."""
    from ..offload import check_offload_schedule
    from .replica import Replica

    key = (context.run_id, context.node_id, json.dumps(dict(context.run_config), sort_keys=True, default=repr))
    kept = _KEPT.get(key) if _KEPT is not None else None
    if kept is None or not kept[1].in_sync:
        kept = None  # released with the others before a new model is built
        drop_kept(context, other_runs=True)
        task: Task = build_task(deployment, context.run_config)
        check_offload_schedule(deployment.args, task.model)  # a model dispatched with offload: what it cannot run
        kept = (task, Replica(task.model, deployment.args))
        if _KEPT is not None:
            _KEPT[key] = kept
    return kept


def drop_kept(context: Context, other_runs: bool = False) -> None:
    """Forget what :func:`kept_node` keeps for this node (its weights in memory are no longer known), and with
    ``other_runs`` what it keeps for other runs."""
    for key in [k for k in _KEPT or () if k[:2] == (context.run_id, context.node_id)
                or (other_runs and k[0] != context.run_id)]:
        del _KEPT[key]


def client_app() -> ClientApp:
    """A ``ClientApp`` answering registration queries and plans as the node config's client."""
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        store = NodeStore.of(context.node_config, context.node_id, context.run_id)
        deployment = node_deployment(context.run_config, store)  # the node's one full check of the run config
        node = read_node_config(context.node_config, deployment.args.num_clients)
        return Message(RecordDict({"hello": MetricRecord({"client": node.client})}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        marks = {"started": time.time()}
        from .node import PlanRefused, answer  # the node's modules: imported by the messages that need them

        marks["imported"] = time.time()
        store = NodeStore.of(context.node_config, context.node_id, context.run_id)
        deployment = node_deployment(context.run_config, store)
        node = read_node_config(context.node_config, deployment.args.num_clients)
        task, replica = kept_node(context, deployment)
        marks["task_built"] = time.time()
        try:
            reply = answer(msg.content, context.state, deployment, task, node, store, replica, marks)
        except PlanRefused:  # refused before any weight changed, or out of sync (then not in_sync: rebuilt)
            raise
        except BaseException:
            drop_kept(context)  # the weights in memory are no longer known: the next plan starts from the store
            raise
        if os.environ.get(TIMINGS_ENV) == "1":
            record_timings(store, marks, msg, reply, context)
        return Message(reply, reply_to=msg)

    return app

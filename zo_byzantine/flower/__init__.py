"""Real federation on Flower (``pip install "zo_byzantine[flower]"``): the protocol's roles across processes and
machines, only seeds and scalars on the wire (SPEC 8).

    wire         Plan / ledger entries <-> ConfigRecord, Report <-> MetricRecord; strict parsing of untrusted records
    config       run config -> ZOByzantineArguments (+ deployment settings), node config (client id, node attack),
                 client-keys (SuperNode public key -> client id)
    replica      the model at the ledger's weights; catch-up through the library's update path
    store        a node's own disk: its replica's weights (safetensors, memory-mapped), its checked settings and
                 partition, kept between the messages of a run (each one a fresh ClientApp process)
    node         the client role on a node: plan -> catch-up -> client_reports -> report
    coordinator  the server role over a grid: register, plan, deadline, judge replies against what was sent,
                 aggregate, ledger, rounds log (flower_rounds.jsonl)
    apps         the ServerApp and ClientApp (thin)
"""

try:
    import flwr  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError('zo_byzantine.flower needs Flower: pip install "zo_byzantine[flower]" (flwr>=1.42,<2).') from err

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the same names, imported eagerly, for type checkers and IDEs
    from .apps import client_app, server_app
    from .config import NODE_ATTACKS, Deployment, Node, Task, read_client_keys, read_node_config, read_run_config
    from .coordinator import Coordinator, read_rounds_log
    from .node import PlanRefused, answer
    from .replica import Replica
    from .store import NodeStore
    from .wire import Reply, WireError, plan_content, read_plan, read_reply, report_content

# name -> the module of this package that defines it, imported on first use (PEP 562): a ClientApp process imports
# what a node needs, never the server's evaluation (scikit-learn) or transformers' Trainer
_EXPORTS = {
    **dict.fromkeys(("client_app", "server_app"), "apps"),
    **dict.fromkeys(("NODE_ATTACKS", "Deployment", "Node", "Task", "read_client_keys", "read_node_config",
                     "read_run_config"), "config"),
    **dict.fromkeys(("Coordinator", "read_rounds_log"), "coordinator"),
    **dict.fromkeys(("PlanRefused", "answer"), "node"),
    **dict.fromkeys(("Replica",), "replica"),
    **dict.fromkeys(("NodeStore",), "store"),
    **dict.fromkeys(("Reply", "WireError", "plan_content", "read_plan", "read_reply", "report_content"), "wire"),
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "NODE_ATTACKS",
    "Coordinator",
    "Deployment",
    "Node",
    "NodeStore",
    "PlanRefused",
    "Replica",
    "Reply",
    "Task",
    "WireError",
    "answer",
    "client_app",
    "plan_content",
    "read_client_keys",
    "read_node_config",
    "read_plan",
    "read_reply",
    "read_rounds_log",
    "read_run_config",
    "report_content",
    "server_app",
]

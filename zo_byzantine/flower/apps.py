"""The Flower apps: thin drivers of the two roles (``Coordinator`` on the SuperLink, ``node.answer`` on a SuperNode).

    server_app() -> ServerApp    @main: check the run config, build the task, Coordinator(...).run(grid)
    client_app() -> ClientApp    @query: this node's client id;  @train: answer a plan (node.answer)

A Flower App (``examples/flower``) exposes them: ``app = server_app()``, ``app = client_app()``.
"""

from __future__ import annotations

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from .config import build_task, read_node_config, read_run_config
from .coordinator import Coordinator
from .node import answer


def server_app() -> ServerApp:
    """A ``ServerApp`` running the run config's deployment on the grid."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        deployment = read_run_config(context.run_config)
        Coordinator(deployment, build_task(deployment, context.run_config)).run(grid)

    return app


def client_app() -> ClientApp:
    """A ``ClientApp`` answering registration queries and plans as the node config's client."""
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        deployment = read_run_config(context.run_config)
        node = read_node_config(context.node_config, deployment.args.num_clients)
        return Message(RecordDict({"hello": MetricRecord({"client": node.client})}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        deployment = read_run_config(context.run_config)
        node = read_node_config(context.node_config, deployment.args.num_clients)
        task = build_task(deployment, context.run_config)
        return Message(answer(msg.content, context.state, deployment, task, node), reply_to=msg)

    return app

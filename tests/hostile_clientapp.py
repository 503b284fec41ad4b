"""A hostile ClientApp for loopback deployments (copied into a test's Flower App as ``zo_flower_app/hostile.py``):
the project's ClientApp, except what the node config's ``hostile`` key says this node does instead.

    hostile = "type-switch"   answer each plan with a reply typed "query" claiming client ``hostile-client``
    hostile = "slow-query"    answer the registration query after ``hostile-seconds`` seconds
"""

import time

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from zo_byzantine.flower import client_app

honest = client_app()
app = ClientApp()


@app.query()
def query(msg: Message, context: Context) -> Message:
    if context.node_config.get("hostile") == "slow-query":
        time.sleep(float(context.node_config.get("hostile-seconds", 1000.0)))
    return honest(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    if context.node_config.get("hostile") != "type-switch":
        return honest(msg, context)
    claim = RecordDict({"hello": MetricRecord({"client": int(context.node_config["hostile-client"])})})
    reply = Message(claim, reply_to=msg)
    reply.metadata.message_type = "query"
    return reply

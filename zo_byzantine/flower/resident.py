"""The resident node runtime: one long-lived process per SuperNode runs every message of the node's ClientApp in
itself, in place of Flower's fresh ``flwr-clientapp`` process per message (issue 43, item 3).

    flower-supernode ... --isolation process --port 9094                       # Flower's node, starts no ClientApp
    zo-byzantine-resident --runtime-api-address 127.0.0.1:9094 --insecure      # this runtime, beside it

One runtime may serve several SuperNodes of a machine (``--runtime-api-address`` repeated): it asks each in turn,
runs their tasks one at a time, and keeps each node's task and replica (memory grows with the nodes served; the
SuperNodes then need no SuperExec or ClientApp processes of their own). Per task a SuperNode offers:
``AcquireTask`` (every ``poll`` seconds while there is none) -> a Runtime API client bound to the task's token ->
its message, ``Context``, run and FAB -> the FAB's ``ClientApp`` (installed and loaded once per FAB hash) -> the
reply and the ``Context`` pushed back; a ``ClientApp`` that raises is answered with Flower's error reply, as
``flwr-clientapp`` does, and the runtime goes on. Between messages the process keeps its
imports and what the ``ClientApp`` keeps (``apps.kept_node``: the task's model, the replica's weights), so a plan
costs its catch-up and its forwards.

Why not Flower's own: in both isolation modes Flower runs one process per message
(``flwr.supernode.runtime.run_clientapp``, which ends in ``flwr_exit``); its start and imports were most of a
round (benchmarks/README). This runtime speaks the Runtime API as ``flower-superexec`` does (the SuperNode cannot
tell them apart): with ``--superexec-auth-secret-file`` (the same file as the SuperNode's) it signs its
``AcquireTask`` requests, and a task's calls carry that task's token. It reuses Flower 1.42's runtime functions
(``pull_task_input``, ``push_message``, ``push_task_output``), which are not a public API (``setup.cfg`` keeps
``flwr`` below 2).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

ACQUIRE = "/flwr.proto.Runtime/AcquireTask"  # the one call a SuperNode checks the SuperExec secret on


def _client(address: str, insecure: bool, certificates: bytes | None, interceptors: list):
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    return RuntimeHttpClient.from_server_address(server_address=address, insecure=insecure,
                                                 root_certificates=certificates, interceptors=interceptors,
                                                 retry_invoker=make_simple_http_retry_invoker())


def _heartbeat(client) -> Callable[[], bool]:
    """A task's heartbeat for ``HeartbeatSender``: ``True`` once sent (or once the SuperNode no longer knows the
    task: a task answered a moment ago), ``False`` to retry on a transport error. Flower's own
    (``make_task_heartbeat_fn_http``) raises SIGINT in the process when the task is gone, which ends a one-task
    process as intended and would end this runtime."""
    import httpx
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest

    def beat() -> bool:
        try:
            client.SendTaskHeartbeat(SendTaskHeartbeatRequest())
        except httpx.TransportError:
            return False
        except httpx.HTTPStatusError as error:
            if error.response.status_code in (httpx.codes.SERVICE_UNAVAILABLE, httpx.codes.GATEWAY_TIMEOUT):
                return False
            logger.debug("task heartbeat refused: %s", error)
        return True

    return beat


class ResidentRuntime:
    """A SuperNode's ClientApp runtime kept alive between messages (see the module docstring).

    Args:
        addresses: the Runtime API of each SuperNode served (``host:port``, its ``--host``/``--port``).
        insecure: plain HTTP (the SuperNode without ``--ssl-*`` files); else TLS with ``certificates`` (PEM bytes
            of the CA, ``None``: the system's).
        secret: the SuperNode's SuperExec auth secret (bytes of ``--superexec-auth-secret-file``), or ``None``.
        poll: seconds to wait when no SuperNode had a task waiting.
    """

    def __init__(self, addresses: list[str], insecure: bool = True, certificates: bytes | None = None,
                 secret: bytes | None = None, poll: float = 0.02):
        from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor, SuperExecAuthHttpInterceptor

        if not poll > 0:
            raise ValueError(f"poll={poll!r}: expected seconds > 0.")
        if not addresses:
            raise ValueError("addresses: expected the Runtime API address of at least one SuperNode.")
        self.insecure, self.certificates, self.poll = insecure, certificates, poll
        interceptors = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
        if secret:
            interceptors.append(SuperExecAuthHttpInterceptor(master_secret=secret, protected_methods=frozenset({
                ACQUIRE})))
        self.clients = {address: _client(address, insecure, certificates, interceptors) for address in addresses}
        self.apps: dict[str, object] = {}  # FAB hash -> its loaded ClientApp
        self.tasks = 0
        from .apps import keep_in_memory

        keep_in_memory(True)  # this process runs many messages: each node's task and replica stay in memory

    def acquire(self, address: str) -> str | None:
        """The token of the next ClientApp task the SuperNode at ``address`` offers, or ``None`` if there is none."""
        from flwr.proto.runtime_pb2 import AcquireTaskRequest
        from flwr.supercore.constant import TaskType

        response = self.clients[address].AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
        return response.token if response.HasField("task") and response.token else None

    def client_app(self, run, fab):
        """The FAB's ``ClientApp``: installed and loaded at its first task, kept for the later ones."""
        if fab.hash_str not in self.apps:
            from flwr.cli.install import install_from_fab
            from flwr.clientapp.utils import get_load_client_app_fn

            install_from_fab(fab.content, skip_prompt=True)
            load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
            self.apps[fab.hash_str] = load(run.fab_id, run.fab_version, fab.hash_str)
        return self.apps[fab.hash_str]

    def run_task(self, address: str, token: str) -> bool:
        """Run the task of ``token`` (of the SuperNode at ``address``) in this process; returns whether the
        ClientApp answered without raising."""
        from flwr.app import Message
        from flwr.app.error import Error
        from flwr.common.constant import ErrorCode, SubStatus
        from flwr.supercore.heartbeat import HeartbeatSender
        from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
        from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

        client = _client(address, self.insecure, self.certificates,
                         [RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                          RuntimeTokenHttpInterceptor(token)])
        heartbeat = HeartbeatSender(_heartbeat(client))
        message = context = reply = None
        status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        heartbeat.start()
        try:
            message, context, run, fab = pull_task_input(client)
            reply = self.client_app(run, fab)(message=message, context=context)
            status, details = SubStatus.COMPLETED, ""
        except Exception as error:  # the ClientApp's failure is its reply, as in flwr-clientapp; the runtime goes on
            logger.exception("ClientApp raised")
            details = f"{type(error)}:<'{error}'>"
            if message is not None:
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message)
        finally:
            try:
                if reply is not None and context is not None:
                    push_message(client, reply, context)
            finally:
                heartbeat.stop()  # before the task ends: no heartbeat for a finished task
                push_task_output(client=client, context=context, sub_status=status, details=details)
                client.close()
                self.tasks += 1
        return status == SubStatus.COMPLETED

    def serve(self, max_tasks: int | None = None) -> None:
        """Run the SuperNodes' tasks as they come, until ``max_tasks`` have run (``None``: until stopped)."""
        while max_tasks is None or self.tasks < max_tasks:
            ran = False
            for address in self.clients:
                token = self.acquire(address)
                if token is not None:
                    self.run_task(address, token)
                    ran = True
            if not ran:
                time.sleep(self.poll)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="zo-byzantine-resident", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime-api-address", required=True, action="append",
                        help="a SuperNode's Runtime API, host:port (flower-supernode's --host and --port); repeat it "
                             "to serve several SuperNodes")
    parser.add_argument("--insecure", action="store_true", help="plain HTTP (a SuperNode without --ssl-* files)")
    parser.add_argument("--root-certificates", default=None, help="PEM file of the CA of the SuperNode's TLS")
    parser.add_argument("--superexec-auth-secret-file", default=None,
                        help="the SuperNode's --superexec-auth-secret-file (the same file)")
    parser.add_argument("--poll", type=float, default=0.02, help="seconds between polls for a task (default 0.02)")
    args = parser.parse_args(argv)
    if args.insecure == (args.root_certificates is not None):
        parser.error("give exactly one of --insecure and --root-certificates")
    if not args.poll > 0:
        parser.error(f"--poll {args.poll}: expected seconds > 0")
    certificates = _read(args.root_certificates) if args.root_certificates else None
    secret = _read(args.superexec_auth_secret_file) if args.superexec_auth_secret_file else None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ResidentRuntime(args.runtime_api_address, args.insecure, certificates, secret, args.poll).serve()


if __name__ == "__main__":
    main()

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
RETRYABLE = (502, 503, 504)  # HTTP statuses retried; any other is given up at once and raised to the caller
GIVE_UP = 60.0  # seconds a SuperNode may stay unreachable before this runtime stops serving it
STARTUP = 600.0  # seconds a SuperNode that never answered may take to come up (many started at once on a small host)
CALL_TIME = 30.0  # seconds a task's call is retried (transport errors, RETRYABLE) before the task is given up


def _retries(max_time: float):
    """How a runtime call is retried: transport errors and 502/503/504 with backoff for up to ``max_time`` seconds;
    any other HTTP status (401: a token the SuperNode no longer knows, or a refused secret; 403: a run that stopped)
    raised at once. Flower's own invoker signals SIGINT to its process on 401, which ends a one-task process as
    intended and would end this runtime and every SuperNode it serves."""
    import httpx
    from flwr.supercore.retry.retry_invoker import RetryInvoker, exponential

    return RetryInvoker(lambda: exponential(max_delay=2.0), (httpx.TransportError, httpx.HTTPStatusError),
                        max_tries=None, max_time=max_time,
                        should_giveup=lambda error: isinstance(error, httpx.HTTPStatusError)
                        and error.response.status_code not in RETRYABLE)


def _client(address: str, insecure: bool, certificates: bytes | None, interceptors: list, max_time: float):
    from flwr.supercore.runtime import RuntimeHttpClient

    return RuntimeHttpClient.from_server_address(server_address=address, insecure=insecure,
                                                 root_certificates=certificates, interceptors=interceptors,
                                                 retry_invoker=_retries(max_time))


def _heartbeat(client) -> Callable[[], bool]:
    """A task's heartbeat for ``HeartbeatSender``: ``False`` (try again) on a transport error or 503/504, else
    ``True``, also when the SuperNode refuses it (a task that has just ended); it never raises (a heartbeat thread
    that died would be mistaken for a stopped one). Flower's own raises SIGINT in the process when the task is gone."""
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
        except Exception as error:  # noqa: BLE001 - logged; the task's own calls report real failures
            logger.debug("task heartbeat failed: %s", error)
        return True

    return beat


def _forget_modules(package: str) -> None:
    """Remove ``package`` and its submodules from ``sys.modules``: the next import reads the newly installed FAB's
    files (Flower's loader returns a module already imported under that name, whichever FAB it came from)."""
    import importlib
    import sys

    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[name]
    importlib.invalidate_caches()


class ResidentRuntime:
    """A SuperNode's ClientApp runtime kept alive between messages (see the module docstring).

    Args:
        addresses: the Runtime API of each SuperNode served (``host:port``, its ``--host``/``--port``).
        insecure: plain HTTP (a SuperNode without ``--ssl-*`` files); else TLS checked against ``certificates``
            (PEM bytes of the CA).
        secret: the SuperNode's SuperExec auth secret (bytes of ``--superexec-auth-secret-file``), or ``None``.
        poll: seconds to wait when no SuperNode had a task waiting.
        give_up: seconds a SuperNode may stay unreachable (or refuse this runtime) before it is no longer served
            (one that never answered: ``STARTUP`` at least); the runtime ends when it serves none, as Flower's
            SuperExec ends with its SuperNode.

    One process runs the app code of every SuperNode it serves, with their secret: serve only SuperNodes of one
    trust domain (one operator's machine), as each SuperNode's own SuperExec would.
    """

    def __init__(self, addresses: list[str], insecure: bool = True, certificates: bytes | None = None,
                 secret: bytes | None = None, poll: float = 0.02, give_up: float = GIVE_UP):
        from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor, SuperExecAuthHttpInterceptor

        if not poll > 0:
            raise ValueError(f"poll={poll!r}: expected seconds > 0.")
        if not addresses:
            raise ValueError("addresses: expected the Runtime API address of at least one SuperNode.")
        if secret is not None and not secret:
            raise ValueError("secret: the SuperExec auth secret is empty (the SuperNode refuses an empty one too).")
        self.insecure, self.certificates, self.poll, self.give_up = insecure, certificates, poll, give_up
        interceptors = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
        if secret:
            interceptors.append(SuperExecAuthHttpInterceptor(master_secret=secret, protected_methods=frozenset({
                ACQUIRE})))
        self.clients = {address: _client(address, insecure, certificates, interceptors, min(poll * 50, 1.0))
                        for address in addresses}
        self.failing: dict[str, float] = {}  # address -> when its calls began to fail
        self.answered: set[str] = set()  # addresses that answered once (before that: STARTUP to come up)
        self.apps: dict[str, object] = {}  # FAB hash -> its loaded ClientApp (one FAB's package at a time)
        self.tasks = 0
        from .apps import keep_in_memory

        keep_in_memory(True)  # this process runs many messages: each node's task and replica stay in memory

    def acquire(self, address: str) -> str | None:
        """The token of the next ClientApp task the SuperNode at ``address`` offers, or ``None`` if there is none
        (or it cannot be reached: recorded, see ``give_up``)."""
        from flwr.proto.runtime_pb2 import AcquireTaskRequest
        from flwr.supercore.constant import TaskType

        try:
            response = self.clients[address].AcquireTask(
                AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
        except Exception as error:  # noqa: BLE001 - unreachable past the retries, or refused (a wrong secret)
            if address not in self.failing:
                logger.warning("SuperNode %s: %s (served again when it answers; dropped after %g s)", address,
                               error, self.give_up)
            self.failing.setdefault(address, time.monotonic())
            return None
        if self.failing.pop(address, None) is not None:
            logger.info("SuperNode %s answers again", address)
        self.answered.add(address)
        return response.token if response.HasField("task") and response.token else None

    def client_app(self, run, fab):
        """The FAB's ``ClientApp``: installed and loaded at its first task, kept for the later ones; a new FAB's
        package replaces the modules of the one before (a new version of an app has the same module names)."""
        if fab.hash_str not in self.apps:
            from flwr.cli.install import install_from_fab
            from flwr.clientapp.utils import get_load_client_app_fn
            from flwr.common.config import get_project_config, get_project_dir

            install_from_fab(fab.content, skip_prompt=True)
            folder = get_project_dir(run.fab_id, run.fab_version, fab.hash_str)
            reference = get_project_config(folder)["tool"]["flwr"]["app"]["components"]["clientapp"]
            _forget_modules(reference.split(":")[0].split(".")[0])
            self.apps.clear()
            load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
            self.apps[fab.hash_str] = load(run.fab_id, run.fab_version, fab.hash_str)
        return self.apps[fab.hash_str]

    def run_task(self, address: str, token: str) -> bool:
        """Run the task of ``token`` (of the SuperNode at ``address``) in this process; returns whether the
        ClientApp answered. Nothing a task does ends the runtime: a ClientApp that raises is answered with
        Flower's error reply, a task the SuperNode no longer knows (401) or a call that fails is logged."""
        from flwr.app import Message
        from flwr.app.error import Error
        from flwr.common.constant import ErrorCode, SubStatus
        from flwr.supercore.heartbeat import HeartbeatSender
        from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
        from flwr.supernode.runtime import run_clientapp

        client = _client(address, self.insecure, self.certificates,
                         [RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                          RuntimeTokenHttpInterceptor(token)], CALL_TIME)
        heartbeat = HeartbeatSender(_heartbeat(client))
        message = context = reply = None
        status, details, code = SubStatus.FAILED, "ClientApp task failed due to unknown reason", None
        heartbeat.start()
        try:
            message, context, run, fab = run_clientapp.pull_task_input(client)
            code = ErrorCode.LOAD_CLIENT_APP_EXCEPTION
            app = self.client_app(run, fab)
            code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
            reply = app(message=message, context=context)
            status, details = SubStatus.COMPLETED, ""
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # noqa: BLE001 - the task's failure is its reply (as flwr-clientapp's)
            logger.exception("task of SuperNode %s failed", address)
            details = f"{type(error)}:<'{error}'>"
            if message is not None and code is not None:
                reply = Message(Error(code=code, reason=details), reply_to=message)
        finally:
            steps = [("push the reply", lambda: reply is not None and context is not None
                      and run_clientapp.push_message(client, reply, context)),
                     ("stop the heartbeat", lambda: heartbeat.is_running and heartbeat.stop()),  # before the end
                     ("push the task's end", lambda: run_clientapp.push_task_output(
                         client=client, context=context, sub_status=status, details=details)),
                     ("close", client.close)]
            for what, step in steps:
                try:
                    step()
                except Exception as error:  # noqa: BLE001 - one failed step must not skip the next
                    logger.warning("task of SuperNode %s: could not %s: %s", address, what, error)
            self.tasks += 1
        return status == SubStatus.COMPLETED

    def serve(self, max_tasks: int | None = None) -> None:
        """Run the SuperNodes' tasks as they come, until ``max_tasks`` have run (``None``: until stopped); stops
        serving a SuperNode unreachable for ``give_up`` seconds, and ends when none is left (``SystemExit``)."""
        while max_tasks is None or self.tasks < max_tasks:
            ran = False
            for address in list(self.clients):
                token = self.acquire(address)
                if token is not None:
                    self.run_task(address, token)
                    ran = True
                elif address in self.failing and time.monotonic() - self.failing[address] > (
                        self.give_up if address in self.answered else max(self.give_up, STARTUP)):
                    logger.error("SuperNode %s unreachable or refusing for %g s: no longer served", address,
                                 self.give_up)
                    del self.clients[address], self.failing[address]
            if not self.clients:
                raise SystemExit("zo-byzantine-resident: no SuperNode left to serve.")
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
    parser.add_argument("--give-up", type=float, default=GIVE_UP,
                        help=f"seconds a SuperNode may stay unreachable before it is no longer served; the runtime "
                             f"ends when none is left (default {GIVE_UP:g})")
    args = parser.parse_args(argv)
    if args.insecure == (args.root_certificates is not None):
        parser.error("give exactly one of --insecure and --root-certificates")
    if not args.poll > 0:
        parser.error(f"--poll {args.poll}: expected seconds > 0")
    certificates = _read(args.root_certificates) if args.root_certificates else None
    secret = _read(args.superexec_auth_secret_file) if args.superexec_auth_secret_file else None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if secret is not None and not secret:
        parser.error(f"--superexec-auth-secret-file {args.superexec_auth_secret_file}: the file is empty")
    ResidentRuntime(args.runtime_api_address, args.insecure, certificates, secret, args.poll, args.give_up).serve()


if __name__ == "__main__":
    main()

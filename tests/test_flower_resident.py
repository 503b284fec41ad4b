"""The resident runtime's failure paths (``zo_byzantine.flower.resident``), without a SuperNode: nothing one task does
ends the runtime (a ClientApp that raises gets Flower's error reply; a reply the SuperNode refuses is logged and the
task still ends), a refused token is never turned into SIGINT, an unreachable SuperNode is dropped after its
allowance and the runtime ends with none left, and a new FAB's package replaces the modules of the one before.
(A real SuperNode runs it in tests/test_flower_deployment.py.)"""

import sys
import types

import pytest

flwr = pytest.importorskip("flwr")

import httpx  # noqa: E402  (Flower's HTTP client)
from flwr.app import Context, Message, RecordDict  # noqa: E402
from flwr.common.constant import ErrorCode, SubStatus  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402
from flwr.supernode.runtime import run_clientapp  # noqa: E402

from zo_byzantine.flower import apps, resident  # noqa: E402


@pytest.fixture
def runtime(monkeypatch):
    """A runtime for one (absent) SuperNode whose task calls are recorded instead of sent."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 5, 1
    message = Message(RecordDict(), dst_node_id=5, message_type="train")
    message.metadata.__dict__["_message_id"] = message.object_id
    context = Context(run_id=7, node_id=5, node_config={}, state=RecordDict(), run_config={})
    calls = {"pushed": [], "ended": []}
    monkeypatch.setattr(resident, "_heartbeat", lambda client: lambda: True)
    monkeypatch.setattr(run_clientapp, "pull_task_input", lambda client: (message, context, object(), object()))
    monkeypatch.setattr(run_clientapp, "push_message", lambda client, reply, ctx: calls["pushed"].append(reply))
    monkeypatch.setattr(run_clientapp, "push_task_output",
                        lambda client, context, sub_status, details: calls["ended"].append((sub_status, details)))
    made = resident.ResidentRuntime(["127.0.0.1:1"], poll=0.01)
    yield made, calls
    apps.keep_in_memory(False)


def _refused(status: int) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://127.0.0.1:1/v1/runtime/push-messages")
    return httpx.HTTPStatusError("refused", request=request, response=httpx.Response(status, request=request))


def test_a_clientapp_that_raises_is_answered_with_an_error_and_the_runtime_goes_on(runtime):
    made, calls = runtime

    def app(message, context):
        raise RuntimeError("the model does not fit")

    made.client_app = lambda run, fab: app
    assert made.run_task("127.0.0.1:1", "token") is False
    (reply,) = calls["pushed"]
    assert reply.has_error() and reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert "the model does not fit" in reply.error.reason
    assert calls["ended"] == [(SubStatus.FAILED, reply.error.reason)] and made.tasks == 1

    def fails_to_load(run, fab):
        raise ImportError("no module named zo_flower_app")

    made.client_app = fails_to_load
    assert made.run_task("127.0.0.1:1", "token") is False
    assert calls["pushed"][-1].error.code == ErrorCode.LOAD_CLIENT_APP_EXCEPTION and made.tasks == 2


def test_a_reply_the_supernode_refuses_is_logged_and_the_task_still_ends(runtime, monkeypatch, caplog):
    made, calls = runtime
    made.client_app = lambda run, fab: lambda message, context: Message(RecordDict(), reply_to=message)

    def refused(client, reply, context):
        raise _refused(401)  # the token expired: Flower's own invoker would SIGINT the process

    monkeypatch.setattr(run_clientapp, "push_message", refused)
    assert made.run_task("127.0.0.1:1", "token") is True
    assert calls["ended"] == [(SubStatus.COMPLETED, "")]
    assert any("could not push the reply" in r.getMessage() for r in caplog.records)


def test_the_runtimes_retries_give_up_a_refusal_at_once_and_retry_a_busy_supernode():
    attempts = []

    def call(status):
        attempts.append(status)
        raise _refused(status)

    for status in (401, 403, 404):
        with pytest.raises(httpx.HTTPStatusError):
            resident._retries(5.0).invoke(call, status)
    assert attempts == [401, 403, 404]  # once each: no SIGINT, no retry
    attempts.clear()
    with pytest.raises(httpx.HTTPStatusError):
        resident._retries(0.3).invoke(call, 503)
    assert len(attempts) > 1  # retried until max_time


def test_an_unreachable_supernode_is_dropped_and_the_runtime_ends_with_none_left(runtime, monkeypatch):
    made, _ = runtime
    monkeypatch.setattr(resident, "STARTUP", 0.0)
    made.give_up = 0.0
    with pytest.raises(SystemExit, match="no SuperNode left to serve"):
        made.serve()
    assert made.clients == {} and made.tasks == 0


def test_an_empty_secret_is_refused():
    with pytest.raises(ValueError, match="secret: the SuperExec auth secret is empty"):
        resident.ResidentRuntime(["127.0.0.1:1"], secret=b"")
    apps.keep_in_memory(False)


def test_a_new_fabs_package_replaces_the_modules_of_the_one_before(monkeypatch):
    for name in ("zo_fake_app", "zo_fake_app.client_app", "zo_fake_apple"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    resident._forget_modules("zo_fake_app")
    assert "zo_fake_app" not in sys.modules and "zo_fake_app.client_app" not in sys.modules
    assert "zo_fake_apple" in sys.modules  # another package with the same prefix stays

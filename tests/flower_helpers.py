"""In-process stand-ins for a Flower deployment: a grid that hands each message to a node's ClientApp (real Flower
``Message``/``Context`` objects, each node with its own persistent ``Context.state`` and its own store in a temporary
folder), and the example app's task."""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import weakref

import pytest

pytest.importorskip("flwr")

from flwr.app import Context, Error, Message, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE_APP = os.path.join(ROOT, "examples", "flower")
if EXAMPLE_APP not in sys.path:
    sys.path.insert(0, EXAMPLE_APP)  # the example app's package (zo_flower_app), as a SuperNode installs it

RUN_ID, SERVER_NODE = 1, 0


def run_config(**overrides) -> dict:
    """The tests' run config: the example's ``vectors`` task, 3 clients of 4 examples, CWTM with f = 1 (keys of the
    example app's run config only: ``flwr run --run-config`` refuses others)."""
    config = {
        "task": "zo_flower_app.task:vectors", "rounds": 3, "round-timeout": 30.0, "startup-timeout": 60.0,
        "min-nodes": 3, "output-dir": "", "num_clients": 3, "clients_per_round": 3, "num_byzantine": 1,
        "aggregator": "cwtm", "per_device_train_batch_size": 4, "num_perturbations": 2, "learning_rate": 0.05,
        "zo_seed": 7, "task-examples": 96,
    }
    config.update(overrides)
    return config


class LoopbackGrid:
    """A Flower grid over in-process nodes (``get_node_ids``, ``get_nodes``, ``push_messages``, ``pull_messages``,
    ``send_and_receive``), on a virtual clock: ``nodes`` maps node id -> node config.

    Pushing a message sets its id as Flower's grid does (its object id) and runs the node's ClientApp at once; the
    replies become available ``delays[node]`` seconds later (virtual: :meth:`sleep` advances :meth:`clock`; pass
    both to the ``Coordinator``). ``tamper(reply, message) -> list[Message]`` may replace each reply (a hostile
    node: every reply it returns is delivered when the message's id is pulled, whatever it answers); ``down``: node
    ids that are connected but never answer; ``keys``: node id -> the public key ``get_nodes`` reports (PEM).
    Every node's store (node config ``store-dir``, unless given) is under :attr:`store_root`, a temporary folder
    removed with the grid.
    """

    def __init__(self, config: dict, nodes: dict[int, dict], tamper=None, delays: dict[int, float] | None = None,
                 keys: dict[int, bytes] | None = None):
        from zo_byzantine.flower import client_app

        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = RUN_ID, SERVER_NODE, 1
        self.config, self.app, self.tamper = config, client_app(), tamper
        self.store_root = tempfile.mkdtemp(prefix="zo_flower_stores_")
        weakref.finalize(self, shutil.rmtree, self.store_root, True)
        self.nodes = dict(nodes)
        self.states = {node: RecordDict() for node in nodes}
        self.down: set[int] = set()
        self.delays = dict(delays or {})
        self.keys = dict(keys or {})
        self.sent: list[Message] = []
        self.now = 0.0
        self.queued: dict[str, tuple[float, list[Message]]] = {}  # message id -> (ready at, replies)

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(float(seconds), 0.0)

    def get_node_ids(self):
        return list(self.nodes)

    def get_nodes(self):
        from flwr.proto.node_pb2 import NodeInfo

        return [NodeInfo(node_id=n, public_key=self.keys.get(n, b"")) for n in self.nodes]

    def push_messages(self, messages):
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = message.object_id  # as Flower's grid does
            ids.append(message.metadata.message_id)
            self.sent.append(message)
            node = message.metadata.dst_node_id
            if node in self.down or node not in self.nodes:
                continue
            node_config = {"store-dir": self.store_root, **self.nodes[node]}
            context = Context(RUN_ID, node, node_config, self.states[node], self.config)
            try:
                reply = self.app(message, context)
            except Exception as err:  # as a SuperNode does: the ClientApp's exception becomes an error reply
                reply = Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=message)
            replies = self.tamper(reply, message) if self.tamper else [reply]
            self.queued[ids[-1]] = (self.now + self.delays.get(node, 0.0), replies)
        return ids

    def store(self, node: int):
        """Node ``node``'s store (as its ClientApp opens it)."""
        from zo_byzantine.flower.store import NodeStore

        return NodeStore.of({"store-dir": self.store_root, **self.nodes.get(node, {})}, node, RUN_ID)

    def pull_messages(self, message_ids):
        ready = [i for i in message_ids if i in self.queued and self.queued[i][0] <= self.now]
        return [reply for i in ready for reply in self.queued.pop(i)[1]]

    def send_and_receive(self, messages, *, timeout=None):
        """As Flower's: push, then wait until every reply is in, or ``timeout`` passes (virtual time)."""
        ids = self.push_messages(messages)
        times = [self.queued[i][0] if i in self.queued else math.inf for i in ids]
        last = max(times, default=self.now)
        self.now = min(last, self.now + timeout) if timeout is not None else last
        return self.pull_messages(ids)


def nodes(n: int, **extra) -> dict:
    """Node id 100 + c -> node config of client c (``extra``: client -> more node config)."""
    return {100 + c: {"partition-id": c, "num-partitions": n, **extra.get(str(c), {})} for c in range(n)}


def coordinator(config: dict, grid: LoopbackGrid | None = None):
    """The ServerApp's coordinator for ``config``; on ``grid``'s virtual clock if given."""
    from zo_byzantine.flower import Coordinator, read_run_config
    from zo_byzantine.flower.config import build_task

    deployment = read_run_config(config)
    timing = {"clock": grid.clock, "sleep": grid.sleep} if grid is not None else {}
    return Coordinator(deployment, build_task(deployment, config), **timing)


def node_weights(grid: LoopbackGrid, node: int) -> list:
    """The weights node ``node`` keeps in its store, after the rounds its ``Context.state`` says it has applied."""
    progress = grid.states[node]["zo_progress"]
    store = grid.store(node)
    (name,) = store.weight_files()
    assert name == store.weights_name(progress["start"], progress["applied"])
    from safetensors.torch import load_file

    from zo_byzantine.flower import read_run_config
    from zo_byzantine.flower.config import build_task

    kept = load_file(store.path(name))
    model = build_task(read_run_config(grid.config), grid.config).model
    return [kept[n] for n, p in model.named_parameters() if p.requires_grad]


def replayed_weights(config: dict, ledger, rounds: int) -> list:
    """The task's start weights with the first ``rounds`` rounds of ``ledger`` replayed."""
    from zo_byzantine import Ledger, replay
    from zo_byzantine.flower import read_run_config
    from zo_byzantine.flower.config import build_task
    from zo_byzantine.ledger import _digest, dumps

    data = {k: v for k, v in ledger.to_dict().items() if k != "digest"}
    data["rounds"] = data["rounds"][:rounds]
    data["digest"] = _digest(data)
    model = build_task(read_run_config(config), config).model
    replay(model, Ledger.loads(dumps(data)))
    return [p.detach() for p in model.parameters()]


# ----- a real deployment on loopback: SuperLink and SuperNodes as subprocesses ------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


class LocalDeployment:
    """``flower-superlink --insecure`` (or with TLS: ``certificates`` from :func:`make_certificates`) and SuperNodes
    on free loopback ports, in ``root``; every process in its own process group, stopped (TERM, then KILL) by
    :meth:`stop`. Use as a context manager."""

    def __init__(self, root, certificates: dict | None = None):
        import shutil

        self.root = str(root)
        self.home = os.path.join(self.root, "flwr_home")
        os.makedirs(self.home, exist_ok=True)
        self.port = free_port()
        self.certificates = certificates
        security = f'root-certificates = "{certificates["ca.crt"]}"' if certificates else "insecure = true"
        with open(os.path.join(self.home, "config.toml"), "w") as f:
            f.write(f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\naddress = "127.0.0.1:{self.port}"\n'
                    f"{security}\n")
        # Flower's executables next to the running interpreter, also for those the SuperLink and SuperNodes start by
        # name (flower-superexec): the tests pass with the venv's interpreter whether or not its bin is on PATH
        self.bin = os.path.dirname(sys.executable)
        self.env = {**os.environ, "FLWR_HOME": self.home, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                    "PATH": os.pathsep.join([self.bin, os.environ.get("PATH", "")])}
        self.processes: dict[str, object] = {}
        self.logs: dict[str, str] = {}
        self.runtime_ports: dict[str, int] = {}  # SuperNode -> its Runtime API port
        self.secret = os.path.join(self.home, "superexec.secret")  # the SuperNodes' and resident runtimes' secret
        with open(self.secret, "wb") as f:
            f.write(os.urandom(32))
        assert shutil.which("flower-superlink", path=self.bin), "flwr is not installed in this environment"

    def _start(self, name: str, argv: list[str]):
        import subprocess

        log = os.path.join(self.root, f"{name}.log")
        self.logs[name] = log
        with open(log, "wb") as out:
            self.processes[name] = subprocess.Popen([os.path.join(self.bin, argv[0]), *argv[1:]], cwd=self.root,
                                                    env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                                    start_new_session=True)

    def start_superlink(self, timeout: float = 60.0, supernode_auth: bool = False) -> None:
        """Start it and wait until it listens; ``supernode_auth``: only SuperNodes whose public key was registered
        (:meth:`register`) may connect (needs TLS)."""
        import socket
        import time

        c = self.certificates
        security = ["--ssl-ca-certfile", c["ca.crt"], "--ssl-certfile", c["server.pem"], "--ssl-keyfile",
                    c["server.key"]] if c else ["--insecure"]
        self._start("superlink", ["flower-superlink", *security, "--port", str(self.port),
                                  "--disable-runtime-dependency-installation",
                                  *(["--enable-supernode-auth"] if supernode_auth else [])])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.processes["superlink"].poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"the SuperLink did not start: {self.tail('superlink')}")

    def start_supernode(self, name: str, node_config: dict, private_key: str | None = None,
                        resident: bool | str = False, idle_poll: float | None = None) -> None:
        """Start SuperNode ``name``; its store (node config ``store-dir``, unless given) is under ``root``.
        ``resident``: the SuperNode in ``process`` isolation (no ClientApp process per message), authenticated to
        its runtime by the deployment's secret file; ``True`` also starts a resident runtime for it alone
        (process ``<name>-resident``), ``"shared"`` leaves it to :meth:`start_resident`. ``idle_poll``: started
        by ``zo-byzantine-supernode --idle-poll`` (Flower's waits capped) instead of ``flower-supernode``."""
        node_config = {"store-dir": os.path.join(self.root, "stores"), **node_config}
        config = " ".join(f"{k}={_toml_value(v)}" for k, v in node_config.items())
        security = ["--root-certificates", self.certificates["ca.crt"]] if self.certificates else ["--insecure"]
        key = ["--auth-supernode-private-key", private_key] if private_key else []
        self.runtime_ports[name] = free_port()
        isolation = ["--isolation", "process", "--superexec-auth-secret-file", self.secret] if resident else []
        launcher = ["python", "-m", "zo_byzantine.flower.supernode", "--idle-poll", str(idle_poll)] \
            if idle_poll is not None else ["flower-supernode"]
        self._start(name, [*launcher, *security, *key, "--superlink", f"127.0.0.1:{self.port}",
                           "--port", str(self.runtime_ports[name]), "--node-config", config, *isolation])
        if resident is True:
            self.start_resident(f"{name}-resident", [name])

    def start_resident(self, name: str, supernodes: list[str]) -> None:
        """Start ``zo-byzantine-resident`` as process ``name``, running the messages of ``supernodes`` (started
        with ``resident``)."""
        addresses = [a for node in supernodes for a in ("--runtime-api-address",
                                                        f"127.0.0.1:{self.runtime_ports[node]}")]
        self._start(name, ["python", "-m", "zo_byzantine.flower.resident", "--insecure", *addresses,
                           "--superexec-auth-secret-file", self.secret])

    def register(self, public_key: str):
        """``flwr supernode register <public_key> loopback``: the SuperLink then accepts that SuperNode."""
        import subprocess

        return subprocess.run([os.path.join(self.bin, "flwr"), "supernode", "register", public_key, "loopback"],
                              cwd=self.root, env=self.env, capture_output=True, text=True, timeout=60)

    def stop_process(self, name: str, grace: float = 10.0) -> None:
        import signal
        import subprocess

        process = self.processes.pop(name, None)
        if process is None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # children left in the group (SuperExec, ClientApp processes)
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _run_argv(self, app_dir: str, config: dict) -> list[str]:
        overrides = " ".join(f"{k}={_toml_value(v)}" for k, v in config.items())
        return [os.path.join(self.bin, "flwr"), "run", app_dir, "loopback", "--stream", "--run-config", overrides]

    def run(self, app_dir: str, config: dict, timeout: float):
        """``flwr run <app_dir> loopback --stream`` with ``config`` as run-config overrides; returns the
        CompletedProcess (raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds)."""
        import subprocess

        return subprocess.run(self._run_argv(app_dir, config), cwd=self.root, env=self.env, capture_output=True,
                              text=True, timeout=timeout, start_new_session=True)

    def start_run(self, app_dir: str, config: dict) -> None:
        """:meth:`run` in the background (process ``"run"``, stopped with the others)."""
        self._start("run", ["flwr", *self._run_argv(app_dir, config)[1:]])

    def tail(self, name: str, chars: int = 3000) -> str:
        with open(self.logs[name], errors="replace") as f:
            return f.read()[-chars:]

    def stop(self) -> None:
        for name in [n for n in self.processes if n != "superlink"] + ["superlink"]:
            self.stop_process(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


# ----- the reference: the same run in one process ---------------------------------------------------------------


def trainer_ledger(config: dict, output_dir, attack: str = "none"):
    """The ledger ``ZOByzantineTrainer`` writes for the run config ``config`` (the same checked arguments, task,
    model and data as the deployment), with ``attack`` (``name:key=value``) played by the first ``num_byzantine``
    clients; and the trained model."""
    from zo_byzantine import ZOByzantineTrainer, build_attack
    from zo_byzantine.aggregators import parse_step
    from zo_byzantine.flower import read_run_config
    from zo_byzantine.flower.config import build_task

    deployment = read_run_config(config, output_dir=str(output_dir))
    task = build_task(deployment, config)
    args = deployment.args
    args.save_strategy, args.disable_tqdm, args.logging_steps = "no", True, 1
    name, kwargs = parse_step(attack)
    trainer = ZOByzantineTrainer(model=task.model, args=args, train_dataset=task.train_dataset,
                                 data_collator=task.data_collator, attack=build_attack(name, **kwargs))
    trainer.train()
    return trainer.ledger, task.model


def scalar_tolerance(mu: float, loss_scale: float = 10.0) -> float:
    """How far a deployment's coefficient may be from the simulation's. A node evaluates its own examples in its own
    forward; the simulation evaluates all participants in one batched forward. Reductions may then be ordered
    differently, so a float32 loss may differ by a few ulps (eps32 * |L|, with |L| <= ``loss_scale``), and a
    two-point scalar ``(L+ - L-) / (2 mu)`` by ``8 eps32 |L| / (2 mu)``; a rule of such scalars by as much."""
    import torch

    return 8 * torch.finfo(torch.float32).eps * loss_scale / (2 * mu)


def weight_tolerance(config: dict, mu: float) -> float:
    """How far weights replayed from a deployment's ledger may be from the simulation's: each round moves them by
    ``lr sum_k c_k z_k``; with every coefficient within :func:`scalar_tolerance` and ``|z| <= 6`` (Gaussian), by
    at most ``rounds x lr x (K nu terms) x tolerance x 6``."""
    terms = config["num_perturbations"] * config.get("local_steps", 1)
    return config["rounds"] * config["learning_rate"] * terms * scalar_tolerance(mu) * 6


def assert_same_rounds(deployed: list[dict], reference: list[dict], mu: float) -> None:
    """Same rounds: seed tuples, participants, learning rate and skipping equal; coefficients within
    :func:`scalar_tolerance` (the honest ``loss`` is not compared: the simulation knows who is Byzantine)."""
    tolerance = scalar_tolerance(mu)
    assert len(deployed) == len(reference)
    for ours, theirs in zip(deployed, reference, strict=True):
        for key in ("round", "seeds", "participants", "lr", "skipped"):
            assert ours.get(key) == theirs.get(key), (key, ours, theirs)
        assert len(ours["coefficients"]) == len(theirs["coefficients"])
        for a, b in zip(ours["coefficients"], theirs["coefficients"], strict=True):
            assert abs(a - b) <= tolerance, (ours["round"], a, b, tolerance)


# ----- TLS and SuperNode authentication, made on loopback ---------------------------------------------------------


def make_certificates(directory) -> dict[str, str]:
    """A self-signed CA and a server certificate it signs for 127.0.0.1 / localhost (valid one day): paths of
    ``ca.crt``, ``server.pem``, ``server.key``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    paths = {name: os.path.join(str(directory), name) for name in ("ca.crt", "server.pem", "server.key")}

    def certificate(subject, issuer, key, signer, ca: bool, names=None):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "zo_byzantine test CA")])
    server_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    ca = certificate(ca_name, ca_name, ca_key, ca_key, True)
    server = certificate(server_name, ca_name, server_key, ca_key, False,
                         [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    with open(paths["ca.crt"], "wb") as f:
        f.write(ca.public_bytes(serialization.Encoding.PEM))
    with open(paths["server.pem"], "wb") as f:
        f.write(server.public_bytes(serialization.Encoding.PEM))
    with open(paths["server.key"], "wb") as f:
        f.write(server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))
    return paths


def make_node_keys(directory, name: str) -> tuple[str, str]:
    """An EC (P-384) key pair in OpenSSH formats for SuperNode authentication: (private, public) paths."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    private, public = os.path.join(str(directory), name), os.path.join(str(directory), f"{name}.pub")
    with open(private, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                  serialization.NoEncryption()))
    with open(public, "wb") as f:
        f.write(key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
    return private, public

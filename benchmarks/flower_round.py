"""Seconds per round of a real Flower deployment on loopback, with where they go (#43), beside the simulation's round
(``ZOByzantineTrainer`` in one process) for the same run config.

One command starts a SuperLink and N SuperNodes on 127.0.0.1 (free ports; each in its own process group, stopped
by its pid at the end, also on failure or Ctrl-C), runs the example app (``examples/flower``) for R rounds with
``flwr run``, and reads back the server's rounds log (``flower_rounds.jsonl``: each round's start, its wait for
replies, its aggregation) and every node's ``timings.jsonl`` (written with ``ZO_FLOWER_TIMINGS=1``: its ClientApp
process's start and the wall-clock time of each step). Per round (median over rounds 1..R-1; round 0 also
registers the nodes), the nodes' means:

    dispatch          server push -> the node's ClientApp process started (SuperLink, SuperNode, SuperExec); with
                      --resident: -> the plan's handler entered in the node's resident runtime
    process+imports   process start -> the node's modules imported (Python, Flower, torch, zo_byzantine, the app);
                      with --resident, imported once per node: ~0
    model load        settings from the store + the task's model and data (``task`` of the run config)
    catch-up          the replica's weights from the store, the plan's ledger rounds applied, the store written
    compute           the round's batch and the client's perturbed forwards (the simulation's client role)
    reply+pull        last node's compute done -> the server has every reply (push, SuperLink, the server's poll)
    aggregation       validation, robust aggregation, ledger write, the server's replica
Also: the bytes SuperNode and ClientApp exchange per plan (plan, reply, Context), the memory of each SuperNode's
process group (idle: SuperNode and SuperExec; peak: with its ClientApp; with --resident: SuperNode and its
resident runtime), the server's CPU seconds per round.

    python benchmarks/flower_round.py --nodes 4                     # vectors task, 20 rounds
    python benchmarks/flower_round.py --nodes 4,16,64 --rounds 20
    python benchmarks/flower_round.py --task text --nodes 4 --rounds 10   # all-MiniLM-L6-v2, head only, SST-2
    python benchmarks/flower_round.py --nodes 4 --resident per-node   # zo-byzantine-resident beside each SuperNode
    python benchmarks/flower_round.py --nodes 64 --resident shared    # one zo-byzantine-resident for all of them
    python benchmarks/flower_round.py --task text --model smollm2-135m --nodes 4 --resident per-node

Runs with the repository's venv (``source .venv/bin/activate``; the Flower executables are taken from beside the
running interpreter). Refuses an N whose estimated memory does not fit in what the machine has available.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples", "flower")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from flower_helpers import EXAMPLE_APP, LocalDeployment  # noqa: E402

SST2 = os.path.join(ROOT, "..", "shared", "data", "sst2", "train.tsv")
PAGE = os.sysconf("SC_PAGE_SIZE")
TICKS = os.sysconf("SC_CLK_TCK")
STEPS = ("dispatch", "process+imports", "model load", "catch-up", "compute", "reply+pull", "aggregation")


def run_config(task: str, nodes: int, rounds: int, out: str, per_client: int, model: str = "") -> dict:
    """The example app's run config (its keys only) for ``nodes`` clients of ``per_client`` examples each."""
    config = {
        "rounds": rounds, "round-timeout": 900.0, "startup-timeout": 900.0, "min-nodes": nodes, "output-dir": out,
        "eval-every": 0, "num_clients": nodes, "clients_per_round": nodes, "num_byzantine": 1, "aggregator": "cwtm",
        "per_device_train_batch_size": 8, "num_perturbations": 4, "learning_rate": 0.05, "zo_seed": 0,
        "task-examples": per_client * nodes, "task-eval-examples": 0,
    }
    if task == "vectors":
        config.update({"task": "zo_flower_app.task:vectors", "task-dim": 8})
    else:
        config.update({"task": "zo_flower_app.task:text", "task-data": os.path.abspath(SST2), "task-model": model,
                       "task-head-only": True, "task-max-length": 64})
        if model:  # a causal LM scoring SST-2's label words with its own head, every weight trained
            config.update({"task-head": "prompt", "per_device_train_batch_size": 4, "num_perturbations": 1,
                           "learning_rate": 1e-5, "zo_eps": 1e-3})
    return config


def simulation_round(config: dict, folder: str) -> float:
    """Seconds per round of ``ZOByzantineTrainer.train()`` on the same run config (one process)."""
    from zo_byzantine import ZOByzantineTrainer
    from zo_byzantine.flower import read_run_config
    from zo_byzantine.flower.config import build_task

    deployment = read_run_config(config, output_dir=folder)
    task = build_task(deployment, config)
    args = deployment.args
    args.save_strategy, args.disable_tqdm, args.logging_steps = "no", True, deployment.rounds
    trainer = ZOByzantineTrainer(model=task.model, args=args, train_dataset=task.train_dataset,
                                 data_collator=task.data_collator)
    start = time.perf_counter()
    trainer.train()
    return (time.perf_counter() - start) / deployment.rounds


# ----- processes: memory and CPU of each process group ----------------------------------------------------------


def group_usage() -> dict[int, tuple[int, float]]:
    """Process group id -> (resident bytes, CPU seconds) summed over its live processes."""
    usage: dict[int, list] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/statm") as f:
                rss = int(f.read().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            continue
        group = int(fields[2])
        cpu = (int(fields[11]) + int(fields[12])) / TICKS
        entry = usage.setdefault(group, [0, 0.0])
        entry[0] += rss
        entry[1] += cpu
    return {g: (r, c) for g, (r, c) in usage.items()}


class Sampler(threading.Thread):
    """Every ``every`` seconds: each SuperNode's memory (its process groups summed; min and max seen)."""

    def __init__(self, groups: dict[str, list[int]], every: float = 1.0):
        super().__init__(daemon=True)
        self.groups, self.every = groups, every
        self.low: dict[str, int] = {}
        self.high: dict[str, int] = {}
        self.stopped = threading.Event()
        self.counting = threading.Event()  # set once the nodes have registered (their start is not counted)
        self.total = 0  # the most memory every SuperNode group held at once

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            if not self.counting.is_set():
                continue
            usage = group_usage()
            self.total = max(self.total, sum(usage[g][0] for gs in self.groups.values() for g in gs if g in usage))
            for name, groups in self.groups.items():
                if any(g in usage for g in groups):
                    rss = sum(usage[g][0] for g in groups if g in usage)
                    self.low[name] = min(self.low.get(name, rss), rss)
                    self.high[name] = max(self.high.get(name, 0), rss)


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", 0)


# ----- one deployment ----------------------------------------------------------------------------------------------


def read_timings(stores: str) -> list[dict]:
    lines = []
    for folder, _, files in os.walk(stores):
        if "timings.jsonl" in files:
            with open(os.path.join(folder, "timings.jsonl")) as f:
                lines += [json.loads(line) for line in f if line.strip()]
    return lines


def breakdown(rounds_log: list[dict], timings: list[dict]) -> dict:
    """Median over rounds 1.. of each step's per-round mean over nodes (see the module docstring)."""
    per_round: dict[str, list[float]] = {step: [] for step in (*STEPS, "round")}
    for entry in rounds_log[1:]:
        marks = [m for m in timings if m["round"] == entry["round"] and "computed" in m and m.get("process")]
        per_round["round"].append(entry["seconds"])
        if not marks or "timing" not in entry:  # a version without the nodes' timings: the round's seconds only
            continue
        started = entry["timing"]["started"]
        mean = statistics.fmean
        entered = [m["process"] if m["process"] > started else m["started"] for m in marks]  # resident: the handler
        values = {
            "dispatch": mean(e - started for e in entered),
            "process+imports": mean(m["imported"] - e for m, e in zip(marks, entered, strict=True)),
            "model load": mean(m["task_built"] - m["imported"] for m in marks),
            "catch-up": mean(m["caught_up"] - m["task_built"] for m in marks),
            "compute": mean(m["computed"] - m["caught_up"] for m in marks),
            "reply+pull": started + entry["timing"]["replies"] - max(m["computed"] for m in marks),
            "aggregation": entry["timing"]["aggregate"],
        }
        for step, value in values.items():
            per_round[step].append(value)
    return {step: statistics.median(v) if v else None for step, v in per_round.items()}


def deploy(task: str, nodes: int, rounds: int, root: str, timeout: float, per_client: int,
           poll: float | None = None, resident: str = "none", model: str = "", idle_poll: float | None = None) -> dict:
    out = os.path.join(root, "server_out")
    config = run_config(task, nodes, rounds, out, per_client, model)
    result = {"task": task + (f" ({model})" if model else ""), "nodes": nodes, "rounds": rounds,
              "superexec_poll_s": poll, "resident": resident, "idle_poll_s": idle_poll}
    result["simulation_round_s"] = simulation_round(config, os.path.join(root, "simulation"))
    begin = time.monotonic()
    with LocalDeployment(root) as deployment:
        deployment.env["ZO_FLOWER_TIMINGS"] = "1"
        if poll is not None:  # Flower's SuperExec: seconds between its polls for a message to run (default 1)
            deployment.env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = str(poll)
        deployment.start_superlink()
        for i in range(nodes):
            deployment.start_supernode(f"node{i}", {"partition-id": i, "num-partitions": nodes},
                                       resident={"none": False, "per-node": True, "shared": "shared"}[resident],
                                       idle_poll=idle_poll)
        if resident == "shared":
            deployment.start_resident("resident", [f"node{i}" for i in range(nodes)])
        groups = {name: process.pid for name, process in deployment.processes.items()}
        watched = {f"node{i}": [groups[f"node{i}"], *([groups[f"node{i}-resident"]] if resident == "per-node" else [])]
                   for i in range(nodes)}
        if resident == "shared":
            watched["resident"] = [groups["resident"]]
        sampler = Sampler(watched)
        sampler.start()
        server_cpu = group_usage().get(groups["superlink"], (0, 0.0))[1]
        deployment.start_run(EXAMPLE_APP, config)
        deadline = time.monotonic() + timeout
        log: list[dict] = []
        while time.monotonic() < deadline:
            log = read_log(out)
            if log:
                sampler.counting.set()
            if len(log) >= rounds or deployment.processes["run"].poll() is not None:
                break
            time.sleep(1.0)
        time.sleep(1.0)
        log = read_log(out)
        server_cpu = group_usage().get(groups["superlink"], (0, 0.0))[1] - server_cpu
        sampler.stopped.set()
        sampler.join()
        if len(log) < rounds:
            result["error"] = (f"{len(log)} of {rounds} rounds in {timeout:.0f} s; run: {deployment.tail('run', 1500)};"
                               f" superlink: {deployment.tail('superlink', 1500)}")
    result["wall_s"] = time.monotonic() - begin
    result["rounds_done"] = len(log)
    timings = read_timings(os.path.join(root, "stores"))
    result["breakdown_s"] = breakdown(log, timings)
    result["first_round_s"] = log[0]["seconds"] if log else None
    result["rounds_accepted"] = sum(len(e["accepted"]) == nodes for e in log)
    result["server_cpu_per_round_s"] = server_cpu / max(len(log), 1)
    steady = [m for m in timings if m["round"] > 0]
    for key in ("plan_bytes", "reply_bytes", "context_bytes"):
        values = [m[key] for m in steady if key in m]
        result[key] = statistics.median(values) if values else None
    mib = 2**20
    shared = sampler.high.pop("resident", None), sampler.low.pop("resident", None)
    result["supernode_idle_mib"] = statistics.median(sampler.low.values()) / mib if sampler.low else None
    result["supernode_peak_mib"] = statistics.median(sampler.high.values()) / mib if sampler.high else None
    result["shared_resident_peak_mib"] = shared[0] / mib if shared[0] is not None else None
    result["all_supernodes_peak_gib"] = sampler.total / 2**30
    return result


def read_log(out: str) -> list[dict]:
    from zo_byzantine.flower import read_rounds_log

    return read_rounds_log(out)


def show(result: dict) -> None:
    b = result["breakdown_s"]
    steps = "  ".join(f"{step} {b[step]:.2f}" if b.get(step) is not None else f"{step} -" for step in STEPS)
    rnd = b.get("round")
    poll = result["superexec_poll_s"]
    runtime = f"resident runtime: {result['resident']}" if result["resident"] != "none" else \
        f"SuperExec poll {'1 s, Flower default' if poll is None else f'{poll:g} s'}"
    if result.get("idle_poll_s") is not None:
        runtime += f"; SuperNode waits capped at {result['idle_poll_s']:g} s"
    print(f"\n{result['task']}, {result['nodes']} nodes, {result['rounds_done']}/{result['rounds']} rounds "
          f"({runtime}) "
          f"({result['rounds_accepted']} with every node accepted), wall {result['wall_s']:.0f} s")
    print(f"  seconds per round (median of rounds 1..): {rnd if rnd is None else round(rnd, 2)}   first round "
          f"{result['first_round_s']}   simulation's round {result['simulation_round_s']:.4f}")
    print(f"  per node and round (means): {steps}")
    print(f"  bytes SuperNode<->ClientApp per plan: plan {result['plan_bytes']}, reply {result['reply_bytes']}, "
          f"Context {result['context_bytes']} (each way)")
    idle, peak = result["supernode_idle_mib"], result["supernode_peak_mib"]
    print(f"  memory per SuperNode (after registration; its process group): idle {idle and round(idle)} MiB, peak "
          f"{peak and round(peak)} MiB (medians over nodes); all SuperNodes at once, peak "
          f"{result['all_supernodes_peak_gib']:.1f} GiB; server CPU per round {result['server_cpu_per_round_s']:.2f} s")
    if result.get("shared_resident_peak_mib") is not None:
        print(f"  the shared resident runtime (counted in 'all'): peak {result['shared_resident_peak_mib']:.0f} MiB")
    if "error" in result:
        print(f"  ERROR: {result['error']}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=("vectors", "text"), default="vectors")
    parser.add_argument("--nodes", default="4", help="comma-separated SuperNode counts, e.g. 4,16,64 (default 4)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--examples-per-client", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per deployment, at most")
    parser.add_argument("--node-mib", type=float, default=450.0,
                        help="memory one SuperNode needs at its peak (SuperNode + SuperExec + a ClientApp), to refuse "
                             "an N that does not fit (default 450)")
    parser.add_argument("--superexec-poll", type=float, default=None,
                        help="FLWR_SUPEREXEC_TASK_POLL_INTERVAL for the SuperNodes' SuperExec (Flower's default: 1 s)")
    parser.add_argument("--model", default="",
                        help="--task text: a causal LM (a folder, or smollm2-135m) scoring SST-2's label words with "
                             "its own head, every weight trained (default: all-MiniLM-L6-v2's classification head)")
    parser.add_argument("--resident", choices=("none", "per-node", "shared"), default="none",
                        help="SuperNodes in process isolation with zo-byzantine-resident running their messages (one "
                             "per SuperNode, or one shared by all) instead of a ClientApp process per message")
    parser.add_argument("--idle-poll", type=float, default=None,
                        help="start the SuperNodes with zo-byzantine-supernode --idle-poll S (Flower's fixed 3 s and "
                             "0.5 s waits capped at S) instead of flower-supernode")
    parser.add_argument("--keep", default="", help="a folder to keep the deployments' files in (default: removed)")
    parser.add_argument("--json", default="", help="write the results to this file too")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.nodes.split(",") if n.strip()]
    if not counts or min(counts) < 2:
        parser.error(f"--nodes {args.nodes!r}: expected comma-separated counts >= 2 (CWTM with one Byzantine node)")
    if args.rounds < 2:
        parser.error(f"--rounds {args.rounds}: expected >= 2 (round 0 also registers the nodes)")
    if args.model and args.task != "text":
        parser.error(f"--model {args.model!r} is for --task text")
    if args.task == "text" and not os.path.isfile(SST2):
        parser.error(f"--task text reads SST-2 from {os.path.abspath(SST2)}, which is missing")
    results = []
    for n in counts:
        need = n * args.node_mib * 2**20
        if need > available_bytes():
            print(f"\n{n} nodes: refused, about {need / 2**30:.1f} GiB needed ({args.node_mib:.0f} MiB per node), "
                  f"{available_bytes() / 2**30:.1f} GiB available")
            results.append({"task": args.task, "nodes": n, "refused": "memory"})
            continue
        root = tempfile.mkdtemp(prefix=f"flower_round_{args.task}_{n}_", dir=args.keep or None)
        try:
            result = deploy(args.task, n, args.rounds, root, args.timeout, args.examples_per_client,
                            args.superexec_poll, args.resident, args.model, args.idle_poll)
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
        show(result)
        results.append(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

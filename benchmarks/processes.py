"""Time per round with the clients spread over 1 and 2 processes, at a fixed total of work per round.

    python benchmarks/processes.py            # spawns torch.distributed.run itself (CPU, gloo)

Each process evaluates its share of the n clients (shared perturbation), the per-client vectors are
gathered, every process applies the same update. On CPU the processes share the machine's cores, so
each process gets ``cores / processes`` threads; on GPUs each process has its own device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(out: str, rounds: int):
    import logging

    import torch
    from _common import RandomTokens, minilm

    from zo_byzantine import ZOByzantineArguments, ZOByzantineTrainer

    logging.disable(logging.WARNING)
    model, _ = minilm()

    args = ZOByzantineArguments(output_dir=out, num_clients=12, per_device_train_batch_size=4, max_steps=rounds,
                                report_to=[], save_strategy="no", disable_tqdm=True, learning_rate=1e-7,
                                remove_unused_columns=False, use_cpu=True, logging_steps=rounds)
    trainer = ZOByzantineTrainer(model=model, args=args, train_dataset=RandomTokens(480, 64, model.config.vocab_size))
    start = time.perf_counter()
    trainer.train()
    seconds = (time.perf_counter() - start) / rounds
    weights = float(sum(p.double().sum() for p in model.parameters()))
    with open(os.path.join(out, f"rank{args.process_index}.json"), "w") as f:
        json.dump({"seconds_per_round": seconds, "world": args.world_size, "checksum": weights}, f)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]))
        return
    rounds, cores = 6, os.cpu_count() or 1
    print(f"# n = 12 clients x 4 examples, 64 tokens, all-MiniLM-L6-v2, nu = 1, {rounds} rounds, {cores} cores")
    print("| processes | threads each | time per round (s) | weights equal across processes |\n|---|---|---|---|")
    for processes in (1, 2):
        with tempfile.TemporaryDirectory() as out:
            threads = max(1, cores // processes)
            env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": HERE}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
                   __file__, "--worker", out, str(rounds)]
            subprocess.run(cmd, check=True, capture_output=True, env=env)
            ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(processes)]
            same = len({r["checksum"] for r in ranks}) == 1
            seconds = max(r["seconds_per_round"] for r in ranks)
            print(f"| {processes} | {threads} | {seconds:.3f} | {same} |", flush=True)


if __name__ == "__main__":
    main()

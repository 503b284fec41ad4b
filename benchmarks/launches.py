"""Operations (each a kernel launch on an accelerator) of a FedES round's direction draws on the plain-torch path
(the path of every device but a CPU with the compiled kernel): one direction at a time against drawn together.

    python benchmarks/launches.py            # FedES's 784-1024-1024-10 MLP (experiments/fedes/), 10 clients, n_B = 256
    python benchmarks/launches.py --nu 94    # n_B = 64

Per trainable tensor a FedES round draws each client's nu directions for its stacked forward, then the update's
sum over all m nu directions. "One at a time" is the code before :meth:`Directions.stacked_draws`: ``draw`` per
seed, a sum's directions one by one, chunks of 2^19 pairs; "together": :func:`counter_streams` over all seeds of a
tensor in chunks of 2^21 pairs (``GPU_CHUNK_PAIRS``). Operations are counted on the ``meta`` device (the same
calls, no arithmetic). On a lent H100 the draws were launch-bound: about 1.3 ms per ``draw``, 2,880 draws and ~3.9 s
per round at n_B = 256 (experiments/fedes/NOTES.md). ``--time_clients N`` also times the draws of N clients both ways,
interleaved, on ``--device`` (``cuda`` on a GPU; on ``cpu`` the plain path, not the CPU's own compiled kernel).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from _common import interleaved, machine
from torch.utils._python_dispatch import TorchDispatchMode

from zo_byzantine import counter, directions, native
from zo_byzantine.directions import CounterDirections, direction_seed

SHAPES = [(1024, 784), (1024,), (1024, 1024), (1024,), (10, 1024), (10,)]


class CountOperations(TorchDispatchMode):
    """Counts the ATen operations run inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def one_at_a_time():
    """The code before directions were drawn together: 2^19-pair chunks on every device, sums term by term."""
    saved = counter.GPU_CHUNK_PAIRS, directions.BLOCK_VALUES
    counter.GPU_CHUNK_PAIRS, directions.BLOCK_VALUES = counter.CHUNK_PAIRS, 1
    try:
        yield
    finally:
        counter.GPU_CHUNK_PAIRS, directions.BLOCK_VALUES = saved


@contextlib.contextmanager
def native_off():
    """The plain-torch path on the CPU too (the compiled kernel is the CPU's own path, not the one measured)."""
    saved = native.library
    native.library = lambda: None
    try:
        yield
    finally:
        native.library = saved


def draws_of_a_round(likes: list[torch.Tensor], clients: int, nu: int, together: bool) -> None:
    gen = CounterDirections()
    for j, like in enumerate(likes):
        for i in range(clients):
            seeds = [direction_seed(0, 0, 1, r, i) for r in range(nu)]
            if together:
                gen.stacked_draws(like, j, seeds, {})
            else:
                torch.stack([gen.total(like, j, [(seed, 1.0)], {}) for seed in seeds])
        gen.total(like, j, [(direction_seed(0, 0, 1, r, i), 1e-3) for i in range(clients) for r in range(nu)])


def operations(clients: int, nu: int, together: bool) -> int:
    likes = [torch.empty(shape, device="meta") for shape in SHAPES]
    with contextlib.nullcontext() if together else one_at_a_time(), CountOperations() as counter:
        draws_of_a_round(likes, clients, nu, together)
    return counter.count


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--nu", type=int, default=24, help="directions per client (ceil(6000 / n_B))")
    parser.add_argument("--time_clients", type=int, default=0, help="also time the draws of this many clients")
    parser.add_argument("--device", default="cpu", help="where --time_clients times them (cpu: the plain path)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    before, after = (operations(args.clients, args.nu, together) for together in (False, True))
    print(f"FedES round, {args.clients} clients x {args.nu} directions, MLP 784-1024-1024-10 (plain-torch path):")
    print(f"  operations, one at a time: {before:,}")
    print(f"  operations, drawn together: {after:,}   ratio {before / after:.1f}x fewer")
    if args.time_clients:
        device = torch.device(args.device)
        likes = [torch.empty(shape, device=device) for shape in SHAPES]
        synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

        def timed(together):
            def run():
                with contextlib.nullcontext() if together else one_at_a_time(), native_off():
                    draws_of_a_round(likes, args.time_clients, args.nu, together)
                synchronize()
            return run

        with torch.no_grad():
            times = interleaved({"one at a time": timed(False), "together": timed(True)}, args.repeats,
                                reference="one at a time")
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU plain path, {machine()}"
        print(f"  {args.time_clients} clients on {where}: one at a time {times['one at a time'][0]:.3f} s, "
              f"together {times['together'][0]:.3f} s (median ratio together / one at a time "
              f"{times['together'][1]:.2f})")


if __name__ == "__main__":
    main()

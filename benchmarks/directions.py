"""Cost of drawing a direction: the counter generator against ``torch.randn``, per element, in one run.

    python benchmarks/directions.py              # 22.7M elements (all-MiniLM-L6-v2's d), best of 7, interleaved

Rows (float32, CPU, torch's thread count): ``torch.randn`` into a preallocated tensor (MT19937 + Box-Muller,
the ``torch`` generator's draw); the counter stream by the compiled kernel and by its plain-torch path; and
the fused sum a perturbed forward needs, ``p + c z``, against the ``torch`` generator's ``randn`` then
``p + c z`` in two more passes; a bfloat16 update rounded stochastically by the kernel in one pass, against the
float32 update then ``rounding.py``'s plain-torch rounding. Ratios are ``torch.randn``'s time over each row's.
"""

from __future__ import annotations

import argparse

import torch
from _common import interleaved, machine

from zo_byzantine import native
from zo_byzantine.counter import counter_stream
from zo_byzantine.directions import CounterDirections, TorchDirections, tensor_seed
from zo_byzantine.perturbation import _exact_update
from zo_byzantine.rounding import stochastic_round_


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=22_713_216)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    n, key = args.numel, tensor_seed(12345, 0)
    if native.library() is None:
        raise SystemExit("The compiled kernel could not be built here (see the warning above).")
    buffer, param = torch.empty(n), torch.randn(n)
    weights = param.to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    counter, legacy = CounterDirections(), TorchDirections()
    rows = {
        "torch.randn (the torch generator's draw)": lambda: torch.randn(n, generator=generator, out=buffer),
        "counter, compiled kernel": lambda: native.generate(buffer, key, True),
        "counter, rademacher, compiled kernel": lambda: native.generate(buffer, key, False),
        "counter, plain torch (fallback)": lambda: counter_stream(key, n, "gaussian"),
        "p + c z, counter fused into a new tensor (one pass; as in a forward)":
            lambda: counter.perturb(param, 0, [(12345, 1e-3)]),
        "p + c z, counter fused in place (the update's pass)": lambda: counter.step_(buffer, 0, [(12345, 1e-3)], 1.0),
        "p + c z, torch generator (randn, scale, add)": lambda: legacy.perturb(param, 0, [(12345, 1e-3)]),
        "bf16 weights, update rounded stochastically: compiled, one pass":
            lambda: counter.step_rounded_(weights, 0, [(12345, 1e-3)], 1e-6, 0.0, key),
        "bf16 weights, update rounded stochastically: float32 update, then rounding.py (the path before)":
            lambda: stochastic_round_(weights, _exact_update(counter, weights, 0, [(12345, 1e-3)], 1e-6, 0.0, None),
                                      key),
    }
    times = interleaved(rows, args.repeats)
    randn = times["torch.randn (the torch generator's draw)"]
    print(f"# direction draws: {n / 1e6:.1f}M float32 elements; {machine()}; best of {args.repeats}")
    print("| what | ns per element | torch.randn time / this time |\n|---|---|---|")
    for name, seconds in times.items():
        print(f"| {name} | {seconds / n * 1e9:.2f} | {randn / seconds:.2f} |")


if __name__ == "__main__":
    main()

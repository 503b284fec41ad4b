"""How much room ALIE has against CWTM on SmolLM2 (issue 49): its shift ``||R - hbar||`` beside ``||hbar||``.

In a round every client reports one scalar per direction, ``g_i = z . grad L_i`` over its own batch of B examples.
ALIE sends ``hbar + omega sigma`` (``sigma`` the honest reports' spread) and CWTM's output stays inside the honest
range, so the shift ``||R - hbar||`` is bounded by ``sigma``. If the clients differed only by sampling, ``sigma``
would fall as ``1 / sqrt(B)``; a label-skewed split leaves a floor. This runs the table's ``cpu_long`` ALIE cell for
a few rounds from the pretrained weights at each B (default 2: the CPU configuration, 8, and 32: DeComFL's), the
same seeds (the same directions), no evaluation, optionally on an iid split or with NNM before CWTM, and prints the
means over the rounds of the logged ``aggregate_shift`` and ``honest_mean_norm`` and their ratio.

    python experiments/smollm2/room.py                         # ~30 minutes on the 2-core CPU (B = 32: ~15)
    python experiments/smollm2/room.py --batches 8 --partition iid
    python experiments/smollm2/room.py --batches 8 --nnm
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess

from table import HERE, command


def room(folder: str) -> dict[str, float]:
    """Means over a finished run's logged rounds of the aggregate's shift and of the honest mean's norm."""
    with open(os.path.join(folder, "trainer_state.json")) as f:
        logged = [e for e in json.load(f)["log_history"] if "aggregate_shift" in e]
    if not logged:
        raise RuntimeError(f"{folder}: no round logged aggregate_shift")
    shift = statistics.fmean(e["aggregate_shift"] for e in logged)
    signal = statistics.fmean(e["honest_mean_norm"] for e in logged)
    return {"rounds": len(logged), "shift": shift, "signal": signal, "ratio": shift / signal}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[2, 8, 32], help="examples per client and round")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="smollm2-135m", help="a shipped model name or a model folder")
    parser.add_argument("--partition", choices=["dirichlet", "iid"], default="dirichlet",
                        help="the clients' split: the table's Dirichlet(1) label skew, or iid")
    parser.add_argument("--nnm", action="store_true", help="NNM before CWTM (the attack is tuned against both)")
    parser.add_argument("--out", default=os.path.join(HERE, "runs", "room"))
    args = parser.parse_args(argv)
    if args.rounds < 1 or any(b < 1 for b in args.batches):
        parser.error(f"--rounds={args.rounds} and --batches={args.batches} must be >= 1")
    print(f"partition {args.partition}, rule {'NNM + ' if args.nnm else ''}CWTM, ALIE tuned against it")
    lines = ["| examples per client B | rounds | mean ‖R - hbar‖ | mean ‖hbar‖ | ratio |", "|---|---|---|---|---|"]
    for batch in args.batches:
        variant = ("" if args.partition == "dirichlet" else f"_{args.partition}") + ("_nnm" if args.nnm else "")
        folder = os.path.join(args.out, f"sst2_alie_b{batch}{variant}_s{args.seed}")
        extra = ("--per_device_train_batch_size", str(batch), "--max_steps", str(args.rounds), "--logging_steps",
                 "1", "--do_eval", "false", "--save_strategy", "no", "--partition", args.partition,
                 *(("--pre_aggregators", "nnm") if args.nnm else ()))
        line = command("cpu_long", "sst2", "alie", args.seed, folder, args.model, extra)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "run.log"), "w") as log:
            code = subprocess.call(line, stdout=log, stderr=subprocess.STDOUT)
        if code != 0:
            raise SystemExit(f"B = {batch}: exit {code}; see {folder}/run.log")
        r = room(folder)
        lines.append(f"| {batch} | {r['rounds']} | {r['shift']:.2f} | {r['signal']:.2f} | {r['ratio']:.2f} |")
        print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

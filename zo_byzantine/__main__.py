"""``python -m zo_byzantine {inspect,replay,plot} RUN_DIR``: read a run's ledger (the logic is in ``runs.py``)."""

from __future__ import annotations

import argparse
import sys

from .ledger import LedgerError

DESCRIPTION = """\
Inspect, replay or plot a zo_byzantine run.

RUN_DIR is a run's output directory (or one of its checkpoints) holding zo_ledger.json, which the
trainer writes at save_model and at the end of train(); trainer_state.json beside it (the trainer
writes it at the end of train(), trainer.save_state() again after a final evaluation; else the last
checkpoint's is read) adds the evaluation accuracy, the aggregate shift and the communication
figures. RUN_DIR may also be the ledger file itself.

Every subcommand checks the ledger first (size, schema, SHA-256 digest; with --key or --key-file its
HMAC) and exits with status 1 and the reason when it fails a check; status 2 is a usage error."""

EPILOG = """\
examples:
  python -m zo_byzantine inspect out/
  python -m zo_byzantine inspect out/ --rounds
  python -m zo_byzantine replay out/ --model start_model/ --out trained.safetensors
  python -m zo_byzantine replay out/ --model-factory my_models:build --start start.pt --out trained.safetensors
  python -m zo_byzantine plot out/ --out run.png"""

REPLAY_DESCRIPTION = """\
Rebuild the trained weights from the starting model and the ledger, bitwise, and write the trainable
ones (the tensors the run trained, by name) to a safetensors file.

The starting model, whose trainable weights must be those the run started from (the ledger's
fingerprint of them is checked: other weights, dtypes or shapes are refused), is given as one of:

  --model DIR
      a folder written by save_pretrained from the starting model (e.g. model.save_pretrained("start")
      before trainer.train()): the class named in its config.json "architectures" (else AutoModel),
      loaded with from_pretrained(DIR), local files only, in the saved dtype (see --dtype).
  --model DIR --start FILE
      the architecture from DIR (any save_pretrained folder of the same model, such as the run's
      output directory), the starting weights from FILE.
  --model-factory MODULE:CALLABLE [--start FILE]
      CALLABLE() builds the model: for plain torch modules or custom code. MODULE is imported from the
      current directory or PYTHONPATH; FILE.py:CALLABLE loads a file instead. Without --start, the
      factory must itself produce the starting weights (a seeded initialisation).

FILE is a .safetensors file or a torch.save'd state dict (read with weights_only=True), e.g. written
by torch.save(model.state_dict(), "start.pt") before training; it must hold every trainable parameter
the ledger names (other entries of the model may be left out: they keep the built model's values).
The parameters the ledger names are made trainable and all others frozen, as in the run. Replay on
any device for runs of the counter generator (the default); the device type the run trained on (--device) for
runs of the torch generator, whose CPU and CUDA streams differ."""


def _key(args) -> bytes | None:
    if args.key is not None:
        return args.key.encode("utf-8")
    if args.key_file is not None:
        with open(args.key_file, "rb") as f:
            return f.read()
    return None


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's output directory (or checkpoint, or ledger file)")
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--key", metavar="TEXT", help="the HMAC key (UTF-8 text): the ledger's HMAC is checked, and a "
                      "ledger without one refused")
    keys.add_argument("--key-file", metavar="FILE", help="the HMAC key, as the bytes of FILE")
    parser.add_argument("--max-bytes", type=int, default=None, metavar="N",
                        help="refuse a ledger larger than N bytes (default: 1 GiB)")


def build_parser() -> argparse.ArgumentParser:
    from .runs import DTYPES

    parser = argparse.ArgumentParser(prog="python -m zo_byzantine", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="{inspect,replay,plot}", required=True)

    inspect = commands.add_parser(
        "inspect", help="print a summary of the run",
        description="Print a summary table: rounds, skipped rounds and why, participants per round (first and last "
                    "few), honest loss at start/end/min, learning rate range, server settings, parameter count, "
                    "fingerprint, digest (checked) and, from trainer_state.json when present, the evaluation "
                    "accuracy (start: before training, best, last) and the uplink bytes per client against dense "
                    "FedAvg.")
    _common(inspect)
    inspect.add_argument("--rounds", action="store_true", help="also print one line per round: round, lr, honest "
                         "loss (null: not computed), participants count, directions, skipped reason")

    replay = commands.add_parser("replay", help="rebuild the trained weights from the starting model and the ledger",
                                 description=REPLAY_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(replay)
    replay.add_argument("--model", metavar="DIR", help="a save_pretrained folder: the architecture, and the starting "
                        "weights unless --start is given")
    replay.add_argument("--model-factory", metavar="MODULE:CALLABLE", help="a callable that builds the model, with "
                        "no arguments (instead of --model)")
    replay.add_argument("--start", metavar="FILE", help="the starting weights (.safetensors or a torch state dict)")
    replay.add_argument("--out", metavar="FILE.safetensors", required=True, help="where to write the trained "
                        "trainable weights")
    replay.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="the model's dtype (default auto: "
                        "the saved one for --model, the factory's for --model-factory)")
    replay.add_argument("--device", default="cpu", help="where to replay (default cpu); the run's device type "
                        "for torch-generator runs")

    plot = commands.add_parser(
        "plot", help="draw the run's curves to a PNG",
        description="Write a PNG with four panels, each explained in one line under its title: honest loss per "
                    "round (from the ledger), evaluation accuracy from the start (before training) on and aggregate "
                    "shift ||R - honest mean|| (from trainer_state.json's log_history), and cumulative uplink bytes "
                    "per participating client against dense FedAvg's. A panel whose series is missing says why.")
    _common(plot)
    plot.add_argument("--out", metavar="FILE.png", required=True, help="the PNG to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from . import runs

    limit = {} if args.max_bytes is None else {"max_bytes": args.max_bytes}
    try:
        key = _key(args)
        if args.command == "inspect":
            run = runs.load_run(args.run_dir, key=key, **limit)
            sys.stdout.write(runs.format_summary(runs.summarize(run)))
            if args.rounds:
                sys.stdout.write("\n" + runs.format_rounds(run))
        elif args.command == "replay":
            if not args.out.endswith(".safetensors"):
                parser.error("replay --out must name a .safetensors file")
            done = runs.replay_run(args.run_dir, args.out, model=args.model, start=args.start,
                                   factory=args.model_factory, key=key, dtype=args.dtype, device=args.device, **limit)
            print(f"replayed {done['rounds']} rounds ({done['skipped']} skipped): wrote {done['tensors']} tensors "
                  f"({done['parameters']} values) to {done['out']}")
        else:
            print(f"wrote {runs.plot_run(args.run_dir, args.out, key=key, **limit)}")
    except LedgerError as err:
        print(f"python -m zo_byzantine {args.command}: error: {err}", file=sys.stderr)
        return 1
    except (ValueError, OSError, ImportError) as err:
        print(f"python -m zo_byzantine {args.command}: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

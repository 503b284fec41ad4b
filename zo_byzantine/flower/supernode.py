"""Flower's SuperNode with its fixed waits shortened (opt-in):

    zo-byzantine-supernode --idle-poll 0.2 <flower-supernode's arguments>

Flower 1.42's SuperNode waits a fixed 3 s after asking the SuperLink for a message and finding none, and looks for
its ClientApp's reply (and the reply's contents) every 0.5 s (``flwr.supernode.start_client_internal``; no setting
changes either): a round of a
federation whose nodes answer in milliseconds takes 3-4.5 s however fast they are (benchmarks/README). This launcher
runs Flower's own ``flower-supernode`` with every wait of that loop capped at ``--idle-poll`` seconds, and nothing
else changed. The price: an idle SuperNode asks the SuperLink ``1 / idle-poll`` times a second (64 nodes at 0.2 s:
320 requests a second on the SuperLink).

How: the loop's module gets a ``time`` whose ``sleep`` is capped (the module's other uses of ``time`` are unchanged).
A Flower whose loop no longer lives there keeps its own waits: the launcher says so and runs it unchanged.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

logger = logging.getLogger(__name__)

LOOP = "flwr.supernode.start_client_internal"  # the SuperNode's pull/push loop in Flower 1.42


class CappedTime:
    """The ``time`` module with ``sleep(seconds)`` waiting at most ``cap`` seconds."""

    def __init__(self, cap: float):
        self.cap = cap

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, self.cap))

    def __getattr__(self, name: str):
        return getattr(time, name)


def cap_waits(cap: float) -> bool:
    """Cap the SuperNode loop's waits at ``cap`` seconds; returns whether Flower's loop was found where expected."""
    import importlib

    if not cap > 0:
        raise ValueError(f"--idle-poll {cap!r}: expected seconds > 0.")
    try:
        loop = importlib.import_module(LOOP)
    except ImportError:
        return False
    if getattr(loop, "time", None) is not time or not hasattr(loop, "start_client_internal"):
        return False
    loop.time = CappedTime(cap)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="zo-byzantine-supernode", description=__doc__.split("\n\n")[0],
                                     epilog="Every other argument goes to flower-supernode.", allow_abbrev=False)
    parser.add_argument("--idle-poll", type=float, default=0.2,
                        help="the most seconds the SuperNode waits before asking again (Flower: 3 s, 0.5 s)")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not args.idle_poll > 0:
        parser.error(f"--idle-poll {args.idle_poll}: expected seconds > 0")
    if not cap_waits(args.idle_poll):
        logging.basicConfig()
        logger.warning("Flower's SuperNode loop is not in %s here (another Flower version): its waits are unchanged.",
                       LOOP)
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *rest]
    flower_supernode()


if __name__ == "__main__":
    main()

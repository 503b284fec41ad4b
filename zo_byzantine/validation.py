"""Checks of single settings, shared by the arguments, rules, attacks and the optimizer: one message format,
``<name>=<value> must be ...``, naming the setting and what is accepted."""

from __future__ import annotations

import math


def is_integer(value) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """An int or float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_integer(name: str, value, low: int, high: int | None = None) -> int:
    """``value`` is an int (not a bool) in ``[low, high]``; returned."""
    if not is_integer(value) or value < low or (high is not None and value > high):
        accepted = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name}={value!r} must be an integer {accepted}.")
    return value


def check_real(name: str, value, low: float, high: float = math.inf, low_open: bool = False) -> float:
    """``value`` is a finite number in ``[low, high]`` (``(low, high]`` with ``low_open``); returned."""
    if not is_number(value) or not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        accepted = f"{'>' if low_open else '>='} {low:g}" if high == math.inf else \
            f"in {'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"{name}={value!r} must be a finite number {accepted}.")
    return value


def check_choice(name: str, value, accepted) -> None:
    """``value`` is one of ``accepted``."""
    if value not in accepted:
        raise ValueError(f"{name}={value!r} is not supported; accepted: {', '.join(map(str, accepted))}.")

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


def check_fraction(name: str, value, low_open: bool = False) -> float:
    """``value`` is a number in ``[0, 0.5)`` (``(0, 0.5)`` with ``low_open``): the share of vectors trimmed or ranked
    from each side; returned."""
    if not is_number(value) or not 0 <= value < 0.5 or (low_open and value == 0):
        raise ValueError(f"{name}={value!r} must be in {'(' if low_open else '['}0, 0.5) (a number: the share of "
                         "vectors from each side).")
    return value


def check_bool(name: str, value) -> bool:
    """``value`` is True or False (not a string such as ``"false"``, which ``bool`` would read as True); returned."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False.")
    return value

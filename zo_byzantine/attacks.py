"""Byzantine attacks on the projected vectors of a round (SPEC 3).

An attack is a callable ``attack(honest: Tensor[h, nu], own: Tensor[b, nu], rule) -> Tensor[b, nu]``:
it sees every honest vector of the round (omniscient), the vectors the Byzantine clients
computed honestly on their own data, and the server's rule; it returns what they send.
"""

from __future__ import annotations

import torch

from .registry import Registry

ATTACKS = Registry("attack")
register_attack = ATTACKS.register


@register_attack("none")
class NoAttack:
    """Byzantine clients follow the protocol: they send their own honest vectors."""

    def __init__(self, num_clients: int | None = None, num_byzantine: int | None = None):
        pass

    def __call__(self, honest: torch.Tensor, own: torch.Tensor, rule) -> torch.Tensor:
        return own


def build_attack(attack, num_clients: int, num_byzantine: int, **kwargs):
    """An attack object from a registered name (with ``kwargs``) or a callable passed through."""
    if callable(attack):
        return attack
    return ATTACKS.get(attack)(num_clients=num_clients, num_byzantine=num_byzantine, **kwargs)

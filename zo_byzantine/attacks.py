"""Byzantine attacks on the projected vectors of a round (SPEC 3).

An attack is a callable ``attack(honest: Tensor[h, nu], own: Tensor[b, nu], rule) -> Tensor[b, nu]``:
it sees every honest vector of the round (omniscient, colluding), the vectors the Byzantine
clients computed on their own data, and the server's rule; it returns what they send.
``hbar`` is the honest mean, ``sigma`` the honest coordinate-wise standard deviation (unbiased).
Attacks that draw random numbers are seeded by the round (``set_round``), so runs are reproducible.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .registry import Registry

ATTACKS = Registry("attack")
register_attack = ATTACKS.register

DEFAULT_OMEGA_GRID = tuple(float(x) for x in np.round(np.linspace(0.0, 10.0, 101), 10))


class Attack:
    """Base class: remembers the Byzantine count and the round key (for seeded attacks)."""

    flips_labels = False

    def __init__(self, num_clients: int = 1, num_byzantine: int = 0):
        self.num_clients, self.num_byzantine = num_clients, num_byzantine
        self.round_key: tuple[int, ...] = (0,)
        self.last_omega: float | None = None

    def set_round(self, key: tuple[int, ...]) -> None:
        self.round_key = tuple(key)

    def generator(self, salt: int, device) -> torch.Generator:
        seed = np.random.SeedSequence([salt, *self.round_key]).generate_state(1, np.uint64)[0]
        return torch.Generator(device=device).manual_seed(int(seed) >> 1)

    def repeat(self, vector: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """All Byzantine clients send the same ``vector``."""
        return vector.expand_as(own).clone()


@register_attack("none")
class NoAttack(Attack):
    """Byzantine clients follow the protocol: they send their own vectors."""

    def __call__(self, honest, own, rule):
        return own


class OmegaAttack(Attack):
    """``hbar + omega * a(honest)``, ``omega`` fixed or ``"auto"``: the candidate maximising
    ``||R(honest + byzantine) - hbar||`` for the server's rule (``target="pipeline"``, pre-aggregation
    included) or for the final rule alone (``target="rule"``: the attacker does not know about NNM).
    """

    def __init__(self, num_clients=1, num_byzantine=0, omega="auto", candidates=DEFAULT_OMEGA_GRID, target="pipeline"):
        super().__init__(num_clients, num_byzantine)
        if omega != "auto" and not isinstance(omega, int | float):
            raise ValueError(f"omega={omega!r}: a number or 'auto'.")
        if target not in ("pipeline", "rule"):
            raise ValueError(f"target={target!r} is not supported; accepted: pipeline, rule.")
        if not len(candidates):
            raise ValueError("candidates: the omega grid is empty.")
        self.omega, self.candidates, self.target = omega, [float(c) for c in candidates], target

    def direction(self, honest: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, honest, own, rule):
        hbar, a = honest.mean(dim=0), self.direction(honest)
        if self.omega != "auto":
            self.last_omega = float(self.omega)
            return self.repeat(hbar + self.omega * a, own)
        target = getattr(rule, "rule", rule) if self.target == "rule" else rule
        best, best_gap = self.candidates[0], -1.0
        for omega in self.candidates:
            sent = (hbar + omega * a).expand(len(own), -1)
            gap = float((target(torch.cat([honest, sent])) - hbar).norm())
            if gap > best_gap:
                best, best_gap = omega, gap
        self.last_omega = best
        return self.repeat(hbar + best * a, own)


@register_attack("alie")
class ALIE(OmegaAttack):
    """A little is enough (Baruch et al. 2019): ``hbar + omega * sigma``."""

    def direction(self, honest):
        return honest.std(dim=0) if len(honest) > 1 else torch.zeros_like(honest[0])


@register_attack("foe")
@register_attack("ipm")
class FOE(OmegaAttack):
    """Fall of empires / inner-product manipulation (Xie et al. 2020): ``hbar - omega hbar = (1 - omega) hbar``."""

    def direction(self, honest):
        return -honest.mean(dim=0)


@register_attack("sf")
class SignFlip(Attack):
    """Sign flipping: ``-hbar``."""

    def __call__(self, honest, own, rule):
        return self.repeat(-honest.mean(dim=0), own)


@register_attack("lf")
class LabelFlip(Attack):
    """Label flipping (data poisoning): the honest protocol on labels ``y -> C - 1 - y``.

    The trainer flips the Byzantine clients' labels before the forwards; ``num_classes`` is ``C``
    (defaults to the model's ``config.num_labels``).
    """

    flips_labels = True

    def __init__(self, num_clients=1, num_byzantine=0, num_classes: int | None = None):
        super().__init__(num_clients, num_byzantine)
        self.num_classes = num_classes

    def __call__(self, honest, own, rule):
        return own


class OrderStatisticAttack(Attack):
    """Per coordinate, the ``k``-th smallest or largest honest value, ``k = floor(beta n)`` (``beta`` = b/n)."""

    def __init__(self, num_clients=1, num_byzantine=0, beta: float | None = None):
        super().__init__(num_clients, num_byzantine)
        beta = num_byzantine / num_clients if beta is None else beta
        self.k = math.floor(beta * num_clients + 1e-9)
        honest = num_clients - num_byzantine
        if not 1 <= self.k <= honest:
            raise ValueError(
                f"{type(self).__name__}: k = floor(beta*n) = {self.k} must be in [1, n - b = {honest}] "
                f"(beta={beta}, n={num_clients}, b={num_byzantine})."
            )

    def kth(self, honest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ordered = honest.sort(dim=0).values
        return ordered[self.k - 1], ordered[len(honest) - self.k]  # k-th smallest, k-th largest


@register_attack("tma")
class TMA(OrderStatisticAttack):
    """Transformed trimmed-mean attack (paper 004 Alg. 4): per coordinate, if ``hbar > 0`` the k-th
    smallest honest value, else the k-th largest."""

    def __call__(self, honest, own, rule):
        small, large = self.kth(honest)
        return self.repeat(torch.where(honest.mean(dim=0) > 0, small, large), own)


@register_attack("always_small")
class AlwaysSmall(OrderStatisticAttack):
    """Paper 000: the k-th smallest honest value per coordinate."""

    def __call__(self, honest, own, rule):
        return self.repeat(self.kth(honest)[0], own)


@register_attack("always_large")
class AlwaysLarge(OrderStatisticAttack):
    """Paper 000: the k-th largest honest value per coordinate."""

    def __call__(self, honest, own, rule):
        return self.repeat(self.kth(honest)[1], own)


@register_attack("random_choice")
class RandomChoice(OrderStatisticAttack):
    """Paper 000: per coordinate, a seeded coin picks the k-th smallest or the k-th largest honest value."""

    def __call__(self, honest, own, rule):
        small, large = self.kth(honest)
        coin = torch.rand(small.shape, generator=self.generator(0xC014, "cpu")) < 0.5
        return self.repeat(torch.where(coin.to(small.device), small, large), own)


@register_attack("gaussian")
class Gaussian(Attack):
    """Each Byzantine client sends ``N(0, std^2)`` per coordinate (seeded by the round)."""

    def __init__(self, num_clients=1, num_byzantine=0, std: float = 1.0):
        super().__init__(num_clients, num_byzantine)
        if std < 0:
            raise ValueError(f"gaussian: std={std} must be >= 0.")
        self.std = std

    def __call__(self, honest, own, rule):
        noise = torch.randn(own.shape, generator=self.generator(0x6A55, "cpu"), dtype=torch.float64)
        return (noise * self.std).to(own)


@register_attack("nonfinite")
class NonFinite(Attack):
    """Sends ``value`` in every coordinate: ``"nan"``, ``"inf"`` or ``"-inf"`` (a robustness check)."""

    def __init__(self, num_clients=1, num_byzantine=0, value: str = "nan"):
        super().__init__(num_clients, num_byzantine)
        if value not in ("nan", "inf", "-inf"):
            raise ValueError(f"nonfinite: value={value!r} is not supported; accepted: nan, inf, -inf.")
        self.value = float(value)

    def __call__(self, honest, own, rule):
        return torch.full_like(own, self.value)


def build_attack(attack, num_clients: int, num_byzantine: int, **kwargs):
    """An attack object from a registered name (with ``kwargs``) or an object passed through."""
    if callable(attack) and not isinstance(attack, str):
        return attack
    return ATTACKS.get(attack)(num_clients=num_clients, num_byzantine=num_byzantine, **kwargs)

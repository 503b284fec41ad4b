"""Byzantine attacks on the vectors of a round (SPEC 3).

An attack is an :class:`Attack`: ``attack(honest: Tensor[h, nu], own: Tensor[k, nu], rule, ctx) ->
AttackOutput(vectors: Tensor[k, nu], diagnostics)``. It sees every honest vector of the round
(omniscient, colluding: a simulation-side adversary), the vectors the ``k`` Byzantine clients computed on
their own data, the server's pipeline ``rule`` (a :class:`~zo_byzantine.aggregators.Chain`) and the
round context; it returns what they send. ``hbar`` is the honest mean, ``sigma`` the honest
coordinate-wise standard deviation (unbiased). Random attacks draw from ``ctx.generator(domain)``, so
runs are reproducible.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import seeds
from .context import AttackOutput, RoundContext
from .ordering import sort_values
from .registry import Registry
from .trusted import merging_cosine, reference_clients
from .validation import check_fraction, check_integer, check_real, is_number

ATTACKS = Registry("attack")
register_attack = ATTACKS.register

DEFAULT_OMEGA_GRID = tuple(float(x) for x in np.round(np.linspace(0.0, 10.0, 101), 10))


class Attack:
    """Base class. ``flips_labels``: a data-poisoning attack that the clients' forwards apply (label
    flipping); ``num_classes`` then names the classes it flips between (``None``: the model's)."""

    flips_labels = False
    num_classes: int | None = None

    def __call__(self, honest: torch.Tensor, own: torch.Tensor, rule, ctx: RoundContext) -> AttackOutput:
        raise NotImplementedError

    @staticmethod
    def repeat(vector: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """All Byzantine clients send the same ``vector``."""
        return vector.expand_as(own).clone()


@register_attack("none")
class NoAttack(Attack):
    """Byzantine clients follow the protocol: they send their own vectors."""

    def __call__(self, honest, own, rule, ctx):
        return AttackOutput(own, {})


def aggregate_candidates(rule, honest: torch.Tensor, candidates: torch.Tensor, k: int, ctx: RoundContext):
    """``rule``'s output for each candidate ``c`` (``C x d``) when all ``k`` Byzantine clients send ``c`` beside
    the honest vectors (``C x d``): what an omniscient attacker's search evaluates
    (``rule.aggregate_repeated``). The sets are ordered honest first (the context's Byzantine mask does not
    describe them, so it is dropped; the rows' client ids follow them, honest first, and a stateful rule's state is
    kept: the attacker knows it)."""
    return rule.aggregate_repeated(honest, candidates, k, search_context(ctx, len(honest), k))


def search_context(ctx: RoundContext, h: int, k: int) -> RoundContext:
    """The context of the sets an attacker evaluates: ``h`` honest rows then ``k`` Byzantine ones, no mask; the client
    ids reordered the same way (where the round's are known) and the rule's state as the round's."""
    clients = None
    if ctx.clients is not None and ctx.byzantine is not None and len(ctx.clients) == h + k:
        mask = ctx.byzantine.tolist()
        clients = tuple(c for c, b in zip(ctx.clients, mask, strict=True) if not b) + \
            tuple(c for c, b in zip(ctx.clients, mask, strict=True) if b)
    return RoundContext(ctx.key, h + k, ctx.num_byzantine, clients=clients, state=ctx.state)


class OmegaAttack(Attack):
    """``hbar + omega * a(honest)``, ``omega`` fixed or ``"auto"``: the candidate maximising
    ``||R(honest + byzantine) - hbar||`` for the server's pipeline (``target="pipeline"``, pre-aggregation
    included) or for its final rule alone (``target="rule"``: the attacker does not know about NNM).
    Diagnostics: ``omega``, the value sent.
    """

    def __init__(self, omega="auto", candidates=DEFAULT_OMEGA_GRID, target="pipeline"):
        if omega != "auto" and not (is_number(omega) and math.isfinite(omega)):
            raise ValueError(f"omega={omega!r}: a finite number or 'auto'.")
        if target not in ("pipeline", "rule"):
            raise ValueError(f"target={target!r} is not supported; accepted: pipeline, rule.")
        if not isinstance(candidates, list | tuple) or not len(candidates):
            raise ValueError(f"candidates={candidates!r}: a non-empty list of numbers (the omega grid).")
        if not all(is_number(c) and math.isfinite(c) for c in candidates):
            raise ValueError(f"candidates={candidates!r}: every omega must be a finite number.")
        self.omega, self.candidates, self.target = omega, [float(c) for c in candidates], target

    def direction(self, honest: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, honest, own, rule, ctx):
        hbar, a = honest.mean(dim=0), self.direction(honest)
        if self.omega != "auto":
            return AttackOutput(self.repeat(hbar + self.omega * a, own), {"omega": float(self.omega)})
        target = rule.rule if self.target == "rule" else rule
        omegas = torch.tensor(self.candidates, dtype=honest.dtype, device=honest.device)
        outputs = aggregate_candidates(target, honest, hbar + omegas[:, None] * a, len(own), ctx)
        gaps = (outputs - hbar).norm(dim=1).nan_to_num(nan=-math.inf)
        best = self.candidates[int(gaps.argmax())]  # the first of equal maxima, as a loop would keep
        return AttackOutput(self.repeat(hbar + best * a, own), {"omega": best})


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

    def __call__(self, honest, own, rule, ctx):
        return AttackOutput(self.repeat(-honest.mean(dim=0), own), {})


@register_attack("lf")
class LabelFlip(Attack):
    """Label flipping (data poisoning): the honest protocol on labels ``y -> C - 1 - y``.

    The clients' forwards flip the Byzantine clients' labels; ``num_classes`` is ``C`` (defaults to the
    model's ``config.num_labels``).
    """

    flips_labels = True

    def __init__(self, num_classes: int | None = None):
        self.num_classes = None if num_classes is None else check_integer("lf: num_classes", num_classes, 2)

    def __call__(self, honest, own, rule, ctx):
        return AttackOutput(own, {})


class OrderStatisticAttack(Attack):
    """Per coordinate, the ``k``-th smallest or largest value: ``k`` = the number of Byzantine vectors of the round
    (``k = floor(beta m)`` when ``beta`` is set), at most the number of values ranked. ``ranked="honest"`` ranks the
    honest vectors (paper 000 Alg. 3 as written); ``"all"`` ranks every client's true vector, the Byzantine
    clients' own included (what they would have sent honestly). With ``"honest"``, once ``k`` passes half the
    ``h`` honest values (``floor(beta m) > h / 2``, e.g. ``alpha = beta > 1/3``) the k-th smallest lies above the
    honest median: the attack then pushes the trimmed mean toward the middle."""

    def __init__(self, beta: float | None = None, ranked: str = "honest"):
        if beta is not None:
            check_fraction(f"{type(self).__name__}: beta", beta, low_open=True)
        if ranked not in ("honest", "all"):
            raise ValueError(f"{type(self).__name__}: ranked={ranked!r} is not supported; accepted: honest, all.")
        self.beta, self.ranked = beta, ranked

    def kth(self, honest: torch.Tensor, own: torch.Tensor, ctx: RoundContext) -> tuple[torch.Tensor, torch.Tensor]:
        values = torch.cat([honest, own]) if self.ranked == "all" else honest
        k = len(own) if self.beta is None else math.floor(self.beta * ctx.num_vectors + 1e-9)
        k = min(max(k, 1), len(values))
        ordered = sort_values(values, 0)
        return ordered[k - 1], ordered[len(values) - k]  # k-th smallest, k-th largest


@register_attack("tma")
class TMA(OrderStatisticAttack):
    """Transformed trimmed-mean attack (paper 004 Alg. 4): per coordinate, if ``hbar > 0`` the k-th
    smallest honest value, else the k-th largest."""

    def __call__(self, honest, own, rule, ctx):
        small, large = self.kth(honest, own, ctx)
        ranked = torch.cat([honest, own]) if self.ranked == "all" else honest  # paper 000 Alg. 3: the mean of all m
        return AttackOutput(self.repeat(torch.where(ranked.mean(dim=0) > 0, small, large), own), {})


@register_attack("always_small")
class AlwaysSmall(OrderStatisticAttack):
    """Paper 000: the k-th smallest honest value per coordinate."""

    def __call__(self, honest, own, rule, ctx):
        return AttackOutput(self.repeat(self.kth(honest, own, ctx)[0], own), {})


@register_attack("always_large")
class AlwaysLarge(OrderStatisticAttack):
    """Paper 000: the k-th largest honest value per coordinate."""

    def __call__(self, honest, own, rule, ctx):
        return AttackOutput(self.repeat(self.kth(honest, own, ctx)[1], own), {})


@register_attack("random_choice")
class RandomChoice(OrderStatisticAttack):
    """Paper 000: per coordinate, a seeded coin picks the k-th smallest or the k-th largest honest value."""

    def __call__(self, honest, own, rule, ctx):
        small, large = self.kth(honest, own, ctx)
        coin = torch.rand(small.shape, generator=ctx.generator(seeds.RANDOM_CHOICE)) < 0.5
        return AttackOutput(self.repeat(torch.where(coin.to(small.device), small, large), own), {})


@register_attack("fang_trim")
class FangTrim(Attack):
    """Full-knowledge trim attack (Fang et al. 2020, "Local model poisoning attacks to Byzantine-robust federated
    learning", Sec. 4.2), written for gradient-like vectors (the server steps against the aggregate).

    Per coordinate ``j``, with ``s_j = sign(hbar_j)`` (the direction the honest vectors would move the model
    against) and ``lo_j``, ``hi_j`` the smallest and largest honest values, every Byzantine client draws its own
    value uniformly beyond the honest range, on the side opposite to ``s_j``, within a factor ``b``:

        s_j > 0:  [lo_j / b, lo_j] if lo_j > 0, else [b lo_j, lo_j]
        s_j <= 0: [hi_j, b hi_j]   if hi_j > 0, else [hi_j / b, hi_j]

    ``b = 2`` as in the paper. The draws come from the round's seeded generator (reproducible). It acts on any
    vector length: R^nu (the projected scalars) and R^d (first-order gradients, FedZO's reconstructions) alike.
    """

    def __init__(self, b: float = 2.0):
        self.b = check_real("fang_trim: b", b, 1.0)

    def __call__(self, honest, own, rule, ctx):
        lo, hi = honest.min(dim=0).values, honest.max(dim=0).values
        push_down = honest.mean(dim=0) > 0
        edge = torch.where(push_down, lo, hi)
        # the interval [edge, far] (or [far, edge]) beyond the honest range; far = edge * b or edge / b
        outward = torch.where(push_down, edge <= 0, edge > 0)
        far = torch.where(outward, edge * self.b, edge / self.b)
        u = torch.rand(own.shape, generator=ctx.generator(seeds.FANG_TRIM), dtype=torch.float64).to(honest)
        return AttackOutput(edge + u * (far - edge), {})


@register_attack("fang_krum")
class FangKrum(Attack):
    """Full-knowledge Krum attack (Fang et al. 2020, Sec. 4.1), written for gradient-like vectors.

    All ``c`` Byzantine clients send ``-lambda sign(hbar)`` (the model pushed against the honest direction). The
    attacker starts from the paper's upper bound on ``lambda`` for ``m`` vectors of dimension ``d``,

        lambda_0 = min_{i in H} sum_{l in G_i} ||g_l - g_i|| / ((m - 2c - 1) sqrt(d)) + max_{i in H} ||g_i|| / sqrt(d),

    ``G_i`` the ``m - c - 2`` honest vectors nearest to ``g_i``, and halves ``lambda`` until the server's pipeline
    selects the crafted vector (its output equals it: Krum picks it) or ``lambda`` falls below ``threshold``, then
    sends the last value tried. All halvings are evaluated at once (``aggregate_candidates``); the largest that is
    selected is the one the paper's loop stops at. Diagnostics: ``lambda`` (logged as ``attack_lambda``,
    averaged) and ``crafted_selected`` (1 or 0; summed in the logs).
    """

    def __init__(self, threshold: float = 1e-5):
        self.threshold = check_real("fang_krum: threshold", threshold, 0.0, low_open=True)

    @staticmethod
    def upper_bound(honest: torch.Tensor, c: int) -> float:
        """``lambda_0`` of the class docstring (``m = len(honest) + c``); 0 when the honest vectors are all 0."""
        h, d = honest.shape
        m = h + c
        dist = torch.cdist(honest[None].double(), honest[None].double())[0]
        dist.fill_diagonal_(math.inf)
        near = max(min(m - c - 2, h - 1), 0)
        spread = sort_values(dist, 1)[:, :near].sum(dim=1).min().item() if near else 0.0
        return spread / (max(m - 2 * c - 1, 1) * math.sqrt(d)) + honest.double().norm(dim=1).max().item() / math.sqrt(d)

    def __call__(self, honest, own, rule, ctx):
        direction = -torch.sign(honest.mean(dim=0))
        lam = self.upper_bound(honest, len(own))
        lambdas = [lam]
        while lambdas[-1] / 2 >= self.threshold:
            lambdas.append(lambdas[-1] / 2)
        crafted = torch.tensor(lambdas, dtype=honest.dtype, device=honest.device)[:, None] * direction
        outputs = aggregate_candidates(rule, honest, crafted, len(own), ctx)
        chosen = (outputs == crafted).all(dim=1).nonzero()
        index = int(chosen[0]) if len(chosen) else len(lambdas) - 1
        diagnostics = {"lambda": lambdas[index], "crafted_selected": int(len(chosen) > 0)}
        return AttackOutput(self.repeat(crafted[index], own), diagnostics)


@register_attack("adaptive")
class Adaptive(Attack):
    """An adaptive attacker against a rule that keeps per-client state (``history.py``; issue 46): omniscient, it
    knows the honest vectors, the rule and the rule's state before the round (``ctx.state``), and evaluates what the
    server would compute, and every client's score after the round, for each choice it has. Its choices: mimic
    (send an honest vector ``v_j``, the one that leaves its clients' lowest score highest: honest in sign, scale and
    noise) or strike with ``v_j + omega a``, ``a = -hbar`` (FOE-like: pulls the aggregate against the honest mean)
    or the honest ``sigma`` (ALIE-like), ``omega`` from ``candidates`` (``strike`` names which), and against a rule
    with a trusted reference (``fltrust``, or ``history`` around it) the cone strike: ``||hbar|| (e u + sqrt(1 - e^2)
    w)``, ``u`` the unit trusted report ``g0 / ||g0||`` and ``w`` the unit part of ``-hbar`` orthogonal to it, ``e``
    from ``cones`` (``omega`` reports ``e``): the row FLTrust still weights, by ``e``, pushing against the honest mean
    as far as it can (``strike="both"`` adds it where the rule has trusted clients; ``"cone"`` alone). Against a rule
    that merges near-identical rows (``fltrust``'s ``merge_cosine``) its rows are made distinct (:meth:`spread`), the
    mimicked honest vector included (the spread rows then share a weight with that honest row, two by two, instead of
    all ``k + 1`` together), and every choice is evaluated as sent.

    ``mode="greedy"`` strikes every round with the most damaging choice that keeps every Byzantine client's score at
    least ``margin`` above the rule's exclusion floor after the round (kept: its strike counts), else mimics;
    ``mode="full"`` (mimic then strike) strikes only with the most damaging choice of all, when that keeps the scores
    above the floor, and mimics otherwise (the scores recover). Damage: ``||R - hbar||`` (``objective="norm"``, as
    ALIE and FOE choose omega) or the progress taken away along the honest mean, ``<hbar - R, hbar> / ||hbar||``
    (``objective="against"``). Against a stateless pipeline it strikes every round (no score to keep).
    Diagnostics: ``struck`` (1 in a round it strikes; summed in the logs) and ``omega``.
    """

    def __init__(self, strike: str = "both", candidates=tuple(float(w) for w in range(0, 11)), margin: float = 0.05,
                 mode: str = "greedy", objective: str = "norm", cones=(0.02, 0.05, 0.1, 0.2, 0.3, 0.5)):
        choices = (("strike", strike, ("foe", "alie", "cone", "both")), ("mode", mode, ("greedy", "full")),
                   ("objective", objective, ("norm", "against")))
        for name, value, accepted in choices:
            if value not in accepted:
                raise ValueError(f"adaptive: {name}={value!r} is not supported; accepted: {', '.join(accepted)}.")
        if not isinstance(candidates, list | tuple) or not candidates or \
                not all(is_number(c) and math.isfinite(c) for c in candidates):
            raise ValueError(f"adaptive: candidates={candidates!r}: a non-empty list of finite numbers (omega).")
        self.strike, self.mode, self.objective = strike, mode, objective
        self.candidates = [float(c) for c in candidates]
        if not isinstance(cones, list | tuple) or not cones or not all(is_number(e) and 0 < e <= 1 for e in cones):
            raise ValueError(f"adaptive: cones={cones!r}: a non-empty list of cosines in (0, 1] (the cone strike's).")
        self.cones = [float(e) for e in cones]
        self.margin = check_real("adaptive: margin", margin, 0.0)

    @staticmethod
    def spread(row: torch.Tensor, k: int, cosine: float | None, ctx) -> torch.Tensor:
        """``k`` Byzantine rows carrying ``row``: identical, or against a rule that merges rows at cosine ``>= cosine``
        to each other (``fltrust``'s ``merge_cosine``), ``row + s e_j`` with ``e_j`` orthonormal, orthogonal to
        ``row`` (seeded by the round) and ``s = ||row|| sqrt(1 / c - 1)``, ``c = cosine - max(1e-3 (1 - cosine),
        1e-5)``: pairwise cosines ``c``, just below the merge, each row keeping ``sqrt(c)`` of its norm along ``row``
        (where ``nu < k + 1`` the ``e_j`` are orthogonal to ``row`` only, and their pairwise cosines are not
        bounded)."""
        if cosine is None or k < 2 or not float(row.norm()) > 0:
            return row.expand(k, -1).clone()
        noise = torch.randn(k, len(row), generator=ctx.generator(seeds.SPREAD), dtype=torch.float64).to(row.device)
        basis = torch.linalg.qr(torch.cat([row.double()[:, None], noise.T], dim=1))[0]
        if basis.shape[1] >= k + 1:
            directions = basis[:, 1 : k + 1].T
        else:
            unit = basis[:, 0]
            directions = noise - (noise @ unit)[:, None] * unit
            directions = directions / directions.norm(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
        c = cosine - max(1e-3 * (1 - cosine), 1e-5)
        size = float(row.double().norm()) * math.sqrt(1 / c - 1)
        return (row.double() + size * directions).to(row)

    def cone_strikes(self, honest: torch.Tensor, clients, trusted) -> torch.Tensor:
        """The cone strikes (``len(cones) x d``) against the trusted report of the honest rows of ``clients`` in
        ``trusted``; none (``0 x d``) where no such row is known or ``g0``, ``hbar`` leave no direction."""
        empty = honest.new_zeros(0, honest.shape[1])
        if self.strike not in ("cone", "both") or not trusted or clients is None:
            return empty
        mine = [i for i, c in enumerate(clients[: len(honest)]) if int(c) in trusted]
        if not mine:
            return empty
        hbar, g0 = honest.mean(dim=0), honest[mine].mean(dim=0)
        size = hbar.norm()
        u = g0 / g0.norm().clamp_min(torch.finfo(g0.dtype).tiny)
        w = -hbar - (-hbar @ u) * u
        if not (float(w.norm()) > 0 and float(g0.norm()) > 0 and math.isfinite(float(size))):
            return empty
        w = w / w.norm()
        e = torch.tensor(self.cones, dtype=honest.dtype, device=honest.device)[:, None]
        return size * (e * u + (1 - e * e).sqrt() * w)

    def strikes(self, honest: torch.Tensor, base: torch.Tensor, clients=None, trusted=()
                ) -> tuple[torch.Tensor, list[float]]:
        """``base + omega a`` for every strike direction and omega, with their omegas, then the cone strikes (their
        cosines as omegas)."""
        hbar = honest.mean(dim=0)
        directions = []
        if self.strike in ("foe", "both"):
            directions.append(-hbar)
        if self.strike in ("alie", "both"):
            directions.append(honest.std(dim=0) if len(honest) > 1 else torch.zeros_like(hbar))
        rows, omegas = [], []
        for a in directions:
            rows += [base + w * a for w in self.candidates]
            omegas += self.candidates
        cones = self.cone_strikes(honest, clients, trusted)
        rows += list(cones)
        omegas += self.cones[: len(cones)]
        if not rows:
            return honest.new_zeros(0, honest.shape[1]), []
        return torch.stack(rows), omegas

    def damage(self, outputs: torch.Tensor, hbar: torch.Tensor) -> torch.Tensor:
        if self.objective == "norm":
            return (outputs - hbar).norm(dim=1).nan_to_num(nan=-math.inf)
        size = hbar.norm().clamp_min(torch.finfo(hbar.dtype).tiny)
        return (((hbar - outputs) @ hbar) / size).nan_to_num(nan=-math.inf)

    def __call__(self, honest, own, rule, ctx):
        hbar, k = honest.mean(dim=0), len(own)
        history = getattr(rule, "rule", None)
        search = search_context(ctx, len(honest), k)
        trusted = reference_clients(history)
        merge = merging_cosine(rule)

        def send(row):
            return self.spread(row, k, merge, ctx).to(own)

        def as_sent(row):
            """The rule's call on the honest rows and the Byzantine rows as they would be sent."""
            return rule(torch.cat([honest, send(row)]), search)

        if not hasattr(history, "fold") or search.clients is None:  # nothing to keep: the most damaging strike
            rows, omegas = self.strikes(honest, hbar, search.clients, trusted)
            if not len(rows):
                return AttackOutput(self.repeat(hbar, own), {"struck": 0, "omega": 0.0})
            if merge is None:
                outputs = aggregate_candidates(rule, honest, rows, k, ctx)
            else:  # distinct rows: each candidate evaluated as sent
                outputs = torch.stack([as_sent(row).value for row in rows])
            best = int(self.damage(outputs, hbar).argmax())
            return AttackOutput(send(rows[best]), {"omega": omegas[best], "struck": 1})
        mine = search.clients[len(honest):]

        def outcome(row):
            """The aggregate, and the margin of the Byzantine clients' lowest score above the floor after the round."""
            out = as_sent(row)
            scores = [out.update.state[c][0] for c in search.clients]
            return out.value, min(out.update.state[c][0] for c in mine) - history.floor(scores)

        mimics = [outcome(v)[1] for v in honest]
        base = honest[max(range(len(honest)), key=lambda j: (mimics[j], -j))]
        rows, omegas = self.strikes(honest, base, search.clients, trusted)
        if not len(rows):
            return AttackOutput(send(base), {"struck": 0, "omega": 0.0})
        results = [outcome(row) for row in rows]
        damage = self.damage(torch.stack([value for value, _ in results]), hbar)
        allowed = torch.tensor([room >= self.margin for _, room in results])
        if self.mode == "full":
            strongest = int(damage.argmax())
            choice = strongest if bool(allowed[strongest]) else None
        else:
            choice = int(damage.masked_fill(~allowed, -math.inf).argmax()) if bool(allowed.any()) else None
        if choice is None:
            return AttackOutput(send(base), {"struck": 0, "omega": 0.0})
        return AttackOutput(send(rows[choice]), {"struck": 1, "omega": omegas[choice]})


@register_attack("gaussian")
class Gaussian(Attack):
    """Each Byzantine client sends ``N(0, std^2)`` per coordinate (seeded by the round)."""

    def __init__(self, std: float = 1.0):
        self.std = check_real("gaussian: std", std, 0.0)

    def __call__(self, honest, own, rule, ctx):
        noise = torch.randn(own.shape, generator=ctx.generator(seeds.GAUSSIAN), dtype=torch.float64)
        return AttackOutput((noise * self.std).to(own), {})


@register_attack("nonfinite")
class NonFinite(Attack):
    """Sends ``value`` in every coordinate: ``"nan"``, ``"inf"`` or ``"-inf"`` (a robustness check)."""

    def __init__(self, value: str = "nan"):
        if value not in ("nan", "inf", "-inf"):
            raise ValueError(f"nonfinite: value={value!r} is not supported; accepted: nan, inf, -inf.")
        self.value = float(value)

    def __call__(self, honest, own, rule, ctx):
        return AttackOutput(torch.full_like(own, self.value), {})


def build_attack(attack, **kwargs) -> Attack:
    """An attack object from a registered name (with ``kwargs``), or an :class:`Attack` passed through."""
    if isinstance(attack, Attack):
        return attack
    if not isinstance(attack, str):
        raise TypeError(f"attack: {attack!r} is neither a registered name nor an Attack (zo_byzantine.Attack).")
    return ATTACKS.build(attack, "attack_kwargs", **kwargs)


def model_num_labels(model) -> int | None:
    """The model's number of classes (``num_labels`` or ``config.num_labels``), if it says."""
    return getattr(model, "num_labels", None) or getattr(getattr(model, "config", None), "num_labels", None)


def flip_labels(inputs: dict, rows: torch.Tensor, num_classes: int | None) -> dict:
    """Label flipping on the Byzantine clients' ``rows``: ``y -> C - 1 - y`` (ignored labels kept)."""
    labels = inputs.get("labels")
    if labels is None or labels.dim() != 1:
        raise ValueError("attack='lf' needs class labels of shape [batch] in the inputs.")
    if not num_classes:
        raise ValueError("attack='lf' needs the number of classes: set attack_kwargs={'num_classes': C}.")
    return {**inputs, "labels": torch.where(rows & (labels >= 0), num_classes - 1 - labels, labels)}

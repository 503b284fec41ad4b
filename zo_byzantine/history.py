"""A rule that uses the clients' history (issue 46): a per-client agreement score, kept across rounds.

One round's values cannot tell FOE (``(1 - omega) hbar``, inside the honest range) from an honest vector; many
rounds can. A zeroth-order report has a known meaning: coordinate ``r`` is a noisy projection of the client's
gradient on the shared ``z_r``, so an honest vector agrees with the round's consensus along the consensus and sits
at the honest distance from it, round after round, while FOE points against it every round and ALIE sits a fixed
``omega sigma`` away. :class:`History` scores each client's agreement with a robust reference every round, folds it
into a decayed per-client score (keyed by client id, so it survives client sampling), and leaves out of the round
the clients whose score fell below a threshold, at most ``f`` of them, before a robust rule sized for ``f``.

The state is part of the round's contract (``context.py``): read from ``ctx.state``, returned in
``Aggregation.update`` with the round's agreements (one number per row), which the ledger records
(``rounds[t].history``) and :meth:`History.fold` turns back into the state, bitwise: a resumed run and a replay
rebuild it from the ledger alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .aggregators import Rule, _row_norms, build_aggregator, coordinate_median, register_aggregator
from .context import Aggregation, RoundContext, SizingError, StateUpdate, recorded_settings
from .ordering import sort_values
from .validation import check_real

MAD_TO_STD = 1.4826  # the median absolute deviation of a normal sample, in standard deviations


def describe(chain) -> str:
    """``"nnm+cclip(iters=3,tau=1.0)"``: each step and the rule with its scalar settings."""
    parts = []
    for part in [*chain.steps, chain.rule]:
        settings = {k: v for k, v in recorded_settings(part).items()
                    if k != "name" and (v is None or isinstance(v, bool | int | float | str))}
        parts.append(part.name + ("(" + ",".join(f"{k}={v}" for k, v in settings.items()) + ")" if settings else ""))
    return "+".join(parts)


def robust_z(x: torch.Tensor) -> torch.Tensor:
    """``(x - median x) / (1.4826 MAD x)`` (float64); zeros where the MAD is 0 or not finite (no spread: no
    evidence either way)."""
    x = x.double()
    med = coordinate_median(x[:, None])[0]
    scale = MAD_TO_STD * coordinate_median((x - med).abs()[:, None])[0]
    if not (math.isfinite(float(scale)) and float(scale) > 0):
        return torch.zeros_like(x)
    return (x - med) / scale


def agreements(vectors: torch.Tensor, f: int, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's agreement with the round, in ``[-cap, 0]``, and the reference it is measured against.

    Reference ``c``: the coordinate-wise mean trimmed by ``f`` per side (in the honest range). Per row, the
    component along ``c`` (``p_i = <v_i, c> / ||c||^2``; honest rows near 1, FOE's ``1 - omega`` far below) and
    the distance ``d_i = ||v_i - c||`` (ALIE's ``omega ||sigma||`` beyond the honest spread; FOE's vector, collinear
    with ``c``, too close) and the sign balance ``b_i = mean_r sign(v_i[r] - c[r])`` (an honest residual is the
    projection of the client's gradient's difference and noise on symmetric ``z_r``: ``b_i`` near 0, ``~1 /
    sqrt(nu)``; ALIE's ``omega sigma``, positive in every coordinate, has ``b = 1``), each as a robust z score over the
    round's rows; ``a_i = clamp(min(z_p, -|z_d|, -|z_b|, 0), -cap, 0)``. Capped at 0 above: agreeing more than the
    median earns nothing (an attacker cannot bank credit by copying the reference)."""
    found, ref = statistics(vectors, f)
    z = {name: robust_z(value) for name, value in found.items()}
    worst = torch.minimum(torch.minimum(z["along"], -z["distance"].abs()), -z["balance"].abs())
    return worst.clamp(-cap, 0.0).nan_to_num(nan=-cap), ref


def statistics(vectors: torch.Tensor, f: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per row, before any scoring (float64): ``along`` ``p_i``, ``distance`` ``d_i`` and ``balance`` ``b_i`` of
    :func:`agreements`, and the reference ``c`` they are measured against."""
    v = vectors.double()
    m = len(v)
    k = min(f, (m - 1) // 2)
    ref = sort_values(v, 0)[k : m - k].mean(dim=0)
    size = float(ref @ ref)
    along = v @ ref / size if size > 0 and math.isfinite(size) else torch.zeros(m, dtype=torch.float64)
    residual = v - ref
    return {"along": along, "distance": _row_norms(residual), "balance": torch.sign(residual).mean(dim=1)}, ref


@register_aggregator("history")
class History(Rule):
    """Agreement history (issue 46): per client id ``c`` a decayed score ``s_c``, updated in the rounds it takes part
    in, ``s_c <- decay s_c + (1 - decay) a_c`` (:func:`agreements`, ``a_c`` in ``[-cap, 0]``; an unseen client starts
    at 0, a client not sampled keeps its score), and the round's output ``rule(V without E)``, ``E`` the rows whose
    updated score is below the floor ``F = median(s) - max(threshold, spread MAD(s))`` (the round's rows' scores), the
    lowest first, at most ``e_max`` of them (``e_max <= f``, the most that leave the inner rule sized for ``f`` on
    ``m - e`` vectors: ``2f < m - e`` for cwtm). The inner pipeline is ``base_pre_aggregators`` then ``base`` (with
    ``base_kwargs``), always sized for the full ``f``: an exclusion is never trusted to have removed a Byzantine
    client. The rows of the inner rule's trusted clients (``base="fltrust"``: ``trusted.py``) are never left out:
    they are its reference. Diagnostics: ``excluded``, and in simulation ``byzantine_excluded``, ``honest_excluded``
    (false exclusions).

    Per-round bound: at most ``f`` of the ``m - e`` rows kept are Byzantine whichever rows are left out, so the
    inner rule's bound holds on them: for cwtm the output lies in the kept honest vectors' per-coordinate range, within
    ``||w_H'|| <= sqrt(nu) R`` of their mean ``hbar'`` (``H'`` the kept honest rows, ``R`` the honest radius), and
    ``||hbar' - hbar|| <= e R / (h - e)`` (``h >= m - f`` honest rows, ``e <= f`` of them possibly left out), so
    ``||out - hbar|| <= sqrt(nu) R + f R / (m - 2f)`` whatever the state: the history cannot let a Byzantine client
    move the aggregate further than the stateless rule on ``m - f`` rows would (a state forged to frame honest clients
    costs efficiency, not the bound).

    Window bound: with ``2f < m`` the median score lies in the honest scores' range, so ``F >= -(S_H + threshold)``
    (``spread = 0``), ``S_H`` the lowest honest score's depth (honest scores are averages of ``a <= 0``: their
    level is set by the honest spread alone, not by the attacker). A Byzantine client kept in a round thus has ``s >=
    -(S_H + threshold)`` after it. Its score over ``W`` rounds of participation is ``s_W = decay^W s_0 + (1 - decay)
    sum_k decay^(W - k) a_k`` with every ``a_k <= 0``: ``j`` rounds with ``a_k <= -q`` inside a window of ``W <= 1 /
    (1 - decay)`` rounds give ``s_W <= -(1 - decay) q j / e`` (``decay^(W - k) >= 1/e``), so it is kept through at most
    ``j <= e (S_H + threshold) / ((1 - decay) q)`` such rounds per window. ``q`` is measured in the honest spread
    (robust z scores): an attacker whose component along the consensus is ``q`` honest deviations below the median
    (FOE: ``1 - omega`` against the honest ``~1``), whose distance to it is ``q`` deviations off the median (ALIE's
    ``omega ||sigma||``; FOE's vector, collinear with the consensus, is too close), or whose residual's signs are
    ``q`` deviations off balance (ALIE's), is out after a few such rounds;
    with the defaults (``decay 0.95``, ``threshold 1``, ``cap 8``) and honest scores near ``-1`` (``E min(z_p,
    -|z_d|, -|z_b|, 0)`` for honest rows), full strikes (``a = -8``) from ``-1`` leave ``-1.35, -1.68, -2.00,
    -2.30``: out at the fourth consecutive strike (floor ``-2``), and one more strike per ``~7`` rounds of mimicry.

    What it does not guarantee: (1) a patient attacker's budget: a client that mimics an honest one (``a`` near the
    honest level) and strikes in the rounds its score allows keeps a rate of about ``(S_H + threshold) / cap``
    full strikes per ``1 / (1 - decay)`` rounds, and one that stays at ``a ~ -(threshold + S_H)`` every round is
    never left out: per round it moves the aggregate like an honest client ``threshold`` honest spreads off the
    median, up to the per-round bound (``attack="adaptive"`` plays this, measured in ``experiments/foe_rules``);
    (2) nothing along directions that keep the three statistics at the honest median's (e.g. an offset of random
    signs and honest size); (3) an honest client whose data
    differ (non-iid) may score low and be left out: each costs the round one honest vector, at most ``e_max``
    (counted as ``honest_excluded``); with very heterogeneous clients (MNIST, Dirichlet 0.1) the honest spread is
    wide and the rule catches little (measured); (4) a Byzantine client new to the run starts at 0 like any other;
    (5) one scalar a report (``nu = 1``): ``b_i`` is ``+-1`` for every row and ``p_i``, ``d_i`` reward a value near
    the consensus, so attackers that sit there score above honest clients (SmolLM2, SST-2: ALIE, SF and FOE all did,
    none was left out; ``experiments/smollm2/reports.py``); the arguments warn.

    >>> ctx = RoundContext(key=(0, 0, 1), num_vectors=5, num_byzantine=1, clients=(0, 1, 2, 3, 4), state={})
    >>> out = History(base="median")(torch.tensor([[1.0, 1], [1.1, 0.9], [0.9, 1.1], [1.0, 1.2], [-9, -9]]), ctx)
    >>> out.value, out.update.record[4] < 0, out.update.state[4][1:]
    (tensor([1., 1.]), True, (1, 0))
    """

    name = "history"

    def __init__(self, base: str = "cwtm", base_pre_aggregators: Sequence = (), base_kwargs: dict | None = None,
                 decay: float = 0.95, threshold: float = 1.0, spread: float = 0.0, cap: float = 8.0):
        if isinstance(base, str) and base == "history":
            raise ValueError("history: base='history' would nest the history; name a stateless rule.")
        self.inner = build_aggregator(base, base_pre_aggregators, **(base_kwargs or {}))
        self.decay = check_real("history: decay", decay, 0.0, 1.0)
        if self.decay == 1.0:
            raise ValueError("history: decay=1.0 would never update a score; accepted: [0, 1).")
        self.threshold = check_real("history: threshold", threshold, 0.0, low_open=True)
        self.cap = check_real("history: cap", cap, 0.0, low_open=True)
        self.spread = check_real("history: spread", spread, 0.0)
        self.name = f"history({self.inner.name})"
        self.protected = tuple(getattr(self.inner.rule, "trusted", ()))  # fltrust's reference rows: never left out
        self.pipeline = describe(self.inner)  # the inner pipeline's settings, as the ledger's protocol records them

    def check(self, m, f):
        super().check(m, f)
        self.inner.check(m, f)

    def most_excluded(self, m: int, f: int) -> int:
        """``e_max``: the most rows left out with the inner rule still sized for ``f`` on the rest."""
        for e in range(f, 0, -1):
            try:
                self.inner.check(m - e, f)
                return e
            except SizingError:
                continue
        return 0

    def floor(self, scores: Sequence[float]) -> float:
        """The score below which a row may be left out: the median of the round's rows' scores less the larger of
        ``threshold`` and ``spread`` robust deviations of the scores (relative: the honest scores' level drifts with
        the task's signal-to-noise ratio, and their spread grows with the clients' heterogeneity)."""
        z = torch.tensor(scores, dtype=torch.float64)
        med = float(coordinate_median(z[:, None])[0])
        mad = MAD_TO_STD * float(coordinate_median((z - med).abs()[:, None])[0])
        return med - max(self.threshold, self.spread * mad)

    def fold(self, state: dict | None, clients: Sequence[int], record: Sequence[float], round_index: int) -> dict:
        """The state after a call from the state before, the rows' clients and their agreements (the ledger's
        record): per client ``(score, rounds seen, last round)``. Plain Python floats: the same bits from the
        ledger as in the run."""
        new = dict(state or {})
        for client, a in zip(clients, record, strict=True):
            score, seen, _ = new.get(int(client), (0.0, 0, -1))
            new[int(client)] = (self.decay * score + (1.0 - self.decay) * float(a), seen + 1, int(round_index))
        return new

    def aggregate(self, vectors, ctx):
        if ctx.clients is None or len(ctx.clients) != len(vectors):
            raise ValueError(f"{self.name}: needs the client id of every row (ctx.clients); got {ctx.clients!r}.")
        m, f = len(vectors), ctx.num_byzantine
        record = [float(a) for a in agreements(vectors, f, self.cap)[0].tolist()]
        state = self.fold(ctx.state, ctx.clients, record, ctx.key[1] if len(ctx.key) > 1 else 0)
        scores = [state[int(c)][0] for c in ctx.clients]
        order = sorted((i for i in range(m) if int(ctx.clients[i]) not in self.protected), key=lambda i: (scores[i], i))
        floor = self.floor(scores)
        out = {i for i in order[: self.most_excluded(m, f)] if scores[i] < floor}
        kept = [i for i in range(m) if i not in out]
        mask = ctx.byzantine
        inner_ctx = RoundContext(ctx.key, len(kept), f, None if mask is None else mask[kept],
                                 tuple(ctx.clients[i] for i in kept))
        value, found, _ = self.inner(vectors[kept], inner_ctx)
        diagnostics = {**found, "excluded": len(out)}
        if mask is not None:
            byz = int(sum(bool(mask[i]) for i in out))
            diagnostics.update(byzantine_excluded=byz, honest_excluded=len(out) - byz)
        return Aggregation(value, diagnostics, StateUpdate(state, record))

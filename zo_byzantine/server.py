"""The server role (SPEC 1.4, 1.6, 2, 8): plans rounds, checks reports, aggregates them robustly, and
emits the downlink (which is also the ledger entry).

    plan(t, participants, local_lr) -> Plan
    aggregate(plan, reports, lr, byzantine=None) -> Downlink:
        reports checked (sender sampled, one each, round t, exact shape); the round's loss: the honest reports'
        mean (simulation), or without a mask the mean trimmed by f per side (deployment) -> per uplink u:
        vectors V (m x nu) -> [simulation: Byzantine rows <- attack(honest, own, rule, ctx)]
        -> non-finite values sanitised -> R_u = rule(V, ctx) sized for the m vectors received (a stateful rule gets
           the run's state in ctx.state, keyed by client id, and returns the next; kept only if the round is applied,
           its record in the downlink and the ledger)
        -> update sum_u sum_r R_u[r] z_{u,r} (shared), sum_i (|D_i|/sum|D|) v_i[r] z_{i,r} (per client),
           or the R^d aggregate (parameter space, first-order)

Nothing here knows the Trainer: the simulation and a deployment drive the same object.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from .aggregators import Chain, Mean
from .attacks import Attack
from .context import RoundContext, SizingError
from .messages import Downlink, Plan, Report
from .optim import update_fits
from .perturbation import ParameterTable
from .trusted import reference_clients
from .validation import is_integer

logger = logging.getLogger(__name__)

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
BYTES_PER_SCALAR = 4  # scalars travel as float32


@dataclass(frozen=True)
class Settings:
    """The protocol's settings (from ``ZOByzantineArguments``)."""

    zo_seed: int
    estimator: str = "two_point"
    mu: float = 1e-3
    num_perturbations: int = 1
    local_steps: int = 1
    local_update: str = "unbiased"
    directions: str = "shared"
    aggregation_space: str = "projection"
    num_byzantine: int = 0  # f: the Byzantine vectors a round's rule must tolerate (at most the vectors received)


class SkipRound(Exception):
    """The round cannot be applied safely; the reason goes to the downlink, the logs and the ledger."""


def sanitize(vectors: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Non-finite entries become the most extreme value (nan, +inf -> +max; -inf -> -max), counted (SPEC 1.6)."""
    bad = ~torch.isfinite(vectors)
    if not bad.any():
        return vectors, 0
    cleaned = torch.nan_to_num(vectors, nan=FLOAT32_MAX, posinf=FLOAT32_MAX, neginf=-FLOAT32_MAX)
    return cleaned, int(bad.sum())


def trimmed(values: torch.Tensor, f: int) -> torch.Tensor:
    """``values`` without their ``f`` smallest and ``f`` largest (fewer if needed to keep one); ``f = 0``: as is."""
    k = min(f, (len(values) - 1) // 2)
    return values if k <= 0 else values.sort().values[k : len(values) - k]


def reconstruct(table: ParameterTable, seeds: list[int], vectors: torch.Tensor) -> torch.Tensor:
    """Rows ``sum_r v_i[r] z_r`` in R^d (m x d): the FedZO view of the clients' estimates."""
    parts = []
    for j, p in table:
        z = table.directions.draw_many(p, seeds, j).flatten(1).double()
        parts.append(vectors @ z.cpu())  # the reports' scalars are on the CPU; the model may not be
    return torch.cat(parts, dim=1)


def unflatten(table: ParameterTable, flat: torch.Tensor) -> list[torch.Tensor]:
    out, start = [], 0
    for _, p in table:
        out.append(flat[start : start + p.numel()].view_as(p).to(p.dtype))
        start += p.numel()
    return out


def robust_aggregate(vectors: torch.Tensor, ctx: RoundContext, rule: Chain, attack: Attack | None = None):
    """One uplink's robust aggregate: ``V -> [simulation: Byzantine rows <- attack(honest, own, rule, ctx)] ->
    sanitise -> R = rule(V, ctx)``. Returns ``(R, V as sent and sanitised, diagnostics, non-finite values,
    the rule's state update or None)``; in simulation the diagnostics add ``aggregate_shift`` ``||R - hbar||`` and
    ``honest_mean_norm`` ``||hbar||``. Raises :class:`SkipRound` where the round cannot be applied."""
    diagnostics = {}
    honest = vectors if ctx.byzantine is None else vectors[~ctx.byzantine]
    if ctx.byzantine is not None:
        if not len(honest):
            raise SkipRound("no honest report (every sampled client is Byzantine)")
        if not torch.isfinite(honest).all():
            raise SkipRound("non-finite honest estimate")
        diagnostics["byzantine_over_bound"] = int(int(ctx.byzantine.sum()) > ctx.num_byzantine)
        if attack is not None and ctx.byzantine.any():
            own = vectors[ctx.byzantine]
            sent, found = attack(honest, own, rule, ctx)
            if tuple(sent.shape) != tuple(own.shape):
                raise ValueError(f"The attack returned {tuple(sent.shape)} for {tuple(own.shape)} vectors.")
            vectors = vectors.clone()
            vectors[ctx.byzantine] = sent.to(vectors)
            diagnostics.update(found)
    vectors, nonfinite = sanitize(vectors)
    value, found, update = rule(vectors, ctx)
    if not torch.isfinite(value).all():
        raise SkipRound("non-finite aggregate")
    diagnostics.update(found)
    if ctx.byzantine is not None:
        hbar = honest.mean(dim=0)
        diagnostics["aggregate_shift"] = float((value - hbar).norm())  # ||R - hbar||
        diagnostics["honest_mean_norm"] = float(hbar.norm())
    return value, vectors, diagnostics, nonfinite, update


class Server:
    """The server role.

    Args:
        settings: the protocol's settings.
        rule: the pipeline (pre-aggregation steps and rule), a :class:`Chain`.
        table: the model's trainable parameters (their shapes and dtypes; parameter-space aggregation
            reconstructs the clients' R^d estimates from it).
        attack: simulation only: the omniscient adversary that replaces the Byzantine rows.
    """

    def __init__(self, settings: Settings, rule: Chain, table: ParameterTable, attack: Attack | None = None):
        if settings.directions == "per_client" and (rule.steps or not isinstance(rule.rule, Mean)):
            raise ValueError(
                f"directions='per_client' (FedES) applies each client's scalars in its own basis, weighted by data "
                f"size: a robust pipeline ({rule.name!r}) would not be applied; accepted: aggregator='mean' with no "
                "pre_aggregators."
            )
        self.settings, self.rule, self.table, self.attack = settings, rule, table, attack
        self.history: dict = {}  # a stateful rule's state (keyed by client id), after the last applied round

    def restore_history(self, rounds: list[dict]) -> dict:
        """Rebuild a stateful rule's state from a ledger's rounds (their ``history`` records, folded in order by the
        rule): what a resumed run or a replay does, bitwise. Rounds without a record leave it as it is."""
        state: dict = {}
        fold = getattr(self.rule.rule, "fold", None)
        for entry in rounds:
            for record in entry.get("history") or []:
                if fold is None:
                    raise ValueError(f"The ledger records a rule's history but the rule {self.rule.name!r} keeps none.")
                state = fold(state, entry["participants"], record, entry["round"])
        self.history = state
        return state

    def plan(self, round_index: int, participants, local_lr: float) -> Plan:
        s, t = self.settings, int(round_index)
        steps = []
        for step in range(s.local_steps + 1):  # step 0: the compressed basis Z_t
            key = 1 if s.local_update == "biased" and step > 0 else step
            steps.append(tuple((s.zo_seed, t, key, r) for r in range(s.num_perturbations)))
        return Plan(
            round=t,
            participants=tuple(int(c) for c in participants),
            seed_tuples=tuple(steps),
            per_client=s.directions == "per_client",
            estimator=s.estimator,
            mu=s.mu,
            num_perturbations=s.num_perturbations,
            local_steps=s.local_steps,
            local_lr=float(local_lr),
            local_update=s.local_update,
            generator=self.table.directions.identity(),
        )

    def width(self) -> int:
        """Scalars per uplink vector: ``nu``, or ``d`` for the first-order baseline."""
        return self.table.numel if self.settings.estimator == "first_order" else self.settings.num_perturbations

    def scalars_per_client(self, num_participants: int) -> tuple[int, int]:
        """Scalars one client sends and receives per round (SPEC 1.5, 2, 4)."""
        s, d = self.settings, self.table.numel
        if s.estimator == "first_order":
            return d, d
        up = s.num_perturbations * (s.local_steps if s.local_update == "unbiased" else 1)
        if s.aggregation_space == "parameter":
            return up, d
        if s.directions == "per_client":
            return up, num_participants * up
        return up, up

    def communication(self, num_participants: int, rounds: int) -> dict[str, float]:
        """Scalars and bytes per client per round, cumulative bytes, beside dense FedAvg (d each way)."""
        d, (up, down), m = self.table.numel, self.scalars_per_client(num_participants), num_participants
        return {
            "uplink_scalars_per_client": up,
            "uplink_bytes_per_client": up * BYTES_PER_SCALAR,
            "downlink_scalars_per_client": down,
            "downlink_bytes_per_client": down * BYTES_PER_SCALAR,
            "fedavg_bytes_per_client": d * BYTES_PER_SCALAR,
            "uplink_bytes_total": rounds * m * up * BYTES_PER_SCALAR,
            "downlink_bytes_total": rounds * m * down * BYTES_PER_SCALAR,
            "fedavg_uplink_bytes_total": rounds * m * d * BYTES_PER_SCALAR,
        }

    def accept(self, plan: Plan, reports: list[Report]) -> list[Report]:
        """The reports that may enter the round, in participant order: from a sampled client, one each, for
        round ``t``, of the exact shape. Others are dropped and logged."""
        shape = (len(plan.uplink_steps), self.width())
        order = {c: i for i, c in enumerate(plan.participants)}
        kept: dict[int, Report] = {}
        for report in reports:
            problem = None
            if not isinstance(report, Report):
                problem = f"not a Report ({type(report).__name__})"
            elif not is_integer(report.client) or not is_integer(report.round):
                problem = f"client {report.client!r} and round {report.round!r} must be integers"
            elif not is_integer(report.num_examples) or report.num_examples < 1:
                problem = f"num_examples={report.num_examples!r} must be an integer >= 1"
            elif isinstance(report.loss, bool) or not isinstance(report.loss, int | float):
                problem = f"loss {report.loss!r} is not a number"
            elif (not torch.is_tensor(report.scalars) or report.scalars.layout != torch.strided
                  or report.scalars.device.type != "cpu" or not report.scalars.dtype.is_floating_point):
                problem = "scalars must be a dense real floating-point tensor on the CPU"
            elif report.client not in order:
                problem = f"client {report.client!r} was not sampled"
            elif report.client in kept:
                problem = f"a second report from client {report.client}"
            elif report.round != plan.round:
                problem = f"round {report.round!r} instead of {plan.round}"
            elif not torch.is_tensor(report.scalars) or tuple(report.scalars.shape) != shape:
                problem = f"scalars of shape {getattr(report.scalars, 'shape', None)} instead of {shape}"
            if problem:
                logger.warning("Round %d: report rejected: %s.", plan.round, problem)
                continue
            kept[report.client] = report
        accepted = sorted(kept.values(), key=lambda r: order[r.client])
        return [Report(r.round, r.client, r.scalars.double(), float(r.loss), r.num_examples) for r in accepted]

    def aggregate(self, plan: Plan, reports: list[Report], lr: float, byzantine=None) -> Downlink:
        """The round's downlink from the reports. ``byzantine`` (simulation only): mask over
        ``plan.participants`` of the clients the attack controls. A round that cannot be applied safely comes
        back with ``skipped`` set."""
        accepted = self.accept(plan, reports)
        downlink = Downlink(plan.round, float(lr), participants=[r.client for r in accepted], received=len(accepted),
                            rejected=len(reports) - len(accepted))
        if byzantine is not None:
            byzantine = torch.as_tensor(byzantine, dtype=torch.bool).cpu()
            if len(byzantine) != len(plan.participants):
                raise ValueError(f"byzantine: a mask of {len(byzantine)} for {len(plan.participants)} participants.")
            position = {c: i for i, c in enumerate(plan.participants)}
            byzantine = byzantine[[position[r.client] for r in accepted]]
        state = self.history
        try:
            state = self._aggregate(plan, accepted, byzantine, downlink)
            self._check_overflow(downlink)
        except SkipRound as skip:
            downlink.skipped = str(skip)
            downlink.seed_tuples, downlink.coefficients, downlink.dense = [], [], None
            downlink.history = None  # a skipped round leaves the state as it was
        else:
            self.history = state
        return downlink

    def _aggregate(self, plan: Plan, reports: list[Report], byzantine, downlink: Downlink) -> None:
        s = self.settings
        if not reports:
            raise SkipRound("no valid report")
        losses = torch.tensor([r.loss for r in reports], dtype=torch.float64)
        honest_losses = losses if byzantine is None else losses[~byzantine]
        if byzantine is not None and not torch.isfinite(honest_losses).all():
            raise SkipRound("non-finite honest loss")
        finite = honest_losses[torch.isfinite(honest_losses)]
        if byzantine is None:  # who is Byzantine is unknown (a deployment): any f losses may be forged
            finite = trimmed(finite, s.num_byzantine)
        downlink.loss = float(finite.mean()) if len(finite) else math.nan
        m, f = len(reports), min(s.num_byzantine, len(reports))
        try:
            self.rule.check(m, f)
        except SizingError as err:
            raise SkipRound(f"{m} reports are too few for the rule: {err}") from err
        dense_space = plan.first_order or s.aggregation_space == "parameter"
        stacked = torch.stack([r.scalars for r in reports])  # m x uplinks x width
        dense, state, clients = None, self.history, tuple(r.client for r in reports)
        reference = reference_clients(self.rule.rule)
        if reference and not set(reference) & set(clients):
            raise SkipRound(f"no report of a trusted client {list(reference)}: the rule's reference is missing")
        for u, step in enumerate(plan.uplink_steps):
            ctx = RoundContext((s.zo_seed, plan.round, u + 1), m, f, byzantine, clients, state)
            vectors = stacked[:, u]
            if dense_space and not plan.first_order:  # FedZO: the rule runs on the reconstructed R^d estimates
                vectors = reconstruct(self.table, plan.seeds(step, reports[0].client), vectors)
            value, sent, diagnostics, nonfinite, update = robust_aggregate(vectors, ctx, self.rule, self.attack)
            if update is not None:  # a stateful rule: its state goes on to the next uplink, its record to the ledger
                state = update.state
                downlink.history = [*(downlink.history or []), update.record]
            downlink.nonfinite += nonfinite
            downlink.diagnostics.append(diagnostics)
            if dense_space:
                dense = value if dense is None else dense + value
                continue
            if plan.per_client:  # FedES: bases differ by client; data-size-weighted sum of the scalars sent
                sizes = torch.tensor([r.num_examples for r in reports], dtype=torch.float64)
                weights = (sizes / sizes.sum()).tolist()
                for i, report in enumerate(reports):
                    downlink.seed_tuples += plan.keys(step, report.client)
                    downlink.coefficients += [weights[i] * v for v in sent[i].tolist()]
            else:
                downlink.aggregates.append(value.tolist())  # R of this uplink, applied on the shared directions
                downlink.seed_tuples += plan.keys(step, reports[0].client)
                downlink.coefficients += value.tolist()
        if dense is not None:
            downlink.dense = unflatten(self.table, dense)
        return state

    def _check_overflow(self, downlink: Downlink) -> None:
        """Guard (``optim.update_fits``): the update and each of its terms stay far inside the weights' dtype.
        No honest update is that large; applying one (a non-robust rule fed extreme values) would push the
        weights towards inf, or, with lr = 0, give 0 * inf = NaN."""
        if downlink.skipped:
            return
        if downlink.dense is not None:
            size = max(float(g.abs().max()) for g in downlink.dense)
        else:
            size = sum(abs(c) for c in downlink.coefficients)
        if not update_fits(self.table.params, downlink.lr, size):
            raise SkipRound("aggregate overflows the parameters' dtype")

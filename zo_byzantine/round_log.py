"""What the rounds log: a window of rounds between two ``Trainer`` logs and the run's honest loss.

The honest loss of a log is the mean over the window's rounds that computed one (a skipped round with a loss
counts, one without does not: never a 0 in the mean); ``train_loss`` is the same mean over the whole run, NaN
when no round computed one.
"""

from __future__ import annotations

import math

from .directions import COUNTER
from .messages import Downlink

WINDOW_KEYS = ("rounds", "skipped_rounds", "nonfinite_values", "rejected_reports", "loss_sum", "loss_count")
PER_APPLIED_ROUND = ("aggregate_shift", "honest_mean_norm")  # logged as means over applied rounds
# averaged over the uplinks that reported them; other diagnostics summed
LOG_NAMES = {"omega": "attack_omega", "lambda": "attack_lambda"}


def mean_loss(totals: dict) -> float:
    """``loss_sum / loss_count``, NaN when no round computed a loss."""
    return totals["loss_sum"] / totals["loss_count"] if totals["loss_count"] else math.nan


class RoundLog:
    """Rounds since the last log (:meth:`record`, :meth:`window_logs`) and the run's loss totals."""

    def __init__(self) -> None:
        self.window = self._empty_window()
        self.run_loss = {"loss_sum": 0.0, "loss_count": 0}
        self.drawn_at_log = COUNTER.drawn

    @staticmethod
    def _empty_window() -> dict:
        return {**dict.fromkeys(WINDOW_KEYS, 0), "diagnostics": {}}

    def restart(self, done_losses: list[float] = ()) -> None:
        """The run's totals from the losses of the rounds already done (a resumed run's ledger), as uninterrupted."""
        self.run_loss = {"loss_sum": float(sum(done_losses)), "loss_count": len(done_losses)}

    def run_mean(self) -> float:
        """``train_loss``: the mean honest loss of the run's rounds."""
        return mean_loss(self.run_loss)

    def record(self, downlink: Downlink) -> None:
        """Add a round to the window: skipped, non-finite values, rejected reports, the diagnostics of the rule and
        the attack (sums and counts per name)."""
        window = self.window
        window["rounds"] += 1
        window["skipped_rounds"] += int(bool(downlink.skipped))
        window["nonfinite_values"] += downlink.nonfinite
        window["rejected_reports"] += downlink.rejected
        if math.isfinite(downlink.loss):  # the honest loss, also of a skipped round when it was computed
            for totals in (window, self.run_loss):
                totals["loss_sum"] += downlink.loss
                totals["loss_count"] += 1
        if downlink.skipped:
            return
        for found in downlink.diagnostics:
            for name, value in found.items():
                total = window["diagnostics"].setdefault(name, [0.0, 0])
                total[0] += value
                total[1] += 1

    def window_logs(self, communication: dict, numel: int) -> dict:
        """The window's logs (honest ``loss``, ``communication``, counts, diagnostics, generator passes per round in
        units of ``numel``), and a new window; ``{}`` when no round ran since the last log."""
        window = self.window
        if not window["rounds"]:
            return {}
        logs = {"loss": mean_loss(window), **communication}  # the Trainer's would count skipped rounds as 0
        applied = max(window["rounds"] - window["skipped_rounds"], 1)
        for name in ("skipped_rounds", "nonfinite_values", "rejected_reports"):
            logs[name] = int(window[name])
        for name, (total, count) in window["diagnostics"].items():
            if name in PER_APPLIED_ROUND:
                logs[name] = total / applied  # mean per applied round of the sum over its uplinks
            elif name in LOG_NAMES:
                logs[LOG_NAMES[name]] = total / count
            else:
                logs[name] = int(total) if float(total).is_integer() else total
        # Gaussian numbers drawn since the last log (perturbed forwards and updates), in units of d
        logs["generator_passes_per_round"] = (COUNTER.drawn - self.drawn_at_log) / (window["rounds"] * numel)
        self.window = self._empty_window()
        self.drawn_at_log = COUNTER.drawn
        return logs

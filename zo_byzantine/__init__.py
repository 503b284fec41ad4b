"""zo_byzantine: federated zeroth-order fine-tuning that survives Byzantine clients.

The names below are imported on first use (PEP 562): ``import zo_byzantine`` costs nothing beyond Python's, and a
process that needs part of the library (a Flower ClientApp: the ledger, the perturbation, the client role) does not
import transformers' Trainer, peft or datasets.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the same names, imported eagerly, for type checkers and IDEs
    from .aggregators import (
        AGGREGATORS,
        PRE_AGGREGATORS,
        Chain,
        PreAggregator,
        Rule,
        build_aggregator,
        register_aggregator,
        register_pre_aggregator,
    )
    from .arguments import ZOByzantineArguments
    from .attacks import ATTACKS, Attack, build_attack, register_attack
    from .client import client_reports
    from .context import Aggregation, AttackOutput, RoundContext, SizingError
    from .directions import CounterDirections, Directions, TorchDirections, build_directions
    from .estimators import ESTIMATORS
    from .federation import Federation, partition_dataset
    from .ledger import Ledger, LedgerError, replay
    from .messages import Downlink, Plan, Report
    from .optim import ZOOptimizer
    from .perturbation import ParameterTable, apply_update, direction_seed, perturbed
    from .server import Server, Settings
    from .trainer import ZOByzantineTrainer

__version__ = "0.2.0"

_EXPORTS = {  # name -> the module of this package that defines it
    **dict.fromkeys(("AGGREGATORS", "PRE_AGGREGATORS", "Chain", "PreAggregator", "Rule", "build_aggregator",
                     "register_aggregator", "register_pre_aggregator"), "aggregators"),
    **dict.fromkeys(("ZOByzantineArguments",), "arguments"),
    **dict.fromkeys(("ATTACKS", "Attack", "build_attack", "register_attack"), "attacks"),
    **dict.fromkeys(("client_reports",), "client"),
    **dict.fromkeys(("Aggregation", "AttackOutput", "RoundContext", "SizingError"), "context"),
    **dict.fromkeys(("CounterDirections", "Directions", "TorchDirections", "build_directions"), "directions"),
    **dict.fromkeys(("ESTIMATORS",), "estimators"),
    **dict.fromkeys(("Federation", "partition_dataset"), "federation"),
    **dict.fromkeys(("Ledger", "LedgerError", "replay"), "ledger"),
    **dict.fromkeys(("Downlink", "Plan", "Report"), "messages"),
    **dict.fromkeys(("ZOOptimizer",), "optim"),
    **dict.fromkeys(("ParameterTable", "apply_update", "direction_seed", "perturbed"), "perturbation"),
    **dict.fromkeys(("Server", "Settings"), "server"),
    **dict.fromkeys(("ZOByzantineTrainer",), "trainer"),
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later look-ups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "AGGREGATORS",
    "ATTACKS",
    "ESTIMATORS",
    "PRE_AGGREGATORS",
    "Aggregation",
    "Attack",
    "AttackOutput",
    "Chain",
    "CounterDirections",
    "Directions",
    "Downlink",
    "Federation",
    "Ledger",
    "LedgerError",
    "ParameterTable",
    "Plan",
    "PreAggregator",
    "Report",
    "RoundContext",
    "Rule",
    "Server",
    "Settings",
    "SizingError",
    "TorchDirections",
    "ZOByzantineArguments",
    "ZOByzantineTrainer",
    "ZOOptimizer",
    "apply_update",
    "build_aggregator",
    "build_attack",
    "build_directions",
    "client_reports",
    "direction_seed",
    "partition_dataset",
    "perturbed",
    "register_aggregator",
    "register_attack",
    "register_pre_aggregator",
    "replay",
]

"""zo_byzantine: federated zeroth-order fine-tuning that survives Byzantine clients."""

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

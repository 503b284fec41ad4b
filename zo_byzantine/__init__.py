"""zo_byzantine: federated zeroth-order fine-tuning that survives Byzantine clients."""

from .aggregators import AGGREGATORS, build_aggregator, register_aggregator
from .arguments import ZOByzantineArguments
from .attacks import ATTACKS, build_attack, register_attack
from .estimators import ESTIMATORS
from .federation import Federation, partition_dataset
from .ledger import Ledger, LedgerError, replay
from .optim import ZOOptimizer
from .perturbation import ParameterTable, apply_update, direction_seed, perturbed
from .trainer import ZOByzantineTrainer

__version__ = "0.1.0"

__all__ = [
    "AGGREGATORS",
    "ATTACKS",
    "ESTIMATORS",
    "Federation",
    "Ledger",
    "LedgerError",
    "ParameterTable",
    "ZOByzantineArguments",
    "ZOByzantineTrainer",
    "ZOOptimizer",
    "apply_update",
    "build_aggregator",
    "build_attack",
    "direction_seed",
    "partition_dataset",
    "perturbed",
    "register_aggregator",
    "register_attack",
    "replay",
]
